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
``r535_struct_mismatch``. ``FakeNvml.set_scenario`` swaps the data under a
running exporter (a card lost between two scrapes, a driver reload).

What a caller did is recorded: ``fake.calls`` (every C call, with the device it
named), ``fake.missing_lookups`` (symbols pynvml asked for and did not get) and
``fake.exceptions`` (a Python exception inside a callback; the C caller gets
NVML_ERROR_UNKNOWN, as ctypes would otherwise hand back a garbage code).
Tests should assert ``fake.exceptions == []``.

Where NVML's documentation is silent, the fake's choice is stated beside the
function (``_nvmlDeviceGetIndex`` etc.).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from ctypes import POINTER, c_int, c_uint, c_ulonglong, c_void_p
from dataclasses import dataclass, field
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
    NVML_ERROR_NOT_SUPPORTED. Keys are pynvml's own constants (field ids, thresholds, clocks,
    memory locations), never numbers written here: NVML's field ids moved between releases.

    - ``fields``: nvmlDeviceGetFieldValues, by field id (``NVML_FI_DEV_MEMORY_TEMP``,
      ``NVML_FI_DEV_CLOCKS_EVENT_REASON_*`` in ns, ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``,
      ``NVML_FI_DEV_PCIE_REPLAY_COUNTER``, ``NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` in mJ);
      the single calls that give the same values answer from here too;
    - ``thresholds_c``: nvmlDeviceGetTemperatureThreshold, by ``NVML_TEMPERATURE_THRESHOLD_*``;
    - ``clocks_mhz``/``max_clocks_mhz``: nvmlDeviceGetClockInfo/GetMaxClockInfo, by ``NVML_CLOCK_*``;
    - ``power_limits_mw``: enforced, management (requested), default, min, max;
    - ``ecc_counts``: nvmlDeviceGetMemoryErrorCounter, by (error type, counter type, location);
      a location not listed answers NOT_SUPPORTED (an older card has no SRAM/DRAM locations);
    - ``remapped_rows``: (correctable, uncorrectable, pending, failure);
    - ``remapper_histogram``: (max, high, partial, low, none) banks;
    - ``retired_pages``: page addresses by ``NVML_PAGE_RETIREMENT_CAUSE_*``;
    - ``repair_pending``: (channel, tpc), nvmlDeviceGetRepairStatus (590+).
    """

    fields: Mapping[int, int] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        if (self.gpu_util_percent is None) != (self.memory_util_percent is None):
            raise ValueError(f"{self.uuid}: utilisation is gpu and memory together, or neither")
        slots = [m.index for m in self.mig_devices]
        if len(slots) != len(set(slots)) or any(not 0 <= s < self.max_mig_devices for s in slots):
            raise ValueError(f"{self.uuid}: MIG slots {slots} must be distinct and below {self.max_mig_devices}")

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
    # Readings our exporter does not take but nvitop-exporter does; the
    # benchmarks run it over this fake (benchmarks/run.py). Fixed answers, see
    # "other readings" below.
    "nvmlDeviceGetTemperatureV": ((_P, _P), c_int),
    "nvmlDeviceGetClockInfo": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetPowerManagementLimit": ((_P, _P), c_int),
    "nvmlDeviceGetFanSpeed": ((_P, _P), c_int),
    "nvmlDeviceGetEncoderUtilization": ((_P, _P, _P), c_int),
    "nvmlDeviceGetDecoderUtilization": ((_P, _P, _P), c_int),
    "nvmlDeviceGetPcieThroughput": ((_P, c_uint, _P), c_int),
    "nvmlDeviceGetFieldValues": ((_P, c_int, _P), c_int),
    "nvmlDeviceGetProcessUtilization": ((_P, _P, _P, c_ulonglong), c_int),
}
for _kind in _PROCESS_LISTS:
    for _suffix in ("", "_v2", "_v3"):
        _SIGNATURES[f"nvmlDeviceGet{_kind}RunningProcesses{_suffix}"] = ((_P, _P, _P), c_int)

# Calls that name a device by handle in their first argument.
_NO_HANDLE = frozenset({
    "nvmlInitWithFlags", "nvmlInit_v2", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetProcessName",
    "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
})


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
        self._strings: dict[int, ctypes.Array] = {}  # nvmlErrorString buffers, kept alive
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
        symbols it found).
        """
        self.scenario = scenario

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

        return ctypes.CFUNCTYPE(restype, *argtypes)(thunk)

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

    # -- other readings ---------------------------------------------------
    # The fake's choices: every card answers the same H100-like values; a MIG
    # handle answers NVML_ERROR_NOT_SUPPORTED, as for temperature and power.

    _CLOCKS_MHZ: ClassVar[dict[int, int]] = {
        pynvml.NVML_CLOCK_GRAPHICS: 1980, pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619,
        pynvml.NVML_CLOCK_VIDEO: 1755,
    }
    _PCIE_KB_PER_S: ClassVar[dict[int, int]] = {
        pynvml.NVML_PCIE_UTIL_TX_BYTES: 412, pynvml.NVML_PCIE_UTIL_RX_BYTES: 538,
    }

    def _card_only(self, name: str, handle: int | None) -> _Target:
        t = self._device(name, handle)
        if t.mig:
            raise _Fail(NVML_ERROR_NOT_SUPPORTED)
        return t

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

    def _nvmlDeviceGetClockInfo(self, handle: int | None, clock: int, out: int | None) -> int:
        self._card_only("nvmlDeviceGetClockInfo", handle)
        if clock not in self._CLOCKS_MHZ:
            return NVML_ERROR_INVALID_ARGUMENT
        return _write_uint(out, self._CLOCKS_MHZ[clock])

    def _nvmlDeviceGetPowerManagementLimit(self, handle: int | None, out: int | None) -> int:
        self._card_only("nvmlDeviceGetPowerManagementLimit", handle)
        return _write_uint(out, 700_000)

    def _nvmlDeviceGetFanSpeed(self, handle: int | None, out: int | None) -> int:
        self._device("nvmlDeviceGetFanSpeed", handle)
        return NVML_ERROR_NOT_SUPPORTED  # passively cooled data-centre boards

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
        # The call succeeds and each field carries its own answer: none is supported here.
        self._device("nvmlDeviceGetFieldValues", handle)
        if values is None or count <= 0:
            return NVML_ERROR_INVALID_ARGUMENT
        for entry in (pynvml.c_nvmlFieldValue_t * count).from_address(values):
            entry.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return NVML_SUCCESS

    def _nvmlDeviceGetProcessUtilization(self, handle: int | None, samples: int | None, count: int | None,
                                         since: int) -> int:
        # NVML: NOT_FOUND when no sample was taken since ``since`` (no process ran a kernel).
        self._card_only("nvmlDeviceGetProcessUtilization", handle)
        if count is None:
            return NVML_ERROR_INVALID_ARGUMENT
        return NVML_ERROR_NOT_FOUND

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


A100_80GB = dict(name="NVIDIA A100-SXM4-80GB", pci_device_id=0x20B210DE, pci_subsystem_id=0x147F10DE)
A100_40GB = dict(name="NVIDIA A100-SXM4-40GB", pci_device_id=0x20B010DE, pci_subsystem_id=0x134F10DE)
H100 = dict(name="NVIDIA H100 80GB HBM3", pci_device_id=0x233010DE, pci_subsystem_id=0x16C110DE)
H200 = dict(name="NVIDIA H200", pci_device_id=0x233510DE, pci_subsystem_id=0x18BE10DE)


def demo() -> FakeNvmlScenario:
    """src/mig_exporter/samples/demo.xml + demo.L.txt: one A100 in MIG mode, one whole A100."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **A100_80GB,
                uuid="GPU-a84bba07-931d-b925-306a-0799dc6ebd71",
                pci_bus_id="00000000:07:00.0",
                memory=_mem(81920, 562, 20971, 60387),
                mig_mode=(True, True),
                temperature_c=34,
                power_mw=87230,
                gpu_util_percent=None,
                mig_devices=(
                    FakeMig(0, 2, 0, "3g.40gb", "MIG-8b8c764d-1c0a-5cb3-bea1-3519a60a077b",
                            _mem(40192, 0, 11663, 28529), compute_processes=(_proc(48213, 11520),)),
                    FakeMig(1, 3, 0, "2g.20gb", "MIG-bd142880-e842-57ab-bec1-2975fd55911e",
                            _mem(19968, 0, 9251, 10717), compute_processes=(_proc(51877, 9216),)),
                    FakeMig(2, 9, 0, "1g.10gb", "MIG-a2cbd390-b656-5a4d-8bad-821df997d529",
                            _mem(9728, 0, 13, 9715)),
                ),
            ),
            FakeCard(
                **A100_80GB,
                uuid="GPU-975dcb6d-e070-3b4a-b7ed-013e50181d96",
                pci_bus_id="00000000:0F:00.0",
                memory=_mem(81920, 562, 22110, 59248),
                mig_mode=(False, False),
                temperature_c=51,
                power_mw=312450,
                gpu_util_percent=63,
                memory_util_percent=41,
                compute_processes=(_proc(50318, 1620),),
                graphics_processes=(_proc(50102, 20480),),  # llama.cpp on Vulkan
            ),
        ),
        process_names={
            48213: "/usr/local/bin/llama-server",
            51877: "/usr/bin/python3",
            50102: "/usr/local/bin/llama-server",
            50318: "/usr/bin/python3",
        },
    )


def h100_mig_processes() -> FakeNvmlScenario:
    """h100-mig-processes: one H100 in MIG mode, four instances, three processes."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **H100,
                uuid="GPU-0e9558c1-530a-493a-fbb8-b64cb580fac2",
                pci_bus_id="00000000:19:00.0",
                memory=_mem(81559, 479, 11125, 69955),
                mig_mode=(True, True),
                temperature_c=52,
                power_mw=432170,
                gpu_util_percent=None,
                mig_devices=(
                    FakeMig(0, 2, 0, "3g.40gb", "MIG-12b47fa4-2f93-5cea-b2ff-bf3e0b6e9aba",
                            _mem(40448, 0, 3594, 36854),
                            compute_processes=(_proc(21180, 2296), _proc(21181, 1272))),
                    FakeMig(1, 3, 0, "2g.20gb", "MIG-7cd8995e-feba-5903-8050-d09c5892503e",
                            _mem(20096, 0, 17, 20079)),
                    FakeMig(2, 9, 0, "1g.10gb", "MIG-ae36563d-8b6d-5a25-a43a-846eb31e7ea4",
                            _mem(9984, 0, 7493, 2491), compute_processes=(_proc(21198, 7484),)),
                    FakeMig(3, 10, 0, "1g.10gb", "MIG-45ee6ebc-57f4-5590-941e-1f037860cf29",
                            _mem(9984, 0, 9, 9975)),
                ),
            ),
        ),
        process_names={21180: "/root/tools/memhog", 21181: "/root/tools/memhog", 21198: "./gpu_burn"},
    )


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
                pci_bus_id="00000000:4C:00.0",
                memory=_mem(143771, 586, 34390, 108795),
                mig_mode=(True, True),
                temperature_c=47,
                power_mw=311620,
                gpu_util_percent=None,
                mig_devices=(
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


def a100_mig_nothing_carved() -> FakeNvmlScenario:
    """a100-mig-nothing-carved: card 0 in MIG mode with no instance, card 1 with one 7g.40gb."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **A100_40GB,
                uuid="GPU-d21b54fa-8973-381f-412a-0a4f9fa42335",
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
                pci_bus_id="00000000:0F:00.0",
                memory=_mem(40960, 605, 4117, 36238),
                mig_mode=(True, True),
                temperature_c=38,
                power_mw=118360,
                gpu_util_percent=None,
                mig_devices=(
                    # GPU instance id 0 is a real id.
                    FakeMig(0, 0, 0, "7g.40gb", "MIG-b3005440-698c-5839-a8e1-705bb7a7af3d",
                            _mem(40192, 0, 4105, 36087), compute_processes=(_proc(3301, 4092),)),
                ),
            ),
        ),
        process_names={3301: "/usr/bin/python3"},
    )


def a100_mig_pending() -> FakeNvmlScenario:
    """a100-mig-pending: MIG current Disabled, pending Enabled; a whole card with utilisation."""
    return FakeNvmlScenario(
        driver_version="550.90.07",
        cuda_version=12040,
        cards=(
            FakeCard(
                **A100_80GB,
                uuid="GPU-2e2425ba-9682-1709-05f4-ec5a399fc47f",
                pci_bus_id="00000000:87:00.0",
                memory=_mem(81920, 562, 5123, 76235),
                mig_mode=(False, True),
                temperature_c=39,
                power_mw=98540,
                gpu_util_percent=12,
                memory_util_percent=3,
                compute_processes=(_proc(900, 5100),),
            ),
        ),
        process_names={900: "/usr/bin/python3"},
    )


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


SCENARIOS: dict[str, Callable[[], FakeNvmlScenario]] = {
    "demo": demo,
    "h100-mig-processes": h100_mig_processes,
    "h200-shared-gpu-instance": h200_shared_gpu_instance,
    "a100-mig-nothing-carved": a100_mig_nothing_carved,
    "a100-mig-pending": a100_mig_pending,
    "na-memory": na_memory,
    "one-lost-one-no-permission": one_lost_one_no_permission,
}

