"""What the reads beside the GPU snapshot found: engines in /proc, pods from the
kubelet, owners from the cgroups, the Slurm job map. Frozen dataclasses, like
the snapshot; ``None`` means unknown."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineProcess:
    """An inference-engine process: the top-most process an engine rule
    matched, with every descendant (matched or not) folded into it.

    ``used_bytes`` is what its pid, its threads' ids and its descendants'
    pids and thread ids hold, summed over all devices: 0 when none of them is
    on any GPU's process list, ``None`` when unknown (the driver said N/A for
    one of them). ``device_indexes`` are the placement indexes they are on.
    """

    engine: str
    pid: int
    comm: str
    used_bytes: int | None
    device_indexes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineReading:
    """What the /proc read beside the GPU snapshot found.

    ``engines`` are the engines switched on (each is counted, with an explicit
    0). ``host_pid_namespace`` is ``None`` when /proc could not be read.
    ``processes`` is ``None`` when engines cannot be told apart from processes
    on the CPU: /proc unreadable, or not the host's PID namespace (the driver
    lists host PIDs). ``placed`` is False when the GPU read failed, so where
    the engines are is unknown. ``problems`` are lines for the log.
    """

    engines: tuple[str, ...]
    host_pid_namespace: bool | None
    processes: tuple[EngineProcess, ...] | None
    placed: bool
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ProcessPod:
    """The container and pod of a process on a GPU's list. Each field is ""
    when unknown: ``container_id`` outside a container, the names when the
    kubelet's log directories do not name the container or pod."""

    pid: int
    container_id: str
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class Allocation:
    """A device (by placement index) the kubelet allocated to a container,
    through ``resource`` (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``)."""

    device_index: int
    namespace: str
    pod: str
    container: str
    resource: str


@dataclass(frozen=True, slots=True)
class PodReading:
    """What the Kubernetes read beside the GPU snapshot found (docs/kubernetes.md).

    ``processes`` holds the processes on the GPU lists that run in a
    container, by pid. ``allocations`` is ``None`` when the kubelet was not
    asked or did not answer; ``pod_resources_success`` is ``None`` when it
    was not asked (switched off, or no socket outside a pod: not on
    Kubernetes), else whether it answered: False too for no socket in a pod,
    where the allocations exist and cannot be read. ``problems`` count as read
    problems; ``notes`` are conditions logged once (no socket outside a pod).
    """

    processes: dict[int, ProcessPod]
    allocations: tuple[Allocation, ...] | None
    pod_resources_success: bool | None
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SlurmAllocation:
    """A device (by placement index) a Slurm job-map file gives to job ``job``."""

    device_index: int
    job: str


@dataclass(frozen=True, slots=True)
class SlurmJobMapReading:
    """What the Slurm job-map directory (dcgm-exporter's format) gave.

    ``read_success`` is False when the directory itself could not be read;
    ``allocations`` is then empty. ``problems`` (a bad file, a name on no
    device) count as read problems; the rest of the directory is kept.
    ``complete`` is False when allocations may be missing though the directory
    was read: a file naming a device could not be read, the scrape's budget ran
    out before the last file, or the directory holds more than the files read.
    """

    allocations: tuple[SlurmAllocation, ...]
    read_success: bool
    problems: tuple[str, ...] = ()
    complete: bool = True


@dataclass(frozen=True, slots=True)
class ProcessOwner:
    """Who a process on a GPU's list belongs to outside Kubernetes (docs/hpc.md).
    Each field is ``None`` when unknown or not applicable: ``slurm_job`` and
    ``slurm_step`` outside a Slurm job, ``systemd_unit`` in a container, a pod
    or a Slurm job. ``user`` is the name the host's passwd gives the process's
    real uid, else the uid itself."""

    pid: int
    slurm_job: str | None
    slurm_step: str | None
    systemd_unit: str | None
    user: str | None


@dataclass(frozen=True, slots=True)
class OwnerReading:
    """What the cgroups and ``/proc/PID/status`` of the processes on the GPU
    lists say, by pid (none when the /proc root is not the host's PID
    namespace). ``problems`` count as read problems."""

    processes: dict[int, ProcessOwner]
    problems: tuple[str, ...] = ()
