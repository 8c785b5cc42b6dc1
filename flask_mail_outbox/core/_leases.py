"""The lease cycle: claim, renew, record, release, reap; nothing about SMTP.

Each transaction is short and never spans a network call to the mail server:

* the claim is the compare-and-set ``queued -> sending`` with a lease, the
  single gate every delivery route goes through: :meth:`Leases.claim_ids` and
  :meth:`Leases.claim_due` (their SQL is :mod:`._claim`'s);
* :meth:`Leases.renew_leases` is the heartbeat of rows still being sent;
* :meth:`Leases.record` writes outcomes, guarded: it only changes a row that
  is still ``sending`` under the claim's owner token, so a sender that lost
  its lease can never overwrite what a later claim recorded;
* :meth:`Leases.release` releases rows claimed and never sent, and
  :meth:`Leases.reap_expired` queues rows whose lease ran out.

Every write here that can change a key's line applies :mod:`._ordering`'s
rule in the same transaction.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import _degrade
from ..transports import FailedOver
from . import _claim, _ordering
from ._claim import CLAIM_RETURNING
from ._database import Database
from ._models import ENDED, Status, email_table

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Interception:
    """What staging (:mod:`._intercept`) made of one attempt: its envelope, bytes, notes."""

    recipients: tuple[str, ...]
    mime: bytes
    notes: tuple[str, ...]
    #: Addresses its To and Cc headers name that its envelope does not go to: a
    #: transport that addresses by the headers (a JSON API) leaves them out too.
    left_out: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ClaimedEmail:
    """A row this process holds a lease on, with what the transport needs."""

    id: int
    owner: str
    attempt: int
    sender: str
    recipients: tuple[str, ...]
    mime: bytes
    message_id: str
    key: str | None
    error_history: tuple[dict[str, Any], ...]
    # When send() queued it (naive UTC): email_sent's ``created_at``, for latency metrics.
    created_at: datetime | None = None
    # ESMTP parameters for MAIL FROM and each RCPT TO (Message's mail/rcpt_options).
    mail_options: tuple[str, ...] = ()
    rcpt_options: tuple[str, ...] = ()
    #: The named transport that sends it (OUTBOX_TRANSPORTS).
    transport: str = "default"
    #: Recipients on the suppression list, left out of the envelope: (address, reason).
    suppressed: tuple[tuple[str, str], ...] = ()
    #: ``send(expires_after=...)``: not delivered by then, it ends expired (naive UTC).
    expires_at: datetime | None = None
    #: What staging made of this attempt (``_intercept``): None when it left it untouched.
    interception: Interception | None = None
    #: The W3C trace context of its PRODUCER span (OUTBOX_OTEL), read by the claim:
    #: ``traceparent`` and ``tracestate``, None when it was queued untraced.
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def deliverable(self) -> tuple[str, ...]:
        """The recipients the transport is given: all but the suppressed ones."""
        if not self.suppressed:
            return self.recipients
        left_out = {address for address, _ in self.suppressed}
        return tuple(r for r in self.recipients if r not in left_out)

    @property
    def throttle_deferrals(self) -> int:
        """Throttled attempts given back so far (the retry policy bounds them)."""
        return sum(1 for entry in self.error_history if entry.get("deferred"))

    @property
    def ambiguous_attempts(self) -> int:
        """Attempts so far that may have delivered it (a drop after the final dot...)."""
        return sum(1 for entry in self.error_history if entry.get("maybe_sent"))


@dataclasses.dataclass(frozen=True)
class Reaped:
    """Rows whose lease had expired, queued again (a spent one fails at its next claim)."""

    requeued: tuple[int, ...] = ()
    #: Their ordering keys (see :meth:`Leases.claim_due`).
    keys: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self.requeued)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What to record for one claimed row.

    ``status`` is the row's next status: ``sent``, ``failed``, or ``queued``
    (a transient failure, due again ``due_in`` seconds from now on the
    database clock, or at once; or a release with
    ``give_back_attempt`` when the send never started). ``deferred``: a
    throttle deferral, marked so in the error history (see
    :attr:`ClaimedEmail.throttle_deferrals`).
    """

    email: ClaimedEmail
    status: Status
    error_code: int = 0
    error_message: str | None = None
    due_in: float | None = None
    give_back_attempt: bool = False
    deferred: bool = False
    #: The transports this attempt failed over from (written to the error history).
    failovers: tuple[FailedOver, ...] = ()
    #: The provider's id of the delivered message, when it gave one.
    provider_message_id: str | None = None
    #: Recipients the server refused as nonexistent: (address, its reply).
    unknown_recipients: tuple[tuple[str, str], ...] = ()
    #: The attempt may have delivered it (see :attr:`ClaimedEmail.ambiguous_attempts`).
    maybe_sent: bool = False


class Recorded(NamedTuple):
    """What :meth:`Leases.record` wrote: outcomes recorded and lost, and new key holders.

    ``lost``: rows no longer ``sending`` under their claim (another claim took
    them after their lease expired). ``holders``: ids that now hold their key
    (:func:`._ordering.advance`): due ones are the next to claim.
    """

    recorded: list[Outcome]
    lost: list[Outcome]
    holders: list[int]


class Leases:
    """The lease cycle's write transactions (see the module docstring), on ``db``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def claim_ids(self, ids: Sequence[int], *, owner: str, lease_seconds: float,
                  conn: Connection | None = None) -> list[ClaimedEmail]:
        """Claim those of ``ids`` that are due and first in their key's order.

        One ``UPDATE ... RETURNING``: ``queued -> sending``, ``attempts + 1``,
        a lease under ``owner``. A row another delivery claimed first, or one
        not yet due, or one with an earlier unfinished email of the same key,
        is simply not returned.
        """
        if not ids:
            return []
        t = email_table
        stmt = (
            t.update()
            .where(t.c.id.in_(list(ids)), self.db.dialect.claimable(self.db.now_expr))
            .values(**self.db.dialect.claim_values(self.db.clock, owner, lease_seconds))
            .returning(*CLAIM_RETURNING)
        )
        with self.db.write(conn) as tx:
            rows = tx.execute(stmt).all()
        return self._claimed(rows, owner)

    def claim_due(self, limit: int, *, owner: str, lease_seconds: float,
                  reap: bool = False, transport: str = "default",
                  conn: Connection | None = None) -> tuple[list[ClaimedEmail], Reaped]:
        """One dispatcher tick's database work: reap once, then claim up to ``limit``.

        Due rows of ``transport`` are taken by priority, then oldest first
        (``priority, due_at, id``); only keyless rows and key holders are
        candidates, read from the partial index that holds exactly those.

        * PostgreSQL: ONE statement, in autocommit: the reap and the claim are
          data-modifying CTEs (:data:`._claim.PG_CLAIM_AND_REAP`), ``FOR UPDATE
          SKIP LOCKED``, so concurrent dispatchers never wait for each other
          nor take one row twice. An idle tick is one round trip.
        * SQLite: ``BEGIN IMMEDIATE``, the reap, the claim (:data:`._claim.SQLITE_PICK`).

        ``reap``: also queue rows whose lease expired again (see
        :meth:`reap_expired`). ``conn`` is the dispatcher's own long-lived connection (no pool
        checkout and pre-ping per tick). Returns ``(claimed, reaped)``.
        """
        if conn is None:
            with self.db.dispatch_connection() as own:
                return self.claim_due(limit, owner=owner, lease_seconds=lease_seconds,
                                      reap=reap, transport=transport, conn=own)
        rows, reaped_rows, ordered = self.db.dialect.claim_due(
            conn, limit=limit, owner=owner, lease_seconds=lease_seconds, reap=reap,
            transport=transport, clock=self.db.clock)
        reaped = _reaped(reaped_rows)
        if reaped.keys and not ordered:
            self._advance_reaped(reaped)
        return self._claimed(rows, owner), reaped

    def next_expiry(self, conn: Connection) -> float | None:
        """Seconds until the earliest lease of a ``sending`` row runs out (None: no such row).

        A dispatcher that waits on NOTIFY asks this when its claim found
        nothing: a process that died holding rows sends no NOTIFY, so the
        waiting one wakes when their lease runs out instead of at its backstop.
        Both times are the database clock's; one lookup on the lease index.
        """
        t = email_table
        soonest, now = conn.execute(sa.select(sa.func.min(t.c.lease_expires_at),
                                              self.db.now_expr())
                                    .where(t.c.status == "sending")).one()
        if soonest is None:
            return None
        return max(0.0, float((soonest - now).total_seconds()))

    def _advance_reaped(self, reaped: Reaped) -> None:
        """Order the keys of rows the PostgreSQL claim reaped, after it committed.

        A reaped holder keeps its flag, so nothing waits on this; it only
        lets an email put back below it go first. Rare (a process died), and
        a failure must not lose the claimed batch: it is reported, not raised.
        """
        try:
            with self.db.write() as conn:
                _ordering.advance(conn, reaped.keys)
        except sa.exc.SQLAlchemyError as exc:
            _degrade.report(
                f"Could not order the keys of {len(reaped.requeued)} reaped email(s) again",
                consequence="each goes out again before any dead letter of its key put back "
                            "below it; nothing is lost or stuck",
                fix="check the database connection", exc=exc)

    def reap_expired(self, ids: Sequence[int] | None = None) -> Reaped:
        """Queue ``sending`` rows whose lease expired again (``ids``: only those).

        Their attempt stays charged; one whose attempts are spent is
        dead-lettered by the delivery that claims it next, without a send
        (see :func:`._delivery.outcome_for`). Nothing here changes a key's
        line but the order of a holder and an email put back below it.
        """
        with self.db.write() as conn:
            reaped = self._reap(conn, ids)
            _ordering.advance(conn, reaped.keys)
            return reaped

    def _reap(self, conn: Connection, ids: Sequence[int] | None = None) -> Reaped:
        return _reaped(conn.execute(_claim.reap_statement(self.db.now_expr, ids)).all())

    def release(self, claimed: Sequence[ClaimedEmail]) -> list[int]:
        """Release rows claimed but never handed to the transport (attempt returned).

        Returns the ids released (a row whose lease another claim took is not).
        """
        outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True) for email in claimed]
        return [outcome.email.id for outcome in self.record(outcomes).recorded]

    def _claimed(self, rows: Sequence[Any], owner: str) -> list[ClaimedEmail]:
        """The claimed rows, in the order they are to be sent (:func:`._claim.send_order`)."""
        if logger.isEnabledFor(logging.DEBUG):
            for row in rows:
                logger.debug("Email %d claimed for attempt %d on transport %r (lease owner %s)",
                             row.id, row.attempts, row.transport, owner)
        claimed = []
        for row in sorted(rows, key=_claim.send_order):
            options = json.loads(row.smtp_options) if row.smtp_options else {}
            claimed.append(ClaimedEmail(
                id=row.id, owner=owner, attempt=row.attempts, sender=row.sender,
                recipients=tuple(json.loads(row.recipients)), mime=row.mime or b"",
                message_id=row.message_id, key=row.key,
                error_history=tuple(json.loads(row.error_history or "[]")),
                created_at=row.created_at,
                mail_options=tuple(options.get("mail", ())),
                rcpt_options=tuple(options.get("rcpt", ())),
                transport=row.transport,
                expires_at=row.expires_at,
                traceparent=row.traceparent, tracestate=row.tracestate,
            ))
        return claimed

    def due_in(self, ids: Sequence[int]) -> list[tuple[int, float]]:
        """Seconds until each of ``ids`` still ``queued`` is due (0 or less: due now).

        Measured on the claim's own "now" (the database clock on PostgreSQL),
        so a worker that waits this long finds the row claimable whatever its
        host's clock says. Rows no longer queued (sent, cancelled) are left out.
        """
        t = email_table
        unique = sorted(set(ids))
        found: list[tuple[int, float]] = []
        with self.db.read() as conn:
            for start in range(0, len(unique), 500):
                chunk = unique[start:start + 500]
                rows = conn.execute(
                    sa.select(t.c.id, t.c.due_at, self.db.now_expr().label("now"))
                    .where(t.c.id.in_(chunk), t.c.status == Status.QUEUED.value)).all()
                found += [(int(row.id), (row.due_at - row.now).total_seconds())
                          for row in rows]
        return found

    def renew_leases(self, owner: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still ``sending`` under ``owner``; returns how many.

        A lease that ran out but that no reap took yet is ``owner``'s again:
        the update and a reap are compare-and-sets on the same row, and
        whichever commits first wins.
        """
        if not ids:
            return 0
        t = email_table
        with self.db.write() as conn:
            rows = conn.execute(
                t.update()
                .where(t.c.id.in_(list(ids)), t.c.lease_owner == owner,
                       t.c.status == Status.SENDING.value)
                .values(lease_expires_at=self.db.later_expr(lease_seconds))
                .returning(t.c.id)
            ).all()
        return len(rows)

    def record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False,
               conn: Connection | None = None,
               then: Callable[[Connection, list[Outcome]], None] | None = None) -> Recorded:
        """Write outcomes in one transaction (see :meth:`_record`), on ``conn`` if given.

        On PostgreSQL a deadlock with another transaction is retried: the
        guarded updates make a second run equivalent to the first.
        """
        tries = 0
        while True:
            try:
                return self._record(outcomes, scrub_sent=scrub_sent, conn=conn, then=then)
            except sa.exc.OperationalError as exc:
                tries += 1
                if getattr(exc.orig, "sqlstate", None) != "40P01" or tries >= 3:
                    raise

    def _record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False,
                conn: Connection | None = None,
                then: Callable[[Connection, list[Outcome]], None] | None = None) -> Recorded:
        """Write outcomes in one transaction.

        Every update is guarded by ``status = 'sending' AND lease_owner =
        owner`` (the owner token is unique per claim, so it also pins the
        attempt). A row that no longer matches lost its lease: another claim
        owns it now, and its outcome is not overwritten. With ``scrub_sent``
        (``OUTBOX_SCRUB_SENT``) a row that becomes ``sent`` loses its MIME in
        the same UPDATE, so no committed ``sent`` row ever still holds a body.
        The outcomes' keys are advanced in the same transaction (a finished
        email gives its key to the next one, see :mod:`._ordering`), and
        ``then(tx, recorded)`` writes what goes with them (delivery events).
        """
        with self.db.write(conn) as tx:
            keys = _ordering.lock_lines(tx, {o.email.key for o in outcomes
                                             if o.email.key is not None})
            recorded, lost = self._write_outcomes(tx, outcomes, scrub_sent)
            if then is not None:
                then(tx, recorded)
            # Last: on PostgreSQL it sets a lock timeout for the rest of the transaction.
            holders = self._advance_recorded(tx, keys)
        if logger.isEnabledFor(logging.DEBUG):
            for outcome in recorded:
                logger.debug("Email %d attempt %d recorded %s%s", outcome.email.id,
                             outcome.email.attempt, outcome.status.value, _due(outcome))
            for outcome in lost:
                logger.debug("Email %d attempt %d not recorded: its lease was lost (another "
                             "claim owns it now)", outcome.email.id, outcome.email.attempt)
        return Recorded(recorded, lost, holders)

    def _write_outcomes(self, tx: Connection, outcomes: Sequence[Outcome],
                        scrub_sent: bool) -> tuple[list[Outcome], list[Outcome]]:
        """The guarded updates of :meth:`_record`: ``(recorded, lost)``.

        The plain ``sent`` ones in one statement (the database's
        :meth:`._dialect.Dialect.record_sent`), then one update each.
        """
        recorded: list[Outcome] = []
        lost: list[Outcome] = []
        plain_sent = [outcome for outcome in outcomes if _plain_sent(outcome)]
        others = [outcome for outcome in outcomes if not _plain_sent(outcome)]
        if plain_sent:
            done = self.db.dialect.record_sent(
                tx, [(o.email.id, o.email.owner, o.provider_message_id) for o in plain_sent],
                scrub=scrub_sent, clock=self.db.clock)
            for outcome in plain_sent:
                (recorded if outcome.email.id in done else lost).append(outcome)
        # Built only when needed: a function construct costs a few percent of
        # a batch that is all sent.
        now = self.db.now_expr() if others else None
        t = email_table
        for outcome in others:
            hit = tx.execute(
                t.update()
                .where(t.c.id == outcome.email.id, t.c.status == Status.SENDING.value,
                       t.c.lease_owner == outcome.email.owner)
                .values(**self._outcome_values(outcome, now, scrub_sent))
                .returning(t.c.id)
            ).first()
            (recorded if hit is not None else lost).append(outcome)
        return recorded, lost

    def _advance_recorded(self, tx: Connection, keys: Sequence[str]) -> list[int]:
        """Hand the recorded outcomes' keys on, never waiting on a request (PostgreSQL).

        A request's uncommitted ``cancel()`` holds the row lock of the email it
        cancels, which may be its key's next one: delivery must not wait for
        the request (leases would run out meanwhile). Past a short lock timeout
        the key is left to that request, whose commit or rollback hands it on
        (:meth:`._producer.Producer.after_commit` or :meth:`~._producer.Producer.forget`);
        the sweep's key repair is the backstop.
        """
        holders = self.db.dialect.advance_unblocked(tx, sorted(set(keys)))
        if holders is None:
            logger.info("Left keys %s to a transaction that holds their next email (a "
                        "cancel() not yet committed): it hands them on when it ends",
                        sorted(keys)[:20])
            return []
        return holders

    def _outcome_values(self, outcome: Outcome, now: Any, scrub_sent: bool) -> dict[str, Any]:
        """The SET of one outcome's update (everything but a plain ``sent``)."""
        t = email_table
        values: dict[str, Any] = {"status": outcome.status.value, "lease_owner": None,
                                  "lease_expires_at": None}
        if outcome.status is Status.SENT:
            values["sent_at"] = now
            values["provider_message_id"] = outcome.provider_message_id
            if scrub_sent:
                values["mime"] = None
        if outcome.status is Status.FAILED:
            values["failed_at"] = now
        if outcome.status in ENDED:
            values["ended_at"] = now
            if scrub_sent:  # never sent, and never will be: done with, as a sent one
                values["mime"] = None
        if outcome.status is Status.QUEUED:
            values["due_at"] = self.db.later_expr(outcome.due_in) if outcome.due_in else now
        if outcome.give_back_attempt:
            values["attempts"] = t.c.attempts - 1
        at = self.db.clock().isoformat(timespec="seconds") + "Z"
        entries: list[dict[str, Any]] = [
            {"code": step.error.code, "message": step.error.message, "at": at,
             "attempt": outcome.email.attempt, "transport": step.transport,
             "failed_over_to": step.to} for step in outcome.failovers]
        if outcome.error_message is not None:
            values["last_error"] = _error_text(outcome.error_code, outcome.error_message)
            entry: dict[str, Any] = {
                "code": outcome.error_code, "message": outcome.error_message,
                "at": at, "attempt": outcome.email.attempt}
            if outcome.deferred:
                entry["deferred"] = True
            if outcome.maybe_sent:
                entry["maybe_sent"] = True
            entries.append(entry)
        if entries:
            values["error_history"] = json.dumps([*outcome.email.error_history, *entries])
        return values


def _due(outcome: Outcome) -> str:
    """The rest of a recorded outcome's DEBUG line: when it is due again, and why."""
    said = (f" ({_degrade.unaddressed(_error_text(outcome.error_code, outcome.error_message))})"
            if outcome.error_message else "")
    if outcome.status is Status.QUEUED:
        again = f"due again in {outcome.due_in:.0f} s" if outcome.due_in else "due again now"
        back = ", attempt given back" if outcome.give_back_attempt else ""
        return f", {again}{back}{said}"
    return said


def _plain_sent(outcome: Outcome) -> bool:
    """Sent, with nothing to add to its error history: one statement records all such."""
    return outcome.status is Status.SENT and not outcome.error_message \
        and not outcome.failovers


def _reaped(rows: Sequence[Any]) -> Reaped:
    return Reaped(requeued=tuple(int(r.id) for r in rows),
                  keys=frozenset(str(r.key) for r in rows if r.key is not None))


def _error_text(code: int, message: str) -> str:
    return f"{code} {message}" if code else message
