"""The NVML read path: libnvidia-ml through pynvml, answering in microseconds.

It builds the same snapshot as the nvidia-smi path, through the same
placement rules, so a dashboard cannot tell which path fed it except by the
``source`` label. What each value matches in nvidia-smi:

- cards: ``nvmlDeviceGetCount`` / ``GetHandleByIndex`` (``nvidia-smi -L`` order);
- MIG mode: ``GetMigMode`` (``mig_mode/current_mig``, ``pending_mig``);
- instances: ``GetMaxMigDeviceCount`` and ``GetMigDeviceHandleByIndex`` over
  every slot, skipping empty ones (``mig_devices/mig_device``); profile from the
  instance's name, "NVIDIA A100-SXM4-80GB MIG 3g.40gb" (``-L``'s profile);
- memory: ``GetMemoryInfo`` v2 where the driver has it, for ``reserved``
  (``fb_memory_usage``);
- processes: compute, graphics and MPS lists on each MIG handle, or on the
  card (``processes/process_info``), v3 with a fallback to v2.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pynvml

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.core.flight import Flights
from mig_exporter.model.placement import place
from mig_exporter.model.snapshot import (
    CardReading,
    Memory,
    MigInstance,
    ProcessReading,
    Snapshot,
    is_plausible_pid,
)
from mig_exporter.sources.nvml_gateway import Nvml, NvmlCallError, NvmlUnavailable, error_name

DEFAULT_TIMEOUT_S = 10.0
_EMPTY_SLOT = frozenset({pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT})
# Reads of a process list that grows between pynvml's sizing call and its read each time.
_LIST_ATTEMPTS = 3
_PROFILE_IN_NAME = re.compile(r"\bMIG\s+(\S+)\s*$")

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

    def __init__(self, nvml: Nvml | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
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
        cards: list[CardReading] = []
        problems: list[str] = []
        for index in range(count):
            cards.append(self._read_card(index, problems))
        return place(cards, driver_version=driver, cuda_version=cuda, problems=problems)

    def _read_card(self, index: int, problems: list[str]) -> CardReading:
        """One card; a failing call marks the card (keeping what was read before
        it) instead of failing the read, unless the whole library has gone."""
        identity: dict[str, Any] = {}
        try:
            return self._read_card_values(index, identity, problems)
        except NvmlCallError as e:
            if e.code in (pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
                raise
            return CardReading(index=index, error=f"{error_name(e.code)} in {e.function}", **identity)

    def _read_card_values(self, index: int, identity: dict[str, Any], problems: list[str]) -> CardReading:
        nv = self.nvml
        handle = nv.call(pynvml.nvmlDeviceGetHandleByIndex, index)
        identity["uuid"] = _text(nv.call(pynvml.nvmlDeviceGetUUID, handle))
        identity["name"] = _text(nv.call(pynvml.nvmlDeviceGetName, handle))
        identity["pci_bus_id"] = _text(getattr(nv.optional(pynvml.nvmlDeviceGetPciInfo, handle), "busId", None))
        mode = nv.optional(pynvml.nvmlDeviceGetMigMode, handle)
        identity["mig_current"] = mig_current = None if mode is None else bool(mode[0])
        identity["mig_pending"] = None if mode is None else bool(mode[1])
        temperature = nv.optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        power_mw = nv.optional(pynvml.nvmlDeviceGetPowerUsage, handle)
        utilization = None if mig_current else nv.optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
        identity["memory"] = self._memory(handle)
        instances: list[MigInstance] = []
        processes: list[ProcessReading] = []
        if mig_current:
            for mig_index, mig_handle in self._mig_handles(handle):
                gi = nv.call(pynvml.nvmlDeviceGetGpuInstanceId, mig_handle)
                ci = nv.call(pynvml.nvmlDeviceGetComputeInstanceId, mig_handle)
                instances.append(MigInstance(
                    mig_index=mig_index,
                    gpu_instance_id=gi,
                    compute_instance_id=ci,
                    memory=self._memory(mig_handle),
                    profile=_profile(_text(nv.optional(pynvml.nvmlDeviceGetName, mig_handle))),
                    uuid=_text(nv.optional(pynvml.nvmlDeviceGetUUID, mig_handle)),
                ))
                processes.extend(self._processes(mig_handle, gi, ci, f"card {index} MIG device {mig_index}", problems))
        else:
            processes.extend(self._processes(handle, None, None, f"card {index}", problems))
        return CardReading(
            index=index,
            temperature_celsius=None if temperature is None else float(temperature),
            power_draw_watts=None if power_mw is None else power_mw / 1000.0,
            utilization_ratio=None if utilization is None else utilization.gpu / 100.0,
            instances=tuple(instances),
            processes=tuple(processes),
            **identity,
        )

    def _mig_handles(self, handle: Any) -> list[tuple[int, Any]]:
        nv = self.nvml
        found = []
        for mig_index in range(nv.call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)):
            try:
                found.append((mig_index, nv.call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, mig_index)))
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
                return Memory(total_bytes=m.total, used_bytes=m.used, free_bytes=m.free, reserved_bytes=m.reserved)
            except NvmlCallError as e:
                if not (e.unsupported or e.code == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
                    raise
        m = nv.optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
        if m is None:
            return Memory()
        return Memory(total_bytes=m.total, used_bytes=m.used, free_bytes=m.free)

    def _processes(self, handle: Any, gi: int | None, ci: int | None, where: str,
                   problems: list[str]) -> list[ProcessReading]:
        """Compute (C), graphics (G) and MPS (M) processes; placement merges a pid
        listed in several of them into one process of type C+G or M+C."""
        found: list[ProcessReading] = []
        names: dict[int, str] = {}
        readable = False
        for letter, functions in _PROCESS_LISTS:
            listed = self._process_list(handle, functions, where, problems)
            if listed is None:
                continue
            readable = True
            for pid, used in listed:
                if pid not in names:
                    names[pid] = self._process_name(pid)
                found.append(ProcessReading(pid=pid, type=letter, name=names[pid], used_bytes=used,
                                            gpu_instance_id=gi, compute_instance_id=ci))
        if not readable:
            # pynvml reaches the process lists only through their _v2 and _v3
            # symbols; a driver with neither would show every device as idle.
            problems.append(f"{where}: this driver's NVML has no process list pynvml can call; "
                            "processes unknown (use --source nvidia-smi)")
        return found

    def _process_list(self, handle: Any, functions: tuple[str, ...], where: str,
                      problems: list[str]) -> list[tuple[int, int | None]] | None:
        """(pid, used bytes) from the newest variant the driver has, or ``None``
        when it has none. A list holding an impossible pid (the R535 v2/v3 struct
        mismatch) is read again with the older variant; if every variant is
        garbled, the impossible pids are dropped and the memory of the rest is
        unknown: the same garbling made it garbage too."""
        garbled: list[Any] | None = None
        for name in functions:
            function = getattr(pynvml, name, None)
            if function is None:
                continue
            try:
                entries = self._listed(function, handle)
            except NvmlCallError as e:
                if e.unsupported:
                    continue
                raise
            if all(is_plausible_pid(p.pid) for p in entries):
                return [(int(p.pid), p.usedGpuMemory) for p in entries]
            garbled = entries
        if garbled is None:
            return None
        kept: list[tuple[int, int | None]] = [(int(p.pid), None) for p in garbled if is_plausible_pid(p.pid)]
        problems.append(
            f"{where}: {len(garbled) - len(kept)} process entries with impossible pids dropped and the memory of "
            f"{len(kept)} unknown (NVML process struct version mismatch)"
        )
        return kept

    def _listed(self, function: Any, handle: Any) -> list[Any]:
        """One process list. pynvml sizes it, allocates twice that plus five and reads: a list
        that grew past that in between answers INSUFFICIENT_SIZE, and is asked again (sized
        anew), a bounded number of times, rather than fail the card for this read."""
        for _ in range(_LIST_ATTEMPTS - 1):
            try:
                return list(self.nvml.call(function, handle))
            except NvmlCallError as e:
                if e.code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                    raise
        return list(self.nvml.call(function, handle))

    def _process_name(self, pid: int) -> str:
        try:
            return _text(self.nvml.call(pynvml.nvmlSystemGetProcessName, pid)) or ""
        except NvmlCallError:
            return ""  # exited since it was listed, or not ours to see


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
