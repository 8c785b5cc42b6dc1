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
import re
import sys
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

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

_KEYS = ("enabled", "link", "recipient_domain", "tracer_provider", "metrics",
         "meter_provider")


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
    #: OpenTelemetry metrics: True, False, or "auto": on when a meter provider is set
    #: when the app is registered (see flask_mail_outbox/_operator/otel_metrics.py).
    metrics: bool | str = "auto"
    #: The meter provider to use (None: the global one, ``metrics.set_meter_provider``).
    meter_provider: Any = dataclasses.field(default=None, compare=False, repr=False)


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
    metrics = value.get("metrics", "auto")
    if not (isinstance(metrics, bool) or metrics == "auto"):
        raise ConfigError(KEY, f"'metrics' must be True, False or 'auto', got {metrics!r}")
    meters = value.get("meter_provider")
    if meters is not None and not callable(getattr(meters, "get_meter", None)):
        raise ConfigError(KEY, f"'meter_provider' must be an OpenTelemetry MeterProvider "
                               f"or None, got {type(meters).__name__}")
    if metrics is True and meters is None:
        try:
            import opentelemetry.metrics
        except ImportError:
            raise ConfigError(KEY, "'metrics' is True but opentelemetry-api is not installed: "
                                   "pip install 'flask-mail-outbox[otel]'") from None
    if enabled is True and provider is None:
        try:
            import opentelemetry.trace  # noqa: F401
        except ImportError:
            raise ConfigError(KEY, "'enabled' is True but opentelemetry-api is not installed: "
                                   "pip install 'flask-mail-outbox[otel]'") from None
    return TracingSettings(enabled=enabled, link=link, recipient_domain=domain,
                           tracer_provider=provider, metrics=metrics, meter_provider=meters)


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
        try:
            for index, span in enumerate(self._spans):
                if email_ids is not None and span.is_recording():
                    span.set_attribute("messaging.message.id", str(email_ids[index]))
                if error is not None:
                    failed(span, error)
                span.end()
        except Exception as exc:  # noqa: BLE001 - reported; the rows are queued
            _degrade.report(
                f"Could not end the PRODUCER spans of {len(self._spans)} email(s) queued",
                consequence="those spans are missing from the trace; the emails are queued "
                            "with their trace context and delivered as usual",
                fix="check the app's OpenTelemetry span processors (the traceback below "
                    "names the failing one)",
                exc=exc)


def failed(span: Any, error: BaseException) -> None:
    """Mark ``span`` failed with ``error``: an ``exception`` event naming its type, the
    status ERROR. Not ``record_exception()``: its message and stack trace can hold
    addresses and content (a refused RCPT's reply, a failed INSERT's parameters), and
    no span carries those."""
    from opentelemetry.trace import Status, StatusCode

    kind = type(error)
    span.add_event("exception", {"exception.type": f"{kind.__module__}.{kind.__qualname__}"})
    span.set_status(Status(StatusCode.ERROR, kind.__name__))


#: The ``traceparent`` :class:`ProducerSpans` writes (version 00), parsed without a
#: propagator: the claim reads one per email, and this is a quarter of its cost.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def producer_context(traceparent: str | None, tracestate: str | None) -> Any:
    """The PRODUCER span's context stored on a row (a non-recording span), or None."""
    if not traceparent:
        return None
    from opentelemetry import trace

    match = _TRACEPARENT.fullmatch(traceparent)
    if match is None:  # another version: the propagator knows them all
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        produced = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier))
        return produced if produced.get_span_context().is_valid else None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not (trace_id and span_id):
        return None
    state = trace.TraceState.from_header([tracestate]) if tracestate else None
    return trace.NonRecordingSpan(trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(match[3], 16)),
        trace_state=state))


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One delivery attempt under way, traced: its live CONSUMER span."""

    tracer: Any
    span: Any
    #: The span of the claim statement that took the email (None: not seen claimed).
    claim: Any
    #: The PRODUCER span (non-recording, read from the row), or None: queued untraced.
    producer: Any
    #: The transport's name (``messaging.destination.name``).
    transport: str


#: The attempts under way in this process, by (email id, Message-ID): what the
#: transports' spans (:func:`sending`) and DKIM's (:func:`signed`) open under.
#: Empty whenever tracing is off, so those cost one truth test then.
LIVE: dict[tuple[int, str], Attempt] = {}


def _attributes(operation: str, transport: str, email_id: int | None = None,
                key: str | None = None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.operation.name": operation,
        "messaging.operation.type": _OPERATION_TYPES.get(operation, operation),
        "messaging.destination.name": transport}
    if email_id is not None:
        attributes["messaging.message.id"] = str(email_id)
    if key:
        attributes["messaging.message.conversation_id"] = key
    return attributes


#: ``messaging.operation.type`` of an operation name that is none of the convention's.
_OPERATION_TYPES = {"claim": "receive", "event": "process", "record": "settle"}


def claim(tracer: Any, settings: TracingSettings, claimed: Sequence[Any], *,
          started: int | None, server: Any) -> None:
    """The span of one claim statement (from ``started`` to now, in the worker's own
    trace, linked to every claimed email's PRODUCER span) and a live CONSUMER span for
    each email it took (put in :data:`LIVE`): a child of the claim span, linked to
    its producer (``"link": "child"``: the producer's child, linked to the claim span).

    ``claimed``: :class:`~.core._leases.ClaimedEmail` rows, with the trace contexts
    their claim read (``traceparent``, ``tracestate``: no query of its own);
    ``server``: a transport's name -> its (host, port).
    """
    from opentelemetry import trace
    from opentelemetry.trace import Link

    now = time.time_ns()
    producers = {email.id: producer_context(email.traceparent, email.tracestate)
                 for email in claimed}
    transports = sorted({email.transport for email in claimed})
    attributes = _attributes("claim", transports[0] if len(transports) == 1 else "*")
    attributes["messaging.batch.message_count"] = len(claimed)
    root = trace.set_span_in_context(trace.INVALID_SPAN)
    claim_span = tracer.start_span(
        "claim", context=root, kind=trace.SpanKind.CLIENT, attributes=attributes,
        links=[Link(p.get_span_context()) for p in producers.values() if p is not None],
        start_time=started if started is not None else now)
    claim_span.end(now)
    claim_context = trace.set_span_in_context(claim_span)
    servers: dict[str, tuple[str, int] | None] = {}
    for email in claimed:
        producer = producers[email.id]
        attributes = _attributes("process", email.transport, email.id, email.key)
        attributes[ATTEMPT] = email.attempt
        if email.transport not in servers:
            servers[email.transport] = server(email.transport)
        address = servers[email.transport]
        if address is not None:
            attributes["server.address"], attributes["server.port"] = address
        if settings.recipient_domain:
            attributes[RECIPIENT_DOMAINS] = _domains(email.deliverable)
        if settings.link == "child" and producer is not None:
            context, links = trace.set_span_in_context(producer), [
                Link(claim_span.get_span_context())]
        else:
            context = claim_context
            links = [] if producer is None else [Link(producer.get_span_context())]
        span = tracer.start_span(f"process {email.transport}", context=context,
                                 kind=trace.SpanKind.CONSUMER, attributes=attributes,
                                 links=links, start_time=now)
        LIVE[(email.id, email.message_id)] = Attempt(tracer, span, claim_span, producer,
                                                     email.transport)


def server_of(transport: Any) -> tuple[str, int] | None:
    """The host and port of an API transport's ``base_url`` (None: it has none)."""
    url = getattr(transport, "base_url", None)
    if not isinstance(url, str):
        return None
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        return None
    return (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


def _domains(recipients: Sequence[str]) -> list[str]:
    return sorted({address.rpartition("@")[2].lower() for address in recipients})


def forget(email_id: int, message_id: str) -> None:
    """An attempt given back unsent (released, held): its span is dropped, never ended."""
    LIVE.pop((email_id, message_id), None)


def unseen(tracer: Any, settings: TracingSettings, email: Any, *, start_time: int,
           server: tuple[str, int] | None) -> Attempt:
    """A CONSUMER span opened at its record for an attempt not seen claimed (tracing
    came on while it was in flight): from ``start_time`` (its record's start)."""
    from opentelemetry import trace
    from opentelemetry.trace import Link

    producer = producer_context(email.traceparent, email.tracestate)
    attributes = _attributes("process", email.transport, email.id, email.key)
    attributes[ATTEMPT] = email.attempt
    if server is not None:
        attributes["server.address"], attributes["server.port"] = server
    if settings.recipient_domain:
        attributes[RECIPIENT_DOMAINS] = _domains(email.deliverable)
    if settings.link == "child" and producer is not None:
        context, links = trace.set_span_in_context(producer), []
    else:  # the worker's own trace: not the caller's, whatever is current here
        context = trace.set_span_in_context(trace.INVALID_SPAN)
        links = [] if producer is None else [Link(producer.get_span_context())]
    span = tracer.start_span(f"process {email.transport}", context=context,
                             kind=trace.SpanKind.CONSUMER, attributes=attributes,
                             links=links, start_time=start_time)
    return Attempt(tracer, span, None, producer, email.transport)


def end_attempts(ended: Sequence[tuple[Attempt, str, int, bool]],
                 record: tuple[int, int]) -> None:
    """The ``record`` span of one record transaction (``record``: its start and end,
    ns), linked to the CONSUMER span of every attempt it recorded, then those spans
    ended: ``ended`` holds (attempt, outcome, reply code, failed) for each.

    One ``record`` span per transaction, not per email: the transaction is one, and a
    span per email cost each attempt a third of its tracing. It is the child of the
    first attempt's claim span (in the worker's own trace), a root when none was seen.
    """
    if not ended:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link, Status, StatusCode

    first = ended[0][0]
    transports = {attempt.transport for attempt, *_ in ended}
    attributes = _attributes("record", first.transport if len(transports) == 1 else "*")
    attributes["messaging.batch.message_count"] = len(ended)
    first.tracer.start_span(
        "record", context=trace.set_span_in_context(first.claim or trace.INVALID_SPAN),
        kind=trace.SpanKind.INTERNAL, attributes=attributes, start_time=record[0],
        links=[Link(attempt.span.get_span_context()) for attempt, *_ in ended],
    ).end(record[1])
    for attempt, outcome, reply_code, in_error in ended:
        span = attempt.span
        if span.is_recording():  # a sampled-out span: no attribute to build
            span.set_attributes({OUTCOME: outcome, REPLY_CODE: reply_code} if reply_code
                                else {OUTCOME: outcome})
            if in_error:
                span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class _Off:
    """What :func:`sending` and :func:`signing` return when the attempt is not traced."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def done(self, results: Sequence[Any]) -> None:
        """Nothing to note."""


OFF = _Off()


class _Sending:
    """The span of one SMTP transaction or provider API request, current while it runs
    (an instrumented httpx client's span is its child); ended by ``with``."""

    def __init__(self, attempts: list[Attempt], email_ids: list[int], name: str,
                 server: tuple[str, int] | None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link

        first = attempts[0]
        # One email: what its CONSUMER parent says is not said again (each attribute
        # costs the SDK a validation); a batch says what it carries.
        attributes: dict[str, Any] = {} if len(email_ids) == 1 else {
            "messaging.system": SYSTEM, "messaging.operation.name": "send",
            "messaging.operation.type": "send",
            "messaging.destination.name": first.transport,
            "messaging.batch.message_count": len(email_ids)}
        if server is not None:
            attributes["server.address"], attributes["server.port"] = server
        if len(email_ids) == 1:
            context, links = trace.set_span_in_context(first.span), []
        else:  # a batch request: under the claim, linked to every email's producer
            context = trace.set_span_in_context(first.claim or trace.INVALID_SPAN)
            links = [Link(a.producer.get_span_context()) for a in attempts
                     if a.producer is not None]
        self.span = first.tracer.start_span(name, context=context, kind=trace.SpanKind.CLIENT,
                                            attributes=attributes, links=links)
        self._batch = len(email_ids) > 1
        self._token: Any = None

    def __enter__(self) -> Self:
        from opentelemetry import context, trace

        self._token = context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """End the span; never raises (the send's own exception, if any, goes on)."""
        from opentelemetry import context

        try:
            context.detach(self._token)
            if error is not None:
                failed(self.span, error)
            self.span.end()
        except Exception as exc:  # noqa: BLE001 - reported; the send's result stands
            _span_failed(self.span, exc)

    def done(self, results: Sequence[Any]) -> None:
        """Note the results (``Delivered`` / ``Failed``): the outcome and reply code.

        One email delivered: nothing, its CONSUMER parent says ``sent`` (an attribute
        set costs the SDK a lock and a validation per email); a failure or a batch
        says what happened."""
        if not self.span.is_recording():
            return
        from opentelemetry.trace import Status, StatusCode

        errors = [result.error for result in results if hasattr(result, "error")]
        try:
            if not errors:
                if self._batch:
                    self.span.set_attribute(OUTCOME, "delivered")
                return
            self.span.set_attribute(OUTCOME, "failed" if len(errors) == len(results)
                                    else "partial")
            codes = [int(getattr(error, "code", 0) or 0) for error in errors]
            if any(codes):
                self.span.set_attribute(REPLY_CODE, next(code for code in codes if code))
            self.span.set_status(Status(StatusCode.ERROR, type(errors[0]).__name__))
        except Exception as exc:  # noqa: BLE001 - reported; the send's result stands
            _span_failed(self.span, exc)


def _span_failed(span: Any, exc: Exception) -> None:
    _degrade.report(
        f"Could not end the span {getattr(span, 'name', '?')!r} of a delivery attempt",
        consequence="that span is missing from its trace or incomplete; the email is sent "
                    "and its outcome recorded as usual",
        fix="check the app's OpenTelemetry span processors (the traceback below names the "
            "failing one)", exc=exc)


def sending(envelopes: Sequence[Any], name: str,
            server: tuple[str, int] | None = None) -> _Sending | _Off:
    """The span of one SMTP transaction or API request carrying ``envelopes``: a child
    of the email's CONSUMER span (made current, so an instrumented httpx or aiosmtplib
    continues inside it), or for a batch, a child of the claim linked to every
    email's producer; :data:`OFF` when none of them is traced. Never raises."""
    if not LIVE:
        return OFF
    try:
        attempts = [LIVE.get((e.email_id, e.message_id)) for e in envelopes]
        traced = [a for a in attempts if a is not None]
        if not traced:
            return OFF
        return _Sending(traced, [e.email_id for e in envelopes], name, server)
    except Exception as exc:  # noqa: BLE001 - reported; sending must not fail for a span
        _degrade.report(
            f"Could not open the span of sending {len(envelopes)} email(s)",
            consequence="that span is missing from their trace; they are sent as usual",
            fix="check the app's OpenTelemetry span processors (the traceback below names "
                "the failing one)", exc=exc)
        return OFF


def signed(dkim: Any, email_id: int, message_id: str, mime: bytes) -> bytes:
    """``dkim.signed(email_id, mime)``, inside a ``dkim.sign`` child span of the
    attempt's CONSUMER span when it is traced."""
    attempt = LIVE.get((email_id, message_id)) if LIVE else None
    if attempt is None:
        return bytes(dkim.signed(email_id, mime))
    from opentelemetry import trace

    try:
        span = attempt.tracer.start_span(
            "dkim.sign", context=trace.set_span_in_context(attempt.span),
            kind=trace.SpanKind.INTERNAL, attributes={"messaging.message.id": str(email_id)})
    except Exception as exc:  # noqa: BLE001 - reported; the message is signed all the same
        _span_failed(attempt.span, exc)
        return bytes(dkim.signed(email_id, mime))
    try:
        return bytes(dkim.signed(email_id, mime))
    finally:
        try:
            span.end()
        except Exception as exc:  # noqa: BLE001 - reported; the signed message stands
            _span_failed(span, exc)


#: The attribute naming what an event reported (``delivered``, ``bounced``...).
EVENT_TYPE = "flask_mail_outbox.event_type"
BOUNCE_KIND = "flask_mail_outbox.bounce_kind"
REASON = "flask_mail_outbox.reason"


def event_spans(tracer: Any, events: Sequence[Any],
                contexts: Mapping[int, tuple[str | None, str | None]]) -> None:
    """A span per delivery event (a webhook's, a bounce's) matched to an email, in the
    current trace (the request that brought it), linked to the email's PRODUCER span.

    ``events``: :class:`~flask_mail_outbox._events.DeliveryEvent` with an ``email_id``;
    no recipient is put on the span."""
    from opentelemetry import trace
    from opentelemetry.trace import Link

    for event in events:
        producer = producer_context(*contexts.get(event.email_id, (None, None)))
        attributes = _attributes("event", event.transport or "default", event.email_id)
        attributes[EVENT_TYPE] = event.event_type
        if event.bounce_kind:
            attributes[BOUNCE_KIND] = event.bounce_kind
        if event.reason:
            attributes[REASON] = event.reason
        tracer.start_span(f"event {event.event_type}", kind=trace.SpanKind.INTERNAL,
                          attributes=attributes,
                          links=[] if producer is None else [
                              Link(producer.get_span_context())]).end()
