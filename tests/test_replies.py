"""How SMTP replies are classified: throttled, transient or permanent.

The table holds real reply texts, each with where it came from. Throttling is
the server saying *this client* is too fast (the attempt is given back, a
bounded number of times); greylisting, a full mailbox and local errors are
ordinary transient failures (the attempt counts and the backoff applies).
"""

from __future__ import annotations

import aiosmtplib
import pytest

from flask_mail_outbox._errors import PermanentError, TransientError
from flask_mail_outbox.transports._replies import (
    ReplyClass,
    classify_reply,
    enhanced_code,
)
from flask_mail_outbox.transports._smtp import map_smtp_error

T, G, P = ReplyClass.THROTTLED, ReplyClass.TRANSIENT, ReplyClass.PERMANENT

#: (code, text after the code, expected class, where the reply comes from)
REAL_REPLIES: list[tuple[int, str, ReplyClass, str]] = [
    # -- throttling: the client is sending too fast ------------------------------------
    (421, "4.7.28 Gmail has detected an unusual rate of unsolicited mail originating from "
          "your IP address. To protect our users from spam, mail sent from your IP address "
          "has been temporarily rate limited.", T,
     "Gmail, SMTP error reference (support.google.com/a/answer/3726730), 4.7.28"),
    (450, "4.2.1 The user you are trying to contact is receiving mail at a rate that "
          "prevents additional messages from being delivered. Please resend your message "
          "at a later point.", T,
     "Gmail, SMTP error reference, 4.2.1 (per-recipient rate)"),
    (451, "4.7.500 Server busy. Please try again later from [203.0.113.5]. (S77714) "
          "[DB5EUR03FT012.eop-EUR03.prod.protection.outlook.com]", T,
     "Outlook.com / Exchange Online NDR reference, 4.7.500-699"),
    (451, "4.7.650 The mail server [203.0.113.5] has been temporarily rate limited due to "
          "IP reputation.", T,
     "Outlook.com / Exchange Online NDR reference, 4.7.650"),
    (454, "Throttling failure: Maximum sending rate exceeded.", T,
     "Amazon SES SMTP interface, sending limit errors"),
    (454, "Throttling failure: Daily message quota exceeded.", T,
     "Amazon SES SMTP interface, sending quota errors"),
    (421, "4.7.0 mx.example.com Error: too many connections from 203.0.113.5", T,
     "Postfix smtpd, smtpd_client_connection_count_limit (anvil)"),
    (421, "4.7.0 mx.example.com Error: too many connections", T,
     "Postfix postscreen, postscreen_client_connection_count_limit"),
    (450, "4.7.1 Error: too much mail from 203.0.113.5", T,
     "Postfix smtpd, smtpd_client_message_rate_limit"),
    (421, "4.7.0 [TSS04] Messages from 203.0.113.5 temporarily deferred due to unexpected "
          "volume or user complaints - 4.16.55.1; see https://postmaster.yahooinc.com/"
          "error-codes", T,
     "Yahoo postmaster error codes, TSS04"),
    (421, "4.3.2 The maximum number of concurrent server connections has exceeded a limit, "
          "closing transmission channel", T,
     "Exchange Server, MaxInboundConnectionPerSource"),
    (421, "Too many concurrent SMTP connections; please try again later.", T,
     "Exim, smtp_accept_max_per_host"),
    # -- greylisting, full mailboxes, local errors: ordinary transient failures --------
    (451, "4.3.0 try again later", G,
     "the issue's report: any '4xx try again later' was once taken for throttling"),
    (450, "4.2.0 <bob@example.org>: Recipient address rejected: Greylisted, see "
          "http://postgrey.schweikert.ch/help/example.org.html", G,
     "Postgrey (Postfix policy server) default reply"),
    (451, "4.7.1 Greylisting in action, please come back later", G,
     "milter-greylist / sqlgrey style reply"),
    (451, "4.7.1 Please try again later", G, "Sendmail / generic greylisting"),
    (450, "4.7.1 Greylisted, try again in 300 seconds (too many unknown senders)", G,
     "greylisting text that also says 'too many': greylisting wins"),
    (452, "4.2.2 The email account that you tried to reach is over quota. Please direct "
          "the recipient to https://support.google.com/mail/?p=OverQuotaTemp", G,
     "Gmail, SMTP error reference, 4.2.2"),
    (452, "4.2.2 Mailbox full, quota exceeded", G,
     "Dovecot LMTP/LDA over a relay: 'exceeded' about the mailbox, not the rate"),
    (451, "4.3.0 Temporary failure", G, "Postfix, generic temporary failure"),
    (451, "4.3.0 Error: queue file write error", G, "Postfix cleanup, disk full"),
    (421, "4.7.0 Try again later, closing connection. (EHLO)", G,
     "Gmail, SMTP error reference, 4.7.0 (generic)"),
    (421, "4.3.2 Service not available, closing transmission channel", G,
     "RFC 5321 421, the test server's default"),
    (451, "Temporary local problem - please try later", G, "Exim, local delivery deferral"),
    (450, "4.1.8 <noreply@example.com>: Sender address rejected: Domain not found", G,
     "Postfix, reject_unknown_sender_domain (unknown_address_reject_code 450)"),
    (452, "4.3.1 Insufficient system resources", G, "Exchange Server, back pressure"),
    (452, "4.5.3 Too many recipients", G,
     "RFC 5321 section 4.5.3.1.10: about this message, not the client's rate"),
    (421, "4.4.2 mx.example.com Error: timeout exceeded", G,
     "Postfix smtpd, smtpd_timeout: 'exceeded' about a timeout"),
    (421, "4.7.0 mx.example.com Error: too many errors", G,
     "Postfix smtpd, smtpd_hard_error_limit: our commands, not our pace"),
    (450, "4.2.0 <bob@example.org>: Recipient address rejected: quota exceeded", G,
     "Postfix with a quota policy service: a full mailbox without 4.2.2"),
    (451, "4.4.1 Please separate the recipients and generate a new session", G,
     "'rate' only inside other words: not throttling"),
    # -- permanent: never retried --------------------------------------------------------
    (550, "5.1.1 The email account that you tried to reach does not exist.", P,
     "Gmail, SMTP error reference, 5.1.1"),
    (554, "5.7.1 Service unavailable; Client host [203.0.113.5] blocked using "
          "zen.spamhaus.org", P, "Postfix, reject_rbl_client"),
    (550, "5.4.5 Daily user sending quota exceeded.", P,
     "Gmail, SMTP error reference, 5.4.5 (a 5xx is permanent, whatever it says)"),
]


@pytest.mark.parametrize(("code", "text", "expected", "source"), REAL_REPLIES,
                         ids=[f"{c}-{s[:40]}" for c, _, _, s in REAL_REPLIES])
def test_real_replies_are_classified(code: int, text: str, expected: ReplyClass,
                                     source: str) -> None:
    assert classify_reply(code, text) is expected, source


@pytest.mark.parametrize(("text", "expected"), [
    ("4.7.28 rate limited", "4.7.28"),
    ("4.7.500 Server busy", "4.7.500"),
    ("Throttling failure", None),
    ("version 1.2.3.4 of something", None),
    ("<bob@example.org>: 4.2.2 mailbox full", None),  # not at the start
    ("4.7.28 first line\n4.7.28 second line", "4.7.28"),
    ("mx.example.com\n4.7.0 Error: too many connections", "4.7.0"),
])
def test_enhanced_status_code_is_read_from_the_text(text: str, expected: str | None) -> None:
    assert enhanced_code(text) == expected


def test_a_throttle_reply_outside_the_throttle_codes_is_transient() -> None:
    # 422 is no code a throttling server uses; the words alone do not make it throttling.
    assert classify_reply(422, "too many") is ReplyClass.TRANSIENT


@pytest.mark.parametrize(("code", "text", "throttled"), [
    (451, "4.3.0 try again later", False),
    (454, "Throttling failure: Maximum sending rate exceeded.", True),
    (421, "4.7.0 Error: too many connections", True),
])
def test_the_smtp_transport_maps_replies_through_the_classifier(
        code: int, text: str, throttled: bool) -> None:
    error = map_smtp_error(aiosmtplib.SMTPDataError(code, text))
    assert isinstance(error, TransientError) and error.throttled is throttled
    assert isinstance(map_smtp_error(aiosmtplib.SMTPDataError(550, "5.1.1 no")), PermanentError)


def test_all_recipients_refused_is_throttled_only_when_every_temporary_refusal_is() -> None:
    rate = "4.2.1 The user you are trying to contact is receiving mail at a rate"
    grey = "4.2.0 Recipient address rejected: Greylisted"
    both_rate = aiosmtplib.SMTPRecipientsRefused([
        aiosmtplib.SMTPRecipientRefused(450, rate, "a@example.org"),
        aiosmtplib.SMTPRecipientRefused(550, "5.1.1 no such user", "b@example.org")])
    mixed = aiosmtplib.SMTPRecipientsRefused([
        aiosmtplib.SMTPRecipientRefused(450, rate, "a@example.org"),
        aiosmtplib.SMTPRecipientRefused(450, grey, "c@example.org")])
    first = map_smtp_error(both_rate)
    second = map_smtp_error(mixed)
    assert isinstance(first, TransientError) and first.throttled is True
    assert isinstance(second, TransientError) and second.throttled is False
