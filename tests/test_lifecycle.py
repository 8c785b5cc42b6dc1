"""Issue 15 in one process: what stop() releases, the lazy start, the start-up dispatcher,
the stored empty sweep, the CLI's logging and start line, rounded figures.

The gunicorn deployments themselves are in tests/test_deploy.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, poll, rows
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core._sweeping import RELEASED

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _queue(mail: OutboxMail, count: int, subject: str = "m") -> list[int]:
    ids = [mail.send(Message(f"{subject}{i}", recipients=["a@example.com"], body="x"))
           for i in range(count)]
    db.session.commit()
    return ids


def test_stop_releases_what_it_held_and_the_next_sweep_takes_it_at_once(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    """Rows handed over after commit and never claimed are marked at stop(); the
    next sweep, with the 300 s age gate, sends them; a row no process released
    stays under the gate, and the sweep's line says how many and until when."""
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    smtp_server.hold()
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_BATCH_SIZE=1)
    with app.app_context():
        ids = _queue(mail, 3)
        assert smtp_server.wait_held(1)  # the first is in DATA; two wait in memory
        mail.stop(timeout=1)
    # With batches of one, the worker claims one at a time: the second and third
    # waited in memory, and stop() released them.
    [stop_line] = [r for r in caplog.records
                   if r.getMessage().startswith("Outbox delivery stopped")]
    assert stop_line.levelno == logging.INFO
    assert f"released 2 unsent email(s) {ids[1:]}" in stop_line.getMessage()
    assert "1 email(s) still being sent" in stop_line.getMessage()
    smtp_server.release()
    assert smtp_server.wait_for(1)
    current = poll(lambda: rows(app), lambda rs: rs[0]["status"] == "sent", timeout=10)
    assert [(r["status"], r["lease_owner"]) for r in current] == [
        ("sent", None), ("queued", RELEASED), ("queued", RELEASED)]

    # A row nobody released (its process died, or it still holds it in memory).
    other, other_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with other.app_context():
        db.session.execute(sa.text(
            "UPDATE outbox_email SET lease_owner = NULL WHERE id = :id"), {"id": ids[2]})
        db.session.commit()
        caplog.clear()
        report = other_mail.sweep()  # the default age gate, 300 s
        assert other_mail.wait_idle(10)
    assert (report.scanned, report.sent, report.age_gated) == (1, 1, 1)
    assert report.age_gated_until is not None
    assert [r["status"] for r in rows(app)] == ["sent", "sent", "queued"]
    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("Outbox sweep (manual")]
    assert "left 1 younger queued email(s) to the age gate" in line
    assert report.age_gated_until in line


def test_stop_with_nothing_held_says_so_at_info(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with app.app_context():
        _queue(mail, 2)
        assert smtp_server.wait_for(2) and mail.wait_idle(10)
    mail.stop()
    lines = [r for r in caplog.records if r.getMessage().startswith("Outbox delivery stopped")]
    assert [(r.levelno, "nothing released, nothing in flight" in r.getMessage())
            for r in lines] == [(logging.INFO, True)]


def test_a_serving_process_starts_its_jobs_on_first_use_not_at_import(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """init_app outside a command (a WSGI server importing the app, perhaps a master
    that will fork) starts nothing; the first request does."""
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_RUN_SCHEDULER=True)
    state = app.extensions["mail_outbox"]
    assert state.serving and state.scheduler is None and state.current_outbox() is None

    @app.get("/ping")
    def ping() -> str:
        return "pong"

    with app.test_client() as client:
        assert client.get("/ping").get_data(as_text=True) == "pong"
    assert state.scheduler is not None and state.scheduler.pid == os.getpid()


def test_durable_without_startup_sweep_runs_its_dispatcher_from_the_start(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """A row committed by another process (here: another app, no NOTIFY) is delivered
    by this serving process's dispatcher with no local commit and no sweep."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_SCHEDULER=True, OUTBOX_SWEEP_ON_STARTUP=False,
                          OUTBOX_DURABLE=True, OUTBOX_LISTEN=False,
                          OUTBOX_POLL_MAX_INTERVAL=0.5)
    app.extensions["mail_outbox"].ensure_started()  # as the first request does
    with app.app_context():
        stats = poll(mail.stats, lambda s: s["dispatcher"] is not None
                     and s["dispatcher"]["running"], timeout=10)
    assert stats["dispatcher"] is not None and stats["dispatcher"]["running"]
    script, script_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                                    OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                                    OUTBOX_LISTEN=False)
    with script.app_context():
        _queue(script_mail, 2, "from a script ")
    assert smtp_server.wait_for(2, timeout=20)
    assert poll(lambda: rows(app), lambda rs: {r["status"] for r in rs} == {"sent"},
                timeout=10)
    with app.app_context():
        assert mail.stats()["last_sweep"] is None  # no sweep took them


def test_a_sweep_that_found_nothing_is_stored_and_shown(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_RUN_SCHEDULER=True)
    with app.app_context():
        report = mail.wait_sweep(20)  # the startup sweep, which finds nothing
        assert report is not None and report.scanned == 0 and report.kind == "startup"
        assert mail.stats()["last_sweep"] == report.as_dict()
    result = app.test_cli_runner().invoke(args=["outbox", "status"])
    assert result.exit_code == 0, result.output
    last = result.output.splitlines()[-1]
    assert last.startswith(f"last sweep: {report.started_at} (inline, startup): scanned 0")
    assert report.duration_seconds == round(report.duration_seconds, 3)


def test_a_periodic_sweep_that_found_nothing_is_stored_too(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    from flask_mail_outbox.core import run_sweep

    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    state = app.extensions["mail_outbox"]
    report = run_sweep(state.outbox(), kind="periodic")
    with app.app_context():
        assert mail.stats()["last_sweep"] == report.as_dict()
    assert report.kind == "periodic" and report.scanned == 0

    # A run of them stores only its first: an idle process writes nothing each minute.
    writes: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "outbox_setting" in statement and not statement.lstrip().startswith("SELECT"):
            writes.append(statement)

    engine = state.outbox().engine
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        run_sweep(state.outbox(), kind="periodic")
        assert writes == []
        with app.app_context():
            assert mail.stats()["last_sweep"] == report.as_dict()
        manual = run_sweep(state.outbox())  # a sweep of another kind ends the run
        again = run_sweep(state.outbox(), kind="periodic")
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(writes) == 2 and manual.kind == "manual"
    with app.app_context():
        assert mail.stats()["last_sweep"] == again.as_dict()


def _flask(db_url: str, smtp_port: int, *args: str,
           **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
           "DEPLOY_DB_URL": db_url, "DEPLOY_SMTP_PORT": str(smtp_port), **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "gunicorn_app:create_app", "outbox", *args],
        env=env, cwd=str(TESTS), capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("flag", "expected"), [((), 2), (("--concurrency", "3"), 3)],
                         ids=["OUTBOX_CONCURRENCY", "--concurrency"])
def test_a_worker_opens_outbox_concurrency_connections_unless_told_otherwise(
        make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer,
        flag: tuple[str, ...], expected: int) -> None:
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    with app.app_context():
        _queue(mail, 12)
    smtp_server.delay("data", 0.2)  # connections open while the first replies wait
    done = _flask(db_url, smtp_server.port, "worker", "--once", *flag, DEPLOY_CONCURRENCY="2")
    assert done.returncode == 0, done.stderr
    assert smtp_server.wait_for(12)
    start = [line for line in done.stderr.splitlines() if "flask outbox worker --once (pid" in line]
    assert len(start) == 1 and f"concurrency {expected}" in start[0], done.stderr
    assert smtp_server.max_concurrent_connections == expected


def test_cli_commands_log_a_start_line_without_the_password(
        backend: str, make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """An app that configures no logging: the worker still says what it runs."""
    # The tables, and one email this process leaves to the worker.
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    with app.app_context():
        _queue(mail, 1)
    url = db_url
    if backend == "postgresql":
        url = sa.make_url(db_url).set(password="s3cret-pw").render_as_string(
            hide_password=False)
    done = _flask(url, smtp_server.port, "worker", "--once")
    assert done.returncode == 0, done.stderr
    assert smtp_server.wait_for(1)
    start = [line for line in done.stderr.splitlines() if "flask outbox worker --once (pid" in line]
    assert len(start) == 1, done.stderr
    assert " INFO flask_mail_outbox._operator.cli " in start[0]
    assert f"transport smtp 127.0.0.1:{smtp_server.port}" in start[0]
    assert "mode durable" in start[0] and "concurrency 4" in start[0]
    assert "s3cret-pw" not in done.stderr and "s3cret-pw" not in done.stdout
    if backend == "postgresql":
        assert ":***@" in start[0]
    else:
        assert f"database {db_url}" in start[0]

    quiet = _flask(url, smtp_server.port, "sweep", "--log-level", "warning")
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr and "scanned" in quiet.stdout
    loud = _flask(url, smtp_server.port, "sweep")
    assert "Outbox sweep (manual, inline)" in loud.stderr, loud.stderr


def test_a_mark_the_database_refuses_at_stop_is_an_error_and_loses_nothing(
        make_apps: MakeApps, smtp_server: FaultSMTPServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    smtp_server.hold()
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_BATCH_SIZE=1)
    store = app.extensions["mail_outbox"].outbox().store

    def refuse(ids: list[int]) -> int:
        raise sa.exc.OperationalError("UPDATE outbox_email", {}, Exception("database gone"))

    with app.app_context():
        ids = _queue(mail, 3)
        assert smtp_server.wait_held(1)
        monkeypatch.setattr(store.sweep, "mark_released", refuse)
        mail.stop(timeout=1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
              and "released at stop" in r.getMessage()]
    assert len(errors) == 1 and str(ids[1:]) in errors[0]
    assert "wait for the age gate" in errors[0]  # the consequence
    assert "`flask outbox sweep --min-age 0`" in errors[0]  # the fix
    smtp_server.release()
    assert smtp_server.wait_for(1)
    last = poll(lambda: rows(app), lambda rs: rs[1]["status"] == "queued", timeout=10)
    # Queued and unmarked: nothing lost, only left to the age gate.
    assert [(r["status"], r["lease_owner"]) for r in last][2] == ("queued", None)


# -- issue 29, item 3: tables created after OutboxMail(app), as the README's tour does -------


def _tourist_app(db_url: str, **config: Any) -> tuple[Flask, OutboxMail, SQLAlchemy]:
    """``OutboxMail(app)`` on a database without the outbox tables (they come later)."""
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, MAIL_SUPPRESS_SEND=False,
                      MAIL_DEFAULT_SENDER="noreply@example.com", **config)
    sql = SQLAlchemy(app)
    return app, OutboxMail(app), sql


def _close_tourist(app: Flask, mail: OutboxMail, sql: SQLAlchemy) -> None:
    mail.stop(timeout=5)
    with app.app_context():
        sql.session.remove()
        sql.engine.dispose()


@pytest.mark.parametrize("durable", [False, True], ids=["inline", "durable"])
def test_tables_created_right_after_init_app_start_quietly(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture,
        durable: bool) -> None:
    """The start-up job reads the delivery mode before ``mail.create_all()`` ran: that is
    expected, not an ERROR, and the first email goes out as usual."""
    caplog.set_level(logging.DEBUG, logger="flask_mail_outbox")
    app, mail, sql = _tourist_app(db_url, MAIL_SERVER=smtp_server.host,
                                  MAIL_PORT=smtp_server.port, OUTBOX_DURABLE=durable,
                                  OUTBOX_LISTEN=False, OUTBOX_SWEEP_ON_STARTUP=False)
    try:
        app.extensions["mail_outbox"].ensure_started()  # as the first request does
        # The start-up job has looked for the mode (and found no table) ...
        poll(lambda: [r for r in caplog.records if "delivery mode at start-up" in r.getMessage()],
             timeout=30)
        with app.app_context():  # ... and only now does the tour create the tables.
            sql.create_all()
            mail.create_all()
            mail.send(Message("hello", recipients=["a@example.com"], body="x"))
            sql.session.commit()
        assert smtp_server.wait_for(1)
    finally:
        _close_tourist(app, mail, sql)
    ours = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []
    assert not [r for r in ours if r.exc_info]


def test_tables_still_missing_when_needed_are_one_error_line_naming_the_fix(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    """No ``create_all()`` and no migration: the start-up sweep needs the tables, and
    says so once, in one line (no traceback), with the fix."""
    caplog.set_level(logging.DEBUG, logger="flask_mail_outbox")
    app, mail, sql = _tourist_app(db_url, MAIL_SERVER=smtp_server.host,
                                  MAIL_PORT=smtp_server.port, OUTBOX_DURABLE=True,
                                  OUTBOX_LISTEN=False)
    try:
        with app.app_context():
            assert mail.wait_sweep(30) is None  # started it; it failed
            state = app.extensions["mail_outbox"]
            state.scheduler._periodic()  # a periodic run finds them missing too
    finally:
        _close_tourist(app, mail, sql)
    ours = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")]
    errors = [r for r in ours if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    [error] = errors
    text = error.getMessage()
    assert error.levelno == logging.ERROR and error.exc_info is None
    assert "\n" not in text
    assert text.startswith("The outbox tables do not exist")
    assert "`flask db upgrade outbox@head`" in text and "`mail.create_all()`" in text
