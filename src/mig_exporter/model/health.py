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
    # An ECC count the driver wrote that could not be read as one (10^30, 5000 digits): left
    # out of ecc_errors, and never read as no errors (grade: ecc_unreadable).
    ecc_unreadable: bool = False
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
    # The driver's advice as it gave it where this exporter does not know it (an unrecognised
    # string in the XML; a number NVML's header for the driver in use does not define).
    recovery_action_unknown: str | None = None
    # Memory the card can no longer repair (590+: nvidia-smi's unrepairable_memory, NVML's
    # nvmlDeviceGetUnrepairableMemoryFlag_v1): the card needs replacing.
    unrepairable_memory: bool | None = None
    pcie_replays: int | None = None
    # The PCIe link: generation and width (lanes) now, and the most this card and host allow.
    pcie_link_generation_current: int | None = None
    pcie_link_generation_max: int | None = None
    pcie_link_width_current: int | None = None
    pcie_link_width_max: int | None = None

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
# A link at a quarter of its lanes or fewer is degraded (the x1-of-x16 L4 in
# tests/fixtures/nvidia-smi-real/). Half is not: the real captures show healthy cards wired x8 in
# an x16 slot's place (T4, A10G, laptop GPUs), and NVML's maximum is the card's, not the slot's.
# GPUPCIeLinkDegraded also fires on a link narrower than it ran in the last day.
PCIE_DEGRADED_SHARE = 4
# Recovery actions that need the card (or more) reset before work can go on: a reset mark.
_RESET_ACTIONS = {
    RecoveryAction.GPU_RESET: "the driver advises a GPU reset",
    RecoveryAction.NODE_REBOOT: "the driver advises a node reboot",
    RecoveryAction.DRAIN_AND_RESET: "the driver advises draining the card and resetting it",
    RecoveryAction.BUS_RESET: "the driver advises a bus reset",
    RecoveryAction.SYSTEM_REBOOT: "the driver advises a system reboot",
}
_KNOWN_ACTIONS = frozenset(int(a) for a in RecoveryAction)
UNKNOWN_ACTION = "the driver advises an action this exporter does not know"
_WARNING_ACTIONS = {
    RecoveryAction.DRAIN_P2P: "the driver advises draining peer-to-peer traffic",
    RecoveryAction.RECOVER_IMEX_DOMAIN: "the driver advises recovering the IMEX domain",
}


class Verdict(NamedTuple):
    """A card's grade: its worst state and every reason for a state above ok, worst first;
    ``codes`` names each reason for a label (``mig_exporter_card_health_reason``) and ``states``
    gives each reason's own state, both in the order of ``reasons``."""

    state: str
    reasons: tuple[str, ...]
    codes: tuple[str, ...] = ()
    states: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """What a person reads: "ok", "warning", "needs reset", "replace"."""
        return {"reset": "needs reset", "replace": "replace"}.get(self.state, self.state)


def grade(health: CardHealth, instance_uncorrectable: int = 0, temperature_celsius: float | None = None) -> Verdict:
    """The card's worst state and why, by the rules docs/metrics.md lists under
    ``mig_exporter_card_health``. ``instance_uncorrectable``: volatile uncorrectable ECC
    errors its MIG instances report on their own, counted where the card gives no volatile
    uncorrectable count of its own (which holds theirs). ``temperature_celsius``: the core's
    temperature (``CardReading.temperature_celsius``), held against the card's own
    thresholds."""
    found: dict[str, list[tuple[str, str]]] = {state: [] for state in HEALTH_STATES}

    def add(state: str, code: str, text: str) -> None:
        found[state].append((code, text))

    if health.row_remap_failure:
        add("replace", "row_remap_failure", "row remapping failed: the card has no spare rows left for a failing bank")
    if health.unrepairable_memory:
        add("replace", "unrepairable_memory", "the driver reports memory it cannot repair")
    if health.row_remap_pending:
        add("reset", "row_remap_pending", "a row remap is pending: reset the card to apply it")
    if health.retired_pages_pending:
        add("reset", "retired_pages_pending", "a page retirement is pending: reset the card to apply it")
    for unit, pending in health.repair_pending:
        if pending:
            add("reset", f"{unit}_repair_pending", f"a {unit} repair is pending: reset the card to apply it")
    action = health.recovery_action
    if action is not None and action in _RESET_ACTIONS:
        add("reset", "recovery_action", _RESET_ACTIONS[RecoveryAction(action)])
    elif action is not None and action in _WARNING_ACTIONS:
        add("warning", "recovery_action", _WARNING_ACTIONS[RecoveryAction(action)])
    elif health.recovery_action_unknown is not None or (action is not None and action not in _KNOWN_ACTIONS):
        # Never ok: an advice not understood may be a reset or a reboot (NVML's enum grew twice).
        add("warning", "recovery_action_unknown", UNKNOWN_ACTION)
    # The card's own count holds its instances' errors; theirs stand in where it gives none.
    card_counts = [e.errors for e in health.ecc_errors if e.scope == "volatile" and e.type == "uncorrectable"]
    uncorrectable = sum(card_counts) if card_counts else instance_uncorrectable
    if uncorrectable:
        add("warning", "ecc_uncorrectable", f"{uncorrectable} uncorrectable ECC error(s) since the driver loaded")
    if health.ecc_unreadable:
        # Fails closed: a count too large to read may be a card full of errors.
        add("warning", "ecc_unreadable", "an ECC count could not be read")
    if health.ecc_sram_threshold_exceeded:
        add("warning", "ecc_sram_threshold", "SRAM errors passed the driver's threshold")
    for reason in SLOWDOWN_REASONS:
        if health.active(reason):
            add("warning", reason, f"clocks held down: {reason.replace('_', ' ')}")
    margin = health.temperature_margin_celsius
    if margin is not None and margin < MARGIN_WARNING_CELSIUS:
        add("warning", "temperature_margin", f"{margin:g} °C from its thermal limit")
    past = _past_threshold(health, temperature_celsius)
    if past is not None:
        add("warning", "temperature_over_threshold", past)
    if dict(health.row_remap_availability_banks).get("none", 0) > 0:
        add("warning", "row_remap_exhausted", "a memory bank has no spare rows left to remap")
    width, widest = health.pcie_link_width_current, health.pcie_link_width_max
    if width is not None and widest is not None and 0 < width * PCIE_DEGRADED_SHARE <= widest:
        # Width, never generation: an idle link drops its generation to save power, not its lanes.
        add("warning", "pcie_link_width", f"PCIe link at x{width} of x{widest}")
    worst = next((state for state in reversed(HEALTH_STATES) if found[state]), "ok")
    ordered = [(state, code, text) for state in reversed(HEALTH_STATES) for code, text in found[state]]
    return Verdict(worst, tuple(text for _, _, text in ordered), tuple(code for _, code, _ in ordered),
                   tuple(state for state, _, _ in ordered))


def _past_threshold(health: CardHealth, temperature_celsius: float | None) -> str | None:
    """What a core at or past the card's own shutdown or slowdown threshold reads as, worst
    first; ``None`` below both or where either is unknown. The margin (T.Limit) does not need
    to be read: a card that gives no margin, or a wrong one, is still graded by its
    thresholds."""
    if temperature_celsius is None:
        return None
    for name in ("shutdown", "slowdown"):
        limit = health.threshold(name)
        if limit is not None and temperature_celsius >= limit:
            return f"{temperature_celsius:g} °C, at or past its {limit:g} °C {name} threshold"
    return None


def instance_uncorrectable(errors: tuple[EccCount, ...]) -> int:
    """Volatile uncorrectable errors among a MIG instance's own counts."""
    return sum(e.errors for e in errors if e.scope == "volatile" and e.type == "uncorrectable")


# The XID codes NVIDIA documents: its "Xid Catalog" (model/xids.py's CATALOGUE_VERSION, the
# R575 edition: codes 1-172). A code outside it is counted under xid="other" (XidSeen.xid
# OTHER_XID): a corrupt line or a driver newer than the catalogue must not make one series per
# number. A code a later edition adds reads as "other" until this range is widened with it.
XID_DOCUMENTED = range(1, 173)
OTHER_XID = -1
# Distinct (card, index, xid) series at most; later ones count under xid="other" on their card
# (sources/xid.py's XidBook), so that a storm of codes cannot make the scrape unbounded.
XID_SERIES_CAP = 256


class XidSeen(NamedTuple):
    """An XID error code seen on a card (since boot where the kernel's log is read, else
    since the exporter started: sources/xid.py): ``device_index`` is the MIG instance's
    placement index when the XID named its GPU and compute instance, else the card's;
    ``last_seconds`` when it was last seen, seconds since the epoch. ``last_pid`` is the pid
    the last kernel line named (``None``: unknown, or NVML's event alone), and who that
    process was, as found while it lived (``None`` where not known)."""

    card: int
    device_index: int
    xid: int
    seen: int  # how many times
    last_seconds: float
    last_pid: int | None = None
    process_name: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    slurm_job: str | None = None
    systemd_unit: str | None = None
