"""Fabricated /proc trees in the kernel's own file formats, for tests.

Not a mock of the reader: the exporter reads these with the same code that
reads /proc. Each process gets ``stat`` (52 fields, the name in parentheses),
``cmdline`` (NUL-separated and NUL-terminated), ``comm``, ``status``,
``cgroup`` (a host process's by default), an ``exe`` link, ``task/<tid>/``
directories and an ``ns/pid`` link. ``self``
links to the exporter's own pid, as on a real /proc, and ``uptime`` holds the
seconds since boot that a process's start time (``stat``'s field 22, in clock
ticks) is measured from. Links to nowhere are
fine: readlink reads their text, exactly as it reads /proc's magic links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

HOST_NS = "pid:[4026531836]"
CONTAINER_NS = "pid:[4026532513]"
HOST_CGROUP = "0::/system.slice/sshd.service\n"


@dataclass
class Proc:
    pid: int
    comm: str
    cmdline: list[str]
    ppid: int = 1
    exe: str | None = None  # None: the link is absent (a kernel thread, or unreadable)
    state: str = "S"
    threads: list[int] = field(default_factory=list)  # extra thread ids besides pid
    cgroup: str = HOST_CGROUP  # /proc/PID/cgroup's contents
    uid: int = 0  # status's Uid: line (real, effective, saved and filesystem uids alike)
    start_ticks: int = 183204  # stat's starttime: clock ticks after boot


def write_proc(root: Path, p: Proc, namespace: str = HOST_NS) -> None:
    """One process's directory, as the kernel shows it."""
    d = root / str(p.pid)
    (d / "task").mkdir(parents=True)
    (d / "ns").mkdir()
    (d / "stat").write_text(stat_line(p.pid, p.comm, p.state, p.ppid, 1 + len(p.threads), p.start_ticks))
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in p.cmdline))
    (d / "comm").write_text(p.comm + "\n")
    (d / "status").write_text(status_text(p))
    (d / "cgroup").write_text(p.cgroup)
    if p.exe is not None:
        os.symlink(p.exe, d / "exe")
    os.symlink(namespace, d / "ns" / "pid")
    for tid in [p.pid, *p.threads]:
        (d / "task" / str(tid)).mkdir()


def stat_line(pid: int, comm: str, state: str, ppid: int, threads: int, start_ticks: int = 183204) -> str:
    """``/proc/PID/stat`` as the kernel writes it (fs/proc/array.c)."""
    after = [
        state, ppid, pid, pid, 0, -1, 4194560,  # state ppid pgrp session tty_nr tpgid flags
        28731, 0, 12, 0, 5120, 981, 0, 0,  # minflt cminflt majflt cmajflt utime stime cutime cstime
        20, 0, threads, 0, start_ticks,  # priority nice num_threads itrealvalue starttime
        8724447232, 1203544, 18446744073709551615,  # vsize rss rsslim
        94842451136512, 94842455372285, 140727312340720, 0, 0,  # startcode endcode startstack kstkesp kstkeip
        0, 0, 4096, 1260, 1, 0, 0, 17, 3, 0, 0, 0, 0, 0,  # signals, wchan, nswap, exit_signal, processor, rt, policy...
        94842457661072, 94842457703184, 94842474131456,  # start_data end_data start_brk
        140727312345631, 140727312345710, 140727312345710, 140727312347109, 0,  # arg/env start/end, exit_code
    ]
    assert len(after) == 50
    return f"{pid} ({comm}) " + " ".join(str(v) for v in after) + "\n"


def status_text(p: Proc) -> str:
    return (
        f"Name:\t{p.comm}\nUmask:\t0022\nState:\t{p.state} (sleeping)\nTgid:\t{p.pid}\nNgid:\t0\n"
        f"Pid:\t{p.pid}\nPPid:\t{p.ppid}\nTracerPid:\t0\nUid:\t{p.uid}\t{p.uid}\t{p.uid}\t{p.uid}\nGid:\t0\t0\t0\t0\n"
        f"NSpid:\t{p.pid}\nThreads:\t{1 + len(p.threads)}\n"
    )


def make_proc(root: Path, processes: list[Proc], *, self_pid: int = 4242, namespace: str = HOST_NS,
              with_kernel: bool = True, uptime_s: float = 86400.0) -> Path:
    """Write a /proc tree under ``root``: init (1), kthreadd (2), the exporter
    itself (``self_pid``, linked from ``self``) and ``processes``."""
    root.mkdir(parents=True, exist_ok=True)
    base = [
        Proc(1, "systemd", ["/sbin/init", "splash"], ppid=0, exe="/usr/lib/systemd/systemd"),
        Proc(self_pid, "mig-exporter", ["/usr/bin/python3", "/usr/local/bin/mig-exporter", "serve"],
             exe="/usr/bin/python3.12"),
    ]
    if with_kernel:
        base.insert(1, Proc(2, "kthreadd", [], ppid=0, exe=None))
    for p in [*base, *processes]:
        write_proc(root, p, namespace)
    os.symlink(str(self_pid), root / "self")
    (root / "meminfo").write_text("MemTotal:       263856188 kB\n")  # non-process entries a reader must skip
    (root / "uptime").write_text(f"{uptime_s:.2f} {uptime_s * 1.7:.2f}\n")
    (root / "sys").mkdir()
    return root
