"""Named transports (``OUTBOX_TRANSPORTS``) and failover, over real SMTP servers.

Each email goes through the transport ``send(transport=...)`` named (stored on
the row), each transport opens its own connections, and an unknown name is an
``InvalidMessage`` at ``send()``. A transport fault (refused connection, 421,
a failed login or TLS handshake, a timeout) moves the attempt to the next
transport of the entry's ``failover`` list and is written to the error
history; a 5xx, a per-recipient refusal or greylisting never fails over.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import close_app, db, free_port, make_app, rows, wait_rows
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core._config import load_config


@pytest.fixture
def bulk_server() -> Iterator[FaultSMTPServer]:
    """A second real SMTP server: the "bulk" (or "backup") transport's."""
    with FaultSMTPServer() as server:
        yield server


def _entry(server: FaultSMTPServer, **extra: Any) -> dict[str, Any]:
    return {"transport": "smtp", "MAIL_SERVER": server.host, "MAIL_PORT": server.port,
            **extra}


def _send(app: Flask, subject: str, recipients: list[str] | None = None,
          **options: Any) -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        email_id = mail.send(Message(subject, recipients=recipients or ["a@example.com"],
                                     body="x"), **options)
        db.session.commit()
    return int(email_id)


def _finished(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda current: len(current) == count and all(
        r["status"] in ("sent", "failed") for r in current)


# -- routing ---------------------------------------------------------------------------


@pytest.mark.parametrize("durable", [False, True], ids=["inline", "durable"])
def test_each_email_goes_through_the_transport_it_names(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer,
        durable: bool) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=durable, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_TRANSPORTS={"bulk": _entry(bulk_server)})
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        plain = [_send(app, f"plain {i}") for i in range(3)]
        named_default = _send(app, "named default", transport="default")
        bulk = [_send(app, f"bulk {i}", transport="bulk") for i in range(2)]
        with app.app_context():
            bulk += mail.send_many([Message(f"many {i}", recipients=["b@example.com"],
                                            body="x") for i in range(3)], transport="bulk")
            db.session.commit()
        current = wait_rows(app, _finished(9), timeout=20)
        assert smtp_server.wait_for(4) and bulk_server.wait_for(5)
        by_id = {r["id"]: r for r in current}
        assert {by_id[i]["transport"] for i in [*plain, named_default]} == {"default"}
        assert {by_id[i]["transport"] for i in bulk} == {"bulk"}
        assert {r["status"] for r in current} == {"sent"}
        assert sorted(smtp_server.message_ids()) == sorted(
            by_id[i]["message_id"] for i in [*plain, named_default])
        assert sorted(bulk_server.message_ids()) == sorted(by_id[i]["message_id"] for i in bulk)
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize("name", ["bulk", "", 7, "Default"])
def test_an_unknown_transport_is_refused_at_send_and_nothing_is_written(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer,
        name: Any) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_TRANSPORTS={"news": _entry(bulk_server)})
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            with pytest.raises(InvalidMessage) as excinfo:
                mail.send(Message("x", recipients=["a@example.com"], body="x"), transport=name)
            assert excinfo.value.field == "transport"
            assert "default, news" in str(excinfo.value)
            with pytest.raises(InvalidMessage) as many:
                mail.send_many([Message("x", recipients=["a@example.com"], body="x")],
                               transport=name)
            assert many.value.field == "transport"
            db.session.commit()
        assert rows(app) == []
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize("durable", [False, True], ids=["inline", "durable"])
def test_each_transport_opens_its_own_connections(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer,
        durable: bool) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=durable, OUTBOX_LISTEN=False, OUTBOX_CONCURRENCY=3,
                   OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_TRANSPORTS={"bulk": _entry(bulk_server, concurrency=1)})
    smtp_server.hold()
    bulk_server.hold()
    try:
        for i in range(6):
            _send(app, f"plain {i}")
            _send(app, f"bulk {i}", transport="bulk")
        assert smtp_server.wait_held(3) and bulk_server.wait_held(1)
        # Held for a moment longer: no fourth default connection, no second bulk one.
        assert not smtp_server.wait_held(4, timeout=0.5)
        assert not bulk_server.wait_held(2, timeout=0.1)
        assert (smtp_server.active_connections, bulk_server.active_connections) == (3, 1)
        smtp_server.release()
        bulk_server.release()
        wait_rows(app, _finished(12), timeout=20)
        assert (len(smtp_server.messages), len(bulk_server.messages)) == (6, 6)
        assert smtp_server.max_concurrent_connections == 3
        assert bulk_server.max_concurrent_connections == 1
    finally:
        smtp_server.release()
        bulk_server.release()
        close_app(app, timeout=5)


# -- configuration ---------------------------------------------------------------------


BAD_ENTRIES: list[tuple[dict[str, Any], str, str]] = [
    ({"bulk": {"MAIL_SERVR": "x"}}, 'OUTBOX_TRANSPORTS["bulk"]["MAIL_SERVR"]', "unknown"),
    ({"bulk": "smtp.example.com"}, 'OUTBOX_TRANSPORTS["bulk"]', "dict"),
    ({"bulk": {"transport": "pigeon"}}, 'OUTBOX_TRANSPORTS["bulk"]["transport"]',
     "neither"),
    ({"bulk": {"MAIL_PORT": 70000}}, 'OUTBOX_TRANSPORTS["bulk"]["MAIL_PORT"]', "65535"),
    ({"bulk": {"MAIL_USE_TLS": True, "MAIL_USE_SSL": True}},
     'OUTBOX_TRANSPORTS["bulk"]["MAIL_USE_TLS"]', "exclusive"),
    ({"bulk": {"MAIL_PASSWORD": ""}}, 'OUTBOX_TRANSPORTS["bulk"]["MAIL_PASSWORD"]',
     "non-empty"),
    ({"bulk": {"rate_limit": "14 per second"}}, 'OUTBOX_TRANSPORTS["bulk"]["rate_limit"]',
     "'14/s'"),
    ({"bulk": {"rate_limit": "0/s"}}, 'OUTBOX_TRANSPORTS["bulk"]["rate_limit"]', "more than 0"),
    ({"bulk": {"rate_limit": -3}}, 'OUTBOX_TRANSPORTS["bulk"]["rate_limit"]', "positive"),
    ({"bulk": {"concurrency": 0}}, 'OUTBOX_TRANSPORTS["bulk"]["concurrency"]', "at least 1"),
    ({"bulk": {"concurrency": 999}}, 'OUTBOX_TRANSPORTS["bulk"]["concurrency"]', "at most"),
    ({"bulk": {"failover": "backup"}}, 'OUTBOX_TRANSPORTS["bulk"]["failover"]', "list"),
    ({"bulk": {"failover": ["backup"]}}, 'OUTBOX_TRANSPORTS["bulk"]["failover"]',
     "not a transport"),
    ({"bulk": {"failover": ["bulk"]}}, 'OUTBOX_TRANSPORTS["bulk"]["failover"]', "itself"),
    ({"x" * 65: {}}, "OUTBOX_TRANSPORTS", "64 characters"),
    ({}, "OUTBOX_TRANSPORTS", "dict"),
]


@pytest.mark.parametrize(("transports", "key", "problem"), BAD_ENTRIES,
                         ids=[key.replace("OUTBOX_TRANSPORTS", "") or "top"
                              + f"-{i}" for i, (_, key, _) in enumerate(BAD_ENTRIES)])
def test_a_bad_entry_fails_at_init_naming_the_entry_and_its_setting(
        tmp_path: Any, transports: dict[str, Any], key: str, problem: str) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      OUTBOX_TRANSPORTS=transports)
    SQLAlchemy(app)
    with pytest.raises(ConfigError) as excinfo:
        OutboxMail(app)
    assert excinfo.value.key == key
    assert problem in excinfo.value.problem
    assert "mail_outbox" not in app.extensions


def test_an_entry_never_inherits_the_apps_login_and_outbox_rate_limit_is_the_default_rate(
        ) -> None:
    config = load_config({
        "MAIL_SERVER": "smtp.one.example", "MAIL_USERNAME": "one", "MAIL_PASSWORD": "secret",
        "MAIL_USE_TLS": True, "OUTBOX_RATE_LIMIT": 14, "OUTBOX_CONCURRENCY": 6,
        "OUTBOX_TRANSPORTS": {"two": {"MAIL_SERVER": "smtp.two.example",
                                      "rate_limit": "600/min", "failover": ["default"]}},
    }, instance_path="/tmp", testing=False)
    default, two = config.transport_specs
    assert (default.name, default.smtp.username, default.smtp.password) == (
        "default", "one", "secret")
    assert str(default.rate) == "14/s" and default.rate.per_second == 14
    assert (two.smtp.host, two.smtp.username, two.smtp.password, two.smtp.use_tls) == (
        "smtp.two.example", None, None, False)
    assert (str(two.rate), two.rate.per_second, two.failover) == ("600/min", 10, ("default",))
    assert "secret" not in repr(config.transport_specs)


# -- failover ----------------------------------------------------------------------------

#: name -> (what to do to the primary, extra app config): each a transport fault.
Fault = Callable[[FaultSMTPServer], dict[str, Any]]


def _refused(primary: FaultSMTPServer) -> dict[str, Any]:
    return {"MAIL_PORT": free_port()}  # nothing listens there


def _closing_421(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.reply("connect", 421, "4.3.2 Service shutting down")
    return {}


def _421_at_mail(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.reply("mail", 421, "4.3.0 Temporary system problem, closing")
    return {}


def _bad_login(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.require_auth("outbox", "right")
    return {"MAIL_USERNAME": "outbox", "MAIL_PASSWORD": "wrong"}


def _no_starttls(primary: FaultSMTPServer) -> dict[str, Any]:
    return {"MAIL_USE_TLS": True}  # the server offers no STARTTLS: the handshake fails


def _timeout(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.delay("mail", 4.0)
    return {"MAIL_TIMEOUT": 1.0}


TRANSPORT_FAULTS: dict[str, Fault] = {
    "refused": _refused, "421-greeting": _closing_421, "421-at-mail": _421_at_mail,
    "login": _bad_login, "tls": _no_starttls, "timeout": _timeout,
}


def _failover_app(db_url: str, primary: FaultSMTPServer, backup: FaultSMTPServer,
                  **primary_config: Any) -> Flask:
    config: dict[str, Any] = {"MAIL_SERVER": primary.host, "MAIL_PORT": primary.port,
                              "MAIL_TIMEOUT": 5.0}
    config.update(primary_config)
    return make_app(db_url, OUTBOX_INLINE_RETRIES=0, OUTBOX_TRANSPORTS={
        "default": {"transport": "smtp", **config, "failover": ["backup"]},
        "backup": _entry(backup)})


@pytest.mark.parametrize("fault", list(TRANSPORT_FAULTS), ids=list(TRANSPORT_FAULTS))
def test_a_transport_fault_fails_over_and_is_written_to_the_history(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer,
        fault: str) -> None:
    app = _failover_app(db_url, smtp_server, bulk_server, **TRANSPORT_FAULTS[fault](smtp_server))
    try:
        email_id = _send(app, "failing over")
        [row] = wait_rows(app, _finished(1), timeout=20)
        assert row["id"] == email_id
        assert (row["status"], row["attempts"], row["transport"]) == ("sent", 1, "default")
        assert bulk_server.message_ids() == [row["message_id"]]
        assert smtp_server.messages == []
        [step] = json.loads(row["error_history"])
        assert (step["transport"], step["failed_over_to"], step["attempt"]) == (
            "default", "backup", 1)
        assert step["message"]
        assert row["last_error"] is None
    finally:
        close_app(app, timeout=5)


def _permanent(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.reply("data", 550, "5.7.1 Message rejected as spam")
    return {}


def _greylisted(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.reply("rcpt", 451, "4.7.1 Greylisted, please try again later")
    return {}


def _busy_mailbox(primary: FaultSMTPServer) -> dict[str, Any]:
    primary.reply("data", 452, "4.2.2 Mailbox full")
    return {}


MESSAGE_FAULTS: dict[str, tuple[Fault, str]] = {
    "550": (_permanent, "failed"), "greylisted": (_greylisted, "queued"),
    "452-at-data": (_busy_mailbox, "queued"),
}


@pytest.mark.parametrize("fault", list(MESSAGE_FAULTS), ids=list(MESSAGE_FAULTS))
def test_a_refusal_of_the_message_never_fails_over(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer,
        fault: str) -> None:
    setup, status = MESSAGE_FAULTS[fault]
    app = _failover_app(db_url, smtp_server, bulk_server, **setup(smtp_server))
    try:
        _send(app, "refused as it is")
        [row] = wait_rows(app, lambda current: len(current) == 1 and current[0]["attempts"] == 1
                          and current[0]["status"] == status and current[0]["last_error"],
                          timeout=20)
        assert bulk_server.messages == [] and bulk_server.connections == 0
        history = json.loads(row["error_history"])
        assert len(history) == 1 and "failed_over_to" not in history[0]
    finally:
        close_app(app, timeout=5)


def test_a_partial_refusal_is_sent_and_never_fails_over(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("gone@example.com")
    app = _failover_app(db_url, smtp_server, bulk_server)
    try:
        _send(app, "some refused", recipients=["here@example.com", "gone@example.com"])
        [row] = wait_rows(app, _finished(1), timeout=20)
        assert row["status"] == "sent"
        assert "gone@example.com" in row["last_error"]
        assert [m.rcpt_tos for m in smtp_server.messages] == [["here@example.com"]]
        assert bulk_server.messages == [] and bulk_server.connections == 0
    finally:
        close_app(app, timeout=5)


def test_when_every_transport_of_the_chain_is_down_the_attempt_counts_once(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer) -> None:
    smtp_server.reply("connect", 421, "4.3.2 Service shutting down")
    bulk_server.reply("connect", 421, "4.3.2 Backup shutting down too")
    app = _failover_app(db_url, smtp_server, bulk_server)
    try:
        _send(app, "nowhere to go")
        [row] = wait_rows(app, lambda current: len(current) == 1 and current[0]["last_error"],
                          timeout=20)
        assert (row["status"], row["attempts"]) == ("queued", 1)
        assert "Backup shutting down" in row["last_error"]
        first, last = json.loads(row["error_history"])
        assert (first["transport"], first["failed_over_to"]) == ("default", "backup")
        assert "Service shutting down" in first["message"]
        assert "failed_over_to" not in last and "Backup shutting down" in last["message"]
    finally:
        close_app(app, timeout=5)


def test_the_dashboard_shows_the_transport_the_priority_and_the_failover(
        db_url: str, smtp_server: FaultSMTPServer, bulk_server: FaultSMTPServer) -> None:
    smtp_server.reply("connect", 421, "4.3.2 Service shutting down")
    app = _failover_app(db_url, smtp_server, bulk_server)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix="/outbox")
        email_id = _send(app, "shown", priority="high")
        wait_rows(app, _finished(1), timeout=20)
        page = app.test_client().get(f"/outbox/emails/{email_id}").get_data(as_text=True)
        assert ('<dt>Transport</dt><dd>default <span class="muted">(smtp)</span></dd>'
                in page)
        assert "<dt>Priority</dt><dd>high</dd>" in page
        # The backup's SMTP server gave the message its queue id: shown as the provider's.
        (received,) = bulk_server.messages
        assert f"<dt>Provider id</dt><dd><code>{received.queue_id}</code></dd>" in page
        assert "Service shutting down" in page
        assert "(default failed; sent on through backup)" in page
    finally:
        close_app(app, timeout=5)
