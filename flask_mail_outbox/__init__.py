"""flask-mail-outbox: email from a Flask app that is never lost and never blocks a request.

``mail.send(msg)`` stores the email in the caller's database transaction; it
is delivered in the background after commit, and a rollback sends nothing.
"""

from __future__ import annotations

from ._delivery import DeliveredMessage
from ._errors import (
                      ConfigError,
                      InvalidMessage,
                      OutboxError,
                      PermanentError,
                      TransientError,
                      TransportError,
)
from ._extension import OutboxMail
from ._message import Attachment, Message
from ._models import Status
from ._signals import email_dispatched, email_failed, email_queued, email_sent
from ._sweep import SweepReport

__all__ = [
    "Attachment",
    "ConfigError",
    "DeliveredMessage",
    "InvalidMessage",
    "Message",
    "OutboxError",
    "OutboxMail",
    "PermanentError",
    "Status",
    "SweepReport",
    "TransientError",
    "TransportError",
    "email_dispatched",
    "email_failed",
    "email_queued",
    "email_sent",
]
