"""The provider APIs the package speaks: one row per kind, and no other module names one.

A row says what an ``OUTBOX_TRANSPORTS`` entry's ``"transport"`` kind is made
of: its transport class, its webhook receiver, how that webhook authenticates,
and the extra it needs installed. Classes are named as ``"module:Class"`` and
imported by the layer they belong to (``transports.transport_class``,
``_webhooks.receiver_class``), on first use: this module imports nothing of
the package, so every layer may read it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

#: How a webhook authenticates: HTTP Basic credentials (a refusal asks for
#: them with ``WWW-Authenticate``), or a signature over the request.
WebhookAuth = Literal["basic", "signature"]


@dataclasses.dataclass(frozen=True)
class Provider:
    """One provider API: its transport, its webhook receiver, how that webhook authenticates."""

    #: Its name in ``OUTBOX_TRANSPORTS`` (``"transport": kind``).
    kind: str
    #: ``"module:Class"`` of its transport.
    transport: str
    #: ``"module:Class"`` of its webhook receiver.
    receiver: str
    webhook_auth: WebhookAuth
    #: The ``pip install 'flask-mail-outbox[extra]'`` it needs, or None.
    extra: str | None = None


PROVIDERS: dict[str, Provider] = {p.kind: p for p in (
    Provider("postmark", "flask_mail_outbox.transports._postmark:PostmarkTransport",
             "flask_mail_outbox._webhooks.postmark:PostmarkReceiver", "basic"),
    Provider("sendgrid", "flask_mail_outbox.transports._sendgrid:SendGridTransport",
             "flask_mail_outbox._webhooks.sendgrid:SendGridReceiver", "signature"),
    Provider("mailgun", "flask_mail_outbox.transports._mailgun:MailgunTransport",
             "flask_mail_outbox._webhooks.mailgun:MailgunReceiver", "signature"),
    Provider("resend", "flask_mail_outbox.transports._resend:ResendTransport",
             "flask_mail_outbox._webhooks.resend:ResendReceiver", "signature"),
    Provider("ses", "flask_mail_outbox.transports._ses:SESTransport",
             "flask_mail_outbox._webhooks.ses:SESReceiver", "signature", extra="ses"),
)}


def webhook_auth(kind: str) -> WebhookAuth | None:
    """How the webhook of ``kind`` authenticates; None for a kind with no webhooks."""
    provider = PROVIDERS.get(kind)
    return None if provider is None else provider.webhook_auth


__all__ = ["PROVIDERS", "Provider", "WebhookAuth", "webhook_auth"]
