"""What every part of the store shares: the engine, its database's SQL, transactions, "now".

The store's parts (see :mod:`._store`) each take a :class:`Database`: the
outbox's own engine, the strategy of its database (:mod:`._dialect`), the
clock, and short write and read transactions. Timestamps are naive UTC, on
:mod:`._clock`'s clocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from . import _ordering
from ._clock import utcnow
from ._dialect import Dialect, dialect_of
from ._listen import notify_statement

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Database:
    """The outbox's own engine, its database's strategy, its clock and its transactions."""

    def __init__(self, engine: Engine, *, clock: Callable[[], datetime] = utcnow,
                 clock_in_sql: bool = False) -> None:
        self.engine = engine
        self.clock = clock
        #: ``clock_in_sql`` (a :class:`~._clock.TestClock`'s): "now" is ``clock()`` in
        #: every statement, on PostgreSQL too (:meth:`._dialect.Dialect.on_clock`).
        dialect = dialect_of(engine)
        self.dialect: Dialect = dialect.on_clock() if clock_in_sql else dialect

    # -- time -----------------------------------------------------------------

    def now_expr(self) -> sa.ColumnElement[datetime]:
        """"Now" as SQL: the database clock on PostgreSQL, ``clock()`` on SQLite (and
        on PostgreSQL with ``clock_in_sql``)."""
        return self.dialect.now(self.clock)

    def later_expr(self, seconds: float) -> sa.ColumnElement[datetime]:
        """``now + seconds`` as SQL, on the same clock as :meth:`now_expr`."""
        return self.dialect.later(self.clock, seconds)

    # -- transactions ---------------------------------------------------------

    @contextmanager
    def write(self, conn: Connection | None = None) -> Iterator[Connection]:
        """A short write transaction on ``conn`` (a kept one), else on a new connection.

        On SQLite it starts with ``BEGIN IMMEDIATE`` (:meth:`._dialect.Dialect.begin_write`):
        a deferred transaction that reads and then writes fails with
        SQLITE_BUSY whatever the busy timeout, while an immediate one waits
        for the write lock.
        """
        if conn is None:
            with self.engine.connect() as own, self.write(own) as tx:
                yield tx
            return
        self.dialect.begin_write(conn)
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
            yield self.dialect.autocommit(conn)

    def dispatch_connection(self) -> Connection:
        """A connection for the claim (autocommit on PostgreSQL: one statement)."""
        return self.dialect.autocommit(self.engine.connect())

    def advance_keys(self, keys: Iterable[str]) -> list[int]:
        """Apply the per-key rule to ``keys`` in a short transaction of its own (after a cancel)."""
        wanted = sorted(set(keys))
        if not wanted:
            return []
        with self.write() as conn:
            return _ordering.advance(conn, wanted)

    def notify(self) -> None:
        """Wake every process's listening dispatcher now (PostgreSQL; its own statement)."""
        with self.engine.connect() as conn:
            conn.execute(notify_statement())
            conn.commit()


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
