"""When a read is due: one value, made where the budget is known (Prometheus' scrape-timeout
header, ``--timeout``, a probe target's ``timeout``) and handed down unchanged to the commands
and files the read goes through, each of which asks only how long it has left."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, order=True, slots=True)
class Deadline:
    """A moment on the monotonic clock (``at``, as ``time.monotonic()``). Ordered by it:
    ``min(a, b)`` is the sooner of two deadlines."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """``seconds`` from now; a budget of 0 or less is a deadline already passed."""
        return cls(time.monotonic() + seconds)

    def within(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first (a source's own timeout)."""
        return min(self, Deadline.after(seconds))

    def left_s(self) -> float:
        """Seconds left until it is due; 0 once it has passed, never less."""
        return max(self.at - time.monotonic(), 0.0)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at
