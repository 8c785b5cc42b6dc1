"""One place that reports every way an email may not go out as promised.

Each report is logged at ERROR and says three things: what happened, the
consequence (which emails, the state they were left in, what will take them
and when) and the fix. ``scripts/check_durability_log_level.py`` checks that
every ``except`` around a durability-critical call either re-raises or comes
through here (or logs at ERROR itself).

An ongoing fault (the database is down, the SMTP server refuses connections)
is coalesced: one ERROR when it starts, repeats only counted, and one summary
when it ends, so an outage does not write a line per tick or per email.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def report(what: str, *, consequence: str, fix: str,
           exc: BaseException | None = None) -> None:
    """Log one degradation at ERROR with its consequence and fix."""
    logger.error("%s. Consequence: %s. Fix: %s.", what, consequence, fix,
                 exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


@dataclass
class _Ongoing:
    started: float
    repeats: int
    what: str


class FaultTracker:
    """Coalesces repeats of one ongoing fault into a start line and an end line.

    ``failing(fault, ...)`` logs at ERROR the first time a fault is seen and
    only counts later calls; ``recovered(fault)`` logs how long it lasted and
    how often it recurred, once, when it had been failing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ongoing: dict[str, _Ongoing] = {}

    def failing(self, fault: str, what: str, *, consequence: str, fix: str,
                exc: BaseException | None = None) -> bool:
        """Report ``fault``; returns True when this call logged (the fault is new)."""
        with self._lock:
            ongoing = self._ongoing.get(fault)
            if ongoing is not None:
                ongoing.repeats += 1
                return False
            self._ongoing[fault] = _Ongoing(time.monotonic(), 0, what)
        report(f"{what} (further occurrences are counted until it recovers)",
               consequence=consequence, fix=fix, exc=exc)
        return True

    def recovered(self, fault: str) -> None:
        """Close ``fault`` if it was ongoing, with one summary line."""
        with self._lock:
            ongoing = self._ongoing.pop(fault, None)
        if ongoing is not None:
            # Recovery is not a degradation: INFO, so alerting on ERROR stays meaningful.
            logger.info(
                "Recovered: %s; it lasted %.1f s and recurred %d more time(s). "
                "Rows left queued meanwhile are delivered by the normal route now.",
                ongoing.what, time.monotonic() - ongoing.started, ongoing.repeats,
            )
