"""example_app: join the outbox branch again (outbox_0006)

Revision ID: example_0007
Revises: example_0006, outbox_0006
Create Date: 2026-12-05

A merge revision, like example_0006: flask-mail-outbox added ``outbox_0006`` (the
provider's message id), which made the outbox branch a second head again. It changes
nothing; it keeps plain ``flask db upgrade`` at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0007"
down_revision = ("example_0006", "outbox_0006")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
