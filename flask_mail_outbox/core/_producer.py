"""The producer's commit protocol: what any session-based integration calls.

A row is written in the caller's transaction and goes out only if that
transaction commits. Four calls make that so, in this order:

1. :meth:`Producer.enqueue` inserts prepared rows (:func:`._rows.prepare_row`)
   in the caller's ``session`` and returns a :class:`Ticket` per row; it does not
   commit. :meth:`Producer.cancel` is its opposite, with tickets of its own.
2. :meth:`Producer.before_commit`, the last statements inside the outermost
   transaction: a keyed email that found an earlier one of its key open hands
   the key on if that one finished meanwhile (:func:`._ordering.advance`), and
   in durable mode on PostgreSQL one NOTIFY wakes the dispatchers of every
   process (PostgreSQL delivers it only if the transaction commits).
3. :meth:`Producer.after_commit` starts the committed rows on their way
   (:meth:`._outbox.Outbox.deliver_soon`) and hands the keys of cancelled rows
   on. It never raises: the commit succeeded, and a failure here is reported
   while the rows wait, safe, for the sweep.
4. :meth:`Producer.after_rollback` (or :meth:`Producer.forget`, when the
   transaction ended without either) forgets them.

The integration keeps the tickets between those calls: the Flask one on the
session's transactions (``flask_mail_outbox._flask.staging``, which also
follows savepoints); a plain SQLAlchemy program in a variable (see the core's
docstring). What a ticket says (due now or later, urgent, notified already,
waiting on its key) stays inside it: the integration only carries it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from sqlalchemy.orm import Session

from .. import _degrade, _tracing
from ._clock import TestClock, utcnow
from ._dialect import Dialect
from ._insert import (
    cancel_emails,
    email_connection,
    email_dialect,
    insert_email,
    insert_emails,
    tables_needed,
)
from ._listen import notify_statement
from ._ordering import advance
from ._outbox import Mode, Outbox
from ._rows import QueuedRow
from ._settings import OutboxConfig

logger = logging.getLogger(__name__)


class Ticket(NamedTuple):
    """One row a transaction queued or cancelled, and what its commit owes it.

    (A named tuple: one is made per ``send()``, and a tuple is made fastest.)
    """

    email_id: int
    #: False: the row was there already (its idempotency key): the commit owes it nothing.
    created: bool = True
    #: Due at commit; False: sent with ``send_after``, timed until it is due.
    due_now: bool = True
    #: ``priority="high"``: handed over before what already waits.
    urgent: bool = False
    #: Its insert ran the NOTIFY already: the commit needs none for it.
    notified: bool = False
    #: PostgreSQL: the key of an email that found an earlier one of its key open;
    #: the commit hands the key on if that one finished meanwhile (see ``_ordering``).
    waits_on_key: str | None = None
    #: Not a new row but a cancel: nothing to deliver; after the commit (or the
    #: rollback) the key of the cancelled row, ``key``, is handed on.
    cancelled: bool = False
    key: str | None = None

    @property
    def is_new(self) -> bool:
        """A row this transaction added: its commit delivers it."""
        return self.created and not self.cancelled


class Producer:
    """The commit protocol of one :class:`~._outbox.Outbox` (see the module docstring).

    ``outbox`` is the :class:`~._outbox.Outbox`, or a function that returns it
    when first needed (the Flask integration's, made on first use and again
    after a fork; then ``config`` is its settings): a transaction that only
    queues email on SQLite asks for no outbox until its commit.
    """

    def __init__(self, outbox: Outbox | Callable[[], Outbox],
                 config: OutboxConfig | None = None) -> None:
        if isinstance(outbox, Outbox):
            self._outbox: Callable[[], Outbox] = lambda: outbox
            self.config = outbox.config if config is None else config
        elif config is None:
            raise TypeError("Producer(outbox_function) needs the config too")
        else:
            self._outbox = outbox
            self.config = config
        #: A :class:`~._clock.TestClock` the rows are stamped on (``created_at``,
        #: ``due_at``), as the outbox's, or None: the database's "now" (SQLite: utcnow).
        self.clock: TestClock | None = outbox.clock if isinstance(outbox, Outbox) else None

    # -- in the transaction ----------------------------------------------------------

    def enqueue(self, session: Session, rows: Sequence[QueuedRow]) -> list[Ticket]:
        """Insert ``rows`` (in send order) in ``session``'s transaction; a ticket each.

        Rows with a ``key`` must all share it. A row with an idempotency key
        already stored adds nothing: its ticket names the stored row, with
        ``created=False``. Many keyless rows go in one multi-row INSERT.
        """
        if not rows:
            return []
        tracer = _tracing.tracer(self.config.otel)
        if tracer is None:  # tracing off: NULL trace columns, nothing imported
            return self._enqueue(session, rows)
        spans = _tracing.producer_spans(tracer, [row.values for row in rows])
        if spans is None:  # the tracer failed (reported): untraced
            return self._enqueue(session, rows)
        try:
            tickets = self._enqueue(session, rows)
        except BaseException as exc:
            spans.end(None, exc)
            raise
        spans.end([ticket.email_id for ticket in tickets])
        return tickets

    def _enqueue(self, session: Session, rows: Sequence[QueuedRow]) -> list[Ticket]:
        dialect = email_dialect(session)
        notify = self._notifies(dialect)
        clock = utcnow
        if self.clock is not None:  # a test's: "now" is its time on every database
            dialect, clock = dialect.on_clock(), self.clock.now
        if len(rows) == 1:  # send(): the common case, and the one an idempotency key takes
            row = rows[0]
            email_id, created, waits = insert_email(session, row.values, row.attachments,
                                                    notify=notify, dialect=dialect,
                                                    recipients=row.recipients, clock=clock)
            return [Ticket(email_id, created, row.due_now, row.urgent, notify,
                           row.values.get("key") if waits else None)]
        key = rows[0].values.get("key")
        if any(row.values.get("key") != key for row in rows):
            raise ValueError("Producer.enqueue(): every row of one call must have the same key")
        if any(row.values.get("idempotency_key") for row in rows):
            inserted = [insert_email(session, row.values, row.attachments, notify=notify,
                                     dialect=dialect, recipients=row.recipients, clock=clock)
                        for row in rows]
        else:
            inserted = [(email_id, True, waits) for email_id, waits in insert_emails(
                session, [(row.values, row.attachments) for row in rows], key=key,
                notify=notify, dialect=dialect, clock=clock)]
        return [Ticket(email_id, created, row.due_now, row.urgent, notify,
                       key if waits else None)
                for (email_id, created, waits), row in zip(inserted, rows, strict=True)]

    def cancel(self, session: Session, *, email_ids: Sequence[int] = (), key: str | None = None,
               idempotency_key: str | None = None) -> tuple[list[Ticket], int]:
        """Cancel queued rows in ``session``'s transaction; ``(tickets, in_flight)``.

        See :func:`._insert.cancel_emails`: ``in_flight`` counts the rows named
        that are being sent already (not cancelled).
        """
        dialect = email_dialect(session)
        clock = utcnow
        if self.clock is not None:  # a test's: "now" is its time on every database
            dialect, clock = dialect.on_clock(), self.clock.now
        cancelled, in_flight = cancel_emails(session, email_ids=email_ids, key=key,
                                             idempotency_key=idempotency_key,
                                             scrub=self.config.scrub_sent, clock=clock,
                                             dialect=dialect)
        tickets = [Ticket(email_id=email_id, cancelled=True, key=row_key)
                   for email_id, row_key in cancelled]
        return tickets, in_flight

    def before_commit(self, session: Session, tickets: Sequence[Ticket]) -> None:
        """The last statements inside the outermost transaction that holds ``tickets``."""
        keys = {t.waits_on_key for t in tickets if t.waits_on_key is not None}
        if keys:
            advance(email_connection(session), keys)
        if any(t.is_new and not t.notified for t in tickets) \
                and self._notifies(email_dialect(session)):
            session.execute(notify_statement())

    # -- after it ended ----------------------------------------------------------------

    def after_commit(self, tickets: Sequence[Ticket]) -> None:
        """Start the committed rows on their way, hand cancelled keys on; never raises."""
        due: list[int] = []
        urgent: set[int] = set()
        scheduled: list[int] = []
        cancelled: list[Ticket] = []
        for ticket in tickets:
            if ticket.cancelled:
                cancelled.append(ticket)
            elif ticket.created:
                (due if ticket.due_now else scheduled).append(ticket.email_id)
                if ticket.urgent:
                    urgent.add(ticket.email_id)
        if cancelled:
            self._hand_on_keys(cancelled)
        if due or scheduled:
            self._deliver_soon(due, urgent=urgent, scheduled=scheduled)

    def after_store_commit(self, ids: Sequence[int]) -> None:
        """Rows the outbox's own transaction made due (dead letters put back); never raises.

        No caller's commit carried a NOTIFY for them: in durable mode on
        PostgreSQL one goes out now, so the dispatchers of every process take
        them at once rather than at their next poll; then they start here as
        after :meth:`after_commit`.
        """
        if not ids:
            return
        try:
            outbox = self._outbox()
            if self._notifies(outbox.store.dialect):
                outbox.store.notify()
        except Exception as exc:  # noqa: BLE001 - the rows are queued; a poll takes them
            _degrade.report(
                f"Could not wake the dispatchers for {len(ids)} email(s) {list(ids)[:20]} "
                "put back",
                consequence="they are queued; the dispatchers of other processes take them at "
                            "their next poll (up to OUTBOX_POLL_MAX_INTERVAL)",
                fix="check the database connection",
                exc=exc)
        self.after_commit([Ticket(email_id) for email_id in ids])

    def after_rollback(self, tickets: Sequence[Ticket]) -> None:
        """The transaction (or savepoint) holding ``tickets`` rolled back: forget them."""
        discarded, undone = self.forget(tickets)
        if discarded:
            logger.info("Rollback discarded %d staged email(s) %s; nothing was sent.",
                        len(discarded), discarded)
        if undone:
            logger.info("Rollback undid the cancel of %d email(s) %s; they stay queued.",
                        len(undone), undone)

    def forget(self, tickets: Sequence[Ticket]) -> tuple[list[int], list[int]]:
        """The transaction holding ``tickets`` ended without a commit; never raises.

        Returns the ids of the discarded sends and of the undone cancels. A
        record that found a cancelled row's key locked by that transaction
        left the key to it (see ``Leases._advance_recorded``): it is handed on now.
        """
        cancelled = [t for t in tickets if t.cancelled]
        self._hand_on_keys(cancelled)
        return [t.email_id for t in tickets if t.is_new], [t.email_id for t in cancelled]

    def _notifies(self, dialect: Dialect) -> bool:
        """Whether a commit of new rows sends the NOTIFY (durable mode, PostgreSQL, LISTEN)."""
        if not (dialect.listens and self.config.listen):
            return False
        with tables_needed():  # the mode's first read is send()'s first query on PostgreSQL
            return self._outbox().mode() is Mode.DURABLE

    def _deliver_soon(self, ids: list[int], *, urgent: set[int], scheduled: list[int]) -> None:
        try:
            self._outbox().deliver_soon(ids, urgent=urgent, scheduled=scheduled)
        except Exception as exc:  # noqa: BLE001 - the commit succeeded; never fail it now
            every = [*ids, *scheduled]
            _degrade.report(
                f"Could not hand {len(every)} committed email(s) {every[:20]} to delivery",
                consequence="they stay queued in the database; the periodic sweep takes them "
                            "after OUTBOX_SWEEP_MIN_AGE_SECONDS (those sent with send_after: "
                            "when due)",
                fix="check the database connection and the transport configuration; "
                    "`flask outbox sweep` delivers them once fixed",
                exc=exc)

    def _hand_on_keys(self, cancelled: list[Ticket]) -> None:
        """Hand each cancelled row's key to its next email, and start that one."""
        keys = {t.key for t in cancelled if t.key is not None}
        if not keys:
            return
        try:
            holders = self._outbox().store.advance_keys(keys)
        except Exception as exc:  # noqa: BLE001 - the cancel committed; the sweep heals keys
            _degrade.report(
                f"Could not hand on the keys {sorted(keys)[:20]} of {len(cancelled)} "
                "cancelled email(s)",
                consequence="the next email of each such key waits until a sweep's key "
                            "repair hands its key on (inline mode: every tenth periodic "
                            "sweep; durable mode: the next start-up sweep)",
                fix="check the database connection; `flask outbox sweep` repairs keys now",
                exc=exc)
            return
        if holders:
            self._deliver_soon(holders, urgent=set(), scheduled=[])
