"""One place that reports every way an email may not go out as promised.

Each report is logged at ERROR and says three things: what happened, the
consequence (which emails, the state they were left in, what will take them
and when) and the fix. ``scripts/check_durability_log_level.py`` checks that
every ``except`` around a durability-critical call either re-raises or comes
through here (or logs at ERROR itself).

An ongoing fault (the database is down, the SMTP server refuses connections)
is coalesced: one ERROR when it starts, repeats only counted, and one summary
when it ends, so an outage does not write a line per tick or per email. A
database outage hits every part of a process at once (dispatcher ticks, lease
renewals, outcome writes, the LISTEN connection): a failure to reach the
database is one fault, :data:`DATABASE`, whichever part reports it. Missing
outbox tables (before ``create_all()`` or the migrations) are one fault too,
:data:`TABLES`, said in one line with the fix: no traceback, since the
cause is known.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field

import sqlalchemy as sa

from ._outside import clean_text

logger = logging.getLogger(__name__)

#: The fault every "cannot reach the database" failure is reported under.
DATABASE = "database"
#: The fault every "the outbox tables do not exist" failure is reported under.
TABLES = "tables"

# SQLSTATEs of a connection that failed or was cut: connection exceptions
# (class 08) and the server shutting down or not accepting connections yet
# (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now). The
# rest of class 57 is answered by a live server (57014 query_canceled is a
# statement_timeout or a cancel): a fault of its own, not an outage.
_UNREACHABLE_SQLSTATE_CLASS = "08"
_UNREACHABLE_SQLSTATES = ("57P01", "57P02", "57P03")
#: PostgreSQL's undefined_table.
_UNDEFINED_TABLE = "42P01"
_TABLES_FIX = ("create them: `flask db upgrade outbox@head` with Flask-Migrate (see "
               "docs/migrations.md), or `mail.create_all()` after `db.create_all()` in "
               "development")


#: An address's local part and its "@" in a server's reply (neither class holds "@" or
#: white space, so the search is linear).
_LOCAL_PART = re.compile(r"[^\s<>()\[\]\\,;:\"@]{1,64}@(?=[^\s<>()\[\]\\,;:\"@])")


def unaddressed(text: str) -> str:
    """``text`` with each address's local part masked (``***@example.com``): a server's
    reply often echoes the recipient (``550 5.1.1 <bob@example.com>: ...``), and the DEBUG
    lines that quote replies never carry an address."""
    return _LOCAL_PART.sub("***@", text)


def report(what: str, *, consequence: str, fix: str,
           exc: BaseException | None = None) -> None:
    """Log one degradation at ERROR with its consequence and fix.

    ``what`` may quote a server's or a custom transport's text: it is made safe
    to write (no NUL, no control characters, no lone surrogates), uncapped.
    """
    logger.error("%s. Consequence: %s. Fix: %s.", clean_text(what, limit=len(what)),
                 consequence, fix,
                 exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


def database_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached (down, restarting, cut off).

    Not for errors the database answered with (a deadlock, a missing table,
    SQLite's "database is locked"): those are faults of their own.
    """
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        return exc.orig is not None and database_unreachable(exc.orig)
    try:
        import psycopg
    except ImportError:  # pragma: no cover - only PostgreSQL is ever unreachable
        return False
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    sqlstate = exc.sqlstate
    # No SQLSTATE: the client could not connect, or lost the connection.
    return (sqlstate is None or sqlstate[:2] == _UNREACHABLE_SQLSTATE_CLASS
            or sqlstate in _UNREACHABLE_SQLSTATES)


def tables_missing(exc: BaseException) -> str | None:
    """The driver's one-line message when ``exc`` says an outbox table does not exist.

    None otherwise (a missing column, or a table that is not the outbox's, is
    a fault of its own).
    """
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    lines = str(orig).strip().splitlines()
    text = lines[0] if lines else ""
    undefined = (getattr(orig, "sqlstate", None) == _UNDEFINED_TABLE
                 or text.startswith("no such table:"))
    return text if undefined and "outbox_" in text else None


@dataclass
class _Ongoing:
    started: float
    repeats: int
    what: str
    # The parts whose failures were folded into this one (DATABASE, TABLES).
    parts: set[str] = field(default_factory=set)


class FaultTracker:
    """Coalesces repeats of one ongoing fault into a start line and an end line.

    ``failing(fault, ...)`` logs at ERROR the first time a fault is seen and
    only counts later calls; ``recovered(fault)`` logs how long it lasted and
    how often it recurred, once, when it had been failing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ongoing: dict[str, _Ongoing] = {}

    def failing(self, fault: str, what: str, *, consequence: str, fix: str,
                exc: BaseException | None = None) -> bool:
        """Report ``fault``; returns True when this call logged (the fault is new).

        When ``exc`` says the database cannot be reached, the report is the
        one :data:`DATABASE` fault, shared by every part of the process; when
        it says the outbox tables do not exist, the one :data:`TABLES` fault,
        in one line without a traceback.
        """
        part = fault
        missing = None if exc is None else tables_missing(exc)
        if exc is not None and database_unreachable(exc):
            fault = DATABASE
            what = f"The database cannot be reached ({what})"
            consequence = (f"{consequence}; every other part of this process that needs the "
                           "database waits and retries with backoff too, counted here until "
                           "the database answers again")
            fix = "check that the database is up and reachable; the emails need nothing"
        elif missing is not None:
            fault, exc = TABLES, None
            what = f"The outbox tables do not exist ({what}: {missing})"
            consequence = ("no email can be queued or delivered until they do (mail.send() "
                           "raises); the background jobs keep trying")
            fix = _TABLES_FIX
        with self._lock:
            ongoing = self._ongoing.get(fault)
            if ongoing is not None:
                ongoing.repeats += 1
                ongoing.parts.add(part)
                return False
            self._ongoing[fault] = _Ongoing(time.monotonic(), 0, what, {part})
        report(f"{what} (further occurrences are counted until it recovers)",
               consequence=consequence, fix=fix, exc=exc)
        return True

    def recovered(self, fault: str) -> None:
        """Close ``fault`` if it was ongoing, with one summary line.

        A part that failed during a database outage (or while the tables were
        missing) and works again closes it: the database answers.
        """
        with self._lock:
            ongoing = self._ongoing.pop(fault, None)
            for shared in (DATABASE, TABLES):
                outage = self._ongoing.get(shared)
                if ongoing is None and outage is not None and fault in outage.parts:
                    ongoing = self._ongoing.pop(shared)
        if ongoing is not None:
            # Recovery is not a degradation: INFO, so alerting on ERROR stays meaningful.
            logger.info(
                "Recovered: %s; it lasted %.1f s and recurred %d more time(s). "
                "Rows left queued meanwhile are delivered by the normal route now.",
                ongoing.what, time.monotonic() - ongoing.started, ongoing.repeats,
            )
