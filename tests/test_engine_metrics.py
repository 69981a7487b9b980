"""Engine metrics end to end: an exporter on 127.0.0.1 reading a fake
nvidia-smi and a /proc, scraped over HTTP.

The last tests start real processes: copies (links) of the Python
interpreter named ``llama-server``, given ``-ngl 99``. The fake nvidia-smi
lists the engine's pid, its child's, its thread's, or none of them, and the
exposed memory follows; a process that does not match is never reported.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import MIB, SAMPLES, FakeSmi, value
from conftest import samples as exposition_samples
from mig_exporter.engines.attribution import EngineReader
from mig_exporter.engines.rules import DEFAULT_SETTINGS
from mig_exporter.host.procfs import HOST_PID_NAMESPACE, ProcfsSource
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from proc_tree import CONTAINER_NS, Proc, make_proc

pytestmark = pytest.mark.timeout(60)

LLAMA = ["/usr/local/bin/llama-server", "-m", "/models/mistral-7b-instruct-q4_k_m.gguf", "-ngl", "99"]
ENGINE_FAMILIES = ("mig_exporter_engine_processes", "mig_exporter_engine_memory_used_bytes", "mig_exporter_engine_info")


def demo_xml(pids: dict[int, int] | None = None) -> bytes:
    """The demo's ``nvidia-smi -q -x`` with some of its pids replaced: 48213 on
    MIG 1000 (11520 MiB), 51877 on MIG 1001, 50102 (type G, 20480 MiB) and
    50318 on card 1."""
    xml = (SAMPLES / "demo.xml").read_text()
    for old, new in (pids or {}).items():
        assert xml.count(f"<pid>{old}</pid>") == 1
        xml = xml.replace(f"<pid>{old}</pid>", f"<pid>{new}</pid>")
    return xml.encode()


@pytest.fixture
def serve(serve):
    """conftest's server, with the default engine presets reading ``proc_root``."""
    return lambda source, proc_root: serve(Scraper(source, EngineReader(DEFAULT_SETTINGS, ProcfsSource(proc_root))))


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=15) as response:
        assert response.status == 200
        return exposition_samples(response.read().decode())


def series(samples, name: str) -> list[dict[str, str]]:
    return sorted((dict(ls) for n, ls in samples if n == name), key=lambda d: (d.get("pid", ""), sorted(d.items())))


def demo_smi(fake_nvidia_smi: FakeSmi, pids: dict[int, int] | None = None) -> Path:
    return fake_nvidia_smi(xml=demo_xml(pids), listing=(SAMPLES / "demo.L.txt").read_bytes())


# --- a fabricated /proc --------------------------------------------------------------------------


def test_one_llama_server_on_the_gpu_and_one_on_the_cpu(serve, fake_nvidia_smi, tmp_path):
    root = make_proc(tmp_path / "proc", [
        Proc(48213, "llama-server", LLAMA, exe="/usr/local/bin/llama-server"),  # on MIG 1000
        Proc(52040, "llama-server", LLAMA, exe="/usr/local/bin/llama-server"),  # on no list
        Proc(60000, "python3", ["/usr/bin/python3", "train.py", "-ngl", "99"], exe="/usr/bin/python3.12"),
    ])
    samples = scrape(serve(NvidiaSmiSource(str(demo_smi(fake_nvidia_smi))), str(root)))

    assert value(samples, "mig_exporter_read_success", source="nvidia-smi") == 1
    assert value(samples, "mig_exporter_read_problems", source="nvidia-smi") == 0
    assert value(samples, "mig_exporter_host_pid_namespace") == 1
    assert value(samples, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid="48213") == 11520 * MIB
    assert value(samples, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid="52040") == 0
    assert series(samples, "mig_exporter_engine_info") == [
        {"engine": "llama.cpp", "pid": "48213", "comm": "llama-server", "index": "1000"},
        {"engine": "llama.cpp", "pid": "52040", "comm": "llama-server", "index": ""},
    ]  # sorted by pid
    assert value(samples, "mig_exporter_engine_info", pid="52040", index="") == 1
    assert {d["engine"]: value(samples, "mig_exporter_engine_processes", **d)
            for d in series(samples, "mig_exporter_engine_processes")} == {
        "llama.cpp": 2, "ollama": 0, "vllm": 0, "sglang": 0, "tgi": 0, "triton": 0, "tensorrt-llm": 0}
    assert not any(("pid", "60000") in ls for n, ls in samples if n.startswith("mig_exporter_engine_"))
    # The GPU side is unchanged by the engine read.
    assert value(samples, "mig_exporter_process_memory_used_bytes", pid="48213", index="1000") == 11520 * MIB


def test_outside_the_host_namespace_engines_are_left_out(serve, fake_nvidia_smi, tmp_path, caplog):
    root = make_proc(tmp_path / "proc", [Proc(48213, "llama-server", LLAMA), Proc(52040, "llama-server", LLAMA)],
                     namespace=CONTAINER_NS)
    caplog.set_level("WARNING", logger="mig_exporter")
    url = serve(NvidiaSmiSource(str(demo_smi(fake_nvidia_smi))), str(root))
    samples = scrape(url)
    scrape(url)

    assert value(samples, "mig_exporter_host_pid_namespace") == 0
    for family in ENGINE_FAMILIES:
        assert series(samples, family) == [], f"{family} must not claim anything outside the host namespace"
    assert value(samples, "mig_exporter_read_problems", source="nvidia-smi") == 1
    assert value(samples, "mig_exporter_device_memory_used_bytes", index="1000") == 11663 * MIB
    warnings = [r.getMessage() for r in caplog.records if "not the host's" in r.getMessage()]
    assert len(warnings) == 1, "logged once, not at every scrape"
    assert "hostPID: true" in warnings[0]


def test_a_failed_gpu_read_counts_engines_and_places_none(serve, fake_nvidia_smi, tmp_path):
    root = make_proc(tmp_path / "proc", [Proc(52040, "llama-server", LLAMA)])
    samples = scrape(serve(NvidiaSmiSource(str(fake_nvidia_smi(mode="fail", list_mode="fail"))), str(root)))

    assert value(samples, "mig_exporter_read_success", source="nvidia-smi") == 0
    assert value(samples, "mig_exporter_host_pid_namespace") == 1
    assert value(samples, "mig_exporter_engine_processes", engine="llama.cpp") == 1
    assert series(samples, "mig_exporter_engine_memory_used_bytes") == []  # unknown, not 0
    assert series(samples, "mig_exporter_engine_info") == []


def test_an_unreadable_proc_root_is_a_problem_not_a_failure(serve, fake_nvidia_smi, tmp_path, caplog):
    caplog.set_level("WARNING", logger="mig_exporter")
    samples = scrape(serve(NvidiaSmiSource(str(demo_smi(fake_nvidia_smi))), str(tmp_path / "no-proc")))

    assert value(samples, "mig_exporter_read_success", source="nvidia-smi") == 1
    assert value(samples, "mig_exporter_read_problems", source="nvidia-smi") == 1
    assert value(samples, "mig_exporter_host_pid_namespace") is None
    for family in ENGINE_FAMILIES:
        assert series(samples, family) == []
    assert any(f"cannot read {tmp_path}/no-proc" in r.getMessage() for r in caplog.records)


# --- real processes ------------------------------------------------------------------------------

PYTHON = os.path.realpath(sys.executable)
# The engine: holds a child (a plain python, which matches nothing) and a
# thread, and says their ids.
ENGINE_CODE = f"""
import os, subprocess, threading, time
child = subprocess.Popen([{PYTHON!r}, "-c", "import time; time.sleep(120)"])
started = threading.Event(); tids = []
def work():
    tids.append(threading.get_native_id()); started.set(); time.sleep(120)
threading.Thread(target=work, daemon=True).start(); started.wait()
print(os.getpid(), child.pid, tids[0], flush=True)
time.sleep(120)
"""
IDLE_CODE = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"


@dataclass
class Running:
    process: subprocess.Popen
    ids: list[int]


@pytest.fixture
def start_named(tmp_path) -> Iterator:
    """Start a real process whose name (comm) is ``name``: the interpreter run
    through a link of that name, as a copied binary would be."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    running: list[Running] = []

    def start(name: str, code: str, *args: str) -> Running:
        link = bin_dir / name
        if not link.exists():
            link.symlink_to(PYTHON)
        process = subprocess.Popen([str(link), "-c", code, *args], stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
        line = process.stdout.readline()
        assert line, f"{name} did not start (exit {process.poll()})"
        started = Running(process, [int(x) for x in line.split()])
        running.append(started)
        assert Path(f"/proc/{process.pid}/comm").read_text().strip() == name
        return started

    yield start
    for r in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.process.pid, signal.SIGKILL)
        r.process.wait(10)
        r.process.stdout.close()


def overlay_proc(root: Path, pids: list[int]) -> Path:
    """A /proc whose process directories are the real ones of ``pids``, behind
    a ``self`` in the host's PID namespace: the real-process test then runs
    the same wherever the test itself runs (a container included)."""
    root.mkdir()
    me = root / "4242"
    (me / "ns").mkdir(parents=True)
    os.symlink(HOST_PID_NAMESPACE, me / "ns" / "pid")
    os.symlink("4242", root / "self")
    for pid in pids:
        os.symlink(f"/proc/{pid}", root / str(pid))
    return root


IN_HOST_NAMESPACE = os.readlink("/proc/self/ns/pid") == HOST_PID_NAMESPACE


@pytest.mark.parametrize("proc", ["real", "overlay"])
def test_memory_follows_real_processes(proc, serve, start_named, fake_nvidia_smi, tmp_path):
    engine = start_named("llama-server", ENGINE_CODE, "-m", "/models/q.gguf", "-ngl", "99")
    pid, child, thread = engine.ids
    bystander = start_named("model-server", IDLE_CODE, "-ngl", "99").ids[0]  # matches no rule
    cpu_by_choice = start_named("llama-server", IDLE_CODE, "-ngl", "0").ids[0]  # asks for no GPU
    assert len({pid, child, thread, bystander, cpu_by_choice}) == 5

    root = "/proc" if proc == "real" else str(overlay_proc(tmp_path / "proc", [pid, child, bystander, cpu_by_choice]))
    # Every other process the demo lists is the bystander, so the list is
    # never one of pids this /proc lacks.
    others = {48213: bystander, 51877: bystander, 50318: bystander}
    smi = demo_smi(fake_nvidia_smi, {**others, 50102: pid})
    url = serve(NvidiaSmiSource(str(smi)), root)

    def listing(holder: int) -> None:
        (smi.parent / "q.xml").write_bytes(demo_xml({**others, 50102: holder}))

    samples = scrape(url)
    if proc == "real" and not IN_HOST_NAMESPACE:
        # Here the pids nvidia-smi would list are not ours: nothing is claimed.
        assert value(samples, "mig_exporter_host_pid_namespace") == 0
        for family in ENGINE_FAMILIES:
            assert series(samples, family) == []
        return

    def memory(samples) -> float | None:
        return value(samples, "mig_exporter_engine_memory_used_bytes", engine="llama.cpp", pid=str(pid))

    def indexes(samples) -> list[str]:
        return [d["index"] for d in series(samples, "mig_exporter_engine_info") if d["pid"] == str(pid)]

    # Listed itself, on card 1.
    assert value(samples, "mig_exporter_host_pid_namespace") == 1
    assert memory(samples) == 20480 * MIB
    assert indexes(samples) == ["1"]
    assert value(samples, "mig_exporter_engine_info", pid=str(pid), comm="llama-server", index="1") == 1
    # Only the engines are reported: the bystander and the -ngl 0 run are not,
    # and nor are the engine's child and thread as engines of their own.
    engine_pids = {d["pid"] for d in series(samples, "mig_exporter_engine_memory_used_bytes")}
    assert str(pid) in engine_pids
    assert engine_pids.isdisjoint({str(child), str(thread), str(bystander), str(cpu_by_choice)})

    # Off every list: 0, on no device.
    listing(bystander)
    samples = scrape(url)
    assert memory(samples) == 0
    assert indexes(samples) == [""]

    # Its child holds the memory, then one of its threads does.
    listing(child)
    assert memory(scrape(url)) == 20480 * MIB
    listing(thread)
    assert memory(scrape(url)) == 20480 * MIB

    # It exits: its series go, and it is no longer counted.
    before = value(samples, "mig_exporter_engine_processes", engine="llama.cpp")
    os.killpg(engine.process.pid, signal.SIGKILL)
    engine.process.wait(10)
    samples = scrape(url)
    assert memory(samples) is None
    assert indexes(samples) == []
    assert value(samples, "mig_exporter_engine_processes", engine="llama.cpp") == before - 1


def test_real_process_names_are_what_the_kernel_says(start_named):
    """The premise of the test above: a link named llama-server gives a
    process whose comm is llama-server and whose cmdline carries -ngl 99."""
    pid = start_named("llama-server", IDLE_CODE, "-ngl", "99").ids[0]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert Path(f"/proc/{pid}/comm").read_text() == "llama-server\n"
    assert cmdline[0].endswith(b"/llama-server") and cmdline[-3:] == [b"-ngl", b"99", b""]
    assert re.search(r"python", os.readlink(f"/proc/{pid}/exe"))
