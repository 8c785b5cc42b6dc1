"""Transports that need no server: console, file, memory, null."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Self

from ._base import Envelope, Transport
from ._settings import TransportSettings


class ConsoleTransport(Transport):
    """Writes each message to standard output (development)."""

    _lock = threading.Lock()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        text = envelope.mime.decode("utf-8", "replace").replace("\r\n", "\n")
        with self._lock:
            sys.stdout.write(
                f"---------- email {envelope.email_id} ----------\n"
                f"Envelope-From: {envelope.sender}\n"
                f"Envelope-To: {', '.join(envelope.recipients)}\n{text}\n"
                "---------- end of email ----------\n"
            )
            sys.stdout.flush()
        return {}


class FileTransport(Transport):
    """Writes one ``.eml`` file per message into ``OUTBOX_FILE_PATH``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """A file transport writing into ``settings.file_path``."""
        return cls(settings.file_path)

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        os.makedirs(self.path, exist_ok=True)
        name = f"{envelope.email_id:010d}-{envelope.message_id.strip('<>').replace('/', '_')}.eml"
        final = os.path.join(self.path, name)
        partial = final + ".part"
        # Write then rename, so a reader never sees half a message.
        with open(partial, "wb") as handle:
            handle.write(envelope.mime)
        os.replace(partial, final)
        return {}


class MemoryTransport(Transport):
    """Keeps messages in ``outbox`` (tests; what ``MAIL_SUPPRESS_SEND`` selects)."""

    def __init__(self) -> None:
        super().__init__()
        self.outbox: list[Envelope] = []
        self._lock = threading.Lock()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        with self._lock:
            self.outbox.append(envelope)
        return {}


class NullTransport(Transport):
    """Accepts and drops every message."""

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        return {}
