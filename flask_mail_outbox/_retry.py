"""The retry policy: a pure function from (attempt, error) to a decision.

No database, no clock: the caller turns ``Decision.delay`` into a due time.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from ._errors import PermanentError, TransientError, TransportError

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


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with ±``jitter`` uniform jitter, capped, then dead-letter."""

    base_seconds: float
    max_seconds: float
    max_attempts: int
    jitter: float = 0.2
    rand: Callable[[], float] = random.random

    def delay(self, attempt: int) -> float:
        """Seconds before retrying after failed attempt number ``attempt`` (1-based)."""
        exponent = max(0, attempt - 1)
        # Cap the exponent too, so 2**exponent never overflows a float.
        raw = self.base_seconds * 2.0 ** min(exponent, 62)
        capped = min(self.max_seconds, raw)
        return capped * (1.0 + self.jitter * (2.0 * self.rand() - 1.0))

    def decide(self, attempt: int, error: TransportError) -> Decision:
        """The fate of a row whose attempt number ``attempt`` failed with ``error``."""
        if isinstance(error, PermanentError):
            return Decision(dead=True)
        if isinstance(error, TransientError) and error.throttled:
            # The server asked us to slow down: not the message's fault.
            return Decision(dead=False, delay=THROTTLE_DELAY_SECONDS, charge=False)
        if attempt >= self.max_attempts:
            return Decision(dead=True)
        return Decision(dead=False, delay=self.delay(attempt))
