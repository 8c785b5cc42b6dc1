"""SendGrid's webhook receiver: the Signed Event Webhook, every event type, every refusal.

The events are the shapes of SendGrid's Event Webhook Reference (tests/provider_sendgrid.py),
signed with an ECDSA P-256 key the test makes; the receiver is called the way the route
calls it, with a fixed ``now``.
"""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from provider_sendgrid import sign_webhook, webhook_event, webhook_key, webhook_request

from flask_mail_outbox import ConfigError
from flask_mail_outbox._events import DeliveryEvent
from flask_mail_outbox._webhooks import WebhookRefused, WebhookRequest, receiver_class
from flask_mail_outbox._webhooks.sendgrid import SendGridReceiver

NOW = 1_700_000_000.0
SENT = 1_699_999_000  # when the events happened (Unix seconds)
MESSAGE_ID = "W86EgYT6SQKk0lRflfLRsA"
TO = "example@test.com"
KEY, PUBLIC = webhook_key()
OTHER_KEY, _ = webhook_key()


def _receiver() -> SendGridReceiver:
    return SendGridReceiver("sg", PUBLIC)


def _request(headers: dict[str, str], body: bytes, now: float = NOW) -> WebhookRequest:
    return WebhookRequest({name.lower(): value for name, value in headers.items()}, body, now)


def _receive(*events: dict[str, Any]) -> tuple[DeliveryEvent, ...]:
    received = _receiver().receive(_request(*webhook_request(list(events), KEY, NOW)))
    assert received.nonces == () and received.confirm_url is None
    assert [json.loads(event.payload or "") for event in received.events] == list(events)
    assert all(event.transport == "sg" for event in received.events)
    return received.events


def _one(name: str, event_id: str = "zmzJhfJgAfUSOW80yEbPyw==", **extra: Any) -> DeliveryEvent:
    (event,) = _receive(webhook_event(name, MESSAGE_ID, TO, SENT, event_id, **extra))
    assert event.provider_event_id == event_id
    assert event.provider_message_id == MESSAGE_ID
    assert event.recipient == TO
    assert event.occurred_at == datetime(2023, 11, 14, 21, 56, 40)
    return event


def test_the_kind_names_this_receiver() -> None:
    assert receiver_class("sendgrid") is SendGridReceiver


# -- events --------------------------------------------------------------------------------


def test_delivered() -> None:
    event = _one("delivered")
    assert (event.event_type, event.mta_response) == ("delivered", "250 OK")


def test_processed_has_no_normalized_type() -> None:
    event = _one("processed")
    assert (event.event_type, event.description) == ("unknown", "processed")


def test_dropped_is_rejected_with_the_reason() -> None:
    event = _one("dropped")
    assert (event.event_type, event.bounce_kind) == ("rejected", None)
    assert event.description == "dropped: Bounced Address"
    assert event.suppresses is None
    assert event.reason == "suppressed"  # SendGrid's own list left it out


@pytest.mark.parametrize(("name", "extra", "reason"), [
    ("dropped", {"reason": "Unsubscribed Address"}, "suppressed"),
    ("dropped", {"reason": "Invalid SMTPAPI header"}, "undefined"),  # no reason fits
    ("dropped", {"reason": "Spam Content (if spam checker app enabled)"}, "spam"),
    ("bounce", {"bounce_classification": "Reputation"}, "blocked"),
    ("bounce", {"bounce_classification": "Unclassified", "reason": "550 5.2.2 full"},
     "mailbox_full"),
    ("deferred", {"response": "421 4.7.0 Try again later: rate limit"}, "rate_limited"),
    ("spamreport", {}, "complaint"),
    ("delivered", {}, None),
])
def test_each_event_s_reason(name: str, extra: dict[str, Any], reason: str | None) -> None:
    assert _one(name, **extra).reason == reason


def test_deferred() -> None:
    event = _one("deferred")
    assert (event.event_type, event.description) == ("deferred", "attempt 5")
    assert event.mta_response == "400 try again later"


def test_bounce_is_permanent() -> None:
    event = _one("bounce")
    assert (event.event_type, event.bounce_kind) == ("bounced", "permanent")
    assert event.mta_response == "500 unknown recipient"
    assert event.description == "bounce"
    assert event.suppresses == "bounced"


def test_bounce_invalid_address_classification_is_permanent() -> None:
    event = _one("bounce", bounce_classification="Invalid Address",
                 reason="550 5.1.1 The email account that you tried to reach does not exist.")
    assert (event.event_type, event.bounce_kind) == ("bounced", "permanent")
    assert event.description == "bounce: Invalid Address"


def test_blocked_is_transient() -> None:
    event = _one("bounce", type="blocked", bounce_classification="Reputation")
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")
    assert event.description == "blocked: Reputation"
    assert event.suppresses is None


@pytest.mark.parametrize("classification", ["Content", "Reputation",
                                            "Frequency or Volume Too High", "Technical"])
def test_a_bounce_blaming_the_sender_is_transient(classification: str) -> None:
    event = _one("bounce", bounce_classification=classification)
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")


def test_open() -> None:
    assert _one("open").event_type == "opened"


def test_click_describes_the_url() -> None:
    event = _one("click")
    assert (event.event_type, event.description) == ("clicked", "http://www.sendgrid.com/")


def test_spamreport() -> None:
    event = _one("spamreport")
    assert (event.event_type, event.suppresses) == ("complained", "complained")


def test_unsubscribe() -> None:
    event = _one("unsubscribe")
    assert (event.event_type, event.suppresses) == ("unsubscribed", "unsubscribed")


def test_group_unsubscribe_names_the_group() -> None:
    event = _one("group_unsubscribe")
    assert (event.event_type, event.description) == ("unsubscribed",
                                                     "group_unsubscribe (group 10)")


def test_group_resubscribe_is_unknown() -> None:
    event = _one("group_resubscribe")
    assert (event.event_type, event.description) == ("unknown",
                                                     "group_resubscribe (group 10)")


def test_an_unknown_event_is_kept_and_named() -> None:
    event = _one("machine_opened")
    assert (event.event_type, event.description) == ("unknown", "machine_opened")


def test_the_reference_batch_in_order() -> None:
    names = ["processed", "deferred", "delivered", "open", "click", "bounce", "dropped",
             "spamreport", "unsubscribe", "group_unsubscribe", "group_resubscribe"]
    events = _receive(*(webhook_event(name, MESSAGE_ID, TO, SENT, f"id-{index}")
                        for index, name in enumerate(names)))
    assert [event.event_type for event in events] == [
        "unknown", "deferred", "delivered", "opened", "clicked", "bounced", "rejected",
        "complained", "unsubscribed", "unsubscribed", "unknown"]
    assert [event.provider_event_id for event in events] == [
        f"id-{index}" for index in range(len(names))]


def test_an_event_without_sg_event_id_gets_a_stable_digest() -> None:
    raw = webhook_event("delivered", MESSAGE_ID, TO, SENT)
    del raw["sg_event_id"]
    (first,) = _receive(raw)
    (again,) = _receive(dict(reversed(list(raw.items()))))
    assert first.provider_event_id == again.provider_event_id
    assert first.provider_event_id is not None and len(first.provider_event_id) == 64


def test_a_thousand_events_in_one_post() -> None:
    batch = [webhook_event("delivered", f"msg{index}", f"to{index}@example.com", SENT,
                           f"ev{index}") for index in range(1000)]
    headers, body = webhook_request(batch, KEY, NOW)
    started = time.perf_counter()
    received = _receiver().receive(_request(headers, body))
    elapsed = time.perf_counter() - started
    assert len(received.events) == 1000
    assert received.events[999].provider_message_id == "msg999"
    assert received.events[999].recipient == "to999@example.com"
    assert elapsed < 1.0, f"{elapsed:.3f} s for 1000 events"


def test_an_empty_batch() -> None:
    assert _receiver().receive(_request(*webhook_request([], KEY, NOW))).events == ()


def test_the_key_as_pem() -> None:
    pem = serialization.load_der_public_key(base64.b64decode(PUBLIC)).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    SendGridReceiver.check_secret(pem, "key")
    received = SendGridReceiver("sg", pem).receive(
        _request(*webhook_request([webhook_event("open", MESSAGE_ID, TO, SENT)], KEY, NOW)))
    assert received.events[0].event_type == "opened"


def test_the_edges_of_the_window_are_accepted() -> None:
    for skew in (-300, 300):
        headers, body = webhook_request([], KEY, NOW + skew)
        assert _receiver().receive(_request(headers, body)).events == ()


# -- refusals ------------------------------------------------------------------------------

_GOOD_HEADERS, _GOOD_BODY = webhook_request(
    [webhook_event("delivered", MESSAGE_ID, TO, SENT)], KEY, NOW)
_SIGNATURE = _GOOD_HEADERS["X-Twilio-Email-Event-Webhook-Signature"]
_STAMP = _GOOD_HEADERS["X-Twilio-Email-Event-Webhook-Timestamp"]


def _signed(body: bytes, timestamp: float = NOW,
            key: ec.EllipticCurvePrivateKey = KEY) -> dict[str, str]:
    stamp = str(int(timestamp))
    return {"x-twilio-email-event-webhook-signature": sign_webhook(body, key, stamp),
            "x-twilio-email-event-webhook-timestamp": stamp}


def _signed_json(value: Any) -> tuple[dict[str, str], bytes]:
    body = json.dumps(value).encode()
    return _signed(body), body


def _with(**changes: Any) -> tuple[dict[str, str], bytes]:
    return _signed_json([{**webhook_event("delivered", MESSAGE_ID, TO, SENT), **changes}])


#: (what, headers, body, status): every bad request tried.
REFUSALS: list[tuple[str, dict[str, str], bytes, int]] = [
    ("no signature headers", {}, _GOOD_BODY, 401),
    ("no signature", {"x-twilio-email-event-webhook-timestamp": _STAMP}, _GOOD_BODY, 401),
    ("no timestamp", {"x-twilio-email-event-webhook-signature": _SIGNATURE}, _GOOD_BODY, 401),
    ("an empty signature", {"x-twilio-email-event-webhook-signature": "",
                            "x-twilio-email-event-webhook-timestamp": _STAMP}, _GOOD_BODY, 401),
    ("signed by another key", _signed(_GOOD_BODY, key=OTHER_KEY), _GOOD_BODY, 403),
    ("a body changed after signing", {k.lower(): v for k, v in _GOOD_HEADERS.items()},
     _GOOD_BODY.replace(b"250 OK", b"250 ok"), 403),
    ("a timestamp changed after signing",
     {"x-twilio-email-event-webhook-signature": _SIGNATURE,
      "x-twilio-email-event-webhook-timestamp": str(int(NOW) + 1)}, _GOOD_BODY, 403),
    ("a signature not base64", {"x-twilio-email-event-webhook-signature": "not base64!",
                                "x-twilio-email-event-webhook-timestamp": _STAMP},
     _GOOD_BODY, 403),
    ("a signature not DER", {"x-twilio-email-event-webhook-signature":
                             base64.b64encode(b"\x00" * 64).decode(),
                             "x-twilio-email-event-webhook-timestamp": _STAMP},
     _GOOD_BODY, 403),
    ("an old timestamp", _signed(_GOOD_BODY, NOW - 301), _GOOD_BODY, 403),
    ("a timestamp from the future", _signed(_GOOD_BODY, NOW + 301), _GOOD_BODY, 403),
    ("a timestamp that is not a number",
     {"x-twilio-email-event-webhook-signature": sign_webhook(_GOOD_BODY, KEY, "yesterday"),
      "x-twilio-email-event-webhook-timestamp": "yesterday"}, _GOOD_BODY, 403),
    ("bad JSON", _signed(b"[{not json"), b"[{not json", 400),
    ("a body not UTF-8", _signed(b"\xff\xfe[]"), b"\xff\xfe[]", 400),
    ("a JSON object, not an array", *_signed_json({"event": "delivered"}), 400),
    ("an event that is not an object", *_signed_json(["delivered"]), 400),
    ("an event without a name", *_signed_json([{"email": TO, "timestamp": SENT}]), 400),
    ("an event name that is a number", *_with(event=7), 400),
    ("an email that is a list", *_with(email=[TO]), 400),
    ("a timestamp that is a string", *_with(timestamp="1699999000"), 400),
    ("a timestamp out of range", *_with(timestamp=10**20), 400),
    ("an sg_message_id that is a number", *_with(sg_message_id=12), 400),
]


@pytest.mark.parametrize(("what", "headers", "body", "status"), REFUSALS,
                         ids=[case[0] for case in REFUSALS])
def test_refused(what: str, headers: dict[str, str], body: bytes, status: int) -> None:
    with pytest.raises(WebhookRefused) as refused:
        _receiver().receive(WebhookRequest(headers, body, NOW))
    assert refused.value.status == status, what
    signature = headers.get("x-twilio-email-event-webhook-signature")
    assert not signature or signature not in refused.value.reason
    assert PUBLIC not in refused.value.reason


def _pem(key: Any) -> str:
    return str(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode())


def _der64(key: Any) -> str:
    return base64.b64encode(key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)).decode()


_RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
_P384 = ec.generate_private_key(ec.SECP384R1())

#: (what, webhook_secret): every secret check_secret refuses.
BAD_SECRETS: list[tuple[str, Any]] = [
    ("None", None), ("a number", 42), ("empty", ""), ("blank", " \n "),
    ("not base64", "this is not a key!"), ("base64 of no key", "aGVsbG8gd29ybGQ="),
    ("a private key PEM", KEY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()),
    ("a truncated key", PUBLIC[:40]),
    ("an RSA key", _der64(_RSA)), ("an RSA key as PEM", _pem(_RSA)),
    ("a P-384 key", _der64(_P384)),
]


@pytest.mark.parametrize(("what", "secret"), BAD_SECRETS, ids=[c[0] for c in BAD_SECRETS])
def test_check_secret_refuses(what: str, secret: Any) -> None:
    with pytest.raises(ConfigError) as error:
        SendGridReceiver.check_secret(secret, 'OUTBOX_TRANSPORTS["sg"]["webhook_secret"]')
    assert error.value.key == 'OUTBOX_TRANSPORTS["sg"]["webhook_secret"]'
    if isinstance(secret, str) and secret.strip():
        assert secret.strip() not in str(error.value)


def test_a_receiver_with_a_bad_key_cannot_be_made() -> None:
    with pytest.raises(ConfigError):
        SendGridReceiver("sg", "not a key")


def test_check_secret_takes_the_key_sendgrid_shows() -> None:
    SendGridReceiver.check_secret(PUBLIC, "key")
    SendGridReceiver.check_secret(f"  {PUBLIC[:30]}\n{PUBLIC[30:]}\n", "key")


def test_refusal_count() -> None:
    """The count the report gives: bad requests plus bad secrets."""
    assert len(REFUSALS) + len(BAD_SECRETS) == 33
