"""Devices counted by class: the one definition of *free* that every view uses (the
exporter's ``mig_exporter_device_state``, which the recording rules, the dashboard and
``fleet`` count; the landing page, ``doctor`` and ``status``). docs/capacity.md says it in words.

A device is **free** when a scheduler may place work on it: the driver listed its processes
and none is on it, no pod or Slurm job is allocated to it, the exporter sees the host's PIDs
(else the driver's list may be missing processes it cannot name), and its memory in use is no
more than an empty device's (``EMPTY_DEVICE_MARGIN_BYTES``). It is **unknown**, and never
free, where any of that cannot be told; **in use** otherwise. The read itself succeeding,
and being recent, is the rules' part: a failed read has no device series at all.

The memory free of a class is the sum of its devices' free memory, each GPU instance once:
compute instances of one GPU instance share its memory and each report all of it
(docs/metrics.md#shared-memory-of-compute-instances).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, NamedTuple

from mig_exporter.model.readings import EngineReading, PodReading, SlurmJobMapReading
from mig_exporter.model.snapshot import Device, Snapshot

UNKNOWN_CLASS = ""  # the class label of a device whose product name the driver did not give
TIMES = "\u00d7"  # how many of a class: 7 \u00d7 h100-80g-mig-1g.10gb

FREE = "free"
IN_USE = "in_use"
UNKNOWN = "unknown"
STATES = (FREE, IN_USE, UNKNOWN)  # the values of mig_exporter_device_state's state label

# Memory an empty device shows in use, at most. In the real captures (tests/test_free.py
# reads them all), a device with no process listed holds 0 to 19 MiB on a MIG instance and 0 to
# 116 MiB on a whole card (a desktop card, 68 MiB under Windows' WDDM); the smallest CUDA process
# listed holds 160 MiB. 128 MiB lies between: more, with no process listed, is work the driver
# does not name to us (another PID namespace, a vGPU VM), never room to place work.
EMPTY_DEVICE_MARGIN_BYTES = 128 * 1024**2


class DeviceState(NamedTuple):
    """``state`` is ``free``, ``in_use`` or ``unknown``; ``reason`` says why, for a person."""

    state: str
    reason: str


@dataclass(frozen=True, slots=True)
class HostView:
    """What decides a device's state beyond the GPU read.

    ``host_pids``: whether the exporter sees the host's PIDs (``None``: /proc was not read, or
    could not be). ``allocated``: who each device is allocated to, by placement index
    (``pod NAMESPACE/POD``, ``Slurm job ID``); ``allocations_known`` is False when a source of
    allocations was asked and did not answer (the kubelet, the Slurm job-map directory), so an
    empty device may still be someone's."""

    host_pids: bool | None = True
    allocated: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    allocations_known: bool = True


# What a bare read knows: the GPU read only (tests, the docs' examples).
GPU_ONLY = HostView()


def host_view(engines: EngineReading | None, pods: PodReading | None,
              job_map: SlurmJobMapReading | None) -> HostView:
    """The HostView of one scrape's readings beside the GPU read. The kubelet not asked (no
    socket outside a pod: not on Kubernetes; switched off) and no job-map directory are no
    allocations; asked and not answering (no socket in a pod included), and a job map read
    in part (a device's file unread, the budget spent, too many files), are unknown ones."""
    allocated: dict[int, list[str]] = defaultdict(list)
    for a in (pods.allocations or ()) if pods is not None else ():
        allocated[a.device_index].append(f"pod {a.namespace}/{a.pod}")
    for s in job_map.allocations if job_map is not None else ():
        allocated[s.device_index].append(f"Slurm job {s.job}")
    kubelet_failed = pods is not None and pods.pod_resources_success is False
    job_map_failed = job_map is not None and not (job_map.read_success and job_map.complete)
    return HostView(engines.host_pid_namespace if engines is not None else None,
                    {index: tuple(dict.fromkeys(who)) for index, who in allocated.items()},
                    not (kubelet_failed or job_map_failed))


@dataclass(frozen=True, slots=True)
class ClassCount:
    """One device class on a node."""

    device_class: str
    devices: int
    free: int
    in_use: int
    unknown: int
    # ``None`` when no device of the class reports its free memory.
    memory_free_bytes: int | None

    def describe(self) -> str:
        """``7 x h100-80g-mig-1g.10gb (2 free)`` (with a multiplication sign); with nothing
        free it says which way, and unknown devices are always named."""
        name = self.device_class or "unknown class"
        if self.free:
            state = f"{self.free} free" + (f", {self.unknown} unknown" if self.unknown else "")
        elif self.in_use == self.devices:
            state = "in use"
        elif self.unknown == self.devices:
            state = "unknown"
        else:
            state = f"none free, {self.unknown} unknown"
        return f"{self.devices} {TIMES} {name} ({state})"

    def as_json(self) -> dict[str, Any]:
        """As ``status --output json`` and ``doctor --format json`` give it."""
        return {"class": self.device_class, "devices": self.devices, "free": self.free, "in_use": self.in_use,
                "unknown": self.unknown, "memory_free_bytes": self.memory_free_bytes}


def processes_per_device(snapshot: Snapshot) -> Counter[int]:
    """How many processes the driver lists on each device, by placement index (none: absent)."""
    return Counter(map(attrgetter("device_index"), snapshot.processes))


def device_states(snapshot: Snapshot, host: HostView = GPU_ONLY) -> dict[int, DeviceState]:
    """Each device's state, by placement index: the one definition (module docstring)."""
    on = processes_per_device(snapshot)
    # Compute instances of one GPU instance share its memory: what a busy sibling holds is
    # not this one's to place.
    busy_siblings: dict[tuple[int, int], list[str]] = defaultdict(list)
    for d in snapshot.devices:
        if d.gpu_instance_id is not None and on[d.index]:
            busy_siblings[(d.card, d.gpu_instance_id)].append(d.display_name)
    unreadable = {c.index for c in snapshot.cards if c.error is not None}
    return {d.index: _state(d, on[d.index], host, unreadable, busy_siblings) for d in snapshot.devices}


def _state(d: Device, listed: int, host: HostView, unreadable: set[int],
           busy_siblings: Mapping[tuple[int, int], list[str]]) -> DeviceState:
    if listed:  # a listed process is work, whatever else is unknown
        return DeviceState(IN_USE, f"{listed} process{'es' if listed != 1 else ''} listed")
    if who := host.allocated.get(d.index):
        return DeviceState(IN_USE, "allocated to " + ", ".join(who) + " (no process yet)")
    if d.card in unreadable:
        return DeviceState(UNKNOWN, "its card could not be read")
    if not d.processes_known:
        return DeviceState(UNKNOWN, "the driver gives no process list for it")
    if host.host_pids is None:
        return DeviceState(UNKNOWN, "whether the exporter sees the host's PIDs is unknown (/proc not read)")
    if not host.host_pids:
        return DeviceState(UNKNOWN, "the exporter does not see the host's PIDs: the driver's list may miss processes")
    if not host.allocations_known:
        return DeviceState(UNKNOWN, "the device allocations could not be read (kubelet or Slurm job map)")
    used = d.memory.used_bytes
    if used is None:
        return DeviceState(UNKNOWN, "its memory in use is not reported")
    if used > EMPTY_DEVICE_MARGIN_BYTES:
        held = f"{used / 1024**3:.1f} GiB" if used >= 1024**3 else f"{used // 1024**2} MiB"
        siblings = busy_siblings.get((d.card, d.gpu_instance_id)) if d.gpu_instance_id is not None else None
        if siblings:
            return DeviceState(IN_USE, f"its GPU instance's memory is shared with {', '.join(siblings)}, "
                                       f"which holds {held} of it")
        return DeviceState(UNKNOWN, f"{held} in use with no process listed")
    return DeviceState(FREE, "no process, no allocation, memory as an empty device's")


def count_by_class(snapshot: Snapshot, host: HostView = GPU_ONLY,
                   states: Mapping[int, DeviceState] | None = None) -> tuple[ClassCount, ...]:
    """The node's devices by class, in the order the classes first appear."""
    states = device_states(snapshot, host) if states is None else states
    counts: dict[str, Counter[str]] = {}
    memory: dict[str, dict[tuple[int, int | None], int]] = {}
    for device in snapshot.devices:
        klass = device.device_class or UNKNOWN_CLASS
        counts.setdefault(klass, Counter())[states[device.index].state] += 1
        free = device.memory.free_bytes
        per_instance = memory.setdefault(klass, {})
        if free is not None:
            # A whole card, or a GPU instance: the key its compute instances share. As the rules
            # take it (gpu_instance "" on a whole card, and on a MIG device whose id is N/A).
            key = (device.card, device.gpu_instance_id)
            per_instance[key] = max(free, per_instance.get(key, 0))
    return tuple(
        ClassCount(klass, sum(c.values()), c[FREE], c[IN_USE], c[UNKNOWN],
                   sum(memory[klass].values()) if memory[klass] else None)
        for klass, c in counts.items()
    )


def summary(counts: Iterable[ClassCount]) -> str:
    """``7 x h100-80g-mig-1g.10gb (2 free), 1 x h100-80g (in use)`` (with multiplication signs)."""
    return ", ".join(c.describe() for c in counts)
