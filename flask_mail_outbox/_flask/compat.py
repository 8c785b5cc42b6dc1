"""Flask-Mail's surface: the ``app.extensions["mail"]`` state and ``mail.connect()``.

Code written for Flask-Mail 0.10 (views, tests, other extensions) reaches the
mail through ``current_app.extensions["mail"]`` (``.send``, ``.default_sender``,
``.connect()``...). :class:`FlaskMailState` is that object for an app that
uses the outbox, with Flask-Mail's attributes holding the values the outbox
uses, and ``send`` queuing in the current transaction like ``mail.send``.

:class:`Connection` is ``mail.connect()``: Flask-Mail opens one SMTP
connection for a loop of ``conn.send(msg)``; the outbox validates each
message at ``conn.send`` (a bad one raises there, as in Flask-Mail) and queues
them all with one ``send_many`` when the ``with`` block ends.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

from flask import Flask

from .._compose.message import Message
from .._errors import InvalidMessage
from ..core._internal import QueuedRow, check_message, prepare_row
from .state import EXTENSION_KEY, app_state

if TYPE_CHECKING:
    from ..core._internal import DeliveredMessage


class Mail(Protocol):
    """What the Flask-Mail surface needs of the extension."""

    def send(self, message: Message) -> int: ...

    def record_messages(self) -> AbstractContextManager[list[DeliveredMessage]]: ...

logger = logging.getLogger(__name__)

#: Where Flask-Mail keeps its state, and where code written for it looks.
FLASK_MAIL_KEY = "mail"


class FlaskMailState:
    """Flask-Mail's ``_Mail`` state for an app that uses the outbox.

    The attributes are Flask-Mail's, with the values the outbox uses:
    ``server``, ``port``, ``username``, ``password``, ``use_tls``, ``use_ssl``
    (the default transport's SMTP settings), ``default_sender``,
    ``suppress`` (``MAIL_SUPPRESS_SEND``: the memory transport is in use),
    ``ascii_attachments``; ``debug`` and ``max_emails`` are Flask-Mail's
    ``MAIL_DEBUG`` and ``MAIL_MAX_EMAILS``, read for code that looks at them
    and otherwise unused (SMTP talk is logged through :mod:`logging`, and the
    transport keeps its own connections). The password is kept, never shown
    by ``repr``.
    """

    def __init__(self, ext: Mail, app: Flask) -> None:
        config = app.extensions[EXTENSION_KEY].config
        smtp = config.smtp
        self._ext = ext
        self.server: str = smtp.host
        self.port: int = smtp.port
        self.username: str | None = smtp.username
        self.password: str | None = smtp.password
        self.use_tls: bool = smtp.use_tls
        self.use_ssl: bool = smtp.use_ssl
        self._state = app.extensions[EXTENSION_KEY]
        self.suppress: bool = config.suppress_send
        # Flask-Mail's keys the outbox does not use; they are not in _config's
        # table because nothing in the outbox depends on them.
        self.debug: int = int(app.config.get("MAIL_DEBUG", app.debug))
        self.max_emails: int | None = app.config.get("MAIL_MAX_EMAILS")

    # Flask-Mail's tests and some apps set these after init_app (``mail.default_sender
    # = ...``): the outbox then builds and sends messages with the new value.

    @property
    def default_sender(self) -> str | tuple[str, str] | None:
        """``MAIL_DEFAULT_SENDER`` as the outbox uses it (settable, as in Flask-Mail)."""
        sender: str | tuple[str, str] | None = self._state.config.default_sender
        return sender

    @default_sender.setter
    def default_sender(self, value: str | tuple[str, str] | None) -> None:
        self._state.config = dataclasses.replace(self._state.config, default_sender=value)

    @property
    def ascii_attachments(self) -> bool:
        """``MAIL_ASCII_ATTACHMENTS`` as the outbox uses it (settable, as in Flask-Mail)."""
        return bool(self._state.config.ascii_attachments)

    @ascii_attachments.setter
    def ascii_attachments(self, value: bool) -> None:
        self._state.config = dataclasses.replace(self._state.config,
                                                 ascii_attachments=bool(value))

    def __repr__(self) -> str:
        return (f"<FlaskMailState server={self.server!r} port={self.port!r} "
                f"username={self.username!r} default_sender={self.default_sender!r} "
                f"suppress={self.suppress!r}>")

    def send(self, message: Message) -> int:
        """``mail.send(message)``: queued in the current transaction; the row id."""
        return self._ext.send(message)

    def send_message(self, *args: Any, **kwargs: Any) -> int:
        """``send(Message(*args, **kwargs))``."""
        return self.send(Message(*args, **kwargs))

    def connect(self) -> Connection:
        """Flask-Mail's bulk idiom; see :class:`Connection`."""
        return Connection(self._ext)

    def record_messages(self) -> AbstractContextManager[list[DeliveredMessage]]:
        """``mail.record_messages()``."""
        return self._ext.record_messages()


def register(ext: Mail, app: Flask) -> FlaskMailState:
    """Build the app's :class:`FlaskMailState`; put it at ``app.extensions["mail"]`` if free."""
    state = FlaskMailState(ext, app)
    holder = app.extensions.get(FLASK_MAIL_KEY)
    if holder is None:
        app.extensions[FLASK_MAIL_KEY] = state
    else:
        logger.info("app.extensions[%r] is already held by %s (Flask-Mail?); flask-mail-outbox "
                    "leaves it alone: code that sends through it does not use the outbox",
                    FLASK_MAIL_KEY, type(holder).__module__ + "." + type(holder).__qualname__)
    return state


class Connection:
    """``with mail.connect() as conn: conn.send(msg)``: many emails, one insert.

    ``conn.send(msg)`` validates ``msg`` at once (:class:`InvalidMessage` at
    the call, nothing kept) and keeps it; leaving the block queues every kept
    message in the current transaction with one ``mail.send_many()``, in
    ``conn.send`` order (``conn.ids`` then holds their row ids). The block
    commits nothing: the caller's commit sends them all, a rollback none.
    When the block ends with an exception, the messages kept before it are
    queued all the same (Flask-Mail had sent them by then); the transaction
    decides. ``num_emails`` counts them like Flask-Mail's; ``max_emails``
    (Flask-Mail's reconnect period) has no use here, the transport keeps its
    own connections.
    """

    def __init__(self, ext: Mail) -> None:
        self._ext = ext
        self._rows: list[QueuedRow] = []
        self.num_emails = 0
        self.ids: list[int] = []

    def __enter__(self) -> Self:
        self._rows = []
        self.num_emails = 0
        self.ids = []
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        rows, self._rows = self._rows, []
        if exc is None:
            self.ids = app_state().queue(rows)
            return
        try:
            self.ids = app_state().queue(rows)
        except Exception:
            # The block's own exception goes on; the session is likely unusable.
            logger.exception(
                "mail.connect(): the block raised, and queuing the %d email(s) it had "
                "sent before failed too; they are not in the transaction and will not be "
                "sent", len(rows))

    def send(self, message: Message, envelope_from: str | tuple[str, str] | None = None) -> None:
        """Validate ``message`` and keep it for the insert at the end of the block."""
        if envelope_from is not None:
            raise InvalidMessage("envelope_from", "not supported: the envelope sender is "
                                                  "the message's sender")
        check_message(message)
        self._rows.append(prepare_row(message, app_state().config, key=None, due_at=None))
        self.num_emails += 1

    def send_message(self, *args: Any, **kwargs: Any) -> None:
        """``send(Message(*args, **kwargs))``."""
        self.send(Message(*args, **kwargs))
