"""Code written for Flask-Mail keeps working: ``app.extensions["mail"]``,
``mail.state``, ``mail.connect()``, ``send_message`` and ``email_dispatched``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import flask_mail
import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, rows
from flask import Flask, current_app
from flask_sqlalchemy import SQLAlchemy
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail, email_dispatched
from flask_mail_outbox._flask.compat import Connection, FlaskMailState


def letter(i: int) -> Message:
    return Message(f"Letter {i}", recipients=[f"user{i}@example.com"], body=f"Hello {i}")


def flask_mail_state(app: Flask) -> Any:
    """What Flask-Mail code reaches: ``current_app.extensions["mail"]``."""
    with app.app_context():
        return current_app.extensions["mail"]


def test_extensions_mail_holds_the_outbox_settings(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   MAIL_USERNAME="robot", MAIL_PASSWORD="s3cret-pw", MAIL_ASCII_ATTACHMENTS=True,
                   MAIL_MAX_EMAILS=50, MAIL_DEBUG=1)
    try:
        state = flask_mail_state(app)
        assert isinstance(state, FlaskMailState)
        expected = {"server": smtp_server.host, "port": smtp_server.port, "username": "robot",
                    "password": "s3cret-pw", "use_tls": False, "use_ssl": False,
                    "default_sender": "Sender <sender@example.com>", "debug": 1,
                    "max_emails": 50, "suppress": False, "ascii_attachments": True}
        # Every attribute of Flask-Mail's own state object, none missing.
        real = flask_mail.Mail().init_mail({})
        assert set(vars(real)) == set(expected)
        assert {name: getattr(state, name) for name in expected} == expected
        assert "s3cret-pw" not in repr(state)
        assert "robot" in repr(state)
        assert app.extensions["test_mail"].state is state  # OutboxMail(app): mail.state
    finally:
        close_app(app)


def test_factory_style_state_is_none_and_init_app_returns_it(tmp_path: Path) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'f.db'}", TESTING=True,
                      OUTBOX_RUN_SCHEDULER=False)
    SQLAlchemy(app)
    mail = OutboxMail()
    returned = mail.init_app(app)
    try:
        # As in Flask-Mail: init_app() returns the state, mail.state stays None.
        assert mail.state is None
        assert returned is app.extensions["mail"]
        assert returned.suppress is True  # TESTING turns MAIL_SUPPRESS_SEND on
    finally:
        mail.stop()


def test_real_flask_mail_keeps_its_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'r.db'}", TESTING=True,
                      OUTBOX_RUN_SCHEDULER=False)
    SQLAlchemy(app)
    real = flask_mail.Mail(app)
    with caplog.at_level(logging.INFO, logger="flask_mail_outbox"):
        mail = OutboxMail(app)
    try:
        assert app.extensions["mail"] is real.state
        lines = [r for r in caplog.records if "app.extensions['mail']" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO
        assert "flask_mail._Mail" in lines[0].getMessage()
        assert isinstance(mail.state, FlaskMailState)  # still there for whoever asks
    finally:
        mail.stop()


def test_state_send_queues_in_the_transaction(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    compat = current_app.extensions["mail"]
    compat.send(letter(1))
    db.session.rollback()
    assert mail.wait_idle(5)
    assert not smtp_server.wait_for(1, timeout=0.5)
    assert rows(app) == []
    email_id = compat.send(letter(2))
    compat.send_message("Positional", ["pos@example.com"], "body text")
    assert smtp_server.messages == []  # queued, not sent: the commit decides
    db.session.commit()
    assert smtp_server.wait_for(2)
    assert mail.wait_idle(10)
    assert rows(app)[0]["id"] == email_id
    got = sorted((m.parsed["Subject"], tuple(m.rcpt_tos)) for m in smtp_server.messages)
    assert got == [("Letter 2", ("user2@example.com",)), ("Positional", ("pos@example.com",))]


def test_outbox_send_message_takes_flask_mails_positions(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send_message("Hi", ["a@example.com"], "the body")
    db.session.commit()
    assert smtp_server.wait_for(1)
    [received] = smtp_server.messages
    assert received.parsed["Subject"] == "Hi"
    assert received.parsed.get_content().strip() == "the body"


def test_email_dispatched_reaches_a_flask_mail_receiver_once_per_email(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    seen: list[tuple[Flask, str, list[str], set[str]]] = []
    ids: list[str] = []

    # Written exactly as for Flask-Mail 0.10, only the import changed.
    def log_dispatched(app: Flask, message: Any) -> None:
        seen.append((app, message.subject, message.recipients, set(message.send_to)))
        ids.append(message.msgId)

    email_dispatched.connect(log_dispatched)
    try:
        msg = Message("Dispatched", recipients=["to@example.com"], cc=["cc@example.com"],
                      body="x")
        mail.send(msg)
        mail.send(letter(7))
        assert seen == []
        db.session.commit()
        assert smtp_server.wait_for(2)
        assert mail.wait_idle(10)
    finally:
        email_dispatched.disconnect(log_dispatched)
    assert sorted(seen, key=lambda s: s[1]) == [
        (app, "Dispatched", ["to@example.com"], {"to@example.com", "cc@example.com"}),
        (app, "Letter 7", ["user7@example.com"], {"user7@example.com"}),
    ]
    assert sorted(ids) == sorted(smtp_server.message_ids())


def test_a_raising_dispatched_receiver_breaks_no_delivery(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(app: Flask, message: Any) -> None:
        raise RuntimeError("a receiver with a bug")

    email_dispatched.connect(broken)
    try:
        mail.send_many([letter(0), letter(1)])
        db.session.commit()
        assert smtp_server.wait_for(2)
        assert mail.wait_idle(10)
    finally:
        email_dispatched.disconnect(broken)
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]
    assert len([r for r in caplog.records if "email-dispatched" in r.getMessage()]) == 2


def test_record_messages_through_extensions_mail(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'rec.db'}", TESTING=True)
    try:
        with app.app_context():
            compat = current_app.extensions["mail"]
            with compat.record_messages() as outbox:
                compat.send(letter(3))
                db.session.commit()
            assert [m.subject for m in outbox] == ["Letter 3"]
            assert outbox[0].recipients == ["user3@example.com"]
    finally:
        close_app(app)


def test_connect_queues_the_block_in_one_insert_in_order(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO OUTBOX_EMAIL"):
            statements.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", count)
    try:
        with current_app.extensions["mail"].connect() as conn:
            assert isinstance(conn, Connection)
            for i in range(5):
                conn.send(letter(i))
            assert statements == []  # kept until the block ends
        assert conn.num_emails == 5
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", count)
    assert len(statements) == 1
    assert not smtp_server.wait_for(1, timeout=0.3)
    db.session.commit()
    assert smtp_server.wait_for(5)
    assert [r["subject"] for r in rows(app)] == [f"Letter {i}" for i in range(5)]
    assert [r["id"] for r in rows(app)] == conn.ids


def test_connect_rejects_a_bad_message_at_its_send(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with mail.connect() as conn:
        conn.send(letter(0))
        with pytest.raises(InvalidMessage, match="^recipients"):
            conn.send(Message("Nobody", body="x"))
        with pytest.raises(InvalidMessage, match="^envelope_from"):
            conn.send(letter(1), envelope_from="bounce@example.com")
        conn.send_message("Shortcut", ["s@example.com"], "b")
    assert conn.num_emails == 2
    db.session.commit()
    assert sorted(r["subject"] for r in rows(app)) == ["Letter 0", "Shortcut"]


def test_connect_block_that_raises_leaves_the_commit_to_decide(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    # Flask-Mail had sent the messages before the exception; the outbox queues
    # them, and the caller's transaction decides.
    with pytest.raises(KeyError), mail.connect() as conn:
        conn.send(letter(0))
        conn.send(letter(1))
        raise KeyError("user 3 has no address")
    db.session.commit()
    assert smtp_server.wait_for(2)
    assert sorted(r["subject"] for r in rows(app)) == ["Letter 0", "Letter 1"]

    with pytest.raises(KeyError), mail.connect() as conn:
        conn.send(letter(2))
        raise KeyError("again")
    db.session.rollback()
    assert mail.wait_idle(5)
    assert len(rows(app)) == 2


def test_a_flask_mail_message_is_refused_with_the_fix(app: Flask, mail: OutboxMail) -> None:
    old = flask_mail.Message("Hi", recipients=["a@example.com"], body="x")
    with pytest.raises(InvalidMessage, match="import Message from flask_mail_outbox"):
        mail.send(old)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessage, match=r"^messages\[0\]\.msg: .*flask_mail\.Message"):
        mail.send_many([old])  # type: ignore[list-item]


def test_default_sender_and_ascii_attachments_set_after_init_app_apply(db_url: str) -> None:
    """Flask-Mail's tests (and some apps) set these on the state after init_app."""
    from conftest import close_app, make_app

    from flask_mail_outbox import InvalidMessage, Message

    app = make_app(db_url, TESTING=True)
    try:
        state = app.extensions["mail"]
        mail = app.extensions["test_mail"]
        with app.app_context():
            state.default_sender = ("Shop", "shop@example.com")
            assert state.default_sender == ("Shop", "shop@example.com")
            msg = Message("Hi", ["a@example.com"], "x")
            msg.attach("Grüße.txt", "text/plain", b"x")
            state.ascii_attachments = True
            assert state.ascii_attachments is True
            mime = msg.as_bytes()
            assert b"From: Shop <shop@example.com>" in mime
            assert b'filename="Grue.txt"' in mime  # Flask-Mail's NFKD + ASCII
            state.default_sender = None
            with pytest.raises(InvalidMessage, match="sender"):
                mail.send(Message("No sender", ["a@example.com"], "x"))
    finally:
        close_app(app)
