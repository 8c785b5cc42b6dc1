"""Pluggable transports: how a built message leaves the process.

A transport is a class with one required method, :meth:`Transport.send`;
:meth:`Transport.open` streams messages through it (a :class:`Sending`: put
messages in, each result is reported as it is known) and ``send_many`` sends a
batch over such a stream. Built-in transports are chosen by name in
``OUTBOX_TRANSPORT`` (:data:`BUILTIN`); a custom one as
``"package.module:Class"``. Each is built from its own
:class:`TransportSettings` (:meth:`Transport.from_settings`), never from the
whole app config.
"""

from __future__ import annotations

from ._base import (
    Delivered,
    Envelope,
    Failed,
    FailedOver,
    NotAttempted,
    Report,
    Result,
    Sending,
    Transport,
)
from ._failover import FailoverTransport
from ._mailbox import MailboxTransport
from ._registry import (
    API_KINDS,
    BUILTIN,
    build,
    is_builtin,
    transport_class,
)
from ._settings import SMTPSettings, TransportSettings
from ._simple import ConsoleTransport, FileTransport, MemoryTransport, NullTransport
from ._smtp import SMTPTransport

__all__ = [
    "API_KINDS",
    "BUILTIN",
    "ConsoleTransport",
    "Delivered",
    "Envelope",
    "Failed",
    "FailedOver",
    "FailoverTransport",
    "FileTransport",
    "MailboxTransport",
    "MemoryTransport",
    "NotAttempted",
    "NullTransport",
    "Report",
    "Result",
    "SMTPSettings",
    "SMTPTransport",
    "Sending",
    "Transport",
    "TransportSettings",
    "build",
    "is_builtin",
    "transport_class",
]
