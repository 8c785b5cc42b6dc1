"""SQLite under contention: threads and processes writing one file (issue 6, part 4).

Writers: this process's 4 request threads and 3 subprocesses
(``tests/chaos_app.py``) with 3 request threads each. Every request adds a
row of the app's own and an email and commits. Each of those 4 processes also
runs a durable dispatcher that polls fast in batches of 5, and a
`flask outbox worker` process delivers too: 5 claimers and recorders (each
``BEGIN IMMEDIATE``) against the writers' commits on one SQLite file.

What must hold: every request succeeded (no exception in any writer), no
``database is locked`` anywhere (exceptions, library logs, stderr), no ERROR from
the library, and every email delivered exactly once by Message-ID.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import chaos_app
import pytest
import sqlalchemy as sa
from smtpserver import FaultSMTPServer
from test_workers import FAST, Worker

from flask_mail_outbox import OutboxMail
from flask_mail_outbox.core import email_table

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

THREADS, REQUESTS, PROCESSES = 3, 50, 3
LOCAL_THREADS = 4


def test_concurrent_writers_and_deliverers_lose_nothing_and_never_see_locked(
        tmp_path: Path, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    url = f"sqlite:///{tmp_path / 'contended.db'}"
    app = chaos_app.create_app(url, smtp_server.port, "local")
    mail: OutboxMail = app.extensions["mail_outbox"].ext
    with app.app_context():
        chaos_app.db.create_all()
        mail.create_all()

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO)]),
               CHAOS_DB_URL=url, CHAOS_SMTP_PORT=str(smtp_server.port))
    logs = [tmp_path / f"writer-{i}.log" for i in range(PROCESSES)]
    writers = []
    for i, log in enumerate(logs):
        with log.open("wb") as stderr:
            writers.append(subprocess.Popen(
                [sys.executable, str(TESTS / "chaos_app.py"), str(THREADS), str(REQUESTS)],
                env=dict(env, CHAOS_NAME=f"proc{i}"), cwd=str(REPO), stdout=subprocess.PIPE,
                stderr=stderr, text=True))
    worker = Worker("sqlite", tmp_path, url, smtp_server.port, 4, dict(FAST))
    expected = LOCAL_THREADS * REQUESTS + PROCESSES * THREADS * REQUESTS
    engine = sa.create_engine(url)
    try:
        done, errors = chaos_app.run_writers(app, LOCAL_THREADS, REQUESTS)
        outputs = [proc.communicate(timeout=180)[0] for proc in writers]
        codes = [proc.returncode for proc in writers]

        def all_sent() -> bool:
            with engine.connect() as conn:
                return bool(conn.execute(sa.select(sa.func.count()).where(
                    email_table.c.status == "sent")).scalar_one() == expected)

        assert smtp_server.wait_until(lambda: len(smtp_server.messages) >= expected,
                                      timeout=120)
        assert smtp_server.wait_until(all_sent, timeout=60)
        with engine.connect() as conn:
            current = conn.execute(sa.select(email_table.c.message_id, email_table.c.status,
                                             email_table.c.subject)).all()
        assert worker.terminate_and_wait(timeout=30) == 0
    finally:
        for proc in writers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        worker.kill()
        mail.stop(timeout=10)
        engine.dispose()

    # Every writer succeeded, in this process and in the others.
    assert (done, errors) == (LOCAL_THREADS * REQUESTS, [])
    assert codes == [0] * PROCESSES, outputs
    assert all(out.strip().endswith(f"DONE sent={THREADS * REQUESTS} errors=0")
               for out in outputs), outputs
    # Nothing lost, each email once.
    assert len(current) == expected
    assert Counter(r.status for r in current) == {"sent": expected}
    received = Counter(smtp_server.message_ids())
    assert received == {r.message_id: 1 for r in current}
    # Nobody saw the lock: not in exceptions (above), logs or stderr.
    texts = {str(log): log.read_text(errors="replace") for log in logs}
    texts["worker"] = worker.log()
    texts["this process"] = "\n".join(r.getMessage() for r in caplog.records)
    for name, text in texts.items():
        assert "database is locked" not in text, (name, text[-3000:])
        assert "Traceback" not in text, (name, text[-3000:])
        if name != "this process":
            assert " ERROR " not in text, (name, text[-3000:])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with capsys.disabled():
        print(f"\n[sqlite locking] {LOCAL_THREADS} threads here + {PROCESSES} processes x "
              f"{THREADS} threads wrote {expected} emails (one commit each) while 5 "
              f"dispatchers claimed and recorded; delivered {sum(received.values())}, "
              f"distinct {len(received)}, lost 0, 'database is locked' 0, "
              f"worker delivered {len(worker.sent_ids())}")
