"""Shared fixtures: a real SMTP server, SQLite and PostgreSQL backends, an app.

Every database test runs twice, on a SQLite file and on PostgreSQL
(``OUTBOX_TEST_POSTGRES_URL``, set by ``scripts/run-tests``). Without that
variable the PostgreSQL half is skipped locally, and fails in CI
(``CI`` or ``OUTBOX_REQUIRE_POSTGRES`` set): a green run that skipped it
proves nothing.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiosmtplib
import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

# tests/ is on sys.path through pyproject's `pythonpath`.
from smtpserver import FaultSMTPServer
from sqlalchemy.orm import Mapped, mapped_column

from flask_mail_outbox import OutboxMail
from flask_mail_outbox.core import email_table
from flask_mail_outbox.core import metadata as outbox_metadata

PG_URL = os.environ.get("OUTBOX_TEST_POSTGRES_URL")
REQUIRE_PG = bool(os.environ.get("OUTBOX_REQUIRE_POSTGRES")) or \
    os.environ.get("CI", "").lower() in ("1", "true", "yes")

db = SQLAlchemy()


class User(db.Model):  # type: ignore[name-defined,misc]
    """The app's own data, committed in the same transaction as emails."""

    __tablename__ = "test_user"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))



#: prepare_message()'s settings as an app with default configuration passes them.
PREPARE_OPTIONS: dict[str, Any] = {
    "default_sender": None,
    "allow_local_addresses": False,
    "max_message_bytes": 25 * 1024 * 1024,
    "message_id_domain": None,
    "ascii_attachments": False,
}

def pytest_report_header() -> str:
    """Which aiosmtplib this run's SMTP tests use (pyproject.toml allows a range)."""
    return f"aiosmtplib {aiosmtplib.__version__}"


# --- the fast inner loop and the parallel run --------------------------------------------
# `pytest -m "not slow"` is the contributors' quick subset (docs/contributing.md): every
# test whose node id starts with an entry of tests/slow.txt is marked `slow` here, so no
# test file carries the mark. tests/test_fast_subset.py keeps the list honest.
#
# The full suite runs on one pytest-xdist worker per core (scripts/run-tests: `-n N`).
# Each worker is its own pytest session, so `pg_database` gives each its own PostgreSQL
# database (and with it its own LISTEN/NOTIFY channels and advisory locks: PostgreSQL
# scopes both to a database); servers bind port 0 or free_port(); files go under
# tmp_path, Postfix and the outage cluster under their own mkdtemp() directories. The
# modules below send all their tests to one worker, in file order (the scheduler below):
# each sets up something costly once per module, which every worker given one of its
# tests would otherwise set up again, or has a test that needs the ones before it.

SLOW_LIST = Path(__file__).with_name("slow.txt")

#: Test modules (file names) whose tests all run on one xdist worker, and why.
ONE_WORKER_MODULES: dict[str, str] = {
    "test_postfix.py": "one private Postfix instance for the module",
    "test_bounces_postfix.py": "one private Postfix instance for the module",
    "test_db_outage.py": "the module's own PostgreSQL cluster, stopped and restarted",
    "test_packaging.py": "the wheel, built once for the module",
    "test_webhook_routes.py": "its last test counts what the tests before it refused",
}


def read_slow_list(path: Path = SLOW_LIST) -> list[str]:
    """tests/slow.txt's entries: node-id prefixes, one a line; '#' starts a comment."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def slow_entry_matches(entry: str, nodeid: str) -> bool:
    """Whether ``entry`` (a file, a test, or one parametrization) names ``nodeid``."""
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that tests/slow.txt names `slow`."""
    entries = read_slow_list()
    exact = set(entries)
    prefixes = tuple(entry + tail for entry in entries for tail in ("::", "["))
    for item in items:
        nodeid = item.nodeid
        if nodeid in exact or nodeid.startswith(prefixes):  # as slow_entry_matches()
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controlling process
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` (xdist's `--dist load`): each test to the next free worker, except the
    ONE_WORKER_MODULES, each sent whole to one worker.

    (Not `--dist loadgroup` with xdist_group marks: xdist 3.8 tags the grouped tests by
    rewriting their node ids, which pytest 9.2 no longer lets it do, so the marks are
    silently ignored. `_split_scope` is the method xdist's own loadgroup and loadfile
    schedulers override to say what goes to one worker.)
    """
    if config.getoption("dist") != "load":
        return None  # the caller chose another mode
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.rsplit("/", 1)[-1] in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


def _escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape, ``\\udcff``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker sends the report
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Captured output with a lone surrogate (a hostile server's reply, logged) cannot be
    sent from an xdist worker, which would die of it (execnet encodes strictly to UTF-8):
    such characters are shown escaped, as a run in one process shows them replaced."""
    report.sections = [(title, _escape_surrogates(content))
                       for title, content in report.sections]


def pytest_collection_finish(session: pytest.Session) -> None:
    """With OUTBOX_COLLECTION_REPORT=<file>: one line per test, "slow|fast <node id>"
    (tests/test_fast_subset.py reads it)."""
    report = os.environ.get("OUTBOX_COLLECTION_REPORT")
    if report:
        Path(report).write_text("".join(
            f"{'slow' if item.get_closest_marker('slow') else 'fast'} {item.nodeid}\n"
            for item in session.items), encoding="utf-8")


def require_postgres() -> str:
    """The PostgreSQL URL, or skip (locally) / fail (CI) when there is none."""
    if PG_URL:
        return PG_URL
    if REQUIRE_PG:
        pytest.fail("OUTBOX_TEST_POSTGRES_URL is not set but PostgreSQL tests are required "
                    "(CI / OUTBOX_REQUIRE_POSTGRES); run ./scripts/run-tests")
    pytest.skip("OUTBOX_TEST_POSTGRES_URL not set (./scripts/run-tests starts a server)")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str | None]:
    """One throwaway PostgreSQL database for the session (tables truncated per test)."""
    if not PG_URL:
        yield None
        return
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"outbox_t_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """Which database a test runs on."""
    if request.param == "postgresql":
        require_postgres()
    return str(request.param)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, pg_database: str | None) -> Iterator[str]:
    """A clean database for one test: a new SQLite file, or emptied PostgreSQL tables."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'test.db'}"
        return
    assert pg_database is not None  # backend() already skipped or failed otherwise
    yield empty_postgres(pg_database)


def empty_postgres(url: str) -> str:
    """Drop the outbox's and the test models' tables from ``url``; returns ``url``."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        outbox_metadata.drop_all(conn)
        db.metadata.drop_all(conn)
    engine.dispose()
    return url


@pytest.fixture
def smtp_server() -> Iterator[FaultSMTPServer]:
    """A real SMTP server on 127.0.0.1 that tests can script."""
    with FaultSMTPServer() as server:
        yield server


def make_app(db_url: str, **config: Any) -> Flask:
    """A Flask app with the test models and the extension, tables created."""
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=db_url,
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_TIMEOUT=5,
        SECRET_KEY="test",
        # The tests' fast retry schedule (2 s doubling, 5 attempts), kept
        # explicitly: the library's defaults wait a minute and try for a day.
        OUTBOX_RETRY_BASE_SECONDS=2.0,
        OUTBOX_MAX_ATTEMPTS=5,
    )
    # Sweep jobs only where a test asks for them.
    app.config["OUTBOX_RUN_SCHEDULER"] = False
    if "TESTING" not in config:
        # pytest-flask sets TESTING; these apps exercise the real transport.
        app.config["MAIL_SUPPRESS_SEND"] = False
    app.config.update(config)
    db.init_app(app)
    mail = OutboxMail(app)
    with app.app_context():
        db.create_all()
        mail.create_all()
    app.extensions["test_mail"] = mail
    return app


def close_app(app: Flask, timeout: float | None = None) -> None:
    """Stop the app's extension (``timeout``, else its default) and dispose its engines."""
    mail: OutboxMail = app.extensions["test_mail"]
    if timeout is None:
        mail.stop()
    else:
        mail.stop(timeout=timeout)
    with app.app_context():
        db.session.remove()
        for engine in db.engines.values():
            engine.dispose()


def rows(app: Flask) -> list[dict[str, Any]]:
    """Every ``outbox_email`` row of the app's database, by id."""
    with app.app_context(), db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            email_table.select().order_by(email_table.c.id)).mappings()]


_T = TypeVar("_T")


def poll(fetch: Callable[[], _T], until: Callable[[_T], object] = bool, *,
         timeout: float, interval: float = 0.05) -> _T:
    """``fetch()`` every ``interval`` s until ``until`` holds for its result, or
    ``timeout`` passed; returns the last result (the caller asserts on it).

    The one polling loop of the tests: for state no event announces (rows in
    the database, a process's log). The SMTP server has its own waits.
    """
    deadline = time.monotonic() + timeout
    while True:
        current = fetch()
        if until(current) or time.monotonic() > deadline:
            return current
        time.sleep(interval)


def wait_rows(app: Flask, predicate: Callable[[list[dict[str, Any]]], bool],
              timeout: float, interval: float = 0.05) -> list[dict[str, Any]]:
    """``rows(app)`` once ``predicate`` holds for them, or as they are after ``timeout``."""
    return poll(lambda: rows(app), predicate, timeout=timeout, interval=interval)


def query_plan(engine: sa.Engine, statement: str, parameters: Any) -> str:
    """The plan of ``statement`` as it ran (captured with its bound parameters).

    On PostgreSQL sequential scans are turned off first, so a plan that still
    reads the whole table means no index matched the predicates.
    """
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return " | ".join(str(r[-1]) for r in conn.exec_driver_sql(
                f"EXPLAIN QUERY PLAN {statement}", parameters))
        conn.exec_driver_sql("SET enable_seqscan = off")
        return " | ".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {statement}",
                                                               parameters))


def drop_example_tables(url: str) -> None:
    """PostgreSQL: the session's shared database must not keep the example's migrated schema."""
    if sa.make_url(url).get_backend_name() != "postgresql":
        return  # a new SQLite file per test
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            outbox_metadata.drop_all(conn)
            conn.exec_driver_sql("DROP TABLE IF EXISTS users")
            conn.exec_driver_sql("DROP TABLE IF EXISTS alembic_version")
    finally:
        engine.dispose()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


MakeApps = Callable[..., tuple[Flask, OutboxMail]]


@pytest.fixture
def make_apps(db_url: str) -> Iterator[MakeApps]:
    """``make_apps(**config)``: ``make_app(db_url, **config)`` and its extension;
    every app made is closed (``close_app``) at teardown."""
    made: list[Flask] = []

    def factory(**config: Any) -> tuple[Flask, OutboxMail]:
        app = make_app(db_url, **config)
        made.append(app)
        return app, app.extensions["test_mail"]

    yield factory
    for app in made:
        close_app(app)


@pytest.fixture
def app(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    """An app delivering over SMTP to ``smtp_server``."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    yield app
    close_app(app, timeout=5)


@pytest.fixture
def hand_ticked_app(db_url: str, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    """Durable over SMTP to ``smtp_server``, with no dispatcher thread and no LISTEN.

    The test ticks the dispatcher by hand (``hand_ticked_worker(app).tick()``),
    and nothing else wakes it.
    """
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    hand_ticked_worker(app)
    yield app
    close_app(app, timeout=5)


def hand_ticked_worker(app: Flask) -> Any:
    """``app``'s worker as a dispatcher that never starts a thread: tests call its tick()."""
    return app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)


@pytest.fixture
def mail(app: Flask) -> OutboxMail:
    """The app's extension."""
    mail: OutboxMail = app.extensions["test_mail"]
    return mail
