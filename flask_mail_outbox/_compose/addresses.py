"""Addresses: every address a ``Message`` names, checked and put in one shape.

Sender, recipients, cc, bcc and reply_to arrive as ``"a@x.org"``,
``"Name <a@x.org>"`` or ``("Name", "a@x.org")``; this module turns each into an
``Addr`` (email-validator decides, syntax only, never a DNS query) or raises
``InvalidMessage`` naming the field. It also holds the check every header
value goes through first: no CR, LF or NUL (header injection), valid Unicode.

A non-ASCII local part (``grüße@example.org``, RFC 6531) is accepted only when
``OUTBOX_ALLOW_SMTPUTF8`` is on (``allow_smtputf8``; None reads the current
app's setting): its ``Addr.ascii`` is then UTF-8, written as such into the
headers (RFC 6532) and sent with the ``SMTPUTF8`` MAIL parameter.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from email.utils import parseaddr
from typing import NamedTuple

import email_validator
from email_validator import EmailNotValidError, validate_email

from .._errors import InvalidMessage
from .ambient import current_options

__all__ = [
    "UNDISCLOSED_RECIPIENTS",
    "Addr",
    "AddressError",
    "address_list",
    "bare_address",
    "check_header_text",
    "display_list",
    "has_bad_chars",
    "needs_smtputf8",
    "parse_address",
    "reply_to_list",
    "resolve_sender",
]

#: The To of a message sent only to bcc, as mail clients write it.
UNDISCLOSED_RECIPIENTS = "undisclosed-recipients:;"

_SPECIALS_FOR_DISPLAY = re.compile(r'[()<>\[\]:;@\\,."]')
_QUOTED_PAIR = re.compile(r"\\(.)")

# email-validator refuses these domains whatever its options say, except
# "test" under test_environment=True. Read, never modified: it is that
# library's global state.
_SPECIAL_USE_DOMAINS: tuple[str, ...] = tuple(
    getattr(
        email_validator,
        "SPECIAL_USE_DOMAIN_NAMES",
        ("arpa", "invalid", "local", "localhost", "onion", "test"),
    )
)


# --------------------------------------------------------------------------- #
# Header text
# --------------------------------------------------------------------------- #


def has_bad_chars(text: str) -> bool:
    """True when ``text`` holds a CR, LF or NUL, which would end or corrupt a header line."""
    return "\r" in text or "\n" in text or "\0" in text


def check_header_text(field: str, text: str) -> None:
    """Raise ``InvalidMessage`` naming ``field`` unless ``text`` can go into a header."""
    if has_bad_chars(text):
        raise InvalidMessage(
            field, f"contains a CR, LF or NUL character (header injection?): {text[:80]!r}"
        )
    if not text.isascii():
        _check_encodable(field, text)


def _check_encodable(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(
            field, f"is not valid Unicode text ({exc.reason} at position {exc.start})"
        ) from None


# --------------------------------------------------------------------------- #
# Parsing and validating
# --------------------------------------------------------------------------- #


class Addr(NamedTuple):
    """A validated address."""

    name: str  # display name, "" when none
    # local@punycode-domain, what the envelope and headers use; the local part
    # is UTF-8 only for an SMTPUTF8 address (see needs_smtputf8).
    ascii: str
    display: str  # local@unicode-domain, for listings
    domain: str  # the ASCII domain


class AddressError(Exception):
    """email-validator's verdict, without its exception chain."""


def needs_smtputf8(address: str) -> bool:
    """Whether an envelope address can only be sent with SMTPUTF8 (a non-ASCII local part)."""
    return not address.isascii()


def app_allows_smtputf8() -> bool:
    """``OUTBOX_ALLOW_SMTPUTF8`` of the current app (as ``init_app`` parsed it); False outside one."""
    return current_options().allow_smtputf8


@functools.lru_cache(maxsize=1024)
def parse_address(address: str, allow_local: bool, allow_smtputf8: bool = False) -> Addr:
    """Validate one bare address (cached: the same senders and recipients repeat).

    With ``allow_smtputf8`` a non-ASCII local part is kept (NFC-normalised) in
    ``Addr.ascii``; the domain is always in its ASCII (punycode) form.
    """
    special = ""
    checked = address
    if allow_local:
        # email-validator has no switch for special-use names other than
        # "test" (test_environment=True), and its list is global state we must
        # not change. So check the address with the reserved suffix swapped
        # for "test", and put the suffix back afterwards.
        head, at, domain = address.rpartition("@")
        lowered = domain.lower()
        for name in _SPECIAL_USE_DOMAINS:
            if lowered == name or lowered.endswith("." + name):
                special = name
                checked = head + at + domain[: len(domain) - len(name)] + "test"
                break
    try:
        valid = validate_email(
            checked,
            check_deliverability=False,  # syntax only: never a DNS query in a request
            allow_smtputf8=allow_smtputf8,
            globally_deliverable=not allow_local,
            test_environment=allow_local,
            # RFC 5321's 64-octet local part, which email-validator skips by default:
            # servers refuse longer ones, and send() is where to hear about it.
            strict=True,
        )
    except EmailNotValidError as exc:
        raise AddressError(str(exc)) from None
    local = valid.ascii_local_part if valid.ascii_local_part is not None else valid.local_part
    if not local.isascii() and not allow_smtputf8:  # pragma: no cover - email-validator refuses it
        raise AddressError("The address needs SMTPUTF8, which is not allowed.")
    ascii_domain = valid.ascii_domain
    unicode_domain = valid.domain
    if special:
        ascii_domain = ascii_domain[: -len("test")] + special
        unicode_domain = unicode_domain[: -len("test")] + special
    return Addr(
        name="",
        ascii=f"{local}@{ascii_domain}",
        display=f"{local}@{unicode_domain}",
        domain=ascii_domain,
    )


def _split_display_form(text: str) -> tuple[str, str]:
    """``Name <a@x.org>`` -> (name, address), as Flask-Mail's parseaddr reads it.

    Done here rather than by email-validator, which refuses the common
    unquoted non-ASCII form ``Jörg Müller <j@x.org>``. An addr-spec cannot
    contain "<", so the last one starts the address.
    """
    if not text.endswith(">") or "<" not in text:
        return "", text
    start = text.rindex("<")
    name = text[:start].strip()
    if len(name) >= 2 and name[0] == '"' and name[-1] == '"':
        name = _QUOTED_PAIR.sub(r"\1", name[1:-1])
    return name, text[start + 1 : -1]


def _address(field: str, value: object, allow_local: bool, allow_smtputf8: bool) -> Addr:
    """One address in any accepted form, or InvalidMessage naming ``field``."""
    if isinstance(value, str):
        check_header_text(field, value)
        name, address = _split_display_form(value)
    elif isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[0], str) or not isinstance(value[1], str):
            raise InvalidMessage(
                field, f"an address tuple must be (name, address), both str; got {value!r}"
            )
        name, address = value
        check_header_text(field, name)
        check_header_text(field, address)
    else:
        raise InvalidMessage(
            field,
            f"expected an address string or a (name, address) tuple, got {type(value).__name__}",
        )
    if not address:
        raise InvalidMessage(field, f"{value!r} has no address")
    try:
        addr = parse_address(address, allow_local, allow_smtputf8)
    except AddressError as exc:
        hint = ""
        if not allow_local and _looks_local(address):
            hint = "; set OUTBOX_ALLOW_LOCAL_ADDRESSES = True to allow local and test domains"
        elif not allow_smtputf8 and not address.rpartition("@")[0].isascii():
            hint = ("; set OUTBOX_ALLOW_SMTPUTF8 = True to allow non-ASCII local parts "
                    "(RFC 6531: only servers that offer SMTPUTF8 take them)")
        raise InvalidMessage(
            field, f"{address!r} is not a valid email address ({exc}){hint}"
        ) from None
    return addr._replace(name=name) if name else addr


def _looks_local(text: str) -> bool:
    local, at, domain = text.rpartition("@")
    if not at or not local or not domain:
        return False  # not an address at all: no hint about local domains
    domain = domain.lower()
    return "." not in domain or any(
        domain == d or domain.endswith("." + d) for d in _SPECIAL_USE_DOMAINS
    )


def address_list(field: str, value: object, allow_local: bool, *,
                 allow_smtputf8: bool | None = None) -> list[Addr]:
    """A list of addresses (recipients, cc, bcc); None is an empty list.

    ``allow_smtputf8`` None: the current app's ``OUTBOX_ALLOW_SMTPUTF8``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        raise InvalidMessage(
            field, f"expected a list of addresses, got the string {value!r}; write [{value!r}]"
        )
    if not isinstance(value, (list, tuple)):
        raise InvalidMessage(field, f"expected a list of addresses, got {type(value).__name__}")
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, str) for v in value)
        and "@" not in value[0]
        and "@" in value[1]
    ):
        raise InvalidMessage(field, f"got the single address tuple {value!r}; write [{value!r}]")
    utf8 = app_allows_smtputf8() if allow_smtputf8 is None else allow_smtputf8
    return [_address(f"{field}[{i}]", item, allow_local, utf8) for i, item in enumerate(value)]


def resolve_sender(sender: object, default_sender: object, allow_local: bool, *,
                   allow_smtputf8: bool | None = None) -> Addr:
    """The message's sender, else ``MAIL_DEFAULT_SENDER``; neither is an error."""
    utf8 = app_allows_smtputf8() if allow_smtputf8 is None else allow_smtputf8
    if sender is not None and sender != "":
        return _address("sender", sender, allow_local, utf8)
    if default_sender is None or default_sender == "":
        raise InvalidMessage(
            "sender",
            "the message has no sender and there is no default; set MAIL_DEFAULT_SENDER or pass sender=",
        )
    try:
        return _address("sender", default_sender, allow_local, utf8)
    except InvalidMessage as exc:
        raise InvalidMessage("sender", f"MAIL_DEFAULT_SENDER: {exc.problem}") from None


def reply_to_list(value: object, allow_local: bool, *,
                  allow_smtputf8: bool | None = None) -> list[Addr]:
    """Reply-To: one address or a list of them; None or "" is none."""
    if value is None or value == "":
        return []
    utf8 = app_allows_smtputf8() if allow_smtputf8 is None else allow_smtputf8
    if isinstance(value, list):
        return [_address(f"reply_to[{i}]", item, allow_local, utf8)
                for i, item in enumerate(value)]
    return [_address("reply_to", value, allow_local, utf8)]


# --------------------------------------------------------------------------- #
# Unvalidated and display forms
# --------------------------------------------------------------------------- #


def bare_address(addr: object) -> str:
    """The addr-spec of an unvalidated address, for ``send_to``."""
    if isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[1], str):
        return addr[1]
    if isinstance(addr, str):
        if "<" in addr:
            return parseaddr(addr)[1] or addr
        return addr
    return ""


def display_list(addrs: Sequence[Addr]) -> str:
    """The To header as a person reads it (decoded names, Unicode domains)."""
    out = []
    for addr in addrs:
        if not addr.name:
            out.append(addr.display)
        elif _SPECIALS_FOR_DISPLAY.search(addr.name):
            quoted = addr.name.replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'"{quoted}" <{addr.display}>')
        else:
            out.append(f"{addr.name} <{addr.display}>")
    return ", ".join(out)
