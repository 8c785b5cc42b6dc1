"""Per-app state: the settings, this process's delivery core, and when to start things.

Per-app state lives in ``app.extensions["mail_outbox"]`` (an :class:`AppState`).
What runs threads or holds connections is the core's
:class:`~flask_mail_outbox.core.Outbox`, created lazily on first use in each
process and again after a fork, with callbacks that send the app's signals.
This module also decides which processes run the sweep jobs (serving ones,
never ``flask db ...``).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click
from flask import Flask, current_app, has_app_context

from .. import _degrade
from .._compose.ambient import ComposeOptions, set_provider
from .._errors import TransportError
from .._events import DeliveryEvent
from ..core._internal import (
    Callbacks,
    ClaimedEmail,
    DeliveredMessage,
    Executor,
    Mode,
    Outbox,
    OutboxConfig,
    OutgoingEmail,
    Producer,
    QueuedRow,
    TestClock,
    Ticket,
)
from . import staging
from .scheduler import SweepScheduler
from .signals import (
    email_dispatched,
    email_event,
    email_failed,
    email_queued,
    email_sent,
)
from .templating import EmailTemplates

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

logger = logging.getLogger(__name__)


#: The key of an app's :class:`AppState` in ``app.extensions``.
EXTENSION_KEY = "mail_outbox"


def app_state() -> AppState:
    """The outbox state of the current app: the one way in.

    The extension, the CLI and the dashboard reach this process's core
    (:meth:`AppState.outbox`) only through this.
    """
    state: AppState | None = current_app.extensions.get(EXTENSION_KEY)
    if state is None:
        raise RuntimeError("flask-mail-outbox is not registered on the current app; call "
                           "OutboxMail(app) or mail.init_app(app) first.")
    return state


class AppState:
    """Per-app state, in ``app.extensions["mail_outbox"]``.

    ``ext`` is the extension object that registered it (``OutboxMail``).
    """

    def __init__(self, ext: Any, app: Flask, db: SQLAlchemy, config: OutboxConfig) -> None:
        self.ext = ext
        self.app = app
        self.db = db
        self.config = config
        self.faults = _degrade.FaultTracker()
        #: Sends in flight per transport for this process's core: OUTBOX_CONCURRENCY,
        #: or `flask outbox worker --concurrency` before the core is created.
        self.concurrency = config.concurrency
        self._outbox: Outbox | None = None
        #: A test's clock (``flask_mail_outbox.testing``): every "now" of the core
        #: follows it; None, the real clocks. Set with :meth:`use_clock`.
        self.clock: TestClock | None = None
        #: Called with each core made on ``clock`` (the test kit sets it up there).
        self._prepare: Callable[[Outbox], None] | None = None
        #: The core's commit protocol; it asks for this process's core only when it needs it.
        self.producer = Producer(self.outbox, config)
        self._lock = threading.Lock()
        self.scheduler: SweepScheduler | None = None
        #: This app is served by this process or by workers forked from it: the
        #: background jobs start in the process that serves (ensure_started()).
        self.serving = False
        #: What this process's workers share when a master forked them (see
        #: _deployment_of_worker); None for a process that is no such worker.
        self.deployment: str | None = None
        #: The app's templated emails (``mail.send_template()``): set by ``init_app``.
        self.templates: EmailTemplates
        #: The task queue that delivers committed emails (OUTBOX_EXECUTOR; None: the
        #: dispatcher): set by ``init_app``.
        self.executor: Executor | None = None

    def outbox(self) -> Outbox:
        """This process's delivery core, created on first use and after a fork."""
        with self._lock:
            outbox = self._outbox
            if outbox is None or outbox.pid != os.getpid():
                if outbox is not None:
                    outbox.forget_parent()
                with self.app.app_context():
                    url = self.db.engine.url
                outbox = self._outbox = Outbox(
                    url, self.config, faults=self.faults, concurrency=self.concurrency,
                    callbacks=Callbacks(sent=self._sent, failed=self._failed,
                                        events=self.tell_events, before_send=self.before_send),
                    clock=self.clock, executor=self.executor)
                if self._prepare is not None:
                    self._prepare(outbox)
            return outbox

    def use_clock(self, clock: TestClock | None, *, timeout: float = 10.0,
                  prepare: Callable[[Outbox], None] | None = None) -> None:
        """Run this app's core on ``clock`` (None: the real clocks again).

        This process's core, if it has one, is stopped (``timeout`` for what it
        sends) and made again on first use, on the new clock; ``prepare(core)``
        is called with each core made on it.
        """
        with self._lock:
            outbox, self._outbox = self.current_outbox(), None
            self.clock = clock
            self._prepare = prepare if clock is not None else None
            self.producer.clock = clock
        if outbox is not None:
            outbox.stop(timeout)

    def test_now(self) -> datetime | None:
        """The test clock's time; None without one (then the real clock is read)."""
        clock = self.clock
        return None if clock is None else clock.now()

    def current_outbox(self) -> Outbox | None:
        """This process's core if it has one (never creates it)."""
        outbox = self._outbox
        return outbox if outbox is not None and outbox.pid == os.getpid() else None

    # -- the mode (decided by the core: Outbox.mode) ------------------------------------

    def durable(self) -> bool:
        """Whether durable delivery is in force (see :meth:`Outbox.mode`)."""
        return self.outbox().mode() is Mode.DURABLE

    # -- the producer's protocol (the core's; staging keeps the tickets) ---------------------


    def queue(self, rows: Sequence[QueuedRow]) -> list[int]:
        """Insert prepared rows in the current ``db.session`` transaction; their ids.

        ``send()``, ``send_many()`` and ``mail.connect()`` all come here: the
        tickets stay on the session until its outermost transaction ends.
        """
        if not rows:
            return []
        session = self.db.session()
        tickets = self.producer.enqueue(session, rows)
        staging.keep(session, self, tickets)
        return [t.email_id for t in tickets]

    def cancel(self, *, email_ids: Sequence[int], key: str | None,
               idempotency_key: str | None) -> tuple[int, int]:
        """Cancel in the current transaction; ``(cancelled, in_flight)`` (see ``mail.cancel``)."""
        session = self.db.session()
        tickets, in_flight = self.producer.cancel(session, email_ids=email_ids, key=key,
                                                    idempotency_key=idempotency_key)
        staging.keep(session, self, tickets)
        return len(tickets), in_flight

    def before_commit(self, session: Any, tickets: list[Ticket]) -> None:
        """Inside the outermost transaction that queued email, just before its commit."""
        self.producer.before_commit(session, tickets)

    def after_commit(self, tickets: list[Ticket]) -> None:
        """After the outermost commit: ``email_queued``, the jobs, then delivery."""
        if email_queued.receivers:
            for ticket in tickets:
                if not ticket.is_new:
                    continue
                try:
                    email_queued.send(self.app, email_id=ticket.email_id)
                except Exception:
                    logger.exception("A receiver of the email_queued signal raised (email "
                                     "%s); delivery goes on", ticket.email_id)
        if any(t.is_new for t in tickets):
            self.ensure_started()
        self.producer.after_commit(tickets)

    def after_rollback(self, tickets: list[Ticket]) -> None:
        """A transaction (or savepoint) that held ``tickets`` rolled back."""
        self.producer.after_rollback(tickets)

    def forget(self, tickets: list[Ticket]) -> tuple[list[int], list[int]]:
        """A transaction that held ``tickets`` ended uncommitted (see ``Producer.forget``)."""
        return self.producer.forget(tickets)

    def deliver_committed(self, ids: Sequence[int]) -> None:
        """Start delivering rows committed outside ``send()`` (a retry); never raises."""
        self.producer.after_store_commit(ids)

    # -- the core's callbacks: the app's signals --------------------------------------

    def _sent(self, email: ClaimedEmail, provider_message_id: str | None) -> None:
        if not email_sent.receivers and not email_dispatched.receivers:
            return
        # As sent: redirected, with before_send's changes (staging), when it was intercepted.
        sent = email.interception
        message = DeliveredMessage(email_id=email.id, message_id=email.message_id,
                                   sender=email.sender,
                                   send_to=email.recipients if sent is None else sent.recipients,
                                   mime=email.mime if sent is None else sent.mime,
                                   provider_message_id=provider_message_id)
        self._signal(email_sent, email_id=email.id, message_id=email.message_id,
                     message=message, created_at=email.created_at)
        self._signal(email_dispatched, message=message)

    def _failed(self, email: ClaimedEmail, error: TransportError | None) -> None:
        self._signal(email_failed, email_id=email.id, message_id=email.message_id, error=error)

    def tell_events(self, events: Sequence[DeliveryEvent]) -> None:
        """Send ``email_event`` for each stored event (in an app context)."""
        if not email_event.receivers:
            return
        for event in events:
            self._signal(email_event, event=event, email_id=event.email_id)

    def _signal(self, signal: Any, **kwargs: Any) -> None:
        """Send a signal in an app context; a failing receiver is logged, never breaks delivery."""
        try:
            with self.app.app_context():
                signal.send(self.app, **kwargs)
        except Exception:
            logger.exception("A receiver of the %s signal raised (email %s); what it "
                             "reports is recorded and delivery goes on", signal.name,
                             kwargs.get("email_id"))

    def before_send(self, email: OutgoingEmail) -> None:
        """The app's ``@mail.before_send`` functions, in order, in an app context (a veto
        stops them); called by the core in the delivery thread or worker process."""
        hooks = self.ext.before_send_hooks
        if not hooks:
            return
        with self.app.app_context():
            for hook in hooks:
                hook(email)
                if email.vetoed is not None:
                    return

    # -- the background jobs -------------------------------------------------------------

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
                    self.outbox, self.config, self.faults, deployment=self.deployment,
                    start_dispatcher=start_dispatcher)
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
        """Stop this process's jobs and delivery (see ``OutboxMail.stop``)."""
        with self._lock:
            outbox, self._outbox = self.current_outbox(), None
            scheduler = self.scheduler
            if scheduler is not None and scheduler.pid == os.getpid():
                self.scheduler = None
            else:
                scheduler = None
        if scheduler is not None:
            scheduler.stop()
        if outbox is not None:
            outbox.stop(timeout, serving=self.serving)


def compose_options() -> ComposeOptions | None:
    """How messages built in the current app are composed (the message layer's provider)."""
    if not has_app_context():
        return None
    state = current_app.extensions.get(EXTENSION_KEY)
    if isinstance(state, AppState):
        return state.config.compose
    config = current_app.config
    defaults = ComposeOptions()
    return ComposeOptions(
        default_sender=config.get("MAIL_DEFAULT_SENDER"),
        allow_local_addresses=bool(config.get("OUTBOX_ALLOW_LOCAL_ADDRESSES", False)),
        max_message_bytes=config.get("OUTBOX_MAX_MESSAGE_BYTES", defaults.max_message_bytes),
        message_id_domain=config.get("OUTBOX_MESSAGE_ID_DOMAIN"),
        ascii_attachments=bool(config.get("MAIL_ASCII_ATTACHMENTS", False)),
        html_to_text=bool(config.get("OUTBOX_HTML_TO_TEXT", True)))


set_provider(compose_options)


#: Every app's state in this process (stopped at exit, restarted after a fork).
all_states: weakref.WeakSet[AppState] = weakref.WeakSet()
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
    for state in list(all_states):
        state._lock = threading.Lock()
        if state.scheduler is not None or state.serving:
            state.scheduler = None
            try:
                state.start_scheduler()
            except Exception:
                logger.exception("Could not start the outbox sweep jobs in a forked process")


def _stop_all() -> None:
    for state in list(all_states):
        try:
            state.stop(timeout=10)
        except Exception:
            logger.exception("Stopping outbox delivery at exit failed")
