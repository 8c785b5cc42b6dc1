"""The sweep: finishing what a crash or a failed hand-over left behind.

It takes due ``queued`` rows older than ``OUTBOX_SWEEP_MIN_AGE_SECONDS`` (age,
not "older than this boot": a younger row may be in flight in some process,
and only age means the same on every instance), younger ones that are in
flight nowhere (released by a stopping process, or sent with ``send_after``:
not due at their commit, so no commit handed them over), and ``sending`` rows
whose lease expired, oldest first, at most ``OUTBOX_SWEEP_BATCH`` of them,
reading one more to know for certain whether it stopped short.

* Inline mode: it hands them to this process's worker (claim -> send ->
  record) and waits for their outcomes; a row another delivery claimed first
  is ``skipped``.
* Durable mode: it neither delivers nor inserts: expired leases go back to
  ``queued`` through the reap's guarded update, and the dispatcher is woken.
  Sweeping twice is harmless.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any

from .. import _degrade
from ._models import Status
from ._outbox import Outbox
from ._queries import Reader

logger = logging.getLogger(__name__)

#: Seconds an inline sweep waits for the outcomes of what it handed over.
SWEEP_DELIVERY_TIMEOUT = 3600.0

LAST_SWEEP_SETTING = "last_sweep"


@dataclasses.dataclass(frozen=True)
class SweepReport:
    """What one sweep did.

    ``scanned``: rows that met the criteria and were taken (rows under the
    age gate are not scanned); ``requeued``: made due for the dispatcher
    (durable mode); ``sent``; ``failed``: could not be delivered in this sweep
    (dead-lettered, or left queued after a transient failure); ``skipped``:
    taken but owned by another delivery; ``truncated``: more rows were waiting
    beyond the batch; ``kind``: ``startup``, ``periodic`` or ``manual``;
    ``age_gated``: due queued rows left alone because they are younger than the
    age gate (they may be in flight in another process; rows released or sent
    with ``send_after`` are in flight nowhere, and never counted here), and
    ``age_gated_until``: when the oldest of them becomes eligible.
    """

    scanned: int = 0
    requeued: int = 0
    sent: int = 0
    failed: int = 0
    skipped: int = 0
    truncated: bool = False
    mode: str = "inline"
    dry_run: bool = False
    started_at: str = ""
    duration_seconds: float = 0.0
    kind: str = "manual"
    age_gated: int = 0
    age_gated_until: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepReport:
        """Rebuild a stored report (unknown keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def run_sweep(outbox: Outbox, *, min_age: float | None = None, limit: int | None = None,
              dry_run: bool = False, heal: bool = True, kind: str = "manual") -> SweepReport:
    """One sweep by this process's ``outbox``; raises if the database fails.

    ``heal`` also gives keys left without a holder their lowest open email
    (see :func:`._ordering.heal`). Every sweep but a dry run stores its
    report (one that found nothing too: status shows that sweeps ran), except
    that of a run of periodic sweeps finding nothing only the first is stored,
    so an idle process writes nothing. A ``periodic`` sweep that finds nothing
    logs at DEBUG only and does not count the rows under the age gate.
    """
    min_age, limit = _checked(outbox, min_age, limit)
    started = time.monotonic()
    started_at = outbox.store.clock().isoformat(timespec="seconds") + "Z"
    store = outbox.store
    mode = outbox.mode().value
    if heal and not dry_run:
        healed = store.sweep.heal_key_heads()
        if healed:
            logger.info("The sweep gave %d ordering key(s) without a holder their oldest "
                        "open email", healed)
    candidates = store.sweep.sweep_candidates(min_age_seconds=min_age, limit=limit + 1,
                                              retried_ungated=outbox.executor is not None)
    truncated = len(candidates) > limit
    candidates = candidates[:limit]
    ids = [email_id for email_id, _ in candidates]
    expired = [email_id for email_id, status in candidates if status == Status.SENDING.value]
    fields: dict[str, Any] = {"scanned": len(ids), "truncated": truncated, "mode": mode,
                              "dry_run": dry_run, "started_at": started_at, "kind": kind}
    quiet = kind == "periodic" and not ids
    if not quiet:
        fields.update(_age_gated(outbox, min_age))
    if dry_run or not ids:
        report = SweepReport(**fields, duration_seconds=_elapsed(started))
        if not dry_run:
            _store_report(outbox, report, quiet=quiet)
        if quiet:
            logger.debug("Periodic outbox sweep: nothing to take")
            return report
        _log(report, outbox)
        return report
    report = _take(outbox, ids, expired, fields, started, durable=mode == "durable")
    _store_report(outbox, report)
    _log(report, outbox)
    return report


def _checked(outbox: Outbox, min_age: float | None, limit: int | None) -> tuple[float, int]:
    """``min_age`` and ``limit``, defaulted from the config; ValueError when invalid."""
    config = outbox.config
    min_age = config.sweep_min_age_seconds if min_age is None else min_age
    limit = config.sweep_batch if limit is None else limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    if isinstance(min_age, bool) or not isinstance(min_age, (int, float)) or min_age < 0:
        raise ValueError(f"min_age must be a number of seconds >= 0, got {min_age!r}")
    return float(min_age), limit


def _take(outbox: Outbox, ids: list[int], expired: list[int], fields: dict[str, Any],
          started: float, *, durable: bool) -> SweepReport:
    """Take the candidates: reap the expired leases, then deliver (inline) or wake a dispatcher."""
    # A lost lease keeps its attempt charged: no row is retried without bound
    # (one whose attempts are spent is dead-lettered at its next claim).
    reaped = outbox.store.leases.reap_expired(ids=expired) if expired else None
    if reaped is not None:
        outbox.delivery.report_reaped(reaped)
    if outbox.executor is not None:
        # A task queue delivers: the due rows (and the leases just reaped) are
        # published to it; what its broker refuses waits for the next sweep.
        back = set(reaped.requeued) if reaped is not None else set()
        due = [i for i in ids if i not in expired or i in back]
        # Urgent ones first, in tasks of their own, as at the commit (unless the engine
        # keeps the sweep's tasks off its urgent route: see Executor.sweeps_urgent).
        urgent = outbox.store.sweep.urgent_among(due) \
            if getattr(outbox.executor, "sweeps_urgent", True) else set()
        published = outbox.publish(due, urgent=urgent, why="by the sweep")
        return SweepReport(**fields, requeued=published, skipped=len(ids) - published,
                           duration_seconds=_elapsed(started))
    if durable:
        # Due queued rows are already claimable; expired leases were just reaped.
        if outbox.dispatcher is not None or outbox.config.run_worker:
            outbox.dispatch()
        requeued = len(reaped.requeued) if reaped is not None else 0
        return SweepReport(**fields, requeued=len(ids) - len(expired) + requeued,
                           skipped=len(expired) - requeued, duration_seconds=_elapsed(started))
    batch = outbox.worker.deliver(ids, timeout=SWEEP_DELIVERY_TIMEOUT)
    return SweepReport(**fields, sent=len(batch.sent),
                       failed=len(batch.failed) + len(batch.transient),
                       skipped=len(batch.not_claimed) + len(batch.lost),
                       duration_seconds=_elapsed(started))


def _elapsed(started: float) -> float:
    """Seconds since ``started``, to the millisecond (a person reads it)."""
    return round(time.monotonic() - started, 3)


def _age_gated(outbox: Outbox, min_age: float) -> dict[str, Any]:
    """The report's ``age_gated`` fields: what the age gate kept from this sweep."""
    count, oldest, now = outbox.store.sweep.age_gated(
        min_age_seconds=min_age, retried_ungated=outbox.executor is not None)
    if not count or oldest is None:
        return {"age_gated": 0, "age_gated_until": None}
    eligible = max(oldest + timedelta(seconds=min_age), now)
    return {"age_gated": count,
            "age_gated_until": eligible.isoformat(timespec="seconds") + "Z"}


def _store_report(outbox: Outbox, report: SweepReport, *, quiet: bool = False) -> None:
    """Store ``report`` as the last sweep's; ``quiet`` (a periodic sweep that found
    nothing) only when this process's last stored report was not quiet too."""
    if quiet and outbox.quiet_sweep_stored:
        return
    outbox.quiet_sweep_stored = quiet
    try:
        outbox.store.admin.set_setting(LAST_SWEEP_SETTING, report.as_dict())
    except Exception as exc:  # noqa: BLE001 - reported; the report is for status output only
        # Through the tracker: in an outage this is one more part of the one outage.
        outbox.faults.failing(
            "sweep-report", "Could not store the sweep report",
            consequence="`flask outbox status` and `mail.stats()` show an older one; no "
                        "email is affected",
            fix="check the database connection; the next sweep stores its own", exc=exc)
        return
    outbox.faults.recovered("sweep-report")


def _log(report: SweepReport, outbox: Outbox) -> None:
    gated = ""
    if report.age_gated:
        gated = (f"; left {report.age_gated} younger queued email(s) to the age gate "
                 "(they may be in flight in another process), the oldest eligible at "
                 f"{report.age_gated_until}")
    logger.info(
        "Outbox sweep (%s, %s%s): scanned=%d requeued=%d sent=%d failed=%d skipped=%d "
        "truncated=%s in %.3f s%s", report.kind, report.mode,
        ", dry run" if report.dry_run else "",
        report.scanned, report.requeued, report.sent, report.failed, report.skipped,
        report.truncated, report.duration_seconds, gated)
    if report.dry_run:
        return
    interval = outbox.config.sweep_interval_for(report.mode == "durable")
    when = (f"the next periodic sweep, in {interval:g} s" if interval
            else "the next `flask outbox sweep` (no periodic sweep in durable mode: the "
                 "dispatcher's reap and claim take due rows)")
    if report.failed:
        _degrade.report(
            f"The sweep could not deliver {report.failed} email(s)",
            consequence=("they were dead-lettered (a permanent failure, or their "
                         "OUTBOX_MAX_ATTEMPTS spent) or stay queued after a transient failure; "
                         "queued ones are retried once their backoff has passed (at most "
                         "OUTBOX_RETRY_MAX_SECONDS), by "
                         + ("the dispatcher" if report.mode == "durable"
                            else f"the periodic sweep (every {interval:g} s)"
                            if interval else "the next `flask outbox sweep`")),
            fix="see the ERROR lines above for each email's cause; `flask outbox dlq list` "
                "shows dead letters")
    if report.truncated:
        _degrade.report(
            f"The sweep stopped at OUTBOX_SWEEP_BATCH ({report.scanned} rows) with more "
            "rows waiting",
            consequence=f"the rest stay as they are until {when}",
            fix="run `flask outbox sweep` again now, or raise OUTBOX_SWEEP_BATCH")


def load_last_report(reader: Reader) -> SweepReport | None:
    """The last stored sweep report of any process sharing the database."""
    data = reader.setting(LAST_SWEEP_SETTING)
    return SweepReport.from_dict(data) if isinstance(data, dict) else None

