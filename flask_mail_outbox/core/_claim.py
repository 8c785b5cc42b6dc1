"""The claim's SQL: which rows may go now, and the statements that take them.

Read top to bottom: the predicate of a claimable row (the sweep's selection
uses it too), the order a claim takes rows in, PostgreSQL's claim (one
statement, with the reap), SQLite's pick, and the reap. Run by the store
(:class:`._leases.Leases`) through its database's strategy
(:meth:`._dialect.Dialect.claim_due`), which also writes the claim's lease on
SQLite. "Now" is the store's (:meth:`._dialect.Dialect.now`): the database
clock on PostgreSQL, the store's clock on SQLite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ._models import Status, email_table

#: Builds "now" as SQL: the database clock on PostgreSQL, the store's clock elsewhere.
Now = Callable[[], sa.ColumnElement[datetime]]

#: ``lease_owner`` of a ``queued`` row that was not due when ``send()`` queued it
#: (``send_after``): its commit handed it to no delivery, so it is in flight
#: nowhere until it is claimed, and the sweep takes it when due whatever its
#: age. No claim owner looks like it (those are ``host:pid:n:hex``), and the
#: claim, like every record, overwrites it.
SCHEDULED = "scheduled"

#: What a claim returns of each row (see :meth:`._leases.Leases.claim_due`).
CLAIM_RETURNING = (email_table.c.id, email_table.c.attempts, email_table.c.sender,
                   email_table.c.recipients, email_table.c.mime, email_table.c.message_id,
                   # created_at before key: the PostgreSQL claim's UNION with the
                   # reap lists key and error_history last.
                   email_table.c.created_at, email_table.c.smtp_options,
                   email_table.c.transport, email_table.c.expires_at,
                   # The claim's order, kept for sending (see send_order).
                   email_table.c.priority, email_table.c.due_at,
                   email_table.c.key, email_table.c.error_history,
                   # The PRODUCER span's W3C context (OUTBOX_OTEL): read here so a
                   # traced claim needs no second query for it (NULL when untraced).
                   email_table.c.traceparent, email_table.c.tracestate)


#: The order the claim takes one transport's due rows in: higher priority (a lower
#: number) first, then oldest due first; ``ix_outbox_email_due`` holds them in this
#: order after the transport.
CLAIM_ORDER = (email_table.c.priority, email_table.c.due_at, email_table.c.id)


def send_order(row: Any) -> tuple[Any, ...]:
    """The order a claimed batch is sent in: higher priority first, then send order.

    ``UPDATE ... RETURNING`` gives rows in no set order, so a claim of five
    would otherwise reach a connection as the database happens to list them.
    Not :data:`CLAIM_ORDER`'s due time: a retried batch must come out in the
    same order as its first attempt (an API's batch idempotency key is made
    from its emails in order). Rows of one key never meet in a claim (only a
    key's holder is claimable), so this cannot reorder a key's line.
    """
    return (row.priority, row.id)


#: Keyless, or the head of its key.
FREE: sa.ColumnElement[bool] = sa.or_(email_table.c.key.is_(None), email_table.c.key_head)
#: :data:`FREE` as ``ix_outbox_email_due`` writes it: SQLite uses a partial index
#: only when the query repeats its terms literally (``key_head = 1`` does not count).
FREE_AS_INDEXED: Any = sa.text('(outbox_email."key" IS NULL OR outbox_email.key_head)')


def claimable(now: Now, *, free: Any = FREE) -> sa.ColumnElement[bool]:
    """Queued, due, and free to go: keyless, or the head of its key.

    Written as ``ix_outbox_email_due`` writes its WHERE (a literal
    ``'queued'``; a bound one does not count for a partial index).
    """
    t = email_table
    queued = t.c.status == sa.literal_column(f"'{Status.QUEUED.value}'")
    return sa.and_(queued, t.c.due_at <= now(), free)


# PostgreSQL's claim: ONE statement, run in autocommit, bound per tick.
#
# ``due`` picks the ids from ix_outbox_email_due (its WHERE written literally)
# FOR UPDATE SKIP LOCKED, so concurrent dispatchers never wait for each other
# nor take one row twice; MATERIALIZED fences it, so the planner cannot update
# more rows than the limit. ``claimed`` takes them: ``id = ANY(ARRAY(...))`` and
# nothing else, because a queue's statistics are always stale (the table was
# nearly empty at the last ANALYZE): a join with ``due`` is planned as a nested
# loop over every queued row, and a ``status = 'queued'`` recheck here matches
# the partial index of queued rows and scans all of them. The recheck is not
# needed: ``due`` locked each row FOR UPDATE after re-evaluating its conditions
# on the newest version, and the lock is held until this statement commits.
#
# Every row comes back with an ``outcome`` first: ``sending`` for a claimed
# row, and (PG_CLAIM_AND_REAP) ``queued`` for a reaped one, then
# CLAIM_RETURNING's columns (NULL for a reaped row but its id and key).
_PG_PICK_AND_CLAIM = """\
WITH due AS MATERIALIZED (
    SELECT id FROM outbox_email
    WHERE status = 'queued' AND due_at <= timezone('UTC', now())
      AND (key IS NULL OR key_head) AND transport = :claim_transport
    ORDER BY priority, due_at, id
    LIMIT :claim_limit
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE outbox_email
    SET status = 'sending', attempts = attempts + 1, lease_owner = :claim_owner,
        lease_expires_at = timezone('UTC', now()) + :claim_lease
    WHERE id = ANY (ARRAY(SELECT due.id FROM due))
    RETURNING id, attempts, sender, recipients, mime, message_id, created_at,
              smtp_options, transport, expires_at, priority, due_at, key, error_history,
              traceparent, tracestate
)"""

# The reap rides along in the same statement (as reap_statement below); the
# rows it frees are claimable from the next tick (one snapshot per statement).
_PG_REAP = """\
, reaped AS (
    UPDATE outbox_email
    SET status = 'queued', due_at = timezone('UTC', now()),
        lease_owner = NULL, lease_expires_at = NULL
    WHERE status = 'sending' AND lease_expires_at < timezone('UTC', now())
    RETURNING id, status, key
)"""

_PG_CLAIMED = "\nSELECT 'sending' AS outcome, claimed.* FROM claimed"

_PG_REAPED = """
UNION ALL
SELECT reaped.status, reaped.id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, reaped.key, NULL, NULL, NULL
FROM reaped"""


def _pg_statement(sql: str) -> sa.TextualSelect:
    return sa.text(sql).bindparams(
        sa.bindparam("claim_transport", type_=sa.String()),
        sa.bindparam("claim_limit", type_=sa.Integer()),
        sa.bindparam("claim_owner", type_=sa.String()),
        sa.bindparam("claim_lease", type_=sa.Interval()),
    ).columns(sa.column("outcome", sa.String()), *CLAIM_RETURNING)


PG_CLAIM = _pg_statement(_PG_PICK_AND_CLAIM + _PG_CLAIMED)
PG_CLAIM_AND_REAP = _pg_statement(_PG_PICK_AND_CLAIM + _PG_REAP + _PG_CLAIMED + _PG_REAPED)

#: The database's "now" in the statements above.
PG_NOW = "timezone('UTC', now())"


def _pg_on_clock(sql: str) -> sa.TextualSelect:
    """``sql`` with "now" the bound ``claim_now`` (a :class:`~._clock.TestClock`'s) instead."""
    return _pg_statement(sql.replace(PG_NOW, "CAST(:claim_now AS timestamp)")).bindparams(
        sa.bindparam("claim_now", type_=sa.DateTime()))


#: :data:`PG_CLAIM` and :data:`PG_CLAIM_AND_REAP` on a test clock (only with one: see
#: :meth:`._dialect.Dialect.on_clock`).
PG_CLAIM_ON_CLOCK = _pg_on_clock(_PG_PICK_AND_CLAIM + _PG_CLAIMED)
PG_CLAIM_AND_REAP_ON_CLOCK = _pg_on_clock(_PG_PICK_AND_CLAIM + _PG_REAP + _PG_CLAIMED
                                          + _PG_REAPED)

#: SQLite's choice of rows to claim, pinned to ``ix_outbox_email_due``; the
#: claim is then ``UPDATE ... WHERE id IN (this) RETURNING`` in the same
#: ``BEGIN IMMEDIATE`` transaction as the reap.
#:
#: SQLite's planner, on a table it has no statistics for (nobody runs ANALYZE
#: on an outbox), prefers the dashboard's ``(status, id)`` index for ``status =
#: 'queued'``: every claim would then read and sort every queued row, keyed
#: rows waiting behind their head included. ``INDEXED BY`` makes it read only
#: the rows that may go now, in order.
SQLITE_PICK = sa.text(
    "SELECT id FROM outbox_email INDEXED BY ix_outbox_email_due "
    "WHERE status = 'queued' AND (\"key\" IS NULL OR key_head) AND due_at <= :now "
    "AND transport = :transport ORDER BY priority, due_at, id LIMIT :limit"
).bindparams(sa.bindparam("now", type_=sa.DateTime()),
             sa.bindparam("limit", type_=sa.Integer()),
             sa.bindparam("transport", type_=sa.String())).columns(email_table.c.id)


def reap_statement(now: Now, ids: Sequence[int] | None) -> Any:
    """The guarded reap: expired leases back to queued, due now (``ids``: only those)."""
    t = email_table
    # 'sending' written literally, as ix_outbox_email_lease's WHERE is: a
    # bound value does not prove the partial index applies, and the
    # planner takes the (status, id) index instead, walking the entries
    # every row's 'sending' version leaves behind until VACUUM.
    where: list[Any] = [t.c.status == sa.literal_column(f"'{Status.SENDING.value}'"),
                        t.c.lease_expires_at < now()]
    if ids is not None:
        where.append(t.c.id.in_(list(ids)))
    return (t.update().where(*where)
            .values(status=Status.QUEUED.value, due_at=now(),
                    lease_owner=None, lease_expires_at=None)
            .returning(t.c.id, t.c.status, t.c.key))
