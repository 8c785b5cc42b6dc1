"""Driving a worker's loop by hand: tests, and ``flask outbox worker --once``.

:class:`HandTicked` is the part of :class:`~._worker.Worker` that runs its
rounds in the caller's thread instead of the loop's: one round and its
results (:meth:`HandTicked.tick`), or rounds until nothing is due
(:meth:`HandTicked.drain`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._store import ClaimedEmail


class HandTicked:
    """:meth:`tick` and :meth:`drain` over a worker's :meth:`step` (a mixin of Worker)."""

    _cond: threading.Condition
    _woken: bool
    _handed: dict[int, None]
    _in_flight: dict[int, ClaimedEmail]
    _results: list[Any]
    _next_claim: float
    dispatching: bool
    last_claim_at: float | None
    last_claimed: int
    finished: int

    def step(self) -> None:
        raise NotImplementedError

    def _record(self) -> None:
        raise NotImplementedError

    def _release_paced(self) -> float | None:
        """Send the rows whose rate slot has come; when the next one comes (None: none)."""
        raise NotImplementedError

    def tick(self, timeout: float = 60.0) -> float:
        """One round now, whatever the poll gap: claim, send, wait for every result, record.

        For loops ticked by hand (tests): returns the seconds the loop would
        wait before its next round (0.0 when handed ids are waiting, such as
        the next emails of keys this round handed on).
        """
        with self._cond:
            self._woken = self.dispatching
        self.step()
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._in_flight or time.monotonic() >= deadline:
                    break
                self._cond.wait(0.05)
            self._release_paced()  # rows waiting for a rate slot are in flight too
        self._record()
        if self._handed or not self.dispatching or self.last_claim_at is None:
            return 0.0
        return max(0.0, self._next_claim - self.last_claim_at)

    def drain(self, timeout: float = 3600.0) -> int:
        """Rounds until nothing is in flight or due now (hand-ticked loops, ``--once``).

        Returns how many rows it finished (sent, failed, queued again, given back).
        """
        deadline = time.monotonic() + timeout
        before = self.finished
        while time.monotonic() < deadline:
            with self._cond:
                self._woken = self.dispatching  # claim whenever there is room
            self.step()
            if not self._wait_for_results(deadline):
                with self._cond:
                    if not (self._handed or (self.dispatching and self.last_claimed)):
                        break
        return self.finished - before

    def _wait_for_results(self, deadline: float) -> bool:
        """Wait for the results of what is in flight; False when nothing is."""
        while True:
            slot = self._release_paced()  # rows waiting for a rate slot are in flight too
            with self._cond:
                if not self._in_flight or self._results:
                    return bool(self._in_flight or self._results)
                wait = min(0.5, max(0.0, deadline - time.monotonic()))
                if slot is not None:
                    wait = min(wait, max(0.001, slot - time.monotonic()))
                if not self._cond.wait(wait) and time.monotonic() >= deadline:
                    return False

