"""The outbox's writes (and the reads they act on), and nothing about SMTP.

The write side (:meth:`Store.insert_email`) runs in the caller's session and
transaction. The delivery side runs on the store's own engine, in short
transactions that never span a network call to the mail server:

* the claim is the compare-and-set ``queued -> sending`` with a lease, the
  single gate every delivery route goes through: :meth:`Store.claim_ids` and
  :meth:`Store.claim_due`, and the promotion a dispatcher's record makes with
  a :class:`HandOn` (the same compare-and-set, in the UPDATE that makes a
  key's next email its head);
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
import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from . import _degrade
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
# Delivery tries a key's lock (see key_lock()) and never waits for it: a
# producer holds it for its whole request. In SQL over ``unnest(...) AS k(key)``.
_TRY_KEY_LOCK_PG = "pg_try_advisory_xact_lock(hashtextextended(k.key, 0))"

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
    """Rows whose lease had expired: back to ``queued``, or ``failed`` when spent."""

    requeued: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.requeued) + len(self.failed)


@dataclasses.dataclass
class HandOn:
    """A dispatcher's request that recording its batch also claim what the batch hands on.

    When an email of a key finishes, its key's next email becomes the head
    (the promotion). With a ``HandOn``, a promoted email that is due is also
    claimed in that same UPDATE, under ``owner`` with a lease of
    ``lease_seconds``: the dispatcher sends it in its next batch without a
    claim statement of its own, and the row gets one version fewer. After a
    successful :meth:`Store.record`, ``claimed`` holds those rows (empty
    otherwise: only a committed record claims).

    ``owner`` is one claim's, as every owner token is: the record that hands
    on never shares it with the batch it records nor with the next tick's own
    claim, so the record's guard still pins the attempt. (Should a record's
    commit succeed on the server but fail in the client, its retry finds those
    rows claimed already and hands nothing on: they wait out their lease and
    are reaped and sent by the next claim, their attempt charged.)
    """

    owner: str
    lease_seconds: float
    claimed: list[ClaimedEmail] = dataclasses.field(default_factory=list)


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
                 recipients: Sequence[str] | None = None) -> tuple[int, bool]:
    """Insert one email row in the caller's ``session``; returns ``(id, created)``.

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
    commit order within a key.
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
        return plain_id, True
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
                .returning(*_returning(dialect, notify)))
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
            email_table.insert().values(**values).returning(*_returning(dialect, notify))
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
        # How many rows this store ever made their key's head: a dispatcher whose
        # tick promoted some has due work waiting and ticks again at once.
        self.promotions = 0
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

        ``reap_max_attempts`` None: no reap at this claim (unlike
        :meth:`reap_expired`, where None means "reap, never dead-letter").
        ``conn`` is the dispatcher's own long-lived connection (no pool
        checkout and pre-ping per tick). Returns ``(claimed, reaped)``.
        """
        if conn is None:
            with self.dispatch_connection() as own:
                return self.claim_due(limit, owner=owner, lease_seconds=lease_seconds,
                                      reap_max_attempts=reap_max_attempts, conn=own)
        t = email_table
        if not self.is_postgres:
            pick: Any = (self._sqlite_pick(limit) if self.is_sqlite else
                         sa.select(t.c.id).where(self._claimable())
                         .order_by(t.c.due_at, t.c.id).limit(limit))
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
        rows, reaped, reaped_keys = self._claim_due_postgres(
            conn, limit, owner, lease_seconds, reap_max_attempts)
        if reaped_keys or self.has_unpromoted():
            self._promote_after_claim(reaped_keys)
        return self._claimed(rows, owner), reaped

    def _promote_after_claim(self, keys: set[str]) -> None:
        """Hand the keys of reaped rows on (see :meth:`_reap`); retry put-off promotions.

        Rare, and in a transaction of its own after the claim committed: a
        failure here must not lose the claimed batch (its rows are ``sending``
        under this tick's lease), so it is logged and the keys are put off to
        the next tick instead of raised.
        """
        try:
            with self.write() as tx:
                self._promote(tx, keys)
                self._retry_promotions(tx)
        except sa.exc.SQLAlchemyError as exc:
            with self._unpromoted_lock:
                self._unpromoted.update(keys)
            _degrade.report(
                "Handing ordering keys on to their next emails failed after a claim",
                consequence="the claimed emails are sent as usual; the next email of "
                            f"{len(keys) or 'the put-off'} key(s) waits for the next "
                            "tick, which tries again",
                fix="nothing if the next tick succeeds; otherwise check the database "
                    "error below", exc=exc)

    def _claim_due_postgres(self, conn: Connection, limit: int,
                            owner: str, lease_seconds: float,
                            reap_max_attempts: int | None
                            ) -> tuple[list[Any], Reaped, set[str]]:
        """The PostgreSQL claim; also returns the keys of the rows it reaped."""
        stmt = self._pg_claim_statement(reap=reap_max_attempts is not None)
        params: dict[str, Any] = {"claim_limit": limit, "claim_owner": owner,
                                  "claim_lease": timedelta(seconds=lease_seconds)}
        if reap_max_attempts is not None:
            params["reap_max_attempts"] = reap_max_attempts
        rows = conn.execute(stmt, params).all()
        conn.commit()  # a no-op in autocommit; ends SQLAlchemy's transaction marker
        return ([row for row in rows if row.outcome == Status.SENDING.value], Reaped(
            requeued=tuple(r.id for r in rows if r.outcome == Status.QUEUED.value),
            failed=tuple(r.id for r in rows if r.outcome == Status.FAILED.value)),
            {str(r.key) for r in rows if r.outcome != Status.SENDING.value and r.key is not None})

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
            reaped = self._reap_statement(
                sa.bindparam("reap_max_attempts", type_=sa.Integer), None).cte("reaped")
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

    def has_unpromoted(self) -> bool:
        """Whether some key's promotion was put off (a producer held its lock)."""
        with self._unpromoted_lock:
            return bool(self._unpromoted)

    def reap_expired(self, max_attempts: int | None,
                     ids: Sequence[int] | None = None) -> Reaped:
        """Return ``sending`` rows whose lease expired to ``queued``.

        With ``max_attempts``, rows that used them all become ``failed``
        (both modes' sweeps pass ``OUTBOX_MAX_ATTEMPTS``); None never
        dead-letters. With
        ``ids``, only those rows are considered (the sweep's candidates).
        """
        with self.write() as conn:
            return self._reap(conn, max_attempts, ids)

    def _reap_statement(self, max_attempts: int | sa.BindParameter[int] | None,
                        ids: Sequence[int] | None) -> Any:
        """The guarded reap: expired leases back to queued (failed when spent)."""
        t = email_table
        spent: Any = (t.c.attempts >= max_attempts if max_attempts is not None
                      else sa.false())
        # 'sending' written literally, as ix_outbox_email_lease's WHERE is: a
        # bound value does not prove the partial index applies, and the
        # planner took the (status, id) index instead, walking the entries
        # every row's 'sending' version leaves behind until VACUUM (1.7 ms of
        # each claim, 4,000 rows into a keyed drain).
        where: list[Any] = [t.c.status == sa.literal_column(f"'{Status.SENDING.value}'"),
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
                failed_at=sa.case((spent, self.now_expr()), else_=t.c.failed_at),
            )
            .returning(t.c.id, t.c.status, t.c.key)
        )

    def _reap(self, conn: Connection, max_attempts: int | None,
              ids: Sequence[int] | None = None) -> Reaped:
        rows = conn.execute(self._reap_statement(max_attempts, ids)).all()
        # A dead-lettered head hands its key on; a head put back in the queue
        # keeps it, unless an email was put back below it (see _rehead). Rare:
        # these keys are searched from the start.
        self._promote(conn, {row.key for row in rows if row.key is not None})
        return Reaped(
            requeued=tuple(r.id for r in rows if r.status == Status.QUEUED.value),
            failed=tuple(r.id for r in rows if r.status == Status.FAILED.value))

    def _promote(self, conn: Connection, keys: set[str],
                 after: dict[str, int] | None = None,
                 tried: dict[str, bool] | None = None,
                 hand_on: HandOn | None = None) -> list[Any]:
        """Make the oldest unfinished email of each key its head.

        On PostgreSQL the key's advisory lock is only tried: a producer holds
        it for its whole request, and delivery must not wait for requests. A
        key whose lock is busy is remembered and promoted at the next claim
        (the producer's insert then sees the finished head, or the promotion
        sees the producer's row).

        ``after`` maps a key to its head that just finished: every older email
        of the key is finished too (a head with an email put back below it
        loses its flag and gets no hint, see :meth:`_rehead`), so the search
        starts past it. Searched from the start, it walks the index entries
        finished rows leave behind until VACUUM, a few milliseconds per key
        deep in a backlog (``python -m benchmarks backlog``). A key with nothing open past its hint is searched
        from the start (a dead letter put back by ``retry()`` may sit below).
        All keys take two statements on PostgreSQL (the locks, then the update);
        ``tried`` maps the keys whose lock an earlier statement of this
        transaction tried already to whether it got it (see
        :meth:`_record_sent`), which spares the first.

        With ``hand_on``, a promoted email that is queued and due is claimed
        by the same update; returns those rows (with the claim's columns).
        """
        hints = after or {}
        starts = {key: hints.get(key, 0) for key in sorted(keys)}
        tried = dict(tried or {})
        promoted, busy, none_open, claimed = self._promote_heads(conn, starts, tried, hand_on)
        # Nothing open past the hint: a dead letter put back below it may still
        # wait, so search from the start. (A key whose next email is head
        # already keeps that head: searching again could make a second one.)
        rest = {key: 0 for key in none_open if starts[key]}
        more = self._promote_heads(conn, rest, tried, hand_on)
        promoted.update(more[0])
        claimed += more[3]
        handed = {int(row.id) for row in claimed}
        promoted_ids = list(promoted.values())
        with self._unpromoted_lock:
            self._unpromoted.difference_update(keys - busy)
            self._unpromoted.update(busy)
            # Claimed already: not for inline delivery to offer.
            self._promoted.extend(i for i in promoted_ids if i not in handed)
            self.promotions += len(promoted_ids)
            del self._promoted[:-10_000]
        return claimed

    # The key locks are taken in an earlier statement than the promotion's
    # search (this one, or the record's update): in READ COMMITTED a statement
    # reads the snapshot taken when it started, so a read in the statement
    # that takes a lock misses a producer that committed (and let the lock go)
    # while the statement ran.
    #
    # The text statements name their result columns: SQLAlchemy then keeps the
    # result's metadata with the compiled statement instead of building it
    # from the cursor at each execution.
    _LOCK_KEYS_PG = sa.text(
        f"SELECT k.key, {_TRY_KEY_LOCK_PG} AS locked"
        " FROM unnest(CAST(:keys AS varchar[])) AS k(key)"
    ).columns(sa.column("key", sa.String()), sa.column("locked", sa.Boolean()))

    # Each key's oldest open email past its hint: what both promotions update.
    _PROMOTE_SEARCH_PG = (
        "WITH c AS MATERIALIZED ("
        " SELECT v.key, (SELECT min(o.id) FROM outbox_email o WHERE o.key = v.key"
        "  AND o.status IN ('queued', 'sending') AND o.id > v.after) AS id"
        " FROM unnest(CAST(:keys AS varchar[]), CAST(:afters AS bigint[])) AS v(key, after)),")

    _PROMOTE_PG = sa.text(
        _PROMOTE_SEARCH_PG +
        " heads AS (UPDATE outbox_email e SET key_head = true FROM c"
        "  WHERE e.id = c.id AND e.key_head IS false RETURNING e.id)"
        " SELECT c.key, c.id, c.id IN (SELECT id FROM heads) AS promoted FROM c"
    ).columns(sa.column("key", sa.String()), sa.column("id", sa.BigInteger()),
              sa.column("promoted", sa.Boolean()))

    # The same, handing on (see HandOn): a promoted email that is queued and
    # due is claimed by the promotion's own update. Every SET term reads the
    # row as it was, so the CASEs agree; a row is ours when its lease owner is
    # the claim's (unique) owner.
    _HAND_ON_DUE = "e.status = 'queued' AND e.due_at <= timezone('UTC', now())"
    _PROMOTE_CLAIM_PG = sa.text(
        _PROMOTE_SEARCH_PG +
        " heads AS (UPDATE outbox_email e SET key_head = true,"
        f"  status = CASE WHEN {_HAND_ON_DUE} THEN 'sending' ELSE e.status END,"
        f"  attempts = CASE WHEN {_HAND_ON_DUE} THEN e.attempts + 1 ELSE e.attempts END,"
        f"  lease_owner = CASE WHEN {_HAND_ON_DUE} THEN :owner ELSE e.lease_owner END,"
        f"  lease_expires_at = CASE WHEN {_HAND_ON_DUE}"
        "   THEN timezone('UTC', now()) + CAST(:lease AS interval) ELSE e.lease_expires_at END"
        "  FROM c WHERE e.id = c.id AND e.key_head IS false"
        "  RETURNING e.id, e.lease_owner, e.attempts, e.sender, e.recipients, e.mime,"
        "  e.message_id, e.created_at, e.smtp_options, e.error_history)"
        " SELECT c.key, c.id, h.id IS NOT NULL AS promoted, h.lease_owner, h.attempts,"
        " h.sender, h.recipients, h.mime, h.message_id, h.created_at, h.smtp_options,"
        " h.error_history FROM c LEFT JOIN heads h ON h.id = c.id"
    ).columns(sa.column("key", sa.String()), sa.column("id", sa.BigInteger()),
              sa.column("promoted", sa.Boolean()), email_table.c.lease_owner,
              *[col for col in _CLAIM_RETURNING if col.name not in ("id", "key")])

    def _promote_heads(self, conn: Connection, starts: dict[str, int],
                       tried: dict[str, bool], hand_on: HandOn | None = None
                       ) -> tuple[dict[str, int], set[str], set[str], list[Any]]:
        """Make each key's oldest open email past ``starts[key]`` its head.

        Returns ``({key: promoted id}, keys whose lock was busy, keys with no
        open email past their start, rows claimed for hand_on)``. On
        PostgreSQL two statements of the same text for any number of keys (the
        driver prepares them once; built per key, a statement cost more to
        construct than to run): the locks,
        then the search and update, which sees every producer that committed
        before its lock was granted. The locks of keys in ``tried`` are not
        tried again (and ``tried`` learns the rest). On SQLite one small
        search and update per key (writers are serialized there).
        """
        if not starts:
            return {}, set(), set(), []
        if self.is_postgres:
            untried = [key for key in starts if key not in tried]
            if untried:
                for row in conn.execute(self._LOCK_KEYS_PG, {"keys": untried}):
                    tried[str(row.key)] = bool(row.locked)
            busy = {key for key in starts if not tried[key]}
            locked = {key: start for key, start in starts.items() if key not in busy}
            if not locked:
                return {}, busy, set(), []
            params: dict[str, Any] = {"keys": list(locked), "afters": list(locked.values())}
            if hand_on is None:
                rows = conn.execute(self._PROMOTE_PG, params).all()
            else:
                params.update(owner=hand_on.owner,
                              lease=timedelta(seconds=hand_on.lease_seconds))
                rows = conn.execute(self._PROMOTE_CLAIM_PG, params).all()
            return ({str(row.key): int(row.id) for row in rows if row.promoted},
                    busy, {str(row.key) for row in rows if row.id is None},
                    [row for row in rows if hand_on is not None and row.promoted
                     and row.lease_owner == hand_on.owner])
        t = email_table
        promoted: dict[str, int] = {}
        none_open: set[str] = set()
        claimed: list[Any] = []
        promote = t.update().values(key_head=True)
        returning: tuple[Any, ...] = (t.c.id,)
        if hand_on is not None:
            returning = (t.c.lease_owner, *_CLAIM_RETURNING)
            due = sa.and_(t.c.status == Status.QUEUED.value, t.c.due_at <= self.now_expr())
            promote = promote.values(
                status=sa.case((due, Status.SENDING.value), else_=t.c.status),
                attempts=sa.case((due, t.c.attempts + 1), else_=t.c.attempts),
                lease_owner=sa.case((due, hand_on.owner), else_=t.c.lease_owner),
                lease_expires_at=sa.case((due, self.later_expr(hand_on.lease_seconds)),
                                         else_=t.c.lease_expires_at))
        for key, start in starts.items():
            oldest = conn.execute(sa.select(sa.func.min(t.c.id)).where(
                t.c.key == key, t.c.status.in_(_OPEN), t.c.id > start)).scalar()
            if oldest is None:
                none_open.add(key)
                continue
            head = conn.execute(promote.where(t.c.id == oldest, t.c.key_head.is_(False))
                                .returning(*returning)).first()
            if head is not None:
                promoted[key] = int(head.id)
                if hand_on is not None and head.lease_owner == hand_on.owner:
                    claimed.append(head)
        return promoted, set(), none_open, claimed

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
        # A sending row occupies its key even without the flag (see _rehead).
        occupied = sa.or_(t.c.key_head, t.c.status == Status.SENDING.value)
        has_head = (sa.func.bool_or(occupied) if self.is_postgres
                    else sa.func.max(occupied) == 1)
        headless = (sa.select(sa.func.min(t.c.id))
                    .where(t.c.key.is_not(None), t.c.status.in_(_OPEN))
                    .group_by(t.c.key).having(~has_head))
        with self.write() as conn:
            return conn.execute(t.update().where(t.c.id.in_(headless.scalar_subquery()))
                                .values(key_head=True)).rowcount

    def release(self, claimed: Sequence[ClaimedEmail]) -> list[int]:
        """Give back rows claimed but never handed to the transport (attempt returned).

        Returns the ids given back (a row whose lease another claim took is not).
        """
        outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True) for email in claimed]
        recorded, _ = self.record(outcomes)
        return [outcome.email.id for outcome in recorded]

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
        :meth:`_rehead`): it becomes the head when the key has none or only a
        ``queued`` one, and waits for a ``sending`` head otherwise.
        """
        t = email_table
        with self.write() as conn:
            key = conn.execute(sa.select(t.c.key).where(
                t.c.id == email_id, t.c.status == Status.FAILED.value)).scalar()
            if self.is_postgres and key is not None:
                conn.execute(sa.select(key_lock(key)))
            done = conn.execute(
                t.update().where(t.c.id == email_id, t.c.status == Status.FAILED.value)
                .values(status=Status.QUEUED.value, attempts=0, due_at=self.now_expr(),
                        key_head=key is None, lease_owner=None, lease_expires_at=None)
            ).rowcount
            if done and key is not None:
                self._rehead(conn, [key])
        return bool(done)

    def _rehead(self, conn: Connection, keys: Sequence[str]) -> None:
        """Give each key's line id order again after dead letters were put back.

        The rule: the lowest open id of a key is its head. A ``queued`` head
        above a put-back email stops being head (it has not started). A
        ``sending`` one finishes first; it loses its ``key_head`` flag, which
        tells whoever records or reaps it to search its key from the start
        instead of past it, so the put-back email goes next. The caller holds
        the keys' locks on PostgreSQL.
        """
        t = email_table
        keys = list(keys)
        lowest = t.alias("lowest")
        is_lowest = t.c.id == (sa.select(sa.func.min(lowest.c.id))
                               .where(lowest.c.key == t.c.key, lowest.c.status.in_(_OPEN))
                               .scalar_subquery())
        sending = t.alias("sending")
        below = t.alias("below")
        queued_line = sa.and_(
            t.c.status == Status.QUEUED.value, t.c.key_head != is_lowest,
            ~sa.select(sending.c.id).where(
                sending.c.key == t.c.key, sending.c.status == Status.SENDING.value).exists())
        sending_above = sa.and_(
            t.c.status == Status.SENDING.value, t.c.key_head.is_(True),
            sa.select(below.c.id).where(
                below.c.key == t.c.key, below.c.status == Status.QUEUED.value,
                below.c.id < t.c.id).exists())
        conn.execute(
            t.update()
            .where(t.c.key.in_(keys), sa.or_(queued_line, sending_above))
            .values(key_head=sa.case((t.c.status == Status.SENDING.value, sa.false()),
                                     else_=is_lowest)))

    def retry_all_failed(self, keys_per_transaction: int | None = None) -> list[int]:
        """Put every dead letter back (as :meth:`retry_failed` does); their ids, oldest first.

        Set-based instead of a transaction per row: ``keys_per_transaction``
        keys (:data:`RETRY_ALL_KEYS_PER_TRANSACTION`) per transaction, each
        taking its keys' locks, putting their rows back in one UPDATE (the
        keyless ones with the first) and fixing their heads in one more (see
        :meth:`_rehead`). A transaction holding the locks of every key at once
        could fill PostgreSQL's shared lock table (``max_locks_per_transaction``
        times ``max_connections`` for the whole server). The locks are only
        tried (waiting on several while producers hold some could deadlock
        with them); the dead letters of a key whose lock was busy are then put
        back one by one, each waiting for its key's lock. A keyed row that
        failed after its key's chunk was done stays a dead letter.
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
                    locks = conn.execute(self._LOCK_KEYS_PG, {"keys": chunk}).all()
                    busy += [str(row.key) for row in locks if not row.locked]
                    chunk = [str(row.key) for row in locks if row.locked]
                scope: Any = t.c.key.in_(chunk)
                if number == 0:  # the keyless dead letters go with the first chunk
                    scope = sa.or_(t.c.key.is_(None), scope)
                retried += conn.execute(
                    t.update().where(failed, scope)
                    .values(status=Status.QUEUED.value, attempts=0, due_at=self.now_expr(),
                            key_head=t.c.key.is_(None), lease_owner=None,
                            lease_expires_at=None)
                    .returning(t.c.id)).scalars()
                if chunk:
                    self._rehead(conn, chunk)
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

    def record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False,
               hand_on: HandOn | None = None) -> tuple[list[Outcome], list[Outcome]]:
        """Write outcomes in one transaction; returns ``(recorded, lost)``.

        See :meth:`_record`. On PostgreSQL a deadlock between the key locks of
        this transaction and a producer's is retried: the guarded updates make
        a second run equivalent to the first. With ``hand_on``, the emails the
        batch makes their key's head are also claimed when due (see
        :class:`HandOn`).
        """
        tries = 0
        while True:
            try:
                return self._record(outcomes, scrub_sent=scrub_sent, hand_on=hand_on)
            except sa.exc.OperationalError as exc:
                tries += 1
                if getattr(exc.orig, "sqlstate", None) != "40P01" or tries >= 3:
                    raise

    def _record(self, outcomes: Sequence[Outcome], *, scrub_sent: bool = False,
                hand_on: HandOn | None = None) -> tuple[list[Outcome], list[Outcome]]:
        """Write outcomes in one transaction; returns ``(recorded, lost)``.

        Every update is guarded by ``status = 'sending' AND lease_owner =
        owner`` (the owner token is unique per claim, so it also pins the
        attempt). A row that no longer matches lost its lease: another claim
        owns it now, and its outcome is not overwritten. With ``scrub_sent``
        (``OUTBOX_SCRUB_SENT``) a row that becomes ``sent`` loses its MIME in
        the same UPDATE, so no committed ``sent`` row ever still holds a body.
        """
        scrub: dict[str, Any] = {"mime": None} if scrub_sent else {}
        t = email_table
        recorded: list[Outcome] = []
        lost: list[Outcome] = []
        plain_sent = [o for o in outcomes if o.status is Status.SENT and not o.error_message]
        others = [o for o in outcomes if not (o.status is Status.SENT and not o.error_message)]
        rewound: set[str | None] = set()
        # The keys a finished email may hand on: on PostgreSQL the first
        # sent-update, if there is one, tries their locks, which saves the
        # promotion a statement (see _record_sent). A key found rewound below
        # is locked by the promotion itself.
        lock_keys = sorted({o.email.key for o in outcomes
                            if o.email.key is not None and o.status is not Status.QUEUED})
        tried: dict[str, bool] = {}
        if hand_on is not None:
            hand_on.claimed = []
        handed: list[Any] = []
        with self.write() as conn:
            # Built only when needed: a function construct costs a few percent of
            # a batch that is all sent.
            now = self.now_expr() if others else None
            by_owner: dict[str, list[Outcome]] = {}
            for outcome in plain_sent:
                by_owner.setdefault(outcome.email.owner, []).append(outcome)
            for owner, group in by_owner.items():
                done = self._record_sent(conn, owner, [o.email.id for o in group],
                                         scrub=scrub_sent, lock_keys=lock_keys, tried=tried)
                lock_keys = []
                for outcome in group:
                    if outcome.email.id in done:
                        recorded.append(outcome)
                        if not done[outcome.email.id]:
                            rewound.add(outcome.email.key)
                    else:
                        lost.append(outcome)
            for outcome in others:
                values: dict[str, Any] = {"status": outcome.status.value, "lease_owner": None,
                                          "lease_expires_at": None}
                if outcome.status is Status.SENT:
                    values.update(sent_at=now, **scrub)
                if outcome.status is Status.FAILED:
                    values["failed_at"] = now
                if outcome.status is Status.QUEUED:
                    values["due_at"] = (self.later_expr(outcome.due_in)
                                        if outcome.due_in else now)
                if outcome.give_back_attempt:
                    values["attempts"] = t.c.attempts - 1
                if outcome.error_message is not None:
                    values["last_error"] = _error_text(outcome.error_code, outcome.error_message)
                    history = list(outcome.email.error_history)
                    entry: dict[str, Any] = {
                        "code": outcome.error_code, "message": outcome.error_message,
                        "at": self.clock().isoformat(timespec="seconds") + "Z",
                        "attempt": outcome.email.attempt}
                    if outcome.deferred:
                        entry["deferred"] = True
                    history.append(entry)
                    values["error_history"] = json.dumps(history)
                hit = conn.execute(
                    t.update()
                    .where(t.c.id == outcome.email.id, t.c.status == Status.SENDING.value,
                           t.c.lease_owner == outcome.email.owner)
                    .values(**values)
                    .returning(t.c.id, t.c.key_head)
                ).first()
                (recorded if hit is not None else lost).append(outcome)
                if hit is not None and not hit.key_head:
                    rewound.add(outcome.email.key)
            # A keyed email that is finished hands its key to the next one, past
            # itself; one that lost its flag to an email put back below it (see
            # _rehead), finished or queued again, from the start of its key.
            rewound.discard(None)
            finished = {o.email.key: o.email.id for o in recorded
                        if o.email.key is not None and o.status is not Status.QUEUED}
            after = {key: start for key, start in finished.items() if key not in rewound}
            handed = self._promote(conn, set(finished) | {str(key) for key in rewound},
                                   after=after, tried=tried, hand_on=hand_on)
        if hand_on is not None:
            hand_on.claimed = self._claimed(handed, hand_on.owner)
        return recorded, lost

    def _record_sent(self, conn: Connection, owner: str, ids: list[int], *, scrub: bool,
                     lock_keys: list[str], tried: dict[str, bool]) -> dict[int, bool]:
        """Mark ``ids`` (claimed by ``owner``) ``sent``; returns ``{id: key_head}`` of the hits.

        One statement, built once per store and only bound per batch (built
        per batch, its construction and the rendering of its IN list were
        about a tenth of the record's time). On PostgreSQL it also tries the
        locks of ``lock_keys``
        (``tried`` learns the answers), so a keyed tick's promotion needs only
        its own search-and-update after it: the locks are still taken in an
        earlier statement than the search that depends on them (see
        ``_LOCK_KEYS_PG``).

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
        if self.is_postgres:
            rows = conn.execute(stmt, {"ids": ids, "owner": owner, "keys": lock_keys}).all()
            tried.update((str(row.key), bool(row.locked)) for row in rows if row.id is None)
            return {int(row.id): bool(row.key_head) for row in rows if row.id is not None}
        rows = conn.execute(stmt, {"ids": ids, "owner": owner, "now": self.clock()}).all()
        return {int(row.id): bool(row.key_head) for row in rows}

    def _build_record_sent(self, scrub: bool) -> Any:
        t = email_table
        if self.is_postgres:
            scrub_sql = ", mime = NULL" if scrub else ""
            return sa.text(
                f"WITH locks AS MATERIALIZED (SELECT k.key, {_TRY_KEY_LOCK_PG} AS locked"
                "  FROM unnest(CAST(:keys AS varchar[])) AS k(key)),"
                " done AS (UPDATE outbox_email SET status = 'sent',"
                "  sent_at = timezone('UTC', now()), lease_owner = NULL,"
                f"  lease_expires_at = NULL{scrub_sql}"
                "  WHERE id = ANY(CAST(:ids AS bigint[]))"
                "  AND CASE WHEN status = 'sending' THEN lease_owner = :owner END"
                "  RETURNING id, key_head)"
                " SELECT id, key_head, CAST(NULL AS varchar) AS key, CAST(NULL AS boolean)"
                "  AS locked FROM done"
                " UNION ALL SELECT NULL, NULL, key, locked FROM locks"
            ).columns(sa.column("id", sa.BigInteger()), sa.column("key_head", sa.Boolean()),
                      sa.column("key", sa.String()), sa.column("locked", sa.Boolean()))
        return (t.update()
                .where(t.c.id.in_(sa.bindparam("ids", expanding=True)),
                       t.c.status == Status.SENDING.value,
                       t.c.lease_owner == sa.bindparam("owner"))
                .values(status=Status.SENT.value, sent_at=sa.bindparam("now", type_=sa.DateTime()),
                        lease_owner=None, lease_expires_at=None,
                        **({"mime": None} if scrub else {}))
                .returning(t.c.id, t.c.key_head))

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
