"""Hangs, floods and hostile input: what the exporter leaves behind after many hung reads, how long a
hung read may hold a scrape, the memory a hostile document may cost, and one log line per failure."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import MIB, calls, fixture_bytes, left_behind
from mig_exporter.config.file import parse_config
from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
from mig_exporter.web.probe import Prober

pytestmark = pytest.mark.timeout(120)

HUNG_READS = 1000


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def read_success(body: bytes) -> float | None:
    for line in body.decode().splitlines():
        if line.startswith("mig_exporter_read_success{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("nvidia-smi-read", "nvidia-smi-L", "reap-"))]


# --- hung reads ----------------------------------------------------------------------------------

def test_a_thousand_hung_reads_leave_no_zombie_no_orphan_no_thread_and_no_fd(fake_nvidia_smi):
    """Both commands print part of their output, start a child of their own and hang; each read has
    50 ms. 1000 reads, ten at a time (each on its own source, so none is shared), and then nothing
    of them may be left: no process of their groups (the orphaned children included), no zombie
    of ours, no reader or reaper thread, no pipe."""
    fakes = [fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), mode="hang", list_mode="hang")
             for _ in range(10)]
    fds_before = open_fds()

    def hundred_reads(fake) -> list[str]:
        source = NvidiaSmiSource(str(fake), timeout_s=0.05)
        errors = []
        for _ in range(HUNG_READS // len(fakes)):
            try:
                source.read()
            except Exception as e:  # what escaped is what the test checks
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    with ThreadPoolExecutor(max_workers=len(fakes)) as pool:
        outcomes = list(pool.map(hundred_reads, fakes))

    # Every read failed at its deadline: the commands killed there (CommandTimeout), or, on a
    # loaded machine, the caller answering at the deadline while the kill is still under way.
    assert all(len(errors) == HUNG_READS // len(fakes) for errors in outcomes)
    odd = [e for errors in outcomes for e in errors
           if not e.startswith("CommandTimeout: ") and not re.search(r"^ReadError: .* did not finish within", e)]
    assert odd == []
    runs = [run for fake in fakes for run in calls(fake)]
    queries = [pid for pid, args in runs if args == "-q -x"]
    # A run killed before its shell got to its first line (a loaded machine, 50 ms) logs nothing
    # and started no child; most get as far as starting theirs.
    assert HUNG_READS // 2 <= len(queries) <= HUNG_READS

    live, zombies = left_behind([pid for pid, _ in runs], within_s=5.0)
    assert live == [], f"{len(live)} processes of the hung commands are still running: {live[:5]}"
    assert zombies == [], f"{len(zombies)} children were never reaped"
    deadline = time.monotonic() + 5
    while read_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_threads() == []
    assert open_fds() <= fds_before, "pipes of the hung commands were left open"


def test_a_read_still_hung_does_not_hold_the_next_scrape_past_its_own_deadline(serve, fake_nvidia_smi):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), mode="hang", list_mode="hang")
    url = serve(NvidiaSmiSource(str(smi), timeout_s=8), timeout_s=8, offset_s=0.5)
    first: dict[str, object] = {}

    def slow_scrape() -> None:  # no header: the read gets the whole --timeout of 8 s
        started = time.monotonic()
        first["answer"] = get(url + "/metrics")
        first["elapsed"] = time.monotonic() - started

    hung = threading.Thread(target=slow_scrape)
    hung.start()
    deadline = time.monotonic() + 5
    while len(calls(smi)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(calls(smi)) == 2, "the first scrape never started nvidia-smi"

    # Prometheus scrapes again with a 2 s timeout: its read may take 1.5 s, not the 8 s still left
    # to the read in flight, which it joins rather than starting another.
    for _ in range(2):
        started = time.monotonic()
        status, body = get(url + "/metrics", {"X-Prometheus-Scrape-Timeout-Seconds": "2"})
        elapsed = time.monotonic() - started
        assert status == 200 and read_success(body) == 0
        assert 1.4 <= elapsed < 2.0, f"answered after {elapsed:.2f}s"
    assert hung.is_alive(), "the first read should still be hung"
    assert len(calls(smi)) == 2, "the scrapes joined the read in flight instead of starting more"
    started = time.monotonic()
    status, _ = get(url + "/-/healthy")
    assert status == 200 and time.monotonic() - started < 0.5, "/-/healthy must not wait for a read"

    hung.join(15)
    status, body = first["answer"]  # type: ignore[misc]
    assert status == 200 and read_success(body) == 0
    assert 7.5 <= first["elapsed"] < 9.5  # type: ignore[operator]
    assert left_behind([pid for pid, _ in calls(smi)]) == ([], [])


# --- hostile documents: memory ------------------------------------------------------------------

BILLION_LAUGHS = (
    b'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY a "aaaaaaaaaa">'
    + b"".join(b'<!ENTITY %c "' % (98 + i) + b"&%c;" % (97 + i) * 10 + b'">' for i in range(9))
    + b"]><nvidia_smi_log><driver_version>&j;</driver_version></nvidia_smi_log>"
)
# One entity of 100 kB referenced 20 000 times: 2 GB once expanded, and no nesting for a
# parser's loop detection to notice.
QUADRATIC_BLOWUP = (
    b'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY x "' + b"x" * 100_000 + b'">]>'
    + b"<nvidia_smi_log><driver_version>" + b"&x;" * 20_000 + b"</driver_version></nvidia_smi_log>"
)
XXE = (b'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY x SYSTEM "file:///dev/zero">]>'
       b"<nvidia_smi_log><driver_version>&x;</driver_version></nvidia_smi_log>")
# Parameter entities and an external DTD pulled in from inside the internal subset.
XXE_PARAMETER = (b'<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY % d SYSTEM "file:///dev/zero"> %d;]>'
                 b"<nvidia_smi_log/>")

_MEASURE = textwrap.dedent("""
    import resource, sys, time, tracemalloc
    from mig_exporter.core.errors import ParseError
    from mig_exporter.nvidia_smi.query_xml import parse_query_xml
    data = sys.stdin.buffer.read()
    parse_query_xml(b"<nvidia_smi_log/>")  # warm up: imports, the parser
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    started = time.perf_counter()
    try:
        parse_query_xml(data)
        outcome = "parsed"
    except ParseError as e:
        outcome = "ParseError: " + str(e)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(outcome)
    print((after - before) * 1024, peak, elapsed)
""")


@pytest.mark.parametrize("name, document", [
    ("billion laughs", BILLION_LAUGHS),
    ("quadratic blowup", QUADRATIC_BLOWUP),
    ("external entity", XXE),
    ("external parameter entity", XXE_PARAMETER),
], ids=["billion-laughs", "quadratic-blowup", "external-entity", "external-parameter-entity"])
def test_hostile_documents_are_refused_quickly_with_bounded_memory(name, document):
    """Measured in a fresh interpreter: its peak resident size (which libxml2's allocations count
    towards) after parsing, against the peak before, and the Python heap with tracemalloc."""
    result = subprocess.run([sys.executable, "-c", _MEASURE], input=document, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    outcome, figures = result.stdout.decode().splitlines()
    rss_growth, python_peak, elapsed = (float(x) for x in figures.split())
    assert outcome.startswith("ParseError: "), f"{name}: {outcome}"
    assert rss_growth < 16 * MIB, f"{name}: resident memory grew by {rss_growth / MIB:.1f} MiB"
    assert python_peak < 4 * len(document) + MIB, f"{name}: Python heap peaked at {python_peak / MIB:.1f} MiB"
    assert elapsed < 2.0, f"{name}: took {elapsed:.2f}s"


def test_a_flood_from_nvidia_smi_costs_one_failed_scrape_and_bounded_memory(serve, fake_nvidia_smi):
    """stdout is capped: a command printing without end is killed at the cap, not buffered."""
    import tracemalloc

    smi = fake_nvidia_smi(mode="flood")
    source = NvidiaSmiSource(str(smi), timeout_s=20, max_output_bytes=4 * MIB)
    url = serve(source, timeout_s=20)
    tracemalloc.start()
    try:
        started = time.monotonic()
        status, body = get(url + "/metrics")
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == 200 and read_success(body) == 0
    assert elapsed < 10, "the cap must end the read, not the deadline"
    assert peak < 4 * MIB + 8 * MIB, f"Python heap peaked at {peak / MIB:.1f} MiB for a 4 MiB cap"


# --- one log line per failure ------------------------------------------------------------------

def _failure_lines(caplog) -> list[str]:
    return [f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.levelno >= logging.INFO]


@pytest.mark.parametrize("mode, reason", [
    ("fail", "exit status 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."),
    ("hang", "timed out after"),
    ("garbage", "nvidia-smi -q -x output "),  # random bytes: not UTF-8, or not XML
    ("flood", "wrote more than 983040 bytes, its share of the read's output cap of 1048576 bytes; "
              "process group killed"),
])
def test_each_failed_read_logs_one_line_with_its_reason(serve, fake_nvidia_smi, caplog, mode, reason):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"),
                          mode=mode)
    url = serve(NvidiaSmiSource(str(smi), timeout_s=1, max_output_bytes=MIB), timeout_s=1)
    caplog.set_level(logging.INFO)
    assert get(url + "/metrics")[0] == 200
    lines = _failure_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("WARNING read from nvidia-smi failed: ") and reason in lines[0]


def test_a_missing_binary_logs_one_line(serve, tmp_path, caplog):
    url = serve(NvidiaSmiSource(str(tmp_path / "nvidia-smi")))
    caplog.set_level(logging.INFO)
    assert get(url + "/metrics")[0] == 200
    assert _failure_lines(caplog) == [f"WARNING read from nvidia-smi failed: {tmp_path}/nvidia-smi: "
                                      "no such file"]
    caplog.clear()
    assert get(url + "/-/ready")[0] == 503
    assert _failure_lines(caplog) == [f"INFO GET /-/ready from 127.0.0.1:{_port(caplog)}: answered 503: Not ready: "
                                      f"{tmp_path}/nvidia-smi: no such file"]


def _port(caplog) -> str:
    message = caplog.records[-1].getMessage()
    return message.split("from 127.0.0.1:", 1)[1].split(":", 1)[0]


@pytest.mark.parametrize("path, status, reason", [
    ("/nope", 404, "Not found"),
    ("/probe?target=../etc", 400, "target '../etc' is not a target name"),
    ("/probe?target=gpu-b", 400, "unknown target 'gpu-b': not in probe_targets (gpu-a)"),
])
def test_each_refused_request_logs_one_line_with_its_reason(serve, fake_nvidia_smi, caplog, path, status, reason):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"))
    prober = Prober(parse_config(f"probe_targets:\n  gpu-a: {{command: ['{smi}']}}\n", "mig.yml"))
    url = serve(NvidiaSmiSource(str(smi)), prober=prober)
    caplog.set_level(logging.INFO)
    assert get(url + path)[0] == status
    lines = _failure_lines(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"INFO GET {path} from 127.0.0.1:") and f"answered {status}: {reason}" in lines[0]


def test_a_busy_probe_logs_one_line(serve, fake_nvidia_smi, caplog):
    smi = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), mode="hang", list_mode="hang")
    other = fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"))
    prober = Prober(parse_config(f"probe_targets:\n  hung: {{command: ['{smi}'], timeout: 3s}}\n"
                                 f"  other: {{command: ['{other}']}}\n", "mig.yml"), max_concurrent=1)
    url = serve(NvidiaSmiSource(str(other)), prober=prober)
    caplog.set_level(logging.INFO)
    hung = threading.Thread(target=get, args=(url + "/probe?target=hung",))
    hung.start()
    deadline = time.monotonic() + 5
    while len(calls(smi)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert get(url + "/probe?target=other")[0] == 503
    hung.join(10)
    busy = [line for line in _failure_lines(caplog) if "answered 503" in line]
    assert len(busy) == 1 and "1 probes are running already (--probe.max-concurrent)" in busy[0]
    assert busy[0].startswith("WARNING GET /probe?target=other from 127.0.0.1:")
