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

from flask_mail_outbox import (
    ConfigError,
    InvalidMessage,
    Message,
    OutboxMail,
    PermanentError,
    TransientError,
)
from flask_mail_outbox.core import email_table
from flask_mail_outbox.transports import (
    BUILTIN,
    Envelope,
    SMTPSettings,
    SMTPTransport,
    Transport,
    TransportSettings,
    build,
    transport_class,
)


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


# -- transports built from their own settings ------------------------------------------------


class TokenTransport(Transport):
    """A custom transport that needs its OUTBOX_TRANSPORTS entry: its own key, its name."""

    built: list[TransportSettings] = []
    seen: list[tuple[str, str]] = []

    def __init__(self, token: str, name: str) -> None:
        super().__init__()
        self.token, self.name = token, name

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> TokenTransport:
        cls.built.append(settings)
        return cls(settings.options["token"], settings.name)

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        self.seen.append((self.name, self.token))
        return {}


def test_a_custom_transport_gets_its_own_entry_never_the_app_config(
        make_apps: MakeApps) -> None:
    TokenTransport.built, TokenTransport.seen = [], []
    app, mail = make_apps(OUTBOX_TRANSPORTS={"api": {
        "transport": "test_transports:TokenTransport", "token": "tok-1", "concurrency": 2}})
    with app.app_context():
        mail.send(Message("x", recipients=["a@example.com"], body="x"), transport="api")
        db.session.commit()
        assert mail.wait_idle(20)
    assert statuses(app) == ["sent"]
    (settings,) = TokenTransport.built
    assert (settings.name, dict(settings.options), settings.concurrency) == \
        ("api", {"token": "tok-1"}, 2)
    assert TokenTransport.seen == [("api", "tok-1")]


def test_a_builtin_entry_still_refuses_an_unknown_key(make_apps: MakeApps) -> None:
    with pytest.raises(ConfigError, match=r'OUTBOX_TRANSPORTS\["bulk"\]\["token"\]'):
        make_apps(OUTBOX_TRANSPORTS={"bulk": {"transport": "smtp", "token": "x"}})


class NeedsConfig(Transport):
    """Written as ``__init__(self, config)`` with no ``from_settings``: nothing can build it."""

    def __init__(self, config: Any) -> None:
        super().__init__()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        return {}


def test_a_transport_whose_init_takes_arguments_without_from_settings_is_refused(
        make_apps: MakeApps) -> None:
    with pytest.raises(ConfigError, match=r"^OUTBOX_TRANSPORT: .*__init__ takes arguments.*"
                                          r"from_settings"):
        make_apps(OUTBOX_TRANSPORT="test_transports:NeedsConfig")
    with pytest.raises(ConfigError, match=r'^OUTBOX_TRANSPORTS\["bulk"\]\["transport"\]: '):
        make_apps(OUTBOX_TRANSPORTS={"bulk": {"transport": "test_transports:NeedsConfig"}})


def test_the_registry_names_every_builtin_and_refuses_what_is_not_a_transport() -> None:
    assert {name: cls.__name__ for name, cls in BUILTIN.items()} == {
        "smtp": "SMTPTransport", "console": "ConsoleTransport", "file": "FileTransport",
        "memory": "MemoryTransport", "null": "NullTransport", "mailbox": "MailboxTransport"}
    assert transport_class("test_transports:TokenTransport", "K") is TokenTransport
    with pytest.raises(ConfigError, match="^K: .*must be a subclass"):
        transport_class("test_transports:statuses", "K")
    with pytest.raises(ConfigError, match="^K: cannot import"):
        transport_class("no_such_module:X", "K")
    smtp = build(BUILTIN["smtp"], TransportSettings(smtp=SMTPSettings(port=2525),
                                                    concurrency=3))
    assert isinstance(smtp, SMTPTransport) and smtp.concurrency == 3
    assert smtp.settings.port == 2525


@pytest.mark.parametrize(("kind", "entry"), [
    ("postmark", {"token": "pm-token"}), ("resend", {"api_key": "re_key"}),
    ("sendgrid", {"api_key": "SG.key"})])
def test_a_json_api_refuses_a_body_part_it_would_drop_nothing_written(
        make_apps: MakeApps, kind: str, entry: dict[str, str]) -> None:
    # Their APIs take text, html, attachments and inline images as fields: a
    # text/calendar alternative has no field, and would vanish without a word.
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": {
        "transport": kind, "base_url": "http://127.0.0.1:9", **entry}})
    with app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(Message("invite", recipients=["a@example.com"], body="x",
                              alts={"calendar": "BEGIN:VCALENDAR\r\nEND:VCALENDAR\r\n"}))
        assert excinfo.value.field == "alts" and "text/calendar" in str(excinfo.value)
        db.session.commit()
    assert statuses(app) == []


@pytest.mark.parametrize("kind", ["postmark", "sendgrid", "mailgun", "resend", "ses"])
def test_esmtp_parameters_are_refused_for_an_api_and_its_failover_too(
        make_apps: MakeApps, kind: str) -> None:
    entry = {"postmark": {"token": "t"}, "sendgrid": {"api_key": "k"},
             "mailgun": {"api_key": "k", "domain": "mg.example.com"},
             "resend": {"api_key": "re_k"},
             "ses": {"region": "eu-west-1", "access_key_id": "AK",
                     "secret_access_key": "SK"}}[kind]
    app, mail = make_apps(OUTBOX_TRANSPORTS={
        "api": {"transport": kind, **entry},
        "smtp": {"transport": "smtp", "failover": ["api"]}})
    with app.app_context():
        for name in ("api", "smtp"):  # the API itself, and an SMTP entry failing over to it
            with pytest.raises(InvalidMessage) as excinfo:
                mail.send(Message("x", recipients=["a@example.com"], body="x",
                                  rcpt_options=["NOTIFY=SUCCESS"]), transport=name)
            assert excinfo.value.field == "mail_options" and "'api'" in str(excinfo.value)
        mail.send(Message("x", recipients=["a@example.com"], body="x"), transport="api")
        db.session.rollback()
