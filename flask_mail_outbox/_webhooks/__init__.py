"""Provider webhooks: each kind's signature scheme verified, its events normalized.

A receiver takes a :class:`WebhookRequest` (headers, body, the time) and
returns what it :class:`Received`, or raises :class:`WebhookRefused` with the
HTTP status to answer. Receivers write nothing and know no Flask: the
integration's route stores what they return (see ``_flask.webhooks``).
"""

from ._base import (
    MAX_BODY_BYTES,
    TOLERANCE_SECONDS,
    Received,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    receiver_class,
)

__all__ = ["MAX_BODY_BYTES", "TOLERANCE_SECONDS", "Received", "Receiver", "WebhookRefused",
           "WebhookRequest", "receiver_class"]
