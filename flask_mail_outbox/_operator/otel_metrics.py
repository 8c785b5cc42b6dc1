"""OpenTelemetry metrics (the ``otel`` extra, ``opentelemetry-api`` only), next to the
Prometheus ones of :mod:`.metrics` and from the same sources: the library's signals
for what this process did, and one read of the database per collection for what
every process sharing it sees.

On the meter ``flask_mail_outbox`` of the app's meter provider (``OUTBOX_OTEL``'s
``"meter_provider"``, or the global one), when ``OUTBOX_OTEL["metrics"]`` is True, or
``"auto"`` (the default) and a meter provider other than the API's default is set
when the app is registered:

* counters ``outbox.emails.queued``, ``outbox.emails.sent``, ``outbox.emails.failed``
  (``{email}``): committed, delivered, dead-lettered by this process;
* the histogram ``outbox.email.delivery.duration`` (``s``): ``created_at`` to the
  server's acceptance, observed when this process delivers;
* observable gauges read at collection: ``outbox.queue.depth`` (``{email}``, by
  ``outbox.status``: ``queued``, ``sending``), ``outbox.queue.oldest_due_age``
  (``s``: how long the longest-waiting due email has been due, as health counts it)
  and ``outbox.transport.paused`` (1 while a transport is paused by a fault of its
  own, by ``outbox.transport`` and ``outbox.pause.kind``; 0 otherwise).

A process that never imported ``opentelemetry`` has no meter provider set: with
``"auto"`` nothing is imported or registered then.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .._flask.signals import email_failed, email_queued, email_sent
from .._flask.state import AppState
from ..core._internal import PauseStore, utcnow

if TYPE_CHECKING:
    from flask import Flask

#: The meter's name (the instrumentation scope).
METER = "flask_mail_outbox"
#: Seconds one read of the database serves every gauge of a collection.
READ_FOR = 1.0


def meter_provider(settings: Any) -> Any:
    """The meter provider ``OUTBOX_OTEL`` asks for, or None: OTel metrics are off."""
    if settings.metrics is False:
        return None
    if settings.meter_provider is not None:
        return settings.meter_provider
    api: Any = sys.modules.get("opentelemetry.metrics")
    if api is None:
        if settings.metrics != True:
            return None  # never imported: no meter provider can have been set
        import opentelemetry.metrics

        api = opentelemetry.metrics
    provider = api.get_meter_provider()
    # The API's defaults: its proxy (none set) and the no-op one.
    if settings.metrics == "auto" and type(provider).__name__ in (
            "_ProxyMeterProvider", "NoOpMeterProvider"):
        return None
    return provider


def install(state: AppState) -> None:
    """The OTel metrics of ``state``'s app, when ``OUTBOX_OTEL`` turns them on."""
    provider = meter_provider(state.config.otel)
    if provider is None:
        return
    with _lock:
        instruments = _by_provider.get(provider)
        if instruments is None:
            instruments = _by_provider[provider] = Instruments(provider.get_meter(METER))
    instruments.add_app(state)


_by_provider: weakref.WeakKeyDictionary[Any, Instruments] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Instruments:
    """The outbox's instruments on one meter, fed by the apps registered on it."""

    def __init__(self, meter: Any) -> None:
        self.queued = meter.create_counter(
            "outbox.emails.queued", unit="{email}",
            description="Emails committed to the outbox by this process")
        self.sent = meter.create_counter(
            "outbox.emails.sent", unit="{email}",
            description="Emails this process delivered (accepted by the server)")
        self.failed = meter.create_counter(
            "outbox.emails.failed", unit="{email}",
            description="Emails this process dead-lettered (failed for good)")
        self.latency = meter.create_histogram(
            "outbox.email.delivery.duration", unit="s",
            description="Seconds from send() to the server accepting the email")
        self._state: weakref.ref[AppState] | None = None
        self._read: tuple[float, Any, dict[str, Any]] | None = None
        self._read_lock = threading.Lock()
        meter.create_observable_gauge(
            "outbox.queue.depth", [self._depth], unit="{email}",
            description="Emails not finished yet, by status (queued, sending)")
        meter.create_observable_gauge(
            "outbox.queue.oldest_due_age", [self._oldest_due], unit="s",
            description="Seconds the longest-waiting due email has been due (0 if none)")
        meter.create_observable_gauge(
            "outbox.transport.paused", [self._paused],
            description="1 while a transport is paused by a fault of its own, by transport "
                        "and the fault's kind")

    def add_app(self, state: AppState) -> None:
        """Count ``state``'s app's signals and follow its database (the gauges follow
        the app added last, as the Prometheus collector does)."""
        app = state.app
        email_queued.connect(self._on_queued, sender=app, weak=False)
        email_sent.connect(self._on_sent, sender=app, weak=False)
        email_failed.connect(self._on_failed, sender=app, weak=False)
        self._state = weakref.ref(state)

    def _on_queued(self, sender: Flask, **_: Any) -> None:
        self.queued.add(1)

    def _on_sent(self, sender: Flask, *, created_at: datetime | None = None,
                 **_: Any) -> None:
        self.sent.add(1)
        if created_at is not None:
            self.latency.record(max(0.0, (utcnow() - created_at).total_seconds()))

    def _on_failed(self, sender: Flask, **_: Any) -> None:
        self.failed.add(1)

    # -- the gauges: one read of the database serves a collection -------------------------

    def _figures(self) -> tuple[AppState, Any, dict[str, Any]] | None:
        state = self._state() if self._state is not None else None
        if state is None:
            return None
        with self._read_lock:
            read = self._read
            if read is None or time.monotonic() - read[0] > READ_FOR:
                try:
                    figures = state.outbox().reader.queue_figures()
                    pauses = PauseStore(state.outbox().store).all()
                except Exception as exc:  # noqa: BLE001 - reported; the gauges are missing
                    state.faults.failing(
                        "otel-metrics-database",
                        "The OpenTelemetry metrics could not query the outbox tables",
                        consequence="the queue gauges are missing from this collection "
                                    "until the database answers",
                        fix="check the database connection and that the outbox tables exist",
                        exc=exc)
                    return None
                state.faults.recovered("otel-metrics-database")
                read = self._read = (time.monotonic(), figures, pauses)
        return state, read[1], read[2]

    def _depth(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        read = self._figures()
        if read is not None:
            _, figures, _ = read
            yield Observation(figures.queued, {"outbox.status": "queued"})
            yield Observation(figures.sending, {"outbox.status": "sending"})

    def _oldest_due(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        read = self._figures()
        if read is not None:
            _, figures, _ = read
            yield Observation(_age(figures.now, figures.earliest_due))

    def _paused(self, options: Any) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        read = self._figures()
        if read is not None:
            state, _, pauses = read
            for name in state.config.transport_names:
                pause = pauses.get(name)
                yield Observation(1 if pause else 0, {"outbox.transport": name,
                                                      "outbox.pause.kind": pause.kind
                                                      if pause else ""})


def _age(now: datetime, oldest: datetime | None) -> float:
    return 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())
