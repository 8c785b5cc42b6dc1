"""What the sweep reads and repairs, on the store's engine (the sweep itself is :mod:`._sweep`).

The rows a sweep takes (:meth:`Sweeping.sweep_candidates`) and those its age
gate holds back, rows a stopping process released (:meth:`Sweeping.mark_released`),
the per-key repair, and the claim of a deployment's startup sweep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from . import _claim, _ordering
from ._database import Database
from ._models import DEFAULT_PRIORITY, Status, email_table, setting_table

#: ``lease_owner`` of a ``queued`` row that a stopping process released, or
#: had been handed after a commit and never claimed: provably in flight
#: nowhere, so the sweep takes it whatever its age. No claim owner looks like
#: it (those are ``host:pid:n:hex``), and a claim overwrites it.
RELEASED = "released"

#: The ``lease_owner`` marks of queued rows in flight nowhere, which the sweep's
#: age gate does not hold back: released at a stop, or scheduled by ``send_after``.
_UNGATED = (RELEASED, _claim.SCHEDULED)

def _tried() -> Any:
    """A queued row a delivery had: an attempt spent, or given back with its error
    recorded (the fault that paused its transport, or held unsent for that pause)."""
    t = email_table
    return sa.or_(t.c.attempts > 0, t.c.last_error.is_not(None))


class Sweeping:
    """The sweep's selection and repairs (see the module docstring), on ``db``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def sweep_candidates(self, *, min_age_seconds: float, limit: int,
                         retried_ungated: bool = False) -> list[tuple[int, str]]:
        """Rows a sweep takes, oldest first (``created_at, id``): at most ``limit``.

        Due ``queued`` rows older than the age gate (keyless or key heads, so
        key order holds), younger ones in flight nowhere (released, or not
        due when queued: see :data:`_UNGATED`), and ``sending`` rows whose
        lease expired. One statement: a UNION ALL of three index scans, each
        on its partial index. Returns ``(id, status)`` pairs.

        ``retried_ungated``: young rows a task already had are in flight
        nowhere too (a task queue's task recorded the failure, or held the
        row for its paused transport with the attempt given back, and
        returned: nothing retries in memory), so they are published when due
        (their retry, their transport's probe), not once the row is as old
        as the gate.
        """
        t = email_table
        now = self.db.now_expr()
        cutoff = self._sweep_cutoff(min_age_seconds)
        queued = (sa.select(t.c.id, t.c.status, t.c.created_at)
                  .where(self.db.dialect.claimable(self.db.now_expr),
                         t.c.created_at <= cutoff)
                  .order_by(t.c.created_at, t.c.id).limit(limit))
        # Given back by a stopping process, or not due when queued: in flight
        # nowhere, so not age-gated. Only those younger than the gate are read
        # here: the scan reads the young end of the queued rows' partial index.
        given_back = (sa.select(t.c.id, t.c.status, t.c.created_at)
                      .where(self.db.dialect.claimable(self.db.now_expr),
                             t.c.created_at > cutoff,
                             sa.or_(t.c.lease_owner.in_(_UNGATED), _tried())
                             if retried_ungated else t.c.lease_owner.in_(_UNGATED))
                      .order_by(t.c.created_at, t.c.id).limit(limit))
        expired = (sa.select(t.c.id, t.c.status, t.c.created_at)
                   .where(t.c.status == Status.SENDING.value, t.c.lease_expires_at < now)
                   .order_by(t.c.created_at, t.c.id).limit(limit))
        both = sa.union_all(queued.subquery().select(), given_back.subquery().select(),
                            expired.subquery().select()).subquery()
        with self.db.read() as conn:
            rows = conn.execute(
                sa.select(both.c.id, both.c.status)
                .order_by(both.c.created_at, both.c.id).limit(limit)
            ).all()
        return [(int(row.id), str(row.status)) for row in rows]

    def urgent_among(self, ids: Sequence[int]) -> set[int]:
        """Those of ``ids`` sent with a priority above normal (``priority="high"``): a
        sweep publishing to a task queue gives them tasks of their own, first."""
        if not ids:
            return set()
        t = email_table
        with self.db.read() as conn:
            return {int(i) for i in conn.execute(
                sa.select(t.c.id).where(t.c.id.in_(list(ids)),
                                        t.c.priority < DEFAULT_PRIORITY)).scalars()}

    def age_gated(self, *, min_age_seconds: float,
                  retried_ungated: bool = False) -> tuple[int, datetime | None, datetime]:
        """Due queued rows the age gate keeps from a sweep: (count, oldest created_at, now).

        Rows in flight nowhere (:data:`_UNGATED`: released, or scheduled by
        ``send_after``; with ``retried_ungated``, those a task had: see
        :meth:`sweep_candidates`) are not gated. Reads the sweep's partial index.
        """
        t = email_table
        cutoff = self._sweep_cutoff(min_age_seconds)
        gated = [sa.or_(t.c.lease_owner.is_(None), t.c.lease_owner.not_in(_UNGATED))]
        if retried_ungated:
            gated.append(sa.not_(_tried()))
        with self.db.read() as conn:
            count, oldest, now = conn.execute(
                sa.select(sa.func.count(), sa.func.min(t.c.created_at), self.db.now_expr())
                .where(self.db.dialect.claimable(self.db.now_expr),
                       t.c.created_at > cutoff, *gated)
            ).one()
        return int(count), oldest, now

    def _sweep_cutoff(self, min_age_seconds: float) -> Any:
        """The age gate: rows created at or before this are old enough for a sweep."""
        return self.db.dialect.ago(self.db.clock, min_age_seconds)

    def mark_released(self, ids: Sequence[int]) -> int:
        """Mark ``queued`` rows of ``ids`` as released (see :data:`RELEASED`); how many.

        Only unleased queued rows change: one another process claimed meanwhile
        is its business.
        """
        t = email_table
        marked = 0
        unique = sorted(set(ids))
        with self.db.write() as conn:
            for start in range(0, len(unique), 500):
                chunk = unique[start:start + 500]
                marked += conn.execute(
                    t.update().where(t.c.id.in_(chunk), t.c.status == Status.QUEUED.value,
                                     t.c.lease_owner.is_(None))
                    .values(lease_owner=RELEASED)).rowcount
        return marked

    def heal_key_heads(self) -> int:
        """Give every key with open emails but no holder one (see :func:`._ordering.heal`).

        The sweep's safety net; how many keys it healed.
        """
        with self.db.write() as conn:
            return len(_ordering.heal(conn))

    def claim_startup_sweep(self, deployment: str) -> bool:
        """Whether this process runs the startup sweep of ``deployment`` (the first asks wins).

        An insert of a setting named after the deployment: the primary key
        lets one process in. Claims older than a day are deleted in the same
        transaction (a losing insert rolls that back too: the winner did it).
        """
        t = setting_table
        name = "startup_sweep:" + deployment
        try:
            with self.db.write() as conn:
                conn.execute(t.delete().where(
                    t.c.name.startswith("startup_sweep:", autoescape=True),
                    t.c.updated_at < self.db.later_expr(-86400)))
                conn.execute(t.insert().values(name=name, value=json.dumps(True),
                                               updated_at=self.db.now_expr()))
        except sa.exc.IntegrityError:
            return False
        return True
