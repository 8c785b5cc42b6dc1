"""example_app: the users table

Revision ID: example_0001
Revises:
Create Date: 2026-12-07

The root of example_app's own history, labelled ``example``: a branch of its own
beside the library's ``outbox`` branch, never merged with it. It depends on
``outbox_0001`` (the outbox's initial schema) because the app cannot run without
the outbox tables: ``flask db upgrade example@head`` creates them first. Later
outbox revisions need nothing from this history: ``flask --app example_app db
upgrade heads`` applies them, and no revision is added here for them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = "example_0001"
down_revision: str | None = None
branch_labels = ("example",)
depends_on = "outbox_0001"


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("email", sa.String(length=320), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("email", name=op.f("uq_users_email")),
    )


def downgrade() -> None:
    op.drop_table("users")
