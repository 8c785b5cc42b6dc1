"""``request``: latency of a view that sends an email and commits, SMTP server taking 1 s.

A child process (``python -m benchmarks.request --child SPEC``) serves
:mod:`benchmarks.bench_app` with a ``POST /signup`` view that calls
``mail.send()`` and ``db.session.commit()``, on werkzeug's threaded server.
This process posts to it, one request at a time, ``--spacing`` apart, while the
SMTP sink takes ``--smtp-delay`` per message: the response time shows whether
the slow server reaches the request.
"""

from __future__ import annotations

import argparse
import http.client
import sys
import time
from typing import Any

from ._harness import (
    Context,
    Report,
    Table,
    bench_env,
    free_port,
    log,
    percentile,
    stop_process,
    wait_port,
)
from .bench_app import build

NAME = "request"
HELP = "request latency of a view that sends + commits, SMTP server taking 1 s"
SMOKE = ["--n", "10", "--warmup", "2", "--spacing", "0", "--smtp-delay", "0.5"]

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "inline-sqlite": ("sqlite", {"OUTBOX_DURABLE": False}),
    "durable-sqlite": ("sqlite", {"OUTBOX_DURABLE": True}),
    "inline-pg": ("pg", {"OUTBOX_DURABLE": False}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=200,
                        help="measured requests per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--spacing", type=float, default=0.02,
                        help="seconds between requests (default 0.02)")
    parser.add_argument("--smtp-delay", type=float, default=1.0,
                        help="the sink's wait before each 250 (default 1 s)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink(args.smtp_delay)
    table = Table(f"Request latency, POST /signup (send + commit), SMTP server answering "
                  f"after {args.smtp_delay:g} s; {args.n} requests {args.spacing * 1000:g} ms "
                  "apart (ms)", ["config", "p50", "p90", "p99", "max", "delivered meanwhile",
                                 "errors"])
    report = Report(NAME, tables=[table])
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        backend, config = CONFIGS[name]
        for _, url in ctx.databases(backend, f"request_{backend}", fallback=False):
            build(url, sink.smtp_port).stop()  # the tables
            sink.reset()
            port = free_port()
            server = ctx.spawn([sys.executable, "-m", "benchmarks.request", "--child",
                                str(port)],
                               env=bench_env(url, sink.smtp_port,
                                             {**config, "OUTBOX_RUN_SCHEDULER": False}),
                               name=f"request-{name}")
            try:
                wait_port(port, 60, [server])
                times, errors = [], 0
                for i in range(args.warmup + args.n):
                    started = time.perf_counter()
                    errors += _post(port, i) != 200
                    if i >= args.warmup:
                        times.append(1000 * (time.perf_counter() - started))
                    time.sleep(args.spacing)
                delivered = sink.stats()["count"]
            finally:
                stop_process(server)
            p50 = percentile(times, 50)
            table.add(name, p50, percentile(times, 90), percentile(times, 99), max(times),
                      f"{delivered} of {args.warmup + args.n}", errors)
            report.figures[f"{name} p50 ms"] = p50 if not errors else None
            log(f"request {name}: p50 {p50:.1f} ms, {errors} errors")
    report.notes.append("delivered meanwhile: what the slow server had accepted when the last "
                        "response came back; the rest is still queued or being sent")
    return report


def _post(port: int, i: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/signup", body=f"email=user{i}@example.com",
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def child_main(port: int) -> None:
    from flask import request
    from werkzeug.serving import make_server

    from flask_mail_outbox import Message

    from .bench_app import from_env

    bench = from_env()

    @bench.app.post("/signup")
    def signup() -> str:
        bench.mail.send(Message("Welcome", recipients=[request.form["email"]],
                                body="Thanks for signing up.\n"))
        bench.db.session.commit()
        return "ok"

    make_server("127.0.0.1", port, bench.app, threaded=True).serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(int(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks request`")
