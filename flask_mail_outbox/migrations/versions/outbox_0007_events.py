"""outbox: delivery events, the suppression list, expiry, and the statuses that end unsent

Revision ID: outbox_0007
Revises: outbox_0006
Create Date: 2026-12-06

Creates ``outbox_event`` (delivery events, unique per transport and
``provider_event_id``), ``outbox_suppression`` (one row per normalized address)
and ``outbox_webhook_nonce`` (signature tokens already accepted); adds
``outbox_email.expires_at`` (``send(expires_after=...)``); and widens
``ck_outbox_email_status`` to the terminal statuses ``suppressed``, ``expired``
and ``cancelled``. On PostgreSQL the constraint is replaced in the migration's
transaction: ``outbox_email`` is locked (writes and reads wait) while its rows
are checked, a scan of the table, so stop delivery for it on a large table.
SQLite cannot alter a constraint and rebuilds the table, as outbox_0005 does.
A downgrade deletes the rows in the three new statuses (unsent, and never to be
sent: the old schema could only hold them as dead letters, which "retry all"
would send).

Frozen history: imports nothing from the package (see outbox_0001).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateIndex, CreateTable

# revision identifiers, used by Alembic.
revision = "outbox_0007"
down_revision: str | None = "outbox_0006"
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None

OLD_STATUSES = "'queued', 'sending', 'sent', 'failed'"
STATUSES = OLD_STATUSES + ", 'suppressed', 'expired', 'cancelled'"

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _where(clause: str) -> dict[str, Any]:
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


def _search_text(length: int) -> Any:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def _transport() -> sa.Column[Any]:
    return sa.Column("transport", sa.String(64), nullable=False, server_default="default")


def _email_table(*, new: bool) -> sa.Table:
    """``outbox_email`` at this revision, or (not ``new``) at outbox_0006."""
    statuses = STATUSES if new else OLD_STATUSES
    metadata = sa.MetaData(naming_convention={
        "ix": "ix_%(column_0_label)s",
        "pk": "pk_%(table_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
    })
    return sa.Table(
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
        sa.Column("smtp_options", sa.Text(), nullable=True),
        sa.Column("priority", sa.SmallInteger(), nullable=False, server_default="1"),
        _transport(),
        sa.Column("provider_message_id", sa.String(255), nullable=True),
        *([sa.Column("expires_at", sa.DateTime(), nullable=True)] if new else []),
        sa.CheckConstraint(f"status IN ({statuses})", name="ck_outbox_email_status"),
        sa.UniqueConstraint("idempotency_key", name="uq_outbox_email_idempotency_key"),
        sa.Index("ix_outbox_email_due", "transport", "priority",
                 "due_at", "id",
                 **_where("status = 'queued' AND (key IS NULL OR key_head)")),
        sa.Index(
            "ix_outbox_email_queued_created", "created_at", "id", **_where("status = 'queued'")
        ),
        sa.Index("ix_outbox_email_lease", "lease_expires_at", **_where("status = 'sending'")),
        sa.Index(
            "ix_outbox_email_key_open",
            "key",
            "id",
            **_where("status IN ('queued', 'sending') AND key IS NOT NULL"),
        ),
        sa.Index(
            "ix_outbox_email_key_holder", "key",
            **_where("key_head AND status IN ('queued', 'sending')"),
        ),
        sa.Index("ix_outbox_email_failed", "id", **_where("status = 'failed'")),
        sa.Index("ix_outbox_email_sent_at", "sent_at", **_where("status = 'sent'")),
        sa.Index("ix_outbox_email_status_id", "status", "id"),
        sa.Index("ix_outbox_email_search_recipient", "search_recipient", "id"),
        sa.Index("ix_outbox_email_search_subject", "search_subject", "id"),
        sa.Index("ix_outbox_email_provider_message_id", "provider_message_id"),
    )


def _rebuild_sqlite(table: sa.Table, copied: list[str]) -> None:
    """Rebuild ``outbox_email`` as ``table``, copying the ``copied`` columns."""
    columns = ", ".join(f'"{name}"' for name in copied)
    op.execute("PRAGMA legacy_alter_table = ON")
    op.execute("ALTER TABLE outbox_email RENAME TO _outbox_email_0006")
    op.execute(CreateTable(table))
    op.execute(f"INSERT INTO outbox_email ({columns}) SELECT {columns} FROM _outbox_email_0006")
    op.execute("DROP TABLE _outbox_email_0006")  # its indexes go with it
    op.execute("PRAGMA legacy_alter_table = OFF")
    for index in sorted(table.indexes, key=lambda index: str(index.name)):
        op.execute(CreateIndex(index))


def _create_tables() -> None:
    big_id = _BIG_ID
    op.create_table(
        "outbox_event",
        sa.Column("id", big_id, autoincrement=True, nullable=False),
        sa.Column("email_id", big_id, nullable=True),
        sa.Column("transport", sa.String(64), nullable=False),
        sa.Column("provider_event_id", sa.String(255), nullable=True),
        sa.Column("event_type", sa.String(16), nullable=False),
        sa.Column("bounce_kind", sa.String(16), nullable=True),
        sa.Column("recipient", sa.String(320), nullable=True),
        sa.Column("occurred_at", sa.DateTime(), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("description", sa.Text(), server_default="", nullable=False),
        sa.Column("mta_response", sa.Text(), server_default="", nullable=False),
        sa.Column("payload", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_event"),
        sa.UniqueConstraint("transport", "provider_event_id",
                            name="uq_outbox_event_provider_event_id"),
    )
    op.create_index("ix_outbox_event_email", "outbox_event",
                    ["email_id", "occurred_at", "id"])
    op.create_index("ix_outbox_event_type", "outbox_event", ["event_type", "email_id"])
    op.create_table(
        "outbox_suppression",
        sa.Column("address", _search_text(320), nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("source", sa.String(255), server_default="", nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("reason IN ('bounced', 'complained', 'unsubscribed', 'manual')",
                           name=op.f("ck_outbox_suppression_reason")),
        sa.PrimaryKeyConstraint("address", name="pk_outbox_suppression"),
    )
    op.create_index("ix_outbox_suppression_expires_at", "outbox_suppression", ["expires_at"],
                    **_where("expires_at IS NOT NULL"))
    op.create_index("ix_outbox_suppression_created_at", "outbox_suppression",
                    ["created_at", "address"])
    op.create_table(
        "outbox_webhook_nonce",
        sa.Column("transport", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(255), nullable=False),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("transport", "nonce", name="pk_outbox_webhook_nonce"),
    )
    op.create_index("ix_outbox_webhook_nonce_seen_at", "outbox_webhook_nonce", ["seen_at"])


def _set_status_check(statuses: str) -> None:
    """PostgreSQL: replace the status constraint (a scan of the table, under its lock)."""
    op.execute("ALTER TABLE outbox_email DROP CONSTRAINT ck_outbox_email_status")
    op.execute("ALTER TABLE outbox_email ADD CONSTRAINT ck_outbox_email_status "
               f"CHECK (status IN ({statuses}))")


def upgrade() -> None:
    _create_tables()
    if op.get_context().dialect.name == "sqlite":
        _rebuild_sqlite(_email_table(new=True),
                        [c.name for c in _email_table(new=False).columns])
        return
    op.add_column("outbox_email", sa.Column("expires_at", sa.DateTime(), nullable=True))
    _set_status_check(STATUSES)


def downgrade() -> None:
    # Rows in a status the old constraint refuses cannot stay. They were never sent and
    # must never be: as dead letters a "retry all" would send them, so they go.
    unsent = "SELECT id FROM outbox_email WHERE status IN ('suppressed', 'expired', 'cancelled')"
    op.execute(f"DELETE FROM outbox_attachment WHERE email_id IN ({unsent})")
    op.execute("DELETE FROM outbox_email WHERE status IN ('suppressed', 'expired', 'cancelled')")
    if op.get_context().dialect.name == "sqlite":
        table = _email_table(new=False)
        _rebuild_sqlite(table, [c.name for c in table.columns])
    else:
        _set_status_check(OLD_STATUSES)
        op.drop_column("outbox_email", "expires_at")
    op.drop_table("outbox_webhook_nonce")
    op.drop_table("outbox_suppression")
    op.drop_table("outbox_event")
