"""A fake libnvidia-ml under pynvml's real ctypes layer, and scenarios for it.

The real ``pynvml`` module (nvidia-ml-py) runs unchanged: its wrappers build
their ctypes structs and call what they take for C functions. Those are
``ctypes.CFUNCTYPE`` callbacks implemented here over a scenario, so struct
layouts, size-query protocols, version fields, string buffers, handle
pointers, error codes and pynvml's own error classes are all exercised. Only
the shared object is replaced: ``pynvml.nvmlLib`` is set to a ``FakeNvmlLibrary``
whose attributes are the callbacks (a missing one raises ``AttributeError``,
which pynvml turns into ``NVMLError_FunctionNotFound``, as with a real
library lacking a symbol).

It needs no pytest, so the benchmarks import it too (tests/ on ``sys.path``, as
under pytest for ``from conftest import ...``). In a test, the fixture
``fake_nvml_lib`` of tests/conftest.py installs it until the test ends::

    def test_something(fake_nvml_lib):
        fake = fake_nvml_lib("h100-mig-processes")    # a name from SCENARIOS, or a FakeNvmlScenario
        ...                                            # code under test calls pynvml.nvmlInit() etc.
        assert fake.exceptions == []

    from fake_nvml import demo, fake_nvml

    with fake_nvml(demo()) as fake:                   # the same without pytest
        ...

Knobs, all on the frozen dataclasses below: per card or per MIG instance
``errors={"nvmlDeviceGetPowerUsage": NVML_ERROR_UNKNOWN}`` (``"*"`` for every
call that takes the card's handle or one of its MIG handles), scenario-wide
``system_errors`` (calls without a device handle), ``init_error``,
``missing_functions`` (an older driver; see ``OLD_DRIVER_MISSING``) and
``r535_struct_mismatch``; ``driver_version`` also picks the header whose field ids
nvmlDeviceGetFieldValues answers (``FAKE_FIELD_IDS``: 570's has no thermal clock-event counters,
575's and 580.65's have them at 251-253, 580.82's (CUDA 13.0 Update 1) and 590's at 269-271), and ``nvml_version`` what
nvmlSystemGetNVMLVersion says (by default CUDA's major version, then ``driver_version``); per card
``serial`` and ``health=FakeHealth(...)`` (heat, power and wear; its
``field_errors`` fail single fields inside a successful nvmlDeviceGetFieldValues) and per MIG
instance ``sram_uncorrectable_volatile``. ``FakeNvml.set_scenario`` swaps the data under a
running exporter (a card lost between two scrapes, a driver reload).

Activity: per card ``gpm_supported`` (the Hopper cards' ``H100``/``H200`` say yes), ``activity``
(a whole card's) and per MIG instance ``activity`` (its GPU instance's), GPM metric id -> percent
(``gpm(graphics=..., sm=...)``), counted against the fake's clock (``FakeNvml.now``, held by
``advance``/``set_clock``): a window of N s at a scripted activity reads that activity;
``gpm_metric_errors`` (each metric's own return code), ``empty_gpu_instances`` (a GPU instance
with no compute instance); ``process_samples`` (fixed ``FakeUtilSample`` entries of
nvmlDeviceGetProcessUtilization on a whole card) and ``process_activity`` (pid -> (sm %, mem %) or
(sm %, mem %, enc %, dec %): one sample a driver period, ``process_sample_period_us``, made as
the fake's clock runs, stamped by its wall clock, ``FakeNvml.wall_time``, which
``step_wall_clock`` moves as NTP would);
``process_samples_merged`` (one sample a process a call, as drivers in the field answer).
``FakeNvml.gpm_samples_held`` counts the GPM samples not freed.

What a caller did is recorded: ``fake.calls`` (every C call, with the device it
named), ``fake.missing_lookups`` (symbols pynvml asked for and did not get),
``fake.arities`` (how many arguments a call that may take fewer was given) and
``fake.exceptions`` (a Python exception inside a callback; the C caller gets
NVML_ERROR_UNKNOWN, as ctypes would otherwise hand back a garbage code).
Tests should assert ``fake.exceptions == []``.

Where NVML's documentation is silent, the fake's choice is stated beside the
function (``_nvmlDeviceGetIndex`` etc.).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from ctypes import POINTER, c_int, c_uint, c_ulonglong, c_void_p
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import pynvml

MIB = 1024 * 1024

NVML_SUCCESS = pynvml.NVML_SUCCESS
NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION = pynvml.NVML_ERROR_NO_PERMISSION
NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN

# NVML's "not available" values in process entries.
UNKNOWN_MEMORY = 0xFFFFFFFFFFFFFFFF  # usedGpuMemory (pynvml turns it into None)
NO_INSTANCE_ID = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId outside MIG

# What a pre-R510 driver lacks: the _v3 process calls and nvmlDeviceGetMemoryInfo_v2.
OLD_DRIVER_MISSING = frozenset({
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetMemoryInfo_v2",
})

# Under r535_struct_mismatch every process becomes these four entries on the
# _v3 calls: its pid, then 0, 4294967295, 4294967295 (the pattern reported in
# XuehaiPan/nvitop#75 on R535 drivers), all with this nonsense memory size.
R535_GARBAGE_PIDS = (0, 0xFFFFFFFF, 0xFFFFFFFF)
R535_GARBAGE_BYTES = 0x0000FFFFFFFFFFFF  # ~256 TiB: larger than any card

# The timestamp of every retired page (seconds since the epoch; the i-th page one second later).
RETIRED_AT = 1_717_171_717

# nvmlErrorString's texts, as libnvidia-ml has them.
_ERROR_STRINGS = {
    pynvml.NVML_SUCCESS: "Success",
    pynvml.NVML_ERROR_UNINITIALIZED: "Uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    pynvml.NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    pynvml.NVML_ERROR_NOT_FOUND: "Not Found",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    pynvml.NVML_ERROR_TIMEOUT: "Timeout",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    pynvml.NVML_ERROR_NO_DATA: "No data",
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    pynvml.NVML_ERROR_UNKNOWN: "Unknown Error",
}


# ---------------------------------------------------------------------------
# Scenario model
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeMemory:
    """A framebuffer as nvmlDeviceGetMemoryInfo_v2 reports it; ``used`` excludes ``reserved``."""

    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class FakeProcess:
    """One entry of a process list. ``used_bytes=None``: NVML cannot say (0xFFFFFFFFFFFFFFFF)."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class FakeSramStatus:
    """nvmlDeviceGetSramEccErrorStatus (570+): uncorrectable SRAM errors split by parity and
    SEC-DED, correctable ones, and whether they passed the driver's threshold."""

    volatile_parity: int = 0
    volatile_secded: int = 0
    volatile_correctable: int = 0
    aggregate_parity: int = 0
    aggregate_secded: int = 0
    aggregate_correctable: int = 0
    threshold_exceeded: bool = False


@dataclass(frozen=True)
class FakeHealth:
    """A card's heat, power and wear, as NVML answers them. ``None`` (or a missing key) answers
    NVML_ERROR_NOT_SUPPORTED. Keys of the enums that never moved (thresholds, clocks, memory
    locations) are pynvml's constants; field ids are not, as they moved between headers.

    - ``fields``: nvmlDeviceGetFieldValues, by NVML's NAME of the field (``"NVML_FI_DEV_MEMORY_TEMP"``,
      ``"NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"`` in ns, ``"NVML_FI_PWR_SMOOTHING_ENABLED"``,
      ``"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"``, ``"NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"`` in mJ...):
      the scenario's driver answers each at the id ITS header gives that name (``FAKE_FIELD_IDS``),
      and a name its header lacks at none. The single calls that give the same values answer from
      here too, and the fields that repeat a single call (ECC mode and DRAM counts, retired pages,
      remapped rows, the enforced and requested power limits) answer from that call's value
      (``field_answers``);
    - ``thresholds_c``: nvmlDeviceGetTemperatureThreshold, by ``NVML_TEMPERATURE_THRESHOLD_*``;
    - ``clocks_mhz``/``max_clocks_mhz``: nvmlDeviceGetClockInfo/GetMaxClockInfo, by ``NVML_CLOCK_*``;
    - ``power_limits_mw``: enforced, management (requested), default, min, max;
    - ``ecc_counts``: nvmlDeviceGetMemoryErrorCounter, by (error type, counter type, location);
      a location not listed answers NOT_SUPPORTED (an older card has no SRAM/DRAM locations);
    - ``remapped_rows``: (correctable, uncorrectable, pending, failure);
    - ``remapper_histogram``: (max, high, partial, low, none) banks;
    - ``retired_pages``: page addresses by ``NVML_PAGE_RETIREMENT_CAUSE_*``;
    - ``repair_pending``: (channel, tpc), nvmlDeviceGetRepairStatus (590+);
    - ``unrepairable_memory``: nvmlDeviceGetUnrepairableMemoryFlag_v1 (590+);
    - ``pcie_link``: (current generation, max generation, current width, max width), the four
      nvmlDeviceGet{Curr,Max}PcieLink{Generation,Width} calls.
    """

    fields: Mapping[str, int] = field(default_factory=dict)
    margin_c: int | None = None
    thresholds_c: Mapping[int, int] = field(default_factory=dict)
    clocks_event_reasons: int | None = None  # the active bitmask
    supported_clocks_event_reasons: int | None = None
    performance_state: int | None = None
    clocks_mhz: Mapping[int, int] = field(default_factory=dict)
    max_clocks_mhz: Mapping[int, int] = field(default_factory=dict)
    fan_percent: int | None = None
    power_limits_mw: tuple[int | None, int | None, int | None, int | None, int | None] = (None,) * 5
    ecc_mode: tuple[bool, bool] | None = None
    ecc_counts: Mapping[tuple[int, int, int], int] = field(default_factory=dict)
    sram: FakeSramStatus | None = None
    remapped_rows: tuple[int, int, bool, bool] | None = None
    remapper_histogram: tuple[int, int, int, int, int] | None = None
    retired_pages: Mapping[int, tuple[int, ...]] | None = None
    retired_pending: bool | None = None
    repair_pending: tuple[bool, bool] | None = None
    unrepairable_memory: bool | None = None
    pcie_link: tuple[int, int, int, int] | None = None
    # A field's own nvmlReturn inside a successful nvmlDeviceGetFieldValues call, over ``fields``:
    # by NVML's name (at the id of the driver's header), or by a raw id.
    field_errors: Mapping[int | str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeUtilSample:
    """One entry of nvmlDeviceGetProcessUtilization: a process's share of the card's SM and frame
    buffer memory in one driver sample period, at the driver's CPU timestamp in microseconds."""

    pid: int
    timestamp_us: int
    sm_percent: int
    memory_percent: int
    encoder_percent: int = 0
    decoder_percent: int = 0


@dataclass(frozen=True)
class FakeMig:
    """One MIG device (a compute instance) in MIG slot ``index`` of its card."""

    index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # "3g.40gb"; the device's name is "<card name> MIG <profile>"
    uuid: str
    memory: FakeMemory
    compute_processes: tuple[FakeProcess, ...] = ()
    graphics_processes: tuple[FakeProcess, ...] = ()
    mps_processes: tuple[FakeProcess, ...] = ()
    errors: Mapping[str, int] = field(default_factory=dict)
    # nvmlDeviceGetMemoryErrorCounter on this MIG handle: its volatile uncorrectable SRAM errors.
    sram_uncorrectable_volatile: int | None = None
    # Its GPU instance's activity, GPM metric id -> percent (0-100, NaN allowed; a metric not
    # listed was idle, 0): what nvmlGpmMigSampleGet's samples accumulate (see "GPM" below). The
    # compute instances of one GPU instance share it, and must carry the same script.
    activity: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeCard:
    """One physical card. ``None`` readings answer NVML_ERROR_NOT_SUPPORTED.

    ``mig_mode`` is ``(current, pending)``; ``None`` means the card has no MIG
    support. A card in MIG mode lists its processes in its ``mig_devices``; its
    own process lists hold only processes outside MIG (none on real hardware).
    ``errors`` maps a C function name, or ``"*"`` for every call taking this
    card's handle or one of its MIG handles, to the NVML code it answers.
    ``nvmlDeviceGetHandleByIndex_v2`` fails only when named explicitly.
    """

    name: str
    uuid: str
    pci_bus_id: str  # "00000000:19:00.0"
    memory: FakeMemory | None
    mig_mode: tuple[bool, bool] | None
    temperature_c: int | None
    power_mw: int | None
    gpu_util_percent: int | None
    memory_util_percent: int | None = None
    pci_device_id: int = 0  # 0x233010DE: device id << 16 | vendor id
    pci_subsystem_id: int = 0
    max_mig_devices: int = 7  # reported while MIG is enabled
    compute_processes: tuple[FakeProcess, ...] = ()
    graphics_processes: tuple[FakeProcess, ...] = ()
    mps_processes: tuple[FakeProcess, ...] = ()
    mig_devices: tuple[FakeMig, ...] = ()
    errors: Mapping[str, int] = field(default_factory=dict)
    health: FakeHealth = field(default_factory=FakeHealth)
    serial: str | None = None  # nvmlDeviceGetSerial; None: NOT_SUPPORTED (a GeForce)
    # GPM (Hopper and later): nvmlGpmQueryDeviceSupport's isSupportedDevice (an A100 answers SUCCESS
    # with 0; an error is injected through ``errors``); the whole card's activity while not in MIG
    # mode (metric id -> percent, as FakeMig.activity); each metric's own nvmlReturn in
    # nvmlGpmMetricsGet, on the card and its GPU instances alike; and the ids of GPU instances that
    # have no compute instance, so no MIG device (nvmlGpmMigSampleGet samples them; their metrics
    # answer NO_DATA).
    gpm_supported: bool = False
    activity: Mapping[int, float] = field(default_factory=dict)
    gpm_metric_errors: Mapping[int, int] = field(default_factory=dict)
    empty_gpu_instances: tuple[int, ...] = ()
    # nvmlDeviceGetProcessUtilization's samples on a whole card: only processes with activity, each
    # with the driver's CPU timestamp in microseconds. ``process_samples`` are fixed; those of
    # ``process_activity`` (pid -> (sm %, mem %) or (sm %, mem %, enc %, dec %), while not all 0)
    # are made as the fake's clock runs, one a process every ``process_sample_period_us`` (NVML:
    # between 1 s and 1/6 s), stamped
    # by the fake's wall clock, and kept PROCESS_SAMPLE_BUFFER_S (see "Process utilisation" below).
    # ``process_samples_merged``: one sample a process a call instead, its mean over the samples
    # newer than the timestamp asked, stamped at its newest (go-nvml #51 and nvtop #110 show drivers
    # answering so: one sample a pid, each pid's timestamp its own).
    process_samples: tuple[FakeUtilSample, ...] = ()
    process_activity: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    process_sample_period_us: int = 166_667
    process_samples_merged: bool = False

    def __post_init__(self) -> None:
        if (self.gpu_util_percent is None) != (self.memory_util_percent is None):
            raise ValueError(f"{self.uuid}: utilisation is gpu and memory together, or neither")
        slots = [m.index for m in self.mig_devices]
        if len(slots) != len(set(slots)) or any(not 0 <= s < self.max_mig_devices for s in slots):
            raise ValueError(f"{self.uuid}: MIG slots {slots} must be distinct and below {self.max_mig_devices}")
        scripts: dict[int, Mapping[int, float]] = {}
        for m in self.mig_devices:
            if scripts.setdefault(m.gpu_instance_id, m.activity) != m.activity:
                raise ValueError(f"{self.uuid}: the compute instances of GPU instance {m.gpu_instance_id} "
                                 "must carry one activity script (it is the GPU instance's)")
        if set(self.empty_gpu_instances) & set(scripts):
            raise ValueError(f"{self.uuid}: GPU instances {sorted(set(self.empty_gpu_instances) & set(scripts))} "
                             "have compute instances")

    def gpu_instances(self) -> dict[int, tuple[frozenset[tuple[int, str]], Mapping[int, float]]]:
        """GPU instance id -> (its members, (compute instance id, MIG UUID), and its activity script),
        while in MIG mode; those without a compute instance too (no members, no script: no data)."""
        if not self.mig_enabled:
            return {}
        found: dict[int, tuple[frozenset[tuple[int, str]], Mapping[int, float]]] = {
            gi: (frozenset(), {}) for gi in self.empty_gpu_instances}
        for m in self.mig_devices:
            members, _ = found.get(m.gpu_instance_id, (frozenset(), m.activity))
            found[m.gpu_instance_id] = (members | {(m.compute_instance_id, m.uuid)}, m.activity)
        return found

    @property
    def mig_enabled(self) -> bool:
        return self.mig_mode is not None and self.mig_mode[0]

    def mig_in_slot(self, index: int) -> FakeMig | None:
        return next((m for m in self.mig_devices if m.index == index), None)


@dataclass(frozen=True)
class FakeNvmlScenario:
    """What libnvidia-ml answers. ``cuda_version`` is NVML's int: 12040 for CUDA 12.4."""

    driver_version: str
    cuda_version: int
    cards: tuple[FakeCard, ...]
    process_names: Mapping[int, str] = field(default_factory=dict)
    init_error: int | None = None  # nvmlInitWithFlags answers this
    missing_functions: frozenset[str] = frozenset()
    r535_struct_mismatch: bool = False
    system_errors: Mapping[str, int] = field(default_factory=dict)  # calls without a device handle
    # nvmlSystemGetNVMLVersion's answer; None: CUDA's major version, then driver_version ("12.570.86.15").
    nvml_version: str | None = None

    @property
    def nvml_version_text(self) -> str:
        return self.nvml_version or f"{self.cuda_version // 1000}.{self.driver_version}"


# ---------------------------------------------------------------------------
# The fake library
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeCall:
    """One C call: its name, the device it named ("card0", "card0/mig2") and its scalar arguments."""

    function: str
    device: str | None
    args: tuple[Any, ...]


class FakeNvmlLibrary:
    """Stands where ``ctypes.CDLL("libnvidia-ml.so.1")`` would."""

    def __init__(self, functions: dict[str, Any], on_missing: Callable[[str], None]) -> None:
        self._functions = functions
        self._on_missing = on_missing

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._functions[name]
        except KeyError:
            self._on_missing(name)
            raise AttributeError(f"fake libnvidia-ml has no symbol {name}") from None


_P = c_void_p  # every pointer argument; the callbacks cast it themselves
_PROCESS_LISTS = {
    "Compute": "compute_processes",
    "Graphics": "graphics_processes",
    "MPSCompute": "mps_processes",
}
# C name -> (argument types, restype). Process-list symbols are added below.
_SIGNATURES: dict[str, tuple[tuple[Any, ...], Any]] = {
    "nvmlInitWithFlags": ((c_uint,), c_int),
    "nvmlInit_v2": ((), c_int),
    "nvmlShutdown": ((), c_int),
    "nvmlErrorString": ((c_int,), c_void_p),  # const char*; pynvml sets restype c_char_p on it
    "nvmlSystemGetDriverVersion": ((_P, c_uint), c_int),
    "nvmlSystemGetCudaDriverVersion": ((_P,), c_int),
    "nvmlSystemGetCudaDriverVersion_v2": ((_P,), c_int),
    "nvmlSystemGetProcessName": ((c_uint, _P, c_uint), c_int),
    "nvmlDeviceGetCount_v2": ((_P,), c_int),
    "nvmlDeviceGetHandleByIndex_v2": ((c_uint, _P), c_int),
    "nvmlDeviceGetIndex": ((_P, _P), c_int),
    "nvmlDeviceGetName": ((_P, _P, c_uint), c_int),
    "nvmlDeviceGetUUID": ((_P, _P, c_uint), c_int),
    "nvmlDeviceGetPciInfo_v3": ((_P, _P), c_int),
    "nvmlDeviceGetMigMode": ((_P, _P, _P), c_int),
    "nvmlDeviceGetTemperature": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetPowerUsage": ((_P, _P), c_int),
    "nvmlDeviceGetUtilizationRates": ((_P, _P), c_int),
    "nvmlDeviceGetMemoryInfo": ((_P, _P), c_int),
    "nvmlDeviceGetMemoryInfo_v2": ((_P, _P), c_int),
    "nvmlDeviceGetMaxMigDeviceCount": ((_P, _P), c_int),
    "nvmlDeviceGetMigDeviceHandleByIndex": ((_P, c_uint, _P), c_int),
    "nvmlDeviceIsMigDeviceHandle": ((_P, _P), c_int),
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": ((_P, _P), c_int),
    "nvmlDeviceGetGpuInstanceId": ((_P, _P), c_int),
    "nvmlDeviceGetComputeInstanceId": ((_P, _P), c_int),
    # Card health (sources/nvml_health.py), answered from FakeCard.health; nvitop-exporter,
    # which the benchmarks run over this fake (benchmarks/run.py), takes some of them too.
    "nvmlDeviceGetTemperatureV": ((_P, _P), c_int),
    "nvmlDeviceGetClockInfo": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetMaxClockInfo": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetPowerManagementLimit": ((_P, _P), c_int),
    "nvmlDeviceGetEnforcedPowerLimit": ((_P, _P), c_int),
    "nvmlDeviceGetPowerManagementDefaultLimit": ((_P, _P), c_int),
    "nvmlDeviceGetPowerManagementLimitConstraints": ((_P, _P, _P), c_int),
    "nvmlDeviceGetFanSpeed": ((_P, _P), c_int),
    "nvmlDeviceGetTemperatureThreshold": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetMarginTemperature": ((_P, _P), c_int),
    "nvmlDeviceGetCurrentClocksEventReasons": ((_P, _P), c_int),
    "nvmlDeviceGetSupportedClocksEventReasons": ((_P, _P), c_int),
    "nvmlDeviceGetCurrentClocksThrottleReasons": ((_P, _P), c_int),  # the pre-535 names
    "nvmlDeviceGetSupportedClocksThrottleReasons": ((_P, _P), c_int),
    "nvmlDeviceGetPerformanceState": ((_P, _P), c_int),
    "nvmlDeviceGetTotalEnergyConsumption": ((_P, _P), c_int),
    "nvmlDeviceGetPcieReplayCounter": ((_P, _P), c_int),
    "nvmlDeviceGetEccMode": ((_P, _P, _P), c_int),
    "nvmlDeviceGetMemoryErrorCounter": ((_P, c_uint, c_uint, c_uint, _P), c_int),
    "nvmlDeviceGetSramEccErrorStatus": ((_P, _P), c_int),
    "nvmlDeviceGetRemappedRows": ((_P, _P, _P, _P, _P), c_int),
    "nvmlDeviceGetRowRemapperHistogram": ((_P, _P), c_int),
    # pynvml sizes with 4 arguments (no timestamps) and reads with 5: see _FEWEST_ARGUMENTS.
    "nvmlDeviceGetRetiredPages_v2": ((_P, c_uint, _P, _P, _P), c_int),
    "nvmlDeviceGetRetiredPagesPendingStatus": ((_P, _P), c_int),
    "nvmlDeviceGetRepairStatus": ((_P, _P), c_int),
    "nvmlDeviceGetUnrepairableMemoryFlag_v1": ((_P, _P), c_int),
    "nvmlDeviceGetCurrPcieLinkGeneration": ((_P, _P), c_int),
    "nvmlDeviceGetMaxPcieLinkGeneration": ((_P, _P), c_int),
    "nvmlDeviceGetCurrPcieLinkWidth": ((_P, _P), c_int),
    "nvmlDeviceGetMaxPcieLinkWidth": ((_P, _P), c_int),
    "nvmlDeviceGetSerial": ((_P, _P, c_uint), c_int),
    "nvmlSystemGetNVMLVersion": ((_P, c_uint), c_int),
    # Readings our exporter does not take but nvitop-exporter does. Fixed answers, see
    # "other readings" below.
    "nvmlDeviceGetEncoderUtilization": ((_P, _P, _P), c_int),
    "nvmlDeviceGetDecoderUtilization": ((_P, _P, _P), c_int),
    "nvmlDeviceGetPcieThroughput": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetFieldValues": ((_P, c_int, _P), c_int),
    "nvmlDeviceGetProcessUtilization": ((_P, _P, _P, c_ulonglong), c_int),
}
for _kind in _PROCESS_LISTS:
    for _suffix in ("", "_v2", "_v3"):
        _SIGNATURES[f"nvmlDeviceGet{_kind}RunningProcesses{_suffix}"] = ((_P, _P, _P), c_int)
# Symbols a caller may call with fewer arguments than nvml.h declares, as C allows: the rest arrive
# as NULL. pynvml's nvmlDeviceGetRetiredPages_v2 sizes its arrays by a call without the timestamps.
_FEWEST_ARGUMENTS = {"nvmlDeviceGetRetiredPages_v2": 4}
# What nvmlDeviceGetMemoryErrorCounter answers on a MIG handle: its volatile uncorrectable SRAM errors.
_OWN_ECC = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC, pynvml.NVML_MEMORY_LOCATION_SRAM)
# NVML's field ids, per driver branch, as each branch's nvml.h numbers them (NVIDIA's header as
# NVIDIA/go-nvml keeps it, gen/nvml/nvml.h, and the nvidia-ml-py release of each branch), written
# out here as numbers: never pynvml's constants (the installed binding's own release) nor
# sources/nvml_header.py's table (the code under test), so that a mismatch shows.
_IDS_535 = {
    "NVML_FI_DEV_ECC_CURRENT": 1, "NVML_FI_DEV_ECC_PENDING": 2,
    "NVML_FI_DEV_ECC_SBE_VOL_DEV": 11, "NVML_FI_DEV_ECC_DBE_VOL_DEV": 12,
    "NVML_FI_DEV_ECC_SBE_AGG_DEV": 22, "NVML_FI_DEV_ECC_DBE_AGG_DEV": 23,
    "NVML_FI_DEV_RETIRED_SBE": 29, "NVML_FI_DEV_RETIRED_DBE": 30, "NVML_FI_DEV_RETIRED_PENDING": 31,
    "NVML_FI_DEV_PERF_POLICY_POWER": 74, "NVML_FI_DEV_PERF_POLICY_THERMAL": 75,
    "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST": 76,
    "NVML_FI_DEV_MEMORY_TEMP": 82, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83, "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_REMAPPED_COR": 142, "NVML_FI_DEV_REMAPPED_UNC": 143, "NVML_FI_DEV_REMAPPED_PENDING": 144,
    "NVML_FI_DEV_REMAPPED_FAILURE": 145, "NVML_FI_DEV_POWER_MIN_LIMIT": 187, "NVML_FI_DEV_POWER_MAX_LIMIT": 188,
    "NVML_FI_DEV_POWER_DEFAULT_LIMIT": 189, "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,
    "NVML_FI_DEV_POWER_REQUESTED_LIMIT": 192,
}
_IDS_550 = {**_IDS_535, "NVML_FI_DEV_RESET_STATUS": 226, "NVML_FI_DEV_DRAIN_AND_RESET_STATUS": 227}
_IDS_570 = {**_IDS_550, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
            # 251-268: power smoothing; no thermal clock-event counters in 570's header.
            "NVML_FI_PWR_SMOOTHING_ENABLED": 251, "NVML_FI_PWR_SMOOTHING_PRIV_LVL": 252,
            "NVML_FI_PWR_SMOOTHING_IMM_RAMP_DOWN_ENABLED": 253}
_IDS_575 = {**_IDS_550, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": 74, "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": 76,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 251,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 252,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 253, "NVML_FI_PWR_SMOOTHING_ENABLED": 256}
_IDS_590 = {**_IDS_550, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": 74, "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": 76,
            "NVML_FI_PWR_SMOOTHING_ENABLED": 251, "NVML_FI_PWR_SMOOTHING_PRIV_LVL": 252,
            "NVML_FI_PWR_SMOOTHING_IMM_RAMP_DOWN_ENABLED": 253,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 269,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 270,
            "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 271}
# Driver branch -> its header's ids; a driver is answered with the newest branch at or below its own
# (older than 535: 535's).
# By (branch, release): 580.82 renumbered the counters within its branch (NVML's known issues:
# "changed between 13.0 and 13.0U1/v580TRD2").
FAKE_FIELD_IDS: dict[tuple[int, int], dict[str, int]] = {
    (535, 0): _IDS_535, (550, 0): _IDS_550, (555, 0): _IDS_535, (560, 0): _IDS_550, (570, 0): _IDS_570,
    (575, 0): _IDS_575, (580, 0): _IDS_575, (580, 82): _IDS_590,
    (590, 0): _IDS_590, (595, 0): _IDS_590, (610, 0): _IDS_590, (615, 0): _IDS_590,
}
# nvmlFieldValue_t.valueType (nvml.h's nvmlValueType_t: 1 unsigned int, 3 unsigned long long) of
# the fields the scenarios give; any other is an unsigned long long.
VALUE_UINT, VALUE_ULL = 1, 3
_UINT_FIELDS = frozenset({
    "NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_PCIE_REPLAY_COUNTER", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    "NVML_FI_DEV_RESET_STATUS", "NVML_FI_DEV_DRAIN_AND_RESET_STATUS", "NVML_FI_DEV_ECC_CURRENT",
    "NVML_FI_DEV_ECC_PENDING", "NVML_FI_DEV_RETIRED_PENDING", "NVML_FI_DEV_REMAPPED_PENDING",
    "NVML_FI_DEV_REMAPPED_FAILURE", "NVML_FI_DEV_POWER_CURRENT_LIMIT", "NVML_FI_DEV_POWER_REQUESTED_LIMIT",
    "NVML_FI_PWR_SMOOTHING_ENABLED",
})
# Memory error types, counter types and the DRAM location, as nvml.h numbers them.
_CORRECTED, _UNCORRECTED, _VOLATILE, _AGGREGATE, _DRAM_LOCATION = 0, 1, 0, 1, 2
# Retirement causes: multiple single-bit errors, a double-bit error.
_SBE_CAUSE, _DBE_CAUSE = 0, 1


def fake_field_ids(driver_version: str) -> dict[str, int]:
    """The field ids the header of ``driver_version``'s branch and release gives ("570.86.15": 570's,
    "580.82.07": 580.82's)."""
    parts = [int(p) for p in driver_version.split(".")[:2]]
    release = (parts[0], parts[1] if len(parts) > 1 else 0)
    return FAKE_FIELD_IDS[max((k for k in FAKE_FIELD_IDS if k <= release), default=min(FAKE_FIELD_IDS))]


def _derived_fields(card: FakeCard) -> dict[str, int]:
    """The fields that repeat a single call, from that call's value in the card's health."""
    health = card.health
    found: dict[str, int] = {}
    if health.ecc_mode is not None:
        found.update(NVML_FI_DEV_ECC_CURRENT=int(health.ecc_mode[0]), NVML_FI_DEV_ECC_PENDING=int(health.ecc_mode[1]))
        if health.ecc_mode[0]:  # counted only while ECC is on, as nvmlDeviceGetMemoryErrorCounter
            for name, key in (("SBE_VOL", (_CORRECTED, _VOLATILE)), ("DBE_VOL", (_UNCORRECTED, _VOLATILE)),
                              ("SBE_AGG", (_CORRECTED, _AGGREGATE)), ("DBE_AGG", (_UNCORRECTED, _AGGREGATE))):
                count = health.ecc_counts.get((*key, _DRAM_LOCATION))
                if count is not None:
                    found[f"NVML_FI_DEV_ECC_{name}_DEV"] = count
    if health.retired_pages is not None:
        found["NVML_FI_DEV_RETIRED_SBE"] = len(health.retired_pages.get(_SBE_CAUSE, ()))
        found["NVML_FI_DEV_RETIRED_DBE"] = len(health.retired_pages.get(_DBE_CAUSE, ()))
    if health.retired_pending is not None:
        found["NVML_FI_DEV_RETIRED_PENDING"] = int(health.retired_pending)
    if health.remapped_rows is not None and not card.mig_enabled:  # as GetRemappedRows: not in MIG mode
        for name, value in zip(("COR", "UNC", "PENDING", "FAILURE"), health.remapped_rows, strict=True):
            found[f"NVML_FI_DEV_REMAPPED_{name}"] = int(value)
    enforced, requested = health.power_limits_mw[0], health.power_limits_mw[1]
    if enforced is not None:
        found["NVML_FI_DEV_POWER_CURRENT_LIMIT"] = enforced
    if requested is not None:
        found["NVML_FI_DEV_POWER_REQUESTED_LIMIT"] = requested
    return found


def field_answers(card: FakeCard, driver_version: str) -> dict[int, tuple[int, int | None, int]]:
    """What nvmlDeviceGetFieldValues answers for each field id the card's driver knows:
    ``id -> (nvmlReturn, value or None, valueType)``; an id not listed answers NOT_SUPPORTED."""
    ids = fake_field_ids(driver_version)
    values = {**_derived_fields(card), **card.health.fields}
    found: dict[int, tuple[int, int | None, int]] = {
        ids[name]: (NVML_SUCCESS, value, VALUE_UINT if name in _UINT_FIELDS else VALUE_ULL)
        for name, value in values.items() if name in ids and value is not None}
    for key, code in card.health.field_errors.items():
        fid = ids.get(key) if isinstance(key, str) else key
        if fid is not None:
            found[fid] = (code, None, VALUE_ULL)
    return found


# Calls that name a device by handle in their first argument.
_NO_HANDLE = frozenset({
    "nvmlInitWithFlags", "nvmlInit_v2", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetProcessName",
    "nvmlSystemGetNVMLVersion",
    "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
})

# -- XID events (src/mig_exporter/sources/xid.py) ------------------------------------------------
# An event set is a token of its own, never a device handle. The XIDs a test queues with
# ``FakeNvml.emit_xid`` wait, in order, for the first nvmlEventSetWait_v2 on a set where their card
# is registered. A wait on a set holding a card whose ``errors`` name nvmlEventSetWait_v2 (or "*")
# answers that code (GPU_IS_LOST: the card fell off the bus); one with nothing to deliver answers
# TIMEOUT after its timeout. Registering on a MIG handle answers NOT_SUPPORTED (NVML's events are
# the card's; an event on an instance carries its GPU and compute instance ids).
_SIGNATURES.update({
    "nvmlEventSetCreate": ((_P,), c_int),
    "nvmlEventSetFree": ((_P,), c_int),
    "nvmlDeviceRegisterEvents": ((_P, c_ulonglong, _P), c_int),
    "nvmlDeviceGetSupportedEventTypes": ((_P, _P), c_int),
    "nvmlEventSetWait_v2": ((_P, _P, c_uint), c_int),
})
_NO_HANDLE = _NO_HANDLE | {"nvmlEventSetCreate", "nvmlEventSetFree", "nvmlEventSetWait_v2"}
# What every card answers to nvmlDeviceGetSupportedEventTypes: ECC, P-state, XID and clock events.
SUPPORTED_EVENTS = (pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
                    | pynvml.nvmlEventTypePState | pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeClock)
_EVENT_SET_TOKEN = 0x7E000000  # the first event set's; each next one is one more
_EVENT_POLL_S = 0.05  # how soon a waiting nvmlEventSetWait_v2 sees a scenario swapped under it


class _FakeEvents:
    """The event sets (token -> cards registered) and the XIDs queued, behind one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sets: dict[int, set[int]] = {}
        self.next_token = _EVENT_SET_TOKEN
        self.queue: list[tuple[int, int, int, int]] = []  # card, xid, gpu instance, compute instance


# -- Process utilisation ------------------------------------------------------------------------------
# The driver samples a whole card's processes once a period and keeps the samples for a while; how
# long is not documented (nvmlDeviceGetProcessUtilization: "all the samples maintained by the driver's
# internal sample buffer"). The fake's choice: the last two minutes. A period's samples carry the
# wall-clock time (us) at its end; the fake's periods end on multiples of the period of its own
# monotonic clock, so a wall clock stepped back stamps the next ones earlier than the last, as a
# driver stamping with the CPU's clock would.
PROCESS_SAMPLE_BUFFER_S = 120.0


# -- GPM (src/mig_exporter/sources/nvml_activity.py) --------------------------------------------------
# A sample (nvmlGpmSampleAlloc) is a token of its own, never a device handle. Filling it
# (nvmlGpmMigSampleGet on the parent card and a GPU instance id, nvmlGpmSampleGet on a whole card)
# keeps, at the fake's clock (``FakeNvml.now``), the integral over time of each scripted percent of
# its GPU instance or card: counters that grow with time as the hardware's do. nvmlGpmMetricsGet
# answers (integral at sample2 - at sample1) / (time between them), so a window of N s at a
# scripted activity gives that activity, and a script changed halfway (``set_scenario``) the
# average over time. The counters are kept per (card UUID, GPU instance id or None, members): a GPU
# instance destroyed and made again under the same id counts from zero again, and two samples
# across that change give garbage, as counters that restarted would. The fake's choices where
# NVML's documentation is silent:
# - nvmlGpmMigSampleGet on a GPU instance id the card does not have (never made, or destroyed)
#   answers NOT_FOUND; on a MIG handle INVALID_ARGUMENT (it takes the parent); on a card in MIG
#   mode, nvmlGpmSampleGet answers NOT_SUPPORTED (a MIG handle samples its GPU instance); on a card
#   without GPM every sampling call answers NOT_SUPPORTED;
# - nvmlGpmMetricsGet: version other than 1 ARGUMENT_VERSION_MISMATCH; numMetrics 0 or past 98
#   (the smallest NVML_GPM_METRIC_MAX of any nvml.h, nvidia-ml-py 12.560's) INVALID_ARGUMENT; a
#   sample not allocated, freed or never filled, or samples of two different devices,
#   INVALID_ARGUMENT; two samples less than 100 ms apart give 0 for every metric (NVML: the
#   interval "should be greater than 100ms due to the internal sample refresh rate"; DCGM:
#   "collection at higher frequencies will result in zeroes"). Only metrics[0:numMetrics] is read
#   or written, at nvml.h's offsets, and the struct's size is never checked: pynvml sizes it by its
#   own NVML_GPM_METRIC_MAX (210 in 13.580.65, 477 in 13.615.71) under the same version. The
#   percent metrics (ids 1-13) answer; any other id answers NOT_SUPPORTED in its own nvmlReturn;
#   a scripted NaN or Inf is answered as it is, with SUCCESS; a GPU instance without a compute
#   instance samples, but each of its metrics answers NO_DATA (DCGM's DcgmGpmManager.cpp skips such a
#   GPU instance and answers blank values: it has no data, never a measured 0).
_SIGNATURES.update({
    "nvmlGpmQueryDeviceSupport": ((_P, _P), c_int),
    "nvmlGpmSampleAlloc": ((_P,), c_int),
    "nvmlGpmSampleFree": ((_P,), c_int),
    "nvmlGpmSampleGet": ((_P, _P), c_int),
    "nvmlGpmMigSampleGet": ((_P, c_uint, _P), c_int),
    "nvmlGpmMetricsGet": ((_P,), c_int),
})
_NO_HANDLE = _NO_HANDLE | {"nvmlGpmSampleAlloc", "nvmlGpmSampleFree", "nvmlGpmMetricsGet"}
_GPM_SAMPLE_TOKEN = 0x6A000000  # the first sample's; each next one is one more
GPM_METRICS_MAX_OLDEST = 98
GPM_PERCENT_METRICS = frozenset(range(1, 14))
_GPM_MIN_INTERVAL_S = 0.1
# nvmlGpmMetricsGet_t as nvml.h lays it out: version, numMetrics, sample1, sample2, then
# nvmlGpmMetric_t {metricId, nvmlReturn, value (double), metricInfo (three char *)}.
_GPM_METRICS_AT, _GPM_METRIC_BYTES = 24, 40
# A GPM counter's key: card UUID, GPU instance id (None: the whole card), the instance's members.
_GpmKey = tuple[str, "int | None", frozenset[tuple[int, str]]]


@dataclass
class _GpmSample:
    """What a filled sample holds: whose counters, when, and their integrals (percent x seconds);
    ``odd``: the scripted metrics that were NaN or Inf then."""

    key: _GpmKey
    at_s: float
    totals: dict[int, float]
    odd: dict[int, float]


def gpm(graphics: float = 0.0, sm: float = 0.0, occupancy: float = 0.0, tensor: float = 0.0,
        dram: float = 0.0) -> dict[int, float]:
    """An activity script (percent) of the five GPM metrics the exporter reads."""
    return {pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: graphics, pynvml.NVML_GPM_METRIC_SM_UTIL: sm,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: occupancy, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: tensor,
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: dram}


def _gpm_scripts(scenario: FakeNvmlScenario) -> dict[_GpmKey, Mapping[int, float]]:
    """Every GPU instance and whole card of ``scenario`` that counts, with its activity script."""
    found: dict[_GpmKey, Mapping[int, float]] = {}
    for card in scenario.cards:
        if card.mig_enabled:
            for gi, (members, script) in card.gpu_instances().items():
                found[(card.uuid, gi, members)] = script
        else:
            found[(card.uuid, None, frozenset())] = card.activity
    return found


class _ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t, filled by the unversioned process-list symbols (pynvml no longer calls them)."""

    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]


class _Fail(Exception):
    """Raised inside a callback to answer an NVML error code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class _Target:
    """What a handle points at."""

    card_index: int
    card: FakeCard
    mig: FakeMig | None

    @property
    def label(self) -> str:
        return f"card{self.card_index}" + (f"/mig{self.mig.index}" if self.mig else "")


def _card_token(card_index: int) -> int:
    return 0x10000 + (card_index << 8)


def _mig_token(card_index: int, slot: int) -> int:
    return _card_token(card_index) + 1 + slot


class FakeNvml:
    """A fake libnvidia-ml over one scenario. ``install()`` puts it under pynvml."""

    def __init__(self, scenario: FakeNvmlScenario) -> None:
        self.scenario = scenario
        self.calls: list[FakeCall] = []
        self.exceptions: list[tuple[str, BaseException]] = []
        self.missing_lookups: list[str] = []
        self.init_count = 0
        # (symbol, how many arguments it was called with), for _FEWEST_ARGUMENTS' symbols.
        self.arities: list[tuple[str, int]] = []
        self._strings: dict[int, ctypes.Array] = {}  # nvmlErrorString buffers, kept alive
        # The fake's clock (seconds): None follows time.monotonic; ``advance`` and ``set_clock`` hold it.
        self.clock_s: float | None = None
        # The wall clock (the driver's process utilisation timestamps): the monotonic one plus this.
        self.wall_offset_s = time.time() - time.monotonic()
        # Process utilisation: each whole card's samples (taken at, monotonic us; timestamp, wall us;
        # pid, (sm, mem, enc, dec) %), oldest first, and the monotonic time (us) up to which its periods were sampled.
        self._util_samples: dict[str, list[tuple[int, int, int, tuple[int, int, int, int]]]] = {}
        self._util_made_to_us: dict[str, int] = {}
        # GPM: the counters (key -> integrated up to, metric -> percent x seconds) and the samples
        # allocated and not freed (token -> what it holds, None until filled).
        self._gpm_counters: dict[_GpmKey, tuple[float, dict[int, float]]] = {}
        self._gpm_samples: dict[int, _GpmSample | None] = {}
        self._gpm_next_token = _GPM_SAMPLE_TOKEN
        self._functions: dict[str, Any] = {}  # CFUNCTYPE objects, kept alive while installed
        for name, (argtypes, restype) in _SIGNATURES.items():
            if name not in scenario.missing_functions:
                self._functions[name] = self._callback(name, argtypes, restype)
        self.lib = FakeNvmlLibrary(self._functions, self.missing_lookups.append)
        self._saved: tuple[Any, dict, int, dict] | None = None

    # -- installing -------------------------------------------------------

    def install(self) -> FakeNvml:
        with pynvml.libLoadLock:
            if self._saved is not None:
                raise RuntimeError("this fake is already installed")
            if isinstance(pynvml.nvmlLib, FakeNvmlLibrary):
                raise RuntimeError("another fake libnvidia-ml is installed; uninstall it first")
            self._saved = (pynvml.nvmlLib, dict(pynvml._nvmlGetFunctionPointer_cache), pynvml._nvmlLib_refcount,
                           dict(pynvml.NVMLError._errcode_to_string))
            pynvml.nvmlLib = self.lib
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlLib_refcount = 0
        return self

    def uninstall(self) -> None:
        """Leave pynvml as it was: library, function cache, refcount and NVMLError's string cache."""
        with pynvml.libLoadLock:
            if self._saved is None:
                return
            lib, cache, refcount, strings = self._saved
            pynvml.nvmlLib = lib
            pynvml._nvmlGetFunctionPointer_cache.clear()
            pynvml._nvmlGetFunctionPointer_cache.update(cache)
            pynvml._nvmlLib_refcount = refcount
            # str(NVMLError) caches nvmlErrorString's answers in the class, for every later test.
            pynvml.NVMLError._errcode_to_string.clear()
            pynvml.NVMLError._errcode_to_string.update(strings)
            self._saved = None

    @property
    def installed(self) -> bool:
        return self._saved is not None

    def set_scenario(self, scenario: FakeNvmlScenario) -> None:
        """Answer from now on from ``scenario``; handles already given out stay valid by index.

        ``missing_functions`` stays as it was at construction (pynvml caches the
        symbols it found). GPM's counters count under the old activity scripts until now, and
        under the new ones from now; those of a GPU instance or card that is gone are dropped.
        """
        now = self.now()
        self._util_make(now)  # the old scripts' samples up to now
        old = _gpm_scripts(self.scenario)
        for key in list(self._gpm_counters):
            if key in old:
                self._gpm_count(key, old[key], now)
        kept = _gpm_scripts(scenario)
        self._gpm_counters = {k: v for k, v in self._gpm_counters.items() if k in kept}
        self.scenario = scenario

    # -- the fake's clock (GPM's counters) ----------------------------------

    def now(self) -> float:
        """The fake's time in seconds: what GPM's counters count by."""
        return time.monotonic() if self.clock_s is None else self.clock_s

    def set_clock(self, seconds: float) -> None:
        """Hold the clock at ``seconds`` (it never goes back)."""
        if seconds < self.now() and self.clock_s is not None:
            raise ValueError(f"the fake's clock goes forward only ({self.clock_s} -> {seconds})")
        self.clock_s = seconds

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` on (holding it from now if it followed time.monotonic)."""
        if seconds < 0:
            raise ValueError("the fake's clock goes forward only")
        self.clock_s = self.now() + seconds
        return self.clock_s

    def wall_time(self) -> float:
        """The fake's wall clock in seconds: what the driver stamps process utilisation samples with."""
        return self.now() + self.wall_offset_s

    def set_wall_clock(self, seconds: float) -> None:
        """Set the wall clock to ``seconds`` now (before any sample is made: see ``step_wall_clock``)."""
        self.wall_offset_s = seconds - self.now()

    def step_wall_clock(self, seconds: float) -> None:
        """Step the wall clock by ``seconds`` (back where negative), as NTP's step does: the samples
        up to now keep their stamps, the next ones are stamped on the new clock."""
        self._util_make(self.now())
        self.wall_offset_s += seconds

    @property
    def gpm_samples_held(self) -> int:
        """GPM samples allocated and not freed."""
        return len(self._gpm_samples)

    def called(self, function: str, device: str | None = None) -> int:
        """How many times ``function`` was called (on ``device``, "card0" or "card0/mig1", if given)."""
        return sum(1 for c in self.calls if c.function == function and (device is None or c.device == device))

    # -- plumbing ---------------------------------------------------------

    def _callback(self, name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
        kind, suffix = _process_symbol(name)
        if kind is not None:
            def impl(*args: Any) -> int:
                return self._process_list(name, kind, suffix, *args)
        else:
            impl = getattr(self, "_" + name)
        failure = self._error_string(NVML_ERROR_UNKNOWN) if restype is c_void_p else NVML_ERROR_UNKNOWN

        def thunk(*args: Any) -> Any:
            try:
                self.calls.append(self._describe(name, argtypes, args))
                return impl(*args)
            except _Fail as f:
                return f.code
            except BaseException as e:  # ctypes would hand C a garbage code
                self.exceptions.append((name, e))
                return failure

        function = ctypes.CFUNCTYPE(restype, *argtypes)(thunk)
        if name not in _FEWEST_ARGUMENTS:
            return function

        def fewer(*args: Any) -> Any:
            # ctypes refuses fewer arguments than a CFUNCTYPE declares, where C passes them.
            if len(args) < _FEWEST_ARGUMENTS[name]:
                raise TypeError(f"{name} takes at least {_FEWEST_ARGUMENTS[name]} arguments ({len(args)} given)")
            self.arities.append((name, len(args)))
            return function(*args, *(None,) * (len(argtypes) - len(args)))

        return fewer

    def _describe(self, name: str, argtypes: tuple[Any, ...], args: tuple[Any, ...]) -> FakeCall:
        device = None
        if name not in _NO_HANDLE and args:
            target = self._resolve(args[0])
            device = target.label if target else f"invalid:{args[0]}"
        scalars = tuple(a for t, a in zip(argtypes, args, strict=True) if t is not c_void_p)
        return FakeCall(name, device, scalars)

    def _resolve(self, token: int | None) -> _Target | None:
        if not token:
            return None
        cards = self.scenario.cards
        for i, card in enumerate(cards):
            if token == _card_token(i):
                return _Target(i, card, None)
            for mig in card.mig_devices:
                if token == _mig_token(i, mig.index):
                    return _Target(i, card, mig)
        return None

    def _require_init(self, name: str) -> None:
        if self.init_count <= 0:
            raise _Fail(NVML_ERROR_UNINITIALIZED)
        code = self.scenario.system_errors.get(name)
        if code is not None:
            raise _Fail(code)

    def _device(self, name: str, token: int | None) -> _Target:
        """The handle's target, after init and the scenario's injected errors."""
        if self.init_count <= 0:
            raise _Fail(NVML_ERROR_UNINITIALIZED)
        target = self._resolve(token)
        if target is None:
            raise _Fail(NVML_ERROR_INVALID_ARGUMENT)
        for errors in (target.card.errors, target.mig.errors if target.mig else {}):
            code = errors.get(name, errors.get("*"))
            if code is not None:
                raise _Fail(code)
        return target

    def _error_string(self, code: int) -> int:
        if code not in self._strings:
            self._strings[code] = ctypes.create_string_buffer(_ERROR_STRINGS.get(code, "Unknown Error").encode())
        return ctypes.addressof(self._strings[code])

    # -- system -----------------------------------------------------------

    def _nvmlInitWithFlags(self, flags: int) -> int:
        if self.scenario.init_error is not None:
            return self.scenario.init_error
        self.init_count += 1
        return NVML_SUCCESS

    def _nvmlInit_v2(self) -> int:
        return self._nvmlInitWithFlags(0)

    def _nvmlShutdown(self) -> int:
        if self.init_count <= 0:
            return NVML_ERROR_UNINITIALIZED
        self.init_count -= 1
        return NVML_SUCCESS

    def _nvmlErrorString(self, code: int) -> int:
        return self._error_string(code)

    def _nvmlSystemGetDriverVersion(self, buf: int | None, length: int) -> int:
        self._require_init("nvmlSystemGetDriverVersion")
        return _write_string(buf, length, self.scenario.driver_version)

    def _nvmlSystemGetNVMLVersion(self, buf: int | None, length: int) -> int:
        self._require_init("nvmlSystemGetNVMLVersion")
        return _write_string(buf, length, self.scenario.nvml_version_text)

    def _nvmlSystemGetCudaDriverVersion(self, out: int | None) -> int:
        self._require_init("nvmlSystemGetCudaDriverVersion")
        return _write_uint(out, self.scenario.cuda_version, c_int)

    def _nvmlSystemGetCudaDriverVersion_v2(self, out: int | None) -> int:
        self._require_init("nvmlSystemGetCudaDriverVersion_v2")
        return _write_uint(out, self.scenario.cuda_version, c_int)

    def _nvmlSystemGetProcessName(self, pid: int, buf: int | None, length: int) -> int:
        self._require_init("nvmlSystemGetProcessName")
        name = self.scenario.process_names.get(pid)
        if name is None:
            return NVML_ERROR_NOT_FOUND
        return _write_string(buf, length, name)

    def _nvmlDeviceGetCount_v2(self, out: int | None) -> int:
        self._require_init("nvmlDeviceGetCount_v2")
        return _write_uint(out, len(self.scenario.cards))

    def _nvmlDeviceGetHandleByIndex_v2(self, index: int, out: int | None) -> int:
        self._require_init("nvmlDeviceGetHandleByIndex_v2")
        if out is None or index >= len(self.scenario.cards):
            return NVML_ERROR_INVALID_ARGUMENT
        code = self.scenario.cards[index].errors.get("nvmlDeviceGetHandleByIndex_v2")
        if code is not None:
            return code
        return _write_handle(out, _card_token(index))

    # -- identity ---------------------------------------------------------

    def _nvmlDeviceGetIndex(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetIndex", handle)
        if t.mig:  # the fake's choice: a MIG device has no NVML index of its own
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, t.card_index)

    def _nvmlDeviceGetName(self, handle: int | None, buf: int | None, length: int) -> int:
        t = self._device("nvmlDeviceGetName", handle)
        name = f"{t.card.name} MIG {t.mig.profile}" if t.mig else t.card.name
        return _write_string(buf, length, name)

    def _nvmlDeviceGetUUID(self, handle: int | None, buf: int | None, length: int) -> int:
        t = self._device("nvmlDeviceGetUUID", handle)
        return _write_string(buf, length, t.mig.uuid if t.mig else t.card.uuid)

    def _nvmlDeviceGetPciInfo_v3(self, handle: int | None, out: int | None) -> int:
        # The fake's choice: a MIG handle answers its parent's PCI identity.
        t = self._device("nvmlDeviceGetPciInfo_v3", handle)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        domain, bus, rest = t.card.pci_bus_id.split(":")
        device = rest.split(".")[0]
        info = ctypes.cast(out, POINTER(pynvml.nvmlPciInfo_t)).contents
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(device, 16)
        info.pciDeviceId = t.card.pci_device_id
        info.pciSubSystemId = t.card.pci_subsystem_id
        info.busId = t.card.pci_bus_id.encode()
        info.busIdLegacy = f"{int(domain, 16):04x}:{bus}:{rest}".upper().encode()
        return NVML_SUCCESS

    # -- MIG --------------------------------------------------------------

    def _nvmlDeviceGetMigMode(self, handle: int | None, current: int | None, pending: int | None) -> int:
        t = self._device("nvmlDeviceGetMigMode", handle)
        if t.mig or t.card.mig_mode is None:
            return NVML_ERROR_NOT_SUPPORTED
        if current is None or pending is None:
            return NVML_ERROR_INVALID_ARGUMENT
        c_uint.from_address(current).value = int(t.card.mig_mode[0])
        c_uint.from_address(pending).value = int(t.card.mig_mode[1])
        return NVML_SUCCESS

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle: int | None, out: int | None) -> int:
        # NVML: "Returns zero if MIG is not supported or enabled".
        t = self._device("nvmlDeviceGetMaxMigDeviceCount", handle)
        if t.mig:  # the fake's choice for a MIG handle
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_uint(out, t.card.max_mig_devices if t.card.mig_enabled else 0)

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int | None, index: int, out: int | None) -> int:
        t = self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if t.mig or out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        if not t.card.mig_enabled:
            return NVML_ERROR_NOT_SUPPORTED
        if index >= t.card.max_mig_devices:
            return NVML_ERROR_INVALID_ARGUMENT
        if t.card.mig_in_slot(index) is None:
            return NVML_ERROR_NOT_FOUND
        return _write_handle(out, _mig_token(t.card_index, index))

    def _nvmlDeviceIsMigDeviceHandle(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceIsMigDeviceHandle", handle)
        return _write_uint(out, int(t.mig is not None))

    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
        if t.mig is None or out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_handle(out, _card_token(t.card_index))

    def _nvmlDeviceGetGpuInstanceId(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetGpuInstanceId", handle)
        if t.mig is None:
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, t.mig.gpu_instance_id)

    def _nvmlDeviceGetComputeInstanceId(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetComputeInstanceId", handle)
        if t.mig is None:
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, t.mig.compute_instance_id)

    # -- readings ---------------------------------------------------------

    def _nvmlDeviceGetTemperature(self, handle: int | None, sensor: int, out: int | None) -> int:
        t = self._device("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            return NVML_ERROR_INVALID_ARGUMENT
        if t.mig or t.card.temperature_c is None:
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, t.card.temperature_c)

    def _nvmlDeviceGetPowerUsage(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetPowerUsage", handle)
        if t.mig or t.card.power_mw is None:
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, t.card.power_mw)

    def _nvmlDeviceGetUtilizationRates(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetUtilizationRates", handle)
        if t.mig or t.card.mig_enabled or t.card.gpu_util_percent is None:
            return NVML_ERROR_NOT_SUPPORTED
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        util = ctypes.cast(out, POINTER(pynvml.c_nvmlUtilization_t)).contents
        util.gpu = t.card.gpu_util_percent
        util.memory = t.card.memory_util_percent
        return NVML_SUCCESS

    def _memory(self, name: str, handle: int | None) -> FakeMemory:
        t = self._device(name, handle)
        memory = t.mig.memory if t.mig else t.card.memory
        if memory is None:
            raise _Fail(NVML_ERROR_NOT_SUPPORTED)
        return memory

    def _nvmlDeviceGetMemoryInfo(self, handle: int | None, out: int | None) -> int:
        # v1 has no "reserved": its used is reserved + allocated, and total = free + used.
        m = self._memory("nvmlDeviceGetMemoryInfo", handle)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        info = ctypes.cast(out, POINTER(pynvml.c_nvmlMemory_t)).contents
        info.total, info.free, info.used = m.total_bytes, m.free_bytes, m.reserved_bytes + m.used_bytes
        return NVML_SUCCESS

    def _nvmlDeviceGetMemoryInfo_v2(self, handle: int | None, out: int | None) -> int:
        m = self._memory("nvmlDeviceGetMemoryInfo_v2", handle)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        info = ctypes.cast(out, POINTER(pynvml.c_nvmlMemory_v2_t)).contents
        if info.version != pynvml.nvmlMemory_v2:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        info.total, info.reserved, info.used, info.free = m.total_bytes, m.reserved_bytes, m.used_bytes, m.free_bytes
        return NVML_SUCCESS

    # -- card health --------------------------------------------------------
    # Answered from FakeCard.health; a value it does not hold is NOT_SUPPORTED, and a MIG handle
    # answers NOT_SUPPORTED (as for temperature and power), but for its own ECC counter.

    def _card_only(self, name: str, handle: int | None) -> _Target:
        t = self._device(name, handle)
        if t.mig:
            raise _Fail(NVML_ERROR_NOT_SUPPORTED)
        return t

    def _health(self, name: str, handle: int | None) -> FakeHealth:
        return self._card_only(name, handle).card.health

    def _nvmlDeviceGetTemperatureV(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlDeviceGetTemperatureV", handle)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        reading = ctypes.cast(out, POINTER(pynvml.c_nvmlTemperature_v1_t)).contents
        if reading.version != pynvml.nvmlTemperature_v1:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if reading.sensorType != pynvml.NVML_TEMPERATURE_GPU:
            return NVML_ERROR_INVALID_ARGUMENT
        if t.mig or t.card.temperature_c is None:
            return NVML_ERROR_NOT_SUPPORTED
        reading.temperature = t.card.temperature_c
        return NVML_SUCCESS

    def _clock(self, name: str, handle: int | None, clock: int, out: int | None, table: str) -> int:
        clocks = getattr(self._health(name, handle), table)
        if not 0 <= clock < pynvml.NVML_CLOCK_COUNT:
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_uint(out, _given(clocks.get(clock)))

    def _nvmlDeviceGetClockInfo(self, handle: int | None, clock: int, out: int | None) -> int:
        return self._clock("nvmlDeviceGetClockInfo", handle, clock, out, "clocks_mhz")

    def _nvmlDeviceGetMaxClockInfo(self, handle: int | None, clock: int, out: int | None) -> int:
        return self._clock("nvmlDeviceGetMaxClockInfo", handle, clock, out, "max_clocks_mhz")

    def _limit(self, name: str, handle: int | None, out: int | None, which: int) -> int:
        return _write_uint(out, _given(self._health(name, handle).power_limits_mw[which]))

    def _nvmlDeviceGetEnforcedPowerLimit(self, handle: int | None, out: int | None) -> int:
        return self._limit("nvmlDeviceGetEnforcedPowerLimit", handle, out, 0)

    def _nvmlDeviceGetPowerManagementLimit(self, handle: int | None, out: int | None) -> int:
        return self._limit("nvmlDeviceGetPowerManagementLimit", handle, out, 1)

    def _nvmlDeviceGetPowerManagementDefaultLimit(self, handle: int | None, out: int | None) -> int:
        return self._limit("nvmlDeviceGetPowerManagementDefaultLimit", handle, out, 2)

    def _nvmlDeviceGetPowerManagementLimitConstraints(self, handle: int | None, low: int | None,
                                                      high: int | None) -> int:
        limits = self._health("nvmlDeviceGetPowerManagementLimitConstraints", handle).power_limits_mw
        if low is None or high is None:
            return NVML_ERROR_INVALID_ARGUMENT
        _write_uint(low, _given(limits[3]))
        return _write_uint(high, _given(limits[4]))

    def _nvmlDeviceGetFanSpeed(self, handle: int | None, out: int | None) -> int:
        return _write_uint(out, _given(self._health("nvmlDeviceGetFanSpeed", handle).fan_percent))

    def _nvmlDeviceGetTemperatureThreshold(self, handle: int | None, threshold: int, out: int | None) -> int:
        health = self._health("nvmlDeviceGetTemperatureThreshold", handle)
        if not 0 <= threshold < pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT:
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_uint(out, _given(health.thresholds_c.get(threshold)))

    def _nvmlDeviceGetMarginTemperature(self, handle: int | None, out: int | None) -> int:
        health = self._health("nvmlDeviceGetMarginTemperature", handle)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        margin = ctypes.cast(out, POINTER(pynvml.c_nvmlMarginTemperature_v1_t)).contents
        if margin.version != pynvml.nvmlMarginTemperature_v1:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        margin.marginTemperature = _given(health.margin_c)
        return NVML_SUCCESS

    def _reasons(self, name: str, handle: int | None, out: int | None, attribute: str) -> int:
        return _write_uint(out, _given(getattr(self._health(name, handle), attribute)), c_ulonglong)

    def _nvmlDeviceGetCurrentClocksEventReasons(self, handle: int | None, out: int | None) -> int:
        return self._reasons("nvmlDeviceGetCurrentClocksEventReasons", handle, out, "clocks_event_reasons")

    def _nvmlDeviceGetSupportedClocksEventReasons(self, handle: int | None, out: int | None) -> int:
        return self._reasons("nvmlDeviceGetSupportedClocksEventReasons", handle, out,
                             "supported_clocks_event_reasons")

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int | None, out: int | None) -> int:
        return self._reasons("nvmlDeviceGetCurrentClocksThrottleReasons", handle, out, "clocks_event_reasons")

    def _nvmlDeviceGetSupportedClocksThrottleReasons(self, handle: int | None, out: int | None) -> int:
        return self._reasons("nvmlDeviceGetSupportedClocksThrottleReasons", handle, out,
                             "supported_clocks_event_reasons")

    def _nvmlDeviceGetPerformanceState(self, handle: int | None, out: int | None) -> int:
        return _write_uint(out, _given(self._health("nvmlDeviceGetPerformanceState", handle).performance_state))

    def _nvmlDeviceGetTotalEnergyConsumption(self, handle: int | None, out: int | None) -> int:
        fields = self._health("nvmlDeviceGetTotalEnergyConsumption", handle).fields
        return _write_uint(out, _given(fields.get("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION")), c_ulonglong)

    def _nvmlDeviceGetPcieReplayCounter(self, handle: int | None, out: int | None) -> int:
        fields = self._health("nvmlDeviceGetPcieReplayCounter", handle).fields
        return _write_uint(out, _given(fields.get("NVML_FI_DEV_PCIE_REPLAY_COUNTER")))

    def _nvmlDeviceGetEccMode(self, handle: int | None, current: int | None, pending: int | None) -> int:
        mode = _given(self._health("nvmlDeviceGetEccMode", handle).ecc_mode)
        if current is None or pending is None:
            return NVML_ERROR_INVALID_ARGUMENT
        _write_uint(current, int(mode[0]))
        return _write_uint(pending, int(mode[1]))

    def _nvmlDeviceGetMemoryErrorCounter(self, handle: int | None, error_type: int, counter: int, location: int,
                                         out: int | None) -> int:
        t = self._device("nvmlDeviceGetMemoryErrorCounter", handle)
        if error_type > 1 or counter > 1 or location >= pynvml.NVML_MEMORY_LOCATION_COUNT:
            return NVML_ERROR_INVALID_ARGUMENT
        if t.mig:  # a MIG handle counts only its own volatile uncorrectable SRAM errors
            count = t.mig.sram_uncorrectable_volatile if (error_type, counter, location) == _OWN_ECC else None
            return _write_uint(out, _given(count), c_ulonglong)
        health = t.card.health
        if not (health.ecc_mode and health.ecc_mode[0]):  # NVML counts nothing while ECC is off
            return NVML_ERROR_NOT_SUPPORTED
        return _write_uint(out, _given(health.ecc_counts.get((error_type, counter, location))), c_ulonglong)

    def _nvmlDeviceGetSramEccErrorStatus(self, handle: int | None, out: int | None) -> int:
        sram = _given(self._health("nvmlDeviceGetSramEccErrorStatus", handle).sram)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        status = ctypes.cast(out, POINTER(pynvml.c_nvmlEccSramErrorStatus_v1_t)).contents
        if status.version != pynvml.nvmlEccSramErrorStatus_v1:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        status.volatileUncParity, status.volatileUncSecDed = sram.volatile_parity, sram.volatile_secded
        status.aggregateUncParity, status.aggregateUncSecDed = sram.aggregate_parity, sram.aggregate_secded
        status.volatileCor, status.aggregateCor = sram.volatile_correctable, sram.aggregate_correctable
        status.bThresholdExceeded = int(sram.threshold_exceeded)
        return NVML_SUCCESS

    def _remapper(self, name: str, handle: int | None, attribute: str) -> Any:
        t = self._card_only(name, handle)
        if t.card.mig_enabled:  # NVML: not supported in MIG mode
            raise _Fail(NVML_ERROR_NOT_SUPPORTED)
        return _given(getattr(t.card.health, attribute))

    def _nvmlDeviceGetRemappedRows(self, handle: int | None, corr: int | None, unc: int | None,
                                   pending: int | None, failure: int | None) -> int:
        rows = self._remapper("nvmlDeviceGetRemappedRows", handle, "remapped_rows")
        outs = (corr, unc, pending, failure)
        if None in outs:
            return NVML_ERROR_INVALID_ARGUMENT
        for ptr, value in zip(outs, rows, strict=True):
            _write_uint(ptr, int(value))
        return NVML_SUCCESS

    def _nvmlDeviceGetRowRemapperHistogram(self, handle: int | None, out: int | None) -> int:
        banks = self._remapper("nvmlDeviceGetRowRemapperHistogram", handle, "remapper_histogram")
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        values = ctypes.cast(out, POINTER(pynvml.c_nvmlRowRemapperHistogramValues)).contents
        values.max, values.high, values.partial, values.low, values.none = banks
        return NVML_SUCCESS

    def _nvmlDeviceGetRetiredPages_v2(self, handle: int | None, cause: int, count_ptr: int | None,
                                      addresses: int | None, timestamps: int | None) -> int:
        # NVML: a count too small (0 to ask the size) answers INSUFFICIENT_SIZE with the count.
        retired = _given(self._health("nvmlDeviceGetRetiredPages_v2", handle).retired_pages)
        if count_ptr is None or cause >= pynvml.NVML_PAGE_RETIREMENT_CAUSE_COUNT:
            return NVML_ERROR_INVALID_ARGUMENT
        pages = retired.get(cause, ())
        count = c_uint.from_address(count_ptr)
        if addresses is None or count.value < len(pages):
            count.value = len(pages)
            return NVML_SUCCESS if not pages else NVML_ERROR_INSUFFICIENT_SIZE
        count.value = len(pages)
        for i, page in enumerate(pages):
            c_ulonglong.from_address(addresses + 8 * i).value = page
            if timestamps is not None:
                c_ulonglong.from_address(timestamps + 8 * i).value = RETIRED_AT + i
        return NVML_SUCCESS

    def _nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int | None, out: int | None) -> int:
        pending = _given(self._health("nvmlDeviceGetRetiredPagesPendingStatus", handle).retired_pending)
        return _write_uint(out, int(pending))

    def _nvmlDeviceGetRepairStatus(self, handle: int | None, out: int | None) -> int:
        pending = _given(self._health("nvmlDeviceGetRepairStatus", handle).repair_pending)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        status = ctypes.cast(out, POINTER(pynvml.c_nvmlRepairStatus_t)).contents
        if status.version != pynvml.nvmlRepairStatus_v1:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        status.bChannelRepairPending, status.bTpcRepairPending = int(pending[0]), int(pending[1])
        return NVML_SUCCESS

    def _nvmlDeviceGetUnrepairableMemoryFlag_v1(self, handle: int | None, out: int | None) -> int:
        # nvml.h (590+): nvmlUnrepairableMemory_v1_t {unsigned int version; unsigned int unrepairableMemory;},
        # version NVML_STRUCT_VERSION(UnrepairableMemory, 1) = 8 | 1 << 24.
        flag = _given(self._health("nvmlDeviceGetUnrepairableMemoryFlag_v1", handle).unrepairable_memory)
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        if c_uint.from_address(out).value != 0x1000008:
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        c_uint.from_address(out + 4).value = int(flag)
        return NVML_SUCCESS

    def _link(self, name: str, handle: int | None, out: int | None, which: int) -> int:
        return _write_uint(out, _given(self._health(name, handle).pcie_link)[which])

    def _nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int | None, out: int | None) -> int:
        return self._link("nvmlDeviceGetCurrPcieLinkGeneration", handle, out, 0)

    def _nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int | None, out: int | None) -> int:
        return self._link("nvmlDeviceGetMaxPcieLinkGeneration", handle, out, 1)

    def _nvmlDeviceGetCurrPcieLinkWidth(self, handle: int | None, out: int | None) -> int:
        return self._link("nvmlDeviceGetCurrPcieLinkWidth", handle, out, 2)

    def _nvmlDeviceGetMaxPcieLinkWidth(self, handle: int | None, out: int | None) -> int:
        return self._link("nvmlDeviceGetMaxPcieLinkWidth", handle, out, 3)

    def _nvmlDeviceGetSerial(self, handle: int | None, buf: int | None, length: int) -> int:
        t = self._device("nvmlDeviceGetSerial", handle)
        return _write_string(buf, length, _given(t.card.serial))  # a MIG handle answers its card's

    # -- other readings ---------------------------------------------------
    # The fake's choices: every card answers the same H100-like values; a MIG
    # handle answers NVML_ERROR_NOT_SUPPORTED, as for temperature and power.

    _PCIE_KB_PER_S: ClassVar[dict[int, int]] = {
        pynvml.NVML_PCIE_UTIL_TX_BYTES: 412, pynvml.NVML_PCIE_UTIL_RX_BYTES: 538,
    }

    def _nvmlDeviceGetEncoderUtilization(self, handle: int | None, util: int | None, period: int | None) -> int:
        self._card_only("nvmlDeviceGetEncoderUtilization", handle)
        if period is None:
            return NVML_ERROR_INVALID_ARGUMENT
        _write_uint(period, 167_000)
        return _write_uint(util, 0)

    def _nvmlDeviceGetDecoderUtilization(self, handle: int | None, util: int | None, period: int | None) -> int:
        self._card_only("nvmlDeviceGetDecoderUtilization", handle)
        if period is None:
            return NVML_ERROR_INVALID_ARGUMENT
        _write_uint(period, 167_000)
        return _write_uint(util, 0)

    def _nvmlDeviceGetPcieThroughput(self, handle: int | None, counter: int, out: int | None) -> int:
        self._card_only("nvmlDeviceGetPcieThroughput", handle)
        if counter not in self._PCIE_KB_PER_S:
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_uint(out, self._PCIE_KB_PER_S[counter])

    def _nvmlDeviceGetFieldValues(self, handle: int | None, count: int, values: int | None) -> int:
        # The call succeeds and each field carries its own answer, at the ids of the scenario's
        # driver's header (field_answers); a MIG handle supports none.
        t = self._device("nvmlDeviceGetFieldValues", handle)
        if values is None or count <= 0:
            return NVML_ERROR_INVALID_ARGUMENT
        answers = {} if t.mig else field_answers(t.card, self.scenario.driver_version)
        for entry in (pynvml.c_nvmlFieldValue_t * count).from_address(values):
            code, value, kind = answers.get(entry.fieldId, (NVML_ERROR_NOT_SUPPORTED, None, VALUE_ULL))
            entry.nvmlReturn = code
            if code == NVML_SUCCESS:
                entry.valueType = kind
                if kind == VALUE_UINT:
                    entry.value.uiVal = value
                else:
                    entry.value.ullVal = value
        return NVML_SUCCESS

    def _nvmlDeviceGetProcessUtilization(self, handle: int | None, samples: int | None, count: int | None,
                                         since: int) -> int:
        # NVML: "One utilization sample structure is returned per process running, that had some
        # non-zero utilization during the last sample period"; samples newer than ``since`` (us)
        # only, NOT_FOUND when there is none; sized by a call with a NULL array, answered
        # INSUFFICIENT_SIZE with the count. In MIG mode (a driver-535 report on an H100, research
        # section 1.5) the size query answers and the read is refused: NOT_SUPPORTED on the card,
        # INVALID_ARGUMENT on a MIG handle.
        t = self._device("nvmlDeviceGetProcessUtilization", handle)
        if count is None:
            return NVML_ERROR_INVALID_ARGUMENT
        size = c_uint.from_address(count)
        if t.mig or t.card.mig_enabled:
            if samples is None:
                size.value = 1
                return NVML_ERROR_INSUFFICIENT_SIZE
            return NVML_ERROR_INVALID_ARGUMENT if t.mig else NVML_ERROR_NOT_SUPPORTED
        found = self._util_answer(t.card, since)
        if not found:
            return NVML_ERROR_NOT_FOUND
        if samples is None or size.value < len(found):
            size.value = len(found)
            return NVML_ERROR_INSUFFICIENT_SIZE
        size.value = len(found)
        for slot, s in zip((pynvml.c_nvmlProcessUtilizationSample_t * len(found)).from_address(samples), found,
                           strict=True):
            slot.pid, slot.timeStamp, slot.smUtil, slot.memUtil = s.pid, s.timestamp_us, s.sm_percent, s.memory_percent
            slot.encUtil, slot.decUtil = s.encoder_percent, s.decoder_percent
        return NVML_SUCCESS

    def _util_make(self, now: float) -> None:
        """Sample every whole card's scripted processes (``process_activity``) for each period ended
        by ``now``, under the scenario as it is; keep PROCESS_SAMPLE_BUFFER_S of them. A card seen
        for the first time has a full buffer behind it, as under a driver running since boot."""
        now_us = int(now * 1e6)
        offset_us = int(self.wall_offset_s * 1e6)
        buffer_us = int(PROCESS_SAMPLE_BUFFER_S * 1e6)
        for card in self.scenario.cards:
            kept = self._util_samples.setdefault(card.uuid, [])
            made = self._util_made_to_us.get(card.uuid, now_us - buffer_us)
            self._util_made_to_us[card.uuid] = now_us
            if not card.mig_enabled:
                period = card.process_sample_period_us
                for k in range(max(made, now_us - buffer_us) // period + 1, now_us // period + 1):
                    kept.extend((k * period, k * period + offset_us, pid, (*shares, 0, 0)[:4])
                                for pid, shares in card.process_activity.items() if any(shares))
            while kept and kept[0][0] <= now_us - buffer_us:
                kept.pop(0)

    def _util_answer(self, card: FakeCard, since: int) -> list[FakeUtilSample]:
        """The samples newer than ``since``: the fixed ones, then those made; merged one a process
        (its mean, at its newest timestamp) where the card says so."""
        self._util_make(self.now())
        found = [s for s in card.process_samples if s.timestamp_us > since]
        made = self._util_samples.get(card.uuid, ())
        found += [FakeUtilSample(pid, stamp, *shares) for _, stamp, pid, shares in made if stamp > since]
        if not card.process_samples_merged:
            return found
        by_pid: dict[int, list[FakeUtilSample]] = {}
        for sample in found:
            by_pid.setdefault(sample.pid, []).append(sample)
        return [FakeUtilSample(pid, max(s.timestamp_us for s in its),
                               *(round(sum(getattr(s, share) for s in its) / len(its)) for share in
                                 ("sm_percent", "memory_percent", "encoder_percent", "decoder_percent")))
                for pid, its in by_pid.items()]

    # -- GPM (see "GPM" above the class) ---------------------------------------

    def _gpm_count(self, key: _GpmKey, script: Mapping[int, float], now: float) -> dict[int, float]:
        """The counters of ``key`` brought up to ``now`` under ``script``."""
        at, totals = self._gpm_counters.get(key, (now, {}))
        for metric, percent in script.items():
            if percent == percent and abs(percent) != float("inf"):
                totals[metric] = totals.get(metric, 0.0) + percent * (now - at)
        self._gpm_counters[key] = (now, totals)
        return totals

    def _gpm_fill(self, token: int | None, key: _GpmKey, script: Mapping[int, float]) -> int:
        if token not in self._gpm_samples:
            return NVML_ERROR_INVALID_ARGUMENT
        now = self.now()
        totals = self._gpm_count(key, script, now)
        odd = {m: p for m, p in script.items() if not (p == p and abs(p) != float("inf"))}
        self._gpm_samples[token] = _GpmSample(key, now, dict(totals), odd)
        return NVML_SUCCESS

    def _gpm_card(self, name: str, handle: int | None) -> _Target:
        t = self._device(name, handle)
        if not t.card.gpm_supported:
            raise _Fail(NVML_ERROR_NOT_SUPPORTED)
        return t

    def _nvmlGpmQueryDeviceSupport(self, handle: int | None, out: int | None) -> int:
        t = self._device("nvmlGpmQueryDeviceSupport", handle)  # a MIG handle answers as its card
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        support = pynvml.c_nvmlGpmSupport_t.from_address(out)
        if support.version != 1:  # NVML_GPM_SUPPORT_VERSION
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        support.isSupportedDevice = int(t.card.gpm_supported)
        return NVML_SUCCESS

    def _nvmlGpmSampleAlloc(self, out: int | None) -> int:
        self._require_init("nvmlGpmSampleAlloc")
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        token, self._gpm_next_token = self._gpm_next_token, self._gpm_next_token + 1
        self._gpm_samples[token] = None
        return _write_handle(out, token)

    def _nvmlGpmSampleFree(self, token: int | None) -> int:
        self._require_init("nvmlGpmSampleFree")
        if token not in self._gpm_samples:
            return NVML_ERROR_INVALID_ARGUMENT
        del self._gpm_samples[token]
        return NVML_SUCCESS

    def _nvmlGpmSampleGet(self, handle: int | None, token: int | None) -> int:
        t = self._gpm_card("nvmlGpmSampleGet", handle)
        card = t.card
        if t.mig is not None:
            members, script = card.gpu_instances()[t.mig.gpu_instance_id]
            return self._gpm_fill(token, (card.uuid, t.mig.gpu_instance_id, members), script)
        if card.mig_enabled:
            return NVML_ERROR_NOT_SUPPORTED
        return self._gpm_fill(token, (card.uuid, None, frozenset()), card.activity)

    def _nvmlGpmMigSampleGet(self, handle: int | None, gpu_instance: int, token: int | None) -> int:
        t = self._gpm_card("nvmlGpmMigSampleGet", handle)
        if t.mig is not None:
            return NVML_ERROR_INVALID_ARGUMENT
        if not t.card.mig_enabled:
            return NVML_ERROR_NOT_SUPPORTED
        found = t.card.gpu_instances().get(gpu_instance)
        if found is None:
            return NVML_ERROR_NOT_FOUND
        return self._gpm_fill(token, (t.card.uuid, gpu_instance, found[0]), found[1])

    def _nvmlGpmMetricsGet(self, address: int | None) -> int:
        self._require_init("nvmlGpmMetricsGet")
        if address is None:
            return NVML_ERROR_INVALID_ARGUMENT
        if c_uint.from_address(address).value != 1:  # NVML_GPM_METRICS_GET_VERSION
            return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        count = c_uint.from_address(address + 4).value
        first = self._gpm_samples.get(c_void_p.from_address(address + 8).value or 0)
        second = self._gpm_samples.get(c_void_p.from_address(address + 16).value or 0)
        if not 0 < count <= GPM_METRICS_MAX_OLDEST or first is None or second is None \
                or first.key[:2] != second.key[:2]:
            return NVML_ERROR_INVALID_ARGUMENT
        card = next((c for c in self.scenario.cards if c.uuid == second.key[0]), None)
        errors = card.gpm_metric_errors if card is not None else {}
        bare = second.key[1] is not None and not second.key[2]  # a GPU instance without a compute instance
        seconds = second.at_s - first.at_s
        for i in range(count):
            at = address + _GPM_METRICS_AT + _GPM_METRIC_BYTES * i
            metric = c_uint.from_address(at).value
            code = pynvml.NVML_ERROR_NO_DATA if bare else errors.get(
                metric, NVML_SUCCESS if metric in GPM_PERCENT_METRICS else NVML_ERROR_NOT_SUPPORTED)
            c_uint.from_address(at + 4).value = code
            if code != NVML_SUCCESS:
                continue
            if metric in second.odd:
                value = second.odd[metric]
            elif abs(seconds) < _GPM_MIN_INTERVAL_S:
                value = 0.0
            else:
                value = (second.totals.get(metric, 0.0) - first.totals.get(metric, 0.0)) / seconds
            ctypes.c_double.from_address(at + 8).value = value
        return NVML_SUCCESS

    # -- processes --------------------------------------------------------

    def _processes(self, t: _Target, kind: str) -> list[tuple[int, int, int, int]]:
        """(pid, used bytes, GI, CI) as NVML lists them for this handle."""
        attribute = _PROCESS_LISTS[kind]
        entries = []
        if t.mig is None:
            for p in getattr(t.card, attribute):
                entries.append((p.pid, _used(p), NO_INSTANCE_ID, NO_INSTANCE_ID))
        migs = [t.mig] if t.mig else sorted(t.card.mig_devices, key=lambda m: m.index)
        for mig in migs:
            for p in getattr(mig, attribute):
                entries.append((p.pid, _used(p), mig.gpu_instance_id, mig.compute_instance_id))
        return entries

    def _process_list(self, name: str, kind: str, suffix: str, handle: int | None, count_ptr: int | None,
                      infos: int | None) -> int:
        t = self._device(name, handle)
        if count_ptr is None:
            return NVML_ERROR_INVALID_ARGUMENT
        entries = self._processes(t, kind)
        if suffix == "_v3" and self.scenario.r535_struct_mismatch:
            entries = [row for pid, _, gi, ci in entries
                       for row in [(pid, R535_GARBAGE_BYTES, gi, ci)]
                       + [(bad, R535_GARBAGE_BYTES, 0, 0) for bad in R535_GARBAGE_PIDS]]
        count = c_uint.from_address(count_ptr)
        if infos is None or count.value < len(entries):
            count.value = len(entries)
            return NVML_SUCCESS if not entries else NVML_ERROR_INSUFFICIENT_SIZE
        count.value = len(entries)
        if suffix == "":
            array = (_ProcessInfoV1 * len(entries)).from_address(infos)
            for slot, (pid, used, _, _) in zip(array, entries, strict=True):
                slot.pid, slot.usedGpuMemory = pid, used
        else:
            array = (pynvml.c_nvmlProcessInfo_v2_t * len(entries)).from_address(infos)
            for slot, (pid, used, gi, ci) in zip(array, entries, strict=True):
                slot.pid, slot.usedGpuMemory, slot.gpuInstanceId, slot.computeInstanceId = pid, used, gi, ci
        return NVML_SUCCESS

    # -- XID events (see _FakeEvents) -------------------------------------

    @property
    def _events(self) -> _FakeEvents:
        return self.__dict__.setdefault("_xid_events", _FakeEvents())  # made at first use

    def emit_xid(self, card_index: int, xid: int, gpu_instance_id: int | None = None,
                 compute_instance_id: int | None = None) -> None:
        """Queue XID ``xid`` on card ``card_index``, on the MIG instance its ids name if given."""
        events = self._events
        with events.cond:
            events.queue.append((card_index, xid, NO_INSTANCE_ID if gpu_instance_id is None else gpu_instance_id,
                                 NO_INSTANCE_ID if compute_instance_id is None else compute_instance_id))
            events.cond.notify_all()

    def _nvmlEventSetCreate(self, out: int | None) -> int:
        self._require_init("nvmlEventSetCreate")
        if out is None:
            return NVML_ERROR_INVALID_ARGUMENT
        events = self._events
        with events.cond:
            token = events.next_token
            events.next_token += 1
            events.sets[token] = set()
        return _write_handle(out, token)

    def _nvmlEventSetFree(self, event_set: int | None) -> int:
        self._require_init("nvmlEventSetFree")
        with self._events.cond:
            return NVML_SUCCESS if self._events.sets.pop(event_set or 0, None) is not None \
                else NVML_ERROR_INVALID_ARGUMENT

    def _nvmlDeviceGetSupportedEventTypes(self, handle: int | None, out: int | None) -> int:
        self._card_only("nvmlDeviceGetSupportedEventTypes", handle)
        return _write_uint(out, SUPPORTED_EVENTS, c_ulonglong)

    def _nvmlDeviceRegisterEvents(self, handle: int | None, types: int, event_set: int | None) -> int:
        t = self._card_only("nvmlDeviceRegisterEvents", handle)
        if types & ~SUPPORTED_EVENTS:
            return NVML_ERROR_NOT_SUPPORTED
        with self._events.cond:
            cards = self._events.sets.get(event_set or 0)
            if cards is None:
                return NVML_ERROR_INVALID_ARGUMENT
            cards.add(t.card_index)
        return NVML_SUCCESS

    def _nvmlEventSetWait_v2(self, event_set: int | None, data: int | None, timeout_ms: int) -> int:
        self._require_init("nvmlEventSetWait_v2")
        events = self._events
        deadline = time.monotonic() + timeout_ms / 1000
        with events.cond:
            while True:
                cards = events.sets.get(event_set or 0)
                if cards is None or data is None:
                    return NVML_ERROR_INVALID_ARGUMENT
                for card in sorted(cards):
                    errors = self.scenario.cards[card].errors if card < len(self.scenario.cards) else {}
                    code = errors.get("nvmlEventSetWait_v2", errors.get("*"))
                    if code is not None:
                        return code
                for i, (card, xid, gi, ci) in enumerate(events.queue):
                    if card in cards:
                        del events.queue[i]
                        return _write_event(data, _card_token(card), xid, gi, ci)
                left = deadline - time.monotonic()
                if left <= 0:
                    return pynvml.NVML_ERROR_TIMEOUT
                events.cond.wait(min(left, _EVENT_POLL_S))


def _write_event(data: int, device: int, xid: int, gi: int, ci: int) -> int:
    event = pynvml.c_nvmlEventData_t.from_address(data)
    c_void_p.from_address(data + pynvml.c_nvmlEventData_t.device.offset).value = device
    event.eventType = pynvml.nvmlEventTypeXidCriticalError
    event.eventData, event.gpuInstanceId, event.computeInstanceId = xid, gi, ci
    return NVML_SUCCESS


def _process_symbol(name: str) -> tuple[str | None, str]:
    for kind in _PROCESS_LISTS:
        stem = f"nvmlDeviceGet{kind}RunningProcesses"
        if name.startswith(stem):
            return kind, name[len(stem):]
    return None, ""


def _used(p: FakeProcess) -> int:
    return UNKNOWN_MEMORY if p.used_bytes is None else p.used_bytes


def _write_uint(ptr: int | None, value: int, ctype: Any = c_uint) -> int:
    if ptr is None:
        return NVML_ERROR_INVALID_ARGUMENT
    ctype.from_address(ptr).value = value
    return NVML_SUCCESS


def _given(value: Any) -> Any:
    """``value``, or NVML_ERROR_NOT_SUPPORTED where the scenario holds none."""
    if value is None:
        raise _Fail(NVML_ERROR_NOT_SUPPORTED)
    return value


def _write_handle(ptr: int, token: int) -> int:
    c_void_p.from_address(ptr).value = token
    return NVML_SUCCESS


def _write_string(buf: int | None, length: int, text: str) -> int:
    """Copy ``text`` NUL-terminated into a caller's buffer of ``length`` bytes.

    Lone surrogates (``"\\udcff"``) become the raw bytes they stand for, so a
    scenario can hold a process name that is not UTF-8, as Linux allows."""
    if buf is None:
        return NVML_ERROR_INVALID_ARGUMENT
    data = text.encode("utf-8", errors="surrogateescape") + b"\0"
    if len(data) > length:
        return NVML_ERROR_INSUFFICIENT_SIZE
    ctypes.memmove(buf, data, len(data))
    return NVML_SUCCESS


def install_fake_nvml(scenario: FakeNvmlScenario | str) -> FakeNvml:
    """A fake libnvidia-ml installed under pynvml, for a name from ``SCENARIOS`` or a scenario;
    ``uninstall()`` leaves pynvml as it was."""
    return FakeNvml(SCENARIOS[scenario]() if isinstance(scenario, str) else scenario).install()


@contextmanager
def fake_nvml(scenario: FakeNvmlScenario | str) -> Iterator[FakeNvml]:
    """Install a fake libnvidia-ml under pynvml for the block, then leave pynvml as it was."""
    fake = install_fake_nvml(scenario)
    try:
        yield fake
    finally:
        fake.uninstall()


# ---------------------------------------------------------------------------
# Scenarios: the same machines as tests/fixtures/nvidia-smi/ and the bundled demo
# ---------------------------------------------------------------------------


def mib(n: int) -> int:
    return n * MIB


def _mem(total: int, reserved: int, used: int, free: int) -> FakeMemory:
    """A memory block from MiB values, as the fixtures write them."""
    return FakeMemory(mib(total), mib(reserved), mib(used), mib(free))


def _proc(pid: int, used_mib: int | None) -> FakeProcess:
    return FakeProcess(pid, None if used_mib is None else mib(used_mib))


# Every clock-event reason nvidia-smi lists: what the fixtures' cards support.
ALL_CLOCK_EVENT_REASONS = sum(getattr(pynvml, f"nvmlClocksEventReason{suffix}") for suffix in (
    "GpuIdle", "ApplicationsClocksSetting", "SwPowerCap", "HwSlowdown", "SyncBoost", "SwThermalSlowdown",
    "HwThermalSlowdown", "HwPowerBrakeSlowdown", "DisplayClockSetting"))
_GRAPHICS, _SM, _MEM, _VIDEO = (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_MEM,
                                pynvml.NVML_CLOCK_VIDEO)


def _clocks(graphics: int, sm: int, memory: int, video: int) -> dict[int, int]:
    return {_GRAPHICS: graphics, _SM: sm, _MEM: memory, _VIDEO: video}


def _thresholds(shutdown: int, slowdown: int, gpu_max: int, memory_max: int | None) -> dict[int, int]:
    """nvidia-smi's gpu_temp_max_threshold, _slow_threshold, _max_gpu_threshold, _max_mem_threshold."""
    found = {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: shutdown, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: slowdown,
             pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: gpu_max}
    if memory_max is not None:
        found[pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX] = memory_max
    return found


def _sram_dram(volatile: tuple[int, int, int, int], aggregate: tuple[int, int, int, int]) -> dict:
    """ecc_counts from nvidia-smi's order: sram corrected, sram uncorrected, dram corrected, dram uncorrected."""
    found = {}
    for counter, counts in ((pynvml.NVML_VOLATILE_ECC, volatile), (pynvml.NVML_AGGREGATE_ECC, aggregate)):
        for (error, location), count in zip(
                ((pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_LOCATION_SRAM),
                 (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_LOCATION_SRAM),
                 (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_LOCATION_DRAM),
                 (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_LOCATION_DRAM)), counts, strict=True):
            found[error, counter, location] = count
    return found


NO_ECC_ERRORS = _sram_dram((0, 0, 0, 0), (0, 0, 0, 0))


def _fixture_health(*, memory_c: int | None, limits_w: tuple[int, int, int, int, int], clocks: dict[int, int],
                    max_clocks: dict[int, int], thresholds: dict[int, int], energy_j: int,
                    drain_flag: bool = True, **more: Any) -> FakeHealth:
    """A card of the nvidia-smi fixtures (driver 535/550): P0, no fan, every clock-event reason supported
    and none active, ECC on without errors, no PCIe replays, neither a reset required nor a drain
    recommended (gpu_reset_status), unless ``more`` says otherwise. The 550 fixtures' XML has no
    clock-event counters, recovery action, SRAM status, repair status or margin: NVML answers
    NOT_SUPPORTED there. The energy is NVML's alone (nvidia-smi -q -x has none)."""
    fields = {"NVML_FI_DEV_PCIE_REPLAY_COUNTER": 0, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": energy_j * 1000,
              "NVML_FI_DEV_RESET_STATUS": 0}
    if drain_flag:  # drain_and_reset_recommended N/A where False
        fields["NVML_FI_DEV_DRAIN_AND_RESET_STATUS"] = 0
    if memory_c is not None:
        fields["NVML_FI_DEV_MEMORY_TEMP"] = memory_c
    values: dict[str, Any] = dict(
        fields=fields, thresholds_c=thresholds, clocks_event_reasons=0,
        supported_clocks_event_reasons=ALL_CLOCK_EVENT_REASONS, performance_state=0, clocks_mhz=clocks,
        max_clocks_mhz=max_clocks, power_limits_mw=tuple(w * 1000 for w in limits_w), ecc_mode=(True, True),
        ecc_counts=NO_ECC_ERRORS)
    return FakeHealth(**{**values, **more})


def _counting_sram(*migs: FakeMig, errors: Mapping[int, int] | None = None) -> tuple[FakeMig, ...]:
    """MIG devices with their own volatile uncorrectable SRAM count: ``errors`` by slot, else 0."""
    return tuple(replace(m, sram_uncorrectable_volatile=(errors or {}).get(m.index, 0)) for m in migs)


A100_THRESHOLDS = _thresholds(92, 89, 85, 95)
A100_LIMITS_W = (400, 400, 400, 100, 400)
HOPPER_THRESHOLDS = _thresholds(92, 89, 87, 95)
HOPPER_LIMITS_W = (700, 700, 700, 200, 700)


def _a100(memory_c: int, memory_mhz: int, energy_j: int, **more: Any) -> FakeHealth:
    """An A100 of the fixtures: 1410 MHz graphics and SM, video 1275 (max 1290)."""
    return _fixture_health(memory_c=memory_c, limits_w=A100_LIMITS_W, thresholds=A100_THRESHOLDS, energy_j=energy_j,
                           clocks=_clocks(1410, 1410, memory_mhz, 1275),
                           max_clocks=_clocks(1410, 1410, memory_mhz, 1290), **more)


def _hopper(memory_c: int, margin_c: int, memory_mhz: int, energy_j: int) -> FakeHealth:
    """An H100/H200 of the fixtures: 1980 MHz graphics and SM, video 1755 (max 1545), T.Limit margin."""
    return _fixture_health(memory_c=memory_c, limits_w=HOPPER_LIMITS_W, thresholds=HOPPER_THRESHOLDS,
                           energy_j=energy_j, margin_c=margin_c, clocks=_clocks(1980, 1980, memory_mhz, 1755),
                           max_clocks=_clocks(1980, 1980, memory_mhz, 1545))


def h100_fixture_health() -> FakeHealth:
    """The health of h100-mig-processes.xml's card, for machines built from that XML (benchmarks/), less
    the energy: their snapshots are compared value for value with the XML's, which has none."""
    health = replace(_hopper(61, 35, 2619, 0), pcie_link=_FIXTURE_BOARDS["GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2"][1])
    energy = "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
    return replace(health, fields={k: v for k, v in health.fields.items() if k != energy})


A100_80GB = dict(name="NVIDIA A100-SXM4-80GB", pci_device_id=0x20B210DE, pci_subsystem_id=0x147F10DE)
A100_40GB = dict(name="NVIDIA A100-SXM4-40GB", pci_device_id=0x20B010DE, pci_subsystem_id=0x134F10DE)
# Hopper has GPM (NVML's GPM functions: "For Hopper or newer fully supported devices"); an A100 does not.
H100 = dict(name="NVIDIA H100 80GB HBM3", pci_device_id=0x233010DE, pci_subsystem_id=0x16C110DE,
            gpm_supported=True)
H200 = dict(name="NVIDIA H200", pci_device_id=0x233510DE, pci_subsystem_id=0x18BE10DE, gpm_supported=True)
# The driver's CPU timestamp (us) of the scenarios' process utilisation samples: RETIRED_AT, and on.
SAMPLED_AT_US = RETIRED_AT * 1_000_000
# What gpu_burn does to its 1g.10gb GPU instance (research capture A: pmon sm 99, mem 10).
GPU_BURN = gpm(graphics=99.0, sm=97.0, occupancy=48.0, tensor=0.0, dram=10.0)


# Each fixture card's board serial and PCIe link (current generation, max generation, current
# width, max width), as its nvidia-smi capture gives them (serial, pci/pci_gpu_link_info), by UUID.
_FIXTURE_BOARDS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "GPU-a84bba07-931d-b925-306a-0799dc6ebd71": ("1653922034781", (4, 4, 16, 16)),  # demo
    "GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96": ("1653922034512", (4, 4, 4, 16)),  # demo: a link at x4 of x16
    "GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2": ("1654123056789", (5, 5, 16, 16)),  # h100-mig-processes
    "GPU-68c6414c-e9da-201e-0c0d-1a0dc00f0e71": ("1655024011872", (5, 5, 16, 16)),  # h200-shared-gpu-instance
    "GPU-d21b54fa-8973-381f-412a-0a4f9fa42335": ("1324321002518", (4, 4, 16, 16)),  # a100-mig-nothing-carved
    "GPU-0b233931-da53-f50a-0be5-2d057e0bd04a": ("1324321002764", (4, 4, 16, 16)),
    "GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f": ("1653922035104", (4, 4, 16, 16)),  # a100-mig-pending
    "GPU-5edbada5-14e2-87ba-0547-69ba41cbb44f": ("1322021045367", (4, 4, 16, 16)),  # na-memory
    "GPU-07539038-7071-2d5f-63ad-fa395d6cff31": ("1563120043211", (1, 3, 16, 16)),  # na-memory: idle at gen 1
}


def _with_boards(build: Callable[[], FakeNvmlScenario]) -> Callable[[], FakeNvmlScenario]:
    """``build``'s scenario with each fixture card's serial and PCIe link (``_FIXTURE_BOARDS``)."""
    @functools.wraps(build)
    def built() -> FakeNvmlScenario:
        scenario = build()
        cards = []
        for card in scenario.cards:
            board = _FIXTURE_BOARDS.get(card.uuid)
            if board is not None:
                card = replace(card, serial=board[0], health=replace(card.health, pcie_link=board[1]))
            cards.append(card)
        return replace(scenario, cards=tuple(cards))
    return built


def _counters(health: FakeHealth, **ns: int) -> FakeHealth:
    """``health`` with the five clock-event counters of a 575+ header (ns; 0 unless ``ns`` names them)."""
    names = ("SW_POWER_CAP", "SYNC_BOOST", "SW_THERM_SLOWDOWN", "HW_THERM_SLOWDOWN", "HW_POWER_BRAKE_SLOWDOWN")
    counters = {f"NVML_FI_DEV_CLOCKS_EVENT_REASON_{name}": ns.get(name, 0) for name in names}
    return replace(health, fields={**health.fields, **counters})


@_with_boards
def demo() -> FakeNvmlScenario:
    """src/mig_exporter/samples/demo.xml + demo.L.txt (a 575 driver, with the clock-event counters):
    one A100 in MIG mode, one whole A100 with 8.4 s of power brake behind it, at a 38 °C margin."""
    return FakeNvmlScenario(
        driver_version="575.57.08",
        cuda_version=12090,
        cards=(
            FakeCard(
                **A100_80GB,
                uuid="GPU-a84bba07-931d-b925-306a-0799dc6ebd71",
                health=_counters(_a100(41, 1593, 5_210_333, ecc_counts=_sram_dram((0, 1, 0, 0), (0, 1, 0, 0)),
                                       clocks_event_reasons=pynvml.nvmlClocksEventReasonGpuIdle)),
                pci_bus_id="00000000:07:00.0",
                memory=_mem(81920, 562, 20971, 60387),
                mig_mode=(True, True),
                temperature_c=34,
                power_mw=87230,
                gpu_util_percent=None,
                mig_devices=_counting_sram(
                    FakeMig(0, 2, 0, "3g.40gb", "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b",
                            _mem(40192, 0, 11663, 28529), compute_processes=(_proc(48213, 11520),)),
                    FakeMig(1, 3, 0, "2g.20gb", "MIG-bd142880-e842-57ab-bec1-2975fd55911e",
                            _mem(19968, 0, 9251, 10717), compute_processes=(_proc(51877, 9216),)),
                    FakeMig(2, 9, 0, "1g.10gb", "MIG-a2cbd390-b656-5a4d-8bad-821df997d529",
                            _mem(9728, 0, 13, 9715)),
                    errors={0: 1},
                ),
            ),
            FakeCard(
                **A100_80GB,
                uuid="GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96",
                health=_counters(_a100(58, 1593, 18_602_915, ecc_counts=_sram_dram((0, 0, 0, 1), (0, 0, 0, 1)),
                                       remapped_rows=(0, 1, True, False), remapper_histogram=(639, 1, 0, 0, 0),
                                       margin_c=38),
                                 SW_POWER_CAP=1_843_200_000, HW_POWER_BRAKE_SLOWDOWN=8_412_000_000),
                pci_bus_id="00000000:0F:00.0",
                memory=_mem(81920, 562, 22110, 59248),
                mig_mode=(False, False),
                temperature_c=51,
                power_mw=312450,
                gpu_util_percent=63,
                memory_util_percent=41,
                compute_processes=(_proc(50318, 1620),),
                graphics_processes=(_proc(50102, 20480),),  # llama.cpp on Vulkan
                # The training job works (63 % and 41 % over its two samples, as samples/demo-pmon.txt
                # shows it); llama.cpp holds its memory idle (no sample).
                process_samples=(FakeUtilSample(50318, SAMPLED_AT_US, 61, 40),
                                 FakeUtilSample(50318, SAMPLED_AT_US + 166_667, 65, 42)),
            ),
        ),
        process_names={
            48213: "/usr/local/bin/llama-server",
            51877: "/usr/bin/python3",
            50102: "/usr/local/bin/llama-server",
            50318: "/usr/bin/python3",
        },
    )


@_with_boards
def h100_mig_processes() -> FakeNvmlScenario:
    """h100-mig-processes: one H100 in MIG mode, four instances, three processes; gpu_burn keeps its
    GPU instance (9) busy, the two memhogs hold memory on GPU instance 2 and compute nothing (GPM)."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **H100,
                uuid="GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2",
                health=_hopper(61, 35, 2619, 30_118_402),
                pci_bus_id="00000000:19:00.0",
                memory=_mem(81559, 479, 11125, 69955),
                mig_mode=(True, True),
                temperature_c=52,
                power_mw=432170,
                gpu_util_percent=None,
                mig_devices=_counting_sram(
                    FakeMig(0, 2, 0, "3g.40gb", "MIG-12b47fa4-2f93-5cea-b2ff-bf3e0b6e9aba",
                            _mem(40448, 0, 3594, 36854),
                            compute_processes=(_proc(21180, 2296), _proc(21181, 1272))),
                    FakeMig(1, 3, 0, "2g.20gb", "MIG-7cd8995e-feba-5903-8050-d09c5892503e",
                            _mem(20096, 0, 17, 20079)),
                    FakeMig(2, 9, 0, "1g.10gb", "MIG-ae36563d-8b6d-5a25-a43a-846eb31e7ea4",
                            _mem(9984, 0, 7493, 2491), compute_processes=(_proc(21198, 7484),),
                            activity=GPU_BURN),
                    FakeMig(3, 10, 0, "1g.10gb", "MIG-45ee6ebc-57f4-5590-941e-1f037860cf29",
                            _mem(9984, 0, 9, 9975)),
                ),
            ),
        ),
        process_names={21180: "/root/tools/memhog", 21181: "/root/tools/memhog", 21198: "./gpu_burn"},
    )


@_with_boards
def h200_shared_gpu_instance() -> FakeNvmlScenario:
    """h200-shared-gpu-instance: MIG devices 0 and 1 are two compute instances of GPU instance 1."""
    gi1 = _mem(71424, 0, 30210, 41214)  # both compute instances report the whole GPU instance
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **H200,
                uuid="GPU-68c6414c-e9da-201e-0c0d-1a0dc00f0e71",
                health=_hopper(55, 40, 3201, 22_407_119),
                pci_bus_id="00000000:4C:00.0",
                memory=_mem(143771, 586, 34390, 108795),
                mig_mode=(True, True),
                temperature_c=47,
                power_mw=311620,
                gpu_util_percent=None,
                mig_devices=_counting_sram(
                    FakeMig(0, 1, 0, "1c.3g.71gb", "MIG-a714a16e-81c1-5aad-836d-31def0b9d299", gi1,
                            compute_processes=(_proc(7001, 20480),)),
                    FakeMig(1, 1, 1, "2c.3g.71gb", "MIG-3134b65a-b3ad-5f32-a1cc-8fa650bdf659", gi1,
                            compute_processes=(_proc(7002, 9600),)),
                    # nvidia-smi's type M+C: the same process on the compute and the MPS list.
                    FakeMig(2, 5, 0, "2g.35gb", "MIG-3d1b61b4-b171-5b2f-8a9f-889eeaf77ee0",
                            _mem(33280, 0, 4113, 29167),
                            compute_processes=(_proc(7003, 4096),), mps_processes=(_proc(7003, 4096),)),
                    FakeMig(3, 11, 0, "1g.18gb", "MIG-9a4496e0-ed7a-5fce-aa86-dc3f3464849a",
                            _mem(16384, 0, 13, 16371)),
                    FakeMig(4, 12, 0, "1g.18gb", "MIG-845d1f7c-3a05-579f-8922-2a2bed27a584",
                            _mem(16384, 0, 13, 16371)),
                ),
            ),
        ),
        process_names={7001: "/usr/bin/python3", 7002: "/usr/bin/python3",
                       7003: "/opt/tritonserver/bin/tritonserver"},
    )


@_with_boards
def a100_mig_nothing_carved() -> FakeNvmlScenario:
    """a100-mig-nothing-carved: card 0 in MIG mode with no instance, card 1 with one 7g.40gb."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **A100_40GB,
                uuid="GPU-d21b54fa-8973-381f-412a-0a4f9fa42335",
                health=_a100(38, 1215, 3_310_054, clocks_event_reasons=pynvml.nvmlClocksEventReasonGpuIdle),
                pci_bus_id="00000000:07:00.0",
                memory=_mem(40960, 605, 0, 40355),
                mig_mode=(True, True),
                temperature_c=31,
                power_mw=54710,
                gpu_util_percent=None,
            ),
            FakeCard(
                **A100_40GB,
                uuid="GPU-0b233931-da53-f50a-0be5-2d057e0bd04a",
                health=_a100(46, 1215, 7_012_660),
                pci_bus_id="00000000:0F:00.0",
                memory=_mem(40960, 605, 4117, 36238),
                mig_mode=(True, True),
                temperature_c=38,
                power_mw=118360,
                gpu_util_percent=None,
                mig_devices=_counting_sram(
                    # GPU instance id 0 is a real id.
                    FakeMig(0, 0, 0, "7g.40gb", "MIG-b3005440-698c-5839-a8e1-705bb7a7af3d",
                            _mem(40192, 0, 4105, 36087), compute_processes=(_proc(3301, 4092),)),
                ),
            ),
        ),
        process_names={3301: "/usr/bin/python3"},
    )


@_with_boards
def a100_mig_pending() -> FakeNvmlScenario:
    """a100-mig-pending: MIG current Disabled, pending Enabled; a whole card with utilisation."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **A100_80GB,
                uuid="GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f",
                health=_a100(47, 1593, 6_120_775, remapped_rows=(0, 0, False, False),
                             remapper_histogram=(640, 0, 0, 0, 0)),
                pci_bus_id="00000000:87:00.0",
                memory=_mem(81920, 562, 5123, 76235),
                mig_mode=(False, True),
                temperature_c=39,
                power_mw=98540,
                gpu_util_percent=12,
                memory_util_percent=3,
                compute_processes=(_proc(900, 5100),),
                process_samples=(FakeUtilSample(900, SAMPLED_AT_US, 12, 3),),
            ),
        ),
        process_names={900: "/usr/bin/python3"},
    )


@_with_boards
def na_memory() -> FakeNvmlScenario:
    """na-memory: an A10G that reports nothing (N/A everywhere) and a T4 without MIG support."""
    return FakeNvmlScenario(
        driver_version="535.154.05",
        cuda_version=12020,
        cards=(
            FakeCard(
                name="NVIDIA A10G",
                pci_device_id=0x223710DE,
                pci_subsystem_id=0x152F10DE,
                uuid="GPU-5edbada5-14e2-87ba-0547-69ba41cbb44f",
                health=_fixture_health(
                    memory_c=None, limits_w=(300, 300, 300, 100, 300), thresholds=_thresholds(98, 95, 88, None),
                    energy_j=1_500_210, clocks={}, max_clocks=_clocks(1710, 1710, 6251, 1500), fan_percent=0,
                    ecc_counts={}),
                pci_bus_id="00000000:3B:00.0",
                memory=None,
                mig_mode=None,
                temperature_c=None,
                power_mw=None,
                gpu_util_percent=None,
                compute_processes=(_proc(4242, None),),
                graphics_processes=(_proc(4243, None),),
            ),
            FakeCard(
                name="Tesla T4",
                pci_device_id=0x1EB810DE,
                pci_subsystem_id=0x12A210DE,
                uuid="GPU-07539038-7071-2d5f-63ad-fa395d6cff31",
                health=_fixture_health(
                    memory_c=None, limits_w=(70, 70, 70, 60, 70), thresholds=_thresholds(96, 93, 85, None),
                    energy_j=402_117, clocks=_clocks(300, 300, 405, 540), max_clocks=_clocks(1590, 1590, 5001, 1470),
                    performance_state=8, clocks_event_reasons=pynvml.nvmlClocksEventReasonGpuIdle, drain_flag=False),
                pci_bus_id="00000000:AF:00.0",
                memory=_mem(15360, 257, 2, 15101),
                mig_mode=None,
                temperature_c=29,
                power_mw=9780,
                gpu_util_percent=0,  # a real zero
                memory_util_percent=0,
            ),
        ),
        process_names={4242: "/usr/bin/python3", 4243: "/usr/lib/xorg/Xorg"},
    )


def one_lost_one_no_permission() -> FakeNvmlScenario:
    """Three H100s: card 0 fell off the bus, card 1 refuses MIG queries to this user, card 2 is fine.

    Not an nvidia-smi fixture: the values are ours. Card 0 still gives out its
    handle (as libnvidia-ml does for a card that was enumerated) and answers
    NVML_ERROR_GPU_IS_LOST to everything after.
    """
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **H100,
                uuid="GPU-3f0c1a52-7b6e-4d21-9a8f-0c5e2b7d4a11",
                pci_bus_id="00000000:18:00.0",
                memory=_mem(81559, 479, 0, 81080),
                mig_mode=(False, False),
                temperature_c=40,
                power_mw=70120,
                gpu_util_percent=0,
                memory_util_percent=0,
                errors={"*": NVML_ERROR_GPU_IS_LOST},
            ),
            FakeCard(
                **H100,
                uuid="GPU-8d2e4b61-1c3a-4f5e-b7d9-2a6c8e0f1b22",
                pci_bus_id="00000000:2A:00.0",
                memory=_mem(81559, 479, 13, 81067),
                mig_mode=(True, True),
                temperature_c=36,
                power_mw=98760,
                gpu_util_percent=None,
                mig_devices=(
                    FakeMig(0, 0, 0, "7g.80gb", "MIG-5e7a9c1d-3b2f-5a8e-9d4c-6f1b0a2e8c44",
                            _mem(80896, 0, 13, 80883)),
                ),
                errors={
                    "nvmlDeviceGetMaxMigDeviceCount": NVML_ERROR_NO_PERMISSION,
                    "nvmlDeviceGetMigDeviceHandleByIndex": NVML_ERROR_NO_PERMISSION,
                },
            ),
            FakeCard(
                **H100,
                uuid="GPU-c41f7e93-5a2b-4c6d-8e1f-3b7a9d0c2e33",
                pci_bus_id="00000000:3C:00.0",
                memory=_mem(81559, 479, 8203, 72877),
                mig_mode=(False, False),
                temperature_c=44,
                power_mw=250310,
                gpu_util_percent=87,
                memory_util_percent=52,
                compute_processes=(_proc(61001, 8192),),
            ),
        ),
        process_names={61001: "/usr/bin/python3"},
    )


def without_mig_monitor(scenario: FakeNvmlScenario) -> FakeNvmlScenario:
    """``scenario`` as a container sees it that has the GPUs (/dev/nvidiaN) but neither the MIG
    monitor capability (/dev/nvidia-caps/nvidia-cap2) nor the access capability of any GPU or
    compute instance: the ``all`` of NVIDIA_VISIBLE_DEVICES gives those of the instances that
    exist when the container starts, so this is a container started before its instances were
    made (NVIDIA/nvidia-docker#1473), or one given none.

    On each card in MIG mode:

    - ``nvmlDeviceGetMemoryInfo`` (v1 and v2) answers ``NVML_ERROR_NO_PERMISSION``: the card's
      aggregate memory needs the monitor capability (NVIDIA/nvidia-container-toolkit#842, pynvml
      ``NVMLError_NoPermission`` on a MIG card's handle, driver 550.127.08; NVIDIA/k8s-device-plugin#399
      and #1683, "error getting parent memory info: Insufficient Permissions");
    - no MIG instance is found: every slot of ``nvmlDeviceGetMigDeviceHandleByIndex`` answers
      ``NOT_FOUND``, as an empty slot does. No source says which code the driver gives for an
      instance the caller cannot open; NOT_FOUND is what nvidia-smi's showing none implies;
    - so no process is listed either (the process lists are read on the MIG handles), and the
      card's own lists are not read in MIG mode.

    Identity, MIG mode, temperature and power still answer (nvidia-smi still shows them).
    """
    cards = tuple(
        replace(card, mig_devices=(), errors={**card.errors, "nvmlDeviceGetMemoryInfo": NVML_ERROR_NO_PERMISSION,
                                              "nvmlDeviceGetMemoryInfo_v2": NVML_ERROR_NO_PERMISSION})
        if card.mig_enabled else card
        for card in scenario.cards)
    return replace(scenario, cards=cards)


# ---------------------------------------------------------------------------
# Health scenarios without an nvidia-smi fixture: NVML only (tests/test_nvml_health.py)
# ---------------------------------------------------------------------------

# What a 470-era driver lacks of the health calls (beside OLD_DRIVER_MISSING).
R470_HEALTH_MISSING = frozenset({
    "nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetSupportedClocksEventReasons",
    "nvmlDeviceGetMarginTemperature", "nvmlDeviceGetSramEccErrorStatus", "nvmlDeviceGetRepairStatus",
})
_ECC = (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
_VOL, _AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
_OLDER_LOCATIONS = (pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY, pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE,
                    pynvml.NVML_MEMORY_LOCATION_L1_CACHE, pynvml.NVML_MEMORY_LOCATION_L2_CACHE,
                    pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY, pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM)


def pascal_page_retirement() -> FakeNvmlScenario:
    """A Tesla P100 on a 470 driver: no MIG, ECC by the older locations (no CBU), three retired pages
    and one retirement pending, the pre-535 clock-throttle names, no margin or SRAM status."""
    def counts(single: int, double: int) -> tuple[int, ...]:
        return (single, 0, 0, 0, 0, 0), (double, 0, 0, 0, 0, 0)  # device_memory first
    ecc = {}
    for scope, (single, double) in ((_VOL, counts(3, 0)), (_AGG, counts(12, 1))):
        for error, values in zip(_ECC, (single, double), strict=True):
            ecc.update({(error, scope, location): n for location, n in zip(_OLDER_LOCATIONS, values, strict=True)})
    health = FakeHealth(
        fields={"NVML_FI_DEV_PCIE_REPLAY_COUNTER": 7, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 912_345_678},
        thresholds_c=_thresholds(85, 82, 80, None), clocks_event_reasons=pynvml.nvmlClocksThrottleReasonSwPowerCap,
        supported_clocks_event_reasons=ALL_CLOCK_EVENT_REASONS & ~pynvml.nvmlClocksThrottleReasonSyncBoost
        & ~pynvml.nvmlClocksThrottleReasonDisplayClockSetting,
        performance_state=0, clocks_mhz=_clocks(1189, 1189, 715, 1063),
        max_clocks_mhz=_clocks(1328, 1328, 715, 1189), power_limits_mw=(250_000, 250_000, 250_000, 125_000, 250_000),
        ecc_mode=(True, True), ecc_counts=ecc,
        retired_pages={pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: (0x1A2B000, 0x1A2C000),
                       pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: (0x3F00000,)},
        retired_pending=True)
    return FakeNvmlScenario(
        driver_version="470.256.02",
        cuda_version=11040,
        cards=(FakeCard(name="Tesla P100-PCIE-16GB", pci_device_id=0x15F810DE, pci_subsystem_id=0x118F10DE,
                        uuid="GPU-5b1f0e7c-2d4a-4c8e-9f13-7a6b2c9d0e44", pci_bus_id="00000000:3B:00.0",
                        memory=_mem(16384, 0, 1203, 15181), mig_mode=None, temperature_c=44, power_mw=31_250,
                        gpu_util_percent=0, memory_util_percent=0, health=health),),
        missing_functions=OLD_DRIVER_MISSING | R470_HEALTH_MISSING,
    )


def h100_r570_sram_split() -> FakeNvmlScenario:
    """An H100 (whole card) on a 575 driver (the first whose header has the thermal clock-event
    counters, at 251-253) with 570's SRAM status split into parity and SEC-DED past its threshold, a
    drain-and-reset advice (4), clocks held by the power cap, the clock-event counters, a TPC repair
    pending (590+'s call) and two remapped rows."""
    sram = FakeSramStatus(volatile_parity=2, volatile_secded=1, volatile_correctable=5, aggregate_parity=3,
                          aggregate_secded=2, aggregate_correctable=9, threshold_exceeded=True)
    health = FakeHealth(
        fields={"NVML_FI_DEV_MEMORY_TEMP": 71, "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 2,
                "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 4_200_000_123,
                "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 4,
                "NVML_FI_DEV_RESET_STATUS": 0, "NVML_FI_DEV_DRAIN_AND_RESET_STATUS": 0,
                "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": 1_500_000_000,
                "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": 0,
                "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 250_000_000,
                "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 0,
                "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 0},
        margin_c=3, thresholds_c={**HOPPER_THRESHOLDS, pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_CURR: 83},
        clocks_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap,
        supported_clocks_event_reasons=ALL_CLOCK_EVENT_REASONS, performance_state=0,
        clocks_mhz=_clocks(1755, 1755, 2619, 1605), max_clocks_mhz=_clocks(1980, 1980, 2619, 1545),
        fan_percent=None, power_limits_mw=(650_000, 650_000, 700_000, 200_000, 700_000), ecc_mode=(True, True),
        ecc_counts=_sram_dram((5, 3, 1, 0), (9, 5, 4, 0)), sram=sram, remapped_rows=(2, 0, False, False),
        remapper_histogram=(638, 2, 0, 0, 0), repair_pending=(False, True))
    return FakeNvmlScenario(
        driver_version="575.57.08",
        cuda_version=12090,
        cards=(FakeCard(**H100, uuid="GPU-1d7e3c90-8b2a-4f61-a5c3-9e0f2b4d6a88", pci_bus_id="00000000:9A:00.0",
                        memory=_mem(81559, 479, 60211, 20869), mig_mode=(False, False), temperature_c=80,
                        power_mw=648_900, gpu_util_percent=100, memory_util_percent=64, health=health),),
    )


SCENARIOS: dict[str, Callable[[], FakeNvmlScenario]] = {
    "demo": demo,
    "h100-mig-processes": h100_mig_processes,
    "h200-shared-gpu-instance": h200_shared_gpu_instance,
    "a100-mig-nothing-carved": a100_mig_nothing_carved,
    "a100-mig-pending": a100_mig_pending,
    "na-memory": na_memory,
    "one-lost-one-no-permission": one_lost_one_no_permission,
}

