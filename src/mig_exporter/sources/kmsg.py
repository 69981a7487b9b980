"""XID lines from the kernel's log, read from ``/dev/kmsg`` at each scrape (no thread of its own).

``/dev/kmsg`` (Linux ``Documentation/ABI/testing/dev-kmsg``): opened ``O_RDONLY|O_NONBLOCK``,
its first read returns the oldest record still in the kernel's buffer, so a restarted
exporter counts the XIDs since boot again; each read returns one record; ``EAGAIN`` says
there is none newer; ``EPIPE`` says records were overwritten before being read (the next read
goes on with the oldest left); a buffer smaller than a record is ``EINVAL`` (``READ_SIZE`` is
larger than the kernel's 8 KiB record limit). Opening it needs ``CAP_SYSLOG`` where
``kernel.dmesg_restrict`` is 1 (``EPERM`` otherwise). A regular file of records, one a line,
replays the same way (the tests' and ``--demo``'s).

The file stays open between scrapes: a reopen would start again from the oldest record, and
records already counted are skipped by their sequence number (the highest one seen is kept).
A read takes at most ``max_records`` records, so an XID storm costs bounded CPU per scrape
(the rest waits for the next); counts are kept per (card's PCI address, GPU instance, compute
instance, XID), at most ``max_keys`` of them; no line is kept.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from mig_exporter.model.xid_line import parse_record, parse_xid

log = logging.getLogger("mig_exporter")

DEFAULT_PATH = "/dev/kmsg"
READ_SIZE = 16384  # more than a record can be (8 KiB of text and its dictionary): never EINVAL
MAX_RECORDS = 50_000  # records a read takes at most; the kernel's buffer holds fewer on most hosts
MAX_KEYS = 1024  # distinct (card, instance, XID) counted; beyond, lines count into ``overflow``
# EPERM on open: the kernel's check_syslog_permissions, or a container's device list without
# /dev/kmsg (c 1:11; containerd's WithDefaultUnixDevices leaves it out): docs/xids.md.
_NO_PERMISSION = ("no CAP_SYSLOG while kernel.dmesg_restrict is 1, or a container not allowed the device: "
                  "grant CAP_SYSLOG (in a container: privileged), or set kernel.dmesg_restrict=0")

Key = tuple[tuple[int, int, int], int | None, int | None, int]  # (pci, gi, ci, xid)


class KmsgTally(NamedTuple):
    """XID lines of one card (by PCI address), instance and code: ``before`` logged before
    the exporter started, ``since`` after; the last line's time (seconds since the epoch),
    pid and process name (``None`` where the driver did not know them)."""

    pci: tuple[int, int, int]
    gpu_instance_id: int | None
    compute_instance_id: int | None
    xid: int
    before: int
    since: int
    last_seconds: float
    pid: int | None
    process_name: str | None


class _Tally:
    __slots__ = ("before", "last", "name", "pid", "since")

    def __init__(self) -> None:
        self.before = self.since = 0
        self.last = float("-inf")
        self.pid: int | None = None
        self.name: str | None = None


def boot_seconds() -> float:
    """When the printk clock was 0, in seconds since the epoch. The kernel stamps records with
    ``local_clock()``, which stops in suspend as ``CLOCK_MONOTONIC`` does (``CLOCK_BOOTTIME``
    would not, and place a record read after a suspend too late). Whole seconds: two processes
    (a restart, ``read`` and ``serve``) then give a line the same time, not microseconds apart."""
    return float(round(time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)))


def _why(path: str, error: OSError) -> str:
    reason = f"cannot read {path}: {error.strerror or error}"
    if error.errno in (errno.EPERM, errno.EACCES):
        reason += f" ({_NO_PERMISSION})"
    return reason


def kmsg_status(path: str = DEFAULT_PATH) -> tuple[bool, str | None]:
    """Whether ``path`` can be read as the exporter reads it (one open, one read), and why not:
    for ``doctor``."""
    if not path:
        return False, "turned off (--collector.xid.kmsg '')"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return False, _why(path, e)
    try:
        os.read(fd, READ_SIZE)
    except (BlockingIOError, BrokenPipeError):
        pass  # nothing new, or records overwritten: readable
    except OSError as e:
        return False, _why(path, e)
    finally:
        os.close(fd)
    return True, None


class KmsgReader:
    """Counts the XID lines of ``path``; ``read()`` takes the records new since the last one.

    Thread-safe (concurrent scrapes read in turn). ``started`` (seconds since the epoch)
    splits the lines logged before the exporter started from those after (the merge with
    NVML's events, sources/xid.py, needs both)."""

    def __init__(self, path: str = DEFAULT_PATH, *, started: float | None = None, max_records: int = MAX_RECORDS,
                 max_keys: int = MAX_KEYS, read: Callable[[int, int], bytes] = os.read,
                 boot: Callable[[], float] = boot_seconds) -> None:
        self.path = path
        self.started = time.time() if started is None else started
        self.max_records = max_records
        self.max_keys = max_keys
        self._read = read
        self._boot = boot
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._partial = b""  # a regular file's last line, not whole yet
        self._lines: list[bytes] = []  # lines read and not taken yet (a read's bound was met)
        self._seq = -1
        self._tallies: dict[Key, _Tally] = {}
        self.overflow = 0  # XID lines past max_keys: counted here, on no card
        self.lost = 0  # reads that met EPIPE: records overwritten before they were read
        self.overwritten = 0  # records overwritten before they were read: the seq gap after an EPIPE
        self._gap = False  # an EPIPE met: the next record's seq says how many were lost
        self._readable: bool | None = None
        self._reason: str | None = None

    def describe(self) -> str:
        return f"kernel log {self.path}"

    def status(self) -> tuple[bool | None, str | None]:
        """Whether the last read could read the log (``None`` before any), and why not."""
        with self._lock:
            return self._readable, self._reason

    def read(self) -> None:
        """Take the records new since the last read, at most ``max_records``; never raises."""
        with self._lock:
            fd = self._fd if self._fd is not None else self._open()
            if fd is None:
                return
            boot = self._boot()
            records = 0
            while records < self.max_records:
                if self._lines:  # whole lines read before: a file gives many a read
                    take = self._lines[:self.max_records - records]
                    del self._lines[:len(take)]
                    for line in take:
                        self._take(line, boot)
                    records += len(take)
                    continue
                try:
                    chunk = self._read(fd, READ_SIZE)
                except BlockingIOError:  # EAGAIN: nothing newer
                    break
                except BrokenPipeError:  # EPIPE: overwritten records; the next read goes on
                    self.lost += 1
                    self._gap = True
                    records += 1
                    continue
                except OSError as e:
                    self._close()
                    self._set(False, _why(self.path, e))
                    return
                if not chunk:  # a regular file's end, a FIFO without a writer
                    break
                self._lines = (self._partial + chunk).split(b"\n")
                self._partial = self._lines.pop()  # the part after the last newline
                if len(self._partial) > READ_SIZE:  # longer than any record: no record
                    self._partial = b""
            self._set(True, None)

    def dropped(self) -> dict[str, int]:
        """Lines not counted on any card, by why: ``overwritten`` (records the kernel overwrote
        before a read took them: any could have been an XID), ``too_many_kinds`` (XID lines past
        ``max_keys`` distinct card, instance and code)."""
        with self._lock:
            return {"overwritten": self.overwritten, "too_many_kinds": self.overflow}

    def tallies(self) -> list[KmsgTally]:
        with self._lock:
            return [KmsgTally(pci, gi, ci, xid, t.before, t.since, t.last, t.pid, t.name)
                    for (pci, gi, ci, xid), t in self._tallies.items()]

    def close(self) -> None:
        with self._lock:
            self._close()

    def _take(self, line: bytes, boot: float) -> None:
        record = parse_record(line)
        if record is None or record.seq <= self._seq:  # a continuation line, or counted already
            return
        if self._gap and self._seq >= 0:
            self.overwritten += record.seq - self._seq - 1
        self._gap = False
        self._seq = record.seq
        xid = parse_xid(record.message)
        if xid is None:
            return
        key = (xid.pci, xid.gpu_instance_id, xid.compute_instance_id, xid.xid)
        tally = self._tallies.get(key)
        if tally is None:
            if len(self._tallies) >= self.max_keys:
                if not self.overflow:
                    log.warning("more than %d distinct XID lines (card, instance, code) in %s: the rest are "
                                "counted on no card", self.max_keys, self.path)
                self.overflow += 1
                return
            tally = self._tallies[key] = _Tally()
        when = boot + record.ts_usec / 1e6
        if when >= self.started:
            tally.since += 1
        else:
            tally.before += 1
        if when >= tally.last:
            tally.last, tally.pid, tally.name = when, xid.pid, xid.process_name

    def _open(self) -> int | None:
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self._set(False, _why(self.path, e))
            return None
        return self._fd

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._partial, self._lines = None, b"", []

    def _set(self, readable: bool, reason: str | None) -> None:
        """Keep what ``status()`` says; say it once when it changes, never at each scrape."""
        before, self._readable, self._reason = self._reason, readable, reason
        if reason is not None and reason != before:
            log.warning("XIDs from the kernel log: %s", reason)
        elif reason is None and before is not None:
            log.info("XIDs from the kernel log: reading %s again", self.path)
