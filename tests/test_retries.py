"""Retries against real servers' replies, and the bound on how long an email stays unfinished.

Greylisting is an ordinary transient failure (the attempt counts, the backoff
applies); throttling gives its attempt back, a bounded number of times; a
lost lease spends an attempt. The fake-clock tests walk each path with the
library's default schedule and check the exact sequence of attempt times and
that the whole stays within the bound the README states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import close_app, db, make_app, poll, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import _retry, email_table
from flask_mail_outbox.core._clock import utcnow
from flask_mail_outbox.core._config import _DEFAULTS
from flask_mail_outbox.core._retry import longest_unfinished, schedule

GREYLISTED = "4.7.1 Greylisted, please try again later"
THROTTLED = "Throttling failure: Maximum sending rate exceeded."
README = Path(__file__).resolve().parent.parent / "README.md"

DEFAULT_RETRY = {key: _DEFAULTS[key] for key in (
    "OUTBOX_RETRY_BASE_SECONDS", "OUTBOX_RETRY_MAX_SECONDS", "OUTBOX_MAX_ATTEMPTS",
    "OUTBOX_MAX_THROTTLE_DEFERRALS")}


def _send(app: Flask) -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
    return int(email_id)


def _durable(db_url: str, smtp_server: FaultSMTPServer, **config: Any) -> Flask:
    return make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                    OUTBOX_DURABLE=True, OUTBOX_RETRY_BASE_SECONDS=0.05,
                    OUTBOX_RETRY_MAX_SECONDS=0.2, OUTBOX_POLL_INTERVAL=0.05,
                    OUTBOX_POLL_MAX_INTERVAL=0.2, **config)


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- over the real SMTP test server ------------------------------------------------------

def test_two_greylisting_replies_then_success_count_three_attempts(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    smtp_server.reply("data", 451, GREYLISTED, times=2)
    app = _durable(db_url, smtp_server)
    try:
        _send(app)
        assert smtp_server.wait_for(1, timeout=20)
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=20.0)
    finally:
        close_app(app)
    assert row["attempts"] == 3
    history = json.loads(row["error_history"])
    assert [(h["code"], h["attempt"], h.get("deferred")) for h in history] == [
        (451, 1, None), (451, 2, None)]
    assert smtp_server.data_attempts == 3
    assert not [m for m in _errors(caplog) if "throttl" in m.lower()]


def test_a_server_that_always_greylists_dead_letters_after_the_configured_attempts(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    smtp_server.reply("data", 451, GREYLISTED)
    app = _durable(db_url, smtp_server, OUTBOX_MAX_ATTEMPTS=4)
    try:
        email_id = _send(app)
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=20.0)
    finally:
        close_app(app)
    assert row["attempts"] == 4 and smtp_server.data_attempts == 4
    errors = _errors(caplog)
    assert not [m for m in errors if "throttl" in m.lower()]
    [dead] = [m for m in errors if f"Email {email_id} " in m]
    assert "OUTBOX_MAX_ATTEMPTS=4" in dead and "Greylisted" in dead
    assert "dead-lettered" in dead  # the consequence
    assert f"mail.retry({email_id})" in dead and "flask outbox dlq retry" in dead  # the fix


def test_a_throttled_row_stops_being_given_back_after_the_bound(
        db_url: str, smtp_server: FaultSMTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_retry, "THROTTLE_DELAY_SECONDS", 0.05)
    smtp_server.reply("data", 454, THROTTLED)
    app = _durable(db_url, smtp_server, OUTBOX_MAX_ATTEMPTS=3,
                   OUTBOX_MAX_THROTTLE_DEFERRALS=2)
    try:
        _send(app)
        [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=30.0)
    finally:
        close_app(app)
    history = json.loads(row["error_history"])
    # Two deferrals given back (attempt 1 both times), then three charged attempts.
    assert [(h["attempt"], h.get("deferred", False)) for h in history] == [
        (1, True), (1, True), (1, False), (2, False), (3, False)]
    assert row["attempts"] == 3 and smtp_server.data_attempts == 5


def test_inline_mode_dead_letters_a_server_that_always_greylists(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, GREYLISTED)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_MAX_ATTEMPTS=3, OUTBOX_INLINE_RETRIES=1,
                   OUTBOX_RETRY_BASE_SECONDS=0.05, OUTBOX_RETRY_MAX_SECONDS=0.05)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        _send(app)
        # First attempt and one in-process retry; then the row waits its backoff.
        [row] = wait_rows(app, lambda r: r[0]["attempts"] == 2 and r[0]["status"] == "queued",
                          timeout=10.0)
        with app.app_context():
            assert mail.wait_idle(10)
        assert row["due_at"] > row["created_at"]  # the backoff, not due at once
        poll(lambda: rows(app)[0]["due_at"] <= utcnow(), timeout=5.0)
        with app.app_context():
            swept = mail.sweep(min_age=0)
        assert swept.failed == 1
        [row] = rows(app)
    finally:
        close_app(app)
    assert row["status"] == "failed" and row["attempts"] == 3
    assert smtp_server.data_attempts == 3


def test_inline_mode_waits_out_a_throttle_deferral_before_its_in_process_retry(
        db_url: str, smtp_server: FaultSMTPServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_retry, "THROTTLE_DELAY_SECONDS", 1.0)
    smtp_server.reply("data", 454, THROTTLED, times=1)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    try:
        _send(app)
        deferred = poll(lambda: rows(app)[0], lambda r: r["error_history"], timeout=10.0)
        # Recorded as due a second from now, not at once: the server asked for a pause.
        assert (deferred["due_at"] - utcnow()).total_seconds() > 0.5
        # And the in-process retry came when it was due (a retry in a quarter of a
        # second would have found it not due and left it to the sweep).
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=10.0)
    finally:
        close_app(app)
    assert row["attempts"] == 1 and smtp_server.data_attempts == 2
    assert [h.get("deferred") for h in json.loads(row["error_history"])] == [True]


# -- the schedule and the bound on a fake clock -----------------------------------------

class FakeClock:
    """The store's clock (naive UTC), moved by the test."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


def _hand_ticked(tmp_path: Path, smtp_server: FaultSMTPServer,
                 clock: FakeClock) -> tuple[Flask, Any]:
    app = make_app(f"sqlite:///{tmp_path / 'clock.db'}", MAIL_SERVER=smtp_server.host,
                   MAIL_PORT=smtp_server.port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                   OUTBOX_LISTEN=False, **DEFAULT_RETRY)
    runtime = app.extensions["mail_outbox"].outbox()
    runtime.store.clock = clock
    dispatcher = runtime.dispatch(hand_ticked=True)
    # Jitter at its top: the slowest schedule the defaults allow.
    dispatcher.policy = dataclasses.replace(dispatcher.policy, rand=lambda: 1.0)
    # A rate learned from a throttle paces on the real clock; these tests are
    # about due times.
    dispatcher.lanes.lanes["default"].learnable = None
    return app, dispatcher


def _walk(app: Flask, dispatcher: Any, clock: FakeClock) -> list[float]:
    """Tick whenever the row falls due, until it is finished; the gaps between attempts."""
    # From the moment the row was first due (send() stamps it on the real clock).
    clock.now = start = datetime.fromisoformat(str(rows(app)[0]["due_at"]))
    gaps: list[float] = []
    last = start
    for _ in range(200):
        [row] = rows(app)
        if row["status"] in ("sent", "failed"):
            break
        due = datetime.fromisoformat(str(row["due_at"]))
        clock.now = max(clock.now, due)
        gaps.append(round((clock.now - last).total_seconds(), 6))
        last = clock.now
        dispatcher.tick()
    [row] = rows(app)
    assert row["status"] == "failed"
    gaps.append(round((clock.now - start).total_seconds(), 6))  # the total, last
    return gaps


def _bound(pickup: float = 0.0) -> float:
    return longest_unfinished(
        base_seconds=_DEFAULTS["OUTBOX_RETRY_BASE_SECONDS"],
        max_seconds=_DEFAULTS["OUTBOX_RETRY_MAX_SECONDS"],
        max_attempts=_DEFAULTS["OUTBOX_MAX_ATTEMPTS"],
        max_throttle_deferrals=_DEFAULTS["OUTBOX_MAX_THROTTLE_DEFERRALS"],
        lease_seconds=_DEFAULTS["OUTBOX_LEASE_SECONDS"], pickup_seconds=pickup)


def _backoffs() -> list[float]:
    return [round(step.delay * 1.2, 6) for step in schedule(
        _DEFAULTS["OUTBOX_RETRY_BASE_SECONDS"], _DEFAULTS["OUTBOX_RETRY_MAX_SECONDS"],
        _DEFAULTS["OUTBOX_MAX_ATTEMPTS"])]


def test_fake_clock_transient_path_follows_the_default_schedule_to_the_dead_letter(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, GREYLISTED)
    clock = FakeClock()
    app, dispatcher = _hand_ticked(tmp_path, smtp_server, clock)
    try:
        _send(app)
        *gaps, total = _walk(app, dispatcher, clock)
    finally:
        close_app(app)
    assert gaps == [0.0, *_backoffs()]
    assert gaps[1:8] == [72, 144, 288, 576, 1152, 2304, 4320]  # 1 min doubling, +20 %
    assert rows(app)[0]["attempts"] == 30 and smtp_server.data_attempts == 30
    assert total <= _bound()
    assert total > 24 * 3600  # about a day of trying, with jitter at its top


def test_fake_clock_throttled_path_gives_back_ten_attempts_then_backs_off(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 454, THROTTLED)
    clock = FakeClock()
    app, dispatcher = _hand_ticked(tmp_path, smtp_server, clock)
    try:
        _send(app)
        *gaps, total = _walk(app, dispatcher, clock)
    finally:
        close_app(app)
    assert gaps == [0.0, *[_retry.THROTTLE_DELAY_SECONDS] * 10, *_backoffs()]
    [row] = rows(app)
    assert row["attempts"] == 30 and smtp_server.data_attempts == 40
    assert sum(1 for h in json.loads(row["error_history"]) if h.get("deferred")) == 10
    assert total <= _bound()


def test_fake_clock_lease_lost_path_spends_an_attempt_per_lease(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    clock = FakeClock()
    app, dispatcher = _hand_ticked(tmp_path, smtp_server, clock)
    store = dispatcher.store
    lease = _DEFAULTS["OUTBOX_LEASE_SECONDS"]
    max_attempts = _DEFAULTS["OUTBOX_MAX_ATTEMPTS"]
    try:
        email_id = _send(app)
        clock.now = start = rows(app)[0]["due_at"]
        claims = 0
        failed_at: datetime | None = None
        for _ in range(100):
            # A process claims it and dies mid-send; a lease later the next claim
            # reaps it and claims it again, until a claim finds its attempts
            # spent: that delivery dead-letters it without a send.
            claimed, _ = store.leases.claim_due(1, owner=f"dead-{claims}", lease_seconds=lease,
                                         reap=True)
            if claimed and claimed[0].attempt > max_attempts:
                with app.app_context():
                    report = dispatcher.delivery.finish([(claimed[0], None)], policy=dispatcher.policy)
                assert report.failed == [email_id]
                failed_at = clock.now
                break
            claims += len(claimed)
            clock.now += timedelta(seconds=lease + 0.001)
        [row] = rows(app)
    finally:
        close_app(app)
    assert failed_at is not None
    assert row["id"] == email_id and row["status"] == "failed"
    assert claims == max_attempts and row["attempts"] == max_attempts
    total = (failed_at - start).total_seconds()
    assert total == pytest.approx(max_attempts * (lease + 0.001))
    assert total <= _bound()
    assert smtp_server.data_attempts == 0


def test_fake_clock_worst_case_walk_stays_within_the_bound(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    """Every path at its worst in one email: the bound is an upper bound, and a close one.

    Each due row waits the longest pickup (the PostgreSQL LISTEN backstop) before a
    tick takes it; attempt 1 loses its lease; then every throttle deferral is spent;
    then a greylisting server to the last attempt, jitter at its top.
    """
    pickup = _DEFAULTS["OUTBOX_LISTEN_BACKSTOP_SECONDS"]
    lease = _DEFAULTS["OUTBOX_LEASE_SECONDS"]
    smtp_server.reply("data", 454, THROTTLED, times=_DEFAULTS["OUTBOX_MAX_THROTTLE_DEFERRALS"])
    smtp_server.reply("data", 451, GREYLISTED)
    clock = FakeClock()
    app, dispatcher = _hand_ticked(tmp_path, smtp_server, clock)
    try:
        _send(app)
        clock.now = start = rows(app)[0]["due_at"]
        clock.now += timedelta(seconds=pickup)
        claimed, _ = dispatcher.store.leases.claim_due(1, owner="dies", lease_seconds=lease)
        assert len(claimed) == 1
        clock.now += timedelta(seconds=lease + 0.001 + pickup)
        for _ in range(100):
            dispatcher.tick()
            [row] = rows(app)
            if row["status"] == "failed":
                break
            clock.now = row["due_at"] + timedelta(seconds=pickup)
    finally:
        close_app(app)
    assert (row["status"], row["attempts"]) == ("failed", 30)
    assert smtp_server.data_attempts == 29 + 10
    total = (clock.now - start).total_seconds()
    bound = _bound(pickup=pickup)
    assert total <= bound
    # Exactly the walk: a pickup, the lost lease and the pickup after its reap, ten
    # deferrals, then each backoff from attempt 2 on at the top of its jitter.
    assert total == pytest.approx(pickup + (lease + 0.001 + pickup)
                                  + 10 * (_retry.THROTTLE_DELAY_SECONDS + pickup)
                                  + sum(b + pickup for b in _backoffs()[1:]), abs=0.01)
    assert bound - total < 300  # the bound is close: under 5 minutes slack on 30 hours


# -- what the README states ------------------------------------------------------------

def _readme_section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end != -1 else len(text)]


def test_the_readme_schedule_table_is_the_default_schedule() -> None:
    section = _readme_section("### The retry schedule")
    table = re.findall(r"^\| (\d+) \| ([\d.]+ (?:s|min|h)) \| ([^|]+?) \|$", section, re.MULTILINE)
    expected = schedule(_DEFAULTS["OUTBOX_RETRY_BASE_SECONDS"],
                        _DEFAULTS["OUTBOX_RETRY_MAX_SECONDS"], _DEFAULTS["OUTBOX_MAX_ATTEMPTS"])
    assert [int(attempt) for attempt, _, _ in table] == [s.attempt for s in expected]
    assert [delay for _, delay, _ in table] == [_retry.human_seconds(s.delay)
                                                for s in expected]
    assert [elapsed for _, _, elapsed in table] == [_retry.human_seconds(s.elapsed)
                                                    for s in expected]


def test_the_readme_states_the_longest_unfinished_time_of_each_mode() -> None:
    section = _readme_section("### The retry schedule")
    durable = _retry.human_seconds(_bound(pickup=_DEFAULTS["OUTBOX_LISTEN_BACKSTOP_SECONDS"]))
    inline = _retry.human_seconds(_bound(pickup=60.0) + _DEFAULTS["OUTBOX_SWEEP_MIN_AGE_SECONDS"])
    assert f"durable mode: at most {durable}" in section
    assert f"inline mode: at most {inline}" in section


def test_an_inline_sweep_dead_letters_a_lost_lease_whose_attempts_are_spent(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_MAX_ATTEMPTS=2)
    mail: OutboxMail = app.extensions["test_mail"]
    store = app.extensions["mail_outbox"].outbox().store
    try:
        ids = [_send(app), _send(app)]
        assert smtp_server.wait_for(2)
        with app.app_context():
            assert mail.wait_idle(10)
        # As processes that died mid-send left them: one with an attempt to spare,
        # one with its attempts spent, both leases expired.
        for email_id, attempts in zip(ids, (1, 2)):
            with store.write() as conn:
                conn.execute(email_table.update().where(email_table.c.id == email_id).values(
                    status="sending", attempts=attempts, lease_owner="dead",
                    lease_expires_at=utcnow() - timedelta(seconds=1)))
        with app.app_context():
            report = mail.sweep(min_age=0)
        spare, spent = rows(app)
    finally:
        close_app(app)
    assert (spare["status"], spare["attempts"]) == ("sent", 2)
    assert (spent["status"], spent["attempts"]) == ("failed", 2)
    assert (report.scanned, report.sent, report.failed, report.skipped) == (2, 1, 1, 0)
    assert smtp_server.wait_for(3) and not smtp_server.wait_for(4, timeout=0.3)
