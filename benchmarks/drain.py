"""``drain``: how fast K ``flask outbox worker`` processes empty a backlog, SMTP with latency.

Per round and per K (the order alternating between rounds): the tables are
emptied; N emails are queued through ``mail.send()`` in this process (500 per
transaction, durable, no dispatcher here) with ``send_after`` an hour ahead, so
nothing is due; K ``flask outbox worker --concurrency C`` processes start (on
PostgreSQL: until all K LISTEN); then one transaction makes every row due
(``UPDATE outbox_email SET due_at``) and sends one more email, so its commit
wakes the workers as any ``send()`` does. The clock runs from that commit
until the sink has all N + 1.

The sink answers each message after ``--delay-ms``: the drain is then bound by
latency, K x C / delay, which is what a real provider imposes; the figure is
the share of that bound reached, and the K-worker rate over the 1-worker rate
in the same round. SQLite has no LISTEN: its workers poll every 0.5 s, and its
clock starts at the first receipt instead.

Where a drain loses against the bound, from the sink's receipts: "first ms",
the release to the first receipt less the delay (the wake-up, the claim and
the connections opening); "steady", the share of the bound between the 10th
and the 90th percentile receipt (the per-message turnaround: the sink's own
work after each reply, the client's, the wire); "last K x C ms", how long the
last K x C receipts took: within one delay when every connection ends
together, longer when one process still held rows while others had run out
(its claims take up to a batch, OUTBOX_BATCH_SIZE). The last round is
partly empty too: N + 1 messages on K x C connections take ceil((N + 1) / (K
x C)) rounds, so 1,001 on 32 reach at most 0.977 of the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    execute,
    log,
    median,
    ratio,
    status_counts,
    stop_process,
    wait_listening,
)
from .bench_app import Bench, build, message

NAME = "drain"
HELP = "N queued emails drained by 1 vs 4 worker processes, sink with latency"
SMOKE = ["--n", "40", "--rounds", "1", "--workers", "1,2", "--delay-ms", "20"]

#: Emails are queued this far ahead, then released all at once.
HOLD = timedelta(hours=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1000, help="emails per round")
    parser.add_argument("--workers", default="1,4", help="worker process counts to compare")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="flask outbox worker --concurrency")
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="the sink's wait before each 250")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="pg", help="pg and/or sqlite")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the workers' OUTBOX_BATCH_SIZE (default: the default, 100)")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    counts = [int(k) for k in args.workers.split(",")]
    sink = ctx.sink(args.delay_ms / 1000)
    table = Table(f"Drain of {args.n} emails, worker --concurrency {args.concurrency}, sink "
                  f"answering after {args.delay_ms:g} ms (median of {args.rounds} rounds)",
                  ["database", "workers", "msg/s", "bound msg/s", "of bound",
                   f"x {counts[0]} worker(s)", "not sent", "first ms", "steady",
                   "last K x C ms"])
    report = Report(NAME, tables=[table])
    for backend, url in ctx.databases(args.backends, NAME):
        bench = build(url, sink.smtp_port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                      OUTBOX_RUN_SCHEDULER=False)
        config = {} if args.batch_size is None else {"OUTBOX_BATCH_SIZE": args.batch_size}
        rates: dict[int, list[float]] = {k: [] for k in counts}
        shapes: dict[int, list[Shape]] = {k: [] for k in counts}
        not_sent = dict.fromkeys(counts, 0)
        try:
            for r in range(args.rounds):
                for k in counts if r % 2 == 0 else counts[::-1]:
                    rate, shape = drain_shaped(ctx, bench, url, sink, n=args.n, workers=k,
                                               concurrency=args.concurrency,
                                               delay=args.delay_ms / 1000, config=config)
                    rates[k].append(rate)
                    shapes[k].append(shape)
                    not_sent[k] += args.n + 1 - status_counts(url).get("sent", 0)
                    log(f"drain {backend} round {r + 1} K={k}: {rate:.0f} msg/s")
        finally:
            bench.stop()
        for k in counts:
            median_rate = median(rates[k])
            bound = k * args.concurrency / (args.delay_ms / 1000) if args.delay_ms else None
            vs = median(ratio(a, b) for a, b in zip(rates[k], rates[counts[0]], strict=True))
            first = median(s.first for s in shapes[k])
            steady = median(s.steady for s in shapes[k])
            last = median(s.last for s in shapes[k])
            table.add(backend, k, median_rate, bound, ratio(median_rate, bound), vs, not_sent[k],
                      None if first is None else first * 1000, ratio(steady, bound),
                      None if last is None else last * 1000)
            report.figures[f"{backend} {k} workers msg/s"] = median_rate
            report.figures[f"{backend} {k} workers of bound"] = ratio(median_rate, bound)
            report.figures[f"{backend} {k} workers steady of bound"] = ratio(steady, bound)
    report.notes.append("bound = workers x concurrency / delay; the sink's own MAIL/RCPT/DATA "
                        "round trips come on top of the delay")
    return report


@dataclasses.dataclass(frozen=True)
class Shape:
    """Where a drain's time went (see the module docstring); None where not measured."""

    first: float | None  # seconds from the release to the first receipt, less the delay
    steady: float | None  # msg/s between the 10th and the 90th percentile receipt
    last: float | None  # seconds the last K x C receipts took (one per connection)


def drain_once(ctx: Context, bench: Bench, url: str, sink: Sink, *, n: int, workers: int,
               concurrency: int) -> float:
    """Queue ``n``, start ``workers``, release, wait for the sink; msg/s (workers stopped)."""
    return drain_shaped(ctx, bench, url, sink, n=n, workers=workers,
                        concurrency=concurrency)[0]


def drain_shaped(ctx: Context, bench: Bench, url: str, sink: Sink, *, n: int, workers: int,
                 concurrency: int, delay: float = 0.0, config: dict[str, Any] | None = None
                 ) -> tuple[float, Shape]:
    """:func:`drain_once`, and where its time went (``delay``: the sink's)."""
    procs, released = start_drain(ctx, bench, url, sink, n=n, workers=workers,
                                  concurrency=concurrency, config=config)
    try:
        stats = sink.wait_for(n + 1, timeout=60 + n / 10, procs=procs)
    finally:
        for proc in procs:
            stop_process(proc)
    if stats["count"] < n + 1:
        raise RuntimeError(f"only {stats['count']} of {n + 1} emails arrived")
    postgres = url.startswith("postgresql")
    shape = _shape(sink.receipts(), released if postgres else None, delay,
                   connections=workers * concurrency)
    if postgres:
        return stats["count"] / max(stats["last"] - released, 1e-9), shape
    return (stats["count"] - 1) / max(stats["last"] - stats["first"], 1e-9), shape


def _shape(receipts: list[list[Any]], released: float | None, delay: float, *,
           connections: int) -> Shape:
    """:class:`Shape` from the sink's ``[time, Message-ID, X-Bench-Id]`` receipts."""
    times = sorted(float(r[0]) for r in receipts)
    if len(times) < max(10, connections):
        return Shape(None, None, None)
    low, high = len(times) // 10, len(times) * 9 // 10
    steady = (high - low) / max(times[high] - times[low], 1e-9)
    first = None if released is None else times[0] - released - delay
    return Shape(first, steady, times[-1] - times[-connections])


def start_drain(ctx: Context, bench: Bench, url: str, sink: Sink, *, n: int, workers: int,
                concurrency: int, config: dict[str, Any] | None = None
                ) -> tuple[list[subprocess.Popen[Any]], float]:
    """Empty the tables, queue ``n`` held emails, start ``workers``, release; (them, when)."""
    execute(url, "DELETE FROM outbox_attachment", "DELETE FROM outbox_email")
    bench.enqueue(n, "drain", send_after=HOLD)
    sink.reset()
    postgres = url.startswith("postgresql")
    # SQLite wakes no other process: its workers poll often instead.
    polling = {} if postgres else {"OUTBOX_POLL_MAX_INTERVAL": 0.5}
    procs = [ctx.spawn_worker(url, sink, concurrency=concurrency,
                              config={**polling, **(config or {})}, name=f"drain-{i}")
             for i in range(workers)]
    try:
        if postgres:
            wait_listening(url, workers, procs)
        return procs, release(bench)
    except BaseException:
        for proc in procs:
            stop_process(proc)
        raise


def release(bench: Bench) -> float:
    """Make every queued row due and send one more, in one transaction; when it committed."""
    with bench.app.app_context():
        bench.db.session.execute(sa.text("UPDATE outbox_email SET due_at = :now "
                                         "WHERE status = 'queued'"),
                                 {"now": datetime.now(UTC).replace(tzinfo=None)})
        bench.mail.send(message("release"))
        bench.db.session.commit()
        released = time.time()
        bench.db.session.remove()
    return released
