"""Resend's webhooks: one event per POST, signed by Svix.

What Resend sends (https://resend.com/docs/webhooks/introduction and
https://resend.com/docs/webhooks/event-types): a JSON object
``{"type": "email.delivered", "created_at": "<ISO 8601>", "data": {...}}``
where ``data`` carries the email's ``email_id`` (the ``id`` the send reply
gave, which the resend transport stores as ``provider_message_id``), ``to``
(a list of addresses), ``created_at`` (when the email was created) and, by
type, ``bounce`` (``type`` Permanent / Transient / Undetermined, ``subType``,
``message``, ``diagnosticCode``), ``click`` (``link``...), ``failed``
(``reason``) or ``suppressed`` (``message``, ``type``).

How it is verified (https://resend.com/docs/webhooks/verify-webhooks-requests
and Svix's https://docs.svix.com/receiving/verifying-payloads/how-manual):
the headers ``svix-id``, ``svix-timestamp`` (seconds since the epoch) and
``svix-signature``, a space-separated list of ``v1,<base64>`` entries. The
signed content is ``f"{svix_id}.{svix_timestamp}.{body}"``, HMAC-SHA256 keyed
with the base64 decoding of the secret after its ``whsec_`` prefix; one
matching ``v1`` entry is enough (several appear while a secret is rotated).
A missing header is refused with 401, a wrong signature and a timestamp
outside :data:`~._base.TOLERANCE_SECONDS` with 403.

The svix-id is the same on every retry of one event, so it is the event's
``provider_event_id`` (with ``":<recipient>"`` when the email had several
``to`` addresses): a retried event is a duplicate the store ignores. It is not
a nonce to refuse on reuse, since Svix retries legitimately with the same id.

==========================  ===================================================
Resend ``type``             event
==========================  ===================================================
``email.delivered``         ``delivered``
``email.delivery_delayed``  ``deferred``
``email.bounced``           ``bounced``: ``bounce.type`` Transient and
                            Undetermined -> ``transient``; Permanent, or
                            no type (older payloads) -> ``permanent``
``email.complained``        ``complained``
``email.opened``            ``opened``
``email.clicked``           ``clicked`` (the link in ``description``)
``email.failed``            ``rejected``: Resend did not send it
                            (``failed.reason`` in ``description``)
``email.suppressed``        ``rejected``: Resend's own suppression list
``email.sent``              ``unknown`` (no normalized type means "handed on")
``email.scheduled``         ``unknown``
anything else               ``unknown`` (``contact.*``, ``domain.*``,
                            ``email.received``...)
==========================  ===================================================

An ``unknown`` event has Resend's type in ``description``.

What Resend does not give: which recipient an event is about. An email to
several ``to`` addresses yields one event per address, each carrying the same
outcome (as Anymail notes, Resend sends an event per recipient without saying
whose it is), except a permanent bounce or a complaint, which would put every
one of them on the suppression list: that is one event without a recipient,
and suppresses nobody. Cc and Bcc recipients are not listed at all. No SMTP reply but a
bounce's ``diagnosticCode``, which becomes ``mta_response``. ``occurred_at``
is the top-level ``created_at`` (when the event happened; the
``svix-timestamp`` changes on every retry), or the svix-timestamp when
``created_at`` is missing or unreadable.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parseaddr
from typing import Any

from .._errors import ConfigError
from .._events import DeliveryEvent, capped_payload, naive_utc
from .._reasons import resend_reason, text_reason
from ._base import (
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    bounded_id,
    check_timestamp,
    iso_time,
    joined,
    json_body,
    json_object,
    outside_recipient,
)

__all__ = ["ResendReceiver"]

SECRET_PREFIX = "whsec_"

#: The longest ``to`` entry read as an address (a display name and an address);
#: longer ones are skipped, since the address parser is not linear.
MAX_ADDRESS_TEXT = 1000

#: Resend type -> normalized type; anything else is ``unknown``.
EVENT_TYPES = {
    "email.delivered": "delivered",
    "email.delivery_delayed": "deferred",
    "email.bounced": "bounced",
    "email.complained": "complained",
    "email.opened": "opened",
    "email.clicked": "clicked",
    "email.failed": "rejected",
    "email.suppressed": "rejected",
}

#: An ``email.failed`` reason that is the account's (a quota, an unverified domain, a key).
_ACCOUNT = re.compile(r"quota|domain|api.?key|verif|limit", re.IGNORECASE)


class ResendReceiver(Receiver):
    """Resend's Svix-signed webhook (see the module docstring).

    ``webhook_secret`` is the endpoint's signing secret as Resend shows it,
    ``whsec_`` followed by base64.
    """

    kind = "resend"

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, secret, options)
        self._key = _signing_key(secret, "webhook_secret")

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """``whsec_`` and base64, as Resend shows the endpoint's signing secret."""
        _signing_key(secret, key)

    def receive(self, request: WebhookRequest) -> Received:
        """Verify the Svix signature, then one event per ``to`` address."""
        svix_id = request.header("svix-id")
        timestamp = request.header("svix-timestamp")
        signatures = request.header("svix-signature")
        if not svix_id or not timestamp or not signatures:
            raise WebhookRefused(401, "the svix-id, svix-timestamp and svix-signature headers "
                                 "are required (a Svix-signed Resend webhook)")
        signed_at = check_timestamp(timestamp, request.now)
        self._verify(svix_id, timestamp, signatures, request.body)
        body = json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("type"), str) \
                or not isinstance(body.get("data"), dict):
            raise WebhookRefused(400, 'the body is not a Resend event: expected an object '
                                 'with a "type" string and a "data" object')
        return Received(events=tuple(self._events(body, svix_id, signed_at)))

    def _verify(self, svix_id: str, timestamp: str, signatures: str, body: bytes) -> None:
        signed = f"{svix_id}.{timestamp}.".encode() + body
        expected = base64.b64encode(hmac.new(self._key, signed, hashlib.sha256).digest())
        offered = [entry.partition(",")[2] for entry in signatures.split()
                   if entry.partition(",")[0] == "v1"]
        if not offered:
            raise WebhookRefused(403, "the svix-signature header has no v1 signature")
        # Every entry is compared, so the time taken does not say which one matched.
        matched = False
        for candidate in offered:
            matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "replace"))
        if not matched:
            raise WebhookRefused(403, "the Svix signature does not match (is webhook_secret "
                                 "this endpoint's signing secret?)")

    def _events(self, body: dict[str, Any], svix_id: str,
                signed_at: float) -> list[DeliveryEvent]:
        kind: str = body["type"]
        data: dict[str, Any] = body["data"]
        event_type = EVENT_TYPES.get(kind, "unknown")
        occurred_at = iso_time(body.get("created_at")) or naive_utc(
            datetime.fromtimestamp(signed_at, UTC))
        message_id = data.get("email_id") if isinstance(data.get("email_id"), str) else None
        bounce_kind = None
        description = kind if event_type == "unknown" else ""
        mta_response = ""
        reason = {"complained": "complaint", "deferred": "undefined"}.get(event_type)
        if kind == "email.bounced":
            bounce = json_object(data.get("bounce"))
            # Resend documents email.bounced as a permanent rejection; only a bounce that
            # says Transient or Undetermined is not (older payloads have no type at all).
            bounce_kind = ("transient" if bounce.get("type") in ("Transient", "Undetermined")
                           else "permanent")
            description = joined(": ", joined(" / ", bounce.get("type"), bounce.get("subType")),
                                  bounce.get("message"))
            mta_response = joined("; ", *_strings(bounce.get("diagnosticCode")))
            reason = resend_reason(bounce.get("type"), bounce.get("subType"),
                                   mta_response or joined("", bounce.get("message")))
        elif kind == "email.clicked":
            description = joined("", json_object(data.get("click")).get("link"))
        elif kind == "email.failed":
            description = joined("", json_object(data.get("failed")).get("reason"))
            # Resend's refusal to send: the account's limits or setup, else its words.
            reason = "account" if _ACCOUNT.search(description) else (
                text_reason(description) or "undefined")
        elif kind == "email.suppressed":
            suppressed = json_object(data.get("suppressed"))
            description = joined(": ", suppressed.get("type"), suppressed.get("message")) \
                or "Resend's suppression list"
            reason = "suppressed"
        recipients: list[str | None] = [*_recipients(data.get("to"))] or [None]
        if len(recipients) > 1 and (event_type == "complained" or bounce_kind == "permanent"):
            # Whose bounce is it? Resend does not say: one event without a recipient
            # rather than suppressing every address the email went to.
            description = joined("; ", description, f"Resend does not say which of the "
                                  f"{len(recipients)} recipients this concerns")
            recipients = [None]
        payload = capped_payload(body)
        return [DeliveryEvent(
            event_type=event_type, recipient=outside_recipient(recipient), occurred_at=occurred_at,
            transport=self.name,
            provider_event_id=bounded_id(svix_id if len(recipients) <= 1
                                         else f"{svix_id}:{recipient}"),
            bounce_kind=bounce_kind, description=description, mta_response=mta_response,
            reason=reason, provider_message_id=message_id, payload=payload)
            for recipient in recipients]


def _signing_key(secret: Any, key: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret, or a ``ConfigError`` that does not show it."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise ConfigError(key, f"expected the endpoint's signing secret as Resend shows it, "
                          f"{SECRET_PREFIX!r} followed by base64")
    try:
        decoded = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if not decoded:
        raise ConfigError(key, f"the signing secret after {SECRET_PREFIX!r} is not base64 "
                          "(copy it again from Resend's webhook page)")
    return decoded


def _recipients(value: Any) -> list[str]:
    """The addresses of ``data.to`` (a list, or one string), without display names."""
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    found: list[str] = []
    seen: set[str] = set()
    for item in values:
        if isinstance(item, str) and len(item) <= MAX_ADDRESS_TEXT:
            try:
                address = parseaddr(item)[1] or item.strip()
            except (RecursionError, ValueError, IndexError):  # the parser recurses on "(((("
                address = item.strip()
            if address and address not in seen:
                seen.add(address)
                found.append(address)
    return found


def _strings(value: Any) -> list[str]:
    """A string, or the strings of a list (Resend's diagnosticCode is either)."""
    if isinstance(value, str):
        return [value]
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []
