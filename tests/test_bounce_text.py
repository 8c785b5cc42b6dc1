"""What the reader reads beyond a clean DSN: bounces written as text, DSN fields in text,
SES notifications by mail, Hotmail's old complaints, broken report blocks; and what it
must never read as a bounce (a person's reply, an auto-reply, a Message-ID, a JSON
fragment).

The messages are made here, in the shapes the MTAs named write (the structure and
the wording that the reader keys on), with addresses of example domains.
"""

from __future__ import annotations

import email
import json

import flufl.bounce
import pytest

from flask_mail_outbox._bounces import BounceReport, read_bounce
from flask_mail_outbox._events import DeliveryEvent
from flask_mail_outbox._policy import for_good


def text_bounce(body: bytes, *, sender: bytes = b"MAILER-DAEMON <>",
                subject: bytes = b"Mail delivery failed", headers: bytes = b"") -> bytes:
    return (b"From: " + sender + b"\nTo: app@example.com\nSubject: " + subject + b"\n"
            b"Message-Id: <b1@mx.example.org>\nDate: Mon, 07 Dec 2026 18:00:00 +0000\n"
            + headers + b"\n" + body)


def events(report: BounceReport) -> list[tuple[str, str | None, str | None, str | None]]:
    return [(e.event_type, e.recipient, e.bounce_kind, e.reason) for e in report.events]


def only(report: BounceReport) -> DeliveryEvent:
    assert len(report.events) == 1, report
    return report.events[0]


def dsn(report: bytes, *, text: bytes = b"The mail system says no.\n") -> bytes:
    return (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\n"
            b"Subject: Undelivered Mail Returned to Sender\n"
            b"Date: Sat, 05 Dec 2026 10:00:00 +0000\nMessage-ID: <dsn-1@mx.example.org>\n"
            b"MIME-Version: 1.0\n"
            b"Content-Type: multipart/report; report-type=delivery-status; boundary=BB\n\n"
            b"--BB\nContent-Type: text/plain\n\n" + text +
            b"\n--BB\nContent-Type: message/delivery-status\n\n"
            b"Reporting-MTA: dns; mx.example.org\n\n" + report + b"\n--BB--\n")


# -- text bounces, read here -----------------------------------------------------------


def test_dragonfly_text_names_its_recipient() -> None:
    """DragonFly's bounce: no DSN, no line flufl.bounce knows."""
    raw = text_bounce(
        b"This is the DragonFly Mail Agent v0.13 at df.example.org.\n\n"
        b"There was an error delivering your mail to <gone@example.net>.\n\n"
        b"mx.example.net [192.0.2.25] did not like our RCPT TO:\n"
        b"550 5.1.1 <gone@example.net>: Recipient address rejected: User unknown\n\n"
        b"Message headers follow.\n\nTo: <gone@example.net>\nFrom: <app@example.com>\n"
        b"Cc: <copied@example.net>\nMessage-Id: <orig@example.com>\n\n"
        b"Hello, write back to friend@example.org.\n")
    report = read_bounce(raw)
    assert report.kind == "detected"
    assert events(report) == [("bounced", "gone@example.net", "permanent", "user_unknown")]
    assert "recognised by its text" in report.events[0].description


def test_yahoo_text_without_a_blank_line_before_the_address() -> None:
    raw = text_bounce(
        b"Sorry, we were unable to deliver your message to the following address.\n"
        b"<gone@example.net>:\n"
        b"Remote host said: 552 5.2.2 <gone@example.net>... Mailbox full [RCPT_TO]\n\n"
        b"--- Below this line is a copy of the message.\n\nTo: gone@example.net\n",
        sender=b"MAILER-DAEMON@mx.example.org", subject=b"Failure Notice")
    assert events(read_bounce(raw)) == [
        ("bounced", "gone@example.net", "permanent", "mailbox_full")]


def test_opensmtpd_old_text_and_each_recipient_its_own_reason() -> None:
    raw = text_bounce(
        b"    Hi!\n\n    This is the MAILER-DAEMON, please DO NOT REPLY to this e-mail.\n\n"
        b"    An error has occurred while attempting to deliver a message for\n"
        b"    the following list of recipients:\n\n"
        b"one@example.net: 550 5.1.1 <one@example.net>: User unknown\n"
        b"two@example.net: 552 5.2.2 <two@example.net>: Mailbox full\n\n"
        b"    Below is a copy of the original message:\n\nTo: one@example.net, "
        b"two@example.net\nFrom: app@example.com\n",
        subject=b"Delivery status notification: error")
    assert events(read_bounce(raw)) == [
        ("bounced", "one@example.net", "permanent", "user_unknown"),
        ("bounced", "two@example.net", "permanent", "mailbox_full")]


def test_exim_retry_timeout_exceeded_is_a_transient_expired_bounce() -> None:
    raw = text_bounce(
        b"This message was created automatically by mail delivery software.\n\n"
        b"A message that you sent could not be delivered to one or more of its\n"
        b"recipients. This is a permanent error. The following address(es) failed:\n\n"
        b"  slow@example.net\n    retry timeout exceeded\n\n"
        b"------ This is a copy of the message, including all the headers. ------\n\n"
        b"To: slow@example.net\n", sender=b"Mail Delivery System <Mailer-Daemon@mx.example.org>")
    event = only(read_bounce(raw))
    assert (event.event_type, event.bounce_kind, event.reason) == (
        "bounced", "transient", "expired")
    assert for_good(event.event_type, event.bounce_kind, event.reason) is None


def test_qmail_giving_up_after_4xx_is_transient() -> None:
    raw = text_bounce(
        b"Hi. This is the qmail-send program at mx.example.org.\n"
        b"I'm afraid I wasn't able to deliver your message to the following addresses.\n"
        b"This is a permanent error; I've given up. Sorry it didn't work out.\n\n"
        b"<slow@example.net>:\n"
        b"I'm not going to try again; this message has been in the queue too long.\n\n"
        b"--- Below this line is a copy of the message.\n\nTo: slow@example.net\n",
        sender=b"MAILER-DAEMON@mx.example.org", subject=b"failure notice")
    assert events(read_bounce(raw)) == [("bounced", "slow@example.net", "transient", "expired")]


def test_qmail_permanent_error_given_up_stays_permanent() -> None:
    """qmail's "I've given up" on a 5xx is its permanent error, not an expiry."""
    raw = text_bounce(
        b"Hi. This is the qmail-send program at mx.example.org.\n"
        b"This is a permanent error; I've given up. Sorry it didn't work out.\n\n"
        b"<gone@example.net>:\nRemote host said: 550 Unknown user gone@example.net\n"
        b"Giving up on 192.0.2.1.\n", sender=b"MAILER-DAEMON@mx.example.org",
        subject=b"failure notice")
    (event,) = read_bounce(raw).events
    assert (event.event_type, event.bounce_kind) == ("bounced", "permanent")


def test_a_delay_warning_in_text_is_a_deferral() -> None:
    raw = text_bounce(
        b"    A message is delayed for more than 10 minutes for the following\n"
        b"    list of recipients:\n\nslow@example.net: Network error on destination MXs\n\n"
        b"    Please note that this is only a temporary failure report.\n"
        b"    You DO NOT NEED to re-send the message to these recipients.\n",
        subject=b"Delivery status notification: delayed")
    assert events(read_bounce(raw)) == [("deferred", "slow@example.net", None, "network_error")]


def test_the_bounce_senders_and_message_ids_are_no_recipients() -> None:
    """Zoho's shape: the returned message's Message-ID and its sender appear in the text;
    neither is a recipient, and the sender of ours is never suppressed."""
    raw = text_bounce(
        b"Your message could not be delivered.\n\n"
        b"Message-ID: <1234.5678@mail.example.com>\nFrom: app@example.com\n"
        b"gone@example.net: 550 5.1.1 User unknown\n"
        b"If you need help, mail postmaster@mx.example.org or <mailer-daemon@mx.example.org>\n",
        subject=b"Undelivered Mail", headers=b"In-Reply-To: <1234.5678@mail.example.com>\n")
    report = read_bounce(raw)
    assert [e.recipient for e in report.events] == ["gone@example.net",
                                                    "postmaster@mx.example.org"]
    assert "1234.5678@mail.example.com" not in {e.recipient for e in report.events}


def test_zoho_quoted_headers_give_no_message_id_and_no_sender() -> None:
    """Zoho quotes the returned headers in its text, without a marker: flufl.bounce names
    the Message-ID and the sender there as failed addresses; neither is one."""
    raw = text_bounce(
        b"This message was created automatically by mail delivery software.\n"
        b"A message that you sent could not be delivered to one or more of its "
        b"recipients. This is a permanent error.\n\n"
        b"gone@example.net Invalid Address, ERROR_CODE :550, ERROR_CODE :5.1.1 "
        b"<gone@example.net>... User Unknown\n\n\n"
        b"Received:from mail.example.com by mx.example.com\n"
        b"Message-ID:<14a3e1b4b5a.10b1a4c5610175.858838608@mail.example.com>\n"
        b"From:Ann <ann@mail.example.com>\nTo:<gone@example.net>\nSubject:hello\n",
        sender=b"mailer-daemon@mail.example.com", subject=b"Undelivered Mail Returned to Sender")
    _, permanent = flufl.bounce.all_failures(email.message_from_bytes(raw))
    assert b"14a3e1b4b5a.10b1a4c5610175.858838608@mail.example.com" in permanent
    assert events(read_bounce(raw)) == [
        ("bounced", "gone@example.net", "permanent", "user_unknown")]


def test_status_and_diagnostic_codes_that_differ_the_diagnostic_says_why() -> None:
    """Sendmail writes Status 5.1.1 over the remote's "550 5.7.1 IP address blacklisted"."""
    event = only(read_bounce(dsn(b"Final-Recipient: rfc822; ann@example.net\nAction: failed\n"
                                 b"Status: 5.1.1\nDiagnostic-Code: SMTP; 550 5.7.1 IP address "
                                 b"blacklisted by recipient\n")))
    assert (event.reason, for_good(event.event_type, event.bounce_kind, event.reason)) == (
        "blocked", None)


def test_a_text_bounce_naming_no_valid_address_has_no_recipient() -> None:
    raw = text_bounce(b"Delivery failed: user unknown.\nRecipient: <not an address>\n"
                      b"Also <@mx.example.org> and \"x\"@ and @example.net.\n",
                      subject=b"Undeliverable: hello")
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("not-a-bounce", ())


def test_a_multipart_without_its_boundary_is_read_as_text() -> None:
    raw = (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\n"
           b"Subject: Delivery Notification: Delivery has failed\n"
           b"Content-Type: multipart/report;\nboundary=\"missing\"\n\n"
           b"Your message cannot be delivered to the following recipients:\n\n"
           b"  Recipient address: gone@example.net\n  Reason: User unknown\n")
    assert [e.recipient for e in read_bounce(raw).events] == ["gone@example.net"]


# -- never a bounce -------------------------------------------------------------------


@pytest.mark.parametrize(("sender", "subject", "headers"), [
    # a person's reply quoting a failure, and a forward of one
    (b"Ann <ann@example.net>", b"Re: Undelivered Mail Returned to Sender", b""),
    (b"Ann <ann@example.net>", b"Fwd: Mail delivery failed", b""),
    # auto-replies: by header, by subject (even from a system-looking sender)
    (b"Ann <ann@example.net>", b"Delivery failure report", b"X-Autoreply: yes\n"),
    (b"Ann <ann@example.net>", b"Undeliverable items", b"Precedence: auto_reply\n"),
    (b"Ann <ann@example.net>", b"Out of office: hello", b""),
    (b"Ann <ann@example.net>", b"Automatic reply: hello", b""),
    (b"Ann <ann@example.net>", b"hello", b""),
])
def test_replies_and_auto_replies_are_no_bounce(sender: bytes, subject: bytes,
                                               headers: bytes) -> None:
    raw = text_bounce(
        b"I am away until Monday. Your message to <bob@example.net> was not delivered\n"
        b"to me: 550 5.1.1 user unknown, ha. Write to carol@example.net instead.\n\n"
        b"> To: bob@example.net\n", sender=sender, subject=subject, headers=headers)
    report = read_bounce(raw)
    assert (report.kind, report.events) == ("not-a-bounce", ())


# -- DSNs: broken blocks and fields ---------------------------------------------------


def test_two_final_recipient_blocks_without_a_blank_line_are_two() -> None:
    report = read_bounce(dsn(
        b"Final-Recipient: rfc822; full@example.net\nAction: failed\nStatus: 4.2.2\n"
        b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.1.1\n"))
    assert events(report) == [("bounced", "full@example.net", "transient", "expired"),
                              ("bounced", "gone@example.net", "permanent", "user_unknown")]


def test_an_original_recipient_after_a_complete_block_starts_the_next() -> None:
    report = read_bounce(dsn(
        b"Original-Recipient: rfc822; one@example.net\nFinal-Recipient: rfc822; a@example.net\n"
        b"Action: failed\nStatus: 5.1.1\n"
        b"Original-Recipient: rfc822; two@example.net\nFinal-Recipient: rfc822; b@example.net\n"
        b"Action: failed\nStatus: 5.2.2\n"))
    assert [(e.recipient, e.reason) for e in report.events] == [
        ("one@example.net", "user_unknown"), ("two@example.net", "mailbox_full")]


def test_action_before_final_then_original_recipient_is_one_block() -> None:
    """Amazon's order: Action, Final-Recipient, Original-Recipient, Status."""
    report = read_bounce(dsn(
        b"Action: failed\nFinal-Recipient: rfc822; gone@example.net\n"
        b"Original-Recipient: rfc822; gone@example.net\nStatus: 5.1.1\n"))
    assert events(report) == [("bounced", "gone@example.net", "permanent", "user_unknown")]


@pytest.mark.parametrize(("final", "recipient"), [
    (b"rfc822; @mx.example.org:gone@example.net", "gone@example.net"),
    (b"rfc822;@smtp.example.net:gone@example.net", "gone@example.net"),
    (b"RFC822; @mx.example.org", None),
])
def test_a_source_routed_final_recipient(final: bytes, recipient: str | None) -> None:
    event = only(read_bounce(dsn(b"Final-Recipient: " + final + b"\nAction: failed\n"
                                 b"Status: 5.1.1\n")))
    assert event.recipient == recipient


def test_diagnostic_code_without_status_gives_the_class() -> None:
    event = only(read_bounce(dsn(b"Final-Recipient: rfc822; gone@example.net\n"
                                 b"Action: failed\n"
                                 b"Diagnostic-Code: smtp; 550 5.1.1 <gone@example.net> unknown\n")))
    assert (event.bounce_kind, event.reason) == ("permanent", "user_unknown")
    event = only(read_bounce(dsn(b"Final-Recipient: rfc822; gone@example.net\n"
                                 b"Action: failed\nDiagnostic-Code: smtp; 550 Unknown user\n")))
    assert event.bounce_kind == "permanent"


def test_a_delayed_4_4_7_is_the_give_up_of_opensmtpd() -> None:
    event = only(read_bounce(dsn(b"Final-Recipient: rfc822; slow@example.net\n"
                                 b"Action: delayed\nStatus: 4.4.7\n")))
    assert (event.event_type, event.bounce_kind, event.reason) == (
        "bounced", "transient", "expired")


def test_a_5_4_7_expiry_is_transient() -> None:
    event = only(read_bounce(dsn(b"Final-Recipient: rfc822; slow@example.net\n"
                                 b"Action: failed\nStatus: 5.4.7\n"
                                 b"Diagnostic-Code: smtp; 554 5.4.7 message expired\n")))
    assert (event.bounce_kind, event.reason) == ("transient", "expired")


def test_a_block_with_no_telling_field_is_read_with_the_text_about_its_recipient() -> None:
    event = only(read_bounce(dsn(
        b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.0.0\n",
        text=b"Delivery to the following recipient failed:\n\n  gone@example.net\n"
             b"    The recipient name is not recognized\n")))
    assert event.reason == "user_unknown"


def test_an_unknown_user_at_data_or_a_refusal_at_mail_from_suppresses_nothing() -> None:
    at_data = only(read_bounce(dsn(
        b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.0.0\n"
        b"Diagnostic-Code: smtp; 550 Unknown user gone@example.net\n",
        text=b"<gone@example.net>: host mx.example.net said: 550 Unknown user\n"
             b"    gone@example.net (in reply to end of DATA command)\n")))
    at_mail_from = only(read_bounce(dsn(
        b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.0.0\n",
        text=b"  gone@example.net\n    SMTP error from remote mail server after MAIL FROM:"
             b"<app@example.com>:\n    553 example.com does not exist\n")))
    at_rcpt = only(read_bounce(dsn(
        b"Final-Recipient: rfc822; gone@example.net\nAction: failed\nStatus: 5.0.0\n"
        b"Diagnostic-Code: smtp; 550 Unknown user gone@example.net\n",
        text=b"<gone@example.net>: host mx.example.net said: 550 Unknown user\n"
             b"    gone@example.net (in reply to RCPT TO command)\n")))
    assert [e.reason for e in (at_data, at_mail_from, at_rcpt)] == [
        "policy", "policy", "user_unknown"]
    assert [for_good(e.event_type, e.bounce_kind, e.reason)
            for e in (at_data, at_mail_from, at_rcpt)] == [None, None, "bounced"]


def test_dsn_fields_written_into_a_text_part_are_a_dsn() -> None:
    """Amazon WorkMail: the DSN fields in text/plain, quoted-printable."""
    raw = (b"From: MAILER-DAEMON@us-west-2.amazonses.com\nTo: app@example.com\n"
           b"Subject: Delivery Status Notification (Failure)\nMIME-Version: 1.0\n"
           b"Content-Type: multipart/mixed; boundary=W\n\n--W\n"
           b"Content-Type: text/plain; charset=iso-8859-15\n"
           b"Content-Transfer-Encoding: quoted-printable\n\n"
           b"An error occurred while trying to deliver the mail to the following recip=\n"
           b"ients:\ngone@example.net\n\nTechnical report:\n\nReporting-MTA: d=\nsn; a1.example\n\n"
           b"Action: failed\nFinal-Reci=\npient: rfc822; gone@example.net\n"
           b"Diagnostic-Code: smtp; 550 5.1.1=\n <gone@example.net>... User Unknown\n"
           b"Status: 5.1.1\n\n--W--\n")
    report = read_bounce(raw)
    assert report.kind == "dsn"
    assert events(report) == [("bounced", "gone@example.net", "permanent", "user_unknown")]


# -- SES by mail, Hotmail's old complaints --------------------------------------------


def ses(notification: dict[str, object], *, envelope: bool = False, fold: int = 0) -> bytes:
    body = json.dumps(notification)
    if envelope:
        body = json.dumps({"Type": "Notification", "Message": body}, indent=2)
    if fold:
        body = "\n ".join(body[i:i + fold] for i in range(0, len(body), fold))
    return (b"From: SES <no-reply@sns.amazonaws.com>\nTo: app@example.com\n"
            b"Subject: AWS Notification Message\nContent-Type: text/plain; charset=UTF-8\n\n"
            + body.encode() + b"\n\n--\nIf you wish to stop receiving notifications ...\n")


BOUNCE = {"notificationType": "Bounce", "bounce": {
    "bounceType": "Permanent", "bounceSubType": "General",
    "bouncedRecipients": [{"emailAddress": "gone@example.net",
                           "diagnosticCode": "smtp; 550 5.1.1 user unknown"}]},
    "mail": {"commonHeaders": {"messageId": "<orig-1@example.com>"}}}


@pytest.mark.parametrize(("envelope", "fold"), [(False, 0), (False, 77), (True, 0), (True, 70)])
def test_an_ses_notification_by_mail_names_its_recipient(envelope: bool, fold: int) -> None:
    report = read_bounce(ses(BOUNCE, envelope=envelope, fold=fold))
    assert events(report) == [("bounced", "gone@example.net", "permanent", "user_unknown")]
    assert report.events[0].message_id == "<orig-1@example.com>"


def test_an_ses_notification_never_makes_json_a_recipient() -> None:
    broken = ses(BOUNCE).replace(b'"gone@example.net"', b'{"bounceType":"x"}')
    assert all(e.recipient is None for e in read_bounce(broken).events)
    cut = ses(BOUNCE)[:200]  # not JSON any more: read as text, and no JSON fragment named
    for event in read_bounce(cut).events:
        assert event.recipient is None or "{" not in event.recipient


def test_an_ses_complaint_and_transient_bounce() -> None:
    complaint = {"notificationType": "Complaint", "complaint": {
        "complainedRecipients": [{"emailAddress": "ann@example.net"}]}}
    assert events(read_bounce(ses(complaint))) == [
        ("complained", "ann@example.net", None, "complaint")]
    transient = {"notificationType": "Bounce", "bounce": {
        "bounceType": "Transient", "bounceSubType": "MailboxFull",
        "bouncedRecipients": [{"emailAddress": "full@example.net"}]}}
    assert events(read_bounce(ses(transient))) == [
        ("bounced", "full@example.net", "transient", "mailbox_full")]


def test_hotmail_complaint_before_arf() -> None:
    raw = (b"From: staff@hotmail.com\nTo: app@example.com\n"
           b"Subject:  complaint about message from 192.0.2.222\nMIME-Version: 1.0\n"
           b"Content-Type: multipart/mixed; boundary=H\n\n--H\n"
           b"Content-Type: message/rfc822\nContent-Disposition: inline\n\n"
           b"X-HmXmrOriginalRecipient: ann@example.net\nFrom: app@example.com\n"
           b"To: ann@example.net\nMessage-ID: <orig-2@example.com>\nSubject: Hi\n\nHello\n--H--\n")
    report = read_bounce(raw)
    assert report.kind == "arf"
    assert events(report) == [("complained", "ann@example.net", None, "complaint")]
    assert report.events[0].message_id == "<orig-2@example.com>"
