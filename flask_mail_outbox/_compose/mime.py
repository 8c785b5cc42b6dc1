"""MIME writing: validated parts in, the exact bytes of the message out.

Nothing here checks user input; ``_addresses`` and ``_fields`` have done that
before anything is written. What is written is plain RFC 5322 / RFC 2045-2047 /
RFC 2231 and every line ends in CRLF.

The MIME is written by hand rather than through ``email.message.EmailMessage``:
the stdlib route costs milliseconds per message (header folding through the
policy machinery dominates), and this runs inside every ``mail.send()``. The
tests read every shape back with ``email.parser.BytesParser``.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import re
import struct
import urllib.parse
from collections.abc import Sequence
from datetime import datetime
from email.utils import format_datetime
from itertools import chain
from typing import TypeAlias

from .addresses import UNDISCLOSED_RECIPIENTS, Addr

__all__ = [
    "Part",
    "attachment_part",
    "message_body",
    "part_header",
    "top_headers",
    "unstructured_header",
    "uri_list_header",
]

#: A MIME part: its header lines (no CRLF) and its encoded body (CRLF lines).
Part: TypeAlias = "tuple[list[str], bytes]"

# RFC 5322 recommends 78 characters per header line; 998 is the hard limit.
_FOLD_AT = 78
_HARD_LINE_LIMIT = 998
# Longest raw token (word, quoted name, filename) written on one header line;
# anything longer goes through RFC 2047/2231 encoding, which can be split.
_MAX_RAW_TOKEN = 900
# Encoded text per RFC 2047 encoded-word: 52 characters (39 UTF-8 bytes in
# base64), 64 with the "=?utf-8?b?" and "?=" around them (the limit is 75), so
# that "Subject: " or "Reply-To: " plus one word still fits in 78 characters.
_EW_BYTES = 39
_EW_CHARS = 52
# What RFC 2047's Q encoding may leave as is, even in a display name (5.(3)).
_Q_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!*+-/")
_Q_BYTES = tuple(
    chr(b) if b in _Q_SAFE else "_" if b == 0x20 else f"={b:02X}" for b in range(256)
)
# Base64 line length (RFC 2045), and a struct that cuts 256 such lines at once.
_B64_LINE = 76
_B64_BLOCK = struct.Struct(f"{_B64_LINE}s" * 256)
# Characters of an RFC 2231 percent-encoded parameter per continuation line.
_RFC2231_CHUNK = 60

_ATEXT_WORDS = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?: [A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*")
_HIGH_BYTES = bytes(range(128, 256))


# --------------------------------------------------------------------------- #
# The message
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=64)
def _date_header(date: datetime) -> str:
    # Every email of one second has the same Date: formatted once, not per email.
    return format_datetime(date)


def top_headers(
    sender: Addr,
    to: Sequence[Addr],
    cc: Sequence[Addr],
    reply_to: Sequence[Addr],
    subject: str,
    date: datetime,
    message_id: str,
    body_headers: list[str],
    extra_lines: Sequence[tuple[str, str]],
) -> list[str]:
    """The message's own header lines, in the order mail clients write them.

    ``extra_lines`` are rendered extra headers as (lower-case name, line); one
    named like a header written here replaces it, the others are appended.
    """
    headers = {"from": _address_header("From", [sender])}
    if to:
        headers["to"] = _address_header("To", to)
    elif not cc:
        # Bcc-only mail: say so rather than leave To out (what MUAs do).
        headers["to"] = "To: " + UNDISCLOSED_RECIPIENTS
    if cc:
        headers["cc"] = _address_header("Cc", cc)
    if reply_to:
        headers["reply-to"] = _address_header("Reply-To", reply_to)
    if subject:
        # Flask-Mail writes no Subject for an empty one, and neither do MUAs.
        headers["subject"] = unstructured_header("Subject", subject)
    headers["date"] = "Date: " + _date_header(date.replace(microsecond=0))
    headers["message-id"] = "Message-ID: " + message_id
    headers["mime-version"] = "MIME-Version: 1.0"
    lines = list(headers.values()) + body_headers
    if extra_lines:
        position = {name: index for index, name in enumerate(headers)}
        for name, line in extra_lines:
            if name in position:
                # Flask-Mail appends a second copy; replacing is what users mean.
                lines[position[name]] = line
            else:
                lines.append(line)
    return lines


def message_body(
    alternatives: Sequence[tuple[str, bytes]],
    attachments: Sequence[Part],
    charset: str,
    seed: str,
) -> Part:
    """The message's content, nested as mail clients expect it.

    ``alternatives`` are (subtype, text already encoded in ``charset``), more
    than one making a multipart/alternative. ``attachments`` are parts made
    by ``attachment_part``. Inline ones with a Content-ID (images the html
    shows through ``cid:``) go with the html part in a multipart/related that
    takes its place among the alternatives, so clients show them in place and
    not as attachments; without an html part they stay attachments. The others
    put a multipart/mixed around it all. ``seed`` makes the boundaries: the
    same message builds to the same bytes.
    """
    has_html = any(subtype.lower() == "html" for subtype, _ in alternatives)
    inline = [part for part in attachments if has_html and _is_inline(part)]
    mixed = [part for part in attachments if not (has_html and _is_inline(part))]
    parts = []
    for subtype, data in alternatives:
        part = _text_part(subtype, data, charset)
        if inline and subtype.lower() == "html":
            part = _multipart("related", [part, *inline], seed, '; type="text/html"')
            inline = []
        parts.append(part)
    if len(parts) > 1:
        parts = [_multipart("alternative", parts, seed)]
    if mixed:
        return _multipart("mixed", [*parts, *mixed], seed)
    if parts:
        return parts[0]
    return _text_part("plain", b"", charset)


def _is_inline(part: Part) -> bool:
    """An inline part the html can show: ``Content-Disposition: inline`` and a Content-ID."""
    disposition = (part_header(part, "Content-Disposition") or "").partition(";")[0]
    return disposition.strip().lower() == "inline" and bool(part_header(part, "Content-ID"))


def part_header(part: Part, name: str) -> str | None:
    """The value of header ``name`` of a built ``part``, unfolded; None when it has none."""
    prefix = name.lower() + ":"
    for line in part[0]:
        if line[: len(prefix)].lower() == prefix:
            return line[len(prefix) :].replace("\r\n", "").strip()
    return None


# --------------------------------------------------------------------------- #
# Parts
# --------------------------------------------------------------------------- #


def attachment_part(
    content_type: str,
    disposition: str,
    filename: str | None,
    headers: Sequence[tuple[str, str]],
    data: bytes,
) -> Part:
    """An attachment, base64-encoded, with its checked extra ``headers``."""
    header_lines = {
        "content-type": "Content-Type: " + content_type,
        "content-disposition": _content_disposition(disposition, filename),
    }
    for name, text in headers:
        # Like extra_headers, a header named like one of ours replaces it.
        header_lines[name.lower()] = unstructured_header(name, text)
    lines = list(header_lines.values())
    lines.append("Content-Transfer-Encoding: base64")
    return lines, _base64_lines(data)


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


def _text_part(subtype: str, data: bytes, charset: str) -> Part:
    """A text/* part of already-encoded text: 7bit when it can be, else QP or base64."""
    # Line breaks are made CRLF; nothing is added, as Flask-Mail adds nothing.
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
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


def _multipart(subtype: str, parts: Sequence[Part], seed: str, params: str = "") -> Part:
    chunks = [
        b"\r\n".join(h.encode("ascii") for h in headers) + b"\r\n\r\n" + body
        for headers, body in parts
    ]
    attempt = 0
    while True:
        # Derived from the message's seed, so building a message twice gives
        # the same bytes; one per subtype (so nested boundaries differ) and
        # attempt. "=_" can occur neither in base64 nor in quoted-printable; a
        # 7bit text part could hold it, so check rather than hope.
        digest = hashlib.blake2b(f"{seed}/{subtype}/{attempt}".encode(), digest_size=16)
        boundary = "=_" + digest.hexdigest()
        marker = boundary.encode("ascii")
        if not any(marker in chunk for chunk in chunks):
            break
        attempt += 1
    delimiter = b"--" + marker
    body = (
        delimiter
        + b"\r\n"
        + (b"\r\n" + delimiter + b"\r\n").join(chunks)
        + b"\r\n"
        + delimiter
        + b"--\r\n"
    )
    return [f'Content-Type: multipart/{subtype}; boundary="{boundary}"{params}'], body


# --------------------------------------------------------------------------- #
# Header lines
# --------------------------------------------------------------------------- #


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
    """RFC 2047 encoded-words of ``text``, Q or B, whichever is shorter (as Flask-Mail's ``Header``).

    Mostly-ASCII text reads best as Q (``=?utf-8?q?Caf=C3=A9?=``), other
    scripts are shorter in base64; ties go to Q, as in ``email.charset``'s
    SHORTEST. Each word holds at most ``_EW_CHARS`` encoded characters, and
    chunks never split a character. With ``break_after_space`` a chunk ends
    after a space where it can, so a reader that (wrongly) keeps the folding
    whitespace between words only doubles a space instead of splitting a word.
    """
    data = text.encode("utf-8")
    q_length = sum(len(_Q_BYTES[b]) for b in data)
    use_q = q_length <= (len(data) + 2) // 3 * 4
    total, limit = (q_length, _EW_CHARS) if use_q else (len(data), _EW_BYTES)
    chunks: list[str] = []
    if total <= limit:
        chunks.append(text)
    else:
        start = 0
        size = 0
        last_space = -1
        for i, char in enumerate(text):
            n = _q_length(char) if use_q else len(char.encode("utf-8"))
            if size + n > limit:
                cut = last_space + 1 if break_after_space and last_space >= start else i
                chunks.append(text[start:cut])
                piece = text[cut:i]
                size = _q_length(piece) if use_q else len(piece.encode("utf-8"))
                start = cut
                last_space = -1
            size += n
            if char == " ":
                last_space = i
        chunks.append(text[start:])
    if use_q:
        return ["=?utf-8?q?" + "".join(_Q_BYTES[b] for b in c.encode("utf-8")) + "?=" for c in chunks]
    return [
        "=?utf-8?b?" + binascii.b2a_base64(c.encode("utf-8"), newline=False).decode("ascii") + "?="
        for c in chunks
    ]


def _q_length(text: str) -> int:
    return sum(len(_Q_BYTES[b]) for b in text.encode("utf-8"))


def unstructured_header(name: str, value: str) -> str:
    """An unstructured header (Subject, extra headers), RFC 2047-encoded when plain text would not survive."""
    if value.isascii() and value.isprintable() and "=?" not in value and value == value.strip():
        words = value.split(" ")
        if max(map(len, words)) <= _MAX_RAW_TOKEN:
            return _fold(name, words)
    # Non-ASCII, control characters, edge whitespace or something that looks
    # like an encoded-word: encode it all so the reader gets it back exactly.
    return _fold(name, _encoded_words(value))


def _address_header(name: str, addrs: Sequence[Addr]) -> str:
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


def uri_list_header(name: str, uris: Sequence[str]) -> str:
    """A header holding ``<uri>, <uri>`` (RFC 2369's List-* headers), folded between URIs."""
    last = len(uris) - 1
    return _fold(name, [f"<{uri}>" + ("," if i < last else "") for i, uri in enumerate(uris)])
