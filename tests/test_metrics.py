"""Prometheus metrics: counters from real deliveries, gauges read at scrape time.

Each test registers on a private ``CollectorRegistry`` (except the one about
the default ``REGISTRY``) and delivers to the test SMTP server.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, query_plan, wait_rows
from flask import Flask, Response
from prometheus_client import CollectorRegistry, generate_latest
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import email_table

REPO = Path(__file__).resolve().parent.parent


def send(app: Flask, mail: OutboxMail, to: str, **options: Any) -> int:
    with app.app_context():
        email_id = mail.send(Message("metrics", recipients=[to], body="x"), **options)
        db.session.commit()
    return email_id


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def smtp_app(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> tuple[Flask, OutboxMail]:
    return make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)


def test_counters_and_latency_from_real_deliveries(
        smtp_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)
    for n in range(3):
        send(app, mail, f"user{n}@example.com")
    assert smtp_server.wait_for(3)
    wait_rows(app, lambda r: [x["status"] for x in r] == ["sent"] * 3, 20)
    smtp_server.refuse_recipient("bad@example.com", 550)
    send(app, mail, "bad@example.com")
    wait_rows(app, lambda r: r[-1]["status"] == "failed", 20)
    with app.app_context():
        assert mail.wait_idle(20)
    assert value(registry, "outbox_emails_queued_total") == 4
    assert value(registry, "outbox_emails_sent_total") == 3
    assert value(registry, "outbox_emails_failed_total") == 1
    assert value(registry, "outbox_email_delivery_seconds_count") == 3
    assert value(registry, "outbox_email_delivery_seconds_bucket", le="+Inf") == 3


def test_latency_covers_the_time_the_server_held_the_email(
        smtp_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)
    smtp_server.hold()
    send(app, mail, "a@example.com")
    assert smtp_server.wait_held(1)
    time.sleep(0.5)  # deliberate window: the server keeps the email for at least this long
    smtp_server.release()
    assert smtp_server.wait_for(1)
    wait_rows(app, lambda r: r[0]["status"] == "sent", 20)
    assert value(registry, "outbox_email_delivery_seconds_count") == 1
    # Measured from created_at, before the hold, to the signal after the release: the
    # held window is in it, so the observation lies above the 0.25 s bucket.
    assert value(registry, "outbox_email_delivery_seconds_bucket", le="0.25") == 0
    assert value(registry, "outbox_email_delivery_seconds_bucket", le="+Inf") == 1


def test_gauges_are_read_from_the_database_at_scrape_time(
        smtp_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer, backend: str) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry(auto_describe=True)  # as the default REGISTRY
    engine = app.extensions["mail_outbox"].outbox().store.engine
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM outbox_rate" not in statement:  # the paused transports: a row per transport
            statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    mail.init_metrics(registry, app=app)
    assert statements == []  # registering queries nothing; scraping does
    assert value(registry, "outbox_database_up") == 1
    assert len(statements) == 1  # one statement per scrape
    sa.event.remove(engine, "before_cursor_execute", count)
    assert value(registry, "outbox_queue_depth", status="queued") == 0
    assert value(registry, "outbox_oldest_queued_age_seconds") == 0
    assert value(registry, "outbox_oldest_due_age_seconds") == 0
    later = [send(app, mail, f"later{n}@example.com", send_after=timedelta(hours=1))
             for n in range(2)]
    with app.app_context(), db.engine.begin() as conn:
        t = email_table
        created = conn.execute(sa.select(t.c.created_at).where(t.c.id == later[0])).scalar_one()
        conn.execute(t.update().where(t.c.id == later[0]).values(
            created_at=created - timedelta(seconds=400)))
        conn.execute(t.update().where(t.c.id == later[1]).values(status="sending"))
    smtp_server.refuse_recipient("bad@example.com", 550)
    send(app, mail, "bad@example.com")
    wait_rows(app, lambda r: r[-1]["status"] == "failed", 20)
    assert value(registry, "outbox_queue_depth", status="queued") == 1
    assert value(registry, "outbox_queue_depth", status="sending") == 1
    assert value(registry, "outbox_dead_letters") == 1
    age = value(registry, "outbox_oldest_queued_age_seconds")
    assert age is not None and 400 <= age < 400 + 120
    # Created 400 s ago but due in an hour: queued that long, not late (as health says).
    assert value(registry, "outbox_oldest_due_age_seconds") == 0
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(t.update().where(t.c.id == later[0]).values(
            due_at=created - timedelta(seconds=300)))
    due = value(registry, "outbox_oldest_due_age_seconds")
    assert due is not None and 300 <= due < 300 + 120

    # One statement per scrape, whatever else the registry holds.
    statements.clear()
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        text = generate_latest(registry).decode()
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 1, statements
    assert 'outbox_queue_depth{status="queued"} 1.0' in text
    assert "# TYPE outbox_emails_sent_total counter" in text


def test_a_scrape_survives_an_unreadable_database(
        smtp_app: tuple[Flask, OutboxMail], caplog: pytest.LogCaptureFixture) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_email RENAME TO outbox_email_away"))
    try:
        with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
            text = generate_latest(registry).decode()  # the app's /metrics still answers
            generate_latest(registry)
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox_email_away RENAME TO outbox_email"))
    assert "outbox_database_up 0.0" in text
    assert "outbox_queue_depth{" not in text and "outbox_emails_sent_total 0.0" in text
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "metrics scrape could not query" in errors[0].getMessage()
    assert value(registry, "outbox_database_up") == 1


def test_registering_twice_and_a_second_app_on_one_registry(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    first, first_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    second, second_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    registry = CollectorRegistry()
    first_mail.init_metrics(registry, app=first)
    with first.app_context():
        first_mail.init_metrics(registry)  # again: no duplicate timeseries error
    second_mail.init_metrics(registry, app=second)
    send(first, first_mail, "a@example.com")
    send(second, second_mail, "b@example.com")
    assert smtp_server.wait_for(2)
    wait_rows(first, lambda r: [x["status"] for x in r] == ["sent", "sent"], 20)
    with first.app_context():
        assert first_mail.wait_idle(20)
    with second.app_context():
        assert second_mail.wait_idle(20)
    # Each email counted once: the first app's signals are connected once.
    assert value(registry, "outbox_emails_sent_total") == 2
    assert value(registry, "outbox_emails_queued_total") == 2


def test_exposed_through_the_apps_own_metrics_route(
        smtp_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), mimetype=prometheus_client.CONTENT_TYPE_LATEST)

    send(app, mail, "a@example.com")
    assert smtp_server.wait_for(1)
    wait_rows(app, lambda r: r[0]["status"] == "sent", 20)
    with app.app_context():
        assert mail.wait_idle(20)
    body = app.test_client().get("/metrics").get_data(as_text=True)
    assert "outbox_emails_sent_total 1.0" in body
    assert "outbox_database_up 1.0" in body


def test_a_gauge_name_taken_already_is_refused(smtp_app: tuple[Flask, OutboxMail]) -> None:
    app, mail = smtp_app
    registry = CollectorRegistry()
    prometheus_client.Gauge("outbox_dead_letters", "the app's own", registry=registry)
    with pytest.raises(ValueError, match="outbox_dead_letters"):
        mail.init_metrics(registry, app=app)


def test_default_registry(smtp_app: tuple[Flask, OutboxMail]) -> None:
    app, mail = smtp_app
    with app.app_context():
        mail.init_metrics()
        mail.init_metrics()
    assert prometheus_client.REGISTRY.get_sample_value("outbox_database_up") == 1


def test_init_metrics_outside_the_app_needs_init_app(smtp_app: tuple[Flask, OutboxMail]) -> None:
    app, _ = smtp_app
    with pytest.raises(RuntimeError, match="init_app"):
        OutboxMail().init_metrics(CollectorRegistry(), app=app)


def test_missing_prometheus_client_names_the_extra() -> None:
    # A real interpreter in which prometheus_client cannot be imported.
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "try:\n    import flask_mail_outbox._operator.metrics\n"
            "except ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'flask-mail-outbox[metrics]'" in proc.stdout


def test_the_scrape_reads_indexes_only(smtp_app: tuple[Flask, OutboxMail], backend: str) -> None:
    app, mail = smtp_app
    store = app.extensions["mail_outbox"].outbox().store
    registry = CollectorRegistry()
    mail.init_metrics(registry, app=app)
    executed: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM outbox_rate" not in statement:  # the paused transports: a row per transport
            executed.append((statement, parameters))

    value(registry, "outbox_database_up")  # connects (pragmas are not the scrape's statement)
    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        assert value(registry, "outbox_database_up") == 1
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    # The plan of the statement as the scrape ran it, with its bound parameters.
    ((statement, parameters),) = executed
    plan = query_plan(store.engine, statement, parameters)
    # Five subqueries, each on an index of the outbox; no read of the whole table.
    assert len(re.findall(r"(?:INDEX|using) ix_outbox_email", plan)) == 5, plan
    assert not re.search(r"SCAN outbox_email(?! USING)", plan) and "Seq Scan" not in plan, plan
