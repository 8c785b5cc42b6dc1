"""Delivery on a task queue the app already runs: the broker is a doorbell, the database the truth.

With ``OUTBOX_EXECUTOR`` set to a task queue (``"celery"``, ``"rq"``,
``"dramatiq"``), a commit does not wake this library's dispatcher: it
*publishes* the ids of the committed emails (:meth:`Executor.publish`) to the
task queue. A task on one of its workers then runs this library's own claim
of those ids (the compare-and-set with a lease a dispatcher runs), delivers
what it claimed and records the outcomes (:func:`deliver_ids`). A task for an
email already sent, claimed elsewhere or not due claims nothing and returns.

What a broker can lose, the database keeps: a doorbell lost between the
commit and the publish, a task lost with its worker, a retry's next due time,
an email sent with ``send_after``: each is a due row, and the periodic sweep
task (:func:`._sweep.run_sweep` on an outbox with an executor) publishes due
rows again. Delivery errors never raise into the broker: the outbox's backoff
sets the next due time, and the sweep publishes the row when it is due.

The engines' own modules (``flask_mail_outbox.contrib.celery``, ``.rq``,
``.dramatiq``) implement :class:`Executor` and the tasks; the core knows none
of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from .._degrade import FaultTracker
from ._delivery import BatchReport

if TYPE_CHECKING:
    from ._worker import Worker

logger = logging.getLogger(__name__)

#: How long one task waits for the outcomes of the emails it claimed (seconds):
#: a send times out long before (the transports' own timeouts); this only bounds a
#: task whose worker is stuck.
TASK_TIMEOUT = 3600.0


class Executor(Protocol):
    """A task queue's side of the hand-over: publishes the ids of emails to deliver."""

    #: The engine's name, as ``OUTBOX_EXECUTOR`` says it ("celery", "rq", "dramatiq").
    name: str
    #: The sweep task's name as the engine shows it (what an operator looks for).
    sweep_task: str
    #: Optional (default True): whether the sweep publishes ``priority="high"`` emails
    #: as urgent too. False for an engine whose urgent route can go unconsumed (a
    #: queue of its own): there the sweep's plain task is the fallback.
    # sweeps_urgent: bool

    def publish(self, ids: Sequence[int], *, urgent: bool = False) -> None:
        """Publish one task that delivers ``ids``; raise when the broker refused it.

        ``urgent``: the emails were sent with ``priority="high"`` (an engine
        with task priorities gives the task a higher one).
        """
        ...


def chunks(ids: Sequence[int], size: int) -> Iterator[list[int]]:
    """``ids`` in lists of at most ``size``: one task claims at most a batch."""
    for start in range(0, len(ids), size):
        yield list(ids[start:start + size])


def publish(executor: Executor, ids: Sequence[int], *, urgent: Sequence[int] | set[int] = (),
            batch_size: int, faults: FaultTracker, why: str = "after commit") -> int:
    """Publish ``ids`` (urgent ones first, in tasks of their own); how many were published.

    Never raises: a broker that refuses is reported once at ERROR (then
    recovered), and the rows it refused stay queued in the database for the
    periodic sweep task to publish again.
    """
    if not ids:
        return 0
    first = [i for i in ids if i in urgent]
    rest = [i for i in ids if i not in urgent] if first else list(ids)
    published = 0
    try:
        for group, is_urgent in ((first, True), (rest, False)):
            for chunk in chunks(group, batch_size):
                executor.publish(chunk, urgent=is_urgent)
                published += len(chunk)
                logger.debug("Emails %s published to %s (%s)", chunk, executor.name, why)
    except Exception as exc:  # noqa: BLE001 - the rows are queued: the sweep task publishes them
        left = len(ids) - published
        sweep_task = getattr(executor, "sweep_task", "flask_mail_outbox.sweep")
        faults.failing(
            f"executor-publish-{executor.name}",
            f"Could not publish {left} email(s) to the {executor.name} broker ({why})",
            consequence=f"they stay queued in the database; the periodic sweep task "
                        f"({sweep_task} on {executor.name}) publishes them again "
                        f"once the broker answers (OUTBOX_SWEEP_MIN_AGE_SECONDS after their "
                        f"creation at the earliest); no email is lost",
            fix=f"check that the {executor.name} broker is up and reachable from this process "
                f"(OUTBOX_EXECUTOR_URL, or the {executor.name} app's broker URL)",
            exc=exc)
        return published
    faults.recovered(f"executor-publish-{executor.name}")
    return published


def deliver_ids(worker: Worker, ids: Sequence[int], *, timeout: float = TASK_TIMEOUT,
                until_claimed: bool = False) -> BatchReport:
    """A task's body: claim ``ids``, deliver what was claimed, record; never raises for mail.

    The ids go to this process's ``worker`` (its outbox's
    :attr:`~._outbox.Outbox.worker`), whose loop claims them with the
    outbox's own compare-and-set and a lease, sends them on its long-lived
    connections and records the outcomes; the call returns once every id has
    its first outcome (or ``timeout`` passed). Ids it cannot claim (sent,
    cancelled, claimed elsewhere, not due, waiting on their key) are in
    ``not_claimed``. A transient failure is recorded at once with its backoff
    (no retry in this process: the sweep task publishes it when due), so
    nothing of the task stays in memory. Tasks running at once in one process
    (an engine's threads) share the loop: their ids are claimed and sent side
    by side, as a dispatcher's claims are, so one-email tasks on T threads
    keep up to T emails in flight. ``until_claimed``: return once the ids
    are claimed (``report.claimed``), the loop sending and recording them
    after, for an engine that runs one task at a time per process (RQ): the
    next task's ids are claimed while these are on the wire, and the loop's
    room (``OUTBOX_BATCH_SIZE`` rows in flight) holds the next claim back. A
    worker ticked by hand (the test kit, ``flask outbox worker --once``) is
    drained in the caller's thread instead.
    """
    worker.retries_in_process = False
    clean = sorted({int(i) for i in ids})
    if not clean:
        return BatchReport()
    report = worker.deliver(clean, timeout=timeout, until_claimed=until_claimed)
    logger.debug("Task for %s: %d claimed and on their way, %d sent, %d failed, %d to retry, "
                 "%d not claimed", clean[:20], len(report.claimed), len(report.sent),
                 len(report.failed), len(report.transient), len(report.not_claimed))
    return report


__all__ = ["TASK_TIMEOUT", "Executor", "chunks", "deliver_ids", "publish"]
