"""The SMTP transport's send phase: RFC 2920 pipelining, and lock-step without it.

The transport writes a message's MAIL, RCPTs and DATA as one group when the
server offers PIPELINING. :class:`GroupServer` proves it by the order of
events: it answers nothing until the whole group has arrived, so a client
that waited for each reply would wait forever (and fail on MAIL_TIMEOUT).
Every outcome the fault tests cover is checked here both ways, pipelined and
lock-step, against the real aiosmtpd server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Self
from unittest.mock import ANY

import pytest
from smtpserver import FaultSMTPServer

from flask_mail_outbox import PermanentError, TransientError
from flask_mail_outbox.transports import (
    Delivered,
    Envelope,
    Failed,
    SMTPSettings,
    SMTPTransport,
)
from flask_mail_outbox.transports._pipeline import dot_stuffed

SENDER = "sender@example.com"
#: A message the server took (its queue id, whatever it is, is the provider's id).
ACCEPTED = Delivered(refused={}, provider_message_id=ANY)


def _transport(port: int, *, timeout: float = 5.0, concurrency: int = 1) -> SMTPTransport:
    return SMTPTransport(SMTPSettings(port=port, timeout=timeout), concurrency=concurrency)


def _envelope(n: int, *recipients: str) -> Envelope:
    mime = (f"Message-ID: <m{n}@example.com>\r\nSubject: n{n}\r\n\r\n"
            f"body {n}\r\n.leading dot\r\n").encode()
    return Envelope(email_id=n, sender=SENDER, recipients=recipients or ("to@example.com",),
                    mime=mime, message_id=f"<m{n}@example.com>")


class GroupServer:
    """A bare SMTP server that offers PIPELINING and holds every reply of a group.

    After EHLO it reads until it has a MAIL line, every RCPT line and the
    DATA line (the group RFC 2920 lets a client send together) before it
    answers any of them. With ``chained=N`` it also holds the reply to each
    of the first N-1 contents until the next message's whole envelope has
    arrived. ``unsolicited`` makes it say ``421`` on an idle connection after
    the first message, without closing it; ``drop_at_group=N`` answers the
    N-th envelope's MAIL and then closes the connection.
    """

    def __init__(self, *, unsolicited: bool = False, chained: int = 0,
                 drop_at_group: int = 0) -> None:
        self.unsolicited = unsolicited
        self.chained = chained
        self.drop_at_group = drop_at_group
        self.groups: list[list[bytes]] = []
        self.contents: list[bytes] = []
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._session, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.run_until_complete(asyncio.sleep(0.05))
        self._loop.close()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.write(b"220 group ready\r\n")
        await reader.readline()  # EHLO
        writer.write(b"250-group\r\n250-PIPELINING\r\n250 SIZE 1000000\r\n")
        group: list[bytes] | None = None
        try:
            while True:
                if group is None:
                    line = await reader.readline()
                    if not line or line.startswith(b"QUIT"):
                        writer.write(b"221 bye\r\n")
                        break
                    if line.startswith(b"RSET"):
                        writer.write(b"250 reset\r\n")
                        continue
                    group = await self._rest_of_group(reader, line)
                self.groups.append(group)
                if len(self.groups) == self.drop_at_group:
                    writer.write(b"250 sender ok\r\n")  # then the line goes dead
                    await writer.drain()
                    break
                writer.write(b"250 sender ok\r\n" + b"250 rcpt ok\r\n" * (len(group) - 2)
                             + b"354 go on\r\n")
                content = bytearray()
                while not content.endswith(b"\r\n.\r\n"):
                    content += await reader.readline()
                self.contents.append(bytes(content))
                group = None
                if len(self.contents) < self.chained:
                    # Hold the content's reply until the next envelope is here.
                    group = await self._rest_of_group(reader, await reader.readline())
                writer.write(b"250 queued\r\n")
                if self.unsolicited and len(self.contents) == 1:
                    await writer.drain()
                    writer.write(b"421 4.4.2 idle too long\r\n")
            await writer.drain()
        finally:
            writer.close()

    @staticmethod
    async def _rest_of_group(reader: asyncio.StreamReader, first: bytes) -> list[bytes]:
        group = [first]
        while not group[-1].startswith(b"DATA"):
            group.append(await reader.readline())
        return group

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_a_pipelining_server_gets_mail_rcpt_and_data_in_one_group() -> None:
    with GroupServer() as server:
        transport = _transport(server.port, timeout=3)
        try:
            results = transport.send_many([_envelope(1), _envelope(2, "a@example.com",
                                                                   "b@example.com")])
        finally:
            transport.close()
    # A lock-step client would have waited for the MAIL reply the server holds
    # back until DATA arrives, and timed out.
    assert results == [ACCEPTED, ACCEPTED]
    assert [[line.split(b":")[0] for line in group] for group in server.groups] == [
        [b"MAIL FROM", b"RCPT TO", b"DATA\r\n"],
        [b"MAIL FROM", b"RCPT TO", b"RCPT TO", b"DATA\r\n"],
    ]
    assert server.groups[0][0] == b"MAIL FROM:<sender@example.com> SIZE=%d\r\n" % len(
        _envelope(1).mime)
    assert server.connections == 1
    # The content arrives dot-stuffed and ended, exactly as DATA carries it.
    assert server.contents[0] == dot_stuffed(_envelope(1).mime)
    assert b"\r\n..leading dot\r\n" in server.contents[0]


def test_the_next_envelope_travels_with_the_content_of_the_one_before() -> None:
    with GroupServer(chained=3) as server:
        transport = _transport(server.port, timeout=3)
        try:
            results = transport.send_many([_envelope(1), _envelope(2), _envelope(3)])
        finally:
            transport.close()
    # A client that waited for the content's reply before the next MAIL FROM
    # would have waited for a reply the server holds back, and timed out.
    assert results == [ACCEPTED] * 3
    assert server.contents == [dot_stuffed(_envelope(n).mime) for n in (1, 2, 3)]
    assert server.connections == 1


def test_a_message_whose_envelope_went_ahead_is_resent_uncharged_if_the_line_dies() -> None:
    with GroupServer(drop_at_group=2) as server:
        transport = _transport(server.port, timeout=3)
        try:
            results = transport.send_many([_envelope(1), _envelope(2)])
        finally:
            transport.close()
    # The second envelope went with the first content; the server took its MAIL
    # and hung up before any content: it is sent again on a new connection, and
    # delivered, not failed (a failure would charge the row an attempt).
    assert results == [ACCEPTED, ACCEPTED]
    assert server.connections == 2
    assert server.contents == [dot_stuffed(_envelope(n).mime) for n in (1, 2)]


def test_an_unsolicited_reply_on_an_idle_connection_is_not_taken_for_an_answer() -> None:
    with GroupServer(unsolicited=True) as server:
        transport = _transport(server.port, timeout=3)
        try:
            first = transport.send_many([_envelope(1)])
            # The 421 arrives while the connection sits in the pool.
            assert _wait(lambda: server.connections == 1 and len(server.contents) == 1)
            second = transport.send_many([_envelope(2)])
        finally:
            transport.close()
    assert first == [ACCEPTED]
    # Read as the reply to MAIL FROM, the 421 would have failed the message;
    # the transport drops the connection and sends on a new one instead.
    assert second == [ACCEPTED]
    assert server.connections == 2
    assert len(server.contents) == 2


def _wait(predicate: object, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(params=[True, False], ids=["pipelined", "lock-step"])
def server(request: pytest.FixtureRequest) -> Iterator[FaultSMTPServer]:
    with FaultSMTPServer(pipelining=request.param) as started:
        yield started


def test_one_refused_recipient_of_two(server: FaultSMTPServer) -> None:
    server.refuse_recipient("bad@example.com", 550)
    transport = _transport(server.port)
    try:
        results = transport.send_many([_envelope(1, "bad@example.com", "good@example.com"),
                                       _envelope(2)])
    finally:
        transport.close()
    first, second = results
    assert isinstance(first, Delivered) and list(first.refused) == ["bad@example.com"]
    assert first.refused["bad@example.com"][0] == 550
    assert second == ACCEPTED
    assert [m.rcpt_tos for m in server.messages] == [["good@example.com"],
                                                        ["to@example.com"]]
    assert server.connections == 1


def test_every_recipient_refused_is_permanent_and_the_connection_goes_on(
        server: FaultSMTPServer) -> None:
    server.refuse_recipient("bad@example.com", 550)
    transport = _transport(server.port)
    try:
        results = transport.send_many([_envelope(1, "bad@example.com"), _envelope(2)])
    finally:
        transport.close()
    assert isinstance(results[0], Failed) and isinstance(results[0].error, PermanentError)
    assert "every recipient refused" in str(results[0].error)
    assert results[1] == ACCEPTED
    assert server.message_ids() == ["<m2@example.com>"]
    assert server.connections == 1


@pytest.mark.parametrize(("phase", "code", "kind"), [
    ("mail", 451, TransientError), ("mail", 553, PermanentError),
    ("rcpt", 452, TransientError), ("data", 451, TransientError),
    ("data", 554, PermanentError),
])
def test_a_refusal_at_each_phase_fails_that_message_only(
        server: FaultSMTPServer, phase: str, code: int, kind: type[Exception]) -> None:
    server.reply(phase, code, times=1)  # type: ignore[arg-type]
    transport = _transport(server.port)
    try:
        results = transport.send_many([_envelope(1), _envelope(2)])
    finally:
        transport.close()
    assert isinstance(results[0], Failed) and type(results[0].error) is kind
    assert results[0].error.code == code
    assert results[1] == ACCEPTED
    assert server.message_ids() == ["<m2@example.com>"]
    assert server.connections == 1  # RSET, not a new connection


def test_a_drop_in_the_middle_of_the_content_fails_only_that_message(
        server: FaultSMTPServer) -> None:
    server.drop_mid_data(after_bytes=16, times=1)
    transport = _transport(server.port)
    try:
        results = transport.send_many([_envelope(1), _envelope(2)])
    finally:
        transport.close()
    assert isinstance(results[0], Failed) and isinstance(results[0].error, TransientError)
    assert results[1] == ACCEPTED
    assert server.message_ids() == ["<m2@example.com>"]
    assert server.connections == 2


def test_a_server_that_never_answers_mail_is_bounded_by_the_timeout(
        server: FaultSMTPServer) -> None:
    server.delay("mail", 30, times=1)
    transport = _transport(server.port, timeout=1)
    try:
        results = transport.send_many([_envelope(1)])
    finally:
        transport.close()
    assert isinstance(results[0], Failed) and isinstance(results[0].error, TransientError)
    assert "timed out" in str(results[0].error).lower()
    assert server.messages == []


def test_many_messages_over_one_reused_connection(server: FaultSMTPServer) -> None:
    transport = _transport(server.port, concurrency=2)
    try:
        results = transport.send_many([_envelope(n) for n in range(1, 41)])
        more = transport.send_many([_envelope(n) for n in range(41, 61)])
    finally:
        transport.close()
    assert results + more == [ACCEPTED] * 60
    assert sorted(server.message_ids()) == sorted(f"<m{n}@example.com>" for n in range(1, 61))
    assert server.connections == 2
    # Each message arrives byte for byte, leading dot included.
    assert all(b"\n.leading dot" in m.data.replace(b"\r\n", b"\n") for m in server.messages)


@pytest.mark.parametrize(("mime", "wire"), [
    (b"a\r\nb\r\n", b"a\r\nb\r\n.\r\n"),
    (b"a\r\nb", b"a\r\nb\r\n.\r\n"),
    (b"a\nb\rc\r\n", b"a\r\nb\r\nc\r\n.\r\n"),
    (b".a\r\n.\r\nb.\r\n..c\r\n", b"..a\r\n..\r\nb.\r\n...c\r\n.\r\n"),
    (b"x\n.y\n", b"x\r\n..y\r\n.\r\n"),
    (b"", b"\r\n.\r\n"),
])
def test_the_content_is_sent_with_crlf_and_its_leading_dots_doubled(
        mime: bytes, wire: bytes) -> None:
    assert dot_stuffed(mime) == wire
