"""Messages: the Flask-Mail compatible ``Message``, and turning one into a ``PreparedEmail``.

``prepare_message()`` is the one place where a ``Message`` is checked and turned
into the exact bytes that will go over SMTP. ``mail.send()`` calls it before
anything is written, so a bad message raises ``InvalidMessage`` in the request
that made it, never later in a worker.

This module holds the user's classes and the order of the steps; the checks
are in ``_addresses`` (every address) and ``_fields`` (every other field), and
``_mime`` writes the bytes.
"""

from __future__ import annotations

import mimetypes
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from .._errors import ConfigError, InvalidMessage
from .addresses import (
    UNDISCLOSED_RECIPIENTS,
    Addr,
    address_list,
    app_allows_smtputf8,
    bare_address,
    check_header_text,
    display_list,
    has_bad_chars,
    reply_to_list,
    resolve_sender,
)
from .ambient import ComposeOptions, current_options
from .fields import (
    AttachmentInfo,
    ExtraHeaders,
    check_attachments,
    check_esmtp_options,
    extra_headers,
    resolve_charset,
    resolve_date,
    size_and_limit,
    text_alternatives,
)
from .html_text import html_to_text
from .links import UnsubscribeLinks
from .message_id import context_domain, new_message_id, resolve_message_id
from .mime import Part, message_body, top_headers
from .unsubscribe import unsubscribe_lines

__all__ = ["Address", "Attachment", "AttachmentInfo", "Message", "PreparedEmail", "TemplateInfo",
           "prepare_message"]

#: An address as users give it: ``"a@x.org"``, ``"Name <a@x.org>"`` or ``("Name", "a@x.org")``.
Address: TypeAlias = "str | tuple[str, str]"


# What makes a display name need quotes (email.utils.formataddr's set).
_NAME_SPECIALS = re.compile(r'[][\\()<>@,:;".]')


# --------------------------------------------------------------------------- #
# The user-facing classes
# --------------------------------------------------------------------------- #


class Attachment:
    """A file attached to a ``Message``, as in Flask-Mail.

    ``data`` is bytes (sent byte-exact) or str (sent as UTF-8). A missing
    ``content_type`` is guessed from ``filename``. ``headers`` are extra MIME
    headers of this part, for example ``{"Content-ID": "<logo>"}`` for an
    inline image.
    """

    def __init__(
        self,
        filename: str | None = None,
        content_type: str | None = None,
        data: bytes | str | None = None,
        disposition: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> None:
        self.filename = filename
        self.content_type = content_type
        self.data = data
        self.disposition = disposition or "attachment"
        self.headers: Mapping[str, str] | Iterable[tuple[str, str]] = headers or {}

    def __repr__(self) -> str:
        return f"<Attachment {self.filename!r} {self.content_type!r}>"


@dataclass(frozen=True)
class TemplateInfo:
    """Which template a message was rendered from; its row records the three fields.

    ``name`` is the email's template name (``"orders/shipped"``), ``locale`` the
    locale it was rendered in (None without translations), ``source_hash`` the
    SHA-256 (hex) of every template file the render read, so a row says which
    version of the template it came from.
    """

    name: str
    locale: str | None
    source_hash: str


class Message:
    """An email, with Flask-Mail 0.10's constructor, attributes and helpers.

    The constructor accepts anything, as Flask-Mail's does; ``mail.send()``
    (through ``prepare_message``) validates and raises ``InvalidMessage``
    naming the offending field. A missing ``sender`` is the app's
    ``MAIL_DEFAULT_SENDER``, as in Flask-Mail: set by the constructor inside
    an app context, else filled in when the message is built. A
    ``(name, address)`` sender reads back as ``"name <address>"``, as in
    Flask-Mail.

    ``msgId`` is made with the message, as Flask-Mail makes it, and becomes
    the stored row's Message-ID. Its domain is ``OUTBOX_MESSAGE_ID_DOMAIN``
    when an app context is active, else the domain of the sender (the
    message's, or the app's ``MAIL_DEFAULT_SENDER``); never a DNS lookup.
    Made outside an app context and without a sender, the message has no
    domain to go by yet: ``msgId`` reads None until one is known (a sender is
    set, or it is read or built in an app context), and is kept from then on.
    Made outside an app context, it is made again when it is sent by an app
    whose ``OUTBOX_MESSAGE_ID_DOMAIN`` names another domain. Set it to
    ``"<id@domain>"`` to choose one, or to None to have a new one made.
    One ``Message`` is one email: sent again, it keeps its Message-ID and Date.

    ``list_unsubscribe`` (keyword-only): an ``https://`` URL and/or a
    ``mailto:`` URI, a str or a sequence of them, written as
    ``List-Unsubscribe``; with an https URL, ``List-Unsubscribe-Post:
    List-Unsubscribe=One-Click`` too (RFC 8058 one-click unsubscribe).
    True: the outbox makes the one-click URL itself, ``OUTBOX_UNSUBSCRIBE_URL``
    plus a token signed with ``SECRET_KEY`` naming the recipient (exactly one
    is required), and its route suppresses that address for bulk mail.

    ``subject`` is at most :data:`MAX_SUBJECT_CHARS` (10,000) characters.
    """

    def __init__(
        self,
        subject: str = "",
        recipients: list[Address] | None = None,
        body: str | None = None,
        html: str | None = None,
        alts: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        sender: Address | None = None,
        cc: list[Address] | None = None,
        bcc: list[Address] | None = None,
        attachments: list[Attachment] | None = None,
        reply_to: Address | None = None,
        date: float | datetime | None = None,
        charset: str | None = None,
        extra_headers: dict[str, str] | None = None,
        mail_options: list[str] | None = None,
        rcpt_options: list[str] | None = None,
        *,
        list_unsubscribe: str | Sequence[str] | bool | None = None,
    ) -> None:
        self.subject = subject
        self.recipients: list[Address] = recipients if recipients is not None else []
        self.body = body
        self.html = html
        self.alts: dict[str, str] = _alts_dict(alts)
        # Flask-Mail's ``sender or default_sender``: the app's, inside an app context.
        self._default_sender: Any = None
        options = current_options()
        if sender is None or sender == "":
            sender = self._default_sender = _sender_text(options.default_sender)
        self.sender: Address | None = _sender_text(sender)
        self.cc: list[Address] = cc if cc is not None else []
        self.bcc: list[Address] = bcc if bcc is not None else []
        self.attachments: list[Attachment] = attachments if attachments is not None else []
        self.reply_to = reply_to
        self.date = date
        self.charset = charset
        self.extra_headers = extra_headers
        self.mail_options: list[str] = mail_options if mail_options is not None else []
        self.rcpt_options: list[str] = rcpt_options if rcpt_options is not None else []
        self.list_unsubscribe = list_unsubscribe
        # Makes the multipart boundaries, so every build of this message is the same bytes.
        self._seed = secrets.token_hex(16)
        # The Date of a message without ``date``: its first build's time, then kept.
        self._built_date: datetime | None = None
        self._msg_id: str | None = None
        self._msg_id_made = False  # made here (not chosen by the user)
        self._make_msg_id(options)
        #: The template it was rendered from (``mail.template_message()``), else None.
        self.template: TemplateInfo | None = None

    @property
    def msgId(self) -> str | None:
        """The Message-ID, ``"<unique@domain>"``; see the class docstring for its domain."""
        if self._msg_id is None:
            self._make_msg_id(current_options())
        return self._msg_id

    @msgId.setter
    def msgId(self, value: str | None) -> None:
        self._msg_id, self._msg_id_made = value, False

    def _make_msg_id(self, options: ComposeOptions) -> None:
        domain = context_domain(self.sender, options)
        if domain is not None:
            self._msg_id, self._msg_id_made = new_message_id(domain), True

    def __repr__(self) -> str:
        return f"<Message {self.subject!r} to {self.recipients!r}>"

    @property
    def send_to(self) -> set[str]:
        """Every envelope address (recipients, cc and bcc), bare, as Flask-Mail's ``send_to``."""
        result: set[str] = set()
        for group in (self.recipients, self.cc, self.bcc):
            if isinstance(group, (list, tuple)):
                for addr in group:
                    bare = bare_address(addr)
                    if bare:
                        result.add(bare)
        return result

    def add_recipient(self, recipient: Address) -> None:
        """Add one address to ``recipients``."""
        if isinstance(self.recipients, tuple):
            self.recipients = list(self.recipients)
        if not isinstance(self.recipients, list):
            raise InvalidMessage(
                "recipients", f"expected a list of addresses, got {type(self.recipients).__name__}"
            )
        self.recipients.append(recipient)

    def attach(
        self,
        filename: str | None = None,
        content_type: str | None = None,
        data: bytes | str | None = None,
        disposition: str | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    ) -> None:
        """Add an attachment (Flask-Mail's signature); checked when the message is sent.

        With ``disposition="inline"`` and a ``Content-ID`` header, and an
        ``html`` body, the part goes with the html in multipart/related, as
        ``embed()`` does.
        """
        self.attachments.append(Attachment(filename, content_type, data, disposition, headers))

    def embed(
        self, filename: str | None, content_type: str | None, data: bytes | str
    ) -> str:
        """Add an inline image the html shows as ``<img src="cid:...">``; returns that cid.

        The cid has no angle brackets. The part goes with the html part in a
        multipart/related, so clients show it in place, not as an attachment
        (without ``html`` it stays an inline attachment, after the text). A
        missing ``content_type`` is guessed from ``filename``.
        """
        if content_type is None and isinstance(filename, str):
            content_type = mimetypes.guess_type(filename)[0]
        # The Message-ID's domain, when it has one; any will do, a cid is only
        # matched within its message.
        msg_id = self.msgId
        domain = "inline.invalid"
        if isinstance(msg_id, str) and "@" in msg_id and msg_id.endswith(">"):
            domain = msg_id[msg_id.rindex("@") + 1 : -1]
        cid = f"{secrets.token_hex(12)}@{domain}"
        self.attach(filename, content_type, data, "inline", {"Content-ID": f"<{cid}>"})
        return cid

    def has_bad_headers(self) -> bool:
        """True when any header name or value would carry a CR, LF or NUL (header injection)."""
        values: list[object] = [self.subject, self.sender, self.reply_to, self._msg_id,
                                self.list_unsubscribe]
        for group in (self.recipients, self.cc, self.bcc):
            if isinstance(group, (list, tuple)):
                values.extend(group)
            else:
                values.append(group)
        if isinstance(self.extra_headers, Mapping):
            for key, value in self.extra_headers.items():
                values += [key, value]
        if isinstance(self.attachments, (list, tuple)):
            for att in self.attachments:
                values += [
                    getattr(att, "filename", None),
                    getattr(att, "content_type", None),
                    getattr(att, "disposition", None),
                ]
                headers = getattr(att, "headers", None)
                if isinstance(headers, Mapping):
                    for key, value in headers.items():
                        values += [key, value]
        return any(_has_bad_chars_deep(value) for value in values)

    def as_bytes(self) -> bytes:
        """The MIME message, CRLF line endings, built exactly as ``mail.send()`` builds it.

        Inside an app context the app's ``MAIL_DEFAULT_SENDER`` and ``OUTBOX_*``
        settings apply; outside one, the message's own sender is used. Every
        call gives the same bytes: the Message-ID, the boundaries and (without
        a ``date``) the Date of the first build are kept. Raises
        ``InvalidMessage`` like ``send()``.
        """
        return prepare_message(self, **_ambient_options()).mime

    def as_string(self) -> str:
        """``as_bytes()`` as text (7-bit, or UTF-8 headers with OUTBOX_ALLOW_SMTPUTF8: lossless)."""
        return self.as_bytes().decode("utf-8")

    def __bytes__(self) -> bytes:
        return self.as_bytes()

    def __str__(self) -> str:
        return self.as_string()


@dataclass(frozen=True, slots=True)
class PreparedEmail:
    """A validated message, ready to store and send.

    ``sender`` and ``recipients`` are the SMTP envelope (bare ASCII addresses;
    ``recipients`` is to + cc + bcc without duplicates). ``mime`` is the whole
    message exactly as it will be sent, including its ``message_id``.
    """

    sender: str
    recipients: tuple[str, ...]
    subject: str
    message_id: str
    mime: bytes
    attachments: tuple[AttachmentInfo, ...]
    to_display: str
    #: Flask-Mail's ``mail_options`` / ``rcpt_options``: ESMTP parameters for
    #: MAIL FROM and for each RCPT TO (``("BODY=8BITMIME",)``, ``("NOTIFY=FAILURE",)``).
    mail_options: tuple[str, ...] = ()
    rcpt_options: tuple[str, ...] = ()


# --------------------------------------------------------------------------- #
# Validation and building
# --------------------------------------------------------------------------- #


def prepare_message(
    msg: Message,
    *,
    default_sender: Address | None,
    allow_local_addresses: bool,
    max_message_bytes: int,
    message_id_domain: str | None,
    ascii_attachments: bool,
    now: datetime | None = None,
    html_to_text: bool | None = None,
    allow_smtputf8: bool | None = None,
    unsubscribe_links: UnsubscribeLinks | None = None,
) -> PreparedEmail:
    """Validate ``msg`` and build the exact bytes to send.

    Raises ``InvalidMessage(field, problem)`` for what cannot be sent (no
    recipient or sender, a refused address, CR/LF/NUL in a header, a message
    over ``max_message_bytes``; local domains unless ``allow_local_addresses``).
    ``now`` dates a message without ``date`` at its first build (kept, like a
    new ``msgId``). ``html_to_text`` / ``allow_smtputf8``: None reads the app's.
    """
    if not isinstance(msg, Message):
        raise TypeError(f"prepare_message() expects a Message, got {type(msg).__name__}")
    _check_max_message_bytes(max_message_bytes)
    # Checked in this order, so a message with several faults always reports the same one.
    subject = _checked_subject(msg.subject)
    utf8 = app_allows_smtputf8() if allow_smtputf8 is None else allow_smtputf8
    to, cc, bcc = _recipients(msg, allow_local_addresses, utf8)
    sender = _sender(msg, default_sender, allow_local_addresses, utf8)
    reply_to = reply_to_list(msg.reply_to, allow_local_addresses, allow_smtputf8=utf8)
    check_esmtp_options("mail_options", msg.mail_options)
    check_esmtp_options("rcpt_options", msg.rcpt_options)

    codec, charset_name = resolve_charset(msg.charset)
    alternatives = text_alternatives(msg.body, msg.html, msg.alts, codec)
    date = _date(msg, now)
    extra = extra_headers(msg.extra_headers)
    message_id = resolve_message_id(msg, extra, message_id_domain, sender)
    unsubscribe = unsubscribe_lines(msg.list_unsubscribe, extra, allow_local_addresses,
                                    recipients=_envelope(to, cc, bcc),
                                    links=unsubscribe_links, message_id=message_id)
    attachments = check_attachments(msg.attachments, ascii_attachments, max_message_bytes)

    body_headers, body = _content(
        msg, alternatives, [att.part for att in attachments], codec, charset_name, html_to_text
    )
    extra_lines = [*unsubscribe, *(extra.lines if extra else ())]
    headers = top_headers(
        sender, to, cc, reply_to, subject, date, message_id, body_headers, extra_lines
    )
    mime = "\r\n".join(headers).encode("utf-8") + b"\r\n\r\n" + body
    _check_message_size(mime, max_message_bytes, bool(attachments))
    return PreparedEmail(
        sender=sender.ascii,
        recipients=_envelope(to, cc, bcc),
        subject=subject,
        message_id=message_id,
        mime=mime,
        attachments=tuple(att.info for att in attachments),
        to_display=_to_display(to, cc, extra),
        mail_options=tuple(msg.mail_options),
        rcpt_options=tuple(msg.rcpt_options),
    )


def _check_max_message_bytes(max_message_bytes: object) -> None:
    if (
        isinstance(max_message_bytes, bool)
        or not isinstance(max_message_bytes, int)
        or max_message_bytes <= 0
    ):
        raise ConfigError(
            "OUTBOX_MAX_MESSAGE_BYTES", f"must be a positive integer, got {max_message_bytes!r}"
        )


#: The longest subject ``send()`` takes (characters). Encoded, 10,000 characters of any
#: text (4-byte ones in base64 encoded words: 70 KB) stay under Postfix's
#: ``header_size_limit`` (102,400 bytes), past which a relay cuts the header; real subjects
#: are under 200. A longer one is a mistake (a body passed as the subject) or an attack.
MAX_SUBJECT_CHARS = 10_000


def _checked_subject(subject: object) -> str:
    if not isinstance(subject, str):
        raise InvalidMessage("subject", f"expected str, got {type(subject).__name__}")
    if len(subject) > MAX_SUBJECT_CHARS:
        raise InvalidMessage(
            "subject", f"is {len(subject):,} characters long; at most {MAX_SUBJECT_CHARS:,} "
            "are accepted (encoded, a longer one passes no relay whole)")
    check_header_text("subject", subject)
    return subject


def _recipients(msg: Message, allow_local: bool,
                allow_smtputf8: bool) -> tuple[list[Addr], list[Addr], list[Addr]]:
    """To, cc and bcc, checked; at least one of them must name someone."""
    to = address_list("recipients", msg.recipients, allow_local, allow_smtputf8=allow_smtputf8)
    cc = address_list("cc", msg.cc, allow_local, allow_smtputf8=allow_smtputf8)
    bcc = address_list("bcc", msg.bcc, allow_local, allow_smtputf8=allow_smtputf8)
    if not (to or cc or bcc):
        raise InvalidMessage(
            "recipients",
            "the message has no recipients; give at least one in recipients, cc or bcc",
        )
    return to, cc, bcc


def _sender(msg: Message, default_sender: Address | None, allow_local: bool,
            allow_smtputf8: bool) -> Addr:
    """The sender; one the constructor took from MAIL_DEFAULT_SENDER is checked as that setting."""
    if msg._default_sender is not None and msg.sender == msg._default_sender:
        # A fault is the setting's: say so, as when the default is filled in here.
        return resolve_sender(None, msg.sender, allow_local, allow_smtputf8=allow_smtputf8)
    return resolve_sender(msg.sender, default_sender, allow_local, allow_smtputf8=allow_smtputf8)


def _date(msg: Message, now: datetime | None) -> datetime:
    """``msg.date`` checked; without one, the time of the message's first build, kept."""
    if msg.date is not None:
        return resolve_date(msg.date, now)
    built = msg._built_date
    if built is None:
        built = msg._built_date = resolve_date(None, now)
    return built


def _content(
    msg: Message,
    alternatives: list[tuple[str, bytes]],
    attachment_parts: list[Part],
    codec: str,
    charset: str,
    html_to_text_on: bool | None,
) -> Part:
    """The message's content (see ``message_body``), with the text part html mail needs.

    Like Flask-Mail, a message with any alternative but no text/plain one
    starts its multipart/alternative with a text/plain part: the html's text
    (``OUTBOX_HTML_TO_TEXT``), else empty as Flask-Mail's. A message of
    attachments only starts with an empty text part too, as Flask-Mail's, so
    its charset is written and the first part is the body.
    """
    if not alternatives and attachment_parts:
        alternatives = [("plain", b"")]
    subtypes = [subtype.lower() for subtype, _ in alternatives]
    if alternatives and "plain" not in subtypes:
        text = ""
        if html_to_text_on is None:
            html_to_text_on = current_options().html_to_text
        if html_to_text_on and "html" in subtypes:
            text = html_to_text(alternatives[subtypes.index("html")][1].decode(codec))
        alternatives = [("plain", text.encode(codec, "replace")), *alternatives]
    return message_body(alternatives, attachment_parts, charset, msg._seed)


def _check_message_size(mime: bytes, max_message_bytes: int, attachments: bool) -> None:
    if len(mime) > max_message_bytes:
        size, limit = size_and_limit(len(mime), max_message_bytes)
        # Users compare the limit with their files' sizes: say why the message is bigger.
        growth = " (attachments grow by a third when encoded for email)" if attachments else ""
        raise InvalidMessage(
            "message size",
            f"the built message is {size}{growth}, which exceeds "
            f"OUTBOX_MAX_MESSAGE_BYTES ({limit})",
        )


def _envelope(to: list[Addr], cc: list[Addr], bcc: list[Addr]) -> tuple[str, ...]:
    """Every recipient's ASCII address once (compared case-blind), in to, cc, bcc order."""
    envelope: list[str] = []
    seen: set[str] = set()
    for addr in (*to, *cc, *bcc):
        key = addr.ascii.lower()
        if key not in seen:
            seen.add(key)
            envelope.append(addr.ascii)
    return tuple(envelope)


def _to_display(to: list[Addr], cc: list[Addr], extra: ExtraHeaders | None) -> str:
    """The To a listing shows: as written to the header, or the extra header that replaced it."""
    if extra and "to" in extra.replaced:
        return extra.replaced["to"]
    return display_list(to) if to else ("" if cc else UNDISCLOSED_RECIPIENTS)


# --------------------------------------------------------------------------- #
# Helpers of the Message class
# --------------------------------------------------------------------------- #


def _sender_text(sender: object) -> Any:
    """Flask-Mail's ``"name <address>"`` for a ``(name, address)`` sender, quoting the name when needed.

    Anything else is kept as given, for validation to report.
    """
    if not (isinstance(sender, tuple) and len(sender) == 2 and all(isinstance(p, str) for p in sender)):
        return sender
    name, address = sender
    if not name:
        return address
    if _NAME_SPECIALS.search(name) or name != name.strip():
        name = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"{name} <{address}>"


def _has_bad_chars_deep(value: object) -> bool:
    if isinstance(value, str):
        return has_bad_chars(value)
    if isinstance(value, (tuple, list)):
        return any(_has_bad_chars_deep(v) for v in value)
    return False


def _alts_dict(alts: object) -> Any:
    """Flask-Mail's ``dict(alts or {})``; what cannot be converted is kept for validation to report."""
    if alts is None:
        return {}
    try:
        return dict(alts)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return alts


# --------------------------------------------------------------------------- #
# Flask integration for as_bytes()
# --------------------------------------------------------------------------- #


def _ambient_options() -> dict[str, Any]:
    """``prepare_message`` options for ``as_bytes()``: the current app's (see :mod:`.ambient`)."""
    options = current_options()
    return {
        "default_sender": options.default_sender,
        "allow_local_addresses": options.allow_local_addresses,
        "max_message_bytes": options.max_message_bytes,
        "message_id_domain": options.message_id_domain,
        "ascii_attachments": options.ascii_attachments,
        "unsubscribe_links": options.unsubscribe_links,
    }
