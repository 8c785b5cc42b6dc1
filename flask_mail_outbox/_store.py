"""The outbox's writes (and the reads they act on), and nothing about SMTP.

The write side (:meth:`Store.insert_email`) runs in the caller's session and
transaction. The delivery side runs on the store's own engine, in short
transactions that never span a network call to the mail server:

* the claim is the compare-and-set ``queued -> sending`` with a lease, the
  single gate every delivery route goes through: :meth:`Store.claim_ids` and
  :meth:`Store.claim_due`;
* :meth:`Store.renew_leases` is the heartbeat of rows still being sent;
* :meth:`Store.record` writes outcomes, guarded: it only changes a row that is
  still ``sending`` under the claim's owner token, so a sender that lost its
  lease can never overwrite what a later claim recorded.

Per-key order is :mod:`._ordering`'s: every write here that can change a key's
line calls it in the same transaction.

Timestamps are naive UTC. On PostgreSQL "now" is the database clock, so
processes with skewed clocks agree on leases and ages; SQLite is one machine,
so the Python clock is the database clock.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from . import _degrade, _ordering
from ._listen import CHANNEL
from ._models import (
    SEARCH_RECIPIENT_LENGTH,
    SEARCH_SUBJECT_LENGTH,
    Status,
    attachment_table,
    email_table,
    search_key,
    setting_table,
)

logger = logging.getLogger(__name__)

_OPEN = (Status.QUEUED.value, Status.SENDING.value)

#: ``lease_owner`` of a ``queued`` row that a stopping process gave back, or
#: had been handed after a commit and never claimed: provably in flight
#: nowhere, so the sweep takes it whatever its age. No claim owner looks like
#: it (those are ``host:pid:n:hex``), and a claim overwrites it.
GIVEN_BACK = "given-back"

#: Keys :meth:`Store.retry_all_failed` puts back per transaction (one advisory
#: lock each on PostgreSQL, held until the transaction ends).
RETRY_ALL_KEYS_PER_TRANSACTION = 500
_CLAIM_RETURNING = (email_table.c.id, email_table.c.attempts, email_table.c.sender,
                    email_table.c.recipients, email_table.c.mime, email_table.c.message_id,
                    # created_at before key: the PostgreSQL claim's UNION with the
                    # reap lists key and error_history last.
                    email_table.c.created_at, email_table.c.smtp_options,
                    email_table.c.key, email_table.c.error_history)


def utcnow() -> datetime:
    """The current time, naive UTC (how every timestamp is stored)."""
    return datetime.now(UTC).replace(tzinfo=None)


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

    @property
    def throttle_deferrals(self) -> int:
        """Throttled attempts given back so far (the retry policy bounds them)."""
        return sum(1 for entry in self.error_history if entry.get("deferred"))


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


class Recorded(NamedTuple):
    """What :meth:`Store.record` wrote: outcomes recorded and lost, and new key holders.

    ``lost``: rows no longer ``sending`` under their claim (another claim took
    them after their lease expired). ``holders``: ids that now hold their key
    (:func:`._ordering.advance`): due ones are the next to claim.
    """

    recorded: list[Outcome]
    lost: list[Outcome]
    holders: list[int]


def now_expr(dialect: str, clock: Callable[[], datetime] = utcnow) -> sa.ColumnElement[datetime]:
    """"Now" as SQL for ``dialect``: the database clock on PostgreSQL, ``clock()`` elsewhere."""
    if dialect == "postgresql":
        return sa.func.timezone("UTC", sa.func.now(), type_=sa.DateTime())
    return sa.literal(clock(), sa.DateTime())


def _returning(dialect: str, notify: bool) -> tuple[Any, ...]:
    """``RETURNING id``, and on PostgreSQL with ``notify`` the wake-up of listeners.

    ``pg_notify`` in the insert itself saves the commit a round trip; PostgreSQL
    delivers it only if the row's (sub)transaction commits, and sends one
    notification per transaction however many rows carried it.
    """
    if notify and dialect == "postgresql":
        return email_table.c.id, sa.func.pg_notify(CHANNEL, "")
    return (email_table.c.id,)


@functools.cache
def _plain_insert(dialect: str, notify: bool) -> sa.Insert:
    """The INSERT of an email with neither key nor idempotency key, built once.

    Building the statement for each email cost more than executing it: with
    it built once, ``send()`` + commit runs about 4x faster on SQLite and
    2.5x on PostgreSQL (``python -m benchmarks enqueue``).
    """
    t = email_table
    if dialect != "postgresql":
        return t.insert().returning(*_returning(dialect, notify))
    now = now_expr(dialect)
    due = sa.func.coalesce(sa.bindparam("due_at_or_now", type_=sa.DateTime()), now)
    return t.insert().values(created_at=now, due_at=due).returning(*_returning(dialect, notify))


def _insert_plain(session: Session, dialect: str, values: dict[str, Any],
                  clock: Callable[[], datetime], notify: bool) -> int:
    """Insert ``values`` (no key, no idempotency key) with :func:`_plain_insert`."""
    if dialect == "postgresql":
        values["due_at_or_now"] = values.pop("due_at", None)
    else:
        now = clock()
        values["created_at"] = now
        if values.get("due_at") is None:
            values["due_at"] = now
    stmt = _plain_insert(dialect, notify)
    conn = session.connection(bind_arguments={"clause": stmt})
    return int(conn.execute(stmt, values).scalar_one())


_INSERT_CLAUSE = email_table.insert()


def email_dialect(session: Session) -> str:
    """The dialect name of the database ``session`` writes emails to."""
    return str(session.get_bind(clause=_INSERT_CLAUSE).dialect.name)


def insert_email(session: Session, values: dict[str, Any], attachments: Sequence[dict[str, Any]],
                 *, clock: Callable[[], datetime] = utcnow,
                 notify: bool = False, dialect: str | None = None,
                 recipients: Sequence[str] | None = None) -> tuple[int, bool, bool]:
    """Insert one email row in the caller's ``session``; returns ``(id, created, waits)``.

    With ``notify``, on PostgreSQL, the insert also wakes the listeners of
    other processes (see :func:`_returning`): the commit needs no NOTIFY.
    ``dialect`` and ``recipients`` (the list ``values["recipients"]`` holds
    as JSON) spare lookups the caller has made already.

    ``created_at`` (and ``due_at`` unless given) are "now" on the database's
    clock. With an ``idempotency_key`` already stored, nothing is inserted and
    the existing row's id comes back with ``created=False``. The insert goes
    first so that on SQLite the transaction takes the write lock before it
    reads (see :meth:`Store.write`). On PostgreSQL, producers of one ``key``
    are serialized by a transaction-scoped advisory lock, so id order is
    commit order within a key; ``waits`` is True when the new email found an
    earlier one of its key open: its commit must :func:`._ordering.advance`
    the key (see there).
    """
    if dialect is None:
        dialect = email_dialect(session)
    values = dict(values)
    values.update(search_values(values["recipients"] if recipients is None else recipients,
                                values["subject"]))
    if values.get("key") is None and values.get("idempotency_key") is None:
        plain_id = _insert_plain(session, dialect, values, clock, notify)
        if attachments:
            session.execute(attachment_table.insert(),
                            [dict(row, email_id=plain_id) for row in attachments])
        return plain_id, True, False
    now = now_expr(dialect, clock)
    values["created_at"] = now
    if values.get("due_at") is None:
        values["due_at"] = now
    keyed = values.get("key") is not None
    if keyed:
        if dialect == "postgresql":
            session.execute(sa.select(_ordering.producer_lock(values["key"])))
        values["key_head"] = _ordering.holds_at_insert(values["key"])
    returning = (*_returning(dialect, notify), email_table.c.key_head)
    idem = values.get("idempotency_key")
    stmt: Any
    if idem is not None and dialect in ("sqlite", "postgresql"):
        insert = sqlite.insert if dialect == "sqlite" else pg.insert
        stmt = (insert(email_table).values(**values)
                .on_conflict_do_nothing(index_elements=["idempotency_key"])
                .returning(*returning))
        row = session.execute(stmt).first()
        if row is None:
            existing = session.execute(
                sa.select(email_table.c.id).where(email_table.c.idempotency_key == idem)
            ).scalar_one()
            return int(existing), False, False
    else:
        if idem is not None:
            existing = session.execute(
                sa.select(email_table.c.id).where(email_table.c.idempotency_key == idem)
            ).scalar()
            if existing is not None:
                return int(existing), False, False
        row = session.execute(email_table.insert().values(**values).returning(*returning)).one()
    new_id = int(row.id)
    if attachments:
        session.execute(attachment_table.insert(),
                        [dict(a, email_id=new_id) for a in attachments])
    return new_id, True, keyed and dialect == "postgresql" and not row.key_head


class Store:
    """The outbox's SQL on its own engine (everything but the insert)."""

    def __init__(self, engine: Engine, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.is_postgres = engine.dialect.name == "postgresql"
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._pg_claims: dict[bool, Any] = {}
        self._record_sent_statements: dict[bool, Any] = {}

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
    def write(self) -> Iterator[Connection]:
        """A short write transaction on the store's own engine.

        On SQLite it starts with ``BEGIN IMMEDIATE``: a deferred transaction
        that reads and then writes fails with SQLITE_BUSY whatever the busy
        timeout, while an immediate one waits for the write lock.
        """
        with self.engine.connect() as conn:
            if self.is_sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            yield conn
            conn.commit()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads (autocommit on PostgreSQL: no BEGIN/ROLLBACK trips)."""
        with self.engine.connect() as conn:
            if self.is_postgres:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn

    # -- the delivery side ------------------------------------------------------

    def claim_ids(self, ids: Sequence[int], *, owner: str,
                  lease_seconds: float) -> list[ClaimedEmail]:
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
            .where(t.c.id.in_(list(ids)), self._claimable())
            .values(**self._claim_values(owner, lease_seconds))
            .returning(*_CLAIM_RETURNING)
        )
        with self.write() as conn:
            rows = conn.execute(stmt).all()
        return self._claimed(rows, owner)

    def claim_due(self, limit: int, *, owner: str, lease_seconds: float,
                  reap: bool = False,
                  conn: Connection | None = None) -> tuple[list[ClaimedEmail], Reaped]:
        """One dispatcher tick's database work: reap once, then claim up to ``limit``.

        Due rows are taken oldest first (``due_at, id``); only keyless rows and
        key holders are candidates, read from the partial index that holds
        exactly those.

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
                                      reap=reap, conn=own)
        t = email_table
        if not self.is_postgres:
            pick: Any = (self._sqlite_pick(limit) if self.is_sqlite else
                         sa.select(t.c.id).where(self._claimable())
                         .order_by(t.c.due_at, t.c.id).limit(limit))
            if self.is_sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                reaped = self._reap(conn) if reap else Reaped()
                _ordering.advance(conn, reaped.keys)
                rows = conn.execute(
                    t.update().where(t.c.id.in_(pick.scalar_subquery()))
                    .values(**self._claim_values(owner, lease_seconds))
                    .returning(*_CLAIM_RETURNING)
                ).all()
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return self._claimed(rows, owner), reaped
        rows, reaped = self._claim_due_postgres(conn, limit, owner, lease_seconds, reap)
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
                            lease_seconds: float, reap: bool) -> tuple[list[Any], Reaped]:
        """The PostgreSQL claim (and reap): one statement, in autocommit."""
        stmt = self._pg_claim_statement(reap=reap)
        params: dict[str, Any] = {"claim_limit": limit, "claim_owner": owner,
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
            built = self._pg_claims[reap] = self._build_pg_claim(reap=reap)
        return built

    def _build_pg_claim(self, *, reap: bool) -> Any:
        t = email_table
        pick = (sa.select(t.c.id).where(self._claimable())
                .order_by(t.c.due_at, t.c.id).limit(sa.bindparam("claim_limit", type_=sa.Integer)))
        due = pick.with_for_update(skip_locked=True).cte("due").prefix_with("MATERIALIZED")
        # ``id = ANY(ARRAY(...))`` and nothing else: a queue's statistics are always
        # stale (the table was nearly empty at the last ANALYZE), and a join with
        # ``due`` was planned as a nested loop over every queued row (380,000
        # comparisons for a batch of 100 at a 4,000 backlog: 137 ms instead of 6),
        # while a ``status = 'queued'`` recheck here matched the partial index of
        # queued rows and scanned all of them. The recheck is not needed: ``due``
        # locked each row FOR UPDATE after re-evaluating its conditions on the
        # newest version, and the lock is held until this statement commits.
        picked = sa.func.array(sa.select(due.c.id).scalar_subquery())
        lease = sa.bindparam("claim_lease", type_=sa.Interval())
        claimed = (t.update().where(t.c.id == sa.any_(picked))
                   .values(status=Status.SENDING.value, attempts=t.c.attempts + 1,
                           lease_owner=sa.bindparam("claim_owner", type_=sa.String()),
                           lease_expires_at=self.now_expr() + lease)
                   .returning(*_CLAIM_RETURNING).cte("claimed"))
        stmt: Any = sa.select(sa.literal(Status.SENDING.value).label("outcome"), *claimed.c)
        if reap:
            # The reap rides along in the same statement; the rows it frees are
            # claimable from the next tick (one snapshot per statement).
            reaped = self._reap_statement(None).cte("reaped")
            stmt = sa.union_all(stmt, sa.select(
                reaped.c.status.label("outcome"), reaped.c.id,
                *[sa.null().cast(col.type).label(col.name) for col in claimed.c
                  if col.name not in ("id", "key", "error_history")],
                reaped.c.key, sa.null().cast(sa.Text()).label("error_history")))
        return stmt

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
        (see :func:`._delivery.outcomes_for`). Nothing here changes a key's
        line but the order of a holder and an email put back below it.
        """
        with self.write() as conn:
            reaped = self._reap(conn, ids)
            _ordering.advance(conn, reaped.keys)
            return reaped

    def _reap_statement(self, ids: Sequence[int] | None) -> Any:
        """The guarded reap: expired leases back to queued, due now."""
        t = email_table
        # 'sending' written literally, as ix_outbox_email_lease's WHERE is: a
        # bound value does not prove the partial index applies, and the
        # planner took the (status, id) index instead, walking the entries
        # every row's 'sending' version leaves behind until VACUUM (1.7 ms of
        # each claim, 4,000 rows into a keyed drain).
        where: list[Any] = [t.c.status == sa.literal_column(f"'{Status.SENDING.value}'"),
                            t.c.lease_expires_at < self.now_expr()]
        if ids is not None:
            where.append(t.c.id.in_(list(ids)))
        return (t.update().where(*where)
                .values(status=Status.QUEUED.value, due_at=self.now_expr(),
                        lease_owner=None, lease_expires_at=None)
                .returning(t.c.id, t.c.status, t.c.key))

    def _reap(self, conn: Connection, ids: Sequence[int] | None = None) -> Reaped:
        rows = conn.execute(self._reap_statement(ids)).all()
        return Reaped(requeued=tuple(int(r.id) for r in rows),
                      keys=frozenset(str(r.key) for r in rows if r.key is not None))

    def heal_key_heads(self) -> int:
        """Give every key with open emails but no holder one (see :func:`._ordering.heal`).

        The sweep's safety net; how many keys it healed.
        """
        with self.write() as conn:
            return len(_ordering.heal(conn))

    def release(self, claimed: Sequence[ClaimedEmail]) -> list[int]:
        """Give back rows claimed but never handed to the transport (attempt returned).

        Returns the ids given back (a row whose lease another claim took is not).
        """
        outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True) for email in claimed]
        return [outcome.email.id for outcome in self.record(outcomes).recorded]

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

    def age_gated(self, *, min_age_seconds: float) -> tuple[int, datetime | None, datetime]:
        """Due queued rows the age gate keeps from a sweep: (count, oldest created_at, now).

        Rows marked :data:`GIVEN_BACK` are not gated. Reads the sweep's partial index.
        """
        t = email_table
        cutoff = self._sweep_cutoff(min_age_seconds)
        with self.read() as conn:
            count, oldest, now = conn.execute(
                sa.select(sa.func.count(), sa.func.min(t.c.created_at), self.now_expr())
                .where(self._claimable(), t.c.created_at > cutoff,
                       sa.or_(t.c.lease_owner.is_(None), t.c.lease_owner != GIVEN_BACK))
            ).one()
        return int(count), oldest, now

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

    def sweep_candidates(self, *, min_age_seconds: float,
                         limit: int) -> list[tuple[int, str]]:
        """Rows a sweep takes, oldest first (``created_at, id``): at most ``limit``.

        Due ``queued`` rows older than the age gate (keyless or key heads, so
        key order holds), and ``sending`` rows whose lease expired. One
        statement: a UNION ALL of two index scans, each on its partial index.
        Returns ``(id, status)`` pairs.
        """
        t = email_table
        now = self.now_expr()
        cutoff = self._sweep_cutoff(min_age_seconds)
        queued = (sa.select(t.c.id, t.c.status, t.c.created_at)
                  .where(self._claimable(), t.c.created_at <= cutoff)
                  .order_by(t.c.created_at, t.c.id).limit(limit))
        # Given back by a stopping process: in flight nowhere, so not age-gated.
        # They are few and young: the scan reads the queued rows' partial index.
        given_back = (sa.select(t.c.id, t.c.status, t.c.created_at)
                      .where(self._claimable(), t.c.created_at > cutoff,
                             t.c.lease_owner == GIVEN_BACK)
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

    def _sweep_cutoff(self, min_age_seconds: float) -> Any:
        """The age gate: rows created at or before this are old enough for a sweep."""
        if self.is_postgres:
            return self.now_expr() - sa.literal(timedelta(seconds=min_age_seconds),
                                                sa.Interval())
        return sa.literal(self.clock() - timedelta(seconds=min_age_seconds), sa.DateTime())

    def delete_sent(self, *, older_than: datetime, batch: int, dry_run: bool = False) -> int:
        """Delete up to ``batch`` ``sent`` rows sent before ``older_than``; returns how many."""
        t = email_table
        old = (sa.select(t.c.id).where(t.c.status == Status.SENT.value,
                                       t.c.sent_at < sa.literal(older_than, sa.DateTime()))
               .order_by(t.c.sent_at).limit(batch))
        if dry_run:
            with self.read() as conn:
                return int(conn.execute(
                    sa.select(sa.func.count()).select_from(old.subquery())).scalar_one())
        with self.write() as conn:
            ids = list(conn.execute(old).scalars())
            if ids:
                # Explicitly: SQLite only cascades with PRAGMA foreign_keys on.
                conn.execute(attachment_table.delete().where(
                    attachment_table.c.email_id.in_(ids)))
                conn.execute(t.delete().where(t.c.id.in_(ids)))
            return len(ids)

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
            return len(ids)

    def _sqlite_pick(self, limit: int) -> Any:
        """The claim's choice of rows on SQLite, pinned to ``ix_outbox_email_due``.

        SQLite's planner, on a table it has no statistics for (nobody runs
        ANALYZE on an outbox), prefers the dashboard's ``(status, id)`` index for
        ``status = 'queued'``: every claim would then read and sort every queued
        row, keyed rows waiting behind their head included. ``INDEXED BY``
        makes it read only the rows that may go now, in order.
        """
        return sa.text(
            "SELECT id FROM outbox_email INDEXED BY ix_outbox_email_due "
            "WHERE status = 'queued' AND (\"key\" IS NULL OR key_head) AND due_at <= :now "
            "ORDER BY due_at, id LIMIT :limit"
        ).bindparams(sa.bindparam("now", self.clock(), type_=sa.DateTime()),
                     sa.bindparam("limit", limit)).columns(email_table.c.id)

    def _claimable(self) -> sa.ColumnElement[bool]:
        """Queued, due, and free to go: keyless, or the head of its key.

        Written as ``ix_outbox_email_due`` writes its WHERE: SQLite uses a
        partial index only when the query repeats those terms literally (a
        bound ``'queued'``, or ``key_head = 1``, does not count); otherwise
        each claim reads and sorts every queued row.
        """
        t = email_table
        queued = t.c.status == sa.literal_column(f"'{Status.QUEUED.value}'")
        free: Any = sa.or_(t.c.key.is_(None), t.c.key_head)
        if self.is_sqlite:
            free = sa.text('(outbox_email."key" IS NULL OR outbox_email.key_head)')
        return sa.and_(queued, t.c.due_at <= self.now_expr(), free)

    def _claim_values(self, owner: str, lease_seconds: float) -> dict[str, Any]:
        t = email_table
        return {"status": Status.SENDING.value, "attempts": t.c.attempts + 1,
                "lease_owner": owner, "lease_expires_at": self.later_expr(lease_seconds)}

    def _claimed(self, rows: Sequence[Any], owner: str) -> list[ClaimedEmail]:
        claimed = []
        for row in rows:
            options = json.loads(row.smtp_options) if row.smtp_options else {}
            claimed.append(ClaimedEmail(
                id=row.id, owner=owner, attempt=row.attempts, sender=row.sender,
                recipients=tuple(json.loads(row.recipients)), mime=row.mime or b"",
                message_id=row.message_id, key=row.key,
                error_history=tuple(json.loads(row.error_history or "[]")),
                created_at=row.created_at,
                mail_options=tuple(options.get("mail", ())),
                rcpt_options=tuple(options.get("rcpt", ())),
            ))
        claimed.sort(key=lambda email: email.id)
        return claimed

    def renew_leases(self, owner: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still ``sending`` under ``owner``; returns how many."""
        return len(self.renew_held(owner, ids, lease_seconds))

    def renew_held(self, owner: str, ids: Sequence[int], lease_seconds: float) -> set[int]:
        """Extend the lease of rows still ``sending`` under ``owner``; returns their ids.

        A lease that ran out but that no reap took yet is ``owner``'s again:
        the update and a reap are compare-and-sets on the same row, and
        whichever commits first wins.
        """
        if not ids:
            return set()
        t = email_table
        with self.write() as conn:
            rows = conn.execute(
                t.update()
                .where(t.c.id.in_(list(ids)), t.c.lease_owner == owner,
                       t.c.status == Status.SENDING.value)
                .values(lease_expires_at=self.later_expr(lease_seconds))
                .returning(t.c.id)
            ).all()
        return {int(row.id) for row in rows}

    def record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False) -> Recorded:
        """Write outcomes in one transaction (see :meth:`_record`).

        On PostgreSQL a deadlock with another transaction is retried: the
        guarded updates make a second run equivalent to the first.
        """
        tries = 0
        while True:
            try:
                return self._record(outcomes, scrub_sent=scrub_sent)
            except sa.exc.OperationalError as exc:
                tries += 1
                if getattr(exc.orig, "sqlstate", None) != "40P01" or tries >= 3:
                    raise

    def _record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False) -> Recorded:
        """Write outcomes in one transaction.

        Every update is guarded by ``status = 'sending' AND lease_owner =
        owner`` (the owner token is unique per claim, so it also pins the
        attempt). A row that no longer matches lost its lease: another claim
        owns it now, and its outcome is not overwritten. With ``scrub_sent``
        (``OUTBOX_SCRUB_SENT``) a row that becomes ``sent`` loses its MIME in
        the same UPDATE, so no committed ``sent`` row ever still holds a body.
        The outcomes' keys are advanced in the same transaction (a finished
        email gives its key to the next one, see :mod:`._ordering`).
        """
        recorded: list[Outcome] = []
        lost: list[Outcome] = []
        plain_sent: dict[str, list[Outcome]] = {}
        others: list[Outcome] = []
        for outcome in outcomes:
            if outcome.status is Status.SENT and not outcome.error_message:
                plain_sent.setdefault(outcome.email.owner, []).append(outcome)
            else:
                others.append(outcome)
        with self.write() as conn:
            keys = _ordering.lock_lines(conn, {o.email.key for o in outcomes
                                               if o.email.key is not None})
            for owner, group in plain_sent.items():
                done = self._record_sent(conn, owner, [o.email.id for o in group],
                                         scrub=scrub_sent)
                for outcome in group:
                    (recorded if outcome.email.id in done else lost).append(outcome)
            # Built only when needed: a function construct costs a few percent of
            # a batch that is all sent.
            now = self.now_expr() if others else None
            t = email_table
            for outcome in others:
                hit = conn.execute(
                    t.update()
                    .where(t.c.id == outcome.email.id, t.c.status == Status.SENDING.value,
                           t.c.lease_owner == outcome.email.owner)
                    .values(**self._outcome_values(outcome, now, scrub_sent))
                    .returning(t.c.id)
                ).first()
                (recorded if hit is not None else lost).append(outcome)
            holders = _ordering.advance(conn, keys, locked=True)
        return Recorded(recorded, lost, holders)

    def _outcome_values(self, outcome: Outcome, now: Any, scrub_sent: bool) -> dict[str, Any]:
        """The SET of one outcome's update (everything but a plain ``sent``)."""
        t = email_table
        values: dict[str, Any] = {"status": outcome.status.value, "lease_owner": None,
                                  "lease_expires_at": None}
        if outcome.status is Status.SENT:
            values["sent_at"] = now
            if scrub_sent:
                values["mime"] = None
        if outcome.status is Status.FAILED:
            values["failed_at"] = now
        if outcome.status is Status.QUEUED:
            values["due_at"] = self.later_expr(outcome.due_in) if outcome.due_in else now
        if outcome.give_back_attempt:
            values["attempts"] = t.c.attempts - 1
        if outcome.error_message is not None:
            values["last_error"] = _error_text(outcome.error_code, outcome.error_message)
            entry: dict[str, Any] = {
                "code": outcome.error_code, "message": outcome.error_message,
                "at": self.clock().isoformat(timespec="seconds") + "Z",
                "attempt": outcome.email.attempt}
            if outcome.deferred:
                entry["deferred"] = True
            values["error_history"] = json.dumps([*outcome.email.error_history, entry])
        return values

    def _record_sent(self, conn: Connection, owner: str, ids: list[int], *,
                     scrub: bool) -> set[int]:
        """Mark ``ids`` (claimed by ``owner``) ``sent``; returns the ids it changed.

        One statement, built once per store and only bound per batch (built
        per batch, its construction and the rendering of its IN list were
        about a tenth of the record's time).

        The guard (still ``sending``, under this claim) is written inside a
        CASE so that it cannot steer the plan: a plain ``status = 'sending'``
        matches ``ix_outbox_email_lease``'s WHERE, and with a queue's stale
        statistics the planner read that index, walking every dead 'sending'
        entry (1,000 heap pages, 1.5 ms, 4,000 rows into a keyed drain),
        instead of fetching the batch's ids from the primary key.
        """
        stmt = self._record_sent_statements.get(scrub)
        if stmt is None:
            stmt = self._record_sent_statements[scrub] = self._build_record_sent(scrub)
        params: dict[str, Any] = {"ids": ids, "owner": owner}
        if not self.is_postgres:
            params["now"] = self.clock()
        return {int(i) for i in conn.execute(stmt, params).scalars()}

    def _build_record_sent(self, scrub: bool) -> Any:
        t = email_table
        if self.is_postgres:
            scrub_sql = ", mime = NULL" if scrub else ""
            return sa.text(
                "UPDATE outbox_email SET status = 'sent',"
                " sent_at = timezone('UTC', now()), lease_owner = NULL,"
                f" lease_expires_at = NULL{scrub_sql}"
                " WHERE id = ANY(CAST(:ids AS bigint[]))"
                " AND CASE WHEN status = 'sending' THEN lease_owner = :owner END"
                " RETURNING id"
            ).columns(sa.column("id", sa.BigInteger()))
        return (t.update()
                .where(t.c.id.in_(sa.bindparam("ids", expanding=True)),
                       t.c.status == Status.SENDING.value,
                       t.c.lease_owner == sa.bindparam("owner"))
                .values(status=Status.SENT.value, sent_at=sa.bindparam("now", type_=sa.DateTime()),
                        lease_owner=None, lease_expires_at=None,
                        **({"mime": None} if scrub else {}))
                .returning(t.c.id))

    # -- settings ---------------------------------------------------------------

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


def _error_text(code: int, message: str) -> str:
    return f"{code} {message}" if code else message


def search_values(recipients: str | Sequence[str], subject: str) -> dict[str, str]:
    """The dashboard's search columns for a row: first recipient and subject, normalised.

    ``recipients`` is the list, or the JSON the row stores.
    """
    if isinstance(recipients, str):
        recipients = json.loads(recipients)
    first = recipients[0] if recipients else ""
    return {"search_recipient": search_key(first, SEARCH_RECIPIENT_LENGTH),
            "search_subject": search_key(subject, SEARCH_SUBJECT_LENGTH)}
