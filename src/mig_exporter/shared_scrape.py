"""Concurrent ``/metrics`` requests share one scrape and its encoded answer.

The read alone was shared before (``singleflight.py``): every request still
read /proc, built its families and encoded them, so fifty scrapes at once held
fifty answers, and glibc's per-thread heaps kept that peak as resident memory
for good (docs/reliability.md). Now a request joins the scrape in flight, and
each encoding (Accept header, gzip or not) is made once per scrape.

A request joins only a scrape that ends by the request's own deadline: behind
a read still hung with a longer budget it runs a scrape of its own, which
joins that read only until its own deadline (``SingleFlight``). A scrape that
has ended is never reused: the next request reads afresh.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client.core import Metric

from mig_exporter.exposition import render

# A joined scrape ends at its deadline plus the few ms a killed command takes to
# answer; a request waits this long past its own deadline before giving up on it.
JOIN_GRACE_S = 0.25


class Answer:
    """The families of one scrape and their encodings, each made once, by the
    first request that asks for it."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self.families = tuple(families)
        self._lock = threading.Lock()
        self._encoded: dict[tuple[str, bool], tuple[bytes, str]] = {}

    def encoded(self, accept: str, compress: bool) -> tuple[bytes, str]:
        """The body and Content-Type for ``Accept: accept``, gzipped if ``compress``."""
        key = (accept, compress)
        with self._lock:  # a second request for the same encoding waits for the first
            found = self._encoded.get(key)
            if found is None:
                body, content_type = render(self.families, accept)
                if compress:
                    # Level 1, as nginx's default: a third of level 6's time for a
                    # body ~15% larger, on a scrape that must cost next to nothing.
                    body = gzip.compress(body, compresslevel=1)
                found = self._encoded[key] = (body, content_type)
            return found


class _Flight:
    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.done = threading.Event()
        self.answer: Answer | None = None
        self.error: BaseException | None = None


class SharedScrapes:
    """``scrape(budget_s)`` builds the families; ``answer(budget_s)`` runs it
    or joins the one in flight."""

    def __init__(self, scrape: Callable[[float], Sequence[Metric]],
                 late: Callable[[str], Sequence[Metric]]) -> None:
        """``late(reason)``: the families of a failed read, for a request whose
        joined scrape overran its deadline (a bug: a scrape ends by its deadline)."""
        self._scrape = scrape
        self._late = late
        self._lock = threading.Lock()
        self._flight: _Flight | None = None

    def answer(self, budget_s: float) -> Answer:
        deadline = time.monotonic() + budget_s
        with self._lock:
            flight = self._flight
            joined = flight is not None and flight.deadline <= deadline
            if not joined:
                # The scrape in flight (if any) may run past this request's deadline:
                # scrape on our own; later requests join this one.
                flight = self._flight = _Flight(deadline)
        assert flight is not None
        if not joined:
            self._fly(flight, budget_s)
        elif not flight.done.wait(max(deadline - time.monotonic(), 0.0) + JOIN_GRACE_S):
            # _late logs it, as a failed read
            return Answer(self._late(f"the scrape in flight did not finish within {budget_s:.1f}s"))
        if flight.error is not None:
            raise flight.error
        assert flight.answer is not None
        return flight.answer

    def _fly(self, flight: _Flight, budget_s: float) -> None:
        """Run the scrape in the requesting thread, and hand it to those who joined."""
        try:
            flight.answer = Answer(self._scrape(budget_s))
        except BaseException as e:  # every request on this scrape gets the same error
            flight.error = e
        finally:
            with self._lock:
                if self._flight is flight:
                    self._flight = None
            flight.done.set()
