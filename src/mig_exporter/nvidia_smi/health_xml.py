"""Read a card's health from its ``<gpu>`` element of ``nvidia-smi -q -x``: heat, clocks,
power limits, memory wear, its PCIe link and the driver's advice, into ``CardHealth``; and a
MIG device's own ECC counts.

Pure, like the rest of the parse: the element in, values out. Each field is found by the
elements present, never by the driver or DTD version: the same reading was written under
two names over the years (``clocks_throttle_reasons`` became ``clocks_event_reasons`` at
535, ``power_readings`` became ``gpu_power_readings``), and which ECC layout a card has
depends on the GPU, not the driver. ``query_xml`` supplies the typed readers (``Values``):
a marker such as ``N/A`` or ``Requested functionality has been deprecated`` is ``None``
without a word; any other text that does not read is ``None`` and a problem line.

The real samples in ../shared/fixtures/nvidia-smi/real/ (NOTES.md) show every layout read
here; tests/test_health_xml.py reads one of each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple, Protocol, TypeVar, cast

from lxml import etree

from mig_exporter.model.health import (
    CLOCK_EVENT_REASONS,
    POWER_LIMITS,
    REMAP_AVAILABILITY,
    CardHealth,
    ClockReading,
    EccCount,
    RecoveryAction,
)

_T = TypeVar("_T")


class Values(Protocol):
    """What ``query_xml._Values`` reads a value's untrimmed text as (``None``: no element)."""

    def number_of(self, raw: str | None, path: str, unit: str) -> float | None: ...

    def count_of(self, raw: str | None, path: str, unit: str = "") -> int | None: ...

    def choice(self, raw: str | None, path: str, table: Mapping[str, _T]) -> _T | None: ...

    def known_text(self, raw: str | None) -> str | None: ...


class Lookup(Protocol):
    """A ``<gpu>`` element, or ``query_xml._Children`` of it (the paths read here are short)."""

    def find(self, path: str) -> etree._Element | None: ...


_ACTIVE = {"active": True, "not active": False}
_YES = {"yes": True, "no": False}
_ENABLED = {"enabled": True, "disabled": False}
_PSTATES = {f"p{n}": n for n in range(16)}
# nvidia-smi's words for NVML's recovery actions (nvmlDeviceGpuRecoveryAction_t). "None",
# "Reset", "Reboot", "Drain P2P" and "Drain and Reset" are the words NVIDIA's "Error Recovery
# and Response Flags" page gives each action (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt),
# and "None" and "Reset" are what real -q outputs show (the corpus holds only "None"). The
# longer forms and the enum's own names ("GPU_RESET") are read too: the words were never
# fixed in a DTD, and an action not understood is graded a warning, never ok.
_RECOVERY = {
    "none": RecoveryAction.NONE,
    "reset": RecoveryAction.GPU_RESET,
    "gpu reset": RecoveryAction.GPU_RESET,
    "gpu reset required": RecoveryAction.GPU_RESET,
    "reboot": RecoveryAction.NODE_REBOOT,
    "node reboot": RecoveryAction.NODE_REBOOT,
    "node reboot required": RecoveryAction.NODE_REBOOT,
    "drain p2p": RecoveryAction.DRAIN_P2P,
    "drain and reset": RecoveryAction.DRAIN_AND_RESET,
    "recover imex domain": RecoveryAction.RECOVER_IMEX_DOMAIN,
    "bus reset": RecoveryAction.BUS_RESET,
    "system reboot": RecoveryAction.SYSTEM_REBOOT,
    **{action.name.lower(): action for action in RecoveryAction},
}
# An action this exporter does not know is kept as the driver wrote it, this long at most.
_MOST_ACTION_CHARS = 64

# Absolute thresholds only: the T.Limit forms (gpu_temp_*_tlimit_threshold, "-7 C") are
# offsets from the limit, not temperatures.
_THRESHOLDS = tuple((name, tag, f"temperature/{tag}") for name, tag in (
    ("shutdown", "gpu_temp_max_threshold"),
    ("slowdown", "gpu_temp_slow_threshold"),
    ("max_operating", "gpu_temp_max_gpu_threshold"),
    ("memory_max_operating", "gpu_temp_max_mem_threshold"),
    ("target", "gpu_target_temperature"),
))
# The counters' own names where they differ from the reasons' (575+ writes "therm", "brake").
_COUNTER_ALIASES = {
    "sw_thermal_slowdown": "sw_therm_slowdown",
    "hw_thermal_slowdown": "hw_therm_slowdown",
    "hw_power_brake_slowdown": "hw_power_brake",
}
_COUNTER_TAGS = tuple(
    (reason, tuple((tag, f"clocks_event_reasons_counters/{tag}") for tag in (
        f"clocks_event_reasons_counters_{name}" for name in (_COUNTER_ALIASES.get(reason), reason) if name)))
    for reason in CLOCK_EVENT_REASONS
)
_CLOCK_TAGS = {section: tuple((clock, tag, f"{section}/{tag}") for clock, tag in (
    ("graphics", "graphics_clock"), ("sm", "sm_clock"), ("memory", "mem_clock"), ("video", "video_clock")))
    for section in ("clocks", "max_clocks")}
# Each limit by its gpu_power_readings name (535+), then its power_readings one (<=525).
_LIMIT_NAMES = (
    ("current_power_limit", "enforced_power_limit"),
    ("requested_power_limit", "power_limit"),
    ("default_power_limit",),
    ("min_power_limit",),
    ("max_power_limit",),
)
_LIMIT_TAGS = {section: tuple((limit, tuple((tag, f"{section}/{tag}") for tag in tags))
                              for limit, tags in zip(POWER_LIMITS, _LIMIT_NAMES, strict=True))
               for section in ("gpu_power_readings", "power_readings")}
# Turing and later: by memory and type. 570+ splits sram_uncorrectable into parity and SEC-DED.
_SRAM_DRAM = (
    ("sram", "correctable", "sram_correctable"),
    ("sram", "uncorrectable", "sram_uncorrectable"),
    ("dram", "correctable", "dram_correctable"),
    ("dram", "uncorrectable", "dram_uncorrectable"),
)
_SRAM_PARTS = ("sram_uncorrectable_parity", "sram_uncorrectable_secded")
# Older cards: by location; their own "total" is never one (a sum is the total).
_LOCATIONS = ("device_memory", "register_file", "l1_cache", "l2_cache", "texture_memory", "texture_shm", "cbu")
_BITS = (("single_bit", "correctable"), ("double_bit", "uncorrectable"))
_MIG_SCOPES = (("volatile_count", "volatile"), ("aggregate_count", "aggregate"))
# Each count's path by the block that holds it, spelled out once (for a problem line).
_PATHS = {prefix: {tag: f"{prefix}/{tag}" for tag in (*(t for _, _, t in _SRAM_DRAM), *_SRAM_PARTS, *_LOCATIONS,
                                                        "sram_threshold_exceeded")}
          for prefix in (*(f"ecc_errors/{scope}{bit}" for scope in ("volatile", "aggregate")
                           for bit in ("", "/single_bit", "/double_bit")),
                         *(f"mig_device/ecc_error_count/{tag}" for tag, _ in _MIG_SCOPES))}
_REPAIRS = (("channel", "channel_repair_pending"), ("tpc", "tpc_repair_pending"))
# The PCIe link (pci/pci_gpu_link_info), as nvmlDeviceGetCurrPcieLinkGeneration/Width and
# nvmlDeviceGetMaxPcieLinkGeneration/Width give it. max_link_gen is the most this card and its
# host allow together, not the card's own: 535+ writes the two apart as max_device_link_gen and
# max_host_link_gen, and the RTX PRO 6000 capture shows 5 and 4 beside a max_link_gen of 4.
# NVML's docs say the same of the width; yet the laptop captures (RTX 3060 Laptop, RTX A5000
# Laptop, chips wired x8) write 8x of 16x. Widths are written "16x"; N/A on a vGPU guest.
_LINK = "pci/pci_gpu_link_info"
_LINK_TAGS = (
    ("pcie_gen/current_link_gen", ""),
    ("pcie_gen/max_link_gen", ""),
    ("link_widths/current_link_width", "x"),
    ("link_widths/max_link_width", "x"),
)


def read_health(card: Lookup, values: Values) -> CardHealth:
    """The health a ``<gpu>`` reports; what it does not report is left ``None`` (or empty)."""
    temperature = _texts(card.find("temperature"))
    ecc_mode = _texts(card.find("ecc_mode"))
    ecc = _ecc(card.find("ecc_errors"), values)
    rows = _remapped_rows(card.find("remapped_rows"), values)
    retired = _retired_pages(card.find("retired_pages"), values)
    action, unknown_action = _recovery_action(card, values)
    link = _pcie_link(card.find(_LINK), values)
    return CardHealth(
        memory_temperature_celsius=values.number_of(temperature.get("memory_temp"), "temperature/memory_temp", "c"),
        temperature_thresholds_celsius=_thresholds(temperature, values),
        temperature_margin_celsius=values.number_of(temperature.get("gpu_temp_tlimit"), "temperature/gpu_temp_tlimit",
                                                    "c"),
        clock_events_active=_clock_events(card, values),
        clock_event_seconds=_clock_event_seconds(card.find("clocks_event_reasons_counters"), values),
        performance_state=values.choice(_text(card.find("performance_state")), "performance_state", _PSTATES),
        clocks=(*_clocks(card, "clocks", "current", values), *_clocks(card, "max_clocks", "max", values)),
        fan_speed_ratio=_ratio(values.number_of(_text(card.find("fan_speed")), "fan_speed", "%")),
        power_limits_watts=_power_limits(card, values),
        ecc_mode_current=values.choice(ecc_mode.get("current_ecc"), "ecc_mode/current_ecc", _ENABLED),
        ecc_mode_pending=values.choice(ecc_mode.get("pending_ecc"), "ecc_mode/pending_ecc", _ENABLED),
        ecc_errors=ecc.counts,
        ecc_sram_threshold_exceeded=ecc.sram_threshold_exceeded,
        ecc_unreadable=ecc.unreadable,
        remapped_rows_correctable=rows.correctable,
        remapped_rows_uncorrectable=rows.uncorrectable,
        row_remap_pending=rows.pending,
        row_remap_failure=rows.failure,
        row_remap_availability_banks=rows.banks,
        retired_pages_single_bit=retired.single_bit,
        retired_pages_double_bit=retired.double_bit,
        retired_pages_pending=retired.pending,
        repair_pending=ecc.repair_pending,
        recovery_action=action,
        recovery_action_unknown=unknown_action,
        unrepairable_memory=ecc.unrepairable_memory,
        pcie_replays=values.count_of(_text(card.find("pci/replay_counter")), "pci/replay_counter"),
        pcie_link_generation_current=link[0],
        pcie_link_generation_max=link[1],
        pcie_link_width_current=link[2],
        pcie_link_width_max=link[3],
    )


def instance_ecc(counts: Mapping[str, Mapping[str, str | None]], values: Values) -> tuple[EccCount, ...]:
    """A MIG device's own ECC counts: ``counts`` holds each block of its ``<ecc_error_count>``
    (``volatile_count``, ``aggregate_count``) as its leaves' untrimmed texts by tag."""
    if not counts:
        return ()
    found: list[EccCount] = []
    for tag, scope in _MIG_SCOPES:
        leaves = counts.get(tag)
        if leaves:
            # An instance's unreadable count is a problem line only: Device has no mark for it.
            found += _sram_dram(leaves, scope, f"mig_device/ecc_error_count/{tag}", values, [])
    return tuple(found)


def instance_ecc_blocks(block: etree._Element | None) -> dict[str, dict[str, str | None]]:
    """An ``<ecc_error_count>`` element as ``instance_ecc`` takes it: the first block of each
    tag, and in it the first leaf of each tag (as ``find`` gives)."""
    counts: dict[str, dict[str, str | None]] = {}
    if block is not None:
        for count in block:
            tag = cast(str, count.tag)
            if tag not in counts:
                counts[tag] = _texts(count)
    return counts


def _thresholds(temperature: Mapping[str, str | None], values: Values) -> tuple[tuple[str, float], ...]:
    found = []
    for name, tag, path in _THRESHOLDS:
        celsius = values.number_of(temperature.get(tag), path, "c")
        if celsius is not None:
            found.append((name, celsius))
    return tuple(found)


def _clock_events(card: Lookup, values: Values) -> tuple[tuple[str, bool], ...]:
    """Active/Not Active by reason: ``clocks_event_reasons`` (535+), else the older
    ``clocks_throttle_reasons``; a reason the driver does not know (v7's ``unknown``) is left out."""
    block = card.find("clocks_event_reasons")
    section, prefix = "clocks_event_reasons", "clocks_event_reason_"
    if block is None:
        block = card.find("clocks_throttle_reasons")
        section, prefix = "clocks_throttle_reasons", "clocks_throttle_reason_"
    texts = _texts(block)
    if not texts:
        return ()
    found = []
    for reason in CLOCK_EVENT_REASONS:
        tag = prefix + reason
        active = values.choice(texts.get(tag), f"{section}/{tag}", _ACTIVE)
        if active is not None:
            found.append((reason, active))
    return tuple(found)


def _clock_event_seconds(block: etree._Element | None, values: Values) -> tuple[tuple[str, float], ...]:
    """The time held down by each reason since the driver loaded (575+), in microseconds."""
    texts = _texts(block)
    if not texts:
        return ()
    found = []
    for reason, tags in _COUNTER_TAGS:
        for tag, path in tags:
            micro = values.number_of(texts.get(tag), path, "us")
            if micro is not None:
                found.append((reason, micro / 1_000_000))
                break
    return tuple(found)


def _clocks(card: Lookup, section: str, kind: str, values: Values) -> list[ClockReading]:
    texts = _texts(card.find(section))
    found = []
    for clock, tag, path in _CLOCK_TAGS[section]:
        mhz = values.number_of(texts.get(tag), path, "mhz")
        if mhz is not None and math.isfinite(hertz := mhz * 1_000_000):
            found.append(ClockReading(clock, kind, hertz))
    return found


def _power_limits(card: Lookup, values: Values) -> tuple[tuple[str, float], ...]:
    section = "gpu_power_readings"
    block = card.find(section)
    if block is None:
        section = "power_readings"
        block = card.find(section)
    texts = _texts(block)
    found = []
    for limit, tags in _LIMIT_TAGS[section]:
        for tag, path in tags:
            watts = values.number_of(texts.get(tag), path, "w")
            if watts is not None:
                found.append((limit, watts))
                break
    return tuple(found)


class _Ecc(NamedTuple):
    counts: tuple[EccCount, ...] = ()
    sram_threshold_exceeded: bool | None = None
    repair_pending: tuple[tuple[str, bool], ...] = ()
    unrepairable_memory: bool | None = None
    unreadable: bool = False


def _ecc(block: etree._Element | None, values: Values) -> _Ecc:
    """``ecc_errors``: its counts by scope, 570+'s SRAM threshold flag, 590+'s pending repairs
    and 590+'s ``unrepairable_memory`` (Yes/No, as the repairs; NVML's
    nvmlDeviceGetUnrepairableMemoryFlag_v1; N/A on a card without it)."""
    if block is None:
        return _Ecc()
    parts = _children(block)
    counts: list[EccCount] = []
    unreadable: list[str] = []
    threshold = None
    for scope in ("volatile", "aggregate"):
        el = parts.get(scope)
        if el is None:
            continue
        leaves = _children(el)
        texts = {tag: leaf.text for tag, leaf in leaves.items()}
        prefix = f"ecc_errors/{scope}"
        counts += _sram_dram(texts, scope, prefix, values, unreadable)
        counts += _locations(leaves, scope, values, unreadable)
        if threshold is None:
            threshold = values.choice(texts.get("sram_threshold_exceeded"), _PATHS[prefix]["sram_threshold_exceeded"],
                                      _YES)
    repairs = []
    for unit, tag in _REPAIRS:
        el = parts.get(tag)
        pending = None if el is None else values.choice(el.text, f"ecc_errors/{tag}", _YES)
        if pending is not None:
            repairs.append((unit, pending))
    unrepairable = _text(parts.get("unrepairable_memory"))
    return _Ecc(tuple(counts), threshold, tuple(repairs),
                values.choice(unrepairable, "ecc_errors/unrepairable_memory", _YES), bool(unreadable))


def _count(values: Values, raw: str | None, path: str, unreadable: list[str]) -> int | None:
    """An ECC count; one written but not readable as a count (10^30, 5000 digits, "12abc")
    goes on ``unreadable``, so that the card fails closed (grade's ``ecc_unreadable``)
    where leaving it out would read as no errors. N/A and absent are not unreadable."""
    count = values.count_of(raw, path)
    if count is None and values.known_text(raw):
        unreadable.append(path)
    return count


def _sram_dram(texts: Mapping[str, str | None], scope: str, prefix: str, values: Values,
               unreadable: list[str]) -> list[EccCount]:
    found = []
    paths = _PATHS[prefix]
    for memory, kind, tag in _SRAM_DRAM:
        errors = _count(values, texts.get(tag), paths[tag], unreadable)
        if errors is None and tag == "sram_uncorrectable" and (_SRAM_PARTS[0] in texts or _SRAM_PARTS[1] in texts):
            # 570+: the parts where the whole gives no count (either part may be N/A alone).
            parts = [_count(values, texts.get(part), paths[part], unreadable) for part in _SRAM_PARTS]
            known = [n for n in parts if n is not None]
            errors = sum(known) if known else None
        if errors is not None:
            found.append(EccCount(scope, memory, kind, errors))
    return found


def _locations(leaves: Mapping[str, etree._Element], scope: str, values: Values,
               unreadable: list[str]) -> list[EccCount]:
    """Pre-Turing cards: ``single_bit``/``double_bit`` by location."""
    found = []
    for bit, kind in _BITS:
        el = leaves.get(bit)
        if el is None:
            continue
        texts = _texts(el)
        paths = _PATHS[f"ecc_errors/{scope}/{bit}"]
        for location in _LOCATIONS:
            errors = _count(values, texts.get(location), paths[location], unreadable)
            if errors is not None:
                found.append(EccCount(scope, location, kind, errors))
    return found


class _Rows(NamedTuple):
    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None
    banks: tuple[tuple[str, int], ...] = ()


def _remapped_rows(block: etree._Element | None, values: Values) -> _Rows:
    """Ampere and later; ``N/A`` (no children) on the others, and on a card in MIG mode."""
    if block is None or len(block) == 0:
        return _Rows()
    parts = _children(block)
    texts = {tag: el.text for tag, el in parts.items()}
    histogram = _texts(parts.get("row_remapper_histogram"))
    banks = []
    for name in REMAP_AVAILABILITY:
        tag = f"row_remapper_histogram_{name}"
        count = values.count_of(histogram.get(tag), f"remapped_rows/row_remapper_histogram/{tag}", "bank(s)")
        if count is not None:
            banks.append((name, count))
    return _Rows(
        values.count_of(texts.get("remapped_row_corr"), "remapped_rows/remapped_row_corr"),
        values.count_of(texts.get("remapped_row_unc"), "remapped_rows/remapped_row_unc"),
        values.choice(texts.get("remapped_row_pending"), "remapped_rows/remapped_row_pending", _YES),
        values.choice(texts.get("remapped_row_failure"), "remapped_rows/remapped_row_failure", _YES),
        tuple(banks),
    )


class _Retired(NamedTuple):
    single_bit: int | None = None
    double_bit: int | None = None
    pending: bool | None = None


def _retired_pages(block: etree._Element | None, values: Values) -> _Retired:
    """Pre-Ampere page retirement: the counts (v9 and v10+ alike) and the pending flag,
    ``pending_retirement`` or, where only it is written, the older ``pending_blacklist``."""
    if block is None:
        return _Retired()
    parts = _children(block)
    counts = []
    for tag in ("multiple_single_bit_retirement", "double_bit_retirement"):
        raw = _texts(parts.get(tag)).get("retired_count")
        counts.append(values.count_of(raw, f"retired_pages/{tag}/retired_count"))
    flag = "pending_retirement" if "pending_retirement" in parts else "pending_blacklist"
    pending = values.choice(_text(parts.get(flag)), f"retired_pages/{flag}", _YES)
    return _Retired(counts[0], counts[1], pending)


def _recovery_action(card: Lookup, values: Values) -> tuple[int | None, str | None]:
    """The action and, where nvidia-smi wrote one this exporter does not know, its text:
    ``gpu_recovery_action`` (570+), else what ``gpu_reset_status`` says: a reset required
    (GPU reset), a drain and reset recommended (drain and reset), neither (none)."""
    action = card.find("gpu_recovery_action")
    if action is not None:
        raw = (action.text or "").strip()
        # N/A, Not Supported, deprecated, an error: no advice read. A bare "Unknown" is advice
        # (an action without a word in this nvidia-smi), not understood.
        text = raw if raw.lower() == "unknown" else values.known_text(raw)
        if text is None:
            return None, None
        known = _RECOVERY.get(text.lower())
        if known is None:
            return None, " ".join(text.split())[:_MOST_ACTION_CHARS]
        return int(known), None
    status = _texts(card.find("gpu_reset_status"))
    reset = values.choice(status.get("reset_required"), "gpu_reset_status/reset_required", _YES)
    drain = values.choice(status.get("drain_and_reset_recommended"),
                          "gpu_reset_status/drain_and_reset_recommended", _YES)
    if drain:
        return int(RecoveryAction.DRAIN_AND_RESET), None
    if reset:
        return int(RecoveryAction.GPU_RESET), None
    # A "No" beside a flag the card does not have (N/A, deprecated) still says no action.
    return (int(RecoveryAction.NONE) if False in (reset, drain) else None), None


def _pcie_link(block: etree._Element | None, values: Values) -> tuple[int | None, ...]:
    """Generation now and at most, then width now and at most (``None`` where N/A)."""
    if block is None:
        return (None,) * len(_LINK_TAGS)
    return tuple(values.count_of(_text(block.find(tag)), f"{_LINK}/{tag}", unit) for tag, unit in _LINK_TAGS)


def _children(el: etree._Element) -> dict[str, etree._Element]:
    """Each child by tag, in one pass; the first of a repeated tag, as ``find`` gives."""
    found: dict[str, etree._Element] = {}
    for child in el:
        tag = cast(str, child.tag)  # a parsed tree's tags are str (comments are removed)
        if tag not in found:
            found[tag] = child
    return found


def _texts(el: etree._Element | None) -> dict[str, str | None]:
    """Each child's untrimmed text by tag, in one pass; the first of a repeated tag (reversed:
    a dict keeps the last it is given)."""
    if el is None:
        return {}
    # (No cast per child: a parsed tree's tags are str, and this runs some fifty times a card.)
    return cast("dict[str, str | None]", dict(reversed([(child.tag, child.text) for child in el])))


def _text(el: etree._Element | None) -> str | None:
    return None if el is None else el.text


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0

