"""The test kit's control half (``flask_mail_outbox.testing._control.OutboxControl``).

Each guarantee of the outbox, driven on a test clock and checked as an exact
sequence on both databases: nothing goes before its time, everything goes at
it, through the worker's real claim, transport and record (the memory
transport, scripted to fail as a real server would). And every bad use of
the control is a :class:`TestKitError` that says what to do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, rows
from flask import Flask

from flask_mail_outbox import (
    DeliveryEvent,
    Message,
    OutboxMail,
    TransientError,
    email_event,
    email_failed,
)
from flask_mail_outbox.testing._control import OutboxControl, TestKitError
from flask_mail_outbox.transports import MemoryTransport

BASE = 10.0  # OUTBOX_RETRY_BASE_SECONDS here: the first retry waits 8 to 12 s (jitter)


@pytest.fixture
def kit(make_apps: MakeApps) -> Iterator[tuple[Flask, OutboxMail, OutboxControl]]:
    """A TESTING app in manual mode: nothing is delivered until ``deliver()``."""
    app, mail = make_apps(TESTING=True, OUTBOX_RETRY_BASE_SECONDS=BASE,
                          OUTBOX_RETRY_MAX_SECONDS=600.0, OUTBOX_MAX_ATTEMPTS=3)
    control = OutboxControl(app)
    with app.app_context():
        yield app, mail, control
    control.close()


def _send(mail: OutboxMail, to: str = "ann@example.com", subject: str = "hello",
          **options: Any) -> int:
    email_id = mail.send(Message(subject, recipients=[to], body="hi"), **options)
    db.session.commit()
    return email_id


def _row(app: Flask, email_id: int) -> dict[str, Any]:
    return next(row for row in rows(app) if row["id"] == email_id)


def _delivered(app: Flask) -> list[str]:
    """The subjects the memory transport took, in order."""
    transport = app.extensions["mail_outbox"].outbox().transports["default"]
    assert isinstance(transport, MemoryTransport)
    return [envelope.mime.split(b"Subject: ", 1)[1].split(b"\r\n", 1)[0].decode()
            for envelope in transport.outbox]


def _advance_to(control: OutboxControl, moment: datetime, *, by: float = 0.0) -> None:
    """Move the clock to ``moment`` + ``by`` seconds (real time keeps running on top)."""
    control.advance(max(0.0, (moment - control.clock.now()).total_seconds() + by))


@pytest.fixture
def failed_signals(kit: tuple[Flask, OutboxMail, OutboxControl]) -> Iterator[list[Any]]:
    app = kit[0]
    heard: list[Any] = []

    def on_failed(sender: Flask, **kwargs: Any) -> None:
        heard.append((kwargs["email_id"], kwargs["error"]))

    email_failed.connect(on_failed, app)
    yield heard
    email_failed.disconnect(on_failed, app)


# -- time -------------------------------------------------------------------------------

def test_send_after_goes_out_when_the_clock_reaches_it_and_not_a_second_before(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    email_id = _send(mail, send_after=timedelta(minutes=5))
    due_at = _row(app, email_id)["due_at"]
    assert control.deliver() == 0
    _advance_to(control, due_at, by=-1.0)
    assert control.deliver() == 0
    assert _row(app, email_id)["status"] == "queued"
    _advance_to(control, due_at)
    assert control.deliver() == 1
    assert _row(app, email_id)["status"] == "sent"
    assert _delivered(app) == ["hello"]


def test_send_after_counts_from_the_test_clock(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    # An hour on, a reminder five minutes out is due five minutes after *that*.
    app, mail, control = kit
    control.advance(3600)
    email_id = _send(mail, send_after=timedelta(minutes=5))
    control.advance(299)
    assert control.deliver() == 0
    control.advance(1)
    assert control.deliver() == 1
    assert _row(app, email_id)["status"] == "sent"


def test_expires_after_expires_unsent_once_the_clock_passes_it(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    short = _send(mail, subject="short", expires_after=timedelta(seconds=30))
    long = _send(mail, subject="long", expires_after=timedelta(seconds=120))
    control.advance(60)
    assert control.deliver() == 2
    assert (_row(app, short)["status"], _row(app, long)["status"]) == ("expired", "sent")
    assert _delivered(app) == ["long"]


def test_a_lease_that_runs_out_is_reaped_after_the_lease_and_not_before(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    email_id = _send(mail)
    outbox = app.extensions["mail_outbox"].outbox()
    lease = outbox.config.lease_seconds
    # A worker claims it and dies: the row stays sending under its lease.
    (claimed,) = outbox.store.leases.claim_ids([email_id], owner="dead:1:1:0",
                                               lease_seconds=lease)
    expires = _row(app, email_id)["lease_expires_at"]
    assert control.deliver() == 0
    _advance_to(control, expires, by=-1.0)
    assert control.deliver() == 0
    assert _row(app, email_id)["status"] == "sending"
    _advance_to(control, expires, by=1.0)
    assert control.deliver() == 1
    row = _row(app, email_id)
    assert (row["status"], row["attempts"]) == ("sent", 2)  # the lost attempt stays charged
    assert claimed.attempt == 1


def test_a_rate_limit_paces_on_the_clock_and_deliver_does_not_wait_for_its_slots(
        make_apps: MakeApps) -> None:
    # One email every 10 s: deliver() sends what the schedule allows now, and the
    # next once the clock has passed its slot (a real-time wait would take 10 s).
    # The row waiting for its slot keeps its lease across a jump past the lease
    # (30 s): it is sent once, not reaped and sent again.
    app, mail = make_apps(TESTING=True, OUTBOX_RATE_LIMIT=0.1, OUTBOX_LEASE_SECONDS=30)
    control = OutboxControl(app)
    try:
        with app.app_context():
            ids = [_send(mail, subject=f"n{n}") for n in range(3)]
            started = time.monotonic()
            counts = [control.deliver()]
            assert [_row(app, i)["status"] for i in ids] == ["sent", "sending", "queued"]
            for step in (9.0, 41.0, 100.0):
                control.advance(step)
                counts.append(control.deliver())
            assert time.monotonic() - started < 8
            assert counts == [1, 0, 2, 0]
            assert _delivered(app) == ["n0", "n1", "n2"]
            assert [_row(app, i)["attempts"] for i in ids] == [1, 1, 1]
    finally:
        control.close()


# -- failures ---------------------------------------------------------------------------

def test_a_transient_failure_is_retried_after_its_backoff_and_not_before(
        kit: tuple[Flask, OutboxMail, OutboxControl], failed_signals: list[Any]) -> None:
    app, mail, control = kit
    control.fail_next(to="ann@example.com")
    ann = _send(mail)
    bob = _send(mail, to="bob@example.com", subject="bob")
    assert control.deliver() == 2
    row = _row(app, ann)
    assert (row["status"], row["attempts"], _row(app, bob)["status"]) == ("queued", 1, "sent")
    assert row["last_error"].startswith("451 4.3.0")
    backoff = (row["due_at"] - control.clock.now()).total_seconds()
    assert BASE * 0.8 - 1 <= backoff <= BASE * 1.2  # the policy's first delay, jitter and all
    _advance_to(control, row["due_at"], by=-1.0)
    assert control.deliver() == 0
    assert _row(app, ann)["status"] == "queued"
    _advance_to(control, row["due_at"])
    assert control.deliver() == 1
    assert (_row(app, ann)["status"], _row(app, ann)["attempts"]) == ("sent", 2)
    assert _delivered(app) == ["bob", "hello"]
    assert failed_signals == []


def test_after_the_last_attempt_it_is_dead_lettered_and_email_failed_is_sent(
        kit: tuple[Flask, OutboxMail, OutboxControl], failed_signals: list[Any]) -> None:
    app, mail, control = kit
    control.fail_next(3, message="4.2.0 try later")  # OUTBOX_MAX_ATTEMPTS = 3
    email_id = _send(mail)
    statuses = []
    for _ in range(3):
        control.deliver()
        row = _row(app, email_id)
        statuses.append((row["status"], row["attempts"]))
        _advance_to(control, row["due_at"])
    assert statuses == [("queued", 1), ("queued", 2), ("failed", 3)]
    assert _row(app, email_id)["last_error"] == "451 4.2.0 try later"
    assert [(heard_id, type(error), error.code) for heard_id, error in failed_signals] \
        == [(email_id, TransientError, 451)]
    assert control.deliver() == 0  # a dead letter is not retried
    assert _delivered(app) == []


def test_a_permanent_failure_is_dead_lettered_at_once(
        kit: tuple[Flask, OutboxMail, OutboxControl], failed_signals: list[Any]) -> None:
    app, mail, control = kit
    control.fail_next(kind="permanent")
    email_id = _send(mail)
    assert control.deliver() == 1
    row = _row(app, email_id)
    assert (row["status"], row["attempts"]) == ("failed", 1)
    assert row["last_error"].startswith("550 5.7.1")
    assert [(heard_id, error.code) for heard_id, error in failed_signals] == [(email_id, 550)]


def test_a_throttle_defers_without_charging_an_attempt(
        kit: tuple[Flask, OutboxMail, OutboxControl], failed_signals: list[Any]) -> None:
    app, mail, control = kit
    control.fail_next(kind="throttle")
    email_id = _send(mail)
    assert control.deliver() == 1
    row = _row(app, email_id)
    assert (row["status"], row["attempts"]) == ("queued", 0)
    assert row["last_error"].startswith("421 4.7.0")
    assert '"deferred": true' in row["error_history"]
    _advance_to(control, row["due_at"], by=-1.0)
    assert control.deliver() == 0
    _advance_to(control, row["due_at"])
    assert control.deliver() == 1
    assert (_row(app, email_id)["status"], _row(app, email_id)["attempts"]) == ("sent", 1)
    assert failed_signals == []


def test_failures_are_scripted_per_address_in_order(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    control.fail_next(to="Bob@Example.com", kind="permanent")
    control.fail_next(kind="permanent")  # the next send of any address after that
    ann = _send(mail)
    bob = _send(mail, to="bob@example.com")
    carl = _send(mail, to="carl@example.com")
    control.deliver()
    assert [_row(app, i)["status"] for i in (ann, bob, carl)] == ["failed", "failed", "sent"]


# -- events -----------------------------------------------------------------------------

def test_a_simulated_hard_bounce_suppresses_the_address_and_sends_email_event(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    heard: list[DeliveryEvent] = []

    def on_event(sender: Flask, **kwargs: Any) -> None:
        heard.append(kwargs["event"])

    email_event.connect(on_event, app)
    try:
        first = _send(mail)
        control.deliver()
        soft = control.simulate_event(first, "soft_bounced")
        assert mail.suppression("ann@example.com") is None  # a soft bounce suppresses nothing
        event = control.simulate_event(first, "bounced", description="550 no such user")
    finally:
        email_event.disconnect(on_event, app)
    assert (event.event_type, event.bounce_kind, event.email_id, event.recipient) \
        == ("bounced", "permanent", first, "ann@example.com")
    assert [e.id for e in heard] == [soft.id, event.id]
    assert [e.event_type for e in mail.events(first)] == ["bounced", "bounced"]
    entry = mail.suppression("ann@example.com")
    assert entry is not None and entry.reason == "bounced"
    later = _send(mail, subject="later")
    assert control.deliver() == 1
    assert _row(app, later)["status"] == "suppressed"
    assert _delivered(app) == ["hello"]


@pytest.mark.parametrize(("kind", "reason"), [("complained", "complained"),
                                              ("unsubscribed", "unsubscribed"),
                                              ("delivered", None)])
def test_each_simulated_event_acts_as_the_providers_would(
        kit: tuple[Flask, OutboxMail, OutboxControl], kind: str, reason: str | None) -> None:
    _, mail, control = kit
    email_id = _send(mail)
    control.deliver()
    control.simulate_event(email_id, kind)
    entry = mail.suppression("ann@example.com")
    assert (entry.reason if entry is not None else None) == reason


# -- commits ----------------------------------------------------------------------------

def test_rolled_back_mail_is_never_delivered(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    mail.send(Message("rolled back", recipients=["ann@example.com"], body="x"))
    db.session.rollback()
    with db.session.begin_nested():
        mail.send(Message("kept", recipients=["ann@example.com"], body="x"))
    savepoint = db.session.begin_nested()
    mail.send(Message("savepoint rolled back", recipients=["ann@example.com"], body="x"))
    savepoint.rollback()
    db.session.commit()
    control.advance(3600)
    assert control.deliver() == 1
    assert _delivered(app) == ["kept"]
    assert [row["subject"] for row in rows(app)] == ["kept"]


def test_manual_mode_delivers_nothing_at_commit_and_inline_mode_does(
        make_apps: MakeApps) -> None:
    app, mail = make_apps(TESTING=True)
    for mode, at_commit in (("manual", []), ("inline", ["now"])):
        control = OutboxControl(app, mode=mode)
        try:
            with app.app_context():
                mail.send(Message("now", recipients=["ann@example.com"], body="x"))
                mail.send(Message("later", recipients=["ann@example.com"], body="x"),
                          send_after=timedelta(seconds=30))
                db.session.commit()
                assert _delivered(app) == at_commit
                assert not app.extensions["mail_outbox"].outbox().worker.running
                control.advance(30)
                control.deliver()
                assert sorted(_delivered(app)) == ["later", "now"]
        finally:
            control.close()
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM outbox_email"))


# -- bad use ----------------------------------------------------------------------------

def test_a_real_transport_is_refused_with_what_to_do(make_apps: MakeApps) -> None:
    app, _ = make_apps()  # MAIL_SUPPRESS_SEND False: SMTP
    with pytest.raises(TestKitError, match=r"real transport 'smtp' is configured.*"
                                           r"TESTING = True.*OUTBOX_TRANSPORT = 'memory'"):
        OutboxControl(app)
    assert app.extensions["mail_outbox"].clock is None  # nothing left behind


def test_a_mailbox_transport_is_refused_as_what_it_is(make_apps: MakeApps) -> None:
    # The example app's default: it sends nothing real, so "a real transport" and "tests
    # must not send real email" would send the user looking for the wrong mistake.
    app, _ = make_apps(OUTBOX_TRANSPORT="mailbox")
    with pytest.raises(TestKitError) as refused:
        OutboxControl(app)
    said = str(refused.value)
    assert "transport 'mailbox' is configured" in said and "real" not in said
    assert "TESTING = True" in said and "OUTBOX_TRANSPORT = 'memory'" in said


def test_bad_set_ups_are_refused(make_apps: MakeApps) -> None:
    app, _ = make_apps(TESTING=True)
    with pytest.raises(TestKitError, match=r"mode='auto'.*'inline', 'manual'"):
        OutboxControl(app, mode="auto")
    with pytest.raises(TestKitError, match="has no flask-mail-outbox"):
        OutboxControl(Flask("bare"))
    control = OutboxControl(app)
    with pytest.raises(TestKitError, match="under another test kit's control"):
        OutboxControl(app)
    control.close()
    control.close()  # idempotent
    with pytest.raises(TestKitError, match=r"deliver\(\): this control is closed"):
        control.deliver()
    assert app.extensions["mail_outbox"].clock is None
    OutboxControl(app).close()  # the app can be taken over again


def test_advance_refuses_to_go_back_or_to_move_under_a_running_delivery_thread(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, _, control = kit
    for bad in (-1, timedelta(seconds=-5), "soon"):
        with pytest.raises(TestKitError, match="only moves forward"):
            control.advance(bad)  # type: ignore[arg-type]
    assert control.clock.offset == timedelta(0)
    worker = app.extensions["mail_outbox"].outbox().worker
    worker.hand_ticked = False
    worker.start()  # a delivery loop in a thread of its own, as an app outside the kit runs
    try:
        assert worker.running
        with pytest.raises(TestKitError, match=r"advance\(60\): a delivery thread is running"):
            control.advance(60)
        with pytest.raises(TestKitError, match=r"deliver\(\): a delivery thread is running"):
            control.deliver()
    finally:
        worker.stop(5)
    assert control.clock.offset == timedelta(0)


def test_fail_next_and_simulate_event_name_what_is_wrong(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    _, mail, control = kit
    kinds = "'transient', 'permanent', 'throttle'"
    for kwargs, text in (({"kind": "bounce"}, f"kind must be one of {kinds}"),
                         ({"count": 0}, "count must be a whole number >= 1"),
                         ({"to": "nobody"}, "to must be an email address")):
        with pytest.raises(TestKitError, match=rf"fail_next\(\): {text}"):
            control.fail_next(**kwargs)
    queued = _send(mail)
    with pytest.raises(TestKitError, match=r"simulate_event\(999999, 'bounced'\): there is no "
                                           r"email 999999"):
        control.simulate_event(999999, "bounced")
    with pytest.raises(TestKitError, match=r"the kind is one of 'delivered', 'bounced', "
                                           r"'soft_bounced', 'complained', 'unsubscribed'"):
        control.simulate_event(queued, "opened")
    with pytest.raises(TestKitError, match=rf"email {queued} is 'queued', not sent.*deliver"):
        control.simulate_event(queued, "bounced")
    control.deliver()
    with pytest.raises(TestKitError, match="'bob@example.com' is not a recipient"):
        control.simulate_event(queued, "bounced", recipient="bob@example.com")
    assert mail.events(queued) == []  # nothing was recorded by the refused calls
