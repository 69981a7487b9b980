"""Map a snapshot to metric families. Nothing here reads a device.

One family per metric name, built fresh for every scrape, so a process that
has exited or an instance that was destroyed simply stops being exposed. An
unknown value is left out, never written as 0. Sample output (demo)::

    mig_exporter_device_memory_used_bytes{card="0",index="1000",mig_profile="3g.40gb"} 1.2229541888e+10
    mig_exporter_process_memory_used_bytes{card="1",index="1",mig_profile="",pid="50102"} 2.147483648e+10
    mig_exporter_card_mig_instances{card="0"} 3.0
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.snapshot import Device, Snapshot

DEVICE_LABELS = ["index", "card", "mig_profile"]
PROCESS_LABELS = [*DEVICE_LABELS, "pid"]


def _device_labels(d: Device) -> list[str]:
    return [str(d.index), str(d.card), d.profile or ""]


def snapshot_families(snapshot: Snapshot) -> Iterator[Metric]:
    """Device, process and card families for one snapshot."""
    yield from _device_families(snapshot)
    yield from _process_families(snapshot)
    yield from _card_families(snapshot)


def _device_families(snapshot: Snapshot) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "mig_exporter_device_info",
        "A device a workload runs on: a whole card, or one MIG instance of a card in MIG mode. "
        "Compute instances of one gpu_instance share its memory.",
        labels=["index", "card", "mig_profile", "uuid", "gpu_instance", "compute_instance", "class", "name"],
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


def _process_families(snapshot: Snapshot) -> Iterator[Metric]:
    used = GaugeMetricFamily(
        "mig_exporter_process_memory_used_bytes",
        "Device memory held by the process on the device, in bytes (left out where the driver does not say).",
        labels=PROCESS_LABELS,
    )
    info = GaugeMetricFamily(
        "mig_exporter_process_info",
        "A process on a device, with its name and type (C compute, G graphics, C+G both, M+C MPS).",
        labels=[*PROCESS_LABELS, "process_name", "process_type"],
    )
    device_labels = {d.index: _device_labels(d) for d in snapshot.devices}
    for p in snapshot.processes:
        labels = [*device_labels[p.device_index], str(p.pid)]
        info.add_metric([*labels, p.name, p.type], 1)
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
        for family, value in (
            (temperature, c.temperature_celsius),
            (power, c.power_draw_watts),
            (utilization, c.utilization_ratio),
        ):
            if value is not None:
                family.add_metric([card], value)
    yield from (info, ok, mig_mode, instances, temperature, power, utilization)


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
    ok = GaugeMetricFamily("mig_exporter_read_success", "1 when the last read succeeded, 0 when it failed.", labels=labels)
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
        "a process on no instance); each is logged.",
        labels=labels,
    )
    found.add_metric([source], problems)
    build = GaugeMetricFamily("mig_exporter_build_info", "The exporter's version.", labels=["version"])
    build.add_metric([version], 1)
    yield from (ok, duration, errors, found, build)


def _int_label(value: int | None) -> str:
    return "" if value is None else str(value)
