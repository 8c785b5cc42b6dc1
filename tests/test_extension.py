"""The extension's setup: configuration checks, registration, the public surface."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

import flask_mail_outbox
from flask_mail_outbox import ConfigError, OutboxMail


def bare_app(tmp_path: Path, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'x.db'}"
    app.config.update(config)
    SQLAlchemy(app)
    return app


def test_public_names_are_pinned() -> None:
    assert sorted(flask_mail_outbox.__all__) == [
        "Attachment", "ConfigError", "DeliveredMessage", "DeliveryEvent", "InvalidMessage",
        "Message", "OutboxError", "OutboxMail", "PermanentError", "Status", "Suppression",
        "SweepReport", "TemplateError", "TransientError", "TransportError", "email_dispatched",
        "email_event",
        "email_failed", "email_queued", "email_sent", "email_unsubscribed", "local_debug_only",
    ]
    for name in flask_mail_outbox.__all__:
        assert getattr(flask_mail_outbox, name).__doc__


@pytest.mark.parametrize(("key", "value", "text"), [
    ("OUTBOX_MAX_ATTEMPTS", 0, "at least 1"),
    ("OUTBOX_MAX_ATTEMPTS", "many", "expected a number"),
    ("OUTBOX_MAX_ATTEMPTS", 2.5, "whole number"),
    ("OUTBOX_INLINE_RETRIES", -1, "at least 0"),
    ("OUTBOX_LEASE_SECONDS", 0, "at least 1"),
    ("OUTBOX_BATCH_SIZE", 0, "at least 1"),
    ("OUTBOX_POLL_INTERVAL", 0, "greater than 0"),
    ("OUTBOX_POLL_MAX_INTERVAL", 0.1, "at least OUTBOX_POLL_INTERVAL"),
    ("OUTBOX_RETRY_MAX_SECONDS", 1, "at least OUTBOX_RETRY_BASE_SECONDS"),
    ("OUTBOX_RATE_LIMIT", 0, "greater than 0"),
    ("OUTBOX_DURABLE", "maybe", "True or False"),
    ("OUTBOX_LISTEN", 2, "True or False"),
    ("OUTBOX_TRANSPORT", "carrier-pigeon", "package.module:Class"),
    ("OUTBOX_TRANSPORT", "no_such_module_x:Thing", "cannot import"),
    ("OUTBOX_MAX_MESSAGE_BYTES", -5, "at least 1"),
    ("OUTBOX_SWEEP_BATCH", 0, "at least 1"),
    ("OUTBOX_SWEEP_INTERVAL_SECONDS", 0, "greater than 0"),
    ("OUTBOX_MESSAGE_ID_DOMAIN", "a b", "not a domain"),
    ("OUTBOX_TLS_CA_FILE", "", "non-empty"),
    ("OUTBOX_RETENTION_DAYS", 0, "greater than 0"),
    ("OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS", float("nan"), "finite"),
    ("OUTBOX_BATCHSIZE", 5, "did you mean OUTBOX_BATCH_SIZE"),
    ("MAIL_PORT", 70000, "at most 65535"),
    ("MAIL_PORT", "smtp", "expected a number"),
    ("MAIL_TIMEOUT", 0, "greater than 0"),
    ("MAIL_DEFAULT_SENDER", 42, "addr@example.com"),
    ("MAIL_SERVER", "", "host name"),
])
def test_bad_config_fails_at_init_naming_the_key(tmp_path: Path, key: str, value: Any,
                                                  text: str) -> None:
    app = bare_app(tmp_path, **{key: value})
    with pytest.raises(ConfigError) as info:
        OutboxMail(app)
    assert str(info.value).startswith(key)
    assert text in str(info.value)
    assert "mail_outbox" not in app.extensions


def test_tls_and_ssl_together_are_refused(tmp_path: Path) -> None:
    app = bare_app(tmp_path, MAIL_USE_TLS=True, MAIL_USE_SSL=True)
    with pytest.raises(ConfigError, match="MAIL_USE_TLS"):
        OutboxMail(app)


@pytest.mark.parametrize("uri", ["sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?cache=shared&uri=true"])
def test_in_memory_sqlite_is_refused(uri: str) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = uri
    SQLAlchemy(app)
    with pytest.raises(ConfigError, match="SQLALCHEMY_DATABASE_URI"):
        OutboxMail(app)


def test_second_registration_raises_with_the_fix(tmp_path: Path) -> None:
    app = bare_app(tmp_path)
    OutboxMail(app)
    with pytest.raises(RuntimeError, match="init_app"):
        OutboxMail(app)


# Flask-Migrate (and Alembic, which comes with it) is the `migrate` extra only: a
# module of None in sys.modules makes its import fail, as if it were not installed.
WITHOUT_MIGRATE = textwrap.dedent("""
    import pkgutil, sys
    sys.modules["flask_migrate"] = sys.modules["alembic"] = None

    import flask_mail_outbox
    for module in pkgutil.walk_packages(flask_mail_outbox.__path__, "flask_mail_outbox."):
        __import__(module.name)  # every module but the Alembic revisions (not a package)

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from flask_mail_outbox import Message, OutboxMail

    app = Flask(__name__)
    app.config.update(TESTING=True, SQLALCHEMY_DATABASE_URI=sys.argv[1],
                      MAIL_DEFAULT_SENDER="sender@example.com")
    db = SQLAlchemy(app)
    mail = OutboxMail(app)
    with app.app_context(), mail.record_messages() as outbox:
        mail.create_all()
        mail.send(Message("Welcome", recipients=["ann@example.com"], body="Hi!"))
        db.session.commit()
    mail.stop()
    print([m.subject for m in outbox])
""")


def test_the_library_needs_no_flask_migrate(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", WITHOUT_MIGRATE, f"sqlite:///{tmp_path / 'x.db'}"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['Welcome']"


def test_missing_sqlalchemy_says_what_to_do() -> None:
    app = Flask(__name__)
    with pytest.raises(RuntimeError, match="SQLAlchemy"):
        OutboxMail(app)


def test_factory_pattern_and_explicit_db(tmp_path: Path) -> None:
    mail = OutboxMail()
    apps = []
    for name in ("one", "two"):
        app = Flask(name)
        app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / name}.db"
        db = SQLAlchemy()
        db.init_app(app)
        mail.init_app(app, db=db)
        apps.append(app)
        assert app.extensions["mail_outbox"].db is db
        assert app.extensions["mail_outbox"].ext is mail
    assert apps[0].extensions["mail_outbox"] is not apps[1].extensions["mail_outbox"]


def test_suppress_send_follows_testing(tmp_path: Path) -> None:
    app = bare_app(tmp_path, TESTING=True)
    OutboxMail(app)
    assert app.extensions["mail_outbox"].config.suppress_send is True
    app2 = bare_app(tmp_path / "b" if (tmp_path / "b").mkdir() is None else tmp_path)
    OutboxMail(app2)
    assert app2.extensions["mail_outbox"].config.suppress_send is False


def test_sqlite_database_is_switched_to_wal(tmp_path: Path) -> None:
    import sqlite3
    app = bare_app(tmp_path)
    OutboxMail(app)  # opens no connection: the app engine's first one sets WAL
    with app.app_context():
        app.extensions["sqlalchemy"].engine.connect().close()
    with sqlite3.connect(tmp_path / "x.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
