"""SES's webhook receiver: SNS signatures verified, the topic checked, SES events normalized.

SNS messages are built and signed as SNS does (tests/provider_ses.py): an
RSA key and a self-signed certificate the test makes, trusted under an
``https://sns.<region>.amazonaws.com`` URL with :meth:`SNSCertificates.trust`,
both signature versions. SES records are the documentation's samples, in
both shapes (event publishing and feedback notifications). The certificate
fetch itself runs against an HTTPS server on a loopback port, TLS verified
against a certificate authority the test makes, through an httpx transport
the test gives (no code of ours patched). The clock is fixed.
"""

from __future__ import annotations

import base64
import datetime
import json
import ssl
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from provider_ses import (
    SES_MESSAGE_ID,
    SIGNING_CERT_URL,
    SNS_REGION,
    TOPIC_ARN,
    SNSSigner,
    bounce_detail,
    complaint_detail,
    confirmation,
    delay_detail,
    delivery_detail,
    notification,
    ses_event,
    sign_sns,
    sns_request,
    sns_signer,
    subscription_detail,
    webhook_request,
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
from flask_mail_outbox._webhooks.ses import (
    DEFAULT_CERTIFICATES,
    CertificateUnavailable,
    SESReceiver,
    SNSCertificates,
    sns_url_allowed,
)

#: 2026-01-01T00:00:00Z.
NOW = 1767225600.0
SNS_ID = "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"
OTHER_TOPIC = f"arn:aws:sns:{SNS_REGION}:123456789012:someone-elses-topic"
ANN, BOB = "ann@example.com", "bob@example.com"


@pytest.fixture(scope="module")
def signer() -> SNSSigner:
    return sns_signer()


@pytest.fixture
def certificates(signer: SNSSigner) -> Iterator[SNSCertificates]:
    """Certificates that trust the test's signer and fetch nothing (a fetch fails the test)."""
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"fetched {request.url}")
    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        certificates = SNSCertificates(client)
        certificates.trust(signer.url, signer.pem)
        yield certificates


@pytest.fixture
def receiver(certificates: SNSCertificates) -> SESReceiver:
    return SESReceiver("mail-ses", TOPIC_ARN, certificates=certificates)


def _receive(receiver: SESReceiver, headers: dict[str, str], body: bytes,
             now: float = NOW) -> Received:
    return receiver.receive(WebhookRequest(headers=headers, body=body, now=now))


def _events(receiver: SESReceiver, signer: SNSSigner, record: dict[str, Any] | str,
            version: str = "2") -> list[DeliveryEvent]:
    received = _receive(receiver, *webhook_request(record, signer, NOW, version=version,
                                                   message_id=SNS_ID))
    assert received.nonces == () and received.confirm_url is None
    return list(received.events)


def _summary(events: list[DeliveryEvent]) -> list[tuple[Any, ...]]:
    return [(e.event_type, e.recipient, e.bounce_kind, e.occurred_at, e.provider_message_id,
             e.provider_event_id, e.transport) for e in events]


def _at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text).replace(tzinfo=None)


# -- events ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1", "2"])
@pytest.mark.parametrize("notification_format", [False, True], ids=["eventType",
                                                                     "notificationType"])
def test_a_permanent_bounce_is_one_event_per_bounced_recipient(
        receiver: SESReceiver, signer: SNSSigner, version: str,
        notification_format: bool) -> None:
    record = ses_event("Bounce", [ANN, BOB, "carol@example.com"], bounce_detail(
        [(ANN, "5.1.1", "smtp; 550 5.1.1 user unknown"), (BOB, "5.1.1", "smtp; 550 5.1.1 no")]),
        notification_format=notification_format)
    events = _events(receiver, signer, record, version)
    at = _at("2017-08-05T00:41:02.669")
    assert _summary(events) == [
        ("bounced", ANN, "permanent", at, SES_MESSAGE_ID, f"{SNS_ID}:{ANN}", "mail-ses"),
        ("bounced", BOB, "permanent", at, SES_MESSAGE_ID, f"{SNS_ID}:{BOB}", "mail-ses")]
    assert [(e.description, e.mta_response) for e in events] == [
        ("Permanent/General (5.1.1)", "smtp; 550 5.1.1 user unknown"),
        ("Permanent/General (5.1.1)", "smtp; 550 5.1.1 no")]
    assert events[0].payload is not None and json.loads(events[0].payload) == record


@pytest.mark.parametrize(("bounce_type", "sub_type"), [("Transient", "MailboxFull"),
                                                       ("Undetermined", "Undetermined"),
                                                       ("Permanent", "Suppressed")])
def test_the_bounce_kind_follows_the_bounce_type(
        receiver: SESReceiver, signer: SNSSigner, bounce_type: str, sub_type: str) -> None:
    record = ses_event("Bounce", [ANN], bounce_detail([(ANN, "4.2.2", "smtp; 452 full")],
                                                      bounce_type, sub_type))
    [event] = _events(receiver, signer, record)
    assert (event.event_type, event.bounce_kind, event.description) == (
        "bounced", "permanent" if bounce_type == "Permanent" else "transient",
        f"{bounce_type}/{sub_type} (4.2.2)")


@pytest.mark.parametrize("notification_format", [False, True])
def test_a_complaint_is_one_event_per_complained_recipient(
        receiver: SESReceiver, signer: SNSSigner, notification_format: bool) -> None:
    record = ses_event("Complaint", [ANN, BOB], complaint_detail([BOB]),
                       notification_format=notification_format)
    [event] = _events(receiver, signer, record)
    assert _summary([event]) == [("complained", BOB, None, _at("2017-08-05T00:41:02.669"),
                                  SES_MESSAGE_ID, f"{SNS_ID}:{BOB}", "mail-ses")]
    assert event.description == "complaint: abuse"


@pytest.mark.parametrize("notification_format", [False, True])
def test_a_delivery_is_one_event_per_delivered_recipient(
        receiver: SESReceiver, signer: SNSSigner, notification_format: bool) -> None:
    record = ses_event("Delivery", [ANN, BOB], delivery_detail([ANN, BOB]),
                       notification_format=notification_format)
    events = _events(receiver, signer, record)
    at = _at("2016-10-19T23:21:04.133")
    assert _summary(events) == [
        ("delivered", ANN, None, at, SES_MESSAGE_ID, f"{SNS_ID}:{ANN}", "mail-ses"),
        ("delivered", BOB, None, at, SES_MESSAGE_ID, f"{SNS_ID}:{BOB}", "mail-ses")]
    assert {e.mta_response for e in events} == {"250 2.6.0 Message received"}


def test_a_delivery_delay_is_deferred_per_delayed_recipient(
        receiver: SESReceiver, signer: SNSSigner) -> None:
    [event] = _events(receiver, signer, ses_event("DeliveryDelay", [ANN, BOB],
                                                  delay_detail([ANN])))
    assert _summary([event]) == [("deferred", ANN, None, _at("2020-06-16T00:15:40.641"),
                                  SES_MESSAGE_ID, f"{SNS_ID}:{ANN}", "mail-ses")]
    assert (event.description, event.mta_response) == (
        "TransientCommunicationFailure (4.4.1)",
        "smtp; 421 4.4.1 Unable to connect to remote host")
    assert event.reason == "network_error"  # SES's delayType says why


@pytest.mark.parametrize(("delay_type", "reason"), [
    ("MailboxFull", "mailbox_full"), ("SpamDetected", "spam"), ("IPFailure", "blocked"),
    ("SendingDeferral", "rate_limited"), ("RecipientServerError", "system_error"),
    ("Undetermined", "network_error"),  # no reason of its own: the reply's 4.4.1
])
def test_a_delivery_delay_s_reason_is_its_delay_type_else_its_reply(
        receiver: SESReceiver, signer: SNSSigner, delay_type: str, reason: str) -> None:
    detail = delay_detail([ANN])
    detail["delayType"] = delay_type
    [event] = _events(receiver, signer, ses_event("DeliveryDelay", [ANN], detail))
    assert event.reason == reason


@pytest.mark.parametrize(("kind", "detail", "reason"), [
    ("Reject", {"reason": "Bad content"}, "policy"),
    ("Reject", {"reason": "Sending paused: DMARC policy"}, "authentication"),
    ("Rendering Failure", {"errorMessage": "x", "templateName": "T"}, "content"),
    ("Open", {"timestamp": "2017-08-09T22:00:19.652Z"}, None),
])
def test_a_rejection_s_reason(receiver: SESReceiver, signer: SNSSigner, kind: str,
                              detail: dict[str, Any], reason: str | None) -> None:
    [event] = _events(receiver, signer, ses_event(kind, [ANN], detail))
    assert event.reason == reason


RENDERING = "Attribute 'attributeName' is not present in the rendering data."

#: SES eventType, its object, normalized type, description, when it happened.
PER_DESTINATION: list[tuple[str, dict[str, Any] | None, str, str, str]] = [
    ("Send", {}, "unknown", "Send", "2017-08-05T00:40:02.012"),
    ("Reject", {"reason": "Bad content"}, "rejected", "rejected by SES: Bad content",
     "2017-08-05T00:40:02.012"),
    ("Rendering Failure", {"errorMessage": RENDERING, "templateName": "MyTemplate"},
     "rejected", f"rendering failure: MyTemplate: {RENDERING}", "2017-08-05T00:40:02.012"),
    ("Open", {"ipAddress": "192.0.2.1", "timestamp": "2017-08-09T22:00:19.652Z",
              "userAgent": "Mozilla/5.0"}, "opened", "", "2017-08-09T22:00:19.652"),
    ("Click", {"ipAddress": "192.0.2.1", "link": "http://docs.aws.amazon.com/ses/latest/",
               "linkTags": {"samplekey0": ["samplevalue0"]},
               "timestamp": "2017-08-09T23:51:25.570Z", "userAgent": "Mozilla/5.0"},
     "clicked", "http://docs.aws.amazon.com/ses/latest/", "2017-08-09T23:51:25.570"),
    ("Subscription", subscription_detail(unsubscribe_all=True), "unsubscribed",
     "unsubscribed from all topics: ContactListName", "2022-01-12T01:00:17.910"),
    ("Subscription", subscription_detail(unsubscribe_all=False), "unknown",
     "Subscription (topic preferences changed): ContactListName", "2022-01-12T01:00:17.910"),
    ("Received", None, "unknown", "Received", "2017-08-05T00:40:02.012"),
    ("SomethingNew", {"x": 1}, "unknown", "SomethingNew", "2017-08-05T00:40:02.012"),
]


@pytest.mark.parametrize(("kind", "detail", "event_type", "description", "at"),
                         PER_DESTINATION, ids=[f"{r[0]}-{r[2]}" for r in PER_DESTINATION])
def test_events_without_recipients_of_their_own_are_per_destination(
        receiver: SESReceiver, signer: SNSSigner, kind: str, detail: dict[str, Any] | None,
        event_type: str, description: str, at: str) -> None:
    events = _events(receiver, signer, ses_event(kind, [ANN, BOB], detail))
    assert _summary(events) == [
        (event_type, ANN, None, _at(at), SES_MESSAGE_ID, f"{SNS_ID}:{ANN}", "mail-ses"),
        (event_type, BOB, None, _at(at), SES_MESSAGE_ID, f"{SNS_ID}:{BOB}", "mail-ses")]
    assert {e.description for e in events} == {description}


def test_a_bounce_naming_no_recipient_falls_back_to_the_destination(
        receiver: SESReceiver, signer: SNSSigner) -> None:
    record = ses_event("Bounce", [ANN], {**bounce_detail([]), "bounceSubType": "NoEmail"})
    [event] = _events(receiver, signer, record)
    assert (event.event_type, event.recipient, event.bounce_kind) == ("bounced", ANN,
                                                                      "permanent")


def test_a_retried_notification_gives_the_same_events(
        receiver: SESReceiver, signer: SNSSigner) -> None:
    record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
    assert _events(receiver, signer, record) == _events(receiver, signer, record)


@pytest.mark.parametrize("message", [
    "Successfully validated SNS topic for Amazon SES event publishing.",
    json.dumps({"notificationType": "AmazonSnsSubscriptionSucceeded",
                "message": f"You have successfully subscribed your Amazon SNS topic "
                           f"'{TOPIC_ARN}' to receive 'Bounce' notifications from Amazon "
                           "SES for identity 'example.com'."}),
])
def test_ses_setup_messages_carry_no_events(
        receiver: SESReceiver, signer: SNSSigner, message: str) -> None:
    assert _events(receiver, signer, message) == []


def test_a_signed_subject_is_part_of_the_signature(
        receiver: SESReceiver, signer: SNSSigner) -> None:
    record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
    message = sign_sns(notification(record, NOW, subject="Amazon SES Email Event"), signer)
    assert len(_receive(receiver, *sns_request(message)).events) == 1
    message["Subject"] = "changed"
    with pytest.raises(WebhookRefused) as refused:
        _receive(receiver, *sns_request(message))
    assert refused.value.status == 403


@pytest.mark.parametrize("version", ["1", "2"])
def test_a_subscription_confirmation_asks_for_its_url(
        receiver: SESReceiver, signer: SNSSigner, version: str) -> None:
    message = sign_sns(confirmation(NOW), signer, version)
    received = _receive(receiver, *sns_request(message))
    assert received == Received(confirm_url=message["SubscribeURL"])
    assert received.confirm_url is not None and received.confirm_url.startswith(
        f"https://sns.{SNS_REGION}.amazonaws.com/?Action=ConfirmSubscription&TopicArn=")


def test_an_unsubscribe_confirmation_carries_nothing(
        receiver: SESReceiver, signer: SNSSigner) -> None:
    message = sign_sns(confirmation(NOW, kind="UnsubscribeConfirmation"), signer)
    assert _receive(receiver, *sns_request(message)) == Received()


def test_several_topics_may_be_ours(certificates: SNSCertificates, signer: SNSSigner) -> None:
    receiver = SESReceiver("ses", [OTHER_TOPIC, TOPIC_ARN], certificates=certificates)
    for topic in (OTHER_TOPIC, TOPIC_ARN):
        record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
        assert _receive(receiver, *webhook_request(record, signer, NOW, topic_arn=topic))


def test_the_certificates_come_from_the_options_or_the_default(
        certificates: SNSCertificates) -> None:
    assert SESReceiver("ses", TOPIC_ARN, {"certificates": certificates}).certificates \
        is certificates
    assert SESReceiver("ses", TOPIC_ARN).certificates is DEFAULT_CERTIFICATES
    assert receiver_class("ses") is SESReceiver
    assert repr(SESReceiver("ses", TOPIC_ARN)) == "<SESReceiver 'ses'>"


def test_the_window_edge_is_accepted(receiver: SESReceiver, signer: SNSSigner) -> None:
    record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
    for skew in (-TOLERANCE_SECONDS, TOLERANCE_SECONDS):
        headers, body = webhook_request(record, signer, NOW + skew)
        assert _receive(receiver, headers, body).events


# -- refusals ----------------------------------------------------------------------------


def _signed(message: dict[str, Any], signer: SNSSigner, version: str = "2",
            **changes: Any) -> tuple[dict[str, str], bytes]:
    """``message`` signed, then ``changes`` applied (None deletes a field)."""
    signed = sign_sns(message, signer, version)
    for name, value in changes.items():
        if value is None:
            signed.pop(name, None)
        else:
            signed[name] = value
    return sns_request(signed)


def _raw(body: Any) -> tuple[dict[str, str], bytes]:
    return {"x-amz-sns-message-type": "Notification"}, (
        body if isinstance(body, bytes) else json.dumps(body).encode())


def _bad_inputs(signer: SNSSigner, stranger: SNSSigner) -> list[tuple[str, tuple[dict[str, str],
                                                                                 bytes], int]]:
    """Every bad request tried: (name, (headers, body), status expected)."""
    record = ses_event("Bounce", [ANN], bounce_detail([(ANN, "5.1.1", "smtp; 550 5.1.1")]))
    good = notification(record, NOW, message_id=SNS_ID)
    confirm = confirmation(NOW)
    host = f"sns.{SNS_REGION}.amazonaws.com"
    cases: list[tuple[str, tuple[dict[str, str], bytes], int]] = [
        # not an SNS message: 400
        ("body not JSON", _raw(b"{\"Type\": \"Notification\""), 400),
        ("body not UTF-8", _raw(b"\xff\xfe"), 400),
        ("empty body", _raw(b""), 400),
        ("a JSON array", _raw([good]), 400),
        ("no Type", _raw({k: v for k, v in sign_sns(good, signer).items() if k != "Type"}),
         400),
        ("an unknown Type", _signed(good, signer, Type="Alert"), 400),
        ("a Type that is not a string", _signed(good, signer, Type=["Notification"]), 400),
        ("raw message delivery (the SES record alone)", _raw(record), 400),
        # unsigned: 401
        ("no Signature", _signed(good, signer, Signature=None), 401),
        ("no SigningCertURL", _signed(good, signer, SigningCertURL=None), 401),
        ("no SignatureVersion", _signed(good, signer, SignatureVersion=None), 401),
        ("empty Signature", _signed(good, signer, Signature=""), 401),
        # not ours, or not verified: 403
        ("another topic, validly signed",
         _signed(notification(record, NOW, topic_arn=OTHER_TOPIC), signer), 403),
        ("no TopicArn", _signed(good, signer, TopicArn=None), 403),
        ("a TopicArn that is not a string", _signed(good, signer, TopicArn=["x"]), 403),
        ("signed by a key that is not the certificate's", _signed(good, stranger), 403),
        ("Message changed after signing", _signed(good, signer, Message=json.dumps(
            ses_event("Delivery", [ANN], delivery_detail([ANN])))), 403),
        ("MessageId changed after signing", _signed(good, signer, MessageId="other"), 403),
        ("TopicArn changed after signing, to ours",
         _signed(notification(record, NOW, topic_arn=OTHER_TOPIC), signer,
                 TopicArn=TOPIC_ARN), 403),
        ("Type changed after signing", _signed(confirm, signer, Type="UnsubscribeConfirmation"),
         403),
        ("version 1 signature announced as version 2",
         _signed(good, signer, "1", SignatureVersion="2"), 403),
        ("version 2 signature announced as version 1",
         _signed(good, signer, "2", SignatureVersion="1"), 403),
        ("SignatureVersion 3", _signed(good, signer, SignatureVersion="3"), 403),
        ("Signature not base64", _signed(good, signer, Signature="not base64!"), 403),
        ("Signature of other bytes", _signed(good, signer, Signature=base64.b64encode(
            b"x" * 256).decode()), 403),
        ("SigningCertURL over http", _signed(good, signer, SigningCertURL=signer.url.replace(
            "https://", "http://")), 403),
        ("SigningCertURL on another host", _signed(
            good, signer, SigningCertURL="https://evil.example.com/SimpleNotificationService-"
                                         "x.pem"), 403),
        ("SigningCertURL on a look-alike host", _signed(
            good, signer, SigningCertURL=signer.url.replace(host, host + ".evil.example.com")),
         403),
        ("SigningCertURL with user info", _signed(
            good, signer, SigningCertURL=f"https://{host}@evil.example.com/x.pem"), 403),
        ("SigningCertURL on another port", _signed(
            good, signer, SigningCertURL=signer.url.replace(host, host + ":8443")), 403),
        ("SigningCertURL not a .pem", _signed(
            good, signer, SigningCertURL=f"https://{host}/?Action=Unsubscribe"), 403),
        ("SigningCertURL on s3 of amazonaws.com", _signed(
            good, signer, SigningCertURL="https://s3.amazonaws.com/bucket/x.pem"), 403),
        ("Timestamp too old", _signed(notification(record, NOW - TOLERANCE_SECONDS - 1,
                                                   message_id=SNS_ID), signer), 403),
        ("Timestamp from the future", _signed(notification(
            record, NOW + TOLERANCE_SECONDS + 1, message_id=SNS_ID), signer), 403),
        ("Timestamp not a time", _signed({**good, "Timestamp": "yesterday"}, signer), 403),
        ("SubscribeURL on another host", _signed(
            {**confirm, "SubscribeURL": "https://evil.example.com/?Action=ConfirmSubscription"},
            signer), 403),
        ("SubscribeURL over http", _signed(
            {**confirm, "SubscribeURL": confirm["SubscribeURL"].replace("https", "http", 1)},
            signer), 403),
        ("a confirmation from another topic", _signed(
            confirmation(NOW, topic_arn=OTHER_TOPIC), signer), 403),
        # verified, but not what SES sends: 400
        ("no MessageId", _signed({k: v for k, v in good.items() if k != "MessageId"}, signer),
         400),
        ("no Message", _signed({k: v for k, v in good.items() if k != "Message"}, signer), 400),
        ("a confirmation without Token", _signed(
            {k: v for k, v in confirm.items() if k != "Token"}, signer), 400),
        ("Message not JSON", _signed(notification("hello", NOW), signer), 400),
        ("Message a JSON array", _signed(notification("[]", NOW), signer), 400),
        ("Message without mail", _signed(notification({"eventType": "Bounce"}, NOW), signer),
         400),
        ("Message without a type", _signed(notification({"mail": {}}, NOW), signer), 400),
    ]
    return cases


#: How many bad requests test_every_bad_input_is_refused tries (the report counts them).
REFUSAL_CASES = 45


def test_every_bad_input_is_refused(receiver: SESReceiver, signer: SNSSigner) -> None:
    stranger = SNSSigner(sns_signer().key, signer.pem, signer.url)
    cases = _bad_inputs(signer, stranger)
    assert len(cases) == REFUSAL_CASES
    for name, (headers, body), status in cases:
        with pytest.raises(WebhookRefused) as refused:
            _receive(receiver, headers, body)
        assert refused.value.status == status, (name, refused.value)
        signature = json.loads(body).get("Signature") if status != 400 else None
        assert not signature or signature not in refused.value.reason, name


def test_a_bad_certificate_url_is_refused_before_any_fetch(signer: SNSSigner) -> None:
    fetched: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        fetched.append(str(request.url))
        return httpx.Response(200, content=signer.pem)
    with httpx.Client(transport=httpx.MockTransport(record)) as client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=SNSCertificates(client))
        for url in ("http://evil.example.com/x.pem", "https://evil.example.com/x.pem",
                    f"https://sns.{SNS_REGION}.amazonaws.com.evil.example.com/x.pem"):
            headers, body = _signed(notification({"mail": {}}, NOW), signer,
                                    SigningCertURL=url)
            with pytest.raises(WebhookRefused) as refused:
                _receive(receiver, headers, body)
            assert refused.value.status == 403
        headers, body = _signed(notification({"mail": {}}, NOW), signer,
                                TopicArn=OTHER_TOPIC)
        with pytest.raises(WebhookRefused):
            _receive(receiver, headers, body)
    assert fetched == []


def test_a_certificate_outside_its_dates_is_refused(certificates: SNSCertificates) -> None:
    expired = sns_signer(f"https://sns.{SNS_REGION}.amazonaws.com/"
                         "SimpleNotificationService-expired.pem",
                         valid_until=datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC))
    certificates.trust(expired.url, expired.pem)
    receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
    record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
    with pytest.raises(WebhookRefused) as refused:
        _receive(receiver, *webhook_request(record, expired, NOW))
    assert refused.value.status == 403 and "validity" in refused.value.reason


def test_a_certificate_without_an_rsa_key_is_refused(
        certificates: SNSCertificates, signer: SNSSigner) -> None:
    url = f"https://sns.{SNS_REGION}.amazonaws.com/SimpleNotificationService-ec.pem"
    certificates.trust(url, _certificate("sns.amazonaws.com")[1])
    receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
    record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
    headers, body = _signed(notification(record, NOW), signer, SigningCertURL=url)
    with pytest.raises(WebhookRefused) as refused:
        _receive(receiver, headers, body)
    assert refused.value.status == 403 and "RSA" in refused.value.reason


BAD_TOPICS: list[Any] = [
    None, "", 42, [], (), "my-topic", "arn:aws:sqs:us-east-1:123456789012:queue",
    "arn:aws:sns:us-east-1:12345678901:topic", "arn:aws:sns:us-east-1:123456789012:",
    "arn:aws:sns:us-east-1:123456789012:topic name", "arn:aws:sns::123456789012:topic",
    "arn:aws-xx:sns:us-east-1:123456789012:topic", " " + TOPIC_ARN,
    [TOPIC_ARN, "arn:aws:sns:us-east-1:123456789012"], {"arn": TOPIC_ARN},
]


@pytest.mark.parametrize("bad", BAD_TOPICS, ids=repr)
def test_a_secret_that_is_not_a_topic_arn_is_a_config_error(bad: Any) -> None:
    key = 'OUTBOX_TRANSPORTS["ses"]["webhook_secret"]'
    with pytest.raises(ConfigError) as error:
        SESReceiver.check_secret(bad, key)
    assert error.value.key == key
    assert not isinstance(bad, str) or not bad.strip() or bad not in error.value.problem
    with pytest.raises(ConfigError):
        SESReceiver("ses", bad)


def test_topic_arns_of_every_partition_are_accepted() -> None:
    for topic in (TOPIC_ARN, "arn:aws-cn:sns:cn-north-1:123456789012:events",
                  "arn:aws-us-gov:sns:us-gov-west-1:123456789012:ses_events-1"):
        SESReceiver.check_secret(topic, "key")
    SESReceiver.check_secret([TOPIC_ARN, OTHER_TOPIC], "key")


@pytest.mark.parametrize(("url", "allowed"), [
    (SIGNING_CERT_URL, True),
    ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
    ("https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-abc.pem", True),
    ("https://sns.us-gov-west-1.amazonaws.com/SimpleNotificationService-abc.pem", True),
    ("https://SNS.US-EAST-1.AMAZONAWS.COM/SimpleNotificationService-abc.pem", True),
    ("https://sns.us-east-1.amazonaws.com:443/SimpleNotificationService-abc.pem", True),
    ("http://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", False),
    ("https://sns.amazonaws.com/SimpleNotificationService-abc.pem", False),
    ("https://sns.us-east-1.amazonaws.com.evil.com/x.pem", False),
    ("https://evil.com/sns.us-east-1.amazonaws.com/x.pem", False),
    ("https://sqs.us-east-1.amazonaws.com/x.pem", False),
    ("https://sns.us_east_1.amazonaws.com/x.pem", False),
    ("https://sns.us-east-1.amazonaws.com:99999/x.pem", False),
    ("https://[::1/x.pem", False),
    ("https://sns.us-east-1.amazonaws.com/x.txt", False),
    (None, False),
    # An S3 bucket's virtual host, which anyone can create (issue 36).
    ("https://sns.s3.amazonaws.com/SimpleNotificationService-abc.pem", False),
    ("https://sns.s3-website.amazonaws.com/SimpleNotificationService-abc.pem", False),
    # Any other path on the SNS host.
    ("https://sns.us-east-1.amazonaws.com/x.pem", False),
    ("https://sns.us-east-1.amazonaws.com/a/SimpleNotificationService-abc.pem", False),
    ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem?x=.pem", False),
    ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem#", False),
    # What urlsplit drops silently and the HTTP client refuses (issue 36: a 500).
    ("https://sns.us-east-1.amazonaws.com/SimpleNotification\tService-abc.pem", False),
    ("https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem\n", False),
    ("https://user@sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem", False),
])
def test_the_certificate_url_rule(url: Any, allowed: bool) -> None:
    assert sns_url_allowed(url, pem=True) is allowed


# -- the certificate fetch ---------------------------------------------------------------


def _mock(handler: Callable[[httpx.Request], httpx.Response]) -> tuple[SNSCertificates,
                                                                       httpx.Client]:
    client = httpx.Client(transport=httpx.MockTransport(handler))
    return SNSCertificates(client), client


def test_a_fetched_certificate_is_cached(signer: SNSSigner) -> None:
    fetched: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        fetched.append(str(request.url))
        return httpx.Response(200, content=signer.pem)
    certificates, client = _mock(serve)
    with client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
        record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
        for _ in range(3):
            assert _receive(receiver, *webhook_request(record, signer, NOW)).events
    assert fetched == [signer.url]


def test_the_cache_expires_and_is_bounded(signer: SNSSigner) -> None:
    fetched: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        fetched.append(request.url.path)
        return httpx.Response(200, content=signer.pem)
    with httpx.Client(transport=httpx.MockTransport(serve)) as client:
        expiring = SNSCertificates(client, ttl=0.0)
        expiring.get(signer.url)
        expiring.get(signer.url)
        assert len(fetched) == 2
        fetched.clear()
        bounded = SNSCertificates(client, max_entries=2)
        urls = [f"https://sns.{SNS_REGION}.amazonaws.com/SimpleNotificationService-{n}.pem"
                for n in range(3)]
        for url in [*urls, urls[2], urls[1], urls[0]]:
            bounded.get(url)
        assert [path.removeprefix("/SimpleNotificationService-") for path in fetched] == [
            "0.pem", "1.pem", "2.pem", "0.pem"]


def test_a_trusted_certificate_is_never_fetched_and_wins(signer: SNSSigner) -> None:
    other = sns_signer()

    def serve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=other.pem)
    certificates, client = _mock(serve)
    with client:
        certificates.trust(signer.url, signer.pem.decode())
        assert certificates.get(signer.url) == x509.load_pem_x509_certificate(signer.pem)


@pytest.mark.parametrize("answer", [
    httpx.Response(404, content=b"<Error><Code>NoSuchKey</Code></Error>"),
    httpx.Response(500),
    httpx.Response(301, headers={"Location": "https://evil.example.com/x.pem"}),
    httpx.Response(200, content=b"not a certificate"),
    httpx.Response(200, content=b"x" * (64 * 1024 + 1)),
], ids=["404", "500", "redirect", "not PEM", "too large"])
def test_a_certificate_that_cannot_be_had_is_a_503(signer: SNSSigner,
                                                   answer: httpx.Response) -> None:
    certificates, client = _mock(lambda request: answer)
    with client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
        record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
        with pytest.raises(WebhookRefused) as refused:
            _receive(receiver, *webhook_request(record, signer, NOW))
    assert refused.value.status == 503 and "SNS will retry" in refused.value.reason


def test_a_network_failure_is_a_503(signer: SNSSigner) -> None:
    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)
    certificates, client = _mock(fail)
    with client:
        with pytest.raises(CertificateUnavailable):
            certificates.get(signer.url)
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
        with pytest.raises(WebhookRefused) as refused:
            _receive(receiver, *webhook_request(ses_event("Send", [ANN], {}), signer, NOW))
    assert refused.value.status == 503


def test_concurrent_requests_share_the_cache(signer: SNSSigner) -> None:
    fetched: list[str] = []
    lock = threading.Lock()

    def serve(request: httpx.Request) -> httpx.Response:
        with lock:
            fetched.append(str(request.url))
        return httpx.Response(200, content=signer.pem)
    certificates, client = _mock(serve)
    results: list[int] = []
    with client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=certificates)
        record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
        certificates.get(signer.url)

        def post() -> None:
            for _ in range(20):
                results.append(len(_receive(receiver, *webhook_request(record, signer,
                                                                       NOW)).events))
        threads = [threading.Thread(target=post) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [1] * 160 and fetched == [signer.url]


# -- the certificate fetch over real TLS -------------------------------------------------


def _certificate(common_name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey]
                 | None = None, *, ca: bool = False,
                 ) -> tuple[ec.EllipticCurvePrivateKey, bytes, x509.Certificate]:
    """An EC key and its certificate for ``common_name``, self-signed or by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, signing_key = (issuer[0].subject, issuer[1]) if issuer else (name, key)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
               .not_valid_after(datetime.datetime(2040, 1, 1, tzinfo=datetime.UTC))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
    certificate = builder.sign(signing_key, hashes.SHA256())
    return key, certificate.public_bytes(serialization.Encoding.PEM), certificate


class _Loopback(httpx.BaseTransport):
    """Connects to 127.0.0.1:``port`` whatever the URL's host, keeping it for SNI and TLS."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self.port = port
        self.inner = httpx.HTTPTransport(verify=context)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        request.url = request.url.copy_with(host="127.0.0.1", port=self.port)
        request.extensions = {**request.extensions, "sni_hostname": host}
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def sns_https(tmp_path: Path, signer: SNSSigner) -> Iterator[tuple[int, bytes, list[str]]]:
    """An HTTPS server on a loopback port, as sns.<region>.amazonaws.com, serving the
    signer's certificate; yields (port, the authority's PEM, the paths requested)."""
    ca_key, ca_pem, ca = _certificate("Outbox Test Root CA", ca=True)
    key, pem, _ = _certificate(f"sns.{SNS_REGION}.amazonaws.com", (ca, ca_key))
    (tmp_path / "server.pem").write_bytes(pem)
    (tmp_path / "server.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    requested: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            body = signer.pem if self.path.endswith(".pem") else b"not found"
            self.send_response(200 if self.path.endswith(".pem") else 404)
            self.send_header("Content-Type", "application/x-pem-file")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], ca_pem, requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_certificate_is_fetched_over_verified_tls(
        sns_https: tuple[int, bytes, list[str]], signer: SNSSigner) -> None:
    port, ca_pem, requested = sns_https
    context = ssl.create_default_context(cadata=ca_pem.decode())
    with httpx.Client(transport=_Loopback(port, context), timeout=5.0) as client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=SNSCertificates(client))
        record = ses_event("Bounce", [ANN], bounce_detail([(ANN, "5.1.1", "smtp; 550")]))
        for version in ("1", "2"):
            [event] = _receive(receiver, *webhook_request(record, signer, NOW,
                                                          version=version)).events
            assert (event.event_type, event.bounce_kind) == ("bounced", "permanent")
        confirm = sign_sns(confirmation(NOW), signer)
        assert _receive(receiver, *sns_request(confirm)).confirm_url == confirm["SubscribeURL"]
    assert requested == [SIGNING_CERT_URL.split(".com", 1)[1]]


def test_a_server_whose_tls_certificate_is_not_trusted_is_a_503(
        sns_https: tuple[int, bytes, list[str]], signer: SNSSigner) -> None:
    """The system's trust store does not know the test's authority: TLS fails, nothing read."""
    port, _, requested = sns_https
    with httpx.Client(transport=_Loopback(port, ssl.create_default_context()),
                      timeout=5.0) as client:
        receiver = SESReceiver("ses", TOPIC_ARN, certificates=SNSCertificates(client))
        record = ses_event("Delivery", [ANN], delivery_detail([ANN]))
        with pytest.raises(WebhookRefused) as refused:
            _receive(receiver, *webhook_request(record, signer, NOW))
    assert refused.value.status == 503 and "ConnectError" in refused.value.reason
    assert requested == []


def test_a_tls_name_that_is_not_the_url_host_is_a_503(
        sns_https: tuple[int, bytes, list[str]], signer: SNSSigner) -> None:
    """A certificate for sns.<region> does not serve sns.<another region>."""
    port, ca_pem, requested = sns_https
    context = ssl.create_default_context(cadata=ca_pem.decode())
    other = "us-west-2" if SNS_REGION != "us-west-2" else "us-east-1"
    url = f"https://sns.{other}.amazonaws.com/SimpleNotificationService-0.pem"
    with httpx.Client(transport=_Loopback(port, context), timeout=5.0) as client, \
            pytest.raises(CertificateUnavailable):
        SNSCertificates(client).get(url)
    assert requested == []


def test_the_default_client_is_made_once_and_closed() -> None:
    certificates = SNSCertificates()
    client = certificates._http()
    assert certificates._http() is client and not client.is_closed
    certificates.close()
    assert client.is_closed
