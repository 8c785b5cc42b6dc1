"""The core's face for the layers above it: the Flask integration, the operator's tools,
the migrations.

Those layers import the core from here (or its public names from
``flask_mail_outbox.core``), never from its other private modules: an
import-linter contract in ``pyproject.toml`` holds them to it. A name here is
internal: it may change in any release.
"""

from __future__ import annotations

from . import (
    BatchReport,
    Callbacks,
    ClaimedEmail,
    DeliveredMessage,
    Executor,
    HourCount,
    Mode,
    Outbox,
    OutboxConfig,
    OutgoingEmail,
    Producer,
    QueuedRow,
    Rate,
    Reader,
    Status,
    Suppression,
    SweepReport,
    TestClock,
    Ticket,
    TransportSpec,
    Worker,
    attachment_table,
    deliver_ids,
    email_table,
    event_table,
    load_config,
    metadata,
    prepare_row,
    run_sweep,
    suppression_table,
)
from ._clock import utcnow
from ._config import _DEFAULTS as CONFIG_DEFAULTS
from ._config import MAX_CONCURRENCY, warn_plaintext_logins
from ._dialect import dialect_of
from ._events import Replayed
from ._mailbox import Mailbox, MailboxEntry, MailboxPage
from ._models import TABLE_NAMES
from ._outbox import DURABLE_SETTING
from ._pause import Pause, PauseStore
from ._queries import EVENT_SCAN_BUDGET, EXACT, SEARCH_FIELDS, recount_tally
from ._rows import (
    check_key,
    check_message,
    due_at_of,
    expires_at_of,
    priority_rank,
    transport_name,
)
from ._suppression import REASONS, suppression_key
from ._sweep import load_last_report

__all__ = [
    "CONFIG_DEFAULTS",
    "DURABLE_SETTING",
    "EVENT_SCAN_BUDGET",
    "EXACT",
    "MAX_CONCURRENCY",
    "REASONS",
    "SEARCH_FIELDS",
    "TABLE_NAMES",
    "BatchReport",
    "Callbacks",
    "ClaimedEmail",
    "DeliveredMessage",
    "Executor",
    "HourCount",
    "Mailbox",
    "MailboxEntry",
    "MailboxPage",
    "Mode",
    "Outbox",
    "OutboxConfig",
    "OutgoingEmail",
    "Pause",
    "PauseStore",
    "Producer",
    "QueuedRow",
    "Rate",
    "Reader",
    "Replayed",
    "Status",
    "Suppression",
    "SweepReport",
    "TestClock",
    "Ticket",
    "TransportSpec",
    "Worker",
    "attachment_table",
    "check_key",
    "check_message",
    "deliver_ids",
    "dialect_of",
    "due_at_of",
    "email_table",
    "event_table",
    "expires_at_of",
    "load_config",
    "load_last_report",
    "metadata",
    "prepare_row",
    "priority_rank",
    "recount_tally",
    "run_sweep",
    "suppression_key",
    "suppression_table",
    "transport_name",
    "utcnow",
    "warn_plaintext_logins",
]
