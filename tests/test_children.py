"""Children that outlive their read (issue #14): the output cap is the read's, not each command's;
as PID 1 the exporter reaps the orphans its reads leave; and grandchildren that escape the
process group (double fork, setsid, deaf to SIGTERM, holding stdout) are killed and reaped after
each read and at shutdown, the exporter being their subreaper. Every test runs real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from conftest import MIB, FakeSmi, escaped, fixture_bytes, require_tool, running

pytestmark = pytest.mark.timeout(120)

DEFAULT_CAP = 64 * MIB


def h100(fake_nvidia_smi: FakeSmi, **kwargs):
    return fake_nvidia_smi(fixture_bytes("h100-mig-processes.xml"), fixture_bytes("h100-mig-processes.L.txt"),
                           **kwargs)


def survivors(pids: list[int], within_s: float = 2.0) -> list[int]:
    """The given processes still running after a short grace (SIGKILL lands asynchronously)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in pids if running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def kill_all(pids: list[int]) -> None:
    """The test started them: never leave them running, whatever the outcome."""
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


# --- the output cap is the read's --------------------------------------------------------------

_DOUBLE_FLOOD = textwrap.dedent("""
    import resource, sys, time
    from mig_exporter.core.deadline import Deadline
    from mig_exporter.core.errors import OutputTooLarge
    from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
    source = NvidiaSmiSource(sys.argv[1], timeout_s=60)  # the default cap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    try:
        source.read(Deadline.after(60))
        outcome = "read"
    except OutputTooLarge as e:
        outcome = "OutputTooLarge: " + str(e)
    elapsed = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(outcome)
    print((after - before) * 1024, elapsed)
""")


def test_a_read_whose_two_commands_both_flood_holds_at_most_the_reads_cap(fake_nvidia_smi):
    """`-q -x` and `-L` both print without end, in parallel: together they may hold the read's cap
    (64 MiB), not 64 MiB each. Measured in a fresh interpreter: its peak resident size during the
    read against its peak before (the interpreter and every module already loaded)."""
    smi = fake_nvidia_smi(mode="flood", list_mode="flood")
    result = subprocess.run([sys.executable, "-c", _DOUBLE_FLOOD, str(smi)], capture_output=True, timeout=90)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    outcome, figures = result.stdout.decode().splitlines()
    growth, elapsed = (float(x) for x in figures.split())
    # Both buffers together hold at most the cap; bytearray's growth slack and the last chunks
    # come on top. Close to two caps (each command holding 64 MiB) is what it cost before.
    assert growth < 1.25 * DEFAULT_CAP, f"resident memory grew by {growth / MIB:.1f} MiB during the read"
    assert outcome.startswith("OutputTooLarge: "), outcome
    assert f"its share of the read's output cap of {DEFAULT_CAP} bytes" in outcome
    assert elapsed < 30, "the cap must end the read, not the deadline"


# --- reaping as PID 1 --------------------------------------------------------------------------

_AS_PID_1 = textwrap.dedent("""
    import os, sys, time
    from mig_exporter.core.deadline import Deadline
    from mig_exporter.core.errors import ReadError
    from mig_exporter.sources.nvidia_smi import NvidiaSmiSource
    assert os.getpid() == 1, os.getpid()
    source = NvidiaSmiSource(sys.argv[1], timeout_s=0.3)
    failed = 0
    for _ in range(10):
        try:
            source.read(Deadline.after(0.3))
        except ReadError:
            failed += 1

    def processes():
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                out.append((int(entry), stat[stat.rindex(")") + 2]))
        return out

    deadline = time.monotonic() + 2  # SIGKILL lands asynchronously
    while processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    left = processes()
    print(failed, len([p for p, state in left if state == "Z"]), len([p for p, state in left if state != "Z"]))
""")


def test_as_pid_1_the_orphans_of_killed_reads_are_reaped(fake_nvidia_smi):
    """In a PID namespace of its own (as in a container started without --init), the exporter is
    PID 1: the children its commands started (`sleep 600 &`), killed with their process group at
    the read's deadline, are handed to it, and nobody else will reap them. After 10 hung reads no
    zombie is left, and nothing else is running."""
    unshare = require_tool("unshare")
    smi = h100(fake_nvidia_smi, mode="hang", list_mode="hang")
    argv = [unshare, "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        argv.insert(1, "--map-root-user")
    result = subprocess.run([*argv, sys.executable, "-c", _AS_PID_1, str(smi)], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    failed, zombies, live = (int(x) for x in result.stdout.split())
    assert failed == 10
    assert zombies == 0, f"{zombies} zombies after 10 hung reads as PID 1"
    assert live == 0


# --- grandchildren that escape the process group -------------------------------------------------

def test_read_kills_the_grandchildren_that_escaped_and_does_not_wait_for_their_stdout(fake_nvidia_smi):
    """nvidia-smi prints its report and exits, leaving a grandchild in a session of its own that
    ignores SIGTERM and holds stdout open. `read` answers at once (it does not wait for that stdout
    to close until its deadline), and leaves no such grandchild running."""
    require_tool("setsid")
    smi = h100(fake_nvidia_smi, mode="escape", list_mode="escape")
    pids: list[int] = []
    try:
        for _ in range(2):
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "mig_exporter", "read", "--nvidia-smi", str(smi),
                                     "--timeout", "10"], capture_output=True, text=True, timeout=30)
            elapsed = time.monotonic() - started
            assert result.returncode == 0, result.stderr
            assert 'mig_exporter_read_success{source="nvidia-smi"} 1.0' in result.stdout
            assert elapsed < 5, f"read took {elapsed:.1f}s: it waited for the grandchildren's stdout"
            pids = escaped(smi)
            assert pids, "the fake never left its grandchildren"
            assert survivors(pids) == [], f"grandchildren still running after the read: {survivors(pids)}"
    finally:
        kill_all(escaped(smi))


_HELPER_OF_A_RUNNING_COMMAND = textwrap.dedent("""
    import os, sys, threading, time
    from mig_exporter.core.deadline import Deadline
    from mig_exporter.sources.command import reaping, run_command
    pidfile = sys.argv[1]
    # A double-forks a helper into a session of its own and waits for its answer (0.5 s); the
    # helper then stays, holding A's stdout.
    a = ("( setsid sh -c 'sleep 0.5; echo $$ > \\"$0.tmp\\"; mv \\"$0.tmp\\" \\"$0\\"; exec sleep 600' \\"$0\\" & ); "
         "i=0; while [ ! -e \\"$0\\" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i + 1)); done; cat \\"$0\\"")
    result = {}
    with reaping():
        worker = threading.Thread(
            target=lambda: result.update(a=run_command(["sh", "-c", a, pidfile], Deadline.after(10))))
        worker.start()
        others = 0
        while worker.is_alive() and others < 500:  # other commands end, and sweep, while A's helper works
            run_command(["true"], Deadline.after(5))
            others += 1
        worker.join(15)
    done = result.get("a")
    print(done.stdout.decode().strip() if done else "failed", done.duration_s if done else 0, others)
""")


def test_a_sweep_spares_what_a_command_still_running_left_and_its_own_sweep_does_not(tmp_path):
    """Sweeps run after every command; what a command still running double-forked away (here a
    helper it waits for) carries that command's token and is left alone until that command ends,
    when its own sweep kills it."""
    require_tool("setsid")
    pidfile = tmp_path / "helper.pid"
    try:
        result = subprocess.run([sys.executable, "-c", _HELPER_OF_A_RUNNING_COMMAND, str(pidfile)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        helper, duration, others = result.stdout.split()
        assert helper != "failed"
        assert int(others) > 5, "no other command ran while the helper worked"
        assert int(helper) == int(pidfile.read_text())
        assert float(duration) < 3, "the command waited for its helper's stdout"
        assert survivors([int(helper)]) == []
    finally:
        if pidfile.exists():
            kill_all([int(pidfile.read_text())])


def _metrics(url: str, timeout_header: str | None = None) -> str:
    request = urllib.request.Request(url + "/metrics")
    if timeout_header is not None:
        request.add_header("X-Prometheus-Scrape-Timeout-Seconds", timeout_header)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def test_serve_kills_escaped_grandchildren_after_each_read_and_at_shutdown(fake_nvidia_smi, tmp_path):
    """Each scrape's read leaves grandchildren that escaped the group: they are gone when the scrape
    answers, and the next scrape does not wait on them. Then a read is left in flight with its
    grandchildren running, and SIGTERM stops serve: none of them survives it."""
    from test_cli import cli_env, serving

    require_tool("setsid")
    smi = h100(fake_nvidia_smi, mode="escape", list_mode="escape")
    hung = h100(fake_nvidia_smi, mode="escape-hang", list_mode="escape-hang")
    config = tmp_path / "mig.yml"
    config.write_text(f"probe_targets:\n  hung: {{command: ['{hung}'], timeout: 60s}}\n")
    try:
        with serving("--nvidia-smi", str(smi), "--timeout", "20", "--config.file", str(config),
                     "--web.listen-address", "127.0.0.1:0", env=cli_env()) as server:
            for scrape in range(3):
                started = time.monotonic()
                body = _metrics(server.url, timeout_header="10")
                elapsed = time.monotonic() - started
                assert 'mig_exporter_read_success{source="nvidia-smi"} 1.0' in body, f"scrape {scrape}"
                assert elapsed < 5, f"scrape {scrape} took {elapsed:.1f}s"
                assert len(escaped(smi)) == 2 * (scrape + 1)
                assert survivors(escaped(smi)) == [], f"scrape {scrape}: grandchildren still running"

            # A probe whose commands leave their grandchildren and then hang: stop serve under it.
            probe = threading.Thread(target=_ignore, args=(server.url + "/probe?target=hung",), daemon=True)
            probe.start()
            deadline = time.monotonic() + 10
            while len(escaped(hung)) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(escaped(hung)) == 2, "the hung probe never left its grandchildren"
            assert all(running(pid) for pid in escaped(hung))
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(timeout=10) == 0
            probe.join(10)
        assert survivors(escaped(hung)) == [], "grandchildren survived serve's shutdown"
    finally:
        kill_all(escaped(smi) + escaped(hung))


def _ignore(url: str) -> None:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=60) as response:
        response.read()  # or not: the server is stopped under the request


# --- reaper.py -----------------------------------------------------------------------------------

def test_child_pids_lists_this_process_children_with_or_without_children_files(tmp_path):
    from mig_exporter.sources.reaper import child_pids
    from proc_tree import Proc, make_proc

    sleepers = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        assert {p.pid for p in sleepers} <= child_pids()
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    # A /proc without task/TID/children files (no CONFIG_PROC_CHILDREN): every process's parent.
    me = os.getpid()
    root = make_proc(tmp_path / "proc", [Proc(70001, "sleep", ["sleep", "30"], ppid=me),
                                         Proc(70002, "sleep", ["sleep", "30"], ppid=1)], self_pid=me)
    assert child_pids(str(root)) == {70001}


def test_the_child_subreaper_flag_is_set_and_given_up():
    from mig_exporter.sources.command import reaping
    from mig_exporter.sources.reaper import is_child_subreaper

    assert not is_child_subreaper()
    with reaping() as done:
        assert done and is_child_subreaper()
    assert not is_child_subreaper()


def test_orphans_are_found_among_the_main_threads_children_and_other_threads_children_are_not(tmp_path):
    """The kernel hands an orphan to its reaper's first living thread, the main thread: a sweep
    reads that thread's children alone. A grandchild whose parent has exited is there once
    this process is its subreaper; a child another thread started is that thread's and is not,
    while that thread lives."""
    from mig_exporter.sources.command import reaping
    from mig_exporter.sources.reaper import child_pids, orphan_pids

    require_tool("setsid")
    pidfile = tmp_path / "orphan.pid"
    started: list[subprocess.Popen[bytes]] = []
    checked = threading.Event()

    def start_and_stay() -> None:  # a thread that ends hands its children to the main thread
        started.append(subprocess.Popen(["sleep", "30"]))
        checked.wait(30)

    worker = threading.Thread(target=start_and_stay)
    orphan = None
    with reaping():
        try:
            worker.start()
            while not started and worker.is_alive():
                time.sleep(0.01)
            # sh starts a grandchild in the background and exits: the grandchild is handed to us.
            subprocess.run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}"], check=True)
            orphan = int(pidfile.read_text())
            deadline = time.monotonic() + 5
            while orphan not in orphan_pids() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert orphan in orphan_pids()
            assert started[0].pid not in orphan_pids()
            assert {orphan, started[0].pid} <= child_pids()
        finally:
            checked.set()
            worker.join()
            for proc in started:
                proc.kill()
                proc.wait()
            if orphan is not None:
                kill_all([orphan])
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(orphan, 0)
