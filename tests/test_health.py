"""`mail.health()` and its route: each reason from real rows, a real dispatcher, a real outage.

Reasons: ``queue_too_old`` (an email due for longer than
OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS), ``dead_letters_growing``,
``dispatcher_tick_failed``, ``database_unreachable``. The route lists them all,
and answers 503 for ``database_unreachable`` only (an instance a load balancer
can route around), or for any reason on its strict variant. The check is one
SQL statement reading indexes only (counted with ``before_cursor_execute``, and
the plan of the statement as executed read).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, free_port, query_plan, wait_rows
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._operator.health import DeadLetterTrend
from flask_mail_outbox.core import email_table

HEALTH_FIELDS = {"status", "reasons", "oldest_due_age_seconds", "dead_letters",
                 "dead_letters_added", "paused_transports", "dispatcher", "checked_at"}


def send(app: Flask, mail: OutboxMail, to: str, **options: Any) -> int:
    with app.app_context():
        email_id = mail.send(Message("health", recipients=[to], body="x"), **options)
        db.session.commit()
    return email_id


def make_due(app: Flask, email_id: int, seconds_ago: float) -> None:
    """Make a queued row due ``seconds_ago`` (as a row nothing took would be)."""
    t = email_table
    with app.app_context(), db.engine.begin() as conn:
        now = conn.execute(sa.select(t.c.created_at).where(t.c.id == email_id)).scalar_one()
        conn.execute(t.update().where(t.c.id == email_id).values(
            created_at=now - timedelta(seconds=seconds_ago),
            due_at=now - timedelta(seconds=seconds_ago)))


def health(app: Flask, mail: OutboxMail) -> dict[str, Any]:
    with app.app_context():
        return mail.health()


def codes(result: dict[str, Any]) -> list[str]:
    return [reason["code"] for reason in result["reasons"]]


def add_health_routes(app: Flask, mail: OutboxMail) -> None:
    """``/healthz`` (the default) and ``/healthz/strict`` (503 on any reason), as the README says."""
    app.add_url_rule("/healthz", view_func=mail.health_view)
    app.add_url_rule("/healthz/strict", "healthz_strict", view_func=mail.health_view,
                     defaults={"strict": True})


def route_statuses(app: Flask, expected_codes: list[str]) -> tuple[int, int]:
    """(default, strict) status codes; both bodies list ``expected_codes``, neither is cached."""
    client = app.test_client()
    answers = [client.get("/healthz"), client.get("/healthz/strict")]
    for response in answers:
        assert codes(response.get_json()) == expected_codes
        assert response.get_json()["status"] == ("degraded" if expected_codes else "ok")
        assert response.headers["Cache-Control"] == "no-store"
    return answers[0].status_code, answers[1].status_code


@pytest.fixture
def smtp_app(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> tuple[Flask, OutboxMail]:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS=60)
    add_health_routes(app, mail)
    return app, mail


def test_ok_when_mail_flows(smtp_app: tuple[Flask, OutboxMail],
                            smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_app
    send(app, mail, "a@example.com")
    assert smtp_server.wait_for(1)
    result = health(app, mail)
    assert set(result) == HEALTH_FIELDS
    assert result["status"] == "ok" and result["reasons"] == []
    assert result["dead_letters"] == 0 and result["oldest_due_age_seconds"] is None
    response = app.test_client().get("/healthz")
    assert response.status_code == 200
    assert response.headers["Cache-Control"] == "no-store"
    assert response.get_json()["status"] == "ok"
    assert route_statuses(app, []) == (200, 200)


def test_queue_too_old(smtp_app: tuple[Flask, OutboxMail]) -> None:
    app, mail = smtp_app
    scheduled = send(app, mail, "later@example.com", send_after=timedelta(hours=2))
    # Queued long ago for later: not late before its time (inline mode leaves it alone).
    t = email_table
    with app.app_context(), db.engine.begin() as conn:
        created = conn.execute(sa.select(t.c.created_at).where(t.c.id == scheduled)).scalar_one()
        conn.execute(t.update().where(t.c.id == scheduled)
                     .values(created_at=created - timedelta(hours=1)))
    assert health(app, mail)["status"] == "ok"

    late = send(app, mail, "stuck@example.com", send_after=timedelta(hours=2))
    make_due(app, late, 30)  # due, younger than the limit (60 s)
    result = health(app, mail)
    assert result["status"] == "ok"
    assert 30 <= result["oldest_due_age_seconds"] < 60

    make_due(app, late, 90)
    result = health(app, mail)
    assert result["status"] == "degraded" and codes(result) == ["queue_too_old"]
    assert "OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS" in result["reasons"][0]["message"]
    assert 90 <= result["oldest_due_age_seconds"] < 90 + 60
    # A state of the shared database: every instance sees it, so the default route
    # stays 200 (a load balancer would drain them all); the strict one says 503.
    assert route_statuses(app, ["queue_too_old"]) == (200, 503)
    response = app.test_client().get("/healthz/strict")
    # No address, subject or setting leaks into what a load balancer sees.
    assert "example.com" not in response.get_data(as_text=True)


def test_dead_letters_growing(smtp_app: tuple[Flask, OutboxMail],
                              smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_app
    assert health(app, mail)["status"] == "ok"  # the baseline: no dead letters
    # 5.7.1, not the default 5.1.1: an unknown user would be suppressed after the first.
    smtp_server.refuse_recipient("bad@example.com", 550, "5.7.1 Relay access denied")
    bad = send(app, mail, "bad@example.com")
    wait_rows(app, lambda r: [x["status"] for x in r] == ["failed"], 20)
    result = health(app, mail)
    assert codes(result) == ["dead_letters_growing"]
    assert result["dead_letters"] == 1 and result["dead_letters_added"] == 1
    assert health(app, mail)["status"] == "degraded"  # still within the window
    assert route_statuses(app, ["dead_letters_growing"]) == (200, 503)
    # Dealt with: the dead letter is retried (and delivered); the count drops.
    smtp_server.reset_faults()
    with app.app_context():
        mail.retry(bad)
    assert smtp_server.wait_for(1)
    wait_rows(app, lambda r: [x["status"] for x in r] == ["sent"], 20)
    result = health(app, mail)
    assert result["status"] == "ok" and result["dead_letters"] == 0


def test_dead_letter_trend_window() -> None:
    now = [1000.0]
    trend = DeadLetterTrend(900, clock=lambda: now[0])
    assert trend.observe(5) == 0  # nothing to compare with yet
    now[0] += 10
    assert trend.observe(7) == 2
    now[0] += 800
    assert trend.observe(7) == 2  # the 5 seen 810 s ago is still in the window
    now[0] += 100
    assert trend.observe(7) == 0  # it left the window: no rise in the last 900 s
    now[0] += 1
    assert trend.observe(4) == 0  # purged or retried: a drop is not growth
    for _ in range(1000):
        now[0] += 1
        trend.observe(4)
    assert len(trend._seen) == 1  # a steady count keeps one entry, however often checked


def test_dispatcher_tick_failed(make_apps: MakeApps, smtp_server: FaultSMTPServer,
                                caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_LISTEN=False)
    add_health_routes(app, mail)
    state = app.extensions["mail_outbox"]
    dispatcher = state.outbox().dispatch(hand_ticked=True)

    def no_wait(_deadline: float) -> None:
        """Ticks by hand: no pause between them."""

    dispatcher.tick()
    assert health(app, mail)["status"] == "ok"
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_email RENAME TO outbox_email_away"))
    try:
        with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
            dispatcher.tick()
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox_email_away RENAME TO outbox_email"))
    assert dispatcher.last_claim_failed
    result = health(app, mail)
    assert codes(result) == ["dispatcher_tick_failed"]
    assert result["dispatcher"] == {"running": False, "last_tick_failed": True}
    # Not a reason to route requests elsewhere: the dispatcher runs beside them.
    assert route_statuses(app, ["dispatcher_tick_failed"]) == (200, 503)
    dispatcher.tick()
    assert health(app, mail)["status"] == "ok"


@pytest.fixture
def unreachable_app(backend: str, tmp_path: Path) -> Iterator[tuple[Flask, OutboxMail]]:
    """An app whose database does not answer (nothing listens / no such directory)."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'missing-dir' / 'app.db'}"
    else:
        url = f"postgresql+psycopg://outbox:s3cret-pw@127.0.0.1:{free_port()}/outbox"
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, OUTBOX_RUN_SCHEDULER=False,
                      MAIL_DEFAULT_SENDER="sender@example.com", MAIL_PASSWORD="s3cret-pw")
    if backend == "sqlite":
        # init_app switches SQLite to WAL, which needs the file: create it, then remove it.
        (tmp_path / "missing-dir").mkdir()
    mail = OutboxMail(app, db=SQLAlchemy(app))
    if backend == "sqlite":
        with app.app_context():
            app.extensions["sqlalchemy"].engine.dispose()
        for path in (tmp_path / "missing-dir").iterdir():
            path.unlink()
        (tmp_path / "missing-dir").rmdir()
    add_health_routes(app, mail)
    yield app, mail
    mail.stop()


def test_database_unreachable_is_a_reason_not_an_exception(
        unreachable_app: tuple[Flask, OutboxMail], caplog: pytest.LogCaptureFixture) -> None:
    app, mail = unreachable_app
    with caplog.at_level(logging.INFO, logger="flask_mail_outbox"):
        first = health(app, mail)
        response = app.test_client().get("/healthz")
    assert codes(first) == ["database_unreachable"]
    assert first["dead_letters"] is None and first["dead_letters_added"] is None
    assert first["oldest_due_age_seconds"] is None
    assert response.status_code == 503
    assert codes(response.get_json()) == ["database_unreachable"]
    # This instance's own trouble: 503 on both routes.
    with caplog.at_level(logging.INFO, logger="flask_mail_outbox"):
        assert route_statuses(app, ["database_unreachable"]) == (503, 503)
    # One ERROR for the ongoing outage, however often the route is polled.
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "health check could not query" in errors[0].getMessage()
    everything = json.dumps(first) + response.get_data(as_text=True) + caplog.text
    assert "s3cret-pw" not in everything


def test_one_indexed_statement_per_check(make_apps: MakeApps, backend: str) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    app.add_url_rule("/healthz", view_func=mail.health_view)
    state = app.extensions["mail_outbox"]
    engine = state.outbox().store.engine
    statements: list[str] = []
    executed: list[tuple[str, Any]] = []

    def count(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM outbox_rate" in statement:
            return  # the paused transports: a row per transport, whatever the queue holds
        statements.append(statement)
        executed.append((statement, parameters))

    health(app, mail)  # connects (pragmas and pre-ping are not the check's statements)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        for _ in range(5):
            health(app, mail)
        assert app.test_client().get("/healthz").status_code == 200
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(statements) == 6, statements  # one per check, the route's included
    assert all(s.lstrip().upper().startswith("SELECT") for s in statements)

    # The plan of the statement as it ran, with its bound parameters (a bound
    # status keeps SQLite off the partial indexes: literals would plan differently).
    statement, parameters = executed[-1]
    plan = query_plan(engine, statement, parameters)
    # Both subqueries read an index of the outbox (which one is the planner's choice);
    # neither reads the table through (SQLite "SCAN outbox_email" without an index,
    # PostgreSQL "Seq Scan").
    assert len(re.findall(r"(?:INDEX|using) ix_outbox_email", plan)) == 2, plan
    assert not re.search(r"SCAN outbox_email(?! USING)", plan) and "Seq Scan" not in plan, plan
