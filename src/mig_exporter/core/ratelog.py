"""Log lines limited per reason: a flood of bad requests writes a few lines and a count,
not megabytes.

Each reason (a key such as the status and the refusal's text) may log ``burst`` lines
per window; the lines past that are counted, and when the window ends one line says
"N more like this in the last 10 s". Distinct keys are capped too, so varying the
request (another user name, another path) does not get around it: past the cap, the
lines of new keys are counted under one key per logger and level.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

DEFAULT_WINDOW_S = 10.0
DEFAULT_BURST = 3
DEFAULT_MAX_KEYS = 64


class _Reason:
    __slots__ = ("example", "level", "logged", "suppressed")

    def __init__(self, level: int) -> None:
        self.level = level
        self.logged = 0
        self.suppressed = 0
        self.example = ""


class RateLimitedLog:
    """``log(key, level, msg, *args)``: as ``logger.log``, at most ``burst`` lines per key and window."""

    def __init__(self, logger: logging.Logger, *, window_s: float = DEFAULT_WINDOW_S, burst: int = DEFAULT_BURST,
                 max_keys: int = DEFAULT_MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.window_s = window_s
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._reasons: dict[Hashable, _Reason] = {}

    def log(self, key: Hashable, level: int, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        self.flush()
        with self._lock:
            reason = self._reasons.get(key)
            if reason is None:
                if len(self._reasons) >= self.max_keys:
                    key = ("other reasons", level)
                    reason = self._reasons.get(key)
                if reason is None:
                    reason = self._reasons[key] = _Reason(level)
            if reason.logged < self.burst:
                reason.logged += 1
                emit = True
            else:
                reason.suppressed += 1
                if not reason.example:
                    reason.example = msg % args if args else msg
                emit = False
        if emit:
            self.logger.log(level, msg, *args)

    def flush(self) -> None:
        """End the window if its time is up: one line per reason that had lines held back."""
        now = self._clock()
        with self._lock:
            if now - self._window_start < self.window_s:
                return
            held = [r for r in self._reasons.values() if r.suppressed]
            self._reasons = {}
            self._window_start = now
        for r in held:
            self.logger.log(r.level, "%d more like this in the last %gs: %s", r.suppressed, self.window_s, r.example)
