"""What happened to an email after the hand-off, in one shape for every source.

A provider's webhook, a bounce message, a synchronous refusal and an app's
own :meth:`~flask_mail_outbox.OutboxMail.record_event` all become
:class:`DeliveryEvent` values with the normalized types Anymail users know.
This module is plain data: it knows no database and no provider.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from ._errors import InvalidMessage
from ._outside import clean_address, clean_line, clean_text
from ._policy import VERDICTS, for_good
from ._reasons import REASONS

__all__ = ["BOUNCE_KINDS", "EVENT_TYPES", "PAYLOAD_LIMIT", "DeliveryEvent", "capped_payload",
           "naive_utc"]

#: The normalized event types (Anymail's names).
EVENT_TYPES = ("delivered", "bounced", "deferred", "rejected", "complained", "opened",
               "clicked", "unsubscribed", "unknown")

#: A ``bounced`` event's kind, the report's own class: a permanent bounce suppresses the
#: address for good only for a reason that says it is dead (:mod:`._policy`).
BOUNCE_KINDS = ("permanent", "transient")

#: The most of a provider's raw payload kept with an event (bytes of UTF-8 JSON).
PAYLOAD_LIMIT = 64 * 1024

#: Longest ``description`` / ``mta_response`` kept (characters).
TEXT_LIMIT = 2000

# What no database stores as text: NUL (PostgreSQL), lone surrogates (UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# What an id may not hold: any control character or lone surrogate.
_UNSAFE_ID = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


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
    #: Why it failed, one of :data:`flask_mail_outbox._reasons.REASONS` (None: not said,
    #: or not a failure).
    reason: str | None = None
    #: What the suppression policy concluded for the recipient when the event was stored:
    #: ``permanent`` (suppressed for good), ``until`` (suppressed until
    #: ``suppressed_until``: repeated soft bounces) or ``none``; None for an event with no
    #: recipient or of a type the policy ignores (delivered, opened, clicked...).
    verdict: str | None = None
    #: The end of an ``until`` verdict's suppression (naive UTC), else None.
    suppressed_until: datetime | None = None
    #: Whether the verdict was applied to the suppression list. False for a report not
    #: trusted to act (a bounce of a several-recipient email, or of none of ours): its
    #: verdict is what the policy would have concluded, and nothing was suppressed.
    applied: bool = False
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
        # Text from outside (a webhook's fields) is made safe to store here, once, for
        # every source: control characters and lone surrogates replaced, length cut, a
        # recipient that is not an address dropped (it never becomes a suppression key).
        if isinstance(self.provider_event_id, str) and _UNSAFE_ID.search(self.provider_event_id):
            # Still unique and stable (a resend repeats it): its digest.
            object.__setattr__(self, "provider_event_id", hashlib.sha256(
                self.provider_event_id.encode("utf-8", "surrogatepass")).hexdigest())
        for name, line_limit in (("provider_message_id", 255), ("message_id", 998)):
            value = getattr(self, name)
            if isinstance(value, str) and _UNSAFE_ID.search(value):
                object.__setattr__(self, name, clean_line(value, line_limit) or None)
        not_an_address = ""
        if isinstance(self.recipient, str):
            address = clean_address(self.recipient)
            if address is None:
                not_an_address = self.recipient
            object.__setattr__(self, "recipient", address)
        if self.event_type not in EVENT_TYPES:
            raise InvalidMessage("event_type", f"{self.event_type!r} is not one of "
                                 f"{', '.join(EVENT_TYPES)}")
        if self.bounce_kind is not None and self.bounce_kind not in BOUNCE_KINDS:
            raise InvalidMessage("bounce_kind", f"{self.bounce_kind!r} is not one of "
                                 f"{', '.join(BOUNCE_KINDS)}")
        if self.reason is not None and self.reason not in REASONS:
            raise InvalidMessage("reason", f"{self.reason!r:.80} is not one of "
                                 f"{', '.join(REASONS)}")
        if self.verdict is not None and self.verdict not in VERDICTS:
            raise InvalidMessage("verdict", f"{self.verdict!r:.80} is not one of "
                                 f"{', '.join(VERDICTS)}")
        if not isinstance(self.applied, bool):
            raise InvalidMessage("applied", f"expected a bool, got {self.applied!r:.80}")
        if self.suppressed_until is not None and not isinstance(self.suppressed_until, datetime):
            raise InvalidMessage("suppressed_until", f"expected None or a datetime, got "
                                 f"{self.suppressed_until!r:.80}")
        if self.bounce_kind is not None and self.event_type != "bounced":
            raise InvalidMessage("bounce_kind", "only a bounced event has a bounce kind")
        for name in ("occurred_at", "suppressed_until"):
            moment = getattr(self, name)
            if moment is not None and moment.tzinfo is not None:
                object.__setattr__(self, name, naive_utc(moment))
        description = self.description
        if not_an_address:
            shown = clean_line(not_an_address, 200)
            description = "; ".join(filter(None, (
                description, f"the recipient given is not an address: {shown}")))
        object.__setattr__(self, "description", clean_text(description, TEXT_LIMIT))
        object.__setattr__(self, "mta_response", clean_text(self.mta_response, TEXT_LIMIT))
        if self.payload is not None:
            object.__setattr__(self, "payload", capped_payload(self.payload))

    @property
    def suppresses(self) -> str | None:
        """The suppression reason this event puts on its recipient for good, or None.

        A permanent bounce whose reason says the address is dead (user or host
        unknown, suspended...), a spam complaint and an unsubscribe do
        (:func:`flask_mail_outbox._policy.for_good`); a soft bounce (a full
        mailbox, a spam block, any transient one), a deferral and everything else
        do not. Repeated soft bounces may suppress for a bounded time: the
        stored event's :attr:`verdict` says.
        """
        return for_good(self.event_type, self.bounce_kind, self.reason)


def naive_utc(moment: datetime) -> datetime:
    """``moment`` as the naive UTC time the outbox stores (naive ones are taken as UTC)."""
    if moment.tzinfo is None:
        return moment
    return moment.astimezone(UTC).replace(tzinfo=None)


def capped_payload(payload: Any) -> str | None:
    """``payload`` (parsed JSON, or JSON text) as text of at most :data:`PAYLOAD_LIMIT` bytes.

    A payload over the limit is cut at a character boundary; it is kept for
    people to read, not parsed again. A NUL or a lone surrogate in it is written
    as its JSON escape (``\\u0000``), so it can always be stored.
    """
    if payload is None:
        return None
    if isinstance(payload, str):
        text = payload
    else:
        try:
            text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError):  # a cycle, nesting too deep
            text = clean_text(payload, PAYLOAD_LIMIT)
    # NUL and lone surrogates (JSON text escapes them, text given as str may not) as
    # JSON escapes, which every database stores and a reader still sees.
    text = _UNSTORABLE.sub(lambda found: f"\\u{ord(found[0]):04x}", text)
    if len(text) <= PAYLOAD_LIMIT // 4:  # at most 4 bytes a character: within the limit
        return text
    data = text.encode("utf-8")
    if len(data) <= PAYLOAD_LIMIT:
        return text
    return data[:PAYLOAD_LIMIT].decode("utf-8", "ignore")
