"""Internationalised addresses (RFC 6531/6532): OUTBOX_ALLOW_SMTPUTF8.

Against the real SMTP test server, with and without ``SMTPUTF8`` offered: the
``SMTPUTF8`` MAIL parameter only for a message that needs it, and a message
that needs it through a server without it fails permanently, naming the
address, the missing extension and OUTBOX_ALLOW_SMTPUTF8.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from email.message import EmailMessage
from email.parser import Parser
from email.policy import default as default_policy
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, hand_ticked_worker, make_app, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail, PermanentError
from flask_mail_outbox._compose.addresses import address_list, parse_address
from flask_mail_outbox._compose.mime import top_headers
from flask_mail_outbox.core import email_table
from flask_mail_outbox.transports import Delivered, Envelope, Failed
from flask_mail_outbox.transports import SMTPSettings, SMTPTransport

UTF8 = "grüße@example.org"
ASCII = "plain@example.org"

def _transport(server: FaultSMTPServer) -> SMTPTransport:
    return SMTPTransport(SMTPSettings(host=server.host, port=server.port, timeout=5),
                         concurrency=1)


def _envelope(n: int, *recipients: str, sender: str = "sender@example.com") -> Envelope:
    to = ", ".join(recipients)
    mime = (f"From: {sender}\r\nTo: {to}\r\nMessage-ID: <m{n}@example.com>\r\n"
            f"Subject: n{n}\r\n\r\nbody {n}\r\n").encode()
    return Envelope(email_id=n, sender=sender, recipients=recipients, mime=mime,
                    message_id=f"<m{n}@example.com>")


def parsed_utf8(data: bytes) -> EmailMessage:
    """``data`` parsed back as RFC 6532 has it: UTF-8 headers (BytesParser reads them as ASCII)."""
    message = Parser(policy=default_policy).parsestr(data.decode("utf-8"))
    assert isinstance(message, EmailMessage)
    return message


@pytest.fixture(params=[True, False], ids=["pipelining", "one-at-a-time"])
def pipelining(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


# --------------------------------------------------------------------------- #
# The transport
# --------------------------------------------------------------------------- #


def test_utf8_address_is_sent_with_smtputf8_when_offered(pipelining: bool) -> None:
    with FaultSMTPServer(pipelining=pipelining) as server:
        transport = _transport(server)
        try:
            [result] = transport.send_many([_envelope(1, UTF8)])
        finally:
            transport.close()
        assert isinstance(result, Delivered) and not result.refused
        [received] = server.messages
        assert received.rcpt_tos == [UTF8]
        assert "SMTPUTF8" in received.mail_options
        assert "BODY=8BITMIME" in received.mail_options  # RFC 6532 headers are 8-bit
        assert parsed_utf8(received.data)["To"].addresses[0].addr_spec == UTF8


def test_utf8_sender_alone_needs_smtputf8_too() -> None:
    with FaultSMTPServer() as server:
        transport = _transport(server)
        try:
            [result] = transport.send_many([_envelope(1, ASCII, sender="jörg@example.com")])
        finally:
            transport.close()
        assert isinstance(result, Delivered)
        assert server.messages[0].mail_from == "jörg@example.com"
        assert "SMTPUTF8" in server.messages[0].mail_options


def test_ascii_mail_never_asks_for_smtputf8(pipelining: bool) -> None:
    with FaultSMTPServer(pipelining=pipelining) as server:  # it offers SMTPUTF8
        transport = _transport(server)
        try:
            results = transport.send_many([_envelope(1, ASCII), _envelope(2, UTF8),
                                           _envelope(3, ASCII)])
        finally:
            transport.close()
        assert all(isinstance(r, Delivered) for r in results)
        options = {m.message_id: m.mail_options for m in server.messages}
        assert "SMTPUTF8" not in options["<m1@example.com>"]
        assert "SMTPUTF8" in options["<m2@example.com>"]
        assert options["<m3@example.com>"] == ["SIZE=" + str(len(_envelope(3, ASCII).mime))]


def test_without_smtputf8_the_utf8_message_fails_permanently_and_the_rest_go(
        pipelining: bool) -> None:
    with FaultSMTPServer(smtputf8=False, pipelining=pipelining) as server:
        transport = _transport(server)
        try:
            results = transport.send_many([_envelope(1, ASCII), _envelope(2, UTF8, ASCII),
                                           _envelope(3, ASCII)])
        finally:
            transport.close()
        first, refused, last = results
        assert isinstance(first, Delivered) and isinstance(last, Delivered)
        assert isinstance(refused, Failed) and isinstance(refused.error, PermanentError)
        text = str(refused.error)
        assert repr(UTF8) in text and "SMTPUTF8" in text and "OUTBOX_ALLOW_SMTPUTF8" in text
        assert [m.message_id for m in server.messages] == ["<m1@example.com>",
                                                           "<m3@example.com>"]
        assert server.connections == 1  # nothing was written: the connection went on


# --------------------------------------------------------------------------- #
# Delivery: the row's end
# --------------------------------------------------------------------------- #


@pytest.fixture
def utf8_app(db_url: str) -> Iterator[Any]:
    """``make(server)``: a hand-ticked durable app with OUTBOX_ALLOW_SMTPUTF8 on."""
    made: list[Flask] = []

    def make(server: FaultSMTPServer) -> Flask:
        app = make_app(db_url, MAIL_SERVER=server.host, MAIL_PORT=server.port,
                       OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                       OUTBOX_ALLOW_SMTPUTF8=True)
        made.append(app)
        return app

    yield make
    for app in made:
        close_app(app, timeout=5)


def _queue_utf8_row(app: Flask) -> int:
    """A queued row to UTF8, as the builder writes it (RFC 6532: the address as UTF-8)."""
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        email_id = mail.send(Message("Grüße", recipients=[ASCII], body="Hallo"))
        db.session.commit()
        [row] = [r for r in rows(app) if r["id"] == email_id]
        # Until prepare_message writes UTF-8 headers (see the module docstring),
        # the row is made what it will write.
        mime = row["mime"].replace(ASCII.encode(), UTF8.encode("utf-8"))
        with db.engine.begin() as conn:
            conn.execute(sa.update(email_table).where(email_table.c.id == email_id)
                         .values(recipients=json.dumps([UTF8]), mime=mime))
    return email_id


def test_row_is_sent_through_a_server_that_offers_smtputf8(utf8_app: Any) -> None:
    with FaultSMTPServer() as server:
        app = utf8_app(server)
        _queue_utf8_row(app)
        hand_ticked_worker(app).tick()
        assert server.wait_for(1)
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=10)
        assert row["status"] == "sent" and row["attempts"] == 1
        assert server.messages[0].rcpt_tos == [UTF8]
        assert "SMTPUTF8" in server.messages[0].mail_options


def test_row_is_dead_lettered_when_the_server_has_no_smtputf8(utf8_app: Any) -> None:
    with FaultSMTPServer(smtputf8=False) as server:
        app = utf8_app(server)
        _queue_utf8_row(app)
        hand_ticked_worker(app).tick()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=10)
        assert row["status"] == "failed" and row["attempts"] == 1  # no retry
        assert repr(UTF8) in row["last_error"]
        assert "SMTPUTF8" in row["last_error"] and "OUTBOX_ALLOW_SMTPUTF8" in row["last_error"]
        assert server.messages == [] and server.data_attempts == 0


# --------------------------------------------------------------------------- #
# Validation at send()
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(("field", "fields"), [
    ("recipients[0]", {"recipients": [UTF8]}),
    ("cc[1]", {"recipients": [ASCII], "cc": [ASCII, ("Grüße", UTF8)]}),
    ("sender", {"recipients": [ASCII], "sender": f"Jörg <{UTF8}>"}),
    ("reply_to", {"recipients": [ASCII], "reply_to": UTF8}),
])
def test_off_a_utf8_address_is_refused_at_send_naming_the_field(
        app: Flask, mail: OutboxMail, field: str, fields: dict[str, Any]) -> None:
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(Message("x", body="x", **fields))
        assert excinfo.value.field == field
        assert UTF8 in str(excinfo.value) and "OUTBOX_ALLOW_SMTPUTF8 = True" in str(excinfo.value)
        db.session.rollback()
    assert rows(app) == []


def test_on_the_address_is_accepted_and_keeps_its_utf8_local_part(db_url: str) -> None:
    app = make_app(db_url, OUTBOX_ALLOW_SMTPUTF8=True)
    try:
        with app.app_context():
            [addr] = address_list("recipients", [("Jörg", "Grüße@Bücher.example")], False)
        assert addr.ascii == "Grüße@xn--bcher-kva.example"  # the domain in its ASCII form
        assert addr.display == "Grüße@bücher.example"
        # RFC 6532: the address goes into the header as UTF-8, not as an encoded-word.
        [line] = [h for h in top_headers(addr, [addr], [], [], "s",
                                         datetime.now(UTC), "<m@x>", [], [])
                  if h.startswith("To:")]
        assert "<Grüße@xn--bcher-kva.example>" in line and "=?utf-8?" in line  # the name
        # Outside an app, and explicitly off, the setting is off.
        with pytest.raises(InvalidMessage):
            address_list("recipients", [UTF8], False)
        with app.app_context(), pytest.raises(InvalidMessage):
            address_list("recipients", [UTF8], False, allow_smtputf8=False)
    finally:
        close_app(app, timeout=5)


def test_ascii_addresses_are_the_same_whatever_the_setting() -> None:
    assert parse_address(ASCII, False, True) == parse_address(ASCII, False, False)


# --------------------------------------------------------------------------- #
# Through mail.send() (needs the message builder's UTF-8 headers)
# --------------------------------------------------------------------------- #


def test_send_delivers_a_utf8_address_end_to_end(db_url: str) -> None:
    with FaultSMTPServer() as server:
        app = make_app(db_url, MAIL_SERVER=server.host, MAIL_PORT=server.port,
                       OUTBOX_ALLOW_SMTPUTF8=True)
        mail: OutboxMail = app.extensions["test_mail"]
        try:
            with app.app_context():
                mail.send(Message("Grüße", recipients=[("Jörg", UTF8), ASCII], body="Hallo"))
                db.session.commit()
            assert server.wait_for(1)
            received = server.messages[0]
            assert received.rcpt_tos == [UTF8, ASCII]
            assert "SMTPUTF8" in received.mail_options
            assert [a.addr_spec for a in parsed_utf8(received.data)["To"].addresses] == [UTF8, ASCII]
            assert wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=10)
        finally:
            close_app(app, timeout=5)


def test_send_dead_letters_a_utf8_address_without_server_support(db_url: str) -> None:
    with FaultSMTPServer(smtputf8=False) as server:
        app = make_app(db_url, MAIL_SERVER=server.host, MAIL_PORT=server.port,
                       OUTBOX_ALLOW_SMTPUTF8=True)
        mail: OutboxMail = app.extensions["test_mail"]
        try:
            with app.app_context():
                mail.send(Message("Grüße", recipients=[UTF8], body="Hallo"))
                db.session.commit()
            [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=10)
            assert repr(UTF8) in row["last_error"] and "SMTPUTF8" in row["last_error"]
        finally:
            close_app(app, timeout=5)
