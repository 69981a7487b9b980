"""Map the XIDs seen (sources/xid.py's ``XidBook``) to metric families. Nothing here reads a device.

Sample::

    mig_exporter_xid_errors_total{card="0",index="1000",xid="94"} 1.0
    mig_exporter_xid_last_timestamp_seconds{card="0",index="1000",xid="94"} 1.7649e+09
    mig_exporter_xid_last_process_info{card="0",container="",index="1000",namespace="",pid="48213",
        pod="",process_name="llama-server",slurm_job="",systemd_unit="",xid="94"} 1.0
    mig_exporter_xid_source_readable{source="kmsg"} 1.0
    mig_exporter_xid_series_folded_total{reason="over_cap"} 0.0
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.model.health import OTHER_XID, XidSeen

LABELS = ["card", "index", "xid"]
PROCESS_LABELS = [*LABELS, "pid", "process_name", "namespace", "pod", "container", "slurm_job", "systemd_unit"]


def xid_families(seen: Iterable[XidSeen], readable: Mapping[str, bool] | None = None,
                 dropped: Mapping[str, int] | None = None, folded: Mapping[str, int] | None = None
                 ) -> Iterator[Metric]:
    """XID errors by card, placement index and code (docs/xids.md); ``readable``: whether each
    XID source (``kmsg``, ``nvml_events``) is read, for the sources in use; ``dropped``: the kernel
    log's lines counted on no card, by why (``KmsgReader.dropped``), where it is read; ``folded``:
    the (card, index, xid) counted under xid="other", by why (``XidBook.folded``)."""
    total = CounterMetricFamily(
        "mig_exporter_xid_errors",
        "XID errors the driver reported: since boot where the kernel's log is read, else since the exporter "
        "started (NVML's events), each once; by card, placement index (the MIG instance's when the XID names "
        "it, else the card's) and XID code.", labels=LABELS)
    last = GaugeMetricFamily("mig_exporter_xid_last_timestamp_seconds",
                             "When the XID was last seen, in seconds since the epoch.", labels=LABELS)
    process = GaugeMetricFamily(
        "mig_exporter_xid_last_process_info",
        "The process the last kernel line of the XID named, and its pod, Slurm job and systemd unit as found "
        "while it lived (empty where unknown, and all empty for an XID NVML's events alone gave).",
        labels=PROCESS_LABELS)
    for x in sorted(seen):
        labels = [str(x.card), str(x.device_index), "other" if x.xid == OTHER_XID else str(x.xid)]
        total.add_metric(labels, x.seen)
        last.add_metric(labels, x.last_seconds)
        process.add_metric([*labels, *("" if v is None else str(v) for v in (
            x.last_pid, x.process_name, x.namespace, x.pod, x.container, x.slurm_job, x.systemd_unit))], 1)
    yield from (total, last, process)
    if readable:
        sources = GaugeMetricFamily("mig_exporter_xid_source_readable",
                                    "Whether the XID source is read (1) or not (0, the reason in the log).",
                                    labels=["source"])
        for name, ok in sorted(readable.items()):
            sources.add_metric([name], 1 if ok else 0)
        yield sources
    if dropped is not None:
        # A storm past the bounds, or a log read too late, shows here rather than as nothing.
        lost = CounterMetricFamily(
            "mig_exporter_xid_kmsg_lines_dropped",
            "Kernel log lines counted on no card, by reason: overwritten (records the kernel overwrote before "
            "they were read; any could have been an XID), too_many_kinds (XID lines past the bound on distinct "
            "card, instance and code).", labels=["reason"])
        for reason, count in sorted(dropped.items()):
            lost.add_metric([reason], count)
        yield lost
    if folded is not None:
        # The bound on series shows here: a storm of codes reads as a number, not as silence.
        over = CounterMetricFamily(
            "mig_exporter_xid_series_folded",
            "Distinct card, index and XID code counted under xid=\"other\", by reason: out_of_range (a code "
            "outside NVIDIA's XID catalogue), over_cap (past the bound on distinct series).", labels=["reason"])
        for reason, count in sorted(folded.items()):
            over.add_metric([reason], count)
        yield over
