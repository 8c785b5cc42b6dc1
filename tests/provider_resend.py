"""A fake of Resend's Email API: ``POST /emails`` and ``POST /emails/batch``, as documented.

https://resend.com/docs/api-reference: ``Authorization: Bearer <key>`` (401
``missing_api_key`` without one, 403 ``invalid_api_key`` for a wrong one),
``{"statusCode", "name", "message"}`` error bodies, an email's fields checked
(``from``, ``to`` a list of at most 50, ``subject``, a body, ``headers`` an
object of strings, attachments with content, a ``content_id`` under 128
characters, 40 MB), 403 ``validation_error`` for a From domain not verified
(when :attr:`FakeResend.verified_domains` is set), ``Idempotency-Key`` kept:
the same key and payload answer the first reply without sending again,
another payload 409 ``invalid_idempotent_request``, one still in progress
409 ``concurrent_idempotent_requests``. A batch takes up to 100 emails
without attachments; ``x-batch-validation: permissive`` answers ``data`` and
``errors``, strict mode refuses the whole batch for one bad email. Accepted
emails are kept in :attr:`FakeResend.accepted`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import threading
import uuid
from email.utils import getaddresses
from typing import Any

from httpserver import FakeAPI, Reply, Request

API_KEY = "re_test_0123456789abcdef"

_ADDRESS = re.compile(r"^[^@\s<>\"]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$")


@dataclasses.dataclass(frozen=True)
class Accepted:
    """One email Resend accepted: its JSON, its id, whether it came in a batch."""

    id: str
    json: dict[str, Any]
    batch: bool
    idempotency_key: str | None

    def attachment(self, filename: str) -> tuple[bytes, dict[str, Any]]:
        """The decoded content and the JSON of the attachment called ``filename``."""
        found = next(a for a in self.json.get("attachments", []) if a["filename"] == filename)
        return base64.b64decode(found["content"]), found


class FakeResend(FakeAPI):
    """Resend's sending endpoints on a loopback port (see the module docstring)."""

    def __init__(self, api_key: str = API_KEY) -> None:
        super().__init__()
        self.api_key = api_key
        #: From domains Resend lets this account send from; None: any.
        self.verified_domains: set[str] | None = None
        #: Addresses Resend's validation refuses (``validation_error``).
        self.invalid: set[str] = set()
        self.accepted: list[Accepted] = []
        #: Idempotency-Key -> (the payload, the reply) for 24 hours (here: for ever).
        self._keys: dict[str, tuple[bytes, Reply]] = {}
        self._in_progress: set[str] = set()
        self._state_lock = threading.Lock()
        #: How many of the next accepted requests lose their reply: the email is
        #: sent, then the connection is cut mid-response (a crash before the record).
        self.lose_replies = 0

    def sending(self) -> list[Request]:
        """The requests to the sending endpoints, in order."""
        return [r for r in self.requests if r.path in ("/emails", "/emails/batch")]

    def handle(self, request: Request) -> Reply:
        if request.method != "POST" or request.path not in ("/emails", "/emails/batch"):
            return _error(404, "not_found", "The requested endpoint does not exist.")
        authorization = request.header("Authorization") or ""
        if not authorization.startswith("Bearer ") or not authorization[7:].strip():
            return _error(401, "missing_api_key", "Missing API key in the authorization header")
        if authorization[7:] != self.api_key:
            return _error(403, "invalid_api_key", "API key is invalid")
        key = request.header("Idempotency-Key")
        if key is None:
            return self._maybe_lost(self._answer(request))
        if not 1 <= len(key) <= 256:
            return _error(400, "invalid_idempotency_key", "The key must be between 1-256 chars.")
        with self._state_lock:
            if key in self._in_progress:
                return _error(409, "concurrent_idempotent_requests", "Same idempotency key "
                              "used while original request is still in progress.")
            seen = self._keys.get(key)
            if seen is not None:
                payload, reply = seen
                if payload != _canonical(request.body):
                    return _error(409, "invalid_idempotent_request", "Same idempotency key "
                                  "used with a different request payload.")
                return reply
            self._in_progress.add(key)
        try:
            reply = self._answer(request, key)
        finally:
            with self._state_lock:
                self._in_progress.discard(key)
        if 200 <= reply.status < 300:
            with self._state_lock:
                self._keys[key] = (_canonical(request.body), reply)
        return self._maybe_lost(reply)

    def _maybe_lost(self, reply: Reply) -> Reply:
        with self._state_lock:
            if not 200 <= reply.status < 300 or self.lose_replies <= 0:
                return reply
            self.lose_replies -= 1
        return dataclasses.replace(reply, cut=True)

    def _answer(self, request: Request, key: str | None = None) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return _error(400, "validation_error", "Invalid JSON body.")
        if request.path == "/emails":
            if not isinstance(body, dict):
                return _error(422, "validation_error", "The body must be an object.")
            problem = self._problem(body, batch=False)
            if problem is not None:
                return _error(*problem)
            return Reply(200, {"id": self._accept(body, batch=False, key=key)})
        if not isinstance(body, list) or not all(isinstance(e, dict) for e in body):
            return _error(422, "validation_error", "The body must be an array of emails.")
        if not 1 <= len(body) <= 100:
            return _error(422, "validation_error", "The batch must hold 1 to 100 emails.")
        problems = [self._problem(email, batch=True) for email in body]
        if (request.header("x-batch-validation") or "strict") != "permissive":
            first = next((p for p in problems if p is not None), None)
            if first is not None:
                return _error(*first)
        data = [{"id": self._accept(email, batch=True, key=key)}
                for email, problem in zip(body, problems, strict=True) if problem is None]
        reply: dict[str, Any] = {"data": data}
        if request.header("x-batch-validation") == "permissive":
            reply["errors"] = [{"index": i, "message": p[2]}
                               for i, p in enumerate(problems) if p is not None]
        return Reply(200, reply)

    def _accept(self, email: dict[str, Any], *, batch: bool, key: str | None) -> str:
        email_id = str(uuid.uuid4())
        with self._state_lock:
            self.accepted.append(Accepted(email_id, email, batch, key))
        return email_id

    def _problem(self, email: dict[str, Any], *, batch: bool) -> tuple[int, str, str] | None:
        for field in ("from", "to", "subject"):
            if not email.get(field):
                return 422, "missing_required_field", f"Missing `{field}` field."
        sender = email["from"]
        if not isinstance(sender, str) or sender.lstrip().startswith('"') \
                or not _valid(sender):
            return 422, "validation_error", ("Invalid `from` field. The email address needs "
                                             "to follow the `email@example.com` or `Name "
                                             "<email@example.com>` format.")
        domain = getaddresses([sender])[0][1].rpartition("@")[2].lower()
        if self.verified_domains is not None and domain not in self.verified_domains:
            return 403, "validation_error", (f"The {domain} domain is not verified. Please, "
                                             "add and verify your domain on "
                                             "https://resend.com/domains")
        for field in ("to", "cc", "bcc", "reply_to"):
            value = email.get(field)
            if value is None:
                continue
            addresses = [value] if isinstance(value, str) else value
            if not isinstance(addresses, list) or not all(isinstance(a, str)
                                                          for a in addresses):
                return 422, "validation_error", f"Invalid `{field}` field."
            if field == "to" and len(addresses) > 50:
                return 422, "validation_error", "Too many recipients in `to` (max 50)."
            for address in addresses:
                if address.lstrip().startswith('"') or not _valid(address) \
                        or getaddresses([address])[0][1].lower() in self.invalid:
                    return 422, "validation_error", (
                        f"Invalid `{field}` field. The email address needs to follow the "
                        "`email@example.com` or `Name <email@example.com>` format.")
        if not email.get("html") and not email.get("text"):
            return 422, "missing_required_field", "Missing `html` or `text` field."
        headers = email.get("headers", {})
        if not isinstance(headers, dict) or not all(isinstance(v, str)
                                                    for v in headers.values()):
            return 422, "validation_error", "Invalid `headers` field: an object of strings."
        attachments = email.get("attachments", [])
        if batch and attachments:
            return 422, "validation_error", "Attachments are not supported in batch emails."
        size = len(email.get("html") or "") + len(email.get("text") or "")
        for attachment in attachments:
            content = attachment.get("content") if isinstance(attachment, dict) else None
            if not content and not (isinstance(attachment, dict) and attachment.get("path")):
                return 422, "invalid_attachment", ("Attachment must have either a `content` "
                                                   "or `path`.")
            try:
                base64.b64decode(content or "", validate=True)
            except (binascii.Error, ValueError):
                return 422, "invalid_attachment", "Attachment content is not base64."
            size += len(content or "")
            if len(str(attachment.get("content_id") or "")) >= 128:
                return 422, "validation_error", "The `content_id` must be under 128 characters."
        if size > 40_000_000:
            return 422, "validation_error", "The email is larger than 40MB."
        return None


def _valid(address: str) -> bool:
    parsed = getaddresses([address])
    return len(parsed) == 1 and bool(_ADDRESS.match(parsed[0][1]))


def _canonical(body: bytes) -> bytes:
    """The payload as Resend compares it: the JSON, whatever its spacing and key order."""
    try:
        return json.dumps(json.loads(body), sort_keys=True).encode()
    except ValueError:
        return body


def _error(status: int, name: str, message: str) -> Reply:
    return Reply(status, {"statusCode": status, "name": name, "message": message})


# == Webhooks ==============================================================================
# Resend's webhooks as Resend sends them (https://resend.com/docs/webhooks/introduction):
# Svix-signed (svix-id, svix-timestamp, svix-signature: "v1,<base64 HMAC-SHA256 of
# f"{id}.{timestamp}.{body}"> keyed with the secret's base64 after "whsec_"), payloads in
# the shapes of https://resend.com/docs/webhooks/event-types. For the receiver's tests
# (tests/test_webhooks_resend.py) and the end-to-end ones.

import hashlib
import hmac
import os

#: The sample email of Resend's event pages.
SAMPLE_EMAIL_ID = "56761188-7520-42d8-8898-ff6fc54ce618"


def webhook_secret() -> str:
    """A new random signing secret, as Resend shows one: ``whsec_`` and base64."""
    return "whsec_" + base64.b64encode(os.urandom(24)).decode("ascii")


def svix_signature(secret: str, svix_id: str, timestamp: str, body: bytes) -> str:
    """The ``svix-signature`` value Svix sends for ``body``: ``v1,<base64>``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{svix_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def webhook_request(event: dict[str, Any], secret: str, now: float, *,
                    svix_id: str = "msg_2bPxLmd1QkdjsHM7xOX4ToFtG8N",
                    timestamp: float | None = None) -> tuple[dict[str, str], bytes]:
    """The headers (lower-case) and body Resend POSTs for ``event``, signed with ``secret``.

    ``timestamp`` is the svix-timestamp (``now`` when not given).
    """
    body = json.dumps(event).encode()
    stamp = str(int(now if timestamp is None else timestamp))
    return {"content-type": "application/json", "svix-id": svix_id, "svix-timestamp": stamp,
            "svix-signature": svix_signature(secret, svix_id, stamp, body),
            "user-agent": "Svix-Webhooks/1.0"}, body


def resend_event(event_type: str, *, email_id: str = SAMPLE_EMAIL_ID,
                 to: list[str] | None = None, created_at: str = "2024-11-22T23:41:12.126Z",
                 **data: Any) -> dict[str, Any]:
    """One webhook payload as Resend's event pages show it; ``data`` adds to its ``data``."""
    return {
        "type": event_type,
        "created_at": created_at,
        "data": {
            "broadcast_id": "8b146471-e88e-4322-86af-016cd36fd216",
            "created_at": "2024-11-22T23:41:11.894719+00:00",
            "email_id": email_id,
            "from": "Acme <onboarding@resend.dev>",
            "to": ["delivered@resend.dev"] if to is None else to,
            "subject": "Sending this example",
            "template_id": "43f68331-0622-4e15-8202-246a0388854b",
            "tags": {"category": "confirm_email"},
            **data,
        },
    }


def bounce(bounce_type: str = "Permanent", sub_type: str = "Suppressed") -> dict[str, Any]:
    """An ``email.bounced`` payload's ``bounce`` object (Resend's sample, the type given)."""
    return {
        "diagnosticCode": ["smtp; 550 5.5.0 Requested action not taken: mailbox unavailable"],
        "message": "The recipient's email address is on the suppression list because it has "
                   "a recent history of producing hard bounces.",
        "subType": sub_type,
        "type": bounce_type,
    }
