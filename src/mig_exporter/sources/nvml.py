"""The NVML read path: libnvidia-ml through pynvml, answering in microseconds.

It builds the same snapshot as the nvidia-smi path, through the same
placement rules, so a dashboard cannot tell which path fed it except by the
``source`` label. What each value matches in nvidia-smi:

- cards: ``nvmlDeviceGetCount`` / ``GetHandleByIndex`` (``nvidia-smi -L`` order);
- the board serial: ``GetSerial`` (``serial``), once per card until NVML is initialised again;
- MIG mode: ``GetMigMode`` (``mig_mode/current_mig``, ``pending_mig``);
- instances: ``GetMaxMigDeviceCount`` and ``GetMigDeviceHandleByIndex`` over
  every slot, skipping empty ones (``mig_devices/mig_device``); profile from the
  instance's name, "NVIDIA A100-SXM4-80GB MIG 3g.40gb" (``-L``'s profile);
- memory: ``GetMemoryInfo`` v2 where the driver has it, for ``reserved``
  (``fb_memory_usage``);
- temperature: ``GetTemperatureV`` where the driver has it, else ``GetTemperature`` (``gpu_temp``);
- health (heat, power, wear; a MIG instance's own ECC count): sources/nvml_health.py;
- processes: compute, graphics and MPS lists on each MIG handle, or on the
  card (``processes/process_info``), v3 with a fallback to v2;
- activity (sources/nvml_activity.py, docs/activity.md): GPM per GPU instance and whole card
  (``nvidia-smi dmon --gpm-metrics``), each process's share of a whole card (``pmon -s u``). Read
  after every card's memory and processes: GPM calls come last in a read.

What a read costs: a big host lists hundreds of processes a read, so the per-process work is
kept off pynvml's per-entry Python objects, keeping its ctypes layer. The process lists are
read through the library's own C functions (pynvml's lookup, its ``c_nvmlProcessInfo_*``
Structure classes and its size-query protocol) and unpacked in one pass from the struct
array's bytes, at the offsets of pynvml's Structure fields. Each listed pid's name
(``nvmlSystemGetProcessName``) is asked once at every read, never kept: a process can rename
itself (setproctitle, exec) under the same pid, and nvidia-smi shows its current name. A
process listed as in the last read, under the same name, keeps its reading.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import re
import struct
import time
from collections.abc import Callable
from typing import Any

import pynvml

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.core.flight import Flights
from mig_exporter.core.visible import bounded_name
from mig_exporter.model.placement import PlacementMemo, place
from mig_exporter.model.snapshot import (
    ACTIVITY_READ_FAILED,
    CardReading,
    Memory,
    MigInstance,
    ProcessReading,
    Snapshot,
    is_process_id,
)
from mig_exporter.sources.nvml_activity import DEFAULT_WINDOW_S, GpmBook, ProcessActivityReader
from mig_exporter.sources.nvml_gateway import Nvml, NvmlCallError, NvmlUnavailable, error_name
from mig_exporter.sources.nvml_health import CardKey, HealthReader

log = logging.getLogger("mig_exporter")

DEFAULT_TIMEOUT_S = 10.0
_EMPTY_SLOT = frozenset({pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT})
# Reads of a process list that grows between pynvml's sizing call and its read each time.
_LIST_ATTEMPTS = 3
_PROFILE_IN_NAME = re.compile(r"\bMIG\s+(\S+)\s*$")

_NAME_BUFFER_BYTES = 1024  # what pynvml's nvmlSystemGetProcessName allocates
# What pynvml's nvmlDeviceGetName and GetUUID allocate.
_NAME_BYTES = pynvml.NVML_DEVICE_NAME_V2_BUFFER_SIZE
_UUID_BYTES = pynvml.NVML_DEVICE_UUID_V2_BUFFER_SIZE
_SERIAL_BYTES = pynvml.NVML_DEVICE_SERIAL_BUFFER_SIZE  # what pynvml's nvmlDeviceGetSerial allocates
_UNKNOWN_MEMORY = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # pynvml makes it None
_USED = operator.itemgetter(1)
_MEMORY_V2 = ("total", "reserved", "free", "used")
_ENTRY_V3 = getattr(pynvml, "c_nvmlProcessInfo_v3_t", pynvml.c_nvmlProcessInfo_v2_t)

_PROCESS_LISTS = (
    # pynvml's unversioned wrappers raise a non-NVML error where _v3 is missing;
    # name the versions, newest first.
    ("C", ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")),
    ("G", ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")),
    ("M", ("nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2")),
)


class NvmlSource:
    """Reads through libnvidia-ml at each call."""

    name = "nvml"

    def __init__(self, nvml: Nvml | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 activity_window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml or Nvml()
        self.timeout_s = timeout_s
        # An NVML call can hang in the driver, where no deadline reaches: reads and readiness
        # checks (/-/ready, --source auto's choice) run in a flight's daemon thread, so a caller
        # answers at its deadline, concurrent callers share one pass, and threads never pile up.
        # The read ends at its deadline as a killed nvidia-smi does, so the scrape around it
        # answers then, with its own /proc reading: waiting past it (the scrape's join grace)
        # would only make the answer late, hence no grace here.
        self._reads: Flights[str, Snapshot] = Flights("nvml-read", ends_at_deadline=False)
        self._checks: Flights[str, tuple[bool, str]] = Flights("nvml-ready", ends_at_deadline=False)
        self._readings: dict[tuple[_Row, str], ProcessReading] = {}
        self._placement = PlacementMemo()  # each card as the last read placed it (model/placement.py)
        self._health = HealthReader(self.nvml)
        # The board serial of each card (by UUID), asked once per initialisation: fixed per board.
        self._serials: dict[object, str | None] = {}
        self._serials_generation = -1
        # GPM's samples and each whole card's process utilisation, kept across reads (each scraper
        # its own window); ``clock`` times GPM's samples, ``wall_clock`` is the clock of the driver's
        # process utilisation timestamps (tests drive both). Freed before NVML is initialised again,
        # whoever asks for it first (a read or a readiness check).
        self.activity = GpmBook(self.nvml, activity_window_s, clock)
        self._process_activity = ProcessActivityReader(self.nvml, activity_window_s, clock, wall_clock)
        self.nvml.on_reinit(self._before_reinit)
        # Each card's UUID as the last read that got it saw it, by index: a card whose read fails
        # before its UUID keeps its windows under that UUID.
        self._uuids: dict[int, str] = {}

    def _before_reinit(self) -> None:
        self.activity.release()
        self._process_activity.reset()

    def close(self) -> None:
        """Free the GPM samples kept, then shut NVML down (no read may run meanwhile)."""
        self.activity.release()
        self.nvml.shutdown()

    def ready(self) -> tuple[bool, str]:
        def late() -> tuple[bool, str]:
            return False, f"NVML readiness check did not finish within {self.timeout_s:.1f}s"
        return self._checks.run("ready", Deadline.after(self.timeout_s), self._check, late)

    def _check(self) -> tuple[bool, str]:
        try:
            self.nvml.ensure()
            count = self.nvml.call(pynvml.nvmlDeviceGetCount)
        except ReadError as e:
            return False, str(e)
        return True, f"libnvidia-ml loaded, {count} device(s)"

    def describe(self) -> str:
        return f"NVML (libnvidia-ml, timeout {self.timeout_s:g}s)"

    def read(self, deadline: Deadline | None = None) -> Snapshot:
        """One read by ``deadline`` or the source's own timeout, whichever comes first. NVML
        answers in microseconds or hangs in the driver: the calls run in a flight's thread, and
        a read still hung at the deadline fails then (``ReadError``), the call left to finish
        in its thread; the next read joins it rather than starting another."""
        deadline = Deadline.after(self.timeout_s) if deadline is None else deadline.within(self.timeout_s)
        started = time.monotonic()

        def late() -> Snapshot:
            raise ReadError(f"nvml read did not finish within {deadline.at - started:.1f}s")
        return self._reads.run("read", deadline, self._read_now, late)

    def _read_now(self) -> Snapshot:
        """One read, in the calling thread."""
        nv = self.nvml
        nv.ensure()
        driver = _text(nv.optional(pynvml.nvmlSystemGetDriverVersion))
        cuda = _cuda_version(nv.optional(pynvml.nvmlSystemGetCudaDriverVersion))
        count = nv.call(pynvml.nvmlDeviceGetCount)
        problems: list[str] = []
        handles: dict[int, Any] = {}
        read = [self._read_card(index, problems, handles) for index in range(count)]
        self._read_activity(read, handles, problems)
        asker: _NameAsker | None = None
        names: dict[int, str] = {}
        # A process listed as in the last read, under the same name, is the same immutable
        # reading: kept rather than built again (most of a big host's processes, most reads).
        # Keyed by its row and its name, so a renamed process gets a new reading.
        earlier, readings = self._readings, {}
        cards: list[CardReading] = []
        for card in read:
            if isinstance(card, CardReading):
                cards.append(card)
                continue
            processes = []
            for row in card[1]:
                name = names.get(row[0])
                if name is None:
                    asker = asker or _NameAsker(nv)
                    names[row[0]] = name = asker.name(row[0])
                key = (row, name)
                reading = earlier.get(key)
                if reading is None:
                    reading = ProcessReading(row[0], row[1], name, *row[2:])
                readings[key] = reading
                processes.append(reading)
            cards.append(CardReading(processes=tuple(processes), **card[0]))
        self._readings = readings
        return place(cards, driver_version=driver, cuda_version=cuda, problems=problems, memo=self._placement)

    def _read_activity(self, read: list[CardReading | tuple[dict[str, Any], list[_Row]]], handles: dict[int, Any],
                       problems: list[str]) -> None:
        """Each card's activity, into its values: once every card's memory and processes are read,
        so that no GPM call comes before a memory read (a driver-535 report saw GPM calls disturb
        later memory reads on MIG handles). What fails here fails no memory reading: whatever a
        card's activity raises (a function the driver lacks, a pynvml of another layout) leaves
        that card's activity read_failed, with a problem line."""
        with self.activity.reading() as gpm:
            for card in read:
                if isinstance(card, CardReading):
                    # Its windows are kept for its return, under the UUID its last good read saw.
                    gpm.failed_cards.add(card.uuid or self._uuids.get(card.index, card.index))
                    continue
                values, rows = card
                index = values["index"]
                if values["uuid"]:
                    self._uuids[index] = values["uuid"]
                key, handle, where = values["uuid"] or index, handles[index], f"card {index}"
                try:
                    if values["mig_current"]:
                        values["instances"] = gpm.gpu_instances(key, handle, values["instances"], where, problems)
                    else:
                        values["activity"], values["activity_unknown"] = gpm.whole_card(key, handle, where, problems)
                except Exception as e:
                    _activity_failed(where, "activity", e, problems)
                    gpm.failed_cards.add(key)  # its windows are kept, as a failed card's
                    if values["mig_current"]:
                        values["instances"] = tuple(i._replace(activity=None, activity_unknown=ACTIVITY_READ_FAILED)
                                                    for i in values["instances"])
                    else:
                        values["activity"], values["activity_unknown"] = None, ACTIVITY_READ_FAILED
                if values["mig_current"] or not values["processes_known"]:
                    continue
                try:
                    values["process_activity"] = self._process_activity.read(
                        key, handle, (row[0] for row in rows), where, problems)
                except Exception as e:
                    _activity_failed(where, "process activity", e, problems)
                    values["process_activity"] = None

    def _read_card(self, index: int, problems: list[str],
                   handles: dict[int, Any]) -> CardReading | tuple[dict[str, Any], list[_Row]]:
        """One card: its ``CardReading``'s fields and process rows, to be named; or, where a
        call failed, the card marked (keeping what was read before it) instead of failing the
        read, unless the whole library has gone. ``handles`` gets the card's handle."""
        identity: dict[str, Any] = {}
        try:
            return self._read_card_values(index, identity, problems, handles)
        except NvmlCallError as e:
            if e.code in (pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
                raise
            return CardReading(index=index, error=f"{error_name(e.code)} in {e.function}",
                               lost=e.code == pynvml.NVML_ERROR_GPU_IS_LOST, **identity)

    def _read_card_values(self, index: int, identity: dict[str, Any], problems: list[str],
                          handles: dict[int, Any]) -> tuple[dict[str, Any], list[_Row]]:
        nv = self.nvml
        handles[index] = handle = nv.call(pynvml.nvmlDeviceGetHandleByIndex, index)
        identity["uuid"] = _text(nv.text("nvmlDeviceGetUUID", handle, _UUID_BYTES))
        identity["name"] = _text(nv.text("nvmlDeviceGetName", handle, _NAME_BYTES))
        identity["serial"] = self._serial(identity["uuid"] or index, handle)
        identity["pci_bus_id"] = _text(getattr(nv.optional(pynvml.nvmlDeviceGetPciInfo, handle), "busId", None))
        mode = nv.optional(pynvml.nvmlDeviceGetMigMode, handle)
        identity["mig_current"] = mig_current = None if mode is None else bool(mode[0])
        identity["mig_pending"] = None if mode is None else bool(mode[1])
        card: CardKey = (identity["uuid"] or index, mig_current)
        temperature = self._health.temperature(card, handle)
        power_mw = nv.optional(pynvml.nvmlDeviceGetPowerUsage, handle)
        utilization = None if mig_current else nv.optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        try:
            identity["memory"] = self._memory(handle)
        except NvmlCallError as e:
            # A card in MIG mode refuses its own memory to a container without the MIG monitor
            # capability (nvidia-smi writes "Insufficient Permissions" there); the instances it
            # can open still answer: read them, and mark the card (doctor's mig-monitor-missing).
            if not (mig_current and e.code == pynvml.NVML_ERROR_NO_PERMISSION):
                raise
            identity["memory"] = Memory()
            identity["aggregate_denied"] = True
        health = self._health.card(card, handle, mig_current)
        instances: list[MigInstance] = []
        processes: list[_Row] = []
        known = True
        if mig_current:
            for mig_index, mig_handle in self._mig_handles(handle):
                instance = self._instance(card, mig_index, mig_handle)
                instances.append(instance)
                listed = self._processes(mig_handle, instance.gpu_instance_id, instance.compute_instance_id,
                                         f"card {index} MIG device {mig_index}", problems)
                known = known and listed is not None
                processes.extend(listed or ())
        else:
            listed = self._processes(handle, None, None, f"card {index}", problems)
            known = listed is not None
            processes.extend(listed or ())
        return dict(
            index=index,
            processes_known=known,
            temperature_celsius=temperature,
            power_draw_watts=None if power_mw is None else power_mw / 1000.0,
            utilization_ratio=None if utilization is None else utilization.gpu / 100.0,
            instances=tuple(instances),
            health=health,
            **identity,
        ), processes

    def _serial(self, key: object, handle: Any) -> str | None:
        """``nvmlDeviceGetSerial`` (nvidia-smi's ``serial``), kept until NVML is initialised again;
        a card without one (GeForce answers NOT_SUPPORTED) is not asked again either."""
        if self._serials_generation != self.nvml.generation:
            self._serials, self._serials_generation = {}, self.nvml.generation
        if key not in self._serials:
            try:
                self._serials[key] = _text(self.nvml.text("nvmlDeviceGetSerial", handle, _SERIAL_BYTES))
            except NvmlCallError as e:
                if e.card_gone:
                    raise
                if not e.unsupported:
                    return None  # failed this time: asked again at the next read
                self._serials[key] = None
        return self._serials[key]

    def _instance(self, card: CardKey, mig_index: int, mig_handle: Any) -> MigInstance:
        nv = self.nvml
        gi = nv.uint("nvmlDeviceGetGpuInstanceId", mig_handle)
        ci = nv.uint("nvmlDeviceGetComputeInstanceId", mig_handle)
        memory = self._memory(mig_handle)
        profile = _profile(_text(nv.optional(nv.text, "nvmlDeviceGetName", mig_handle, _NAME_BYTES)))
        uuid = _text(nv.optional(nv.text, "nvmlDeviceGetUUID", mig_handle, _UUID_BYTES))
        return MigInstance(
            mig_index=mig_index, gpu_instance_id=gi, compute_instance_id=ci, memory=memory, profile=profile, uuid=uuid,
            # Remembered apart from the card: a MIG instance answers its own calls.
            ecc_errors=self._health.instance_ecc((uuid or f"{card[0]}/{mig_index}", True), mig_handle),
        )

    def _mig_handles(self, handle: Any) -> list[tuple[int, Any]]:
        nv = self.nvml
        found = []
        for mig_index in range(nv.call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
            try:
                found.append((mig_index, nv.mig_handle(handle, mig_index)))
            except NvmlCallError as e:
                if e.code not in _EMPTY_SLOT:
                    raise
        return found

    def _memory(self, handle: Any) -> Memory:
        """v2 (with ``reserved``) where the driver has it, else v1."""
        nv = self.nvml
        version = getattr(pynvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                m = nv.call(pynvml.nvmlDeviceGetMemoryInfo, handle, version=version)
                total, reserved, free, used = _layout(pynvml.c_nvmlMemory_v2_t, _MEMORY_V2).unpack(ctypes.string_at(
                    ctypes.addressof(m), ctypes.sizeof(m)))
                return Memory(total_bytes=total, used_bytes=used, free_bytes=free, reserved_bytes=reserved)
            except NvmlCallError as e:
                if not (e.unsupported or e.code == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    raise
        m = nv.optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
        if m is None:
            return Memory()
        return Memory(total_bytes=m.total, used_bytes=m.used, free_bytes=m.free)

    def _processes(self, handle: Any, gi: int | None, ci: int | None, where: str,
                   problems: list[str]) -> list[_Row] | None:
        """Compute (C), graphics (G) and MPS (M) processes; placement merges a pid
        listed in several of them into one process of type C+G or M+C. ``None`` when
        the driver has no list to give: which processes run is then unknown."""
        found: list[_Row] = []
        readable = False
        for letter, functions in _PROCESS_LISTS:
            listed = self._process_list(handle, functions, where, problems)
            if listed is None:
                continue
            # The compute list is the one that says whether the device is free: an empty
            # graphics list alone would show a busy compute device as free.
            readable = readable or letter == "C"
            found.extend((pid, letter, used, gi, ci) for pid, used in listed)
        if not readable:
            # pynvml reaches the process lists only through their _v2 and _v3
            # symbols; a driver with neither would show every device as idle.
            problems.append(f"{where}: this driver's NVML has no compute process list pynvml can call; "
                            "processes unknown (use --source nvidia-smi)")
            return None
        return found

    def _process_list(self, handle: Any, functions: tuple[str, ...], where: str,
                      problems: list[str]) -> list[tuple[int, int | None]] | None:
        """(pid, used bytes) from the newest variant the driver has, or ``None``
        when it has none. A pid past Linux's range is kept (a vGPU VM's: model/snapshot.py);
        a list holding a pid no process has, 0 or 2^32-1 (the R535 v2/v3 struct mismatch
        puts both between the real entries), is read again with the older variant; if every
        variant is garbled, those pids are dropped and the memory of the rest is unknown:
        the same garbling made it garbage too."""
        garbled: list[tuple[int, int | None]] | None = None
        for name in functions:
            try:
                entries = self._listed(name, handle)
            except NvmlCallError as e:
                if e.unsupported:
                    continue
                raise
            # min and max of (pid, used) pairs hold the least and greatest pid.
            if not entries or (is_process_id(min(entries)[0]) and is_process_id(max(entries)[0])):
                return entries
            garbled = entries
        if garbled is None:
            return None
        kept: list[tuple[int, int | None]] = [(pid, None) for pid, _ in garbled if is_process_id(pid)]
        problems.append(
            f"{where}: {len(garbled) - len(kept)} process entries with impossible pids (0, or 4294967295: NVML's "
            f"'none') dropped and the memory of {len(kept)} unknown (NVML process struct version mismatch)"
        )
        return kept

    def _listed(self, name: str, handle: Any) -> list[tuple[int, int | None]]:
        """One process list, as pynvml's wrapper reads it (sized by a first call, an array of
        twice that plus five, read), without its per-entry objects. A list that grew past the
        array in between answers INSUFFICIENT_SIZE, and is asked again (sized anew), a bounded
        number of times, rather than fail the card for this read."""
        nv = self.nvml
        function = nv.c_function(name)
        entry = _ENTRY_V3 if name.endswith("_v3") else pynvml.c_nvmlProcessInfo_v2_t
        count = ctypes.c_uint(0)
        for attempt in range(1, _LIST_ATTEMPTS + 1):
            count.value = 0
            code = function(handle, ctypes.byref(count), None)
            if code == pynvml.NVML_SUCCESS:
                return []  # no processes
            if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                nv.check(name, code)
            count.value = count.value * 2 + 5
            array = (entry * count.value)()
            code = function(handle, ctypes.byref(count), array)
            if code == pynvml.NVML_SUCCESS:
                return _unpack(entry, array, count.value)
            if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or attempt == _LIST_ATTEMPTS:
                nv.check(name, code)
        raise AssertionError("unreachable: the last attempt raises")


def _activity_failed(where: str, what: str, e: Exception, problems: list[str]) -> None:
    """What a card's activity raised beyond NVML's own errors (those are problem lines already)."""
    log.warning("%s: %s not read", where, what, exc_info=e)
    problems.append(f"{where}: {what} not read ({type(e).__name__}: {e}); {what} unknown")


# (pid, type letter, used bytes, GPU instance id, compute instance id): a process as listed, before its name.
_Row = tuple[int, str, "int | None", "int | None", "int | None"]


class _NameAsker:
    """``nvmlSystemGetProcessName`` through the C function, one buffer for a read's calls."""

    def __init__(self, nv: Nvml) -> None:
        self._nv = nv
        self._buffer = ctypes.create_string_buffer(_NAME_BUFFER_BYTES)
        self._decoded: dict[bytes, str] = {}  # many processes share a name
        try:
            self._function: Any = nv.c_function("nvmlSystemGetProcessName")
        except NvmlCallError:
            self._function = None

    def name(self, pid: int) -> str:
        if self._function is None:
            return ""
        # Plain ints go as C ints, whose 32 bits are those of NVML's unsigned ints: the size, and
        # every pid kept (below 2^32-1: one past 2^31, a vGPU VM's id, passes its own bits).
        code = self._function(pid, self._buffer, _NAME_BUFFER_BYTES)
        if code != pynvml.NVML_SUCCESS:
            try:
                self._nv.check("nvmlSystemGetProcessName", code)  # a driver-level error still marks re-init
            except NvmlCallError:
                return ""  # exited since it was listed, or not ours to see
        value = self._buffer.value
        name = self._decoded.get(value)
        if name is None:
            # Bounded as nvidia-smi's path bounds it (NVML's own cap is the 1024-byte buffer).
            self._decoded[value] = name = bounded_name(_text(value) or "")
        return name


@functools.cache
def _layout(entry: type[ctypes.Structure], fields: tuple[str, ...] = ("pid", "usedGpuMemory")) -> struct.Struct:
    """``fields`` (in the order they lie, unsigned ints) of one of pynvml's Structures, at their
    offsets: one C call reads them all, where each attribute would pass through pynvml's
    ``__getattribute__``."""
    codes = {4: "I", 8: "Q"}
    layout, at = "=", 0
    for name in fields:
        field = getattr(entry, name)
        if field.offset < at or field.size not in codes:
            raise AssertionError(f"unexpected layout of {entry.__name__}")
        layout += f"{field.offset - at}x{codes[field.size]}"
        at = field.offset + field.size
    return struct.Struct(f"{layout}{ctypes.sizeof(entry) - at}x")


def _unpack(entry: type[ctypes.Structure], array: ctypes.Array[Any], count: int) -> list[tuple[int, int | None]]:
    data = ctypes.string_at(array, count * ctypes.sizeof(entry))
    entries: list[tuple[int, int | None]] = list(_layout(entry).iter_unpack(data))
    if entries and max(entries, key=_USED)[1] == _UNKNOWN_MEMORY:
        return [(pid, None if used == _UNKNOWN_MEMORY else used) for pid, used in entries]
    return entries


def _profile(mig_name: str | None) -> str | None:
    m = _PROFILE_IN_NAME.search(mig_name or "")
    return m.group(1) if m else None


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    text = str(value).strip()
    return text or None


def _cuda_version(value: int | None) -> str | None:
    """12040 -> "12.4", as nvidia-smi prints it."""
    if not value:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


__all__ = ["NvmlSource", "NvmlUnavailable"]
