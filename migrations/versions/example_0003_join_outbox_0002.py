"""example_app: join the outbox branch again (outbox_0002)

Revision ID: example_0003
Revises: example_0002, outbox_0002
Create Date: 2026-11-30

A merge revision, like example_0002 (``flask --app example_app db merge -m "join the
outbox branch" heads``): flask-mail-outbox added ``outbox_0002`` (the dashboard's
search columns), which made the outbox branch a second head again. It changes
nothing; it keeps plain ``flask db upgrade`` at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0003"
down_revision = ("example_0002", "outbox_0002")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
