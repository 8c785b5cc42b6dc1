"""The write transactions of delivery, on the store's own engine; nothing about SMTP.

Each is short and never spans a network call to the mail server:

* the claim is the compare-and-set ``queued -> sending`` with a lease, the
  single gate every delivery route goes through: :meth:`Store.claim_ids` and
  :meth:`Store.claim_due` (their statements are :mod:`._claim`'s);
* :meth:`Store.renew_leases` is the heartbeat of rows still being sent;
* :meth:`Store.record` writes outcomes, guarded: it only changes a row that is
  still ``sending`` under the claim's owner token, so a sender that lost its
  lease can never overwrite what a later claim recorded;
* then the work outside the lease cycle: the sweep's selection and repairs,
  dead letters put back or deleted, old ``sent`` rows deleted, shared
  settings written.

Elsewhere: the insert that ``send()`` runs in the caller's session is
:mod:`._insert`'s, the reads are :mod:`._queries`'s, and the per-key order
rule is :mod:`._ordering`'s: every write here that can change a key's line
calls it in the same transaction.

Timestamps are naive UTC, on :mod:`._clock`'s clocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .. import _degrade
from ..transports import FailedOver
from . import _claim, _ordering
from ._claim import CLAIM_RETURNING
from ._clock import now_expr, utcnow
from ._models import Status, attachment_table, email_table, event_table, setting_table

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
    #: Their ordering keys (see :meth:`Store.claim_due`).
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
    """What :meth:`Store.record` wrote: outcomes recorded and lost, and new key holders.

    ``lost``: rows no longer ``sending`` under their claim (another claim took
    them after their lease expired). ``holders``: ids that now hold their key
    (:func:`._ordering.advance`): due ones are the next to claim.
    """

    recorded: list[Outcome]
    lost: list[Outcome]
    holders: list[int]


#: ``lease_owner`` of a ``queued`` row that a stopping process gave back, or
#: had been handed after a commit and never claimed: provably in flight
#: nowhere, so the sweep takes it whatever its age. No claim owner looks like
#: it (those are ``host:pid:n:hex``), and a claim overwrites it.
GIVEN_BACK = "given-back"

#: The ``lease_owner`` marks of queued rows in flight nowhere, which the sweep's
#: age gate does not hold back: given back at a stop, or scheduled by ``send_after``.
_UNGATED = (GIVEN_BACK, _claim.SCHEDULED)

#: Keys :meth:`Store.retry_all_failed` puts back per transaction (one
#: advisory lock each on PostgreSQL, held until the transaction ends).
RETRY_ALL_KEYS_PER_TRANSACTION = 500


class Store:
    """Delivery's write transactions on the outbox's own engine.

    The lease cycle (claim, reap, renew, record, release), then the sweep's
    selection and repairs, dead letters, retention and settings.
    """

    def __init__(self, engine: Engine, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.is_postgres = engine.dialect.name == "postgresql"
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._pg_claims: dict[bool, Any] = {}
        self._record_sent_statements: dict[tuple[bool, bool], Any] = {}

    # -- time -----------------------------------------------------------------

    def now_expr(self) -> sa.ColumnElement[datetime]:
        """"Now" as SQL: the database clock on PostgreSQL, ``clock()`` elsewhere."""
        return now_expr(self.engine.dialect.name, self.clock)

    def later_expr(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``now + seconds`` as SQL, on the same clock as :meth:`now_expr`."""
        if self.is_postgres:
            return self.now_expr() + sa.literal(timedelta(seconds=seconds), sa.Interval())
        return sa.literal(self.clock() + timedelta(seconds=seconds), sa.DateTime())

    # -- transactions ---------------------------------------------------------

    @contextmanager
    def write(self, conn: Connection | None = None) -> Iterator[Connection]:
        """A short write transaction on ``conn`` (a kept one), else on a new connection.

        On SQLite it starts with ``BEGIN IMMEDIATE``: a deferred transaction
        that reads and then writes fails with SQLITE_BUSY whatever the busy
        timeout, while an immediate one waits for the write lock.
        """
        if conn is None:
            with self.engine.connect() as own, self.write(own) as tx:
                yield tx
            return
        if self.is_sqlite:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.rollback()
            raise
        conn.commit()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads (autocommit on PostgreSQL: no BEGIN/ROLLBACK trips)."""
        with self.engine.connect() as conn:
            if self.is_postgres:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    # -- the lease cycle ------------------------------------------------------

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
            .where(t.c.id.in_(list(ids)), _claim.claimable(self.now_expr, sqlite=self.is_sqlite))
            .values(**self._claim_values(owner, lease_seconds))
            .returning(*CLAIM_RETURNING)
        )
        with self.write(conn) as tx:
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
          data-modifying CTEs; the ids are picked in a materialized CTE with
          ``FOR UPDATE SKIP LOCKED`` (the fence keeps the planner from updating
          more rows than the limit), so concurrent dispatchers never wait for
          each other nor take one row twice. An idle tick is one round trip.
        * SQLite: ``BEGIN IMMEDIATE``, the reap, the claim: three statements.

        ``reap``: also queue rows whose lease expired again (see
        :meth:`reap_expired`). ``conn`` is the dispatcher's own long-lived connection (no pool
        checkout and pre-ping per tick). Returns ``(claimed, reaped)``.
        """
        if conn is None:
            with self.dispatch_connection() as own:
                return self.claim_due(limit, owner=owner, lease_seconds=lease_seconds,
                                      reap=reap, transport=transport, conn=own)
        t = email_table
        if not self.is_postgres:
            pick: Any = (_claim.sqlite_pick(self.clock(), limit, transport) if self.is_sqlite
                         else sa.select(t.c.id)
                         .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                                t.c.transport == transport)
                         .order_by(*_claim.CLAIM_ORDER).limit(limit))
            if self.is_sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                reaped = self._reap(conn) if reap else Reaped()
                _ordering.advance(conn, reaped.keys)
                rows = conn.execute(
                    t.update().where(t.c.id.in_(pick.scalar_subquery()))
                    .values(**self._claim_values(owner, lease_seconds))
                    .returning(*CLAIM_RETURNING)
                ).all()
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return self._claimed(rows, owner), reaped
        rows, reaped = self._claim_due_postgres(conn, limit, owner, lease_seconds, reap,
                                                transport)
        if reaped.keys:
            self._advance_reaped(reaped)
        return self._claimed(rows, owner), reaped

    def _advance_reaped(self, reaped: Reaped) -> None:
        """Order the keys of rows the PostgreSQL claim reaped, after it committed.

        A reaped holder keeps its flag, so nothing waits on this; it only
        lets an email put back below it go first. Rare (a process died), and
        a failure must not lose the claimed batch: it is reported, not raised.
        """
        try:
            with self.write() as conn:
                _ordering.advance(conn, reaped.keys)
        except sa.exc.SQLAlchemyError as exc:
            _degrade.report(
                f"Could not order the keys of {len(reaped.requeued)} reaped email(s) again",
                consequence="each goes out again before any dead letter of its key put back "
                            "below it; nothing is lost or stuck",
                fix="check the database connection", exc=exc)

    def _claim_due_postgres(self, conn: Connection, limit: int, owner: str,
                            lease_seconds: float, reap: bool,
                            transport: str) -> tuple[list[Any], Reaped]:
        """The PostgreSQL claim (and reap): one statement, in autocommit."""
        stmt = self._pg_claim_statement(reap=reap)
        params: dict[str, Any] = {"claim_transport": transport, "claim_limit": limit,
                                  "claim_owner": owner,
                                  "claim_lease": timedelta(seconds=lease_seconds)}
        rows = conn.execute(stmt, params).all()
        conn.commit()  # a no-op in autocommit; ends SQLAlchemy's transaction marker
        reaped = [r for r in rows if r.outcome == Status.QUEUED.value]
        return ([row for row in rows if row.outcome == Status.SENDING.value],
                Reaped(requeued=tuple(int(r.id) for r in reaped),
                       keys=frozenset(str(r.key) for r in reaped if r.key is not None)))

    def _pg_claim_statement(self, *, reap: bool) -> Any:
        """The claim (and reap) statement, built once: a tick only binds its values.

        Built per tick it cost about as much Python as the database spent
        running it (a claim of 20 key heads: 6 of 11 ms).
        """
        built = self._pg_claims.get(reap)
        if built is None:
            built = self._pg_claims[reap] = _claim.pg_claim(self.now_expr, reap=reap)
        return built

    def dispatch_connection(self) -> Connection:
        """A connection for :meth:`claim_due` (autocommit on PostgreSQL: one statement)."""
        conn = self.engine.connect()
        if self.is_postgres:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    def reap_expired(self, ids: Sequence[int] | None = None) -> Reaped:
        """Queue ``sending`` rows whose lease expired again (``ids``: only those).

        Their attempt stays charged; one whose attempts are spent is
        dead-lettered by the delivery that claims it next, without a send
        (see :func:`._delivery.outcome_for`). Nothing here changes a key's
        line but the order of a holder and an email put back below it.
        """
        with self.write() as conn:
            reaped = self._reap(conn, ids)
            _ordering.advance(conn, reaped.keys)
            return reaped

    def _reap(self, conn: Connection, ids: Sequence[int] | None = None) -> Reaped:
        rows = conn.execute(_claim.reap_statement(self.now_expr, ids)).all()
        return Reaped(requeued=tuple(int(r.id) for r in rows),
                      keys=frozenset(str(r.key) for r in rows if r.key is not None))

    def release(self, claimed: Sequence[ClaimedEmail]) -> list[int]:
        """Give back rows claimed but never handed to the transport (attempt returned).

        Returns the ids given back (a row whose lease another claim took is not).
        """
        outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True) for email in claimed]
        return [outcome.email.id for outcome in self.record(outcomes).recorded]

    def _claim_values(self, owner: str, lease_seconds: float) -> dict[str, Any]:
        t = email_table
        return {"status": Status.SENDING.value, "attempts": t.c.attempts + 1,
                "lease_owner": owner, "lease_expires_at": self.later_expr(lease_seconds)}

    def _claimed(self, rows: Sequence[Any], owner: str) -> list[ClaimedEmail]:
        """The claimed rows, in the order they are to be sent (:func:`._claim.send_order`)."""
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
        with self.read() as conn:
            for start in range(0, len(unique), 500):
                chunk = unique[start:start + 500]
                rows = conn.execute(
                    sa.select(t.c.id, t.c.due_at, self.now_expr().label("now"))
                    .where(t.c.id.in_(chunk), t.c.status == Status.QUEUED.value)).all()
                found += [(int(row.id), (row.due_at - row.now).total_seconds())
                          for row in rows]
        return found

    def advance_keys(self, keys: Iterable[str]) -> list[int]:
        """Apply the per-key rule to ``keys`` in a short transaction of its own (after a cancel)."""
        wanted = sorted(set(keys))
        if not wanted:
            return []
        with self.write() as conn:
            return _ordering.advance(conn, wanted)

    def renew_leases(self, owner: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still ``sending`` under ``owner``; returns how many.

        A lease that ran out but that no reap took yet is ``owner``'s again:
        the update and a reap are compare-and-sets on the same row, and
        whichever commits first wins.
        """
        if not ids:
            return 0
        t = email_table
        with self.write() as conn:
            rows = conn.execute(
                t.update()
                .where(t.c.id.in_(list(ids)), t.c.lease_owner == owner,
                       t.c.status == Status.SENDING.value)
                .values(lease_expires_at=self.later_expr(lease_seconds))
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
        recorded: list[Outcome] = []
        lost: list[Outcome] = []
        plain_sent: list[Outcome] = []
        others: list[Outcome] = []
        for outcome in outcomes:
            if outcome.status is Status.SENT and not outcome.error_message \
                    and not outcome.failovers and (outcome.provider_message_id is None
                                                   or self.is_postgres or self.is_sqlite):
                plain_sent.append(outcome)
            else:
                others.append(outcome)
        with self.write(conn) as tx:
            keys = _ordering.lock_lines(tx, {o.email.key for o in outcomes
                                             if o.email.key is not None})
            if plain_sent:
                done = self._record_sent(tx, plain_sent, scrub=scrub_sent)
                for outcome in plain_sent:
                    (recorded if outcome.email.id in done else lost).append(outcome)
            # Built only when needed: a function construct costs a few percent of
            # a batch that is all sent.
            now = self.now_expr() if others else None
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
            if then is not None:
                then(tx, recorded)
            # Last: on PostgreSQL it sets a lock timeout for the rest of the transaction.
            holders = self._advance_recorded(tx, keys)
        return Recorded(recorded, lost, holders)

    def _advance_recorded(self, tx: Connection, keys: Sequence[str]) -> list[int]:
        """Hand the recorded outcomes' keys on, never waiting on a request (PostgreSQL).

        A request's uncommitted ``cancel()`` holds the row lock of the email it
        cancels, which may be its key's next one: delivery must not wait for
        the request (leases would run out meanwhile). Past a short lock timeout
        the key is left to that request, whose commit or rollback hands it on
        (see ``_flask.state``); the sweep's key repair is the backstop.
        """
        if not keys or not self.is_postgres:
            return _ordering.advance(tx, keys, locked=True)
        # One round trip more than the plain advance: the savepoint and the timeout
        # (how long to wait for a row a request locked) together; the timeout lasts
        # to the commit, and nothing runs after this.
        tx.exec_driver_sql("SAVEPOINT outbox_advance; SET LOCAL lock_timeout = '200ms'")
        try:
            return _ordering.advance(tx, keys, locked=True)
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
                raise
            tx.exec_driver_sql("ROLLBACK TO SAVEPOINT outbox_advance")
            logger.info("Left keys %s to a transaction that holds their next email (a "
                        "cancel() not yet committed): it hands them on when it ends",
                        sorted(keys)[:20])
            return []

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
        if outcome.status is Status.QUEUED:
            values["due_at"] = self.later_expr(outcome.due_in) if outcome.due_in else now
        if outcome.give_back_attempt:
            values["attempts"] = t.c.attempts - 1
        at = self.clock().isoformat(timespec="seconds") + "Z"
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

    def _record_sent(self, conn: Connection, outcomes: list[Outcome], *,
                     scrub: bool) -> set[int]:
        """Mark ``outcomes``' rows ``sent``, each guarded by its own claim; the ids it changed.

        One statement for every claim the record holds (each row's id, owner
        token and provider message id), built once per store and only bound
        per record: building it per record, with the rendering of its IN
        list, would cost more than running it.

        The guard (still ``sending``, under this claim) is written inside a
        CASE so that it cannot steer the plan: a plain ``status = 'sending'``
        matches ``ix_outbox_email_lease``'s WHERE, and with a queue's stale
        statistics the planner reads that index, walking every dead 'sending'
        entry, instead of fetching the batch's ids from the primary key.
        """
        with_ids = any(o.provider_message_id is not None for o in outcomes)
        variant = (scrub, with_ids and not self.is_postgres)
        stmt = self._record_sent_statements.get(variant)
        if stmt is None:
            stmt = self._record_sent_statements[variant] = self._build_record_sent(*variant)
        params: dict[str, Any]
        if self.is_postgres:
            params = {"ids": [o.email.id for o in outcomes],
                      "owners": [o.email.owner for o in outcomes],
                      "pids": [o.provider_message_id for o in outcomes]}
        elif self.is_sqlite:
            params = {"pairs": json.dumps([(o.email.id, o.email.owner, o.provider_message_id)
                                           for o in outcomes]), "now": self.clock()}
        else:
            params = {"pairs": [(o.email.id, o.email.owner) for o in outcomes],
                      "now": self.clock()}
        return set(conn.execute(stmt, params).scalars().all())

    def _build_record_sent(self, scrub: bool, with_ids: bool) -> Any:
        t = email_table
        scrub_sql = ", mime = NULL" if scrub else ""
        if self.is_postgres:
            return sa.text(
                "UPDATE outbox_email AS e SET status = 'sent',"
                " sent_at = timezone('UTC', now()), lease_owner = NULL,"
                f" lease_expires_at = NULL, provider_message_id = c.pid{scrub_sql}"
                " FROM unnest(CAST(:ids AS bigint[]), CAST(:owners AS text[]),"
                " CAST(:pids AS text[])) AS c(id, owner, pid)"
                " WHERE e.id = c.id"
                " AND CASE WHEN e.status = 'sending' THEN e.lease_owner = c.owner END"
                " RETURNING e.id"
            ).columns(sa.column("id", sa.BigInteger()))
        if self.is_sqlite:
            # The rows as one JSON parameter, as unnest() takes arrays above: an
            # expanding IN of pairs is rendered anew for every record. (json_each
            # is JSON1, built into SQLite since 3.38 and into Python's builds before.)
            pid_sql = (", provider_message_id = (SELECT json_extract(value, '$[2]')"
                       " FROM json_each(:pairs) WHERE json_extract(value, '$[0]') = outbox_email.id)"
                       if with_ids else "")
            return sa.text(
                "UPDATE outbox_email SET status = 'sent', sent_at = :now, lease_owner = NULL,"
                f" lease_expires_at = NULL{pid_sql}{scrub_sql}"
                " WHERE status = 'sending' AND (id, lease_owner) IN"
                " (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')"
                "  FROM json_each(:pairs))"
                " RETURNING id"
            ).bindparams(sa.bindparam("now", type_=sa.DateTime())).columns(
                sa.column("id", sa.BigInteger()))
        return (t.update()
                .where(sa.tuple_(t.c.id, t.c.lease_owner).in_(
                           sa.bindparam("pairs", expanding=True)),
                       t.c.status == Status.SENDING.value)
                .values(status=Status.SENT.value, sent_at=sa.bindparam("now", type_=sa.DateTime()),
                        lease_owner=None, lease_expires_at=None,
                        **({"mime": None} if scrub else {}))
                .returning(t.c.id))

    # -- the sweep ------------------------------------------------------------

    def sweep_candidates(self, *, min_age_seconds: float,
                         limit: int) -> list[tuple[int, str]]:
        """Rows a sweep takes, oldest first (``created_at, id``): at most ``limit``.

        Due ``queued`` rows older than the age gate (keyless or key heads, so
        key order holds), younger ones in flight nowhere (given back, or not
        due when queued: see :data:`_UNGATED`), and ``sending`` rows whose
        lease expired. One statement: a UNION ALL of three index scans, each
        on its partial index. Returns ``(id, status)`` pairs.
        """
        t = email_table
        now = self.now_expr()
        cutoff = self._sweep_cutoff(min_age_seconds)
        queued = (sa.select(t.c.id, t.c.status, t.c.created_at)
                  .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                         t.c.created_at <= cutoff)
                  .order_by(t.c.created_at, t.c.id).limit(limit))
        # Given back by a stopping process, or not due when queued: in flight
        # nowhere, so not age-gated. Only those younger than the gate are read
        # here: the scan reads the young end of the queued rows' partial index.
        given_back = (sa.select(t.c.id, t.c.status, t.c.created_at)
                      .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                             t.c.created_at > cutoff, t.c.lease_owner.in_(_UNGATED))
                      .order_by(t.c.created_at, t.c.id).limit(limit))
        expired = (sa.select(t.c.id, t.c.status, t.c.created_at)
                   .where(t.c.status == Status.SENDING.value, t.c.lease_expires_at < now)
                   .order_by(t.c.created_at, t.c.id).limit(limit))
        both = sa.union_all(queued.subquery().select(), given_back.subquery().select(),
                            expired.subquery().select()).subquery()
        with self.read() as conn:
            rows = conn.execute(
                sa.select(both.c.id, both.c.status)
                .order_by(both.c.created_at, both.c.id).limit(limit)
            ).all()
        return [(int(row.id), str(row.status)) for row in rows]

    def age_gated(self, *, min_age_seconds: float) -> tuple[int, datetime | None, datetime]:
        """Due queued rows the age gate keeps from a sweep: (count, oldest created_at, now).

        Rows in flight nowhere (:data:`_UNGATED`: given back, or scheduled by
        ``send_after``) are not gated. Reads the sweep's partial index.
        """
        t = email_table
        cutoff = self._sweep_cutoff(min_age_seconds)
        with self.read() as conn:
            count, oldest, now = conn.execute(
                sa.select(sa.func.count(), sa.func.min(t.c.created_at), self.now_expr())
                .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                       t.c.created_at > cutoff,
                       sa.or_(t.c.lease_owner.is_(None), t.c.lease_owner.not_in(_UNGATED)))
            ).one()
        return int(count), oldest, now

    def _sweep_cutoff(self, min_age_seconds: float) -> Any:
        """The age gate: rows created at or before this are old enough for a sweep."""
        if self.is_postgres:
            return self.now_expr() - sa.literal(timedelta(seconds=min_age_seconds),
                                                sa.Interval())
        return sa.literal(self.clock() - timedelta(seconds=min_age_seconds), sa.DateTime())

    def mark_given_back(self, ids: Sequence[int]) -> int:
        """Mark ``queued`` rows of ``ids`` as given back (see :data:`GIVEN_BACK`); how many.

        Only unleased queued rows change: one another process claimed meanwhile
        is its business.
        """
        t = email_table
        marked = 0
        unique = sorted(set(ids))
        with self.write() as conn:
            for start in range(0, len(unique), 500):
                chunk = unique[start:start + 500]
                marked += conn.execute(
                    t.update().where(t.c.id.in_(chunk), t.c.status == Status.QUEUED.value,
                                     t.c.lease_owner.is_(None))
                    .values(lease_owner=GIVEN_BACK)).rowcount
        return marked

    def heal_key_heads(self) -> int:
        """Give every key with open emails but no holder one (see :func:`._ordering.heal`).

        The sweep's safety net; how many keys it healed.
        """
        with self.write() as conn:
            return len(_ordering.heal(conn))

    def claim_startup_sweep(self, deployment: str) -> bool:
        """Whether this process runs the startup sweep of ``deployment`` (the first asks wins).

        An insert of a setting named after the deployment: the primary key
        lets one process in. Claims older than a day are deleted in the same
        transaction (a losing insert rolls that back too: the winner did it).
        """
        t = setting_table
        name = "startup_sweep:" + deployment
        try:
            with self.write() as conn:
                conn.execute(t.delete().where(
                    t.c.name.startswith("startup_sweep:", autoescape=True),
                    t.c.updated_at < self.later_expr(-86400)))
                conn.execute(t.insert().values(name=name, value=json.dumps(True),
                                               updated_at=self.now_expr()))
        except sa.exc.IntegrityError:
            return False
        return True

    # -- dead letters and retention -------------------------------------------

    def retry_failed(self, email_id: int) -> bool:
        """Put a dead letter back: ``queued``, attempts 0, due now. False if not failed.

        A keyed one takes its place in its key's line by id (see
        the rule of :mod:`._ordering`). On PostgreSQL it waits for the key's
        producer lock first, as a ``send()`` of the key would.
        """
        t = email_table
        with self.write() as conn:
            key = conn.execute(sa.select(t.c.key).where(
                t.c.id == email_id, t.c.status == Status.FAILED.value)).scalar()
            if self.is_postgres and key is not None:
                conn.execute(sa.select(_ordering.producer_lock(key)))
            done = conn.execute(
                t.update().where(t.c.id == email_id, t.c.status == Status.FAILED.value)
                .values(status=Status.QUEUED.value, attempts=0, due_at=self.now_expr(),
                        key_head=False, lease_owner=None, lease_expires_at=None)
            ).rowcount
            if done and key is not None:
                _ordering.advance(conn, [key])
        return bool(done)

    _TRY_PRODUCER_LOCKS_PG = sa.text(
        "SELECT k.key, pg_try_advisory_xact_lock(hashtextextended(k.key, 0)) AS locked"
        " FROM unnest(CAST(:keys AS varchar[])) AS k(key) ORDER BY k.key"
    ).columns(sa.column("key", sa.String()), sa.column("locked", sa.Boolean()))

    def retry_all_failed(self, keys_per_transaction: int | None = None) -> list[int]:
        """Put every dead letter back (as :meth:`retry_failed` does); their ids, oldest first.

        Set-based instead of a transaction per row: ``keys_per_transaction``
        keys (:data:`RETRY_ALL_KEYS_PER_TRANSACTION`) per transaction, each
        taking its keys' producer locks, putting their rows back in one UPDATE
        (the keyless ones with the first) and ordering their keys again (see
        the rule of :mod:`._ordering`). A transaction holding the locks of every
        key at once could fill PostgreSQL's shared lock table
        (``max_locks_per_transaction`` times ``max_connections`` for the whole
        server). The locks are only tried (waiting on several while producers
        hold some could deadlock with them); the dead letters of a key whose
        lock was busy are then put back one by one, each waiting for its key's
        lock. A keyed row that failed after its key's chunk was done stays a
        dead letter.
        """
        per = keys_per_transaction or RETRY_ALL_KEYS_PER_TRANSACTION
        t = email_table
        failed = t.c.status == Status.FAILED.value
        with self.read() as conn:
            keys = sorted(conn.execute(sa.select(t.c.key).distinct().where(
                failed, t.c.key.is_not(None))).scalars())
        chunks = [keys[start:start + per] for start in range(0, len(keys), per)] or [[]]
        retried: list[int] = []
        busy: list[str] = []
        for number, chunk in enumerate(chunks):
            with self.write() as conn:
                if self.is_postgres and chunk:
                    locks = conn.execute(self._TRY_PRODUCER_LOCKS_PG, {"keys": chunk}).all()
                    busy += [str(row.key) for row in locks if not row.locked]
                    chunk = [str(row.key) for row in locks if row.locked]
                scope: Any = t.c.key.in_(chunk)
                if number == 0:  # the keyless dead letters go with the first chunk
                    scope = sa.or_(t.c.key.is_(None), scope)
                retried += conn.execute(
                    t.update().where(failed, scope)
                    .values(status=Status.QUEUED.value, attempts=0, due_at=self.now_expr(),
                            key_head=False, lease_owner=None, lease_expires_at=None)
                    .returning(t.c.id)).scalars()
                _ordering.advance(conn, chunk)
        if busy:
            with self.read() as conn:
                waiting = list(conn.execute(sa.select(t.c.id).where(
                    failed, t.c.key.in_(busy))).scalars())
            retried += [email_id for email_id in waiting if self.retry_failed(email_id)]
        return sorted(int(email_id) for email_id in retried)

    def delete_failed(self, *, older_than: datetime | None) -> int:
        """Delete dead letters (dead-lettered before ``older_than`` when given).

        One ``DELETE ... WHERE status = 'failed' RETURNING id``: the status is
        checked by the statement that deletes, so a row ``retry()`` put back
        meanwhile is left alone (a separate SELECT of ids would delete it
        queued). The attachments go after their rows, by the ids returned:
        those rows are gone within this transaction, so nothing can retry them.
        Rows from before ``failed_at`` existed count from ``created_at``.
        """
        t = email_table
        where: list[Any] = [t.c.status == Status.FAILED.value]
        if older_than is not None:
            where.append(sa.func.coalesce(t.c.failed_at, t.c.created_at)
                         < sa.literal(older_than, sa.DateTime()))
        with self.write() as conn:
            ids = list(conn.execute(t.delete().where(*where).returning(t.c.id)).scalars())
            for start in range(0, len(ids), 500):
                # Explicitly: SQLite only cascades with PRAGMA foreign_keys on.
                conn.execute(attachment_table.delete().where(
                    attachment_table.c.email_id.in_(ids[start:start + 500])))
                conn.execute(event_table.delete().where(
                    event_table.c.email_id.in_(ids[start:start + 500])))
            return len(ids)

    def delete_sent(self, *, older_than: datetime, batch: int) -> int:
        """Delete up to ``batch`` ``sent`` rows sent before ``older_than``; returns how many."""
        t = email_table
        old = (sa.select(t.c.id).where(t.c.status == Status.SENT.value,
                                       t.c.sent_at < sa.literal(older_than, sa.DateTime()))
               .order_by(t.c.sent_at).limit(batch))
        with self.write() as conn:
            ids = list(conn.execute(old).scalars())
            if ids:
                # Explicitly: SQLite only cascades with PRAGMA foreign_keys on.
                conn.execute(attachment_table.delete().where(
                    attachment_table.c.email_id.in_(ids)))
                # An email's delivery events go with it (they reference it, without a key).
                conn.execute(event_table.delete().where(event_table.c.email_id.in_(ids)))
                conn.execute(t.delete().where(t.c.id.in_(ids)))
            return len(ids)

    # -- settings -------------------------------------------------------------

    def set_setting(self, name: str, value: Any) -> None:
        """Store a shared setting (insert or replace) and commit."""
        t = setting_table
        raw = json.dumps(value)
        with self.write() as conn:
            updated = conn.execute(
                t.update().where(t.c.name == name).values(value=raw, updated_at=self.now_expr())
            ).rowcount
            if not updated:
                conn.execute(t.insert().values(name=name, value=raw, updated_at=self.now_expr()))


class KeptConnection:
    """A connection one loop keeps across its calls: no pool checkout and pre-ping each.

    Kept without a ping, it is found cut at its first use after the database
    restarted: :meth:`run` then runs the work once more on a fresh connection,
    instead of reporting an outage that is over. (Should the cut work have
    committed after all, its guarded writes find nothing to do the second
    time: a claim's rows are reaped when their lease expires, a record's
    outcomes are reported lost.) Any other error closes it, and is raised.
    """

    def __init__(self, connect: Callable[[], Connection], *, doing: str) -> None:
        self._connect = connect
        self.doing = doing  # for the log line: "claiming", "recording"
        self.connection: Connection | None = None

    def run(self, work: Callable[[Connection], T]) -> T:
        """``work(connection)`` on the kept connection (opened if there is none)."""
        kept = self.connection is not None
        if self.connection is None:
            self.connection = self._connect()
        try:
            return work(self.connection)
        except BaseException as exc:
            self.close(invalidate=True)
            if kept and isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
                logger.info("An outbox worker's database connection was cut (%s); "
                            "%s again on a new one", exc.orig, self.doing)
                return self.run(work)
            raise

    def close(self, *, invalidate: bool = False) -> None:
        """Close the connection (``invalidate``: never give it back to the pool)."""
        conn, self.connection = self.connection, None
        if conn is not None:
            if invalidate:
                conn.invalidate()
            conn.close()


def _error_text(code: int, message: str) -> str:
    return f"{code} {message}" if code else message

