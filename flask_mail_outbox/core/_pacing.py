"""How fast a worker goes: pure rules, each testable on a fake clock.

* :class:`IdleBackoff`: the gap before a dispatcher's next claim of due rows;
* :func:`inline_pause`: the pause before an in-process retry (inline mode);
* :class:`ReapSchedule`: which of a dispatcher's claims also reap.
"""

from __future__ import annotations

from . import _retry


def inline_backoff(retry: int) -> float:
    """Seconds before in-process retry number ``retry`` (1-based), capped near 2 s."""
    return float(min(2.0, 0.25 * 2 ** (retry - 1)))


def inline_pause(retry: int, *, throttled: bool, retry_after: float | None) -> float:
    """Seconds before in-process retry number ``retry`` of a transient failure.

    A throttling server asked for a pause: the row waits until it is due
    again (:data:`~._retry.THROTTLE_DELAY_SECONDS`), not a quarter of a
    second; a server that said when to come back (``retry_after``) is not
    tried sooner.
    """
    pause = _retry.THROTTLE_DELAY_SECONDS if throttled else inline_backoff(retry)
    return max(pause, retry_after or 0.0)


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
