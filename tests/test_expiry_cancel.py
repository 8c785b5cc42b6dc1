"""Mail that can expire or be taken back.

``send(..., expires_after=...)``: a row not delivered by then ends in the
terminal status ``expired`` (not attempted again, not dead-lettered; INFO).
``mail.cancel(...)`` moves queued rows to ``cancelled`` in the caller's
transaction; a row already ``sending`` is not cancelled. Both pass the same
gate a claim passes (a compare-and-set on ``status = 'queued'``), so a row is
sent or cancelled, never both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, hand_ticked_worker, make_app, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core import Status, email_table
from flask_mail_outbox.core._leases import Outcome


@pytest.fixture
def durable(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    """Durable over SMTP, no dispatcher thread: the test ticks it (a minute's retry base)."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_RETRY_BASE_SECONDS=60.0)
    hand_ticked_worker(app)
    yield app
    close_app(app, timeout=5)


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def queue(app: Flask, *messages: Message, **options: Any) -> list[int]:
    with app.app_context():
        ids = [mail_of(app).send(m, **options) for m in messages]
        db.session.commit()
    return ids


def status_of(app: Flask) -> dict[int, str]:
    return {r["id"]: r["status"] for r in rows(app)}


def tick(app: Flask) -> None:
    hand_ticked_worker(app).tick()


def hello(to: str = "a@example.com", subject: str = "Hello") -> Message:
    return Message(subject, [to], "Hi")


# -- expiry --------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "problem"), [
    ({"expires_after": timedelta(0)}, "positive"),
    ({"expires_after": timedelta(seconds=-5)}, "positive"),
    ({"expires_after": datetime.now(UTC) - timedelta(seconds=1)}, "never be sent"),
    ({"expires_after": timedelta(hours=1), "send_after": timedelta(hours=2)}, "send_after"),
    ({"expires_after": "1h"}, "datetime or timedelta"),
])
def test_an_expiry_that_cannot_be_met_is_refused(durable: Flask, options: dict[str, Any],
                                                 problem: str) -> None:
    with durable.app_context():
        with pytest.raises(InvalidMessage) as caught:
            mail_of(durable).send(hello(), **options)
        assert caught.value.field == "expires_after" and problem in caught.value.problem
        with pytest.raises(InvalidMessage):
            mail_of(durable).send_many([hello()], **options)
        db.session.commit()
    assert rows(durable) == []


def test_a_row_claimed_after_its_expiry_ends_expired_unsent(
        durable: Flask, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    [late, fine] = queue(durable, hello(subject="late"), hello(subject="fine"),
                         expires_after=timedelta(hours=1))
    with durable.app_context(), db.engine.begin() as conn:  # an hour passes for "late"
        conn.execute(email_table.update().where(email_table.c.id == late)
                     .values(expires_at=datetime.now(UTC).replace(tzinfo=None)
                             - timedelta(seconds=1)))
    with caplog.at_level(logging.INFO):
        tick(durable)
    assert status_of(durable) == {late: "expired", fine: "sent"}
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["fine"]
    row = next(r for r in rows(durable) if r["id"] == late)
    assert row["attempts"] == 0 and "expired at" in row["last_error"]
    assert any(r.levelno == logging.INFO and f"Email {late}" in r.getMessage()
               for r in caplog.records)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)
    with durable.app_context():
        assert mail_of(durable).stats()["counts"]["expired"] == 1
        assert mail_of(durable).dead_letters() == []


def test_a_retry_that_would_come_after_the_expiry_ends_it_at_once(
        durable: Flask, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 Try again later")
    [email_id] = queue(durable, hello(), expires_after=timedelta(seconds=30))
    tick(durable)  # fails; the next try would be in a minute, past the expiry
    row = rows(durable)[0]
    assert (row["id"], row["status"], row["attempts"]) == (email_id, "expired", 1)
    assert "before its next attempt" in row["last_error"] and "451" in row["last_error"]


def test_a_retry_within_the_expiry_is_queued_as_usual(
        durable: Flask, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 Try again later", times=1)
    queue(durable, hello(), expires_after=timedelta(hours=1))
    tick(durable)
    assert rows(durable)[0]["status"] == "queued"


def test_send_many_expires_every_row(durable: Flask) -> None:
    with durable.app_context():
        ids = mail_of(durable).send_many([hello(), hello("b@example.com")],
                                         expires_after=timedelta(minutes=5))
        db.session.commit()
    expiries = {r["expires_at"] for r in rows(durable) if r["id"] in ids}
    assert len(expiries) == 1 and None not in expiries


# -- cancel --------------------------------------------------------------------------------


def test_cancel_commits_with_the_caller_and_nothing_is_sent(
        durable: Flask, smtp_server: FaultSMTPServer) -> None:
    [first, second] = queue(durable, hello(subject="one"), hello(subject="two"))
    with durable.app_context():
        assert mail_of(durable).cancel(first) == 1
        db.session.commit()
    tick(durable)
    assert status_of(durable) == {first: "cancelled", second: "sent"}
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["two"]


def test_a_rolled_back_cancel_cancels_nothing(durable: Flask,
                                              caplog: pytest.LogCaptureFixture) -> None:
    [email_id] = queue(durable, hello())
    with caplog.at_level(logging.INFO), durable.app_context():
        assert mail_of(durable).cancel(email_id) == 1
        db.session.rollback()
    assert status_of(durable) == {email_id: "queued"}
    assert any("Rollback undid the cancel" in r.getMessage() for r in caplog.records)


def test_a_forgotten_commit_of_a_cancel_is_an_error(durable: Flask,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    [email_id] = queue(durable, hello())
    with durable.app_context():
        mail_of(durable).cancel(email_id)
        db.session.close()
    assert status_of(durable) == {email_id: "queued"}
    assert any(r.levelno == logging.ERROR and "cancel of 1 email" in r.getMessage()
               for r in caplog.records)


def test_a_row_being_sent_is_not_cancelled(durable: Flask) -> None:
    [email_id] = queue(durable, hello())
    store = durable.extensions["mail_outbox"].outbox().store
    [claimed] = store.leases.claim_ids([email_id], owner="test-owner", lease_seconds=60)
    with durable.app_context():
        assert mail_of(durable).cancel(email_id) == 0
        db.session.commit()
    assert status_of(durable) == {email_id: "sending"}
    store.leases.record([Outcome(claimed, Status.SENT)])
    assert status_of(durable) == {email_id: "sent"}


def test_cancel_by_key_by_idempotency_key_and_a_delayed_row(durable: Flask) -> None:
    with durable.app_context():
        mail = mail_of(durable)
        keyed = [mail.send(hello(subject=f"k{i}"), key="user-7") for i in range(3)]
        later = mail.send(hello(subject="later"), send_after=timedelta(days=3))
        once = mail.send(hello(subject="once"), idempotency_key="reminder-42")
        db.session.commit()
        assert mail.cancel(key="user-7") == 3
        assert mail.cancel(later) == 1
        assert mail.cancel(idempotency_key="reminder-42") == 1
        assert mail.cancel(idempotency_key="nothing") == 0
        assert mail.cancel([]) == 0
        db.session.commit()
    assert set(status_of(durable).values()) == {"cancelled"}
    assert len(status_of(durable)) == len(keyed) + 2
    del once


def test_cancelling_a_keys_head_lets_the_next_one_go(
        durable: Flask, smtp_server: FaultSMTPServer) -> None:
    [head, second, third] = queue(durable, *(hello(subject=s) for s in ("1", "2", "3")),
                                  key="order-9")
    with durable.app_context():
        assert mail_of(durable).cancel(head) == 1
        db.session.commit()
    for _ in range(3):
        tick(durable)
    assert status_of(durable) == {head: "cancelled", second: "sent", third: "sent"}
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["2", "3"]


@pytest.mark.parametrize(("args", "kwargs"), [
    ((), {}),
    ((1,), {"key": "k"}),
    ((), {"key": "k", "idempotency_key": "i"}),
    (("1",), {}),
    ((True,), {}),
    (([1, "2"],), {}),
])
def test_cancel_takes_exactly_one_way_of_naming_emails(durable: Flask, args: tuple[Any, ...],
                                                       kwargs: dict[str, Any]) -> None:
    with durable.app_context(), pytest.raises(TypeError):
        mail_of(durable).cancel(*args, **kwargs)


def test_cli_cancel(durable: Flask) -> None:
    [first, second, keyed] = queue(durable, hello(), hello())[:2] + \
        queue(durable, hello(), key="k")
    runner = durable.test_cli_runner()
    result = runner.invoke(args=["outbox", "cancel", str(first), str(second)])
    assert result.exit_code == 0 and "2 email(s) cancelled" in result.output
    result = runner.invoke(args=["outbox", "cancel", "--key", "k"])
    assert result.exit_code == 0 and "1 email(s) cancelled" in result.output
    result = runner.invoke(args=["outbox", "cancel", str(first)])
    assert result.exit_code == 1 and "nothing cancelled" in result.output
    result = runner.invoke(args=["outbox", "cancel"])
    assert result.exit_code == 2
    assert set(status_of(durable).values()) == {"cancelled"}
    del keyed


# -- the gate, under concurrency -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_racing_claim_and_cancel_never_both_win(durable: Flask) -> None:
    """300 rounds: a claim (a worker's compare-and-set) against a cancel committing."""
    store = durable.extensions["mail_outbox"].outbox().store
    outcomes: dict[str, int] = {"sent": 0, "cancelled": 0}
    for round_number in range(300):
        [email_id] = queue(durable, hello(subject=f"r{round_number}"))
        barrier = threading.Barrier(2)
        got: dict[str, Any] = {}

        def claim() -> None:
            barrier.wait()
            got["claimed"] = store.leases.claim_ids([email_id], owner=f"w{round_number}",
                                             lease_seconds=60)

        def take_back() -> None:
            with durable.app_context():
                barrier.wait()
                got["cancelled"] = mail_of(durable).cancel(email_id)
                db.session.commit()

        threads = [threading.Thread(target=claim), threading.Thread(target=take_back)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        if got["claimed"]:
            store.leases.record([Outcome(got["claimed"][0], Status.SENT)])
        with durable.app_context(), db.engine.connect() as conn:
            status = conn.execute(sa.select(email_table.c.status)
                                  .where(email_table.c.id == email_id)).scalar_one()
        assert bool(got["claimed"]) != bool(got["cancelled"]), (round_number, got)
        assert status == ("sent" if got["claimed"] else "cancelled")
        outcomes[status] += 1
    # Both sides won some rounds: the race was real.
    assert outcomes["sent"] and outcomes["cancelled"], outcomes


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_two_workers_racing_expiries_send_or_expire_each_row_once(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    """Two dispatchers (two apps, as two processes would be) over rows expiring as they go."""
    apps = [make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                     OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                     OUTBOX_BATCH_SIZE=10) for _ in range(2)]
    try:
        workers = [hand_ticked_worker(app) for app in apps]
        ids = queue(apps[0], *(hello(f"r{i}@example.com", f"row {i}") for i in range(200)),
                    expires_after=timedelta(hours=1))
        # Half the rows expire now-ish, spread over the next 200 ms, while both tick.
        with apps[0].app_context(), db.engine.begin() as conn:
            now = datetime.now(UTC).replace(tzinfo=None)
            for index, email_id in enumerate(ids[::2]):
                conn.execute(email_table.update().where(email_table.c.id == email_id)
                             .values(expires_at=now + timedelta(milliseconds=index * 2)))

        def drain(worker: Any) -> None:
            for _ in range(60):
                worker.tick()
                if all(s != "queued" for s in status_of(apps[0]).values()):
                    return

        threads = [threading.Thread(target=drain, args=(worker,)) for worker in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        final = {r["id"]: r for r in rows(apps[0])}
        received = [m.message_id for m in smtp_server.messages]
        assert len(received) == len(set(received))  # nothing sent twice
        by_message_id = {r["message_id"]: r for r in final.values()}
        for message_id in received:
            assert by_message_id[message_id]["status"] == "sent"
        statuses = [r["status"] for r in final.values()]
        assert set(statuses) <= {"sent", "expired"}
        assert statuses.count("sent") == len(received)
        assert statuses.count("expired") > 0 and statuses.count("sent") >= 100
    finally:
        for app in apps:
            close_app(app, timeout=5)


def test_a_row_paced_by_a_rate_limit_past_its_expiry_ends_unsent(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    """A claimed row waiting (minutes, at "100/day") for a rate slot is checked again when
    its slot comes: here the slot comes after its expiry."""
    import dataclasses
    import time

    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_RATE_LIMIT=1.0)
    try:
        worker = hand_ticked_worker(app)
        [email_id] = queue(app, hello(subject="late"), expires_after=timedelta(hours=1))
        store = app.extensions["mail_outbox"].outbox().store
        [claimed] = store.leases.claim_ids([email_id], owner="paced-test", lease_seconds=60)
        # Held for its slot while its expiry passes (as a long rate wait would).
        claimed = dataclasses.replace(
            claimed, expires_at=datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=1))
        lane = worker.lanes.lanes["default"]
        worker._in_flight[email_id] = claimed
        lane.paced.append((time.monotonic(), claimed))
        worker._send_paced()
        worker._record()
        assert status_of(app) == {email_id: "expired"}
        assert smtp_server.messages == []
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)  # row locks
@pytest.mark.parametrize("ending", ["commit", "rollback", "failed request"])
def test_a_cancel_held_open_never_makes_delivery_wait(durable: Flask,
                                                      smtp_server: FaultSMTPServer,
                                                      ending: str) -> None:
    """A request that cancelled a key's next email and has not committed yet holds its row:
    the record of the key's head must not wait for it (leases would run out meanwhile);
    the key goes on when that request ends, whichever way. A request that raises after its
    cancel ends with neither a commit nor a rollback of its own (Flask-SQLAlchemy closes the
    session): the cancel is undone, and the key goes on at once, not at a key repair."""
    [head, second, third] = queue(durable, *(hello(subject=s) for s in ("1", "2", "3")),
                                  key="order-7")
    cancelled = threading.Event()
    finish = threading.Event()
    statuses: list[int] = []

    def cancel_and_wait() -> None:
        mail_of(durable).cancel(second)
        cancelled.set()
        finish.wait(60)

    @durable.route("/cancel-then-fail")
    def cancel_then_fail() -> str:
        cancel_and_wait()
        raise RuntimeError("the view fails after its cancel")

    durable.config["PROPAGATE_EXCEPTIONS"] = False

    def request() -> None:
        if ending == "failed request":
            statuses.append(durable.test_client().get("/cancel-then-fail").status_code)
            return
        with durable.app_context():
            cancel_and_wait()
            if ending == "commit":
                db.session.commit()
            else:
                db.session.rollback()

    holder = threading.Thread(target=request)
    holder.start()
    try:
        assert cancelled.wait(20)
        ticking = threading.Thread(target=tick, args=(durable,))
        ticking.start()
        ticking.join(30)
        assert not ticking.is_alive(), "the record waited for the request's transaction"
        assert status_of(durable)[head] == "sent"
    finally:
        finish.set()
        holder.join(30)
    assert statuses == ([500] if ending == "failed request" else [])
    for _ in range(3):
        tick(durable)
    expected = {head: "sent", second: "cancelled" if ending == "commit" else "sent",
                third: "sent"}
    assert status_of(durable) == expected
