"""Attempts that may have delivered the email are retried a bounded number of times.

Issue 36, defect 10: a 2xx the transport cannot read, a timeout after the
request went, a connection cut after the provider accepted, and an SMTP
connection dropped after the final dot, were each retried up to
``OUTBOX_MAX_ATTEMPTS`` times: 4 to 6 accepted copies. Now:

* a provider that honours an idempotency key (Resend) is retried as usual:
  the key makes each retry safe, one copy in all;
* any other is retried ``OUTBOX_AMBIGUOUS_RETRIES`` times (default 1), then
  the row ends ``failed`` with a last error that says it may have been sent;
* such an attempt never fails over to another transport (a copy of its own).

Copies are counted where they arrive: the local provider servers' accepted
lists, the SMTP server's messages by Message-ID. Also here (issue 36, 11):
a reply that echoes the library's own credentials is stored and logged with
``[redacted]`` in their place.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import MakeApps, db, make_app, rows, wait_rows
from httpserver import FakeAPI
from provider_mailgun import MailgunAPI
from provider_postmark import TOKEN, FakePostmark
from provider_resend import API_KEY, FakeResend
from provider_sendgrid import SendGridAPI
from provider_ses import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, SignedSESFake
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message

SENDGRID_KEY = "SG.test-key.secret"
MAILGUN_KEY = "key-test-secret"

#: Fast retries, many attempts: without the bound each attempt is a copy.
FAST: dict[str, Any] = {
    "OUTBOX_MAX_ATTEMPTS": 6, "OUTBOX_RETRY_BASE_SECONDS": 0.05,
    "OUTBOX_RETRY_MAX_SECONDS": 0.1, "OUTBOX_INLINE_RETRIES": 6,
}
MODES: dict[str, dict[str, Any]] = {
    "inline": {},
    "durable": {"OUTBOX_DURABLE": True, "OUTBOX_POLL_INTERVAL": 0.05,
                "OUTBOX_POLL_MAX_INTERVAL": 0.1},
}


def _send(app: Any, to: str = "ann@example.com") -> int:
    mail = app.extensions["test_mail"]
    with app.app_context():
        email_id = int(mail.send(Message("Hello", recipients=[to], body="Hello text")))
        db.session.commit()
    return email_id


def _ended(current: list[dict[str, Any]]) -> bool:
    return bool(current) and all(r["status"] in ("sent", "failed") for r in current)


def _history(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(json.loads(row["error_history"] or "[]"))


def _settled(app: Any, seconds: float = 1.0) -> list[dict[str, Any]]:
    """The rows once ended, and still so after ``seconds`` (no later attempt)."""
    [row] = wait_rows(app, _ended, timeout=20)
    again = wait_rows(app, lambda r: r[0]["attempts"] != row["attempts"], timeout=seconds)
    assert again[0]["attempts"] == row["attempts"], "attempted again after it ended"
    return again


# -- SMTP: dropped after the final dot -----------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("retries", [1, 0, 2])
def test_smtp_dropped_after_the_final_dot_is_retried_within_the_bound(
        mode: str, retries: int, make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    smtp_server.drop_after_accept()  # every attempt: the server takes it, says nothing
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_AMBIGUOUS_RETRIES=retries, **FAST, **MODES[mode])
    email_id = _send(app)
    [row] = _settled(app)
    copies = smtp_server.message_ids().count(row["message_id"])
    assert copies == 1 + retries
    assert (row["status"], row["attempts"]) == ("failed", 1 + retries)
    assert "may have been sent:" in row["last_error"], row["last_error"]
    assert f"OUTBOX_AMBIGUOUS_RETRIES={retries}" in row["last_error"]
    assert "after the whole message was sent" in row["last_error"]
    assert [h.get("maybe_sent") for h in _history(row)] == [True] * (1 + retries)
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and f"Email {email_id} " in r.getMessage()]
    assert any("may have been sent" in e for e in errors), errors


def test_smtp_dropped_once_after_the_final_dot_is_sent_on_the_retry(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """The bound's one retry: the documented second copy, and the row ends sent."""
    smtp_server.drop_after_accept(times=1)
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port, **FAST)
    _send(app)
    [row] = _settled(app)
    assert (row["status"], row["attempts"]) == ("sent", 2)
    assert smtp_server.message_ids().count(row["message_id"]) == 2


def test_smtp_silent_after_the_final_dot_is_ambiguous_too(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """No reply within MAIL_TIMEOUT after the content: the server may have queued it."""
    smtp_server.delay("data", 3)
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       MAIL_TIMEOUT=0.5, **FAST)
    _send(app)
    [row] = _settled(app)
    assert (row["status"], row["attempts"]) == ("failed", 2)
    assert smtp_server.data_attempts == 2
    assert "may have been sent:" in row["last_error"] and "timed out" in row["last_error"]


def test_smtp_refused_after_the_final_dot_is_not_ambiguous(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """A 451 after the dot is an answer: retried as usual, never counted as maybe sent."""
    smtp_server.reply("data", 451, times=3)
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_AMBIGUOUS_RETRIES=0, **FAST)
    _send(app)
    [row] = _settled(app)
    assert (row["status"], row["attempts"]) == ("sent", 4)
    assert not any(h.get("maybe_sent") for h in _history(row))


# -- providers -----------------------------------------------------------------------------


def _postmark() -> tuple[FakeAPI, dict[str, Any]]:
    fake = FakePostmark()
    return fake, {"transport": "postmark", "token": TOKEN}


def _sendgrid() -> tuple[FakeAPI, dict[str, Any]]:
    return SendGridAPI(SENDGRID_KEY), {"transport": "sendgrid", "api_key": SENDGRID_KEY}


def _mailgun() -> tuple[FakeAPI, dict[str, Any]]:
    return MailgunAPI(MAILGUN_KEY), {"transport": "mailgun", "api_key": MAILGUN_KEY,
                                     "domain": "mg.example.com"}


def _ses() -> tuple[FakeAPI, dict[str, Any]]:
    return SignedSESFake(), {"transport": "ses", "region": REGION,
                             "access_key_id": ACCESS_KEY_ID,
                             "secret_access_key": SECRET_ACCESS_KEY}


def _resend() -> tuple[FakeAPI, dict[str, Any]]:
    return FakeResend(), {"transport": "resend", "api_key": API_KEY}


PROVIDERS: dict[str, Callable[[], tuple[FakeAPI, dict[str, Any]]]] = {
    "postmark": _postmark, "sendgrid": _sendgrid, "mailgun": _mailgun, "ses": _ses,
    "resend": _resend}
NOT_IDEMPOTENT = ["postmark", "sendgrid", "mailgun", "ses"]


@pytest.fixture
def provider(request: pytest.FixtureRequest) -> Iterator[tuple[FakeAPI, dict[str, Any]]]:
    fake, entry = PROVIDERS[request.param]()
    fake.start()
    yield fake, {**entry, "base_url": fake.url, "timeout": 0.4}
    fake.stop()


def _accepted(fake: FakeAPI) -> int:
    return len(fake.accepted)  # type: ignore[attr-defined]


AMBIGUOUS_CASES = [
    *[pytest.param(name, shape, id=f"{name}-{shape}") for name in ["postmark"]
      for shape in ("garbled", "late", "cut")],
    *[pytest.param(name, "cut", id=f"{name}-cut") for name in NOT_IDEMPOTENT[1:]],
    pytest.param("sendgrid", "late", id="sendgrid-late"),
]


@pytest.mark.parametrize(("provider", "shape"), AMBIGUOUS_CASES, indirect=["provider"])
def test_an_ambiguous_provider_answer_is_retried_within_the_bound(
        provider: tuple[FakeAPI, dict[str, Any]], shape: str, make_apps: MakeApps) -> None:
    fake, entry = provider
    fake.answer_ambiguously(shape)  # every request: accepted, its answer lost
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": entry}, **FAST, **MODES["durable"])
    _send(app)
    [row] = _settled(app)
    assert _accepted(fake) == 2  # the first attempt and its one retry
    assert (row["status"], row["attempts"]) == ("failed", 2)
    assert "may have been sent:" in row["last_error"], row["last_error"]
    assert "the provider may have accepted it" in row["last_error"]


@pytest.mark.parametrize("provider", ["postmark"], indirect=True)
def test_an_ambiguous_provider_answer_once_is_sent_on_the_retry(
        provider: tuple[FakeAPI, dict[str, Any]], make_apps: MakeApps) -> None:
    fake, entry = provider
    fake.answer_ambiguously("cut", times=1)
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": entry}, **FAST)
    _send(app)
    [row] = _settled(app)
    assert (row["status"], row["attempts"]) == ("sent", 2)
    assert _accepted(fake) == 2  # the documented second copy, and no third


@pytest.mark.parametrize("shape", ["garbled", "late", "cut"])
@pytest.mark.parametrize("provider", ["resend"], indirect=True)
def test_an_idempotent_provider_is_retried_as_usual_and_sends_once(
        provider: tuple[FakeAPI, dict[str, Any]], shape: str, make_apps: MakeApps) -> None:
    """Resend honours the Idempotency-Key: three lost answers, one email."""
    fake, entry = provider
    fake.answer_ambiguously(shape, times=3)
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": entry}, OUTBOX_AMBIGUOUS_RETRIES=0,
                       **FAST)
    _send(app)
    [row] = _settled(app)
    assert (row["status"], row["attempts"]) == ("sent", 4)
    assert _accepted(fake) == 1
    keys = {r.header("Idempotency-Key") for r in fake.requests}
    assert keys == {row["message_id"].strip("<>")}


@pytest.mark.parametrize("provider", ["postmark", "resend"], indirect=True)
def test_an_ambiguous_answer_never_fails_over(
        provider: tuple[FakeAPI, dict[str, Any]], make_apps: MakeApps,
        smtp_server: FaultSMTPServer) -> None:
    """The backup would send a copy of its own: the attempt ends on the primary."""
    fake, entry = provider
    fake.answer_ambiguously("late", times=1)
    app, _ = make_apps(OUTBOX_TRANSPORTS={
        "default": {**entry, "failover": ["backup"]},
        "backup": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                   "MAIL_PORT": smtp_server.port}}, **FAST)
    _send(app)
    [row] = _settled(app)
    assert row["status"] == "sent" and smtp_server.messages == []
    assert not any(h.get("failed_over_to") for h in _history(row))


@pytest.mark.parametrize("value", [-1, 1.5, "many", True])
def test_a_bad_ambiguous_retries_is_refused_naming_the_key(
        value: Any, db_url: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_AMBIGUOUS_RETRIES"):
        make_app(db_url, OUTBOX_AMBIGUOUS_RETRIES=value)


# -- credentials echoed back ---------------------------------------------------------------


@pytest.mark.parametrize(("provider", "secret"), [
    pytest.param("postmark", TOKEN, id="postmark"),
    pytest.param("resend", API_KEY, id="resend"),
    pytest.param("sendgrid", SENDGRID_KEY, id="sendgrid"),
], indirect=["provider"])
def test_a_reply_echoing_the_api_key_is_stored_and_logged_redacted(
        provider: tuple[FakeAPI, dict[str, Any]], secret: str, make_apps: MakeApps,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fake, entry = provider
    fake.echo_credentials(401)
    # Not the fixture's 0.4 s (made for late answers): a loaded CI machine took longer
    # to connect, and the transport paused as unreachable instead.
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": {**entry, "timeout": 10}},
                       OUTBOX_INLINE_RETRIES=0)
    _send(app)
    # The refused key pauses the transport: its ERROR comes just after the record.
    [row] = wait_rows(app, lambda r: bool(r[0]["last_error"]) and "[redacted]" in caplog.text,
                      timeout=30)
    assert fake.requests, "the provider was asked"
    assert "[redacted]" in row["last_error"], row["last_error"]
    stored = json.dumps(rows(app), default=str)
    assert secret not in stored
    assert secret not in caplog.text
    assert "[redacted]" in caplog.text


def test_an_smtp_reply_echoing_the_password_is_stored_and_logged_redacted(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    password = "s3cret-Passw0rd"
    smtp_server.require_auth("outbox", password)
    smtp_server.reply("data", 554, f"5.7.1 refused for outbox/{password}")
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       MAIL_USERNAME="outbox", MAIL_PASSWORD=password)
    _send(app)
    [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=10)
    assert row["last_error"] == "554 5.7.1 refused for outbox/[redacted]"
    assert password not in json.dumps(rows(app), default=str)
    assert password not in caplog.text
