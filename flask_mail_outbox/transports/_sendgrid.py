"""SendGrid: the v3 Mail Send API, one JSON request per message.

Implemented from SendGrid's documentation (Twilio SendGrid, "Mail Send",
https://www.twilio.com/docs/sendgrid/api-reference/mail-send/mail-send, and its
OpenAPI description ``tsg_mail_v3``; "Errors",
https://www.twilio.com/docs/sendgrid/api-reference/mail-send/errors; "Rate Limits",
https://www.twilio.com/docs/sendgrid/api-reference/how-to-use-the-sendgrid-v3-api/rate-limits):

* ``POST {base_url}/v3/mail/send`` with ``Authorization: Bearer <api_key>`` and a
  JSON body: one ``personalizations`` entry (``to``, ``cc``, ``bcc`` as
  ``{email, name}``), ``from``, ``reply_to`` (one address) or ``reply_to_list``
  (several), ``subject``, ``content`` (``text/plain`` first, then ``text/html``,
  the order the API requires), ``attachments`` (base64 ``content``, ``type``,
  ``filename``, ``disposition`` ``attachment`` or ``inline`` with its
  ``content_id``) and ``headers`` (every other header of the stored message);
* success is ``202 Accepted`` with an empty body and the ``X-Message-Id``
  header, stored as the row's provider message id. A ``200`` means "valid but
  not queued" (sandbox mode only): the message did not go, so it is a
  transient error like any 2xx the API does not document for a send;
* errors are ``{"errors": [{"message", "field", "help"}]}`` with 400
  (the message: permanent), 401/403 (the key), 413 (too large: permanent),
  429 (throttled; the documented ``X-RateLimit-Reset`` epoch, or a
  ``Retry-After``, says when to come back) and 5xx (transient, fails over).

What the API cannot take is refused at ``send()`` (:meth:`SendGridTransport.check_message`):
a header it reserves (``x-sg-id``, ``x-sg-eid``, ``received``; the others of
its list are fields here, and ``DKIM-Signature`` is left out because SendGrid
signs the message itself), a header name used twice (``headers`` is an
object), a message without a To address, subject or body, more than 1000
recipients, more than 30 MB, and a body part other than text and html (an
``alts`` part) that this transport cannot pass on yet.

Assumed where the docs are silent: an address named twice (To and Cc) is sent
once, in its first place (the API refuses duplicates; SMTP delivers one copy
too); an attachment without a file name is named by its Content-ID or its
position (the API requires ``filename``); a header value that is not ASCII is
sent RFC 2047-encoded ("you must ensure these are properly encoded"). There
is no idempotency key: a crash between SendGrid's accept and the outbox's
record sends the message again on retry.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from email.header import Header
from typing import Any, ClassVar

import httpx

from .._errors import InvalidMessage, PermanentError, TransientError
from ._base import Delivered, Envelope, Result
from ._http import MAX_RETRY_AFTER, BadResponse, HTTPTransport, retry_after
from ._parts import Address, MessageParts, parts_of, refuse_dropped

#: The headers SendGrid's ``headers`` object may not set (its docs' list, lower case).
RESERVED_HEADERS = frozenset({
    "x-sg-id", "x-sg-eid", "received", "dkim-signature", "content-type",
    "content-transfer-encoding", "to", "from", "subject", "reply-to", "cc", "bcc",
})
#: Reserved headers left out rather than refused: SendGrid DKIM-signs every message itself.
DROPPED_HEADERS = frozenset({"dkim-signature"})
#: The most recipients (to + cc + bcc) one request may have.
MAX_RECIPIENTS = 1000
#: "The total size of your email, including attachments, must be less than 30MB."
MAX_MESSAGE_BYTES = 30_000_000
#: The API's path for a send, under ``base_url``.
SEND_PATH = "/v3/mail/send"


class SendGridTransport(HTTPTransport):
    """Sends through SendGrid's v3 Mail Send API (see the module docstring).

    Its ``OUTBOX_TRANSPORTS`` entry takes ``api_key`` (required) and
    ``base_url`` (``https://api.sendgrid.com``; ``https://api.eu.sendgrid.com``
    for an EU regional subuser).
    """

    kind: ClassVar[str] = "sendgrid"
    default_base_url: ClassVar[str] = "https://api.sendgrid.com"
    settings_keys: ClassVar[tuple[str, ...]] = ("api_key",)
    required_keys: ClassVar[tuple[str, ...]] = ("api_key",)
    secret_keys: ClassVar[tuple[str, ...]] = ("api_key",)
    max_batch: ClassVar[int] = 1

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse what SendGrid cannot take (see the module docstring); nothing is written."""
        if len(mime) >= MAX_MESSAGE_BYTES:
            raise InvalidMessage("attachments", f"the message is {len(mime)} bytes; SendGrid "
                                 f"takes less than {MAX_MESSAGE_BYTES} (30 MB) per email")
        parts = parts_of(Envelope(0, "", tuple(recipients), mime, ""))
        check_parts(parts)
        refuse_dropped(parts, "sendgrid")

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """``POST /v3/mail/send`` with the message as SendGrid's JSON fields."""
        parts = parts_of(envelopes[0])
        try:
            check_parts(parts)
        except InvalidMessage as exc:  # stored before this transport was configured for it
            raise PermanentError(f"sendgrid cannot take this message: {exc}") from exc
        return client.build_request(
            "POST", self.base_url + SEND_PATH, json=mail_send_body(parts),
            headers={"Authorization": f"Bearer {self.options['api_key']}",
                     "Accept": "application/json"})

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """202 is queued: the ``X-Message-Id`` header is the provider's id."""
        if response.status_code != 202:
            raise BadResponse(f"a send is answered 202 Accepted; {response.status_code} means "
                              "SendGrid did not queue it (200 is its sandbox mode)")
        # A 202 without the header was still accepted: sending it again would be a duplicate.
        message_id = response.headers.get("X-Message-Id") or None
        return [Delivered(provider_message_id=message_id) for _ in envelopes]

    def error_detail(self, response: httpx.Response) -> str:
        """SendGrid's ``errors`` list as ``field: message`` pairs (the whole text otherwise)."""
        try:
            body = response.json()
        except ValueError:
            return super().error_detail(response)
        errors = body.get("errors") if isinstance(body, Mapping) else None
        if not isinstance(errors, list) or not errors:
            return super().error_detail(response)
        found = []
        for error in errors:
            if not isinstance(error, Mapping):
                continue
            field = error.get("field")
            text = str(error.get("message") or "").strip()
            found.append(f"{field}: {text}" if field and field != "null" else text)
        return self.outside("; ".join(found)) or super().error_detail(response)

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransientError | None:
        """A 429: SendGrid documents X-RateLimit-Reset (a Unix time), not Retry-After.

        A 401 or 403 is the account's: spent credits ("Maximum credits exceeded"),
        a From address of no verified Sender Identity, or a refused key.
        """
        status = response.status_code
        if status in (401, 403):
            detail = self.error_detail(response)
            said = detail.lower()
            kind = ("quota" if "credits" in said else
                    "sender" if "sender identity" in said else "credentials")
            return TransientError(
                f"{self.kind} API refused the account (HTTP {status}): {detail}; check the "
                f"API key and the account of OUTBOX_TRANSPORTS[{self.name!r}]", code=status,
                account_fault=kind)
        if status != 429:
            return None
        wait = retry_after(response)
        if wait is None:
            wait = rate_limit_reset(response)
        return TransientError(
            f"{self.kind} API throttled the request (HTTP 429): {self.error_detail(response)}",
            code=429, throttled=True, retry_after=wait)


def mail_send_body(parts: MessageParts) -> dict[str, Any]:
    """The Mail Send JSON of one message (:func:`check_parts` found nothing wrong)."""
    seen: set[str] = set()
    personalization: dict[str, Any] = {}
    for field, addresses in (("to", parts.to), ("cc", parts.cc), ("bcc", parts.bcc)):
        unique = [a for a in addresses if not _seen_before(a, seen)]
        if unique:
            personalization[field] = [_address(a) for a in unique]
    body: dict[str, Any] = {
        "personalizations": [personalization],
        "from": _address(parts.sender),
        "subject": parts.subject,
        "content": [{"type": kind, "value": value}
                    for kind, value in (("text/plain", parts.text), ("text/html", parts.html))
                    if value],
    }
    if len(parts.reply_to) == 1:
        body["reply_to"] = _address(parts.reply_to[0])
    elif parts.reply_to:
        body["reply_to_list"] = [_address(a) for a in parts.reply_to]
    attachments = []
    for index, attachment in enumerate(parts.attachments, start=1):
        item = {
            "content": base64.b64encode(attachment.content).decode("ascii"),
            "type": attachment.content_type,
            "filename": attachment.filename or attachment.content_id or f"attachment-{index}",
            "disposition": "inline" if attachment.inline else "attachment",
        }
        if attachment.content_id is not None:
            item["content_id"] = attachment.content_id
        attachments.append(item)
    if attachments:
        body["attachments"] = attachments
    headers = {name: _encoded(value) for name, value in parts.headers
               if name.lower() not in DROPPED_HEADERS}
    if headers:
        body["headers"] = headers
    return body


def rate_limit_reset(response: httpx.Response) -> float | None:
    """Seconds until ``X-RateLimit-Reset`` (a Unix time), capped; None when absent or bad."""
    value = response.headers.get("X-RateLimit-Reset")
    try:
        reset = float(value) if value else None
    except ValueError:
        return None
    if reset is None:
        return None
    return min(MAX_RETRY_AFTER, max(0.0, reset - time.time()))


def check_parts(parts: MessageParts) -> None:
    """:class:`InvalidMessage` naming what SendGrid cannot take as it is."""
    recipients = {a.email.lower() for a in (*parts.to, *parts.cc, *parts.bcc)}
    if len(recipients) > MAX_RECIPIENTS:
        raise InvalidMessage("recipients", f"{len(recipients)} recipients; SendGrid takes at "
                             f"most {MAX_RECIPIENTS} (to + cc + bcc) per email")
    if not parts.to:
        raise InvalidMessage("recipients", "SendGrid needs at least one To address (a "
                             "message only to cc or bcc addresses cannot be sent through it)")
    if not parts.subject.strip():
        raise InvalidMessage("subject", "SendGrid requires a subject")
    if not parts.text and not parts.html:
        raise InvalidMessage("body", "SendGrid requires a text or html body")
    counts: dict[str, int] = {}
    for name, _ in parts.headers:
        lname = name.lower()
        if lname in RESERVED_HEADERS and lname not in DROPPED_HEADERS:
            raise InvalidMessage("extra_headers", f"{name!r} is a header SendGrid reserves "
                                 "for itself; it would not be sent")
        counts[lname] = counts.get(lname, 0) + 1
        if counts[lname] == 2:
            raise InvalidMessage("extra_headers", f"{name!r} appears more than once; "
                                 "SendGrid takes one value per header name")


def _seen_before(address: Address, seen: set[str]) -> bool:
    key = address.email.lower()
    if key in seen:
        return True
    seen.add(key)
    return False


def _address(address: Address) -> dict[str, str]:
    return {"email": address.email, "name": address.name} if address.name \
        else {"email": address.email}


def _encoded(value: str) -> str:
    # One encoded-word run, never folded: a JSON value carries no line breaks.
    return value if value.isascii() else Header(value, "utf-8").encode(maxlinelen=0)
