"""One scrape: read the source, keep the exporter's own bookkeeping, and hand
the collector what to map.

A failed read is data, not an exception: the scrape still answers, with
``mig_exporter_read_success 0``, and the reason goes to the log as one line.
With engines watched, /proc is read in a worker thread alongside the GPUs (it
needs nothing from them, and took as long as them on a busy node), and waited
for by the read's deadline; only its first read, of every process, is made
before the GPUs, since it holds the interpreter while the GPU read starts. So a
process started while the driver is asked may be in one reading and not the
other: a new engine may show 0 bytes for one read (as if on the CPU), and what
the driver lists for a process /proc did not show yet goes to no engine until
the next read. With pods watched, the kubelet's log
directory names and its pod-resources answer are read alongside the GPUs too,
and the cgroups of the processes the driver listed just after them, by the
read's deadline. With owners watched, the same cgroups (read once for both) and
the processes' uids give their Slurm jobs, systemd units and users, read only
for the processes in /proc: those its listing shows (the engines', when taken by
then), and a thread's id (no leader, not listed) found by itself.
With a Slurm job-map directory, it is read last, by the same deadline.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import Metric

from mig_exporter import __version__
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.core.workers import WORKERS
from mig_exporter.engines.attribution import EngineReader, EngineTrees, engine_trees, engines_on_gpus
from mig_exporter.host.cgroup import CgroupIdentity
from mig_exporter.host.jobmap import SlurmJobMap
from mig_exporter.host.owners import OwnerReader
from mig_exporter.host.procfs import ProcTable
from mig_exporter.kubernetes.pods import KubeletReading, PodReader
from mig_exporter.metrics.families import (
    allocation_families,
    device_state_families,
    engine_families,
    owner_families,
    pod_families,
    read_families,
    snapshot_families,
)
from mig_exporter.metrics.process_series import ALL_PROCESSES, ProcessSeries
from mig_exporter.metrics.xid_families import xid_families
from mig_exporter.model.capacity import HostView, host_view
from mig_exporter.model.readings import EngineReading, OwnerReading, PodReading, SlurmJobMapReading
from mig_exporter.model.snapshot import Snapshot
from mig_exporter.sources.base import Source, read_telling_start
from mig_exporter.sources.xid import XidBook

if TYPE_CHECKING:
    from mig_exporter.sources.kmsg import KmsgReader
    from mig_exporter.sources.xid import XidListener

log = logging.getLogger("mig_exporter")

# What the GPU read still gets when the scrape's budget is spent before it starts: enough to
# fail as a timeout of its own, not so much that the answer comes late.
_MIN_READ_S = 0.05
# How long the /proc read waits for the GPU read's commands to be started (a start that hangs on
# a dead mount must not keep the engines from being read).
_WAIT_FOR_GPU_S = 0.1


class _Procs(NamedTuple):
    """A /proc read: the table, or why there is none; and what it says of the engines
    (made beside the GPU read; ``None``, and ``failure`` why, where making it failed)."""

    table: ProcTable | None
    error: str | None
    trees: EngineTrees | None
    failure: str | None = None


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    snapshot: Snapshot | None
    duration_s: float
    error: str | None = None
    engines: EngineReading | None = None
    pods: PodReading | None = None
    job_map: SlurmJobMapReading | None = None
    owners: OwnerReading | None = None

    @property
    def success(self) -> bool:
        return self.snapshot is not None

    @property
    def host(self) -> HostView:
        """What decides each device's state beyond the GPU read (model/capacity.py)."""
        return host_view(self.engines, self.pods, self.job_map)

    @property
    def problems(self) -> tuple[str, ...]:
        return ((self.snapshot.problems if self.snapshot else ()) + (self.engines.problems if self.engines else ())
                + (self.pods.problems if self.pods else ()) + (self.owners.problems if self.owners else ())
                + (self.job_map.problems if self.job_map else ()))


class Scraper:
    """Reads a source on demand and counts what went wrong.

    Thread-safe: concurrent scrapes each read; only the counters, and the newest /proc
    reading (what a failed read made for a scrape still in flight shows), are shared.
    """

    def __init__(self, source: Source, engines: EngineReader | None = None, name: str | None = None,
                 pods: PodReader | None = None, owners: OwnerReader | None = None,
                 job_map: SlurmJobMap | None = None, process_series: ProcessSeries = ALL_PROCESSES) -> None:
        self.source = source
        self.process_series = process_series  # --collector.processes
        self.name = name or source.name  # what the log calls this read path
        self.engines = engines
        self.pods = pods
        self.job_map = job_map
        self.owners = owners
        # The XIDs (docs/xids.md): serve's NVML listener (sources/xid.py), and the kernel's log
        # (sources/kmsg.py), read at each scrape; the book merges them and joins each successful read.
        self.xids: XidListener | None = None
        self.kmsg: KmsgReader | None = None
        self._xid_book = XidBook()
        self._lock = threading.Lock()
        self._errors_total = 0
        self._known_problems: dict[str, frozenset[str]] = {}
        self._logged_bugs: set[str] = set()
        self._newest_procs: tuple[float, _Procs] | None = None
        # The /proc read still running, if any: a read hung for good (a process in D state) is
        # waited for by the scrapes after it, not started again in a new thread at each one.
        self._procs_running: Future[_Procs] | None = None

    @property
    def errors_total(self) -> int:
        with self._lock:
            return self._errors_total

    def read(self, deadline: Deadline | None = None, answered: Callable[[], bool] | None = None) -> ReadOutcome:
        """One read, due at ``deadline`` (``None``: the source's own timeout, and no limit on the rest).

        ``answered`` is asked before a failure is counted and logged: whether a caller takes
        this read's answer (``None``: always). A shared read asks its flight (``core/flight.py``):
        False when every caller has answered late already, each answer counting itself."""
        started = time.monotonic()
        gpu_started = threading.Event()
        reading = self._start_procs(gpu_started)
        kubelet = self._start_kubelet(deadline)
        try:
            try:
                snapshot = read_telling_start(self.source, None if deadline is None
                                              else max(deadline, Deadline.after(_MIN_READ_S)), gpu_started.set)
            finally:
                gpu_started.set()  # a read that failed before its commands ran: the /proc read goes on now
        except ReadError as e:
            return self._failed(started, str(e), self._engines(self._procs(reading, deadline), None), answered)
        except Exception as e:  # a bug must not take the scrape down; say where
            self._log_bug(f"read from {self.name} failed unexpectedly", e)
            engines = self._engines(self._procs(reading, deadline), None)
            return self._failed(started, f"unexpected {type(e).__name__}: {e}", engines, answered)
        procs = self._procs(reading, deadline)
        engines = self._engines(procs, snapshot)
        table = procs.table if procs is not None else None
        # The engines' listing of /proc, for the owners' reads; none where it is another /proc's pids.
        same_proc = table is not None and (self.owners is None or table.namespace.root == self.owners.procs.root)
        listing = table.inodes if table is not None and same_proc else None
        identities = self._identities(snapshot, deadline, listing)
        owners = self._owners(snapshot, deadline, identities, listing)
        pods = self._pods(snapshot, deadline, identities, kubelet)
        job_map = self._job_map(snapshot, deadline)
        self._read_kmsg()
        duration = time.monotonic() - started
        self._log_problems(snapshot.problems)
        if engines is not None:
            self._log_problems(engines.problems, "engines")
        if pods is not None:
            self._log_problems(pods.problems, "pods")
            self._log_problems(pods.notes, "pod notes", logging.INFO)
        if owners is not None:
            self._log_problems(owners.problems, "owners")
        if job_map is not None:
            self._log_problems(job_map.problems, "slurm job map")
        return ReadOutcome(snapshot, duration, engines=engines, pods=pods, owners=owners, job_map=job_map)

    def read_allocations(self, snapshot: Snapshot, deadline: Deadline | None = None,
                         ) -> tuple[PodReading | None, SlurmJobMapReading | None]:
        """The kubelet's and the Slurm job map's readings for ``snapshot``, a GPU read made
        elsewhere (doctor's), read by ``deadline`` as a scrape reads them after its GPUs
        (``None`` for what is not watched); ``host_view`` makes their allocations a HostView."""
        return self._pods(snapshot, deadline), self._job_map(snapshot, deadline)

    def _read_kmsg(self) -> None:
        """The kernel log's records new since the last scrape (bounded: sources/kmsg.py)."""
        if self.kmsg is None:
            return
        try:
            self.kmsg.read()
        except Exception as e:  # a bug here costs the XIDs' newest lines, not the scrape
            self._log_bug("reading XIDs from the kernel log failed unexpectedly", e)

    def _xid_families(self, outcome: ReadOutcome) -> Iterator[Metric]:
        """The XIDs of both sources, merged (sources/xid.py's XidBook), and whether each is read."""
        readable: dict[str, bool] = {}
        if self.kmsg is not None:
            kmsg_readable, _why = self.kmsg.status()
            if kmsg_readable is not None:
                readable["kmsg"] = kmsg_readable
        status = getattr(self.xids, "status", None)  # a listener's; a test's stand-in may have none
        if status is not None:
            readable["nvml_events"] = status().watching
        seen = []
        if outcome.snapshot is not None:
            seen = self._xid_book.seen(outcome.snapshot, self.kmsg.tallies() if self.kmsg is not None else (),
                                       self.xids.seen(outcome.snapshot) if self.xids is not None else (),
                                       outcome.pods, outcome.owners)
        yield from xid_families(seen, readable, self.kmsg.dropped() if self.kmsg is not None else None,
                                self._xid_book.folded())

    def _job_map(self, snapshot: Snapshot, deadline: Deadline | None) -> SlurmJobMapReading | None:
        if self.job_map is None:
            return None
        try:
            return self.job_map.read(snapshot, deadline)
        except Exception as e:  # a bug here costs the Slurm allocations, not the scrape
            self._log_bug("reading the slurm job map failed unexpectedly", e)
            return SlurmJobMapReading((), False, (f"slurm job map: unexpected {type(e).__name__}: {e}",))

    def _identities(self, snapshot: Snapshot, deadline: Deadline | None,
                    listing: dict[int, int] | None) -> dict[int, CgroupIdentity] | None:
        """The GPU processes' cgroups, read once for owners and pods; ``None``
        leaves each reader to read its own (no owners read), or to find
        that /proc is not the host's."""
        if self.owners is None:
            return None
        try:
            return self.owners.identities(snapshot, deadline, listing)
        except Exception as e:  # a bug here costs the attribution, not the scrape
            self._log_bug("reading the GPU processes' cgroups failed unexpectedly", e)
            return None

    def _owners(self, snapshot: Snapshot, deadline: Deadline | None,
                identities: dict[int, CgroupIdentity] | None, listing: dict[int, int] | None) -> OwnerReading | None:
        if self.owners is None:
            return None
        if identities is None:
            return OwnerReading({})  # not the host's PID namespace: its pids are not the driver's
        try:
            return self.owners.read(snapshot, deadline, identities, listing)
        except Exception as e:  # a bug here costs the owner labels, not the scrape
            self._log_bug("attributing processes to Slurm jobs, units and users failed unexpectedly", e)
            return OwnerReading({}, (f"owner attribution failed: unexpected {type(e).__name__}: {e}",))

    def _pods(self, snapshot: Snapshot, deadline: Deadline | None,
              identities: dict[int, CgroupIdentity] | None = None,
              kubelet: Future[KubeletReading] | None = None) -> PodReading | None:
        if self.pods is None:
            return None
        try:
            answer = None
            if kubelet is not None:
                # Out of time, pods.read asks again: it says so without asking.
                with contextlib.suppress(FutureTimeout):
                    answer = kubelet.result(None if deadline is None else deadline.left_s())
            return self.pods.read(snapshot, deadline, identities, answer)
        except Exception as e:  # a bug here costs the pod labels, not the scrape
            self._log_bug("attributing processes to pods failed unexpectedly", e)
            return PodReading({}, None, None, (f"pod attribution failed: unexpected {type(e).__name__}: {e}",))

    def _start_procs(self, gpu_started: threading.Event) -> Future[_Procs] | None:
        """Start reading /proc in a worker (``None``: engines are not watched), once
        ``gpu_started`` is set (the GPU read's commands are running: the /proc read holds the
        interpreter, and their start would wait for it) or ``_WAIT_FOR_GPU_S`` has passed; the
        newest reading is kept as it comes, for a failed read made meanwhile (``failed_scrape``)."""
        if self.engines is None:
            return None
        with self._lock:
            running = self._procs_running
            if running is not None and not running.done():
                return running
            reading: Future[_Procs] = Future()
            self._procs_running = reading

        def read(wait: bool = False) -> None:
            if wait:
                gpu_started.wait(_WAIT_FOR_GPU_S)
            try:
                procs = self._read_procs()
            except BaseException:  # never left running for the scrapes after it to wait on
                reading.set_result(self._no_table("reading processes was interrupted"))
                raise
            with self._lock:
                self._newest_procs = (time.monotonic(), procs)
            reading.set_result(procs)

        if not self.engines.reads_little():  # a first read, of everything: before the GPUs, as it holds the
            read()  # interpreter (the GPU read's commands would start late, and a signal could miss them)
            return reading
        try:
            WORKERS.start(lambda: read(wait=True), "mig-exporter-procs")
        except RuntimeError:  # no thread to be had (a pids limit): read here, before the GPUs
            read()
        return reading

    def _start_kubelet(self, deadline: Deadline | None) -> Future[KubeletReading] | None:
        """Start asking the kubelet (its allocations, its log directory's names) in a worker,
        alongside the GPU read; ``None`` when pods are not watched, or nothing is to be asked."""
        pods = self.pods
        if pods is None or (pods.pod_resources is None and not pods.log_dir):
            return None
        answer: Future[KubeletReading] = Future()

        def read() -> None:
            try:
                answer.set_result(pods.read_kubelet(deadline))
            except Exception as e:  # _pods logs it, once
                answer.set_exception(e)

        try:
            WORKERS.start(read, "mig-exporter-kubelet")
        except RuntimeError:  # no thread to be had: ask after the GPUs, as pods.read does
            return None
        return answer

    def _procs(self, reading: Future[_Procs] | None, deadline: Deadline | None) -> _Procs | None:
        """The /proc reading, waited for until ``deadline``."""
        if reading is None:
            return None
        try:
            return reading.result(None if deadline is None else deadline.left_s())
        except FutureTimeout:
            return self._no_table("reading processes took longer than the scrape's budget")

    def _no_table(self, error: str) -> _Procs:
        assert self.engines is not None
        return _Procs(None, error, engine_trees(self.engines.settings, None, error))

    def _read_procs(self) -> _Procs:
        """Read /proc, and what it says of the engines: both beside the GPU read, in a worker."""
        assert self.engines is not None
        try:
            table, error = self.engines.read_procs()
        except Exception as e:  # a bug in the /proc read costs the engine metrics, not the scrape
            self._log_bug("reading processes failed unexpectedly", e)
            table, error = None, f"reading processes failed: unexpected {type(e).__name__}: {e}"
        try:
            return _Procs(table, error, self.engines.trees(table, error))
        except Exception as e:
            self._log_bug("attributing GPU memory to engines failed unexpectedly", e)
            return _Procs(table, error, None, f"engine attribution failed: unexpected {type(e).__name__}: {e}")

    def _engines(
        self, procs: _Procs | None, snapshot: Snapshot | None
    ) -> EngineReading | None:
        if self.engines is None or procs is None:
            return None
        if procs.trees is None:  # making them failed, and was logged then
            return EngineReading((), None, None, False, (procs.failure or "engine attribution failed",))
        try:
            return engines_on_gpus(procs.trees, snapshot)
        except Exception as e:
            self._log_bug("attributing GPU memory to engines failed unexpectedly", e)
            problem = f"engine attribution failed: unexpected {type(e).__name__}: {e}"
            return EngineReading((), None, None, False, (problem,))

    def _failed(self, started: float, reason: str, engines: EngineReading | None = None,
                answered: Callable[[], bool] | None = None) -> ReadOutcome:
        if self._count_failure(answered):
            log.warning("read from %s failed: %s", self.name, reason)
        else:  # each caller answered late, counted and logged that; this is why the read failed
            log.info("read from %s, answered late by every caller, failed: %s", self.name, reason)
        outcome = ReadOutcome(None, time.monotonic() - started, reason, engines)
        if engines is not None:
            self._log_problems(engines.problems, "engines")
        return outcome

    def _count_failure(self, answered: Callable[[], bool] | None) -> bool:
        """Count a failed read in read_errors_total, if it is anyone's answer (``answered``)."""
        if answered is not None and not answered():
            return False
        with self._lock:
            self._errors_total += 1
        return True

    def _log_bug(self, what: str, error: Exception) -> None:
        """The traceback once per distinct fault; afterwards the failed-read
        line alone, so a fault that repeats at every scrape cannot flood the log."""
        key = f"{what}: {type(error).__name__}: {error}"
        with self._lock:
            first = key not in self._logged_bugs
            self._logged_bugs.add(key)
        if first:
            log.error("%s (traceback shown once)", what, exc_info=error)

    def _log_problems(self, problems: Iterable[str], kind: str = "gpu", level: int = logging.WARNING) -> None:
        """Log a problem once when it appears and once when it clears, not at
        every scrape: a card that stays broken would otherwise flood the log.
        GPU, engine and pod problems are kept apart, so a failed GPU read (which
        has no GPU problems to report) does not log theirs as cleared."""
        current = frozenset(problems)
        with self._lock:
            known = self._known_problems.get(kind, frozenset())
            new = current - known
            cleared = known - current
            self._known_problems[kind] = current
        for problem in sorted(new):
            log.log(level, "read from %s: %s", self.name, problem)
        for problem in sorted(cleared):
            log.info("read from %s: cleared: %s", self.name, problem)

    def families(self, deadline: Deadline | None = None) -> list[Metric]:
        """Read once and map the outcome to metric families: ``scrape()`` without the outcome.
        Nothing in the exporter calls it (it needs the outcome too); kept for the tests of each
        reader (pods, owners, Slurm job map, NVML, the docs' metric list), which read a scrape's
        families alone, so that they need not unpack what they do not look at."""
        return self.scrape(deadline)[1]

    def scrape(self, deadline: Deadline | None = None,
               answered: Callable[[], bool] | None = None) -> tuple[ReadOutcome, list[Metric]]:
        """Read once: the outcome (the landing page draws it) and its metric families
        (``answered`` as for ``read``)."""
        outcome = self.read(deadline, answered)
        try:
            return outcome, list(self.families_for(outcome))
        except Exception as e:  # a mapping bug still answers, as a failed read
            self._log_bug(f"mapping the read from {self.name} failed", e)
            if outcome.success:  # a failed read was counted as one already
                self._count_failure(answered)
            failed = ReadOutcome(None, outcome.duration_s, f"unexpected {type(e).__name__}: {e}")
            return failed, list(self.families_for(failed))

    def failed_scrape(self, reason: str, started: float,
                      procs_since: float | None = None) -> tuple[ReadOutcome, list[Metric]]:
        """A read begun at ``started`` (``time.monotonic()``) that failed for ``reason``,
        counted and logged as one, and its families. With ``procs_since`` (``time.monotonic()``)
        and engines watched, it carries the newest /proc reading if taken since then (a scrape
        still in flight takes it alongside its GPU read): the engine families of a failed read, without
        reading /proc again."""
        outcome = self._failed(started, reason, self._engines(self._procs_since(procs_since), None))
        return outcome, list(self.families_for(outcome))

    def _procs_since(self, since: float | None) -> _Procs | None:
        with self._lock:
            newest = self._newest_procs
        if since is None or newest is None or newest[0] < since:
            return None
        return newest[1]

    def families_for(self, outcome: ReadOutcome) -> Iterator[Metric]:
        if outcome.snapshot is not None:
            yield from snapshot_families(outcome.snapshot, outcome.pods, outcome.owners, self.process_series)
            if outcome.pods is not None:
                yield from pod_families(outcome.pods, outcome.snapshot)
            if outcome.owners is not None:
                yield from owner_families(outcome.owners, outcome.snapshot)
            yield from allocation_families(outcome.pods, outcome.job_map)
            yield from device_state_families(outcome.snapshot, outcome.host)
        if self.xids is not None or self.kmsg is not None:  # on both read paths
            yield from self._xid_families(outcome)
        if outcome.engines is not None:
            yield from engine_families(outcome.engines, self.process_series)
        yield from read_families(
            self.source.name,
            success=outcome.success,
            duration_s=outcome.duration_s,
            errors_total=self.errors_total,
            problems=len(outcome.problems),
            version=__version__,
        )
