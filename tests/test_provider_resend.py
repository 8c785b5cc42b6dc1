"""The resend transport against a fake of Resend's Email API (tests/provider_resend.py).

Every test goes through a real app: ``mail.send`` and a commit, the worker,
the transport's pooled client, a real HTTP server answering as Resend
documents (idempotency keys included), and the row as the store records it,
on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeApps, db, free_port, rows, wait_rows
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from httpserver import Reply
from provider_resend import API_KEY, FakeResend
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail


@pytest.fixture
def fake() -> Iterator[FakeResend]:
    """Resend on a loopback port."""
    server = FakeResend()
    server.start()
    yield server
    server.stop()


def _entry(fake: FakeResend, **extra: Any) -> dict[str, Any]:
    return {"transport": "resend", "base_url": fake.url, "api_key": API_KEY, **extra}


def _send(app: Flask, *messages: Message, **options: Any) -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [int(mail.send(message, **options)) for message in messages]
        db.session.commit()
    return ids


def _plain(subject: str = "hello", to: str = "to@example.com") -> Message:
    return Message(subject, recipients=[to], body="text")


def _idle(app: Flask) -> None:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        assert mail.wait_idle(10)


def _status(*statuses: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda current: bool(current) and all(r["status"] in statuses for r in current)


def _history(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(json.loads(row["error_history"] or "[]"))


def _durable(make_apps: MakeApps, fake: FakeResend, **config: Any) -> tuple[Flask, OutboxMail]:
    """A durable app whose dispatcher polls often: a retried row goes out within a second."""
    settings: dict[str, Any] = {
        "OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False, "OUTBOX_POLL_INTERVAL": 0.05,
        "OUTBOX_POLL_MAX_INTERVAL": 0.2, "OUTBOX_INLINE_RETRIES": 0,
        "OUTBOX_RETRY_BASE_SECONDS": 0.2, "OUTBOX_TRANSPORTS": {"default": _entry(fake)}}
    settings.update(config)
    return make_apps(**settings)


# -- delivery ----------------------------------------------------------------------------


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
PDF = b"%PDF-1.4\n" + bytes(range(256)) * 4


def test_every_field_arrives_and_resends_id_is_stored(
        make_apps: MakeApps, fake: FakeResend) -> None:
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    message = Message("Grüße, order #7", sender=("Ann Örtel", "ann@example.com"),
                      recipients=["Bob Bauer <bob@example.com>", "carol@example.com"],
                      cc=["Müller, Jörg <joerg@example.com>"], bcc=["hidden@example.com"],
                      reply_to="Support <support@example.com>", body="Plain text\nline two",
                      extra_headers={"X-Campaign": "spring"},
                      list_unsubscribe="https://example.com/unsubscribe/7")
    message.attach("invoice.pdf", "application/pdf", PDF)
    cid = message.embed("logo.png", "image/png", PNG)
    message.html = f"<p>Hi <img src=\"cid:{cid}\"></p>"
    [email_id] = _send(app, message)
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    [request] = fake.sending()
    assert request.path == "/emails" and request.header("Authorization") == f"Bearer {API_KEY}"
    assert request.header("Idempotency-Key") == row["message_id"].strip("<>")
    [accepted] = fake.accepted
    sent = accepted.json
    assert sent["from"] == "Ann Örtel <ann@example.com>"
    assert sent["to"] == ["Bob Bauer <bob@example.com>", "carol@example.com"]
    assert sent["cc"] == ["=?utf-8?q?M=C3=BCller=2C_J=C3=B6rg?= <joerg@example.com>"]
    assert sent["bcc"] == ["hidden@example.com"]
    assert sent["reply_to"] == ["Support <support@example.com>"]
    assert sent["subject"] == "Grüße, order #7"
    assert sent["text"] == "Plain text\nline two"
    assert sent["html"] == f"<p>Hi <img src=\"cid:{cid}\"></p>"
    assert sent["headers"] == {"Message-ID": row["message_id"],
                               "List-Unsubscribe": "<https://example.com/unsubscribe/7>",
                               "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
                               "X-Campaign": "spring"}
    pdf, pdf_json = accepted.attachment("invoice.pdf")
    assert pdf == PDF and pdf_json["content_type"] == "application/pdf"
    assert "content_id" not in pdf_json
    png, png_json = accepted.attachment("logo.png")
    assert png == PNG and png_json["content_type"] == "image/png"
    assert png_json["content_id"] == cid
    assert row["id"] == email_id and row["provider_message_id"] == accepted.id
    assert row["attempts"] == 1 and row["last_error"] is None


def test_an_html_only_email_opts_out_of_resends_generated_text(
        make_apps: MakeApps, fake: FakeResend) -> None:
    app, _ = make_apps(OUTBOX_HTML_TO_TEXT=False, OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, Message("html only", recipients=["to@example.com"], html="<b>hi</b>"))
    _idle(app)
    wait_rows(app, _status("sent"), timeout=10)
    [accepted] = fake.accepted
    assert (accepted.json["html"], accepted.json["text"]) == ("<b>hi</b>", "")


@pytest.fixture(scope="module")
def dkim_key() -> str:
    """A private key for DKIM signing at delivery."""
    return subprocess.run(["openssl", "genrsa", "2048"], check=True,
                          capture_output=True).stdout.decode("ascii")


def test_a_dkim_signature_is_not_sent_resend_signs_itself(
        make_apps: MakeApps, fake: FakeResend, dkim_key: str) -> None:
    app, _ = make_apps(OUTBOX_DKIM_DOMAIN="example.com", OUTBOX_DKIM_SELECTOR="s1",
                       OUTBOX_DKIM_PRIVATE_KEY=dkim_key,
                       OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    wait_rows(app, _status("sent"), timeout=10)
    [accepted] = fake.accepted
    assert "DKIM-Signature" not in accepted.json["headers"]


# -- idempotency -------------------------------------------------------------------------


def test_a_reply_lost_after_resend_accepted_is_not_a_second_email(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.lose_replies = 1  # Resend sends it, the connection drops before the answer
    app, _ = _durable(make_apps, fake)
    _send(app, _plain("exactly once"))
    [row] = wait_rows(app, _status("sent"), timeout=15)
    first, second = fake.sending()
    key = row["message_id"].strip("<>")
    assert first.header("Idempotency-Key") == second.header("Idempotency-Key") == key
    assert first.body == second.body
    # Resend answered the retry with the first reply instead of sending again.
    [accepted] = fake.accepted
    assert row["provider_message_id"] == accepted.id and row["attempts"] == 2
    [step] = _history(row)
    assert "connection failed" in step["message"]


def test_a_batch_retried_after_a_lost_reply_is_not_sent_twice(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.lose_replies = 1
    app, _ = _durable(make_apps, fake, OUTBOX_RUN_WORKER=False)
    _send(app, *[_plain(f"batch {i}", to=f"r{i}@example.com") for i in range(4)])
    app.extensions["mail_outbox"].outbox().dispatch()
    current = wait_rows(app, lambda rs: len(rs) == 4 and _status("sent")(rs), timeout=15)
    # The lost reply's retry, and any retry of that on a loaded machine (its answer can
    # be late too): each the same batch under the same key, so the 4 are accepted once.
    first, *retries = fake.sending()
    assert retries and all(r.path == first.path == "/emails/batch" for r in retries)
    assert {r.header("Idempotency-Key") for r in retries} == {first.header("Idempotency-Key")}
    assert len(fake.accepted) == 4
    assert {r["provider_message_id"] for r in current} == {a.id for a in fake.accepted}


def test_another_email_under_a_used_message_id_is_a_dead_letter_not_a_silent_drop(
        make_apps: MakeApps, fake: FakeResend) -> None:
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    same = {"Message-ID": "<order-7@example.com>"}
    _send(app, Message("first", recipients=["a@example.com"], body="x", extra_headers=same))
    _idle(app)
    _send(app, Message("second", recipients=["a@example.com"], body="y", extra_headers=same))
    _idle(app)
    first, second = wait_rows(app, _status("sent", "failed"), timeout=10)
    assert (first["status"], second["status"]) == ("sent", "failed")
    assert len(fake.accepted) == 1
    [step] = _history(second)
    assert step["code"] == 409 and "invalid_idempotent_request" in step["message"]
    assert "most likely sent" in step["message"]


def test_409_while_the_first_attempt_is_in_progress_is_transient(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.script(Reply(409, {"statusCode": 409, "name": "concurrent_idempotent_requests",
                            "message": "Same idempotency key used while original request "
                                       "is still in progress."}))
    app, _ = _durable(make_apps, fake)
    _send(app, _plain())
    [row] = wait_rows(app, _status("sent"), timeout=15)
    [step] = _history(row)
    assert step["code"] == 409 and "concurrent_idempotent_requests" in step["message"]
    assert len(fake.accepted) == 1


# -- the error classes -------------------------------------------------------------------


def test_429_honours_retry_after_and_charges_no_attempt(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.script(Reply(429, {"statusCode": 429, "name": "rate_limit_exceeded",
                            "message": "Too many requests."},
                      headers={"retry-after": "30", "ratelimit-limit": "2",
                               "ratelimit-remaining": "0", "ratelimit-reset": "30"}))
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={"default": _entry(fake)})
    before = datetime.now(UTC).replace(tzinfo=None)
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, lambda current: bool(current[0]["last_error"]), timeout=10)
    assert (row["status"], row["attempts"]) == ("queued", 0)
    assert "429" in row["last_error"] and "rate_limit_exceeded" in row["last_error"]
    assert row["due_at"] >= before + timedelta(seconds=29), row["due_at"] - before
    assert fake.accepted == []


def test_a_500_is_transient_and_delivered_on_retry(make_apps: MakeApps,
                                                   fake: FakeResend) -> None:
    fake.script(Reply(500, {"statusCode": 500, "name": "application_error",
                            "message": "An unexpected error occurred."}))
    app, _ = make_apps(OUTBOX_RETRY_BASE_SECONDS=0.05,
                       OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    assert len(fake.sending()) == 2 and len(fake.accepted) == 1
    [step] = _history(row)
    assert step["code"] == 500 and "application_error" in step["message"]


def _fail_with_502(fake: FakeResend) -> dict[str, Any]:
    fake.script(Reply(502, b"<html>Bad Gateway</html>"))
    return {}


def _refuse_connections(fake: FakeResend) -> dict[str, Any]:
    return {"base_url": f"http://127.0.0.1:{free_port()}"}


def _unverified_domain(fake: FakeResend) -> dict[str, Any]:
    fake.verified_domains = {"verified.example"}
    return {}


def _quota_spent(fake: FakeResend) -> dict[str, Any]:
    fake.script(Reply(429, {"statusCode": 429, "name": "daily_quota_exceeded",
                            "message": "You have reached your daily email sending quota."}))
    return {}


TRANSPORT_FAULTS: dict[str, Callable[[FakeResend], dict[str, Any]]] = {
    "502": _fail_with_502, "refused": _refuse_connections,
    "403-unverified-domain": _unverified_domain, "429-daily-quota": _quota_spent,
}


@pytest.mark.parametrize("fault", list(TRANSPORT_FAULTS))
def test_a_transport_fault_fails_over_to_smtp_in_the_same_attempt(
        make_apps: MakeApps, fake: FakeResend, smtp_server: FaultSMTPServer,
        fault: str, caplog: pytest.LogCaptureFixture) -> None:
    primary = _entry(fake, failover=["backup"], **TRANSPORT_FAULTS[fault](fake))
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={
        "default": primary,
        "backup": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                   "MAIL_PORT": smtp_server.port}})
    _send(app, _plain("failing over"))
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    assert row["attempts"] == 1 and fake.accepted == []
    assert smtp_server.message_ids() == [row["message_id"]]
    [step] = _history(row)
    assert (step["transport"], step["failed_over_to"]) == ("default", "backup")
    assert "resend" in step["message"]
    # Not the API key's fault: no ERROR says to check it.
    assert "API key" not in caplog.text


def test_401_and_403_stay_queued_with_one_error_and_a_rotated_key_delivers(
        make_apps: MakeApps, fake: FakeResend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    app, mail = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_RETRY_BASE_SECONDS=0.5,
                          OUTBOX_PAUSE_PROBE_SECONDS=0.5,
                          OUTBOX_TRANSPORTS={"default": _entry(fake, api_key="re_revoked_9876")})
    _send(app, _plain("one"))
    _send(app, _plain("two"))
    _idle(app)
    current = wait_rows(app, lambda rs: len(rs) == 2 and all(r["last_error"] for r in rs),
                        timeout=10)
    # The transport is paused (test_pause.py): the emails keep their attempts.
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 0)] * 2
    assert all("403" in r["last_error"] and "invalid_api_key" in r["last_error"]
               and "API key" in r["last_error"] for r in current)
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and "is paused since" in r.getMessage()]
    assert len(errors) == 1, errors
    assert "OUTBOX_TRANSPORTS['default']" in errors[0] and "API key" in errors[0]
    assert "re_revoked_9876" not in caplog.text
    mail.stop()
    rotated, _ = _durable(make_apps, fake, OUTBOX_PAUSE_PROBE_SECONDS=0.5)
    rotated.extensions["mail_outbox"].outbox().dispatch()
    current = wait_rows(rotated, lambda rs: len(rs) == 2 and _status("sent")(rs), timeout=15)
    assert {r["provider_message_id"] for r in current} == {a.id for a in fake.accepted}


def test_a_missing_api_key_is_401_and_stays_queued(make_apps: MakeApps,
                                                   fake: FakeResend) -> None:
    fake.script(Reply(401, {"statusCode": 401, "name": "missing_api_key",
                            "message": "Missing API key in the authorization header"}))
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, lambda current: bool(current[0]["last_error"]), timeout=10)
    assert (row["status"], row["attempts"]) == ("queued", 0)  # paused: the attempt given back
    assert "missing_api_key" in row["last_error"] and "API key" in row["last_error"]


def test_an_invalid_recipient_is_a_dead_letter_with_resends_name_and_message(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.invalid.add("nobody@example.com")
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain("to a refused address", to="nobody@example.com"))
    _idle(app)
    [row] = wait_rows(app, _status("failed"), timeout=10)
    assert row["attempts"] == 1 and len(fake.sending()) == 1
    [step] = _history(row)
    assert step["code"] == 422
    assert "validation_error" in step["message"] and "Invalid `to` field" in step["message"]


def test_a_connection_closed_mid_response_is_transient_and_nothing_is_lost(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.script(Reply(200, {"id": "x" * 200}, cut=True))
    app, _ = _durable(make_apps, fake)
    _send(app, _plain())
    [row] = wait_rows(app, _status("sent"), timeout=15)
    assert row["attempts"] == 2 and len(fake.accepted) == 1
    [step] = _history(row)
    assert "connection failed" in step["message"]


def test_a_200_that_is_not_json_is_a_clear_transient_error_and_nothing_is_lost(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.script(Reply(200, b"<html>upstream proxy says hi</html>",
                      headers={"Content-Type": "text/html"}))
    app, _ = make_apps(OUTBOX_RETRY_BASE_SECONDS=0.05,
                       OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    [step] = _history(row)
    assert "not what it documents" in step["message"] and "upstream proxy" in step["message"]
    assert len(fake.accepted) == 1 and row["provider_message_id"] == fake.accepted[0].id


# -- the batch endpoint ------------------------------------------------------------------


def _deliver_claimed(app: Flask, count: int) -> list[dict[str, Any]]:
    worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
    worker.tick()
    return wait_rows(app, lambda rs: len(rs) == count and all(r["status"] != "queued"
                                                              or r["last_error"] for r in rs),
                     timeout=10)


def test_rows_claimed_together_go_as_one_permissive_batch_and_an_invalid_one_fails_alone(
        make_apps: MakeApps, fake: FakeResend) -> None:
    fake.invalid.add("nobody@example.com")
    app, _ = _durable(make_apps, fake, OUTBOX_RUN_WORKER=False)
    _send(app, *[_plain(f"batch {i}", to=f"r{i}@example.com") for i in range(3)],
          _plain("the bad one", to="nobody@example.com"),
          *[_plain(f"batch {i}", to=f"r{i}@example.com") for i in range(3, 5)])
    current = _deliver_claimed(app, 6)
    [request] = fake.sending()
    assert request.path == "/emails/batch" and len(request.json()) == 6
    assert request.header("x-batch-validation") == "permissive"
    by_subject = {r["subject"]: r for r in current}
    bad = by_subject.pop("the bad one")
    assert bad["status"] == "failed" and "Invalid `to` field" in bad["last_error"]
    assert {r["status"] for r in by_subject.values()} == {"sent"}
    # Each row has the id of its own email (the ids skip the refused index).
    for accepted in fake.accepted:
        assert by_subject[accepted.json["subject"]]["provider_message_id"] == accepted.id
    assert all(a.batch for a in fake.accepted) and len(fake.accepted) == 5


def test_an_email_with_attachments_leaves_the_batch(make_apps: MakeApps,
                                                    fake: FakeResend) -> None:
    app, _ = _durable(make_apps, fake, OUTBOX_RUN_WORKER=False)
    attached = _plain("attached")
    attached.attach("a.txt", "text/plain", b"hello")
    inline = Message("inline", recipients=["to@example.com"], html="<p>x</p>")
    inline.embed("logo.png", "image/png", PNG)
    _send(app, _plain("small 1"), _plain("small 2"), attached, inline)
    current = _deliver_claimed(app, 4)
    assert {r["status"] for r in current} == {"sent"}
    shapes = sorted((r.path, len(r.json()) if r.path.endswith("batch") else 1)
                    for r in fake.sending())
    assert shapes == [("/emails", 1), ("/emails", 1), ("/emails/batch", 2)]
    assert {a.json["subject"] for a in fake.accepted if not a.batch} == {"attached", "inline"}


def test_a_whole_batch_refused_is_transient_for_every_row(make_apps: MakeApps,
                                                          fake: FakeResend) -> None:
    fake.script(Reply(422, {"statusCode": 422, "name": "validation_error",
                            "message": "The batch must hold 1 to 100 emails."}))
    app, _ = _durable(make_apps, fake, OUTBOX_RUN_WORKER=False)
    _send(app, *[_plain(f"batch {i}") for i in range(3)])
    current = _deliver_claimed(app, 3)
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 1)] * 3
    assert all("whole batch" in r["last_error"] for r in current)


# -- configuration and send()-time refusals ----------------------------------------------


def _init(tmp_path: Path, entry: dict[str, Any]) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      OUTBOX_TRANSPORTS={"default": entry})
    SQLAlchemy(app)
    OutboxMail(app)


@pytest.mark.parametrize(("entry", "key", "problem"), [
    ({}, "api_key", "non-empty string"),
    ({"api_key": ""}, "api_key", "non-empty string"),
    ({"api_key": 12345678}, "api_key", "non-empty string"),
    ({"api_key": "re_secret_1\n"}, "api_key", "line breaks"),
    ({"api_key": "re_secret_1", "base_url": "api.resend.com"}, "base_url", "http"),
    ({"api_key": "re_secret_1", "token": "x"}, "token", "unknown setting"),
], ids=["missing", "empty", "not-a-string", "newline", "base_url", "unknown"])
def test_a_bad_entry_fails_at_init_naming_the_key_and_never_the_key_itself(
        tmp_path: Path, entry: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _init(tmp_path, {"transport": "resend", **entry})
    assert excinfo.value.key == f'OUTBOX_TRANSPORTS["default"]["{key}"]'
    assert problem in excinfo.value.problem
    assert "re_secret_1" not in str(excinfo.value) and "12345678" not in str(excinfo.value)


def _fifty_one_to() -> Message:
    return Message("crowd", recipients=[f"r{i}@example.com" for i in range(51)], body="x")


def _bcc_only() -> Message:
    return Message("hidden", bcc=["b@example.com"], body="x")


def _quoted_from() -> Message:
    return Message("quoted", sender=("Shop, Inc.", "shop@example.com"),
                   recipients=["to@example.com"], body="x")


def _no_subject() -> Message:
    return Message("", recipients=["to@example.com"], body="x")


def _no_body() -> Message:
    return Message("empty", recipients=["to@example.com"])


def _too_large() -> Message:
    message = _plain("large")
    for i in range(2):
        message.attach(f"scan{i}.tiff", "image/tiff", b"\x00" * 15_100_000)
    return message


REFUSED: dict[str, tuple[Callable[[], Message], dict[str, Any], str, str]] = {
    "51-to": (_fifty_one_to, {}, "recipients", "at most 50"),
    "bcc-only": (_bcc_only, {}, "recipients", "at least one To"),
    "from-name-with-comma": (_quoted_from, {}, "sender", "display name"),
    "no-subject": (_no_subject, {}, "subject", "requires a subject"),
    "no-body": (_no_body, {}, "body", "text or an html body"),
    "over-40-mb": (_too_large, {"OUTBOX_MAX_MESSAGE_BYTES": 64 * 1024 * 1024},
                   "attachments", "40,000,000"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_resend_cannot_take_is_refused_at_send_and_nothing_is_written(
        make_apps: MakeApps, fake: FakeResend, case: str) -> None:
    build, config, field, problem = REFUSED[case]
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)}, **config)
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(build())
        db.session.commit()
    assert excinfo.value.field == field and problem in excinfo.value.problem
    assert rows(app) == [] and fake.requests == []


# -- rate ----------------------------------------------------------------------------------


def test_a_shared_rate_limit_spaces_the_requests(make_apps: MakeApps,
                                                 fake: FakeResend) -> None:
    rate, total = 20.0, 12
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake, rate_limit=f"{rate:g}/s")})
    with app.app_context():
        mail.send_many([_plain(f"paced {i}") for i in range(total)])
        released = time.monotonic()  # no slot is before the commit
        db.session.commit()
    assert fake.wait_for(total, timeout=15, where=lambda r: r.path == "/emails")
    wait_rows(app, lambda rs: len(rs) == total and _status("sent")(rs), timeout=10)
    times = sorted(r.received_at for r in fake.sending())
    assert len(times) == total
    # Slots 1/20 s apart: unpaced, twelve requests take a few milliseconds.
    assert times[-1] - released >= (total - 2) / rate * 0.9, (released, times)
