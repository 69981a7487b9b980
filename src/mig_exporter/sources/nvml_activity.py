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
- ``nvmlDeviceGetProcessUtilization`` on a whole card (``nvidia-smi pmon -s u``'s sm and mem
  columns): each card keeps what the driver gave over the last window, asks only for what is newer
  than the newest it kept, and every read averages the window that ends at its own time.

Unknown is never 0: a device whose activity was not measured carries the reason
(``ACTIVITY_*`` of model/snapshot.py) instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import pynvml

from mig_exporter.core.errors import ReadError
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
# Kept samples are spaced at least window / SPACINGS apart (but the newest), so that a list holds
# at most SPACINGS + 2 whatever the window: 18 at 30 s and at 3600 s alike.
SPACINGS = 16
# GPM metric id (nvml.h's nvmlGpmMetricId_t, the same in every binding) -> Activity's field.
GPM_METRICS = (
    (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, "graphics_ratio"),
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_ratio"),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy_ratio"),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_ratio"),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_bandwidth_ratio"),
)
# A GPM percent this far outside 0-100 is rounding, held at the edge; further out it is no
# measurement (counters across a GPU instance remade unseen, a driver fault) and is left out, as
# DCGM blanks what it cannot trust: clamping would turn -20 % into a measured "idle".
GPM_PERCENT_SLACK = 0.5
# nvmlGpmMetric_t: metricId, nvmlReturn, value (double), then metricInfo (three pointers, left alone).
_METRIC = struct.Struct("=IId24x")
# Set before the call, so that a metric NVML did not write reads as failed, never as a stale value
# (DataDog's gpm.go does the same "to ensure NVML has actually modified the value").
_UNWRITTEN = b"".join(_METRIC.pack(metric, pynvml.NVML_ERROR_UNKNOWN, math.nan) for metric, _ in GPM_METRICS)

# A GPU instance's or whole card's samples are kept under (card, GPU instance id or None).
SeriesKey = tuple[object, "int | None"]
# Who a GPU instance is: its (compute instance id, MIG UUID, profile) triples. Ids are handed out
# again at once after a reconfiguration, so a GPU instance made again under the same id starts
# afresh; one made again of the same shape where the MIG UUIDs repeat cannot be told apart.
Members = frozenset[tuple["int | None", "str | None", "str | None"]]
_WHOLE_CARD: Members = frozenset()

# nvmlProcessUtilizationSample_t: pid, timeStamp (CPU us), smUtil, memUtil, encUtil, decUtil, at
# pynvml's offsets (the media engines only to tell a transcoder from an idle process, as pmon's).
_SAMPLE_FIELDS = ("pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil")
# Reads of the samples that grow between the sizing call and the read each time.
_SAMPLE_ATTEMPTS = 3


class ActivityUnreadable(ReadError):
    """This pynvml lays out a structure other than the exporter reads it (a newer binding)."""


class Bounds(NamedTuple):
    """What a sample list keeps: at most ``max_samples``, none older than ``max_age_s``, each
    (but the newest) at least ``spacing_s`` after the one before."""

    max_samples: int
    max_age_s: float
    spacing_s: float


def window_bounds(window_s: float) -> Bounds:
    """The bounds of a ``window_s`` list. Kept samples are at least ``spacing`` apart (a second, or
    a sixteenth of the window), so ``window / spacing + 2`` of them always reach a window back
    whatever the window; and a sample older than twice the window and a half is dropped (DCGM
    keeps "twice the nominal interval plus a small jitter slack so late polls still leave two
    usable samples"; the slack here is half a window, so that a lone scraper at twice the window,
    Prometheus' 1m against the default 30 s, keeps its last sample through any jitter)."""
    spacing = max(MIN_INTERVAL_S, window_s / SPACINGS)
    return Bounds(math.ceil(window_s / spacing - 1e-9) + 2, 2 * window_s + max(MIN_INTERVAL_S, window_s / 2),
                  spacing)


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
    it did not see are freed (unless that card's read failed, for ``max_age_s`` at most).
    ``release()`` frees them all: before NVML is initialised again or shut down."""

    def __init__(self, nvml: Nvml, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s < MIN_INTERVAL_S:
            raise ValueError(f"the activity window must be at least {MIN_INTERVAL_S:g} s")
        self.nv = nvml
        self.window_s = window_s
        self.clock = clock
        self.max_samples, self.max_age_s, self.spacing_s = window_bounds(window_s)
        self._lock = threading.Lock()
        self._series: dict[SeriesKey, _Series] = {}
        self._supported: dict[object, bool] = {}  # card -> GPM, until NVML is initialised again
        self._failed_since: dict[object, float] = {}  # card -> when its reads began to fail
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
                # Samples of an earlier initialisation (the gateway's on_reinit hook freed them
                # before it) and what it said of each card do not hold for this one, which may
                # be a new driver.
                self._release_locked()
                self._supported, self._generation = {}, self.nv.generation
            self._functions = {}
            read = _GpmRead(self, self.clock())
            yield read
            for card in [c for c in self._failed_since if c not in read.failed_cards]:
                del self._failed_since[card]
            for card in read.failed_cards:
                self._failed_since.setdefault(card, read.now)
            # A card whose reads fail keeps its windows for its return, but not past the age
            # bound: by then they hold nothing a read could measure from.
            kept = {c for c, since in self._failed_since.items() if read.now - since <= self.max_age_s}
            for key in [k for k in self._series if k not in read.seen and k[0] not in kept]:
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
        if due:
            # The newest stops being the newest: kept only if it lies a spacing after the one
            # before, so that the list reaches a window back in SPACINGS + 2 samples at most.
            if len(samples) >= 2 and samples[-1][0] - samples[-2][0] < self.spacing_s:
                dropped.append(samples.pop()[1])
            if len(samples) >= self.max_samples:
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
            except BaseException:
                self._free(sample)  # whatever failed, the sample is not lost (the card's read reports it)
                raise
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

    def supported(self, card: object, handle: Any, where: str, problems: list[str]) -> bool | None:
        """Whether ``card`` (its parent handle: never a MIG handle's, whose asking disturbed later
        memory reads in a driver-535 report) has GPM; ``None`` where NVML could not say this time
        (a problem line; asked again at the next read). Only a definite answer is kept, until NVML
        is initialised again: SUCCESS (isSupportedDevice), or NOT_SUPPORTED or FUNCTION_NOT_FOUND
        (DCGM's DoesNvmlDeviceSupportGpm: "Assuming no GPM support"). A passing UNKNOWN or TIMEOUT
        at start-up must not hide a Hopper card's activity for the exporter's life."""
        known = self._supported.get(card)
        if known is None:
            try:
                known = bool(self.nv.call(pynvml.nvmlGpmQueryDeviceSupport, handle).isSupportedDevice)
            except NvmlCallError as e:
                if e.code not in LASTING_UNSUPPORTED:
                    problems.append(f"{where}: GPM support not known ({e}); activity unknown")
                    return None
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
        """The five metrics between two samples, as ratios (DCGM divides its percentage fields by
        100.0); ``None`` for each whose own return code is not success, that is NaN or Inf, or
        that lies outside 0-100 by more than GPM_PERCENT_SLACK."""
        request = self._request
        if request is None:
            request = pynvml.c_nvmlGpmMetricsGet_t()
            if (type(request).metrics.offset, ctypes.sizeof(pynvml.c_nvmlGpmMetric_t)) != (24, _METRIC.size):
                raise ActivityUnreadable("unexpected layout of pynvml's c_nvmlGpmMetricsGet_t: activity not read")
            self._request = request
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION  # pynvml's wrapper leaves it to the caller
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = first, second
        at = ctypes.addressof(request) + 24
        ctypes.memmove(at, _UNWRITTEN, len(_UNWRITTEN))
        self.nv.check("nvmlGpmMetricsGet", self.function("nvmlGpmMetricsGet")(ctypes.byref(request)))
        ratios: list[float | None] = []
        for _, code, value in _METRIC.iter_unpack(ctypes.string_at(at, len(_UNWRITTEN))):
            ok = code == pynvml.NVML_SUCCESS and -GPM_PERCENT_SLACK <= value <= 100.0 + GPM_PERCENT_SLACK
            ratios.append(min(1.0, max(0.0, value / 100.0)) if ok else None)  # NaN fails the range
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
        supported = book.supported(card, handle, where, problems)
        if not supported:
            if supported is None:
                self.seen.add((card, None))  # its window survives a read that could not ask
            return None, ACTIVITY_NO_GPM if supported is False else ACTIVITY_READ_FAILED

        def take(sample: Any) -> None:
            book.nv.check("nvmlGpmSampleGet", book.function("nvmlGpmSampleGet")(handle, sample))
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
        supported = book.supported(card, handle, where, problems)
        if not supported:
            if supported is None:
                self.seen.update((card, i.gpu_instance_id) for i in instances)
            reason = ACTIVITY_NO_GPM if supported is False else ACTIVITY_READ_FAILED
            return tuple(i._replace(activity=None, activity_unknown=reason) for i in instances)
        members: dict[int, set[tuple[int | None, str | None, str | None]]] = {}
        for i in instances:
            if i.gpu_instance_id is not None:
                members.setdefault(i.gpu_instance_id, set()).add((i.compute_instance_id, i.uuid, i.profile))
        found: dict[int, tuple[Activity | None, str | None]] = {}
        for gi, its in members.items():
            def take(sample: Any, gi: int = gi) -> None:
                function = book.function("nvmlGpmMigSampleGet")
                book.nv.check("nvmlGpmMigSampleGet", function(handle, ctypes.c_uint(gi), sample))
            found[gi] = book.measure(self, (card, gi), frozenset(its), take, f"{where} GPU instance {gi}", problems)
        return tuple(i._replace(activity=found[i.gpu_instance_id][0], activity_unknown=found[i.gpu_instance_id][1])
                     if i.gpu_instance_id is not None else i for i in instances)


# -- each process's share of a whole card ------------------------------------------------------------

# NVML: the driver's sample period "may be between 1 second and 1/6 second depending on the product"
# (nvidia-smi --help-query-gpu, utilization.gpu); a period learnt from the samples is held within it.
SHORTEST_PERIOD_US = 166_666
LONGEST_PERIOD_US = 1_000_000
# A span of one process's samples merged into one holds at most window / PROCESS_SPANS, so that a
# process keeps at most about max(2 x PROCESS_SPANS, window / its period) spans: 180 at 30 s and
# 1/6 s, 240 at 3600 s. Where a merged span meets the window's edge, its mean is taken as even: an
# error of at most 1/PROCESS_SPANS of the window.
PROCESS_SPANS = 120
# The wall clock moved this much more (or less) than the monotonic one since the card's last read
# (plus NTP's slew, at most 500 ppm): a step, not a slew.
CLOCK_STEP_S = 1.0
_STEP_US = int(CLOCK_STEP_S * 1e6)
_SLEW = 0.001


class _Span:
    """Part of one process's time on a card, [start_us, end_us]: the integral of its SM and memory
    percent over it (percent x us), how long of it no value was known (a sample over 100), and how
    long it worked on a media engine (NVENC, NVDEC) alone, with no SM or memory share."""

    __slots__ = ("end_us", "media_us", "mem_area", "mem_unknown_us", "sm_area", "sm_unknown_us", "start_us")

    def __init__(self, start_us: int, end_us: int, sm: int, mem: int, media: bool = False) -> None:
        length = end_us - start_us
        self.start_us, self.end_us = start_us, end_us
        self.sm_area, self.sm_unknown_us = (sm * length, 0) if sm <= 100 else (0, length)
        self.mem_area, self.mem_unknown_us = (mem * length, 0) if mem <= 100 else (0, length)
        self.media_us = length if media and not sm and not mem else 0

    def absorb(self, later: _Span) -> None:
        """Become one span with ``later`` (after it): a gap between the two was idle."""
        self.end_us = later.end_us
        self.sm_area += later.sm_area
        self.sm_unknown_us += later.sm_unknown_us
        self.mem_area += later.mem_area
        self.mem_unknown_us += later.mem_unknown_us
        self.media_us += later.media_us


class _CardWindow:
    """A whole card's process utilisation kept over the last window: each pid's spans in time
    order, the newest driver timestamp seen (what the next ask starts after), since when every
    sample the driver gave is here, and the driver's period, where its samples show it."""

    __slots__ = ("floor_us", "known_from_us", "newest_us", "offset_s", "period_us", "read_at", "spans")

    def __init__(self, offset_s: float, read_at: float, floor_us: int = 0) -> None:
        self.spans: dict[int, list[_Span]] = {}
        self.newest_us = 0
        self.known_from_us: int | None = None
        self.floor_us = floor_us  # nothing before this is known (the wall clock stepped then)
        self.period_us: int | None = None
        self.offset_s = offset_s  # the wall clock less the monotonic one, at the last read
        self.read_at = read_at


class ProcessActivityReader:
    """Each listed process's share of a whole card over the last window (``nvmlDeviceGetProcessUtilization``).

    NVML returns "one utilization sample structure ... per process running, that had some non-zero
    utilization during the last sample period", with "the CPU timestamp at which the samples were
    recorded" (wall-clock microseconds), only those newer than the timestamp asked ("0 to read
    utilization based on all the samples maintained by the driver's internal sample buffer"), and
    NOT_FOUND when there is none. Every read gets the window that ends at its own time, whoever read
    before it (as GPM's), so two Prometheus servers a second apart see the same busy process busy:

    - each card keeps what the driver gave, by its timestamps, over the last ``window``; a read asks
      only for what is newer than the newest kept (0 at the first: the driver's whole buffer), so
      nothing is asked twice and nothing another read took is lost;
    - each sample stands for the time before it that it measured: one driver period where the
      driver gives a sample a period (its period learnt from two samples of one process in one
      answer: the shortest gap, held within NVML's 1/6 s to 1 s), else (one sample a process a call,
      as drivers answer in the field: go-nvml #51, nvtop #110) the time since the timestamp asked;
    - a process's value is the time average over the window: its samples' percent over the time
      they stand for, and 0 for the time the driver gave no sample of it (the driver samples only
      processes with activity; nvtop and nvidia-smi pmon show such a process at 0). So a process
      busy for half the window reads half its load;
    - a listed process with no sample in the window is idle, 0.0, once what is known spans a driver
      period; before that (a card's first read that got nothing from the driver is known for one
      period back) every listed process is unknown (``None``);
    - a value over 100 is no measurement (nvtop drops such samples, its bug #110): its time is left
      out of that process's average, and a process with nothing else in the window reads ``None``;
    - a process whose only work in the window was on a media engine (``encUtil``/``decUtil`` above 0,
      SM and memory 0: a transcoder on NVENC) reads ``None``: not idle, and no share to give (as a
      pmon row busy on enc or dec alone);
    - the timestamps are the wall clock's: where it stepped (its distance from the monotonic clock
      moved by more than CLOCK_STEP_S), the card's window starts again, and that read's values are
      unknown, with a problem line; a sample stamped in the future (from before a step back) makes
      its process unknown rather than idle.

    A card that does not support it (NOT_SUPPORTED, FUNCTION_NOT_FOUND) is not asked again until
    NVML is initialised again; another error makes this read's values unknown, with a problem line."""

    def __init__(self, nvml: Nvml, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.nv = nvml
        self.window_us = int(window_s * 1e6)
        self.clock = clock
        self.wall_clock = wall_clock
        self._cards: dict[object, _CardWindow] = {}
        self._unsupported: set[object] = set()
        self._generation = -1
        self._layout: struct.Struct | None = None

    @property
    def spans_held(self) -> int:
        return sum(len(spans) for card in self._cards.values() for spans in card.spans.values())

    def reset(self) -> None:
        """Forget every card's window (NVML is initialised again: the driver may be a new one)."""
        self._cards, self._unsupported = {}, set()

    def read(self, card: object, handle: Any, pids: Iterable[int], where: str,
             problems: list[str]) -> tuple[ProcessActivity, ...] | None:
        if self._generation != self.nv.generation:
            self.reset()
            self._generation = self.nv.generation
        if card in self._unsupported:
            return None
        listed = dict.fromkeys(pids)
        if not listed:
            return ()  # nothing to measure: not asked, and the next ask starts after the newest kept
        mono, wall = self.clock(), self.wall_clock()
        now_us = int(wall * 1e6)
        self._forget_unread(mono)
        state = self._cards.get(card)
        if state is not None:
            moved = (wall - mono) - state.offset_s
            if abs(moved) > CLOCK_STEP_S + _SLEW * (mono - state.read_at) or state.newest_us > now_us + _STEP_US:
                # Stepped: the samples kept and those to come are on two clocks. The window starts
                # again from now: samples stamped before it (the driver's buffer) count for nothing.
                problems.append(f"{where}: the wall clock stepped {moved:+.1f}s; process activity unknown this read, "
                                "its window starts again")
                state = self._cards[card] = _CardWindow(wall - mono, mono, floor_us=now_us)
        since = 0 if state is None else state.newest_us
        try:
            samples = self._samples(handle, since)
        except NvmlCallError as e:
            if e.code in LASTING_UNSUPPORTED:
                self._unsupported.add(card)
            elif not e.unsupported:
                problems.append(f"{where}: process utilisation not read ({e}); process activity unknown")
            return None
        if state is None:
            state = self._cards[card] = _CardWindow(wall - mono, mono)
        state.offset_s, state.read_at = wall - mono, mono
        future = self._keep(state, samples, since, now_us)
        return self._averages(state, listed, future, now_us)

    def _forget_unread(self, mono: float) -> None:
        """Drop the windows of cards not read for two windows (gone, or in MIG mode now)."""
        stale = [c for c, s in self._cards.items() if mono - s.read_at > 2 * self.window_us / 1e6]
        for card in stale:
            del self._cards[card]

    def _keep(self, state: _CardWindow, samples: list[tuple[int, int, int, int, int, int]], since: int,
              now_us: int) -> set[int]:
        """Add the driver's new samples to ``state``'s spans; the pids of samples stamped in the
        future (a wall clock stepped back since the driver took them), whose values are unknown."""
        future: set[int] = set()
        by_pid: dict[int, list[tuple[int, int, int, bool]]] = {}
        horizon = now_us + _STEP_US
        for pid, stamp, sm, mem, enc, dec in samples:
            if stamp <= since:
                continue  # older than asked: not this answer's
            if stamp > horizon:
                future.add(pid)
                continue
            by_pid.setdefault(pid, []).append((stamp, sm, mem, enc > 0 or dec > 0))
        for found in by_pid.values():
            found.sort()
            gaps = [b[0] - a[0] for a, b in itertools.pairwise(found) if b[0] > a[0]]
            if gaps:
                period = min(LONGEST_PERIOD_US, max(SHORTEST_PERIOD_US, min(gaps)))
                state.period_us = period if state.period_us is None else min(state.period_us, period)
        # What one sample stands for at most: a period where the driver gives one a period, else
        # all the time since the last ask (the window, at a card's first).
        longest = state.period_us or self.window_us
        bucket = self.window_us // PROCESS_SPANS
        starts = []
        for pid, found in by_pid.items():
            spans = state.spans.setdefault(pid, [])
            after = since or None
            for stamp, sm, mem, media in found:
                start = stamp - longest if after is None else max(stamp - longest, after)
                if spans and start < spans[-1].end_us:
                    start = spans[-1].end_us  # never count a time twice
                after = stamp
                if start >= stamp:
                    continue
                starts.append(start)
                span = _Span(start, stamp, sm, mem, media)
                if spans and stamp - spans[-1].start_us <= bucket:
                    spans[-1].absorb(span)
                else:
                    spans.append(span)
            state.newest_us = max(state.newest_us, found[-1][0])
        if state.known_from_us is None:
            # A first answer: the driver's buffer holds every sample since its oldest, and at
            # least its last period (with nothing in it, every process was idle then).
            period = state.period_us or LONGEST_PERIOD_US
            state.known_from_us = max(min([*starts, _sampled_to(state, now_us) - period]), state.floor_us)
        return future

    def _averages(self, state: _CardWindow, listed: dict[int, None], future: set[int],
                  now_us: int) -> tuple[ProcessActivity, ...]:
        """Each listed pid's time average over the window ending now: as far as the driver has
        surely sampled (its newest sample, or a period ago), back a window or to ``known_from``."""
        period = state.period_us or LONGEST_PERIOD_US
        end = _sampled_to(state, now_us)
        begin = max(end - self.window_us, state.known_from_us or end)
        for pid in list(state.spans):
            spans = state.spans[pid]
            while spans and spans[0].end_us <= begin:
                spans.pop(0)
            if not spans:
                del state.spans[pid]
        covered = end - begin
        if covered < period:
            return tuple(ProcessActivity(pid, None, None) for pid in listed)
        rows = []
        for pid in listed:
            if pid in future:
                rows.append(ProcessActivity(pid, None, None))
                continue
            sm_area = sm_unknown = mem_area = mem_unknown = media = 0.0
            for span in state.spans.get(pid, ()):
                if span.start_us >= end:
                    break
                length = span.end_us - span.start_us
                inside = (min(span.end_us, end) - max(span.start_us, begin)) / length
                sm_area += span.sm_area * inside
                sm_unknown += span.sm_unknown_us * inside
                mem_area += span.mem_area * inside
                mem_unknown += span.mem_unknown_us * inside
                media += span.media_us * inside
            if media > 0 and not sm_area and not mem_area:
                rows.append(ProcessActivity(pid, None, None))  # a transcoder: not idle, no share to give
                continue
            rows.append(ProcessActivity(pid, _ratio(sm_area, covered - sm_unknown, period),
                                        _ratio(mem_area, covered - mem_unknown, period)))
        return tuple(rows)

    def _samples(self, handle: Any, since: int) -> list[tuple[int, int, int, int, int, int]]:
        """(pid, timestamp us, sm %, mem %, enc %, dec %) of the samples newer than ``since``, as pynvml's wrapper
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
                    raise ActivityUnreadable(f"unexpected layout of pynvml's {entry.__name__}: process activity "
                                             "not read")
                layout += f"{f.offset - at}x{codes[f.size]}"
                at = f.offset + f.size
            self._layout = struct.Struct(f"{layout}{ctypes.sizeof(entry) - at}x")
        return self._layout


def _sampled_to(state: _CardWindow, now_us: int) -> int:
    """How far the driver has surely sampled: its newest sample, or a period ago (the sample of the
    period under way is not taken yet; counting that time as idle would read every process low)."""
    return min(now_us, max(state.newest_us, now_us - (state.period_us or LONGEST_PERIOD_US)))


def _ratio(area: float, known_us: float, period_us: int) -> float | None:
    """percent x us over ``known_us``, as a ratio; ``None`` where less than a period is known."""
    if known_us < period_us:
        return None
    return min(1.0, area / known_us / 100.0)


__all__ = ["DEFAULT_WINDOW_S", "GPM_METRICS", "MIN_INTERVAL_S", "ActivityUnreadable", "Bounds", "GpmBook",
           "ProcessActivityReader", "window_bounds"]
