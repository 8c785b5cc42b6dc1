"""The SMTP transport, on aiosmtplib.

The transport owns an asyncio loop in a daemon thread (``outbox-smtp``) and
a pool of open connections (``_idle``). :meth:`SMTPTransport.open` returns a
stream whose connection workers, up to ``concurrency`` tasks in that loop,
take the messages as they are put: each worker holds one connection and
sends message after message on it while there is work, so no one opens a
connection per email, and a connection that finishes a message takes the
next one at once instead of waiting for a batch to end. The results go to
the stream's reporter thread (``outbox-report``), which calls ``report``, so
a slow callback never stalls the loop.

One message's transaction on an open session, and the mapping of
aiosmtplib's errors, are in :mod:`._transaction`; the wire in :mod:`._pipeline`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import socket
import ssl
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Self

import aiosmtplib

from .. import _tracing
from .._errors import TransientError, TransportError
from ._base import Envelope, Failed, NotAttempted, Report, Result, Sending, Transport
from ._pipeline import Pipe, Session
from ._settings import SMTPSettings, TransportSettings
from ._transaction import map_smtp_error, send_message

__all__ = ["SMTPTransport", "map_smtp_error"]

#: Seconds a connection worker with nothing to send waits for another message
#: before it parks its connection in the pool and ends.
IDLE_SECONDS = 1.0
#: After a connection is refused while others are open (a server that limits
#: connections per client), seconds before the stream tries another one.
CONNECT_BACKOFF_SECONDS = 1.0


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
    """Sends over SMTP with aiosmtplib, several reused connections at a time.

    ``concurrency`` bounds the connections of each open stream.
    """

    def __init__(self, settings: SMTPSettings, *, concurrency: int = 4) -> None:
        super().__init__()
        self.settings = settings
        self.concurrency = max(1, concurrency)
        #: Seconds an idle connection worker waits for more (see :data:`IDLE_SECONDS`).
        self.idle_seconds = IDLE_SECONDS
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hostname = _local_hostname()
        # The streams open() returned, for close(); under _lock.
        self._streams: weakref.WeakSet[_SMTPSending] = weakref.WeakSet()
        # Touched only in the loop thread: open connections no worker holds,
        # and the workers running.
        self._idle: list[Session] = []
        self._workers: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """An SMTP transport for ``settings.smtp``, with ``settings.concurrency`` connections."""
        return cls(settings.smtp, concurrency=settings.concurrency)

    def open(self, report: Report) -> Sending:
        """Open a stream over up to ``concurrency`` connections (see :class:`Sending`).

        Results are reported as each message's last reply arrives, in that
        order. A message put is sent by a worker that is free, or by a new
        worker (a pooled connection, or a new one) while there are fewer than
        ``concurrency``; a worker with nothing to send waits
        :attr:`idle_seconds` for more, then parks its connection. When no
        worker can connect, the messages queued at that moment fail with the
        connection's error; a later :meth:`Sending.put` tries again.
        """
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                # First use, or a forked child, where the parent's thread is gone.
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="outbox-smtp",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                self._idle, self._workers = [], set()
            sending = _SMTPSending(self, self._loop, report)
            self._streams.add(sending)
        return sending

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        result = self.send_many([envelope])[0]
        if isinstance(result, Failed):
            raise result.error
        return result.refused

    def close(self) -> None:
        """Stop every open stream, close the pooled connections and the loop thread.

        What a stream has not started is reported ``Failed(NotAttempted())``;
        what it has finishes first (within MAIL_TIMEOUT). The transport may
        be used again afterwards.
        """
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            streams, self._streams = list(self._streams), weakref.WeakSet()
        if loop is None or thread is None or not thread.is_alive():
            return
        timeout = self.settings.timeout
        # Closing is best effort: what fails here only makes the connections go
        # without their QUIT.
        with contextlib.suppress(Exception):
            for sending in streams:
                sending.cancel_pending()
            asyncio.run_coroutine_threadsafe(self._wind_down(), loop).result(
                timeout=2 * timeout + 2)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=2)
        if not thread.is_alive():
            loop.close()

    # -- coroutines -------------------------------------------------------------

    async def _wind_down(self) -> None:
        if self._workers:
            await asyncio.wait(set(self._workers), timeout=self.settings.timeout + 1)
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
            session = Session(Pipe.take_over(client, secrets=(s.password,)),
                              pipelining=client.supports_extension("pipelining"),
                              size=client.supports_extension("size"),
                              smtputf8=client.supports_extension("smtputf8"),
                              eightbitmime=client.supports_extension("8bitmime"))
        except Exception as exc:
            client.close()
            error = map_smtp_error(exc, secrets=(s.password,))
            if isinstance(error, TransientError) and error.account_fault is None \
                    and cannot_connect(exc):
                # No session at all: if no connection of the stream is up, every
                # message fails with this, and the core pauses the transport.
                error.account_fault, error.transport_fault = "unreachable", True
            raise _ConnectFailed(error) from exc
        return session


def cannot_connect(exc: BaseException) -> bool:
    """Whether ``exc`` says no TCP connection to the server could be made (refused, timing
    out, no route, no such host): not a server that answered badly or late (a greeting
    that never came, a 421), nor a TLS handshake that failed."""
    if isinstance(exc, aiosmtplib.SMTPConnectResponseError):
        return False
    cause = exc.__cause__ if isinstance(exc, aiosmtplib.SMTPConnectError) else exc
    # A reset, abort or broken pipe: the server took the connection, then dropped it.
    return isinstance(cause, OSError) and not isinstance(
        cause, (aiosmtplib.SMTPException, ssl.SSLError, ConnectionResetError,
                ConnectionAbortedError, BrokenPipeError))


class _Job:
    """One message put into a stream, as the loop thread tracks it."""

    __slots__ = ("envelope", "reported", "started")

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        # Handed to the server (its MAIL FROM, or for an envelope written
        # ahead its content, went out): cancel_pending() can no longer stop it.
        self.started = False
        self.reported = False


class _SMTPSending(Sending):
    """The stream of :meth:`SMTPTransport.open`.

    :meth:`put` hands each message to the loop thread; everything else of
    the stream (its queue, its workers, what has started) lives there, so a
    worker's step and a cancel never interleave. Results go through a queue
    to the reporter thread, started by the first :meth:`put`, which ends
    once the stream is closed (or cancelled) and every result reported.
    """

    def __init__(self, transport: SMTPTransport, loop: asyncio.AbstractEventLoop,
                 report: Report) -> None:
        super().__init__(report)
        self._transport, self._loop = transport, loop
        self._results: queue.SimpleQueue[tuple[Envelope, Result] | None] = queue.SimpleQueue()
        self._reporter: threading.Thread | None = None
        # -- the loop thread's -------------------------------------------------------------
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[_Job, None] = {}  # put and not reported, in put order
        self._live = 0  # workers running
        self._busy = 0  # of which sending a message now
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ending = False  # closed or cancelled: workers end once out of work
        self._cancelled = False
        self._no_spawn_until = 0.0

    # -- the caller's side ---------------------------------------------------------------

    def _hand_over(self, envelopes: Sequence[Envelope]) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_results,
                                              name="outbox-report", daemon=True)
            self._reporter.start()
        self._loop.call_soon_threadsafe(self._arrive, [_Job(e) for e in envelopes])

    def _cancel(self) -> set[int]:
        self._results.put(None)  # the reporter may end once drained
        if not self._loop.is_running():
            return set()  # the transport was closed: nothing of this stream runs
        # Decided in the loop thread, between two steps of the workers, so no
        # message can start after the answer was computed.
        future = asyncio.run_coroutine_threadsafe(self._cancel_in_loop(), self._loop)
        return future.result(timeout=5)

    def _no_more_puts(self) -> None:
        self._results.put(None)
        with contextlib.suppress(RuntimeError):  # a closed loop has no workers to tell
            self._loop.call_soon_threadsafe(self._end)

    def _report_results(self) -> None:
        while True:
            item = self._results.get()
            if item is not None:
                self._reported(*item)
            with self._lock:
                if self._closed and self._unreported == 0:
                    return

    # -- the loop thread: the stream --------------------------------------------------------

    def _arrive(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self._jobs[job] = None
        self._queue.extend(jobs)
        self._staff()

    def _staff(self) -> None:
        """Wake idle workers for the queued messages; start workers for what they cannot take."""
        self._wake(len(self._queue))
        transport = self._transport
        while (len(self._queue) > self._live - self._busy and self._live < transport.concurrency
               and not self._cancelled
               and (self._live == 0 or self._loop.time() >= self._no_spawn_until)):
            self._live += 1
            task = self._loop.create_task(self._work())
            transport._workers.add(task)
            task.add_done_callback(transport._workers.discard)

    def _wake(self, count: int) -> None:
        while count > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    def _end(self) -> None:
        self._ending = True
        self._wake(len(self._waiters))

    async def _cancel_in_loop(self) -> set[int]:
        self._ending = self._cancelled = True
        self._queue.clear()
        never = [job for job in self._jobs if not job.started]
        for job in never:
            self._finish(job, Failed(NotAttempted()))
        self._wake(len(self._waiters))
        return {job.envelope.email_id for job in never}

    def _begin(self, job: _Job) -> bool:
        # Asked by the transaction in the step that starts the message, so
        # cancel_pending() never answers with a message that then starts.
        if self._cancelled:
            return False
        job.started = True
        return True

    def _finish(self, job: _Job, result: Result) -> None:
        if job.reported:
            return  # cancel_pending() reported it already
        job.reported = True
        del self._jobs[job]
        self._results.put((job.envelope, result))

    def _requeue(self, job: _Job) -> None:
        """``job`` goes again, first in line: the server accepted nothing of it."""
        if job.reported:
            return
        job.started = False
        self._queue.appendleft(job)
        self._wake(1)

    def _unreachable(self, error: TransportError) -> None:
        """A worker could not connect (it has ended)."""
        if self._live == 0:
            # Nobody can reach the server: what is queued now fails with why,
            # instead of waiting for ever; a later put() tries to connect again.
            while self._queue:
                self._finish(self._queue.popleft(), Failed(error))
        else:
            # Others are connected: the server may limit connections per client.
            self._no_spawn_until = self._loop.time() + CONNECT_BACKOFF_SECONDS

    # -- the loop thread: one connection worker ---------------------------------------------

    async def _work(self) -> None:
        transport = self._transport
        session = transport._idle.pop() if transport._idle else None
        reused = session is not None
        # The message whose MAIL/RCPT/DATA went out with the previous one's content.
        ahead: _Job | None = None
        unreachable: TransportError | None = None
        try:
            while ahead is not None or await self._wait_for_work():
                if session is None:
                    try:
                        session, reused = await transport._connect(), False
                    except _ConnectFailed as exc:
                        unreachable = exc.error
                        return
                written, job = ahead is not None, ahead
                if job is None:
                    if not self._queue:
                        continue  # another connection took it while this one connected
                    job = self._queue.popleft()
                self._busy += 1
                try:
                    session, reused, ahead = await self._send_on(session, job, written=written,
                                                                 reused=reused)
                finally:
                    self._busy -= 1
        finally:
            self._live -= 1
            if session is not None and session.is_connected:
                transport._idle.append(session)
            if unreachable is not None:
                self._unreachable(unreachable)
            self._staff()  # what is queued may need a worker again

    async def _wait_for_work(self) -> bool:
        """Until a message is queued: False when this worker should end instead."""
        deadline = self._loop.time() + self._transport.idle_seconds
        while not self._queue:
            remaining = deadline - self._loop.time()
            if self._ending or remaining <= 0:
                return False
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            await asyncio.wait({waiter}, timeout=remaining)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        return not self._cancelled

    async def _send_on(self, session: Session, job: _Job, *, written: bool, reused: bool
                       ) -> tuple[Session | None, bool, _Job | None]:
        """Send ``job`` on ``session``.

        Returns the session to go on with (None once closed), whether it has
        sent before (a dead pooled connection is not the message's fault), and
        the message whose envelope went ahead with this one's content.
        """
        taken: list[_Job] = []

        def take_follow() -> Envelope | None:
            # Only what the other connections will not take next: the queue's
            # tail is spread over every connection, not queued behind one.
            if self._cancelled or len(self._queue) < self._live:
                return None
            taken.append(self._queue.popleft())
            return taken[0].envelope

        settings = self._transport.settings
        with _tracing.sending([job.envelope], "smtp transaction",
                              (settings.host, settings.port)) as traced:
            outcome, keep, follow_written = await send_message(
                session, job.envelope, timeout=settings.timeout,
                begin=lambda: self._begin(job), written=written,
                take_follow=take_follow if session.pipelining else None)
            if outcome is not None:
                traced.done([outcome])
        follow = taken[0] if taken else None
        if follow is not None and not (follow_written and keep):
            # Not written, or written on a connection that is now dropped: the
            # server accepted nothing of it; it goes again on a live one.
            self._requeue(follow)
        if outcome is None:
            if keep:
                return session, reused, None  # stopped before it started; the session is clean
            session.pipe.close()
            if self._cancelled:
                # Never accepted, and delivery stops (cancel_pending() may have
                # reported it already).
                self._finish(job, Failed(NotAttempted()))
            elif reused or written:
                # The connection was gone before the server saw anything of this
                # message (a pooled one closed while idle, or it died under the
                # envelope sent ahead): send on a fresh one, the row not charged.
                self._requeue(job)
            else:
                self._finish(job, Failed(TransientError("connection lost before MAIL FROM",
                                                       transport_fault=True)))
            return None, False, None
        self._finish(job, outcome)
        if not keep:
            session.pipe.close()
            return None, False, None
        return session, True, follow if follow_written else None
