"""Amazon SES: the stored MIME as raw content through the SES API v2, signed with SigV4.

One endpoint, ``SendEmail`` of the SES API v2
(https://docs.aws.amazon.com/ses/latest/APIReference-V2/API_SendEmail.html,
and botocore's own ``sesv2`` service model, which this follows for names,
status codes and error shapes)::

    POST {endpoint}/v2/email/outbound-emails
    {"Content": {"Raw": {"Data": base64(the stored MIME)}},
     "Destination": {"ToAddresses": [every envelope recipient]},
     "ConfigurationSetName": configuration_set}          -> 200 {"MessageId": "..."}

* The message goes as the outbox stored it, byte for byte (a ``DKIM-Signature``
  the outbox added is kept: SES documents manual DKIM signing of raw messages).
  ``FromEmailAddress`` is not sent: for raw content SES takes the sender from
  the ``From`` header (which is the envelope sender here), and setting it would
  replace that header.
* ``Destination`` is the SMTP envelope: every recipient, Bcc included (a raw
  message's headers carry no Bcc). SES does not rewrite the To/Cc headers from it.
* A request is signed with botocore's ``SigV4Auth`` (service ``ses``, the
  entry's ``region``) over a ``botocore.awsrequest.AWSRequest``, and the signed
  headers are copied onto the pooled httpx request. Credentials are the entry's
  ``access_key_id`` / ``secret_access_key``, or AWS's usual chain (environment,
  shared files and profiles, container and instance roles), refreshed by
  botocore when they expire.
* Errors (``x-amzn-ErrorType`` header, or ``__type`` / ``code`` in the JSON
  body, with ``message``) are classified on top of :class:`HTTPTransport`'s:
  TooManyRequestsException and Throttling are throttles, but a quota ("Daily
  message quota exceeded", with them or LimitExceededException) is the
  account's. The account's faults pause the transport (``account_fault``,
  see docs/guide/modes.md, "A paused transport"): the credential errors of 401 and 403
  (InvalidSignatureException, UnrecognizedClientException, ExpiredToken,
  AccessDenied...) are ``credentials``; a spent quota,
  AccountSuspendedException and SendingPausedException ``quota``;
  MailFromDomainNotVerifiedException, and a MessageRejected "not verified"
  that names the sender (or no address), ``sender``; NotFoundException (the
  configuration set) ``settings``. MessageRejected otherwise and
  BadRequestException (400) are permanent for that message; 5xx are
  transient faults.

What SES would refuse is refused at ``send()`` (:meth:`SESTransport.check_message`):
more than 50 recipients, a message over 40 MB (the v2 limit, attachments included
after MIME encoding; counted as 40,000,000 bytes, the stricter reading, since SES
does not say which megabyte it means: an assumption), and an address whose local
part is not ASCII (SES has no SMTPUTF8).

botocore is the ``ses`` extra; this module is imported only when an
``OUTBOX_TRANSPORTS`` entry names ``"ses"``. botocore ships no type
information: what is taken from it is typed ``Any``.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Mapping, Sequence
from email.headerregistry import Address
from email.parser import BytesHeaderParser
from email.policy import default as default_policy
from typing import Any, ClassVar

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import botocore.exceptions
import botocore.session
import httpx

from .._errors import (
    ConfigError,
    InvalidMessage,
    PermanentError,
    TransientError,
    TransportError,
)
from ._base import Delivered, Envelope, Result
from ._http import BadResponse, HTTPTransport, retry_after

logger = logging.getLogger(__name__)

#: SendEmail's path under the endpoint.
SEND_EMAIL_PATH = "/v2/email/outbound-emails"
#: The most recipients (To, Cc and Bcc together) SES takes in one message.
MAX_RECIPIENTS = 50
#: The largest message the SES API v2 takes, attachments included (40 MB, read as
#: decimal megabytes so that nothing SES refuses for its size gets past ``send()``).
MAX_MESSAGE_BYTES = 40_000_000
#: The name SigV4 signs for, for both SES APIs.
SIGNING_NAME = "ses"

_REGION = re.compile(r"[a-z]{2}(-[a-z0-9]+)+")
_KEYS = ("access_key_id", "secret_access_key")

#: Error types that say we are sending too fast or too much: no attempt is charged.
_THROTTLES = frozenset({"TooManyRequestsException", "LimitExceededException",
                        "Throttling", "ThrottlingException"})
#: Error types that say the credentials or their rights are wrong (401 and 403).
_CREDENTIALS = frozenset({
    "InvalidSignatureException", "IncompleteSignatureException", "SignatureDoesNotMatch",
    "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken",
    "ExpiredTokenException", "MissingAuthenticationTokenException",
    "AccessDeniedException", "AccessDenied",
})
#: Error types that stop every message of the account, whatever it holds.
_ACCOUNT = frozenset({"AccountSuspendedException", "SendingPausedException"})


class SESTransport(HTTPTransport):
    """Amazon SES (API v2 ``SendEmail``, raw content); see the module docstring.

    Entry keys: ``region`` (required), ``configuration_set``, ``endpoint_url``
    (``base_url`` means the same), ``access_key_id`` and ``secret_access_key``
    (both or neither), ``timeout``.
    """

    kind: ClassVar[str] = "ses"
    default_base_url: ClassVar[str] = "https://email.{region}.amazonaws.com"
    settings_keys: ClassVar[tuple[str, ...]] = (
        "region", "configuration_set", "endpoint_url", *_KEYS)
    required_keys: ClassVar[tuple[str, ...]] = ("region",)
    secret_keys: ClassVar[tuple[str, ...]] = ("secret_access_key",)
    max_batch: ClassVar[int] = 1

    def __init__(self, options: Mapping[str, Any], *, name: str = "default",
                 concurrency: int = 4) -> None:
        super().__init__(options, name=name, concurrency=concurrency)
        self.region = str(options["region"])
        self.configuration_set: str | None = options.get("configuration_set") or None
        self.base_url = endpoint_of(options).rstrip("/")
        self._credentials: Any = None
        #: The kind of refusal reported at ERROR and not yet followed by an accept.

    # -- settings ---------------------------------------------------------------------------

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """:class:`ConfigError` naming the key; without keys, AWS's chain must find some."""
        super().check_settings(options, prefix)
        region = str(options["region"])
        if not _REGION.fullmatch(region):
            raise ConfigError(f'{prefix}["region"]',
                              f"expected an AWS region such as 'eu-west-1', got {region!r}")
        configuration_set = options.get("configuration_set")
        if configuration_set is not None and (not isinstance(configuration_set, str)
                                              or not configuration_set.strip()):
            raise ConfigError(f'{prefix}["configuration_set"]',
                              f"expected the name of an SES configuration set, "
                              f"got {configuration_set!r}")
        endpoint_url = options.get("endpoint_url")
        if endpoint_url is not None:
            if not isinstance(endpoint_url, str) or not endpoint_url.startswith(
                    ("https://", "http://")):
                raise ConfigError(f'{prefix}["endpoint_url"]',
                                  f"expected an http(s) URL such as "
                                  f"'https://email.{region}.amazonaws.com', got {endpoint_url!r}")
            if options.get("base_url") is not None:
                raise ConfigError(f'{prefix}["endpoint_url"]',
                                  "set endpoint_url or base_url, not both: for the ses "
                                  "transport they are the same setting")
        given = [key for key in _KEYS if options.get(key) is not None]
        for key in given:
            value = options[key]
            if not isinstance(value, str) or not value.strip():
                shown = "" if key in cls.secret_keys else f", got {value!r}"
                raise ConfigError(f'{prefix}["{key}"]',
                                  f"expected a non-empty string{shown}")
        if len(given) == 1:
            missing = next(key for key in _KEYS if key not in given)
            raise ConfigError(f'{prefix}["{missing}"]',
                              f"{given[0]} is set, so {missing} must be too: set both, or "
                              "neither to use AWS's credential chain (environment, profile, "
                              "instance role)")
        if given:
            return
        try:
            found = chain_credentials()
        except botocore.exceptions.BotoCoreError as exc:  # a missing profile, a failing process
            raise ConfigError(prefix, f"AWS's credential chain failed: {type(exc).__name__}: "
                                      f"{exc}") from exc
        if found is None:
            raise ConfigError(prefix, "the ses transport found no AWS credentials: set "
                                      "access_key_id and secret_access_key in the entry, or "
                                      "provide them the AWS way (AWS_ACCESS_KEY_ID and "
                                      "AWS_SECRET_ACCESS_KEY, AWS_PROFILE and "
                                      "~/.aws/credentials, a container or instance role)")

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse what SES refuses: over 50 recipients, over 40 MB, a non-ASCII local part."""
        refusal = refusal_of(mime, recipients)
        if refusal is not None:
            raise InvalidMessage(*refusal)

    # -- the request ------------------------------------------------------------------------

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """One signed ``SendEmail`` of the first (and only) envelope."""
        envelope = envelopes[0]
        refusal = refusal_of(envelope.mime, envelope.recipients)
        if refusal is not None:  # queued before this transport was configured for it
            raise PermanentError(f"SES cannot take this message: {refusal[0]}: {refusal[1]}")
        body: dict[str, Any] = {
            "Content": {"Raw": {"Data": base64.b64encode(envelope.mime).decode("ascii")}},
            "Destination": {"ToAddresses": list(envelope.recipients)},
        }
        if self.configuration_set:
            body["ConfigurationSetName"] = self.configuration_set
        content = json.dumps(body).encode()
        url = self.base_url + SEND_EMAIL_PATH
        headers = self._signed_headers(url, content)
        return client.build_request("POST", url, content=content, headers=headers)

    def _signed_headers(self, url: str, content: bytes) -> dict[str, str]:
        """The SigV4 headers (``Authorization``, ``X-Amz-Date``...) for a POST of ``content``."""
        request = botocore.awsrequest.AWSRequest(
            method="POST", url=url, data=content,
            headers={"Content-Type": "application/json"})
        botocore.auth.SigV4Auth(self._frozen_credentials(), SIGNING_NAME,
                                self.region).add_auth(request)
        return {str(key): str(value) for key, value in request.headers.items()}

    def _frozen_credentials(self) -> Any:
        """The credentials to sign with now (the chain's refreshed when they expire)."""
        try:
            if self._credentials is None:
                self._credentials = entry_credentials(self.options) or chain_credentials()
            credentials = self._credentials
            if credentials is None:
                raise TransientError(
                    "ses: AWS's credential chain found no credentials", transport_fault=True)
            return credentials.get_frozen_credentials()
        except botocore.exceptions.BotoCoreError as exc:
            # A refresh that failed (an instance role unreachable, an expired SSO session).
            raise TransientError(f"ses: the AWS credentials could not be loaded: "
                                 f"{type(exc).__name__}: {exc}", transport_fault=True) from exc

    # -- the answer -------------------------------------------------------------------------

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """``{"MessageId": ...}``: the id SES gives the message (its Message-ID's left part)."""
        body = response.json()
        message_id = body.get("MessageId") if isinstance(body, Mapping) else None
        if not isinstance(message_id, str) or not message_id:
            raise BadResponse("no MessageId in the answer")
        return [Delivered(provider_message_id=message_id) for _ in envelopes]

    def error_detail(self, response: httpx.Response) -> str:
        """``<AWS error type>: <message>`` and the request id, for the error history."""
        error_type, message = aws_error(response)
        if not error_type and not message:
            return super().error_detail(response)
        detail = ": ".join(part for part in (error_type, message) if part)
        request_id = response.headers.get("x-amzn-RequestId")
        return self.outside(f"{detail} (request id {request_id})" if request_id else detail)

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransportError | None:
        """The SES error types classified differently from :class:`HTTPTransport`'s statuses."""
        status = response.status_code
        if status < 400:
            return None
        detail = self.error_detail(response)
        error_type, message = aws_error(response)
        said = (message or "").lower()
        if "quota" in said and (error_type in _THROTTLES or status == 429
                                or error_type == "LimitExceededException"):
            # "Daily message quota exceeded": no email goes until the quota resets.
            return TransientError(f"ses: the account's sending quota is spent (HTTP {status}): "
                                  f"{detail}", code=status, account_fault="quota")
        if error_type in _THROTTLES or status == 429:
            return TransientError(f"ses throttled the request (HTTP {status}): {detail}",
                                  code=status, throttled=True,
                                  retry_after=retry_after(response))
        if error_type in _CREDENTIALS or status in (401, 403):
            return TransientError(f"ses refused the credentials (HTTP {status}): {detail}; "
                                  f"check the AWS credentials of OUTBOX_TRANSPORTS"
                                  f"[{self.name!r}] (expired, rotated, for another region, or "
                                  "without ses:SendEmail)", code=status,
                                  account_fault="credentials")
        if error_type in _ACCOUNT:
            return TransientError(f"ses: the account cannot send in {self.region} (HTTP "
                                  f"{status}): {detail}; see its status in the SES console",
                                  code=status, account_fault="quota")
        if error_type == "MailFromDomainNotVerifiedException" or (
                error_type == "MessageRejected" and "not verified" in said
                and _names_the_sender(said, envelopes)):
            return TransientError(f"ses: the sender is not verified in {self.region} (HTTP "
                                  f"{status}): {detail}; verify the sending identity",
                                  code=status, account_fault="sender")
        if error_type == "NotFoundException" or status == 404:
            return TransientError(f"ses: not found (HTTP {status}): {detail}; check "
                                  f"configuration_set ({self.configuration_set!r}) and the "
                                  f"endpoint ({self.base_url})", code=status,
                                  account_fault="settings")
        return None



_ADDRESSES = re.compile(r"[^\s,:;<>]+@[^\s,:;<>]+[^\s,:;<>.]")


def _names_the_sender(said: str, envelopes: Sequence[Envelope]) -> bool:
    """Whether SES's "not verified" is about the sender, not only about recipients.

    Outside the sandbox SES checks the sender's identity; in the sandbox it also
    names each recipient it has not verified, which is that message's problem alone.
    """
    named = {address.lower() for address in _ADDRESSES.findall(said)}
    recipients = {address.lower() for envelope in envelopes for address in envelope.recipients}
    return not named or not named <= recipients


def endpoint_of(options: Mapping[str, Any]) -> str:
    """``endpoint_url`` (or ``base_url``), else SES's regional endpoint for ``region``."""
    given = options.get("endpoint_url") or options.get("base_url")
    if given:
        return str(given)
    region = str(options["region"])
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"https://email.{region}.{suffix}"


def entry_credentials(options: Mapping[str, Any]) -> Any:
    """The entry's own static credentials, or None when it sets none."""
    key_id, secret = (options.get(key) for key in _KEYS)
    if not key_id or not secret:
        return None
    return botocore.credentials.Credentials(str(key_id), str(secret))


def chain_credentials() -> Any:
    """What AWS's usual chain finds (environment, profile, roles), or None."""
    return botocore.session.get_session().get_credentials()


def refusal_of(mime: bytes, recipients: Sequence[str]) -> tuple[str, str] | None:
    """(field, problem) for a message SES would refuse, or None."""
    count = len({r.lower() for r in recipients})
    if count > MAX_RECIPIENTS:
        problem = (f"SES takes at most {MAX_RECIPIENTS} recipients per message (To, Cc and "
                   f"Bcc together), this one has {count}: send it as several messages")
        return "recipients", problem
    if len(mime) > MAX_MESSAGE_BYTES:
        problem = (f"the message is {len(mime)} bytes, and SES takes at most "
                   f"{MAX_MESSAGE_BYTES:,} (40 MB, attachments included)")
        return "message size", problem
    no_utf8 = "SES does not support SMTPUTF8, so the part before the @ must be ASCII"
    for address in recipients:
        if not address.isascii():
            return "recipients", f"{address!r}: {no_utf8}"
    headers = BytesHeaderParser(policy=default_policy).parsebytes(mime)
    for value in headers.get_all("From", []):
        for sender in getattr(value, "addresses", ()):
            if isinstance(sender, Address) and not sender.username.isascii():
                return "sender", f"{sender.addr_spec!r}: {no_utf8}"
    return None


def aws_error(response: httpx.Response) -> tuple[str, str]:
    """(error type, message) of an AWS JSON error answer; empty strings when absent.

    The type is in ``x-amzn-ErrorType`` (``Type:http://...``), else the body's
    ``__type`` (``namespace#Type``) or ``code``, as botocore's rest-json parser reads it.
    """
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, Mapping):
        body = {}
    error_type = response.headers.get("x-amzn-ErrorType", "").split(":", 1)[0].strip()
    if not error_type:
        found = body.get("__type") or body.get("code") or body.get("Code") or ""
        error_type = str(found).rsplit("#", 1)[-1].strip()
    message = body.get("message") or body.get("Message") or ""
    return error_type, str(message)
