"""A card's health as read: heat, power and wear, and the rules that grade it.

Heat, power and wear are the card's, never a MIG instance's: a card in MIG mode
reports them once, on the card, and an instance joins it through ``card``. The
one exception is what the driver itself gives per instance: an instance's own
ECC error counts (``InstanceEcc``, on ``MigInstance`` and ``Device``).

Units are in the field names; ``None`` (or an empty tuple) means the driver did
not say, and is never read as zero. Both read paths (nvidia-smi's XML and NVML)
fill the same fields; docs/metrics.md says where each comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

# The reasons clocks are held down, by the names of clock_event_active (nvidia-smi's
# clocks_event_reason_* / clocks_throttle_reason_* suffixes).
CLOCK_EVENT_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "display_clocks_setting",
)
TEMPERATURE_THRESHOLDS = ("shutdown", "slowdown", "max_operating", "memory_max_operating", "target")
POWER_LIMITS = ("current", "requested", "default", "min", "max")
CLOCKS = ("graphics", "sm", "memory", "video")
REMAP_AVAILABILITY = ("max", "high", "partial", "low", "none")
REPAIR_UNITS = ("channel", "tpc")


class RecoveryAction(IntEnum):
    """NVML's nvmlDeviceGpuRecoveryAction_t: what the driver advises doing to the card."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


class EccCount(NamedTuple):
    """One ECC error counter: ``scope`` volatile (since the driver loaded) or aggregate
    (the card's life); ``memory`` sram/dram (Turing and later) or the older cards' location
    (device_memory, register_file, l1_cache, ...); ``type`` correctable/uncorrectable."""

    scope: str
    memory: str
    type: str
    errors: int


class ClockReading(NamedTuple):
    clock: str  # graphics, sm, memory, video
    kind: str  # current, max
    hertz: float


@dataclass(frozen=True, slots=True)
class CardHealth:
    """Heat, power and wear of one card, as read. Pairs are ``(name, value)``, in the
    order of the name tuples above; a name the driver did not give is left out."""

    memory_temperature_celsius: float | None = None
    temperature_thresholds_celsius: tuple[tuple[str, float], ...] = ()
    temperature_margin_celsius: float | None = None
    clock_events_active: tuple[tuple[str, bool], ...] = ()
    clock_event_seconds: tuple[tuple[str, float], ...] = ()
    performance_state: int | None = None
    clocks: tuple[ClockReading, ...] = ()
    fan_speed_ratio: float | None = None
    power_limits_watts: tuple[tuple[str, float], ...] = ()
    energy_joules: float | None = None
    ecc_mode_current: bool | None = None
    ecc_mode_pending: bool | None = None
    ecc_errors: tuple[EccCount, ...] = ()
    ecc_sram_threshold_exceeded: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    row_remap_availability_banks: tuple[tuple[str, int], ...] = ()
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    repair_pending: tuple[tuple[str, bool], ...] = ()
    recovery_action: int | None = None
    pcie_replays: int | None = None

    def active(self, reason: str) -> bool:
        return dict(self.clock_events_active).get(reason, False)

    def threshold(self, name: str) -> float | None:
        return dict(self.temperature_thresholds_celsius).get(name)


NO_HEALTH = CardHealth()

# The card_health states, best to worst; the family has one series per state.
HEALTH_STATES = ("ok", "warning", "reset", "replace")
# Clock events that mean the card is protecting itself, not obeying a setting or idling.
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")
# A margin under this to the thermal limit (T.Limit) is a warning (the alert's threshold too).
MARGIN_WARNING_CELSIUS = 5.0
# Recovery actions that need the card (or more) reset before work can go on: a reset mark.
_RESET_ACTIONS = {
    RecoveryAction.GPU_RESET: "the driver advises a GPU reset",
    RecoveryAction.NODE_REBOOT: "the driver advises a node reboot",
    RecoveryAction.DRAIN_AND_RESET: "the driver advises draining the card and resetting it",
    RecoveryAction.BUS_RESET: "the driver advises a bus reset",
    RecoveryAction.SYSTEM_REBOOT: "the driver advises a system reboot",
}
_WARNING_ACTIONS = {
    RecoveryAction.DRAIN_P2P: "the driver advises draining peer-to-peer traffic",
    RecoveryAction.RECOVER_IMEX_DOMAIN: "the driver advises recovering the IMEX domain",
}


class Verdict(NamedTuple):
    """A card's grade: its worst state and every reason for a state above ok."""

    state: str
    reasons: tuple[str, ...]

    @property
    def label(self) -> str:
        """What a person reads: "ok", "warning", "needs reset", "replace"."""
        return {"reset": "needs reset", "replace": "replace"}.get(self.state, self.state)


def grade(health: CardHealth, instance_uncorrectable: int = 0) -> Verdict:
    """The card's worst state and why, by the rules docs/metrics.md lists under
    ``mig_exporter_card_health``. ``instance_uncorrectable``: volatile uncorrectable ECC
    errors its MIG instances report on their own, counted where the card gives no volatile
    uncorrectable count of its own (which holds theirs)."""
    found: dict[str, list[str]] = {state: [] for state in HEALTH_STATES}
    if health.row_remap_failure:
        found["replace"].append("row remapping failed: the card has no spare rows left for a failing bank")
    if health.row_remap_pending:
        found["reset"].append("a row remap is pending: reset the card to apply it")
    if health.retired_pages_pending:
        found["reset"].append("a page retirement is pending: reset the card to apply it")
    for unit, pending in health.repair_pending:
        if pending:
            found["reset"].append(f"a {unit} repair is pending: reset the card to apply it")
    action = health.recovery_action
    if action is not None and action in _RESET_ACTIONS:
        found["reset"].append(_RESET_ACTIONS[RecoveryAction(action)])
    elif action is not None and action in _WARNING_ACTIONS:
        found["warning"].append(_WARNING_ACTIONS[RecoveryAction(action)])
    # The card's own count holds its instances' errors; theirs stand in where it gives none.
    card_counts = [e.errors for e in health.ecc_errors if e.scope == "volatile" and e.type == "uncorrectable"]
    uncorrectable = sum(card_counts) if card_counts else instance_uncorrectable
    if uncorrectable:
        found["warning"].append(f"{uncorrectable} uncorrectable ECC error(s) since the driver loaded")
    if health.ecc_sram_threshold_exceeded:
        found["warning"].append("SRAM errors passed the driver's threshold")
    for reason in SLOWDOWN_REASONS:
        if health.active(reason):
            found["warning"].append(f"clocks held down: {reason.replace('_', ' ')}")
    margin = health.temperature_margin_celsius
    if margin is not None and margin < MARGIN_WARNING_CELSIUS:
        found["warning"].append(f"{margin:g} °C from its thermal limit")
    if dict(health.row_remap_availability_banks).get("none", 0) > 0:
        found["warning"].append("a memory bank has no spare rows left to remap")
    worst = next((state for state in reversed(HEALTH_STATES) if found[state]), "ok")
    reasons = tuple(r for state in reversed(HEALTH_STATES) for r in found[state])
    return Verdict(worst, reasons)


def instance_uncorrectable(errors: tuple[EccCount, ...]) -> int:
    """Volatile uncorrectable errors among a MIG instance's own counts."""
    return sum(e.errors for e in errors if e.scope == "volatile" and e.type == "uncorrectable")


class XidSeen(NamedTuple):
    """An XID error code seen on a card since the exporter started: ``index`` is the MIG
    instance's placement index when the event named its GPU and compute instance, else the
    card's; ``last_seconds`` when it was last seen, seconds since the epoch."""

    card: int
    device_index: int
    xid: int
    seen: int  # how many times
    last_seconds: float
