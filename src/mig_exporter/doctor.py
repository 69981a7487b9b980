"""``mig-exporter doctor``: read both paths, show what they see, and warn of
the states in which nothing can run or the numbers are wrong.

Pure analysis lives here (``diagnose``, ``render_text``, ``as_json``); the CLI
does the reading. Every finding names its fix, and has a severity:

- ``error``: workloads cannot run, or the exporter's numbers are wrong (a card
  it cannot read, MIG with nothing carved, processes hidden from it, two paths
  that disagree, no GPU visible);
- ``warning``: worth fixing, but the exporter reads right (one path of two is
  unavailable, nvidia-smi is slow, a MIG mode change waits for a reset).

The exit code (``Report.exit_code``), for readiness gates and scripts:
0 when at least one path reads and there is no error; 1 when there is an
error; 2 when nothing can be read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mig_exporter.core.errors import ReadError
from mig_exporter.model.snapshot import MIB, Device, Snapshot

# Memory in use on a device with no process listed, beyond this, means the
# process list is hidden from us (not in the host PID namespace). An idle
# device holds a few MiB of context; a real workload holds gigabytes.
UNLISTED_MEMORY_THRESHOLD_BYTES = 256 * MIB
DEFAULT_SLOW_THRESHOLD_S = 2.0
# NVML answers in bytes, nvidia-smi in whole MiB, and memory in use moves
# between the two reads: compare totals to a MiB, usage more loosely.
_TOTAL_TOLERANCE_BYTES = MIB
_USED_TOLERANCE_BYTES = 64 * MIB


@dataclass(frozen=True, slots=True)
class PathReading:
    """One read path's result: its snapshot, or why there is none."""

    source: str
    snapshot: Snapshot | None
    error: str | None
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.snapshot is not None


ERROR = "error"
WARNING = "warning"
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_UNREADABLE = 2


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    message: str
    fix: str
    severity: str = ERROR


@dataclass(frozen=True, slots=True)
class Report:
    readings: tuple[PathReading, ...]
    findings: tuple[Finding, ...] = field(default=())

    @property
    def snapshot(self) -> Snapshot | None:
        """What to show: the first path that read (NVML before nvidia-smi)."""
        return next((r.snapshot for r in self.readings if r.snapshot is not None), None)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def exit_code(self) -> int:
        """2: no path reads; 1: a path reads and there is an error; 0: otherwise."""
        if self.snapshot is None:
            return EXIT_UNREADABLE
        return EXIT_PROBLEM if self.errors else EXIT_OK


def timed_read(source: str, read: Callable[[], Snapshot]) -> PathReading:
    """One path's read, timed. Each source keeps its own deadline: nvidia-smi is killed at
    it, and an NVML read hung in the driver fails at it (its flight's thread is left to it)."""
    started = time.monotonic()
    try:
        snapshot = read()
    except ReadError as e:
        return PathReading(source, None, str(e), time.monotonic() - started)
    except Exception as e:  # doctor reports a broken path; it does not crash on one
        return PathReading(source, None, f"unexpected {type(e).__name__}: {e}", time.monotonic() - started)
    return PathReading(source, snapshot, None, time.monotonic() - started)


def diagnose(
    nvml: PathReading | None,
    smi: PathReading,
    *,
    slow_threshold_s: float = DEFAULT_SLOW_THRESHOLD_S,
) -> Report:
    """The findings of one read of each path. ``nvml`` is None where it was not
    read (``doctor --demo``, whose sample is nvidia-smi's output).

    A path that fails while the other reads is a warning: the exporter reads
    through the other (``--source auto``). Both failing is the exit code's 2."""
    findings: list[Finding] = []
    readings = tuple(r for r in (nvml, smi) if r is not None)
    another_reads = sum(r.ok for r in readings) >= 1
    if nvml is not None and not nvml.ok:
        findings.append(Finding(
            "nvml-unavailable", f"NVML could not be read: {nvml.error}",
            "install the NVIDIA driver on the host; in a container run with the NVIDIA runtime and "
            "NVIDIA_DRIVER_CAPABILITIES=utility so libnvidia-ml.so.1 is mounted",
            WARNING if another_reads else ERROR,
        ))
    if not smi.ok:
        findings.append(Finding(
            "nvidia-smi-failed", f"nvidia-smi could not be read: {smi.error}",
            "give --nvidia-smi PATH (GPU Operator: /run/nvidia/driver/usr/bin/nvidia-smi); in a container "
            "run with the NVIDIA runtime and NVIDIA_DRIVER_CAPABILITIES=utility",
            WARNING if another_reads else ERROR,
        ))
    elif smi.duration_s > slow_threshold_s:
        findings.append(Finding(
            "nvidia-smi-slow", f"nvidia-smi took {smi.duration_s:.2f}s (threshold {slow_threshold_s:g}s)",
            "enable persistence mode (nvidia-persistenced, or nvidia-smi -pm 1) so the driver is not "
            "initialised at every call, or read through NVML (--source nvml)",
            WARNING,
        ))
    for reading in readings:
        if reading.snapshot is not None and not reading.snapshot.cards:
            findings.append(Finding(
                "no-devices", f"{reading.source} works but sees no GPU",
                "expose the GPUs to the container: NVIDIA_VISIBLE_DEVICES=all (or the device plugin's "
                "allocation), runtimeClassName: nvidia, and check the devices on the host with nvidia-smi -L",
            ))
    snapshot = next((r.snapshot for r in readings if r.snapshot is not None), None)
    if snapshot is not None:
        findings.extend(_card_findings(snapshot))
        findings.extend(_unlisted_memory_findings(snapshot))
    if nvml is not None and nvml.snapshot is not None and smi.snapshot is not None:
        differences = compare(nvml.snapshot, smi.snapshot)
        if differences:
            findings.append(Finding(
                "paths-disagree",
                "NVML and nvidia-smi disagree: " + "; ".join(differences[:10])
                + (f"; and {len(differences) - 10} more" if len(differences) > 10 else ""),
                "run doctor again (a change between the two reads shows once); if it persists, the "
                "libnvidia-ml the exporter loads and the nvidia-smi it runs come from different drivers",
            ))
    return Report(readings, tuple(findings))


def _card_findings(snapshot: Snapshot) -> Iterable[Finding]:
    for card in snapshot.cards:
        label = f"card {card.index} ({card.name or 'unknown'})"
        if card.error is not None:
            if "NO_PERMISSION" in card.error:
                yield Finding(
                    "mig-no-permission", f"{label}: {card.error}",
                    "MIG monitoring needs the MIG capability devices: run with NVIDIA_MIG_MONITOR_DEVICES=all "
                    "(NVIDIA container toolkit) or give access to /dev/nvidia-caps",
                )
            else:
                yield Finding(
                    "card-unreadable", f"{label} could not be read: {card.error}",
                    "check the kernel log for Xid errors (dmesg); a lost GPU needs a reset or a reboot",
                )
            continue
        if card.mig_current and card.mig_instances == 0:
            yield Finding(
                "mig-nothing-carved", f"{label} is in MIG mode with no instance carved: nothing can run on it",
                "create instances (nvidia-smi mig -cgi <profiles> -C), or set the node's MIG config for the "
                "MIG manager (nvidia.com/mig.config), or disable MIG (nvidia-smi -mig 0 and a reset)",
            )
        if card.mig_current is not None and card.mig_pending is not None and card.mig_current != card.mig_pending:
            now = "enabled" if card.mig_current else "disabled"
            then = "enabled" if card.mig_pending else "disabled"
            yield Finding(
                "mig-reset-pending", f"{label}: MIG mode is {now} but {then} is pending: a GPU reset is needed",
                f"reset the GPU when idle (nvidia-smi -r -i {card.index}) or reboot; on Kubernetes drain the "
                "node and let the MIG manager apply it",
                WARNING,  # the card works in its current mode until then
            )


def _unlisted_memory_findings(snapshot: Snapshot) -> Iterable[Finding]:
    listed: dict[int, int] = {}
    for p in snapshot.processes:
        listed[p.device_index] = listed.get(p.device_index, 0) + 1
    for device in snapshot.devices:
        used = device.memory.used_bytes
        if used is not None and used > UNLISTED_MEMORY_THRESHOLD_BYTES and not listed.get(device.index):
            yield Finding(
                "memory-without-processes",
                f"device {_device_name(device)} holds {used // MIB} MiB but no process is listed",
                "the exporter probably does not see the host's PID namespace: run it with hostPID: true "
                "(Kubernetes) or --pid=host (docker)",
            )


def compare(a: Snapshot, b: Snapshot) -> list[str]:
    """Differences between two snapshots of the same node, one line each."""
    out: list[str] = []
    a_cards = {c.index: c for c in a.cards}
    b_cards = {c.index: c for c in b.cards}
    for index in sorted(set(a_cards) | set(b_cards)):
        ca, cb = a_cards.get(index), b_cards.get(index)
        if ca is None or cb is None:
            out.append(f"card {index} seen by one path only")
            continue
        for attr in ("uuid", "mig_current", "mig_pending", "mig_instances"):
            if getattr(ca, attr) != getattr(cb, attr):
                out.append(f"card {index} {attr}: {getattr(ca, attr)!r} vs {getattr(cb, attr)!r}")
    a_devices = {d.index: d for d in a.devices}
    b_devices = {d.index: d for d in b.devices}
    names = {i: _device_name(d) for i, d in (*b_devices.items(), *a_devices.items())}
    for index in sorted(set(a_devices) | set(b_devices)):
        da, db = a_devices.get(index), b_devices.get(index)
        if da is None or db is None:
            out.append(f"device {names[index]} seen by one path only")
            continue
        out.extend(_device_differences(da, db))
    a_procs = {(p.device_index, p.pid): p for p in a.processes}
    b_procs = {(p.device_index, p.pid): p for p in b.processes}
    for key in sorted(set(a_procs) ^ set(b_procs)):
        out.append(f"process {key[1]} on device {names.get(key[0], key[0])} seen by one path only")
    for key in sorted(set(a_procs) & set(b_procs)):
        pa, pb = a_procs[key], b_procs[key]
        if pa.type != pb.type:
            out.append(f"process {key[1]} type: {pa.type} vs {pb.type}")
        if not _close(pa.used_bytes, pb.used_bytes, _USED_TOLERANCE_BYTES):
            out.append(f"process {key[1]} memory: {_mib(pa.used_bytes)} vs {_mib(pb.used_bytes)}")
    return out


def _device_differences(a: Device, b: Device) -> list[str]:
    out = []
    name = _device_name(a)
    for attr in ("uuid", "profile", "gpu_instance_id", "compute_instance_id", "device_class"):
        if getattr(a, attr) != getattr(b, attr):
            out.append(f"device {name} {attr}: {getattr(a, attr)!r} vs {getattr(b, attr)!r}")
    if not _close(a.memory.total_bytes, b.memory.total_bytes, _TOTAL_TOLERANCE_BYTES):
        out.append(f"device {name} memory total: {_mib(a.memory.total_bytes)} vs {_mib(b.memory.total_bytes)}")
    if not _close(a.memory.used_bytes, b.memory.used_bytes, _USED_TOLERANCE_BYTES):
        out.append(f"device {name} memory used: {_mib(a.memory.used_bytes)} vs {_mib(b.memory.used_bytes)}")
    return out


def _device_name(d: Device) -> str:
    """``1/mig2 (1102)``: the name people read, and the placement index the
    metrics carry; a whole card is just its index."""
    return f"{d.display_name} ({d.index})" if d.is_mig else d.display_name


def _close(a: int | None, b: int | None, tolerance: int) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= tolerance


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / MIB:.0f} MiB"


def render_text(report: Report) -> str:
    lines = []
    for r in report.readings:
        if r.snapshot is not None:
            lines.append(f"{r.source}: ok, {len(r.snapshot.cards)} card(s), {len(r.snapshot.devices)} device(s) "
                         f"in {r.duration_s:.3f}s")
        else:
            lines.append(f"{r.source}: FAILED in {r.duration_s:.3f}s: {r.error}")
    snapshot = report.snapshot
    if snapshot is not None:
        lines.append("")
        lines.append(f"driver {snapshot.driver_version or 'unknown'}, CUDA {snapshot.cuda_version or 'unknown'}")
        for card in snapshot.cards:
            lines.append("")
            lines.extend(_card_lines(snapshot, card.index))
    lines.append("")
    errors = len(report.errors)
    warnings = len(report.findings) - errors
    for f in sorted(report.findings, key=lambda f: f.severity != ERROR):
        lines.append(f"{f.severity.upper()} [{f.code}] {f.message}")
        lines.append(f"      fix: {f.fix}")
    lines.append(f"{_verdict(report.exit_code)}: {errors} error(s), {warnings} warning(s) (exit {report.exit_code})")
    return "\n".join(lines) + "\n"


def _verdict(exit_code: int) -> str:
    return {EXIT_OK: "ok", EXIT_PROBLEM: "problems found", EXIT_UNREADABLE: "nothing can be read"}[exit_code]


def _card_lines(snapshot: Snapshot, index: int) -> list[str]:
    card = next(c for c in snapshot.cards if c.index == index)
    mode = "no MIG support" if card.mig_current is None else (
        f"MIG current {_mode(card.mig_current)}, pending {_mode(card.mig_pending)}"
    )
    head = f"card {card.index}: {card.name or 'unknown'} {card.uuid or ''} {card.pci_bus_id or ''} - {mode}"
    if card.mig_instances is not None:
        head += f", {card.mig_instances} instance(s)"
    if card.error:
        head += f" - UNREADABLE: {card.error}"
    lines = [head]
    for d in (d for d in snapshot.devices if d.card == index):
        kind = (f"MIG {d.profile or 'unknown'} GI {d.gpu_instance_id} CI {d.compute_instance_id}" if d.is_mig
                else "whole card")
        lines.append(f"  device {_device_name(d)}: {kind} {d.uuid or ''} - {_mib(d.memory.used_bytes)} used of "
                     f"{_mib(d.memory.total_bytes)}")
        for p in snapshot.processes_on(d.index):
            lines.append(f"    pid {p.pid} {p.type} {p.name or '?'} {_mib(p.used_bytes)}")
    return lines


def _mode(enabled: bool | None) -> str:
    return "unknown" if enabled is None else ("enabled" if enabled else "disabled")


def as_json(report: Report) -> dict[str, Any]:
    snapshot = report.snapshot
    return {
        "reads": [
            {"source": r.source, "ok": r.ok, "error": r.error, "duration_seconds": round(r.duration_s, 6)}
            for r in report.readings
        ],
        "driver_version": snapshot.driver_version if snapshot else None,
        "cuda_version": snapshot.cuda_version if snapshot else None,
        "cards": [
            {
                "card": c.index, "name": c.name, "uuid": c.uuid, "pci_bus_id": c.pci_bus_id,
                "mig_current": c.mig_current, "mig_pending": c.mig_pending, "mig_instances": c.mig_instances,
                "error": c.error,
                "devices": [
                    {
                        "index": d.index, "device": d.display_name, "mig_profile": d.profile, "uuid": d.uuid,
                        "gpu_instance": d.gpu_instance_id, "compute_instance": d.compute_instance_id,
                        "class": d.device_class, "memory_total_bytes": d.memory.total_bytes,
                        "memory_used_bytes": d.memory.used_bytes,
                        "processes": [
                            {"pid": p.pid, "type": p.type, "name": p.name, "used_bytes": p.used_bytes}
                            for p in snapshot.processes_on(d.index)
                        ],
                    }
                    for d in snapshot.devices if d.card == c.index
                ],
            }
            for c in snapshot.cards
        ] if snapshot else [],
        "warnings": [
            {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix} for f in report.findings
        ],
        "exit_code": report.exit_code,
    }
