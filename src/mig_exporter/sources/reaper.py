"""This process as a reaper of orphans: the child subreaper flag and a list of its children.

A process whose parent dies is handed to the nearest ancestor that is a *child
subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), or else to PID 1 of its PID
namespace. With the flag set, whatever an nvidia-smi run leaves behind (a
grandchild that called ``setsid()`` to leave the process group, children of a
group member killed at the deadline) becomes a child of the exporter, which can
then find, kill and reap it (``command.py``). Linux only; elsewhere, or where
prctl is refused, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

_libc: ctypes.CDLL | None = None


def _prctl(option: int, arg: ctypes.c_ulong | ctypes.c_void_p) -> int:
    """prctl(2) through the C library: 0, or -1 with errno set. -1 where it cannot be called."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        result: int = _libc.prctl(ctypes.c_int(option), arg, ctypes.c_ulong(0), ctypes.c_ulong(0),
                                  ctypes.c_ulong(0))
        return result
    except (OSError, AttributeError):
        return -1


def set_child_subreaper(on: bool) -> bool:
    """Set or clear this process's child subreaper flag; whether that was done."""
    return _prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1 if on else 0)) == 0


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper now."""
    flag = ctypes.c_int(0)
    if _prctl(PR_GET_CHILD_SUBREAPER, ctypes.cast(ctypes.pointer(flag), ctypes.c_void_p)) != 0:
        return False
    return flag.value != 0


def child_pids(proc: str = "/proc") -> set[int]:
    """The pids of this process's children, zombies included.

    Read from each thread's ``task/TID/children`` (a child belongs to the thread
    that forked it, or that it was handed to); where the kernel has no such file
    (``CONFIG_PROC_CHILDREN``), from the parent field of every ``/proc/PID/stat``.
    """
    me = os.getpid()
    task = f"{proc}/{me}/task"
    pids: set[int] = set()
    try:
        threads = os.listdir(task)
        for tid in threads:
            try:
                with open(f"{task}/{tid}/children") as f:
                    pids.update(int(pid) for pid in f.read().split())
            except FileNotFoundError:
                if not os.path.isdir(f"{task}/{tid}"):
                    continue  # the thread has ended since the listing
                raise
        return pids
    except FileNotFoundError:
        pass  # no children files: read every process's parent
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone since the listing
        fields = stat[stat.rindex(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me:
            pids.add(int(entry))
    return pids


def orphan_pids(proc: str = "/proc") -> set[int]:
    """The pids of this process's children that an orphan can be among: those of its main
    thread (the thread group leader), zombies included. The kernel hands an orphan to the
    first living thread of its reaper, which is the leader while it lives; the children
    other threads started themselves are theirs and are not orphans. One file to read,
    where ``child_pids`` reads one per thread. Where the kernel has no children files
    (``CONFIG_PROC_CHILDREN``), every child (``child_pids``)."""
    me = os.getpid()
    try:
        with open(f"{proc}/{me}/task/{me}/children") as f:
            return {int(pid) for pid in f.read().split()}
    except FileNotFoundError:
        return child_pids(proc)


def read_environ(pid: int, proc: str = "/proc") -> bytes | None:
    """``/proc/PID/environ``: None when it cannot be read; b"" for a zombie, and for a
    moment during an exec, when the kernel has no environment to show."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def value_in(environ: bytes, name: str) -> str | None:
    prefix = name.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def is_zombie(pid: int, proc: str = "/proc") -> bool:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] == b"Z"
