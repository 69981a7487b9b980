"""Run a command safely: an argv list (never a shell), a deadline, a cap on
output, and a kill of the whole process group when the command is done.

nvidia-smi can hang in uninterruptible sleep when the driver wedges, and a
wrapper (``chroot``, ``ssh``) can leave children behind; killing only the
direct child would leak them. Each command therefore starts in a new session
(its own process group). On timeout, overflow or cancellation the whole group
gets SIGKILL; when the command exits, whatever it left running in its group is
killed too, at once (so a leftover holding our pipes does not hold the read to
its deadline). Groups still running when the exporter stops are killed by
``kill_running()``.

A read's commands (``-q -x`` and ``-L``, and ``pmon`` where a whole card has
processes) run side by side, read in the calling thread (``run_commands``):
one wait covers all their pipes and exits, and no thread is started for them.
A command the read can go without (pmon) may have a deadline of its own,
sooner than the read's.

The output cap is a read's, not a command's: the commands of one read share an
``OutputBudget``, and the first to take the read past it is killed.

Grandchildren that leave the group (``setsid()``) escape its kill. Inside
``reaping()`` (``serve`` and ``read``: the process is a child subreaper then,
``reaper.py``) and when the exporter is PID 1, orphans are handed to this
process: after each run of commands (once for a read's two), when a command's
pipes stay open after it exited, and at ``kill_running()``, every child of
ours that is not a command (of those an orphan is handed to: the main
thread's) is killed and reaped, until none is left. Except
those of a command still running (its own helpers, double-forked away): each
command's environment carries ``MIG_EXPORTER_COMMAND``, a token of its own,
which its descendants inherit; an orphan whose token is a running command's
is left to that command's own sweep. A command is never reaped by a sweep: it
is tracked from its start to its reaping, and a sweep waits while a command
is being started (not yet tracked).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from mig_exporter.core import workers
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandError, CommandFailed, CommandNotFound, CommandTimeout, OutputTooLarge
from mig_exporter.sources import reaper

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024 * 1024
_MAX_STDERR_BYTES = 64 * 1024
# A pipe holds 64 KiB (Linux's default), so no read returns more; a larger
# request only allocates (and maps) a larger buffer at every read.
_CHUNK = 64 * 1024
_REAP_GRACE_S = 0.05
_CANCEL_POLL_S = 0.05
# A command's pipes still open this long after it exited are held by something
# that escaped its group (its output left in them is read within microseconds).
_HELD_S = 0.01
# How long a sweep waits for what it killed to die and hand its own children on
# (SIGKILL lands within milliseconds, except in uninterruptible sleep).
_SWEEP_S = 0.25
_SHUTDOWN_SWEEP_S = 1.0

# Every command's child, from its start until it is reaped (by pid). The lock
# is held across each reaping of them, and by the sweep while it lists, kills
# and reaps; a sweep does nothing while a command is being started
# (``_starting``: forked, not yet in ``_children``). So the sweep never takes
# a command for an orphan. The fork itself is outside the lock: an exec that
# hangs (a binary on a dead mount) must not hold every other read. Reentrant:
# SIGTERM's handler (cli.py) may run kill_running() in a thread that holds it.
_children: dict[int, subprocess.Popen[bytes]] = {}
_starting = 0
# The tokens of the commands still running (by pid), which their descendants carry.
_running: dict[int, str] = {}
_lock = threading.RLock()
_started = threading.Condition(_lock)  # notified as each start ends (``_starting`` lowered)
_START_WAIT_S = 1.0  # how long kill_running waits for starts under way to be recorded
_reaping = 0
_serial = itertools.count(1)
TOKEN_VARIABLE = "MIG_EXPORTER_COMMAND"
_TOKEN_KEY = TOKEN_VARIABLE.encode()


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    stdout: bytes
    stderr: bytes
    duration_s: float


class OutputBudget:
    """The stdout bytes one or more commands may hold, in all. A read gives each
    of its commands (``-q -x`` and ``-L`` run in parallel) a share of its cap
    (``read_cap``), so a read that floods on both holds at most the cap, not
    the cap per command; fixed shares, because with one shared count the
    command that crossed the cap first was killed, which could be a ``-q -x``
    of a few KiB beside a flooding ``-L``. A command that fails gives back
    what it took as its output is dropped."""

    def __init__(self, limit: int, *, shared: bool = True, read_cap: int | None = None) -> None:
        self.limit = limit
        self.shared = shared
        self.read_cap = read_cap
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, size: int) -> bool:
        """Count ``size`` more bytes, if the total stays within the limit; whether it does."""
        with self._lock:
            if self._used + size > self.limit:
                return False
            self._used += size
            return True

    def give_back(self, size: int) -> None:
        with self._lock:
            self._used -= size

    def refusal(self, shown: str) -> str:
        if self.read_cap is not None:
            return (f"{shown}: wrote more than {self.limit} bytes, its share of the read's output cap of "
                    f"{self.read_cap} bytes; process group killed")
        if not self.shared:
            return f"{shown}: wrote more than {self.limit} bytes; process group killed"
        return f"{shown}: the read's commands (one cap for them all) wrote more than {self.limit} bytes; " \
               "process group killed"


def run_command(
    argv: Sequence[str],
    deadline: Deadline,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    cancel: threading.Event | None = None,
    output_budget: OutputBudget | None = None,
) -> CommandResult:
    """Run ``argv`` to completion by ``deadline`` and return its output.

    ``output_budget``: the read's, shared with its other commands; without
    one, the command may write ``max_output_bytes`` on its own.

    Raises ``CommandNotFound``, ``CommandTimeout`` (also when ``cancel`` is
    set first), ``OutputTooLarge`` or ``CommandFailed`` (non-zero exit, with
    the first line of stderr, or of stdout where nvidia-smi writes its errors).
    """
    budget = output_budget if output_budget is not None else OutputBudget(max_output_bytes, shared=False)
    (answer,) = run_commands([(argv, budget)], deadline, cancel)
    if isinstance(answer, CommandError):
        raise answer
    return answer


def run_commands(
    commands: Sequence[tuple[Sequence[str], OutputBudget]],
    deadline: Deadline,
    cancel: threading.Event | None = None,
    started: Callable[[], None] | None = None,
    sooner: Sequence[Deadline | None] = (),
) -> list[CommandResult | CommandError]:
    """Run the commands side by side, each with its stdout budget, by ``deadline``; each one's
    result or error, in order (the errors ``run_command`` raises). ``started`` is called once
    every command is running (or failed to start), before their output is waited for.
    ``sooner``: a deadline of a command's own, by position, for one the read can go without
    (``nvidia-smi pmon``): it is killed then, and the others go on to ``deadline``.

    Read in the calling thread: one wait covers every pipe of every command. The later
    commands are started in a kept worker thread while the first starts here, so a read
    starts no thread once one is idle. The first command is the one the others serve: when it fails,
    the others are killed at once, each answered as cancelled; one that cannot be started at
    all raises its ``CommandNotFound`` and starts nothing more.
    """
    owns = [*sooner, *[None] * (len(commands) - len(sooner))]
    runs = [_Run(tuple(argv), budget, deadline if own is None else min(deadline, own))
            for (argv, budget), own in zip(commands, owns, strict=True)]
    try:
        _start_all(runs)
        if started is not None:
            started()
        _collect(runs, cancel)
        for run in runs:
            if run.outcome == "eof" and run.proc is not None and run.proc.returncode is None:
                run.outcome = _wait_exited(run.proc, run.deadline, cancel)  # no pidfd: polled
    finally:
        # Also on KeyboardInterrupt or SystemExit: never leave a group behind.
        _finish(runs)
        for run in runs:
            if run.outcome != "eof":
                run.drop()  # the output goes with the error: so does its share of the budget
    return [run.answer() for run in runs]


def _start_all(runs: list[_Run]) -> None:
    """Start every command: the first in this thread and, at the same time, the others in a
    kept worker (``core/workers.py``: no thread is started for it once one is idle). A start
    holds its thread until the child has called exec (vfork), which on a busy machine can
    take a millisecond or more; one after the other, the read would wait for both.

    Raises the first command's ``CommandNotFound`` once the others have been started (so
    that they are killed with it); theirs are kept as their answers."""
    rest = runs[1:]
    started = threading.Event()

    def start_rest() -> None:
        try:
            for run in rest:
                _start(run)
        finally:
            started.set()

    in_worker = False
    if rest:
        try:
            workers.WORKERS.start(start_rest, "command-start")
            in_worker = True
        except RuntimeError:  # no thread to be had (a pids limit): one after the other, here
            pass
    try:
        runs[0].proc = _spawn(runs[0].argv)
    finally:
        # Even when the first failed: what the worker started must be there to kill. A start
        # that hangs (an exec on a dead mount) holds the read as the first command's would.
        if in_worker:
            started.wait()
    if not in_worker:
        for run in rest:
            _start(run)


def _start(run: _Run) -> None:
    try:
        run.proc = _spawn(run.argv)
    except CommandNotFound as e:
        run.error = e
    except Exception as e:  # never expected (_spawn maps OSError): still the command's answer, not the read's
        run.error = CommandNotFound(f"{run.argv[0]}: cannot start: {e}")


class _Run:
    """One command of ``run_commands``: its child, its output so far, how it ended."""

    def __init__(self, argv: tuple[str, ...], budget: OutputBudget, deadline: Deadline) -> None:
        self.argv = argv
        self.budget = budget
        self.deadline = deadline  # the read's, or a sooner one of its own
        self.started = time.monotonic()
        self.proc: subprocess.Popen[bytes] | None = None
        self.error: CommandError | None = None  # could not be started
        # Chunks as read, joined once at the end: one copy of a large -q -x, not a growing buffer's and then bytes()'s.
        self.stdout: list[bytes] = []
        self.stdout_bytes = 0
        self.stderr = bytearray()
        self.open_pipes = 2
        self.pidfd: int | None = None  # readable once the child has exited; closed then
        self.exited_at: float | None = None  # when its exit was seen, its pipes still open (until swept)
        self.swept = False  # a sweep that left nothing has run since it was reaped
        self.outcome = "interrupted"  # then "running", and at last "eof" or how it was stopped
        self.stopped_at: float | None = None  # when it was stopped (its own deadline may come first)

    @property
    def done(self) -> bool:
        """Ended: stopped, or its pipes at EOF and its exit seen (or not to be seen: no pidfd)."""
        return self.outcome != "running" or (self.open_pipes == 0 and self.pidfd is None)

    def answer(self) -> CommandResult | CommandError:
        if self.error is not None:
            return self.error
        shown = " ".join(self.argv).replace("\n", "\\n")
        elapsed = (time.monotonic() if self.stopped_at is None else self.stopped_at) - self.started
        if self.outcome in ("timeout", "interrupted"):
            return CommandTimeout(f"{shown}: timed out after {elapsed:.1f}s; process group killed")
        if self.outcome == "cancelled":
            return CommandTimeout(f"{shown}: cancelled after {elapsed:.1f}s; process group killed")
        if self.outcome == "overflow":
            return OutputTooLarge(self.budget.refusal(shown))
        assert self.proc is not None
        returncode = self.proc.returncode
        if returncode != 0:
            reason = _first_line(bytes(self.stderr)) or _first_line(b"".join(self.stdout)) or "no output"
            what = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
            self.drop()
            return CommandFailed(f"{shown}: {what}: {reason}")
        return CommandResult(self.argv, b"".join(self.stdout), bytes(self.stderr), elapsed)

    def drop(self) -> None:
        """Let go of the output, and give its share of the budget back."""
        self.budget.give_back(self.stdout_bytes)
        self.stdout.clear()
        self.stdout_bytes = 0

    def failed(self) -> bool:
        """Ended, and not with a clean exit."""
        return self.outcome not in ("running", "eof") or (
            self.done and self.proc is not None and self.proc.returncode not in (None, 0))

    def stop(self, outcome: str, sel: selectors.BaseSelector) -> None:
        """Stop reading it (its group is killed by ``_finish``)."""
        self.outcome = outcome
        self.stopped_at = time.monotonic()
        self.close(sel)

    def close(self, sel: selectors.BaseSelector) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        for pipe in (self.proc.stdout, self.proc.stderr):
            if not pipe.closed:
                with contextlib.suppress(KeyError):
                    sel.unregister(pipe)
                pipe.close()
        self.open_pipes = 0
        self.end_pidfd(sel)

    def end_pidfd(self, sel: selectors.BaseSelector) -> None:
        if self.pidfd is not None:
            sel.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None


def kill_running() -> int:
    """SIGKILL the process group of every command still running; return how many.

    For shutdown: a read in flight when the exporter is stopped must not leave
    nvidia-smi (or a wrapper's children) behind. Reaping (``reaping()``, PID 1),
    it then kills and reaps the orphans, escaped grandchildren included, until
    none is left (or a second has passed). A command forked but not yet recorded (its
    start still returning in another thread) is waited for up to a second and killed
    too: it may already be running, and would outlive us in its own session.
    """
    with _lock:
        _started.wait_for(lambda: _starting == 0, _START_WAIT_S)
        procs = [proc for proc in _children.values() if proc.returncode is None]
        for proc in procs:
            _signal_group(proc)
        _running.clear()  # what they left is no longer anyone's to wait for
    if _is_reaping():
        _sweep(procs, _SHUTDOWN_SWEEP_S)
    return len(procs)


@contextlib.contextmanager
def reaping() -> Iterator[bool]:
    """Make this process the reaper of what its commands leave: a child
    subreaper, so escaped grandchildren are handed to it, and a sweep after
    each command. For a process that owns its children (``serve``, ``read``):
    the sweep kills every child that is not a command (nor left by one still
    running). Yields whether the subreaper flag could be set. PID 1 sweeps
    without it, always."""
    global _reaping
    was = reaper.is_child_subreaper()
    done = was or reaper.set_child_subreaper(True)
    with _lock:
        _reaping += 1
    try:
        yield done
    finally:
        with _lock:
            _reaping -= 1
        if done and not was:
            reaper.set_child_subreaper(False)


def _is_reaping() -> bool:
    # PID 1 of a PID namespace (a container without --init) gets every orphan
    # in it: nobody else would reap them.
    return _reaping > 0 or os.getpid() == 1


def _environment() -> dict[bytes, bytes]:
    """A copy of this process's environment, as bytes (what a child is given). Copied from the
    bytes ``os.environ`` keeps (``_data``, shared with ``os.environb``) where there are any: at C
    speed, where iterating ``os.environ`` decodes each name and value and Popen encodes them back
    (some 30 µs a command)."""
    data = getattr(os.environb, "_data", None)
    if isinstance(data, dict):
        return dict(data)
    return dict(os.environb)


def _spawn(argv: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, tracked from its start on."""
    global _starting
    token = f"{os.getpid()}.{next(_serial)}"
    env = _environment()
    env[_TOKEN_KEY] = token.encode()
    with _lock:
        _starting += 1
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError) as e:
        raise CommandNotFound(f"{argv[0]}: cannot execute: {e.strerror or e}") from None
    except OSError as e:
        raise CommandNotFound(f"{argv[0]}: cannot start: {e.strerror or e}") from None
    else:
        with _lock:
            _children[proc.pid] = proc
            _running[proc.pid] = token
    finally:
        with _lock:
            _starting -= 1
            _started.notify_all()
    return proc


def _collect(runs: list[_Run], cancel: threading.Event | None) -> None:
    """Read every pipe of the started ``runs`` until each has ended: its pipes at EOF and its
    exit seen ("eof"), or stopped: at its deadline ("timeout"), past its budget ("overflow"),
    or cancelled ("cancelled": ``cancel`` set, or the first command failed).

    A command's exit is seen through its pidfd: what it left in its group is killed then, at
    once, and the child reaped. Its output already in the pipes is still read to the end; pipes
    still open ``_HELD_S`` after its exit are held by something that escaped the group, which,
    reaping, a sweep kills then (else it would hold the read to its deadline)."""
    live = [run for run in runs if run.proc is not None]
    with selectors.DefaultSelector() as sel:
        try:
            _register(live, sel)
            while _step(runs, live, sel, cancel):
                pass
        finally:
            for run in live:
                if run.outcome == "running" and run.done:
                    run.outcome = "eof"
                run.close(sel)


def _register(live: list[_Run], sel: selectors.BaseSelector) -> None:
    """Each started run's pipes, and its pidfd where it has one, watched by ``sel``."""
    for run in live:
        assert run.proc is not None and run.proc.stdout is not None and run.proc.stderr is not None
        run.outcome = "running"
        sel.register(run.proc.stdout, selectors.EVENT_READ, (run, True))
        sel.register(run.proc.stderr, selectors.EVENT_READ, (run, False))
        run.pidfd = _open_pidfd(run.proc.pid)
        if run.pidfd is not None:
            sel.register(run.pidfd, selectors.EVENT_READ, (run, None))


def _step(runs: list[_Run], live: list[_Run], sel: selectors.BaseSelector, cancel: threading.Event | None) -> bool:
    """One wait of ``_collect``'s and what it brought; ``False`` once every run has ended."""
    if runs[0].failed():
        for run in live:
            if not run.done:
                run.stop("cancelled", sel)  # of no use without the first
    running = [run for run in live if not run.done]
    if not running:
        return False
    remaining = _wait_for(min(run.deadline for run in running), cancel)
    if remaining == "timeout":
        # Only those due: a command with a sooner deadline of its own ends alone.
        for run in running:
            if run.deadline.expired:
                run.stop(remaining, sel)
        return True
    if isinstance(remaining, str):
        for run in running:
            run.stop(remaining, sel)
        return False
    held = [run for run in running if run.exited_at is not None]
    if held:
        due = min(run.exited_at or 0.0 for run in held) + _HELD_S - time.monotonic()
        if due <= 0:
            _sweep_after(live)
            for run in held:
                run.exited_at = None  # once: what a sweep cannot kill, the deadline ends
            return True
        remaining = min(remaining, due)
    for run in _read_ready(sel, remaining):  # after the pipes: their EOF in the same wait is no held pipe
        if run.outcome == "running":
            assert run.proc is not None
            run.end_pidfd(sel)
            _end_group(run.proc)
            if run.open_pipes:
                run.exited_at = time.monotonic()
    return True


def _read_ready(sel: selectors.BaseSelector, timeout: float) -> list[_Run]:
    """What the pipes ready within ``timeout`` seconds hold, read; the runs whose exit came."""
    exits = []
    for key, _ in sel.select(timeout):
        run, is_stdout = key.data
        if run.outcome != "running":
            continue  # stopped by an event before this one: its pipes are closed
        if is_stdout is None:
            exits.append(run)
            continue
        chunk = os.read(key.fd, _CHUNK)
        if not chunk:
            sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
            run.open_pipes -= 1
        elif is_stdout:
            if not run.budget.take(len(chunk)):
                run.drop()  # now: the read's other command may go on with it
                run.stop("overflow", sel)
                continue
            run.stdout.append(chunk)
            run.stdout_bytes += len(chunk)
        elif len(run.stderr) < _MAX_STDERR_BYTES:
            run.stderr += chunk[: _MAX_STDERR_BYTES - len(run.stderr)]
    return exits


def _wait_for(deadline: Deadline, cancel: threading.Event | None) -> float | str:
    """How long the next wait may block, or "timeout"/"cancelled" when it may
    not; with a cancel event the wait is cut short so a cancel is seen soon."""
    remaining = deadline.left_s()
    if remaining <= 0:
        return "timeout"
    if cancel is None:
        return remaining
    if cancel.is_set():
        return "cancelled"
    return min(remaining, _CANCEL_POLL_S)


def _wait_exited(proc: subprocess.Popen[bytes], deadline: Deadline, cancel: threading.Event | None) -> str:
    """Wait for the child to exit *without reaping it* ("eof"), so its group id
    stays reserved for the kill that follows; or "timeout"/"cancelled" when it
    closed its output but hangs on (a wedged driver call after printing)."""
    pidfd = None if _exited(proc) else _open_pidfd(proc.pid)
    try:
        delay = 0.0005
        while True:
            if _exited(proc):
                return "eof"
            remaining = _wait_for(deadline, cancel)
            if isinstance(remaining, str):
                return remaining
            if pidfd is not None:
                # Readable once the child has exited: no polling delay after a
                # clean exit, which is every read.
                select.select([pidfd], [], [], remaining)
            else:
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.02)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited (reaped already, or a zombie not yet reaped)."""
    with _lock:
        if proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # reaped elsewhere; nothing left to wait for


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # Linux 5.3+
    except (AttributeError, OSError):
        return None


def _signal_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group. Only while the child is unreaped (the
    caller holds the lock): its pid, the group id, is reserved until then."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _reap(proc: subprocess.Popen[bytes]) -> bool:
    """Reap the child if it has exited, and stop tracking it; whether it is reaped."""
    with _lock:
        if proc.returncode is None:
            proc.poll()
        if proc.returncode is None:
            return False
        if _children.get(proc.pid) is proc:
            del _children[proc.pid]
        return True


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """The command has exited: SIGKILL what it left in its group and reap it."""
    with _lock:
        _running.pop(proc.pid, None)
        _signal_group(proc)
        _reap(proc)


def _finish(runs: list[_Run]) -> None:
    """SIGKILL the whole process group of each command of ``runs`` still unreaped, then reap
    them and, reaping, the orphans they left: one sweep for them all, unless one has run
    since the last of them was reaped and left nothing.

    The group id is the child's pid (it leads its own session) and stays
    reserved until the child is reaped, so the kill cannot hit a stranger.
    """
    procs = [run.proc for run in runs if run.proc is not None]
    with _lock:
        for proc in procs:
            if proc.returncode is None:
                _running.pop(proc.pid, None)
            _signal_group(proc)
    for proc in procs:  # the pipes, where _collect never got to them
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    # SIGKILL is acted on at once except in uninterruptible sleep (a wedged
    # driver call). Do not let such a child hold the caller past its deadline:
    # a daemon thread reaps it whenever the kernel lets it go.
    grace = Deadline.after(_REAP_GRACE_S)
    for proc in procs:
        if proc.returncode is None and (_wait_exited(proc, grace, None) != "eof" or not _reap(proc)):
            threading.Thread(target=_reap_later, args=(proc,), name=f"reap-{proc.pid}", daemon=True).start()
    if any(run.proc is not None and not run.swept for run in runs):
        _sweep_after(runs)


def _sweep_after(runs: list[_Run]) -> None:
    """Reaping, sweep up what the commands of ``runs`` reaped so far left; mark them swept
    when the sweep leaves nothing."""
    if not _is_reaping():
        return
    reaped = [run for run in runs if run.proc is not None and run.proc.returncode is not None]
    if _sweep([]):
        for run in reaped:
            run.swept = True


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ChildProcessError):
        if not _exited(proc):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    _reap(proc)
    if _is_reaping():
        _sweep([proc])


def _sweep(commands: Iterable[subprocess.Popen[bytes]], within_s: float = _SWEEP_S) -> bool:
    """Kill and reap every child of ours that is neither a command nor left by
    one still running, until none is left and ``commands`` have exited, or
    ``within_s`` has passed.

    Each one killed hands its own children to us (we are their subreaper, or
    PID 1) once it is dead, so they are found at the next pass; the commands
    hand theirs on when they exit. Whether it ended with none left."""
    waiting = list(commands)
    deadline = Deadline.after(within_s)
    delay = 0.0005
    while True:
        left = _kill_orphans()
        waiting = [proc for proc in waiting if not _exited(proc)]
        if not left and not waiting:
            return True
        if deadline.expired:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _kill_orphans() -> int:
    """SIGKILL and reap (once dead) our children that are neither commands nor
    left by one still running, among those an orphan is handed to (the main
    thread's, ``reaper.orphan_pids``); how many are left unreaped (1 while a
    command is being started: its child is not tracked yet, so nothing is
    touched)."""
    with _lock:
        if _starting:
            return 1
        try:
            pids = reaper.orphan_pids()
        except OSError:
            return 0  # no /proc: nothing to find them by
        running = set(_running.values())
        left = 0
        for pid in pids - _children.keys():
            if running:
                environ = reaper.read_environ(pid)
                if environ == b"" and not reaper.is_zombie(pid):
                    left += 1  # mid-exec, its environment not shown yet: the next pass reads it
                    continue
                if environ and reaper.value_in(environ, TOKEN_VARIABLE) in running:
                    continue  # its command's own sweep will come
            # Our child until we reap it, and only a sweep (under this lock)
            # reaps it: the pid cannot have gone to a stranger.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            try:
                reaped, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if reaped == 0:
                left += 1
        return left


def _first_line(data: bytes) -> str:
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.strip():
            return " ".join(line.split())[:300]
    return ""
