"""Crashes with real processes: SIGKILL at every point of a delivery, then the next start.

The guarantee (docs/guide/modes.md, docs/guide/sweep.md): a crash at any moment
leaves a row that a sweep or a worker finishes; the claim is the single gate, so two processes
starting at once over the same stranded rows deliver each exactly once; the
only duplicate is the RFC 5321 section 6.1 window (the server accepted, the
process died before recording it), and it carries the same Message-ID.

Every test runs on SQLite and on PostgreSQL. The test process creates the
tables (``make_app``) and reads the rows; the crashing processes and the "next
start" are subprocesses of ``tests/crash_app.py`` (configured through
``CRASH_*`` environment variables), killed with SIGKILL, and always killed in
the ``children`` fixture's ``finally``. Proofs go by the order of events
(a line the subprocess printed, the SMTP server holding a DATA, the row's state
in the database) with generous bounds, never by short sleeps.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, free_port, make_app, poll
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message
from flask_mail_outbox.core import email_table
from flask_mail_outbox.core._clock import utcnow
from flask_mail_outbox.core._dialect import dialect_of
from flask_mail_outbox.core._internal import PauseStore

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
CRASH_APP = TESTS / "crash_app.py"

#: Bounds for things that take milliseconds when all is well.
WAIT = 30.0


# -- subprocesses ---------------------------------------------------------------------------


class Child:
    """One ``crash_app.py`` subprocess: its stdout lines as they come, stderr in a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._stderr = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(CRASH_APP), *args], env=env, cwd=str(REPO),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _pump(self, timeout: float) -> bool:
        """Take one line (or EOF) within ``timeout``; False when nothing came."""
        try:
            line = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if line is None:
            self._eof = True
        else:
            self.lines.append(line)
        return True

    def expect(self, prefix: str, timeout: float = WAIT) -> str:
        """The rest of the first stdout line starting with ``prefix`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
            if self._eof:
                self.proc.wait(timeout=WAIT)
                pytest.fail(f"{self.name} exited ({self.proc.returncode}) without printing "
                            f"{prefix!r}; stdout {self.lines}\n{self.stderr_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"{self.name} did not print {prefix!r} within {timeout:g} s; "
                            f"stdout {self.lines}\n{self.stderr_tail()}")
            self._pump(remaining)

    def expect_ids(self, prefix: str, timeout: float = WAIT) -> list[int]:
        """The ids of an ``<PREFIX> ids=1,2`` line."""
        rest = self.expect(prefix, timeout)
        assert rest.startswith("ids="), rest
        return [int(i) for i in rest[len("ids="):].split(",") if i]

    def report(self, timeout: float = 60.0) -> dict[str, Any]:
        """A ``serve`` child's startup sweep report; it must then exit 0."""
        report = json.loads(self.expect("REPORT ", timeout))
        assert report is not None, f"{self.name}: no startup sweep report\n{self.stderr_tail()}"
        assert self.proc.wait(timeout=WAIT) == 0, self.stderr_tail()
        return dict(report)

    def kill(self) -> None:
        """SIGKILL (if still running) and reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT)

    def wait_killed(self, timeout: float = WAIT) -> None:
        """Wait for the child to die by SIGKILL (one that kills itself)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout:g} s\n{self.stderr_tail()}")
        assert code == -signal.SIGKILL, f"{self.name} exited {code}\n{self.stderr_tail()}"

    def stderr_tail(self, lines: int = 40) -> str:
        self._stderr.flush()
        text = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} stderr (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def close(self) -> None:
        try:
            self.kill()
        finally:
            self._reader.join(timeout=WAIT)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()


Spawn = Callable[..., Child]


@pytest.fixture
def children(db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path) -> Iterator[Spawn]:
    """``spawn(name, *args, **CRASH_env)``: start a crash_app subprocess; all killed at the end."""
    made: list[Child] = []
    base = dict(os.environ)
    base.update(PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]),
                CRASH_DB_URL=db_url, CRASH_SMTP_PORT=str(smtp_server.port),
                PYTHONUNBUFFERED="1")

    def spawn(name: str, *args: str, **env: Any) -> Child:
        child_env = dict(base)
        child_env.update({key: str(value) for key, value in env.items()})
        child = Child(name, list(args), child_env, tmp_path / f"{name}.stderr")
        made.append(child)
        return child

    try:
        yield spawn
    finally:
        problems: list[BaseException] = []
        for child in made:  # kill every one, whatever happens to the others
            try:
                child.close()
            except Exception as exc:  # noqa: BLE001 - raised below, after the rest
                problems.append(exc)
        if problems:
            raise problems[0]


# -- the test process's app -----------------------------------------------------------------


@pytest.fixture
def local(db_url: str) -> Iterator[Flask]:
    """The test process's app: creates the tables, reads rows; its SMTP server is unreachable.

    No backoff (``OUTBOX_RETRY_BASE_SECONDS=0``): what its failed tries leave is due at once;
    the refused connection pauses its transport (test_pause.py), whose emails are due again
    at once too (``OUTBOX_PAUSE_PROBE_SECONDS``), or in a second for those it held.
    """
    app = make_app(db_url, MAIL_SERVER="127.0.0.1", MAIL_PORT=free_port(),
                   OUTBOX_INLINE_RETRIES=0, MAIL_TIMEOUT=2, OUTBOX_RETRY_BASE_SECONDS=0,
                   OUTBOX_PAUSE_PROBE_SECONDS=0.01)
    yield app
    close_app(app, timeout=5)


def engine_of(app: Flask) -> sa.Engine:
    with app.app_context():
        return db.engine


def rows(app: Flask) -> list[dict[str, Any]]:
    with engine_of(app).connect() as conn:
        return [dict(r) for r in conn.execute(
            sa.select(email_table.c.id, email_table.c.status, email_table.c.attempts,
                      email_table.c.message_id, email_table.c.subject)
            .order_by(email_table.c.id)).mappings()]


def row(app: Flask, email_id: int) -> dict[str, Any]:
    [found] = [r for r in rows(app) if r["id"] == email_id]
    return found


def wait_leases_expired(app: Flask, timeout: float = WAIT) -> None:
    """Wait until no ``sending`` row has a live lease (on the clock the store compares with)."""
    engine = engine_of(app)
    t = email_table

    def live() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).where(
                t.c.status == "sending",
                t.c.lease_expires_at >= dialect_of(engine).now(utcnow))).scalar_one())

    still = poll(live, lambda n: n == 0, timeout=timeout, interval=0.1)
    assert still == 0, f"{still} lease(s) still live after {timeout:g} s"


def copies(server: FaultSMTPServer, message_id: str) -> int:
    return Counter(server.message_ids())[message_id]


def kill_during_data(spawn: Spawn, server: FaultSMTPServer, name: str,
                     count: int = 1) -> list[int]:
    """A process sends ``count`` emails, SIGKILLed while the server withholds the DATA replies.

    Returns the row ids. On return the server has seen the client disconnect and
    abandoned the held messages (never answered 250, never recorded).
    """
    server.hold()
    child = spawn(name, "send", str(count), CRASH_LEASE_SECONDS=1, CRASH_SUBJECT=name)
    ids = child.expect_ids("COMMITTED")
    assert len(ids) == count
    assert server.wait_held(count, timeout=WAIT), child.stderr_tail()
    child.kill()
    # The dead client's connections close; the server abandons the DATA it held.
    assert server.wait_until(lambda: server.held == 0 and server.active_connections == 0,
                             timeout=WAIT)
    server.release()
    assert not server.wait_for(1, timeout=0.5)  # released: nothing to accept any more
    return ids


# -- 2. SIGKILL mid-DATA ----------------------------------------------------------------------


def test_sigkill_during_data_then_the_next_start_delivers_it(
        local: Flask, children: Spawn, smtp_server: FaultSMTPServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    [email_id] = kill_during_data(children, smtp_server, "mid-data")
    left = row(local, email_id)
    assert (left["status"], left["attempts"]) == ("sending", 1)
    assert smtp_server.messages == []

    wait_leases_expired(local)
    report = children("next-start", "serve", CRASH_MIN_AGE=0).report()

    assert (report["scanned"], report["sent"], report["failed"], report["skipped"],
            report["truncated"], report["mode"]) == (1, 1, 0, 0, False, "inline")
    done = row(local, email_id)
    assert (done["status"], done["attempts"]) == ("sent", 2)
    received = smtp_server.message_ids()
    assert received and set(received) == {done["message_id"]}
    # The held copy of the killed process was never answered 250: this server
    # dropped it, so exactly one copy arrived (a server that had queued it
    # anyway would make it two, with the same Message-ID).
    assert len(received) == 1
    with capsys.disabled():
        print(f"\n[mid-DATA kill] copies received: {len(received)}, Message-ID "
              f"{done['message_id']}, final status {done['status']}, "
              f"attempts {done['attempts']}")


# -- 3. two starts at once over the same stranded rows ---------------------------------------


def test_two_starts_at_once_deliver_every_stranded_row_exactly_once(
        local: Flask, children: Spawn, smtp_server: FaultSMTPServer, backend: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    count = 40
    mail = local.extensions["test_mail"]
    with local.app_context():  # the first try failed: the server was unreachable
        ids = [mail.send(Message(f"stranded-{i}", recipients=["rcpt@example.com"], body="x"))
               for i in range(count)]
        db.session.commit()
        assert mail.wait_idle(WAIT)
    mail.stop()
    # The unreachable server paused the transport: no email spent its attempt.
    assert {(r["status"], r["attempts"]) for r in rows(local)} == {("queued", 0)}
    time.sleep(1.1)  # those it held unsent are due a second later
    # The server is back, as a probe would find: the transport is resumed, so that the
    # two starts below sweep at once (a paused one would send one probe at a time).
    assert PauseStore(local.extensions["mail_outbox"].outbox().store).resume("default")

    # Each start sweeps in chunks of 5 over 4 SMTP connections. The server holds
    # every DATA until both starts are sending at once (4 held each): the two
    # sweeps overlap for certain, not by luck of timing.
    smtp_server.hold()
    first = children("start-1", "serve", CRASH_MIN_AGE=0, CRASH_BATCH_SIZE=5)
    second = children("start-2", "serve", CRASH_MIN_AGE=0, CRASH_BATCH_SIZE=5)
    both = smtp_server.wait_held(8, timeout=WAIT)
    assert both, (smtp_server.held, first.stderr_tail(), second.stderr_tail())
    smtp_server.release()
    reports = [first.report(), second.report()]

    assert sum(r["sent"] for r in reports) == count
    for report in reports:
        assert report["failed"] == 0 and report["truncated"] is False
        assert report["scanned"] == report["sent"] + report["skipped"], report
        assert report["sent"] > 0, report  # both delivered a share
    # Whichever claimed first had read all 40; the other read before the first
    # one's first chunk (held) finished, so at most those 5 were missing.
    scanned = sorted(r["scanned"] for r in reports)
    assert scanned[1] == count and scanned[0] >= count - 5, reports
    assert sum(r["skipped"] for r in reports) == sum(scanned) - count

    final = rows(local)
    assert [r["id"] for r in final] == ids
    assert {(r["status"], r["attempts"]) for r in final} == {("sent", 1)}
    assert smtp_server.wait_for(count)
    received = smtp_server.message_ids()
    assert len(received) == count and len(set(received)) == count
    assert set(received) == {r["message_id"] for r in final}
    with capsys.disabled():
        print(f"\n[two starts, {backend}] " + "; ".join(
            f"scanned={r['scanned']} sent={r['sent']} skipped={r['skipped']}" for r in reports))


# -- 4. the crash points table ----------------------------------------------------------------


def test_a_crash_at_any_point_leaves_a_row_the_next_start_finishes(
        local: Flask, children: Spawn, smtp_server: FaultSMTPServer, backend: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    points: dict[str, int | None] = {}

    # (a) before commit: the transaction is open, the INSERT ran.
    victim = children("point-a", "open", "1", CRASH_SUBJECT="point-a")
    assert len(victim.expect_ids("OPEN")) == 1
    victim.kill()
    assert rows(local) == []
    points["a"] = None

    # (b) after commit, before any claim: nothing in the process claims.
    victim = children("point-b", "send", "1", CRASH_SUBJECT="point-b", CRASH_DURABLE=1,
                      CRASH_RUN_WORKER=0)
    [points["b"]] = victim.expect_ids("COMMITTED")
    victim.kill()

    # (c) after the claim, before SMTP: the transport got the row and never sends.
    victim = children("point-c", "send", "1", CRASH_SUBJECT="point-c", CRASH_LEASE_SECONDS=1,
                      CRASH_TRANSPORT="crash_app:SleepingTransport")
    [points["c"]] = victim.expect_ids("COMMITTED")
    assert victim.expect_ids("CLAIMED") == [points["c"]]
    victim.kill()

    # (d) during DATA: the server holds the final reply.
    [points["d"]] = kill_during_data(children, smtp_server, "point-d")

    # (e) the server accepted (250), the process dies before writing "sent".
    victim = children("point-e", "send", "1", CRASH_SUBJECT="point-e", CRASH_LEASE_SECONDS=1,
                      CRASH_TRANSPORT="crash_app:KillAfterAcceptTransport")
    [points["e"]] = victim.expect_ids("ACCEPTED")
    victim.wait_killed()

    before = {r["id"]: r for r in rows(local)}
    assert [before[points[p]]["subject"] for p in "bcde"] == [f"point-{p}-0" for p in "bcde"]
    assert len(before) == 4
    left = {p: (before[points[p]]["status"], before[points[p]]["attempts"]) for p in "bcde"}
    assert left == {"b": ("queued", 0), "c": ("sending", 1), "d": ("sending", 1),
                    "e": ("sending", 1)}
    mid = {p: before[points[p]]["message_id"] for p in "bcde"}
    assert smtp_server.message_ids() == [mid["e"]]  # only (e) reached a 250

    wait_leases_expired(local)
    report = children("next-start", "serve", CRASH_MIN_AGE=0).report()
    assert (report["scanned"], report["sent"], report["failed"], report["skipped"]) == \
        (4, 4, 0, 0), report

    after = {r["id"]: r for r in rows(local)}
    assert len(after) == 4
    received = smtp_server.message_ids()
    assert set(received) == set(mid.values())  # nothing from (a), nothing unknown
    assert not [m for m in smtp_server.messages if m.parsed["Subject"] == "point-a-0"]
    table = {"a": (0, "no row", "-")}
    for p in "bcde":
        final = after[points[p]]
        table[p] = (copies(smtp_server, mid[p]), final["status"], final["attempts"])
    assert table == {
        "a": (0, "no row", "-"),       # nothing stored, nothing sent
        "b": (1, "sent", 1),           # delivered exactly once
        "c": (1, "sent", 2),           # exactly once, after the lease
        "d": (1, "sent", 2),           # this server dropped the unanswered copy
        "e": (2, "sent", 2),           # the RFC 5321 6.1 window: two, same Message-ID
    }
    assert len(received) == 5

    labels = {
        "a": "(a) before commit (transaction open)",
        "b": "(b) after commit, before claim",
        "c": "(c) after claim, before SMTP",
        "d": "(d) during DATA (reply withheld)",
        "e": "(e) after 250, before status write",
    }
    lines = [(f"\ncrash points [{backend}]: next start's sweep scanned={report['scanned']} "
              f"sent={report['sent']}"),
             f"{'point':40} {'left by the crash':18} {'copies':>6} {'final':>7} {'attempts':>8}"]
    for p in "abcde":
        state = "no row" if p == "a" else "{} / {}".format(*left[p])
        n, status, attempts = table[p]
        lines.append(f"{labels[p]:40} {state:18} {n:>6} {status:>7} {attempts!s:>8}")
    with capsys.disabled():
        print("\n".join(lines))


# -- the sweep's reports after a crash ------------------------------------------------------


def test_a_crash_on_the_last_attempt_is_reported_truthfully_by_the_next_start(
        local: Flask, children: Spawn, smtp_server: FaultSMTPServer) -> None:
    """The next start's sweep takes a row whose lease expired with its attempts spent.

    Nothing else is running (the process that owned the row was SIGKILLed), so the
    row cannot be "owned by another delivery": the report must not count it as
    ``skipped``. Whatever the sweep does with it, the report says so (``sent``, or
    ``failed`` with an ERROR line naming the email: like every degradation, a row
    dead-lettered is reported at ERROR).
    """
    [email_id] = kill_during_data(children, smtp_server, "last-attempt")
    wait_leases_expired(local)
    serve = children("next-start", "serve", CRASH_MIN_AGE=0, CRASH_MAX_ATTEMPTS=1)
    report = serve.report()
    final = row(local, email_id)
    errors = [line for line in serve.log.read_text().splitlines()
              if " ERROR " in line and str(email_id) in line]
    assert report["scanned"] == 1, report
    assert (final["status"], report["skipped"]) in {("sent", 0), ("failed", 0)}, \
        (final, report)
    if final["status"] == "failed":
        assert report["failed"] == 1 and errors, (report, serve.stderr_tail())
    else:
        assert report["sent"] == 1 and copies(smtp_server, final["message_id"]) == 1


def test_a_durable_start_capped_by_its_batch_reports_no_more_than_it_scanned(
        local: Flask, children: Spawn, smtp_server: FaultSMTPServer) -> None:
    """A crash leaves 3 expired leases; a durable start with OUTBOX_SWEEP_BATCH=1 sweeps.

    docs/guide/sweep.md: ``scanned`` are the rows taken; ``requeued`` the ones made due
    for the dispatcher, ``skipped`` those owned by another delivery. A count of
    rows can be neither larger than what was scanned nor negative.
    """
    ids = kill_during_data(children, smtp_server, "capped", count=3)
    assert [(r["status"], r["attempts"]) for r in rows(local)] == [("sending", 1)] * 3
    wait_leases_expired(local)
    report = children("next-start", "serve", CRASH_MIN_AGE=0, CRASH_DURABLE=1,
                      CRASH_RUN_WORKER=0, CRASH_SWEEP_BATCH=1).report()
    assert (report["mode"], report["scanned"], report["truncated"]) == ("durable", 1, True)
    assert 0 <= report["requeued"] <= report["scanned"], report
    assert 0 <= report["skipped"] <= report["scanned"], report
    assert report["requeued"] + report["skipped"] == report["scanned"], report
    assert len(ids) == 3
