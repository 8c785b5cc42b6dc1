"""The transports that need no server, custom transports, and TLS over SMTP."""

from __future__ import annotations

import email.policy
import logging
from collections.abc import Mapping
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from conftest import db, make_app
from flask_mail_outbox import Message, OutboxMail, PermanentError, TransientError
from flask_mail_outbox._models import email_table
from flask_mail_outbox.transports import Envelope, Transport
from smtpserver import FaultSMTPServer


def run_app(db_url: str, **config: Any) -> tuple[Flask, OutboxMail]:
    app = make_app(db_url, **config)
    return app, app.extensions["test_mail"]


def close(app: Flask, mail: OutboxMail) -> None:
    mail.stop()
    with app.app_context():
        for engine in db.engines.values():
            engine.dispose()


def statuses(app: Flask) -> list[str]:
    with app.app_context(), db.engine.connect() as conn:
        return [r.status for r in conn.execute(email_table.select().order_by(email_table.c.id))]


def send_one(app: Flask, mail: OutboxMail, subject: str = "Hello") -> int:
    with app.app_context():
        email_id = mail.send(Message(subject, recipients=["a@example.com"], body="Body text"))
        db.session.commit()
        assert mail.wait_idle(20)
    return email_id


def test_console_transport_prints_the_message(db_url: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    app, mail = run_app(db_url, OUTBOX_TRANSPORT="console")
    try:
        send_one(app, mail, "Console subject")
        out = capsys.readouterr().out
        assert "Subject: Console subject" in out and "Envelope-To: a@example.com" in out
        assert statuses(app) == ["sent"]
    finally:
        close(app, mail)


def test_file_transport_writes_one_eml_per_message(db_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "mails"
    app, mail = run_app(db_url, OUTBOX_TRANSPORT="file", OUTBOX_FILE_PATH=str(folder))
    try:
        send_one(app, mail, "First")
        send_one(app, mail, "Second")
        files = sorted(folder.glob("*.eml"))
        assert len(files) == 2
        parsed = [BytesParser(policy=email.policy.default).parsebytes(f.read_bytes())
                  for f in files]
        assert [p["Subject"] for p in parsed] == ["First", "Second"]
        assert not list(folder.glob("*.part"))
    finally:
        close(app, mail)


def test_null_transport_accepts_and_drops(db_url: str) -> None:
    app, mail = run_app(db_url, OUTBOX_TRANSPORT="null")
    try:
        send_one(app, mail)
        assert statuses(app) == ["sent"]
    finally:
        close(app, mail)


class FlakyTransport(Transport):
    """A custom transport: fails transiently once per message, then refuses 'bad'."""

    seen: list[str] = []

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        self.seen.append(envelope.message_id)
        if "bad@example.com" in envelope.recipients:
            raise PermanentError("no such user", code=550)
        if self.seen.count(envelope.message_id) == 1:
            raise TransientError("try later", code=451)
        return {}


def test_custom_transport_by_dotted_path(db_url: str) -> None:
    FlakyTransport.seen = []
    app, mail = run_app(db_url, OUTBOX_TRANSPORT="test_transports:FlakyTransport")
    try:
        send_one(app, mail)
        with app.app_context():
            mail.send(Message("x", recipients=["bad@example.com"], body="x"))
            db.session.commit()
            assert mail.wait_idle(20)
        assert statuses(app) == ["sent", "failed"]
        assert len(FlakyTransport.seen) == 3
    finally:
        close(app, mail)


class RaisingTransport(Transport):
    """A broken custom transport that raises instead of returning results."""

    def send_many(self, envelopes: Any) -> Any:
        raise ValueError("bug in the transport")


def test_a_transport_that_raises_loses_nothing(db_url: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    app, mail = run_app(db_url, OUTBOX_TRANSPORT="test_transports:RaisingTransport",
                        OUTBOX_INLINE_RETRIES=0)
    try:
        send_one(app, mail)
        assert statuses(app) == ["queued"]
        assert any(r.levelno == logging.ERROR and "instead of returning results" in r.getMessage()
                   for r in caplog.records)
    finally:
        close(app, mail)


def test_a_class_that_is_not_a_transport_is_refused_at_init(db_url: str) -> None:
    from flask_mail_outbox import ConfigError

    with pytest.raises(ConfigError, match="OUTBOX_TRANSPORT.*subclass"):
        make_app(db_url, OUTBOX_TRANSPORT="pathlib:PurePath")


@pytest.fixture
def tls_server() -> Any:
    with FaultSMTPServer(starttls=True) as server:
        yield server


def test_starttls_verifies_certificates_by_default(db_url: str, tls_server: FaultSMTPServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    app, mail = run_app(db_url, MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                        MAIL_USE_TLS=True, OUTBOX_INLINE_RETRIES=0)
    try:
        send_one(app, mail)
        assert statuses(app) == ["queued"]
        assert tls_server.messages == []
    finally:
        close(app, mail)


def test_starttls_with_a_trusted_ca_file(db_url: str, tls_server: FaultSMTPServer) -> None:
    app, mail = run_app(db_url, MAIL_SERVER="localhost", MAIL_PORT=tls_server.port,
                        MAIL_USE_TLS=True, OUTBOX_TLS_CA_FILE=tls_server.cert_file)
    try:
        send_one(app, mail)
        assert statuses(app) == ["sent"]
        assert tls_server.wait_for(1)
        assert tls_server.messages[0].tls is True
    finally:
        close(app, mail)


def test_starttls_with_verification_off(db_url: str, tls_server: FaultSMTPServer) -> None:
    app, mail = run_app(db_url, MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                        MAIL_USE_TLS=True, OUTBOX_TLS_VERIFY=False)
    try:
        send_one(app, mail)
        assert statuses(app) == ["sent"]
    finally:
        close(app, mail)


def test_use_tls_true_never_falls_back_to_plain_text(db_url: str,
                                                    smtp_server: FaultSMTPServer) -> None:
    # A server that does not offer STARTTLS.
    app, mail = run_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                        MAIL_USE_TLS=True, OUTBOX_INLINE_RETRIES=0)
    try:
        send_one(app, mail)
        assert statuses(app) == ["queued"]
        assert smtp_server.messages == []
    finally:
        close(app, mail)
