"""Inline delivery over a real SMTP server: outcomes, errors, the request never waits."""

from __future__ import annotations

import email.policy
import json
import logging
import threading
from email.parser import BytesParser
from typing import Any

import pytest
from conftest import MakeApps, User, close_app, db, free_port, make_app, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import (
    Message,
    OutboxMail,
    email_failed,
    email_queued,
    email_sent,
)
from flask_mail_outbox.core import Outbox


def test_view_returns_while_smtp_server_holds_the_message(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    @app.post("/signup")
    def signup() -> str:
        db.session.add(User(email="new@example.com"))
        mail.send(Message("Welcome", recipients=["new@example.com"], body="Hi"))
        db.session.commit()
        return "ok"

    smtp_server.hold()
    with app.test_client() as client:
        response = client.post("/signup")
    assert response.status_code == 200
    # The response is back, and the server is still holding the message:
    # the request did not wait for SMTP.
    assert smtp_server.wait_held(1)
    assert smtp_server.messages == []
    assert [r["status"] for r in rows(app)] == ["sending"]
    smtp_server.release()
    assert smtp_server.wait_for(1)
    assert wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=15.0)[0]["status"] == "sent"


def test_everything_arrives_intact(app: Flask, mail: OutboxMail,
                                   smtp_server: FaultSMTPServer) -> None:
    payload = bytes(range(256)) * 10
    msg = Message(
        "Grüße — 你好",
        recipients=[("Zoë Ünïcode", "to@example.com")],
        body="Plain text: naïve café\n",
        html="<p>HTML: <b>naïve café</b></p>",
        cc=["cc@example.com"],
        bcc=["hidden@example.com"],
        reply_to="reply@example.com",
        extra_headers={"X-Campaign": "welcome-1"},
    )
    msg.attach("data.bin", "application/octet-stream", payload)
    mail.send(msg)
    db.session.commit()
    assert smtp_server.wait_for(1)
    [received] = smtp_server.messages
    assert sorted(received.rcpt_tos) == ["cc@example.com", "hidden@example.com",
                                         "to@example.com"]
    parsed = BytesParser(policy=email.policy.default).parsebytes(received.data)
    assert parsed["Subject"] == "Grüße — 你好"
    assert parsed["To"].addresses[0].display_name == "Zoë Ünïcode"
    assert parsed["Cc"] == "cc@example.com"
    assert parsed["Bcc"] is None and b"hidden@example.com" not in received.data
    assert parsed["Reply-To"] == "reply@example.com"
    assert parsed["X-Campaign"] == "welcome-1"
    # Text parts travel in canonical CRLF form.
    text = parsed.get_body(("plain",)).get_content().replace("\r\n", "\n")
    assert text == "Plain text: naïve café\n"
    assert "<b>naïve café</b>" in parsed.get_body(("html",)).get_content()
    [attachment] = list(parsed.iter_attachments())
    assert attachment.get_filename() == "data.bin"
    assert attachment.get_content() == payload


def test_the_servers_queue_id_is_the_provider_message_id(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    seen: list[str | None] = []

    def on_sent(sender: Flask, message: Any, **_: Any) -> None:
        seen.append(message.provider_message_id)

    with email_sent.connected_to(on_sent, app):
        ids = [mail.send(Message("x", recipients=[f"u{n}@example.com"], body="x"))
               for n in range(3)]
        db.session.commit()
        assert smtp_server.wait_for(3)
        wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), 10)
    queue_ids = {m.message_id: m.queue_id for m in smtp_server.messages}
    stored = {r["message_id"]: r["provider_message_id"] for r in rows(app) if r["id"] in ids}
    assert stored == queue_ids and all(stored.values())
    assert sorted(seen, key=str) == sorted(queue_ids.values())


def test_smtp_550_fails_permanently_with_the_reply(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    smtp_server.reply("data", 550, "5.7.1 Message rejected as spam")
    failures: list[dict[str, Any]] = []

    def on_failed(sender: Flask, **kwargs: Any) -> None:
        failures.append(kwargs)

    email_failed.connect(on_failed, app)
    try:
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=15.0)
    finally:
        email_failed.disconnect(on_failed, app)
    assert row["status"] == "failed" and row["attempts"] == 1
    assert "550" in row["last_error"] and "rejected as spam" in row["last_error"]
    history = json.loads(row["error_history"])
    assert history[0]["code"] == 550 and history[0]["attempt"] == 1
    assert mail.wait_idle(5)
    assert [f["email_id"] for f in failures] == [email_id]
    assert any(r.levelno == logging.ERROR and f"mail.retry({email_id})" in r.getMessage()
               for r in caplog.records)


def test_unreachable_server_leaves_row_queued_with_an_error(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(db_url, MAIL_SERVER="127.0.0.1", MAIL_PORT=free_port(),
                   OUTBOX_INLINE_RETRIES=1, MAIL_TIMEOUT=2)
    mail: OutboxMail = app.extensions["test_mail"]
    caplog.set_level(logging.INFO)
    try:
        with app.app_context():
            email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert mail.wait_idle(20)
        [row] = rows(app)
        assert row["status"] == "queued" and "Connect call failed" in row["last_error"]
        # A refused connection pauses the transport (test_pause.py): the attempt is given
        # back, and one ERROR names the transport, not the email.
        assert row["attempts"] == 0
        errors = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")
                  and r.levelno == logging.ERROR]
        assert [r.getMessage().startswith("Transport 'default' is paused since")
                and "cannot be reached" in r.getMessage() for r in errors] == [True]
        assert row["id"] == email_id
        assert not [r for r in caplog.records if r.name.startswith("flask_mail_outbox")
                    and r.levelno == logging.WARNING]
    finally:
        close_app(app)


def test_two_transient_failures_then_success(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 Temporary failure", times=2)
    mail.send(Message("x", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(1, timeout=20)
    assert mail.wait_idle(10)
    [row] = rows(app)
    assert row["status"] == "sent" and row["attempts"] == 3
    assert [h["code"] for h in json.loads(row["error_history"])] == [451, 451]
    assert len(smtp_server.messages) == 1


def test_partial_refusal_is_sent_recorded_and_reported(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    smtp_server.refuse_recipient("bad@example.com", 550, "5.1.1 No such user")
    mail.send(Message("x", recipients=["good@example.com", "bad@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(1)
    [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=15.0)
    assert row["attempts"] == 1
    assert "bad@example.com" in row["last_error"] and "550" in row["last_error"]
    assert mail.wait_idle(5)
    # Not retried: a retry would send a second copy to good@example.com.
    assert not smtp_server.wait_for(2, timeout=0.5)
    assert smtp_server.messages[0].rcpt_tos == ["good@example.com"]
    assert any(r.levelno == logging.ERROR and "refused for others" in r.getMessage()
               for r in caplog.records)


def test_every_recipient_refused_is_permanent(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("bad@example.com", 550, "5.1.1 No such user")
    mail.send(Message("x", recipients=["bad@example.com"], body="x"))
    db.session.commit()
    [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=15.0)
    assert row["status"] == "failed" and "every recipient refused" in row["last_error"]


def test_password_never_logged_or_stored(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cr3t-Pa55word-xyz"
    smtp_server.require_auth("user", "the-right-one")
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   MAIL_USERNAME="user", MAIL_PASSWORD=secret, OUTBOX_INLINE_RETRIES=0)
    mail: OutboxMail = app.extensions["test_mail"]
    caplog.set_level(logging.DEBUG)
    try:
        with app.app_context():
            mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert mail.wait_idle(20)
        [row] = rows(app)
        assert row["status"] == "queued" and "authentication failed" in row["last_error"]
        assert smtp_server.auth_attempts >= 1
        texts = [r.getMessage() for r in caplog.records] + [caplog.text, row["last_error"],
                                                             row["error_history"]]
        import base64
        encoded = base64.b64encode(f"\0user\0{secret}".encode()).decode()
        for text in texts:
            assert secret not in text and encoded not in text
        assert secret not in repr(app.extensions["mail_outbox"].config)
    finally:
        close_app(app)


def test_auth_success(db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.require_auth("user", "right")
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   MAIL_USERNAME="user", MAIL_PASSWORD="right")
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert smtp_server.wait_for(1)
    finally:
        close_app(app)


def test_signals_and_record_messages(app: Flask, mail: OutboxMail,
                                     smtp_server: FaultSMTPServer) -> None:
    queued: list[int] = []

    def on_queued(sender: Flask, email_id: int, **_: Any) -> None:
        queued.append(email_id)

    email_queued.connect(on_queued, app)
    try:
        with mail.record_messages() as outbox:
            email_id = mail.send(Message("Hello", recipients=["a@example.com"], body="Hi",
                                         html="<p>Hi</p>"))
            assert queued == []
            db.session.commit()
            assert queued == [email_id]
            assert smtp_server.wait_for(1)
            assert mail.wait_idle(10)
    finally:
        email_queued.disconnect(on_queued, app)
    [message] = outbox
    assert message.email_id == email_id
    assert message.subject == "Hello" and message.recipients == ["a@example.com"]
    assert message.body == "Hi\n" or message.body == "Hi"
    assert message.html is not None and "<p>Hi</p>" in message.html
    assert message.message_id == smtp_server.message_ids()[0]


def test_memory_transport_delivers_inside_commit(db_url: str) -> None:
    app = make_app(db_url, TESTING=True)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context(), mail.record_messages() as outbox:
            mail.send(Message("Hello", recipients=["a@example.com"], body="Hi"))
            assert outbox == []
            db.session.commit()
            assert [m.subject for m in outbox] == ["Hello"]
        assert rows(app)[0]["status"] == "sent"
    finally:
        close_app(app)


def test_connections_are_reused_across_a_batch(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    for i in range(40):
        mail.send(Message("x", recipients=[f"u{i}@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(40)
    assert mail.wait_idle(10)
    # A small pool, not a connection per email.
    assert smtp_server.connections <= 4


def test_pooled_connection_closed_by_server_is_reopened_without_an_attempt(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send(Message("first", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    smtp_server.drop("mail", times=1)  # the pooled connection dies at the next MAIL FROM
    mail.send(Message("second", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(2)
    assert mail.wait_idle(10)
    second = rows(app)[1]
    assert second["status"] == "sent" and second["attempts"] == 1


def test_use_tls_false_never_upgrades(db_url: str) -> None:
    with FaultSMTPServer(starttls=True) as server:
        app = make_app(db_url, MAIL_SERVER=server.host, MAIL_PORT=server.port,
                       MAIL_USE_TLS=False)
        mail: OutboxMail = app.extensions["test_mail"]
        try:
            with app.app_context():
                mail.send(Message("x", recipients=["a@example.com"], body="x"))
                db.session.commit()
                assert server.wait_for(1)
            assert server.messages[0].tls is False
        finally:
            close_app(app)


def test_concurrent_senders_never_share_a_row(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    # Two processes' cores offered the same ids at once: the claim lets one through.
    ids = []
    for i in range(30):
        ids.append(mail.send(Message("x", recipients=[f"u{i}@example.com"], body="x")))
    smtp_server.hold()
    db.session.commit()
    state = app.extensions["mail_outbox"]
    with app.app_context():
        rival = Outbox(db.engine.url, state.config)  # another process's core, in a thread
    results: list[Any] = []
    racer = threading.Thread(target=lambda: results.append(rival.worker.deliver(ids, 30)))
    with app.app_context():
        racer.start()
        assert smtp_server.wait_held(1)  # a delivery is at the server: now race it
        smtp_server.release()
        racer.join(20)
    assert smtp_server.wait_for(30)
    assert mail.wait_idle(10)
    assert not smtp_server.wait_for(31, timeout=0.5)  # no second copy of anything
    assert len(set(smtp_server.message_ids())) == 30
    rival.stop(5)


def test_delivery_thread_is_restarted_in_a_forked_child(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    import os

    mail.send(Message("parent", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads did not survive the fork
        code = 1
        try:
            with app.app_context():
                mail.send(Message("child", recipients=["a@example.com"], body="x"))
                db.session.commit()
                code = 0 if mail.wait_idle(20) else 2
            mail.stop()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert smtp_server.wait_for(2)
    assert sorted(m.parsed["Subject"] for m in smtp_server.messages) == ["child", "parent"]
    # The parent still delivers after the child came and went.
    mail.send(Message("parent again", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(3)


def test_stop_is_idempotent_and_delivery_resumes_lazily(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send(Message("one", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(1)
    mail.stop()
    mail.stop()
    assert not [t for t in threading.enumerate() if t.name == "outbox-inline" and t.is_alive()]
    mail.send(Message("two", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_for(2)


def test_no_delivery_thread_until_something_is_committed(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    before = {t.ident for t in threading.enumerate()}
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    try:
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not [name for name in started if name.startswith("outbox")]
    finally:
        close_app(app)


def test_stop_releases_claimed_rows_not_yet_handed_to_the_server(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.hold()
    for i in range(10):
        mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
    db.session.commit()
    assert smtp_server.wait_held(4)  # four connections, each holding one message
    mail.stop(timeout=1)
    # The six never handed to the server are queued again with their attempt
    # released, at once; the four in flight keep their lease.
    assert sorted((r["status"], r["attempts"]) for r in rows(app)) == (
        [("queued", 0)] * 6 + [("sending", 1)] * 4)
    smtp_server.release()
    assert smtp_server.wait_for(4)
    assert not smtp_server.wait_for(5, timeout=0.5)


@pytest.mark.parametrize("durable", [False, True], ids=["inline", "durable"])
def test_outbox_concurrency_is_the_number_of_connections_a_process_opens(
        make_apps: MakeApps, smtp_server: FaultSMTPServer, durable: bool) -> None:
    """OUTBOX_CONCURRENCY bounds the SMTP connections of the inline worker and
    of the in-process dispatcher alike (``--concurrency`` for `flask outbox worker`)."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=durable, OUTBOX_CONCURRENCY=3,
                          OUTBOX_POLL_INTERVAL=0.1)
    smtp_server.hold()
    with app.app_context():
        for i in range(8):
            mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_held(3)
    # Eight are waiting, and no fourth connection opens while three are held.
    assert not smtp_server.wait_until(lambda: smtp_server.held > 3, timeout=1.0)
    assert smtp_server.active_connections == 3
    smtp_server.release()
    assert smtp_server.wait_for(8)
    assert smtp_server.max_concurrent_connections == 3
