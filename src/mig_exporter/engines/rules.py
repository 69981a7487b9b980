"""Which processes are inference engines: match rules and the built-in presets.

A rule names an engine and says what a process of it looks like: its name
(``comm``), its executable's basename (``exe``), regular expressions its
command line must match (``cmdline``), and optionally that the command line
asks for GPU offload (``gpu_offload``). Every selector a rule gives must
match; several rules with the same name are alternatives. Your rules are
tried first, then the presets in the order of ``PRESETS``; the first that
matches names the engine. docs/engines.md lists each preset's rule.

The ``engines:`` section of the config file is read into these by
``config.engines``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mig_exporter.host.procfs import ProcEntry

# The kernel keeps 15 bytes of a process name (TASK_COMM_LEN 16, with the NUL).
COMM_MAX_LEN = 15
ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True, slots=True)
class GpuOffload:
    """The command line asks for GPU offload.

    ``flags`` take a layer count (``-ngl 99``, ``--n-gpu-layers=99``); the
    last one given wins, as in llama.cpp. A count other than 0 asks for the
    GPU: ``-1``, ``all`` and ``auto`` mean "as many as fit", and a value we
    cannot read is the engine's to refuse, so it asks too. ``when_absent`` is
    what a command line without any of the flags asks for.
    """

    flags: tuple[str, ...]
    when_absent: bool = True

    def asks(self, args: Sequence[str]) -> bool:
        value: str | None = None
        for i, arg in enumerate(args):
            for flag in self.flags:
                if arg == flag:
                    value = args[i + 1] if i + 1 < len(args) else ""
                elif arg.startswith(flag + "="):
                    value = arg[len(flag) + 1 :]
        if value is None:
            return self.when_absent
        return layers_ask_for_gpu(value)


def layers_ask_for_gpu(value: str) -> bool:
    """Whether a layer count asks for the GPU: everything but 0 does."""
    try:
        return int(value.strip()) != 0
    except ValueError:
        return True  # all, auto, or a value the engine will reject itself


@dataclass(frozen=True, slots=True)
class EngineRule:
    """One way a process of ``engine`` looks. Empty selectors are not checked."""

    engine: str
    comm: frozenset[str] = frozenset()
    exe: frozenset[str] = frozenset()
    cmdline: tuple[re.Pattern[str], ...] = ()
    gpu_offload: GpuOffload | None = None

    def matches(self, process: ProcEntry) -> bool:
        if self.comm and process.comm not in self.comm:
            return False
        if self.exe and not self._exe_matches(process):
            return False
        if self.cmdline:
            text = " ".join(process.cmdline)
            if not all(p.search(text) for p in self.cmdline):
                return False
        return self.gpu_offload is None or self.gpu_offload.asks(process.cmdline)

    def _exe_matches(self, process: ProcEntry) -> bool:
        # An entry with a slash is a full path; without, a basename.
        name, path = process.exe_name, process.exe_path
        return any((e == path) if "/" in e else (e == name) for e in self.exe)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The rules in the order they are tried, and every engine switched on
    (each gets an explicit ``mig_exporter_engine_processes`` 0)."""

    rules: tuple[EngineRule, ...]
    engines: tuple[str, ...]

    def match(self, process: ProcEntry) -> str | None:
        """The engine the first matching rule names, or None."""
        for rule in self.rules:
            if rule.matches(process):
                return rule.engine
        return None


# --- presets -------------------------------------------------------------------------------------

# An interpreter (any path, python3, python3.11) with one-letter options such
# as -u or -O, but not -m; then a script or a module. Anchored at the start so
# that `pgrep -f vllm`, an editor or a log tail naming an engine never match.
PYTHON = r"(\S*/)?python[0-9.]*(\s+-[A-Za-ln-z]+)*\s+"


def _script(name: str, args: str = "") -> str:
    """A program run directly or as a Python script (a console entry point)."""
    return rf"^({PYTHON})?(\S*/)?{name}{args}(\s|$)"


def _module(name: str) -> str:
    """``python -m NAME``."""
    return rf"^{PYTHON}-m\s+{name}(\s|$)"


LLAMA_CPP_LAYERS = GpuOffload(flags=("-ngl", "--gpu-layers", "--n-gpu-layers"), when_absent=True)


def _rule(engine: str, *, comm: Iterable[str] = (), exe: Iterable[str] = (), cmdline: Iterable[str] = (),
          gpu_offload: GpuOffload | None = None) -> EngineRule:
    return EngineRule(engine, frozenset(comm), frozenset(exe), tuple(re.compile(c) for c in cmdline), gpu_offload)


PRESETS: dict[str, tuple[EngineRule, ...]] = {
    "llama.cpp": (
        _rule("llama.cpp", comm=["llama-server", "llama-cli"], gpu_offload=LLAMA_CPP_LAYERS),
        _rule("llama.cpp", exe=["llama-server", "llama-cli"], gpu_offload=LLAMA_CPP_LAYERS),
    ),
    "ollama": (
        # The runners hold the model; `ollama serve` itself holds no GPU
        # memory and is never an engine.
        _rule("ollama", cmdline=[r"^(\S*/)?ollama\s+runner(\s|$)"]),
        _rule("ollama", exe=["ollama_llama_server"]),
        _rule("ollama", comm=["ollama_llama_se"]),  # ollama_llama_server, cut to 15
    ),
    "vllm": (
        _rule("vllm", cmdline=[_script("vllm", r"\s+serve")]),
        _rule("vllm", cmdline=[_module(r"vllm\.entrypoints\.\S+")]),
    ),
    "sglang": (
        _rule("sglang", cmdline=[_script("sglang", r"\s+serve")]),
        _rule("sglang", cmdline=[_module(r"sglang\.launch_server")]),
    ),
    "tgi": (
        _rule("tgi", exe=["text-generation-launcher"]),
        _rule("tgi", cmdline=[_script("text-generation-launcher")]),
        _rule("tgi", cmdline=[_script("text-generation-server", r"\s+serve")]),
    ),
    "triton": (
        _rule("triton", comm=["tritonserver"]),
        _rule("triton", exe=["tritonserver"]),
    ),
    "tensorrt-llm": (
        _rule("tensorrt-llm", comm=["trtllm-serve"]),
        _rule("tensorrt-llm", cmdline=[_script("trtllm-serve")]),
        _rule("tensorrt-llm", cmdline=[_module(r"tensorrt_llm\.commands\.serve")]),
    ),
}


def settings(rules: Iterable[EngineRule] = (), presets: Iterable[str] = tuple(PRESETS)) -> EngineSettings:
    """Your rules first, then the named presets in their documented order."""
    switched_on = set(presets)
    ordered = [*rules, *(r for name, rs in PRESETS.items() if name in switched_on for r in rs)]
    engines = tuple(dict.fromkeys(r.engine for r in ordered))
    return EngineSettings(tuple(ordered), engines)


DEFAULT_SETTINGS = settings()
