"""`mail.stats()` and `flask outbox status --json`: one documented, stable shape.

Every field the README lists is pinned here, on SQLite and PostgreSQL, with
real rows in every status, and the last sweep is read back by a second app
instance and by a second process (`flask outbox status --json`), as any
operator's shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from conftest import MakeApps, db, free_port, rows, wait_rows
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import email_table

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

STATUS_FIELDS = {"counts", "oldest_queued_age_seconds", "dead_letters", "mode", "executor",
                 "last_sweep"}
SWEEP_FIELDS = {"scanned", "requeued", "sent", "failed", "skipped", "truncated", "mode",
                "dry_run", "started_at", "duration_seconds", "kind", "age_gated",
                "age_gated_until"}
DISPATCHER_FIELDS = {"running", "ticks", "last_tick_failed", "listening"}


def send(app: Flask, mail: OutboxMail, to: str, **options: Any) -> int:
    with app.app_context():
        email_id = mail.send(Message("status", recipients=[to], body="x"), **options)
        db.session.commit()
    return email_id


def backdate(app: Flask, email_id: int, seconds: float) -> None:
    """Move a row's ``created_at`` (and due time) ``seconds`` into the past."""
    t = email_table
    with app.app_context(), db.engine.begin() as conn:
        row = conn.execute(sa.select(t.c.created_at).where(t.c.id == email_id)).one()
        past = row.created_at - timedelta(seconds=seconds)
        conn.execute(t.update().where(t.c.id == email_id).values(created_at=past))


def four_statuses(app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> dict[str, int]:
    """One sent, one failed, two queued for later (one of them 500 s old) and one sending."""
    smtp_server.refuse_recipient("bad@example.com", 550)
    ids = {"sent": send(app, mail, "a@example.com"), "failed": send(app, mail, "bad@example.com")}
    with app.app_context():
        assert mail.wait_idle(20)
    ids["queued"] = send(app, mail, "later@example.com", send_after=timedelta(hours=1))
    ids["old"] = send(app, mail, "later2@example.com", send_after=timedelta(hours=1))
    ids["sending"] = send(app, mail, "sending@example.com", send_after=timedelta(hours=1))
    backdate(app, ids["old"], 500)
    with app.app_context(), db.engine.begin() as conn:
        # A row another process holds a lease on (no process here touches it).
        conn.execute(email_table.update().where(email_table.c.id == ids["sending"])
                     .values(status="sending"))
    return ids


def test_stats_shape_and_values(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    four_statuses(app, mail, smtp_server)
    with app.app_context():
        stats = mail.stats()
    assert set(stats) == STATUS_FIELDS | {"dispatcher"}
    assert stats["counts"] == {"queued": 2, "sending": 1, "sent": 1, "failed": 1, "suppressed": 0,
                               "expired": 0, "cancelled": 0}
    assert stats["dead_letters"] == 1
    assert stats["mode"] == "inline"
    assert stats["last_sweep"] is None
    assert stats["dispatcher"] is None  # inline mode: this process runs no dispatcher
    # The back-dated row leads; the figure is measured, so only a generous bound.
    assert 500 <= stats["oldest_queued_age_seconds"] < 500 + 120
    json.dumps(stats)  # plain JSON values only


def test_empty_outbox(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    with app.app_context():
        stats = mail.stats()
    assert stats["counts"] == {"queued": 0, "sending": 0, "sent": 0, "failed": 0, "suppressed": 0,
                               "expired": 0, "cancelled": 0}
    assert stats["oldest_queued_age_seconds"] is None and stats["dead_letters"] == 0


def test_stats_show_this_process_dispatcher(make_apps: MakeApps,
                                            smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_LISTEN=False)
    send(app, mail, "a@example.com")
    assert smtp_server.wait_for(1)
    wait_rows(app, lambda r: [x["status"] for x in r] == ["sent"], 20)
    with app.app_context():
        stats = mail.stats()
    assert stats["mode"] == "durable"
    dispatcher = stats["dispatcher"]
    assert set(dispatcher) == DISPATCHER_FIELDS
    assert dispatcher["running"] is True and dispatcher["ticks"] >= 1
    assert dispatcher["last_tick_failed"] is False and dispatcher["listening"] is False


def test_last_sweep_is_shared_with_other_app_instances_and_processes(
        make_apps: MakeApps, smtp_server: FaultSMTPServer, db_url: str) -> None:
    sweeper, sweeper_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    reader, reader_mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with reader.app_context():
        assert reader_mail.stats()["last_sweep"] is None
    email_id = send(sweeper, sweeper_mail, "a@example.com", send_after=timedelta(hours=1))
    backdate(sweeper, email_id, 3600)
    with sweeper.app_context(), db.engine.begin() as conn:
        # Stranded: due an hour ago, never handed over (as after a crash).
        conn.execute(email_table.update().where(email_table.c.id == email_id)
                     .values(due_at=email_table.c.created_at))
    with sweeper.app_context():
        report = sweeper_mail.sweep(min_age=60)
    assert (report.scanned, report.sent) == (1, 1)
    assert smtp_server.wait_for(1)

    with reader.app_context():
        last = reader_mail.stats()["last_sweep"]
    assert set(last) == SWEEP_FIELDS
    assert last == report.as_dict()

    result = reader.test_cli_runner().invoke(args=["outbox", "status", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    # No dispatcher (the command runs none); the paused transports (the command reads them).
    assert set(printed) == STATUS_FIELDS | {"paused_transports"}
    assert printed["last_sweep"] == report.as_dict()
    assert printed["counts"]["sent"] == 1

    # A second process, as an operator's shell runs it.
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}", "WORKER_DB_URL": db_url,
           "WORKER_SMTP_PORT": str(smtp_server.port)}
    proc = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "worker_app:create_app", "outbox", "status",
         "--json"], env=env, cwd=str(TESTS), capture_output=True, text=True, timeout=120,
        check=False)
    assert proc.returncode == 0, proc.stderr
    other = json.loads(proc.stdout)
    assert other["last_sweep"] == report.as_dict()
    assert other["counts"] == {"queued": 0, "sending": 0, "sent": 1, "failed": 0, "suppressed": 0,
                               "expired": 0, "cancelled": 0}
    assert [r["status"] for r in rows(sweeper)] == ["sent"]


def test_cli_status_text(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    four_statuses(app, mail, smtp_server)
    result = app.test_cli_runner().invoke(args=["outbox", "status"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "mode: inline"
    assert "  queued              2" in lines and "  failed              1" in lines
    assert any(line.startswith("oldest queued: 5") for line in lines)
    assert lines[-1] == "last sweep: never"


def test_cli_status_when_the_database_is_down(backend: str, tmp_path: Path) -> None:
    """A clear error and exit 1, not a traceback (and no credentials printed)."""
    url = (f"sqlite:///{tmp_path / 'app.db'}" if backend == "sqlite"
           else f"postgresql+psycopg://outbox:s3cret-pw@127.0.0.1:{free_port()}/outbox")
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, OUTBOX_RUN_SCHEDULER=False)
    mail = OutboxMail(app, db=SQLAlchemy(app))  # SQLite: a new file without the tables
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "status", "--json"])
    finally:
        mail.stop()
    assert result.exit_code == 1
    assert "cannot read the outbox tables" in result.output
    assert "s3cret-pw" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_cli_status_dates_the_age_gate_figure_of_the_last_sweep(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """The last sweep's "younger under the age gate" is what that sweep saw: once the
    email is sent, status must not present it as current."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    send(app, mail, "a@example.com")  # queued: this process runs no dispatcher
    with app.app_context():
        report = mail.sweep()
    assert (report.scanned, report.age_gated) == (0, 1)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "worker", "--once"])
    assert result.exit_code == 0, result.output
    assert smtp_server.wait_for(1)
    result = runner.invoke(args=["outbox", "status"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  queued              0" in lines and "  sent                1" in lines
    last = lines[-1]
    assert last.startswith(f"last sweep: {report.started_at} (durable, manual): scanned 0")
    assert (f"as of the sweep at {report.started_at}, 1 younger under the age gate until "
            f"{report.age_gated_until}") in last, last
