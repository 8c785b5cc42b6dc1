"""A fake Mailgun ``messages.mime`` API: its auth, its validation, its answers.

Implements ``POST /v3/{domain}/messages.mime`` as Mailgun documents it: HTTP
Basic authentication with user ``api`` and the key (else 401 with the body
``Forbidden``); a domain of the account (else 404 ``{"message": "Domain not
found: ..."}``); a ``multipart/form-data`` body with ``to`` (one or more,
each a valid address) and ``message`` as a file part holding a MIME message
with a From header, each refused with 400 ``{"message": ...}``; success is
200 ``{"id": "<...@domain>", "message": "Queued. Thank you."}``. Accepted
sends are kept, with the exact bytes of ``message``, in :attr:`accepted`.
"""

from __future__ import annotations

import base64
import dataclasses
import re
import secrets
import threading
import time
from email.parser import BytesParser
from email.policy import default as default_policy
from email.utils import getaddresses

from httpserver import FakeAPI, Reply, Request

_PATH = re.compile(r"/v3/([^/]+)/messages\.mime")
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")


@dataclasses.dataclass(frozen=True)
class Accepted:
    """One message Mailgun queued: its id, recipients and the MIME bytes as received."""

    message_id: str
    domain: str
    to: list[str]
    mime: bytes
    request: Request


class MailgunAPI(FakeAPI):
    """The ``messages.mime`` endpoint on a loopback port (see the module docstring)."""

    def __init__(self, api_key: str = "key-test-secret",
                 domains: frozenset[str] = frozenset({"mg.example.com"})) -> None:
        super().__init__()
        self.api_key = api_key
        self.domains = set(domains)
        #: Addresses Mailgun refuses as invalid (the test decides).
        self.invalid_addresses: set[str] = set()
        self.accepted: list[Accepted] = []
        self._accept_lock = threading.Lock()

    def handle(self, request: Request) -> Reply:
        match = _PATH.fullmatch(request.path)
        if match is None or request.method != "POST":
            # What Mailgun answers a path it does not route: a 404 without JSON.
            return Reply(404, b"404 page not found\n", {"Content-Type": "text/plain"})
        expected = "Basic " + base64.b64encode(f"api:{self.api_key}".encode()).decode()
        if request.header("Authorization") != expected:
            return Reply(401, b"Forbidden", {"Content-Type": "text/plain"})
        domain = match.group(1)
        if domain not in self.domains:
            return Reply(404, {"message": f"Domain not found: {domain}"})
        try:
            fields = _form_data(request)
        except ValueError as exc:
            return Reply(400, {"message": str(exc)})
        to = [value.decode() for value in fields.get("to", [])]
        if not to:
            return Reply(400, {"message": "to parameter is missing"})
        for value in to:
            for _, address in getaddresses([value]):
                if not _EMAIL.fullmatch(address) or address.lower() in self.invalid_addresses:
                    return Reply(400, {"message": "to parameter is not a valid address. "
                                                  "please check documentation"})
        if len(fields.get("message", [])) != 1:
            return Reply(400, {"message": "message parameter is missing"})
        mime = fields["message"][0]
        headers = BytesParser(policy=default_policy).parsebytes(mime, headersonly=True)
        if not headers.get("From"):
            return Reply(400, {"message": "from parameter is missing"})
        message_id = f"<{time.strftime('%Y%m%d%H%M%S')}.{secrets.token_hex(8)}@{domain}>"
        with self._accept_lock:
            self.accepted.append(Accepted(message_id, domain, to, mime, request))
        return Reply(200, {"id": message_id, "message": "Queued. Thank you."})


def _form_data(request: Request) -> dict[str, list[bytes]]:
    """The fields of a ``multipart/form-data`` body, each value's bytes exactly as sent."""
    content_type = request.header("Content-Type") or ""
    found = re.search(r'boundary="?([^";]+)"?', content_type)
    if not content_type.startswith("multipart/form-data") or found is None:
        raise ValueError("the request must be multipart/form-data")
    delimiter = b"--" + found.group(1).encode()
    fields: dict[str, list[bytes]] = {}
    for chunk in request.body.split(delimiter)[1:]:
        if chunk.startswith(b"--"):
            break  # the closing delimiter
        head, sep, value = chunk[2:].partition(b"\r\n\r\n")  # after the delimiter's CRLF
        name = re.search(rb'name="([^"]*)"', head)
        if not sep or name is None or not value.endswith(b"\r\n"):
            raise ValueError("a malformed multipart/form-data part")
        fields.setdefault(name.group(1).decode(), []).append(value[:-2])
    return fields


# -- Webhooks ------------------------------------------------------------------------------
#
# Mailgun's webhooks (https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/):
# one JSON object per POST, {"signature": {...}, "event-data": {...}}, the signature the
# hex HMAC-SHA256 of timestamp + token keyed with the webhook signing key
# (.../webhooks/securing-webhooks). The events below are the docs' samples, adapted: the
# message id (as the send answered it, brackets and all), recipient and time are the caller's.

import hashlib
import hmac
import json
from typing import Any

#: Random per test run, as a real one is.
WEBHOOK_SIGNING_KEY = f"{secrets.token_hex(16)}-{secrets.token_hex(4)}-{secrets.token_hex(4)}"


def webhook_signature(timestamp: str, token: str, signing_key: str) -> str:
    """``signature.signature`` of a webhook signed at ``timestamp`` with ``token``."""
    return hmac.new(signing_key.encode("utf-8"), (timestamp + token).encode("utf-8"),
                    hashlib.sha256).hexdigest()


def webhook_payload(event_data: dict[str, Any], signing_key: str, now: float,
                    token: str | None = None) -> dict[str, Any]:
    """The JSON object Mailgun POSTs for ``event_data``, signed at ``now``."""
    token = token or secrets.token_hex(25)  # "randomly generated string with length of 50"
    timestamp = str(int(now))
    return {"signature": {"token": token, "timestamp": timestamp,
                          "signature": webhook_signature(timestamp, token, signing_key)},
            "event-data": event_data}


def webhook_request(event_data: dict[str, Any], signing_key: str, now: float,
                    token: str | None = None) -> tuple[dict[str, str], bytes]:
    """The headers and body of Mailgun's POST of ``event_data``, signed at ``now``."""
    payload = webhook_payload(event_data, signing_key, now, token)
    return {"Content-Type": "application/json"}, json.dumps(payload).encode("utf-8")


def webhook_event(event: str, message_id: str, recipient: str, timestamp: float,
                  event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """``event-data`` as the docs show it; ``message_id`` as the send answered it.

    ``extra`` adds or replaces fields (``severity``, ``reason``, ``delivery-status``...);
    without them ``failed`` is the docs' permanent failure sample.
    """
    headers = {"to": f"Alice <{recipient}>", "message-id": message_id.strip("<>"),
               "from": "Bob <bob@mg.example.com>", "subject": "Test webhook"}
    data: dict[str, Any] = {
        "event": event, "id": event_id or secrets.token_urlsafe(16), "timestamp": timestamp,
        "log-level": "info", "recipient": recipient,
        "recipient-domain": recipient.rpartition("@")[2],
        "envelope": {"transport": "smtp", "sender": "bob@mg.example.com",
                     "sending-ip": "209.61.154.250", "targets": recipient},
        "flags": {"is-routed": False, "is-authenticated": True, "is-system-test": False,
                  "is-test-mode": False},
        "message": {"headers": headers, "attachments": [], "size": 111},
        "tags": ["my_tag_1", "my_tag_2"],
        "user-variables": {"my_var_1": "Mailgun Variable #1", "my-var-2": "awesome"},
        "campaigns": [],
    }
    if event == "delivered":
        data["delivery-status"] = {
            "tls": True, "mx-host": "smtp-in.example.com", "attempt-no": 1, "description": "",
            "session-seconds": 0.4331989288330078, "utf8": True, "code": 250, "message": "OK",
            "certificate-verified": True}
    elif event == "failed":
        data.update({"log-level": "error", "severity": "permanent", "reason": "bounce",
                     "delivery-status": {
                         "attempt-no": 1, "code": 550, "description": "",
                         "message": "5.1.1 The email account that you tried to reach does "
                                    "not exist.", "session-seconds": 2.95,
                         "mx-host": "aspmx.l.example.org"}})
    elif event in ("opened", "clicked", "unsubscribed", "complained"):
        data["message"] = {"headers": {"message-id": headers["message-id"]}}
        data.update({"ip": "50.56.129.169", "geolocation": {
            "country": "US", "region": "CA", "city": "San Francisco"},
            "client-info": {"client-type": "browser", "client-os": "Linux",
                            "device-type": "desktop", "client-name": "Chrome",
                            "user-agent": "Mozilla/5.0 (X11; Linux x86_64)"}})
        if event == "clicked":
            data["url"] = "https://example.com/offer"
    return {**data, **extra}
