"""Bounce messages read into delivery events: DSNs, ARF reports, and the rest via flufl.bounce.

The samples in tests/bounces/ are real messages, each with its source in
tests/bounces/SOURCES.md: DSNs, an auto-reply and a DMARC failure report that a
real Postfix (with Debian's vacation and OpenDMARC) made here for VERP senders,
and bounces, reports and ordinary mail from Postfix, Exim, Exchange, Mimecast,
Gmail, Yahoo, qmail and SocketLabs out of the test data of PyPI and Debian
packages (flufl.bounce, bounced, talon, Python's own email tests). The files
are kept as published; where a test needs a VERP address or a variation on one,
it makes it from the bytes here (an MTA's header prepended, a field changed) and
says so. ``email_id_of`` is a fake that knows the VERP addresses the samples
made here came back to.
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

import flufl.bounce
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

#: The VERP senders the samples made here were sent with (SOURCES.md): rows 42 and 43
#: (``example.com``), 44 to 47 (``outbox.test``), tokens made with ``fixture-secret-key``.
VERP_42 = "bounces+42-ns4et57bltfhikkq@example.com"
VERP_43 = "bounces+43-jhw4rp2cqp3qzxpo@example.com"
VERP_44 = "bounces+44-uhfp7wgwweogcrda@outbox.test"
VERP_45 = "bounces+45-tuoyboxhflnsm4ss@outbox.test"
VERP_46 = "bounces+46-kfzzrq5a2mwygtr2@outbox.test"
VERP_47 = "bounces+47-uaqpkb5p7cwjv2nu@outbox.test"
#: A token of the right shape whose signature is wrong, naming row 42, and row 43.
FORGED_42 = "bounces+42-aaaaaaaaaaaaaaaa@example.com"
FORGED_43 = "bounces+43-ns4et57bltfhikkq@example.com"
#: The envelope sender (and DSN To) of the third-party Exim DSN.
EXIM_SENDER = "python-dev-bounces+python=david...@python.org"


def known_verp(address: str) -> int | None:
    """A stand-in for VerpAddresses.email_id_of: the row of a VERP address it signed."""
    return {VERP_42: 42, VERP_43: 43, VERP_44: 44, VERP_45: 45, VERP_46: 46,
            VERP_47: 47}.get(address.strip().strip("<>").lower())


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
    "postfix-two-recipients-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "gone-one@outbox.test", 'unknown user: "gone-one@outbox.test"'),
        ("bounced", "permanent", "gone-two@outbox.test", 'unknown user: "gone-two@outbox.test"')],
        "<outbox-44.fixture@app.outbox.test>"),
    # gave up on a 4.x.x: a transient bounce
    "postfix-expired-4.4.1.eml": ("dsn", [
        ("bounced", "transient", "slow@defer.test",
         "connect to 127.0.0.1[127.0.0.1]:54935: Connection refused")],
        "<outbox-45.fixture@app.outbox.test>"),
    # Postfix relaying big providers' refusals
    "postfix-relay-gmail-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "agris.ameriksNEEXISTEE@gmail.com",
         ("550-5.1.1 The email account that you tried to reach does not exist. Please "
          "550-5.1.1 try double-checking"))],
        "<20090209202911.51830328E80@Albanis-3.local>"),
    "postfix-relay-yahoo-554.eml": ("dsn", [
        ("bounced", "permanent", "doesntexistthisemaill@yahoo.com",
         "554 delivery error: dd This user doesn't have a yahoo.com account")],
        "<20090210165627.50514329496@Albanis-3.local>"),
    # Exim
    "exim-dsn-gmail-5.7.1.eml": ("dsn", [
        ("bounced", "permanent", "david...@gmail.com",
         ("550-5.7.1 [94.136.40.141 12] Our system has detected that this message is "
          "550-5.7.1 likely unsolicited mail."))],
        None),  # the returned headers were cut before the Message-ID
    "exim-text-2.05.eml": ("detected", [
        ("bounced", "permanent", "userx@its.example.nl", "")],
        "<19990920022322.A19735@stereo.rotzorg.org>"),
    # Microsoft
    "exchange2010-5.1.1.eml": ("dsn", [
        ("bounced", "permanent", "customer.testemail@test-receive-domain.se",
         "550 5.1.1 RESOLVER.ADR.RecipNotFound; not found")],
        "<4db6d64e2f07a_1009115d44c424c@linux1.mail>"),
    # Mimecast giving up on Exchange Online's 4.4.4 after 92 hours: flufl.bounce finds
    # the address, the text's 4.4.4 makes it a transient bounce (the mail expired)
    "mimecast-office365-4.4.4.eml": ("detected", [
        ("bounced", "transient", "user@example.com", "")], None),
    # Gmail
    "gmail-text-failure-2006.eml": ("detected", [
        ("bounced", "permanent", "userx@example.com", "")], None),
    "gmail-delay-warning-2008.eml": ("detected", [
        ("deferred", None, "userx@example.com", "")], None),
    # Yahoo
    "yahoo-failure-notice.eml": ("detected", [
        ("bounced", "permanent", "bogus-address@example.net", "")],
        "<130907fb-848c-d154-8e59-ed1e08319fcf@yahoo.com>"),
    # qmail: only flufl.bounce knows it
    "qmail-failure-notice.eml": ("detected", [
        ("bounced", "permanent", "userx@example.de", "")], None),
    # ARF: a complaint relayed by SocketLabs (its returned message cut short: no
    # recipient is named), and a DMARC failure report made here: no complaint
    "socketlabs-arf-abuse.eml": ("arf", [("complained", None, None, "")], None),
    "opendmarc-arf-auth-failure.eml": ("arf", [], None),
    # auto-replies and ordinary mail: no bounce
    "exchange-out-of-office.eml": ("not-a-bounce", [], None),
    "gmail-vacation-auto-reply.eml": ("not-a-bounce", [], None),
    "vacation-auto-reply.eml": ("not-a-bounce", [], None),
    "not-bounce-plain.eml": ("not-a-bounce", [], None),
    "not-bounce-forwarded-message.eml": ("not-a-bounce", [], None),
    "zimbra-reply-quoting-recipients.eml": ("not-a-bounce", [], None),
}

#: Samples the reader gets wrong today (see SOURCES.md): expected to fail until it is fixed.
KNOWN_WRONG: dict[str, str] = {}


def _sample_params() -> list[object]:
    return [pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN_WRONG[name], strict=True))
            if name in KNOWN_WRONG else name for name in sorted(EXPECTED)]


def test_every_sample_is_tested_and_has_its_source() -> None:
    files = {path.name for path in SAMPLES.glob("*.eml")}
    assert files == set(EXPECTED)
    sources = (SAMPLES / "SOURCES.md").read_text()
    assert {name for name in files if f"`{name}`" not in sources} == set()


@pytest.mark.parametrize("name", _sample_params())
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


def test_a_reply_quoting_recipients_is_no_bounce_though_flufl_reads_one() -> None:
    """flufl.bounce reads the quoted To: of Zimbra's ordinary reply as a failed address;
    the message is a person's reply ("Re:", from a person), so the reader drops it."""
    raw = sample("zimbra-reply-quoting-recipients.eml")
    _, permanent = flufl.bounce.all_failures(email.message_from_bytes(raw))
    assert permanent == {b"xxx@hotmail.com"}  # what flufl.bounce alone says
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("not-a-bounce", ())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_provider_event_id_is_the_bounce_message_id_and_the_recipient(name: str) -> None:
    raw = sample(name)
    own = email.message_from_bytes(raw)["Message-ID"]
    report = read_bounce(raw)
    for event in report.events:
        if own is not None:
            assert event.provider_event_id == f"{own.strip()}:{event.recipient or ''}"
        else:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", event.provider_event_id or "")
    # the same bounce read twice: the same ids, so the event log stores it once
    assert [e.provider_event_id for e in read_bounce(raw).events] == \
        [e.provider_event_id for e in report.events]


@pytest.mark.parametrize(("name", "rows"), [
    ("postfix-hard-5.1.1.eml", [42]),
    ("postfix-delayed-4.4.1.eml", [43]),
    ("postfix-two-recipients-5.1.1.eml", [44, 44]),
    ("postfix-expired-4.4.1.eml", [45]),
])
def test_postfix_dsns_made_here_name_their_row(name: str, rows: list[int]) -> None:
    report = read_bounce(sample(name), email_id_of=known_verp)
    assert [e.email_id for e in report.events] == rows
    assert report.reason.endswith(f"email {rows[0]} by its VERP address")


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
        reason="user_unknown", payload=event.payload)
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


def test_giving_up_on_a_4xx_is_a_transient_bounce_that_suppresses_nothing() -> None:
    """Postfix with maximal_queue_lifetime = 0: ``Action: failed`` with ``Status: 4.4.1``,
    as Gmail sends when it stops retrying."""
    event = only(read_bounce(sample("postfix-expired-4.4.1.eml"), email_id_of=known_verp))
    assert (event.event_type, event.bounce_kind, event.email_id) == ("bounced", "transient", 45)
    assert event.suppresses is None
    assert event.description == "Status 4.4.1 from mx.outbox.test"
    # the Date of the DSN (Postfix writes no Last-Attempt-Date)
    assert event.occurred_at == datetime(2026, 12, 6, 0, 48, 52)
    assert summary(event)["action"] == "failed"
    assert "will_retry_until" not in summary(event)


def test_occurred_at_is_the_last_attempt_date() -> None:
    """A ``Last-Attempt-Date`` field added to the recipient block (as Gmail writes one)."""
    raw = sample("postfix-expired-4.4.1.eml").replace(
        b"Status: 4.4.1\n", b"Status: 4.4.1\nLast-Attempt-Date: Sat, 05 Dec 2026 15:30:00 "
                            b"-0800 (PST)\n", 1)
    assert only(read_bounce(raw)).occurred_at == datetime(2026, 12, 5, 23, 30, 0)


def test_two_recipient_blocks_two_events() -> None:
    report = read_bounce(sample("postfix-two-recipients-5.1.1.eml"), email_id_of=known_verp)
    assert [e.description for e in report.events] == ["Status 5.1.1 from mx.outbox.test"] * 2
    assert [e.recipient for e in report.events] == ["gone-one@outbox.test",
                                                     "gone-two@outbox.test"]
    assert len({e.provider_event_id for e in report.events}) == 2
    assert report.reason == ("a delivery status notification from mx.outbox.test: 2 bounced; "
                             "email 44 by its VERP address")


def test_postfix_relaying_gmail_unfolds_the_multi_line_reply() -> None:
    event = only(read_bounce(sample("postfix-relay-gmail-5.1.1.eml")))
    assert event.description == "Status 5.1.1 from Albanis-3.local"
    assert event.mta_response == (
        "550-5.1.1 The email account that you tried to reach does not exist. Please "
        "550-5.1.1 try double-checking the recipient's email address for typos "
        "550-5.1.1 or unnecessary spaces. Learn more at "
        "550 5.1.1 http://mail.google.com/support/bin/answer.py?answer=6596 "
        "20si2615223bwz.60")
    assert summary(event)["remote_mta"] == "dns; gmail-smtp-in.l.google.com"
    # Last-Attempt-Date absent: the DSN's Date, Mon, 9 Feb 2009 22:29:16 +0200
    assert event.occurred_at == datetime(2009, 2, 9, 20, 29, 16)


def test_postfix_relaying_yahoo() -> None:
    event = only(read_bounce(sample("postfix-relay-yahoo-554.eml")))
    assert event.description == "Status 5.0.0 from Albanis-3.local"
    assert event.mta_response == (
        "554 delivery error: dd This user doesn't have a yahoo.com account "
        "(doesntexistthisemaill@yahoo.com) [0] - mta153.mail.re1.yahoo.com")
    assert summary(event)["remote_mta"] == "dns; d.mx.mail.yahoo.com"


def test_exim_dsn_with_action_before_final_recipient() -> None:
    report = read_bounce(sample("exim-dsn-gmail-5.7.1.eml"))
    event = only(report)
    assert event.description == "Status 5.0.0 from smtp13.mailcore.me"
    assert event.mta_response.endswith("550 5.7.1 for more information. c11si2772404eds.65 - "
                                       "gsmtp")
    assert event.occurred_at == datetime(2020, 1, 8, 20, 6, 11)
    assert report.reason == ("a delivery status notification from smtp13.mailcore.me: "
                             "1 bounced; no VERP address of ours")


def test_exchange_report_whose_text_is_multipart_alternative() -> None:
    """Exchange 2010 puts its text and HTML in a multipart/alternative inside the report."""
    event = only(read_bounce(sample("exchange2010-5.1.1.eml")))
    assert event.description == "Status 5.1.1 from test-receive-domain.se"
    assert event.occurred_at == datetime(2011, 4, 26, 14, 27, 48)


# -- ARF ----------------------------------------------------------------------------------


def test_socketlabs_complaint_names_no_recipient() -> None:
    """The returned message is cut short in the sample: no Original-Rcpt-To, no To."""
    report = read_bounce(sample("socketlabs-arf-abuse.eml"))
    event = only(report)
    assert (event.event_type, event.recipient, event.message_id) == ("complained", None, None)
    assert event.suppresses == "complained"
    assert event.description == "Feedback-Type abuse, reported by SocketLabs"
    # no Received-Date: the report's Date, Thu, 19 May 2016 02:36:35 -0700 (PDT)
    assert event.occurred_at == datetime(2016, 5, 19, 9, 36, 35)
    assert summary(event)["reported_domain"] == "service.socketlabs.com"
    assert report.reason == ("a feedback report (abuse) from SocketLabs for no recipient "
                             "named; no VERP address of ours")


def test_arf_original_rcpt_to_names_the_recipient() -> None:
    raw = sample("socketlabs-arf-abuse.eml").replace(
        b"Version: 0.1\n", b"Version: 0.1\nOriginal-Rcpt-To: fbl-test@service.socketlabs.com\n")
    event = only(read_bounce(raw))
    assert (event.event_type, event.recipient) == ("complained",
                                                   "fbl-test@service.socketlabs.com")


def abuse_report_from_opendmarc() -> bytes:
    """The OpenDMARC report made here, its Feedback-Type changed to abuse."""
    return sample("opendmarc-arf-auth-failure.eml").replace(
        b"Feedback-Type: auth-failure", b"Feedback-Type: abuse")


def test_arf_without_original_rcpt_to_takes_the_returned_to() -> None:
    event = only(read_bounce(abuse_report_from_opendmarc()))
    assert (event.event_type, event.recipient) == ("complained", "alice@outbox.test")
    assert event.message_id == "<outbox-47.fixture@app.outbox.test>"


def test_arf_whose_original_names_several_recipients_names_none() -> None:
    """A complaint comes from one mailbox: never suppress every address of a To."""
    raw = abuse_report_from_opendmarc().replace(b"To: alice@outbox.test\n",
                                                b"To: a@outbox.test, b@outbox.test\n")
    event = only(read_bounce(raw))
    assert (event.event_type, event.recipient) == ("complained", None)
    assert event.message_id == "<outbox-47.fixture@app.outbox.test>"


def test_arf_opt_out_is_an_unsubscribe() -> None:
    raw = sample("socketlabs-arf-abuse.eml").replace(b"Feedback-Type: abuse",
                                                     b"Feedback-Type: opt-out")
    event = only(read_bounce(raw))
    assert (event.event_type, event.suppresses) == ("unsubscribed", "unsubscribed")


@pytest.mark.parametrize("feedback", [b"auth-failure", b"not-spam"])
def test_arf_that_is_no_complaint_gives_no_event(feedback: bytes) -> None:
    raw = sample("socketlabs-arf-abuse.eml").replace(b"Feedback-Type: abuse",
                                                     b"Feedback-Type: " + feedback)
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("arf", ())
    assert feedback.decode() in report.reason


def test_dmarc_failure_report_is_no_complaint() -> None:
    report = read_bounce(sample("opendmarc-arf-auth-failure.eml"), email_id_of=known_verp)
    assert (report.kind, report.events) == ("arf", ())
    assert report.reason.startswith("a feedback report of type auth-failure from "
                                    "OpenDMARC-Filter/1.4.2: not a recipient's complaint")


# -- VERP matching ------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["X-Original-To", "Delivered-To", "Envelope-to",
                                    "X-Envelope-To", "To"])
def test_verp_address_in_each_envelope_header(header: str) -> None:
    """A third-party DSN delivered to a VERP address: the MTA's header names the row."""
    raw = prepended("exim-dsn-gmail-5.7.1.eml", f"{header}: {VERP_43}")
    if header == "To":  # the DSN's own To is the original envelope sender
        raw = sample("exim-dsn-gmail-5.7.1.eml").replace(
            f"\nTo: {EXIM_SENDER}\n".encode(), f"\nTo: {VERP_43}\n".encode(), 1)
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
    raw = prepended("exim-dsn-gmail-5.7.1.eml", f"X-Original-To: {FORGED_42}",
                    f"Delivered-To: {VERP_43}", "Delivered-To: mailbox@example.com",
                    f"Envelope-to: {VERP_42}")
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id == 43
    assert asked.asked == [FORGED_42, VERP_43]


def test_every_candidate_is_asked_once_in_order() -> None:
    raw = prepended("exim-dsn-gmail-5.7.1.eml", "X-Original-To: x@example.com",
                    "Delivered-To: y@example.com", "Delivered-To: x@example.com",
                    "Envelope-to: z@example.com")
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id is None
    # then the DSN's To, which is also the returned headers' Return-path
    assert asked.asked == ["x@example.com", "y@example.com", "z@example.com", EXIM_SENDER]


def test_another_senders_verp_scheme_names_no_row() -> None:
    """The relayed Gmail bounce came back to its sender's own VERP address (the recipient
    encoded in it): every candidate is asked, none is ours."""
    asked = Recording()
    report = read_bounce(sample("postfix-relay-gmail-5.1.1.eml"), email_id_of=asked)
    assert only(report).email_id is None
    assert asked.asked == ["bounces-main+agris.ameriksNEEXISTEE=gmail.com@amerimail.lv",
                           "bounce_and_mail_handler@ameriks", "bounces-main@amerimail.lv"]
    assert report.reason.endswith("no VERP address of ours")


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
    raw = prepended("exim-dsn-gmail-5.7.1.eml", f"Return-path: <{VERP_42}>")
    asked = Recording()
    assert only(read_bounce(raw, email_id_of=asked)).email_id is None
    assert VERP_42 not in asked.asked


def test_without_email_id_of_no_email_id_and_the_message_id_fallback() -> None:
    for name in ("postfix-hard-5.1.1.eml", "postfix-delayed-4.4.1.eml",
                 "postfix-two-recipients-5.1.1.eml", "postfix-expired-4.4.1.eml"):
        report = read_bounce(sample(name))
        assert [e.email_id for e in report.events] == [None] * len(report.events)
        assert {e.message_id for e in report.events} == {EXPECTED[name][2]}


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
    raw = dsn(b"Reporting-MTA: dns; mx.example.org\n\n"
              b"Action: failed\nFinal-Recipient: rfc822;|/usr/local/bin/sort-mail pat@"
              b"example.org /home/pat/.rules\nStatus: 5.0.0\n",
              headers=b"X-Failed-Recipients: pat@example.org\n")
    assert only(read_bounce(raw)).recipient == "pat@example.org"


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
    """Some gateways fold a multi-line Diagnostic-Code without an indent, put a space
    before the colon, or write ``rfc/822``."""
    raw = dsn(b"Arrival-Date: Thu, 17 Jul 2017 23:34:45 +0000\n"
              b"Reporting-MTA: dns; gw1.filter.example.net\n\n"
              b"Diagnostic-Code: smtp; 550-Relaying is not allowed for this client.\n"
              b"550-gw1.filter.example.net [198.51.100.21] asks you to authenticate\n"
              b"550 before you relay through it.\n"
              b"Status : 5.0.0\nAction : failed\n"
              b"Final-Recipient : rfc/822;pat@example.org\n")
    event = only(read_bounce(raw))
    assert (event.event_type, event.bounce_kind, event.recipient) == (
        "bounced", "permanent", "pat@example.org")
    assert event.mta_response == (
        "550-Relaying is not allowed for this client. "
        "550-gw1.filter.example.net [198.51.100.21] asks you to authenticate "
        "550 before you relay through it.")


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
    us, its VERP headers name nothing, and the forward (from a person, "Fwd:") is no bounce
    at all, though flufl.bounce, which looks inside attachments, finds the address."""
    inner = sample("postfix-hard-5.1.1.eml")
    raw = (b"From: colleague@example.com\nTo: app@example.com\nSubject: Fwd: bounce\n"
           b"Date: Sat, 05 Dec 2026 10:00:00 +0000\nMIME-Version: 1.0\n"
           b"Content-Type: multipart/mixed; boundary=FW\n\n--FW\nContent-Type: text/plain\n\n"
           b"See below.\n--FW\nContent-Type: message/rfc822\n\n" + inner + b"\n--FW--\n")
    asked = Recording()
    report = read_bounce(raw, email_id_of=asked)
    assert (report.kind, report.events) == ("not-a-bounce", ())
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
    """The qmail bounce with its Message-Id line taken out."""
    raw = sample("qmail-failure-notice.eml").replace(
        b"Message-Id: <199911042119.QAA21584@python.org>\n", b"")
    assert b"message-id" not in raw.split(b"\n\n", 1)[0].lower()
    first = only(read_bounce(raw)).provider_event_id
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first or "")
    assert first == only(read_bounce(raw)).provider_event_id
    other = only(read_bounce(raw.replace(b"userx@example.de", b"usery@example.de")))
    assert other.recipient == "usery@example.de"
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
    raw = prepended("qmail-failure-notice.eml", f"Delivered-To: {VERP_42}")
    report = read_bounce(raw, email_id_of=known_verp)
    assert (report.kind, only(report).email_id) == ("detected", 42)


def test_a_detector_that_fails_makes_it_not_a_bounce(monkeypatch: pytest.MonkeyPatch) -> None:
    import flufl.bounce

    def broken(msg: object) -> tuple[frozenset[bytes], frozenset[bytes]]:
        raise UnicodeDecodeError("ascii", b"\xff", 0, 1, "a detector bug")

    monkeypatch.setattr(flufl.bounce, "all_failures", broken)
    report = read_bounce(sample("qmail-failure-notice.eml"))
    assert (report.kind, report.events) == ("not-a-bounce", ())
    assert "flufl.bounce failed on it (UnicodeDecodeError)" in report.reason


def test_flufl_garbage_is_no_address() -> None:
    """flufl.bounce's detectors can return text that is no address (here a line of
    JSON where qmail names the address): it is never an event."""
    raw = (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\nSubject: failure notice\n"
           b"Date: Sat, 05 Dec 2026 10:00:00 +0000\n\n"
           b"Hi. This is the qmail-send program at mx.example.org.\n"
           b"I'm afraid I wasn't able to deliver your message to the following addresses.\n"
           b"This is a permanent error; I've given up. Sorry it didn't work out.\n\n"
           b'<"a":{"b":"c@d","e":"f@g"}>:\nSorry.\n')
    report = read_bounce(raw)
    assert report.events == ()


# -- not bounces, and not mail ------------------------------------------------------------


@pytest.mark.parametrize("name", ["exchange-out-of-office.eml", "gmail-vacation-auto-reply.eml",
                                  "vacation-auto-reply.eml", "not-bounce-plain.eml",
                                  "not-bounce-forwarded-message.eml"])
def test_not_a_bounce(name: str) -> None:
    report = read_bounce(sample(name), email_id_of=known_verp)
    assert (report.kind, report.events) == ("not-a-bounce", ())
    assert report.reason == ("no delivery-status or feedback-report part, and flufl.bounce "
                             "recognised no bounce")


def test_an_auto_reply_to_our_verp_address_is_not_a_bounce() -> None:
    """vacation(1) answers the envelope sender, our VERP address (row 46): it names the
    row, but an auto-reply is never a bounce event."""
    asked = Recording()
    report = read_bounce(sample("vacation-auto-reply.eml"), email_id_of=asked)
    assert (report.kind, report.events) == ("not-a-bounce", ())
    assert asked.asked == [VERP_46]


def test_an_out_of_office_with_our_verp_address_prepended_is_not_a_bounce() -> None:
    raw = prepended("exchange-out-of-office.eml", f"Delivered-To: {VERP_42}")
    report = read_bounce(raw, email_id_of=known_verp)
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
    # Read up to the 33rd multipart (the stdlib parser's time grows with the depth times
    # the lines inside): nothing past it, so nothing to report.
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("not-a-bounce", ())


def test_many_parts() -> None:
    parts = b"".join(b"--B\nContent-Type: text/plain\n\nhello\n" for _ in range(20_000))
    raw = (b"From: a@example.com\nContent-Type: multipart/mixed; boundary=B\n\n" + parts
           + b"--B--\n")
    assert read_bounce(raw).kind == "not-a-bounce"
