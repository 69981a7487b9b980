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

The output cap is a read's, not a command's: the commands of one read share an
``OutputBudget``, and the first to take the read past it is killed.

Grandchildren that leave the group (``setsid()``) escape its kill. Inside
``reaping()`` (``serve`` and ``read``: the process is a child subreaper then,
``reaper.py``) and when the exporter is PID 1, orphans are handed to this
process: after each command, and at ``kill_running()``, every child of ours
that is not a command is killed and reaped, until none is left. Except those
of a command still running (its own helpers, double-forked away): each
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import CommandFailed, CommandNotFound, CommandTimeout, OutputTooLarge
from mig_exporter.sources import reaper

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024 * 1024
_MAX_STDERR_BYTES = 64 * 1024
# A pipe holds 64 KiB (Linux's default), so no read returns more; a larger
# request only allocates (and maps) a larger buffer at every read.
_CHUNK = 64 * 1024
_REAP_GRACE_S = 0.05
_CANCEL_POLL_S = 0.05
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
_reaping = 0
_serial = itertools.count(1)
TOKEN_VARIABLE = "MIG_EXPORTER_COMMAND"


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
    argv = tuple(argv)
    shown = " ".join(argv).replace("\n", "\\n")
    budget = output_budget if output_budget is not None else OutputBudget(max_output_bytes, shared=False)
    started = time.monotonic()
    proc = _spawn(argv)
    stdout = bytearray()
    stderr = bytearray()
    outcome = "interrupted"
    try:
        outcome = _collect(proc, deadline, stdout, stderr, budget, cancel)
        if outcome == "eof":
            outcome = _wait_exited(proc, deadline, cancel)
    finally:
        # Also on KeyboardInterrupt or SystemExit: never leave the group behind.
        _finish(proc)
        if outcome != "eof":
            _drop(stdout, budget)  # the output goes with the error: so does its share of the budget
    elapsed = time.monotonic() - started
    if outcome == "timeout":
        raise CommandTimeout(f"{shown}: timed out after {elapsed:.1f}s; process group killed")
    if outcome == "cancelled":
        raise CommandTimeout(f"{shown}: cancelled after {elapsed:.1f}s; process group killed")
    if outcome == "overflow":
        raise OutputTooLarge(budget.refusal(shown))
    returncode = proc.returncode
    if returncode != 0:
        reason = _first_line(bytes(stderr)) or _first_line(bytes(stdout)) or "no output"
        what = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        _drop(stdout, budget)
        raise CommandFailed(f"{shown}: {what}: {reason}")
    return CommandResult(argv, bytes(stdout), bytes(stderr), elapsed)


def kill_running() -> int:
    """SIGKILL the process group of every command still running; return how many.

    For shutdown: a read in flight when the exporter is stopped must not leave
    nvidia-smi (or a wrapper's children) behind. Reaping (``reaping()``, PID 1),
    it then kills and reaps the orphans, escaped grandchildren included, until
    none is left (or a second has passed).
    """
    with _lock:
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


def _spawn(argv: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own, tracked from its start on."""
    global _starting
    token = f"{os.getpid()}.{next(_serial)}"
    env = {**os.environ, TOKEN_VARIABLE: token}
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
    return proc


def _collect(
    proc: subprocess.Popen[bytes],
    deadline: Deadline,
    stdout: bytearray,
    stderr: bytearray,
    budget: OutputBudget,
    cancel: threading.Event | None,
) -> str:
    """Read both pipes until EOF ("eof"), the deadline ("timeout"), the
    budget ("overflow") or cancellation ("cancelled").

    When the command exits first, what it left in its group (and, reaping,
    what escaped it) is killed at once: a leftover that holds the pipes would
    otherwise hold the read to its deadline. The output already in the pipes
    is still read to the end."""
    assert proc.stdout is not None and proc.stderr is not None
    pidfd = _open_pidfd(proc.pid)
    open_pipes = 2
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, stdout)
        sel.register(proc.stderr, selectors.EVENT_READ, stderr)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ, None)  # readable once the command has exited
        try:
            while open_pipes:
                remaining = _wait_for(deadline, cancel)
                if isinstance(remaining, str):
                    return remaining
                for key, _ in sel.select(remaining):
                    if key.data is None:
                        sel.unregister(key.fileobj)
                        _end_group(proc)
                        continue
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_pipes -= 1
                        continue
                    buffer: bytearray = key.data
                    if buffer is stdout:
                        if not budget.take(len(chunk)):
                            _drop(stdout, budget)  # now: the read's other command may go on with it
                            return "overflow"
                        buffer += chunk
                    elif len(buffer) < _MAX_STDERR_BYTES:
                        buffer += chunk[: _MAX_STDERR_BYTES - len(buffer)]
            return "eof"
        finally:
            proc.stdout.close()
            proc.stderr.close()
            if pidfd is not None:
                os.close(pidfd)


def _drop(stdout: bytearray, budget: OutputBudget) -> None:
    budget.give_back(len(stdout))
    stdout.clear()


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
    """The command has exited: SIGKILL what it left in its group, reap it and,
    reaping, sweep up what escaped the group."""
    with _lock:
        _running.pop(proc.pid, None)
        _signal_group(proc)
        _reap(proc)
    if _is_reaping():
        _sweep([proc])


def _finish(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group, then reap the child and,
    reaping, the orphans it left.

    The group id is the child's pid (it leads its own session) and stays
    reserved until the child is reaped, so the kill cannot hit a stranger.
    """
    with _lock:
        if proc.returncode is None:
            _running.pop(proc.pid, None)
        _signal_group(proc)
    # SIGKILL is acted on at once except in uninterruptible sleep (a wedged
    # driver call). Do not let such a child hold the caller past its deadline:
    # a daemon thread reaps it whenever the kernel lets it go.
    if _wait_exited(proc, Deadline.after(_REAP_GRACE_S), None) != "eof" or not _reap(proc):
        threading.Thread(target=_reap_later, args=(proc,), name=f"reap-{proc.pid}", daemon=True).start()
        return
    if _is_reaping():
        _sweep([proc])


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ChildProcessError):
        if not _exited(proc):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    _reap(proc)
    if _is_reaping():
        _sweep([proc])


def _sweep(commands: Iterable[subprocess.Popen[bytes]], within_s: float = _SWEEP_S) -> None:
    """Kill and reap every child of ours that is neither a command nor left by
    one still running, until none is left and ``commands`` have exited, or
    ``within_s`` has passed.

    Each one killed hands its own children to us (we are their subreaper, or
    PID 1) once it is dead, so they are found at the next pass; the commands
    hand theirs on when they exit."""
    waiting = list(commands)
    deadline = Deadline.after(within_s)
    delay = 0.0005
    while True:
        left = _kill_orphans()
        waiting = [proc for proc in waiting if not _exited(proc)]
        if (not left and not waiting) or deadline.expired:
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _kill_orphans() -> int:
    """SIGKILL and reap (once dead) our children that are neither commands nor
    left by one still running; how many are left unreaped (1 while a command
    is being started: its child is not tracked yet, so nothing is touched)."""
    with _lock:
        if _starting:
            return 1
        try:
            pids = reaper.child_pids()
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
