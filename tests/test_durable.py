"""Durable mode: leased claims, retries, dead letters, key order, the toggle."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, poll, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import email_table


@pytest.fixture
def durable_app(db_url: str, smtp_server: FaultSMTPServer) -> Any:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RETRY_BASE_SECONDS=0.05,
                   OUTBOX_RETRY_MAX_SECONDS=0.2, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_POLL_MAX_INTERVAL=0.2)
    yield app
    close_app(app, timeout=5)


def test_durable_send_is_delivered_by_the_dispatcher(
        durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    with durable_app.app_context():
        assert mail.durable is True
        mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert smtp_server.wait_for(1)
        assert mail.wait_idle(10)
        runtime = durable_app.extensions["mail_outbox"].current_outbox()
        assert runtime.dispatcher is not None and runtime.worker.running
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
    [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent", timeout=20.0)
    assert row["attempts"] == 3
    assert [h["attempt"] for h in json.loads(row["error_history"])] == [1, 2]
    assert not smtp_server.wait_for(2, timeout=0.3)


def test_permanent_failure_dead_letters_and_retry_delivers(
        durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.reply("data", 554, "5.7.1 rejected", times=1)
    with durable_app.app_context():
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "failed", timeout=20.0)
        assert row["attempts"] == 1
        [dead] = mail.dead_letters()
        assert dead["id"] == email_id and dead["error_history"][0]["code"] == 554
        mail.retry(email_id)
        assert smtp_server.wait_for(1)
        [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent", timeout=20.0)
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
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=20.0)
        assert row["status"] == "failed" and row["attempts"] == 4
        assert len(json.loads(row["error_history"])) == 4
        assert smtp_server.data_attempts == 4
    finally:
        close_app(app)


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
    assert [r["status"] for r in wait_rows(durable_app, lambda r: r[1]["status"] == "sent",
                                           timeout=20.0)] == ["failed", "sent"]


def test_send_after_waits_until_due(durable_app: Flask, smtp_server: FaultSMTPServer) -> None:
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
            close_app(app)


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
        close_app(app)


@pytest.mark.parametrize("keys", [0, 3], ids=["keyless", "3 keys"])
def test_worker_once_delivers_what_is_due(db_url: str, smtp_server: FaultSMTPServer,
                                          keys: int) -> None:
    """With keys, each batch hands its keys on to their next emails: --once sends them all."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True, OUTBOX_BATCH_SIZE=7)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            for i in range(20):
                mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"),
                          key=f"k{i % keys}" if keys else None)
            db.session.commit()
        assert not smtp_server.wait_for(1, timeout=0.5)  # nobody runs a dispatcher yet
        result = app.test_cli_runner().invoke(args=["outbox", "worker", "--once"])
        assert result.exit_code == 0, result.output
        assert "20 email(s)" in result.output
        assert smtp_server.wait_for(20)
        assert [(r["status"], r["attempts"]) for r in rows(app)] == [("sent", 1)] * 20
        arrived = [int(m.parsed["Subject"][1:]) for m in smtp_server.messages]
        for k in range(keys):
            assert [i for i in arrived if i % keys == k] == list(range(k, 20, keys))
    finally:
        close_app(app)


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
    [row] = wait_rows(durable_app, lambda r: r[0]["status"] == "sent", timeout=20.0)
    assert row["attempts"] == 2


def test_commit_wakes_the_dispatcher_long_before_its_next_poll(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_POLL_INTERVAL=60, OUTBOX_POLL_MAX_INTERVAL=60,
                   OUTBOX_LISTEN=False)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        dispatcher = app.extensions["mail_outbox"].outbox().dispatch()
        poll(lambda: dispatcher.claims, timeout=10, interval=0.01)
        assert dispatcher.claims == 1  # ticked once at start; the next poll is 60 s away
        with app.app_context():
            mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
        assert smtp_server.wait_for(1, timeout=10)
    finally:
        close_app(app)


def test_outcome_of_a_lost_lease_is_not_recorded(db_url: str) -> None:
    from flask_mail_outbox.core import Status
    from flask_mail_outbox.core._leases import Outcome

    app = make_app(db_url, OUTBOX_TRANSPORT="null", OUTBOX_RUN_WORKER=False,
                   OUTBOX_DURABLE=True, OUTBOX_LISTEN=False)  # no process delivers
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"),
                                 send_after=timedelta(hours=1))
            db.session.execute(email_table.update().values(due_at=email_table.c.created_at))
            db.session.commit()
        store = app.extensions["mail_outbox"].outbox().store
        [first] = store.leases.claim_ids([email_id], owner="A", lease_seconds=1)
        with app.app_context():  # A's lease runs out while A is still sending
            db.session.execute(email_table.update().values(
                lease_expires_at=email_table.c.created_at))
            db.session.commit()
        assert len(store.leases.reap_expired()) == 1
        [second] = store.leases.claim_ids([email_id], owner="B", lease_seconds=60)
        recorded, lost, _ = store.leases.record([Outcome(first, Status.FAILED, error_code=550,
                                               error_message="late news from A")])
        assert recorded == [] and len(lost) == 1
        [row] = rows(app)
        assert row["status"] == "sending" and row["lease_owner"] == "B"
        assert row["attempts"] == 2 and row["last_error"] is None
        recorded, lost, _ = store.leases.record([Outcome(second, Status.SENT)])
        assert len(recorded) == 1 and rows(app)[0]["status"] == "sent"
    finally:
        close_app(app)


def test_one_record_of_several_claims_pairs_each_row_with_its_own_claim(db_url: str) -> None:
    """Sent outcomes of several claims are recorded in one statement, each row
    guarded by the owner of ITS claim: a row whose lease another claim of the
    same record took is lost, even though that claim's owner is in the record."""
    from sqlalchemy import event as sa_event

    from flask_mail_outbox.core import Status
    from flask_mail_outbox.core._leases import Outcome

    app = make_app(db_url, OUTBOX_TRANSPORT="null", OUTBOX_RUN_WORKER=False,
                   OUTBOX_DURABLE=True, OUTBOX_LISTEN=False)  # no process delivers
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            x, y, z = (mail.send(Message(s, recipients=["a@example.com"], body="x"),
                                 send_after=timedelta(hours=1)) for s in "xyz")
            db.session.execute(email_table.update().values(due_at=email_table.c.created_at))
            db.session.commit()
        store = app.extensions["mail_outbox"].outbox().store
        [x_by_a] = store.leases.claim_ids([x], owner="A", lease_seconds=1)
        with app.app_context():  # A's lease on x runs out while A is still sending
            db.session.execute(email_table.update().where(email_table.c.id == x).values(
                lease_expires_at=email_table.c.created_at))
            db.session.commit()
        assert len(store.leases.reap_expired()) == 1
        by_b = {e.id: e for e in store.leases.claim_ids([x, y], owner="B", lease_seconds=60)}
        [z_by_c] = store.leases.claim_ids([z], owner="C", lease_seconds=60)
        updates: list[str] = []
        engine = store.engine

        def listener(_c: Any, _cur: Any, sql: str, *_: Any) -> None:
            if sql.lstrip().startswith("UPDATE"):
                updates.append(sql)

        sa_event.listen(engine, "before_cursor_execute", listener)
        try:
            recorded, lost, _ = store.leases.record([
                Outcome(x_by_a, Status.SENT), Outcome(by_b[y], Status.SENT),
                Outcome(z_by_c, Status.SENT)])
        finally:
            sa_event.remove(engine, "before_cursor_execute", listener)
        assert len(updates) == 1
        assert sorted(o.email.id for o in recorded) == [y, z]
        assert [o.email.id for o in lost] == [x]
        status = {r["id"]: (r["status"], r["lease_owner"]) for r in rows(app)}
        assert status == {x: ("sending", "B"), y: ("sent", None), z: ("sent", None)}
    finally:
        close_app(app)


def test_heartbeat_keeps_a_slow_send_from_being_sent_twice(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    common = dict(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                  OUTBOX_DURABLE=True, OUTBOX_LEASE_SECONDS=1, OUTBOX_POLL_INTERVAL=0.1,
                  OUTBOX_POLL_MAX_INTERVAL=0.2)
    sender = make_app(db_url, **common)
    rival = make_app(db_url, **common)  # a second dispatcher, reaping every 0.2 s
    try:
        rival.extensions["mail_outbox"].outbox().dispatch()
        smtp_server.hold()
        with sender.app_context():
            sender.extensions["test_mail"].send(
                Message("slow", recipients=["a@example.com"], body="x"))
            db.session.commit()
        assert smtp_server.wait_held(1)
        # For 3.5 leases no second DATA may start: without renewal the rival reaps
        # the row and sends it again while the first send is still held.
        assert not smtp_server.wait_until(lambda: smtp_server.data_attempts > 1, timeout=3.5)
        assert smtp_server.held == 1
        smtp_server.release()
        assert smtp_server.wait_for(1)
        [row] = wait_rows(sender, lambda r: r[0]["status"] == "sent", timeout=20.0)
        assert row["attempts"] == 1
        assert not smtp_server.wait_until(lambda: smtp_server.data_attempts > 1, timeout=0.5)
        assert len(smtp_server.messages) == 1
    finally:
        for app in (sender, rival):
            close_app(app)


def test_only_the_head_of_a_key_is_ever_in_flight(durable_app: Flask,
                                                 smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = durable_app.extensions["test_mail"]
    smtp_server.hold()
    with durable_app.app_context():
        for i in range(3):
            mail.send(Message(f"k{i}", recipients=["a@example.com"], body="x"), key="user:7")
        db.session.commit()
    assert smtp_server.wait_held(1)
    # Many poll intervals: nothing else of the key may start meanwhile.
    assert not smtp_server.wait_held(2, timeout=0.5)
    assert smtp_server.held == 1
    assert [r["status"] for r in rows(durable_app)] == ["sending", "queued", "queued"]
    smtp_server.release()
    assert smtp_server.wait_for(3)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["k0", "k1", "k2"]


def test_sqlite_write_transactions_wait_for_the_lock(tmp_path: Any) -> None:
    """A store write waits for another writer's lock instead of failing.

    retry() reads then writes in one transaction started with BEGIN
    IMMEDIATE, so it queues behind the other writer (busy timeout) and then
    reads fresh data; it never answers "database is locked".
    """
    import sqlite3
    import threading

    db_url = f"sqlite:///{tmp_path / 'lock.db'}"
    app = make_app(db_url, OUTBOX_TRANSPORT="null", OUTBOX_RUN_WORKER=False)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.execute(email_table.update().values(status="failed"))
            db.session.commit()
        path = db_url.removeprefix("sqlite:///")
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        other.execute("UPDATE outbox_setting SET value = value")
        other.execute("INSERT INTO outbox_setting VALUES ('x', '1', '2026-01-01')")

        def commit_later() -> None:
            time.sleep(0.5)
            other.execute("COMMIT")

        committer = threading.Thread(target=commit_later)
        committer.start()
        store = app.extensions["mail_outbox"].outbox().store
        assert store.admin.retry_failed(email_id) is True  # waited for the lock, no SQLITE_BUSY
        committer.join()
        other.close()
        assert rows(app)[0]["status"] == "queued"
    finally:
        close_app(app)


def test_inline_follower_waits_for_its_heads_retry_not_for_the_sweep(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 try later", times=1)
    mail.send(Message("head", recipients=["a@example.com"], body="x"), key="k")
    mail.send(Message("follower", recipients=["a@example.com"], body="x"), key="k")
    db.session.commit()
    assert smtp_server.wait_for(2, timeout=15)
    assert mail.wait_idle(10)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["head", "follower"]


@contextlib.contextmanager
def listened_web_app(pg_database: str | None) -> Iterator[tuple[Flask, Any]]:
    """A durable app that runs no worker, and a connection LISTENing on the outbox's channel."""
    from conftest import require_postgres

    require_postgres()
    import psycopg

    from flask_mail_outbox.core._listen import CHANNEL, libpq_url

    assert pg_database is not None
    app = make_app(pg_database, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                   OUTBOX_TRANSPORT="null")
    try:
        with psycopg.connect(libpq_url(pg_database), autocommit=True) as listener:
            listener.execute(f"LISTEN {CHANNEL}")
            yield app, listener
    finally:
        close_app(app)


def test_notify_survives_a_rolled_back_savepoint(pg_database: str | None) -> None:
    with listened_web_app(pg_database) as (app, listener):
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            nested = db.session.begin_nested()
            mail.send(Message("gone", recipients=["a@example.com"], body="x"))
            nested.rollback()
            mail.send(Message("kept", recipients=["a@example.com"], body="x"))
            db.session.commit()
        received = list(listener.notifies(timeout=5, stop_after=1))
        assert len(received) == 1
        with app.app_context():
            mail.send(Message("rolled back", recipients=["a@example.com"], body="x"))
            db.session.rollback()
        assert list(listener.notifies(timeout=1, stop_after=1)) == []


@pytest.mark.parametrize("retry_all", [False, True])
def test_a_dead_letter_put_back_wakes_the_dispatchers_of_every_process(
        pg_database: str | None, retry_all: bool) -> None:
    """``retry()`` and ``retry_all()`` commit in the outbox's own transaction, with no commit
    of the caller to carry the NOTIFY: one goes out after them, so a worker in another process
    takes the row at once, not at its next poll (up to OUTBOX_POLL_MAX_INTERVAL)."""
    with listened_web_app(pg_database) as (app, listener):
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            email_id = mail.send(Message("dead", recipients=["a@example.com"], body="x"))
            db.session.commit()
            db.session.execute(sa.text("UPDATE outbox_email SET status = 'failed' WHERE id = :id"),
                               {"id": email_id})
            db.session.commit()
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1  # the send's
        with app.app_context():
            if retry_all:
                assert mail.retry_all() == 1
            else:
                mail.retry(email_id)
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
