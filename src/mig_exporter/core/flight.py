"""Share one read among concurrent callers, each waiting only until its own deadline.

Two Prometheus replicas scraping at once, or fifty, cause one nvidia-smi run
(or one NVML pass), not fifty. The work runs in a daemon thread: a caller whose
deadline passes answers at once, the work goes on to its own deadline (a hung
driver call is never waited for at exit), and the next caller joins it rather
than starting another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from mig_exporter.core.errors import ReadError

T = TypeVar("T")


class Flight(Generic[T]):
    """One run of shared work: what it returned or raised, for every caller
    waiting on it (``shared_scrape.py`` keeps its flights too)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def fly(self, work: Callable[[], T], landed: Callable[[Flight[T]], None]) -> None:
        """Run ``work`` and keep its value or error; then ``landed`` (its owner
        lets the next caller start a flight of its own) and wake every waiter."""
        try:
            self.value = work()
        except BaseException as e:  # handed to every caller waiting on this flight
            self.error = e
        finally:
            landed(self)
            self.done.set()


class SingleFlight(Generic[T]):
    def __init__(self, name: str, thread_name: str) -> None:
        self.name = name
        self.thread_name = thread_name
        self._lock = threading.Lock()
        self._flight: Flight[T] | None = None

    def run(self, work: Callable[[], T], timeout_s: float, grace_s: float = 0.0) -> T:
        """The result of ``work``, shared with every caller that arrives while it
        runs. Raises what ``work`` raised, or ``ReadError`` at ``timeout_s``.

        ``grace_s``: for work that ends itself at the same deadline (a command
        killed at its timeout), wait that much longer to report its own error."""
        with self._lock:
            flight = self._flight
            if flight is None:
                flight = self._flight = Flight()
                threading.Thread(target=flight.fly, args=(work, self._landed), name=self.thread_name,
                                 daemon=True).start()
        if not flight.done.wait(max(timeout_s, 0.0) + grace_s):
            raise ReadError(f"{self.name} did not finish within {timeout_s:.1f}s")
        if flight.error is not None:
            raise flight.error
        # value is T | None only until work returns: it has, without an error.
        return flight.value  # type: ignore[return-value]

    def _landed(self, flight: Flight[T]) -> None:
        with self._lock:
            if self._flight is flight:
                self._flight = None
