"""XIDs from the kernel's log: the driver's lines parsed, /dev/kmsg read as the kernel serves it,
and merged with NVML's events so that each XID counts once (docs/xids.md).

The lines are the driver's own, as printed in public logs and code (each cited where it is
used). /dev/kmsg's behaviour follows Linux ``Documentation/ABI/testing/dev-kmsg`` and
``kernel/printk/printk.c``: one record a read, ``EAGAIN`` at the end, ``EPIPE`` where records
were overwritten, ``EPERM`` on open without ``CAP_SYSLOG`` under ``kernel.dmesg_restrict=1``
(``check_syslog_permissions``).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import tracemalloc
from pathlib import Path

import pytest

from conftest import SAMPLES
from mig_exporter.metrics.scrape import Scraper
from mig_exporter.model.health import XidSeen
from mig_exporter.model.readings import OwnerReading, PodReading, ProcessOwner, ProcessPod
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.model.xid_line import KmsgRecord, XidLine, parse_record, parse_xid, pci_key
from mig_exporter.sources.demo import DemoSource
from mig_exporter.sources.kmsg import KmsgReader, kmsg_status
from mig_exporter.sources.xid import INSTANCE_WAITS, XidBook, XidWatch
from test_cli import run_cli

BOOT = 1_700_000_000.0  # the printk clock's 0 in these tests, seconds since the epoch
STARTED = BOOT + 1000.0  # when the exporter started: records at ts >= 1000 s are "since"


def record(seq: int, ts_s: float, message: str, prio: int = 4) -> str:
    """One /dev/kmsg record, as the kernel formats it (printk.c's ext header "%u,%llu,%llu,%c;")."""
    return f"{prio},{seq},{int(ts_s * 1_000_000)},-;{message}\n"


def reader(path: Path | str, **options: object) -> KmsgReader:
    return KmsgReader(str(path), started=STARTED, boot=lambda: BOOT, **options)  # type: ignore[arg-type]


def tallies(r: KmsgReader) -> dict[tuple[object, ...], tuple[int, int]]:
    return {(t.pci, t.gpu_instance_id, t.compute_instance_id, t.xid): (t.before, t.since) for t in r.tallies()}


# -- the driver's lines -------------------------------------------------------------------------

# Real lines, with where each was printed.
REAL_LINES = [
    # leptonai/gpud components/accelerator/nvidia/error/xid/README.md (a dmesg of Aug 2024)
    ("NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
     "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
     XidLine((0, 0xCB, 0), None, None, 13, None, None)),
    ("NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, errorString CTX SWITCH "
     "TIMEOUT, Info 0x58005",
     XidLine((0, 0xCB, 0), None, None, 109, 1797828, "pt_main_thread")),
    # NVIDIA/open-gpu-kernel-modules, the comment on _gpuGenerateErrorLog (Ampere error containment)
    ("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
     XidLine((0, 1, 0), 5, None, 94, 7194, None)),
    ("NVRM: Xid (PCI:0000:01:00): 95, pid=7062, Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
     XidLine((0, 1, 0), None, None, 95, 7062, None)),
    # leptonai/gpud components/accelerator/nvidia/xid/kmsg_test.go: no pid at all; no "PCI:"; domain 0009
    ("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.", XidLine((0, 1, 0), None, None, 79, None, None)),
    ("NVRM: Xid (0000:03:00): 14, Channel 00000001", XidLine((0, 3, 0), None, None, 14, None, None)),
    ("NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
     XidLine((9, 1, 0), None, None, 154, None, None)),
    ("NVRM: Xid (PCI:0000:19:00): 119, pid=452531, name=cache_mgr_main, Timeout after 6s of waiting for RPC "
     "response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20809004 0x608).",
     XidLine((0, 0x19, 0), None, None, 119, 452531, "cache_mgr_main")),
    # pid=<unknown> without quotes: the kernel line AWS SageMaker HyperPod's health-monitoring docs show
    ("NVRM: Xid (PCI:0000:b9:00): 74, pid=<unknown>, name=<unknown>, NVLink: fatal error detected on link "
     "6(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)", XidLine((0, 0xB9, 0), None, None, 74, None, None)),
    # GPU-I and GPU-CI, in kernel_rc.c's format ("PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u"), as a
    # public XID guide quotes it; and the same with the pid unknown
    ("NVRM: Xid (PCI:0000:3b:00 GPU-I:00 GPU-CI:00): 63, pid=12345, name=python, Retiring page...",
     XidLine((0, 0x3B, 0), 0, 0, 63, 12345, "python")),
    ("NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=<unknown>, name=<unknown>, Ch 00000010",
     XidLine((0, 0x3B, 0), 1, 2, 43, None, None)),
]


@pytest.mark.parametrize(("line", "expected"), REAL_LINES, ids=[str(i) for i in range(len(REAL_LINES))])
def test_every_shape_the_driver_prints(line: str, expected: XidLine) -> None:
    assert parse_xid(line.encode()) == expected


@pytest.mark.parametrize("message", [
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    "NVRM: GPU 0000:0f:00.0: GPU has fallen off the bus.",  # no Xid: counted by the line that has one
    "nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 11001, Fatal, Link 00",  # an NVSwitch's, not a GPU's
    "NVRM: Xid (invalid): some error",
])
def test_what_is_no_xid_line_is_none(message: str) -> None:
    assert parse_xid(message.encode()) is None


def test_a_process_name_is_cut_and_kept_as_the_kernel_escaped_it() -> None:
    line = parse_xid(b"NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\\x1b[31m" + b"x" * 200 + b", Graphics")
    assert line is not None and line.process_name is not None
    assert line.process_name.startswith("a\\x1b[31m") and len(line.process_name) == 64


def test_a_record_and_its_continuation_lines() -> None:
    assert parse_record(b"4,1873,95114262,-;NVRM: Xid (PCI:0000:0f:00): 13, pid=5\n") == KmsgRecord(
        1873, 95114262, b"NVRM: Xid (PCI:0000:0f:00): 13, pid=5")
    assert parse_record(b"6,5,1,-,caller=T1;hello") == KmsgRecord(5, 1, b"hello")  # a kernel with caller ids
    assert parse_record(b" SUBSYSTEM=pci") is None
    assert parse_record(b"garbage") is None


def test_the_pci_address_of_the_line_is_the_card_of_nvidia_smi_and_nvml() -> None:
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00") == pci_key("3b:00") == (0, 0x3B, 0)
    assert pci_key("00000009:01:00.0") == (9, 1, 0)
    assert pci_key(None) is None and pci_key("N/A") is None


# -- the reader ---------------------------------------------------------------------------------


class KmsgDevice:
    """/dev/kmsg as the kernel serves it: a read returns one record (and its continuation lines),
    each open starts at the oldest record still held, EAGAIN at the end, EPIPE once where records
    were overwritten since the last read (the next read returns the oldest left)."""

    def __init__(self, records: list[str]) -> None:
        self.records = [r.encode() for r in records]
        self.first = 0  # the oldest record the buffer still holds
        self.at: dict[int, int] = {}
        self.reads = 0

    def read(self, fd: int, size: int) -> bytes:
        self.reads += 1
        position = self.at.setdefault(fd, self.first)
        if position < self.first:
            self.at[fd] = self.first
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        if position >= len(self.records):
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        assert size >= 8192  # else the kernel answers EINVAL
        self.at[fd] = position + 1
        return self.records[position]

    def overwrite(self, count: int) -> None:
        self.first += count


LINES = [
    record(1, 5, "Linux version 6.8.0"),
    record(2, 900, "NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=48213, name=llama-server, Contained: SM "
                   "(0x1). RST: No, D-RST: No").replace("\n", "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:07:00.0\n"),
    record(3, 1100, "NVRM: Xid (PCI:0000:0f:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."),
    record(4, 1200, "NVRM: Xid (PCI:0000:0f:00): 13, pid=50318, name=python3, Graphics Exception"),
]


def test_a_device_gives_a_record_a_read_and_the_file_stays_open(tmp_path: Path) -> None:
    device = KmsgDevice(LINES)
    (tmp_path / "kmsg").touch()
    r = reader(tmp_path / "kmsg", read=device.read)
    r.read()
    assert tallies(r) == {((0, 7, 0), 2, 0, 94): (1, 0), ((0, 15, 0), None, None, 79): (0, 1),
                          ((0, 15, 0), None, None, 13): (0, 1)}
    device.records.append(record(5, 1300, "NVRM: Xid (PCI:0000:0f:00): 13, pid=50318, name=python3, x").encode())
    r.read()
    assert tallies(r)[((0, 15, 0), None, None, 13)] == (0, 2)  # the new record only
    assert r.status() == (True, None)


def test_records_overwritten_before_being_read_are_skipped_and_reading_goes_on(tmp_path: Path) -> None:
    device = KmsgDevice(LINES)
    (tmp_path / "kmsg").touch()
    r = reader(tmp_path / "kmsg", read=device.read)
    r.read()
    device.records += [record(5 + i, 1300 + i, "NVRM: Xid (PCI:0000:0f:00): 31, pid=1, name=a, fault").encode()
                       for i in range(5)]
    device.overwrite(6)  # the ring moved past the first two new records before the next read
    r.read()
    assert r.lost == 1
    assert tallies(r)[((0, 15, 0), None, None, 31)] == (0, 3)
    # The two it never saw (seq 5 and 6) are said, as a metric can: any of them may have been an XID.
    assert r.dropped() == {"overwritten": 2, "too_many_kinds": 0}


def test_a_reopened_log_counts_no_record_twice(tmp_path: Path) -> None:
    device = KmsgDevice(LINES)
    (tmp_path / "kmsg").touch()
    r = reader(tmp_path / "kmsg", read=device.read)
    r.read()
    before = tallies(r)
    real_read = device.read

    def failing(fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    r._read = failing
    r.read()
    assert r.status() == (False, f"cannot read {tmp_path / 'kmsg'}: Input/output error")
    r._read = real_read
    r.read()  # opened again: from the oldest record, each already counted skipped by its seq
    assert tallies(r) == before and r.status() == (True, None)


def test_a_regular_file_of_records_replays_and_a_restart_counts_the_same(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.txt"
    path.write_text("".join(LINES))
    first = reader(path)
    first.read()
    with path.open("a") as f:  # a line written half, then whole: counted once, when whole
        f.write(record(5, 1300, "NVRM: Xid (PCI:0000:0f:00): 13, pid=9, name=b, y")[:20])
    first.read()
    with path.open("a") as f:
        f.write(record(5, 1300, "NVRM: Xid (PCI:0000:0f:00): 13, pid=9, name=b, y")[20:])
    first.read()
    restarted = reader(path)  # the exporter restarted: the same file, from its start
    restarted.read()
    assert tallies(first) == tallies(restarted)
    assert tallies(restarted)[((0, 15, 0), None, None, 13)] == (0, 2)
    last = {t.xid: (t.last_seconds, t.pid, t.process_name) for t in restarted.tallies()}
    assert last[13] == (BOOT + 1300, 9, "b") and last[79] == (BOOT + 1100, None, None)


def test_a_fifo_is_read_as_it_comes(tmp_path: Path) -> None:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    r = reader(path)
    r.read()  # no writer yet: nothing, and no wait
    assert tallies(r) == {} and r.status() == (True, None)
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, LINES[2].encode())
        r.read()
        r.read()  # EAGAIN while the writer is open: nothing new, and no wait
    finally:
        os.close(fd)
    assert tallies(r) == {((0, 15, 0), None, None, 79): (0, 1)}


def test_an_unreadable_log_is_said_once_and_the_scrape_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(path: str, flags: int, mode: int = 0o777) -> int:  # as devkmsg_open under dmesg_restrict
        raise PermissionError(errno.EPERM, "Operation not permitted", path)

    monkeypatch.setattr("mig_exporter.sources.kmsg.os.open", refused)
    scraper = Scraper(DemoSource())
    scraper.kmsg = reader("/dev/kmsg")
    with caplog.at_level(logging.INFO, logger="mig_exporter"):
        for _ in range(3):
            families = {f.name: f for f in scraper.families()}
    assert [s.value for s in families["mig_exporter_read_success"].samples] == [1]
    assert [(s.labels, s.value) for s in families["mig_exporter_xid_source_readable"].samples] == [
        ({"source": "kmsg"}, 0)]
    said = [r for r in caplog.records if "kernel log" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "CAP_SYSLOG" in said[0].getMessage() and "dmesg_restrict" in said[0].getMessage()
    assert kmsg_status("/dev/kmsg") == (False, "cannot read /dev/kmsg: Operation not permitted (no CAP_SYSLOG "
                                               "while kernel.dmesg_restrict is 1, or a container not allowed the "
                                               "device: grant CAP_SYSLOG (in a container: privileged), or set "
                                               "kernel.dmesg_restrict=0)")


def test_kmsg_status_of_a_readable_and_a_missing_log(tmp_path: Path) -> None:
    (tmp_path / "kmsg").write_text(LINES[0])
    assert kmsg_status(str(tmp_path / "kmsg")) == (True, None)
    readable, why = kmsg_status(str(tmp_path / "none"))
    assert not readable and why == f"cannot read {tmp_path / 'none'}: No such file or directory"
    assert kmsg_status("") == (False, "turned off (--collector.xid.kmsg '')")


def test_an_xid_storm_costs_bounded_memory_and_records_per_read(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              ) -> None:
    path = tmp_path / "storm.txt"
    with path.open("w") as f:  # 100 000 XID lines over 3 000 distinct codes and 100 000 pids
        for i in range(100_000):
            f.write(record(i + 1, 2000 + i / 1000, f"NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): {i % 3000}, "
                                                   f"pid={10_000 + i}, name=worker{i}, Graphics Exception: ESR 0x1"))
    r = reader(path, max_records=40_000)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="mig_exporter"):
            r.read()
            first = sum(t.since for t in r.tallies()) + r.overflow
            r.read()
            r.read()
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first <= 40_000  # a read takes at most max_records records: the rest waits
    assert len(r.tallies()) == 1024  # the cap on distinct keys
    assert sum(t.since for t in r.tallies()) + r.overflow == 100_000  # every line counted, none twice
    assert peak < 2 * 1024 * 1024  # no line kept: 1 024 tallies and one read's buffer
    assert len([rec for rec in caplog.records if "distinct XID lines" in rec.getMessage()]) == 1
    assert r.dropped() == {"overwritten": 0, "too_many_kinds": r.overflow} and r.overflow > 0


def test_concurrent_scrapes_read_each_record_once(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.txt"
    path.write_text("".join(record(i + 1, 1500, "NVRM: Xid (PCI:0000:0f:00): 13, pid=1, name=a, x")
                            for i in range(2000)))
    r = reader(path, max_records=50)
    def scrapes() -> None:
        for _ in range(20):
            r.read()

    threads = [threading.Thread(target=scrapes) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tallies(r) == {((0, 15, 0), None, None, 13): (0, 2000)}


# -- placed and merged with NVML's events -------------------------------------------------------


def demo_lines(tmp_path: Path, *lines: str) -> KmsgReader:
    path = tmp_path / "kmsg.txt"
    path.write_text("".join(record(i + 1, ts, text) for i, (ts, text) in enumerate(
        (float(line.split("|")[0]), line.split("|")[1]) for line in lines)))
    r = reader(path)
    r.read()
    return r


def test_a_replay_gives_counts_per_card_and_mig_device_with_the_pod_of_the_pid(tmp_path: Path) -> None:
    # The demo: card 0 (PCI 0000:07:00) in MIG mode, GPU instance 2 is 0/mig0 (placement index 1000)
    # with llama-server 48213 on it; card 1 (PCI 0000:0f:00) whole.
    r = demo_lines(tmp_path,
                   "900|NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=48213, name=llama-server, Contained",
                   "950|NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=48213, name=llama-server, Contained",
                   "1100|NVRM: Xid (PCI:0000:0f:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                   "1200|NVRM: Xid (PCI:0000:07:00 GPU-I:09): 31, pid=51877, name=python3, MMU Fault")
    snapshot = DemoSource().read()
    pods = PodReading({48213: ProcessPod(48213, "c1", "llm", "llama-0", "server")}, None, None)
    owners = OwnerReading({51877: ProcessOwner(51877, "4242", "0", None, "alice")})
    seen = XidBook().seen(snapshot, r.tallies(), (), pods, owners)
    assert seen == [
        XidSeen(0, 1000, 94, 2, BOOT + 950, 48213, "llama-server", "llm", "llama-0", "server"),
        XidSeen(0, 1002, 31, 1, BOOT + 1200, 51877, "python3", slurm_job="4242"),  # GPU-I 9 alone: its one CI
        XidSeen(1, 1, 79, 1, BOOT + 1100),
    ]


def test_the_pod_of_the_pid_is_kept_once_the_process_is_gone(tmp_path: Path) -> None:
    r = demo_lines(tmp_path, "1100|NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=48213, name=x, y")
    book, snapshot = XidBook(), DemoSource().read()
    pods = PodReading({48213: ProcessPod(48213, "c1", "llm", "llama-0", "server")}, None, None)
    assert book.seen(snapshot, r.tallies(), (), pods)[0].pod == "llama-0"
    assert book.seen(snapshot, r.tallies(), (), PodReading({}, None, None))[0].pod == "llama-0"


def test_a_line_of_a_card_no_snapshot_named_waits(tmp_path: Path) -> None:
    r = demo_lines(tmp_path, "1100|NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus.")
    assert XidBook().seen(DemoSource().read(), r.tallies()) == []


def _without(snapshot: Snapshot, index: int) -> Snapshot:
    """The snapshot of a read that missed one MIG instance (a partial read, an instance remade)."""
    return dataclasses.replace(snapshot, devices=tuple(d for d in snapshot.devices if d.index != index))


def test_a_line_of_an_instance_a_read_missed_waits_for_it_and_its_event_counts_once(tmp_path: Path) -> None:
    """A scrape whose snapshot lacks the instance the line names: the line waits, never stuck on
    the card; placed when the instance is back, its NVML event there counts with it once."""
    line = "NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=48213, name=llama-server, Contained"
    path = tmp_path / "kmsg.txt"
    path.write_text(record(1, 1100, line))
    r, book, whole = reader(path), XidBook(), DemoSource().read()
    r.read()
    assert book.seen(_without(whole, 1000), r.tallies()) == []
    with path.open("a") as f:
        f.write(record(2, 1200, line))
    r.read()
    event = XidSeen(0, 1000, 94, 2, BOOT + 1200.1)  # NVML's two events, placed on 0/mig0
    assert [(x.card, x.device_index, x.xid, x.seen) for x in book.seen(whole, r.tallies(), [event])] == [
        (0, 1000, 94, 2)]


def test_a_line_of_an_instance_no_snapshot_ever_had_counts_on_its_card_after_a_few_scrapes(tmp_path: Path) -> None:
    """An instance destroyed before the exporter saw it: its lines wait INSTANCE_WAITS scrapes,
    then count on the card rather than never."""
    r = demo_lines(tmp_path, "900|NVRM: Xid (PCI:0000:07:00 GPU-I:05 GPU-CI:00): 94, pid=1, name=x, Contained")
    book, snapshot = XidBook(), DemoSource().read()
    for _ in range(INSTANCE_WAITS):
        assert book.seen(snapshot, r.tallies()) == []
    assert [(x.card, x.device_index, x.seen) for x in book.seen(snapshot, r.tallies())] == [(0, 0, 1)]
    assert [(x.card, x.device_index, x.seen) for x in book.seen(snapshot, r.tallies())] == [(0, 0, 1)]


def test_lines_after_a_reconfiguration_go_to_the_new_instance_and_the_old_count_stays(tmp_path: Path) -> None:
    """GPU instance 2 is 0/mig0 (1000), then, remade, another placement index: the first line stays
    counted on 1000 (a counter never moves), the next goes to the instance as it is now."""
    line = "NVRM: Xid (PCI:0000:07:00 GPU-I:02 GPU-CI:00): 94, pid=1, name=x, Contained"
    path = tmp_path / "kmsg.txt"
    path.write_text(record(1, 1100, line))
    r, book, before = reader(path), XidBook(), DemoSource().read()
    r.read()
    assert [(x.device_index, x.seen) for x in book.seen(before, r.tallies())] == [(1000, 1)]
    remade = dataclasses.replace(before, devices=tuple(
        dataclasses.replace(d, index=1001, mig_index=1) if d.index == 1000 else d
        for d in before.devices if d.index != 1001))
    with path.open("a") as f:
        f.write(record(2, 1200, line))
    r.read()
    assert [(x.device_index, x.seen) for x in book.seen(remade, r.tallies())] == [(1000, 1), (1001, 1)]


def nvml_event(count: int, at: float) -> XidSeen:
    return XidSeen(1, 1, 13, count, at)


KMSG_13 = "NVRM: Xid (PCI:0000:0f:00): 13, pid=50318, name=python3, Graphics Exception"


def test_an_nvml_event_and_its_kernel_line_count_once(tmp_path: Path) -> None:
    r = demo_lines(tmp_path, f"1100|{KMSG_13}")
    seen = XidBook().seen(DemoSource().read(), r.tallies(), [nvml_event(1, BOOT + 1100.2)])
    assert [(s.card, s.device_index, s.xid, s.seen, s.last_pid) for s in seen] == [(1, 1, 13, 1, 50318)]


def test_an_nvml_event_counts_when_the_log_is_unreadable() -> None:
    seen = XidBook().seen(DemoSource().read(), (), [nvml_event(1, BOOT + 1100)])
    assert [(s.xid, s.seen, s.last_pid) for s in seen] == [(13, 1, None)]


def test_a_kernel_line_counts_without_an_nvml_event(tmp_path: Path) -> None:
    r = demo_lines(tmp_path, f"1100|{KMSG_13}")
    seen = XidBook().seen(DemoSource().read(), r.tallies(), [])
    assert [(s.xid, s.seen) for s in seen] == [(13, 1)]


def test_lines_before_the_start_add_to_the_events_since_and_the_count_never_goes_down(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.txt"
    path.write_text(record(1, 500, KMSG_13))  # before the exporter started: NVML never saw it
    r = reader(path)
    book, snapshot = XidBook(), DemoSource().read()
    r.read()
    assert book.seen(snapshot, r.tallies(), [])[0].seen == 1
    # NVML's event comes first, its line at the next scrape: 2, then still 2.
    assert book.seen(snapshot, r.tallies(), [nvml_event(1, BOOT + 1100)])[0].seen == 2
    with path.open("a") as f:
        f.write(record(2, 1100, KMSG_13))
    r.read()
    assert book.seen(snapshot, r.tallies(), [nvml_event(1, BOOT + 1100)])[0].seen == 2


class _Listener:
    """What a scrape asks serve's NVML listener: its events, placed, and whether it watches."""

    def __init__(self, seen: list[XidSeen], watching: bool) -> None:
        self._seen, self._watching = seen, watching

    def seen(self, snapshot: object) -> list[XidSeen]:
        return self._seen

    def status(self) -> XidWatch:
        return XidWatch(self._watching, 2 if self._watching else 0, None)


def test_a_scrape_on_the_nvidia_smi_path_merges_both_sources_and_says_which_are_read(tmp_path: Path) -> None:
    scraper = Scraper(DemoSource())  # the nvidia-smi path's parser
    scraper.kmsg = reader(SAMPLES / "demo-kmsg.txt")
    scraper.xids = _Listener([nvml_event(2, BOOT + 2000), XidSeen(0, 1001, 43, 1, BOOT + 2000)], False)  # type: ignore[assignment]
    families = {f.name: f for f in scraper.families()}
    counts = {(s.labels["card"], s.labels["index"], s.labels["xid"]): s.value
              for s in families["mig_exporter_xid_errors"].samples if s.name.endswith("_total")}
    # The demo's log: XID 94 on 0/mig0, 13 twice and 79 on card 1, all logged before STARTED (95 s to
    # 242 s after boot): NVML's 2 events of XID 13 since the start add to its 2 lines.
    assert counts == {("0", "1000", "94"): 1, ("0", "1001", "43"): 1, ("1", "1", "13"): 4, ("1", "1", "79"): 1}
    readable = {s.labels["source"]: s.value for s in families["mig_exporter_xid_source_readable"].samples}
    assert readable == {"kmsg": 1, "nvml_events": 0}
    info = {(s.labels["index"], s.labels["xid"]): (s.labels["pid"], s.labels["process_name"])
            for s in families["mig_exporter_xid_last_process_info"].samples}
    assert info == {("1000", "94"): ("48213", "llama-server"), ("1", "13"): ("50318", "python3"),
                    ("1", "79"): ("", ""), ("1001", "43"): ("", "")}


# -- the command line ---------------------------------------------------------------------------


def test_read_demo_has_every_xid_family_from_its_sample_log() -> None:
    done = run_cli("read", "--demo")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert 'mig_exporter_xid_errors_total{card="0",index="1000",xid="94"} 1.0' in lines
    assert 'mig_exporter_xid_errors_total{card="1",index="1",xid="13"} 2.0' in lines
    assert 'mig_exporter_xid_errors_total{card="1",index="1",xid="79"} 1.0' in lines
    assert any(line.startswith('mig_exporter_xid_last_timestamp_seconds{card="0",index="1000",xid="94"} ')
               for line in lines)
    assert ('mig_exporter_xid_last_process_info{card="0",container="",index="1000",namespace="",pid="48213",pod="",'
            'process_name="llama-server",slurm_job="",systemd_unit="",xid="94"} 1.0') in lines
    assert 'mig_exporter_xid_source_readable{source="kmsg"} 1.0' in lines


def test_an_empty_kmsg_path_turns_the_kernel_log_off(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"  # the demo's cards through the nvidia-smi path, no kernel log
    smi.write_text(f"#!/bin/sh\nif [ \"$1\" = -L ]; then cat {SAMPLES / 'demo.L.txt'}; "
                   f"else cat {SAMPLES / 'demo.xml'}; fi\n")
    smi.chmod(0o755)
    done = run_cli("read", "--source", "nvidia-smi", "--nvidia-smi", str(smi), "--collector.xid.kmsg", "")
    assert done.returncode == 0, done.stderr
    assert "mig_exporter_read_success{source=\"nvidia-smi\"} 1.0" in done.stdout
    assert "mig_exporter_xid" not in done.stdout
