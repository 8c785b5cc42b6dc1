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


# -- Webhooks ------------------------------------------------------------------------------
#
# What Postmark POSTs to a webhook URL (https://postmarkapp.com/developer/webhooks/...):
# one record per request, the URL's credentials as HTTP Basic. The records below are the
# docs' samples, adapted: the message id, recipient and time are the caller's.

WEBHOOK_USER = "postmark-hooks"
#: Random per test run, as a real one is.
WEBHOOK_PASSWORD = uuid.uuid4().hex
WEBHOOK_SECRET = f"{WEBHOOK_USER}:{WEBHOOK_PASSWORD}"

_WEBHOOK_METADATA = {"example": "value", "example_2": "value"}
_WEBHOOK_CLIENT = {"Name": "Chrome 35.0.1916.153", "Company": "Google", "Family": "Chrome"}
_WEBHOOK_OS = {"Name": "OS X 10.7 Lion", "Company": "Apple Computer, Inc.",
               "Family": "OS X 10"}
_WEBHOOK_GEO = {"CountryISOCode": "RS", "Country": "Serbia", "RegionISOCode": "VO",
                "Region": "Autonomna Pokrajina Vojvodina", "City": "Novi Sad", "Zip": "21000",
                "Coords": "45.2517,19.8369", "IP": "188.2.95.4"}
_WEBHOOK_AGENT = ("Mozilla/5.0 (Macintosh; Intel Mac OS X 10_7_5) AppleWebKit/537.36 "
                  "(KHTML, like Gecko) Chrome/35.0.1916.153 Safari/537.36")


def webhook_request(record: dict[str, Any],
                    secret: str = WEBHOOK_SECRET) -> tuple[dict[str, str], bytes]:
    """The headers and body of Postmark's POST of ``record`` to a URL holding ``secret``."""
    credentials = base64.b64encode(secret.encode("utf-8")).decode("ascii")
    return ({"Content-Type": "application/json", "Authorization": f"Basic {credentials}"},
            json.dumps(record).encode("utf-8"))


def delivery_record(message_id: str, recipient: str,
                    delivered_at: str = "2019-11-05T16:33:54.9070259Z") -> dict[str, Any]:
    """A Delivery webhook's record."""
    return {"RecordType": "Delivery", "ServerID": 23, "MessageStream": "outbound",
            "MessageID": message_id, "Recipient": recipient, "Tag": "welcome-email",
            "DeliveredAt": delivered_at, "Details": "Test delivery webhook details",
            "Metadata": dict(_WEBHOOK_METADATA)}


def bounce_record(message_id: str, email: str, *, bounce_type: str = "HardBounce",
                  type_code: int = 1, bounce_id: int = 4323372036854775807,
                  bounced_at: str = "2019-11-05T16:33:54.9070259Z",
                  description: str = "The server was unable to deliver your message (ex: "
                                     "unknown user, mailbox not found).",
                  details: str = "Test bounce details") -> dict[str, Any]:
    """A Bounce webhook's record (``bounce_type`` and ``type_code`` from the bounce types list)."""
    return {"RecordType": "Bounce", "MessageStream": "outbound", "ID": bounce_id,
            "Type": bounce_type, "TypeCode": type_code, "Name": "Hard bounce", "Tag": "Test",
            "MessageID": message_id, "Metadata": dict(_WEBHOOK_METADATA), "ServerID": 23,
            "Description": description, "Details": details, "Email": email,
            "From": "sender@example.com", "BouncedAt": bounced_at, "DumpAvailable": True,
            "Inactive": True, "CanActivate": True, "Subject": "Test subject",
            "Content": "<Full dump of bounce>"}


def spam_complaint_record(message_id: str, email: str, *, complaint_id: int = 42,
                          bounced_at: str = "2019-11-05T16:33:54.9070259Z") -> dict[str, Any]:
    """A Spam Complaint webhook's record."""
    return {"RecordType": "SpamComplaint", "MessageStream": "outbound", "ID": complaint_id,
            "Type": "SpamComplaint", "TypeCode": 100001, "Name": "Spam complaint",
            "Tag": "Test", "MessageID": message_id, "Metadata": dict(_WEBHOOK_METADATA),
            "ServerID": 1234, "Description": "The subscriber explicitly marked this message "
            "as spam.", "Details": "Test spam complaint details", "Email": email,
            "From": "sender@example.com", "BouncedAt": bounced_at, "DumpAvailable": True,
            "Inactive": True, "CanActivate": False, "Subject": "Test subject",
            "Content": "<Abuse report dump>"}


def open_record(message_id: str, recipient: str,
                received_at: str = "2019-11-05T16:33:54.9070259Z") -> dict[str, Any]:
    """An Open webhook's record."""
    return {"RecordType": "Open", "MessageStream": "outbound",
            "Metadata": dict(_WEBHOOK_METADATA), "FirstOpen": True, "Recipient": recipient,
            "MessageID": message_id, "ReceivedAt": received_at, "Platform": "WebMail",
            "ReadSeconds": 5, "Tag": "welcome-email", "UserAgent": _WEBHOOK_AGENT,
            "OS": dict(_WEBHOOK_OS), "Client": dict(_WEBHOOK_CLIENT), "Geo": dict(_WEBHOOK_GEO)}


def click_record(message_id: str, recipient: str, link: str = "https://example.com",
                 received_at: str = "2017-10-25T15:21:11.9065619Z") -> dict[str, Any]:
    """A Click webhook's record."""
    return {"RecordType": "Click", "MessageStream": "outbound",
            "Metadata": dict(_WEBHOOK_METADATA), "Recipient": recipient,
            "MessageID": message_id, "ReceivedAt": received_at, "Platform": "Desktop",
            "ClickLocation": "HTML", "OriginalLink": link, "Tag": "welcome-email",
            "UserAgent": _WEBHOOK_AGENT, "OS": dict(_WEBHOOK_OS),
            "Client": dict(_WEBHOOK_CLIENT), "Geo": dict(_WEBHOOK_GEO)}


def subscription_change_record(message_id: str | None, recipient: str, *,
                               suppress: bool = True,
                               reason: str | None = "HardBounce", origin: str = "Recipient",
                               changed_at: str = "2020-02-01T10:53:34.416071Z",
                               ) -> dict[str, Any]:
    """A Subscription Change webhook's record (a reactivation when ``suppress`` is false)."""
    return {"RecordType": "SubscriptionChange", "MessageID": message_id, "ServerID": 123456,
            "MessageStream": "outbound", "ChangedAt": changed_at, "Recipient": recipient,
            "Origin": origin, "SuppressSending": suppress,
            "SuppressionReason": reason if suppress else None,
            "Tag": "my-tag" if suppress else None,
            "Metadata": dict(_WEBHOOK_METADATA) if suppress else {}}
