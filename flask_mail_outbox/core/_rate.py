"""A transport's ``rate_limit``, shared by every process on the database.

The limit is one schedule per transport in ``outbox_rate`` (a GCRA, the
token bucket's cousin that stores one time instead of a level): ``tat`` is
when the next message may go. A worker takes slots in blocks, one
``UPDATE ... RETURNING`` per block: the block's first slot starts at
``max(tat, now)`` and the slots follow every ``1 / rate`` seconds, so four
workers taking blocks in turn send one even stream at the rate, never a
burst (a provider that counts per second sees at most the rate). Nothing
is taken while idle: a worker takes slots for rows it has claimed. The
schedule survives restarts, so a day's limit holds across deploys.

A reply that says the client is too fast halves the shared rate (at most
once a second, down to a 64th); it then grows back additively, to the full
rate in :data:`RECOVERY_SECONDS` (AIMD).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from ._models import rate_table

if TYPE_CHECKING:
    from ._settings import Rate
    from ._store import Store

#: Seconds a halved rate takes to grow back to the configured one.
RECOVERY_SECONDS = 30.0
#: A halving waits this long after the last one (one per round trip of the feedback).
CUT_INTERVAL_SECONDS = 1.0
#: A block holds about this many seconds of the rate (at least one message).
BLOCK_SECONDS = 0.25


def effective_rate(max_rate: float, cut_rate: float | None, cut_at: float,
                   now: float) -> float:
    """The rate in force at ``now``: the configured one, or a halved one growing back.

    The same rule as :meth:`SharedRate._effective` writes in SQL.
    """
    if cut_rate is None:
        return max_rate
    return min(max_rate, cut_rate + (now - cut_at) * max_rate / RECOVERY_SECONDS)


@dataclasses.dataclass(frozen=True)
class Slots:
    """``count`` send times: ``start`` (on the caller's clock) and every ``spacing`` after."""

    count: int
    start: float
    spacing: float

    def at(self, index: int) -> float:
        """When slot ``index`` (0-based) may go."""
        return self.start + index * self.spacing


class SharedRate:
    """One transport's shared schedule (see the module docstring)."""

    def __init__(self, store: Store, name: str, rate: Rate, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.name = name
        self.rate = rate
        self.clock = clock
        self.wall = wall
        #: Messages per block: a quarter of a second's worth, at least one.
        self.block = max(1, math.ceil(rate.per_second * BLOCK_SECONDS))
        self._ensured = False
        self._take: Any = None
        self._cut: Any = None

    def take(self, count: int) -> Slots:
        """Reserve ``count`` slots on the shared schedule; when they may go."""
        if count <= 0:
            return Slots(0, self.clock(), 0.0)
        self._ensure()
        params: dict[str, Any] = {"rate_name": self.name, "n": float(count),
                                  "max_rate": self.rate.per_second}
        if not self.store.is_postgres:
            params["now"] = self.wall()
        with self.store.write() as conn:
            row = conn.execute(self._take_statement(), params).one()
        now = float(row.now) if self.store.is_postgres else params["now"]
        rate = effective_rate(self.rate.per_second, row.cut_rate, row.cut_at, now)
        # The block's first slot, in seconds from the database's "now".
        start_in = float(row.tat) - count / rate - now
        return Slots(count, self.clock() + max(0.0, start_in), 1.0 / rate)

    def throttled(self) -> None:
        """The server said this transport sends too fast: halve the shared rate."""
        self._ensure()
        params: dict[str, Any] = {"rate_name": self.name, "max_rate": self.rate.per_second}
        if not self.store.is_postgres:
            params["now"] = self.wall()
        with self.store.write() as conn:
            conn.execute(self._cut_statement(), params)

    # -- statements -------------------------------------------------------------------

    def _ensure(self) -> None:
        if self._ensured:
            return
        insert: Any = (postgresql.insert(rate_table) if self.store.is_postgres
                       else sqlite.insert(rate_table))
        with self.store.write() as conn:
            conn.execute(insert.values(name=self.name, tat=0.0, cut_at=0.0)
                         .on_conflict_do_nothing(index_elements=["name"]))
        self._ensured = True

    def _now(self) -> Any:
        if self.store.is_postgres:
            return sa.cast(sa.extract("epoch", sa.func.now()), sa.Float())
        return sa.bindparam("now", type_=sa.Float())

    def _effective(self, now: Any) -> Any:
        """The rate in force: the configured one, or a halved one growing back."""
        t = rate_table
        least = sa.func.least if self.store.is_postgres else sa.func.min
        max_rate = sa.bindparam("max_rate", type_=sa.Float())
        return sa.case(
            (t.c.cut_rate.is_(None), max_rate),
            else_=least(max_rate, t.c.cut_rate + (now - t.c.cut_at) * max_rate
                        / RECOVERY_SECONDS))

    def _take_statement(self) -> Any:
        if self._take is None:
            t = rate_table
            now = self._now()
            greatest = sa.func.greatest if self.store.is_postgres else sa.func.max
            n = sa.bindparam("n", type_=sa.Float())
            rate = self._effective(now)
            # RETURNING holds no parameters (SQLite would bind them out of order):
            # the caller computes the rate in force from the columns.
            returned = [t.c.tat, t.c.cut_rate, t.c.cut_at]
            if self.store.is_postgres:
                returned.append(now.label("now"))
            self._take = (t.update().where(t.c.name == sa.bindparam("rate_name"))
                          .values(tat=greatest(t.c.tat, now) + n / rate)
                          .returning(*returned))
        return self._take

    def _cut_statement(self) -> Any:
        if self._cut is None:
            t = rate_table
            now = self._now()
            greatest = sa.func.greatest if self.store.is_postgres else sa.func.max
            max_rate = sa.bindparam("max_rate", type_=sa.Float())
            self._cut = (t.update()
                         .where(t.c.name == sa.bindparam("rate_name"),
                                t.c.cut_at <= now - CUT_INTERVAL_SECONDS)
                         .values(cut_rate=greatest(max_rate / 64, self._effective(now) / 2),
                                 cut_at=now))
        return self._cut
