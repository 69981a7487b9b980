"""One scrape: read the source, keep the exporter's own bookkeeping, and hand
the collector what to map.

A failed read is data, not an exception: the scrape still answers, with
``mig_exporter_read_success 0``, and the reason goes to the log as one line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import Metric

from mig_exporter import __version__
from mig_exporter.collector import read_families, snapshot_families
from mig_exporter.errors import ReadError
from mig_exporter.snapshot import Snapshot

log = logging.getLogger("mig_exporter")


class Source(Protocol):
    """A read path: nvidia-smi, NVML or the demo."""

    name: str

    def read(self, timeout_s: float | None = None) -> Snapshot: ...

    def ready(self) -> tuple[bool, str]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    snapshot: Snapshot | None
    duration_s: float
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.snapshot is not None


class Scraper:
    """Reads a source on demand and counts what went wrong.

    Thread-safe: concurrent scrapes each read; only the counters are shared.
    """

    def __init__(self, source: Source, name: str | None = None) -> None:
        self.source = source
        self.name = name or source.name  # what the log calls this read path
        self._lock = threading.Lock()
        self._errors_total = 0
        self._known_problems: frozenset[str] = frozenset()
        self._logged_bugs: set[str] = set()

    @property
    def errors_total(self) -> int:
        with self._lock:
            return self._errors_total

    def read(self, timeout_s: float | None = None) -> ReadOutcome:
        started = time.monotonic()
        try:
            snapshot = self.source.read(timeout_s)
        except ReadError as e:
            return self._failed(started, str(e))
        except Exception as e:  # a bug must not take the scrape down; say where
            self._log_bug(f"read from {self.name} failed unexpectedly", e)
            return self._failed(started, f"unexpected {type(e).__name__}: {e}")
        duration = time.monotonic() - started
        self._log_problems(snapshot.problems)
        return ReadOutcome(snapshot, duration)

    def _failed(self, started: float, reason: str) -> ReadOutcome:
        with self._lock:
            self._errors_total += 1
        log.warning("read from %s failed: %s", self.name, reason)
        return ReadOutcome(None, time.monotonic() - started, reason)

    def _log_bug(self, what: str, error: Exception) -> None:
        """The traceback once per distinct fault; afterwards the failed-read
        line alone, so a fault that repeats at every scrape cannot flood the log."""
        key = f"{what}: {type(error).__name__}: {error}"
        with self._lock:
            first = key not in self._logged_bugs
            self._logged_bugs.add(key)
        if first:
            log.error("%s (traceback shown once)", what, exc_info=error)

    def _log_problems(self, problems: Iterable[str]) -> None:
        """Log a problem once when it appears and once when it clears, not at
        every scrape: a card that stays broken would otherwise flood the log."""
        current = frozenset(problems)
        with self._lock:
            new = current - self._known_problems
            cleared = self._known_problems - current
            self._known_problems = current
        for problem in sorted(new):
            log.warning("read from %s: %s", self.name, problem)
        for problem in sorted(cleared):
            log.info("read from %s: cleared: %s", self.name, problem)

    def families(self, timeout_s: float | None = None) -> list[Metric]:
        """Read once and map the outcome to metric families."""
        outcome = self.read(timeout_s)
        try:
            return list(self.families_for(outcome))
        except Exception as e:  # a mapping bug still answers, as a failed read
            self._log_bug(f"mapping the read from {self.name} failed", e)
            with self._lock:
                self._errors_total += 1
            failed = ReadOutcome(None, outcome.duration_s, f"unexpected {type(e).__name__}: {e}")
            return list(self.families_for(failed))

    def families_for(self, outcome: ReadOutcome) -> Iterator[Metric]:
        if outcome.snapshot is not None:
            yield from snapshot_families(outcome.snapshot)
        yield from read_families(
            self.source.name,
            success=outcome.success,
            duration_s=outcome.duration_s,
            errors_total=self.errors_total,
            problems=len(outcome.snapshot.problems) if outcome.snapshot else 0,
            version=__version__,
        )


class ScrapeCollector:
    """A prometheus_client collector that reads at every ``collect()``.

    ``describe()`` returns nothing so that registering it never triggers a
    read (the default registry would otherwise collect once to learn names).
    """

    def __init__(self, scraper: Scraper, timeout_s: float | None = None) -> None:
        self.scraper = scraper
        self.timeout_s = timeout_s

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.scraper.families(self.timeout_s)
