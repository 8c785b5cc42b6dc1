"""What one process runs for an app: engine, transport, the worker, and when to start them.

Per-app state lives in ``app.extensions["mail_outbox"]`` (an :class:`_AppState`).
What runs threads or holds connections (engine, transport, the delivery
:class:`~._worker.Worker`, the LISTEN thread, the sweep jobs) is the
:class:`_Runtime`, created lazily on first use in each process and re-created
after a fork. :meth:`_AppState.deliver_soon` is the one place the delivery
mode is decided.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import click
import sqlalchemy as sa
from flask import Flask, current_app
from sqlalchemy import event

from . import _degrade, _ordering, _queries, _staging
from ._config import BUILTIN_TRANSPORTS, OutboxConfig
from ._delivery import Delivery
from ._errors import ConfigError
from ._insert import email_connection, email_dialect
from ._listen import Listener, libpq_url, notify_statement
from ._scheduler import SweepScheduler
from ._signals import email_queued
from ._transport_specs import DEFAULT as DEFAULT_TRANSPORT
from ._transport_specs import TransportSpec
from ._worker import Worker
from .transports import (
    ConsoleTransport,
    FailoverTransport,
    FileTransport,
    MemoryTransport,
    NullTransport,
    SMTPTransport,
    Transport,
)

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

    from ._extension import OutboxMail

logger = logging.getLogger(__name__)


def _build_transport(config: OutboxConfig, spec: TransportSpec, *,
                     concurrency: int) -> Transport:
    """One named transport, with the settings of its OUTBOX_TRANSPORTS entry."""
    if spec.name != DEFAULT_TRANSPORT or spec.smtp is not config.smtp:
        config = dataclasses.replace(config, smtp=spec.smtp, transport=spec.kind)
    name = spec.kind
    if name == "smtp":
        return SMTPTransport(config, concurrency=spec.concurrency or concurrency)
    builtin: dict[str, type[Transport]] = {
        "console": ConsoleTransport, "file": FileTransport,
        "memory": MemoryTransport, "null": NullTransport,
    }
    if name in BUILTIN_TRANSPORTS:
        return builtin[name](config)
    import importlib

    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    transport = cls(config)
    if not isinstance(transport, Transport):
        raise ConfigError("OUTBOX_TRANSPORT",
                          f"{name!r} must subclass flask_mail_outbox.transports.Transport")
    return transport


def build_transports(config: OutboxConfig, *, concurrency: int) -> dict[str, Transport]:
    """Every named transport, "default" first; one with a ``failover`` list is wrapped.

    With ``MAIL_SUPPRESS_SEND`` (``TESTING``) every name is one memory transport.
    """
    if config.suppress_send:
        memory = MemoryTransport(config)
        return dict.fromkeys(config.transport_names, memory)
    own = {spec.name: _build_transport(config, spec, concurrency=concurrency)
           for spec in config.transport_specs}
    return {spec.name: FailoverTransport([(name, own[name]) for name in
                                          (spec.name, *spec.failover)])
            if spec.failover else own[spec.name]
            for spec in config.transport_specs}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        # The busy timeout makes writers queue for the lock instead of failing.
        cursor.execute("PRAGMA busy_timeout=30000")
        ensure_wal(cursor)
    finally:
        cursor.close()


def ensure_wal(cursor: Any) -> None:
    """Switch a SQLite database to WAL (persistent, per file) unless it already is.

    WAL lets request threads read and commit while the delivery thread
    writes; in the default rollback-journal mode readers block the writer.
    """
    if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
    except Exception as exc:  # noqa: BLE001 - reported; SQLite still works, only slower
        _degrade.report(
            "Could not switch the SQLite database to WAL journal mode",
            consequence="request threads and the delivery thread block each other more, "
                        "and concurrent commits may wait up to the busy timeout",
            fix="run `PRAGMA journal_mode=WAL` on the database once while nothing else uses it",
            exc=exc)


class _Runtime:
    """What one process runs for one app: engine, transport, the worker, LISTEN."""

    def __init__(self, state: _AppState) -> None:
        self.pid = os.getpid()
        self.state = state
        app, config = state.app, state.config
        with app.app_context():
            url = state.db.engine.url
        if url.get_backend_name() == "sqlite":
            self.engine = sa.create_engine(url, connect_args={"timeout": 30,
                                                               "check_same_thread": False})
            event.listen(self.engine, "connect", _sqlite_pragmas)
        else:
            self.engine = sa.create_engine(url, pool_size=4, max_overflow=8, pool_pre_ping=True)
        from ._store import Store

        self.store = Store(self.engine)
        self.transports = build_transports(config, concurrency=state.concurrency)
        #: The default transport (``MAIL_*`` / ``OUTBOX_TRANSPORT``).
        self.transport = self.transports[DEFAULT_TRANSPORT]
        self.synchronous = all(isinstance(t, MemoryTransport) for t in self.transports.values())
        self.delivery = Delivery(app=app, config=config, store=self.store,
                                 transports=self.transports, faults=state.faults)
        self.worker = Worker(self.delivery, config)
        self.listener: Listener | None = None
        self._lock = threading.Lock()

    def dispatch(self, *, hand_ticked: bool = False) -> Worker:
        """Make this process's worker a dispatcher (and start LISTEN on PostgreSQL), once.

        ``hand_ticked``: its loop runs in the caller's thread (``flask outbox
        worker``), or is ticked by hand: no thread of its own.
        """
        with self._lock:
            worker = self.worker
            if hand_ticked:
                worker.hand_ticked = True
            if not worker.dispatching:
                config = self.state.config
                if config.listen and self.store.is_postgres:
                    def on_state(up: bool) -> None:
                        worker.listening = up

                    self.listener = Listener(
                        libpq_url(config.listen_url or self.engine.url), worker.wake,
                        on_state, self.state.faults)
                    self.listener.start()
        worker.dispatch()
        return worker

    @property
    def dispatcher(self) -> Worker | None:
        """The worker, when it claims due rows too (durable mode); else None."""
        return self.worker if self.worker.dispatching else None

    def idle(self) -> bool:
        return self.worker.idle()

    def stop(self, timeout: float) -> None:
        self.delivery.stopping = True
        if self.listener is not None:
            self.listener.stop()
        self.worker.stop(timeout)
        in_flight = self.worker.in_flight() if self.worker.running else 0
        self._mark_given_back(in_flight=in_flight)
        if in_flight:
            # Messages are still being sent past the timeout: let them finish and
            # record their outcomes in the worker's daemon thread; closing the
            # transport or the engine under it would leave their rows sending.
            return
        for transport in {id(t): t for t in self.transports.values()}.values():
            transport.close()
        self.engine.dispose()

    def _mark_given_back(self, *, in_flight: int) -> None:
        """Mark what this process gave back for the next sweep, and say what happens next.

        Those rows are queued and provably in flight nowhere (this process
        held them and lets go), so any process's next sweep takes them at once
        instead of after OUTBOX_SWEEP_MIN_AGE_SECONDS.
        """
        config = self.state.config
        ids = self.delivery.take_given_back()
        pid = os.getpid()
        still = (f"; {in_flight} email(s) still being sent finish in the background, or, if "
                 f"this process exits first, stay sending until their lease expires "
                 f"(OUTBOX_LEASE_SECONDS, {config.lease_seconds:g} s) and a sweep takes them"
                 if in_flight else "")
        if not ids:
            # INFO where the app is served or delivery threads ran (a clean stop
            # is worth a line); a command that only read or swept stays quiet.
            ran = self.state.serving or self.worker.started
            logger.log(logging.INFO if ran or in_flight else logging.DEBUG,
                       "Outbox delivery stopped (pid %d): nothing given back%s", pid,
                       still or ", nothing in flight")
            return
        marked = self.delivery.mark_given_back(ids, when="at stop")
        if marked is None:
            return
        interval = config.sweep_interval_for(False)
        logger.info(
            "Outbox delivery stopped (pid %d): gave back %d unsent email(s) %s, queued and "
            "marked so the next sweep of any process takes them whatever their age (the "
            "startup sweep of the next start, or a running process's periodic sweep%s)%s",
            pid, marked, ids[:20], f" within {interval:g} s" if interval else "", still)


#: The key of an app's :class:`_AppState` in ``app.extensions``.
EXTENSION_KEY = "mail_outbox"


def app_state() -> _AppState:
    """The outbox state of the current app: the one way in.

    :class:`~._extension.OutboxMail`, the CLI and the dashboard reach the
    runtime (store, worker, transport) only through this.
    """
    state: _AppState | None = current_app.extensions.get(EXTENSION_KEY)
    if state is None:
        raise RuntimeError("flask-mail-outbox is not registered on the current app; call "
                           "OutboxMail(app) or mail.init_app(app) first.")
    return state


class _AppState:
    """Per-app state, in ``app.extensions["mail_outbox"]``."""

    def __init__(self, ext: OutboxMail, app: Flask, db: SQLAlchemy, config: OutboxConfig) -> None:
        self.ext = ext
        self.app = app
        self.db = db
        self.config = config
        self.faults = _degrade.FaultTracker()
        #: SMTP connections of this process's stream: OUTBOX_CONCURRENCY, or
        #: `flask outbox worker --concurrency` before the runtime starts.
        self.concurrency = config.concurrency
        self._runtime: _Runtime | None = None
        self._lock = threading.Lock()
        self._durable_cache: tuple[bool, float] | None = None
        self.scheduler: SweepScheduler | None = None
        #: This app is served by this process or by workers forked from it: the
        #: background jobs start in the process that serves (ensure_started()).
        self.serving = False
        #: What this process's workers share when a master forked them (see
        #: _deployment_of_worker); None for a process that is no such worker.
        self.deployment: str | None = None
        #: The last sweep report this process stored was a periodic one that
        #: found nothing: the next such one need not be stored (see run_sweep).
        self.quiet_sweep_stored = False

    def runtime(self) -> _Runtime:
        """This process's runtime, created on first use and after a fork."""
        with self._lock:
            runtime = self._runtime
            if runtime is None or runtime.pid != os.getpid():
                if runtime is not None:
                    # Inherited from the parent: drop its pooled connections
                    # without closing them under the parent's feet.
                    runtime.engine.dispose(close=False)
                runtime = self._runtime = _Runtime(self)
            return runtime

    def current_runtime(self) -> _Runtime | None:
        """The runtime if this process has one (never creates it)."""
        runtime = self._runtime
        return runtime if runtime is not None and runtime.pid == os.getpid() else None

    # -- the delivery mode ------------------------------------------------------------

    def durable(self) -> bool:
        """The delivery mode in force, read lazily and cached for the settings TTL.

        An idle process never asks: this runs only when something needs it.
        """
        cached = self._durable_cache
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        with self.runtime().store.read() as conn:
            stored = _queries.get_setting(conn, DURABLE_SETTING)
        value = self.config.durable if stored is None else bool(stored)
        self._durable_cache = (value, now + self.config.settings_ttl_seconds)
        return value

    def set_durable(self, on: bool) -> None:
        """Store the mode for every process sharing the database (commits its own work)."""
        self.runtime().store.set_setting(DURABLE_SETTING, bool(on))
        self._durable_cache = (bool(on), time.monotonic() + self.config.settings_ttl_seconds)

    def prepare_commit(self, session: Any, entries: list[_staging.StagedEmail]) -> None:
        """Inside the outermost transaction that queued email, just before its commit.

        Hands on the keys whose new emails found an earlier one open (see
        :mod:`._ordering`), and sends one NOTIFY (durable mode, PostgreSQL)
        unless the inserts did: PostgreSQL delivers it only if the transaction
        commits, so listeners in other processes never wake for a rollback.
        """
        keys = {e.waits_on_key for e in entries if e.waits_on_key is not None}
        if keys:
            _ordering.advance(email_connection(session), keys)
        if any(not e.notified for e in entries) and self.config.listen \
                and _is_postgres(session) and self.durable():
            session.execute(notify_statement())

    def publish(self, entries: list[_staging.StagedEmail]) -> None:
        """Called after the outermost commit with the rows it made durable."""
        if email_queued.receivers:
            for entry in entries:
                try:
                    email_queued.send(self.app, email_id=entry.email_id)
                except Exception:
                    logger.exception("A receiver of the email_queued signal raised (email "
                                     "%s); delivery goes on", entry.email_id)
        self.ensure_started()
        self.deliver_soon([e.email_id for e in entries if e.due_now],
                          urgent={e.email_id for e in entries if e.urgent})

    def deliver_soon(self, ids: Sequence[int], *, urgent: Collection[int] = ()) -> None:
        """Start delivering committed rows that are due now: the one place the mode decides.

        The memory transport delivers them here and now (a test sees its
        messages as soon as ``commit()`` returns); inline mode hands them to
        this process's worker (``urgent`` ones before what waits); durable
        mode wakes this process's dispatcher when it runs one
        (``OUTBOX_RUN_WORKER``), and otherwise leaves them to the dispatchers
        the commit's NOTIFY wakes (their claim takes high priority first).
        Never raises: the commit succeeded, and the rows are safe in the database.
        """
        try:
            runtime = self.runtime()
            if runtime.synchronous:
                if ids:
                    with self.app.app_context():
                        runtime.delivery.deliver_now(ids)
            elif not self.durable():
                runtime.worker.hand(ids, urgent=urgent)
            elif self.config.run_worker or runtime.worker.dispatching:
                runtime.dispatch()  # wakes it: it claims them with whatever else is due
        except Exception as exc:  # noqa: BLE001 - the commit succeeded; never fail it now
            _degrade.report(
                f"Could not hand {len(ids)} committed email(s) {list(ids)[:20]} to delivery",
                consequence="they stay queued in the database; the periodic sweep takes them "
                            "after OUTBOX_SWEEP_MIN_AGE_SECONDS",
                fix="check the database connection and the transport configuration; "
                    "`flask outbox sweep` delivers them once fixed",
                exc=exc)

    def start_scheduler(self, *, start_dispatcher: bool = True) -> SweepScheduler:
        """Start this process's sweep jobs (once per process, again after a fork).

        ``start_dispatcher``: also start the dispatcher at once in durable mode
        (``flask outbox worker`` runs its own in the foreground).
        """
        with self._lock:
            scheduler = self.scheduler
            if scheduler is None or scheduler.pid != os.getpid():
                self.deployment = _deployment_of_worker()
                scheduler = self.scheduler = SweepScheduler(
                    self, start_dispatcher=start_dispatcher)
                scheduler.start()
            return scheduler

    def ensure_started(self) -> None:
        """In a serving process, start the background jobs on first use (cheap after that).

        Called by the first request, the first commit that queues email and
        ``wait_sweep()``: a process that only imports the app and forks
        workers (gunicorn's master with ``--preload``, uWSGI's master) never
        gets here, so it runs no scheduler, dispatcher or SMTP connection.
        """
        scheduler = self.scheduler
        if not self.serving or (scheduler is not None and scheduler.pid == os.getpid()):
            return
        try:
            self.start_scheduler()
        except Exception:  # delivery after commit goes on without the jobs
            logger.exception("Could not start the outbox sweep jobs in pid %d; sweeps and the "
                             "start-up dispatcher do not run in this process", os.getpid())

    def stop(self, timeout: float) -> None:
        with self._lock:
            runtime, self._runtime = self.current_runtime(), None
            scheduler = self.scheduler
            if scheduler is not None and scheduler.pid == os.getpid():
                self.scheduler = None
            else:
                scheduler = None
        if scheduler is not None:
            scheduler.stop()
        if runtime is not None:
            runtime.stop(timeout)


DURABLE_SETTING = "durable"

_all_states: weakref.WeakSet[_AppState] = weakref.WeakSet()
_hooks_installed = False


def install_process_hooks() -> None:
    """Once per process: stop every app's delivery at exit, restart its jobs after a fork."""
    global _hooks_installed
    if not _hooks_installed:
        atexit.register(_stop_all)
        os.register_at_fork(after_in_child=_restart_schedulers_in_child)
        _hooks_installed = True


def serving_process(app: Flask) -> bool:
    """Whether this process serves the app (so the sweep jobs belong in it).

    A WSGI server imports the app outside any click command; `flask run`
    serves (but not the reloader's parent process, which only watches
    files); other commands such as `flask db upgrade` do not (`flask outbox
    worker` starts the jobs itself).
    """
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return True
    if ctx.command.name != "run":
        return False
    reload = ctx.params.get("reload")
    if reload is None:
        reload = bool(app.debug)
    return not reload or os.environ.get("WERKZEUG_RUN_MAIN") == "true"


def start_at_once(app: Flask) -> bool:
    """Whether a serving process starts its background jobs in init_app.

    `flask run` serves in this process, and so does a worker forked by a
    master running the same command (gunicorn or uWSGI without preloading,
    the reloader's child). Any other process (a WSGI server's master
    importing the app before it forks, a single-process server, a script)
    starts them on first use instead: first request, first commit, or
    after a fork in the child.
    """
    ctx = click.get_current_context(silent=True)
    return (ctx is not None and ctx.command.name == "run") or _deployment_of_worker() is not None


def _deployment_of_worker() -> str | None:
    """``host:master pid:master start`` when a master running this same command forked
    this process (a gunicorn or uWSGI worker); None otherwise, or where ``/proc`` is missing.

    Workers of one deployment share it, a restarted master gives a new one.
    """
    ppid = os.getppid()
    try:
        with open("/proc/self/cmdline", "rb") as own_file:
            own = own_file.read()
        with open(f"/proc/{ppid}/cmdline", "rb") as parent_file:
            parent = parent_file.read()
        with open(f"/proc/{ppid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    if not own or own != parent:
        return None
    # Field 22, the start time; fields are counted after the ")" that ends the name.
    started = stat.rsplit(b")", 1)[-1].split()[19].decode()
    return f"{socket.gethostname()}:{ppid}:{started}"


def _restart_schedulers_in_child() -> None:
    # Only the forking thread survives: a lock another thread held at the
    # fork would stay locked forever, so each state gets a fresh one. The
    # parent's scheduler thread is gone too. A serving app starts its jobs
    # in the child: a master that forks workers (gunicorn --preload) is
    # where the app was imported, the child is where it is served.
    for state in list(_all_states):
        state._lock = threading.Lock()
        if state.scheduler is not None or state.serving:
            state.scheduler = None
            try:
                state.start_scheduler()
            except Exception:
                logger.exception("Could not start the outbox sweep jobs in a forked process")


def _stop_all() -> None:
    for state in list(_all_states):
        try:
            state.stop(timeout=10)
        except Exception:
            logger.exception("Stopping outbox delivery at exit failed")


def _is_postgres(session: Any) -> bool:
    return email_dialect(session) == "postgresql"


