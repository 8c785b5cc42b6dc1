"""The APScheduler jobs of one app in one process: the startup and periodic sweeps.

A ``BackgroundScheduler`` (daemon threads) owned by the extension runs one
sweep at start, never blocking start-up or the first request, and then a
periodic sweep every ``OUTBOX_SWEEP_INTERVAL_SECONDS`` (60 s in inline mode;
in durable mode the dispatcher's reap and claim do that job, so the periodic
sweep skips unless the interval was set explicitly). When
``OUTBOX_RETENTION_DAYS`` is set, the periodic job also deletes the
``sent``, ``suppressed``, ``expired`` and ``cancelled`` rows that ended longer
ago (see :meth:`~flask_mail_outbox.core._admin.Admin.delete_ended`). A failing sweep is reported at ERROR and never kills the
scheduler.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from .. import _degrade
from ..core._internal import Mode, Outbox, OutboxConfig, SweepReport, run_sweep, utcnow

if TYPE_CHECKING:
    from apscheduler.schedulers.background import BackgroundScheduler

logger = logging.getLogger(__name__)


class SweepScheduler:
    """Startup and periodic sweeps for one app in one process."""

    def __init__(self, outbox: Callable[[], Outbox], config: OutboxConfig,
                 faults: _degrade.FaultTracker, *, deployment: str | None,
                 start_dispatcher: bool = True) -> None:
        #: This process's core, created on first use (an idle process reads nothing).
        self.outbox = outbox
        self.config = config
        self.faults = faults
        self.deployment = deployment
        self.start_dispatcher = start_dispatcher
        self.pid = os.getpid()
        self.startup_done = threading.Event()
        self.startup_report: SweepReport | None = None
        self._scheduler: BackgroundScheduler | None = None
        self._periodic_runs = 0

    def start(self) -> None:
        """Schedule the startup sweep (now, in the scheduler's thread) and the periodic one."""
        from apscheduler.schedulers.background import BackgroundScheduler

        config = self.config
        scheduler = BackgroundScheduler(daemon=True, timezone=UTC)
        # With a task queue as the executor (OUTBOX_EXECUTOR), its workers deliver:
        # this process runs no dispatcher, and its sweeps publish to the queue.
        if config.run_worker and self.start_dispatcher and config.executor == "dispatcher":
            # Its own job, at once: the dispatcher never waits for (or on) a sweep.
            scheduler.add_job(self._start_dispatcher_if_durable, "date",
                              run_date=datetime.now(UTC), id="outbox-start-dispatcher",
                              misfire_grace_time=None)
        if config.sweep_on_startup:
            # A moment after start: an app that creates its tables right after
            # init_app (development) has done so by then.
            scheduler.add_job(self._startup_sweep, "date",
                              run_date=datetime.now(UTC) + timedelta(seconds=1),
                              id="outbox-startup-sweep", misfire_grace_time=None)
        else:
            self.startup_done.set()
        interval = config.sweep_interval_seconds or 60.0
        scheduler.add_job(self._periodic, "interval", seconds=interval,
                          id="outbox-periodic-sweep", max_instances=1, coalesce=True,
                          misfire_grace_time=None)
        scheduler.start()
        self._scheduler = scheduler
        logger.info("Outbox sweep jobs started (pid %d)", self.pid)

    def stop(self) -> None:
        """Shut the scheduler down without waiting for a running job."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None and scheduler.running:
            scheduler.shutdown(wait=False)
        self.startup_done.set()

    def _startup_sweep(self) -> None:
        try:
            if self._first_of_deployment():
                self.startup_report = self._sweep("startup")
        finally:
            self.startup_done.set()

    def _first_of_deployment(self) -> bool:
        """Whether this process runs its deployment's one startup sweep.

        The workers a master forked (gunicorn, uWSGI) share a deployment (see
        ``_deployment_of_worker``): the first to ask runs the sweep, the others
        skip it (it is idempotent: one is enough). A process that is no such
        worker always runs its own.
        """
        deployment = self.deployment
        if deployment is None:
            return True
        digest = hashlib.sha1(deployment.encode()).hexdigest()
        try:
            first = self.outbox().store.sweep.claim_startup_sweep(digest)
        except Exception as exc:  # noqa: BLE001 - durability: ok the sweep runs, and reports its own failure
            logger.info("Could not claim the deployment's startup sweep (%s); this process "
                        "runs one", type(exc).__name__)
            return True
        if not first:
            logger.info("Outbox startup sweep skipped in pid %d: another worker of this "
                        "deployment (master pid %d) runs it", os.getpid(), os.getppid())
        return first

    def _start_dispatcher_if_durable(self) -> None:
        """A serving process in durable mode runs its dispatcher from the start.

        No outbox tables yet is expected here (an app that calls
        ``mail.create_all()`` right after ``init_app``, or a database before
        its migrations): with no table there is no row to dispatch, so this
        is left to the first commit that queues email and to the periodic
        job, and whatever needs the tables says so if they are still missing.
        """
        try:
            outbox = self.outbox()
            if outbox.mode() is Mode.DURABLE:
                outbox.dispatch()
        except Exception as exc:  # noqa: BLE001 - reported; the first commit starts it too
            missing = _degrade.tables_missing(exc)
            if missing is not None:
                logger.debug("No outbox tables yet to read the delivery mode at start-up "
                             "from (%s); in durable mode the first commit that queues email, "
                             "or the periodic job, starts this process's dispatcher", missing)
                return
            self.faults.failing(
                "startup-mode", "Could not read the delivery mode at start-up",
                consequence="in durable mode this process's dispatcher starts only with its "
                            "first commit that queues email; rows already due wait until "
                            "then (or for a `flask outbox worker`)",
                fix="check the database connection and that the outbox tables exist",
                exc=exc)

    def _periodic(self) -> None:
        config = self.config
        try:
            if config.sweep_interval_seconds is None:
                outbox = self.outbox()
                dispatcher = outbox.dispatcher
                if outbox.executor is not None:
                    pass  # a task queue delivers: this sweep publishes what is due
                elif dispatcher is not None and dispatcher.running:
                    # A dispatcher takes due rows here, whatever the mode: nothing
                    # to do, and no query (an idle durable process asks nothing).
                    return
                elif outbox.mode() is Mode.DURABLE:
                    # Switched to durable: this process must run a dispatcher so
                    # no row is left without a taker (it ticks once as it starts).
                    if config.run_worker:
                        outbox.dispatch()
                    self.faults.recovered("sweep")  # this job works again
                    return
        except Exception as exc:  # noqa: BLE001 - reported; the next run retries
            self.faults.failing("sweep", **self._failure("periodic"), exc=exc)
            return
        # The key-head safety net scans open keyed rows: every tenth run is plenty.
        self._periodic_runs += 1
        tenth = self._periodic_runs % 10 == 0
        self._sweep("periodic", heal=tenth)
        if tenth:
            self._prune_suppressions()
        if config.retention_days is not None:
            self._purge_retained(config.retention_days)

    def _sweep(self, kind: str, *, heal: bool = True) -> SweepReport | None:
        try:
            report = run_sweep(self.outbox(), heal=heal, kind=kind)
        except Exception as exc:  # noqa: BLE001 - reported; a sweep never kills the app
            self.faults.failing("sweep", **self._failure(kind), exc=exc)
            return None
        self.faults.recovered("sweep")
        return report

    def _failure(self, kind: str) -> dict[str, str]:
        interval = self.config.sweep_interval_seconds or 60.0
        return {
            "what": f"The {kind} outbox sweep failed",
            "consequence": "emails left behind by a crash or a failed hand-over stay queued "
                           "until a sweep succeeds (the periodic sweep retries every "
                           f"{interval:g} s)",
            "fix": "check the database connection and that the outbox tables exist "
                   "(`flask db upgrade outbox@head`); `flask outbox sweep` runs one by hand",
        }

    def _prune_suppressions(self) -> None:
        """Delete suppression entries past their ``expires_at`` (they no longer apply anyway)."""
        try:
            pruned = self.outbox().suppressions.prune()
        except Exception as exc:  # noqa: BLE001 - tidiness only: lapsed entries are not read
            logger.warning("Could not delete lapsed suppression entries (they no longer "
                           "apply; the next run retries): %s", exc)
            return
        if pruned:
            logger.info("Deleted %d lapsed suppression entr(ies)", pruned)

    def _purge_retained(self, days: float) -> None:
        store = self.outbox().store
        cutoff = utcnow() - timedelta(days=days)
        try:
            total = 0
            # Sent ones by sent_at; those that ended unsent (suppressed, expired,
            # cancelled) by ended_at.
            for delete in (store.admin.delete_sent, store.admin.delete_ended):
                while True:
                    deleted = delete(older_than=cutoff, batch=1000)
                    total += deleted
                    if deleted < 1000:
                        break
            # Events matched to no email, kept as long as the soft-bounce window
            # counts them at least (a shorter retention would forget bounces).
            window = timedelta(seconds=self.config.soft_bounces.window_seconds)
            events = 0
            while True:
                deleted = store.admin.delete_unmatched_events(
                    older_than=min(cutoff, utcnow() - window), batch=1000)
                events += deleted
                if deleted < 1000:
                    break
        except Exception as exc:  # noqa: BLE001 - only retention; nothing is lost
            logger.error("Could not delete sent or ended emails older than "
                         "OUTBOX_RETENTION_DAYS (%g); the table keeps growing until this "
                         "works: %s", days, exc)
            return
        if total:
            logger.info("Deleted %d sent or ended email(s) older than %g day(s)", total, days)
        if events:
            logger.info("Deleted %d delivery event(s) matched to no email, older than %g "
                        "day(s)", events, days)
