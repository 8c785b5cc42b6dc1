"""The Flask extension: ``OutboxMail``, its public methods.

Per-app state lives in ``app.extensions["mail_outbox"]`` (see :mod:`._runtime`);
the extension object itself keeps no app, so one ``OutboxMail`` can serve
several apps.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from flask import Flask, Response, current_app, got_request_exception

from . import _compat, _health, _queries, _runtime, _staging
from ._compat import Connection, FlaskMailState
from ._config import _DEFAULTS, OutboxConfig, load_config
from ._delivery import DeliveredMessage
from ._errors import ConfigError, InvalidMessage
from ._insert import email_dialect, insert_email, insert_emails
from ._message import Message, prepare_message
from ._models import DEFAULT_PRIORITY, PRIORITIES, Status, metadata
from ._runtime import EXTENSION_KEY, _all_states, _AppState, app_state
from ._signals import email_sent
from ._store import utcnow
from ._sweep import SweepReport, load_last_report, run_sweep
from ._transport_specs import DEFAULT as DEFAULT_TRANSPORT
from ._transport_specs import warn_plaintext_logins

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

logger = logging.getLogger(__name__)

# One table of keys: the defaults in _config (a key added there is known here).
_KNOWN_OUTBOX_KEYS = frozenset(key for key in _DEFAULTS if key.startswith("OUTBOX_"))
_MAX_KEY_LENGTH = 255


def _check_unknown_keys(config: Any) -> None:
    for key in config:
        if key.startswith("OUTBOX_") and key not in _KNOWN_OUTBOX_KEYS:
            close = difflib.get_close_matches(key, _KNOWN_OUTBOX_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(key, f"is not a flask-mail-outbox setting{hint}")


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


def _prepare_sqlite(app: Flask, db: SQLAlchemy) -> None:
    """Put the app's SQLite database in WAL mode at start, before any writer."""
    with app.app_context():
        engine = db.engine
        if engine.dialect.name != "sqlite":
            return
        with engine.connect() as conn:
            cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                _runtime.ensure_wal(cursor)
            finally:
                cursor.close()


@dataclasses.dataclass(frozen=True)
class QueuedRow:
    """A validated message as the row ``send()`` writes (not written yet)."""

    values: dict[str, Any]
    attachments: list[dict[str, Any]]
    recipients: tuple[str, ...]
    due_now: bool
    #: priority="high": an inline worker hands it over before what waits.
    urgent: bool = False


class OutboxMail:
    """Transactional email for Flask.

    ``mail.send(msg)`` adds the email to ``db.session`` as a ``queued`` row in
    the caller's transaction; it is delivered in the background after the
    outermost commit, and a rollback sends nothing.
    """

    def __init__(self, app: Flask | None = None, db: SQLAlchemy | None = None) -> None:
        self._db = db
        #: Flask-Mail's ``mail.state``: the Flask-Mail-compatible state of the app
        #: given here; None in the factory style (``init_app`` returns it instead).
        self.state: FlaskMailState | None = None
        if app is not None:
            self.state = self.init_app(app, db)

    def init_app(self, app: Flask, db: SQLAlchemy | None = None) -> FlaskMailState:
        """Register with ``app``: read and check the configuration, hook the session.

        Also puts a Flask-Mail-compatible object at ``app.extensions["mail"]``
        unless another extension (Flask-Mail itself) holds that key, and
        returns it, as Flask-Mail's ``init_app`` returns its state.
        """
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
        warn_plaintext_logins(config)
        if config.dkim is not None:
            config.dkim.check()  # signs a probe: a key that cannot sign fails here
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
        _runtime.install_process_hooks()
        if config.run_scheduler and _runtime.serving_process(app):
            state.serving = True
            app.before_request(state.ensure_started)
            if _runtime.start_at_once(app):
                state.start_scheduler()
        return _compat.register(self, app)

    # -- state --------------------------------------------------------------------

    def _state(self) -> _AppState:
        return app_state()

    # -- sending ----------------------------------------------------------------------

    def send(self, msg: Message, *, key: str | None = None,
             send_after: datetime | timedelta | None = None,
             idempotency_key: str | None = None, transport: str | None = None,
             priority: str = "normal") -> int:
        """Queue ``msg`` in the current ``db.session`` transaction; return the row id.

        Validates first and raises :class:`InvalidMessage` (nothing written) on
        bad input. Does not commit: the email goes out after the caller's
        outermost commit, and a rollback discards it. With an
        ``idempotency_key`` already stored, returns that row's id and adds
        nothing. ``transport`` names one of ``OUTBOX_TRANSPORTS`` (None: the
        default one). ``priority`` (``"high"``, ``"normal"``, ``"low"``): among
        due emails, higher goes first; within a ``key``, ``send()`` order wins.
        """
        state = self._state()
        _check_message(msg)
        _check_key("key", key)
        _check_key("idempotency_key", idempotency_key)
        row = self._prepare_row(msg, key=key, due_at=_due_at(send_after),
                                idempotency_key=idempotency_key, config=state.config,
                                priority=_priority(priority),
                                transport=_transport_name(transport, state.config))
        session = state.db.session()
        dialect = email_dialect(session)
        notify = _notifies(state, dialect)
        email_id, created, waits = insert_email(session, row.values, row.attachments,
                                                notify=notify, dialect=dialect,
                                                recipients=row.recipients)
        if created:
            _staging.stage(session, _staging.StagedEmail(
                email_id=email_id, due_now=row.due_now, publisher=state, notified=notify,
                waits_on_key=key if waits else None, urgent=row.urgent))
        return email_id

    def send_many(self, messages: Iterable[Message], *, key: str | None = None,
                  send_after: datetime | timedelta | None = None,
                  transport: str | None = None, priority: str = "normal") -> list[int]:
        """Queue many messages in the current transaction, all or nothing; their row ids.

        The same rows, statuses, order, signals and delivery as
        ``[mail.send(m, key=key, send_after=send_after, transport=transport,
        priority=priority) for m in messages]``, in one multi-row INSERT. Every message is validated before anything
        is written: a bad one raises :class:`InvalidMessage` naming its index
        (``messages[3].recipients: ...``) and nothing is added. Does not commit.
        """
        _check_key("key", key)
        due_at = _due_at(send_after)
        rank = _priority(priority)
        config = self._state().config
        name = _transport_name(transport, config)
        rows: list[QueuedRow] = []
        for index, msg in enumerate(messages):
            try:
                rows.append(self._prepare_row(msg, key=key, due_at=due_at, config=config,
                                              priority=rank, transport=name))
            except InvalidMessage as exc:
                raise InvalidMessage(f"messages[{index}].{exc.field}", exc.problem) from exc
        return self._queue_rows(rows, key=key)

    def _prepare_row(self, msg: Message, *, key: str | None, due_at: datetime | None,
                     idempotency_key: str | None = None,
                     config: OutboxConfig | None = None,
                     priority: int = DEFAULT_PRIORITY,
                     transport: str = DEFAULT_TRANSPORT) -> QueuedRow:
        """Validate ``msg`` and build its row (nothing written): ``InvalidMessage`` if bad.

        ``config`` (the current app's) spares the lookup in a loop.
        """
        if config is None:
            config = self._state().config
        _check_message(msg)
        prepared = prepare_message(
            msg, default_sender=config.default_sender,
            allow_local_addresses=config.allow_local_addresses,
            max_message_bytes=config.max_message_bytes,
            message_id_domain=config.message_id_domain,
            ascii_attachments=config.ascii_attachments,
            html_to_text=config.html_to_text, allow_smtputf8=config.allow_smtputf8)
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
            "priority": priority,
            "transport": transport,
        }
        attachments = [
            {"position": index, "filename": info.filename, "content_type": info.content_type,
             "size": info.size}
            for index, info in enumerate(prepared.attachments)
        ]
        return QueuedRow(values, attachments, prepared.recipients,
                         due_now=due_at is None or due_at <= utcnow(),
                         urgent=priority < DEFAULT_PRIORITY)

    def _queue_rows(self, rows: list[QueuedRow], *, key: str | None) -> list[int]:
        """Insert prepared rows in the current transaction and stage them; their ids."""
        if not rows:
            return []
        state = self._state()
        session = state.db.session()
        dialect = email_dialect(session)
        notify = _notifies(state, dialect)
        inserted = insert_emails(session, [(row.values, row.attachments) for row in rows],
                                 key=key, notify=notify, dialect=dialect)
        _staging.stage_many(session, [
            _staging.StagedEmail(email_id=email_id, due_now=row.due_now, publisher=state,
                                 notified=notify, waits_on_key=key if waits else None,
                                 urgent=row.urgent)
            for (email_id, waits), row in zip(inserted, rows, strict=True)])
        return [email_id for email_id, _ in inserted]

    def send_message(self, *args: Any, **kwargs: Any) -> int:
        """``send(Message(*args, **kwargs))`` (Flask-Mail's shortcut)."""
        return self.send(Message(*args, **kwargs))

    def connect(self) -> Connection:
        """Flask-Mail's bulk idiom: ``with mail.connect() as conn: conn.send(msg)``.

        Each ``conn.send(msg)`` validates at once; the block's messages are
        queued in the current transaction with one ``send_many`` when it ends
        (see :class:`~._compat.Connection`). It commits nothing.
        """
        return Connection(self)

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
        return runtime.worker.wait_idle(timeout)

    def stop(self, timeout: float = 10) -> None:
        """Stop this process's delivery threads for every app; idempotent.

        Messages claimed but not yet handed to the server are given back at
        once; the ones the server is receiving get ``timeout`` seconds to
        finish and have their outcomes recorded. What this
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
            state.runtime().dispatch()

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
        state.deliver_soon([email_id])

    def retry_all(self) -> int:
        """Put every dead letter back at once (commits); how many went back.

        One set-based UPDATE however many there are (``retry()`` in a loop
        would be a transaction each), then delivery starts as for ``retry()``.
        In inline mode at most the worker's queue is handed over at once; the
        sweep delivers the rest.
        """
        state = self._state()
        ids = state.runtime().store.retry_all_failed()
        state.deliver_soon(ids)
        return len(ids)

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
        """An operator dashboard as a Flask blueprint (opt-in; see docs/operations.md).

        ``authorize`` is a callable with no arguments, called on every page and
        action; when it returns a false value the answer is 403. Register the
        result with ``app.register_blueprint(bp, url_prefix="/outbox")``.
        """
        from .dashboard import make_blueprint

        return make_blueprint(self, authorize, **options)

    def stats(self) -> dict[str, Any]:
        """Counts per status, oldest queued age, dead letters, mode, last sweep, dispatcher.

        The shape ``flask outbox status --json`` prints (without
        ``dispatcher``), listed field by field in docs/operations.md. The last sweep
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
                "running": dispatcher.running, "ticks": dispatcher.claims,
                "last_tick_failed": dispatcher.last_claim_failed,
                "listening": dispatcher.listening,
            },
        }

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reasons": [...], ...}`` for this app.

        Degraded when an email has been due for longer than
        ``OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS``, when dead letters grew in
        the last 15 minutes, when this process's last dispatcher tick failed,
        or when the database cannot be read (a reason, never an exception).
        One indexed SQL statement; see docs/operations.md for every field.
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


def _request_failed(sender: Flask, **_: Any) -> None:
    _staging.mark_request_failed()


def _teardown_request(exc: BaseException | None) -> None:
    if exc is not None:
        _staging.mark_request_failed()


def _check_message(msg: Any) -> None:
    if not isinstance(msg, Message):
        kind = f"{type(msg).__module__}.{type(msg).__qualname__}"
        hint = ("; import Message from flask_mail_outbox instead of flask_mail"
                if kind == "flask_mail.Message" else "")
        raise InvalidMessage("msg", f"expected a flask_mail_outbox.Message, got {kind}{hint}")


def _notifies(state: _AppState, dialect: str) -> bool:
    """Whether the insert itself runs the NOTIFY that prepare_commit() would send at commit."""
    return state.config.listen and dialect == "postgresql" and state.durable()


def _priority(value: Any) -> int:
    """The stored rank of ``send(priority=...)``; :class:`InvalidMessage` if not a known one."""
    rank = PRIORITIES.get(value) if isinstance(value, str) else None
    if rank is None:
        raise InvalidMessage("priority", f"expected one of {', '.join(map(repr, PRIORITIES))}, "
                                         f"got {value!r}")
    return rank


def _transport_name(value: Any, config: OutboxConfig) -> str:
    """``send(transport=...)``: a configured name; :class:`InvalidMessage` otherwise."""
    if value is None:
        return DEFAULT_TRANSPORT
    if not isinstance(value, str) or value not in config.transport_names:
        raise InvalidMessage("transport", f"expected one of the transports configured in "
                             f"OUTBOX_TRANSPORTS ({', '.join(config.transport_names)}), "
                             f"got {value!r}")
    return value


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
