"""A transport-wide fault pauses the transport, not the emails (issue 40 item 4).

Real parts: the app's worker, the resend transport against tests/provider_resend.py
(whose key is revoked, then restored), SMTP against tests/smtpserver.py (refusing
AUTH, or a closed port), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, free_port, rows, wait_rows
from flask import Flask
from provider_resend import API_KEY, FakeResend

from flask_mail_outbox import ConfigError, Message, OutboxMail

PAUSED_ERROR = "is paused since"


@pytest.fixture
def fake() -> Iterator[FakeResend]:
    server = FakeResend()
    server.start()
    yield server
    server.stop()


def _entry(fake: FakeResend, **extra: Any) -> dict[str, Any]:
    return {"transport": "resend", "base_url": fake.url, "api_key": API_KEY, **extra}


def _send(app: Flask, count: int, subject: str = "hello") -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [int(mail.send(Message(f"{subject} {i}", recipients=[f"to{i}@example.com"],
                                     body="text"))) for i in range(count)]
        db.session.commit()
    return ids


def _durable(make_apps: MakeApps, fake: FakeResend, **config: Any) -> tuple[Flask, OutboxMail]:
    settings: dict[str, Any] = {
        "OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False, "OUTBOX_POLL_INTERVAL": 0.05,
        "OUTBOX_POLL_MAX_INTERVAL": 0.2, "OUTBOX_INLINE_RETRIES": 0,
        "OUTBOX_RETRY_BASE_SECONDS": 0.2, "OUTBOX_MAX_ATTEMPTS": 2,
        "OUTBOX_PAUSE_PROBE_SECONDS": 0.5, "OUTBOX_PAUSE_PROBE_MAX_SECONDS": 1.0,
        "OUTBOX_TRANSPORTS": {"default": _entry(fake)}}
    settings.update(config)
    return make_apps(**settings)


def _pause_row(app: Flask, name: str = "default") -> Any:
    with app.app_context(), db.engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT paused_kind, paused_reason, paused_since, probe_at, probe_delay "
            "FROM outbox_rate WHERE name = :name"), {"name": name}).first()


def _errors(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and text in r.getMessage()]


def test_a_revoked_key_pauses_the_transport_and_nothing_is_dead_lettered(
        make_apps: MakeApps, fake: FakeResend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fake.api_key = "re_rotated_elsewhere"  # ours is refused: 403 invalid_api_key
    app, mail = _durable(make_apps, fake)
    _send(app, 5)
    paused = wait_rows(app, lambda rs: len(rs) == 5 and all(r["last_error"] for r in rs),
                       timeout=10)
    assert all(r["status"] == "queued" and r["attempts"] == 0 for r in paused), paused
    row = _pause_row(app)
    assert row is not None and row.paused_kind == "credentials", row
    assert "403" in row.paused_reason
    # Paused: only probes reach the API, one at a time, at a growing delay.
    before = len(fake.sending())
    time.sleep(2.5)
    probes = len(fake.sending()) - before
    assert 1 <= probes <= 4, probes
    current = rows(app)
    assert all(r["status"] == "queued" and r["attempts"] == 0 for r in current), current
    # The key is good again: the next probe gets through and everything goes at once.
    fake.api_key = API_KEY
    sent = wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert len(sent) == 5 and all(r["attempts"] == 1 for r in sent), sent
    accepted = [a.json["headers"]["Message-ID"] for a in fake.accepted]
    assert sorted(accepted) == sorted(r["message_id"] for r in sent)
    assert _pause_row(app).paused_kind is None
    errors = _errors(caplog, PAUSED_ERROR)
    assert len(errors) == 1, errors
    assert "wait without spending attempts" in errors[0] and "5 days" in errors[0]
    assert not _errors(caplog, "dead-lettered")
    assert any("is back" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    mail.stop()
