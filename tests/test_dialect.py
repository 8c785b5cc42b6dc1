"""The SQL dialects in one module: each database's strategy, and nobody else asking which it is.

``flask_mail_outbox.core._dialect`` holds a strategy per database (PostgreSQL,
SQLite) for what differs between them. The checker below keeps every other
module of the package from testing which database it is on; the rest runs each
strategy on its real database (the ``db_url`` fixture: SQLite and PostgreSQL).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_mail_outbox import ConfigError
from flask_mail_outbox.core import Status, email_table, metadata
from flask_mail_outbox.core._dialect import Postgres, SQLite, dialect_named
from flask_mail_outbox.core._leases import Outcome
from flask_mail_outbox.core._models import setting_table
from flask_mail_outbox.core._store import Store

PACKAGE = Path(__file__).resolve().parent.parent / "flask_mail_outbox"

#: A line that asks which database it is on, or builds one database's statement.
BRANCH = re.compile(
    r"is_postgres|is_sqlite|dialect\.name|get_backend_name\(\)|(==|!=|in) *\(?\"(postgresql|sqlite)\""
    r"|\bsqlite=|postgresql\.insert|sqlite\.insert|\bpg\.insert|sqlalchemy\.dialects")

#: Where a line may do so: the dialect module, and the frozen Alembic history (a
#: revision imports nothing from the package, so it spells its DDL per database).
ALLOWED = ("core/_dialect.py", "migrations/versions/")

def database_branches(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """``(path, line)`` of every line under ``root`` that matches :data:`BRANCH`, but the allowed."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(ALLOWED):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if BRANCH.search(line):
                found.add((relative, line.strip()))
    return found


def test_no_module_but_the_dialect_module_asks_which_database_it_is_on() -> None:
    found = database_branches()
    assert sorted(found) == [], "ask the module's strategy (core/_dialect.py) instead"


@pytest.mark.parametrize("line", [
    "        if self.store.is_postgres:",
    '    if conn.dialect.name == "postgresql":',
    '    if url.get_backend_name() == "sqlite":',
    "        insert = postgresql.insert(rate_table)",
    "from sqlalchemy.dialects import sqlite",
    '    sqlite = dialect in ("sqlite", "other")',
    "    return claimable(now, sqlite=True)",
])
def test_the_checker_catches_a_new_branch(tmp_path: Path, line: str) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "_dialect.py").write_text(line + "\n")  # allowed there
    (tmp_path / "core" / "_rate.py").write_text("x = 1\n" + line + "\n")
    assert database_branches(tmp_path) == {("core/_rate.py", line.strip())}


def test_an_unsupported_database_is_named_in_the_error() -> None:
    with pytest.raises(ConfigError, match="SQLALCHEMY_DATABASE_URI.*'mysql'"):
        dialect_named("mysql")


FIXED = datetime(2026, 3, 1, 12, 34, 56)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    engine = sa.create_engine(db_url)
    metadata.create_all(engine)
    yield Store(engine, clock=lambda: FIXED)
    engine.dispose()


def test_each_database_gets_its_strategy(store: Store, backend: str) -> None:
    assert type(store.dialect) is {"sqlite": SQLite, "postgresql": Postgres}[backend]
    assert store.dialect.name == backend
    assert store.dialect.database_clock is store.dialect.listens is (backend == "postgresql")


def test_now_later_and_ago_are_on_one_clock(store: Store, backend: str) -> None:
    dialect, clock = store.dialect, store.clock
    with store.read() as conn:
        now, later, ago = conn.execute(sa.select(
            dialect.now(clock), dialect.later(clock, 90), dialect.ago(clock, 90))).one()
    assert later - now == timedelta(seconds=90) == now - ago
    if backend == "sqlite":  # one machine: the store's clock is the database's
        assert now == FIXED
    else:  # the database's clock, whatever the store's says
        assert abs(now - datetime.now(UTC).replace(tzinfo=None)) < timedelta(minutes=5)


def test_scalar_functions_and_hours(store: Store) -> None:
    dialect = store.dialect
    at = sa.literal(FIXED, sa.DateTime())
    with store.read() as conn:
        least, greatest, hour, start = conn.execute(sa.select(
            dialect.least(sa.literal(3.0), sa.literal(1.0), sa.literal(2.0)),
            dialect.greatest(sa.literal(3.0), sa.literal(1.0), sa.literal(2.0)),
            dialect.hour_number(at), dialect.hour_start(at))).one()
    assert (least, greatest) == (1.0, 3.0)
    epoch_hours = int((FIXED - datetime(1970, 1, 1)).total_seconds()) // 3600
    assert int(hour) == epoch_hours
    assert str(start)[:19] == "2026-03-01 12:00:00"


def test_the_on_conflict_insert_keeps_the_first(store: Store) -> None:
    insert = store.dialect.insert(setting_table)
    with store.write() as conn:
        for value in ("first", "second"):
            conn.execute(insert.values(name="n", value=value, updated_at=FIXED)
                         .on_conflict_do_nothing(index_elements=["name"]))
    with store.read() as conn:
        assert conn.execute(sa.select(setting_table.c.value)).scalars().all() == ["first"]


def _row(**values: object) -> dict[str, object]:
    return {"status": Status.QUEUED.value, "created_at": FIXED, "due_at": FIXED,
            "message_id": "<m@example.com>", "sender": "a@example.com",
            "recipients": '["b@example.com"]', "size": 1, "priority": 1, "attempts": 0,
            "lease_owner": None, "lease_expires_at": None, **values}


def test_the_claim_takes_due_rows_by_priority_and_the_reap_frees_expired_leases(
        store: Store) -> None:
    """Each database's claim statement: priority first, not-due rows left, the reap in the tick."""
    past = FIXED - timedelta(days=3650)  # due on the database clock too (PostgreSQL's)
    with store.write() as conn:
        normal, high, later, expired = conn.execute(
            email_table.insert().returning(email_table.c.id, sort_by_parameter_order=True),
            [_row(due_at=past, priority=1), _row(due_at=past, priority=0),
             _row(due_at=datetime(2999, 1, 1), priority=0),
             _row(status=Status.SENDING.value, lease_owner="dead", attempts=1,
                  lease_expires_at=past)]).scalars().all()
    claimed, reaped = store.leases.claim_due(1, owner="one", lease_seconds=60, reap=True)
    assert [email.id for email in claimed] == [high]
    assert reaped.requeued == (expired,)
    claimed, reaped = store.leases.claim_due(5, owner="two", lease_seconds=60, reap=True)
    assert sorted(email.id for email in claimed) == sorted([normal, expired])
    assert len(reaped) == 0
    with store.read() as conn:
        rows = {row.id: row for row in conn.execute(sa.select(email_table))}
    assert rows[later].status == Status.QUEUED.value
    assert (rows[high].status, rows[high].lease_owner, rows[high].attempts) == (
        Status.SENDING.value, "one", 1)
    assert (rows[expired].lease_owner, rows[expired].attempts) == ("two", 2)


def test_record_sent_writes_each_provider_id_under_its_own_claim(store: Store) -> None:
    past = FIXED - timedelta(days=3650)
    with store.write() as conn:
        conn.execute(email_table.insert(), [_row(due_at=past), _row(due_at=past)])
    first, second = store.leases.claim_due(2, owner="w", lease_seconds=60)[0]
    stale = Outcome(dataclasses.replace(second, owner="another claim"), Status.SENT)
    recorded, lost, _ = store.leases.record([
        Outcome(first, Status.SENT, provider_message_id="p-1"), stale])
    assert [o.email.id for o in recorded] == [first.id]
    assert [o.email.id for o in lost] == [second.id]
    with store.read() as conn:
        rows = {row.id: row for row in conn.execute(sa.select(email_table))}
    assert (rows[first.id].status, rows[first.id].provider_message_id) == ("sent", "p-1")
    assert rows[second.id].status == Status.SENDING.value
