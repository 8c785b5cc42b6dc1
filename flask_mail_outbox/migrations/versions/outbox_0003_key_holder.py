"""outbox: ix_outbox_email_key_holder, the index of each key's holder

Revision ID: outbox_0003
Revises: outbox_0002
Create Date: 2026-12-02

Per-key order gives one open email of each key the ``key_head`` flag (the *holder*,
the only one that may be claimed). Whoever finishes a holder asks whether its key
still has one before flagging the next; this partial index makes that question one
probe, however deep the key's backlog. It holds one entry per key with open email.

On PostgreSQL ``CREATE INDEX`` blocks writes to ``outbox_email`` while it builds: it
reads only the open keyed rows' flags, well under a second for a million rows. Rows
left by earlier versions need nothing: their flags already mean this (a key without
a holder gets one from the next sweep's heal).

Frozen history: imports nothing from the package (see outbox_0001).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = "outbox_0003"
down_revision: str | None = "outbox_0002"
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None

_PREDICATE = "key_head AND status IN ('queued', 'sending')"


def upgrade() -> None:
    op.create_index("ix_outbox_email_key_holder", "outbox_email", ["key"],
                    sqlite_where=sa.text(_PREDICATE), postgresql_where=sa.text(_PREDICATE))


def downgrade() -> None:
    op.drop_index("ix_outbox_email_key_holder", table_name="outbox_email")
