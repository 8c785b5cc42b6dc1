"""What a stopping process releases, and the mark that frees it for the next sweep.

A process that stops releases rows it holds and will not send: ids handed to
its worker and never claimed, rows claimed and never handed to the server.
They are ``queued`` again (their attempt returned) and in flight nowhere, so
:meth:`Releases.mark` marks them for any process's next sweep, which takes
them at once instead of after ``OUTBOX_SWEEP_MIN_AGE_SECONDS``. One
:class:`Releases` per :class:`~._outbox.Outbox` owns the stopping flag, the
ids released while stopping, the mark and the INFO lines that say so.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from .. import _degrade

if TYPE_CHECKING:
    from ._settings import OutboxConfig
    from ._store import Store

logger = logging.getLogger(__name__)


class Releases:
    """The stopping flag of one process, and what it released (see the module docstring)."""

    def __init__(self, store: Store, config: OutboxConfig) -> None:
        self.store = store
        self.config = config
        self._stopping = False
        self._released: list[int] = []
        # Set once stop() marked what it knew of: rows released afterwards (they
        # finish in the background) are marked as they come.
        self._marked = False
        self._lock = threading.Lock()

    @property
    def stopping(self) -> bool:
        """Whether this process stops: it claims nothing more, and releases what it holds."""
        return self._stopping

    def stop(self) -> None:
        """This process stops (safe from a signal handler: takes no lock)."""
        self._stopping = True

    def note(self, ids: list[int]) -> None:
        """Ids released (queued, in flight nowhere): kept for :meth:`mark` while stopping.

        Once :meth:`mark` ran, they are marked at once; before the process
        stops, nothing is kept (a running process delivers them itself).
        """
        if not ids or not self._stopping:
            return
        with self._lock:
            if not self._marked:
                self._released.extend(ids)
                return
        marked = self._mark(ids, when="after stop")
        if marked is None:
            return
        logger.info("Outbox delivery released %d more unsent email(s) %s after stop, "
                    "marked for the next sweep of any process", marked, ids[:20])

    def mark(self, *, in_flight: int, ran: bool) -> None:
        """Mark what was released for the next sweep, and say what happens next (at INFO).

        ``in_flight``: rows still being sent past the stop's timeout. ``ran``:
        say it at INFO even when nothing was released or is in flight (where
        the app is served, or its worker ran); DEBUG otherwise.
        """
        with self._lock:
            self._marked = True
            ids, self._released = sorted(set(self._released)), []
        pid = os.getpid()
        still = (f"; {in_flight} email(s) still being sent finish in the background, or, if "
                 f"this process exits first, stay sending until their lease expires "
                 f"(OUTBOX_LEASE_SECONDS, {self.config.lease_seconds:g} s) and a sweep takes "
                 "them" if in_flight else "")
        if not ids:
            logger.log(logging.INFO if ran or in_flight else logging.DEBUG,
                       "Outbox delivery stopped (pid %d): nothing released%s", pid,
                       still or ", nothing in flight")
            return
        marked = self._mark(ids, when="at stop")
        if marked is None:
            return
        interval = self.config.sweep_interval_for(False)
        logger.info(
            "Outbox delivery stopped (pid %d): released %d unsent email(s) %s, queued and "
            "marked so the next sweep of any process takes them whatever their age (the "
            "startup sweep of the next start, or a running process's periodic sweep%s)%s",
            pid, marked, ids[:20], f" within {interval:g} s" if interval else "", still)

    def _mark(self, ids: list[int], *, when: str) -> int | None:
        """Mark ``ids`` for any process's next sweep; how many, None if it failed (reported).

        The rows are queued either way; unmarked, they wait for the age gate.
        """
        try:
            return self.store.sweep.mark_released(ids)
        except Exception as exc:  # noqa: BLE001 - reported; the age gate still frees them
            _degrade.report(
                f"Could not mark {len(ids)} email(s) {ids[:20]} released {when}",
                consequence="they stay queued and wait for the age gate: a sweep takes them "
                            "OUTBOX_SWEEP_MIN_AGE_SECONDS "
                            f"({self.config.sweep_min_age_seconds:g} s) after they were created",
                fix="check the database connection; once every process that could hold them "
                    "has stopped or restarted, `flask outbox sweep --min-age 0` sends them now",
                exc=exc)
            return None
