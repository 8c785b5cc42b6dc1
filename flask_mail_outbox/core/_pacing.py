"""How fast a worker goes: pure rules, each testable on a fake clock.

* :class:`IdleBackoff`: the gap before a dispatcher's next claim of due rows;
* :class:`RateLimiter`: messages per second for one process, halved when the
  server says it sends too fast;
* :func:`pace`: a dispatcher's limiter after a record, started when the server
  says "too fast" and no rate was configured;
* :func:`inline_backoff`: the pause before an in-process retry (inline mode);
* :class:`ReapSchedule`: which of a dispatcher's claims also reap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import _degrade

if TYPE_CHECKING:
    from ._delivery import BatchReport
    from ._settings import OutboxConfig


def inline_backoff(retry: int) -> float:
    """Seconds before in-process retry number ``retry`` (1-based), capped near 2 s."""
    return float(min(2.0, 0.25 * 2 ** (retry - 1)))


#: Seconds between reaps while every claim finds work (see :class:`ReapSchedule`).
BUSY_REAP_INTERVAL = 1.0


class ReapSchedule:
    """Whether a dispatcher's claim also reaps expired leases.

    A claim after one that found nothing (or failed) always does, and so does
    the first. While claims keep finding work, only the first claim at least
    :data:`BUSY_REAP_INTERVAL` seconds after the last reap does: a reap reads
    the index entries of every 'sending' row version since the last VACUUM.
    """

    def __init__(self) -> None:
        self._last = -float("inf")
        self._idle = True

    def due(self, now: float) -> bool:
        """Whether the claim about to run at ``now`` reaps (counted as a reap if so)."""
        if self._idle or now - self._last >= BUSY_REAP_INTERVAL:
            self._last = now
            return True
        return False

    def found(self, claimed: int) -> None:
        """How many rows the claim found (0 when it failed)."""
        self._idle = not claimed


class IdleBackoff:
    """The gap before a dispatcher's next claim, from what its last claim found."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._idle_gap = initial

    def after_claim(self, *, claimed: int, full: bool, failed: bool,
                    maximum: float | None = None) -> float:
        """Seconds from the start of the claim that just ended to the next one."""
        cap = self.maximum if maximum is None else maximum
        if failed or (claimed == 0 and not full):
            gap = min(self._idle_gap, cap)
            self._idle_gap = min(self._idle_gap * 2, cap)
            return gap
        self._idle_gap = self.initial
        # A full claim means more is waiting: go again as soon as there is room.
        return 0.0 if full else self.initial


class RateLimiter:
    """Messages per second for one process; slows down when the server throttles."""

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self.current = rate
        self.clock = clock
        self.sleep = sleep
        self._next_free = clock()

    def acquire(self, wanted: int) -> int:
        """Wait for the right to send up to ``wanted`` now; returns how many."""
        now = self.clock()
        if self._next_free > now:
            self.sleep(self._next_free - now)
            now = self._next_free
        # At most one second's worth per claim, at least one message.
        allowed = max(1, min(wanted, int(self.current)))
        self._next_free = now + allowed / self.current
        return allowed

    def feedback(self, *, throttled: bool) -> None:
        """Halve the rate when throttled; creep back up to the configured rate otherwise."""
        if throttled:
            self.current = max(self.rate / 64, self.current / 2)
        else:
            self.current = min(self.rate, self.current * 1.1)


def pace(limiter: RateLimiter | None, report: BatchReport, *, tried: int,
         config: OutboxConfig, clock: Callable[[], float]) -> RateLimiter | None:
    """The limiter after ``report``: throttled replies slow it down, others let it recover.

    With no configured rate, the first throttled reply starts one at half of what
    was tried, and feedback finds the server's pace from there.
    """
    throttled = sum(error.throttled for _, _, error in report.transient)
    if throttled and limiter is None:
        limiter = RateLimiter(float(config.batch_size) * 10, clock=clock)
        limiter.current = max(1.0, tried / 2)
        _degrade.report(
            f"The SMTP server is throttling this process ({throttled} "
            "email(s) refused with a reply that says it is sending too fast)",
            consequence="those emails are queued again, their attempt given back at most "
                        f"OUTBOX_MAX_THROTTLE_DEFERRALS ({config.max_throttle_deferrals}) "
                        "times each, and this process now paces itself below the "
                        "server's limit",
            fix="set OUTBOX_RATE_LIMIT to the rate your provider allows")
    if limiter is not None:
        limiter.feedback(throttled=throttled > 0)
    return limiter
