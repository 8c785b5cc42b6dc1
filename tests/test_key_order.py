"""Per-key order under races and repairs: hand-on, producers' commits, retry, reap.

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
from flask_mail_outbox.core import Status
from flask_mail_outbox.core._dialect import TALLY_LOCK
from flask_mail_outbox.core._leases import Outcome


@pytest.fixture
def app(hand_ticked_app: Flask) -> Flask:
    """Durable, no dispatcher thread: the test ticks the dispatcher by hand."""
    return hand_ticked_app


def _dispatcher(app: Flask) -> Any:
    return app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)


def _step(app: Flask) -> None:
    _dispatcher(app).tick()


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


class _ProducerMidSend:
    """A request that sent an email of key "k" and has not committed yet.

    ``pause="before commit"``: it waits before ``commit()``, holding the key's
    producer lock. ``pause="in commit"``: it waits inside ``commit()``, after
    its ``before_commit`` hand-on ran, holding the key's line lock. Either way
    :meth:`commit_when_a_lock_waits` lets it go on as soon as another
    transaction waits for an advisory lock (a recorder waiting for the line
    lock), or :meth:`go` at once.
    """

    def __init__(self, app: Flask, db_url: str, *, pause: str) -> None:
        self.engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
        mail: OutboxMail = app.extensions["test_mail"]
        self.paused, self._go = threading.Event(), threading.Event()

        def wait_inside_commit(session: Any) -> None:
            self.paused.set()
            self._go.wait(30)

        def produce() -> None:
            with app.app_context():
                session = db.session()
                mail.send(Message("next", recipients=["a@example.com"], body="x"), key="k")
                if pause == "before commit":
                    self.paused.set()
                    self._go.wait(30)
                else:  # runs after the extension's own before_commit listener
                    sa.event.listen(session, "before_commit", wait_inside_commit)
                try:
                    db.session.commit()
                finally:
                    if pause != "before commit":
                        sa.event.remove(session, "before_commit", wait_inside_commit)

        self._thread = threading.Thread(target=produce)
        self._thread.start()
        self._watcher: threading.Thread | None = None

    def go(self) -> None:
        self._go.set()

    def commit_when_a_lock_waits(self) -> None:
        def release() -> None:
            with self.engine.connect() as conn:
                poll(lambda: conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND NOT granted").scalar(), timeout=30, interval=0.02)
            self._go.set()

        self._watcher = threading.Thread(target=release)
        self._watcher.start()

    def join(self) -> None:
        if self._watcher is not None:
            self._watcher.join()
        self._thread.join()
        self.engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_producer_that_commits_after_the_record_hands_itself_the_key(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """The record cannot see the producer's email; the producer's commit sees the
    record's, and makes its own email the holder (the hand-on at before_commit)."""
    _send(app, "head")
    producer = _ProducerMidSend(app, db_url, pause="before commit")
    assert producer.paused.wait(10)
    _step(app)  # "head" is sent; its key has no open email the record can see
    assert [(r["subject"], r["status"], r["key_head"]) for r in rows(app)] == [
        ("head", "sent", True)]
    producer.go()
    producer.join()
    assert [(r["subject"], r["status"], r["key_head"]) for r in rows(app)] == [
        ("head", "sent", True), ("next", "queued", True)]
    _step(app)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["head", "next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_record_that_waits_for_a_committing_producer_hands_it_the_key(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """The producer's hand-on ran while "head" was open (it changed nothing) and
    holds the line lock: the record waits for the commit, then sees "next"."""
    _send(app, "head")
    producer = _ProducerMidSend(app, db_url, pause="in commit")
    assert producer.paused.wait(10)
    producer.commit_when_a_lock_waits()
    _step(app)  # "head" is sent; its record waits for the key's line lock
    producer.join()
    assert [(r["subject"], r["status"], r["key_head"]) for r in rows(app)] == [
        ("head", "sent", True), ("next", "queued", True)]
    _step(app)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["head", "next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_failed_ordering_after_a_reap_keeps_the_batch(
        app: Flask, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    """The PostgreSQL claim reaps in its own statement; ordering the reaped rows'
    keys comes after it committed, and its failure loses nothing."""
    orphan = _send(app, "orphan")
    store = _dispatcher(app).store
    assert [e.id for e in store.leases.claim_due(1, owner="dead", lease_seconds=0)[0]] == [orphan]
    for subject in ("m1", "m2"):
        _send(app, subject, key=None)
    # A real statement error from the database in that follow-up.
    with caplog.at_level(logging.ERROR), _Rewrite(
            "SET key_head = (e.id = c.lowest)", "SET key_head = (1/0 = 1)",
            prefix="WITH c AS") as rw:
        _step(app)
    assert rw.hits == 1
    assert [(r["subject"], r["status"]) for r in rows(app)] == [
        ("orphan", "queued"), ("m1", "sent"), ("m2", "sent")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("Could not order the keys of 1 reaped email" in m for m in errors), errors
    _step(app)  # the reaped holder kept its flag: it goes
    assert [r["status"] for r in rows(app)] == ["sent"] * 3


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
                " WHERE datname = current_database())"
                # Not the tally's fold lock (a try-lock its trigger may take).
                f" AND NOT (classid = {TALLY_LOCK[0]} AND objid = {TALLY_LOCK[1]}"
                " AND objsubid = 2)").scalar() or 0))

    store = _dispatcher(app).store
    sa.event.listen(store.engine, "before_cursor_execute", count_locks)
    try:
        assert len(store.admin.retry_all_failed(keys_per_transaction=2)) == 5
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", count_locks)
    watch.dispose()
    # Two keys per transaction, each with its producer lock and its line lock.
    assert max(held) == 2 * 2
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
    _step(app)  # "first" is dead-lettered and hands the key to "second"
    store = _dispatcher(app).store
    # "second" is being sent (a lease of 0 s when the reap is to take it back).
    [second] = store.leases.claim_due(10, owner="test-owner",
                               lease_seconds=0 if then == "reaped" else 60)[0]
    with app.app_context():
        mail.retry(first)
    # It waits for the head being sent: never two of one key at once.
    assert [(r["status"], bool(r["key_head"])) for r in rows(app)][0] == ("queued", False)
    assert store.sweep.heal_key_heads() == 0  # the sweep's repair agrees: the key is occupied
    if then == "sent":
        store.leases.record([Outcome(second, Status.SENT)])
    elif then == "queued again":
        store.leases.record([Outcome(second, Status.QUEUED, error_code=421, error_message="busy")])
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
def test_a_cut_dispatcher_connection_is_replaced_without_an_error(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    _step(app)  # opens the dispatcher's kept connection
    dispatcher = _dispatcher(app)
    pid = dispatcher._claims.connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
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
    # The cut connection went back invalidated, not leaked: what is checked out
    # now is the new claim connection and the record's kept one, opened by this step.
    assert dispatcher.store.engine.pool.checkedout() == checked_out + 1
    assert dispatcher._writes.connection is not None


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_cut_record_connection_is_replaced_without_an_error(
        app: Flask, db_url: str, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    """The worker's kept write connection (records, claims of handed ids) is
    found cut at its next use: the record goes once more on a new one."""
    _send(app, "before the cut", key=None)
    _step(app)  # records on the kept write connection
    dispatcher = _dispatcher(app)
    pid = dispatcher._writes.connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    dispatcher._writes.connection.rollback()
    engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})").scalar()
    engine.dispose()
    _send(app, "after the cut", key=None)
    with caplog.at_level(logging.INFO):
        _step(app)
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("recording again on a new one" in r.getMessage() for r in caplog.records)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["before the cut",
                                                                    "after the cut"]
