"""Every SQL statement the outbox runs, and nothing about SMTP.

The write side (:meth:`Store.insert_email`) runs in the caller's session and
transaction. The delivery side runs on the store's own engine, in short
transactions that never span a network call to the mail server:

* :meth:`Store.claim_ids` is the compare-and-set ``queued -> sending`` with a
  lease, the single gate every delivery route goes through;
* :meth:`Store.renew_leases` is the heartbeat of rows still being sent;
* :meth:`Store.record` writes outcomes, guarded: it only changes a row that is
  still ``sending`` under the claim's owner token, so a sender that lost its
  lease can never overwrite what a later claim recorded.

Timestamps are naive UTC. On PostgreSQL "now" is the database clock, so
processes with skewed clocks agree on leases and ages; SQLite is one machine,
so the Python clock is the database clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from ._models import Status, attachment_table, email_table, setting_table

logger = logging.getLogger(__name__)

_OPEN = (Status.QUEUED.value, Status.SENDING.value)
_CLAIM_RETURNING = (email_table.c.id, email_table.c.attempts, email_table.c.sender,
                    email_table.c.recipients, email_table.c.mime, email_table.c.message_id,
                    email_table.c.key, email_table.c.error_history)


def utcnow() -> datetime:
    """The current time, naive UTC (how every timestamp is stored)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


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


@dataclasses.dataclass(frozen=True)
class Reaped:
    """Rows whose lease had expired: back to ``queued``, or ``failed`` when spent."""

    requeued: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.requeued) + len(self.failed)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What to record for one claimed row.

    ``status`` is the row's next status: ``sent``, ``failed``, or ``queued``
    (a transient failure, due again ``due_in`` seconds from now on the
    database clock, or at once; or a release with
    ``give_back_attempt`` when the send never started).
    """

    email: ClaimedEmail
    status: Status
    error_code: int = 0
    error_message: str | None = None
    due_in: float | None = None
    give_back_attempt: bool = False


def now_expr(dialect: str, clock: Callable[[], datetime] = utcnow) -> sa.ColumnElement[datetime]:
    """"Now" as SQL for ``dialect``: the database clock on PostgreSQL, ``clock()`` elsewhere."""
    if dialect == "postgresql":
        return sa.func.timezone("UTC", sa.func.now(), type_=sa.DateTime())
    return sa.literal(clock(), sa.DateTime())


def key_lock(key: str) -> sa.ColumnElement[Any]:
    """PostgreSQL: a transaction-scoped advisory lock on one ordering key.

    Producers of a key (``send()``) and whoever changes which row heads the
    key (recording an outcome, the reap, ``retry()``) take it, so id order is
    commit order and a key never ends up without a head.
    """
    return sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(key, 0))


def _open_of_key(key: Any, *, alias: str = "open_of_key") -> sa.Select[tuple[int]]:
    other = email_table.alias(alias)
    return sa.select(other.c.id).where(other.c.key == key, other.c.status.in_(_OPEN))


def insert_email(session: Session, values: dict[str, Any], attachments: Sequence[dict[str, Any]],
                 *, clock: Callable[[], datetime] = utcnow) -> tuple[int, bool]:
    """Insert one email row in the caller's ``session``; returns ``(id, created)``.

    ``created_at`` (and ``due_at`` unless given) are "now" on the database's
    clock. With an ``idempotency_key`` already stored, nothing is inserted and
    the existing row's id comes back with ``created=False``. The insert goes
    first so that on SQLite the transaction takes the write lock before it
    reads (see :meth:`Store.write`). On PostgreSQL, producers of one ``key``
    are serialized by a transaction-scoped advisory lock, so id order is
    commit order within a key.
    """
    dialect = session.get_bind(clause=email_table.insert()).dialect.name
    values = dict(values)
    now = now_expr(dialect, clock)
    values["created_at"] = now
    if values.get("due_at") is None:
        values["due_at"] = now
    if values.get("key") is not None:
        if dialect == "postgresql":
            session.execute(sa.select(key_lock(values["key"])))
        values["key_head"] = ~_open_of_key(values["key"]).exists()
    idem = values.get("idempotency_key")
    stmt: Any
    if idem is not None and dialect in ("sqlite", "postgresql"):
        insert = sqlite.insert if dialect == "sqlite" else pg.insert
        stmt = (insert(email_table).values(**values)
                .on_conflict_do_nothing(index_elements=["idempotency_key"])
                .returning(email_table.c.id))
        new_id = session.execute(stmt).scalar()
        if new_id is None:
            existing = session.execute(
                sa.select(email_table.c.id).where(email_table.c.idempotency_key == idem)
            ).scalar_one()
            return int(existing), False
    else:
        if idem is not None:
            existing = session.execute(
                sa.select(email_table.c.id).where(email_table.c.idempotency_key == idem)
            ).scalar()
            if existing is not None:
                return int(existing), False
        new_id = session.execute(
            email_table.insert().values(**values).returning(email_table.c.id)
        ).scalar_one()
    if attachments:
        session.execute(attachment_table.insert(),
                        [dict(row, email_id=new_id) for row in attachments])
    return int(new_id), True


class Store:
    """The outbox's SQL on its own engine (everything but the insert)."""

    def __init__(self, engine: Engine, *, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine = engine
        self.clock = clock
        self.is_postgres = engine.dialect.name == "postgresql"
        self.is_sqlite = engine.dialect.name == "sqlite"
        # Keys whose next email could not be promoted yet (a producer held the
        # key's lock); retried at the next claim, and healed by the sweep.
        self._unpromoted: set[str] = set()
        self._unpromoted_lock = threading.Lock()
        # Ids that became the head of their key, for inline delivery to offer
        # (bounded: past it, the sweep takes them).
        self._promoted: list[int] = []

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
                  reap_max_attempts: int | None = None,
                  conn: Connection | None = None) -> tuple[list[ClaimedEmail], Reaped]:
        """One dispatcher tick's database work: reap once, then claim up to ``limit``.

        Due rows are taken oldest first (``due_at, id``); only keyless rows and
        key heads are candidates, read from the partial index that holds
        exactly those.

        * PostgreSQL: ONE statement, in autocommit: the reap and the claim are
          data-modifying CTEs; the ids are picked in a materialized CTE with
          ``FOR UPDATE SKIP LOCKED`` (the fence keeps the planner from updating
          more rows than the limit), so concurrent dispatchers never wait for
          each other nor take one row twice. An idle tick is one round trip.
        * SQLite: ``BEGIN IMMEDIATE``, the reap, the claim: three statements.

        ``conn`` is the dispatcher's own long-lived connection (no pool
        checkout and pre-ping per tick). Returns ``(claimed, reaped)``.
        """
        if conn is None:
            with self.dispatch_connection() as own:
                return self.claim_due(limit, owner=owner, lease_seconds=lease_seconds,
                                      reap_max_attempts=reap_max_attempts, conn=own)
        t = email_table
        pick = (sa.select(t.c.id).where(self._claimable())
                .order_by(t.c.due_at, t.c.id).limit(limit))
        if not self.is_postgres:
            if self.is_sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                reaped = (self._reap(conn, reap_max_attempts) if reap_max_attempts is not None
                          else Reaped())
                self._retry_promotions(conn)
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
        rows, reaped = self._claim_due_postgres(conn, pick, limit, owner, lease_seconds,
                                                reap_max_attempts)
        if reaped.failed or self._has_unpromoted():
            # Rare: a dead-lettered key head hands its key on (its own transaction).
            with self.write() as tx:
                keys = set(tx.execute(sa.select(t.c.key).where(
                    t.c.id.in_(reaped.failed), t.c.key.is_not(None))).scalars())
                self._promote(tx, keys)
                self._retry_promotions(tx)
        return self._claimed(rows, owner), reaped

    def _claim_due_postgres(self, conn: Connection, pick: sa.Select[Any], limit: int,
                            owner: str, lease_seconds: float,
                            reap_max_attempts: int | None) -> tuple[list[Any], Reaped]:
        t = email_table
        due = pick.with_for_update(skip_locked=True).cte("due").prefix_with("MATERIALIZED")
        claimed = (t.update().where(t.c.id == due.c.id, t.c.status == Status.QUEUED.value)
                   .values(**self._claim_values(owner, lease_seconds))
                   .returning(*_CLAIM_RETURNING).cte("claimed"))
        stmt: Any = sa.select(sa.literal(Status.SENDING.value).label("outcome"), *claimed.c)
        if reap_max_attempts is not None:
            # The reap rides along in the same statement; the rows it frees are
            # claimable from the next tick (one snapshot per statement).
            reaped = self._reap_statement(reap_max_attempts, None).cte("reaped")
            stmt = sa.union_all(stmt, sa.select(
                reaped.c.status.label("outcome"), reaped.c.id,
                *[sa.null().cast(col.type).label(col.name) for col in claimed.c
                  if col.name not in ("id", "key", "error_history")],
                reaped.c.key, sa.null().cast(sa.Text()).label("error_history")))
        rows = conn.execute(stmt).all()
        conn.commit()  # a no-op in autocommit; ends SQLAlchemy's transaction marker
        return ([row for row in rows if row.outcome == Status.SENDING.value], Reaped(
            requeued=tuple(r.id for r in rows if r.outcome == Status.QUEUED.value),
            failed=tuple(r.id for r in rows if r.outcome == Status.FAILED.value)))

    def dispatch_connection(self) -> Connection:
        """A connection for :meth:`claim_due` (autocommit on PostgreSQL: one statement)."""
        conn = self.engine.connect()
        if self.is_postgres:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    def _has_unpromoted(self) -> bool:
        with self._unpromoted_lock:
            return bool(self._unpromoted)

    def reap_expired(self, max_attempts: int | None,
                     ids: Sequence[int] | None = None) -> Reaped:
        """Return ``sending`` rows whose lease expired to ``queued``.

        With ``max_attempts``, rows that used them all become ``failed``
        (durable mode); inline mode passes None and never dead-letters. With
        ``ids``, only those rows are considered (the sweep's candidates).
        """
        with self.write() as conn:
            return self._reap(conn, max_attempts, ids)

    def _reap_statement(self, max_attempts: int | None,
                        ids: Sequence[int] | None) -> Any:
        """The guarded reap: expired leases back to queued (failed when spent)."""
        t = email_table
        spent: Any = (t.c.attempts >= max_attempts if max_attempts is not None
                      else sa.false())
        where: list[Any] = [t.c.status == Status.SENDING.value,
                            t.c.lease_expires_at < self.now_expr()]
        if ids is not None:
            where.append(t.c.id.in_(list(ids)))
        return (
            t.update()
            .where(*where)
            .values(
                status=sa.case((spent, Status.FAILED.value), else_=Status.QUEUED.value),
                due_at=self.now_expr(),
                lease_owner=None, lease_expires_at=None,
                last_error=sa.case(
                    (spent, "lease expired: the process sending it stopped, and its "
                            "attempts are spent"),
                    else_=t.c.last_error),
            )
            .returning(t.c.id, t.c.status, t.c.key)
        )

    def _reap(self, conn: Connection, max_attempts: int | None,
              ids: Sequence[int] | None = None) -> Reaped:
        rows = conn.execute(self._reap_statement(max_attempts, ids)).all()
        self._promote(conn, {row.key for row in rows
                             if row.key is not None and row.status == Status.FAILED.value})
        return Reaped(
            requeued=tuple(r.id for r in rows if r.status == Status.QUEUED.value),
            failed=tuple(r.id for r in rows if r.status == Status.FAILED.value))

    def _promote(self, conn: Connection, keys: set[str]) -> None:
        """Make the oldest unfinished email of each key its head.

        On PostgreSQL the key's advisory lock is only tried: a producer holds
        it for its whole request, and delivery must not wait for requests. A
        key whose lock is busy is remembered and promoted at the next claim
        (the producer's insert then sees the finished head, or the promotion
        sees the producer's row).
        """
        t = email_table
        busy: set[str] = set()
        promoted: list[int] = []
        for key in sorted(keys):
            if self.is_postgres and not conn.execute(sa.select(sa.func.pg_try_advisory_xact_lock(
                    sa.func.hashtextextended(key, 0)))).scalar():
                busy.add(key)
                continue
            oldest = (sa.select(sa.func.min(t.c.id))
                      .where(t.c.key == key, t.c.status.in_(_OPEN)).scalar_subquery())
            promoted.extend(conn.execute(
                t.update().where(t.c.id == oldest, t.c.key_head.is_(False))
                .values(key_head=True).returning(t.c.id)).scalars())
        with self._unpromoted_lock:
            self._unpromoted.difference_update(keys - busy)
            self._unpromoted.update(busy)
            self._promoted.extend(promoted)
            del self._promoted[:-10_000]

    def take_promoted(self) -> list[int]:
        """Ids that became their key's head since the last call (this process's promotions).

        Read after the promoting transaction committed (the caller's batch
        has returned), so the rows are claimable by the time they are offered.
        """
        with self._unpromoted_lock:
            promoted, self._promoted = self._promoted, []
        return promoted

    def _retry_promotions(self, conn: Connection) -> None:
        with self._unpromoted_lock:
            pending = set(self._unpromoted)
        if pending:
            self._promote(conn, pending)

    def retry_promotions(self) -> None:
        """Promote the keys whose promotion was put off (no-op when there are none)."""
        with self._unpromoted_lock:
            if not self._unpromoted:
                return
        with self.write() as conn:
            self._retry_promotions(conn)

    def heal_key_heads(self) -> int:
        """Give every key with unfinished emails but no head its oldest one as head.

        The safety net for a promotion lost with its process; the sweep runs
        it. Scans the open keyed rows (the ``ix_outbox_email_key_open`` index).
        """
        t = email_table
        has_head = (sa.func.bool_or(t.c.key_head) if self.is_postgres
                    else sa.func.max(t.c.key_head) == 1)
        headless = (sa.select(sa.func.min(t.c.id))
                    .where(t.c.key.is_not(None), t.c.status.in_(_OPEN))
                    .group_by(t.c.key).having(~has_head))
        with self.write() as conn:
            return conn.execute(t.update().where(t.c.id.in_(headless.scalar_subquery()))
                                .values(key_head=True)).rowcount

    def release(self, claimed: Sequence[ClaimedEmail]) -> int:
        """Give back rows claimed but never handed to the transport (attempt returned)."""
        outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True) for email in claimed]
        recorded, _ = self.record(outcomes)
        return len(recorded)

    def retry_failed(self, email_id: int) -> bool:
        """Put a dead letter back: ``queued``, attempts 0, due now. False if not failed."""
        t = email_table
        with self.write() as conn:
            key = conn.execute(sa.select(t.c.key).where(
                t.c.id == email_id, t.c.status == Status.FAILED.value)).scalar()
            if self.is_postgres and key is not None:
                conn.execute(sa.select(key_lock(key)))
            head: Any = True if key is None else ~_open_of_key(key).exists()
            done = conn.execute(
                t.update().where(t.c.id == email_id, t.c.status == Status.FAILED.value)
                .values(status=Status.QUEUED.value, attempts=0, due_at=self.now_expr(),
                        key_head=head, lease_owner=None, lease_expires_at=None)
            ).rowcount
        return bool(done)

    def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``failed`` rows with their failure history."""
        t = email_table
        with self.read() as conn:
            rows = conn.execute(
                sa.select(t.c.id, t.c.message_id, t.c.subject, t.c.recipients, t.c.key,
                          t.c.attempts, t.c.last_error, t.c.error_history, t.c.created_at)
                .where(t.c.status == Status.FAILED.value)
                .order_by(t.c.id.desc()).limit(limit)
            ).mappings().all()
        return [
            {**dict(row), "recipients": json.loads(row["recipients"]),
             "error_history": json.loads(row["error_history"] or "[]")}
            for row in rows
        ]

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
        if self.is_postgres:
            cutoff: Any = now - sa.literal(timedelta(seconds=min_age_seconds), sa.Interval())
        else:
            cutoff = sa.literal(self.clock() - timedelta(seconds=min_age_seconds),
                                sa.DateTime())
        queued = (sa.select(t.c.id, t.c.status, t.c.created_at)
                  .where(self._claimable(), t.c.created_at <= cutoff)
                  .order_by(t.c.created_at, t.c.id).limit(limit))
        expired = (sa.select(t.c.id, t.c.status, t.c.created_at)
                   .where(t.c.status == Status.SENDING.value, t.c.lease_expires_at < now)
                   .order_by(t.c.created_at, t.c.id).limit(limit))
        both = sa.union_all(queued.subquery().select(), expired.subquery().select()).subquery()
        with self.read() as conn:
            rows = conn.execute(
                sa.select(both.c.id, both.c.status)
                .order_by(both.c.created_at, both.c.id).limit(limit)
            ).all()
        return [(int(row.id), str(row.status)) for row in rows]

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

    def count_sent_before(self, older_than: datetime) -> int:
        """How many ``sent`` rows were sent before ``older_than``."""
        t = email_table
        with self.read() as conn:
            return int(conn.execute(
                sa.select(sa.func.count()).where(
                    t.c.status == Status.SENT.value,
                    t.c.sent_at < sa.literal(older_than, sa.DateTime()))
            ).scalar_one())

    def delete_failed(self, *, older_than: datetime | None) -> int:
        """Delete dead letters (created before ``older_than`` when given)."""
        t = email_table
        where: list[Any] = [t.c.status == Status.FAILED.value]
        if older_than is not None:
            where.append(t.c.created_at < sa.literal(older_than, sa.DateTime()))
        with self.write() as conn:
            ids = list(conn.execute(sa.select(t.c.id).where(*where)).scalars())
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                conn.execute(attachment_table.delete().where(
                    attachment_table.c.email_id.in_(chunk)))
                conn.execute(t.delete().where(t.c.id.in_(chunk)))
            return len(ids)

    def failed_ids(self) -> list[int]:
        """Every dead letter's id, oldest first."""
        t = email_table
        with self.read() as conn:
            return list(conn.execute(sa.select(t.c.id).where(
                t.c.status == Status.FAILED.value).order_by(t.c.id)).scalars())

    def oldest_queued_age(self) -> float | None:
        """Seconds since the oldest ``queued`` row was created, or None."""
        t = email_table
        with self.read() as conn:
            oldest = conn.execute(sa.select(sa.func.min(t.c.created_at)).where(
                t.c.status == Status.QUEUED.value)).scalar()
            if oldest is None:
                return None
            now = conn.execute(sa.select(self.now_expr())).scalar_one()
        return max(0.0, float((now - oldest).total_seconds()))

    def _claimable(self) -> sa.ColumnElement[bool]:
        """Queued, due, and free to go: keyless, or the head of its key."""
        t = email_table
        return sa.and_(t.c.status == Status.QUEUED.value, t.c.due_at <= self.now_expr(),
                       sa.or_(t.c.key.is_(None), t.c.key_head))

    def _claim_values(self, owner: str, lease_seconds: float) -> dict[str, Any]:
        t = email_table
        return {"status": Status.SENDING.value, "attempts": t.c.attempts + 1,
                "lease_owner": owner, "lease_expires_at": self.later_expr(lease_seconds)}

    def _claimed(self, rows: Sequence[Any], owner: str) -> list[ClaimedEmail]:
        claimed = [
            ClaimedEmail(
                id=row.id, owner=owner, attempt=row.attempts, sender=row.sender,
                recipients=tuple(json.loads(row.recipients)), mime=row.mime or b"",
                message_id=row.message_id, key=row.key,
                error_history=tuple(json.loads(row.error_history or "[]")),
            )
            for row in rows
        ]
        claimed.sort(key=lambda email: email.id)
        return claimed

    def renew_leases(self, owner: str, ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the lease of rows still ``sending`` under ``owner``; returns how many."""
        if not ids:
            return 0
        t = email_table
        with self.write() as conn:
            result = conn.execute(
                t.update()
                .where(t.c.id.in_(list(ids)), t.c.lease_owner == owner,
                       t.c.status == Status.SENDING.value)
                .values(lease_expires_at=self.later_expr(lease_seconds))
            )
            return result.rowcount

    def record(self, outcomes: Sequence[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
        """Write outcomes in one transaction; returns ``(recorded, lost)``.

        See :meth:`_record`. On PostgreSQL a deadlock between the key locks of
        this transaction and a producer's is retried: the guarded updates make
        a second run equivalent to the first.
        """
        tries = 0
        while True:
            try:
                return self._record(outcomes)
            except sa.exc.OperationalError as exc:
                tries += 1
                if getattr(exc.orig, "sqlstate", None) != "40P01" or tries >= 3:
                    raise

    def _record(self, outcomes: Sequence[Outcome]) -> tuple[list[Outcome], list[Outcome]]:
        """Write outcomes in one transaction; returns ``(recorded, lost)``.

        Every update is guarded by ``status = 'sending' AND lease_owner =
        owner`` (the owner token is unique per claim, so it also pins the
        attempt). A row that no longer matches lost its lease: another claim
        owns it now, and its outcome is not overwritten.
        """
        t = email_table
        recorded: list[Outcome] = []
        lost: list[Outcome] = []
        plain_sent = [o for o in outcomes if o.status is Status.SENT and not o.error_message]
        others = [o for o in outcomes if not (o.status is Status.SENT and not o.error_message)]
        with self.write() as conn:
            now = self.now_expr()
            by_owner: dict[str, list[Outcome]] = {}
            for outcome in plain_sent:
                by_owner.setdefault(outcome.email.owner, []).append(outcome)
            for owner, group in by_owner.items():
                done = set(conn.execute(
                    t.update()
                    .where(t.c.id.in_([o.email.id for o in group]),
                           t.c.status == Status.SENDING.value, t.c.lease_owner == owner)
                    .values(status=Status.SENT.value, sent_at=now, lease_owner=None,
                            lease_expires_at=None)
                    .returning(t.c.id)
                ).scalars())
                for outcome in group:
                    (recorded if outcome.email.id in done else lost).append(outcome)
            for outcome in others:
                values: dict[str, Any] = {"status": outcome.status.value, "lease_owner": None,
                                          "lease_expires_at": None}
                if outcome.status is Status.SENT:
                    values["sent_at"] = now
                if outcome.status is Status.QUEUED:
                    values["due_at"] = (self.later_expr(outcome.due_in)
                                        if outcome.due_in else now)
                if outcome.give_back_attempt:
                    values["attempts"] = t.c.attempts - 1
                if outcome.error_message is not None:
                    values["last_error"] = _error_text(outcome.error_code, outcome.error_message)
                    history = list(outcome.email.error_history)
                    history.append({"code": outcome.error_code,
                                    "message": outcome.error_message,
                                    "at": self.clock().isoformat(timespec="seconds") + "Z",
                                    "attempt": outcome.email.attempt})
                    values["error_history"] = json.dumps(history)
                hit = conn.execute(
                    t.update()
                    .where(t.c.id == outcome.email.id, t.c.status == Status.SENDING.value,
                           t.c.lease_owner == outcome.email.owner)
                    .values(**values)
                    .returning(t.c.id)
                ).scalar()
                (recorded if hit is not None else lost).append(outcome)
            # A keyed email that is finished hands its key to the next one.
            self._promote(conn, {o.email.key for o in recorded
                                 if o.email.key is not None and o.status is not Status.QUEUED})
        return recorded, lost

    # -- settings ---------------------------------------------------------------

    def get_setting(self, name: str) -> Any:
        """The JSON value of a shared setting, or None when unset."""
        with self.read() as conn:
            raw = conn.execute(
                sa.select(setting_table.c.value).where(setting_table.c.name == name)
            ).scalar()
        return None if raw is None else json.loads(raw)

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

    def counts(self) -> dict[str, int]:
        """Rows per status."""
        t = email_table
        with self.read() as conn:
            rows = conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status)).all()
        result = {status.value: 0 for status in Status}
        result.update({row[0]: int(row[1]) for row in rows})
        return result


def _error_text(code: int, message: str) -> str:
    return f"{code} {message}" if code else message
