"""Every read-only statement behind status, stats, health, metrics, the dashboard and
the dead-letter list.

Each function takes a :class:`~sqlalchemy.engine.Connection` the caller opened,
normally with :meth:`Store.read` (on the store's own engine, never the host
app's session; autocommit on PostgreSQL, so a read costs no BEGIN/ROLLBACK
trips), and returns plain values. None writes, commits or opens a connection of
its own, so a caller that needs several reads runs them on one connection. A
function that compares with "now" takes ``clock``, the store's
(:attr:`Store.clock`): on PostgreSQL "now" is the database clock whatever
``clock`` says, on SQLite it is ``clock()`` (see :func:`._store.now_expr`).

Every query is shaped to use an index whatever the table holds, so it costs
the same with a million retained ``sent`` rows as with none:

* counts, ages, health and the gauges: each (sub)query is limited to one
  status, so it reads index entries of that status's rows (which index is the
  planner's choice: a partial one, or ``ix_outbox_email_status_id``);
* listing: newest first by ``id`` (the primary key, or ``(status, id)`` within
  a status), paginated by keyset (``id < last seen``), never ``OFFSET``;
* search: a prefix is a range ``lo <= search_column < hi`` on
  ``(search_column, id)``, in that index's order, paginated by ``(value, id)``;
* per hour: the ``sent`` rows since a day ago through the partial index on
  ``sent_at``, and the dead letters through the one on ``failed`` rows.

Not here: the reads that are part of a write (the idempotency lookup of
:func:`._store.insert_email`, the claim's pick, the keys of
:meth:`Store.retry_all_failed`, the dry run of :meth:`Store.delete_sent`), and
the sweep's selection (:meth:`Store.sweep_candidates`, :meth:`Store.age_gated`),
which is the claim's predicate and lives with it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ._models import Status, email_table, setting_table
from ._store import now_expr, utcnow

Clock = Callable[[], datetime]


def _now(conn: Connection, clock: Clock) -> sa.ColumnElement[datetime]:
    return now_expr(conn.dialect.name, clock)


# -- status and stats ---------------------------------------------------------------


def counts(conn: Connection) -> dict[str, int]:
    """Rows per status (every status present, 0 when it has none)."""
    t = email_table
    rows = conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status)).all()
    result = {status.value: 0 for status in Status}
    result.update({row[0]: int(row[1]) for row in rows})
    return result


def oldest_queued_age(conn: Connection, *, clock: Clock = utcnow) -> float | None:
    """Seconds since the oldest ``queued`` row was created, or None."""
    t = email_table
    oldest = conn.execute(sa.select(sa.func.min(t.c.created_at)).where(
        t.c.status == Status.QUEUED.value)).scalar()
    if oldest is None:
        return None
    now = conn.execute(sa.select(_now(conn, clock))).scalar_one()
    return max(0.0, float((now - oldest).total_seconds()))


def get_setting(conn: Connection, name: str) -> Any:
    """The JSON value of a shared setting (``outbox_setting``), or None when unset."""
    raw = conn.execute(
        sa.select(setting_table.c.value).where(setting_table.c.name == name)
    ).scalar()
    return None if raw is None else json.loads(raw)


def count_sent_before(conn: Connection, older_than: datetime) -> int:
    """How many ``sent`` rows were sent before ``older_than`` (what a purge would delete)."""
    t = email_table
    return int(conn.execute(
        sa.select(sa.func.count()).where(
            t.c.status == Status.SENT.value,
            t.c.sent_at < sa.literal(older_than, sa.DateTime()))
    ).scalar_one())


def email_outcome(conn: Connection, email_id: int) -> sa.RowMapping:
    """``message_id``, ``status``, ``attempts`` and ``last_error`` of one row (it must exist)."""
    t = email_table
    return conn.execute(
        sa.select(t.c.message_id, t.c.status, t.c.attempts, t.c.last_error)
        .where(t.c.id == email_id)).mappings().one()


def dead_letters(conn: Connection, limit: int) -> list[dict[str, Any]]:
    """The newest ``failed`` rows with their failure history."""
    t = email_table
    rows = conn.execute(
        sa.select(t.c.id, t.c.message_id, t.c.subject, t.c.recipients, t.c.key,
                  t.c.attempts, t.c.last_error, t.c.error_history, t.c.created_at)
        .where(t.c.status == Status.FAILED.value)
        .order_by(t.c.id.desc()).limit(limit)
    ).mappings().all()
    return [
        {**dict(row), "recipients": json.loads(row["recipients"]),
         "error_history": json.loads(row["error_history"] or "[]")}
        for row in rows
    ]


# -- health and metrics ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HealthFigures:
    """What a health check reads: the earliest due time of what may go now, dead letters, now."""

    earliest_due: datetime | None
    dead_letters: int
    now: datetime


@dataclasses.dataclass(frozen=True)
class QueueFigures:
    """What a metrics scrape reads: rows per unfinished status, the oldest queued, now."""

    queued: int
    sending: int
    failed: int
    oldest: datetime | None
    earliest_due: datetime | None
    now: datetime


def _count(status: Status) -> sa.ScalarSelect[Any]:
    t = email_table
    return (sa.select(sa.func.count()).select_from(t)
            .where(t.c.status == status.value).scalar_subquery())


def _earliest_due() -> sa.ScalarSelect[Any]:
    """The due time of the longest-waiting email that may go now (keyless or its key's head).

    A key's blocked followers are not counted themselves: they wait through
    their head, whose due time this is.
    """
    t = email_table
    return (sa.select(sa.func.min(t.c.due_at))
            .where(t.c.status == Status.QUEUED.value, sa.or_(t.c.key.is_(None), t.c.key_head))
            .scalar_subquery())


def health_figures(conn: Connection, *, clock: Clock = utcnow) -> HealthFigures:
    """One statement, so a load balancer may ask every second.

    Each subquery is limited to one status, so it reads index entries of queued
    or failed rows, never the whole table.
    """
    row = conn.execute(sa.select(_earliest_due().label("earliest_due"),
                                 _count(Status.FAILED).label("dead_letters"),
                                 _now(conn, clock).label("now"))).one()
    return HealthFigures(earliest_due=row.earliest_due, dead_letters=int(row.dead_letters),
                         now=row.now)


def queue_figures(conn: Connection, *, clock: Clock = utcnow) -> QueueFigures:
    """One statement for the gauges; each subquery is limited to one status, so it
    reads an index of that status's rows (which one is the planner's choice), not the table.
    """
    t = email_table
    oldest = (sa.select(sa.func.min(t.c.created_at))
              .where(t.c.status == Status.QUEUED.value).scalar_subquery())
    row = conn.execute(sa.select(_count(Status.QUEUED).label("queued"),
                                 _count(Status.SENDING).label("sending"),
                                 _count(Status.FAILED).label("failed"),
                                 oldest.label("oldest"), _earliest_due().label("earliest_due"),
                                 _now(conn, clock).label("now"))).one()
    return QueueFigures(queued=int(row.queued), sending=int(row.sending),
                        failed=int(row.failed), oldest=row.oldest,
                        earliest_due=row.earliest_due, now=row.now)
