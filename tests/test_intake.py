"""A worker's intake on a fake clock, and what a stopping process releases (issue 37).

The intake holds what was handed to a worker and not claimed yet: ids due
now (urgent first), ids scheduled with ``send_after`` and in-process retries,
every deadline on the one clock it is given. These tests walk it through an
exact sequence of fake times. :class:`Releases` owns the stopping flag and
the mark that frees released rows for the next sweep: checked on real
databases (SQLite and PostgreSQL).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app, poll, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._degrade import FaultTracker
from flask_mail_outbox.core import _intake, email_table
from flask_mail_outbox.core._intake import Intake
from flask_mail_outbox.core._releases import Releases
from flask_mail_outbox.core._sweeping import RELEASED


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_intake_hands_out_ids_at_their_exact_fake_times() -> None:
    clock = FakeClock(100.0)
    intake = Intake(clock, FaultTracker())
    assert intake.next_deadline() is None

    # Handed ids are due now, in order; an urgent one goes before all that wait.
    intake.hand([1, 2])
    intake.hand([3, 4], urgent={4})
    assert intake.next_deadline() == 100.0
    assert intake.take(2) == [4, 1]
    assert intake.take(10) == [2, 3]
    assert intake.next_deadline() is None

    # Scheduled ids, each due so many seconds from now (a past time is now).
    intake.schedule([(5, 5.0), (6, 1.0), (7, -3.0)])
    assert intake.next_deadline() == 100.0
    assert intake.take(10) == [7]
    assert intake.next_deadline() == 101.0
    assert not intake.in_hand()  # due later: not work in hand

    # An in-process retry, due after its pause (2.5 s for the first).
    intake.retry(8, lambda number: 2.5 * number)
    assert intake.in_hand()  # a retry waiting is work in hand
    assert intake.next_deadline() == 101.0

    clock.now = 100.999
    assert intake.take(10) == []
    clock.now = 101.0
    assert intake.take(10) == [6]
    assert intake.next_deadline() == 102.5

    clock.now = 102.5
    assert intake.take(10) == [8]
    assert intake.retries_done(8) == 1
    assert intake.next_deadline() == 105.0

    # Its second retry pauses twice as long, from now.
    intake.retry(8, lambda number: 2.5 * number)
    assert intake.next_deadline() == 105.0
    clock.now = 105.0
    intake.hand([9])  # handed before one comes due: what comes due joins the end
    assert intake.take(10) == [9, 5]
    assert intake.next_deadline() == 107.5
    clock.now = 107.5
    assert intake.take(10) == [8]
    assert intake.retries_done(8) == 2
    intake.settled([8])
    assert intake.retries_done(8) == 0
    assert intake.next_deadline() is None
    assert not intake.in_hand()


def test_a_stopping_intake_drops_what_waits_and_names_what_was_not_claimed() -> None:
    clock = FakeClock()
    intake = Intake(clock, FaultTracker())
    intake.hand([1, 2])
    intake.schedule([(3, 60.0)])
    intake.retry(4, lambda number: 1.0)
    assert intake.clear() == [1, 2, 4]  # scheduled ones are marked so in the database
    assert intake.next_deadline() is None
    clock.now += 120
    assert intake.take(10) == []


def test_what_overflows_the_intake_is_reported_once_and_left_queued(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    monkeypatch.setattr(_intake, "MAX_HANDED", 3)
    monkeypatch.setattr(_intake, "MAX_SCHEDULED", 2)
    intake = Intake(FakeClock(), FaultTracker())
    intake.hand([1, 2])
    intake.hand([3, 4, 5], urgent={5})
    assert intake.handed == 3
    assert intake.fitting([6, 7, 8]) == [6, 7]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert errors[0].startswith("The delivery queue of this process is full (3 emails")
    assert "2 committed email(s)" in errors[0]
    assert errors[1].startswith("This process already times 2 emails sent with send_after")
    assert "1 more" in errors[1]
    assert intake.take(10) == [1, 2, 3]
    intake.hand([9])  # room again: the overflow is over
    assert any(r.getMessage().startswith("Recovered: The delivery queue of this process")
               for r in caplog.records)


@pytest.fixture
def inline_app(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    yield app
    close_app(app, timeout=5)


def test_a_scheduled_email_goes_out_when_the_workers_clock_says_it_is_due(
        inline_app: Flask, smtp_server: FaultSMTPServer) -> None:
    """The due time read from the database becomes a deadline on the worker's clock:
    stopped, that clock holds the email back after its time passed in the world, and
    it goes at the first round once that clock reaches it."""
    clock = FakeClock(5000.0)
    worker = inline_app.extensions["mail_outbox"].outbox().worker
    worker.hand_ticked = True
    worker.clock = clock
    mail: OutboxMail = inline_app.extensions["test_mail"]
    with inline_app.app_context():
        mail.send(Message("later", recipients=["a@example.com"], body="x"),
                  send_after=timedelta(seconds=1))
        db.session.commit()
    deadline = worker.intake.next_deadline()
    assert deadline is not None and 5000.0 < deadline <= 5001.0
    # Due in the database (on its clock), and not on the worker's.
    store = inline_app.extensions["mail_outbox"].outbox().store

    def due_in_the_database() -> bool:
        with store.read() as conn:
            return bool(conn.execute(sa.select(sa.func.count()).select_from(email_table)
                                     .where(email_table.c.due_at <= store.now_expr())).scalar())

    assert poll(due_in_the_database, timeout=10)
    clock.now = deadline - 0.001
    worker.tick(timeout=10)
    assert smtp_server.messages == [] and [r["status"] for r in rows(inline_app)] == ["queued"]
    assert worker.intake.next_deadline() == deadline
    clock.now = deadline
    worker.tick(timeout=10)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["later"]
    assert [r["status"] for r in rows(inline_app)] == ["sent"]
    assert worker.intake.next_deadline() is None


@pytest.fixture
def quiet_app(db_url: str) -> Iterator[Flask]:
    """Durable, with no dispatcher: what is queued stays queued."""
    app = make_app(db_url, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    yield app
    close_app(app, timeout=5)


def _queue(app: Flask, count: int) -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
               for i in range(count)]
        db.session.commit()
    return ids


def test_releases_marks_what_was_released_at_stop_and_after_it(
        quiet_app: Flask, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    ids = _queue(quiet_app, 4)
    outbox = quiet_app.extensions["mail_outbox"].outbox()
    releases = Releases(outbox.store, outbox.config)

    releases.note([ids[0]])  # a running process delivers what it releases itself
    assert not releases.stopping
    releases.stop()
    assert releases.stopping
    releases.note([ids[2], ids[1]])
    releases.note([ids[1]])  # twice: marked once
    releases.mark(in_flight=0, ran=False)
    [line] = [r for r in caplog.records if r.getMessage().startswith("Outbox delivery stopped")]
    assert line.levelno == logging.INFO
    assert f"released 2 unsent email(s) {[ids[1], ids[2]]}" in line.getMessage()
    assert [r["lease_owner"] for r in rows(quiet_app)] == [None, RELEASED, RELEASED, None]

    # Released after stop()'s mark (a send that finished in the background): marked at once.
    releases.note([ids[3]])
    assert [r["lease_owner"] for r in rows(quiet_app)] == [
        None, RELEASED, RELEASED, RELEASED]
    assert any(r.getMessage().startswith(f"Outbox delivery released 1 more unsent email(s) "
                                         f"{[ids[3]]} after stop") for r in caplog.records)
    assert [r["status"] for r in rows(quiet_app)] == ["queued"] * 4


def test_releases_with_nothing_released_says_so_at_info_only_where_it_ran(
        quiet_app: Flask, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="flask_mail_outbox")
    outbox = quiet_app.extensions["mail_outbox"].outbox()
    for ran, level in ((False, logging.DEBUG), (True, logging.INFO)):
        caplog.clear()
        releases = Releases(outbox.store, outbox.config)
        releases.stop()
        releases.mark(in_flight=0, ran=ran)
        [line] = [r for r in caplog.records
                  if r.getMessage().startswith("Outbox delivery stopped")]
        assert (line.levelno, line.getMessage().split(": ", 1)[1]) == (
            level, "nothing released, nothing in flight")


def test_rows_released_while_stopping_are_marked_and_those_before_are_not(
        quiet_app: Flask) -> None:
    """Delivery.release tells the process's Releases: claimed rows it lets go once the
    process stops are marked for the next sweep; before the stop, a running process
    takes them again itself, so they are not."""
    ids = _queue(quiet_app, 2)
    outbox = quiet_app.extensions["mail_outbox"].outbox()
    claimed = outbox.store.leases.claim_ids(ids, owner="test-owner", lease_seconds=60)
    assert [email.id for email in claimed] == ids
    assert outbox.delivery.release(claimed[:1]) == 1
    outbox.releases.stop()
    assert outbox.delivery.release(claimed[1:]) == 1
    outbox.releases.mark(in_flight=0, ran=True)
    assert [(r["status"], r["attempts"], r["lease_owner"]) for r in rows(quiet_app)] == [
        ("queued", 0, None), ("queued", 0, RELEASED)]
