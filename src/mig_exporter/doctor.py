"""``mig-exporter doctor``: read both paths, show what they see, and warn of
the states in which nothing can run or the numbers are wrong.

Pure analysis lives here (``diagnose``, ``render_text``, ``as_json``); the CLI
does the reading. Every finding names its fix, and has a severity:

- ``error``: workloads cannot run, or the exporter's numbers are wrong (a card
  it cannot read, MIG with nothing carved, processes hidden from it, two paths
  that disagree, no GPU visible);
- ``warning``: worth fixing, but the exporter reads right (one path of two is
  unavailable, nvidia-smi is slow, a MIG mode change waits for a reset).

Each device's activity (GPM) is shown where measured, and where not, which case of those the
metrics leave out applies, in plain words (``ACTIVITY_UNKNOWN_WORDS``); each process on a whole
card, its share of the card's SMs and memory.

Each card's health is its grade, made once when the snapshot was built
(``Card.verdict``, by ``model/health.py``'s rules of ``mig_exporter_card_health``):
a card that needs a reset or replacing is an error, a warning state a warning,
each with the grade's reasons. Notes are what cannot be seen, not problems: a
card in MIG mode cannot report its remapped rows, XIDs cannot be watched
without NVML's events, and a value one path gives and the other does not
cannot be compared (only values both give are: one that differs is an error).

The exit code (``Report.exit_code``), for readiness gates and scripts:
0 when at least one path reads and there is no error; 1 when there is an
error; 3 when a card needs a reset or replacing (before 1: the hardware
needs someone); 2 when nothing can be read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mig_exporter.core.errors import ReadError
from mig_exporter.core.visible import shown, visible
from mig_exporter.model.capacity import (
    EMPTY_DEVICE_MARGIN_BYTES,
    GPU_ONLY,
    UNKNOWN,
    HostView,
    count_by_class,
    device_states,
    summary,
)
from mig_exporter.model.health import CardHealth, EccCount, Verdict
from mig_exporter.model.snapshot import (
    ACTIVITY_FIRST_SAMPLE,
    ACTIVITY_NO_COMPUTE_INSTANCE,
    ACTIVITY_NO_GPM,
    ACTIVITY_NOT_MEASURED,
    ACTIVITY_NOT_READ,
    ACTIVITY_READ_FAILED,
    MIB,
    Activity,
    Card,
    Device,
    Snapshot,
)

log = logging.getLogger(__name__)

# Memory in use on a device with no process listed, beyond this, means the
# process list is hidden from us (not in the host PID namespace). An idle
# device holds a few MiB of context; a real workload holds gigabytes.
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
NOTE = "note"  # what cannot be seen; counted neither as an error nor as a warning
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_UNREADABLE = 2
EXIT_CARD_HEALTH = 3
# The findings of a card that needs someone: a reset, or a new card.
HEALTH_EXIT_CODES = ("card-needs-reset", "card-needs-replacing")
NO_XIDS_WITHOUT_NVML = "no XIDs: the kernel's log is not read and nvidia-smi gives none"
NO_NVML_EVENTS = "NVML is not read: nvidia-smi gives no XID events"
# What still covers a card in MIG mode that cannot report its remapped rows.
MIG_REMAP_COVER = ("XIDs 63 and 64 (row remapping) and 94 and 95 (contained and uncontained memory errors; "
                   "from the kernel's log, and NVML's events), the recovery action "
                   "(mig_exporter_card_recovery_action) and its instances' own SRAM errors "
                   "(mig_exporter_device_ecc_errors_total)")


# Why a device's activity is left out of the metrics (mig_exporter_device_activity_unknown's reason),
# as a person reads it: what the case is, and what, if anything, makes it measured.
ACTIVITY_UNKNOWN_WORDS = {
    ACTIVITY_NO_GPM: "not measured: the card has no GPM (GPU Performance Monitoring came with Hopper; an A100 or "
                     "A30 has none)",
    ACTIVITY_FIRST_SAMPLE: "not measured yet: one sample so far, and a window needs two (the exporter's next scrape "
                           "has one)",
    ACTIVITY_NO_COMPUTE_INSTANCE: "not measured: its GPU instance has no compute instance, and the driver measures "
                                  "nothing without one",
    ACTIVITY_NOT_MEASURED: "not measured: the driver answered every activity metric with an error, NaN or infinity",
    ACTIVITY_READ_FAILED: "not measured: reading it failed (the read's problems say why)",
    ACTIVITY_NOT_READ: "not read: this read path (nvidia-smi) has none; NVML does, on Hopper and later",
}
# Activity's ratios as doctor names them.
_ACTIVITY_NAMES = (("graphics_ratio", "graphics"), ("sm_ratio", "SM"), ("sm_occupancy_ratio", "SM occupancy"),
                   ("tensor_ratio", "tensor"), ("dram_bandwidth_ratio", "DRAM bandwidth"))


def activity_words(device: Device) -> str:
    """The device's activity as doctor prints it: the ratios measured over the window, or why none is."""
    activity = device.activity
    if activity is None:
        reason = device.activity_unknown or ACTIVITY_NOT_READ
        return ACTIVITY_UNKNOWN_WORDS.get(reason, f"not measured ({reason})")
    shown = [f"{name} {100 * value:.0f}%" for field, name in _ACTIVITY_NAMES
             if (value := getattr(activity, field)) is not None]
    return ", ".join(shown) + f" over the last {activity.window_seconds:.0f} s"


def _activity_json(activity: Activity | None) -> dict[str, float | None] | None:
    return None if activity is None else {"window_seconds": activity.window_seconds,
                                          **{field: getattr(activity, field) for field, _ in _ACTIVITY_NAMES}}


@dataclass(frozen=True, slots=True)
class XidWatch:
    """Whether the exporter can watch XID events through NVML, on how many cards, and why not."""

    watching: bool
    cards: int
    reason: str | None


def xid_watch() -> XidWatch:
    """The NVML XID watcher's own answer (``sources/xid.py``'s ``xid_watch_status``), imported
    here, lazily: a build without it, or a watcher that fails, is "not watching", with why."""
    try:
        from mig_exporter.sources.xid import xid_watch_status
    except ImportError as e:
        return XidWatch(False, 0, f"this build has no XID watcher ({e})")
    try:
        status = xid_watch_status()
    except Exception as e:  # doctor reports a watcher that fails; it does not crash on one
        log.debug("xid_watch_status failed", exc_info=True)
        return XidWatch(False, 0, f"the XID watcher failed: {type(e).__name__}: {e}")
    return XidWatch(bool(status.watching), int(status.cards), status.reason)


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
    # What cannot be seen (severity NOTE): remapped rows of a card in MIG mode, XIDs.
    notes: tuple[Finding, ...] = field(default=())
    xids: XidWatch | None = None
    # Whether the kernel's log (/dev/kmsg, the XID lines since boot) reads, and why not; None: not asked.
    kmsg: tuple[bool, str | None] | None = None
    # What decides a device's state beyond the read, as status has it: the PID namespace, and
    # the allocations to pods and Slurm jobs of the snapshot shown.
    host: HostView = GPU_ONLY

    @property
    def snapshot(self) -> Snapshot | None:
        """What to show: the first path that read (NVML before nvidia-smi)."""
        return shown_snapshot(self.readings)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def exit_code(self) -> int:
        """2: no path reads; 3: a card needs a reset or replacing; 1: another error; 0: otherwise."""
        if self.snapshot is None:
            return EXIT_UNREADABLE
        if any(f.code in HEALTH_EXIT_CODES for f in self.findings):
            return EXIT_CARD_HEALTH
        return EXIT_PROBLEM if self.errors else EXIT_OK


def shown_snapshot(readings: Iterable[PathReading | None]) -> Snapshot | None:
    """The snapshot doctor shows, and reads the allocations of: the first path's that read."""
    return next((r.snapshot for r in readings if r is not None and r.snapshot is not None), None)


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
    xids: XidWatch | None = None,
    host: HostView = GPU_ONLY,
    allocation_problems: Iterable[str] = (),
    kmsg: tuple[bool, str | None] | None = None,
) -> Report:
    """The findings of one read of each path. ``nvml`` is None where it was not
    read (``doctor --demo``, whose sample is nvidia-smi's output). ``xids``: the
    XID watcher's answer; asked of it (``xid_watch``) when NVML reads and none is given.
    ``host``: what decides the devices' states beyond the read (``host_view``), and
    ``allocation_problems`` what reading its allocations found. ``kmsg``: whether the kernel's
    log reads (``sources/kmsg.py``'s ``kmsg_status``), and why not.

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
    snapshot = shown_snapshot(readings)
    notes: list[Finding] = []
    if snapshot is not None:
        findings.extend(_card_findings(snapshot))
        findings.extend(_health_findings(snapshot))
        findings.extend(_unlisted_memory_findings(snapshot, host))
        findings.extend(_allocation_findings(snapshot, host, tuple(allocation_problems)))
        notes.extend(_remap_notes(snapshot))
    xids = (xids if xids is not None else xid_watch()) if nvml is not None and nvml.ok else None
    notes.extend(_xid_notes(xids, kmsg))
    if nvml is not None and nvml.snapshot is not None and smi.snapshot is not None:
        compared = compare_paths(nvml.snapshot, smi.snapshot)
        if compared.differences:
            findings.append(Finding(
                "paths-disagree", "NVML and nvidia-smi disagree: " + _some(compared.differences),
                "run doctor again (a change between the two reads shows once); if it persists, the "
                "libnvidia-ml the exporter loads and the nvidia-smi it runs come from different drivers",
            ))
        if compared.one_path_only:
            notes.append(Finding(
                "one-path-only", "values one path gives and the other does not, not compared: "
                + _some(compared.one_path_only),
                "nothing to do: each path reads what its driver interface offers (docs/metrics.md, "
                "\"Where the paths differ\"); the exporter exports what the path it reads gives", NOTE))
    return Report(readings, tuple(findings), tuple(notes), xids, kmsg, host)


def _some(lines: Sequence[str], most: int = 10) -> str:
    """The first ``most`` lines, and how many more."""
    return "; ".join(lines[:most]) + (f"; and {len(lines) - most} more" if len(lines) > most else "")


def _xid_notes(xids: XidWatch | None, kmsg: tuple[bool, str | None] | None = None) -> Iterable[Finding]:
    """Why XIDs are not seen: the kernel's log unreadable (the one source of XIDs since boot, and
    of their pids), and NVML's events not watched (none without NVML, or the watcher's reason)."""
    kmsg_reads = kmsg is not None and kmsg[0]
    if kmsg is not None and not kmsg[0]:
        yield Finding("xids-kmsg-unreadable", f"the kernel's log cannot be read: {kmsg[1] or 'no reason given'}",
                      "mount the host's /dev/kmsg; in Kubernetes the container must be allowed to open it "
                      "(securityContext.privileged: true) and hold CAP_SYSLOG where kernel.dmesg_restrict=1; "
                      "until then XIDs since boot and their pids are not seen (docs/xids.md)", NOTE)
    if xids is None and not kmsg_reads:
        yield Finding("xids-not-watched", NO_XIDS_WITHOUT_NVML,
                      "read the kernel's log (--collector.xid.kmsg) or run the exporter with --source nvml (or "
                      "auto, where NVML loads) to export mig_exporter_xid_errors_total", NOTE)
    elif xids is not None and not xids.watching:
        yield Finding("xids-not-watched", f"NVML's XID events cannot be watched: {xids.reason or 'no reason given'}",
                      "the kernel's log gives the XIDs where it reads" if kmsg_reads else
                      "the alerts on XIDs (docs/alerts.md) see nothing from this node", NOTE)


def verdicts(snapshot: Snapshot) -> dict[int, Verdict]:
    """Each readable card's grade, as the snapshot made it (``Card.verdict``: the one the
    families and the page show). An unreadable card has none: unknown, not ok."""
    return {c.index: c.verdict for c in snapshot.cards if c.verdict is not None}


_COOLING = "check the card's cooling, airflow and power delivery: the hardware slows it down"
# A warning reason's code (Verdict.codes), and what to do about it.
_WARNING_FIXES = {
    "temperature_over_threshold": "check the card's cooling and airflow now: it is at or past its own slowdown or "
                                  "shutdown temperature",
    "ecc_unreadable": "read the card's ECC counts with nvidia-smi -q -d ECC: one could not be read, so errors may be "
                      "hidden; check the driver and the card",
    "ecc_uncorrectable": "watch the card: an uncorrectable error is often followed by a pending row remap or "
                         "page retirement (a reset), or XIDs 48, 63, 64, 94, 95",
    "ecc_sram_threshold": "the card's SRAM is wearing out: plan to replace it",
    **dict.fromkeys(("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"),
                    _COOLING),
    "temperature_margin": "check the card's cooling and airflow: it is close to slowing down",
    "row_remap_exhausted": "the next failing row in that bank cannot be remapped: plan to replace the card",
    "recovery_action": "follow the driver's advice (nvidia-smi -q shows the recovery action)",
    "recovery_action_unknown": "read the driver's advice as nvidia-smi -q shows it (GPU Recovery Action) and the "
                               "NVIDIA docs for it; treat it as a reset until known",
    "pcie_link_width": "the link trained to a quarter of the card's lanes or fewer: reseat the card, check its "
                       "riser or slot, and the lanes again after a reboot (nvidia-smi -q -d PCI -i <card>)",
}


def _health_findings(snapshot: Snapshot) -> Iterable[Finding]:
    names = {c.index: c.name or "unknown" for c in snapshot.cards}
    for index, found in verdicts(snapshot).items():
        label = f"card {index} ({names[index]})"
        why = "; ".join(found.reasons)
        # Each warning reason's fix, after the reset's or the replacement's where there is one.
        fixes = "; ".join(dict.fromkeys(_WARNING_FIXES[code].replace("<card>", str(index)) for code in found.codes
                                        if code in _WARNING_FIXES))
        if found.state == "replace":
            yield Finding("card-needs-replacing", f"{label} needs replacing: {why}", _then(
                "drain the card and have it replaced (RMA): its memory has failed beyond repair "
                f"(nvidia-smi -q -d ROW_REMAPPER,ECC -i {index})", fixes))
        elif found.state == "reset":
            yield Finding("card-needs-reset", f"{label} needs a reset: {why}", _then(
                f"drain its workloads and reset it when idle (nvidia-smi -r -i {index}), or reboot the "
                "node; on Kubernetes cordon and drain the node first", fixes))
        elif found.state == "warning":
            yield Finding("card-health-warning", f"{label}: {why}",
                          fixes or "watch the card (mig_exporter_card_health)", WARNING)


def _then(fix: str, more: str) -> str:
    return f"{fix}; then: {more}" if more else fix


def remapped_rows_unknown(card: Card) -> bool:
    """A readable card in MIG mode whose remapped rows the driver did not give (both paths:
    N/A in the XML, NOT_SUPPORTED from NVML)."""
    h = card.health
    return (card.error is None and bool(card.mig_current) and h.row_remap_pending is None
            and h.remapped_rows_uncorrectable is None and h.remapped_rows_correctable is None)


def _remap_notes(snapshot: Snapshot) -> Iterable[Finding]:
    for card in snapshot.cards:
        if remapped_rows_unknown(card):
            yield Finding(
                "remapped-rows-unknown",
                f"card {card.index} ({card.name or 'unknown'}) is in MIG mode: it cannot report its remapped rows "
                "(nvidia-smi writes N/A, NVML answers NOT_SUPPORTED), so a pending or failed row remap is not seen",
                f"what still covers it: {MIG_REMAP_COVER}", NOTE)


# The fix for a container without the MIG monitor capability. The NVIDIA runtime hook refuses
# NVIDIA_MIG_MONITOR_DEVICES in a container without CAP_SYS_ADMIN in its bounding set
# ("cannot set MIG_MONITOR_DEVICES in non privileged container"), so the two go together.
MIG_MONITOR_FIX = (
    "give the container the MIG monitor capability (/dev/nvidia-caps/nvidia-cap2): on Kubernetes set the chart's "
    "migMonitor.enabled=true (it sets NVIDIA_MIG_MONITOR_DEVICES=all and adds SYS_ADMIN, without which the "
    "NVIDIA runtime hook refuses the variable); with docker: -e NVIDIA_MIG_MONITOR_DEVICES=all --cap-add "
    "SYS_ADMIN. In CDI mode the variable is ignored before toolkit 1.20.1 (JIT-CDI), which honours it under "
    "the same rule. See docs/mig-monitor.md"
)


def mig_monitor_missing(card: Card) -> bool:
    """A card in MIG mode whose aggregate readings the driver refused to us: its memory (NVML
    NO_PERMISSION, nvidia-smi "Insufficient Permissions"), or a card whose read NVML refused."""
    if not card.mig_current:
        return False
    return card.aggregate_denied or (card.error is not None and "NO_PERMISSION" in card.error)


def _mig_monitor_finding(card: Card, label: str) -> Finding:
    if card.error is not None:
        seen = f"NVML refused it ({card.error}): none of its instances or processes is read"
    elif card.mig_instances:
        seen = (f"{card.mig_instances} instance(s) seen, those this container was given at its start; an "
                "instance made since, and the card's memory, are hidden")
    else:
        seen = ("no instance is seen, so whether none is carved or all are hidden cannot be told; its "
                "memory is hidden")
    return Finding(
        "mig-monitor-missing",
        f"{label} is in MIG mode and the driver refuses this container its aggregate readings (memory: "
        f"Insufficient Permissions): the container lacks the MIG monitor capability; {seen}",
        MIG_MONITOR_FIX,
    )


def _no_permission_finding(card: Card, message: str, what: str) -> Finding:
    """A card not in MIG mode that this process may not ``what`` ("open", "read in full"): its device node."""
    return Finding(
        "card-no-permission", message,
        f"the exporter may not {what} /dev/nvidia{card.index}: on Kubernetes "
        "keep the nvidia runtime class and NVIDIA_VISIBLE_DEVICES=all (docs/kubernetes.md, GPU access); elsewhere "
        "run it as a user in the device node's group, or through the NVIDIA container runtime",
    )


def _card_findings(snapshot: Snapshot) -> Iterable[Finding]:
    for card in snapshot.cards:
        label = f"card {card.index} ({card.name or 'unknown'})"
        monitor_missing = mig_monitor_missing(card)
        if monitor_missing:
            yield _mig_monitor_finding(card, label)
        if card.error is not None:
            if "NO_PERMISSION" in card.error and not monitor_missing:
                # Not the card's fault: this process may not open its device node.
                yield _no_permission_finding(card, f"{label} could not be read: {card.error}", "open")
            elif not monitor_missing:
                yield Finding(
                    "card-unreadable", f"{label} could not be read: {card.error}",
                    "check the kernel log for Xid errors (dmesg); a lost GPU needs a reset or a reboot",
                )
            continue
        if card.aggregate_denied and not card.mig_current:
            yield _no_permission_finding(
                card, f"{label}: the driver refuses this process the card's memory (Insufficient Permissions)",
                "read in full")
        if card.mig_current and card.mig_instances == 0 and not card.aggregate_denied:
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


def _unlisted_memory_findings(snapshot: Snapshot, host: HostView) -> Iterable[Finding]:
    """Memory held beyond an empty device's with no process listed on the device or on the
    compute instances sharing its GPU instance: the state model/capacity.py calls unknown."""
    # Asked as if the host's PIDs were seen, so that the memory is looked at on every device.
    states = device_states(snapshot, HostView(True, host.allocated, True))
    for device in snapshot.devices:
        used = device.memory.used_bytes
        if (device.processes_known and used is not None and used > EMPTY_DEVICE_MARGIN_BYTES
                and states[device.index].state == UNKNOWN):
            yield Finding(
                "memory-without-processes",
                f"device {_device_name(device)} holds {used // MIB} MiB but no process is listed, so it is "
                "never counted free",
                "the exporter probably does not see the host's PID namespace: run it with hostPID: true "
                "(Kubernetes) or --pid=host (docker)" if host.host_pids is not True else
                "a process the driver does not name holds it (a vGPU VM, a process in another PID namespace "
                "of the host): nvidia-smi on the host shows it",
            )


def _allocation_findings(snapshot: Snapshot, host: HostView, problems: tuple[str, ...]) -> Iterable[Finding]:
    """The allocations to pods and Slurm jobs could not all be read: no empty device is free."""
    if host.allocations_known or not snapshot.devices:
        return
    why = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    yield Finding(
        "allocations-unknown",
        f"the device allocations could not all be read, so no empty device counts free: {why or 'no reason given'}",
        "as the reason says: the kubelet's socket needs the host's /var/lib/kubelet/pod-resources mounted and "
        "uid 0 (docs/kubernetes.md); each file of the Slurm job-map directory must be readable, within --timeout "
        "(docs/hpc.md)",
        WARNING,  # the numbers are not wrong: the devices are counted unknown
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """Two snapshots of one node compared: ``differences``, values both give that differ (an
    error: ``paths-disagree``); ``one_path_only``, values one gives and the other does not
    (a note: an NVML field nvidia-smi does not print, a threshold the XML writes and NVML does
    not give, an instance's SRAM count one path reports as 0 and the other leaves out)."""

    differences: tuple[str, ...] = ()
    one_path_only: tuple[str, ...] = ()


class _Lines:
    """The lines of a comparison as it is made; ``names``: the two paths, in order."""

    def __init__(self, names: tuple[str, str]) -> None:
        self.names = names
        self.differences: list[str] = []
        self.one_path_only: list[str] = []

    def value(self, what: str, a: Any, b: Any, tolerance: int | None = None,
              shown: Callable[[Any], str] = repr) -> None:
        """Compare a value where both give one; say which path alone gives it otherwise."""
        if a is None and b is None:
            return
        if a is None or b is None:
            self.one_path_only.append(f"{what} ({self.names[0] if b is None else self.names[1]} only)")
        elif a != b if tolerance is None else abs(a - b) > tolerance:
            self.differences.append(f"{what}: {shown(a)} vs {shown(b)}")

    def pairs(self, what: str, a: Iterable[tuple[Any, Any]], b: Iterable[tuple[Any, Any]]) -> None:
        """``(name, value)`` pairs (or ECC counts by key) compared name by name."""
        by_a, by_b = dict(a), dict(b)
        for key in sorted(set(by_a) | set(by_b), key=str):
            name = " ".join(key) if isinstance(key, tuple) else str(key)
            self.value(f"{what} {name}", by_a.get(key), by_b.get(key))


def compare(a: Snapshot, b: Snapshot) -> list[str]:
    """The values both snapshots of the same node give and differ on, one line each."""
    return list(compare_paths(a, b).differences)


def compare_paths(a: Snapshot, b: Snapshot, names: tuple[str, str] = ("NVML", "nvidia-smi")) -> Comparison:
    """Two snapshots of the same node (``names``: the paths that read them) compared value by
    value: a card, device or process one path sees and the other does not is a difference; a
    value one path gives and the other does not is not (``Comparison.one_path_only``)."""
    out = _Lines(names)
    a_cards = {c.index: c for c in a.cards}
    b_cards = {c.index: c for c in b.cards}
    for index in sorted(set(a_cards) | set(b_cards)):
        ca, cb = a_cards.get(index), b_cards.get(index)
        if ca is None or cb is None:
            out.differences.append(f"card {index} seen by one path only")
            continue
        for attr in ("uuid", "serial", "mig_current", "mig_pending", "mig_instances"):
            out.value(f"card {index} {attr}", getattr(ca, attr), getattr(cb, attr))
        _health_differences(out, f"card {index}", ca.health, cb.health)
    a_devices = {d.index: d for d in a.devices}
    b_devices = {d.index: d for d in b.devices}
    names_of = {i: _device_name(d) for i, d in (*b_devices.items(), *a_devices.items())}
    for index in sorted(set(a_devices) | set(b_devices)):
        da, db = a_devices.get(index), b_devices.get(index)
        if da is None or db is None:
            out.differences.append(f"device {names_of[index]} seen by one path only")
            continue
        _device_differences(out, da, db)
    # Processes only where both paths list them (a path the driver refuses the list gives none).
    listed = {i for i in set(a_devices) & set(b_devices)
              if a_devices[i].processes_known and b_devices[i].processes_known}
    a_procs = {(p.device_index, p.pid): p for p in a.processes if p.device_index in listed}
    b_procs = {(p.device_index, p.pid): p for p in b.processes if p.device_index in listed}
    for key in sorted(set(a_procs) ^ set(b_procs)):
        out.differences.append(f"process {key[1]} on device {names_of.get(key[0], key[0])} seen by one path only")
    for key in sorted(set(a_procs) & set(b_procs)):
        pa, pb = a_procs[key], b_procs[key]
        out.value(f"process {key[1]} type", pa.type or None, pb.type or None, shown=str)
        out.value(f"process {key[1]} memory", pa.used_bytes, pb.used_bytes, _USED_TOLERANCE_BYTES, _mib)
    return Comparison(tuple(out.differences), tuple(out.one_path_only))


# Health readings that move between two reads a moment apart: not compared. (An idle link
# drops its PCIe generation to save power, and takes it up again under load.)
_HEALTH_MOVING = frozenset({
    "memory_temperature_celsius", "temperature_margin_celsius", "clock_events_active", "clock_event_seconds",
    "performance_state", "clocks", "fan_speed_ratio", "pcie_replays", "pcie_link_generation_current"})
# What one path alone gives (docs/metrics.md, "Where the paths differ"): not even a note.
HEALTH_NVML_ONLY = frozenset({"energy_joules"})


def _health_differences(out: _Lines, card: str, a: CardHealth, b: CardHealth) -> None:
    """The card's health readings, as ``_Lines.value`` compares them; pairs and ECC counters
    name by name (``card 0 ecc volatile dram uncorrectable: 1 vs 0``)."""
    for f in dataclasses.fields(CardHealth):
        if f.name in _HEALTH_MOVING or f.name in HEALTH_NVML_ONLY:
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.name == "recovery_action_unknown":
            # Each path words an advice it does not know its own way (a string, NVML's number):
            # both having one is agreement.
            va, vb = va and "an action this exporter does not know", vb and "an action this exporter does not know"
        if f.name == "ecc_errors":
            out.pairs(f"{card} ecc", _ecc_counts(va), _ecc_counts(vb))
        elif isinstance(va, tuple) and isinstance(vb, tuple):
            out.pairs(f"{card} {f.name}", va, vb)
        else:
            out.value(f"{card} {f.name}", va, vb)


def _ecc_counts(counts: tuple[EccCount, ...]) -> list[tuple[tuple[str, str, str], int]]:
    return [((e.scope, e.memory, e.type), e.errors) for e in counts]


def _device_differences(out: _Lines, a: Device, b: Device) -> None:
    name = f"device {_device_name(a)}"
    for attr in ("uuid", "profile", "gpu_instance_id", "compute_instance_id", "device_class"):
        out.value(f"{name} {attr}", getattr(a, attr), getattr(b, attr))
    out.value(f"{name} memory total", a.memory.total_bytes, b.memory.total_bytes, _TOTAL_TOLERANCE_BYTES, _mib)
    out.value(f"{name} memory used", a.memory.used_bytes, b.memory.used_bytes, _USED_TOLERANCE_BYTES, _mib)
    out.pairs(f"{name} ecc", _ecc_counts(a.ecc_errors), _ecc_counts(b.ecc_errors))


def _device_name(d: Device) -> str:
    """``1/mig2 (1102)``: the name people read, and the placement index the
    metrics carry; a whole card is just its index."""
    return f"{d.display_name} ({d.index})" if d.is_mig else d.display_name


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / MIB:.0f} MiB"


def render_text(report: Report) -> str:
    """The report for a terminal. Names in it came from outside (a process's, a card's, a
    finding's quoted value): each line is made visible whole (core/visible.py), so a control,
    line separator or bidi character in a name is shown as an escape, never obeyed, and the only
    line breaks are the report's own."""
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
        if snapshot.devices:
            lines.append("")
            lines.append("devices by class: " + summary(count_by_class(snapshot, report.host)))
    if report.xids is not None and report.xids.watching:
        partly = f" ({report.xids.reason})" if report.xids.reason else ""
        lines.append(f"XIDs: watched through NVML events on {report.xids.cards} card(s){partly}")
    lines.append("")
    errors = len(report.errors)
    warnings = len(report.findings) - errors
    for f in sorted(report.findings, key=lambda f: f.severity != ERROR):
        lines.append(f"{f.severity.upper()} [{f.code}] {f.message}")
        lines.append(f"      fix: {f.fix}")
    for f in report.notes:
        lines.append(f"NOTE [{f.code}] {f.message}")
        lines.append(f"      {f.fix}")
    lines.append(f"{_verdict(report.exit_code)}: {errors} error(s), {warnings} warning(s) (exit {report.exit_code})")
    return "".join(visible(line) + "\n" for line in lines)


def _verdict(exit_code: int) -> str:
    return {EXIT_OK: "ok", EXIT_PROBLEM: "problems found", EXIT_UNREADABLE: "nothing can be read",
            EXIT_CARD_HEALTH: "a card needs a reset or replacing"}[exit_code]


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
    found = verdicts(snapshot).get(index)
    if found is not None:
        lines.append(f"  health: {found.label}")
        lines.extend(f"    - {r}" for r in found.reasons)
    if remapped_rows_unknown(card):
        lines.append("  remapped rows: not reported in MIG mode (see the note below)")
    for d in (d for d in snapshot.devices if d.card == index):
        kind = (f"MIG {d.profile or 'unknown'} GI {d.gpu_instance_id} CI {d.compute_instance_id}" if d.is_mig
                else "whole card")
        lines.append(f"  device {_device_name(d)}: {kind} {d.uuid or ''} - {_mib(d.memory.used_bytes)} used of "
                     f"{_mib(d.memory.total_bytes)}")
        lines.append(f"    activity: {activity_words(d)}")
        shares = {a.pid: a for a in snapshot.process_activity if a.device_index == d.index}
        for p in snapshot.processes_on(d.index):
            share = shares.get(p.pid)
            ratios = () if share is None else (("SM", share.sm_ratio), ("memory", share.memory_ratio))
            measured = "".join(f", {name} {100 * value:.0f}%" for name, value in ratios if value is not None)
            lines.append(f"    pid {p.pid} {p.type} {shown(p.name) or '?'} {_mib(p.used_bytes)}{measured}")
    return lines


def _mode(enabled: bool | None) -> str:
    return "unknown" if enabled is None else ("enabled" if enabled else "disabled")


def _health_json(snapshot: Snapshot, card: Card) -> dict[str, Any] | None:
    """The card's grade, as mig_exporter_card_health has it; None for an unreadable card."""
    found = verdicts(snapshot).get(card.index)
    if found is None:
        return None
    return {"state": found.state, "label": found.label, "reasons": list(found.reasons), "codes": list(found.codes),
            "remapped_rows_reported": not remapped_rows_unknown(card)}


def as_json(report: Report) -> dict[str, Any]:
    snapshot = report.snapshot
    xids = report.xids
    states = device_states(snapshot, report.host) if snapshot else {}
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
                "error": c.error, "health": _health_json(snapshot, c),
                "devices": [
                    {
                        "index": d.index, "device": d.display_name, "mig_profile": d.profile, "uuid": d.uuid,
                        "gpu_instance": d.gpu_instance_id, "compute_instance": d.compute_instance_id,
                        "class": d.device_class, "memory_total_bytes": d.memory.total_bytes,
                        "memory_used_bytes": d.memory.used_bytes,
                        "state": states[d.index].state, "reason": states[d.index].reason,
                        "activity": _activity_json(d.activity),
                        "activity_unknown": None if d.activity is not None else {
                            "reason": d.activity_unknown or ACTIVITY_NOT_READ, "why": activity_words(d)},
                        "process_activity": [
                            {"pid": a.pid, "sm_ratio": a.sm_ratio, "memory_ratio": a.memory_ratio}
                            for a in snapshot.process_activity if a.device_index == d.index
                        ],
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
        "classes": [c.as_json() for c in count_by_class(snapshot, states=states)] if snapshot else [],
        "warnings": [
            {"code": f.code, "severity": f.severity, "message": f.message, "fix": f.fix} for f in report.findings
        ],
        "notes": [{"code": f.code, "message": f.message, "detail": f.fix} for f in report.notes],
        "xids": {"watching": xids.watching, "cards": xids.cards, "reason": xids.reason} if xids is not None
        else {"watching": False, "cards": 0, "reason": NO_NVML_EVENTS},
        "kmsg": None if report.kmsg is None else {"readable": report.kmsg[0], "reason": report.kmsg[1]},
        "exit_code": report.exit_code,
    }
