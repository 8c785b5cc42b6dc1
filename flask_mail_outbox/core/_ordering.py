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

PostgreSQL: producers of a key hold its lock (:func:`producer_lock`) for their
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

from ._models import Status, email_table

#: The first key of the line locks' two-integer lock space ("ln" in ASCII):
#: PostgreSQL keeps two-key advisory locks apart from the one-key locks
#: producers take, so a line lock never waits for a request.
_LINE_LOCK_SPACE = 0x6C6E

_OPEN_SQL = "('queued', 'sending')"

_LOCK_LINES_PG = sa.text(
    f"SELECT pg_advisory_xact_lock({_LINE_LOCK_SPACE}, hashtext(k.key))"
    " FROM unnest(CAST(:keys AS varchar[])) AS k(key) ORDER BY k.key")

# For each key: its lowest open email and its holder (one probe each, in
# ix_outbox_email_key_open and ix_outbox_email_key_holder however deep the
# backlog); then the rule, in one UPDATE of at most those two rows.
_ADVANCE_PG = sa.text(
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


def producer_lock(key: str) -> sa.ColumnElement[Any]:
    """PostgreSQL: the lock a producer of ``key`` holds until its transaction ends."""
    return sa.func.pg_advisory_xact_lock(sa.func.hashtextextended(key, 0))


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
    if ordered and conn.dialect.name == "postgresql":
        conn.execute(_LOCK_LINES_PG, {"keys": ordered})
    return ordered


def advance(conn: Connection, keys: Iterable[str], *, locked: bool = False) -> list[int]:
    """Apply the rule (see the module docstring) to ``keys``; the ids that got the flag.

    Takes the keys' line locks first, unless the caller's transaction did
    (``locked``: a recorder takes them before its updates).
    """
    ordered = sorted(set(keys)) if locked else lock_lines(conn, keys)
    if not ordered:
        return []
    if conn.dialect.name == "postgresql":
        rows = conn.execute(_ADVANCE_PG, {"keys": ordered}).all()
        return sorted(int(row.id) for row in rows if row.key_head)
    t = email_table
    flagged = []
    for key in ordered:
        lowest = conn.execute(sa.select(sa.func.min(t.c.id))
                              .where(t.c.key == key, _open(t))).scalar()
        if lowest is None:
            continue
        holder = conn.execute(sa.select(t.c.id, t.c.status)
                              .where(t.c.key == key, _holds(t)).limit(1)).first()
        if holder is not None and (holder.status != Status.QUEUED.value or holder.id == lowest):
            continue
        if holder is not None:
            conn.execute(t.update().where(t.c.id == holder.id).values(key_head=False))
        conn.execute(t.update().where(t.c.id == lowest).values(key_head=True))
        flagged.append(int(lowest))
    return flagged


def heal(conn: Connection) -> list[int]:
    """:func:`advance` over every key with open emails and no holder; the new holders.

    Reads the open keyed rows (``ix_outbox_email_key_open``).
    """
    t = email_table
    holder = t.alias("h")
    headless = (sa.select(t.c.key).distinct()
                .where(t.c.key.is_not(None), _open(t),
                       ~sa.select(holder.c.id).where(holder.c.key == t.c.key,
                                                     _holds(holder)).exists()))
    return advance(conn, [str(key) for key in conn.execute(headless).scalars()])


def _open(t: Any) -> sa.ColumnElement[bool]:
    """Open (queued or sending), the statuses written literally: SQLite reads a
    partial index only for a query that repeats its WHERE's terms."""
    status: sa.ColumnElement[str] = t.c.status
    return status.in_([sa.literal_column("'queued'"), sa.literal_column("'sending'")])


def _holds(t: Any) -> sa.ColumnElement[bool]:
    """Holds its key's flag, written as ``ix_outbox_email_key_holder``'s WHERE is.

    ``key_head`` unqualified, as the index writes it: used only where ``t`` is
    the innermost FROM, which SQL resolves it to.
    """
    return sa.and_(sa.literal_column("key_head"), _open(t))
