"""What an SMTP reply means for the email: sent too fast, try again later, or never.

:func:`classify_reply` is a pure function of the reply code, the enhanced
status code (RFC 3463, ``class.subject.detail`` at the start of the text) and
the words. It separates two kinds of 4xx that call for opposite responses:

* **throttled**: the server says *this client* is sending too fast (Gmail
  ``4.7.28``, Outlook ``4.7.500 Server busy``, SES ``454 Throttling failure``,
  Postfix ``too many connections``). The message is not at fault: the sender
  slows down and the attempt may be given back, a bounded number of times.
* **transient**: anything else that may work later: greylisting ("try again
  later", ``4.7.1 greylisted``), a full mailbox (``4.2.2``), a local error
  (``4.3.0``). The attempt counts and the retry backoff applies, so a server
  that never accepts ends in the dead-letter list instead of a loop.

5xx is permanent. The table of real replies this is tested against, with
where each came from, is in ``tests/test_replies.py``.
"""

from __future__ import annotations

import enum
import re

__all__ = ["ReplyClass", "classify_reply", "enhanced_code"]


class ReplyClass(enum.Enum):
    """The three fates an SMTP reply can give an attempt."""

    THROTTLED = "throttled"
    TRANSIENT = "transient"
    PERMANENT = "permanent"


#: Reply codes a throttling server uses (RFC 5321 421/450/451/452, and 454
#: as Amazon SES uses it).
THROTTLE_CODES = frozenset({421, 450, 451, 452, 454})

#: Enhanced status codes that mean "too fast" whatever the words.
THROTTLE_ENHANCED = frozenset({
    "4.7.28",   # Gmail: unusual rate of mail from your IP, temporarily rate limited
    "4.7.500",  # Outlook.com / Office 365: server busy, try again later from <ip>
    "4.7.650",  # Outlook.com: IP reputation throttling
})

#: Enhanced status codes that are never throttling, whatever the words: a full
#: mailbox says "quota exceeded" about the recipient, not about the sender's rate.
NEVER_THROTTLE_ENHANCED = frozenset({
    "4.2.0", "4.2.2", "4.2.3", "4.2.4",  # the mailbox: unavailable, full, too large, list
    "4.4.1", "4.4.2", "4.4.3", "4.4.4", "4.4.5", "4.4.6", "4.4.7",  # network and routing
    "4.5.0", "4.5.1", "4.5.2", "4.5.3", "4.5.4", "4.5.5", "4.5.6",  # protocol; 4.5.3: too
    # many recipients in this message (RFC 5321 4.5.3.1.10)
})

# "rate" as a word ("sending rate", "rate limited", "ratelimit"), not inside
# "separate" or "generate"; "too many" only of connections, sessions or
# messages ("too many errors" is about our commands, "too many recipients"
# about this message); "exceeded" only of a rate, a limit or connections
# ("timeout exceeded" and "quota exceeded" are not about our pace).
_THROTTLE_WORDS = re.compile(
    r"\brate\b|\brate[- ]?limit|throttl|slow down|too much mail|unexpected volume|\btss04\b"
    r"|too many (?:\w+ ){0,2}(?:connections|sessions|messages|mails?|emails?)\b"
    r"|(?:rate|limit|connections?)\b[^.;]*\bexceeded|\bexceeded\b[^.;]*\b(?:rate|limit)",
    re.IGNORECASE)
# Greylisting is a deliberate "come back in a few minutes", and "too many
# recipients" is about the message: never throttling, whatever else they say.
_NEVER_THROTTLE_WORDS = re.compile(r"gr[ae]ylist|too many recipients", re.IGNORECASE)
# At the start of the text or of one of its lines (RFC 3463 section 2; a
# multi-line reply repeats it on each line).
_ENHANCED = re.compile(r"(?:^|\n)[ \t]*([245])\.(\d{1,3})\.(\d{1,3})(?![\d.])")


def enhanced_code(text: str) -> str | None:
    """The RFC 3463 enhanced status code that starts a reply text or line (``"4.7.28"``)."""
    match = _ENHANCED.search(text)
    if match is None:
        return None
    return ".".join(match.groups())


def classify_reply(code: int, text: str) -> ReplyClass:
    """Classify an SMTP reply: ``code`` (e.g. 451) and its ``text`` (without the code).

    5xx is :attr:`ReplyClass.PERMANENT`; a 4xx is
    :attr:`ReplyClass.THROTTLED` only when its enhanced code or its words say
    the client is too fast (and it is not greylisting nor a full mailbox);
    every other reply is :attr:`ReplyClass.TRANSIENT`.
    """
    if code >= 500:
        return ReplyClass.PERMANENT
    if code not in THROTTLE_CODES:
        return ReplyClass.TRANSIENT
    enhanced = enhanced_code(text)
    if enhanced in NEVER_THROTTLE_ENHANCED or _NEVER_THROTTLE_WORDS.search(text):
        return ReplyClass.TRANSIENT
    if enhanced in THROTTLE_ENHANCED or _THROTTLE_WORDS.search(text):
        return ReplyClass.THROTTLED
    return ReplyClass.TRANSIENT


_QUEUE_ID = re.compile(r"queued as\s+<?([\w.@-]+)>?|\bid=([\w.-]+)|^ok\s+<?([\w.@-]{8,})>?\s*$",
                       re.IGNORECASE)


def queue_id(text: str) -> str | None:
    """The server's id of an accepted message from its final ``250`` text, if it gives one.

    Postfix and sendmail say ``queued as 4F3A2...``, Exim ``id=1abc-...``,
    Amazon SES ``Ok 0100018c...``; many servers say nothing of the sort.
    """
    for line in reversed(text.splitlines()):
        match = _QUEUE_ID.search(line.strip().removeprefix("2.0.0").strip())
        if match is not None:
            found = next(group for group in match.groups() if group)
            return found[:255]
    return None
