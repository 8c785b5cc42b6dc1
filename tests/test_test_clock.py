"""The core's one injectable clock: ``Outbox(..., clock=TestClock())``.

With a :class:`~flask_mail_outbox.core.TestClock` every "now" of the core is
the clock's, on both databases: the claim, the record, the inserts' stamps,
leases, the worker's deadlines. On PostgreSQL the SQL binds the clock's value
where the database's ``now()`` stands otherwise, and only then: without a
test clock the statements are exactly production's (checked here both on the
compiled text and on what a real cycle runs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, poll, rows
from flask import Flask
from sqlalchemy.orm import Session

from flask_mail_outbox import Message
from flask_mail_outbox.core import (
    Outbox,
    Producer,
    TestClock,
    _claim,
    email_table,
    load_config,
    metadata,
    prepare_row,
)
from flask_mail_outbox.core._clock import utcnow
from flask_mail_outbox.core._dialect import (
    POSTGRES,
    POSTGRES_ON_CLOCK,
    SQLITE,
    _pg_insert_rows,
)
from flask_mail_outbox.core._store import Store
from flask_mail_outbox.testing._control import OutboxControl
from flask_mail_outbox.transports import MemoryTransport

#: What reads a database's own clock in SQL (PostgreSQL's now(), SQLite's and the
#: standard's CURRENT_TIMESTAMP and friends).
DATABASE_CLOCK = re.compile(r"\bnow\(\)|current_timestamp|current_date|localtimestamp"
                            r"|clock_timestamp|statement_timestamp|datetime\('now'", re.IGNORECASE)


# -- the clock itself ------------------------------------------------------------------

def test_a_test_clock_is_the_real_clocks_plus_an_offset_that_only_grows() -> None:
    clock = TestClock()
    assert clock.offset == timedelta(0)
    clock.advance(90)
    clock.advance(timedelta(minutes=1))
    assert clock.offset == timedelta(seconds=150)
    assert repr(clock) == "TestClock(offset=0:02:30)"
    ahead = (clock.now() - utcnow()).total_seconds()
    assert 149.9 < ahead <= 150.0
    assert 149.9 < clock.monotonic() - time.monotonic() <= 150.0
    assert 149.9 < clock.wall() - time.time() <= 150.0
    for bad in (-1, timedelta(seconds=-1), float("nan"), float("inf")):
        with pytest.raises(ValueError, match="only moves forward"):
            clock.advance(bad)
    with pytest.raises(TypeError, match="expected seconds"):
        clock.advance("5")  # type: ignore[arg-type]
    assert clock.offset == timedelta(seconds=150)  # nothing moved


def test_an_outbox_takes_only_a_test_clock() -> None:
    with pytest.raises(TypeError, match="expected a TestClock or None, got function"):
        Outbox("sqlite:///unused.db", load_config({}, instance_path="/x", testing=True),
               clock=lambda: 0.0)  # type: ignore[arg-type]


# -- production SQL unchanged ------------------------------------------------------------

def _pg(statement: Any) -> str:
    from sqlalchemy.dialects import postgresql
    return str(statement.compile(dialect=postgresql.dialect()))  # type: ignore[no-untyped-call]


def test_without_a_test_clock_postgresql_runs_exactly_the_statements_it_ran_before() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never connects
    real = Store(engine)
    on_clock = Store(engine, clock=TestClock().now, clock_in_sql=True)
    assert real.dialect is POSTGRES and real.dialect.database_clock
    assert on_clock.dialect is POSTGRES_ON_CLOCK and not on_clock.dialect.database_clock
    assert SQLITE.on_clock() is SQLITE
    # The claim: the database's clock, unbound; on a test clock, a bound value and no now().
    for production, clocked in ((_claim.PG_CLAIM, _claim.PG_CLAIM_ON_CLOCK),
                                (_claim.PG_CLAIM_AND_REAP, _claim.PG_CLAIM_AND_REAP_ON_CLOCK)):
        text: str = getattr(production.element, "text")  # noqa: B009 - typed as abstract
        clocked_text: str = getattr(clocked.element, "text")  # noqa: B009
        assert text.count(_claim.PG_NOW) >= 2
        assert ":claim_now" not in text
        assert not DATABASE_CLOCK.search(clocked_text)
        assert clocked_text.replace("CAST(:claim_now AS timestamp)", _claim.PG_NOW) == text
    # "now" as SQL, the due predicate, leases.
    assert _pg(real.now_expr()).endswith(", now())")
    assert "now()" in _pg(real.dialect.claimable(real.now_expr))
    assert "now()" in _pg(real.later_expr(30))
    for expression in (on_clock.now_expr(), on_clock.later_expr(30),
                       on_clock.dialect.claimable(on_clock.now_expr)):
        assert not DATABASE_CLOCK.search(_pg(expression))
    # The multi-row insert: created_at and due_at the database's, or the clock's stamps.
    columns = ("sender", "due_at")
    production_insert = _pg_insert_rows(engine.dialect, columns, False).text
    assert "coalesce(u.due_at, timezone('UTC', now()))" in production_insert
    assert "created_at) SELECT" in production_insert
    stamped = _pg_insert_rows(engine.dialect, (*columns, "created_at"), False,
                              stamped=True).text
    assert not DATABASE_CLOCK.search(stamped)
    engine.dispose()


@pytest.fixture
def statements(make_apps: MakeApps) -> Iterator[tuple[Flask, list[str]]]:
    """A TESTING app, and every statement any engine (the app's, the outbox's) runs."""
    app, _ = make_apps(TESTING=True)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        yield app, seen
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def _cycle(app: Flask, control: OutboxControl | None) -> None:
    """Send, fail once, retry, deliver, bounce, suppress: what reads "now" in SQL."""
    mail = app.extensions["test_mail"]
    with app.app_context():
        if control is not None:
            control.fail_next(to="ann@example.com")
        mail.send(Message("now", recipients=["ann@example.com"], body="x"))
        mail.send(Message("later", recipients=["bob@example.com"], body="x"),
                  send_after=timedelta(seconds=30), key="k", expires_after=timedelta(hours=1))
        db.session.commit()
        if control is None:
            return
        control.deliver()
        control.advance(31)
        control.deliver()
        sent = [row["id"] for row in rows(app) if row["status"] == "sent"]
        control.simulate_event(sent[0], "bounced")
        mail.sweep(min_age=0)


def test_with_a_test_clock_no_statement_reads_the_database_clock(
        statements: tuple[Flask, list[str]], backend: str) -> None:
    app, seen = statements
    control = OutboxControl(app)
    try:
        _cycle(app, control)
    finally:
        control.close()
    assert [row["status"] for row in rows(app)] == ["sent", "sent"]
    claims = [s for s in seen if "lease_owner" in s and "UPDATE" in s.upper()]
    assert claims, "the capture saw no claim"
    assert [s for s in seen if DATABASE_CLOCK.search(s)] == []


def test_without_a_test_clock_postgresql_reads_its_own_clock(
        statements: tuple[Flask, list[str]], backend: str) -> None:
    # The capture above sees what it should: production's claim reads now() on
    # PostgreSQL; SQLite's "now" is the caller's clock with or without a test clock.
    app, seen = statements
    _cycle(app, None)
    with app.app_context():
        assert app.extensions["test_mail"].wait_idle(10)
    claims = [s for s in seen if "lease_owner" in s and "UPDATE" in s.upper()]
    assert claims
    if backend == "postgresql":
        assert all("now()" in s for s in claims)
    else:
        assert [s for s in seen if DATABASE_CLOCK.search(s)] == []


# -- the core on a test clock, without Flask ---------------------------------------------

def test_a_core_on_a_test_clock_claims_and_leases_on_it(db_url: str) -> None:
    clock = TestClock()
    config = load_config({"MAIL_DEFAULT_SENDER": "shop@example.com",
                          "OUTBOX_LEASE_SECONDS": 60}, instance_path="/x", testing=True)
    outbox = Outbox(db_url, config, transports={"default": MemoryTransport()}, clock=clock)
    try:
        metadata.create_all(outbox.engine)
        clock.advance(3600)  # an hour ahead of the real clocks, and of the database's
        row = prepare_row(Message("n", recipients=["ann@example.com"], body="hi"), config,
                          key=None, due_at=clock.now() + timedelta(seconds=60),
                          now=clock.now())
        assert not row.due_now
        producer = Producer(outbox)
        with Session(outbox.engine) as session, session.begin():
            (ticket,) = producer.enqueue(session, [row])
        leases = outbox.store.leases
        assert leases.claim_due(10, owner="o:1", lease_seconds=60)[0] == []
        clock.advance(59)
        assert leases.claim_due(10, owner="o:1", lease_seconds=60)[0] == []
        clock.advance(1)
        (claimed,), _ = leases.claim_due(10, owner="o:1", lease_seconds=60)
        assert claimed.id == ticket.email_id
        with outbox.engine.connect() as conn:
            stored = conn.execute(sa.select(email_table.c.created_at,
                                            email_table.c.lease_expires_at)).one()
        # Stamped on the clock (an hour ahead), not on the database's.
        assert abs((stored.created_at - (clock.now() - timedelta(seconds=60)))
                   .total_seconds()) < 5
        assert abs((stored.lease_expires_at - (clock.now() + timedelta(seconds=60)))
                   .total_seconds()) < 5
        # Not reaped before the lease runs out; reaped once it has.
        assert len(leases.reap_expired()) == 0
        clock.advance(61)
        assert leases.reap_expired().requeued == (ticket.email_id,)
    finally:
        outbox.stop(5)


def test_a_running_worker_takes_a_scheduled_email_when_the_clock_reaches_it(
        db_url: str) -> None:
    # The worker's own thread (inline mode): its deadlines are on the clock, and an
    # advance wakes it to look at them again.
    clock = TestClock()
    config = load_config({"MAIL_DEFAULT_SENDER": "shop@example.com"}, instance_path="/x",
                         testing=True)
    transport = MemoryTransport()
    outbox = Outbox(db_url, config, transports={"default": transport}, clock=clock)
    try:
        metadata.create_all(outbox.engine)
        row = prepare_row(Message("n", recipients=["ann@example.com"], body="hi"), config,
                          key=None, due_at=clock.now() + timedelta(seconds=60),
                          now=clock.now())
        producer = Producer(outbox)
        with Session(outbox.engine) as session:
            with session.begin():
                tickets = producer.enqueue(session, [row])
                producer.before_commit(session, tickets)
            producer.after_commit(tickets)
        assert outbox.worker.running
        time.sleep(0.3)  # the loop waits for its deadline, a minute ahead
        clock.advance(59)
        time.sleep(0.5)
        assert transport.outbox == []
        clock.advance(1)
        assert len(poll(lambda: list(transport.outbox), timeout=5)) == 1
    finally:
        outbox.stop(5)
