"""The mailgun transport against a fake Mailgun ``messages.mime`` API (tests/provider_mailgun.py).

Every test goes through a real app: ``mail.send`` and a commit, then delivery
over HTTP to the fake, which checks the key and the domain and parses the
multipart body the way Mailgun documents it; the rows are read back from the
database. Mailgun takes the stored MIME as it is, so the tests compare bytes.
"""

from __future__ import annotations

import base64
import json
import logging
import subprocess
import time
from collections.abc import Iterator
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy
from typing import Any

import dkim
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
from provider_mailgun import MailgunAPI
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail

KEY = "key-test-secret"
DOMAIN = "mg.example.com"
PDF = b"%PDF-1.4\n" + bytes(range(256)) * 4
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


@pytest.fixture
def mailgun() -> Iterator[MailgunAPI]:
    api = MailgunAPI(KEY, frozenset({DOMAIN}))
    api.start()
    yield api
    api.stop()


def _entry(api: MailgunAPI, **extra: Any) -> dict[str, Any]:
    return {"transport": "mailgun", "base_url": api.url, "api_key": KEY, "domain": DOMAIN,
            **extra}


def _app(make_apps: MakeApps, api: MailgunAPI, entry: dict[str, Any] | None = None,
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


def _parsed(data: bytes) -> EmailMessage:
    message = BytesParser(policy=default_policy).parsebytes(data)
    assert isinstance(message, EmailMessage)
    return message


def _hand_ticked(make_apps: MakeApps, api: MailgunAPI,
                 entry: dict[str, Any] | None = None) -> Any:
    """A restarted app's worker, ticked by the test: it delivers what is due."""
    app, _ = _app(make_apps, api, entry, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                  OUTBOX_LISTEN=False)
    return app, hand_ticked_worker(app)


# -- delivery ------------------------------------------------------------------------------


def test_the_stored_bytes_arrive_unchanged_with_every_recipient_and_the_id_is_stored(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    app, mail = _app(make_apps, mailgun)
    msg = Message("Your order", sender=("Shop Ltd", "shop@example.com"),
                  recipients=["Ann Example <ann@example.com>"], cc=["cc@example.com"],
                  bcc=["hidden@example.com"], reply_to="Help Desk <help@example.com>",
                  body="Hello text", extra_headers={"X-Campaign": "spring"},
                  list_unsubscribe="https://example.com/u/1")
    msg.attach("report.pdf", "application/pdf", PDF)
    cid = msg.embed("logo.png", "image/png", PNG)
    msg.html = f'<p>Hello <img src="cid:{cid}"></p>'
    with app.app_context():
        mail.send(msg)
        db.session.commit()
    [row] = wait_rows(app, _all_sent(1), timeout=10)
    [accepted] = mailgun.accepted
    expected = "Basic " + base64.b64encode(f"api:{KEY}".encode()).decode()
    assert accepted.request.header("Authorization") == expected
    assert accepted.request.path == f"/v3/{DOMAIN}/messages.mime"
    assert accepted.mime == row["mime"]  # byte for byte
    assert accepted.to == ["ann@example.com", "cc@example.com", "hidden@example.com"]
    sent = _parsed(accepted.mime)
    assert sent["From"] == "Shop Ltd <shop@example.com>"
    assert (sent["To"], sent["Cc"], sent["Bcc"]) == (
        "Ann Example <ann@example.com>", "cc@example.com", None)
    assert sent["Reply-To"] == "Help Desk <help@example.com>"
    assert sent["Message-ID"] == row["message_id"]
    assert sent["List-Unsubscribe"] == "<https://example.com/u/1>"
    assert sent["X-Campaign"] == "spring"
    attachments = {p.get_filename(): p for p in sent.iter_attachments()}
    assert attachments["report.pdf"].get_content() == PDF
    logo = next(p for p in sent.walk() if p.get("Content-ID") == f"<{cid}>")
    assert logo.get_content() == PNG
    assert row["provider_message_id"] == accepted.message_id.strip("<>")
    assert row["attempts"] == 1


def test_a_dkim_signature_made_at_delivery_arrives_and_verifies(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    private = subprocess.run(["openssl", "genrsa", "2048"], check=True,
                             capture_output=True).stdout
    public = base64.b64encode(subprocess.run(
        ["openssl", "pkey", "-pubout", "-outform", "DER"], input=private, check=True,
        capture_output=True).stdout)
    app, _ = _app(make_apps, mailgun, OUTBOX_DKIM_DOMAIN="example.com",
                  OUTBOX_DKIM_SELECTOR="s1", OUTBOX_DKIM_PRIVATE_KEY=private.decode())
    _send(app, sender="shop@example.com")
    wait_rows(app, _all_sent(1), timeout=10)
    data = mailgun.accepted[0].mime
    assert data.startswith(b"DKIM-Signature:")

    def dns(name: bytes, timeout: int = 5) -> bytes | None:
        return b"v=DKIM1; k=rsa; p=" + public if name.startswith(b"s1._domainkey.") else None

    assert dkim.verify(data, dnsfunc=dns)


def test_more_than_1000_recipients_are_refused_at_send_and_nothing_is_written(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    app, mail = _app(make_apps, mailgun)
    with app.app_context(), pytest.raises(InvalidMessage) as excinfo:
        mail.send(Message("x", recipients=[f"r{i}@example.com" for i in range(1001)],
                          body="x"))
    assert excinfo.value.field == "recipients" and "1000" in excinfo.value.problem
    assert rows(app) == [] and mailgun.requests == []


# -- errors ------------------------------------------------------------------------------------


def test_429_charges_no_attempt_and_the_row_waits_its_retry_after(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    mailgun.script(Reply(429, {"message": "Too many requests"}, {"Retry-After": "30"}))
    app, _ = _app(make_apps, mailgun, OUTBOX_INLINE_RETRIES=0)
    _send(app)
    [row] = wait_rows(app, lambda rs: bool(rs[0]["error_history"]), timeout=10)
    assert row["status"] == "queued" and row["attempts"] == 0
    [entry] = _history(row)
    assert entry["code"] == 429 and "Too many requests" in entry["message"]
    assert (row["due_at"] - row["created_at"]).total_seconds() >= 29
    assert not mailgun.wait_for(2, timeout=1.0)  # not asked again before it is due


def test_a_5xx_is_transient_and_the_retry_delivers(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    mailgun.script(Reply(502, b"<html>Bad Gateway</html>", {"Content-Type": "text/html"}))
    app, _ = _app(make_apps, mailgun)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(mailgun.requests) == 2
    [entry] = _history(row)
    assert entry["code"] == 502 and "Bad Gateway" in entry["message"]
    assert row["provider_message_id"] == mailgun.accepted[0].message_id.strip("<>")


@pytest.mark.parametrize("fault", ["500", "refused"])
def test_a_transport_fault_fails_over_to_smtp_in_the_same_attempt(
        make_apps: MakeApps, mailgun: MailgunAPI, smtp_server: FaultSMTPServer,
        fault: str) -> None:
    entry = _entry(mailgun, failover=["backup"], timeout=0.5)
    if fault == "500":
        # Connection: close, so no pooled connection outlives the app: the runtime does
        # not close a transport that has a failover list (reported to the integrator).
        mailgun.script(Reply(500, {"message": "Internal Server Error"},
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
    assert row["attempts"] == 1 and mailgun.accepted == []
    [step] = _history(row)
    assert (step["transport"], step["failed_over_to"]) == ("default", "backup")
    assert {"500": "500", "refused": "connection failed"}[
        fault] in f"{step['code']} {step['message']}"


def _config_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ERRORs about the transport: its pause (test_pause.py)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and
            r.getMessage().startswith("Transport 'default' is paused since")]


def test_401_keeps_the_rows_queued_with_one_error_then_a_rotated_key_delivers(
        make_apps: MakeApps, mailgun: MailgunAPI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    old_key = "key-revoked-old-secret"
    app, _ = _app(make_apps, mailgun, _entry(mailgun, api_key=old_key),
                  OUTBOX_INLINE_RETRIES=0)
    _send(app, "one")
    _send(app, "two")
    current = wait_rows(app, lambda rs: all(r["error_history"] for r in rs)
                        and bool(_config_errors(caplog)), timeout=10)
    # The transport is paused (test_pause.py): the emails keep their attempts.
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 0), ("queued", 0)]
    assert all("401" in r["last_error"] and "Forbidden" in r["last_error"] for r in current)
    [error] = _config_errors(caplog)
    assert "mailgun" in error and "API key" in error and "without spending attempts" in error
    assert "old-secret" not in caplog.text
    close_app(app)
    rotated, worker = _hand_ticked(make_apps, mailgun)
    done = poll(lambda: (worker.drain(timeout=5), rows(rotated))[1], _all_sent(2), timeout=15)
    assert sorted(_parsed(a.mime)["Subject"] for a in mailgun.accepted) == ["one", "two"]
    assert {r["provider_message_id"] for r in done} == {
        a.message_id.strip("<>") for a in mailgun.accepted}


def test_404_for_an_unknown_domain_is_a_setting_to_fix_not_a_dead_letter(
        make_apps: MakeApps, mailgun: MailgunAPI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flask_mail_outbox")
    app, _ = _app(make_apps, mailgun, _entry(mailgun, domain="mg.example.org"),
                  OUTBOX_INLINE_RETRIES=0)
    _send(app, "one")
    _send(app, "two")
    current = wait_rows(app, lambda rs: all(r["error_history"] for r in rs)
                        and bool(_config_errors(caplog)), timeout=10)
    # The transport is paused (test_pause.py): the emails keep their attempts.
    assert [(r["status"], r["attempts"]) for r in current] == [("queued", 0), ("queued", 0)]
    assert all("Domain not found: mg.example.org" in r["last_error"] for r in current)
    [error] = _config_errors(caplog)
    assert "the domain and base_url of OUTBOX_TRANSPORTS['default']" in error
    assert "api.eu.mailgun.net" in error and "without spending attempts" in error
    assert KEY not in caplog.text
    close_app(app)
    fixed, worker = _hand_ticked(make_apps, mailgun)
    poll(lambda: (worker.drain(timeout=5), rows(fixed))[1], _all_sent(2), timeout=15)
    assert {a.domain for a in mailgun.accepted} == {DOMAIN}


def test_400_for_a_bad_recipient_dead_letters_with_mailguns_text(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    mailgun.invalid_addresses = {"bounce@example.com"}
    app, _ = _app(make_apps, mailgun)
    _send(app, recipients=["bounce@example.com"])
    [row] = wait_rows(app, lambda rs: rs[0]["status"] == "failed", timeout=10)
    assert row["attempts"] == 1 and len(mailgun.requests) == 1
    [entry] = _history(row)
    assert entry["code"] == 400
    assert "to parameter is not a valid address" in entry["message"]


def test_a_connection_closed_mid_response_is_transient_and_nothing_is_lost(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    mailgun.script(Reply(500, {"message": "x" * 200}, cut=True))
    app, _ = _app(make_apps, mailgun)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(mailgun.accepted) == 1
    [entry] = _history(row)
    assert "connection failed" in entry["message"]


@pytest.mark.parametrize("body", [b"Mailgun Magnificent API", b'{"message": "Queued."}'],
                         ids=["not-json", "no-id"])
def test_a_200_that_is_not_the_documented_json_is_a_clear_transient_error(
        make_apps: MakeApps, mailgun: MailgunAPI, body: bytes) -> None:
    mailgun.script(Reply(200, body, {"Content-Type": "text/plain"}))
    app, _ = _app(make_apps, mailgun)
    _send(app)
    [row] = wait_rows(app, _all_sent(1), timeout=15)
    assert row["attempts"] == 2 and len(mailgun.accepted) == 1
    [entry] = _history(row)
    assert entry["code"] == 200 and "not what it documents" in entry["message"]
    assert body.decode() in entry["message"]


# -- settings and rate ---------------------------------------------------------------------


@pytest.mark.parametrize(("entry", "key", "problem"), [
    ({"domain": DOMAIN}, '["api_key"]', "needs it"),
    ({"domain": DOMAIN, "api_key": ["key-secret-in-a-list"]}, '["api_key"]', "needs it"),
    ({"api_key": KEY}, '["domain"]', "needs it"),
    ({"api_key": KEY, "domain": "https://api.mailgun.net/v3/mg.example.com"}, '["domain"]',
     "mg.example.com"),
    ({"api_key": KEY, "domain": DOMAIN, "base_url": "api.eu.mailgun.net"}, '["base_url"]',
     "https://api.mailgun.net"),
    ({"api_key": KEY, "domain": DOMAIN, "region": "eu"}, '["region"]', "unknown setting"),
], ids=["no-key", "key-not-a-string", "no-domain", "domain-url", "base_url", "typo"])
def test_a_bad_entry_fails_at_init_naming_its_key_without_the_secret(
        tmp_path: Any, entry: dict[str, Any], key: str, problem: str) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      OUTBOX_TRANSPORTS={"default": {"transport": "mailgun", **entry}})
    SQLAlchemy(app)
    with pytest.raises(ConfigError) as excinfo:
        OutboxMail(app)
    assert excinfo.value.key == f'OUTBOX_TRANSPORTS["default"]{key}'
    assert problem in excinfo.value.problem
    assert "secret" not in str(excinfo.value).replace("webhook_secret", "")  # a key name


def test_a_shared_rate_limit_spaces_the_requests(
        make_apps: MakeApps, mailgun: MailgunAPI) -> None:
    rate, total = 20.0, 15
    app, mail = _app(make_apps, mailgun, _entry(mailgun, rate_limit=f"{rate:g}/s"))
    with app.app_context():
        mail.send_many([Message(f"paced {i}", recipients=["a@example.com"], body="x")
                        for i in range(total)])
        released = time.monotonic()  # no slot is before the commit
        db.session.commit()
    assert mailgun.wait_for(total, timeout=30)
    times = sorted(r.received_at for r in mailgun.requests)
    # From the commit, which no slot precedes: on a loaded machine the first requests
    # can arrive late and together (they catch up to their slots), so a span measured
    # between received requests could be shorter than the rate allows without any
    # request coming early; the last one can never come before its slot.
    assert times[-1] - released >= (total - 2) / rate * 0.9, (released, times)
    wait_rows(app, _all_sent(total), timeout=10)
    assert len(mailgun.accepted) == total
