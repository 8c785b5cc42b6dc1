"""Amazon SES's events, delivered by Amazon SNS to an HTTPS subscription.

What arrives (https://docs.aws.amazon.com/sns/latest/dg/http-notification-json.html
and .../http-subscription-confirmation-json.html): a JSON object with
``Type`` ``Notification``, ``SubscriptionConfirmation`` or
``UnsubscribeConfirmation``, ``MessageId``, ``TopicArn``, ``Message``,
``Timestamp`` (ISO 8601), ``SignatureVersion``, ``Signature`` and
``SigningCertURL``; a confirmation also has ``Token`` and ``SubscribeURL``. A
Notification's ``Message`` is SES's event as JSON text, in one of two shapes:
feedback notifications (``notificationType`` Bounce, Complaint, Delivery;
https://docs.aws.amazon.com/ses/latest/dg/notification-contents.html) or
event publishing through a configuration set (``eventType`` Send, Reject,
Bounce, Complaint, Delivery, Open, Click, Rendering Failure, DeliveryDelay,
Subscription; https://docs.aws.amazon.com/ses/latest/dg/event-publishing-retrieving-sns-contents.html).
Both carry ``mail.messageId``, the ``MessageId`` SendEmail answered, which the
ses transport stores as ``provider_message_id``.

How it is verified ("Verifying the signatures of Amazon SNS messages",
https://docs.aws.amazon.com/sns/latest/dg/sns-verify-signature-of-message.html):

1. ``TopicArn`` must be one of the topics in ``webhook_secret`` (403). Anyone
   can create an SNS topic that posts to this URL with genuine AWS
   signatures: the topic is what makes a notification ours.
2. ``SigningCertURL`` must be exactly
   ``https://sns.<region>.amazonaws.com[.cn]/SimpleNotificationService-<id>.pem``
   (403, checked before anything is fetched; the region as AWS writes one, so
   no other amazonaws.com host, such as an S3 bucket's, passes); the
   certificate is fetched from there over verified TLS (:class:`SNSCertificates`:
   cached, a failure remembered for a minute, one fetch at a time and a few a
   minute, since the request is not verified yet) and must be inside its
   validity dates. A fetch that fails is refused with 503, so SNS retries: an
   outage is not a forgery.
3. ``SignatureVersion`` 1 is SHA1withRSA, 2 SHA256withRSA, over the canonical
   string: ``name\\nvalue\\n`` for Message, MessageId, Subject (when present),
   Timestamp, TopicArn, Type of a Notification, and Message, MessageId,
   SubscribeURL, Timestamp, Token, TopicArn, Type of a confirmation. Any
   other version, or a signature that does not verify, is refused with 403.
   ``webhook_secret`` may be ``{"topics": [...], "signature_versions": ["2"]}``
   to refuse version 1 (set the topic's ``SignatureVersion`` attribute to 2
   first).
4. ``Timestamp`` must be within :data:`~._base.TOLERANCE_SECONDS` (403). SNS
   keeps a message's Timestamp on its retries: its default policy (three
   retries 20 s apart) stays inside the window, a custom delivery policy
   retrying for longer will see its late retries refused.

A body without ``Signature`` / ``SigningCertURL`` (raw message delivery
turned on) is refused with 401: raw delivery must be off. A
SubscriptionConfirmation that verifies answers ``confirm_url`` (its
``SubscribeURL``, which must pass the same host rule): the route fetches it
after answering, and the subscription is confirmed. An UnsubscribeConfirmation
that verifies carries nothing. The first notification SES sends to a topic
("Successfully validated SNS topic for Amazon SES event publishing.", or a
``notificationType`` AmazonSnsSubscriptionSucceeded) carries nothing.

======================  =======================================================
SES event               event, one per recipient
======================  =======================================================
Bounce                  ``bounced`` per ``bouncedRecipients``: bounceType
                        Permanent -> ``permanent``, Transient and
                        Undetermined -> ``transient``; ``diagnosticCode`` ->
                        ``mta_response``, type, subtype and ``status`` ->
                        ``description``
Complaint               ``complained`` per ``complainedRecipients``
Delivery                ``delivered`` per ``delivery.recipients``
                        (``smtpResponse`` -> ``mta_response``)
DeliveryDelay           ``deferred`` per ``delayedRecipients``
Reject                  ``rejected`` (SES found a virus; the reason in
                        ``description``)
Rendering Failure       ``rejected`` (the template's error in ``description``)
Open, Click             ``opened``, ``clicked`` per ``mail.destination``
Subscription            ``unsubscribed`` when ``unsubscribeAll`` is set, else
                        ``unknown`` (one topic's preference is not the address)
Send, anything else     ``unknown``, the type in ``description``
======================  =======================================================

``provider_event_id`` is the SNS ``MessageId`` (the same on SNS's retries)
and ``":<recipient>"``. ``occurred_at`` is the event object's ``timestamp``
(``mail.timestamp`` for Send, Reject and Rendering Failure, which have none).
What SES does not give: which recipient opened or clicked (SES does not
track them apart), so an open or a click is recorded for every
``mail.destination``, as Anymail does.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hmac
import re
import threading
import time
from collections.abc import Mapping
from datetime import UTC
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from .._errors import ConfigError
from .._events import DeliveryEvent, capped_payload
from .._reasons import ses_reason, smtp_reason, text_reason
from ._base import (
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    bounded_id,
    bounded_json,
    check_timestamp,
    iso_time,
    joined,
    json_body,
    json_object,
    outside_recipient,
)

__all__ = [
    "DEFAULT_CERTIFICATES",
    "CertificateUnavailable",
    "SESReceiver",
    "SNSCertificates",
    "sns_url_allowed",
]

#: A topic ARN as SNS writes it (standard, China and GovCloud partitions).
TOPIC_ARN = re.compile(r"arn:aws(-cn|-us-gov)?:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_-]{1,256}")
#: The hosts SNS signs from and confirms on: ``sns.<region>.amazonaws.com[.cn]``, the
#: region as AWS names them (``us-east-1``, ``us-gov-west-1``, ``cn-north-1``), so that
#: another service's host under amazonaws.com (``sns.s3.amazonaws.com``, an S3 bucket
#: anyone can create) is not taken.
SNS_HOST = re.compile(r"sns\.[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]{1,2}\.amazonaws\.com(\.cn)?")
#: A signing certificate's URL, whole: https, an SNS host, SNS's certificate path.
SIGNING_CERT_URL = re.compile(r"https://(?P<host>[A-Za-z0-9.-]{1,100})(:443)?"
                              r"/SimpleNotificationService-[A-Za-z0-9]{1,64}\.pem")

#: The fields each SNS message type signs, in the order they are signed.
SIGNED_FIELDS = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                 "TopicArn", "Type"),
    "UnsubscribeConfirmation": ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token",
                                "TopicArn", "Type"),
}
#: SignatureVersion -> the hash of its RSA PKCS#1 v1.5 signature.
SIGNATURE_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"1": hashes.SHA1, "2": hashes.SHA256}
#: The versions accepted unless ``webhook_secret`` says otherwise (a topic signs with
#: version 1, SHA-1, until its ``SignatureVersion`` attribute is set to 2).
DEFAULT_SIGNATURE_VERSIONS = ("1", "2")

#: What SES publishes first to a topic it was given, not an event.
SETUP_MESSAGE = "Successfully validated SNS topic for Amazon SES event publishing."


class CertificateUnavailable(Exception):
    """The signing certificate could not be had (network, TLS, HTTP status, not PEM)."""


class SNSCertificates:
    """SNS signing certificates by URL: fetched over verified TLS, cached, or trusted locally.

    ``client`` is the ``httpx.Client`` fetches go through (made on first use
    when not given: TLS verified, ``timeout`` seconds, no redirects). A fetched
    certificate is kept ``ttl`` seconds, at most ``max_entries`` of them; an
    answer over ``max_bytes`` is not read further. A fetch that failed is
    remembered ``failure_ttl`` seconds, and at most ``fetches_per_minute``
    fetches start in a minute (see :meth:`get`). :meth:`trust` pre-seeds one
    that never expires from the cache and is never fetched (tests, and
    deployments that cannot reach AWS). The URL is assumed already checked
    with :func:`sns_url_allowed`. Safe to share between threads.
    """

    def __init__(self, client: httpx.Client | None = None, *, ttl: float = 24 * 3600.0,
                 max_entries: int = 32, max_bytes: int = 64 * 1024,
                 timeout: float = 5.0, failure_ttl: float = 60.0,
                 fetches_per_minute: int = 6) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.failure_ttl = failure_ttl
        self.fetches_per_minute = fetches_per_minute
        self._client = client
        self._own_client = client is None
        self._lock = threading.Lock()
        # One fetch at a time: requests naming many URLs wait their turn, not a thread each.
        self._fetching = threading.Lock()
        self._cached: collections.OrderedDict[str, tuple[float, x509.Certificate]] = \
            collections.OrderedDict()
        self._failed: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()
        self._fetched_at: collections.deque[float] = collections.deque()
        self._trusted: dict[str, x509.Certificate] = {}

    def trust(self, url: str, pem: bytes | str) -> None:
        """Use the certificate ``pem`` for ``url`` from now on, without fetching it."""
        certificate = x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str)
                                                     else pem)
        with self._lock:
            self._trusted[url] = certificate

    def get(self, url: str) -> x509.Certificate:
        """The certificate at ``url``; raises :class:`CertificateUnavailable`.

        A request that is not signed yet (anyone knowing the topic ARN can send
        one) costs at most one fetch: a failed fetch is remembered for
        ``failure_ttl`` seconds, fetches run one at a time, and at most
        ``fetches_per_minute`` of them start in a minute (more are refused
        without a fetch, and SNS retries).
        """
        found = self._known(url)
        if found is not None:
            return found
        with self._fetching:
            found = self._known(url)  # fetched by the request this one waited for
            if found is not None:
                return found
            now = time.monotonic()
            with self._lock:
                while self._fetched_at and self._fetched_at[0] <= now - 60.0:
                    self._fetched_at.popleft()
                if len(self._fetched_at) >= self.fetches_per_minute:
                    raise CertificateUnavailable(f"more than {self.fetches_per_minute} "
                                                 "certificate fetches in a minute")
                self._fetched_at.append(now)
            try:
                certificate = self._fetch(url)
            except CertificateUnavailable as exc:
                with self._lock:
                    self._failed[url] = (time.monotonic() + self.failure_ttl, str(exc))
                    while len(self._failed) > self.max_entries:
                        self._failed.popitem(last=False)
                raise
            with self._lock:
                self._failed.pop(url, None)
                self._cached[url] = (time.monotonic() + self.ttl, certificate)
                self._cached.move_to_end(url)
                while len(self._cached) > self.max_entries:
                    self._cached.popitem(last=False)
            return certificate

    def _known(self, url: str) -> x509.Certificate | None:
        """The certificate of ``url`` trusted or cached; a failure remembered raises."""
        with self._lock:
            trusted = self._trusted.get(url)
            if trusted is not None:
                return trusted
            now = time.monotonic()
            cached = self._cached.get(url)
            if cached is not None and cached[0] > now:
                self._cached.move_to_end(url)
                return cached[1]
            failed = self._failed.get(url)
            if failed is not None and failed[0] > now:
                raise CertificateUnavailable(f"{failed[1]} (a fetch that failed "
                                             f"less than {self.failure_ttl:g} s ago)")
        return None

    def close(self) -> None:
        """Close the client this instance made (a given one is the caller's)."""
        with self._lock:
            client = self._client if self._own_client else None
            if client is not None:
                self._client = None
        if client is not None:
            client.close()

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout, follow_redirects=False)
            return self._client

    def _fetch(self, url: str) -> x509.Certificate:
        try:
            with self._http().stream("GET", url, timeout=self.timeout,
                                     follow_redirects=False) as response:
                if response.status_code != 200:
                    raise CertificateUnavailable(f"HTTP {response.status_code}")
                data = b""
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise CertificateUnavailable(f"the answer is over {self.max_bytes:,} "
                                                     "bytes")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise CertificateUnavailable(f"{type(exc).__name__}: {exc}") from exc
        try:
            return x509.load_pem_x509_certificate(data)
        except ValueError as exc:
            raise CertificateUnavailable("the answer is not a PEM certificate") from exc


#: The certificates every :class:`SESReceiver` shares unless given its own.
DEFAULT_CERTIFICATES = SNSCertificates()


def sns_url_allowed(url: Any, *, pem: bool = False) -> bool:
    """True for ``https://sns.<region>.amazonaws.com[.cn]/...``.

    With ``pem``: exactly ``https://sns.<region>.amazonaws.com[.cn]/SimpleNotificationService-<id>.pem``,
    the only path SNS signs from. Printable ASCII only (``urlsplit`` drops a TAB
    or a line break silently; the HTTP client would refuse them).
    """
    if not isinstance(url, str) or len(url) > 2048 or not url.isascii() \
            or not url.isprintable() or " " in url:
        return False
    if pem:
        whole = SIGNING_CERT_URL.fullmatch(url)
        return whole is not None and SNS_HOST.fullmatch(whole["host"].lower()) is not None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    return (parts.scheme == "https" and parts.username is None and parts.password is None
            and port in (None, 443) and SNS_HOST.fullmatch(parts.hostname or "") is not None)


class SESReceiver(Receiver):
    """SES events through an SNS HTTPS subscription (see the module docstring).

    ``webhook_secret`` is the SNS topic ARN the endpoint is subscribed to,
    or a list of them. ``certificates`` (or the entry's ``certificates``
    option) is the :class:`SNSCertificates` to use, :data:`DEFAULT_CERTIFICATES`
    otherwise.
    """

    kind = "ses"

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None, *,
                 certificates: SNSCertificates | None = None) -> None:
        super().__init__(name, secret, options)
        self.topics = tuple(_topics(secret, "webhook_secret"))
        self.signature_versions = _signature_versions(secret, "webhook_secret")
        self.certificates: SNSCertificates = (certificates or self.options.get("certificates")
                                              or DEFAULT_CERTIFICATES)

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """One topic ARN, a non-empty list of them, or ``{"topics": ..., "signature_versions": ...}``."""
        _topics(secret, key)
        _signature_versions(secret, key)

    def receive(self, request: WebhookRequest) -> Received:
        """Verify the SNS message; a Notification's SES event becomes events."""
        message = json_body(request)
        if not isinstance(message, dict) or not isinstance(message.get("Type"), str) \
                or message["Type"] not in SIGNED_FIELDS:
            raise WebhookRefused(400, "the body is not an SNS message: expected an object whose "
                                 "Type is Notification, SubscriptionConfirmation or "
                                 "UnsubscribeConfirmation")
        self._verify(message, request.now)
        kind = message["Type"]
        if kind == "SubscriptionConfirmation":
            return Received(confirm_url=message["SubscribeURL"])
        if kind == "UnsubscribeConfirmation":
            return Received()
        return Received(events=tuple(self._events(message)))

    # -- verification ---------------------------------------------------------------------

    def _verify(self, message: dict[str, Any], now: float) -> None:
        if not all(message.get(field) for field in ("Signature", "SigningCertURL",
                                                     "SignatureVersion")):
            raise WebhookRefused(401, "the SNS message is not signed (Signature, "
                                 "SigningCertURL and SignatureVersion are required; raw "
                                 "message delivery must be off)")
        topic = message.get("TopicArn")
        if not isinstance(topic, str) or not any(
                hmac.compare_digest(topic.encode("utf-8", "surrogatepass"), ours.encode()) for ours in self.topics):
            raise WebhookRefused(403, "the notification comes from a topic that is not this "
                                 "transport's (webhook_secret lists the subscribed topic ARNs)")
        version = message["SignatureVersion"]
        algorithm = SIGNATURE_HASHES.get(version) if isinstance(version, str) else None
        if algorithm is None or version not in self.signature_versions:
            raise WebhookRefused(403, f"SignatureVersion must be "
                                 f"{' or '.join(self.signature_versions)} (webhook_secret's "
                                 "signature_versions)")
        url = message["SigningCertURL"]
        if not sns_url_allowed(url, pem=True):
            raise WebhookRefused(403, "SigningCertURL is not an https://sns.<region>."
                                 "amazonaws.com/ certificate URL")
        canonical = _canonical(message)
        signed_at = iso_time(message["Timestamp"])
        if signed_at is None:
            raise WebhookRefused(403, "the SNS Timestamp is not an ISO 8601 time")
        check_timestamp(signed_at.replace(tzinfo=UTC).timestamp(), now)
        if message["Type"] != "Notification" and not sns_url_allowed(message["SubscribeURL"]):
            raise WebhookRefused(403, "SubscribeURL is not an https://sns.<region>."
                                 "amazonaws.com/ URL")
        try:
            signature = base64.b64decode(str(message["Signature"]), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookRefused(403, "the SNS signature is not base64") from None
        try:
            certificate = self.certificates.get(url)
        except CertificateUnavailable as exc:
            raise WebhookRefused(503, f"the SNS signing certificate could not be fetched "
                                 f"({exc}); SNS will retry") from None
        if not (certificate.not_valid_before_utc.timestamp() <= now
                <= certificate.not_valid_after_utc.timestamp()):
            raise WebhookRefused(403, "the SNS signing certificate is outside its validity "
                                 "dates")
        key = certificate.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise WebhookRefused(403, "the SNS signing certificate's key is not RSA")
        try:
            key.verify(signature, canonical, padding.PKCS1v15(), algorithm())
        except InvalidSignature:
            raise WebhookRefused(403, "the SNS signature does not verify") from None

    # -- events ---------------------------------------------------------------------------

    def _events(self, message: dict[str, Any]) -> list[DeliveryEvent]:
        text = message["Message"]
        if text.strip() == SETUP_MESSAGE:
            return []
        event = bounded_json(text, "the notification's Message (an SNS topic that SES does "
                                   "not publish to?)")
        if not isinstance(event, dict):
            raise WebhookRefused(400, "the notification's Message is not an SES event object")
        kind = event.get("eventType", event.get("notificationType"))
        if kind == "AmazonSnsSubscriptionSucceeded":
            return []
        mail = event.get("mail")
        if not isinstance(kind, str) or not isinstance(mail, dict):
            raise WebhookRefused(400, "the notification's Message is not an SES event: "
                                 "expected eventType or notificationType, and mail")
        base = _SESEvent(self.name, message, event, mail)
        if kind == "Bounce":
            bounce = json_object(event.get("bounce"))
            bounce_kind = "permanent" if bounce.get("bounceType") == "Permanent" \
                else "transient"
            kinds = joined("/", bounce.get("bounceType"), bounce.get("bounceSubType"))
            return [base.one("bounced", entry.get("emailAddress"), bounce, bounce_kind=bounce_kind,
                             description=joined(" ", kinds, _parenthesized(entry.get("status"))),
                             mta_response=_text(entry.get("diagnosticCode")),
                             reason=ses_reason(bounce.get("bounceType"),
                                               bounce.get("bounceSubType"),
                                               joined(" ", entry.get("status"),
                                                      entry.get("diagnosticCode"))))
                    for entry in _entries(bounce.get("bouncedRecipients"))] \
                or base.each("bounced", bounce, bounce_kind=bounce_kind, description=kinds,
                             reason=ses_reason(bounce.get("bounceType"),
                                               bounce.get("bounceSubType")))
        if kind == "Complaint":
            complaint = json_object(event.get("complaint"))
            description = joined(": ", "complaint", complaint.get("complaintFeedbackType")
                                  or complaint.get("complaintSubType"))
            return [base.one("complained", entry.get("emailAddress"), complaint,
                             description=description, reason="complaint")
                    for entry in _entries(complaint.get("complainedRecipients"))] \
                or base.each("complained", complaint, description=description,
                             reason="complaint")
        if kind == "Delivery":
            delivery = json_object(event.get("delivery"))
            return base.each("delivered", delivery, _unique(_list(delivery.get("recipients"))),
                             mta_response=_text(delivery.get("smtpResponse")))
        if kind == "DeliveryDelay":
            delay = json_object(event.get("deliveryDelay"))
            return [base.one("deferred", entry.get("emailAddress"), delay,
                             description=joined(" ", _text(delay.get("delayType")),
                                                 _parenthesized(entry.get("status"))),
                             mta_response=_text(entry.get("diagnosticCode")),
                             reason=_delay_reason(delay, entry))
                    for entry in _entries(delay.get("delayedRecipients"))] \
                or base.each("deferred", delay, description=_text(delay.get("delayType")),
                             reason=_delay_reason(delay, {}))
        if kind == "Reject":
            reject = json_object(event.get("reject"))
            return base.each("rejected", reject, description=joined(
                ": ", "rejected by SES", reject.get("reason")),
                reason=text_reason(_text(reject.get("reason"))) or "policy")
        if kind == "Rendering Failure":
            failure = json_object(event.get("failure"))
            return base.each("rejected", failure, description=joined(
                ": ", "rendering failure", failure.get("templateName"),
                failure.get("errorMessage")), reason="content")
        if kind in ("Open", "Click"):
            detail = json_object(event.get(kind.lower()))
            return base.each("opened" if kind == "Open" else "clicked", detail,
                             description=_text(detail.get("link")))
        if kind == "Subscription":
            subscription = json_object(event.get("subscription"))
            preferences = json_object(subscription.get("newTopicPreferences"))
            if preferences.get("unsubscribeAll") is True:
                return base.each("unsubscribed", subscription, description=joined(
                    ": ", "unsubscribed from all topics", subscription.get("contactList")))
            return base.each("unknown", subscription, description=joined(
                ": ", "Subscription (topic preferences changed)",
                subscription.get("contactList")))
        return base.each("unknown", {}, description=kind)


#: SES's ``delayType`` -> reason (others: the diagnostic's).
_DELAY_TYPES = {"MailboxFull": "mailbox_full", "SpamDetected": "spam",
                "RecipientServerError": "system_error", "IPFailure": "blocked",
                "TransientCommunicationFailure": "network_error",
                "BYOIPHostNameLookupUnavailable": "network_error",
                "SendingDeferral": "rate_limited"}


def _delay_reason(delay: dict[str, Any], entry: Any) -> str:
    """The reason of an SES delivery delay: its ``delayType``, else the recipient's reply."""
    kind = delay.get("delayType")
    if isinstance(kind, str) and kind in _DELAY_TYPES:
        return _DELAY_TYPES[kind]
    found = entry if isinstance(entry, dict) else {}
    return smtp_reason(joined(" ", found.get("status"), found.get("diagnosticCode")))


class _SESEvent:
    """What every event of one SES notification shares."""

    def __init__(self, transport: str, message: dict[str, Any], event: dict[str, Any],
                 mail: dict[str, Any]) -> None:
        self.transport = transport
        self.sns_id = str(message["MessageId"])
        self.fallback = iso_time(mail.get("timestamp")) or iso_time(message.get("Timestamp"))
        self.message_id = mail.get("messageId") if isinstance(mail.get("messageId"), str) \
            else None
        self.destination = _unique(_list(mail.get("destination")))
        self.payload = capped_payload(event)

    def one(self, event_type: str, recipient: Any, detail: dict[str, Any],
            **fields: Any) -> DeliveryEvent:
        """The event for ``recipient``, at ``detail``'s timestamp."""
        address = recipient if isinstance(recipient, str) and recipient else None
        return DeliveryEvent(
            event_type=event_type, recipient=outside_recipient(address),
            occurred_at=iso_time(detail.get("timestamp")) or self.fallback,
            transport=self.transport,
            provider_event_id=bounded_id(f"{self.sns_id}:{address}" if address
                                         else self.sns_id),
            provider_message_id=self.message_id, payload=self.payload, **fields)

    def each(self, event_type: str, detail: dict[str, Any],
             recipients: list[str] | None = None, **fields: Any) -> list[DeliveryEvent]:
        """The event for each of ``recipients`` (``mail.destination``), or one for nobody."""
        targets: list[str | None] = [*(recipients or self.destination)] or [None]
        return [self.one(event_type, recipient, detail, **fields) for recipient in targets]


def _signature_versions(secret: Any, key: str) -> tuple[str, ...]:
    """The SignatureVersions ``webhook_secret`` accepts (both unless it says), or a ``ConfigError``."""
    if not isinstance(secret, Mapping) or "signature_versions" not in secret:
        return DEFAULT_SIGNATURE_VERSIONS
    versions = secret["signature_versions"]
    if isinstance(versions, str) or not isinstance(versions, (list, tuple)) or not versions \
            or any(v not in SIGNATURE_HASHES for v in versions):
        raise ConfigError(f'{key}["signature_versions"]', 'expected a non-empty list of "1" '
                          '(SHA1withRSA) and "2" (SHA256withRSA); ["2"] refuses SHA-1, once the '
                          "topic's SignatureVersion attribute is 2")
    return tuple(dict.fromkeys(versions))


def _topics(secret: Any, key: str) -> list[str]:
    """The topic ARNs of ``webhook_secret``, or a ``ConfigError``."""
    if isinstance(secret, Mapping):
        unknown = sorted(set(secret) - {"topics", "signature_versions"}, key=str)
        if unknown:
            raise ConfigError(key, f"unknown setting {unknown[0]!r}; an SES webhook_secret is a "
                              'topic ARN, a list of them, or a dict with "topics" and '
                              '"signature_versions"')
        if "topics" not in secret:
            raise ConfigError(f'{key}["topics"]', "expected the SNS topic ARN (or a list of "
                              "them) the endpoint is subscribed to")
        secret = secret["topics"]
        key = f'{key}["topics"]'
    topics = [secret] if isinstance(secret, str) else secret
    if not isinstance(topics, (list, tuple)) or not topics:
        raise ConfigError(key, "expected the SNS topic ARN the endpoint is subscribed to "
                          "(arn:aws:sns:<region>:<account id>:<topic name>), or a list of them")
    for index, topic in enumerate(topics):
        if not isinstance(topic, str) or TOPIC_ARN.fullmatch(topic) is None:
            where = "" if isinstance(secret, str) else f" (entry {index})"
            raise ConfigError(key, f"not an SNS topic ARN{where}: expected "
                              "arn:aws:sns:<region>:<12-digit account id>:<topic name>")
    return list(topics)


def _canonical(message: dict[str, Any]) -> bytes:
    """The string SNS signed: ``name\\nvalue\\n`` for each signed field present, in order."""
    lines: list[str] = []
    for field in SIGNED_FIELDS[message["Type"]]:
        value = message.get(field)
        if value is None and field == "Subject":
            continue
        if not isinstance(value, str):
            raise WebhookRefused(400, f"the SNS message has no {field} string")
        lines += [field, value]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _entries(value: Any) -> list[dict[str, Any]]:
    return [entry for entry in _list(value) if isinstance(entry, dict)]


def _unique(values: list[Any]) -> list[str]:
    """The non-empty strings of ``values``, each once, in order."""
    return list(dict.fromkeys(v for v in values if isinstance(v, str) and v))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _parenthesized(value: Any) -> str:
    return f"({value})" if isinstance(value, str) and value else ""
