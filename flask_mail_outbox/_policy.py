"""What an event concludes for its recipient's address: the suppression policy.

A reason (:data:`flask_mail_outbox._reasons.REASONS`) says why mail failed;
this module says what that means for the address. Only an address found dead
is suppressed for good: the recipient's mailbox or domain does not exist, or
is disabled. So are complaints and unsubscribes, which are the recipient's
own word. Every other failure (a full mailbox, a spam filter, a policy block,
a rate limit) is soft: it says nothing lasting about the address.

The functions here are pure; the bounded suppression of an address that
bounces softly again and again is decided where events are stored.
"""

from __future__ import annotations

__all__ = ["DEAD_REASONS", "for_good"]

#: The reasons that mean the address itself is dead: a bounce for one of these,
#: when the report calls it permanent, suppresses the address for good.
DEAD_REASONS = frozenset({"user_unknown", "host_unknown", "suspended", "has_moved",
                          "not_accepting"})


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
