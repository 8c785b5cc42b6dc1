"""``POST <OUTBOX_WEBHOOK_PREFIX>/<transport>``: the route around the receivers.

End to end for each provider: mail sent through the provider's test server,
its events posted back signed as the provider signs them, ``mail.events()``
showing them, and the next ``send()`` to a hard-bounced address ending
``suppressed`` without a request to the provider. And what the route keeps
for every kind: 404 for a transport without a secret or unknown, 413 over
1 MiB, refusals that write nothing, resends ignored, one transaction per
request, signals after the answer, 503 when the events cannot be stored.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import provider_mailgun
import provider_postmark
import provider_resend
import provider_sendgrid
import provider_ses
import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, wait_rows
from flask import Flask
from provider_resend import API_KEY, FakeResend
from provider_ses import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, MotoSES

from flask_mail_outbox import DeliveryEvent, Message, OutboxMail, email_event
from flask_mail_outbox._webhooks import MAX_BODY_BYTES
from flask_mail_outbox._webhooks.ses import DEFAULT_CERTIFICATES
from flask_mail_outbox.core import event_table, suppression_table

#: Bad inputs tried against the routes (every one must write nothing).
BAD_INPUTS: list[str] = []


def send(app: Flask, *messages: Message, transport: str | None = None) -> list[int]:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        ids = [int(mail.send(message) if transport is None
                   else mail.send(message, transport=transport)) for message in messages]
        db.session.commit()
    return ids


def settled(app: Flask, count: int) -> list[dict[str, Any]]:
    return wait_rows(app, lambda rs: len(rs) >= count and all(
        r["status"] not in ("queued", "sending") for r in rs), timeout=15)


def counts(app: Flask) -> tuple[int, int]:
    """(events, suppressions) stored."""
    with app.app_context(), db.engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(event_table)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(
                    suppression_table)).scalar_one())


def post(app: Flask, name: str, headers: dict[str, str], body: bytes) -> Any:
    response = app.test_client().post(f"/outbox/webhooks/{name}", headers=headers, data=body)
    response.close()  # runs what the route does after its answer (the signals)
    return response


# -- Resend, end to end -------------------------------------------------------------------


@pytest.fixture
def resend() -> Iterator[FakeResend]:
    server = FakeResend()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def resend_app(make_apps: MakeApps, resend: FakeResend) -> tuple[Flask, str]:
    secret = provider_resend.webhook_secret()
    app, _ = make_apps(OUTBOX_TRANSPORTS={"mail-resend": {
        "transport": "resend", "base_url": resend.url, "api_key": API_KEY,
        "webhook_secret": secret}, "default": {"transport": "resend", "base_url": resend.url,
                                               "api_key": API_KEY}})
    return app, secret


def test_resend_bounce_end_to_end(resend_app: tuple[Flask, str], resend: FakeResend) -> None:
    app, secret = resend_app
    mail: OutboxMail = app.extensions["test_mail"]
    heard: list[DeliveryEvent] = []
    # Sent through the transport whose webhook reports it: events are matched to the
    # emails of their own transport.
    [email_id] = send(app, Message("Hi", ["gone@example.com"], "x"), transport="mail-resend")
    [row] = settled(app, 1)
    assert row["status"] == "sent" and row["provider_message_id"]
    requests_before = len(resend.sending())

    def on_event(sender: Flask, event: DeliveryEvent, **_: Any) -> None:
        heard.append(event)

    now = time.time()
    # A dead address (5.1.1): the suppression policy makes it permanent.
    dead = {**provider_resend.bounce("Permanent", "General"),
            "diagnosticCode": ["smtp; 550 5.1.1 The email account does not exist"]}
    headers, body = provider_resend.webhook_request(provider_resend.resend_event(
        "email.bounced", email_id=row["provider_message_id"], to=["gone@example.com"],
        bounce=dead), secret, now, svix_id="msg_e2e_1")
    with email_event.connected_to(on_event, app):
        response = post(app, "mail-resend", headers, body)
        assert response.status_code == 200
        assert response.get_json() == {"accepted": 1, "duplicates": 0, "unmatched": 0}
        # Svix retries with the same id: acknowledged, ignored.
        again = post(app, "mail-resend", *provider_resend.webhook_request(
            json.loads(body), secret, now + 30, svix_id="msg_e2e_1"))
        assert again.get_json() == {"accepted": 0, "duplicates": 1, "unmatched": 0}
    with app.app_context():
        (event,) = mail.events(email_id)
        entry = mail.suppression("gone@example.com")
    assert (event.event_type, event.bounce_kind, event.recipient, event.transport,
            event.reason) == (
        "bounced", "permanent", "gone@example.com", "mail-resend", "user_unknown")
    assert (event.verdict, event.suppressed_until, event.applied) == ("permanent", None, True)
    assert event.mta_response.startswith("smtp; 550")
    assert [e.id for e in heard] == [event.id]
    assert entry is not None and (entry.reason, entry.source) == (
        "bounced", "mail-resend bounced")
    # The next email to that address ends suppressed: Resend hears nothing of it.
    [next_id] = send(app, Message("Again", ["gone@example.com"], "x"))
    current = settled(app, 2)
    assert next(r for r in current if r["id"] == next_id)["status"] == "suppressed"
    assert len(resend.sending()) == requests_before


def test_a_suppressed_cc_is_left_out_of_an_api_request(
        resend_app: tuple[Flask, str], resend: FakeResend) -> None:
    app, _ = resend_app
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        mail.suppress("complainer@example.com", "complained")
    send(app, Message("Hi", ["ok@example.com"], "x", cc=["complainer@example.com"],
                      bcc=["hidden@example.com"]))
    [row] = settled(app, 1)
    assert row["status"] == "sent"
    (request,) = resend.sending()
    sent = json.loads(request.body)
    assert sent["to"] == ["ok@example.com"]
    assert sent.get("cc") in (None, [])
    assert sent["bcc"] == ["hidden@example.com"]


# -- SES through SNS, end to end ----------------------------------------------------------


@pytest.fixture
def moto() -> Iterator[MotoSES]:
    server = MotoSES().start()
    server.verify("example.com")
    yield server
    server.stop()


@pytest.fixture
def signer() -> provider_ses.SNSSigner:
    signer = provider_ses.sns_signer()
    DEFAULT_CERTIFICATES.trust(signer.url, signer.pem)  # the local trust
    return signer


def test_ses_bounce_and_complaint_end_to_end(make_apps: MakeApps, moto: MotoSES,
                                             signer: provider_ses.SNSSigner) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": {
        "transport": "ses", "region": REGION, "base_url": moto.url,
        "access_key_id": ACCESS_KEY_ID, "secret_access_key": SECRET_ACCESS_KEY,
        "webhook_secret": provider_ses.TOPIC_ARN}})
    [bounced_id, complained_id] = send(app, Message("A", ["gone@example.com"], "x"),
                                       Message("B", ["angry@example.com"], "x"))
    current = settled(app, 2)
    ids = {r["id"]: r["provider_message_id"] for r in current}
    now = time.time()
    bounce = provider_ses.ses_event("Bounce", ["gone@example.com"], provider_ses.bounce_detail(
        [("gone@example.com", "5.1.1", "smtp; 550 5.1.1 user unknown")]))
    bounce["mail"]["messageId"] = ids[bounced_id]
    complaint = provider_ses.ses_event("Complaint", ["angry@example.com"],
                                       provider_ses.complaint_detail(["angry@example.com"]))
    complaint["mail"]["messageId"] = ids[complained_id]
    for event in (bounce, complaint):
        response = post(app, "default", *provider_ses.webhook_request(event, signer, now))
        assert response.status_code == 200, response.get_data(as_text=True)
    with app.app_context():
        assert [(e.event_type, e.bounce_kind, e.reason) for e in mail.events(bounced_id)] == [
            ("bounced", "permanent", "user_unknown")]
        assert [(e.event_type, e.reason) for e in mail.events(complained_id)] == [
            ("complained", "complaint")]
        assert mail.suppression("gone@example.com").reason == "bounced"  # type: ignore[union-attr]
        assert mail.suppression("angry@example.com").reason == "complained"  # type: ignore[union-attr]
    sent_before = len(moto.sent())
    send(app, Message("C", ["gone@example.com"], "x"), Message("D", ["angry@example.com"], "x"))
    assert [r["status"] for r in settled(app, 4)][2:] == ["suppressed", "suppressed"]
    assert len(moto.sent()) == sent_before


def test_an_sns_subscription_is_confirmed_after_the_answer(
        make_apps: MakeApps, signer: provider_ses.SNSSigner,
        caplog: pytest.LogCaptureFixture) -> None:
    app, _ = make_apps(OUTBOX_TRANSPORTS={"ses": {
        "transport": "ses", "region": REGION, "access_key_id": ACCESS_KEY_ID,
        "secret_access_key": SECRET_ACCESS_KEY, "webhook_secret": provider_ses.TOPIC_ARN}})
    message = provider_ses.sign_sns(provider_ses.confirmation(time.time()), signer)
    response = post(app, "ses", *provider_ses.sns_request(message))
    assert response.status_code == 200
    assert response.get_json()["accepted"] == 0
    # The SubscribeURL is AWS's: unreachable here, so the confirmation is reported.
    assert any("Could not confirm the SNS subscription" in r.getMessage()
               for r in caplog.records)
    assert counts(app) == (0, 0)


# -- what the route keeps for every kind ----------------------------------------------------


def test_no_secret_no_route_and_unknown_transports_are_404(
        resend_app: tuple[Flask, str]) -> None:
    app, secret = resend_app
    headers, body = provider_resend.webhook_request(
        provider_resend.resend_event("email.delivered"), secret, time.time())
    for name in ("default", "nope", "mail-resend/extra"):
        BAD_INPUTS.append(f"route {name}")
        assert post(app, name, headers, body).status_code == 404
    assert app.test_client().get("/outbox/webhooks/mail-resend").status_code == 405
    assert counts(app) == (0, 0)


def test_an_app_without_webhook_secrets_has_no_route(make_apps: MakeApps) -> None:
    app, _ = make_apps(TESTING=True)
    assert app.test_client().post("/outbox/webhooks/default", data=b"{}").status_code == 404


@pytest.mark.parametrize("how", ["declared", "streamed"])
def test_a_body_over_one_mib_is_413(resend_app: tuple[Flask, str], how: str) -> None:
    app, secret = resend_app
    event = provider_resend.resend_event("email.delivered", padding="x" * MAX_BODY_BYTES)
    headers, body = provider_resend.webhook_request(event, secret, time.time())
    BAD_INPUTS.append(f"oversized body ({how})")
    client = app.test_client()
    if how == "declared":
        response = client.post("/outbox/webhooks/mail-resend", headers=headers, data=body)
    else:  # chunked, no Content-Length: the route stops reading at the cap
        response = client.post("/outbox/webhooks/mail-resend", headers=headers,
                               input_stream=io.BytesIO(body),
                               environ_overrides={"CONTENT_LENGTH": "",
                                                  "wsgi.input_terminated": True})
    assert response.status_code == 413
    assert counts(app) == (0, 0)


@pytest.mark.parametrize(("name", "change"), [
    ("wrong signature", lambda h, b: ({**h, "svix-signature": "v1,AAAA"}, b)),
    ("missing signature", lambda h, b: ({k: v for k, v in h.items()
                                         if k != "svix-signature"}, b)),
    ("old timestamp", None),
    ("bad JSON", None),
    ("body changed after signing", lambda h, b: (h, b.replace(b"x@example", b"y@example"))),
])
def test_refusals_write_nothing(resend_app: tuple[Flask, str], name: str,
                                change: Callable[..., Any] | None) -> None:
    app, secret = resend_app
    event = provider_resend.resend_event("email.bounced", to=["x@example.com"],
                                         bounce=provider_resend.bounce())
    now = time.time()
    if name == "old timestamp":
        headers, body = provider_resend.webhook_request(event, secret, now, timestamp=now - 301)
    elif name == "bad JSON":
        body = b'{"type": "email.bounced", '
        headers, _ = provider_resend.webhook_request(event, secret, now)
        stamp = headers["svix-timestamp"]
        headers["svix-signature"] = provider_resend.svix_signature(
            secret, headers["svix-id"], stamp, body)
    else:
        assert change is not None
        headers, body = change(*provider_resend.webhook_request(event, secret, now))
    BAD_INPUTS.append(name)
    response = post(app, "mail-resend", headers, body)
    assert response.status_code in (400, 401, 403)
    assert "error" in response.get_json()
    assert secret not in response.get_data(as_text=True)
    assert counts(app) == (0, 0)


def test_an_event_for_an_unknown_message_is_kept_and_counted(
        resend_app: tuple[Flask, str]) -> None:
    app, secret = resend_app
    response = post(app, "mail-resend", *provider_resend.webhook_request(
        provider_resend.resend_event("email.delivered", email_id="not-ours"), secret,
        time.time()))
    assert response.get_json() == {"accepted": 1, "duplicates": 0, "unmatched": 1}
    assert counts(app) == (1, 0)


def test_events_that_cannot_be_stored_are_503_and_the_provider_retries(
        resend_app: tuple[Flask, str], caplog: pytest.LogCaptureFixture) -> None:
    app, secret = resend_app
    headers, body = provider_resend.webhook_request(
        provider_resend.resend_event("email.delivered"), secret, time.time())
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_event RENAME TO outbox_event_x"))
    try:
        response = post(app, "mail-resend", headers, body)
        assert response.status_code == 503
        assert any(r.levelname == "ERROR" and "delivery event" in r.getMessage()
                   for r in caplog.records)
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox_event_x RENAME TO outbox_event"))
    assert post(app, "mail-resend", headers, body).status_code == 200  # the retry


def test_bad_inputs_were_counted() -> None:
    """Run last in this module: the refusals above, each of which wrote nothing."""
    assert len(BAD_INPUTS) >= 3 + 2 + 5


# -- Postmark, SendGrid, Mailgun, end to end ----------------------------------------------


class Provider:
    """One provider's test server and how it posts a hard bounce back, signed."""

    kind = ""

    def __init__(self) -> None:
        self.server: Any = None

    def entry(self) -> dict[str, Any]:
        raise NotImplementedError

    def bounce(self, provider_id: str, address: str, now: float) -> tuple[dict[str, str], bytes]:
        raise NotImplementedError

    def sends(self) -> int:
        return len(self.server.accepted)


class Postmark(Provider):
    kind = "postmark"

    def __init__(self) -> None:
        super().__init__()
        self.server = provider_postmark.FakePostmark()

    def entry(self) -> dict[str, Any]:
        return {"transport": "postmark", "base_url": self.server.url,
                "token": provider_postmark.TOKEN,
                "webhook_secret": provider_postmark.WEBHOOK_SECRET}

    def bounce(self, provider_id: str, address: str, now: float) -> tuple[dict[str, str], bytes]:
        return provider_postmark.webhook_request(
            provider_postmark.bounce_record(provider_id, address))


class SendGrid(Provider):
    kind = "sendgrid"

    def __init__(self) -> None:
        super().__init__()
        self.server = provider_sendgrid.SendGridAPI(SENDGRID_KEY)
        self.key, self.public = provider_sendgrid.webhook_key()

    def entry(self) -> dict[str, Any]:
        return {"transport": "sendgrid", "base_url": self.server.url, "api_key": SENDGRID_KEY,
                "webhook_secret": self.public}

    def bounce(self, provider_id: str, address: str, now: float) -> tuple[dict[str, str], bytes]:
        return provider_sendgrid.webhook_request([provider_sendgrid.webhook_event(
            "bounce", provider_id, address, int(now))], self.key, now)


class Mailgun(Provider):
    kind = "mailgun"

    def __init__(self) -> None:
        super().__init__()
        self.server = provider_mailgun.MailgunAPI(MAILGUN_KEY, frozenset({MAILGUN_DOMAIN}))

    def entry(self) -> dict[str, Any]:
        return {"transport": "mailgun", "base_url": self.server.url, "api_key": MAILGUN_KEY,
                "domain": MAILGUN_DOMAIN,
                "webhook_secret": provider_mailgun.WEBHOOK_SIGNING_KEY}

    def bounce(self, provider_id: str, address: str, now: float) -> tuple[dict[str, str], bytes]:
        return provider_mailgun.webhook_request(provider_mailgun.webhook_event(
            "failed", provider_id, address, now), provider_mailgun.WEBHOOK_SIGNING_KEY, now)


SENDGRID_KEY = "SG.test-key.secret"
MAILGUN_KEY = "key-test-secret"
MAILGUN_DOMAIN = "mg.example.com"


@pytest.fixture(params=[Postmark, SendGrid, Mailgun], ids=lambda cls: cls.kind)
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    made: Provider = request.param()
    made.server.start()
    yield made
    made.server.stop()


def test_hard_bounce_end_to_end(make_apps: MakeApps, provider: Provider) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORTS={"default": provider.entry()})
    [email_id] = send(app, Message("Hi", ["gone@example.com"], "x"))
    [row] = settled(app, 1)
    assert row["status"] == "sent" and row["provider_message_id"]
    response = post(app, "default", *provider.bounce(row["provider_message_id"],
                                                     "gone@example.com", time.time()))
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json()["accepted"] == 1
    with app.app_context():
        (event,) = mail.events(email_id)
        entry = mail.suppression("gone@example.com")
    assert (event.event_type, event.bounce_kind, event.recipient, event.email_id) == (
        "bounced", "permanent", "gone@example.com", email_id)
    # Why, as each provider's bounce says it (its type, or the reply it passes on).
    assert event.reason == "user_unknown"
    assert entry is not None and entry.reason == "bounced"
    sends = provider.sends()
    [again] = send(app, Message("Again", ["gone@example.com"], "x"))
    assert next(r for r in settled(app, 2) if r["id"] == again)["status"] == "suppressed"
    assert provider.sends() == sends


def test_a_replayed_mailgun_token_is_refused(make_apps: MakeApps) -> None:
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS={"mg": {
        "transport": "mailgun", "api_key": MAILGUN_KEY, "domain": MAILGUN_DOMAIN,
        "webhook_secret": provider_mailgun.WEBHOOK_SIGNING_KEY}})
    now = time.time()
    first = provider_mailgun.webhook_request(provider_mailgun.webhook_event(
        "delivered", "id-1@mg.example.com", "a@example.com", now),
        provider_mailgun.WEBHOOK_SIGNING_KEY, now, token="t" * 50)
    assert post(app, "mg", *first).status_code == 200
    BAD_INPUTS.append("replayed Mailgun token")
    assert post(app, "mg", *first).status_code == 403
    # The same token on another event (a forged one) is refused too.
    other = provider_mailgun.webhook_request(provider_mailgun.webhook_event(
        "failed", "id-1@mg.example.com", "a@example.com", now),
        provider_mailgun.WEBHOOK_SIGNING_KEY, now, token="t" * 50)
    BAD_INPUTS.append("reused Mailgun token, other event")
    assert post(app, "mg", *other).status_code == 403
    assert counts(app) == (1, 0)


def test_a_batch_of_1000_sendgrid_events_is_one_transaction(make_apps: MakeApps) -> None:
    key, public = provider_sendgrid.webhook_key()
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS={"sg": {
        "transport": "sendgrid", "api_key": SENDGRID_KEY, "webhook_secret": public}})
    now = time.time()
    events = [provider_sendgrid.webhook_event("delivered", f"msg{i}", f"r{i}@example.com",
                                              int(now), event_id=f"ev{i}")
              for i in range(999)]
    events.append(provider_sendgrid.webhook_event("bounce", "msg-last", "last@example.com",
                                                  int(now), event_id="ev-last"))
    commits: list[object] = []

    def on_commit(conn: object) -> None:
        commits.append(conn)

    engine = app.extensions["mail_outbox"].outbox().engine
    sa.event.listen(engine, "commit", on_commit)
    try:
        response = post(app, "sg", *provider_sendgrid.webhook_request(events, key, now))
    finally:
        sa.event.remove(engine, "commit", on_commit)
    assert response.status_code == 200
    assert response.get_json() == {"accepted": 1000, "duplicates": 0, "unmatched": 1000}
    assert len(commits) == 1
    assert counts(app) == (1000, 1)
    # SendGrid resends the whole batch: every event is acknowledged and ignored.
    response = post(app, "sg", *provider_sendgrid.webhook_request(events, key, now))
    assert response.get_json() == {"accepted": 0, "duplicates": 1000, "unmatched": 0}
    assert counts(app) == (1000, 1)


def test_an_event_twice_in_one_batch_is_stored_once(make_apps: MakeApps) -> None:
    key, public = provider_sendgrid.webhook_key()
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS={"sg": {
        "transport": "sendgrid", "api_key": SENDGRID_KEY, "webhook_secret": public}})
    now = time.time()
    event = provider_sendgrid.webhook_event("delivered", "m1", "a@example.com", int(now),
                                            event_id="same")
    other = provider_sendgrid.webhook_event("open", "m1", "a@example.com", int(now),
                                            event_id="other")
    response = post(app, "sg", *provider_sendgrid.webhook_request([event, other, event],
                                                                  key, now))
    assert response.get_json() == {"accepted": 2, "duplicates": 1, "unmatched": 2}
    assert counts(app) == (2, 0)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_retry_racing_its_original_in_another_order_never_deadlocks(
        make_apps: MakeApps) -> None:
    """A provider's retry can arrive while the original is still being stored."""
    app, _ = make_apps(TESTING=True)
    log = app.extensions["mail_outbox"].outbox().events
    for round_number in range(8):
        events = [DeliveryEvent("bounced", bounce_kind="permanent", transport="sg",
                                reason="user_unknown", provider_event_id=f"{round_number}-{i}",
                                recipient=f"r{round_number}-{i}@example.com")
                  for i in range(300)]
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def store(batch: list[DeliveryEvent]) -> None:
            barrier.wait()
            try:
                log.record(batch)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=store, args=(batch,))
                   for batch in (events, list(reversed(events)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == [], errors
    assert counts(app) == (8 * 300, 8 * 300)
