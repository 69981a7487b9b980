"""Map a snapshot to metric families. Nothing here reads a device.

One family per metric name, built fresh for every scrape, so a process that
has exited or an instance that was destroyed simply stops being exposed. An
unknown value is left out, never written as 0. Sample output (demo)::

    mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10
    mig_exporter_process_memory_used_bytes{card="1",index="1",mig_profile="",pid="50102"} 2.147483648e+10
    mig_exporter_card_mig_instances{card="0"} 3.0

The activity families (GPM per GPU instance and whole card, per process on whole cards) are
written only where something was measured: a read path or card that measures none has no
family at all, and ``mig_exporter_device_activity_unknown`` says why of each device::

    mig_exporter_device_sm_activity_ratio{card="0",index="1000",mig_profile="3g.40gb"} 0.37
    mig_exporter_device_activity_unknown{card="1",index="1",mig_profile="",reason="no_gpm"} 1.0
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import compress
from typing import TypeVar, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.metrics.exposition import Column, GaugeColumns
from mig_exporter.metrics.health_families import health_families
from mig_exporter.metrics.process_series import ALL_PROCESSES, OTHER_PID, ProcessSeries
from mig_exporter.model.capacity import STATES, HostView, device_states, processes_per_device
from mig_exporter.model.readings import (
    EngineReading,
    OwnerReading,
    PodReading,
    SlurmJobMapReading,
)
from mig_exporter.model.snapshot import (
    ACTIVITY_NOT_READ,
    Activity,
    Device,
    PlacedProcessActivity,
    Process,
    Snapshot,
)

DEVICE_LABELS = ["index", "card", "mig_profile"]
PROCESS_LABELS = [*DEVICE_LABELS, "pid"]
POD_LABELS = ["namespace", "pod", "container"]
SLURM_RESOURCE = "slurm"  # the resource label of a device a Slurm job-map file allocates
# Never "job": Prometheus sets that label on every series it scrapes.
OWNER_LABELS = ["slurm_job", "slurm_step", "systemd_unit", "user"]
K = TypeVar("K")  # what memory is summed by: a pod's container, a Slurm job, a systemd unit


def _device_labels(d: Device) -> tuple[str, str, str]:
    return str(d.index), str(d.card), d.profile or ""


def snapshot_families(snapshot: Snapshot, pods: PodReading | None = None,
                      owners: OwnerReading | None = None,
                      process_series: ProcessSeries = ALL_PROCESSES) -> Iterator[Metric]:
    """Device, process and card families for one snapshot; ``pods`` gives
    the processes' pod labels (empty without it: /probe, not on Kubernetes),
    ``owners`` their Slurm job, systemd unit and user (empty without it: /probe);
    ``process_series`` which processes get series of their own (--collector.processes)."""
    yield from _device_families(snapshot)
    yield from _activity_families(snapshot)
    yield from _process_families(snapshot, pods, owners, process_series)
    yield from _card_families(snapshot)
    yield from health_families(snapshot)


def _device_families(snapshot: Snapshot) -> Iterator[Metric]:
    devices = snapshot.devices
    n = len(devices)
    labels = [_device_labels(d) for d in devices]
    index, card, profile = [d[0] for d in labels], [d[1] for d in labels], [d[2] for d in labels]
    yield GaugeColumns(
        "mig_exporter_device_info",
        "A device a workload runs on: a whole card, or one MIG instance of a card in MIG mode. "
        "Compute instances of one gpu_instance share its memory. device is the name people read: "
        "card/migN for a MIG instance (1/mig2 is index 1102), the card's index for a whole card.",
        labels=["index", "card", "mig_profile", "uuid", "gpu_instance", "compute_instance", "class", "name", "device"],
        columns=[index, card, profile, [d.uuid or "" for d in devices],
                 [_int_label(d.gpu_instance_id) for d in devices], [_int_label(d.compute_instance_id) for d in devices],
                 [d.device_class or "" for d in devices], [d.name or "" for d in devices],
                 [d.display_name for d in devices]],
        values=1,
        count=n,
    )
    for field, text in (
        ("total", "in total"),
        ("used", "in use"),
        ("free", "free"),
        ("reserved", "reserved by the driver and firmware"),
    ):
        values = [getattr(d.memory, f"{field}_bytes") for d in devices]
        yield _known(
            f"mig_exporter_device_memory_{field}_bytes",
            f"Device framebuffer memory {text}, in bytes (nvidia-smi fb_memory_usage/{field}).",
            DEVICE_LABELS, [index, card, profile], values,
        )
    by_device = processes_per_device(snapshot)
    # A device whose process list the driver did not give is left out: unknown, not free.
    yield _known(
        "mig_exporter_device_processes",
        "Processes holding memory on the device, as the driver lists them (left out where it does not list them).",
        DEVICE_LABELS, [index, card, profile],
        [by_device[d.index] if d.processes_known else None for d in devices],
    )


def _known(name: str, documentation: str, labels: list[str], columns: list[list[str]],
           values: Sequence[float | None]) -> GaugeColumns:
    """A family of the rows whose value is known: an unknown one is left out, never written as 0."""
    if None in values:
        keep = [value is not None for value in values]
        columns = [list(compress(column, keep)) for column in columns]
        known = [value for value in values if value is not None]
    else:
        known = cast("list[float]", values)
    return GaugeColumns(name, documentation, labels=labels, columns=columns, values=known, count=len(known))


# Each GPM ratio of ``Activity``: its family, and what it measures (NVML's GPM metric; DCGM's field).
ACTIVITY_RATIOS = (
    ("graphics_ratio", "mig_exporter_device_graphics_activity_ratio",
     "Fraction of time the graphics or compute engine was busy: any kernel ran (GPM GRAPHICS_UTIL; DCGM's "
     "GR_ENGINE_ACTIVE)"),
    ("sm_ratio", "mig_exporter_device_sm_activity_ratio",
     "Fraction of time the SMs had at least one warp, averaged over the SMs (GPM SM_UTIL; DCGM's SM_ACTIVE)"),
    ("sm_occupancy_ratio", "mig_exporter_device_sm_occupancy_ratio",
     "Warps resident on the SMs over the most they can hold, averaged over the SMs (GPM SM_OCCUPANCY; DCGM's "
     "SM_OCCUPANCY)"),
    ("tensor_ratio", "mig_exporter_device_tensor_activity_ratio",
     "Fraction of time the tensor cores were busy (GPM ANY_TENSOR_UTIL; DCGM's PIPE_TENSOR_ACTIVE)"),
    ("dram_bandwidth_ratio", "mig_exporter_device_dram_bandwidth_ratio",
     "Fraction of the peak DRAM bandwidth used, of the GPU instance (GPM DRAM_BW_UTIL; DCGM's DRAM_ACTIVE)"),
)
_ACTIVITY_WHERE = (" over the last window (mig_exporter_device_activity_window_seconds), 0-1. Compute instances "
                   "of one gpu_instance share what it reports. Left out where not measured "
                   "(mig_exporter_device_activity_unknown says why).")


def _activity_families(snapshot: Snapshot) -> Iterator[Metric]:
    """GPM activity per device, written only where some device has it: a path or fleet that measures
    none (nvidia-smi, an A100) has no such family at all, never one of zeros. Each device whose
    activity is not measured gets ``mig_exporter_device_activity_unknown`` with the reason instead."""
    devices = snapshot.devices
    measured = [(d, d.activity) for d in devices if d.activity is not None]
    if measured:
        labels = [_device_labels(d) for d, _ in measured]
        columns = [[x[0] for x in labels], [x[1] for x in labels], [x[2] for x in labels]]
        for field, name, text in ACTIVITY_RATIOS:
            values = [getattr(a, field) for _, a in measured]
            if any(v is not None for v in values):
                yield _known(name, text + _ACTIVITY_WHERE, DEVICE_LABELS, columns, values)
        yield _known(
            "mig_exporter_device_activity_window_seconds",
            "The interval the device's activity ratios average over, in seconds: between the newest GPM sample "
            "and the newest one at least --collector.activity.window older (else the oldest kept).",
            DEVICE_LABELS, columns, [_window(a) for _, a in measured],
        )
    unknown = [d for d in devices if d.activity is None]
    if unknown:
        labels = [_device_labels(d) for d in unknown]
        yield GaugeColumns(
            "mig_exporter_device_activity_unknown",
            "1 for a device whose activity is not measured, with why: no_gpm (the card has no GPM: before "
            "Hopper), first_sample (a window needs two samples), no_compute_instance, not_measured (every metric "
            "failed, NaN or Inf), read_failed, not_read (this read path does not read it). Absent where measured.",
            labels=[*DEVICE_LABELS, "reason"],
            columns=[[x[0] for x in labels], [x[1] for x in labels], [x[2] for x in labels],
                     [d.activity_unknown or ACTIVITY_NOT_READ for d in unknown]],
            values=1,
            count=len(unknown),
        )


def _window(activity: Activity) -> float | None:
    # A window that is not a positive number of seconds measured nothing: left out, never 0.
    seconds = activity.window_seconds
    return seconds if seconds > 0 else None


def _process_families(snapshot: Snapshot, pods: PodReading | None, owners: OwnerReading | None,
                      process_series: ProcessSeries) -> Iterator[Metric]:
    if not process_series.enabled:
        return
    processes, other = process_series.select(snapshot.processes)
    n = len(processes)
    device_labels = {d.index: _device_labels(d) for d in snapshot.devices}
    on = [device_labels[p.device_index] for p in processes]
    index, card, profile = ([d[0] for d in on], [d[1] for d in on], [d[2] for d in on])
    pid = [str(p.pid) for p in processes]
    used: list[int | None] = [p.used_bytes for p in processes]
    if other:  # top=N: one pid="other" row per device for the processes folded together
        folded_on = [device_labels[device] for device in other]
        memory_columns = [index + [d[0] for d in folded_on], card + [d[1] for d in folded_on],
                          profile + [d[2] for d in folded_on], pid + [OTHER_PID] * len(other)]
        used = used + list(other.values())
    else:
        memory_columns = [index, card, profile, pid]
    yield _known(
        "mig_exporter_process_memory_used_bytes",
        "Device memory held by the process on the device, in bytes (left out where the driver does not say). "
        "With --collector.processes=top=N, pid=\"other\" holds the memory of a device's other processes.",
        PROCESS_LABELS, memory_columns, used,
    )
    if snapshot.process_activity:
        yield from _process_activity_families(snapshot.process_activity, processes, on, pid)
    # Without pods or owners (/probe, a node without them) each of their labels is one "" for all.
    in_pods = pods.processes if pods is not None else {}
    pod_columns: list[Column] = ["", "", "", ""]
    if in_pods:
        pod_of = [in_pods.get(p.pid) for p in processes]
        pod_columns = [[pod.namespace if pod else "" for pod in pod_of], [pod.pod if pod else "" for pod in pod_of],
                       [pod.container if pod else "" for pod in pod_of],
                       [pod.container_id if pod else "" for pod in pod_of]]
    owned = owners.processes if owners is not None else {}
    owner_columns: list[Column] = ["", "", "", ""]
    if owned:
        owner_of = [owned.get(p.pid) for p in processes]
        owner_columns = [[(o.slurm_job or "") if o else "" for o in owner_of],
                         [(o.slurm_step or "") if o else "" for o in owner_of],
                         [(o.systemd_unit or "") if o else "" for o in owner_of],
                         [(o.user or "") if o else "" for o in owner_of]]
    yield GaugeColumns(
        "mig_exporter_process_info",
        "A process on a device, with its name and type (C compute, G graphics, C+G both, M+C MPS), and its "
        "Kubernetes namespace, pod, container and container id, its Slurm job and step, its systemd unit and its "
        "user (each empty where unknown or not in one).",
        labels=[*PROCESS_LABELS, "process_name", "process_type", *POD_LABELS, "container_id", *OWNER_LABELS],
        columns=[index, card, profile, pid, [p.name for p in processes], [p.type for p in processes],
                 *pod_columns, *owner_columns],
        values=1,
        count=n,
    )


def _process_activity_families(activity: Sequence[PlacedProcessActivity], processes: Sequence[Process],
                               on: list[tuple[str, str, str]], pid: list[str]) -> Iterator[Metric]:
    """Per-process activity on whole cards, for the processes written one by one (``processes``,
    with their device labels ``on`` and ``pid``): a folded one (pid="other") has none, as a sum of
    shares of different samples would be no share. Written only where some process has it."""
    by_key = {(a.device_index, a.pid): a for a in activity}
    found = ((i, by_key.get((p.device_index, p.pid))) for i, p in enumerate(processes))
    rows = [(i, a) for i, a in found if a is not None]
    if not rows:
        return
    columns = [[on[i][0] for i, _ in rows], [on[i][1] for i, _ in rows], [on[i][2] for i, _ in rows],
               [pid[i] for i, _ in rows]]
    for field, name, text in (
        ("sm_ratio", "mig_exporter_process_sm_activity_ratio",
         "Fraction of time the process ran a kernel on the whole card (0-1): over --collector.activity.window "
         "on the NVML path, pmon's one sample on the nvidia-smi path (docs/activity.md)"),
        ("memory_ratio", "mig_exporter_process_memory_activity_ratio",
         "Fraction of time the process read or wrote device memory on the whole card (0-1), over the same window "
         "or sample"),
    ):
        values = [getattr(a, field) for _, a in rows]
        if any(v is not None for v in values):
            yield _known(
                name,
                text + ": the driver's per-process samples (nvmlDeviceGetProcessUtilization, nvidia-smi pmon); 0 "
                "for a listed process the driver sampled no activity of. Left out on cards in MIG mode, where "
                "the driver does not give it, and for processes without their own series (--collector.processes).",
                PROCESS_LABELS, columns, values)


def _card_families(snapshot: Snapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mig_exporter_card_info",
        "A physical card, with its identity (serial: the board's, as an RMA asks) and the driver it runs under.",
        labels=["card", "uuid", "name", "pci_bus_id", "serial", "driver_version", "cuda_version"],
    )
    ok = GaugeMetricFamily(
        "mig_exporter_card_read_success",
        "1 when the card's section of the read could be read, 0 when it failed (see the log).",
        labels=["card"],
    )
    # Only 1, only while it holds: the nvidia-smi path cannot tell a lost card from another
    # failure, so a 0 would claim what no read knows.
    lost = GaugeMetricFamily(
        "mig_exporter_card_lost",
        "1 while the card's read fails because the driver says it is lost (NVML's GPU_IS_LOST: it fell off "
        "the bus); absent otherwise.",
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
            [card, c.uuid or "", c.name or "", c.pci_bus_id or "", c.serial or "", snapshot.driver_version or "",
             snapshot.cuda_version or ""],
            1,
        )
        ok.add_metric([card], 0 if c.error else 1)
        if c.lost:
            lost.add_metric([card], 1)
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
    yield from (info, ok, *([lost] if lost.samples else []), mig_mode, instances, temperature, power, utilization)


def engine_families(reading: EngineReading, process_series: ProcessSeries = ALL_PROCESSES) -> Iterator[Metric]:
    """Engine families for one /proc read (docs/engines.md). ``process_series``: which engine
    processes get series of their own (``ProcessSeries.select_engines``); the others are summed
    per engine into ``pid="other"``: one memory series, and one info series per device they are
    on (``comm=""``, never ``index=""``). Sample output (demo, ``--collector.processes none``)::

        mig_exporter_host_pid_namespace 1.0
        mig_exporter_engine_processes{engine="llama.cpp"} 3.0
        mig_exporter_engine_memory_used_bytes{engine="llama.cpp",pid="52040"} 0.0
        mig_exporter_engine_memory_used_bytes{engine="llama.cpp",pid="other"} 3.3554432e+10
        mig_exporter_engine_info{comm="llama-server",engine="llama.cpp",index="",pid="52040"} 1.0
        mig_exporter_engine_info{comm="",engine="llama.cpp",index="1",pid="other"} 1.0
        mig_exporter_engine_info{comm="",engine="llama.cpp",index="1000",pid="other"} 1.0
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
        "0 means it is on no GPU's process list (it runs on the CPU). With --collector.processes=top=N or "
        "none, pid=\"other\" holds the memory of the engine's other processes on GPUs.",
        labels=["engine", "pid"],
    )
    info = GaugeMetricFamily(
        "mig_exporter_engine_info",
        "An engine process and a device it holds memory on; index is empty when it is on none. With "
        "--collector.processes=top=N or none, pid=\"other\" (comm empty) stands for the engine's other "
        "processes on that device.",
        labels=["engine", "pid", "comm", "index"],
    )
    own, folded = process_series.select_engines(reading.processes)
    for e in own:
        pid = str(e.pid)
        if e.used_bytes is not None:
            used.add_metric([e.engine, pid], e.used_bytes)
        for index in e.device_indexes or (None,):
            info.add_metric([e.engine, pid, e.comm, _int_label(index)], 1)
    # The folded ones, each on some device: per engine, the memory of those whose memory is known
    # (as under all, where one of unknown memory has no memory series), and the devices of all.
    other_used: dict[str, int] = {}
    other_on: dict[str, set[int]] = {}
    for e in folded:
        if e.used_bytes is not None:
            other_used[e.engine] = other_used.get(e.engine, 0) + e.used_bytes
        other_on.setdefault(e.engine, set()).update(e.device_indexes)
    for engine, value in sorted(other_used.items()):
        used.add_metric([engine, OTHER_PID], value)
    for engine, devices in sorted(other_on.items()):
        for index in sorted(devices):
            info.add_metric([engine, OTHER_PID, "", str(index)], 1)
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
    sums = _memory_by(snapshot, {pid: (pod.namespace, pod.pod, pod.container)
                                 for pid, pod in reading.processes.items() if pod.pod})
    used = GaugeMetricFamily(
        "mig_exporter_pod_memory_used_bytes",
        "Device memory the processes of a pod's container hold, summed over all devices, in bytes "
        "(left out where the driver does not say for one of them).",
        labels=POD_LABELS,
    )
    for key, value in sorted(sums.items()):
        used.add_metric(list(key), value)
    yield used


def _memory_by(snapshot: Snapshot, keys: dict[int, K]) -> dict[K, int]:
    """Process memory summed per key, by pid (a pid not in ``keys`` is not
    counted). A key one of whose processes the driver gives no figure for is
    left out: its sum would be too low."""
    if not keys:  # no pod, job or unit known: nothing to sum (and no loop over every process)
        return {}
    sums: dict[K, int] = {}
    unknown = []
    for p in snapshot.processes:
        key = keys.get(p.pid)
        if key is not None:
            if p.used_bytes is None:
                unknown.append(key)
            else:
                sums[key] = sums.get(key, 0) + p.used_bytes
    for key in unknown:
        sums.pop(key, None)
    return sums


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


def device_state_families(snapshot: Snapshot, host: HostView) -> Iterator[Metric]:
    """Each device's state as a scheduler may take it (model/capacity.py): one series per state,
    1 for the device's and 0 for the others, so that a change of state is a change of value and
    never two series at once (as kube-state-metrics' kube_pod_status_phase). Sample output::

        mig_exporter_device_state{card="0",index="1000",mig_profile="3g.40gb",state="free"} 1.0
        mig_exporter_device_state{card="0",index="1000",mig_profile="3g.40gb",state="in_use"} 0.0
        mig_exporter_device_state{card="0",index="1000",mig_profile="3g.40gb",state="unknown"} 0.0
    """
    states = device_states(snapshot, host)
    n = len(snapshot.devices)
    labels = [_device_labels(d) for d in snapshot.devices]
    yield GaugeColumns(
        "mig_exporter_device_state",
        "1 for the device's state, 0 for the others: free (a scheduler may place work on it: no process listed, "
        "nothing allocated, the host's PIDs seen, memory as an empty device's), in_use, or unknown (docs/capacity.md).",
        labels=[*DEVICE_LABELS, "state"],
        columns=[[d[0] for d in labels for _ in STATES], [d[1] for d in labels for _ in STATES],
                 [d[2] for d in labels for _ in STATES], [s for _ in labels for s in STATES]],
        values=[int(states[d.index].state == s) for d in snapshot.devices for s in STATES],
        count=n * len(STATES),
    )


def owner_families(reading: OwnerReading, snapshot: Snapshot) -> Iterator[Metric]:
    """Slurm job and systemd unit sums for one read (docs/hpc.md), for those
    with processes on a GPU's list. Sample output::

        mig_exporter_slurm_job_memory_used_bytes{slurm_job="4242"} 2.147483648e+10
        mig_exporter_systemd_unit_memory_used_bytes{systemd_unit="ollama.service"} 1.207959552e+10
    """
    owners = reading.processes
    jobs = _memory_by(snapshot, {pid: o.slurm_job for pid, o in owners.items() if o.slurm_job is not None})
    units = _memory_by(snapshot, {pid: o.systemd_unit for pid, o in owners.items() if o.systemd_unit is not None})
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
