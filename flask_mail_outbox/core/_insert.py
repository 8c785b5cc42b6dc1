"""The producer side: the INSERT that ``send()`` runs in the caller's session.

Nothing here opens a connection or commits: the row is written in the
caller's transaction, and goes out only if that transaction commits (the
after-commit hand-over is the Flask integration's,
``flask_mail_outbox._flask.staging``). Everything delivery does after
that is :class:`._store.Store`'s, on its own engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from . import _ordering
from ._clock import now_expr, utcnow
from ._listen import CHANNEL
from ._models import (
    SEARCH_RECIPIENT_LENGTH,
    SEARCH_SUBJECT_LENGTH,
    attachment_table,
    email_table,
    search_key,
)

_INSERT_CLAUSE = email_table.insert()


def email_dialect(session: Session) -> str:
    """The dialect name of the database ``session`` writes emails to."""
    return str(session.get_bind(clause=_INSERT_CLAUSE).dialect.name)


def email_connection(session: Session) -> Connection:
    """``session``'s connection to the database it writes emails to, in its transaction."""
    return session.connection(bind_arguments={"clause": _INSERT_CLAUSE})


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
    reads (see :meth:`._store.Store.write`). On PostgreSQL, producers of one ``key``
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
        email_id = _insert_plain(session, dialect, values, clock, notify)
        created, waits = True, False
    else:
        email_id, created, waits = _insert_keyed(session, dialect, values, clock, notify)
    if created and attachments:
        session.execute(attachment_table.insert(),
                        [dict(row, email_id=email_id) for row in attachments])
    return email_id, created, waits


def insert_emails(session: Session, rows: Sequence[tuple[dict[str, Any], Sequence[dict[str, Any]]]],
                  *, key: str | None, clock: Callable[[], datetime] = utcnow,
                  notify: bool = False, dialect: str | None = None) -> list[tuple[int, bool]]:
    """Insert many email rows in ``session``, as N :func:`insert_email` would; ``[(id, waits)]``.

    ``rows`` are ``(values, attachments)`` pairs in send order, all with the same
    ``key`` (or none) and no idempotency key. Keyless, they go in one multi-row
    INSERT (SQLAlchemy's insertmanyvalues, ids returned in parameter order).
    With a key, the first goes through :func:`insert_email` (the producer lock,
    and ``key_head`` when nothing of its key is open) and the rest in one
    multi-row INSERT behind it: none of them can hold the key, and on
    PostgreSQL each waits for the commit to advance the key, exactly as N
    ``send()`` calls leave them. The attachments of all go in one executemany.
    """
    if not rows:
        return []
    if dialect is None:
        dialect = email_dialect(session)
    results: list[tuple[int, bool]] = []
    rest = rows
    if key is not None:
        first_values, first_attachments = rows[0]
        email_id, _, waits = insert_email(session, dict(first_values, key=key),
                                          first_attachments, clock=clock, notify=notify,
                                          dialect=dialect)
        results.append((email_id, waits))
        rest = rows[1:]
    batch = [_batch_values(values, key, dialect, clock) for values, _ in rest]
    if batch:
        ids = (_insert_unnest(session, batch, notify) if dialect == "postgresql"
               else _insert_values(session, batch, dialect, notify))
        waits = key is not None and dialect == "postgresql"
        results.extend((email_id, waits) for email_id in ids)
    attachments = [dict(att, email_id=email_id)
                   for (email_id, _), (_, atts) in zip(results[len(rows) - len(rest):], rest)
                   for att in atts]
    if attachments:
        session.execute(attachment_table.insert(), attachments)
    return results


def _batch_values(values: dict[str, Any], key: str | None, dialect: str,
                  clock: Callable[[], datetime]) -> dict[str, Any]:
    """One row of a multi-row insert (every row has the same columns).

    On PostgreSQL ``created_at`` and a missing ``due_at`` are the database's
    "now", as for one email; elsewhere ``clock()``.
    """
    values = dict(values, key=key, key_head=False)
    values.update(search_values(values["recipients"], values["subject"]))
    if dialect != "postgresql":
        now = clock()
        values["created_at"] = now
        if values.get("due_at") is None:
            values["due_at"] = now
    return values


def _insert_values(session: Session, batch: list[dict[str, Any]], dialect: str,
                   notify: bool) -> list[int]:
    """``INSERT ... VALUES (...), (...) RETURNING id`` (insertmanyvalues); ids in row order.

    Asked for RETURNING in parameter order, SQLAlchemy falls back to one
    INSERT per row on SQLite. It needs no asking: the rows of a multi-row
    INSERT take rowids in VALUES order, each one past the largest, under the
    write lock, so the ids sorted are in row order.
    """
    stmt = _plain_insert(dialect, notify, many=dialect != "sqlite")
    conn = session.connection(bind_arguments={"clause": stmt})
    ids = [int(row[0]) for row in conn.execute(stmt, batch)]
    return sorted(ids) if dialect == "sqlite" else ids


def _insert_unnest(session: Session, batch: list[dict[str, Any]], notify: bool) -> list[int]:
    """PostgreSQL: ``INSERT ... SELECT FROM unnest(arrays) ORDER BY ordinality``; ids in order.

    One array parameter per column rather than one parameter per value:
    psycopg parses the placeholders of a statement text it cannot cache, and
    for a thousand-row VALUES list that cost more than the insert. The ids
    come from the sequence in ``ORDER BY`` order, so sorted they are in row
    order (SQLAlchemy's own insertmanyvalues relies on the same).
    """
    columns = [name for name in batch[0] if name != "created_at"]
    conn = session.connection(bind_arguments={"clause": _INSERT_CLAUSE})
    stmt = _unnest_insert(conn.dialect, tuple(columns), notify)
    params = {f"p_{name}": [row[name] for row in batch] for name in columns}
    return sorted(int(row[0]) for row in conn.execute(stmt, params))


@functools.cache
def _unnest_insert(dialect: sa.Dialect, columns: tuple[str, ...], notify: bool) -> sa.TextClause:
    """The statement of :func:`_insert_unnest` for these columns, built once."""
    # The column's type without its COLLATE (the column keeps it).
    types = {name: email_table.c[name].type.compile(dialect=dialect).split(" COLLATE ")[0]
             for name in columns}
    arrays = ", ".join(f"CAST(:p_{name} AS {types[name]}[])" for name in columns)
    now = "timezone('UTC', now())"
    selected = ", ".join(f"coalesce(u.{name}, {now})" if name == "due_at" else f"u.{name}"
                         for name in columns)
    quoted = ", ".join(f'"{name}"' for name in columns)
    returning = f"id, pg_notify('{CHANNEL}', '')" if notify else "id"
    return sa.text(
        f"INSERT INTO {email_table.name} ({quoted}, created_at) "
        f"SELECT {selected}, {now} FROM unnest({arrays}) WITH ORDINALITY "
        f"AS u({', '.join(columns)}, ord) ORDER BY u.ord RETURNING {returning}")


def search_values(recipients: str | Sequence[str], subject: str) -> dict[str, str]:
    """The dashboard's search columns for a row: first recipient and subject, normalised.

    ``recipients`` is the list, or the JSON the row stores.
    """
    if isinstance(recipients, str):
        recipients = json.loads(recipients)
    first = recipients[0] if recipients else ""
    return {"search_recipient": search_key(first, SEARCH_RECIPIENT_LENGTH),
            "search_subject": search_key(subject, SEARCH_SUBJECT_LENGTH)}


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
def _plain_insert(dialect: str, notify: bool, many: bool = False) -> sa.Insert:
    """The INSERT of an email with neither key nor idempotency key, built once.

    Building the statement for each email costs more than executing it (see
    the enqueue figures in docs/performance.md). ``many``: for an
    executemany, whose ids must come back in the order of the rows given.
    """
    t = email_table
    stmt = t.insert()
    if dialect == "postgresql":
        now = now_expr(dialect)
        due = sa.func.coalesce(sa.bindparam("due_at_or_now", type_=sa.DateTime()), now)
        stmt = stmt.values(created_at=now, due_at=due)
    return stmt.returning(*_returning(dialect, notify), sort_by_parameter_order=many)


def _insert_plain(session: Session, dialect: str, values: dict[str, Any],
                  clock: Callable[[], datetime], notify: bool) -> int:
    """Insert ``values`` (no key, no idempotency key); the new row's id.

    SQLite: a plain INSERT, the id from the cursor's ``lastrowid``; elsewhere
    :func:`_plain_insert` (``RETURNING id``, and the wake-up on PostgreSQL).
    """
    if dialect == "postgresql":
        values["due_at_or_now"] = values.pop("due_at", None)
    else:
        now = clock()
        values["created_at"] = now
        if values.get("due_at") is None:
            values["due_at"] = now
    if dialect == "sqlite":
        # One row: its id is the cursor's lastrowid, which costs no result row
        # to fetch and process (see docs/performance.md).
        conn = session.connection(bind_arguments={"clause": _INSERT_CLAUSE})
        return int(conn.execute(_INSERT_CLAUSE, values).lastrowid)
    stmt = _plain_insert(dialect, notify)
    conn = session.connection(bind_arguments={"clause": stmt})
    return int(conn.execute(stmt, values).scalar_one())


def _insert_keyed(session: Session, dialect: str, values: dict[str, Any],
                  clock: Callable[[], datetime], notify: bool) -> tuple[int, bool, bool]:
    """Insert ``values`` with a key, an idempotency key or both: ``(id, created, waits)``.

    A keyed email takes its key's producer lock first (PostgreSQL) and holds
    its key at once when no earlier email of the key is open.
    """
    now = now_expr(dialect, clock)
    values["created_at"] = now
    if values.get("due_at") is None:
        values["due_at"] = now
    keyed = values.get("key") is not None
    if keyed:
        if dialect == "postgresql":
            session.execute(sa.select(_ordering.producer_lock(values["key"])))
        values["key_head"] = _ordering.holds_at_insert(values["key"])
    email_id, created, key_head = _insert_unless_stored(session, dialect, values, notify)
    return email_id, created, created and keyed and dialect == "postgresql" and not key_head


def _insert_unless_stored(session: Session, dialect: str, values: dict[str, Any],
                          notify: bool) -> tuple[int, bool, bool]:
    """Insert ``values`` unless their ``idempotency_key`` is stored: ``(id, created, key_head)``.

    A stored one's id comes back with ``created=False``. On SQLite and
    PostgreSQL that is one ``INSERT ... ON CONFLICT DO NOTHING``; elsewhere a
    lookup, then the insert.
    """
    returning = (*_returning(dialect, notify), email_table.c.key_head)
    idem = values.get("idempotency_key")
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
    return int(row.id), True, bool(row.key_head)


def cancel_emails(session: Session, *, email_ids: Sequence[int] = (), key: str | None = None,
                  idempotency_key: str | None = None) -> tuple[list[tuple[int, str | None]], int]:
    """Cancel queued rows in the caller's ``session`` (not committed); ``(cancelled, in_flight)``.

    ``cancelled``: ``(id, key)`` of each row moved from ``queued`` to
    ``cancelled`` (waiting for its ``send_after`` or a retry included);
    ``in_flight``: how many rows the criteria name that are ``sending``
    already and are not cancelled. The compare-and-set on ``status =
    'queued'`` is the gate a claim also passes: a row is either claimed or
    cancelled, never both. A cancelled key holder gives up its flag here;
    the next email of its key is handed the flag after the commit (see
    :meth:`._store.Store.advance_keys`), so a request never holds a key's line lock.
    """
    t = email_table
    if email_ids:
        where: Any = t.c.id.in_(list(email_ids))
    elif key is not None:
        where = t.c.key == key
    else:
        where = t.c.idempotency_key == idempotency_key
    conn = email_connection(session)
    rows = conn.execute(
        t.update().where(where, t.c.status == "queued")
        .values(status="cancelled", key_head=False, lease_owner=None, lease_expires_at=None,
                last_error="cancelled by mail.cancel() before it was sent")
        .returning(t.c.id, t.c.key)).all()
    in_flight = conn.execute(sa.select(sa.func.count()).select_from(t)
                             .where(where, t.c.status == "sending")).scalar_one()
    return [(int(row.id), row.key) for row in rows], int(in_flight)
