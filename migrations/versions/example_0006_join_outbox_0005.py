"""example_app: join the outbox branch again (outbox_0005)

Revision ID: example_0006
Revises: example_0005, outbox_0005
Create Date: 2026-12-02

A merge revision, like example_0005: flask-mail-outbox added ``outbox_0005`` (the
transport column, the due-work index by transport, the shared rate table), which made
the outbox branch a second head again. It changes nothing; it keeps plain ``flask db upgrade``
at one head.
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0006"
down_revision = ("example_0005", "outbox_0005")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
