"""Mailgun: the stored MIME message as it is, through ``messages.mime``.

Implemented from Mailgun's documentation ("Send an email in MIME format",
https://documentation.mailgun.com/docs/mailgun/api-reference/send/mailgun/messages/post-v3--domain-name--messages-mime;
its API introduction on the base URLs, HTTP Basic authentication and response
codes; "API Response Codes",
https://documentation.mailgun.com/docs/mailgun/quickstart-guide/responses):

* ``POST {base_url}/v3/{domain}/messages.mime`` with HTTP Basic authentication
  (user ``api``, password the API key) and a ``multipart/form-data`` body:
  ``to``, once per envelope recipient (To, Cc and Bcc alike: Mailgun delivers
  to exactly these), and ``message``, the stored MIME as a file part. Mailgun
  takes those bytes unchanged, so the Message-ID, every header and a
  ``DKIM-Signature`` made by ``OUTBOX_DKIM_*`` arrive as the outbox stored them;
* success is ``200`` with ``{"id": "<...>", "message": "Queued. Thank you."}``;
  the id, without its angle brackets, is the row's provider message id. A 200
  without an id (Mailgun answers "Mailgun Magnificent API" to a path it does not
  know) is a transient error like any answer the API does not document;
* errors: 400 ``{"message": ...}`` (the message: permanent), 401 (``Forbidden``)
  and 403 (the key), 404 (see below), 413 (too large: permanent), 429
  (throttled, ``Retry-After`` honoured) and 5xx (transient, fails over).

A 404 says the domain is not one of the account's in this region (or
``base_url`` is not Mailgun's API root): a configuration error of the
transport, not a fault of the message. Like a refused key it pauses the
transport (``account_fault="settings"``, one ERROR naming the entry's
``domain`` and ``base_url``): the emails wait without spending attempts, so
fixing the setting delivers the queue instead of finding it dead-lettered.

Refused at ``send()``: more than 1000 recipients and messages over 25 MB, the
limits Mailgun documents. Assumed where the docs are silent: the envelope's
ESMTP options (``mail_options``, ``rcpt_options``) have no API equivalent
and are not sent; Mailgun takes no idempotency key, so a crash between its
accept and the outbox's record sends the message again on retry.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar
from urllib.parse import quote

import httpx

from .._errors import ConfigError, InvalidMessage, TransientError
from ._base import Delivered, Envelope, Result
from ._http import BadResponse, HTTPTransport

logger = logging.getLogger(__name__)

#: The most recipients one message may have.
MAX_RECIPIENTS = 1000
#: "Mailgun supports maximum messages size of 25MB."
MAX_MESSAGE_BYTES = 25 * 1024 * 1024


class MailgunTransport(HTTPTransport):
    """Sends the stored MIME through Mailgun's ``messages.mime`` (see the module docstring).

    Its ``OUTBOX_TRANSPORTS`` entry takes ``api_key`` and ``domain`` (both
    required) and ``base_url`` (``https://api.mailgun.net``;
    ``https://api.eu.mailgun.net`` for a domain in the EU region).
    """

    kind: ClassVar[str] = "mailgun"
    default_base_url: ClassVar[str] = "https://api.mailgun.net"
    settings_keys: ClassVar[tuple[str, ...]] = ("api_key", "domain")
    required_keys: ClassVar[tuple[str, ...]] = ("api_key", "domain")
    secret_keys: ClassVar[tuple[str, ...]] = ("api_key",)
    max_batch: ClassVar[int] = 1

    def __init__(self, options: Mapping[str, Any], *, name: str = "default",
                 concurrency: int = 4) -> None:
        super().__init__(options, name=name, concurrency=concurrency)
        domain = str(options.get("domain") or "").strip()
        self.url = f"{self.base_url}/v3/{quote(domain, safe='')}/messages.mime"
        credentials = base64.b64encode(f"api:{options.get('api_key') or ''}".encode())
        self._authorization = "Basic " + credentials.decode("ascii")

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """The common checks, and a ``domain`` that is a name, not a path or a URL."""
        super().check_settings(options, prefix)
        domain = str(options["domain"]).strip()
        if "/" in domain or ":" in domain or " " in domain:
            raise ConfigError(f'{prefix}["domain"]', "expected the sending domain's name as "
                              f"Mailgun lists it, such as 'mg.example.com', got {domain!r}")

    @classmethod
    def check_message(cls, mime: bytes, recipients: Sequence[str]) -> None:
        """Refuse what Mailgun documents it cannot take; nothing is written."""
        unique = {r.lower() for r in recipients}
        if len(unique) > MAX_RECIPIENTS:
            raise InvalidMessage("recipients", f"{len(unique)} recipients; Mailgun takes at "
                                 f"most {MAX_RECIPIENTS} per email")
        if len(mime) > MAX_MESSAGE_BYTES:
            raise InvalidMessage("attachments", f"the message is {len(mime)} bytes; Mailgun "
                                 f"takes at most {MAX_MESSAGE_BYTES} (25 MB) per email")

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """``POST /v3/{domain}/messages.mime``: the recipients and the stored bytes."""
        envelope = envelopes[0]
        return client.build_request(
            "POST", self.url, data={"to": list(envelope.recipients)},
            files={"message": ("message.eml", envelope.mime, "message/rfc822")},
            headers={"Authorization": self._authorization, "Accept": "application/json"})

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """``{"id": "<...>", "message": "Queued. Thank you."}``: the id, without brackets."""
        body = response.json()
        message_id = body.get("id") if isinstance(body, Mapping) else None
        if not isinstance(message_id, str) or not message_id.strip("<> "):
            raise BadResponse("no message id in the answer (is base_url Mailgun's API root?)")
        return [Delivered(provider_message_id=message_id.strip().strip("<>"))
                for _ in envelopes]

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransientError | None:
        """A 404 is this entry's domain or base_url, not the message: like a refused key."""
        if response.status_code != 404:
            return None
        detail = self.error_detail(response)
        return TransientError(
            f"{self.kind} API does not know the domain {self.options.get('domain')!r} "
            f"(HTTP 404): {detail}; check the domain and base_url of "
            f"OUTBOX_TRANSPORTS[{self.name!r}] (https://api.eu.mailgun.net for a domain in "
            "the EU region)", code=404, account_fault="settings")
