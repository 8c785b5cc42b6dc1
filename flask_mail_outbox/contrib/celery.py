"""Delivery on Celery workers: ``OUTBOX_EXECUTOR = "celery"`` (docs/executors/celery.md).

The app publishes, after each commit, one task ``flask_mail_outbox.deliver``
naming the ids of the emails it queued, to the queue ``OUTBOX_EXECUTOR_QUEUE``,
through the Celery app the Flask app already has. A Celery worker that imports
the Flask app (its factory) runs the task: the outbox's own claim of those ids,
the send, the record (``_flask.executors.deliver_task``). The periodic task
``flask_mail_outbox.sweep`` (``celery beat``: :func:`beat_schedule`) publishes
what is due again: retries, ``send_after``, expired leases, lost doorbells.

Which Celery app publishes: ``app.extensions["celery"]`` (where the Flask
docs' ``celery_init_app`` puts it), else Celery's current app if it has a
broker configured; else :class:`ConfigError` naming ``OUTBOX_EXECUTOR``.

The tasks are declared with :func:`celery.shared_task`, so every Celery app of
the process has them once this module is imported (``init_app`` imports it
when ``OUTBOX_EXECUTOR = "celery"``). Both ignore their results, never retry
through Celery, and are acknowledged early (``acks_late=False``): the broker is
a doorbell, and a task lost with its worker is recovered by the outbox (the
lease expires, the sweep publishes the row again), not by the broker. A task
delivered twice (Redis redelivers unacknowledged messages after its
``visibility_timeout``, kombu #337) claims nothing the second time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

# Celery ships no type information (a pyproject mypy override is proposed).
from celery import Celery, shared_task
from celery import current_app as celery_current_app
from flask import Flask

from .._errors import ConfigError
from .._flask import executors

logger = logging.getLogger(__name__)

#: The task that claims, delivers and records the emails whose ids it names.
DELIVER = "flask_mail_outbox.deliver"
#: The periodic task that publishes what is due (run it from ``celery beat``).
SWEEP = "flask_mail_outbox.sweep"

#: Brokers whose kombu transport consumes the LOWEST priority number first
#: (kombu's Redis transport: one list per priority step, read 0 first).
LOW_NUMBER_FIRST = frozenset({"redis", "rediss", "sentinel", "valkey", "valkeys"})
#: Brokers whose priority is the AMQP one: the HIGHEST number first (a queue
#: declared with ``x-max-priority``; elsewhere the priority is ignored).
HIGH_NUMBER_FIRST = frozenset({"amqp", "amqps", "pyamqp", "librabbitmq"})

#: (urgent, normal) priorities per kind of broker; None: sent without one.
PRIORITIES: dict[str, tuple[int | None, int | None]] = {
    "low-first": (0, 6),
    "high-first": (9, None),
    "none": (None, None),
}


def find_celery(app: Flask) -> Celery:
    """The Celery app that publishes for ``app`` (see the module docstring).

    :class:`ConfigError` naming ``OUTBOX_EXECUTOR`` when there is none with a broker.
    """
    found = app.extensions.get("celery")
    if found is not None:
        if not isinstance(found, Celery):
            raise ConfigError(
                "OUTBOX_EXECUTOR",
                f"'celery' needs a Celery app at app.extensions['celery'], found "
                f"{type(found).__name__}: store the celery.Celery instance there "
                f"(as the Flask docs' celery_init_app does)")
        return found
    default: Celery = celery_current_app._get_current_object()
    if broker_url(default):
        return default
    raise ConfigError(
        "OUTBOX_EXECUTOR",
        "'celery' needs a Celery app with a broker: create it before OutboxMail(app) / "
        "init_app(app) and store it at app.extensions['celery'] (the Flask docs' "
        "celery_init_app does, with app.config['CELERY'] = {'broker_url': "
        "'redis://127.0.0.1:6379/0', ...}), or configure the current Celery app's "
        "broker_url; see docs/executors/celery.md")


def broker_url(celery: Celery) -> str | None:
    """The URL ``celery`` publishes to (its write URL), None when none is configured."""
    conf = celery.conf
    url = conf.broker_write_url or conf.broker_url
    return str(url) if url else None


def broker_kind(celery: Celery) -> str:
    """How ``celery``'s broker orders priorities: "low-first", "high-first" or "none"."""
    url = broker_url(celery) or ""
    scheme = urlsplit(url.split(";")[0]).scheme.lower().split("+")[0]
    if scheme in LOW_NUMBER_FIRST:
        return "low-first"
    if scheme in HIGH_NUMBER_FIRST:
        return "high-first"
    return "none"


class CeleryExecutor:
    """Publishes ``flask_mail_outbox.deliver`` tasks through a Celery app (the seam's Executor)."""

    name = "celery"
    sweep_task = SWEEP

    def __init__(self, celery: Celery, queue: str) -> None:
        self.celery = celery
        self.queue = queue
        self.urgent_priority, self.normal_priority = PRIORITIES[broker_kind(celery)]

    def publish(self, ids: Sequence[int], *, urgent: bool = False) -> None:
        """One task naming ``ids``; raises when the broker refused it (after Celery's
        own publish retries: ``task_publish_retry_policy``)."""
        options: dict[str, Any] = {}
        priority = self.urgent_priority if urgent else self.normal_priority
        if priority is not None:
            options["priority"] = priority
        self.celery.send_task(DELIVER, args=([int(i) for i in ids],), queue=self.queue,
                              ignore_result=True, add_to_parent=False, **options)


def publisher(app: Flask) -> CeleryExecutor:
    """The executor of ``app`` (called by ``init_app`` through ``_flask.executors.load``)."""
    state = app.extensions.get("mail_outbox")
    # init_app calls this before it registers its state: the queue comes from the config.
    queue = (state.config.executor_queue if state is not None
             else app.config.get("OUTBOX_EXECUTOR_QUEUE") or "outbox")
    return CeleryExecutor(find_celery(app), str(queue))


def deliver_ids(ids: list[int]) -> dict[str, int]:
    """Claim ``ids``, deliver what was claimed, record; counts (never raises for mail)."""
    return executors.deliver_task(ids)


def sweep_due() -> dict[str, int]:
    """Publish what is due (retries, send_after, expired leases, lost doorbells); counts."""
    return executors.sweep_task()


#: The task options of both: results ignored (the counts are in the worker's log), no
#: Celery retries, early acknowledgement (the lease and the sweep recover a lost task).
TASK_OPTIONS: dict[str, Any] = {"ignore_result": True, "acks_late": False, "max_retries": 0,
                                "autoretry_for": ()}
#: ``flask_mail_outbox.deliver``: one argument, the list of ids.
deliver = shared_task(name=DELIVER, **TASK_OPTIONS)(deliver_ids)
#: ``flask_mail_outbox.sweep``: no argument.
sweep = shared_task(name=SWEEP, **TASK_OPTIONS)(sweep_due)


def beat_schedule(seconds: float = 30.0, *, queue: str = "outbox") -> dict[str, dict[str, Any]]:
    """The ``celery beat`` entry of the sweep task: merge it into ``beat_schedule``.

    ``celery.conf.beat_schedule.update(beat_schedule(30))``, or
    ``CELERY = {"beat_schedule": beat_schedule(30), ...}``. ``queue``: the
    app's ``OUTBOX_EXECUTOR_QUEUE``. A sweep not started within ``seconds``
    expires (the next one comes): sweeps never pile up behind a stopped worker.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    return {SWEEP: {"task": SWEEP, "schedule": float(seconds),
                    "options": {"queue": queue, "expires": float(seconds)}}}


__all__ = ["DELIVER", "SWEEP", "TASK_OPTIONS", "CeleryExecutor", "beat_schedule", "broker_kind",
           "deliver", "deliver_ids", "find_celery", "publisher", "sweep", "sweep_due"]
