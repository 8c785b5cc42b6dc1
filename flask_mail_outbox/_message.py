"""Messages: the Flask-Mail compatible ``Message``, and turning one into a ``PreparedEmail``.

``prepare_message()`` is the one place where a ``Message`` is checked and turned
into the exact bytes that will go over SMTP. ``mail.send()`` calls it before
anything is written, so a bad message raises ``InvalidMessage`` in the request
that made it, never later in a worker.

This module validates every field (addresses through ``_addresses``) and hands
the checked pieces to ``_mime``, which writes the bytes.
"""

from __future__ import annotations

import codecs
import functools
import math
import mimetypes
import re
import secrets
import time
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.charset import Charset
from typing import Any, NamedTuple, TypeAlias

from flask import current_app, has_app_context

from ._addresses import (
    UNDISCLOSED_RECIPIENTS,
    AddressError,
    address_list,
    bare_address,
    check_header_text,
    display_list,
    has_bad_chars,
    parse_address,
    reply_to_list,
    resolve_sender,
)
from ._errors import ConfigError, InvalidMessage
from ._mime import Part, attachment_part, message_body, top_headers, unstructured_header

__all__ = ["Address", "Attachment", "AttachmentInfo", "Message", "PreparedEmail", "prepare_message"]

#: An address as users give it: ``"a@x.org"``, ``"Name <a@x.org>"`` or ``("Name", "a@x.org")``.
Address: TypeAlias = "str | tuple[str, str]"

_DEFAULT_MAX_MESSAGE_BYTES = 25 * 1024 * 1024

_HEADER_NAME = re.compile(r"[!-9;-~]+")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONTENT_TYPE = re.compile(
    r"(?P<type>[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+)(?P<params>\s*;[ -~]*)?"
)
# An ESMTP parameter of MAIL FROM / RCPT TO (RFC 5321 4.1.2): keyword[=value].
_ESMTP_PARAMETER = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*(=[!-<>-~]+)?")
# "<left@right>", printable ASCII without spaces, "<", ">" or a second "@".
_MESSAGE_ID = re.compile(r"<[!-;=?A-~]+@[!-;=?A-~]+>")
_WHITESPACE_RUNS = re.compile(r"\s+")

# Headers that hold addresses: an extra header replacing one of them must be
# ASCII, since RFC 2047 encoding would swallow the address itself.
_ADDRESS_HEADERS = frozenset({"from", "to", "cc", "reply-to", "sender"})
# Headers the MIME structure owns; overriding them would corrupt the message.
_STRUCTURAL_HEADERS = frozenset({"content-type", "content-transfer-encoding", "mime-version"})


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
                    bare = bare_address(addr)
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
    #: Flask-Mail's ``mail_options`` / ``rcpt_options``: ESMTP parameters for
    #: MAIL FROM and for each RCPT TO (``("BODY=8BITMIME",)``, ``("NOTIFY=FAILURE",)``).
    mail_options: tuple[str, ...] = ()
    rcpt_options: tuple[str, ...] = ()


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
    check_header_text("subject", subject)

    to = address_list("recipients", msg.recipients, allow_local_addresses)
    cc = address_list("cc", msg.cc, allow_local_addresses)
    bcc = address_list("bcc", msg.bcc, allow_local_addresses)
    if not (to or cc or bcc):
        raise InvalidMessage(
            "recipients",
            "the message has no recipients; give at least one in recipients, cc or bcc",
        )

    sender = resolve_sender(msg.sender, default_sender, allow_local_addresses)
    reply_to = reply_to_list(msg.reply_to, allow_local_addresses)
    _check_esmtp_options("mail_options", msg.mail_options)
    _check_esmtp_options("rcpt_options", msg.rcpt_options)

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

    body_headers, body = message_body(alternatives, [att.part for att in attachments], charset_name)
    extra_lines = extra.lines if extra else ()
    headers = top_headers(
        sender, to, cc, reply_to, subject, date, message_id, body_headers, extra_lines
    )
    to_display = display_list(to) if to else ("" if cc else UNDISCLOSED_RECIPIENTS)
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
        mail_options=tuple(msg.mail_options),
        rcpt_options=tuple(msg.rcpt_options),
    )


# --------------------------------------------------------------------------- #
# Message-ID
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=16)
def _message_id_domain(domain: str) -> str:
    if not isinstance(domain, str) or not domain or has_bad_chars(domain):
        raise ConfigError(
            "OUTBOX_MESSAGE_ID_DOMAIN",
            f"must be a domain name such as 'example.com', got {domain!r}",
        )
    try:
        return parse_address("postmaster@" + domain, True).domain
    except AddressError as exc:
        raise ConfigError(
            "OUTBOX_MESSAGE_ID_DOMAIN", f"{domain!r} is not a valid domain name ({exc})"
        ) from None


def _check_message_id(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidMessage("msgId", f"expected str, got {type(value).__name__}")
    check_header_text("msgId", value)
    if not value.isascii() or not _MESSAGE_ID.fullmatch(value):
        raise InvalidMessage(
            "msgId", f"{value!r} is not a Message-ID of the form '<unique@domain>'"
        )
    return value


# --------------------------------------------------------------------------- #
# Simple fields
# --------------------------------------------------------------------------- #


def _has_bad_chars_deep(value: object) -> bool:
    if isinstance(value, str):
        return has_bad_chars(value)
    if isinstance(value, (tuple, list)):
        return any(_has_bad_chars_deep(v) for v in value)
    return False


def _check_esmtp_options(field: str, value: object) -> None:
    """Flask-Mail's ``mail_options`` / ``rcpt_options``: a list of ESMTP parameters.

    They would go on the MAIL FROM / RCPT TO command line, so a CR or LF in
    one would inject an SMTP command; refuse anything but ``KEYWORD[=value]``.
    """
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(
            field, f"expected a list of ESMTP parameters, got {type(value).__name__}"
        )
    for option in value:
        if not isinstance(option, str) or not _ESMTP_PARAMETER.fullmatch(option):
            raise InvalidMessage(
                field, f"{option!r} is not an ESMTP parameter such as 'SMTPUTF8' or 'BODY=8BITMIME'"
            )


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
        check_header_text("extra_headers", name)
        check_header_text("extra_headers", text)
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
        lines.append((lname, unstructured_header(name, text)))
    return _Extra(lines, replaced)


# --------------------------------------------------------------------------- #
# Attachments
# --------------------------------------------------------------------------- #


class _BuiltAttachment(NamedTuple):
    part: Part
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
    check_header_text(f"{field}.content_type", content_type)
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
    check_header_text(f"{field}.disposition", disposition)
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

    headers = _part_headers(f"{field}.headers", getattr(att, "headers", None))
    info = AttachmentInfo(filename=filename, content_type=match["type"].lower(), size=len(data))
    part = attachment_part(content_type, disposition, filename, headers, data)
    return _BuiltAttachment(part=part, info=info)


def _attachment_filename(field: str, filename: object, ascii_only: bool) -> str | None:
    """The checked filename; with MAIL_ASCII_ATTACHMENTS, transliterated as Flask-Mail does."""
    if filename is None:
        return None
    if not isinstance(filename, str):
        raise InvalidMessage(field, f"expected str or None, got {type(filename).__name__}")
    check_header_text(field, filename)
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
        check_header_text(field, name)
        check_header_text(field, text)
        if not name.isascii() or not _HEADER_NAME.fullmatch(name):
            raise InvalidMessage(field, f"{name!r} is not a header name")
        if name.lower() == "content-transfer-encoding":
            raise InvalidMessage(
                field, "Content-Transfer-Encoding is always base64 and cannot be set"
            )
        checked.append((name, text))
    return checked


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
