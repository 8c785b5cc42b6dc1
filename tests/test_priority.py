"""Priorities: ``mail.send(msg, priority="high" | "normal" | "low")``.

Among due rows the claim takes higher priority first (then oldest due first);
within a key the order stays ``send()`` order whatever the priority; an inline
worker hands a high email to the server before the ones already waiting.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core import email_table


def _send(app: Flask, subject: str, priority: str | None = None, **options: Any) -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        kwargs: dict[str, Any] = {} if priority is None else {"priority": priority}
        email_id = mail.send(Message(subject, recipients=["a@example.com"], body="x"),
                             **kwargs, **options)
        db.session.commit()
    return int(email_id)


def _subjects(claimed: Any, app: Flask) -> list[str]:
    subject = {r["id"]: r["subject"] for r in rows(app)}
    return [subject[e.id] for e in claimed]


def test_the_claim_takes_high_then_normal_then_low_each_in_send_order(
        hand_ticked_app: Flask) -> None:
    app = hand_ticked_app
    for subject, priority in [("low 1", "low"), ("normal 1", None), ("low 2", "low"),
                              ("high 1", "high"), ("normal 2", "normal"), ("high 2", "high")]:
        _send(app, subject, priority)
    assert {r["subject"]: r["priority"] for r in rows(app)} == {
        "low 1": 2, "normal 1": 1, "low 2": 2, "high 1": 0, "normal 2": 1, "high 2": 0}
    store = app.extensions["mail_outbox"].outbox().store
    first, _ = store.leases.claim_due(3, owner="a", lease_seconds=60)
    second, _ = store.leases.claim_due(3, owner="b", lease_seconds=60)
    # Each claim takes the rows first in (priority, due_at, id) order, and
    # returns them in that order: the order they are sent in.
    assert _subjects(first, app) == ["high 1", "high 2", "normal 1"]
    assert _subjects(second, app) == ["normal 2", "low 1", "low 2"]


def test_within_a_key_send_order_wins_over_priority(
        hand_ticked_app: Flask, smtp_server: FaultSMTPServer) -> None:
    app = hand_ticked_app
    _send(app, "k first, low", "low", key="k")
    _send(app, "k second, high", "high", key="k")
    _send(app, "keyless normal")
    worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
    worker.drain(timeout=30)
    assert [r["status"] for r in rows(app)] == ["sent"] * 3
    received = [m.parsed["Subject"] for m in smtp_server.messages]
    assert received.index("k first, low") < received.index("k second, high")


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "inline"])
def test_a_high_email_passes_a_queued_backlog_within_two_batches(
        make_apps: MakeApps, smtp_server: FaultSMTPServer, durable: bool) -> None:
    """Order of events: 300 low emails are being delivered (20 per batch, the
    server taking 10 ms each on 2 connections) when one high email commits; the
    server receives it among the first two batches that start after it."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=durable, OUTBOX_BATCH_SIZE=20,
                          OUTBOX_CONCURRENCY=2, OUTBOX_POLL_INTERVAL=0.05)
    smtp_server.delay("data", 0.01)
    with app.app_context():
        for i in range(300):
            mail.send(Message(f"low {i}", recipients=["a@example.com"], body="x"),
                      priority="low")
        db.session.commit()
    assert smtp_server.wait_for(30, timeout=30)
    before = len(smtp_server.messages)
    _send(app, "high", "high")
    assert smtp_server.wait_until(
        lambda: "high" in [m.parsed["Subject"] for m in smtp_server.messages], timeout=30)
    position = [m.parsed["Subject"] for m in smtp_server.messages].index("high")
    # What was claimed before the high one committed (at most a batch in
    # flight) goes first, then the high one: well inside two batches.
    assert position - before < 2 * 20, (before, position)
    assert len(smtp_server.messages) < 300  # it did not wait for the backlog


@pytest.mark.parametrize("bad", ["urgent", "", 1, None, "HIGH "])
def test_a_bad_priority_is_refused_naming_the_field_and_writes_nothing(
        make_apps: MakeApps, bad: Any) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(Message("x", recipients=["a@example.com"], body="x"), priority=bad)
        assert excinfo.value.field == "priority"
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send_many([Message("x", recipients=["a@example.com"], body="x")],
                           priority=bad)
        assert excinfo.value.field == "priority"
        db.session.commit()
        assert db.session.execute(sa.select(sa.func.count()).select_from(email_table)
                                  ).scalar() == 0


def test_send_many_stores_the_priority_of_every_row(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null", OUTBOX_RUN_WORKER=False)
    with app.app_context():
        mail.send_many([Message(f"m{i}", recipients=["a@example.com"], body="x")
                        for i in range(3)], priority="high")
        mail.send(Message("default", recipients=["a@example.com"], body="x"))
        db.session.commit()
    assert sorted(r["priority"] for r in rows(app)) == [0, 0, 0, 1]


def test_a_high_email_goes_first_only_once_it_is_due_on_a_fake_clock(tmp_path: Any) -> None:
    """Priority orders due rows; it never makes a row due early (SQLite: the store's clock)."""
    from datetime import timedelta

    from conftest import close_app, make_app

    from flask_mail_outbox.core._clock import utcnow

    app = make_app(f"sqlite:///{tmp_path / 'clock.db'}", OUTBOX_DURABLE=True,
                   OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    try:
        start = utcnow()
        _send(app, "high later", "high", send_after=timedelta(minutes=10))
        _send(app, "low 1", "low")
        _send(app, "normal later", None, send_after=timedelta(minutes=5))
        _send(app, "low 2", "low")
        store = app.extensions["mail_outbox"].outbox().store
        now = start + timedelta(minutes=1)
        store.clock = lambda: now
        first, _ = store.leases.claim_due(1, owner="a", lease_seconds=3600)
        assert _subjects(first, app) == ["low 1"]  # the high one is not due yet
        now = start + timedelta(minutes=6)
        second, _ = store.leases.claim_due(1, owner="b", lease_seconds=3600)
        assert _subjects(second, app) == ["normal later"]  # due now, and above low 2
        now = start + timedelta(minutes=11)
        third, _ = store.leases.claim_due(2, owner="c", lease_seconds=3600)
        assert sorted(_subjects(third, app)) == ["high later", "low 2"]
        assert store.leases.claim_due(1, owner="d", lease_seconds=3600)[0] == []
        # Given back, both due: a claim of one row takes the high one over the older low.
        store.leases.release(third)
        [again], _ = store.leases.claim_due(1, owner="e", lease_seconds=3600)
        assert _subjects([again], app) == ["high later"]
    finally:
        close_app(app, timeout=5)


FIVE = [("low 1", "low"), ("normal 1", "normal"), ("high 1", "high"), ("low 2", "low"),
        ("high 2", "high")]


def test_one_claim_sends_high_then_normal_then_low_each_in_send_order(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """Five emails drained by one claim of `worker --once --concurrency 1` go out by
    priority, not in send order (the claim, up to OUTBOX_BATCH_SIZE, takes all five;
    it used to hand them to the connection by id)."""
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    for subject, priority in FIVE:
        _send(app, subject, priority)
    result = app.test_cli_runner().invoke(
        args=["outbox", "worker", "--once", "--concurrency", "1"])
    assert result.exit_code == 0, result.output
    assert [m.parsed["Subject"] for m in smtp_server.messages] == [
        "high 1", "high 2", "normal 1", "low 1", "low 2"]


def test_one_commits_hand_over_sends_high_then_normal_then_low(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """Inline mode: one commit's low, high and normal go out high, normal, low."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_CONCURRENCY=1)
    with app.app_context():
        for subject, priority in [("low", "low"), ("high", "high"), ("normal", "normal")]:
            mail.send(Message(subject, recipients=["a@example.com"], body="x"),
                      priority=priority)
        db.session.commit()
    assert smtp_server.wait_for(3, timeout=30)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["high", "normal", "low"]


def test_per_key_order_still_wins_within_one_claim(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """A key's later high email waits for its earlier low one, even in one drain."""
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    _send(app, "k low", "low", key="k")
    _send(app, "free normal", "normal")
    _send(app, "k high", "high", key="k")
    _send(app, "free high", "high")
    result = app.test_cli_runner().invoke(
        args=["outbox", "worker", "--once", "--concurrency", "1"])
    assert result.exit_code == 0, result.output
    received = [m.parsed["Subject"] for m in smtp_server.messages]
    assert received.index("k low") < received.index("k high")
    assert received[:3] == ["free high", "free normal", "k low"]
