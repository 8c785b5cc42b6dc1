"""Durable mode's dispatcher: ticks that reap, claim and hand rows to the route.

A tick is: reap expired leases once, claim up to a batch of due rows (one
short transaction, :meth:`Store.claim_due`), deliver them through the
:class:`DeliveryRoute` with the retry policy. (While ticks keep finding work,
the reap rides along once every :data:`BUSY_REAP_INTERVAL` seconds only.)
Between ticks the dispatcher waits:

* a tick that claimed nothing (or failed) doubles the gap, from
  ``OUTBOX_POLL_INTERVAL`` up to ``OUTBOX_POLL_MAX_INTERVAL`` (or up to
  ``OUTBOX_LISTEN_BACKSTOP_SECONDS`` while a LISTEN connection is up);
* a tick that claimed something snaps back (a full batch ticks again at once);
* the gap is measured from the start of the tick, and ticks never overlap;
* :meth:`Dispatcher.wake` ends the wait at once; any number of wakes during a
  tick collapse into exactly one follow-up tick.

While a full batch is being sent, the next batch is claimed beside it (a
:class:`ClaimAhead` thread, on the dispatcher's connection, its leases kept
alive by the heartbeat), so the next tick starts sending at once: the claim
no longer sits between two batches. Only after a full batch (more is surely
due), never under a rate limit; a prefetched batch that is not sent is
released when the loop stops.

When a batch finishes an email of an ordering key, recording it hands the
key to its next email (:func:`~flask_mail_outbox._ordering.advance`): that
one is due now, so the dispatcher ticks again at once, as after a full batch.

The scheduling rule is :class:`IdleBackoff`, a small pure class, and the loop
takes an injectable clock and wait function, so tests can check the exact gap
sequence on a fake clock.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import sqlalchemy as sa

from . import _degrade
from ._delivery import BatchReport, ClaimAhead, DeliveryRoute, new_owner
from ._retry import RetryPolicy
from ._store import ClaimedEmail, Reaped

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ._config import OutboxConfig

logger = logging.getLogger(__name__)

#: Seconds between reaps while every tick finds work (see :meth:`Dispatcher._reap_now`).
BUSY_REAP_INTERVAL = 1.0


class IdleBackoff:
    """The gap before the next tick, from what the last tick did."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self._idle_gap = initial

    def after_tick(self, *, claimed: int, full: bool, failed: bool,
                   maximum: float | None = None) -> float:
        """Seconds from the start of the tick that just ended to the next one.

        ``full``: more is due now (a full batch, or keys handed on), even when
        this tick claimed nothing.
        """
        cap = self.maximum if maximum is None else maximum
        if failed or (claimed == 0 and not full):
            gap = min(self._idle_gap, cap)
            self._idle_gap = min(self._idle_gap * 2, cap)
            return gap
        self._idle_gap = self.initial
        # A full batch means more is waiting: go again at once.
        return 0.0 if full else self.initial


class Dispatcher:
    """One dispatcher loop for one app in one process."""

    def __init__(self, route: DeliveryRoute, config: OutboxConfig, *,
                 policy: RetryPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 name: str = "outbox-dispatcher") -> None:
        self.route = route
        self.store = route.store
        self.config = config
        self.policy = policy or config.retry_policy()
        self.clock = clock
        self.backoff = IdleBackoff(config.poll_interval, config.poll_max_interval)
        self.name = name
        self.listening = False  # set by the LISTEN thread while its connection is up
        self.sizer = BatchSizer(config.batch_size,
                                concurrency=getattr(route.transport, "concurrency", 1))
        self.rate_limiter: RateLimiter | None = (
            RateLimiter(config.rate_limit, clock=clock) if config.rate_limit else None)
        self._cond = threading.Condition()
        self._wake_pending = False
        self._stopping = False
        self._in_tick = False
        self._thread: threading.Thread | None = None
        # The dispatcher's own connection, kept across ticks: no pool checkout
        # (and pre-ping) per tick, so an idle tick is the claim and nothing else.
        self._conn: Connection | None = None
        #: Claim the next batch while a full one is sent (see the module docstring).
        self.prefetch = True
        self._prefetched: ClaimAhead | None = None
        self._delivering = False  # the tick has handed its batch to deliver_claimed
        self._claimed_now: list[ClaimedEmail] = []  # what the tick claimed (or ahead)
        self.ticks = 0
        self.last_claimed = 0
        self._last_reap = -math.inf
        self._last_claim_empty = True  # what the last claim (its own, or ahead) found
        self.last_tick_failed = False
        self.last_tick_at: float | None = None

    # -- control ----------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a daemon thread (idempotent; a stopped dispatcher stays stopped).

        (A stop may come while the process still winds down: the scheduler
        asking for a dispatcher then must not start a new loop that claims.)
        """
        with self._cond:
            if self._stopping or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
            self._thread.start()
        logger.info("Outbox dispatcher started (pid %d)", os.getpid())

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Tick as soon as possible (now if waiting; once more after a running tick)."""
        with self._cond:
            self._wake_pending = True
            self._cond.notify_all()

    def close_connection(self) -> None:
        """Return the dispatcher's connection (after the loop ended)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def request_stop(self) -> None:
        """Stop after the tick in flight (safe from a signal handler)."""
        self._stopping = True
        # No lock: a signal handler may interrupt a thread holding it.
        self._wake_pending = True

    def stop(self, timeout: float) -> None:
        """Stop claiming; give the batch in flight ``timeout`` seconds, release the rest."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout / 2)
        if thread.is_alive():
            # Messages not yet handed to the server are released now.
            self.route.release_unstarted()
            thread.join(timeout / 2)

    def idle(self) -> bool:
        """No tick running or pending, and the last tick found nothing due."""
        with self._cond:
            return (not self._in_tick and not self._wake_pending
                    and self.ticks > 0 and self.last_claimed == 0
                    and not self.last_tick_failed)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Tick until :meth:`stop` (in :meth:`start`'s thread, or in the foreground)."""
        with self._cond:
            current = threading.current_thread()
            if self._thread is not None and self._thread.is_alive() \
                    and self._thread is not current:
                raise RuntimeError("this dispatcher's loop already runs in another thread")
            # A foreground loop (`flask outbox worker`) counts as running, so
            # start() never adds a second loop beside it.
            self._thread = current
        try:
            while not self._stopping:
                self.step()
        finally:
            try:
                self.release_held()
            finally:
                self.close_connection()
                with self._cond:
                    if self._thread is current:
                        # A foreground loop that ended no longer runs (stop()
                        # then closes the transport and the engine).
                        self._thread = None

    def release_held(self) -> int:
        """Give back the rows claimed ahead for a next tick that will not come; how many."""
        prefetched, self._prefetched = self._prefetched, None
        return self.route.release_ahead(prefetched) if prefetched is not None else 0

    def step(self, wait: Callable[[float], None] | None = None) -> float:
        """One tick, then the wait before the next; returns the gap it chose."""
        with self._cond:
            self._wake_pending = False
            self._in_tick = True
        started = self.clock()
        try:
            report, full = self.tick()
            failed = False
        except Exception as exc:  # noqa: BLE001 - reported; the next tick retries
            failed, report, full = True, None, False
            self.route.faults.failing(
                "dispatcher-tick", "A dispatcher tick could not reap, claim or record",
                consequence="due emails stay queued (or sending until their lease expires); "
                            "the dispatcher keeps ticking with backoff and resumes on its own "
                            "when the database answers again",
                fix="check the database connection and that the outbox tables exist "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
        else:
            self.route.faults.recovered("dispatcher-tick")
        finally:
            with self._cond:
                self._in_tick = False
                self._cond.notify_all()
        self.ticks += 1
        self.last_tick_failed = failed
        self.last_tick_at = started
        claimed = report.count if report is not None else 0
        with self._cond:
            self.last_claimed = claimed
        cap = self.config.listen_backstop_seconds if self.listening else None
        gap = self.backoff.after_tick(claimed=claimed, full=full, failed=failed,
                                      maximum=max(cap, self.config.poll_max_interval)
                                      if cap else None)
        (wait or self._wait_until)(started + gap)
        return gap

    def _wait_until(self, deadline: float) -> None:
        with self._cond:
            while not self._stopping and not self._wake_pending:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return
                # In slices: a signal handler (the worker's SIGTERM) sets the flags
                # without being able to notify, and a lock wait is not interrupted.
                self._cond.wait(min(remaining, 0.5))

    def tick(self) -> tuple[BatchReport | None, bool]:
        """Reap, claim, deliver; returns the batch report and whether more is due now.

        More is due when the batch was full, or when recording it handed some
        keys to their next emails.
        """
        limit = self.sizer.size
        if self.rate_limiter is not None:
            limit = self.rate_limiter.acquire(limit)
        # If anything raises before this tick hands its batch to
        # deliver_claimed, the rows it claimed are given back at once: none is
        # left sending for nobody.
        try:
            return self._tick(limit)
        except BaseException:
            if not self._delivering:
                self._give_back_quietly(self._claimed_now)
            raise
        finally:
            self._delivering = False
            self._claimed_now = []

    def _give_back_quietly(self, claimed: list[ClaimedEmail]) -> None:
        """Give back rows on the way out of a failing tick (its own error is the one raised)."""
        try:
            self.route.give_back(claimed)
        except Exception as exc:  # noqa: BLE001 - the tick's error is reported; these are reaped
            logger.info("Could not give back %d claimed email(s) (%s); they are queued "
                        "again when their lease expires", len(claimed), exc)

    def _tick(self, limit: int) -> tuple[BatchReport | None, bool]:
        claimed, reaped = self._take_prefetched(limit)
        if claimed is None:
            claimed, reaped = self._claim_due(limit, new_owner())
        self._claimed_now = claimed
        self.route.report_reaped(reaped)
        if not claimed:
            return None, False
        if self._stopping:
            self._delivering = True  # given back: no longer held
            self.route.give_back(claimed)
            return None, False
        if self.prefetch and len(claimed) >= limit and self.rate_limiter is None:
            self._prefetched = self.route.claim_ahead(
                lambda: self._claim_due(limit, new_owner()))
        started = self.clock()
        with self.route.app.app_context():
            # From here the batch's rows are deliver_claimed's: sent and
            # recorded, or left to their lease if that fails.
            self._delivering = True
            report = self.route.deliver_claimed(claimed, policy=self.policy)
        self.sizer.after_batch(len(claimed), self.clock() - started)
        self._after_throttling(report, len(claimed))
        return report, len(claimed) >= limit or bool(report.holders)

    def _take_prefetched(self, limit: int) -> tuple[list[ClaimedEmail] | None, Reaped]:
        """The batch claimed ahead, if there is one and it may go now (None: claim now)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None:
            return None, Reaped()
        try:
            claimed, reaped = prefetched.result()
        except Exception as exc:  # noqa: BLE001 - claimed nothing; claimed again below
            # It failed while the batch before was sent (say, the database
            # went away then). That is old news now: raising it would fail
            # this tick, and report an outage, even after the database came
            # back. The claim made now tells the current state.
            logger.info("The claim made ahead failed (%s); claiming now", exc)
            return None, Reaped()
        if claimed and self.rate_limiter is not None:
            # The server said "too many" since it was claimed: the limiter decides.
            self.route.give_back(claimed)
            claimed, more = self._claim_due(limit, new_owner())
            reaped = Reaped(reaped.requeued + more.requeued, reaped.keys | more.keys)
        return claimed, reaped

    def _after_throttling(self, report: BatchReport, tried: int) -> None:
        """Pace this process when the server said it sends too fast."""
        throttled_count = sum(error.throttled for _, _, error in report.transient)
        throttled = throttled_count > 0
        if throttled and self.rate_limiter is None:
            # No configured rate, but the server says "too fast": start at half of
            # what this tick tried, and let feedback find the server's pace.
            self.rate_limiter = RateLimiter(float(self.config.batch_size) * 10, clock=self.clock)
            self.rate_limiter.current = max(1.0, tried / 2)
            _degrade.report(
                f"The SMTP server is throttling this process ({throttled_count} "
                "email(s) refused with a reply that says it is sending too fast)",
                consequence="those emails are queued again, their attempt given back at most "
                            f"OUTBOX_MAX_THROTTLE_DEFERRALS ({self.policy.max_throttle_deferrals}) "
                            "times each, and this process now paces itself below the "
                            "server's limit",
                fix="set OUTBOX_RATE_LIMIT to the rate your provider allows")
        if self.rate_limiter is not None:
            self.rate_limiter.feedback(throttled=throttled)

    def _reap_now(self) -> bool:
        """Whether the next claim also reaps expired leases.

        A claim after one that found nothing always does (so does the first).
        While claims keep finding work (a drain: dozens a second), only the
        first claim at least :data:`BUSY_REAP_INTERVAL` seconds after the last
        reap does: a reap reads the index entries of every 'sending' row
        version since the last VACUUM. An expired lease is then taken back
        by the first claim a second after the last reap, or by the next idle
        one, rather than by the very next claim.
        """
        now = self.clock()
        if self._last_claim_empty or now - self._last_reap >= BUSY_REAP_INTERVAL:
            self._last_reap = now
            return True
        return False

    def _claim_due(self, limit: int, owner: str, *,
                   reap: bool | None = None) -> tuple[list[ClaimedEmail], Reaped]:
        """The tick's claim on the kept connection, or on a new one if it had died.

        The connection is kept across ticks without a ping, so the first tick
        after the database restarted finds it cut: the claim goes once more on
        a fresh connection, under a new owner, instead of failing a tick and
        reporting an outage that is over. (Should the cut claim have committed
        after all, its rows are reaped when their lease expires, like a crashed
        worker's.) Only the claim itself is retried: ``claim_due`` never raises
        after its claim committed, so a claimed batch is never dropped.
        """
        if reap is None:
            reap = self._reap_now()
        kept = self._conn is not None
        if self._conn is None:
            self._conn = self.store.dispatch_connection()
        try:
            result = self.store.claim_due(
                limit, owner=owner, lease_seconds=self.config.lease_seconds,
                reap=reap, conn=self._conn)
            self._last_claim_empty = not result[0]
            return result
        except BaseException as exc:
            # The claim after a failed one reaps, whenever it comes: leases may
            # have run out meanwhile (a database outage).
            self._last_claim_empty = True
            # A broken connection is replaced (now, or at the next tick).
            conn, self._conn = self._conn, None
            conn.invalidate()
            conn.close()
            if kept and isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
                logger.info("The dispatcher's database connection was cut (%s); "
                            "claiming again on a new one", exc.orig)
                return self._claim_due(limit, new_owner(), reap=reap)
            raise


class BatchSizer:
    """How many rows the next claim takes: a batch the connections finish soon.

    A claim is sent as one batch and the next claim waits for all of it, so a
    big batch to a slow server leaves connections idle at its tail, and holds
    rows that other workers could be sending meanwhile. The next claim is
    what keeps each connection busy for about ``target`` seconds at the pace
    the last batch went, between ``concurrency`` and ``OUTBOX_BATCH_SIZE``: a
    fast server gets full batches, a slow one small ones.
    """

    def __init__(self, maximum: int, *, concurrency: int, target: float = 0.5) -> None:
        self.maximum = maximum
        self.concurrency = max(1, min(concurrency, maximum))
        self.target = target
        self.size = maximum

    def after_batch(self, count: int, seconds: float) -> int:
        """Record that a batch of ``count`` messages took ``seconds``; the next size."""
        if count <= 0:
            return self.size
        # Seconds one connection spent per message.
        per_message = seconds * min(self.concurrency, count) / count
        per_connection = self.maximum if per_message <= 0 else int(self.target / per_message)
        self.size = max(self.concurrency, min(self.maximum, per_connection * self.concurrency))
        return self.size


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
        # At most one second's worth per batch, at least one message.
        allowed = max(1, min(wanted, int(self.current)))
        self._next_free = now + allowed / self.current
        return allowed

    def feedback(self, *, throttled: bool) -> None:
        """Halve the rate when throttled; creep back up to the configured rate otherwise."""
        if throttled:
            self.current = max(self.rate / 64, self.current / 2)
        else:
            self.current = min(self.rate, self.current * 1.1)
