"""The sendgrid transport against a fake SendGrid v3 Mail Send API (tests/provider_sendgrid.py).

Every test goes through a real app: ``mail.send`` and a commit, then delivery
over HTTP to the fake, which checks the key and validates the body the way
SendGrid documents it; the rows are read back from the database.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    MakeApps,
    close_app,
    db,
    free_port,
    hand_ticked_worker,
    poll,
    rows,
    wait_rows,
)
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from httpserver import Reply
from provider_sendgrid import SendGridAPI
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail

KEY = "SG.test-key.secret"
PDF = b"%PDF-1.4\n" + bytes(range(256)) * 4
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


@pytest.fixture
def sendgrid() -> Iterator[SendGridAPI]:
    api = SendGridAPI(KEY)
    api.start()
    yield api
    api.stop()


def _entry(api: SendGridAPI, **extra: Any) -> dict[str, Any]:
    return {"transport": "sendgrid", "base_url": api.url, "api_key": KEY, **extra}


def _app(make_apps: MakeApps, api: SendGridAPI, entry: dict[str, Any] | None = None,
         **config: Any) -> tuple[Flask, OutboxMail]:
    # A paused transport (a refused key) is probed soon: its tests restore the key.
    config.setdefault("OUTBOX_PAUSE_PROBE_SECONDS", 0.5)
    return make_apps(OUTBOX_TRANSPORTS={"default": entry or _entry(api)}, **config)


def _send(app: Flask, subject: str = "Hello", **fields: Any) -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    fields.setdefault("recipients", ["ann@example.com"])
    fields.setdefault("body", "Hello text")
    with app.app_context():
        email_id = mail.send(Message(subject, **fields))
        db.session.commit()
    return int(email_id)


def _history(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(json.loads(row["error_history"] or "[]"))


def _all_sent(count: int) -> Any:
    return lambda rs: len(rs) == count and {r["status"] for r in rs} == {"sent"}


# -- delivery ------------------------------------------------------------------------------


def test_every_field_arrives_and_the_x_message_id_is_stored(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    app, mail = _app(make_apps, sendgrid)
    msg = Message("Your order", sender=("Shop Ltd", "shop@example.com"),
                  recipients=["Ann Example <ann@example.com>"], cc=["cc@example.com"],
                  bcc=["hidden@example.com"], reply_to="Help Desk <help@example.com>",
                  body="Hello text", extra_headers={"X-Campaign": "spring"},
                  list_unsubscribe="https://example.com/u/1")
    msg.attach("report.pdf", "application/pdf", PDF)
    cid = msg.embed("logo.png", "image/png", PNG)
    msg.html = f'<p>Hello <img src="cid:{cid}"></p>'
    with app.app_context():
        email_id = mail.send(msg)
        db.session.commit()
    [row] = wait_rows(app, _all_sent(1), timeout=10)
    [accepted] = sendgrid.accepted
    body = accepted.body
    assert accepted.request.header("Authorization") == f"Bearer {KEY}"
    assert accepted.request.path == "/v3/mail/send"
    assert body["personalizations"] == [{
        "to": [{"email": "ann@example.com", "name": "Ann Example"}],
        "cc": [{"email": "cc@example.com"}], "bcc": [{"email": "hidden@example.com"}]}]
    assert body["from"] == {"email": "shop@example.com", "name": "Shop Ltd"}
    assert body["reply_to"] == {"email": "help@example.com", "name": "Help Desk"}
    assert body["subject"] == "Your order"
    assert [(c["type"], c["value"].strip()) for c in body["content"]] == [
        ("text/plain", "Hello text"), ("text/html", f'<p>Hello <img src="cid:{cid}"></p>')]
    headers = body["headers"]
    assert headers["Message-ID"] == row["message_id"]
    assert headers["List-Unsubscribe"] == "<https://example.com/u/1>"
    assert headers["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert headers["X-Campaign"] == "spring"
    assert not {"date", "mime-version", "dkim-signature"} & {h.lower() for h in headers}
    by_name = {a["filename"]: a for a in body["attachments"]}
    assert base64.b64decode(by_name["report.pdf"]["content"]) == PDF
    assert (by_name["report.pdf"]["type"], by_name["report.pdf"]["disposition"]) == (
        "application/pdf", "attachment")
    logo = by_name["logo.png"]
    assert base64.b64decode(logo["content"]) == PNG
    assert (logo["type"], logo["disposition"], logo["content_id"]) == (
        "image/png", "inline", cid)
    assert row["id"] == email_id
    assert row["provider_message_id"] == accepted.message_id
    assert row["attempts"] == 1


def test_an_address_in_to_and_cc_is_sent_once_and_several_reply_tos_are_a_list(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    app, _ = _app(make_apps, sendgrid)
    _send(app, recipients=["ann@example.com", "Bob <bob@example.com>"],
          cc=["ANN@example.com", "cc@example.com"],
          extra_headers={"Reply-To": "a@example.com, B <b@example.com>"})
    wait_rows(app, _all_sent(1), timeout=10)
    body = sendgrid.accepted[0].body
    assert body["personalizations"] == [{
        "to": [{"email": "ann@example.com"}, {"email": "bob@example.com", "name": "Bob"}],
        "cc": [{"email": "cc@example.com"}]}]
    assert body["reply_to_list"] == [{"email": "a@example.com"},
                                     {"email": "b@example.com", "name": "B"}]
    assert "reply_to" not in body


def test_a_dkim_signature_made_at_delivery_is_left_to_sendgrid_to_make(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    private = subprocess.run(["openssl", "genrsa", "2048"], check=True,
                             capture_output=True).stdout.decode("ascii")
    app, _ = _app(make_apps, sendgrid, OUTBOX_DKIM_DOMAIN="example.com",
                  OUTBOX_DKIM_SELECTOR="s1", OUTBOX_DKIM_PRIVATE_KEY=private)
    _send(app, sender="shop@example.com", extra_headers={"X-Campaign": "x"})
    wait_rows(app, _all_sent(1), timeout=10)
    headers = sendgrid.accepted[0].body["headers"]
    assert "X-Campaign" in headers
    assert "dkim-signature" not in {h.lower() for h in headers}


# -- refused at send() -------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "field", "named"), [
    ({"extra_headers": {"X-SG-ID": "abc"}}, "extra_headers", "X-SG-ID"),
    ({"extra_headers": {"x-sg-eid": "abc"}}, "extra_headers", "x-sg-eid"),
    ({"extra_headers": {"Received": "from x by y"}}, "extra_headers", "Received"),
    ({"recipients": [], "bcc": ["hidden@example.com"]}, "recipients", "To address"),
    ({"subject": ""}, "subject", "subject"),
    ({"alts": {"calendar": "BEGIN:VCALENDAR\r\nEND:VCALENDAR\r\n"}}, "alts", "text/calendar"),
    ({"recipients": [f"r{i}@example.com" for i in range(1001)]}, "recipients", "1000"),
], ids=["x-sg-id", "x-sg-eid", "received", "bcc-only", "no-subject", "alts", "1001"])
def test_what_sendgrid_cannot_take_is_refused_at_send_and_nothing_is_written(
        make_apps: MakeApps, sendgrid: SendGridAPI, fields: dict[str, Any], field: str,
        named: str) -> None:
    app, mail = _app(make_apps, sendgrid)
    fields = dict(fields)  # the parameter is shared by the SQLite and PostgreSQL runs
    subject = fields.pop("subject", "Hello")
    fields.setdefault("recipients", ["ann@example.com"])
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(Message(subject, body="x", **fields))
        db.session.commit()
    assert excinfo.value.field == field
    assert named in excinfo.value.problem
    assert rows(app) == []
    assert sendgrid.requests == []


def test_the_refusal_holds_when_sendgrid_is_only_the_failover(
        make_apps: MakeApps, sendgrid: SendGridAPI, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORTS={
        "default": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                    "MAIL_PORT": smtp_server.port, "failover": ["sg"]},
        "sg": _entry(sendgrid)})
    with app.app_context(), pytest.raises(InvalidMessage, match="X-SG-ID"):
        mail.send(Message("x", recipients=["a@example.com"], body="x",
                          extra_headers={"X-SG-ID": "1"}))
    assert rows(app) == []


def test_a_row_stored_for_another_transport_that_sendgrid_cannot_take_fails_saying_why(
        make_apps: MakeApps, sendgrid: SendGridAPI, smtp_server: FaultSMTPServer) -> None:
    before, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    _send(before, extra_headers={"X-SG-ID": "kept"})
    close_app(before)
    # The app now delivers its default transport through SendGrid.
    after, _ = _app(make_apps, sendgrid, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                    OUTBOX_LISTEN=False)
    hand_ticked_worker(after).drain(timeout=10)
    [row] = rows(after)
    assert row["status"] == "failed" and sendgrid.requests == []
    assert "X-SG-ID" in row["last_error"] and "reserves" in row["last_error"]


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", ["retry-after", "x-ratelimit-reset"])
def test_429_charges_no_attempt_and_the_row_waits_as_asked(
        make_apps: MakeApps, sendgrid: SendGridAPI, headers: str) -> None:
    wait = 30
    app, _ = _app(make_apps, sendgrid, OUTBOX_INLINE_RETRIES=0)
    asked = ({"Retry-After": str(wait)} if headers == "retry-after" else
             {"X-RateLimit-Limit": "600", "X-RateLimit-Remaining": "0",
              "X-RateLimit-Reset": str(int(time.time()) + wait + 1)})
    sendgrid.script(Reply(429, {"errors": [{"field": None, "message": "too many requests"}]},
                          asked))
    _send(app)
    [row] = wait_rows(app, lambda rs: bool(rs[0]["error_history"]), timeout=10)
    assert row["status"] == "queued" and row["attempts"] == 0
    [entry] = _history(row)
    assert entry["code"] == 429 and "too many requests" in entry["message"]
    assert (row["due_at"] - row["created_at"]).total_seconds() >= wait - 1
    assert not sendgrid.wait_for(2, timeout=1.0)  # not asked again before it is due


def test_a_5xx_is_transient_and_the_retry_delivers(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    sendgrid.script(Reply(500, {"errors": [{"message": "internal server error"}]}))
    app, _ = _app(make_apps, sendgrid)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(sendgrid.requests) == 2
    [entry] = _history(row)
    assert entry["code"] == 500 and "internal server error" in entry["message"]
    assert row["provider_message_id"] == sendgrid.accepted[0].message_id


@pytest.mark.parametrize("fault", ["503", "refused"])
def test_a_transport_fault_fails_over_to_smtp_in_the_same_attempt(
        make_apps: MakeApps, sendgrid: SendGridAPI, smtp_server: FaultSMTPServer,
        fault: str) -> None:
    entry = _entry(sendgrid, failover=["backup"], timeout=0.5)
    if fault == "503":
        # Connection: close, so no pooled connection outlives the app: the runtime does
        # not close a transport that has a failover list (reported to the integrator).
        sendgrid.script(Reply(503, {"errors": [{"message": "service unavailable"}]},
                              {"Connection": "close"}))
    else:
        entry["base_url"] = f"http://127.0.0.1:{free_port()}"
    app, _ = make_apps(OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={
        "default": entry,
        "backup": {"transport": "smtp", "MAIL_SERVER": smtp_server.host,
                   "MAIL_PORT": smtp_server.port}})
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=10)
    assert smtp_server.wait_for(1) and smtp_server.message_ids() == [row["message_id"]]
    assert row["attempts"] == 1 and sendgrid.accepted == []
    [step] = _history(row)
    assert (step["transport"], step["failed_over_to"]) == ("default", "backup")
    assert {"503": "503", "refused": "connection failed"}[
        fault] in f"{step['code']} {step['message']}"


def test_401_keeps_the_rows_queued_with_one_error_then_a_rotated_key_delivers(
        make_apps: MakeApps, sendgrid: SendGridAPI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    old_key = "SG.revoked-key.old-secret"
    app, _ = _app(make_apps, sendgrid, _entry(sendgrid, api_key=old_key),
                  OUTBOX_INLINE_RETRIES=0)
    _send(app, "one")
    _send(app, "two")
    current = wait_rows(app, lambda rs: all(r["error_history"] for r in rs) and any(
        r.levelno >= logging.ERROR for r in caplog.records), timeout=10)
    # The transport is paused (test_pause.py): the emails keep their attempts.
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 0), ("queued", 0)]
    assert all("401" in r["last_error"] and "API key" in r["last_error"] for r in current)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # One ERROR names the transport, however many emails its key fails, and no
    # per-email ERROR: the transport is paused.
    [error] = errors
    assert error.startswith("Transport 'default' is paused since")
    assert "sendgrid" in error and "API key" in error and "without spending attempts" in error
    assert old_key not in caplog.text and "old-secret" not in caplog.text
    close_app(app)
    # The key is rotated: a worker restarted with the new one delivers both when due.
    rotated, _ = _app(make_apps, sendgrid, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                      OUTBOX_LISTEN=False)
    worker = hand_ticked_worker(rotated)
    done = poll(lambda: (worker.drain(timeout=5), rows(rotated))[1], _all_sent(2), timeout=15)
    assert sorted(a.body["subject"] for a in sendgrid.accepted) == ["one", "two"]
    assert {r["provider_message_id"] for r in done} == {a.message_id for a in sendgrid.accepted}


def test_400_for_a_bad_recipient_dead_letters_with_sendgrids_field_and_text(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    sendgrid.invalid_addresses = {"bounce@example.com"}
    app, _ = _app(make_apps, sendgrid)
    _send(app, recipients=["bounce@example.com"])
    [row] = wait_rows(app, lambda rs: rs[0]["status"] == "failed", timeout=10)
    assert row["attempts"] == 1 and len(sendgrid.requests) == 1
    [entry] = _history(row)
    assert entry["code"] == 400
    assert "personalizations.0.to.0.email: Does not contain a valid address." in entry["message"]


def test_a_connection_closed_mid_response_is_transient_and_nothing_is_lost(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    sendgrid.script(Reply(500, {"errors": [{"message": "x" * 200}]}, cut=True))
    app, _ = _app(make_apps, sendgrid)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(sendgrid.accepted) == 1
    [entry] = _history(row)
    assert "connection failed" in entry["message"]


def test_a_2xx_that_is_not_202_is_a_clear_transient_error_and_nothing_is_lost(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    sendgrid.script(Reply(200, b"<html>maintenance</html>", {"Content-Type": "text/html"}))
    app, _ = _app(make_apps, sendgrid)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(sendgrid.accepted) == 1
    [entry] = _history(row)
    assert entry["code"] == 200
    assert "did not queue it" in entry["message"] and "maintenance" in entry["message"]


# -- settings and rate ---------------------------------------------------------------------


@pytest.mark.parametrize(("entry", "key", "problem"), [
    ({}, '["api_key"]', "needs it"),
    ({"api_key": ""}, '["api_key"]', "needs it"),
    ({"api_key": ["SG.secret-in-a-list"]}, '["api_key"]', "needs it"),
    ({"api_key": KEY, "base_url": "api.sendgrid.com"}, '["base_url"]', "https://api.sendgrid"),
    ({"api_key": KEY, "timeout": 0}, '["timeout"]', "positive"),
    ({"api_key": KEY, "apikey": KEY}, '["apikey"]', "unknown setting"),
], ids=["missing", "empty", "not-a-string", "base_url", "timeout", "typo"])
def test_a_bad_entry_fails_at_init_naming_its_key_without_the_secret(
        tmp_path: Any, entry: dict[str, Any], key: str, problem: str) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      OUTBOX_TRANSPORTS={"default": {"transport": "sendgrid", **entry}})
    SQLAlchemy(app)
    with pytest.raises(ConfigError) as excinfo:
        OutboxMail(app)
    assert excinfo.value.key == f'OUTBOX_TRANSPORTS["default"]{key}'
    assert problem in excinfo.value.problem
    # The key's value never appears (its secret part, "secret"; the allowed keys are named).
    assert "secret" not in str(excinfo.value).replace("webhook_secret", "")


def test_a_shared_rate_limit_spaces_the_requests(
        make_apps: MakeApps, sendgrid: SendGridAPI) -> None:
    rate, total = 20.0, 15
    app, mail = _app(make_apps, sendgrid, _entry(sendgrid, rate_limit=f"{rate:g}/s"))
    with app.app_context():
        mail.send_many([Message(f"paced {i}", recipients=["a@example.com"], body="x")
                        for i in range(total)])
        released = time.monotonic()  # no slot is before the commit
        db.session.commit()
    assert sendgrid.wait_for(total, timeout=30)
    times = sorted(r.received_at for r in sendgrid.requests)
    # From the commit, which no slot precedes: on a loaded machine the first requests
    # can arrive late and together (they catch up to their slots), so a span measured
    # between received requests could be shorter than the rate allows without any
    # request coming early; the last one can never come before its slot.
    assert times[-1] - released >= (total - 2) / rate * 0.9, (released, times)
    wait_rows(app, _all_sent(total), timeout=10)
    assert math.isclose(len(sendgrid.accepted), total)
