"""What an event concludes for its recipient's address: the suppression policy.

A reason (:data:`flask_mail_outbox._reasons.REASONS`) says why mail failed;
this module says what that means for the address. Only an address found dead
is suppressed for good: the recipient's mailbox or domain does not exist, or
is disabled. So are complaints and unsubscribes, which are the recipient's
own word. Every other failure (a full mailbox, a spam filter, a policy block,
a rate limit) is soft: it says nothing lasting about the address, and only
repeated soft bounces suppress it, for a bounded time (:class:`SoftBounceRule`).

The functions here are pure; the event log counts an address's soft bounces
and applies the verdict (``flask_mail_outbox.core._events``).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

__all__ = ["DEAD_REASONS", "POLICY_EVENTS", "VERDICTS", "SoftBounceRule", "Verdict", "conclude",
           "for_good", "is_soft_bounce"]

#: The reasons that mean the address itself is dead: a bounce for one of these,
#: when the report calls it permanent, suppresses the address for good.
DEAD_REASONS = frozenset({"user_unknown", "host_unknown", "suspended", "has_moved",
                          "not_accepting"})

#: The event types the policy concludes something for; every other type
#: (delivered, deferred, rejected, opened, clicked, unknown) gets no verdict.
POLICY_EVENTS = frozenset({"bounced", "complained", "unsubscribed"})

#: What the policy concludes for an event's recipient: suppressed for good,
#: suppressed until a time (repeated soft bounces), or not suppressed.
VERDICTS = ("permanent", "until", "none")


def for_good(event_type: str, bounce_kind: str | None, reason: str | None) -> str | None:
    """The suppression reason an event puts on its address for good, or None.

    ``bounced`` for a permanent bounce whose reason is one of
    :data:`DEAD_REASONS`; ``complained`` for a complaint; ``unsubscribed``
    for an unsubscribe; None for everything else (a soft bounce among them).
    """
    if event_type == "bounced":
        return "bounced" if bounce_kind == "permanent" and reason in DEAD_REASONS else None
    if event_type == "complained":
        return "complained"
    if event_type == "unsubscribed":
        return "unsubscribed"
    return None


def is_soft_bounce(event_type: str, bounce_kind: str | None, reason: str | None) -> bool:
    """Whether an event is a bounce that does not suppress for good (it counts toward
    :class:`SoftBounceRule`): a transient bounce, or a permanent one for a reason
    that is not the address's death (a spam block, a full mailbox...)."""
    return event_type == "bounced" and for_good(event_type, bounce_kind, reason) is None


@dataclasses.dataclass(frozen=True)
class SoftBounceRule:
    """Bounded suppression of an address that bounces softly again and again.

    ``limit`` soft bounces of one address within ``window_seconds`` suppress
    it for ``suppress_seconds`` from when the last of them is recorded. Any of the three at 0
    turns the rule off (soft bounces then never suppress).
    """

    limit: int = 3
    window_seconds: float = 7 * 86400.0
    suppress_seconds: float = 14 * 86400.0

    @property
    def enabled(self) -> bool:
        """Whether soft bounces can suppress at all."""
        return self.limit > 0 and self.window_seconds > 0 and self.suppress_seconds > 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the policy concluded for one event's recipient.

    ``verdict`` is one of :data:`VERDICTS`; ``suppression`` the list's reason
    for it (``bounced``, ``complained``, ``unsubscribed``; None for ``none``);
    ``until`` the end of a bounded suppression (None otherwise).
    """

    verdict: str
    suppression: str | None = None
    until: datetime | None = None


def conclude(event_type: str, bounce_kind: str | None, reason: str | None, *,
             soft_bounces: int, rule: SoftBounceRule, now: datetime) -> Verdict | None:
    """The verdict for an event's recipient, or None for a type the policy ignores.

    ``soft_bounces``: how many soft bounces of the address the rule's window
    holds, this event included when it is one.
    """
    if event_type not in POLICY_EVENTS:
        return None
    lasting = for_good(event_type, bounce_kind, reason)
    if lasting is not None:
        return Verdict("permanent", lasting)
    if rule.enabled and soft_bounces >= rule.limit:
        return Verdict("until", "bounced", now + timedelta(seconds=rule.suppress_seconds))
    return Verdict("none")
