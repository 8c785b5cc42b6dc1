"""The transports that need no server, custom transports, and TLS over SMTP."""

from __future__ import annotations

import email.policy
import logging
from collections.abc import Mapping
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeApps, db, make_app
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail, PermanentError, TransientError
from flask_mail_outbox._models import email_table
from flask_mail_outbox.transports import Envelope, Transport


def statuses(app: Flask) -> list[str]:
    with app.app_context(), db.engine.connect() as conn:
        return [r.status for r in conn.execute(email_table.select().order_by(email_table.c.id))]


def send_one(app: Flask, mail: OutboxMail, subject: str = "Hello") -> int:
    with app.app_context():
        email_id = mail.send(Message(subject, recipients=["a@example.com"], body="Body text"))
        db.session.commit()
        assert mail.wait_idle(20)
    return email_id


def test_console_transport_prints_the_message(make_apps: MakeApps,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="console")
    send_one(app, mail, "Console subject")
    out = capsys.readouterr().out
    assert "Subject: Console subject" in out and "Envelope-To: a@example.com" in out
    assert statuses(app) == ["sent"]


def test_file_transport_writes_one_eml_per_message(make_apps: MakeApps, tmp_path: Path) -> None:
    folder = tmp_path / "mails"
    app, mail = make_apps(OUTBOX_TRANSPORT="file", OUTBOX_FILE_PATH=str(folder))
    send_one(app, mail, "First")
    send_one(app, mail, "Second")
    files = sorted(folder.glob("*.eml"))
    assert len(files) == 2
    parsed = [BytesParser(policy=email.policy.default).parsebytes(f.read_bytes())
              for f in files]
    assert [p["Subject"] for p in parsed] == ["First", "Second"]
    assert not list(folder.glob("*.part"))


def test_null_transport_accepts_and_drops(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    send_one(app, mail)
    assert statuses(app) == ["sent"]


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


def test_custom_transport_by_dotted_path(make_apps: MakeApps) -> None:
    FlakyTransport.seen = []
    app, mail = make_apps(OUTBOX_TRANSPORT="test_transports:FlakyTransport")
    send_one(app, mail)
    with app.app_context():
        mail.send(Message("x", recipients=["bad@example.com"], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    assert statuses(app) == ["sent", "failed"]
    assert len(FlakyTransport.seen) == 3


class RaisingTransport(Transport):
    """A broken custom transport that raises instead of returning results."""

    def send(self, envelope: Any) -> Any:
        raise ValueError("bug in the transport")


def test_a_transport_that_raises_loses_nothing(make_apps: MakeApps,
                                               caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="test_transports:RaisingTransport",
                          OUTBOX_INLINE_RETRIES=0)
    send_one(app, mail)
    assert statuses(app) == ["queued"]
    assert any(r.levelno == logging.ERROR and "instead of returning results" in r.getMessage()
               for r in caplog.records)


def test_a_class_that_is_not_a_transport_is_refused_at_init(db_url: str) -> None:
    from flask_mail_outbox import ConfigError

    with pytest.raises(ConfigError, match="OUTBOX_TRANSPORT.*subclass"):
        make_app(db_url, OUTBOX_TRANSPORT="pathlib:PurePath")


@pytest.fixture
def tls_server() -> Any:
    with FaultSMTPServer(starttls=True) as server:
        yield server


def test_starttls_verifies_certificates_by_default(tls_server: FaultSMTPServer,
                                                   make_apps: MakeApps,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=True, OUTBOX_INLINE_RETRIES=0)
    send_one(app, mail)
    assert statuses(app) == ["queued"]
    assert tls_server.messages == []


def test_starttls_with_a_trusted_ca_file(tls_server: FaultSMTPServer, make_apps: MakeApps) -> None:
    app, mail = make_apps(MAIL_SERVER="localhost", MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=True, OUTBOX_TLS_CA_FILE=tls_server.cert_file)
    send_one(app, mail)
    assert statuses(app) == ["sent"]
    assert tls_server.wait_for(1)
    assert tls_server.messages[0].tls is True


def test_starttls_with_verification_off(tls_server: FaultSMTPServer, make_apps: MakeApps) -> None:
    app, mail = make_apps(MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=True, OUTBOX_TLS_VERIFY=False)
    send_one(app, mail)
    assert statuses(app) == ["sent"]


def test_use_tls_true_never_falls_back_to_plain_text(smtp_server: FaultSMTPServer,
                                                    make_apps: MakeApps) -> None:
    # A server that does not offer STARTTLS.
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          MAIL_USE_TLS=True, OUTBOX_INLINE_RETRIES=0)
    send_one(app, mail)
    assert statuses(app) == ["queued"]
    assert smtp_server.messages == []
