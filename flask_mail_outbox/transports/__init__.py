"""Pluggable transports: how a built message leaves the process.

A transport is a class with one required method, :meth:`Transport.send`
(``send_many`` batches by default through it). Built-in transports are chosen
by name in ``OUTBOX_TRANSPORT``; a custom one as ``"package.module:Class"``.
"""

from __future__ import annotations

from ._base import Delivered, Envelope, Failed, Result, Transport
from ._simple import ConsoleTransport, FileTransport, MemoryTransport, NullTransport
from ._smtp import SMTPTransport

__all__ = [
    "ConsoleTransport",
    "Delivered",
    "Envelope",
    "Failed",
    "FileTransport",
    "MemoryTransport",
    "NullTransport",
    "Result",
    "SMTPTransport",
    "Transport",
]
