"""ONE delivery loop for both modes.

A :class:`Worker` runs in one daemon thread per app and process, and takes
work from two sources:

* ids handed to it (:meth:`Worker.hand`): the rows a commit queued, the
  emails a recorded outcome made their key's holder, (inline mode) its
  own in-process retries once their pause is over, and the rows a commit
  queued with a ``send_after`` once they are due (:meth:`Worker.schedule`),
  all waiting in its :class:`~._intake.Intake`;
* due rows it claims itself (:meth:`~._leases.Leases.claim_due`) when it is a
  *dispatcher* (durable mode, ``flask outbox worker``): at its poll, or at
  once when a commit or a NOTIFY wakes it.

Both go through the same compare-and-set claim, and into the long-lived
stream of each row's transport (a :class:`~._lanes.Lane` each, rate-limited
or not). At most a batch is claimed and unrecorded (:attr:`Worker.capacity`),
the next claim comes at :attr:`Worker.refill_at`, so the connections stay fed.
Results are recorded as they arrive, coalesced over :data:`RECORD_WINDOW` (a
killed process re-sends only what was in flight or came back in its last ms).

A dispatcher's claims follow :class:`~._pacing.IdleBackoff` (gaps measured
from the start of a claim; wakes during a round collapse into one claim).
Every deadline of the loop (a claim's, a retry's, a scheduled email's, a
paced row's slot, the record window) is on one injectable clock, so tests can
check the exact sequence; the timeouts a caller gives (:meth:`Worker.tick`,
:meth:`Worker.drain`, :meth:`Worker.wait_idle`) are real seconds. What a
stopping worker releases goes to its :class:`~._releases.Releases`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from ._database import KeptConnection
from ._delivery import (
    Attempt,
    BatchReport,
    Delivery,
    Expired,
    Overdue,
    Suppressed,
    Waiter,
    Waiters,
    expired,
    new_owner,
)
from ._intake import TAKEN_LATER, Intake
from ._lanes import Lanes
from ._leases import ClaimedEmail, Reaped
from ._pacing import IdleBackoff, ReapSchedule, inline_pause
from ._pause import Gate, Pauses

if TYPE_CHECKING:
    from .._errors import TransientError
    from ..transports import Envelope, Result
    from ._settings import OutboxConfig

logger = logging.getLogger(__name__)

#: Seconds the results that came back wait for more before they are recorded
#: (see :meth:`Unrecorded.record_in`): a record per result would cost a transaction each.
RECORD_WINDOW = 0.003
#: Seconds the loop waits at most before it looks again while a dispatcher (a
#: signal handler, the worker's SIGTERM, stops it without being able to
#: notify) or while ids wait for room.
POLL_SLICE = 0.5
#: Seconds past a lease's end at which a dispatcher waiting on NOTIFY claims (and reaps).
LEASE_WAKE_MARGIN = 0.05


class Unrecorded:
    """Results that came back and wait for their record, coalesced over :data:`RECORD_WINDOW`.

    Guarded by its worker's lock.
    """

    def __init__(self) -> None:
        self._results: list[tuple[ClaimedEmail, Attempt | None]] = []
        self._since = 0.0  # when the first of them came back

    def __len__(self) -> int:
        return len(self._results)

    def add(self, email: ClaimedEmail, result: Attempt | None, now: float) -> bool:
        """Keep ``email``'s result, come back at ``now``; whether it is the first waiting."""
        first = not self._results
        if first:
            self._since = now
        self._results.append((email, result))
        return first

    def take(self) -> list[tuple[ClaimedEmail, Attempt | None]]:
        """Every result waiting, to record now."""
        done, self._results = self._results, []
        return done

    def record_in(self, now: float, *, at_once: bool) -> float | None:
        """Seconds from ``now`` until they are recorded; None when none came back.

        They wait up to :data:`RECORD_WINDOW` for more (one record, one
        statement, for all that were sent), unless ``at_once``.
        """
        if not self._results:
            return None
        if at_once:
            return 0.0
        return self._since + RECORD_WINDOW - now


class Worker:
    """The delivery loop of one app in one process (see the module docstring)."""

    def __init__(self, delivery: Delivery, config: OutboxConfig, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.delivery = delivery
        self.store = delivery.store
        self.config = config
        self.policy = config.retry_policy()
        #: The loop's one clock: every deadline of the intake, the lanes and the
        #: claims is on it (they read it through this attribute, so a clock set
        #: later reaches them all).
        self.clock = clock

        def now() -> float:
            return self.clock()

        #: A lane per named transport: its stream, rate and paced rows (see _lanes).
        self.lanes = Lanes(self.store, config, delivery.transports, delivery.faults, now,
                           wall=wall)
        #: The transports paused by a fault of their own, as this process knows them.
        self.pauses = Pauses(self.store, config, delivery.faults, now)
        #: Rows claimed and not yet recorded, at most (a claim takes at most a batch).
        self.capacity = max(1, config.batch_size)
        #: Claim again once no more than this is in flight: half a batch (at
        #: least a message on each connection and one waiting for it), so the
        #: connections stay fed while the claim runs, and a claim takes many
        #: rows, not one per result.
        self.refill_at = min(self.capacity - 1, max(2 * self.lanes.concurrency,
                                                          self.capacity // 2))
        #: Claims due rows itself (durable mode): see :meth:`dispatch`.
        self.dispatching = False
        self.backoff = IdleBackoff(config.poll_interval, config.poll_max_interval)
        self.listening = False  # set by the LISTEN thread while its connection is up
        self._cond = threading.Condition()
        #: What waits to be claimed: handed ids, scheduled ones, in-process retries.
        self.intake = Intake(now, delivery.faults)
        #: The stopping flag, and what this process releases when it stops.
        self.releases = delivery.releases
        self._waiters = Waiters()
        self._in_flight: dict[int, ClaimedEmail] = {}
        #: Results that came back, waiting for their record.
        self._results = Unrecorded()
        self._woken = False
        #: Whether the last lookup of the earliest lease found one (see _lease_runs_out).
        self._leases_seen = True
        self._busy = False  # in a round (between taking work and putting or recording it)
        #: Never starts a thread: a test or ``flask outbox worker --once`` calls
        #: :meth:`step` / :meth:`drain` itself.
        self.hand_ticked = False
        #: Inline mode retries a transient failure in this process a few times
        #: (``OUTBOX_INLINE_RETRIES``); False: it is recorded with its backoff at once
        #: (a task queue's task: nothing of it stays in memory when the task returns).
        self.retries_in_process = True
        # One caller at a time drains a hand-ticked worker in its own thread.
        self._drain_lock = threading.Lock()
        self.started = False  # whether the loop ever ran in this process
        self._thread: threading.Thread | None = None
        # Kept across rounds: the dispatcher's claims (autocommit on PostgreSQL),
        # and the records and the claims of handed ids (transactions).
        self._claims = KeptConnection(lambda: self.store.dispatch_connection(), doing="claiming")
        self._writes = KeptConnection(lambda: self.store.engine.connect(), doing="recording")
        self._next_claim = -float("inf")
        self.reaps = ReapSchedule()
        self.claims = 0
        #: Rows this worker finished (recorded one way or another), ever.
        self.finished = 0
        self.last_claimed = 0
        self.last_claim_failed = False
        self.last_claim_at: float | None = None

    # -- sources ------------------------------------------------------------------------

    def hand(self, ids: Sequence[int], *, urgent: Collection[int] = ()) -> None:
        """Deliver ``ids`` (committed, or handed a key) as soon as there is room.

        Those also in ``urgent`` (``priority="high"``) go before every id
        already waiting; the others after them. Once the worker stops, they
        are released (queued in the database, in flight nowhere).
        """
        if not ids:
            return
        with self._cond:
            if self.releases.stopping:
                self.releases.note(list(ids))
                return
            self.intake.hand(ids, urgent)
            self._cond.notify_all()
        self.start()

    def schedule(self, ids: Sequence[int]) -> None:
        """Deliver ``ids`` (committed, not due yet: ``send_after``) when each is due.

        Their due times are read here, in the committing thread, on the
        claim's clock (the database's on PostgreSQL), so the loop hands each
        over at its time: it goes out then, not at a later sweep. If this
        process stops first, they are queued and marked as scheduled in the
        database: the next sweep of any process takes them when due, whatever
        their age.
        """
        if not ids or self.releases.stopping:
            return
        with self._cond:
            ids = self.intake.fitting(ids)
        if not ids:
            return
        try:
            due_in = self.store.leases.due_in(ids)
        except Exception as exc:  # noqa: BLE001 - reported; the rows are marked for the sweep
            self.delivery.faults.failing(
                "scheduled", "Could not read the due times of emails sent with send_after",
                consequence=f"{len(ids)} such email(s) are not timed by this process; they "
                            f"stay queued, and once due {TAKEN_LATER}",
                fix="check the database connection and the outbox tables "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
            return
        self.delivery.faults.recovered("scheduled")
        with self._cond:
            if self.releases.stopping:
                return
            self.intake.schedule(due_in)
            self._cond.notify_all()
        self.start()

    def wake(self) -> None:
        """Claim due rows as soon as there is room (a commit, a NOTIFY)."""
        with self._cond:
            self._woken = True
            self.pauses.invalidate()  # a NOTIFY may say a paused transport is back
            self._cond.notify_all()

    def nudge(self) -> None:
        """Look at the deadlines again now (the loop's clock jumped: a test's clock)."""
        with self._cond:
            self._cond.notify_all()

    def dispatch(self) -> None:
        """Also claim due rows from now on (durable mode), and start the loop."""
        self.pauses.look()  # a transport paused before this process started: probe it too
        self.dispatching = True
        self.wake()
        self.start()

    def deliver(self, ids: Sequence[int], timeout: float, *,
                until_claimed: bool = False) -> BatchReport:
        """Hand ``ids`` over and wait (up to ``timeout``) for their first outcomes.

        The loop delivers them; a worker ticked by hand whose loop runs
        nowhere (a sweep beside a hand-ticked dispatcher) is drained in the
        caller's thread instead: the same claim, lanes and record either way.
        ``until_claimed``: return once each id is claimed (``report.claimed``)
        or found unclaimable; the loop sends and records the claimed ones
        after (a task queue's one-task-at-a-time worker: the next task's ids
        are claimed while these are on the wire).
        """
        waiter = Waiter(set(ids), until_claimed=until_claimed)
        if not waiter.ids:
            return waiter.report
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiters.add(waiter)
        self.hand(ids)
        try:
            # Ticked by hand (a task queue's threads): one thread drains at a time. While
            # another thread's drain takes these ids too, return as soon as they are
            # recorded, not when that drain ends (it may go on with other threads' ids).
            while self.hand_ticked and not self.running and not waiter.done.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if self._drain_lock.acquire(timeout=min(remaining, 0.05)):
                    try:
                        self.drain(max(0.0, deadline - time.monotonic()))
                    finally:
                        self._drain_lock.release()
                    break
            waiter.done.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with self._cond:
                self._waiters.discard(waiter)
        return waiter.report

    # -- ticked by hand (tests, `flask outbox worker --once`, the memory transport) ------

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
            self._send_paced()  # rows waiting for a rate slot are in flight too
        self._record()
        if self.intake.handed or not self.dispatching or self.last_claim_at is None:
            return 0.0
        return max(0.0, self._next_claim - self.last_claim_at)

    def drain(self, timeout: float = 3600.0, *, wait_for_slots: bool = True) -> int:
        """Rounds until nothing is in flight or due now (hand-ticked loops, ``--once``).

        Returns how many rows it finished (sent, failed, queued again, released).
        ``wait_for_slots=False``: rows of a rate-limited transport whose slot
        is still to come stay claimed, for a later drain (the test kit's
        ``deliver()``, whose clock moves only when the test moves it).
        """
        deadline = time.monotonic() + timeout
        before = self.finished
        while time.monotonic() < deadline:
            with self._cond:
                self._woken = self.dispatching  # claim whenever there is room
            self.step()
            if not self._wait_for_results(deadline, wait_for_slots=wait_for_slots):
                with self._cond:
                    if not (self.intake.handed or (self.dispatching and self.last_claimed)):
                        break
        return self.finished - before

    def _wait_for_results(self, deadline: float, *, wait_for_slots: bool = True) -> bool:
        """Wait for the results of what is in flight, or for ids handed meanwhile that
        there is room for; False when nothing is in flight (nor, without
        ``wait_for_slots``, anything but rows waiting for a rate slot to come)."""
        while True:
            slot = self._send_paced()  # rows waiting for a rate slot are in flight too
            with self._cond:
                if not self._in_flight or self._results:
                    return bool(self._in_flight or self._results)
                if self.intake.handed and len(self._in_flight) <= self.refill_at \
                        and not self.releases.stopping:
                    # Ids handed meanwhile (another task's thread) and room for them: a
                    # round claims them now, not once what is on the wire came back.
                    return True
                if not wait_for_slots and slot is not None and \
                        len(self._in_flight) <= self.lanes.paced():
                    return False
                wait = min(0.5, max(0.0, deadline - time.monotonic()))
                if slot is not None:
                    wait = min(wait, max(0.001, slot - self.clock()))
                if not self._cond.wait(wait) and time.monotonic() >= deadline:
                    return False

    # -- control ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run the loop in a daemon thread (idempotent; a stopped worker stays stopped)."""
        with self._cond:
            if self.releases.stopping or self.running or self.hand_ticked:
                return
            self.started = True
            self._thread = threading.Thread(target=self.run, name="outbox-worker",
                                            daemon=True)
            self._thread.start()
        if self.dispatching:
            logger.info("Outbox dispatcher started (pid %d)", os.getpid())

    def idle(self) -> bool:
        """Nothing handed, claimed, waiting for a retry or to be recorded, nor
        scheduled and due (one due later is not work in hand)."""
        with self._cond:
            claiming = self._woken or self.last_claim_failed or (
                self.dispatching and bool(self.last_claimed))
            return not (self._busy or claiming or self.intake.in_hand() or self._in_flight
                        or self._results)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until :meth:`idle`; True when it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.idle():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.running:
                    return self.idle()
                self._cond.wait(min(remaining, 0.5))
            return True

    def request_stop(self) -> None:
        """Stop claiming (safe from a signal handler: takes no lock)."""
        self.releases.stop()

    def stop(self, timeout: float) -> None:
        """Stop claiming; give what is in flight ``timeout`` seconds, release the rest."""
        self.releases.stop()
        with self._cond:
            # Handed over (or waiting for an in-process retry) and not claimed:
            # queued in the database and in flight nowhere. Scheduled ones are
            # marked so in the database: any sweep takes them when due.
            released = self.intake.clear()
            self.releases.note(released)
            self._settle(BatchReport(not_claimed=released))
            self._cond.notify_all()
            thread = self._thread
        self.cancel_unstarted()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if not self.running:
            # Ticked by hand, or the loop has ended: nothing else closes these.
            self._close()

    def cancel_unstarted(self) -> int:
        """Stop handing claimed messages to the server; they are released. How many."""
        never, paced = self.lanes.cancel()
        self._release(paced)
        return len(never) + len(paced)

    def in_flight(self) -> int:
        """Rows claimed and not yet recorded."""
        with self._cond:
            return len(self._in_flight) + len(self._results)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Loop until :meth:`stop` and every result is recorded (in the foreground too)."""
        with self._cond:
            current = threading.current_thread()
            if self.running and self._thread is not current:
                raise RuntimeError("this worker's loop already runs in another thread")
            self._thread = current
            self.started = True
        try:
            while True:
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - reported; the loop goes on
                    self.delivery.faults.failing(
                        "worker", "The outbox delivery loop hit an unexpected error",
                        consequence="it goes on with its next round; what it had claimed is "
                                    "sent and recorded, or taken again when its lease expires",
                        fix="report it with the traceback below", exc=exc)
                    time.sleep(0.5)
                with self._cond:
                    if self.releases.stopping and not (self._in_flight or self._results):
                        return
                self._wait()
        finally:
            self._close()

    def step(self) -> None:
        """One round: record what came back, then claim what there is room for."""
        with self._cond:
            self._busy = True
        try:
            self._record()
            if self.releases.stopping:  # rows waiting for a rate slot are released at once
                self._release(self.lanes.take_back())
                return
            self._send_paced()
            # Room for a claim up to the capacity, once no more than the refill point is out.
            in_flight = self.in_flight()
            room = self.capacity - in_flight if in_flight <= self.refill_at else 0
            if room > 0:
                room -= self._claim_handed(room)
            if room > 0 and self.dispatching:
                with self._cond:  # a wake while there was no room waits for room
                    woken, self._woken = self._woken, False
                if woken or self.clock() >= self._next_claim:
                    self._claim_due(room, woken=woken)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _wait(self) -> None:
        """Until the loop has a round to run (:meth:`_next_round_in`), or may end."""
        with self._cond:
            while not self.releases.stopping or self._in_flight:
                wait = self._next_round_in()
                if wait is not None and wait <= 0:
                    return
                self._cond.wait(None if wait is None else max(wait, 0.001))

    def _next_round_in(self) -> float | None:
        """Seconds until a round has work (0 or less: now); None: none until notified.

        The work: results to record once their window is over, a paced row
        whose slot came and, with room on the wire, an id of the intake or
        (a dispatcher) a claim that is due, or a wake.
        """
        due = _soonest(self.intake.next_deadline(),
                       self._next_claim if self.dispatching else None)
        now = self.clock()  # read after the deadlines: a handed id's is "now"
        # Room for a claim (see step()); what came back is recorded first, so only
        # what is on the wire counts.
        room = len(self._in_flight) <= self.refill_at
        waits = [self._results.record_in(now, at_once=self._record_at_once()),
                 _until(self.lanes.next_slot(), now)]
        if room:
            waits.append(0.0 if self.dispatching and self._woken else _until(due, now))
        if self.dispatching or (due is not None and not room):
            waits.append(POLL_SLICE)  # a look now and then (see POLL_SLICE)
        return _soonest(*waits)

    def _record_at_once(self) -> bool:
        """Whether what came back is recorded without waiting for more: the loop
        stops, nothing else is in flight, or half a batch came back."""
        return self.releases.stopping or not self._in_flight or \
            len(self._results) >= self.capacity // 2

    # -- claiming -----------------------------------------------------------------------

    def _claim_handed(self, room: int) -> int:
        with self._cond:
            ids = self.intake.take(room)
        if not ids:
            return 0
        claim_started = time.time_ns()  # the claim span's start (OUTBOX_OTEL)
        try:
            claimed = self._writes.run(lambda conn: self.store.leases.claim_ids(
                ids, owner=new_owner(), lease_seconds=self.config.lease_seconds, conn=conn))
            self.delivery.traced(claimed, claim_started)
        except Exception as exc:  # noqa: BLE001 - reported; the rows stay in the database
            self._settle(BatchReport(not_claimed=ids))
            self.delivery.faults.failing(
                "inline-drain", "Delivery could not claim emails handed over after commit",
                consequence=(f"{len(ids)} committed email(s) were not delivered by this "
                             "process; they stay queued and a sweep or a dispatcher takes "
                             "them later"),
                fix="check the database connection and the outbox tables "
                    "(`flask db upgrade outbox@head`); run `flask outbox sweep` once it is fixed",
                exc=exc)
            return 0
        self.delivery.faults.recovered("inline-drain")
        got = {email.id for email in claimed}
        with self._cond:
            self._waiters.claimed(list(got))
        self._settle(BatchReport(not_claimed=[i for i in ids if i not in got]))
        self._put(claimed)
        return len(claimed)

    def _claim_due(self, room: int, *, woken: bool = False) -> None:
        """A dispatcher's claim of due rows, lane by lane (with the reap, at its intervals).

        ``woken``: by a wake (a commit, a NOTIFY) rather than its own schedule.
        """
        started = self.clock()
        self.claims += 1
        self.last_claim_at = started
        claimed: list[ClaimedEmail] = []
        reaped = Reaped()
        full = False
        reap = self.reaps.due(started)
        tried = False  # whether any lane had room: only its claim can reap
        try:
            for lane in self.lanes:
                gate = self.pauses.gate(lane.name)
                if gate is Gate.CLOSED:
                    continue
                if gate is Gate.PROBE:
                    self._end_overdue(lane.name)
                limit = (min(1, room - len(claimed)) if gate is Gate.PROBE
                         else lane.claim_limit(room - len(claimed)))
                if limit <= 0:
                    if gate is Gate.PROBE:
                        self.pauses.probe_with(lane.name, None)
                    continue
                tried = True
                got, lane_reaped = self._claim_on_kept_connection(limit, reap=reap,
                                                                  transport=lane.name)
                if reap:
                    reaped, reap = lane_reaped, False
                if gate is Gate.PROBE:
                    self.pauses.probe_with(lane.name, got[0].id if got else None)
                lane.backlog = len(got) >= limit and gate is Gate.OPEN
                full = full or lane.backlog
                claimed += got
        except Exception as exc:  # noqa: BLE001 - reported; the next claim retries
            self.last_claim_failed = True
            self.last_claimed = 0
            self.reaps.found(0)  # the next claim reaps: leases may have run out
            self._schedule(started, claimed=0, full=False, failed=True)
            self.delivery.faults.failing(
                "dispatcher-tick", "A dispatcher could not reap or claim due emails",
                consequence="due emails stay queued (or sending until their lease expires); "
                            "the dispatcher keeps trying with backoff and resumes on its own "
                            "when the database answers again",
                fix="check the database connection and that the outbox tables exist "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
            self._put(claimed)  # what an earlier lane claimed before the failure
            return
        self.delivery.faults.recovered("dispatcher-tick")
        self.reaps.found(len(claimed))
        self.last_claim_failed = False
        self.last_claimed = len(claimed)
        # Rows just reaped are due now, but the PostgreSQL claim that reaped them could
        # not take them (one snapshot per statement): claim again at once, as after a full
        # claim. Idle on NOTIFY, wake when a lease runs out: a dead holder sends none. Not
        # when no lane had room (paced by a rate): no claim, so no reap, could take the
        # row before a lane opens (ready_at), and a lease already out would wake it every
        # LEASE_WAKE_MARGIN until then.
        wake = (self._lease_runs_out(woken) if not claimed and tried and self.listening
                else None)
        self._schedule(started, claimed=len(claimed), full=full or bool(reaped),
                       failed=False, wake_in=wake)
        try:
            self.delivery.report_reaped(reaped)
        finally:
            self._put(claimed)

    def _lease_runs_out(self, woken: bool) -> float | None:
        """Seconds until another claim's lease runs out (see ``Leases.next_expiry``); None: none
        held, or the lookup failed (the backstop still applies).

        Looked up after a wake, and after a lookup that found a lease, not on the
        backstop ticks of an idle database: a claim elsewhere follows a commit, whose
        NOTIFY woke this dispatcher too, so an idle tick costs one statement, not two.
        """
        if not (woken or self._leases_seen):
            return None
        try:
            seconds = self._claims.run(self.store.leases.next_expiry)
        except Exception:  # noqa: BLE001 - the next claim reports a database fault
            return None
        self._leases_seen = seconds is not None
        # Just past it: the reap takes leases that ran out strictly before "now".
        return None if seconds is None else seconds + LEASE_WAKE_MARGIN

    def _schedule(self, started: float, *, claimed: int, full: bool, failed: bool,
                  wake_in: float | None = None) -> None:
        cap = self.config.listen_backstop_seconds if self.listening else None
        gap = self.backoff.after_claim(
            claimed=claimed, full=full, failed=failed,
            maximum=max(cap, self.config.poll_max_interval) if cap else None)
        if wake_in is not None:
            gap = min(gap, wake_in)
        # A rate-limited lane with more due claims again once its slots run low; a
        # paused one's probe is due at its time.
        ready = _soonest(self.lanes.ready_at(), _after(self.pauses.next_probe_in(), started))
        with self._cond:
            self._next_claim = started + gap if ready is None else min(started + gap, ready)
            self._cond.notify_all()

    def _claim_on_kept_connection(self, limit: int, *, reap: bool,
                                  transport: str) -> tuple[list[ClaimedEmail], Reaped]:
        """The claim on the dispatcher's kept connection (a new owner for each try)."""
        started = time.time_ns()  # the claim span's start (OUTBOX_OTEL)
        claimed, reaped = self._claims.run(lambda conn: self.store.leases.claim_due(
            limit, owner=new_owner(), lease_seconds=self.config.lease_seconds,
            reap=reap, transport=transport, conn=conn))
        self.delivery.traced(claimed, started)
        return claimed, reaped

    # -- sending and recording ------------------------------------------------------------

    def _put(self, claimed: Sequence[ClaimedEmail]) -> None:
        """Claimed rows onto their lanes' streams, but for those that end or go back here.

        Rows claimed by a round that began before the stop are released unsent.
        """
        if not claimed:
            return
        with self._cond:
            stopping = self.releases.stopping
            if not stopping:
                self._in_flight.update((email.id, email) for email in claimed)
        if stopping:
            self.delivery.release(claimed)
            return
        self.delivery.heartbeat.track(claimed)
        self.delivery.traced(claimed)
        claimed = self._not_paused(claimed)
        screened = self._screened(self._sendable(claimed))
        for email in screened:
            if not email.deliverable:  # every recipient suppressed: ends without a send
                self._on_result_of(email, Suppressed())
        going = self._intercepted([email for email in screened if email.deliverable])
        self.lanes.send(going, self._on_result)

    def _not_paused(self, claimed: Sequence[ClaimedEmail]) -> list[ClaimedEmail]:
        """``claimed`` but for those of paused transports, released unsent (their attempt
        returned), save one taken as its transport's probe when the probe is due."""
        going: list[ClaimedEmail] = []
        held: list[ClaimedEmail] = []
        gates: dict[str, Gate] = {}
        for email in claimed:
            name = email.transport
            if self.pauses.is_probe(name, email.id):  # a dispatcher's claim of the probe
                going.append(email)
                continue
            if name not in gates:
                gates[name] = self.pauses.gate(name)
                if gates[name] is Gate.PROBE:
                    self._end_overdue(name)
                    self.pauses.probe_with(name, email.id)
                    going.append(email)
                    gates[name] = Gate.CLOSED  # one probe
                    continue
            (going if gates[name] is Gate.OPEN else held).append(email)
        for name in {email.transport for email in held}:
            self._hold([email for email in held if email.transport == name], name)
        return going

    def _hold(self, emails: list[ClaimedEmail], name: str) -> None:
        """Claimed rows of paused transport ``name``: queued again unsent until its probe."""
        with self._cond:
            for email in emails:
                self._in_flight.pop(email.id, None)
        why, due_in = self.pauses.held(name)
        self.delivery.hold(emails, why, due_in)
        self._settle(BatchReport(released=[email.id for email in emails]))

    def _end_overdue(self, name: str) -> None:
        """End ``name``'s emails that waited past OUTBOX_MAX_QUEUE_LIFETIME_SECONDS (failed,
        with the pause as their last error) or their own expiry (expired), unsent."""
        lifetime = self.config.max_queue_lifetime_seconds
        if lifetime is None or self.releases.stopping:
            return
        try:
            ids = self.pauses.sql.overdue(name, lifetime, self.capacity)
            claimed = self._writes.run(lambda conn: self.store.leases.claim_ids(
                ids, owner=new_owner(), lease_seconds=self.config.lease_seconds,
                conn=conn)) if ids else []
        except Exception as exc:  # noqa: BLE001 - reported; the next probe tries again
            self.delivery.faults.failing(
                "overdue", f"Could not end the emails of paused transport {name!r} that waited "
                           "longer than OUTBOX_MAX_QUEUE_LIFETIME_SECONDS",
                consequence="they stay queued until a later probe can end them",
                fix="check the database connection", exc=exc)
            return
        self.delivery.faults.recovered("overdue")
        if not claimed:
            return
        why = self.pauses.overdue_reason(name)
        now = self.store.clock()
        with self._cond:
            self._in_flight.update((email.id, email) for email in claimed)
        for email in claimed:
            self._on_result_of(email, Expired() if expired(email, now) else Overdue(why))

    def _screened(self, sendable: list[ClaimedEmail]) -> list[ClaimedEmail]:
        """``sendable`` with their suppressed recipients noted; all released if the list
        cannot be read."""
        screened = self.delivery.screen(sendable) if sendable else []
        if screened is None:
            self._release(sendable)
            return []
        with self._cond:  # results are recorded with the suppressed recipients noted
            for email in screened:
                if email.suppressed and email.id in self._in_flight:
                    self._in_flight[email.id] = email
        return screened

    def _sendable(self, claimed: Sequence[ClaimedEmail]) -> list[ClaimedEmail]:
        """Those of ``claimed`` to screen and send; the others end or are released here.

        Spent ones are dead-lettered unsent, expired ones end unsent, and
        those naming a transport of another OUTBOX_TRANSPORTS are released.
        """
        sendable: list[ClaimedEmail] = []
        unknown: list[ClaimedEmail] = []
        now = self.store.clock()
        for email in claimed:
            if email.attempt > self.policy.max_attempts:
                self._on_result_of(email, None)  # spent: dead-lettered unsent
            elif expired(email, now):
                self._on_result_of(email, Expired())  # too late: ends unsent
            else:
                (sendable if email.transport in self.lanes else unknown).append(email)
        if unknown:
            self._release(unknown)
            self.lanes.report_unknown(unknown)
        return sendable

    def _send_paced(self) -> float | None:
        """Send the paced rows whose slot came; when the next slot comes (None: none waits)."""
        # A paced row whose expiry passed while it waited for its slot ends unsent.
        self.lanes.send_due(self._on_result, lambda email: self._on_result_of(email, Expired()))
        return self.lanes.next_slot()

    def _release(self, emails: list[ClaimedEmail]) -> None:
        """Claimed rows that never reach a stream: queued again, attempt returned."""
        if not emails:
            return
        with self._cond:
            for email in emails:
                self._in_flight.pop(email.id, None)
        self.delivery.release(emails)
        self._settle(BatchReport(released=[email.id for email in emails]))

    def _intercepted(self, emails: list[ClaimedEmail]) -> list[ClaimedEmail]:
        """``emails`` as staging sends them (``Delivery.intercept``); those it ends, ended."""
        going, ended = self.delivery.intercept(emails)
        for email, result in ended:
            self._on_result_of(email, result)
        with self._cond:  # results are recorded with what interception made of them
            for email in going:
                if email.interception is not None and email.id in self._in_flight:
                    self._in_flight[email.id] = email
        return going

    def _on_result(self, envelope: Envelope, result: Result) -> None:
        """The transport's report (a transport thread): record it at the next round."""
        with self._cond:  # an RLock: _on_result_of takes it again without a wait
            email = self._in_flight.get(envelope.email_id)
            if email is not None:
                self._on_result_of(email, result)

    def _on_result_of(self, email: ClaimedEmail, result: Attempt | None) -> None:
        with self._cond:
            self._in_flight.pop(email.id, None)
            now = self.clock()
            first = self._results.add(email, result, now)
            # A woken loop records what came back, window or not: wake it for the
            # first result (it then waits out the window) and what ends it early.
            if first or self._results.record_in(now, at_once=self._record_at_once()) == 0.0:
                self._cond.notify_all()

    def _record(self) -> None:
        with self._cond:
            done = self._results.take()
        if not done:
            return
        retry_now = {email.id for email, _ in done
                     if self.intake.retries_done(email.id) < self.config.inline_retries
                     and not self.dispatching and not self.hand_ticked
                     and self.retries_in_process}
        try:
            report = self.delivery.finish(done, policy=self.policy, retry_now=retry_now,
                                          kept=self._writes, paced=self.lanes.paced_ids(
                                              done, dispatching=self.dispatching))
        except Exception:  # noqa: BLE001 - durability: ok Delivery._record reported it at ERROR, with what happens to the rows
            self._settle(BatchReport(not_claimed=[email.id for email, _ in done]))
            return
        self.finished += report.count
        self.lanes.after_record(done, report, dispatching=self.dispatching)
        self._after_pause(done)
        self._settle(report, retry_now)
        self.hand(report.holders)

    def _after_pause(self, done: Sequence[tuple[ClaimedEmail, Attempt | None]]) -> None:
        """Pause a transport whose fault came back, back off or resume after a probe."""
        resumed, paused = self.pauses.after_record(
            [(email.transport, email.id, result) for email, result in done])
        for name in paused:
            self._end_overdue(name)
        if not resumed:
            return
        if self.store.dialect.listens:
            try:
                self.store.notify()  # every dispatcher claims the waiting emails now
            except Exception as exc:  # noqa: BLE001 - reported; the others see it later
                self.delivery.faults.failing(
                    "pause-notify", f"Could not wake the other processes: transport(s) "
                                    f"{resumed} are back",
                    consequence="their dispatchers send the waiting emails at their next "
                                "claim (OUTBOX_LISTEN_BACKSTOP_SECONDS at most)",
                    fix="check the database connection", exc=exc)
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def _settle(self, report: BatchReport, retry_now: Collection[int] = ()) -> None:
        """After a record: schedule in-process retries, tell waiters, forget the rest."""
        with self._cond:
            self._waiters.tell(report)
            for email_id, attempt, error in report.transient:
                self._settle_transient(email_id, attempt, error, due_now=email_id in retry_now)
            self.intake.settled(itertools.chain(report.sent, report.failed, report.suppressed,
                                                report.expired, report.cancelled, report.lost,
                                                report.not_claimed, report.released,
                                                report.paused))
            self._cond.notify_all()

    def _settle_transient(self, email_id: int, attempt: int, error: TransientError, *,
                          due_now: bool) -> None:
        """A transient failure: retried here after a pause, or left queued (and reported).

        ``due_now``: recorded as due again at once, for this worker to retry.
        """
        if due_now and not self.releases.stopping:
            # A throttling server asked for a pause: retry when the row is due
            # again, not in a quarter of a second.
            self.intake.retry(email_id, lambda number: inline_pause(
                number, throttled=error.throttled, retry_after=error.retry_after))
            return
        self.intake.settled([email_id])
        if due_now:
            # Not retried here because this process stops: released, and marked
            # at stop for the next sweep of any process.
            self.releases.note([email_id])
        if not self.dispatching:  # a dispatcher takes it again when due
            self.delivery.report_left_queued(email_id, attempt, error, due_now=due_now)

    def _close(self) -> None:
        self.lanes.close()
        self._claims.close()
        self._writes.close()
        with self._cond:
            if self._thread is threading.current_thread():
                self._thread = None
            self._cond.notify_all()


def _until(deadline: float | None, now: float) -> float | None:
    """Seconds from ``now`` to ``deadline`` (None: no deadline)."""
    return None if deadline is None else deadline - now


def _after(seconds: float | None, start: float) -> float | None:
    """``start + seconds`` (None: no deadline)."""
    return None if seconds is None else start + seconds


def _soonest(*times: float | None) -> float | None:
    """The least of ``times`` that are not None; None if all are."""
    return min((t for t in times if t is not None), default=None)
