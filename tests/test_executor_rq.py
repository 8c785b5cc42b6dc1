"""OUTBOX_EXECUTOR = "rq": real RQ worker processes on a private Redis, PostgreSQL, SMTP.

The test process is the producer (``OUTBOX_EXECUTOR = "rq"``: a commit publishes
``deliver`` jobs); the workers are ``rq worker`` subprocesses running
:class:`flask_mail_outbox.contrib.rq.OutboxWorker` with the app of
``tests/executor_rq_app.py`` (``FLASK_APP``). The sweep job runs through RQ as
well (:func:`~flask_mail_outbox.contrib.rq.enqueue_sweep` publishes it, a worker
runs it), except where a test reads the sweep's counts in-process.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import (
    close_app,
    db,
    empty_postgres,
    make_app,
    poll,
    require_postgres,
    rows,
)
from executor_rq_app import COMMON
from flask import Flask
from redis import Redis
from redis_server import RedisServer
from rq import Queue
from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox._flask.executors import sweep_task
from flask_mail_outbox.contrib.rq import (
    DELIVER,
    JOB_TIMEOUT,
    SWEEP,
    enqueue_sweep,
    register_sweep,
)
from flask_mail_outbox.core import email_table

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
QUEUE = "outbox"
OUTBOX_WORKER = "flask_mail_outbox.contrib.rq.OutboxWorker"
FORKING_WORKER = "executor_rq_app.ForkingWorker"


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_database: str | None) -> str:
    require_postgres()
    assert pg_database is not None
    return empty_postgres(pg_database)


@pytest.fixture
def producer(pg_url: str, smtp_server: FaultSMTPServer, redis: RedisServer) -> Iterator[Flask]:
    """The web process: sends in views, publishes after commits, never delivers."""
    app = make_app(pg_url, **COMMON, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR_URL=redis.url)
    yield app
    close_app(app, timeout=5)


class RQWorker:
    """One ``rq worker`` subprocess on the test's Redis, logging to a file."""

    def __init__(self, name: str, tmp_path: Path, redis_url: str, env: dict[str, str],
                 worker_class: str, pool: int = 0) -> None:
        self.name = name
        self.log_path = tmp_path / f"rq-{name}.log"
        full_env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
                    "FLASK_APP": "executor_rq_app:create_app", **env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rq.cli", "worker", "--worker-class", worker_class,
                 "-u", redis_url, "--name", f"{name}-{time.monotonic_ns()}", QUEUE]
                if not pool else
                [sys.executable, "-m", "rq.cli", "worker-pool", "-n", str(pool),
                 "--worker-class", worker_class, "-u", redis_url, QUEUE],
                env=full_env, cwd=str(TESTS), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def horses(self) -> list[int]:
        """The pids of its work-horses (RQ's forking worker)."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == self.pid:  # the parent's pid
                children.append(int(stat.parent.name))
        return children

    def kill(self) -> None:
        """SIGKILL the worker and every process it started (a pool's workers, a horse)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def spawn(tmp_path: Path, pg_url: str, producer: Flask, smtp_server: FaultSMTPServer,
          redis: RedisServer) -> Iterator[Callable[..., RQWorker]]:
    """Start RQ workers (the tables exist: ``producer`` made them); all killed at the end."""
    started: list[RQWorker] = []

    def start(name: str, *, worker_class: str = OUTBOX_WORKER, pool: int = 0,
              **env: str) -> RQWorker:
        full = {"RQ_TEST_DB_URL": pg_url, "RQ_TEST_SMTP_PORT": str(smtp_server.port),
                "RQ_TEST_REDIS_URL": redis.url, **env}
        worker = RQWorker(name, tmp_path, redis.url, full, worker_class, pool)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def queue_of(redis: RedisServer) -> Queue:
    return Queue(QUEUE, connection=Redis.from_url(redis.url))


def send(app: Flask, subjects: list[str], *, key: str | None = None, **options: Any) -> list[int]:
    """Queue one email per subject in one commit; their ids."""
    mail = mail_of(app)
    with app.app_context():
        ids = [mail.send(Message(s, recipients=["a@example.com"], body=s), key=key, **options)
               for s in subjects]
        db.session.commit()
    return ids


def statuses(app: Flask) -> Counter[str]:
    return Counter(r["status"] for r in rows(app))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def wait_sent(app: Flask, n: int, timeout: float = 30.0) -> None:
    done = poll(lambda: statuses(app), lambda c: c == Counter(sent=n), timeout=timeout,
                interval=0.1)
    assert done == Counter(sent=n), done


def run_sweep_job(app: Flask, redis: RedisServer, timeout: float = 20.0) -> None:
    """Publish one sweep job and wait until a worker ran it (``result_ttl=0``: its
    hash is gone once it succeeded)."""
    job = enqueue_sweep(app)
    assert poll(lambda: not job.connection.exists(job.key), timeout=timeout, interval=0.05), \
        f"the sweep job {job.id} did not finish: {job.get_status(refresh=True)}"


# -- the required cases ----------------------------------------------------------------------


def test_a_committed_send_is_published_and_a_worker_delivers_it(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    mail = mail_of(producer)

    @producer.post("/signup")
    def signup() -> str:
        mail.send(Message("welcome", recipients=["new@example.com"], body="hi"))
        db.session.commit()
        return "ok"

    assert producer.test_client().post("/signup").status_code == 200
    queue = queue_of(redis)
    assert queue.count == 1  # published at the commit, before any worker runs
    job = queue.jobs[0]
    assert (job.func_name, job.args, job.result_ttl, job.retries_left) == (
        DELIVER, ([rows(producer)[0]["id"]],), 0, None)
    worker = spawn("w1")
    wait_sent(producer, 1)
    assert smtp_server.wait_for(1)
    assert [m.parsed.get("Subject") for m in smtp_server.messages] == ["welcome"]
    assert f"pid={worker.pid}" in poll(worker.log, lambda t: "rq-test sent" in t, timeout=5)
    # result_ttl=0: nothing of the job stays in Redis.
    assert poll(lambda: queue.count == 0 and not queue.connection.keys("rq:job:*"), timeout=5)


def test_a_rolled_back_send_publishes_nothing(producer: Flask, spawn: Callable[..., RQWorker],
                                              smtp_server: FaultSMTPServer,
                                              redis: RedisServer) -> None:
    mail = mail_of(producer)

    @producer.post("/signup")
    def signup() -> str:
        mail.send(Message("never", recipients=["new@example.com"], body="hi"))
        db.session.rollback()
        return "rolled back"

    assert producer.test_client().post("/signup").status_code == 200
    queue = queue_of(redis)
    assert queue.count == 0
    assert not queue.connection.keys("rq:job:*")
    spawn("w1")
    send(producer, ["after"])  # a later commit is delivered: the worker was running
    wait_sent(producer, 1)
    assert [m.parsed.get("Subject") for m in smtp_server.messages] == ["after"]


def test_a_job_for_ids_it_cannot_claim_returns_quietly(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    spawn("w1")
    [sent] = send(producer, ["sent already"])
    wait_sent(producer, 1)
    later = datetime.now(UTC) + timedelta(hours=1)
    [not_due] = send(producer, ["later"], send_after=later)
    # One claimed by another process: a live lease that is not this worker's.
    [held] = send(producer, ["held"])
    with producer.app_context(), db.engine.begin() as conn:
        conn.execute(sa.update(email_table).where(email_table.c.id == held).values(
            status="sending", lease_owner="elsewhere:1:x",
            lease_expires_at=sa.func.now() + timedelta(minutes=10)))
    queue = queue_of(redis)
    assert poll(lambda: queue.count == 0, timeout=10)  # the commits' own jobs ran
    job = queue.enqueue_call(DELIVER, args=([sent, not_due, held, 999_999],), result_ttl=60)
    result = poll(lambda: job.latest_result(), timeout=10)
    assert result is not None and result.type == result.Type.SUCCESSFUL, result
    assert result.return_value == {"sent": 0, "failed": 0, "retry": 0, "suppressed": 0,
                                   "expired": 0, "cancelled": 0, "paused": 0,
                                   "not_claimed": 4, "claimed": 0}
    assert len(smtp_server.messages) == 1
    assert statuses(producer) == Counter(sent=1, queued=1, sending=1)
    assert FailedJobRegistry(QUEUE, connection=queue.connection).count == 0


def test_broker_down_at_commit_then_the_sweep_job_publishes_it(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    redis.kill()
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    started = time.monotonic()
    [email_id] = send(producer, ["while redis is down"])  # the commit succeeds
    assert time.monotonic() - started < 5
    assert statuses(producer) == Counter(queued=1)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "Could not publish 1 email(s) to the rq broker" in errors[0].getMessage()
    assert "they stay queued in the database" in errors[0].getMessage()

    redis.start()
    spawn("w1")
    time.sleep(1.0)  # OUTBOX_SWEEP_MIN_AGE_SECONDS
    run_sweep_job(producer, redis)  # the sweep job, run by the worker, publishes it
    wait_sent(producer, 1)
    assert len(smtp_server.messages) == 1
    # The producer's next commit publishes again, and says once that the broker answers.
    send(producer, ["redis is back"])
    wait_sent(producer, 2)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == errors
    recovered = [r.getMessage() for r in caplog.records
                 if r.levelno == logging.INFO and "rq" in r.getMessage()]
    assert recovered, "no recovery line"
    assert email_id == rows(producer)[0]["id"]


def test_a_broker_that_never_answers_holds_the_commit_seconds_not_forever(
        pg_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    """A Redis address that accepts connections and never answers (a hung server, a
    proxy with nothing behind it): the publish gives up after its timeouts."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(64)
    app = make_app(pg_url, **COMMON, MAIL_PORT=smtp_server.port,
                   OUTBOX_EXECUTOR_URL=f"redis://127.0.0.1:{mute.getsockname()[1]}/0")
    took: list[float] = []

    def commit() -> None:
        started = time.monotonic()
        send(app, ["to a mute broker"])
        took.append(time.monotonic() - started)

    try:
        thread = threading.Thread(target=commit, daemon=True)
        thread.start()
        thread.join(15)
        assert took and took[0] < 10, "the commit waited on the broker for 15 s"
        assert statuses(app) == Counter(queued=1)
    finally:
        mute.close()  # a publish still waiting gets a reset
        close_app(app, timeout=5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Could not publish 1 email(s)" in errors[0].getMessage()


def test_a_transient_failure_is_not_retried_by_rq_but_swept_when_due(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    smtp_server.reply("data", 451, times=1)
    spawn("w1")
    [email_id] = send(producer, ["try twice"])
    row = poll(lambda: rows(producer)[0], lambda r: r["attempts"] == 1 and r["status"] ==
               "queued", timeout=20)
    queue = queue_of(redis)
    registries = (FailedJobRegistry(QUEUE, connection=queue.connection),
                  ScheduledJobRegistry(QUEUE, connection=queue.connection))
    assert poll(lambda: queue.count == 0, timeout=5)
    assert [r.count for r in registries] == [0, 0]  # no RQ retry, no broker ETA
    assert smtp_server.data_attempts == 1
    # Not due yet (the outbox's backoff): the sweep does not publish it.
    with producer.app_context():
        db_now = db.session.execute(sa.select(sa.func.now())).scalar_one()
        db.session.remove()
    wait = (_aware(row["due_at"]) - _aware(db_now)).total_seconds()
    if wait > 0.5:  # else a slow machine already passed the 2 s backoff
        assert sweep_task(app=producer)["published"] == 0
        assert queue.count == 0
    time.sleep(max(0.0, wait) + 0.2)
    run_sweep_job(producer, redis)
    wait_sent(producer, 1)
    assert [m.parsed.get("Subject") for m in smtp_server.messages] == ["try twice"]
    assert rows(producer)[0]["attempts"] == 2
    assert email_id == row["id"]


def test_send_after_is_published_by_the_sweep_once_due_never_with_an_eta(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    due = datetime.now(UTC) + timedelta(seconds=3)
    send(producer, ["later"], send_after=due)
    queue = queue_of(redis)
    assert queue.count == 0
    assert ScheduledJobRegistry(QUEUE, connection=queue.connection).count == 0
    assert not queue.connection.keys("rq:job:*")
    with producer.app_context():
        assert sweep_task(app=producer)["published"] == 0  # not due yet
    assert queue.count == 0
    spawn("w1")
    time.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()) + 0.2)
    run_sweep_job(producer, redis)
    wait_sent(producer, 1)
    assert [m.parsed.get("Subject") for m in smtp_server.messages] == ["later"]


def test_the_emails_of_a_key_are_delivered_in_send_order(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    smtp_server.delay("data", 0.01)
    for commit in range(4):
        send(producer, [f"k {commit * 10 + i}" for i in range(10)], key="account-1")
        send(producer, [f"free {commit * 10 + i}" for i in range(10)])
    spawn("w1", RQ_TEST_BATCH="5")
    spawn("w2", RQ_TEST_BATCH="5")
    wait_sent(producer, 80, timeout=60)
    keyed = [s for s in (m.parsed.get("Subject") for m in smtp_server.messages)
             if s.startswith("k ")]
    assert keyed == [f"k {i}" for i in range(40)]


def test_cancel_and_expiry_hold_under_rq(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    """What cancel and expires_after promise holds when RQ's workers deliver: an email
    cancelled or expired while its job waits in Redis is not sent, and cancelling a
    key's holder publishes the key's next email (nothing else would before a sweep)."""
    mail = mail_of(producer)
    # The key's holder is not due for an hour: the next email of its key waits.
    [holder] = send(producer, ["holder"], key="acct", send_after=timedelta(hours=1))
    [follower] = send(producer, ["follower"], key="acct")
    [cancelled] = send(producer, ["cancelled while its job waits"])
    [expiring] = send(producer, ["expired while its job waits"],
                      expires_after=timedelta(hours=1))
    queue = queue_of(redis)
    assert queue.count == 3  # the follower's, the cancelled one's, the expiring one's jobs
    with producer.app_context():
        assert mail.cancel(cancelled) == 1
        db.session.execute(sa.update(email_table).where(email_table.c.id == expiring)
                           .values(expires_at=sa.func.now() - timedelta(seconds=1)))
        db.session.commit()
    spawn("w1")
    assert poll(lambda: queue.count == 0, timeout=30)
    # The follower's own job ran and could not claim it: its key is held.
    assert poll(lambda: {r["id"]: r["status"] for r in rows(producer)},
                lambda s: s[expiring] == "expired", timeout=30)[follower] == "queued"
    with producer.app_context():
        assert mail.cancel(holder) == 1
        db.session.commit()  # hands the key on: the follower is published now
    done = poll(lambda: {r["id"]: r["status"] for r in rows(producer)},
                lambda s: s[follower] == "sent", timeout=30)
    assert done == {holder: "cancelled", follower: "sent", cancelled: "cancelled",
                    expiring: "expired"}
    assert [m.parsed.get("Subject") for m in smtp_server.messages] == ["follower"]
    assert FailedJobRegistry(QUEUE, connection=queue.connection).count == 0


def test_a_worker_pool_of_outbox_workers_delivers(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer) -> None:
    """``rq worker-pool -n 2 --worker-class ...OutboxWorker``, as docs/executors/rq.md says."""
    smtp_server.delay("data", 0.1)
    pool = spawn("pool", pool=2)
    poll(lambda: pool.log().count("Listening on") == 2, timeout=30)
    for commit in range(8):  # eight jobs: one of each process's jobs at a time
        send(producer, [f"p {commit * 5 + i}" for i in range(5)])
    wait_sent(producer, 40, timeout=60)
    senders = {m[1] for m in re.finditer(r"rq-test sent id=\d+ pid=(\d+)", pool.log())}
    assert len(senders) == 2, pool.log()[-3000:]  # two worker processes shared the jobs
    assert len(set(smtp_server.message_ids())) == 40


def test_rqs_own_forking_worker_with_flask_app_only_delivers(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer) -> None:
    """Plain ``rq worker`` (a work-horse per job, the app made in each from ``FLASK_APP``):
    slow per job (docs/executors/rq.md), but correct."""
    worker = spawn("plain", worker_class="rq.Worker")
    send(producer, ["one"])
    send(producer, ["two"])
    wait_sent(producer, 2, timeout=60)
    senders = {int(m[1]) for m in re.finditer(r"rq-test sent id=\d+ pid=(\d+)", worker.log())}
    assert len(senders) == 2 and worker.pid not in senders  # one work-horse per job
    assert sorted(m.parsed.get("Subject") for m in smtp_server.messages) == ["one", "two"]


# -- killed work-horses and workers ------------------------------------------------------------


def _owned_by(app: Flask, pid: int) -> int:
    t = email_table
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(
            t.c.status == "sending", t.c.lease_owner.like(f"%:{pid}:%"))).scalar_one())


def test_a_killed_work_horse_loses_nothing(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    """RQ's forking worker: SIGKILL the work-horse mid-delivery; RQ marks its job failed
    (abandoned), and the lease and the sweep deliver the emails anyway."""
    smtp_server.hold()
    worker = spawn("fork", worker_class=FORKING_WORKER, RQ_TEST_LEASE="3")
    send(producer, [f"h {i}" for i in range(6)])
    assert smtp_server.wait_held(1, timeout=30)
    [horse] = poll(worker.horses, timeout=10)
    assert poll(lambda: _owned_by(producer, horse), timeout=10) == 6
    os.kill(horse, signal.SIGKILL)
    queue = queue_of(redis)
    failed = FailedJobRegistry(QUEUE, connection=queue.connection)
    assert poll(lambda: failed.count, timeout=20) == 1  # RQ's own verdict: the job failed
    assert worker.proc.poll() is None  # the worker goes on
    smtp_server.release()
    time.sleep(3.2)  # the lease
    run_sweep_job(producer, redis)
    wait_sent(producer, 6)
    received = Counter(smtp_server.message_ids())
    assert set(received) == {r["message_id"] for r in rows(producer)}
    # A held DATA was never answered: nothing could have been accepted twice.
    assert sum(n - 1 for n in received.values()) == 0
    assert failed.count == 1  # RQ never ran the job again: no retries


def test_a_killed_worker_loses_nothing(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer) -> None:
    """SIGKILL the OutboxWorker mid-delivery: its job ended at the claim (RQ holds
    nothing of it), its rows are claimed by the dead process; a new worker, the expired
    leases and the sweep deliver everything."""
    smtp_server.hold()
    worker = spawn("w1", RQ_TEST_LEASE="3")
    send(producer, [f"k {i}" for i in range(6)])
    assert smtp_server.wait_held(1, timeout=30)
    assert poll(lambda: _owned_by(producer, worker.pid), timeout=10) == 6
    worker.kill()
    smtp_server.release()
    queue = queue_of(redis)
    # The job finished once its ids were claimed: only the database knows them now.
    assert StartedJobRegistry(QUEUE, connection=queue.connection).get_job_ids() == []
    spawn("w2", RQ_TEST_LEASE="3")
    time.sleep(3.2)
    run_sweep_job(producer, redis)
    wait_sent(producer, 6)
    received = Counter(smtp_server.message_ids())
    assert set(received) == {r["message_id"] for r in rows(producer)}
    assert sum(n - 1 for n in received.values()) == 0


# -- configuration -------------------------------------------------------------------------------


def test_rq_without_a_broker_url_fails_at_init_app(pg_url: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_EXECUTOR_URL.*needs the Redis URL"):
        make_app(pg_url, OUTBOX_EXECUTOR="rq")
    with pytest.raises(ConfigError, match="OUTBOX_EXECUTOR_URL.*not a Redis URL"):
        make_app(pg_url, OUTBOX_EXECUTOR="rq", OUTBOX_EXECUTOR_URL="http://127.0.0.1:6379")


def test_urgent_emails_are_published_at_the_front_of_the_queue(
        producer: Flask, redis: RedisServer) -> None:
    normal = send(producer, ["first", "second"])
    [urgent] = send(producer, ["urgent"], priority="high")
    mail = mail_of(producer)
    with producer.app_context():  # one commit with both kinds
        mixed = [mail.send(Message(subject, recipients=["a@example.com"], body="x"),
                           priority=priority)
                 for subject, priority in (("normal again", "normal"), ("urgent again", "high"))]
        db.session.commit()
    jobs = queue_of(redis).jobs
    # A commit with both publishes its urgent ids in a job of their own, first.
    # RQ has no priorities: an urgent job goes to the front of the queue; a commit with
    # both kinds publishes its urgent ids first, in a job of their own (so: at the front).
    assert [job.args[0] for job in jobs] == [[mixed[1]], [urgent], normal, [mixed[0]]]


def test_a_worker_without_an_app_refuses_to_start(
        spawn: Callable[..., RQWorker], redis: RedisServer) -> None:
    worker = spawn("no-app", FLASK_APP="")
    assert worker.proc.wait(60) == 1
    assert "OUTBOX_EXECUTOR" in worker.log() and "FLASK_APP" in worker.log()
    assert "Listening on" not in worker.log()


def test_rq_cron_schedules_the_sweep_job(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer, tmp_path: Path) -> None:
    """docs/executors/rq.md's cron file, run by ``rq cron``: sweep jobs every second."""
    config = tmp_path / "outbox_cron.py"
    config.write_text("from flask_mail_outbox.contrib.rq import register_sweep\n\n"
                      "register_sweep('outbox', interval=1)\n")
    redis.kill()
    [email_id] = send(producer, ["lost doorbell"])  # published nowhere: Redis was down
    redis.start()
    queue = queue_of(redis)
    assert queue.count == 0
    log = tmp_path / "cron.log"
    with open(log, "wb") as out:
        cron = subprocess.Popen(
            [sys.executable, "-m", "rq.cli", "cron", "-u", redis.url, str(config)],
            env=dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}"), cwd=str(tmp_path),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        job = poll(lambda: queue.jobs, timeout=20)[0]
        assert (job.func_name, job.result_ttl, job.timeout) == (SWEEP, 0, JOB_TIMEOUT)
        spawn("w1")
        wait_sent(producer, 1)
        assert rows(producer)[0]["id"] == email_id
        assert cron.poll() is None, log.read_text()
    finally:
        cron.kill()
        cron.wait(10)


def test_register_sweep_on_a_scheduler_of_ones_own(redis: RedisServer) -> None:
    from rq.cron import CronScheduler

    scheduler = CronScheduler(connection=Redis.from_url(redis.url))
    register_sweep("mail", interval=30, scheduler=scheduler)
    [entry] = scheduler.get_jobs()
    assert (entry.func_name, entry.queue_name, entry.interval) == (SWEEP, "mail", 30)
    with pytest.raises(ValueError, match="interval"):
        register_sweep("mail", interval=0, scheduler=scheduler)


def test_the_app_flask_app_names_stays_loaded(pg_url: str, redis: RedisServer,
                                             smtp_server: FaultSMTPServer) -> None:
    """``load_app()`` in a process with only ``FLASK_APP`` (a forked work-horse of
    ``rq.Worker``): the app it creates survives a garbage collection (the executors'
    registry of apps is weak)."""
    code = ("import gc\n"
            "from flask_mail_outbox.contrib.rq import load_app\n"
            "from flask_mail_outbox._flask.executors import task_app\n"
            "load_app()\n"
            "gc.collect()\n"
            "print(task_app().import_name)\n")
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
           "FLASK_APP": "executor_rq_app:create_app", "RQ_TEST_DB_URL": pg_url,
           "RQ_TEST_SMTP_PORT": str(smtp_server.port), "RQ_TEST_REDIS_URL": redis.url}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(TESTS),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "executor_rq_app"


def test_enqueue_sweep_needs_the_rq_executor(pg_url: str) -> None:
    app = make_app(pg_url, OUTBOX_RUN_WORKER=False)  # the dispatcher: no executor
    try:
        with pytest.raises(ConfigError, match="OUTBOX_EXECUTOR"):
            enqueue_sweep(app)
    finally:
        close_app(app, timeout=5)


# -- the chaos proof -------------------------------------------------------------------------------

TOTAL = 2000
CONNECTIONS = 4


def test_chaos_two_workers_a_sigkill_and_a_redis_restart_lose_nothing(
        producer: Flask, spawn: Callable[..., RQWorker], smtp_server: FaultSMTPServer,
        redis: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    with capsys.disabled():
        print(f"\n[rq chaos] seed={seed} (replay: CHAOS_SEED={seed})")
    began = time.monotonic()
    smtp_server.delay("data", 0.01)
    env = {"RQ_TEST_LEASE": "5", "RQ_TEST_CONCURRENCY": str(CONNECTIONS),
           "RQ_TEST_BATCH": "20"}
    workers = {name: spawn(name, **env) for name in ("w1", "w2")}
    for first in range(0, TOTAL, 250):
        send(producer, [f"chaos {i}" for i in range(first, first + 250)])
    expected = {r["message_id"] for r in rows(producer)}
    assert len(expected) == TOTAL

    stop = threading.Event()
    sweeps = Counter[str]()
    restarts: list[str] = []

    def scheduler() -> None:
        """The sweep's scheduler (a sweep job every 1.5 s, through RQ), and the workers'
        supervisor: RQ's worker quits when Redis goes away under it (exit 1), and a
        supervisor (systemd, Kubernetes) starts it again, as here every 0.3 s."""
        next_sweep = time.monotonic() + 1.5
        while not stop.wait(0.3):
            for name, worker in list(workers.items()):
                if worker.proc.poll() is not None:
                    restarts.append(f"{name}:{worker.proc.returncode}")
                    workers[name] = spawn(f"{name}-{len(restarts)}", **env)
            if time.monotonic() >= next_sweep:
                next_sweep += 1.5
                try:
                    enqueue_sweep(producer)
                    sweeps["published"] += 1
                except Exception:  # noqa: BLE001 - Redis is down: the next one
                    sweeps["refused"] += 1

    thread = threading.Thread(target=scheduler, name="scheduler", daemon=True)
    thread.start()
    try:
        # SIGKILL a worker mid-delivery once ~30 % arrived (the supervisor restarts it).
        assert smtp_server.wait_for(int(TOTAL * 0.3), timeout=120)
        name = rng.choice(sorted(workers))
        victim = workers[name]
        assert poll(lambda: _owned_by(producer, victim.pid), timeout=10, interval=0.01)
        time.sleep(rng.uniform(0.0, 0.05))  # anywhere inside its job
        received_at_kill = len(smtp_server.messages)
        victim.kill()
        in_flight = _owned_by(producer, victim.pid)
        # SIGKILL Redis at ~60 % (its queued jobs are lost), down for a second.
        assert smtp_server.wait_for(int(TOTAL * 0.6), timeout=120)
        received_at_redis = len(smtp_server.messages)
        redis.restart(down_for=1.0)
        assert smtp_server.wait_until(
            lambda: expected <= set(smtp_server.message_ids()), timeout=150), \
            f"seed={seed}: {len(expected - set(smtp_server.message_ids()))} never arrived"
    finally:
        stop.set()
        thread.join(5)
    drained = time.monotonic()
    wait_sent(producer, TOTAL, timeout=30)
    received = Counter(smtp_server.message_ids())
    lost = expected - set(received)
    duplicates = sum(n - 1 for n in received.values() if n > 1)
    assert (lost, set(received) - expected) == (set(), set()), f"seed={seed}"
    # Only what the killed worker had on the wire can arrive twice (Redis lost jobs, not
    # leases: a job published again for a row in flight claims nothing).
    assert in_flight >= 1, f"seed={seed}: the kill found the worker holding no email"
    assert duplicates <= in_flight, (f"seed={seed}", duplicates, in_flight)
    with capsys.disabled():
        print(f"[rq chaos] seed={seed} emails={TOTAL} workers=2 connections={CONNECTIONS} "
              f"kill at {received_at_kill} received (in flight {in_flight}), redis restart at "
              f"{received_at_redis}; duplicates={duplicates} lost={len(lost)} sweeps={dict(sweeps)} "
              f"worker restarts={restarts} "
              f"wall time to all received {drained - began:.1f} s")
    # The killed one, and those Redis took down with it (RQ's worker quits then).
    assert 1 <= len(restarts) <= 1 + 2 * len(workers) * 10, restarts
