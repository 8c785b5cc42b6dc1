"""outbox: the provider's id of each message

Revision ID: outbox_0006
Revises: outbox_0005
Create Date: 2026-12-05

Adds ``outbox_email.provider_message_id`` (VARCHAR(255), NULL): the id a provider's
API answered with, or an SMTP server's ``queued as ...``, which delivery events are
matched on; and its index ``ix_outbox_email_provider_message_id``. On PostgreSQL the
nullable column is added in place (no table rewrite) and the index is built while the
table is locked for writes. SQLite rebuilds the table, as outbox_0005 does, so its
schema stays exactly what the models create.

Frozen history: imports nothing from the package (see outbox_0001).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateIndex, CreateTable

# revision identifiers, used by Alembic.
revision = "outbox_0006"
down_revision: str | None = "outbox_0005"
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _where(clause: str) -> dict[str, Any]:
    return {"sqlite_where": sa.text(clause), "postgresql_where": sa.text(clause)}


def _search_text(length: int) -> Any:
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def _transport() -> sa.Column[Any]:
    return sa.Column("transport", sa.String(64), nullable=False, server_default="default")


def _email_table(*, provider_id: bool) -> sa.Table:
    """``outbox_email`` at this revision, or (not ``provider_id``) at outbox_0005."""
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
        *([sa.Column("provider_message_id", sa.String(255), nullable=True)]
          if provider_id else []),
        sa.CheckConstraint(
            "status IN ('queued', 'sending', 'sent', 'failed')", name="ck_outbox_email_status"
        ),
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
        *([sa.Index("ix_outbox_email_provider_message_id", "provider_message_id")]
          if provider_id else []),
    )


def _rebuild_sqlite(table: sa.Table, copied: list[str]) -> None:
    """Rebuild ``outbox_email`` as ``table``, copying the ``copied`` columns."""
    columns = ", ".join(f'"{name}"' for name in copied)
    op.execute("PRAGMA legacy_alter_table = ON")
    op.execute("ALTER TABLE outbox_email RENAME TO _outbox_email_0005")
    op.execute(CreateTable(table))
    op.execute(f"INSERT INTO outbox_email ({columns}) SELECT {columns} FROM _outbox_email_0005")
    op.execute("DROP TABLE _outbox_email_0005")  # its indexes go with it
    op.execute("PRAGMA legacy_alter_table = OFF")
    for index in sorted(table.indexes, key=lambda index: str(index.name)):
        op.execute(CreateIndex(index))


def upgrade() -> None:
    if op.get_context().dialect.name == "sqlite":
        _rebuild_sqlite(_email_table(provider_id=True),
                        [c.name for c in _email_table(provider_id=False).columns])
        return
    op.add_column("outbox_email", sa.Column("provider_message_id", sa.String(255),
                                            nullable=True))
    op.create_index("ix_outbox_email_provider_message_id", "outbox_email",
                    ["provider_message_id"])


def downgrade() -> None:
    if op.get_context().dialect.name == "sqlite":
        table = _email_table(provider_id=False)
        _rebuild_sqlite(table, [c.name for c in table.columns])
        return
    op.drop_index("ix_outbox_email_provider_message_id", table_name="outbox_email")
    op.drop_column("outbox_email", "provider_message_id")
