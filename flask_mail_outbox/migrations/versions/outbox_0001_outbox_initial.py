"""outbox: the initial schema

Revision ID: outbox_0001
Revises:
Create Date: 2026-12-07

Creates every outbox table (``outbox_email``, ``outbox_attachment``,
``outbox_setting``, ``outbox_rate``, ``outbox_event``, ``outbox_suppression``,
``outbox_webhook_nonce``, ``outbox_tally``, ``outbox_mailbox``) with their indexes, the partial ones
included, and the triggers on ``outbox_email`` that keep ``outbox_tally`` (on
PostgreSQL also their function, ``outbox_tally_rows()``). The tables are new and
empty, so the tally has nothing to count yet. A downgrade drops all of it.

The root of the ``outbox`` branch: a project's own revisions never merge it
(see docs/migrations.md); a revision that needs the outbox tables declares
``depends_on = "outbox_0001"``.

Frozen history: this file spells out the schema as it is at this revision and
imports nothing from the package, so later changes to the models cannot change
it. tests/test_migrations.py proves that the result equals what
``flask_mail_outbox.core._models.metadata.create_all`` builds, catalog for catalog,
on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateIndex, CreateTable

# revision identifiers, used by Alembic.
revision = "outbox_0001"
down_revision: str | None = None
branch_labels = ("outbox",)
depends_on: str | None = None

# SQLite only auto-increments an INTEGER PRIMARY KEY, not BIGINT.
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

STATUSES = "'queued', 'sending', 'sent', 'failed', 'suppressed', 'expired', 'cancelled'"


def _where(clause: str) -> dict[str, Any]:
    """Partial-index predicate for both supported dialects."""
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


def _search_text(length: int) -> Any:
    """Byte order on PostgreSQL ("C"), as SQLite's BINARY: a prefix is a range scan."""
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def _tables() -> sa.MetaData:
    """The tables at this revision, on a MetaData of their own.

    Not ``op.create_table``: that builds its tables with the naming convention of the
    host application's ``target_metadata``, which would rename constraints (the check
    constraint to ``ck_outbox_email_ck_outbox_email_status`` under Flask's usual
    convention, the primary and foreign keys to whatever the app uses) and make this
    branch's schema depend on the app that runs it. The names are the ones below
    (primary and foreign keys, unnamed indexes by this MetaData's own convention),
    exactly as ``create_all`` names them.
    """
    metadata = sa.MetaData(naming_convention={
        "ix": "ix_%(column_0_label)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
    })
    sa.Table(
        "outbox_email",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("due_at", sa.DateTime(), nullable=False),
        sa.Column("sent_at", sa.DateTime(), nullable=True),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=True),
        sa.Column("key_head", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("error_history", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(96), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("sender", sa.String(320), nullable=False),
        sa.Column("recipients", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False, server_default=""),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("mime", sa.LargeBinary(), nullable=True),
        sa.Column("search_recipient", _search_text(320), nullable=True),
        sa.Column("search_subject", _search_text(200), nullable=True),
        sa.Column("failed_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("smtp_options", sa.Text(), nullable=True),
        sa.Column("priority", sa.SmallInteger(), nullable=False, server_default="1"),
        sa.Column("transport", sa.String(64), nullable=False, server_default="default"),
        sa.Column("provider_message_id", sa.String(255), nullable=True),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("scheduled_for", sa.DateTime(), nullable=True),
        sa.Column("template_name", sa.String(255), nullable=True),
        sa.Column("template_locale", sa.String(35), nullable=True),
        sa.Column("template_hash", sa.String(64), nullable=True),
        sa.Column("intercepted", sa.Text(), nullable=True),
        sa.Column("traceparent", sa.String(55), nullable=True),
        sa.Column("tracestate", sa.String(512), nullable=True),
        sa.CheckConstraint(f"status IN ({STATUSES})", name="ck_outbox_email_status"),
        sa.UniqueConstraint("idempotency_key", name="uq_outbox_email_idempotency_key"),
        # Due work: only rows that may go now, in the order each transport claims them.
        sa.Index("ix_outbox_email_due", "transport", "priority", "due_at", "id",
                 **_where("status = 'queued' AND (key IS NULL OR key_head)")),
        # The sweep: oldest queued first.
        sa.Index("ix_outbox_email_queued_created", "created_at", "id",
                 **_where("status = 'queued'")),
        # The reap: expired leases.
        sa.Index("ix_outbox_email_lease", "lease_expires_at", **_where("status = 'sending'")),
        # Per-key order: an earlier unfinished email of this key, the key's holder.
        sa.Index("ix_outbox_email_key_open", "key", "id",
                 **_where("status IN ('queued', 'sending') AND key IS NOT NULL")),
        sa.Index("ix_outbox_email_key_holder", "key",
                 **_where("key_head AND status IN ('queued', 'sending')")),
        # Dead letters and retention.
        sa.Index("ix_outbox_email_failed", "id", **_where("status = 'failed'")),
        sa.Index("ix_outbox_email_sent_at", "sent_at", **_where("status = 'sent'")),
        sa.Index("ix_outbox_email_ended_at", "ended_at",
                 **_where("status IN ('suppressed', 'expired', 'cancelled')")),
        # The dashboard: newest first within a status, prefix search.
        sa.Index("ix_outbox_email_status_id", "status", "id"),
        sa.Index("ix_outbox_email_search_recipient", "search_recipient", "id"),
        sa.Index("ix_outbox_email_search_subject", "search_subject", "id"),
        # Delivery events are matched on the provider's id.
        sa.Index("ix_outbox_email_provider_message_id", "provider_message_id"),
    )
    sa.Table(
        "outbox_attachment",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("email_id", _BIG_ID, sa.ForeignKey("outbox_email.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=True),
        sa.Column("content_type", sa.String(255), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Index("ix_outbox_attachment_email_id", "email_id"),
    )
    sa.Table(
        "outbox_setting",
        metadata,
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    sa.Table(
        "outbox_rate",
        metadata,
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("tat", sa.Float(), nullable=False, server_default="0"),
        sa.Column("cut_rate", sa.Float(), nullable=True),
        sa.Column("cut_at", sa.Float(), nullable=False, server_default="0"),
        sa.Column("paused_kind", sa.String(16), nullable=True),
        sa.Column("paused_error", sa.Text(), nullable=True),
        sa.Column("paused_since", sa.DateTime(), nullable=True),
        sa.Column("probe_at", sa.DateTime(), nullable=True),
        sa.Column("probe_delay", sa.Float(), nullable=True),
    )
    sa.Table(
        "outbox_event",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("email_id", _BIG_ID, nullable=True),
        sa.Column("transport", sa.String(64), nullable=False),
        sa.Column("provider_event_id", sa.String(255), nullable=True),
        sa.Column("event_type", sa.String(16), nullable=False),
        sa.Column("bounce_kind", sa.String(16), nullable=True),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("recipient", sa.String(320), nullable=True),
        sa.Column("occurred_at", sa.DateTime(), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False, server_default=""),
        sa.Column("mta_response", sa.Text(), nullable=False, server_default=""),
        sa.Column("payload", sa.Text(), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=True),
        sa.Column("suppressed_until", sa.DateTime(), nullable=True),
        sa.Column("applied_to", sa.String(320), nullable=True),
        sa.UniqueConstraint("transport", "provider_event_id",
                            name="uq_outbox_event_provider_event_id"),
        sa.Index("ix_outbox_event_email", "email_id", "occurred_at", "id"),
        sa.Index("ix_outbox_event_type", "event_type", "email_id"),
        sa.Index("ix_outbox_event_applied_to", "applied_to", "occurred_at",
                 **_where("applied_to IS NOT NULL")),
    )
    sa.Table(
        "outbox_suppression",
        metadata,
        sa.Column("address", _search_text(320), primary_key=True),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("source", sa.String(255), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("reason IN ('bounced', 'complained', 'unsubscribed', 'manual')",
                           name="ck_outbox_suppression_reason"),
        sa.Index("ix_outbox_suppression_expires_at", "expires_at",
                 **_where("expires_at IS NOT NULL")),
        sa.Index("ix_outbox_suppression_created_at", "created_at", "address"),
    )
    sa.Table(
        "outbox_webhook_nonce",
        metadata,
        sa.Column("transport", sa.String(64), primary_key=True),
        sa.Column("nonce", sa.String(255), primary_key=True),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
        sa.Index("ix_outbox_webhook_nonce_seen_at", "seen_at"),
    )
    sa.Table(
        "outbox_tally",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("sent_hour", sa.BigInteger(), nullable=True),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.Index("ix_outbox_tally_status_sent_hour", "status", "sent_hour"),
    )
    sa.Table(
        "outbox_mailbox",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("email_id", _BIG_ID, nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("sender", sa.String(320), nullable=False),
        sa.Column("recipients", sa.Text(), nullable=False),
        sa.Column("header_from", sa.Text(), nullable=False, server_default=""),
        sa.Column("header_to", sa.Text(), nullable=False, server_default=""),
        sa.Column("subject", sa.Text(), nullable=False, server_default=""),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("mime", sa.LargeBinary(), nullable=False),
        sa.Index("ix_outbox_mailbox_email_id", "email_id", "id"),
    )
    return metadata


# --- the tally's triggers ----------------------------------------------------------------
# outbox_tally holds running totals of the terminal statuses that grow with history
# (sent per hour, suppressed, expired, cancelled); triggers on outbox_email keep them.

TALLIED = ("sent", "suppressed", "expired", "cancelled")
TALLIED_SQL = "('sent', 'suppressed', 'expired', 'cancelled')"
TALLY_LOCK = (0x7461, 0)

_PG_HOUR = ("CASE WHEN status = 'sent'"
            " THEN CAST(floor(extract(epoch FROM sent_at) / 3600) AS bigint) END")
# Statement-level: one appended row per key a statement changed. INSERT only appends;
# UPDATE and DELETE fold the rows of each key at every 64th appended row, unless
# someone else is folding (a try-lock: nothing waits). TRUNCATE empties it.
_PG_FUNCTION = f"""\
CREATE OR REPLACE FUNCTION outbox_tally_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    fold boolean;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]});
        DELETE FROM outbox_tally;
        RETURN NULL;
    ELSIF TG_OP = 'INSERT' THEN
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, {_PG_HOUR}, count(*) FROM new_rows
        WHERE status IN {TALLIED_SQL} GROUP BY 1, 2;
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, {_PG_HOUR}, -count(*) FROM old_rows
            WHERE status IN {TALLIED_SQL} GROUP BY 1, 2
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    ELSE
        WITH added AS (
            INSERT INTO outbox_tally (status, sent_hour, n)
            SELECT status, sent_hour, sum(n) FROM (
                SELECT status, {_PG_HOUR} AS sent_hour, -1 AS n FROM old_rows
                WHERE status IN {TALLIED_SQL}
                UNION ALL
                SELECT status, {_PG_HOUR}, 1 FROM new_rows
                WHERE status IN {TALLIED_SQL}) AS moved
            GROUP BY status, sent_hour HAVING sum(n) <> 0
            RETURNING id)
        SELECT bool_or(mod(id, 64) = 0) INTO fold FROM added;
    END IF;
    -- Only where each statement sees what the last fold committed (READ COMMITTED):
    -- a REPEATABLE READ snapshot may hold rows another fold deleted since.
    IF fold AND current_setting('transaction_isolation') = 'read committed'
            AND pg_try_advisory_xact_lock({TALLY_LOCK[0]}, {TALLY_LOCK[1]}) THEN
        WITH keys AS (
            SELECT status, coalesce(sent_hour, -1) AS hour FROM outbox_tally
            GROUP BY 1, 2 HAVING count(*) > 1),
        folded AS (
            DELETE FROM outbox_tally
            WHERE (status, coalesce(sent_hour, -1)) IN (SELECT status, hour FROM keys)
            RETURNING status, sent_hour, n)
        INSERT INTO outbox_tally (status, sent_hour, n)
        SELECT status, sent_hour, sum(n) FROM folded
        GROUP BY status, sent_hour HAVING sum(n) <> 0;
    END IF;
    RETURN NULL;
END
$$"""


def _pg_trigger(event: str, referencing: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.lower()} AFTER {event} ON outbox_email"
            f" REFERENCING {referencing} FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()")


def _sqlite_tallied(column: str) -> str:
    """``column IN (tallied)`` as OR-ed equalities (cheaper per row inside a trigger)."""
    return "(" + " OR ".join(f"{column} = '{status}'" for status in TALLIED) + ")"


def _sqlite_add(row: str, sign: str) -> str:
    """Add ``sign`` 1 to the total of ``row`` (NEW or OLD), when its status is tallied."""
    hour = (f"CASE WHEN {row}.status = 'sent'"
            f" THEN CAST(strftime('%s', {row}.sent_at) AS INTEGER) / 3600 END")
    return (f"    UPDATE outbox_tally SET n = n {sign} 1"
            f" WHERE status = {row}.status AND sent_hour IS {hour};\n"
            f"    INSERT INTO outbox_tally (status, sent_hour, n) SELECT {row}.status, {hour}, {sign}1"
            f" WHERE {_sqlite_tallied(row + '.status')} AND NOT EXISTS (SELECT 1 FROM outbox_tally"
            f" WHERE status = {row}.status AND sent_hour IS {hour});\n")


def _sqlite_trigger(event: str, when: str, body: str) -> str:
    return (f"CREATE TRIGGER outbox_tally_{event.split()[0].lower()} AFTER {event}"
            f" ON outbox_email\nWHEN {when}\nBEGIN\n{body}END")


TRIGGERS = {
    "postgresql": (
        _PG_FUNCTION,
        _pg_trigger("INSERT", "NEW TABLE AS new_rows"),
        _pg_trigger("UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
        _pg_trigger("DELETE", "OLD TABLE AS old_rows"),
        ("CREATE TRIGGER outbox_tally_truncate AFTER TRUNCATE ON outbox_email"
         " FOR EACH STATEMENT EXECUTE FUNCTION outbox_tally_rows()"),
    ),
    "sqlite": (
        _sqlite_trigger("INSERT", _sqlite_tallied("NEW.status"), _sqlite_add("NEW", "+")),
        _sqlite_trigger(
            "UPDATE OF status, sent_at",
            f"({_sqlite_tallied('OLD.status')} OR {_sqlite_tallied('NEW.status')})"
            " AND (OLD.status IS NOT NEW.status OR OLD.sent_at IS NOT NEW.sent_at)",
            _sqlite_add("OLD", "-") + _sqlite_add("NEW", "+")),
        _sqlite_trigger("DELETE", _sqlite_tallied("OLD.status"), _sqlite_add("OLD", "-")),
    ),
}


def upgrade() -> None:
    # op.execute, not metadata.create_all(op.get_bind()), so `flask db upgrade --sql`
    # prints the DDL too.
    for table in _tables().sorted_tables:
        op.execute(CreateTable(table))
        for index in sorted(table.indexes, key=lambda index: str(index.name)):
            op.execute(CreateIndex(index))
    for statement in TRIGGERS.get(op.get_context().dialect.name, ()):
        op.execute(statement)


def downgrade() -> None:
    # Dependent tables first; each table's indexes, constraints and triggers go with it.
    for table in reversed(_tables().sorted_tables):
        op.drop_table(table.name)
    if op.get_context().dialect.name == "postgresql":
        # The triggers went with outbox_email; PostgreSQL keeps their function.
        op.execute("DROP FUNCTION IF EXISTS outbox_tally_rows()")
