"""flask-mail-outbox: email from a Flask app that is never lost and never blocks a request.

``mail.send(msg)`` stores the email in the caller's database transaction; it
is delivered in the background after commit, and a rollback sends nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._compose.message import Attachment, Message
from ._errors import (
    ConfigError,
    InvalidMessage,
    OutboxError,
    PermanentError,
    TemplateError,
    TransientError,
    TransportError,
)
from ._events import DeliveryEvent
from ._flask.signals import (
    email_dispatched,
    email_event,
    email_failed,
    email_queued,
    email_sent,
    email_unsubscribed,
)
from .core import DeliveredMessage, Status, Suppression, SweepReport

if TYPE_CHECKING:
    from ._mail import OutboxMail
    from ._operator.dashboard import local_debug_only


def __getattr__(name: str) -> Any:
    # OutboxMail imports Flask; importing it on first use keeps `import
    # flask_mail_outbox.core` (which imports this package first) free of Flask.
    if name == "OutboxMail":
        from ._mail import OutboxMail

        globals()["OutboxMail"] = OutboxMail
        return OutboxMail
    if name == "local_debug_only":
        from ._operator.dashboard import local_debug_only

        globals()["local_debug_only"] = local_debug_only
        return local_debug_only
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Attachment",
    "ConfigError",
    "DeliveredMessage",
    "DeliveryEvent",
    "InvalidMessage",
    "Message",
    "OutboxError",
    "OutboxMail",
    "PermanentError",
    "Status",
    "Suppression",
    "SweepReport",
    "TemplateError",
    "TransientError",
    "TransportError",
    "email_dispatched",
    "email_event",
    "email_failed",
    "email_queued",
    "email_sent",
    "email_unsubscribed",
    "local_debug_only",
]
