"""Durable mode: leased claims, retries, dead letters, key order, the toggle."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from flask import Flask

from conftest import db, make_app
from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._models import email_table
from smtpserver import FaultSMTPServer


def rows(app: Flask) -> list[dict[str, Any]]:
    with app.app_context(), db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            email_table.select().order_by(email_table.c.id)).mappings()]


def wait_rows(app: Flask, predicate: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        current = rows(app)
        if predicate(current) or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


@pytest.fixture
def durable_app(db_url: str, smtp_server: FaultSMTPServer) -> Any:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RETRY_BASE_SECONDS=0.05,
                   OUTBOX_RETRY_MAX_SECONDS=0.2, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_POLL_MAX_INTERVAL=0.2)
    yield app
    app.extensions["test_mail"].stop(timeout=5)
    with app.app_context():
        db.session.remove()
        for engine in db.engines.values():
            engine.dispose()


def test_durable_send_is_delivered_by_the_dispatcher(
        durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    with durable_app.app_context():
        assert mail.durable is True
        mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert smtp_server.wait_for(1)
        assert mail.wait_idle(10)
        runtime = durable_app.extensions["mail_outbox"].current_runtime()
        assert runtime.dispatcher is not None and runtime.dispatcher.running
        assert not runtime.inline.idle() or runtime.inline._thread is None
    [row] = rows(durable_app)
    assert row["status"] == "sent" and row["attempts"] == 1


def test_two_transient_failures_then_success_counts_three_attempts(
        durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.reply("data", 451, "4.3.0 try later", times=2)
    with durable_app.app_context():
        mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_for(1)
    [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent")
    assert row["attempts"] == 3
    assert [h["attempt"] for h in json.loads(row["error_history"])] == [1, 2]
    time.sleep(0.3)
    assert len(smtp_server.messages) == 1


def test_permanent_failure_dead_letters_and_retry_delivers(
        durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.reply("data", 554, "5.7.1 rejected", times=1)
    with durable_app.app_context():
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "failed")
        assert row["attempts"] == 1
        [dead] = mail.dead_letters()
        assert dead["id"] == email_id and dead["error_history"][0]["code"] == 554
        mail.retry(email_id)
        assert smtp_server.wait_for(1)
        [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent")
        assert row["attempts"] == 1
        assert mail.dead_letters() == []
        with pytest.raises(LookupError):
            mail.retry(email_id)


def test_always_4xx_fails_after_max_attempts(db_url: str,
                                             smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 try later")
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RETRY_BASE_SECONDS=0.02,
                   OUTBOX_RETRY_MAX_SECONDS=0.05, OUTBOX_MAX_ATTEMPTS=4,
                   OUTBOX_POLL_INTERVAL=0.02, OUTBOX_POLL_MAX_INTERVAL=0.1)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed")
        assert row["status"] == "failed" and row["attempts"] == 4
        assert len(json.loads(row["error_history"])) == 4
        assert smtp_server.data_attempts == 4
    finally:
        mail.stop()
        with app.app_context():
            for engine in db.engines.values():
                engine.dispose()


def test_one_key_is_delivered_in_send_order(durable_app: Flask,
                                            smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.delay("data", 0.01)
    with durable_app.app_context():
        for i in range(25):
            mail.send(Message(f"n{i:02d}", recipients=["a@example.com"], body="x"),
                      key="user:42")
            db.session.commit()
        for i in range(10):
            mail.send(Message(f"free{i}", recipients=["b@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_for(35, timeout=30)
    keyed = [m.parsed["Subject"] for m in smtp_server.messages
             if m.parsed["Subject"].startswith("n")]
    assert keyed == [f"n{i:02d}" for i in range(25)]


def test_a_dead_lettered_email_releases_its_key(durable_app: Flask,
                                                smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.refuse_recipient("bad@example.com", 550)
    with durable_app.app_context():
        mail.send(Message("first", recipients=["bad@example.com"], body="x"), key="k")
        mail.send(Message("second", recipients=["a@example.com"], body="x"), key="k")
        db.session.commit()
    assert smtp_server.wait_for(1)
    assert [r["status"] for r in wait_rows(durable_app, lambda r: r[1]["status"] == "sent")] \
        == ["failed", "sent"]


def test_send_after_waits_until_due(durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    from datetime import timedelta

    mail: OutboxMail = durable_app.extensions["test_mail"]
    with durable_app.app_context():
        mail.send(Message("later", recipients=["a@example.com"], body="x"),
                  send_after=timedelta(seconds=1.5))
        mail.send(Message("now", recipients=["a@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_for(1)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["now"]
    assert smtp_server.wait_for(2, timeout=10)
    assert smtp_server.messages[1].parsed["Subject"] == "later"


def test_toggle_is_shared_by_apps_on_one_database(db_url: str,
                                                  smtp_server: FaultSMTPServer) -> None:
    first = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                     OUTBOX_SETTINGS_TTL_SECONDS=0)
    second = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                      OUTBOX_SETTINGS_TTL_SECONDS=0)
    apps = [first, second]
    try:
        with first.app_context():
            assert first.extensions["test_mail"].durable is False
            first.extensions["test_mail"].set_durable(True)
        with second.app_context():
            assert second.extensions["test_mail"].durable is True
        result = second.test_cli_runner().invoke(args=["outbox", "durable", "status"])
        assert result.output.strip() == "durable"
        result = second.test_cli_runner().invoke(args=["outbox", "durable", "off"])
        assert result.exit_code == 0, result.output
        with first.app_context():
            assert first.extensions["test_mail"].durable is False
        result = first.test_cli_runner().invoke(args=["outbox", "durable", "status"])
        assert result.output.strip() == "inline"
    finally:
        for app in apps:
            app.extensions["test_mail"].stop()
            with app.app_context():
                for engine in db.engines.values():
                    engine.dispose()


def test_switching_modes_strands_nothing(db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_SETTINGS_TTL_SECONDS=0, OUTBOX_POLL_INTERVAL=0.05)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("inline", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert smtp_server.wait_for(1)
            mail.set_durable(True)
            mail.send(Message("durable", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert smtp_server.wait_for(2)
            mail.set_durable(False)
            mail.send(Message("inline again", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert smtp_server.wait_for(3)
        assert len(set(smtp_server.message_ids())) == 3
    finally:
        mail.stop()
        with app.app_context():
            for engine in db.engines.values():
                engine.dispose()


def test_worker_once_delivers_what_is_due(db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True, OUTBOX_BATCH_SIZE=7)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            for i in range(20):
                mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
            db.session.commit()
        assert not smtp_server.wait_for(1, timeout=0.5)  # nobody runs a dispatcher yet
        result = app.test_cli_runner().invoke(args=["outbox", "worker", "--once"])
        assert result.exit_code == 0, result.output
        assert "20 email(s)" in result.output
        assert smtp_server.wait_for(20)
        assert {r["status"] for r in rows(app)} == {"sent"}
    finally:
        mail.stop()
        with app.app_context():
            for engine in db.engines.values():
                engine.dispose()


def test_expired_lease_is_reaped_and_redelivered(durable_app: Flask,
                                                 smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    with durable_app.app_context():
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        # Pretend a dead process claimed it: sending, lease long expired, attempt 1.
        db.session.execute(email_table.update().where(email_table.c.id == email_id).values(
            status="sending", attempts=1, lease_owner="dead:1:1:x",
            lease_expires_at=email_table.c.created_at))
        db.session.commit()
    assert smtp_server.wait_for(1)
    [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent")
    assert row["attempts"] == 2
