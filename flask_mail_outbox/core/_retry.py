"""The retry policy: a pure function from (attempt, error) to a decision.

No database, no clock: the caller turns ``Decision.delay`` into a due time.

Nothing is retried without bound. A transient failure charges an attempt and
waits ``min(max, base * 2**(attempt-1))`` seconds (±20 %); the attempt
numbered ``max_attempts`` dead-letters the row. A throttled reply (the server
says this client is too fast) gives its attempt back and waits
:data:`THROTTLE_DELAY_SECONDS`, but only ``max_throttle_deferrals`` times per
row: past that a throttled reply is an ordinary transient failure.
:func:`schedule` and :func:`longest_unfinished` turn a configuration into the
documented table and bound.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from .._errors import PermanentError, TransientError, TransportError

#: How long a throttled row waits before it is due again (its attempt is given back).
THROTTLE_DELAY_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with a failed attempt.

    ``dead`` rows become ``failed``; the others are due again after
    ``delay`` seconds, with their attempt given back when ``charge`` is False.
    """

    dead: bool
    delay: float = 0.0
    charge: bool = True

    @property
    def deferral(self) -> bool:
        """A throttle deferral: due again without spending an attempt."""
        return not self.dead and not self.charge


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with ±``jitter`` uniform jitter, capped, then dead-letter."""

    base_seconds: float
    max_seconds: float
    max_attempts: int
    max_throttle_deferrals: int = 10
    jitter: float = 0.2
    rand: Callable[[], float] = random.random

    def delay(self, attempt: int) -> float:
        """Seconds before retrying after failed attempt number ``attempt`` (1-based)."""
        exponent = max(0, attempt - 1)
        # Cap the exponent too, so 2**exponent never overflows a float.
        raw = self.base_seconds * 2.0 ** min(exponent, 62)
        capped = min(self.max_seconds, raw)
        return capped * (1.0 + self.jitter * (2.0 * self.rand() - 1.0))

    def decide(self, attempt: int, error: TransportError, *, deferrals: int = 0) -> Decision:
        """The fate of a row whose attempt number ``attempt`` failed with ``error``.

        ``deferrals``: how many throttle deferrals the row has had already.
        """
        if isinstance(error, PermanentError):
            return Decision(dead=True)
        if (isinstance(error, TransientError) and error.throttled
                and deferrals < self.max_throttle_deferrals):
            # The server asked us to slow down: not the message's fault.
            return Decision(dead=False, delay=THROTTLE_DELAY_SECONDS, charge=False)
        if attempt >= self.max_attempts:
            return Decision(dead=True)
        return Decision(dead=False, delay=self.delay(attempt))


@dataclasses.dataclass(frozen=True)
class Step:
    """One row of the retry schedule: after failed attempt ``attempt``, wait ``delay``."""

    attempt: int
    delay: float
    elapsed: float


def schedule(base_seconds: float, max_seconds: float, max_attempts: int) -> list[Step]:
    """The retry schedule without jitter: attempt -> delay -> time since the first attempt.

    ``elapsed`` is when the next attempt starts (the last row's is when the
    last attempt starts, after which the row is ``sent`` or ``failed``).
    """
    policy = RetryPolicy(base_seconds, max_seconds, max_attempts, jitter=0.0)
    steps: list[Step] = []
    elapsed = 0.0
    for attempt in range(1, max_attempts):
        delay = policy.delay(attempt)
        elapsed += delay
        steps.append(Step(attempt, delay, elapsed))
    return steps


def longest_unfinished(*, base_seconds: float, max_seconds: float, max_attempts: int,
                       max_throttle_deferrals: int, lease_seconds: float,
                       pickup_seconds: float, send_seconds: float = 0.0,
                       jitter: float = 0.2) -> float:
    """The longest an email can stay unfinished (queued or sending) once it is due.

    Each wait at its worst: ``pickup_seconds`` before anything takes a due
    row (a dispatcher's longest idle wait, or the inline sweep's interval);
    between two attempts, the longer of a transient failure's backoff with
    its jitter at the top and a lost lease (the lease runs out, a reap comes,
    then a claim); each throttle deferral's delay; and after the last attempt,
    a lost lease that the reap dead-letters. ``send_seconds`` is what one SMTP
    conversation may take (each operation is bounded by ``MAIL_TIMEOUT``);
    the documented figures leave it at 0, as they leave out waiting behind a
    backlog deeper than one batch.
    """
    policy = RetryPolicy(base_seconds, max_seconds, max_attempts, jitter=0.0)
    lost_lease = lease_seconds + 2 * pickup_seconds
    between = sum(max(policy.delay(a) * (1 + jitter) + pickup_seconds, lost_lease)
                  for a in range(1, max_attempts))
    throttled = max_throttle_deferrals * (THROTTLE_DELAY_SECONDS + pickup_seconds)
    sends = (max_attempts + max_throttle_deferrals) * send_seconds
    return pickup_seconds + between + throttled + lease_seconds + pickup_seconds + sends


def human_seconds(seconds: float) -> str:
    """A duration as a person reads it: ``"45 s"``, ``"7 min"``, ``"1.1 h"``."""
    if seconds < 60:
        return f"{round(seconds, 1):g} s"
    if seconds < 3600:
        return f"{round(seconds / 60, 1):g} min"
    return f"{round(seconds / 3600, 1):g} h"
