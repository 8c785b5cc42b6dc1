"""example_app: join the outbox branch again (outbox_0008)

Revision ID: example_0009
Revises: example_0008, outbox_0008
Create Date: 2026-12-06

A merge revision, like example_0008: flask-mail-outbox added ``outbox_0008`` (the
running totals of the terminal statuses), which made the outbox branch a second head
again. It changes nothing; it keeps plain ``flask db upgrade`` at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0009"
down_revision = ("example_0008", "outbox_0008")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
