"""Delivery on Dramatiq workers (``OUTBOX_EXECUTOR = "dramatiq"``; docs/executors/dramatiq.md).

A commit publishes one message per batch of ids to the actor
``flask_mail_outbox.deliver`` (one argument: the list of ids) on the queue
``OUTBOX_EXECUTOR_QUEUE``; emails sent with ``priority="high"`` go to the
queue ``<queue>.urgent`` instead, which a worker consumes with a consumer of
its own, so they never wait behind the backlog of the main queue. The actor
``flask_mail_outbox.sweep`` (no arguments) publishes what is due again; it is
sent periodically by :func:`sweeper` (a Dramatiq fork function running an
APScheduler job) or by :func:`schedule_sweep` in a process of the app's choice.

Which broker (Dramatiq binds actors to a broker when they are declared):

1. the global broker, when the app set one (``dramatiq.set_broker()``) before
   ``init_app``;
2. else a ``RedisBroker`` on ``OUTBOX_EXECUTOR_URL``, made the global broker
   (the ``dramatiq`` command runs the global broker);
3. else :class:`ConfigError` naming ``OUTBOX_EXECUTOR_URL``. Both set is a
   :class:`ConfigError` too: the outbox would publish to one broker while the
   worker consumes another.

Both actors have Dramatiq's retries off (``max_retries=0``): a delivery error
never raises (the outbox's backoff sets the next due time, the sweep publishes
the row again), and a task that raises (a worker set up wrong) goes to the
dead-letter queue once instead of looping. The deliver actor's time limit is
past the outbox's own bound on one task (an hour): Dramatiq's
default of ten minutes would interrupt a long drain between a send and its
record.

Workers: ``dramatiq flask_mail_outbox.contrib.dramatiq:setup`` with
``FLASK_APP`` set (:func:`setup` loads the app the way ``flask`` does), or a
module of the app that creates it (``dramatiq myapp.tasks``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dramatiq
import dramatiq.broker
import redis
from dramatiq.brokers.redis import RedisBroker
from flask import Flask

from .._errors import ConfigError
from .._flask import executors
from .._flask.state import EXTENSION_KEY

if TYPE_CHECKING:
    from apscheduler.schedulers.base import BaseScheduler

logger = logging.getLogger(__name__)

#: The actors' names (``actor_name``), the same on every broker.
DELIVER = "flask_mail_outbox.deliver"
SWEEP = "flask_mail_outbox.sweep"
#: The suffix of the queue urgent deliveries go to (``<queue>.urgent``).
URGENT_SUFFIX = ".urgent"
#: The deliver actor's time limit (ms): past the outbox's own bound on one task
#: (core/_executor.py TASK_TIMEOUT, an hour), so Dramatiq interrupts only a task that
#: is stuck, never a drain between a send and its record.
DELIVER_TIME_LIMIT_MS = (3600 + 60) * 1000
#: The sweep actor's time limit (ms): a scan and a publish, seconds at most.
SWEEP_TIME_LIMIT_MS = 10 * 60 * 1000
#: The periodic sweep's interval (seconds) when OUTBOX_SWEEP_INTERVAL_SECONDS is unset.
SWEEP_INTERVAL = 60.0
#: Seconds a publish waits for Redis to connect / answer: the commit's after-commit
#: hook must not hang on a broker that does not answer (the rows stay queued).
CONNECT_TIMEOUT = 2.0
SOCKET_TIMEOUT = 5.0

_QUEUE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9._-]*")
_lock = threading.Lock()
#: The brokers this module made, by URL (one per URL per process).
_made: dict[str, RedisBroker] = {}


def deliver(ids: list[int]) -> None:
    """The ``flask_mail_outbox.deliver`` actor's function: claim ``ids``, deliver, record.

    Returns nothing (Dramatiq warns about a result without its Results
    middleware); the counts are logged at DEBUG, the outcomes are in the database.
    """
    counts = executors.deliver_task(ids)
    logger.debug("flask_mail_outbox.deliver: %s", counts)


def sweep() -> None:
    """The ``flask_mail_outbox.sweep`` actor's function: publish what is due."""
    counts = executors.sweep_task()
    logger.debug("flask_mail_outbox.sweep: %s", counts)


def _options(broker: dramatiq.Broker, **options: Any) -> dict[str, Any]:
    """``options`` this broker's middleware knows (an app's broker may lack Retries or
    TimeLimit: then there is nothing to turn off)."""
    return {k: v for k, v in options.items() if k in broker.actor_options}


def declare(broker: dramatiq.Broker, queue: str) -> tuple[dramatiq.Actor[Any, Any],
                                                           dramatiq.Actor[Any, Any]]:
    """The two actors on ``broker`` (declared on first use), and the urgent queue.

    Dramatiq keeps one actor per name and broker: a second app of this
    process on the same broker shares them, on the same queue only
    (:class:`ConfigError` naming ``OUTBOX_EXECUTOR_QUEUE`` otherwise).
    """
    found = []
    for name, fn, limit in ((DELIVER, deliver, DELIVER_TIME_LIMIT_MS),
                            (SWEEP, sweep, SWEEP_TIME_LIMIT_MS)):
        if name in broker.actors:
            actor = broker.get_actor(name)
            if actor.queue_name != queue:
                raise ConfigError(
                    "OUTBOX_EXECUTOR_QUEUE",
                    f"{name} is declared on queue {actor.queue_name!r} of this Dramatiq broker "
                    f"already (another app of this process); Dramatiq keeps one actor per name "
                    f"and broker: give the apps the same OUTBOX_EXECUTOR_QUEUE, got {queue!r}")
        else:
            actor = dramatiq.Actor(
                fn, broker=broker, actor_name=name, queue_name=queue, priority=0,
                options=_options(broker, max_retries=0, time_limit=limit))
        found.append(actor)
    broker.declare_queue(queue + URGENT_SUFFIX)
    return found[0], found[1]


class DramatiqExecutor:
    """Publishes ``flask_mail_outbox.deliver`` messages to one broker and queue."""

    name = "dramatiq"
    sweep_task = SWEEP
    #: The sweep publishes urgent emails to the main queue: a worker started with
    #: ``--queues outbox`` alone never reads ``outbox.urgent``, and the sweep is what
    #: still delivers them then (docs/executors/dramatiq.md).
    sweeps_urgent = False

    def __init__(self, broker: dramatiq.Broker, queue: str) -> None:
        self.broker = broker
        self.queue = queue
        self.urgent_queue = queue + URGENT_SUFFIX
        self.deliver_actor, self.sweep_actor = declare(broker, queue)

    def publish(self, ids: Sequence[int], *, urgent: bool = False) -> None:
        """Enqueue one deliver message for ``ids`` (urgent: on ``<queue>.urgent``);
        raises when the broker refuses. Never a delay: the database times retries."""
        message = self.deliver_actor.message([int(i) for i in ids])
        if urgent:
            message = message.copy(queue_name=self.urgent_queue)
        self.broker.enqueue(message)

    def publish_sweep(self) -> None:
        """Enqueue one sweep message; raises when the broker refuses."""
        self.broker.enqueue(self.sweep_actor.message())


def _setting(app: Flask, key: str, default: Any) -> Any:
    # init_app calls publisher() before the app's state exists: its config was
    # already checked by then (load_config), so the raw value is the checked one.
    return app.config.get(key, default)


def _broker_for(url: str | None) -> dramatiq.Broker:
    """The broker by the module docstring's rule."""
    current = dramatiq.broker.global_broker
    ours = current is not None and any(current is b for b in _made.values())
    if current is not None and not ours:
        if url:
            raise ConfigError(
                "OUTBOX_EXECUTOR_URL",
                f"the app set a global Dramatiq broker ({type(current).__name__}) and "
                f"OUTBOX_EXECUTOR_URL ({url!r}) too: the outbox would publish to one and the "
                "`dramatiq` workers consume the other. Unset OUTBOX_EXECUTOR_URL to use the "
                "app's broker, or set no broker before init_app")
        return current
    if not url:
        raise ConfigError(
            "OUTBOX_EXECUTOR_URL",
            "OUTBOX_EXECUTOR = 'dramatiq' needs a broker: set OUTBOX_EXECUTOR_URL to a Redis "
            "URL (redis://host:6379/0), or call dramatiq.set_broker() before init_app")
    broker = _made.get(url)
    if broker is None:
        client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT,
                                      socket_timeout=SOCKET_TIMEOUT)
        broker = _made[url] = RedisBroker(client=client)  # type: ignore[no-untyped-call]
    dramatiq.set_broker(broker)
    return broker


def publisher(app: Flask) -> DramatiqExecutor:
    """The executor of ``app`` (``OUTBOX_EXECUTOR = "dramatiq"``): its broker, by the
    module docstring's rule, with the two actors declared on it."""
    queue = _setting(app, "OUTBOX_EXECUTOR_QUEUE", "outbox")
    if not isinstance(queue, str) or not _QUEUE_NAME.fullmatch(queue):
        raise ConfigError("OUTBOX_EXECUTOR_QUEUE",
                          f"a Dramatiq queue name starts with a letter or '_' followed by "
                          f"letters, digits, '.', '-' or '_'; got {queue!r}")
    with _lock:
        broker = _broker_for(_setting(app, "OUTBOX_EXECUTOR_URL", None))
        return DramatiqExecutor(broker, queue)


def setup() -> None:
    """The ``dramatiq`` command's broker hook: ``dramatiq flask_mail_outbox.contrib.dramatiq:setup``.

    Loads the app as ``flask`` does (``FLASK_APP``) unless this process made
    one already; its ``init_app`` declares the actors and sets the broker.
    """
    executor(_worker_app())


def _worker_app() -> Flask:
    """This process's app: one it made, else ``FLASK_APP`` loaded as ``flask`` loads it."""
    return executors.task_app()


def executor(app: Flask) -> DramatiqExecutor:
    """``app``'s Dramatiq executor; :class:`ConfigError` when its OUTBOX_EXECUTOR is not dramatiq."""
    state = app.extensions.get(EXTENSION_KEY)
    found = getattr(state, "executor", None)
    if not isinstance(found, DramatiqExecutor):
        raise ConfigError("OUTBOX_EXECUTOR",
                          f"app {app.import_name!r} does not deliver on Dramatiq "
                          f"(OUTBOX_EXECUTOR = {getattr(found, 'name', 'dispatcher')!r})")
    return found


def send_sweep(app: Flask | None = None) -> bool:
    """Publish one ``flask_mail_outbox.sweep`` message; False when the broker refused.

    A refusal is reported once at ERROR (and its end at INFO) for the outage,
    not once per attempt: the next period tries again.
    """
    target = executors.task_app(app)
    found = executor(target)
    faults = target.extensions[EXTENSION_KEY].faults
    try:
        found.publish_sweep()
    except Exception as exc:  # noqa: BLE001 - reported; the next period sends it again
        faults.failing(
            "executor-sweep-dramatiq", "Could not publish the periodic sweep task to Dramatiq",
            consequence="retries, send_after emails, expired leases and lost doorbells wait "
                        "for the next period; nothing is lost",
            fix="check that the Dramatiq broker (OUTBOX_EXECUTOR_URL, or the app's broker) is "
                "up and reachable from the process that runs the schedule",
            exc=exc)
        return False
    faults.recovered("executor-sweep-dramatiq")
    return True


def sweep_interval(app: Flask) -> float:
    """OUTBOX_SWEEP_INTERVAL_SECONDS, else :data:`SWEEP_INTERVAL`."""
    configured = app.extensions[EXTENSION_KEY].config.sweep_interval_seconds
    return float(configured) if configured else SWEEP_INTERVAL


def schedule_sweep(app: Flask, scheduler: BaseScheduler, *,
                   interval: float | None = None) -> Any:
    """Add the periodic sweep to an APScheduler ``scheduler``; returns the job.

    Every ``interval`` seconds (default :func:`sweep_interval`) it publishes
    one sweep message (:func:`send_sweep`). Run it in ONE process (several
    publish more sweeps, harmlessly).
    """
    every = sweep_interval(app) if interval is None else float(interval)
    if every <= 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    return scheduler.add_job(send_sweep, "interval", seconds=every, kwargs={"app": app},
                             id="flask_mail_outbox.sweep", replace_existing=True,
                             max_instances=1, coalesce=True)


def sweeper() -> None:
    """A Dramatiq fork function running the periodic sweep (blocks until SIGTERM).

    ``dramatiq flask_mail_outbox.contrib.dramatiq:setup --fork-function
    flask_mail_outbox.contrib.dramatiq:sweeper``: the command's main process
    forks it beside the workers and stops it with them.
    """
    from apscheduler.schedulers.blocking import BlockingScheduler

    app = _worker_app()
    executor(app)
    scheduler = BlockingScheduler(timezone="UTC")
    schedule_sweep(app, scheduler)
    logger.info("Publishing flask_mail_outbox.sweep every %.0f s", sweep_interval(app))
    scheduler.start()


__all__ = ["DELIVER", "SWEEP", "DramatiqExecutor", "declare", "deliver", "executor",
           "publisher", "schedule_sweep", "send_sweep", "setup", "sweep", "sweep_interval",
           "sweeper"]
