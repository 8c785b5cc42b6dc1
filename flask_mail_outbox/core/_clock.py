"""Time as the outbox stores it: naive UTC; and the one clock a test can move.

"Now" as SQL is each database's (:meth:`._dialect.Dialect.now`): the database
clock on PostgreSQL, so processes with skewed clocks agree on leases and ages;
on SQLite, one machine, this clock.

A :class:`TestClock` given to :class:`~._outbox.Outbox` replaces both of the
core's clocks (the wall clock of timestamps and the monotonic clock of the
worker's deadlines) with the real ones plus an offset that only grows; on
PostgreSQL "now" in SQL is then its value, bound, instead of the database's
(see :meth:`._dialect.Dialect.on_clock`). Without one, nothing changes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta


def utcnow() -> datetime:
    """The current time, naive UTC (how every timestamp is stored)."""
    return datetime.now(UTC).replace(tzinfo=None)


class TestClock:
    """The real clocks plus an offset a test moves forward (:meth:`advance`).

    :meth:`now` is ``utcnow()`` plus the offset (naive UTC), :meth:`monotonic`
    is ``time.monotonic()`` plus the offset in seconds, :meth:`wall` is
    ``time.time()`` plus it. Time keeps running as it does; it only jumps when
    told. The offset never goes back, so timestamps written before an advance
    stay in the past.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def on_advance(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each :meth:`advance` (a worker waiting for a
        deadline looks again: it may have come)."""
        with self._lock:
            self._listeners.append(listener)

    @property
    def offset(self) -> timedelta:
        """How far ahead of the real clocks this one is."""
        return timedelta(seconds=self._offset)

    def advance(self, seconds: float | timedelta) -> None:
        """Move the clock ``seconds`` forward (a float, or a timedelta).

        Raises :class:`ValueError` for a negative or non-finite amount (the
        outbox's clocks never go back), :class:`TypeError` for what is not a number.
        """
        amount = seconds.total_seconds() if isinstance(seconds, timedelta) else seconds
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise TypeError(f"TestClock.advance(seconds): expected seconds (a number or a "
                             f"timedelta), got {type(seconds).__name__}")
        if not math.isfinite(amount) or amount < 0:
            raise ValueError(f"TestClock.advance(seconds): the clock only moves forward; got "
                             f"{seconds!r}")
        with self._lock:
            self._offset += float(amount)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def now(self) -> datetime:
        """The current time on this clock, naive UTC (as :func:`utcnow`)."""
        return utcnow() + timedelta(seconds=self._offset)

    def monotonic(self) -> float:
        """``time.monotonic()`` on this clock."""
        return time.monotonic() + self._offset

    def wall(self) -> float:
        """``time.time()`` on this clock (seconds since the epoch)."""
        return time.time() + self._offset

    def __repr__(self) -> str:
        return f"TestClock(offset={self.offset!s})"
