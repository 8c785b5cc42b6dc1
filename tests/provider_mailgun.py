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
