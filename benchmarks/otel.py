"""``otel``: what OpenTelemetry tracing costs ``send()`` and the drain, side by side.

Three apps on one database, measured alternately, round after round:

* **off**: ``OUTBOX_OTEL = {"enabled": False}``;
* **none**: the default (``"auto"``) with no tracer provider set: what every app
  without OpenTelemetry runs (the goal: no measurable cost);
* **sdk**: the SDK's ``TracerProvider`` with a ``BatchSpanProcessor`` to an
  exporter that drops the spans (what an app exporting to a collector pays in
  its own process, the network left out).

``send``: N emails through ``mail.send()``, one commit each (a request sending one
email), durable with no worker: the PRODUCER span and its context on the row.
``drain``: N emails committed at once (``send_many``) and delivered by the app's
inline worker to the SMTP sink; the clock runs from the commit until the sink has
all N: the claim, CONSUMER, SMTP and record spans. The sink answers at once
(``drain``: bound by this process's CPU, the worst case for any overhead) and, as a
real server does, after ``--delay-ms`` (``drain+delay``).

Each is timed twice: wall time, and this process's CPU time (every thread of it:
the sender's, the worker's, the span processor's), which the other processes of a
shared machine disturb less. Ratio = the median of the per-round ratios to **off**.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from ._harness import Context, Report, Sink, Table, median
from .bench_app import Bench, build, message

NAME = "otel"
HELP = "send() and the drain with tracing off, with no provider, and with the SDK configured"
SMOKE = ["--n", "20", "--rounds", "1", "--backends", "sqlite", "--delay-ms", "5"]
VARIANTS = ("off", "none", "sdk")


class Dropped(SpanExporter):
    """An exporter that counts the spans and drops them."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=500, help="emails per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,pg", help="sqlite and/or pg")
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="the slow sink's answer time (drain+delay)")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    table = Table(f"Tracing overhead, {args.n} emails per measurement, median of "
                  f"{args.rounds} rounds", ["database", "what", "off ms", "none ms", "sdk ms",
                                            "none/off", "sdk/off", "cpu none/off",
                                            "cpu sdk/off"])
    report = Report(NAME, tables=[table])
    sinks = {"drain": ctx.sink(), "drain+delay": ctx.sink(delay=args.delay_ms / 1000)}
    for backend, url in ctx.databases(args.backends, NAME):
        exporter = Dropped()
        times = _measure(url, sinks, args.n, args.rounds, exporter)
        for what, by_variant in times.items():
            ms = {v: (median(w for w, _ in t) or 0.0) * 1e3 for v, t in by_variant.items()}
            ratios = {(v, i): median(t[i] / o[i] for t, o in zip(
                by_variant[v], by_variant["off"], strict=True))
                for v in ("none", "sdk") for i in (0, 1)}
            table.add(backend, what, ms["off"], ms["none"], ms["sdk"], ratios["none", 0],
                      ratios["sdk", 0], ratios["none", 1], ratios["sdk", 1])
            for variant in ("none", "sdk"):
                report.figures[f"{backend}/{what} {variant}/off"] = ratios[variant, 0]
                report.figures[f"{backend}/{what} cpu {variant}/off"] = ratios[variant, 1]
        report.notes.append(f"{backend}: the sdk variant exported {exporter.count} spans")
    report.notes.append(f"x/off: the median of the per-round ratios of wall time (cpu: of "
                        f"this process's CPU time); drain+delay: the sink answers after "
                        f"{args.delay_ms:g} ms; goal: sdk/off <= 1.05, none/off within noise")
    return report


def _apps(url: str, port: int, exporter: Dropped, **config: Any
          ) -> tuple[dict[str, Bench], TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    otel: dict[str, Any] = {"off": {"enabled": False}, "none": None,
                            "sdk": {"tracer_provider": provider}}
    apps = {}
    for variant in VARIANTS:
        extra = dict(config)
        if otel[variant] is not None:
            extra["OUTBOX_OTEL"] = otel[variant]
        apps[variant] = build(url, port, create=not apps, **extra)
    return apps, provider


Times = list[tuple[float, float]]


def _measure(url: str, sinks: dict[str, Sink], n: int, rounds: int, exporter: Dropped
             ) -> dict[str, dict[str, Times]]:
    result: dict[str, dict[str, Times]] = {
        what: {v: [] for v in VARIANTS} for what in ("send", *sinks)}
    fast = sinks["drain"]
    senders, provider = _apps(url, fast.smtp_port, exporter, OUTBOX_DURABLE=True,
                              OUTBOX_RUN_WORKER=False, OUTBOX_RUN_SCHEDULER=False)
    try:
        for bench in senders.values():  # warm-up: connections, compiled statements
            bench.enqueue(20, "warm-up", batch=1)
        for r in range(rounds):
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                cpu = time.process_time()
                wall = senders[variant].enqueue(n, f"send {variant}", batch=1)
                result["send"][variant].append((wall, time.process_time() - cpu))
    finally:
        for bench in senders.values():
            bench.stop()
        provider.shutdown()
    for what, sink in sinks.items():
        drainers, provider = _apps(url, sink.smtp_port, exporter, OUTBOX_DURABLE=False,
                                   OUTBOX_RUN_SCHEDULER=False)
        try:
            for bench in drainers.values():
                _drain(bench, sink, 20, "warm-up")
            for r in range(rounds):
                for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    result[what][variant].append(
                        _drain(drainers[variant], sink, n, f"{what} {variant}"))
        finally:
            for bench in drainers.values():
                bench.stop()
            provider.shutdown()
    return result


def _drain(bench: Bench, sink: Sink, n: int, tag: str) -> tuple[float, float]:
    """``n`` emails committed at once, then delivered inline: commit to the last receipt
    (wall time, and this process's CPU time)."""
    sink.reset()
    with bench.app.app_context():
        bench.mail.send_many([message(f"{tag} #{i}") for i in range(n)])
        started, cpu = time.perf_counter(), time.process_time()
        bench.db.session.commit()
        stats = sink.wait_for(n, timeout=120)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        bench.db.session.remove()
    if stats["count"] < n:
        raise RuntimeError(f"{tag}: the sink got {stats['count']} of {n} emails")
    return elapsed, cpu
