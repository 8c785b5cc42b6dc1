"""Delivery's write transactions on the outbox's own engine, in three parts by concept.

:class:`Store` is the shared base (:class:`._database.Database`: the engine,
its database's SQL strategy, the clock, short write and read transactions)
and holds:

* ``store.leases`` (:class:`._leases.Leases`): the lease cycle, claim,
  renew, record, release, reap;
* ``store.sweep`` (:class:`._sweeping.Sweeping`): what the sweep reads and
  repairs;
* ``store.admin`` (:class:`._admin.Admin`): dead letters put back or
  deleted, retention, shared settings.

Nothing here is about SMTP. Elsewhere: the insert that ``send()`` runs in the
caller's session is :mod:`._insert`'s, the reads are :mod:`._queries`'s, and
the per-key order rule is :mod:`._ordering`'s: every write that can change a
key's line calls it in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from ._admin import Admin
from ._clock import utcnow
from ._database import Database
from ._leases import Leases
from ._sweeping import Sweeping


class Store(Database):
    """The outbox's engine and transactions (the base), and the three parts that use them."""

    def __init__(self, engine: Engine, *, clock: Callable[[], datetime] = utcnow,
                 clock_in_sql: bool = False) -> None:
        super().__init__(engine, clock=clock, clock_in_sql=clock_in_sql)
        self.leases = Leases(self)
        self.sweep = Sweeping(self)
        self.admin = Admin(self)
