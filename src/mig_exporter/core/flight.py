"""Concurrent callers of the same work share one run of it, each waiting only until its own
deadline: fifty scrapes at once cause one scrape (one nvidia-smi run or NVML pass, one /proc
read, one answer), twenty probes of one target one run of its command.

The rules, the same for every caller:

- A caller joins the run in flight for its key, whatever that run's deadline, even one already
  past it: a run is never doubled, so a driver call hung for good holds one thread, not one per
  scrape. With none in flight the caller starts one, due at the caller's own deadline, or at
  the ``run_deadline`` it gives (the exporter and the prober give the server's own limit: a
  client's short deadline must not cut short a read that other clients join). What
  ``admit`` took for it (a probe slot) is given back when it ends; where no thread can be
  started for it (a pids limit), at once, and the caller gets ``FlightNotStarted``: nothing is
  left in flight, and the next caller starts afresh.
- The work runs in a daemon thread (``core/workers.py``: one kept from an earlier run when
  idle) and hands its result over in a ``concurrent.futures.Future``:
  a caller answers at its deadline while the run goes on to its own, and a run hung in the
  driver never holds up the interpreter's exit.
- Each caller waits until its own deadline. Work that ends itself at its deadline (a command
  killed then answers a few ms after it) is waited for ``JOIN_GRACE_S`` longer by a caller it
  is due to by then, but only up to its own deadline and the grace: a caller that joins a run
  already past that waits until its own deadline alone, or every answer behind a hung run
  would come the grace late. Work no deadline reaches (``ends_at_deadline=False``: an NVML
  call hung in the driver) gets no grace at all: waiting longer would only make the answer late.
- A caller whose deadline passes gets ``late()``: one answer for the callers the run kept waiting
  together, made by the first of them (a failed read counted and logged once, not once per
  request); a caller that joins after it was made gets one of its own.
- A run's own failure is one more failed answer only if a caller takes it. Its work asks
  ``keep_callers(key)`` before counting and logging it: False when every caller has answered
  late already (each of those answers counted itself), so the failure is counted nowhere else;
  True holds the callers still waiting to the run's answer, which is moments away (a caller
  whose deadline passes from then on waits up to ``JOIN_GRACE_S`` more for it, rather than
  answer late with the same failure counted twice).
- What the work raised goes to every caller still waiting: the one that started the run raises
  it, the others a ``FlightFailed`` caused by it (one exception raised in many threads would pile
  each thread's frames onto its traceback). Where every caller has answered late already, it is
  logged here, once, since no caller will.
- A run that has ended is never reused by a caller that came after it ended: that caller starts
  afresh. A caller that came before it ended (``arrived_at``: a request the HTTP loop had whole then,
  and handed to a worker only once the run had ended, behind a queue of others) takes its result
  all the same, as it would have had a thread been free: two hundred scrapes at once
  cause one read, not one per wave of the worker pool. A run's result is kept for that only
  ``KEEP_ENDED_S``, or until ``forget_ended`` finds it older.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, wait
from typing import Generic, TypeVar

from mig_exporter.core import workers as exporter_workers
from mig_exporter.core.deadline import Deadline
from mig_exporter.core.errors import ReadError
from mig_exporter.core.workers import Workers

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

log = logging.getLogger("mig_exporter")

# A run ends at its deadline plus the few ms a killed command takes to answer; a
# caller waits this long past the run's deadline for a run due by its own.
JOIN_GRACE_S = 0.25
# How long an ended run's result is kept for the callers that arrived while it was in flight and
# are still on their way to it (queued for a worker): they reach it within milliseconds of its end.
KEEP_ENDED_S = 2.0


class FlightFailed(Exception):
    """The run a caller joined raised; its error is the cause."""


class FlightNotStarted(RuntimeError):
    """No thread could be started for a new run (a pids or thread limit); the cause says why.
    Nothing was left in flight, and what ``admit`` took was given back."""


class _Run(Generic[T]):
    """One run of the work: its result, and what its callers share besides."""

    def __init__(self, deadline: Deadline, release: Callable[[], None] | None) -> None:
        self.deadline = deadline
        self.release = release  # gives back what admit took for it
        self.future: Future[T] = Future()
        # Guarded by lock (taken after Flights._lock where both are held), held for moments:
        self.lock = threading.Lock()
        self.joined = 0  # callers that joined it, the one that started it not counted
        self.waiting = 1  # callers that will take its answer: all of them, less those that answered late
        self.kept = False  # keep_callers held them to its answer
        self.answered_late = False  # a caller the run kept waiting answered late (a shared late answer)
        # Guarded by late_lock, held while a late answer is made:
        self.late_lock = threading.Lock()
        self.lates = 0  # late answers made so far
        self.late: tuple[T] | None = None  # the latest of them


class Flights(Generic[K, T]):
    """Runs of ``work`` shared per key; thread-safe. ``name`` names the threads the work runs
    in, and what a ``FlightFailed`` says failed. ``ends_at_deadline``: whether the work ends
    itself at its deadline, or a few ms after it (a command killed then), so a caller due by
    then waits ``JOIN_GRACE_S`` more for it; False for work no deadline reaches. ``workers``:
    the threads runs take (the exporter's own by default)."""

    def __init__(self, name: str, *, ends_at_deadline: bool = True, workers: Workers | None = None,
                 keep_ended: bool = False) -> None:
        self.name = name
        self.keep_ended = keep_ended  # keep an ended run's result for the callers that came before it ended
        self.ends_at_deadline = ends_at_deadline
        self._workers = workers  # None: the exporter's own, looked up at each run
        self._lock = threading.Lock()
        self._runs: dict[K, _Run[T]] = {}
        # The last run of each key that ended with a result: (when it ended, its result).
        self._ended: dict[K, tuple[float, T]] = {}

    def joined(self, key: K) -> int:
        """How many callers have joined the run in flight for ``key`` so far (0 when none is),
        the one that started it not counted; those that have answered late since still are:
        the count is never lowered."""
        with self._lock:
            run = self._runs.get(key)
            if run is None:
                return 0
            with run.lock:
                return run.joined

    def run(self, key: K, deadline: Deadline, work: Callable[[], T], late: Callable[[], T],
            admit: Callable[[], Callable[[], None]] | None = None, arrived_at: float | None = None,
            run_deadline: Deadline | None = None, own_late: Callable[[], T] | None = None) -> T:
        """What ``work`` returns, from the run in flight for ``key`` or from a new one; by
        ``deadline``, else what ``late`` returns. ``admit`` is called before a new run starts
        (never for a caller that joins one): what it raises goes to this caller alone, and
        nothing starts; what it returns gives back what it took, and is called when the run
        ends. ``arrived_at`` (``time.monotonic()``): when the caller's request came, if it waited
        since for a thread; a run that ended with a result after that (in flight then, or
        started since) answers it. ``run_deadline``: when a new run is due, if not at this
        caller's own deadline (the server's own limit, so that no caller's shorter deadline
        cuts short a run that later callers join: ``work`` must read under the same one).
        ``own_late``: the answer, made for this caller alone and shared with no one, when its own
        deadline passes before the run's (its client's timeout, no failure of the run's); ``late``
        by default.
        Raises ``FlightNotStarted`` when no thread can be started for a new run."""
        with self._lock:
            ended = self._ended.get(key)
            if ended is not None and arrived_at is not None and arrived_at <= ended[0]:
                return ended[1]
            run = self._runs.get(key)
            starts = run is None
            if run is None:
                run = self._runs[key] = _Run(run_deadline or deadline, admit() if admit is not None else None)
                self._ended.pop(key, None)  # a newer run is in flight: callers join it
                try:
                    (self._workers or exporter_workers.WORKERS).start(lambda: self._fly(key, run, work), self.name)
                except BaseException as e:  # the run never started: leave nothing behind
                    del self._runs[key]
                    if run.release is not None:
                        run.release()
                    if not isinstance(e, Exception):
                        raise
                    raise FlightNotStarted(f"could not start a thread for the {self.name}: {e}") from e
            else:
                with run.lock:
                    run.joined += 1
                    run.waiting += 1
        with run.late_lock:
            seen = run.lates
        if not wait((run.future,), timeout=self._until(run, deadline).left_s())[0]:
            alone = deadline < run.deadline  # the run was not due yet: this caller's own timeout
            answer = self._give_up(run, seen, (own_late or late) if alone else late, alone)
            if answer is not None:
                return answer[0]
        error = run.future.exception()
        if error is not None and not starts:
            raise FlightFailed(f"the shared {self.name} failed: {error}") from error
        return run.future.result()

    def forget_ended(self, now: float) -> None:
        """Let go of ended runs' results kept longer than ``KEEP_ENDED_S``: a scrape's answer is
        not held between scrapes."""
        with self._lock:
            for key in [key for key, (ended, _) in self._ended.items() if now - ended > KEEP_ENDED_S]:
                del self._ended[key]

    def keep_callers(self, key: K) -> bool:
        """For the work of the run in flight for ``key``, before it counts and logs its
        failure: whether any caller still waits to take it as its answer. False when every
        caller has answered late already (each of those answers counted itself): the failure
        is then no answer of its own, and is neither counted nor logged as one. Callers that
        answered their own timeout alone (``own_late``) counted nothing: a run that only they
        left is counted still, once. True while any caller waits holds the
        callers still waiting to the run's answer: a caller whose deadline passes from now on
        waits up to ``JOIN_GRACE_S`` more for it rather than answer late (the run has only to
        map its failure)."""
        with self._lock:
            run = self._runs.get(key)
        if run is None:  # not called from a run's work: nothing to share, count as usual
            return True
        with run.lock:
            run.kept = run.waiting > 0
            return run.kept or not run.answered_late

    def _until(self, run: _Run[T], deadline: Deadline) -> Deadline:
        """How long a caller due at ``deadline`` waits for ``run``: the grace only for a run due
        by then that ends itself, and only up to the run's deadline and the grace."""
        if not self.ends_at_deadline or run.deadline > deadline:
            return deadline
        return max(deadline, Deadline(run.deadline.at + JOIN_GRACE_S))

    def _give_up(self, run: _Run[T], seen: int, late: Callable[[], T], alone: bool = False) -> tuple[T] | None:
        """The late answer for a caller whose wait has run out and that saw ``seen`` of them
        made when it joined: the latest, if made since; else a new one. ``alone``: the caller's
        own deadline came before the run's, so the run did not keep it waiting: it answers its
        own timeout, made for it alone and shared with no one (a caller due with the run must not
        take a client's timeout as the run's failure). ``None`` when the run's own answer is there
        to take after all: it ended just now, or it keeps its callers and ends within
        ``JOIN_GRACE_S``."""
        with run.lock:
            if run.future.done():
                return None
            kept = run.kept
            if not kept:
                run.waiting -= 1
                run.answered_late = run.answered_late or not alone
        if alone and not kept:
            return (late(),)
        if kept:
            wait((run.future,), timeout=JOIN_GRACE_S)
            with run.lock:
                if run.future.done():
                    return None
                run.waiting -= 1  # kept, then hung mapping its failure (a bug): answer, counted again
                run.answered_late = run.answered_late or not alone
        if alone:
            return (late(),)
        with run.late_lock:
            if run.late is None or run.lates == seen:
                run.late = (late(),)
                run.lates += 1
            return run.late

    def _fly(self, key: K, run: _Run[T], work: Callable[[], T]) -> None:
        """The run's thread: the work; then what admit took is given back, the run leaves the
        table (the next caller starts afresh) and its callers are woken."""
        try:
            result: tuple[T] | BaseException = (work(),)
        except BaseException as e:  # handed to every caller of the run
            result = e
        try:
            if run.release is not None:  # first: the next run may take it at once
                run.release()
        finally:
            with self._lock:
                if self._runs.get(key) is run:
                    del self._runs[key]
                    if self.keep_ended and not isinstance(result, BaseException):
                        self._ended[key] = (time.monotonic(), result[0])
            with run.lock:
                if isinstance(result, BaseException):
                    run.future.set_exception(result)
                else:
                    run.future.set_result(result[0])
                untaken = run.waiting == 0
        if untaken and isinstance(result, BaseException):
            self._log_untaken(result)

    def _log_untaken(self, error: BaseException) -> None:
        """What a run raised when every caller had answered late: no caller will log it."""
        if isinstance(error, ReadError):  # an expected failure, which each caller answered as its own
            log.info("a %s run that every caller had answered late without failed: %s", self.name, error)
        else:  # a bug no one else will report
            log.error("a %s run that every caller had answered late without failed", self.name, exc_info=error)
