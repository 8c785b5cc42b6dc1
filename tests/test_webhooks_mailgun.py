"""Mailgun's webhook receiver: HMAC-signed events, every event type, every refusal.

The events are the shapes of Mailgun's webhook docs (tests/provider_mailgun.py), signed
with a random webhook signing key; the receiver is called the way the route calls it,
with a fixed ``now``. A token seen twice is the route's to refuse: the receiver returns it
as a nonce.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
from provider_mailgun import (
    WEBHOOK_SIGNING_KEY,
    webhook_event,
    webhook_payload,
    webhook_request,
    webhook_signature,
)

from flask_mail_outbox import ConfigError
from flask_mail_outbox._events import DeliveryEvent
from flask_mail_outbox._webhooks import (
    Received,
    WebhookRefused,
    WebhookRequest,
    receiver_class,
)
from flask_mail_outbox._webhooks.mailgun import MailgunReceiver

NOW = 1_700_000_000.0
WHEN = 1_699_999_000.153125  # when the event happened
OCCURRED = datetime(2023, 11, 14, 21, 56, 40, 153125)
SENT_ID = "<20231114215000.1.DF5966851B4BAA99@mg.example.com>"  # as the send answered
MESSAGE_ID = "20231114215000.1.DF5966851B4BAA99@mg.example.com"  # the row's
TO = "alice@example.com"
TOKEN = "a8ce0edb2dd8301dee6c2405235584e45aa91d1e9f979f3de0"


def _receiver() -> MailgunReceiver:
    return MailgunReceiver("mg", WEBHOOK_SIGNING_KEY)


def _request(headers: dict[str, str], body: bytes) -> WebhookRequest:
    return WebhookRequest({name.lower(): value for name, value in headers.items()}, body, NOW)


def _receive(data: dict[str, Any], token: str = TOKEN) -> Received:
    received = _receiver().receive(_request(*webhook_request(data, WEBHOOK_SIGNING_KEY, NOW,
                                                             token)))
    assert received.nonces == (token,) and received.confirm_url is None
    assert all(json.loads(event.payload or "") == data for event in received.events)
    assert all(event.transport == "mg" for event in received.events)
    return received


def _one(name: str, **extra: Any) -> DeliveryEvent:
    (event,) = _receive(webhook_event(name, SENT_ID, TO, WHEN, "DACSsAdVSeGpLid7TN03WA",
                                      **extra)).events
    assert event.provider_event_id == "DACSsAdVSeGpLid7TN03WA:1699999000.153125"
    assert (event.recipient, event.occurred_at) == (TO, OCCURRED)
    assert event.provider_message_id == MESSAGE_ID
    return event


def test_the_kind_names_this_receiver() -> None:
    assert receiver_class("mailgun") is MailgunReceiver


# -- events --------------------------------------------------------------------------------


def test_delivered() -> None:
    event = _one("delivered")
    assert (event.event_type, event.mta_response) == ("delivered", "250 OK")


def test_failed_permanent_is_a_permanent_bounce() -> None:
    event = _one("failed")
    assert (event.event_type, event.bounce_kind) == ("bounced", "permanent")
    assert event.mta_response == ("550 5.1.1 The email account that you tried to reach does "
                                  "not exist.")
    assert event.description == "bounce"
    assert event.suppresses == "bounced"


def test_failed_temporary_is_deferred() -> None:
    event = _one("failed", severity="temporary", reason="generic", **{"delivery-status": {
        "attempt-no": 1, "code": 452, "description": "",
        "message": "4.2.2 The email account that you tried to reach is over quota.",
        "session-seconds": 1.0, "retry-seconds": 600}})
    assert (event.event_type, event.bounce_kind) == ("deferred", None)
    assert event.mta_response.startswith("452 4.2.2 ")
    assert event.description == "generic"


@pytest.mark.parametrize("reason", ["suppress-bounce", "suppress-unsubscribe",
                                    "suppress-complaint"])
def test_failed_on_mailguns_suppression_list_is_rejected(reason: str) -> None:
    event = _one("failed", reason=reason, **{"delivery-status": {
        "attempt-no": 1, "message": "", "code": 605,
        "description": "Not delivering to previously bounced address", "session-seconds": 0.0}})
    assert (event.event_type, event.bounce_kind) == ("rejected", None)
    assert event.description == f"{reason}: Not delivering to previously bounced address"
    assert event.mta_response == "605"
    assert event.suppresses is None


@pytest.mark.parametrize("severity", ["permanent", "temporary"])
def test_failed_old_is_a_transient_bounce(severity: str) -> None:
    event = _one("failed", severity=severity, reason="old")
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")


def test_failed_espblock_is_a_transient_bounce() -> None:
    event = _one("failed", reason="espblock")
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")


def test_failed_without_a_severity_is_unknown() -> None:
    raw = webhook_event("failed", SENT_ID, TO, WHEN, "x")
    del raw["severity"]
    (event,) = _receive(raw).events
    assert event.event_type == "unknown"
    assert event.description.startswith("failed (None): bounce")


def test_rejected_names_its_reason() -> None:
    event = _one("rejected", reject={
        "reason": "Sandbox subdomains are for test purposes only.", "description": ""})
    assert (event.event_type, event.description) == (
        "rejected", "Sandbox subdomains are for test purposes only.")


def test_rejected_without_recipient_is_one_event_per_to_address() -> None:
    raw = webhook_event("rejected", SENT_ID, TO, WHEN, "RJ", reject={"reason": "why"})
    del raw["recipient"]
    raw["message"]["headers"]["to"] = "Alice <alice@example.com>, bob@example.org"
    events = _receive(raw).events
    assert [(e.recipient, e.provider_event_id) for e in events] == [
        ("alice@example.com", "RJ:1699999000.153125:alice@example.com"),
        ("bob@example.org", "RJ:1699999000.153125:bob@example.org")]
    assert {e.event_type for e in events} == {"rejected"}


def test_opened() -> None:
    assert _one("opened").event_type == "opened"


def test_clicked_describes_the_url() -> None:
    event = _one("clicked")
    assert (event.event_type, event.description) == ("clicked", "https://example.com/offer")


def test_unsubscribed() -> None:
    event = _one("unsubscribed")
    assert (event.event_type, event.suppresses) == ("unsubscribed", "unsubscribed")


def test_complained() -> None:
    event = _one("complained")
    assert (event.event_type, event.suppresses) == ("complained", "complained")


@pytest.mark.parametrize("name", ["accepted", "stored", "list_member_uploaded",
                                  "list_member_upload_error", "list_uploaded", "new_thing"])
def test_other_events_are_unknown_and_named(name: str) -> None:
    event = _one(name)
    assert (event.event_type, event.description) == ("unknown", name)


def test_delivery_status_null() -> None:
    event = _one("accepted", **{"delivery-status": None})
    assert (event.event_type, event.mta_response) == ("unknown", "")


def test_an_event_without_an_id_gets_a_stable_digest() -> None:
    raw = webhook_event("delivered", SENT_ID, TO, WHEN)
    del raw["id"]
    (first,) = _receive(raw).events
    (again,) = _receive(dict(reversed(list(raw.items()))), token="t" * 50).events
    assert first.provider_event_id == again.provider_event_id
    assert first.provider_event_id is not None and len(first.provider_event_id) == 64


def test_the_same_id_on_another_day_is_another_event() -> None:
    # Mailgun's ids are "unique within a day": the event's time is part of ours.
    first = _receive(webhook_event("opened", SENT_ID, TO, WHEN, "same")).events[0]
    later = _receive(webhook_event("opened", SENT_ID, TO, WHEN + 86400 * 3, "same"),
                     token="u" * 50).events[0]
    assert first.provider_event_id != later.provider_event_id


def test_the_token_is_the_nonce() -> None:
    received = _receive(webhook_event("delivered", SENT_ID, TO, WHEN), token="tok-" * 12)
    assert received.nonces == ("tok-" * 12,)


def test_a_subaccounts_parent_signature_is_accepted() -> None:
    payload = webhook_payload(webhook_event("delivered", SENT_ID, TO, WHEN), "subaccount-key",
                              NOW, TOKEN)
    signature = payload["signature"]
    signature["parent-signature"] = webhook_signature(signature["timestamp"], TOKEN,
                                                      WEBHOOK_SIGNING_KEY)
    received = _receiver().receive(_request({}, json.dumps(payload).encode()))
    assert received.events[0].event_type == "delivered"


def test_an_integer_timestamp_is_signed_as_its_digits() -> None:
    payload = webhook_payload(webhook_event("delivered", SENT_ID, TO, WHEN),
                              WEBHOOK_SIGNING_KEY, NOW, TOKEN)
    payload["signature"]["timestamp"] = int(payload["signature"]["timestamp"])
    assert _receiver().receive(_request({}, json.dumps(payload).encode())).events


def test_the_edges_of_the_window_are_accepted() -> None:
    for skew in (-300, 300):
        body = json.dumps(webhook_payload(webhook_event("opened", SENT_ID, TO, WHEN),
                                          WEBHOOK_SIGNING_KEY, NOW + skew)).encode()
        assert _receiver().receive(_request({}, body)).events


# -- refusals ------------------------------------------------------------------------------

_DATA = webhook_event("delivered", SENT_ID, TO, WHEN)
_GOOD = webhook_payload(_DATA, WEBHOOK_SIGNING_KEY, NOW, TOKEN)


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _signature(**changes: Any) -> bytes:
    block = {**_GOOD["signature"], **changes}
    return _json({**_GOOD, "signature": {k: v for k, v in block.items() if v is not None}})


def _data(**changes: Any) -> bytes:
    return _json(webhook_payload({**_DATA, **changes}, WEBHOOK_SIGNING_KEY, NOW, TOKEN))


#: (what, body, status): every bad request tried.
REFUSALS: list[tuple[str, bytes, int]] = [
    ("no signature block", _json({"event-data": _DATA}), 401),
    ("no token", _signature(token=None), 401),
    ("no timestamp", _signature(timestamp=None), 401),
    ("no signature", _signature(signature=None), 401),
    ("signed with another key",
     _json(webhook_payload(_DATA, "another-signing-key", NOW, TOKEN)), 403),
    ("a wrong signature", _signature(signature="0" * 64), 403),
    ("a signature in upper case", _signature(signature=_GOOD["signature"]["signature"].upper()),
     403),
    ("a non-ASCII signature", _signature(signature="é" * 64), 403),
    ("another token under the signature", _signature(token="b" * 50), 403),
    ("a timestamp changed after signing", _signature(timestamp=str(int(NOW) - 1)), 403),
    ("a wrong parent-signature alone",
     _signature(signature=None, **{"parent-signature": "1" * 64}), 403),
    ("an old timestamp", _json(webhook_payload(_DATA, WEBHOOK_SIGNING_KEY, NOW - 301)), 403),
    ("a timestamp from the future",
     _json(webhook_payload(_DATA, WEBHOOK_SIGNING_KEY, NOW + 301)), 403),
    ("a signed timestamp that is not a number",
     _signature(timestamp="soon", signature=webhook_signature("soon", TOKEN,
                                                              WEBHOOK_SIGNING_KEY)), 403),
    ("bad JSON", b'{"signature": ', 400),
    ("a body not UTF-8", b"\xff\xfe{}", 400),
    ("a form-encoded (legacy) body", b"token=abc&timestamp=1&signature=def", 400),
    ("a JSON array", _json([_GOOD]), 400),
    ("a signature block that is a string", _json({**_GOOD, "signature": "abc"}), 400),
    ("a token that is a number", _signature(token=12345), 400),
    ("a timestamp that is a float", _signature(timestamp=NOW), 400),
    ("a signed token over 255 characters",
     _json(webhook_payload(_DATA, WEBHOOK_SIGNING_KEY, NOW, "t" * 256)), 400),
    ("no event-data", _json({"signature": _GOOD["signature"]}), 400),
    ("event-data that is a list", _json({**_GOOD, "event-data": [_DATA]}), 400),
    ("event-data without an event", _json({**_GOOD, "event-data": {"id": "x"}}), 400),
    ("a recipient that is a list", _data(recipient=[TO]), 400),
    ("an event timestamp that is a string", _data(timestamp="1699999000"), 400),
    ("an event timestamp out of range", _data(timestamp=1e20), 400),
    ("a reason that is a number", _data(event="failed", reason=5), 400),
]


@pytest.mark.parametrize(("what", "body", "status"), REFUSALS,
                         ids=[case[0] for case in REFUSALS])
def test_refused(what: str, body: bytes, status: int) -> None:
    with pytest.raises(WebhookRefused) as refused:
        _receiver().receive(WebhookRequest({"content-type": "application/json"}, body, NOW))
    assert refused.value.status == status, what
    assert WEBHOOK_SIGNING_KEY not in refused.value.reason
    assert _GOOD["signature"]["signature"] not in refused.value.reason


#: (what, webhook_secret): every secret check_secret refuses.
BAD_SECRETS: list[tuple[str, Any]] = [
    ("None", None), ("a number", 1234), ("empty", ""), ("blank", "   "),
    ("with a space", "key with space"), ("with a newline", "key\nnext"),
    ("not ASCII", "schlüssel-0123456789"),
]


@pytest.mark.parametrize(("what", "secret"), BAD_SECRETS, ids=[c[0] for c in BAD_SECRETS])
def test_check_secret_refuses(what: str, secret: Any) -> None:
    with pytest.raises(ConfigError) as error:
        MailgunReceiver.check_secret(secret, 'OUTBOX_TRANSPORTS["mg"]["webhook_secret"]')
    assert error.value.key == 'OUTBOX_TRANSPORTS["mg"]["webhook_secret"]'
    if isinstance(secret, str) and secret.strip():
        assert secret not in str(error.value)


def test_check_secret_takes_a_signing_key() -> None:
    MailgunReceiver.check_secret(WEBHOOK_SIGNING_KEY, "key")


def test_refusal_count() -> None:
    """The count the report gives: bad requests plus bad secrets."""
    assert len(REFUSALS) + len(BAD_SECRETS) == 36


def _status(code: int, message: str) -> dict[str, Any]:
    return {"attempt-no": 1, "code": code, "description": "", "message": message}


@pytest.mark.parametrize(("extra", "reason"), [
    ({}, "user_unknown"),  # the docs' sample: reason "bounce", 550 5.1.1
    ({"reason": "generic", "delivery-status": _status(552, "5.2.2 Mailbox full")},
     "mailbox_full"),
    ({"reason": "suppress-bounce", "delivery-status": _status(605, "")}, "user_unknown"),
    ({"reason": "old", "severity": "temporary"}, "expired"),
    ({"reason": "espblock", "severity": "temporary"}, "blocked"),
    ({"reason": "generic", "severity": "temporary",
      "delivery-status": _status(421, "4.7.0 Too many connections, slow down")},
     "rate_limited"),
])
def test_a_failure_s_reason_is_mailgun_s_else_the_reply(extra: dict[str, Any],
                                                       reason: str) -> None:
    assert _one("failed", **extra).reason == reason


def test_a_complaint_s_reason_and_a_delivery_s_none() -> None:
    assert _one("complained").reason == "complaint"
    assert _one("delivered").reason is None

