"""The delivery core: the outbox without Flask.

Everything between a committed row and its recorded outcome lives here: the
settings read from a mapping of ``MAIL_*`` / ``OUTBOX_*`` keys (:func:`load_config`), the
tables, the store (every write transaction), the claim, the per-key order,
the retry policy, shared rate limits, the worker and its lanes, recording
outcomes, LISTEN, the sweep. It imports no Flask and no Flask-SQLAlchemy.
:class:`Outbox` is built from plain values (a database URL,
:class:`OutboxConfig`, transports, :class:`Callbacks`); the Flask integration
owns one per process and app, and anything else may too::

    outbox = Outbox("postgresql+psycopg://...", config, callbacks=Callbacks(sent=...))
    metadata.create_all(outbox.engine)
    row = prepare_row(Message(...), config, key=None, due_at=None)
    with Session(outbox.engine) as session, session.begin():
        ids = [i for i, _ in insert_emails(session, [(row.values, row.attachments)], ...)]
    outbox.worker.deliver(ids, timeout=30)

Reads go through :attr:`Outbox.reader` (a :class:`Reader`), which never
builds a worker.

``__all__`` is this package's public face. The layers above it (the Flask
integration, the operator's tools, the migrations) reach the rest through
``flask_mail_outbox.core._internal``; an import-linter contract in
``pyproject.toml`` forbids them the private modules.
"""

from __future__ import annotations

from ._config import load_config
from ._delivery import BatchReport, Callbacks, DeliveredMessage
from ._insert import insert_emails
from ._models import (
    Status,
    attachment_table,
    email_table,
    event_table,
    metadata,
    suppression_table,
)
from ._outbox import Mode, Outbox
from ._queries import HourCount, Reader
from ._rows import QueuedRow, prepare_row
from ._settings import OutboxConfig, Rate, TransportSpec
from ._store import ClaimedEmail
from ._suppression import Suppression
from ._sweep import SweepReport, run_sweep
from ._worker import Worker

__all__ = [
    "BatchReport",
    "Callbacks",
    "ClaimedEmail",
    "DeliveredMessage",
    "HourCount",
    "Mode",
    "Outbox",
    "OutboxConfig",
    "QueuedRow",
    "Rate",
    "Reader",
    "Status",
    "Suppression",
    "SweepReport",
    "TransportSpec",
    "Worker",
    "attachment_table",
    "email_table",
    "event_table",
    "insert_emails",
    "load_config",
    "metadata",
    "prepare_row",
    "run_sweep",
    "suppression_table",
]
