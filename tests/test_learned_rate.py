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
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import Rate
from flask_mail_outbox.core._models import email_table
from flask_mail_outbox.core._rate import (
    _PROBE_CURVE,
    _PROBE_OFFSET,
    LEARNED_CAP,
    LEARNED_CUT,
    LEARNED_PLATEAU_SECONDS,
    LEARNED_PROBE_SECONDS,
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

        # A first guess, in force at once: the 12/s accepted, stored on the steep
        # side of the curve (its value there times the stored rate is 12).
        assert rate.learn(sending_for=5.0) == pytest.approx(12.0)
        assert _rate_row(app) == {"name": "default", "tat": wall.now,
                                  "cut_rate": pytest.approx(12.0 / _PROBE_CURVE),
                                  "cut_at": wall.now - _PROBE_OFFSET, "paused_kind": None,
                                  "paused_error": None, "paused_since": None,
                                  "probe_at": None, "probe_delay": None}  # not paused
        assert _PROBE_OFFSET == LEARNED_PLATEAU_SECONDS + LEARNED_PROBE_SECONDS
        assert other.exists() and other.current == pytest.approx(12.0)
        # Another process learning later keeps the stored rate when its own guess
        # is no higher (the 30 rows are too old to count).
        _mark_sent(app, 30, store.clock() - timedelta(seconds=5))
        assert other.learn(sending_for=5.0) == pytest.approx(12.0)
        assert _rate_row(app)["cut_rate"] == pytest.approx(12.0 / _PROBE_CURVE)  # type: ignore[index]

        # It probes: x1.32 (2 / 1.518) in the 0.59 s up to the stored rate's cap...
        first = rate.take(4)
        assert (first.start, first.spacing) == (mono.now, pytest.approx(1 / 12.0))
        step = 2.0 / _PROBE_CURVE
        learned_at = wall.now
        wall.now = learned_at + 0.2
        assert 12.0 < 1 / rate.take(1).spacing < 12.0 * step
        wall.now = learned_at + 0.6  # at the cap; the schedule not saturated: it stays
        assert rate.take(1).spacing == pytest.approx(1 / (12.0 * step))
        assert _rate_row(app)["cut_rate"] == pytest.approx(12.0 / _PROBE_CURVE)  # type: ignore[index]
        # ...and on from there while the schedule is saturated (the slot just
        # taken is still ahead): the same steep step again, from where it is:
        # doubling about every 1.5 s.
        assert rate.take(100).spacing == pytest.approx(1 / (12.0 * step))
        row = _rate_row(app)
        assert row is not None
        assert (row["cut_rate"], row["cut_at"]) == (
            pytest.approx(12.0 * step / _PROBE_CURVE), pytest.approx(wall.now - _PROBE_OFFSET))
        wall.now += 0.1
        assert 12.0 * step < 1 / rate.take(1).spacing < 12.0 * step * step
        wall.now += 0.5
        assert rate.take(1).spacing == pytest.approx(1 / (12.0 * step * step))
        assert step ** (1.5 / 0.588) == pytest.approx(2.0, rel=0.02)
        # The curve after a cut: 0.7 of the rate held, back at it after the
        # plateau's seconds, flat around it, then up to twice it.
        assert [round(_curve(12.0, s), 3) for s in (0, 1, 2, 3, 4, 5)] == [
            8.4, 11.55, 12.0, 12.45, 15.6, 24.0]
        assert effective_rate(None, 12.0, 100.0, 103.0) == pytest.approx(12.45)
        wall.now += 2.0

        # A refusal of a message sent before the last cut is that cut's event: none.
        assert rate.throttled(row["cut_at"] - 0.5) is None
        # One sent after it is a new event: cut to what was accepted in the last
        # second (20 rows), as that is less than the rate in force (27.4).
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
    assert one.learn(sending_for=10.0) == pytest.approx(9.0, rel=0.05)  # then probes up
    assert two.exists() and two.current == pytest.approx(9.0, rel=0.05)
    # Throttled together, a process whose guess counts more rows (recorded since)
    # replaces the lower first guess; a lower one later does not.
    _mark_sent(app, 3, None if one.store.dialect.database_clock
               else datetime.now(UTC).replace(tzinfo=None))
    assert two.learn(sending_for=10.0) == pytest.approx(12.0, rel=0.05)
    assert one.learn(sending_for=10.0) == pytest.approx(12.0, rel=0.05)  # 12 again: kept
    assert _rate_row(app)["cut_rate"] == pytest.approx(  # type: ignore[index]
        12.0 / _PROBE_CURVE, rel=0.001)
    assert two.take(3).spacing == pytest.approx(1 / 12.0, rel=0.05)
    assert two.throttled(time.time() - 60) is None  # sent before the rate was learned
    _mark_sent(app, 6, None if one.store.dialect.database_clock
               else datetime.now(UTC).replace(tzinfo=None))
    # A message sent after the learning (a second later than now: beyond any clock
    # difference between this process and the database).
    cut = two.throttled(time.time() + 1.0)
    assert cut is not None and cut <= 12 * 1.05 * LEARNED_CUT
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


def _lane(app: Flask, hand_ticked: bool = True) -> Any:
    return app.extensions["mail_outbox"].outbox().dispatch(
        hand_ticked=hand_ticked).lanes.lanes["default"]


def test_a_refusal_a_process_sent_before_it_paced_is_the_event_that_taught_the_rate(
        make_apps: Any) -> None:
    """A learned rate starts on the probing side of its curve, so its cut_at is
    seconds back: what a process sent unpaced before it joined must not count as
    a new congestion event (it would cut the first guess at once)."""
    app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    lanes = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True).lanes
    lane = lanes.lanes["default"]
    assert lane.claim_limit(500) == 500  # unpaced
    unpaced_at = time.time() - 0.5
    _queue(app, 20)
    _mark_sent(app, 10, None if lane.learnable.store.dialect.database_clock
               else datetime.now(UTC).replace(tzinfo=None))
    lanes._learn(lane, refused=3)
    assert lane.rate is not None and lane.paced_since >= unpaced_at + 0.5
    stored = _rate_row(app)
    assert stored is not None
    # Sent unpaced before the lane joined: the learning's event, no cut...
    lanes._cut = None  # type: ignore[method-assign,assignment]  # must not be called
    rows = [SimpleNamespace(id=1, transport="default")]
    lane.sent_at[1] = unpaced_at
    report = SimpleNamespace(transient=[(1, 1, SimpleNamespace(throttled=True))])
    lanes.after_record([(rows[0], None)], report, dispatching=True)  # type: ignore[arg-type]
    assert _rate_row(app) == stored
    # ...one sent at a slot taken since is a new event: cut.
    del lanes._cut
    slots = lane.rate.take(1)
    lane.sent_at[1] = slots.taken_at
    lanes.after_record([(rows[0], None)], report, dispatching=True)  # type: ignore[arg-type]
    after = _rate_row(app)
    assert after is not None and after["cut_at"] > stored["cut_at"]


def test_a_throttled_row_of_a_paced_lane_waits_for_its_slot_not_the_throttle_delay(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    """With a rate to pace by, a refusal cuts it and the refused row is due again at
    once (its next slot is its wait); unpaced it waits THROTTLE_DELAY_SECONDS. At
    the end of a run the last refused rows otherwise hold the whole run 5 s."""
    smtp_server.quota(1.0, burst=2)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_RATE_LIMIT=50, OUTBOX_CONCURRENCY=1)
    try:
        _queue(app, 5)
        worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
        worker.tick(timeout=10)
        with app.app_context(), db.engine.connect() as conn:
            e = email_table
            rows = conn.execute(sa.select(e.c.status, e.c.due_at, e.c.attempts)).all()
        now = datetime.now(UTC).replace(tzinfo=None)
        assert sorted(r.status for r in rows) == ["queued"] * 3 + ["sent"] * 2
        assert smtp_server.quota_refusals == 3
        deferred = [r for r in rows if r.status == "queued"]
        assert all(r.attempts == 0 for r in deferred), deferred  # given back: a deferral
        assert all(r.due_at <= now for r in deferred), (now, deferred)
    finally:
        close_app(app, timeout=5)
    # Unpaced (no rate learned yet: this is how it learns), the wait stays.
    smtp_server.quota(1.0, burst=2)
    unpaced = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                       OUTBOX_CONCURRENCY=1)
    try:
        with unpaced.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM outbox_email"))
            conn.execute(sa.text("DELETE FROM outbox_rate"))
        time.sleep(2.1)  # the bucket is full again
        _queue(unpaced, 5)
        unpaced.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True).tick(timeout=10)
        with unpaced.app_context(), db.engine.connect() as conn:
            due = conn.execute(sa.select(email_table.c.due_at)
                               .where(email_table.c.status == "queued")).scalars().all()
        assert due and all(d >= datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=3)
                           for d in due), due
    finally:
        close_app(unpaced, timeout=5)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_process_joins_a_rate_another_learned_at_once_and_draws_no_refusal(
        make_apps: Any, smtp_server: FaultSMTPServer) -> None:
    """PostgreSQL: the process that learns a rate NOTIFYs it; a process already
    sending unpaced joins it at its next round instead of drawing refusals of its
    own to learn it (the server counts them)."""
    smtp_server.quota(4.0, burst=1)
    app, _ = make_apps(OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    second, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True, OUTBOX_LISTEN=True,
                          OUTBOX_CONCURRENCY=4)
    worker = second.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
    lane = worker.lanes.lanes["default"]
    assert lane.claim_limit(500) == 500 and lane.rate is None  # looked: nothing learned
    deadline = time.monotonic() + 10
    while not worker.listening and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.listening
    # Another process learns 1/s (nothing accepted lately: the floor of a first guess).
    SharedRate(app.extensions["mail_outbox"].outbox().store, "default", None).learn(1.0)
    while not lane.told and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lane.told
    _queue(app, 3)
    worker.drain(timeout=15)
    assert lane.rate is not None and lane.rate.learned
    assert len(smtp_server.messages) == 3
    # Unpaced, three at once against a burst of one: two refusals.
    assert smtp_server.quota_refusals == 0
