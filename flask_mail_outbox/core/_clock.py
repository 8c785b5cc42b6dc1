"""Time as the outbox stores it: naive UTC.

"Now" as SQL is each database's (:meth:`._dialect.Dialect.now`): the database
clock on PostgreSQL, so processes with skewed clocks agree on leases and ages;
on SQLite, one machine, this clock.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """The current time, naive UTC (how every timestamp is stored)."""
    return datetime.now(UTC).replace(tzinfo=None)
