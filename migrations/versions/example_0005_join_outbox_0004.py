"""example_app: join the outbox branch again (outbox_0004)

Revision ID: example_0005
Revises: example_0004, outbox_0004
Create Date: 2026-12-02

A merge revision, like example_0004: flask-mail-outbox added ``outbox_0004`` (the
priority column and the due-work index in the claim's order), which made the outbox
branch a second head again. It changes nothing; it keeps plain ``flask db upgrade``
at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0005"
down_revision = ("example_0004", "outbox_0004")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
