"""Shared rate limits: a transport's ``rate_limit`` held by every process on the database.

The schedule (``outbox_rate``) is checked slot by slot on a fake clock, then
end to end: emails counted at a real SMTP server with their arrival times,
one app and (``test_workers.py``) two worker processes sharing one limit. A
throttling reply halves the shared rate, which grows back additively.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core._rate import RECOVERY_SECONDS, SharedRate
from flask_mail_outbox.core import Rate


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _rate_row(app: Flask, name: str = "default") -> dict[str, Any]:
    with app.app_context(), db.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM outbox_rate WHERE name = :n"),
                           {"n": name}).mappings().one()
    return dict(row)


def test_slots_follow_one_schedule_and_a_throttle_halves_it_until_it_grows_back(
        tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'rate.db'}")
    try:
        store = app.extensions["mail_outbox"].outbox().store
        wall, mono = Clock(1_000_000.0), Clock(50.0)
        rate = SharedRate(store, "bulk", Rate(10, 1.0), clock=mono, wall=wall)
        other = SharedRate(store, "bulk", Rate(10, 1.0), clock=mono, wall=wall)  # a 2nd process
        assert rate.block == 3  # a quarter of a second's worth, rounded up
        first = rate.take(3)
        assert (first.start, first.spacing, [first.at(i) for i in range(3)]) == (
            50.0, 0.1, [50.0, 50.1, 50.2])
        # Another process taking at the same moment gets the slots after them.
        second = other.take(3)
        assert second.start == pytest.approx(50.3) and second.spacing == pytest.approx(0.1)
        # Idle time is not saved up: a second later the next slot is now.
        wall.now += 1.0
        mono.now += 1.0
        assert rate.take(1).start == pytest.approx(51.0)
        # A throttled reply halves the rate: the slots come twice as far apart...
        sent = wall.now - 0.2  # the refused message was sent before any cut
        assert rate.throttled(sent) == pytest.approx(5.0)
        assert _rate_row(app, "bulk")["cut_rate"] == pytest.approx(5.0)
        wall.now += 0.5
        mono.now += 0.5
        halved = rate.take(2)
        assert halved.spacing == pytest.approx(1 / (5.0 + 0.5 * 10 / RECOVERY_SECONDS))
        # ...once per congestion event: the refusals of messages sent before the
        # cut (another process's, a second later) are the event it answered...
        wall.now += 1.0
        assert other.throttled(sent + 0.1) is None
        assert _rate_row(app, "bulk")["cut_rate"] == pytest.approx(5.0)
        # ...and a refusal of one sent after it is a new event: halves what it has grown to.
        assert other.throttled(halved.taken_at) is not None
        grown = 5.0 + 1.5 * 10 / RECOVERY_SECONDS
        assert _rate_row(app, "bulk")["cut_rate"] == pytest.approx(grown / 2)
        # ...and it grows back by rate / RECOVERY_SECONDS per second, to the full rate.
        wall.now += RECOVERY_SECONDS / 2
        assert rate.take(1).spacing == pytest.approx(1 / (grown / 2 + 5.0))
        wall.now += RECOVERY_SECONDS
        assert rate.take(1).spacing == pytest.approx(0.1)
        # Another transport's schedule is its own.
        assert SharedRate(store, "news", Rate(600, 60.0), clock=mono, wall=wall).take(
            4).start == mono.now
    finally:
        close_app(app, timeout=5)


def test_two_processes_engines_share_one_schedule(make_apps: Any) -> None:
    """Two engines (as two processes have) take consecutive slots of one schedule."""
    first_app, _ = make_apps()
    second_app, _ = make_apps()
    one = SharedRate(first_app.extensions["mail_outbox"].outbox().store, "t", Rate(50, 1.0))
    two = SharedRate(second_app.extensions["mail_outbox"].outbox().store, "t", Rate(50, 1.0))
    a = one.take(10)
    b = two.take(10)
    c = one.take(10)
    # 10 slots at 50/s are 0.2 s: each block starts where the last one ended.
    assert b.start - a.start == pytest.approx(0.2, abs=0.05)
    assert c.start - b.start == pytest.approx(0.2, abs=0.05)
    assert a.spacing == b.spacing == pytest.approx(0.02)


def _windows(times: list[float], width: float) -> int:
    """The most arrivals within any ``width`` seconds."""
    times = sorted(times)
    most, start = 0, 0
    for end, t in enumerate(times):
        while t - times[start] >= width:
            start += 1
        most = max(most, end - start + 1)
    return most


@pytest.mark.parametrize("durable", [False, True], ids=["inline", "durable"])
def test_a_rate_limit_spreads_delivery_evenly_at_the_server(
        db_url: str, smtp_server: FaultSMTPServer, durable: bool) -> None:
    rate, total = 20.0, 30
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=durable, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_RATE_LIMIT=rate)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            mail.send_many([Message(f"paced {i}", recipients=["a@example.com"], body="x")
                            for i in range(total)])
            db.session.commit()
        assert smtp_server.wait_for(total, timeout=30)
        times = [m.received_at for m in smtp_server.messages]
        span = max(times) - min(times)
        # Slots 1/20 s apart: 29 gaps (unpaced, 30 go in well under 0.2 s), and no
        # burst above the rate; loosely, as the test server's loop can stall under load.
        assert span >= (total - 1) / rate * 0.9, span
        assert _windows(times, 1.0) <= math.ceil(rate * 1.0) + 6, sorted(times)
        wait_rows(app, lambda rs: {r["status"] for r in rs} == {"sent"}, timeout=10)
    finally:
        close_app(app, timeout=5)


def test_a_throttling_reply_halves_the_shared_rate_and_charges_no_attempt(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 450, "4.2.1 You are sending too fast, slow down", times=2)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_RETRY_BASE_SECONDS=0.0,
                   OUTBOX_TRANSPORTS={"default": {"MAIL_SERVER": smtp_server.host,
                                                  "MAIL_PORT": smtp_server.port,
                                                  "rate_limit": "40/s"}})
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            mail.send_many([Message(f"t {i}", recipients=["a@example.com"], body="x")
                            for i in range(6)])
            db.session.commit()
        current = wait_rows(app, lambda rs: {r["status"] for r in rs} == {"sent"}, timeout=40)
        assert sorted(r["attempts"] for r in current) == [1] * 6  # throttles given back
        cut = _rate_row(app)["cut_rate"]
        assert cut is not None and cut <= 20.0 + 1e-6  # halved from 40 (once or twice)
    finally:
        close_app(app, timeout=5)


def test_a_hand_ticked_drain_sends_the_paced_rows_as_their_slots_come(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    """``flask outbox worker --once`` (a drain in the caller's thread) under a rate limit."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_RATE_LIMIT=10.0)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            mail.send_many([Message(f"once {i}", recipients=["a@example.com"], body="x")
                            for i in range(8)])
            db.session.commit()
        worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
        assert worker.drain(timeout=30) == 8
        assert len(smtp_server.messages) == 8
        times = sorted(m.received_at for m in smtp_server.messages)
        assert times[-1] - times[0] >= 7 / 10 * 0.9
        # One round, one claim's worth: the round waits for its paced rows.
        with app.app_context():
            mail.send(Message("one more", recipients=["a@example.com"], body="x"))
            db.session.commit()
        worker.tick(timeout=10)
        assert len(smtp_server.messages) == 9
    finally:
        close_app(app, timeout=5)
