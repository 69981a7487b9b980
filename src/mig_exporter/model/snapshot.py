"""The snapshot: one read of the driver as frozen dataclasses, and named tuples for
what a read holds many of (the per-process rows, hundreds a read; MIG instances and
memory blocks): a tuple is built several times faster than a frozen
dataclass, and read by the same attribute names.

Both read paths (nvidia-smi and NVML) end here, and the collector starts here.
Sizes are ints in bytes, temperatures in degrees Celsius, power in watts and
utilisation as a ratio (0.0-1.0). ``None`` always means "the driver did not
say" (N/A, Not Supported, a missing element); it is never read as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from mig_exporter.model.health import NO_HEALTH, CardHealth, EccCount, Verdict

MIB = 1024 * 1024


class Memory(NamedTuple):
    """A framebuffer's memory, as nvidia-smi's ``fb_memory_usage`` reports it."""

    total_bytes: int | None = None
    used_bytes: int | None = None
    free_bytes: int | None = None
    reserved_bytes: int | None = None


class Activity(NamedTuple):
    """What a device's engines did over a window, as ratios (0.0-1.0): NVML's GPU Performance
    Monitoring (GPM, Hopper and later), between two samples ``window_seconds`` apart. Each value
    is ``None`` where its metric was not measured (its own return code not success, NaN, Inf);
    DRAM bandwidth is a GPU instance's, shared by its compute instances as its memory is."""

    window_seconds: float
    graphics_ratio: float | None = None
    sm_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_ratio: float | None = None
    dram_bandwidth_ratio: float | None = None


# Why a device has no Activity: each case is left out, never a 0 (docs/metrics.md, doctor).
ACTIVITY_NO_GPM = "no_gpm"  # the card has no GPM (before Hopper: A100, A30), or NVML says it has none
ACTIVITY_FIRST_SAMPLE = "first_sample"  # one sample so far: a window needs two
ACTIVITY_NO_COMPUTE_INSTANCE = "no_compute_instance"  # a GPU instance with no compute instance has no data
ACTIVITY_NOT_MEASURED = "not_measured"  # every metric failed, or was NaN or Inf
ACTIVITY_READ_FAILED = "read_failed"  # a GPM call failed (its error in the read's problems)
ACTIVITY_NOT_READ = "not_read"  # this read path does not read it (nvidia-smi's XML)


class ProcessActivity(NamedTuple):
    """A process's share of a whole card's engines over the window ending at the read (NVML) or in
    pmon's one sample (nvidia-smi), as ratios (0.0-1.0); ``None`` where it is not known (not yet a
    driver period of samples, a clock step, a value the driver gave out of range):
    ``nvmlDeviceGetProcessUtilization`` on the NVML path, ``nvidia-smi pmon -s u`` on the
    nvidia-smi path. A listed process with no sample was idle (the driver samples only processes
    with activity). None on a card in MIG mode: the driver does not give it there."""

    pid: int
    sm_ratio: float | None
    memory_ratio: float | None


class MigInstance(NamedTuple):
    """One MIG device of a card, as read (before placement).

    ``profile`` and ``uuid`` come from ``nvidia-smi -L`` on the nvidia-smi path
    (the XML does not carry them) and are ``None`` when that listing failed.
    """

    mig_index: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
    memory: Memory
    profile: str | None = None
    uuid: str | None = None
    # The instance's own ECC counts, where the driver gives them per instance.
    ecc_errors: tuple[EccCount, ...] = ()
    # Its GPU instance's activity (GPM), or why there is none (an ACTIVITY_* reason).
    activity: Activity | None = None
    activity_unknown: str | None = ACTIVITY_NOT_READ


# A process the driver lists is kept under the id it gives, whatever its size: a vGPU host
# lists its VMs by ids past Linux's range (tests/fixtures/nvidia-smi-real/: a Tesla M10 host,
# driver 390.94, VMs 42818686 to 44717029), and they hold memory as any process does. Only
# what no process id can be is dropped, on either read path: 0, and NO_PID (2^32-1) and
# past it. The driver's process id is an unsigned int whose all-ones value is NVML's "none"
# (as for a GPU instance id), and the R535-era NVML process struct mismatch read through
# pynvml gave exactly 0 and 2^32-1 between the real entries (XuehaiPan/nvitop#75).
NO_PID = 0xFFFFFFFF

# Linux never hands out a pid of 0 or at or above PID_MAX_LIMIT (2^22, the most
# kernel.pid_max may be): an id outside is no process of this host's /proc (a vGPU VM's),
# and is never looked up there.
PID_MAX_LIMIT = 4_194_304


def is_process_id(pid: object) -> bool:
    """Whether ``pid`` can be the id the driver gives a process: a Linux pid, or a VM's id
    on a vGPU host."""
    return type(pid) is int and 0 < pid < NO_PID


def not_a_process_id(pid: int) -> str:
    """Why ``pid``, which ``is_process_id`` refuses, is no process's id (for a problem line)."""
    if pid < 0:
        return "negative"
    if pid == 0:
        return "no process has id 0"
    if pid == NO_PID:
        return "2^32-1, NVML's 'none' and the garbage of a process struct mismatch"
    return "larger than a driver's 32-bit process id"


def is_linux_pid(pid: int) -> bool:
    """Whether ``pid`` can be a process of a Linux /proc (0 < pid < PID_MAX_LIMIT)."""
    return 0 < pid < PID_MAX_LIMIT


class ProcessReading(NamedTuple):
    """One process as the driver lists it on a card, before placement.

    ``gpu_instance_id``/``compute_instance_id`` are ``None`` outside MIG.
    """

    pid: int
    type: str
    name: str
    used_bytes: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class CardReading:
    """One physical card as read, with its MIG instances and processes.

    ``error`` is set when the card's section could not be read; the other
    fields then hold whatever was read before the failure.
    """

    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    serial: str | None = None
    mig_current: bool | None = None
    mig_pending: bool | None = None
    temperature_celsius: float | None = None
    power_draw_watts: float | None = None
    utilization_ratio: float | None = None
    memory: Memory = field(default_factory=Memory)
    instances: tuple[MigInstance, ...] = ()
    processes: tuple[ProcessReading, ...] = ()
    error: str | None = None
    # True when the read failed because the card is gone (NVML's GPU_IS_LOST): it fell off the
    # bus, and no read sees it again before a reset or a reboot.
    lost: bool = False
    health: CardHealth = NO_HEALTH
    # False when the driver did not list the card's processes (N/A, no list it can give):
    # its devices are then neither free nor in use, but unknown.
    processes_known: bool = True
    # True when the driver refused the card's own (aggregate) readings: nvidia-smi writes
    # "Insufficient Permissions" in its fb_memory_usage, NVML answers NO_PERMISSION to its
    # memory. On a card in MIG mode that is a container without the MIG monitor capability.
    aggregate_denied: bool = False
    # A whole card's activity (GPM), or why there is none (an ACTIVITY_* reason); a card in MIG
    # mode carries its instances' on them.
    activity: Activity | None = None
    activity_unknown: str | None = ACTIVITY_NOT_READ
    # Each listed process's activity on a whole card; None where it was not measured (a card in
    # MIG mode, a failed read, a path that does not read it).
    process_activity: tuple[ProcessActivity, ...] | None = None


@dataclass(frozen=True, slots=True)
class Card:
    """A physical card: identity, mode and the card-wide readings.

    ``mig_instances`` is the number of MIG devices when MIG is enabled, and
    ``None`` on a card not in MIG mode. ``utilization_ratio`` is ``None`` on a
    card in MIG mode: the driver does not measure it there, and zero would lie.
    """

    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None
    card_class: str | None
    mig_current: bool | None
    mig_pending: bool | None
    mig_instances: int | None
    temperature_celsius: float | None
    power_draw_watts: float | None
    utilization_ratio: float | None
    error: str | None = None
    lost: bool = False  # CardReading.lost
    health: CardHealth = NO_HEALTH
    # The driver refused the card's aggregate readings (``CardReading.aggregate_denied``):
    # in MIG mode, the MIG instances this container cannot open, and the processes, are hidden.
    aggregate_denied: bool = False
    serial: str | None = None
    # The card's grade (model/health.py ``grade``), made once when the snapshot is built and
    # read by the families, the landing page and doctor; ``None`` where the card was not read.
    verdict: Verdict | None = None


@dataclass(frozen=True, slots=True)
class Device:
    """What a workload runs on: a whole card, or one MIG instance of a card.

    ``index`` is the placement index: the card's nvidia-smi index for a whole
    card, ``1000 + 100 * card + mig_index`` for a MIG instance. Compute
    instances of one GPU instance share its memory, so two devices with the
    same ``card`` and ``gpu_instance_id`` report the same framebuffer.
    """

    index: int
    card: int
    mig_index: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None
    uuid: str | None
    name: str | None
    device_class: str | None
    memory: Memory
    # A MIG instance's own ECC counts (the driver gives no other health per instance).
    ecc_errors: tuple[EccCount, ...] = ()
    # False when which processes run here is unknown: the card's list was N/A, or a MIG
    # instance's GPU instance id was (no process can be placed on it).
    processes_known: bool = True
    # What its engines did over the last window (GPM), or why that is unknown (ACTIVITY_*).
    activity: Activity | None = None
    activity_unknown: str | None = ACTIVITY_NOT_READ

    @property
    def is_mig(self) -> bool:
        return self.mig_index is not None

    @property
    def display_name(self) -> str:
        """What people read: ``1/mig2`` for MIG instance 2 of card 1 (placement
        index 1102), ``1`` for whole card 1."""
        return f"{self.card}/mig{self.mig_index}" if self.mig_index is not None else str(self.card)


class Process(NamedTuple):
    """A process holding memory on one device (by placement index)."""

    pid: int
    type: str
    name: str
    used_bytes: int | None
    device_index: int


class PlacedProcessActivity(NamedTuple):
    """A process's activity on a whole card (``ProcessActivity``), by placement index."""

    pid: int
    device_index: int
    sm_ratio: float | None
    memory_ratio: float | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read: cards, the devices they are reported as, and the processes.

    ``problems`` lists what went wrong without failing the read (a card that
    could not be read, a failed ``-L``, a process matching no instance), each
    as one line for the log.
    """

    driver_version: str | None
    cuda_version: str | None
    cards: tuple[Card, ...]
    devices: tuple[Device, ...]
    processes: tuple[Process, ...]
    problems: tuple[str, ...] = ()
    # The processes' activity on whole cards where it was measured (one row per listed process).
    process_activity: tuple[PlacedProcessActivity, ...] = ()

    def device(self, index: int) -> Device | None:
        return next((d for d in self.devices if d.index == index), None)

    def processes_on(self, index: int) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.device_index == index)


