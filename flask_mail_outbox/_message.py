"""Messages: the Flask-Mail compatible ``Message``, its validation, and the MIME it becomes.

``prepare_message()`` is the one place where a ``Message`` is checked and turned
into the exact bytes that will go over SMTP. ``mail.send()`` calls it before
anything is written, so a bad message raises ``InvalidMessage`` in the request
that made it, never later in a worker.

The MIME is written by hand rather than through ``email.message.EmailMessage``:
the stdlib route costs milliseconds per message (header folding through the
policy machinery dominates), and this runs inside every ``mail.send()``. What
is written is plain RFC 5322 / RFC 2045-2047 / RFC 2231, every line ends in
CRLF, and the tests read every shape back with ``email.parser.BytesParser``.
"""

from __future__ import annotations

import binascii
import codecs
import functools
import math
import mimetypes
import re
import secrets
import struct
import time
import unicodedata
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.charset import Charset
from email.utils import format_datetime, parseaddr
from itertools import chain
from typing import Any, NamedTuple, TypeAlias

import email_validator
from email_validator import EmailNotValidError, validate_email
from flask import current_app, has_app_context

from ._errors import ConfigError, InvalidMessage

__all__ = ["Address", "Attachment", "AttachmentInfo", "Message", "PreparedEmail", "prepare_message"]

#: An address as users give it: ``"a@x.org"``, ``"Name <a@x.org>"`` or ``("Name", "a@x.org")``.
Address: TypeAlias = "str | tuple[str, str]"

_DEFAULT_MAX_MESSAGE_BYTES = 25 * 1024 * 1024

# A MIME part: its header lines (no CRLF) and its encoded body (CRLF lines).
_Part: TypeAlias = "tuple[list[str], bytes]"

# RFC 5322 recommends 78 characters per header line; 998 is the hard limit.
_FOLD_AT = 78
_HARD_LINE_LIMIT = 998
# Longest raw token (word, quoted name, filename) written on one header line;
# anything longer goes through RFC 2047/2231 encoding, which can be split.
_MAX_RAW_TOKEN = 900
# UTF-8 bytes per RFC 2047 encoded-word: 39 bytes -> 52 base64 characters,
# 64 with the "=?utf-8?b?" and "?=" around them (the limit is 75), so that
# "Subject: " or "Reply-To: " plus one word still fits in 78 characters.
_EW_BYTES = 39
# Base64 line length (RFC 2045), and a struct that cuts 256 such lines at once.
_B64_LINE = 76
_B64_BLOCK = struct.Struct(f"{_B64_LINE}s" * 256)
# Characters of an RFC 2231 percent-encoded parameter per continuation line.
_RFC2231_CHUNK = 60

_ATEXT_WORDS = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?: [A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*")
_HEADER_NAME = re.compile(r"[!-9;-~]+")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONTENT_TYPE = re.compile(
    r"(?P<type>[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+)(?P<params>\s*;[ -~]*)?"
)
# "<left@right>", printable ASCII without spaces, "<", ">" or a second "@".
_MESSAGE_ID = re.compile(r"<[!-;=?A-~]+@[!-;=?A-~]+>")
_SPECIALS_FOR_DISPLAY = re.compile(r'[()<>\[\]:;@\\,."]')
_WHITESPACE_RUNS = re.compile(r"\s+")
_QUOTED_PAIR = re.compile(r"\\(.)")
_HIGH_BYTES = bytes(range(128, 256))
_UNDISCLOSED = "undisclosed-recipients:;"

# Headers that hold addresses: an extra header replacing one of them must be
# ASCII, since RFC 2047 encoding would swallow the address itself.
_ADDRESS_HEADERS = frozenset({"from", "to", "cc", "reply-to", "sender"})
# Headers the MIME structure owns; overriding them would corrupt the message.
_STRUCTURAL_HEADERS = frozenset({"content-type", "content-transfer-encoding", "mime-version"})

# email-validator refuses these domains whatever its options say, except
# "test" under test_environment=True. Read, never modified: it is that
# library's global state.
_SPECIAL_USE_DOMAINS: tuple[str, ...] = tuple(
    getattr(
        email_validator,
        "SPECIAL_USE_DOMAIN_NAMES",
        ("arpa", "invalid", "local", "localhost", "onion", "test"),
    )
)


# --------------------------------------------------------------------------- #
# The user-facing classes
# --------------------------------------------------------------------------- #


class Attachment:
    """A file attached to a ``Message``, as in Flask-Mail.

    ``data`` is bytes (sent byte-exact) or str (sent as UTF-8). A missing
    ``content_type`` is guessed from ``filename``. ``headers`` are extra MIME
    headers of this part, for example ``{"Content-ID": "<logo>"}`` for an
    inline image.
    """

    def __init__(
        self,
        filename: str | None = None,
        content_type: str | None = None,
        data: bytes | str | None = None,
        disposition: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> None:
        self.filename = filename
        self.content_type = content_type
        self.data = data
        self.disposition = disposition or "attachment"
        self.headers: Mapping[str, str] | Iterable[tuple[str, str]] = headers or {}

    def __repr__(self) -> str:
        return f"<Attachment {self.filename!r} {self.content_type!r}>"


class Message:
    """An email, with Flask-Mail 0.10's constructor, attributes and helpers.

    The constructor accepts anything, as Flask-Mail's does; ``mail.send()``
    (through ``prepare_message``) validates and raises ``InvalidMessage``
    naming the offending field. A missing ``sender`` is filled from
    ``MAIL_DEFAULT_SENDER`` when the message is built.

    ``msgId`` starts as None and the Message-ID is made when the message is
    queued; set it to ``"<id@domain>"`` to choose one yourself.
    """

    def __init__(
        self,
        subject: str = "",
        recipients: list[Address] | None = None,
        body: str | None = None,
        html: str | None = None,
        alts: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        sender: Address | None = None,
        cc: list[Address] | None = None,
        bcc: list[Address] | None = None,
        attachments: list[Attachment] | None = None,
        reply_to: Address | None = None,
        date: float | datetime | None = None,
        charset: str | None = None,
        extra_headers: dict[str, str] | None = None,
        mail_options: list[str] | None = None,
        rcpt_options: list[str] | None = None,
    ) -> None:
        self.subject = subject
        self.recipients: list[Address] = recipients if recipients is not None else []
        self.body = body
        self.html = html
        self.alts: dict[str, str] = _alts_dict(alts)
        self.sender = sender
        self.cc: list[Address] = cc if cc is not None else []
        self.bcc: list[Address] = bcc if bcc is not None else []
        self.attachments: list[Attachment] = attachments if attachments is not None else []
        self.reply_to = reply_to
        self.date = date
        self.charset = charset
        self.extra_headers = extra_headers
        self.mail_options: list[str] = mail_options if mail_options is not None else []
        self.rcpt_options: list[str] = rcpt_options if rcpt_options is not None else []
        self.msgId: str | None = None

    def __repr__(self) -> str:
        return f"<Message {self.subject!r} to {self.recipients!r}>"

    @property
    def send_to(self) -> set[str]:
        """Every envelope address (recipients, cc and bcc), bare, as Flask-Mail's ``send_to``."""
        result: set[str] = set()
        for group in (self.recipients, self.cc, self.bcc):
            if isinstance(group, (list, tuple)):
                for addr in group:
                    bare = _bare_address(addr)
                    if bare:
                        result.add(bare)
        return result

    def add_recipient(self, recipient: Address) -> None:
        """Add one address to ``recipients``."""
        if isinstance(self.recipients, tuple):
            self.recipients = list(self.recipients)
        if not isinstance(self.recipients, list):
            raise InvalidMessage(
                "recipients", f"expected a list of addresses, got {type(self.recipients).__name__}"
            )
        self.recipients.append(recipient)

    def attach(
        self,
        filename: str | None = None,
        content_type: str | None = None,
        data: bytes | str | None = None,
        disposition: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> None:
        """Add an attachment (Flask-Mail's signature); checked when the message is sent."""
        self.attachments.append(Attachment(filename, content_type, data, disposition, headers))

    def has_bad_headers(self) -> bool:
        """True when any header name or value would carry a CR, LF or NUL (header injection)."""
        values: list[object] = [self.subject, self.sender, self.reply_to, self.msgId]
        for group in (self.recipients, self.cc, self.bcc):
            if isinstance(group, (list, tuple)):
                values.extend(group)
            else:
                values.append(group)
        if isinstance(self.extra_headers, Mapping):
            for key, value in self.extra_headers.items():
                values += [key, value]
        if isinstance(self.attachments, (list, tuple)):
            for att in self.attachments:
                values += [
                    getattr(att, "filename", None),
                    getattr(att, "content_type", None),
                    getattr(att, "disposition", None),
                ]
                headers = getattr(att, "headers", None)
                if isinstance(headers, Mapping):
                    for key, value in headers.items():
                        values += [key, value]
        return any(_has_bad_chars_deep(value) for value in values)

    def as_bytes(self) -> bytes:
        """The MIME message, CRLF line endings, built exactly as ``mail.send()`` builds it.

        Inside an app context the app's ``MAIL_DEFAULT_SENDER`` and ``OUTBOX_*``
        settings apply; outside one, the message's own sender is used. Without a
        ``msgId`` each call makes a fresh Message-ID, and without a ``date`` each
        call stamps the current time. Raises ``InvalidMessage`` like ``send()``.
        """
        return prepare_message(self, **_current_app_options()).mime

    def as_string(self) -> str:
        """``as_bytes()`` as text (the message is 7-bit, so this is lossless)."""
        return self.as_bytes().decode("ascii")

    def __bytes__(self) -> bytes:
        return self.as_bytes()

    def __str__(self) -> str:
        return self.as_string()


@dataclass(frozen=True, slots=True)
class AttachmentInfo:
    """What a listing needs to know about one attachment of a prepared email."""

    filename: str | None
    content_type: str
    size: int


@dataclass(frozen=True, slots=True)
class PreparedEmail:
    """A validated message, ready to store and send.

    ``sender`` and ``recipients`` are the SMTP envelope (bare ASCII addresses;
    ``recipients`` is to + cc + bcc without duplicates). ``mime`` is the whole
    message exactly as it will be sent, including its ``message_id``.
    """

    sender: str
    recipients: tuple[str, ...]
    subject: str
    message_id: str
    mime: bytes
    attachments: tuple[AttachmentInfo, ...]
    to_display: str


# --------------------------------------------------------------------------- #
# Validation and building
# --------------------------------------------------------------------------- #


def prepare_message(
    msg: Message,
    *,
    default_sender: Address | None,
    allow_local_addresses: bool,
    max_message_bytes: int,
    message_id_domain: str | None,
    ascii_attachments: bool,
    now: datetime | None = None,
) -> PreparedEmail:
    """Validate ``msg`` and build the exact bytes to send.

    Raises ``InvalidMessage(field, problem)`` for anything that cannot be sent:
    no recipients, an address email-validator refuses (syntax only, no DNS),
    no sender, CR/LF/NUL in a header, a wrong type, attachment data that is
    not bytes or str, or a message larger than ``max_message_bytes``.
    Single-label and special-use domains (``localhost``, ``*.test``,
    ``*.local`` ...) are refused unless ``allow_local_addresses``.
    ``now`` (default: the current UTC time) dates a message without ``date``.
    """
    if not isinstance(msg, Message):
        raise TypeError(f"prepare_message() expects a Message, got {type(msg).__name__}")
    if (
        isinstance(max_message_bytes, bool)
        or not isinstance(max_message_bytes, int)
        or max_message_bytes <= 0
    ):
        raise ConfigError(
            "OUTBOX_MAX_MESSAGE_BYTES", f"must be a positive integer, got {max_message_bytes!r}"
        )

    subject = msg.subject
    if not isinstance(subject, str):
        raise InvalidMessage("subject", f"expected str, got {type(subject).__name__}")
    _check_header_text("subject", subject)

    to = _address_list("recipients", msg.recipients, allow_local_addresses)
    cc = _address_list("cc", msg.cc, allow_local_addresses)
    bcc = _address_list("bcc", msg.bcc, allow_local_addresses)
    if not (to or cc or bcc):
        raise InvalidMessage(
            "recipients",
            "the message has no recipients; give at least one in recipients, cc or bcc",
        )

    sender = _resolve_sender(msg.sender, default_sender, allow_local_addresses)
    reply_to = _reply_to_list(msg.reply_to, allow_local_addresses)

    codec, charset_name = _resolve_charset(msg.charset)
    alternatives = _alternatives(msg, codec)
    date = _resolve_date(msg.date, now)
    extra = _extra_headers(msg.extra_headers)

    message_id = msg.msgId
    if extra and "message-id" in extra.replaced:
        message_id = extra.replaced["message-id"]
    if message_id is not None:
        message_id = _check_message_id(message_id)
    else:
        domain = _message_id_domain(message_id_domain) if message_id_domain else sender.domain
        message_id = f"<{time.time_ns() // 1000:x}.{secrets.token_hex(8)}@{domain}>"

    attachments = _attachments(msg.attachments, ascii_attachments, max_message_bytes)

    body_headers, body = _body(alternatives, attachments, charset_name)
    headers = _top_headers(sender, to, cc, reply_to, subject, date, message_id, body_headers, extra)
    to_display = _display_list(to) if to else ("" if cc else _UNDISCLOSED)
    if extra and "to" in extra.replaced:
        to_display = extra.replaced["to"]

    mime = "\r\n".join(headers).encode("ascii") + b"\r\n\r\n" + body
    if len(mime) > max_message_bytes:
        raise InvalidMessage(
            "message size",
            f"the built message is {len(mime)} bytes, which exceeds OUTBOX_MAX_MESSAGE_BYTES ({max_message_bytes})",
        )

    envelope: list[str] = []
    seen: set[str] = set()
    for addr in (*to, *cc, *bcc):
        key = addr.ascii.lower()
        if key not in seen:
            seen.add(key)
            envelope.append(addr.ascii)

    return PreparedEmail(
        sender=sender.ascii,
        recipients=tuple(envelope),
        subject=subject,
        message_id=message_id,
        mime=mime,
        attachments=tuple(att.info for att in attachments),
        to_display=to_display,
    )


def _top_headers(
    sender: _Addr,
    to: list[_Addr],
    cc: list[_Addr],
    reply_to: list[_Addr],
    subject: str,
    date: datetime,
    message_id: str,
    body_headers: list[str],
    extra: _Extra | None,
) -> list[str]:
    """The message's own header lines, in the order mail clients write them."""
    headers = {"from": _address_header("From", [sender])}
    if to:
        headers["to"] = _address_header("To", to)
    elif not cc:
        # Bcc-only mail: say so rather than leave To out (what MUAs do).
        headers["to"] = "To: " + _UNDISCLOSED
    if cc:
        headers["cc"] = _address_header("Cc", cc)
    if reply_to:
        headers["reply-to"] = _address_header("Reply-To", reply_to)
    headers["subject"] = _unstructured_header("Subject", subject)
    headers["date"] = "Date: " + format_datetime(date)
    headers["message-id"] = "Message-ID: " + message_id
    headers["mime-version"] = "MIME-Version: 1.0"
    lines = list(headers.values()) + body_headers
    if extra:
        position = {name: index for index, name in enumerate(headers)}
        for name, line in extra.lines:
            if name in position:
                # Flask-Mail appends a second copy; replacing is what users mean.
                lines[position[name]] = line
            else:
                lines.append(line)
    return lines


# --------------------------------------------------------------------------- #
# Addresses
# --------------------------------------------------------------------------- #


class _Addr(NamedTuple):
    name: str  # display name, "" when none
    ascii: str  # local@punycode-domain, what the envelope and headers use
    display: str  # local@unicode-domain, for listings
    domain: str  # the ASCII domain


class _AddressError(Exception):
    """email-validator's verdict, without its exception chain."""


@functools.lru_cache(maxsize=1024)
def _parse_address(address: str, allow_local: bool) -> _Addr:
    """Validate one bare address (cached: the same senders and recipients repeat)."""
    special = ""
    checked = address
    if allow_local:
        # email-validator has no switch for special-use names other than
        # "test" (test_environment=True), and its list is global state we must
        # not change. So check the address with the reserved suffix swapped
        # for "test", and put the suffix back afterwards.
        head, at, domain = address.rpartition("@")
        lowered = domain.lower()
        for name in _SPECIAL_USE_DOMAINS:
            if lowered == name or lowered.endswith("." + name):
                special = name
                checked = head + at + domain[: len(domain) - len(name)] + "test"
                break
    try:
        valid = validate_email(
            checked,
            check_deliverability=False,  # syntax only: never a DNS query in a request
            allow_smtputf8=False,
            globally_deliverable=not allow_local,
            test_environment=allow_local,
        )
    except EmailNotValidError as exc:
        raise _AddressError(str(exc)) from None
    local = valid.ascii_local_part
    if local is None:  # pragma: no cover - allow_smtputf8=False guarantees it
        raise _AddressError("The address needs SMTPUTF8, which is not supported.")
    ascii_domain = valid.ascii_domain
    unicode_domain = valid.domain
    if special:
        ascii_domain = ascii_domain[: -len("test")] + special
        unicode_domain = unicode_domain[: -len("test")] + special
    return _Addr(
        name="",
        ascii=f"{local}@{ascii_domain}",
        display=f"{local}@{unicode_domain}",
        domain=ascii_domain,
    )


def _split_display_form(text: str) -> tuple[str, str]:
    """``Name <a@x.org>`` -> (name, address), as Flask-Mail's parseaddr reads it.

    Done here rather than by email-validator, which refuses the common
    unquoted non-ASCII form ``Jörg Müller <j@x.org>``. An addr-spec cannot
    contain "<", so the last one starts the address.
    """
    if not text.endswith(">") or "<" not in text:
        return "", text
    start = text.rindex("<")
    name = text[:start].strip()
    if len(name) >= 2 and name[0] == '"' and name[-1] == '"':
        name = _QUOTED_PAIR.sub(r"\1", name[1:-1])
    return name, text[start + 1 : -1]


def _address(field: str, value: object, allow_local: bool) -> _Addr:
    """One address in any accepted form, or InvalidMessage naming ``field``."""
    if isinstance(value, str):
        _check_header_text(field, value)
        name, address = _split_display_form(value)
    elif isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[0], str) or not isinstance(value[1], str):
            raise InvalidMessage(
                field, f"an address tuple must be (name, address), both str; got {value!r}"
            )
        name, address = value
        _check_header_text(field, name)
        _check_header_text(field, address)
    else:
        raise InvalidMessage(
            field,
            f"expected an address string or a (name, address) tuple, got {type(value).__name__}",
        )
    if not address:
        raise InvalidMessage(field, f"{value!r} has no address")
    try:
        addr = _parse_address(address, allow_local)
    except _AddressError as exc:
        hint = ""
        if not allow_local and _looks_local(address):
            hint = "; set OUTBOX_ALLOW_LOCAL_ADDRESSES = True to allow local and test domains"
        raise InvalidMessage(
            field, f"{address!r} is not a valid email address ({exc}){hint}"
        ) from None
    return addr._replace(name=name) if name else addr


def _looks_local(text: str) -> bool:
    local, at, domain = text.rpartition("@")
    if not at or not local or not domain:
        return False  # not an address at all: no hint about local domains
    domain = domain.lower()
    return "." not in domain or any(
        domain == d or domain.endswith("." + d) for d in _SPECIAL_USE_DOMAINS
    )


def _address_list(field: str, value: object, allow_local: bool) -> list[_Addr]:
    if value is None:
        return []
    if isinstance(value, str):
        raise InvalidMessage(
            field, f"expected a list of addresses, got the string {value!r}; write [{value!r}]"
        )
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(field, f"expected a list of addresses, got {type(value).__name__}")
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, str) for v in value)
        and "@" not in value[0]
        and "@" in value[1]
    ):
        raise InvalidMessage(field, f"got the single address tuple {value!r}; write [{value!r}]")
    return [_address(f"{field}[{i}]", item, allow_local) for i, item in enumerate(value)]


def _resolve_sender(sender: object, default_sender: object, allow_local: bool) -> _Addr:
    if sender is not None and sender != "":
        return _address("sender", sender, allow_local)
    if default_sender is None or default_sender == "":
        raise InvalidMessage(
            "sender",
            "the message has no sender and there is no default; set MAIL_DEFAULT_SENDER or pass sender=",
        )
    try:
        return _address("sender", default_sender, allow_local)
    except InvalidMessage as exc:
        raise InvalidMessage("sender", f"MAIL_DEFAULT_SENDER: {exc.problem}") from None


def _reply_to_list(value: object, allow_local: bool) -> list[_Addr]:
    if value is None or value == "":
        return []
    if isinstance(value, list):
        return [_address(f"reply_to[{i}]", item, allow_local) for i, item in enumerate(value)]
    return [_address("reply_to", value, allow_local)]


def _bare_address(addr: object) -> str:
    """The addr-spec of an unvalidated address, for ``send_to``."""
    if isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[1], str):
        return addr[1]
    if isinstance(addr, str):
        if "<" in addr:
            return parseaddr(addr)[1] or addr
        return addr
    return ""


@functools.lru_cache(maxsize=16)
def _message_id_domain(domain: str) -> str:
    if not isinstance(domain, str) or not domain or _has_bad_chars(domain):
        raise ConfigError(
            "OUTBOX_MESSAGE_ID_DOMAIN",
            f"must be a domain name such as 'example.com', got {domain!r}",
        )
    try:
        return _parse_address("postmaster@" + domain, True).domain
    except _AddressError as exc:
        raise ConfigError(
            "OUTBOX_MESSAGE_ID_DOMAIN", f"{domain!r} is not a valid domain name ({exc})"
        ) from None


def _check_message_id(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidMessage("msgId", f"expected str, got {type(value).__name__}")
    _check_header_text("msgId", value)
    if not value.isascii() or not _MESSAGE_ID.fullmatch(value):
        raise InvalidMessage(
            "msgId", f"{value!r} is not a Message-ID of the form '<unique@domain>'"
        )
    return value


# --------------------------------------------------------------------------- #
# Simple fields
# --------------------------------------------------------------------------- #


def _has_bad_chars(text: str) -> bool:
    return "\r" in text or "\n" in text or "\0" in text


def _has_bad_chars_deep(value: object) -> bool:
    if isinstance(value, str):
        return _has_bad_chars(value)
    if isinstance(value, (tuple, list)):
        return any(_has_bad_chars_deep(v) for v in value)
    return False


def _check_header_text(field: str, text: str) -> None:
    if _has_bad_chars(text):
        raise InvalidMessage(
            field, f"contains a CR, LF or NUL character (header injection?): {text[:80]!r}"
        )
    if not text.isascii():
        _check_encodable(field, text)


def _check_encodable(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            field, f"is not valid Unicode text ({exc.reason} at position {exc.start})"
        ) from None


def _alts_dict(alts: object) -> Any:
    """Flask-Mail's ``dict(alts or {})``; what cannot be converted is kept for validation to report."""
    if alts is None:
        return {}
    try:
        return dict(alts)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return alts


def _resolve_charset(charset: object) -> tuple[str, str]:
    """(Python codec, MIME charset name) of the message's text parts; utf-8 by default."""
    if charset is None or charset == "":
        return "utf-8", "utf-8"
    if not isinstance(charset, str):
        raise InvalidMessage("charset", f"expected str or None, got {type(charset).__name__}")
    return _charset_names(charset)


@functools.lru_cache(maxsize=32)
def _charset_names(charset: str) -> tuple[str, str]:
    if not charset.isascii() or not _TOKEN.fullmatch(charset):
        raise InvalidMessage("charset", f"{charset!r} is not a charset name")
    try:
        codec = codecs.lookup(charset).name
    except LookupError:
        raise InvalidMessage("charset", f"unknown charset {charset!r}") from None
    # Line endings are normalised on bytes, so the charset must write ASCII as ASCII.
    try:
        ascii_compatible = "a\n=".encode(codec) == b"a\n="
    except LookupError:  # a codec that is not a text encoding, such as rot13
        ascii_compatible = False
    if not ascii_compatible:
        raise InvalidMessage("charset", f"{charset!r} is not ASCII-compatible; use utf-8")
    return codec, Charset(charset).input_charset.lower()


def _alternatives(msg: Message, codec: str) -> list[tuple[str, bytes]]:
    """The text parts, text first then html then ``alts``: (subtype, encoded text)."""
    alts = msg.alts
    if not isinstance(alts, Mapping):
        raise InvalidMessage(
            "alts",
            f"expected a dict or a list of (subtype, content) pairs, got {type(alts).__name__}",
        )
    items: list[tuple[str, str, object]] = []
    if msg.body is not None:
        items.append(("body", "plain", msg.body))
    if msg.html is not None:
        items.append(("html", "html", msg.html))
    for subtype, content in alts.items():
        field = f"alts[{subtype!r}]"
        if not isinstance(subtype, str) or not subtype.isascii() or not _TOKEN.fullmatch(subtype):
            raise InvalidMessage("alts", f"{subtype!r} is not a MIME subtype such as 'html'")
        lowered = subtype.lower()
        if (lowered == "plain" and msg.body is not None) or (
            lowered == "html" and msg.html is not None
        ):
            if content == (msg.body if lowered == "plain" else msg.html):
                continue  # the same text given twice, as Flask-Mail's html property allows
            raise InvalidMessage(
                "alts",
                f"{subtype!r} is given both in alts and as {'body' if lowered == 'plain' else 'html'}=",
            )
        items.append((field, subtype, content))
    result = []
    for field, subtype, text in items:
        if not isinstance(text, str):
            raise InvalidMessage(field, f"expected str or None, got {type(text).__name__}")
        try:
            result.append((subtype, text.encode(codec)))
        except UnicodeEncodeError as exc:
            raise InvalidMessage(
                field, f"cannot be encoded as {codec} ({exc.reason} at position {exc.start})"
            ) from None
    return result


def _resolve_date(value: object, now: datetime | None) -> datetime:
    if value is None:
        if now is None:
            return datetime.now(UTC)
        return now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidMessage("date", f"{value!r} is not a time")
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError) as exc:
            raise InvalidMessage("date", f"{value!r} is out of range ({exc})") from None
    raise InvalidMessage(
        "date", f"expected a Unix timestamp, a datetime or None, got {type(value).__name__}"
    )


class _Extra(NamedTuple):
    lines: list[tuple[str, str]]  # (lower-case name, rendered header)
    replaced: dict[str, str]  # raw values of the standard headers it overrides


def _extra_headers(value: object) -> _Extra | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidMessage(
            "extra_headers", f"expected a dict of str to str, got {type(value).__name__}"
        )
    lines: list[tuple[str, str]] = []
    replaced: dict[str, str] = {}
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidMessage(
                "extra_headers",
                f"names and values must be str, got {type(name).__name__}: {type(text).__name__}",
            )
        _check_header_text("extra_headers", name)
        _check_header_text("extra_headers", text)
        if not name.isascii() or not _HEADER_NAME.fullmatch(name):
            raise InvalidMessage("extra_headers", f"{name!r} is not a header name")
        lname = name.lower()
        if lname == "bcc":
            raise InvalidMessage(
                "extra_headers", "a Bcc header would show the blind copies to everyone; use bcc="
            )
        if lname in _STRUCTURAL_HEADERS:
            raise InvalidMessage(
                "extra_headers",
                f"{name!r} is set from the message's parts and cannot be overridden",
            )
        if lname in _ADDRESS_HEADERS and not text.isascii():
            raise InvalidMessage(
                "extra_headers",
                f"{name!r} must be ASCII here; use sender=, recipients=, cc= or reply_to= instead",
            )
        if lname in {"to", "message-id"}:
            replaced[lname] = text
        if lname == "message-id":
            continue  # used as the Message-ID by the caller
        lines.append((lname, _unstructured_header(name, text)))
    return _Extra(lines, replaced)


# --------------------------------------------------------------------------- #
# Attachments
# --------------------------------------------------------------------------- #


class _BuiltAttachment(NamedTuple):
    part: _Part
    info: AttachmentInfo


def _attachments(value: object, ascii_only: bool, max_bytes: int) -> list[_BuiltAttachment]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(
            "attachments", f"expected a list of Attachment, got {type(value).__name__}"
        )
    built: list[_BuiltAttachment] = []
    total = 0
    for index, att in enumerate(value):
        field = f"attachments[{index}]"
        if not all(hasattr(att, a) for a in ("filename", "content_type", "data")):
            raise InvalidMessage(field, f"expected an Attachment, got {type(att).__name__}")
        data = att.data
        if isinstance(data, bytearray):
            data = bytes(data)
        if not isinstance(data, (bytes, str)):
            raise InvalidMessage(
                f"{field}.data", f"expected bytes or str, got {type(data).__name__}"
            )
        total += len(data)
        if total > max_bytes:
            # Cheap early exit: base64 only makes it bigger.
            raise InvalidMessage(
                "message size",
                f"the attachments alone are over {total} bytes, which exceeds OUTBOX_MAX_MESSAGE_BYTES ({max_bytes})",
            )
        built.append(_attachment(field, att, data, ascii_only))
    return built


def _attachment(field: str, att: Any, data: bytes | str, ascii_only: bool) -> _BuiltAttachment:
    filename = _attachment_filename(f"{field}.filename", att.filename, ascii_only)
    content_type = att.content_type
    if content_type is None or content_type == "":
        guessed = mimetypes.guess_type(filename)[0] if filename else None
        content_type = guessed or "application/octet-stream"
    elif not isinstance(content_type, str):
        raise InvalidMessage(
            f"{field}.content_type", f"expected str or None, got {type(content_type).__name__}"
        )
    _check_header_text(f"{field}.content_type", content_type)
    match = _CONTENT_TYPE.fullmatch(content_type)
    if not content_type.isascii() or match is None:
        raise InvalidMessage(
            f"{field}.content_type",
            f"{content_type!r} is not a MIME type such as 'application/pdf'",
        )

    disposition = getattr(att, "disposition", None) or "attachment"
    if not isinstance(disposition, str):
        raise InvalidMessage(
            f"{field}.disposition", f"expected str, got {type(disposition).__name__}"
        )
    _check_header_text(f"{field}.disposition", disposition)
    if not disposition.isascii() or not _TOKEN.fullmatch(disposition):
        raise InvalidMessage(
            f"{field}.disposition", f"{disposition!r} is not a disposition such as 'attachment'"
        )

    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidMessage(
                f"{field}.data", f"is not valid Unicode text ({exc.reason})"
            ) from None
        if match["type"].lower().startswith("text/") and "charset" not in content_type.lower():
            content_type += '; charset="utf-8"'

    header_lines = {
        "content-type": "Content-Type: " + content_type,
        "content-disposition": _content_disposition(disposition, filename),
    }
    for name, text in _part_headers(f"{field}.headers", getattr(att, "headers", None)):
        # Like extra_headers, a header named like one of ours replaces it.
        header_lines[name.lower()] = _unstructured_header(name, text)
    lines = list(header_lines.values())
    lines.append("Content-Transfer-Encoding: base64")
    info = AttachmentInfo(filename=filename, content_type=match["type"].lower(), size=len(data))
    return _BuiltAttachment(part=(lines, _base64_lines(data)), info=info)


def _attachment_filename(field: str, filename: object, ascii_only: bool) -> str | None:
    """The checked filename; with MAIL_ASCII_ATTACHMENTS, transliterated as Flask-Mail does."""
    if filename is None:
        return None
    if not isinstance(filename, str):
        raise InvalidMessage(field, f"expected str or None, got {type(filename).__name__}")
    _check_header_text(field, filename)
    if ascii_only:
        filename = unicodedata.normalize("NFKD", filename)
        filename = filename.encode("ascii", "ignore").decode("ascii")
        filename = _WHITESPACE_RUNS.sub(" ", filename).strip()
    return filename or None


def _part_headers(field: str, value: object) -> list[tuple[str, str]]:
    """An attachment's extra headers (a dict, or pairs as older Flask-Mail took), checked."""
    if not value:
        return []
    pairs: object = value.items() if isinstance(value, Mapping) else value
    if not isinstance(pairs, Iterable):
        raise InvalidMessage(field, f"expected a dict of str to str, got {type(value).__name__}")
    checked = []
    for pair in pairs:
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], str)
        ):
            raise InvalidMessage(field, f"expected str names and values, got {pair!r}")
        name, text = pair
        _check_header_text(field, name)
        _check_header_text(field, text)
        if not name.isascii() or not _HEADER_NAME.fullmatch(name):
            raise InvalidMessage(field, f"{name!r} is not a header name")
        if name.lower() == "content-transfer-encoding":
            raise InvalidMessage(
                field, "Content-Transfer-Encoding is always base64 and cannot be set"
            )
        checked.append((name, text))
    return checked


def _content_disposition(disposition: str, filename: str | None) -> str:
    if filename is None:
        return "Content-Disposition: " + disposition
    if filename.isascii() and filename.isprintable() and len(filename) <= _MAX_RAW_TOKEN:
        quoted = filename.replace("\\", "\\\\").replace('"', '\\"')
        return _fold("Content-Disposition", [disposition + ";", f'filename="{quoted}"'])
    # RFC 2231: percent-encoded UTF-8, split into numbered continuations at
    # character boundaries so every piece is valid on its own.
    chunks: list[str] = []
    current = ""
    for char in filename:
        piece = urllib.parse.quote(char, safe="")
        if current and len(current) + len(piece) > _RFC2231_CHUNK:
            chunks.append(current)
            current = ""
        current += piece
    chunks.append(current)
    if len(chunks) == 1:
        return _fold("Content-Disposition", [disposition + ";", f"filename*=utf-8''{chunks[0]}"])
    atoms = [disposition + ";"]
    for i, chunk in enumerate(chunks):
        prefix = "utf-8''" if i == 0 else ""
        end = ";" if i < len(chunks) - 1 else ""
        atoms.append(f"filename*{i}*={prefix}{chunk}{end}")
    return _fold("Content-Disposition", atoms)


# --------------------------------------------------------------------------- #
# MIME writing
# --------------------------------------------------------------------------- #


def _body(
    alternatives: list[tuple[str, bytes]], attachments: list[_BuiltAttachment], charset: str
) -> _Part:
    """The message's content: one text part, multipart/alternative, wrapped in multipart/mixed for attachments."""
    parts = [_text_part(subtype, data, charset) for subtype, data in alternatives]
    if len(parts) > 1:
        parts = [_multipart("alternative", parts)]
    if attachments:
        return _multipart("mixed", parts + [att.part for att in attachments])
    if parts:
        return parts[0]
    return _text_part("plain", b"", charset)


def _text_part(subtype: str, data: bytes, charset: str) -> _Part:
    """A text/* part of already-encoded text: 7bit when it can be, else QP or base64."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if data and not data.endswith(b"\n"):
        data += b"\n"
    content_type = f'Content-Type: text/{subtype}; charset="{charset}"'
    if data.isascii() and b"\0" not in data and _longest_line(data) <= _HARD_LINE_LIMIT:
        return [content_type, "Content-Transfer-Encoding: 7bit"], data.replace(b"\n", b"\r\n")
    high = len(data) - len(data.translate(None, _HIGH_BYTES))
    # Quoted-printable triples each 8-bit byte, base64 grows everything by a
    # third: QP wins (and stays readable) while under 1 byte in 6 is 8-bit.
    if high * 6 < len(data):
        encoded = binascii.b2a_qp(data, istext=True).replace(b"\n", b"\r\n")
        return [content_type, "Content-Transfer-Encoding: quoted-printable"], encoded
    return [content_type, "Content-Transfer-Encoding: base64"], _base64_lines(data)


def _longest_line(data: bytes) -> int:
    if len(data) <= _HARD_LINE_LIMIT:
        return len(data)
    return max(map(len, data.split(b"\n")))


def _base64_lines(data: bytes) -> bytes:
    """Base64 in 76-character lines (RFC 2045), joined with CRLF."""
    encoded = binascii.b2a_base64(data, newline=False)
    size = len(encoded)
    if size <= _B64_LINE:
        return encoded
    # Cutting lines with a Python loop costs more than the encoding itself;
    # a precompiled struct cuts a block of 256 lines per C call instead.
    whole = size - size % _B64_BLOCK.size
    lines = list(chain.from_iterable(_B64_BLOCK.iter_unpack(memoryview(encoded)[:whole])))
    count, rest = divmod(size - whole, _B64_LINE)
    if count:
        lines.extend(struct.unpack_from(f"{_B64_LINE}s" * count, encoded, whole))
    if rest:
        lines.append(encoded[size - rest :])
    return b"\r\n".join(lines)


def _multipart(subtype: str, parts: Sequence[_Part]) -> _Part:
    chunks = [
        b"\r\n".join(h.encode("ascii") for h in headers) + b"\r\n\r\n" + body
        for headers, body in parts
    ]
    while True:
        # "=_" can occur neither in base64 nor in quoted-printable; a 7bit text
        # part could hold it, so check rather than hope.
        boundary = "=_" + secrets.token_hex(16)
        marker = boundary.encode("ascii")
        if not any(marker in chunk for chunk in chunks):
            break
    delimiter = b"--" + marker
    body = (
        delimiter
        + b"\r\n"
        + (b"\r\n" + delimiter + b"\r\n").join(chunks)
        + b"\r\n"
        + delimiter
        + b"--\r\n"
    )
    return [f'Content-Type: multipart/{subtype}; boundary="{boundary}"'], body


def _fold(name: str, atoms: Sequence[str]) -> str:
    """``name: atom atom ...``, breaking before an atom when the line would pass 78 characters."""
    out = [name, ":"]
    start = len(name) + 1
    line = start
    for atom in atoms:
        if atom and line > start and line + 1 + len(atom) > _FOLD_AT:
            out.append("\r\n ")
            line = 1
        else:
            out.append(" ")
            line += 1
        out.append(atom)
        line += len(atom)
    return "".join(out)


def _encoded_words(text: str, *, break_after_space: bool = False) -> list[str]:
    """RFC 2047 base64 encoded-words of at most ``_EW_BYTES`` UTF-8 bytes each.

    Chunks never split a character. With ``break_after_space`` a chunk ends
    after a space where it can, so a reader that (wrongly) keeps the folding
    whitespace between words only doubles a space instead of splitting a word.
    """
    chunks: list[str] = []
    data = text.encode("utf-8")
    if len(data) <= _EW_BYTES:
        chunks.append(text)
    else:
        start = 0
        size = 0
        last_space = -1
        for i, char in enumerate(text):
            code = ord(char)
            n = 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4
            if size + n > _EW_BYTES:
                cut = last_space + 1 if break_after_space and last_space >= start else i
                chunks.append(text[start:cut])
                size = len(text[cut:i].encode("utf-8"))
                start = cut
                last_space = -1
            size += n
            if char == " ":
                last_space = i
        chunks.append(text[start:])
    return [
        "=?utf-8?b?" + binascii.b2a_base64(c.encode("utf-8"), newline=False).decode("ascii") + "?="
        for c in chunks
    ]


def _unstructured_header(name: str, value: str) -> str:
    """An unstructured header (Subject, extra headers), RFC 2047-encoded when plain text would not survive."""
    if value.isascii() and value.isprintable() and "=?" not in value and value == value.strip():
        words = value.split(" ")
        if max(map(len, words)) <= _MAX_RAW_TOKEN:
            return _fold(name, words)
    # Non-ASCII, control characters, edge whitespace or something that looks
    # like an encoded-word: encode it all so the reader gets it back exactly.
    return _fold(name, _encoded_words(value))


def _address_header(name: str, addrs: Sequence[_Addr]) -> str:
    atoms: list[str] = []
    last = len(addrs) - 1
    for i, addr in enumerate(addrs):
        comma = "," if i < last else ""
        if addr.name:
            atoms.extend(_phrase(addr.name))
            atoms.append(f"<{addr.ascii}>{comma}")
        else:
            atoms.append(addr.ascii + comma)
    return _fold(name, atoms)


def _phrase(name: str) -> list[str]:
    """A display name as header atoms: plain words, one quoted string, or encoded-words."""
    if name.isascii() and name.isprintable() and "=?" not in name and len(name) <= _MAX_RAW_TOKEN:
        if _ATEXT_WORDS.fullmatch(name):
            return name.split(" ")
        return ['"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"']
    return _encoded_words(name, break_after_space=True)


def _display_list(addrs: Sequence[_Addr]) -> str:
    """The To header as a person reads it (decoded names, Unicode domains)."""
    out = []
    for addr in addrs:
        if not addr.name:
            out.append(addr.display)
        elif _SPECIALS_FOR_DISPLAY.search(addr.name):
            quoted = addr.name.replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'"{quoted}" <{addr.display}>')
        else:
            out.append(f"{addr.name} <{addr.display}>")
    return ", ".join(out)


# --------------------------------------------------------------------------- #
# Flask integration for as_bytes()
# --------------------------------------------------------------------------- #


_OPTION_NAMES = (
    "default_sender",
    "allow_local_addresses",
    "max_message_bytes",
    "message_id_domain",
    "ascii_attachments",
)


def _current_app_options() -> dict[str, Any]:
    """``prepare_message`` options for ``as_bytes()``: the app's, or neutral ones outside an app.

    ``mail.send()`` passes the settings ``init_app`` parsed; reading that same
    object here keeps ``as_bytes()`` identical to what is sent. An app without
    the extension gets the raw config keys with their documented defaults.
    """
    if not has_app_context():
        return {
            "default_sender": None,
            "allow_local_addresses": False,
            "max_message_bytes": _DEFAULT_MAX_MESSAGE_BYTES,
            "message_id_domain": None,
            "ascii_attachments": False,
        }
    state = current_app.extensions.get("mail_outbox")
    parsed = getattr(state, "config", None)
    if parsed is not None and all(hasattr(parsed, name) for name in _OPTION_NAMES):
        return {name: getattr(parsed, name) for name in _OPTION_NAMES}
    config = current_app.config
    return {
        "default_sender": config.get("MAIL_DEFAULT_SENDER"),
        "allow_local_addresses": bool(config.get("OUTBOX_ALLOW_LOCAL_ADDRESSES", False)),
        "max_message_bytes": config.get("OUTBOX_MAX_MESSAGE_BYTES", _DEFAULT_MAX_MESSAGE_BYTES),
        "message_id_domain": config.get("OUTBOX_MESSAGE_ID_DOMAIN"),
        "ascii_attachments": bool(config.get("MAIL_ASCII_ATTACHMENTS", False)),
    }
