"""Transports that need no server: console, file, memory, null."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Self

from .._errors import PermanentError, TransientError, TransportError
from ._base import Envelope, Transport
from ._replies import ReplyClass, classify_reply
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


#: What :meth:`Failures.add` can make a send fail with, and the reply a server
#: would give for it (code, text): the errors are built from these as the SMTP
#: transport builds them from a real reply (:func:`._replies.classify_reply`).
FAILURE_REPLIES: dict[str, tuple[int, str]] = {
    "transient": (451, "4.3.0 Temporary local problem, try again later (fail_next)"),
    "permanent": (550, "5.7.1 Message refused (fail_next)"),
    "throttle": (421, "4.7.0 Too many messages, slow down (fail_next)"),
    "account": (535, "5.7.8 Authentication credentials invalid (fail_next)"),
}


class Failures:
    """Sends a test scripted to fail: "the next ``count`` sends (to ``to``, or any)".

    Shared by the memory transports of one outbox, so that "the next send"
    means the next one whichever named transport makes it. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[list[Any]] = []  # [left, to (lowercased) or None, kind, code, text]

    def add(self, count: int = 1, *, to: str | None = None, kind: str = "transient",
            message: str | None = None) -> None:
        """Make the next ``count`` sends to ``to`` (any recipient of it; None: any send) fail.

        ``kind``: ``"transient"`` (a 451: retried with backoff), ``"permanent"``
        (a 550: dead-lettered) or ``"throttle"`` (a 421 rate reply: deferred,
        the attempt given back) or ``"account"`` (a 535 refusing the credentials:
        the transport is paused, the attempt given back, see
        docs/guide/modes.md, "A paused transport"); ``message``: the server's text instead of the
        default one. Rules are used in the order they were added. Raises
        :class:`ValueError` for a bad argument.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a whole number >= 1, got {count!r}")
        if kind not in FAILURE_REPLIES:
            raise ValueError(f"kind must be one of {', '.join(map(repr, FAILURE_REPLIES))}, "
                             f"got {kind!r}")
        if to is not None and (not isinstance(to, str) or "@" not in to):
            raise ValueError(f"to must be an email address or None, got {to!r}")
        if message is not None and (not isinstance(message, str) or not message.strip()):
            raise ValueError(f"message must be a non-empty str or None, got {message!r}")
        code, text = FAILURE_REPLIES[kind]
        with self._lock:
            self._rules.append([count, None if to is None else to.lower(), kind, code,
                                message or text])

    def pending(self) -> int:
        """How many scripted failures are still to come."""
        with self._lock:
            return sum(rule[0] for rule in self._rules)

    def clear(self) -> None:
        """Forget every scripted failure."""
        with self._lock:
            self._rules.clear()

    def take(self, envelope: Envelope) -> TransportError | None:
        """The error the send of ``envelope`` fails with (counted), or None: it goes."""
        recipients = {address.lower() for address in envelope.recipients}
        with self._lock:
            for rule in self._rules:
                if rule[1] is None or rule[1] in recipients:
                    rule[0] -= 1
                    if rule[0] == 0:
                        self._rules.remove(rule)
                    return _failure(rule[2], rule[3], rule[4])
        return None


def _failure(kind: str, code: int, text: str) -> TransportError:
    """The error a real server's ``code text`` reply becomes (as the SMTP transport maps it)."""
    if kind == "permanent":
        return PermanentError(text, code=code)
    if kind == "throttle":
        return TransientError(text, code=code, throttled=True)
    if kind == "account":
        return TransientError(text, code=code, account_fault="credentials")
    return TransientError(text, code=code,
                          throttled=classify_reply(code, text) is ReplyClass.THROTTLED)


class MemoryTransport(Transport):
    """Keeps messages in ``outbox`` (tests; what ``MAIL_SUPPRESS_SEND`` selects).

    ``failures`` (a :class:`Failures`) makes scripted sends fail as a real
    server would (``fail_next``); those are not kept.
    """

    def __init__(self) -> None:
        super().__init__()
        self.outbox: list[Envelope] = []
        self._lock = threading.Lock()
        self.failures = Failures()

    def fail_next(self, count: int = 1, *, to: str | None = None, kind: str = "transient",
                  message: str | None = None) -> None:
        """Make the next ``count`` sends fail (see :meth:`Failures.add`)."""
        self.failures.add(count, to=to, kind=kind, message=message)

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        error = self.failures.take(envelope)
        if error is not None:
            raise error
        with self._lock:
            self.outbox.append(envelope)
        return {}


class NullTransport(Transport):
    """Accepts and drops every message."""

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        return {}
