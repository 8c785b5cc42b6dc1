"""example_app: join the outbox branch again (outbox_0003)

Revision ID: example_0004
Revises: example_0003, outbox_0003
Create Date: 2026-12-02

A merge revision, like example_0003: flask-mail-outbox added ``outbox_0003`` (the
index of each ordering key's holder), which made the outbox branch a second head
again. It changes nothing; it keeps plain ``flask db upgrade`` at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0004"
down_revision = ("example_0003", "outbox_0003")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
