"""A fake SendGrid v3 Mail Send API: its auth, its validation, its answers.

Implements ``POST /v3/mail/send`` as SendGrid documents it (the Mail Send
reference, its OpenAPI description ``tsg_mail_v3`` and the Mail Send "Errors"
page): ``Authorization: Bearer <key>`` or 401; the body's required fields,
types and rules (one ``to`` at least per personalization, at most 1000
recipients, each address once, a subject, content values of one character or
more with text/plain before text/html, attachments with base64 ``content``
and a ``filename``, ``content_id`` for an inline one, no reserved header,
``reply_to`` or ``reply_to_list`` but not both), each refused with 400 and
``{"errors": [{"message", "field", "help"}]}``; success is 202 with an empty
body and an ``X-Message-Id``. Accepted sends are kept in :attr:`accepted`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
import secrets
import threading
from typing import Any

from httpserver import FakeAPI, Reply, Request

HELP = "https://www.twilio.com/docs/sendgrid/api-reference/mail-send/errors"
RESERVED = {"x-sg-id", "x-sg-eid", "received", "dkim-signature", "content-type",
            "content-transfer-encoding", "to", "from", "subject", "reply-to", "cc", "bcc"}
_EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")


@dataclasses.dataclass(frozen=True)
class Accepted:
    """One send SendGrid queued: its body and the id it answered."""

    message_id: str
    body: dict[str, Any]
    request: Request


class Invalid(Exception):
    """One of the API's validation errors."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


class SendGridAPI(FakeAPI):
    """The Mail Send endpoint on a loopback port (see the module docstring)."""

    def __init__(self, api_key: str = "SG.test-key.secret") -> None:
        super().__init__()
        self.api_key = api_key
        #: Addresses this account's SendGrid refuses as invalid (the test decides).
        self.invalid_addresses: set[str] = set()
        self.accepted: list[Accepted] = []
        self._accept_lock = threading.Lock()

    def handle(self, request: Request) -> Reply:
        if request.path != "/v3/mail/send":
            return _errors(404, None, "not found")
        if request.method != "POST":
            return _errors(405, None, "method not allowed")
        auth = request.header("Authorization")
        if not auth:
            return _errors(401, None, "authorization required")
        if auth != f"Bearer {self.api_key}":
            return _errors(401, None, "The provided authorization grant is invalid, expired, "
                                      "or revoked")
        try:
            body = json.loads(request.body)
        except ValueError:
            return _errors(400, None, "Bad Request")
        try:
            self._validate(body)
        except Invalid as exc:
            return _errors(400, exc.field, exc.message)
        message_id = secrets.token_urlsafe(16)
        with self._accept_lock:
            self.accepted.append(Accepted(message_id, body, request))
        return Reply(202, b"", {"X-Message-Id": message_id})

    # -- the documented rules -------------------------------------------------------------

    def _validate(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise Invalid(None, "Bad Request")
        sender = body.get("from")
        if not isinstance(sender, dict) or not sender.get("email"):
            raise Invalid("from.email", "The from object must be provided for every email "
                          "send. It is an object that requires the email parameter, but may "
                          "also contain a name parameter.")
        self._address("from", sender)
        personalizations = body.get("personalizations")
        if not isinstance(personalizations, list) or not personalizations:
            raise Invalid("personalizations", "You must have at least one personalization.")
        if len(personalizations) > 1000:
            raise Invalid("personalizations", "The personalization block is limited to 1000 "
                          "personalizations per API request.")
        total = 0
        for index, personalization in enumerate(personalizations):
            if not isinstance(personalization, dict) or not personalization.get("to"):
                raise Invalid(f"personalizations.{index}.to", "The to parameter is required "
                              "for all personalization objects.")
            seen: set[str] = set()
            for kind in ("to", "cc", "bcc"):
                for number, address in enumerate(personalization.get(kind) or []):
                    field = f"personalizations.{index}.{kind}.{number}.email"
                    email = self._address(field, address)
                    if email.lower() in seen:
                        raise Invalid(f"personalizations.{index}", "Each email address in the "
                                      "personalization block should be unique between to, cc, "
                                      f"and bcc. We found the first duplicate instance of "
                                      f"[{email}] in the personalizations.{index}.{kind} "
                                      "field.")
                    seen.add(email.lower())
                    total += 1
            self._headers(f"personalizations.{index}.headers", personalization.get("headers"))
        if total > 1000:
            raise Invalid("personalizations", "There is a limit of 1000 total recipients "
                          "(to + cc + bcc) per request.")
        if not body.get("subject") and not all(p.get("subject") for p in personalizations):
            raise Invalid("subject", "The subject is required. You can get around this "
                          "requirement if you use a template with a subject defined or if "
                          "every personalization has a subject defined.")
        if "reply_to" in body and "reply_to_list" in body:
            raise Invalid("reply_to", "You can use either the reply_to property or the "
                          "reply_to_list property but not both.")
        if "reply_to" in body:
            self._address("reply_to", body["reply_to"])
        for number, address in enumerate(body.get("reply_to_list") or []):
            self._address(f"reply_to_list.{number}", address)
        self._content(body)
        self._attachments(body.get("attachments"))
        self._headers("headers", body.get("headers"))

    def _address(self, field: str, value: Any) -> str:
        email = value.get("email") if isinstance(value, dict) else None
        if not isinstance(email, str) or not _EMAIL.fullmatch(email) \
                or email.lower() in self.invalid_addresses:
            raise Invalid(field, "Does not contain a valid address.")
        name = value.get("name")
        if name is not None and not isinstance(name, str):
            raise Invalid(field.replace(".email", ".name"), "Invalid type. Expected: string")
        return email

    @staticmethod
    def _content(body: dict[str, Any]) -> None:
        content = body.get("content")
        if not isinstance(content, list) or not content:
            raise Invalid("content", "Unless a valid template_id is provided, the content "
                          "parameter is required. There must be at least one defined content "
                          "block.")
        types = []
        for index, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str) \
                    or not block["type"]:
                raise Invalid(f"content.{index}.type", "The content type must be a string at "
                              "least one character in length.")
            if not isinstance(block.get("value"), str) or not block["value"]:
                raise Invalid(f"content.{index}.value", "The content value must be a string "
                              "at least one character in length.")
            types.append(block["type"])
        wanted = [t for t in ("text/plain", "text/html") if t in types]
        if types[:len(wanted)] != wanted or len(set(types)) != len(types):
            raise Invalid("content", "If present, text/plain and text/html may only be "
                          "provided once, and text/plain must be first, followed by "
                          "text/html, followed by any other content.")

    @staticmethod
    def _attachments(attachments: Any) -> None:
        for index, item in enumerate(attachments or []):
            if not isinstance(item, dict) or not item.get("content"):
                raise Invalid(f"attachments.{index}.content", "The attachment content is "
                              "required.")
            try:
                base64.b64decode(item["content"], validate=True)
            except (binascii.Error, ValueError):
                raise Invalid(f"attachments.{index}.content", "The attachment content must "
                              "be base64 encoded.") from None
            if not item.get("filename"):
                raise Invalid(f"attachments.{index}.filename", "The attachment filename "
                              "parameter is required.")
            disposition = item.get("disposition", "attachment")
            if disposition not in ("inline", "attachment"):
                raise Invalid(f"attachments.{index}.disposition", "The disposition of your "
                              "attachment can be either \"inline\" or \"attachment\".")
            if disposition == "inline" and not item.get("content_id"):
                raise Invalid(f"attachments.{index}.content_id", "The content_id parameter "
                              "is required if disposition is set to inline.")

    @staticmethod
    def _headers(field: str, headers: Any) -> None:
        if headers is None:
            return
        if not isinstance(headers, dict):
            raise Invalid(field, "Invalid type. Expected: object")
        for name, value in headers.items():
            if name.lower() in RESERVED:
                raise Invalid(field, f"The header {name} is reserved and cannot be "
                              "overridden.")
            if not isinstance(value, str):
                raise Invalid(f"{field}.{name}", "Invalid type. Expected: string")
            if not value.isascii():
                raise Invalid(f"{field}.{name}", "Header values must be properly encoded "
                              "if they contain unicode characters.")


def _errors(status: int, field: str | None, message: str) -> Reply:
    return Reply(status, {"errors": [{"message": message, "field": field, "help": HELP}]})


# -- Webhooks ------------------------------------------------------------------------------
#
# The Event Webhook (https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/event):
# a JSON array of events per POST, signed as the Signed Event Webhook does it
# (.../getting-started-event-webhook-security-features): ECDSA P-256 with SHA-256 over the
# timestamp header's bytes followed by the body, the DER signature in base64. The events
# below are the reference's samples, adapted: message id, recipient and time are the caller's.

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec


def webhook_key() -> tuple[ec.EllipticCurvePrivateKey, str]:
    """A new signing key, and its public half as SendGrid shows it (base64 of the DER)."""
    private = ec.generate_private_key(ec.SECP256R1())
    der = private.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, base64.b64encode(der).decode("ascii")


def sign_webhook(body: bytes, key: ec.EllipticCurvePrivateKey, timestamp: str) -> str:
    """The ``X-Twilio-Email-Event-Webhook-Signature`` of ``body`` sent at ``timestamp``."""
    signature = key.sign(timestamp.encode("utf-8") + body, ec.ECDSA(hashes.SHA256()))
    return base64.b64encode(signature).decode("ascii")


def webhook_request(events: list[dict[str, Any]], key: ec.EllipticCurvePrivateKey,
                    now: float) -> tuple[dict[str, str], bytes]:
    """The headers and body of SendGrid's POST of ``events``, signed with ``key`` at ``now``."""
    # A trailing CRLF, as SendGrid's POSTs are reported to end: the raw bytes are signed.
    body = json.dumps(events).encode("utf-8") + b"\r\n"
    timestamp = str(int(now))
    return ({"Content-Type": "application/json",
             "X-Twilio-Email-Event-Webhook-Signature": sign_webhook(body, key, timestamp),
             "X-Twilio-Email-Event-Webhook-Timestamp": timestamp}, body)


_WEBHOOK_AGENT = ("Mozilla/4.0 (compatible; MSIE 6.1; Windows XP; .NET CLR 1.1.4322; "
                  ".NET CLR 2.0.50727)")


def webhook_event(event: str, message_id: str, email: str, timestamp: int,
                  event_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """One event as the reference shows it; ``message_id`` is the send's ``X-Message-Id``.

    ``extra`` adds the event's own fields (``reason``, ``type``, ``url``...); without
    them each type gets the reference sample's.
    """
    sample: dict[str, dict[str, Any]] = {
        "processed": {"pool": {"name": "new_MY_test", "id": 210}},
        "dropped": {"reason": "Bounced Address", "status": "5.0.0"},
        "delivered": {"response": "250 OK"},
        "deferred": {"response": "400 try again later", "attempt": "5"},
        "bounce": {"reason": "500 unknown recipient", "status": "5.0.0", "type": "bounce"},
        "open": {"useragent": _WEBHOOK_AGENT, "ip": "255.255.255.255"},
        "click": {"useragent": _WEBHOOK_AGENT, "ip": "255.255.255.255",
                  "url": "http://www.sendgrid.com/"},
        "group_unsubscribe": {"useragent": _WEBHOOK_AGENT, "ip": "255.255.255.255",
                              "url": "http://www.sendgrid.com/", "asm_group_id": 10},
        "group_resubscribe": {"useragent": _WEBHOOK_AGENT, "ip": "255.255.255.255",
                              "url": "http://www.sendgrid.com/", "asm_group_id": 10},
    }
    return {"email": email, "timestamp": timestamp,
            "smtp-id": "<14c5d75ce93.dfd.64b469@ismtpd-555>", "event": event,
            "category": "cat facts", "sg_event_id": event_id or secrets.token_urlsafe(16),
            "sg_message_id": f"{message_id}.filter0001.16648.5515E0B88.0",
            **sample.get(event, {}), **extra}
