"""Per-key order: the only code that writes ``key_head``.

Emails sent with the same ``key`` go out in id order, never two at once. One
open email of each key holds the ``key_head`` flag, the *holder*, and the
claim takes a keyed row only when it holds the flag (``ix_outbox_email_due``
indexes exactly the keyless rows and the holders). The rule, for each key:

1. a key with open emails and no holder gives the flag to its lowest open id;
2. a ``queued`` holder with a lower open email gives the flag up to it (a dead
   letter was put back below it, ``retry()``); a ``sending`` holder keeps it
   and finishes first.

:func:`advance` ``(conn, keys)`` applies it. It is idempotent, and it runs in
the write transaction of every operation that changes a key's line: recording
outcomes, the reap, ``retry()`` and ``retry_all()``, a producer's commit, and the
sweep's :func:`heal` (a safety net: nothing in the library leaves a key
without a holder).

PostgreSQL: producers of a key hold its lock (:meth:`._dialect.Postgres.producer_lock`) for their
whole transaction, so id order is commit order. Delivery never waits for a
request: whoever advances a key takes its *line lock* instead (a second lock
space, held only by short transactions), and so does a producer, just before
its commit, for the keys whose new email found an earlier one open. Whichever
of a producer and a recorder takes the line lock second sees the other's
rows, so a key never ends up without a holder between them. SQLite runs one
writer at a time, so it needs neither lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ._dialect import dialect_of, holds_key, open_status
from ._models import Status, email_table


def holds_at_insert(key: Any) -> sa.ColumnElement[bool]:
    """The ``key_head`` of a new email of ``key``: whether nothing of its key is open.

    Exact under the producer's lock (PostgreSQL) or SQLite's write lock;
    an email that finds an earlier one open waits for :func:`advance`.
    """
    other = email_table.alias("open_of_key")
    return ~sa.select(other.c.id).where(
        other.c.key == key, other.c.status.in_((Status.QUEUED.value, Status.SENDING.value))
    ).exists()


def lock_lines(conn: Connection, keys: Iterable[str]) -> list[str]:
    """Take the line locks of ``keys`` (PostgreSQL; in key order); the keys, sorted.

    A statement of its own, before the reads that depend on it: in READ
    COMMITTED a statement reads the snapshot taken as it started, so it would
    miss what committed while it waited for a lock.
    """
    ordered = sorted(set(keys))
    if ordered:
        dialect_of(conn).lock_lines(conn, ordered)
    return ordered


def advance(conn: Connection, keys: Iterable[str], *, locked: bool = False) -> list[int]:
    """Apply the rule (see the module docstring) to ``keys``; the ids that got the flag.

    Takes the keys' line locks first, unless the caller's transaction did
    (``locked``: a recorder takes them before its updates). The rule as SQL is
    the database's (:meth:`._dialect.Dialect.advance`).
    """
    ordered = sorted(set(keys)) if locked else lock_lines(conn, keys)
    if not ordered:
        return []
    return dialect_of(conn).advance(conn, ordered)


def heal(conn: Connection) -> list[int]:
    """:func:`advance` over every key with open emails and no holder; the new holders.

    Reads the open keyed rows (``ix_outbox_email_key_open``).
    """
    t = email_table
    holder = t.alias("h")
    headless = (sa.select(t.c.key).distinct()
                .where(t.c.key.is_not(None), open_status(t),
                       ~sa.select(holder.c.id).where(holder.c.key == t.c.key,
                                                     holds_key(holder)).exists()))
    return advance(conn, [str(key) for key in conn.execute(headless).scalars()])
