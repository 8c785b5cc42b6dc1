"""The bounce reader on hostile shapes: linear in its input, and never a surprise exception.

Anyone can mail the bounce address, and ``flask outbox bounce`` runs on every
message the MTA hands it. Two properties, for every shape tried:

- **Time.** Each shape is read at a size N and 4N; a linear reader takes about
  4 times as long, a quadratic one 16. The check is on CPU time (this
  thread's, so a loaded machine's other work does not count), the best of a
  few rounds, and passes when 4N is read under a floor a quadratic reader
  already blows at N, or in under 8 times N's time. Before the fix the
  continuation-line shapes took 0.7 s at 14 KB and 12 s at 58 KB.
- **Outcome.** A :class:`BounceReport`, or :class:`NotMail` (which
  ``process_bounce`` turns into the documented ``InvalidMessage``), nothing
  else; what an event carries is safe to store (no control character, no
  lone surrogate, addresses that are addresses).

Hypothesis then puts generated hostile values (repeated units: parentheses,
folds, NULs, invalid UTF-8, huge numbers, extreme dates, encoded words) in
each place of real samples, with a deadline a quadratic reader misses.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_mail_outbox._bounces import MAX_BYTES, BounceReport, NotMail, read_bounce

SAMPLES = Path(__file__).parent / "bounces"
DSN = (SAMPLES / "postfix-hard-5.1.1.eml").read_bytes()
ARF = (SAMPLES / "socketlabs-arf-abuse.eml").read_bytes()
TEXT = (SAMPLES / "qmail-failure-notice.eml").read_bytes()
DIAGNOSTIC = b'Diagnostic-Code: X-Postfix; unknown user: "nobody-here"'
VERP = "bounces+42-ns4et57bltfhikkq@example.com"

#: Extreme dates: past what a datetime holds in UTC, before year 1, huge numbers.
EXTREME_DATES = [
    b"Fri, 31 Dec 9999 23:59:59 -2359",
    b"Mon, 1 Jan 0001 00:00:00 +2359",
    b"Sat, 1 Jan 99999999999999999999 00:00:00 +0000",
    b"Sat, 99999999999 Jan 2020 00:00:00 +0000",
    b"Sat, 1 Jan 2020 99999999999:00:00 +0000",
    b"Sat, 1 Jan 2020 00:00:00 +99999999999999999999",
    b"Sat, 1 Jan 2020 00:00:00 -" + b"9" * 5000,
    b"1 Jan " + b"9" * 5000,
    b"Thu, 1 Jan 1970 00:00:00 +0000",
    b"nan",
]


#: A text bounce flufl.bounce does not know (DragonFly's shape): the reader's own text path.
OWN_TEXT = (b"From: MAILER-DAEMON <>\nTo: app@example.com\nSubject: Mail delivery failed\n"
            b"Message-Id: <t1@mx.example.org>\nDate: Mon, 07 Dec 2026 18:00:00 +0000\n\n"
            b"There was an error delivering your mail to <gone@example.net>.\n\n"
            b"550 5.1.1 <gone@example.net>: Recipient address rejected: User unknown\n\n"
            b"Message headers follow.\n\nTo: <gone@example.net>\nFrom: <app@example.com>\n")
#: An SES notification mailed by SNS.
SES = (b"From: SES <no-reply@sns.amazonaws.com>\nTo: app@example.com\n"
       b"Subject: AWS Notification Message\n\n"
       b'{"notificationType":"Bounce","bounce":{"bounceType":"Permanent",'
       b'"bouncedRecipients":[{"emailAddress":"gone@example.net"}]}}\n')


def _own_text(value: bytes) -> bytes:
    return OWN_TEXT.replace(b"There was", value + b"\nThere was")


def _html_bounce(value: bytes) -> bytes:
    return (b"From: MAILER-DAEMON@mx.example.org\nTo: app@example.com\n"
            b"Subject: Undeliverable\nMIME-Version: 1.0\nContent-Type: text/html\n\n"
            b"<p>Delivery to <b>gone@example.net</b> failed: user unknown.</p>" + value)


def _dsn_field(value: bytes) -> bytes:
    return DSN.replace(DIAGNOSTIC, b"Diagnostic-Code: X-Postfix; " + value)


def _arf_report(lines: bytes) -> bytes:
    return (b"From: fbl@isp.example\nTo: abuse@example.com\nSubject: complaint\n"
            b"MIME-Version: 1.0\nContent-Type: multipart/report; "
            b"report-type=feedback-report; boundary=XX\n\n--XX\nContent-Type: text/plain\n\n"
            b"A complaint.\n--XX\nContent-Type: message/feedback-report\n\n"
            b"Feedback-Type: abuse\n" + lines + b"\n\n--XX--\n")


def _nested(n: int) -> bytes:
    head = b"From: a@example.com\nMIME-Version: 1.0\nContent-Type: multipart/mixed; boundary=b0\n\n"
    return head + b"".join(b"--b%d\nContent-Type: multipart/mixed; boundary=b%d\n\n" % (i - 1, i)
                           for i in range(1, n))


def _base64_report(n: int) -> bytes:
    report = (b"Reporting-MTA: dns; mx.example\n\nFinal-Recipient: rfc822; gone@example.com\n"
              b"Action: failed\nStatus: 5.1.1\nDiagnostic-Code: smtp; 550" + b"\n more" * n + b"\n")
    return (b"From: MAILER-DAEMON@mx.example\nTo: a@example.com\nMIME-Version: 1.0\n"
            b"Content-Type: multipart/report; report-type=delivery-status; boundary=B\n\n"
            b"--B\nContent-Type: message/delivery-status\nContent-Transfer-Encoding: base64\n\n"
            + base64.encodebytes(report) + b"--B--\n")


#: name -> (the message at size n, n): each n a quadratic reader already takes long on.
SHAPES: dict[str, tuple[Callable[[int], bytes], int]] = {
    # Many continuation lines: in a report field (defect 2's 40 KB DSN), without their
    # indent (read leniently), in an ARF report (20,000 folded lines), base64-encoded.
    "dsn field folded": (lambda n: _dsn_field(b"550" + b"\n x" * n), 4000),
    "dsn field unindented": (lambda n: _dsn_field(b"550" + b"\nx" * n), 4000),
    "arf field folded": (lambda n: _arf_report(b"User-Agent: x" + b"\n y" * n), 4000),
    "base64 report folded": (_base64_report, 4000),
    "header folded": (lambda n: b"Subject: a" + b"\n b" * n + b"\n" + DSN, 8000),
    # Many headers and many addresses (defect 2's 40,000 Delivered-To, 140,000 To).
    "many headers": (lambda n: b"".join(b"X-H%d: v\n" % i for i in range(n)) + DSN, 4000),
    "many delivered-to": (lambda n: b"".join(b"Delivered-To: a%d@example.com\n" % i
                                             for i in range(n)) + DSN, 4000),
    "many to addresses": (lambda n: b"To: " + b", ".join(b"a%d@example.com" % i
                                                         for i in range(n)) + b"\n" + DSN, 8000),
    "many report blocks": (lambda n: DSN.replace(
        b"Final-Recipient: rfc822; nobody-here",
        b"Final-Recipient: rfc822; x@example.com\nAction: failed\nStatus: 5.1.1\n\n" * n
        + b"Final-Recipient: rfc822; nobody-here"), 1000),
    "many report recipients": (lambda n: _arf_report(b"".join(
        b"Original-Rcpt-To: r%d@example.com\n" % i for i in range(n))), 2000),
    "many fields in a block": (lambda n: DSN.replace(b"Action: failed\n",
                                                     b"Action: failed\n" + b"X-F: y\n" * n), 4000),
    # Deep nesting: comments (defect 6's 200,000 "("), closed ones, quotes, MIME parts.
    "open comments in to": (lambda n: b"To: " + b"(" * n + b"\n" + DSN, 20000),
    "closed comments in to": (lambda n: b"To: " + b"(" * n + b")" * n + b" a@example.com\n"
                              + DSN, 20000),
    "quotes in to": (lambda n: b"To: " + b'"\\' * n + b"\n" + DSN, 20000),
    "nested multiparts": (_nested, 200),
    "nested returned messages": (lambda n: b"From: a@example.com\nMIME-Version: 1.0\n"
                                 + b"Content-Type: message/rfc822\n\nSubject: x\n" * n
                                 + b"\nend\n" * n, 200),
    # Huge numbers, and lines: a status, a date, the text flufl.bounce reads.
    "huge status": (lambda n: DSN.replace(b"Status: 5.1.1", b"Status: 5." + b"1" * n + b".1"),
                    20000),
    "huge date": (lambda n: DSN.replace(b"Arrival-Date: ", b"Arrival-Date: " + b"9" * n + b" "),
                  20000),
    "long text lines": (lambda n: TEXT.replace(b"\n\n", b"\n\n" + b" " * n + b"x\n", 1), 20000),
    "many text lines": (lambda n: TEXT + b"<a@example.com>:\nSorry, no mailbox here.\n\n" * n,
                        2000),
    # The text path (a bounce no DSN and no flufl.bounce detector reads): runs of what an
    # address is made of, addresses by the thousand, the copy's markers, HTML tags, DSN
    # fields in text, two-block DSNs without a blank line, a big SES notification.
    "text: a run of local-part characters": (lambda n: _own_text(b"a" * n + b"@"), 20000),
    "text: many @": (lambda n: _own_text(b"a@" * n), 8000),
    "text: a long domain": (lambda n: _own_text(b"x@" + b"a." * n + b"1"), 8000),
    "text: many addresses": (lambda n: _own_text(b"".join(
        b"<r%d@example.net>: 550 5.1.1 user unknown\n" % i for i in range(n))), 1000),
    "text: many markers": (lambda n: _own_text(b"---- Original message ----\n" * n), 4000),
    "text: many tags": (lambda n: _html_bounce(b"<" * n + b"<b>" * n), 8000),
    "text: dsn fields": (lambda n: OWN_TEXT.replace(b"\n\nMessage headers", b"\n\n" + b"".join(
        b"Final-Recipient: rfc822; r%d@example.net\nAction: failed\nStatus: 5.1.1\n" % i
        for i in range(n)) + b"\nMessage headers"), 500),
    "dsn blocks without blank lines": (lambda n: DSN.replace(
        b"Final-Recipient: rfc822; nobody-here",
        b"Final-Recipient: rfc822; x@example.com\nAction: failed\nStatus: 5.1.1\n" * n
        + b"Final-Recipient: rfc822; nobody-here"), 1000),
    "ses: many recipients": (lambda n: SES.replace(b'[{"emailAddress":"gone@example.net"}]',
                                                   b"[" + b",".join(
        b'{"emailAddress":"r%d@example.net"}' % i for i in range(n)) + b"]"), 2000),
    "ses: a folded notification": (lambda n: SES.replace(b'"Permanent"', b'"Perm' + b"\n " * n
                                                         + b'anent"'), 8000),
    # What no database or terminal takes: NULs, invalid UTF-8 and encoded surrogates.
    "nuls in the report": (lambda n: _dsn_field(b"\x00" * n), 20000),
    "invalid utf-8": (lambda n: _dsn_field(b"\xff\xfe\xed\xa0\x80" * n), 8000),
    "encoded words": (lambda n: b"Subject: " + b"=?utf-8?q?=C3=A9?= " * n + b"\n" + DSN, 4000),
}

#: CPU seconds under which 4N always passes: the quadratic reader took more at N already.
FLOOR = 0.25
#: The most 4N may take over N: 4 when linear, 16 when quadratic.
RATIO = 8.0

_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def cpu_seconds(raw: bytes, rounds: int = 3) -> float:
    """The least CPU time of this thread ``read_bounce(raw)`` took over ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        started = time.thread_time()
        outcome(raw)
        best = min(best, time.thread_time() - started)
    return best


def outcome(raw: bytes) -> BounceReport | None:
    """What reading ``raw`` gives: a report, or None for NotMail; nothing else is raised."""
    try:
        report = read_bounce(raw, email_id_of=lambda address: 42 if address == VERP else None)
    except NotMail:
        return None
    assert isinstance(report, BounceReport)
    for event in report.events:
        for text in (event.description, event.mta_response, event.payload or "",
                     event.provider_event_id or "", event.message_id or ""):
            assert not _UNSAFE.search(text), (event, text)
        assert event.recipient is None or re.fullmatch(r"[^\s<>@]+@[^\s<>@]+",
                                                       event.recipient), event
        assert len(event.mta_response) <= 2000 and len(event.description) <= 500
        assert event.provider_event_id is not None and len(event.provider_event_id) <= 255
    return report


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_is_read_in_linear_time(name: str) -> None:
    make, n = SHAPES[name]
    small, large = make(n), make(4 * n)
    assert len(large) <= MAX_BYTES, "measured below the cap, where the reader reads it all"
    outcome(small)  # warm: imports, regular expressions
    t_small, t_large = cpu_seconds(small), cpu_seconds(large)
    assert t_large < FLOOR or t_large < RATIO * t_small, (
        f"{name}: {len(small)} bytes in {t_small:.3f} s, {len(large)} bytes in "
        f"{t_large:.3f} s (x{t_large / max(t_small, 1e-6):.1f} for x4 the input)")


@pytest.mark.parametrize("name", ["dsn field folded", "many report blocks"])
def test_past_the_cap_nothing_more_is_read(name: str) -> None:
    """Past :data:`MAX_BYTES` nothing more is read: 8 MiB costs what 1 MiB does."""
    make, n = SHAPES[name]
    while len(make(2 * n)) <= MAX_BYTES:
        n *= 2
    at_cap, big = make(n), make(8 * n)  # 1 MiB at most, and 4 to 8 MiB of the same shape
    t_cap, t_big = cpu_seconds(at_cap, rounds=1), cpu_seconds(big, rounds=1)
    assert t_big < 10.0 and t_big < 3 * t_cap + 0.2, (t_cap, t_big)


@pytest.mark.parametrize("date", EXTREME_DATES, ids=lambda d: d[:40].decode())
@pytest.mark.parametrize("field", [b"Date: ", b"Last-Attempt-Date: ", b"Arrival-Date: "])
def test_an_extreme_date_is_no_date(field: bytes, date: bytes) -> None:
    """Defect 6: ``Fri, 31 Dec 9999 23:59:59 -2359`` raised OverflowError (exit 75 for ever)."""
    if field == b"Last-Attempt-Date: ":
        raw = DSN.replace(b"Action: failed\n", b"Action: failed\nLast-Attempt-Date: " + date
                          + b"\n")
    else:
        raw = re.sub(rb"(?m)^" + field + rb".*$", lambda _: field + date, DSN, count=1)
    report = outcome(raw)
    assert report is not None and report.kind == "dsn"
    (event,) = report.events
    assert event.event_type == "bounced" and event.recipient == "nobody-here@example.com"


def test_two_hundred_thousand_open_parentheses_are_no_address() -> None:
    """Defect 6: ``To:`` and 200,000 ``(`` raised RecursionError (exit 75 for ever)."""
    raw = b"From: a@example.com\nTo: " + b"(" * 200_000 + b"\nSubject: x\n\nhello\n"
    report = outcome(raw)
    assert report is not None and report.kind == "not-a-bounce"
    # In a DSN, the rest is still read, and the VERP address below it still found.
    raw = b"To: " + b"(" * 200_000 + b"\nX-Original-To: " + VERP.encode() + b"\n" + DSN
    report = outcome(raw)
    assert report is not None and [e.email_id for e in report.events] == [42]


# -- generated: hostile values in every place of real samples --------------------------

#: Units repeated into a value: what nests, folds, escapes or cannot be stored.
UNITS = [b"(", b")", b"\n ", b"\nx", b"\r\n\t", b'"', b"\\", b"<", b">", b"@", b"a@b.example, ",
         b"=?utf-8?q?=C3=A9?= ", b"=?x?b?////?=", b"\x00", b"\xed\xa0\x80", b"\xff", b"9",
         b";", b":", b"\r", b"--B\n", b"\n\n", b"rfc822;", b" "]

values = st.one_of(
    st.sampled_from(EXTREME_DATES),
    st.binary(max_size=200),
    st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.tuples(st.lists(st.sampled_from(UNITS), min_size=1, max_size=4),
              st.integers(1, 12_000)).map(lambda t: b"".join(t[0]) * t[1]),
)

#: Where a value goes: (sample, what is replaced, with what (the value at {})).
PLACES = [
    (DSN, b"Date: Sun,  6 Dec 2026 00:27:28 +0000 (UTC)\nFrom", b"Date: {}\nFrom"),
    (DSN, b"To: bounces+42", b"To: {}, bounces+42"),
    (DSN, b"Delivered-To:", b"Delivered-To: {}\nDelivered-To:"),
    (DSN, b"Message-Id: <", b"Message-Id: {} <"),
    (DSN, b"Content-Type: message/delivery-status", b"Content-Type: message/delivery-status{}"),
    (DSN, b"Arrival-Date: ", b"Arrival-Date: {} "),
    (DSN, b"Final-Recipient: rfc822; ", b"Final-Recipient: rfc822; {}"),
    (DSN, b"Original-Recipient: rfc822;", b"Original-Recipient: rfc822;{}"),
    (DSN, b"Action: failed", b"Action: failed{}"),
    (DSN, b"Status: 5.1.1", b"Status: 5.1.1{}"),
    (DSN, DIAGNOSTIC, b"Diagnostic-Code: {}"),
    (DSN, b"Action: failed\n", b"Action: failed\nLast-Attempt-Date: {}\n"),
    (DSN, b"Return-Path: <bounces", b"Return-Path: {}<bounces"),
    (DSN, b"Subject: Reset", b"Subject: {}Reset"),
    (ARF, b"Feedback-Type: abuse", b"Feedback-Type: abuse{}"),
    (ARF, b"Original-Rcpt-To: ", b"Original-Rcpt-To: {}"),
    (ARF, b"Arrival-Date: ", b"Arrival-Date: {}"),
    (TEXT, b"\n\n", b"\n\n{}\n"),
    (TEXT, b"From: ", b"From: {}"),
    (OWN_TEXT, b"There was", b"{}There was"),
    (OWN_TEXT, b"Subject: Mail", b"Subject: {}Mail"),
    (OWN_TEXT, b"550 5.1.1", b"{} 5.1.1"),
    (SES, b'"gone@example.net"', b'"{}"'),
    (SES, b'"Permanent"', b'"{}"'),
]


@settings(max_examples=120, deadline=3000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(place=st.sampled_from(PLACES), value=values)
def test_hostile_values_anywhere_give_a_report_or_not_mail(
        place: tuple[bytes, bytes, bytes], value: bytes) -> None:
    sample, old, new = place
    if old not in sample:
        old, new = b"\n\n", b"\n" + new.replace(b"{}", b"X-Fuzz: {}") + b"\n\n"
    raw = sample.replace(old, new.replace(b"{}", value), 1)
    started = time.thread_time()
    outcome(raw)
    # 12,000 units of up to 4 x 14 bytes: a quadratic reader takes minutes on such a fold.
    assert time.thread_time() - started < 3.0


@settings(max_examples=60, deadline=3000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=st.one_of(st.binary(max_size=4000), st.builds(
    lambda head, body: head + b"\n\n" + body,
    st.binary(max_size=2000), st.binary(max_size=2000))))
def test_arbitrary_bytes_give_a_report_or_not_mail(raw: bytes) -> None:
    outcome(raw)
