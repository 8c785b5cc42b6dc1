"""Amazon SES for the ses transport's tests: moto's server mode, and a fake that checks SigV4.

:class:`MotoSES` is moto's ``ThreadedMotoServer`` on a loopback port, in this
process: the transport signs its requests with the real botocore and moto
answers SES API v2 ``SendEmail`` as its sesv2 backend does (sender identities
must be verified; the message is kept, raw, in the v1 backend moto's sesv2
piggybacks on). boto3 is used only here, to verify identities; what moto
received is read from its backend, which lives in this process.

moto does not check signatures. :class:`SignedSESFake` (a ``FakeAPI``) does:
it recomputes the SigV4 signature of every request it receives with botocore's
own signer, from the received method, path, signed headers and body, and
answers AWS's documented errors (403 ``InvalidSignatureException``,
``UnrecognizedClientException``...) when it does not match; then it checks
the body the way SES does (400 ``BadRequestException`` / ``MessageRejected``)
and answers ``200 {"MessageId": ...}``, keeping what it accepted.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import email.policy
import hmac
import json
import logging
import re
import threading
import uuid
from email.message import EmailMessage
from email.parser import BytesParser
from email.utils import getaddresses, parseaddr
from typing import Any

import boto3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from httpserver import FakeAPI, Reply, Request
from moto.core.models import DEFAULT_ACCOUNT_ID
from moto.server import ThreadedMotoServer
from moto.ses.models import RawMessage, ses_backends

REGION = "eu-west-1"
ACCESS_KEY_ID = "AKIAOUTBOXTEST000001"
SECRET_ACCESS_KEY = "outbox-test-secret/0123456789abcdefghij"
SEND_EMAIL_PATH = "/v2/email/outbound-emails"
#: How far a request's X-Amz-Date may be from now (AWS allows five minutes).
MAX_SKEW = datetime.timedelta(minutes=5)

_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"(?P<service>[^/]+)/aws4_request, SignedHeaders=(?P<signed>[a-z0-9;-]+), "
    r"Signature=(?P<signature>[0-9a-f]{64})")
_CORAL = "http://internal.amazon.com/coral/com.amazon.coral.service/"


# -- moto -----------------------------------------------------------------------------------


class MotoSES:
    """moto's server mode on 127.0.0.1 (see the module docstring)."""

    def __init__(self, region: str = REGION) -> None:
        self.region = region
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        # werkzeug logs every request line at INFO; the tests' logs are about the outbox.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)

    def start(self) -> MotoSES:
        """Serve, with moto's state reset (its backends are this process's globals)."""
        self._server.start()
        self.reset()
        return self

    def stop(self) -> None:
        """Stop serving, leaving no state behind."""
        self.reset()
        self._server.stop()

    @property
    def url(self) -> str:
        """The ``endpoint_url`` to configure."""
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    def reset(self) -> None:
        """Forget every identity and message (moto's own reset endpoint)."""
        import httpx
        httpx.post(f"{self.url}/moto-api/reset").raise_for_status()

    def verify(self, identity: str) -> None:
        """Make ``identity`` (an address or a domain) a verified sender, through the API."""
        client = boto3.client("sesv2", region_name=self.region, endpoint_url=self.url,
                              aws_access_key_id=ACCESS_KEY_ID,
                              aws_secret_access_key=SECRET_ACCESS_KEY)
        try:
            client.create_email_identity(EmailIdentity=identity)
        finally:
            client.close()

    def sent(self) -> list[RawMessage]:
        """The raw messages moto accepted, in order (``.id``, ``.source``,
        ``.destinations``, ``.raw_data``: the decoded MIME)."""
        return list(ses_backends[DEFAULT_ACCOUNT_ID][self.region].sent_messages)


# -- a fake that checks the signature -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Accepted:
    """One message the signed fake accepted."""

    message_id: str
    raw: bytes
    destinations: tuple[str, ...]
    body: dict[str, Any]
    access_key_id: str

    def message(self) -> EmailMessage:
        """The raw MIME, parsed."""
        parsed = BytesParser(policy=email.policy.default).parsebytes(self.raw)
        assert isinstance(parsed, EmailMessage)
        return parsed


def aws_error(status: int, error_type: str, message: str,
              headers: dict[str, str] | None = None) -> Reply:
    """An AWS rest-json error answer, as the SES API v2 sends it."""
    return Reply(status, {"message": message},
                 headers={"x-amzn-ErrorType": f"{error_type}:{_CORAL}",
                          "x-amzn-RequestId": str(uuid.uuid4()), **(headers or {})})


class SignedSESFake(FakeAPI):
    """SES API v2 ``SendEmail`` that verifies SigV4 (see the module docstring).

    ``credentials`` maps the access key ids it knows to their secrets (replace
    it to rotate); ``verified`` holds the verified identities (addresses or
    domains).
    """

    def __init__(self, region: str = REGION) -> None:
        super().__init__()
        self.region = region
        self.credentials = {ACCESS_KEY_ID: SECRET_ACCESS_KEY}
        self.verified = {"example.com"}
        self.accepted: list[Accepted] = []
        #: Answer with ``Connection: close`` (the client keeps no connection open).
        self.close_connections = False
        self._accepted_lock = threading.Lock()

    def sending(self) -> list[Request]:
        """The SendEmail requests received, whatever was answered."""
        return [r for r in self.requests if r.path == SEND_EMAIL_PATH]

    def handle(self, request: Request) -> Reply:
        reply = self.answer(request)
        if self.close_connections:
            reply = dataclasses.replace(reply, headers={**reply.headers, "Connection": "close"})
        return reply

    def answer(self, request: Request) -> Reply:
        """SES's answer to ``request``: a signature error, a body error, or the MessageId."""
        if request.method != "POST" or request.path != SEND_EMAIL_PATH:
            return aws_error(404, "UnknownOperationException", "Unknown operation")
        refused = self.check_signature(request)
        if refused is not None:
            return refused
        return self.send_email(request)

    # -- SigV4 ---------------------------------------------------------------------------

    def check_signature(self, request: Request) -> Reply | None:
        """None when ``request`` is signed with a known key, else AWS's 403 answer."""
        authorization = request.header("Authorization")
        if not authorization:
            return aws_error(403, "MissingAuthenticationTokenException",
                             "Missing Authentication Token")
        found = _AUTHORIZATION.fullmatch(authorization)
        if found is None:
            return aws_error(403, "IncompleteSignatureException",
                             f"Authorization header requires 'Credential', 'Signature' and "
                             f"'SignedHeaders' parameters. Authorization={authorization}")
        secret = self.credentials.get(found["key"])
        if secret is None:
            return aws_error(403, "UnrecognizedClientException",
                             "The security token included in the request is invalid.")
        if found["region"] != self.region or found["service"] != "ses":
            return aws_error(403, "InvalidSignatureException",
                             f"Credential should be scoped to a valid region and to the "
                             f"service 'ses', not '{found['region']}/{found['service']}'.")
        amz_date = request.header("X-Amz-Date") or ""
        try:
            signed_at = datetime.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(
                tzinfo=datetime.UTC)
        except ValueError:
            return aws_error(403, "IncompleteSignatureException",
                             "Authorization header requires existence of either a "
                             "'X-Amz-Date' or a 'Date' header.")
        if abs(datetime.datetime.now(datetime.UTC) - signed_at) > MAX_SKEW \
                or amz_date[:8] != found["date"]:
            return aws_error(403, "InvalidSignatureException",
                             f"Signature expired: {amz_date} is now earlier or later than "
                             "the allowed five minutes.")
        names = found["signed"].split(";")
        headers = {name: request.header(name) for name in names}
        if "host" not in names or "x-amz-date" not in names or None in headers.values():
            return aws_error(403, "InvalidSignatureException",
                             "The request signature we calculated does not match the "
                             "signature you provided (a signed header is missing).")
        # botocore's own signer over the request as it arrived.
        received = AWSRequest(method=request.method,
                              url=f"http://{request.header('Host')}{request.path}",
                              data=request.body, headers=headers)
        received.context["timestamp"] = amz_date
        signer = SigV4Auth(Credentials(found["key"], secret), "ses", self.region)
        canonical = signer.canonical_request(received)
        expected = signer.signature(signer.string_to_sign(received, canonical), received)
        if not hmac.compare_digest(expected, found["signature"]):
            return aws_error(403, "InvalidSignatureException",
                             "The request signature we calculated does not match the "
                             "signature you provided. Check your AWS Secret Access Key and "
                             "signing method. Consult the service documentation for details.")
        return None

    # -- SendEmail -----------------------------------------------------------------------

    def send_email(self, request: Request) -> Reply:
        """Check the body as SES does; accept the message."""
        try:
            body = request.json()
            data = body["Content"]["Raw"]["Data"]
            raw = base64.b64decode(data, validate=True)
        except (ValueError, KeyError, TypeError, binascii.Error):
            return aws_error(400, "BadRequestException",
                             "Content.Raw.Data is required: the raw message, base64-encoded")
        destination = body.get("Destination") or {}
        destinations = tuple(address for key in ("ToAddresses", "CcAddresses", "BccAddresses")
                             for address in destination.get(key, []))
        message = BytesParser(policy=email.policy.default).parsebytes(raw, headersonly=True)
        if not destinations:  # raw content: the recipients of the headers
            destinations = tuple(a for _, a in getaddresses(
                [str(v) for h in ("To", "Cc") for v in message.get_all(h, [])]) if a)
        if not destinations:
            return aws_error(400, "BadRequestException", "Missing required destination")
        if len(destinations) > 50:
            return aws_error(400, "MessageRejected", "Recipient count exceeds 50.")
        sender = body.get("FromEmailAddress") or parseaddr(str(message.get("From", "")))[1]
        if not sender:
            return aws_error(400, "BadRequestException", "Missing required header 'From'.")
        if sender not in self.verified and sender.rpartition("@")[2] not in self.verified:
            return aws_error(400, "MessageRejected",
                             f"Email address is not verified. The following identities "
                             f"failed the check in region {self.region.upper()}: {sender}")
        found = _AUTHORIZATION.fullmatch(request.header("Authorization") or "")
        accepted = Accepted(message_id=f"0102{uuid.uuid4().hex}-000000", raw=raw,
                            destinations=destinations, body=body,
                            access_key_id=found["key"] if found else "")
        with self._accepted_lock:
            self.accepted.append(accepted)
        return Reply(200, {"MessageId": accepted.message_id},
                     headers={"x-amzn-RequestId": str(uuid.uuid4())})


def request_body(request: Request) -> dict[str, Any]:
    """A SendEmail request's JSON body."""
    body = json.loads(request.body)
    assert isinstance(body, dict)
    return body


# == Webhooks ==============================================================================
# SES events as SNS delivers them to an HTTPS subscription
# (https://docs.aws.amazon.com/sns/latest/dg/http-notification-json.html), signed the way
# "Verifying the signatures of Amazon SNS messages" describes: RSA PKCS#1 v1.5 with SHA1
# (SignatureVersion 1) or SHA256 (2) over "name\nvalue\n" for the type's fields, with a key
# whose certificate the test makes and trusts under an https://sns.<region>.amazonaws.com
# URL. SES event records in the shapes of
# https://docs.aws.amazon.com/ses/latest/dg/event-publishing-retrieving-sns-examples.html
# and .../notification-examples.html. For tests/test_webhooks_ses.py and the end-to-end ones.

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

#: The topic the tests' app is subscribed to (SES publishes to a topic of its own region).
SNS_REGION = REGION
TOPIC_ARN = f"arn:aws:sns:{SNS_REGION}:123456789012:outbox-ses-events"
#: Where the tests' signing certificate is (trusted locally, never fetched).
SIGNING_CERT_URL = (f"https://sns.{SNS_REGION}.amazonaws.com/"
                    "SimpleNotificationService-9c6465fa7f48f5cacd23014631ec1136.pem")
#: The SES message id of the sample records (what SendEmail answered).
SES_MESSAGE_ID = "0102018f2b7d5c1a-6e1b2c3d-4e5f-4a1b-9c8d-7e6f5a4b3c2d-000000"

_SNS_FIELDS = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                 "TopicArn", "Type"),
    "UnsubscribeConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                "TopicArn", "Type"),
}


@dataclasses.dataclass(frozen=True)
class SNSSigner:
    """An RSA key and its self-signed certificate, standing for SNS's, at ``url``."""

    key: rsa.RSAPrivateKey
    pem: bytes
    url: str


def sns_signer(url: str = SIGNING_CERT_URL, *,
               valid_from: datetime.datetime = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
               valid_until: datetime.datetime = datetime.datetime(2040, 1, 1,
                                                                  tzinfo=datetime.UTC),
               ) -> SNSSigner:
    """A new key and a self-signed certificate for it, named as SNS's is."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.amazonaws.com")])
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid_from).not_valid_after(valid_until)
                   .sign(key, hashes.SHA256()))
    return SNSSigner(key, certificate.public_bytes(serialization.Encoding.PEM), url)


def sns_timestamp(now: float) -> str:
    """``now`` as SNS writes its Timestamp: ISO 8601, milliseconds, Z."""
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def sign_sns(message: dict[str, Any], signer: SNSSigner, version: str = "2") -> dict[str, Any]:
    """``message`` with SignatureVersion, Signature and SigningCertURL, as SNS signs it."""
    fields = _SNS_FIELDS[message["Type"]]
    canonical = "".join(f"{name}\n{message[name]}\n" for name in fields if name in message)
    algorithm = hashes.SHA1() if version == "1" else hashes.SHA256()
    signature = signer.key.sign(canonical.encode(), padding.PKCS1v15(), algorithm)
    return {**message, "SignatureVersion": version,
            "Signature": base64.b64encode(signature).decode("ascii"),
            "SigningCertURL": signer.url}


def sns_request(message: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    """The headers (lower-case) and body SNS POSTs for a signed ``message``."""
    headers = {"x-amz-sns-message-type": str(message.get("Type")),
               "x-amz-sns-message-id": str(message.get("MessageId")),
               "x-amz-sns-topic-arn": str(message.get("TopicArn")),
               "content-type": "text/plain; charset=UTF-8",
               "user-agent": "Amazon Simple Notification Service Agent"}
    if message.get("Type") == "Notification":
        headers["x-amz-sns-subscription-arn"] = \
            f"{message.get('TopicArn')}:c9135db0-26c4-47ec-8998-413945fb5a96"
    return headers, json.dumps(message, indent=2).encode()


def notification(ses_event: dict[str, Any] | str, now: float, *, topic_arn: str = TOPIC_ARN,
                 message_id: str | None = None, subject: str | None = None) -> dict[str, Any]:
    """An unsigned SNS Notification carrying ``ses_event`` (JSON-encoded unless a string)."""
    message: dict[str, Any] = {
        "Type": "Notification",
        "MessageId": message_id or str(uuid.uuid4()),
        "TopicArn": topic_arn,
        "Message": ses_event if isinstance(ses_event, str) else json.dumps(ses_event),
        "Timestamp": sns_timestamp(now),
        "UnsubscribeURL": f"https://sns.{SNS_REGION}.amazonaws.com/?Action=Unsubscribe"
                          f"&SubscriptionArn={topic_arn}:c9135db0-26c4-47ec-8998-413945fb5a96",
    }
    if subject is not None:
        message["Subject"] = subject
    return message


def confirmation(now: float, *, kind: str = "SubscriptionConfirmation",
                 topic_arn: str = TOPIC_ARN) -> dict[str, Any]:
    """An unsigned SubscriptionConfirmation (or UnsubscribeConfirmation) as SNS sends it."""
    token = ("2336412f37fb687f5d51e6e241d09c805a5a57b30d712f794cc5f6a988666d92768dd60a747ba6f"
             "3beb71854e285d6ad02428b09ceece29417f1f02d609c582afbacc99c583a916b9981dd2728f4ae6"
             "fdb82efd087cc3b7849e05798d2d2785c03b0879594eeac82c01f235d0e717736")
    text = (f"You have chosen to subscribe to the topic {topic_arn}.\nTo confirm the "
            "subscription, visit the SubscribeURL included in this message.")
    if kind == "UnsubscribeConfirmation":
        text = (f"You have chosen to deactivate subscription {topic_arn}:"
                "2bcfbf39-05c3-41de-beaa-fcfcc21c8f55.\nTo cancel this operation and "
                "restore the subscription, visit the SubscribeURL included in this message.")
    return {
        "Type": kind,
        "MessageId": str(uuid.uuid4()),
        "Token": token,
        "TopicArn": topic_arn,
        "Message": text,
        "SubscribeURL": f"https://sns.{SNS_REGION}.amazonaws.com/?Action=ConfirmSubscription"
                        f"&TopicArn={topic_arn}&Token={token}",
        "Timestamp": sns_timestamp(now),
    }


def webhook_request(ses_event: dict[str, Any] | str, signer: SNSSigner, now: float, *,
                    topic_arn: str = TOPIC_ARN, version: str = "2",
                    message_id: str | None = None) -> tuple[dict[str, str], bytes]:
    """The headers and body SNS POSTs to deliver ``ses_event``, signed by ``signer``."""
    return sns_request(sign_sns(notification(ses_event, now, topic_arn=topic_arn,
                                             message_id=message_id), signer, version))


def ses_mail(destination: list[str], *, message_id: str = SES_MESSAGE_ID,
             timestamp: str = "2017-08-05T00:40:02.012Z") -> dict[str, Any]:
    """An SES record's ``mail`` object (the documentation's sample)."""
    return {
        "timestamp": timestamp,
        "source": "Sender Name <sender@example.com>",
        "sourceArn": "arn:aws:ses:us-east-1:123456789012:identity/sender@example.com",
        "sendingAccountId": "123456789012",
        "messageId": message_id,
        "destination": destination,
        "headersTruncated": False,
        "headers": [{"name": "From", "value": "Sender Name <sender@example.com>"},
                    {"name": "To", "value": ", ".join(destination)},
                    {"name": "Subject", "value": "Message sent from Amazon SES"}],
        "commonHeaders": {"from": ["Sender Name <sender@example.com>"], "to": destination,
                          "messageId": message_id, "subject": "Message sent from Amazon SES"},
        "tags": {"ses:configuration-set": ["ConfigSet"]},
    }


def ses_event(event_type: str, destination: list[str], detail: dict[str, Any] | None = None,
              *, notification_format: bool = False, message_id: str = SES_MESSAGE_ID,
              ) -> dict[str, Any]:
    """An SES record: ``eventType`` (event publishing) or ``notificationType`` (feedback
    notifications), ``mail``, and ``detail`` under the type's key (``bounce``...)."""
    keys = {"Rendering Failure": "failure", "DeliveryDelay": "deliveryDelay"}
    record: dict[str, Any] = {
        "notificationType" if notification_format else "eventType": event_type,
        "mail": ses_mail(destination, message_id=message_id),
    }
    if notification_format:
        del record["mail"]["tags"]
    if detail is not None:
        record[keys.get(event_type, event_type.lower())] = detail
    return record


def bounce_detail(recipients: list[tuple[str, str, str]], bounce_type: str = "Permanent",
                  sub_type: str = "General") -> dict[str, Any]:
    """A ``bounce`` object; ``recipients`` are (address, status, diagnosticCode)."""
    return {
        "bounceType": bounce_type,
        "bounceSubType": sub_type,
        "bouncedRecipients": [{"emailAddress": address, "action": "failed", "status": status,
                               "diagnosticCode": diagnostic}
                              for address, status, diagnostic in recipients],
        "timestamp": "2017-08-05T00:41:02.669Z",
        "feedbackId": "01000157c44f053b-61b59c11-9236-11e6-8f96-7be8aexample-000000",
        "reportingMTA": "dsn; mta.example.com",
    }


def complaint_detail(recipients: list[str]) -> dict[str, Any]:
    """A ``complaint`` object."""
    return {
        "complainedRecipients": [{"emailAddress": address} for address in recipients],
        "timestamp": "2017-08-05T00:41:02.669Z",
        "feedbackId": "01000157c44f053b-61b59c11-9236-11e6-8f96-7be8aexample-000000",
        "userAgent": "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36",
        "complaintFeedbackType": "abuse",
        "arrivalDate": "2017-08-05T00:41:02.669Z",
    }


def delivery_detail(recipients: list[str]) -> dict[str, Any]:
    """A ``delivery`` object."""
    return {
        "timestamp": "2016-10-19T23:21:04.133Z",
        "processingTimeMillis": 11893,
        "recipients": recipients,
        "smtpResponse": "250 2.6.0 Message received",
        "reportingMTA": "mta.example.com",
    }


def delay_detail(recipients: list[str]) -> dict[str, Any]:
    """A ``deliveryDelay`` object."""
    return {
        "timestamp": "2020-06-16T00:15:40.641Z",
        "delayType": "TransientCommunicationFailure",
        "expirationTime": "2020-06-16T00:25:40.914Z",
        "delayedRecipients": [{"emailAddress": address, "status": "4.4.1",
                               "diagnosticCode": "smtp; 421 4.4.1 Unable to connect to "
                                                 "remote host"} for address in recipients],
        "reportingMTA": "dsn; a1-2.smtp-out.amazonses.com",
    }


def subscription_detail(unsubscribe_all: bool) -> dict[str, Any]:
    """A ``subscription`` object (a recipient's topic preferences changed)."""
    return {
        "contactList": "ContactListName",
        "timestamp": "2022-01-12T01:00:17.910Z",
        "source": "UnsubscribeHeader",
        "newTopicPreferences": {
            "unsubscribeAll": unsubscribe_all,
            "topicSubscriptionStatus": [{"topicName": "ExampleTopicName",
                                         "subscriptionStatus": "OptOut"}],
        },
        "oldTopicPreferences": {
            "unsubscribeAll": False,
            "topicSubscriptionStatus": [{"topicName": "ExampleTopicName",
                                         "subscriptionStatus": "OptIn"}],
        },
    }
