"""flask-mail-outbox: email from a Flask app that is never lost and never blocks a request.

``mail.send(msg)`` stores the email in the caller's database transaction; it
is delivered in the background after commit, and a rollback sends nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._errors import (
    ConfigError,
    InvalidMessage,
    OutboxError,
    PermanentError,
    TemplateError,
    TransientError,
    TransportError,
)

if TYPE_CHECKING:
    from ._compose.message import Attachment, Message
    from ._events import DeliveryEvent
    from ._flask.signals import (
        email_dispatched,
        email_event,
        email_failed,
        email_queued,
        email_sent,
        email_unsubscribed,
    )
    from ._mail import OutboxMail
    from ._operator.dashboard import local_debug_only
    from .core import DeliveredMessage, Status, Suppression, SweepReport

#: Where each public name lives, imported on first use (PEP 562): ``import
#: flask_mail_outbox.core`` (which imports this package first) stays free of
#: Flask, and pytest, which loads the test kit's plugin through an entry point in
#: every run, pays for none of the package until a test uses it.
_LAZY = {
    "Attachment": "._compose.message", "Message": "._compose.message",
    "DeliveryEvent": "._events",
    "email_dispatched": "._flask.signals", "email_event": "._flask.signals",
    "email_failed": "._flask.signals", "email_queued": "._flask.signals",
    "email_sent": "._flask.signals", "email_unsubscribed": "._flask.signals",
    "OutboxMail": "._mail", "local_debug_only": "._operator.dashboard",
    "DeliveredMessage": ".core", "Status": ".core", "Suppression": ".core",
    "SweepReport": ".core",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
