"""The one delivery route: claim -> send -> record.

:class:`DeliveryRoute` is what every way of delivering goes through (the
after-commit hand-over, the sweep, and the durable dispatcher): the store's
compare-and-set claim is the only gate, the transport sends, the store
records the outcomes in bulk, and a :class:`Heartbeat` renews the leases of
rows still being sent so a slow server never causes a second copy.

:class:`InlineDelivery` is inline mode's background worker: one daemon thread
per app and process that takes ids handed over after commit, delivers them in
batches and retries transient failures a few times in process.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy
from functools import cached_property
from typing import TYPE_CHECKING, Any

from . import _degrade, _retry
from ._errors import PermanentError, TransientError, TransportError
from ._models import Status
from ._retry import RetryPolicy
from ._signals import email_failed, email_sent
from ._store import ClaimedEmail, Outcome, Reaped, Recorded, Store
from .transports import Delivered, Envelope, Failed, Transport
from .transports._base import NotAttempted

if TYPE_CHECKING:
    from flask import Flask

    from ._config import OutboxConfig

logger = logging.getLogger(__name__)

_owner_counter = itertools.count(1)
_HOST = socket.gethostname()


#: Why a row claimed past its last attempt is dead-lettered unsent.
SPENT_LEASE = "lease expired: the process sending it stopped, and its attempts are spent"


def new_owner() -> str:
    """A lease owner token, unique per claim (host, pid, sequence, random)."""
    return f"{_HOST[:40]}:{os.getpid()}:{next(_owner_counter)}:{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class DeliveredMessage:
    """A delivered email as ``record_messages()`` yields it (Flask-Mail-like)."""

    email_id: int
    message_id: str
    sender: str
    send_to: tuple[str, ...]
    mime: bytes

    @cached_property
    def parsed(self) -> EmailMessage:
        """The message parsed back with the stdlib parser."""
        parsed = BytesParser(policy=default_policy).parsebytes(self.mime)
        return parsed

    @property
    def subject(self) -> str:
        """The decoded Subject header."""
        return str(self.parsed.get("Subject", ""))

    @property
    def recipients(self) -> list[str]:
        """The To addresses, as written in the header."""
        return [str(a.addr_spec) for h in self.parsed.get_all("To", []) for a in h.addresses]

    def _part(self, subtype: str) -> str | None:
        part = self.parsed.get_body(preferencelist=(subtype,))
        if part is None or part.get_content_subtype() != subtype:
            return None
        # Text travels in canonical CRLF form; hand it back with Python newlines.
        return str(part.get_content()).replace("\r\n", "\n")

    @property
    def body(self) -> str | None:
        """The text/plain body, if any."""
        return self._part("plain")

    @property
    def html(self) -> str | None:
        """The text/html body, if any."""
        return self._part("html")


@dataclasses.dataclass
class BatchReport:
    """What happened to the ids offered to one :meth:`DeliveryRoute.deliver_ids`."""

    sent: list[int] = dataclasses.field(default_factory=list)
    failed: list[int] = dataclasses.field(default_factory=list)
    # Transient failures, back to queued: (id, attempt, error).
    transient: list[tuple[int, int, TransientError]] = dataclasses.field(default_factory=list)
    not_claimed: list[int] = dataclasses.field(default_factory=list)
    lost: list[int] = dataclasses.field(default_factory=list)
    # Claimed but never handed to the server (shutdown): back to queued, attempt returned.
    released: list[int] = dataclasses.field(default_factory=list)
    # Emails that now hold their key (a finished one handed it on): next to claim.
    holders: list[int] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        """Rows this batch finished one way or another."""
        return len(self.sent) + len(self.failed) + len(self.transient) + len(self.released)


class Heartbeat:
    """Renews the leases of rows in flight every third of a lease."""

    def __init__(self, store: Store, lease_seconds: float,
                 faults: _degrade.FaultTracker) -> None:
        self.store = store
        self.lease_seconds = lease_seconds
        self.faults = faults
        self._tracked: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def tracking(self, claimed: Sequence[ClaimedEmail]) -> Iterator[None]:
        """Keep the leases of ``claimed`` alive while the block runs.

        A batch may hold rows of two claims (rows handed on by the last
        record, and the tick's own claim): each owner's rows are renewed.
        """
        owners = _by_owner(claimed)
        for owner, ids in owners.items():
            self.track(owner, ids)
        try:
            yield
        finally:
            for owner in owners:
                self.untrack(owner)

    def track(self, owner: str, ids: Sequence[int]) -> None:
        """Keep the leases of ``ids`` alive until :meth:`untrack` (or a tracking block ends)."""
        with self._lock:
            self._tracked[owner] = list(ids)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="outbox-heartbeat",
                                                daemon=True)
                self._thread.start()

    def untrack(self, owner: str) -> None:
        """Stop renewing the leases of ``owner``'s rows."""
        with self._lock:
            self._tracked.pop(owner, None)

    def _run(self) -> None:
        interval = self.lease_seconds / 3
        while True:
            time.sleep(interval)
            with self._lock:
                tracked = list(self._tracked.items())
            for owner, ids in tracked:
                try:
                    self.store.renew_leases(owner, ids, self.lease_seconds)
                    self.faults.recovered("heartbeat")
                except Exception as exc:  # noqa: BLE001 - reported; the next beat retries
                    self.faults.failing(
                        "heartbeat", "Could not renew the leases of emails being sent",
                        consequence=(f"{len(ids)} email(s) in flight may be claimed again by "
                                     "another process once their lease expires, which can "
                                     "send a duplicate with the same Message-ID"),
                        fix="check the database connection; raise OUTBOX_LEASE_SECONDS if the "
                            "database is slow",
                        exc=exc)


def _by_owner(claimed: Sequence[ClaimedEmail]) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = {}
    for email in claimed:
        owners.setdefault(email.owner, []).append(email.id)
    return owners


class ClaimAhead:
    """A claim running in a thread of its own while a batch is sent; :meth:`result` waits.

    The claimer is expected to put the rows it claims under the heartbeat,
    so their leases live while they wait their turn.
    """

    def __init__(self, claim: Callable[[], tuple[list[ClaimedEmail], Reaped]]) -> None:
        self._claim = claim
        self._value: tuple[list[ClaimedEmail], Reaped] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="outbox-claim-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._claim()
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self) -> tuple[list[ClaimedEmail], Reaped]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._value is None:  # pragma: no cover - _run sets one or the other
            raise RuntimeError("the claim ahead ended without a result")
        return self._value


class DeliveryRoute:
    """claim -> send -> record, for one app in one process."""

    def __init__(self, *, app: Flask, config: OutboxConfig, store: Store,
                 transport: Transport, faults: _degrade.FaultTracker) -> None:
        self.app = app
        self.config = config
        self.store = store
        self.transport = transport
        self.faults = faults
        self.heartbeat = Heartbeat(store, config.lease_seconds, faults)
        self.policy = config.retry_policy()
        self._send_lock = threading.Lock()
        self._current: Sequence[ClaimedEmail] = ()
        self._released_early: set[int] = set()
        #: Set by the runtime's stop(): from then on, ids given back are kept in
        #: :attr:`given_back` so stop() can mark them for the next sweep.
        self.stopping = False
        self.given_back: list[int] = []
        #: Set once stop() marked what it knew of: a batch that ends in the
        #: background afterwards marks what it gives back itself.
        self.mark_at_once = False
        self._given_lock = threading.Lock()

    def take_given_back(self) -> list[int]:
        """The ids given back so far at stop; later ones are marked as they come."""
        with self._given_lock:
            self.mark_at_once = True
            ids, self.given_back = sorted(set(self.given_back)), []
            return ids

    def in_flight(self) -> Sequence[ClaimedEmail]:
        """The rows of the batch being sent now (empty between batches)."""
        return self._current

    def release_unstarted(self) -> int:
        """At shutdown: give back the rows of the batch in flight that will never start.

        They go back to ``queued`` with their attempt returned at once, instead
        of waiting out their lease if this process exits before the batch ends.
        """
        never = self.transport.cancel_pending()
        current = self._current
        if not never or not current:
            return 0
        unstarted = [e for e in current if e.id in never]
        self._released_early.update(e.id for e in unstarted)
        released = self.store.release(unstarted)
        self.note_given_back(released)
        logger.info("Outbox delivery is stopping (pid %d): gave back %d email(s) of the batch "
                    "in flight not yet handed to the server; %d in flight may still finish",
                    os.getpid(), len(released), len(current) - len(unstarted))
        return len(released)

    def mark_given_back(self, ids: list[int], *, when: str) -> int | None:
        """Mark ``ids`` given back for any process's next sweep; how many, None if it failed.

        A failure is reported here: the rows are queued either way, only later.
        """
        try:
            return self.store.mark_given_back(ids)
        except Exception as exc:  # noqa: BLE001 - reported; the age gate still frees them
            _degrade.report(
                f"Could not mark {len(ids)} email(s) {ids[:20]} given back {when}",
                consequence="they stay queued and wait for the age gate: a sweep takes them "
                            "OUTBOX_SWEEP_MIN_AGE_SECONDS "
                            f"({self.config.sweep_min_age_seconds:g} s) after they were created",
                fix="check the database connection; once every process that could hold them "
                    "has stopped or restarted, `flask outbox sweep --min-age 0` sends them now",
                exc=exc)
            return None

    def note_given_back(self, ids: list[int]) -> None:
        """Keep ids given back at stop for stop()'s mark, or mark them now if it is past."""
        if not ids:
            return
        with self._given_lock:
            if not self.mark_at_once:
                self.given_back.extend(ids)
                return
        marked = self.mark_given_back(ids, when="after stop")
        if marked is None:
            return
        logger.info("Outbox delivery gave back %d more unsent email(s) %s after stop, "
                    "marked for the next sweep of any process", marked, ids[:20])

    def deliver_ids(self, ids: Sequence[int],
                    claimed: Sequence[ClaimedEmail] | None = None, *,
                    retry_now: Collection[int] = ()) -> BatchReport:
        """Claim those of ``ids`` that are due, send them, record the outcomes (inline).

        ``claimed``: the rows of ``ids`` claimed already (see :meth:`claim_ahead`).
        ``retry_now``: ids the caller retries in process after a transient
        failure; they are due again at once instead of after their backoff.
        """
        if claimed is None:
            claimed = self.store.claim_ids(ids, owner=new_owner(),
                                           lease_seconds=self.config.lease_seconds)
        report = self.deliver_claimed(claimed, retry_now=retry_now)
        got = {email.id for email in claimed}
        report.not_claimed = [i for i in ids if i not in got]
        return report

    def claim_ahead(self, claim: Callable[[], tuple[list[ClaimedEmail], Reaped]]
                    ) -> ClaimAhead:
        """Run ``claim`` in a thread while another batch is sent; its rows' leases kept alive."""
        def claim_and_track() -> tuple[list[ClaimedEmail], Reaped]:
            claimed, reaped = claim()
            if claimed:
                self.heartbeat.track(claimed[0].owner, [e.id for e in claimed])
            return claimed, reaped
        return ClaimAhead(claim_and_track)

    def release_ahead(self, ahead: ClaimAhead) -> int:
        """Give back rows claimed ahead that will not be sent now; returns how many."""
        try:
            claimed, _ = ahead.result()
        except Exception:  # noqa: BLE001 - a failed claim claimed nothing
            return 0
        return self.give_back(claimed)

    def give_back(self, claimed: Sequence[ClaimedEmail]) -> int:
        """Release claimed rows unsent (queued, attempt returned); stop renewing their leases."""
        if not claimed:
            return 0
        try:
            released = self.store.release(claimed)
            if self.stopping:
                self.note_given_back(released)
            return len(released)
        finally:
            for owner in _by_owner(claimed):
                self.heartbeat.untrack(owner)

    def deliver_claimed(self, claimed: Sequence[ClaimedEmail], *,
                        policy: RetryPolicy | None = None,
                        retry_now: Collection[int] = ()) -> BatchReport:
        """Send rows this process has claimed and record what happened.

        The retry policy (``policy``, else the configured one) decides every
        failure in both modes: a transient one sets the row's next due time,
        or dead-letters it on its last allowed attempt; a throttled one gives
        the attempt back a bounded number of times. Rows in ``retry_now``
        (inline mode's in-process retries) are due again at once. A row claimed
        past its last attempt (its lease had expired on that attempt) is
        dead-lettered without a send.
        """
        if not claimed:
            return BatchReport()
        # One transport, one batch at a time: transports are not required to be
        # thread-safe, and batching is where the throughput comes from anyway.
        # Leases are renewed from here until the outcomes are recorded: waiting for
        # the send lock, sending, and retrying the record all count.
        with self.heartbeat.tracking(claimed):
            return self._send_and_record(claimed, policy or self.policy, retry_now)

    def _send_and_record(self, claimed: Sequence[ClaimedEmail], policy: RetryPolicy,
                         retry_now: Collection[int]) -> BatchReport:
        report = BatchReport()
        spent = [e for e in claimed if e.attempt > policy.max_attempts]
        if spent:
            claimed = [e for e in claimed if e.attempt <= policy.max_attempts]
        envelopes = [Envelope(email_id=e.id, sender=e.sender, recipients=e.recipients,
                              mime=e.mime, message_id=e.message_id,
                              mail_options=e.mail_options, rcpt_options=e.rcpt_options)
                     for e in claimed]
        with self._send_lock:
            self._current = claimed
            try:
                results = self.transport.send_many(envelopes) if envelopes else []
            except Exception as exc:  # noqa: BLE001 - a broken transport must not lose rows
                _degrade.report(
                    f"Transport {type(self.transport).__name__}.send_many raised "
                    f"{type(exc).__name__} instead of returning results",
                    consequence=(f"{len(claimed)} email(s) are put back to queued and will be "
                                 "retried (it counts as a transient failure)"),
                    fix="fix the transport: it must return Failed(...) results, not raise",
                    exc=exc)
                results = [Failed(TransientError(f"transport raised {type(exc).__name__}: {exc}"))
                           for _ in claimed]
            finally:
                self._current = ()
        if len(results) != len(claimed):
            raise RuntimeError(f"transport returned {len(results)} results for "
                               f"{len(claimed)} messages")
        outcomes = [Outcome(e, Status.FAILED, error_message=SPENT_LEASE, give_back_attempt=True)
                    for e in spent]
        released_early, self._released_early = self._released_early, set()
        for email, result in zip(claimed, results):
            if email.id in released_early:
                report.released.append(email.id)
                continue
            if isinstance(result, Delivered):
                refused = "; ".join(f"{addr}: {code} {text}"
                                    for addr, (code, text) in result.refused.items())
                outcomes.append(Outcome(email, Status.SENT,
                                        error_code=max((c for c, _ in result.refused.values()),
                                                       default=0),
                                        error_message=f"some recipients refused: {refused}"
                                        if refused else None))
            elif isinstance(result.error, PermanentError):
                outcomes.append(Outcome(email, Status.FAILED, error_code=result.error.code,
                                        error_message=result.error.message))
            elif isinstance(result.error, NotAttempted):
                outcomes.append(Outcome(email, Status.QUEUED, give_back_attempt=True))
            else:
                decision = policy.decide(email.attempt, result.error,
                                         deferrals=email.throttle_deferrals)
                if decision.dead:
                    outcomes.append(Outcome(email, Status.FAILED, error_code=result.error.code,
                                            error_message=result.error.message))
                else:
                    outcomes.append(Outcome(
                        email, Status.QUEUED, error_code=result.error.code,
                        error_message=result.error.message,
                        # A deferral waits its few seconds even when retried in process.
                        due_in=(None if email.id in retry_now and decision.charge
                                else decision.delay),
                        give_back_attempt=not decision.charge, deferred=decision.deferral))
        recorded, lost, report.holders = self._record(outcomes)
        errors: dict[int, TransportError] = {
            e.id: r.error for e, r in zip(claimed, results) if isinstance(r, Failed)}
        errors.update((e.id, TransientError(SPENT_LEASE)) for e in spent)
        for outcome in recorded:
            email = outcome.email
            if outcome.status is Status.SENT:
                report.sent.append(email.id)
                if outcome.error_message:
                    _degrade.report(
                        f"Email {email.id} ({email.message_id}) was accepted for some "
                        f"recipients and refused for others: {outcome.error_message}",
                        consequence="it is marked sent and will not be retried, since a retry "
                                    "would send a second copy to the recipients who got it",
                        fix="check the refused addresses and send them a new email if needed")
                self._signal_sent(email)
            elif outcome.status is Status.FAILED:
                report.failed.append(email.id)
                error = errors[email.id]
                why = ("failed permanently" if isinstance(error, PermanentError) else
                       "had an expired lease (the process sending it stopped) and no attempt "
                       f"left (OUTBOX_MAX_ATTEMPTS={policy.max_attempts}); the server may or may "
                       "not have accepted its last one" if email in spent else
                       f"failed for the last allowed time (OUTBOX_MAX_ATTEMPTS="
                       f"{policy.max_attempts})")
                _degrade.report(
                    f"Email {email.id} ({email.message_id}) {why} on attempt "
                    f"{email.attempt}: {error}",
                    consequence="it is dead-lettered (status failed) and will not be sent",
                    fix=f"correct the cause, then put it back with mail.retry({email.id}) or "
                        f"`flask outbox dlq retry {email.id}`")
                self._signal(email_failed, email_id=email.id, message_id=email.message_id,
                             error=error)
            elif email.id in errors and isinstance(errors[email.id], NotAttempted):
                report.released.append(email.id)
            else:
                error = errors[email.id]
                report.transient.append(
                    (email.id, email.attempt,
                     error if isinstance(error, TransientError) else TransientError(str(error))))
        for outcome in lost:
            report.lost.append(outcome.email.id)
            _degrade.report(
                f"Email {outcome.email.id} ({outcome.email.message_id}) lost its lease while "
                f"being sent (outcome {outcome.status.value} not recorded)",
                consequence="another delivery claimed it after the lease expired; it may have "
                            "been sent twice with the same Message-ID",
                fix="raise OUTBOX_LEASE_SECONDS above the slowest SMTP transaction, or check "
                    "that the database keeps up with lease renewals")
        return report

    def report_reaped(self, reaped: Reaped) -> None:
        """Report what a reap found: rows whose sender died mid-delivery."""
        if reaped.requeued:
            _degrade.report(
                f"{len(reaped.requeued)} email(s) {list(reaped.requeued)[:20]} had an expired "
                "lease: the process sending them stopped mid-delivery",
                consequence="they are queued again and will be delivered; one may arrive "
                            "twice, with the same Message-ID, if its server had accepted it "
                            "already",
                fix="nothing for these emails; find why the other process stopped "
                    "(killed, out of memory) and give workers time to stop on SIGTERM")

    #: Seconds between attempts to record outcomes while the database refuses.
    record_retry_delays = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)

    def _record(self, outcomes: list[Outcome]) -> Recorded:
        """Record outcomes, retrying while the database is briefly unavailable.

        The messages were handed to the server already: giving up here means
        they are sent again once their lease expires. The heartbeat keeps the
        leases alive meanwhile (when the database lets it).
        """
        for delay in (*self.record_retry_delays, None):
            try:
                result = self.store.record(outcomes, scrub_sent=self.config.scrub_sent)
            except Exception as exc:
                if delay is None:
                    sent = sum(o.status is Status.SENT for o in outcomes)
                    _degrade.report(
                        f"Could not record the outcome of {len(outcomes)} email(s) "
                        f"({sent} accepted by the server)",
                        consequence="they stay sending until their lease expires, then are "
                                    "delivered again: the accepted ones arrive twice, with the "
                                    "same Message-ID",
                        fix="check the database connection; on SQLite, keep other writers' "
                            "transactions short",
                        exc=exc)
                    raise
                self.faults.failing(
                    "record", "Could not record delivery outcomes; retrying",
                    consequence="the outcomes are retried for about a minute while the "
                                "leases are kept alive",
                    fix="check the database connection", exc=exc)
                time.sleep(delay)
            else:
                self.faults.recovered("record")
                return result
        raise RuntimeError("unreachable")  # pragma: no cover - the loop returns or raises

    def _signal_sent(self, email: ClaimedEmail) -> None:
        if not email_sent.receivers:
            return
        message = DeliveredMessage(email_id=email.id, message_id=email.message_id,
                                   sender=email.sender, send_to=email.recipients, mime=email.mime)
        self._signal(email_sent, email_id=email.id, message_id=email.message_id,
                     message=message, created_at=email.created_at)

    def _signal(self, signal: Any, **kwargs: Any) -> None:
        """Send a signal; a failing receiver is logged and never breaks delivery."""
        try:
            with self.app.app_context():
                signal.send(self.app, **kwargs)
        except Exception:
            logger.exception("A receiver of the %s signal raised (email %s); the email's "
                             "outcome is recorded and delivery goes on", signal.name,
                             kwargs.get("email_id"))


def inline_backoff(retry: int) -> float:
    """Seconds before in-process retry number ``retry`` (1-based), capped near 2 s."""
    return float(min(2.0, 0.25 * 2 ** (retry - 1)))


class InlineDelivery:
    """Inline mode's background worker for one app in one process.

    ``submit(ids)`` returns at once; a daemon thread delivers the ids in
    batches through the route. A transient failure is retried
    ``OUTBOX_INLINE_RETRIES`` times in this process; after that the row stays
    queued for the periodic sweep (or a durable dispatcher), with an ERROR.
    """

    def __init__(self, route: DeliveryRoute, config: OutboxConfig) -> None:
        self.route = route
        self.config = config
        self._pending: dict[int, None] = {}
        self._retries: dict[int, tuple[float, int]] = {}  # id -> (due monotonic, retry number)
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    #: Ids waiting in memory at most; past it, hand-overs fall back to the sweep.
    max_pending = 20_000

    def submit(self, ids: Sequence[int]) -> None:
        """Hand over committed ids; starts the worker thread on first use."""
        if not ids:
            return
        with self._cond:
            if self._stopping:
                return
            room = self.max_pending - len(self._pending)
            if room < len(ids):
                self.route.faults.failing(
                    "inline-overflow",
                    f"The inline delivery queue is full ({self.max_pending} emails waiting)",
                    consequence=f"{len(ids) - max(room, 0)} committed email(s) (and further "
                                "ones until it drains) are not handed over; they stay queued "
                                "and the periodic sweep delivers them after "
                                "OUTBOX_SWEEP_MIN_AGE_SECONDS",
                    fix="the SMTP server is slower than the rate of email; check it, or "
                        "switch to durable mode and run `flask outbox worker` processes")
                ids = ids[:max(room, 0)]
            elif not self._pending:
                self.route.faults.recovered("inline-overflow")
            for email_id in ids:
                self._pending[email_id] = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="outbox-inline",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def started(self) -> bool:
        """Whether the worker thread ever ran in this process."""
        return self._thread is not None

    def alive(self) -> bool:
        """Whether the worker thread is still running (a batch may be in flight)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def idle(self) -> bool:
        """No id pending, none being delivered, no in-process retry waiting."""
        with self._cond:
            return not self._pending and not self._busy and not self._retries

    def wait_idle(self, timeout: float) -> bool:
        """Wait until :meth:`idle`; True when it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy or self._retries:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self._thread is None or not self._thread.is_alive()):
                    return not (self._pending or self._busy or self._retries)
                self._cond.wait(min(remaining, 0.5))
            return True

    def stop(self, timeout: float) -> None:
        """Stop taking work; wait up to ``timeout`` for the batch in flight."""
        with self._cond:
            self._stopping = True
            # Handed over after commit (or waiting for an in-process retry) and
            # not claimed: queued in the database and in flight nowhere.
            self.route.note_given_back([*self._pending, *self._retries])
            self._pending.clear()
            self._retries.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout / 2)
            if thread.is_alive():
                # Messages not yet handed to the server are released now.
                self.route.release_unstarted()
                thread.join(timeout / 2)

    def _next_batch(self) -> list[int] | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                for email_id, (due, _) in list(self._retries.items()):
                    if due <= now:
                        self._pending[email_id] = None
                if self._pending:
                    batch = list(itertools.islice(self._pending, self.config.batch_size))
                    for email_id in batch:
                        del self._pending[email_id]
                    self._busy = True
                    return batch
                waits = [due - now for due, _ in self._retries.values()]
                self._cond.wait(min(waits) if waits else None)

    def _take_ahead(self) -> list[int] | None:
        """The next batch, without waiting, when ids wait beyond a full batch."""
        with self._cond:
            if self._stopping or not self.claim_ahead or len(self._pending) < 2:
                return None
            batch = list(itertools.islice(self._pending, self.config.batch_size))
            for email_id in batch:
                del self._pending[email_id]
            return batch

    #: Claim the next batch while one is sent (as the durable dispatcher does).
    claim_ahead = True

    def _claim_ids(self, ids: Sequence[int]) -> tuple[list[ClaimedEmail], Reaped]:
        claimed = self.route.store.claim_ids(ids, owner=new_owner(),
                                             lease_seconds=self.config.lease_seconds)
        return claimed, Reaped()

    def _run(self) -> None:
        ahead: tuple[list[int], ClaimAhead] | None = None
        try:
            while True:
                claimed: Sequence[ClaimedEmail] | None = None
                if ahead is not None:
                    (batch, claiming), ahead = ahead, None
                    try:
                        claimed = claiming.result()[0]
                    except Exception:  # noqa: BLE001 - durability: ok nothing was claimed; _deliver claims again and reports
                        claimed = None
                    if self._stopping:  # read after the claim: stop() may have come meanwhile
                        self.route.release_ahead(claiming)
                        return
                else:
                    next_batch = self._next_batch()
                    if next_batch is None:
                        return
                    batch = next_batch
                more = self._take_ahead() if len(batch) >= self.config.batch_size else None
                if more:
                    ahead = (more, self.route.claim_ahead(functools.partial(
                        self._claim_ids, more)))
                try:
                    self._deliver(batch, claimed)
                finally:
                    with self._cond:
                        self._busy = ahead is not None
                        self._cond.notify_all()
        finally:
            if ahead is not None:
                self.route.release_ahead(ahead[1])
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _deliver(self, batch: list[int], claimed: Sequence[ClaimedEmail] | None = None) -> None:
        retry_numbers = {i: self._retries.get(i, (0.0, 0))[1] for i in batch}
        # Rows this process will retry in a moment stay due now; the others
        # get the retry policy's backoff and are left to the periodic sweep.
        retry_now = {i for i, n in retry_numbers.items() if n < self.config.inline_retries}
        try:
            with self.route.app.app_context():
                report = self.route.deliver_ids(batch, claimed, retry_now=retry_now)
            self.route.faults.recovered("inline-drain")
        except Exception as exc:  # noqa: BLE001 - reported; the rows stay in the database
            with self._cond:
                for email_id in batch:
                    self._retries.pop(email_id, None)
            self.route.faults.failing(
                "inline-drain", "Inline delivery could not claim or record a batch",
                consequence=(f"{len(batch)} committed email(s) were not delivered by this "
                             "process; they stay queued (or sending until their lease "
                             "expires) and the periodic sweep takes them after "
                             f"OUTBOX_SWEEP_MIN_AGE_SECONDS ({self.config.sweep_min_age_seconds:g} s)"),
                fix="check the database connection and the outbox tables "
                    "(`flask db upgrade outbox@head`); run `flask outbox sweep` once it is fixed",
                exc=exc)
            return
        with self._cond:
            for email_id in itertools.chain(report.sent, report.failed, report.lost,
                                            report.not_claimed):
                self._retries.pop(email_id, None)
            for email_id, attempt, error in report.transient:
                retry = retry_numbers.get(email_id, 0) + 1
                if email_id in retry_now and not self._stopping:
                    # A throttling server asked for a pause: retry when the row is due
                    # again, not in a quarter of a second.
                    pause = _retry.THROTTLE_DELAY_SECONDS if error.throttled else inline_backoff(retry)
                    self._retries[email_id] = (time.monotonic() + pause, retry)
                    continue
                self._retries.pop(email_id, None)
                policy = self.route.policy
                when = ("due again now: this process stopped before retrying it"
                        if email_id in retry_now else
                        "due again after its retry backoff, OUTBOX_RETRY_BASE_SECONDS doubling "
                        "per attempt up to OUTBOX_RETRY_MAX_SECONDS, or in a few seconds with "
                        "its attempt given back if the server was throttling")
                if self._stopping and email_id in retry_now:
                    # Due now and not retried here because this process stops: stop()
                    # marks it for the next sweep of any process.
                    self.route.note_given_back([email_id])
                _degrade.report(
                    f"Email {email_id} could not be delivered after {attempt} attempt(s): "
                    f"{error}",
                    consequence=f"it stays queued ({when}); the periodic sweep (every "
                                "OUTBOX_SWEEP_INTERVAL_SECONDS) or a durable dispatcher takes "
                                "it when due, and it is dead-lettered if attempt "
                                f"{policy.max_attempts} (OUTBOX_MAX_ATTEMPTS) fails too",
                    fix="check MAIL_SERVER/MAIL_PORT and that the SMTP server accepts mail; "
                        "`flask outbox status` shows what waits")
        # A finished keyed email handed its key to the next one: offer that one now.
        promoted = report.holders
        if promoted:
            with self._cond:
                for email_id in promoted:
                    if email_id not in self._retries:
                        self._pending[email_id] = None
