"""Time as the outbox stores it: naive UTC, and "now" as SQL.

On PostgreSQL "now" is the database clock, so processes with skewed clocks
agree on leases and ages; SQLite is one machine, so the Python clock is the
database clock.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import sqlalchemy as sa


def utcnow() -> datetime:
    """The current time, naive UTC (how every timestamp is stored)."""
    return datetime.now(UTC).replace(tzinfo=None)


def now_expr(dialect: str, clock: Callable[[], datetime] = utcnow) -> sa.ColumnElement[datetime]:
    """"Now" as SQL for ``dialect``: the database clock on PostgreSQL, ``clock()`` elsewhere."""
    if dialect == "postgresql":
        return sa.func.timezone("UTC", sa.func.now(), type_=sa.DateTime())
    return sa.literal(clock(), sa.DateTime())
