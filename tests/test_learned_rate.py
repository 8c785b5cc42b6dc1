"""A rate learned from a throttling server when no ``rate_limit`` is configured.

The schedule's rule is checked step by step on fake clocks (SQLite, where the
schedule's "now" is the caller's), its statements on both databases, and the
whole mechanism end to end: a real SMTP server with one strict token bucket
over all its sessions, and a dispatcher that was told no rate.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import Rate
from flask_mail_outbox.core._rate import (
    LEARNED_CAP,
    LEARNED_CUT,
    LEARNED_PLATEAU_SECONDS,
    SharedRate,
    effective_rate,
)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _rate_row(app: Flask, name: str = "default") -> dict[str, Any] | None:
    with app.app_context(), db.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM outbox_rate WHERE name = :n"),
                           {"n": name}).mappings().first()
    return None if row is None else dict(row)


def _queue(app: Flask, n: int) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        mail.send_many([Message(f"m{i}", recipients=["a@example.com"], body="x")
                        for i in range(n)])
        db.session.commit()


def _mark_sent(app: Flask, n: int, at: datetime | None) -> None:
    """``n`` queued rows recorded sent at ``at`` (None: the database's now)."""
    with app.app_context(), db.engine.begin() as conn:
        ids = [r[0] for r in conn.execute(sa.text(
            "SELECT id FROM outbox_email WHERE status = 'queued' ORDER BY id LIMIT :n"),
            {"n": n})]
        assert len(ids) == n
        when = ("timezone('UTC', now())" if conn.dialect.name == "postgresql" and at is None
                else ":at")
        for email_id in ids:
            conn.execute(sa.text(f"UPDATE outbox_email SET status = 'sent', sent_at = {when} "
                                 "WHERE id = :id"),
                         {"id": email_id, "at": at})


def _curve(held: float, since_cut: float) -> float:
    x = since_cut - LEARNED_PLATEAU_SECONDS
    return held * min(LEARNED_CAP, 1.0 + (1.0 - LEARNED_CUT) / LEARNED_PLATEAU_SECONDS ** 3
                      * x ** 3)


def test_a_learned_rate_starts_at_what_was_accepted_and_follows_its_curve(
        tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'learn.db'}", OUTBOX_RUN_WORKER=False,
                   OUTBOX_DURABLE=True)
    try:
        store = app.extensions["mail_outbox"].outbox().store
        wall, mono = Clock(2_000_000_000.0), Clock(50.0)
        store.clock = lambda: datetime.fromtimestamp(wall.now, UTC).replace(tzinfo=None)
        rate = SharedRate(store, "default", None, clock=mono, wall=wall)
        other = SharedRate(store, "default", None, clock=mono, wall=wall)  # a 2nd process
        assert rate.learned and not rate.exists()
        _queue(app, 80)
        # 12 rows accepted in the last second (and 5 long before: not counted).
        _mark_sent(app, 5, store.clock() - timedelta(seconds=30))
        _mark_sent(app, 12, store.clock() - timedelta(seconds=0.5))

        # Learned like a cut to the accepted rate: 12/s held, 0.7 of it at first.
        assert rate.learn(sending_for=5.0) == pytest.approx(12 * LEARNED_CUT)
        assert _rate_row(app) == {"name": "default", "tat": wall.now, "cut_rate": 12.0,
                                  "cut_at": wall.now, "paused_kind": None,
                                  "paused_error": None, "paused_since": None,
                                  "probe_at": None, "probe_delay": None}  # not paused
        assert other.exists() and other.current == 12.0
        # Another process learning later keeps the stored rate.
        _mark_sent(app, 30, store.clock())
        assert other.learn(sending_for=5.0) == pytest.approx(12 * LEARNED_CUT)
        assert _rate_row(app)["cut_rate"] == 12.0  # type: ignore[index]

        # The slots follow the curve: 0.7 of the held rate, back at it after the
        # plateau's seconds, flat around it, then probing up to twice it.
        first = rate.take(4)
        assert (first.start, first.spacing) == (mono.now, pytest.approx(1 / 8.4))
        cut_at = wall.now
        for seconds in (1.0, 2.0, 3.0, 4.0):
            wall.now = cut_at + seconds
            expected = _curve(12.0, seconds)
            assert expected == pytest.approx(effective_rate(None, 12.0, cut_at, wall.now))
            assert rate.take(1).spacing == pytest.approx(1 / expected)
        assert [round(_curve(12.0, s), 3) for s in (0, 1, 2, 3, 4, 5)] == [
            8.4, 11.55, 12.0, 12.45, 15.6, 24.0]
        # At the cap and not saturated (the last slot is past): it stays there.
        wall.now = cut_at + 6.0
        assert rate.take(100).spacing == pytest.approx(1 / 24.0)
        assert _rate_row(app)["cut_rate"] == 12.0  # type: ignore[index]
        # Saturated at the cap (100 slots ahead): the cap becomes the held rate.
        wall.now += 0.1
        assert rate.take(1).spacing == pytest.approx(1 / 24.0)
        row = _rate_row(app)
        assert row is not None
        assert (row["cut_rate"], row["cut_at"]) == (24.0, pytest.approx(
            wall.now - LEARNED_PLATEAU_SECONDS))

        # A refusal of a message sent before the last cut is that cut's event: none.
        assert rate.throttled(row["cut_at"] - 0.5) is None
        # One sent after it is a new event: cut to what was accepted in the last
        # second (20 rows), as that is less than the rate in force (24).
        _mark_sent(app, 20, store.clock() - timedelta(seconds=0.3))
        assert rate.throttled(wall.now - 0.05) == pytest.approx(20 * LEARNED_CUT)
        assert (_rate_row(app)["cut_rate"], _rate_row(app)["cut_at"]) == (  # type: ignore[index]
            20.0, wall.now)
        # The burst of refusals that follows (sent before this cut) is the same event.
        for _ in range(50):
            assert other.throttled(wall.now - 0.01) is None
        assert _rate_row(app)["cut_rate"] == 20.0  # type: ignore[index]
        # Nothing accepted lately: the rate in force is kept lower still, at least 1/s.
        wall.now += 10.0
        assert rate.throttled(wall.now) == pytest.approx(1.0 * LEARNED_CUT)
    finally:
        close_app(app, timeout=5)


def test_learning_and_a_cut_on_the_database_s_clock(make_apps: Any) -> None:
    """Both databases (PostgreSQL's "now" is its own): learn, share, cut once per event."""
    app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    second, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    one = SharedRate(app.extensions["mail_outbox"].outbox().store, "default", None)
    two = SharedRate(second.extensions["mail_outbox"].outbox().store, "default", None)
    _queue(app, 30)
    _mark_sent(app, 9, None if one.store.dialect.database_clock
               else datetime.now(UTC).replace(tzinfo=None))
    assert one.learn(sending_for=10.0) == pytest.approx(9 * LEARNED_CUT, rel=0.05)
    assert two.exists() and two.current == pytest.approx(9.0)
    assert two.take(3).spacing == pytest.approx(1 / (9 * LEARNED_CUT), rel=0.05)
    assert two.throttled(time.time() - 60) is None  # sent before the rate was learned
    _mark_sent(app, 6, None if one.store.dialect.database_clock
               else datetime.now(UTC).replace(tzinfo=None))
    # A message sent after the learning (a second later than now: beyond any clock
    # difference between this process and the database).
    cut = two.throttled(time.time() + 1.0)
    assert cut is not None and cut <= 9 * LEARNED_CUT + 1e-6
    assert _rate_row(app)["cut_rate"] == pytest.approx(cut / LEARNED_CUT)  # type: ignore[index]


def test_a_throttling_server_teaches_the_rate_every_worker_then_paces_by(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    """No rate configured, a strict quota: the first refusals teach a shared rate,
    the emails still waiting in the stream go back to be paced, and the rest go
    evenly at about the quota: far fewer refusals than emails, none dead."""
    quota, total = 25.0, 120
    smtp_server.quota(quota, burst=2)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_CONCURRENCY=4, OUTBOX_BATCH_SIZE=10, OUTBOX_RETRY_BASE_SECONDS=0.0)
    try:
        with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
            _queue(app, total)
            current = wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs),
                                timeout=90)
        assert [r["status"] for r in current] == ["sent"] * total
        assert len(smtp_server.messages) == total
        # Unpaced, nearly every email after the first dozen is refused at least once.
        refused = smtp_server.quota_refusals
        assert refused <= total // 4, refused
        row = _rate_row(app)
        assert row is not None and row["cut_rate"] is not None
        assert 1.0 <= row["cut_rate"] <= 4 * quota, row
        [learned] = [r.getMessage() for r in caplog.records
                     if "learned shared rate" in r.getMessage()]
        assert "no rate_limit is configured" in learned and " msg/s " in learned
    finally:
        close_app(app, timeout=5)


def test_a_worker_started_later_paces_by_the_rate_learned_before(make_apps: Any) -> None:
    app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    early, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    later, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)

    def lane_of(worker_app: Flask) -> Any:
        dispatcher = worker_app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
        return dispatcher.lanes.lanes["default"]

    lane = lane_of(early)
    assert lane.claim_limit(500) == 500  # nothing learned yet: unpaced
    assert lane.rate is None
    _queue(app, 5)
    SharedRate(app.extensions["mail_outbox"].outbox().store, "default", None).learn(1.0)
    # A process looks once, when it starts: the early one goes on unpaced until
    # its own first refusal (then it joins), the later one paces from the start.
    assert lane_of(early).claim_limit(500) == 500
    lane = lane_of(later)
    assert lane.claim_limit(500) == 1  # a block of the learned rate (1/s): one message
    assert lane.rate is not None and lane.rate.learned


def test_deleting_the_learned_rate_forgets_it_in_running_workers(make_apps: Any) -> None:
    """The documented way to forget a learned rate (DELETE its row) reaches a worker
    already pacing by it: it goes unpaced, with no error, until a refusal teaches it
    again. A configured rate's deleted row starts again."""
    app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    worker, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    _queue(app, 5)
    SharedRate(app.extensions["mail_outbox"].outbox().store, "default", None).learn(1.0)
    lanes = worker.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True).lanes
    lane = lanes.lanes["default"]
    assert lane.claim_limit(500) == 1 and lane.rate is not None  # paced by it
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_rate WHERE name = 'default'"))
    assert lanes._slots(lane, 2) is None  # no slots: the rows go at once
    assert lane.rate is None and lane.claim_limit(500) == 500
    assert not lanes.faults._ongoing  # nothing reported as failing

    store = app.extensions["mail_outbox"].outbox().store
    configured = SharedRate(store, "bulk", Rate(10, 1.0))
    assert configured.take(2).spacing == pytest.approx(0.1)
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_rate WHERE name = 'bulk'"))
    assert configured.take(2).spacing == pytest.approx(0.1)
    assert _rate_row(app, "bulk") is not None
