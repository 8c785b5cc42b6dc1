"""The send phase of an SMTP session, pipelined (RFC 2920).

aiosmtplib opens the session (TCP or TLS, EHLO, STARTTLS, AUTH): that part
is security-sensitive and its code is well tried. It then waits for a reply
after every command, four round trips per message (MAIL, RCPT, DATA, the
content), and its protocol object keeps one reply at a time, so it cannot
read the replies of commands sent together. Once the session is open, the
transport is handed to :class:`Pipe`, which queues every reply it parses.
:func:`~flask_mail_outbox.transports._transaction.send_message` then writes a
message's MAIL, RCPTs and DATA as one group when the server offers
``PIPELINING`` (one command at a time when it does not), in the same write
as the previous message's content (RFC 2920 lets the content open a group):
one write and one round trip per message.

Errors are aiosmtplib's exception types, so ``map_smtp_error`` maps them
like any other aiosmtplib error.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass

import aiosmtplib
from aiosmtplib import SMTPResponse

from .._outside import clean_text, redact

_LINE_ENDINGS = re.compile(rb"\r\n|\n|\r(?!\n)")
_LEADING_DOT = re.compile(rb"(?m)^\.")
_PROHIBITED_IN_ADDRESS = re.compile(rb"[\x00-\x1f\x7f\s]")
_PROHIBITED_IN_COMMAND = re.compile(rb"[\x00-\x1f\x7f]")
_MAX_LINE = 8192
_MAX_REPLY = 65536


class Pipe(asyncio.Protocol):
    """Reads SMTP replies into a queue; every reply is kept, however they arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 secrets: Sequence[str | None] = ()) -> None:
        self._loop = loop
        #: Credentials of ours a reply must never carry on (a server that echoes them).
        self._secrets = tuple(secrets)
        self._buffer = bytearray()
        self._lines: list[bytes] = []
        self._replies: collections.deque[SMTPResponse] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        # One timer per connection, moved forward by each read (see read()).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    @classmethod
    def take_over(cls, client: aiosmtplib.SMTP, secrets: Sequence[str | None] = ()) -> Pipe:
        """Move ``client``'s open session (after EHLO and AUTH) onto a Pipe.

        ``secrets`` (the password) are replaced by ``[redacted]`` in every reply.
        """
        transport = client.transport
        if transport is None or transport.is_closing():
            raise aiosmtplib.SMTPServerDisconnected("Connection lost")
        pipe = cls(asyncio.get_running_loop(), secrets)
        pipe.transport = transport  # type: ignore[assignment]
        transport.set_protocol(pipe)
        # aiosmtplib must not touch the transport any more (it would close it).
        client.transport = None
        return pipe

    # -- asyncio.Protocol ------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        end = buffer.rfind(b"\n")
        if end >= 0:
            # Every complete line at once: one copy and one cut of the buffer,
            # not one of each per line.
            lines = bytes(buffer[:end]).split(b"\n")
            del buffer[:end + 1]
            for line in lines:
                try:
                    code = int(line[:3])
                except ValueError:
                    line += b"\n"
                    self._fail(aiosmtplib.SMTPResponseException(
                        -1, f"Malformed SMTP response line: {line[:80]!r}"))
                    return
                text = line[4:].strip(b" \t\r\n")
                if line[3:4] == b"-":
                    self._lines.append(text)
                    if sum(len(x) for x in self._lines) > _MAX_REPLY:
                        self._fail(aiosmtplib.SMTPResponseException(-1, "Response too long"))
                        return
                    continue
                if self._lines:
                    self._lines.append(text)
                    text = b"\n".join(self._lines)
                    self._lines = []
                self._replies.append(SMTPResponse(code, self._safe(text)))
        if len(buffer) > _MAX_LINE:
            self._fail(aiosmtplib.SMTPResponseException(-1, "Response too long"))
        self._wake()

    def _safe(self, text: bytes) -> str:
        # The one place a reply of the send phase enters: made safe to store and
        # log (a NUL, a control character, a huge text), our credentials removed.
        safe = clean_text(text)
        return redact(safe, self._secrets) if self._secrets else safe

    def eof_received(self) -> bool:
        self._fail(aiosmtplib.SMTPServerDisconnected("Unexpected EOF received"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(aiosmtplib.SMTPServerDisconnected(
            f"Connection lost: {exc}" if exc else "Connection lost"))
        self.transport = None

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the client side -------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._error is None and self.transport is not None \
            and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.is_connected:
            raise self._error or aiosmtplib.SMTPServerDisconnected("Connection lost")
        self.transport.write(data)  # type: ignore[union-attr]

    async def read(self, timeout: float | None) -> SMTPResponse:
        """The next reply, in the order the commands were written."""
        while not self._replies:
            if self._error is not None:
                raise self._error
            waiter = self._waiter = self._loop.create_future()
            if timeout is not None:
                # Not a timer per read (two per message): the deadline moves, and
                # the one timer, when it fires early, sets itself for the new one.
                self._deadline = self._loop.time() + timeout
                if self._timer is None:
                    self._timer = self._loop.call_at(self._deadline, self._check_deadline)
            await waiter
        return self._replies.popleft()

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # no read waiting; the next read arms the timer again
        if self._loop.time() >= self._deadline:
            waiter.set_exception(aiosmtplib.SMTPReadTimeoutError(
                "Timed out waiting for server response"))
        else:
            self._timer = self._loop.call_at(self._deadline, self._check_deadline)

    def discard_unsolicited(self) -> bool:
        """Before a new transaction: True when the server spoke unasked (a 421 while idle).

        The connection is then closed; what it said answers no command of ours.
        """
        if self._replies or self._buffer or self._lines:
            self.close()
            return True
        return False

    async def command(self, line: bytes, timeout: float | None) -> SMTPResponse:
        self.write(line)
        return await self.read(timeout)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._error is None:
            self._error = aiosmtplib.SMTPServerDisconnected("Connection closed")

    async def quit(self, timeout: float | None) -> None:
        try:
            await self.command(b"QUIT\r\n", timeout)
        finally:
            self.close()


@dataclass
class Session:
    """An open, authenticated session and what the server offered."""

    pipe: Pipe
    pipelining: bool
    size: bool
    #: RFC 6531: the server takes UTF-8 addresses and headers (MAIL ... SMTPUTF8).
    smtputf8: bool = False
    #: RFC 6152: the server takes 8-bit content (MAIL ... BODY=8BITMIME).
    eightbitmime: bool = False

    @property
    def is_connected(self) -> bool:
        return self.pipe.is_connected


def _address(address: str, utf8: bool) -> bytes:
    # An SMTPUTF8 transaction carries UTF-8 addresses (RFC 6531); any other is ASCII.
    data = f"<{address}>".encode("utf-8" if utf8 else "ascii")
    if _PROHIBITED_IN_ADDRESS.search(data, 1, len(data) - 1):
        raise ValueError("address contains a prohibited character")
    return data


def envelope_commands(sender: str, recipients: Sequence[str], mail_options: Sequence[str],
                      rcpt_options: Sequence[str], *, utf8: bool = False) -> list[bytes]:
    """MAIL FROM, then one RCPT TO per recipient, each a CRLF-ended line.

    ``utf8``: the transaction is SMTPUTF8 (``mail_options`` says so), so the
    addresses may be UTF-8; otherwise a non-ASCII one raises ``ValueError``.
    """
    mail = b"MAIL FROM:" + _address(sender, utf8)
    if mail_options:
        mail += b" " + " ".join(mail_options).encode("ascii")
    rcpt_tail = (b" " + " ".join(rcpt_options).encode("ascii")) if rcpt_options else b""
    lines = [mail + b"\r\n"]
    lines += [b"RCPT TO:" + _address(r, utf8) + rcpt_tail + b"\r\n" for r in recipients]
    for line in lines:
        if _PROHIBITED_IN_COMMAND.search(line, 0, len(line) - 2):
            raise ValueError("Command arg contains a prohibited control character")
    return lines


def dot_stuffed(mime: bytes) -> bytes:
    """The content as DATA carries it: CRLF line ends, leading dots doubled, the final dot.

    The outbox's own MIME is CRLF already and rarely has a line starting with
    a dot: two counts and a find (C speed) skip both regular expressions then.
    """
    data = mime
    crlf = data.count(b"\r\n")
    if data.count(b"\n") != crlf or data.count(b"\r") != crlf:
        data = _LINE_ENDINGS.sub(b"\r\n", data)
    if not data.endswith(b"\r\n"):
        data += b"\r\n"
    if data.startswith(b".") or b"\n." in data:
        data = _LEADING_DOT.sub(b"..", data)
    return data + b".\r\n"
