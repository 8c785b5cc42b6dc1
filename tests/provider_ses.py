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
