"""``limits``: workers against a provider's rate limit, with and without ``OUTBOX_RATE_LIMIT``.

The sink is a provider with a quota: one token bucket over all its sessions,
``--quota`` messages a second; above it, it answers ``421 4.7.28 Rate limit
exceeded`` and closes the connection (Gmail's words). ``--bursts`` says how many
tokens the bucket holds: ``quota`` (one second's worth, a lenient provider) and
a strict one (``5``: real quotas are often that strict, and a client that
sends in bursts at the top of each second is refused most of each burst there).
``--workers`` ``flask outbox worker`` processes drain a backlog on PostgreSQL
(released at once, as in ``drain``), and the sink's receipts in a steady window
``[release + --warmup, + --window)`` give the delivered rate:

* ``shared``: ``OUTBOX_RATE_LIMIT = <quota>`` (per second), one limit in the database
  (``outbox_rate``) for every process: delivered close to the quota, almost
  no refusals;
* ``unlimited``: no rate configured, the 421 is the only signal: the workers
  learn a shared rate from it (see ``flask_mail_outbox/core/_rate.py``).

Either way no email may end dead-lettered (a 421 is transient). Refused per
delivered = all refusals of the run / messages accepted ("in the window": of
the steady window alone, after the first refusals taught the rate); ``dead``
counts ``failed`` rows. Each run starts with ``outbox_rate`` empty. "Whole
run / quota" is every receipt over the release to the last receipt, learning
and the last retries included: with ``--n`` the run is that backlog, drained.

Issue 41's strict server (one bucket over all sessions, 40/s, burst 5,
``421 4.7.0`` at ``MAIL FROM``, 1,200 emails) is::

    python -m benchmarks limits --bursts 5 --quota-at data,mail --n 1200 \
        --quota-reply "421 4.7.0 Too many messages, slow down"

(``--quota-at data`` is this scenario's own server, side by side;
``--keep-open``: a server that does not close the connection after its 421.)
"""

from __future__ import annotations

import argparse
import math

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    execute,
    log,
    ratio,
    status_counts,
    stop_process,
)
from .bench_app import Bench, build
from .drain import start_drain

NAME = "limits"
HELP = "workers against a provider's quota (421 above it), with and without a rate limit"
SMOKE = ["--quota", "40", "--workers", "1", "--warmup", "0.5", "--window", "1.5",
         "--backends", "pg", "--bursts", "5"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quota", type=float, default=40.0,
                        help="the provider's messages per second, over all sessions")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=4.0,
                        help="seconds after the release not counted")
    parser.add_argument("--window", type=float, default=15.0, help="the steady window")
    parser.add_argument("--rows", default="shared,unlimited", help="shared and/or unlimited")
    parser.add_argument("--bursts", default="quota,5",
                        help="the quota bucket's sizes to run against: 'quota' (one "
                             "second's worth) and/or numbers of messages")
    parser.add_argument("--backends", default="pg",
                        help="pg (several workers share one database), or sqlite")
    parser.add_argument("--quota-at", default="data",
                        help="where the server refuses above the quota: 'data' (the end of "
                             "DATA) and/or 'mail' (MAIL FROM), comma-separated")
    parser.add_argument("--quota-reply", default=None,
                        help="the server's reply above the quota (default: the sink's, "
                             "421 4.7.28 Rate limit exceeded, slow down)")
    parser.add_argument("--keep-open", action="store_true",
                        help="the server keeps the connection open after its 421 (by "
                             "default it closes it, as RFC 5321 says)")
    parser.add_argument("--n", type=int, default=None,
                        help="the backlog (default: enough to outlast the window); the "
                             "whole run's rate is n over the release to the last receipt")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    # Enough backlog to outlast the window at the quota.
    n = args.n or math.ceil(args.quota * (args.warmup + args.window) * 1.3) + 20
    table = Table(f"{args.workers} workers x {args.concurrency} against a {args.quota:g} msg/s "
                  f"quota, {n} emails, {args.window:g} s window after {args.warmup:g} s",
                  ["database", "burst", "refused at", "rate limit", "delivered msg/s",
                   "/ quota", "whole run / quota", "refused", "refused per delivered",
                   "in the window", "dead"])
    report = Report(NAME, tables=[table])
    bursts = [args.quota if b.strip() == "quota" else float(b)
              for b in args.bursts.split(",") if b.strip()]
    places = [p.strip() for p in args.quota_at.split(",") if p.strip()]
    sinks = [(burst, place, ctx.sink(quota=args.quota, burst=burst, quota_at=place,
                                     quota_reply=args.quota_reply,
                                     quota_close=not args.keep_open))
             for burst in bursts for place in places]
    for backend, url in ctx.databases(args.backends, NAME):
        bench = build(url, sinks[0][2].smtp_port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                      OUTBOX_RUN_SCHEDULER=False)
        try:
            for burst, place, sink in sinks:
                for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
                    _run_row(ctx, args, report, table, bench, url, sink, backend, burst, place,
                             row, n)
        finally:
            bench.stop()
    return report


def _run_row(ctx: Context, args: argparse.Namespace, report: Report, table: Table,
             bench: Bench, url: str, sink: Sink, backend: str, burst: float, place: str,
             row: str, n: int) -> None:
    config = {"OUTBOX_RATE_LIMIT": args.quota} if row == "shared" else {}
    # Each run starts without what an earlier one learned or set.
    execute(url, "DELETE FROM outbox_rate")
    procs, released = start_drain(ctx, bench, url, sink, n=n, workers=args.workers,
                                  concurrency=args.concurrency, config=config)
    t0 = released + args.warmup
    try:
        # The window, or (a backlog given) the whole run, which takes n / quota at best.
        timeout = args.warmup + args.window if args.n is None else 2 * n / args.quota + 10
        sink.wait_for(n + 1, timeout=timeout, procs=procs)
        stats = sink.stats()
        times = [float(r[0]) for r in sink.receipts()]
        refusals = sink.refusals()
    finally:
        for proc in procs:
            stop_process(proc)
    end = t0 + args.window
    if stats["count"] > n:  # the backlog ran out: the window ends with it
        end = min(end, max(times))
    rate = (sum(t0 <= t < end for t in times) / (end - t0)) if end > t0 else None
    # The whole run, learning included: every receipt over the release to the last.
    whole = len(times) / (max(times) - released) if times else None
    refused = int(stats["refused"])
    per_delivered = refused / max(stats["count"], 1)
    # Past the warm-up: what pacing costs once learned (the first refusals teach it).
    delivered_in = sum(t0 <= t < end for t in times)
    steady = sum(t0 <= t < end for t in refusals) / max(delivered_in, 1)
    dead = status_counts(url).get("failed", 0)
    size = "quota" if burst == args.quota else f"{burst:g}"
    table.add(backend, size, place, row, rate, ratio(rate, args.quota),
              ratio(whole, args.quota), refused, per_delivered, steady, dead)
    size = size if place == "data" else f"{size} at {place}"
    report.figures[f"{backend} burst {size} {row} delivered/quota"] = ratio(rate, args.quota)
    report.figures[f"{backend} burst {size} {row} whole run/quota"] = ratio(whole, args.quota)
    report.figures[f"{backend} burst {size} {row} refused per delivered"] = per_delivered
    report.figures[f"{backend} burst {size} {row} refused per delivered in the window"] = steady
    report.figures[f"{backend} burst {size} {row} dead"] = dead
    log(f"limits {backend} burst {size} {row}: {rate or 0:.1f} msg/s, whole run "
        f"{whole or 0:.1f} msg/s, {refused} refused of {stats['count']}")
