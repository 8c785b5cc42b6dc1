"""Staging at delivery: OUTBOX_REDIRECT_TO, OUTBOX_ALLOWED_RECIPIENTS and @mail.before_send.

Every test delivers to a real SMTP server (tests/smtpserver.py) and reads what
arrived there (the envelope as the server saw it, the bytes, the DKIM signature
verified by dkimpy) and what the row says, on SQLite and PostgreSQL. The hook is
also run by a ``flask outbox worker`` subprocess (durable mode, PostgreSQL).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dkim
import pytest
import sqlalchemy as sa
from conftest import (
    MakeApps,
    close_app,
    db,
    empty_postgres,
    hand_ticked_worker,
    make_app,
    require_postgres,
    rows,
    wait_rows,
)
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from flask import Flask, current_app
from provider_postmark import TOKEN as POSTMARK_TOKEN
from provider_postmark import FakePostmark
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core import OutgoingEmail, email_table
from flask_mail_outbox.core._intercept import ORIGINAL_CC, ORIGINAL_TO, header_line
from flask_mail_outbox.testing import OutboxTest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
QA = "qa@qa-inbox.org"


def send(app: Flask, *messages: Message) -> list[int]:
    """Queue ``messages`` in one transaction and commit; their ids."""
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [mail.send(message) for message in messages]
        db.session.commit()
    return ids


def finished(count: int) -> Any:
    return lambda found: len(found) >= count and all(
        r["status"] not in ("queued", "sending") for r in found)


def notes(row: dict[str, Any]) -> list[str]:
    return list(json.loads(row["intercepted"] or "[]"))


@pytest.fixture
def smtp_apps(make_apps: MakeApps, smtp_server: FaultSMTPServer) -> MakeApps:
    """``make_apps(**config)`` delivering over SMTP to ``smtp_server``."""
    def factory(**config: Any) -> tuple[Flask, OutboxMail]:
        return make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port, **config)
    return factory


# -- OUTBOX_REDIRECT_TO -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dkim_key() -> tuple[str, bytes]:
    """An RSA key: (private PEM, the DNS record's p= value)."""
    key = rsa.generate_private_key(65537, 2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode("ascii")
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, base64.b64encode(public)


def test_redirect_goes_to_the_redirect_address_only_the_originals_in_headers_signed_as_sent(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer,
        dkim_key: tuple[str, bytes]) -> None:
    app, mail = smtp_apps(OUTBOX_REDIRECT_TO=[QA], OUTBOX_DKIM_DOMAIN="example.com",
                          OUTBOX_DKIM_SELECTOR="s1", OUTBOX_DKIM_PRIVATE_KEY=dkim_key[0])
    [email_id] = send(app, Message("Your order", recipients=["Alice Ä <alice@customer.org>"],
                                   cc=["bob@customer.org"], bcc=["carol@secret.org"],
                                   body="shipped"))
    assert smtp_server.wait_for(1)
    [received] = smtp_server.messages
    assert received.rcpt_tos == [QA]  # the envelope, as the server saw it
    parsed = received.parsed
    assert parsed["To"] == QA and parsed["Cc"] is None
    assert parsed[ORIGINAL_TO] == "Alice Ä <alice@customer.org>"
    assert parsed[ORIGINAL_CC] == "bob@customer.org"
    assert b"carol" not in received.data and b"secret.org" not in received.data
    record = b"v=DKIM1; k=rsa; p=" + dkim_key[1]
    assert dkim.DKIM(received.data).verify(
        dnsfunc=lambda name, timeout=5: record if name.startswith(b"s1.") else None)
    [row] = wait_rows(app, finished(1), timeout=10)
    assert row["status"] == "sent"
    # The row keeps its real recipients; what staging did is recorded beside them.
    assert json.loads(row["recipients"]) == ["alice@customer.org", "bob@customer.org",
                                             "carol@secret.org"]
    assert notes(row) == [(f"redirected to {QA} (OUTBOX_REDIRECT_TO) instead of "
                           "alice@customer.org, bob@customer.org, carol@secret.org")]
    with app.app_context():
        detail = app.extensions["mail_outbox"].outbox().reader.get_email(email_id)
    assert detail is not None and detail.intercepted == tuple(notes(row))
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                           url_prefix="/outbox")
    page = app.test_client().get(f"/outbox/emails/{email_id}").get_data(as_text=True)
    assert 'id="intercepted"' in page and f"redirected to {QA}" in page


def test_suppression_applies_to_the_real_addresses_not_the_redirect(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_apps(OUTBOX_REDIRECT_TO=[QA])
    with app.app_context():
        mail.suppress("alice@customer.org", "bounced")
    both, alone = send(app, Message("Both", recipients=["alice@customer.org",
                                                        "bob@customer.org"], body="x"),
                       Message("Alone", recipients=["alice@customer.org"], body="x"))
    found = {r["id"]: r for r in wait_rows(app, finished(2), timeout=10)}
    assert smtp_server.wait_for(1)
    assert [(m.rcpt_tos, m.parsed["Subject"]) for m in smtp_server.messages] == [
        ([QA], "Both")]
    # The suppressed real address is left out, not redirected...
    assert notes(found[both]) == [(f"redirected to {QA} (OUTBOX_REDIRECT_TO) instead of "
                                   "bob@customer.org")]
    with app.app_context():
        assert [(e.event_type, e.recipient) for e in mail.events(both)] == [
            ("rejected", "alice@customer.org")]
    # ...and an email whose only real recipient is suppressed ends as it would without.
    assert found[alone]["status"] == "suppressed" and found[alone]["intercepted"] is None


def test_rate_limit_paces_redirected_mail_per_email_of_its_transport(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    # The outbox's rate limits are per transport, in messages: a redirected email
    # takes one slot of its transport's rate, as it would sent to its real recipients
    # (three each here), so staging paces as production does.
    app, _ = smtp_apps(OUTBOX_REDIRECT_TO=[QA], OUTBOX_RATE_LIMIT=5,
                       OUTBOX_CONCURRENCY=4)
    send(app, *[Message(f"m{i}", recipients=[f"u{i}@a.org", f"u{i}@b.org", f"u{i}@c.org"],
                        body="x") for i in range(6)])
    assert smtp_server.wait_for(6)
    times = sorted(m.received_at for m in smtp_server.messages)
    assert times[-1] - times[0] >= 5 / 5 * 0.8, times
    assert {tuple(m.rcpt_tos) for m in smtp_server.messages} == {(QA,)}


# -- OUTBOX_ALLOWED_RECIPIENTS --------------------------------------------------------------


def test_the_allow_list_blocks_and_records_and_an_email_with_none_allowed_is_cancelled(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, _ = smtp_apps(OUTBOX_ALLOWED_RECIPIENTS=["*@team.org", "Ops@Partner.org"])
    mixed, outside = send(
        app, Message("Mixed", recipients=["dev@team.org", "customer@shop.org"],
                     cc=["ops@partner.org"], bcc=["dev@sub.team.org"], body="x"),
        Message("Outside", recipients=["customer@shop.org"], body="x"))
    found = {r["id"]: r for r in wait_rows(app, finished(2), timeout=10)}
    assert smtp_server.wait_for(1)
    [received] = smtp_server.messages
    assert received.rcpt_tos == ["dev@team.org", "ops@partner.org"]
    assert found[mixed]["status"] == "sent"
    assert notes(found[mixed]) == [("not sent to customer@shop.org, dev@sub.team.org: "
                                    "outside OUTBOX_ALLOWED_RECIPIENTS")]
    # None allowed: it ends without contacting a server, and the row says why.
    row = found[outside]
    assert row["status"] == "cancelled" and row["attempts"] == 0
    assert row["last_error"] == ("not sent: no recipient is in OUTBOX_ALLOWED_RECIPIENTS "
                                 "(customer@shop.org)")
    assert notes(row) == ["not sent to customer@shop.org: outside OUTBOX_ALLOWED_RECIPIENTS"]
    assert smtp_server.connections == 1


def test_the_allow_list_is_the_last_gate_after_the_hook(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_apps(OUTBOX_ALLOWED_RECIPIENTS=["*@team.org"])

    @mail.before_send
    def widen(email: OutgoingEmail) -> None:
        email.recipients = [*email.recipients, "boss@elsewhere.org"]

    send(app, Message("x", recipients=["dev@team.org"], body="x"))
    [row] = wait_rows(app, finished(1), timeout=10)
    assert smtp_server.wait_for(1)
    assert smtp_server.messages[0].rcpt_tos == ["dev@team.org"]
    assert notes(row)[-1] == "not sent to boss@elsewhere.org: outside OUTBOX_ALLOWED_RECIPIENTS"


@pytest.fixture
def postmark() -> Iterator[FakePostmark]:
    """Postmark's API on a loopback port: a transport that addresses by the headers."""
    server = FakePostmark()
    server.start()
    yield server
    server.stop()


def test_an_api_transport_sends_to_no_address_staging_took_out_of_the_envelope(
        make_apps: MakeApps, postmark: FakePostmark) -> None:
    # A JSON API takes To and Cc from the headers: the addresses the allow-list or the
    # hook left out of the envelope must be left out of those too.
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": {
        "transport": "postmark", "base_url": postmark.url, "token": POSTMARK_TOKEN}},
        OUTBOX_ALLOWED_RECIPIENTS=["*@team.org"])

    @mail.before_send
    def move(email: OutgoingEmail) -> None:
        if email.parsed["Subject"] == "moved":
            email.recipients = ["hook@team.org"]

    send(app, Message("blocked", recipients=["dev@team.org", "customer@shop.org"],
                      cc=["boss@shop.org"], body="x"),
         Message("moved", recipients=["alice@team.org"], body="x"))
    found = wait_rows(app, finished(2), timeout=10)
    assert [r["status"] for r in found] == ["sent", "sent"]
    sent = {a.json["Subject"]: a.json for a in postmark.accepted}
    assert (sent["blocked"]["To"], sent["blocked"].get("Cc"), sent["blocked"].get("Bcc")) == (
        "dev@team.org", None, None)
    assert (sent["moved"].get("To"), sent["moved"]["Bcc"]) == (None, "hook@team.org")


# -- @mail.before_send ----------------------------------------------------------------------


def test_the_hook_changes_headers_and_recipients_or_vetoes_in_an_app_context(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = smtp_apps(OUTBOX_REDIRECT_TO=[QA])
    seen: list[tuple[int, str, tuple[str, ...], tuple[str, ...], str | None]] = []
    headers_seen: list[list[tuple[str, str]]] = []

    @mail.before_send
    def stage(email: OutgoingEmail) -> None:
        seen.append((email.id, current_app.import_name, email.recipients,
                     email.original_recipients, email.header("To")))
        headers_seen.append(email.headers)
        if email.parsed["Subject"] == "Veto me":
            email.veto("not in staging")
            return
        email.set_header("X-Environment", "staging é")
        email.set_header("Subject", "[staging] " + email.parsed["Subject"])
        email.remove_header("Reply-To")
        email.recipients = ["hook@team.org"]

    sent, vetoed = send(app, Message("Hello", recipients=["alice@customer.org"],
                                     reply_to="help@shop.org", body="x"),
                        Message("Veto me", recipients=["bob@customer.org"], body="x"))
    found = {r["id"]: r for r in wait_rows(app, finished(2), timeout=10)}
    assert smtp_server.wait_for(1)
    [received] = smtp_server.messages
    assert received.rcpt_tos == ["hook@team.org"]
    parsed = received.parsed
    assert parsed["X-Environment"] == "staging é" and parsed["Subject"] == "[staging] Hello"
    assert parsed["Reply-To"] is None and parsed["To"] == QA
    # It saw the email after the redirect, with the real recipients beside it.
    assert seen[0] == (sent, app.import_name, (QA,), ("alice@customer.org",), QA)
    assert ("To", QA) in headers_seen[0] and ("Subject", "Hello") in headers_seen[0]
    assert ("X-Outbox-Original-To", "alice@customer.org") in headers_seen[0]
    assert notes(found[sent]) == [
        f"redirected to {QA} (OUTBOX_REDIRECT_TO) instead of alice@customer.org",
        "before_send set X-Environment: staging é",
        "before_send set Subject: [staging] Hello",
        "before_send removed Reply-To",
        "before_send changed the recipients to hook@team.org"]
    row = found[vetoed]
    assert row["status"] == "cancelled" and row["attempts"] == 0
    assert row["last_error"] == "vetoed by before_send: not in staging"
    # The stored message is never changed: a retry starts from what send() built.
    with app.app_context():
        stored = rows(app)[0]["mime"]
    assert b"X-Environment" not in stored and b"help@shop.org" in stored


@pytest.mark.parametrize("fault", ["raises", "injects a header"])
def test_a_hook_that_raises_fails_the_attempt_transiently_never_sends_and_logs_error(
        smtp_apps: MakeApps, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture,
        fault: str) -> None:
    app, mail = smtp_apps(OUTBOX_MAX_ATTEMPTS=2, OUTBOX_INLINE_RETRIES=1,
                          OUTBOX_RETRY_BASE_SECONDS=0.1, OUTBOX_REDIRECT_TO=[QA])
    calls: list[int] = []

    @mail.before_send
    def broken(email: OutgoingEmail) -> None:
        calls.append(email.attempt)
        if fault == "raises":
            raise RuntimeError("lookup failed")
        email.set_header("X-Note", "ok\r\nBcc: everyone@customer.org")

    with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
        send(app, Message("x", recipients=["alice@customer.org"], body="x"))
        [row] = wait_rows(app, finished(1), timeout=15)
    said = ("RuntimeError: lookup failed" if fault == "raises" else
            "InvalidMessage: X-Note: contains a CR, LF or NUL character")
    assert row["status"] == "failed" and row["attempts"] == 2 and calls == [1, 2]
    assert row["last_error"].startswith(f"before_send raised {said}")
    assert notes(row)[-1].startswith(f"before_send raised {said}")
    assert smtp_server.connections == 0 and smtp_server.messages == []
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    hook_errors = [e for e in errors if e.startswith("before_send raised")]
    assert len(hook_errors) == 2  # one per attempt, then the dead letter's own report
    assert "Consequence: it is not sent on this attempt" in hook_errors[0]
    assert "Fix: fix the @mail.before_send function" in hook_errors[0]
    assert "failed for the last allowed time" in errors[-1]


def test_a_stored_message_staging_cannot_edit_fails_the_attempt_unsent_and_the_rest_goes(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   OUTBOX_REDIRECT_TO=[QA])
    try:
        worker = hand_ticked_worker(app)
        broken_id, fine_id = send(app, Message("broken", recipients=["a@customer.org"],
                                               body="x"),
                                  Message("fine", recipients=["b@customer.org"], body="x"))
        [row] = [r for r in rows(app) if r["id"] == broken_id]
        broken = row["mime"].replace(b"\r\nMIME-Version:", b"\r\nnot a header line\r\n"
                                     b"MIME-Version:", 1)
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.update(email_table).where(email_table.c.id == broken_id)
                         .values(mime=broken))
        with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
            worker.tick()
        assert smtp_server.wait_for(1)
        assert [m.parsed["Subject"] for m in smtp_server.messages] == ["fine"]
        found = {r["id"]: r for r in rows(app)}
        assert found[fine_id]["status"] == "sent"
        assert found[broken_id]["status"] == "queued" and found[broken_id]["attempts"] == 1
        assert found[broken_id]["last_error"].startswith("staging failed: ValueError: header "
                                                         "line")
        [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert error.startswith(f"Staging could not prepare email {broken_id}")
        assert "Consequence: it is not sent on this attempt" in error
    finally:
        close_app(app, timeout=5)


def test_the_test_kits_manual_delivery_goes_through_staging(db_url: str) -> None:
    # OutboxTest.deliver() is the worker's own path: the hook and the redirect apply there.
    app = make_app(db_url, TESTING=True, OUTBOX_REDIRECT_TO=[QA])
    mail: OutboxMail = app.extensions["test_mail"]

    @mail.before_send
    def veto_invoices(email: OutgoingEmail) -> None:
        if email.parsed["Subject"] == "Invoice":
            email.veto("not from staging")

    kit = OutboxTest(app, mode="manual")
    try:
        send(app, Message("Welcome", recipients=["ann@customer.org"], body="x"),
             Message("Invoice", recipients=["ann@customer.org"], body="x"))
        kit.assert_enqueued(count=2)
        assert kit.deliver() == 2
        [welcome] = kit.assert_sent(subject="Welcome", to="ann@customer.org")
        assert welcome.to == ("ann@customer.org",)  # the row's recipients: the real ones
        [invoice] = kit.emails(status="cancelled")
        assert invoice.last_error == "vetoed by before_send: not from staging"
    finally:
        kit.close()
        close_app(app)


def test_header_text_is_validated() -> None:
    assert header_line("X-Env", "staging") == b"X-Env: staging"
    assert header_line("X-Env", "é").startswith(b"X-Env: =?utf-8?")
    for name, value in [("X-Env", "a\r\nBcc: x@y.org"), ("X-Env", "a\nb"), ("X-Env", "a\0"),
                        ("X Env", "a"), ("X:Env", "a"), ("", "a"), ("To", "not <an address")]:
        with pytest.raises(InvalidMessage):
            header_line(name, value)
    # Other control characters never reach the header raw (RFC 5322: printable ASCII and
    # white space only; a vertical tab or form feed is a line break to some readers).
    for control in "\x0b\x0c\x1c\x1e\x7f\x1b":
        with pytest.raises(InvalidMessage, match=r"X-Env: contains a control character"):
            header_line("X-Env", f"a{control}Bcc: x@y.org")
    assert header_line("X-Env", "a\tb") == b"X-Env: a\tb"


def test_before_send_decorates_functions_only(make_apps: MakeApps) -> None:
    _, mail = make_apps()
    with pytest.raises(TypeError, match="before_send"):
        mail.before_send("not a function")  # type: ignore[arg-type]


# -- in a `flask outbox worker` process ---------------------------------------------------


@pytest.fixture
def pg_producer(pg_database: str | None, smtp_server: FaultSMTPServer) -> Iterator[Flask]:
    """The test process's app on PostgreSQL, durable: it queues, a worker delivers."""
    require_postgres()
    assert pg_database is not None
    app = make_app(empty_postgres(pg_database), MAIL_SERVER=smtp_server.host,
                   MAIL_PORT=smtp_server.port, OUTBOX_RUN_WORKER=False, OUTBOX_DURABLE=True)
    yield app
    close_app(app, timeout=5)


def test_the_hook_runs_in_a_flask_outbox_worker_process_in_its_app_context(
        pg_producer: Flask, smtp_server: FaultSMTPServer, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}",
               WORKER_DB_URL=pg_producer.config["SQLALCHEMY_DATABASE_URI"],
               WORKER_SMTP_PORT=str(smtp_server.port))
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "staging_helpers:create_app", "outbox",
         "worker"], env=env, cwd=str(TESTS), stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        [email_id] = send(pg_producer, Message("x", recipients=["alice@customer.org"],
                                               body="x"))
        assert smtp_server.wait_for(1, timeout=30), (tmp_path / "worker.log").read_text()
        [row] = wait_rows(pg_producer, finished(1), timeout=10)
    finally:
        worker.terminate()
        worker.wait(15)
        log.close()
    [received] = smtp_server.messages
    assert received.rcpt_tos == ["hook@team.org"]
    assert received.parsed["X-Hook-Pid"] == str(worker.pid) != str(os.getpid())
    assert received.parsed["X-Hook-App"] == "worker_app"
    assert row["id"] == email_id and row["status"] == "sent"
    assert notes(row)[-1] == "before_send changed the recipients to hook@team.org"
