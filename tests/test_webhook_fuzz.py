"""Fuzzing the five webhook routes with hypothesis, through Flask, on both databases.

Adversarial bodies (nesting thousands deep, huge numbers, times past the year
9999, NUL, lone surrogates, HTML, wrong types in every field) are posted
unsigned and signed as each provider signs. Whatever they hold:

* the answer is 200, 400, 401 or 403: never a 500, never a 503 (a 503 tells the
  provider to send the same poison again for hours);
* each request takes well under a second (every parser is linear);
* a refused request writes nothing (events, suppressions, nonces);
* an unsigned request is always refused.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from conftest import MakeApps
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webhooks_helpers import KINDS, TRANSPORTS, post, sign, written

#: Per kind and database; five kinds, two databases, about 20 s in all.
FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
#: The longest one request may take (seconds): the slowest seen is under 0.2.
BOUND = 2.0

HOSTILE_PIECES = st.sampled_from([
    "\x00", "\ud800", "\udfff", "<script>alert(1)</script>", "\r\n", "\x1b[2J", "\u202e",
    "a@example.com", "A@EXAMPLE.COM", "@", "<", ">", "\"", "\\", "e0", "nan", "inf", " ",
    "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "2024-02-30T00:00:00Z",
    "((((((((((", "\t", "é", "\U0001f4a9", "%00", "\ufeff"])
TEXT = st.one_of(
    st.lists(st.one_of(HOSTILE_PIECES, st.text(max_size=10)), max_size=12).map("".join),
    st.text(st.characters(codec=None, categories=None), max_size=40),
    st.integers(1, 5000).map(lambda n: "(" * n),
    st.integers(1, 3000).map(lambda n: "a" * n + "@example.com"),
)
NUMBER = st.one_of(st.integers(-(10 ** 300), 10 ** 300), st.floats(allow_nan=False),
                   st.sampled_from([0, -1, 2 ** 63, 1e308, -1e308, 253402300800,
                                    -62135596801, 1.5e-320]))
LEAF = st.one_of(TEXT, NUMBER, st.booleans(), st.none(),
                 st.lists(TEXT, max_size=3), st.dictionaries(TEXT, TEXT, max_size=2))
JSON = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(TEXT, inner, max_size=4)),
                    max_leaves=20)


def some(**fields: Any) -> st.SearchStrategy[dict[str, Any]]:
    """A dict with any of ``fields`` (each a strategy), the rest left out."""
    return st.fixed_dictionaries({}, optional=fields)


def named(*names: str) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(names), LEAF)


SHAPES: dict[str, st.SearchStrategy[Any]] = {
    "postmark": some(
        RecordType=named("Bounce", "Delivery", "SpamComplaint", "Open", "Click",
                         "SubscriptionChange", "Inbound"),
        MessageID=LEAF, Email=LEAF, Recipient=LEAF, Type=named("HardBounce", "SpamComplaint"),
        TypeCode=LEAF, ID=LEAF, BouncedAt=LEAF, DeliveredAt=LEAF, ReceivedAt=LEAF,
        ChangedAt=LEAF, Details=LEAF, Description=LEAF, SuppressSending=LEAF,
        SuppressionReason=LEAF, Origin=LEAF, OriginalLink=LEAF, Metadata=JSON),
    "sendgrid": st.lists(some(
        event=named("bounce", "delivered", "dropped", "deferred", "open", "click",
                    "spamreport", "unsubscribe", "group_unsubscribe"),
        email=LEAF, timestamp=LEAF, sg_event_id=LEAF, sg_message_id=LEAF, reason=LEAF,
        type=named("bounce", "blocked"), response=LEAF, url=LEAF, attempt=LEAF,
        asm_group_id=LEAF, bounce_classification=LEAF, extra=JSON), max_size=5),
    "mailgun": some(
        event=named("failed", "delivered", "rejected", "opened", "clicked", "complained",
                    "unsubscribed"),
        timestamp=LEAF, id=LEAF, recipient=LEAF, severity=named("permanent", "temporary"),
        reason=named("suppress-bounce", "old", "generic"), url=LEAF,
        reject=some(reason=LEAF),
        **{"delivery-status": some(code=LEAF, message=LEAF, description=LEAF),
           "message": some(headers=some(**{"message-id": LEAF, "to": LEAF}))}),
    "resend": some(
        type=named("email.bounced", "email.delivered", "email.complained", "email.clicked",
                   "email.failed", "email.suppressed"),
        created_at=LEAF,
        data=some(email_id=LEAF, to=st.one_of(LEAF, st.lists(LEAF, max_size=4)),
                  bounce=some(type=named("Permanent", "Transient"), subType=LEAF,
                              message=LEAF, diagnosticCode=LEAF),
                  click=some(link=LEAF), failed=some(reason=LEAF),
                  suppressed=some(type=LEAF, message=LEAF))),
    "ses": some(
        eventType=named("Bounce", "Complaint", "Delivery", "DeliveryDelay", "Reject",
                        "Open", "Click", "Subscription", "Rendering Failure"),
        notificationType=LEAF,
        mail=some(messageId=LEAF, timestamp=LEAF, destination=st.lists(LEAF, max_size=3)),
        bounce=some(bounceType=named("Permanent", "Transient"), bounceSubType=LEAF,
                    timestamp=LEAF, bouncedRecipients=st.lists(some(
                        emailAddress=LEAF, status=LEAF, diagnosticCode=LEAF), max_size=3)),
        complaint=some(complainedRecipients=st.lists(some(emailAddress=LEAF), max_size=3),
                       complaintFeedbackType=LEAF, timestamp=LEAF),
        delivery=some(recipients=st.lists(LEAF, max_size=3), smtpResponse=LEAF,
                      timestamp=LEAF),
        deliveryDelay=some(delayType=LEAF, delayedRecipients=LEAF, timestamp=LEAF),
        subscription=some(contactList=LEAF, newTopicPreferences=some(unsubscribeAll=LEAF))),
}

# Text that is not what json.dumps writes: nesting, numbers, broken JSON.
RAW = st.one_of(
    st.integers(60, 60_000).map(lambda n: "[" * n + "]" * n),
    st.integers(60, 30_000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(60, 100_000).map(lambda n: "[" * n),
    st.integers(60, 100_000).map(lambda n: '"' + "\\" * n),
    st.integers(4300, 200_000).map(lambda n: "[" + "9" * n + "]"),
    st.integers(1, 100_000).map(lambda n: "[1e" + "9" * min(n, 5000) + "]"),
    st.sampled_from(["NaN", "[Infinity]", '{"timestamp": -Infinity}', "", "null", "\ufeff{}",
                     '"\\ud800"', "[\"\x00\"]", '{"a": "\\u0000"}', "[1,]", "{'a': 1}"]),
    st.text(st.characters(codec=None, categories=None), max_size=200),
)


def body_text(kind: str, shaped: Any, raw: str | None) -> str:
    """JSON text for ``kind``: a raw adversarial text, or the shaped value (surrogates
    escaped, as providers' JSON encoders write them)."""
    if raw is not None:
        return raw
    return json.dumps(shaped)


def check(app: Flask, kind: str, headers: dict[str, str], body: bytes,
          allowed: tuple[int, ...]) -> None:
    before = written(app)
    start = time.perf_counter()
    response = post(app, kind, headers, body)
    took = time.perf_counter() - start
    assert response.status_code in allowed, (response.status_code,
                                             response.get_data(as_text=True)[:300])
    assert took < BOUND, f"{took:.2f} s for {len(body)} bytes"
    if response.status_code != 200:
        assert written(app) == before


@pytest.fixture
def app(make_apps: MakeApps) -> Flask:
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS=TRANSPORTS)
    return app


@pytest.mark.parametrize("kind", KINDS)
def test_signed_hostile_events_never_answer_5xx(app: Flask, kind: str) -> None:
    @FUZZ
    @given(shaped=SHAPES[kind], raw=st.one_of(st.none(), st.none(), RAW))
    def run(shaped: Any, raw: str | None) -> None:
        check(app, kind, *sign(kind, body_text(kind, shaped, raw)), (200, 400, 403))

    run()


UNSIGNED_HEADERS = st.one_of(
    st.just({"Content-Type": "application/json"}),
    st.fixed_dictionaries({}, optional={
        "Authorization": st.sampled_from(["Basic", "Basic !!!", "Basic dTpw", "Bearer x",
                                          "Basic " + "A" * 10_000]),
        "X-Twilio-Email-Event-Webhook-Signature": st.sampled_from(["", "MEUCIQ==", "x" * 500]),
        "X-Twilio-Email-Event-Webhook-Timestamp": st.sampled_from(["nan", "1e999", "-1", "0"]),
        "svix-id": st.sampled_from(["msg_1", "x" * 1000]),
        "svix-timestamp": st.sampled_from(["nan", "inf", "9" * 400, "1"]),
        "svix-signature": st.sampled_from(["v1,", "v1,AAAA v2,BBBB", "v1," + "A" * 5000]),
    }))


@pytest.mark.parametrize("kind", KINDS)
def test_unsigned_hostile_requests_are_refused_and_write_nothing(app: Flask,
                                                                 kind: str) -> None:
    @FUZZ
    @given(shaped=SHAPES[kind], raw=st.one_of(st.none(), RAW), headers=UNSIGNED_HEADERS)
    def run(shaped: Any, raw: str | None, headers: dict[str, str]) -> None:
        text = body_text(kind, shaped, raw)
        if kind == "mailgun" and raw is None:  # a signature block that is not Mailgun's
            text = json.dumps({"signature": {"timestamp": str(int(time.time())),
                                             "token": "a" * 50, "signature": "0" * 64},
                               "event-data": shaped})
        if kind == "ses" and raw is None:  # an SNS message with a forged signature
            text = json.dumps({"Type": "Notification", "MessageId": "m",
                               "TopicArn": TRANSPORTS["ses"]["webhook_secret"],
                               "Message": json.dumps(shaped), "Timestamp": "2030-01-01T00:00:00Z",
                               "SignatureVersion": "2", "Signature": "AAAA",
                               "SigningCertURL": "https://sns.us-east-1.amazonaws.com/"
                                                 "SimpleNotificationService-forged.pem"})
        check(app, kind, headers, text.encode("utf-8", "surrogatepass"), (400, 401, 403))

    run()
