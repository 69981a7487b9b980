"""Which processes are engines: the presets against command lines as the
engines are really started, the GPU-offload condition, and the engines:
config section with all its errors reported at once."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import REPO
from mig_exporter.config.checks import ConfigError
from mig_exporter.config.engines import parse_engines
from mig_exporter.config.file import load_config
from mig_exporter.engines.rules import (
    DEFAULT_SETTINGS,
    PRESETS,
    GpuOffload,
    layers_ask_for_gpu,
)
from mig_exporter.host.procfs import ProcEntry


def proc(cmdline: str, comm: str | None = None, exe: str | None = None, state: str = "S") -> ProcEntry:
    args = tuple(cmdline.split(" ")) if cmdline else ()
    name = comm if comm is not None else (args[0].rsplit("/", 1)[-1][:15] if args else "")
    return ProcEntry(pid=100, ppid=1, comm=name, state=state, exe=exe, cmdline=args, thread_ids=(100,))


PY = "/usr/bin/python3"

# (what, process, engine the presets name or None)
CASES = [
    # llama.cpp: by name or executable, asking for GPU offload.
    ("llama-server -ngl 99", proc("/usr/local/bin/llama-server -m /models/q.gguf -ngl 99 --port 8080"), "llama.cpp"),
    ("--n-gpu-layers=all", proc("llama-server -m q.gguf --n-gpu-layers=all"), "llama.cpp"),
    ("--gpu-layers auto", proc("llama-server -m q.gguf --gpu-layers auto"), "llama.cpp"),
    ("-ngl -1", proc("llama-server -m q.gguf -ngl -1"), "llama.cpp"),
    ("no flag: current llama.cpp offloads by default", proc("llama-server -m q.gguf"), "llama.cpp"),
    ("-ngl 0 runs on the CPU by choice", proc("llama-server -m q.gguf -ngl 0"), None),
    ("the last flag wins", proc("llama-server -ngl 99 -m q.gguf --n-gpu-layers 0"), None),
    ("llama-cli", proc("./build/bin/llama-cli -m q.gguf -ngl 33 -p hi"), "llama.cpp"),
    ("renamed argv[0], real executable", proc("server -m q.gguf -ngl 99", comm="server",
                                              exe="/opt/llama.cpp/build/bin/llama-server"), "llama.cpp"),
    ("a shell that mentions llama-server", proc("bash -c llama-server -ngl 99", comm="bash", exe="/usr/bin/bash"),
     None),
    ("a zombie still matches by name (the attribution skips it)", proc("", comm="llama-server", state="Z"),
     "llama.cpp"),
    # Ollama: the runners, never `ollama serve`.
    ("ollama runner", proc("/usr/local/bin/ollama runner --model /root/.ollama/models/blobs/sha256-6a0746a1ec1a "
                           "--ctx-size 8192 --batch-size 512 --n-gpu-layers 33 --threads 8 --port 41235"), "ollama"),
    ("ollama runner, new engine", proc("/usr/bin/ollama runner --ollama-engine --model /m --port 40001"), "ollama"),
    ("ollama_llama_server", proc("/tmp/ollama1/runners/cuda_v12/ollama_llama_server --model /m --port 3",
                                 exe="/tmp/ollama1/runners/cuda_v12/ollama_llama_server"), "ollama"),
    ("ollama_llama_server, exe unreadable", proc("x --model /m", comm="ollama_llama_se"), "ollama"),
    ("ollama serve", proc("/usr/local/bin/ollama serve"), None),
    # vLLM.
    ("vllm serve", proc(f"{PY} /usr/local/bin/vllm serve Qwen/Qwen2.5-1.5B-Instruct --port 8000", comm="vllm"),
     "vllm"),
    ("vllm serve from a venv", proc("/srv/.venv/bin/python3.12 /srv/.venv/bin/vllm serve m", comm="vllm"), "vllm"),
    ("python -m vllm.entrypoints", proc(f"{PY} -m vllm.entrypoints.openai.api_server --model m"), "vllm"),
    ("python -u -m vllm.entrypoints", proc("python -u -m vllm.entrypoints.api_server --model m"), "vllm"),
    ("pgrep -f 'vllm serve'", proc("pgrep -f vllm serve"), None),
    ("a script with vllm serve in its arguments", proc(f"{PY} bench.py --backend vllm serve"), None),
    ("a vLLM worker on its own", proc("VLLM::EngineCore", comm="VLLM::EngineCor"), None),
    # SGLang.
    ("python -m sglang.launch_server", proc(f"{PY} -m sglang.launch_server --model-path m --port 30000"), "sglang"),
    ("sglang serve", proc(f"{PY} /usr/local/bin/sglang serve --model-path m", comm="sglang"), "sglang"),
    ("python -m sglang.bench_serving", proc(f"{PY} -m sglang.bench_serving --backend sglang"), None),
    # TGI.
    ("text-generation-launcher", proc("text-generation-launcher --model-id m --port 80", comm="text-generation",
                                      exe="/usr/local/bin/text-generation-launcher"), "tgi"),
    ("text-generation-server serve", proc("/opt/conda/bin/python3.11 /opt/conda/bin/text-generation-server serve m "
                                          "--uds-path /tmp/text-generation-server", comm="text-generation"), "tgi"),
    ("text-generation-server download-weights", proc("/opt/conda/bin/python3.11 /opt/conda/bin/"
                                                     "text-generation-server download-weights m",
                                                     comm="text-generation"), None),
    # Triton.
    ("tritonserver", proc("/opt/tritonserver/bin/tritonserver --model-repository=/models",
                          exe="/opt/tritonserver/bin/tritonserver"), "triton"),
    # TensorRT-LLM.
    ("trtllm-serve", proc(f"{PY} /usr/local/bin/trtllm-serve serve m --backend pytorch", comm="trtllm-serve"),
     "tensorrt-llm"),
    ("python -m tensorrt_llm.commands.serve", proc(f"{PY} -m tensorrt_llm.commands.serve m"), "tensorrt-llm"),
    ("trtllm-build is not a server", proc(f"{PY} /usr/local/bin/trtllm-build --checkpoint_dir c", comm="trtllm-build"),
     None),
    # Not engines.
    ("python training", proc(f"{PY} train.py --epochs 3", comm="python3"), None),
    ("an editor on an engine's config", proc("vim /etc/llama-server.conf", comm="vim"), None),
]


@pytest.mark.parametrize("what,process,engine", CASES, ids=[c[0] for c in CASES])
def test_presets(what, process, engine):
    assert DEFAULT_SETTINGS.match(process) == engine


def test_every_preset_has_a_case_that_matches():
    matched = {engine for _, p, engine in CASES if engine}
    assert matched == set(PRESETS)


@pytest.mark.parametrize("value,asks", [
    ("99", True), ("1", True), ("0", False), (" 0", False), ("-1", True), ("999", True),
    ("all", True), ("auto", True), ("", True), ("lots", True),
])
def test_layer_counts(value, asks):
    assert layers_ask_for_gpu(value) is asks


def test_offload_without_the_flag_follows_when_absent():
    assert GpuOffload(("--gpulayers",), when_absent=False).asks(["koboldcpp", "--model", "m"]) is False
    assert GpuOffload(("--gpulayers",), when_absent=False).asks(["koboldcpp", "--gpulayers", "20"]) is True
    assert GpuOffload(("--gpulayers",), when_absent=True).asks(["koboldcpp"]) is True
    assert GpuOffload(("-ngl",)).asks(["llama-server", "-ngl"]) is True  # value missing: the engine decides


# --- the config section --------------------------------------------------------------------------


def test_no_section_means_every_preset():
    settings, errors = parse_engines(None)
    assert errors == []
    assert settings == DEFAULT_SETTINGS
    assert settings.engines == ("llama.cpp", "ollama", "vllm", "sglang", "tgi", "triton", "tensorrt-llm")


def test_your_rules_come_first_and_presets_switch_off():
    settings, errors = parse_engines({
        "presets": {"triton": False, "tensorrt-llm": False},
        "rules": [
            {"name": "koboldcpp", "exe": "koboldcpp",
             "gpu_offload": {"flags": ["--gpulayers"], "when_absent": False}},
            {"name": "my-llama", "comm": ["llama-server"], "cmdline": [r"--alias\s+prod"]},
        ],
    })
    assert errors == []
    assert settings.engines == ("koboldcpp", "my-llama", "llama.cpp", "ollama", "vllm", "sglang", "tgi")
    assert settings.match(proc("/opt/koboldcpp --model m --gpulayers 43", exe="/opt/koboldcpp")) == "koboldcpp"
    assert settings.match(proc("/opt/koboldcpp --model m", exe="/opt/koboldcpp")) is None
    # Your rule wins over the preset it overlaps.
    assert settings.match(proc("llama-server -m q.gguf --alias prod -ngl 99")) == "my-llama"
    assert settings.match(proc("llama-server -m q.gguf -ngl 99")) == "llama.cpp"
    assert settings.match(proc("/opt/tritonserver/bin/tritonserver", exe="/opt/tritonserver/bin/tritonserver")) is None


def test_presets_false_leaves_only_your_rules():
    settings, errors = parse_engines({"presets": False, "rules": [{"name": "x", "comm": "x-server"}]})
    assert errors == [] and settings.engines == ("x",)
    settings, errors = parse_engines({"presets": False})
    assert errors == [] and settings.engines == ()


def test_exe_with_a_slash_is_a_full_path():
    settings, errors = parse_engines({"presets": False, "rules": [{"name": "x", "exe": "/opt/x/bin/server"}]})
    assert errors == []
    assert settings.match(proc("server", exe="/opt/x/bin/server")) == "x"
    assert settings.match(proc("server", exe="/usr/bin/server")) is None


def test_every_error_is_reported_at_once():
    settings, errors = parse_engines({
        "presets": {"llama": True, "vllm": "yes"},
        "rules": [
            {"name": "ok", "comm": "a"},
            {"comm": "text-generation-launcher"},
            {"name": "bad regex", "cmdline": ["(unclosed"]},
            {"name": "nothing"},
            {"name": "y", "exe": ["y"], "gpu_offload": {"flags": ["ngl"], "when_absent": "no", "extra": 1}},
            "just a string",
        ],
        "rule": [],
    })
    assert settings is None
    assert errors == [
        "engines.rule: unknown key (known: presets, rules)",
        "engines.presets.llama: unknown preset (known: llama.cpp, ollama, vllm, sglang, tgi, triton, tensorrt-llm)",
        "engines.presets.vllm: must be true or false, not a string",
        "engines.rules[1].name: missing; give the engine label (letters, digits, '.', '_' or '-', e.g. llama.cpp)",
        "engines.rules[1].comm: 'text-generation-launcher' is longer than 15 bytes and can never match: the kernel "
        "cuts process names to 15 ('text-generation'); match it with exe or cmdline instead",
        "engines.rules[2].name: 'bad regex' is not a valid engine label (letters, digits, '.', '_' or '-', "
        "e.g. llama.cpp)",
        "engines.rules[2].cmdline[0]: '(unclosed' is not a valid regular expression (missing ), unterminated "
        "subpattern at position 0)",
        "engines.rules[3]: give at least one of comm, exe, cmdline",
        "engines.rules[4].gpu_offload.extra: unknown key (known: flags, when_absent)",
        "engines.rules[4].gpu_offload.flags[0]: 'ngl' is not a command-line flag (it must start with '-')",
        "engines.rules[4].gpu_offload.when_absent: must be true or false, not a string",
        "engines.rules[5]: must be a mapping, not a string",
    ]


@pytest.mark.parametrize("section,error", [
    ([], "engines: must be a mapping with presets and rules, not a list"),
    ({"presets": ["vllm"]}, "engines.presets: must be true, false or a mapping of preset name to true/false, "
                            "not a list"),
    ({"rules": {"name": "x"}}, "engines.rules: must be a list of rules, not a mapping"),
    ({"rules": [{"name": "x", "comm": [1]}]}, "engines.rules[0].comm[0]: 1 is a number; quote it to make it a string"),
    ({"rules": [{"name": "x", "comm": {"a": 1}}]},
     "engines.rules[0].comm: must be a string or a list of strings, not a mapping"),
    ({"rules": [{"name": "x", "exe": ""}]}, "engines.rules[0].exe: must not be empty"),
    ({"rules": [{"name": "x", "cmdline": "("}]}, "engines.rules[0].cmdline: '(' is not a valid regular expression "
                                                 "(missing ), unterminated subpattern at position 0)"),
    ({"rules": [{"name": "x", "comm": "x", "gpu_offload": {}}]},
     "engines.rules[0].gpu_offload.flags: give the flags that take a GPU layer count, e.g. [-ngl, --n-gpu-layers]"),
])
def test_shape_errors(section, error):
    assert parse_engines(section) == (None, [error])


def test_config_file(tmp_path):
    path = tmp_path / "mig-exporter.yml"
    path.write_text("engines:\n  presets:\n    ollama: false\n  rules:\n    - name: koboldcpp\n      exe: koboldcpp\n")
    assert load_config(path).engines.engines == ("koboldcpp", "llama.cpp", "vllm", "sglang", "tgi", "triton",
                                                 "tensorrt-llm")
    path.write_text("{}\n")  # an empty file is refused as torn: {} says empty by intent
    assert load_config(path).engines == DEFAULT_SETTINGS


@pytest.mark.parametrize("text,message", [
    ("engines: [\n", "expected the node content, but found '<stream end>'"),
    ("- engines\n", "the file must be a mapping of settings, not a list (known: probe_targets, engines)"),
    ("engine:\n  presets: false\nmodules: {}\n", "engine: unknown key (known: probe_targets, engines)"),
    ("engines:\n  presets: {vllm: maybe}\n", "engines.presets.vllm"),
])
def test_config_file_errors(tmp_path, text, message):
    path = tmp_path / "bad.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert message in str(caught.value)


def test_a_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"none.yml: cannot read: No such file or directory"):
        load_config(tmp_path / "none.yml")


def test_docs_give_every_preset_rule():
    """docs/engines.md lists each preset with the names and patterns it matches."""
    docs = (REPO / "docs" / "engines.md").read_text()
    for name, rules in PRESETS.items():
        m = re.search(rf"^### `{re.escape(name)}`\n(.*?)(?=^### |^## |\Z)", docs, re.S | re.M)
        assert m, f"docs/engines.md has no section ### `{name}`"
        section = m.group(1)
        for rule in rules:
            for text in [*rule.comm, *rule.exe, *(p.pattern for p in rule.cmdline),
                         *(rule.gpu_offload.flags if rule.gpu_offload else ())]:
                assert f"`{text}`" in section, f"{name}: `{text}` is not in its section of docs/engines.md"


def test_the_config_examples_in_the_docs_are_valid():
    blocks = []
    for doc in (REPO / "README.md", REPO / "docs" / "engines.md"):
        blocks += [b for b in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S) if "engines:" in b]
    assert len(blocks) == 2
    for block in blocks:
        found, errors = parse_engines(yaml.safe_load(block)["engines"])
        assert errors == [] and "koboldcpp" in found.engines
