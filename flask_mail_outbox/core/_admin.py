"""The operator's writes: dead letters put back or deleted, retention, shared settings.

On the store's engine; each is a short transaction of its own. A dead letter
put back takes its place in its key's line (the rule of :mod:`._ordering`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from . import _ordering
from ._database import Database
from ._models import (
    Status,
    attachment_table,
    email_table,
    event_table,
    retained_before,
    setting_table,
)

#: Keys :meth:`Admin.retry_all_failed` puts back per transaction (one
#: advisory lock each on PostgreSQL, held until the transaction ends).
RETRY_ALL_KEYS_PER_TRANSACTION = 500


class Admin:
    """Dead letters, retention and settings (see the module docstring), on ``db``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def retry_failed(self, email_id: int) -> bool:
        """Put a dead letter back: ``queued``, attempts 0, due now. False if not failed.

        A keyed one takes its place in its key's line by id (see
        the rule of :mod:`._ordering`). On PostgreSQL it waits for the key's
        producer lock first, as a ``send()`` of the key would.
        """
        t = email_table
        with self.db.write() as conn:
            key = conn.execute(sa.select(t.c.key).where(
                t.c.id == email_id, t.c.status == Status.FAILED.value)).scalar()
            if key is not None:
                self.db.dialect.lock_producer(conn, key)
            done = conn.execute(
                t.update().where(t.c.id == email_id, t.c.status == Status.FAILED.value)
                .values(status=Status.QUEUED.value, attempts=0, due_at=self.db.now_expr(),
                        scheduled_for=self.db.now_expr(),
                        key_head=False, lease_owner=None, lease_expires_at=None)
            ).rowcount
            if done and key is not None:
                _ordering.advance(conn, [key])
        return bool(done)

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
        with self.db.read() as conn:
            keys = sorted(conn.execute(sa.select(t.c.key).distinct().where(
                failed, t.c.key.is_not(None))).scalars())
        chunks = [keys[start:start + per] for start in range(0, len(keys), per)] or [[]]
        retried: list[int] = []
        busy: list[str] = []
        for number, chunk in enumerate(chunks):
            with self.db.write() as conn:
                chunk, busy_now = self.db.dialect.try_producer_locks(conn, chunk)
                busy += busy_now
                scope: Any = t.c.key.in_(chunk)
                if number == 0:  # the keyless dead letters go with the first chunk
                    scope = sa.or_(t.c.key.is_(None), scope)
                retried += conn.execute(
                    t.update().where(failed, scope)
                    .values(status=Status.QUEUED.value, attempts=0, due_at=self.db.now_expr(),
                            scheduled_for=self.db.now_expr(),
                            key_head=False, lease_owner=None, lease_expires_at=None)
                    .returning(t.c.id)).scalars()
                _ordering.advance(conn, chunk)
        if busy:
            with self.db.read() as conn:
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
        with self.db.write() as conn:
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
        return self._delete_before(older_than, batch, ended=False)

    def delete_ended(self, *, older_than: datetime, batch: int) -> int:
        """Delete up to ``batch`` rows that ended unsent before ``older_than``; how many.

        ``suppressed``, ``expired`` and ``cancelled`` rows, by ``ended_at`` (when
        they ended).
        """
        return self._delete_before(older_than, batch, ended=True)

    def delete_unmatched_events(self, *, older_than: datetime, batch: int) -> int:
        """Delete up to ``batch`` events matched to no email that occurred before ``older_than``.

        A matched event goes with its email (:meth:`_delete`); these (a webhook
        or a bounce about mail this outbox did not send, or whose email is gone)
        would otherwise stay for ever. Oldest first, on ``ix_outbox_event_email``
        (``email_id IS NULL`` is its leading range).
        """
        t = event_table
        with self.db.write() as conn:
            ids = list(conn.execute(
                sa.select(t.c.id).where(t.c.email_id.is_(None), t.c.occurred_at < older_than)
                .order_by(t.c.occurred_at, t.c.id).limit(batch)).scalars())
            if ids:
                conn.execute(t.delete().where(t.c.id.in_(ids)))
            return len(ids)

    def _delete_before(self, older_than: datetime, batch: int, *, ended: bool) -> int:
        """The oldest ``batch`` rows of :func:`._models.retained_before`, deleted."""
        rows = retained_before("id", ended=ended, index_hint=self.db.dialect.index_hint)
        old = (sa.text(f"{rows.text} ORDER BY {'ended_at' if ended else 'sent_at'} LIMIT :batch")
               .bindparams(sa.bindparam("older_than", older_than, type_=sa.DateTime()),
                           sa.bindparam("batch", batch, type_=sa.Integer())))
        return self._delete(old)

    def _delete(self, old: Any) -> int:
        """Delete the rows ``old`` selects, with their attachments and events."""
        t = email_table
        with self.db.write() as conn:
            ids = list(conn.execute(old).scalars())
            if ids:
                # Explicitly: SQLite only cascades with PRAGMA foreign_keys on.
                conn.execute(attachment_table.delete().where(
                    attachment_table.c.email_id.in_(ids)))
                # An email's delivery events go with it (they reference it, without a key).
                conn.execute(event_table.delete().where(event_table.c.email_id.in_(ids)))
                conn.execute(t.delete().where(t.c.id.in_(ids)))
            return len(ids)

    def set_setting(self, name: str, value: Any) -> None:
        """Store a shared setting (insert or replace) and commit."""
        t = setting_table
        raw = json.dumps(value)
        with self.db.write() as conn:
            updated = conn.execute(
                t.update().where(t.c.name == name).values(value=raw, updated_at=self.db.now_expr())
            ).rowcount
            if not updated:
                conn.execute(t.insert().values(name=name, value=raw, updated_at=self.db.now_expr()))
