"""Daemon threads kept for the next call: starting a thread costs about a millisecond of a
2-core machine, and a scrape used to start two.

A call runs in an idle worker when there is one, else in a new thread, so a call hung for good
(an NVML call in the driver, a /proc read blocked on a dying process) holds its own thread and
never a queue: the calls after it still run at once. A worker idle for ``idle_s`` ends. Workers
are daemon threads: one hung in the driver never holds up the interpreter's exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("mig_exporter")

IDLE_NAME = "mig-exporter-idle"  # what an idle worker is called (a running one takes its call's name)


class Workers:
    """A pool of daemon threads that grows with the calls in flight and shrinks when idle;
    thread-safe."""

    def __init__(self, idle_s: float = 60.0) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._calls: deque[tuple[Callable[[], object], str]] = deque()
        self._idle = 0  # workers waiting for a call
        self._threads = 0  # workers alive

    @property
    def threads(self) -> int:
        """Workers alive, idle or running a call."""
        with self._lock:
            return self._threads

    def start(self, call: Callable[[], object], name: str) -> None:
        """Run ``call`` (which handles its own errors: what escapes it is logged) in a worker named ``name``
        while it runs. Raises what ``threading.Thread.start`` raises when a new thread is needed
        and cannot be started (a pids limit); nothing is left queued then."""
        with self._lock:
            if self._idle > len(self._calls):  # a waiting worker takes it
                self._calls.append((call, name))
                self._ready.notify()
                return
            self._threads += 1
        try:
            threading.Thread(target=self._work, args=(call,), name=name, daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def _work(self, call: Callable[[], object]) -> None:
        thread = threading.current_thread()
        while True:
            try:
                call()
            except BaseException:  # a bug in the call: the worker outlives it
                log.error("a call in the %s thread failed", thread.name, exc_info=True)
            thread.name = IDLE_NAME
            with self._lock:
                self._idle += 1
                until = time.monotonic() + self.idle_s
                while not self._calls:
                    left = until - time.monotonic()
                    if left <= 0:
                        self._idle -= 1
                        self._threads -= 1
                        return
                    self._ready.wait(left)
                self._idle -= 1
                call, thread.name = self._calls.popleft()


# The exporter's workers: the shared scrape and probe runs, NVML's read, /proc read alongside the GPU.
WORKERS = Workers()
