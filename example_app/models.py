"""The example's own table: who signed up."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from example_app.extensions import db


def _utcnow() -> datetime:
    # Naive UTC, like the outbox's own timestamps.
    return datetime.now(UTC).replace(tzinfo=None)


class User(db.Model):  # type: ignore[name-defined,misc]
    """One signup. The address is unique: one account per address."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(sa.Integer(), primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(320), nullable=False, unique=True)
    name: Mapped[str] = mapped_column(sa.String(100), nullable=False)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(), nullable=False, default=_utcnow)
