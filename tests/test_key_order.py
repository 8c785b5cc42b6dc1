"""Per-key order under races and repairs: promotion, claim follow-up, retry.

Every interleaving here is made deterministic with a real PostgreSQL lock or a
real statement error, never a timed window.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import db, poll, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail, _degrade
from flask_mail_outbox._models import Status
from flask_mail_outbox._store import Outcome

LOCK_CALL = "pg_try_advisory_xact_lock(hashtextextended(k.key, 0))"


@pytest.fixture
def app(hand_ticked_app: Flask) -> Flask:
    """Durable, no dispatcher thread: the test ticks the dispatcher by hand."""
    return hand_ticked_app


def _dispatcher(app: Flask) -> Any:
    return app.extensions["mail_outbox"].runtime().ensure_dispatcher(start_thread=False)


def _step(app: Flask) -> None:
    _dispatcher(app).step(wait=lambda deadline: None)


def _send(app: Flask, subject: str, key: str | None = "k") -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        email_id = mail.send(Message(subject, recipients=["a@example.com"], body="x"), key=key)
        db.session.commit()
    return int(email_id)


class _Rewrite:
    """Rewrites matching statements on their way to the database while active."""

    def __init__(self, needle: str, replacement: str, *, prefix: str = "") -> None:
        self.needle, self.replacement, self.prefix, self.hits = needle, replacement, prefix, 0

    def __call__(self, conn: Any, cursor: Any, statement: str, params: Any,
                 context: Any, executemany: bool) -> tuple[str, Any]:
        if self.needle in statement and statement.startswith(self.prefix):
            self.hits += 1
            statement = statement.replace(self.needle, self.replacement)
        return statement, params

    def __enter__(self) -> _Rewrite:
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", self, retval=True)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", self)


WAITING_LOCK_CALL = "outbox_test_waiting_lock(hashtextextended(k.key, 0))"


class _ProducerMidSend:
    """A request in the middle of ``send(key="k")`` ... ``commit()``, holding the key's lock.

    :meth:`commit_when_a_lock_waits` lets it commit as soon as some other
    transaction waits for an advisory lock: with :data:`LOCK_CALL` rewritten
    to :data:`WAITING_LOCK_CALL`, delivery's try-lock waits for the producer,
    so the lock is granted only after the producer committed, as when it
    commits in that instant.
    """

    def __init__(self, app: Flask, db_url: str) -> None:
        self.engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
        with self.engine.connect() as conn:
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION outbox_test_waiting_lock(k bigint) RETURNS boolean"
                " LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_xact_lock(k); RETURN true;"
                " END $$")
        mail: OutboxMail = app.extensions["test_mail"]
        inserted, self._commit = threading.Event(), threading.Event()

        def produce() -> None:
            with app.app_context():
                mail.send(Message("next", recipients=["a@example.com"], body="x"), key="k")
                inserted.set()
                self._commit.wait(30)
                db.session.commit()

        self._thread = threading.Thread(target=produce)
        self._thread.start()
        assert inserted.wait(10)
        self._watcher: threading.Thread | None = None

    def commit_when_a_lock_waits(self) -> None:
        def release() -> None:
            with self.engine.connect() as conn:
                poll(lambda: conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND NOT granted").scalar(), timeout=30, interval=0.02)
            self._commit.set()

        self._watcher = threading.Thread(target=release)
        self._watcher.start()

    def join(self) -> None:
        if self._watcher is not None:
            self._watcher.join()
        self._thread.join()
        self.engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_producer_committing_while_the_promotion_takes_its_lock_is_promoted(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    _send(app, "head")
    producer = _ProducerMidSend(app, db_url)
    _step(app)  # "head" is sent; its key's lock is busy, so the promotion is put off
    store = _dispatcher(app).store
    assert "k" in store._unpromoted
    producer.commit_when_a_lock_waits()
    with _Rewrite(LOCK_CALL, WAITING_LOCK_CALL) as rw:
        _step(app)  # the put-off promotion runs; the producer commits while it waits
    producer.join()
    assert rw.hits >= 1
    for _ in range(2):
        _step(app)
    assert [(r["subject"], r["status"]) for r in rows(app)] == [
        ("head", "sent"), ("next", "sent")]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_producer_committing_while_the_record_takes_its_lock_is_handed_the_key(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """The record tries its keys' locks in its first statement (see Store._record_sent).

    Made to wait there until a producer of the key commits, the promotion (a
    later statement) still sees the producer's email and makes it the head at
    once, claimed for the next batch (see HandOn): nothing is put off.
    """
    _send(app, "head")
    producer = _ProducerMidSend(app, db_url)
    producer.commit_when_a_lock_waits()
    with _Rewrite(LOCK_CALL, WAITING_LOCK_CALL, prefix="WITH locks") as rw:
        _step(app)  # "head" is sent; its record waits for the key until "next" commits
    producer.join()
    assert rw.hits == 1
    store = _dispatcher(app).store
    assert "k" not in store._unpromoted
    assert [(r["subject"], r["status"], r["key_head"]) for r in rows(app)] == [
        ("head", "sent", True), ("next", "sending", True)]
    _step(app)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["head", "next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_failed_promotion_after_the_claim_keeps_the_batch(
        app: Flask, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    for subject in ("m1", "m2"):
        _send(app, subject, key=None)
    store = _dispatcher(app).store
    with store._unpromoted_lock:
        store._unpromoted.add("ghost")  # a put-off promotion: the claim's follow-up runs
    # A real statement error from the database in the follow-up promotion:
    # its statement of locks alone. The prefix is needed: recording the batch
    # runs a statement whose text holds the same lock call (with no keys here).
    with caplog.at_level(logging.ERROR), _Rewrite(LOCK_CALL, "1/0 = 1",
                                                  prefix="SELECT k.key") as rw:
        _step(app)
    assert rw.hits == 1
    assert [(r["subject"], r["status"]) for r in rows(app)] == [("m1", "sent"), ("m2", "sent")]
    assert "ghost" in store._unpromoted
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("Handing ordering keys on" in message for message in errors), errors


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_retry_all_takes_a_bounded_number_of_key_locks_per_transaction(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 554, "5.6.0 rejected", times=5)
    for i in range(5):
        _send(app, f"m{i}", key=f"k{i}")
    _step(app)
    assert [r["status"] for r in rows(app)] == ["failed"] * 5
    watch = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    held: list[int] = []

    def count_locks(*args: Any) -> None:
        with watch.connect() as conn:
            held.append(int(conn.exec_driver_sql(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())").scalar() or 0))

    store = _dispatcher(app).store
    sa.event.listen(store.engine, "before_cursor_execute", count_locks)
    try:
        assert len(store.retry_all_failed(keys_per_transaction=2)) == 5
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", count_locks)
    watch.dispose()
    assert max(held) == 2
    assert [(r["status"], r["key_head"]) for r in rows(app)] == [("queued", True)] * 5


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_statement_timeout_is_not_an_unreachable_database(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        conn.exec_driver_sql("SET statement_timeout = 50")
        with pytest.raises(sa.exc.OperationalError) as timeout:
            conn.exec_driver_sql("SELECT pg_sleep(5)")
    assert getattr(timeout.value.orig, "sqlstate", None) == "57014"
    assert not _degrade.database_unreachable(timeout.value)
    with engine.connect() as conn, engine.connect() as other:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        other.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid or 0)})")
        with pytest.raises(sa.exc.DBAPIError) as cut:
            conn.exec_driver_sql("SELECT 1")
    assert _degrade.database_unreachable(cut.value)
    engine.dispose()


@pytest.mark.parametrize("retry_all", [False, True])
def test_a_dead_letter_put_back_goes_before_a_queued_head(
        app: Flask, smtp_server: FaultSMTPServer, retry_all: bool) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    smtp_server.reply("data", 554, "5.6.0 rejected", times=1)
    first = _send(app, "first")
    for subject in ("second", "third"):
        _send(app, subject)
    # A head that waits queued (the dispatcher would otherwise claim it as it
    # hands the key on, a head being sent: the next test).
    _dispatcher(app).hand_on = False
    _step(app)  # "first" is dead-lettered and hands the key to "second"
    assert [(r["status"], r["key_head"]) for r in rows(app)] == [
        ("failed", True), ("queued", True), ("queued", False)]
    with app.app_context():
        if retry_all:
            assert mail.retry_all() == 1
        else:
            mail.retry(first)
    # Id order: "second" has not started, so "first" is the key's head again.
    assert [(r["status"], bool(r["key_head"])) for r in rows(app)] == [
        ("queued", True), ("queued", False), ("queued", False)]
    for _ in range(3):
        _step(app)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["first", "second", "third"]


@pytest.mark.parametrize("then", ["sent", "queued again", "reaped"])
def test_a_dead_letter_put_back_below_a_sending_head_goes_next(
        app: Flask, smtp_server: FaultSMTPServer, then: str) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    smtp_server.reply("data", 554, "5.6.0 rejected", times=1)
    first = _send(app, "first")
    for subject in ("second", "third", "fourth"):
        _send(app, subject)
    _dispatcher(app).hand_on = False  # the test claims "second" itself
    _step(app)  # "first" is dead-lettered and hands the key to "second"
    store = _dispatcher(app).store
    # "second" is being sent (a lease of 0 s when the reap is to take it back).
    [second] = store.claim_due(10, owner="test-owner",
                               lease_seconds=0 if then == "reaped" else 60)[0]
    with app.app_context():
        mail.retry(first)
    # It waits for the head being sent: never two of one key at once.
    assert [(r["status"], bool(r["key_head"])) for r in rows(app)][0] == ("queued", False)
    assert store.heal_key_heads() == 0  # the sweep's repair agrees: the key is occupied
    if then == "sent":
        store.record([Outcome(second, Status.SENT)])
    elif then == "queued again":
        store.record([Outcome(second, Status.QUEUED, error_code=421, error_message="busy")])
    if then != "reaped":
        # Id order: the one put back goes next, not "third".
        assert [(r["subject"], r["status"], bool(r["key_head"])) for r in rows(app)][0::2] == [
            ("first", "queued", True), ("third", "queued", False)]
    # One tick more than there are emails: a dispatcher that just claimed
    # reaps at its next idle tick (or a second later), not at once.
    for _ in range(6):
        _step(app)
    assert [r["status"] for r in rows(app)] == ["sent"] * 4
    sent = [m.parsed["Subject"] for m in smtp_server.messages]
    assert sent == (["first", "third", "fourth"] if then == "sent"
                    else ["first", "second", "third", "fourth"])


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_tick_that_only_promotes_a_put_off_key_ticks_again_at_once(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    for subject in ("a", "b"):
        _send(app, subject)
    engine = sa.create_engine(db_url)
    with engine.connect() as producer:  # a request holding the key's lock
        producer.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtextextended('k', 0))")
        _step(app)  # "a" is sent; handing "k" on is put off
        producer.commit()
    engine.dispose()
    assert [(r["status"], bool(r["key_head"])) for r in rows(app)] == [
        ("sent", True), ("queued", False)]
    # This tick claims nothing; its claim hands "k" on to "b", which is due now.
    assert _dispatcher(app).step(wait=lambda deadline: None) == 0.0
    _step(app)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["a", "b"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_cut_dispatcher_connection_is_replaced_without_an_error(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    _step(app)  # opens the dispatcher's kept connection
    dispatcher = _dispatcher(app)
    pid = dispatcher._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})").scalar()
    engine.dispose()
    _send(app, "after the cut", key=None)
    checked_out = dispatcher.store.engine.pool.checkedout()
    with caplog.at_level(logging.INFO):
        _step(app)
    assert [r["status"] for r in rows(app)] == ["sent"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("claiming again on a new one" in r.getMessage() for r in caplog.records)
    assert dispatcher.store.engine.pool.checkedout() == checked_out
