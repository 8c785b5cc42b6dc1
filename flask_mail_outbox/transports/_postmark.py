"""Postmark's Email API: one message per ``POST /email``, up to 500 per ``POST /email/batch``.

What is implemented, from Postmark's documentation:

* ``POST /email`` (https://postmarkapp.com/developer/api/email-api): one
  message as JSON (``From``, ``To``, ``Cc``, ``Bcc`` as comma-separated
  strings, ``ReplyTo``, ``Subject``, ``TextBody``, ``HtmlBody``, ``Headers``
  as ``[{"Name", "Value"}]``, ``Attachments`` as ``[{"Name", "Content"
  (base64), "ContentType", "ContentID"}]`` where an inline image's
  ``ContentID`` is ``"cid:..."``, ``MessageStream``). A 200 answers
  ``{"To", "SubmittedAt", "MessageID", "ErrorCode": 0, "Message": "OK"}``;
  ``MessageID`` is stored as the row's ``provider_message_id``.
* ``POST /email/batch`` (https://postmarkapp.com/developer/user-guide/send-email-with-api/batch-emails):
  a JSON array of up to 500 such messages, 50 MB in all; the 200 answer is an
  array of the same replies, in order, each with its own ``ErrorCode``
  (0 for a message accepted), so each row gets its own outcome.
* Authentication (https://postmarkapp.com/developer/api/overview): the
  server token in ``X-Postmark-Server-Token``; a wrong or missing one is a
  401 (``ErrorCode`` 10).
* Errors (same page): 422 with ``{"ErrorCode": n, "Message": "..."}``, 413
  for a payload over 10 MB (50 MB for a batch), 429 when throttled, 500 and
  503 on Postmark's side. The codes used here: 300 invalid email request and
  406 inactive (suppressed) recipient (permanent for that message), 100
  maintenance, 405 not allowed to send, 412 account pending and 413 account
  may not send (the account's problem, not the message's: transient, and the
  transport's fault, so a ``failover`` takes the attempt), 429 rate limit.
* Limits (https://postmarkapp.com/support/article/1180-what-does-errorcode-300-mean
  and .../1056-what-are-the-attachment-and-email-size-limits): at most 50
  recipients in To, Cc and Bcc together; a text or html body is required;
  each body at most 5 MB, the whole message at most 10 MB counted after base64.
  Mailboxes must be ASCII (the address pattern in the ErrorCode 300 article;
  Anymail's Postmark page says the same of non-ASCII mailboxes). These are
  refused at ``send()`` (:meth:`PostmarkTransport.check_message`).

Assumed where the documentation is silent: whether Postmark keeps a
``Message-ID`` passed in ``Headers`` is not documented, so it is passed on
and the row keeps Postmark's ``MessageID``, which its webhooks carry; a reply with ``ErrorCode`` 0 whose
``Message`` lists "inactive addresses" was accepted for the others (the
wording Anymail parses), and those addresses are recorded as refused; a 4xx
answering a whole batch says nothing about any one message, so it is
transient for every row of the batch rather than a dead letter for 500.
A ``DKIM-Signature`` of the stored message is not sent: Postmark signs itself.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Mapping, Sequence
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
from ._http import BadResponse, HTTPTransport
from ._parts import Address, MessageParts, parts_of, refuse_dropped

logger = logging.getLogger(__name__)

#: Recipients (To, Cc and Bcc together) Postmark takes in one message.
MAX_RECIPIENTS = 50
#: A message's size as Postmark counts it (bodies and base64 attachments);
#: "10 MB" read as the stricter 10,000,000 bytes.
MAX_MESSAGE_BYTES = 10_000_000
#: Each of TextBody and HtmlBody.
MAX_BODY_BYTES = 5_000_000
#: The payload of one batch request.
MAX_BATCH_BYTES = 50_000_000
#: Messages of at most this many stored bytes share a batch request: 500 of
#: them stay well under :data:`MAX_BATCH_BYTES` with the JSON around them.
#: A larger one goes alone through ``/email``.
BATCHABLE_BYTES = MAX_BATCH_BYTES * 8 // 10 // 500
#: The message stream when the entry names none (Postmark's default transactional one).
DEFAULT_STREAM = "outbound"

#: ErrorCodes that are the account's problem, not the message's.
ACCOUNT_CODES = {
    100: "Postmark is in maintenance",
    405: "the account is not allowed to send (out of credits, or sending paused)",
    412: "the account is pending approval",
    413: "the account may not send",
}
#: ErrorCodes that say the sender is not one the account may send from (a sender
#: signature or domain not defined, or not confirmed): no email of it can go.
SENDER_CODES = {
    400: "the sender signature is not defined",
    401: "the sender signature is not confirmed",
}
#: ErrorCodes that say "try again": a bad token (also a 401) and the rate limit.
TOKEN_CODE = 10
RATE_LIMIT_CODE = 429

_INACTIVE = re.compile(r"inactive addresses:\s*(.*?)\.\s*Inactive recipients", re.DOTALL)
_ASCII_MAILBOX = re.compile(r"^[\x21-\x7e]+$")


class PostmarkTransport(HTTPTransport):
    """Sends through Postmark's Email API (see the module docstring).

    Entry keys: ``token`` (required, the server API token) and
    ``message_stream`` (default ``"outbound"``), besides ``base_url`` and
    ``timeout``.
    """

    kind = "postmark"
    default_base_url = "https://api.postmarkapp.com"
    settings_keys = ("token", "message_stream")
    required_keys = ("token",)
    secret_keys = ("token",)
    max_batch = 500

    def __init__(self, options: Mapping[str, Any], *, name: str = "default",
                 concurrency: int = 4) -> None:
        super().__init__(options, name=name, concurrency=concurrency)
        self._token = str(options.get("token") or "")
        self.message_stream = str(options.get("message_stream") or DEFAULT_STREAM)

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """The base's checks, and ``message_stream`` a non-empty string when set."""
        super().check_settings(options, prefix)
        stream = options.get("message_stream")
        if stream is not None and (not isinstance(stream, str) or not stream.strip()):
            raise ConfigError(f'{prefix}["message_stream"]',
                              f"expected a Postmark message stream id such as "
                              f"{DEFAULT_STREAM!r}, got {stream!r}")

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse what Postmark refuses, before anything is written (see the module docstring)."""
        unique = {r.lower() for r in recipients}
        if len(unique) > MAX_RECIPIENTS:
            raise InvalidMessage("recipients", f"Postmark takes at most {MAX_RECIPIENTS} "
                                 f"recipients per message (To, Cc and Bcc together), this "
                                 f"one has {len(unique)}: send it as several messages")
        for recipient in recipients:
            if not _ascii_mailbox(recipient):
                raise InvalidMessage("recipients", f"Postmark does not take non-ASCII "
                                     f"mailboxes, got {recipient!r}")
        parts = parts_of(Envelope(0, "", tuple(recipients), mime, ""))
        refuse_dropped(parts, "postmark")
        if not _ascii_mailbox(parts.sender.email):
            raise InvalidMessage("sender", f"Postmark does not take non-ASCII mailboxes, "
                                 f"got {parts.sender.email!r}")
        if not parts.text and not parts.html:
            raise InvalidMessage("body", "Postmark needs a text or an html body (an "
                                 "attachment alone cannot be sent)")
        for field, body in (("body", parts.text), ("html", parts.html)):
            if body and len(body.encode()) > MAX_BODY_BYTES:
                raise InvalidMessage(field, f"Postmark takes at most {MAX_BODY_BYTES:,} bytes "
                                     f"per body, this one has {len(body.encode()):,}")
        size = _size(parts)
        if size > MAX_MESSAGE_BYTES:
            raise InvalidMessage("attachments" if parts.attachments else "body",
                                 f"Postmark takes at most {MAX_MESSAGE_BYTES:,} bytes per "
                                 f"message, bodies and base64 attachments counted; this one "
                                 f"has {size:,}")

    # -- requests -------------------------------------------------------------------------

    def batchable(self, envelope: Envelope) -> bool:
        """Small messages share a batch; a large one goes alone (the 50 MB batch limit)."""
        return len(envelope.mime) <= BATCHABLE_BYTES

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """``POST /email`` for one message, ``POST /email/batch`` for several."""
        messages = [self.message_json(parts_of(envelope)) for envelope in envelopes]
        single = len(envelopes) == 1
        body = json.dumps(messages[0] if single else messages, ensure_ascii=False,
                          separators=(",", ":")).encode()
        return client.build_request(
            "POST", f"{self.base_url}/email" if single else f"{self.base_url}/email/batch",
            content=body,
            headers={"Accept": "application/json", "Content-Type": "application/json",
                     "X-Postmark-Server-Token": self._token})

    def message_json(self, parts: MessageParts) -> dict[str, Any]:
        """One message as Postmark's JSON."""
        message: dict[str, Any] = {"From": parts.sender.formatted(), "Subject": parts.subject}
        for field, addresses in (("To", parts.to), ("Cc", parts.cc), ("Bcc", parts.bcc),
                                 ("ReplyTo", parts.reply_to)):
            if addresses:
                message[field] = _joined(addresses)
        if parts.text:
            message["TextBody"] = parts.text
        if parts.html:
            message["HtmlBody"] = parts.html
        headers = [{"Name": name, "Value": value} for name, value in parts.headers
                   if name.lower() != "dkim-signature"]
        if headers:
            message["Headers"] = headers
        if parts.attachments:
            message["Attachments"] = [
                {"Name": a.filename, "Content": base64.b64encode(a.content).decode("ascii"),
                 "ContentType": a.content_type,
                 **({"ContentID": f"cid:{a.content_id}"} if a.content_id else {})}
                for a in parts.attachments]
        message["MessageStream"] = self.message_stream
        return message

    # -- answers --------------------------------------------------------------------------

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """One result per message from a 200: the reply object, or the batch's array."""
        body = response.json()
        replies = [body] if len(envelopes) == 1 else body
        if not isinstance(replies, list) or len(replies) != len(envelopes):
            raise BadResponse(f"expected {len(envelopes)} replies, got {_shape(body)}")
        return [self._result_of(reply) for reply in replies]

    def _result_of(self, reply: Any) -> Result:
        if not isinstance(reply, Mapping):
            raise BadResponse(f"a reply that is not an object: {reply!r}")
        # Anymail saw ErrorCode missing from a reply accepted with a delay.
        code = reply.get("ErrorCode", 0)
        text = str(reply["Message"])
        if code != 0:
            return Failed(self.error_for(code, text))
        message_id = reply["MessageID"]
        if not isinstance(message_id, str) or not message_id:
            raise BadResponse(f"MessageID {message_id!r}")
        # "Message OK, but will not deliver to these inactive addresses: ..."
        match = _INACTIVE.search(text)
        refused = {address.strip(): (406, text) for address in
                   (match.group(1).split(",") if match else ()) if address.strip()}
        return Delivered(refused=refused, provider_message_id=message_id)

    def error_for(self, code: Any, text: str) -> TransportError:
        """What Postmark's ``ErrorCode`` means for the message it answers."""
        detail = f"ErrorCode {code}; {text}"
        if code == RATE_LIMIT_CODE:
            return TransientError(f"postmark API throttled the request: {detail}", code=429,
                                  throttled=True)
        if code == TOKEN_CODE:
            return TransientError(f"postmark API refused the server token: {detail}; check "
                                  f"the API key of OUTBOX_TRANSPORTS[{self.name!r}]", code=401,
                                  account_fault="credentials")
        if code in ACCOUNT_CODES:
            return TransientError(f"postmark API cannot send for this account "
                                  f"({ACCOUNT_CODES[code]}): {detail}", code=422,
                                  account_fault="unreachable" if code == 100 else "quota")
        if code in SENDER_CODES:
            return TransientError(f"postmark API refuses the sender ({SENDER_CODES[code]}): "
                                  f"{detail}", code=422, account_fault="sender")
        return PermanentError(f"postmark API refused the message: {detail}", code=422)

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransportError | None:
        """Postmark's ``ErrorCode`` of a 422 decides, not the status alone.

        The base makes every 4xx but 401, 403 and 429 permanent. A 422's
        ``ErrorCode`` may be the account's problem (:data:`ACCOUNT_CODES`), and
        a 4xx answering a whole batch is about none of its messages in particular.
        """
        status = response.status_code
        if not 400 <= status < 500 or status in (401, 403, 429):
            return None
        if len(envelopes) > 1:
            return TransientError(f"postmark API refused the whole batch of {len(envelopes)} "
                                  f"(HTTP {status}): {self.error_detail(response)}",
                                  code=status)
        error = _error_body(response) if status == 422 else None
        return None if error is None else self.error_for(*error)



def _joined(addresses: Sequence[Address]) -> str:
    return ", ".join(address.formatted() for address in addresses)


def _ascii_mailbox(address: str) -> bool:
    return bool(_ASCII_MAILBOX.match(address.rpartition("@")[0] or address))


def _size(parts: MessageParts) -> int:
    """The message's size as Postmark counts it: bodies, and attachments after base64."""
    bodies = sum(len(body.encode()) for body in (parts.text, parts.html) if body)
    return bodies + sum(4 * -(-len(a.content) // 3) for a in parts.attachments)


def _error_body(response: httpx.Response) -> tuple[Any, str] | None:
    """``(ErrorCode, Message)`` of an error answer, or None when it has none."""
    try:
        body = response.json()
    except ValueError:
        return None
    if isinstance(body, Mapping) and "ErrorCode" in body:
        return body["ErrorCode"], str(body.get("Message", ""))
    return None


def _shape(body: Any) -> str:
    if isinstance(body, list):
        return f"an array of {len(body)}"
    return f"a {type(body).__name__}"
