"""OpenTelemetry tracing (the ``otel`` extra, ``opentelemetry-api`` only).

``send()`` / ``send_many()`` open a PRODUCER span per email in the caller's
trace and store its W3C trace context (``traceparent``, ``tracestate``) on the
row; each delivery attempt opens a CONSUMER span in the worker's own trace,
linked to that context (or its child: ``OUTBOX_OTEL = {"link": "child"}``).

``opentelemetry`` is imported only here, and only when tracing is on: with
``"enabled": "auto"`` (the default) tracing is on when the app has set a tracer
provider other than the API's default, and a process that never imported
``opentelemetry`` has none, so the send path then costs one dictionary look-up.
No span carries an address, a subject or a body; ``"recipient_domain": True``
adds the domains of the recipients to the CONSUMER span.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from . import _degrade
from ._errors import ConfigError

KEY = "OUTBOX_OTEL"
#: ``messaging.system`` of every span.
SYSTEM = "flask-mail-outbox"
#: The attributes of this library's own that no convention names yet.
ATTEMPT = "flask_mail_outbox.attempt"
OUTCOME = "flask_mail_outbox.outcome"
REPLY_CODE = "flask_mail_outbox.reply_code"
RECIPIENT_DOMAINS = "flask_mail_outbox.recipient_domains"

_KEYS = ("enabled", "link", "recipient_domain", "tracer_provider")


@dataclasses.dataclass(frozen=True)
class TracingSettings:
    """``OUTBOX_OTEL``, validated."""

    #: True, False, or "auto": on when a tracer provider is set.
    enabled: bool | str = "auto"
    #: "link": the CONSUMER span links to the producer's context; "child": its child.
    link: str = "link"
    #: Add the recipients' domains (never an address) to the CONSUMER span.
    recipient_domain: bool = False
    #: The tracer provider to use (None: the global one, ``trace.set_tracer_provider``).
    tracer_provider: Any = dataclasses.field(default=None, compare=False, repr=False)


def settings_from(value: Any) -> TracingSettings:
    """``OUTBOX_OTEL`` as :class:`TracingSettings`; :class:`ConfigError` naming the key."""
    if value is None:
        return TracingSettings()
    if not isinstance(value, Mapping):
        raise ConfigError(KEY, f"expected a dict such as {{'enabled': 'auto', 'link': 'link'}}, "
                               f"got {value!r}")
    unknown = sorted(str(key) for key in value if key not in _KEYS)
    if unknown:
        raise ConfigError(KEY, f"unknown key {unknown[0]!r}: the keys are "
                               f"{', '.join(_KEYS)}")
    enabled = value.get("enabled", "auto")
    if not (isinstance(enabled, bool) or enabled == "auto"):
        raise ConfigError(KEY, f"'enabled' must be True, False or 'auto', got {enabled!r}")
    link = value.get("link", "link")
    if link not in ("link", "child"):
        raise ConfigError(KEY, f"'link' must be 'link' or 'child', got {link!r}")
    domain = value.get("recipient_domain", False)
    if not isinstance(domain, bool):
        raise ConfigError(KEY, f"'recipient_domain' must be True or False, got {domain!r}")
    provider = value.get("tracer_provider")
    if provider is not None and not callable(getattr(provider, "get_tracer", None)):
        raise ConfigError(KEY, f"'tracer_provider' must be an OpenTelemetry TracerProvider "
                               f"or None, got {type(provider).__name__}")
    if enabled is True and provider is None:
        try:
            import opentelemetry.trace  # noqa: F401
        except ImportError:
            raise ConfigError(KEY, "'enabled' is True but opentelemetry-api is not installed: "
                                   "pip install 'flask-mail-outbox[otel]'") from None
    return TracingSettings(enabled=enabled, link=link, recipient_domain=domain,
                           tracer_provider=provider)


def tracer(settings: TracingSettings) -> Any:
    """The tracer to use now, or None: tracing is off (nothing imported for that)."""
    if settings.enabled is False:
        return None
    if settings.tracer_provider is not None:
        return _tracer_of(settings.tracer_provider)
    trace: Any = sys.modules.get("opentelemetry.trace")
    if trace is None:  # never imported: no provider can have been set
        if settings.enabled != True:
            return None
        import opentelemetry.trace

        trace = opentelemetry.trace
    provider = trace.get_tracer_provider()
    if settings.enabled == "auto" and isinstance(
            provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return _tracer_of(provider)


#: The tracer of each provider (the SDK makes a new one per get_tracer() call).
_TRACERS: dict[int, tuple[Any, Any]] = {}


def _tracer_of(provider: Any) -> Any:
    known = _TRACERS.get(id(provider))
    if known is not None and known[0] is provider:
        return known[1]
    tracer = provider.get_tracer("flask_mail_outbox")
    if len(_TRACERS) > 16:  # providers made and dropped (tests): never grows without bound
        _TRACERS.clear()
    _TRACERS[id(provider)] = (provider, tracer)
    return tracer


def producer_spans(tracer: Any, values: Sequence[dict[str, Any]]) -> ProducerSpans | None:
    """The PRODUCER spans of one ``send()`` / ``send_many()``, their contexts put in
    ``values``; None, reported, when the tracer fails: the rows go untraced (NULL)."""
    try:
        return ProducerSpans(tracer, values)
    except Exception as exc:  # noqa: BLE001 - reported; sending must not fail for a span
        for row in values:
            row.pop("traceparent", None)
            row.pop("tracestate", None)
        _degrade.report(
            f"Could not open the PRODUCER span of {len(values)} email(s) being queued",
            consequence="they are queued untraced: no span, and their delivery spans "
                        "link to nothing",
            fix="check the app's OpenTelemetry span processors (the traceback below names "
                "the failing one)",
            exc=exc)
        return None


class ProducerSpans:
    """The PRODUCER spans of one ``send()`` / ``send_many()``, one per row."""

    def __init__(self, tracer: Any, values: Sequence[dict[str, Any]]) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        operation = "send" if len(values) == 1 else "create"
        propagator = TraceContextTextMapPropagator()
        self._spans = []
        for row in values:
            transport = str(row.get("transport") or "default")
            attributes: dict[str, Any] = {
                "messaging.system": SYSTEM, "messaging.operation.name": operation,
                "messaging.operation.type": operation,
                "messaging.destination.name": transport}
            if row.get("key"):
                attributes["messaging.message.conversation_id"] = str(row["key"])
            span = tracer.start_span(f"{operation} {transport}", kind=trace.SpanKind.PRODUCER,
                                     attributes=attributes)
            carrier: dict[str, str] = {}
            propagator.inject(carrier, context=trace.set_span_in_context(span))
            row["traceparent"] = carrier.get("traceparent")
            row["tracestate"] = carrier.get("tracestate") or None
            self._spans.append(span)

    def end(self, email_ids: Sequence[int] | None, error: BaseException | None = None) -> None:
        """End them, with the ids the rows got (None: the insert failed with ``error``);
        never raises (a failure is reported)."""
        from opentelemetry.trace import Status, StatusCode

        try:
            for index, span in enumerate(self._spans):
                if email_ids is not None:
                    span.set_attribute("messaging.message.id", str(email_ids[index]))
                if error is not None:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, type(error).__name__))
                span.end()
        except Exception as exc:  # noqa: BLE001 - reported; the rows are queued
            _degrade.report(
                f"Could not end the PRODUCER spans of {len(self._spans)} email(s) queued",
                consequence="those spans are missing from the trace; the emails are queued "
                            "with their trace context and delivered as usual",
                fix="check the app's OpenTelemetry span processors (the traceback below "
                    "names the failing one)",
                exc=exc)


def consumer_span(tracer: Any, settings: TracingSettings, *, email_id: int, attempt: int,
                  transport: str, key: str | None, traceparent: str | None,
                  tracestate: str | None, outcome: str, reply_code: int,
                  server: tuple[str, int] | None, recipients: Sequence[str],
                  start_time: int | None, failed: bool,
                  record: tuple[int, int] | None = None) -> None:
    """One CONSUMER span for one recorded delivery attempt, from ``start_time`` (its
    claim) to now; ``record``: the start and end (ns) of the transaction that recorded
    it (its batch's), a child span ``record``."""
    from opentelemetry import trace
    from opentelemetry.trace import Link, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.operation.name": "process",
        "messaging.operation.type": "process", "messaging.destination.name": transport,
        "messaging.message.id": str(email_id), ATTEMPT: attempt, OUTCOME: outcome}
    if key:
        attributes["messaging.message.conversation_id"] = key
    if reply_code:
        attributes[REPLY_CODE] = reply_code
    if server is not None:
        attributes["server.address"], attributes["server.port"] = server
    if settings.recipient_domain:
        attributes[RECIPIENT_DOMAINS] = sorted({address.rpartition("@")[2].lower()
                                                for address in recipients})
    context = None
    links = []
    if traceparent:
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        produced = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier))
        producer = produced.get_span_context()
        if producer.is_valid:
            if settings.link == "child":
                context = trace.set_span_in_context(produced)
            else:
                links.append(Link(producer))
                # The worker's own trace: not the caller's, whatever is current here.
                context = trace.set_span_in_context(trace.INVALID_SPAN)
    elif settings.link == "link":
        context = trace.set_span_in_context(trace.INVALID_SPAN)
    if start_time is None and record is not None:  # not seen claimed: from its record
        start_time = record[0]
    span = tracer.start_span(f"process {transport}", context=context,
                             kind=trace.SpanKind.CONSUMER, attributes=attributes, links=links,
                             start_time=start_time)
    if record is not None:
        tracer.start_span("record", context=trace.set_span_in_context(span),
                          kind=trace.SpanKind.INTERNAL, start_time=record[0]).end(record[1])
    if failed:
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()
