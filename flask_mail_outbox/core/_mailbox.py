"""The development inbox's table: what the ``mailbox`` transport delivered.

The transport (:class:`~flask_mail_outbox.transports.MailboxTransport`) sits
below the core and knows no schema: it accepts each message and holds its
envelope. :class:`Keeper`, called by the delivery's record step, writes each
held envelope of an email recorded ``sent`` into ``outbox_mailbox`` on the
same transaction, so a message is in the mailbox exactly when the outbox
says it was delivered (a record that fails and is retried writes it once;
an outcome lost with its lease writes nothing, and the next delivery does).
:class:`Mailbox` reads it (newest first, one message) and clears it.
"""

from __future__ import annotations

import dataclasses
import email.policy
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from email.parser import BytesHeaderParser
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .. import _degrade
from .._outside import clean_line
from ..transports import FailoverTransport, MailboxTransport, Transport
from ._models import Status, mailbox_table

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ._database import Database
    from ._leases import Outcome

#: The most characters of a copied From, To or Subject header (the MIME keeps it whole).
HEADER_CHARS = 998


def mailboxes(transports: Mapping[str, Transport]) -> list[MailboxTransport]:
    """The mailbox transports among ``transports``, those inside failover chains included."""
    found: list[MailboxTransport] = []
    for transport in transports.values():
        members = ([t for _, t in transport.chain] if isinstance(transport, FailoverTransport)
                   else [transport])
        found += [t for t in members if isinstance(t, MailboxTransport) and
                  all(t is not seen for seen in found)]
    return found


class Keeper:
    """Writes what the mailbox transports delivered, with the outcomes that record it."""

    def __init__(self, transports: Mapping[str, Transport], database: Database) -> None:
        self.boxes = mailboxes(transports)
        self.database = database

    def keep_on(self, tx: Connection, recorded: Sequence[Outcome]) -> None:
        """Insert the envelope of each ``sent`` outcome a mailbox transport delivered."""
        if not self.boxes:
            return
        rows = []
        for outcome in recorded:
            if outcome.status is not Status.SENT:
                continue
            for box in self.boxes:
                envelope = box.held(outcome.email.id)
                if envelope is not None:
                    rows.append(row_for(envelope.email_id, envelope.message_id, envelope.sender,
                                        envelope.recipients, envelope.mime,
                                        self.database.clock()))
                    break
        if rows:
            self._insert(tx, rows)

    def _insert(self, tx: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` in a savepoint: a mailbox the database refuses (its table
        missing) must not keep the outcomes from being recorded.

        Were the outcomes' transaction to fail, the emails would stay ``sending``
        and be delivered again when their leases expire, and again: the mailbox
        is a copy for a person to read, the outcome is the outbox's record. A
        connection that is gone fails the savepoint's rollback too, and that
        goes up to the record's own retries, as any outage.
        """
        tx.exec_driver_sql("SAVEPOINT outbox_mailbox")
        try:
            tx.execute(mailbox_table.insert(), rows)
        except sa.exc.DBAPIError as exc:
            tx.exec_driver_sql("ROLLBACK TO SAVEPOINT outbox_mailbox")
            _degrade.report(
                f"Could not keep {len(rows)} delivered message(s) "
                f"{[row['email_id'] for row in rows][:20]} in the mailbox (outbox_mailbox)",
                consequence="the emails are recorded sent, but the dashboard's Mailbox page "
                            "does not show them",
                fix="create the outbox's tables (`flask db upgrade outbox@head`, or "
                    "mail.create_all() without migrations); a database made from a "
                    "pre-release checkout lacks outbox_mailbox: recreate it",
                exc=exc)
            return
        tx.exec_driver_sql("RELEASE SAVEPOINT outbox_mailbox")

    def forget(self, email_ids: Iterable[int]) -> None:
        """Drop what the transports hold for ``email_ids`` (recorded, or lost)."""
        ids = list(email_ids)
        for box in self.boxes:
            box.forget(ids)


def row_for(email_id: int, message_id: str, sender: str, recipients: Sequence[str],
            mime: bytes, now: datetime) -> dict[str, Any]:
    """The ``outbox_mailbox`` row of one delivered message."""
    headers = _headers(mime)
    return {"email_id": email_id, "received_at": now,
            "message_id": clean_line(message_id, 255), "sender": clean_line(sender, 320),
            "recipients": json.dumps([clean_line(r, 320) for r in recipients]),
            "header_from": headers.get("from", ""), "header_to": headers.get("to", ""),
            "subject": headers.get("subject", ""), "size": len(mime), "mime": mime}


def _headers(mime: bytes) -> dict[str, str]:
    """From, To and Subject decoded for the list; "" for one that is missing or unreadable."""
    found: dict[str, str] = {}
    try:
        message = BytesHeaderParser(policy=email.policy.default).parsebytes(mime)
        for name, raw in message.raw_items():
            key = name.lower()
            if key in ("from", "to", "subject") and key not in found:
                value = raw if len(raw) > 4 * HEADER_CHARS else \
                    str(email.policy.default.header_fetch_parse(name, raw))
                found[key] = clean_line(value, HEADER_CHARS)
    except Exception:  # noqa: BLE001 - a header that does not parse is shown blank
        return found
    return found


@dataclasses.dataclass(frozen=True)
class MailboxEntry:
    """One message of the mailbox; ``mime`` only when read one by one."""

    id: int
    email_id: int
    received_at: datetime
    message_id: str
    sender: str
    recipients: list[str]
    header_from: str
    header_to: str
    subject: str
    size: int
    mime: bytes | None = None


@dataclasses.dataclass(frozen=True)
class MailboxPage:
    """Newest first; ``next_before`` is the cursor of the next (older) page, None at the end."""

    entries: list[MailboxEntry]
    next_before: int | None


_LIST_COLUMNS = [c for c in mailbox_table.c if c.name != "mime"]


class Mailbox:
    """Reads and clears ``outbox_mailbox`` on the outbox's own engine."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def page(self, *, limit: int = 50, before: int | None = None) -> MailboxPage:
        """Up to ``limit`` messages older than id ``before`` (or the newest), newest first.

        One scan of the primary key from ``before`` down (keyset, no count, no
        ``OFFSET``), as the dashboard's other lists.
        """
        query = sa.select(*_LIST_COLUMNS).order_by(mailbox_table.c.id.desc()).limit(limit + 1)
        if before is not None:
            query = query.where(mailbox_table.c.id < before)
        with self.database.read() as conn:
            rows = conn.execute(query).all()
        entries = [_entry(row) for row in rows[:limit]]
        more = len(rows) > limit
        return MailboxPage(entries, entries[-1].id if more else None)

    def get(self, entry_id: int) -> MailboxEntry | None:
        """One message with its MIME, or None."""
        with self.database.read() as conn:
            row = conn.execute(mailbox_table.select()
                               .where(mailbox_table.c.id == entry_id)).first()
        return None if row is None else _entry(row, mime=bytes(row.mime))

    def clear(self) -> int:
        """Delete every message; how many there were."""
        with self.database.write() as tx:
            return int(tx.execute(mailbox_table.delete()).rowcount)


def _entry(row: Any, *, mime: bytes | None = None) -> MailboxEntry:
    return MailboxEntry(
        id=int(row.id), email_id=int(row.email_id), received_at=row.received_at,
        message_id=row.message_id, sender=row.sender,
        recipients=[str(r) for r in json.loads(row.recipients)],
        header_from=row.header_from, header_to=row.header_to, subject=row.subject,
        size=int(row.size), mime=mime)
