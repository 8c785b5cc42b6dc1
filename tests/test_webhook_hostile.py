"""Issue 36's webhook defects, each through the real route, on SQLite and PostgreSQL.

3. a NUL in an event field (PostgreSQL refused it: 503 for ever, a whole batch lost);
4. inputs that answered 500: deep JSON, timestamps past the year 9999 in UTC, a TAB
   in SNS's certificate URL, a lone surrogate;
5. Mailgun's replay with the timestamp/token split moved (``"e0"``);
11. a signed ``nan`` timestamp, the SNS certificate host and path, SNS fetches for
    unverified requests, SignatureVersion 1 refusable, recipients that are not
    addresses, events matched across transports.

Every refused request writes nothing (events, suppressions, nonces).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import provider_mailgun
import provider_postmark
import provider_resend
import provider_sendgrid
import provider_ses
import pytest
import sqlalchemy as sa
from conftest import MakeApps, db
from flask import Flask
from webhooks_helpers import (
    TRANSPORTS,
    post,
    sign,
    sign_postmark,
    sign_resend,
    sign_sendgrid,
    sign_ses,
    written,
)

from flask_mail_outbox import OutboxMail
from flask_mail_outbox._errors import ConfigError
from flask_mail_outbox._events import PAYLOAD_LIMIT, capped_payload
from flask_mail_outbox._webhooks import WebhookRefused, WebhookRequest
from flask_mail_outbox._webhooks._base import bounded_json, json_depth
from flask_mail_outbox._webhooks.ses import (
    CertificateUnavailable,
    SESReceiver,
    SNSCertificates,
)
from flask_mail_outbox.core import email_table

DEEP = "[" * 2000 + "]" * 2000
FAR = "9999-12-31T23:59:59-23:59"


@pytest.fixture
def app(make_apps: MakeApps) -> Flask:
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS=TRANSPORTS)
    return app


def refused(app: Flask, kind: str, headers: dict[str, str], body: bytes,
            statuses: tuple[int, ...] = (400, 401, 403)) -> int:
    before = written(app)
    response = post(app, kind, headers, body)
    assert response.status_code in statuses, response.get_data(as_text=True)
    assert written(app) == before
    return int(response.status_code)


# -- defect 3: a NUL in any field ------------------------------------------------------


def test_a_nul_in_one_event_of_a_sendgrid_batch_of_1000_stores_all_1000(app: Flask) -> None:
    now = time.time()
    events = [provider_sendgrid.webhook_event("delivered", f"msg{n}", f"user{n}@example.com",
                                              int(now), event_id=f"ev{n}")
              for n in range(1000)]
    events[500] = provider_sendgrid.webhook_event(
        "bounce", "msg\x00500", "bad\x00user@example.com", int(now), event_id="ev\x00500",
        reason="550 5.1.1 no such\x00user", type="bounce")
    response = post(app, "sendgrid", *sign_sendgrid(json.dumps(events).encode(), now))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json()["accepted"] == 1000
    with app.app_context(), db.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT recipient, description, mta_response, payload, "
                                    "provider_event_id FROM outbox_event WHERE event_type = "
                                    "'bounced'")).all()
    [(recipient, description, mta_response, payload, event_id)] = rows
    # Not an address: no recipient, so no suppression; the text kept, made safe.
    assert recipient is None and "bad\ufffduser@example.com" in description
    assert mta_response == "550 5.1.1 no such\ufffduser"
    assert "\x00" not in payload and "\\u0000" in payload
    assert "\x00" not in event_id
    assert written(app)[1] == 0


@pytest.mark.parametrize("kind", ["postmark", "mailgun", "resend", "ses"])
def test_a_nul_in_every_field_of_a_signed_event_is_stored_cleaned(app: Flask,
                                                                   kind: str) -> None:
    nul = "x\x00y"
    payloads = {
        "postmark": {**provider_postmark.bounce_record(nul, "a\x00@example.com",
                                                       description=nul), "Details": nul},
        "mailgun": provider_mailgun.webhook_event("failed", nul, "a\x00@example.com",
                                                  time.time(), event_id=nul,
                                                  severity="permanent", reason=nul),
        "resend": provider_resend.resend_event(
            "email.bounced", email_id=nul, to=["a\x00@example.com"],
            bounce={"type": "Permanent", "subType": nul, "message": nul,
                    "diagnosticCode": [nul]}),
        "ses": provider_ses.ses_event("Bounce", ["a\x00@example.com"],
                                      provider_ses.bounce_detail([("a\x00@example.com", nul,
                                                                   nul)]),
                                      message_id=nul),
    }
    response = post(app, kind, *sign(kind, json.dumps(payloads[kind])))
    assert response.status_code == 200, response.get_data(as_text=True)
    with app.app_context(), db.engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.text(
            "SELECT recipient, description, mta_response, payload FROM outbox_event"))]
    assert rows and all("\x00" not in (v or "") for row in rows for v in row)
    assert all(row[0] is None for row in rows)
    assert written(app)[1] == 0  # no suppression keyed by a NUL


def test_a_permanent_bounce_naming_html_suppresses_nobody(app: Flask) -> None:
    record = provider_postmark.bounce_record("m1", "<script>alert(1)</script>@example.com")
    response = post(app, "postmark", *sign_postmark(json.dumps(record).encode()))
    assert response.status_code == 200
    assert written(app)[:2] == (1, 0)  # the event kept, no suppression


# -- defect 4: what answered 500 ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["postmark", "sendgrid", "mailgun", "resend", "ses"])
def test_json_nested_2000_deep_is_400(app: Flask, kind: str) -> None:
    # Unsigned (Mailgun and SES parse before they verify) and signed.
    refused(app, kind, {"Content-Type": "application/json"}, DEEP.encode())
    assert refused(app, kind, *sign(kind, DEEP)) == 400
    if kind in ("sendgrid", "postmark", "resend"):
        assert refused(app, kind, *sign(kind, f'[{{"a": {DEEP}}}]')) == 400


def test_a_body_of_nan_and_huge_numbers_is_400(app: Flask) -> None:
    for body in ("[NaN]", '[{"timestamp": Infinity}]', "[" + "9" * 5000 + "]"):
        assert refused(app, "sendgrid", *sign("sendgrid", body)) == 400


def test_a_time_past_9999_in_utc_is_refused(app: Flask) -> None:
    # SES: the SNS Timestamp, checked before the signature.
    headers, body = sign_ses(json.dumps(provider_ses.ses_event("Delivery", ["a@example.com"])))
    message = json.loads(body)
    message["Timestamp"] = FAR
    assert refused(app, "ses", headers, json.dumps(message).encode()) == 403
    # Postmark: an event's own time.
    record = provider_postmark.delivery_record("m1", "a@example.com", delivered_at=FAR)
    assert refused(app, "postmark", *sign_postmark(json.dumps(record).encode())) == 400
    # Resend: the event's created_at is not needed (the signed time stands in).
    event = provider_resend.resend_event("email.delivered", created_at=FAR)
    assert post(app, "resend", *sign_resend(json.dumps(event).encode())).status_code == 200
    # SES: an event's timestamp (the notification's stands in).
    ses = provider_ses.ses_event("Delivery", ["a@example.com"],
                                 {**provider_ses.delivery_detail(["a@example.com"]),
                                  "timestamp": FAR})
    assert post(app, "ses", *sign_ses(json.dumps(ses))).status_code == 200


@pytest.mark.parametrize("url", [
    "https://sns.us-east-1.amazonaws.com/SimpleNotification\tService-abc.pem",
    "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-abc.pem\n",
    "https://sns.s3.amazonaws.com/SimpleNotificationService-abc.pem",
    "https://sns.us-east-1.amazonaws.com/bucket/x.pem",
])
def test_a_bad_signing_cert_url_is_403_before_any_fetch(app: Flask, url: str) -> None:
    headers, body = sign_ses(json.dumps(provider_ses.ses_event("Delivery", ["a@example.com"])))
    message = {**json.loads(body), "SigningCertURL": url}
    assert refused(app, "ses", headers, json.dumps(message).encode()) == 403


def test_a_lone_surrogate_in_a_postmark_field_is_stored_cleaned(app: Flask) -> None:
    record = provider_postmark.bounce_record("m\ud8001", "a@example.com",
                                             description="bad \udc00 text")
    body = json.dumps(record).encode()  # ASCII: the surrogate as its \\u escape
    assert b"\\udc00" in body
    response = post(app, "postmark", *sign_postmark(body))
    assert response.status_code == 200, response.get_data(as_text=True)
    with app.app_context():
        mail: OutboxMail = app.extensions["test_mail"]
        assert mail.suppression("a@example.com") is not None
    with app.app_context(), db.engine.connect() as conn:
        (description, payload) = conn.execute(sa.text(
            "SELECT description, payload FROM outbox_event")).one()
    assert "bad \ufffd text" in description and "\\udc00" in payload


# -- defect 5: Mailgun's replay with the split moved ---------------------------------------


def test_mailgun_refuses_the_signature_reused_with_the_split_moved(app: Flask) -> None:
    now = time.time()
    token = "e0" + "5" * 48  # one captured token in 256 starts so
    data = provider_mailgun.webhook_event("delivered", "m1", "a@example.com", now)
    headers, body = provider_mailgun.webhook_request(data, provider_mailgun.WEBHOOK_SIGNING_KEY,
                                                     now, token)
    assert post(app, "mailgun", headers, body).status_code == 200
    replay = json.loads(body)
    replay["signature"]["timestamp"] += "e0"          # float("1700000000e0") == 1700000000.0
    replay["signature"]["token"] = token[2:]          # the same HMAC input, a "new" nonce
    replay["event-data"] = provider_mailgun.webhook_event(
        "failed", "m1", "victim@example.com", now, severity="permanent")
    assert refused(app, "mailgun", headers, json.dumps(replay).encode()) == 403
    with app.app_context():
        mail: OutboxMail = app.extensions["test_mail"]
        assert mail.suppression("victim@example.com") is None
    # Other timestamps that are not digits, and tokens that are not Mailgun's.
    for timestamp, bad_token in ((" 1", token), ("+1", token), ("1.0", token),
                                 (str(int(now)), "short"), (str(int(now)), "a b" * 10)):
        forged = json.loads(body)
        forged["signature"].update(timestamp=timestamp, token=bad_token)
        refused(app, "mailgun", headers, json.dumps(forged).encode())


# -- defect 11 --------------------------------------------------------------------------


@pytest.mark.parametrize("stamp", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_signed_timestamp_that_is_not_finite_is_403(app: Flask, stamp: str) -> None:
    events = json.dumps([provider_sendgrid.webhook_event("delivered", "m", "a@example.com",
                                                         int(time.time()))]).encode()
    assert refused(app, "sendgrid", *sign_sendgrid(events, timestamp=stamp)) == 403
    event = json.dumps(provider_resend.resend_event("email.delivered")).encode()
    assert refused(app, "resend", *sign_resend(event, timestamp=stamp)) == 403


def test_events_match_emails_of_their_own_transport_only(app: Flask) -> None:
    now = time.time()
    with app.app_context(), db.engine.begin() as conn:
        for transport, pid in (("postmark", "shared-id"), ("sendgrid", "other-id")):
            conn.execute(email_table.insert().values(
                status="sent", created_at=sa.func.current_timestamp(),
                due_at=sa.func.current_timestamp(), message_id=f"<{transport}@example.com>",
                sender="s@example.com", recipients='["a@example.com"]', size=1,
                transport=transport, provider_message_id=pid))
    # SendGrid's webhook names Postmark's id: no match. Postmark's does.
    batch = [provider_sendgrid.webhook_event("delivered", "shared-id", "a@example.com",
                                             int(now), event_id="sg1")]
    assert post(app, "sendgrid", *sign_sendgrid(json.dumps(batch).encode(), now)).get_json()[
        "unmatched"] == 1
    record = provider_postmark.delivery_record("shared-id", "a@example.com")
    assert post(app, "postmark", *sign_postmark(json.dumps(record).encode())).get_json()[
        "unmatched"] == 0


def test_an_email_that_failed_over_matches_the_transport_that_sent_it(app: Flask) -> None:
    history = json.dumps([{"code": 503, "message": "down", "at": "2030-01-01T00:00:00Z",
                           "attempt": 1, "transport": "postmark",
                           "failed_over_to": "sendgrid"}])
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(email_table.insert().values(
            status="sent", created_at=sa.func.current_timestamp(),
            due_at=sa.func.current_timestamp(), message_id="<fo@example.com>",
            sender="s@example.com", recipients='["a@example.com"]', size=1,
            transport="postmark", provider_message_id="fo-id", error_history=history))
    now = time.time()
    batch = [provider_sendgrid.webhook_event("delivered", "fo-id", "a@example.com", int(now),
                                             event_id="sg-fo")]
    assert post(app, "sendgrid", *sign_sendgrid(json.dumps(batch).encode(), now)).get_json()[
        "unmatched"] == 0


def test_sns_signature_version_1_can_be_refused() -> None:
    receiver = SESReceiver("ses", {"topics": [provider_ses.TOPIC_ARN],
                                   "signature_versions": ["2"]})
    now = time.time()
    signer = provider_ses.sns_signer()
    receiver.certificates = SNSCertificates()
    receiver.certificates.trust(signer.url, signer.pem)
    record = provider_ses.ses_event("Delivery", ["a@example.com"],
                                    provider_ses.delivery_detail(["a@example.com"]))
    for version, accepted in (("1", False), ("2", True)):
        headers, body = provider_ses.webhook_request(record, signer, now, version=version)
        request = WebhookRequest(headers=headers, body=body, now=now)
        if accepted:
            assert receiver.receive(request).events
        else:
            with pytest.raises(WebhookRefused) as caught:
                receiver.receive(request)
            assert caught.value.status == 403 and "SignatureVersion" in caught.value.reason
    # Both by default, as before.
    assert SESReceiver("ses", provider_ses.TOPIC_ARN).signature_versions == ("1", "2")
    for bad in ({"topics": provider_ses.TOPIC_ARN, "signature_versions": ["3"]},
                {"topics": provider_ses.TOPIC_ARN, "signature_versions": "2"},
                {"topics": provider_ses.TOPIC_ARN, "signature_versions": []},
                {"signature_versions": ["2"]}):
        with pytest.raises(ConfigError):
            SESReceiver.check_secret(bad, "webhook_secret")


@pytest.fixture
def counting_server() -> Iterator[tuple[SNSCertificates, list[str]]]:
    fetched: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        fetched.append(str(request.url))
        return httpx.Response(404)
    with httpx.Client(transport=httpx.MockTransport(serve)) as client:
        yield SNSCertificates(client, fetches_per_minute=3), fetched


def test_unverified_sns_requests_cost_one_fetch_per_url_and_a_few_a_minute(
        counting_server: tuple[SNSCertificates, list[str]]) -> None:
    certificates, fetched = counting_server
    url = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-{}.pem"
    for _ in range(20):  # the same URL: one fetch, its failure remembered
        with pytest.raises(CertificateUnavailable, match="HTTP 404"):
            certificates.get(url.format(0))
    assert len(fetched) == 1
    for n in range(1, 20):  # many URLs: a few fetches a minute, then none
        with pytest.raises(CertificateUnavailable):
            certificates.get(url.format(n))
    assert len(fetched) == 3



# -- every parser of a webhook body is linear -------------------------------------------


def _seconds(text: str) -> float:
    start = time.perf_counter()
    try:
        bounded_json(text, "the body")
    except WebhookRefused:
        pass
    return time.perf_counter() - start


@pytest.mark.parametrize("shape", [
    "[", "]", "{", '"', '\\"', '"\\', '"\\\\', "[[[]", '{"a":', '["a",', "9", "\x00", "\ud800",
    "1e", '"[', "é",
], ids=repr)
def test_the_json_reader_is_linear_on_adversarial_shapes(shape: str) -> None:
    """A megabyte (the route's cap) of each worst shape: sixteen times the input costs
    well under the 256 times a quadratic reader would (a linear one: 16), and under a
    second. The ratios are far apart so that a loaded machine cannot blur them: the
    bound is half the quadratic ratio (a run on a CI machine under `-n 2` with other
    processes measured 66 for a linear shape, the megabyte's allocation included)."""
    small = shape * (62_500 // len(shape))
    large = small * 16
    _seconds(small)
    small_time = min(_seconds(small) for _ in range(5))
    large_time = min(_seconds(large) for _ in range(5))
    assert large_time < max(128 * small_time, 0.05), (small_time, large_time)
    assert large_time < 1.0


def test_json_depth_counts_brackets_outside_strings() -> None:
    assert json_depth('[1, {"a": "[[[[", "b": [2]}]') == 3
    assert json_depth('["\\"[[[["]') == 1
    assert json_depth("") == 0
    assert bounded_json("[" * 64 + "]" * 64, "x") is not None
    with pytest.raises(WebhookRefused) as caught:
        bounded_json("[" * 65 + "]" * 65, "the body")
    assert caught.value.status == 400 and "deeper than 64" in caught.value.reason


def test_a_payload_is_always_storable() -> None:
    assert capped_payload({"a": "\x00\ud800"}) == '{"a":"\\u0000\\ud800"}'
    assert capped_payload("raw \x00 text \udfff") == "raw \\u0000 text \\udfff"
    assert len(capped_payload(["é" * 100_000]).encode()) <= PAYLOAD_LIMIT  # type: ignore[union-attr]
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    assert capped_payload(nested) is not None  # too deep for json.dumps: kept as text
