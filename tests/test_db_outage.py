"""PostgreSQL stopped for ten seconds in the middle of a drain (issue 6, part 4).

The tests run their own throwaway cluster (``scripts/pg-cluster``), never the
shared one: it is stopped (``pg_ctl stop -m fast``, which also cuts every open
connection) and started again on the same port and data directory.

What must hold, for `flask outbox worker` processes and for the in-process
durable dispatcher alike:

* they keep running through the outage and report it at ERROR exactly once
  (the coalescing ``FaultTracker``: one ERROR when it starts, however many
  ticks, heartbeats, outcome writes and LISTEN reconnects fail, and one summary
  line when it ends);
* they back off (the summary counts the failed attempts: a handful, not a spin);
* they resume when the database returns, the LISTEN connection included (a
  NOTIFY after the outage wakes an idle worker long before its next poll);
* nothing is lost or sent twice: every row ``sent``, every Message-ID received
  once;
* a request that calls ``mail.send()`` + ``commit()`` during the outage gets an
  exception it can handle (SQLAlchemy's ``OperationalError``): no row, and no
  email later.

Recovery time (database back -> first delivery) is printed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from conftest import (
    REQUIRE_PG,
    close_app,
    db,
    empty_postgres,
    free_port,
    make_app,
    rows,
    wait_rows,
)
from flask import Flask
from smtpserver import FaultSMTPServer
from test_workers import Worker, _quiet_after, all_done

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._degrade import FaultTracker
from flask_mail_outbox.core import Outbox, SweepReport, load_config
from flask_mail_outbox.core._sweep import _store_report

REPO = Path(__file__).resolve().parent.parent
PG_CLUSTER = REPO / "scripts" / "pg-cluster"

#: How long the database stays down.
OUTAGE = 10.0
#: Library loggers' ERROR lines in a worker's log (``worker_app`` format).
_ERROR = re.compile(r"^[\d.]+ \d+ \[[^\]]+\] ERROR flask_mail_outbox[\w.]*: (.*)$", re.MULTILINE)
_RECOVERED = re.compile(r"INFO flask_mail_outbox[\w.]*: Recovered: .*recurred (\d+) more",
                        re.MULTILINE)


class Cluster:
    """A throwaway PostgreSQL cluster that a test may stop and start again."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url = ""

    def _run(self, *args: str) -> str:
        done = subprocess.run([str(PG_CLUSTER), *args], capture_output=True, text=True,
                              timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"scripts/pg-cluster {' '.join(args)} failed:\n{done.stderr}")
        return done.stdout

    def create(self) -> str:
        self.url = self._run("start", str(self.directory)).strip().splitlines()[-1]
        return self.url

    def stop(self) -> None:
        """Fast shutdown: open connections are terminated at once."""
        self._run("stop", str(self.directory))

    def resume(self) -> None:
        """Start the stopped server again (same data, same port); returns once it accepts."""
        bindir = self._run("bindir").strip()
        command = [f"{bindir}/pg_ctl", "-D", str(self.directory / "data"),
                   "-l", str(self.directory / "postgres.log"), "-w", "-t", "60", "-s", "start"]
        if os.geteuid() == 0:  # pg-cluster runs the server as "postgres" under root
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, cwd=self.directory, check=True, timeout=90,
                       capture_output=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """This module's own PostgreSQL (skipped locally without binaries; required in CI)."""
    if subprocess.run([str(PG_CLUSTER), "bindir"], capture_output=True,
                      check=False).returncode != 0:
        if REQUIRE_PG:
            pytest.fail("no PostgreSQL server binaries for the outage tests (install "
                        "postgresql, or set PG_BINDIR)")
        pytest.skip("no PostgreSQL server binaries (scripts/pg-cluster bindir)")
    # Under /tmp: when run as root the server runs as "postgres" and must reach it.
    directory = Path(tempfile.mkdtemp(prefix="outbox-outage-", dir="/tmp"))
    found = Cluster(directory)
    try:
        found.create()
        yield found
    finally:
        found.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def url(cluster: Cluster) -> str:
    return empty_postgres(cluster.url)


def outage_app(url: str, smtp_server: FaultSMTPServer, **config: object) -> Flask:
    """An app on the cluster; its own engine pings pooled connections (they die in an outage)."""
    return make_app(url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                    SQLALCHEMY_ENGINE_OPTIONS={"pool_pre_ping": True}, **config)


def queue(app: Flask, count: int, subject: str) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        for i in range(count):
            mail.send(Message(f"{subject} {i}", recipients=["a@example.com"], body="x"))
        db.session.commit()


def ride_out_outage(cluster: Cluster, smtp_server: FaultSMTPServer, started_at: int,
                    during: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """Once ``started_at`` messages arrived, stop the database for OUTAGE seconds.

    ``during`` runs right after the stop. Returns (messages received when the
    database came back, seconds from then to the first message accepted after).
    """
    assert smtp_server.wait_for(started_at, timeout=60), len(smtp_server.messages)
    cluster.stop()
    during()
    # The rest of the outage: a deliberate window with the database down.
    time.sleep(OUTAGE)
    before = len(smtp_server.messages)
    cluster.resume()
    back = time.monotonic()
    assert smtp_server.wait_for(before + 1, timeout=60), "nothing delivered after the outage"
    return before, time.monotonic() - back


def assert_each_once(app: Flask, smtp_server: FaultSMTPServer, total: int) -> None:
    current = wait_rows(app, all_done(total), timeout=60.0, interval=0.2)
    assert Counter(r["status"] for r in current) == {"sent": total}
    received = Counter(smtp_server.message_ids())
    assert received == {r["message_id"]: 1 for r in current}


# -- the coalescing, on its own ---------------------------------------------------------------


def refused() -> sa.exc.OperationalError:
    """A real failure to reach PostgreSQL: nothing listens on the port."""
    engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError("connected to a port nobody listens on")


def library_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("flask_mail_outbox") and r.levelno == level]


def test_one_error_per_database_outage_whichever_part_reports_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    faults = FaultTracker()
    down = refused()
    cut = psycopg.OperationalError("consuming input failed: server closed the connection")
    for part, exc in [("dispatcher-tick", down), ("heartbeat", down), ("record", down),
                      ("listen", cut), ("dispatcher-tick", down)]:
        faults.failing(part, f"{part} failed", consequence="c", fix="f", exc=exc)
    faults.recovered("sweep")  # a part that never failed says nothing about the database
    assert library_records(caplog, logging.INFO) == []
    faults.recovered("listen")  # the LISTEN connection is back: so is the database
    faults.recovered("dispatcher-tick")

    [error] = library_records(caplog, logging.ERROR)
    assert error.startswith("The database cannot be reached (dispatcher-tick failed)")
    [summary] = library_records(caplog, logging.INFO)
    assert summary.startswith("Recovered: The database cannot be reached")
    assert "recurred 4 more time(s)" in summary


def test_a_sweep_report_the_outage_keeps_from_being_stored_is_part_of_the_outage(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sweep that read its rows just before the database went down fails to store its
    report (what made a full run's worker log a second ERROR, ``Could not store the
    sweep report ... the database system is shutting down``): one outage, one ERROR."""
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    faults = FaultTracker()
    faults.failing("dispatcher-tick", "tick failed", consequence="c", fix="f", exc=refused())
    gone = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none"
    config = load_config({}, instance_path=tempfile.gettempdir(), testing=False)
    outbox = Outbox(gone, config, faults=faults)
    try:
        _store_report(outbox, SweepReport(kind="startup"))
    finally:
        outbox.engine.dispose()
    errors = library_records(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    assert errors[0].startswith("The database cannot be reached (tick failed)")
    faults.recovered("dispatcher-tick")
    [summary] = library_records(caplog, logging.INFO)
    assert "recurred 1 more time(s)" in summary  # the report's failure, counted


def test_errors_the_database_answered_with_are_faults_of_their_own(
        caplog: pytest.LogCaptureFixture) -> None:
    faults = FaultTracker()
    deadlock = sa.exc.OperationalError("UPDATE ...", {}, psycopg.errors.DeadlockDetected())
    faults.failing("record", "record failed", consequence="c", fix="f", exc=deadlock)
    faults.failing("dispatcher-tick", "tick failed", consequence="c", fix="f", exc=refused())
    first, second = library_records(caplog, logging.ERROR)
    assert first.startswith("record failed (further occurrences")
    assert second.startswith("The database cannot be reached (tick failed)")


# -- (a) worker processes -------------------------------------------------------------------


def test_workers_report_an_outage_once_and_resume_listen_included(
        url: str, cluster: Cluster, smtp_server: FaultSMTPServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    total = 400
    producer = outage_app(url, smtp_server, OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    try:
        queue(producer, total, "drain")
        smtp_server.delay("data", 0.05)  # ~80 messages/s: the drain is mid-way at the stop
        # A first poll of 40 s: after the outage only a wake (LISTEN) brings a worker
        # back quickly, and an idle worker's next poll is always far away.
        env = {"WORKER_POLL": "40", "WORKER_POLL_MAX": "60", "WORKER_LISTEN_BACKSTOP": "120",
               "WORKER_BATCH_SIZE": "10"}
        workers = [Worker(name, tmp_path, url, smtp_server.port, 2, env)
                   for name in ("o1", "o2")]
        try:
            before, recovery = ride_out_outage(cluster, smtp_server, started_at=60)
            assert before < total - 100  # the outage cut the drain in the middle
            assert_each_once(producer, smtp_server, total)

            # The LISTEN connections are back: a NOTIFY wakes idle workers at once.
            for w in workers:
                _quiet_after(w, lambda t: t.listening and t.gap >= 40 and t.claimed == 0,
                             timeout=60.0)
            committed = time.time()
            queue(producer, 1, "after")
            assert smtp_server.wait_for(total + 1, timeout=10)
            for worker in workers:
                # The first tick after the commit, and the one before it: a worker may
                # have ticked again (its LISTEN reconnect wakes it) while the test
                # waited for the other one to go quiet, so "before" is read now.
                worker.wait_log(lambda w: any(t.start >= committed - 0.5 for t in w.ticks()),
                                10, "the tick the NOTIFY caused")
                ticks = worker.ticks()
                i = next(i for i, t in enumerate(ticks) if t.start >= committed - 0.5)
                last, woken = ticks[i - 1], ticks[i]
                assert last.listening and last.gap >= 40, ticks[-5:]
                assert woken.start < last.start + last.gap - 20
            assert_each_once(producer, smtp_server, total + 1)

            recurred = []
            for worker in workers:
                log = worker.log()
                errors = _ERROR.findall(log)
                assert len(errors) == 1, "\n".join(errors)
                assert errors[0].startswith("The database cannot be reached")
                recoveries = [int(n) for n in _RECOVERED.findall(log)]
                assert len(recoveries) == 1, log[-4000:]
                assert recoveries[0] <= 30  # backed off: a handful of retries in 10 s
                recurred.append(recoveries[0])
                assert worker.proc.poll() is None  # still running
            for worker in workers:
                assert worker.terminate_and_wait(timeout=30) == 0
        finally:
            for worker in workers:
                worker.kill()
    finally:
        close_app(producer, timeout=5)
    with capsys.disabled():
        print(f"\n[outage, 2 workers] database down {OUTAGE:g} s after {before} of "
              f"{total} delivered; back -> first delivery {recovery:.2f} s; "
              f"ERROR lines per worker 1, failures counted meanwhile {recurred}; "
              f"lost 0, duplicates 0")


# -- (b) the in-process dispatcher, (c) a request during the outage --------------------------


def test_in_process_dispatcher_and_a_request_during_the_outage(
        url: str, cluster: Cluster, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    total = 300
    # Leases outlast the outage even on a loaded CI machine (a run there saw two of
    # the default 30 s expire, and their reap's ERROR beside the outage's).
    app = outage_app(url, smtp_server, OUTBOX_DURABLE=True, OUTBOX_BATCH_SIZE=10,
                     OUTBOX_LEASE_SECONDS=120)
    mail: OutboxMail = app.extensions["test_mail"]
    outcomes: list[str] = []

    @app.post("/signup")
    def signup() -> tuple[str, int]:
        try:
            mail.send(Message("signed up during the outage", recipients=["b@example.com"],
                              body="x"))
            db.session.commit()
        except sa.exc.OperationalError as exc:  # the transaction failed: nothing promised
            db.session.rollback()
            outcomes.append(type(exc).__name__)
            return "try again later", 503
        return "ok", 200

    try:
        smtp_server.delay("data", 0.05)
        queue(app, total, "drain")  # the commit starts this process's dispatcher
        statuses: list[int] = []
        before, recovery = ride_out_outage(
            cluster, smtp_server, started_at=40,
            during=lambda: statuses.append(app.test_client().post("/signup").status_code))
        assert (statuses, outcomes) == ([503], ["OperationalError"])
        assert before < total - 100

        assert_each_once(app, smtp_server, total)
        with app.app_context():
            assert mail.wait_idle(30)
        assert not [r for r in rows(app) if r["subject"].startswith("signed up")]
        assert not [m for m in smtp_server.messages
                    if str(m.parsed["Subject"]).startswith("signed up")]
        dispatcher = app.extensions["mail_outbox"].current_outbox().dispatcher
        assert dispatcher is not None and dispatcher.running
    finally:
        close_app(app, timeout=5)

    library = [r for r in caplog.records if r.name.startswith("flask_mail_outbox")]
    errors = [r.getMessage() for r in library if r.levelno >= logging.ERROR]
    assert len(errors) == 1, "\n".join(errors)
    assert errors[0].startswith("The database cannot be reached")
    recovered = [r.getMessage() for r in library if r.getMessage().startswith("Recovered: ")]
    assert len(recovered) == 1, recovered
    recurred = int(re.search(r"recurred (\d+) more", recovered[0])[1])  # type: ignore[index]
    assert recurred <= 30
    with capsys.disabled():
        print(f"\n[outage, in-process dispatcher] database down {OUTAGE:g} s after {before} of "
              f"{total} delivered; back -> first delivery {recovery:.2f} s; one ERROR "
              f"({errors[0][:80]}...), failures counted meanwhile {recurred}; the request "
              f"during the outage got {outcomes[0]} (503), no row, no email")
