"""Transactional send: commit publishes, rollback discards, savepoints, idempotency."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import User, close_app, db, make_app, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core import attachment_table


def welcome(to: str = "user@example.com", **kwargs: Any) -> Message:
    return Message("Welcome", recipients=[to], body="Hi!", **kwargs)


def test_send_commit_delivers_once_with_stored_message_id(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    db.session.add(User(email="user@example.com"))
    email_id = mail.send(welcome())
    db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    [row] = rows(app)
    assert row["id"] == email_id
    assert row["status"] == "sent" and row["sent_at"] is not None
    assert row["attempts"] == 1
    assert smtp_server.message_ids() == [row["message_id"]]
    [received] = smtp_server.messages
    assert received.rcpt_tos == ["user@example.com"]
    assert received.mail_from == "sender@example.com"
    assert received.parsed["Subject"] == "Welcome"


def test_nothing_arrives_before_commit_and_rollback_sends_nothing(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send(welcome())
    # Flushed into the open transaction, not committed, not handed over.
    assert mail.wait_idle(5)
    assert not smtp_server.wait_for(1, timeout=0.5)
    db.session.rollback()
    assert mail.wait_idle(5)
    assert smtp_server.messages == []
    assert rows(app) == []


def test_send_does_not_commit_the_callers_transaction(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    db.session.add(User(email="a@example.com"))
    mail.send(welcome())
    db.session.rollback()
    with app.app_context():
        assert db.session.query(User).count() == 0
    assert rows(app) == []


def test_savepoint_rollback_discards_only_its_email(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send(welcome("outer@example.com"))
    nested = db.session.begin_nested()
    mail.send(welcome("inner@example.com"))
    nested.rollback()
    mail.send(welcome("after@example.com"))
    db.session.commit()
    assert smtp_server.wait_for(2)
    assert mail.wait_idle(10)
    got = sorted(m.rcpt_tos[0] for m in smtp_server.messages)
    assert got == ["after@example.com", "outer@example.com"]
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]


def test_released_savepoint_sends_nothing_until_outer_commit(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with db.session.begin_nested():
        mail.send(welcome("inner@example.com"))
    # The savepoint was released: not a commit.
    assert mail.wait_idle(5)
    assert not smtp_server.wait_for(1, timeout=0.5)
    db.session.commit()
    assert smtp_server.wait_for(1)
    assert smtp_server.messages[0].rcpt_tos == ["inner@example.com"]


def test_nested_savepoints_inner_rollback_outer_release(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    outer = db.session.begin_nested()
    mail.send(welcome("level1@example.com"))
    inner = db.session.begin_nested()
    mail.send(welcome("level2@example.com"))
    inner.rollback()
    outer.commit()
    db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    assert [m.rcpt_tos[0] for m in smtp_server.messages] == ["level1@example.com"]


def test_idempotency_key_twice_gives_one_row_one_delivery(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    first = mail.send(welcome(), idempotency_key="signup:42")
    second = mail.send(welcome(), idempotency_key="signup:42")
    db.session.commit()
    third = mail.send(welcome(), idempotency_key="signup:42")
    db.session.commit()
    assert first == second == third
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    assert not smtp_server.wait_for(2, timeout=0.5)
    assert len(rows(app)) == 1


def test_three_hundred_emails_in_one_transaction(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    for i in range(300):
        mail.send(welcome(f"user{i}@example.com"))
    db.session.commit()
    assert smtp_server.wait_for(300, timeout=60)
    assert mail.wait_idle(30)
    ids = smtp_server.message_ids()
    assert len(ids) == 300 and len(set(ids)) == 300
    assert {r["status"] for r in rows(app)} == {"sent"}
    assert {r["message_id"] for r in rows(app)} == set(ids)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_stores_an_email_in_one_insert_and_returns_its_rows_id(db_url: str) -> None:
    # The id of a plain send() is the insert's own rowid: no RETURNING row to
    # fetch, no second statement; each id names the row its email went into.
    app = make_app(db_url, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                   OUTBOX_TRANSPORT="null")
    mail: OutboxMail = app.extensions["test_mail"]
    statements: list[str] = []
    try:
        with app.app_context():
            db.session.execute(sa.text("SELECT 1"))  # the transaction is open: only sends count
            sa.event.listen(db.engine, "before_cursor_execute",
                            lambda _c, _cur, sql, *_: statements.append(sql))
            ids = [mail.send(welcome(f"user{i}@example.com")) for i in range(3)]
            db.session.commit()
        assert len(statements) == 3
        assert all(s.startswith("INSERT INTO outbox_email") and "RETURNING" not in s
                   for s in statements)
        stored = {r["id"]: r["recipients"] for r in rows(app)}
        assert [stored[i] for i in ids] == [f'["user{i}@example.com"]' for i in range(3)]
    finally:
        close_app(app)


def test_invalid_message_writes_nothing(app: Flask, mail: OutboxMail) -> None:
    with pytest.raises(InvalidMessage, match="recipients"):
        mail.send(Message("No one", recipients=[], body="x"))
    with pytest.raises(InvalidMessage, match="subject"):
        mail.send(Message("Bad\r\nBcc: evil@example.com", recipients=["a@example.com"]))
    with pytest.raises(InvalidMessage, match="key"):
        mail.send(welcome(), key="")
    with pytest.raises(InvalidMessage, match="send_after"):
        mail.send(welcome(), send_after="tomorrow")  # type: ignore[arg-type]
    db.session.commit()
    assert rows(app) == []


def test_attachments_are_listed(app: Flask, mail: OutboxMail,
                                smtp_server: FaultSMTPServer) -> None:
    msg = welcome()
    msg.attach("report.pdf", "application/pdf", bytes(range(256)) * 4)
    email_id = mail.send(msg)
    db.session.commit()
    with app.app_context(), db.engine.connect() as conn:
        listed = conn.execute(attachment_table.select()).mappings().all()
    assert [(a["email_id"], a["filename"], a["content_type"], a["size"]) for a in listed] == [
        (email_id, "report.pdf", "application/pdf", 1024)]
    assert smtp_server.wait_for(1)


def test_forgotten_commit_is_an_error_explicit_rollback_is_not(
        app: Flask, mail: OutboxMail, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    email_id = mail.send(welcome())
    db.session.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert str(email_id) in errors[0].getMessage()
    assert "db.session.commit()" in errors[0].getMessage()
    caplog.clear()
    mail.send(welcome())
    db.session.rollback()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert rows(app) == []


def test_request_that_raises_is_not_a_forgotten_commit(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Not the `app` fixture: pytest-flask keeps an app context pushed around
    # tests that use it, and the session only ends when a request's own
    # app context is torn down.
    web = make_app(db_url, MAIL_SUPPRESS_SEND=True, PROPAGATE_EXCEPTIONS=False)
    mail: OutboxMail = web.extensions["test_mail"]

    @web.post("/boom")
    def boom() -> str:
        mail.send(welcome())
        raise RuntimeError("view failed")

    @web.post("/forgot")
    def forgot() -> str:
        mail.send(welcome())
        return "ok"

    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    try:
        with web.test_client() as client:
            assert client.post("/boom").status_code == 500
        ours = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")]
        assert not [r for r in ours if r.levelno >= logging.WARNING]
        assert any("request failed" in r.getMessage() for r in ours)
        caplog.clear()
        with web.test_client() as client:
            assert client.post("/forgot").status_code == 200
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "forgotten db.session.commit()" in errors[0].getMessage()
        assert rows(web) == []
    finally:
        close_app(web)


def test_many_threads_committing_while_delivering(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    @app.post("/signup/<int:n>")
    def signup(n: int) -> str:
        db.session.add(User(email=f"u{n}@example.com"))
        mail.send(welcome(f"u{n}@example.com"))
        db.session.commit()
        return "ok"

    failures: list[BaseException] = []

    def client_thread(t: int) -> None:
        try:
            with app.test_client() as client:
                for i in range(40):
                    response = client.post(f"/signup/{t * 1000 + i}")
                    if response.status_code != 200:
                        failures.append(RuntimeError(response.get_data(as_text=True)))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=client_thread, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert smtp_server.wait_for(240, timeout=60)
    assert mail.wait_idle(30)
    assert len(set(smtp_server.message_ids())) == 240
    assert {r["status"] for r in rows(app)} == {"sent"}
    with app.app_context():
        assert db.session.scalar(sa.select(sa.func.count()).select_from(User)) == 240
