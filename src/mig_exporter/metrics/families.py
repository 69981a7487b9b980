"""Map a snapshot to metric families. Nothing here reads a device.

One family per metric name, built fresh for every scrape, so a process that
has exited or an instance that was destroyed simply stops being exposed. An
unknown value is left out, never written as 0. Sample output (demo)::

    mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10
    mig_exporter_process_memory_used_bytes{card="1",index="1",mig_profile="",pid="50102"} 2.147483648e+10
    mig_exporter_card_mig_instances{card="0"} 3.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.model.readings import (
    EngineReading,
    OwnerReading,
    PodReading,
    ProcessOwner,
    ProcessPod,
    SlurmJobMapReading,
)
from mig_exporter.model.snapshot import Device, Process, Snapshot

DEVICE_LABELS = ["index", "card", "mig_profile"]
PROCESS_LABELS = [*DEVICE_LABELS, "pid"]
POD_LABELS = ["namespace", "pod", "container"]
NO_POD = ProcessPod(0, "", "", "", "")
SLURM_RESOURCE = "slurm"  # the resource label of a device a Slurm job-map file allocates
# Never "job": Prometheus sets that label on every series it scrapes.
OWNER_LABELS = ["slurm_job", "slurm_step", "systemd_unit", "user"]
NO_OWNER = ProcessOwner(0, None, None, None, None)
K = TypeVar("K")  # what memory is summed by: a pod's container, a Slurm job, a systemd unit


def _device_labels(d: Device) -> list[str]:
    return [str(d.index), str(d.card), d.profile or ""]


def snapshot_families(snapshot: Snapshot, pods: PodReading | None = None,
                      owners: OwnerReading | None = None) -> Iterator[Metric]:
    """Device, process and card families for one snapshot; ``pods`` gives
    the processes' pod labels (empty without it: /probe, not on Kubernetes),
    ``owners`` their Slurm job, systemd unit and user (empty without it: /probe)."""
    yield from _device_families(snapshot)
    yield from _process_families(snapshot, pods, owners)
    yield from _card_families(snapshot)


def _device_families(snapshot: Snapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mig_exporter_device_info",
        "A device a workload runs on: a whole card, or one MIG instance of a card in MIG mode. "
        "Compute instances of one gpu_instance share its memory. device is the name people read: "
        "card/migN for a MIG instance (1/mig2 is index 1102), the card's index for a whole card.",
        labels=["index", "card", "mig_profile", "uuid", "gpu_instance", "compute_instance", "class", "name", "device"],
    )
    memory = {
        field: GaugeMetricFamily(
            f"mig_exporter_device_memory_{field}_bytes",
            f"Device framebuffer memory {text}, in bytes (nvidia-smi fb_memory_usage/{field}).",
            labels=DEVICE_LABELS,
        )
        for field, text in (
            ("total", "in total"),
            ("used", "in use"),
            ("free", "free"),
            ("reserved", "reserved by the driver and firmware"),
        )
    }
    count = GaugeMetricFamily(
        "mig_exporter_device_processes",
        "Processes holding memory on the device, as the driver lists them.",
        labels=DEVICE_LABELS,
    )
    by_device: dict[int, int] = {d.index: 0 for d in snapshot.devices}
    for p in snapshot.processes:
        by_device[p.device_index] = by_device.get(p.device_index, 0) + 1
    for d in snapshot.devices:
        labels = _device_labels(d)
        info.add_metric(
            [
                *labels,
                d.uuid or "",
                _int_label(d.gpu_instance_id),
                _int_label(d.compute_instance_id),
                d.device_class or "",
                d.name or "",
                d.display_name,
            ],
            1,
        )
        values = {
            "total": d.memory.total_bytes,
            "used": d.memory.used_bytes,
            "free": d.memory.free_bytes,
            "reserved": d.memory.reserved_bytes,
        }
        for field, value in values.items():
            if value is not None:
                memory[field].add_metric(labels, value)
        count.add_metric(labels, by_device[d.index])
    yield info
    yield from memory.values()
    yield count


def _process_families(snapshot: Snapshot, pods: PodReading | None, owners: OwnerReading | None) -> Iterator[Metric]:
    used = GaugeMetricFamily(
        "mig_exporter_process_memory_used_bytes",
        "Device memory held by the process on the device, in bytes (left out where the driver does not say).",
        labels=PROCESS_LABELS,
    )
    info = GaugeMetricFamily(
        "mig_exporter_process_info",
        "A process on a device, with its name and type (C compute, G graphics, C+G both, M+C MPS), and its "
        "Kubernetes namespace, pod, container and container id, its Slurm job and step, its systemd unit and its "
        "user (each empty where unknown or not in one).",
        labels=[*PROCESS_LABELS, "process_name", "process_type", *POD_LABELS, "container_id", *OWNER_LABELS],
    )
    device_labels = {d.index: _device_labels(d) for d in snapshot.devices}
    in_pods = pods.processes if pods is not None else {}
    owned = owners.processes if owners is not None else {}
    for p in snapshot.processes:
        labels = [*device_labels[p.device_index], str(p.pid)]
        pod = in_pods.get(p.pid, NO_POD)
        owner = owned.get(p.pid, NO_OWNER)
        info.add_metric([*labels, p.name, p.type, pod.namespace, pod.pod, pod.container, pod.container_id,
                         owner.slurm_job or "", owner.slurm_step or "", owner.systemd_unit or "", owner.user or ""], 1)
        if p.used_bytes is not None:
            used.add_metric(labels, p.used_bytes)
    yield used
    yield info


def _card_families(snapshot: Snapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mig_exporter_card_info",
        "A physical card, with its identity and the driver it runs under.",
        labels=["card", "uuid", "name", "pci_bus_id", "driver_version", "cuda_version"],
    )
    ok = GaugeMetricFamily(
        "mig_exporter_card_read_success",
        "1 when the card's section of the read could be read, 0 when it failed (see the log).",
        labels=["card"],
    )
    mig_mode = GaugeMetricFamily(
        "mig_exporter_card_mig_mode",
        "MIG mode, 1 enabled and 0 disabled; state=pending differs from current until the card is reset. "
        "Absent on cards without MIG support.",
        labels=["card", "state"],
    )
    instances = GaugeMetricFamily(
        "mig_exporter_card_mig_instances",
        "MIG instances carved on a card in MIG mode; 0 means nothing is carved and nothing can run on it.",
        labels=["card"],
    )
    temperature = GaugeMetricFamily(
        "mig_exporter_card_temperature_celsius", "GPU core temperature, in degrees Celsius.", labels=["card"]
    )
    power = GaugeMetricFamily("mig_exporter_card_power_draw_watts", "Board power draw, in watts.", labels=["card"])
    utilization = GaugeMetricFamily(
        "mig_exporter_card_utilization_ratio",
        "Fraction of time a kernel ran on the card (0-1); left out on cards in MIG mode, where the driver "
        "does not measure it.",
        labels=["card"],
    )
    for c in snapshot.cards:
        card = str(c.index)
        info.add_metric(
            [card, c.uuid or "", c.name or "", c.pci_bus_id or "", snapshot.driver_version or "",
             snapshot.cuda_version or ""],
            1,
        )
        ok.add_metric([card], 0 if c.error else 1)
        for state, value in (("current", c.mig_current), ("pending", c.mig_pending)):
            if value is not None:
                mig_mode.add_metric([card, state], 1 if value else 0)
        if c.mig_instances is not None:
            instances.add_metric([card], c.mig_instances)
        for family, reading in (
            (temperature, c.temperature_celsius),
            (power, c.power_draw_watts),
            (utilization, c.utilization_ratio),
        ):
            if reading is not None:
                family.add_metric([card], reading)
    yield from (info, ok, mig_mode, instances, temperature, power, utilization)


def engine_families(reading: EngineReading) -> Iterator[Metric]:
    """Engine families for one /proc read (docs/engines.md). Sample output (demo)::

        mig_exporter_host_pid_namespace 1.0
        mig_exporter_engine_processes{engine="llama.cpp"} 3.0
        mig_exporter_engine_memory_used_bytes{engine="llama.cpp",pid="52040"} 0.0
        mig_exporter_engine_info{comm="llama-server",engine="llama.cpp",index="",pid="52040"} 1.0
    """
    if reading.host_pid_namespace is not None:
        yield GaugeMetricFamily(
            "mig_exporter_host_pid_namespace",
            "1 when the exporter and its /proc root are in the host's PID namespace, whose PIDs the driver lists; "
            "0 otherwise, and then engine metrics are left out.",
            value=int(reading.host_pid_namespace),
        )
    if reading.processes is None:
        return
    count = GaugeMetricFamily(
        "mig_exporter_engine_processes",
        "Inference-engine processes running (top-most matches), with an explicit 0 for every engine switched on.",
        labels=["engine"],
    )
    counts = dict.fromkeys(reading.engines, 0)
    for e in reading.processes:
        counts[e.engine] = counts.get(e.engine, 0) + 1
    for engine, n in counts.items():
        count.add_metric([engine], n)
    yield count
    if not reading.placed:
        return  # the GPU read failed: where the engines are is unknown, not "nowhere"
    used = GaugeMetricFamily(
        "mig_exporter_engine_memory_used_bytes",
        "Device memory the engine process, its threads and its descendants hold on all devices, in bytes; "
        "0 means it is on no GPU's process list (it runs on the CPU).",
        labels=["engine", "pid"],
    )
    info = GaugeMetricFamily(
        "mig_exporter_engine_info",
        "An engine process and a device it holds memory on; index is empty when it is on none.",
        labels=["engine", "pid", "comm", "index"],
    )
    for e in reading.processes:
        pid = str(e.pid)
        if e.used_bytes is not None:
            used.add_metric([e.engine, pid], e.used_bytes)
        for index in e.device_indexes or (None,):
            info.add_metric([e.engine, pid, e.comm, _int_label(index)], 1)
    yield used
    yield info


def pod_families(reading: PodReading, snapshot: Snapshot) -> Iterator[Metric]:
    """Kubernetes families for one read (docs/kubernetes.md). Sample output::

        mig_exporter_pod_resources_read_success 1.0
        mig_exporter_pod_memory_used_bytes{container="server",namespace="llm",pod="llama-0"} 1.207959552e+10
    """
    if reading.pod_resources_success is not None:
        yield GaugeMetricFamily(
            "mig_exporter_pod_resources_read_success",
            "1 when the kubelet's pod-resources List answered in this read, 0 when it failed (see the log); "
            "left out where there is no socket (not on Kubernetes).",
            value=int(reading.pod_resources_success),
        )
    def container(p: Process) -> tuple[str, str, str] | None:
        pod = reading.processes.get(p.pid)
        return None if pod is None or not pod.pod else (pod.namespace, pod.pod, pod.container)

    sums = _memory_by(snapshot, container)
    used = GaugeMetricFamily(
        "mig_exporter_pod_memory_used_bytes",
        "Device memory the processes of a pod's container hold, summed over all devices, in bytes "
        "(left out where the driver does not say for one of them).",
        labels=POD_LABELS,
    )
    for key, value in sorted(sums.items()):
        used.add_metric(list(key), value)
    yield used


def _memory_by(snapshot: Snapshot, key_of: Callable[[Process], K | None]) -> dict[K, int]:
    """Process memory summed per key (``None``: not counted). A key one of
    whose processes the driver gives no figure for is left out: its sum would
    be too low."""
    sums: dict[K, int | None] = {}
    for p in snapshot.processes:
        key = key_of(p)
        if key is None or (key in sums and sums[key] is None):
            continue
        sums[key] = None if p.used_bytes is None else (sums.get(key) or 0) + p.used_bytes
    return {key: value for key, value in sums.items() if value is not None}


def allocation_families(pods: PodReading | None, job_map: SlurmJobMapReading | None) -> Iterator[Metric]:
    """Which device is allocated to what, from the kubelet and from a Slurm
    job-map directory (docs/metrics.md). Sample output::

        mig_exporter_slurm_job_map_read_success 1.0
        mig_exporter_device_allocation_info{container="server",index="1000",namespace="llm",pod="llama-0",resource="nvidia.com/mig-3g.40gb",slurm_job=""} 1.0
        mig_exporter_device_allocation_info{container="",index="1001",namespace="",pod="",resource="slurm",slurm_job="4242"} 1.0
    """  # noqa: E501 - sample exposition lines: they cannot be wrapped
    if job_map is not None:
        yield GaugeMetricFamily(
            "mig_exporter_slurm_job_map_read_success",
            "1 when the Slurm job-map directory was read (bad files in it are read problems), 0 when the "
            "directory could not be read; left out without --slurm.job-map-dir.",
            value=int(job_map.read_success),
        )
    kubelet = pods.allocations if pods is not None else None
    if kubelet is None and job_map is None:
        return
    allocated = GaugeMetricFamily(
        "mig_exporter_device_allocation_info",
        "A device allocated to a pod's container by the kubelet, through the extended resource named, or to a "
        "Slurm job by a job-map file (resource slurm).",
        labels=["index", *POD_LABELS, "resource", "slurm_job"],
    )
    for a in kubelet or ():
        allocated.add_metric([str(a.device_index), a.namespace, a.pod, a.container, a.resource, ""], 1)
    for s in job_map.allocations if job_map is not None else ():
        allocated.add_metric([str(s.device_index), "", "", "", SLURM_RESOURCE, s.job], 1)
    yield allocated


def owner_families(reading: OwnerReading, snapshot: Snapshot) -> Iterator[Metric]:
    """Slurm job and systemd unit sums for one read (docs/hpc.md), for those
    with processes on a GPU's list. Sample output::

        mig_exporter_slurm_job_memory_used_bytes{slurm_job="4242"} 2.147483648e+10
        mig_exporter_systemd_unit_memory_used_bytes{systemd_unit="ollama.service"} 1.207959552e+10
    """
    owners = reading.processes
    jobs = _memory_by(snapshot, lambda p: owners[p.pid].slurm_job if p.pid in owners else None)
    units = _memory_by(snapshot, lambda p: owners[p.pid].systemd_unit if p.pid in owners else None)
    for name, label, what, sums in (
        ("mig_exporter_slurm_job_memory_used_bytes", "slurm_job", "a Slurm job's processes (all its steps)", jobs),
        ("mig_exporter_systemd_unit_memory_used_bytes", "systemd_unit", "a systemd unit's processes", units),
    ):
        family = GaugeMetricFamily(
            name,
            f"Device memory {what} hold on this node, summed over all devices, in bytes "
            "(left out where the driver does not say for one of them).",
            labels=[label],
        )
        for key, value in sorted(sums.items()):
            family.add_metric([key], value)
        yield family


def read_families(
    source: str,
    *,
    success: bool,
    duration_s: float,
    errors_total: int,
    problems: int,
    version: str,
) -> Iterator[Metric]:
    """The exporter's own families about a read."""
    labels = ["source"]
    ok = GaugeMetricFamily(
        "mig_exporter_read_success", "1 when the last read succeeded, 0 when it failed.", labels=labels
    )
    ok.add_metric([source], 1 if success else 0)
    duration = GaugeMetricFamily(
        "mig_exporter_read_duration_seconds", "How long the read for this scrape took, in seconds.", labels=labels
    )
    duration.add_metric([source], duration_s)
    errors = CounterMetricFamily(
        "mig_exporter_read_errors", "Reads that failed since the exporter started.", labels=labels
    )
    errors.add_metric([source], errors_total)
    found = GaugeMetricFamily(
        "mig_exporter_read_problems",
        "Problems in the last read that did not fail it (an unreadable card or value, a failed nvidia-smi -L, "
        "a process on no instance, an unreadable /proc or one outside the host PID namespace, a failed kubelet call, "
        "an unreadable Slurm job-map directory or file); each is logged.",
        labels=labels,
    )
    found.add_metric([source], problems)
    build = GaugeMetricFamily("mig_exporter_build_info", "The exporter's version.", labels=["version"])
    build.add_metric([version], 1)
    yield from (ok, duration, errors, found, build)


def _int_label(value: int | None) -> str:
    return "" if value is None else str(value)
