"""Delivery on RQ workers (``OUTBOX_EXECUTOR = "rq"``; docs/executors/rq.md).

A commit publishes one RQ job per batch of ids: the function
``flask_mail_outbox.contrib.rq.deliver`` with the list of ids, on the queue
``OUTBOX_EXECUTOR_QUEUE`` of the Redis at ``OUTBOX_EXECUTOR_URL``. RQ retries
are off and a job's result is not kept (``result_ttl=0``): the database holds
every outcome, and the periodic job ``flask_mail_outbox.contrib.rq.sweep``
(scheduled with ``rq cron``: :func:`register_sweep`) publishes what is due
again. Emails sent with ``priority="high"`` go to the front of the queue
(``at_front``): RQ has no priorities within a queue.

Workers run :class:`OutboxWorker` (``rq worker --worker-class
flask_mail_outbox.contrib.rq.OutboxWorker``): it loads the Flask app once, at
start-up, the way ``flask`` finds it (``FLASK_APP``), and runs each job in its
own process instead of forking a work-horse per job, so the outbox's database
pool and SMTP connections live across jobs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from flask import Flask
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue, SimpleWorker
from rq import cron as rq_cron
from rq.job import Job

from .._errors import ConfigError
from .._flask import executors

logger = logging.getLogger(__name__)

#: The deliver job's function path, as RQ names it.
DELIVER = "flask_mail_outbox.contrib.rq.deliver"
#: The sweep job's function path.
SWEEP = "flask_mail_outbox.contrib.rq.sweep"
#: A job's time limit (seconds): a minute past the outbox's own bound on one task
#: (an hour: ``deliver_ids``), so RQ never interrupts a delivery the outbox still waits for.
JOB_TIMEOUT = 3660
#: How long a job that raised (a worker set up wrong) stays in RQ's failed registry.
FAILURE_TTL = 7 * 86400
#: The sweep's recommended interval (seconds): see docs/executors/rq.md.
SWEEP_INTERVAL = 60
#: Seconds a publish waits for Redis to accept a connection / answer: the commit's
#: after-commit hook must not hang on a broker that does not answer.
CONNECT_TIMEOUT = 2.0
SOCKET_TIMEOUT = 2.0


def redis_client(url: str) -> Redis:
    """A client for ``url`` that fails fast: one immediate retry (a pooled connection
    that a Redis restart closed), then the error (the rows stay queued)."""
    return Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT,
                          socket_timeout=SOCKET_TIMEOUT, retry=Retry(NoBackoff(), 1))


class RQExecutor:
    """Publishes ``deliver`` jobs to one RQ queue (see the module docstring)."""

    name = "rq"
    sweep_task = SWEEP

    def __init__(self, url: str, queue: str) -> None:
        self.url = url
        self.queue_name = queue
        # redis-py's pool notices a fork and opens new connections in the child.
        self.queue = Queue(queue, connection=redis_client(url))

    def publish(self, ids: Sequence[int], *, urgent: bool = False) -> None:
        """Enqueue one ``deliver`` job for ``ids`` (at the front when ``urgent``);
        raises when Redis refuses."""
        batch = [int(i) for i in ids]
        self.queue.enqueue_call(
            DELIVER, args=(batch,), timeout=JOB_TIMEOUT, result_ttl=0,
            failure_ttl=FAILURE_TTL, at_front=urgent, retry=None,
            description=f"flask_mail_outbox deliver {len(batch)} email(s) from {batch[0]}"
                        if batch else "flask_mail_outbox deliver")

    def publish_sweep(self) -> Job:
        """Enqueue one ``sweep`` job (for a scheduler other than ``rq cron``)."""
        return self.queue.enqueue_call(SWEEP, timeout=JOB_TIMEOUT, result_ttl=0,
                                failure_ttl=FAILURE_TTL, retry=None,
                                description="flask_mail_outbox sweep")


def publisher(app: Flask) -> RQExecutor:
    """The executor of ``app`` (``OUTBOX_EXECUTOR = "rq"``).

    :class:`ConfigError` naming ``OUTBOX_EXECUTOR_URL`` when it is missing or
    not a Redis URL. Connects to nothing yet.
    """
    url = app.config.get("OUTBOX_EXECUTOR_URL")
    if not url:
        raise ConfigError(
            "OUTBOX_EXECUTOR_URL",
            "OUTBOX_EXECUTOR = 'rq' needs the Redis URL of the RQ workers' queue, such as "
            "'redis://127.0.0.1:6379/0'")
    queue = app.config.get("OUTBOX_EXECUTOR_QUEUE") or "outbox"
    try:
        return RQExecutor(str(url), str(queue))
    except ValueError as exc:  # redis-py: not a redis://, rediss:// or unix:// URL
        raise ConfigError("OUTBOX_EXECUTOR_URL",
                          f"not a Redis URL (redis://host:port/db): {exc}") from None


# -- the jobs -----------------------------------------------------------------------------


def deliver(ids: list[int]) -> dict[str, int]:
    """The deliver job: claim ``ids``; this process delivers and records them; counts.

    Never raises for mail; raises :class:`ConfigError` when the worker has no app.
    """
    # RQ runs one job at a time per process. In an OutboxWorker, which lives on,
    # the job returns once its ids are claimed, and the process's delivery loop
    # sends and records them while the next job's ids are claimed (docs/executors/
    # rq.md has the measured difference). A forked work-horse exits with its job:
    # there the job waits for the outcomes.
    return executors.deliver_task(ids, app=load_app(), until_claimed=_outbox_worker_pid
                                  == os.getpid())


def sweep() -> dict[str, int]:
    """The periodic sweep job: publishes what is due (retries, ``send_after``,
    expired leases, lost doorbells)."""
    return executors.sweep_task(app=load_app())


# -- scheduling the sweep -------------------------------------------------------------------


def register_sweep(queue: str = "outbox", *, interval: int = SWEEP_INTERVAL,
                   scheduler: rq_cron.CronScheduler | None = None) -> Any:
    """Schedule the sweep job every ``interval`` seconds with RQ's own cron.

    In the file given to ``rq cron`` (``scheduler`` None: RQ's module-level
    registry that ``rq cron`` reads), or on a :class:`rq.cron.CronScheduler`
    of your own. ``queue``: ``OUTBOX_EXECUTOR_QUEUE``. Returns what RQ returns.
    """
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval must be a whole number of seconds >= 1, got {interval!r}")
    options: dict[str, Any] = {"queue_name": queue, "interval": interval, "result_ttl": 0,
                               "failure_ttl": FAILURE_TTL, "job_timeout": JOB_TIMEOUT,
                               "name": SWEEP}
    if scheduler is None:
        return rq_cron.register(sweep, **options)
    return scheduler.register(sweep, **options)


def enqueue_sweep(app: Flask | None = None) -> Job:
    """Publish one sweep job now through ``app``'s executor (or this process's app):
    for a scheduler other than ``rq cron`` (APScheduler, a system cron running
    ``flask`` commands). The job; raises when Redis refuses."""
    executor = executors.task_app(app).extensions["mail_outbox"].executor
    if not isinstance(executor, RQExecutor):
        raise ConfigError("OUTBOX_EXECUTOR", "enqueue_sweep() needs OUTBOX_EXECUTOR = 'rq'")
    return executor.publish_sweep()


# -- the worker -------------------------------------------------------------------------------


def load_app() -> Flask:
    """This process's app: the one it created, else ``FLASK_APP`` loaded as ``flask`` does.

    :class:`ConfigError` naming ``OUTBOX_EXECUTOR`` when neither gives one.
    """
    return executors.task_app()


#: The pid of this process's OutboxWorker (None: none): its jobs run in it, and it
#: lives on after each, so its delivery loop finishes what a job claimed.
_outbox_worker_pid: int | None = None


class OutboxWorker(SimpleWorker):
    """An RQ worker for the outbox's queue: the app loaded at start, no fork per job.

    Loading the app here (not in the first job) makes a worker set up wrong
    fail at start, and :class:`rq.SimpleWorker` runs every job in this process:
    the outbox's engine, its database pool and its SMTP connections are made
    once, not once per job as in a forked work-horse (docs/executors/rq.md has
    the measured cost of each).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _outbox_worker_pid
        super().__init__(*args, **kwargs)
        self.flask_app = load_app()
        _outbox_worker_pid = os.getpid()
        logger.info("RQ worker %s delivers for the Flask app %s", self.name,
                    self.flask_app.import_name)


__all__ = ["DELIVER", "SWEEP", "OutboxWorker", "RQExecutor", "deliver", "enqueue_sweep",
           "load_app", "publisher", "register_sweep", "sweep"]
