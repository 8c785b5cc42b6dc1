"""The transport interface (the shape of httpx's ``BaseTransport``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .._errors import TransientError, TransportError

if TYPE_CHECKING:
    from .._config import OutboxConfig


@dataclasses.dataclass(frozen=True)
class Envelope:
    """One message ready to go: the SMTP envelope and the exact bytes to send."""

    email_id: int
    sender: str
    recipients: tuple[str, ...]
    mime: bytes
    message_id: str
    #: ESMTP parameters for MAIL FROM and for each RCPT TO (Flask-Mail's
    #: ``mail_options`` / ``rcpt_options``); transports without an envelope ignore them.
    mail_options: tuple[str, ...] = ()
    rcpt_options: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Delivered:
    """The server accepted the message; ``refused`` lists recipients it refused."""

    refused: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Failed:
    """Nothing was accepted; ``error`` says whether to try again."""

    error: TransportError


Result = Delivered | Failed


class NotAttempted(TransientError):
    """The transport was cancelled before it handed this message to the server.

    The row is released (back to ``queued``, its attempt given back).
    """

    def __init__(self) -> None:
        super().__init__("not attempted: delivery stopped before this message was sent")


class Transport:
    """Base class of transports.

    Subclasses implement :meth:`send`; they may override :meth:`send_many`
    to send a batch concurrently or over one connection, and :meth:`close`
    to release connections. Transports are created once per process and
    app, and called from one delivery thread at a time.
    """

    def __init__(self, config: OutboxConfig) -> None:
        self.config = config

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        """Send one message; return refused recipients (``{addr: (code, text)}``).

        Raise :class:`TransientError` when a later attempt may succeed and
        :class:`PermanentError` when it never will.
        """
        raise NotImplementedError

    def send_many(self, envelopes: Sequence[Envelope]) -> list[Result]:
        """Send a batch; one result per envelope, in order. Never raises TransportError."""
        results: list[Result] = []
        for envelope in envelopes:
            try:
                results.append(Delivered(refused=self.send(envelope)))
            except TransportError as exc:
                results.append(Failed(exc))
        return results

    def cancel_pending(self) -> set[int] | None:
        """Ask a running :meth:`send_many` to stop handing new messages to the server.

        Returns the ids of the envelopes that are now guaranteed never to be
        sent (they come back as ``Failed(NotAttempted())``), or None when the
        transport cannot tell; the default transport finishes its batch.
        """
        return None

    def close(self) -> None:
        """Release connections; the transport may be used again afterwards."""
