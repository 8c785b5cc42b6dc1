"""A stored MIME message taken apart, for the providers whose APIs take JSON fields.

Postmark, SendGrid and Resend do not take the message's bytes: they take its
sender, recipients, subject, text and html bodies, attachments (inline images
with their Content-ID) and headers as fields, and build the MIME themselves.
:func:`parts_of` reads those fields back from exactly the bytes the outbox
stored, so what they send is what ``send()`` validated. Bcc recipients are
not in the headers (they never are): they are the envelope's recipients that
neither To nor Cc names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from email.header import decode_header, make_header
from email.message import Message
from email.parser import BytesParser
from email.policy import compat32
from email.utils import getaddresses

from .._compose.addresses import AddressError, parse_address
from .._errors import InvalidMessage
from ._base import Envelope

#: Headers the JSON fields carry themselves; every other header is passed on as one.
_FOLD = re.compile(r"\r?\n(?=[ \t])")

FIELD_HEADERS = frozenset({
    "from", "to", "cc", "bcc", "reply-to", "subject", "date", "mime-version",
    "content-type", "content-transfer-encoding", "content-disposition", "content-id",
})


@dataclasses.dataclass(frozen=True)
class Address:
    """One address: ``name`` may be empty."""

    email: str
    name: str = ""

    def formatted(self) -> str:
        """``"Name" <a@x.org>``, or the bare address without a name."""
        if not self.name:
            return self.email
        quoted = self.name.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{quoted}" <{self.email}>'


@dataclasses.dataclass(frozen=True)
class Attachment:
    """An attached file, or (with ``content_id``) an inline image the html refers to."""

    filename: str
    content_type: str
    content: bytes
    #: The Content-ID without its angle brackets, for an inline part.
    content_id: str | None = None

    @property
    def inline(self) -> bool:
        """Whether the html shows it (``cid:``) rather than attaching it."""
        return self.content_id is not None


@dataclasses.dataclass(frozen=True)
class MessageParts:
    """The fields of one stored message."""

    sender: Address
    to: tuple[Address, ...]
    cc: tuple[Address, ...]
    bcc: tuple[Address, ...]
    reply_to: tuple[Address, ...]
    subject: str
    text: str | None
    html: str | None
    attachments: tuple[Attachment, ...]
    #: Every other header, in order (Message-ID, List-Unsubscribe, X-...).
    headers: tuple[tuple[str, str], ...]
    #: The content types of body parts no field carries (an ``alts`` part such as
    #: text/calendar): a JSON API would drop them, so :func:`refuse_dropped` refuses.
    others: tuple[str, ...] = ()

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (any case), or None."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key.lower() == wanted), None)


def parts_of(envelope: Envelope) -> MessageParts:
    """The fields of ``envelope``'s stored message (see the module docstring).

    The message is the outbox's own well-formed MIME, so it is parsed with the
    standard library's plain (``compat32``) parser and the few headers needed
    are decoded here: the modern policy's header registry costs several times
    the whole parse, on the transport's loop thread, for every message.
    """
    message = BytesParser(policy=compat32).parsebytes(envelope.mime)
    senders = _addresses(message, "From")
    to, cc = _addresses(message, "To"), _addresses(message, "Cc")
    if envelope.left_out:
        to, cc = _without(to, envelope.left_out), _without(cc, envelope.left_out)
    named = {a.email.lower() for a in (*to, *cc)}
    bcc = tuple(Address(r) for r in envelope.recipients if r.lower() not in named)
    text = html = None
    attachments = []
    others = []
    for part in message.walk():
        if part.is_multipart():
            continue
        disposition = part.get_content_disposition()
        content_id = part.get("Content-ID")
        kind = part.get_content_type()
        if disposition != "attachment" and content_id is None and \
                kind in ("text/plain", "text/html"):
            if kind == "text/plain" and text is None:
                text = _decoded_text(part)
                continue
            if kind == "text/html" and html is None:
                html = _decoded_text(part)
                continue
        if disposition is None and content_id is None:
            others.append(kind)
            continue
        payload = part.get_payload(decode=True)
        attachments.append(Attachment(
            filename=part.get_filename() or "", content_type=kind,
            content=payload if isinstance(payload, bytes) else b"",
            content_id=_unfolded(content_id).strip().strip("<>") if content_id else None))
    return MessageParts(
        sender=senders[0] if senders else Address(envelope.sender),
        to=to, cc=cc, bcc=bcc, reply_to=_addresses(message, "Reply-To"),
        subject=_decoded(message.get("Subject", "")),
        text=text, html=html, attachments=tuple(attachments),
        headers=tuple((key, _decoded(value)) for key, value in message.items()
                      if key.lower() not in FIELD_HEADERS),
        others=tuple(others),
    )


def refuse_dropped(parts: MessageParts, kind: str) -> None:
    """Refuse at ``send()`` a message with a body part the ``kind`` API has no field for."""
    if parts.others:
        raise InvalidMessage("alts", f"a {parts.others[0]} body part cannot be sent through "
                             f"the {kind} API (it takes text and html bodies, attachments and "
                             "inline images); send this message through SMTP")


def _without(addresses: tuple[Address, ...], left_out: Sequence[str]) -> tuple[Address, ...]:
    """``addresses`` but those in ``left_out`` (envelope forms: the domain in ASCII)."""
    gone = {address.lower() for address in left_out}
    return tuple(a for a in addresses if _envelope_form(a.email) not in gone)


def _envelope_form(address: str) -> str:
    try:
        return parse_address(address, True, True).ascii.lower()
    except AddressError:
        return address.lower()


def _unfolded(value: object) -> str:
    return _FOLD.sub(" ", str(value))


def _decoded(value: object) -> str:
    """A header value unfolded, its RFC 2047 encoded words decoded."""
    text = _unfolded(value)
    return str(make_header(decode_header(text))) if "=?" in text else text


def _addresses(message: Message, header: str) -> tuple[Address, ...]:
    values = [_unfolded(value) for value in message.get_all(header, [])]
    return tuple(Address(email, _decoded(name)) for name, email in getaddresses(values)
                 if email)


def _decoded_text(part: Message) -> str:
    payload = part.get_payload(decode=True)
    data = payload if isinstance(payload, bytes) else b""
    # Text travels in canonical CRLF form; the APIs take it with plain newlines.
    return data.decode(part.get_content_charset() or "us-ascii", "replace").replace("\r\n", "\n")
