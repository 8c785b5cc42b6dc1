"""The sweep: what it takes, how many, how it routes, what it reports; the commands."""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any

import pytest
from conftest import MakeApps, db, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message
from flask_mail_outbox.core import email_table


def strand(make_apps: MakeApps, count: int, **config: Any) -> list[int]:
    """Rows left queued by a process whose SMTP server failed them (451 at MAIL FROM).

    A transient failure of the message, not of the whole transport (an unreachable
    server would pause the transport, and its rows would wait for its probe). With no
    backoff (``OUTBOX_RETRY_BASE_SECONDS=0``) they are due again at once, so a sweep may
    take them as soon as the test wants.
    """
    with FaultSMTPServer() as failing:
        failing.reply("mail", 451, "4.3.0 Temporary failure, try again")
        app, mail = make_apps(MAIL_SERVER=failing.host, MAIL_PORT=failing.port,
                              OUTBOX_INLINE_RETRIES=0, MAIL_TIMEOUT=2,
                              OUTBOX_RETRY_BASE_SECONDS=0, **config)
        with app.app_context():
            ids = [mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
                   for i in range(count)]
            db.session.commit()
            assert mail.wait_idle(20)
        mail.stop()
    assert {r["status"] for r in rows(app)} == {"queued"}
    return ids


def test_next_start_sweeps_stranded_rows(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 3)
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_SCHEDULER=True, OUTBOX_SWEEP_MIN_AGE_SECONDS=0)
    with app.app_context():
        report = mail.wait_sweep(20)
    assert report is not None
    assert (report.scanned, report.sent, report.failed, report.truncated) == (3, 3, 0, False)
    assert smtp_server.wait_for(3)
    assert {r["status"] for r in rows(app)} == {"sent"}
    with app.app_context():
        stats = mail.stats()
    assert stats["last_sweep"]["sent"] == 3


def test_rows_younger_than_the_age_gate_are_untouched(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 2)
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with app.app_context():
        report = mail.sweep()  # default min age: 300 s
    assert report.scanned == 0 and report.sent == 0
    assert {r["status"] for r in rows(app)} == {"queued"}


def test_batch_cap_reads_one_more_to_know_it_stopped_short(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    strand(make_apps, 7)
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_SWEEP_BATCH=5)
    with app.app_context():
        first = mail.sweep(min_age=0)
        second = mail.sweep(min_age=0)
        third = mail.sweep(min_age=0, limit=2)
    assert (first.scanned, first.sent, first.truncated) == (5, 5, True)
    assert (second.scanned, second.sent, second.truncated) == (2, 2, False)
    assert (third.scanned, third.truncated) == (0, False)
    truncations = [r for r in caplog.records if r.levelno == logging.ERROR
                   and "stopped at OUTBOX_SWEEP_BATCH" in r.getMessage()]
    assert len(truncations) == 1 and "next periodic sweep, in 60 s" in truncations[0].getMessage()


def test_exactly_a_full_batch_is_not_truncated(make_apps: MakeApps,
                                               smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 5)
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with app.app_context():
        report = mail.sweep(min_age=0, limit=5)
    assert (report.scanned, report.sent, report.truncated) == (5, 5, False)


def test_sweep_respects_due_times_and_key_order(make_apps: MakeApps,
                                                smtp_server: FaultSMTPServer) -> None:
    # A server failing each message (not the whole transport, which would pause it).
    with FaultSMTPServer() as failing:
        failing.reply("mail", 451, "4.3.0 Temporary failure, try again")
        app, mail = make_apps(MAIL_SERVER=failing.host, MAIL_PORT=failing.port,
                              OUTBOX_INLINE_RETRIES=0, MAIL_TIMEOUT=2,
                              OUTBOX_RETRY_BASE_SECONDS=0)
        with app.app_context():
            mail.send(Message("later", recipients=["a@example.com"], body="x"),
                      send_after=timedelta(hours=1))
            mail.send(Message("k1", recipients=["a@example.com"], body="x"), key="k")
            mail.send(Message("k2", recipients=["a@example.com"], body="x"), key="k")
            db.session.commit()
            assert mail.wait_idle(20)
        mail.stop()
    sweeper, smail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with sweeper.app_context():
        first = smail.sweep(min_age=0)
        # Only the head of "k" was taken ("later" is not due); once it went out,
        # the key's next email is handed to inline delivery at once.
        assert (first.scanned, first.sent) == (1, 1)
        assert smtp_server.wait_for(2)
        assert smail.wait_idle(10)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["k1", "k2"]
    assert [r["status"] for r in rows(sweeper)] == ["queued", "sent", "sent"]


def test_sweep_takes_expired_leases_and_skips_live_ones(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    with app.app_context():
        dead = mail.send(Message("dead", recipients=["a@example.com"], body="x"))
        alive = mail.send(Message("alive", recipients=["a@example.com"], body="x"))
        db.session.commit()
    store = app.extensions["mail_outbox"].outbox().store
    store.leases.claim_ids([dead], owner="dead-process", lease_seconds=60)
    store.leases.claim_ids([alive], owner="live-process", lease_seconds=600)
    with app.app_context():
        db.session.execute(email_table.update().where(email_table.c.id == dead).values(
            lease_expires_at=email_table.c.created_at))
        db.session.commit()
    inline, imail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with inline.app_context():
        imail.set_durable(False)
        report = imail.sweep(min_age=0)
    assert (report.scanned, report.sent) == (1, 1)
    assert smtp_server.wait_for(1)
    assert smtp_server.messages[0].parsed["Subject"] == "dead"
    assert [(r["status"], r["attempts"]) for r in rows(app)] == [("sent", 2), ("sending", 1)]


def test_durable_sweeps_requeue_without_delivering_and_twice_is_harmless(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    with app.app_context():
        ids = [mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
               for i in range(3)]
        db.session.commit()
    store = app.extensions["mail_outbox"].outbox().store
    store.leases.claim_ids(ids[:1], owner="dead-process", lease_seconds=60)
    with app.app_context():
        db.session.execute(email_table.update().where(email_table.c.id == ids[0]).values(
            lease_expires_at=email_table.c.created_at))
        db.session.commit()
        first = mail.sweep(min_age=0)
        second = mail.sweep(min_age=0)
    assert (first.scanned, first.requeued, first.sent, first.mode) == (3, 3, 0, "durable")
    assert (second.scanned, second.requeued) == (3, 3)
    assert smtp_server.messages == []
    assert [r["status"] for r in rows(app)] == ["queued"] * 3
    result = app.test_cli_runner().invoke(args=["outbox", "worker", "--once"])
    assert result.exit_code == 0, result.output
    assert smtp_server.wait_for(3)
    assert not smtp_server.wait_for(4, timeout=0.3)
    assert sorted(smtp_server.message_ids()) == sorted(r["message_id"] for r in rows(app))
    assert [(r["status"], r["attempts"]) for r in rows(app)] == [
        ("sent", 2), ("sent", 1), ("sent", 1)]


def test_startup_sweep_never_blocks_the_first_request(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 5)
    smtp_server.hold()
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_SCHEDULER=True, OUTBOX_SWEEP_MIN_AGE_SECONDS=0)

    @app.get("/ping")
    def ping() -> str:
        return "pong"

    with app.test_client() as client:
        # The first request starts this serving process's jobs (not init_app: a
        # process that only imports the app, such as a preloading master, runs none).
        assert client.get("/ping").get_data(as_text=True) == "pong"
        assert smtp_server.wait_held(1)  # the startup sweep is sending; the server holds it
        assert client.get("/ping").get_data(as_text=True) == "pong"
    assert smtp_server.held >= 1 and smtp_server.messages == []
    smtp_server.release()
    with app.app_context():
        report = mail.wait_sweep(30)
    assert report is not None and report.sent == 5
    assert smtp_server.wait_for(5)


def test_a_failing_sweep_is_reported_and_the_scheduler_survives(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with app.app_context():
        from flask_mail_outbox.core import metadata
        metadata.drop_all(db.engine)  # the database "has no outbox" any more
    scheduler = app.extensions["mail_outbox"].start_scheduler()
    assert scheduler.startup_done.wait(20)
    assert scheduler.startup_report is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR
              and "startup outbox sweep failed" in r.getMessage()]
    # Missing tables are one line (the sweep's), not also the start-up mode read's.
    assert not any("delivery mode at start-up" in r.getMessage() for r in caplog.records
                   if r.levelno >= logging.WARNING)
    assert len(errors) == 1 and "flask db upgrade outbox@head" in errors[0].getMessage()
    assert scheduler._scheduler is not None and scheduler._scheduler.running


def test_drain_failure_error_text_is_pinned(make_apps: MakeApps, smtp_server: FaultSMTPServer,
                                           caplog: pytest.LogCaptureFixture) -> None:
    # A server that closes at its greeting: the transport's fault, yet no pause (a
    # refused connection would pause the transport and say so instead).
    smtp_server.reply("connect", 421, "4.3.2 Service not available, closing channel")
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_INLINE_RETRIES=0, MAIL_TIMEOUT=2)
    caplog.set_level(logging.DEBUG, logger="flask_mail_outbox")
    with app.app_context():
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    ours = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")]
    assert not [r for r in ours if r.levelno == logging.WARNING]
    # Only this email's: a heartbeat of an earlier test's app, still finishing a send
    # after its stop timeout, may log here once its database is gone.
    [error] = [r for r in ours if r.levelno >= logging.ERROR
               and f"Email {email_id} " in r.getMessage()]
    text = error.getMessage()
    assert text.startswith(f"Email {email_id} could not be delivered after 1 attempt(s): ")
    assert text.endswith(
        ". Consequence: it stays queued (due again after its retry backoff, "
        "OUTBOX_RETRY_BASE_SECONDS doubling per attempt up to OUTBOX_RETRY_MAX_SECONDS, or in "
        "a few seconds with its attempt given back if the server was throttling); the "
        "periodic sweep (every OUTBOX_SWEEP_INTERVAL_SECONDS) or a durable dispatcher takes it "
        "when due, and it is dead-lettered if attempt 5 (OUTBOX_MAX_ATTEMPTS) fails too. "
        "Fix: check the transport's settings (MAIL_SERVER and MAIL_PORT for SMTP, the "
        "entry's API settings for a provider) and that it accepts mail; "
        "`flask outbox status` shows what waits.")


# -- the commands ---------------------------------------------------------------------------

def test_cli_sweep_dry_run_then_real(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 2)
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "sweep", "--min-age", "0", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "scanned           2" in result.output and "dry_run           True" in result.output
    assert not smtp_server.wait_for(1, timeout=0.5)
    result = runner.invoke(args=["outbox", "sweep", "--min-age", "0"])
    assert result.exit_code == 0, result.output
    assert "sent              2" in result.output
    assert smtp_server.wait_for(2)


def test_cli_sweep_exits_1_when_a_row_failed(make_apps: MakeApps,
                                             smtp_server: FaultSMTPServer) -> None:
    strand(make_apps, 1)
    smtp_server.reply("data", 550, "5.7.1 no")
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    result = app.test_cli_runner().invoke(args=["outbox", "sweep", "--min-age", "0"])
    assert result.exit_code == 1
    assert "failed            1" in result.output


def test_cli_status_dlq_and_purge(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    smtp_server.refuse_recipient("bad@example.com", 550)
    with app.app_context():
        good = mail.send(Message("good", recipients=["a@example.com"], body="x"))
        bad = mail.send(Message("bad", recipients=["bad@example.com"], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "status", "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert status["counts"] == {"queued": 0, "sending": 0, "sent": 1, "failed": 1,
                                "suppressed": 0, "expired": 0, "cancelled": 0}
    assert status["mode"] == "inline" and status["dead_letters"] == 1
    assert "oldest_queued_age_seconds" in status and "last_sweep" in status
    result = runner.invoke(args=["outbox", "status"])
    assert "failed" in result.output and "mode: inline" in result.output

    result = runner.invoke(args=["outbox", "dlq", "list"])
    assert result.exit_code == 0 and str(bad) in result.output and "550" in result.output
    result = runner.invoke(args=["outbox", "dlq", "retry", "999999"])
    assert result.exit_code == 1 and "not dead letters: 999999" in result.output
    result = runner.invoke(args=["outbox", "dlq", "retry"])
    assert result.exit_code == 2
    smtp_server.reset_faults()
    result = runner.invoke(args=["outbox", "dlq", "retry", str(bad)])
    assert result.exit_code == 0, result.output
    assert smtp_server.wait_for(2)
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]

    with app.app_context():  # make the first one old
        from flask_mail_outbox.core._clock import utcnow
        db.session.execute(email_table.update().where(email_table.c.id == good).values(
            sent_at=utcnow() - timedelta(days=40)))
        db.session.commit()
    result = runner.invoke(args=["outbox", "purge", "--older-than", "30", "--dry-run"])
    assert result.exit_code == 0 and "1 sent and 0 suppressed" in result.output
    result = runner.invoke(args=["outbox", "purge", "--older-than", "30"], input="n\n")
    assert result.exit_code == 1 and len(rows(app)) == 2
    result = runner.invoke(args=["outbox", "purge", "--older-than", "30", "--yes"])
    assert result.exit_code == 0 and "deleted 1 sent and 0 suppressed" in result.output
    assert [r["id"] for r in rows(app)] == [bad]


def test_cli_dlq_purge(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    smtp_server.reply("data", 554, "5.7.1 no")
    with app.app_context():
        for i in range(3):
            mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
            mail.send_message(subject="att", recipients=["a@example.com"], body="x",
                              attachments=None)
        db.session.commit()
        assert mail.wait_idle(20)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "dlq", "retry", "--all"])
    assert result.exit_code == 0 and "6 email(s) queued again" in result.output
    assert mail_wait(app)
    result = runner.invoke(args=["outbox", "dlq", "purge", "--yes"])
    assert result.exit_code == 0 and "deleted 6 dead letter(s)" in result.output
    assert rows(app) == []


def mail_wait(app: Flask) -> bool:
    with app.app_context():
        return bool(app.extensions["test_mail"].wait_idle(20))


def test_sweep_heals_a_key_left_without_a_head(make_apps: MakeApps,
                                               smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    with app.app_context():
        for i in range(2):
            mail.send(Message(f"k{i}", recipients=["a@example.com"], body="x"), key="k")
        # A promotion lost with its process: the head finished, nobody promoted.
        db.session.execute(email_table.update().where(email_table.c.subject == "k0").values(
            status="sent"))
        db.session.commit()
        report = mail.sweep(min_age=0)
    assert report.requeued == 1
    assert [(r["subject"], bool(r["key_head"])) for r in rows(app)] == [
        ("k0", True), ("k1", True)]


def test_an_inline_sweep_beside_a_hand_ticked_worker_delivers_in_the_sweeping_thread(
        hand_ticked_app: Flask, smtp_server: FaultSMTPServer) -> None:
    # The worker's loop runs nowhere (a test's, or `flask outbox worker --once`'s):
    # the sweep drains it in its own thread instead of waiting for a loop that never comes.
    mail = hand_ticked_app.extensions["test_mail"]
    with hand_ticked_app.app_context():
        mail.set_durable(False)
        mail.send(Message("left behind", recipients=["a@example.com"], body="x"))
        db.session.commit()
        started = time.monotonic()
        report = mail.sweep(min_age=0)
    assert (report.scanned, report.sent) == (1, 1)
    assert time.monotonic() - started < 30
    assert smtp_server.wait_for(1, timeout=1)
