"""A card's heat, power and wear through NVML: model/health.py's ``CardHealth``, once per card and
read, and a MIG instance's own ECC count. What each value matches in ``nvidia-smi -q -x``:

- one ``nvmlDeviceGetFieldValues`` call: ``NVML_FI_DEV_MEMORY_TEMP`` (``temperature/memory_temp``),
  ``NVML_FI_DEV_CLOCKS_EVENT_REASON_*`` (ns, the clock-event counters), ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``
  (``gpu_recovery_action``; before 570, ``NVML_FI_DEV_RESET_STATUS`` and ``_DRAIN_AND_RESET_STATUS``,
  ``gpu_reset_status``), ``NVML_FI_DEV_PCIE_REPLAY_COUNTER`` (``pci/replay_counter``) and
  ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (mJ; NVML's alone); without FieldValues, the single calls
  ``GetTotalEnergyConsumption`` and ``GetPcieReplayCounter``;
- ``GetTemperatureThreshold`` (``temperature/gpu_temp_*_threshold``, ``gpu_target_temperature``),
  ``GetMarginTemperature`` (``gpu_temp_tlimit``);
- ``GetCurrentClocksEventReasons`` for each reason ``GetSupportedClocksEventReasons`` gives
  (``clocks_event_reasons``; the ``...ThrottleReasons`` names on an older driver);
- ``GetPerformanceState``, ``GetClockInfo``/``GetMaxClockInfo`` (``clocks``, ``max_clocks``),
  ``GetFanSpeed``, the power limits (``gpu_power_readings/*_power_limit``);
- ``GetEccMode``, ``GetMemoryErrorCounter`` (``ecc_errors``; sram/dram where the SRAM location answers,
  else the older locations), ``GetSramEccErrorStatus`` (570+: parity + SEC-DED, ``sram_threshold_exceeded``);
- ``GetRemappedRows``, ``GetRowRemapperHistogram`` (``remapped_rows``; not asked in MIG mode, where
  NVML does not support them), ``GetRetiredPages_v2`` and ``GetRetiredPagesPendingStatus``
  (``retired_pages``), ``GetRepairStatus`` (590+).

A value the driver does not give, or that fails on its own, is ``None`` (or left out of its tuple),
never 0, and never fails the card; an error that says the card is gone (``GPU_IS_LOST``...) does,
as for every other reading. A card is read at every scrape: a call that answered NOT_SUPPORTED or
FUNCTION_NOT_FOUND is remembered per card (its UUID and MIG mode) until NVML is initialised again,
and not asked again; a card whose health NVML does not give at all costs no calls after its first read.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from mig_exporter.model.health import CLOCK_EVENT_REASONS, CardHealth, ClockReading, EccCount, RecoveryAction
from mig_exporter.sources.nvml_gateway import LASTING_UNSUPPORTED, Nvml, NvmlCallError

# What a card is known by in the memo: its UUID (or index) and its MIG mode, which changes what it supports.
CardKey = tuple[object, "bool | None"]
# Answers after which the next, older variant of a call is asked.
_NEXT_VARIANT = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})


def _constant(*names: str) -> Any:
    """The first of ``names`` the installed pynvml has: NVML's names and ids moved between releases."""
    return next((getattr(pynvml, n) for n in names if hasattr(pynvml, n)), None)


# FieldValues: (what it is, field id); a field this pynvml lacks is not asked.
_FIELDS = tuple((name, fid) for name, fid in (
    ("memory_temperature", _constant("NVML_FI_DEV_MEMORY_TEMP")),
    ("sw_power_cap", _constant("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP")),
    ("sync_boost", _constant("NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST")),
    ("sw_thermal_slowdown", _constant("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN")),
    ("hw_thermal_slowdown", _constant("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN")),
    ("hw_power_brake_slowdown", _constant("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN")),
    ("recovery_action", _constant("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")),
    # Before 570's recovery action, the two flags it replaces (nvidia-smi's gpu_reset_status).
    ("reset_required", _constant("NVML_FI_DEV_RESET_STATUS")),
    ("drain_and_reset", _constant("NVML_FI_DEV_DRAIN_AND_RESET_STATUS")),
    ("pcie_replays", _constant("NVML_FI_DEV_PCIE_REPLAY_COUNTER")),
    ("energy_mj", _constant("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION")),
) if fid is not None)
_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_THRESHOLDS = (
    ("shutdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
    ("slowdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
    ("max_operating", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
    ("memory_max_operating", pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
    ("target", pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_CURR),
)
_REASON_BITS = tuple((name, _constant(f"nvmlClocksEventReason{suffix}", f"nvmlClocksThrottleReason{suffix}"))
                     for name, suffix in zip(CLOCK_EVENT_REASONS, (
                         "GpuIdle", "ApplicationsClocksSetting", "SwPowerCap", "HwSlowdown", "HwThermalSlowdown",
                         "HwPowerBrakeSlowdown", "SyncBoost", "SwThermalSlowdown", "DisplayClockSetting"), strict=True))
_CLOCK_IDS = (("graphics", pynvml.NVML_CLOCK_GRAPHICS), ("sm", pynvml.NVML_CLOCK_SM),
              ("memory", pynvml.NVML_CLOCK_MEM), ("video", pynvml.NVML_CLOCK_VIDEO))
_SCOPES = (("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC))
_TYPES = (("correctable", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
          ("uncorrectable", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
_SRAM = pynvml.NVML_MEMORY_LOCATION_SRAM
_DRAM = pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY  # pynvml's NVML_MEMORY_LOCATION_DRAM is the same location
# Before Turing's SRAM/DRAM split: device_memory (the DRAM location) and the on-chip ones.
_OLDER_LOCATIONS = (
    ("device_memory", _DRAM),
    ("register_file", pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE),
    ("l1_cache", pynvml.NVML_MEMORY_LOCATION_L1_CACHE),
    ("l2_cache", pynvml.NVML_MEMORY_LOCATION_L2_CACHE),
    ("texture_memory", pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY),
    ("texture_shm", pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM),
    ("cbu", pynvml.NVML_MEMORY_LOCATION_CBU),
)
_RETIREMENT_CAUSES = (
    ("single_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
    ("double_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
)


class HealthReader:
    """Reads ``CardHealth`` through one ``Nvml``, remembering per card what it does not support."""

    def __init__(self, nv: Nvml) -> None:
        self._nv = nv
        self._generation = -1
        self._memos: dict[CardKey, dict[tuple[object, ...], int]] = {}
        self._fixed: dict[CardKey, dict[tuple[object, ...], Any]] = {}

    def _same_driver(self) -> None:
        if self._generation != self._nv.generation:  # a new initialisation may be a new driver
            self._generation, self._memos, self._fixed = self._nv.generation, {}, {}

    def _memo(self, card: CardKey) -> dict[tuple[object, ...], int]:
        self._same_driver()
        return self._memos.setdefault(card, {})

    def _ask_fixed(self, card: CardKey, names: str | tuple[str, ...], handle: Any, *args: Any) -> Any:
        """``_ask`` for a value the card keeps while the driver is loaded (its maximum clocks, its
        thresholds, the limits it allows): asked until it answers, then kept. A third of the
        health calls per card, each about 12 µs through ctypes."""
        self._same_driver()
        kept = self._fixed.setdefault(card, {})
        key = (names, *args)
        if key not in kept:
            value = self._ask(card, names, handle, *args)
            if value is None:
                return None
            kept[key] = value
        return kept[key]

    def _ask(self, card: CardKey, names: str | tuple[str, ...], handle: Any, *args: Any,
             key: tuple[object, ...] | None = None) -> Any:
        """The first of ``names`` (pynvml functions, newest first) the driver has, called with
        ``handle, *args``; ``None`` where it does not answer. Raises only where the card is gone."""
        memo = self._memo(card)
        for name in (names,) if isinstance(names, str) else names:
            function = getattr(pynvml, name, None)
            known = (name, *args) if key is None else (name, *key)
            code = memo.get(known) if function is not None else pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
            if code is None:
                try:
                    return self._nv.call(function, handle, *args)  # type: ignore[arg-type]
                except NvmlCallError as e:
                    if e.card_gone:
                        raise
                    code = e.code
                    if code in LASTING_UNSUPPORTED:
                        memo[known] = code
            if code not in _NEXT_VARIANT:
                return None
        return None

    def temperature(self, card: CardKey, handle: Any) -> float | None:
        """The core's temperature, through ``GetTemperatureV`` where the driver has it (the
        unversioned call is deprecated)."""
        value = self._ask(card, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle,
                          pynvml.NVML_TEMPERATURE_GPU)
        return None if value is None else float(value)

    def instance_ecc(self, card: CardKey, mig_handle: Any) -> tuple[EccCount, ...]:
        """A MIG instance's own volatile uncorrectable SRAM errors (nvidia-smi's
        ``mig_device/ecc_error_count/volatile_count/sram_uncorrectable``)."""
        count = self._ask(card, "nvmlDeviceGetMemoryErrorCounter", mig_handle,
                          pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, _SRAM)
        return () if count is None else (EccCount("volatile", "sram", "uncorrectable", int(count)),)

    def card(self, card: CardKey, handle: Any, mig_current: bool | None) -> CardHealth:
        """One card's health; ``mig_current`` leaves out what NVML does not support in MIG mode."""
        fields = self._fields(card, handle)
        energy = fields.get("energy_mj")
        return CardHealth(
            memory_temperature_celsius=_float(fields.get("memory_temperature")),
            clock_event_seconds=tuple((name, fields[name] / 1e9) for name in CLOCK_EVENT_REASONS if name in fields),
            recovery_action=_recovery_action(fields),
            pcie_replays=_int(fields.get("pcie_replays")),
            energy_joules=None if energy is None else energy / 1000.0,
            **self._heat(card, handle),
            **self._power(card, handle),
            **self._ecc(card, handle),
            **self._wear(card, handle, mig_current),
        )

    def _fields(self, card: CardKey, handle: Any) -> dict[str, float]:
        """The FieldValues readings by name, in one call for every field not known unsupported."""
        memo = self._memo(card)
        wanted = [(name, fid) for name, fid in _FIELDS if ("field", fid) not in memo]
        if not wanted:
            return {}
        values = self._ask(card, "nvmlDeviceGetFieldValues", handle, [fid for _, fid in wanted],
                           key=("all",))
        if values is None:  # no FieldValues here: the single calls that give the same
            found = {"energy_mj": self._ask(card, "nvmlDeviceGetTotalEnergyConsumption", handle),
                     "pcie_replays": self._ask(card, "nvmlDeviceGetPcieReplayCounter", handle)}
            return {name: value for name, value in found.items() if value is not None}
        found = {}
        for (name, fid), entry in zip(wanted, values, strict=True):
            code = entry.nvmlReturn
            if code == pynvml.NVML_SUCCESS:
                member = _VALUE_MEMBERS.get(entry.valueType)
                if member is not None:
                    found[name] = getattr(entry.value, member)
            elif code in LASTING_UNSUPPORTED:
                memo[("field", fid)] = code
            else:
                try:  # one field failing alone is that value unknown; a gone card is the card's
                    self._nv.check("nvmlDeviceGetFieldValues", code)
                except NvmlCallError as e:
                    if e.card_gone:
                        raise
        return found

    def _heat(self, card: CardKey, handle: Any) -> dict[str, Any]:
        ask = self._ask
        # The target temperature can be set (nvidia-smi -gtt): asked each time; the others are the card's.
        thresholds = [(name, (ask if name == "target" else self._ask_fixed)(
            card, "nvmlDeviceGetTemperatureThreshold", handle, t)) for name, t in _THRESHOLDS]
        active = ask(card, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
                     handle)
        supported = self._ask_fixed(card, ("nvmlDeviceGetSupportedClocksEventReasons",
                                           "nvmlDeviceGetSupportedClocksThrottleReasons"), handle)
        events: tuple[tuple[str, bool], ...] = ()
        if active is not None:
            # Without the supported mask (an older driver), every reason it names is reported.
            events = tuple((name, bool(active & bit)) for name, bit in _REASON_BITS
                           if bit is not None and (supported is None or supported & bit))
        pstate = ask(card, "nvmlDeviceGetPerformanceState", handle)
        fan = ask(card, "nvmlDeviceGetFanSpeed", handle)
        return dict(
            temperature_thresholds_celsius=tuple((name, float(v)) for name, v in thresholds if v is not None),
            temperature_margin_celsius=_float(ask(card, "nvmlDeviceGetMarginTemperature", handle)),
            clock_events_active=events,
            performance_state=None if pstate in (None, pynvml.NVML_PSTATE_UNKNOWN) else int(pstate),
            fan_speed_ratio=None if fan is None else fan / 100.0,
        )

    def _power(self, card: CardKey, handle: Any) -> dict[str, Any]:
        ask = self._ask
        clocks = []
        fixed = self._ask_fixed
        for kind, function, asking in (("current", "nvmlDeviceGetClockInfo", ask),
                                       ("max", "nvmlDeviceGetMaxClockInfo", fixed)):
            for clock, clock_id in _CLOCK_IDS:
                mhz = asking(card, function, handle, clock_id)
                if mhz is not None:
                    clocks.append(ClockReading(clock, kind, mhz * 1e6))
        constraints = fixed(card, "nvmlDeviceGetPowerManagementLimitConstraints", handle) or (None, None)
        limits = (("current", ask(card, "nvmlDeviceGetEnforcedPowerLimit", handle)),
                  ("requested", ask(card, "nvmlDeviceGetPowerManagementLimit", handle)),
                  ("default", fixed(card, "nvmlDeviceGetPowerManagementDefaultLimit", handle)),
                  ("min", constraints[0]), ("max", constraints[1]))
        return dict(clocks=tuple(clocks),
                    power_limits_watts=tuple((name, mw / 1000.0) for name, mw in limits if mw is not None))

    def _ecc(self, card: CardKey, handle: Any) -> dict[str, Any]:
        mode = self._ask(card, "nvmlDeviceGetEccMode", handle)
        current = None if mode is None else bool(mode[0])
        found: dict[str, Any] = dict(ecc_mode_current=current, ecc_mode_pending=None if mode is None else bool(mode[1]))
        if not current:  # counters are kept only while ECC is on
            return found
        status = self._sram_status(card, handle)
        sram: dict[tuple[str, str], int | None] = {}
        if status is not None:  # 570+: the uncorrectable SRAM errors are parity + SEC-DED
            found["ecc_sram_threshold_exceeded"] = bool(status.bThresholdExceeded)
            sram["volatile", "uncorrectable"] = status.volatileUncParity + status.volatileUncSecDed
            sram["aggregate", "uncorrectable"] = status.aggregateUncParity + status.aggregateUncSecDed
        for scope, s in _SCOPES:
            for kind, t in _TYPES:
                if (scope, kind) not in sram:
                    sram[scope, kind] = self._counter(card, handle, t, s, _SRAM)
        dram = {(scope, kind): self._counter(card, handle, t, s, _DRAM) for scope, s in _SCOPES for kind, t in _TYPES}
        if all(v is None for v in sram.values()):  # no SRAM location: an older card's layout
            found["ecc_errors"] = self._older_ecc(card, handle, dram)
            return found
        # nvidia-smi's order: scope, memory, type.
        found["ecc_errors"] = tuple(
            EccCount(scope, memory, kind, v) for scope, _ in _SCOPES
            for memory, values in (("sram", sram), ("dram", dram))
            for kind, _ in _TYPES if (v := values[scope, kind]) is not None)
        return found

    def _sram_status(self, card: CardKey, handle: Any) -> Any:
        """``GetSramEccErrorStatus`` (570+), or ``None``."""
        struct = getattr(pynvml, "c_nvmlEccSramErrorStatus_v1_t", None)
        if struct is None:
            return None
        status = struct()
        answered = self._ask(card, "nvmlDeviceGetSramEccErrorStatus", handle, ctypes.byref(status), key=())
        return None if answered is None else status

    def _older_ecc(self, card: CardKey, handle: Any,
                   device_memory: dict[tuple[str, str], int | None]) -> tuple[EccCount, ...]:
        """Before the SRAM/DRAM split, in nvidia-smi's order: scope, type, location; device_memory is
        the DRAM location, already asked."""
        found = []
        for scope, s in _SCOPES:
            for kind, t in _TYPES:
                for memory, location in _OLDER_LOCATIONS:
                    value = (device_memory[scope, kind] if location == _DRAM
                             else self._counter(card, handle, t, s, location))
                    if value is not None:
                        found.append(EccCount(scope, memory, kind, value))
        return tuple(found)

    def _counter(self, card: CardKey, handle: Any, error_type: int, scope: int, location: int) -> int | None:
        return _int(self._ask(card, "nvmlDeviceGetMemoryErrorCounter", handle, error_type, scope, location))

    def _wear(self, card: CardKey, handle: Any, mig_current: bool | None) -> dict[str, Any]:
        ask = self._ask
        found: dict[str, Any] = {}
        rows = None if mig_current else ask(card, "nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            found.update(remapped_rows_correctable=int(rows[0]), remapped_rows_uncorrectable=int(rows[1]),
                         row_remap_pending=bool(rows[2]), row_remap_failure=bool(rows[3]))
        histogram = None if mig_current else ask(card, "nvmlDeviceGetRowRemapperHistogram", handle)
        if histogram is not None:
            found["row_remap_availability_banks"] = tuple(
                (name, int(getattr(histogram, name))) for name in ("max", "high", "partial", "low", "none"))
        for cause, cause_id in _RETIREMENT_CAUSES:
            pages = ask(card, ("nvmlDeviceGetRetiredPages_v2", "nvmlDeviceGetRetiredPages"), handle, cause_id)
            if pages is not None:
                found[f"retired_pages_{cause}"] = len(pages)
        pending = ask(card, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if pending is not None:
            found["retired_pages_pending"] = bool(pending)
        repair = ask(card, "nvmlDeviceGetRepairStatus", handle)
        if repair is not None:
            found["repair_pending"] = (("channel", bool(repair[0])), ("tpc", bool(repair[1])))
        return found


def _recovery_action(fields: dict[str, float]) -> int | None:
    """The driver's advice; before 570, as nvidia-smi reads its flags: a drain and reset
    recommended, else a reset required, else (one flag saying no) none."""
    if "recovery_action" in fields:
        return int(fields["recovery_action"])
    drain, reset = fields.get("drain_and_reset"), fields.get("reset_required")
    if drain:
        return int(RecoveryAction.DRAIN_AND_RESET)
    if reset:
        return int(RecoveryAction.GPU_RESET)
    return None if drain is None and reset is None else int(RecoveryAction.NONE)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)
