"""example_app: the users table

Revision ID: example_0001
Revises:
Create Date: 2025-11-30

The root of example_app's own history. It needs nothing from the outbox branch (no
foreign key to an outbox table), so it does not depend on it; example_0002 joins the
two histories.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = "example_0001"
down_revision: str | None = None
branch_labels = ("example",)
depends_on: str | None = None


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
