"""Concurrent callers of the same work share one run of it, each waiting only until its own
deadline: fifty scrapes at once cause one scrape (one nvidia-smi run or NVML pass, one /proc
read, one answer), twenty probes of one target one run of its command.

The rules, the same for every caller:

- A caller joins the run in flight for its key, whatever that run's deadline, even one already
  past it: a run is never doubled, so a driver call hung for good holds one thread, not one per
  scrape. With none in flight the caller starts one, due at the caller's own deadline.
- The work runs in a daemon thread and hands its result over in a ``concurrent.futures.Future``:
  a caller answers at its deadline while the run goes on to its own, and a run hung in the
  driver never holds up the interpreter's exit.
- Each caller waits until its own deadline; for a run due by then, ``JOIN_GRACE_S`` longer (a
  command killed at the deadline answers a few ms after it).
- A caller whose deadline passes gets ``late()``: one answer for the callers the run kept waiting
  together, made by the first of them (a failed read counted and logged once, not once per
  request); a caller that joins after it was made gets one of its own.
- What the work raised goes to every caller: the one that started the run raises it, the others
  a ``FlightFailed`` caused by it (one exception raised in many threads would pile each
  thread's frames onto its traceback).
- A run that has ended is never reused: the next caller starts afresh.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, wait
from typing import Generic, TypeVar

from mig_exporter.core.deadline import Deadline

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# A run ends at its deadline plus the few ms a killed command takes to answer; a
# caller waits this long past its own deadline for a run due by then.
JOIN_GRACE_S = 0.25


class FlightFailed(Exception):
    """The run a caller joined raised; its error is the cause."""


class _Run(Generic[T]):
    """One run of the work: its result, and what its callers share besides."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.future: Future[T] = Future()
        self.joined = 0  # callers that joined it, the one that started it not counted
        self.late_lock = threading.Lock()
        self.lates = 0  # late answers made so far
        self.late: tuple[T] | None = None  # the latest of them


class Flights(Generic[K, T]):
    """Runs of ``work`` shared per key; thread-safe. ``name`` names the threads the work runs
    in, and what a ``FlightFailed`` says failed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._runs: dict[K, _Run[T]] = {}

    def joined(self, key: K) -> int:
        """How many callers joined the run in flight for ``key`` (0 when none)."""
        with self._lock:
            run = self._runs.get(key)
            return run.joined if run is not None else 0

    def run(self, key: K, deadline: Deadline, work: Callable[[], T], late: Callable[[], T],
            admit: Callable[[], None] | None = None) -> T:
        """What ``work`` returns, from the run in flight for ``key`` or from a new one; by
        ``deadline``, else what ``late`` returns. ``admit`` is called before a new run starts
        (never for a caller that joins one): what it raises goes to this caller alone, and
        nothing starts."""
        with self._lock:
            run = self._runs.get(key)
            starts = run is None
            if run is None:
                if admit is not None:
                    admit()
                run = self._runs[key] = _Run(deadline)
                threading.Thread(target=self._fly, args=(key, run, work), name=self.name, daemon=True).start()
            else:
                run.joined += 1
        with run.late_lock:
            seen = run.lates
        grace = JOIN_GRACE_S if run.deadline <= deadline else 0.0
        done, _ = wait((run.future,), timeout=deadline.left_s() + grace)
        if not done:
            return self._late(run, seen, late)
        error = run.future.exception()
        if error is not None and not starts:
            raise FlightFailed(f"the shared {self.name} failed: {error}") from error
        return run.future.result()

    def _fly(self, key: K, run: _Run[T], work: Callable[[], T]) -> None:
        """The run's thread: the work, then the run leaves the table (the next caller starts
        afresh) and its callers are woken."""
        try:
            value = work()
        except BaseException as e:  # handed to every caller of the run
            self._land(key, run)
            run.future.set_exception(e)
        else:
            self._land(key, run)
            run.future.set_result(value)

    def _land(self, key: K, run: _Run[T]) -> None:
        with self._lock:
            if self._runs.get(key) is run:
                del self._runs[key]

    @staticmethod
    def _late(run: _Run[T], seen: int, late: Callable[[], T]) -> T:
        """The late answer for a caller that saw ``seen`` of them made when it joined: the
        latest, if made since; else a new one."""
        with run.late_lock:
            if run.late is None or run.lates == seen:
                run.late = (late(),)
                run.lates += 1
            return run.late[0]
