"""The Flask extension's sending and administration API (``OutboxMail`` without its
operator surfaces, which ``flask_mail_outbox._mail`` adds on top).

Per-app state lives in ``app.extensions["mail_outbox"]`` (see :mod:`.state`);
the extension object itself keeps no app, so one ``OutboxMail`` can serve
several apps.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from flask import Flask, current_app, got_request_exception

from .._bounces import NotMail, read_bounce
from .._compose.message import Address, Message
from .._errors import ConfigError, InvalidMessage
from .._events import DeliveryEvent, capped_payload, naive_utc
from .._reasons import smtp_reason
from ..core._internal import (
    CONFIG_DEFAULTS,
    DeliveredMessage,
    Mode,
    OutgoingEmail,
    QueuedRow,
    Status,
    Suppression,
    SweepReport,
    check_key,
    check_message,
    dialect_of,
    due_at_of,
    expires_at_of,
    load_config,
    load_last_report,
    metadata,
    prepare_row,
    priority_rank,
    run_sweep,
    transport_name,
    warn_plaintext_logins,
)
from . import compat, executors, staging, webhooks
from . import state as app_states
from .compat import Connection, FlaskMailState
from .signals import email_sent
from .state import EXTENSION_KEY, AppState, app_state
from .templating import EmailTemplates, LocaleResolver, Preview

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy

logger = logging.getLogger(__name__)

# One table of keys: the defaults in _config (a key added there is known here).
_KNOWN_OUTBOX_KEYS = frozenset(key for key in CONFIG_DEFAULTS if key.startswith("OUTBOX_"))
_MAX_KEY_LENGTH = 255


def _check_unknown_keys(config: Any) -> None:
    for key in config:
        if key.startswith("OUTBOX_") and key not in _KNOWN_OUTBOX_KEYS:
            close = difflib.get_close_matches(key, _KNOWN_OUTBOX_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(key, f"is not a flask-mail-outbox setting{hint}")


def _check_database_uri(uri: Any) -> None:
    """The app's database: one the outbox runs on and can share (``ConfigError`` otherwise)."""
    if not isinstance(uri, (str, sa.URL)):
        return
    url = sa.make_url(uri)
    dialect_of(url).check_app_url(url)


def _prepare_engine(app: Flask, db: SQLAlchemy) -> None:
    """Set what each connection of the app's engine needs on its ``connect`` event.

    Flask-SQLAlchemy makes the engine in its ``init_app`` and connects on first
    use; so does this: an app is created with its database down. On SQLite the
    first connection, before any write, puts the file in WAL mode.
    """
    with app.app_context():
        engine = db.engine  # made by db.init_app; no connection yet
    dialect_of(engine).prepare_app_engine(engine)


class OutboxExtension:
    """Transactional email for Flask: registration, sending, and the outbox's own API.

    ``mail.send(msg)`` adds the email to ``db.session`` as a ``queued`` row in
    the caller's transaction; it is delivered in the background after the
    outermost commit, and a rollback sends nothing.
    """

    def __init__(self, app: Flask | None = None, db: SQLAlchemy | None = None) -> None:
        self._db = db
        #: ``@mail.preview`` registrations, by template name (every app of this extension).
        self._previews: dict[str, list[Preview]] = {}
        self._locale_resolver: LocaleResolver | None = None
        #: ``@mail.before_send`` functions, in registration order (every app of this extension).
        self.before_send_hooks: list[Callable[[OutgoingEmail], None]] = []
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
        # First: the database's kind needs no engine, and names the key to change.
        _check_database_uri(app.config.get("SQLALCHEMY_DATABASE_URI"))
        db = db or self._db or app.extensions.get("sqlalchemy")
        if db is None:
            raise RuntimeError(
                "flask-mail-outbox needs Flask-SQLAlchemy: create SQLAlchemy(app) (or call "
                "db.init_app(app)) before OutboxMail(app), or pass OutboxMail(app, db=db).")
        _check_unknown_keys(app.config)
        config = load_config(app.config, instance_path=app.instance_path,
                             testing=bool(app.config.get("TESTING")))
        warn_plaintext_logins(config)
        if config.dkim is not None:
            config.dkim.check()  # signs a probe: a key that cannot sign fails here
        state = AppState(self, app, db, config)
        state.templates = EmailTemplates(app, config, self._previews)
        # A task queue's extra missing, or its broker not configured: fails here.
        state.executor = executors.load(app, config.executor)
        _prepare_engine(app, db)
        app.extensions[EXTENSION_KEY] = state
        app_states.all_states.add(state)
        staging.install(db.session)
        got_request_exception.connect(_request_failed, app, weak=False)
        app.teardown_request(_teardown_request)
        app_states.install_process_hooks()
        webhooks.register(app, state)
        if config.run_scheduler and app_states.serving_process(app):
            state.serving = True
            app.before_request(state.ensure_started)
            if app_states.start_at_once(app):
                state.start_scheduler()
        return compat.register(self, app)

    # -- state --------------------------------------------------------------------

    def _state(self) -> AppState:
        return app_state()

    # -- templated emails -----------------------------------------------------------

    def templates(self) -> EmailTemplates:
        """The current app's templated emails: names, locales, previews, ``render()``."""
        return self._state().templates

    def template_message(self, template: str, *, recipients: list[Address] | None = None,
                         context: Mapping[str, Any] | None = None, locale: str | None = None,
                         **fields: Any) -> Message:
        """Render the email ``template`` (``"orders/shipped"``) into a :class:`Message`.

        The subject, HTML and text come from the template's files under
        ``OUTBOX_TEMPLATE_FOLDER`` (see docs/guide/templates.md); ``fields`` are
        the message's other fields (``sender``, ``cc``, ``attachments``, ...).
        The locale is ``locale``, else the ``@mail.locale_resolver``'s answer for
        the recipients, else the request's (Flask-Babel), else the default one.
        ``mail.send(msg)`` records the template's name, locale and version.
        Raises :class:`TemplateError` (an :class:`InvalidMessage`); needs an app context.
        """
        templates = self._state().templates
        chosen = templates.choose_locale(template, locale, recipients or (),
                                         self._locale_resolver)
        rendered = templates.render(template, context, locale=chosen)
        return rendered.message(recipients=recipients, **fields)

    def send_template(self, template: str, *, recipients: list[Address],
                      context: Mapping[str, Any] | None = None, locale: str | None = None,
                      key: str | None = None,
                      send_after: datetime | timedelta | None = None,
                      idempotency_key: str | None = None, transport: str | None = None,
                      priority: str = "normal",
                      expires_after: datetime | timedelta | None = None,
                      **fields: Any) -> int:
        """Render the email ``template`` and queue it, as ``send()`` does; its row id.

        ``mail.send(mail.template_message(template, recipients=..., context=...,
        locale=..., **fields), key=..., ...)``: rendered here, in the caller's
        request, so a :class:`TemplateError` (a missing template or variable, a
        syntax error, an unknown locale) is raised before anything is written.
        """
        msg = self.template_message(template, recipients=recipients, context=context,
                                    locale=locale, **fields)
        return self.send(msg, key=key, send_after=send_after, idempotency_key=idempotency_key,
                         transport=transport, priority=priority, expires_after=expires_after)

    def preview(self, template: str, name: str = "default"
                ) -> Callable[[Callable[[], Mapping[str, Any]]], Callable[[], Mapping[str, Any]]]:
        """Register a preview of ``template``: a function with no arguments returning a context.

        The dashboard's previews and ``flask outbox templates check`` render the
        template with it, in every locale. Several previews of one template need
        distinct ``name``s::

            @mail.preview("orders/shipped")
            def shipped():
                return {"order": Order(id=1042, items=[...])}
        """
        def register(func: Callable[[], Mapping[str, Any]]) -> Callable[[], Mapping[str, Any]]:
            if not callable(func):
                raise TypeError(f"@mail.preview({template!r}) decorates a function, "
                                f"got {func!r}")
            kept = self._previews.setdefault(template, [])
            if any(item.name == name for item in kept):
                raise ValueError(f"template {template!r} already has a preview named {name!r}; "
                                 "give this one another name: @mail.preview(template, name=...)")
            kept.append(Preview(template, name, func))
            return func
        return register

    def locale_resolver(self, func: LocaleResolver) -> LocaleResolver:
        """Register the function that picks the locale of a templated email (a decorator).

        Called with the bare ``To`` addresses (never an empty list: without one it is
        not called) when ``send_template()`` is given no ``locale``; it returns a
        locale (``"de"``), or None to fall through to the request's locale and then
        the default one::

            @mail.locale_resolver
            def user_locale(recipients):
                user = User.query.filter_by(email=recipients[0]).first()
                return user.locale if user else None
        """
        if not callable(func):
            raise TypeError(f"@mail.locale_resolver decorates a function, got {func!r}")
        self._locale_resolver = func
        return func

    def before_send(self, func: Callable[[OutgoingEmail], None]
                    ) -> Callable[[OutgoingEmail], None]:
        """Register a function called with each email about to be delivered (a decorator).

        It runs at delivery, in the delivery thread or the ``flask outbox worker``
        process, inside an app context, once per attempt, with an
        :class:`~flask_mail_outbox.core.OutgoingEmail` it may change (its
        ``recipients``; ``set_header()``, ``remove_header()``) or veto
        (``veto(reason)``: the email ends ``cancelled``). What it did is
        recorded on the row. An exception it raises fails the attempt as a
        transient failure (retried, then dead-lettered): the email is never
        sent without it. See docs/guide/staging.md::

            @mail.before_send
            def tag_staging(email):
                email.set_header("X-Environment", "staging")
        """
        if not callable(func):
            raise TypeError(f"@mail.before_send decorates a function, got {func!r}")
        self.before_send_hooks.append(func)
        return func

    # -- sending ----------------------------------------------------------------------

    def send(self, msg: Message, *, key: str | None = None,
             send_after: datetime | timedelta | None = None,
             idempotency_key: str | None = None, transport: str | None = None,
             priority: str = "normal",
             expires_after: datetime | timedelta | None = None) -> int:
        """Queue ``msg`` in the current ``db.session`` transaction; return the row id.

        Validates first and raises :class:`InvalidMessage` (nothing written) on
        bad input. Does not commit: the email goes out after the caller's
        outermost commit, and a rollback discards it. With an
        ``idempotency_key`` already stored, returns that row's id and adds
        nothing. ``transport`` names one of ``OUTBOX_TRANSPORTS`` (None: the
        default one). ``priority`` (``"high"``, ``"normal"``, ``"low"``): among
        due emails, higher goes first; within a ``key``, ``send()`` order wins.
        ``expires_after`` (a timedelta from now, or a datetime): not delivered
        by then, the email ends ``expired``, unsent and not retried (a
        password reset must not arrive an hour late).
        """
        state = self._state()
        check_message(msg)
        check_key("key", key)
        check_key("idempotency_key", idempotency_key)
        now = state.test_now()  # None: the real clock
        due_at = due_at_of(send_after, now=now)
        row = prepare_row(msg, state.config, key=key, due_at=due_at,
                          idempotency_key=idempotency_key, priority=priority_rank(priority),
                          transport=transport_name(transport, state.config),
                          expires_at=expires_at_of(expires_after, due_at, now=now), now=now)
        return state.queue([row])[0]

    def send_many(self, messages: Iterable[Message], *, key: str | None = None,
                  send_after: datetime | timedelta | None = None,
                  transport: str | None = None, priority: str = "normal",
                  expires_after: datetime | timedelta | None = None) -> list[int]:
        """Queue many messages in the current transaction, all or nothing; their row ids.

        The same rows, statuses, order, signals and delivery as
        ``[mail.send(m, key=key, send_after=send_after, transport=transport,
        priority=priority, expires_after=expires_after) for m in messages]``, in one multi-row INSERT. Every message is validated before anything
        is written: a bad one raises :class:`InvalidMessage` naming its index
        (``messages[3].recipients: ...``) and nothing is added. Does not commit.
        """
        check_key("key", key)
        state = self._state()
        now = state.test_now()  # None: the real clock
        due_at = due_at_of(send_after, now=now)
        expires_at = expires_at_of(expires_after, due_at, now=now)
        rank = priority_rank(priority)
        name = transport_name(transport, state.config)
        rows: list[QueuedRow] = []
        for index, msg in enumerate(messages):
            try:
                check_message(msg)
                rows.append(prepare_row(msg, state.config, key=key, due_at=due_at,
                                        priority=rank, transport=name, expires_at=expires_at,
                                        now=now))
            except InvalidMessage as exc:
                raise InvalidMessage(f"messages[{index}].{exc.field}", exc.problem) from exc
        return state.queue(rows)

    def cancel(self, email_id: int | Iterable[int] | None = None, *, key: str | None = None,
               idempotency_key: str | None = None) -> int:
        """Take queued emails back in the current ``db.session`` transaction; how many.

        Name them by ``email_id`` (one id or several), by ``key`` (every
        queued email of that key), or by ``idempotency_key``, exactly one of
        the three. Rows still ``queued``, including those waiting for their
        ``send_after`` or a retry, become ``cancelled``; a row already
        ``sending`` is not cancelled and not counted. Like ``send()`` it does
        not commit: the cancel takes effect with the caller's commit, and a
        rollback cancels nothing. After the commit, the next email of a
        cancelled key holder's key may go.
        """
        given = [email_id is not None, key is not None, idempotency_key is not None]
        if sum(given) != 1:
            raise TypeError("cancel() takes exactly one of email_id, key and idempotency_key")
        ids: list[int] = []
        if email_id is not None:
            ids = [email_id] if isinstance(email_id, int) else list(email_id)
            for value in ids:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"email_id must be an int or ints, got {value!r}")
            if not ids:
                return 0
        check_key("key", key)
        check_key("idempotency_key", idempotency_key)
        cancelled, in_flight = self._state().cancel(email_ids=ids, key=key,
                                                    idempotency_key=idempotency_key)
        if in_flight:
            logger.info("cancel(): %d email(s) are being sent already and were not cancelled",
                        in_flight)
        return cancelled

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
        outbox = self._state().current_outbox()
        if outbox is None or not outbox.has_worker:
            return True
        return outbox.worker.wait_idle(timeout)

    def stop(self, timeout: float = 10) -> None:
        """Stop this process's delivery threads for every app; idempotent.

        Messages claimed but not yet handed to the server are released at
        once; the ones the server is receiving get ``timeout`` seconds to
        finish and have their outcomes recorded. What this
        process releases, or had been handed after a commit and never
        claimed, is ``queued`` and marked so the next sweep of any process
        takes it whatever its age; rows still being sent past the timeout
        stay ``sending`` until their lease expires and a sweep takes them.
        Logs at INFO what it released and what takes it.
        """
        for state in list(app_states.all_states):
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
        self._state().outbox().set_mode(Mode.DURABLE if on else Mode.INLINE)

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest dead-lettered (``failed``) emails, with their failure history."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        return self._state().outbox().reader.dead_letters(limit)

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
        if not state.outbox().store.admin.retry_failed(email_id):
            raise LookupError(f"email {email_id} is not a dead letter (no failed row with "
                              "that id)")
        state.deliver_committed([email_id])

    def retry_all(self) -> int:
        """Put every dead letter back at once (commits); how many went back.

        One set-based UPDATE however many there are (``retry()`` in a loop
        would be a transaction each), then delivery starts as for ``retry()``.
        In inline mode at most the worker's queue is handed over at once; the
        sweep delivers the rest.
        """
        state = self._state()
        ids = state.outbox().store.admin.retry_all_failed()
        state.deliver_committed(ids)
        return len(ids)

    # -- after the hand-off: events and the suppression list ----------------------------

    def events(self, email_id: int) -> list[DeliveryEvent]:
        """What happened to one email after it was sent, oldest first (see :class:`DeliveryEvent`)."""
        if isinstance(email_id, bool) or not isinstance(email_id, int):
            raise TypeError(f"email_id must be an int, got {type(email_id).__name__}")
        return self._state().outbox().events.for_email(email_id)

    def record_event(self, event_type: str | DeliveryEvent, *, email_id: int | None = None,
                     message_id: str | None = None, provider_message_id: str | None = None,
                     recipient: str | None = None, occurred_at: datetime | None = None,
                     transport: str = "app", provider_event_id: str | None = None,
                     bounce_kind: str | None = None, description: str = "",
                     mta_response: str = "", payload: Any = None,
                     reason: str | None = None) -> DeliveryEvent | None:
        """Store a delivery event from a custom transport or an app's own webhook.

        The email is ``email_id``, or found by ``provider_message_id`` among
        the emails ``transport`` sent (so pass the sending transport's name
        with it), or by ``message_id`` (the Message-ID); an event that names none is kept
        with ``email_id`` None. ``reason`` says why it failed (one of the
        reasons in docs/events.md); for a bounce without one it is read from
        ``mta_response`` (``"550 5.1.1 ..."`` is ``user_unknown``). The
        suppression policy decides as for a provider's webhook: a permanent
        bounce for a dead address (user or host unknown, suspended...), a
        complaint and an unsubscribe put ``recipient`` on the suppression list
        for good; repeated soft bounces for a while. Returns the stored event, or None when
        ``(transport, provider_event_id)`` was stored before (a resend). Sends
        ``email_event``. Writes and commits at once, in the outbox's own
        transaction. A bad type or field is an ``InvalidMessage`` naming it.
        """
        if isinstance(event_type, DeliveryEvent):
            event = event_type
        else:
            event = DeliveryEvent(
                event_type, recipient=recipient, occurred_at=occurred_at,
                transport=transport, provider_event_id=provider_event_id,
                email_id=email_id, bounce_kind=bounce_kind, description=description,
                mta_response=mta_response, provider_message_id=provider_message_id,
                message_id=message_id, payload=capped_payload(payload),
                reason=smtp_reason(mta_response) if reason is None and event_type == "bounced"
                and isinstance(mta_response, str) and mta_response.strip() else reason)
        if event.event_type == "bounced" and event.bounce_kind is None:
            raise InvalidMessage("bounce_kind", "a bounced event needs bounce_kind "
                                 "'permanent' or 'transient'")
        state = self._state()
        recorded = state.outbox().events.record([event])
        state.tell_events(recorded.new)
        return recorded.new[0] if recorded.new else None

    def process_bounce(self, raw: bytes) -> list[DeliveryEvent]:
        """Read one bounce message (an RFC 3464 DSN, an RFC 5965 ARF report, or a common
        non-standard bounce) and store what it says; the new events.

        For an app that fetches a bounce mailbox itself; ``flask outbox bounce``
        does the same for an MTA's pipe. A DSN names its email by the VERP
        token of ``OUTBOX_BOUNCE_ADDRESS`` (a forged token changes nothing)
        or, without VERP, by the returned Message-ID. A permanent bounce or a
        complaint suppresses the recipient of a one-recipient email of ours;
        anything else is kept as an event and suppresses nothing, since a
        bounce is mail anyone can send, and every recipient of an email sees
        its token and its Message-ID. A message that is not a bounce, or
        names no email of ours, returns ``[]`` (logged at INFO); one that is
        not mail at all raises :class:`~flask_mail_outbox.InvalidMessage`.
        Database errors propagate: retry later.
        """
        if not isinstance(raw, (bytes, bytearray)):
            raise TypeError(f"process_bounce() takes bytes, got {type(raw).__name__}")
        state = self._state()
        verp = state.config.verp
        try:
            report = read_bounce(bytes(raw), email_id_of=verp.email_id_of if verp else None)
        except NotMail as exc:
            raise InvalidMessage("raw", str(exc)) from None
        events = [event for event in report.events
                  if verp is None or report.kind == "arf" or event.email_id is not None]
        if len(events) < len(report.events):
            logger.info("A %s names no email by a valid VERP address: %d event(s) ignored "
                        "(a forged or foreign bounce changes nothing)", report.kind,
                        len(report.events) - len(events))
        if not events:
            logger.info("Not a bounce of ours: %s", report.reason)
            return []
        recorded = state.outbox().events.record(events, source=f"bounce ({report.kind})",
                                                unauthenticated=True)
        if recorded.unmatched:
            logger.info("%d bounce event(s) name no email this outbox knows (kept with "
                        "email_id NULL): %s", recorded.unmatched, report.reason)
        state.tell_events(recorded.new)
        return list(recorded.new)

    def suppress(self, address: str, reason: str = "manual", *, source: str = "manual",
                 expires_at: datetime | None = None) -> bool:
        """Put ``address`` on the suppression list (commits); True if it was not on it.

        ``reason``: ``manual`` (the default), ``bounced``, ``complained`` or
        ``unsubscribed`` (which applies to bulk mail only). ``expires_at``
        (naive UTC, or aware): the entry stops applying then. Delivery leaves
        a suppressed recipient out; an email with no other recipient ends
        ``suppressed`` without contacting a server.
        """
        if expires_at is not None and not isinstance(expires_at, datetime):
            raise InvalidMessage("expires_at", f"expected a datetime, got {expires_at!r}")
        return self._state().outbox().suppressions.add(
            address, reason, source=source,
            expires_at=None if expires_at is None else naive_utc(expires_at))

    def unsuppress(self, address: str) -> bool:
        """Take ``address`` off the suppression list (commits); True if it was on it."""
        return self._state().outbox().suppressions.remove(address)

    def suppression(self, address: str) -> Suppression | None:
        """The suppression list's entry in force for ``address``, or None."""
        return self._state().outbox().suppressions.get(address)

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
        return run_sweep(self._state().outbox(), min_age=min_age, limit=limit, dry_run=dry_run)

    def wait_sweep(self, timeout: float) -> SweepReport | None:
        """Wait for this process's startup sweep; its report, or None (not run, failed)."""
        state = self._state()
        state.ensure_started()
        scheduler = state.scheduler
        if scheduler is None:
            return None
        scheduler.startup_done.wait(timeout)
        return scheduler.startup_report

    def stats(self) -> dict[str, Any]:
        """Counts per status, oldest queued age, dead letters, mode, executor, last sweep, dispatcher.

        The shape ``flask outbox status --json`` prints (without
        ``dispatcher``), listed field by field in docs/operations.md. The last sweep
        comes from the database, so it is the last of any process; the
        dispatcher is this process's (None when it runs none).
        """
        outbox = self._state().outbox()
        reader = outbox.reader
        counts = reader.counts()
        oldest_queued_age = reader.oldest_queued_age()
        last = load_last_report(reader)
        dispatcher = outbox.dispatcher
        return {
            "counts": counts,
            "oldest_queued_age_seconds": oldest_queued_age,
            "dead_letters": counts.get(Status.FAILED.value, 0),
            "mode": outbox.mode().value,
            "executor": outbox.config.executor,
            "last_sweep": last.as_dict() if last is not None else None,
            "dispatcher": None if dispatcher is None else {
                "running": dispatcher.running, "ticks": dispatcher.claims,
                "last_tick_failed": dispatcher.last_claim_failed,
                "listening": dispatcher.listening,
            },
        }


def _request_failed(sender: Flask, **_: Any) -> None:
    staging.mark_request_failed()


def _teardown_request(exc: BaseException | None) -> None:
    if exc is not None:
        staging.mark_request_failed()
