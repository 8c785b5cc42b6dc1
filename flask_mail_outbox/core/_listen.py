"""PostgreSQL LISTEN/NOTIFY: wake dispatchers in other processes at once.

A transaction that queued email (in durable mode) runs ``pg_notify`` once;
PostgreSQL delivers it when, and only if, that transaction commits. Each
process that runs a dispatcher keeps one connection that ``LISTEN``\\ s and
wakes its dispatchers. The poll stays as a backstop: while the connection is
up the idle gap may grow to ``OUTBOX_LISTEN_BACKSTOP_SECONDS``.

Behind PgBouncer in transaction mode LISTEN silently receives nothing: turn
``OUTBOX_LISTEN`` off, or point ``OUTBOX_LISTEN_URL`` at the database directly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import sqlalchemy as sa

from .. import _degrade

logger = logging.getLogger(__name__)

CHANNEL = "outbox_email"
#: A transport's rate was learned (the payload is its name): pace by it now.
RATE_CHANNEL = "outbox_rate"


def notify_statement() -> sa.TextClause:
    """The statement a committing transaction runs once to wake listeners."""
    return sa.text(f"SELECT pg_notify('{CHANNEL}', '')")


def notify_rate_statement() -> sa.TextClause:
    """The statement that tells listeners transport ``:name``'s rate was learned."""
    return sa.text(f"SELECT pg_notify('{RATE_CHANNEL}', :name)")


def libpq_url(url: sa.URL | str) -> str:
    """A SQLAlchemy URL as a libpq connection URI (what psycopg.connect takes)."""
    parsed = sa.make_url(url)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class Listener:
    """One LISTEN connection per process; calls ``on_notify`` for each notification.

    ``on_rate``: called first with the transport's name when another process
    learned its rate (:data:`RATE_CHANNEL`).
    """

    def __init__(self, url: str, on_notify: Callable[[], None],
                 on_state: Callable[[bool], None], faults: _degrade.FaultTracker,
                 on_rate: Callable[[str], None] | None = None) -> None:
        self.url = url
        self.on_notify = on_notify
        self.on_rate = on_rate
        self.on_state = on_state
        self.faults = faults
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the LISTEN thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="outbox-listen", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop listening; the thread notices within a second."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            import psycopg
        except ImportError as exc:
            # An app on psycopg2 (postgresql://): no LISTEN, the dispatcher polls.
            self.faults.failing(
                "listen-driver", "Cannot LISTEN for new emails: psycopg (3) is not installed",
                consequence="the durable dispatcher does not wake at once for new emails; "
                            "it polls (OUTBOX_POLL_INTERVAL, backing off to "
                            "OUTBOX_LISTEN_BACKSTOP_SECONDS)",
                fix="install the postgres extra (psycopg 3), or set OUTBOX_LISTEN = False",
                exc=exc)
            self.on_state(False)
            return

        delay = 1.0
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if self.on_rate is not None:
                        conn.execute(f"LISTEN {RATE_CHANNEL}")
                    self.on_state(True)
                    self.faults.recovered("listen")
                    delay = 1.0
                    # A wake right after connecting covers commits made while it was down.
                    self.on_notify()
                    while not self._stopping.is_set():
                        for notice in conn.notifies(timeout=1.0):
                            if notice.channel == RATE_CHANNEL and self.on_rate is not None:
                                self.on_rate(notice.payload)
                            self.on_notify()
            except Exception as exc:  # noqa: BLE001 - reported; polling still delivers
                self.on_state(False)
                if self._stopping.is_set():
                    return
                self.faults.failing(
                    "listen", "The LISTEN connection for instant wake-ups is down",
                    consequence="nothing is lost: dispatchers fall back to polling every "
                                "OUTBOX_POLL_MAX_INTERVAL at most, so new emails may wait "
                                "that long; it reconnects on its own",
                    fix="check the database; behind PgBouncer (transaction mode) set "
                        "OUTBOX_LISTEN_URL to a direct connection or OUTBOX_LISTEN=False",
                    exc=exc)
                self._stopping.wait(delay)
                delay = min(delay * 2, 30.0)
        self.on_state(False)


