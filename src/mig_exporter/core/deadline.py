"""When a read is due: one value, made where the budget is known (Prometheus' scrape-timeout
header, ``--timeout``, a probe target's ``timeout``) and handed down unchanged to the commands
and files the read goes through, each of which asks only how long it has left."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# Two deadlines this close are one: the same budget, taken by the caller and again by the shared
# read a few microseconds (a busy machine: milliseconds) apart.
SAME_S = 0.05


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

    def at_least(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes later (a shared read's limit,
        which no caller's sooner deadline cuts short). A deadline within ``SAME_S`` of it is
        kept as it is: it is that same limit, taken a moment earlier by the caller."""
        limit = Deadline.after(seconds)
        return limit if limit.at - self.at > SAME_S else self

    def left_s(self) -> float:
        """Seconds left until it is due; 0 once it has passed, never less."""
        return max(self.at - time.monotonic(), 0.0)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at


# The least a client's own deadline (Prometheus' scrape-timeout header) may ask for. Below it a
# header is no scrape timeout Prometheus sends (its least is 1s by default config and promtool
# refuses less in practice) but a way to cut reads short: clamped up to it, and counted.
MIN_HEADER_S = 1.0
# The least budget left for a read once the header's offset is taken off (an offset as large as
# the header itself would leave nothing).
MIN_BUDGET_S = 0.1


def client_budget(limit_s: float, header: str | None, offset_s: float) -> tuple[float, bool]:
    """A request's budget in seconds, and whether its header was clamped: ``limit_s`` (the
    server's own limit), or Prometheus' scrape timeout (``header``) less ``offset_s`` when that
    is sooner, so the answer arrives before Prometheus gives up. A header below ``MIN_HEADER_S``
    or not a positive number (``0``, ``-5``, ``nan``, ``-inf``, ``abc``) counts as
    ``MIN_HEADER_S``, and is reported as clamped; ``inf`` asks for no limit but the server's.
    The budget is this request's alone: the read it shares runs under the server's limit
    (``core/flight.py``)."""
    if not header:
        return limit_s, False
    try:
        asked = float(header)
    except ValueError:
        asked = math.nan
    if asked == math.inf:  # no limit of the client's own: the server's
        return limit_s, False
    clamped = not (math.isfinite(asked) and asked >= MIN_HEADER_S)
    if clamped:
        asked = MIN_HEADER_S
    return min(limit_s, max(asked - offset_s, MIN_BUDGET_S)), clamped
