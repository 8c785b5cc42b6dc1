"""The delivery core: the outbox without Flask.

Everything between a committed row and its recorded outcome lives here: the
settings read from a mapping of ``MAIL_*`` / ``OUTBOX_*`` keys (:func:`load_config`), the
tables, the store (every write transaction), the claim, the per-key order,
the retry policy, shared rate limits, the worker and its lanes, recording
outcomes, LISTEN, the sweep. It imports no Flask and no Flask-SQLAlchemy.
:class:`Outbox` is built from plain values (a database URL,
:class:`OutboxConfig`, transports, :class:`Callbacks`); the Flask integration
owns one per process and app, and anything else may too. A row goes out
only if the transaction that wrote it commits: a :class:`Producer` is that
protocol (enqueue in the caller's session, ``before_commit`` inside it,
``after_commit`` or ``after_rollback`` after it); the Flask integration calls
it from the session's events, a plain SQLAlchemy program by hand::

    outbox = Outbox("postgresql+psycopg://...", config, callbacks=Callbacks(sent=...))
    metadata.create_all(outbox.engine)
    producer = Producer(outbox)
    row = prepare_row(Message(...), config, key="order-7", due_at=None)
    with Session(outbox.engine) as session:
        with session.begin():
            tickets = producer.enqueue(session, [row])   # with the app's own writes
            producer.before_commit(session, tickets)     # per-key hand-on, NOTIFY
        producer.after_commit(tickets)                   # delivery starts

(The complete program, tested, is on the architecture page of the docs.)

Reads go through :attr:`Outbox.reader` (a :class:`Reader`), which never
builds a worker.

``__all__`` is this package's public face. The layers above it (the Flask
integration, the operator's tools, the migrations) reach the rest through
``flask_mail_outbox.core._internal``; an import-linter contract in
``pyproject.toml`` forbids them the private modules.
"""

from __future__ import annotations

from ._clock import TestClock
from ._config import load_config
from ._delivery import BatchReport, Callbacks, DeliveredMessage
from ._executor import Executor, deliver_ids
from ._intercept import OutgoingEmail
from ._leases import ClaimedEmail
from ._models import (
    Status,
    attachment_table,
    email_table,
    event_table,
    metadata,
    suppression_table,
)
from ._outbox import Mode, Outbox
from ._producer import Producer, Ticket
from ._queries import HourCount, Reader
from ._rows import QueuedRow, prepare_row
from ._settings import OutboxConfig, Rate, TransportSpec
from ._suppression import Suppression
from ._sweep import SweepReport, run_sweep
from ._worker import Worker

__all__ = [
    "BatchReport",
    "Callbacks",
    "ClaimedEmail",
    "DeliveredMessage",
    "Executor",
    "HourCount",
    "Mode",
    "Outbox",
    "OutboxConfig",
    "OutgoingEmail",
    "Producer",
    "QueuedRow",
    "Rate",
    "Reader",
    "Status",
    "Suppression",
    "SweepReport",
    "TestClock",
    "Ticket",
    "TransportSpec",
    "Worker",
    "attachment_table",
    "deliver_ids",
    "email_table",
    "event_table",
    "load_config",
    "metadata",
    "prepare_row",
    "run_sweep",
    "suppression_table",
]
