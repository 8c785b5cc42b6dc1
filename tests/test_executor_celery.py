"""OUTBOX_EXECUTOR = "celery": real Celery worker processes, a private Redis, PostgreSQL.

The producer is the test process's app (``tests/executor_celery_app.py``): its
commits publish ``flask_mail_outbox.deliver`` tasks to the Redis broker. Worker
processes (``celery -A executor_celery_app worker``) deliver them to the test's
SMTP server, which counts messages by Message-ID. A task's counts are read from
the worker's log (Celery logs each task's return value); the broker's queue is
read with Redis's LLEN (every priority list of the queue). The sweep task is
run through the engine: the test publishes it, a worker runs it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from conftest import poll
from executor_celery_app import create_app
from executor_celery_app import db as app_db
from flask import Flask
from redis_server import RedisServer, redis_server  # noqa: F401 - the fixture
from smtpserver import FaultSMTPServer
from test_workers import pg_url  # noqa: F401 - the fixture

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox.contrib.celery import (
    DELIVER,
    SWEEP,
    CeleryExecutor,
    beat_schedule,
    find_celery,
)
from flask_mail_outbox.core import email_table

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
QUEUE = "outbox"

#: Settings shared by the producer and the workers: a sweep takes due rows one second
#: old (the age gate: a row younger may still be in a task on its way), retries come
#: after a second.
SHARED: dict[str, Any] = {"OUTBOX_SWEEP_MIN_AGE_SECONDS": 1.0,
                          "OUTBOX_RETRY_BASE_SECONDS": 1.0}

_DONE = re.compile(r"Task (flask_mail_outbox\.\w+)\[([\w-]+)\] succeeded in [\d.]+s: (\{.*\})")


class CeleryWorker:
    """One ``celery worker`` process on the test's broker, database and SMTP server."""

    def __init__(self, name: str, tmp_path: Path, db_url: str, smtp_port: int,
                 broker_url: str, *, pool: str, concurrency: int,
                 config: dict[str, Any], beat: float | None = None) -> None:
        self.name = name
        self.log_path = tmp_path / f"celery-{name}.log"
        env = dict(os.environ)
        env.update({"PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}", "EXEC_DB_URL": db_url,
                    "EXEC_SMTP_PORT": str(smtp_port), "EXEC_BROKER_URL": broker_url,
                    "EXEC_CONFIG": json.dumps(config)})
        if beat is None:
            command = ["worker", "-Q", QUEUE, "-n", f"{name}@%h", "--pool", pool,
                       "--concurrency", str(concurrency), "--prefetch-multiplier", "1",
                       "--without-gossip", "--without-mingle", "--without-heartbeat"]
        else:  # `celery beat` with the sweep's entry, its schedule file in tmp_path
            env["EXEC_BEAT_SECONDS"] = str(beat)
            command = ["beat", "--schedule", str(tmp_path / f"beat-{name}")]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "executor_celery_app", *command,
                 "--loglevel", "INFO"],
                env=env, cwd=str(TESTS), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def results(self, task: str = DELIVER) -> list[dict[str, int]]:
        """The counts of each ``task`` this worker finished, in order."""
        return [json.loads(m[3].replace("'", '"')) for m in _DONE.finditer(self.log())
                if m[1] == task]

    def wait_log(self, predicate: Callable[[CeleryWorker], bool], timeout: float,
                 what: str) -> None:
        if poll(lambda: predicate(self) or self.proc.poll() is not None, timeout=timeout):
            if predicate(self):
                return
            pytest.fail(f"celery worker {self.name} exited ({self.proc.returncode}) while "
                        f"waiting for {what}:\n{self.log()[-4000:]}")
        pytest.fail(f"celery worker {self.name}: no {what} within {timeout} s:\n"
                    f"{self.log()[-4000:]}")

    def wait_ready(self, timeout: float = 60.0) -> CeleryWorker:
        self.wait_log(lambda w: " ready." in w.log(), timeout, "'ready.'")
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Celery's warm shutdown); the exit code, None if still running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


@pytest.fixture
def producer(request: pytest.FixtureRequest, pg_url: str,  # noqa: F811 - fixtures
             smtp_server: FaultSMTPServer,
             redis_server: RedisServer) -> Iterator[Flask]:  # noqa: F811
    """The web app: creates the tables, publishes after each commit, never delivers.

    A test function's ``producer_config`` attribute adds config keys.
    """
    extra = getattr(request.function, "producer_config", {})
    app = create_app(pg_url, smtp_server.port, redis_server.url, **{**SHARED, **extra})
    with app.app_context():
        app_db.create_all()
        app.extensions["mail_outbox"].ext.create_all()
    yield app
    app.extensions["mail_outbox"].ext.stop(timeout=5)
    with app.app_context():
        app_db.session.remove()
        # The session's PostgreSQL database is shared: the app's own table goes (a test
        # that compares the schema with its models would find it).
        app_db.drop_all()
        app_db.engine.dispose()


@pytest.fixture
def spawn(tmp_path: Path, pg_url: str, producer: Flask,  # noqa: F811 - fixtures
          smtp_server: FaultSMTPServer,
          redis_server: RedisServer) -> Iterator[Callable[..., CeleryWorker]]:  # noqa: F811
    """Start Celery workers (after the producer made the tables); all killed at the end."""
    started: list[CeleryWorker] = []

    def start(name: str, *, pool: str = "threads", concurrency: int = 2,
              beat: float | None = None, **config: Any) -> CeleryWorker:
        worker = CeleryWorker(name, tmp_path, pg_url, smtp_server.port, redis_server.url,
                              pool=pool, concurrency=concurrency, config={**SHARED, **config},
                              beat=beat)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()


def broker_length(server: RedisServer, queue: str = QUEUE) -> int:
    """Messages waiting in ``queue`` (kombu's Redis transport: one list per priority)."""
    client = redis.Redis.from_url(server.url)
    try:
        keys = [queue] + [f"{queue}\x06\x16{p}" for p in range(1, 10)]
        return sum(int(client.llen(k)) for k in keys)
    finally:
        client.close()


def send(app: Flask, subject: str, **options: Any) -> int:
    mail: OutboxMail = app.extensions["mail_outbox"].ext
    with app.app_context():
        email_id = mail.send(Message(subject, recipients=["a@example.com"], body="x"),
                             **options)
        app_db.session.commit()
    return email_id


def run_sweep(app: Flask) -> None:
    """Publish the sweep task (a worker runs it), as ``celery beat`` would."""
    app.extensions["celery"].send_task(SWEEP, queue=QUEUE, ignore_result=True)


def rows(app: Flask) -> list[dict[str, Any]]:
    """Every ``outbox_email`` row, by id (read with this app's Flask-SQLAlchemy)."""
    with app.app_context(), app_db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            email_table.select().order_by(email_table.c.id)).mappings()]


def wait_rows(app: Flask, predicate: Callable[[list[dict[str, Any]]], bool],
              timeout: float, interval: float = 0.05) -> list[dict[str, Any]]:
    return poll(lambda: rows(app), predicate, timeout=timeout, interval=interval)


def row(app: Flask, email_id: int) -> dict[str, Any]:
    return next(r for r in rows(app) if r["id"] == email_id)


# -- 1. commit -> task -> a real worker delivers -----------------------------------------


def test_a_view_that_commits_is_delivered_by_a_prefork_worker(
        producer: Flask, spawn: Callable[..., CeleryWorker],
        smtp_server: FaultSMTPServer) -> None:
    """Prefork: the worker's children fork after the app was made; each builds its own core."""
    worker = spawn("w1", pool="prefork", concurrency=2).wait_ready()
    client = producer.test_client()
    for n in range(6):
        assert client.post(f"/signup/{n}").status_code == 200
    assert smtp_server.wait_for(6, timeout=30), worker.log()[-3000:]
    current = wait_rows(producer, lambda rs: all(r["status"] == "sent" for r in rs),
                        timeout=10)
    assert Counter(r["status"] for r in current) == {"sent": 6}
    assert sorted(m.parsed["Subject"] for m in smtp_server.messages) == sorted(
        f"signup {n}" for n in range(6))
    assert sum(r["sent"] for r in worker.results()) == 6
    # The children (not the master) delivered: lease owners name other pids.
    assert worker.stop() == 0


# -- 2. rollback -> nothing published ----------------------------------------------------


def test_a_view_that_rolls_back_publishes_nothing(
        producer: Flask, redis_server: RedisServer,  # noqa: F811 - fixture
        smtp_server: FaultSMTPServer) -> None:
    client = producer.test_client()
    assert client.post("/signup-fails/1").status_code == 200
    assert broker_length(redis_server) == 0
    assert rows(producer) == []
    # The control: a commit publishes one task.
    assert client.post("/signup/2").status_code == 200
    assert broker_length(redis_server) == 1
    assert smtp_server.messages == []


# -- 3. a task for ids it cannot claim returns quietly; twice sends once -----------------


def test_a_task_for_ids_it_cannot_claim_returns_quietly(
        producer: Flask, spawn: Callable[..., CeleryWorker],
        smtp_server: FaultSMTPServer) -> None:
    worker = spawn("w1").wait_ready()
    sent = send(producer, "sent already")
    assert smtp_server.wait_for(1, timeout=30), worker.log()[-3000:]
    wait_rows(producer, lambda rs: rs[0]["status"] == "sent", timeout=10)
    elsewhere = send(producer, "claimed elsewhere", send_after=timedelta(hours=1))
    later = send(producer, "not due", send_after=timedelta(hours=1))
    with producer.app_context(), app_db.engine.begin() as conn:
        conn.execute(email_table.update().where(email_table.c.id == elsewhere).values(
            status="sending", lease_owner="elsewhere:1:1:abc", due_at=sa.func.now(),
            lease_expires_at=sa.func.now() + timedelta(minutes=5)))
    celery = producer.extensions["celery"]
    for _ in range(2):  # the same message twice: a redelivery (same task id)
        celery.send_task(DELIVER, args=([sent, elsewhere, later],), queue=QUEUE,
                         task_id="redelivered-task")
    worker.wait_log(lambda w: len(w.results()) >= 3, 30, "three deliver tasks")
    assert worker.results()[1:] == [
        {"sent": 0, "failed": 0, "retry": 0, "suppressed": 0, "expired": 0,
         "cancelled": 0, "paused": 0, "not_claimed": 3}] * 2
    assert "Traceback" not in worker.log()
    assert len(smtp_server.messages) == 1
    assert {r["id"]: r["status"] for r in rows(producer)} == {
        sent: "sent", elsewhere: "sending", later: "queued"}
    # A task that cannot be right raises loudly, once: Celery does not retry it.
    celery.send_task(DELIVER, args=(["1; DROP TABLE outbox_email"],), queue=QUEUE)
    worker.wait_log(lambda w: "raised unexpected: TypeError" in w.log(), 30, "the TypeError")
    time.sleep(0.5)
    assert worker.log().count("raised unexpected") == 1
    assert "Retry in" not in worker.log()


def test_a_task_delivered_twice_sends_once(
        producer: Flask, spawn: Callable[..., CeleryWorker], redis_server: RedisServer,  # noqa: F811
        smtp_server: FaultSMTPServer) -> None:
    """kombu #337: Redis redelivers a message after its visibility timeout; the claim
    makes the second run harmless. Both copies wait in the broker; two worker processes
    take one each."""
    email_id = send(producer, "once")
    celery = producer.extensions["celery"]
    celery.send_task(DELIVER, args=([email_id],), queue=QUEUE)
    assert broker_length(redis_server) == 2
    workers = [spawn(f"w{n}", concurrency=1) for n in (1, 2)]
    poll(lambda: sum(len(w.results()) for w in workers) == 2, timeout=60)
    results = [r for w in workers for r in w.results()]
    assert sorted((r["sent"], r["not_claimed"]) for r in results) == [(0, 1), (1, 0)], \
        [w.log()[-2000:] for w in workers]
    time.sleep(0.5)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["once"]
    assert row(producer, email_id)["status"] == "sent"


# -- 4. broker down at commit --------------------------------------------------------------


def test_broker_down_at_commit_keeps_the_row_for_the_sweep(
        producer: Flask, spawn: Callable[..., CeleryWorker], redis_server: RedisServer,  # noqa: F811
        smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    redis_server.kill()
    started = time.monotonic()
    assert producer.test_client().post("/signup/1").status_code == 200
    took = time.monotonic() - started
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    text = errors[0].getMessage()
    assert "Could not publish 1 email(s) to the celery broker" in text
    assert "stay queued in the database" in text and "flask_mail_outbox.sweep" in text
    assert [r["status"] for r in rows(producer)] == ["queued"]
    print(f"[celery] a commit with the broker down took {took:.2f} s")
    assert took < 10

    redis_server.start()
    assert broker_length(redis_server) == 0
    worker = spawn("w1").wait_ready()
    time.sleep(1.0)  # the age gate (OUTBOX_SWEEP_MIN_AGE_SECONDS=1)
    run_sweep(producer)
    assert smtp_server.wait_for(1, timeout=30), worker.log()[-3000:]
    assert worker.results(SWEEP)[0]["published"] == 1
    assert [r["status"] for r in wait_rows(
        producer, lambda rs: rs[0]["status"] == "sent", timeout=10)] == ["sent"]


# -- 5. a transient failure: no broker retry; the sweep publishes it when due --------------


def test_a_transient_failure_waits_for_the_sweep_not_a_broker_retry(
        producer: Flask, spawn: Callable[..., CeleryWorker],
        smtp_server: FaultSMTPServer) -> None:
    smtp_server.reply("data", 451, "4.3.0 try later", times=1)
    worker = spawn("w1").wait_ready()
    email_id = send(producer, "greylisted")
    worker.wait_log(lambda w: bool(w.results()), 30, "the deliver task")
    assert worker.results() == [{"sent": 0, "failed": 0, "retry": 1, "suppressed": 0,
                                 "expired": 0, "cancelled": 0, "paused": 0,
                                 "not_claimed": 0}]
    first = row(producer, email_id)
    assert first["status"] == "queued" and first["attempts"] == 1
    assert first["due_at"] > first["created_at"]
    # Past its due time, nothing retries it without a sweep: no broker retry.
    time.sleep(2.5)
    assert row(producer, email_id)["status"] == "queued"
    assert smtp_server.messages == []
    assert "Retry in" not in worker.log()
    run_sweep(producer)
    assert smtp_server.wait_for(1, timeout=30), worker.log()[-3000:]
    done = wait_rows(producer, lambda rs: rs[0]["status"] == "sent", timeout=10)[0]
    assert done["attempts"] == 2
    assert len(smtp_server.messages) == 1
    assert len(worker.results()) == 2


# -- 6. send_after: never a broker ETA -----------------------------------------------------


def test_send_after_is_published_by_the_sweep_once_due(
        producer: Flask, spawn: Callable[..., CeleryWorker], redis_server: RedisServer,  # noqa: F811
        smtp_server: FaultSMTPServer) -> None:
    email_id = send(producer, "later", send_after=timedelta(minutes=10))
    assert broker_length(redis_server) == 0  # nothing published, no ETA task either
    worker = spawn("w1").wait_ready()
    run_sweep(producer)
    worker.wait_log(lambda w: bool(w.results(SWEEP)), 30, "the first sweep")
    assert worker.results(SWEEP)[0]["published"] == 0
    assert row(producer, email_id)["status"] == "queued"
    # Its time comes (moved, not waited for: a loaded machine starts a worker slowly).
    with producer.app_context():
        app_db.session.execute(email_table.update().where(email_table.c.id == email_id)
                               .values(due_at=email_table.c.due_at - timedelta(minutes=10)))
        app_db.session.commit()
    due = row(producer, email_id)["due_at"]
    deadline = time.monotonic() + 30
    while not smtp_server.messages and time.monotonic() < deadline:
        run_sweep(producer)
        smtp_server.wait_for(1, timeout=0.5)
    assert len(smtp_server.messages) == 1, worker.log()[-3000:]
    sent = wait_rows(producer, lambda rs: rs[0]["status"] == "sent", timeout=10)[0]
    assert sent["sent_at"] >= due
    assert "eta" not in worker.log().lower().replace("beta", "")


def test_celery_beat_runs_the_sweep_from_the_beat_schedule_entry(
        producer: Flask, spawn: Callable[..., CeleryWorker],
        smtp_server: FaultSMTPServer) -> None:
    """The entry of beat_schedule() as `celery beat` reads it: no sweep published by hand."""
    email_id = send(producer, "by beat", send_after=timedelta(seconds=2))
    worker = spawn("w1").wait_ready()
    beat = spawn("beat", beat=1.0)
    assert smtp_server.wait_for(1, timeout=30), beat.log()[-2000:] + worker.log()[-2000:]
    assert row(producer, email_id)["status"] in ("sending", "sent")
    assert worker.results(SWEEP), worker.log()[-2000:]
    assert "Scheduler: Sending due task flask_mail_outbox.sweep" in beat.log()
    beat.stop()


# -- 7. per-key order ----------------------------------------------------------------------


def test_the_emails_of_a_key_are_delivered_in_send_order(
        producer: Flask, spawn: Callable[..., CeleryWorker],
        smtp_server: FaultSMTPServer) -> None:
    workers = [spawn(f"w{n}", concurrency=2).wait_ready() for n in (1, 2)]
    for n in range(12):
        send(producer, f"k {n}", key="account-1")
    assert smtp_server.wait_for(12, timeout=60), workers[0].log()[-3000:]
    assert [m.parsed["Subject"] for m in smtp_server.messages] == [f"k {n}" for n in range(12)]
    assert all(r["status"] == "sent" for r in wait_rows(
        producer, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10))


# -- urgent emails: a priority the broker serves first -----------------------------------------


def test_an_urgent_email_overtakes_the_tasks_waiting_in_the_broker(
        producer: Flask, spawn: Callable[..., CeleryWorker], redis_server: RedisServer,  # noqa: F811
        smtp_server: FaultSMTPServer) -> None:
    for n in range(5):
        send(producer, f"normal {n}")
    send(producer, "urgent", priority="high")
    assert broker_length(redis_server) == 6
    worker = spawn("w1", concurrency=1).wait_ready()
    assert smtp_server.wait_for(6, timeout=30), worker.log()[-3000:]
    subjects = [m.parsed["Subject"] for m in smtp_server.messages]
    # One task may be prefetched before the urgent one is seen (prefetch multiplier 1).
    assert "urgent" in subjects[:2], subjects


# -- bad configuration ---------------------------------------------------------------------


def test_no_celery_app_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    from celery import Celery
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("no_celery")
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'x.db'}",
                      OUTBOX_EXECUTOR="celery")
    Celery("unconfigured").set_default()  # a current app without a broker
    with pytest.raises(ConfigError) as info:
        find_celery(app)
    assert info.value.key == "OUTBOX_EXECUTOR"
    assert "app.extensions['celery']" in str(info.value)
    with pytest.raises(ConfigError, match="OUTBOX_EXECUTOR: 'celery' needs a Celery app"):
        OutboxMail(app, db=SQLAlchemy(app))  # init_app fails at once, naming the key
    mine = Celery("mine", broker="redis://127.0.0.1:1/0")
    app.extensions["celery"] = mine
    Celery("other", broker="redis://127.0.0.1:2/0").set_default()
    assert find_celery(app) is mine  # the Flask app's own, before the current one
    app.extensions["celery"] = object()
    with pytest.raises(ConfigError, match="found object"):
        find_celery(app)
    configured = Celery("configured", broker="redis://127.0.0.1:1/0")
    configured.set_default()
    del app.extensions["celery"]
    assert find_celery(app) is configured  # the current app, since it has a broker


def test_urgent_priorities_follow_the_brokers_order() -> None:
    from celery import Celery

    on_redis = CeleryExecutor(Celery("r", broker="redis://127.0.0.1:1/0"), "outbox")
    assert (on_redis.urgent_priority, on_redis.normal_priority) == (0, 6)
    on_amqp = CeleryExecutor(Celery("a", broker="amqp://guest@127.0.0.1//"), "outbox")
    assert (on_amqp.urgent_priority, on_amqp.normal_priority) == (9, None)


def test_beat_schedule_entry() -> None:
    assert beat_schedule(30, queue="mail") == {SWEEP: {
        "task": SWEEP, "schedule": 30.0, "options": {"queue": "mail", "expires": 30.0}}}
    with pytest.raises(ValueError):
        beat_schedule(0)


# -- 8. the chaos proof ----------------------------------------------------------------------

CHAOS_TOTAL = 2000
CHAOS_CONNECTIONS = 4
CHAOS_BATCH = 20
CHAOS_DATA_DELAY = 0.03


def _sending_of(app: Flask, pid: int) -> int:
    t = email_table
    with app.app_context(), app_db.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(
            t.c.status == "sending", t.c.lease_owner.like(f"%:{pid}:%"))).scalar_one())


def test_chaos_sigkill_a_worker_and_restart_redis_lose_nothing(
        producer: Flask, spawn: Callable[..., CeleryWorker], redis_server: RedisServer,  # noqa: F811
        smtp_server: FaultSMTPServer, capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    with capsys.disabled():
        print(f"\n[celery chaos] seed={seed} (replay: CHAOS_SEED={seed})")
    config = {"OUTBOX_LEASE_SECONDS": 5, "OUTBOX_BATCH_SIZE": CHAOS_BATCH,
              "OUTBOX_CONCURRENCY": CHAOS_CONNECTIONS, "OUTBOX_SWEEP_MIN_AGE_SECONDS": 3.0}
    mail: OutboxMail = producer.extensions["mail_outbox"].ext
    with producer.app_context():
        for first in range(0, CHAOS_TOTAL, 250):
            for i in range(first, first + 250):
                mail.send(Message(f"chaos {i}", recipients=[f"r{i % 50}@example.com"],
                                  body=f"email number {i}"))
            app_db.session.commit()
    expected = {r["message_id"] for r in rows(producer)}
    assert len(expected) == CHAOS_TOTAL

    smtp_server.delay("data", CHAOS_DATA_DELAY)
    workers = {name: spawn(name, concurrency=2, **config) for name in ("w1", "w2")}
    for worker in workers.values():
        worker.wait_ready()
    began = time.monotonic()
    stop_sweeping = threading.Event()
    sweeps = Counter[str]()

    def sweeper() -> None:  # the beat: a sweep every second, through the broker
        while not stop_sweeping.wait(1.0):
            try:
                run_sweep(producer)
                sweeps["published"] += 1
            except Exception:  # noqa: BLE001 - the broker is down: beat would skip too
                sweeps["refused"] += 1

    sweeping = threading.Thread(target=sweeper, name="beat", daemon=True)
    sweeping.start()
    try:
        assert smtp_server.wait_for(int(CHAOS_TOTAL * 0.3), timeout=120)
        pids = {name: w.pid for name, w in workers.items()}

        def holding() -> list[str]:
            return [n for n, p in pids.items() if _sending_of(producer, p)]

        name = rng.choice(poll(holding, timeout=30, interval=0.02) or ["w1"])
        time.sleep(rng.uniform(0.0, 0.2))
        victim = workers[name]
        received_at_kill = len(smtp_server.messages)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        in_flight = _sending_of(producer, victim.pid)
        workers[name] = spawn(f"{name}-restarted", concurrency=2, **config)
        killed_at = time.monotonic() - began

        assert smtp_server.wait_for(int(CHAOS_TOTAL * 0.6), timeout=120)
        received_at_restart = len(smtp_server.messages)
        queued_in_redis = broker_length(redis_server)
        redis_server.restart(down_for=1.0)
        redis_at = time.monotonic() - began

        assert smtp_server.wait_until(
            lambda: expected <= {m.message_id for m in smtp_server.messages}, timeout=150), (
            f"seed={seed}: {len(expected - set(smtp_server.message_ids()))} never arrived")
        drained = time.monotonic() - began
    finally:
        stop_sweeping.set()
        sweeping.join(10)
    current = wait_rows(producer, lambda rs: all(r["status"] == "sent" for r in rs),
                        timeout=60, interval=0.2)
    assert Counter(r["status"] for r in current) == {"sent": CHAOS_TOTAL}
    received = Counter(smtp_server.message_ids())
    lost = expected - set(received)
    unknown = set(received) - expected
    duplicates = sum(n - 1 for n in received.values() if n > 1)
    summary = (f"[celery chaos] seed={seed} emails={CHAOS_TOTAL} workers=2 (threads x2, "
               f"{CHAOS_CONNECTIONS} connections each) kill of {name} at {killed_at:.1f} s "
               f"({received_at_kill} received, {in_flight} rows in flight under its leases); "
               f"redis restart at {redis_at:.1f} s ({received_at_restart} received, "
               f"{queued_in_redis} messages lost with it); sweeps {dict(sweeps)}; "
               f"duplicates={duplicates} lost={len(lost)}; all received at {drained:.1f} s")
    with capsys.disabled():
        print(summary)
    assert (lost, unknown) == (set(), set()), summary
    # Only a row the server accepted before its sender died unrecorded can arrive twice:
    # at most the rows in flight under the killed worker's leases.
    assert duplicates <= in_flight, summary
    for worker in workers.values():
        assert worker.stop() == 0, worker.log()[-3000:]
    assert all(r["attempts"] <= 2 for r in current), summary


test_chaos_sigkill_a_worker_and_restart_redis_lose_nothing.producer_config = {  # type: ignore[attr-defined]
    "OUTBOX_BATCH_SIZE": CHAOS_BATCH}  # tasks of 20 ids
