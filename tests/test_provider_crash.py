"""SIGKILL of a `flask outbox worker` in the middle of provider API requests loses nothing.

A real worker process (``tests/provider_worker_app.py``) drains 200 emails
from PostgreSQL through the ses transport (an HTTP transport: pooled httpx
client, ``concurrency`` requests in flight, SigV4-signed by botocore with
credentials from the environment) into :class:`provider_ses.SignedSESFake`,
which checks every signature, records what it accepted as soon as it has
read the request and answers 50 ms later. Three times, just after a request
arrived (so requests are in flight), the test SIGKILLs the worker, reads how
many rows the dead process held in ``sending``, and starts another. At the end:

* every row is ``sent``, and the fake accepted every Message-ID (lost = 0);
* every copy beyond the first of a Message-ID is explained by a kill: a message the
  provider had accepted while its row was still ``sending`` under the killed
  process (a request in flight, or an answer not yet recorded), which the next
  worker sends again after the lease (SES has no idempotency key). Per kill that
  is the ``concurrency`` requests on the wire plus the answers that came back in
  the worker's last record window (``RECORD_WINDOW`` and one commit): a few more
  than ``concurrency`` at most, never the rows it had merely claimed.

PostgreSQL only, as every multi-process test (tests/test_workers.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from email.parser import BytesHeaderParser
from email.policy import default as default_policy
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import db, rows, wait_rows
from flask import Flask
from provider_ses import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, SignedSESFake

# The multi-process tests' fixtures (imported to be used here).
from test_workers import FAST, REPO, TESTS, all_done, pg_url, producer  # noqa: F401

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import email_table

TOTAL = 200
KILLS = 3
#: Requests in flight per worker process (the ses entry's ``concurrency``).
CONCURRENCY = 4
#: How long the fake takes to answer each request, after it recorded the message.
LATENCY = 0.05
LEASE = "2"
BATCH = "20"


class APIWorker:
    """One ``flask outbox worker`` subprocess of ``provider_worker_app``, logging to a file."""

    def __init__(self, name: str, tmp_path: Path, db_url: str, api_url: str) -> None:
        self.log_path = tmp_path / f"worker-{name}.log"
        env = dict(os.environ)
        env.update(FAST)
        env.update({
            "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
            "WORKER_DB_URL": db_url, "WORKER_SES_URL": api_url, "WORKER_SES_REGION": REGION,
            "WORKER_HTTP_CONCURRENCY": str(CONCURRENCY), "WORKER_LEASE_SECONDS": LEASE,
            "WORKER_BATCH_SIZE": BATCH,
            # The ses transport finds these through AWS's usual chain.
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_EC2_METADATA_DISABLED": "true",
        })
        env.pop("AWS_SESSION_TOKEN", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flask", "--app", "provider_worker_app:create_app",
                 "outbox", "worker"],
                env=env, cwd=str(TESTS), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def api() -> Iterator[SignedSESFake]:
    """The provider, answering each request ``LATENCY`` s after it recorded it."""
    server = SignedSESFake(REGION)
    server.latency = LATENCY
    server.start()
    yield server
    server.stop()


@pytest.fixture
def spawn(tmp_path: Path, pg_url: str, producer: Flask,  # noqa: F811 - fixtures
          api: SignedSESFake) -> Iterator[Callable[[str], APIWorker]]:
    """Start workers on the test's database and fake API; all killed at the end."""
    started: list[APIWorker] = []

    def start(name: str) -> APIWorker:
        worker = APIWorker(name, tmp_path, pg_url, api.url)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()


def _sending_of(app: Flask, pid: int) -> set[str]:
    """Message-IDs of the rows in ``sending`` under process ``pid``'s leases (``host:pid:...``)."""
    t = email_table
    with app.app_context(), db.engine.connect() as conn:
        return set(conn.execute(sa.select(t.c.message_id).where(
            t.c.status == "sending", t.c.lease_owner.like(f"%:{pid}:%"))).scalars())


_HEADERS = BytesHeaderParser(policy=default_policy)


def _copies(api: SignedSESFake) -> Counter[str]:
    """How many times the fake accepted each Message-ID."""
    return Counter(str(_HEADERS.parsebytes(a.raw)["Message-ID"]) for a in list(api.accepted))


def test_sigkills_mid_request_lose_no_email_and_duplicate_only_what_was_in_flight(
        producer: Flask, spawn: Callable[[str], APIWorker],  # noqa: F811 - fixtures
        api: SignedSESFake, capsys: pytest.CaptureFixture[str]) -> None:
    mail: OutboxMail = producer.extensions["test_mail"]
    with producer.app_context():
        for i in range(TOTAL):
            mail.send(Message(f"crash {i}", recipients=[f"r{i % 20}@example.com"],
                              body=f"email number {i}"))
        db.session.commit()
    expected = {r["message_id"] for r in rows(producer)}
    assert len(expected) == TOTAL

    worker = spawn("w0")
    held: list[int] = []  # rows `sending` under the killed process
    accepted_unrecorded: list[int] = []  # of those, the ones the provider had accepted
    for n in range(1, KILLS + 1):
        # Spread over the drain; right after a request arrived, so the worker is waiting
        # for answers (the fake has recorded the message and answers 50 ms later).
        assert api.wait_for(n * TOTAL // (KILLS + 2), timeout=60), worker.log()[-3000:]
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(10)
        time.sleep(0.2)  # what the dead process wrote before dying is read by the fake
        sending = _sending_of(producer, worker.pid)
        held.append(len(sending))
        accepted_unrecorded.append(len(sending & set(_copies(api))))
        assert len(api.accepted) < TOTAL, f"the drain ended before kill {n}"
        worker = spawn(f"w{n}")

    deadline = time.monotonic() + 90
    while not expected <= set(_copies(api)) and time.monotonic() < deadline:
        time.sleep(0.1)
    copies = _copies(api)
    current = wait_rows(producer, all_done(TOTAL), timeout=60.0, interval=0.2)
    assert Counter(r["status"] for r in current) == {"sent": TOTAL}, worker.log()[-3000:]
    assert all(r["lease_owner"] is None for r in current)

    lost = expected - set(copies)
    unknown = set(copies) - expected
    duplicates = sum(n - 1 for n in copies.values() if n > 1)
    assert (lost, unknown) == (set(), set())
    # Each copy is one the provider accepted for a row the killed worker had not recorded.
    assert duplicates == sum(accepted_unrecorded), (duplicates, accepted_unrecorded, held)
    # Every kill landed mid-request: the provider had messages the worker never recorded.
    assert all(accepted_unrecorded), accepted_unrecorded
    # The requests on the wire, and the answers of the last record window: never the
    # claimed rows the worker had not sent yet.
    assert all(a <= 2 * CONCURRENCY for a in accepted_unrecorded), (accepted_unrecorded, held)
    assert all(a < h for a, h in zip(accepted_unrecorded, held, strict=True)), \
        (accepted_unrecorded, held)
    # The provider's id of the copy each row recorded is one the provider gave.
    assert {r["provider_message_id"] for r in current} <= {a.message_id for a in api.accepted}
    assert worker.proc.poll() is None
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(30) == 0, worker.log()[-3000:]
    with capsys.disabled():
        print(f"\n[provider crash] emails={TOTAL} kills={KILLS} concurrency={CONCURRENCY} "
              f"rows held at the kills={held} accepted but unrecorded={accepted_unrecorded} "
              f"duplicates={duplicates} lost={len(lost)} requests={len(api.sending())}")
