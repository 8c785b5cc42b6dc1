"""Tests for the scriptable test SMTP server in ``tests/smtpserver.py``.

Every behaviour is exercised with a real SMTP client (``smtplib`` or
``aiosmtplib``) over TCP.  No test asserts tight timings: concurrency is
proven by the order of events, and time only appears as generous upper bounds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import smtplib
import ssl
import threading
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest
from smtpserver import (
    PHASES,
    FaultSMTPServer,
    ReceivedMessage,
    smtp_server,  # noqa: F401  (fixture re-exported for this module)
)

CLIENT_TIMEOUT = 10.0  # seconds; only an upper bound so a broken test cannot hang
JOIN_TIMEOUT = 10.0


@pytest.fixture
def server() -> Iterator[FaultSMTPServer]:
    """A started server, stopped after the test."""
    with FaultSMTPServer() as srv:
        yield srv


def make_message(message_id: str = "<m1@example.com>", body: str = "Hello") -> bytes:
    """A small RFC 5322 message with CRLF line endings (and a dot-stuffed line)."""
    return (
        "From: Sender <sender@example.com>\r\n"
        "To: rcpt@example.com\r\n"
        "Subject: Test message\r\n"
        f"Message-ID: {message_id}\r\n"
        "\r\n"
        f"{body}\r\n"
        ".a line that starts with a dot\r\n"
        "..two dots\r\n"
        "last line\r\n"
    ).encode("ascii")


def send(
    server: FaultSMTPServer,
    message: bytes,
    *,
    sender: str = "sender@example.com",
    rcpts: list[str] | None = None,
    timeout: float = CLIENT_TIMEOUT,
) -> dict[str, tuple[int, bytes]]:
    """Send ``message`` with smtplib in one session; returns the refused recipients."""
    with smtplib.SMTP(server.host, server.port, timeout=timeout) as client:
        return client.sendmail(sender, rcpts or ["rcpt@example.com"], message)


class Runner(threading.Thread):
    """Run ``func`` in a thread, keeping its result or exception."""

    def __init__(self, func: Callable[[], Any], name: str = "runner") -> None:
        super().__init__(name=name, daemon=True)
        self._func = func
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._func()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def finish(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Join, failing the test if the thread is still running after ``timeout``."""
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} still running after {timeout} s"


# --------------------------------------------------------------------- normal behaviour


def test_normal_send_is_recorded_with_exact_bytes(server: FaultSMTPServer) -> None:
    message = make_message("<exact@example.com>")

    refused = send(server, message, rcpts=["one@example.com", "two@example.org"])

    assert refused == {}
    assert server.wait_for(1)
    [received] = server.messages
    assert isinstance(received, ReceivedMessage)
    assert received.mail_from == "sender@example.com"
    assert received.rcpt_tos == ["one@example.com", "two@example.org"]
    assert received.data == message  # exact bytes, dot-unstuffed back
    assert received.message_id == "<exact@example.com>"
    parsed = received.parsed
    assert isinstance(parsed, EmailMessage)
    assert parsed["Subject"] == "Test message"
    assert ".a line that starts with a dot" in parsed.get_content()
    assert server.message_ids() == ["<exact@example.com>"]


def test_message_without_message_id(server: FaultSMTPServer) -> None:
    send(server, b"Subject: no id\r\n\r\nbody\r\n")
    [received] = server.messages
    assert received.message_id is None
    assert server.message_ids() == []


def test_messages_is_a_snapshot_and_clear_forgets(server: FaultSMTPServer) -> None:
    send(server, make_message("<a@example.com>"))
    snapshot = server.messages
    snapshot.clear()
    assert len(server.messages) == 1

    send(server, make_message("<b@example.com>"))
    assert server.message_ids() == ["<a@example.com>", "<b@example.com>"]

    server.clear()
    assert server.messages == []
    assert server.message_ids() == []
    assert server.connections == 2  # counters are kept


def test_wait_for_blocks_until_messages_arrive(server: FaultSMTPServer) -> None:
    assert server.wait_for(1, timeout=0.05) is False

    sender = Runner(
        lambda: [send(server, make_message(f"<w{i}@example.com>")) for i in range(2)]
    )
    sender.start()
    assert server.wait_for(2)
    sender.finish()
    assert sender.error is None
    assert server.message_ids() == ["<w0@example.com>", "<w1@example.com>"]


def test_explicit_start_stop_restart_and_ephemeral_ports() -> None:
    first = FaultSMTPServer()
    second = FaultSMTPServer()
    assert first.port == 0 and not first.running
    first.start()
    second.start()
    try:
        assert first.host == "127.0.0.1"
        assert first.port > 0 and second.port > 0 and first.port != second.port
        assert first.running
        with pytest.raises(RuntimeError):
            first.start()
        send(first, make_message())
        assert len(first.messages) == 1 and second.messages == []
    finally:
        first.stop()
        second.stop()
    assert not first.running
    first.stop()  # idempotent

    with pytest.raises(OSError):
        smtplib.SMTP(first.host, first.port, timeout=CLIENT_TIMEOUT)

    first.start()  # restartable
    try:
        send(first, make_message("<again@example.com>"))
        assert first.message_ids()[-1] == "<again@example.com>"
    finally:
        first.stop()


def test_fixture_yields_a_running_server(smtp_server: FaultSMTPServer) -> None:  # noqa: F811
    assert smtp_server.running
    send(smtp_server, make_message())
    assert smtp_server.wait_for(1)


def test_large_and_utf8_messages(server: FaultSMTPServer) -> None:
    line = "0123456789" * 7 + "abcdef\r\n"  # 78 chars + CRLF
    big = (
        b"Subject: big\r\nMessage-ID: <big@example.com>\r\n\r\n"
        + (line * 27_000).encode()
    )
    assert len(big) > 2 * 1024 * 1024  # above smtplib/aiosmtpd-ish small defaults
    send(server, big, timeout=60)

    msg = EmailMessage()
    msg["From"] = "sénder@exämple.org"
    msg["To"] = "rëcipient@exämple.org"
    msg["Subject"] = "Grüße ✓"
    msg["Message-ID"] = "<utf8@example.com>"
    msg.set_content("Ünïcödé body ✓\n")
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.send_message(msg)  # uses SMTPUTF8 because of the addresses

    assert server.wait_for(2)
    large, utf8 = server.messages
    assert large.data == big
    assert large.message_id == "<big@example.com>"
    assert utf8.mail_from == "sénder@exämple.org"
    assert utf8.rcpt_tos == ["rëcipient@exämple.org"]
    assert "SMTPUTF8" in utf8.mail_options
    assert utf8.parsed["Subject"] == "Grüße ✓"
    # 8bit body as received on the wire (CRLF line endings)
    assert utf8.parsed.get_content() == "Ünïcödé body ✓\r\n"


# --------------------------------------------------------------------- scripted replies


def test_reply_data_451_once_then_success(server: FaultSMTPServer) -> None:
    server.reply("data", 451, times=1)
    message = make_message("<retry@example.com>")

    with pytest.raises(smtplib.SMTPDataError) as excinfo:
        send(server, message)
    assert excinfo.value.smtp_code == 451
    assert server.messages == []  # rejected at end of DATA: not recorded

    assert send(server, message) == {}
    assert server.message_ids() == ["<retry@example.com>"]
    assert server.data_attempts == 2


@pytest.mark.parametrize(
    ("code", "text"), [(552, "5.3.4 Message too big for system"), (554, None)]
)
def test_reply_data_permanent_failure_every_time(
    server: FaultSMTPServer, code: int, text: str | None
) -> None:
    server.reply("data", code, text)
    for _ in range(2):
        with pytest.raises(smtplib.SMTPDataError) as excinfo:
            send(server, make_message())
        assert excinfo.value.smtp_code == code
        if text is not None:
            assert excinfo.value.smtp_error == text.encode()
    assert server.messages == []
    assert server.data_attempts == 2


def test_reply_data_2xx_records_with_custom_text(server: FaultSMTPServer) -> None:
    server.reply("data", 250, "2.0.0 Ok: queued as ABC123", times=1)
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.ehlo()
        client.mail("sender@example.com")
        client.rcpt("rcpt@example.com")
        code, text = client.data(make_message())
    assert (code, text) == (250, b"2.0.0 Ok: queued as ABC123")
    assert len(server.messages) == 1


def test_reply_data_421_closes_the_connection(server: FaultSMTPServer) -> None:
    server.reply("data", 421, times=1)
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.ehlo()
        client.mail("sender@example.com")
        client.rcpt("rcpt@example.com")
        code, _ = client.data(make_message())
        assert code == 421
        assert server.wait_until(lambda: server.active_connections == 0)
        with pytest.raises(smtplib.SMTPServerDisconnected):
            client.noop()
    assert server.messages == []


def test_reply_connect_421(server: FaultSMTPServer) -> None:
    server.reply("connect", 421, "Too many connections")

    with pytest.raises(smtplib.SMTPConnectError) as excinfo:
        smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT)
    assert excinfo.value.smtp_code == 421
    assert excinfo.value.smtp_error == b"Too many connections"
    assert server.wait_until(lambda: server.active_connections == 0)

    server.reset_faults()
    send(server, make_message())
    assert server.wait_for(1)
    assert server.connections == 2


def test_reply_connect_times_and_custom_greeting(server: FaultSMTPServer) -> None:
    server.reply("connect", 554, "No service for you", times=1)
    server.reply("connect", 220, "custom.example ESMTP hello", times=1)

    with pytest.raises(smtplib.SMTPConnectError) as excinfo:
        smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT)
    assert excinfo.value.smtp_code == 554

    client = smtplib.SMTP(timeout=CLIENT_TIMEOUT)
    try:
        assert client.connect(server.host, server.port) == (
            220,
            b"custom.example ESMTP hello",
        )
        client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    finally:
        client.quit()

    send(server, make_message())  # back to normal
    assert len(server.messages) == 2


def test_reply_ehlo_every_time_and_once(server: FaultSMTPServer) -> None:
    server.reply("ehlo", 554, "5.7.1 Go away")
    with pytest.raises(smtplib.SMTPHeloError) as excinfo:
        send(server, make_message())  # smtplib tries EHLO, then HELO: both refused
    assert excinfo.value.smtp_code == 554

    server.reset_faults()
    server.reply("ehlo", 502, times=1)
    send(server, make_message())  # EHLO refused once, smtplib falls back to HELO
    [received] = server.messages
    assert received.mail_options == []  # plain SMTP (HELO): no ESMTP parameters


def test_reply_mail_once(server: FaultSMTPServer) -> None:
    server.reply("mail", 451, "4.3.0 Try later", times=1)
    with pytest.raises(smtplib.SMTPSenderRefused) as excinfo:
        send(server, make_message())
    assert excinfo.value.smtp_code == 451
    send(server, make_message())
    assert len(server.messages) == 1


def test_reply_rcpt_refuses_everyone(server: FaultSMTPServer) -> None:
    server.reply("rcpt", 450)
    with pytest.raises(smtplib.SMTPRecipientsRefused) as excinfo:
        send(server, make_message(), rcpts=["a@example.com", "b@example.com"])
    assert {code for code, _ in excinfo.value.recipients.values()} == {450}
    assert server.messages == []
    assert server.data_attempts == 0


def test_refuse_recipient_partial(server: FaultSMTPServer) -> None:
    server.refuse_recipient("ghost@example.com")

    refused = send(
        server, make_message(), rcpts=["alive@example.com", "Ghost@Example.com"]
    )

    assert refused == {"Ghost@Example.com": (550, b"5.7.1 Recipient address rejected")}
    [received] = server.messages
    assert received.rcpt_tos == ["alive@example.com"]


def test_refuse_recipient_custom_code(server: FaultSMTPServer) -> None:
    server.refuse_recipient("full@example.com", 452, "4.2.2 Mailbox full")
    refused = send(server, make_message(), rcpts=["full@example.com", "ok@example.com"])
    assert refused == {"full@example.com": (452, b"4.2.2 Mailbox full")}


def test_rules_for_one_phase_apply_in_order(server: FaultSMTPServer) -> None:
    server.reply("data", 451, times=1)
    server.drop("data", times=1)

    with pytest.raises(smtplib.SMTPDataError):
        send(server, make_message("<1@example.com>"))
    with pytest.raises(smtplib.SMTPServerDisconnected):
        send(server, make_message("<2@example.com>"))
    send(server, make_message("<3@example.com>"))

    assert server.message_ids() == ["<3@example.com>"]
    assert server.data_attempts == 3


def test_multiline_reply_text(server: FaultSMTPServer) -> None:
    server.reply("mail", 550, "5.7.1 Rejected\nsee https://example.com/why")
    with pytest.raises(smtplib.SMTPSenderRefused) as excinfo:
        send(server, make_message())
    assert excinfo.value.smtp_error == b"5.7.1 Rejected\nsee https://example.com/why"


def test_reset_faults_restores_normal_behaviour(server: FaultSMTPServer) -> None:
    for phase in ("mail", "rcpt", "data"):
        server.reply(phase, 554)
    server.refuse_recipient("rcpt@example.com")
    server.delay("data", 30)
    server.require_auth("user", "pw")
    server.hold()
    server.reset_faults()

    send(server, make_message())  # would hang for 30 s / be held if not reset
    assert len(server.messages) == 1
    assert server.held == 0


def test_invalid_arguments_are_rejected() -> None:
    srv = FaultSMTPServer()  # not started: scripting works without a running server
    with pytest.raises(ValueError):
        srv.reply("quit", 500)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        srv.reply("data", 99)
    with pytest.raises(ValueError):
        srv.reply("data", 451, times=0)
    with pytest.raises(ValueError):
        srv.delay("data", -1)
    with pytest.raises(ValueError):
        srv.refuse_recipient("a@example.com", code=250)
    with pytest.raises(RuntimeError):
        _ = srv.cert_file
    assert set(PHASES) == {"connect", "ehlo", "mail", "rcpt", "data"}


# --------------------------------------------------------------------- drops


def test_drop_data_disconnects_and_records_nothing(server: FaultSMTPServer) -> None:
    server.drop("data")
    with (
        smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client,
        pytest.raises(smtplib.SMTPServerDisconnected),
    ):
        client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    assert server.data_attempts == 1
    assert server.wait_until(lambda: server.active_connections == 0)
    assert server.messages == []


def test_drop_data_once_then_success(server: FaultSMTPServer) -> None:
    server.drop(times=1)  # phase defaults to "data"
    with pytest.raises(smtplib.SMTPServerDisconnected):
        send(server, make_message())
    send(server, make_message())
    assert len(server.messages) == 1
    assert server.data_attempts == 2


@pytest.mark.parametrize("phase", ["connect", "ehlo", "mail", "rcpt"])
def test_drop_other_phases(server: FaultSMTPServer, phase: str) -> None:
    server.drop(phase, times=1)  # type: ignore[arg-type]
    with pytest.raises(smtplib.SMTPServerDisconnected):
        send(server, make_message())
    send(server, make_message())
    assert len(server.messages) == 1


# --------------------------------------------------------------------- delays


def test_delay_connect_does_not_block_other_sessions(server: FaultSMTPServer) -> None:
    server.delay("connect", 3.0, times=1)
    events: list[str] = []

    def slow() -> None:
        send(server, make_message("<slow@example.com>"), timeout=30)
        events.append("slow done")

    slow_runner = Runner(slow, "slow")
    slow_runner.start()
    # The first session takes the only scripted delay before the greeting.
    assert server.wait_until(lambda: server.delaying == 1)

    send(server, make_message("<fast@example.com>"))
    events.append("fast done")

    slow_runner.finish()
    assert slow_runner.error is None
    assert events == ["fast done", "slow done"]
    assert server.message_ids() == ["<fast@example.com>", "<slow@example.com>"]
    assert server.max_concurrent_connections == 2


def test_delay_data_does_not_block_other_sessions(server: FaultSMTPServer) -> None:
    server.delay("data", 3.0, times=1)

    slow_runner = Runner(
        lambda: send(server, make_message("<slow@example.com>"), timeout=30)
    )
    slow_runner.start()
    # The slow message was fully received and is now waiting for its reply.
    assert server.wait_until(lambda: server.delaying == 1)
    assert server.data_attempts == 1
    assert server.messages == []

    send(server, make_message("<fast@example.com>"))
    assert server.message_ids() == ["<fast@example.com>"]

    slow_runner.finish()
    assert slow_runner.error is None
    assert server.message_ids() == ["<fast@example.com>", "<slow@example.com>"]
    assert server.delaying == 0


def test_delay_every_time_and_removal(server: FaultSMTPServer) -> None:
    server.delay("rcpt", 0.05)
    send(server, make_message(), rcpts=["a@example.com", "b@example.com"])
    server.delay("rcpt", 0)  # removes it
    send(server, make_message())
    assert len(server.messages) == 2


# --------------------------------------------------------------------- hold / release


def test_hold_withholds_reply_until_release(server: FaultSMTPServer) -> None:
    server.hold()
    runner = Runner(lambda: send(server, make_message("<held@example.com>")))
    runner.start()

    assert server.wait_held(1)
    assert server.held == 1
    assert server.data_attempts == 1
    assert server.messages == []  # held: not accepted yet
    assert runner.is_alive()  # client still waiting for the DATA reply

    server.release()
    runner.finish()
    assert runner.error is None
    assert runner.result == {}
    assert server.message_ids() == ["<held@example.com>"]
    assert server.held == 0

    send(server, make_message("<after@example.com>"))  # no longer held
    assert server.message_ids() == ["<held@example.com>", "<after@example.com>"]


def test_hold_several_sessions(server: FaultSMTPServer) -> None:
    server.hold()
    runners = [
        Runner(
            functools.partial(send, server, make_message(f"<h{i}@example.com>")),
            f"h{i}",
        )
        for i in range(3)
    ]
    for runner in runners:
        runner.start()
    assert server.wait_held(3)
    assert server.messages == []
    assert server.wait_held(4, timeout=0.05) is False

    server.release()
    for runner in runners:
        runner.finish()
        assert runner.error is None
    assert server.wait_for(3)
    assert sorted(server.message_ids()) == [f"<h{i}@example.com>" for i in range(3)]
    assert server.max_concurrent_connections == 3


def test_hold_with_data_fault_applies_fault_after_release(
    server: FaultSMTPServer,
) -> None:
    server.hold()
    server.reply("data", 451, times=1)
    runner = Runner(lambda: send(server, make_message()))
    runner.start()
    assert server.wait_held(1)
    server.release()
    runner.finish()
    assert isinstance(runner.error, smtplib.SMTPDataError)
    assert runner.error.smtp_code == 451
    assert server.messages == []


# --------------------------------------------------------------------- auth


def test_auth_not_advertised_by_default(server: FaultSMTPServer) -> None:
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.ehlo()
        assert not client.has_extn("auth")
        code, _ = client.docmd("AUTH", "PLAIN AHVzZXIAcHc=")
        assert code == 502
    assert server.auth_attempts == 1


def test_require_auth_without_login_gets_530_at_mail(server: FaultSMTPServer) -> None:
    server.require_auth("user", "s3cret")
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.ehlo()
        assert client.has_extn("auth")
        assert set(client.esmtp_features["auth"].split()) == {"LOGIN", "PLAIN"}
        with pytest.raises(smtplib.SMTPSenderRefused) as excinfo:
            client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    assert excinfo.value.smtp_code == 530
    assert server.messages == []
    assert server.auth_attempts == 0


def test_require_auth_wrong_password_gets_535(server: FaultSMTPServer) -> None:
    server.require_auth("user", "s3cret")
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        with pytest.raises(smtplib.SMTPAuthenticationError) as excinfo:
            client.login("user", "wrong")
        assert excinfo.value.smtp_code == 535
        with pytest.raises(smtplib.SMTPSenderRefused):
            client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    assert server.auth_attempts >= 1
    assert server.messages == []


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_require_auth_right_credentials_are_accepted(
    server: FaultSMTPServer, mechanism: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = "pa55-Very-Secret-Word"
    server.require_auth("mailer", password)
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.ehlo()
        client.user, client.password = "mailer", password
        authenticator = client.auth_plain if mechanism == "PLAIN" else client.auth_login
        code, _ = client.auth(mechanism, authenticator)
        assert code == 235
        client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    [received] = server.messages
    assert received.auth_username == "mailer"
    assert server.auth_attempts == 1
    assert password not in caplog.text
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ] == []
    assert password not in repr(server)
    assert password not in repr(received)


def test_auth_with_aiosmtplib(server: FaultSMTPServer) -> None:
    server.require_auth("user", "s3cret")
    message = EmailMessage()
    message["From"] = "sender@example.com"
    message["To"] = "rcpt@example.com"
    message["Subject"] = "auth"
    message.set_content("body\n")

    async def go(password: str) -> None:
        # connect() and login() apart, as the SMTP transport does, and close() in any
        # case: before 3.0.2, aiosmtplib leaves the socket open when a login run by
        # connect() (aiosmtplib.send with a username) fails.
        client = aiosmtplib.SMTP(hostname=server.host, port=server.port, start_tls=False,
                                 timeout=CLIENT_TIMEOUT)
        await client.connect()
        try:
            await client.login("user", password)
            await client.send_message(message)
            await client.quit()
        finally:
            client.close()

    with pytest.raises(aiosmtplib.SMTPAuthenticationError) as excinfo:
        asyncio.run(go("nope"))
    assert excinfo.value.code == 535
    asyncio.run(go("s3cret"))
    assert len(server.messages) == 1


# --------------------------------------------------------------------- counters


def test_counters(server: FaultSMTPServer) -> None:
    assert (
        server.connections,
        server.data_attempts,
        server.max_concurrent_connections,
    ) == (
        0,
        0,
        0,
    )
    send(server, make_message())
    send(server, make_message())
    assert server.connections == 2
    assert server.max_concurrent_connections == 1  # sequential sessions

    server.reply("data", 554, times=1)
    with pytest.raises(smtplib.SMTPDataError):
        send(server, make_message())
    assert server.data_attempts == 3  # the refused DATA counts too
    assert len(server.messages) == 2

    first = smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT)
    second = smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT)
    try:
        assert server.active_connections == 2
        assert server.max_concurrent_connections == 2
    finally:
        first.quit()
        second.quit()
    assert server.wait_until(lambda: server.active_connections == 0)
    assert server.connections == 5
    assert server.max_concurrent_connections == 2

    server.reset_counters()
    assert (server.connections, server.data_attempts, server.auth_attempts) == (0, 0, 0)
    assert server.max_concurrent_connections == 0


# --------------------------------------------------------------------- stop


def _stop_in_thread(server: FaultSMTPServer) -> None:
    stopper = Runner(server.stop, "stopper")
    stopper.start()
    stopper.finish()  # fails if stop() hangs for 10 s
    assert stopper.error is None
    assert not server.running


def test_stop_while_holding_does_not_hang() -> None:
    server = FaultSMTPServer().start()
    server.hold()
    runner = Runner(lambda: send(server, make_message()))
    runner.start()
    assert server.wait_held(1)

    _stop_in_thread(server)

    runner.finish()
    assert isinstance(runner.error, smtplib.SMTPServerDisconnected)
    assert server.messages == []  # abandoned, not accepted
    assert server.held == 0


def test_stop_during_delay_and_with_idle_client_does_not_hang() -> None:
    server = FaultSMTPServer().start()
    idle = smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT)
    try:
        idle.ehlo()
        server.delay("data", 60)
        runner = Runner(lambda: send(server, make_message(), timeout=60))
        runner.start()
        assert server.wait_until(lambda: server.delaying == 1)

        _stop_in_thread(server)

        runner.finish()
        assert isinstance(runner.error, smtplib.SMTPServerDisconnected)
        with pytest.raises(smtplib.SMTPServerDisconnected):
            idle.noop()
    finally:
        idle.close()
    assert server.messages == []


# --------------------------------------------------------------------- aiosmtplib


def test_aiosmtplib_send_fault_and_drop(server: FaultSMTPServer) -> None:
    message = EmailMessage()
    message["From"] = "sender@example.com"
    message["To"] = "rcpt@example.com"
    message["Subject"] = "async"
    message["Message-ID"] = "<async@example.com>"
    message.set_content("body\n")

    async def go() -> None:
        await aiosmtplib.send(
            message, hostname=server.host, port=server.port, timeout=CLIENT_TIMEOUT
        )

    server.reply("data", 451, times=1)
    with pytest.raises(aiosmtplib.SMTPDataError) as excinfo:
        asyncio.run(go())
    assert excinfo.value.code == 451

    server.drop("data", times=1)
    with pytest.raises(aiosmtplib.SMTPServerDisconnected):
        asyncio.run(go())

    asyncio.run(go())
    assert server.message_ids() == ["<async@example.com>"]
    assert server.messages[0].parsed["Subject"] == "async"
    assert server.data_attempts == 3


# --------------------------------------------------------------------- STARTTLS

# CI installs openssl (.ci/run), so there the tests run or fail, never skip.
needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None
    and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason="FaultSMTPServer(starttls=True) needs the openssl command line tool",
)


def test_starttls_without_openssl_raises_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    server = FaultSMTPServer(starttls=True)
    with pytest.raises(RuntimeError, match="openssl"):
        server.start()
    assert not server.running


@pytest.fixture
def tls_server() -> Iterator[FaultSMTPServer]:
    with FaultSMTPServer(starttls=True) as srv:
        yield srv


@needs_openssl
def test_starttls_with_trusted_self_signed_certificate(
    tls_server: FaultSMTPServer,
) -> None:
    context = ssl.create_default_context(cafile=tls_server.cert_file)
    tls_server.require_auth("user", "s3cret")
    with smtplib.SMTP(
        tls_server.host, tls_server.port, timeout=CLIENT_TIMEOUT
    ) as client:
        client.ehlo()
        assert client.has_extn("starttls")
        client.starttls(context=context)  # verifies the certificate for 127.0.0.1
        client.ehlo()
        assert not client.has_extn("starttls")
        client.login("user", "s3cret")
        message = make_message("<tls@example.com>")
        client.sendmail("sender@example.com", ["rcpt@example.com"], message)
    assert tls_server.message_ids() == ["<tls@example.com>"]


@needs_openssl
def test_starttls_untrusted_certificate_is_rejected_by_client(
    tls_server: FaultSMTPServer,
) -> None:
    with smtplib.SMTP(
        tls_server.host, tls_server.port, timeout=CLIENT_TIMEOUT
    ) as client:
        client.ehlo()
        with pytest.raises(ssl.SSLCertVerificationError):
            client.starttls(context=ssl.create_default_context())


@needs_openssl
def test_starttls_with_aiosmtplib(tls_server: FaultSMTPServer) -> None:
    message = EmailMessage()
    message["From"] = "sender@example.com"
    message["To"] = "rcpt@example.com"
    message["Subject"] = "tls"
    message.set_content("body\n")

    async def go() -> None:
        client = aiosmtplib.SMTP(hostname=tls_server.host, port=tls_server.port,
                                 start_tls=True, cert_bundle=tls_server.cert_file,
                                 timeout=CLIENT_TIMEOUT)
        async with client:
            await client.send_message(message)
            raw = client.get_transport_info("socket")
        # A TLS transport closes its socket only after the close_notify exchange, some
        # loop turns after quit(); asyncio.run() would otherwise close the loop first
        # and leave the socket unclosed (aiosmtplib 3 returns from quit() soonest).
        deadline = asyncio.get_running_loop().time() + CLIENT_TIMEOUT
        while raw.fileno() != -1 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert len(tls_server.messages) == 1


@needs_openssl
def test_cert_file_is_removed_on_stop() -> None:
    server = FaultSMTPServer(starttls=True).start()
    cert = Path(server.cert_file)
    assert cert.read_text().startswith("-----BEGIN CERTIFICATE-----")
    server.stop()
    assert not cert.exists()
    with pytest.raises(RuntimeError):
        _ = server.cert_file


# --------------------------------------------------------------------- the phase matrix


def _reply_code(exc: smtplib.SMTPException) -> int:
    """The SMTP code an smtplib error carries (a refused recipient's, for RCPT)."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        [(code, _text)] = exc.recipients.values()
        return int(code)
    assert isinstance(exc, smtplib.SMTPResponseException), exc
    return int(exc.smtp_code)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("code", [451, 554])
def test_every_phase_can_answer_4xx_and_5xx(
    server: FaultSMTPServer, phase: str, code: int
) -> None:
    # Every occurrence: smtplib falls back from EHLO to HELO, which shares the phase.
    server.reply(phase, code)  # type: ignore[arg-type]
    with pytest.raises(smtplib.SMTPException) as excinfo:
        send(server, make_message())
    assert _reply_code(excinfo.value) == code
    assert server.messages == []
    server.reset_faults()
    send(server, make_message())
    assert len(server.messages) == 1


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_can_be_delayed(server: FaultSMTPServer, phase: str) -> None:
    server.delay(phase, 1.0, times=1)  # type: ignore[arg-type]
    runner = Runner(lambda: send(server, make_message(), timeout=30), f"delayed-{phase}")
    runner.start()
    # The session is parked in this phase's delay and nothing was accepted yet.
    assert server.wait_until(lambda: server.delaying == 1)
    assert server.messages == []
    if phase != "data":
        assert server.data_attempts == 0
    runner.finish()
    assert runner.error is None
    assert len(server.messages) == 1 and server.delaying == 0


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_can_drop_the_connection(server: FaultSMTPServer, phase: str) -> None:
    server.drop(phase, times=1)  # type: ignore[arg-type]
    with pytest.raises(smtplib.SMTPServerDisconnected):
        send(server, make_message())
    assert server.messages == []
    send(server, make_message())
    assert len(server.messages) == 1


def test_drop_mid_data_cuts_the_content_short(server: FaultSMTPServer) -> None:
    # 1 MiB: the client is still writing when the server hangs up after 64 bytes.
    big = make_message(body="x" * 70 + "\r\n" + ("y" * 998 + "\r\n") * 1024)
    server.drop_mid_data(after_bytes=64, times=1)
    with pytest.raises((smtplib.SMTPServerDisconnected, ConnectionError)):
        send(server, big)
    assert server.mid_data_drops == 1
    assert server.data_attempts == 1
    assert server.wait_until(lambda: server.active_connections == 0)
    assert server.messages == []
    send(server, big)  # used up: the next one goes through whole
    assert [m.data for m in server.messages] == [big]


def test_drop_mid_data_with_aiosmtplib(server: FaultSMTPServer) -> None:
    message = make_message(body=("z" * 998 + "\r\n") * 500)

    async def go() -> None:
        await aiosmtplib.send(message, sender="sender@example.com",
                              recipients=["rcpt@example.com"], hostname=server.host,
                              port=server.port, timeout=CLIENT_TIMEOUT)

    server.drop_mid_data()
    for _ in range(2):  # times=None: every DATA is cut
        with pytest.raises((aiosmtplib.SMTPServerDisconnected, ConnectionError)):
            asyncio.run(go())
    assert server.mid_data_drops == 2 and server.messages == []
    server.reset_faults()
    asyncio.run(go())
    assert len(server.messages) == 1


def test_drop_during_auth(server: FaultSMTPServer) -> None:
    server.require_auth("user", "pw")
    server.drop_during_auth(times=1)
    with (
        smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client,
        pytest.raises(smtplib.SMTPServerDisconnected),
    ):
        client.login("user", "pw")
    assert server.auth_attempts == 1
    with smtplib.SMTP(server.host, server.port, timeout=CLIENT_TIMEOUT) as client:
        client.login("user", "pw")
        client.sendmail("sender@example.com", ["rcpt@example.com"], make_message())
    assert server.messages[0].auth_username == "user"


def test_new_fault_arguments_are_checked() -> None:
    srv = FaultSMTPServer()
    with pytest.raises(ValueError):
        srv.drop_mid_data(after_bytes=0)
    with pytest.raises(ValueError):
        srv.drop_mid_data(times=0)
    with pytest.raises(ValueError):
        srv.drop_during_auth(times=0)
