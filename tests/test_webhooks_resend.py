"""Resend's webhook receiver: Svix signatures checked, every documented event normalized.

Payloads are Resend's documented samples (tests/provider_resend.py), signed
as Svix signs them with a random secret; the clock is fixed. Every bad input
is refused with the status the receiver contract gives, and its reason shows
neither the secret nor the signature.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
from provider_resend import (
    SAMPLE_EMAIL_ID,
    bounce,
    resend_event,
    svix_signature,
    webhook_request,
    webhook_secret,
)

from flask_mail_outbox import ConfigError
from flask_mail_outbox._events import DeliveryEvent
from flask_mail_outbox._webhooks import (
    TOLERANCE_SECONDS,
    Received,
    WebhookRefused,
    WebhookRequest,
    receiver_class,
)
from flask_mail_outbox._webhooks.resend import ResendReceiver

#: 2024-11-22T23:41:12Z, the time of Resend's samples.
NOW = 1732318872.0
SVIX_ID = "msg_2bPxLmd1QkdjsHM7xOX4ToFtG8N"
CREATED = datetime(2024, 11, 22, 23, 41, 12, 126000)


@pytest.fixture
def secret() -> str:
    return webhook_secret()


@pytest.fixture
def receiver(secret: str) -> ResendReceiver:
    return ResendReceiver("mail-resend", secret)


def _receive(receiver: ResendReceiver, headers: dict[str, str], body: bytes,
             now: float = NOW) -> Received:
    return receiver.receive(WebhookRequest(headers=headers, body=body, now=now))


def _events(receiver: ResendReceiver, secret: str, event: dict[str, Any]) -> list[DeliveryEvent]:
    received = _receive(receiver, *webhook_request(event, secret, NOW))
    assert received.nonces == () and received.confirm_url is None
    return list(received.events)


def _refused(receiver: ResendReceiver, headers: dict[str, str], body: bytes, status: int,
             secret: str, now: float = NOW) -> WebhookRefused:
    with pytest.raises(WebhookRefused) as refused:
        _receive(receiver, headers, body, now)
    assert refused.value.status == status
    assert secret not in refused.value.reason and secret[6:] not in refused.value.reason
    signature = headers.get("svix-signature", "")
    assert not signature or signature[3:] not in refused.value.reason
    return refused.value


# -- events ------------------------------------------------------------------------------

HARD = bounce()["message"]
SUPPRESSED = ("Resend has suppressed sending to this address because it is on the "
              "account-level suppression list.")

#: Resend type, data to add, normalized type, bounce kind, description, mta_response,
#: reason (None: the event is no failure).
DOCUMENTED: list[tuple[str, dict[str, Any], str, str | None, str, str, str | None]] = [
    ("email.delivered", {}, "delivered", None, "", "", None),
    ("email.delivery_delayed", {}, "deferred", None, "", "", "undefined"),
    ("email.complained", {}, "complained", None, "", "", "complaint"),
    ("email.opened", {}, "opened", None, "", "", None),
    ("email.clicked", {"click": {"ipAddress": "122.115.53.11", "link": "https://resend.com",
                                 "timestamp": "2024-11-24T05:00:57.163Z",
                                 "userAgent": "Mozilla/5.0"}},
     "clicked", None, "https://resend.com", "", None),
    ("email.bounced", {"bounce": bounce("Permanent", "Suppressed")}, "bounced", "permanent",
     f"Permanent / Suppressed: {HARD}",
     "smtp; 550 5.5.0 Requested action not taken: mailbox unavailable", "user_unknown"),
    ("email.bounced", {"bounce": bounce("Transient", "MailboxFull")}, "bounced", "transient",
     f"Transient / MailboxFull: {HARD}",
     "smtp; 550 5.5.0 Requested action not taken: mailbox unavailable", "mailbox_full"),
    ("email.bounced", {"bounce": {"type": "Undetermined", "subType": "Undetermined",
                                  "message": "unknown", "diagnosticCode": "smtp; 554 no"}},
     "bounced", "transient", "Undetermined / Undetermined: unknown", "smtp; 554 no",
     "policy"),
    # An email.bounced without bounce.type (Resend's payloads of 2023): Resend documents the
    # event as a permanent rejection, so the address is suppressed.
    ("email.bounced", {}, "bounced", "permanent", "", "", "undefined"),
    ("email.failed", {"failed": {"reason": "reached_daily_quota"}}, "rejected", None,
     "reached_daily_quota", "", "account"),
    ("email.suppressed", {"suppressed": {"message": SUPPRESSED,
                                         "type": "OnAccountSuppressionList"}},
     "rejected", None, f"OnAccountSuppressionList: {SUPPRESSED}", "", "suppressed"),
    ("email.sent", {}, "unknown", None, "email.sent", "", None),
    ("email.scheduled", {}, "unknown", None, "email.scheduled", "", None),
    ("email.received", {}, "unknown", None, "email.received", "", None),
    ("contact.created", {}, "unknown", None, "contact.created", "", None),
    ("domain.updated", {}, "unknown", None, "domain.updated", "", None),
]


@pytest.mark.parametrize(("kind", "data", "event_type", "bounce_kind", "description",
                          "mta_response", "reason"), DOCUMENTED,
                         ids=[f"{row[0]}-{row[3]}" for row in DOCUMENTED])
def test_every_documented_event_type_is_normalized(
        receiver: ResendReceiver, secret: str, kind: str, data: dict[str, Any],
        event_type: str, bounce_kind: str | None, description: str, mta_response: str,
        reason: str | None) -> None:
    event = resend_event(kind, **data)
    [got] = _events(receiver, secret, event)
    assert got == DeliveryEvent(
        event_type=event_type, recipient="delivered@resend.dev", occurred_at=CREATED,
        transport="mail-resend", provider_event_id=SVIX_ID, bounce_kind=bounce_kind,
        description=description, mta_response=mta_response, reason=reason,
        provider_message_id=SAMPLE_EMAIL_ID, payload=json.dumps(event, separators=(",", ":")))
    assert got.payload is not None and json.loads(got.payload) == event


def test_several_recipients_give_one_event_each_with_distinct_ids(
        receiver: ResendReceiver, secret: str) -> None:
    event = resend_event("email.bounced", to=["Ann <ann@example.com>", "bob@example.com"],
                         bounce=bounce("Transient", "General"))
    events = _events(receiver, secret, event)
    assert [(e.recipient, e.provider_event_id, e.event_type, e.bounce_kind) for e in events] \
        == [("ann@example.com", f"{SVIX_ID}:ann@example.com", "bounced", "transient"),
            ("bob@example.com", f"{SVIX_ID}:bob@example.com", "bounced", "transient")]
    assert {e.provider_message_id for e in events} == {SAMPLE_EMAIL_ID}


@pytest.mark.parametrize(("kind", "extra"), [
    ("email.bounced", {"bounce": bounce("Permanent", "General")}),
    ("email.complained", {}),
])
def test_a_suppressing_event_for_several_recipients_names_none(
        receiver: ResendReceiver, secret: str, kind: str, extra: dict[str, Any]) -> None:
    """Resend does not say whose bounce it is: suppressing them all would be wrong."""
    event = resend_event(kind, to=["ann@example.com", "bob@example.com"], **extra)
    [got] = _events(receiver, secret, event)
    assert got.recipient is None
    assert got.provider_event_id == SVIX_ID
    # Suppressing for all (a complaint, a permanent bounce): no recipient, so nobody is.
    assert got.event_type == "complained" or got.bounce_kind == "permanent"
    assert "which of the 2 recipients" in got.description


def test_an_event_without_recipients_is_kept(receiver: ResendReceiver, secret: str) -> None:
    [got] = _events(receiver, secret, resend_event("email.delivered", to=[]))
    assert (got.recipient, got.provider_event_id, got.event_type) == (None, SVIX_ID,
                                                                       "delivered")


def test_a_retry_carries_the_same_event_id(receiver: ResendReceiver, secret: str) -> None:
    """Svix retries with the same svix-id and a new svix-timestamp: the same event, again."""
    event = resend_event("email.delivered")
    first = _receive(receiver, *webhook_request(event, secret, NOW, timestamp=NOW - 60))
    again = _receive(receiver, *webhook_request(event, secret, NOW, timestamp=NOW))
    assert first.events == again.events


def test_occurred_at_falls_back_to_the_signed_timestamp(
        receiver: ResendReceiver, secret: str) -> None:
    event = resend_event("email.opened")
    del event["created_at"]
    [got] = _events(receiver, secret, event)
    assert got.occurred_at == datetime(2024, 11, 22, 23, 41, 12)
    event["created_at"] = "yesterday"
    [got] = _events(receiver, secret, event)
    assert got.occurred_at == datetime(2024, 11, 22, 23, 41, 12)


def test_a_rotated_secret_signs_twice_and_either_matches(
        receiver: ResendReceiver, secret: str) -> None:
    headers, body = webhook_request(resend_event("email.delivered"), secret, NOW)
    old = svix_signature(webhook_secret(), SVIX_ID, headers["svix-timestamp"], body)
    headers["svix-signature"] = f"{old} {headers['svix-signature']} v1a,c2lnbmF0dXJl"
    assert len(_receive(receiver, headers, body).events) == 1


def test_the_window_edge_is_accepted(receiver: ResendReceiver, secret: str) -> None:
    event = resend_event("email.delivered")
    for skew in (-TOLERANCE_SECONDS, TOLERANCE_SECONDS):
        assert _receive(receiver, *webhook_request(event, secret, NOW, timestamp=NOW + skew))


def test_svix_published_test_vector_verifies() -> None:
    """Svix's (and Standard Webhooks') published vector: the scheme as its libraries sign it."""
    receiver = ResendReceiver("r", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    headers = {"svix-id": "msg_p5jXN8AQM9LWM0D4loKWxJek", "svix-timestamp": "1614265330",
               "svix-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="}
    body = b'{"test": 2432232314}'
    with pytest.raises(WebhookRefused) as refused:  # verified; then not a Resend event
        receiver.receive(WebhookRequest(headers=headers, body=body, now=1614265330.0))
    assert refused.value.status == 400
    assert svix_signature("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                          "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", body) \
        == headers["svix-signature"]
    with pytest.raises(WebhookRefused) as refused:
        receiver.receive(WebhookRequest(headers=headers, body=body + b" ", now=1614265330.0))
    assert refused.value.status == 403


def test_the_registry_names_this_receiver() -> None:
    assert receiver_class("resend") is ResendReceiver
    assert repr(ResendReceiver("r", webhook_secret())) == "<ResendReceiver 'r'>"


# -- refusals ----------------------------------------------------------------------------

def _signed(secret: str, body: bytes, timestamp: float = NOW) -> dict[str, str]:
    stamp = str(int(timestamp))
    return {"svix-id": SVIX_ID, "svix-timestamp": stamp,
            "svix-signature": svix_signature(secret, SVIX_ID, stamp, body)}


def _bad_inputs(secret: str) -> list[tuple[str, dict[str, str], bytes, int]]:
    """Every bad request tried: (name, headers, body, status expected)."""
    good = json.dumps(resend_event("email.bounced", bounce=bounce())).encode()
    headers = _signed(secret, good)
    other = webhook_secret()
    cases: list[tuple[str, dict[str, str], bytes, int]] = [
        ("no headers", {}, good, 401),
        ("no svix-signature", {k: v for k, v in headers.items() if k != "svix-signature"},
         good, 401),
        ("no svix-id", {k: v for k, v in headers.items() if k != "svix-id"}, good, 401),
        ("no svix-timestamp", {k: v for k, v in headers.items() if k != "svix-timestamp"},
         good, 401),
        ("empty svix-signature", {**headers, "svix-signature": ""}, good, 401),
        ("signed with another secret", _signed(other, good), good, 403),
        ("body changed after signing", headers, good.replace(b"Permanent", b"Transient"), 403),
        ("another svix-id than signed", {**headers, "svix-id": "msg_other"}, good, 403),
        ("another timestamp than signed", {**headers, "svix-timestamp": str(int(NOW) - 1)},
         good, 403),
        ("signature of another scheme only", {**headers, "svix-signature": "v1a,"
                                              + headers["svix-signature"][3:]}, good, 403),
        ("signature not base64", {**headers, "svix-signature": "v1,not-base64!!"}, good, 403),
        ("signature without a version", {**headers, "svix-signature":
                                         headers["svix-signature"][3:]}, good, 403),
        ("non-ASCII signature", {**headers, "svix-signature": "v1,sïgnature"}, good, 403),
        ("timestamp too old", _signed(secret, good, NOW - TOLERANCE_SECONDS - 1), good, 403),
        ("timestamp from the future", _signed(secret, good, NOW + TOLERANCE_SECONDS + 1), good,
         403),
        ("timestamp not a number", {**headers, "svix-timestamp": "yesterday"}, good, 403),
        ("timestamp in milliseconds", _signed(secret, good, NOW * 1000), good, 403),
    ]
    for name, body in [("not JSON", b"{\"type\": \"email.delivered\""),
                       ("not UTF-8", b"\xff\xfe{}"),
                       ("empty body", b""),
                       ("a JSON array", b"[]"),
                       ("a JSON string", b"\"email.delivered\""),
                       ("no type", json.dumps({"data": {}}).encode()),
                       ("type not a string", json.dumps({"type": 1, "data": {}}).encode()),
                       ("no data", json.dumps({"type": "email.delivered"}).encode()),
                       ("data not an object", json.dumps({"type": "email.delivered",
                                                          "data": []}).encode())]:
        cases.append((f"body {name}", _signed(secret, body), body, 400))
    return cases


def test_every_bad_input_is_refused(receiver: ResendReceiver, secret: str) -> None:
    cases = _bad_inputs(secret)
    assert len(cases) == REFUSAL_CASES
    for name, headers, body, status in cases:
        refused = _refused(receiver, headers, body, status, secret)
        assert refused.reason, name


#: How many bad requests test_every_bad_input_is_refused tries (the report counts them).
REFUSAL_CASES = 26


def test_refusal_reasons_say_what_is_wrong(receiver: ResendReceiver, secret: str) -> None:
    good = json.dumps(resend_event("email.delivered")).encode()
    reason = _refused(receiver, _signed(secret, good, NOW - 3600), good, 403, secret).reason
    assert "window" in reason
    reason = _refused(receiver, _signed(webhook_secret(), good), good, 403, secret).reason
    assert "does not match" in reason
    reason = _refused(receiver, {}, good, 401, secret).reason
    assert "svix-signature" in reason
    reason = _refused(receiver, _signed(secret, b"[]"), b"[]", 400, secret).reason
    assert "not a Resend event" in reason


def test_the_signature_is_checked_before_the_body_is_read(
        receiver: ResendReceiver, secret: str) -> None:
    """A body that is not JSON, unsigned, is a 401 (and badly signed, a 403), never a 400."""
    _refused(receiver, {}, b"not json", 401, secret)
    _refused(receiver, _signed(webhook_secret(), b"not json"), b"not json", 403, secret)


BAD_SECRETS: list[Any] = [None, "", 42, "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_",
                          "whsec_not base64!", "whsec_abc", "WHSEC_MfKQ9r8GKYqrTwjUPD8ILPZIo2Lw",
                          ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]]


@pytest.mark.parametrize("bad", BAD_SECRETS, ids=repr)
def test_a_secret_of_the_wrong_form_is_a_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError) as error:
        ResendReceiver.check_secret(bad, 'OUTBOX_TRANSPORTS["resend"]["webhook_secret"]')
    assert error.value.key == 'OUTBOX_TRANSPORTS["resend"]["webhook_secret"]'
    if isinstance(bad, str) and len(bad) > 6:
        assert bad not in str(error.value) and bad[6:] not in str(error.value)
    with pytest.raises(ConfigError):
        ResendReceiver("resend", bad)


def test_a_secret_as_resend_shows_it_is_accepted() -> None:
    ResendReceiver.check_secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "key")
    ResendReceiver.check_secret(webhook_secret(), "key")
