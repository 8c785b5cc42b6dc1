"""One app with a webhook for each of the five providers, and their signatures over any body.

For the hostile-input tests (tests/test_webhook_hostile.py, tests/test_webhook_fuzz.py):
each ``sign_*`` takes the raw bytes to post (or, for Mailgun and SNS, whose
signatures are inside the body, the raw text of the part they sign around) and
returns ``(headers, body)`` signed as the provider signs.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import provider_mailgun
import provider_postmark
import provider_resend
import provider_sendgrid
import provider_ses
import sqlalchemy as sa
from conftest import db
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from flask import Flask

from flask_mail_outbox._webhooks.ses import DEFAULT_CERTIFICATES
from flask_mail_outbox.core import event_table, suppression_table
from flask_mail_outbox.core._models import nonce_table

NOWHERE = "http://127.0.0.1:9"  # never asked: these apps only hear webhooks
SENDGRID_KEY, SENDGRID_PUBLIC = provider_sendgrid.webhook_key()
RESEND_SECRET = provider_resend.webhook_secret()
SNS_SIGNER = provider_ses.sns_signer()

#: OUTBOX_TRANSPORTS with a webhook for each provider, named by its kind.
TRANSPORTS: dict[str, dict[str, Any]] = {
    "default": {"transport": "file"},
    "postmark": {"transport": "postmark", "base_url": NOWHERE, "token": "pm-token",
                 "webhook_secret": provider_postmark.WEBHOOK_SECRET},
    "sendgrid": {"transport": "sendgrid", "base_url": NOWHERE, "api_key": "SG.k.s",
                 "webhook_secret": SENDGRID_PUBLIC},
    "mailgun": {"transport": "mailgun", "base_url": NOWHERE, "api_key": "key-x",
                "domain": "mg.example.com",
                "webhook_secret": provider_mailgun.WEBHOOK_SIGNING_KEY},
    "resend": {"transport": "resend", "base_url": NOWHERE, "api_key": "re_x",
               "webhook_secret": RESEND_SECRET},
    "ses": {"transport": "ses", "region": provider_ses.REGION, "base_url": NOWHERE,
            "access_key_id": "AKIDEXAMPLE", "secret_access_key": "secret",
            "webhook_secret": provider_ses.TOPIC_ARN},
}
KINDS = ("postmark", "sendgrid", "mailgun", "resend", "ses")


def written(app: Flask) -> tuple[int, int, int]:
    """(events, suppressions, nonces) stored."""
    with app.app_context(), db.engine.connect() as conn:
        return tuple(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
                     for table in (event_table, suppression_table, nonce_table))  # type: ignore[return-value]


def post(app: Flask, kind: str, headers: dict[str, str], body: bytes) -> Any:
    response = app.test_client().post(f"/outbox/webhooks/{kind}", headers=headers, data=body)
    response.close()  # what the route does after its answer (signals) runs now
    return response


def sign_postmark(body: bytes) -> tuple[dict[str, str], bytes]:
    credentials = base64.b64encode(provider_postmark.WEBHOOK_SECRET.encode()).decode()
    return {"Content-Type": "application/json", "Authorization": f"Basic {credentials}"}, body


def sign_sendgrid(body: bytes, now: float | None = None,
                  timestamp: str | None = None) -> tuple[dict[str, str], bytes]:
    stamp = timestamp if timestamp is not None else str(int(now or time.time()))
    return ({"Content-Type": "application/json",
             "X-Twilio-Email-Event-Webhook-Signature":
                 provider_sendgrid.sign_webhook(body, SENDGRID_KEY, stamp),
             "X-Twilio-Email-Event-Webhook-Timestamp": stamp}, body)


def sign_resend(body: bytes, now: float | None = None, timestamp: str | None = None,
                svix_id: str = "msg_hostile") -> tuple[dict[str, str], bytes]:
    stamp = timestamp if timestamp is not None else str(int(now or time.time()))
    return ({"content-type": "application/json", "svix-id": svix_id, "svix-timestamp": stamp,
             "svix-signature": provider_resend.svix_signature(RESEND_SECRET, svix_id, stamp,
                                                              body)}, body)


def sign_mailgun(event_data_json: str, now: float | None = None,
                 token: str | None = None) -> tuple[dict[str, str], bytes]:
    """A signed Mailgun body whose ``event-data`` is the raw JSON text given."""
    block = provider_mailgun.webhook_payload({}, provider_mailgun.WEBHOOK_SIGNING_KEY,
                                             now or time.time(), token)["signature"]
    body = '{"signature": ' + json.dumps(block) + ', "event-data": ' + event_data_json + "}"
    return {"Content-Type": "application/json"}, body.encode("utf-8", "surrogatepass")


def sign_ses(message_text: str, now: float | None = None,
             **fields: Any) -> tuple[dict[str, str], bytes]:
    """A signed SNS Notification whose ``Message`` is the text given (any characters, a lone
    surrogate included: signed over its UTF-8 with surrogates passed through)."""
    # The local trust, never fetched: set again for each request, since other modules'
    # tests trust their own signer's certificate under the same URL in the same process.
    DEFAULT_CERTIFICATES.trust(SNS_SIGNER.url, SNS_SIGNER.pem)
    message = provider_ses.notification(message_text, now or time.time())
    message.update(fields)
    canonical = "".join(f"{name}\n{message[name]}\n" for name in
                        ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type")
                        if name in message)
    signature = SNS_SIGNER.key.sign(canonical.encode("utf-8", "surrogatepass"),
                                    padding.PKCS1v15(), hashes.SHA256())
    message.update(SignatureVersion="2", Signature=base64.b64encode(signature).decode(),
                   SigningCertURL=SNS_SIGNER.url)
    return provider_ses.sns_request(message)


def sign(kind: str, payload: str, now: float | None = None) -> tuple[dict[str, str], bytes]:
    """``payload`` (JSON text) as ``kind``'s signed POST: the body itself, or the part the
    signature goes around (Mailgun's ``event-data``, SNS's ``Message``)."""
    if kind == "mailgun":
        return sign_mailgun(payload, now)
    if kind == "ses":
        return sign_ses(payload, now)
    body = payload.encode("utf-8", "surrogatepass")
    if kind == "postmark":
        return sign_postmark(body)
    if kind == "sendgrid":
        return sign_sendgrid(body, now)
    return sign_resend(body, now)
