"""The NVML path through a real shared library: the C fake libnvidia-ml.so.1 (tests/fake_libnvml/).

The exporter runs unmodified in a process of its own, loading our library where it asks for
``libnvidia-ml.so.1`` (``LD_LIBRARY_PATH``), so pynvml's real ctypes calls cross a real C ABI:
struct layouts, handle pointers, the size-query protocol, a call that never returns.
"""

from __future__ import annotations

import ctypes
import dataclasses
import http.client
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pynvml
import pytest

import mig_exporter
from benchmarks import scenarios as bench
from conftest import fixture_bytes
from fake_nvml import _SIGNATURES, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NOT_SUPPORTED, SCENARIOS, FakeNvmlScenario
from fake_nvml_c import SONAME, scenario_text

PACKAGE_ROOT = str(Path(mig_exporter.__file__).resolve().parent.parent)
FIXTURE_SCENARIOS = ["h100-mig-processes", "h200-shared-gpu-instance", "a100-mig-nothing-carved",
                     "a100-mig-pending", "na-memory"]
BENCH_SHAPES = {s.name: s for s in bench.MAIN_SHAPES}

# pynvml's ctypes classes and the C struct of nvml.h each stands for.
LAYOUTS = {
    "nvmlMemory_t": pynvml.c_nvmlMemory_t,
    "nvmlMemory_v2_t": pynvml.c_nvmlMemory_v2_t,
    "nvmlProcessInfo_t": pynvml.c_nvmlProcessInfo_v3_t,
    "nvmlPciInfo_t": pynvml.nvmlPciInfo_t,
    "nvmlUtilization_t": pynvml.c_nvmlUtilization_t,
    "nvmlTemperature_v1_t": pynvml.c_nvmlTemperature_v1_t,
    "nvmlFieldValue_t": pynvml.c_nvmlFieldValue_t,
    "nvmlProcessUtilizationSample_t": pynvml.c_nvmlProcessUtilizationSample_t,
}


class ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t, which pynvml no longer defines (tests/fake_nvml.py's)."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


def _env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _read(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mig_exporter", "read", *args], env=_env(env),
                          capture_output=True, text=True, timeout=120)


def _without_volatile(text: str) -> str:
    """Exposition minus the per-read duration, with the source label made neutral."""
    lines = [line for line in text.splitlines() if not line.startswith("mig_exporter_read_duration_seconds{")]
    return re.sub(r'source="[^"]+"', 'source="*"', "\n".join(lines))


def _sample(text: str, prefix: str) -> str | None:
    return next((line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(prefix + " ")), None)


# -- the library itself ----------------------------------------------------------


def _layouts(library: Path, names: list[str]) -> dict[str, int]:
    """``fakeNvmlLayout`` of each name, asked in a process of its own: a library loaded here would
    answer every later ``CDLL("libnvidia-ml.so.1")`` of this test process by its soname."""
    code = ("import ctypes, json, sys\n"
            "lib = ctypes.CDLL(sys.argv[1])\n"
            "lib.fakeNvmlLayout.restype = ctypes.c_long\n"
            "lib.fakeNvmlLayout.argtypes = [ctypes.c_char_p]\n"
            "print(json.dumps({n: lib.fakeNvmlLayout(n.encode()) for n in sys.argv[2:]}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(library), *names], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return {k: int(v) for k, v in json.loads(out).items()}


def test_every_struct_has_nvml_h_layout_as_pynvml_declares_it(fake_libnvml_dir):
    classes = {**LAYOUTS, "nvmlProcessInfo_v1_t": ProcessInfoV1}
    expected = {"nvmlMemory_v2": pynvml.nvmlMemory_v2, "nvmlTemperature_v1": pynvml.nvmlTemperature_v1}
    for c_name, cls in classes.items():
        expected[c_name] = ctypes.sizeof(cls)
        for field_name, *_ in cls._fields_:
            expected[f"{c_name}.{field_name}"] = getattr(cls, field_name).offset
    assert len(expected) == 2 + 9 + 39  # the version words, nine structs, every field
    assert _layouts(fake_libnvml_dir / SONAME, list(expected)) == expected
    assert expected["nvmlMemory_v2"] == 0x02000028


def test_it_exports_every_function_the_python_fake_serves(fake_libnvml_dir):
    """The Python fake's list is what our exporter and nvitop-exporter's update call."""
    exported = subprocess.run(["nm", "-D", "--defined-only", str(fake_libnvml_dir / SONAME)],
                              capture_output=True, text=True, check=True).stdout
    symbols = {line.split()[-1] for line in exported.splitlines() if " T " in line}
    assert set(_SIGNATURES) <= symbols
    assert {s for s in symbols if s.startswith("nvml")} == set(_SIGNATURES)


def test_the_scenario_file_keeps_odd_strings_and_refuses_what_a_library_cannot_do():
    base = SCENARIOS["h100-mig-processes"]()
    odd = dataclasses.replace(base, process_names={21180: "my job 100%", 21198: "caf\udce9"})
    text = scenario_text(odd)
    assert "process_name 21180 my%20job%20100%25\n" in text
    assert "process_name 21198 caf%E9\n" in text  # the raw byte of a name that is not UTF-8
    with pytest.raises(ValueError, match="missing_functions"):
        scenario_text(dataclasses.replace(base, missing_functions=frozenset({"nvmlDeviceGetMemoryInfo_v2"})))
    with pytest.raises(ValueError, match=r"\(0, 9\)"):
        scenario_text(base, grow={(0, 9): 5})


# -- the exporter in a process of its own, over the library ---------------------------


@pytest.mark.parametrize("name", FIXTURE_SCENARIOS)
def test_read_source_nvml_over_the_library_equals_nvidia_smi(fake_libnvml_env, fake_nvidia_smi, name):
    smi = fake_nvidia_smi(fixture_bytes(f"{name}.xml"), fixture_bytes(f"{name}.L.txt"))
    via_nvml = _read(fake_libnvml_env(name), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0, via_nvml.stderr
    assert via_smi.returncode == 0, via_smi.stderr
    assert _sample(via_nvml.stdout, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    assert _without_volatile(via_nvml.stdout) == _without_volatile(via_smi.stdout)


@pytest.mark.parametrize("name", sorted(BENCH_SHAPES))
def test_the_benchmark_machines_read_the_same_through_the_library(fake_libnvml_env, fake_nvidia_smi, name):
    shape = BENCH_SHAPES[name]
    smi = fake_nvidia_smi(bench.query_xml(shape), bench.listing(shape))
    via_nvml = _read(fake_libnvml_env(bench.nvml_scenario(shape)), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0 and via_smi.returncode == 0, via_nvml.stderr + via_smi.stderr
    processes = [line for line in via_nvml.stdout.splitlines()
                 if line.startswith("mig_exporter_process_memory_used_bytes{")]
    assert len(processes) == shape.processes
    assert _without_volatile(via_nvml.stdout) == _without_volatile(via_smi.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """``mig-exporter serve --source nvml`` in its own process."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mig_exporter", "serve", "--source", "nvml",
             "--web.listen-address", f"127.0.0.1:{self.port}", "--log-level", "warning", *args],
            env=_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            try:
                self.get("/-/healthy")
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("serve did not answer /-/healthy")

    def get(self, path: str, timeout: float = 30) -> tuple[int, str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            started = time.monotonic()
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read().decode(), time.monotonic() - started
        finally:
            conn.close()

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""


@pytest.fixture
def serve():
    started: list[Served] = []

    def start(env: dict[str, str], *args: str) -> Served:
        started.append(Served(env, *args))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_serve_source_nvml_maps_our_library_and_answers_as_read_does(fake_libnvml_env, fake_libnvml_dir, serve):
    env = fake_libnvml_env("h100-mig-processes")
    served = serve(env)
    status, body, _ = served.get("/metrics")
    assert status == 200
    maps = Path(f"/proc/{served.proc.pid}/maps").read_text()
    assert str(fake_libnvml_dir / SONAME) in maps
    assert "/libnvidia-ml.so" not in maps.replace(str(fake_libnvml_dir / SONAME), "")
    read = _read(env, "--source", "nvml")
    ours = [line for line in body.splitlines() if line.startswith("mig_exporter_") and "_read_" not in line
            and not line.startswith(("mig_exporter_build_info", "mig_exporter_scrape", "mig_exporter_exporter"))]
    assert len(ours) > 20
    assert set(ours) <= set(read.stdout.splitlines())
    assert served.get("/-/ready")[0] == 200


def test_every_later_scrape_through_the_library_lists_the_processes_as_one_read_does(fake_libnvml_env, serve):
    # Later reads keep process readings from earlier ones: they must never differ.
    env = fake_libnvml_env(bench.nvml_scenario(BENCH_SHAPES["big-mig"]))

    def processes(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("mig_exporter_process_"))

    expected = processes(_read(env, "--source", "nvml").stdout)
    assert len(expected) >= BENCH_SHAPES["big-mig"].processes
    served = serve(env)
    for _ in range(3):
        status, body, _ = served.get("/metrics")
        assert status == 200
        assert processes(body) == expected


# -- error modes -------------------------------------------------------------------


def test_a_lost_card_and_refused_mig_queries_mark_their_cards_and_the_third_reports(fake_libnvml_env):
    result = _read(fake_libnvml_env("one-lost-one-no-permission"), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _sample(out, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(out, 'mig_exporter_card_read_success{card="1"}') == "0.0"
    assert _sample(out, 'mig_exporter_card_read_success{card="2"}') == "1.0"
    assert "NVML_ERROR_GPU_IS_LOST in nvmlDeviceGetUUID" in result.stderr
    assert "NVML_ERROR_NO_PERMISSION in nvmlDeviceGetMaxMigDeviceCount" in result.stderr
    assert _sample(out, 'mig_exporter_process_memory_used_bytes{card="2",gpu_instance_id="",index="2",'
                        'pid="61001",type="C"}') is not None or 'pid="61001"' in out


def _not_supported(name: str, *functions: str) -> FakeNvmlScenario:
    base = SCENARIOS[name]()
    cards = tuple(dataclasses.replace(c, errors={f: NVML_ERROR_NOT_SUPPORTED for f in functions}) for c in base.cards)
    return dataclasses.replace(base, cards=cards)


def test_not_supported_mig_mode_reads_the_card_whole(fake_libnvml_env):
    """A driver that answers NOT_SUPPORTED to nvmlDeviceGetMigMode: the card has no MIG, as a T4."""
    result = _read(fake_libnvml_env(_not_supported("a100-mig-pending", "nvmlDeviceGetMigMode")),
                   "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "1.0"
    assert "mig_exporter_card_mig_mode{" not in result.stdout
    assert 'pid="900"' in result.stdout


def test_not_supported_mig_device_queries_fail_only_that_card(fake_libnvml_env):
    result = _read(fake_libnvml_env(_not_supported("h100-mig-processes", "nvmlDeviceGetMaxMigDeviceCount")),
                   "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(result.stdout, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    assert "NVML_ERROR_NOT_SUPPORTED in nvmlDeviceGetMaxMigDeviceCount" in result.stderr


def test_a_process_list_that_grew_after_its_sizing_call_is_read_again(fake_libnvml_env):
    """pynvml sizes the list, allocates twice that plus five, reads: a list that grew past that
    answers INSUFFICIENT_SIZE to the read. The exporter asks again rather than drop the card."""
    result = _read(fake_libnvml_env("h100-mig-processes", grow={(0, 0): 50}), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert _sample(out, 'mig_exporter_card_read_success{card="0"}') == "1.0"
    assert "INSUFFICIENT_SIZE" not in result.stderr
    grown = [line for line in out.splitlines() if line.startswith("mig_exporter_process_memory_used_bytes{")
             and re.search(r'pid="30001\d\d"', line)]
    assert len(grown) == 50
    assert 'pid="21180"' in out and 'pid="21198"' in out


def test_an_insufficient_size_on_every_read_fails_the_card_after_bounded_retries(fake_libnvml_env):
    """A list that outgrows every read (a fork bomb on the GPU) ends in a marked card, not a loop."""
    base = SCENARIOS["h100-mig-processes"]()
    lost = dataclasses.replace(base, cards=(dataclasses.replace(
        base.cards[0], errors={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_INSUFFICIENT_SIZE,
                               "nvmlDeviceGetComputeRunningProcesses_v2": pynvml.NVML_ERROR_INSUFFICIENT_SIZE}),))
    result = _read(fake_libnvml_env(lost), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert "NVML_ERROR_INSUFFICIENT_SIZE" in result.stderr


def test_a_lost_card_keeps_its_handle_and_fails_only_itself(fake_libnvml_env):
    base = SCENARIOS["demo"]()
    cards = (dataclasses.replace(base.cards[0], errors={"*": NVML_ERROR_GPU_IS_LOST}), base.cards[1])
    result = _read(fake_libnvml_env(dataclasses.replace(base, cards=cards)), "--source", "nvml")
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "0.0"
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="1"}') == "1.0"
    assert 'pid="50318"' in result.stdout and 'pid="48213"' not in result.stdout


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_device_call_hung_for_good_fails_every_later_read_at_its_deadline_while_ready_stays_200(
        fake_libnvml_env, serve):
    """What docs/reliability.md describes: after nvmlDeviceGetPowerUsage never returns, each
    scrape answers at its deadline with the read failed and no device series, one thread stays
    hung, and /-/ready, whose check calls nvmlDeviceGetCount only, still answers 200."""
    served = serve(fake_libnvml_env("demo", hang=("nvmlDeviceGetPowerUsage", 2)), "--timeout", "1")
    status, first, _ = served.get("/metrics")  # the two cards' power: the calls the hang allows
    assert status == 200 and _sample(first, 'mig_exporter_read_success{source="nvml"}') == "1.0"
    threads = []
    for n in range(1, 7):
        status, body, took = served.get("/metrics")
        assert status == 200
        assert 0.9 < took < 3.0, took
        assert _sample(body, 'mig_exporter_read_success{source="nvml"}') == "0.0"
        assert _sample(body, 'mig_exporter_read_errors_total{source="nvml"}') == f"{n}.0"
        assert "mig_exporter_device_memory_used_bytes{" not in body
        ready, text, ready_took = served.get("/-/ready")
        assert ready == 200 and "2 device(s)" in text and ready_took < 0.5
        threads.append(_threads(served.proc.pid))
    # Later reads join the hung one: no thread per scrape (6 scrapes would add 5). The kept
    # workers may grow by one where a scrape's call comes while every kept one is still busy.
    assert threads[-1] - threads[0] <= 1, threads
    assert "nvml read did not finish within 1.0s" in served.stop()


def test_a_hung_device_count_fails_reads_and_readiness_alike(fake_libnvml_env, serve):
    """Hung in nvmlDeviceGetCount, the call /-/ready's check makes too: both answer at their
    deadlines, reads failed and /-/ready 503, /-/healthy at once."""
    # One call at startup's readiness check, one in the first read; the third never returns.
    served = serve(fake_libnvml_env("demo", hang=("nvmlDeviceGetCount_v2", 2)), "--timeout", "1")
    assert _sample(served.get("/metrics")[1], 'mig_exporter_read_success{source="nvml"}') == "1.0"
    for _ in range(2):
        status, body, took = served.get("/metrics")
        assert status == 200 and 0.9 < took < 3.0
        assert _sample(body, 'mig_exporter_read_success{source="nvml"}') == "0.0"
        ready, text, ready_took = served.get("/-/ready")
        assert ready == 503 and "did not finish within 1.0s" in text and 0.9 < ready_took < 3.0
        healthy, _, healthy_took = served.get("/-/healthy")
        assert healthy == 200 and healthy_took < 0.5


def test_the_library_benchmark_runs_in_quick_mode_and_measures_every_figure(fake_libnvml_dir):
    """benchmarks/nvml_lib.py: no timing asserted, only that every figure is measured."""
    from benchmarks import nvml_lib

    figures: dict[str, float] = {}
    table = nvml_lib.measure(True, figures)
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "scenario" not in line]
    assert [r[0].strip() for r in rows] == ["big-mig", "big-whole", "single"]
    nvitop = importlib.util.find_spec("nvitop_exporter") is not None
    for row in rows:
        cells = [c.strip() for c in row[1:]]
        assert all(re.fullmatch(r"\d+\.\d\d", c) for c in (cells if nvitop else cells[:3])), row
    assert figures["big-mig.scrape_p50_ms"] > 0 and figures["single.read_cpu_ms"] > 0
    assert ("big-mig.ratio_cpu" in figures) == nvitop
    if nvitop:
        assert figures["big-mig.devices"] == 8 + 56
    assert "QUICK MODE" in table and "targets (big-mig)" in table


_PROTOCOL_CHILD = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {"init": lib.nvmlInitWithFlags(0)}
card, mig = ctypes.c_void_p(), ctypes.c_void_p()
out["handle"] = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(card))
out["mig"] = lib.nvmlDeviceGetMigDeviceHandleByIndex(card, 0, ctypes.byref(mig))
out["bogus"] = lib.nvmlDeviceGetUUID(ctypes.c_void_p(card.value + 1), ctypes.create_string_buffer(96), 96)
lists = lib.nvmlDeviceGetComputeRunningProcesses_v3
count = ctypes.c_uint(0)
out["sizing"] = [lists(mig, ctypes.byref(count), None), count.value]
short = ctypes.c_uint(1)
buf = (ctypes.c_char * (24 * 200))()
out["short"] = [lists(mig, ctypes.byref(short), buf), short.value]
exact = ctypes.c_uint(count.value)
out["grown"] = [lists(mig, ctypes.byref(exact), buf), exact.value]
room = ctypes.c_uint(200)
out["read"] = [lists(mig, ctypes.byref(room), buf), room.value]
out["pids"] = [int.from_bytes(buf[24 * i:24 * i + 4], "little") for i in range(room.value)][:3]
print(json.dumps(out))
"""


def test_the_size_query_protocol_as_nvml_h_describes_it(fake_libnvml_env, fake_libnvml_dir):
    """In C terms, without pynvml: a NULL array sizes the list (INSUFFICIENT_SIZE and the count),
    a short array answers INSUFFICIENT_SIZE with the count needed, a long one is filled; a list set
    to grow is longer after its sizing call; a pointer not given out is INVALID_ARGUMENT."""
    env = fake_libnvml_env("h100-mig-processes", grow={(0, 0): 50})
    out = subprocess.run([sys.executable, "-c", _PROTOCOL_CHILD, str(fake_libnvml_dir / SONAME)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    answers = json.loads(out)
    insufficient = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert answers == {
        "init": 0, "handle": 0, "mig": 0, "bogus": pynvml.NVML_ERROR_INVALID_ARGUMENT,
        "sizing": [insufficient, 2],  # MIG device 0's two processes
        "short": [insufficient, 52],  # grown since: 50 more
        "grown": [insufficient, 52],
        "read": [0, 52],
        "pids": [21180, 21181, 3000102],  # 3000000 + 1000·card + 100·(slot+1) + place in the list
    }


def test_a_process_name_that_is_not_utf8_crosses_the_library_and_is_kept(fake_libnvml_env):
    base = SCENARIOS["h100-mig-processes"]()
    odd = dataclasses.replace(base, process_names={**base.process_names, 21198: "gpu_burn-caf\udce9"})
    result = _read(fake_libnvml_env(odd), "--source", "nvml")
    assert result.returncode == 0, result.stderr
    assert 'process_name="gpu_burn-caf\ufffd"' in result.stdout
    assert _sample(result.stdout, 'mig_exporter_card_read_success{card="0"}') == "1.0"


def test_r535_garbled_v3_lists_are_read_again_with_v2_through_the_library(fake_libnvml_env, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    garbled = dataclasses.replace(SCENARIOS["h100-mig-processes"](), r535_struct_mismatch=True)
    via_nvml = _read(fake_libnvml_env(garbled), "--source", "nvml")
    via_smi = _read(dict(os.environ), "--source", "nvidia-smi", "--nvidia-smi", str(smi))
    assert via_nvml.returncode == 0, via_nvml.stderr
    assert _without_volatile(via_nvml.stdout) == _without_volatile(via_smi.stdout)
