"""The SMTP transport, on aiosmtplib.

The transport owns an asyncio loop in a daemon thread and a small pool of
open connections. :meth:`SMTPTransport.send_many` spreads a batch over up to
``concurrency`` connections (each one sends its share back to back, reusing
the session), so the delivery thread never opens a connection per email.

One message's transaction on an open session, and the mapping of
aiosmtplib's errors, are in :mod:`._transaction`; the wire in :mod:`._pipeline`.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import aiosmtplib

from .._errors import TransientError, TransportError
from ._base import Envelope, Failed, NotAttempted, Result, Transport
from ._pipeline import Pipe, Session
from ._transaction import map_smtp_error, send_message

if TYPE_CHECKING:
    from .._config import OutboxConfig

_T = TypeVar("_T")


def _local_hostname() -> str:
    # aiosmtplib would call socket.getfqdn(), a DNS lookup per connection;
    # the bare host name needs no network and is what EHLO needs.
    name = socket.gethostname() or "localhost"
    return name if all(c.isalnum() or c in ".-" for c in name) else "localhost"


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

            outcome, keep, follow_written = await send_message(
                client, envelopes[index], timeout=self.settings.timeout,
                begin=functools.partial(self._begin, envelopes[index]), written=written,
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

    def _begin(self, envelope: Envelope) -> bool:
        # Decided in the same step as the add, so cancel_pending() is exact.
        if self._cancelled.is_set():
            return False
        self._started.add(envelope.email_id)
        return True
