"""The `flask outbox` commands."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeApps, close_app, db, free_port, make_app, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _flask(db_url: str, smtp_port: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``flask outbox ARGS`` in its own process, for an app that configures no logging."""
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
           "DEPLOY_DB_URL": db_url, "DEPLOY_SMTP_PORT": str(smtp_port)}
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "gunicorn_app:create_app", "outbox", *args],
        env=env, cwd=str(TESTS), capture_output=True, text=True, timeout=120, check=False)


def test_send_test_delivers_one_email(app: Flask, smtp_server: FaultSMTPServer) -> None:
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                "ops@example.com"])
    assert result.exit_code == 0, result.output
    assert ": sent after 1 attempt(s)" in result.output
    assert smtp_server.wait_for(1)
    assert smtp_server.messages[0].rcpt_tos == ["ops@example.com"]


def test_send_test_against_a_dead_server_is_one_shot(db_url: str) -> None:
    """Tried once, then taken back: no real email is left queued to retry for a day (the
    library's own retry schedule). A refused connection pauses the transport (see
    test_pause.py): the attempt is given back, and send-test cancels the email."""
    app = make_app(db_url, MAIL_SERVER="127.0.0.1", MAIL_PORT=free_port(),
                   OUTBOX_RETRY_BASE_SECONDS=60.0, OUTBOX_MAX_ATTEMPTS=30)
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                    "ops@example.com"])
        assert result.exit_code == 1
        assert ": cancelled after 0 attempt(s)" in result.output, result.output
        assert "Connect call failed" in result.output
        [row] = rows(app)
        assert (row["status"], row["attempts"]) == ("cancelled", 0)
    finally:
        close_app(app)


def test_send_test_takes_back_an_email_whose_retry_would_come_before_its_deadline(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    """A short retry schedule would retry it within --timeout: it is not retried, it is
    taken back, and a later sweep sends nothing."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_INLINE_RETRIES=0)  # the tests' 2 s schedule
    smtp_server.reply("data", 451, "4.3.0 try later")
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                    "ops@example.com"])
        assert result.exit_code == 1
        assert ": cancelled after 1 attempt(s)" in result.output, result.output
        assert "451" in result.output
        smtp_server.reset_faults()
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            report = mail.sweep(min_age=0)
        assert report.scanned == 0
        [row] = rows(app)
        assert (row["status"], row["attempts"]) == ("cancelled", 1)
        assert smtp_server.messages == []
    finally:
        close_app(app)


def test_send_test_help_says_it_is_one_shot(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "one-shot" in text and "never retried later" in text


def test_durable_on_writes_the_setting_and_starts_no_delivery(
        make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps()  # the tables, and a reader of the setting
    done = _flask(db_url, smtp_server.port, "durable", "on")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("delivery mode is now durable for every process (each sees it "
                           "within OUTBOX_SETTINGS_TTL_SECONDS)\n")
    assert done.stderr == ""
    # Even the engine's debug lines show no delivery started.
    done = _flask(db_url, smtp_server.port, "durable", "on", "--log-level", "debug")
    assert done.returncode == 0, done.stderr
    assert "dispatcher" not in done.stderr, done.stderr
    with app.app_context():
        assert mail.durable


@pytest.mark.parametrize("command", [["send-test", "--to", "ops@example.com"],
                                     ["sweep", "--dry-run"]], ids=["send-test", "dry-run"])
def test_a_command_prints_what_it_says_and_engine_lines_only_when_asked(
        make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer,
        command: list[str]) -> None:
    make_apps()  # the tables
    quiet = _flask(db_url, smtp_server.port, *command)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert quiet.stdout.startswith("email 1 " if command[0] == "send-test" else "scanned ")
    loud = _flask(db_url, smtp_server.port, *command, "--log-level", "debug")
    assert loud.returncode == 0, loud.stderr
    assert " INFO flask_mail_outbox" in loud.stderr, loud.stderr


def test_send_test_goes_through_the_named_transport_and_refuses_an_unknown_one(
        db_url: str, smtp_server: FaultSMTPServer, caplog: pytest.LogCaptureFixture) -> None:
    with FaultSMTPServer() as bulk:
        app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       OUTBOX_TRANSPORTS={"bulk": {"MAIL_SERVER": bulk.host,
                                                   "MAIL_PORT": bulk.port,
                                                   "rate_limit": "5/s"}})
        try:
            runner = app.test_cli_runner()
            result = runner.invoke(args=["outbox", "send-test", "--to", "ops@example.com",
                                         "--transport", "bulk"])
            assert result.exit_code == 0, result.output
            assert bulk.wait_for(1) and smtp_server.messages == []
            # The start line of a command names every transport.
            with caplog.at_level(logging.INFO, logger="flask_mail_outbox._operator.cli"):
                swept = runner.invoke(args=["outbox", "sweep", "--dry-run"])
            assert swept.exit_code == 0, swept.output
            assert f"transport default: smtp 127.0.0.1:{smtp_server.port}; bulk: smtp " \
                   f"127.0.0.1:{bulk.port} at 5/s" in caplog.text + swept.output
            result = runner.invoke(args=["outbox", "send-test", "--to", "ops@example.com",
                                         "--transport", "nope"])
            assert result.exit_code == 2
            assert "--transport" in result.output and "default, bulk" in result.output
        finally:
            close_app(app)


def test_send_test_rejects_a_bad_address(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to", "not-an-address"])
    assert result.exit_code == 2
    assert "recipients" in result.output


@pytest.mark.parametrize("kind", ["postmark", "sendgrid", "mailgun", "resend", "ses"])
def test_send_test_works_through_every_provider_api(db_url: str, kind: str) -> None:
    from provider_mailgun import MailgunAPI
    from provider_postmark import TOKEN, FakePostmark
    from provider_resend import API_KEY, FakeResend
    from provider_sendgrid import SendGridAPI
    from provider_ses import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, SignedSESFake

    fake: Any
    fake, entry = {
        "postmark": lambda: (FakePostmark(), {"token": TOKEN}),
        "sendgrid": lambda: (SendGridAPI(), {"api_key": "SG.test-key.secret"}),
        "mailgun": lambda: (MailgunAPI(), {"api_key": "key-test-secret",
                                           "domain": "mg.example.com"}),
        "resend": lambda: (FakeResend(), {"api_key": API_KEY}),
        "ses": lambda: (SignedSESFake(), {"region": REGION, "access_key_id": ACCESS_KEY_ID,
                                          "secret_access_key": SECRET_ACCESS_KEY}),
    }[kind]()
    fake.start()
    url_key = "endpoint_url" if kind == "ses" else "base_url"
    app = make_app(db_url, OUTBOX_TRANSPORTS={"api": {"transport": kind, url_key: fake.url,
                                                      **entry}})
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                    "ops@example.com", "--transport", "api"])
        assert result.exit_code == 0, result.output
        assert ": sent after 1 attempt(s)" in result.output
        assert fake.wait_for(1, timeout=1)
    finally:
        close_app(app)
        fake.stop()


def test_worker_debug_lines_follow_one_email_from_claim_to_record(
        make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer) -> None:
    """Issue 41 item 7: `--log-level debug` shows each email's claim, hand-over, reply and
    record, each line naming the email (`Email <id>`), so an operator can grep one."""
    make_apps()  # the tables
    assert _flask(db_url, smtp_server.port, "durable", "on").returncode == 0
    # Durable, and no dispatcher of its own: the worker below delivers.
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    with app.app_context():
        ok = mail.send(Message("debug me", recipients=["alice.debug@example.com"], body="x"))
        later = mail.send(Message("try again", recipients=["bob.debug@example.com"], body="x"))
        db.session.commit()
    smtp_server.reply("data", 451, "4.3.0 Try again later", times=1)
    done = _flask(db_url, smtp_server.port, "worker", "--once", "--log-level", "debug")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()

    def of(email_id: int) -> list[str]:
        return [line.split(": ", 1)[1] for line in lines
                if f"Email {email_id} " in line or f"Email {email_id}:" in line]

    first, second = of(ok), of(later)
    both = {first[-1], second[-1]}
    assert len(first) == 4 and len(second) == 4, done.stderr
    assert first[0].startswith(f"Email {ok} claimed for attempt 1 on transport 'default'")
    assert first[1].startswith(f"Email {ok} handed to the transport: Message-ID <")
    assert {first[2].split(": ", 1)[0], second[2].split(": ", 1)[0]} == {
        f"Email {ok}", f"Email {later}"}
    # One of the two met the 451 (whichever went first), the other was accepted.
    replies = {first[2], second[2]}
    assert any(r.endswith("accepted") or "accepted, provider id" in r for r in replies), replies
    assert any("transient failure: 451 4.3.0 Try again later" in r for r in replies), replies
    assert any(r.endswith("recorded sent") for r in both), both
    assert any(" recorded queued, due again in " in r and "451" in r for r in both), both
    # Never an address in a DEBUG line.
    assert "alice.debug" not in done.stderr and "bob.debug" not in done.stderr
