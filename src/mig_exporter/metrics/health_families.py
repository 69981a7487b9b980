"""Map a snapshot's card health (model/health.py) and the XIDs seen to metric families.
Nothing here reads a device. Heat, power and wear are reported once per card (label
``card``); only the ECC counts the driver gives per MIG instance are on the device
(``mig_exporter_device_ecc_errors_total``). An unknown value is left out, never 0.
Sample output (demo)::

    mig_exporter_card_row_remap_pending{card="1"} 1.0
    mig_exporter_card_health{card="1",state="reset"} 1.0
    mig_exporter_device_ecc_errors_total{card="0",index="1002",memory="sram",mig_profile="1g.10gb",scope="volatile",type="uncorrectable"} 1.0
"""  # noqa: E501 - a sample exposition line cannot be wrapped

from __future__ import annotations

from collections.abc import Iterable, Iterator
from math import copysign

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.metrics.exposition import CounterColumns, GaugeColumns
from mig_exporter.model.health import HEALTH_STATES, XidSeen, grade, instance_uncorrectable
from mig_exporter.model.snapshot import Snapshot


class _Rows:
    """One family's rows (label values, then the value), gathered as tuples and turned into
    columns at the end: a family of a few hundred lines is then written by ``render`` in
    one template, not a ``Sample`` and a label dict per line (docs/performance.md)."""

    __slots__ = ("documentation", "kind", "labels", "name", "rows")

    def __init__(self, name: str, documentation: str, labels: list[str] | None = None,
                 kind: type[GaugeColumns] = GaugeColumns, first: tuple[str, ...] = ("card",)) -> None:
        self.name, self.documentation, self.kind = name, documentation, kind
        self.labels = [*first, *(labels or [])]
        self.rows: list[tuple[str | float, ...]] = []

    def family(self) -> GaugeColumns:
        """The family of these rows; the one made last time where the rows are the same (a card's
        wear, limits and thresholds seldom change between two scrapes), so that its lines are
        written once (``GaugeColumns.lines``)."""
        rows = self.rows
        # 0 and -0.0 are equal rows but two texts: a row holding -0.0 is never kept nor matched.
        keep = not any(r[-1] == 0 and copysign(1.0, r[-1]) < 0 for r in rows)
        kept = _LAST.get(self.name)
        if keep and kept is not None and kept[0] == rows and kept[1].unread:
            return kept[1]
        *labels, values = zip(*rows, strict=True) if rows else ([] for _ in range(len(self.labels) + 1))
        columns = [list(column) for column in labels]  # label columns are str
        family = self.kind(self.name, self.documentation, labels=self.labels, columns=columns, values=list(values),
                           count=len(values))
        if keep:
            _LAST[self.name] = (rows, family)
        return family


# The last family made of each name, and its rows (a few dozen names; a dict op at a time:
# thread-safe). A probe's read may take a name's place; the next scrape then makes it anew.
_LAST: dict[str, tuple[list[tuple[str | float, ...]], GaugeColumns]] = {}


def _gauge(name: str, documentation: str, labels: list[str] | None = None) -> _Rows:
    return _Rows(name, documentation, labels)


def _counter(name: str, documentation: str, labels: list[str] | None = None) -> _Rows:
    return _Rows(name, documentation, labels, CounterColumns)


def health_families(snapshot: Snapshot) -> Iterator[Metric]:
    """The card-health families, and the per-instance ECC counts, for one snapshot."""
    memory_temperature = _gauge("mig_exporter_card_memory_temperature_celsius",
                                "Memory (HBM/GDDR) temperature, in degrees Celsius.")
    thresholds = _gauge(
        "mig_exporter_card_temperature_threshold_celsius",
        "The driver's absolute temperature thresholds, in degrees Celsius: shutdown, slowdown, max_operating "
        "(the core's), memory_max_operating, target. T.Limit offsets are never among them.", ["threshold"])
    margin = _gauge("mig_exporter_card_temperature_margin_celsius",
                    "How far the core is below its thermal limit (T.Limit), in degrees Celsius; "
                    "the card slows down at 0.")
    active = _gauge("mig_exporter_card_clock_event_active",
                    "1 while the driver holds the clocks down for the reason, 0 when not.", ["reason"])
    event_seconds = _counter(
        "mig_exporter_card_clock_event_seconds",
        "Time the clocks were held down for the reason since the driver loaded, in seconds "
        "(a 3 s throttle between two scrapes shows here, not in clock_event_active).", ["reason"])
    pstate = _gauge("mig_exporter_card_performance_state", "Performance state as a number: P0 is 0 (fastest).")
    clocks = _gauge("mig_exporter_card_clock_hertz", "Clock frequencies in hertz: kind=current now, kind=max the "
                    "most the card may run.", ["clock", "kind"])
    fan = _gauge("mig_exporter_card_fan_speed_ratio", "Fan speed the driver asks for, 0-1; left out without a fan.")
    limits = _gauge("mig_exporter_card_power_limit_watts",
                    "Power limits in watts: current (enforced), requested (set), default, min, max.", ["limit"])
    energy = _counter("mig_exporter_card_energy_joules",
                      "Energy the card used since the driver loaded, in joules (NVML only).")
    ecc_mode = _gauge("mig_exporter_card_ecc_mode", "ECC mode, 1 enabled and 0 disabled; state=pending takes "
                      "effect at the next reset.", ["state"])
    ecc = _counter(
        "mig_exporter_card_ecc_errors",
        "ECC errors by scope (volatile since the driver loaded, aggregate over the card's life), memory "
        "(sram, dram; older cards: the driver's location) and type (correctable, uncorrectable). The "
        "driver's own total is never one: a sum is the total.", ["scope", "memory", "type"])
    sram_threshold = _gauge("mig_exporter_card_ecc_sram_threshold_exceeded",
                            "1 when SRAM errors passed the driver's threshold, 0 when not.")
    remapped = _gauge("mig_exporter_card_remapped_rows", "Memory rows remapped so far, by the error that caused "
                      "it. Not reported by a card in MIG mode.", ["type"])
    remap_pending = _gauge("mig_exporter_card_row_remap_pending",
                           "1 when a row remap waits for a card reset: the card needs a reset.")
    remap_failure = _gauge("mig_exporter_card_row_remap_failure",
                           "1 when a row remap failed: the card needs replacing.")
    availability = _gauge("mig_exporter_card_row_remap_availability_banks",
                          "Memory banks by how many spare rows they have left to remap (the remapper's histogram).",
                          ["availability"])
    retired = _gauge("mig_exporter_card_retired_pages", "Memory pages retired (pre-Ampere page retirement), by "
                     "cause.", ["cause"])
    retired_pending = _gauge("mig_exporter_card_retired_pages_pending",
                             "1 when a page retirement waits for a card reset.")
    repair = _gauge("mig_exporter_card_repair_pending", "1 when a repair of the unit waits for a card reset.",
                    ["unit"])
    recovery = _gauge("mig_exporter_card_recovery_action",
                      "The driver's advice: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset, "
                      "5 recover the IMEX domain, 6 bus reset, 7 system reboot.")
    replays = _counter("mig_exporter_card_pcie_replays", "PCIe replays since the driver loaded.")
    state = _gauge("mig_exporter_card_health",
                   "The card's health: 1 for its worst state (ok, warning, reset: needs a reset, replace: needs "
                   "replacing), 0 for the others (docs/metrics.md lists the rules).", ["state"])
    device_ecc = _Rows(
        "mig_exporter_device_ecc_errors",
        "ECC errors a MIG instance reports on its own, by scope, memory and type.",
        ["scope", "memory", "type"], CounterColumns, first=("index", "card", "mig_profile"))
    by_card: dict[int, int] = {}
    for d in snapshot.devices:
        if d.ecc_errors:
            by_card[d.card] = by_card.get(d.card, 0) + instance_uncorrectable(d.ecc_errors)
            device = (str(d.index), str(d.card), d.profile or "")
            device_ecc.rows += [(*device, e.scope, e.memory, e.type, e.errors) for e in d.ecc_errors]
    for c in snapshot.cards:
        card = str(c.index)
        h = c.health
        for family, value in ((memory_temperature, h.memory_temperature_celsius),
                              (margin, h.temperature_margin_celsius), (pstate, h.performance_state),
                              (fan, h.fan_speed_ratio), (recovery, h.recovery_action)):
            if value is not None:
                family.rows.append((card, value))
        for family, flag in ((sram_threshold, h.ecc_sram_threshold_exceeded), (remap_pending, h.row_remap_pending),
                             (remap_failure, h.row_remap_failure), (retired_pending, h.retired_pages_pending)):
            if flag is not None:
                family.rows.append((card, int(flag)))
        for counter, total in ((energy, h.energy_joules), (replays, h.pcie_replays)):
            if total is not None:
                counter.rows.append((card, total))
        for family, pairs in ((thresholds, h.temperature_thresholds_celsius), (limits, h.power_limits_watts),
                              (availability, h.row_remap_availability_banks)):
            for name, value in pairs:
                family.rows.append((card, name, value))
        for family, flags in ((active, h.clock_events_active), (repair, h.repair_pending)):
            for name, on in flags:
                family.rows.append((card, name, int(on)))
        for reason, seconds in h.clock_event_seconds:
            event_seconds.rows.append((card, reason, seconds))
        for reading in h.clocks:
            clocks.rows.append((card, reading.clock, reading.kind, reading.hertz))
        for mode, enabled in (("current", h.ecc_mode_current), ("pending", h.ecc_mode_pending)):
            if enabled is not None:
                ecc_mode.rows.append((card, mode, int(enabled)))
        for e in h.ecc_errors:
            ecc.rows.append((card, e.scope, e.memory, e.type, e.errors))
        for kind, rows in (("correctable", h.remapped_rows_correctable),
                           ("uncorrectable", h.remapped_rows_uncorrectable)):
            if rows is not None:
                remapped.rows.append((card, kind, rows))
        for cause, pages in (("single_bit", h.retired_pages_single_bit), ("double_bit", h.retired_pages_double_bit)):
            if pages is not None:
                retired.rows.append((card, cause, pages))
        if c.error is None:  # an unreadable card's health is unknown, not ok
            worst = grade(h, by_card.get(c.index, 0)).state
            for s in HEALTH_STATES:
                state.rows.append((card, s, int(s == worst)))
    for built in (memory_temperature, thresholds, margin, active, event_seconds, pstate, clocks, fan, limits, energy,
                  ecc_mode, ecc, sram_threshold, remapped, remap_pending, remap_failure, availability, retired,
                  retired_pending, repair, recovery, replays, state, device_ecc):
        if built.rows:  # render leaves an empty family out; no need to build it
            yield built.family()


def xid_families(seen: Iterable[XidSeen]) -> Iterator[Metric]:
    """XID errors seen since the exporter started (NVML's events; docs/metrics.md)."""
    total = CounterMetricFamily(
        "mig_exporter_xid_errors",
        "XID errors the driver reported since the exporter started, by card, placement index (the MIG "
        "instance's when the event names it, else the card's) and XID code.", labels=["card", "index", "xid"])
    last = GaugeMetricFamily("mig_exporter_xid_last_seconds",
                             "When the XID was last seen, in seconds since the epoch.", labels=["card", "index", "xid"])
    for x in sorted(seen):
        labels = [str(x.card), str(x.device_index), str(x.xid)]
        total.add_metric(labels, x.seen)
        last.add_metric(labels, x.last_seconds)
    yield from (total, last)
