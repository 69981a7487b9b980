"""The /proc read path: every process's name, executable, command line,
parent and threads, a process's cgroup file, and whether this /proc is the
host's PID namespace.

The root is configurable (``--proc.root``; ``/host/proc`` in a container that
mounts the host's). Parsing is pure (bytes in, ``ProcEntry`` out) and apart
from the file reading, so it is tested on fabricated trees in the real file
formats. A process that exits while it is being read is skipped, never an
error: /proc changes under the reader all the time.

``ProcfsSource.read`` keeps what it read of each process and reads again only
what may have changed (docs/engines.md): a process is known by its pid and the
inode of its ``/proc/PID`` directory, which the listing gives for free
(``d_ino``) and which the kernel draws afresh for each process, so a reused pid
is a new process. The start time would tell them apart as well, but only after
opening each ``stat``, which is the cost saved. A known process is read again
when its parent is no longer the one it had (it died: the process was
re-parented), while it is young (the first ``SETTLE_S`` of its life, when a
wrapper execs into the program it starts: a container's entrypoint downloads
its model first), at every read while it or an ancestor matches ``watch`` (the
engines: their threads, states and command lines are read fresh), and in turn:
at each read the processes whose pid is the read's number modulo
``REVISIT_READS``, so that every process is read again at least once every
``REVISIT_READS`` reads and an old process that execs into an engine is seen
within as many. Everything else is as last read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from mig_exporter.core.errors import ReadError
from mig_exporter.model.snapshot import is_linux_pid

DEFAULT_ROOT = "/proc"
# The inode of the initial PID namespace is a kernel constant
# (PROC_PID_INIT_INO, 0xEFFFFFFC) since Linux 3.8.
HOST_PID_NAMESPACE = "pid:[4026531836]"
MAX_FILE_BYTES = 1 << 20  # a cmdline is at most a few pages; never buffer more
# Most of these files are under a page. A read of the whole MAX_FILE_BYTES would
# allocate (and give back) 1 MiB per file, twice per process, at every scrape.
_READ_CHUNK = 16 * 1024
# How long after it starts a process is read at every read: long enough for a wrapper
# (an entrypoint script, a launcher) to exec into the program it starts, after the
# minutes a model's download takes.
SETTLE_S = 600.0
# Every process is read again at least once in this many reads (a 64th of them at each):
# an old process's exec is seen within as many. A 64th of a node of 5000 processes is
# about 80 processes' files, a few ms (benchmarks/procscan.py's warm read).
REVISIT_READS = 64
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

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
    """Every process under one /proc root, by pid; ``inodes``: each one's /proc/PID
    inode (``ProcfsSource.listing``) when read from a /proc tree."""

    namespace: PidNamespace
    processes: dict[int, ProcEntry]
    inodes: dict[int, int] | None = None


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


def parse_start_ticks(data: bytes) -> int:
    """The start time from ``/proc/PID/stat`` (field 22): clock ticks after boot."""
    fields = data[data.rfind(b")") + 1 :].split()
    if len(fields) < 20 or not fields[19].isdigit():
        raise ValueError("/proc/PID/stat: no start time")
    return int(fields[19])


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


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a microsecond more a process
class _Known:
    """A process as last read: which incarnation (the /proc/PID directory's inode), whose
    child (its parent's inode then), when it started, and whether ``watch`` matched it.
    Never changed once made."""

    inode: int
    parent_inode: int | None
    started_s: float  # seconds after boot
    matched: bool
    entry: ProcEntry


class ProcfsSource:
    """Reads a /proc tree at each call, again only what may have changed (see the module's notes).

    Thread-safe: concurrent reads each read what they need and the last one's knowledge is kept."""

    def __init__(self, root: str = DEFAULT_ROOT, settle_s: float = SETTLE_S,
                 revisit_reads: int = REVISIT_READS) -> None:
        self.root = root
        self.settle_s = settle_s
        self.revisit_reads = revisit_reads
        self._reads = 0  # how many reads were made: whose turn it is to be read again
        self._watch: Callable[[ProcEntry], object] | None = None
        self._known: dict[int, _Known] = {}
        self._under: frozenset[int] = frozenset()  # pids under a watched process, as last read

    def watch(self, match: Callable[[ProcEntry], object]) -> None:
        """Read the processes ``match`` is true for, and all under them, at every read."""
        self._watch = match
        self._known = {}

    def describe(self) -> str:
        return self.root

    @property
    def warm(self) -> bool:
        """Whether a read has been made to build on: the next reads only what changed."""
        return bool(self._known)

    def read_namespace(self) -> PidNamespace:
        if not os.path.isdir(self.root):
            raise ProcError(f"cannot read {self.root}: not a directory")
        return PidNamespace(self.root, _readlink(f"{self.root}/self/ns/pid"))

    def listing(self) -> dict[int, int]:
        """Each process's pid and the inode of its directory, which tells a reused pid's
        new process from the old one. Raises ``ProcError`` when the root cannot be listed."""
        try:
            with os.scandir(self.root) as entries:
                return {int(e.name): e.inode() for e in entries if e.name.isdigit()}
        except OSError as e:
            raise ProcError(f"cannot read {self.root}: {e.strerror or e}") from None

    def inodes(self, pids: Iterable[int]) -> dict[int, int]:
        """The inode of ``<root>/PID`` for each of ``pids`` that the listing lacks and that is
        there all the same: a thread's id (the listing holds thread group leaders only, yet
        ``<root>/TID`` opens), whose inode tells that thread from a later one of the same id."""
        found: dict[int, int] = {}
        root = self.root
        access, exists = os.access, os.F_OK
        for pid in pids:
            if not is_linux_pid(pid):  # a vGPU VM's id on the driver's list: in no /proc
                continue
            path = f"{root}/{pid}"
            # Nearly every such pid is gone rather than a thread: access says so without the
            # exception a failing stat raises (0.8 against 1.3 µs).
            if access(path, exists):
                with contextlib.suppress(OSError):  # ended in between
                    found[pid] = os.stat(path).st_ino
        return found

    def read(self) -> ProcTable:
        """Every process. Raises ``ProcError`` only when the root itself
        cannot be listed; a single process that cannot be read is skipped."""
        listing = self.listing()
        uptime_s = self._uptime_s()
        settled_before = None if uptime_s is None else uptime_s - self.settle_s
        known = self._known
        under = self._under
        revisit = self.revisit_reads
        turn = self._reads % revisit
        self._reads += 1
        now: dict[int, _Known] = {}
        moved = False  # whether the tree (or what watch matches in it) changed: what is under it then
        for pid, inode in listing.items():
            k = known.get(pid)
            if (k is None or k.inode != inode or pid in under or settled_before is None or pid % revisit == turn
                    or k.started_s > settled_before or k.parent_inode != listing.get(k.entry.ppid)):
                # String paths, not pathlib: on a node with thousands of processes
                # pathlib's joins were a third of the read.
                read = self._read_one(pid, inode, listing, k)
                if read is None:
                    continue
                moved = moved or k is None or k.inode != inode or k.entry.ppid != read.entry.ppid \
                    or k.matched != read.matched
                k = read
            now[pid] = k
        if self._watch is not None and (moved or now.keys() != known.keys()):
            self._under = self._under_watch(now)
        self._known = now
        return ProcTable(self.read_namespace(), {pid: k.entry for pid, k in now.items()}, listing)

    def _read_one(self, pid: int, inode: int, listing: dict[int, int], kept: _Known | None) -> _Known | None:
        read = _read_process(f"{self.root}/{pid}")
        if read is None:
            return None
        entry, started_ticks = read
        parent_inode = listing.get(entry.ppid)
        if kept is not None and kept.inode == inode and kept.parent_inode == parent_inode and kept.entry == entry:
            # Unchanged (most of those read in their turn, and of the engines' trees): what
            # watch made of it holds, and the kept objects are not churned for the collector.
            return kept
        matched = self._watch is not None and bool(self._watch(entry))
        return _Known(inode, parent_inode, started_ticks / _CLOCK_TICKS, matched, entry)

    @staticmethod
    def _under_watch(known: dict[int, _Known]) -> frozenset[int]:
        """The pids that ``watch`` matched, or one of whose ancestors it matched."""
        under: dict[int, bool] = {}
        for pid in known:
            path: list[int] = []
            current: int | None = pid
            result = False
            while current is not None:
                seen = under.get(current)
                if seen is not None:
                    result = seen
                    break
                k = known.get(current)
                if k is None:
                    break
                if k.matched:
                    result = True
                    break
                under[current] = False  # until the walk ends: a cycle (pids reused mid-read) ends it
                path.append(current)
                current = k.entry.ppid if k.entry.ppid != current else None
            for p in path:
                under[p] = result
            if result:
                under[pid] = True
        return frozenset(p for p, u in under.items() if u)

    def _uptime_s(self) -> float | None:
        """Seconds since boot (what start times count from); ``None`` when unreadable,
        and then every process is read as if young."""
        try:
            return float(_read(f"{self.root}/uptime").split(maxsplit=1)[0])
        except (OSError, ValueError, IndexError):
            return None

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
    read = _read_process(directory)
    return None if read is None else read[0]


def _read_process(directory: str) -> tuple[ProcEntry, int] | None:
    """One process and its start time (clock ticks after boot), or ``None`` if it vanished or cannot be read."""
    try:
        stat = _read(f"{directory}/stat")
        cmdline = _read(f"{directory}/cmdline")
    except OSError:
        # Gone (ENOENT/ESRCH) or hidden from us (EACCES under hidepid): either
        # way there is nothing to report about it.
        return None
    try:
        entry = parse_process(stat, cmdline, _readlink(f"{directory}/exe"), _thread_ids(directory))
        return entry, parse_start_ticks(stat)
    except ValueError:
        return None


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
