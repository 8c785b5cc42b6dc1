"""The delivery core of one process: built from plain values, it knows no Flask.

:class:`Outbox` takes a database URL, the settings (:class:`~._settings.OutboxConfig`),
optionally ready transports, and :class:`~._delivery.Callbacks` for outcomes.
It owns the engine and the :class:`~._store.Store` from the start, and builds
what delivers (the transports, :class:`~._delivery.Delivery`, the
:class:`~._worker.Worker`, LISTEN) only when something is to be delivered: a
read through :attr:`Outbox.reader` never makes a worker.

:meth:`Outbox.mode` is the one place the delivery mode is decided, and
:meth:`Outbox.deliver_soon` the one place committed rows start on their way.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence

import sqlalchemy as sa

from .. import _degrade
from ..transports import (
    FailoverTransport,
    MemoryTransport,
    Transport,
    build,
)
from ._clock import TestClock
from ._delivery import Callbacks, Delivery
from ._dialect import create_engine
from ._events import EventLog
from ._executor import Executor, publish
from ._listen import Listener, libpq_url
from ._queries import Reader
from ._releases import Releases
from ._settings import DEFAULT_TRANSPORT, OutboxConfig
from ._store import Store
from ._suppression import Suppressions
from ._worker import Worker

logger = logging.getLogger(__name__)

#: The ``outbox_setting`` row of the runtime delivery-mode switch.
DURABLE_SETTING = "durable"


class Mode(enum.Enum):
    """The delivery mode in force for every process sharing the database."""

    INLINE = "inline"
    DURABLE = "durable"


def build_transports(config: OutboxConfig, *, concurrency: int) -> dict[str, Transport]:
    """Every configured transport by name, "default" first; one with a failover list is wrapped.

    With ``suppress_send`` (``MAIL_SUPPRESS_SEND``) every name is one memory transport.
    """
    if config.suppress_send:
        return dict.fromkeys(config.transport_names, MemoryTransport())
    own: dict[str, Transport] = {}
    for spec in config.transport_specs:
        settings = dataclasses.replace(spec.settings,
                                       concurrency=spec.concurrency or concurrency)
        own[spec.name] = build(spec.cls, settings)
    return {spec.name: FailoverTransport([(name, own[name]) for name in
                                          (spec.name, *spec.failover)])
            if spec.failover else own[spec.name]
            for spec in config.transport_specs}


class Outbox:
    """One process's delivery core for one database (see the module docstring).

    ``transports``: ready ones by name (None: built from ``config`` when first
    needed); ``concurrency``: sends in flight per transport where its spec sets
    none (``OUTBOX_CONCURRENCY``, or ``flask outbox worker --concurrency``).
    ``clock``: a :class:`~._clock.TestClock` whose time every "now" of this core
    follows (timestamps, the worker's deadlines, and on PostgreSQL "now" in
    SQL); None: the real clocks, and the SQL the database's ``now()``.
    """

    def __init__(self, url: str | sa.URL, config: OutboxConfig, *,
                 transports: Mapping[str, Transport] | None = None,
                 callbacks: Callbacks | None = None,
                 faults: _degrade.FaultTracker | None = None,
                 concurrency: int | None = None,
                 clock: TestClock | None = None,
                 executor: Executor | None = None) -> None:
        if clock is not None and not isinstance(clock, TestClock):
            raise TypeError(f"Outbox(clock=...): expected a TestClock or None, got "
                            f"{type(clock).__name__}")
        self.pid = os.getpid()
        #: The test clock this core runs on (None: the real clocks).
        self.clock = clock
        self._monotonic = time.monotonic if clock is None else clock.monotonic
        self.config = config
        self.callbacks = callbacks or Callbacks()
        self.faults = faults or _degrade.FaultTracker()
        self.concurrency = concurrency or config.concurrency
        #: A task queue that delivers committed emails instead of this process's
        #: dispatcher (``OUTBOX_EXECUTOR``; see ``_executor``); None: the dispatcher.
        self.executor = executor
        self.engine = create_engine(url)
        self.store = (Store(self.engine) if clock is None
                      else Store(self.engine, clock=clock.now, clock_in_sql=True))
        #: The read API (counts, lists, one email, figures): no worker needed.
        self.reader = Reader(self.store)
        #: The suppression list, and the delivery events (which add to it).
        self.suppressions = Suppressions(self.store)
        self.events = EventLog(self.store, self.suppressions,
                               soft_bounces=config.soft_bounces)
        #: What this process releases when it stops (see :meth:`stop`).
        self.releases = Releases(self.store, self.config)
        self._transports = dict(transports) if transports is not None else None
        self._delivery: Delivery | None = None
        self._worker: Worker | None = None
        self.listener: Listener | None = None
        self._lock = threading.RLock()
        self._mode_cache: tuple[Mode, float] | None = None
        #: Commits hand nothing over: committed rows wait, queued, for a hand-ticked
        #: worker's :meth:`Worker.drain` (``flask_mail_outbox.testing``'s manual mode).
        self.manual = False
        #: The last sweep report this process stored was a periodic one that
        #: found nothing: the next such one need not be stored (see run_sweep).
        self.quiet_sweep_stored = False

    # -- what delivers, built on first need ---------------------------------------------

    @property
    def transports(self) -> dict[str, Transport]:
        """Every transport by name, "default" first (a failover chain is one transport)."""
        with self._lock:
            if self._transports is None:
                self._transports = build_transports(self.config, concurrency=self.concurrency)
            return self._transports

    @property
    def synchronous(self) -> bool:
        """Every transport keeps messages in memory: deliver in the committing thread."""
        return all(isinstance(t, MemoryTransport) for t in self.transports.values())

    @property
    def delivery(self) -> Delivery:
        """Claimed rows to recorded outcomes."""
        with self._lock:
            if self._delivery is None:
                self._delivery = Delivery(config=self.config, store=self.store,
                                          transports=self.transports, faults=self.faults,
                                          callbacks=self.callbacks, events=self.events,
                                          releases=self.releases)
            return self._delivery

    @property
    def worker(self) -> Worker:
        """This process's delivery loop."""
        with self._lock:
            if self._worker is None:
                if self.clock is None:
                    self._worker = Worker(self.delivery, self.config)
                else:
                    self._worker = Worker(self.delivery, self.config,
                                          clock=self.clock.monotonic, wall=self.clock.wall)
                    self.clock.on_advance(self._worker.nudge)
            return self._worker

    @property
    def has_worker(self) -> bool:
        """Whether this process built its worker (without building it)."""
        return self._worker is not None

    @property
    def dispatcher(self) -> Worker | None:
        """The worker when it claims due rows too (durable mode); else None."""
        worker = self._worker
        return worker if worker is not None and worker.dispatching else None

    # -- the mode ----------------------------------------------------------------------

    def mode(self) -> Mode:
        """The delivery mode in force: the shared setting, or ``config.durable`` without one.

        Read lazily and cached for ``settings_ttl_seconds``, so an idle process
        never asks.
        """
        cached = self._mode_cache
        now = self._monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        stored = self.reader.setting(DURABLE_SETTING)
        durable = self.config.durable if stored is None else bool(stored)
        mode = Mode.DURABLE if durable else Mode.INLINE
        self._mode_cache = (mode, now + self.config.settings_ttl_seconds)
        return mode

    def set_mode(self, mode: Mode) -> None:
        """Store ``mode`` for every process sharing the database (commits its own work)."""
        self.store.admin.set_setting(DURABLE_SETTING, mode is Mode.DURABLE)
        self._mode_cache = (mode, self._monotonic() + self.config.settings_ttl_seconds)
        if mode is Mode.DURABLE and self.config.run_worker and self.executor is None:
            self.dispatch()

    def deliver_soon(self, ids: Sequence[int], *, urgent: Collection[int] = (),
                     scheduled: Sequence[int] = ()) -> None:
        """Start delivering committed rows: ``ids`` are due now, ``scheduled`` later.

        Memory transports deliver due ones before this returns, through the same
        worker (a test sees its messages as soon as ``commit()`` returns); inline mode hands them to this process's worker (``urgent``
        ones before what waits); durable mode wakes this process's dispatcher
        when it runs one (``run_worker``), and otherwise leaves them to the
        dispatchers the commit's NOTIFY wakes. The worker that delivers here
        also times the ``scheduled`` ones (``send_after``) and claims each when
        it is due (see :meth:`Worker.schedule`); without one, a dispatcher's
        claim or a sweep takes them. With an :attr:`executor` (a task queue),
        the due ones are published to it, in either mode, and the scheduled
        ones wait for its sweep task. Raises on a database error; the rows are
        safe in the database either way. :attr:`manual`: none of this.
        """
        if self.manual:
            return
        if self.executor is not None and not self.config.suppress_send:
            self.publish(ids, urgent=urgent)
        elif self.synchronous:
            if ids:
                self.worker.deliver(ids, timeout=3600.0)
            self.worker.schedule(scheduled)
        elif self.mode() is Mode.INLINE:
            self.worker.hand(ids, urgent=urgent)
            self.worker.schedule(scheduled)
        elif self.config.run_worker or self.dispatcher is not None:
            self.dispatch()  # wakes it: it claims them with whatever else is due
            self.worker.schedule(scheduled)

    def publish(self, ids: Sequence[int], *, urgent: Collection[int] = (),
                why: str = "after commit") -> int:
        """Publish ``ids`` to the :attr:`executor`; how many it took (never raises).

        What the broker refused stays queued for the sweep task (one ERROR says so).
        """
        if self.executor is None:
            raise RuntimeError("Outbox.publish(): this outbox has no executor (OUTBOX_EXECUTOR)")
        return publish(self.executor, ids, urgent=set(urgent),
                       batch_size=self.config.batch_size, faults=self.faults, why=why)

    def dispatch(self, *, hand_ticked: bool = False) -> Worker:
        """Make this process's worker a dispatcher (and LISTEN on PostgreSQL), once.

        ``hand_ticked``: its loop runs in the caller's thread (``flask outbox
        worker``), or is ticked by hand: no thread of its own.
        """
        with self._lock:
            worker = self.worker
            if hand_ticked:
                worker.hand_ticked = True
            if not worker.dispatching and self.config.listen and self.store.dialect.listens:
                def on_state(up: bool) -> None:
                    worker.listening = up

                self.listener = Listener(libpq_url(self.config.listen_url or self.engine.url),
                                         worker.wake, on_state, self.faults,
                                         on_rate=worker.lanes.learned_elsewhere)
                self.listener.start()
        worker.dispatch()
        return worker

    # -- stopping ----------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing in flight or due in this process's worker (True without one)."""
        worker = self._worker
        return worker is None or worker.idle()

    def stop(self, timeout: float, *, serving: bool = False) -> None:
        """Stop delivering: no new claims; sends in flight get ``timeout`` seconds.

        What this process releases is marked for the next sweep of any
        process, and logged at INFO (``serving``: also when nothing was
        released, a line worth having where the app is served).
        """
        self.releases.stop()
        if self.listener is not None:
            self.listener.stop()
        worker = self._worker
        in_flight = 0
        if worker is not None:
            worker.stop(timeout)
            in_flight = worker.in_flight() if worker.running else 0
        self.releases.mark(in_flight=in_flight,
                           ran=serving or (worker is not None and worker.started))
        if in_flight:
            # Messages are still being sent past the timeout: let them finish and
            # record their outcomes in the worker's daemon thread; closing the
            # transport or the engine under it would leave their rows sending.
            return
        for transport in {id(t): t for t in (self._transports or {}).values()}.values():
            transport.close()
        self.engine.dispose()

    def forget_parent(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them."""
        self.engine.dispose(close=False)


__all__ = ["DEFAULT_TRANSPORT", "DURABLE_SETTING", "Mode", "Outbox", "build_transports"]
