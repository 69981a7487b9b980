"""What the exporter answers, for ``serve`` and ``read`` alike: one scrape's families, then those
of every other collector it was built with (the counters about probes), encoded by
``exposition.py``. The HTTP server asks it for an answer as client_python's handler asks a
registry: it knows nothing of which metrics exist.

Concurrent callers share one scrape and its answer (``core/flight.py``): every request reading
/proc, building its families and encoding them, fifty scrapes at once held fifty answers, and
glibc's per-thread heaps kept that peak as resident memory (docs/reliability.md). Each encoding
(format, gzipped or not) is made once per scrape. The answer carries the read's outcome too: the
landing page (``/``) draws the read that ``/metrics`` answers with.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.flight import FlightNotStarted, Flights
from mig_exporter.metrics.exposition import negotiate, render, sample_count
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.sources.base import Source
from mig_exporter.sources.nvidia_smi import DEFAULT_TIMEOUT_S

log = logging.getLogger("mig_exporter")

# How long a finished read's answer is given, as it is, to requests that arrive while some
# connection still has its bytes queued (issue 38): 450 clients that never read, arriving a few ms
# apart, pinned 450 answers of 410 KB each; sharing one, they pin one per window. The connection
# loop counts the connections holding an answer's bytes (``Answer.queued``): a Prometheus that
# drains its answer holds nothing, and its next scrape reads afresh. A failed read is never reused.
# ``web/probe.py`` reuses a probe target's answer by the same rule.
REUSE_S = 1.0


def reusable(answer: Answer | None, ended_at: float, now: float) -> bool:
    """The reuse rule of ``/metrics`` and ``/probe``: a finished read's ``answer`` (``ended_at``,
    ``time.monotonic()``) is given to a request arriving ``now`` within ``REUSE_S`` of its end while
    a connection still has its bytes queued."""
    return answer is not None and now - ended_at <= REUSE_S and answer.queued()


_SCRAPE = "scrape"  # the one key of the exporter's flights: every scrape reads the same


class Collector(Protocol):
    """What a registry collects from (client_python's ``Collector``)."""

    def collect(self) -> Iterable[Metric]: ...


class Answer:
    """The families of one scrape and their encodings, each made once, by the
    first caller that asks for it; ``outcome`` is the read they were mapped
    from (``None`` for an answer that has no read of this exporter's, a probe's)."""

    def __init__(self, families: Sequence[Metric], outcome: ReadOutcome | None = None) -> None:
        self.families = tuple(families)
        self.outcome = outcome
        self._lock = threading.Lock()
        self._encodings: dict[tuple[str, bool], _Encoding] = {}
        self._holders = _Holders()

    def queued(self) -> bool:
        """Whether a connection still has any of its encodings queued to write: the connection
        loop says so itself (``web/connections.Held``), counting each connection that queues the
        bytes and each that has sent them all or is closed. Nothing else counts: a worker handing
        the bytes over, a copy, a traceback."""
        return self._holders.count > 0

    def encoded(self, accept: str | None, compress: bool) -> tuple[bytes, str]:
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
                    # Level 1 (nginx's default, Go's BestSpeed): on big-mig's 364 KiB,
                    # 0.9 ms for 25 KiB, where 6 (client_golang's default) takes 2.3 ms
                    # for 22 KiB and 9 (client_python's) 6 ms for 19 KiB; 2 and 3 cost
                    # the same as 1 within 2% and save 2%, and 0 saves 0.7 ms but sends
                    # 15 times the bytes to every Prometheus.
                    body = gzip.compress(body, compresslevel=1)
                encoding.value = (_Body(body, self._holders), content_type)
            return encoding.value


class _Encoding:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: tuple[bytes, str] | None = None


class _Holders:
    """How many connections have an answer's bytes queued, as the connection loops report it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the loops of several servers may write one answer
        self.count = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.count += delta


class _Body(bytes):
    """An encoding's bytes, which tell its answer's ``_Holders`` when a connection queues them
    and when it has done with them (``web/connections.Held``). It refers to the count alone, not
    to the answer: a connection that does not read pins these bytes, never the families."""

    _holders: _Holders

    def __new__(cls, data: bytes, holders: _Holders) -> _Body:
        body = super().__new__(cls, data)
        body._holders = holders
        return body

    def hold(self, delta: int) -> None:
        self._holders.add(delta)


class Exporter:
    """The scrape collector and the other collectors, composed: ``answer(deadline)`` scrapes
    or joins the scrape in flight. ``collect()`` is the same with ``timeout_s`` and
    ``describe()`` is empty (registering never reads): client_python's collector protocol, so
    another program can register the exporter in a prometheus_client registry and serve it with
    its own HTTP server. Nothing in mig-exporter does; tests/test_collector.py and
    tests/test_promtool.py do."""

    def __init__(self, scraper: Scraper, *collectors: Collector, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.scraper = scraper
        self.collectors = collectors
        self.timeout_s = timeout_s  # --timeout: the budget of a scrape no one gave a shorter one
        self._scrapes: Flights[str, Answer] = Flights("scrape", keep_ended=True)
        self._lock = threading.Lock()
        self._clamped = 0  # guarded by _lock
        self._client_timeouts = 0  # guarded by _lock
        self._last: tuple[float, Answer] | None = None  # the newest scrape's answer, and when it ended

    @property
    def source(self) -> Source:
        return self.scraper.source

    def answer(self, deadline: Deadline, arrived_at: float | None = None) -> Answer:
        """This caller's share of a scrape due at ``deadline``: the one in flight, else a new one;
        or, for a request that arrived at ``arrived_at`` (``time.monotonic()``) and waited for a
        thread meanwhile, the scrape that was in flight then, if it has ended since.
        Kept past its deadline by the scrape it joined, the caller gets a failed read, counted and
        logged once for the callers kept waiting together, with the engine reading of the /proc
        read that scrape began with; the scrape's own failure is then counted and logged only
        if a caller still waits to take it (``core/flight.py``)."""
        started = time.monotonic()
        last = self._last
        if last is not None and reusable(last[1], last[0], started):
            return last[1]  # a connection still holds its bytes: the same bytes, not another copy
        # The scrape runs under the server's own limit, never a caller's shorter deadline: a
        # client that asks for 0.1s (the scrape-timeout header) must not cut short the read that
        # a Prometheus joins (issue 38). A caller due sooner answers its own timeout, alone.
        limit = deadline.at_least(self.timeout_s)
        try:
            return self._scrapes.run(_SCRAPE, deadline, lambda: self._scrape(limit),
                                     late=lambda: self._late(deadline, started), arrived_at=arrived_at,
                                     run_deadline=limit, own_late=lambda: self._client_timeout(deadline, started))
        except FlightNotStarted as e:  # no thread for the scrape: a failed read, as any other
            return self._failed(str(e), started)

    def forget_finished(self, now: float) -> None:
        """Let go of a finished scrape kept for the requests that arrived while it was in flight
        (``Flights.forget_ended``)."""
        self._scrapes.forget_ended(now)
        last = self._last
        if last is not None and now - last[0] > REUSE_S:
            self._last = None

    def joined(self) -> int:
        """How many callers have joined the scrape in flight so far, the one that started it not
        counted (``Flights.joined``)."""
        return self._scrapes.joined(_SCRAPE)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.answer(Deadline.after(self.timeout_s)).families

    def _scrape(self, deadline: Deadline) -> Answer:
        """One scrape, in the flight's thread; its failure is counted only if a caller takes it."""
        answer = self._answer(*self.scraper.scrape(deadline, answered=lambda: self._scrapes.keep_callers(_SCRAPE)))
        # Only a read that succeeded is given to later requests: a failure is shown to the
        # callers that waited for it, each time afresh after.
        success = answer.outcome is not None and answer.outcome.success
        self._last = (time.monotonic(), answer) if success else None
        return answer

    def _answer(self, outcome: ReadOutcome, families: list[Metric]) -> Answer:
        for collector in self.collectors:
            families.extend(collector.collect())
        families.extend(self._deadline_families())
        # What this answer costs the Prometheus that scrapes it, counted as its
        # scrape_samples_scraped counts: every sample line, this one included.
        families.append(GaugeMetricFamily(
            "mig_exporter_scrape_series",
            "Samples in this /metrics answer, this one included: what Prometheus counts as scrape_samples_scraped "
            "(docs/scale.md).",
            value=sample_count(families) + 1,
        ))
        return Answer(families, outcome)

    def _late(self, deadline: Deadline, started: float) -> Answer:
        return self._failed(f"the scrape in flight did not finish within {deadline.at - started:.1f}s", started)

    def _client_timeout(self, deadline: Deadline, started: float) -> Answer:
        """This caller's own deadline passed while the scrape went on within the server's limit
        (``Flights.run``'s ``own_late``): a failed answer for it alone, but no read error of the
        source, neither counted in read_errors_total nor logged as a WARNING: the read goes on,
        and the callers due with it take its answer."""
        reason = (f"this request's own deadline of {deadline.at - started:.1f}s passed "
                  f"while the scrape went on within --timeout")
        log.debug("%s", reason)
        with self._lock:
            self._client_timeouts += 1
        outcome = ReadOutcome(None, time.monotonic() - started, reason)
        return self._answer(outcome, list(self.scraper.families_for(outcome)))

    def count_clamped(self) -> None:
        """One more request whose scrape-timeout header was below the floor or not a number
        (``core/deadline.client_budget``), from ``/metrics``, ``/`` or ``/probe``."""
        with self._lock:
            self._clamped += 1

    def _deadline_families(self) -> list[Metric]:
        with self._lock:
            clamped, client_timeouts = self._clamped, self._client_timeouts
        return [CounterMetricFamily(
            "mig_exporter_scrape_timeout_clamped",
            "Requests whose X-Prometheus-Scrape-Timeout-Seconds was below 1s or not a finite positive number, "
            "taken as 1s (docs/security.md).", value=clamped),
            # A read that ends between Prometheus' deadline and --timeout fails that scrape but is no
            # read error: without this count it would show only as read_success 0.
            CounterMetricFamily(
                "mig_exporter_scrape_client_timeouts",
                "/metrics requests answered failed at their own deadline (the scrape-timeout header less the "
                "offset) while the read they shared went on within --timeout; not in read_errors_total.",
                value=client_timeouts)]

    def _failed(self, reason: str, started: float) -> Answer:
        """A failed read, with the newest /proc reading if it is no older than ``timeout_s`` (one
        scrape's budget: the scrape in flight takes it alongside its GPU read) or taken since this
        caller came (by the scrape it started or joined)."""
        since = min(time.monotonic() - self.timeout_s, started)
        outcome, families = self.scraper.failed_scrape(reason, started, procs_since=since)
        return self._answer(outcome, families)
