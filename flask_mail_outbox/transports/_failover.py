"""Failover: a transport fault moves the attempt to the next transport of a list.

A named transport with ``"failover": ["backup", ...]`` is wrapped in a
:class:`FailoverTransport`. A message whose result is a
:class:`~flask_mail_outbox.TransientError` with ``transport_fault`` (refused
connection, TLS or login failure, timeout, 421) is put into the next
transport's stream, in the same attempt; the steps travel on the final result
(:attr:`Delivered.failovers`) and are written to the row's error history. A
permanent failure, a per-recipient refusal, greylisting and throttling never
fail over: the next server would refuse it too, or send a second copy. Nor
does a failure after which the message may have been accepted
(``maybe_sent``: a drop after the final dot, a timeout after the request
went): it is retried within ``OUTBOX_AMBIGUOUS_RETRIES`` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from .._errors import TransientError
from ._base import Envelope, Failed, FailedOver, Report, Result, Sending, Transport

logger = logging.getLogger(__name__)


def fails_over(result: Result) -> bool:
    """Whether ``result`` says the transport, not the message, failed."""
    return (isinstance(result, Failed) and isinstance(result.error, TransientError)
            and result.error.transport_fault and not result.error.maybe_sent)


class FailoverTransport(Transport):
    """``chain[0]``'s transport, and the ones after it for its transport faults.

    ``chain``: ``(name, transport)`` pairs, the primary first. The transports
    stay their own (connections, concurrency); the runtime closes them.
    """

    def __init__(self, chain: Sequence[tuple[str, Transport]]) -> None:
        if len(chain) < 2:
            raise ValueError("a failover chain needs a transport and at least one more")
        super().__init__()
        self.chain = list(chain)
        self.concurrency = max(1, int(getattr(chain[0][1], "concurrency", 1)))
        self._down = [False] * len(chain)  # said at WARNING until it delivers again

    def send(self, envelope: Envelope) -> dict[str, tuple[int, str]]:
        result = self.send_many([envelope])[0]
        if isinstance(result, Failed):
            raise result.error
        return dict(result.refused)

    def open(self, report: Report) -> Sending:
        return _FailoverSending(self, report)

    def close(self) -> None:
        """Close every transport of the chain (closing one twice is harmless)."""
        for _, transport in self.chain:
            transport.close()

    def note(self, index: int, result: Result) -> None:
        """Say when a transport of the chain starts failing over, and when it is back."""
        name = self.chain[index][0]
        if fails_over(result) and index + 1 < len(self.chain):
            if not self._down[index]:
                self._down[index] = True
                logger.warning(
                    "Transport %r failed (%s); its emails fail over to %r until it "
                    "delivers again", name, result.error, self.chain[index + 1][0])  # type: ignore[union-attr]
        elif self._down[index] and not isinstance(result, Failed):
            self._down[index] = False
            logger.info("Transport %r delivers again; failover to %r ends", name,
                        self.chain[index + 1][0])


class _FailoverSending(Sending):
    """One stream per transport of the chain, the later ones opened on first failover."""

    def __init__(self, transport: FailoverTransport, report: Report) -> None:
        super().__init__(report)
        self._transport = transport
        self._streams: list[Sending | None] = [None] * len(transport.chain)
        self._steps: dict[int, list[FailedOver]] = {}
        self._open_lock = threading.Lock()
        self._ended = False

    def _stream(self, index: int) -> Sending:
        with self._open_lock:
            stream = self._streams[index]
            if stream is None:
                stream = self._streams[index] = self._transport.chain[index][1].open(
                    lambda envelope, result: self._arrived(index, envelope, result))
            return stream

    def _hand_over(self, envelopes: Sequence[Envelope]) -> None:
        self._stream(0).put_many(envelopes)

    def _cancel(self) -> set[int]:
        never: set[int] = set()
        with self._open_lock:
            self._ended = True
            streams = [s for s in self._streams if s is not None]
        for stream in streams:
            never |= stream.cancel_pending()
        return never

    def _no_more_puts(self) -> None:
        with self._open_lock:
            self._ended = True
        if self.pending() == 0:
            self._close_streams()

    def _close_streams(self) -> None:
        with self._open_lock:
            streams = [s for s in self._streams if s is not None]
        # Not from a report callback (a stream cannot close itself from its own).
        threading.Thread(target=lambda: [s.close() for s in streams],
                         name="outbox-failover-close", daemon=True).start()

    def _arrived(self, index: int, envelope: Envelope, result: Result) -> None:
        transport = self._transport
        transport.note(index, result)
        chain = transport.chain
        if fails_over(result) and index + 1 < len(chain):
            step = FailedOver(chain[index][0], result.error, chain[index + 1][0])  # type: ignore[union-attr]
            with self._open_lock:
                ended = self._ended and self._streams[index + 1] is None
            if not ended:
                self._steps.setdefault(envelope.email_id, []).append(step)
                try:
                    self._stream(index + 1).put_many([envelope])
                    return
                except RuntimeError:  # cancelled meanwhile: report the failure as it is
                    self._steps[envelope.email_id].pop()
        steps = tuple(self._steps.pop(envelope.email_id, ()))
        if steps:
            result = dataclasses.replace(result, failovers=steps)
        self._reported(envelope, result)
        with self._open_lock:
            ended = self._ended
        if ended and self.pending() == 0:
            self._close_streams()
