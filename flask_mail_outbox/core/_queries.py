"""Every read-only statement behind status, stats, health, metrics, the dashboard and
the dead-letter list.

Each function takes a :class:`~sqlalchemy.engine.Connection` the caller opened,
normally with :meth:`._database.Database.read` (on the store's own engine, never the host
app's session; autocommit on PostgreSQL, so a read costs no BEGIN/ROLLBACK
trips), and returns plain values. None writes, commits or opens a connection of
its own (but :func:`recount_tally`), so a caller that needs several reads runs
them on one connection. A
function that compares with "now" takes ``clock``, the store's
(:attr:`._database.Database.clock`): on PostgreSQL "now" is the database clock whatever
``clock`` says, on SQLite it is ``clock()`` (see :meth:`._dialect.Dialect.now`).

Every query is shaped to use an index whatever the table holds, so it costs
the same with a million retained ``sent`` rows as with none:

* counts: ``queued``, ``sending`` and ``failed`` exactly, each (sub)query
  limited to one status, so it reads index entries of that status's rows
  (which index is the planner's choice: a partial one, or
  ``ix_outbox_email_status_id``); ``sent``, ``suppressed``, ``expired`` and
  ``cancelled``, which grow with history, from the running totals the
  database's triggers keep in ``outbox_tally`` (see
  :class:`._models.OutboxTally`), exact too: one row per status and (for
  ``sent``) per hour of retained history, about 8,760 rows a year to add up;
* ages, health and the gauges: as the exact counts, one status each;
* listing: newest first by ``id`` (the primary key, or ``(status, id)`` within
  a status), paginated by keyset (``id < last seen``), never ``OFFSET``;
* search: a prefix is a range ``lo <= search_column < hi`` on
  ``(search_column, id)``, in that index's order, paginated by ``(value, id)``;
* by latest delivery event: a walk down the emails with an event of that type,
  newest first (``max(email_id) < previous`` on ``ix_outbox_event_type``,
  ``(event_type, email_id)``), each kept if its latest event is of that type
  (one probe of ``ix_outbox_event_email``), its row read by primary key,
  paginated by ``email_id < last walked``; at most ``EVENT_SCAN_BUDGET`` steps a
  page, so a rare match gives short pages, never a long one;
* an email's events: ``ix_outbox_event_email``, the newest few hundred only;
* per hour: the ``sent`` rows from the tally's hours (one row per hour), and
  the dead letters through the partial index on ``failed`` rows.

One function writes: :func:`recount_tally`, the repair of those totals.

Not here: the reads that are part of a write (the idempotency lookup of
:func:`._insert.insert_email`, the claim's pick, the keys of
:meth:`._admin.Admin.retry_all_failed`), and the sweep's selection
(:meth:`._sweeping.Sweeping.sweep_candidates`, :meth:`._sweeping.Sweeping.age_gated`),
which is the claim's predicate (:func:`._claim.claimable`) and goes with the store.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._events import EVENT_TYPES, DeliveryEvent
from ._clock import utcnow
from ._dialect import dialect_of
from ._intercept import notes_of
from ._models import (
    PRIORITIES,
    SEARCH_RECIPIENT_LENGTH,
    SEARCH_SUBJECT_LENGTH,
    TALLIED,
    Status,
    attachment_table,
    email_table,
    event_table,
    retained_before,
    search_key,
    setting_table,
    tally_table,
)

Clock = Callable[[], datetime]

SEARCH_FIELDS = ("recipient", "subject")
_LIST_COLUMNS = (
    email_table.c.id, email_table.c.status, email_table.c.created_at, email_table.c.sent_at,
    email_table.c.attempts, email_table.c.subject, email_table.c.recipients,
    email_table.c.last_error, email_table.c.key,
)
_MAX_CODE_POINT = 0x10FFFF
#: The most emails one page of the latest-event filter walks (see :func:`_by_latest_event`).
EVENT_SCAN_BUDGET = 10_000
#: The most events the email page shows (the newest; a webhook may log thousands of opens).
EVENTS_SHOWN = 200
_EVENT_COLUMNS = (
    event_table.c.id, event_table.c.email_id, event_table.c.transport,
    event_table.c.provider_event_id, event_table.c.event_type, event_table.c.bounce_kind,
    event_table.c.reason,
    event_table.c.recipient, event_table.c.occurred_at, event_table.c.description,
    event_table.c.mta_response, event_table.c.verdict, event_table.c.suppressed_until,
    event_table.c.applied_to,
)


def _now(conn: Connection, clock: Clock) -> sa.ColumnElement[datetime]:
    return dialect_of(conn).now(clock)


# -- status and stats ---------------------------------------------------------------


#: The statuses counted row by row: what an operator acts on, small in a healthy outbox.
EXACT = tuple(status for status in Status if status not in TALLIED)
_EPOCH = datetime(1970, 1, 1)


def counts(conn: Connection) -> dict[str, int]:
    """Rows per status (every status present, 0 when it has none), in one statement.

    :data:`EXACT` statuses are counted in their index; the :data:`._models.TALLIED`
    ones are the sums of their running totals (``outbox_tally``), which cost the
    same however many rows are retained.
    """
    tally = tally_table
    exact = [sa.select(sa.literal(status.value, sa.String()).label("status"),
                       _count(status).label("n")) for status in EXACT]
    tallied = sa.select(tally.c.status, sa.func.sum(tally.c.n)).group_by(tally.c.status)
    result = {status.value: 0 for status in Status}
    for status, n in conn.execute(sa.union_all(*exact, tallied)).all():
        result[status] = int(n)
    return result


def recount_tally(conn: Connection) -> dict[str, int]:
    """Rebuild ``outbox_tally`` from the rows themselves; the totals that were wrong.

    The repair for totals that drifted (a trigger dropped by hand, rows changed
    with triggers disabled): one count of the tallied rows, a scan of
    ``outbox_email`` in index order. Returns ``{status: counted - kept}`` for each
    status whose total was off (empty when none was). The caller commits.

    On PostgreSQL it takes the tally's lock (waiting for a fold in progress),
    and deletes the old rows and inserts the count in one statement, so both
    see the same snapshot: a change committed after it is counted by its own
    trigger's row, and not twice. Writers are not stopped.
    """
    t = email_table
    hour = sa.case((t.c.status == Status.SENT.value, _hour_number(conn, t.c.sent_at)))
    counted = (sa.select(t.c.status, hour.label("sent_hour"), sa.func.count().label("n"))
               .where(t.c.status.in_([status.value for status in TALLIED]))
               .group_by(t.c.status, hour))
    kept = {status.value: 0 for status in TALLIED}
    recounted = dict(kept)
    was, now = dialect_of(conn).recount_tally(conn, counted)
    kept.update(was)
    recounted.update(now)
    return {status: recounted[status] - kept[status] for status in recounted
            if recounted[status] != kept[status]}


def _hour_number(conn: Connection, column: Any) -> Any:
    """``column`` as whole hours since the epoch, in SQL (as the triggers compute it)."""
    return dialect_of(conn).hour_number(column)


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
    statement = retained_before("count(*)", ended=False,
                                index_hint=dialect_of(conn).index_hint)
    return int(conn.execute(statement, {"older_than": older_than}).scalar_one())


def count_ended_before(conn: Connection, older_than: datetime) -> int:
    """How many rows ended unsent before ``older_than`` (what a purge would delete)."""
    statement = retained_before("count(*)", ended=True,
                                index_hint=dialect_of(conn).index_hint)
    return int(conn.execute(statement, {"older_than": older_than}).scalar_one())


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


# -- the dashboard ----------------------------------------------------------------------


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
    #: The page stopped at :data:`EVENT_SCAN_BUDGET` before it was full (the
    #: latest-event filter): the next page looks further back.
    partial: bool = False


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
    #: The named transport (OUTBOX_TRANSPORTS) and priority (high/normal/low) it was sent with.
    transport: str = "default"
    priority: str = "normal"
    #: The provider's id of the message (an API's reply, an SMTP ``queued as``), if any.
    provider_message_id: str | None = None
    #: Its delivery events, oldest first (without their payloads): the newest
    #: :data:`EVENTS_SHOWN` of them; ``earlier_events`` says whether older ones were left out.
    events: tuple[DeliveryEvent, ...] = ()
    earlier_events: bool = False
    #: ``mail.send_template()``: the template's name, the locale it was rendered in
    #: and the SHA-256 of its sources (None for an email built by hand).
    template_name: str | None = None
    template_locale: str | None = None
    template_hash: str | None = None
    #: What staging did at delivery to the last attempt it changed (OUTBOX_REDIRECT_TO,
    #: OUTBOX_ALLOWED_RECIPIENTS, ``before_send``): short notes, none when nothing did.
    intercepted: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HourCount:
    """Emails sent and dead-lettered in the hour starting at ``start`` (UTC)."""

    start: datetime
    sent: int
    failed: int


@dataclasses.dataclass(frozen=True)
class Overview:
    """What the dashboard's overview shows, read on one connection."""

    counts: dict[str, int]
    oldest_queued_age: float | None
    hours: list[HourCount]


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


def list_emails(conn: Connection, *, status: str | None = None, field: str = "recipient",
                prefix: str = "", event: str | None = None,
                cursor: dict[str, str] | None = None, limit: int = 50) -> Page:
    """One page of emails, newest first; with a ``prefix``, in search order.

    ``event``: only emails whose latest delivery event (the greatest
    ``(occurred_at, id)`` of theirs) has that type; it combines with
    ``status`` and ``prefix``. ``cursor`` is what the previous page returned
    as ``next_cursor``. Reads one row more than ``limit`` to know for certain
    whether a next page exists.
    """
    if event is not None and event not in EVENT_TYPES:
        raise ValueError(f"event must be one of {', '.join(EVENT_TYPES)}, got {event!r}")
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
        if event is not None:  # the search index leads; one probe per row it reads
            where.append(_latest_event(t.c.id, "event_type") == event)
        stmt = (sa.select(*_LIST_COLUMNS, search_column.label("search_value")).where(*where)
                .order_by(search_column, t.c.id))
    elif event is not None:
        return _by_latest_event(conn, event, status=status, cursor=cursor, limit=limit)
    else:
        if cursor is not None:
            where.append(t.c.id < int(cursor["before"]))
        stmt = sa.select(*_LIST_COLUMNS).where(*where).order_by(t.c.id.desc())
    rows = conn.execute(stmt.limit(limit + 1)).all()
    more, rows = len(rows) > limit, rows[:limit]
    next_cursor: dict[str, str] | None = None
    if more:
        last = rows[-1]
        next_cursor = ({"after_key": last.search_value, "after_id": str(last.id)} if needle
                       else {"before": str(last.id)})
    return Page([_email_row(row) for row in rows], next_cursor)


def _by_latest_event(conn: Connection, event: str, *, status: str | None,
                     cursor: dict[str, str] | None, limit: int) -> Page:
    """Emails whose latest event is ``event`` (and of ``status``), newest first.

    A walk down the emails that have an event of that type, newest first: each
    step is ``max(email_id)`` below the previous one in ``ix_outbox_event_type``
    ``(event_type, email_id)``, an index probe whatever the planner's statistics
    say (a plain join ordered by ``email_id`` is also walked this way by
    PostgreSQL's planner, but not when its statistics are stale: after a bulk
    load, or with autovacuum behind, it read every event of the type and
    sorted them, seconds at a million). Each email walked is kept if its latest
    event (one backward probe of ``ix_outbox_event_email``) has that type and
    its row (by primary key) that status.

    Both databases run the walk only as far as the LIMIT fetches, in its order:
    it is the outer side of an outer join to the email rows (SQLite makes it a
    co-routine; PostgreSQL's row lookup is a LATERAL subquery, whose LIMIT also
    keeps it a primary-key probe that the planner cannot merge into the outer
    query). No ORDER BY: sorting would run the whole walk first.

    A page walks at most :data:`EVENT_SCAN_BUDGET` emails. One that is full
    before that stops there; one that is not (a type that later events mostly
    replace, a status few of them have) ends at the budget's last email, and
    its next page goes on from there (``Page.partial``). So no page costs more
    than that many steps, however rare the match.
    """
    budget = EVENT_SCAN_BUDGET

    def next_below(bound: Any | None, name: str) -> sa.ScalarSelect[Any]:
        candidate = event_table.alias(name)
        found = sa.select(sa.func.max(candidate.c.email_id)).where(
            candidate.c.event_type == event)
        if bound is not None:
            found = found.where(candidate.c.email_id < bound)
        return found.scalar_subquery()

    before = None if cursor is None else int(cursor["before"])
    walk = sa.select(next_below(before, "walk_first").label("email_id"),
                     sa.literal(1, sa.Integer()).label("step")).cte("walk", recursive=True)
    walk = walk.union_all(
        sa.select(next_below(walk.c.email_id, "walk_step"), walk.c.step + 1)
        .where(walk.c.email_id.is_not(None), walk.c.step < budget))
    source, columns = dialect_of(conn).email_at_each_step(walk, _LIST_COLUMNS)
    email_id, email_status = columns[0], columns[1]
    matched = sa.and_(email_id.is_not(None),
                      _latest_event(walk.c.email_id, "event_type") == event,
                      *([] if status is None else [email_status == status]))
    # Every match, and the walk's last step (where a page that is not full ends).
    stmt = (sa.select(walk.c.email_id.label("walked"), walk.c.step, matched.label("matched"),
                      *columns)
            .select_from(source)
            .where(sa.or_(matched, walk.c.step == budget, walk.c.email_id.is_(None))))
    rows = conn.execute(stmt.limit(limit + 1)).all()
    shown = [row for row in rows if row.matched]
    next_cursor: dict[str, str] | None = None
    partial = False
    if len(shown) > limit:
        shown = shown[:limit]
        next_cursor = {"before": str(shown[-1].id)}
    elif rows and rows[-1].walked is not None and rows[-1].step == budget:
        next_cursor = {"before": str(rows[-1].walked)}
        partial = len(shown) < limit
    return Page([_email_row(row) for row in shown], next_cursor, partial=partial)


def _latest_event(email_id: Any, column: str) -> sa.ScalarSelect[Any]:
    """``column`` of the latest event of the email ``email_id`` names (a correlated subquery).

    Latest is the greatest ``(occurred_at, id)``: the last entry of that email in
    ``ix_outbox_event_email``, read backwards, one probe.
    """
    latest = event_table.alias("latest")
    return (sa.select(latest.c[column]).where(latest.c.email_id == email_id)
            .order_by(latest.c.occurred_at.desc(), latest.c.id.desc())
            .limit(1).scalar_subquery())


def email_events(conn: Connection, email_id: int,
                 limit: int | None = None) -> tuple[list[DeliveryEvent], bool]:
    """The newest ``limit`` (:data:`EVENTS_SHOWN`) events of one email, oldest first, and
    whether there are older ones.

    Without the payloads (up to 64 KiB each, which no page shows).
    """
    if limit is None:
        limit = EVENTS_SHOWN
    e = event_table
    rows = conn.execute(
        sa.select(*_EVENT_COLUMNS).where(e.c.email_id == email_id)
        .order_by(e.c.occurred_at.desc(), e.c.id.desc()).limit(limit + 1)).all()
    earlier, rows = len(rows) > limit, rows[:limit]
    events = [DeliveryEvent(
        id=row.id, email_id=row.email_id, transport=row.transport,
        provider_event_id=row.provider_event_id, event_type=row.event_type,
        bounce_kind=row.bounce_kind, reason=row.reason, recipient=row.recipient,
        occurred_at=row.occurred_at,
        description=row.description, mta_response=row.mta_response, verdict=row.verdict,
        suppressed_until=row.suppressed_until, applied=row.applied_to is not None)
        for row in rows]
    events.reverse()
    return events, earlier


def get_email(conn: Connection, email_id: int) -> EmailDetail | None:
    """One email with its attachments and events, or None when there is no such row."""
    t = email_table
    a = attachment_table
    row = conn.execute(
        sa.select(*_LIST_COLUMNS, t.c.message_id, t.c.sender, t.c.due_at, t.c.failed_at,
                  t.c.size, t.c.mime, t.c.error_history, t.c.transport, t.c.priority,
                  t.c.provider_message_id, t.c.template_name, t.c.template_locale,
                  t.c.template_hash, t.c.intercepted)
        .where(t.c.id == email_id)
    ).first()
    if row is None:
        return None
    attachments = conn.execute(
        sa.select(a.c.filename, a.c.content_type, a.c.size)
        .where(a.c.email_id == email_id).order_by(a.c.position)
    ).all()
    events, earlier_events = email_events(conn, email_id)
    return EmailDetail(
        row=_email_row(row), message_id=row.message_id, sender=row.sender,
        due_at=row.due_at, failed_at=row.failed_at, size=row.size, mime=row.mime,
        error_history=json.loads(row.error_history or "[]"),
        attachments=[Attachment(x.filename, x.content_type, x.size) for x in attachments],
        transport=row.transport,
        priority={rank: name for name, rank in PRIORITIES.items()}.get(row.priority, "normal"),
        provider_message_id=row.provider_message_id,
        events=tuple(events), earlier_events=earlier_events,
        template_name=row.template_name, template_locale=row.template_locale,
        template_hash=row.template_hash,
        intercepted=notes_of(row.intercepted),
    )


def hourly_counts(conn: Connection, *, hours: int = 24,
                  clock: Clock = utcnow) -> list[HourCount]:
    """Sent and dead-lettered emails per hour, oldest hour first, the current one last.

    Counts rows as they are now: an email retried since it failed counts where it
    ended, and rows deleted by retention or purge are gone from the chart too.
    The sent ones are the tally's hours (``outbox_tally.sent_hour``, one row
    each), the dead letters are counted in the partial index of ``failed`` rows.
    """
    t = email_table
    tally = tally_table
    now: datetime = conn.execute(sa.select(_now(conn, clock))).scalar_one()
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours - 1)
    since = sa.literal(first, sa.DateTime())
    first_number = (first - _EPOCH) // timedelta(hours=1)
    sent_numbers = conn.execute(
        sa.select(tally.c.sent_hour, sa.func.sum(tally.c.n))
        .where(tally.c.status == Status.SENT.value, tally.c.sent_hour >= first_number)
        .group_by(tally.c.sent_hour)
    ).all()
    sent = [(_EPOCH + timedelta(hours=int(number)), n) for number, n in sent_numbers]
    failed_hour = _hour(conn, t.c.failed_at)
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


def _hour(conn: Connection, column: Any) -> Any:
    """``column`` truncated to the hour, in SQL."""
    return dialect_of(conn).hour_start(column)


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


class Reader:
    """The read API: each method one read on the store's own engine, returning plain values.

    What status, stats, health, metrics and the dashboard show comes from
    here; reading needs no worker, transport or thread. ``"now"`` is the
    store's clock (the database clock on PostgreSQL).
    """

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def clock(self) -> Clock:
        """The store's clock (naive UTC)."""
        return self.store.clock  # type: ignore[no-any-return]

    def counts(self) -> dict[str, int]:
        """Rows per status."""
        with self.store.read() as conn:
            return counts(conn)

    def oldest_queued_age(self) -> float | None:
        """Seconds the oldest due queued email has waited; None when there is none."""
        with self.store.read() as conn:
            return oldest_queued_age(conn, clock=self.clock)

    def setting(self, name: str) -> Any:
        """A shared setting's stored value (None when unset)."""
        with self.store.read() as conn:
            return get_setting(conn, name)

    def count_sent_before(self, older_than: datetime) -> int:
        """``sent`` rows sent before ``older_than``."""
        with self.store.read() as conn:
            return count_sent_before(conn, older_than)

    def count_ended_before(self, older_than: datetime) -> int:
        """``suppressed``, ``expired`` and ``cancelled`` rows that ended before ``older_than``."""
        with self.store.read() as conn:
            return count_ended_before(conn, older_than)

    def email_outcome(self, email_id: int) -> sa.RowMapping:
        """One email's status, attempts and last error."""
        with self.store.read() as conn:
            return email_outcome(conn, email_id)

    def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        """The newest dead letters with their failure history."""
        with self.store.read() as conn:
            return dead_letters(conn, limit)

    def health_figures(self) -> HealthFigures:
        """What health is judged on, in one statement."""
        with self.store.read() as conn:
            return health_figures(conn, clock=self.clock)

    def queue_figures(self) -> QueueFigures:
        """The metrics' gauges, in one statement."""
        with self.store.read() as conn:
            return queue_figures(conn, clock=self.clock)

    def list_emails(self, **options: Any) -> Page:
        """One page of emails (see :func:`list_emails` for the options)."""
        with self.store.read() as conn:
            return list_emails(conn, **options)

    def get_email(self, email_id: int) -> EmailDetail | None:
        """One email with its attachments' names and its delivery events, or None."""
        with self.store.read() as conn:
            return get_email(conn, email_id)

    def hourly_counts(self, hours: int = 24) -> list[HourCount]:
        """Sent and dead-lettered emails per hour, oldest first."""
        with self.store.read() as conn:
            return hourly_counts(conn, hours=hours, clock=self.clock)

    def overview(self) -> Overview:
        """The dashboard's overview: counts, oldest queued age, the last 24 hours, on one
        connection."""
        with self.store.read() as conn:
            return Overview(counts=counts(conn),
                            oldest_queued_age=oldest_queued_age(conn, clock=self.clock),
                            hours=hourly_counts(conn, clock=self.clock))
