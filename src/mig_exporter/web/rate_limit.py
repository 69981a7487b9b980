"""``rate_limit`` of the web config file: its settings, checked, and the token bucket that holds
requests to them (429 beyond it, before authentication)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mig_exporter.config.checks import duration, kind, mapping

WHERE = "rate_limit"
RATE_LIMIT_KEYS = ("interval", "burst")


class TokenBucket:
    """``rate_limit``: one request per ``interval_s``, bursts of ``burst``."""

    def __init__(self, interval_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.interval_s)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


def rate_limit(value: Any, errors: list[str]) -> TokenBucket | None:
    """``rate_limit`` checked: its bucket, or None when there is no limit (interval 0, the default)."""
    found = len(errors)
    value = mapping(value, WHERE, "a mapping with interval and burst", errors, RATE_LIMIT_KEYS)
    if value is None:
        return None
    seconds = _interval_s(value.get("interval", "0s"), errors)
    burst = value.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        number = isinstance(burst, (int, float)) and not isinstance(burst, bool)
        errors.append(f"{WHERE}.burst: must be a whole number, 0 or more, not {burst if number else kind(burst)}")
    elif seconds > 0 and burst < 1:
        errors.append(f"{WHERE}.burst: must be at least 1 when interval is set (0 would refuse every request)")
    if len(errors) > found or seconds <= 0:
        return None
    return TokenBucket(seconds, burst)


def _interval_s(value: object, errors: list[str]) -> float:
    """``interval``: a duration; 0 (bare, or 0s) is no limit."""
    if isinstance(value, str):
        value = value.strip()
    if value == "0" or (type(value) is int and value == 0):
        return 0.0
    return duration(value, f"{WHERE}.interval", errors) or 0.0
