"""Postmark's outbound webhooks: one record per POST, guarded by HTTP Basic credentials.

What Postmark sends (https://postmarkapp.com/developer/webhooks/webhooks-overview
and the page of each webhook under .../developer/webhooks/): one JSON object
per request whose ``RecordType`` is ``Delivery``, ``Bounce``,
``SpamComplaint``, ``Open``, ``Click`` or ``SubscriptionChange``. Every record
names the message by ``MessageID`` (the ``MessageID`` the send answered, the
row's ``provider_message_id``) and the recipient by ``Recipient`` (``Email``
in a bounce or a complaint), with its time in ISO 8601 (``DeliveredAt``,
``BouncedAt``, ``ReceivedAt``, ``ChangedAt``).

How it is verified: Postmark signs nothing. Its documented protection is
HTTP Basic credentials in the webhook URL ("Basic HTTP authentication",
webhooks overview: ``https://<username>:<password>@example.com/webhook``),
which Postmark sends in ``Authorization``. ``webhook_secret`` is that
``"username:password"`` (as the server receives it: a character
percent-encoded in the URL is written plainly here). No ``Authorization``,
or one that is not Basic, is a 401; other credentials are a 403. The
credentials are compared as SHA-256 digests with :func:`hmac.compare_digest`,
so neither their content nor their length shows in the timing.

What Postmark does not give, and what is done instead:

* no signed timestamp. Postmark retries a failed POST for hours (the
  schedule it documents, for its inbound webhook, spans about ten: 1 min,
  5 min, 3 × 10 min, 15 min, 30 min, 1 h, 2 h, 6 h;
  https://postmarkapp.com/support/article/understanding-inbound-webhook-retries-in-postmark),
  each retry with the record as first sent, so a record's own time says
  nothing about replay and is NOT held to the five-minute window. Replay
  protection here is the credentials over TLS (use an https URL), and the
  event ids below: a record sent again is stored once.
* no event id, except a bounce's and a complaint's ``ID`` (the bounce's id
  in Postmark). Every other record's ``provider_event_id`` is the SHA-256 of
  its ``RecordType``, ``MessageID``, recipient and time field, which a
  resend repeats exactly.

Mapping (Anymail's normalized types; a bounce's ``Type``, or its
``TypeCode`` when the name is not one of these, decides;
https://postmarkapp.com/developer/api/bounce-api#bounce-types):

=====================================================  =====================================
Postmark                                               event (bounce kind)
=====================================================  =====================================
Delivery                                               delivered
Open / Click                                           opened / clicked (the link as description)
SpamComplaint; Bounce SpamComplaint (100001)           complained
Bounce HardBounce (1), BadEmailAddress (100000)        bounced (permanent)
Bounce Transient (2), DnsError (256),                  bounced (transient)
SoftBounce (4096), VirusNotification (8192),
SpamNotification (512), Blocked (100006),
DMARCPolicy (100009)
Bounce Unsubscribe (16)                                unsubscribed
Bounce ManuallyDeactivated (100002), Unconfirmed       rejected (Postmark did not send)
(100003), SMTPApiError (100007),
TemplateRenderingFailed (100010)
Bounce Subscribe (32), AutoResponder (64),             unknown (the type as description)
AddressChange (128), OpenRelayTest (1024),
Unknown (2048), ChallengeVerification (16384),
InboundError (100008), any other
SubscriptionChange, SuppressSending true               by ``SuppressionReason``: HardBounce
                                                       bounced (permanent), SpamComplaint
                                                       complained, ManualSuppression (and
                                                       any other) unsubscribed
SubscriptionChange, SuppressSending false              unknown ("reactivated")
any other RecordType                                   unknown (the RecordType as description)
=====================================================  =====================================

Where this differs from Anymail's table: Transient and DnsError are
transient bounces, not deferrals (Postmark reports them as bounces: the
message did not arrive, and nothing says Postmark still tries);
SpamNotification is a transient bounce, not a complaint (a filter's verdict,
not the person's: a complaint would suppress the address for all mail,
password resets included); Blocked and DMARCPolicy are transient bounces
(the receiving side refused the sender, not the address); the types that
are neither Anymail's nor ours (subscribed, autoresponded, inbound) are
``unknown``. With both webhooks on, a hard bounce comes twice, as a Bounce
and as a SubscriptionChange: two events, one suppression.

An inbound email posted here (``FromFull`` and no ``RecordType``, or
``RecordType`` ``Inbound``) is refused with 400: that is the inbound
webhook's URL pointed at this route.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

from .._errors import ConfigError
from .._events import DeliveryEvent, capped_payload, naive_utc
from .._reasons import postmark_reason
from ._base import (
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    json_body,
    outside_recipient,
)

#: Bounce ``Type`` -> (``TypeCode``, event type, bounce kind).
BOUNCE_TYPES: dict[str, tuple[int, str, str | None]] = {
    "HardBounce": (1, "bounced", "permanent"),
    "Transient": (2, "bounced", "transient"),
    "Unsubscribe": (16, "unsubscribed", None),
    "Subscribe": (32, "unknown", None),
    "AutoResponder": (64, "unknown", None),
    "AddressChange": (128, "unknown", None),
    "DnsError": (256, "bounced", "transient"),
    "SpamNotification": (512, "bounced", "transient"),
    "OpenRelayTest": (1024, "unknown", None),
    "Unknown": (2048, "unknown", None),
    "SoftBounce": (4096, "bounced", "transient"),
    "VirusNotification": (8192, "bounced", "transient"),
    "ChallengeVerification": (16384, "unknown", None),
    "BadEmailAddress": (100000, "bounced", "permanent"),
    "SpamComplaint": (100001, "complained", None),
    "ManuallyDeactivated": (100002, "rejected", None),
    "Unconfirmed": (100003, "rejected", None),
    "Blocked": (100006, "bounced", "transient"),
    "SMTPApiError": (100007, "rejected", None),
    "InboundError": (100008, "unknown", None),
    "DMARCPolicy": (100009, "bounced", "transient"),
    "TemplateRenderingFailed": (100010, "rejected", None),
}
_TYPE_NAMES = {code: name for name, (code, _, _) in BOUNCE_TYPES.items()}

#: A SubscriptionChange's ``SuppressionReason`` -> (event type, bounce kind).
SUPPRESSION_REASONS: dict[str, tuple[str, str | None]] = {
    "HardBounce": ("bounced", "permanent"),
    "SpamComplaint": ("complained", None),
    "ManualSuppression": ("unsubscribed", None),
}

#: RecordType -> the field holding the event's time.
TIME_FIELDS = {"Delivery": "DeliveredAt", "Bounce": "BouncedAt", "SpamComplaint": "BouncedAt",
               "Open": "ReceivedAt", "Click": "ReceivedAt", "SubscriptionChange": "ChangedAt"}

_SIMPLE = {"Delivery": "delivered", "Open": "opened", "Click": "clicked"}


class PostmarkReceiver(Receiver):
    """Postmark's webhooks, authenticated by Basic credentials (see the module docstring)."""

    kind: ClassVar[str] = "postmark"

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, secret, options)
        self._digest = hashlib.sha256(str(secret).encode("utf-8")).digest()

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """``"username:password"``, both parts non-empty, no control characters."""
        super().check_secret(secret, key)
        user, colon, password = secret.partition(":")
        if not colon or not user or not password:
            raise ConfigError(key, 'expected "username:password", the Basic credentials set '
                              "in Postmark's webhook URL (https://username:password@host/...)")
        if any(ord(char) < 0x20 or ord(char) == 0x7F for char in secret):
            raise ConfigError(key, "the credentials contain a control character")

    def receive(self, request: WebhookRequest) -> Received:
        """Check the credentials, then turn the one record into one event."""
        self._authenticate(request)
        record = json_body(request)
        if not isinstance(record, dict):
            raise WebhookRefused(400, "a Postmark webhook posts one JSON object")
        record_type = record.get("RecordType")
        if record_type == "Inbound" or (record_type is None and "FromFull" in record):
            raise WebhookRefused(400, "this is an inbound email, not an outbound event: "
                                 "Postmark's inbound webhook points at this URL")
        if not isinstance(record_type, str) or not record_type:
            raise WebhookRefused(400, "no RecordType: not a Postmark webhook record")
        return Received(events=(self._event_of(record_type, record),))

    def _authenticate(self, request: WebhookRequest) -> None:
        header = request.header("authorization")
        scheme, _, value = (header or "").strip().partition(" ")
        if scheme.lower() != "basic":
            raise WebhookRefused(401, "HTTP Basic credentials required (set them in "
                                 "Postmark's webhook URL)")
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookRefused(403, "the Basic credentials are not base64") from None
        if not hmac.compare_digest(hashlib.sha256(given).digest(), self._digest):
            raise WebhookRefused(403, "wrong credentials")

    def _event_of(self, record_type: str, record: dict[str, Any]) -> DeliveryEvent:
        event_type, bounce_kind, description = _classify(record_type, record)
        recipient = _text(record, "Email") or _text(record, "Recipient")
        time_field = TIME_FIELDS.get(record_type) or next(
            (field for field in ("DeliveredAt", "BouncedAt", "ReceivedAt", "ChangedAt")
             if field in record), None)
        time_text = _text(record, time_field) if time_field else None
        message_id = _text(record, "MessageID")
        bounce_id = record.get("ID") if record_type in ("Bounce", "SpamComplaint") else None
        if bounce_id is not None and (isinstance(bounce_id, bool)
                                      or not isinstance(bounce_id, (int, str))):
            raise WebhookRefused(400, f"the {record_type}'s ID is not a number")
        event_id = str(bounce_id) if bounce_id not in (None, "") else _derived_id(
            record_type, message_id, recipient, time_text)
        reason = None
        if event_type in ("bounced", "deferred", "rejected"):
            reason = postmark_reason(_bounce_type(record) or _text(record, "Type"),
                                     _text(record, "Details") or "") \
                if record_type == "Bounce" else "suppressed"
        elif event_type == "complained":
            reason = "complaint"
        return DeliveryEvent(
            event_type=event_type, bounce_kind=bounce_kind, recipient=outside_recipient(recipient),
            reason=reason,
            occurred_at=_time(time_field, time_text), transport=self.name,
            provider_event_id=event_id, description=description,
            mta_response=_text(record, "Details") or "",
            provider_message_id=message_id, payload=capped_payload(record))


def _classify(record_type: str, record: dict[str, Any]) -> tuple[str, str | None, str]:
    """(event type, bounce kind, description) of one record."""
    if record_type in _SIMPLE:
        link = _text(record, "OriginalLink") if record_type == "Click" else None
        return _SIMPLE[record_type], None, link or ""
    if record_type in ("Bounce", "SpamComplaint"):
        name = _bounce_type(record)
        detail = _text(record, "Description") or ""
        if record_type == "SpamComplaint":
            return "complained", None, ": ".join(filter(None, (name or record_type, detail)))
        if name is None:
            shown = _text(record, "Type") or f"TypeCode {record.get('TypeCode')}"
            return "unknown", None, ": ".join(filter(None, (f"Bounce {shown}", detail)))
        _, event_type, bounce_kind = BOUNCE_TYPES[name]
        return event_type, bounce_kind, ": ".join(filter(None, (name, detail)))
    if record_type == "SubscriptionChange":
        suppress = record.get("SuppressSending")
        if not isinstance(suppress, bool):
            raise WebhookRefused(400, "a SubscriptionChange without a true or false "
                                 "SuppressSending")
        reason = _text(record, "SuppressionReason")
        origin = _text(record, "Origin")
        if not suppress:
            return "unknown", None, ("SubscriptionChange: reactivated (Postmark sends to the "
                                     f"address again{', by ' + origin if origin else ''})")
        event_type, bounce_kind = SUPPRESSION_REASONS.get(reason or "", ("unsubscribed", None))
        where = f" by {origin}" if origin else ""
        return event_type, bounce_kind, f"SubscriptionChange: suppressed ({reason}){where}"
    return "unknown", None, f"Postmark {record_type}"


def _bounce_type(record: dict[str, Any]) -> str | None:
    """The bounce's type name when it is a known one (by ``Type``, else ``TypeCode``)."""
    name = _text(record, "Type")
    if name in BOUNCE_TYPES:
        return name
    code = record.get("TypeCode")
    return _TYPE_NAMES.get(code) if isinstance(code, int) and not isinstance(code, bool) \
        else None


def _derived_id(record_type: str, message_id: str | None, recipient: str | None,
                time_text: str | None) -> str:
    """A stable id for a record Postmark gives none: the same record gives the same id."""
    parts = (record_type, message_id or "", recipient or "", time_text or "")
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def _time(field: str | None, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        return naive_utc(datetime.fromisoformat(text))
    except (ValueError, OverflowError):  # not a time; a time past 9999 in UTC
        raise WebhookRefused(400, f"{field} is not an ISO 8601 time between the years 1 "
                             "and 9999") from None


def _text(record: Mapping[str, Any], key: str) -> str | None:
    """``record[key]``: a string, None when absent, null or empty; 400 when not a string."""
    value = record.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebhookRefused(400, f"{key} is a {type(value).__name__}, not a string")
    return value
