"""Concurrent ``/metrics`` requests share one scrape and its encoded answer.

The read alone was shared before (``singleflight.py``): every request still
read /proc, built its families and encoded them, so fifty scrapes at once held
fifty answers, and glibc's per-thread heaps kept that peak as resident memory
(docs/reliability.md). Now a request joins the scrape in flight, and each
encoding (format and gzip or not) is made once per scrape. The answer carries
the read's outcome too: the landing page (``/``) draws the same read that
``/metrics`` answers with, and joins it like any scrape.

A request joins only a scrape that is due by the request's own deadline and
not yet overdue: behind a read still hung with a longer budget, or a scrape
already late, it runs a scrape of its own (which joins that read only until
its own deadline, ``SingleFlight``). A scrape that has ended is never reused:
the next request reads afresh.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client.core import Metric

from mig_exporter.core.flight import Flight
from mig_exporter.metrics.exposition import negotiate, render
from mig_exporter.metrics.scrape import ReadOutcome

# A scrape ends at its deadline plus the few ms a killed command takes to
# answer; a request waits this long past its own deadline before giving up on it.
JOIN_GRACE_S = 0.25


class Answer:
    """The families of one scrape and their encodings, each made once, by the
    first request that asks for it; ``outcome`` is the read they were mapped
    from (``None`` for an answer that has no read of this exporter's, a probe's)."""

    def __init__(self, families: Sequence[Metric], outcome: ReadOutcome | None = None) -> None:
        self.families = tuple(families)
        self.outcome = outcome
        self._lock = threading.Lock()
        self._encodings: dict[tuple[str, bool], _Encoding] = {}

    def encoded(self, accept: str, compress: bool) -> tuple[bytes, str]:
        """The body and Content-Type for ``Accept: accept``, gzipped if ``compress``."""
        # Keyed on what the header asks for, not its spelling; one lock per encoding,
        # so a request for another format does not wait for this one.
        key = (negotiate(accept)[1], compress)
        with self._lock:
            encoding = self._encodings.get(key)
            if encoding is None:
                encoding = self._encodings[key] = _Encoding()
        with encoding.lock:
            if encoding.value is None:
                body, content_type = render(self.families, accept)
                if compress:
                    # Level 1, as nginx's default: a third of level 6's time for a
                    # body ~15% larger, on a scrape that must cost next to nothing.
                    body = gzip.compress(body, compresslevel=1)
                encoding.value = (body, content_type)
            return encoding.value


class _Encoding:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: tuple[bytes, str] | None = None


class ScrapeFailed(Exception):
    """The scrape a request joined raised; its error is the cause."""


class _Flight(Flight[Answer]):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline
        self.joined = 0
        self.late_lock = threading.Lock()
        self.late: Answer | None = None  # the failed answer for those it kept past their deadline


class SharedScrapes:
    """``scrape(budget_s)`` builds the answer; ``answer(budget_s)`` runs it
    or joins the one in flight."""

    def __init__(self, scrape: Callable[[float], Answer], late: Callable[[str, float], Answer]) -> None:
        """``late(reason, started)``: the answer of a failed read, for requests
        whose joined scrape overran (a scrape should end by its deadline)."""
        self._scrape = scrape
        self._late = late
        self._lock = threading.Lock()
        self._flight: _Flight | None = None

    def joined(self) -> int:
        """How many requests are waiting on the scrape in flight (0 when none)."""
        with self._lock:
            return self._flight.joined if self._flight is not None else 0

    def answer(self, budget_s: float) -> Answer:
        started = time.monotonic()
        deadline = started + budget_s
        with self._lock:
            flight = self._flight
            joined = flight is not None and started < flight.deadline <= deadline
            if flight is not None and joined:
                flight.joined += 1
            else:
                # None in flight, or one that may end after this request's deadline
                # or is overdue already: scrape on our own; later requests join this one.
                flight = self._flight = _Flight(deadline)
        if not joined:  # in this thread: it is this request's scrape
            flight.fly(lambda: self._scrape(budget_s), self._landed)
        elif not flight.done.wait(max(deadline - time.monotonic(), 0.0) + JOIN_GRACE_S):
            return self._late_answer(flight, budget_s, started)
        if flight.error is not None:
            if joined:  # a fresh exception: raising the one object in every thread would pile up tracebacks
                raise ScrapeFailed(f"the shared scrape failed: {flight.error}") from flight.error
            raise flight.error
        assert flight.value is not None
        return flight.value

    def _late_answer(self, flight: _Flight, budget_s: float, started: float) -> Answer:
        """One failed read for all the requests a late scrape kept waiting: counted
        and logged once (by ``late``), not once per request."""
        with flight.late_lock:
            if flight.late is None:
                reason = f"the scrape in flight did not finish within {budget_s:.1f}s"
                flight.late = self._late(reason, started)
            return flight.late

    def _landed(self, flight: Flight[Answer]) -> None:
        with self._lock:
            if self._flight is flight:
                self._flight = None
