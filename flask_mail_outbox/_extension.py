"""The Flask extension: ``OutboxMail``.

Per-app state lives in ``app.extensions["mail_outbox"]`` (an :class:`_AppState`);
the extension object itself keeps no app, so one ``OutboxMail`` can serve
several apps. What runs threads or holds connections (engine, transport,
delivery worker) is the :class:`_Runtime`, created lazily on first use in each
process and re-created after a fork.
"""

from __future__ import annotations

import atexit
import difflib
import ipaddress
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
import sqlalchemy as sa
from flask import Flask, Response, current_app, got_request_exception
from sqlalchemy import event

from . import _degrade, _health, _ordering, _queries, _staging
from ._config import _DEFAULTS, BUILTIN_TRANSPORTS, OutboxConfig, load_config
from ._delivery import DeliveredMessage, DeliveryRoute, InlineDelivery
from ._dispatcher import Dispatcher
from ._errors import ConfigError, InvalidMessage
from ._listen import Listener, libpq_url, notify_statement
from ._message import Message, prepare_message
from ._models import Status, email_table, metadata
from ._scheduler import SweepScheduler
from ._signals import email_queued, email_sent
from ._store import Store, email_dialect, insert_email, utcnow
from ._sweep import SweepReport, load_last_report, run_sweep
from .transports import (
    ConsoleTransport,
    FileTransport,
    MemoryTransport,
    NullTransport,
    SMTPTransport,
    Transport,
)

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

logger = logging.getLogger(__name__)

EXTENSION_KEY = "mail_outbox"
# One table of keys: the defaults in _config (a key added there is known here).
_KNOWN_OUTBOX_KEYS = frozenset(key for key in _DEFAULTS if key.startswith("OUTBOX_"))
_MAX_KEY_LENGTH = 255


def _check_unknown_keys(config: Any) -> None:
    for key in config:
        if key.startswith("OUTBOX_") and key not in _KNOWN_OUTBOX_KEYS:
            close = difflib.get_close_matches(key, _KNOWN_OUTBOX_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(key, f"is not a flask-mail-outbox setting{hint}")


def _warn_plaintext_login(config: OutboxConfig) -> None:
    """Warn when the SMTP login would cross the network unencrypted.

    Flask-Mail logs in whatever the connection, and so does the outbox (a
    relay on the same host is a fair setup); to another host the password
    travels in clear unless ``MAIL_USE_TLS`` or ``MAIL_USE_SSL`` is on.
    """
    s = config.smtp
    if (config.transport != "smtp" or config.suppress_send or not s.username
            or s.use_tls or s.use_ssl or _is_loopback(s.host)):
        return
    logger.warning(
        "MAIL_USERNAME is set but neither MAIL_USE_TLS nor MAIL_USE_SSL is: the SMTP "
        "login to %s:%s will send the password unencrypted. Set MAIL_USE_TLS=True "
        "(STARTTLS) or MAIL_USE_SSL=True.", s.host, s.port)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse_memory_sqlite(uri: Any) -> None:
    if not isinstance(uri, (str, sa.URL)):
        return
    url = sa.make_url(uri)
    if url.get_backend_name() != "sqlite":
        return
    database = url.database or ""
    if database in ("", ":memory:") or url.query.get("mode") == "memory" or \
            database.startswith("file::memory:"):
        raise ConfigError(
            "SQLALCHEMY_DATABASE_URI",
            f"{url.render_as_string()!r} is an in-memory SQLite database; the request and "
            "the delivery thread would share one connection and one transaction. Use a file, "
            "e.g. 'sqlite:///app.db' (tests: a file under tmp_path)")


def _build_transport(config: OutboxConfig, *, concurrency: int) -> Transport:
    if config.suppress_send:
        return MemoryTransport(config)
    name = config.transport
    if name == "smtp":
        return SMTPTransport(config, concurrency=concurrency)
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


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    try:
        # The busy timeout makes writers queue for the lock instead of failing.
        cursor.execute("PRAGMA busy_timeout=30000")
        _ensure_wal(cursor)
    finally:
        cursor.close()


def _ensure_wal(cursor: Any) -> None:
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


def _prepare_sqlite(app: Flask, db: SQLAlchemy) -> None:
    """Put the app's SQLite database in WAL mode at start, before any writer."""
    with app.app_context():
        engine = db.engine
        if engine.dialect.name != "sqlite":
            return
        with engine.connect() as conn:
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                _ensure_wal(cursor)
            finally:
                cursor.close()


class _Runtime:
    """What one process runs for one app: engine, transport, delivery threads."""

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
        self.store = Store(self.engine)
        self.transport = _build_transport(config, concurrency=state.concurrency)
        self.synchronous = isinstance(self.transport, MemoryTransport)
        self.route = DeliveryRoute(app=app, config=config, store=self.store,
                                   transport=self.transport, faults=state.faults)
        self.inline = InlineDelivery(self.route, config)
        self.dispatcher: Dispatcher | None = None
        self.listener: Listener | None = None
        self._lock = threading.Lock()

    def ensure_dispatcher(self, *, start_thread: bool = True) -> Dispatcher:
        """This process's dispatcher (and LISTEN thread on PostgreSQL), started once."""
        with self._lock:
            if self.dispatcher is None:
                self.dispatcher = Dispatcher(self.route, self.state.config)
                config = self.state.config
                if config.listen and self.store.is_postgres:
                    dispatcher = self.dispatcher

                    def on_state(up: bool) -> None:
                        dispatcher.listening = up

                    self.listener = Listener(
                        libpq_url(config.listen_url or self.engine.url), dispatcher.wake,
                        on_state, self.state.faults)
                    self.listener.start()
            if start_thread:
                self.dispatcher.start()
            return self.dispatcher

    def idle(self) -> bool:
        dispatcher = self.dispatcher
        return self.inline.idle() and (dispatcher is None or not dispatcher.running
                                       or dispatcher.idle())

    def stop(self, timeout: float) -> None:
        self.route.stopping = True
        if self.dispatcher is not None:
            self.dispatcher.stop(timeout)
        if self.listener is not None:
            self.listener.stop()
        self.inline.stop(timeout)
        if self.dispatcher is not None and not self.dispatcher.running:
            # Ticked by hand (`worker --once`, tests): give back what it holds.
            try:
                self.dispatcher.release_held()
            finally:
                self.dispatcher.close_connection()
        in_flight = self.inline.alive() or (self.dispatcher is not None
                                            and self.dispatcher.running)
        self._mark_given_back(in_flight=len(self.route.in_flight()) if in_flight else 0)
        if in_flight:
            # A batch is still being sent past the timeout: let it finish and
            # record its outcomes in its daemon thread; closing the transport or
            # the engine under it would leave its rows sending.
            return
        self.transport.close()
        self.engine.dispose()

    def _mark_given_back(self, *, in_flight: int) -> None:
        """Mark what this process gave back for the next sweep, and say what happens next.

        Those rows are queued and provably in flight nowhere (this process
        held them and lets go), so any process's next sweep takes them at once
        instead of after OUTBOX_SWEEP_MIN_AGE_SECONDS.
        """
        config = self.state.config
        ids = self.route.take_given_back()
        pid = os.getpid()
        still = (f"; {in_flight} email(s) still being sent finish in the background, or, if "
                 f"this process exits first, stay sending until their lease expires "
                 f"(OUTBOX_LEASE_SECONDS, {config.lease_seconds:g} s) and a sweep takes them"
                 if in_flight else "")
        if not ids:
            # INFO where the app is served or delivery threads ran (a clean stop
            # is worth a line); a command that only read or swept stays quiet.
            ran = self.state.serving or self.inline.started or self.dispatcher is not None
            logger.log(logging.INFO if ran or in_flight else logging.DEBUG,
                       "Outbox delivery stopped (pid %d): nothing given back%s", pid,
                       still or ", nothing in flight")
            return
        marked = self.route.mark_given_back(ids, when="at stop")
        if marked is None:
            return
        interval = config.sweep_interval_for(False)
        logger.info(
            "Outbox delivery stopped (pid %d): gave back %d unsent email(s) %s, queued and "
            "marked so the next sweep of any process takes them whatever their age (the "
            "startup sweep of the next start, or a running process's periodic sweep%s)%s",
            pid, marked, ids[:20], f" within {interval:g} s" if interval else "", still)


class _AppState:
    """Per-app state, in ``app.extensions["mail_outbox"]``."""

    def __init__(self, ext: OutboxMail, app: Flask, db: SQLAlchemy, config: OutboxConfig) -> None:
        self.ext = ext
        self.app = app
        self.db = db
        self.config = config
        self.faults = _degrade.FaultTracker()
        self.concurrency = 4  # concurrent SMTP connections; `flask outbox worker` sets it
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
            _ordering.advance(session.connection(bind_arguments={"clause": email_table.insert()}),
                              keys)
        if any(not e.notified for e in entries) and self.config.listen \
                and _is_postgres(session) and self.durable():
            session.execute(notify_statement())

    def publish(self, entries: list[_staging.StagedEmail]) -> None:
        """Called after the outermost commit with the rows it made durable."""
        ids = [e.email_id for e in entries]
        if email_queued.receivers:
            for email_id in ids:
                try:
                    email_queued.send(self.app, email_id=email_id)
                except Exception:
                    logger.exception("A receiver of the email_queued signal raised (email "
                                     "%s); delivery goes on", email_id)
        due = [e.email_id for e in entries if e.due_now]
        self.ensure_started()
        try:
            runtime = self.runtime()
            if runtime.synchronous:
                # The memory transport delivers inside commit(), so a test sees
                # its messages as soon as commit() returns.
                if due:
                    with self.app.app_context():
                        runtime.route.deliver_ids(due)
            elif self.durable():
                if self.config.run_worker:
                    runtime.ensure_dispatcher().wake()
                elif runtime.dispatcher is not None:
                    runtime.dispatcher.wake()
            elif due:
                runtime.inline.submit(due)
        except Exception as exc:  # noqa: BLE001 - the commit succeeded; never fail it now
            _degrade.report(
                f"Could not hand {len(due)} committed email(s) {due[:20]} to delivery",
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
_atexit_registered = False


def _serving_process(app: Flask) -> bool:
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


def _start_at_once(app: Flask) -> bool:
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


class OutboxMail:
    """Transactional email for Flask.

    ``mail.send(msg)`` adds the email to ``db.session`` as a ``queued`` row in
    the caller's transaction; it is delivered in the background after the
    outermost commit, and a rollback sends nothing.
    """

    def __init__(self, app: Flask | None = None, db: SQLAlchemy | None = None) -> None:
        self._db = db
        if app is not None:
            self.init_app(app, db)

    def init_app(self, app: Flask, db: SQLAlchemy | None = None) -> None:
        """Register with ``app``: read and check the configuration, hook the session."""
        global _atexit_registered
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError(
                "A flask-mail-outbox extension is already registered on this app. "
                "Create one OutboxMail per app and call init_app(app) once "
                "(use the existing app.extensions['mail_outbox'].ext).")
        db = db or self._db or app.extensions.get("sqlalchemy")
        if db is None:
            raise RuntimeError(
                "flask-mail-outbox needs Flask-SQLAlchemy: create SQLAlchemy(app) (or call "
                "db.init_app(app)) before OutboxMail(app), or pass OutboxMail(app, db=db).")
        _refuse_memory_sqlite(app.config.get("SQLALCHEMY_DATABASE_URI"))
        _check_unknown_keys(app.config)
        config = load_config(app.config, instance_path=app.instance_path,
                             testing=bool(app.config.get("TESTING")))
        _warn_plaintext_login(config)
        state = _AppState(self, app, db, config)
        _prepare_sqlite(app, db)
        app.extensions[EXTENSION_KEY] = state
        _all_states.add(state)
        _staging.install(db.session)
        from .cli import outbox_cli

        # Also on app.cli (the entry point covers `flask ...`), so that
        # app.test_cli_runner() and custom CLIs see the commands.
        app.cli.add_command(outbox_cli)
        got_request_exception.connect(_request_failed, app, weak=False)
        app.teardown_request(_teardown_request)
        if not _atexit_registered:
            atexit.register(_stop_all)
            os.register_at_fork(after_in_child=_restart_schedulers_in_child)
            _atexit_registered = True
        if config.run_scheduler and _serving_process(app):
            state.serving = True
            app.before_request(state.ensure_started)
            if _start_at_once(app):
                state.start_scheduler()

    # -- state --------------------------------------------------------------------

    def _state(self) -> _AppState:
        try:
            state: _AppState = current_app.extensions[EXTENSION_KEY]
        except KeyError:
            raise RuntimeError(
                "flask-mail-outbox is not registered on the current app; call "
                "mail.init_app(app) first.") from None
        return state

    # -- sending ----------------------------------------------------------------------

    def send(self, msg: Message, *, key: str | None = None,
             send_after: datetime | timedelta | None = None,
             idempotency_key: str | None = None) -> int:
        """Queue ``msg`` in the current ``db.session`` transaction; return the row id.

        Validates first and raises :class:`InvalidMessage` (nothing written) on
        bad input. Does not commit: the email goes out after the caller's
        outermost commit, and a rollback discards it. With an
        ``idempotency_key`` already stored, returns that row's id and adds
        nothing.
        """
        state = self._state()
        config = state.config
        if not isinstance(msg, Message):
            raise InvalidMessage("msg", f"expected a flask_mail_outbox.Message, got "
                                        f"{type(msg).__name__}")
        _check_key("key", key)
        _check_key("idempotency_key", idempotency_key)
        due_at = _due_at(send_after)
        prepared = prepare_message(
            msg, default_sender=config.default_sender,
            allow_local_addresses=config.allow_local_addresses,
            max_message_bytes=config.max_message_bytes,
            message_id_domain=config.message_id_domain,
            ascii_attachments=config.ascii_attachments)
        values: dict[str, Any] = {
            "status": Status.QUEUED.value,
            "due_at": due_at,
            "message_id": prepared.message_id,
            "key": key,
            "idempotency_key": idempotency_key,
            "attempts": 0,
            "sender": prepared.sender,
            "recipients": json.dumps(list(prepared.recipients)),
            "subject": prepared.subject,
            "size": len(prepared.mime),
            "mime": prepared.mime,
            "smtp_options": _smtp_options(prepared.mail_options, prepared.rcpt_options),
        }
        attachments = [
            {"position": index, "filename": info.filename, "content_type": info.content_type,
             "size": info.size}
            for index, info in enumerate(prepared.attachments)
        ]
        session = state.db.session()
        dialect = email_dialect(session)
        # What prepare_commit() would NOTIFY at commit, the insert does itself.
        notify = state.config.listen and dialect == "postgresql" and state.durable()
        email_id, created, waits = insert_email(session, values, attachments, notify=notify,
                                                dialect=dialect, recipients=prepared.recipients)
        if created:
            _staging.stage(session, _staging.StagedEmail(
                email_id=email_id, due_now=due_at is None or due_at <= utcnow(),
                publisher=state, notified=notify, waits_on_key=key if waits else None))
        return email_id

    def send_message(self, **kwargs: Any) -> int:
        """``send(Message(**kwargs))``."""
        return self.send(Message(**kwargs))

    # -- lifecycle -------------------------------------------------------------------

    def create_all(self) -> None:
        """Create the outbox tables (development and tests; production uses migrations)."""
        state = self._state()
        metadata.create_all(state.db.engine)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until this process has no delivery in flight; True when idle.

        It does not wait for other processes.
        """
        runtime = self._state().current_runtime()
        if runtime is None:
            return True
        deadline = time.monotonic() + timeout
        if not runtime.inline.wait_idle(timeout):
            return False
        while not runtime.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, timeout: float = 10) -> None:
        """Stop this process's delivery threads for every app; idempotent.

        Sends in flight get ``timeout`` seconds to finish (after half of it,
        messages not yet handed to the server are given back). What this
        process gives back, or had been handed after a commit and never
        claimed, is ``queued`` and marked so the next sweep of any process
        takes it whatever its age; rows still being sent past the timeout
        stay ``sending`` until their lease expires and a sweep takes them.
        Logs at INFO what it gave back and what takes it.
        """
        for state in list(_all_states):
            if state.ext is self:
                state.stop(timeout)

    @property
    def durable(self) -> bool:
        """Whether durable delivery is in force (the shared runtime setting)."""
        return self._state().durable()

    def set_durable(self, on: bool) -> None:
        """Switch every process sharing the database to durable (True) or inline delivery.

        Commits its own work. Nothing is stranded either way: the claim is the
        single gate, and whichever mode is in force takes due rows.
        """
        if not isinstance(on, bool):
            raise TypeError(f"set_durable() takes True or False, got {on!r}")
        state = self._state()
        state.set_durable(on)
        if on and state.config.run_worker:
            state.runtime().ensure_dispatcher().wake()

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest dead-lettered (``failed``) emails, with their failure history."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        with self._state().runtime().store.read() as conn:
            return _queries.dead_letters(conn, limit)

    def retry(self, email_id: int) -> None:
        """Put a dead letter back: ``queued``, attempts reset to 0, due now (commits).

        Raises ``LookupError`` when ``email_id`` is not a dead-lettered email,
        ``TypeError`` when it is not an int.
        """
        if isinstance(email_id, bool) or not isinstance(email_id, int):
            raise TypeError(f"email_id must be an int, got {type(email_id).__name__}")
        if not 1 <= email_id < 2**63:  # ids are BIGINT: larger ones overflow the driver
            raise LookupError(f"email {email_id} is not a dead letter (no such id)")
        state = self._state()
        runtime = state.runtime()
        if not runtime.store.retry_failed(email_id):
            raise LookupError(f"email {email_id} is not a dead letter (no failed row with "
                              "that id)")
        self._deliver_retried([email_id])

    def retry_all(self) -> int:
        """Put every dead letter back at once (commits); how many went back.

        One set-based UPDATE however many there are (``retry()`` in a loop
        would be a transaction each), then delivery starts as for ``retry()``.
        In inline mode at most the inline queue's size is handed over at once;
        the sweep delivers the rest.
        """
        ids = self._state().runtime().store.retry_all_failed()
        self._deliver_retried(ids)
        return len(ids)

    def _deliver_retried(self, ids: list[int]) -> None:
        """Start delivering rows just put back, as after a ``send()`` commit."""
        state = self._state()
        runtime = state.runtime()
        if not ids:
            return
        if runtime.synchronous:
            with state.app.app_context():
                runtime.route.deliver_ids(ids)
        elif state.durable():
            if state.config.run_worker:
                runtime.ensure_dispatcher().wake()
        else:
            runtime.inline.submit(ids[:runtime.inline.max_pending])

    @contextmanager
    def record_messages(self) -> Iterator[list[DeliveredMessage]]:
        """Yield a list that fills with every message delivered meanwhile.

        Works with any transport; with the memory transport (``TESTING``)
        delivery happens inside ``commit()``, so messages are there as soon as
        ``commit()`` returns.
        """
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        outbox: list[DeliveredMessage] = []

        def record(sender: Flask, message: DeliveredMessage, **_: Any) -> None:
            outbox.append(message)

        with email_sent.connected_to(record, app):
            yield outbox

    def sweep(self, min_age: float | None = None, limit: int | None = None,
              dry_run: bool = False) -> SweepReport:
        """Run one sweep now, in this thread (see :class:`SweepReport`).

        ``min_age`` defaults to ``OUTBOX_SWEEP_MIN_AGE_SECONDS`` and ``limit``
        to ``OUTBOX_SWEEP_BATCH``. Commits its own work; database errors raise.
        """
        return run_sweep(self._state(), min_age=min_age, limit=limit, dry_run=dry_run)

    def wait_sweep(self, timeout: float) -> SweepReport | None:
        """Wait for this process's startup sweep; its report, or None (not run, failed)."""
        state = self._state()
        state.ensure_started()
        scheduler = state.scheduler
        if scheduler is None:
            return None
        scheduler.startup_done.wait(timeout)
        return scheduler.startup_report

    def dashboard_blueprint(self, authorize: Any, **options: Any) -> Any:
        """An operator dashboard as a Flask blueprint (opt-in; see the README).

        ``authorize`` is a callable with no arguments, called on every page and
        action; when it returns a false value the answer is 403. Register the
        result with ``app.register_blueprint(bp, url_prefix="/outbox")``.
        """
        from .dashboard import make_blueprint

        return make_blueprint(self, authorize, **options)

    def stats(self) -> dict[str, Any]:
        """Counts per status, oldest queued age, dead letters, mode, last sweep, dispatcher.

        The shape ``flask outbox status --json`` prints (without
        ``dispatcher``), listed field by field in the README. The last sweep
        comes from the database, so it is the last of any process; the
        dispatcher is this process's (None when it runs none).
        """
        state = self._state()
        runtime = state.runtime()
        with runtime.store.read() as conn:
            counts = _queries.counts(conn)
            oldest_queued_age = _queries.oldest_queued_age(conn, clock=runtime.store.clock)
            last = load_last_report(conn)
        dispatcher = runtime.dispatcher
        return {
            "counts": counts,
            "oldest_queued_age_seconds": oldest_queued_age,
            "dead_letters": counts.get(Status.FAILED.value, 0),
            "mode": "durable" if state.durable() else "inline",
            "last_sweep": last.as_dict() if last is not None else None,
            "dispatcher": None if dispatcher is None else {
                "running": dispatcher.running, "ticks": dispatcher.ticks,
                "last_tick_failed": dispatcher.last_tick_failed,
                "listening": dispatcher.listening,
            },
        }

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reasons": [...], ...}`` for this app.

        Degraded when an email has been due for longer than
        ``OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS``, when dead letters grew in
        the last 15 minutes, when this process's last dispatcher tick failed,
        or when the database cannot be read (a reason, never an exception).
        One indexed SQL statement; see the README for every field.
        """
        return _health.check(self._state())

    def health_view(self, strict: bool = False) -> Response:
        """A view for monitoring and load balancers: ``health()`` as JSON.

        Opt in with ``app.add_url_rule("/healthz", view_func=mail.health_view)``.
        The body lists every reason; the status is 503 only when this instance
        cannot read the database (``database_unreachable``), 200 otherwise: the
        other reasons are shared by every instance, and a load balancer that
        drained them all would take the site down. ``strict=True`` answers 503
        for any reason, for a monitor rather than a load balancer:
        ``app.add_url_rule("/healthz/strict", "healthz_strict",
        view_func=mail.health_view, defaults={"strict": True})``. The answer
        holds counts, ages and reason codes, no addresses or settings.
        """
        return _health.response(self.health(), strict=strict)

    def init_metrics(self, registry: Any = None, *, app: Flask | None = None) -> None:
        """Register Prometheus metrics for ``app`` (default: the current app).

        On ``registry`` (a ``prometheus_client.CollectorRegistry``; the default
        ``REGISTRY`` otherwise), once per app: calling again is harmless. No
        server is started; the app's own ``/metrics`` exposes them. Needs the
        ``metrics`` extra (``prometheus_client``).
        """
        from . import _metrics

        registered: _AppState | None = (self._state() if app is None
                                        else app.extensions.get(EXTENSION_KEY))
        if registered is None or registered.ext is not self:
            raise RuntimeError("init_metrics(app=...): this OutboxMail is not registered on "
                               "that app; call mail.init_app(app) first")
        _metrics.install(registered, registry)


def _is_postgres(session: Any) -> bool:
    return email_dialect(session) == "postgresql"


def _request_failed(sender: Flask, **_: Any) -> None:
    _staging.mark_request_failed()


def _teardown_request(exc: BaseException | None) -> None:
    if exc is not None:
        _staging.mark_request_failed()


def _check_key(field: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise InvalidMessage(field, f"expected a non-empty string, got {value!r}")
    if len(value) > _MAX_KEY_LENGTH:
        raise InvalidMessage(field, f"longer than {_MAX_KEY_LENGTH} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidMessage(field, "contains control characters")


def _smtp_options(mail_options: tuple[str, ...], rcpt_options: tuple[str, ...]) -> str | None:
    """The ``smtp_options`` column: NULL for the usual email without any."""
    if not mail_options and not rcpt_options:
        return None
    return json.dumps({"mail": list(mail_options), "rcpt": list(rcpt_options)})


def _due_at(send_after: Any) -> datetime | None:
    if send_after is None:
        return None
    if isinstance(send_after, timedelta):
        try:
            return utcnow() + send_after
        except OverflowError:
            raise InvalidMessage("send_after", f"{send_after!r} is past the year 9999") from None
    if isinstance(send_after, datetime):
        if send_after.tzinfo is not None:
            return send_after.astimezone(UTC).replace(tzinfo=None)
        return send_after
    raise InvalidMessage("send_after",
                         f"expected a datetime or timedelta, got {type(send_after).__name__}")
