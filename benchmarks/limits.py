"""``limits``: workers against a provider's rate limit, with and without ``OUTBOX_RATE_LIMIT``.

The sink is a provider with a quota: one token bucket over all its sessions,
``--quota`` messages a second; above it, it answers ``421 4.7.28 Rate limit
exceeded`` and closes the connection (Gmail's words). ``--workers`` ``flask
outbox worker`` processes drain a backlog on PostgreSQL (released at once, as in
``drain``), and the sink's receipts in a steady window ``[release + --warmup,
+ --window)`` give the delivered rate:

* ``shared``: ``OUTBOX_RATE_LIMIT = <quota>`` (per second), one limit in the database
  (``outbox_rate``) for every process: delivered close to the quota, almost
  no refusals;
* ``unlimited``: no rate configured, the 421 is the only signal: delivered at
  what backing off from refusals achieves.

Either way no email may end dead-lettered (a 421 is transient). Refused % =
refusals / accepted messages; ``dead`` counts ``failed`` rows.
"""

from __future__ import annotations

import argparse
import math

from ._harness import Context, Report, Table, log, ratio, status_counts, stop_process
from .bench_app import build
from .drain import start_drain

NAME = "limits"
HELP = "workers against a provider's quota (421 above it), with and without a rate limit"
SMOKE = ["--quota", "40", "--workers", "1", "--warmup", "0.5", "--window", "1.5",
         "--backends", "pg"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quota", type=float, default=40.0,
                        help="the provider's messages per second, over all sessions")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=4.0,
                        help="seconds after the release not counted")
    parser.add_argument("--window", type=float, default=15.0, help="the steady window")
    parser.add_argument("--rows", default="shared,unlimited", help="shared and/or unlimited")
    parser.add_argument("--backends", default="pg",
                        help="pg (several workers share one database), or sqlite")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink(quota=args.quota)
    # Enough backlog to outlast the window at the quota.
    n = math.ceil(args.quota * (args.warmup + args.window) * 1.3) + 20
    table = Table(f"{args.workers} workers x {args.concurrency} against a {args.quota:g} msg/s "
                  f"quota, {args.window:g} s window after {args.warmup:g} s",
                  ["database", "rate limit", "delivered msg/s", "/ quota", "refused",
                   "refused %", "dead"])
    report = Report(NAME, tables=[table])
    for backend, url in ctx.databases(args.backends, NAME):
        bench = build(url, sink.smtp_port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                      OUTBOX_RUN_SCHEDULER=False)
        try:
            for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
                config = {"OUTBOX_RATE_LIMIT": args.quota} if row == "shared" else {}
                procs, released = start_drain(ctx, bench, url, sink, n=n,
                                              workers=args.workers,
                                              concurrency=args.concurrency, config=config)
                t0 = released + args.warmup
                try:
                    sink.wait_for(n + 1, timeout=args.warmup + args.window, procs=procs)
                    stats = sink.stats()
                    times = [float(r[0]) for r in sink.receipts()]
                finally:
                    for proc in procs:
                        stop_process(proc)
                end = t0 + args.window
                if stats["count"] > n:  # the backlog ran out: the window ends with it
                    end = min(end, max(times))
                rate = (sum(t0 <= t < end for t in times) / (end - t0)) if end > t0 else None
                refused = int(stats["refused"])
                dead = status_counts(url).get("failed", 0)
                table.add(backend, row, rate, ratio(rate, args.quota), refused,
                          100 * refused / max(stats["count"], 1), dead)
                report.figures[f"{backend} {row} delivered/quota"] = ratio(rate, args.quota)
                report.figures[f"{backend} {row} dead"] = dead
                log(f"limits {backend} {row}: {rate or 0:.1f} msg/s, {refused} refused")
        finally:
            bench.stop()
    return report
