"""The counts of status, stats() and the dashboard's overview equal a real GROUP BY, always.

``queued``, ``sending`` and ``failed`` are counted row by row; ``sent``,
``suppressed``, ``expired`` and ``cancelled`` (and the sent-per-hour chart) are
running totals that triggers keep in ``outbox_tally`` (see
``flask_mail_outbox.core._models.OutboxTally``). Each test compares them with the
rows themselves after changes made by every path that changes a status: the
worker's record, suppression, expiry, cancel, retry, the sweep, purges, manual
SQL, and on PostgreSQL several processes and threads recording at once. Then the
repair: ``flask outbox status --recount``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, hand_ticked_worker, make_app
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import Status, email_table
from flask_mail_outbox.core._models import tally_table
from flask_mail_outbox.core._queries import counts, hourly_counts, recount_tally
from flask_mail_outbox.core._store import Store

EPOCH = datetime(1970, 1, 1)


@pytest.fixture
def durable(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    """Durable over SMTP, no dispatcher thread: the test ticks it."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_RETRY_BASE_SECONDS=60.0, OUTBOX_MAX_ATTEMPTS=1)
    hand_ticked_worker(app)
    yield app
    close_app(app, timeout=5)


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def store_of(app: Flask) -> Store:
    with app.app_context():
        store: Store = mail_of(app)._state().outbox().store
    return store


def queue(app: Flask, *recipients: str, **options: Any) -> list[int]:
    with app.app_context():
        ids = [mail_of(app).send(Message("Hello", [to], "Hi"), **options) for to in recipients]
        db.session.commit()
    return ids


def hour_number(at: datetime) -> int:
    return (at - EPOCH) // timedelta(hours=1)


def truth(engine: sa.Engine) -> tuple[dict[str, int], Counter[int]]:
    """Rows per status and ``sent`` rows per hour, counted from the rows themselves."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(email_table.c.status, email_table.c.sent_at)).all()
    per_status = {status.value: 0 for status in Status}
    per_status.update(Counter(status for status, _ in rows))
    per_hour = Counter(hour_number(sent_at) for status, sent_at in rows if status == "sent")
    return per_status, per_hour


def assert_exact(engine: sa.Engine, when: str) -> None:
    """The counts, the tally's hours and the chart all equal the rows, after ``when``."""
    per_status, per_hour = truth(engine)
    with engine.connect() as conn:
        assert counts(conn) == per_status, when
        hours = conn.execute(
            sa.select(tally_table.c.sent_hour, sa.func.sum(tally_table.c.n))
            .where(tally_table.c.status == "sent").group_by(tally_table.c.sent_hour)
            .having(sa.func.sum(tally_table.c.n) != 0)).all()
        # Whole hours, as the triggers write them (a REAL would start a second row).
        stored = conn.exec_driver_sql("SELECT DISTINCT sent_hour FROM outbox_tally"
                                      " WHERE sent_hour IS NOT NULL").scalars().all()
        chart = hourly_counts(conn, clock=lambda: datetime.now(UTC).replace(tzinfo=None))
    assert all(type(hour) is int for hour in stored), (when, stored)
    tallied = Counter({hour: int(n) for hour, n in hours})
    assert tallied == per_hour, when
    for hour in chart:
        assert hour.sent == per_hour.get(hour_number(hour.start), 0), (when, hour)


def run_sql(engine: sa.Engine, *statements: str, **params: Any) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement), params)


def test_every_path_that_changes_a_status_keeps_the_totals_exact(
        durable: Flask, smtp_server: FaultSMTPServer) -> None:
    store = store_of(durable)
    engine = store.engine
    mail = mail_of(durable)
    worker = hand_ticked_worker(durable)
    assert_exact(engine, "empty")

    queue(durable, "a@example.com", "b@example.com", "c@example.com", "d@example.com")
    assert_exact(engine, "send(): four queued")
    worker.tick()
    assert_exact(engine, "the worker's record: four sent")

    with durable.app_context():
        mail.suppress("gone@example.com")
    smtp_server.refuse_recipient("refused@example.com", 550)
    [late] = queue(durable, "late@example.com", expires_after=timedelta(hours=1))
    run_sql(engine, "UPDATE outbox_email SET expires_at = :past WHERE id = :id",
            past=datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=1), id=late)
    [refused] = queue(durable, "gone@example.com", "refused@example.com")[1:]
    [taken_back, kept] = queue(durable, "x@example.com", "y@example.com",
                               send_after=timedelta(hours=1))
    with durable.app_context():
        assert mail.cancel(taken_back) == 1
        db.session.commit()
    assert_exact(engine, "cancel()")
    worker.tick()
    per_status, _ = truth(engine)
    assert per_status["suppressed"] == per_status["expired"] == per_status["failed"] == 1
    assert_exact(engine, "suppressed, expired and dead-lettered by the worker")

    with durable.app_context():
        mail.retry(refused)
    assert_exact(engine, "a dead letter retried")
    smtp_server.reset_faults()
    worker.tick()
    assert_exact(engine, "the retried one sent")

    # The sweep: a stranded row (due long ago, never handed over).
    run_sql(engine, "UPDATE outbox_email SET due_at = created_at,"
                    " created_at = :long_ago WHERE id = :id",
            long_ago=datetime.now(UTC).replace(tzinfo=None) - timedelta(hours=2), id=kept)
    with durable.app_context():
        report = mail.sweep(min_age=60)
    assert report.scanned == 1  # durable: handed back to the dispatcher
    assert_exact(engine, "the sweep")
    worker.tick()
    assert truth(engine)[0]["queued"] == 0
    assert_exact(engine, "the swept one sent")

    # Retention: purge in batches, and delete dead letters.
    run_sql(engine, "UPDATE outbox_email SET sent_at = :then WHERE id IN"
                    " (SELECT id FROM outbox_email WHERE status = 'sent' ORDER BY id LIMIT 3)",
            then=datetime.now(UTC).replace(tzinfo=None) - timedelta(days=40))
    assert_exact(engine, "sent_at moved to another hour")
    assert store.admin.delete_sent(older_than=datetime.now(UTC).replace(tzinfo=None)
                             - timedelta(days=30), batch=2) == 2
    assert_exact(engine, "a purge batch")
    smtp_server.refuse_recipient("refused2@example.com", 550)
    queue(durable, "refused2@example.com")
    worker.tick()
    assert store.admin.delete_failed(older_than=None) == 1
    assert_exact(engine, "dead letters deleted")

    # Manual SQL: several rows and statuses in one statement, both ways, and inserts
    # of terminal rows in many hours at once.
    run_sql(engine, "UPDATE outbox_email SET status = CASE WHEN id % 2 = 0 THEN 'cancelled'"
                    " ELSE 'expired' END WHERE status IN ('sent', 'suppressed')")
    assert_exact(engine, "manual UPDATE of many rows")
    now = datetime.now(UTC).replace(tzinfo=None)
    for hours_ago in range(30):
        run_sql(engine, "INSERT INTO outbox_email (status, created_at, due_at, sent_at,"
                        " message_id, sender, recipients, size) VALUES"
                        " ('sent', :at, :at, :at, 'm', 's', '[]', 1),"
                        " ('sent', :at, :at, :at, 'm', 's', '[]', 1),"
                        " ('suppressed', :at, :at, NULL, 'm', 's', '[]', 1)",
                at=now - timedelta(hours=hours_ago, minutes=7))
    assert_exact(engine, "manual INSERT of terminal rows")
    run_sql(engine, "UPDATE outbox_email SET status = 'queued' WHERE status = 'cancelled'",
            "DELETE FROM outbox_email WHERE status = 'suppressed' AND id % 3 = 0")
    assert_exact(engine, "manual UPDATE and DELETE in one transaction")
    run_sql(engine, "DELETE FROM outbox_email")
    assert_exact(engine, "every row deleted")
    if engine.dialect.name == "postgresql":
        queue(durable, "z@example.com")
        worker.tick()
        run_sql(engine, "TRUNCATE outbox_email CASCADE")
        assert_exact(engine, "TRUNCATE")


def test_a_rolled_back_change_leaves_the_totals_as_they_were(durable: Flask) -> None:
    engine = store_of(durable).engine
    queue(durable, "a@example.com")
    hand_ticked_worker(durable).tick()
    with engine.connect() as conn, conn.begin() as tx:
        conn.execute(sa.text("UPDATE outbox_email SET status = 'cancelled'"))
        tx.rollback()
    assert_exact(engine, "rolled back")
    assert truth(engine)[0]["sent"] == 1


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_postgres_folds_the_appended_rows(
        backend: str, durable: Flask) -> None:
    """Each statement appends a row; every 64th folds each status and hour into one."""
    engine = store_of(durable).engine
    at = datetime.now(UTC).replace(tzinfo=None)
    run_sql(engine, "INSERT INTO outbox_email (status, created_at, due_at, message_id, sender,"
                    " recipients, size) SELECT 'queued', :at, :at, 'm', 's', '[]', 1"
                    " FROM generate_series(1, 300)", at=at)
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT id FROM outbox_email ORDER BY id")).scalars().all()
    for email_id in ids:  # 300 statements, each changing one row
        run_sql(engine, "UPDATE outbox_email SET status = 'sent', sent_at = :at WHERE id = :id",
                at=at, id=email_id)
    with engine.connect() as conn:
        kept = conn.execute(sa.text("SELECT count(*) FROM outbox_tally")).scalar_one()
    assert kept <= 64, kept  # not one per statement
    assert_exact(engine, "300 single-row updates")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_repeatable_read_transaction_is_never_failed_by_a_fold(
        backend: str, durable: Flask, isolation: str) -> None:
    """A caller's transaction (a cancel() joins it) may run at REPEATABLE READ: its
    snapshot can hold tally rows another fold deleted since, so it never folds."""
    engine = store_of(durable).engine
    at = datetime.now(UTC).replace(tzinfo=None)
    run_sql(engine, "INSERT INTO outbox_email (status, created_at, due_at, message_id, sender,"
                    " recipients, size) SELECT 'queued', :at, :at, 'm', 's', '[]', 1"
                    " FROM generate_series(1, 200)", at=at)
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT id FROM outbox_email ORDER BY id")).scalars().all()
    run_sql(engine, "UPDATE outbox_email SET status = 'cancelled' WHERE id = :id", id=ids[0])
    with engine.connect().execution_options(isolation_level=isolation) as caller:
        caller.begin()
        caller.execute(sa.text("SELECT count(*) FROM outbox_tally")).one()  # its snapshot
        # Others append and fold (every 64th appended row) and commit meanwhile...
        for email_id in ids[1:100]:
            run_sql(engine, "UPDATE outbox_email SET status = 'cancelled' WHERE id = :id",
                    id=email_id)
        with engine.connect() as conn:
            last = conn.execute(sa.text("SELECT max(id) FROM outbox_tally")).scalar_one()
        # ...and the caller's own change appends the row a fold would start at.
        run_sql(engine, f"SELECT setval(pg_get_serial_sequence('outbox_tally', 'id'),"
                        f" {(last // 64 + 1) * 64 - 1})")
        caller.execute(sa.text("UPDATE outbox_email SET status = 'cancelled' WHERE id = :id"),
                       {"id": ids[150]})
        caller.commit()
    assert_exact(engine, f"a {isolation} change at a fold's turn")


def test_concurrent_transactions_never_deadlock_and_count_right(
        backend: str, durable: Flask) -> None:
    """Threads, each with its own connection (a PostgreSQL backend process), change
    their own rows through every tallied status in random orders, several statements
    per transaction, as workers recording, cancels and purges do at once."""
    engine = store_of(durable).engine
    threads, per_thread, rounds = (6, 40, 60) if backend == "postgresql" else (3, 20, 20)
    at = datetime.now(UTC).replace(tzinfo=None)
    with engine.begin() as conn:
        conn.execute(email_table.insert(), [
            {"status": "queued", "created_at": at, "due_at": at, "message_id": f"m{i}",
             "sender": "s", "recipients": "[]", "size": 1}
            for i in range(threads * per_thread)])
        ids = conn.execute(sa.select(email_table.c.id).order_by(email_table.c.id)
                           ).scalars().all()
    statuses = ["queued", "sending", "sent", "failed", "suppressed", "expired", "cancelled"]
    errors: list[BaseException] = []

    def work(mine: list[int], seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(rounds):
                with engine.begin() as conn:
                    for _ in range(rng.randint(1, 3)):
                        chosen = rng.sample(mine, rng.randint(1, len(mine) // 2))
                        status = rng.choice(statuses)
                        sent_at = at - timedelta(hours=rng.randint(0, 3))
                        conn.execute(email_table.update().where(email_table.c.id.in_(chosen))
                                     .values(status=status, sent_at=sent_at))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(ids[n::threads], n)) for n in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert errors == []
    assert_exact(engine, "concurrent transactions")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_worker_processes_recording_at_once_keep_the_totals_exact(
        backend: str, tmp_path: Any, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """Three ``flask outbox worker`` processes drain 600 emails while this process cancels
    some and purges sent ones: the totals equal the rows, and no process logged an ERROR
    (a deadlock would be one)."""
    from test_workers import FAST, Worker

    producer = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                        OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    workers: list[Worker] = []
    try:
        total = 600
        with producer.app_context():
            mail = mail_of(producer)
            for i in range(total):
                mail.send(Message(f"bulk {i}", [f"r{i % 40}@example.com"], "x"),
                          send_after=timedelta(hours=1) if i % 10 == 0 else None)
            db.session.commit()
        workers = [Worker(name, tmp_path, db_url, smtp_server.port, 4, FAST)
                   for name in ("w1", "w2", "w3")]
        engine = store_of(producer).engine
        with producer.app_context():  # while the workers record
            assert mail.cancel(list(range(1, total + 1, 20))) == total // 20
            db.session.commit()
        held = total // 10 - total // 20  # the delayed ones not cancelled
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # purges in small batches, as the workers record
            store_of(producer).admin.delete_sent(
                older_than=datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=1),
                batch=7)
            per_status, _ = truth(engine)
            if per_status["queued"] == held and per_status["sending"] == 0:
                break
            for worker in workers:
                assert worker.proc.poll() is None, worker.log()[-3000:]
            time.sleep(0.05)
        else:
            pytest.fail(f"not drained within 120 s: {truth(engine)[0]}")
        for worker in workers:
            worker.kill()
        assert_exact(engine, "three workers, cancels and purges")
        for worker in workers:
            assert " ERROR " not in worker.log(), worker.log()[-4000:]
    finally:
        for worker in workers:
            worker.kill()
        close_app(producer, timeout=5)


# -- the repair ---------------------------------------------------------------------------


def recount(app: Flask, *options: str) -> Any:
    result = app.test_cli_runner().invoke(args=["outbox", "status", "--recount", *options])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("damage", [
    "DELETE FROM outbox_tally",
    "UPDATE outbox_tally SET n = n + 5 WHERE status = 'sent'",
    "INSERT INTO outbox_tally (status, sent_hour, n) VALUES ('cancelled', NULL, -2)",
])
def test_recount_repairs_totals_that_drifted_and_says_which(
        durable: Flask, damage: str) -> None:
    engine = store_of(durable).engine
    queue(durable, "a@example.com", "b@example.com")
    hand_ticked_worker(durable).tick()
    [taken_back] = queue(durable, "c@example.com", send_after=timedelta(hours=1))
    with durable.app_context():
        mail_of(durable).cancel(taken_back)
        db.session.commit()
    assert_exact(engine, "before the damage")
    run_sql(engine, damage)
    with engine.connect() as conn:
        drifted = counts(conn)
    right, _ = truth(engine)
    assert drifted != right

    printed = json.loads(recount(durable, "--json"))
    assert printed["recounted"] == {status: right[status] - drifted[status]
                                    for status in right if right[status] != drifted[status]}
    assert printed["counts"] == right
    assert_exact(engine, "after --recount")
    assert "recount: every running total was right" in recount(durable)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_recount_while_workers_record_counts_each_change_once(
        backend: str, durable: Flask) -> None:
    """The recount's delete and count see one snapshot: a change committed while it
    runs is counted by its trigger's row, never twice nor not at all."""
    engine = store_of(durable).engine
    at = datetime.now(UTC).replace(tzinfo=None)
    with engine.begin() as conn:
        conn.execute(email_table.insert(), [
            {"status": "queued", "created_at": at, "due_at": at, "message_id": f"m{i}",
             "sender": "s", "recipients": "[]", "size": 1} for i in range(400)])
    stop = threading.Event()
    errors: list[BaseException] = []

    recorder_engine = sa.create_engine(engine.url)

    def record() -> None:
        try:
            while not stop.is_set():
                run_sql(recorder_engine, "UPDATE outbox_email SET status = 'sent', sent_at = :at WHERE id"
                                " = (SELECT min(id) FROM outbox_email WHERE status = 'queued')",
                        at=at)
        except BaseException as exc:
            errors.append(exc)

    recorder = threading.Thread(target=record)
    recorder.start()
    try:
        store = store_of(durable)
        reports = []
        for _ in range(15):
            with store.write() as conn:
                reports.append(recount_tally(conn))
    finally:
        stop.set()
        recorder.join()
        recorder_engine.dispose()
    assert errors == []
    assert_exact(engine, "recounts during changes")
    # The totals were right all along: no recount may report a correction (what it
    # kept and what it counted come from one snapshot, not two reads around writes).
    assert reports == [{}] * 15, reports


def test_status_text_says_which_counts_are_running_totals(durable: Flask) -> None:
    result = durable.test_cli_runner().invoke(args=["outbox", "status"])
    assert result.exit_code == 0, result.output
    assert ("  (sent, suppressed, expired, cancelled: running totals kept by the database;"
            " --recount rebuilds them)") in result.output.splitlines()



def test_create_all_on_a_database_an_older_create_all_made_adds_and_fills_the_tally(
        db_url: str) -> None:
    """Development databases made by ``create_all`` before the tally existed get it,
    with its triggers and the rows already there, from the next ``create_all``."""
    from flask_mail_outbox.core._models import metadata

    engine = sa.create_engine(db_url)
    try:
        metadata.create_all(engine, tables=[table for table in metadata.sorted_tables
                                            if table is not tally_table])
        at = datetime(2026, 12, 1, 10, 30)
        with engine.begin() as conn:
            conn.execute(email_table.insert(), [
                {"status": status, "created_at": at, "due_at": at, "message_id": "m",
                 "sender": "s", "recipients": "[]", "size": 1,
                 "sent_at": at if status == "sent" else None}
                for status in ["sent", "sent", "cancelled", "queued", "expired"]])
        metadata.create_all(engine)
        assert_exact(engine, "create_all added the tally")
        run_sql(engine, "UPDATE outbox_email SET status = 'sent', sent_at = :at"
                        " WHERE status = 'queued'", at=at)
        assert_exact(engine, "and its triggers")
        assert truth(engine)[0]["sent"] == 3
    finally:
        metadata.drop_all(engine)
        engine.dispose()
