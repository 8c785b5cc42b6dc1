"""A transport-wide fault pauses the transport, not the emails (issue 40 item 4).

Real parts: the app's worker, the resend transport against tests/provider_resend.py
(whose key is revoked, then restored), SMTP against tests/smtpserver.py (refusing
AUTH, or a closed port), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, free_port, rows, wait_rows
from flask import Flask
from provider_resend import API_KEY, FakeResend
from smtpserver import FaultSMTPServer
from sqlalchemy.orm import Session

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox.core import (
    Outbox,
    Producer,
    TestClock,
    load_config,
    metadata,
    prepare_row,
)
from flask_mail_outbox.core._models import email_table, rate_table
from flask_mail_outbox.transports import MemoryTransport

PAUSED_ERROR = "is paused since"


@pytest.fixture
def fake() -> Iterator[FakeResend]:
    server = FakeResend()
    server.start()
    yield server
    server.stop()


def _entry(fake: FakeResend, **extra: Any) -> dict[str, Any]:
    return {"transport": "resend", "base_url": fake.url, "api_key": API_KEY, **extra}


def _send(app: Flask, count: int, subject: str = "hello") -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [int(mail.send(Message(f"{subject} {i}", recipients=[f"to{i}@example.com"],
                                     body="text"))) for i in range(count)]
        db.session.commit()
    return ids


def _durable(make_apps: MakeApps, fake: FakeResend, **config: Any) -> tuple[Flask, OutboxMail]:
    settings: dict[str, Any] = {
        "OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False, "OUTBOX_POLL_INTERVAL": 0.05,
        "OUTBOX_POLL_MAX_INTERVAL": 0.2, "OUTBOX_INLINE_RETRIES": 0,
        "OUTBOX_RETRY_BASE_SECONDS": 0.2, "OUTBOX_MAX_ATTEMPTS": 2,
        "OUTBOX_PAUSE_PROBE_SECONDS": 0.5, "OUTBOX_PAUSE_PROBE_MAX_SECONDS": 1.0,
        "OUTBOX_TRANSPORTS": {"default": _entry(fake)}}
    settings.update(config)
    return make_apps(**settings)


def _pause_row(app: Flask, name: str = "default") -> Any:
    with app.app_context(), db.engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT paused_kind, paused_error, paused_since, probe_at, probe_delay "
            "FROM outbox_rate WHERE name = :name"), {"name": name}).first()


def _waiting(app: Flask) -> bool:
    """Every email waits with its attempts kept (queued, attempts 0), but one probe, which
    may be out (sending, its attempt taken for it)."""
    current = rows(app)
    out = [r for r in current if r["status"] == "sending"]
    return len(out) <= 1 and all(r["status"] == "queued" and r["attempts"] == 0
                                 for r in current if r not in out)


def _errors(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and text in r.getMessage()]


def test_a_revoked_key_pauses_the_transport_and_nothing_is_dead_lettered(
        make_apps: MakeApps, fake: FakeResend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fake.api_key = "re_rotated_elsewhere"  # ours is refused: 403 invalid_api_key
    app, mail = _durable(make_apps, fake)
    _send(app, 5)
    paused = wait_rows(app, lambda rs: len(rs) == 5 and all(r["last_error"] for r in rs)
                       and _pause_row(app) is not None, timeout=10)
    assert all(r["status"] == "queued" and r["attempts"] == 0 for r in paused), paused
    row = _pause_row(app)
    assert row is not None and row.paused_kind == "credentials", row
    assert "403" in row.paused_error
    # Paused: only probes reach the API, one at a time, at a growing delay.
    before = len(fake.sending())
    time.sleep(2.5)
    probes = len(fake.sending()) - before
    assert 1 <= probes <= 4, probes
    assert _waiting(app), rows(app)
    # The key is good again: the next probe gets through and everything goes at once.
    fake.api_key = API_KEY
    sent = wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert len(sent) == 5 and all(r["attempts"] == 1 for r in sent), sent
    accepted = [a.json["headers"]["Message-ID"] for a in fake.accepted]
    assert sorted(accepted) == sorted(r["message_id"] for r in sent)
    assert _pause_row(app).paused_kind is None
    errors = _errors(caplog, PAUSED_ERROR)
    assert len(errors) == 1, errors
    assert "wait without spending attempts" in errors[0] and "5 days" in errors[0]
    assert not _errors(caplog, "dead-lettered")
    assert any("is back" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    mail.stop()


def test_a_process_started_while_the_transport_is_paused_probes_and_resumes_it(
        make_apps: MakeApps, fake: FakeResend, caplog: pytest.LogCaptureFixture) -> None:
    fake.api_key = "re_rotated_elsewhere"
    first, first_mail = _durable(make_apps, fake)
    _send(first, 3)
    wait_rows(first, lambda rs: _pause_row(first) is not None
              and _pause_row(first).paused_kind == "credentials", timeout=10)
    first_mail.stop()  # the only process that knew of the pause
    fake.api_key = API_KEY  # fixed, and a new process starts
    second, second_mail = _durable(make_apps, fake)
    second.extensions["mail_outbox"].outbox().dispatch()
    sent = wait_rows(second, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert len(sent) == 3 and all(r["attempts"] == 1 for r in sent)
    assert _pause_row(second).paused_kind is None  # its probe resumed the transport
    second_mail.stop()


# -- the probe's exact sequence, on a test clock ----------------------------------------


def _clocked(db_url: str, **config: Any) -> tuple[Any, Any, Any, Any]:
    """An outbox on a TestClock with a memory transport, its hand-ticked dispatcher."""
    settings = {"MAIL_DEFAULT_SENDER": "shop@example.com", "OUTBOX_DURABLE": True,
                "OUTBOX_LISTEN": False, "OUTBOX_MAX_ATTEMPTS": 2,
                "OUTBOX_PAUSE_PROBE_SECONDS": 30, "OUTBOX_PAUSE_PROBE_MAX_SECONDS": 120,
                **config}
    clock = TestClock()
    transport = MemoryTransport()
    outbox = Outbox(db_url, load_config(settings, instance_path="/x", testing=False),
                    transports={"default": transport}, clock=clock)
    metadata.create_all(outbox.engine)
    return outbox, clock, transport, outbox.dispatch(hand_ticked=True)


def _enqueue(outbox: Any, count: int, *, due_at: Any = None, **row: Any) -> None:
    producer = Producer(outbox)
    rows_ = [prepare_row(Message(f"n{i}", recipients=[f"r{i}@example.com"], body="hi"),
                         outbox.config, key=None, due_at=due_at, now=outbox.store.clock(),
                         **row)
             for i in range(count)]
    with Session(outbox.engine) as session, session.begin():
        producer.enqueue(session, rows_)


def _state(outbox: Any) -> tuple[Any, list[tuple[str, int]]]:
    """The pause's columns of the default transport, and each email's (status, attempts)."""
    r, e = rate_table, email_table
    with outbox.engine.connect() as conn:
        pause = conn.execute(sa.select(r.c.paused_kind, r.c.paused_since, r.c.probe_at,
                                       r.c.probe_delay).where(r.c.name == "default")).first()
        emails = [(row.status, row.attempts) for row in conn.execute(
            sa.select(e.c.status, e.c.attempts).order_by(e.c.id))]
    return pause, emails


def test_the_probe_sequence_on_a_test_clock(db_url: str) -> None:
    outbox, clock, transport, worker = _clocked(db_url)
    try:
        _enqueue(outbox, 3)
        # The 3 claimed sends meet the fault, then 3 probes are refused, the 4th gets through.
        transport.fail_next(6, kind="account")
        worker.tick()
        pause, emails = _state(outbox)
        assert emails == [("queued", 0)] * 3
        assert (pause.paused_kind, pause.probe_delay) == ("credentials", 30)
        since = pause.paused_since
        assert abs((pause.probe_at - since).total_seconds() - 30) < 0.5
        # Each probe at its time, not before; its refusal doubles the delay (capped at 120).
        at = since
        for delay, next_delay in ((30, 60), (60, 120), (120, 120)):
            clock.advance(delay - 1)
            worker.tick()
            assert transport.failures.pending() == 6 - 3 - [30, 60, 120].index(delay), delay
            clock.advance(1)
            worker.tick()
            assert transport.failures.pending() == 6 - 4 - [30, 60, 120].index(delay), delay
            pause, emails = _state(outbox)
            assert pause.probe_delay == next_delay
            at += timedelta(seconds=delay)
            assert abs((pause.probe_at - (at + timedelta(seconds=next_delay))).total_seconds()) \
                < 1, (pause.probe_at, at)
            assert emails == [("queued", 0)] * 3
        # The 4th probe goes: the transport resumes, and the others go at once.
        clock.advance(119)
        worker.tick()
        assert transport.outbox == []
        clock.advance(1)
        worker.tick()
        worker.tick()
        pause, emails = _state(outbox)
        assert pause.paused_kind is None and pause.probe_at is None
        assert emails == [("sent", 1)] * 3
        assert len(transport.outbox) == 3
    finally:
        outbox.stop(5)


def test_an_email_waits_at_most_the_queue_lifetime_then_fails_with_the_fault(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    outbox, clock, transport, worker = _clocked(db_url, OUTBOX_MAX_QUEUE_LIFETIME_SECONDS=3600)
    try:
        _enqueue(outbox, 2)
        _enqueue(outbox, 1, expires_at=clock.now() + timedelta(minutes=20))
        transport.fail_next(100, kind="account")
        worker.tick()
        assert _state(outbox)[1] == [("queued", 0)] * 3
        for _ in range(12):  # probes every 30 s doubling to 2 min, for 20 minutes
            clock.advance(120)
            worker.tick()
            worker.tick()
        # Its own expires_after ended one: expired.
        assert _state(outbox)[1] == [("queued", 0), ("queued", 0), ("expired", 0)]
        for _ in range(20):  # past an hour in the queue
            clock.advance(120)
            worker.tick()
            worker.tick()
        pause, emails = _state(outbox)
        assert emails == [("failed", 0), ("failed", 0), ("expired", 0)]
        assert pause.paused_kind == "credentials"  # still down
        # One ERROR for the emails one probe ended, not one each (a big queue's flood).
        ended = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR
                 and "were not sent: each waited longer than" in r.getMessage()]
        assert len(ended) == 1 and ended[0].startswith("2 email(s) [1, 2] were not sent"), ended
        with outbox.engine.connect() as conn:
            errors = list(conn.execute(sa.select(email_table.c.last_error).where(
                email_table.c.status == "failed")).scalars())
        for error in errors:
            assert error.startswith("waited longer than OUTBOX_MAX_QUEUE_LIFETIME_SECONDS (1 h) "
                                    "while transport 'default' was paused ("), error
            assert "credentials" in error and "535" in error
        assert transport.outbox == []
    finally:
        outbox.stop(5)


def test_a_probe_with_no_email_to_send_looks_again_later_not_at_once(db_url: str) -> None:
    outbox, clock, transport, worker = _clocked(db_url)
    try:
        _enqueue(outbox, 1)
        transport.fail_next(1, kind="account")
        worker.tick()
        with outbox.engine.begin() as conn:  # nothing left to probe with
            conn.execute(email_table.delete())
        clock.advance(30)
        worker.tick()
        first, _ = _state(outbox)
        assert first.paused_kind == "credentials" and first.probe_delay == 30
        assert abs((first.probe_at - clock.now()).total_seconds() - 30) < 1
        for _ in range(5):  # no claim spins on it
            worker.tick()
        assert _state(outbox)[0].probe_at == first.probe_at
        assert 0 < worker.tick() <= 30
    finally:
        outbox.stop(5)


@pytest.mark.parametrize(("config", "key"), [
    ({"OUTBOX_PAUSE_PROBE_SECONDS": 0}, "OUTBOX_PAUSE_PROBE_SECONDS"),
    ({"OUTBOX_PAUSE_PROBE_SECONDS": "soon"}, "OUTBOX_PAUSE_PROBE_SECONDS"),
    ({"OUTBOX_PAUSE_PROBE_MAX_SECONDS": 10}, "OUTBOX_PAUSE_PROBE_MAX_SECONDS"),
    ({"OUTBOX_MAX_QUEUE_LIFETIME_SECONDS": -1}, "OUTBOX_MAX_QUEUE_LIFETIME_SECONDS"),
    ({"OUTBOX_MAX_QUEUE_LIFETIME_SECONDS": "5d"}, "OUTBOX_MAX_QUEUE_LIFETIME_SECONDS"),
])
def test_bad_pause_settings_are_a_config_error_naming_the_key(
        config: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(config, instance_path="/x", testing=True)
    assert raised.value.key == key


def test_pause_settings_defaults_and_none() -> None:
    config = load_config({}, instance_path="/x", testing=True)
    assert (config.pause_probe_seconds, config.pause_probe_max_seconds,
            config.max_queue_lifetime_seconds) == (30.0, 600.0, 5 * 86400.0)
    config = load_config({"OUTBOX_MAX_QUEUE_LIFETIME_SECONDS": None}, instance_path="/x",
                         testing=True)
    assert config.max_queue_lifetime_seconds is None


# -- SMTP: refused AUTH, a closed port; a failover --------------------------------------


def _smtp_app(make_apps: MakeApps, host: str, port: int, **config: Any) -> tuple[Flask, Any]:
    return make_apps(**{
        "OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False, "OUTBOX_POLL_INTERVAL": 0.05,
        "OUTBOX_POLL_MAX_INTERVAL": 0.2, "OUTBOX_INLINE_RETRIES": 0, "OUTBOX_MAX_ATTEMPTS": 2,
        "OUTBOX_RETRY_BASE_SECONDS": 0.2, "OUTBOX_PAUSE_PROBE_SECONDS": 0.5,
        "OUTBOX_PAUSE_PROBE_MAX_SECONDS": 1.0, "MAIL_SERVER": host, "MAIL_PORT": port,
        "MAIL_TIMEOUT": 2, **config})


def test_an_smtp_server_refusing_the_password_pauses_until_it_takes_it(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    smtp_server.require_auth("outbox", "the-new-password")
    app, mail = _smtp_app(make_apps, smtp_server.host, smtp_server.port,
                          MAIL_USERNAME="outbox", MAIL_PASSWORD="the-old-password")
    _send(app, 4)
    wait_rows(app, lambda rs: _pause_row(app) is not None
              and _pause_row(app).paused_kind == "credentials", timeout=10)
    time.sleep(2)
    assert _waiting(app), rows(app)
    assert "535" in _pause_row(app).paused_error
    assert smtp_server.messages == []
    smtp_server.require_auth("outbox", "the-old-password")  # the server takes it again
    sent = wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert sorted(smtp_server.message_ids()) == sorted(r["message_id"] for r in sent)
    assert all(r["attempts"] == 1 for r in sent)
    assert len(_errors(caplog, PAUSED_ERROR)) == 1
    assert "the-old-password" not in caplog.text
    mail.stop()


def test_a_closed_port_pauses_the_transport_as_unreachable(
        make_apps: MakeApps, caplog: pytest.LogCaptureFixture) -> None:
    app, mail = _smtp_app(make_apps, "127.0.0.1", free_port())
    _send(app, 3)
    wait_rows(app, lambda rs: _pause_row(app) is not None
              and _pause_row(app).paused_kind == "unreachable", timeout=10)
    time.sleep(2.5)  # probes at 0.5 s doubling to 1 s, each refused
    assert _waiting(app), rows(app)
    [error] = _errors(caplog, PAUSED_ERROR)
    assert "cannot be reached" in error and "MAIL_SERVER and MAIL_PORT" in error
    assert _pause_row(app).probe_delay == 1.0
    mail.stop()


def test_a_server_that_takes_the_connection_then_resets_it_does_not_pause(
        make_apps: MakeApps) -> None:
    """review2: a reset after the server accepted the connection is a server answering
    badly (an ordinary transient failure of the email), not an unreachable one."""
    import socket
    import struct
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def reset_each() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST, before any greeting

    thread = threading.Thread(target=reset_each, daemon=True)
    thread.start()
    try:
        app, mail = _smtp_app(make_apps, "127.0.0.1", listener.getsockname()[1])
        _send(app, 2)
        done = wait_rows(app, lambda rs: all(r["attempts"] >= 1 and r["status"] == "queued"
                                             for r in rs), timeout=10)
        assert len(done) == 2
        assert _pause_row(app) is None or _pause_row(app).paused_kind is None
        mail.stop()
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_failover_transport_takes_the_mail_while_the_primary_refuses_its_key(
        make_apps: MakeApps, fake: FakeResend, smtp_server: FaultSMTPServer) -> None:
    fake.api_key = "re_rotated_elsewhere"
    app, mail = _durable(make_apps, fake, OUTBOX_TRANSPORTS={
        "default": _entry(fake, failover=["backup"]),
        "backup": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                   "MAIL_PORT": smtp_server.port}})
    _send(app, 3)
    sent = wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert sorted(smtp_server.message_ids()) == sorted(r["message_id"] for r in sent)
    assert all(r["attempts"] == 1 for r in sent)
    assert fake.accepted == [] and _pause_row(app) is None
    mail.stop()


# -- what an operator sees -----------------------------------------------------------------


def test_status_health_metrics_and_the_dashboard_show_the_paused_transport(
        make_apps: MakeApps, fake: FakeResend) -> None:
    from prometheus_client import CollectorRegistry

    fake.api_key = "re_rotated_elsewhere"
    app, mail = _durable(make_apps, fake, OUTBOX_PAUSE_PROBE_SECONDS=60,
                         OUTBOX_PAUSE_PROBE_MAX_SECONDS=60)
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                           url_prefix="/outbox")
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)
    _send(app, 1)
    wait_rows(app, lambda rs: _pause_row(app) is not None, timeout=10)
    # The CLI in an app of its own (`flask outbox status` stops its app's worker).
    cli_app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_TRANSPORTS={"default": _entry(fake)})
    runner = cli_app.test_cli_runner()
    result = runner.invoke(args=["outbox", "status", "--json"])
    assert result.exit_code == 0, result.output
    [paused] = json.loads(result.output)["paused_transports"]
    assert (paused["transport"], paused["kind"]) == ("default", "credentials")
    assert paused["reason"] == "account"  # the failure reasons' vocabulary
    assert "invalid_api_key" in paused["error"] and paused["probe_delay_seconds"] == 60
    text = runner.invoke(args=["outbox", "status"]).output
    assert "paused transports:\n  default: credentials since " in text
    with app.app_context():
        health = mail.health()
    assert health["status"] == "degraded"
    [reason] = [r for r in health["reasons"] if r["code"] == "transport_paused"]
    assert "transport 'default' is paused since" in reason["message"]
    assert "invalid_api_key" in reason["message"]
    assert [p["transport"] for p in health["paused_transports"]] == ["default"]
    assert registry.get_sample_value("outbox_transport_paused",
                                     {"transport": "default", "kind": "credentials"}) == 1.0
    paused_for = registry.get_sample_value("outbox_transport_paused_seconds",
                                           {"transport": "default"})
    assert paused_for is not None and paused_for >= 0.0
    page = app.test_client().get("/outbox/").get_data(as_text=True)
    assert 'id="paused-default"' in page and "credentials since" in page
    # Back: every surface says so.
    fake.api_key = API_KEY
    earlier = {"now": datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=5)}
    with app.app_context(), db.engine.begin() as conn:  # the minute's wait, skipped
        conn.execute(sa.text("UPDATE outbox_rate SET probe_at = :now"), earlier)
        conn.execute(sa.text("UPDATE outbox_email SET due_at = :now"), earlier)
    wait_rows(app, lambda rs: rs[0]["status"] == "sent", timeout=10)
    assert json.loads(runner.invoke(args=["outbox", "status", "--json"]).output)[
        "paused_transports"] == []
    assert "paused transports: none" in runner.invoke(args=["outbox", "status"]).output
    with app.app_context():
        assert not [r for r in mail.health()["reasons"] if r["code"] == "transport_paused"]
    assert registry.get_sample_value("outbox_transport_paused",
                                     {"transport": "default", "kind": ""}) == 0.0
    assert 'id="paused-transports"' not in app.test_client().get("/outbox/").get_data(
        as_text=True)
    mail.stop()


def test_a_scheduled_emails_queue_lifetime_counts_from_when_it_may_go(db_url: str) -> None:
    """review2: a ``send_after`` email waited its lifetime from ``created_at``, so one
    scheduled further ahead than the lifetime failed at the first probe, never tried."""
    outbox, clock, transport, worker = _clocked(db_url, OUTBOX_MAX_QUEUE_LIFETIME_SECONDS=3600)
    try:
        _enqueue(outbox, 1, due_at=clock.now() + timedelta(hours=2))
        clock.advance(2 * 3600 + 1)  # due now, created two hours ago
        transport.fail_next(100, kind="account")
        worker.tick()
        worker.tick()
        for _ in range(10):  # 20 minutes of probes: well inside its hour
            clock.advance(120)
            worker.tick()
            worker.tick()
        assert _state(outbox)[1] == [("queued", 0)]
        for _ in range(25):  # past an hour since it was due
            clock.advance(120)
            worker.tick()
            worker.tick()
        assert _state(outbox)[1] == [("failed", 0)]
        assert transport.outbox == []
    finally:
        outbox.stop(5)


@pytest.mark.parametrize(("error", "unreachable"), [
    (ConnectionRefusedError(), True), (TimeoutError(), True), (OSError(113, "no route"), True),
    (ConnectionResetError(), False), (ConnectionAbortedError(), False),
    (BrokenPipeError(), False)])
def test_only_a_connection_never_made_counts_as_unreachable(error: OSError,
                                                           unreachable: bool) -> None:
    from flask_mail_outbox.transports._smtp import cannot_connect

    assert cannot_connect(error) is unreachable
