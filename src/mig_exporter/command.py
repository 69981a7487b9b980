"""Run a command safely: an argv list (never a shell), a deadline, a cap on
output, and a kill of the whole process group when the command is done.

nvidia-smi can hang in uninterruptible sleep when the driver wedges, and a
wrapper (``chroot``, ``ssh``) can leave children behind; killing only the
direct child would leak them. Each command therefore starts in a new session
(its own process group). On timeout, overflow or cancellation the whole group
gets SIGKILL; after a clean exit, whatever the command left running in its
group is killed too, before the child is reaped. Groups still running when the
exporter stops are killed by ``kill_running()``.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mig_exporter.errors import CommandFailed, CommandNotFound, CommandTimeout, OutputTooLarge

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024 * 1024
_MAX_STDERR_BYTES = 64 * 1024
# A pipe holds 64 KiB (Linux's default), so no read returns more; a larger
# request only allocates (and maps) a larger buffer at every read.
_CHUNK = 64 * 1024
_REAP_GRACE_S = 0.05
_CANCEL_POLL_S = 0.05

_running: set[subprocess.Popen[bytes]] = set()
_running_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    stdout: bytes
    stderr: bytes
    duration_s: float


def run_command(
    argv: Sequence[str],
    timeout_s: float,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    cancel: threading.Event | None = None,
) -> CommandResult:
    """Run ``argv`` to completion within ``timeout_s`` and return its output.

    Raises ``CommandNotFound``, ``CommandTimeout`` (also when ``cancel`` is
    set first), ``OutputTooLarge`` or ``CommandFailed`` (non-zero exit, with
    the first line of stderr, or of stdout where nvidia-smi writes its errors).
    """
    argv = tuple(argv)
    shown = " ".join(argv).replace("\n", "\\n")
    started = time.monotonic()
    deadline = started + max(timeout_s, 0.0)
    try:
        proc = subprocess.Popen(
            argv,
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

    with _running_lock:
        _running.add(proc)
    try:
        stdout = bytearray()
        stderr = bytearray()
        try:
            outcome = _collect(proc, deadline, stdout, stderr, max_output_bytes, cancel)
            if outcome == "eof":
                outcome = _wait_exited(proc, deadline, cancel)
        finally:
            # Also on KeyboardInterrupt or SystemExit: never leave the group behind.
            _kill_group(proc)
        elapsed = time.monotonic() - started
        if outcome == "timeout":
            raise CommandTimeout(f"{shown}: timed out after {elapsed:.1f}s; process group killed")
        if outcome == "cancelled":
            raise CommandTimeout(f"{shown}: cancelled after {elapsed:.1f}s; process group killed")
        if outcome == "overflow":
            raise OutputTooLarge(f"{shown}: wrote more than {max_output_bytes} bytes; process group killed")
    finally:
        with _running_lock:
            _running.discard(proc)
    returncode = proc.returncode
    if returncode != 0:
        reason = _first_line(bytes(stderr)) or _first_line(bytes(stdout)) or "no output"
        what = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        raise CommandFailed(f"{shown}: {what}: {reason}")
    return CommandResult(argv, bytes(stdout), bytes(stderr), elapsed)


def kill_running() -> int:
    """SIGKILL the process group of every command still running; return how many.

    For shutdown: a read in flight when the exporter is stopped must not leave
    nvidia-smi (or a wrapper's children) behind.
    """
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        _signal_group(proc)
    return len(procs)


def _collect(
    proc: subprocess.Popen[bytes],
    deadline: float,
    stdout: bytearray,
    stderr: bytearray,
    max_output_bytes: int,
    cancel: threading.Event | None,
) -> str:
    """Read both pipes until EOF ("eof"), the deadline ("timeout"), the cap
    ("overflow") or cancellation ("cancelled")."""
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, stdout)
        sel.register(proc.stderr, selectors.EVENT_READ, stderr)
        try:
            while sel.get_map():
                remaining = _wait_for(deadline, cancel)
                if isinstance(remaining, str):
                    return remaining
                for key, _ in sel.select(remaining):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buffer: bytearray = key.data
                    if buffer is stdout:
                        buffer += chunk
                        if len(buffer) > max_output_bytes:
                            return "overflow"
                    elif len(buffer) < _MAX_STDERR_BYTES:
                        buffer += chunk[: _MAX_STDERR_BYTES - len(buffer)]
            return "eof"
        finally:
            proc.stdout.close()
            proc.stderr.close()


def _wait_for(deadline: float, cancel: threading.Event | None) -> float | str:
    """How long the next wait may block, or "timeout"/"cancelled" when it may
    not; with a cancel event the wait is cut short so a cancel is seen soon."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return "timeout"
    if cancel is None:
        return remaining
    if cancel.is_set():
        return "cancelled"
    return min(remaining, _CANCEL_POLL_S)


def _wait_exited(proc: subprocess.Popen[bytes], deadline: float, cancel: threading.Event | None) -> str:
    """Wait for the child to exit *without reaping it* ("eof"), so its group id
    stays reserved for the kill that follows; or "timeout"/"cancelled" when it
    closed its output but hangs on (a wedged driver call after printing)."""
    pidfd = _open_pidfd(proc.pid)
    try:
        delay = 0.0005
        while True:
            try:
                if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return "eof"
            except ChildProcessError:
                return "eof"  # already reaped elsewhere; nothing left to wait for
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


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # Linux 5.3+
    except (AttributeError, OSError):
        return None


def _signal_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole process group, then reap the child.

    The group id is the child's pid (it leads its own session) and stays
    reserved until the child is reaped, so the kill cannot hit a stranger.
    """
    _signal_group(proc)
    # SIGKILL is acted on at once except in uninterruptible sleep (a wedged
    # driver call). Do not let such a child hold the caller past its deadline:
    # a daemon thread reaps it whenever the kernel lets it go.
    try:
        proc.wait(timeout=_REAP_GRACE_S)
    except subprocess.TimeoutExpired:
        threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def _first_line(data: bytes) -> str:
    for line in data.decode("utf-8", errors="replace").splitlines():
        if line.strip():
            return " ".join(line.split())[:300]
    return ""
