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
    row = prepare_row(Message(...), config, key=None, due_at=None)
    with Session(outbox.engine) as session, session.begin():
        ids = [i for i, _ in insert_emails(session, [(row.values, row.attachments)], ...)]
    outbox.worker.deliver(ids, timeout=30)

Reads go through :attr:`Outbox.reader` (a :class:`Reader`), which never
builds a worker.
"""

from __future__ import annotations

from ._clock import now_expr, utcnow
from ._config import _DEFAULTS as CONFIG_DEFAULTS
from ._config import MAX_CONCURRENCY, load_config, warn_plaintext_logins
from ._delivery import BatchReport, Callbacks, DeliveredMessage
from ._events import EventLog, RecordedEvents, Replayed
from ._insert import (
    cancel_emails,
    email_connection,
    email_dialect,
    insert_email,
    insert_emails,
)
from ._listen import notify_statement
from ._models import (
    DEFAULT_PRIORITY,
    PRIORITIES,
    TABLE_NAMES,
    Status,
    attachment_table,
    email_table,
    event_table,
    metadata,
    nonce_table,
    rate_table,
    setting_table,
    suppression_table,
)
from ._ordering import advance
from ._outbox import (
    DURABLE_SETTING,
    Mode,
    Outbox,
    build_transports,
    create_engine,
    ensure_wal,
    sqlite_on_connect,
)
from ._queries import SEARCH_FIELDS, HourCount, Reader
from ._retry import RetryPolicy
from ._rows import (
    QueuedRow,
    check_key,
    check_message,
    due_at_of,
    expires_at_of,
    prepare_row,
    priority_rank,
    transport_name,
)
from ._settings import DEFAULT_TRANSPORT, OutboxConfig, Rate, TransportSpec
from ._store import ClaimedEmail, Store
from ._suppression import REASONS, Suppression, Suppressions, suppression_key
from ._sweep import LAST_SWEEP_SETTING, SweepReport, load_last_report, run_sweep
from ._worker import Worker

__all__ = [
    "CONFIG_DEFAULTS",
    "DEFAULT_PRIORITY",
    "DEFAULT_TRANSPORT",
    "DURABLE_SETTING",
    "LAST_SWEEP_SETTING",
    "MAX_CONCURRENCY",
    "PRIORITIES",
    "REASONS",
    "SEARCH_FIELDS",
    "TABLE_NAMES",
    "BatchReport",
    "Callbacks",
    "ClaimedEmail",
    "DeliveredMessage",
    "EventLog",
    "HourCount",
    "Mode",
    "Outbox",
    "OutboxConfig",
    "QueuedRow",
    "Rate",
    "Reader",
    "RecordedEvents",
    "Replayed",
    "RetryPolicy",
    "Status",
    "Store",
    "Suppression",
    "Suppressions",
    "SweepReport",
    "TransportSpec",
    "Worker",
    "advance",
    "attachment_table",
    "build_transports",
    "cancel_emails",
    "check_key",
    "check_message",
    "create_engine",
    "due_at_of",
    "expires_at_of",
    "email_connection",
    "email_dialect",
    "email_table",
    "ensure_wal",
    "event_table",
    "insert_email",
    "insert_emails",
    "load_config",
    "load_last_report",
    "metadata",
    "nonce_table",
    "notify_statement",
    "now_expr",
    "prepare_row",
    "priority_rank",
    "rate_table",
    "run_sweep",
    "setting_table",
    "sqlite_on_connect",
    "suppression_key",
    "suppression_table",
    "transport_name",
    "utcnow",
    "warn_plaintext_logins",
]
