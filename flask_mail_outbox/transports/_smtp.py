"""The SMTP transport, on aiosmtplib.

The transport owns an asyncio loop in a daemon thread and a small pool of
open connections. :meth:`SMTPTransport.send_many` spreads a batch over up to
``concurrency`` connections (each one sends its share back to back, reusing
the session), so the delivery thread never opens a connection per email.

aiosmtplib's errors are mapped here, and only here, onto
:class:`TransientError` (4xx, timeouts, dropped connections, login failures,
which are configuration problems that a fix resolves) and
:class:`PermanentError` (5xx). No credential ever reaches an error text.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import aiosmtplib

from .._errors import PermanentError, TransientError, TransportError
from ._base import Delivered, Envelope, Failed, NotAttempted, Result, Transport
from ._pipeline import Pipe, Session, dot_stuffed, envelope_commands
from ._replies import ReplyClass, classify_reply

if TYPE_CHECKING:
    from .._config import OutboxConfig

_T = TypeVar("_T")


def _local_hostname() -> str:
    # aiosmtplib would call socket.getfqdn(), a DNS lookup per connection;
    # the bare host name needs no network and is what EHLO needs.
    name = socket.gethostname() or "localhost"
    return name if all(c.isalnum() or c in ".-" for c in name) else "localhost"


def _is_throttle(code: int, text: str) -> bool:
    return classify_reply(code, text) is ReplyClass.THROTTLED


def map_smtp_error(exc: BaseException) -> TransportError:
    """Translate an aiosmtplib (or socket) error into the outbox's error tree."""
    if isinstance(exc, aiosmtplib.SMTPAuthenticationError):
        # A bad password is fixed by configuration, not by giving up on the email.
        return TransientError(f"authentication failed: {exc.message}", code=exc.code)
    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        codes = [err.code for err in exc.recipients]
        text = "; ".join(f"{err.recipient}: {err.code} {err.message}" for err in exc.recipients)
        if all(code >= 500 for code in codes):
            return PermanentError(f"every recipient refused: {text}", code=max(codes))
        # Throttled only when every temporary refusal says so (Gmail's 450 4.2.1
        # "receiving mail at a rate" comes at RCPT): one greylisting recipient
        # means the attempt counts.
        temporary = [err for err in exc.recipients if err.code < 500]
        return TransientError(f"every recipient refused: {text}", code=min(codes),
                              throttled=all(_is_throttle(err.code, err.message)
                                            for err in temporary))
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        if isinstance(exc, aiosmtplib.SMTPConnectResponseError) or exc.code < 500:
            return TransientError(exc.message, code=exc.code,
                                  throttled=_is_throttle(exc.code, exc.message))
        return PermanentError(exc.message, code=exc.code)
    if isinstance(exc, (aiosmtplib.SMTPTimeoutError, TimeoutError)):
        return TransientError(f"timed out: {exc}")
    if isinstance(exc, (aiosmtplib.SMTPException, OSError)):
        return TransientError(f"{type(exc).__name__}: {exc}")
    return TransientError(f"unexpected {type(exc).__name__}: {exc}")


class _ConnectFailed(Exception):
    def __init__(self, error: TransportError) -> None:
        super().__init__(str(error))
        self.error = error


class SMTPTransport(Transport):
    """Sends over SMTP with aiosmtplib, several reused connections at a time."""

    def __init__(self, config: OutboxConfig, *, concurrency: int = 4) -> None:
        super().__init__(config)
        self.settings = config.smtp
        self.concurrency = max(1, concurrency)
        self._idle: list[Session] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hostname = _local_hostname()
        self._cancelled = threading.Event()
        # Touched only in the loop thread: the batch in flight and what has started.
        self._batch_ids: set[int] = set()
        self._started: set[int] = set()

    # -- the loop thread ----------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="outbox-smtp",
                                          daemon=True)
                thread.start()
                self._loop, self._thread, self._idle = loop, thread, []
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        result = self.send_many([envelope])[0]
        if isinstance(result, Failed):
            raise result.error
        return result.refused

    def send_many(self, envelopes: Sequence[Envelope]) -> list[Result]:
        if not envelopes:
            return []
        self._cancelled.clear()
        return self._run(self._send_batch(list(envelopes)))

    def cancel_pending(self) -> set[int] | None:
        loop = self._loop
        if loop is None or not loop.is_running():
            self._cancelled.set()
            return set()
        # Decided in the loop thread, between two steps of the senders, so no
        # message can start after the answer was computed.
        return asyncio.run_coroutine_threadsafe(self._cancel(), loop).result(timeout=5)

    async def _cancel(self) -> set[int]:
        self._cancelled.set()
        return self._batch_ids - self._started

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_idle(), loop).result(
                timeout=self.settings.timeout + 1)
        except Exception:  # noqa: BLE001 - closing is best effort; QUIT is a courtesy
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=2)
        if not thread.is_alive():
            loop.close()

    # -- coroutines -------------------------------------------------------------

    async def _close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for session in idle:
            try:
                await session.pipe.quit(self.settings.timeout)
            except Exception:  # noqa: BLE001 - the connection is going away anyway
                session.pipe.close()
        if idle:
            # A TLS transport closes its socket only after the close_notify
            # exchange; give it a few loop turns before the loop goes away.
            await asyncio.sleep(0.05)

    async def _connect(self) -> Session:
        s = self.settings
        client = aiosmtplib.SMTP(
            hostname=s.host, port=s.port, use_tls=s.use_ssl,
            # Explicit both ways: aiosmtplib's default (None) upgrades whenever
            # offered, and MAIL_USE_TLS=True must never fall back to plain text.
            start_tls=s.use_tls,
            validate_certs=s.tls_verify, cert_bundle=s.tls_ca_file,
            timeout=s.timeout, local_hostname=self._hostname,
        )
        try:
            await client.connect()
            if s.username:
                await client.login(s.username, s.password or "")
            elif client.is_ehlo_or_helo_needed:
                try:
                    await client.ehlo()
                except aiosmtplib.SMTPHeloError:
                    if not client.is_connected:
                        raise
                    await client.helo()
            session = Session(Pipe.take_over(client),
                              pipelining=client.supports_extension("pipelining"),
                              size=client.supports_extension("size"))
        except Exception as exc:
            client.close()
            raise _ConnectFailed(map_smtp_error(exc)) from exc
        return session

    async def _send_batch(self, envelopes: list[Envelope]) -> list[Result]:
        self._batch_ids = {e.email_id for e in envelopes}
        self._started = set()
        results: list[Result | None] = [None] * len(envelopes)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(len(envelopes)):
            queue.put_nowait(index)
        workers = min(self.concurrency, len(envelopes))
        live = [workers]
        try:
            await asyncio.gather(*(self._worker(queue, envelopes, results, live)
                                   for _ in range(workers)))
        finally:
            # A later cancel_pending() must not answer with this batch's ids.
            self._batch_ids, self._started = set(), set()
        return [r if r is not None else Failed(NotAttempted()) for r in results]

    async def _worker(self, queue: asyncio.Queue[int], envelopes: list[Envelope],
                      results: list[Result | None], live: list[int]) -> None:
        client: Session | None = self._idle.pop() if self._idle else None
        reused = client is not None
        # The message whose MAIL/RCPT/DATA went out with the previous one's content.
        ahead: int | None = None
        while ahead is not None or (not queue.empty() and not self._cancelled.is_set()):
            if client is None:
                try:
                    client = await self._connect()
                    reused = False
                except _ConnectFailed as exc:
                    live[0] -= 1
                    if live[0] == 0:
                        # Nobody can reach the server: the rest of the batch fails with why.
                        while not queue.empty():
                            results[queue.get_nowait()] = Failed(exc.error)
                    return
            written = ahead is not None
            if ahead is not None:
                index, ahead = ahead, None
            else:
                try:
                    index = queue.get_nowait()
                except asyncio.QueueEmpty:
                    # Another connection took the last message while this one connected.
                    break
            taken: list[int] = []

            def take_follow(taken: list[int] = taken) -> Envelope | None:
                # Only what the other connections will not take next: a batch's
                # tail is spread over every connection, not queued behind one.
                if self._cancelled.is_set() or queue.qsize() < live[0]:
                    return None
                taken.append(queue.get_nowait())
                return envelopes[taken[0]]

            outcome, keep, follow_written = await self._send_one(
                client, envelopes[index], written=written,
                take_follow=take_follow if client.pipelining else None)
            follow = taken[0] if taken else None
            if follow is not None and not (follow_written and keep):
                # Not written, or written on a connection that is now dropped: the
                # server accepted nothing of it; it goes again on a live one.
                queue.put_nowait(follow)
            if outcome is None:
                client.pipe.close()
                client = None
                if self._cancelled.is_set():
                    break  # stopped before its content: never sent (NotAttempted)
                if reused or written:
                    # The connection was gone before the server saw anything of this
                    # message (a pooled one closed while idle, or it died under the
                    # envelope sent ahead): send on a fresh one, the row not charged.
                    reused = False
                    queue.put_nowait(index)
                    continue
                results[index] = Failed(TransientError("connection lost before MAIL FROM"))
                continue
            results[index] = outcome
            reused = True
            if not keep:
                client.pipe.close()
                client = None
            elif follow_written:
                ahead = follow
        if client is not None and client.is_connected:
            self._idle.append(client)

    def _envelope_group(self, session: Session, envelope: Envelope) -> list[bytes]:
        """MAIL FROM (with SIZE when offered) and the RCPT TO lines of ``envelope``."""
        options = list(envelope.mail_options)
        if session.size and not any(o.upper().startswith("SIZE=") for o in options):
            options.append(f"SIZE={len(envelope.mime)}")
        return envelope_commands(envelope.sender, envelope.recipients, options,
                                 envelope.rcpt_options)

    async def _send_one(self, session: Session, envelope: Envelope, *, written: bool = False,
                        take_follow: Callable[[], Envelope | None] | None = None
                        ) -> tuple[Result | None, bool, bool]:
        """Send on ``session``; returns (result, keep connection, ``follow`` written).

        A result of None means the connection was dead before the server saw
        anything of this message (safe to resend at once). ``written``: this
        message's MAIL, RCPTs and DATA went out already, after the previous
        message's content; it counts as started (see :meth:`cancel_pending`)
        only when its content goes, and a stop before that closes the
        connection instead (nothing was accepted). ``take_follow``
        (pipelining servers only) gives the next message, whose MAIL, RCPTs
        and DATA go out with this one's content: one write and one round trip
        per message (RFC 2920 allows the content first in a group); when it
        was written, the caller sends it next on this connection, or again on
        another one if this one is dropped.
        """
        pipe, timeout = session.pipe, self.settings.timeout
        started = finished = follow_written = False
        if not written:
            if self._cancelled.is_set():
                # Stopped while this connection opened: reported never sent, so it
                # must not start now (decided in the same step as the add below).
                return None, True, False
            self._started.add(envelope.email_id)
        try:
            # An envelope that went ahead was built and written with the last content.
            lines = [] if written else self._envelope_group(session, envelope)
            content = dot_stuffed(envelope.mime)
            if not written and pipe.discard_unsolicited():
                return None, False, False
            try:
                if written:
                    pass
                elif session.pipelining:
                    # MAIL, every RCPT and DATA in one write (RFC 2920).
                    pipe.write(b"".join(lines) + b"DATA\r\n")
                else:
                    pipe.write(lines[0])
                reply = await pipe.read(timeout)
            except aiosmtplib.SMTPServerDisconnected:
                return None, False, False
            started = True
            if session.pipelining:
                try:
                    replies = [await pipe.read(timeout) for _ in envelope.recipients]
                    data_reply: aiosmtplib.SMTPResponse | None = await pipe.read(timeout)
                except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError):
                    if written:
                        # Its envelope went ahead and its content never did: resend
                        # it on a fresh connection, uncharged.
                        return None, False, False
                    raise
                if reply.code != 250 and data_reply is not None and data_reply.code == 354:
                    # A server that took DATA after refusing MAIL: end it, so that
                    # the RSET below is read as a command, not as content.
                    await pipe.command(b".\r\n", timeout)
            else:
                replies = []
                if reply.code == 250:
                    for line in lines[1:]:
                        replies.append(await pipe.command(line, timeout))
                data_reply = None
            if reply.code != 250:
                raise aiosmtplib.SMTPSenderRefused(reply.code, reply.message, envelope.sender)
            refused: dict[str, tuple[int, str]] = {}
            refusals: list[aiosmtplib.SMTPRecipientRefused] = []
            for recipient, answer in zip(envelope.recipients, replies):
                if answer.code not in (250, 251):
                    refusals.append(aiosmtplib.SMTPRecipientRefused(
                        answer.code, answer.message, recipient))
                    refused[recipient] = (answer.code, answer.message)
            if len(refusals) == len(envelope.recipients):
                if data_reply is not None and data_reply.code == 354:
                    # The server took DATA with nobody to deliver to: end it empty.
                    await pipe.command(b".\r\n", timeout)
                raise aiosmtplib.SMTPRecipientsRefused(refusals)
            if data_reply is None:
                data_reply = await pipe.command(b"DATA\r\n", timeout)
            if data_reply.code != 354:
                raise aiosmtplib.SMTPDataError(data_reply.code, data_reply.message)
            if envelope.email_id not in self._started:
                if self._cancelled.is_set():
                    # Its envelope went ahead, but delivery stops: after 354 only
                    # closing the connection ends the transaction without a message.
                    pipe.close()
                    return None, False, False
                self._started.add(envelope.email_id)
            follow = take_follow() if take_follow is not None else None
            group = b""
            if follow is not None:
                try:
                    group = b"".join(self._envelope_group(session, follow)) + b"DATA\r\n"
                except ValueError:
                    group = b""  # it fails on its own turn, not inside this one
            pipe.write(content + group)
            follow_written = bool(group)
            done = await pipe.read(timeout)
            finished = True
            if done.code != 250:
                raise aiosmtplib.SMTPDataError(done.code, done.message)
            return Delivered(refused=refused), True, follow_written
        except Exception as exc:  # noqa: BLE001 - every error becomes a result
            error = map_smtp_error(exc)
            keep = pipe.is_connected and isinstance(
                exc, (aiosmtplib.SMTPResponseException, aiosmtplib.SMTPRecipientsRefused))
            if keep and started and not finished:
                # A transaction left open; none is open after the content's reply
                # (and an RSET then would cancel the envelope sent ahead).
                try:
                    reset = await pipe.command(b"RSET\r\n", timeout)
                    keep = reset.code == 250
                except Exception:  # noqa: BLE001 - a failed RSET means a new connection
                    keep = False
            return Failed(error), keep, follow_written
