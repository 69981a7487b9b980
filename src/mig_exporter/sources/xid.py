"""XID errors as the driver reports them through NVML's events, and ``XidBook``, which merges
them with the kernel log's ``NVRM: Xid (PCI:0000:19:00): 43, pid=..., ...`` lines (the same
errors, read by sources/kmsg.py) so that each counts once (docs/xids.md). An XID is an event,
not a value to read: ``nvidia-smi`` shows none.

One daemon thread (``XidListener``) initialises NVML through the gateway, creates an event set
(``nvmlEventSetCreate``), registers ``nvmlEventTypeXidCriticalError`` on every card that supports
it (``nvmlDeviceGetSupportedEventTypes``, ``nvmlDeviceRegisterEvents``) and waits on the set
(``nvmlEventSetWait_v2``) a second at a time, so that it stops promptly. Each event is counted by
card, GPU instance, compute instance and XID code, with the time it was last seen. A scrape asks
``seen(snapshot)``: the first scrape after an event places it, on the placement index of the MIG
instance its GPU and compute instance ids name (in that scrape's snapshot, else the last one that
had the instance), else on the card's index; once placed it stays, so an instance destroyed since
does not move its count.

What it survives: a card that falls off the bus (``GPU_IS_LOST`` on registering or waiting: the
set is made again without it, the others go on, and it is registered again each minute); a
driver that refuses the events (``NO_PERMISSION`` when not root, ``NOT_SUPPORTED``): the reason
is kept for ``status()`` and ``doctor``, and registering is tried again each minute, never in a
loop; an NVML that does not load (no driver): the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import pynvml

from mig_exporter.core.errors import ReadError
from mig_exporter.core.ratelog import RateLimitedLog
from mig_exporter.model.health import OTHER_XID, XID_DOCUMENTED, XID_SERIES_CAP, XidSeen
from mig_exporter.model.readings import OwnerReading, PodReading
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.model.xid_line import pci_key
from mig_exporter.sources.kmsg import KmsgTally
from mig_exporter.sources.nvml_gateway import Nvml, NvmlCallError, NvmlUnavailable, error_name

log = logging.getLogger("mig_exporter")

WAIT_MS = 1000  # one wait on the event set: how long stop() may take
RETRY_S = 60.0  # how often cards not watched are registered again
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event on no MIG instance
XID_EVENTS = pynvml.nvmlEventTypeXidCriticalError

NO_PERMISSION_REASON = ("no permission to register for XID events: run as root (application XIDs 13, 31, 43 "
                        "on a MIG instance are not reported without it)")
_REASONS = {
    pynvml.NVML_ERROR_NO_PERMISSION: NO_PERMISSION_REASON,
    pynvml.NVML_ERROR_NOT_SUPPORTED: "the driver does not report XID events on this card",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "this driver has no NVML events",
    pynvml.NVML_ERROR_GPU_IS_LOST: "the card fell off the bus (GPU_IS_LOST); registering again each minute",
}
# Errors after which the library itself must be initialised again: the set is made anew.
_LIBRARY_GONE = frozenset({
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
})
# Errors on asking a card's event types that registering would meet too: the card refused.
_CARD_GONE = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED}) | _LIBRARY_GONE


class XidWatch(NamedTuple):
    """Whether XIDs are watched: ``cards`` registered, and ``reason`` why not (or why some
    cards are not), ``None`` when every card is."""

    watching: bool
    cards: int
    reason: str | None


def _why(code: int) -> str:
    return _REASONS.get(code) or f"registering for XID events failed: {error_name(code)}"


def _address(handle: Any) -> int | None:
    """A device handle as a number: the event names its card by the handle it was registered with."""
    return ctypes.cast(handle, ctypes.c_void_p).value


class _Registration:
    """One event set and the cards registered on it, or refused (card -> NVML code)."""

    def __init__(self, nv: Nvml, event_set: Any, count: int) -> None:
        self.nv = nv
        self.event_set = event_set
        self.count = count
        self.cards: dict[int, Any] = {}
        self.refused: dict[int, int] = {}
        self._by_address: dict[int | None, int] = {}

    @classmethod
    def open(cls, nv: Nvml) -> _Registration:
        """Initialise, make the set and register every card. ``ReadError`` (its reason) where
        the library or the set cannot be had."""
        nv.ensure()
        count = nv.call(pynvml.nvmlDeviceGetCount)
        try:
            event_set = nv.call(pynvml.nvmlEventSetCreate)
        except NvmlCallError as e:
            raise ReadError(f"cannot create an NVML event set: {_REASONS.get(e.code, str(e))}") from None
        registration = cls(nv, event_set, count)
        for card in range(count):
            registration.register(card)
        return registration

    def register(self, card: int) -> None:
        nv = self.nv
        try:
            handle = nv.call(pynvml.nvmlDeviceGetHandleByIndex, card)
            try:
                supported = nv.call(pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            except NvmlCallError as e:
                if e.code in _CARD_GONE:
                    raise
                supported = XID_EVENTS  # registering says for sure
            if not supported & XID_EVENTS:
                raise NvmlCallError("nvmlDeviceGetSupportedEventTypes", pynvml.NVML_ERROR_NOT_SUPPORTED, "no XIDs")
            nv.call(pynvml.nvmlDeviceRegisterEvents, handle, XID_EVENTS, self.event_set)
        except NvmlCallError as e:
            self.refused[card] = e.code
            return
        self.refused.pop(card, None)
        self.cards[card] = handle
        self._by_address[_address(handle)] = card

    def card_of(self, device: Any) -> int | None:
        """The card an event names, by its handle; else by asking its index."""
        card = self._by_address.get(_address(device))
        if card is None:
            with contextlib.suppress(NvmlCallError):
                card = int(self.nv.call(pynvml.nvmlDeviceGetIndex, device))
        return card

    def free(self) -> None:
        with contextlib.suppress(NvmlCallError):
            self.nv.call(pynvml.nvmlEventSetFree, self.event_set)

    def watch(self) -> XidWatch:
        groups: dict[str, list[int]] = {}
        for card, code in sorted(self.refused.items()):
            groups.setdefault(_why(code), []).append(card)
        parts = [why if len(cards) == self.count else
                 f"{why} (card{'s' if len(cards) > 1 else ''} {', '.join(map(str, cards))})"
                 for why, cards in groups.items()]
        reason = "; ".join(parts) or (None if self.count else "no GPU found")
        return XidWatch(bool(self.cards), len(self.cards), reason)


def xid_watch_status(nvml: Nvml | None = None) -> XidWatch:
    """Whether XIDs can be watched here: one try, without a thread (create a set, register every
    card, free the set), for ``doctor``. A library opened here is shut down again."""
    nv = nvml or Nvml()
    registration = None
    try:
        registration = _Registration.open(nv)
        return registration.watch()
    except ReadError as e:
        return XidWatch(False, 0, str(e))
    finally:
        if registration is not None:
            registration.free()
        if nvml is None:
            nv.shutdown()


def instance_places(snapshot: Snapshot) -> dict[tuple[int, int, int], int]:
    """(card, GPU instance, compute instance) -> the MIG device's placement index; an XID on
    a GPU instance alone (compute instance ``NO_INSTANCE``) is on its one compute instance."""
    places: dict[tuple[int, int, int], int] = {}
    on_instance: dict[tuple[int, int], list[int]] = {}
    for d in snapshot.devices:
        if d.gpu_instance_id is not None and d.compute_instance_id is not None:
            places[(d.card, d.gpu_instance_id, d.compute_instance_id)] = d.index
            on_instance.setdefault((d.card, d.gpu_instance_id), []).append(d.index)
    for (card, gi), indexes in on_instance.items():
        if len(indexes) == 1:
            places[(card, gi, NO_INSTANCE)] = indexes[0]
    return places


class XidListener:
    """Counts XID events in a daemon thread (``start``/``stop``); ``seen(snapshot)`` places them."""

    def __init__(self, nvml: Nvml | None = None, *, wait_ms: int = WAIT_MS, retry_s: float = RETRY_S) -> None:
        self._own_nvml = nvml is None
        self.nvml = nvml or Nvml()
        self.wait_ms = wait_ms
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Events not yet placed by a scrape: (card, gi, ci, xid) -> [count, last seen].
        self._pending: dict[tuple[int, int, int, int], list[float]] = {}
        # Placed: (card, placement index, xid) -> [count, last seen].
        self._counts: dict[tuple[int, int, int], list[float]] = {}
        # (card, gi, ci) -> placement index, as the newest snapshot that had the instance placed it.
        self._placements: dict[tuple[int, int, int], int] = {}
        self._watch = XidWatch(False, 0, "not started")
        self._log = RateLimitedLog(log, window_s=60.0)
        self._last_lost = float("-inf")

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            thread = threading.Thread(target=self._run, name="mig-exporter-xid", daemon=True)
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had (a pids limit): no XIDs, and why
                self._watch = XidWatch(False, 0, f"cannot start the XID listener's thread: {e}")
                log.warning("XID events: %s", self._watch.reason)
                return
            self._thread = thread
            if self._watch.reason in ("not started", "stopped"):
                self._watch = XidWatch(False, 0, "starting")

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread; whether it ended within ``timeout`` seconds (a wait lasts ``wait_ms``)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        with self._lock:
            self._watch = XidWatch(False, 0, "stopped")
        return True

    def status(self) -> XidWatch:
        with self._lock:
            return self._watch

    def seen(self, snapshot: Snapshot) -> list[XidSeen]:
        """Every XID seen so far, the ones since the last call placed through ``snapshot``."""
        places = instance_places(snapshot)
        with self._lock:
            self._placements.update(places)
            for (card, gi, ci, xid), (count, last) in self._pending.items():
                index = card if gi == NO_INSTANCE else self._placements.get((card, gi, ci), card)
                entry = self._counts.setdefault((card, index, xid), [0, 0.0])
                entry[0] += count
                entry[1] = max(entry[1], last)
            self._pending.clear()
            return [XidSeen(card, index, xid, int(count), last)
                    for (card, index, xid), (count, last) in sorted(self._counts.items())]

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        registration: _Registration | None = None
        next_try = 0.0
        try:
            while not self._stop.is_set():
                try:
                    now = time.monotonic()
                    if now >= next_try and (registration is None or registration.refused
                                            or not registration.cards):
                        registration = self._connect(registration)
                        next_try = now + self.retry_s
                    if registration is None or not registration.cards:
                        self._stop.wait(max(0.0, next_try - time.monotonic()))
                        continue
                    registration = self._wait(registration)
                except Exception as e:  # a bug must not end the watch for good: say so, try later
                    log.error("XID listener failed; trying again in %gs", self.retry_s, exc_info=e)
                    self._set_watch(XidWatch(False, 0, f"the XID listener failed: {type(e).__name__}: {e}"))
                    if registration is not None:
                        registration.free()
                    registration, next_try = None, time.monotonic() + self.retry_s
        finally:
            if registration is not None:
                registration.free()
            if self._own_nvml:
                self.nvml.shutdown()

    def _connect(self, registration: _Registration | None) -> _Registration | None:
        """Register the cards not watched on the set there is; else make the set afresh."""
        if registration is not None and registration.cards:
            for card in list(registration.refused):
                registration.register(card)
            self._set_watch(registration.watch())
            return registration
        if registration is not None:
            registration.free()
        try:
            registration = _Registration.open(self.nvml)
        except NvmlUnavailable as e:  # no driver: the source's own check says so as a warning
            self._set_watch(XidWatch(False, 0, str(e)), logging.INFO)
            return None
        except ReadError as e:
            self._set_watch(XidWatch(False, 0, str(e)))
            return None
        self._set_watch(registration.watch())
        return registration

    def _wait(self, registration: _Registration) -> _Registration | None:
        """One wait on the set, and its event counted; the set to wait on next. Called through
        the library's C function (pynvml's nvmlEventSetWait_v2, without its exception): most
        waits end in TIMEOUT, once a second."""
        data = pynvml.c_nvmlEventData_t()
        try:
            wait = self.nvml.c_function("nvmlEventSetWait_v2")
            code = wait(registration.event_set, ctypes.byref(data), ctypes.c_uint(self.wait_ms))
            if code == pynvml.NVML_ERROR_TIMEOUT:
                return registration
            self.nvml.check("nvmlEventSetWait_v2", code)
        except NvmlCallError as e:
            if e.code == pynvml.NVML_ERROR_GPU_IS_LOST:
                return self._without_lost(registration)
            if e.code in _LIBRARY_GONE or e.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                registration.free()
                self._set_watch(XidWatch(False, 0, f"waiting for XID events failed: {e}"))
                return None
            self._log.log(("wait", e.code), logging.WARNING, "waiting for XID events failed: %s", e)
            self._stop.wait(self.wait_ms / 1000)  # never a loop of failing waits
            return registration
        self._record(registration, data)
        return registration

    def _without_lost(self, registration: _Registration) -> _Registration | None:
        """A card in the set fell off the bus: the set made again, the lost card left out (its
        registering fails, and is tried again each minute)."""
        since = time.monotonic() - self._last_lost
        if since < self.wait_ms / 1000:  # lost again at once: wait before making it again
            self._stop.wait(self.wait_ms / 1000 - since)
        self._last_lost = time.monotonic()
        registration.free()
        try:
            registration = _Registration.open(self.nvml)
        except ReadError as e:
            self._set_watch(XidWatch(False, 0, str(e)))
            return None
        self._set_watch(registration.watch())
        return registration

    def _record(self, registration: _Registration, data: Any) -> None:
        if not int(data.eventType) & XID_EVENTS:
            return
        card = registration.card_of(data.device)
        xid, gi, ci = int(data.eventData), int(data.gpuInstanceId), int(data.computeInstanceId)
        if card is None:
            self._log.log("unknown device", logging.WARNING, "XID %d on a device that is no registered card", xid)
            return
        with self._lock:
            entry = self._pending.setdefault((card, gi, ci, xid), [0, 0.0])
            entry[0] += 1
            entry[1] = time.time()
        where = "" if gi == NO_INSTANCE else f" (GPU instance {gi}, compute instance {ci})"
        self._log.log(("xid", card, xid), logging.WARNING, "XID %d on card %d%s", xid, card, where)

    def _set_watch(self, watch: XidWatch, level: int = logging.WARNING) -> None:
        """Keep what ``status()`` says; log it when it changes, not at each retry."""
        with self._lock:
            before, self._watch = self._watch, watch
        if watch.reason != before.reason and watch.reason is not None:
            log.log(level, "XID events%s: %s", f" on {watch.cards} card(s)" if watch.watching else " not watched",
                        watch.reason)
        elif watch.reason is None and (before.reason is not None or before.cards != watch.cards):
            log.info("watching XID events on %d card(s)", watch.cards)


# Scrapes a line naming a MIG instance no snapshot has had waits for one to have it.
INSTANCE_WAITS = 3


class _Who(NamedTuple):
    """The process a kernel line named, and who it was (found while it lived)."""

    pid: int
    process_name: str | None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    slurm_job: str | None = None
    systemd_unit: str | None = None

    @property
    def found(self) -> bool:
        return any((self.pod, self.slurm_job, self.systemd_unit))


class XidBook:
    """The XIDs of both sources, placed and merged (docs/xids.md): the kernel's lines (a
    ``KmsgReader``'s tallies, since boot) and NVML's events (``XidListener.seen``, since the
    exporter started), each counted once.

    The merge, per card, placement index and XID: ``lines logged before the exporter started
    + max(lines logged since, NVML events since)``. An event and its line count once; an
    event without a line (the log not readable, a record overwritten) counts; a line without
    an event counts. It never goes down, as a counter must not, whichever source is read first.

    Lines are placed as NVML's events are: each scrape places the lines new since the last one
    by their PCI address (the card of that address in a snapshot, remembered) and GPU and
    compute instance ids, on the instance the newest snapshot that had it placed; once placed,
    a count stays where it is (an instance destroyed or renumbered since moves nothing, and a
    reconfiguration's new lines go to the new instance). A line whose card no snapshot has named
    yet waits; one whose instance no snapshot has had waits ``INSTANCE_WAITS`` scrapes (a read
    that missed the instance), then counts on the card (an instance destroyed before the
    exporter saw it). The last line's pid is attributed to its pod,
    container, Slurm job and systemd unit from the scrape's readings of the GPU processes
    while the process lives, and kept once found (a fatal XID ends the process soon after)."""

    def __init__(self, series_cap: int = XID_SERIES_CAP) -> None:
        self._lock = threading.Lock()
        self.series_cap = series_cap
        # The series let in, in the order they first came: which ones are is fixed once seen, so
        # no series ever moves into "other" (and its counter down) when another comes.
        self._series: set[tuple[int, int, int]] = set()
        self._folded: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # key -> its "other" series
        self._folded_why: dict[str, int] = {"out_of_range": 0, "over_cap": 0}
        self._cards: dict[tuple[int, int, int], int] = {}  # PCI address -> card index
        self._places: dict[tuple[int, int, int], int] = {}  # (card, gi, ci) -> placement index
        self._assigned: dict[tuple[Any, ...], tuple[int, int]] = {}  # tally key -> (before, since) placed
        self._waits: dict[tuple[Any, ...], int] = {}  # tally key -> scrapes waited for its instance
        # (card, index, xid) -> [before, since, last, pid, name]: the lines placed so far.
        self._totals: dict[tuple[int, int, int], list[Any]] = {}
        self._who: dict[tuple[int, int, int], _Who] = {}  # (card, index, xid) -> the last line's process

    def seen(self, snapshot: Snapshot, lines: Iterable[KmsgTally] = (), events: Iterable[XidSeen] = (),
             pods: PodReading | None = None, owners: OwnerReading | None = None) -> list[XidSeen]:
        with self._lock:
            for card in snapshot.cards:
                address = pci_key(card.pci_bus_id)
                if address is not None:
                    self._cards[address] = card.index
            self._places.update(instance_places(snapshot))
            for line in lines:
                tally = line[:4]
                before, since = self._assigned.get(tally, (0, 0))
                if (line.before, line.since) == (before, since):
                    continue  # nothing new on this tally since the last scrape
                place = self._place(line)
                if place is None:
                    continue
                entry = self._totals.setdefault((*place, line.xid), [0, 0, float("-inf"), None, None])
                entry[0] += line.before - before
                entry[1] += line.since - since
                self._assigned[tally] = (line.before, line.since)
                if line.last_seconds >= entry[2]:
                    entry[2:] = [line.last_seconds, line.pid, line.process_name]
            merged = self._totals
            events_by_key = {(e.card, e.device_index, e.xid): e for e in events}
            seen = []
            for key in sorted(merged.keys() | events_by_key.keys()):
                before, since, last, pid, name = merged.get(key, (0, 0, float("-inf"), None, None))
                event = events_by_key.get(key)
                count = before + max(since, event.seen if event is not None else 0)
                last = max(last, event.last_seconds if event is not None else float("-inf"))
                who = self._attribute(key, pid, name, snapshot, pods, owners) if pid is not None else None
                seen.append(XidSeen(*key, count, last, *(who or (None,))))
            return self._fold(seen)

    def folded(self) -> dict[str, int]:
        """Distinct (card, index, xid) counted under xid="other", by why: ``out_of_range`` (a
        code outside NVIDIA's catalogue), ``over_cap`` (past ``series_cap`` series)."""
        with self._lock:
            return dict(self._folded_why)

    def _series_of(self, key: tuple[int, int, int]) -> tuple[int, int, int]:
        """The series ``key`` counts in: its own, or an "other" one. Out of range: the code
        alone goes, on its card and index. Past the cap (an "other" series counting as one):
        on its card's own index, of which there is one per card."""
        known = self._folded.get(key)
        if known is not None:
            return known
        if key in self._series:
            return key
        card, index, xid = key
        series = key
        if xid not in XID_DOCUMENTED and xid != OTHER_XID:
            series = (card, index, OTHER_XID)
            self._folded[key] = series
            self._folded_why["out_of_range"] += 1
        if series not in self._series and len(self._series) >= self.series_cap:
            if series == key:
                self._folded_why["over_cap"] += 1
            series = self._folded[key] = (card, card, OTHER_XID)
            if series in self._series:
                return series
        self._series.add(series)
        return series

    def _fold(self, seen: list[XidSeen]) -> list[XidSeen]:
        """``seen`` with each entry in its series (``_series_of``): folded entries add up,
        the latest one's process naming the series."""
        by_series: dict[tuple[int, int, int], XidSeen] = {}
        for x in seen:
            series = self._series_of((x.card, x.device_index, x.xid))
            had = by_series.get(series)
            if had is None:
                by_series[series] = x._replace(card=series[0], device_index=series[1], xid=series[2])
                continue
            latest = x if x.last_seconds > had.last_seconds else had
            by_series[series] = latest._replace(card=series[0], device_index=series[1], xid=series[2],
                                                seen=had.seen + x.seen)
        return [by_series[k] for k in sorted(by_series)]

    def _place(self, line: KmsgTally) -> tuple[int, int] | None:
        """Where the line's new counts go now: (card, placement index); ``None``: wait."""
        card = self._cards.get(line.pci)
        if card is None:  # no snapshot has named the card yet (or the card is gone): wait
            return None
        gi = line.gpu_instance_id
        if gi is None:
            return card, card
        ci = line.compute_instance_id if line.compute_instance_id is not None else NO_INSTANCE
        index = self._places.get((card, gi, ci))
        if index is not None:
            return card, index
        tally = line[:4]
        waited = self._waits.get(tally, 0)
        if waited < INSTANCE_WAITS:
            self._waits[tally] = waited + 1
            return None
        return card, card

    def _attribute(self, key: tuple[int, int, int], pid: int, name: str | None, snapshot: Snapshot,
                   pods: PodReading | None, owners: OwnerReading | None) -> _Who:
        known = self._who.get(key)
        if known is not None and known.pid == pid and known.found:
            return known
        if name is None:  # the driver's line without a name: the GPU list's, if it lists the pid
            name = next((p.name for p in snapshot.processes if p.pid == pid), None)
        pod = pods.processes.get(pid) if pods is not None else None
        owner = owners.processes.get(pid) if owners is not None else None
        who = _Who(pid, name, pod.namespace if pod else None, pod.pod if pod else None,
                   pod.container if pod else None, owner.slurm_job if owner else None,
                   owner.systemd_unit if owner else None)
        self._who[key] = who
        return who
