"""The Mailbox section: the development inbox, read like a mail client.

``GET /mailbox`` lists what the ``mailbox`` transport delivered (the table
``outbox_mailbox``), newest first: from, to, subject, date; "Older messages"
pages back by id (``?before=<id>``). ``GET /mailbox?message=<id>`` shows one
message: the envelope, the html in a sandboxed ``srcdoc`` frame (its inlined
styles allowed, as on a template preview: the page gets the preview's
Content-Security-Policy), the text, every header, and each attachment.
``&download=eml`` downloads the message's exact bytes, ``&download=<n>`` its
``n``-th attachment as it was sent (decoded from its transfer encoding): both
with ``Content-Disposition: attachment`` and a file name made safe, an
attachment as ``application/octet-stream``, so nothing a message carries is
ever rendered on the dashboard's origin. ``POST /mailbox/clear`` empties it
(CSRF checked like every action), then redirects.

The message is a query argument, not a path segment, as on the previews pages:
every route of the blueprint stays buildable with no placeholder but an email
id. The dashboard's ``authorize`` applies to all of it.
"""

from __future__ import annotations

import dataclasses
import email.policy
import io
import re
import unicodedata
from email.message import EmailMessage
from email.parser import BytesParser

from flask import (
    Blueprint,
    abort,
    g,
    redirect,
    render_template,
    request,
    send_file,
    url_for,
)
from flask.typing import ResponseReturnValue

from ..._flask.state import app_state
from ..._outside import clean_line
from ...core._internal import Mailbox, MailboxEntry
from ._preview import preview
from ._previews import INLINE_STYLES_FLAG

# Ids are BIGINT: a larger number names no message.
_MAX_ID = 2**63 - 1
#: The most characters of a download's file name.
_MAX_FILENAME = 150
#: The longest extension kept whole when a long name is cut.
_MAX_SUFFIX = 16
_UNSAFE_IN_FILENAME = re.compile(r'[\\/:*?"<>|\x00-\x1f\x7f]+')
NOTICES = {
    "cleared": "Mailbox cleared: {n} message(s) deleted.",
}


@dataclasses.dataclass(frozen=True)
class Part:
    """An attachment of a message: its place, name, type and decoded size."""

    index: int
    filename: str
    content_type: str
    size: int


class MailboxPages:
    """The Mailbox pages and the clear action (the app's outbox, read per request)."""

    def __init__(self, *, page_size: int) -> None:
        self.page_size = page_size

    def register(self, bp: Blueprint) -> None:
        bp.add_url_rule("/mailbox", "mailbox", self.mailbox)
        bp.add_url_rule("/mailbox/clear", "mailbox_clear", self.clear, methods=["POST"])

    def _mailbox(self) -> Mailbox:
        return Mailbox(app_state().outbox().store)

    # -- pages ----------------------------------------------------------------------

    def mailbox(self) -> ResponseReturnValue:
        if "message" not in request.args:
            return self._list()
        entry = self._entry(_id_arg("message"))
        download = request.args.get("download")
        if download is None:
            return self._message(entry)
        if download == "eml":
            return send_file(io.BytesIO(entry.mime or b""), mimetype="message/rfc822",
                             as_attachment=True, download_name=f"mailbox-{entry.id}.eml")
        if not (download.isascii() and download.isdigit() and len(download) < 6):
            abort(400, description="download must be eml or an attachment's number")
        return self._attachment(entry, int(download))

    def _list(self) -> ResponseReturnValue:
        before = _id_arg("before") if "before" in request.args else None
        page = self._mailbox().page(limit=self.page_size, before=before)
        return render_template("outbox_dashboard/mailbox.html", page=page,
                               transports=self._mailbox_transports(), notice=_notice())

    def _message(self, entry: MailboxEntry) -> ResponseReturnValue:
        mime = entry.mime or b""
        # The message's inlined styles apply in its frame, as on a template preview.
        g.setdefault(INLINE_STYLES_FLAG, True)
        return render_template("outbox_dashboard/mailbox_message.html", entry=entry,
                               preview=preview(mime), parts=attachments_of(mime))

    def _attachment(self, entry: MailboxEntry, index: int) -> ResponseReturnValue:
        found = _attachment_parts(entry.mime or b"")
        if not 0 <= index < len(found):
            abort(404, description=f"Message {entry.id} has no attachment {index}.")
        part, payload = found[index]
        return send_file(io.BytesIO(payload), mimetype="application/octet-stream",
                         as_attachment=True,
                         download_name=safe_filename(part.get_filename(), index))

    # -- the action -----------------------------------------------------------------

    def clear(self) -> ResponseReturnValue:
        deleted = self._mailbox().clear()
        return redirect(url_for(".mailbox", notice="cleared", n=deleted), code=303)

    # -- helpers --------------------------------------------------------------------

    def _entry(self, entry_id: int) -> MailboxEntry:
        entry = self._mailbox().get(entry_id)
        if entry is None:
            abort(404, description=f"There is no message {entry_id} in the mailbox (cleared?).")
        return entry

    def _mailbox_transports(self) -> list[str]:
        """The configured transport names that are mailboxes (for the empty page's hint)."""
        config = app_state().outbox().config
        if config.suppress_send:
            return []
        return [spec.name for spec in config.transport_specs if spec.kind == "mailbox"]


def attachments_of(mime: bytes) -> list[Part]:
    """The attachments of ``mime``, in order; [] when it does not parse."""
    return [Part(index, safe_filename(part.get_filename(), index),
                 clean_line(part.get_content_type(), 255), len(payload))
            for index, (part, payload) in enumerate(_attachment_parts(mime))]


def _attachment_parts(mime: bytes) -> list[tuple[EmailMessage, bytes]]:
    """Each leaf part that is an attachment (or a named inline part), with its bytes."""
    try:
        message = BytesParser(policy=email.policy.default).parsebytes(mime)
        if not isinstance(message, EmailMessage):
            return []
        found = []
        for part in message.walk():
            if not isinstance(part, EmailMessage) or part.is_multipart():
                continue
            disposition = part.get_content_disposition()
            if disposition == "attachment" or (disposition == "inline" and part.get_filename()):
                payload = part.get_payload(decode=True)
                found.append((part, payload if isinstance(payload, bytes) else b""))
        return found
    except Exception:  # noqa: BLE001 - the page says the message does not parse
        return []


def safe_filename(name: object, index: int) -> str:
    """A download name: no path, no control, format or reserved character, not hidden,
    not empty, at most :data:`_MAX_FILENAME` characters with its extension kept.

    Format characters (category Cf) go: a right-to-left override would show
    ``invoice<RLO>gpj.exe`` as ``invoiceexe.jpg``. A long name is cut in its stem,
    so the extension the browser and the OS go by is the one it has.
    """
    raw = name if isinstance(name, str) else ""
    if len(raw) > _MAX_FILENAME * 4:
        raw = raw[:_MAX_FILENAME * 2] + raw[-_MAX_FILENAME:]
    raw = "".join(c for c in raw if unicodedata.category(c) != "Cf")
    stem, dot, suffix = raw.rpartition(".")
    if not (dot and 0 < len(suffix) <= _MAX_SUFFIX):
        stem, suffix = raw, ""
    suffix = _UNSAFE_IN_FILENAME.sub("_", clean_line(suffix, _MAX_SUFFIX))
    stem = _UNSAFE_IN_FILENAME.sub("_", clean_line(stem, _MAX_FILENAME - len(suffix) - bool(suffix)))
    text = (f"{stem}.{suffix}" if suffix else stem).strip(" ._")
    return text or f"attachment-{index + 1}"


def _id_arg(field: str) -> int:
    """A message id from the query; 400 if no row can have it."""
    value = request.args.get(field, "")
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= _MAX_ID):
        abort(400, description=f"{field} must be a message id from 1 to 2**63-1")
    return int(value)


def _notice() -> str | None:
    text = NOTICES.get(request.args.get("notice", ""))
    if text is None:
        return None
    count = request.args.get("n", "")
    return text.format(n=count if count.isascii() and count.isdigit() else "?")
