"""The dashboard's reads: one page of emails, one email, sent and failed per hour.

Every query is shaped to use an index whatever the table holds, so a page costs
the same on a thousand rows or ten million:

* listing: newest first by ``id`` (the primary key, or ``(status, id)`` within a
  status), paginated by keyset (``id < last seen``), never ``OFFSET``;
* search: a prefix is a range ``lo <= search_column < hi`` on
  ``(search_column, id)``, in that index's order, paginated by ``(value, id)``;
* per hour: the ``sent`` rows since a day ago through the partial index on
  ``sent_at``, and the dead letters through the one on ``failed`` rows.

These run on the store's engine in autocommit reads (:meth:`Store.read`), never in
the host app's session.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from .._models import (
    SEARCH_RECIPIENT_LENGTH,
    SEARCH_SUBJECT_LENGTH,
    Status,
    attachment_table,
    email_table,
    search_key,
)
from .._store import Store

SEARCH_FIELDS = ("recipient", "subject")
_LIST_COLUMNS = (
    email_table.c.id, email_table.c.status, email_table.c.created_at, email_table.c.sent_at,
    email_table.c.attempts, email_table.c.subject, email_table.c.recipients,
    email_table.c.last_error, email_table.c.key,
)
_MAX_CODE_POINT = 0x10FFFF


@dataclasses.dataclass(frozen=True)
class EmailRow:
    """One line of a list page."""

    id: int
    status: str
    created_at: datetime
    sent_at: datetime | None
    attempts: int
    subject: str
    recipients: list[str]
    last_error: str | None
    key: str | None


@dataclasses.dataclass(frozen=True)
class Page:
    """Rows of one page, and the query arguments of the next one (None: last page)."""

    rows: list[EmailRow]
    next_cursor: dict[str, str] | None


@dataclasses.dataclass(frozen=True)
class Attachment:
    filename: str | None
    content_type: str
    size: int


@dataclasses.dataclass(frozen=True)
class EmailDetail:
    """One row as the detail page shows it (``mime`` is None once scrubbed)."""

    row: EmailRow
    message_id: str
    sender: str
    due_at: datetime
    failed_at: datetime | None
    size: int
    mime: bytes | None
    error_history: list[dict[str, Any]]
    attachments: list[Attachment]


@dataclasses.dataclass(frozen=True)
class HourCount:
    """Emails sent and dead-lettered in the hour starting at ``start`` (UTC)."""

    start: datetime
    sent: int
    failed: int


def prefix_bounds(prefix: str) -> tuple[str, str | None]:
    """The range ``[lo, hi)`` of every string starting with ``prefix`` (hi None: unbounded).

    In code-point order, which is byte order in UTF-8 ("C" on PostgreSQL, BINARY on
    SQLite): the strings that start with ``p`` are exactly those from ``p`` up to
    ``p`` with its last character incremented. Characters that cannot be
    incremented (U+10FFFF) are dropped first; the surrogates, which UTF-8 cannot
    hold, are jumped over.
    """
    stem = prefix.rstrip(chr(_MAX_CODE_POINT))
    if not stem:
        return prefix, None
    following = ord(stem[-1]) + 1
    if 0xD800 <= following <= 0xDFFF:
        following = 0xE000
    return prefix, stem[:-1] + chr(following)


def list_emails(store: Store, *, status: str | None = None, field: str = "recipient",
                prefix: str = "", cursor: dict[str, str] | None = None,
                limit: int = 50) -> Page:
    """One page of emails, newest first; with a ``prefix``, in search order.

    ``cursor`` is what the previous page returned as ``next_cursor``. Reads one
    row more than ``limit`` to know for certain whether a next page exists.
    """
    t = email_table
    where: list[Any] = []
    if status is not None:
        where.append(t.c.status == status)
    search_column, length = ((t.c.search_recipient, SEARCH_RECIPIENT_LENGTH)
                             if field == "recipient"
                             else (t.c.search_subject, SEARCH_SUBJECT_LENGTH))
    needle = search_key(prefix, length)
    if needle:
        lo, hi = prefix_bounds(needle)
        where.append(search_column >= lo)
        if hi is not None:
            where.append(search_column < hi)
        if cursor is not None:
            where.append(sa.tuple_(search_column, t.c.id)
                         > sa.tuple_(sa.literal(cursor["after_key"]),
                                     sa.literal(int(cursor["after_id"]))))
        order: list[Any] = [search_column, t.c.id]
        columns: tuple[Any, ...] = (*_LIST_COLUMNS, search_column.label("search_value"))
    else:
        if cursor is not None:
            where.append(t.c.id < int(cursor["before"]))
        order = [t.c.id.desc()]
        columns = _LIST_COLUMNS
    stmt = sa.select(*columns).where(*where).order_by(*order).limit(limit + 1)
    with store.read() as conn:
        rows = conn.execute(stmt).all()
    more, rows = len(rows) > limit, rows[:limit]
    next_cursor: dict[str, str] | None = None
    if more:
        last = rows[-1]
        next_cursor = ({"after_key": last.search_value, "after_id": str(last.id)} if needle
                       else {"before": str(last.id)})
    return Page([_email_row(row) for row in rows], next_cursor)


def get_email(store: Store, email_id: int) -> EmailDetail | None:
    """One email with its attachments, or None when there is no such row."""
    t = email_table
    a = attachment_table
    with store.read() as conn:
        row = conn.execute(
            sa.select(*_LIST_COLUMNS, t.c.message_id, t.c.sender, t.c.due_at, t.c.failed_at,
                      t.c.size, t.c.mime, t.c.error_history)
            .where(t.c.id == email_id)
        ).first()
        if row is None:
            return None
        attachments = conn.execute(
            sa.select(a.c.filename, a.c.content_type, a.c.size)
            .where(a.c.email_id == email_id).order_by(a.c.position)
        ).all()
    return EmailDetail(
        row=_email_row(row), message_id=row.message_id, sender=row.sender,
        due_at=row.due_at, failed_at=row.failed_at, size=row.size, mime=row.mime,
        error_history=json.loads(row.error_history or "[]"),
        attachments=[Attachment(x.filename, x.content_type, x.size) for x in attachments],
    )


def hourly_counts(store: Store, *, hours: int = 24) -> list[HourCount]:
    """Sent and dead-lettered emails per hour, oldest hour first, the current one last.

    Counts rows as they are now: an email retried since it failed counts where it
    ended, and rows deleted by retention or purge are gone from the chart too.
    """
    t = email_table
    with store.read() as conn:
        now: datetime = conn.execute(sa.select(store.now_expr())).scalar_one()
        first = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours - 1)
        since = sa.literal(first, sa.DateTime())
        sent_hour = _hour(store, t.c.sent_at)
        sent = conn.execute(
            sa.select(sent_hour, sa.func.count())
            .where(t.c.status == Status.SENT.value, t.c.sent_at >= since).group_by(sent_hour)
        ).all()
        failed_hour = _hour(store, t.c.failed_at)
        failed = conn.execute(
            sa.select(failed_hour, sa.func.count())
            .where(t.c.status == Status.FAILED.value, t.c.failed_at >= since)
            .group_by(failed_hour)
        ).all()
    sent_by_hour = {_as_hour(hour): int(count) for hour, count in sent}
    failed_by_hour = {_as_hour(hour): int(count) for hour, count in failed}
    starts = [first + timedelta(hours=n) for n in range(hours)]
    return [HourCount(start, sent_by_hour.get(start, 0), failed_by_hour.get(start, 0))
            for start in starts]


def _hour(store: Store, column: Any) -> Any:
    """``column`` truncated to the hour, in SQL."""
    if store.is_postgres:
        return sa.func.date_trunc("hour", column)
    return sa.func.strftime("%Y-%m-%d %H:00:00", column)


def _as_hour(value: datetime | str) -> datetime:
    if isinstance(value, str):
        return datetime.strptime(value, "%Y-%m-%d %H:%M:%S")
    return value


def _email_row(row: Any) -> EmailRow:
    return EmailRow(
        id=int(row.id), status=row.status, created_at=row.created_at, sent_at=row.sent_at,
        attempts=int(row.attempts), subject=row.subject,
        recipients=list(json.loads(row.recipients)), last_error=row.last_error, key=row.key,
    )
