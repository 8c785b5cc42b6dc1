"""Mailgun's webhooks: one event per POST, signed with HMAC-SHA256 inside the body.

What Mailgun sends (webhooks, https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/;
event structure and types, .../user-manual/events/event-structure and
.../events/event-types): a JSON object ``{"signature": {...}, "event-data":
{...}}``. ``event-data`` is the event as the Events API shows it: ``event``,
``timestamp`` (Unix seconds, with a fraction), ``id`` ("unique within a
day"), ``recipient``, ``message.headers.message-id`` (the id the send
answered without its angle brackets, the row's ``provider_message_id``),
``severity`` and ``reason`` of a failure, ``delivery-status`` with the MTA's
``code``, ``message`` and ``description``. The legacy form-encoded webhooks
(retired in 2023) are not taken: their body is not JSON (400).

How it is verified ("Securing Webhooks",
https://documentation.mailgun.com/docs/mailgun/user-manual/webhooks/securing-webhooks):
``signature.signature`` is the hex HMAC-SHA256 of ``signature.timestamp``
followed by ``signature.token``, keyed with the domain's HTTP webhook
signing key, which is ``webhook_secret``. A subaccount's event also carries
``parent-signature``, the same HMAC with the primary account's key: either
one matching the configured key is accepted. A missing signature block or
field is a 401, a wrong signature a 403 (compared with
:func:`hmac.compare_digest`), a signed timestamp more than
:data:`~._base.TOLERANCE_SECONDS` from now a 403. The docs suggest caching
tokens "and not honor any subsequent request with the same token": the token
is returned as a nonce (:attr:`Received.nonces`), which the route stores
with the events and refuses when it comes again.

Mapping (Anymail's normalized types):

=========================================  ================================================
Mailgun ``event``                          event (bounce kind)
=========================================  ================================================
delivered                                  delivered
failed, ``reason`` ``suppress-*``          rejected (a previous bounce, unsubscribe or
                                           complaint: Mailgun did not try)
failed, ``reason`` ``old``                 bounced (transient): Mailgun gave up retrying;
                                           the address was never refused
failed, ``reason`` ``espblock``            bounced (transient): the mailbox provider
                                           blocked the sender, not the address
failed, ``severity`` permanent (others)    bounced (permanent)
failed, ``severity`` temporary             deferred (Mailgun retries)
rejected                                   rejected (``reject.reason`` described)
opened / clicked                           opened / clicked (the ``url`` as description)
unsubscribed                               unsubscribed
complained                                 complained
accepted, stored, list_member_uploaded,    unknown (the event name as description)
list_member_upload_error, list_uploaded,
anything else
=========================================  ================================================

``provider_event_id`` is ``event-data.id`` with the event's timestamp
(``"<id>:<timestamp>"``): the id alone is only unique within a day, the pair
is unique and a resend repeats it (an event without an id gets the SHA-256
of its JSON, sorted, which a resend repeats too). A ``rejected`` event may name no
``recipient``; it is then one event per address of the message's ``to``
header (the envelope is not in the event), each id suffixed with the address.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import getaddresses
from typing import Any, ClassVar

from .._errors import ConfigError
from .._events import DeliveryEvent, capped_payload
from .._reasons import mailgun_reason
from ._base import (
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    check_timestamp,
    json_body,
    outside_recipient,
)

#: Mailgun ``event`` -> event type (``failed`` is decided by its severity and reason).
EVENT_TYPES = {
    "delivered": "delivered",
    "rejected": "rejected",
    "opened": "opened",
    "clicked": "clicked",
    "unsubscribed": "unsubscribed",
    "complained": "complained",
}

#: Longest token kept as a nonce (the column's size); Mailgun's are 50 characters.
MAX_TOKEN = 255

#: A signed timestamp: Unix seconds, digits only. The HMAC covers timestamp and token
#: run together, so a timestamp read with ``float()`` would let a signature be reused
#: with the split moved: ``("1700000000e0", token[2:])`` for a token starting "e0".
SIGNED_TIMESTAMP = re.compile(r"[0-9]{1,12}")
#: A signature token: Mailgun's are 50 hexadecimal characters; letters, digits, - and _.
TOKEN = re.compile(rf"[A-Za-z0-9_-]{{16,{MAX_TOKEN}}}")
#: A signature: HMAC-SHA256 in lower-case hexadecimal, as Mailgun writes it.
SIGNATURE = re.compile(r"[0-9a-f]{64}")
#: The longest ``To`` header read for a rejected event's recipients.
MAX_TO_HEADER = 4000


class MailgunReceiver(Receiver):
    """Mailgun's signed webhooks (see the module docstring)."""

    kind: ClassVar[str] = "mailgun"

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, secret, options)
        self._key = str(secret).encode("utf-8")

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """The HTTP webhook signing key: printable ASCII without spaces."""
        super().check_secret(secret, key)
        if not secret.isascii() or not secret.isprintable() or any(c.isspace() for c in secret):
            raise ConfigError(key, "expected Mailgun's HTTP webhook signing key (Sending > "
                              "Webhooks), printable ASCII without spaces")

    def receive(self, request: WebhookRequest) -> Received:
        """Verify the signature block, then normalize ``event-data``; the token is a nonce."""
        body = json_body(request)
        if not isinstance(body, dict):
            raise WebhookRefused(400, "a Mailgun webhook posts one JSON object")
        token, timestamp = self._verify(body.get("signature"))
        check_timestamp(timestamp, request.now)
        data = body.get("event-data")
        if not isinstance(data, dict):
            raise WebhookRefused(400, "no event-data object: not a Mailgun webhook")
        return Received(events=self._events_of(data), nonces=(token,))

    def _verify(self, block: Any) -> tuple[str, str]:
        """(token, timestamp) of a signature block made with the signing key."""
        if block is None:
            raise WebhookRefused(401, "no signature block")
        if not isinstance(block, dict):
            raise WebhookRefused(400, "the signature block is not an object")
        token, timestamp = block.get("token"), block.get("timestamp")
        signatures = [block[field] for field in ("signature", "parent-signature")
                      if block.get(field) is not None]
        if token is None or timestamp is None or not signatures:
            raise WebhookRefused(401, "the signature block lacks its token, timestamp or "
                                 "signature")
        if isinstance(timestamp, int) and not isinstance(timestamp, bool):
            timestamp = str(timestamp)
        if not isinstance(token, str) or not isinstance(timestamp, str) \
                or not all(isinstance(signature, str) for signature in signatures):
            raise WebhookRefused(400, "the signature block's token, timestamp and signature "
                                 "must be strings")
        if SIGNED_TIMESTAMP.fullmatch(timestamp) is None:
            raise WebhookRefused(403, "the signed timestamp is not Unix seconds (digits only)")
        if TOKEN.fullmatch(token) is None:
            raise WebhookRefused(400, f"the signature token is not Mailgun's (16 to {MAX_TOKEN} "
                                 "letters, digits, - and _)")
        signatures = [signature for signature in signatures
                      if SIGNATURE.fullmatch(signature) is not None]
        expected = hmac.new(self._key, (timestamp + token).encode("utf-8"),
                            hashlib.sha256).hexdigest().encode("ascii")
        matches = [hmac.compare_digest(expected, signature.encode("ascii"))
                   for signature in signatures]
        if not any(matches):
            raise WebhookRefused(403, "the signature does not match the webhook signing key")
        return token, timestamp

    def _events_of(self, data: dict[str, Any]) -> tuple[DeliveryEvent, ...]:
        name = _text(data, "event")
        if name is None:
            raise WebhookRefused(400, "event-data has no event name")
        event_type, bounce_kind, description = _classify(name, data)
        timestamp = _timestamp(data)
        event_id = _event_id(data, timestamp)
        status = data.get("delivery-status")
        status = status if isinstance(status, dict) else {}
        mta_response = " ".join(str(part) for part in (status.get("code"), status.get("message"))
                                if part not in (None, ""))
        headers = _headers(data)
        message_id = _text(headers, "message-id")
        recipient = _text(data, "recipient")
        recipients: list[str | None] = [recipient]
        if recipient is None and name == "rejected":  # its recipients: the To header's
            recipients = [*_addresses(_text(headers, "to") or "")] or [None]
        per_address = recipients != [recipient]
        reason = None
        if event_type in ("bounced", "deferred", "rejected"):
            reason = mailgun_reason(_text(data, "reason"), _text(data, "severity"),
                                    mta_response or (_text(status, "description") or ""))
        elif event_type == "complained":
            reason = "complaint"
        return tuple(DeliveryEvent(
            event_type=event_type, bounce_kind=bounce_kind, recipient=outside_recipient(address),
            occurred_at=None if timestamp is None else _utc(timestamp), transport=self.name,
            provider_event_id=_bounded(f"{event_id}:{address}") if per_address else event_id,
            description=description, mta_response=mta_response, reason=reason,
            provider_message_id=message_id.strip().strip("<>") if message_id else None,
            payload=capped_payload(data)) for address in recipients)


def _classify(name: str, data: dict[str, Any]) -> tuple[str, str | None, str]:
    """(event type, bounce kind, description) of one event."""
    reason = _text(data, "reason")
    status = data.get("delivery-status")
    detail = _text(status, "description") if isinstance(status, dict) else None
    if name == "failed":
        described = ": ".join(filter(None, (reason, detail)))
        severity = _text(data, "severity")
        if reason is not None and reason.startswith("suppress-"):
            return "rejected", None, described
        if reason in ("old", "espblock"):
            return "bounced", "transient", described
        if severity == "permanent":
            return "bounced", "permanent", described
        if severity == "temporary":
            return "deferred", None, described
        return "unknown", None, ": ".join(filter(None, (f"failed ({severity})", reason,
                                                         detail)))
    if name == "rejected":
        reject = data.get("reject")
        why = _text(reject, "reason") if isinstance(reject, dict) else None
        return "rejected", None, why or detail or reason or ""
    if name == "clicked":
        return "clicked", None, _text(data, "url") or ""
    if name in EVENT_TYPES:
        return EVENT_TYPES[name], None, detail or ""
    return "unknown", None, ": ".join(filter(None, (name, reason)))


def _addresses(header: str) -> list[str]:
    """The addresses of a ``To`` header; none when it is too long or cannot be read.

    (The standard library's parser recurses on nested comments, and is not
    linear on long headers: the header is bounded first.)
    """
    if len(header) > MAX_TO_HEADER:
        return []
    try:
        return list(dict.fromkeys(address for _, address in getaddresses([header]) if address))
    except (RecursionError, ValueError, IndexError):
        return []


def _headers(data: dict[str, Any]) -> Mapping[str, Any]:
    message = data.get("message")
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers if isinstance(headers, dict) else {}


def _timestamp(data: dict[str, Any]) -> float | None:
    """event-data's ``timestamp`` (Unix seconds), None when absent; 400 when not a time."""
    value = data.get("timestamp")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WebhookRefused(400, "event-data's timestamp is not a number")
    try:
        _utc(value)
    except (OverflowError, OSError, ValueError):
        raise WebhookRefused(400, "event-data's timestamp is out of range") from None
    return float(value)


def _utc(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)


def _event_id(data: dict[str, Any], timestamp: float | None) -> str:
    """``"<id>:<timestamp>"``; the SHA-256 of the event's JSON when it has no id."""
    event_id = _text(data, "id")
    if event_id is None:
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
    return _bounded(event_id if timestamp is None else f"{event_id}:{timestamp:.6f}")


def _bounded(event_id: str) -> str:
    """``event_id``, or its SHA-256 when longer than the column (255)."""
    if len(event_id) <= 255:
        return event_id
    return hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()


def _text(mapping: Mapping[str, Any], key: str) -> str | None:
    """``mapping[key]``: a string, None when absent, null or empty; 400 when not a string."""
    value = mapping.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebhookRefused(400, f"{key} is a {type(value).__name__}, not a string")
    return value
