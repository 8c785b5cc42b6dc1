"""Retention, purge and OUTBOX_SCRUB_SENT cover the emails that ended unsent.

``suppressed``, ``expired`` and ``cancelled`` rows are as final as ``sent``
ones: they record ``ended_at`` when they end, ``OUTBOX_RETENTION_DAYS`` and
``flask outbox purge`` delete them by it (in the partial index
``ix_outbox_email_ended_at``), ``OUTBOX_SCRUB_SENT`` drops their MIME, and the
running totals of the overview follow the deletes. ``queued``, ``sending`` and
``failed`` rows are never touched, however old. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, hand_ticked_worker, make_app, query_plan, rows
from flask import Flask
from smtpserver import FaultSMTPServer
from sqlalchemy import event as sa_event

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._flask.scheduler import SweepScheduler
from flask_mail_outbox.core import Status, email_table, event_table
from flask_mail_outbox.core._queries import counts
from flask_mail_outbox.core._store import Store

ENDED = ("suppressed", "expired", "cancelled")


def utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def make(db_url: str, smtp_server: FaultSMTPServer, **config: Any) -> Flask:
    """Durable over SMTP, no dispatcher thread: the test ticks it."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_MAX_ATTEMPTS=1, **config)
    hand_ticked_worker(app)
    return app


@pytest.fixture
def app(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    app = make(db_url, smtp_server)
    yield app
    close_app(app, timeout=5)


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def store_of(app: Flask) -> Store:
    with app.app_context():
        store: Store = mail_of(app)._state().outbox().store
    return store


def queue(app: Flask, to: str, **options: Any) -> int:
    with app.app_context():
        email_id = mail_of(app).send(Message("Hello", [to], "Hi"), **options)
        db.session.commit()
    return int(email_id)


def end_one_of_each(app: Flask, smtp_server: FaultSMTPServer, tag: str) -> dict[str, int]:
    """One row per terminal status, ended by the paths the library has; their ids."""
    mail = mail_of(app)
    engine = store_of(app).engine
    with app.app_context():
        mail.suppress(f"gone-{tag}@example.com")
    smtp_server.refuse_recipient(f"refused-{tag}@example.com", 550)
    ids = {"suppressed": queue(app, f"gone-{tag}@example.com"),
           "expired": queue(app, f"late-{tag}@example.com", expires_after=timedelta(hours=1)),
           "cancelled": queue(app, f"x-{tag}@example.com", send_after=timedelta(hours=1)),
           "sent": queue(app, f"ok-{tag}@example.com"),
           "failed": queue(app, f"refused-{tag}@example.com")}
    with engine.begin() as conn:
        conn.execute(email_table.update().where(email_table.c.id == ids["expired"])
                     .values(expires_at=utc_now() - timedelta(seconds=1)))
    with app.app_context():
        assert mail.cancel(ids["cancelled"]) == 1
        db.session.commit()
    hand_ticked_worker(app).tick()
    by_id = {row["id"]: row for row in rows(app)}
    assert {status: by_id[i]["status"] for status, i in ids.items()} == {s: s for s in ids}
    return ids


def make_old(app: Flask, ids: list[int], days: float) -> None:
    """Every timestamp of rows ``ids`` moved ``days`` back (a row ended or sent long ago)."""
    then = utc_now() - timedelta(days=days)
    t = email_table
    with store_of(app).engine.begin() as conn:
        conn.execute(t.update().where(t.c.id.in_(ids)).values(
            created_at=then, due_at=then, sent_at=sa.case((t.c.sent_at.is_(None), sa.null()),
                                                          else_=then),
            failed_at=sa.case((t.c.failed_at.is_(None), sa.null()), else_=then),
            ended_at=sa.case((t.c.ended_at.is_(None), sa.null()), else_=then)))


def assert_counts_exact(app: Flask, when: str) -> dict[str, int]:
    """The overview's counts (running totals for the terminal statuses) equal the rows."""
    engine = store_of(app).engine
    with engine.connect() as conn:
        actual = {status.value: 0 for status in Status}
        actual.update(Counter(conn.execute(sa.select(email_table.c.status)).scalars()))
        assert counts(conn) == actual, when
    return actual


def open_rows(app: Flask) -> dict[str, int]:
    """A queued and a sending row, both as old as can be."""
    store = store_of(app)
    queued = queue(app, "waiting@example.com", send_after=timedelta(hours=1))
    sending = queue(app, "busy@example.com", send_after=timedelta(hours=1))
    with store.write() as conn:
        conn.execute(email_table.update().where(email_table.c.id == sending)
                     .values(due_at=store.now_expr()))
    assert store.leases.claim_ids([sending], owner="t", lease_seconds=3600)
    return {"queued": queued, "sending": sending}


def test_each_ended_status_records_when_it_ended(
        app: Flask, smtp_server: FaultSMTPServer) -> None:
    before = utc_now() - timedelta(minutes=5)
    ids = end_one_of_each(app, smtp_server, "a")
    by_id = {row["id"]: row for row in rows(app)}
    for status in ENDED:
        ended_at = by_id[ids[status]]["ended_at"]
        assert ended_at is not None and before <= ended_at <= utc_now() + timedelta(minutes=5), \
            (status, ended_at)
    assert by_id[ids["sent"]]["ended_at"] is None and by_id[ids["failed"]]["ended_at"] is None


def test_retention_deletes_old_ended_rows_and_keeps_young_and_open_ones(
        app: Flask, smtp_server: FaultSMTPServer) -> None:
    old = end_one_of_each(app, smtp_server, "old")
    young = end_one_of_each(app, smtp_server, "young")
    still = open_rows(app)
    make_old(app, [*old.values(), *still.values()], days=40)
    before = assert_counts_exact(app, "before retention")
    assert before["suppressed"] == before["expired"] == before["cancelled"] == 2

    state = app.extensions["mail_outbox"]
    retention = SweepScheduler(state.outbox, state.config, state.faults, deployment=None)
    retention._purge_retained(30)

    left = {row["id"]: row["status"] for row in rows(app)}
    for status in ENDED:
        assert old[status] not in left, status
        assert left[young[status]] == status
    assert old["sent"] not in left  # as before
    assert left[old["failed"]] == "failed"  # dead letters are `dlq purge`'s
    assert left[still["queued"]] == "queued" and left[still["sending"]] == "sending"
    after = assert_counts_exact(app, "after retention")
    assert after["suppressed"] == after["expired"] == after["cancelled"] == 1
    assert after["queued"] == after["sending"] == 1 and after["failed"] == 2


def test_purge_takes_them_and_says_how_many(
        app: Flask, smtp_server: FaultSMTPServer) -> None:
    old = end_one_of_each(app, smtp_server, "old")
    young = end_one_of_each(app, smtp_server, "young")
    still = open_rows(app)
    make_old(app, [*old.values(), *still.values()], days=40)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "purge", "--older-than", "30", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "1 sent and 3 suppressed, expired or cancelled email(s)" in result.output
    assert len(rows(app)) == 12
    result = runner.invoke(args=["outbox", "purge", "--older-than", "30", "--yes",
                                 "--batch", "2"])
    assert result.exit_code == 0, result.output
    assert "deleted 1 sent and 3 suppressed, expired or cancelled email(s)" in result.output
    left = {row["id"]: row["status"] for row in rows(app)}
    assert sorted(left) == sorted([*young.values(), old["failed"], *still.values()])
    assert_counts_exact(app, "after the purge")


@pytest.mark.parametrize("scrub", [True, False])
def test_scrub_sent_drops_the_mime_of_ended_rows(
        db_url: str, smtp_server: FaultSMTPServer, scrub: bool) -> None:
    """Never sent, and never to be: the outbox is done with them as with a sent one."""
    app = make(db_url, smtp_server, OUTBOX_SCRUB_SENT=scrub)
    try:
        ids = end_one_of_each(app, smtp_server, "s")
        by_id = {row["id"]: row for row in rows(app)}
        for status in ("sent", *ENDED):
            assert (by_id[ids[status]]["mime"] is None) is scrub, status
        assert by_id[ids["failed"]]["mime"]  # a dead letter keeps its body: it can be retried
    finally:
        close_app(app, timeout=5)


def test_the_retention_queries_read_their_partial_indexes(
        app: Flask, smtp_server: FaultSMTPServer) -> None:
    """Bounded on a million rows: the oldest rows, straight from their partial index.

    Ended rows by ``ix_outbox_email_ended_at``, sent ones by
    ``ix_outbox_email_sent_at``: the deleting batch and the purge's count.
    """
    store = store_of(app)
    end_one_of_each(app, smtp_server, "p")
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "_at < " in statement:
            captured.append((statement, parameters))

    cutoff = utc_now() - timedelta(days=30)
    sa_event.listen(store.engine, "before_cursor_execute", capture)
    try:
        store.admin.delete_ended(older_than=cutoff, batch=1000)
        store.admin.delete_sent(older_than=cutoff, batch=1000)
        with app.app_context():
            reader = mail_of(app)._state().outbox().reader
            reader.count_ended_before(cutoff)
            reader.count_sent_before(cutoff)
    finally:
        sa_event.remove(store.engine, "before_cursor_execute", capture)
    assert len(captured) == 4, captured
    for statement, parameters in captured:
        index = "ix_outbox_email_ended_at" if "ended_at <" in statement \
            else "ix_outbox_email_sent_at"
        plan = query_plan(store.engine, statement, parameters)
        assert index in plan, plan
        assert "Seq Scan" not in plan and "TEMP B-TREE" not in plan, plan


def _unmatched_event(app: Flask, provider_event_id: str, days_ago: float) -> None:
    """A delivery event about no email of this outbox (an unknown webhook, a stray bounce)."""
    when = utc_now() - timedelta(days=days_ago)
    with app.app_context():
        db.session.execute(event_table.insert().values(
            email_id=None, transport="default", provider_event_id=provider_event_id,
            event_type="bounced", bounce_kind="permanent", reason="user_unknown",
            recipient="gone@example.com", occurred_at=when, received_at=when))
        db.session.commit()


def _event_ids(app: Flask) -> list[str]:
    with app.app_context():
        return sorted(db.session.execute(sa.select(event_table.c.provider_event_id)).scalars())


@pytest.mark.parametrize("via", ["retention", "purge"])
def test_events_matched_to_no_email_are_deleted_too_after_the_soft_bounce_window(
        app: Flask, via: str) -> None:
    """They have no email to go with: without this they stayed for ever."""
    _unmatched_event(app, "old", days_ago=40)
    _unmatched_event(app, "in-retention", days_ago=5)
    _unmatched_event(app, "in-window", days_ago=2)  # the soft-bounce window (7 days) counts it
    _unmatched_event(app, "ten-days", days_ago=10)
    if via == "retention":
        state = app.extensions["mail_outbox"]
        SweepScheduler(state.outbox, state.config, state.faults,
                       deployment=None)._purge_retained(30)
        assert _event_ids(app) == ["in-retention", "in-window", "ten-days"]
        # A retention shorter than the soft-bounce window keeps what the window counts.
        SweepScheduler(state.outbox, state.config, state.faults,
                       deployment=None)._purge_retained(1)
        assert _event_ids(app) == ["in-retention", "in-window"]
    else:
        result = app.test_cli_runner().invoke(
            args=["outbox", "purge", "--older-than", "30", "--yes", "--batch", "1"])
        assert result.exit_code == 0, result.output
        assert "and 1 delivery event(s) matched to no email" in result.output
        assert _event_ids(app) == ["in-retention", "in-window", "ten-days"]
