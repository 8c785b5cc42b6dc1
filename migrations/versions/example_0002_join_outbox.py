"""example_app: join the outbox branch

Revision ID: example_0002
Revises: example_0001, outbox_0001
Create Date: 2025-11-30

A merge revision (``flask db merge heads``): it changes nothing, and makes this app's
history and the library's ``outbox`` branch one head again, so plain ``flask db
upgrade`` and ``flask db migrate`` keep working. When flask-mail-outbox ships another
outbox revision, ``flask db heads`` lists two heads again: run ``flask --app example_app
db merge -m "join the outbox branch" heads`` to add the next merge
(tests/test_migrations.py fails until then).
"""

from __future__ import annotations

# revision identifiers, used by Alembic.
revision = "example_0002"
down_revision = ("example_0001", "outbox_0001")
branch_labels: tuple[str, ...] | None = None
depends_on: str | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
