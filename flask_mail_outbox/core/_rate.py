"""A transport's rate, shared by every process on the database: configured or learned.

The rate is one schedule per transport in ``outbox_rate`` (a GCRA, the
token bucket's cousin that stores one time instead of a level): ``tat`` is
when the next message may go. A worker takes slots in blocks, one
``UPDATE ... RETURNING`` per block: the block's first slot starts at
``max(tat, now)`` and the slots follow every ``1 / rate`` seconds, so four
workers taking blocks in turn send one even stream at the rate, never a
burst (a provider that counts per second sees at most the rate). Nothing
is taken while idle: a worker takes slots for rows it has claimed. The
schedule survives restarts, so a day's limit holds across deploys.

A reply that says the client sends too fast is a congestion event: the rate
is cut once per event, not once per refusal. A refusal belongs to a new event
only when its message was handed to the server after the last cut (``cut_at
< sent_at``): the refusals of messages already on their way when the rate was
cut are the same event, however many there are. A probing learned rate's
``cut_at`` lies seconds back (where its curve is steep): the refusals of what a
process sent unpaced before it joined the rate are told apart by that process
(``Lane.paced_since`` in ``_lanes``), not by ``cut_at``.

* A **configured** ``rate_limit`` is halved by a cut (down to a 64th) and grows
  back additively, to the full rate in :data:`RECOVERY_SECONDS` (AIMD).
* **Learned** (no ``rate_limit``, :meth:`SharedRate.learn`): the first
  throttled reply stores the rate the server accepted since the first send
  (at most the last second; the rows recorded ``sent``, every process's) as a
  first guess that probes upwards (on the curve's steep side, doubling about
  every 1.5 s while saturated) until the next refusal; a cut stores what the
  server accepted over the last second as ``cut_rate``, the rate to hold,
  if that is less than the rate in force at the refusal. From a cut the rate
  follows TCP CUBIC's curve, relative to that stored rate ``w``: it starts at
  :data:`LEARNED_CUT` × ``w``, is back at ``w`` after
  :data:`LEARNED_PLATEAU_SECONDS` and flat around it, then probes above it
  faster and faster, up to twice ``w`` and further only while the schedule is
  saturated (``tat`` ahead of now): a rate nobody uses does not grow unbounded.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ._listen import notify_rate_statement
from ._models import Status, email_table, rate_table

if TYPE_CHECKING:
    from ._settings import Rate
    from ._store import Store

#: Seconds a halved rate takes to grow back to the configured one.
RECOVERY_SECONDS = 30.0
#: A block holds about this many seconds of the rate (at least one message).
BLOCK_SECONDS = 0.25
#: A learned rate right after a cut, as a share of the rate it holds (TCP CUBIC's 0.7).
LEARNED_CUT = 0.7
#: Seconds from a cut until the learned rate is back at the rate it holds.
LEARNED_PLATEAU_SECONDS = 2.0
#: The cubic's coefficient: ``1 - LEARNED_CUT`` below the held rate at the cut.
_CUBIC = (1.0 - LEARNED_CUT) / LEARNED_PLATEAU_SECONDS ** 3
#: The most a learned rate probes above the rate it holds, unless saturated.
LEARNED_CAP = 2.0
#: Where on the curve (seconds past the plateau) a rate that was never cut probes: a
#: first guess grows x1.32 every 0.59 s (doubling in 1.5 s) while the schedule is saturated.
LEARNED_PROBE_SECONDS = 2.4
#: The curve's value there (1.518): a probing rate in force is its stored rate times this.
_PROBE_CURVE = 1.0 + _CUBIC * LEARNED_PROBE_SECONDS ** 3
#: A probing rate's ``cut_at``: this long before now.
_PROBE_OFFSET = LEARNED_PLATEAU_SECONDS + LEARNED_PROBE_SECONDS
#: The slowest learned rate: one message a minute.
LEARNED_FLOOR = 1 / 60
#: The window over which the first throttled reply measures the accepted rate...
LEARN_WINDOW_SECONDS = 1.0
#: ...or the time since the process began sending, if shorter, but not this.
LEARN_SHORTEST_SECONDS = 0.25


def effective_rate(max_rate: float | None, cut_rate: float | None, cut_at: float,
                   now: float) -> float:
    """The rate in force at ``now`` (the same rule as :meth:`SharedRate._effective` in SQL).

    Configured (``max_rate``): the configured one, or a halved one growing
    back. Learned (``max_rate`` None): the last cut value growing, capped.
    """
    if max_rate is None:
        held = LEARNED_FLOOR if cut_rate is None else cut_rate
        x = now - cut_at - LEARNED_PLATEAU_SECONDS
        return max(LEARNED_FLOOR, held * min(LEARNED_CAP, 1.0 + _CUBIC * x * x * x))
    if cut_rate is None:
        return max_rate
    return min(max_rate, cut_rate + (now - cut_at) * max_rate / RECOVERY_SECONDS)


def _window(sending_for: float) -> float:
    """The seconds over which the accepted rows are a rate (see :meth:`SharedRate.learn`)."""
    return min(LEARN_WINDOW_SECONDS, max(LEARN_SHORTEST_SECONDS, sending_for))


class RateForgotten(LookupError):
    """A learned rate's row is gone (deleted to forget it): its lane goes unpaced."""


@dataclasses.dataclass(frozen=True)
class Slots:
    """``count`` send times: ``start`` (on the caller's clock) and every ``spacing`` after.

    ``taken_at``: when they were taken, on the wall clock (``time.time()``): a
    refusal of one of them is a new congestion event only if the rate was not
    cut since (see :meth:`SharedRate.throttled`).
    """

    count: int
    start: float
    spacing: float
    taken_at: float

    def at(self, index: int) -> float:
        """When slot ``index`` (0-based) may go."""
        return self.start + index * self.spacing


class SharedRate:
    """One transport's shared schedule (see the module docstring).

    ``rate`` is the configured ``rate_limit``; None for a learned schedule,
    which exists once :meth:`learn` (or another process) has stored it.
    """

    def __init__(self, store: Store, name: str, rate: Rate | None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.name = name
        self.rate = rate
        self.clock = clock
        self.wall = wall
        #: The rate in force at the last take or cut, in messages per second.
        self.current = rate.per_second if rate is not None else LEARNED_FLOOR
        #: The database's clock minus ``wall`` at the last statement (0 on SQLite,
        #: whose "now" is ``wall``): puts a send time on the schedule's clock.
        self._offset = 0.0
        self._ensured = rate is None  # a learned row is made by learn(), never here
        self._take: Any = None
        self._cut: Any = None

    @property
    def learned(self) -> bool:
        """Whether this schedule is learned from the server's replies (no ``rate_limit``)."""
        return self.rate is None

    @property
    def block(self) -> int:
        """Messages per block: a quarter of a second's worth of the rate in force, at least one."""
        return max(1, math.ceil(self.current * BLOCK_SECONDS))

    def take(self, count: int) -> Slots:
        """Reserve ``count`` slots on the shared schedule; when they may go."""
        taken_at = self.wall()
        if count <= 0:
            return Slots(0, self.clock(), 0.0, taken_at)
        self._ensure()
        params = self._params(rate_name=self.name, n=float(count))
        with self.store.write() as conn:
            row = conn.execute(self._take_statement(), params).first()
        if row is None:  # the row was deleted by hand
            if self.rate is None:
                raise RateForgotten(self.name)
            self._ensured = False  # a configured schedule starts again
            self._ensure()
            with self.store.write() as conn:
                row = conn.execute(self._take_statement(), params).one()
        now = self._db_now(row)
        rate = effective_rate(self._max_rate, row.cut_rate, row.cut_at, now)
        self.current = rate
        # The block's first slot, in seconds from the database's "now".
        start_in = float(row.tat) - count / rate - now
        return Slots(count, self.clock() + max(0.0, start_in), 1.0 / rate, taken_at)

    def throttled(self, sent_at: float) -> float | None:
        """A message sent at ``sent_at`` (wall clock) was refused as too fast: cut the rate.

        Only if the rate was not cut since ``sent_at``: the refusals of
        messages sent before a cut are the congestion event it answered. A
        learned rate is cut to what the server accepted over the last second
        (every process's ``sent`` rows), if that is less than the rate in
        force: a whole second, even early on, so the server's burst does not
        pass for its rate (measured: over a shorter window a server with a
        burst of one second's worth drew twice the refusals). Returns the rate
        in force after the cut, None when this refusal made none.
        """
        self._ensure()
        params = self._params(rate_name=self.name, sent_at=sent_at + self._offset)
        with self.store.write() as conn:
            if self.rate is None:
                params["accepted"] = max(1.0, self._accepted(conn) / LEARN_WINDOW_SECONDS)
            row = conn.execute(self._cut_statement(), params).first()
        if row is None:
            return None
        self.current = (float(row.cut_rate) if self.rate is not None
                        else float(row.cut_rate) * LEARNED_CUT)
        return self.current

    def exists(self) -> bool:
        """Whether a learned rate is stored for this transport (by any process, any time)."""
        t = rate_table
        now = self._now() if self.store.dialect.database_clock else sa.literal(0.0)
        with self.store.read() as conn:
            found = conn.execute(sa.select(t.c.cut_rate, t.c.cut_at, now.label("now"))
                                 .where(t.c.name == self.name, t.c.cut_rate.is_not(None)),
                                 self._params()).first()
        if found is not None:
            self.current = effective_rate(None, found.cut_rate, found.cut_at,
                                          self._db_now(found))
        return found is not None

    def learn(self, sending_for: float) -> float:
        """Store the rate the server accepted as this transport's learned rate; returns it.

        The accepted rate is the ``sent`` rows of this transport recorded in the
        last :data:`LEARN_WINDOW_SECONDS` (every process's), over that window or
        over the ``sending_for`` seconds this process has been sending if that
        is shorter (at least :data:`LEARN_SHORTEST_SECONDS`): a server with a
        small burst refuses within a fraction of a second. At least one a
        second. That is a first guess, not a measure: a fraction of a second
        after the first send it counts the server's burst and misses what is
        not recorded yet (from 1 to 3 times the quota, measured). So the rate
        starts there and probes: it is stored on the steep side of the curve
        (:data:`LEARNED_PROBE_SECONDS` past the plateau), the refusals that
        taught it being its congestion event, and doubles about every 1.5 s
        while the schedule is saturated, until the next refusal cuts it to
        what the server accepted over a full second. A rate another process
        stored first is kept, unless it is a lower first guess of the last
        second (the processes throttled together each guess; the rows recorded
        lag the server, so the highest guess is the nearest).
        """
        with self.store.write() as conn:
            accepted = self._accepted(conn)
            initial = max(1.0, accepted / _window(sending_for))
            insert = self.store.dialect.insert(rate_table)
            now = self._now()
            # In force now: ``initial`` (the stored rate times the curve's value there).
            stored, held_since = initial / _PROBE_CURVE, now - _PROBE_OFFSET
            t = rate_table
            # Another process's first guess of the last second, lower than this one
            # (it counted fewer rows recorded yet): this one replaces it.
            lower_guess = sa.and_(t.c.cut_at <= held_since,
                                  t.c.cut_at >= held_since - LEARN_WINDOW_SECONDS,
                                  t.c.cut_rate < stored)
            statement = (insert.values(name=self.name, tat=now, cut_rate=stored,
                                       cut_at=held_since)
                         .on_conflict_do_update(
                             index_elements=["name"],
                             set_={"cut_rate": stored, "cut_at": held_since},
                             where=sa.or_(t.c.cut_rate.is_(None), lower_guess)))
            conn.execute(statement, self._params())
            if self.store.dialect.listens:  # the others pace by it from their next round
                conn.execute(notify_rate_statement(), {"name": self.name})
            row = conn.execute(sa.select(rate_table.c.cut_rate, rate_table.c.cut_at,
                                         (now if self.store.dialect.database_clock
                                          else sa.literal(0.0)).label("now"))
                               .where(rate_table.c.name == self.name),
                               self._params()).one()
        now_value = self._db_now(row)
        self.current = effective_rate(None, row.cut_rate, row.cut_at, now_value)
        return self.current

    # -- statements -------------------------------------------------------------------

    @property
    def _max_rate(self) -> float | None:
        return None if self.rate is None else self.rate.per_second

    def _params(self, **params: Any) -> dict[str, Any]:
        if self.rate is not None:
            params["max_rate"] = self.rate.per_second
        if not self.store.dialect.database_clock:
            params["now"] = self.wall()
        return params

    def _db_now(self, row: Any) -> float:
        """The statement's "now" on the schedule's clock (PostgreSQL's, else ``wall``)."""
        if not self.store.dialect.database_clock:
            self._offset = 0.0
            return self.wall()
        now = float(row.now)
        self._offset = now - self.wall()
        return now

    def _ensure(self) -> None:
        if self._ensured:
            return
        insert = self.store.dialect.insert(rate_table)
        with self.store.write() as conn:
            conn.execute(insert.values(name=self.name, tat=0.0, cut_at=0.0)
                         .on_conflict_do_nothing(index_elements=["name"]))
        self._ensured = True

    def _now(self) -> Any:
        return self.store.dialect.epoch_now()

    def _effective(self, now: Any) -> Any:
        """The rate in force (see :func:`effective_rate`)."""
        t = rate_table
        least, greatest = self.store.dialect.least, self.store.dialect.greatest
        if self.rate is None:
            x = now - t.c.cut_at - LEARNED_PLATEAU_SECONDS
            curve = least(sa.literal(LEARNED_CAP, sa.Float()), 1.0 + _CUBIC * x * x * x)
            return greatest(sa.literal(LEARNED_FLOOR, sa.Float()),
                            sa.func.coalesce(t.c.cut_rate, LEARNED_FLOOR) * curve)
        max_rate = sa.bindparam("max_rate", type_=sa.Float())
        return sa.case(
            (t.c.cut_rate.is_(None), max_rate),
            else_=least(max_rate, t.c.cut_rate + (now - t.c.cut_at) * max_rate
                        / RECOVERY_SECONDS))

    def _take_statement(self) -> Any:
        if self._take is None:
            t = rate_table
            now = self._now()
            greatest = self.store.dialect.greatest
            n = sa.bindparam("n", type_=sa.Float())
            rate = self._effective(now)
            values: dict[str, Any] = {"tat": greatest(t.c.tat, now) + n / rate}
            if self.rate is None:
                # A learned rate at its cap probes on only while it is all used:
                # from the cap, on the curve's steep side (see learn()), so the
                # rate in force goes on from where it is.
                rebase = sa.and_(t.c.tat > now, rate >= t.c.cut_rate * (LEARNED_CAP * 0.999))
                values["cut_rate"] = sa.case(
                    (rebase, t.c.cut_rate * (LEARNED_CAP / _PROBE_CURVE)), else_=t.c.cut_rate)
                values["cut_at"] = sa.case((rebase, now - _PROBE_OFFSET), else_=t.c.cut_at)
            # RETURNING holds no parameters (SQLite would bind them out of order):
            # the caller computes the rate in force from the columns.
            returned = [t.c.tat, t.c.cut_rate, t.c.cut_at]
            if self.store.dialect.database_clock:
                returned.append(now.label("now"))
            self._take = (t.update().where(t.c.name == sa.bindparam("rate_name"))
                          .values(**values).returning(*returned))
        return self._take

    def _cut_statement(self) -> Any:
        if self._cut is None:
            t = rate_table
            now = self._now()
            least, greatest = self.store.dialect.least, self.store.dialect.greatest
            if self.rate is None:
                # The rate to hold: what the server accepted, if less than what was in force.
                cut = greatest(LEARNED_FLOOR, least(self._effective(now), sa.bindparam(
                    "accepted", type_=sa.Float())))
            else:
                cut = greatest(sa.bindparam("max_rate", type_=sa.Float()) / 64,
                               self._effective(now) / 2)
            returned = [t.c.cut_rate]
            self._cut = (t.update()
                         .where(t.c.name == sa.bindparam("rate_name"),
                                t.c.cut_at < sa.bindparam("sent_at", type_=sa.Float()))
                         .values(cut_rate=cut, cut_at=now)
                         .returning(*returned))
        return self._cut

    def _accepted(self, conn: Any) -> int:
        """How many of this transport's rows were recorded sent in the last window."""
        return int(conn.execute(self._accepted_statement(),
                                self._params(name=self.name)).scalar_one())

    def _accepted_statement(self) -> Any:
        """How many rows of transport ``name`` were recorded sent in the last window."""
        e = email_table
        since = self.store.dialect.ago(self.store.clock, LEARN_WINDOW_SECONDS)
        return (sa.select(sa.func.count()).select_from(e)
                .where(e.c.status == Status.SENT.value, e.c.transport == sa.bindparam("name"),
                       e.c.sent_at >= since))
