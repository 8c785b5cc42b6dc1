"""Resend's Email API: ``POST /emails``, and ``POST /emails/batch`` for up to 100 without attachments.

What is implemented, from Resend's documentation:

* ``POST /emails`` (https://resend.com/docs/api-reference/emails/send-email): one
  email as JSON (``from``, ``to`` (a list, at most 50), ``cc``, ``bcc``,
  ``reply_to``, ``subject``, ``html``, ``text``, ``headers`` (an object),
  ``attachments`` as ``[{"filename", "content" (base64), "content_type",
  "content_id"}]``, the ``content_id`` making an inline image,
  https://resend.com/docs/dashboard/emails/embed-inline-images); a 200
  answers ``{"id": ...}``, stored as the row's ``provider_message_id``.
* ``POST /emails/batch`` (https://resend.com/docs/api-reference/emails/send-batch-emails):
  a JSON array of up to 100 emails, none with attachments. Sent with
  ``x-batch-validation: permissive``
  (https://resend.com/docs/dashboard/emails/batch-validation-modes), so an
  invalid email fails only its own row: the answer is ``{"data": [{"id"}],
  "errors": [{"index", "message"}]}``.
* Authentication (https://resend.com/docs/api-reference/introduction):
  ``Authorization: Bearer <api_key>``; 401 ``missing_api_key``, 403
  ``invalid_api_key``.
* Idempotency (https://resend.com/docs/dashboard/emails/idempotency-keys): an
  ``Idempotency-Key`` header (1-256 characters, kept 24 hours) on both
  endpoints; the same key with the same payload answers the first reply
  without sending again, with another payload 409 ``invalid_idempotent_request``,
  while the first is in progress 409 ``concurrent_idempotent_requests``. The
  key is the email's Message-ID (see :func:`idempotency_key`), the same on
  every attempt of a row, so a retry after a crash between Resend's accept and
  the outbox's record is not a second email. A batch's key stands for its
  emails in order.
* Errors (https://resend.com/docs/api-reference/errors): ``{"statusCode",
  "name", "message"}``; 400/422 ``validation_error``, ``missing_required_field``,
  ``invalid_attachment`` (permanent for the email), 403 ``validation_error``
  (an unverified domain, a testing-only account: the account's problem, so
  transient and failed over, never "check the API key"), 429
  ``rate_limit_exceeded`` (throttled, ``retry-after``) and
  ``daily_quota_exceeded`` / ``monthly_quota_exceeded`` (transient, failed
  over), 5xx.

Assumed where the documentation is silent: a permissive batch's ``data``
lists the created emails in request order, skipping the indexes in
``errors``; an email needs a text or an html body and a non-empty subject
(Resend lists ``subject`` as required); Resend takes one value per header
name (``headers`` is an object); Resend refuses a ``from`` display name
quoted or with a comma (Anymail's Resend backend works around the same), and
takes ``to``/``cc``/``bcc``/``reply_to`` names as RFC 2047 encoded words. A
``DKIM-Signature`` of the stored message is not sent: Resend signs itself
(and a signature made afresh per attempt would change the payload, which the
idempotency key forbids).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from email.charset import QP, Charset
from typing import Any

import httpx

from .._errors import (
    ConfigError,
    InvalidMessage,
    PermanentError,
    TransientError,
    TransportError,
)
from ._base import Delivered, Envelope, Failed, Result
from ._http import BadResponse, HTTPTransport, retry_after
from ._parts import Address, MessageParts, parts_of, refuse_dropped

logger = logging.getLogger(__name__)

#: Addresses Resend takes in ``to``.
MAX_TO = 50
#: Emails per batch request.
MAX_BATCH = 100
#: An email, attachments counted after base64 ("40MB", read as the stricter decimal figure).
MAX_EMAIL_BYTES = 40_000_000
#: A ``content_id`` must be shorter than this.
MAX_CONTENT_ID = 128
#: An ``Idempotency-Key`` is at most this long.
MAX_KEY = 256
#: Characters Resend refuses in a ``from`` display name.
_FROM_NAME_SPECIALS = re.compile(r'[",;<>@\[\]\\]')
#: A display name Resend takes as it is, without quotes or encoding.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9 !#$%&'*+/=?^_`{|}~-]+$")
#: Error names that are the account's problem, not the email's.
QUOTA_NAMES = frozenset({"daily_quota_exceeded", "monthly_quota_exceeded"})

_QP_UTF8 = Charset("utf-8")
_QP_UTF8.header_encoding = QP


def idempotency_key(envelopes: Sequence[Envelope]) -> str:
    """The ``Idempotency-Key`` of a request: the same for every attempt of the same emails.

    One email: its Message-ID without the angle brackets (a SHA-256 of it when
    longer than Resend's 256 characters). A batch: a SHA-256 of its
    Message-IDs in order.
    """
    if len(envelopes) == 1:
        key = envelopes[0].message_id.strip().strip("<>")
        if 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable():
            return key
        return "outbox-" + hashlib.sha256(envelopes[0].message_id.encode()).hexdigest()
    joined = "\n".join(envelope.message_id for envelope in envelopes)
    return "outbox-batch-" + hashlib.sha256(joined.encode()).hexdigest()


class ResendTransport(HTTPTransport):
    """Sends through Resend's Email API (see the module docstring).

    Entry key: ``api_key`` (required), besides ``base_url`` and ``timeout``.
    """

    kind = "resend"
    default_base_url = "https://api.resend.com"
    settings_keys = ("api_key",)
    required_keys = ("api_key",)
    secret_keys = ("api_key",)
    max_batch = MAX_BATCH
    #: Every request carries the email's Idempotency-Key: a retry is safe.
    idempotent = True

    def __init__(self, options: Mapping[str, Any], *, name: str = "default",
                 concurrency: int = 4) -> None:
        super().__init__(options, name=name, concurrency=concurrency)
        self._api_key = str(options.get("api_key") or "")

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """The base's checks; an ``api_key`` with a space or a line break is refused too."""
        super().check_settings(options, prefix)
        key = options["api_key"]
        if any(c.isspace() for c in key.strip()) or key != key.strip():
            raise ConfigError(f'{prefix}["api_key"]', "a Resend API key has no spaces or line "
                              "breaks (a copy-paste error?)")

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse what Resend refuses, before anything is written (see the module docstring)."""
        parts = parts_of(Envelope(0, "", tuple(recipients), mime, ""))
        refuse_dropped(parts, "resend")
        if len(parts.to) > MAX_TO:
            raise InvalidMessage("recipients", f"Resend takes at most {MAX_TO} To addresses "
                                 f"per email, this one has {len(parts.to)}: send it as "
                                 "several emails, or put recipients in Cc or Bcc")
        if not parts.to:
            raise InvalidMessage("recipients", "Resend needs at least one To address (a Cc "
                                 "or Bcc alone is refused)")
        if _FROM_NAME_SPECIALS.search(parts.sender.name):
            raise InvalidMessage("sender", f"Resend refuses a From display name with any of "
                                 f"\" , ; < > @ [ ] \\, got {parts.sender.name!r}")
        if not parts.subject.strip():
            raise InvalidMessage("subject", "Resend requires a subject")
        if not parts.text and not parts.html:
            raise InvalidMessage("body", "Resend needs a text or an html body")
        seen: set[str] = set()
        for name, _ in _sent_headers(parts):
            if name.lower() in seen:
                raise InvalidMessage("extra_headers", f"Resend takes one value per header "
                                     f"name, and {name!r} appears more than once")
            seen.add(name.lower())
        for attachment in parts.attachments:
            if attachment.content_id and len(attachment.content_id) >= MAX_CONTENT_ID:
                raise InvalidMessage("attachments", f"Resend takes a Content-ID shorter than "
                                     f"{MAX_CONTENT_ID} characters, got "
                                     f"{attachment.content_id!r}")
        size = _size(parts)
        if size > MAX_EMAIL_BYTES:
            raise InvalidMessage("attachments" if parts.attachments else "body",
                                 f"Resend takes at most {MAX_EMAIL_BYTES:,} bytes per email, "
                                 f"attachments counted after base64; this one has {size:,}")

    # -- requests -------------------------------------------------------------------------

    def batchable(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` may go through ``/emails/batch``: not with attachments."""
        lowered = envelope.mime.lower()
        if b"content-disposition:" not in lowered and b"content-id:" not in lowered:
            return True
        return not parts_of(envelope).attachments

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """``POST /emails`` for one email, ``POST /emails/batch`` (permissive) for several."""
        emails = [email_json(parts_of(envelope)) for envelope in envelopes]
        single = len(envelopes) == 1
        headers = {"Authorization": f"Bearer {self._api_key}", "Accept": "application/json",
                   "Content-Type": "application/json",
                   "Idempotency-Key": idempotency_key(envelopes)}
        if not single:
            headers["x-batch-validation"] = "permissive"
        body = json.dumps(emails[0] if single else emails, ensure_ascii=False,
                          separators=(",", ":")).encode()
        return client.build_request(
            "POST", f"{self.base_url}/emails" if single else f"{self.base_url}/emails/batch",
            content=body, headers=headers)

    # -- answers --------------------------------------------------------------------------

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """``{"id"}`` for one email; ``{"data", "errors"}`` for a batch, one result per email."""
        body = response.json()
        if len(envelopes) == 1:
            return [Delivered(provider_message_id=_id(body))]
        if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
            raise BadResponse("a batch answer without a data array")
        errors = body.get("errors") or []
        if not isinstance(errors, list):
            raise BadResponse("errors is not an array")
        refused: dict[int, str] = {}
        for error in errors:
            index = error["index"] if isinstance(error, Mapping) else None
            if not isinstance(index, int) or not 0 <= index < len(envelopes):
                raise BadResponse(f"an error for no email of the batch: {error!r}")
            refused[index] = str(error.get("message", ""))
        created = iter(body["data"])
        if len(body["data"]) + len(refused) != len(envelopes):
            raise BadResponse(f"{len(body['data'])} ids and {len(refused)} errors for "
                              f"{len(envelopes)} emails")
        return [Failed(PermanentError(f"resend API refused the email (batch validation): "
                                      f"{refused[i]}", code=422)) if i in refused
                else Delivered(provider_message_id=_id(next(created)))
                for i in range(len(envelopes))]

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransportError | None:
        """Resend's error ``name`` decides where the status alone would mislead.

        A 403 ``validation_error`` (an unverified domain) and a spent quota are
        the account's problem: transient, failed over, one ERROR. A 409 is the
        idempotency key's. A 4xx answering a whole batch is about none of its
        emails in particular. The rest is the base's.
        """
        status = response.status_code
        name, _ = _error_body(response)
        detail = self.error_detail(response)
        if status == 403 and name == "validation_error":
            return TransientError(f"resend API refuses the sender or the recipients for this "
                                  f"account (HTTP {status}): {detail}; verify the sending "
                                  "domain in Resend (Domains) and use it in the From address",
                                  code=status, account_fault="sender")
        if status == 429 and name in QUOTA_NAMES:
            return TransientError(f"resend API: the sending quota is spent (HTTP {status}): "
                                  f"{detail}; wait for it to reset, or raise it in Resend's "
                                  "billing settings", code=status, account_fault="quota",
                                  retry_after=retry_after(response))
        if status == 409 and name == "concurrent_idempotent_requests":
            return TransientError(f"resend API is still processing an earlier attempt of "
                                  f"this email (HTTP 409): {detail}", code=409)
        if status == 409 and name == "invalid_idempotent_request":
            return PermanentError(
                f"resend API already took a request with this email's Idempotency-Key and "
                f"another payload in the last 24 hours (HTTP 409): {detail}; it was most "
                "likely sent then, so it is not sent again", code=409)
        if len(envelopes) > 1 and 400 <= status < 500 and status not in (401, 403, 429):
            return TransientError(f"resend API refused the whole batch of {len(envelopes)} "
                                  f"(HTTP {status}): {detail}", code=status)
        return None



def email_json(parts: MessageParts) -> dict[str, Any]:
    """One email as Resend's JSON."""
    email: dict[str, Any] = {"from": _from(parts.sender), "to": _list(parts.to),
                             "subject": parts.subject}
    for field, addresses in (("cc", parts.cc), ("bcc", parts.bcc), ("reply_to", parts.reply_to)):
        if addresses:
            email[field] = _list(addresses)
    if parts.html:
        email["html"] = parts.html
    # An empty text opts out of Resend's text made from the html: the email
    # goes with the parts it has.
    email["text"] = parts.text or ""
    headers = dict(_sent_headers(parts))
    if headers:
        email["headers"] = headers
    if parts.attachments:
        email["attachments"] = [
            {"filename": a.filename, "content": base64.b64encode(a.content).decode("ascii"),
             "content_type": a.content_type,
             **({"content_id": a.content_id} if a.content_id else {})}
            for a in parts.attachments]
    return email


def _sent_headers(parts: MessageParts) -> list[tuple[str, str]]:
    return [(name, value) for name, value in parts.headers
            if name.lower() != "dkim-signature"]


def _from(address: Address) -> str:
    # Resend wants the name neither quoted nor encoded (check_message refused specials).
    return f"{address.name} <{address.email}>" if address.name else address.email


def _list(addresses: Sequence[Address]) -> list[str]:
    """Addresses for ``to``, ``cc``, ``bcc``, ``reply_to``: a name needing quotes is encoded."""
    formatted = []
    for address in addresses:
        if not address.name:
            formatted.append(address.email)
        elif _PLAIN_NAME.match(address.name):
            formatted.append(f"{address.name} <{address.email}>")
        else:
            formatted.append(f"{_QP_UTF8.header_encode(address.name)} <{address.email}>")
    return formatted


def _size(parts: MessageParts) -> int:
    bodies = sum(len(body.encode()) for body in (parts.text, parts.html) if body)
    return bodies + sum(4 * -(-len(a.content) // 3) for a in parts.attachments)


def _id(reply: Any) -> str:
    if not isinstance(reply, Mapping) or not isinstance(reply.get("id"), str) \
            or not reply["id"]:
        raise BadResponse(f"no id in {reply!r}")
    return str(reply["id"])


def _error_body(response: httpx.Response) -> tuple[str, str]:
    """``(name, message)`` of an error answer; empty strings when it has none."""
    try:
        body = response.json()
    except ValueError:
        return "", ""
    if not isinstance(body, Mapping):
        return "", ""
    return str(body.get("name", "")), str(body.get("message", ""))
