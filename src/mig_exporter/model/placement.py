"""Placement: turn cards as read into the devices a workload runs on.

These rules are shared by every read path, so a dashboard cannot tell which
path fed it:

- A card in MIG mode is reported as its MIG instances, never as the whole
  card. An instance's placement index is ``1000 + 100 * card + mig_index``;
  instances are ordered by MIG device index.
- A card not in MIG mode (or whose mode is unknown) is one device whose
  placement index is its nvidia-smi index, and every process on the card is
  on it.
- On a MIG card, a process belongs to the instance whose GPU-instance *and*
  compute-instance ids it carries, and to no other: charging the card's
  processes to every instance would make each look busy.
- A card in MIG mode with nothing carved yields no device; its
  ``mig_instances`` is 0, which says why.

A ``PlacementMemo`` keeps what each card's devices and processes were placed as
at the last read, with what that depends on (the card's identity, mode,
memory, instances and processes): a card whose are equal is not placed again
(its readings, temperature and power, are read anew every time). Equal inputs
place the same, so the snapshot is the one placing afresh makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

from mig_exporter.model.device_class import card_class, mig_device_class
from mig_exporter.model.health import grade, instance_uncorrectable
from mig_exporter.model.snapshot import (
    Card,
    CardReading,
    Device,
    MigInstance,
    PlacedProcessActivity,
    Process,
    ProcessReading,
    Snapshot,
)

MIG_INDEX_BASE = 1000
MIG_INDEX_PER_CARD = 100


def mig_placement_index(card: int, mig_index: int) -> int:
    """The placement index of MIG device ``mig_index`` on card ``card``."""
    return MIG_INDEX_BASE + MIG_INDEX_PER_CARD * card + mig_index


_Placed = tuple[list[Device], list[Process], list[str]]
# What a card's devices and processes depend on: index, uuid, name, MIG mode, error, memory,
# instances, processes (the card class comes from the name and the memory).
_PlacementKey = tuple[object, ...]


class PlacementMemo:
    """Each card's devices, processes and problem lines as the last read placed them, by card
    index, with the inputs they were placed from. For one source's reads, one after the
    other (a read on another thread meanwhile only finds less in it: it is swapped whole)."""

    __slots__ = ("cards",)

    def __init__(self) -> None:
        self.cards: dict[int, tuple[_PlacementKey, _Placed]] = {}


def place(
    readings: Iterable[CardReading],
    *,
    driver_version: str | None,
    cuda_version: str | None,
    problems: Iterable[str] = (),
    memo: PlacementMemo | None = None,
) -> Snapshot:
    """Build the snapshot from cards as read; ``memo``: the last read's placement, updated."""
    cards: list[Card] = []
    devices: list[Device] = []
    processes: list[Process] = []
    activity: list[PlacedProcessActivity] = []
    found = list(problems)
    last = memo.cards if memo is not None else {}
    now: dict[int, tuple[_PlacementKey, _Placed]] = {}
    for reading in readings:
        key = (reading.index, reading.uuid, reading.name, reading.mig_current, reading.error, reading.memory,
               reading.instances, reading.processes, reading.processes_known, reading.activity,
               reading.activity_unknown)
        klass = card_class(reading.name, reading.memory.total_bytes)
        in_mig = reading.mig_current is True and reading.error is None
        kept = last.get(reading.index)
        if kept is not None and kept[0] == key:
            card_devices, card_processes, card_problems = kept[1]
        else:
            card_devices, card_processes, card_problems = _place_card(reading, klass, in_mig)
        if reading.index not in now:  # a repeated index (garbage): the first kept; equal inputs place alike
            now[reading.index] = (key, (card_devices, card_processes, card_problems))
        # Its readings are new at every read; its grade is made here, once, with its instances' own ECC counts.
        cards.append(_card_from_reading(reading, klass, in_mig, card_devices))
        devices.extend(card_devices)
        processes.extend(card_processes)
        found.extend(card_problems)
        if reading.process_activity is not None and not in_mig and reading.error is None:
            # A whole card is one device, under the card's own index.
            activity.extend(PlacedProcessActivity(a.pid, reading.index, a.sm_ratio, a.memory_ratio)
                            for a in reading.process_activity)
    if memo is not None:
        memo.cards = now
    return Snapshot(
        driver_version=driver_version,
        cuda_version=cuda_version,
        cards=tuple(cards),
        devices=tuple(devices),
        processes=tuple(processes),
        problems=tuple(found),
        process_activity=tuple(activity),
    )


def _place_card(r: CardReading, klass: str | None, in_mig: bool) -> _Placed:
    """The card's devices, the processes on them, and the problem lines placing them gave."""
    if r.error is not None:
        return [], [], [f"card {r.index}: {r.error}"]
    if not in_mig:
        device, processes = _place_whole_card(r, klass)
        return [device], processes, []
    return _place_mig_instances(r, klass)


def _card_from_reading(r: CardReading, klass: str | None, in_mig: bool, devices: list[Device]) -> Card:
    verdict = None if r.error is not None else grade(
        r.health, sum(instance_uncorrectable(d.ecc_errors) for d in devices), temperature_celsius=r.temperature_celsius)
    return Card(
        index=r.index,
        uuid=r.uuid,
        name=r.name,
        pci_bus_id=r.pci_bus_id,
        card_class=klass,
        mig_current=r.mig_current,
        mig_pending=r.mig_pending,
        mig_instances=len(r.instances) if in_mig else None,
        temperature_celsius=r.temperature_celsius,
        power_draw_watts=r.power_draw_watts,
        # The driver does not measure utilisation per MIG instance and reports
        # N/A on the card; never export a stale or zero value there.
        utilization_ratio=None if r.mig_current else r.utilization_ratio,
        error=r.error,
        lost=r.lost,
        health=r.health,
        aggregate_denied=r.aggregate_denied,
        serial=r.serial,
        verdict=verdict,
    )


def _place_whole_card(r: CardReading, klass: str | None) -> tuple[Device, list[Process]]:
    """A card not in MIG mode: one device, with every process on the card."""
    device = Device(
        index=r.index,
        card=r.index,
        mig_index=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        profile=None,
        uuid=r.uuid,
        name=r.name,
        device_class=klass,
        memory=r.memory,
        processes_known=r.processes_known,
        activity=r.activity,
        activity_unknown=r.activity_unknown,
    )
    return device, _merge(r.processes, device.index)


def _place_mig_instances(r: CardReading, klass: str | None) -> tuple[list[Device], list[Process], list[str]]:
    """A card in MIG mode: a device per instance, in MIG index order, each with the
    processes that carry its instance ids; a problem line per process no instance claims."""
    devices: list[Device] = []
    processes: list[Process] = []
    claimed: set[_InstanceIds] = set()
    instances, problems = _placeable_instances(r)
    # Without the MIG monitor capability the driver refuses the card's own readings and lists
    # no more than the instances this container may open: what runs elsewhere on the card is
    # hidden, so no device's process list can be taken as whole (never free, never unused).
    lists_whole = r.processes_known and not r.aggregate_denied
    if r.aggregate_denied:
        problems.append(f"card {r.index}: the driver refused the card's own memory (no MIG monitor capability): "
                        "MIG instances and processes this container cannot open are hidden, so its process "
                        "lists count as unknown (mig-exporter doctor: mig-monitor-missing)")
    by_ids = _processes_by_instance_ids(r.processes)
    for inst in instances:
        device = Device(
            index=mig_placement_index(r.index, inst.mig_index),
            card=r.index,
            mig_index=inst.mig_index,
            gpu_instance_id=inst.gpu_instance_id,
            compute_instance_id=inst.compute_instance_id,
            profile=inst.profile,
            uuid=inst.uuid,
            name=f"{r.name} MIG {inst.profile}" if r.name and inst.profile else r.name,
            device_class=mig_device_class(klass, inst.profile),
            memory=inst.memory,
            ecc_errors=inst.ecc_errors,
            processes_known=lists_whole and inst.gpu_instance_id is not None,
            activity=inst.activity,
            activity_unknown=inst.activity_unknown,
        )
        devices.append(device)
        if inst.gpu_instance_id is not None:
            ids = (inst.gpu_instance_id, inst.compute_instance_id)
            claimed.add(ids)
            processes.extend(_merge(by_ids.get(ids, ()), device.index))
    if not claimed.issuperset(by_ids):
        for p in r.processes:
            if (p.gpu_instance_id, p.compute_instance_id) not in claimed:
                problems.append(
                    f"card {r.index}: process {p.pid} carries GPU instance {p.gpu_instance_id} "
                    f"and compute instance {p.compute_instance_id}, which match no MIG device; not placed"
                )
    return devices, processes, problems


_InstanceIds = tuple[int | None, int | None]


def _processes_by_instance_ids(readings: Sequence[ProcessReading]) -> dict[_InstanceIds, list[ProcessReading]]:
    """The card's processes by the (GPU instance, compute instance) they carry, in listed
    order: one pass over the card's processes, not one per instance."""
    by_ids: dict[_InstanceIds, list[ProcessReading]] = {}
    for p in readings:
        ids = (p.gpu_instance_id, p.compute_instance_id)
        found = by_ids.get(ids)
        if found is None:
            by_ids[ids] = [p]
        else:
            found.append(p)
    return by_ids


def _placeable_instances(r: CardReading) -> tuple[list[MigInstance], list[str]]:
    """The card's instances in MIG index order, less those whose index is out of range or
    repeated, and a problem line for each of those."""
    kept: list[MigInstance] = []
    problems: list[str] = []
    seen_mig_indexes: set[int] = set()
    for inst in sorted(r.instances, key=lambda i: i.mig_index):
        if not 0 <= inst.mig_index < MIG_INDEX_PER_CARD:
            # Its placement index would be another card's instance (or a whole card's).
            problems.append(f"card {r.index}: MIG device index {inst.mig_index} is out of range "
                            f"(0 to {MIG_INDEX_PER_CARD - 1}); skipped")
            continue
        if inst.mig_index in seen_mig_indexes:
            problems.append(f"card {r.index}: MIG device index {inst.mig_index} listed twice; kept the first")
            continue
        seen_mig_indexes.add(inst.mig_index)
        kept.append(inst)
    return kept, problems


def _merge(readings: Sequence[ProcessReading], device_index: int) -> list[Process]:
    """One process per pid on a device, in pid order, so no series is repeated.

    A pid listed more than once (NVML lists a process in each of its compute,
    graphics and MPS lists, each entry with the process's whole usage on the
    device) is one process: its types joined (C+G, M+C) and the larger usage.
    """
    new = tuple.__new__  # a named tuple's own constructor is a Python function around it
    placed = [new(Process, (p[0], p[1], p[2], p[3], device_index)) for p in readings]
    if len({p[0] for p in placed}) == len(placed):  # each pid once, as nvidia-smi lists them
        placed.sort(key=_by_pid)
        return placed
    by_pid: dict[int, Process] = {}
    for p in readings:
        seen = by_pid.get(p.pid)
        if seen is None:
            by_pid[p.pid] = new(Process, (p[0], p[1], p[2], p[3], device_index))
            continue
        known = [u for u in (seen.used_bytes, p.used_bytes) if u is not None]
        used = max(known) if known else None
        types = sorted((set(seen.type.split("+")) | set(p.type.split("+"))) - {""}, key=_type_order)
        by_pid[p.pid] = Process(p.pid, "+".join(types), seen.name or p.name, used, device_index)
    # By pid: the drivers' list orders differ between paths (NVML lists compute
    # before graphics), the snapshot must not.
    return sorted(by_pid.values(), key=_by_pid)


_by_pid = attrgetter("pid")


def _type_order(letter: str) -> tuple[int, str]:
    # nvidia-smi writes combined types as C+G and M+C.
    return ({"M": 0, "C": 1, "G": 2}.get(letter, 3), letter)


def uuid_device_indexes(snapshot: Snapshot, uuid: str) -> tuple[int, ...]:
    """The placement indexes a ``GPU-…`` or ``MIG-…`` UUID stands for: the
    device with that UUID, else all devices of the card with it (a whole card
    in MIG mode stands for all of its instances); () when none has it."""
    found = tuple(d.index for d in snapshot.devices if d.uuid == uuid)
    if found:
        return found
    card = next((c for c in snapshot.cards if c.uuid == uuid), None)
    return () if card is None else card_device_indexes(snapshot, card.index)


def card_device_indexes(snapshot: Snapshot, card: int) -> tuple[int, ...]:
    """The placement indexes of card ``card``'s devices: the card itself, or
    all of its MIG instances when it is in MIG mode."""
    return tuple(d.index for d in snapshot.devices if d.card == card)
