"""The transport interface (the shape of httpx's ``BaseTransport``), and its stream.

A transport sends messages; :meth:`Transport.open` opens a :class:`Sending`,
a stream that takes messages one by one with :meth:`Sending.put` and reports
each one's result as soon as it is known, so a caller can keep every
connection busy and record outcomes as they happen. ``send_many`` (one batch,
all results at the end) is a thin wrapper over it. A subclass implements
:meth:`Transport.send` and inherits a stream that sends one message at a
time in a thread of its own; the SMTP transport overrides :meth:`Transport.open`
to send over several connections at once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

from .. import _degrade, _tracing
from .._errors import TransientError, TransportError
from ._settings import TransportSettings


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
    #: Recipients of the message left out of ``recipients`` (the suppression
    #: list): a transport that addresses by the headers (a JSON API) leaves them
    #: out of its To and Cc too. The headers themselves are not changed.
    left_out: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Delivered:
    """The server accepted the message; ``refused`` lists recipients it refused."""

    refused: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    #: The transports this attempt failed on first, with why (see :class:`FailedOver`).
    failovers: tuple[FailedOver, ...] = ()
    #: The provider's id for the message (an API's reply, an SMTP server's
    #: ``queued as ...``), when it gave one.
    provider_message_id: str | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """Nothing was accepted; ``error`` says whether to try again."""

    error: TransportError
    #: The transports this attempt failed on before the one that said ``error``.
    failovers: tuple[FailedOver, ...] = ()


@dataclasses.dataclass(frozen=True)
class FailedOver:
    """One step of a failover: ``transport`` failed with ``error``, ``to`` took the attempt."""

    transport: str
    error: TransportError
    to: str


Result = Delivered | Failed

#: ``report(envelope, result)``: how a :class:`Sending` hands back each result.
Report = Callable[[Envelope, Result], None]

logger = logging.getLogger(__name__)


def said(result: Result) -> str:
    """What a result says, on one line, for a DEBUG line (the server's text, never an
    address: one a reply echoes is masked; the provider's id is kept whole)."""
    steps = _degrade.unaddressed("".join(f"; failed over from {step.transport} ({step.error})"
                                         for step in result.failovers))
    if isinstance(result, Delivered):
        taken = f", provider id {result.provider_message_id}" if result.provider_message_id \
            else ""
        refused = f", {len(result.refused)} recipient(s) refused" if result.refused else ""
        return f"accepted{taken}{refused}{steps}"
    error = result.error
    kind = ("not attempted" if isinstance(error, NotAttempted)
            else "transient failure" if isinstance(error, TransientError) else "refused")
    return f"{kind}: {_degrade.unaddressed(str(error))}{steps}"


class NotAttempted(TransientError):
    """The transport was cancelled before it handed this message to the server.

    The row is released (back to ``queued``, its attempt given back).
    """

    def __init__(self) -> None:
        super().__init__("not attempted: delivery stopped before this message was sent")


class Sending:
    """A stream of sends opened by :meth:`Transport.open`.

    Messages go in with :meth:`put`, results come out through the ``report``
    callback given to :meth:`Transport.open` as each one is known: exactly
    once per message put, in the order the results arrive (not the order of
    the puts when the transport sends over several connections). ``report``
    is called from a thread of the stream, one call at a time, never from
    inside :meth:`put`; it may call :meth:`put` to keep the stream fed, but
    not :meth:`close` (that would wait for itself). An exception it raises is
    logged and sending goes on.

    A stream ends with :meth:`close` (wait for every result) or
    :meth:`cancel_pending` (give up what has not started); after either,
    :meth:`put` raises :class:`RuntimeError`.

    This class does the bookkeeping every stream shares; an implementation
    provides :meth:`_hand_over` and :meth:`_cancel` (and :meth:`_no_more_puts`
    when its threads must hear of :meth:`close`) and calls :meth:`_reported`
    for each result.
    """

    def __init__(self, report: Report) -> None:
        self._report = report
        #: Guards the counters; put() hands over under it, so a put() and a
        #: cancel_pending() never interleave.
        self._lock = threading.Condition()
        self._unreported = 0
        self._closed = False
        self._reporting = threading.local()

    def put(self, envelope: Envelope) -> None:
        """Queue ``envelope`` to be sent; never waits for the network. Thread-safe.

        Raises :class:`RuntimeError` after :meth:`close` or :meth:`cancel_pending`.
        """
        self.put_many([envelope])

    def put_many(self, envelopes: Sequence[Envelope]) -> None:
        """:meth:`put` each of ``envelopes``, in order, in one hand-over."""
        if not envelopes:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("put() on a closed sending stream: open a new one with "
                                   "Transport.open()")
            self._hand_over(envelopes)
            self._unreported += len(envelopes)
        if logger.isEnabledFor(logging.DEBUG):
            for envelope in envelopes:
                logger.debug("Email %d handed to the transport: Message-ID %s, %d recipient(s)",
                             envelope.email_id, envelope.message_id, len(envelope.recipients))

    def pending(self) -> int:
        """How many messages were put and not reported yet."""
        with self._lock:
            return self._unreported

    def cancel_pending(self) -> set[int]:
        """Stop handing new messages to the server; the ids now guaranteed never sent.

        Each message of the answer is reported as ``Failed(NotAttempted())``
        (once, like any result); messages already handed to the server finish
        and are reported normally. The stream takes no more :meth:`put`.
        """
        with self._lock:
            self._closed = True
        return self._cancel()

    def close(self, timeout: float | None = None) -> bool:
        """Take no more :meth:`put`; wait until every message put was reported.

        Returns True when all were, False when ``timeout`` seconds passed first
        (the stream goes on sending; call again to wait more).
        """
        if getattr(self._reporting, "active", False):
            raise RuntimeError("close() from inside the report callback would wait for "
                               "itself: call it from another thread")
        with self._lock:
            was_open, self._closed = not self._closed, True
        if was_open:
            self._no_more_puts()
        with self._lock:
            return self._lock.wait_for(lambda: self._unreported == 0, timeout)

    # -- for implementations ------------------------------------------------------------

    def _hand_over(self, envelopes: Sequence[Envelope]) -> None:
        """Queue ``envelopes`` for sending; called under ``_lock``, must not block."""
        raise NotImplementedError

    def _cancel(self) -> set[int]:
        """Take every queued message back, report each ``Failed(NotAttempted())``; their ids."""
        raise NotImplementedError

    def _no_more_puts(self) -> None:
        """:meth:`close` was called: nothing more will be put."""

    def _reported(self, envelope: Envelope, result: Result) -> None:
        """Hand ``result`` to the report callback; call once per message put."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Email %d: %s", envelope.email_id, said(result))
        self._reporting.active = True
        try:
            self._report(envelope, result)
        except Exception:
            logger.exception("The report callback of a sending stream raised on email %d; "
                             "its result is lost to the caller, and sending goes on",
                             envelope.email_id)
        finally:
            self._reporting.active = False
        with self._lock:
            self._unreported -= 1
            if self._unreported == 0:
                self._lock.notify_all()


class _OneAtATime(Sending):
    """The stream of a transport that only implements :meth:`Transport.send`.

    One sender thread (``outbox-send``, started by the first :meth:`put`)
    takes the messages in the order they were put and sends each with
    ``transport.send``; it ends once the stream is closed and drained, or
    cancelled.
    """

    def __init__(self, transport: Transport, report: Report) -> None:
        super().__init__(report)
        self._transport = transport
        # A deque under the stream's lock rather than a queue.Queue: taking a
        # message and starting it is one step, so cancel_pending() is exact.
        self._queue: collections.deque[Envelope] = collections.deque()
        self._not_attempted: list[Envelope] = []
        self._thread: threading.Thread | None = None

    def _hand_over(self, envelopes: Sequence[Envelope]) -> None:
        self._queue.extend(envelopes)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="outbox-send", daemon=True)
            self._thread.start()
        self._lock.notify_all()

    def _cancel(self) -> set[int]:
        with self._lock:
            never = list(self._queue)
            self._queue.clear()
            # Reported by the sender thread (all reports come from there), as
            # soon as the message it may be sending now is done.
            self._not_attempted.extend(never)
            self._lock.notify_all()
        return {e.email_id for e in never}

    def _no_more_puts(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._queue or self._not_attempted
                                                  or self._closed))
                never, self._not_attempted = self._not_attempted, []
                envelope = self._queue.popleft() if self._queue else None
                if envelope is None and not never:
                    return  # closed, and nothing left
            for unsent in never:
                self._reported(unsent, Failed(NotAttempted()))
            if envelope is not None:
                self._reported(envelope, self._send(envelope))

    def _send(self, envelope: Envelope) -> Result:
        transport = self._transport
        try:
            with _tracing.sending([envelope], f"{type(transport).__name__} send") as traced:
                result = Delivered(refused=transport.send(envelope))
                traced.done([result])
            return result
        except TransportError as exc:
            return Failed(exc)
        except Exception as exc:  # noqa: BLE001 - a broken transport must not lose the email
            _degrade.report(
                f"Transport {type(transport).__name__}.send raised {type(exc).__name__} "
                f"instead of returning results (email {envelope.email_id})",
                consequence="the email is put back to queued and will be retried (it counts "
                            "as a transient failure)",
                fix="fix the transport: send() must return the refused recipients or raise "
                    "TransientError / PermanentError",
                exc=exc)
            return Failed(TransientError(f"transport raised {type(exc).__name__}: {exc}"))


class Transport:
    """Base class of transports.

    Subclasses implement :meth:`send`; they may override :meth:`open` to
    send several messages at once (over several connections, or one
    pipelined one), and :meth:`close` to release connections. Transports are
    created once per process and app. The inherited :meth:`open` calls
    :meth:`send` from the stream's sender thread, one message at a time per
    stream: a transport used by several streams at once must be thread-safe.
    """

    #: Whether it passes on a message's ESMTP parameters (``mail_options``,
    #: ``rcpt_options``): an API has no place for them, so ``send()`` refuses them.
    takes_esmtp_options: ClassVar[bool] = True

    @classmethod
    def entry_keys(cls) -> tuple[str, ...] | None:
        """The keys of its own an ``OUTBOX_TRANSPORTS`` entry of this kind takes.

        None (the base class): the SMTP keys, spelled like Flask-Mail's
        (``MAIL_SERVER``...), as the ``smtp``, ``console``, ``file``,
        ``memory`` and ``null`` kinds take. Besides these, every entry takes
        ``transport``, ``rate_limit``, ``concurrency`` and ``failover``.
        """
        return None

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """Check an entry's own keys at ``init_app``; raise ``ConfigError`` naming one.

        ``options`` holds the entry's keys that are not common to every
        transport; ``prefix`` is how errors name the entry
        (``OUTBOX_TRANSPORTS["name"]``). The base class takes anything.
        """

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse at ``send()`` a message this kind cannot deliver as it is.

        Raise :class:`~flask_mail_outbox.InvalidMessage` naming what (a header
        the provider forbids, too many recipients...); nothing is written. The
        base class takes every message.
        """

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """The transport for one configured entry. The base class takes no settings.

        Override it in a transport that needs its ``OUTBOX_TRANSPORTS`` entry
        (``settings.options`` holds the entry's own keys).
        """
        return cls()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        """Send one message; return refused recipients (``{addr: (code, text)}``).

        Raise :class:`TransientError` when a later attempt may succeed and
        :class:`PermanentError` when it never will.
        """
        raise NotImplementedError

    def open(self, report: Report) -> Sending:
        """Open a stream of sends; each result goes to ``report(envelope, result)``.

        See :class:`Sending` for the contract. This one sends each message
        with :meth:`send` in a thread of its own, in the order they were put:
        a return is ``Delivered(refused=...)``, a :class:`TransportError` is
        ``Failed(error)``, and any other exception (a bug in the transport)
        is logged at ERROR and becomes ``Failed(TransientError(...))``.
        """
        return _OneAtATime(self, report)

    def send_many(self, envelopes: Sequence[Envelope]) -> list[Result]:
        """Send a batch; one result per envelope, in order. Never raises TransportError.

        Puts every envelope into a stream from :meth:`open` and waits for all
        of them.
        """
        if not envelopes:
            return []
        results: list[Result | None] = [None] * len(envelopes)
        # By identity: a batch may hold equal envelopes, each gets its own result.
        places: dict[int, collections.deque[int]] = {}
        for index, envelope in enumerate(envelopes):
            places.setdefault(id(envelope), collections.deque()).append(index)

        def report(envelope: Envelope, result: Result) -> None:
            results[places[id(envelope)].popleft()] = result

        sending = self.open(report)
        sending.put_many(envelopes)
        sending.close()
        return [r if r is not None else Failed(NotAttempted()) for r in results]

    def close(self) -> None:
        """Release connections; the transport may be used again afterwards."""
