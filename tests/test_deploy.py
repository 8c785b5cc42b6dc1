"""Deploys and restarts under a real WSGI server (issue 15): gunicorn, 2 workers.

The README's signup app (``tests/gunicorn_app.py``) runs under ``gunicorn -w 2``,
with and without ``--preload``, against the test SMTP server slowed to 0.5 s
per message, on a SQLite file and on PostgreSQL, with every setting at its
default (the 300 s age gate included):

* inline mode: signups, SIGTERM to the master mid-batch, a restart. Every
  email arrives within 10 s of the restart, none twice (counted by
  Message-ID); each stopping worker logged what it released, and that is what
  the database holds; one startup sweep ran for the restarted deployment.
* durable mode with ``--preload``: delivery runs in the workers only.

In both, the master's PID runs nothing of the outbox: it holds one thread (a
scheduler, a dispatcher or a delivery thread would be a second), logs no
sweep, no job start and no dispatcher, and opens no SMTP connection. Which
process opened each SMTP connection is read from ``/proc`` while the
connection is open (the server calls back at each connection).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import close_app, free_port, make_app, poll, rows
from smtpserver import FaultSMTPServer

from flask_mail_outbox.core._sweeping import RELEASED

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GUNICORN = Path(sys.executable).with_name("gunicorn")
#: The issue's slow SMTP server.
DATA_DELAY = 0.5
SIGNUPS = 40
LOG_LINE = re.compile(r"^\d+\.\d+ pid=(?P<pid>\d+) (?P<level>[A-Z]+) (?P<logger>\S+): "
                      r"(?P<message>.*)$")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to tell processes apart")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _socket_inode(port: int, server_port: int) -> str | None:
    """The inode of the 127.0.0.1 TCP socket from local ``port`` to ``server_port``.

    Both ends are matched: an ephemeral port is reused towards another peer
    (the HTTP requests, the database) while its old socket still lingers in
    TIME_WAIT with inode 0.
    """
    local, remote = f"0100007F:{port:04X}", f"0100007F:{server_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[9]
    return None


def _owner_of(port: int, server_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the client socket from local ``port`` to ``server_port``."""
    # /proc/net/tcp is read a page at a time: a socket opened or closed
    # elsewhere between two reads can hide a line, so look again before
    # calling the connection unknown.
    for _ in range(10):
        inode = _socket_inode(port, server_port)
        if inode is not None:
            break
        time.sleep(0.02)
    else:
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
                except OSError:
                    continue
        except OSError:
            continue
    return None


class Gunicorn:
    """One ``gunicorn -w 2`` deployment of tests/gunicorn_app.py."""

    def __init__(self, tmp_path: Path, name: str, *, db_url: str, smtp_port: int,
                 preload: bool, durable: bool) -> None:
        self.port = free_port()
        self.log_path = tmp_path / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
               "DEPLOY_DB_URL": db_url, "DEPLOY_SMTP_PORT": str(smtp_port),
               "DEPLOY_DURABLE": "1" if durable else "0"}
        args = [str(GUNICORN), "-w", "2", "-b", f"127.0.0.1:{self.port}",
                # No control socket: its thread in the master would hide ours, and
                # its default path is shared by every deployment on the machine.
                "--graceful-timeout", "30", "--no-control-socket",
                *(["--preload"] if preload else []),
                "gunicorn_app:serve()"]
        self._log = self.log_path.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, cwd=TESTS, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self.stop_began: float | None = None

    def workers(self) -> list[int]:
        return _children(self.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def lines(self) -> list[tuple[int, str, str]]:
        """(pid, level, message) of every library log line."""
        found = []
        for line in self.log().splitlines():
            match = LOG_LINE.match(line)
            if match and match["logger"].startswith("flask_mail_outbox"):
                found.append((int(match["pid"]), match["level"], match["message"]))
        return found

    def request(self, method: str, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until both workers run and one answers ``/ready``."""
        def ready() -> bool:
            if self.proc.poll() is not None or len(self.workers()) < 2:
                return False
            try:
                return self.request("GET", "/ready")[0] == 200
            except OSError:
                return False
        assert poll(ready, timeout=timeout, interval=0.1), self.log()[-3000:]

    def terminate(self) -> None:
        """SIGTERM to the master: a graceful stop."""
        self.stop_began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> float:
        """A graceful stop (unless :meth:`terminate` began one); seconds from its SIGTERM
        until the master exited."""
        if self.stop_began is None:
            self.terminate()
        rc = self.proc.wait(timeout)
        took = time.monotonic() - (self.stop_began or 0.0)
        self._log.close()
        assert rc == 0, self.log()[-3000:]
        return took

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class Owners:
    """The PID that opened each SMTP connection, found while it is open."""

    def __init__(self, server: FaultSMTPServer) -> None:
        self.deployments: list[Gunicorn] = []
        self.by_pid: Counter[int] = Counter()
        self.unknown = 0
        self.unknown_seen: list[str] = []
        self._lock = threading.Lock()
        self._server_port = server.port
        server.on_connect(self._connected)

    def _connected(self, peer: tuple[str, int]) -> None:
        pids = [pid for g in self.deployments for pid in (g.pid, *g.workers())]
        owner = _owner_of(peer[1], self._server_port, pids)
        with self._lock:
            if owner is None:
                self.unknown += 1
                inode = _socket_inode(peer[1], self._server_port)
                self.unknown_seen.append(
                    f"{time.monotonic():.3f} port={peer[1]} inode={inode} pids={pids}")
            else:
                self.by_pid[owner] += 1


@pytest.fixture
def deployments(tmp_path: Path) -> Iterator[list[Gunicorn]]:
    started: list[Gunicorn] = []
    yield started
    for g in started:
        g.kill()


def _assert_master_runs_nothing(g: Gunicorn, owners: Owners) -> None:
    assert _threads(g.pid) == 1, f"the master {g.pid} runs threads"
    in_master = [line for line in g.lines() if line[0] == g.pid]
    assert in_master == [], in_master
    assert owners.by_pid[g.pid] == 0


def _signup(g: Gunicorn, first: int, count: int) -> None:
    for n in range(first, first + count):
        assert g.request("POST", f"/signup/{n}") == (200, "ok")


@pytest.mark.parametrize("preload", [False, True], ids=["workers", "preload"])
def test_a_graceful_restart_mid_batch_delivers_everything_within_ten_seconds(
        preload: bool, db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path,
        deployments: list[Gunicorn], capsys: pytest.CaptureFixture[str]) -> None:
    helper = make_app(db_url)  # creates the tables; reads the rows
    try:
        owners = Owners(smtp_server)
        smtp_server.delay("data", DATA_DELAY)
        first = Gunicorn(tmp_path, "first", db_url=db_url, smtp_port=smtp_server.port,
                         preload=preload, durable=False)
        deployments.append(first)
        owners.deployments.append(first)
        first.wait_ready()
        _signup(first, 0, SIGNUPS)
        expected = {r["message_id"] for r in rows(helper)}
        assert len(expected) == SIGNUPS
        assert smtp_server.wait_for(4, timeout=30)
        _assert_master_runs_nothing(first, owners)
        # Mid-batch, whatever the pace: the server withholds its DATA replies from
        # the SIGTERM until a stopping worker released what it had not started.
        smtp_server.hold()
        first.terminate()
        assert poll(lambda: "not yet handed to the server" in first.log(), timeout=30), \
            first.log()[-3000:]
        smtp_server.release()
        stop_seconds = first.stop()

        after_stop = rows(helper)
        queued = [r for r in after_stop if r["status"] == "queued"]
        delivered_before = len(set(smtp_server.message_ids()))
        assert queued, "the stop came after the batch: nothing to prove"
        assert {r["status"] for r in after_stop} <= {"sent", "queued"}
        # What the stopping workers released is marked for the next sweep, and
        # each said so: together they account for every queued row.
        assert {r["lease_owner"] for r in queued} == {RELEASED}
        stopped = [(pid, message) for pid, _, message in first.lines()
                   if message.startswith("Outbox delivery stopped")]
        assert sorted(pid for pid, _ in stopped) == sorted(
            {pid for pid, _, m in first.lines() if m.startswith("Outbox sweep jobs started")})
        given = sum(int(m) for _, message in stopped
                    for m in re.findall(r"released (\d+) unsent", message))
        assert given == len(queued), stopped

        second = Gunicorn(tmp_path, "second", db_url=db_url, smtp_port=smtp_server.port,
                          preload=preload, durable=False)
        deployments.append(second)
        owners.deployments.append(second)
        second.wait_ready()
        assert smtp_server.wait_until(
            lambda: expected <= set(smtp_server.message_ids()),
            timeout=max(0.0, second.started + 10.0 - time.monotonic())), \
            ((f"{len(expected - set(smtp_server.message_ids()))} email(s) not delivered "
              "within 10 s of the restart"), second.log()[-3000:])
        all_delivered = time.monotonic() - second.started
        counts = Counter(smtp_server.message_ids())
        assert set(counts) == expected and max(counts.values()) == 1, counts
        assert poll(lambda: {r["status"] for r in rows(helper)} == {"sent"}, timeout=10)

        # The sweep logs its summary after it recorded the rows it delivered.
        assert poll(lambda: any(m.startswith("Outbox sweep (startup")
                                for _, _, m in second.lines()), timeout=10), second.lines()
        sweeps = [(pid, m) for pid, _, m in second.lines()
                  if m.startswith("Outbox sweep (startup")]
        assert len(sweeps) == 1, second.lines()
        assert f"scanned={len(queued)}" in sweeps[0][1]
        skipped = [m for _, _, m in second.lines() if "startup sweep skipped" in m]
        assert len(skipped) == 1
        _assert_master_runs_nothing(second, owners)
        assert owners.unknown == 0, (owners.unknown_seen, first.log()[-4000:])
        second_stop = second.stop()
        quiet = [m for _, level, m in second.lines() if m.startswith("Outbox delivery stopped")]
        assert len(quiet) == 2 and all("nothing released, nothing in flight" in m
                                       for m in quiet), quiet
    finally:
        close_app(helper)
    with capsys.disabled():
        print(f"\n[deploy] preload={preload} {db_url.split(':')[0]} signups={SIGNUPS} "
              f"delivered before the stop={delivered_before} released={given} "
              f"first stop {stop_seconds:.1f} s; all delivered {all_delivered:.1f} s after "
              f"the restart; copies per Message-ID max {max(counts.values())}; "
              f"SMTP connections per pid {dict(owners.by_pid)}; idle stop {second_stop:.1f} s")


def test_preload_in_durable_mode_runs_dispatchers_only_in_the_workers(
        db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path,
        deployments: list[Gunicorn], capsys: pytest.CaptureFixture[str]) -> None:
    helper = make_app(db_url)
    try:
        owners = Owners(smtp_server)
        g = Gunicorn(tmp_path, "durable", db_url=db_url, smtp_port=smtp_server.port,
                     preload=True, durable=True)
        deployments.append(g)
        owners.deployments.append(g)
        g.wait_ready()
        workers = g.workers()
        # Each worker starts its dispatcher at once (item 5), without a request of its own.
        started = poll(lambda: Counter(pid for pid, _, m in g.lines()
                                       if m.startswith("Outbox dispatcher started")),
                       lambda c: len(c) == 2, timeout=20)
        assert started == Counter({pid: 1 for pid in workers}), g.lines()
        _signup(g, 0, 10)
        expected = {r["message_id"] for r in rows(helper)}
        assert smtp_server.wait_until(lambda: expected <= set(smtp_server.message_ids()),
                                      timeout=30)
        assert max(Counter(smtp_server.message_ids()).values()) == 1
        _assert_master_runs_nothing(g, owners)
        assert set(owners.by_pid) <= set(workers) and owners.unknown == 0
        # One startup sweep for the deployment (the other worker's claim lost).
        decided = poll(lambda: [(pid, m) for pid, _, m in g.lines()
                                if m.startswith("Outbox sweep (startup")
                                or "startup sweep skipped" in m],
                       lambda found: len(found) == 2, timeout=20)
        assert sorted(pid for pid, _ in decided) == sorted(workers), decided
        assert sum(m.startswith("Outbox sweep (startup") for _, m in decided) == 1
        stop_seconds = g.stop()
    finally:
        close_app(helper)
    with capsys.disabled():
        print(f"\n[deploy] durable --preload {db_url.split(':')[0]}: dispatchers per pid "
              f"{dict(started)}, SMTP connections per pid {dict(owners.by_pid)}, master "
              f"{g.pid}: none; graceful stop {stop_seconds:.1f} s")
