"""Several ``flask outbox worker`` processes on PostgreSQL, a key revoked for a while, then
restored (issue 40 item 4): nothing dead-lettered, nothing lost, nothing sent twice, one
ERROR per fault per process.

The workers (tests/pause_helpers.py: ``OUTBOX_MAX_ATTEMPTS=2``) deliver through the ses
transport to tests/provider_ses.py's fake, which checks every request's signature: an
empty ``credentials`` map refuses the key (403 UnrecognizedClientException).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import db, rows, wait_rows
from flask import Flask
from provider_ses import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, SignedSESFake

# The multi-process tests' fixtures (imported to be used here).
from test_workers import REPO, TESTS, all_done, pg_url, producer  # noqa: F401

from flask_mail_outbox import Message, OutboxMail

WORKERS = 3
BEFORE = 30  # sent while the key works
DURING = 60  # queued while it is revoked
PAUSED = re.compile(r" ERROR flask_mail_outbox\._degrade: Transport 'default' is paused since")
BACK = re.compile(r" INFO flask_mail_outbox\.core\._pause: Transport 'default' is back")
DEAD = re.compile(r"dead-lettered")


@pytest.fixture
def api() -> Iterator[SignedSESFake]:
    server = SignedSESFake(REGION)
    server.start()
    yield server
    server.stop()


class Worker:
    """One ``flask outbox worker`` subprocess of pause_helpers, logging to a file."""

    def __init__(self, name: str, tmp_path: Path, db_url: str, api_url: str) -> None:
        self.log_path = tmp_path / f"worker-{name}.log"
        env = dict(os.environ)
        env.update({"PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}", "WORKER_DB_URL": db_url,
                    "WORKER_SES_URL": api_url, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
                    "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
                    "AWS_EC2_METADATA_DISABLED": "true"})
        env.pop("AWS_SESSION_TOKEN", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flask", "--app", "pause_helpers:create_app",
                 "outbox", "worker"],
                env=env, cwd=str(TESTS), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _queue(app: Flask, count: int, tag: str) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        for i in range(count):
            mail.send(Message(f"{tag} {i}", recipients=[f"{tag}{i}@example.com"], body="x"))
        db.session.commit()


def _paused(app: Flask) -> str | None:
    with app.app_context(), db.engine.connect() as conn:
        kind = conn.execute(sa.text(
            "SELECT paused_kind FROM outbox_rate WHERE name = 'default'")).scalar()
    return None if kind is None else str(kind)


def test_a_key_revoked_then_restored_under_several_workers_loses_and_doubles_nothing(
        tmp_path: Path, pg_url: str, producer: Flask,  # noqa: F811 - fixtures
        api: SignedSESFake) -> None:
    workers = [Worker(str(n), tmp_path, pg_url, api.url) for n in range(WORKERS)]
    try:
        _queue(producer, BEFORE, "before")
        wait_rows(producer, all_done(BEFORE), timeout=60)
        api.credentials = {}  # the key is revoked
        _queue(producer, DURING, "during")
        assert wait_rows(producer, lambda rs: _paused(producer) == "credentials", timeout=30)
        time.sleep(4)  # several probes (0.5 s doubling to 1 s), all refused
        during = [r for r in rows(producer) if r["subject"].startswith("during")]
        probing = [r for r in during if r["status"] == "sending"]  # one probe may be out
        assert len(probing) <= 1 and all(
            r["status"] == "queued" and r["attempts"] == 0 for r in during
            if r not in probing), [(r["id"], r["status"], r["attempts"]) for r in during]
        refused = len(api.sending()) - BEFORE
        api.credentials = {ACCESS_KEY_ID: SECRET_ACCESS_KEY}  # restored
        done = wait_rows(producer, all_done(BEFORE + DURING), timeout=60)
        assert _paused(producer) is None
    finally:
        for worker in workers:
            worker.stop()
    logs = [worker.log() for worker in workers]
    accepted = Counter(_message_id(a.raw) for a in api.accepted)
    # Nothing lost, nothing sent twice (counted at the server, by Message-ID).
    assert sorted(accepted) == sorted(r["message_id"] for r in done)
    assert set(accepted.values()) == {1}, [m for m, n in accepted.items() if n > 1]
    assert all(r["status"] == "sent" for r in done)
    # Nothing dead-lettered, and one ERROR per process for the one fault.
    paused_errors = [len(PAUSED.findall(log)) for log in logs]
    assert paused_errors == [1] * WORKERS, paused_errors
    assert not any(DEAD.search(log) for log in logs)
    assert all(BACK.search(log) for log in logs)
    print(f"\npaused-transport test: {WORKERS} workers, {BEFORE} sent before, {DURING} queued "
          f"while revoked; requests refused while revoked: {refused}; accepted "
          f"{sum(accepted.values())} (distinct {len(accepted)}); dead-lettered 0; ERROR lines "
          f"per process {paused_errors}")


def _message_id(raw: bytes) -> str:
    from email.parser import BytesHeaderParser
    from email.policy import default as default_policy
    return str(BytesHeaderParser(policy=default_policy).parsebytes(raw)["Message-ID"])
