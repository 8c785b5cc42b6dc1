"""The store's work outside the lease cycle: the sweep, dead letters, retention, settings.

:class:`Housekeeping` is mixed into :class:`._store.Store` and runs on its
engine, in its short transactions (it declares what it takes from there): the
sweep's selection of rows left behind and its repairs, dead letters put back
or deleted, old ``sent`` rows deleted, and shared settings written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import _claim, _ordering
from ._models import Status, attachment_table, email_table, setting_table

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: ``lease_owner`` of a ``queued`` row that a stopping process gave back, or
#: had been handed after a commit and never claimed: provably in flight
#: nowhere, so the sweep takes it whatever its age. No claim owner looks like
#: it (those are ``host:pid:n:hex``), and a claim overwrites it.
GIVEN_BACK = "given-back"

#: Keys :meth:`Housekeeping.retry_all_failed` puts back per transaction (one
#: advisory lock each on PostgreSQL, held until the transaction ends).
RETRY_ALL_KEYS_PER_TRANSACTION = 500


class Housekeeping:
    """:class:`._store.Store`'s work for the sweep, dead letters, retention and settings."""

    # What Store provides: its clock and dialect, its transactions, "now" as SQL.
    clock: Callable[[], datetime]
    is_postgres: bool
    is_sqlite: bool

    if TYPE_CHECKING:
        def write(self) -> AbstractContextManager[Connection]: ...
        def read(self) -> AbstractContextManager[Connection]: ...
        def now_expr(self) -> sa.ColumnElement[datetime]: ...
        def later_expr(self, seconds: float) -> sa.ColumnElement[datetime]: ...

    # -- the sweep ------------------------------------------------------------

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
                  .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                         t.c.created_at <= cutoff)
                  .order_by(t.c.created_at, t.c.id).limit(limit))
        # Given back by a stopping process: in flight nowhere, so not age-gated.
        # They are few and young: the scan reads the queued rows' partial index.
        given_back = (sa.select(t.c.id, t.c.status, t.c.created_at)
                      .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                             t.c.created_at > cutoff, t.c.lease_owner == GIVEN_BACK)
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

        Rows marked :data:`GIVEN_BACK` are not gated. Reads the sweep's partial index.
        """
        t = email_table
        cutoff = self._sweep_cutoff(min_age_seconds)
        with self.read() as conn:
            count, oldest, now = conn.execute(
                sa.select(sa.func.count(), sa.func.min(t.c.created_at), self.now_expr())
                .where(_claim.claimable(self.now_expr, sqlite=self.is_sqlite),
                       t.c.created_at > cutoff,
                       sa.or_(t.c.lease_owner.is_(None), t.c.lease_owner != GIVEN_BACK))
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
