"""The kernel's XID lines, parsed: bytes in, named tuples out. Nothing here reads a file.

A record of ``/dev/kmsg`` (Linux ``Documentation/ABI/testing/dev-kmsg``) is
``prio,seq,ts_usec,flags[,...];message`` and a newline, then optional continuation
lines that start with a space (``" SUBSYSTEM=pci"``); the message escapes
non-printable bytes as ``\\xNN``. ``ts_usec`` is the printk clock, microseconds since
boot that do not run in suspend (as ``CLOCK_MONOTONIC``).

The driver's XID line (NVIDIA/open-gpu-kernel-modules,
``src/nvidia/src/kernel/gpu/rc/kernel_rc.c``, its ``portDbgPrintf`` of the XID) is, on a MIG
instance, ``NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, pid=%s,
name=%s, <message>``; with ``GPU-I`` alone, or neither, on an error the driver
attributes to a GPU instance or to the card. Older drivers and other paths print
``pid='<unknown>', name=<unknown>`` or no pid at all (``NVRM: Xid (PCI:0000:01:00):
79, GPU has fallen off the bus.``; the Ampere error-containment lines, as the driver's
comment on ``_gpuGenerateErrorLog`` shows them: ``NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94,
pid=7194, Contained: ...`` with no name), and some the address without ``PCI:``
(``NVRM: Xid (0000:03:00): 14, Channel 00000001``, leptonai/gpud's
``components/accelerator/nvidia/xid/kmsg_test.go``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

# The message's own shape; the PCI address is domain:bus:device (the domain may be left out,
# a function ".0" may follow), as the driver prints gpuGetDomain/Bus/Device.
_XID = re.compile(
    rb"NVRM: Xid \((?:PCI:)?(?P<pci>(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2})(?:\.[0-7])?"
    rb"(?: GPU-I:(?P<gi>\d{1,5}))?(?: GPU-CI:(?P<ci>\d{1,5}))?\): (?P<xid>\d{1,6})\b(?:, )?(?P<rest>.*)",
    re.DOTALL)
# What follows the code: the pid as %s (a number, or '<unknown>' with or without quotes), then
# the process's name, which ends at the next ", " (a name with a comma is cut there).
_PID = re.compile(rb"pid=(?:'?<unknown>'?|(?P<pid>\d{1,10}))(?:, name=(?P<name>.*?)(?:, |$))?", re.DOTALL)
_UNKNOWN_NAMES = frozenset({b"<unknown>", b"'<unknown>'", b""})
NAME_MAX = 64  # a process name kept for a label: the kernel's comm is 16 bytes, the driver's up to 100


class KmsgRecord(NamedTuple):
    """One ``/dev/kmsg`` record: its sequence number, its time in microseconds since boot
    (the printk clock) and its message (the first line, without the continuation lines)."""

    seq: int
    ts_usec: int
    message: bytes


class XidLine(NamedTuple):
    """One XID the kernel logged. ``pci`` is (domain, bus, device); the instance ids are
    ``None`` where the line names none; ``pid`` and ``process_name`` are ``None`` where
    the driver said ``<unknown>`` or nothing."""

    pci: tuple[int, int, int]
    gpu_instance_id: int | None
    compute_instance_id: int | None
    xid: int
    pid: int | None
    process_name: str | None


def parse_record(raw: bytes) -> KmsgRecord | None:
    """A record as a read of ``/dev/kmsg`` returns it (or one line of a file of them);
    ``None`` for what is not one (a continuation line, a line of garbage)."""
    head, sep, message = raw.partition(b";")
    if not sep or raw[:1] in (b" ", b""):
        return None
    fields = head.split(b",")
    if len(fields) < 4:
        return None
    try:
        seq, ts_usec = int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return KmsgRecord(seq, ts_usec, message.split(b"\n", 1)[0])


def pci_key(bus_id: str | bytes | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of ``00000000:3B:00.0`` (nvidia-smi's and NVML's form), of
    ``0000:3b:00`` (the kernel line's) or ``3b:00``; ``None`` where it is none."""
    if bus_id is None:
        return None
    text = bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else bus_id
    parts = text.strip().split(".", 1)[0].split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return domain, bus, device


def _text(raw: bytes | None) -> str | None:
    if raw is None or raw.strip() in _UNKNOWN_NAMES:
        return None
    # /dev/kmsg escaped the non-printable bytes already; what is left is cut, never trusted whole.
    return raw.strip().decode("utf-8", "replace")[:NAME_MAX]


def parse_xid(message: bytes) -> XidLine | None:
    """The XID a kernel message reports, or ``None`` where it reports none."""
    if b"NVRM: Xid" not in message:  # most records: no regular expression at all
        return None
    match = _XID.search(message)
    if match is None:
        return None
    pci = pci_key(match["pci"])
    if pci is None:
        return None
    pid = name = None
    found = _PID.match(match["rest"])
    if found is not None:
        pid = int(found["pid"]) if found["pid"] else None
        name = _text(found["name"])
    gi, ci = match["gi"], match["ci"]
    return XidLine(pci, int(gi) if gi is not None else None, int(ci) if ci is not None else None,
                   int(match["xid"]), pid if pid else None, name)
