"""What happened to an email after the hand-off, in one shape for every source.

A provider's webhook, a bounce message, a synchronous refusal and an app's
own :meth:`~flask_mail_outbox.OutboxMail.record_event` all become
:class:`DeliveryEvent` values with the normalized types Anymail users know.
This module is plain data: it knows no database and no provider.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

from ._errors import InvalidMessage

__all__ = ["BOUNCE_KINDS", "EVENT_TYPES", "PAYLOAD_LIMIT", "DeliveryEvent", "capped_payload",
           "naive_utc"]

#: The normalized event types (Anymail's names).
EVENT_TYPES = ("delivered", "bounced", "deferred", "rejected", "complained", "opened",
               "clicked", "unsubscribed", "unknown")

#: A ``bounced`` event's kind: a permanent bounce suppresses the address.
BOUNCE_KINDS = ("permanent", "transient")

#: The most of a provider's raw payload kept with an event (bytes of UTF-8 JSON).
PAYLOAD_LIMIT = 64 * 1024

#: Longest ``description`` / ``mta_response`` kept (characters).
TEXT_LIMIT = 2000


@dataclasses.dataclass(frozen=True)
class DeliveryEvent:
    """One thing that happened to one email (or to one recipient of it).

    ``email_id`` is the outbox row it concerns, None when no row matched (the
    event is kept all the same). Times are naive UTC, like every time the
    outbox stores. ``provider_event_id`` is unique per ``transport``: a
    provider resending an event is acknowledged and ignored. ``payload`` is
    the provider's raw JSON for this event, cut at :data:`PAYLOAD_LIMIT`.
    ``provider_message_id`` and ``message_id`` are what the event names the
    message by; they are how ``email_id`` is found when it is not given.
    """

    event_type: str
    recipient: str | None = None
    occurred_at: datetime | None = None
    transport: str = ""
    provider_event_id: str | None = None
    email_id: int | None = None
    bounce_kind: str | None = None
    description: str = ""
    mta_response: str = ""
    provider_message_id: str | None = None
    message_id: str | None = None
    payload: str | None = dataclasses.field(default=None, repr=False)
    #: The stored row's id (None until stored).
    id: int | None = None

    def __post_init__(self) -> None:
        for name, limit in (("recipient", 320), ("provider_event_id", 255),
                            ("provider_message_id", 255), ("message_id", 998)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > limit):
                raise InvalidMessage(name, f"expected None or a str of at most {limit} "
                                     f"characters, got {value!r:.80}")
        if not isinstance(self.transport, str) or len(self.transport) > 64:
            raise InvalidMessage("transport", f"expected a transport name of at most 64 "
                                 f"characters, got {self.transport!r:.80}")
        if self.email_id is not None and (isinstance(self.email_id, bool)
                                          or not isinstance(self.email_id, int)):
            raise InvalidMessage("email_id", f"expected None or an int, got {self.email_id!r}")
        if self.occurred_at is not None and not isinstance(self.occurred_at, datetime):
            raise InvalidMessage("occurred_at", f"expected None or a datetime, got "
                                 f"{self.occurred_at!r:.80}")
        for name in ("description", "mta_response"):
            if not isinstance(getattr(self, name), str):
                raise InvalidMessage(name, f"expected a str, got {getattr(self, name)!r:.80}")
        if self.event_type not in EVENT_TYPES:
            raise InvalidMessage("event_type", f"{self.event_type!r} is not one of "
                                 f"{', '.join(EVENT_TYPES)}")
        if self.bounce_kind is not None and self.bounce_kind not in BOUNCE_KINDS:
            raise InvalidMessage("bounce_kind", f"{self.bounce_kind!r} is not one of "
                                 f"{', '.join(BOUNCE_KINDS)}")
        if self.bounce_kind is not None and self.event_type != "bounced":
            raise InvalidMessage("bounce_kind", "only a bounced event has a bounce kind")
        if self.occurred_at is not None and self.occurred_at.tzinfo is not None:
            object.__setattr__(self, "occurred_at", naive_utc(self.occurred_at))
        object.__setattr__(self, "description", self.description[:TEXT_LIMIT])
        object.__setattr__(self, "mta_response", self.mta_response[:TEXT_LIMIT])

    @property
    def suppresses(self) -> str | None:
        """The suppression reason this event puts on its recipient, or None.

        A permanent bounce, a spam complaint and an unsubscribe do; a transient
        bounce, a deferral and everything else do not.
        """
        if self.event_type == "bounced" and self.bounce_kind == "permanent":
            return "bounced"
        if self.event_type == "complained":
            return "complained"
        if self.event_type == "unsubscribed":
            return "unsubscribed"
        return None


def naive_utc(moment: datetime) -> datetime:
    """``moment`` as the naive UTC time the outbox stores (naive ones are taken as UTC)."""
    if moment.tzinfo is None:
        return moment
    return moment.astimezone(UTC).replace(tzinfo=None)


def capped_payload(payload: Any) -> str | None:
    """``payload`` (parsed JSON, or JSON text) as text of at most :data:`PAYLOAD_LIMIT` bytes.

    A payload over the limit is cut at a character boundary; it is kept for
    people to read, not parsed again.
    """
    if payload is None:
        return None
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"),
                                                               ensure_ascii=False, default=str)
    data = text.encode("utf-8")
    if len(data) <= PAYLOAD_LIMIT:
        return text
    return data[:PAYLOAD_LIMIT].decode("utf-8", "ignore")
