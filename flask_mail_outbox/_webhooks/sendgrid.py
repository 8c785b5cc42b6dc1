"""SendGrid's Event Webhook: batches of events, signed with ECDSA P-256.

What SendGrid sends (Event Webhook Reference,
https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/event): a
JSON array of event objects, often many per POST (a batch may hold a
thousand and more). Each has ``event``, ``email`` (the recipient),
``timestamp`` (Unix seconds), ``sg_event_id`` (unique, the same when SendGrid
posts the event again) and ``sg_message_id``: the ``X-Message-Id`` the send
answered (the row's ``provider_message_id``) followed by ``.`` and SendGrid's
routing (``"W86EgYT6SQKk0lRflfLRsA.filter0464p1las1-4823-5EB1A35D-4.0"``), so
the part before the first ``.`` is what is matched.

How it is verified (Signed Event Webhook, "Getting Started with the Event
Webhook Security Features",
https://www.twilio.com/docs/sendgrid/for-developers/tracking-events/getting-started-event-webhook-security-features):
``X-Twilio-Email-Event-Webhook-Signature`` is a base64 ECDSA signature (DER)
with SHA-256 over the bytes of ``X-Twilio-Email-Event-Webhook-Timestamp``
followed by the raw body, made with a P-256 key whose public half SendGrid
shows as the "verification key" (base64 of the DER SubjectPublicKeyInfo).
``webhook_secret`` is that key (a PEM ``PUBLIC KEY`` is taken too). A missing
header is a 401; a signature that does not verify is a 403, and so is a
signed timestamp more than :data:`~._base.TOLERANCE_SECONDS` from now. Only
then is the body parsed. Assumed where the docs are silent: a retry is signed
again when it is sent (if SendGrid resent an old signature, that retry would
be refused as a replay, and SendGrid retries for 24 hours).

Mapping (Anymail's normalized types):

==================================  ========================================================
SendGrid ``event``                  event (bounce kind)
==================================  ========================================================
delivered                           delivered (``response`` as the MTA response)
deferred                            deferred (``response``, ``attempt``)
bounce, ``type`` "bounce"           bounced (permanent), unless ``bounce_classification``
                                    names the sender's side (Content, Reputation, Frequency
                                    or Volume Too High, Technical): transient
bounce, ``type`` "blocked"          bounced (transient): "temporarily" refused
dropped                             rejected (SendGrid did not send; ``reason`` described)
open / click                        opened / clicked (the ``url`` as description)
spamreport                          complained
unsubscribe, group_unsubscribe      unsubscribed (the group id in the description)
processed                           unknown ("processed": queued at SendGrid; no such type)
group_resubscribe                   unknown ("group_resubscribe": no such type)
anything else                       unknown (the event name as description)
==================================  ========================================================

An event without ``sg_event_id`` (none is documented so) gets the SHA-256 of
its JSON with sorted keys, which a resend repeats.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .._errors import ConfigError
from .._events import DeliveryEvent, capped_payload
from .._reasons import sendgrid_reason, smtp_reason
from ._base import (
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    check_timestamp,
    json_body,
    outside_recipient,
)

SIGNATURE_HEADER = "x-twilio-email-event-webhook-signature"
TIMESTAMP_HEADER = "x-twilio-email-event-webhook-timestamp"

#: SendGrid ``event`` -> event type (``bounce`` is decided by its ``type``).
EVENT_TYPES = {
    "delivered": "delivered",
    "deferred": "deferred",
    "dropped": "rejected",
    "open": "opened",
    "click": "clicked",
    "spamreport": "complained",
    "unsubscribe": "unsubscribed",
    "group_unsubscribe": "unsubscribed",
}

#: ``bounce_classification`` values that blame the sender, not the address.
SENDER_SIDE = frozenset({"content", "reputation", "frequency or volume too high", "technical"})


class SendGridReceiver(Receiver):
    """SendGrid's Signed Event Webhook (see the module docstring)."""

    kind: ClassVar[str] = "sendgrid"

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, secret, options)
        key = f'OUTBOX_TRANSPORTS[{name!r}]["webhook_secret"]'
        self._key = verification_key(secret, key)

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """The verification key SendGrid shows: an ECDSA P-256 public key."""
        super().check_secret(secret, key)
        verification_key(secret, key)

    def receive(self, request: WebhookRequest) -> Received:
        """Verify the signature and its timestamp, then normalize every event of the batch."""
        signature = request.header(SIGNATURE_HEADER)
        timestamp = request.header(TIMESTAMP_HEADER)
        if not signature or not timestamp:
            raise WebhookRefused(401, "no X-Twilio-Email-Event-Webhook-Signature and "
                                 "-Timestamp: is the Signed Event Webhook on?")
        try:
            self._key.verify(base64.b64decode(signature, validate=True),
                             timestamp.encode("utf-8") + request.body, ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, binascii.Error, ValueError):
            raise WebhookRefused(403, "the signature does not verify with the configured "
                                 "verification key") from None
        check_timestamp(timestamp, request.now)
        batch = json_body(request)
        if not isinstance(batch, list):
            raise WebhookRefused(400, "the Event Webhook posts a JSON array of events")
        return Received(events=tuple(self._event_of(index, event)
                                     for index, event in enumerate(batch)))

    def _event_of(self, index: int, event: Any) -> DeliveryEvent:
        if not isinstance(event, dict):
            raise WebhookRefused(400, f"event {index} is not an object")
        name = _text(event, "event", index)
        if name is None:
            raise WebhookRefused(400, f"event {index} has no 'event' name")
        event_type, bounce_kind, description = _classify(name, event, index)
        # The MTA's reply: "response" of a delivery or deferral, "reason" of a bounce.
        response = _text(event, "response", index) or (
            _text(event, "reason", index) if name == "bounce" else None)
        message_id = _text(event, "sg_message_id", index)
        reason = None
        if event_type == "bounced":
            reason = sendgrid_reason(_text(event, "bounce_classification", index), response or "")
        elif event_type == "deferred":
            reason = smtp_reason(response or "")
        elif event_type == "rejected":  # dropped: SendGrid's suppression or its own refusal
            dropped = _text(event, "reason", index) or ""
            reason = "suppressed" if "suppress" in dropped.lower() or "unsubscribed" in \
                dropped.lower() or "bounced address" in dropped.lower() else smtp_reason(dropped)
        elif event_type == "complained":
            reason = "complaint"
        return DeliveryEvent(
            event_type=event_type, bounce_kind=bounce_kind,
            recipient=outside_recipient(_text(event, "email", index)), occurred_at=_time(event, index),
            transport=self.name, provider_event_id=_event_id(event, index),
            description=description, mta_response=response or "", reason=reason,
            provider_message_id=message_id.partition(".")[0] if message_id else None,
            payload=capped_payload(event))


def verification_key(secret: Any, key: str) -> ec.EllipticCurvePublicKey:
    """The P-256 public key in ``secret`` (base64 DER, or PEM); ``ConfigError`` naming ``key``."""
    text = str(secret).strip()
    try:
        if text.startswith("-----BEGIN"):
            loaded = serialization.load_pem_public_key(text.encode("ascii"))
        else:
            loaded = serialization.load_der_public_key(
                base64.b64decode("".join(text.split()), validate=True))
    except (ValueError, TypeError, binascii.Error, UnsupportedAlgorithm):
        raise ConfigError(key, "expected the Event Webhook's verification key as SendGrid "
                          "shows it (base64 of a DER public key) or as a PEM PUBLIC KEY; "
                          "this one cannot be read") from None
    if not isinstance(loaded, ec.EllipticCurvePublicKey) \
            or not isinstance(loaded.curve, ec.SECP256R1):
        raise ConfigError(key, "expected an ECDSA P-256 public key (SendGrid's verification "
                          "key), got another kind of key")
    return loaded


def _classify(name: str, event: dict[str, Any], index: int) -> tuple[str, str | None, str]:
    """(event type, bounce kind, description) of one event."""
    if name == "bounce":
        kind = _text(event, "type", index) or "bounce"
        classification = _text(event, "bounce_classification", index)
        transient = kind == "blocked" or (classification or "").lower() in SENDER_SIDE
        return ("bounced", "transient" if transient else "permanent",
                ": ".join(filter(None, (kind, classification))))
    if name == "dropped":
        return "rejected", None, ": ".join(filter(None, (
            "dropped", _text(event, "reason", index) or _text(event, "type", index))))
    if name in ("click", "open"):
        return EVENT_TYPES[name], None, _text(event, "url", index) or ""
    if name in ("group_unsubscribe", "group_resubscribe"):
        group = event.get("asm_group_id")
        described = f"{name} (group {group})" if group is not None else name
        return EVENT_TYPES.get(name, "unknown"), None, described
    if name == "deferred":
        attempt = event.get("attempt")
        return "deferred", None, f"attempt {attempt}" if attempt is not None else ""
    if name in EVENT_TYPES:
        return EVENT_TYPES[name], None, ""
    return "unknown", None, name


def _event_id(event: dict[str, Any], index: int) -> str:
    """``sg_event_id``, or a digest of the event when it has none."""
    event_id = _text(event, "sg_event_id", index)
    if event_id is not None and len(event_id) <= 255:
        return event_id
    if event_id is not None:
        return hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()
    canonical = json.dumps(event, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _time(event: dict[str, Any], index: int) -> datetime | None:
    value = event.get("timestamp")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WebhookRefused(400, f"event {index}'s timestamp is not a number")
    try:
        return datetime.fromtimestamp(value, UTC).replace(tzinfo=None)
    except (OverflowError, OSError, ValueError):
        raise WebhookRefused(400, f"event {index}'s timestamp is out of range") from None


def _text(event: Mapping[str, Any], key: str, index: int) -> str | None:
    """``event[key]``: a string, None when absent, null or empty; 400 when not a string."""
    value = event.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebhookRefused(400, f"event {index}'s {key!r} is a {type(value).__name__}, "
                             "not a string")
    return value
