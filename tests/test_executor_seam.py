"""The executor seam (OUTBOX_EXECUTOR) without an engine: what every engine's module relies on.

The engines' own tests (tests/test_executor_<engine>.py) run real Celery, RQ
and Dramatiq workers on Redis. Here the "broker" is a list in this process,
standing in for an engine's module (``flask_mail_outbox.contrib.<engine>``
in ``sys.modules`` for the test's duration), so the seam's own rules are held
on both databases: what a commit publishes and when, in what chunks, what a
refused publish leaves behind, what the sweep publishes, and what a task's
claim does with ids it cannot take.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, free_port, make_app, poll, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox._flask import executors
from flask_mail_outbox.core._internal import email_table


class ListBroker:
    """The published tasks, in order; refuses while ``down``."""

    name = "rq"
    sweep_task = "flask_mail_outbox.contrib.rq.sweep"
    sweeps_urgent = True

    def __init__(self) -> None:
        self.tasks: list[tuple[list[int], bool]] = []
        self.down = False

    def publish(self, ids: Sequence[int], *, urgent: bool = False) -> None:
        if self.down:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")
        self.tasks.append((list(ids), urgent))

    @property
    def ids(self) -> list[int]:
        return [i for ids, _ in self.tasks for i in ids]


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> ListBroker:
    broker = ListBroker()
    module = types.ModuleType("flask_mail_outbox.contrib.rq")
    module.publisher = lambda app: broker  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flask_mail_outbox.contrib.rq", module)
    return broker


@pytest.fixture
def app(db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> Iterator[Flask]:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR="rq", OUTBOX_BATCH_SIZE=2, OUTBOX_LEASE_SECONDS=30,
                   OUTBOX_SWEEP_MIN_AGE_SECONDS=0)
    yield app
    close_app(app)


def _send(app: Flask, n: int, **options: Any) -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [mail.send(Message(f"m{i}", recipients=[f"r{i}@example.com"], body="x"),
                         **options) for i in range(n)]
        db.session.commit()
    return ids


def test_a_commit_publishes_its_ids_in_batches_urgent_first_and_a_task_delivers_them(
        app: Flask, broker: ListBroker, smtp_server: FaultSMTPServer) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        plain = [mail.send(Message(f"p{i}", recipients=["a@example.com"], body="x"))
                 for i in range(3)]
        high = mail.send(Message("high", recipients=["b@example.com"], body="x"),
                         priority="high")
        db.session.commit()
    # OUTBOX_BATCH_SIZE=2: at most two ids per task; the urgent one in a task of its own, first.
    assert broker.tasks == [([high], True), (plain[:2], False), (plain[2:], False)]
    assert smtp_server.messages == []  # no dispatcher of its own: the queue's workers deliver
    assert all(r["status"] == "queued" for r in rows(app))
    for ids, _ in broker.tasks:
        executors.deliver_task(ids, app=app)
    assert {r["status"] for r in rows(app)} == {"sent"}
    assert len(smtp_server.messages) == 4


def test_a_rollback_publishes_nothing(app: Flask, broker: ListBroker) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        mail.send(Message("never", recipients=["a@example.com"], body="x"))
        db.session.rollback()
    assert broker.tasks == []
    assert rows(app) == []


def test_a_savepoint_publishes_nothing_until_the_outer_commit(
        app: Flask, broker: ListBroker) -> None:
    """A savepoint's release is not a commit: publishing then would hand a worker ids
    that the outer transaction may still roll back (or that it cannot see yet)."""
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        with db.session.begin_nested():
            kept = mail.send(Message("kept", recipients=["a@example.com"], body="x"))
        savepoint = db.session.begin_nested()
        mail.send(Message("undone", recipients=["a@example.com"], body="x"))
        savepoint.rollback()
        assert broker.tasks == []  # released and rolled back savepoints: nothing yet
        db.session.commit()
    assert broker.tasks == [([kept], False)]
    assert [r["id"] for r in rows(app)] == [kept]
    with app.app_context():
        # (A statement before the savepoint: pysqlite begins no transaction for a SAVEPOINT
        # issued first, so releasing it would commit; docs/guarantees.md says so.)
        mail.send(Message("outer", recipients=["a@example.com"], body="x"))
        with db.session.begin_nested():
            mail.send(Message("gone", recipients=["a@example.com"], body="x"))
        db.session.rollback()  # the outer transaction: its released savepoint goes too
    assert broker.tasks == [([kept], False)]
    assert [r["id"] for r in rows(app)] == [kept]


def test_a_task_sends_nothing_twice_and_skips_what_it_cannot_claim(
        app: Flask, broker: ListBroker, smtp_server: FaultSMTPServer) -> None:
    first, later = _send(app, 1), _send(app, 1, send_after=timedelta(hours=1))
    assert broker.ids == first  # send_after: not published at commit (the sweep does, once due)
    assert executors.deliver_task(first, app=app)["sent"] == 1
    again = executors.deliver_task([*first, *later, 999_999], app=app)
    assert again["sent"] == 0 and again["not_claimed"] == 3
    assert len(smtp_server.messages) == 1


def test_a_broker_that_refuses_leaves_the_rows_queued_with_one_error_and_the_sweep_publishes(
        app: Flask, broker: ListBroker, caplog: pytest.LogCaptureFixture) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    broker.down = True
    with caplog.at_level(logging.INFO):
        ids = _send(app, 1) + _send(app, 1)  # two commits: one ERROR, the second counted
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "stay queued" in errors[0].getMessage()
    assert "(flask_mail_outbox.contrib.rq.sweep on rq)" in errors[0].getMessage()
    assert [r["status"] for r in rows(app)] == ["queued", "queued"]
    broker.down = False
    caplog.clear()
    with app.app_context(), caplog.at_level(logging.INFO):
        report = mail.sweep()
    assert report.requeued == 2 and sorted(broker.ids) == ids
    assert any(r.getMessage().startswith("Recovered: Could not publish") for r in caplog.records)


def test_the_sweep_publishes_urgent_emails_first_in_tasks_of_their_own(
        app: Flask, broker: ListBroker) -> None:
    """priority="high" survives a lost doorbell: the sweep marks them urgent, as the commit
    did (Celery: a higher task priority, RQ: the front of the queue, Dramatiq: its queue)."""
    mail: OutboxMail = app.extensions["test_mail"]
    broker.down = True
    plain = _send(app, 1)
    high = _send(app, 1, priority="high")
    broker.down = False
    with app.app_context():
        assert mail.sweep().requeued == 2
    assert broker.tasks == [(high, True), (plain, False)]
    # An engine whose urgent route is a queue a worker may not read (Dramatiq's
    # <queue>.urgent) keeps the sweep's tasks on the main route: its fallback.
    broker.tasks.clear()
    broker.sweeps_urgent = False
    with app.app_context():
        db.session.execute(email_table.update().values(due_at=sa.func.current_timestamp()))
        db.session.commit()
        assert mail.sweep().requeued == 2
    assert broker.tasks == [(plain + high, False)]
    from flask_mail_outbox.contrib.dramatiq import DramatiqExecutor
    assert DramatiqExecutor.sweeps_urgent is False


def test_a_retry_is_published_when_due_not_when_the_row_is_as_old_as_the_age_gate(
        db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> None:
    """A task recorded the failure and returned: nothing retries it in memory anywhere."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR="rq")  # the default age gate: 300 s
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        smtp_server.reply("data", 451, "4.3.0 Try again later", times=1)
        [email_id] = _send(app, 1)
        assert executors.deliver_task([email_id], app=app)["retry"] == 1
        [row] = rows(app)
        assert row["status"] == "queued" and row["attempts"] == 1
        broker.tasks.clear()
        with app.app_context():
            assert mail.sweep().requeued == 0  # not due yet (the backoff: 2 s)
            db.session.execute(email_table.update().values(due_at=row["due_at"] - timedelta(
                seconds=5)))  # its backoff ran out
            db.session.commit()
            report = mail.sweep()
            # Published, so not reported as held back by the gate either.
            assert report.requeued == 1 and report.age_gated == 0
        assert broker.ids == [email_id]
        assert executors.deliver_task(broker.ids, app=app)["sent"] == 1
    finally:
        close_app(app)


def test_the_emails_a_paused_transport_held_are_published_when_its_probe_is_due(
        db_url: str, broker: ListBroker) -> None:
    """An unreachable server pauses its transport: the task holds the emails unsent (their
    attempt given back) and returns. Nothing retries them in memory, so the sweep publishes
    them at the probe's time, not once they are as old as the age gate (300 s here)."""
    app = make_app(db_url, MAIL_SERVER="127.0.0.1", MAIL_PORT=free_port(), MAIL_TIMEOUT=2,
                   OUTBOX_EXECUTOR="rq", OUTBOX_PAUSE_PROBE_SECONDS=0.01)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        ids = _send(app, 2)
        report = executors.deliver_task(ids, app=app)
        assert report["sent"] == 0 and report["paused"] + report["retry"] == 2, report
        assert {(r["status"], r["attempts"]) for r in rows(app)} == {("queued", 0)}
        broker.tasks.clear()
        with app.app_context():
            # Their probe is due: the held ones a moment after the refused one.
            taken = poll(lambda: mail.sweep().requeued, lambda n: n == 2, timeout=10,
                         interval=0.2)
        assert taken == 2 and sorted(broker.ids) == ids
    finally:
        close_app(app)


def test_the_sweep_publishes_an_expired_lease_after_reaping_it(
        app: Flask, broker: ListBroker) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    [email_id] = _send(app, 1)
    broker.tasks.clear()
    with app.app_context():
        # A worker claimed it and died: its lease ran out a minute ago.
        db.session.execute(email_table.update().where(email_table.c.id == email_id).values(
            status="sending", lease_owner="host:1:1:dead", attempts=1,
            lease_expires_at=sa.func.now() - timedelta(minutes=1)
            if db.engine.dialect.name == "postgresql"
            else sa.text("datetime('now', '-1 minute')")))
        db.session.commit()
        report = mail.sweep()
    assert report.requeued == 1 and broker.ids == [email_id]
    assert rows(app)[0]["status"] == "queued"


def test_a_tasks_thread_returns_once_its_emails_are_recorded_not_when_another_drain_ends(
        db_url: str, broker: ListBroker, smtp_server: FaultSMTPServer) -> None:
    """Dramatiq runs 8 threads of tasks in a process, and one drains at a time: a task
    whose emails another thread's drain took returns when they are recorded, while that
    drain still waits on a slow server (its message acknowledged, its thread free)."""
    with FaultSMTPServer() as slow:
        def smtp(server: FaultSMTPServer) -> dict[str, Any]:
            return {"transport": "smtp", "MAIL_SERVER": server.host, "MAIL_PORT": server.port,
                    "MAIL_TIMEOUT": 30}

        app = make_app(db_url, OUTBOX_EXECUTOR="rq",
                       OUTBOX_TRANSPORTS={"default": smtp(smtp_server), "slow": smtp(slow)})
        try:
            [held] = _send(app, 1, transport="slow")
            [quick] = _send(app, 1)
            slow.hold()
            reports: dict[str, dict[str, int]] = {}
            first = threading.Thread(target=lambda: reports.update(
                held=executors.deliver_task([held], app=app)), daemon=True)
            first.start()
            assert slow.wait_held(1, timeout=30)  # the first thread drains, its email held
            second = threading.Thread(target=lambda: reports.update(
                quick=executors.deliver_task([quick], app=app)), daemon=True)
            second.start()
            second.join(30)
            assert reports.get("quick", {}).get("sent") == 1, reports  # while one is held
            assert first.is_alive() and "held" not in reports
            slow.release()
            first.join(30)
            assert reports["held"]["sent"] == 1
            assert {r["status"] for r in rows(app)} == {"sent"}
        finally:
            slow.release()
            close_app(app)


def test_a_serving_process_with_an_executor_runs_no_dispatcher(
        db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR="rq", OUTBOX_DURABLE=True, OUTBOX_SWEEP_ON_STARTUP=False,
                   OUTBOX_SWEEP_MIN_AGE_SECONDS=0)
    try:
        state = app.extensions["mail_outbox"]
        # As a serving process does at its first request: the sweep jobs, and no
        # job that would start a dispatcher (durable mode starts one otherwise).
        scheduler = state.start_scheduler()
        assert "outbox-start-dispatcher" not in {job.id for job in scheduler._scheduler.get_jobs()}
        # That job runs at once where it exists: a second is ample to see its dispatcher.
        assert poll(lambda: state.outbox().dispatcher, timeout=1.0) is None
        _send(app, 1)
        assert state.outbox().dispatcher is None
        assert smtp_server.messages == [] and len(broker.tasks) == 1
        # Its periodic job sweeps, in durable mode too: it publishes what is due (here, a
        # doorbell the broker lost), where it would otherwise start a dispatcher.
        broker.tasks.clear()
        scheduler._periodic()
        assert len(broker.tasks) == 1 and state.outbox().dispatcher is None
    finally:
        close_app(app)


def test_the_startup_sweep_publishes_what_a_lost_doorbell_left(
        db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> None:
    """A process killed between its commit and the publish (here: a broker that refused):
    the next serving process's startup sweep publishes the rows to the task queue."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR="rq", OUTBOX_SWEEP_ON_STARTUP=True,
                   OUTBOX_SWEEP_MIN_AGE_SECONDS=0)
    try:
        broker.down = True
        ids = _send(app, 3)
        broker.down = False
        assert broker.tasks == []
        scheduler = app.extensions["mail_outbox"].start_scheduler()
        assert scheduler.startup_done.wait(30)
        assert scheduler.startup_report is not None
        assert scheduler.startup_report.requeued == 3 and sorted(broker.ids) == ids
        assert smtp_server.messages == []  # published, not delivered here
        for task_ids, _ in broker.tasks:
            executors.deliver_task(task_ids, app=app)
        assert {r["status"] for r in rows(app)} == {"sent"}
    finally:
        close_app(app)


def test_task_arguments_and_a_worker_without_the_app_fail_loudly(broker: ListBroker) -> None:
    with pytest.raises(TypeError, match="ids must be a list of integers"):
        executors.deliver_task(["1; DROP TABLE"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="ids must be a list of integers"):
        executors.deliver_task("12")  # type: ignore[arg-type]


def test_an_engine_not_installed_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['rq'] = None\n"
        "from flask import Flask\n"
        "from flask_sqlalchemy import SQLAlchemy\n"
        "from flask_mail_outbox import OutboxMail, ConfigError\n"
        f"app = Flask('x'); app.config.update(SQLALCHEMY_DATABASE_URI='sqlite:///{tmp_path}/a.db', "
        "OUTBOX_EXECUTOR='rq', OUTBOX_RUN_SCHEDULER=False)\n"
        "SQLAlchemy(app)\n"
        "try:\n    OutboxMail(app)\nexcept ConfigError as exc:\n    print('ERR', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ERR OUTBOX_EXECUTOR: 'rq' needs rq installed: "
                          "pip install 'flask-mail-outbox[rq]'"), out


def test_a_task_in_a_process_without_the_app_says_how_to_fix_it() -> None:
    script = ("import os; os.environ.pop('FLASK_APP', None); os.chdir('/')\n"
              "from flask_mail_outbox._flask.executors import deliver_task\n"
              "from flask_mail_outbox import ConfigError\n"
              "try:\n    deliver_task([1])\nexcept ConfigError as exc:\n    print('ERR', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ERR OUTBOX_EXECUTOR: this worker process has no Flask app") \
        and "FLASK_APP" in out, out


def test_the_first_tasks_of_a_workers_threads_load_flask_app_once(tmp_path: Path) -> None:
    """Eight threads (Dramatiq's default, a Celery threads pool) start with their first
    tasks in a process that has only FLASK_APP: one app is made, not one per thread (two
    would make every later task refuse: "this worker process has 2 Flask apps")."""
    (tmp_path / "slowapp.py").write_text(
        "import time\n"
        "from flask import Flask\n"
        "from flask_sqlalchemy import SQLAlchemy\n"
        "from flask_mail_outbox import OutboxMail\n"
        "def create_app():\n"
        "    time.sleep(0.3)  # a factory that takes a moment (imports, config files)\n"
        "    app = Flask('slowapp')\n"
        f"    app.config.update(SQLALCHEMY_DATABASE_URI='sqlite:///{tmp_path}/a.db',\n"
        "        OUTBOX_EXECUTOR='rq', OUTBOX_EXECUTOR_URL='redis://127.0.0.1:1/0',\n"
        "        OUTBOX_RUN_SCHEDULER=False)\n"
        "    OutboxMail(app, db=SQLAlchemy(app))\n"
        "    return app\n")
    script = (
        "import threading\n"
        "from flask_mail_outbox._flask.executors import task_app\n"
        "found, errors = [], []\n"
        "def run():\n"
        "    try:\n        found.append(task_app())\n"
        "    except Exception as exc:\n        errors.append(exc)\n"
        "threads = [threading.Thread(target=run) for _ in range(8)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(len(found), len({id(a) for a in found}), errors[:1])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "FLASK_APP": "slowapp:create_app",
                              "PYTHONPATH": f"{tmp_path}{os.pathsep}"
                                            f"{os.environ.get('PYTHONPATH', '')}"}).stdout
    assert out.strip() == "8 1 []", out


def test_config_keys_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_EXECUTOR: expected one of"):
        make_app(f"sqlite:///{tmp_path}/a.db", OUTBOX_EXECUTOR="huey")


def test_a_task_fails_over_as_a_dispatcher_does(
        db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> None:
    """The task runs the same lanes: a primary that refuses connections hands the
    email to its failover transport within the same task."""
    from conftest import free_port

    app = make_app(db_url, OUTBOX_EXECUTOR="rq", OUTBOX_TRANSPORTS={
        "default": {"transport": "smtp", "MAIL_SERVER": "127.0.0.1", "MAIL_PORT": free_port(),
                    "MAIL_TIMEOUT": 2, "failover": ["backup"]},
        "backup": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                   "MAIL_PORT": smtp_server.port}})
    try:
        [email_id] = _send(app, 1)
        assert executors.deliver_task([email_id], app=app)["sent"] == 1
        [row] = rows(app)
        assert row["status"] == "sent" and len(smtp_server.messages) == 1
    finally:
        close_app(app)


def test_a_task_keeps_the_shared_rate_limit(
        db_url: str, smtp_server: FaultSMTPServer, broker: ListBroker) -> None:
    """Four emails in one task on a transport limited to 4 a second (an even stream,
    a slot each): the last goes out no sooner than 0.75 s after the first (a lower
    bound: a loaded machine only spreads them more)."""
    app = make_app(db_url, OUTBOX_EXECUTOR="rq", OUTBOX_TRANSPORTS={
        "default": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                    "MAIL_PORT": smtp_server.port, "rate_limit": "4/s"}})
    try:
        ids = _send(app, 4)
        assert executors.deliver_task(ids, app=app)["sent"] == 4
        times = sorted(m.received_at for m in smtp_server.messages)
        assert len(times) == 4 and times[-1] - times[0] >= 0.7, times
    finally:
        close_app(app)
