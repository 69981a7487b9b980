"""Devices counted by class: the one definition of *free* that every view uses (the
recording rules, the dashboard, the landing page, ``doctor``, ``status`` and ``fleet``).

A device is **free** when the driver lists no process on it, **in use** when it lists one
or more (a process whose memory is ``N/A`` included), and **unknown** when the driver gives
no process list for it (``<processes>N/A</processes>``, an NVML without a list pynvml can
call): never free. The memory free of a class is the sum of its devices' free memory, each
GPU instance once: compute instances of one GPU instance share its memory and each report
all of it (docs/metrics.md#shared-memory-of-compute-instances).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from mig_exporter.model.snapshot import Device, Snapshot

UNKNOWN_CLASS = ""  # the class label of a device whose product name the driver did not give
TIMES = "\u00d7"  # how many of a class: 7 \u00d7 h100-80g-mig-1g.10gb


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
        """``7 x h100-80g-mig-1g.10gb (2 free)`` (with a multiplication sign); a class with nothing
        free says which way."""
        name = self.device_class or "unknown class"
        if self.free:
            state = f"{self.free} free"
        elif self.in_use == self.devices:
            state = "in use"
        elif self.unknown == self.devices:
            state = "processes unknown"
        else:
            state = "none free"
        return f"{self.devices} {TIMES} {name} ({state})"

    def as_json(self) -> dict[str, Any]:
        """As ``status --output json`` and ``doctor --format json`` give it."""
        return {"class": self.device_class, "devices": self.devices, "free": self.free, "in_use": self.in_use,
                "unknown": self.unknown, "memory_free_bytes": self.memory_free_bytes}


def processes_per_device(snapshot: Snapshot) -> Counter[int]:
    """How many processes the driver lists on each device, by placement index (none: absent)."""
    return Counter(map(attrgetter("device_index"), snapshot.processes))


def device_state(device: Device, processes_on: int) -> str:
    """``free``, ``in use`` or ``unknown``, for a device with ``processes_on`` processes listed."""
    if not device.processes_known:
        return "unknown"
    return "in use" if processes_on else "free"


def count_by_class(snapshot: Snapshot) -> tuple[ClassCount, ...]:
    """The node's devices by class, in the order the classes first appear."""
    on = processes_per_device(snapshot)
    states: dict[str, dict[str, int]] = {}
    memory: dict[str, dict[tuple[int, int | None], int]] = {}
    for device in snapshot.devices:
        klass = device.device_class or UNKNOWN_CLASS
        counts = states.setdefault(klass, {"free": 0, "in use": 0, "unknown": 0})
        counts[device_state(device, on[device.index])] += 1
        free = device.memory.free_bytes
        per_instance = memory.setdefault(klass, {})
        if free is not None:
            # A whole card, or a GPU instance: the key its compute instances share. As the rules
            # take it (gpu_instance "" on a whole card, and on a MIG device whose id is N/A).
            key = (device.card, device.gpu_instance_id)
            per_instance[key] = max(free, per_instance.get(key, 0))
    return tuple(
        ClassCount(klass, sum(c.values()), c["free"], c["in use"], c["unknown"],
                   sum(memory[klass].values()) if memory[klass] else None)
        for klass, c in states.items()
    )


def summary(counts: tuple[ClassCount, ...]) -> str:
    """``7 x h100-80g-mig-1g.10gb (2 free), 1 x h100-80g (in use)`` (with multiplication signs)."""
    return ", ".join(c.describe() for c in counts)
