"""What a test sees of its emails: committed ``outbox_email`` rows, each parsed once.

The rows are read on a connection of their own, never through the test's
``db.session``: only what a transaction committed is there, so an email whose
transaction (or savepoint) rolled back is absent by construction, as it is for
the worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import sqlalchemy as sa

from ..core import Status, email_table

#: Every status a row can have, for checking ``emails(status=...)``.
STATUSES = tuple(s.value for s in Status)

_PARSER = BytesParser(policy=policy.default)


@dataclass(frozen=True)
class TestEmail:
    """One email as it is in the outbox's table, with its MIME parsed.

    ``to`` and ``cc`` are the addresses of the message's headers, ``bcc`` the
    envelope recipients that neither names; ``recipients`` the whole envelope.
    ``html`` and ``text`` are the bodies (None when the message has no such
    part); ``mime`` the exact bytes handed to the transport and ``parsed`` them as
    an :class:`~email.message.EmailMessage`. ``mime``, ``parsed``, ``html`` and
    ``text`` are None once the row was scrubbed (``OUTBOX_SCRUB_SENT``).
    ``template`` and ``locale``: what ``mail.send_template()`` rendered.
    """

    __test__ = False  # a name pytest would otherwise collect

    id: int
    status: str
    subject: str
    sender: str
    to: tuple[str, ...]
    cc: tuple[str, ...]
    bcc: tuple[str, ...]
    recipients: tuple[str, ...]
    html: str | None
    text: str | None
    mime: bytes | None
    parsed: EmailMessage | None = field(repr=False, compare=False)
    template: str | None
    locale: str | None
    key: str | None
    attempts: int
    last_error: str | None
    message_id: str
    created_at: datetime
    due_at: datetime
    sent_at: datetime | None
    expires_at: datetime | None

    def headers(self, name: str) -> list[str]:
        """Every value of header ``name`` (any case), in order; ``[]`` when absent or scrubbed."""
        if self.parsed is None:
            return []
        return [str(value) for value in self.parsed.get_all(name, [])]

    def header(self, name: str) -> str | None:
        """The first value of header ``name``, or None."""
        values = self.headers(name)
        return values[0] if values else None

    def attachments(self) -> list[tuple[str | None, str, bytes]]:
        """``(filename, content type, data)`` of each attachment, in order."""
        if self.parsed is None:
            return []
        found = []
        for part in self.parsed.iter_attachments():
            data = part.get_payload(decode=True)
            found.append((part.get_filename(), part.get_content_type(),
                          data if isinstance(data, bytes) else b""))
        return found


def read_emails(engine: sa.Engine, status: str | None = None) -> list[TestEmail]:
    """The committed rows of ``engine``'s outbox, oldest first (``status``: only those)."""
    t = email_table
    query = sa.select(t).order_by(t.c.id)
    if status is not None:
        query = query.where(t.c.status == status)
    with engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
    return [to_test_email(row) for row in rows]


def to_test_email(row: Any) -> TestEmail:
    """One ``outbox_email`` row (a mapping) as a :class:`TestEmail`."""
    envelope = tuple(json.loads(row["recipients"]))
    mime: bytes | None = None if row["mime"] is None else bytes(row["mime"])
    parsed: EmailMessage | None = None
    to: tuple[str, ...] = ()
    cc: tuple[str, ...] = ()
    html = text = None
    if mime is not None:
        parsed = _PARSER.parsebytes(mime)
        to = _addresses(parsed, "To")
        cc = _addresses(parsed, "Cc")
        html = _body(parsed, "html")
        text = _body(parsed, "plain")
    named = {a.lower() for a in to + cc}
    bcc = tuple(a for a in envelope if a.lower() not in named)
    return TestEmail(
        id=int(row["id"]), status=row["status"], subject=row["subject"], sender=row["sender"],
        to=to, cc=cc, bcc=bcc, recipients=envelope, html=html, text=text, mime=mime,
        parsed=parsed, template=row["template_name"], locale=row["template_locale"],
        key=row["key"], attempts=int(row["attempts"]), last_error=row["last_error"],
        message_id=row["message_id"], created_at=row["created_at"], due_at=row["due_at"],
        sent_at=row["sent_at"], expires_at=row["expires_at"])


def _addresses(message: EmailMessage, name: str) -> tuple[str, ...]:
    return tuple(str(a.addr_spec) for header in message.get_all(name, [])
                 for a in getattr(header, "addresses", ()) if a.addr_spec)


def _body(message: EmailMessage, subtype: str) -> str | None:
    part = message.get_body(preferencelist=(subtype,))
    if part is None or part.get_content_subtype() != subtype:
        return None
    # Text travels in canonical CRLF form; hand it back with Python newlines.
    return str(part.get_content()).replace("\r\n", "\n")
