"""Bounce messages read: RFC 3464 DSNs, RFC 5965 ARF reports, the rest through flufl.bounce.

:func:`read_bounce` takes one mail message as bytes (what an MTA's pipe
delivery hands a command on standard input, or what a mailbox fetcher got)
and says what it reports, as :class:`~flask_mail_outbox.DeliveryEvent`
values of ``transport`` ``"bounce"``. Like the webhook receivers it knows no
Flask and no database: matching a VERP address to a row is the caller's
``email_id_of``, storing the events is the event log's.

Which reader, in this order:

1. a ``message/delivery-status`` (or RFC 6533 ``message/global-delivery-status``)
   part anywhere in the message's own MIME tree (not inside a returned or
   forwarded message): an RFC 3464 DSN, kind ``"dsn"``. Some relays re-wrap a
   DSN in ``multipart/mixed``; the part is what counts, not the top type;
2. a ``message/feedback-report`` part: an RFC 5965 ARF report, kind ``"arf"``;
3. an Amazon SES notification mailed by SNS (its JSON), kind ``"detected"``;
   Hotmail's complaint from before ARF, kind ``"arf"``;
4. in a message that says it is a bounce (:meth:`_Bounce.looks_like_bounce`:
   a mail system's sender or a bounce's subject, and no sign of a reply or
   an auto-reply), DSN fields written into its text (Amazon WorkMail): kind
   ``"dsn"``;
5. otherwise flufl.bounce (``all_failures``, Mailman's detectors for qmail,
   Exim's and Yahoo's texts, old Sendmail and Exchange, ...), its addresses
   kept only in a message that says it is a bounce and when they are no
   sender and no Message-ID; else, in such a message, the addresses its text
   names (:meth:`_Bounce.text_recipients`): kind ``"detected"`` when either
   finds an address, ``"not-a-bounce"`` when not. The words and the code
   after each address say its event, permanence and reason (:func:`_classify`).
   A DSN whose status part names no recipient (Google Workspace sends such)
   is read so too, and stays a ``"dsn"`` without events when nobody is found.

Anyone can mail the bounce address, so every step is linear in the input and
bounded: the first :data:`MAX_BYTES` of a message are read, up to its
:data:`_MAX_CONTAINERS` + 1st multipart or message/* type; of the headers the
VERP address may be in, the first :data:`_ADDRESS_HEADERS` of each name, each
cut to :data:`_ADDRESS_CHARS` with its comments taken out, and the first
:data:`_ADDRESS_CANDIDATES` addresses; flufl.bounce reads the first
:data:`FLUFL_BYTES` (see :func:`_trimmed`); one message gives at most
:data:`MAX_EVENTS` events. A message the reader fails on anyway raises
:class:`NotMail` (logged at ERROR): a poison message is dropped, never retried.
What an event stores of the message goes through :mod:`._outside` once.

==============================================  =========================================
what the message says                           event (bounce kind)
==============================================  =========================================
DSN ``Action: failed`` (or ``failure``,         ``bounced``: ``permanent`` for a 5.x.x
OpenSMTPD's ``error``, SendGrid's               ``Status`` (none: the Diagnostic-Code's
``expired``; OpenSMTPD's ``delayed`` with       code), ``transient`` for a 4.x.x (Gmail
``4.4.7``, its give-up), per recipient block    gives up on a 4.x.x with ``failed``) and
                                                for an ``expired`` reason (5.4.7)
DSN ``Action: delayed``                         ``deferred`` (the MTA is still trying)
DSN ``Action: delivered`` / ``expanded``        ``delivered`` (only sent when the sender
                                                asked for NOTIFY=SUCCESS; kept if it comes)
DSN ``Action: relayed``, any other action       ``unknown``: relayed means handed to a
                                                system that sends no DSN, so delivery is
                                                not known
ARF ``Feedback-Type`` abuse, fraud, virus,      ``complained``, one per ``Original-Rcpt-To``
other, or none                                  (else the returned message's ``To`` when it
                                                names exactly one address, else no
                                                recipient)
ARF ``opt-out``                                 ``unsubscribed``
ARF ``auth-failure`` (RFC 6591 DMARC/SPF/DKIM   no event: a report about who sent with our
failure report), ``not-spam``                   domain, not about a recipient
a text bounce (flufl.bounce's or ours)          ``bounced``: ``transient`` for a 4xx or
                                                words of a give-up after retries ("retry
                                                timeout exceeded"), else ``permanent``;
                                                ``deferred`` for a delay warning ("will
                                                keep trying")
==============================================  =========================================

A DSN recipient is its ``Original-Recipient`` (the address as the sender
gave it, before forwarding or alias expansion: the one to suppress) when that
is an address, else its ``Final-Recipient`` (else, for the one block of an
Exim DSN that names a pipe or a file, its ``X-Failed-Recipients``). Report
fields are read leniently: a continuation line without its indent, a space
before the colon, a base64 ``message/delivery-status``. ``mta_response`` is the
``Diagnostic-Code`` without its type (``smtp;``, ``X-Postfix;``), unfolded;
``description`` is ``Status 5.1.1 from <Reporting-MTA>``. ``occurred_at`` is
the block's ``Last-Attempt-Date`` (when it failed), else the bounce's ``Date``
(when the MTA wrote it), else the report's ``Arrival-Date`` (when the MTA got
the original, possibly days earlier); an ARF report's ``Arrival-Date`` (or
the older ``Received-Date``), else ``Date``.

Matching: ``email_id`` is the row named by the bounce's envelope recipient,
the VERP address, tried with ``email_id_of`` in this order: ``X-Original-To``
(Postfix: the address before alias expansion), every ``Delivered-To`` top
down (Postfix, qmail, Dovecot, Courier), ``Envelope-To`` and ``X-Envelope-To``
(Exim, others), then what the bounce itself says the envelope sender was:
its ``To``, the returned message's ``Return-Path`` and Postfix's
``X-Postfix-Sender``. The first address ``email_id_of`` knows wins. The
bounce's own ``Return-Path`` is not tried: it is the bounce's envelope
sender, ``<>``. ``message_id`` is the returned original's ``Message-ID``
(from its ``message/rfc822`` or ``text/rfc822-headers`` part; Gmail's
``X-Original-Message-ID`` report field; in a text bounce, the quoted copy
after a line such as qmail's and Yahoo's "--- Below this line is a copy of
the message." or Sendmail's "----- Unsent message follows -----"; the
bounce's ``In-Reply-To``), so that the event log can match a bounce without a VERP
address. A token ``email_id_of`` does not verify gives no ``email_id``.

``provider_event_id`` is ``<the bounce's Message-ID>:<recipient>``, so the
same bounce fed twice is stored once; a bounce without a Message-ID uses the
SHA-256 of its bytes and the recipient.

Everything read here is unauthenticated mail: the matched row's recipients
are not known here, so whoever stores the events must not let a bounce
suppress an address the row never sent to (see the event log's
``unauthenticated``).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import email
import email.errors
import email.header
import email.parser
import email.policy
import hashlib
import itertools
import json
import logging
import quopri
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from email.header import Header
from email.message import Message
from email.utils import getaddresses, parsedate_to_datetime
from typing import Any

import flufl.bounce

from ._events import DeliveryEvent, capped_payload, naive_utc
from ._outside import clean_address, clean_line, clean_text
from ._reasons import TEXT_READ, bounce_reason, ses_reason

__all__ = ["KINDS", "TRANSPORT", "BounceReport", "NotMail", "read_bounce"]

log = logging.getLogger(__name__)

#: The ``transport`` of every event read from a bounce message.
TRANSPORT = "bounce"

#: What :attr:`BounceReport.kind` can be.
KINDS = ("dsn", "arf", "detected", "not-a-bounce")

#: Headers of which a mail message has at least one (RFC 5322 and transport headers).
_MAIL_HEADERS = frozenset({
    "from", "sender", "to", "cc", "date", "subject", "message-id", "received",
    "return-path", "mime-version", "content-type", "delivered-to", "x-original-to",
    "envelope-to", "reply-to", "in-reply-to", "references", "auto-submitted",
})

#: The most bytes looked at for a NUL before the first blank line.
_HEADER_SCAN = 256 * 1024

#: The most events one message gives (Postfix's ``smtpd_recipient_limit``): the rest of an
#: absurd report is left unread, and the reason says so.
MAX_EVENTS = 1000

#: What flufl.bounce reads of a message: the first bytes, and lines cut (see :func:`_trimmed`).
FLUFL_BYTES = 128 * 1024
FLUFL_LINE = 256

#: The most bytes of a message read: its start, where a bounce says what it reports (the
#: headers, the human-readable part, the report, the returned original's headers). The rest
#: of a longer one (a returned original with a big attachment) is not read.
MAX_BYTES = 1024 * 1024

#: The most multipart and message/* parts read: the message is read up to the next one.
#: The stdlib parser passes each line through one generator per enclosing part, so its time
#: grows with their nesting depth times the lines inside (800 levels: 1 s for 42 KB); a
#: bounce has a report, a returned message and its few parts.
_MAX_CONTAINERS = 32
_CONTAINER = re.compile(rb"(?i)\b(?:multipart|message)/")

#: Of each header the VERP address may be in (``Delivered-To``, ``To``, ...), the first
#: :data:`_ADDRESS_HEADERS` fields are read, each up to :data:`_ADDRESS_CHARS` characters,
#: and the first :data:`_ADDRESS_CANDIDATES` addresses found are tried: a real bounce names
#: its envelope recipient once or twice, near the top.
_ADDRESS_HEADERS = 50
_ADDRESS_CHARS = 4000
_ADDRESS_CANDIDATES = 100

#: The most items of a list kept in an event's payload (it is for people to read).
_SUMMARY_ITEMS = 20

#: The longest date read (an RFC 5322 date is about 40 characters).
_DATE_CHARS = 200

#: The MIME tree is walked at most this deep, and through at most this many parts.
_MAX_DEPTH = 30
_MAX_PARTS = 2000

#: The report part types.
_DSN_TYPES = ("message/delivery-status", "message/global-delivery-status")
_ARF_TYPE = "message/feedback-report"
_RETURNED_TYPES = ("message/rfc822", "message/global", "text/rfc822-headers",
                   "message/global-headers")

#: What starts the quoted original in text bounces (qmail and Yahoo; Exim; Sendmail; Gmail, ...).
_COPY_MARKERS = re.compile(
    rb"^[ \t]*-{2,}[ \t]*(?:Below this line is a copy of the message"
    rb"|This is a copy of the message, including all the headers"
    rb"|(?:Original|Unsent) message(?: follows)?|Message header follows"
    rb"|Enclosed is a copy of the message|The header of the original message is following)"
    rb"\.?[ \t]*-*[ \t]*\r?$",
    re.MULTILINE | re.IGNORECASE)

#: A bounce written as text (no DSN part) is read only from a message that looks like one: a
#: sender such as MAILER-DAEMON, or a subject such as "Undelivered Mail". A person's reply or
#: an auto-reply (vacation, out of office) never is one.
_DAEMON = re.compile(
    r"mailer[-_ ]?daemon|post_?master|mail ?delivery|mail administrator|mail ?system|"
    r"\bmailer\b|\bmdaemon\b|delivery (?:status|subsystem)|\bbounces?\b|\bmail ?gw\b",
    re.IGNORECASE)
_BOUNCE_SUBJECT = re.compile(
    r"undeliver|undelivered|not (?:be )?delivered|delivery (?:status|fail|problem|report|"
    r"notification|error|incomplete|delay)|returned mail|return(?:ed)? to sender|failure "
    r"notice|delivery failed|non[- ]?delivery|nondeliver|could not (?:be )?(?:sent|delivered)|"
    r"mail system error|delayed mail|could not send|message (?:not delivered|delayed|"
    r"rejected|blocked)|error sending|mail failure|has failed|failed delivery|"
    r"unable to deliver|delivery warning|mail error",
    re.IGNORECASE)
_REPLY_SUBJECT = re.compile(r"\s*(?:re|fwd?|aw|sv|antw|wg)\s*:", re.IGNORECASE)
_AUTO_REPLY_SUBJECT = re.compile(
    r"\s*(?:\[?auto|out of (?:the )?office|automatic reply|away\b|vacation|abwesen|absence|"
    r"r[eé]ponse automatique|autoreply)", re.IGNORECASE)

#: What a text bounce's explanation is read for: the first characters of its own text.
_EXPLANATION_CHARS = 16_000

#: Where the returned copy starts in a text bounce (read line by line: linear).
_COPY_START = re.compile(
    r"[ \t]*(?:-{2,}|={2,}|\*{2,})?[ \t]*(?:below this line is a copy|this is a copy of|"
    r"(?:original|unsent|returned|rejected|bounced) message(?: headers?)?(?: follows?)?[ \t]*"
    r"(?:-|:|\.|$)|message headers? follows?|headers? of (?:the )?(?:original|returned)|"
    r"the header of the original|enclosed is a copy|included is a copy|below is a copy)",
    re.IGNORECASE)

#: An address's parts, read from an ``@`` outwards (bounded: linear in the text).
_LOCAL_END = re.compile(r"[A-Za-z0-9.!#$%&*+?^_~-]{1,64}\Z")
_DOMAIN = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9-]{0,62}\.)+[A-Za-z]{2,24}(?![A-Za-z0-9-])")

#: Local parts that are a mail system's own, never a failed recipient.
_SYSTEM_LOCALS = frozenset({"mailer-daemon", "double-bounce", "mailerdaemon", "mailer_daemon"})

#: Words of a delay warning (the MTA still tries) and of a message given up after retries.
_STILL_TRYING = re.compile(
    r"will (?:continue|keep) (?:to try|trying|retrying)|still (?:be )?(?:trying|retrying)|"
    r"not yet been delivered|will be retried|will retry|this is a warning|warning message only|"
    r"do not need to resend|delivery (?:has been |is )?delayed|will try (?:again|to deliver)|"
    r"delay(?:ed)? for|temporarily deferred|retry (?:for|until)",
    re.IGNORECASE)
_GAVE_UP = re.compile(
    r"retry time(?:out)? (?:exceeded|expired)|expired|failing for a long time|"
    r"did not accept our requests to connect|cannot send message for|not delivered within|"
    r"was aborted after|failed \d+ attempts|multiple retries|have been failing|"
    r"too long in (?:the )?queue|in the queue too long|could not be delivered within|maximum (?:queue|retry) time|"
    r"queue lifetime|delivery time|message timeout|timed out in queue|"
    r"will not (?:be retried|retry)|no more retries|undeliverable for",
    re.IGNORECASE)

#: How far after a recipient's address its text is read for its status and reason.
_WINDOW = 800

_STATUS = re.compile(r"\b([245])\.(\d{1,3})\.(\d{1,3})\b")
_MESSAGE_ID = re.compile(r"<[^<>\s]+>")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
_SPACES = re.compile(r"\s+")

#: Feedback types that are a recipient's complaint (RFC 5965 section 7.3; missing counts).
_COMPLAINTS = ("abuse", "fraud", "virus", "other", "")


@dataclasses.dataclass(frozen=True)
class BounceReport:
    """What one message turned out to be.

    ``kind`` is one of :data:`KINDS`; ``events`` what it reports (none for
    ``"not-a-bounce"``, possibly none for the others); ``reason`` one line
    for the log saying what was found, or why it is not a bounce.
    """

    kind: str
    events: tuple[DeliveryEvent, ...] = ()
    reason: str = ""


class NotMail(ValueError):
    """The input is not a mail message at all (empty, binary, no headers)."""


def read_bounce(raw: bytes, *,
                email_id_of: Callable[[str], int | None] | None = None) -> BounceReport:
    """What the mail message ``raw`` reports (see the module docstring).

    ``email_id_of`` is the VERP reader: the row id of an address it signed,
    None for any other address. Without it, events are matched by the
    returned Message-ID only. Raises :class:`NotMail` for input that is not
    a mail message.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected the message as bytes, got {type(raw).__name__}")
    data = _bounded(bytes(raw[:MAX_BYTES]))
    msg = _parse(data)
    try:
        reader = _Bounce(data, msg)
    except Exception as exc:  # noqa: BLE001 - a poison message: retrying cannot help
        raise _unreadable(exc) from None
    # The caller's function: what it raises (a database error) is the caller's.
    reader.match(email_id_of)
    try:
        return reader.read()
    except Exception as exc:  # noqa: BLE001 - a poison message: retrying cannot help
        raise _unreadable(exc) from None


def _bounded(data: bytes) -> bytes:
    """``data`` up to its :data:`_MAX_CONTAINERS` + 1st multipart or message/* type, if any."""
    lower = data.lower()  # counted first: a scan with the regular expression costs more
    if lower.count(b"multipart/") + lower.count(b"message/") <= _MAX_CONTAINERS:
        return data
    for count, found in enumerate(_CONTAINER.finditer(data), 1):
        if count > _MAX_CONTAINERS:
            return data[:found.start()]
    return data


def _unreadable(exc: Exception) -> NotMail:
    """A message the reader failed on (a bug of the reader's, not the message's fault)."""
    log.error("A bounce message could not be read (%s: %s): it is dropped as unreadable and "
              "no event is recorded; a bug to report to flask-mail-outbox with the message",
              type(exc).__name__, clean_line(exc, 200))
    return NotMail(f"the message could not be read ({type(exc).__name__})")


# -- parsing -------------------------------------------------------------------------------


def _parse(raw: bytes) -> Message:
    """``raw`` as a message, or :class:`NotMail`."""
    data = raw
    if not data.strip():
        raise NotMail("the input is empty")
    head_end = min(_header_end(data), _HEADER_SCAN)
    if b"\x00" in data[:head_end]:
        raise NotMail("the input is binary data, not a mail message (a NUL byte in what "
                      "would be its header)")
    try:
        msg = email.message_from_bytes(data, policy=email.policy.compat32)
    except RecursionError:
        raise NotMail("the input's MIME parts nest too deeply to be a mail message") from None
    except Exception as exc:  # noqa: BLE001 - the stdlib parser failed on it: poison
        raise _unreadable(exc) from None
    names = {name.lower() for name in msg}
    if not names:
        raise NotMail("the input has no header fields: not a mail message")
    if not names & _MAIL_HEADERS:
        raise NotMail("the input has none of the header fields a mail message has (From, "
                      "Date, To, Received, Content-Type, ...)")
    return msg


def _trimmed(raw: bytes) -> bytes:
    """``raw`` as flufl.bounce reads it: its first :data:`FLUFL_BYTES`, body lines cut.

    Body lines are cut to :data:`FLUFL_LINE` bytes. The detectors run regular
    expressions over every body line, some of them quadratic in a line's
    length (a run of whitespace under ``\\s*(?P<addr>\\S+@\\S+)``): a
    hostile message must not hold the MTA's pipe for minutes. A bounce says
    who failed near its start, before the returned original: the cut
    changes nothing read from the 374 sample bounces of flufl.bounce, bounced and talon.
    """
    head_end = _header_end(raw)
    head, body = raw[:head_end], raw[head_end:FLUFL_BYTES]
    return head[:FLUFL_BYTES] + b"".join(
        line if len(line) <= FLUFL_LINE else line[:FLUFL_LINE] + b"\n"
        for line in body.splitlines(keepends=True))


def _header_end(data: bytes) -> int:
    """Where the header section of ``data`` ends (its length when it has no body)."""
    found = [i for i in (data.find(b"\n\n"), data.find(b"\r\n\r\n")) if i >= 0]
    return min(found) if found else len(data)


def _text(value: Any) -> str:
    """A header value as one line of text: unfolded, without control characters."""
    if value is None:
        return ""
    if isinstance(value, Header):
        try:
            value = str(value)
        except (UnicodeError, LookupError):
            value = value.encode()
    text = str(value).encode("utf-8", "replace").decode("utf-8")
    return _SPACES.sub(" ", _CONTROL.sub(" ", text)).strip()


def _field(block: Message, name: str) -> str:
    return _text(block.get(name))


def _fields(block: Message, name: str, limit: int | None = None) -> list[str]:
    """The ``name`` fields of ``block`` as text (the first ``limit`` of them)."""
    return [_text(value) for value in (block.get_all(name) or [])[:limit]]


def _typed(value: str) -> tuple[str, str]:
    """``"rfc822; a@b"`` as ``("rfc822", "a@b")``; a value without a type as ``("", value)``."""
    kind, semicolon, rest = value.partition(";")
    if not semicolon:
        return "", value.strip()
    return kind.strip().lower(), rest.strip()



def _address(value: str) -> str | None:
    """The email address ``value`` is (``rfc822;`` typed, or bare), or None.

    An RFC 821 source route before it (``@relay.example:user@example.org``)
    is dropped; a value that is only a route (``@mx.example.org``) is none.
    """
    _, text = _typed(value)
    text = text.strip().strip("<>").strip()
    if text.startswith("@"):
        text = text.partition(":")[2]
    return clean_address(text)


def _addresses(values: list[str]) -> list[str]:
    """The addresses named in header ``values``, once each, in order; bounded.

    The first :data:`_ADDRESS_HEADERS` values, each cut to :data:`_ADDRESS_CHARS`
    characters and its comments taken out (the stdlib reads nested comments by
    recursion), then at most :data:`_ADDRESS_CANDIDATES` addresses.
    """
    found: dict[str, None] = {}
    cut = [_uncommented(value[:_ADDRESS_CHARS]) for value in values[:_ADDRESS_HEADERS]]
    for _, address in getaddresses(cut):
        address = address.strip()
        if address and "@" in address:
            found[address] = None
            if len(found) >= _ADDRESS_CANDIDATES:
                break
    return list(found)


def _uncommented(value: str) -> str:
    """``value`` with its RFC 5322 comments (nested, or left open) replaced by a space.

    In one pass: a quoted string is kept (a ``(`` in it is text), as is what
    follows a backslash.
    """
    if "(" not in value:
        return value
    out: list[str] = []
    depth = 0
    quoted = escaped = False
    for char in value:
        if escaped:
            escaped = False
            if not depth:
                out.append(char)
            continue
        if char == "\\":
            escaped = True
            if not depth:
                out.append(char)
        elif quoted:
            quoted = char != '"'
            out.append(char)
        elif char == "(":
            if not depth:
                out.append(" ")
            depth += 1
        elif depth:
            depth -= char == ")"
        elif char == '"':
            quoted = True
            out.append(char)
        else:
            out.append(char)
    return "".join(out)


def _one_line(text: str, limit: int = 300) -> str:
    text = _text(text)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _time(value: str) -> datetime | None:
    """An RFC 5322 date as naive UTC, or None."""
    if not value or len(value) > _DATE_CHARS:
        return None
    try:
        # A zone such as -2359 on 31 Dec 9999 is past what a datetime holds in UTC.
        return naive_utc(parsedate_to_datetime(value))
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _message_id(value: str) -> str | None:
    """The first ``<id>`` in ``value``, or None."""
    match = _MESSAGE_ID.search(value or "")
    if match is None or len(match.group(0)) > 998:
        return None
    return clean_line(match.group(0), 998)


def _clean_value(value: Any) -> Any:
    """A summary value made safe to store: text cleaned and cut, lists bounded."""
    if isinstance(value, str):
        return clean_line(value, 1000)
    if isinstance(value, list):
        return [_clean_value(item) for item in value[:MAX_EVENTS]]
    return value


def _decoded(part: Message) -> bytes:
    """The body of a leaf ``part`` as bytes, its transfer encoding undone."""
    payload = part.get_payload(decode=True)
    return payload if isinstance(payload, bytes) else b""


class _Block:
    """One blank-line separated block of ``name: value`` fields (a DSN or ARF report)."""

    def __init__(self) -> None:
        self.fields: list[tuple[str, str]] = []

    def get(self, name: str) -> str:
        """The first ``name`` field, unfolded ("" when missing)."""
        return next((value for key, value in self.fields if key == name), "")

    def get_all(self, name: str) -> list[str]:
        return [value for key, value in self.fields if key == name]

    def has(self, *names: str) -> bool:
        return any(key in names for key, _ in self.fields)


_FIELD = re.compile(r"([A-Za-z0-9][A-Za-z0-9_-]*)[ \t]*:(.*)")


def _blocks_of(text: str) -> list[_Block]:
    """The blocks of a report body, read leniently.

    Leniently, because real MTAs write broken reports: a continuation line
    without its leading space (MessageLabs), a space before the colon
    (Mimecast). A line that does not start a field continues the last one.
    """
    # Each field's lines are collected, and joined once at the end of the field: joining
    # them per continuation line would be quadratic in a field's length.
    blocks: list[_Block] = []
    current: _Block | None = None
    name: str | None = None
    lines: list[str] = []

    def end_field() -> None:
        if current is not None and name is not None:
            current.fields.append((name, _text(" ".join(lines))))

    names: set[str] = set()
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line.strip():
            end_field()
            current, name, lines = None, None, []
            continue
        match = None if line[:1] in " \t" else _FIELD.fullmatch(line)
        if match is not None and current is not None and _starts_recipient(
                match.group(1).lower(), names):
            # A recipient's block begun where no blank line ended the last one.
            end_field()
            current, name, lines = None, None, []
        if current is None:
            current = _Block()
            blocks.append(current)
            names = set()
        if match is not None:
            end_field()
            name, lines = match.group(1).lower(), [match.group(2)]
            names.add(name)
        elif name is not None:
            lines.append(line)
    end_field()
    return [block for block in blocks if block.fields]


def _starts_recipient(name: str, names: set[str]) -> bool:
    """Whether a field ``name`` begins another recipient's block, after ``names``.

    A second ``Final-Recipient`` does; so does a second ``Original-Recipient``,
    or one after a recipient's ``Final-Recipient`` and ``Status`` (it comes
    before the ``Status``, just before or after ``Final-Recipient``).
    """
    if name == "final-recipient":
        return "final-recipient" in names
    if name == "original-recipient":
        return "original-recipient" in names or {"final-recipient", "status"} <= names
    return False


def _report_blocks(part: Message) -> list[_Block]:
    """The blocks of a delivery-status or feedback-report part.

    The stdlib parser splits ``message/delivery-status`` into header blocks
    itself, strictly (a malformed line ends a block's fields) and ignoring a
    transfer encoding (some MTAs base64 it); other ``message/*`` report types
    it parses as one message. Their text is put back together and read again
    here, leniently.
    """
    encoding = _text(part.get("content-transfer-encoding")).lower()
    payload = part.get_payload()
    if isinstance(payload, list):
        split = part.get_content_type() == "message/delivery-status"
        data = b"\n\n".join(_raw_block(block, split) for block in payload
                             if isinstance(block, Message))
        if encoding in ("base64", "quoted-printable"):
            try:
                data = (base64.b64decode(data) if encoding == "base64"
                        else quopri.decodestring(data))
            except (binascii.Error, ValueError):
                return []
    else:
        data = _decoded(part)
    return _blocks_of(data.decode("utf-8", "replace"))


def _raw_block(block: Message, split: bool) -> bytes:
    """A block the stdlib parsed, as the bytes it came from.

    In a ``split`` delivery-status, a block's "body" can only be the lines
    after a malformed one (a blank line would have ended the block), so it
    follows the fields directly; elsewhere a blank line came between.
    """
    head = "".join(f"{name}: {value}\n" for name, value in block.raw_items())
    body = block.get_payload(decode=True)
    body = body if isinstance(body, bytes) else b""
    between = b"" if split or not head or not body else b"\n"
    return head.encode("utf-8", "surrogateescape") + between + body


def _leaves(msg: Message) -> Iterator[Message]:
    """The parts of ``msg``'s own MIME tree, depth first; never inside a returned message."""
    stack: list[tuple[Message, int]] = [(msg, 0)]
    seen = 0
    while stack and seen < _MAX_PARTS:
        part, depth = stack.pop()
        seen += 1
        yield part
        if part.get_content_maintype() == "multipart" and depth < _MAX_DEPTH:
            children = part.get_payload()
            if isinstance(children, list):
                stack.extend((child, depth + 1) for child in reversed(children)
                             if isinstance(child, Message))


# -- reading -------------------------------------------------------------------------------


class _Bounce:
    """One message being read."""

    def __init__(self, raw: bytes, msg: Message) -> None:
        self.raw = raw
        self.msg = msg
        self.parts = list(_leaves(msg))
        self.dsn_blocks = [block for part in self.parts if part.get_content_type() in _DSN_TYPES
                           for block in _report_blocks(part)]
        self.is_dsn = any(part.get_content_type() in _DSN_TYPES for part in self.parts)
        self.arf_part = next((p for p in self.parts if p.get_content_type() == _ARF_TYPE), None)
        self.own_id = _message_id(_field(msg, "message-id"))
        self._raw_hash: hashlib._Hash | None = None
        self.date = _time(_field(msg, "date"))
        self.returned = self._returned()
        self.candidates = self._candidates()
        self.envelope: str | None = None
        self.email_id: int | None = None
        self._explanation: str | None = None
        self._positions: _Positions | None = None

    def read(self) -> BounceReport:
        if self.is_dsn:
            report = self._dsn()
            if report.events:
                return report
            # A DSN whose status part names nobody (Google Workspace sends some): its
            # text may still say who failed.
            detected = self._detected()
            return detected if detected.events else report
        if self.arf_part is not None:
            return self._arf(self.arf_part)
        notification = self._ses_notification() or self._hotmail_complaint()
        if notification is not None:
            return notification
        if self.looks_like_bounce():
            # DSN fields written into the text (Amazon WorkMail): read as a DSN.
            blocks = _blocks_of(_text_report(self.explanation_text()))
            if any(block.has("final-recipient") for block in blocks):
                self.dsn_blocks = blocks
                report = self._dsn()
                if report.events:
                    return report
        return self._detected()

    # -- what every event shares ----------------------------------------------------------

    def _returned(self) -> Message | None:
        """The headers of the returned original, when the bounce includes them."""
        parser = email.parser.BytesHeaderParser(policy=email.policy.compat32)
        for part in self.parts[1:]:
            if part.get_content_type() not in _RETURNED_TYPES:
                continue
            payload = part.get_payload()
            if isinstance(payload, list) and payload and isinstance(payload[0], Message):
                return payload[0]
            return parser.parsebytes(_decoded(part).lstrip(b"\r\n"))
        if self.msg.is_multipart():
            return None
        marker = _COPY_MARKERS.search(self.raw, _header_end(self.raw))
        if marker is None:
            return None
        return parser.parsebytes(self.raw[marker.end():].lstrip(b"\r\n"))

    def _candidates(self) -> list[str]:
        """The addresses that may be the VERP address, most trustworthy first."""
        values: list[str] = []
        for name in ("x-original-to", "delivered-to", "envelope-to", "x-envelope-to", "to"):
            values += _fields(self.msg, name, _ADDRESS_HEADERS)
        if self.returned is not None:
            values += _fields(self.returned, "return-path", _ADDRESS_HEADERS)
        senders = (value for block in self.dsn_blocks
                   for value in block.get_all("x-postfix-sender"))
        values += [_typed(value)[1] for value in itertools.islice(senders, _ADDRESS_HEADERS)]
        return _addresses(values)

    def match(self, email_id_of: Callable[[str], int | None] | None) -> None:
        """Find the VERP address of ours the bounce came back to, and its row."""
        if email_id_of is None:
            return
        for address in self.candidates:
            email_id = email_id_of(address)
            if email_id is not None:
                self.envelope, self.email_id = clean_line(address, 320), email_id
                return

    def original_id(self, extra: str = "") -> str | None:
        """The returned original's Message-ID, by the best source there is."""
        sources = [_field(self.returned, "message-id") if self.returned is not None else "",
                   extra, _field(self.msg, "in-reply-to")]
        for source in sources:
            found = _message_id(source)
            if found is not None:
                return found
        return None

    def event_id(self, recipient: str | None) -> str:
        """``<bounce Message-ID>:<recipient>``, or a SHA-256 when that cannot be."""
        tail = recipient or ""
        if self.own_id is not None:
            value = f"{self.own_id}:{tail}"
            if len(value) <= 255:
                return value
            return "sha256:" + hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()
        # The message is hashed once, not once per event (a report of 1,000 recipients).
        if self._raw_hash is None:
            self._raw_hash = hashlib.sha256(self.raw + b"\x00")
        digest = self._raw_hash.copy()
        digest.update(tail.encode("utf-8", "replace"))
        return "sha256:" + digest.hexdigest()

    def event(self, event_type: str, recipient: str | None, *, occurred_at: datetime | None,
              message_id: str | None, summary: dict[str, Any], bounce_kind: str | None = None,
              description: str = "", mta_response: str = "",
              reason: str | None = None) -> DeliveryEvent:
        # What the message says is made safe to store here, once (recipient is an
        # address of _address's, the ids are of _message_id's: clean_address'd and cut).
        summary = {key: _clean_value(value) for key, value in summary.items()
                   if value is not None and value != "" and value != []}
        if self.envelope is not None:
            summary["envelope_recipient"] = self.envelope
        if self.own_id is not None:
            summary["bounce_message_id"] = self.own_id
        return DeliveryEvent(
            event_type=event_type, recipient=recipient, occurred_at=occurred_at,
            transport=TRANSPORT, provider_event_id=self.event_id(recipient),
            email_id=self.email_id, bounce_kind=bounce_kind, reason=reason,
            description=clean_line(description, 500), mta_response=clean_text(mta_response),
            message_id=message_id, payload=capped_payload(summary))

    def explanation(self) -> str:
        """The first text/plain part of the bounce's own, decoded, cut at ``TEXT_READ``."""
        for part in self.parts:
            if part.get_content_type() == "text/plain":
                charset = part.get_content_charset() or "ascii"
                try:
                    return _decoded(part)[:TEXT_READ * 4].decode(charset, "replace")
                except LookupError:  # an unknown charset name
                    return _decoded(part)[:TEXT_READ * 4].decode("ascii", "replace")
        return ""

    def matched(self) -> str:
        if self.email_id is not None:
            return f"email {self.email_id} by its VERP address"
        return "no VERP address of ours"

    # -- RFC 3464 ---------------------------------------------------------------------------

    def _dsn(self) -> BounceReport:
        per_message = _Block()
        recipients: list[_Block] = []
        for block in self.dsn_blocks:
            if block.has("final-recipient", "original-recipient", "action"):
                recipients.append(block)
            else:
                per_message.fields += block.fields
        mta = _typed(per_message.get("reporting-mta"))[1]
        source = f" from {mta}" if mta else ""
        if not recipients:
            return BounceReport("dsn", (), _one_line(
                f"a delivery status notification{source} with no per-recipient block: "
                "nothing to record"))
        original = self.original_id(per_message.get("x-original-message-id"))
        arrival = _time(per_message.get("arrival-date"))
        # Exim's X-Failed-Recipients names the address when its one block names a pipe or
        # a file (a local delivery that failed at the far end).
        failed = [a for a in map(_address, _addresses(_fields(
            self.msg, "x-failed-recipients", _ADDRESS_HEADERS))) if a]
        fallback = failed[0] if len(recipients) == 1 and len(failed) == 1 else None
        kept = _unique([self._dsn_event(block, mta, original, arrival, fallback)
                        for block in recipients[:MAX_EVENTS]])
        counts = ", ".join(f"{sum(e.event_type == t for e in kept)} {t}"
                           for t in dict.fromkeys(e.event_type for e in kept))
        return BounceReport("dsn", kept, _one_line(
            f"a delivery status notification{source}: {counts}"
            f"{_unread(len(recipients), 'recipient blocks')}; {self.matched()}"))

    def _dsn_event(self, block: _Block, mta: str, original: str | None,
                   arrival: datetime | None, fallback: str | None) -> DeliveryEvent:
        final = block.get("final-recipient")
        original_rcpt = block.get("original-recipient")
        recipient = _address(original_rcpt) or _address(final) or fallback
        action_text = block.get("action")
        action = re.split(r"[\s(;]", action_text.lower(), maxsplit=1)[0]
        status_text = block.get("status")
        status_match = _STATUS.search(status_text)
        status = status_match.group(0) if status_match else ""
        diagnostic = block.get("diagnostic-code")
        bounce_kind = None
        failed = action.startswith("fail") or action in ("error", "expired")  # OpenSMTPD, SendGrid
        # OpenSMTPD mails its give-up as "delayed" with 4.4.7, delivery time expired.
        failed = failed or (action == "delayed" and status.endswith(".4.7"))
        reason = bounce_reason(status_text, diagnostic, failed=failed) \
            if failed or action == "delayed" else None
        if reason is not None:
            reason = self._refined(reason, status_text, diagnostic, recipient, failed)
        if failed:
            event_type = "bounced"
            # Without a Status, the Diagnostic-Code's own code says the class.
            klass = status[:1] or _reply_class(diagnostic)
            # A message a server kept until it gave up (a 4.x.x, or a 5.4.7 "expired")
            # is a transient failure: the address may well be alive.
            bounce_kind = "permanent" if klass == "5" and reason != "expired" else "transient"
            described = f"Status {status}" if status else f"Action {action_text}, no Status"
        elif action == "delayed":
            event_type, described = "deferred", f"Status {status or 'missing'}"
        elif action in ("delivered", "expanded"):
            event_type, described = "delivered", f"Action {action}"
        else:
            event_type = "unknown"
            described = f"Action {action_text or 'missing'}" + (
                " (passed on to a system that sends no DSN: delivery is not known)"
                if action == "relayed" else "") + (f", Status {status}" if status else "")
        summary = {
            "kind": "dsn", "reporting_mta": mta, "action": action_text, "status": status_text,
            "final_recipient": final, "original_recipient": original_rcpt,
            "diagnostic_code": diagnostic, "remote_mta": block.get("remote-mta"),
            "last_attempt_date": block.get("last-attempt-date"),
            "will_retry_until": block.get("will-retry-until"),
            "original_message_id": original,
        }
        return self.event(
            event_type, recipient, message_id=original, summary=summary,
            occurred_at=_time(block.get("last-attempt-date")) or self.date or arrival,
            bounce_kind=bounce_kind, description=described + (f" from {mta}" if mta else ""),
            mta_response=_typed(diagnostic)[1] if diagnostic else "",
            reason=reason)

    def _refined(self, reason: str, status: str, diagnostic: str, recipient: str | None,
                 failed: bool) -> str:
        """A DSN block's ``reason``, read again with the bounce's text about ``recipient``
        when its fields say no more than "undefined" (a bare 5.0.0, no Diagnostic-Code)."""
        context = diagnostic
        if recipient and (reason == "undefined" or reason in _ADDRESS_REASONS):
            text = self.explanation_text()
            window = _window(text, recipient, self.text_positions())
            if window:
                context = f"{diagnostic}\n{window}"
                if reason == "undefined":
                    reason = bounce_reason(status, context, failed=failed)
        return _filtered(reason, context, status)

    # -- RFC 5965 ---------------------------------------------------------------------------

    def _arf(self, part: Message) -> BounceReport:
        report = _Block()
        for block in _report_blocks(part):
            report.fields += block.fields
        feedback = report.get("feedback-type").lower()
        agent = report.get("user-agent")
        source = f" from {agent}" if agent else ""
        if feedback in _COMPLAINTS:
            event_type = "complained"
        elif feedback == "opt-out":
            event_type = "unsubscribed"
        else:
            return BounceReport("arf", (), _one_line(
                f"a feedback report of type {feedback}{source}: not a recipient's complaint "
                "(an authentication failure or not-spam report), nothing to record"))
        rcpts = list(dict.fromkeys(
            a for a in (_address(v) for v in report.get_all("original-rcpt-to")) if a))
        if not rcpts and self.returned is not None:
            named = _addresses(_fields(self.returned, "to", _ADDRESS_HEADERS))
            only = _address(named[0]) if len(named) == 1 else None
            if only:
                rcpts = [only]
        original = self.original_id()
        arrival = report.get("arrival-date") or report.get("received-date")
        summary = {
            "kind": "arf", "feedback_type": feedback, "user_agent": agent,
            # Every event of the report carries it: the first few, for people to read.
            "original_rcpt_to": report.get_all("original-rcpt-to")[:_SUMMARY_ITEMS],
            "original_mail_from": report.get("original-mail-from"), "arrival_date": arrival,
            "source_ip": report.get("source-ip"),
            "reported_domain": report.get("reported-domain"),
            "original_message_id": original,
        }
        description = f"Feedback-Type {feedback or 'missing'}" + (
            f", reported by {agent}" if agent else "")
        targets: list[str | None] = [*rcpts[:MAX_EVENTS]] or [None]
        events = _unique([self.event(event_type, rcpt, occurred_at=_time(arrival) or self.date,
                                     message_id=original, summary=summary,
                                     description=description,
                                     reason="complaint" if event_type == "complained" else None)
                          for rcpt in targets])
        who = ", ".join(rcpts[:3]) + (", ..." if len(rcpts) > 3 else "") if rcpts \
            else "no recipient named"
        return BounceReport("arf", events, _one_line(
            f"a feedback report ({feedback or 'no type'}){source} for {who}"
            f"{_unread(len(rcpts), 'recipients')}; {self.matched()}"))

    # -- flufl.bounce ----------------------------------------------------------------------

    def _detected(self) -> BounceReport:
        try:
            temporary, permanent = flufl.bounce.all_failures(email.message_from_bytes(
                _trimmed(self.raw), policy=email.policy.compat32))
        except Exception as exc:  # noqa: BLE001 - a detector bug: retrying cannot help
            log.error("flufl.bounce failed on a message (%s: %s): it is taken as not a "
                      "bounce, and no event is recorded; a bug of the detector, to report "
                      "to flufl.bounce with the message", type(exc).__name__, exc)
            return BounceReport("not-a-bounce", (), _one_line(
                f"flufl.bounce failed on it ({type(exc).__name__}): taken as not a bounce"))
        if not self.looks_like_bounce():
            # flufl.bounce reads the quoted To: of a person's reply as a failure.
            permanent = temporary = frozenset()
        excluded = self.not_recipients()
        found: dict[str, bool] = {}
        for addresses, is_temporary in ((permanent, False), (temporary, True)):
            for value in sorted(addresses):
                address = _address(value.decode("ascii", "replace"))
                # flufl.bounce may name the returned message's sender or its Message-ID.
                if address and not _excluded(address, excluded):
                    found.setdefault(address, is_temporary)
        by = "flufl.bounce"
        text = self.explanation_text()
        if not found and self.looks_like_bounce():
            found = dict.fromkeys(self.text_recipients(text, excluded), False)
            by = "its text"
        if not found:
            return BounceReport("not-a-bounce", (), (
                "no delivery-status or feedback-report part, and flufl.bounce recognised no "
                "bounce"))
        original = self.original_id()
        events = []
        positions = self.text_positions()
        for address, flufl_temporary in list(found.items())[:MAX_EVENTS]:
            # The bounce's own text says why and how lasting (no DSN field does here): the
            # words after the address, else the whole text.
            window = _window(text, address, positions)
            event_type, bounce_kind, reason = _classify(window, text)
            if event_type == "deferred" and not flufl_temporary and by == "flufl.bounce" \
                    and not _STILL_TRYING.search(window):
                event_type, bounce_kind = "bounced", "transient"
            summary = {"kind": "detected", "address": address,
                       "temporary": event_type == "deferred",
                       "subject": _one_line(_field(self.msg, "subject"), 200),
                       "from": _one_line(_field(self.msg, "from"), 200),
                       "original_message_id": original}
            events.append(self.event(
                event_type, address, occurred_at=self.date, message_id=original,
                summary=summary, bounce_kind=bounce_kind, reason=reason,
                description=("delay warning" if event_type == "deferred" else "bounce")
                + f" recognised by {by} (not a standard DSN)"))
        named = ", ".join(list(found)[:3]) + (", ..." if len(found) > 3 else "")
        return BounceReport("detected", _unique(events), _one_line(
            f"a non-standard bounce recognised by {by} for {named}"
            f"{_unread(len(found), 'addresses')}; {self.matched()}"))

    # -- text bounces, read here -------------------------------------------------------------

    def looks_like_bounce(self) -> bool:
        """Whether the message says it is a bounce: a mail system's sender or a bounce's
        subject, and no sign of a reply or an auto-reply."""
        subject = _decoded_header(self.msg.get("subject"))
        sender = _text(self.msg.get("from"))[:500]
        daemon = bool(_DAEMON.search(sender))
        if any(self.msg.get(name) is not None
               for name in ("x-autoreply", "x-autorespond", "x-autoresponder")):
            return False
        if _text(self.msg.get("precedence")).lower() == "auto_reply":
            return False
        bounce_subject = bool(_BOUNCE_SUBJECT.search(subject))
        if not daemon and (_REPLY_SUBJECT.match(subject) or not bounce_subject):
            return False
        return not (_AUTO_REPLY_SUBJECT.match(subject) and not bounce_subject)

    def explanation_text(self) -> str:
        """The bounce's own words: its text parts (else its HTML's text), up to the
        returned copy, the first :data:`_EXPLANATION_CHARS` characters."""
        if self._explanation is not None:
            return self._explanation
        plain: list[str] = []
        html: list[str] = []
        for part in self.parts:
            ctype = part.get_content_type()
            payload = part.get_payload()
            if part.get_content_maintype() == "multipart" and isinstance(payload, str):
                # A multipart whose boundary the parser did not find: its body is text.
                ctype = "text/plain"
            if ctype not in ("text/plain", "text/html") or part.is_multipart():
                continue
            charset = part.get_content_charset() or "utf-8"
            data = _decoded(part)[:_EXPLANATION_CHARS * 2]
            try:
                text = data.decode(charset, "replace")
            except LookupError:  # an unknown charset name
                text = data.decode("utf-8", "replace")
            (plain if ctype == "text/plain" else html).append(text)
        if plain:
            text = "\n".join(plain)
        else:
            text = _TAG.sub(" ", "\n".join(html)).replace("&lt;", "<").replace("&gt;", ">")
        self._explanation = _before_copy(text[:_EXPLANATION_CHARS])
        return self._explanation

    def text_positions(self) -> _Positions:
        """Where the explanation names each address (scanned once)."""
        if self._positions is None:
            self._positions = _Positions(self.explanation_text(), self.not_recipients())
        return self._positions

    def not_recipients(self) -> set[str]:
        """Addresses a bounce's text names that are no failed recipient: the bounce's own
        sender and recipient, the returned message's sender, parts of Message-IDs."""
        values: list[str] = []
        for name in ("from", "sender", "reply-to", "to", "return-path", "delivered-to",
                     "envelope-to", "x-envelope-to"):
            values += _fields(self.msg, name, _ADDRESS_HEADERS)
        ids = [_field(self.msg, name) for name in ("message-id", "in-reply-to", "references")]
        if self.returned is not None:
            for name in ("from", "sender", "reply-to", "return-path"):
                values += _fields(self.returned, name, _ADDRESS_HEADERS)
            ids += [_field(self.returned, name)
                    for name in ("message-id", "in-reply-to", "references")]
        found = {a.lower() for a in (_address(v) for v in _addresses(values)) if a}
        for value in ids:
            for address, _ in _text_addresses(value[:_ADDRESS_CHARS]):
                found.add(address.lower())
        # Headers of the returned message quoted in the text (Zoho's): its Message-ID
        # and its sender are no recipients.
        for line in self.explanation_text().splitlines():
            quoted = _SENDER_LINE.match(line) if "@" in line else None
            if quoted is not None:
                named = _line_addresses(line)
                # A Message-ID is no address at all; a From: names one sender (qmail's
                # "From: <sender> RCPT: <recipient>" names the recipient after it).
                found.update(a.lower() for a in (named if quoted.group(1) else named[:1]))
        return found

    def text_recipients(self, text: str, excluded: set[str]) -> list[str]:
        """The failed recipients a text bounce names.

        Exim's ``X-Failed-Recipients`` when it has one; else the addresses of its
        text that are no sender and no Message-ID (:meth:`not_recipients`),
        those the returned message was sent to first when it names any.
        """
        failed = [a for a in (_address(v) for v in _addresses(_fields(
            self.msg, "x-failed-recipients", _ADDRESS_HEADERS))) if a]
        if failed:
            return failed[:MAX_EVENTS]
        named = [address for address, _ in _text_addresses(text)
                 if address.rpartition("@")[0].lower() not in _SYSTEM_LOCALS]
        sent_to: set[str] = set()
        if self.returned is not None:
            # The returned message's own recipients, even one that is its sender too.
            sent_to = {a.lower() for a in (_address(v) for v in _addresses(
                _fields(self.returned, "to", _ADDRESS_HEADERS)
                + _fields(self.returned, "cc", _ADDRESS_HEADERS))) if a}
        return [address for address in named
                if address.lower() in sent_to or not _excluded(address, excluded)]

    # -- Hotmail's complaints before ARF ----------------------------------------------------

    def _hotmail_complaint(self) -> BounceReport | None:
        """Hotmail's complaint ("complaint about message from <ip>", the message attached
        with an ``X-HmXmrOriginalRecipient`` header), or None."""
        if self.returned is None or not _HOTMAIL_COMPLAINT.match(_field(self.msg, "subject")):
            return None
        named = [a for a in (_address(v) for v in _fields(
            self.returned, "x-hmxmroriginalrecipient", _ADDRESS_HEADERS)) if a]
        if not named:
            return None
        original = self.original_id()
        events = [self.event("complained", address, occurred_at=self.date, message_id=original,
                             summary={"kind": "hotmail", "original_message_id": original},
                             reason="complaint", description="complaint from Hotmail (not ARF)")
                  for address in named[:MAX_EVENTS]]
        return BounceReport("arf", _unique(events), _one_line(
            f"a Hotmail complaint (not ARF) for {', '.join(named[:3])}; {self.matched()}"))

    # -- Amazon SES notifications mailed by SNS --------------------------------------------

    def _ses_notification(self) -> BounceReport | None:
        """An SES bounce or complaint notification (JSON mailed by SNS), or None."""
        if self.msg.is_multipart():
            return None
        body = _decoded(self.msg)
        start = body.find(b"{")
        if start < 0 or start > 2000 or b"notificationType" not in body[:4000]:
            return None
        end = body.rfind(b"}")
        try:
            # SNS folds the JSON's long line; a fold is no part of the JSON.
            data = json.loads(re.sub(rb"\r?\n ?", b"", body[start:end + 1]))
            if isinstance(data, dict) and isinstance(data.get("Message"), str):
                data = json.loads(data["Message"])  # the SNS envelope around it
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        kind = str(data.get("notificationType") or "")
        details = data.get(kind.lower())
        if not isinstance(details, dict):
            return None
        events = []
        original = None
        mail = data.get("mail")
        if isinstance(mail, dict):
            common = mail.get("commonHeaders")
            if isinstance(common, dict):
                original = _message_id(str(common.get("messageId") or ""))
        if kind == "Bounce":
            bounce_type = str(details.get("bounceType") or "")
            sub_type = str(details.get("bounceSubType") or "")
            listed = details.get("bouncedRecipients")
            bounce_kind = "transient" if bounce_type == "Transient" else "permanent"
            for item in listed if isinstance(listed, list) else []:
                if not isinstance(item, dict):
                    continue
                diagnostic = str(item.get("diagnosticCode") or "")
                recipient = _address(str(item.get("emailAddress") or ""))
                events.append(self.event(
                    "bounced", recipient, occurred_at=self.date, message_id=original,
                    summary={"kind": "ses-notification", "bounce_type": bounce_type,
                             "bounce_sub_type": sub_type, "diagnostic_code": diagnostic},
                    bounce_kind=bounce_kind, mta_response=diagnostic,
                    reason=ses_reason(bounce_type, sub_type, diagnostic),
                    description=f"SES {bounce_type or 'bounce'} {sub_type}".strip()))
        elif kind == "Complaint":
            listed = details.get("complainedRecipients")
            for item in listed if isinstance(listed, list) else []:
                if isinstance(item, dict):
                    events.append(self.event(
                        "complained", _address(str(item.get("emailAddress") or "")),
                        occurred_at=self.date, message_id=original,
                        summary={"kind": "ses-notification", "feedback_type": str(
                            details.get("complaintFeedbackType") or "")},
                        reason="complaint", description="SES complaint"))
        elif kind == "Delivery":
            listed = details.get("recipients")
            for item in listed if isinstance(listed, list) else []:
                events.append(self.event(
                    "delivered", _address(str(item)), occurred_at=self.date,
                    message_id=original, summary={"kind": "ses-notification"},
                    description="SES delivery"))
        else:
            return None
        return BounceReport("detected", _unique(events[:MAX_EVENTS]), _one_line(
            f"an Amazon SES {kind.lower()} notification for {len(events)} recipients; "
            f"{self.matched()}"))


_TAG = re.compile(r"<[^<>]*>")
_ADDRESS_REASONS = frozenset({"user_unknown", "host_unknown", "suspended", "has_moved",
                              "not_accepting"})
_AT_MAIL_FROM = re.compile(r"after mail from|in reply to mail from|>>> mail from",
                           re.IGNORECASE)
_NO_ACCOUNT = re.compile(r"(?:doesn't|does not) have an? [^\s]{1,100} account", re.IGNORECASE)
_AT_DATA = re.compile(r"end of data|after data|>>> data\b|in reply to data|after the data",
                      re.IGNORECASE)
_HOTMAIL_COMPLAINT = re.compile(r"\s*complaint about message from ", re.IGNORECASE)
_HEADER_LINE = re.compile(r"[ \t>]*(?:message-id|in-reply-to|references|from|sender|reply-to|"
                          r"return-path|to|cc|bcc|x-[a-z-]*id)[ \t]*:", re.IGNORECASE)
_SENDER_LINE = re.compile(r"[ \t>]*(?:(message-id|in-reply-to|references|x-[a-z-]*id)|from|"
                          r"sender|reply-to|return-path)[ \t]*:", re.IGNORECASE)
_CANDIDATE = re.compile(r"([A-Za-z0-9.!#$%&*+?^_~-]{1,64})@((?:[A-Za-z0-9][A-Za-z0-9-]{0,62}\.)"
                        r"{1,8}[A-Za-z]{2,24})(?![A-Za-z0-9-])")
_DSN_FIELD = re.compile(r"^[ \t]*(?:reporting-mta|final-recipient|original-recipient|action)"
                        r"[ \t]*:", re.IGNORECASE | re.MULTILINE)


def _decoded_header(value: Any) -> str:
    """A header's text with its RFC 2047 words decoded (a broken one as it is), one line."""
    text = _text(value)[:500]
    if "=?" not in text:
        return text
    try:
        return _text(str(email.header.make_header(email.header.decode_header(text))))
    except (UnicodeError, LookupError, ValueError, email.errors.HeaderParseError):
        return text


def _before_copy(text: str) -> str:
    """``text`` up to the line where a returned copy starts (none: all of it)."""
    offset = 0
    for line in text.splitlines(keepends=True):
        if _COPY_START.match(line):
            return text[:offset]
        offset += len(line)
    return text


def _text_report(text: str) -> str:
    """The DSN fields written into a bounce's text, from the first one on ("" if none)."""
    found = _DSN_FIELD.search(text)
    return text[found.start():] if found else ""


def _text_addresses(text: str) -> list[tuple[str, int]]:
    """The addresses ``text`` names, once each, with where each is first; bounded.

    Lines that are a quoted header naming a sender or a Message-ID are skipped.
    """
    found: dict[str, int] = {}
    lowered: set[str] = set()
    offset = 0
    for line in text.splitlines(keepends=True):
        if "@" in line and not _HEADER_LINE.match(line):
            for match in _CANDIDATE.finditer(line):
                address = clean_address(f"{match.group(1).lstrip('.')}@{match.group(2)}")
                if address and address.lower() not in lowered:
                    lowered.add(address.lower())
                    found[address] = offset + match.start()
                    if len(found) >= MAX_EVENTS:
                        return list(found.items())
        offset += len(line)
    return list(found.items())


def _line_addresses(line: str) -> list[str]:
    """The addresses one line names (bounded: a line of the explanation)."""
    found = (clean_address(f"{m.group(1).lstrip('.')}@{m.group(2)}")
             for m in _CANDIDATE.finditer(line))
    return [address for address in found if address]


def _excluded(address: str, excluded: set[str]) -> bool:
    """Whether ``address`` is no failed recipient (a system's own, or ``excluded``)."""
    local = address.rpartition("@")[0].lower()
    return address.lower() in excluded or local in _SYSTEM_LOCALS


class _Positions:
    """Where each address is first named in a text (case-insensitively), and the next
    recipient named after a place (a sender's address is no end of a recipient's lines):
    one scan of the text, then a lookup per recipient."""

    def __init__(self, text: str, excluded: set[str]) -> None:
        self.first: dict[str, int] = {}
        for address, position in _text_addresses(text):
            self.first.setdefault(address.lower(), position)
        self.starts = sorted(position for address, position in self.first.items()
                             if not _excluded(address, excluded))

    def after(self, start: int) -> int | None:
        """The first position of an address named after ``start``, if any."""
        index = bisect.bisect_right(self.starts, start)
        return self.starts[index] if index < len(self.starts) else None


def _window(text: str, address: str, positions: _Positions) -> str:
    """The text about ``address``: from its line's start, :data:`_WINDOW` characters on,
    up to the next address named ("" when the text does not name it)."""
    start = positions.first.get(address.lower())
    if start is None:
        return ""
    following = positions.after(start)
    end = start + _WINDOW if following is None else min(start + _WINDOW, following)
    return text[text.rfind("\n", 0, start) + 1:end]


def _classify(window: str, text: str) -> tuple[str, str | None, str]:
    """(event type, bounce kind, reason) of a recipient of a text bounce.

    A delay warning (the MTA still tries, and says it did not give up) is
    ``deferred``; a message given up after retries (Exim's "retry timeout
    exceeded", qmail's "in the queue too long"), or refused with a 4xx, a
    transient bounce; anything else a permanent one. The status or reply code
    in the recipient's own lines decides the class, else the text's first.
    """
    gave_up = _GAVE_UP.search(window) or _GAVE_UP.search(text)
    if not gave_up and _STILL_TRYING.search(text):
        return "deferred", None, bounce_reason(window or text, window or text, failed=False)
    klass = ""
    for source in (window, text):
        found = _STATUS.search(source) or _REPLY.search(source)
        if found is not None:
            klass = found.group(1)
            break
    reason = bounce_reason(window, window) if window else "undefined"
    if reason == "undefined":
        reason = bounce_reason(text, text)
    if gave_up:
        return "bounced", "transient", "expired"
    return ("bounced", "transient" if klass == "4" else "permanent",
            _filtered(reason, window or text))


def _filtered(reason: str, context: str, status: str = "") -> str:
    """``reason``, except where the SMTP dialogue shows the address was not the cause.

    A refusal at MAIL FROM is about the sender ("Unroutable sender address"):
    ``policy``, whatever words it uses. An unknown user refused only after the
    message's content (at DATA: the address was accepted first), with no 5.1.x
    status naming the address, is the receiver's filter, ``policy`` too: it
    says nothing lasting about the address (sisimai's "filtered").
    """
    if reason in _ADDRESS_REASONS and _AT_MAIL_FROM.search(context[:_EXPLANATION_CHARS]):
        return "policy"  # refused at MAIL FROM: about the sender, not the recipient
    if reason != "user_unknown":
        return reason
    code = _STATUS.search(f"{status}\n{context[:_EXPLANATION_CHARS]}")
    if code is not None and code.group(2) == "1":  # a 5.1.x names the address itself
        return reason
    if _NO_ACCOUNT.search(context[:_EXPLANATION_CHARS]):
        return reason  # Yahoo checks its users at DATA, and says so
    return "policy" if _AT_DATA.search(context[:_EXPLANATION_CHARS]) else reason


def _reply_class(diagnostic: str) -> str:
    """The class (``"5"``, ``"4"``) a diagnostic's status or reply code says, or ""."""
    text = _typed(diagnostic)[1][:TEXT_READ] if diagnostic else ""
    found = _STATUS.search(text) or _REPLY.search(text[:200])
    return found.group(1) if found else ""


_REPLY = re.compile(r"(?<![\d.])([45])\d\d(?![\d.])")


def _unread(count: int, what: str) -> str:
    """What the reason says when more than :data:`MAX_EVENTS` were found."""
    return f" (only the first {MAX_EVENTS} of {count} {what} read)" if count > MAX_EVENTS else ""


def _unique(events: list[DeliveryEvent]) -> tuple[DeliveryEvent, ...]:
    """``events`` without a second event of the same ``provider_event_id`` (the first wins)."""
    seen: set[str | None] = set()
    kept = []
    for event in events:
        if event.provider_event_id not in seen:
            seen.add(event.provider_event_id)
            kept.append(event)
    return tuple(kept)
