"""The suppression list: who is on it, and what delivery does about it.

Delivery checks the list per recipient, in one query per claimed batch: a
suppressed recipient is left out of the envelope (and a ``rejected`` event
says so), an email with no recipient left ends ``suppressed`` without
contacting the server, and ``unsubscribed`` applies to bulk mail only. A
permanent bounce, a complaint, an unsubscribe, and an SMTP refusal of an
unknown recipient (5.1.1, 5.1.2, 5.1.10) put an address on the list.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import db, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import (
    DeliveryEvent,
    InvalidMessage,
    Message,
    OutboxMail,
    Suppression,
    email_event,
)
from flask_mail_outbox.core import suppression_table
from flask_mail_outbox.core._suppression import suppression_key

NEWSLETTER_URL = "https://app.example.com/unsubscribe/abc"


def send(app: Flask, mail: OutboxMail, recipients: list[Any], **kwargs: Any) -> int:
    with app.app_context():
        email_id = mail.send(Message("Hello", recipients, "Hi", **kwargs))
        db.session.commit()
    return email_id


def finished(app: Flask, email_id: int) -> dict[str, Any]:
    row = wait_rows(app, lambda r: any(x["id"] == email_id and x["status"] not in
                                       ("queued", "sending") for x in r), timeout=15)
    return next(x for x in row if x["id"] == email_id)


# -- the key -------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "key"), [
    ("Bob@Example.COM", "bob@example.com"),
    ("  bob@example.com ", "bob@example.com"),
    ("user@BÜCHER.example", "user@xn--bcher-kva.example"),
])
def test_addresses_are_keyed_as_send_stores_them_without_case(given: str, key: str) -> None:
    assert suppression_key(given) == key


@pytest.mark.parametrize("bad", ["", "no-at-sign", "a@", "two@@example.com", 42])
def test_a_bad_address_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(InvalidMessage) as caught:
        suppression_key(bad)
    assert caught.value.field == "address"


# -- the list itself -------------------------------------------------------------------------


def test_suppress_unsuppress_and_read_back(app: Flask, mail: OutboxMail) -> None:
    with app.app_context():
        assert mail.suppression("a@example.com") is None
        assert mail.suppress("A@Example.com") is True
        assert mail.suppress("a@example.com", "complained") is False  # replaced
        entry = mail.suppression("a@EXAMPLE.com")
        assert isinstance(entry, Suppression)
        assert (entry.address, entry.reason, entry.source) == ("a@example.com", "complained",
                                                               "manual")
        assert mail.unsuppress("a@example.com") is True
        assert mail.unsuppress("a@example.com") is False
        assert mail.suppression("a@example.com") is None


def test_bad_input_writes_nothing(app: Flask, mail: OutboxMail) -> None:
    with app.app_context():
        with pytest.raises(InvalidMessage, match="reason"):
            mail.suppress("a@example.com", "spam")
        with pytest.raises(InvalidMessage, match="address"):
            mail.suppress("not an address")
        with pytest.raises(InvalidMessage, match="expires_at"):
            mail.suppress("a@example.com", expires_at="tomorrow")  # type: ignore[arg-type]
        with db.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(
                suppression_table)).scalar() == 0


def test_an_expired_entry_no_longer_applies(app: Flask, mail: OutboxMail,
                                            smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.suppress("gone@example.com", expires_at=datetime.now(UTC) - timedelta(seconds=1))
        assert mail.suppression("gone@example.com") is None
    email_id = send(app, mail, ["gone@example.com"])
    assert finished(app, email_id)["status"] == "sent"
    assert smtp_server.messages[-1].rcpt_tos == ["gone@example.com"]


def test_an_entry_that_lapses_between_two_screens_no_longer_applies(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    # The screen's SELECT is built once per process; "now" must still be now at each read
    # (the caller's clock on SQLite, the database's on PostgreSQL).
    with app.app_context():
        mail.suppress("soon@example.com", expires_at=datetime.now(UTC) + timedelta(seconds=2))
    first = send(app, mail, ["soon@example.com"])
    assert finished(app, first)["status"] == "suppressed"
    with app.app_context():
        while mail.suppression("soon@example.com") is not None:
            time.sleep(0.1)
    second = send(app, mail, ["soon@example.com"])
    assert finished(app, second)["status"] == "sent"
    assert [m.rcpt_tos for m in smtp_server.messages] == [["soon@example.com"]]


def test_the_screen_builds_its_select_once(app: Flask, mail: OutboxMail) -> None:
    # Building it took more client CPU than running it, at every claim (issue 41).
    suppressions = mail._state().outbox().suppressions
    with app.app_context():
        mail.suppress("a@example.com")
    with suppressions.store.read() as conn:
        assert suppressions._lookup(conn, ["a@example.com", "b@example.com"]) == {
            "a@example.com": "manual"}
        first = suppressions._in_force_statement()[0]
        assert suppressions._lookup(conn, ["b@example.com"]) == {}
    assert suppressions._in_force_statement()[0] is first


# -- delivery ------------------------------------------------------------------------------


def test_an_email_to_suppressed_recipients_only_ends_suppressed_unsent(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.suppress("bounced@example.com", "bounced")
    heard: list[DeliveryEvent] = []

    def on_event(sender: Flask, event: DeliveryEvent, **_: Any) -> None:
        heard.append(event)

    with email_event.connected_to(on_event, app):
        email_id = send(app, mail, ["Bounced@example.com"])
        row = finished(app, email_id)
        with app.app_context():
            mail.wait_idle(5)
    assert row["status"] == "suppressed"
    assert row["attempts"] == 0  # nothing was attempted
    assert "suppression list" in row["last_error"]
    assert smtp_server.messages == []
    with app.app_context():
        (event,) = mail.events(email_id)
    assert (event.event_type, event.recipient, event.email_id) == (
        "rejected", "Bounced@example.com", email_id)
    assert "bounced" in event.description
    assert [e.id for e in heard] == [event.id]


def test_a_suppressed_recipient_is_left_out_of_the_envelope(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.suppress("complainer@example.com", "complained")
    email_id = send(app, mail, ["ok@example.com"], cc=["complainer@example.com"])
    assert finished(app, email_id)["status"] == "sent"
    (received,) = smtp_server.messages
    assert received.rcpt_tos == ["ok@example.com"]
    # The headers are what send() stored: the envelope is what changes.
    assert "complainer@example.com" in received.parsed["Cc"]
    with app.app_context():
        assert [(e.event_type, e.recipient) for e in mail.events(email_id)] == [
            ("rejected", "complainer@example.com")]


def test_unsubscribed_applies_to_bulk_mail_only(app: Flask, mail: OutboxMail,
                                                smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.suppress("reader@example.com", "unsubscribed")
    reset = send(app, mail, ["reader@example.com"])
    news = send(app, mail, ["reader@example.com"], list_unsubscribe=NEWSLETTER_URL)
    assert finished(app, reset)["status"] == "sent"
    assert finished(app, news)["status"] == "suppressed"
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["Hello"]
    assert "List-Unsubscribe" not in smtp_server.messages[0].parsed


def test_an_unknown_recipient_refused_at_rcpt_is_suppressed(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("nobody@example.com", 550, "5.1.1 <nobody@example.com>: "
                                 "Recipient address rejected: User unknown")
    smtp_server.refuse_recipient("full@example.com", 552, "5.2.2 Mailbox full")
    email_id = send(app, mail, ["ok@example.com", "nobody@example.com", "full@example.com"])
    assert finished(app, email_id)["status"] == "sent"
    with app.app_context():
        entry = mail.suppression("nobody@example.com")
        assert entry is not None and entry.reason == "bounced"
        assert entry.source == "smtp refusal"
        assert mail.suppression("full@example.com") is None  # 5.2.2 is not "unknown"
        (event,) = mail.events(email_id)
    assert (event.event_type, event.bounce_kind, event.recipient) == (
        "bounced", "permanent", "nobody@example.com")
    assert event.mta_response.startswith("550 5.1.1")
    # The next email to that address is not sent at all.
    again = send(app, mail, ["nobody@example.com"])
    assert finished(app, again)["status"] == "suppressed"
    assert len(smtp_server.messages) == 1


def test_every_recipient_refused_as_unknown_suppresses_each(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    for address in ("x@example.com", "y@example.com"):
        smtp_server.refuse_recipient(address, 550, "5.1.2 Domain not found")
    email_id = send(app, mail, ["x@example.com", "y@example.com"])
    assert finished(app, email_id)["status"] == "failed"
    with app.app_context():
        assert {e.recipient for e in mail.events(email_id)} == {"x@example.com",
                                                                "y@example.com"}
        assert mail.suppression("x@example.com") is not None
        assert mail.suppression("y@example.com") is not None


def test_a_list_that_cannot_be_read_gives_the_rows_back(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_suppression RENAME TO outbox_suppression_x"))
    try:
        with caplog.at_level(logging.ERROR):
            email_id = send(app, mail, ["ok@example.com"])
            with app.app_context():
                mail.wait_idle(5)
        row = next(r for r in rows(app) if r["id"] == email_id)
        assert row["status"] == "queued"
        assert row["attempts"] == 0
        assert smtp_server.messages == []
        assert any("suppression list" in r.getMessage() and r.levelno == logging.ERROR
                   for r in caplog.records)
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text(
                "ALTER TABLE outbox_suppression_x RENAME TO outbox_suppression"))


# -- events that suppress ------------------------------------------------------------------


@pytest.mark.parametrize(("event", "reason"), [
    ({"event_type": "bounced", "bounce_kind": "permanent", "reason": "user_unknown"}, "bounced"),
    ({"event_type": "bounced", "bounce_kind": "permanent", "mta_response": "550 5.1.1 no"},
     "bounced"),
    # The policy: a permanent bounce that does not say the address is dead is soft.
    ({"event_type": "bounced", "bounce_kind": "permanent", "reason": "spam"}, None),
    ({"event_type": "bounced", "bounce_kind": "permanent"}, None),
    ({"event_type": "bounced", "bounce_kind": "transient", "reason": "user_unknown"}, None),
    ({"event_type": "bounced", "bounce_kind": "transient"}, None),
    ({"event_type": "complained"}, "complained"),
    ({"event_type": "unsubscribed"}, "unsubscribed"),
    ({"event_type": "deferred"}, None),
    ({"event_type": "delivered"}, None),
])
def test_which_events_suppress(app: Flask, mail: OutboxMail, event: dict[str, Any],
                               reason: str | None) -> None:
    with app.app_context():
        fields = dict(event)
        mail.record_event(fields.pop("event_type"), recipient="R@example.com", **fields)
        entry = mail.suppression("r@example.com")
    assert (entry.reason if entry else None) == reason


def test_an_unsubscribe_never_narrows_a_complaint(app: Flask, mail: OutboxMail) -> None:
    with app.app_context():
        mail.record_event("complained", recipient="r@example.com", transport="sg",
                          provider_event_id="1")
        mail.record_event("unsubscribed", recipient="r@example.com", transport="sg",
                          provider_event_id="2")
        entry = mail.suppression("r@example.com")
        assert entry is not None and entry.reason == "complained"
        # A person's own change is taken as given.
        mail.suppress("r@example.com", "unsubscribed")
        entry = mail.suppression("r@example.com")
        assert entry is not None and entry.reason == "unsubscribed"


# -- the CLI -------------------------------------------------------------------------------


def test_cli_add_list_export_remove(app: Flask, tmp_path: Any) -> None:
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "suppression", "list"])
    assert result.exit_code == 0 and "empty" in result.output
    result = runner.invoke(args=["outbox", "suppression", "add", "Ann@Example.com"])
    assert result.exit_code == 0, result.output
    assert "suppressed (manual): Ann@Example.com" in result.output
    result = runner.invoke(args=["outbox", "suppression", "add", "bob@example.com",
                                 "--reason", "unsubscribed"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(args=["outbox", "suppression", "list"])
    lines = result.output.splitlines()
    assert lines[0].split() == ["address", "reason", "since", "source"]
    assert [line.split()[:2] for line in lines[1:]] == [["ann@example.com", "manual"],
                                                        ["bob@example.com", "unsubscribed"]]
    out = tmp_path / "suppressed.csv"
    result = runner.invoke(args=["outbox", "suppression", "export", "-o", str(out)])
    assert result.exit_code == 0, result.output
    exported = out.read_text(encoding="utf-8").splitlines()
    assert exported[0] == "address,reason,source,created_at,expires_at"
    assert [row.split(",")[:3] for row in exported[1:]] == [
        ["ann@example.com", "manual", "cli"], ["bob@example.com", "unsubscribed", "cli"]]
    result = runner.invoke(args=["outbox", "suppression", "remove", "ann@example.com"])
    assert result.exit_code == 0 and "removed" in result.output
    result = runner.invoke(args=["outbox", "suppression", "remove", "ann@example.com"])
    assert result.exit_code == 1
    assert "not on the suppression list" in result.output


def test_cli_refuses_a_bad_address_and_writes_nothing(app: Flask) -> None:
    runner = app.test_cli_runner()
    result = runner.invoke(args=["outbox", "suppression", "add", "not-an-address"])
    assert result.exit_code == 2
    assert "ADDRESS" in result.output
    result = runner.invoke(args=["outbox", "suppression", "add", "a@example.com",
                                 "--reason", "spam"])
    assert result.exit_code == 2
    assert "empty" in runner.invoke(args=["outbox", "suppression", "list"]).output


# -- record_event's input ----------------------------------------------------------------


@pytest.mark.parametrize(("fields", "field"), [
    ({"event_type": "exploded"}, "event_type"),
    ({"event_type": "bounced"}, "bounce_kind"),
    ({"event_type": "bounced", "bounce_kind": "soft"}, "bounce_kind"),
    ({"event_type": "delivered", "bounce_kind": "permanent"}, "bounce_kind"),
    ({"event_type": "delivered", "recipient": 42}, "recipient"),
    ({"event_type": "delivered", "recipient": "a" * 321}, "recipient"),
    ({"event_type": "delivered", "email_id": "7"}, "email_id"),
    ({"event_type": "delivered", "occurred_at": "yesterday"}, "occurred_at"),
    ({"event_type": "delivered", "transport": "t" * 65}, "transport"),
    ({"event_type": "delivered", "provider_event_id": 5}, "provider_event_id"),
    ({"event_type": "delivered", "description": None}, "description"),
])
def test_record_event_refuses_bad_fields_and_writes_nothing(
        app: Flask, mail: OutboxMail, fields: dict[str, Any], field: str) -> None:
    fields = dict(fields)
    with app.app_context():
        kind = fields.pop("event_type")
        with pytest.raises(InvalidMessage) as caught:
            mail.record_event(kind, **fields)
        assert caught.value.field == field
        with db.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox_event")).scalar() == 0


def test_record_event_matches_by_message_id_and_ignores_a_resend(
        app: Flask, mail: OutboxMail) -> None:
    email_id = send(app, mail, ["a@example.com"])
    finished(app, email_id)
    message_id = next(r for r in rows(app) if r["id"] == email_id)["message_id"]
    with app.app_context():
        event = mail.record_event("opened", message_id=f"<{message_id}>", transport="relay",
                                  provider_event_id="e1", payload={"ip": "192.0.2.1"})
        assert event is not None and event.email_id == email_id
        assert event.payload == '{"ip":"192.0.2.1"}'
        assert mail.record_event("opened", message_id=message_id, transport="relay",
                                 provider_event_id="e1") is None
        assert [e.event_type for e in mail.events(email_id)] == ["opened"]
        with pytest.raises(TypeError):
            mail.events("1")  # type: ignore[arg-type]
