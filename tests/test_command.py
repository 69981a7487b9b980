"""run_command: an argv (never a shell), a deadline, an output cap, and a kill
of the whole process group when either is hit. Every test runs real commands."""

from __future__ import annotations

import os
import shlex
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from conftest import _proc_stats, threads_started
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import (
    CommandError,
    CommandFailed,
    CommandNotFound,
    CommandTimeout,
    OutputTooLarge,
    ReadError,
)
from mig_exporter.sources.command import CommandResult, OutputBudget, run_command

MIB = 1024 * 1024
DRIVER_ERROR = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)

pytestmark = pytest.mark.timeout(30)


# --- /proc helpers -----------------------------------------------------------------------------

def live_members(pgid: int) -> list[tuple[int, str]]:
    """Processes of the group that are still running (not zombies waiting for init)."""
    return [(pid, state) for pid, state, _, pgrp in _proc_stats() if pgrp == pgid and state not in "ZX"]


def zombie_children() -> list[int]:
    """Zombies whose parent is this test process: children nobody reaped."""
    me = os.getpid()
    return [pid for pid, state, ppid, _ in _proc_stats() if ppid == me and state == "Z"]


def wait_until_clean(pgid: int, within_s: float = 1.0) -> tuple[list[tuple[int, str]], list[int]]:
    """Poll briefly (SIGKILL is delivered asynchronously) and return what is left."""
    deadline = time.monotonic() + within_s
    while True:
        left, zombies = live_members(pgid), zombie_children()
        if (not left and not zombies) or time.monotonic() > deadline:
            return left, zombies
        time.sleep(0.02)


def group_leader(pidfile: Path, within_s: float = 2.0) -> int:
    """The pid the command wrote; it leads its own session, so it is also the process group id."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        text = pidfile.read_text().strip() if pidfile.exists() else ""
        if text:
            return int(text)
        time.sleep(0.01)
    raise AssertionError(f"{pidfile} was never written")


# --- success -----------------------------------------------------------------------------------

def test_successful_command_returns_its_stdout_stderr_and_argv() -> None:
    result = run_command(["sh", "-c", "printf 'GPU 0: NVIDIA H100\\n'; printf 'a warning\\n' >&2"], Deadline.after(5))

    assert isinstance(result, CommandResult)
    assert result.stdout == b"GPU 0: NVIDIA H100\n"
    assert result.stderr == b"a warning\n"
    assert result.argv == ("sh", "-c", "printf 'GPU 0: NVIDIA H100\\n'; printf 'a warning\\n' >&2")
    assert 0 <= result.duration_s < 5


def test_output_is_returned_byte_for_byte() -> None:
    every_byte = bytes(range(256)) * 4
    result = run_command(
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)) * 4)"], Deadline.after(10)
    )
    assert result.stdout == every_byte


def test_output_larger_than_one_read_is_returned_whole() -> None:
    # 3 MiB arrives over several reads of the pipe.
    result = run_command(["head", "-c", str(3 * MIB), "/dev/zero"], Deadline.after(5))
    assert result.stdout == b"\0" * (3 * MIB)


def test_command_gets_no_stdin() -> None:
    # With the test's stdin inherited, `cat` would wait for input; with /dev/null it ends at once.
    result = run_command(["cat"], Deadline.after(2))
    assert result.stdout == b""


# --- failure -----------------------------------------------------------------------------------

def test_nonzero_exit_raises_command_failed_with_first_nonempty_stderr_line() -> None:
    argv = ["sh", "-c",
            "printf '\\n   \\nFailed to initialize NVML: Driver/library version mismatch\\nsecond line\\n' >&2; exit 3"]
    with pytest.raises(CommandFailed) as raised:
        run_command(argv, Deadline.after(5))

    message = str(raised.value)
    assert message.startswith("sh -c ")
    assert message.split(": exit status 3: ", 1)[1] == "Failed to initialize NVML: Driver/library version mismatch"
    assert "\n" not in message


def test_nonzero_exit_with_empty_stderr_carries_the_first_stdout_line() -> None:
    # nvidia-smi prints its driver error on stdout and exits 9.
    argv = ["sh", "-c", f"echo; echo {shlex.quote(DRIVER_ERROR)}; echo 'more text'; exit 9"]
    with pytest.raises(CommandFailed) as raised:
        run_command(argv, Deadline.after(5))

    assert str(raised.value).split(": exit status 9: ", 1)[1] == DRIVER_ERROR


def test_nonzero_exit_prefers_stderr_over_stdout() -> None:
    with pytest.raises(CommandFailed) as raised:
        run_command(["sh", "-c", "echo partial output; echo the reason >&2; exit 1"], Deadline.after(5))
    assert str(raised.value).endswith("exit status 1: the reason")


def test_nonzero_exit_without_any_output_says_so() -> None:
    with pytest.raises(CommandFailed) as raised:
        run_command(["sh", "-c", "exit 4"], Deadline.after(5))
    assert str(raised.value).endswith("exit status 4: no output")


def test_death_by_signal_is_reported_as_such() -> None:
    with pytest.raises(CommandFailed) as raised:
        run_command(["sh", "-c", "kill -TERM $$"], Deadline.after(5))
    assert "killed by signal 15" in str(raised.value)


def test_every_command_error_is_a_read_error() -> None:
    for error in (CommandFailed, CommandNotFound, CommandTimeout, OutputTooLarge):
        assert issubclass(error, CommandError)
        assert issubclass(error, ReadError)


# --- not found ---------------------------------------------------------------------------------

def test_missing_binary_raises_command_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "nvidia-smi"
    with pytest.raises(CommandNotFound) as raised:
        run_command([str(missing), "-L"], Deadline.after(5))
    assert str(missing) in str(raised.value)


def test_name_not_on_path_raises_command_not_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CommandNotFound) as raised:
        run_command(["nvidia-smi", "-L"], Deadline.after(5))
    assert str(raised.value).startswith("nvidia-smi: ")


def test_file_without_execute_permission_raises_command_not_found(tmp_path: Path) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho should not run\n")
    script.chmod(0o644)
    with pytest.raises(CommandNotFound) as raised:
        run_command([str(script), "-L"], Deadline.after(5))
    assert str(script) in str(raised.value)


def test_directory_raises_command_not_found(tmp_path: Path) -> None:
    with pytest.raises(CommandNotFound):
        run_command([str(tmp_path), "-L"], Deadline.after(5))


def test_executable_that_is_not_a_program_raises_command_not_found(tmp_path: Path) -> None:
    not_a_program = tmp_path / "nvidia-smi"
    not_a_program.write_bytes(b"\x7fELF-not-really\0\0\0")
    not_a_program.chmod(0o755)
    with pytest.raises(CommandNotFound):
        run_command([str(not_a_program)], Deadline.after(5))


# --- timeout -----------------------------------------------------------------------------------

def test_timeout_kills_the_whole_group_even_when_a_child_holds_the_pipes(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    # The background sleep inherits stdout/stderr: the pipes stay open even if sh alone is killed.
    argv = ["sh", "-c", f"echo $$ > {pidfile}; echo started; sleep 600 & sleep 600"]
    timeout = 0.5

    started = time.monotonic()
    with pytest.raises(CommandTimeout) as raised:
        run_command(argv, Deadline.after(timeout))
    elapsed = time.monotonic() - started

    assert timeout <= elapsed < timeout + 1.0
    assert "timed out" in str(raised.value)
    pgid = group_leader(pidfile)
    left, zombies = wait_until_clean(pgid)
    assert left == [], f"processes of group {pgid} still running: {left}"
    assert zombies == [], f"unreaped children of the test process: {zombies}"


def test_timeout_after_the_command_closed_its_output_still_kills_it(tmp_path: Path) -> None:
    # Printed, closed its pipes, then hung (a driver call stuck after output).
    pidfile = tmp_path / "pid"
    argv = ["sh", "-c", f"echo $$ > {pidfile}; echo done; exec >/dev/null 2>&1; sleep 600"]

    started = time.monotonic()
    with pytest.raises(CommandTimeout):
        run_command(argv, Deadline.after(0.5))
    assert time.monotonic() - started < 1.5

    pgid = group_leader(pidfile)
    left, zombies = wait_until_clean(pgid)
    assert left == []
    assert zombies == []


def test_a_command_that_finishes_in_time_is_not_killed() -> None:
    result = run_command(["sh", "-c", "sleep 0.2; echo finished"], Deadline.after(3))
    assert result.stdout == b"finished\n"
    assert result.duration_s >= 0.2


# --- output cap --------------------------------------------------------------------------------

def test_output_over_the_cap_raises_quickly_with_bounded_memory(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    cap = 1 * MIB
    tracemalloc.start()
    try:
        started = time.monotonic()
        with pytest.raises(OutputTooLarge) as raised:
            run_command(["sh", "-c", f"echo $$ > {pidfile}; exec yes '<gpu>'"], Deadline.after(10),
                        max_output_bytes=cap)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert elapsed < 2.0, "the cap must stop the command, not the timeout"
    assert str(cap) in str(raised.value)
    # The buffer may pass the cap by one read (1 MiB) before the check; never by much more.
    assert peak < cap + 4 * MIB, f"peak Python memory {peak} bytes for a {cap}-byte cap"
    pgid = group_leader(pidfile)
    left, zombies = wait_until_clean(pgid)
    assert left == []
    assert zombies == []


def test_output_exactly_at_the_cap_is_accepted() -> None:
    result = run_command(["head", "-c", "65536", "/dev/zero"], Deadline.after(5), max_output_bytes=65536)
    assert len(result.stdout) == 65536


def test_output_one_byte_over_the_cap_is_refused() -> None:
    with pytest.raises(OutputTooLarge):
        run_command(["head", "-c", "65537", "/dev/zero"], Deadline.after(5), max_output_bytes=65536)


def test_large_stderr_does_not_count_against_the_stdout_cap() -> None:
    # Stderr is kept only for the error line; a chatty command is not refused for it.
    result = run_command(["sh", "-c", "head -c 200000 /dev/zero >&2; echo ok"], Deadline.after(5),
                         max_output_bytes=1024)
    assert result.stdout == b"ok\n"
    assert len(result.stderr) <= 64 * 1024


# --- no shell ----------------------------------------------------------------------------------

def test_shell_metacharacters_in_arguments_are_passed_literally(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"; touch {marker} && echo $(touch {marker}) `touch {marker}` | cat > {marker} *"
    result = run_command(["printf", "%s", hostile], Deadline.after(5))

    assert result.stdout == hostile.encode()
    assert not marker.exists()


def test_an_argv_of_one_string_with_spaces_is_one_program_name() -> None:
    # Without a shell, "echo hi" is the name of a (missing) program, not a command line.
    with pytest.raises(CommandNotFound):
        run_command(["echo hi"], Deadline.after(5))


# --- what a command leaves behind, cancellation, shutdown ------------------------------------

def test_children_left_running_after_a_clean_exit_are_killed(tmp_path: Path) -> None:
    """A wrapper that exits 0 but leaves a background child in its group (one
    that closed our pipes) does not leak it."""
    pidfile = tmp_path / "pid"
    script = f"echo $$ > {shlex.quote(str(pidfile))}; echo hi; sleep 600 >/dev/null 2>&1 &"
    result = run_command(["sh", "-c", script], Deadline.after(5))
    assert result.stdout == b"hi\n"
    left, zombies = wait_until_clean(group_leader(pidfile))
    assert left == [] and zombies == []


def test_cancel_stops_a_running_command_at_once(tmp_path: Path) -> None:
    import threading

    cancel = threading.Event()
    pidfile = tmp_path / "pid"
    threading.Timer(0.2, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(CommandTimeout, match="cancelled"):
        run_command(["sh", "-c", f"echo $$ > {shlex.quote(str(pidfile))}; sleep 600"], Deadline.after(30),
                    cancel=cancel)
    assert time.monotonic() - started < 2.0
    left, zombies = wait_until_clean(group_leader(pidfile))
    assert left == [] and zombies == []


def test_kill_running_takes_down_commands_in_flight(tmp_path: Path) -> None:
    import threading

    from mig_exporter.sources.command import kill_running

    pidfile = tmp_path / "pid"
    errors: list[Exception] = []

    def run() -> None:
        try:
            run_command(["sh", "-c", f"echo $$ > {shlex.quote(str(pidfile))}; sleep 600 & sleep 600"],
                        Deadline.after(30))
        except CommandError as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    pgid = group_leader(pidfile)
    assert kill_running() == 1
    worker.join(5)
    assert not worker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CommandFailed) and "killed by signal 9" in str(errors[0])
    left, zombies = wait_until_clean(pgid)
    assert left == [] and zombies == []


def test_kill_running_waits_for_a_command_forked_but_not_yet_recorded(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A signal can land between a command's fork and its start returning (the child already
    runs: it wrote its pid): shutdown waits for the start to be recorded and kills it too, or
    the command would outlive us in its own session."""
    import subprocess
    import threading

    from mig_exporter.sources import command
    from mig_exporter.sources.command import kill_running

    forked, release = threading.Event(), threading.Event()

    class SlowToReturn(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            forked.set()
            release.wait(10)

    monkeypatch.setattr(command.subprocess, "Popen", SlowToReturn)
    pidfile = tmp_path / "pid"
    errors: list[Exception] = []

    def run() -> None:
        try:
            run_command(["sh", "-c", f"echo $$ > {shlex.quote(str(pidfile))}; exec sleep 600"], Deadline.after(30))
        except CommandError as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    pgid = group_leader(pidfile)
    assert forked.wait(10)
    threading.Timer(0.2, release.set).start()  # the start returns while kill_running waits
    assert kill_running() == 1
    worker.join(5)
    assert not worker.is_alive()
    assert len(errors) == 1 and "killed by signal 9" in str(errors[0])
    left, zombies = wait_until_clean(pgid)
    assert left == [] and zombies == []


# --- several commands side by side (run_commands) ----------------------------------------------

def test_commands_run_side_by_side_and_start_no_thread_once_one_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two commands of 0.4 s each take 0.4 s together. The second is started in a kept worker
    and both are read in the calling thread: after the first run, none starts a thread. Each
    gets its own output, in the order given."""

    from mig_exporter.core import workers
    from mig_exporter.sources.command import OutputBudget, run_commands

    monkeypatch.setattr(workers, "WORKERS", workers.Workers())  # as serve's: threads kept
    commands = [(["sh", "-c", "sleep 0.4; echo first"], OutputBudget(MIB)),
                (["sh", "-c", "sleep 0.4; echo second >&2; echo 2"], OutputBudget(MIB))]
    run_commands([(["true"], OutputBudget(MIB)), (["true"], OutputBudget(MIB))], Deadline.after(10))
    with threads_started() as started_threads:
        started = time.monotonic()
        first, second = run_commands(commands, Deadline.after(10))
        elapsed = time.monotonic() - started
    assert isinstance(first, CommandResult) and isinstance(second, CommandResult)
    assert (first.stdout, second.stdout, second.stderr) == (b"first\n", b"2\n", b"second\n")
    assert 0.4 <= elapsed < 0.75
    assert started_threads == set()


def test_when_the_first_command_fails_the_others_are_cancelled_at_once(tmp_path: Path) -> None:
    from mig_exporter.sources.command import OutputBudget, run_commands

    pidfile = tmp_path / "pid"
    started = time.monotonic()
    failed, cancelled = run_commands([
        (["sh", "-c", f"while [ ! -s {shlex.quote(str(pidfile))} ]; do sleep 0.01; done; echo {DRIVER_ERROR!r} >&2; "
                      "exit 9"], OutputBudget(MIB)),
        (["sh", "-c", f"echo $$ > {shlex.quote(str(pidfile))}; sleep 600"], OutputBudget(MIB)),
    ], Deadline.after(30))
    assert time.monotonic() - started < 2.0
    assert isinstance(failed, CommandFailed) and str(failed).endswith(f"exit status 9: {DRIVER_ERROR}")
    assert isinstance(cancelled, CommandTimeout) and ": cancelled after " in str(cancelled)
    left, zombies = wait_until_clean(group_leader(pidfile))
    assert left == [] and zombies == []


def test_a_later_command_failing_leaves_the_first_to_finish() -> None:
    from mig_exporter.sources.command import OutputBudget, run_commands

    first, second = run_commands([(["sh", "-c", "sleep 0.2; echo done"], OutputBudget(MIB)),
                                  (["sh", "-c", "echo no >&2; exit 3"], OutputBudget(MIB)),
                                  ], Deadline.after(10))
    assert isinstance(first, CommandResult) and first.stdout == b"done\n"
    assert isinstance(second, CommandFailed) and str(second).endswith("exit status 3: no")


def test_a_later_command_that_cannot_start_is_its_answer_and_the_first_still_runs(tmp_path: Path) -> None:
    from mig_exporter.sources.command import OutputBudget, run_commands

    first, missing = run_commands([(["echo", "hi"], OutputBudget(MIB)),
                                   ([str(tmp_path / "absent")], OutputBudget(MIB))], Deadline.after(5))
    assert isinstance(first, CommandResult) and first.stdout == b"hi\n"
    assert isinstance(missing, CommandNotFound) and "cannot execute" in str(missing)


def test_a_command_sees_the_environment_as_it_is_now_and_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment is copied at each start: a variable set (or removed) since the last
    command is seen so; and the command carries a token of its own."""
    script = 'printf "%s|%s|%s" "$MIG_TEST_ADDED" "${MIG_TEST_REMOVED-unset}" "$MIG_EXPORTER_COMMAND"'
    monkeypatch.setenv("MIG_TEST_REMOVED", "here")
    monkeypatch.setenv("MIG_TEST_ADDED", "first")
    before = run_command(["sh", "-c", script], Deadline.after(5)).stdout.decode().split("|")
    monkeypatch.setenv("MIG_TEST_ADDED", "then é")
    monkeypatch.delenv("MIG_TEST_REMOVED")
    after = run_command(["sh", "-c", script], Deadline.after(5)).stdout.decode().split("|")
    assert before[:2] == ["first", "here"]
    assert after[:2] == ["then é", "unset"]
    assert before[2].startswith(f"{os.getpid()}.") and after[2].startswith(f"{os.getpid()}.")
    assert before[2] != after[2]


def test_run_commands_says_when_every_command_runs_before_waiting_for_them() -> None:
    """``started`` is called once both children are running (tracked), before their output is
    waited for: the scrape starts its /proc read then, not while nvidia-smi is being started."""
    from mig_exporter.sources import command

    seen: list[int] = []
    results = command.run_commands(
        [(["sh", "-c", "sleep 0.2; echo a"], OutputBudget(1 << 20)),
         (["sh", "-c", "sleep 0.2; echo b"], OutputBudget(1 << 20))],
        Deadline.after(10), started=lambda: seen.append(len(command._running)))
    assert seen == [2]
    assert [r.stdout for r in results] == [b"a\n", b"b\n"]  # type: ignore[union-attr]
