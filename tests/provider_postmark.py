"""A fake of Postmark's Email API: ``POST /email`` and ``POST /email/batch``, as documented.

https://postmarkapp.com/developer/api/email-api and .../api/overview: the
server token in ``X-Postmark-Server-Token`` (401 with ``ErrorCode`` 10
otherwise), JSON only (422 ``ErrorCode`` 409 / 402 otherwise), a message's
fields checked the way Postmark's ``ErrorCode`` 300 article describes (a
From, at least one recipient and at most 50, a text or html body, valid
attachments), inactive recipients refused with ``ErrorCode`` 406 (or, when
only some are, accepted with the "inactive addresses" note), 413 over the
size limits. A single message's error is a 422; a batch answers 200 with one
reply per message. Accepted messages are kept in :attr:`FakePostmark.accepted`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import json
import re
import threading
import uuid
from email.utils import getaddresses
from typing import Any

from httpserver import FakeAPI, Reply, Request

TOKEN = "pm-server-token-0123"

_MAILBOX = re.compile(r"^[a-z0-9.!#$%&'`*+\-/=^_{}|~]+$", re.IGNORECASE)
_DOMAIN = re.compile(r"^((\.)?[a-zA-Z0-9\-])+$")


@dataclasses.dataclass(frozen=True)
class Accepted:
    """One message Postmark accepted: its JSON, its MessageID, its attachments decoded."""

    message_id: str
    json: dict[str, Any]
    batch: bool

    def attachment(self, name: str) -> tuple[bytes, dict[str, Any]]:
        """The decoded content and the JSON of the attachment called ``name``."""
        found = next(a for a in self.json.get("Attachments", []) if a["Name"] == name)
        return base64.b64decode(found["Content"]), found

    def header(self, name: str) -> str | None:
        """A custom header's value (any case), or None."""
        return next((h["Value"] for h in self.json.get("Headers", [])
                     if h["Name"].lower() == name.lower()), None)


class FakePostmark(FakeAPI):
    """Postmark's sending endpoints on a loopback port (see the module docstring)."""

    def __init__(self, token: str = TOKEN, *, max_message_bytes: int = 10_000_000,
                 max_batch_bytes: int = 50_000_000) -> None:
        super().__init__()
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.max_batch_bytes = max_batch_bytes
        #: Addresses Postmark has marked inactive (a hard bounce, a complaint).
        self.inactive: set[str] = set()
        self.accepted: list[Accepted] = []
        self._accepted_lock = threading.Lock()

    def sending(self) -> list[Request]:
        """The requests to the sending endpoints, in order."""
        return [r for r in self.requests if r.path in ("/email", "/email/batch")]

    def handle(self, request: Request) -> Reply:
        if request.method != "POST" or request.path not in ("/email", "/email/batch"):
            return Reply(404, {"ErrorCode": 404, "Message": "Not found"})
        if (request.header("X-Postmark-Server-Token") or "").lower() != self.token.lower():
            return Reply(401, {"ErrorCode": 10, "Message": "The Server Token you provided in "
                               "the X-Postmark-Server-Token request header was invalid. "
                               "Please verify that you are using a valid token."})
        if "application/json" not in (request.header("Content-Type") or ""):
            return _error(409, "JSON required")
        batch = request.path == "/email/batch"
        if len(request.body) > (self.max_batch_bytes if batch else self.max_message_bytes):
            return Reply(413, {"ErrorCode": 413, "Message": "Payload Too Large"})
        try:
            body = json.loads(request.body)
        except ValueError:
            return _error(402, "Invalid JSON")
        if not batch:
            if not isinstance(body, dict):
                return _error(403, "Incompatible JSON")
            reply = self._one(body, batch=False)
            return Reply(200 if reply["ErrorCode"] == 0 else 422, reply)
        if not isinstance(body, list) or not all(isinstance(m, dict) for m in body):
            return _error(403, "Incompatible JSON")
        if len(body) > 500:
            return _error(410, "Too many batch messages")
        return Reply(200, [self._one(message, batch=True) for message in body])

    def _one(self, message: dict[str, Any], *, batch: bool) -> dict[str, Any]:
        problem = self._problem(message)
        if problem is not None:
            code, text = problem
            return {"ErrorCode": code, "Message": text}
        recipients = [a for field in ("To", "Cc", "Bcc")
                      for _, a in getaddresses([message.get(field) or ""]) if a]
        inactive = [a.lower() for a in recipients if a.lower() in self.inactive]
        if inactive and len(inactive) == len(recipients):
            return {"ErrorCode": 406, "Message": "You tried to send to recipient(s) that "
                    "have been marked as inactive. Found inactive addresses: "
                    f"{', '.join(inactive)}. Inactive recipients are ones that have generated "
                    "a hard bounce, a spam complaint, or a manual suppression."}
        message_id = str(uuid.uuid4())
        with self._accepted_lock:
            self.accepted.append(Accepted(message_id, message, batch))
        text = "OK"
        if inactive:
            text = (f"Message OK, but will not deliver to these inactive addresses: "
                    f"{', '.join(inactive)}. Inactive recipients are ones that have generated "
                    "a hard bounce or a spam complaint.")
        return {"To": message.get("To", ""), "MessageID": message_id, "ErrorCode": 0,
                "SubmittedAt": datetime.datetime.now(datetime.UTC).isoformat(),
                "Message": text}

    def _problem(self, message: dict[str, Any]) -> tuple[int, str] | None:
        sender = message.get("From")
        if not isinstance(sender, str) or not sender.strip():
            return 300, "Invalid 'From' address: ''."
        if _bad_address(sender) is not None:
            return 300, f"Invalid 'From' address: '{sender}'."
        count = 0
        for field in ("To", "Cc", "Bcc", "ReplyTo"):
            value = message.get(field)
            if value is None:
                continue
            if not isinstance(value, str):
                return 403, "Incompatible JSON"
            for name, address in getaddresses([value]):
                bad = _bad_address(address)
                if bad is not None:
                    return 300, f"Error parsing '{field}': {bad}"
                count += field != "ReplyTo"
        if count == 0:
            return 300, "Zero recipients specified"
        if count > 50:
            return 300, "Maximum of 50 recipients allowed per email message"
        if not message.get("TextBody") and not message.get("HtmlBody"):
            return 300, "Provide either email TextBody or HtmlBody or both."
        headers = message.get("Headers", [])
        if not isinstance(headers, list) or not all(
                isinstance(h, dict) and isinstance(h.get("Name"), str)
                and isinstance(h.get("Value"), str) for h in headers):
            return 403, "Incompatible JSON"
        for attachment in message.get("Attachments", []):
            if not isinstance(attachment, dict) or not attachment.get("Name"):
                return 300, "Attachment name missing"
            try:
                base64.b64decode(attachment.get("Content", ""), validate=True)
            except (binascii.Error, ValueError):
                return 300, f"Invalid attachment content for '{attachment['Name']}'"
            if "/" not in str(attachment.get("ContentType", "")):
                return 300, f"Invalid content type for attachment '{attachment['Name']}'"
            content_id = attachment.get("ContentID")
            if content_id is not None and not re.fullmatch(r"[\x21-\x7e]+", str(content_id)):
                return 300, f"Invalid ContentID for attachment '{attachment['Name']}'"
        stream = message.get("MessageStream", "outbound")
        if not isinstance(stream, str) or not stream:
            return 1235, "The message stream for the provided 'ID' was not found."
        return None


def _bad_address(address: str) -> str | None:
    """Why Postmark would refuse ``address`` (its ErrorCode 300 article's patterns), or None."""
    _, email = getaddresses([address])[0] if "<" in address else ("", address)
    mailbox, at, domain = email.strip().rpartition("@")
    if not at:
        return f"Illegal email address '{email}'. It must contain the '@' symbol."
    if not _MAILBOX.match(mailbox):
        return f"Illegal email mailbox '{mailbox}' in address '{email}'."
    if not _DOMAIN.match(domain):
        return f"Illegal email domain '{domain}' in address '{email}'."
    return None


def _error(code: int, text: str) -> Reply:
    return Reply(422, {"ErrorCode": code, "Message": text})
