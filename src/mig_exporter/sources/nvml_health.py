"""A card's heat, power and wear through NVML: model/health.py's ``CardHealth``, once per card and
read, and a MIG instance's own ECC count. What each value matches in ``nvidia-smi -q -x``:

- one ``nvmlDeviceGetFieldValues`` call for every value NVML has a field id for, in the header of
  the driver in use (sources/nvml_header.py, never the installed pynvml's constants):
  ``MEMORY_TEMP`` (``temperature/memory_temp``), the clock-event counters (ns;
  ``PERF_POLICY_POWER``/``_SYNC_BOOST`` and, 575+, ``CLOCKS_EVENT_REASON_*_SLOWDOWN``),
  ``GET_GPU_RECOVERY_ACTION`` (570+, ``gpu_recovery_action``; before it ``RESET_STATUS`` and
  ``DRAIN_AND_RESET_STATUS``, ``gpu_reset_status``), ``PCIE_REPLAY_COUNTER``
  (``pci/replay_counter``), ``TOTAL_ENERGY_CONSUMPTION`` (mJ; NVML's alone), ``ECC_CURRENT``/
  ``_PENDING`` (``ecc_mode``), the device-memory (DRAM) ECC counts ``ECC_SBE/DBE_VOL/AGG_DEV``,
  ``RETIRED_SBE``/``_DBE``/``_PENDING`` (``retired_pages``), ``REMAPPED_*`` (``remapped_rows``)
  and ``POWER_CURRENT_LIMIT``/``_REQUESTED_LIMIT`` (mW, ``current_power_limit``,
  ``requested_power_limit``). Each value a field does not give is asked by its own call below,
  which is also how a driver without FieldValues is read;
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
  (``retired_pages``), ``GetRepairStatus`` (590+), ``GetUnrepairableMemoryFlag_v1`` (590+,
  ``unrepairable_memory``);
- ``GetCurrPcieLinkGeneration``/``Width`` and ``GetMaxPcieLinkGeneration``/``Width``
  (``pci/pci_gpu_link_info/pcie_gen``, ``link_widths``: ``current``/``max``).

A value the driver does not give, or that fails on its own, is ``None`` (or left out of its tuple),
never 0, and never fails the card; an error that says the card is gone (``GPU_IS_LOST``...) does,
as for every other reading. A card is read at every scrape: a call or field that answered
NOT_SUPPORTED or FUNCTION_NOT_FOUND is remembered per card (its UUID and MIG mode) until NVML is
initialised again, and not asked again; a card whose health NVML does not give at all costs no
calls after its first read.

The recovery action is read by name: the driver's number is looked up in its own header's
``nvmlDeviceGpuRecoveryAction_t`` and that name in model/health.py's ``RecoveryAction``; a number
its header does not define is ``recovery_action_unknown`` (the number as text), graded a warning.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import pynvml

from mig_exporter.model.health import CLOCK_EVENT_REASONS, CardHealth, ClockReading, EccCount, RecoveryAction
from mig_exporter.sources.nvml_gateway import LASTING_UNSUPPORTED, Nvml, NvmlCallError
from mig_exporter.sources.nvml_header import Header, header_for

# What a card is known by in the memo: its UUID (or index) and its MIG mode, which changes what it supports.
CardKey = tuple[object, "bool | None"]
# Answers after which the next, older variant of a call is asked.
_NEXT_VARIANT = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH})


def _constant(*names: str) -> Any:
    """The first of ``names`` the installed pynvml has: NVML's names moved between releases."""
    return next((getattr(pynvml, n) for n in names if hasattr(pynvml, n)), None)


# FieldValues: (what it is, NVML's name for its field); the id is the driver's header's.
_FIELDS = (
    ("memory_temperature", "NVML_FI_DEV_MEMORY_TEMP"),
    ("sw_power_cap", "NVML_FI_DEV_PERF_POLICY_POWER"),
    ("sync_boost", "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST"),
    ("sw_thermal_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    ("hw_thermal_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN"),
    ("hw_power_brake_slowdown", "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN"),
    ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
    # Before 570's recovery action, the two flags it replaces (nvidia-smi's gpu_reset_status).
    ("reset_required", "NVML_FI_DEV_RESET_STATUS"),
    ("drain_and_reset", "NVML_FI_DEV_DRAIN_AND_RESET_STATUS"),
    ("pcie_replays", "NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
    ("energy_mj", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
    ("ecc_current", "NVML_FI_DEV_ECC_CURRENT"),
    ("ecc_pending", "NVML_FI_DEV_ECC_PENDING"),
    ("dram_volatile_correctable", "NVML_FI_DEV_ECC_SBE_VOL_DEV"),
    ("dram_volatile_uncorrectable", "NVML_FI_DEV_ECC_DBE_VOL_DEV"),
    ("dram_aggregate_correctable", "NVML_FI_DEV_ECC_SBE_AGG_DEV"),
    ("dram_aggregate_uncorrectable", "NVML_FI_DEV_ECC_DBE_AGG_DEV"),
    ("retired_single_bit", "NVML_FI_DEV_RETIRED_SBE"),
    ("retired_double_bit", "NVML_FI_DEV_RETIRED_DBE"),
    ("retired_pending", "NVML_FI_DEV_RETIRED_PENDING"),
    ("remapped_correctable", "NVML_FI_DEV_REMAPPED_COR"),
    ("remapped_uncorrectable", "NVML_FI_DEV_REMAPPED_UNC"),
    ("remap_pending", "NVML_FI_DEV_REMAPPED_PENDING"),
    ("remap_failure", "NVML_FI_DEV_REMAPPED_FAILURE"),
    ("power_limit_current", "NVML_FI_DEV_POWER_CURRENT_LIMIT"),
    ("power_limit_requested", "NVML_FI_DEV_POWER_REQUESTED_LIMIT"),
)
_REMAPPED = ("remapped_correctable", "remapped_uncorrectable", "remap_pending", "remap_failure")
# Not asked in MIG mode, where NVML does not support them (as GetRemappedRows).
_NOT_IN_MIG = frozenset(_REMAPPED)
# nvmlFieldValue_t as nvml.h lays it out: fieldId, (scopeId, timestamp, latencyUsec skipped),
# valueType, nvmlReturn, then the 8-byte value union as its raw 64 bits; one pass over the array.
_ENTRY = struct.Struct("=I20xIIQ")
_DOUBLE = struct.Struct("=d")
_U64 = struct.Struct("=Q")
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


class _UnrepairableMemory(ctypes.Structure):
    """nvml.h's nvmlUnrepairableMemory_v1_t (590+), here so that an older pynvml can ask it too."""

    _fields_ = [("version", ctypes.c_uint), ("unrepairableMemory", ctypes.c_uint)]


# NVML_STRUCT_VERSION(UnrepairableMemory, 1): the struct's size | 1 << 24 (0x1000008).
_UNREPAIRABLE_V1 = ctypes.sizeof(_UnrepairableMemory) | 1 << 24


class HealthReader:
    """Reads ``CardHealth`` through one ``Nvml``, remembering per card what it does not support."""

    def __init__(self, nv: Nvml) -> None:
        self._nv = nv
        self._generation = -1
        self._memos: dict[CardKey, dict[tuple[object, ...], int]] = {}
        self._fixed: dict[CardKey, dict[tuple[object, ...], Any]] = {}
        self._header: Header | None = None
        # Per card: what its FieldValues call asks, as long as its memo keeps its size (it only grows).
        self._plans: dict[CardKey, tuple[int, tuple[str, ...], Any]] = {}
        # The library's C functions of the hot scalar calls (``_scalar``), looked up once per initialisation.
        self._functions: dict[str, Any] = {}
        self._outs: dict[type[Any], tuple[Any, Any]] = {}

    def _same_driver(self) -> None:
        if self._generation != self._nv.generation:  # a new initialisation may be a new driver
            self._generation, self._memos, self._fixed = self._nv.generation, {}, {}
            self._header, self._plans, self._functions = None, {}, {}

    def header(self) -> Header:
        """The field ids and enum values of the driver in use (sources/nvml_header.py), asked
        once per initialisation; a driver that does not say its NVML version gets the oldest."""
        self._same_driver()
        if self._header is None:
            try:
                version = self._nv.optional(pynvml.nvmlSystemGetNVMLVersion)
            except NvmlCallError:
                return header_for(None)  # asked again at the next read
            self._header = header_for(version)
        return self._header

    def _memo(self, card: CardKey) -> dict[tuple[object, ...], int]:
        if self._generation != self._nv.generation:
            self._same_driver()
        memo = self._memos.get(card)
        if memo is None:
            memo = self._memos[card] = {}
        return memo

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

    def _scalar(self, card: CardKey, names: str | tuple[str, ...], handle: Any, *args: int,
                out: type[Any] = ctypes.c_uint) -> int | None:
        """``_ask`` for a call that writes one number (``name(device, args..., out *)``), through the
        library's C function: pynvml's wrapper, its checks and the gateway's exception handling cost
        more than the call itself, and a card asks about 20 of these a read (8 and 7 per MIG instance)."""
        memo = self._memo(card)
        for name in (names,) if isinstance(names, str) else names:
            known = (name, *args)
            code = memo.get(known)
            if code is None:
                function = self._functions.get(name)
                if function is None:
                    try:
                        function = self._functions[name] = self._nv.c_function(name)
                    except NvmlCallError as e:
                        function, code = None, e.code
                        memo[known] = code
                if function is not None:
                    value, pointer = self._outs.get(out) or self._out(out)
                    code = function(handle, *args, pointer)
                    if code == pynvml.NVML_SUCCESS:
                        return int(value.value)
                    try:
                        self._nv.check(name, code)
                    except NvmlCallError as e:
                        if e.card_gone:
                            raise
                        if code in LASTING_UNSUPPORTED:
                            memo[known] = code
            if code not in _NEXT_VARIANT:
                return None
        return None

    def _out(self, kind: type[Any]) -> tuple[Any, Any]:
        """One output of ``kind`` and its pointer, for every ``_scalar`` call (reads are not concurrent:
        they run in the source's flight, sources/nvml.py)."""
        value = kind()
        self._outs[kind] = made = (value, ctypes.byref(value))
        return made

    def temperature(self, card: CardKey, handle: Any) -> float | None:
        """The core's temperature, through ``GetTemperatureV`` where the driver has it (the
        unversioned call is deprecated)."""
        value = self._ask(card, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle,
                          pynvml.NVML_TEMPERATURE_GPU)
        return None if value is None else float(value)

    def instance_ecc(self, card: CardKey, mig_handle: Any) -> tuple[EccCount, ...]:
        """A MIG instance's own volatile uncorrectable SRAM errors (nvidia-smi's
        ``mig_device/ecc_error_count/volatile_count/sram_uncorrectable``)."""
        count = self._scalar(card, "nvmlDeviceGetMemoryErrorCounter", mig_handle,
                             pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, _SRAM,
                             out=ctypes.c_ulonglong)
        return () if count is None else (EccCount("volatile", "sram", "uncorrectable", int(count)),)

    def card(self, card: CardKey, handle: Any, mig_current: bool | None) -> CardHealth:
        """One card's health; ``mig_current`` leaves out what NVML does not support in MIG mode."""
        header = self.header()
        fields = self._fields(card, handle, mig_current, header)
        energy = fields.get("energy_mj")
        if energy is None:
            energy = self._ask(card, "nvmlDeviceGetTotalEnergyConsumption", handle)
        replays = fields.get("pcie_replays")
        if replays is None:
            replays = self._ask(card, "nvmlDeviceGetPcieReplayCounter", handle)
        action, unknown = _recovery_action(fields, header)
        return CardHealth(
            memory_temperature_celsius=_float(fields.get("memory_temperature")),
            clock_event_seconds=tuple((name, fields[name] / 1e9) for name in CLOCK_EVENT_REASONS if name in fields),
            recovery_action=action,
            recovery_action_unknown=unknown,
            pcie_replays=_int(replays),
            energy_joules=None if energy is None else energy / 1000.0,
            **self._heat(card, handle),
            **self._power(card, handle, fields),
            **self._ecc(card, handle, fields),
            **self._wear(card, handle, mig_current, fields),
            **self._link(card, handle),
        )

    def _fields(self, card: CardKey, handle: Any, mig_current: bool | None, header: Header) -> dict[str, float]:
        """The FieldValues readings by name, in one call for every field the driver's header has
        and the card is not known not to support. Read through the C function, from the array's
        bytes: pynvml's wrapper builds a Python object per entry, and a card asks about 25."""
        memo = self._memo(card)
        plan = self._plans.get(card)
        if plan is None or plan[0] != len(memo):  # a field or the call itself found unsupported since
            wanted = tuple((name, fid) for name, nvml_name in _FIELDS
                           if (fid := header.fields.get(nvml_name)) is not None and ("field", fid) not in memo
                           and not (mig_current and name in _NOT_IN_MIG))
            array = None
            if wanted and ("nvmlDeviceGetFieldValues",) not in memo:
                array = (pynvml.c_nvmlFieldValue_t * len(wanted))()
                for entry, (_, fid) in zip(array, wanted, strict=True):
                    entry.fieldId = fid
            plan = self._plans[card] = (len(memo), tuple(name for name, _ in wanted), array)
        _, names, array = plan
        if array is None:
            return {}
        try:
            function = self._functions.get("nvmlDeviceGetFieldValues")
            if function is None:
                function = self._functions["nvmlDeviceGetFieldValues"] = self._nv.c_function("nvmlDeviceGetFieldValues")
            self._nv.check("nvmlDeviceGetFieldValues", function(handle, len(names), array))
        except NvmlCallError as e:
            if e.card_gone:
                raise
            if e.code in LASTING_UNSUPPORTED:
                memo[("nvmlDeviceGetFieldValues",)] = e.code
            return {}  # no FieldValues here: each value's own call gives it
        found: dict[str, float] = {}
        entries = _ENTRY.iter_unpack(ctypes.string_at(array, ctypes.sizeof(array)))
        for name, (fid, kind, code, value) in zip(names, entries, strict=True):
            if code == pynvml.NVML_SUCCESS:
                number = _value(kind, value)
                if number is not None:
                    found[name] = number
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
        active = self._scalar(card, ("nvmlDeviceGetCurrentClocksEventReasons",
                                     "nvmlDeviceGetCurrentClocksThrottleReasons"), handle, out=ctypes.c_ulonglong)
        supported = self._ask_fixed(card, ("nvmlDeviceGetSupportedClocksEventReasons",
                                           "nvmlDeviceGetSupportedClocksThrottleReasons"), handle)
        events: tuple[tuple[str, bool], ...] = ()
        if active is not None:
            # Without the supported mask (an older driver), every reason it names is reported.
            events = tuple((name, bool(active & bit)) for name, bit in _REASON_BITS
                           if bit is not None and (supported is None or supported & bit))
        pstate = self._scalar(card, "nvmlDeviceGetPerformanceState", handle)
        fan = self._scalar(card, "nvmlDeviceGetFanSpeed", handle)
        return dict(
            temperature_thresholds_celsius=tuple((name, float(v)) for name, v in thresholds if v is not None),
            temperature_margin_celsius=_float(ask(card, "nvmlDeviceGetMarginTemperature", handle)),
            clock_events_active=events,
            performance_state=None if pstate in (None, pynvml.NVML_PSTATE_UNKNOWN) else int(pstate),
            fan_speed_ratio=None if fan is None else fan / 100.0,
        )

    def _power(self, card: CardKey, handle: Any, fields: dict[str, float]) -> dict[str, Any]:
        ask = self._ask
        clocks = []
        fixed = self._ask_fixed
        for kind, function, asking in (("current", "nvmlDeviceGetClockInfo", self._scalar),
                                       ("max", "nvmlDeviceGetMaxClockInfo", fixed)):
            for clock, clock_id in _CLOCK_IDS:
                mhz = asking(card, function, handle, clock_id)
                if mhz is not None:
                    clocks.append(ClockReading(clock, kind, mhz * 1e6))
        constraints = fixed(card, "nvmlDeviceGetPowerManagementLimitConstraints", handle) or (None, None)
        current, requested = fields.get("power_limit_current"), fields.get("power_limit_requested")
        limits = (("current", ask(card, "nvmlDeviceGetEnforcedPowerLimit", handle) if current is None else current),
                  ("requested", ask(card, "nvmlDeviceGetPowerManagementLimit", handle) if requested is None
                   else requested),
                  ("default", fixed(card, "nvmlDeviceGetPowerManagementDefaultLimit", handle)),
                  ("min", constraints[0]), ("max", constraints[1]))
        return dict(clocks=tuple(clocks),
                    power_limits_watts=tuple((name, mw / 1000.0) for name, mw in limits if mw is not None))

    def _ecc(self, card: CardKey, handle: Any, fields: dict[str, float]) -> dict[str, Any]:
        mode: Any = (fields.get("ecc_current"), fields.get("ecc_pending"))
        if None in mode:
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
        dram = {(scope, kind): _int(fields.get(f"dram_{scope}_{kind}")) for scope, _ in _SCOPES for kind, _ in _TYPES}
        for scope, s in _SCOPES:
            for kind, t in _TYPES:
                if dram[scope, kind] is None:
                    dram[scope, kind] = self._counter(card, handle, t, s, _DRAM)
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
        if struct is None or ("nvmlDeviceGetSramEccErrorStatus",) in self._memo(card):  # known unsupported
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
        return self._scalar(card, "nvmlDeviceGetMemoryErrorCounter", handle, error_type, scope, location,
                            out=ctypes.c_ulonglong)

    def _wear(self, card: CardKey, handle: Any, mig_current: bool | None, fields: dict[str, float]) -> dict[str, Any]:
        ask = self._ask
        found: dict[str, Any] = {}
        rows: Any = tuple(fields.get(name) for name in _REMAPPED)
        if None in rows:
            rows = None if mig_current else ask(card, "nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            found.update(remapped_rows_correctable=int(rows[0]), remapped_rows_uncorrectable=int(rows[1]),
                         row_remap_pending=bool(rows[2]), row_remap_failure=bool(rows[3]))
        histogram = None if mig_current else ask(card, "nvmlDeviceGetRowRemapperHistogram", handle)
        if histogram is not None:
            found["row_remap_availability_banks"] = tuple(
                (name, int(getattr(histogram, name))) for name in ("max", "high", "partial", "low", "none"))
        for cause, cause_id in _RETIREMENT_CAUSES:
            count = fields.get(f"retired_{cause}")
            if count is None:
                pages = ask(card, ("nvmlDeviceGetRetiredPages_v2", "nvmlDeviceGetRetiredPages"), handle, cause_id)
                count = None if pages is None else len(pages)
            if count is not None:
                found[f"retired_pages_{cause}"] = int(count)
        pending = fields.get("retired_pending")
        if pending is None:
            pending = ask(card, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if pending is not None:
            found["retired_pages_pending"] = bool(pending)
        repair = ask(card, "nvmlDeviceGetRepairStatus", handle)
        if repair is not None:
            found["repair_pending"] = (("channel", bool(repair[0])), ("tpc", bool(repair[1])))
        unrepairable = self._unrepairable(card, handle)
        if unrepairable is not None:
            found["unrepairable_memory"] = unrepairable
        return found

    def _unrepairable(self, card: CardKey, handle: Any) -> bool | None:
        """``nvmlDeviceGetUnrepairableMemoryFlag_v1(device, nvmlUnrepairableMemory_v1_t *)`` (590+;
        nvml.h as NVIDIA/go-nvml keeps it), through the C function and a struct of our own: the
        pynvml releases before 13.590 lack both."""
        name = "nvmlDeviceGetUnrepairableMemoryFlag_v1"
        memo = self._memo(card)
        if (name,) in memo:
            return None
        status = _UnrepairableMemory(version=_UNREPAIRABLE_V1)
        try:
            self._nv.check(name, self._nv.c_function(name)(handle, ctypes.byref(status)))
        except NvmlCallError as e:
            if e.card_gone:
                raise
            if e.code in LASTING_UNSUPPORTED:
                memo[(name,)] = e.code
            return None
        return bool(status.unrepairableMemory)

    def _link(self, card: CardKey, handle: Any) -> dict[str, Any]:
        """The PCIe link now (it trains down when idle, and after a fault) and the most this card
        and its slot allow, which the card keeps while the driver is loaded (nvidia-smi's
        ``pci/pci_gpu_link_info``: ``pcie_gen``, ``link_widths``, ``current``/``max``)."""
        ask, fixed = self._scalar, self._ask_fixed
        return dict(
            pcie_link_generation_current=ask(card, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            pcie_link_generation_max=_int(fixed(card, "nvmlDeviceGetMaxPcieLinkGeneration", handle)),
            pcie_link_width_current=ask(card, "nvmlDeviceGetCurrPcieLinkWidth", handle),
            pcie_link_width_max=_int(fixed(card, "nvmlDeviceGetMaxPcieLinkWidth", handle)),
        )


def _recovery_action(fields: dict[str, float], header: Header) -> tuple[int | None, str | None]:
    """The driver's advice and, where its header does not define the number (or defines a name
    this exporter does not know), that number as text; before 570, as nvidia-smi reads its
    flags: a drain and reset recommended, else a reset required, else (one flag saying no) none."""
    if "recovery_action" in fields:
        number = int(fields["recovery_action"])
        # By name: a number means what the driver's own header says (580's pynvml calls 5 GPU_RESET_BUS).
        action = RecoveryAction.__members__.get(header.recovery_actions.get(number, ""))
        return (None, str(number)) if action is None else (int(action), None)
    drain, reset = fields.get("drain_and_reset"), fields.get("reset_required")
    if drain:
        return int(RecoveryAction.DRAIN_AND_RESET), None
    if reset:
        return int(RecoveryAction.GPU_RESET), None
    return (None if drain is None and reset is None else int(RecoveryAction.NONE)), None


def _value(kind: int, bits: int) -> float | None:
    """The union member of nvmlValueType_t ``kind`` (0-6 since FieldValues came; USHORT is 570's),
    from the union's 64 bits (little-endian: a narrower member is the low bits)."""
    if kind in (2, 3):  # unsigned long, unsigned long long
        return bits
    if kind == 1:  # unsigned int
        return bits & 0xFFFFFFFF
    if kind == 4:  # signed long long
        return bits - (1 << 64) if bits >> 63 else bits
    if kind == 5:  # signed int
        low = bits & 0xFFFFFFFF
        return low - (1 << 32) if low >> 31 else low
    if kind == 6:  # unsigned short
        return bits & 0xFFFF
    if kind == 0:  # double
        return float(_DOUBLE.unpack(_U64.pack(bits))[0])
    return None


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)
