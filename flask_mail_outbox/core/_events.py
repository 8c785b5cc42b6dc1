"""The event log: delivery events stored, matched to their emails, acted on.

:meth:`EventLog.record` writes a batch of :class:`~flask_mail_outbox.DeliveryEvent`
values in ONE transaction: signature nonces first (a token seen before
refuses the whole batch), then each event's email found by the provider's
message id (among the emails of the event's transport) or the Message-ID, then the events themselves (a provider's resend
of one already stored is ignored, by the unique ``(transport,
provider_event_id)``), then what the suppression policy
(:mod:`flask_mail_outbox._policy`) concludes for each new one's recipient,
stored on the event and applied to the list: for good (a bounce for a reason
that says the address is dead, a complaint, an unsubscribe), until a time
(the address's soft bounces reached the limit within the window), or not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .. import _degrade, _tracing
from .._events import DeliveryEvent
from .._policy import POLICY_EVENTS, SoftBounceRule, conclude, is_soft_bounce
from ._models import (
    SEARCH_RECIPIENT_LENGTH,
    email_table,
    event_table,
    nonce_table,
    search_key,
)
from ._suppression import Suppressions, loose_key

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ._store import Store

#: Ids per ``IN`` list.
_CHUNK = 500

#: How long an accepted nonce is kept: longer than any signed timestamp is accepted.
NONCE_KEEP_SECONDS = 3600.0


class Replayed(Exception):
    """A webhook nonce (a signature token) was accepted before: the request is a replay."""


@dataclasses.dataclass(frozen=True)
class RecordedEvents:
    """What :meth:`EventLog.record` wrote.

    ``new``: the events stored, with their ``id`` and ``email_id``;
    ``duplicates``: how many were already stored (resends, ignored);
    ``unmatched``: how many of the new ones name no known email;
    ``suppressed``: the addresses the new events put on the list, with the reason
    (an entry that applies to all mail is not narrowed to ``unsubscribed``; a
    bounded one, for soft bounces, is ``bounced`` too).
    """

    new: tuple[DeliveryEvent, ...] = ()
    duplicates: int = 0
    unmatched: int = 0
    suppressed: tuple[tuple[str, str], ...] = ()


class EventLog:
    """Delivery events in one database."""

    def __init__(self, store: Store, suppressions: Suppressions, *,
                 soft_bounces: SoftBounceRule | None = None) -> None:
        self.store = store
        self.suppressions = suppressions
        #: OUTBOX_SOFT_BOUNCE_*: when repeated soft bounces suppress an address.
        self.soft_bounces = soft_bounces or SoftBounceRule()
        #: OUTBOX_OTEL (its Delivery sets the app's): a span per event matched to an email.
        self.otel = _tracing.TracingSettings()

    def record(self, events: Sequence[DeliveryEvent], *, nonces: Sequence[str] = (),
               nonce_transport: str = "", source: str | None = None,
               unauthenticated: bool = False) -> RecordedEvents:
        """Store ``events`` (and ``nonces``) in one transaction; see the module docstring.

        ``source`` is what the suppressions they cause say put them there
        (the event's transport and type by default). ``unauthenticated``:
        the events come from mail anyone can send (a bounce, a complaint
        report), which names an email by a VERP token or a Message-ID that
        every recipient of that email has seen. Such an event suppresses
        only the one recipient of a one-recipient email (filled in when the
        report names nobody); the others are stored, and suppress nothing:
        their verdict is what the policy would have concluded, and their soft
        bounces are not counted. Raises :class:`Replayed` when a nonce was seen before; nothing is
        written then.
        """
        with self.store.write() as tx:
            recorded = self.record_on(tx, events, nonces=nonces,
                                      nonce_transport=nonce_transport, source=source,
                                      unauthenticated=unauthenticated)
        if recorded.new and self.otel.enabled is not False:
            self._trace(recorded.new)
        return recorded

    def _trace(self, new: Sequence[DeliveryEvent]) -> None:
        """A span per stored event matched to an email, in the current (the request's)
        trace, linked to the email's PRODUCER span (flask_mail_outbox/_tracing.py).
        Never raises: the events are stored."""
        ids = sorted({event.email_id for event in new if event.email_id is not None})
        tracer = _tracing.tracer(self.otel) if ids else None
        if tracer is None:
            return
        try:
            t = email_table
            with self.store.read() as conn:
                contexts = {row.id: (row.traceparent, row.tracestate) for row in conn.execute(
                    sa.select(t.c.id, t.c.traceparent, t.c.tracestate).where(t.c.id.in_(ids)))}
            _tracing.event_spans(tracer, [event for event in new if event.email_id is not None],
                                 contexts)
        except Exception as exc:  # noqa: BLE001 - reported; the events are stored
            _degrade.report(
                f"Could not trace {len(new)} delivery event(s) of emails "
                f"{', '.join(map(str, ids[:10]))}",
                consequence="their spans are missing from the trace; the events are stored "
                            "and acted on as usual",
                fix="check the database connection and the app's OpenTelemetry span "
                    "processors (the traceback below names the failing one)",
                exc=exc)

    def record_on(self, tx: Connection, events: Sequence[DeliveryEvent], *,
                  nonces: Sequence[str] = (), nonce_transport: str = "",
                  source: str | None = None,
                  unauthenticated: bool = False) -> RecordedEvents:
        """:meth:`record` on a transaction the caller holds (and commits)."""
        if nonces:
            self._take_nonces(tx, nonce_transport, nonces)
        if not events:
            return RecordedEvents()
        matched = self._match(tx, events)
        trusted: set[tuple[int | None, str]] | None = None
        if unauthenticated:
            matched, trusted = self._sole_recipients(tx, matched)
        new, duplicates = self._insert(tx, matched)
        new = self._conclude(tx, new, trusted)
        entries, bounded = [], []
        for event in new:
            if not event.applied or event.recipient is None:
                continue
            entry = (loose_key(event.recipient), "bounced" if event.verdict == "until"
                     else event.suppresses or "", source or f"{event.transport} {event.event_type}")
            if event.verdict == "permanent":
                entries.append(entry)
            elif event.verdict == "until" and event.suppressed_until is not None:
                bounded.append((*entry, event.suppressed_until))
        self.suppressions.put(tx, entries)
        self.suppressions.put_until(tx, bounded)
        return RecordedEvents(new=tuple(new), duplicates=duplicates,
                              unmatched=sum(e.email_id is None for e in new),
                              suppressed=(*((key, reason) for key, reason, _ in entries),
                                          *((key, reason) for key, reason, _, _ in bounded)))

    def _conclude(self, conn: Connection, events: list[DeliveryEvent],
                  trusted: set[tuple[int | None, str]] | None) -> list[DeliveryEvent]:
        """``events`` (stored just now) with the policy's verdict, written to their rows.

        An event is *applied* when it may act on the list: every event of an
        authenticated source, and an unauthenticated one only for the sole
        recipient of its email (``trusted``). A soft bounce counts toward the
        bounded suppression only when applied: anyone can send a bounce naming
        an address, and counted forgeries would suppress it as surely as real
        ones. An unapplied event still gets the verdict the policy would have
        concluded, counting the address's applied soft bounces and itself.
        """
        rule = self.soft_bounces
        now = self.store.clock()
        since = now - timedelta(seconds=rule.window_seconds) if rule.enabled else now
        # Keys only for the types the policy decides on; counts only for soft bounces.
        keys = [loose_key(e.recipient) if e.recipient is not None
                and e.event_type in POLICY_EVENTS else None for e in events]
        soft_keys = {key for key, e in zip(keys, events, strict=True) if key is not None
                     and is_soft_bounce(e.event_type, e.bounce_kind, e.reason)}
        counted = (self._soft_bounce_counts(conn, soft_keys, since)
                   if rule.enabled and soft_keys else {})
        concluded, updates = [], []
        for event, key in zip(events, keys, strict=True):
            verdict, applied = None, False
            if key is not None:
                applied = trusted is None or (event.email_id, key) in trusted
                soft = (is_soft_bounce(event.event_type, event.bounce_kind, event.reason)
                        and event.occurred_at is not None and event.occurred_at > since)
                if soft and applied:
                    counted[key] = counted.get(key, 0) + 1
                verdict = conclude(event.event_type, event.bounce_kind, event.reason,
                                   soft_bounces=counted.get(key, 0) + int(soft and not applied),
                                   rule=rule, now=now)
            if verdict is None:  # whatever a caller's event said, none is stored
                concluded.append(dataclasses.replace(event, verdict=None, suppressed_until=None,
                                                     applied=False))
                continue
            event = dataclasses.replace(event, verdict=verdict.verdict,
                                        suppressed_until=verdict.until, applied=applied)
            concluded.append(event)
            updates.append({"_id": event.id, "_verdict": event.verdict,
                            "_until": event.suppressed_until,
                            "_key": key if applied else None})
        if updates:
            t = event_table
            conn.execute(t.update().where(t.c.id == sa.bindparam("_id")).values(
                verdict=sa.bindparam("_verdict"), suppressed_until=sa.bindparam("_until"),
                applied_to=sa.bindparam("_key")), updates)
        return concluded

    @staticmethod
    def _soft_bounce_counts(conn: Connection, keys: Iterable[str],
                            since: datetime) -> dict[str, int]:
        """How many applied soft bounces each address in ``keys`` has since ``since``."""
        t = event_table
        wanted = sorted(keys)
        counts: dict[str, int] = {}
        for start in range(0, len(wanted), _CHUNK):
            rows = conn.execute(
                sa.select(t.c.applied_to, sa.func.count())
                .where(t.c.applied_to.in_(wanted[start:start + _CHUNK]),
                       t.c.event_type == "bounced", t.c.verdict != "permanent",
                       t.c.occurred_at > since)
                .group_by(t.c.applied_to)).all()
            counts.update((key, int(number)) for key, number in rows)
        return counts

    def _take_nonces(self, conn: Connection, transport: str, nonces: Sequence[str]) -> None:
        t = nonce_table
        now = self.store.clock()
        conn.execute(t.delete().where(t.c.seen_at < self.store.later_expr(-NONCE_KEEP_SECONDS)))
        taken = conn.execute(
            self.store.dialect.insert(t).on_conflict_do_nothing().returning(t.c.nonce),
            [{"transport": transport, "nonce": nonce[:255], "seen_at": now}
             for nonce in dict.fromkeys(nonces)]).all()
        if len(taken) < len(set(nonces)):
            raise Replayed(f"a signature token for {transport!r} was used before")

    def _match(self, conn: Connection, events: Sequence[DeliveryEvent]) -> list[DeliveryEvent]:
        """``events`` with ``email_id`` filled where their provider id or Message-ID is known.

        A provider's message id is matched only among the emails its event's
        transport sent (the row's transport, or one it failed over to): ids are
        the provider's own, and two providers (or two accounts) may use the
        same one; a webhook of one must not reach the emails of another.
        """
        t = email_table
        by_provider = self._by_provider(conn, {e.provider_message_id for e in events
                                               if e.email_id is None and e.provider_message_id})
        by_message = self._ids(conn, t.c.message_id,
                               {_bracketed(e.message_id) for e in events
                                if e.email_id is None and e.provider_message_id is None
                                and e.message_id})
        matched = []
        for event in events:
            if event.email_id is None:
                found = (by_provider.get((event.transport, event.provider_message_id or ""))
                         or by_message.get(_bracketed(event.message_id or "")))
                if found is not None:
                    event = dataclasses.replace(event, email_id=found)
            matched.append(event)
        return matched

    @staticmethod
    def _by_provider(conn: Connection, values: Iterable[str]) -> dict[tuple[str, str], int]:
        """(transport that sent it, provider message id) -> email id, for ``values``."""
        t = email_table
        wanted = sorted(values)
        found: dict[tuple[str, str], int] = {}
        for start in range(0, len(wanted), _CHUNK):
            rows = conn.execute(
                sa.select(t.c.provider_message_id, t.c.id, t.c.transport, t.c.error_history)
                .where(t.c.provider_message_id.in_(wanted[start:start + _CHUNK]))
                .order_by(t.c.id)).all()
            for value, email_id, transport, history in rows:
                for sender in (transport, *_failed_over_to(history)):
                    found.setdefault((sender, value), email_id)
        return found

    @staticmethod
    def _sole_recipients(conn: Connection, events: list[DeliveryEvent]
                         ) -> tuple[list[DeliveryEvent], set[tuple[int | None, str]]]:
        """Unauthenticated events, and the (email, recipient) pairs they may suppress.

        Only an email's one recipient may be suppressed by them: with several,
        any of them could forge a report naming another. An event that names
        such an email but no recipient gets its one recipient.
        """
        ids = sorted({e.email_id for e in events if e.email_id is not None})
        sole: dict[int, str] = {}
        for start in range(0, len(ids), _CHUNK):
            rows = conn.execute(sa.select(email_table.c.id, email_table.c.recipients)
                                .where(email_table.c.id.in_(ids[start:start + _CHUNK]))).all()
            for email_id, recipients in rows:
                addresses = json.loads(recipients)
                if len(addresses) == 1:
                    sole[email_id] = addresses[0]
        filled = [dataclasses.replace(e, recipient=sole[e.email_id])
                  if e.recipient is None and e.email_id in sole else e for e in events]
        return filled, {(email_id, loose_key(address)) for email_id, address in sole.items()}

    @staticmethod
    def _ids(conn: Connection, column: Any, values: Iterable[str]) -> dict[str, int]:
        wanted = sorted(values)
        found: dict[str, int] = {}
        for start in range(0, len(wanted), _CHUNK):
            rows = conn.execute(sa.select(column, email_table.c.id)
                                .where(column.in_(wanted[start:start + _CHUNK]))).all()
            for value, email_id in rows:
                found.setdefault(value, email_id)
        return found

    def _insert(self, conn: Connection,
                events: list[DeliveryEvent]) -> tuple[list[DeliveryEvent], int]:
        """Insert the events not stored yet; returns them (with ids) and how many were not.

        ``ON CONFLICT DO NOTHING`` skips an event stored before, or twice in this
        batch; ``RETURNING`` in parameter order says which rows went in.
        """
        t = event_table
        rows = []
        # In key order: two requests inserting the same events in different orders
        # (a provider's retry racing the original) would otherwise deadlock on
        # PostgreSQL's unique index.
        kept = sorted(events, key=lambda e: (e.transport, e.provider_event_id or ""))
        received = self.store.clock()
        for index, event in enumerate(kept):
            if event.occurred_at is None:
                event = kept[index] = dataclasses.replace(event, occurred_at=received)
            rows.append({
                "email_id": event.email_id, "transport": event.transport,
                "provider_event_id": event.provider_event_id, "event_type": event.event_type,
                "bounce_kind": event.bounce_kind, "reason": event.reason, "recipient": event.recipient,
                "occurred_at": event.occurred_at, "received_at": received,
                "description": event.description, "mta_response": event.mta_response,
                "payload": event.payload})
        inserted = conn.execute(
            self.store.dialect.insert(t).on_conflict_do_nothing()
            .returning(t.c.id, t.c.transport, t.c.provider_event_id, t.c.occurred_at,
                       sort_by_parameter_order=True),
            rows).all() if rows else []
        new = []
        position = 0
        for event, row in zip(kept, rows, strict=True):
            if position < len(inserted) and _same(inserted[position], row):
                new.append(dataclasses.replace(event, id=inserted[position].id))
                position += 1
        return new, len(events) - len(new)

    def email_sent_to(self, address: str, message_id: str) -> tuple[int, str] | None:
        """(id, transport) of the newest email with ``message_id`` whose first recipient is
        ``address``, or None. (By the indexed first-recipient column: a one-click link's
        email has one recipient.)"""
        t = email_table
        with self.store.read() as conn:
            row = conn.execute(
                sa.select(t.c.id, t.c.transport)
                .where(t.c.search_recipient == search_key(address, SEARCH_RECIPIENT_LENGTH),
                       t.c.message_id == message_id)
                .order_by(t.c.id.desc()).limit(1)).first()
        return (int(row.id), str(row.transport)) if row is not None else None

    def for_email(self, email_id: int) -> list[DeliveryEvent]:
        """Every event of one email, oldest first."""
        t = event_table
        with self.store.read() as conn:
            rows = conn.execute(sa.select(t).where(t.c.email_id == email_id)
                                .order_by(t.c.occurred_at, t.c.id)).all()
        return [event_of(row._mapping) for row in rows]


def _failed_over_to(history: str | None) -> list[str]:
    """The transports an email's ``error_history`` says it failed over to."""
    if not history or "failed_over_to" not in history:
        return []
    try:
        entries = json.loads(history)
    except ValueError:
        return []
    return [entry["failed_over_to"] for entry in entries if isinstance(entry, dict)
            and isinstance(entry.get("failed_over_to"), str)] if isinstance(entries, list) else []


def _bracketed(message_id: str) -> str:
    """A Message-ID as ``outbox_email.message_id`` holds it: ``<id@domain>``."""
    return f"<{message_id.strip().strip('<>')}>"


def _same(inserted: Any, row: dict[str, Any]) -> bool:
    return bool(inserted.transport == row["transport"]
                and inserted.provider_event_id == row["provider_event_id"])


def event_of(row: Any) -> DeliveryEvent:
    """A stored event row as a :class:`DeliveryEvent`."""
    return DeliveryEvent(
        id=row["id"], email_id=row["email_id"], transport=row["transport"],
        provider_event_id=row["provider_event_id"], event_type=row["event_type"],
        bounce_kind=row["bounce_kind"], reason=row["reason"], recipient=row["recipient"],
        occurred_at=row["occurred_at"], description=row["description"],
        mta_response=row["mta_response"], payload=row["payload"], verdict=row["verdict"],
        suppressed_until=row["suppressed_until"], applied=row["applied_to"] is not None)
