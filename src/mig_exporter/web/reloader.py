"""One reloader per file: reads it off the event loop and off the scrape pool, one read at a time.

A config path can block whoever opens it: a FIFO (``checks.read_file`` refuses one at once,
but a hung NFS mount or a FUSE file does not give up so easily). So no request thread and no
event loop reads a config file itself: each asks its file's ``Reloader``, whose one thread runs
the reads, at most one at a time, and stays for the next request (it ends after ``IDLE_S``
with nothing to read). Requests that arrive while a read runs are coalesced into the one read
after it, which sees every change they asked about.

Waiting for the outcome is bounded by the read's health, not by the number of callers: any
number of callers wait for a read that goes well (a config file reads in milliseconds), so 20
``POST /-/reload`` at once all get its outcome. Once the read in progress has run
``SHORT_WAIT_S``, only the first ``MAX_WAITERS`` callers still wait (up to the read's
deadline); the others are answered that it has not finished (it still covers them). So 80
``POST /-/reload`` against a hung mount cost the pool a quarter of a second, then two threads.
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

# Callers that may wait for a slow read up to its deadline; the others stop waiting once the
# read in progress has run SHORT_WAIT_S (their request still runs, coalesced into the next read).
MAX_WAITERS = 2
SHORT_WAIT_S = 0.25
# The reloader's thread ends after this long with nothing to read; the next request starts one.
IDLE_S = 60.0


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
        self._start_error: str | None = None  # why the thread could not start, until one does
        self._waiters = 0  # callers waiting up to the deadline (at most MAX_WAITERS)

    def request(self, wait_s: float | None = 0.0) -> T | None:
        """Ask for a read that starts after this call, and wait up to ``wait_s`` for it (None:
        until it ends or is stuck): its result, or None when it has not finished by then (it
        still runs, later). A caller waits not at all while the read in progress is stuck;
        beyond ``MAX_WAITERS`` callers, only while the read in progress has run less than
        ``SHORT_WAIT_S``. None at once, too, when no thread can be started to read (``stuck()``
        says so; the next request tries again)."""
        with self._cond:
            self._requested += 1
            mine = self._requested
            if not self._started():
                return None
            self._cond.notify_all()
            now = time.monotonic()
            if (wait_s is not None and wait_s <= 0) or self._stuck_for(now) is not None:
                return None
            # None: as long as the reads take, the one in progress and this one, each of which
            # ends or is stuck within its deadline; the bound is only a backstop.
            until = now + (wait_s if wait_s is not None else 2 * self.deadline_s + 1)
            patient = self._waiters < MAX_WAITERS
            if patient:
                self._waiters += 1
            try:
                while self._done < mine:
                    now = time.monotonic()
                    left = until - now
                    if left <= 0 or self._stuck_for(now) is not None:
                        return None
                    # Awake when the read in progress turns stuck (a read's start notifies).
                    ran = 0.0 if self._started_at is None else now - self._started_at
                    left = min(left, self.deadline_s - ran + 0.01)
                    if not patient:
                        if ran >= SHORT_WAIT_S:
                            return None
                        left = min(left, SHORT_WAIT_S - ran)
                    self._cond.wait(left)
                return self._result
            finally:
                if patient:
                    self._waiters -= 1

    def stuck(self) -> str | None:
        """Why the reloader is stuck (a read running past its deadline, or no thread to read
        in), or None."""
        with self._cond:
            ran = self._stuck_for(time.monotonic())
            start_error = self._start_error
        if start_error is not None:
            return start_error
        if ran is None:
            return None
        return f"reading {self.name} has not finished after {ran:.0f}s (deadline {self.deadline_s:g}s)"

    def _started(self) -> bool:
        """Under the lock: whether the reloader's thread runs, started now if it did not. A
        thread that cannot start (``can't start new thread`` at a pids limit) is logged once
        until one does, and leaves no trace that would stop the next request from trying."""
        if self._thread is not None:
            return True
        thread = threading.Thread(target=self._run, name=f"reload {self.name}", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:
            if self._start_error is None:
                log.warning("cannot start a thread to read %s: %s; the next request tries again", self.name, e)
            self._start_error = f"cannot start a thread to read {self.name}: {e}"
            return False
        self._thread = thread
        self._start_error = None
        return True

    def _stuck_for(self, now: float) -> float | None:
        if self._started_at is None or now - self._started_at <= self.deadline_s:
            return None
        return now - self._started_at

    def _run(self) -> None:
        """The reloader's thread: read while requests are outstanding; end after ``IDLE_S``
        with none."""
        while True:
            with self._cond:
                idle_until = time.monotonic() + IDLE_S
                while self._done >= self._requested:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._thread = None
                        return
                    self._cond.wait(left)
                covers = self._requested
                self._started_at = time.monotonic()
                self._cond.notify_all()  # callers waiting for it count its time from now
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
