"""A validated message as the row ``send()`` writes: checked, built, not written yet.

:func:`prepare_row` turns a :class:`~flask_mail_outbox.Message` and the
settings into a :class:`QueuedRow` (its column values and attachments'
metadata), raising :class:`~flask_mail_outbox.InvalidMessage` naming the field
on bad input. The checks of ``send()``'s other arguments are here too. Writing
the row is :meth:`._producer.Producer.enqueue`'s.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from .._compose.message import Message, prepare_message
from .._errors import InvalidMessage
from ._claim import SCHEDULED
from ._clock import utcnow
from ._models import DEFAULT_PRIORITY, PRIORITIES, Status
from ._settings import DEFAULT_TRANSPORT, OutboxConfig

_MAX_KEY_LENGTH = 255


@dataclasses.dataclass(frozen=True)
class QueuedRow:
    """A validated message as the row ``send()`` writes (not written yet)."""

    values: dict[str, Any]
    attachments: list[dict[str, Any]]
    recipients: tuple[str, ...]
    due_now: bool
    #: priority="high": an inline worker hands it over before what waits.
    urgent: bool = False


def prepare_row(msg: Message, config: OutboxConfig, *, key: str | None,
                due_at: datetime | None, idempotency_key: str | None = None,
                priority: int = DEFAULT_PRIORITY,
                transport: str = DEFAULT_TRANSPORT,
                expires_at: datetime | None = None,
                now: datetime | None = None) -> QueuedRow:
    """Validate ``msg`` and build its row (nothing written): ``InvalidMessage`` if bad.

    A message without a ``date`` is dated when it becomes due: at ``due_at``
    when that is still ahead (a reminder three days out must not arrive dated
    three days back), else now. The row of one that is not due yet is marked
    :data:`._claim.SCHEDULED`: no commit hands it to a delivery, so the
    sweep's age gate does not hold it back once it is due. ``now``: the
    outbox's clock when it is not the real one (a test clock's time).
    """
    check_message(msg)
    due_now = due_at is None or due_at <= (utcnow() if now is None else now)
    prepared = prepare_message(
        msg, now=None if due_now else due_at, default_sender=config.default_sender,
        allow_local_addresses=config.allow_local_addresses,
        max_message_bytes=config.max_message_bytes,
        message_id_domain=config.message_id_domain,
        ascii_attachments=config.ascii_attachments,
        html_to_text=config.html_to_text, allow_smtputf8=config.allow_smtputf8,
        unsubscribe_links=config.unsubscribe_links)
    _check_for_transports(prepared.mime, prepared.recipients, config, transport,
                          esmtp=bool(prepared.mail_options or prepared.rcpt_options))
    values: dict[str, Any] = {
        "status": Status.QUEUED.value,
        "due_at": due_at,
        # When it was first due, if not at once: the queue lifetime counts from it.
        "scheduled_for": None if due_now else due_at,
        "message_id": prepared.message_id,
        "key": key,
        "idempotency_key": idempotency_key,
        "attempts": 0,
        "sender": prepared.sender,
        "recipients": json.dumps(list(prepared.recipients)),
        "subject": prepared.subject,
        "size": len(prepared.mime),
        "mime": prepared.mime,
        "smtp_options": _smtp_options(prepared.mail_options, prepared.rcpt_options),
        "priority": priority,
        "transport": transport,
        # Every row carries the column, so the rows of a send_many() insert together.
        "lease_owner": None if due_now else SCHEDULED,
        "template_name": None,
        "template_locale": None,
        "template_hash": None,
    }
    if msg.template is not None:
        values["template_name"] = msg.template.name
        values["template_locale"] = msg.template.locale
        values["template_hash"] = msg.template.source_hash
    if expires_at is not None:
        values["expires_at"] = expires_at
    attachments = [
        {"position": index, "filename": info.filename, "content_type": info.content_type,
         "size": info.size}
        for index, info in enumerate(prepared.attachments)
    ]
    return QueuedRow(values, attachments, prepared.recipients, due_now=due_now,
                     urgent=priority < DEFAULT_PRIORITY)


def _check_for_transports(mime: bytes, recipients: tuple[str, ...], config: OutboxConfig,
                          transport: str, *, esmtp: bool) -> None:
    """The row's transport, and those it fails over to, must all take the message.

    ``esmtp``: it carries ESMTP parameters (``mail_options`` / ``rcpt_options``),
    which only an SMTP conversation has; an API would drop them without a word.
    """
    try:
        spec = config.transport_spec(transport)
    except KeyError:
        return  # the caller checked the name; a hand-made config may lack specs
    for name in (spec.name, *spec.failover):
        cls = config.transport_spec(name).cls
        if esmtp and not cls.takes_esmtp_options:
            raise InvalidMessage("mail_options", f"ESMTP parameters (mail_options, "
                                 f"rcpt_options) only go over SMTP, and the {name!r} "
                                 f"transport is {config.transport_spec(name).kind}'s API")
        cls.check_message(mime, recipients)


def check_message(msg: Any) -> None:
    """``msg`` is a :class:`Message`; :class:`InvalidMessage` naming ``msg`` otherwise."""
    if not isinstance(msg, Message):
        kind = f"{type(msg).__module__}.{type(msg).__qualname__}"
        hint = ("; import Message from flask_mail_outbox instead of flask_mail"
                if kind == "flask_mail.Message" else "")
        raise InvalidMessage("msg", f"expected a flask_mail_outbox.Message, got {kind}{hint}")


def priority_rank(value: Any) -> int:
    """The stored rank of ``send(priority=...)``; :class:`InvalidMessage` if not a known one."""
    rank = PRIORITIES.get(value) if isinstance(value, str) else None
    if rank is None:
        raise InvalidMessage("priority", f"expected one of {', '.join(map(repr, PRIORITIES))}, "
                                         f"got {value!r}")
    return rank


def transport_name(value: Any, config: OutboxConfig) -> str:
    """``send(transport=...)``: a configured name; :class:`InvalidMessage` otherwise."""
    if value is None:
        return DEFAULT_TRANSPORT
    if not isinstance(value, str) or value not in config.transport_names:
        raise InvalidMessage("transport", f"expected one of the transports configured in "
                             f"OUTBOX_TRANSPORTS ({', '.join(config.transport_names)}), "
                             f"got {value!r}")
    return value


def check_key(field: str, value: Any) -> None:
    """``key`` / ``idempotency_key``: None or a short printable string."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise InvalidMessage(field, f"expected a non-empty string, got {value!r}")
    if len(value) > _MAX_KEY_LENGTH:
        raise InvalidMessage(field, f"longer than {_MAX_KEY_LENGTH} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidMessage(field, "contains control characters")


def _smtp_options(mail_options: tuple[str, ...], rcpt_options: tuple[str, ...]) -> str | None:
    """The ``smtp_options`` column: NULL for the usual email without any."""
    if not mail_options and not rcpt_options:
        return None
    return json.dumps({"mail": list(mail_options), "rcpt": list(rcpt_options)})


def expires_at_of(expires_after: Any, due_at: datetime | None, *,
                  now: datetime | None = None) -> datetime | None:
    """``expires_after`` as a naive UTC time (None: never); ``InvalidMessage`` when it cannot be.

    A timedelta counts from now (``now``, else the real clock's). An expiry
    that is not after the due time (``send_after``) could never be met, and is
    refused.
    """
    if expires_after is None:
        return None
    if now is None:
        now = utcnow()
    if isinstance(expires_after, timedelta):
        if expires_after <= timedelta(0):
            raise InvalidMessage("expires_after", f"must be positive, got {expires_after!r}")
        try:
            expires_at = now + expires_after
        except OverflowError:
            raise InvalidMessage("expires_after",
                                 f"{expires_after!r} is past the year 9999") from None
    elif isinstance(expires_after, datetime):
        expires_at = (expires_after.astimezone(UTC).replace(tzinfo=None)
                      if expires_after.tzinfo is not None else expires_after)
    else:
        raise InvalidMessage("expires_after", f"expected a datetime or timedelta, got "
                             f"{type(expires_after).__name__}")
    earliest = due_at or now
    if expires_at <= earliest:
        what = "send_after" if due_at is not None else "now"
        raise InvalidMessage("expires_after", f"expires at {expires_at:%Y-%m-%d %H:%M:%S} UTC, "
                             f"not after {what} ({earliest:%Y-%m-%d %H:%M:%S} UTC): it could "
                             "never be sent")
    return expires_at


def due_at_of(send_after: Any, *, now: datetime | None = None) -> datetime | None:
    """``send_after`` as a naive UTC due time (None: due at commit); a timedelta
    counts from ``now`` (else the real clock's)."""
    if send_after is None:
        return None
    if isinstance(send_after, timedelta):
        try:
            return (utcnow() if now is None else now) + send_after
        except OverflowError:
            raise InvalidMessage("send_after", f"{send_after!r} is past the year 9999") from None
    if isinstance(send_after, datetime):
        if send_after.tzinfo is not None:
            return send_after.astimezone(UTC).replace(tzinfo=None)
        return send_after
    raise InvalidMessage("send_after",
                         f"expected a datetime or timedelta, got {type(send_after).__name__}")
