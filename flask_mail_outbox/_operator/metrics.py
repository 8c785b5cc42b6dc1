"""Prometheus metrics, an optional extra (``pip install 'flask-mail-outbox[metrics]'``).

``mail.init_metrics(registry=None)`` registers, on the registry the app
passes (prometheus_client's default ``REGISTRY`` otherwise), and starts no
server: the app's existing ``/metrics`` exposes them.

* Counters fed by the library's signals, so they count what this process did:
  ``outbox_emails_queued_total`` (committed), ``outbox_emails_sent_total``,
  ``outbox_emails_failed_total`` (dead-lettered).
* ``outbox_email_delivery_seconds``: a histogram of ``created_at`` (``send()``;
  on PostgreSQL the start of its transaction) to the server's acceptance,
  observed when this process delivers.
* Gauges read from the database at scrape time by :class:`QueueCollector`, so
  they describe every process sharing it: ``outbox_queue_depth{status}``,
  ``outbox_oldest_queued_age_seconds`` (from ``created_at``, as ``status``),
  ``outbox_oldest_due_age_seconds`` (from the due time, as health: the one to
  alert on), ``outbox_dead_letters``, ``outbox_transport_paused{transport,kind}``
  (1 while a transport is paused by a fault of its own, with the fault's kind;
  0 with kind "" otherwise), ``outbox_transport_paused_seconds{transport}``
  (how long it has been paused, 0 if not), and ``outbox_database_up`` (0 when
  those reads failed).

One set of metrics exists per registry. Registering an app twice, or a
second app on the same registry (a test suite's app per test), adds its
signals to the same counters; the gauges follow the app registered last.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

try:
    import prometheus_client
    from prometheus_client import Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # the optional extra: say which one
    raise ImportError(
        "flask-mail-outbox's metrics need prometheus_client, which is not installed: "
        "pip install 'flask-mail-outbox[metrics]'") from exc

from .._flask.signals import email_failed, email_queued, email_sent
from .._flask.state import AppState
from ..core._internal import PauseStore, Status, utcnow

if TYPE_CHECKING:
    from flask import Flask

#: Enqueue-to-sent latency buckets, seconds: from an idle outbox's prompt
#: delivery to hours of retries.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0, 900.0, 3600.0, 4 * 3600.0, float("inf"))


class QueueCollector(Collector):
    """Gauges read from the database at scrape time (one statement of the queue per
    scrape, and one of ``outbox_rate``, a row per transport, for the paused ones)."""

    def __init__(self) -> None:
        self._state: weakref.ref[AppState] | None = None

    def follow(self, state: AppState) -> None:
        """Report ``state``'s database from now on."""
        self._state = weakref.ref(state)

    def describe(self) -> Iterator[Metric]:
        """The gauges' names, without a query: the registry refuses a name taken twice."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        """Query the database once and yield the gauges."""
        state = self._state() if self._state is not None else None
        if state is None:
            return  # the app is gone
        families = self._families()
        up, depth, oldest, due, dead, paused, paused_for = families
        try:
            row = state.outbox().reader.queue_figures()
            pauses = PauseStore(state.outbox().store).all()
        except Exception as exc:  # noqa: BLE001 - reported; the scrape says so (up = 0)
            state.faults.failing(
                "metrics-database", "The metrics scrape could not query the outbox tables",
                consequence="outbox_database_up is 0 and the queue gauges are missing "
                            "until the database answers",
                fix="check the database connection and that the outbox tables exist",
                exc=exc)
            up.add_metric([], 0.0)
            yield up
            return
        state.faults.recovered("metrics-database")
        up.add_metric([], 1.0)
        depth.add_metric([Status.QUEUED.value], float(row.queued))
        depth.add_metric([Status.SENDING.value], float(row.sending))
        oldest.add_metric([], _age(row.now, row.oldest))
        due.add_metric([], _age(row.now, row.earliest_due))
        dead.add_metric([], float(row.failed))
        for name in state.config.transport_names:
            pause = pauses.get(name)
            paused.add_metric([name, pause.kind if pause else ""], 1.0 if pause else 0.0)
            paused_for.add_metric([name], _age(row.now, pause.since if pause else None))
        yield from families

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("outbox_database_up",
                              "1 when the last scrape could read the outbox tables"),
            GaugeMetricFamily("outbox_queue_depth",
                              "Emails not finished yet, by status (queued, sending)",
                              labels=["status"]),
            GaugeMetricFamily("outbox_oldest_queued_age_seconds",
                              "Seconds since the oldest queued email was queued, scheduled "
                              "ones included (0 if none)"),
            GaugeMetricFamily("outbox_oldest_due_age_seconds",
                              "Seconds the longest-waiting due email has been due, as health "
                              "counts it (0 if none)"),
            GaugeMetricFamily("outbox_dead_letters", "Dead-lettered (failed) emails"),
            GaugeMetricFamily("outbox_transport_paused",
                              "1 while a transport is paused by a fault of its own (its "
                              "emails wait), by transport and the fault's kind",
                              labels=["transport", "kind"]),
            GaugeMetricFamily("outbox_transport_paused_seconds",
                              "Seconds a transport has been paused (0 if it is not)",
                              labels=["transport"]),
        ]


def _age(now: datetime, oldest: datetime | None) -> float:
    return 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())


class OutboxMetrics:
    """The outbox's metrics on one registry, fed by the apps registered on it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queued = Counter("outbox_emails_queued_total",
                              "Emails committed to the outbox by this process",
                              registry=registry)
        self.sent = Counter("outbox_emails_sent_total",
                            "Emails this process delivered (accepted by the server)",
                            registry=registry)
        self.failed = Counter("outbox_emails_failed_total",
                              "Emails this process dead-lettered (failed for good)",
                              registry=registry)
        self.latency = Histogram("outbox_email_delivery_seconds",
                                 "Seconds from send() to the server accepting the email",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.collector = QueueCollector()
        registry.register(self.collector)

    def add_app(self, state: AppState) -> None:
        """Count ``state``'s app's signals and follow its database.

        Blinker keeps one connection per receiver and sender, so adding an
        app twice counts its emails once.
        """
        app = state.app
        email_queued.connect(self._on_queued, sender=app, weak=False)
        email_sent.connect(self._on_sent, sender=app, weak=False)
        email_failed.connect(self._on_failed, sender=app, weak=False)
        self.collector.follow(state)

    def _on_queued(self, sender: Flask, **_: Any) -> None:
        self.queued.inc()

    def _on_sent(self, sender: Flask, *, created_at: datetime | None = None,
                 **_: Any) -> None:
        self.sent.inc()
        if created_at is not None:
            self.latency.observe(max(0.0, (utcnow() - created_at).total_seconds()))

    def _on_failed(self, sender: Flask, **_: Any) -> None:
        self.failed.inc()


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, OutboxMetrics] = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


def install(state: AppState, registry: CollectorRegistry | None) -> None:
    """Register the outbox's metrics for ``state``'s app on ``registry`` (idempotent)."""
    if registry is None:
        registry = prometheus_client.REGISTRY
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = OutboxMetrics(registry)
        metrics.add_app(state)
