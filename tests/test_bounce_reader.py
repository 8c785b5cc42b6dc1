"""Bounce messages read into delivery events: DSNs, ARF reports, and the rest via flufl.bounce.

The samples in tests/bounces/ are real messages, each with its source in
tests/bounces/SOURCES.md: two DSNs a real Postfix made here for VERP senders,
and bounces and reports from Postfix, Exim, Exchange, Office 365, Outlook.com,
Gmail, Yahoo and Amazon SES out of sisimai's collection and flufl.bounce's
test data. The files are kept as published; where a test needs a VERP address
or a variation on one, it makes it from the bytes here (an MTA's header
prepended, a field changed) and says so. ``email_id_of`` is a fake that knows
the two VERP addresses the Postfix samples came back to.
"""

from __future__ import annotations

import base64
import email
import json
import random
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from flask_mail_outbox._bounces import (
    KINDS,
    MAX_EVENTS,
    TRANSPORT,
    BounceReport,
    NotMail,
    read_bounce,
)
from flask_mail_outbox._events import PAYLOAD_LIMIT, TEXT_LIMIT, DeliveryEvent

SAMPLES = Path(__file__).parent / "bounces"

#: The VERP senders the Postfix samples were sent with (rows 42 and 43; SOURCES.md).
VERP_42 = "bounces+42-ns4et57bltfhikkq@example.com"
VERP_43 = "bounces+43-jhw4rp2cqp3qzxpo@example.com"
#: A token of the right shape whose signature is wrong, naming row 42, and row 43.
FORGED_42 = "bounces+42-aaaaaaaaaaaaaaaa@example.com"
FORGED_43 = "bounces+43-ns4et57bltfhikkq@example.com"


def known_verp(address: str) -> int | None:
    """A stand-in for VerpAddresses.email_id_of: the row of a VERP address it signed."""
    return {VERP_42: 42, VERP_43: 43}.get(address.strip().strip("<>").lower())


class Recording:
    """``known_verp``, remembering what it was asked, in order."""

    def __init__(self, rows: Callable[[str], int | None] = known_verp) -> None:
        self.rows = rows
        self.asked: list[str] = []

    def __call__(self, address: str) -> int | None:
        self.asked.append(address)
        return self.rows(address)


def sample(name: str) -> bytes:
    return (SAMPLES / name).read_bytes()


def prepended(name: str, *headers: str) -> bytes:
    """A sample with header lines on top, as the MTA that delivered it adds them."""
    raw = sample(name)
    newline = b"\r\n" if b"\r\n" in raw[:2000] else b"\n"
    return b"".join(h.encode() + newline for h in headers) + raw


def only(report: BounceReport) -> DeliveryEvent:
    assert len(report.events) == 1, report
    return report.events[0]


def summary(event: DeliveryEvent) -> dict[str, object]:
    assert event.payload is not None
    loaded = json.loads(event.payload)
    assert isinstance(loaded, dict)
    return loaded


# -- every sample: its exact events --------------------------------------------------------

#: file -> (kind, [(event type, bounce kind, recipient, mta_response starts with)],
#: the returned original's Message-ID)
EXPECTED: dict[str, tuple[str, list[tuple[str, str | None, str | None, str]], str | None]] = {
    # Postfix, made here (VERP senders)
    "postfix-hard-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "nobody-here@example.com", 'unknown user: "nobody-here"')],
        "<176498070012.4242.17023845513306081729@example.com>"),
    "postfix-delayed-4.4.1.eml": ("dsn", [
        ("deferred", None, "slow@remote-mx.example.net",
         "connect to 127.0.0.1[127.0.0.1]:1: Connection refused")],
        "<176498070013.4242.8812630018283901140@example.com>"),
    # Postfix relaying big providers' refusals
    "postfix-relay-gmail-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "kijitora@gmail.com",
         ("550-5.1.1 The email account that you tried to reach does not exist. Please try "
          "550-5.1.1 double-checking"))],
        "<ffffff-eeeeee-22@neko.example.com>"),
    "postfix-relay-yahoo-5.7.9.eml": ("dsn", [
        ("bounced", "permanent", "kijitora@aol.example.jp",
         "554 5.7.9 Message not accepted for policy reasons.")],
        "<20201113004812.08513C0196A@smtp.example.jp>"),
    # Exim
    "exim-dsn-5.0.0.eml": ("dsn", [
        ("bounced", "permanent", "kijitora@example.net",
         "550 5.7.1 Connections not accepted from servers without a valid sender domain.")],
        "<neko222-nyaaan-22@neko.example.com>"),
    "exim-text-4.72.eml": ("detected", [
        ("bounced", "permanent", "kijitora@example.ed.jp", "")],
        "<E1P1ce6-000Egt-GZ@e1.example.org>"),
    # Microsoft
    "exchange2007-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "mikeneko@example.co.jp",
         "550 5.1.1 RESOLVER.ADR.RecipNotFound; not found")], None),
    "office365-5.1.10.eml": ("dsn", [
        ("bounced", "permanent", "kijitora-nyaan@neko.kyoto.example.jp",
         "550 5.1.10 RESOLVER.ADR.RecipientNotFound; Recipient not found by SMTP address")],
        None),
    "outlook-com-two-recipients.eml": ("dsn", [
        ("bounced", "permanent", "sabineko@example.co.jp",
         "550 5.1.1 <sabineko@example.co.jp>... User Unknown"),
        ("bounced", "permanent", "mikeneko@example.co.jp",
         "550 5.2.2 <mikeneko@example.co.jp>... Mailbox Full")],
        "<BLU436-SMTP695D62048105F50EF3A1B8BA770@phx.gbl>"),
    # Gmail
    "gmail-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "libsisimai-2@googlegroups.com",
         "550-5.1.1 The email account that you tried to reach does not exist.")],
        "<144493c0-8548-4b2b-987f-ae719df82545@Spark>"),
    "gmail-failed-4.4.1.eml": ("dsn", [
        ("bounced", "transient", "siro@neko1.nyaan.jp",
         "The recipient server did not accept our requests to connect.")],
        "<CAByYQsFyrGN=Aa73R9b-3-tiR7uFpUan+9CAWRmKP4z_GriF5Q@mail.gmail.example.com>"),
    "gmail-delay-warning-2008.eml": ("detected", [
        ("deferred", None, "userx@example.com", "")], None),
    # Yahoo
    "yahoo-failure-notice.eml": ("detected", [
        ("bounced", "permanent", "bogus-address@example.net", "")],
        "<130907fb-848c-d154-8e59-ed1e08319fcf@yahoo.com>"),
    "yahoo-arf-abuse.eml": ("arf", [
        ("complained", None, "this-local-part-does-not-exist-on-yahoo@yahoo.com", "")],
        "<000000000000000000000000.smtp@example.com>"),
    # Amazon SES forwarding a complaint
    "amazonses-arf-abuse.eml": ("arf", [
        ("complained", None, "kijitora@y.example.com", "")],
        "<2222222222222222-00000000-eeee-eeee-ffff-222222222222-111111@email.amazonses.com>"),
    # qmail: only flufl.bounce knows it
    "qmail-5.5.0.eml": ("detected", [
        ("bounced", "permanent", "kijitora@example.ne.jp", "")],
        "<000000000.9999999999999.JavaMail.postmaster@mailhub>"),
    # reports that are not a recipient's complaint, and mail that is no bounce
    "opendmarc-arf-auth-failure.eml": ("arf", [], None),
    "hotmail-jmrp-complaint.eml": ("not-a-bounce", [], None),
    "exchange-automatic-reply.eml": ("not-a-bounce", [], None),
    "vacation-auto-reply.eml": ("not-a-bounce", [], None),
    "not-bounce-plain.eml": ("not-a-bounce", [], None),
    "not-bounce-forwarded-attachment.eml": ("not-a-bounce", [], None),
}


def test_every_sample_is_tested_and_has_its_source() -> None:
    files = {path.name for path in SAMPLES.glob("*.eml")}
    assert files == set(EXPECTED)
    sources = (SAMPLES / "SOURCES.md").read_text()
    assert {name for name in files if f"`{name}`" not in sources} == set()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_events(name: str) -> None:
    kind, expected, original_id = EXPECTED[name]
    raw = sample(name)
    report = read_bounce(raw)
    assert report.kind == kind
    assert report.kind in KINDS
    got = [(e.event_type, e.bounce_kind, e.recipient) for e in report.events]
    assert got == [(t, k, r) for t, k, r, _ in expected]
    for event, (_, _, _, response) in zip(report.events, expected, strict=True):
        assert event.mta_response.startswith(response), event.mta_response
        assert event.transport == TRANSPORT == "bounce"
        assert event.message_id == original_id
        assert event.email_id is None  # no email_id_of given
        assert event.provider_message_id is None
        assert event.occurred_at is not None and event.occurred_at.tzinfo is None
        assert event.provider_event_id
    # one line for the log
    assert report.reason and "\n" not in report.reason and len(report.reason) <= 300


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_provider_event_id_is_the_bounce_message_id_and_the_recipient(name: str) -> None:
    raw = sample(name)
    own = email.message_from_bytes(raw)["Message-ID"]
    report = read_bounce(raw)
    for event in report.events:
        if own is not None:
            assert event.provider_event_id == f"{own.strip()}:{event.recipient}"
        else:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", event.provider_event_id or "")
    # the same bounce read twice: the same ids, so the event log stores it once
    assert [e.provider_event_id for e in read_bounce(raw).events] == \
        [e.provider_event_id for e in report.events]


def test_postfix_hard_bounce_in_full() -> None:
    report = read_bounce(sample("postfix-hard-5.1.1.eml"), email_id_of=known_verp)
    event = only(report)
    assert event == DeliveryEvent(
        event_type="bounced", bounce_kind="permanent", recipient="nobody-here@example.com",
        occurred_at=datetime(2026, 12, 6, 0, 27, 28),  # the DSN's Date (no Last-Attempt-Date)
        transport="bounce", email_id=42,
        provider_event_id="<20261206002728.D18F12BC6B3@mx.outbox-test.example>:"
                          "nobody-here@example.com",
        description="Status 5.1.1 from mx.outbox-test.example",
        mta_response='unknown user: "nobody-here"',
        message_id="<176498070012.4242.17023845513306081729@example.com>",
        payload=event.payload)
    assert event.suppresses == "bounced"
    assert summary(event) == {
        "kind": "dsn", "reporting_mta": "mx.outbox-test.example", "action": "failed",
        "status": "5.1.1", "final_recipient": "rfc822; nobody-here@example.com",
        "original_recipient": "rfc822;nobody-here@example.com",
        "diagnostic_code": 'X-Postfix; unknown user: "nobody-here"',
        "original_message_id": "<176498070012.4242.17023845513306081729@example.com>",
        "envelope_recipient": VERP_42,
        "bounce_message_id": "<20261206002728.D18F12BC6B3@mx.outbox-test.example>",
    }
    assert report.reason == ("a delivery status notification from mx.outbox-test.example: "
                             "1 bounced; email 42 by its VERP address")


def test_postfix_delay_is_deferred_and_suppresses_nothing() -> None:
    event = only(read_bounce(sample("postfix-delayed-4.4.1.eml"), email_id_of=known_verp))
    assert (event.event_type, event.bounce_kind, event.email_id) == ("deferred", None, 43)
    assert event.description == "Status 4.4.1 from mx.outbox-test.example"
    assert event.suppresses is None
    assert summary(event)["will_retry_until"] == "Sun, 6 Dec 2026 01:27:28 +0000 (UTC)"


def test_gmail_occurred_at_is_the_last_attempt() -> None:
    event = only(read_bounce(sample("gmail-5.1.1.eml")))
    # Last-Attempt-Date: Mon, 02 Mar 2020 23:50:45 -0800 (PST), in naive UTC
    assert event.occurred_at == datetime(2020, 3, 3, 7, 50, 45)
    assert event.description == "Status 5.1.1 from googlemail.com"


def test_gmail_gives_up_on_a_4xx_a_transient_bounce_that_suppresses_nothing() -> None:
    event = only(read_bounce(sample("gmail-failed-4.4.1.eml")))
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")
    assert event.suppresses is None


def test_two_recipient_blocks_two_events() -> None:
    report = read_bounce(sample("outlook-com-two-recipients.eml"))
    assert [e.description for e in report.events] == [
        "Status 5.1.1 from BLU004-OMC3S20.o.example.com",
        "Status 5.2.2 from BLU004-OMC3S20.o.example.com"]
    assert len({e.provider_event_id for e in report.events}) == 2
    assert report.reason.startswith("a delivery status notification from "
                                    "BLU004-OMC3S20.o.example.com: 2 bounced;")


# -- ARF ----------------------------------------------------------------------------------


def test_yahoo_complaint() -> None:
    report = read_bounce(sample("yahoo-arf-abuse.eml"))
    event = only(report)
    assert event.suppresses == "complained"
    assert event.description == "Feedback-Type abuse, reported by Yahoo!-Mail-Feedback/1.0"
    # Received-Date: Thu, 29 Apr 2013 23:45:50 PST
    assert event.occurred_at == datetime(2013, 4, 30, 7, 45, 50)
    assert summary(event)["original_mail_from"] == "<shironeko@example.com>"
    assert "feedback report (abuse) from Yahoo!-Mail-Feedback/1.0" in report.reason


def test_arf_without_original_rcpt_to_takes_the_returned_to() -> None:
    raw = sample("yahoo-arf-abuse.eml").replace(
        b"Original-Rcpt-To: this-local-part-does-not-exist-on-yahoo@yahoo.com\n", b"")
    event = only(read_bounce(raw))
    assert (event.event_type, event.recipient) == (
        "complained", "this-local-part-does-not-exist-on-yahoo@yahoo.com")


def test_arf_whose_original_names_several_recipients_names_none() -> None:
    """A complaint comes from one mailbox: never suppress every address of a To."""
    raw = sample("yahoo-arf-abuse.eml").replace(
        b"Original-Rcpt-To: this-local-part-does-not-exist-on-yahoo@yahoo.com\n", b""
    ).replace(b"To: this-local-part-does-not-exist-on-yahoo@yahoo.com\n",
              b"To: a@yahoo.example, b@yahoo.example\n")
    event = only(read_bounce(raw))
    assert (event.event_type, event.recipient) == ("complained", None)
    assert event.message_id == "<000000000000000000000000.smtp@example.com>"


def test_arf_opt_out_is_an_unsubscribe() -> None:
    raw = sample("yahoo-arf-abuse.eml").replace(b"Feedback-Type: abuse", b"Feedback-Type: opt-out")
    event = only(read_bounce(raw))
    assert (event.event_type, event.suppresses) == ("unsubscribed", "unsubscribed")


@pytest.mark.parametrize("feedback", [b"auth-failure", b"not-spam"])
def test_arf_that_is_no_complaint_gives_no_event(feedback: bytes) -> None:
    raw = sample("yahoo-arf-abuse.eml").replace(b"Feedback-Type: abuse",
                                                b"Feedback-Type: " + feedback)
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("arf", ())
    assert feedback.decode() in report.reason


def test_dmarc_failure_report_is_no_complaint() -> None:
    report = read_bounce(sample("opendmarc-arf-auth-failure.eml"))
    assert (report.kind, report.events) == ("arf", ())
    assert report.reason.startswith("a feedback report of type auth-failure from "
                                    "OpenDMARC-Filter/1.3.0: not a recipient's complaint")


def test_hotmail_jmrp_is_not_read() -> None:
    """Hotmail's JMRP complaints are not ARF and flufl.bounce has no detector: a known gap."""
    report = read_bounce(sample("hotmail-jmrp-complaint.eml"))
    assert (report.kind, report.events) == ("not-a-bounce", ())


# -- VERP matching ------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["X-Original-To", "Delivered-To", "Envelope-to",
                                    "X-Envelope-To", "To"])
def test_verp_address_in_each_envelope_header(header: str) -> None:
    """A third-party DSN delivered to a VERP address: the MTA's header names the row."""
    raw = prepended("exim-dsn-5.0.0.eml", f"{header}: {VERP_43}")
    if header == "To":  # the DSN's own To is the original envelope sender
        raw = sample("exim-dsn-5.0.0.eml").replace(
            b"\nTo: sironeko-nyaan@neko.example.com\n", f"\nTo: {VERP_43}\n".encode(), 1)
    report = read_bounce(raw, email_id_of=known_verp)
    event = only(report)
    assert event.email_id == 43
    assert summary(event)["envelope_recipient"] == VERP_43
    assert report.reason.endswith("email 43 by its VERP address")


def test_verp_from_the_returned_return_path_when_the_mta_adds_no_envelope_header() -> None:
    """A pipe(8) transport without the D and O flags adds no Delivered-To or X-Original-To."""
    raw = sample("postfix-hard-5.1.1.eml")
    raw = re.sub(rb"(?m)^(X-Original-To|Delivered-To|To): bounces\+[^\n]*\n", b"", raw)
    asked = Recording()
    event = only(read_bounce(raw, email_id_of=asked))
    assert event.email_id == 42
    assert asked.asked == [VERP_42]  # the returned message's Return-Path


def test_verp_from_x_postfix_sender_alone() -> None:
    raw = sample("postfix-delayed-4.4.1.eml")
    raw = re.sub(rb"(?m)^(X-Original-To|Delivered-To|To|Return-Path): <?bounces\+[^\n]*\n", b"",
                 raw)
    assert raw.count(VERP_43.encode()) == 1
    assert only(read_bounce(raw, email_id_of=known_verp)).email_id == 43


def test_verp_candidates_are_tried_in_order_and_the_first_known_wins() -> None:
    raw = prepended("exim-dsn-5.0.0.eml", f"X-Original-To: {FORGED_42}",
                    f"Delivered-To: {VERP_43}", "Delivered-To: mailbox@example.com",
                    f"Envelope-to: {VERP_42}")
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id == 43
    assert asked.asked == [FORGED_42, VERP_43]


def test_every_candidate_is_asked_once_in_order() -> None:
    raw = prepended("exim-dsn-5.0.0.eml", "X-Original-To: x@example.com",
                    "Delivered-To: y@example.com", "Delivered-To: x@example.com",
                    "Envelope-to: z@example.com")
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id is None
    # then the DSN's To, which is also the returned message's Return-path
    assert asked.asked == ["x@example.com", "y@example.com", "z@example.com",
                           "sironeko-nyaan@neko.example.com"]


@pytest.mark.parametrize("forged", [FORGED_42, FORGED_43])
def test_forged_token_gives_no_email_id(forged: str) -> None:
    raw = sample("postfix-hard-5.1.1.eml").replace(VERP_42.encode(), forged.encode())
    report = read_bounce(raw, email_id_of=known_verp)
    event = only(report)
    assert event.email_id is None  # not 42, not 43
    assert report.reason.endswith("no VERP address of ours")
    assert "envelope_recipient" not in summary(event)
    # the returned Message-ID is still given: the event log matches by it, or not at all
    assert event.message_id == "<176498070012.4242.17023845513306081729@example.com>"


def test_the_bounce_own_return_path_is_not_a_verp_candidate() -> None:
    """A message whose envelope sender is one of our VERP addresses is our own mail coming
    back (a forward, a loop), not a bounce to that address."""
    raw = sample("exim-dsn-5.0.0.eml").replace(b"Return-path: <>", f"Return-path: <{VERP_42}>"
                                               .encode(), 1)
    assert VERP_42.encode() in raw
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id is None
    assert VERP_42 not in asked.asked


def test_without_email_id_of_no_email_id_and_the_message_id_fallback() -> None:
    for name in ("postfix-hard-5.1.1.eml", "postfix-delayed-4.4.1.eml"):
        event = only(read_bounce(sample(name)))
        assert event.email_id is None
        assert event.message_id == EXPECTED[name][2]


def test_message_id_from_gmail_x_original_message_id_without_returned_part() -> None:
    raw = dsn(b"Reporting-MTA: dns; googlemail.com\n"
              b"X-Original-Message-ID: <orig-1@app.example.com>\n\n"
              b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.1.1\n")
    assert only(read_bounce(raw)).message_id == "<orig-1@app.example.com>"


def test_message_id_from_in_reply_to_as_a_last_resort() -> None:
    raw = dsn(b"Reporting-MTA: dns; x.example\n\n"
              b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.1.1\n",
              headers=b"In-Reply-To: <orig-2@app.example.com>\n")
    assert only(read_bounce(raw)).message_id == "<orig-2@app.example.com>"


# -- DSN details, on messages made for the case --------------------------------------------


def dsn(status: bytes, *, headers: bytes = b"", content_type: bytes = b"message/delivery-status",
        encoding: bytes | None = None, text: bytes = b"The mail system says no.\n",
        date: bytes = b"Date: Sat, 05 Dec 2026 10:00:00 +0000\n") -> bytes:
    """A minimal multipart/report DSN around ``status``."""
    body = status if encoding is None else base64.encodebytes(status)
    cte = b"" if encoding is None else b"Content-Transfer-Encoding: " + encoding + b"\n"
    return (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\n"
            b"Subject: Undelivered Mail Returned to Sender\n" + date +
            b"Message-ID: <dsn-1@mx.example.org>\n" + headers +
            b"MIME-Version: 1.0\n"
            b"Content-Type: multipart/report; report-type=delivery-status; boundary=BB\n\n"
            b"--BB\nContent-Type: text/plain\n\n" + text +
            b"\n--BB\nContent-Type: " + content_type + b"\n" + cte + b"\n" + body +
            b"\n--BB--\n")


def one_block(action: bytes, status: bytes | None) -> bytes:
    fields = b"Final-Recipient: rfc822; r@example.net\nAction: " + action + b"\n"
    if status is not None:
        fields += b"Status: " + status + b"\n"
    return dsn(b"Reporting-MTA: dns; mx.example.org\n\n" + fields)


@pytest.mark.parametrize(("action", "status", "event_type", "bounce_kind"), [
    (b"failed", b"5.1.1", "bounced", "permanent"),
    (b"failed", b"5.0.0 (permanent failure)", "bounced", "permanent"),
    (b"failed", b"4.4.7", "bounced", "transient"),
    (b"failed", None, "bounced", "transient"),
    (b"Failed (bad address)", b"5.1.1", "bounced", "permanent"),
    (b"failure", b"5.1.1", "bounced", "permanent"),  # seen in flufl.bounce's dsn_03
    (b"error", b"5.1.1", "bounced", "permanent"),  # OpenSMTPD
    (b"expired", b"", "bounced", "transient"),  # SendGrid
    (b"delayed", b"4.4.1", "deferred", None),
    (b"delivered", b"2.0.0", "delivered", None),
    (b"expanded", b"2.0.0", "delivered", None),
    (b"relayed", b"2.0.0", "unknown", None),
    (b"deliverable", b"2.1.5", "unknown", None),
])
def test_action_mapping(action: bytes, status: bytes | None, event_type: str,
                        bounce_kind: str | None) -> None:
    event = only(read_bounce(one_block(action, status)))
    assert (event.event_type, event.bounce_kind) == (event_type, bounce_kind)
    assert event.recipient == "r@example.net"
    if action == b"relayed":
        assert "delivery is not known" in event.description


def test_original_recipient_is_the_address_to_suppress() -> None:
    """An alias expanded at the far end: the address we sent to is Original-Recipient."""
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; mailbox17@internal.example.org\n"
              b"Original-Recipient: rfc822;alias@example.org\nAction: failed\nStatus: 5.1.1\n")
    event = only(read_bounce(raw))
    assert event.recipient == "alias@example.org"
    assert summary(event)["final_recipient"] == "rfc822; mailbox17@internal.example.org"


def test_final_recipient_when_original_recipient_is_no_address() -> None:
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; gone@example.org\n"
              b"Original-Recipient: x400; /C=GB/ADMD= /PRMD=UK.AC/O=Hud/S=Gone/\n"
              b"Action: failed\nStatus: 5.1.1\n")
    assert only(read_bounce(raw)).recipient == "gone@example.org"


def test_exim_pipe_recipient_falls_back_to_x_failed_recipients() -> None:
    raw = dsn(b"Reporting-MTA: dns; neko.example.com\n\n"
              b"Action: failed\nFinal-Recipient: rfc822;|/usr/local/bin/filter kijitora@"
              b"example.com /home/nyaan/.filter\nStatus: 5.0.0\n",
              headers=b"X-Failed-Recipients: kijitora@example.com\n")
    assert only(read_bounce(raw)).recipient == "kijitora@example.com"


def test_a_block_naming_no_address_has_no_recipient() -> None:
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; /var/mail/someone\nAction: failed\nStatus: 5.0.0\n")
    event = only(read_bounce(raw))
    # kept (it may still name its email), but with no address the event log suppresses none
    assert (event.event_type, event.bounce_kind, event.recipient) == ("bounced", "permanent",
                                                                      None)


def test_dsn_with_no_per_recipient_block() -> None:
    report = read_bounce(dsn(b"Reporting-MTA: dns; mx.example.org\n"
                             b"Arrival-Date: Sat, 05 Dec 2026 09:00:00 +0000\n"))
    assert (report.kind, report.events) == ("dsn", ())
    assert report.reason == ("a delivery status notification from mx.example.org with no "
                             "per-recipient block: nothing to record")


def test_dsn_with_an_empty_status_part_but_a_bounce_text_is_read_by_flufl() -> None:
    """Google Workspace sends DSNs whose message/delivery-status part is empty."""
    text = (b"Hi. This is the qmail-send program at mx.example.org.\n"
            b"I'm afraid I wasn't able to deliver your message to the following addresses.\n"
            b"This is a permanent error; I've given up. Sorry it didn't work out.\n\n"
            b"<gone@example.net>:\nSorry, no mailbox here by that name. (#5.1.1)\n")
    report = read_bounce(dsn(b"", text=text))
    assert report.kind == "detected"
    assert [(e.event_type, e.recipient) for e in report.events] == [("bounced",
                                                                      "gone@example.net")]


def test_occurred_at_falls_back_to_arrival_date_without_a_date() -> None:
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n"
              b"Arrival-Date: Fri, 04 Dec 2026 09:00:00 +0100\n\n"
              b"Final-Recipient: rfc822; r@example.net\nAction: failed\nStatus: 5.1.1\n",
              date=b"")
    assert only(read_bounce(raw)).occurred_at == datetime(2026, 12, 4, 8, 0, 0)


def test_broken_report_fields_are_read_leniently() -> None:
    """MessageLabs folds Diagnostic-Code without an indent; Mimecast puts a space before
    the colon (both in sisimai's collection: rhost-messagelabs-01, lhost-mimecast-02)."""
    raw = dsn(b"Arrival-Date: Thu, 17 Jul 2017 23:34:45 +0000\n"
              b"Reporting-MTA: dns; server-0.bemta-0.messagelabs.com\n\n"
              b"Diagnostic-Code: smtp; 550-Please turn on SMTP Authentication in your mail "
              b"client.\n"
              b"550-mail0.bemta0.messagelabs.com [198.51.100.21]:11111 is not permitted to\n"
              b"550 relay through this server without authentication.\n"
              b"Status : 5.0.0\nAction : failed\n"
              b"Final-Recipient : rfc/822;kijitora@example.messagelabs.com\n")
    event = only(read_bounce(raw))
    assert (event.event_type, event.bounce_kind, event.recipient) == (
        "bounced", "permanent", "kijitora@example.messagelabs.com")
    assert event.mta_response == (
        "550-Please turn on SMTP Authentication in your mail client. "
        "550-mail0.bemta0.messagelabs.com [198.51.100.21]:11111 is not permitted to "
        "550 relay through this server without authentication.")


def test_base64_delivery_status_part() -> None:
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; r@example.net\nAction: failed\nStatus: 5.1.1\n",
              encoding=b"base64")
    event = only(read_bounce(raw))
    assert (event.event_type, event.recipient) == ("bounced", "r@example.net")


def test_global_delivery_status_with_an_utf8_address() -> None:
    """RFC 6533: message/global-delivery-status, fields in UTF-8."""
    raw = dsn("Reporting-MTA: dns; mx.example.org\n\n"
              "Final-Recipient: utf-8; jürgen@bücher.example\nAction: failed\n"
              "Status: 5.1.1\n".encode(), content_type=b"message/global-delivery-status")
    assert only(read_bounce(raw)).recipient == "jürgen@bücher.example"


def test_dsn_rewrapped_in_multipart_mixed_is_still_a_dsn() -> None:
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; r@example.net\nAction: delayed\nStatus: 4.3.0\n"
              ).replace(b"multipart/report; report-type=delivery-status;", b"multipart/mixed;")
    report = read_bounce(raw)
    assert report.kind == "dsn"
    assert only(report).event_type == "deferred"


def test_a_forwarded_bounce_is_not_our_dsn() -> None:
    """A DSN inside a message/rfc822 attachment is someone's forward: not read as a DSN to
    us, and its VERP headers name nothing (flufl.bounce, which looks inside attachments,
    still finds the address)."""
    inner = sample("postfix-hard-5.1.1.eml")
    raw = (b"From: colleague@example.com\nTo: app@example.com\nSubject: Fwd: bounce\n"
           b"Date: Sat, 05 Dec 2026 10:00:00 +0000\nMIME-Version: 1.0\n"
           b"Content-Type: multipart/mixed; boundary=FW\n\n--FW\nContent-Type: text/plain\n\n"
           b"See below.\n--FW\nContent-Type: message/rfc822\n\n" + inner + b"\n--FW--\n")
    asked = Recording()
    report = read_bounce(raw, email_id_of=asked)
    assert report.kind == "detected"
    assert [(e.event_type, e.recipient, e.email_id) for e in report.events] == [
        ("bounced", "nobody-here@example.com", None)]
    assert VERP_42 not in asked.asked


def test_payload_and_text_are_capped() -> None:
    huge = b"x" * (200 * 1024)
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Final-Recipient: rfc822; r@example.net\nAction: failed\nStatus: 5.1.1\n"
              b"Diagnostic-Code: smtp; 550 " + huge + b"\n")
    event = only(read_bounce(raw))
    assert event.payload is not None and len(event.payload.encode()) <= PAYLOAD_LIMIT
    assert len(event.mta_response) == TEXT_LIMIT


def test_control_characters_never_reach_the_reason() -> None:
    raw = dsn(b"Reporting-MTA: dns; evil.example\x1b[31m\r injected\n\n"
              b"Final-Recipient: rfc822; r@example.net\nAction: failed\nStatus: 5.1.1\n")
    report = read_bounce(raw)
    assert not re.search(r"[\x00-\x1f\x7f]", report.reason)
    assert not re.search(r"[\x00-\x1f\x7f]", report.events[0].description)


def test_duplicate_recipient_blocks_give_one_event() -> None:
    block = b"Final-Recipient: rfc822; r@example.net\nAction: failed\nStatus: 5.1.1\n"
    report = read_bounce(dsn(b"Reporting-MTA: dns; mx.example.org\n\n" + block + b"\n" + block))
    assert len(report.events) == 1


def test_no_message_id_gives_a_hash_per_recipient() -> None:
    raw = sample("qmail-5.5.0.eml")
    assert b"\nMessage-ID" not in raw.split(b"\n\n", 1)[0]
    first = only(read_bounce(raw)).provider_event_id
    assert first == only(read_bounce(raw)).provider_event_id
    other = only(read_bounce(raw.replace(b"kijitora@example.ne.jp", b"sabatora@example.ne.jp")))
    assert other.recipient == "sabatora@example.ne.jp"
    assert other.provider_event_id != first


# -- flufl.bounce -------------------------------------------------------------------------


def test_flufl_temporary_failure_is_a_deferral() -> None:
    report = read_bounce(sample("gmail-delay-warning-2008.eml"))
    event = only(report)
    assert (event.event_type, event.bounce_kind, event.suppresses) == ("deferred", None, None)
    assert event.description == ("delay warning recognised by flufl.bounce (not a standard "
                                 "DSN)")
    assert summary(event)["temporary"] is True


def test_text_bounce_matched_by_its_verp_address() -> None:
    raw = prepended("qmail-5.5.0.eml", f"Delivered-To: {VERP_42}")
    report = read_bounce(raw, email_id_of=known_verp)
    assert (report.kind, only(report).email_id) == ("detected", 42)


def test_a_detector_that_fails_makes_it_not_a_bounce(monkeypatch: pytest.MonkeyPatch) -> None:
    import flufl.bounce

    def broken(msg: object) -> tuple[frozenset[bytes], frozenset[bytes]]:
        raise UnicodeDecodeError("ascii", b"\xff", 0, 1, "a detector bug")

    monkeypatch.setattr(flufl.bounce, "all_failures", broken)
    report = read_bounce(sample("qmail-5.5.0.eml"))
    assert (report.kind, report.events) == ("not-a-bounce", ())
    assert "flufl.bounce failed on it (UnicodeDecodeError)" in report.reason


def test_flufl_garbage_is_no_address() -> None:
    """flufl.bounce's detectors can return text that is no address (sisimai's
    lhost-amazonses-12 gives a line of JSON): it is never an event."""
    raw = (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\nSubject: failure notice\n"
           b"Date: Sat, 05 Dec 2026 10:00:00 +0000\n\n"
           b"Hi. This is the qmail-send program at mx.example.org.\n"
           b"I'm afraid I wasn't able to deliver your message to the following addresses.\n"
           b"This is a permanent error; I've given up. Sorry it didn't work out.\n\n"
           b'<"a":{"b":"c@d","e":"f@g"}>:\nSorry.\n')
    report = read_bounce(raw)
    assert report.events == ()


# -- not bounces, and not mail ------------------------------------------------------------


@pytest.mark.parametrize("name", ["exchange-automatic-reply.eml", "vacation-auto-reply.eml",
                                  "not-bounce-plain.eml",
                                  "not-bounce-forwarded-attachment.eml"])
def test_not_a_bounce(name: str) -> None:
    report = read_bounce(sample(name), email_id_of=known_verp)
    assert (report.kind, report.events) == ("not-a-bounce", ())
    assert report.reason == ("no delivery-status or feedback-report part, and flufl.bounce "
                             "recognised no bounce")


def test_an_auto_reply_to_our_verp_address_is_not_a_bounce() -> None:
    """An out-of-office sent (wrongly) to the envelope sender: never a bounce event."""
    raw = prepended("exchange-automatic-reply.eml", f"Delivered-To: {VERP_42}")
    report = read_bounce(raw, email_id_of=known_verp)
    assert all(e.event_type not in ("bounced", "complained") for e in report.events)
    assert report.events == ()


@pytest.mark.parametrize("raw", [
    b"",
    b"   \r\n\r\n\t\n",
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10",
    b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n",
    b"just some text\nwith no header at all\n",
    b"Foo: bar\nBaz: qux\n\nkey: value lines, but no header a message has\n",
    b"\n\nFrom: a@example.com\nSubject: headers after a blank line are body\n",
    random.Random(27).randbytes(64 * 1024),
], ids=["empty", "blank", "png", "pdf", "text", "no-mail-header", "leading-blank",
        "random"])
def test_not_mail(raw: bytes) -> None:
    with pytest.raises(NotMail) as caught:
        read_bounce(raw, email_id_of=known_verp)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value)


def test_not_bytes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        read_bounce("From: a@example.com\n\nbody")  # type: ignore[arg-type]


def test_an_mbox_from_line_is_allowed() -> None:
    raw = b"From MAILER-DAEMON  Sun Dec  6 00:27:28 2026\n" + sample("postfix-hard-5.1.1.eml")
    assert only(read_bounce(raw, email_id_of=known_verp)).email_id == 42


# -- big and hostile input ----------------------------------------------------------------


def test_a_dsn_over_10_mib_is_read() -> None:
    """The 10 MiB cap is the caller's; a bigger message still parses (a big returned
    attachment) and gives its event."""
    filler = base64.encodebytes(random.Random(10).randbytes(8 * 1024 * 1024))
    raw = sample("postfix-hard-5.1.1.eml").replace(
        b"Follow this link to reset your password: https://app.example.com/reset/abc",
        b"x" * 76 + b"\n" + filler)
    assert len(raw) > 10 * 1024 * 1024
    event = only(read_bounce(raw, email_id_of=known_verp))
    assert (event.event_type, event.email_id) == ("bounced", 42)


def test_11_mib_of_text_is_read() -> None:
    raw = (b"From: someone@example.com\nTo: app@example.com\nSubject: long\n"
           b"Date: Sat, 05 Dec 2026 10:00:00 +0000\n\n" + b"line of text here\n" * 700_000)
    assert len(raw) > 11 * 1024 * 1024
    assert read_bounce(raw).kind == "not-a-bounce"


def test_text_that_makes_a_detector_backtrack_is_cut() -> None:
    """SimpleWarning's ``\\s*(?P<addr>\\S+@\\S+)`` is quadratic in a line of whitespace;
    the whole 11 MiB would take minutes. flufl.bounce reads the first 128 KiB."""
    raw = (b"From: someone@example.com\nSubject: x\nDate: Sat, 05 Dec 2026 10:00:00 +0000\n\n"
           b"The address to which the message has not yet been delivered is\n"
           + (b"\t" * 998 + b"\n") * 11_000)
    assert read_bounce(raw).kind == "not-a-bounce"


def test_at_most_max_events_from_one_message() -> None:
    blocks = b"".join(b"Final-Recipient: rfc822; u%d@example.net\nAction: failed\n"
                      b"Status: 5.1.1\n\n" % i for i in range(MAX_EVENTS + 500))
    report = read_bounce(dsn(b"Reporting-MTA: dns; mx.example.org\n\n" + blocks))
    assert len(report.events) == MAX_EVENTS
    assert f"(only the first {MAX_EVENTS} of {MAX_EVENTS + 500} recipient blocks read)" \
        in report.reason


def test_mime_nested_too_deeply() -> None:
    depth = 5000
    raw = b"From: a@example.com\n" + b"".join(
        b"Content-Type: multipart/mixed; boundary=B%d\n\n--B%d\n" % (i, i)
        for i in range(depth)) + b"Content-Type: text/plain\n\nx\n"
    with pytest.raises(NotMail, match="nest too deeply"):
        read_bounce(raw)


def test_many_parts() -> None:
    parts = b"".join(b"--B\nContent-Type: text/plain\n\nhello\n" for _ in range(20_000))
    raw = (b"From: a@example.com\nContent-Type: multipart/mixed; boundary=B\n\n" + parts
           + b"--B--\n")
    assert read_bounce(raw).kind == "not-a-bounce"
