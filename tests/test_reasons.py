"""Why mail failed (``flask_mail_outbox._reasons``): one vocabulary for every source.

Table tests per source (DSN Status and Diagnostic-Code, the text of non-DSN
bounces, SMTP replies, API errors, each provider's bounce types); a fuzz test
that no mapping raises and each is linear on long hostile text; the event's
``reason`` checked at the boundary; the documented table checked against the
module's; and end to end on SQLite and PostgreSQL: a real bounce through
``mail.process_bounce()`` and an SMTP 550 5.1.1 from the test server store their
reason, which ``mail.events()`` returns and the dashboard shows. (A provider's
webhook through its route: tests/test_webhook_routes.py.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, wait_rows
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smtpserver import FaultSMTPServer

from flask_mail_outbox import DeliveryEvent, InvalidMessage, Message, OutboxMail
from flask_mail_outbox._bounces import read_bounce
from flask_mail_outbox._reasons import (
    MAILGUN_REASONS,
    POSTMARK_TYPES,
    REASONS,
    RESEND_SUBTYPES,
    SENDGRID_CLASSES,
    SES_SUBTYPES,
    SISIMAI,
    STATUS_CODES,
    api_reason,
    bounce_reason,
    dsn_reason,
    mailgun_reason,
    postmark_reason,
    resend_reason,
    sendgrid_reason,
    ses_reason,
    smtp_reason,
    text_reason,
)
from flask_mail_outbox.core import event_table

SAMPLES = Path(__file__).parent / "bounces"
DOCS = Path(__file__).parent.parent / "docs" / "events.md"


# -- DSN Status and Diagnostic-Code --------------------------------------------------------

@pytest.mark.parametrize(("status", "diagnostic", "reason"), [
    ("5.1.1", "smtp; 550 5.1.1 <a@example.com>... User unknown", "user_unknown"),
    ("5.1.1", "smtp; 550 mailbox full", "user_unknown"),  # a specific code decides
    ("5.1.2", "", "host_unknown"),
    ("5.4.4", "smtp; 550 5.4.4 unable to route", "host_unknown"),
    ("5.1.10", "", "not_accepting"),
    ("5.1.6", "", "has_moved"),
    ("5.2.1", "", "suspended"),
    ("5.2.2", "", "mailbox_full"),
    ("4.2.2", "", "mailbox_full"),
    ("5.2.3", "", "message_too_big"),
    ("5.3.4", "smtp; 552 5.3.4 Message size exceeds fixed limit", "message_too_big"),
    ("5.4.7", "", "expired"),
    ("4.4.1", "connect to mx[192.0.2.1]:25: Connection refused", "network_error"),
    ("5.6.0", "", "content"),
    ("5.7.1", "smtp; 550 5.7.1 Message rejected as spam", "spam"),
    ("5.7.1", "smtp; 554 5.7.1 Relay access denied", "relaying_denied"),
    ("5.7.1", "smtp; 550 5.7.1 Service unavailable; client host blocked using Spamhaus",
     "blocked"),
    ("5.7.1", "smtp; 550 5.7.1 Virus found in the message", "virus"),
    ("5.7.1", "smtp; 550 5.7.1 Message refused", "policy"),
    ("5.7.1", "", "policy"),
    ("5.7.26", "smtp; 550 5.7.26 Unauthenticated email from example.com", "authentication"),
    ("5.7.23", "", "authentication"),
    ("5.7.25", "", "blocked"),
    ("5.7.28", "", "rate_limited"),
    ("5.7.0", "smtp; 550 5.7.0 Message failed DMARC policy", "authentication"),
    ("5.0.0", "smtp; 550 Requested action not taken: mailbox full", "mailbox_full"),
    ("5.0.0", "smtp; 550 No such user here", "user_unknown"),
    ("5.0.0", "smtp; 550 Host unknown", "host_unknown"),
    ("5.0.0", "smtp; 550 Account suspended", "suspended"),
    ("5.0.0", "smtp; 452 over quota", "mailbox_full"),
    ("5.0.0", "smtp; 421 Too many connections, slow down", "rate_limited"),
    ("5.0.0", "", "undefined"),
    ("", "smtp; 550 5.1.1 No such user", "user_unknown"),  # no Status: the code in the text
    ("", "", "undefined"),
    ("9.9.9", "garbage", "undefined"),
])
def test_dsn_status_and_diagnostic(status: str, diagnostic: str, reason: str) -> None:
    assert dsn_reason(status, diagnostic) == reason


@pytest.mark.parametrize(("status", "diagnostic", "failed", "reason"), [
    ("4.4.1", "Connection refused", True, "expired"),  # Postfix gave up on a 4.x.x
    ("4.4.1", "Connection refused", False, "network_error"),  # still being retried
    ("5.1.1", "", True, "user_unknown"),
    ("", "4.2.2 mailbox full", True, "expired"),
])
def test_a_failure_after_transient_replies_is_expired(status: str, diagnostic: str,
                                                      failed: bool, reason: str) -> None:
    assert bounce_reason(status, diagnostic, failed=failed) == reason


# -- the bounce samples, read -------------------------------------------------------------

@pytest.mark.parametrize(("name", "reasons"), [
    ("exchange2010-5.1.1.eml", ["user_unknown"]),
    ("exim-dsn-gmail-5.7.1.eml", ["spam"]),
    ("exim-text-2.05.eml", ["user_unknown"]),  # not a DSN: the 5.1.1 in its text
    ("gmail-delay-warning-2008.eml", ["undefined"]),
    ("gmail-text-failure-2006.eml", ["undefined"]),
    ("mimecast-office365-4.4.4.eml", ["expired"]),
    ("postfix-delayed-4.4.1.eml", ["network_error"]),
    ("postfix-expired-4.4.1.eml", ["expired"]),
    ("postfix-hard-5.1.1.eml", ["user_unknown"]),
    ("postfix-relay-gmail-5.1.1.eml", ["user_unknown"]),
    ("postfix-relay-yahoo-554.eml", ["user_unknown"]),
    ("postfix-two-recipients-5.1.1.eml", ["user_unknown", "user_unknown"]),
    ("qmail-failure-notice.eml", ["undefined"]),
    ("socketlabs-arf-abuse.eml", ["complaint"]),
    ("yahoo-failure-notice.eml", ["user_unknown"]),
])
def test_each_bounce_sample_has_its_reason(name: str, reasons: list[str]) -> None:
    report = read_bounce((SAMPLES / name).read_bytes())
    assert [e.reason for e in report.events] == reasons


# -- SMTP replies and API errors ----------------------------------------------------------

@pytest.mark.parametrize(("reply", "reason"), [
    ("550 5.1.1 No such user", "user_unknown"),
    ("550 5.1.1 <bad@example.com>: Recipient address rejected", "user_unknown"),
    ("550 5.1.2 Bad destination system address", "host_unknown"),
    ("552 5.2.2 Mailbox full", "mailbox_full"),
    ("552 5.3.4 Message too big", "message_too_big"),
    ("554 5.7.1 Relay access denied", "relaying_denied"),
    # Postfix's wording for any refusal of a recipient (here a policy's): not a dead address.
    ("550 5.7.1 Recipient address rejected", "policy"),
    ("550 5.7.1 Recipient address rejected: User unknown in virtual mailbox table",
     "user_unknown"),
    ("550 5.7.26 This message does not have authentication information", "authentication"),
    ("421 4.7.0 Try again later, closing connection (rate limit)", "rate_limited"),
    ("450 4.2.1 The user you are trying to contact is receiving mail too quickly",
     "suspended"),
    ("451 4.7.1 Greylisted, please try again", "policy"),
    ("550 Mailbox unavailable", "undefined"),
    ("552 Requested mail action aborted", "message_too_big"),
    ("551 User not local", "has_moved"),
    ("554 Transaction failed", "policy"),
    ("421 Service not available", "network_error"),
    ("smtp; 554 no", "policy"),
    ("", "undefined"),
    ("not a reply at all", "undefined"),
])
def test_smtp_replies(reply: str, reason: str) -> None:
    assert smtp_reason(reply) == reason


@pytest.mark.parametrize(("code", "message", "reason"), [
    (550, "5.1.1 No such user", "user_unknown"),
    (552, "5.2.2 Over quota", "mailbox_full"),
    (401, "Resend API refused the credentials (HTTP 401): invalid key; check the API key",
     "account"),
    (403, "Postmark API refused the credentials (HTTP 403): forbidden", "account"),
    (429, "SendGrid API throttled the request (HTTP 429): slow down", "rate_limited"),
    (413, "Mailgun API refused the message (HTTP 413): too large", "message_too_big"),
    (503, "Resend API failed (HTTP 503): unavailable", "system_error"),
    (422, "Postmark API refused the message (HTTP 422): Invalid 'To' address",
     "syntax_error"),
    (422, "Postmark API refused the message (HTTP 422): nothing said", "undefined"),
    (400, "Resend API refused the message (HTTP 400): bad request", "undefined"),
    (0, "Resend API did not answer within 10 s (ReadTimeout)", "undefined"),
    (0, "SMTP connection failed: Connection refused", "network_error"),
])
def test_api_and_transport_errors(code: int, message: str, reason: str) -> None:
    assert api_reason(code, message) == reason


# -- each provider's types ----------------------------------------------------------------

@pytest.mark.parametrize(("bounce_type", "sub_type", "diagnostic", "reason"), [
    ("Permanent", "General", "smtp; 550 5.1.1 user unknown", "user_unknown"),
    ("Permanent", "General", "smtp; 550 5.7.1 spam detected", "spam"),
    ("Permanent", "NoEmail", "", "user_unknown"),
    ("Permanent", "Suppressed", "", "user_unknown"),
    ("Permanent", "OnAccountSuppressionList", "", "suppressed"),
    ("Transient", "MailboxFull", "", "mailbox_full"),
    ("Transient", "MessageTooLarge", "", "message_too_big"),
    ("Transient", "ContentRejected", "", "content"),
    ("Transient", "AttachmentRejected", "", "content"),
    ("Transient", "General", "", "undefined"),
    ("Undetermined", "Undetermined", "", "undefined"),
])
def test_ses_bounce_types(bounce_type: str, sub_type: str, diagnostic: str,
                          reason: str) -> None:
    assert ses_reason(bounce_type, sub_type, diagnostic) == reason


@pytest.mark.parametrize(("bounce_type", "details", "reason"), [
    ("HardBounce", "smtp;550 5.1.1 The email account does not exist", "user_unknown"),
    ("HardBounce", "smtp;550 5.1.2 no such domain", "host_unknown"),
    ("HardBounce", "", "user_unknown"),
    ("SoftBounce", "smtp;452 4.2.2 mailbox full", "mailbox_full"),
    ("SoftBounce", "", "undefined"),
    ("Transient", "", "undefined"),
    ("DnsError", "", "host_unknown"),
    ("SpamNotification", "", "spam"),
    ("Blocked", "", "blocked"),
    ("ManuallyDeactivated", "", "suppressed"),
    ("InboundError", "", "system_error"),
    ("AddressChange", "", "has_moved"),
    ("VirusNotification", "", "virus"),
    ("DMARCPolicy", "", "authentication"),
    ("BadEmailAddress", "", "user_unknown"),
    ("Unconfirmed", "", "account"),
    ("TemplateRenderingFailed", "", "content"),
    ("SomethingNew", "", "undefined"),
])
def test_postmark_types(bounce_type: str, details: str, reason: str) -> None:
    assert postmark_reason(bounce_type, details) == reason


@pytest.mark.parametrize(("classification", "reason_text", "reason"), [
    ("Invalid Address", "550 5.1.1 unknown", "user_unknown"),
    ("Technical", "", "system_error"),
    ("Content", "", "content"),
    ("Reputation", "", "blocked"),
    ("Frequency or Volume Too High", "", "rate_limited"),
    ("Mailbox Unavailable", "", "suspended"),
    ("Unclassified", "550 5.2.2 mailbox full", "mailbox_full"),
    (None, "500 unknown recipient", "user_unknown"),
    (None, "", "undefined"),
])
def test_sendgrid_classifications(classification: str | None, reason_text: str,
                                  reason: str) -> None:
    assert sendgrid_reason(classification, reason_text) == reason


@pytest.mark.parametrize(("mailgun", "severity", "response", "reason"), [
    ("bounce", "permanent", "550 5.1.1 The email account does not exist", "user_unknown"),
    ("generic", "permanent", "550 5.7.1 blocked by Spamhaus", "blocked"),
    ("suppress-bounce", "permanent", "", "user_unknown"),
    ("suppress-complaint", "permanent", "", "suppressed"),
    ("old", "temporary", "", "expired"),
    ("espblock", "temporary", "", "blocked"),
    ("greylisted", "temporary", "", "policy"),
    (None, "temporary", "452 4.2.2 mailbox full", "mailbox_full"),
    (None, None, "", "undefined"),
])
def test_mailgun_reasons(mailgun: str | None, severity: str | None, response: str,
                         reason: str) -> None:
    assert mailgun_reason(mailgun, severity, response) == reason


@pytest.mark.parametrize(("bounce_type", "sub_type", "message", "reason"), [
    ("Permanent", "General", "smtp; 550 5.1.1 user unknown", "user_unknown"),
    ("Permanent", "Suppressed", "", "user_unknown"),
    ("Permanent", "OnAccountSuppressionList", "", "suppressed"),
    ("Transient", "MailboxFull", "", "mailbox_full"),
    ("Transient", "MessageTooLarge", "", "message_too_big"),
    ("Transient", "ContentRejected", "", "content"),
    ("Undetermined", "Undetermined", "smtp; 554 no", "policy"),
    (None, None, "", "undefined"),
])
def test_resend_types(bounce_type: str | None, sub_type: str | None, message: str,
                      reason: str) -> None:
    assert resend_reason(bounce_type, sub_type, message) == reason


def test_every_table_names_only_reasons_of_the_vocabulary() -> None:
    named = {*STATUS_CODES.values(), *SES_SUBTYPES.values(), *POSTMARK_TYPES.values(),
             *SENDGRID_CLASSES.values(), *MAILGUN_REASONS.values(), *RESEND_SUBTYPES.values()}
    assert named <= set(REASONS)
    assert set(SISIMAI) == set(REASONS)
    assert all(len(name) <= 32 for name in REASONS)  # outbox_event.reason is String(32)


# -- never raises, linear -----------------------------------------------------------------

#: Each mapping, called with two values (the second ignored by those that take one).
FUNCTIONS: list[Callable[[object, object], str]] = [dsn_reason, lambda a, b: smtp_reason(a), api_reason, ses_reason, postmark_reason,
             sendgrid_reason, mailgun_reason, resend_reason,
             lambda a, b: bounce_reason(a, b, failed=True),
             lambda a, b: text_reason(a) or "undefined"]

anything = st.one_of(st.none(), st.integers(), st.booleans(), st.text(max_size=300),
                     st.binary(max_size=50), st.lists(st.text(max_size=5), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=anything, second=anything)
def test_no_mapping_raises_on_anything(first: object, second: object) -> None:
    for function in FUNCTIONS:
        assert function(first, second) in REASONS


HOSTILE = [
    "5." * 500_000,
    "5.1." * 300_000,
    "550 " * 300_000,
    "mailbox " * 200_000,
    "relay " * 200_000 + "x",
    "user " * 200_000,
    "a" * 1_000_000,
    "\x00\ud800" * 300_000,
    "too " * 300_000,
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_each_mapping_is_linear_on_long_hostile_text(text: str) -> None:
    for function in FUNCTIONS:
        started = time.perf_counter()
        assert function(text, text) in REASONS
        assert function(503, text) in REASONS
        assert time.perf_counter() - started < 0.25, function


# -- the event --------------------------------------------------------------------------

def test_an_event_s_reason_is_one_of_the_vocabulary() -> None:
    assert DeliveryEvent("bounced", bounce_kind="permanent", reason="user_unknown").reason \
        == "user_unknown"
    assert DeliveryEvent("delivered").reason is None
    for bad in ("nope", "", 3, "user_unknown" * 3):
        with pytest.raises(InvalidMessage) as refused:
            DeliveryEvent("bounced", bounce_kind="permanent", reason=bad)  # type: ignore[arg-type]
        assert refused.value.field == "reason"


# -- the documented table -----------------------------------------------------------------

def reason_table() -> str:
    """The table docs/events.md shows, made from the module's."""
    def codes(reason: str) -> str:
        found = [f"X.{key}" for key, value in STATUS_CODES.items() if value == reason]
        return ", ".join(found)

    def provider(reason: str) -> str:
        parts = []
        for name, table in (("SES", SES_SUBTYPES), ("Postmark", POSTMARK_TYPES),
                            ("SendGrid", SENDGRID_CLASSES), ("Mailgun", MAILGUN_REASONS),
                            ("Resend", RESEND_SUBTYPES)):
            keys = [key for key, value in table.items() if value == reason]
            if keys:
                parts.append(f"{name}: {', '.join(keys)}")
        return "; ".join(parts)

    lines = ["| `reason` | what it means | sisimai | RFC 3463 status | provider types |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{name}` | {meaning} | {SISIMAI[name]} | {codes(name)} | {provider(name)} |"
              for name, meaning in REASONS.items()]
    return "\n".join(lines)


def test_the_documented_reason_table_is_the_module_s() -> None:
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(r"<!-- reasons: [^\n]* -->\n(?P<table>(?:\|[^\n]*\n)+)", text)
    assert block is not None, "docs/events.md has no <!-- reasons: ... --> table"
    assert block.group("table").rstrip("\n") == reason_table(), (
        "docs/events.md's reason table differs from flask_mail_outbox._reasons; "
        "paste this:\n" + reason_table())


# -- end to end, on SQLite and PostgreSQL -------------------------------------------------

def test_a_bounce_through_process_bounce_stores_its_reason(make_apps: MakeApps) -> None:
    app, mail = make_apps(TESTING=True)
    with app.app_context():
        [stored] = mail.process_bounce((SAMPLES / "postfix-hard-5.1.1.eml").read_bytes())
        [complaint] = mail.process_bounce((SAMPLES / "socketlabs-arf-abuse.eml").read_bytes())
        [gave_up] = mail.process_bounce((SAMPLES / "postfix-expired-4.4.1.eml").read_bytes())
        assert (stored.reason, complaint.reason, gave_up.reason) == (
            "user_unknown", "complaint", "expired")
        # Read back from the table (not the value returned): the column holds it.
        with db.engine.connect() as conn:
            assert sorted(conn.execute(sa.select(event_table.c.reason)).scalars()) == [
                "complaint", "expired", "user_unknown"]


def test_an_smtp_5_1_1_stores_its_reason_shown_by_events_and_the_dashboard(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("bad@example.com", 550, "5.1.1 No such user")
    email_id = mail.send(Message("x", recipients=["good@example.com", "bad@example.com"],
                                 body="x"))
    db.session.commit()
    wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=15.0)
    assert mail.wait_idle(5)
    with app.app_context():
        events = mail.events(email_id)
    assert [(e.event_type, e.recipient, e.reason) for e in events] == [
        ("bounced", "bad@example.com", "user_unknown")]
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True), url_prefix="/ob")
    page = app.test_client().get(f"/ob/emails/{email_id}").get_data(as_text=True)
    assert '<span class="reason">user_unknown</span>' in page


def test_a_suppressed_recipient_left_out_is_a_suppressed_rejection(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.suppress("gone@example.com")
    email_id = mail.send(Message("x", recipients=["ok@example.com", "gone@example.com"],
                                 body="x"))
    db.session.commit()
    wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=15.0)
    assert mail.wait_idle(5)
    with app.app_context():
        events = mail.events(email_id)
    assert [(e.event_type, e.recipient, e.reason) for e in events] == [
        ("rejected", "gone@example.com", "suppressed")]
