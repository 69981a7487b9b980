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
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from mig_exporter.core.deadline import Deadline
from mig_exporter.core.flight import FlightNotStarted, Flights
from mig_exporter.metrics.exposition import negotiate, render, sample_count
from mig_exporter.metrics.scrape import ReadOutcome, Scraper
from mig_exporter.sources.base import Source
from mig_exporter.sources.nvidia_smi import DEFAULT_TIMEOUT_S

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
                encoding.value = (body, content_type)
            return encoding.value


class _Encoding:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: tuple[bytes, str] | None = None


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
        try:
            return self._scrapes.run(_SCRAPE, deadline, lambda: self._scrape(deadline),
                                     late=lambda: self._late(deadline, started), arrived_at=arrived_at)
        except FlightNotStarted as e:  # no thread for the scrape: a failed read, as any other
            return self._failed(str(e), started)

    def forget_finished(self, now: float) -> None:
        """Let go of a finished scrape kept for the requests that arrived while it was in flight
        (``Flights.forget_ended``)."""
        self._scrapes.forget_ended(now)

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
        return self._answer(*self.scraper.scrape(deadline, answered=lambda: self._scrapes.keep_callers(_SCRAPE)))

    def _answer(self, outcome: ReadOutcome, families: list[Metric]) -> Answer:
        for collector in self.collectors:
            families.extend(collector.collect())
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

    def _failed(self, reason: str, started: float) -> Answer:
        """A failed read, with the newest /proc reading if it is no older than ``timeout_s`` (one
        scrape's budget: the scrape in flight takes it alongside its GPU read)."""
        outcome, families = self.scraper.failed_scrape(reason, started,
                                                       procs_since=time.monotonic() - self.timeout_s)
        return self._answer(outcome, families)
