"""What a worker was given and has not claimed yet, each deadline on one clock.

Ids wait in a worker's :class:`Intake` in three ways before its claim takes them:

* **handed**: due now (a commit queued them, a recorded outcome made them
  their key's holder), in order, the urgent ones (``priority="high"``) first;
* **scheduled**: committed with a ``send_after``, each due at its time;
* **retries**: inline mode's in-process retries, each due after its pause.

:meth:`Intake.take` moves what is due into the handed ones and takes the
first of them; :meth:`Intake.next_deadline` says when the next one is due.
Every deadline is on the clock the intake is given (``time.monotonic`` in a
worker), so a test on a fake clock sees the exact sequence. Both queues held
in memory are bounded (:data:`MAX_HANDED`, :data:`MAX_SCHEDULED`): what does
not fit stays queued in the database, reported, for a sweep or a dispatcher.

An intake takes no lock: its worker's lock guards it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .. import _degrade

#: Ids waiting in memory at most; past it, hand-overs fall back to the sweep.
MAX_HANDED = 20_000
#: Scheduled ids (``send_after``) timed in memory at most; past it, the sweep
#: takes the others when they are due.
MAX_SCHEDULED = 20_000
#: What takes a scheduled email once due when no worker times it.
TAKEN_LATER = ("the periodic sweep of any process takes them (inline mode, up to "
               "OUTBOX_SWEEP_INTERVAL_SECONDS late; they are not held to the age gate), or "
               "a dispatcher's next claim (durable mode)")


class Intake:
    """The handed, scheduled and retried ids of one worker (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], faults: _degrade.FaultTracker) -> None:
        self.clock = clock
        self.faults = faults
        self._handed: dict[int, None] = {}  # an ordered set
        self._scheduled: list[tuple[float, int]] = []  # a heap of (due, id)
        self._retries: dict[int, tuple[float, int]] = {}  # id -> (due, retry number)
        #: Ids taken off :attr:`_retries` and not settled yet -> their retry number.
        self._retry_numbers: dict[int, int] = {}

    # -- what comes in --------------------------------------------------------------

    def hand(self, ids: Sequence[int], urgent: Collection[int] = ()) -> None:
        """Ids due now, after those waiting; those in ``urgent`` before them all.

        Past :data:`MAX_HANDED` waiting, the rest are not kept (reported: they
        stay queued for a sweep or a dispatcher).
        """
        room = MAX_HANDED - len(self._handed)
        if room < len(ids):
            self.faults.failing(
                "inline-overflow",
                f"The delivery queue of this process is full ({MAX_HANDED} emails waiting)",
                consequence=f"{len(ids) - max(room, 0)} committed email(s) (and further "
                            "ones until it drains) are not handed over; they stay queued "
                            "and a sweep or a dispatcher delivers them later",
                fix="the SMTP server is slower than the rate of email; check it, or "
                    "switch to durable mode and run `flask outbox worker` processes")
            ids = ids[:max(room, 0)]
        elif not self._handed:
            self.faults.recovered("inline-overflow")
        first = [i for i in ids if i in urgent] if urgent else []
        if first:
            self._handed = {**dict.fromkeys(first), **self._handed}
        self._handed.update(dict.fromkeys(ids))

    def fitting(self, ids: Sequence[int]) -> Sequence[int]:
        """The first of ``ids`` there is room to schedule (the rest reported, left to a sweep)."""
        room = MAX_SCHEDULED - len(self._scheduled)
        if room >= len(ids):
            self.faults.recovered("scheduled-overflow")
            return ids
        self.faults.failing(
            "scheduled-overflow",
            f"This process already times {MAX_SCHEDULED} emails sent with send_after",
            consequence=f"{len(ids) - max(room, 0)} more (and further ones until some "
                        "are sent) are not timed here; they stay queued, and once due "
                        f"{TAKEN_LATER}",
            fix="nothing is lost; to have every one sent on time, schedule fewer at "
                "once from one process, or spread them over more processes")
        return ids[:max(room, 0)]

    def schedule(self, due_in: Iterable[tuple[int, float]]) -> None:
        """Ids each due in so many seconds from now (``send_after``)."""
        now = self.clock()
        for email_id, seconds in due_in:
            heapq.heappush(self._scheduled, (now + max(0.0, seconds), email_id))

    def retry(self, email_id: int, pause: Callable[[int], float]) -> None:
        """Hand ``email_id`` again once ``pause(number)`` seconds have passed.

        ``number``: which in-process retry of it this is (1 for the first).
        """
        number = self._retry_numbers.pop(email_id, 0) + 1
        self._retries[email_id] = (self.clock() + pause(number), number)

    # -- what goes out --------------------------------------------------------------

    def take(self, room: int) -> list[int]:
        """Up to ``room`` ids to claim now: the handed ones, with what came due first."""
        now = self.clock()
        for email_id, (due, number) in list(self._retries.items()):
            if due <= now:
                del self._retries[email_id]
                self._handed[email_id] = None
                self._retry_numbers[email_id] = number
        while self._scheduled and self._scheduled[0][0] <= now:
            self._handed[heapq.heappop(self._scheduled)[1]] = None
        ids = list(itertools.islice(self._handed, room))
        for email_id in ids:
            del self._handed[email_id]
        return ids

    def next_deadline(self) -> float | None:
        """When an id is next due: now while one is handed; None when none waits."""
        if self._handed:
            return self.clock()
        due = [due for due, _ in self._retries.values()]
        if self._scheduled:
            due.append(self._scheduled[0][0])
        return min(due, default=None)

    def retries_done(self, email_id: int) -> int:
        """The in-process retries ``email_id`` had (0 if none), as far as this intake knows."""
        return self._retry_numbers.get(email_id, 0)

    def settled(self, ids: Iterable[int]) -> None:
        """Ids claimed and finished (or given up): their retry count is dropped."""
        for email_id in ids:
            self._retry_numbers.pop(email_id, None)

    def clear(self) -> list[int]:
        """Drop everything waiting (the worker stops); the handed and retried ids.

        The scheduled ones are marked so in the database already: any sweep
        takes them when due.
        """
        ids = [*self._handed, *self._retries]
        self._handed.clear()
        self._retries.clear()
        self._scheduled.clear()
        return ids

    # -- what it holds --------------------------------------------------------------

    @property
    def handed(self) -> int:
        """How many ids are due now."""
        return len(self._handed)

    def in_hand(self) -> bool:
        """Whether an id is handed, waits for an in-process retry, or is scheduled and due.

        (A scheduled id due later is not work in hand.)
        """
        return bool(self._handed or self._retries) or (
            bool(self._scheduled) and self._scheduled[0][0] <= self.clock())
