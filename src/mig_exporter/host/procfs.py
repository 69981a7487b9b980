"""The /proc read path: every process's name, executable, command line,
parent and threads, a process's cgroup file, and whether this /proc is the
host's PID namespace.

The root is configurable (``--proc.root``; ``/host/proc`` in a container that
mounts the host's). Parsing is pure (bytes in, ``ProcEntry`` out) and apart
from the file reading, so it is tested on fabricated trees in the real file
formats. A process that exits while it is being read is skipped, never an
error: /proc changes under the reader all the time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from mig_exporter.core.errors import ReadError

DEFAULT_ROOT = "/proc"
# The inode of the initial PID namespace is a kernel constant
# (PROC_PID_INIT_INO, 0xEFFFFFFC) since Linux 3.8.
HOST_PID_NAMESPACE = "pid:[4026531836]"
MAX_FILE_BYTES = 1 << 20  # a cmdline is at most a few pages; never buffer more
# Most of these files are under a page. A read of the whole MAX_FILE_BYTES would
# allocate (and give back) 1 MiB per file, twice per process, at every scrape.
_READ_CHUNK = 16 * 1024

class ProcError(ReadError):
    """The /proc root could not be read at all."""


@dataclass(frozen=True, slots=True)
class ProcEntry:
    """One process as /proc shows it.

    ``comm`` is the kernel's process name (at most 15 bytes: longer names are
    cut). ``exe`` is the executable's path (``None`` when the link cannot be
    read: another user's process without privileges, a kernel thread).
    ``thread_ids`` includes the process's own id (its main thread).
    """

    pid: int
    ppid: int
    comm: str
    state: str
    exe: str | None
    cmdline: tuple[str, ...]
    thread_ids: tuple[int, ...] = ()

    @property
    def exe_name(self) -> str | None:
        """The executable's basename; the command line's first word when the
        exe link is unreadable (EACCES is common for other users' processes)."""
        if self.exe:
            return os.path.basename(self.exe)
        if self.cmdline and self.cmdline[0]:
            return os.path.basename(self.cmdline[0].split(" ", 1)[0])
        return None

    @property
    def exe_path(self) -> str | None:
        if self.exe:
            return self.exe
        if self.cmdline and self.cmdline[0]:
            return self.cmdline[0].split(" ", 1)[0]
        return None

    @property
    def alive(self) -> bool:
        """False for zombies and dead tasks: they hold no memory and run nothing."""
        return self.state not in ("Z", "X", "x")


@dataclass(frozen=True, slots=True)
class PidNamespace:
    """Which PID namespace the /proc root shows.

    ``own`` is the target of ``<root>/self/ns/pid``: our own namespace, seen
    through the root. ``<root>/self`` only resolves when we are visible in
    that /proc, so ``own`` being the initial namespace proves both that we
    (and the nvidia-smi we run) see host PIDs and that the root is the
    host's /proc.
    """

    root: str
    own: str | None

    @property
    def is_host(self) -> bool:
        return self.own == HOST_PID_NAMESPACE

    def reason(self) -> str:
        """Why this is not the host's namespace, as one log line."""
        if self.own is None:
            return (f"cannot read {self.root}/self/ns/pid, so the PID namespace is unknown; "
                    "engine metrics are left out")
        if not self.is_host:
            return (f"the PID namespace seen through {self.root} is {self.own}, not the host's "
                    f"{HOST_PID_NAMESPACE}: the driver reports host PIDs, so engine metrics are left out "
                    "(run the exporter in the host PID namespace: hostPID: true, docker --pid=host)")
        return ""


@dataclass(frozen=True, slots=True)
class ProcTable:
    """Every process under one /proc root, by pid."""

    namespace: PidNamespace
    processes: dict[int, ProcEntry]


# --- pure parsing --------------------------------------------------------------------------------

def parse_stat(data: bytes) -> tuple[int, str, str, int]:
    """``(pid, comm, state, ppid)`` from ``/proc/PID/stat``.

    The name sits between the first ``(`` and the *last* ``)``: it may hold
    spaces and parentheses of its own (``(sd-pam)``, ``(my (odd) name)``).
    """
    text = data.decode("utf-8", errors="replace")
    open_at = text.find("(")
    close_at = text.rfind(")")
    if open_at <= 0 or close_at < open_at:
        raise ValueError(f"not a /proc/PID/stat line: {text[:80]!r}")
    pid = int(text[:open_at].strip())
    comm = text[open_at + 1 : close_at]
    fields = text[close_at + 1 :].split()
    if len(fields) < 2:
        raise ValueError(f"/proc/{pid}/stat: too few fields after the name")
    return pid, comm, fields[0], int(fields[1])


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    """The arguments of ``/proc/PID/cmdline``: NUL-separated, NUL-terminated.

    A process that rewrote its title (setproctitle) may leave one string with
    spaces and trailing padding; it is kept as one argument, trimmed.
    """
    if not data:
        return ()
    parts = data.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    args = tuple(p.decode("utf-8", errors="surrogateescape") for p in parts)
    if len(args) == 1:
        return (args[0].rstrip(" "),)
    return args


def parse_status_uid(data: bytes) -> int | None:
    """The real uid from ``/proc/PID/status``: the first of the ``Uid:`` line's
    four fields (real, effective, saved, filesystem); ``None`` without one."""
    for line in data.split(b"\n"):
        if line.startswith(b"Uid:"):
            fields = line[4:].split()
            return int(fields[0]) if fields and fields[0].isdigit() else None
    return None


def parse_exe_link(target: str) -> str:
    """The executable's path from the ``exe`` link; a replaced binary reads
    ``/path (deleted)``, and it is still the same program."""
    return target.removesuffix(" (deleted)")


def parse_process(stat: bytes, cmdline: bytes, exe_link: str | None, thread_ids: Iterable[int] = ()) -> ProcEntry:
    """One process from the contents of its files. Raises ``ValueError`` for a
    malformed ``stat``."""
    pid, comm, state, ppid = parse_stat(stat)
    tids = tuple(sorted(set(thread_ids))) or (pid,)
    return ProcEntry(
        pid=pid,
        ppid=ppid,
        comm=comm,
        state=state,
        exe=parse_exe_link(exe_link) if exe_link else None,
        cmdline=parse_cmdline(cmdline),
        thread_ids=tids,
    )


# --- reading -------------------------------------------------------------------------------------

class ProcReader(Protocol):
    """Where processes come from: a /proc tree, or the demo's bundled table."""

    def describe(self) -> str: ...

    def read(self) -> ProcTable: ...

    def read_namespace(self) -> PidNamespace: ...


class ProcfsSource:
    """Reads a /proc tree at each call."""

    def __init__(self, root: str = DEFAULT_ROOT) -> None:
        self.root = root

    def describe(self) -> str:
        return self.root

    def read_namespace(self) -> PidNamespace:
        if not os.path.isdir(self.root):
            raise ProcError(f"cannot read {self.root}: not a directory")
        return PidNamespace(self.root, _readlink(f"{self.root}/self/ns/pid"))

    def read(self) -> ProcTable:
        """Every process. Raises ``ProcError`` only when the root itself
        cannot be listed; a single process that cannot be read is skipped."""
        try:
            names = os.listdir(self.root)
        except OSError as e:
            raise ProcError(f"cannot read {self.root}: {e.strerror or e}") from None
        processes: dict[int, ProcEntry] = {}
        for name in names:
            if not name.isdigit():
                continue
            # String paths, not pathlib: on a node with thousands of processes
            # pathlib's joins were a third of the read.
            entry = read_process(f"{self.root}/{name}")
            if entry is not None:
                processes[entry.pid] = entry
        return ProcTable(self.read_namespace(), processes)

    def read_cgroup(self, pid: int) -> bytes | None:
        """The contents of ``<root>/PID/cgroup`` (parsed by ``cgroup.py``), or
        ``None`` when the process has gone or cannot be read."""
        try:
            return _read(f"{self.root}/{pid}/cgroup")
        except OSError:
            return None

    def read_status(self, pid: int) -> bytes | None:
        """The contents of ``<root>/PID/status`` (its uid: ``parse_status_uid``),
        or ``None`` when the process has gone or cannot be read."""
        try:
            return _read(f"{self.root}/{pid}/status")
        except OSError:
            return None


def read_process(directory: str) -> ProcEntry | None:
    """One process (``directory``: ``/proc/PID``), or ``None`` if it vanished or cannot be read."""
    try:
        stat = _read(f"{directory}/stat")
        cmdline = _read(f"{directory}/cmdline")
    except OSError:
        # Gone (ENOENT/ESRCH) or hidden from us (EACCES under hidepid): either
        # way there is nothing to report about it.
        return None
    try:
        entry = parse_process(stat, cmdline, _readlink(f"{directory}/exe"), _thread_ids(directory))
    except ValueError:
        return None
    return entry


def read_fd(fd: int, limit_bytes: int, chunk_bytes: int = _READ_CHUNK) -> bytes:
    """What ``fd`` gives until end of file, at most ``limit_bytes`` of it."""
    chunks: list[bytes] = []
    total = 0
    while total < limit_bytes:
        chunk = os.read(fd, min(chunk_bytes, limit_bytes - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read(path: str) -> bytes:
    """The file, up to MAX_FILE_BYTES, read until end of file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_fd(fd, MAX_FILE_BYTES)
    finally:
        os.close(fd)


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _thread_ids(directory: str) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"{directory}/task") if t.isdigit()]
    except OSError:  # gone since its stat was read, or hidden: its own id still counts
        return []
