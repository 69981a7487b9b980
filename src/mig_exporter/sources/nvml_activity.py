"""What a device's engines did, through NVML (docs/activity.md): GPU Performance Monitoring (GPM,
Hopper and later) per GPU instance and per whole card, and each process's share of a whole card.

- GPM: ``nvmlGpmQueryDeviceSupport`` of the card (never of a MIG handle), once per card until NVML
  is initialised again; a sample per GPU instance (``nvmlGpmMigSampleGet`` on the card, with the
  GPU instance's id: one call that its compute instances share) or per whole card
  (``nvmlGpmSampleGet``); ``nvmlGpmMetricsGet`` between two samples for graphics activity, SM
  activity, SM occupancy, any-tensor activity and DRAM bandwidth (percent, here ratios). What
  ``nvidia-smi dmon --gpm-metrics 1,2,3,5,10`` shows, and DCGM's ``DCGM_FI_PROF_*`` fields.
- Every scraper gets its own window, without a thread: each GPU instance (by card UUID, its id and
  its members) keeps a short, time-ordered list of samples; a read adds one where the newest is a
  second old or more, and measures from the newest kept sample at least ``window`` old, else the
  oldest kept. Two Prometheus servers at different phases each get about the window.
- ``nvmlDeviceGetProcessUtilization`` on a whole card, since the newest sample the last read saw
  (``nvidia-smi pmon -s u``'s sm and mem columns).

Unknown is never 0: a device whose activity was not measured carries the reason
(``ACTIVITY_*`` of model/snapshot.py) instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pynvml

from mig_exporter.model.snapshot import (
    ACTIVITY_FIRST_SAMPLE,
    ACTIVITY_NO_GPM,
    ACTIVITY_NOT_MEASURED,
    ACTIVITY_READ_FAILED,
    Activity,
    MigInstance,
    ProcessActivity,
)
from mig_exporter.sources.nvml_gateway import LASTING_UNSUPPORTED, Nvml, NvmlCallError

DEFAULT_WINDOW_S = 30.0
# A new sample only where the newest is this old: NVML wants more than 100 ms between two ("due to
# the internal sample refresh rate"), and scrapes closer than this share one.
MIN_INTERVAL_S = 1.0
# GPM metric id (nvml.h's nvmlGpmMetricId_t, the same in every binding) -> Activity's field.
GPM_METRICS = (
    (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, "graphics_ratio"),
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_ratio"),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy_ratio"),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_ratio"),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_bandwidth_ratio"),
)
# nvmlGpmMetric_t: metricId, nvmlReturn, value (double), then metricInfo (three pointers, left alone).
_METRIC = struct.Struct("=IId24x")
# Set before the call, so that a metric NVML did not write reads as failed, never as a stale value
# (DataDog's gpm.go does the same "to ensure NVML has actually modified the value").
_UNWRITTEN = b"".join(_METRIC.pack(metric, pynvml.NVML_ERROR_UNKNOWN, math.nan) for metric, _ in GPM_METRICS)

# A GPU instance's or whole card's samples are kept under (card, GPU instance id or None).
SeriesKey = tuple[object, "int | None"]
# Who a GPU instance is: its (compute instance id, MIG UUID) pairs. Ids are handed out again at
# once after a reconfiguration, so a GPU instance made again under the same id starts afresh.
Members = frozenset[tuple["int | None", "str | None"]]
_WHOLE_CARD: Members = frozenset()

# nvmlProcessUtilizationSample_t: pid, timeStamp (CPU us), smUtil, memUtil, at pynvml's offsets.
_SAMPLE_FIELDS = ("pid", "timeStamp", "smUtil", "memUtil")
# Reads of the samples that grow between the sizing call and the read each time.
_SAMPLE_ATTEMPTS = 3


def window_bounds(window_s: float) -> tuple[int, float]:
    """How many samples a list keeps, and for how long (s). Samples are at least MIN_INTERVAL_S
    apart, so ``window / MIN_INTERVAL_S + 2`` of them always reach back a window; and a sample
    older than twice the window and a half is dropped (DCGM keeps "twice the nominal interval plus
    a small jitter slack so late polls still leave two usable samples"; the slack here is half a
    window, so that a lone scraper at twice the window, Prometheus' 1m against the default 30 s,
    keeps its last sample through any jitter)."""
    return int(window_s / MIN_INTERVAL_S) + 2, 2 * window_s + max(MIN_INTERVAL_S, window_s / 2)


class _Series:
    """One GPU instance's (or whole card's) samples, oldest first, as (taken at, sample)."""

    __slots__ = ("members", "samples")

    def __init__(self, members: Members) -> None:
        self.members = members
        self.samples: list[tuple[float, Any]] = []


class GpmBook:
    """The GPM samples kept across reads, and the answers of ``nvmlGpmQueryDeviceSupport``.

    A read runs ``with book.reading() as read:`` and asks ``read.gpu_instances`` or
    ``read.whole_card`` of each card it read; at its end, the samples of every GPU instance or card
    it did not see are freed (unless that card's read failed). ``release()`` frees them all: before
    NVML is initialised again or shut down."""

    def __init__(self, nvml: Nvml, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < MIN_INTERVAL_S:
            raise ValueError(f"the activity window must be at least {MIN_INTERVAL_S:g} s")
        self.nv = nvml
        self.window_s = window_s
        self.clock = clock
        self.max_samples, self.max_age_s = window_bounds(window_s)
        self._lock = threading.Lock()
        self._series: dict[SeriesKey, _Series] = {}
        self._supported: dict[object, bool] = {}  # card -> GPM, until NVML is initialised again
        self._generation = -1
        self._request: Any = None  # one nvmlGpmMetricsGet_t, pynvml's, made at first use
        self._functions: dict[str, Any] = {}  # the C functions, looked up once a read

    @property
    def samples_held(self) -> int:
        return sum(len(s.samples) for s in self._series.values())

    @contextlib.contextmanager
    def reading(self) -> Iterator[_GpmRead]:
        with self._lock:
            if self._generation != self.nv.generation:
                # Samples of an earlier initialisation (release() freed them before it) and what
                # it said of each card do not hold for this one, which may be a new driver.
                self._release_locked()
                self._supported, self._generation = {}, self.nv.generation
            self._functions = {}
            read = _GpmRead(self, self.clock())
            yield read
            for key in [k for k in self._series if k not in read.seen and k[0] not in read.failed_cards]:
                self._free_all(self._series.pop(key))

    def release(self) -> None:
        """Free every sample kept (before NVML shuts down or is initialised again)."""
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        self._functions = {}
        for series in self._series.values():
            self._free_all(series)
        self._series = {}

    # -- one key -----------------------------------------------------------------------------------

    def measure(self, read: _GpmRead, key: SeriesKey, members: Members, take: Callable[[Any], None],
                where: str, problems: list[str]) -> tuple[Activity | None, str | None]:
        """The activity of ``key`` over its window: a sample taken (``take`` fills it) where the
        newest is MIN_INTERVAL_S old or more, then the metrics since its baseline."""
        read.seen.add(key)
        series = self._series.get(key)
        if series is not None and series.members != members:
            self._free_all(series)  # made again under the same id: its old samples are another's
            series = None
        if series is None:
            series = self._series[key] = _Series(members)
        now = read.now
        samples = series.samples
        dropped = []
        while samples and now - samples[0][0] > self.max_age_s:
            dropped.append(samples.pop(0)[1])
        due = not samples or now - samples[-1][0] >= MIN_INTERVAL_S
        if due and len(samples) >= self.max_samples:
            dropped.append(samples.pop(0)[1])
        # A sample dropped as a new one is due is filled again rather than freed and another
        # allocated (DCGM's reuseOrAllocateSample): two calls a read fewer, as many samples held.
        spare = dropped.pop() if due and dropped else None
        for sample in dropped:
            self._free(sample)
        if due:
            try:
                sample = spare if spare is not None else self._alloc()
            except NvmlCallError as e:
                problems.append(f"{where}: GPM sample not allocated ({e}); activity unknown")
                return None, ACTIVITY_READ_FAILED
            try:
                take(sample)
            except NvmlCallError as e:
                self._free(sample)
                problems.append(f"{where}: GPM sample not taken ({e}); activity unknown")
                return None, ACTIVITY_READ_FAILED
            samples.append((now, sample))
        newest_at, newest = samples[-1]
        baseline = None
        for at, sample in reversed(samples[:-1]):
            baseline = (at, sample)
            if newest_at - at >= self.window_s:
                break  # the newest at least a window old; else the loop ends on the oldest
        if baseline is None:
            return None, ACTIVITY_FIRST_SAMPLE
        try:
            ratios = self._metrics(baseline[1], newest)
        except NvmlCallError as e:
            problems.append(f"{where}: GPM metrics not read ({e}); activity unknown")
            return None, ACTIVITY_READ_FAILED
        if all(r is None for r in ratios):
            return None, ACTIVITY_NOT_MEASURED
        return Activity(newest_at - baseline[0], *ratios), None

    def supported(self, card: object, handle: Any) -> bool:
        """Whether ``card`` (its parent handle: never a MIG handle's, whose asking disturbed later
        memory reads in a driver-535 report) has GPM. SUCCESS with isSupportedDevice 0 and an error
        both say no (DCGM's DoesNvmlDeviceSupportGpm: "Assuming no GPM support"); kept until NVML
        is initialised again, but for an error that says the card is gone."""
        known = self._supported.get(card)
        if known is None:
            try:
                known = bool(self.nv.call(pynvml.nvmlGpmQueryDeviceSupport, handle).isSupportedDevice)
            except NvmlCallError as e:
                if e.card_gone:
                    return False
                known = False
            self._supported[card] = known
        return known

    def function(self, name: str) -> Any:
        """The C function ``name`` (``Nvml.c_function``), looked up once a read."""
        found = self._functions.get(name)
        if found is None:
            found = self._functions[name] = self.nv.c_function(name)
        return found

    def _alloc(self) -> Any:
        sample = pynvml.c_nvmlGpmSample_t()
        self.nv.check("nvmlGpmSampleAlloc", self.function("nvmlGpmSampleAlloc")(ctypes.byref(sample)))
        return sample

    def _free(self, sample: Any) -> None:
        with contextlib.suppress(NvmlCallError):
            self.nv.check("nvmlGpmSampleFree", self.function("nvmlGpmSampleFree")(sample))

    def _free_all(self, series: _Series) -> None:
        for _, sample in series.samples:
            self._free(sample)
        series.samples = []

    def _metrics(self, first: Any, second: Any) -> list[float | None]:
        """The five metrics between two samples, as ratios; ``None`` for each whose own return
        code is not success, or that is NaN or Inf. Percent / 100, held within [0, 1] (DCGM
        divides its percentage fields by 100.0)."""
        request = self._request
        if request is None:
            request = self._request = pynvml.c_nvmlGpmMetricsGet_t()
            if (type(request).metrics.offset, ctypes.sizeof(pynvml.c_nvmlGpmMetric_t)) != (24, _METRIC.size):
                raise AssertionError("unexpected layout of pynvml's c_nvmlGpmMetricsGet_t")
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION  # pynvml's wrapper leaves it to the caller
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        at = ctypes.addressof(request) + 24
        ctypes.memmove(at, _UNWRITTEN, len(_UNWRITTEN))
        self.nv.check("nvmlGpmMetricsGet", self.function("nvmlGpmMetricsGet")(ctypes.byref(request)))
        ratios: list[float | None] = []
        for _, code, value in _METRIC.iter_unpack(ctypes.string_at(at, len(_UNWRITTEN))):
            ok = code == pynvml.NVML_SUCCESS and math.isfinite(value)
            ratios.append(min(1.0, max(0.0, value / 100.0)) if ok else None)
        return ratios


class _GpmRead:
    """One read's pass over the book: its time, the keys it saw, the cards whose read failed."""

    def __init__(self, book: GpmBook, now: float) -> None:
        self.book = book
        self.now = now
        self.seen: set[SeriesKey] = set()
        self.failed_cards: set[object] = set()

    def whole_card(self, card: object, handle: Any, where: str,
                   problems: list[str]) -> tuple[Activity | None, str | None]:
        """A whole card's activity (``nvmlGpmSampleGet``), or why there is none."""
        book = self.book
        if not book.supported(card, handle):
            return None, ACTIVITY_NO_GPM
        function = book.function("nvmlGpmSampleGet")

        def take(sample: Any) -> None:
            book.nv.check("nvmlGpmSampleGet", function(handle, sample))
        return book.measure(self, (card, None), _WHOLE_CARD, take, where, problems)

    def gpu_instances(self, card: object, handle: Any, instances: Iterable[MigInstance], where: str,
                      problems: list[str]) -> tuple[MigInstance, ...]:
        """``instances`` with their GPU instance's activity (``nvmlGpmMigSampleGet`` on the card,
        once per GPU instance), or why there is none. A GPU instance with no compute instance has
        no MIG device, so NVML lists no instance for it here: it is not a device, and gets nothing."""
        instances = tuple(instances)
        book = self.book
        if not instances:
            return instances
        if not book.supported(card, handle):
            return tuple(i._replace(activity=None, activity_unknown=ACTIVITY_NO_GPM) for i in instances)
        members: dict[int, set[tuple[int | None, str | None]]] = {}
        for i in instances:
            if i.gpu_instance_id is not None:
                members.setdefault(i.gpu_instance_id, set()).add((i.compute_instance_id, i.uuid))
        function = book.function("nvmlGpmMigSampleGet")
        found: dict[int, tuple[Activity | None, str | None]] = {}
        for gi, its in members.items():
            def take(sample: Any, gi: int = gi) -> None:
                book.nv.check("nvmlGpmMigSampleGet", function(handle, ctypes.c_uint(gi), sample))
            found[gi] = book.measure(self, (card, gi), frozenset(its), take, f"{where} GPU instance {gi}", problems)
        return tuple(i._replace(activity=found[i.gpu_instance_id][0], activity_unknown=found[i.gpu_instance_id][1])
                     if i.gpu_instance_id is not None else i for i in instances)


class ProcessActivityReader:
    """Each listed process's share of a whole card since the last read (``nvmlDeviceGetProcessUtilization``).

    NVML returns "one utilization sample structure ... per process running, that had some non-zero
    utilization during the last sample period", with "the CPU timestamp at which the samples were
    recorded", only those newer than the timestamp asked, and NOT_FOUND when there is none. So:

    - the timestamp asked is the newest the card's last read was given (0 at the first read: every
      sample the driver keeps), as nvtop keeps ``last_utilization_timestamp``;
    - a listed process without a sample was idle: 0.0 (nvtop marks it 0% too), and NOT_FOUND makes
      every listed process idle;
    - several samples of one pid (one per driver sample period with activity) are averaged, sm and
      mem apart: the mean of the periods in which it was active since the last read. A value over
      100 is not a measurement (nvtop drops such samples, its bug #110) and is left out; a process
      whose samples were all such reads unknown (None), not idle.
    - samples of pids the card does not list (exited since) are left out.

    A card that does not support it (NOT_SUPPORTED, FUNCTION_NOT_FOUND) is not asked again until
    NVML is initialised again; another error makes this read's values unknown, with a problem line."""

    def __init__(self, nvml: Nvml) -> None:
        self.nv = nvml
        self._seen_us: dict[object, int] = {}
        self._unsupported: set[object] = set()
        self._generation = -1
        self._layout: struct.Struct | None = None

    def read(self, card: object, handle: Any, pids: Iterable[int], where: str,
             problems: list[str]) -> tuple[ProcessActivity, ...] | None:
        if self._generation != self.nv.generation:
            self._seen_us, self._unsupported, self._generation = {}, set(), self.nv.generation
        if card in self._unsupported:
            return None
        listed = dict.fromkeys(pids)
        if not listed:
            return ()  # nothing to measure: not asked, and the next read asks since the last one that did
        since = self._seen_us.get(card, 0)
        try:
            samples = self._samples(handle, since)
        except NvmlCallError as e:
            if e.code in LASTING_UNSUPPORTED:
                self._unsupported.add(card)
            elif not e.unsupported:
                problems.append(f"{where}: process utilisation not read ({e}); process activity unknown")
            return None
        sums: dict[int, list[float]] = {}  # pid -> sm sum, sm count, mem sum, mem count
        newest = since
        for pid, stamp, sm, mem in samples:
            if stamp <= since:
                continue  # older than asked: not this read's
            newest = max(newest, stamp)
            if pid not in listed:
                continue
            acc = sums.setdefault(pid, [0.0, 0, 0.0, 0])
            if sm <= 100:
                acc[0] += sm
                acc[1] += 1
            if mem <= 100:
                acc[2] += mem
                acc[3] += 1
        self._seen_us[card] = newest
        rows = []
        for pid in listed:
            found = sums.get(pid)
            if found is None:
                rows.append(ProcessActivity(pid, 0.0, 0.0))
            else:
                rows.append(ProcessActivity(pid, found[0] / found[1] / 100.0 if found[1] else None,
                                            found[2] / found[3] / 100.0 if found[3] else None))
        return tuple(rows)

    def _samples(self, handle: Any, since: int) -> list[tuple[int, int, int, int]]:
        """(pid, timestamp us, sm %, mem %) of the samples newer than ``since``, as pynvml's wrapper
        asks them (sized by a call with no array, then read), without its per-entry objects; a list
        that grew in between is asked again, a bounded number of times."""
        name = "nvmlDeviceGetProcessUtilization"
        function = self.nv.c_function(name)
        entry = pynvml.c_nvmlProcessUtilizationSample_t
        count = ctypes.c_uint(0)
        stamp = ctypes.c_ulonglong(since)
        for attempt in range(1, _SAMPLE_ATTEMPTS + 1):
            count.value = 0
            code = function(handle, None, ctypes.byref(count), stamp)
            if code in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
                return []  # no sample since ``since``: every process was idle
            if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                self.nv.check(name, code)
            array = (entry * count.value)()
            code = function(handle, array, ctypes.byref(count), stamp)
            if code == pynvml.NVML_SUCCESS:
                data = ctypes.string_at(array, count.value * ctypes.sizeof(entry))
                return list(self._entry_layout().iter_unpack(data))
            if code == pynvml.NVML_ERROR_NOT_FOUND:
                return []
            if code != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or attempt == _SAMPLE_ATTEMPTS:
                self.nv.check(name, code)
        raise AssertionError("unreachable: the last attempt raises")

    def _entry_layout(self) -> struct.Struct:
        """_SAMPLE_FIELDS at the offsets of pynvml's Structure (one unpack a sample)."""
        if self._layout is None:
            entry = pynvml.c_nvmlProcessUtilizationSample_t
            codes = {4: "I", 8: "Q"}
            layout, at = "=", 0
            for name in _SAMPLE_FIELDS:
                f = getattr(entry, name)
                if f.offset < at or f.size not in codes:
                    raise AssertionError(f"unexpected layout of {entry.__name__}")
                layout += f"{f.offset - at}x{codes[f.size]}"
                at = f.offset + f.size
            self._layout = struct.Struct(f"{layout}{ctypes.sizeof(entry) - at}x")
        return self._layout


__all__ = ["DEFAULT_WINDOW_S", "GPM_METRICS", "MIN_INTERVAL_S", "GpmBook", "ProcessActivityReader", "window_bounds"]
