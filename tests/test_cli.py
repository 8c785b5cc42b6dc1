"""The `flask outbox` commands."""

from __future__ import annotations

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


def test_send_test_rejects_a_bad_address(app: Flask) -> None:
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to", "not-an-address"])
    assert result.exit_code == 2
    assert "recipients" in result.output
