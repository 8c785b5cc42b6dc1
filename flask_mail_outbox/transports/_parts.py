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
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy
from email.utils import getaddresses

from ._base import Envelope

#: Headers the JSON fields carry themselves; every other header is passed on as one.
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

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (any case), or None."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key.lower() == wanted), None)


def parts_of(envelope: Envelope) -> MessageParts:
    """The fields of ``envelope``'s stored message (see the module docstring)."""
    message = BytesParser(policy=default_policy).parsebytes(envelope.mime)
    if not isinstance(message, EmailMessage):  # pragma: no cover - the default policy's class
        raise TypeError("the stored message did not parse as an EmailMessage")
    senders = _addresses(message, "From")
    to, cc = _addresses(message, "To"), _addresses(message, "Cc")
    named = {a.email.lower() for a in (*to, *cc)}
    bcc = tuple(Address(r) for r in envelope.recipients if r.lower() not in named)
    return MessageParts(
        sender=senders[0] if senders else Address(envelope.sender),
        to=to, cc=cc, bcc=bcc, reply_to=_addresses(message, "Reply-To"),
        subject=str(message.get("Subject", "")),
        text=_body(message, "plain"), html=_body(message, "html"),
        attachments=tuple(_attachments(message)),
        headers=tuple((key, str(value)) for key, value in message.items()
                      if key.lower() not in FIELD_HEADERS),
    )


def _addresses(message: EmailMessage, header: str) -> tuple[Address, ...]:
    values = [str(value) for value in message.get_all(header, [])]
    return tuple(Address(email, name) for name, email in getaddresses(values) if email)


def _body(message: EmailMessage, subtype: str) -> str | None:
    part = message.get_body(preferencelist=(subtype,))
    if part is None or part.get_content_subtype() != subtype:
        return None
    # Text travels in canonical CRLF form; the APIs take it with plain newlines.
    return str(part.get_content()).replace("\r\n", "\n")


def _attachments(message: EmailMessage) -> list[Attachment]:
    bodies = {id(message.get_body(preferencelist=(kind,))) for kind in ("plain", "html")}
    found = []
    for part in message.walk():
        if part.is_multipart() or id(part) in bodies:
            continue
        content_id = part.get("Content-ID")
        disposition = part.get_content_disposition()
        if disposition is None and content_id is None:
            continue
        payload = part.get_payload(decode=True)
        found.append(Attachment(
            filename=part.get_filename() or "",
            content_type=part.get_content_type(),
            content=payload if isinstance(payload, bytes) else b"",
            content_id=str(content_id).strip().strip("<>") if content_id else None))
    return found
