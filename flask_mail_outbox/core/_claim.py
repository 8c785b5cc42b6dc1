"""The claim's statements: which rows may go now, and the SQL that takes them.

Built here, run by :class:`._store.Store` in its transactions: the predicate
of a claimable row (the sweep's selection uses it too), SQLite's pick pinned
to its index, PostgreSQL's one-statement claim (and reap), and the reap. Each
takes ``now``, the store's "now" as SQL (:meth:`._store.Store.now_expr`), so
the store's clock decides what is due.
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

#: What a claim returns of each row (see :meth:`._store.Store._claimed`).
CLAIM_RETURNING = (email_table.c.id, email_table.c.attempts, email_table.c.sender,
                   email_table.c.recipients, email_table.c.mime, email_table.c.message_id,
                   # created_at before key: the PostgreSQL claim's UNION with the
                   # reap lists key and error_history last.
                   email_table.c.created_at, email_table.c.smtp_options,
                   email_table.c.transport, email_table.c.expires_at,
                   # The claim's order, kept for sending (see send_order).
                   email_table.c.priority, email_table.c.due_at,
                   email_table.c.key, email_table.c.error_history)


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


def claimable(now: Now, *, sqlite: bool) -> sa.ColumnElement[bool]:
    """Queued, due, and free to go: keyless, or the head of its key.

    Written as ``ix_outbox_email_due`` writes its WHERE: SQLite uses a
    partial index only when the query repeats those terms literally (a
    bound ``'queued'``, or ``key_head = 1``, does not count); otherwise
    each claim reads and sorts every queued row.
    """
    t = email_table
    queued = t.c.status == sa.literal_column(f"'{Status.QUEUED.value}'")
    free: Any = sa.or_(t.c.key.is_(None), t.c.key_head)
    if sqlite:
        free = sa.text('(outbox_email."key" IS NULL OR outbox_email.key_head)')
    return sa.and_(queued, t.c.due_at <= now(), free)


def sqlite_pick(now: datetime, limit: int, transport: str) -> Any:
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
        "AND transport = :transport ORDER BY priority, due_at, id LIMIT :limit"
    ).bindparams(sa.bindparam("now", now, type_=sa.DateTime()),
                 sa.bindparam("limit", limit),
                 sa.bindparam("transport", transport)).columns(email_table.c.id)


def pg_claim(now: Now, *, reap: bool) -> Any:
    """PostgreSQL's claim (and with ``reap`` the reap): one statement, bound per tick.

    It binds ``claim_transport``, ``claim_limit``, ``claim_owner`` and
    ``claim_lease``, and returns
    :data:`CLAIM_RETURNING` with an ``outcome`` column first: ``sending`` for
    a claimed row, ``queued`` for a reaped one.
    """
    t = email_table
    pick = (sa.select(t.c.id).where(claimable(now, sqlite=False),
                                    t.c.transport == sa.bindparam("claim_transport",
                                                                  type_=sa.String()))
            .order_by(*CLAIM_ORDER).limit(sa.bindparam("claim_limit", type_=sa.Integer)))
    due = pick.with_for_update(skip_locked=True).cte("due").prefix_with("MATERIALIZED")
    # ``id = ANY(ARRAY(...))`` and nothing else: a queue's statistics are always
    # stale (the table was nearly empty at the last ANALYZE), so a join with
    # ``due`` is planned as a nested loop over every queued row, and a
    # ``status = 'queued'`` recheck here matches the partial index of queued
    # rows and scans all of them. The recheck is not needed: ``due``
    # locked each row FOR UPDATE after re-evaluating its conditions on the
    # newest version, and the lock is held until this statement commits.
    picked = sa.func.array(sa.select(due.c.id).scalar_subquery())
    lease = sa.bindparam("claim_lease", type_=sa.Interval())
    claimed = (t.update().where(t.c.id == sa.any_(picked))
               .values(status=Status.SENDING.value, attempts=t.c.attempts + 1,
                       lease_owner=sa.bindparam("claim_owner", type_=sa.String()),
                       lease_expires_at=now() + lease)
               .returning(*CLAIM_RETURNING).cte("claimed"))
    stmt: Any = sa.select(sa.literal(Status.SENDING.value).label("outcome"), *claimed.c)
    if reap:
        # The reap rides along in the same statement; the rows it frees are
        # claimable from the next tick (one snapshot per statement).
        reaped = reap_statement(now, None).cte("reaped")
        stmt = sa.union_all(stmt, sa.select(
            reaped.c.status.label("outcome"), reaped.c.id,
            *[sa.null().cast(col.type).label(col.name) for col in claimed.c
              if col.name not in ("id", "key", "error_history")],
            reaped.c.key, sa.null().cast(sa.Text()).label("error_history")))
    return stmt


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
