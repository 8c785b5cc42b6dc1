"""The SQL that differs between PostgreSQL and SQLite, in one place.

The outbox runs on two databases (see docs/architecture.md): PostgreSQL, the
production and multi-worker store, and SQLite, the embedded one. Each is a
strategy here, :class:`Postgres` and :class:`SQLite`, over a common base
(:class:`Dialect`) that holds what they share; :func:`dialect_of` picks one
from an engine or a connection, once (:func:`dialect_named` from a name). Every
other module asks its strategy and never tests which database it is on
(``tests/test_dialect.py`` keeps it so).

What differs, and where each strategy answers it:

* time: "now" is the database clock on PostgreSQL, so processes with skewed
  clocks agree on leases and ages; SQLite is one machine, so the caller's
  clock is the database clock (:meth:`Dialect.now`, ``later``, ``ago``). With
  a :class:`~._clock.TestClock` the store runs on :meth:`Dialect.on_clock`'s
  strategy, whose "now" is the caller's clock on PostgreSQL too
  (:class:`PostgresOnClock`); production SQL never changes;
* transactions: SQLite's writes begin ``IMMEDIATE`` (:meth:`Dialect.begin_write`),
  PostgreSQL's reads and dispatch run in autocommit (:meth:`Dialect.autocommit`);
* locks: PostgreSQL serializes the producers of a key, and whoever advances a
  key, on advisory locks; SQLite runs one writer at a time and needs neither;
* the claim: on PostgreSQL one statement (the reap and the claim, ``SKIP
  LOCKED``); on SQLite ``BEGIN IMMEDIATE`` and three. Their SQL is
  :mod:`._claim`'s, read top to bottom there;
* the per-key rule as SQL (:meth:`Dialect.advance`), recording a batch
  ``sent``, the inserts (``RETURNING``, ``ON CONFLICT``, NOTIFY), the tally's
  triggers, and a few functions (``least``/``min``, hours).
"""

from __future__ import annotations

import abc
import functools
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .. import _degrade
from .._errors import ConfigError
from . import _claim
from ._clock import utcnow
from ._listen import CHANNEL
from ._models import (
    TALLIED,
    Status,
    email_table,
    metadata,
    tally_table,
)

Clock = Callable[[], datetime]

#: The first key of the line locks' two-integer lock space ("ln" in ASCII):
#: PostgreSQL keeps two-key advisory locks apart from the one-key locks
#: producers take, so a line lock never waits for a request.
_LINE_LOCK_SPACE = 0x6C6E

_OPEN_SQL = "('queued', 'sending')"


def open_status(t: Any) -> sa.ColumnElement[bool]:
    """Open (queued or sending), the statuses written literally: SQLite reads a
    partial index only for a query that repeats its WHERE's terms."""
    status: sa.ColumnElement[str] = t.c.status
    return status.in_([sa.literal_column("'queued'"), sa.literal_column("'sending'")])


def holds_key(t: Any) -> sa.ColumnElement[bool]:
    """Holds its key's flag, written as ``ix_outbox_email_key_holder``'s WHERE is.

    ``key_head`` unqualified, as the index writes it: used only where ``t`` is
    the innermost FROM, which SQL resolves it to.
    """
    return sa.and_(sa.literal_column("key_head"), open_status(t))


class Dialect(abc.ABC):
    """One database's answers to what differs (see the module docstring)."""

    #: SQLAlchemy's name of the database.
    name: ClassVar[str]
    #: Whether "now" is the database's clock (else the caller's ``clock()``).
    database_clock: ClassVar[bool]
    #: Whether other processes can be woken by NOTIFY (and dispatchers LISTEN).
    listens: ClassVar[bool]
    #: Whether a producer's commit hands on the keys whose new email found an
    #: earlier one open (a recorder may have finished that one, unseen, meanwhile).
    advances_at_commit: ClassVar[bool]

    def index_hint(self, index: str) -> str:
        """What follows a table's name to pin ``index`` for the planner ("": none needed)."""
        return ""

    # -- engine and transactions ------------------------------------------------------

    @abc.abstractmethod
    def create_engine(self, url: sa.URL) -> Engine:
        """The outbox's own engine on ``url`` (its own pool, its own transactions)."""

    def check_app_url(self, url: sa.URL) -> None:
        """Refuse an app database the outbox cannot share with the delivery thread."""

    def prepare_app_engine(self, engine: Engine) -> None:
        """What each connection of the app's own engine needs (it connects on first use)."""

    def begin_write(self, conn: Connection) -> None:
        """Start a write transaction on ``conn`` (SQLAlchemy's implicit BEGIN otherwise)."""

    def autocommit(self, conn: Connection) -> Connection:
        """``conn`` for reads and the dispatcher's one-statement claim."""
        return conn

    # -- time --------------------------------------------------------------------------

    def on_clock(self) -> Dialect:
        """This strategy with "now" the caller's ``clock()`` in every statement.

        For a :class:`~._clock.TestClock` only: SQLite is that already; on
        PostgreSQL it is :class:`PostgresOnClock`, whose SQL binds the clock's
        value where the database's ``now()`` stands otherwise.
        """
        return self

    @abc.abstractmethod
    def now(self, clock: Clock) -> sa.ColumnElement[datetime]:
        """"Now" as SQL (naive UTC)."""

    @abc.abstractmethod
    def later(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        """``now + seconds`` as SQL, on the same clock as :meth:`now`."""

    @abc.abstractmethod
    def ago(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        """``now - seconds`` as SQL, on the same clock as :meth:`now`."""

    @abc.abstractmethod
    def epoch_now(self) -> sa.ColumnElement[float]:
        """"Now" in seconds since the epoch (the rate schedule's clock); on the
        caller's clock it is the bound parameter ``now``."""

    @abc.abstractmethod
    def hour_number(self, column: Any) -> Any:
        """``column`` as whole hours since the epoch (as the tally's triggers compute it)."""

    @abc.abstractmethod
    def hour_start(self, column: Any) -> Any:
        """``column`` truncated to the hour."""

    # -- functions and inserts ----------------------------------------------------------

    @abc.abstractmethod
    def least(self, *args: Any) -> Any:
        """The smallest of ``args`` (a scalar function, not the aggregate)."""

    @abc.abstractmethod
    def greatest(self, *args: Any) -> Any:
        """The largest of ``args`` (a scalar function, not the aggregate)."""

    @abc.abstractmethod
    def insert(self, table: sa.Table) -> Any:
        """An INSERT into ``table`` that takes ``on_conflict_do_nothing/update``."""

    def notify_columns(self, notify: bool) -> tuple[Any, ...]:
        """What an insert's RETURNING adds to wake the listeners of other processes."""
        return ()

    @abc.abstractmethod
    def insert_one(self, conn: Connection, values: dict[str, Any], notify: bool) -> int:
        """Insert one email without key or idempotency key; its id (see :mod:`._insert`)."""

    @abc.abstractmethod
    def insert_rows(self, conn: Connection, batch: list[dict[str, Any]], notify: bool) -> list[int]:
        """Insert many emails (the same columns each) in one statement; their ids, in order."""

    def email_at_each_step(self, walk: Any, columns: Sequence[Any]) -> tuple[Any, list[Any]]:
        """The email row each step of a walk over ids names: ``(FROM, columns)``."""
        t = email_table
        return walk.outerjoin(t, t.c.id == walk.c.email_id), list(columns)

    # -- locks and the per-key rule ------------------------------------------------------

    def lock_producer(self, conn: Connection | Session, key: str) -> None:
        """Take the lock a producer of ``key`` holds until its transaction ends."""

    def try_producer_locks(self, conn: Connection,
                           keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """Try the producer locks of ``keys`` (sorted) without waiting: ``(taken, busy)``."""
        return list(keys), []

    def lock_lines(self, conn: Connection, keys: Sequence[str]) -> None:
        """Take the line locks of ``keys`` (sorted), held to the end of the transaction."""

    def advance(self, conn: Connection, keys: Sequence[str]) -> list[int]:
        """The per-key rule (:mod:`._ordering`) on ``keys`` (sorted); the ids that got the flag.

        One key at a time: its lowest open email, its holder, then the flag moved.
        """
        t = email_table
        flagged = []
        for key in keys:
            lowest = conn.execute(sa.select(sa.func.min(t.c.id))
                                  .where(t.c.key == key, open_status(t))).scalar()
            if lowest is None:
                continue
            holder = conn.execute(sa.select(t.c.id, t.c.status)
                                  .where(t.c.key == key, holds_key(t)).limit(1)).first()
            if holder is not None and (holder.status != Status.QUEUED.value
                                       or holder.id == lowest):
                continue
            if holder is not None:
                conn.execute(t.update().where(t.c.id == holder.id).values(key_head=False))
            conn.execute(t.update().where(t.c.id == lowest).values(key_head=True))
            flagged.append(int(lowest))
        return flagged

    def advance_unblocked(self, conn: Connection, keys: Sequence[str]) -> list[int] | None:
        """:meth:`advance` without waiting on a row a request holds; None if it would have."""
        return self.advance(conn, keys)

    # -- the claim and the record ---------------------------------------------------------

    def claimable(self, now: _claim.Now) -> sa.ColumnElement[bool]:
        """Queued, due, and free to go (see :func:`._claim.claimable`)."""
        return _claim.claimable(now)

    @abc.abstractmethod
    def claim_due(self, conn: Connection, *, limit: int, owner: str, lease_seconds: float,
                  reap: bool, transport: str, clock: Clock) -> tuple[list[Any], list[Any], bool]:
        """Reap (with ``reap``) and claim up to ``limit`` due rows of ``transport`` on ``conn``.

        Committed. Returns ``(claimed, reaped, ordered)``: the claimed rows
        (:data:`._claim.CLAIM_RETURNING`), the reaped ones (``id, status,
        key``), and whether the reaped rows' keys were ordered again in the
        same transaction (else the caller does it).
        """

    def claim_values(self, clock: Clock, owner: Any, lease_seconds: float) -> dict[str, Any]:
        """The SET of a claim: ``queued -> sending``, ``attempts + 1``, a lease under ``owner``."""
        t = email_table
        return {"status": Status.SENDING.value, "attempts": t.c.attempts + 1,
                "lease_owner": owner, "lease_expires_at": self.later(clock, lease_seconds)}

    @abc.abstractmethod
    def record_sent(self, conn: Connection, sent: Sequence[tuple[int, str, str | None]], *,
                    scrub: bool, clock: Clock) -> set[int]:
        """Mark rows ``sent``, each guarded by its own claim: ``(id, owner, provider id)``.

        One statement for the whole batch, built once and only bound per
        record; the guard (still ``sending`` under that claim) is written so
        that it cannot steer the plan (see :meth:`._leases.Leases.record`).
        Returns the ids it changed.
        """

    # -- the tally -----------------------------------------------------------------------

    tally_ddl: ClassVar[tuple[str, ...]]
    tally_backfill: ClassVar[str]

    def create_tally(self, connection: Connection) -> None:
        """The tally's triggers, and the totals of the rows already there."""
        # exec_driver_sql: the SQL as written, no bind-parameter parsing of its text.
        for statement in self.tally_ddl:
            connection.exec_driver_sql(statement)
        connection.exec_driver_sql(self.tally_backfill)

    def drop_tally(self, connection: Connection) -> None:
        """What dropping ``outbox_email`` leaves of the tally's triggers."""

    @abc.abstractmethod
    def recount_tally(self, conn: Connection, counted: Any) -> tuple[dict[str, int],
                                                                     dict[str, int]]:
        """Replace the tally's rows with ``counted``: ``(kept, recounted)`` totals per status."""


# -- PostgreSQL's tally: statement-level triggers ---------------------------------------

_TALLIED_SQL = "(" + ", ".join(f"'{status.value}'" for status in TALLIED) + ")"

#: Two-integer advisory lock ("ta"): held by whoever folds or recounts the tally
#: (PostgreSQL), so that one of them at a time deletes its rows.
TALLY_LOCK = (0x7461, 0)

_PG_HOUR = ("CASE WHEN status = 'sent'"
            " THEN CAST(floor(extract(epoch FROM sent_at) / 3600) AS bigint) END")
# Statement-level: one appended row per key a statement changed, whatever the
# number of rows. INSERT only appends (send() must lock nothing shared);
# UPDATE and DELETE fold, at every 64th appended row, unless someone else is
# folding (a try-lock: nothing waits). TRUNCATE empties it.
_PG_FUNCTION = f"""\
CREATE OR REPLACE FUNCTION outbox_tally_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    fold boolean;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]});
        DELETE FROM outbox_tally;
        RETURN NULL;
    ELSIF TG_OP = 'INSERT' THEN
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, {_PG_HOUR}, count(*) FROM new_rows
        WHERE status IN {_TALLIED_SQL} GROUP BY 1, 2;
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, {_PG_HOUR}, -count(*) FROM old_rows
            WHERE status IN {_TALLIED_SQL} GROUP BY 1, 2
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    ELSE
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, sent_hour, sum(n) FROM (
                SELECT status, {_PG_HOUR} AS sent_hour, -1 AS n FROM old_rows
                WHERE status IN {_TALLIED_SQL}
                UNION ALL
                SELECT status, {_PG_HOUR}, 1 FROM new_rows
                WHERE status IN {_TALLIED_SQL}) AS moved
            GROUP BY status, sent_hour HAVING sum(n) <> 0
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    END IF;
    -- Only where each statement sees what the last fold committed (READ COMMITTED):
    -- a REPEATABLE READ snapshot may hold rows another fold deleted since.
    IF fold AND current_setting('transaction_isolation') = 'read committed'
            AND pg_try_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]}) THEN
        WITH keys AS (
            SELECT status, coalesce(sent_hour, -1) AS hour FROM outbox_tally
            GROUP BY 1, 2 HAVING count(*) > 1),
        folded AS (
            DELETE FROM outbox_tally
            WHERE (status, coalesce(sent_hour, -1)) IN (SELECT status, hour FROM keys)
            RETURNING status, sent_hour, n)
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, sent_hour, sum(n) FROM folded
        GROUP BY status, sent_hour HAVING sum(n) <> 0;
    END IF;
    RETURN NULL;
END
$$"""


def _pg_trigger(event: str, referencing: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.lower()} AFTER {event} ON outbox_email"
            f" REFERENCING {referencing} FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()")


#: The tally's triggers on PostgreSQL, in the order they are created (run by
#: :meth:`._dialect.Dialect.create_tally`). The migration that creates them
#: (outbox_0001) holds the same text: a test compares the catalogs.
PG_TALLY_DDL = (
    _PG_FUNCTION,
    _pg_trigger("INSERT", "NEW TABLE AS new_rows"),
    _pg_trigger("UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
    _pg_trigger("DELETE", "OLD TABLE AS old_rows"),
    ("CREATE TRIGGER outbox_tally_truncate AFTER TRUNCATE ON outbox_email"
    " FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()"),
)

#: Counts the rows already in ``outbox_email`` into a new ``outbox_tally`` (as the
#: triggers would), on PostgreSQL.
PG_TALLY_BACKFILL = (
    f"INSERT INTO outbox_tally (status, sent_hour, n) SELECT status, {_PG_HOUR},"
    f" count(*) FROM outbox_email WHERE status IN {_TALLIED_SQL} GROUP BY 1, 2")

class Postgres(Dialect):
    """PostgreSQL: the database clock, advisory locks, one-statement claims, NOTIFY."""

    name = "postgresql"
    database_clock = True
    listens = True
    advances_at_commit = True
    tally_ddl = PG_TALLY_DDL
    tally_backfill = PG_TALLY_BACKFILL

    _LOCK_LINES = sa.text(
        f"SELECT pg_advisory_xact_lock({_LINE_LOCK_SPACE}, hashtext(k.key))"
        " FROM unnest(CAST(:keys AS varchar[])) AS k(key) ORDER BY k.key")

    _TRY_PRODUCER_LOCKS = sa.text(
        "SELECT k.key, pg_try_advisory_xact_lock(hashtextextended(k.key, 0)) AS locked"
        " FROM unnest(CAST(:keys AS varchar[])) AS k(key) ORDER BY k.key"
    ).columns(sa.column("key", sa.String()), sa.column("locked", sa.Boolean()))

    # For each key: its lowest open email and its holder (one probe each, in
    # ix_outbox_email_key_open and ix_outbox_email_key_holder however deep the
    # backlog); then the rule, in one UPDATE of at most those two rows.
    _ADVANCE = sa.text(
        "WITH c AS MATERIALIZED (SELECT k.key, (SELECT min(o.id) FROM outbox_email o"
        f"  WHERE o.key = k.key AND o.status IN {_OPEN_SQL}) AS lowest, h.id AS holder,"
        "  h.status AS holder_status FROM unnest(CAST(:keys AS varchar[])) AS k(key)"
        "  LEFT JOIN LATERAL (SELECT h.id, h.status FROM outbox_email h WHERE h.key = k.key"
        f"   AND h.key_head AND h.status IN {_OPEN_SQL} LIMIT 1) h ON true)"
        " UPDATE outbox_email e SET key_head = (e.id = c.lowest) FROM c"
        " WHERE (e.id = c.lowest OR e.id = c.holder)"
        "  AND (c.holder IS NULL OR (c.holder_status = 'queued' AND c.holder <> c.lowest))"
        " RETURNING e.id, e.key_head"
    ).columns(sa.column("id", sa.BigInteger()), sa.column("key_head", sa.Boolean()))

    def __init__(self) -> None:
        self._record_sent: dict[bool, Any] = {}

    @staticmethod
    def producer_lock(key: str) -> sa.ColumnElement[Any]:
        """The lock a producer of ``key`` holds until its transaction ends, as SQL."""
        return sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(key, 0))

    def create_engine(self, url: sa.URL) -> Engine:
        return sa.create_engine(url, pool_size=4, max_overflow=8, pool_pre_ping=True)

    def autocommit(self, conn: Connection) -> Connection:
        # No BEGIN/ROLLBACK round trips; the claim is one statement.
        return conn.execution_options(isolation_level="AUTOCOMMIT")

    def on_clock(self) -> Dialect:
        return POSTGRES_ON_CLOCK

    def now(self, clock: Clock) -> sa.ColumnElement[datetime]:
        return sa.func.timezone("UTC", sa.func.now(), type_=sa.DateTime())

    def later(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        return self.now(clock) + sa.literal(timedelta(seconds=seconds), sa.Interval())

    def ago(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        return self.now(clock) - sa.literal(timedelta(seconds=seconds), sa.Interval())

    def epoch_now(self) -> sa.ColumnElement[float]:
        return sa.cast(sa.extract("epoch", sa.func.now()), sa.Float())

    def hour_number(self, column: Any) -> Any:
        return sa.cast(sa.func.floor(sa.extract("epoch", column) / 3600), sa.BigInteger())

    def hour_start(self, column: Any) -> Any:
        return sa.func.date_trunc("hour", column)

    def least(self, *args: Any) -> Any:
        return sa.func.least(*args)

    def greatest(self, *args: Any) -> Any:
        return sa.func.greatest(*args)

    def insert(self, table: sa.Table) -> Any:
        return pg.insert(table)

    def notify_columns(self, notify: bool) -> tuple[Any, ...]:
        # pg_notify in the insert itself saves the commit a round trip; PostgreSQL
        # delivers it only if the row's (sub)transaction commits, and sends one
        # notification per transaction however many rows carried it.
        return (sa.func.pg_notify(CHANNEL, ""),) if notify else ()

    def insert_one(self, conn: Connection, values: dict[str, Any], notify: bool) -> int:
        values["due_at_or_now"] = values.pop("due_at", None)
        return int(conn.execute(_pg_insert_one(notify), values).scalar_one())

    def insert_rows(self, conn: Connection, batch: list[dict[str, Any]], notify: bool) -> list[int]:
        # One array parameter per column rather than one parameter per value:
        # psycopg parses the placeholders of a statement text it cannot cache,
        # and for a thousand-row VALUES list that cost more than the insert.
        # The ids come from the sequence in ORDER BY order, so sorted they are
        # in row order (SQLAlchemy's own insertmanyvalues relies on the same).
        columns = [name for name in batch[0] if name != "created_at"]
        stmt = _pg_insert_rows(conn.dialect, tuple(columns), notify)
        params = {f"p_{name}": [row[name] for row in batch] for name in columns}
        return sorted(int(row[0]) for row in conn.execute(stmt, params))

    def email_at_each_step(self, walk: Any, columns: Sequence[Any]) -> tuple[Any, list[Any]]:
        # A LATERAL subquery, whose LIMIT keeps it a primary-key probe that the
        # planner cannot merge into the outer query.
        t = email_table
        found = (sa.select(*columns).where(t.c.id == walk.c.email_id).limit(1).lateral("e"))
        return walk.outerjoin(found, sa.true()), [found.c[column.name] for column in columns]

    def lock_producer(self, conn: Connection | Session, key: str) -> None:
        conn.execute(sa.select(self.producer_lock(key)))

    def try_producer_locks(self, conn: Connection,
                           keys: Sequence[str]) -> tuple[list[str], list[str]]:
        if not keys:
            return [], []
        locks = conn.execute(self._TRY_PRODUCER_LOCKS, {"keys": list(keys)}).all()
        return ([str(row.key) for row in locks if row.locked],
                [str(row.key) for row in locks if not row.locked])

    def lock_lines(self, conn: Connection, keys: Sequence[str]) -> None:
        if keys:
            conn.execute(self._LOCK_LINES, {"keys": list(keys)})

    def advance(self, conn: Connection, keys: Sequence[str]) -> list[int]:
        rows = conn.execute(self._ADVANCE, {"keys": list(keys)}).all()
        return sorted(int(row.id) for row in rows if row.key_head)

    def advance_unblocked(self, conn: Connection, keys: Sequence[str]) -> list[int] | None:
        # A request's uncommitted cancel() holds the row lock of the email it
        # cancels. One round trip more than the plain advance: the savepoint and
        # the timeout together; the timeout lasts to the commit, and nothing runs
        # after this.
        if not keys:
            return []
        conn.exec_driver_sql("SAVEPOINT outbox_advance; SET LOCAL lock_timeout = '200ms'")
        try:
            return self.advance(conn, keys)
        except sa.exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
                raise
            conn.exec_driver_sql("ROLLBACK TO SAVEPOINT outbox_advance")
            return None

    def claim_due(self, conn: Connection, *, limit: int, owner: str, lease_seconds: float,
                  reap: bool, transport: str, clock: Clock) -> tuple[list[Any], list[Any], bool]:
        # ONE statement, in autocommit (see _claim.PG_CLAIM): an idle tick is one round trip.
        rows = conn.execute(self._claim_statement(reap),
                            {"claim_transport": transport, "claim_limit": limit,
                             "claim_owner": owner,
                             "claim_lease": timedelta(seconds=lease_seconds),
                             **self._claim_params(clock)}).all()
        conn.commit()  # a no-op in autocommit; ends SQLAlchemy's transaction marker
        # The reaped rows' keys are ordered after the commit: a reaped holder
        # keeps its flag, so nothing waits on it.
        return ([row for row in rows if row.outcome == Status.SENDING.value],
                [row for row in rows if row.outcome == Status.QUEUED.value], False)

    def _claim_statement(self, reap: bool) -> sa.TextualSelect:
        return _claim.PG_CLAIM_AND_REAP if reap else _claim.PG_CLAIM

    def _claim_params(self, clock: Clock) -> dict[str, Any]:
        return {}

    def record_sent(self, conn: Connection, sent: Sequence[tuple[int, str, str | None]], *,
                    scrub: bool, clock: Clock) -> set[int]:
        stmt = self._record_sent.get(scrub)
        if stmt is None:
            # The rows as three arrays: an expanding IN list is rendered anew
            # for every record. The guard inside a CASE: a plain ``status =
            # 'sending'`` matches ix_outbox_email_lease's WHERE, and with a
            # queue's stale statistics the planner reads that index, walking
            # every dead 'sending' entry, instead of the primary key.
            stmt = self._record_sent[scrub] = sa.text(
                "UPDATE outbox_email AS e SET status = 'sent',"
                f" sent_at = {self._RECORD_NOW}, lease_owner = NULL,"
                " lease_expires_at = NULL, provider_message_id = c.pid"
                + (", mime = NULL" if scrub else "")
                + " FROM unnest(CAST(:ids AS bigint[]), CAST(:owners AS text[]),"
                " CAST(:pids AS text[])) AS c(id, owner, pid)"
                " WHERE e.id = c.id"
                " AND CASE WHEN e.status = 'sending' THEN e.lease_owner = c.owner END"
                " RETURNING e.id"
            ).columns(sa.column("id", sa.BigInteger()))
        params = {"ids": [row[0] for row in sent], "owners": [row[1] for row in sent],
                  "pids": [row[2] for row in sent], **self._record_params(clock)}
        return set(conn.execute(stmt, params).scalars().all())

    #: "now" in the record of a batch sent: the database's.
    _RECORD_NOW = "timezone('UTC', now())"

    def _record_params(self, clock: Clock) -> dict[str, Any]:
        return {}

    def drop_tally(self, connection: Connection) -> None:
        # The triggers went with outbox_email; PostgreSQL keeps their function.
        connection.exec_driver_sql("DROP FUNCTION IF EXISTS outbox_tally_rows()")

    def recount_tally(self, conn: Connection, counted: Any) -> tuple[dict[str, int],
                                                                     dict[str, int]]:
        # The tally's lock first (waiting for a fold in progress); then what was
        # kept and what is counted, from one snapshot: a change committed
        # meanwhile is in neither (its trigger's row stays).
        tally = tally_table
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock(*TALLY_LOCK)))
        cleared = tally.delete().returning(tally.c.status, tally.c.n).cte("cleared")
        added = (tally.insert().from_select(["status", "sent_hour", "n"], counted)
                 .returning(tally.c.status, tally.c.n).cte("added"))
        both = sa.union_all(
            sa.select(cleared.c.status, cleared.c.n.label("kept"),
                      sa.literal(0, sa.BigInteger()).label("counted")),
            sa.select(added.c.status, sa.literal(0, sa.BigInteger()), added.c.n)).subquery()
        rows = conn.execute(sa.select(both.c.status, sa.func.sum(both.c.kept),
                                      sa.func.sum(both.c.counted)).group_by(both.c.status))
        kept: dict[str, int] = {}
        recounted: dict[str, int] = {}
        for status, was, now in rows:
            kept[status], recounted[status] = int(was), int(now)
        return kept, recounted


class _CallersClock:
    """The caller's ``clock()`` as "now", bound into each statement (SQLite's, and
    PostgreSQL's under a test clock); ``epoch_now`` is the bound parameter ``now``."""

    database_clock = False

    def now(self, clock: Clock) -> sa.ColumnElement[datetime]:
        return sa.literal(clock(), sa.DateTime())

    def later(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        return sa.literal(clock() + timedelta(seconds=seconds), sa.DateTime())

    def ago(self, clock: Clock, seconds: float) -> sa.ColumnElement[datetime]:
        return sa.literal(clock() - timedelta(seconds=seconds), sa.DateTime())

    def epoch_now(self) -> sa.ColumnElement[float]:
        return sa.bindparam("now", type_=sa.Float())


class PostgresOnClock(_CallersClock, Postgres):
    """PostgreSQL with "now" the caller's clock, bound: for a :class:`~._clock.TestClock` only.

    Every statement that reads the database's ``now()`` in :class:`Postgres`
    binds ``clock()`` here instead (the claim, the record, the inserts'
    stamps, the rate schedule's epoch), as SQLite does; what a process with
    no test clock runs is :class:`Postgres`'s, unchanged.
    """

    def on_clock(self) -> Dialect:
        return self

    def insert_one(self, conn: Connection, values: dict[str, Any], notify: bool) -> int:
        # created_at and due_at are stamped from the clock (database_clock is False).
        return int(conn.execute(_pg_insert_stamped(notify), values).scalar_one())

    def insert_rows(self, conn: Connection, batch: list[dict[str, Any]], notify: bool) -> list[int]:
        stmt = _pg_insert_rows(conn.dialect, tuple(batch[0]), notify, stamped=True)
        params = {f"p_{name}": [row[name] for row in batch] for name in batch[0]}
        return sorted(int(row[0]) for row in conn.execute(stmt, params))

    def _claim_statement(self, reap: bool) -> sa.TextualSelect:
        return _claim.PG_CLAIM_AND_REAP_ON_CLOCK if reap else _claim.PG_CLAIM_ON_CLOCK

    def _claim_params(self, clock: Clock) -> dict[str, Any]:
        return {"claim_now": clock()}

    _RECORD_NOW = "CAST(:now AS timestamp)"

    def _record_params(self, clock: Clock) -> dict[str, Any]:
        return {"now": clock()}


# -- SQLite's tally: row-level triggers -------------------------------------------------

def _sqlite_tallied(column: str) -> str:
    """``column IN (tallied)`` as OR-ed equalities: in a trigger SQLite builds an IN list's
    lookup table anew for every row, a cost every claimed row would pay."""
    return "(" + " OR ".join(f"{column} = '{status.value}'" for status in TALLIED) + ")"


def _sqlite_add(row: str, sign: str) -> str:
    """SQLite: add ``sign`` 1 to the total of ``row`` (NEW or OLD), when its status is tallied."""
    hour = (f"CASE WHEN {row}.status = 'sent'"
            f" THEN CAST(strftime('%s', {row}.sent_at) AS INTEGER) / 3600 END")
    return (f"    UPDATE outbox_tally SET n = n {sign} 1"
            f" WHERE status = {row}.status AND sent_hour IS {hour};\n"
            f"    INSERT INTO outbox_tally (status, sent_hour, n) SELECT {row}.status, {hour}, {sign}1"
            f" WHERE {_sqlite_tallied(row + '.status')} AND NOT EXISTS (SELECT 1 FROM outbox_tally"
            f" WHERE status = {row}.status AND sent_hour IS {hour});\n")


def _sqlite_trigger(event: str, when: str, body: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.split()[0].lower()} AFTER {event}"
            f" ON outbox_email\nWHEN {when}\nBEGIN\n{body}END")


#: The tally's triggers on SQLite (see :data:`PG_TALLY_DDL`): writers are serialized,
#: so they update one row per key in place.
SQLITE_TALLY_DDL = (
    _sqlite_trigger("INSERT", _sqlite_tallied("NEW.status"), _sqlite_add("NEW", "+")),
    _sqlite_trigger(
        "UPDATE OF status, sent_at",
        f"({_sqlite_tallied('OLD.status')} OR {_sqlite_tallied('NEW.status')})"
        " AND (OLD.status IS NOT NEW.status OR OLD.sent_at IS NOT NEW.sent_at)",
        _sqlite_add("OLD", "-") + _sqlite_add("NEW", "+")),
    _sqlite_trigger("DELETE", _sqlite_tallied("OLD.status"), _sqlite_add("OLD", "-")),
)

#: Counts the rows already in ``outbox_email`` into a new ``outbox_tally``, on SQLite.
SQLITE_TALLY_BACKFILL = (
    "INSERT INTO outbox_tally (status, sent_hour, n) SELECT status, CASE WHEN"
    " status = 'sent' THEN CAST(strftime('%s', sent_at) AS INTEGER) / 3600 END,"
    f" count(*) FROM outbox_email WHERE status IN {_TALLIED_SQL} GROUP BY 1, 2")



class SQLite(_CallersClock, Dialect):
    """SQLite: one machine's clock, one writer at a time (``BEGIN IMMEDIATE``), no NOTIFY."""

    name = "sqlite"
    listens = False
    advances_at_commit = False
    tally_ddl = SQLITE_TALLY_DDL
    tally_backfill = SQLITE_TALLY_BACKFILL

    def index_hint(self, index: str) -> str:
        # Without statistics (no ANALYZE) the planner may take another index.
        return f" INDEXED BY {index}"

    def __init__(self) -> None:
        self._record_sent: dict[tuple[bool, bool], Any] = {}

    def create_engine(self, url: sa.URL) -> Engine:
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine

    def check_app_url(self, url: sa.URL) -> None:
        database = url.database or ""
        if database in ("", ":memory:") or url.query.get("mode") == "memory" or \
                database.startswith("file::memory:"):
            raise ConfigError(
                "SQLALCHEMY_DATABASE_URI",
                f"{url.render_as_string()!r} is an in-memory SQLite database; the request and "
                "the delivery thread would share one connection and one transaction. Use a "
                "file, e.g. 'sqlite:///app.db' (tests: a file under tmp_path)")

    def prepare_app_engine(self, engine: Engine) -> None:
        # The first connection, before any write, puts the file in WAL mode.
        if not event.contains(engine, "connect", sqlite_on_connect):
            event.listen(engine, "connect", sqlite_on_connect)

    def begin_write(self, conn: Connection) -> None:
        # A deferred transaction that reads and then writes fails with
        # SQLITE_BUSY whatever the busy timeout; an immediate one waits for the
        # write lock.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def hour_number(self, column: Any) -> Any:
        return sa.cast(sa.func.strftime("%s", column), sa.Integer()) // 3600  # integer division

    def hour_start(self, column: Any) -> Any:
        return sa.func.strftime("%Y-%m-%d %H:00:00", column)

    def least(self, *args: Any) -> Any:
        return sa.func.min(*args)

    def greatest(self, *args: Any) -> Any:
        return sa.func.max(*args)

    def insert(self, table: sa.Table) -> Any:
        return sqlite.insert(table)

    def insert_one(self, conn: Connection, values: dict[str, Any], notify: bool) -> int:
        # Its id is the cursor's lastrowid, which costs no result row to fetch
        # and process (see docs/performance.md).
        return int(conn.execute(_EMAIL_INSERT, values).lastrowid)

    def insert_rows(self, conn: Connection, batch: list[dict[str, Any]], notify: bool) -> list[int]:
        # Asked for RETURNING in parameter order, SQLAlchemy falls back to one
        # INSERT per row on SQLite. It needs no asking: the rows of a multi-row
        # INSERT take rowids in VALUES order, each one past the largest, under
        # the write lock, so the ids sorted are in row order.
        return sorted(int(row[0]) for row in conn.execute(_SQLITE_INSERT_ROWS, batch))

    def claimable(self, now: _claim.Now) -> sa.ColumnElement[bool]:
        return _claim.claimable(now, free=_claim.FREE_AS_INDEXED)

    def claim_due(self, conn: Connection, *, limit: int, owner: str, lease_seconds: float,
                  reap: bool, transport: str, clock: Clock) -> tuple[list[Any], list[Any], bool]:
        # BEGIN IMMEDIATE, the reap, the key order, the claim: one transaction.
        t = email_table
        pick = _claim.SQLITE_PICK.bindparams(now=clock(), limit=limit, transport=transport)
        self.begin_write(conn)
        try:
            reaped = (conn.execute(_claim.reap_statement(lambda: self.now(clock), None)).all()
                      if reap else [])
            keys = sorted({str(row.key) for row in reaped if row.key is not None})
            if keys:
                self.advance(conn, keys)
            rows = conn.execute(
                t.update().where(t.c.id.in_(pick.scalar_subquery()))
                .values(**self.claim_values(clock, owner, lease_seconds))
                .returning(*_claim.CLAIM_RETURNING)
            ).all()
        except BaseException:
            conn.rollback()
            raise
        conn.commit()
        return list(rows), list(reaped), True

    def record_sent(self, conn: Connection, sent: Sequence[tuple[int, str, str | None]], *,
                    scrub: bool, clock: Clock) -> set[int]:
        with_ids = any(row[2] is not None for row in sent)
        stmt = self._record_sent.get((scrub, with_ids))
        if stmt is None:
            # The rows as one JSON parameter, as unnest() takes arrays on
            # PostgreSQL: an expanding IN of pairs is rendered anew for every
            # record. (json_each is JSON1, built into SQLite since 3.38 and into
            # Python's builds before.)
            pid_sql = (", provider_message_id = (SELECT json_extract(value, '$[2]')"
                       " FROM json_each(:pairs) WHERE json_extract(value, '$[0]') = outbox_email.id)"
                       if with_ids else "")
            stmt = self._record_sent[(scrub, with_ids)] = sa.text(
                "UPDATE outbox_email SET status = 'sent', sent_at = :now, lease_owner = NULL,"
                f" lease_expires_at = NULL{pid_sql}{', mime = NULL' if scrub else ''}"
                " WHERE status = 'sending' AND (id, lease_owner) IN"
                " (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')"
                "  FROM json_each(:pairs))"
                " RETURNING id"
            ).bindparams(sa.bindparam("now", type_=sa.DateTime())).columns(
                sa.column("id", sa.BigInteger()))
        params = {"pairs": json.dumps([list(row) for row in sent]), "now": clock()}
        return set(conn.execute(stmt, params).scalars().all())

    def create_tally(self, connection: Connection) -> None:
        # The write lock first: the driver begins no transaction before DDL, so a
        # change could fall between the triggers and the count (see outbox_0001).
        connection.exec_driver_sql("DELETE FROM outbox_tally")
        super().create_tally(connection)

    def recount_tally(self, conn: Connection, counted: Any) -> tuple[dict[str, int],
                                                                     dict[str, int]]:
        # The DELETE takes SQLite's write lock: nobody writes until the caller commits.
        tally = tally_table
        kept: dict[str, int] = {}
        for status, n in conn.execute(tally.delete().returning(tally.c.status, tally.c.n)):
            kept[status] = kept.get(status, 0) + int(n)
        conn.execute(tally.insert().from_select(["status", "sent_hour", "n"], counted))
        recounted = {status: int(n) for status, n in conn.execute(
            sa.select(tally.c.status, sa.func.sum(tally.c.n)).group_by(tally.c.status)).all()}
        return kept, recounted


_EMAIL_INSERT = email_table.insert()
_SQLITE_INSERT_ROWS = email_table.insert().returning(email_table.c.id)


@functools.cache
def _pg_insert_one(notify: bool) -> sa.Insert:
    """PostgreSQL's INSERT of one email, on its clock, built once.

    Building the statement for each email costs more than executing it (see
    the enqueue figures in docs/performance.md).
    """
    t = email_table
    now = POSTGRES.now(utcnow)  # the database's clock: utcnow is not read
    due = sa.func.coalesce(sa.bindparam("due_at_or_now", type_=sa.DateTime()), now)
    return (t.insert().values(created_at=now, due_at=due)
            .returning(t.c.id, *POSTGRES.notify_columns(notify)))


@functools.cache
def _pg_insert_stamped(notify: bool) -> sa.Insert:
    """PostgreSQL's INSERT of one email whose ``created_at`` and ``due_at`` are given
    (:class:`PostgresOnClock`), built once."""
    t = email_table
    return t.insert().returning(t.c.id, *POSTGRES.notify_columns(notify))


@functools.cache
def _pg_insert_rows(dialect: sa.Dialect, columns: tuple[str, ...], notify: bool, *,
                    stamped: bool = False) -> sa.TextClause:
    """PostgreSQL: ``INSERT ... SELECT FROM unnest(arrays) ORDER BY ordinality``, built once.

    ``stamped``: ``columns`` hold ``created_at`` and ``due_at`` (a test clock's,
    see :class:`PostgresOnClock`); else both are the database's "now".
    """
    # The column's type without its COLLATE (the column keeps it).
    types = {name: email_table.c[name].type.compile(dialect=dialect).split(" COLLATE ")[0]
             for name in columns}
    arrays = ", ".join(f"CAST(:p_{name} AS {types[name]}[])" for name in columns)
    now = "timezone('UTC', now())"
    selected = ", ".join(f"coalesce(u.{name}, {now})" if name == "due_at" and not stamped
                         else f"u.{name}" for name in columns)
    quoted = ", ".join(f'"{name}"' for name in columns)
    returning = f"id, pg_notify('{CHANNEL}', '')" if notify else "id"
    if stamped:
        return sa.text(
            f"INSERT INTO {email_table.name} ({quoted}) "
            f"SELECT {selected} FROM unnest({arrays}) WITH ORDINALITY "
            f"AS u({', '.join(columns)}, ord) ORDER BY u.ord RETURNING {returning}")
    return sa.text(
        f"INSERT INTO {email_table.name} ({quoted}, created_at) "
        f"SELECT {selected}, {now} FROM unnest({arrays}) WITH ORDINALITY "
        f"AS u({', '.join(columns)}, ord) ORDER BY u.ord RETURNING {returning}")


POSTGRES = Postgres()
POSTGRES_ON_CLOCK = PostgresOnClock()
SQLITE = SQLite()
_DIALECTS: dict[str, Dialect] = {POSTGRES.name: POSTGRES, SQLITE.name: SQLITE}


def dialect_named(name: str) -> Dialect:
    """The strategy of the database SQLAlchemy calls ``name``.

    Raises :class:`~flask_mail_outbox.errors.ConfigError` for a database the
    outbox does not run on.
    """
    try:
        return _DIALECTS[name]
    except KeyError:
        raise ConfigError(
            "SQLALCHEMY_DATABASE_URI",
            f"the outbox runs on PostgreSQL ('postgresql+psycopg://user:password@host/db') "
            f"or SQLite ('sqlite:///app.db') only, not {name!r}"
            + ("; MySQL and MariaDB are not supported" if name in ("mysql", "mariadb")
               else "")) from None


def dialect_of(bind: Engine | Connection | sa.URL) -> Dialect:
    """The strategy of the database ``bind`` is on (or a URL names)."""
    if isinstance(bind, sa.URL):
        return dialect_named(bind.get_backend_name())
    return dialect_named(bind.dialect.name)


def create_engine(url: str | sa.URL) -> Engine:
    """The outbox's own engine on the app's database (its own pool, its own transactions)."""
    url = sa.make_url(url)
    return dialect_of(url).create_engine(url)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        # The busy timeout makes writers queue for the lock instead of failing.
        cursor.execute("PRAGMA busy_timeout=30000")
        ensure_wal(cursor)
    finally:
        cursor.close()


def sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    """The ``connect`` event for the app's own SQLite engine: WAL before its first write.

    The app's engine keeps its own busy timeout; only the journal mode, which
    is the file's and which the delivery thread needs, is set here.
    """
    cursor = dbapi_conn.cursor()
    try:
        ensure_wal(cursor)
    finally:
        cursor.close()


def ensure_wal(cursor: Any) -> None:
    """Switch a SQLite database to WAL (persistent, per file) unless it already is.

    WAL lets request threads read and commit while the delivery thread
    writes; in the default rollback-journal mode readers block the writer.
    """
    if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
    except Exception as exc:  # noqa: BLE001 - reported; SQLite still works, only slower
        _degrade.report(
            "Could not switch the SQLite database to WAL journal mode",
            consequence="request threads and the delivery thread block each other more, "
                        "and concurrent commits may wait up to the busy timeout",
            fix="run `PRAGMA journal_mode=WAL` on the database once while nothing else uses it",
            exc=exc)


@event.listens_for(metadata, "after_create")
def _create_tally_triggers(target: sa.MetaData, connection: Connection,
                           tables: Iterable[sa.Table] | None = None, **_: Any) -> None:
    """With ``outbox_tally`` new (``create_all``): its triggers, and the rows already there.

    Keyed to the tally, not to ``outbox_email``: a database made by an older
    ``create_all`` gets the tally, its triggers and its backfill together.
    """
    if tally_table in (tables or ()):
        dialect_of(connection).create_tally(connection)


@event.listens_for(metadata, "after_drop")
def _drop_tally_function(target: sa.MetaData, connection: Connection, **_: Any) -> None:
    dialect_of(connection).drop_tally(connection)
