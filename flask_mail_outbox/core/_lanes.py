"""A worker's lane per named transport: its stream, its rate, the rows waiting for a slot.

A :class:`~._worker.Worker` has one :class:`Lane` per transport of
``OUTBOX_TRANSPORTS``. A lane claims its own due rows (a dispatcher claims
each lane's in turn), sends over its own stream (its transport's
connections and concurrency), and paces by its own ``rate_limit``: rows of a
rate-limited lane wait in :attr:`Lane.paced` for their slot on the shared
schedule (:class:`~._rate.SharedRate`), the others go at once. A lane without
a configured rate learns one: the first reply that says it sends too fast
stores the rate the server accepted as a shared schedule, which every process
then paces by: at once on PostgreSQL (a NOTIFY, :meth:`Lanes.learned_elsewhere`),
else at its own first refusal; a process that starts later finds it. A
throttled row of a lane that paces by a shared rate is due again at once
(:meth:`Lanes.paced_ids`): the cut rate's next slot is its wait.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from .. import _degrade
from ._delivery import Attempt, BatchReport, Suppressed, envelope_of, expired
from ._rate import LEARN_WINDOW_SECONDS, RateForgotten, SharedRate, Slots

if TYPE_CHECKING:
    from .._compose.verp import VerpAddresses
    from ..transports import Envelope, Report, Sending, Transport
    from ._leases import ClaimedEmail
    from ._settings import OutboxConfig
    from ._store import Store

logger = logging.getLogger(__name__)


class Lane:
    """One transport's share of a worker (see the module docstring).

    ``verp``: the VERP envelope senders of a transport that speaks SMTP
    (``OUTBOX_BOUNCE_ADDRESS``); None for the APIs, whose providers handle returns.
    ``learnable``: the schedule a lane without a configured rate learns (None
    when ``rate`` is configured); it becomes :attr:`rate` once learned.
    """

    def __init__(self, name: str, transport: Transport, rate: SharedRate | None,
                 verp: VerpAddresses | None = None,
                 learnable: SharedRate | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.clock = clock
        self.wall = wall
        self.transport = transport
        #: The schedule this lane paces by: configured, learned, or None (unpaced).
        self.rate = rate
        self.verp = verp
        self.learnable = learnable
        self.looked = learnable is None
        #: When this lane began pacing by a learned rate (wall clock; 0.0 for a
        #: configured one): a refusal of what it sent before, unpaced, is the
        #: congestion event that taught the rate, not a new one.
        self.paced_since = 0.0
        #: Another process learned this lane's rate (a NOTIFY, set from the
        #: listening thread): it joins at the dispatcher's next round.
        self.told = False
        #: When each email in flight was paced (its slot taken) or handed over
        #: unpaced, on the wall clock: a refusal is a new congestion event only
        #: if the rate was not cut since.
        self.sent_at: dict[int, float] = {}
        #: When this lane first handed an email over (monotonic), for learning.
        self.first_put: float | None = None
        self.sending: Sending | None = None
        #: The dispatcher's last claim of this lane was full: more is due.
        self.backlog = False
        #: Claimed rows of a rate-limited lane, with the time their slot comes.
        self.paced: collections.deque[tuple[float, ClaimedEmail]] = collections.deque()

    def put(self, envelopes: Sequence[Envelope], report: Report) -> None:
        """Hand ``envelopes`` to this lane's stream (opened on first use)."""
        if not envelopes:
            return
        if self.first_put is None:
            self.first_put = self.clock()
        now = self.wall()
        for envelope in envelopes:
            self.sent_at.setdefault(envelope.email_id, now)
        if self.sending is None:
            self.sending = self.transport.open(report)
        self.sending.put_many(envelopes)

    def pace(self, claimed: Sequence[ClaimedEmail], slots: Slots) -> None:
        """Queue ``claimed`` for their slots (one each, in order)."""
        for email in claimed:
            self.sent_at[email.id] = slots.taken_at
        self.paced.extend((slots.at(i), email) for i, email in enumerate(claimed))

    def due(self, now: float) -> list[ClaimedEmail]:
        """The paced rows whose slot has come, taken off the queue."""
        due = []
        while self.paced and self.paced[0][0] <= now:
            due.append(self.paced.popleft()[1])
        return due

    def next_slot(self) -> float | None:
        """When the next paced row may go; None when none waits."""
        return self.paced[0][0] if self.paced else None

    def claim_limit(self, room: int) -> int:
        """How many due rows a dispatcher's claim of this lane takes now (0: not now).

        A rate-limited lane claims a block, and again only once nearly all of
        the last one went: the rows it holds are what the schedule lets it
        send soon, so a high-priority email is never stuck behind a long
        local queue.
        """
        if self.rate is None:
            self.adopt_learned()
        if self.rate is None:
            return room
        if len(self.paced) > self.rate.block // 4:
            return 0
        return min(room, self.rate.block)

    def adopt_learned(self) -> None:
        """Pace by a rate learned earlier (by any process), looked for once per process."""
        if self.looked or self.learnable is None:
            return
        self.looked = True
        try:
            found = self.learnable.exists()
        except Exception as exc:  # noqa: BLE001 - unpaced until a refusal learns it again
            _degrade.report(
                f"Could not read the learned rate of transport {self.name!r} (outbox_rate)",
                consequence="this process sends unpaced until the server throttles it, and "
                            "draws the refusals that teach it the rate again",
                fix="check the database connection and that the outbox tables are migrated "
                    "(`flask db upgrade outbox@head`), or set the transport's rate_limit",
                exc=exc)
            return
        if found:
            self.rate, self.paced_since = self.learnable, self.wall()
            logger.info("Transport %r paces at its learned shared rate, %.3g msg/s now "
                        "(outbox_rate; set its rate_limit to replace it)", self.name,
                        self.learnable.current)

    def ready_at(self) -> float | None:
        """When :meth:`claim_limit` allows a claim again; None when it does now."""
        if self.rate is None or len(self.paced) <= self.rate.block // 4:
            return None
        return self.paced[len(self.paced) - self.rate.block // 4 - 1][0]

    def recorded(self, done: Sequence[tuple[ClaimedEmail, Attempt | None]],
                 report: BatchReport) -> tuple[int, float]:
        """Forget when this lane's emails of a record were sent; how many of them were
        throttled, and when the last of those was sent (0.0 if unknown)."""
        mine = {email.id for email, result in done if email.transport == self.name
                and not isinstance(result, Suppressed)}  # not sent, so not paced
        sent_at = {email_id: self.sent_at.pop(email_id) for email_id in mine
                   if email_id in self.sent_at}
        throttled = [email_id for email_id, _, error in report.transient
                     if email_id in mine and error.throttled]
        return len(throttled), max((sent_at.get(i, 0.0) for i in throttled), default=0.0)

    def take_back(self) -> list[ClaimedEmail]:
        """Every paced row, unsent (the worker stops): the caller releases them."""
        rows = [email for _, email in self.paced]
        self.paced.clear()
        for email in rows:
            self.sent_at.pop(email.id, None)
        return rows

    def cancel(self) -> tuple[set[int], int]:
        """Cancel the stream: the ids never handed to the server, and how many remain."""
        sending, self.sending = self.sending, None
        if sending is None:
            return set(), 0
        never = sending.cancel_pending()
        return never, sending.pending()

    def close(self) -> None:
        sending, self.sending = self.sending, None
        if sending is not None:
            sending.close(timeout=0)


class Lanes:
    """A worker's lanes, "default" first, and what it does with all of them."""

    def __init__(self, store: Store, config: OutboxConfig, transports: dict[str, Transport],
                 faults: _degrade.FaultTracker, clock: Callable[[], float], *,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.faults = faults
        self.clock = clock
        #: The wall clock, in seconds since the epoch (the store's clock is the datetime one).
        self.wall = wall
        self.store = store
        self.lanes = {
            spec.name: Lane(spec.name, transports[spec.name],
                            SharedRate(store, spec.name, spec.rate, clock=clock, wall=wall)
                            if spec.rate else None,
                            verp=config.verp if spec.cls.takes_esmtp_options else None,
                            learnable=None if spec.rate else SharedRate(
                                store, spec.name, None, clock=clock, wall=wall),
                            clock=clock, wall=wall)
            for spec in config.transport_specs}

    def __iter__(self) -> Iterator[Lane]:
        return iter(self.lanes.values())

    def __contains__(self, name: object) -> bool:
        return name in self.lanes

    @property
    def concurrency(self) -> int:
        """The most connections any lane's transport opens."""
        return max(max(1, int(getattr(lane.transport, "concurrency", 1))) for lane in self)

    def send(self, claimed: Sequence[ClaimedEmail], report: Report) -> None:
        """Each row to its lane: at once, or (rate-limited) when its slot comes."""
        by_lane: dict[str, list[ClaimedEmail]] = {}
        for email in claimed:
            by_lane.setdefault(email.transport, []).append(email)
        for name, emails in by_lane.items():
            lane = self.lanes[name]
            slots = self._slots(lane, len(emails)) if lane.rate is not None else None
            if slots is None:
                lane.put([envelope_of(e, self.config.dkim, lane.verp) for e in emails], report)
            else:
                lane.pace(emails, slots)
        self.send_due(report)

    def send_due(self, report: Report,
                    too_late: Callable[[ClaimedEmail], None] | None = None) -> None:
        """Send the paced rows whose slot has come; ``too_late`` takes those past their expiry.

        A rate limit can hold a claimed row for minutes: its ``expires_after`` is
        checked again when its slot comes, not only when it was claimed.
        """
        for lane in self:
            if lane.told:
                self._join(lane)
        now = self.clock()
        for lane in self:
            due = lane.due(now)
            if too_late is not None and due:
                wall = self.store.clock()
                for email in [e for e in due if expired(e, wall)]:
                    too_late(email)
                due = [e for e in due if not expired(e, wall)]
            if due:
                lane.put([envelope_of(e, self.config.dkim, lane.verp) for e in due], report)

    def learned_elsewhere(self, name: str) -> None:
        """Another process learned transport ``name``'s rate (its NOTIFY; any thread).

        The lane joins it at the dispatcher's next round (:meth:`send_due`),
        before it draws refusals of its own.
        """
        lane = self.lanes.get(name)
        if lane is not None and lane.rate is None and lane.learnable is not None:
            lane.told = True

    def _join(self, lane: Lane) -> None:
        """Pace ``lane`` by the rate another process just learned; what its unpaced
        stream has not handed to the server yet is taken back to go at that rate."""
        lane.told = False
        if lane.rate is not None:
            return
        lane.looked = False
        lane.adopt_learned()
        if lane.rate is not None:
            lane.cancel()  # each one is reported not attempted, and queued again

    def paced(self) -> int:
        """How many claimed rows wait for their slot, in every lane."""
        return sum(len(lane.paced) for lane in self)

    def next_slot(self) -> float | None:
        """When the next paced row of any lane may go."""
        return min((at for lane in self if (at := lane.next_slot()) is not None), default=None)

    def ready_at(self) -> float | None:
        """When a rate-limited lane with more due may claim again (see Lane.claim_limit)."""
        return min((at for lane in self if lane.backlog and (at := lane.ready_at()) is not None),
                   default=None)

    def _slots(self, lane: Lane, count: int) -> Slots | None:
        """``count`` slots of ``lane``'s shared rate; paced by this process alone if that
        fails; None when its learned rate was deleted (it then goes unpaced)."""
        rate = lane.rate
        if rate is None:
            return None
        try:
            slots = rate.take(count)
        except RateForgotten:
            lane.rate, lane.looked = None, False
            logger.info("The learned rate of transport %r was deleted (outbox_rate): it sends "
                        "unpaced until its server throttles it again", lane.name)
            return None
        except Exception as exc:  # noqa: BLE001 - reported; the emails still go, paced here
            self.faults.failing(
                f"rate-{rate.name}",
                f"Could not take slots of the shared rate of transport {rate.name!r}",
                consequence=f"this process paces its {count} email(s) at the rate last in "
                            f"force ({rate.current:.3g} msg/s) by itself, so processes "
                            "sharing the rate may together send faster than it until the "
                            "database answers",
                fix="check the database connection and that the outbox tables are migrated "
                    "(`flask db upgrade outbox@head` creates outbox_rate)",
                exc=exc)
            return Slots(count, self.clock(), 1.0 / rate.current, self.wall())
        self.faults.recovered(f"rate-{rate.name}")
        return slots

    def paced_ids(self, done: Sequence[tuple[ClaimedEmail, Attempt | None]], *,
                  dispatching: bool) -> set[int]:
        """The ids of ``done`` whose lane paces by a shared rate (configured or learned).

        A throttled one of them is due again at once: the refusal cuts the rate,
        and its next slot on the schedule is its wait (see _delivery.outcome_for).
        A lane without a rate, and an inline process (which retries its own rows
        after a pause), make a throttled row wait its few seconds.
        """
        if not dispatching:
            return set()
        return {email.id for email, _ in done
                if (lane := self.lanes.get(email.transport)) is not None
                and lane.rate is not None}

    def after_record(self, done: Sequence[tuple[ClaimedEmail, Attempt | None]],
                     report: BatchReport, *, dispatching: bool) -> None:
        """Each lane's rate after a record: a new congestion event cuts it (or learns one).

        A lane without a rate learns one only while dispatching: an inline
        process sends what its own requests queued, unpaced.
        """
        for lane in self:
            throttled, sent_at = lane.recorded(done, report)
            if not throttled:
                continue
            if lane.rate is not None:
                if sent_at >= lane.paced_since:
                    self._cut(lane, lane.rate, sent_at)
            elif dispatching:  # what was refused was sent before the rate it learns
                self._learn(lane, throttled)

    def _sending_for(self, lane: Lane) -> float:
        """Seconds since ``lane`` first handed an email over (the learning window's bound)."""
        return (self.clock() - lane.first_put if lane.first_put is not None
                else LEARN_WINDOW_SECONDS)

    def _cut(self, lane: Lane, rate: SharedRate, sent_at: float) -> None:
        """Cut ``lane``'s rate after a refusal of what it sent at ``sent_at`` (a new
        congestion event only if the rate was not cut since)."""
        try:
            cut = rate.throttled(sent_at)
        except Exception:
            logger.exception("Could not cut the shared rate of transport %r after a "
                             "throttled reply", lane.name)
            return
        if cut is not None and rate.learned:
            logger.info("Transport %r was throttled again: its learned shared rate is "
                        "now %.3g msg/s", lane.name, cut)

    def _learn(self, lane: Lane, refused: int) -> None:
        """The first throttled reply of an unconfigured lane: learn its rate, pace by it."""
        if lane.learnable is None:
            return
        # What the unpaced stream holds and has not handed to the server yet would
        # be refused too: it is released (not attempted) and comes back paced.
        # Taken back before the learning's own statement, which the stream would
        # otherwise go on feeding refusals through.
        never, _ = lane.cancel()
        try:
            rate = lane.learnable.learn(self._sending_for(lane))
        except Exception as exc:  # noqa: BLE001 - reported; refusals keep being deferred
            self.faults.failing(
                f"rate-{lane.name}",
                f"Could not store the rate learned for transport {lane.name!r}, whose "
                "server throttles this process",
                consequence="this process keeps sending unpaced and drawing refusals (each "
                            "refused email is queued again)",
                fix="check the database connection and that the outbox tables are migrated "
                    "(`flask db upgrade outbox@head` creates outbox_rate), or set the "
                    "transport's rate_limit",
                exc=exc)
            return
        self.faults.recovered(f"rate-{lane.name}")
        lane.rate, lane.paced_since = lane.learnable, self.wall()
        _degrade.report(
            f"The server of transport {lane.name!r} is throttling this process ({refused} "
            "email(s) refused with a reply that says it sends too fast), and no rate_limit "
            "is configured for it",
            consequence="those emails are queued again, their attempt given back at most "
                        f"OUTBOX_MAX_THROTTLE_DEFERRALS ({self.config.max_throttle_deferrals}) "
                        "times each; every process now paces this transport at a learned "
                        f"shared rate (outbox_rate), starting at {rate:.3g} msg/s (what the "
                        "server accepted since the first send, at most a second, or what "
                        "another process learned first), raised while the server accepts "
                        "it, cut at each new refusal to what it accepted over the last "
                        "second and grown back while that holds; the "
                        f"{len(never)} email(s) it had not handed to the server yet were "
                        "taken back to go at that rate",
            fix="set the transport's rate_limit (OUTBOX_RATE_LIMIT for the default) to the "
                "rate your provider allows")

    def take_back(self) -> list[ClaimedEmail]:
        """Every lane's paced rows, unsent (the worker stops): the caller releases them."""
        return [email for lane in self for email in lane.take_back()]

    def report_unknown(self, emails: Sequence[ClaimedEmail]) -> None:
        """Rows naming a transport this app does not configure (released): at ERROR."""
        names = sorted({email.transport for email in emails})
        self.faults.failing(
            "unknown-transport",
            f"{len(emails)} email(s) {[e.id for e in emails][:20]} name transport(s) "
            f"{names} that this app does not configure",
            consequence="they stay queued and are not delivered by this process",
            fix="add the transport back to OUTBOX_TRANSPORTS (or run this app's processes "
                "with one configuration); to send them through another transport, update "
                "their outbox_email.transport")

    def cancel(self) -> tuple[set[int], list[ClaimedEmail]]:
        """Cancel every stream: the ids never handed over, and the paced rows (unsent)."""
        never: set[int] = set()
        pending = 0
        paced: list[ClaimedEmail] = []
        for lane in self:
            lane_never, lane_pending = lane.cancel()
            never |= lane_never
            pending += lane_pending
            paced += lane.take_back()
        if never or pending or paced:
            # Said whenever something was in flight, so the operator (and a test
            # holding the server's replies) sees the stop reach the stream.
            logger.info("Outbox delivery is stopping (pid %d): released %d email(s) in "
                        "flight not yet handed to the server; %d being sent may still "
                        "finish", os.getpid(), len(never) + len(paced),
                        max(0, pending - len(never)))
        return never, paced

    def close(self) -> None:
        for lane in self:
            lane.close()
