"""Why mail failed, in one vocabulary for every source.

A bounce message, a provider's webhook and the outbox's own SMTP or API
refusal each say why in their own words: an RFC 3463 enhanced status code, a
free-text diagnostic, a provider's bounce type and subtype. The functions here
turn each of them into one :data:`REASONS` name. The names follow the bounce
reasons sisimai publishes (the counterpart is in :data:`SISIMAI`), under names
of our own.

Every function is pure and reads its text once, cut at :data:`TEXT_READ`
characters, with patterns of plain alternatives (no nested repetition): its
time is linear in what it is given, and it never raises on any string.
"""

from __future__ import annotations

import re

__all__ = ["REASONS", "SISIMAI", "api_reason", "bounce_reason", "dsn_reason", "mailgun_reason",
           "postmark_reason", "resend_reason", "sendgrid_reason", "ses_reason",
           "smtp_reason", "text_reason"]

#: The reasons, with what each means (the documented table is made from this).
REASONS: dict[str, str] = {
    "user_unknown": "The recipient's mailbox does not exist at its domain.",
    "host_unknown": "The recipient's domain does not exist or has no mail server.",
    "suspended": "The recipient's mailbox exists but is disabled or suspended.",
    "has_moved": "The recipient has moved; the server names no new address here.",
    "not_accepting": "The domain accepts no mail at all (a null MX, a closed server).",
    "mailbox_full": "The recipient's mailbox is over its quota.",
    "message_too_big": "The message is larger than the receiving server accepts.",
    "content": "The message's format or headers were refused.",
    "spam": "A filter took the message for spam.",
    "virus": "A filter found malware in the message.",
    "blocked": "The sending host or IP address is refused (a blocklist, no reverse DNS).",
    "authentication": "The message failed SPF, DKIM or DMARC checks.",
    "policy": "The receiver's policy refused the message (no more specific reason given).",
    "rate_limited": "Too much mail or too many connections: the receiver asked to slow down.",
    "expired": "A server kept the message in its queue until it gave up.",
    "relaying_denied": "The server refused to relay for this sender or domain.",
    "network_error": "The receiving server could not be reached (DNS, connection, routing).",
    "system_error": "The receiving server failed or is out of resources.",
    "syntax_error": "A command or address was malformed at the SMTP level.",
    "account": "The sending account was refused: credentials, quota or unverified domain.",
    "suppressed": "The address is on a suppression list, so nothing was sent to it.",
    "complaint": "The recipient reported the message as spam (a feedback report).",
    "undefined": "A failure whose cause the report does not say.",
}

#: Each reason's counterpart in sisimai's published reason list.
SISIMAI: dict[str, str] = {
    "user_unknown": "userunknown", "host_unknown": "hostunknown", "suspended": "suspend",
    "has_moved": "hasmoved", "not_accepting": "notaccept", "mailbox_full": "mailboxfull",
    "message_too_big": "mesgtoobig, exceedlimit", "content": "contenterror",
    "spam": "spamdetected", "virus": "virusdetected", "blocked": "blocked, requireptr, "
    "badreputation", "authentication": "authfailure",
    "policy": "policyviolation, rejected, filtered, securityerror", "rate_limited": "speeding, toomanyconn", "expired": "expired",
    "relaying_denied": "norelaying", "network_error": "networkerror",
    "system_error": "systemerror, systemfull, mailererror", "syntax_error": "syntaxerror",
    "account": "(none: the sending account's own fault)", "suppressed": "suppressed",
    "complaint": "feedback", "undefined": "undefined",
}

#: The most characters of any text read (a diagnostic longer than this says it early).
TEXT_READ = 4000

#: RFC 3463 (and RFC 7372, RFC 7505) ``subject.detail`` -> reason. A status not
#: here falls to its subject (:data:`SUBJECTS`), then to the text's keywords.
STATUS_CODES: dict[str, str] = {
    "1.1": "user_unknown", "1.2": "host_unknown", "1.3": "user_unknown",
    "1.4": "user_unknown", "1.6": "has_moved", "1.7": "syntax_error", "1.8": "policy",
    "1.10": "not_accepting",
    "2.1": "suspended", "2.2": "mailbox_full", "2.3": "message_too_big",
    "2.4": "system_error",
    "3.1": "system_error", "3.2": "not_accepting", "3.4": "message_too_big",
    "4.1": "network_error", "4.2": "network_error", "4.3": "network_error",
    "4.4": "host_unknown", "4.5": "rate_limited", "4.6": "network_error", "4.7": "expired",
    "4.316": "expired",
    "5.1": "syntax_error", "5.2": "syntax_error", "5.3": "rate_limited",
    "5.4": "syntax_error", "5.5": "syntax_error",
    "7.7": "content", "7.13": "suspended", "7.17": "has_moved", "7.18": "has_moved",
    "7.20": "authentication", "7.21": "authentication", "7.22": "authentication",
    "7.23": "authentication", "7.24": "authentication", "7.25": "blocked",
    "7.26": "authentication", "7.27": "not_accepting", "7.28": "rate_limited",
}

#: RFC 3463's status subjects, for a detail not in :data:`STATUS_CODES`.
SUBJECTS: dict[str, str] = {
    "1": "user_unknown", "2": "mailbox_full", "3": "system_error", "4": "network_error",
    "6": "content", "7": "policy",
}

#: Statuses that say too little: the text's keywords decide when they find something.
_VAGUE = frozenset({"0.0", "7.0", "7.1", "3.0", "1.0", "2.0", "4.0", "5.0", "6.0",
                    # Office 365 refuses an unknown recipient of a domain with 5.4.1.
                    "4.1"})

#: Keywords in a diagnostic's text, most specific first (lowercased text is searched).
KEYWORDS: tuple[tuple[str, str], ...] = (
    ("authentication", (r"\bdmarc\b|\bspf\b|\bdkim\b|not authenticated|unauthenticated "
                       r"(?:email|mail|message)|sender authentication")),
    ("virus", r"virus|malware|infected"),
    ("spam", r"\bspam\b|spam detected|junk mail|bulk mail|unsolicited"),
    ("mailbox_full", (r"mailbox (?:is )?full|quota|insufficient (?:disk )?(?:space|storage)|"
                     r"mailbox size limit|out of storage|storage full|full mailbox")),
    ("message_too_big", (r"too (?:big|large)|size exceeds|exceeds? (?:the )?(?:maximum )?"
                        r"(?:allowed )?(?:message )?size|message size|size limit")),
    # A recipient's own filter, refusing this sender or this message (sisimai's filtered).
    ("policy", (r"refused due to recipient preferences|user reject|user refuses to|"
               r"message rejected due to user rules|you have been blocked by the recipient|"
               r"only accepting mail from specific")),
    ("user_unknown", (r"user unknown|unknown user|no such (?:user|mailbox|recipient|address)|"
                     r"(?:mailbox|user|recipient|address|account) (?:does not|doesn't) exist|"
                     r"(?:mailbox|user|recipient|address) not found|invalid (?:recipient|"
                     r"mailbox)|unknown (?:recipient|mailbox|address)|"
                     r"user not found|user (?:doesn't|does not) have|user not exist|"
                     r"not listed in (?:the )?(?:domino )?directory|recipient name is not "
                     r"recognized|address (?:couldn't|could not) be found|invalid final "
                     r"delivery userid|please check if address is correct|and other "
                     r"recipients in the same domain|not listed in public name|ディレクトリのリストにありません")),
    ("syntax_error", r"invalid '?to'? address|address syntax|syntax error|malformed address"),
    ("not_accepting", (r"no smtp service|null mx|no mx record|no mx found|"
                      r"does not accept (?:any )?mail")),
    ("host_unknown", (r"host unknown|unknown host|no such domain|domain (?:not found|does not "
                     r"exist)|host not found|nxdomain|unroutable|unrouteable|"
                     r"domain name not found|domain is not reachable|dns lookup fail|"
                     r"\bhost [a-z0-9.-]{1,255} not found|[a-z0-9-]\.[a-z]{2,24} does not exist")),
    ("suspended", r"suspended|disabled|deactivated|inactive|account (?:is )?(?:closed|locked)"),
    ("relaying_denied", (r"relay(?:ing)? (?:access )?(?:denied|not permitted|prohibited)|"
                        r"not permitted to relay|unable to relay|relay not|relaying denied")),
    ("expired", (r"retry time(?:out)? (?:exceeded|expired)|queue lifetime|message expired|"
                r"delivery time expired|too long in (?:the )?queue|expired after|"
                r"could not be delivered within")),
    ("rate_limited", (r"rate limit|too many (?:messages|connections|recipients|emails|"
                     r"requests)|throttl|slow down|rate exceeded|sending limit|"
                     r"temporarily deferred")),
    ("blocked", (r"blacklist|blocklist|denylist|\bdnsbl\b|\brbl\b|spamhaus|reputation|"
                r"reverse dns|\bptr\b|client host rejected|ip (?:address )?(?:is )?blocked|"
                r"blocked")),
    ("has_moved", r"has moved|moved to"),
    ("network_error", (r"connection (?:refused|timed out|reset)|network (?:error|unreachable)|"
                      r"no route to host|timed out")),
    ("content", (r"header (?:syntax|error|rejected)|invalid header|content rejected|"
                r"message content|malformed message")),
    ("system_error", r"mailer error|system error|internal error"),
    ("content", r"media error"),
    ("relaying_denied", r"no relaying"),
    ("policy", r"policy|not allowed|prohibited"),
    # Postfix's and Office 365's refusal of a recipient, when no words above say why.
    ("user_unknown", r"recipient address rejected: access denied"),
    ("policy", r"denied|refused|rejected"),
)

_KEYWORD_PATTERNS = tuple((reason, re.compile(pattern)) for reason, pattern in KEYWORDS)
_STATUS = re.compile(r"\b([245])\.(\d{1,3})\.(\d{1,3})\b")
# A reply code, after a diagnostic type (``smtp; 550 ...``) when there is one.
_REPLY_CODE = re.compile(r"\s*(?:[a-z-]{1,16};\s*)?([245]\d\d)\b", re.IGNORECASE)


def _read(text: object) -> str:
    """``text`` as the lowercased string searched (anything else as empty)."""
    return text[:TEXT_READ].lower() if isinstance(text, str) else ""


def text_reason(text: object) -> str | None:
    """The reason a diagnostic's words name, or None when they name none."""
    read = _read(text)
    if not read:
        return None
    for reason, pattern in _KEYWORD_PATTERNS:
        if pattern.search(read):
            return reason
    return None


def _status_reason(status: str) -> tuple[str | None, bool]:
    """(reason of an enhanced status ``c.s.d``, whether it is too vague to trust alone)."""
    found = _STATUS.search(status)
    if found is None:
        return None, True
    subject, detail = found.group(2), str(int(found.group(3)))
    key = f"{int(subject)}.{detail}"
    reason = STATUS_CODES.get(key) or SUBJECTS.get(str(int(subject)))
    return reason, key in _VAGUE or reason is None


def dsn_reason(status: object, diagnostic: object = "") -> str:
    """The reason of a DSN recipient block: its ``Status`` and ``Diagnostic-Code``.

    A specific enhanced code decides (5.1.1 is ``user_unknown`` whatever the
    text says); a vague one (5.0.0, 5.7.1...) lets the text's keywords refine
    it. The diagnostic's own code, the receiving server's, comes before the
    Status, which the reporting MTA may have made up (Sendmail writes 5.1.1
    over a "550 5.7.1 IP address blacklisted").
    """
    status_text = status if isinstance(status, str) else ""
    diagnostic_text = diagnostic if isinstance(diagnostic, str) else ""
    reason, vague = _status_reason(diagnostic_text[:TEXT_READ])
    if reason is None:
        reason, vague = _status_reason(status_text[:TEXT_READ])
    if not vague and reason is not None:
        return reason
    return text_reason(diagnostic_text) or reason or "undefined"


def bounce_reason(status: object, diagnostic: object = "", *, failed: bool = True) -> str:
    """:func:`dsn_reason`, except that a failure with a transient (4.x.x) status is
    ``expired``: a server retried until it gave up (Postfix's queue lifetime,
    Exim's retry timeout)."""
    status_text = status if isinstance(status, str) else ""
    diagnostic_text = diagnostic if isinstance(diagnostic, str) else ""
    found = _STATUS.search(status_text[:TEXT_READ]) or _STATUS.search(diagnostic_text[:TEXT_READ])
    if failed and found is not None and found.group(1) == "4":
        return "expired"
    return dsn_reason(status_text, diagnostic_text)


def smtp_reason(reply: object) -> str:
    """The reason of an SMTP reply (``"550 5.1.1 No such user"``): the outbox's own
    refusals, and a provider's MTA response."""
    text = reply if isinstance(reply, str) else ""
    reason, vague = _status_reason(text[:TEXT_READ])
    if not vague and reason is not None:
        return reason
    worded = text_reason(text)
    if worded is not None:
        return worded
    if reason is not None:
        return reason
    code = _REPLY_CODE.match(text[:40])
    return _BASIC_CODES.get(code.group(1), "undefined") if code else "undefined"


#: Basic SMTP reply codes (RFC 5321) with no enhanced code and no telling words.
_BASIC_CODES: dict[str, str] = {
    "421": "network_error", "450": "system_error", "451": "system_error",
    "452": "mailbox_full", "550": "undefined", "551": "has_moved", "552": "message_too_big",
    "553": "syntax_error", "554": "policy", "555": "syntax_error",
}


def api_reason(code: object, message: object) -> str:
    """The reason of a transport's refusal (``TransportError.code`` and ``.message``).

    An HTTP API's error names its status (``"(HTTP 401)"``): a refusal of the
    account (401, 403) is ``account``, too many requests (429) ``rate_limited``,
    413 ``message_too_big``, a server error ``system_error``. Any other code is
    an SMTP reply's; code 0 (a timeout, a dropped connection) is read as text.
    """
    number = code if isinstance(code, int) and not isinstance(code, bool) else 0
    text = message if isinstance(message, str) else ""
    if number and _HTTP.search(text[:TEXT_READ]):
        if number in _HTTP_CODES:
            return _HTTP_CODES[number]
        if number >= 500:
            return "system_error"
        # The provider's words only: the outbox's own ("refused the message") say nothing.
        detail = text[:TEXT_READ].partition("): ")[2] or text
        return text_reason(detail) or "undefined"
    if number:
        return smtp_reason(f"{number} {text[:TEXT_READ]}")
    return text_reason(text) or "undefined"


_HTTP = re.compile(r"\bHTTP \d{3}\b")
_HTTP_CODES: dict[int, str] = {401: "account", 403: "account", 413: "message_too_big",
                               429: "rate_limited"}


def _word(value: object) -> str:
    return value.strip().lower()[:64] if isinstance(value, str) else ""


def _look(table: dict[str, str], value: object) -> str | None:
    """``table``'s reason for ``value``, its keys compared case-insensitively."""
    word = _word(value)
    return next((reason for key, reason in table.items() if key.lower() == word), None) \
        if word else None


#: SES bounceSubType -> reason (bounceType ``Undetermined`` is ``undefined``).
#: ``Suppressed`` is SES's global list of addresses that recently bounced as not existing:
#: the address is dead (``user_unknown``); ``OnAccountSuppressionList`` is the account's own
#: list, which a complaint may have put it on, so it stays ``suppressed``.
SES_SUBTYPES: dict[str, str] = {
    "NoEmail": "user_unknown", "Suppressed": "user_unknown",
    "OnAccountSuppressionList": "suppressed", "MailboxFull": "mailbox_full",
    "MessageTooLarge": "message_too_big", "ContentRejected": "content",
    "AttachmentRejected": "content",
}


def ses_reason(bounce_type: object, sub_type: object, diagnostic: object = "") -> str:
    """The reason of an SES bounce: ``bounceType``, ``bounceSubType``, the diagnostic."""
    if _word(bounce_type) == "undetermined":
        return dsn_reason(diagnostic, diagnostic) if diagnostic else "undefined"
    return _look(SES_SUBTYPES, sub_type) or dsn_reason(diagnostic, diagnostic)


#: Postmark's bounce ``Type`` (its documented list) -> reason.
POSTMARK_TYPES: dict[str, str] = {
    "HardBounce": "user_unknown", "SoftBounce": "undefined", "Transient": "undefined",
    # An address Postmark found invalid: it will never take mail (dead, as a hard bounce).
    "BadEmailAddress": "user_unknown", "DnsError": "host_unknown",
    "AutoResponder": "undefined", "SpamNotification": "spam", "SpamComplaint": "complaint",
    "Blocked": "blocked", "ManuallyDeactivated": "suppressed", "Unconfirmed": "account",
    "InboundError": "system_error", "AddressChange": "has_moved",
    "ChallengeVerification": "policy", "VirusNotification": "virus",
    "SMTPApiError": "syntax_error", "Unknown": "undefined", "OpenRelayTest": "policy",
    "DMARCPolicy": "authentication", "TemplateRenderingFailed": "content",
}


def postmark_reason(bounce_type: object, details: object = "") -> str:
    """The reason of a Postmark bounce: its ``Type``, refined by ``Details`` when vague."""
    reason = _look(POSTMARK_TYPES, bounce_type) or "undefined"
    if reason in ("undefined", "user_unknown"):
        worded = smtp_reason(details) if details else "undefined"
        if worded != "undefined" and (reason == "undefined" or worded in _DEAD):
            return worded
    return reason


#: Reasons that say the address itself is dead (a vague "hard" bounce may be refined to one).
_DEAD = frozenset({"user_unknown", "host_unknown", "suspended", "not_accepting"})

#: SendGrid's bounce classification -> reason.
SENDGRID_CLASSES: dict[str, str] = {
    "Invalid Address": "user_unknown", "Technical": "system_error", "Content": "content",
    "Reputation": "blocked", "Frequency or Volume Too High": "rate_limited",
    "Mailbox Unavailable": "suspended", "Unclassified": "undefined",
}


def sendgrid_reason(classification: object, reason: object = "") -> str:
    """The reason of a SendGrid bounce: ``bounce_classification``, else its ``reason``."""
    found = _look(SENDGRID_CLASSES, classification)
    if found is not None and found != "undefined":
        return found
    return smtp_reason(reason)


#: Mailgun's failure ``reason`` -> reason (``generic`` is read from the MTA's reply).
#: ``suppress-bounce``: the address is on the account's bounce list (it hard-bounced).
MAILGUN_REASONS: dict[str, str] = {
    "suppress-bounce": "user_unknown", "suppress-complaint": "suppressed",
    "suppress-unsubscribe": "suppressed", "old": "expired", "bounce": "undefined",
    "espblock": "blocked", "greylisted": "policy", "blacklisted": "blocked",
    "generic": "undefined", "hardfail": "undefined",
}


def mailgun_reason(reason: object, severity: object = "", response: object = "") -> str:
    """The reason of a Mailgun failure: ``reason``, refined by the delivery status's reply."""
    found = _look(MAILGUN_REASONS, reason) or "undefined"
    if found != "undefined":
        return found
    del severity  # permanence is the bounce kind's, not the reason's
    return smtp_reason(response)


#: Resend's ``bounce.subType`` -> reason.
RESEND_SUBTYPES: dict[str, str] = {
    "General": "undefined", "NoEmail": "user_unknown", "Suppressed": "user_unknown",
    "OnAccountSuppressionList": "suppressed", "MailboxFull": "mailbox_full",
    "MessageTooLarge": "message_too_big", "ContentRejected": "content",
    "AttachmentRejected": "content",
}


def resend_reason(bounce_type: object, sub_type: object, message: object = "") -> str:
    """The reason of a Resend bounce (SES's types underneath): ``type``, ``subType``, text."""
    found = _look(RESEND_SUBTYPES, sub_type) or "undefined"
    if found != "undefined":
        return found
    del bounce_type  # permanence is the bounce kind's
    return smtp_reason(message)
