"""Fields: every part of a ``Message`` but its addresses, checked and put in the shape ``_mime`` writes.

``prepare_message()`` (in ``_message``) calls these in turn, after the
subject and the addresses (``_addresses``): the ESMTP options, the charset and
text parts, the date, the extra headers, the Message-ID and the attachments.
Each takes the attribute as the user set it, of any type, and either returns
it checked or raises ``InvalidMessage`` naming the field. Nothing here knows
the ``Message`` class, and nothing here writes MIME but through ``_mime``.
"""

from __future__ import annotations

import codecs
import functools
import math
import mimetypes
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.charset import Charset
from typing import Any, NamedTuple

from .._errors import ConfigError, InvalidMessage
from .addresses import AddressError, check_header_text, has_bad_chars, parse_address
from .mime import Part, attachment_part, unstructured_header

__all__ = [
    "AttachmentInfo",
    "BuiltAttachment",
    "ExtraHeaders",
    "check_attachments",
    "check_esmtp_options",
    "check_message_id",
    "check_message_id_domain",
    "extra_headers",
    "resolve_charset",
    "resolve_date",
    "size_and_limit",
    "text_alternatives",
]


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
# Simple fields
# --------------------------------------------------------------------------- #


def check_esmtp_options(field: str, value: object) -> None:
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


def resolve_charset(charset: object) -> tuple[str, str]:
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


def text_alternatives(
    body: str | None, html: str | None, alts: dict[str, str], codec: str
) -> list[tuple[str, bytes]]:
    """The text parts, text first then html then ``alts``: (subtype, encoded text)."""
    if not isinstance(alts, Mapping):
        raise InvalidMessage(
            "alts",
            f"expected a dict or a list of (subtype, content) pairs, got {type(alts).__name__}",
        )
    items: list[tuple[str, str, object]] = []
    if body is not None:
        items.append(("body", "plain", body))
    if html is not None:
        items.append(("html", "html", html))
    for subtype, content in alts.items():
        field = f"alts[{subtype!r}]"
        if not isinstance(subtype, str) or not subtype.isascii() or not _TOKEN.fullmatch(subtype):
            raise InvalidMessage("alts", f"{subtype!r} is not a MIME subtype such as 'html'")
        lowered = subtype.lower()
        if (lowered == "plain" and body is not None) or (
            lowered == "html" and html is not None
        ):
            if content == (body if lowered == "plain" else html):
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


def resolve_date(value: object, now: datetime | None) -> datetime:
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


class ExtraHeaders(NamedTuple):
    """Checked ``extra_headers``: the lines to write, and what they override."""

    lines: list[tuple[str, str]]  # (lower-case name, rendered header)
    replaced: dict[str, str]  # raw values of the standard headers it overrides


def extra_headers(value: object) -> ExtraHeaders | None:
    """``extra_headers`` checked and rendered; a Message-ID among them is for the caller to use."""
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
    return ExtraHeaders(lines, replaced)


# --------------------------------------------------------------------------- #
# Message-ID
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=16)
def check_message_id_domain(domain: str) -> str:
    """``OUTBOX_MESSAGE_ID_DOMAIN`` as an ASCII domain, or ``ConfigError``."""
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


def check_message_id(value: object) -> str:
    """A Message-ID the user chose (``msgId`` or an extra header), checked."""
    if not isinstance(value, str):
        raise InvalidMessage("msgId", f"expected str, got {type(value).__name__}")
    check_header_text("msgId", value)
    if not value.isascii() or not _MESSAGE_ID.fullmatch(value):
        raise InvalidMessage(
            "msgId", f"{value!r} is not a Message-ID of the form '<unique@domain>'"
        )
    return value


# --------------------------------------------------------------------------- #
# Attachments
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, slots=True)
class AttachmentInfo:
    """What a listing needs to know about one attachment of a prepared email."""

    filename: str | None
    content_type: str
    size: int


class BuiltAttachment(NamedTuple):
    """One checked attachment: its MIME part, and what a listing shows of it."""

    part: Part
    info: AttachmentInfo


def check_attachments(value: object, ascii_only: bool, max_bytes: int) -> list[BuiltAttachment]:
    """``attachments`` checked and encoded, refused early when their data alone is too big."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(
            "attachments", f"expected a list of Attachment, got {type(value).__name__}"
        )
    built: list[BuiltAttachment] = []
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
            size, limit = size_and_limit(total, max_bytes)
            raise InvalidMessage(
                "message size",
                f"the attachments alone are at least {size}, which exceeds "
                f"OUTBOX_MAX_MESSAGE_BYTES ({limit})",
            )
        built.append(_attachment(field, att, data, ascii_only))
    return built


def size_and_limit(size: int, limit: int) -> tuple[str, str]:
    """``size`` and the ``limit`` it exceeds as people read them: ``("30.0 MiB", "25 MiB")``.

    Byte figures are added only where they tell something: to a limit that is
    not a whole number of its unit, and to both when rounding shows them alike.
    """
    shown, allowed = _one_decimal(size), _one_decimal(limit)
    factor, unit = _unit(limit)
    whole = limit % factor == 0
    limit_text = f"{limit // factor} {unit}" if whole else allowed
    if shown == allowed:
        return f"{shown} ({size} bytes)", f"{limit_text}, {limit} bytes"
    if not whole:
        limit_text += f", {limit} bytes"
    return shown, limit_text


def _unit(size: int) -> tuple[int, str]:
    for factor, unit in ((1024 * 1024, "MiB"), (1024, "KiB")):
        if size >= factor:
            return factor, unit
    return 1, "bytes"


def _one_decimal(size: int) -> str:
    factor, unit = _unit(size)
    return f"{size} bytes" if factor == 1 else f"{size / factor:.1f} {unit}"


def _attachment(field: str, att: Any, data: bytes | str, ascii_only: bool) -> BuiltAttachment:
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
    return BuiltAttachment(part=part, info=info)


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
