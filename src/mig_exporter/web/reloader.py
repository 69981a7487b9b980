"""One reloader per file: reads it off the event loop and off the scrape pool, one read at a time.

A config path can block whoever opens it: a FIFO (``checks.read_file`` refuses one at once,
but a hung NFS mount or a FUSE file does not give up so easily). So no request thread and no
event loop reads a config file itself: each asks its file's ``Reloader``, which runs the read
in a thread of its own, at most one at a time. Requests that arrive while a read runs are
coalesced into the one read after it (it sees every change they asked about), and at most
``MAX_WAITERS`` of them wait for it: 80 ``POST /-/reload`` cost two pool threads, not 80.
A read past its deadline is "stuck": nobody waits for it, and ``stuck()`` says so for
``/-/ready``. The read itself cannot be interrupted (a thread blocked in ``open`` stays there);
it only stops costing anyone else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("mig_exporter.web")

# Request threads that may wait for a read at once; the others are answered at once (their
# request still runs, coalesced into the next read).
MAX_WAITERS = 2


class Reloader(Generic[T]):
    """Runs ``work`` (which reads the file and applies it, and never raises) on request."""

    def __init__(self, name: str, work: Callable[[], T], deadline_s: float) -> None:
        self.name = name
        self.work = work
        self.deadline_s = deadline_s
        self._cond = threading.Condition()
        self._requested = 0  # requests so far, numbered; a read started after request n covers it
        self._done = 0  # the highest request a finished read covers
        self._result: T | None = None
        self._started_at: float | None = None  # when the read in progress began; None: none runs
        self._thread: threading.Thread | None = None
        self._waiters = 0

    def request(self, wait_s: float = 0.0, *, only_if_idle: bool = False) -> T | None:
        """Ask for a read that starts after this call, and wait up to ``wait_s`` for it: its
        result, or None when it has not finished by then (it still runs, later). A caller waits
        not at all while the read in progress is stuck, nor when ``MAX_WAITERS`` wait already;
        with ``only_if_idle``, not at all while any read is in progress."""
        with self._cond:
            self._requested += 1
            mine = self._requested
            if only_if_idle and self._thread is not None:
                wait_s = 0.0
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"reload {self.name}", daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()
            if wait_s <= 0 or self._stuck_for(time.monotonic()) is not None or self._waiters >= MAX_WAITERS:
                return None
            until = time.monotonic() + wait_s
            self._waiters += 1
            try:
                while self._done < mine:
                    left = until - time.monotonic()
                    if left <= 0 or self._stuck_for(time.monotonic()) is not None:
                        return None
                    self._cond.wait(left)
                return self._result
            finally:
                self._waiters -= 1

    def stuck(self) -> str | None:
        """Why the reloader is stuck (a read running past its deadline), or None."""
        with self._cond:
            ran = self._stuck_for(time.monotonic())
        if ran is None:
            return None
        return f"reading {self.name} has not finished after {ran:.0f}s (deadline {self.deadline_s:g}s)"

    def _stuck_for(self, now: float) -> float | None:
        if self._started_at is None or now - self._started_at <= self.deadline_s:
            return None
        return now - self._started_at

    def _run(self) -> None:
        """The reloader's thread: read while requests are outstanding, then end."""
        while True:
            with self._cond:
                if self._done >= self._requested:
                    self._thread = None
                    self._started_at = None
                    return
                covers = self._requested
                self._started_at = time.monotonic()
            result: T | None = None
            try:
                result = self.work()
            except Exception:  # work never raises; should it, the read is over and the next one runs
                log.exception("reading %s failed", self.name)
            with self._cond:
                self._done = covers
                self._result = result
                self._started_at = None
                self._cond.notify_all()
