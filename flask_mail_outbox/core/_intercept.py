"""Staging at delivery: ``OUTBOX_REDIRECT_TO``, ``OUTBOX_ALLOWED_RECIPIENTS`` and ``before_send``.

:meth:`Interceptor.intercept` runs once per attempt, in the delivery thread,
on each claimed email that still has a recipient after the suppression list
(which screens the real addresses first: a suppressed recipient is left out
whatever is configured here, and an email all of whose recipients are
suppressed ends ``suppressed`` before this runs). In this order:

1. **redirect** (``OUTBOX_REDIRECT_TO``): the envelope goes to those addresses
   instead; the ``To`` header becomes them, ``Cc`` is removed, and the
   original ``To`` and ``Cc`` are kept, as written, in ``X-Outbox-Original-To``
   and ``X-Outbox-Original-Cc`` (Bcc never appears in a header);
2. **the hook** (``before_send``): sees the email as it would go now and may
   change its recipients and headers, or veto it;
3. **the allow-list** (``OUTBOX_ALLOWED_RECIPIENTS``): the last gate on the
   envelope, so neither a redirect nor a hook reaches an address outside it.

An email left with no recipient, or vetoed, ends ``cancelled`` without
contacting a server (:class:`Intercepted`), its ``last_error`` saying why. A
hook that raises fails the attempt as a transient failure: the email is
never sent unintercepted. What was done is a short JSON list of notes,
written to ``outbox_email.intercepted`` with the outcome (:func:`write_notes`).
The stored MIME is never changed: the headers are edited in this attempt's
bytes, before DKIM signs them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Sequence
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import SMTP
from email.policy import default as default_policy
from email.utils import getaddresses
from typing import TYPE_CHECKING, Any

from .. import _degrade
from .._compose.addresses import AddressError, parse_address
from .._compose.dkim import header_fields
from .._compose.mime import unstructured_header
from .._errors import InvalidMessage, TransientError
from .._outside import clean_line, clean_text
from ..transports import Failed
from ._leases import ClaimedEmail, Interception, Outcome
from ._models import email_table

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

#: Where a redirected email keeps its original ``To`` and ``Cc`` headers. Not
#: ``X-Original-To``: Postfix (and others) add that one at final delivery for the
#: envelope recipient, so a redirected email would arrive with two of them, the
#: redirect inbox's on top.
ORIGINAL_TO = "X-Outbox-Original-To"
ORIGINAL_CC = "X-Outbox-Original-Cc"

#: Headers ``before_send`` may not set or remove: the outbox's identity of the email
#: (events and bounces find it by its Message-ID), the body's structure, what
#: DKIM adds after the hook, what only servers write, and Bcc (never a header).
PROTECTED_HEADERS = frozenset({
    "message-id", "mime-version", "content-type", "content-transfer-encoding",
    "content-disposition", "dkim-signature", "bcc", "return-path", "received"})

#: A note is at most this long; at most this many are kept per attempt.
NOTE_LIMIT = 300
NOTES_KEPT = 20

_HEADER_NAME = re.compile(r"[!-9;-~]{1,76}")  # RFC 5322 ftext: printable ASCII but ":"
#: Control characters but the tab: the header factory would write them raw (a vertical tab
#: or form feed ends a line for some readers); CR, LF and NUL are refused before, as injection.
_CONTROL = re.compile(r"[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclasses.dataclass(frozen=True)
class Intercepted:
    """The result of an email interception ended unsent (vetoed, or no recipient left)."""

    reason: str
    failovers: tuple[Any, ...] = ()


# -- the allow-list ---------------------------------------------------------------------


def allow_pattern(pattern: Any, *, allow_local: bool) -> str:
    """One ``OUTBOX_ALLOWED_RECIPIENTS`` entry normalised: ``user@domain`` or ``*@domain``.

    The domain is kept in its ASCII form and everything in lower case, as the
    suppression list compares addresses. Raises ``ValueError`` with the problem.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"expected 'user@example.com' or '*@example.com', got {pattern!r}")
    text = pattern.strip()
    local, at, domain = text.rpartition("@")
    if local == "*" and at:
        try:
            return "*@" + parse_address(f"x@{domain}", allow_local).domain.lower()
        except AddressError as exc:
            raise ValueError(f"{pattern!r}: {domain!r} is not a domain ({exc})") from None
    if "*" in text:
        raise ValueError(f"{pattern!r}: the only wildcard is a whole local part, "
                         "'*@example.com' (one domain; subdomains need their own entry)")
    try:
        return parse_address(text, allow_local, True).ascii.lower()
    except AddressError as exc:
        raise ValueError(f"{pattern!r} is not an address nor '*@domain' ({exc})") from None


class AllowList:
    """``OUTBOX_ALLOWED_RECIPIENTS``: exact addresses and ``*@domain`` patterns."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        self._addresses = {p for p in self.patterns if not p.startswith("*@")}
        self._domains = {p[2:] for p in self.patterns if p.startswith("*@")}

    def allows(self, address: str) -> bool:
        """Whether ``address`` (as the row stores it) matches an entry, ignoring case."""
        lowered = address.lower()
        return lowered in self._addresses or lowered.rpartition("@")[2] in self._domains


# -- the header block of one attempt ----------------------------------------------------


def header_line(name: str, value: str) -> bytes:
    """``name: value`` as a folded header field (RFC 2047 where needed), without its CRLF.

    Raises ``InvalidMessage`` naming the header for a bad name, a CR, LF or NUL
    in the value (header injection), another control character but the tab, or
    an address header that does not parse.
    """
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        raise InvalidMessage("header", f"{name!r} is not a header name")
    if not isinstance(value, str):
        raise InvalidMessage(name, f"expected a str value, got {type(value).__name__}")
    if "\r" in value or "\n" in value or "\0" in value:
        raise InvalidMessage(name, f"contains a CR, LF or NUL character (header "
                                   f"injection?): {value[:80]!r}")
    if _CONTROL.search(value):
        raise InvalidMessage(name, f"contains a control character (a header holds printable "
                                   f"text, spaces and tabs): {value[:80]!r}")
    header = SMTP.header_factory(name, value)
    if header.defects:
        raise InvalidMessage(name, f"{value[:80]!r} does not parse: {header.defects[0]}")
    folded: str = header.fold(policy=SMTP)
    return folded.rstrip("\r\n").encode("ascii")


class Headers:
    """The header fields of one message, edited in place; the body is kept as it is."""

    def __init__(self, mime: bytes) -> None:
        end = mime.find(b"\r\n\r\n")
        head, self._rest = (mime, b"") if end < 0 else (mime[:end], mime[end:])
        self.fields = header_fields(head)
        self.changed = False

    def raw_values(self, name: str) -> list[bytes]:
        """The values of the fields called ``name`` as written (folds and encoded words)."""
        lowered = name.lower().encode("ascii")
        return [field.partition(b":")[2] for key, field in self.fields if key == lowered]

    def get(self, name: str) -> str | None:
        """The first ``name`` header, decoded; None without one."""
        values = self.raw_values(name)
        if not values:
            return None
        parsed = BytesParser(policy=default_policy).parsebytes(
            name.encode("ascii") + b":" + values[0] + b"\r\n\r\n", headersonly=True)
        return str(parsed.get(name, ""))

    def remove(self, name: str) -> bool:
        """Remove every ``name`` header; whether there was one."""
        lowered = name.lower().encode("ascii")
        kept = [item for item in self.fields if item[0] != lowered]
        removed = len(kept) != len(self.fields)
        if removed:
            self.fields, self.changed = kept, True
        return removed

    def put(self, name: str, line: bytes) -> None:
        """Set the ``name`` header to ``line`` (a whole field): in place of the first, else last."""
        lowered = name.lower().encode("ascii")
        at = next((i for i, (key, _) in enumerate(self.fields) if key == lowered), None)
        self.remove(name)
        self.fields.insert(len(self.fields) if at is None else at, (lowered, line))
        self.changed = True

    def copy_as(self, name: str, new_name: str) -> None:
        """Keep the ``name`` headers, as written, under ``new_name`` (none: nothing)."""
        values = self.raw_values(name)
        self.remove(new_name)
        for value in values:
            self.fields.append((new_name.lower().encode("ascii"),
                                new_name.encode("ascii") + b":" + value))
            self.changed = True

    def mime(self) -> bytes:
        """The message with these header fields."""
        return b"\r\n".join(field for _, field in self.fields) + self._rest


# -- what before_send is given ----------------------------------------------------------


class OutgoingEmail:
    """One email about to be handed to its transport, as ``before_send`` sees and changes it.

    ``recipients`` is the envelope as it would go now (after the suppression
    list and ``OUTBOX_REDIRECT_TO``); assign a new list to change it.
    ``original_recipients`` are the row's, as ``send()`` stored them (To, Cc
    and Bcc). :meth:`set_header` and :meth:`remove_header` change this
    attempt's headers (the stored message stays as it was), :meth:`veto` ends
    the email ``cancelled`` unsent, :meth:`note` adds a line to what the row
    records. Every change is recorded on the row (``intercepted``).
    """

    def __init__(self, email: ClaimedEmail, recipients: Sequence[str], headers: Headers | None,
                 *, allow_local: bool, allow_smtputf8: bool) -> None:
        self.id = email.id
        self.message_id = email.message_id
        #: The envelope sender (the header From is in :attr:`parsed`).
        self.sender = email.sender
        self.transport = email.transport
        self.attempt = email.attempt
        self.original_recipients = email.recipients
        self._mime = email.mime
        self._headers = headers
        self._recipients = tuple(recipients)
        self._allow = (allow_local, allow_smtputf8)
        self.notes: list[str] = []
        self.vetoed: str | None = None

    @property
    def recipients(self) -> tuple[str, ...]:
        """The envelope recipients this attempt goes to."""
        return self._recipients

    @recipients.setter
    def recipients(self, addresses: Sequence[str]) -> None:
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            raise InvalidMessage("recipients", f"expected a list of addresses, got {addresses!r}")
        checked = []
        for index, address in enumerate(addresses):
            if not isinstance(address, str):
                raise InvalidMessage(f"recipients[{index}]", f"expected a str, got {address!r}")
            try:
                checked.append(parse_address(address.strip(), *self._allow).ascii)
            except AddressError as exc:
                raise InvalidMessage(f"recipients[{index}]",
                                     f"{address!r} is not a valid email address ({exc})") from None
        if tuple(checked) != self._recipients:
            self._recipients = tuple(checked)
            self.notes.append("before_send changed the recipients to "
                              + (", ".join(checked) or "none"))

    def _fields(self) -> Headers:
        """This attempt's header fields, split on first use."""
        if self._headers is None:
            self._headers = Headers(self._mime)
        return self._headers

    @property
    def headers(self) -> list[tuple[str, str]]:
        """Every header as it would be sent now, in order, decoded: ``(name, value)``."""
        return [(name, str(value)) for name, value in self.parsed.items()]

    @property
    def parsed(self) -> EmailMessage:
        """The message as it would be sent now, parsed (a copy: change it through the methods)."""
        parsed = BytesParser(policy=default_policy).parsebytes(self._fields().mime())
        return parsed

    def header(self, name: str) -> str | None:
        """The first ``name`` header as it would be sent now, decoded; None without one."""
        return self._fields().get(name)

    def set_header(self, name: str, value: str) -> None:
        """Add the header ``name``, or replace every one of that name (validated: no CR/LF)."""
        line = header_line(name, value)
        self._check_changeable(name)
        self._fields().put(name, line)
        self.notes.append(f"before_send set {name}: {value}")

    def remove_header(self, name: str) -> None:
        """Remove every ``name`` header (nothing when there is none)."""
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise InvalidMessage("header", f"{name!r} is not a header name")
        self._check_changeable(name)
        if self._fields().remove(name):
            self.notes.append(f"before_send removed {name}")

    def veto(self, reason: str) -> None:
        """Do not send this email: it ends ``cancelled``, ``reason`` on its row."""
        self.vetoed = clean_line(reason, NOTE_LIMIT) or "no reason given"

    def note(self, text: str) -> None:
        """Add ``text`` to what the row records of this attempt."""
        self.notes.append(str(text))

    @staticmethod
    def _check_changeable(name: str) -> None:
        if name.lower() in PROTECTED_HEADERS:
            raise InvalidMessage(name, "before_send may not change this header (the outbox "
                                       "or the servers own it)")


#: The core's ``before_send``: called with each :class:`OutgoingEmail` (see ``Callbacks``).
BeforeSend = Callable[[OutgoingEmail], None]


# -- the interceptor ----------------------------------------------------------------------


class Interceptor:
    """Redirect, hook and allow-list applied to claimed emails (see the module docstring)."""

    def __init__(self, *, redirect_to: tuple[str, ...] | None,
                 allowed: tuple[str, ...] | None, before_send: BeforeSend | None,
                 allow_local: bool, allow_smtputf8: bool, max_attempts: int) -> None:
        self.redirect_to = redirect_to
        self.allowed = AllowList(allowed) if allowed is not None else None
        self.before_send = before_send
        self._allow = {"allow_local": allow_local, "allow_smtputf8": allow_smtputf8}
        self.max_attempts = max_attempts

    @property
    def active(self) -> bool:
        """Whether anything is configured (else emails pass untouched, at no cost)."""
        return bool(self.redirect_to or self.allowed or self.before_send)

    def intercept(self, email: ClaimedEmail
                  ) -> tuple[ClaimedEmail, Intercepted | Failed | None]:
        """``email`` as this attempt sends it, and how it ends if it is not sent (else None)."""
        recipients: Sequence[str] = email.deliverable
        headers: Headers | None = None
        notes: list[str] = []
        if self.redirect_to:
            headers = redirected(email.mime, self.redirect_to)
            notes.append(f"redirected to {', '.join(self.redirect_to)} (OUTBOX_REDIRECT_TO) "
                         f"instead of {', '.join(recipients)}")
            recipients = self.redirect_to
        if self.before_send is not None:
            outgoing = OutgoingEmail(email, recipients, headers, **self._allow)
            try:
                self.before_send(outgoing)
            except Exception as exc:  # noqa: BLE001 - reported; the attempt fails, retried
                return self._hook_failed(email, notes, exc)
            notes += outgoing.notes
            recipients, headers = outgoing.recipients, outgoing._headers
            if outgoing.vetoed is not None:
                reason = f"vetoed by before_send: {outgoing.vetoed}"
                return with_notes(email, notes), Intercepted(reason)
        if not recipients:
            return with_notes(email, notes), Intercepted("before_send left it no recipient")
        if self.allowed is not None:
            blocked = [r for r in recipients if not self.allowed.allows(r)]
            if blocked:
                notes.append(f"not sent to {', '.join(blocked)}: outside "
                             "OUTBOX_ALLOWED_RECIPIENTS")
                recipients = [r for r in recipients if r not in blocked]
            if not recipients:
                return with_notes(email, notes), Intercepted(
                    f"not sent: no recipient is in OUTBOX_ALLOWED_RECIPIENTS "
                    f"({', '.join(blocked)})")
        changed = headers is not None and headers.changed
        if not notes and not changed and tuple(recipients) == email.deliverable:
            return email, None
        headers = headers or Headers(email.mime)
        mime = headers.mime() if changed else email.mime
        return dataclasses.replace(email, interception=Interception(
            tuple(recipients), mime, kept_notes(notes),
            left_out=not_in_envelope(headers, recipients))), None

    def _hook_failed(self, email: ClaimedEmail, notes: list[str],
                     exc: Exception) -> tuple[ClaimedEmail, Failed]:
        said = clean_line(f"{type(exc).__name__}: {exc}", NOTE_LIMIT)
        _degrade.report(
            f"before_send raised for email {email.id} ({email.message_id}) on attempt "
            f"{email.attempt}: {said}",
            consequence="it is not sent on this attempt (never unintercepted): it is retried "
                        "as a transient failure, after the retry backoff, and dead-lettered "
                        f"if the hook still raises on attempt {self.max_attempts} "
                        "(OUTBOX_MAX_ATTEMPTS)",
            fix="fix the @mail.before_send function (the traceback below); to end an email "
                "on purpose, call email.veto(reason) instead of raising",
            exc=exc)
        error = TransientError(f"before_send raised {said}")
        return with_notes(email, [*notes, f"before_send raised {said}"]), Failed(error)


def redirected(mime: bytes, redirect_to: Sequence[str]) -> Headers:
    """The headers of ``mime`` with ``To`` the redirect's and no ``Cc``, the originals kept."""
    headers = Headers(mime)
    headers.copy_as("To", ORIGINAL_TO)
    headers.copy_as("Cc", ORIGINAL_CC)
    headers.remove("Cc")
    # Bare ASCII addresses (load_config checked them): written as they are, folded
    # between addresses, without the header registry's parse.
    headers.put("To", unstructured_header("To", ", ".join(redirect_to)).encode("ascii"))
    return headers


def not_in_envelope(headers: Headers, recipients: Sequence[str]) -> tuple[str, ...]:
    """The addresses ``headers``' To and Cc name that ``recipients`` do not hold.

    A JSON API addresses a message by its headers: without these in the
    envelope's ``left_out`` it would send to an address the allow-list or the
    hook took out of the envelope.
    """
    going = {address.lower() for address in recipients}
    # The raw values, unfolded: an encoded display name does not change the address.
    named = getaddresses([value.replace(b"\r\n", b"").decode("utf-8", "replace")
                          for name in ("To", "Cc") for value in headers.raw_values(name)])
    found: list[str] = []
    for _, address in named:
        try:
            key = parse_address(address, True, True).ascii.lower()
        except AddressError:
            key = address.strip().lower()
        if key and key not in going and key not in found:
            found.append(key)
    return tuple(found)


def with_notes(email: ClaimedEmail, notes: Sequence[str]) -> ClaimedEmail:
    """``email`` ending unsent, carrying ``notes`` to its record."""
    return dataclasses.replace(email, interception=Interception((), email.mime,
                                                                kept_notes(notes)))


def kept_notes(notes: Sequence[str]) -> tuple[str, ...]:
    """``notes`` made safe to store: each one line, cut short, at most :data:`NOTES_KEPT`."""
    kept = [clean_line(note, NOTE_LIMIT) for note in notes[:NOTES_KEPT]]
    if len(notes) > NOTES_KEPT:
        kept[-1] = f"... and {len(notes) - NOTES_KEPT + 1} more note(s)"
    return tuple(kept)


def write_notes(tx: Connection, recorded: Sequence[Outcome]) -> None:
    """Write what interception did to each recorded outcome's row (``intercepted``).

    An email that interception left untouched is not written: no statement
    at all where nothing is configured.
    """
    t = email_table
    for outcome in recorded:
        interception = outcome.email.interception
        if interception is None:
            continue
        notes = json.dumps(list(interception.notes)) if interception.notes else None
        tx.execute(t.update().where(t.c.id == outcome.email.id).values(intercepted=notes))


def notes_of(text: str | None) -> tuple[str, ...]:
    """The notes stored in an ``intercepted`` column (none for NULL or text that is not a list)."""
    if not text:
        return ()
    try:
        notes = json.loads(text)
    except ValueError:
        return (clean_text(text, NOTE_LIMIT),)
    return tuple(str(note) for note in notes) if isinstance(notes, list) else ()
