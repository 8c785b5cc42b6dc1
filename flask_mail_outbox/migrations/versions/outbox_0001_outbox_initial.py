"""outbox: the initial schema (outbox_email, outbox_attachment, outbox_setting)

Revision ID: outbox_0001
Revises:
Create Date: 2025-11-30

Frozen history: this file spells out the tables as they were at this revision and
imports nothing from the package, so later changes to the models cannot change it.
tests/test_migrations.py proves that the result equals ``flask_mail_outbox._models``.
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


def _where(clause: str) -> dict[str, Any]:
    """Partial-index predicate for both supported dialects."""
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


def _tables() -> sa.MetaData:
    """The three tables at this revision, on a MetaData of their own.

    Not ``op.create_table``: that builds its tables with the naming convention of the
    host application's ``target_metadata``, which would rename constraints (the check
    constraint to ``ck_outbox_email_ck_outbox_email_status`` under Flask's usual
    convention, the primary and foreign keys to whatever the app uses) and make this
    branch's schema depend on the app that runs it. Without a convention the names are
    the ones below (primary and foreign keys named by this MetaData's own convention),
    exactly as ``flask_mail_outbox._models.metadata.create_all`` names them.
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
        sa.CheckConstraint(
            "status IN ('queued', 'sending', 'sent', 'failed')", name="ck_outbox_email_status"
        ),
        sa.UniqueConstraint("idempotency_key", name="uq_outbox_email_idempotency_key"),
        # Due work: only rows that may go now (keyless, or the head of their key).
        sa.Index(
            "ix_outbox_email_due",
            "due_at",
            "id",
            **_where("status = 'queued' AND (key IS NULL OR key_head)"),
        ),
        # The sweep: oldest queued first.
        sa.Index(
            "ix_outbox_email_queued_created", "created_at", "id", **_where("status = 'queued'")
        ),
        # The reap: expired leases.
        sa.Index("ix_outbox_email_lease", "lease_expires_at", **_where("status = 'sending'")),
        # Per-key order: is there an earlier unfinished email of this key?
        sa.Index(
            "ix_outbox_email_key_open",
            "key",
            "id",
            **_where("status IN ('queued', 'sending') AND key IS NOT NULL"),
        ),
        # Dead letters and retention.
        sa.Index("ix_outbox_email_failed", "id", **_where("status = 'failed'")),
        sa.Index("ix_outbox_email_sent_at", "sent_at", **_where("status = 'sent'")),
    )
    sa.Table(
        "outbox_attachment",
        metadata,
        sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True),
        sa.Column(
            "email_id",
            _BIG_ID,
            sa.ForeignKey("outbox_email.id", ondelete="CASCADE"),
            nullable=False,
        ),
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
    return metadata


def upgrade() -> None:
    # op.execute, not metadata.create_all(op.get_bind()), so `flask db upgrade --sql`
    # prints the DDL too.
    for table in _tables().sorted_tables:
        op.execute(CreateTable(table))
        for index in sorted(table.indexes, key=lambda index: str(index.name)):
            op.execute(CreateIndex(index))


def downgrade() -> None:
    # The dependent table first; each table's indexes and constraints go with it.
    for name in ("outbox_setting", "outbox_attachment", "outbox_email"):
        op.drop_table(name)
