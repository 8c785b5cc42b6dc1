"""``request``: what a request that sends an email costs while the SMTP server is slow.

The app (:mod:`benchmarks.bench_app` plus one view, ``POST /signup``: a
``mail.send()`` and ``db.session.commit()``) is served by Werkzeug's threaded
WSGI server in a child process (``python -m benchmarks.request --child
SPEC``); the SMTP server is the aiosmtpd sink answering every message after
``--smtp-delay`` seconds (1 s). This process sends ``--n`` requests one at a
time, ``--spacing`` apart, over a fresh HTTP connection each, and times each
from the request's first byte to the response's last. The emails pile up
behind the slow server (4 connections at 1 s each deliver 4/s); the requests
must not wait for them.

Configurations: ``inline-sqlite`` (the default mode), ``durable-sqlite`` (the
app process's dispatcher), ``inline-pg``.
"""

from __future__ import annotations

import argparse
import http.client
import json
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
    log_path,
    percentile,
    stop_process,
    tail,
    wait_port,
)
from ._registry import scenario

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "inline-sqlite": ("sqlite", {"OUTBOX_DURABLE": False}),
    "durable-sqlite": ("sqlite", {"OUTBOX_DURABLE": True}),
    "inline-pg": ("pg", {"OUTBOX_DURABLE": False}),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="measured requests per configuration (default 200; --quick 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--spacing", type=float, default=0.02,
                        help="seconds between requests (default 0.02)")
    parser.add_argument("--smtp-delay", type=float, default=1.0,
                        help="the sink's wait before each 250 (default 1 s)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")


@scenario("request", "request latency of a view that sends + commits, SMTP server taking 1 s",
          add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    n = args.n or (50 if args.quick else 200)
    sink = ctx.aiosmtpd_sink(args.smtp_delay)
    table = Table(f"Request latency, POST /signup (send + commit), SMTP server answering "
                  f"after {args.smtp_delay:g} s; {n} requests {args.spacing * 1000:g} ms apart "
                  "(ms)", ["config", "n", "p50", "p90", "p99", "max", "delivered meanwhile",
                           "errors"])
    report = Report("request", tables=[table])
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        backend, config = CONFIGS[name]
        if backend == "pg":
            _, url = ctx.postgres().create_database("bench_request")
        else:
            url = f"sqlite:///{ctx.workdir / f'request-{name}.db'}"
        create_tables(url)
        sink.reset()
        port = free_port()
        server = ctx.spawn([sys.executable, "-m", "benchmarks.request", "--child",
                            json.dumps({"port": port})],
                           env=bench_env(url, sink.smtp_port,
                                         {**config, "OUTBOX_RUN_SCHEDULER": False}),
                           name=f"request-{name}")
        try:
            wait_port(port, 60)
            times, errors = [], 0
            for i in range(args.warmup + n):
                started = time.perf_counter()
                status = _post(port, i)
                took = 1000 * (time.perf_counter() - started)
                if status != 200:
                    errors += 1
                if i >= args.warmup:
                    times.append(took)
                time.sleep(args.spacing)
            delivered = sink.stats()["count"]
        finally:
            if server.poll() is not None:
                log(f"request server {name} exited early:\n{tail(log_path(server))}")
            stop_process(server)
        row = {"p50_ms": percentile(times, 50), "p90_ms": percentile(times, 90),
               "p99_ms": percentile(times, 99), "max_ms": max(times), "errors": errors,
               "delivered_meanwhile": delivered, "times_ms": times}
        report.data[name] = row
        table.add(name, len(times), row["p50_ms"], row["p90_ms"], row["p99_ms"],
                  row["max_ms"], f"{delivered} of {args.warmup + n}", errors)
        log(f"request {name}: p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms")
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


def child_main(spec: dict[str, Any]) -> None:
    from flask import request
    from werkzeug.serving import make_server

    from flask_mail_outbox import Message

    from .bench_app import create_app

    app = create_app()
    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db

    @app.post("/signup")
    def signup() -> str:
        mail.send(Message("Welcome", recipients=[request.form["email"]],
                          body="Thanks for signing up.\n"))
        db.session.commit()
        return "ok"

    make_server("127.0.0.1", spec["port"], app, threaded=True).serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks request`")
