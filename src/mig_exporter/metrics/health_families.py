"""Map a snapshot's card health (model/health.py) to metric families (the XIDs: xid_families.py).
Nothing here reads a device. Heat, power and wear are reported once per card (label
``card``); only the ECC counts the driver gives per MIG instance are on the device
(``mig_exporter_device_ecc_errors_total``). An unknown value is left out, never 0.

The card families are one table, ``HEALTH_FAMILIES``: a row per family gives its name, help,
labels, kind and the rows a card gives it; one loop over the cards fills them all. The grade
(``mig_exporter_card_health`` and its reasons) is the card's ``verdict``, made once when the
snapshot was built, never graded again here. Sample output (demo)::

    mig_exporter_card_row_remap_pending{card="1"} 1.0
    mig_exporter_card_health{card="1",state="reset"} 1.0
    mig_exporter_card_health_reason{card="1",reason="row_remap_pending",state="reset"} 1.0
    mig_exporter_device_ecc_errors_total{card="0",index="1002",memory="sram",mig_profile="1g.10gb",scope="volatile",type="uncorrectable"} 1.0
"""  # noqa: E501 - a sample exposition line cannot be wrapped

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from math import copysign
from typing import NamedTuple

from prometheus_client.core import Metric

from mig_exporter.metrics.exposition import CounterColumns, GaugeColumns
from mig_exporter.model.health import HEALTH_STATES, CardHealth
from mig_exporter.model.snapshot import Card, Snapshot

# A row of a family: its label values, ``card`` first, then its value.
Row = tuple[str | float, ...]
# A card's rows in a family, from its ``card`` label value and the card.
Rows = Callable[[str, Card], list[Row]]


class HealthFamily(NamedTuple):
    """One card family: ``rows`` gives a card's rows (none where the value is unknown)."""

    name: str  # a counter's without ``_total``, as prometheus_client names it
    documentation: str
    labels: tuple[str, ...]  # after ``card``
    rows: Rows
    kind: type[GaugeColumns] = GaugeColumns


def _value(read: Callable[[CardHealth], float | None]) -> Rows:
    """One row holding the value; none where it is unknown."""
    def rows(card: str, c: Card) -> list[Row]:
        value = read(c.health)
        return [] if value is None else [(card, value)]
    return rows


def _flag(read: Callable[[CardHealth], bool | None]) -> Rows:
    """One row holding 1 or 0; none where it is unknown."""
    def rows(card: str, c: Card) -> list[Row]:
        flag = read(c.health)
        return [] if flag is None else [(card, int(flag))]
    return rows


def _named(read: Callable[[CardHealth], Iterable[tuple[str, float | None]]]) -> Rows:
    """A row per ``(name, value)`` pair, the name as the one label; an unknown value is left out."""
    def rows(card: str, c: Card) -> list[Row]:
        return [(card, name, value) for name, value in read(c.health) if value is not None]
    return rows


def _named_flags(read: Callable[[CardHealth], Iterable[tuple[str, bool | None]]]) -> Rows:
    """A row per ``(name, flag)`` pair holding 1 or 0; an unknown flag is left out."""
    def rows(card: str, c: Card) -> list[Row]:
        return [(card, name, int(flag)) for name, flag in read(c.health) if flag is not None]
    return rows


def _health(card: str, c: Card) -> list[Row]:
    """A row per state, 1 for the card's own; none for a card not read (its health is unknown, not ok)."""
    verdict = c.verdict
    return [] if verdict is None else [(card, state, int(state == verdict.state)) for state in HEALTH_STATES]


def _reasons(card: str, c: Card) -> list[Row]:
    """A row per reason of the grade, by its state and code: none for an ok card or one not read."""
    verdict = c.verdict
    if verdict is None:
        return []
    # dict: a code given twice would be one label set twice, which the exposition does not allow.
    return [(card, state, code, 1) for state, code in dict.fromkeys(zip(verdict.states, verdict.codes, strict=True))]


HEALTH_FAMILIES: tuple[HealthFamily, ...] = (
    HealthFamily("mig_exporter_card_memory_temperature_celsius", "Memory (HBM/GDDR) temperature, in degrees Celsius.",
                 (), _value(lambda h: h.memory_temperature_celsius)),
    HealthFamily(
        "mig_exporter_card_temperature_threshold_celsius",
        "The driver's absolute temperature thresholds, in degrees Celsius: shutdown, slowdown, max_operating "
        "(the core's), memory_max_operating, target. T.Limit offsets are never among them.", ("threshold",),
        _named(lambda h: h.temperature_thresholds_celsius)),
    HealthFamily("mig_exporter_card_temperature_margin_celsius",
                 "How far the core is below its thermal limit (T.Limit), in degrees Celsius; "
                 "the card slows down at 0.", (), _value(lambda h: h.temperature_margin_celsius)),
    HealthFamily("mig_exporter_card_clock_event_active",
                 "1 while the driver holds the clocks down for the reason, 0 when not.", ("reason",),
                 _named_flags(lambda h: h.clock_events_active)),
    HealthFamily(
        "mig_exporter_card_clock_event_seconds",
        "Time the clocks were held down for the reason since the driver loaded, in seconds "
        "(a 3 s throttle between two scrapes shows here, not in clock_event_active).", ("reason",),
        _named(lambda h: h.clock_event_seconds), CounterColumns),
    HealthFamily("mig_exporter_card_performance_state", "Performance state as a number: P0 is 0 (fastest).", (),
                 _value(lambda h: h.performance_state)),
    HealthFamily("mig_exporter_card_clock_hertz", "Clock frequencies in hertz: kind=current now, kind=max the "
                 "most the card may run.", ("clock", "kind"),
                 lambda card, c: [(card, r.clock, r.kind, r.hertz) for r in c.health.clocks]),
    HealthFamily("mig_exporter_card_fan_speed_ratio",
                 "Fan speed the driver asks for, 0-1; left out without a fan.", (),
                 _value(lambda h: h.fan_speed_ratio)),
    HealthFamily("mig_exporter_card_power_limit_watts",
                 "Power limits in watts: current (enforced), requested (set), default, min, max.", ("limit",),
                 _named(lambda h: h.power_limits_watts)),
    HealthFamily("mig_exporter_card_energy_joules",
                 "Energy the card used since the driver loaded, in joules (NVML only).", (),
                 _value(lambda h: h.energy_joules), CounterColumns),
    HealthFamily("mig_exporter_card_ecc_mode", "ECC mode, 1 enabled and 0 disabled; state=pending takes "
                 "effect at the next reset.", ("state",),
                 _named_flags(lambda h: (("current", h.ecc_mode_current), ("pending", h.ecc_mode_pending)))),
    HealthFamily(
        "mig_exporter_card_ecc_errors",
        "ECC errors by scope (volatile since the driver loaded, aggregate over the card's life), memory "
        "(sram, dram; older cards: the driver's location) and type (correctable, uncorrectable). The "
        "driver's own total is never one: a sum is the total.", ("scope", "memory", "type"),
        lambda card, c: [(card, e.scope, e.memory, e.type, e.errors) for e in c.health.ecc_errors], CounterColumns),
    HealthFamily("mig_exporter_card_ecc_sram_threshold_exceeded",
                 "1 when SRAM errors passed the driver's threshold, 0 when not.", (),
                 _flag(lambda h: h.ecc_sram_threshold_exceeded)),
    HealthFamily("mig_exporter_card_remapped_rows", "Memory rows remapped so far, by the error that caused "
                 "it. Not reported by a card in MIG mode.", ("type",),
                 _named(lambda h: (("correctable", h.remapped_rows_correctable),
                                   ("uncorrectable", h.remapped_rows_uncorrectable)))),
    HealthFamily("mig_exporter_card_row_remap_pending",
                 "1 when a row remap waits for a card reset: the card needs a reset.", (),
                 _flag(lambda h: h.row_remap_pending)),
    HealthFamily("mig_exporter_card_row_remap_failure",
                 "1 when a row remap failed: the card needs replacing.", (), _flag(lambda h: h.row_remap_failure)),
    HealthFamily("mig_exporter_card_row_remap_availability_banks",
                 "Memory banks by how many spare rows they have left to remap (the remapper's histogram).",
                 ("availability",), _named(lambda h: h.row_remap_availability_banks)),
    HealthFamily("mig_exporter_card_retired_pages", "Memory pages retired (pre-Ampere page retirement), by "
                 "cause.", ("cause",),
                 _named(lambda h: (("single_bit", h.retired_pages_single_bit),
                                   ("double_bit", h.retired_pages_double_bit)))),
    HealthFamily("mig_exporter_card_retired_pages_pending",
                 "1 when a page retirement waits for a card reset.", (), _flag(lambda h: h.retired_pages_pending)),
    HealthFamily("mig_exporter_card_repair_pending", "1 when a repair of the unit waits for a card reset.",
                 ("unit",), _named_flags(lambda h: h.repair_pending)),
    HealthFamily("mig_exporter_card_unrepairable_memory",
                 "1 when the driver reports memory it cannot repair: the card needs replacing; 0 when not.", (),
                 _flag(lambda h: h.unrepairable_memory)),
    HealthFamily("mig_exporter_card_recovery_action",
                 "The driver's advice: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset, "
                 "5 recover the IMEX domain, 6 bus reset, 7 system reboot.", (), _value(lambda h: h.recovery_action)),
    HealthFamily("mig_exporter_card_pcie_replays", "PCIe replays since the driver loaded.", (),
                 _value(lambda h: h.pcie_replays), CounterColumns),
    HealthFamily("mig_exporter_card_pcie_link_generation",
                 "PCIe link generation: kind=current now (an idle link drops it to save power), kind=max the "
                 "most this card and host allow.", ("kind",),
                 _named(lambda h: (("current", h.pcie_link_generation_current),
                                   ("max", h.pcie_link_generation_max)))),
    HealthFamily("mig_exporter_card_pcie_link_width_lanes",
                 "PCIe link width in lanes: kind=current now, kind=max the most this card and host allow; "
                 "fewer now than max is a degraded link.", ("kind",),
                 _named(lambda h: (("current", h.pcie_link_width_current), ("max", h.pcie_link_width_max)))),
    HealthFamily("mig_exporter_card_health",
                 "The card's health: 1 for its worst state (ok, warning, reset: needs a reset, replace: needs "
                 "replacing), 0 for the others (docs/metrics.md lists the rules).", ("state",), _health),
    HealthFamily("mig_exporter_card_health_reason",
                 "1 for each reason the card's health is not ok: reason names the rule (docs/metrics.md), "
                 "state the state it gives.", ("state", "reason"), _reasons),
)

# The one family on the device: the ECC counts a MIG instance gives on its own.
_DEVICE_ECC = "mig_exporter_device_ecc_errors"
_DEVICE_ECC_HELP = "ECC errors a MIG instance reports on its own, by scope, memory and type."
_DEVICE_ECC_LABELS = ("index", "card", "mig_profile", "scope", "memory", "type")


def health_families(snapshot: Snapshot) -> Iterator[Metric]:
    """The card-health families, and the per-instance ECC counts, for one snapshot."""
    gathered: list[list[Row]] = [[] for _ in HEALTH_FAMILIES]
    for c in snapshot.cards:
        card = str(c.index)
        for rows, family in zip(gathered, HEALTH_FAMILIES, strict=True):
            rows += family.rows(card, c)
    for family, rows in zip(HEALTH_FAMILIES, gathered, strict=True):
        if rows:  # render leaves an empty family out; no need to build it
            yield _built(family.name, family.documentation, family.kind, ("card", *family.labels), rows)
    device_ecc: list[Row] = []
    for d in snapshot.devices:
        device = (str(d.index), str(d.card), d.profile or "")
        device_ecc += [(*device, e.scope, e.memory, e.type, e.errors) for e in d.ecc_errors]
    if device_ecc:
        yield _built(_DEVICE_ECC, _DEVICE_ECC_HELP, CounterColumns, _DEVICE_ECC_LABELS, device_ecc)


def _built(name: str, documentation: str, kind: type[GaugeColumns], labels: tuple[str, ...],
           rows: list[Row]) -> GaugeColumns:
    """The family of these rows (label values, then the value), as columns: a family of a few
    hundred lines is then written by ``render`` in one template, not a ``Sample`` and a label
    dict per line (docs/performance.md). It is the one made last time where the rows are the
    same (a card's wear, limits and thresholds seldom change between two scrapes), so that its
    lines are written once (``GaugeColumns.lines``)."""
    # 0 and -0.0 are equal rows but two texts: a row holding -0.0 is never kept nor matched.
    keep = not any(r[-1] == 0 and copysign(1.0, r[-1]) < 0 for r in rows)
    kept = _LAST.get(name)
    if keep and kept is not None and kept[0] == rows and kept[1].unread:
        return kept[1]
    *labelled, values = zip(*rows, strict=True)
    columns = [list(column) for column in labelled]  # label columns are str
    built = kind(name, documentation, labels=labels, columns=columns, values=list(values), count=len(values))
    if keep:
        _LAST[name] = (rows, built)
    return built


# The last family made of each name, and its rows (a few dozen names; a dict op at a time:
# thread-safe). A probe's read may take a name's place; the next scrape then makes it anew.
_LAST: dict[str, tuple[list[Row], GaugeColumns]] = {}
