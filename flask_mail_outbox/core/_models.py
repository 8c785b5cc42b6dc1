"""The outbox tables, on a MetaData of the library's own.

``outbox_email`` holds one row per email, with the complete MIME built once at
``send()`` (the bytes that are sent are the bytes that were validated).
``outbox_attachment`` lists each email's attachments (name, type, size) so
operators can see them without parsing the MIME. ``outbox_setting`` holds
settings shared by every process (the runtime delivery mode, the last sweep
report).

Partial indexes cover only the rows that can still change (``queued``,
``sending``) or that are listed by status, so finding due work costs the same
whether the table retains a thousand or ten million ``sent`` rows. The
dashboard's listing reads ``(status, id)`` and the two search columns, so its
pages cost the same on a million rows (keyset pagination, prefix range scans).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Constraint names are fixed here, not left to the database or to the host
# app's naming convention, so migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s",
}
metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

# SQLite only auto-increments an INTEGER PRIMARY KEY, not BIGINT.
_BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

SEARCH_RECIPIENT_LENGTH = 320
SEARCH_SUBJECT_LENGTH = 200


def _search_text(length: int) -> sa.types.TypeEngine[str]:
    """A search column: binary order, so a prefix is an index range scan.

    PostgreSQL compares text by the database's collation, under which neither
    ``LIKE 'p%'`` nor ``>= 'p' AND < 'q'`` can use a plain btree; under "C" the
    order is byte order, as SQLite's default BINARY collation is.
    """
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


#: ``mail.send(priority=...)`` -> the stored ``priority`` (the claim takes lower first).
PRIORITIES = {"high": 0, "normal": 1, "low": 2}
DEFAULT_PRIORITY = PRIORITIES["normal"]


class Status(str, enum.Enum):
    """The lifecycle of an email row."""

    QUEUED = "queued"
    SENDING = "sending"
    SENT = "sent"
    FAILED = "failed"
    #: Every recipient was on the suppression list: ended without contacting a server.
    SUPPRESSED = "suppressed"
    #: Not delivered before ``send(expires_after=...)``: ended unsent, not retried.
    EXPIRED = "expired"
    #: Taken back by ``mail.cancel()`` while still queued, or ended unsent at delivery
    #: by staging (a ``before_send`` veto, no recipient in OUTBOX_ALLOWED_RECIPIENTS).
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


#: The terminal statuses an email ends in without being sent: ``ended_at`` says when.
ENDED = (Status.SUPPRESSED, Status.EXPIRED, Status.CANCELLED)
#: ``status IN (ENDED)`` as SQL: the predicate of their partial index, which a
#: query must repeat word for word (values, not bound parameters) for the
#: planner to use it.
ENDED_SQL = "status IN ('suppressed', 'expired', 'cancelled')"


def retained_before(what: str, *, ended: bool,
                    index_hint: Callable[[str], str]) -> sa.TextClause:
    """``SELECT what`` of the rows retention deletes that ended before ``:older_than``.

    ``sent`` rows by ``sent_at``, or (``ended``) the ones that ended unsent by
    ``ended_at``, each in its partial index (``ix_outbox_email_sent_at``,
    ``ix_outbox_email_ended_at``): the predicate is written out (the planner
    matches that, not bound parameters), and ``index_hint`` (the dialect's:
    ``INDEXED BY`` on SQLite) pins the index where the planner needs it: without
    statistics SQLite's takes the dashboard's ``(status, id)`` index and reads
    and sorts every such row.
    """
    status, column, index = ((ENDED_SQL, "ended_at", "ix_outbox_email_ended_at") if ended
                             else ("status = 'sent'", "sent_at", "ix_outbox_email_sent_at"))
    hint = index_hint(index)
    return sa.text(f"SELECT {what} FROM outbox_email{hint}"
                   f" WHERE {status} AND {column} < :older_than").bindparams(
        sa.bindparam("older_than", type_=sa.DateTime()))

#: The statuses the database accepts.
STATUS_CHECK = ("status IN ('queued', 'sending', 'sent', 'failed', 'suppressed', 'expired', "
                "'cancelled')")


def _where(clause: str) -> dict[str, Any]:
    """Partial-index predicate for both supported dialects."""
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


class Base(DeclarativeBase):
    """Declarative base bound to the library's own MetaData."""

    metadata = metadata


class OutboxEmail(Base):
    """One email, from ``send()`` to its final status."""

    __tablename__ = "outbox_email"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(sa.String(16), nullable=False)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    # When the row may next be claimed: send_after, or the time of its next retry.
    due_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    sent_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    message_id: Mapped[str] = mapped_column(sa.String(255), nullable=False)
    key: Mapped[str | None] = mapped_column(sa.String(255))
    # The one open email of its key that may be claimed (see _ordering): a deep
    # backlog behind a few keys costs nothing to skip.
    key_head: Mapped[bool] = mapped_column(sa.Boolean(), nullable=False,
                                           server_default=sa.false())
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(255))
    attempts: Mapped[int] = mapped_column(sa.Integer(), nullable=False, server_default="0")
    last_error: Mapped[str | None] = mapped_column(sa.Text())
    # JSON list of {code, message, at, attempt}, oldest first.
    error_history: Mapped[str | None] = mapped_column(sa.Text())
    lease_owner: Mapped[str | None] = mapped_column(sa.String(96))
    lease_expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    sender: Mapped[str] = mapped_column(sa.String(320), nullable=False)
    # JSON list of envelope recipients (to + cc + bcc).
    recipients: Mapped[str] = mapped_column(sa.Text(), nullable=False)
    subject: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    size: Mapped[int] = mapped_column(sa.Integer(), nullable=False)
    # NULL once scrubbed (OUTBOX_SCRUB_SENT).
    mime: Mapped[bytes | None] = mapped_column(sa.LargeBinary())
    # The dashboard's prefix search: the first recipient and the subject,
    # lower-cased and cut to a length a btree entry always holds
    # (see search_key()). NULL only on rows written around send().
    search_recipient: Mapped[str | None] = mapped_column(_search_text(SEARCH_RECIPIENT_LENGTH))
    search_subject: Mapped[str | None] = mapped_column(_search_text(SEARCH_SUBJECT_LENGTH))
    # When the row was last dead-lettered (the dashboard's failures per hour).
    failed_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    # When it ended without being sent (suppressed, expired, cancelled): what
    # OUTBOX_RETENTION_DAYS and `flask outbox purge` count from, as from sent_at.
    ended_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    # Flask-Mail's mail_options / rcpt_options, as JSON {"mail": [...], "rcpt": [...]};
    # NULL when the message has none (nearly always).
    smtp_options: Mapped[str | None] = mapped_column(sa.Text())
    # mail.send(priority=...): 0 high, 1 normal, 2 low (see PRIORITIES); among due
    # rows the claim takes the lowest number first. A key's order ignores it.
    priority: Mapped[int] = mapped_column(sa.SmallInteger(), nullable=False,
                                          server_default="1")
    # mail.send(transport=...): the name of the OUTBOX_TRANSPORTS entry that sends it.
    transport: Mapped[str] = mapped_column(sa.String(64), nullable=False,
                                           server_default="default")
    # The provider's id of the message (an API's reply, an SMTP "queued as"):
    # delivery events are matched on it.
    provider_message_id: Mapped[str | None] = mapped_column(sa.String(255))
    # mail.send(expires_after=...): not delivered by then, the row ends expired.
    expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    # mail.send(send_after=...): when it was first due; NULL when due at creation
    # (created_at). The queue lifetime of a paused transport counts from it.
    scheduled_for: Mapped[datetime | None] = mapped_column(sa.DateTime())
    # mail.send_template(): the template's name ("orders/shipped"), the locale it
    # was rendered in, and the SHA-256 (hex) of the template files it read, so the
    # dashboard can say which template and which version an email came from.
    template_name: Mapped[str | None] = mapped_column(sa.String(255))
    template_locale: Mapped[str | None] = mapped_column(sa.String(35))
    template_hash: Mapped[str | None] = mapped_column(sa.String(64))
    # What staging did at delivery (OUTBOX_REDIRECT_TO, OUTBOX_ALLOWED_RECIPIENTS,
    # @mail.before_send) to the last attempt it changed: a JSON list of short notes;
    # NULL when nothing intercepted it (see _intercept).
    intercepted: Mapped[str | None] = mapped_column(sa.Text())
    # OpenTelemetry (OUTBOX_OTEL): the W3C trace context of send()'s PRODUCER span,
    # which each delivery attempt's CONSUMER span links to; NULL with tracing off.
    traceparent: Mapped[str | None] = mapped_column(sa.String(55))
    tracestate: Mapped[str | None] = mapped_column(sa.String(512))

    __table_args__ = (
        sa.CheckConstraint(STATUS_CHECK, name="ck_outbox_email_status"),
        sa.UniqueConstraint("idempotency_key", name="uq_outbox_email_idempotency_key"),
        # Due work: only rows that may go now (keyless, or the head of their key),
        # in the order the claim takes them. Each transport claims its own rows, so the transport comes first.
        sa.Index("ix_outbox_email_due", "transport", "priority", "due_at", "id",
                 **_where("status = 'queued' AND (key IS NULL OR key_head)")),
        # The sweep: oldest queued first.
        sa.Index("ix_outbox_email_queued_created", "created_at", "id",
                 **_where("status = 'queued'")),
        # The reap: expired leases.
        sa.Index("ix_outbox_email_lease", "lease_expires_at", **_where("status = 'sending'")),
        # Per-key order: is there an earlier unfinished email of this key?
        sa.Index("ix_outbox_email_key_open", "key", "id",
                 **_where("status IN ('queued', 'sending') AND key IS NOT NULL")),
        # Per-key order: does this key have a holder? (see _ordering)
        sa.Index("ix_outbox_email_key_holder", "key",
                 **_where("key_head AND status IN ('queued', 'sending')")),
        # Dead letters and retention.
        sa.Index("ix_outbox_email_failed", "id", **_where("status = 'failed'")),
        sa.Index("ix_outbox_email_sent_at", "sent_at", **_where("status = 'sent'")),
        sa.Index("ix_outbox_email_ended_at", "ended_at", **_where(ENDED_SQL)),
        # The dashboard: newest first within a status, and prefix search, both
        # paginated by keyset (the id breaks ties).
        sa.Index("ix_outbox_email_status_id", "status", "id"),
        sa.Index("ix_outbox_email_search_recipient", "search_recipient", "id"),
        sa.Index("ix_outbox_email_search_subject", "search_subject", "id"),
        sa.Index("ix_outbox_email_provider_message_id", "provider_message_id"),
    )


class OutboxAttachment(Base):
    """What one attachment of an email is: name, type and size (the data is in the MIME)."""

    __tablename__ = "outbox_attachment"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    email_id: Mapped[int] = mapped_column(
        _BigId, sa.ForeignKey("outbox_email.id", ondelete="CASCADE"), nullable=False, index=True
    )
    position: Mapped[int] = mapped_column(sa.Integer(), nullable=False)
    filename: Mapped[str | None] = mapped_column(sa.Text())
    content_type: Mapped[str] = mapped_column(sa.String(255), nullable=False)
    size: Mapped[int] = mapped_column(sa.Integer(), nullable=False)


class OutboxSetting(Base):
    """A setting shared by every process using the database (JSON value)."""

    __tablename__ = "outbox_setting"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    value: Mapped[str] = mapped_column(sa.Text(), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)


class OutboxRate(Base):
    """A transport's shared rate limit: the schedule every process takes slots from.

    Times are seconds since the epoch on the database clock (Python's on
    SQLite). ``tat``: when the next message may go (GCRA's theoretical
    arrival time). ``cut_rate`` / ``cut_at``: the rate after the last halving
    (a throttling reply) and when; NULL when none is in force.

    The same row says whether the transport is paused (see :mod:`._pause`):
    ``paused_kind`` (an ``account_fault``: credentials, quota, sender,
    unreachable) and ``paused_error`` (the error that paused it) since
    ``paused_since``; the next probe may be taken at ``probe_at``, and
    ``probe_delay`` seconds after a failed one. NULL when it is not paused.
    """

    __tablename__ = "outbox_rate"

    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tat: Mapped[float] = mapped_column(sa.Float(), nullable=False, server_default="0")
    cut_rate: Mapped[float | None] = mapped_column(sa.Float())
    cut_at: Mapped[float] = mapped_column(sa.Float(), nullable=False, server_default="0")
    paused_kind: Mapped[str | None] = mapped_column(sa.String(16))
    paused_error: Mapped[str | None] = mapped_column(sa.Text())
    paused_since: Mapped[datetime | None] = mapped_column(sa.DateTime())
    probe_at: Mapped[datetime | None] = mapped_column(sa.DateTime())
    probe_delay: Mapped[float | None] = mapped_column(sa.Float())


class OutboxEvent(Base):
    """One delivery event (see :class:`flask_mail_outbox.DeliveryEvent`).

    ``email_id`` is a plain reference, not a foreign key: an event for a
    message the outbox does not know is kept with NULL, and retention
    deletes an email's events with it. A provider resending an event hits
    the unique ``(transport, provider_event_id)`` and is ignored.
    """

    __tablename__ = "outbox_event"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    email_id: Mapped[int | None] = mapped_column(_BigId)
    transport: Mapped[str] = mapped_column(sa.String(64), nullable=False)
    provider_event_id: Mapped[str | None] = mapped_column(sa.String(255))
    event_type: Mapped[str] = mapped_column(sa.String(16), nullable=False)
    bounce_kind: Mapped[str | None] = mapped_column(sa.String(16))
    # Why it failed (flask_mail_outbox._reasons.REASONS), NULL when not a failure.
    reason: Mapped[str | None] = mapped_column(sa.String(32))
    recipient: Mapped[str | None] = mapped_column(sa.String(320))
    occurred_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    received_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    description: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    mta_response: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    # The provider's JSON for this event, at most 64 KiB.
    payload: Mapped[str | None] = mapped_column(sa.Text())
    # What the suppression policy concluded for the recipient (flask_mail_outbox._policy):
    # 'permanent', 'until' (suppressed_until) or 'none'; NULL: no recipient, or a type the
    # policy ignores. A report not trusted to act stores what it would have concluded.
    verdict: Mapped[str | None] = mapped_column(sa.String(16))
    suppressed_until: Mapped[datetime | None] = mapped_column(sa.DateTime())
    # The suppression key the verdict was applied to; NULL when it was not (no verdict, or
    # a report not trusted to act). An address's soft bounces are counted by it.
    applied_to: Mapped[str | None] = mapped_column(sa.String(320))

    __table_args__ = (
        sa.UniqueConstraint("transport", "provider_event_id",
                            name="uq_outbox_event_provider_event_id"),
        # An email's events in order, and its latest (the dashboard's filter).
        sa.Index("ix_outbox_event_email", "email_id", "occurred_at", "id"),
        # The dashboard's filter by latest event: the candidates of one type.
        sa.Index("ix_outbox_event_type", "event_type", "email_id"),
        # An address's recent soft bounces (the bounded suppression's count).
        sa.Index("ix_outbox_event_applied_to", "applied_to", "occurred_at",
                 **_where("applied_to IS NOT NULL")),
    )


class OutboxSuppression(Base):
    """An address the outbox does not send to (one row per normalized address).

    ``reason``: ``bounced``, ``complained``, ``unsubscribed`` (bulk mail only)
    or ``manual``; ``source`` says what put it there (a transport's webhook,
    an SMTP refusal, the unsubscribe link, a person). Past ``expires_at`` the
    row no longer applies and housekeeping deletes it.
    """

    __tablename__ = "outbox_suppression"

    # Byte order ("C" on PostgreSQL), as the search columns: a prefix search is a range scan.
    address: Mapped[str] = mapped_column(_search_text(320), primary_key=True)
    reason: Mapped[str] = mapped_column(sa.String(16), nullable=False)
    source: Mapped[str] = mapped_column(sa.String(255), nullable=False, server_default="")
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime())

    __table_args__ = (
        sa.CheckConstraint("reason IN ('bounced', 'complained', 'unsubscribed', 'manual')",
                           name="ck_outbox_suppression_reason"),
        sa.Index("ix_outbox_suppression_expires_at", "expires_at",
                 **_where("expires_at IS NOT NULL")),
        sa.Index("ix_outbox_suppression_created_at", "created_at", "address"),
    )


class OutboxWebhookNonce(Base):
    """A webhook signature token already accepted (Mailgun's): refused if it comes again.

    Kept a little longer than the replay window; housekeeping deletes older ones.
    """

    __tablename__ = "outbox_webhook_nonce"

    transport: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    nonce: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False, index=True)


class OutboxTally(Base):
    """Running totals of the large terminal statuses, kept by triggers on ``outbox_email``.

    ``sent``, ``suppressed``, ``expired`` and ``cancelled`` only grow with
    history, so counting their rows costs more the longer rows are retained;
    these totals cost the same at any size. The statuses an operator acts on
    (``queued``, ``sending``, ``failed``) are small and counted exactly from their
    partial indexes instead, so they are not here.

    The total of a status is ``sum(n)`` over its rows. ``sent_hour`` is the
    hour ``sent_at`` falls in (hours since the epoch, UTC) for ``sent`` rows,
    and NULL for the others: the dashboard's chart reads the last 24 of them.
    On PostgreSQL the triggers only append rows (a change never waits for,
    nor locks, a row another transaction wrote) and every 64th one folds the
    rows of each key into one; on SQLite, whose writers are serialized, they
    update one row per key in place. See :attr:`._dialect.Dialect.tally_ddl`.
    """

    __tablename__ = "outbox_tally"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(sa.String(16), nullable=False)
    sent_hour: Mapped[int | None] = mapped_column(sa.BigInteger())
    n: Mapped[int] = mapped_column(sa.BigInteger(), nullable=False)

    __table_args__ = (
        sa.Index("ix_outbox_tally_status_sent_hour", "status", "sent_hour"),
    )


#: The statuses :class:`OutboxTally` keeps totals of; the others are counted exactly.
TALLIED = (Status.SENT, Status.SUPPRESSED, Status.EXPIRED, Status.CANCELLED)
def search_key(text: str, length: int) -> str:
    """``text`` as the search columns hold it: lower-cased, at most ``length`` characters.

    Both what is stored and what is searched for go through here, so they match.
    """
    return text.lower()[:length]


class OutboxMailbox(Base):
    """A message the ``mailbox`` transport delivered: the development inbox.

    One row per delivery, written in the transaction that records its email
    ``sent`` (so the mailbox holds exactly what the outbox says it sent),
    with the envelope and the exact bytes handed over. The From, To and
    Subject headers are copied (decoded, made safe) so the list reads no
    MIME. No foreign key: purging or retaining ``outbox_email`` rows leaves
    the mailbox as it is, as it would a real inbox. Listed newest first by
    ``id`` (the primary key's order is the order of delivery).
    """

    __tablename__ = "outbox_mailbox"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    email_id: Mapped[int] = mapped_column(_BigId, nullable=False)
    received_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False)
    message_id: Mapped[str] = mapped_column(sa.String(255), nullable=False)
    # The SMTP envelope: MAIL FROM, and RCPT TO as a JSON list.
    sender: Mapped[str] = mapped_column(sa.String(320), nullable=False)
    recipients: Mapped[str] = mapped_column(sa.Text(), nullable=False)
    header_from: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    header_to: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    subject: Mapped[str] = mapped_column(sa.Text(), nullable=False, server_default="")
    size: Mapped[int] = mapped_column(sa.Integer(), nullable=False)
    mime: Mapped[bytes] = mapped_column(sa.LargeBinary(), nullable=False)

    __table_args__ = (
        # An email's copies (a link from its page), newest first.
        sa.Index("ix_outbox_mailbox_email_id", "email_id", "id"),
    )


email_table: sa.Table = OutboxEmail.__table__  # type: ignore[assignment]
tally_table: sa.Table = OutboxTally.__table__  # type: ignore[assignment]
attachment_table: sa.Table = OutboxAttachment.__table__  # type: ignore[assignment]
setting_table: sa.Table = OutboxSetting.__table__  # type: ignore[assignment]
rate_table: sa.Table = OutboxRate.__table__  # type: ignore[assignment]
event_table: sa.Table = OutboxEvent.__table__  # type: ignore[assignment]
suppression_table: sa.Table = OutboxSuppression.__table__  # type: ignore[assignment]
nonce_table: sa.Table = OutboxWebhookNonce.__table__  # type: ignore[assignment]
mailbox_table: sa.Table = OutboxMailbox.__table__  # type: ignore[assignment]

TABLE_NAMES = frozenset(metadata.tables)
