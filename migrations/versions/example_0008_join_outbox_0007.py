"""example_app: join the outbox branch again (outbox_0007)

Revision ID: example_0008
Revises: example_0007, outbox_0007
Create Date: 2026-12-05

A merge revision, like example_0007: flask-mail-outbox added ``outbox_0007`` (delivery
events and the suppression list), which made the outbox branch a second head again. It changes
nothing; it keeps plain ``flask db upgrade`` at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0008"
down_revision = ("example_0007", "outbox_0007")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
