"""Postmark's webhook receiver: Basic credentials, every record type, every refusal.

The records are the shapes Postmark's webhook pages publish (tests/provider_postmark.py),
posted with the credentials of the webhook URL; the receiver is called the way the route
calls it, with a fixed ``now``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime
from typing import Any

import pytest
from provider_postmark import (
    WEBHOOK_PASSWORD,
    WEBHOOK_SECRET,
    WEBHOOK_USER,
    bounce_record,
    click_record,
    delivery_record,
    open_record,
    spam_complaint_record,
    subscription_change_record,
    webhook_request,
)

from flask_mail_outbox import ConfigError
from flask_mail_outbox._events import DeliveryEvent
from flask_mail_outbox._webhooks import WebhookRefused, WebhookRequest, receiver_class
from flask_mail_outbox._webhooks.postmark import BOUNCE_TYPES, PostmarkReceiver

NOW = 1_700_000_000.0
MESSAGE_ID = "883953f4-6105-42a2-a16a-77a8eac79483"
TO = "john@example.com"


def _receiver() -> PostmarkReceiver:
    return PostmarkReceiver("pm", WEBHOOK_SECRET)


def _request(headers: dict[str, str], body: bytes) -> WebhookRequest:
    return WebhookRequest({name.lower(): value for name, value in headers.items()}, body, NOW)


def _receive(record: dict[str, Any]) -> DeliveryEvent:
    received = _receiver().receive(_request(*webhook_request(record)))
    assert received.nonces == () and received.confirm_url is None
    (event,) = received.events
    assert event.transport == "pm"
    assert json.loads(event.payload or "") == record
    return event


def _derived(record_type: str, time_text: str, message_id: str | None = MESSAGE_ID,
             recipient: str = TO) -> str:
    """The documented recipe: SHA-256 of RecordType, MessageID, recipient, time field."""
    parts = (record_type, message_id or "", recipient, time_text)
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def test_the_kind_names_this_receiver() -> None:
    assert receiver_class("postmark") is PostmarkReceiver


# -- events --------------------------------------------------------------------------------


def test_delivery() -> None:
    event = _receive(delivery_record(MESSAGE_ID, TO))
    assert (event.event_type, event.bounce_kind, event.recipient) == ("delivered", None, TO)
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)
    assert event.provider_message_id == MESSAGE_ID
    assert event.mta_response == "Test delivery webhook details"
    assert event.provider_event_id == _derived("Delivery", "2019-11-05T16:33:54.9070259Z")


def test_hard_bounce_uses_postmarks_bounce_id() -> None:
    event = _receive(bounce_record(MESSAGE_ID, TO))
    assert (event.event_type, event.bounce_kind, event.recipient) == ("bounced", "permanent", TO)
    assert event.provider_event_id == "4323372036854775807"
    assert event.provider_message_id == MESSAGE_ID
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)
    assert event.description.startswith("HardBounce: The server was unable to deliver")
    assert event.mta_response == "Test bounce details"
    assert event.suppresses == "bounced"


@pytest.mark.parametrize(("bounce_type", "expected"), [
    (name, (event_type, kind)) for name, (_, event_type, kind) in BOUNCE_TYPES.items()])
def test_every_bounce_type(bounce_type: str, expected: tuple[str, str | None]) -> None:
    code = BOUNCE_TYPES[bounce_type][0]
    event = _receive(bounce_record(MESSAGE_ID, TO, bounce_type=bounce_type, type_code=code,
                                   bounce_id=code))
    assert (event.event_type, event.bounce_kind) == expected
    assert (event.recipient, event.provider_message_id) == (TO, MESSAGE_ID)
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)
    assert event.provider_event_id == str(code)
    assert event.description.startswith(f"{bounce_type}: ")
    if event.event_type == "bounced":
        assert event.bounce_kind in ("permanent", "transient")


@pytest.mark.parametrize(("bounce_type", "event_type", "kind"), [
    ("HardBounce", "bounced", "permanent"), ("BadEmailAddress", "bounced", "permanent"),
    ("SoftBounce", "bounced", "transient"), ("Transient", "bounced", "transient"),
    ("DnsError", "bounced", "transient"), ("SpamNotification", "bounced", "transient"),
    ("Unsubscribe", "unsubscribed", None), ("ManuallyDeactivated", "rejected", None),
    ("AutoResponder", "unknown", None), ("SpamComplaint", "complained", None)])
def test_the_documented_bounce_types(bounce_type: str, event_type: str,
                                     kind: str | None) -> None:
    code = BOUNCE_TYPES[bounce_type][0]
    event = _receive(bounce_record(MESSAGE_ID, TO, bounce_type=bounce_type, type_code=code))
    assert (event.event_type, event.bounce_kind) == (event_type, kind)


def test_type_code_decides_when_the_type_name_is_unknown() -> None:
    event = _receive(bounce_record(MESSAGE_ID, TO, bounce_type="SomethingNew", type_code=4096))
    assert (event.event_type, event.bounce_kind) == ("bounced", "transient")
    assert event.description.startswith("SoftBounce: ")


def test_an_unknown_bounce_type_is_unknown_and_named() -> None:
    event = _receive(bounce_record(MESSAGE_ID, TO, bounce_type="SomethingNew", type_code=7))
    assert (event.event_type, event.bounce_kind) == ("unknown", None)
    assert event.description.startswith("Bounce SomethingNew: ")


def test_spam_complaint() -> None:
    event = _receive(spam_complaint_record(MESSAGE_ID, TO))
    assert (event.event_type, event.bounce_kind, event.recipient) == ("complained", None, TO)
    assert event.provider_event_id == "42"
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)
    assert event.provider_message_id == MESSAGE_ID
    assert event.suppresses == "complained"


def test_open() -> None:
    event = _receive(open_record(MESSAGE_ID, TO))
    assert (event.event_type, event.bounce_kind, event.recipient) == ("opened", None, TO)
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)
    assert event.provider_message_id == MESSAGE_ID
    assert event.provider_event_id == _derived("Open", "2019-11-05T16:33:54.9070259Z")


def test_click_describes_the_link() -> None:
    event = _receive(click_record(MESSAGE_ID, TO, link="https://example.com/offer"))
    assert (event.event_type, event.bounce_kind, event.recipient) == ("clicked", None, TO)
    assert event.description == "https://example.com/offer"
    assert event.occurred_at == datetime(2017, 10, 25, 15, 21, 11, 906561)
    assert event.provider_message_id == MESSAGE_ID
    assert event.provider_event_id == _derived("Click", "2017-10-25T15:21:11.9065619Z")


@pytest.mark.parametrize(("reason", "event_type", "kind"), [
    ("HardBounce", "bounced", "permanent"), ("SpamComplaint", "complained", None),
    ("ManualSuppression", "unsubscribed", None)])
def test_subscription_change_suppressing(reason: str, event_type: str,
                                         kind: str | None) -> None:
    event = _receive(subscription_change_record(MESSAGE_ID, TO, reason=reason))
    assert (event.event_type, event.bounce_kind, event.recipient) == (event_type, kind, TO)
    assert event.occurred_at == datetime(2020, 2, 1, 10, 53, 34, 416071)
    assert event.provider_message_id == MESSAGE_ID
    assert event.provider_event_id == _derived("SubscriptionChange",
                                               "2020-02-01T10:53:34.416071Z")
    assert event.description == f"SubscriptionChange: suppressed ({reason}) by Recipient"


def test_subscription_change_reactivating_is_unknown() -> None:
    event = _receive(subscription_change_record(None, TO, suppress=False, origin="Customer"))
    assert (event.event_type, event.recipient, event.provider_message_id) == (
        "unknown", TO, None)
    assert "reactivated" in event.description
    assert event.suppresses is None
    assert event.provider_event_id == _derived("SubscriptionChange",
                                               "2020-02-01T10:53:34.416071Z", None)


def test_an_unknown_record_type_is_kept_as_unknown() -> None:
    record = {**delivery_record(MESSAGE_ID, TO), "RecordType": "SomethingNew"}
    event = _receive(record)
    assert (event.event_type, event.description) == ("unknown", "Postmark SomethingNew")
    assert event.occurred_at == datetime(2019, 11, 5, 16, 33, 54, 907025)


def test_derived_ids_are_stable_and_distinct() -> None:
    first = _receive(open_record(MESSAGE_ID, TO)).provider_event_id
    assert _receive(open_record(MESSAGE_ID, TO)).provider_event_id == first
    assert _receive(open_record(MESSAGE_ID, "jane@example.com")).provider_event_id != first
    later = open_record(MESSAGE_ID, TO, received_at="2019-11-05T16:40:00Z")
    assert _receive(later).provider_event_id != first
    assert _receive(delivery_record(MESSAGE_ID, TO)).provider_event_id != first


def test_an_old_record_is_accepted_postmark_retries_for_hours() -> None:
    # No signed timestamp: a record's own time is not held to the replay window.
    event = _receive(bounce_record(MESSAGE_ID, TO, bounced_at="2014-08-01T13:28:10.27-04:00"))
    assert event.occurred_at == datetime(2014, 8, 1, 17, 28, 10, 270000)


def test_a_password_with_colons_and_unicode() -> None:
    secret = f"{WEBHOOK_USER}:pä:ss:{WEBHOOK_PASSWORD}"
    PostmarkReceiver.check_secret(secret, "key")
    received = PostmarkReceiver("pm", secret).receive(
        _request(*webhook_request(delivery_record(MESSAGE_ID, TO), secret)))
    assert received.events[0].event_type == "delivered"


def test_the_scheme_name_is_case_insensitive() -> None:
    headers, body = webhook_request(delivery_record(MESSAGE_ID, TO))
    headers["Authorization"] = headers["Authorization"].replace("Basic", "basic")
    assert _receiver().receive(_request(headers, body)).events


def test_repr_hides_the_secret() -> None:
    assert WEBHOOK_PASSWORD not in repr(_receiver())


# -- refusals ------------------------------------------------------------------------------


def _basic(credentials: str) -> str:
    return "Basic " + base64.b64encode(credentials.encode()).decode()


_GOOD = delivery_record(MESSAGE_ID, TO)
_BODY = json.dumps(_GOOD).encode()

#: (what, headers, body, status): every bad request tried.
REFUSALS: list[tuple[str, dict[str, str], bytes, int]] = [
    ("no Authorization", {}, _BODY, 401),
    ("an empty Authorization", {"authorization": ""}, _BODY, 401),
    ("a Bearer token", {"authorization": f"Bearer {WEBHOOK_PASSWORD}"}, _BODY, 401),
    ("Basic without credentials", {"authorization": "Basic"}, _BODY, 403),
    ("a wrong password", {"authorization": _basic(f"{WEBHOOK_USER}:wrong")}, _BODY, 403),
    ("a wrong user", {"authorization": _basic(f"other:{WEBHOOK_PASSWORD}")}, _BODY, 403),
    ("the password alone", {"authorization": _basic(WEBHOOK_PASSWORD)}, _BODY, 403),
    ("the secret with a suffix", {"authorization": _basic(WEBHOOK_SECRET + "x")}, _BODY, 403),
    ("credentials not base64", {"authorization": "Basic !!!not-base64!!!"}, _BODY, 403),
    ("bad JSON", {"authorization": _basic(WEBHOOK_SECRET)}, b"{not json", 400),
    ("a body not UTF-8", {"authorization": _basic(WEBHOOK_SECRET)}, b"\xff\xfe{}", 400),
    ("an empty body", {"authorization": _basic(WEBHOOK_SECRET)}, b"", 400),
    ("a JSON array", {"authorization": _basic(WEBHOOK_SECRET)}, b"[]", 400),
    ("no RecordType", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({"MessageID": MESSAGE_ID}).encode(), 400),
    ("a RecordType not a string", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({**_GOOD, "RecordType": 3}).encode(), 400),
    ("an inbound email", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({"FromFull": {"Email": "a@example.com"}, "Subject": "hi"}).encode(), 400),
    ("RecordType Inbound", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({"RecordType": "Inbound"}).encode(), 400),
    ("a time that is not ISO 8601", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({**_GOOD, "DeliveredAt": "yesterday"}).encode(), 400),
    ("a recipient that is not a string", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({**_GOOD, "Recipient": ["john@example.com"]}).encode(), 400),
    ("a bounce ID that is an object", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({**bounce_record(MESSAGE_ID, TO), "ID": {"n": 1}}).encode(), 400),
    ("a SubscriptionChange without SuppressSending", {"authorization": _basic(WEBHOOK_SECRET)},
     json.dumps({**subscription_change_record(MESSAGE_ID, TO),
                 "SuppressSending": None}).encode(), 400),
]


@pytest.mark.parametrize(("what", "headers", "body", "status"), REFUSALS,
                         ids=[case[0] for case in REFUSALS])
def test_refused(what: str, headers: dict[str, str], body: bytes, status: int) -> None:
    with pytest.raises(WebhookRefused) as refused:
        _receiver().receive(WebhookRequest(headers, body, NOW))
    assert refused.value.status == status, what
    assert WEBHOOK_PASSWORD not in refused.value.reason
    credentials = headers.get("authorization", "").partition(" ")[2]
    assert not credentials or credentials not in refused.value.reason


#: (what, webhook_secret): every secret check_secret refuses.
BAD_SECRETS: list[tuple[str, Any]] = [
    ("None", None), ("a number", 1234), ("empty", ""), ("blank", "   "),
    ("no colon", WEBHOOK_PASSWORD), ("no user", f":{WEBHOOK_PASSWORD}"),
    ("no password", f"{WEBHOOK_USER}:"), ("a control character", f"{WEBHOOK_USER}:pa\nss"),
]


@pytest.mark.parametrize(("what", "secret"), BAD_SECRETS, ids=[c[0] for c in BAD_SECRETS])
def test_check_secret_refuses(what: str, secret: Any) -> None:
    with pytest.raises(ConfigError) as error:
        PostmarkReceiver.check_secret(secret, 'OUTBOX_TRANSPORTS["pm"]["webhook_secret"]')
    assert error.value.key == 'OUTBOX_TRANSPORTS["pm"]["webhook_secret"]'
    if isinstance(secret, str) and secret.strip():
        assert secret not in str(error.value)


def test_check_secret_takes_the_documented_form() -> None:
    PostmarkReceiver.check_secret(WEBHOOK_SECRET, "key")


def test_refusal_count() -> None:
    """The count the report gives: bad requests plus bad secrets."""
    assert len(REFUSALS) + len(BAD_SECRETS) == 29


@pytest.mark.parametrize(("bounce_type", "type_code", "details", "reason"), [
    ("HardBounce", 1, "smtp;550 5.1.1 The email account does not exist", "user_unknown"),
    ("HardBounce", 1, "Test bounce details", "user_unknown"),
    ("SoftBounce", 4096, "smtp;452 4.2.2 Mailbox full", "mailbox_full"),
    ("DnsError", 256, "", "host_unknown"),
    ("DMARCPolicy", 100009, "", "authentication"),
    ("ManuallyDeactivated", 100002, "", "suppressed"),
    ("Unconfirmed", 100003, "", "account"),
])
def test_a_bounce_s_reason_is_its_type_refined_by_its_details(
        bounce_type: str, type_code: int, details: str, reason: str) -> None:
    event = _receive(bounce_record(MESSAGE_ID, TO, bounce_type=bounce_type,
                                   type_code=type_code, details=details))
    assert event.reason == reason


def test_a_complaint_and_a_subscription_change_have_their_reason() -> None:
    assert _receive(spam_complaint_record(MESSAGE_ID, TO)).reason == "complaint"
    assert _receive(subscription_change_record(MESSAGE_ID, TO)).reason == "suppressed"
    assert _receive(delivery_record(MESSAGE_ID, TO)).reason is None

