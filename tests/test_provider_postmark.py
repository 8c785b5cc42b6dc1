"""The postmark transport against a fake of Postmark's Email API (tests/provider_postmark.py).

Every test goes through a real app: ``mail.send`` and a commit, the worker,
the transport's pooled client, a real HTTP server answering as Postmark
documents, and the row as the store records it, on SQLite and PostgreSQL.
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
from provider_postmark import TOKEN, FakePostmark
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail
from flask_mail_outbox.transports._postmark import BATCHABLE_BYTES, PostmarkTransport


@pytest.fixture
def fake() -> Iterator[FakePostmark]:
    """Postmark on a loopback port."""
    server = FakePostmark()
    server.start()
    yield server
    server.stop()


def _entry(fake: FakePostmark, **extra: Any) -> dict[str, Any]:
    return {"transport": "postmark", "base_url": fake.url, "token": TOKEN, **extra}


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


# -- delivery ----------------------------------------------------------------------------


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
PDF = b"%PDF-1.4\n" + bytes(range(256)) * 4


def test_every_field_arrives_and_postmarks_message_id_is_stored(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    message = Message("Grüße, order #7", sender=("Ann Örtel, Shop", "ann@example.com"),
                      recipients=["Bob Bauer <bob@example.com>", "carol@example.com"],
                      cc=["Cc Person <cc@example.com>"], bcc=["hidden@example.com"],
                      reply_to="Support <support@example.com>", body="Plain text\nline two",
                      html="<p>Hi <img src=\"cid:LOGO\"></p>",
                      extra_headers={"X-Campaign": "spring"},
                      list_unsubscribe="https://example.com/unsubscribe/7")
    message.attach("invoice.pdf", "application/pdf", PDF)
    cid = message.embed("logo.png", "image/png", PNG)
    message.html = f"<p>Hi <img src=\"cid:{cid}\"></p>"
    [email_id] = _send(app, message)
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    [request] = fake.sending()
    assert request.path == "/email" and request.header("X-Postmark-Server-Token") == TOKEN
    assert request.header("Accept") == "application/json"
    [accepted] = fake.accepted
    sent = accepted.json
    assert sent["From"] == '"Ann Örtel, Shop" <ann@example.com>'
    assert sent["To"] == '"Bob Bauer" <bob@example.com>, carol@example.com'
    assert sent["Cc"] == '"Cc Person" <cc@example.com>'
    assert sent["Bcc"] == "hidden@example.com"
    assert sent["ReplyTo"] == '"Support" <support@example.com>'
    assert sent["Subject"] == "Grüße, order #7"
    assert sent["TextBody"] == "Plain text\nline two"
    assert sent["HtmlBody"] == f"<p>Hi <img src=\"cid:{cid}\"></p>"
    assert sent["MessageStream"] == "outbound"
    assert accepted.header("Message-ID") == row["message_id"]
    assert accepted.header("List-Unsubscribe") == "<https://example.com/unsubscribe/7>"
    assert accepted.header("List-Unsubscribe-Post") == "List-Unsubscribe=One-Click"
    assert accepted.header("X-Campaign") == "spring"
    pdf, pdf_json = accepted.attachment("invoice.pdf")
    assert pdf == PDF and pdf_json["ContentType"] == "application/pdf"
    assert "ContentID" not in pdf_json
    png, png_json = accepted.attachment("logo.png")
    assert png == PNG and png_json["ContentType"] == "image/png"
    assert png_json["ContentID"] == f"cid:{cid}"
    assert row["id"] == email_id and row["provider_message_id"] == accepted.message_id
    assert row["attempts"] == 1 and row["last_error"] is None


def test_the_entrys_message_stream_is_sent(make_apps: MakeApps, fake: FakePostmark) -> None:
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake,
                                                               message_stream="receipts")})
    _send(app, _plain())
    _idle(app)
    wait_rows(app, _status("sent"), timeout=10)
    assert [a.json["MessageStream"] for a in fake.accepted] == ["receipts"]


@pytest.fixture(scope="module")
def dkim_key() -> str:
    """A private key for DKIM signing at delivery."""
    return subprocess.run(["openssl", "genrsa", "2048"], check=True,
                          capture_output=True).stdout.decode("ascii")


def test_a_dkim_signature_is_not_sent_postmark_signs_itself(
        make_apps: MakeApps, fake: FakePostmark, dkim_key: str) -> None:
    app, _ = make_apps(OUTBOX_DKIM_DOMAIN="example.com", OUTBOX_DKIM_SELECTOR="s1",
                          OUTBOX_DKIM_PRIVATE_KEY=dkim_key,
                          OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    wait_rows(app, _status("sent"), timeout=10)
    [accepted] = fake.accepted
    assert accepted.header("DKIM-Signature") is None
    assert accepted.header("Message-ID") is not None


# -- the error classes -------------------------------------------------------------------


def test_429_honours_retry_after_and_charges_no_attempt(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.script(Reply(429, {"ErrorCode": 429, "Message": "Rate limit exceeded"},
                      headers={"Retry-After": "30"}))
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={"default": _entry(fake)})
    before = datetime.now(UTC).replace(tzinfo=None)
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, lambda current: bool(current[0]["last_error"]), timeout=10)
    assert (row["status"], row["attempts"]) == ("queued", 0)
    assert "429" in row["last_error"] and "Rate limit exceeded" in row["last_error"]
    # Not due again before Retry-After (the retry policy alone says a few seconds).
    assert row["due_at"] >= before + timedelta(seconds=29), row["due_at"] - before
    assert fake.accepted == []


def test_a_500_is_transient_and_delivered_on_retry(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.script(Reply(500, {"ErrorCode": 0, "Message": "Internal server error"}))
    app, _ = make_apps(OUTBOX_RETRY_BASE_SECONDS=0.05,
                          OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    assert len(fake.sending()) == 2 and len(fake.accepted) == 1
    [step] = _history(row)
    assert step["code"] == 500 and "Internal server error" in step["message"]
    assert row["provider_message_id"] == fake.accepted[0].message_id


def _fail_with_500(fake: FakePostmark) -> dict[str, Any]:
    fake.script(Reply(503, b"Service Unavailable"))
    return {}


def _refuse_connections(fake: FakePostmark) -> dict[str, Any]:
    return {"base_url": f"http://127.0.0.1:{free_port()}"}


def _account_cannot_send(fake: FakePostmark) -> dict[str, Any]:
    fake.script(Reply(422, {"ErrorCode": 412, "Message": "Your account is pending approval."}))
    return {}


TRANSPORT_FAULTS: dict[str, Callable[[FakePostmark], dict[str, Any]]] = {
    "503": _fail_with_500, "refused": _refuse_connections,
    "422-account-pending": _account_cannot_send,
}


@pytest.mark.parametrize("fault", list(TRANSPORT_FAULTS))
def test_a_transport_fault_fails_over_to_smtp_in_the_same_attempt(
        make_apps: MakeApps, fake: FakePostmark, smtp_server: FaultSMTPServer,
        fault: str) -> None:
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
    assert "postmark" in step["message"]


def test_401_stays_queued_with_one_error_and_a_rotated_key_delivers(
        make_apps: MakeApps, fake: FakePostmark, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    app, mail = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_RETRY_BASE_SECONDS=0.5,
                          OUTBOX_PAUSE_PROBE_SECONDS=0.5,
                          OUTBOX_TRANSPORTS={"default": _entry(fake, token="revoked-token-9876")})
    _send(app, _plain("one"))
    _send(app, _plain("two"))
    _idle(app)
    current = wait_rows(app, lambda rs: len(rs) == 2 and all(r["last_error"] for r in rs),
                        timeout=10)
    # The transport is paused (test_pause.py): the emails keep their attempts.
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 0)] * 2
    assert all("401" in r["last_error"] and "API key" in r["last_error"] for r in current)
    assert "ErrorCode 10" in current[0]["last_error"]
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and "is paused since" in r.getMessage()]
    assert len(errors) == 1, errors
    assert "OUTBOX_TRANSPORTS['default']" in errors[0] and "API key" in errors[0]
    assert "revoked-token-9876" not in caplog.text
    mail.stop()
    # The key is rotated and the app restarted: the queued emails go out.
    rotated, _ = make_apps(OUTBOX_DURABLE=True, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                           OUTBOX_POLL_MAX_INTERVAL=0.2, OUTBOX_PAUSE_PROBE_SECONDS=0.5,
                           OUTBOX_TRANSPORTS={"default": _entry(fake)})
    rotated.extensions["mail_outbox"].outbox().dispatch()
    current = wait_rows(rotated, lambda rs: len(rs) == 2 and _status("sent")(rs), timeout=15)
    assert {r["provider_message_id"] for r in current} == {a.message_id for a in fake.accepted}


def test_an_inactive_recipient_is_a_dead_letter_with_postmarks_code_and_text(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.inactive.add("bounced@example.com")
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain("to a bounced address", to="bounced@example.com"))
    _idle(app)
    [row] = wait_rows(app, _status("failed"), timeout=10)
    assert row["attempts"] == 1 and len(fake.sending()) == 1
    [step] = _history(row)
    assert step["code"] == 422
    assert "ErrorCode 406" in step["message"] and "bounced@example.com" in step["message"]
    assert "marked as inactive" in row["last_error"]


def test_an_inactive_cc_is_refused_and_the_message_still_sent(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.inactive.add("gone@example.com")
    app, _ = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, Message("partly", recipients=["here@example.com"], cc=["gone@example.com"],
                       body="x"))
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    assert row["provider_message_id"] == fake.accepted[0].message_id
    assert "gone@example.com" in row["last_error"] and "406" in row["last_error"]


def test_a_connection_closed_mid_response_is_transient_and_nothing_is_lost(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.script(Reply(200, {"MessageID": "x" * 200, "ErrorCode": 0, "Message": "OK"},
                      cut=True))
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_DURABLE=True, OUTBOX_LISTEN=False,
                          OUTBOX_POLL_INTERVAL=0.05, OUTBOX_POLL_MAX_INTERVAL=0.2,
                          OUTBOX_RETRY_BASE_SECONDS=0.2,
                          OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    [row] = wait_rows(app, _status("sent"), timeout=15)
    assert row["attempts"] == 2 and len(fake.accepted) == 1
    [step] = _history(row)
    assert "connection failed" in step["message"]


def test_a_200_that_is_not_json_is_a_clear_transient_error_and_nothing_is_lost(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.script(Reply(200, b"<html>upstream proxy says hi</html>",
                      headers={"Content-Type": "text/html"}))
    app, _ = make_apps(OUTBOX_RETRY_BASE_SECONDS=0.05,
                          OUTBOX_TRANSPORTS={"default": _entry(fake)})
    _send(app, _plain())
    _idle(app)
    [row] = wait_rows(app, _status("sent"), timeout=10)
    [step] = _history(row)
    assert "not what it documents" in step["message"] and "upstream proxy" in step["message"]
    assert len(fake.accepted) == 1 and row["provider_message_id"] == fake.accepted[0].message_id


# -- the batch endpoint ------------------------------------------------------------------


def _batch_app(make_apps: MakeApps, fake: FakePostmark, **config: Any) -> tuple[Flask,
                                                                               OutboxMail]:
    """Durable, with the worker started once every row is committed: one claim holds all."""
    return make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                     OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={"default": _entry(fake)},
                     **config)


def _deliver(app: Flask, fake: FakePostmark, count: int) -> list[dict[str, Any]]:
    worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
    worker.tick()
    return wait_rows(app, lambda rs: len(rs) == count and all(r["status"] != "queued"
                                                              or r["last_error"] for r in rs),
                     timeout=10)


def test_rows_claimed_together_go_as_one_batch_and_an_item_error_fails_only_its_row(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.inactive.add("bounced@example.com")
    app, _ = _batch_app(make_apps, fake)
    _send(app, *[_plain(f"batch {i}", to=f"r{i}@example.com") for i in range(5)],
          _plain("the bad one", to="bounced@example.com"))
    current = _deliver(app, fake, 6)
    [request] = fake.sending()
    assert request.path == "/email/batch" and len(request.json()) == 6
    by_subject = {r["subject"]: r for r in current}
    bad = by_subject.pop("the bad one")
    assert bad["status"] == "failed" and "ErrorCode 406" in bad["last_error"]
    assert {r["status"] for r in by_subject.values()} == {"sent"}
    assert {r["provider_message_id"] for r in by_subject.values()} == {
        a.message_id for a in fake.accepted}
    assert all(a.batch for a in fake.accepted)


def test_a_large_message_leaves_the_batch_and_goes_alone(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    app, _ = _batch_app(make_apps, fake)
    big = _plain("big")
    big.attach("big.bin", "application/octet-stream", b"\x01" * BATCHABLE_BYTES)
    _send(app, _plain("small 1"), _plain("small 2"), big)
    current = _deliver(app, fake, 3)
    assert {r["status"] for r in current} == {"sent"}
    paths = sorted((r.path, len(r.json()) if r.path.endswith("batch") else 1)
                   for r in fake.sending())
    assert paths == [("/email", 1), ("/email/batch", 2)]
    [alone] = [a for a in fake.accepted if not a.batch]
    assert alone.json["Subject"] == "big"
    assert alone.attachment("big.bin")[0] == b"\x01" * BATCHABLE_BYTES


def test_a_whole_batch_refused_is_transient_for_every_row(
        make_apps: MakeApps, fake: FakePostmark) -> None:
    fake.script(Reply(422, {"ErrorCode": 402, "Message": "Invalid JSON"}))
    app, _ = _batch_app(make_apps, fake)
    _send(app, *[_plain(f"batch {i}") for i in range(3)])
    current = _deliver(app, fake, 3)
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 1)] * 3
    assert all("whole batch" in r["last_error"] and "Invalid JSON" in r["last_error"]
               for r in current)


# -- configuration and send()-time refusals ----------------------------------------------


def _init(tmp_path: Path, entry: dict[str, Any]) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      OUTBOX_TRANSPORTS={"default": entry})
    SQLAlchemy(app)
    OutboxMail(app)


@pytest.mark.parametrize(("entry", "key", "problem"), [
    ({}, "token", "non-empty string"),
    ({"token": ""}, "token", "non-empty string"),
    ({"token": 12345678}, "token", "non-empty string"),
    ({"token": "secret-token-1", "message_stream": ""}, "message_stream", "stream"),
    ({"token": "secret-token-1", "base_url": "api.postmarkapp.com"}, "base_url", "http"),
    ({"token": "secret-token-1", "timeout": 0}, "timeout", "positive"),
    ({"token": "secret-token-1", "api_key": "x"}, "api_key", "unknown setting"),
], ids=["missing", "empty", "not-a-string", "stream", "base_url", "timeout", "unknown"])
def test_a_bad_entry_fails_at_init_naming_the_key_and_never_the_token(
        tmp_path: Path, entry: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _init(tmp_path, {"transport": "postmark", **entry})
    assert excinfo.value.key == f'OUTBOX_TRANSPORTS["default"]["{key}"]'
    assert problem in excinfo.value.problem
    assert "secret-token-1" not in str(excinfo.value) and "12345678" not in str(excinfo.value)


def _many_recipients() -> Message:
    return Message("crowd", recipients=[f"r{i}@example.com" for i in range(40)],
                   cc=[f"c{i}@example.com" for i in range(8)],
                   bcc=[f"b{i}@example.com" for i in range(3)], body="x")


def _no_body() -> Message:
    return Message("empty", recipients=["to@example.com"])


def _too_large() -> Message:
    message = _plain("large")
    message.attach("scan.tiff", "image/tiff", b"\x00" * 7_600_000)
    return message


REFUSED: dict[str, tuple[Callable[[], Message], str, str]] = {
    "51-recipients": (_many_recipients, "recipients", "at most 50"),
    "no-body": (_no_body, "body", "text or an html body"),
    "over-10-mb": (_too_large, "attachments", "10,000,000"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_postmark_cannot_take_is_refused_at_send_and_nothing_is_written(
        make_apps: MakeApps, fake: FakePostmark, case: str) -> None:
    build, field, problem = REFUSED[case]
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake)})
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(build())
        db.session.commit()
    assert excinfo.value.field == field and problem in excinfo.value.problem
    assert rows(app) == [] and fake.requests == []


def test_a_transport_failing_over_to_postmark_is_held_to_postmarks_limits(
        make_apps: MakeApps, fake: FakePostmark, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORTS={
        "default": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                    "MAIL_PORT": smtp_server.port, "failover": ["pm"]},
        "pm": _entry(fake)})
    with app.app_context(), pytest.raises(InvalidMessage) as excinfo:
        mail.send(_many_recipients())
    assert excinfo.value.field == "recipients" and rows(app) == []


def test_check_message_refuses_a_non_ascii_mailbox() -> None:
    mime = (b"From: a@example.com\r\nTo: =?utf-8?q?J=C3=B6rg?= <j\xc3\xb6rg@example.com>\r\n"
            b"Subject: x\r\n\r\nbody\r\n")
    with pytest.raises(InvalidMessage) as excinfo:
        PostmarkTransport.check_message(mime, ["jörg@example.com"])
    assert excinfo.value.field == "recipients" and "non-ASCII" in excinfo.value.problem
    PostmarkTransport.check_message(mime.replace("j\xc3\xb6rg".encode("latin-1"), b"jorg"),
                                    ["jorg@example.com"])


# -- rate ----------------------------------------------------------------------------------


def test_a_shared_rate_limit_spaces_the_requests(make_apps: MakeApps,
                                                 fake: FakePostmark) -> None:
    rate, total = 20.0, 12
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": _entry(fake, rate_limit=f"{rate:g}/s")})
    with app.app_context():
        mail.send_many([_plain(f"paced {i}") for i in range(total)])
        released = time.monotonic()  # no slot is before the commit
        db.session.commit()
    assert fake.wait_for(total, timeout=15, where=lambda r: r.path == "/email")
    wait_rows(app, lambda rs: len(rs) == total and _status("sent")(rs), timeout=10)
    times = sorted(r.received_at for r in fake.sending())
    assert len(times) == total
    # Slots 1/20 s apart: unpaced, twelve requests take a few milliseconds.
    assert times[-1] - released >= (total - 2) / rate * 0.9, (released, times)
