"""The producer side: the INSERT that ``send()`` runs in the caller's session.

Nothing here opens a connection or commits: the row is written in the
caller's transaction, and goes out only if that transaction commits (the
after-commit hand-over is the Flask integration's,
``flask_mail_outbox._flask.staging``). Everything delivery does after
that is :class:`._store.Store`'s, on its own engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from .. import _degrade
from .._errors import ConfigError
from . import _ordering
from ._clock import utcnow
from ._dialect import Dialect, dialect_of
from ._models import (
    SEARCH_RECIPIENT_LENGTH,
    SEARCH_SUBJECT_LENGTH,
    attachment_table,
    email_table,
    search_key,
)

_INSERT_CLAUSE = email_table.insert()


def email_dialect(session: Session) -> Dialect:
    """The strategy of the database ``session`` writes emails to."""
    return dialect_of(session.get_bind(clause=_INSERT_CLAUSE))


def email_connection(session: Session) -> Connection:
    """``session``'s connection to the database it writes emails to, in its transaction."""
    return session.connection(bind_arguments={"clause": _INSERT_CLAUSE})


@contextmanager
def tables_needed() -> Iterator[None]:
    """Turn the driver's "no such table: outbox_email" (with the whole INSERT) into one
    :class:`ConfigError` that says how to create the tables.

    Only after a statement failed: the happy path runs no extra query. The key is
    SQLALCHEMY_DATABASE_URI, the setting that names the database without them. A
    ConfigError rather than a new class: it is a setup step not done, like a database
    the outbox cannot run on, and it needs no new public name.
    """
    try:
        yield
    except sa.exc.DBAPIError as exc:
        missing = _degrade.tables_missing(exc)
        if missing is None:
            raise
        # from None: the chained driver error would print the whole INSERT again.
        raise ConfigError(
            "SQLALCHEMY_DATABASE_URI",
            f"the outbox tables do not exist in this database ({missing}): create them with "
            "`flask db upgrade heads` (Flask-Migrate, see docs/migrations.md), or "
            "mail.create_all() after db.create_all() in development and tests; roll back "
            "this session's transaction") from None


def insert_email(session: Session, values: dict[str, Any], attachments: Sequence[dict[str, Any]],
                 *, clock: Callable[[], datetime] = utcnow,
                 notify: bool = False, dialect: Dialect | None = None,
                 recipients: Sequence[str] | None = None) -> tuple[int, bool, bool]:
    """Insert one email row in the caller's ``session``; returns ``(id, created, waits)``.

    With ``notify``, on PostgreSQL, the insert also wakes the listeners of
    other processes (:meth:`._dialect.Dialect.notify_columns`): the commit needs no NOTIFY.
    ``dialect`` and ``recipients`` (the list ``values["recipients"]`` holds
    as JSON) spare lookups the caller has made already.

    ``created_at`` (and ``due_at`` unless given) are "now" on the database's
    clock. With an ``idempotency_key`` already stored, nothing is inserted and
    the existing row's id comes back with ``created=False``. The insert goes
    first so that on SQLite the transaction takes the write lock before it
    reads (see :meth:`._database.Database.write`). On PostgreSQL, producers of one ``key``
    are serialized by a transaction-scoped advisory lock, so id order is
    commit order within a key; ``waits`` is True when the new email found an
    earlier one of its key open: its commit must :func:`._ordering.advance`
    the key (see there).
    """
    strategy = email_dialect(session) if dialect is None else dialect
    values = dict(values)
    values.update(search_values(values["recipients"] if recipients is None else recipients,
                                values["subject"]))
    with tables_needed():
        if values.get("key") is None and values.get("idempotency_key") is None:
            email_id = _insert_plain(session, strategy, values, clock, notify)
            created, waits = True, False
        else:
            email_id, created, waits = _insert_keyed(session, strategy, values, clock, notify)
        if created and attachments:
            session.execute(attachment_table.insert(),
                            [dict(row, email_id=email_id) for row in attachments])
    return email_id, created, waits


def insert_emails(session: Session, rows: Sequence[tuple[dict[str, Any], Sequence[dict[str, Any]]]],
                  *, key: str | None, clock: Callable[[], datetime] = utcnow,
                  notify: bool = False, dialect: Dialect | None = None) -> list[tuple[int, bool]]:
    """Insert many email rows in ``session``, as N :func:`insert_email` would; ``[(id, waits)]``.

    ``rows`` are ``(values, attachments)`` pairs in send order, all with the same
    ``key`` (or none) and no idempotency key. Keyless, they go in one multi-row
    INSERT (:meth:`._dialect.Dialect.insert_rows`, ids in row order).
    With a key, the first goes through :func:`insert_email` (the producer lock,
    and ``key_head`` when nothing of its key is open) and the rest in one
    multi-row INSERT behind it: none of them can hold the key, and on
    PostgreSQL each waits for the commit to advance the key, exactly as N
    ``send()`` calls leave them. The attachments of all go in one executemany.
    """
    if not rows:
        return []
    strategy = email_dialect(session) if dialect is None else dialect
    results: list[tuple[int, bool]] = []
    rest = rows
    if key is not None:
        first_values, first_attachments = rows[0]
        email_id, _, waits = insert_email(session, dict(first_values, key=key),
                                          first_attachments, clock=clock, notify=notify,
                                          dialect=strategy)
        results.append((email_id, waits))
        rest = rows[1:]
    batch = [_batch_values(values, key, strategy, clock) for values, _ in rest]
    with tables_needed():
        if batch:
            ids = strategy.insert_rows(email_connection(session), batch, notify)
            waits = key is not None and strategy.advances_at_commit
            results.extend((email_id, waits) for email_id in ids)
        attachments = [dict(att, email_id=email_id)
                       for (email_id, _), (_, atts) in zip(results[len(rows) - len(rest):],
                                                           rest)
                       for att in atts]
        if attachments:
            session.execute(attachment_table.insert(), attachments)
    return results


def _batch_values(values: dict[str, Any], key: str | None, strategy: Dialect,
                  clock: Callable[[], datetime]) -> dict[str, Any]:
    """One row of a multi-row insert (every row has the same columns).

    On PostgreSQL ``created_at`` and a missing ``due_at`` are the database's
    "now", as for one email (:meth:`._dialect.Dialect.insert_rows`); on
    SQLite ``clock()``.
    """
    values = dict(values, key=key, key_head=False)
    values.update(search_values(values["recipients"], values["subject"]))
    if not strategy.database_clock:
        _stamp(values, clock)
    return values


def _stamp(values: dict[str, Any], clock: Callable[[], datetime]) -> None:
    """``created_at``, and ``due_at`` unless given, from ``clock()``."""
    now = clock()
    values["created_at"] = now
    if values.get("due_at") is None:
        values["due_at"] = now


def search_values(recipients: str | Sequence[str], subject: str) -> dict[str, str]:
    """The dashboard's search columns for a row: first recipient and subject, normalised.

    ``recipients`` is the list, or the JSON the row stores.
    """
    if isinstance(recipients, str):
        recipients = json.loads(recipients)
    first = recipients[0] if recipients else ""
    return {"search_recipient": search_key(first, SEARCH_RECIPIENT_LENGTH),
            "search_subject": search_key(subject, SEARCH_SUBJECT_LENGTH)}


def _insert_plain(session: Session, strategy: Dialect, values: dict[str, Any],
                  clock: Callable[[], datetime], notify: bool) -> int:
    """Insert ``values`` (no key, no idempotency key); the new row's id.

    On the database's own clock (PostgreSQL) ``created_at`` and a missing
    ``due_at`` are its "now"; elsewhere ``clock()``. The statement is the
    database's (:meth:`._dialect.Dialect.insert_one`).
    """
    if not strategy.database_clock:
        _stamp(values, clock)
    return strategy.insert_one(email_connection(session), values, notify)


def _insert_keyed(session: Session, strategy: Dialect, values: dict[str, Any],
                  clock: Callable[[], datetime], notify: bool) -> tuple[int, bool, bool]:
    """Insert ``values`` with a key, an idempotency key or both: ``(id, created, waits)``.

    A keyed email takes its key's producer lock first (PostgreSQL) and holds
    its key at once when no earlier email of the key is open.
    """
    now = strategy.now(clock)
    values["created_at"] = now
    if values.get("due_at") is None:
        values["due_at"] = now
    keyed = values.get("key") is not None
    if keyed:
        strategy.lock_producer(session, values["key"])
        values["key_head"] = _ordering.holds_at_insert(values["key"])
    email_id, created, key_head = _insert_unless_stored(session, strategy, values, notify)
    return email_id, created, created and keyed and strategy.advances_at_commit and not key_head


def _insert_unless_stored(session: Session, strategy: Dialect, values: dict[str, Any],
                          notify: bool) -> tuple[int, bool, bool]:
    """Insert ``values`` unless their ``idempotency_key`` is stored: ``(id, created, key_head)``.

    A stored one's id comes back with ``created=False``: one ``INSERT ... ON
    CONFLICT DO NOTHING``, then the lookup only when it inserted nothing.
    """
    returning = (email_table.c.id, *strategy.notify_columns(notify), email_table.c.key_head)
    idem = values.get("idempotency_key")
    if idem is None:
        row = session.execute(email_table.insert().values(**values).returning(*returning)).one()
        return int(row.id), True, bool(row.key_head)
    stmt = (strategy.insert(email_table).values(**values)
            .on_conflict_do_nothing(index_elements=["idempotency_key"])
            .returning(*returning))
    inserted = session.execute(stmt).first()
    if inserted is None:
        existing = session.execute(
            sa.select(email_table.c.id).where(email_table.c.idempotency_key == idem)
        ).scalar_one()
        return int(existing), False, False
    return int(inserted.id), True, bool(inserted.key_head)


def cancel_emails(session: Session, *, email_ids: Sequence[int] = (), key: str | None = None,
                  idempotency_key: str | None = None, scrub: bool = False,
                  clock: Callable[[], datetime] = utcnow,
                  dialect: Dialect | None = None) -> tuple[list[tuple[int, str | None]], int]:
    """Cancel queued rows in the caller's ``session`` (not committed); ``(cancelled, in_flight)``.

    ``cancelled``: ``(id, key)`` of each row moved from ``queued`` to
    ``cancelled`` (waiting for its ``send_after`` or a retry included);
    ``in_flight``: how many rows the criteria name that are ``sending``
    already and are not cancelled. The compare-and-set on ``status =
    'queued'`` is the gate a claim also passes: a row is either claimed or
    cancelled, never both. A cancelled key holder gives up its flag here;
    the next email of its key is handed the flag after the commit (see
    :meth:`._database.Database.advance_keys`), so a request never holds a key's line lock.
    ``ended_at`` is "now" (``dialect``'s, on ``clock``), which retention counts
    from; with ``scrub`` (``OUTBOX_SCRUB_SENT``) the MIME goes too.
    """
    t = email_table
    if email_ids:
        where: Any = t.c.id.in_(list(email_ids))
    elif key is not None:
        where = t.c.key == key
    else:
        where = t.c.idempotency_key == idempotency_key
    conn = email_connection(session)
    now = (dialect or email_dialect(session)).now(clock)
    ended: dict[str, Any] = {"ended_at": now, **({"mime": None} if scrub else {})}
    rows = conn.execute(
        t.update().where(where, t.c.status == "queued")
        .values(status="cancelled", key_head=False, lease_owner=None, lease_expires_at=None,
                last_error="cancelled by mail.cancel() before it was sent", **ended)
        .returning(t.c.id, t.c.key)).all()
    in_flight = conn.execute(sa.select(sa.func.count()).select_from(t)
                             .where(where, t.c.status == "sending")).scalar_one()
    return [(int(row.id), row.key) for row in rows], int(in_flight)
