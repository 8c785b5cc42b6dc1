"""The `flask outbox` commands."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from conftest import close_app, free_port, make_app
from flask import Flask
from smtpserver import FaultSMTPServer


def test_send_test_delivers_one_email(app: Flask, smtp_server: FaultSMTPServer) -> None:
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                "ops@example.com"])
    assert result.exit_code == 0, result.output
    assert ": sent after 1 attempt(s)" in result.output
    assert smtp_server.wait_for(1)
    assert smtp_server.messages[0].rcpt_tos == ["ops@example.com"]


def test_send_test_reports_a_failure_with_exit_1(db_url: str) -> None:
    app = make_app(db_url, MAIL_SERVER="127.0.0.1", MAIL_PORT=free_port(), OUTBOX_INLINE_RETRIES=0)
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to",
                                                    "ops@example.com"])
        assert result.exit_code == 1
        assert "queued" in result.output and "Connect call failed" in result.output
    finally:
        close_app(app)


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
