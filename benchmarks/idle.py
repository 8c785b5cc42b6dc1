"""``idle``: SQL statements per minute of a process that has nothing to send.

Each configuration runs in its own child process (``python -m benchmarks.idle
--child SPEC``), all at once (they mostly sleep). The child builds
:mod:`benchmarks.bench_app`, answers one request through the test client (a
WSGI process starts the outbox's background jobs on its first request), then
sends nothing. It counts every statement any SQLAlchemy engine of the process
hands to a cursor (a listener on the ``Engine`` class, so the outbox's own
engine is counted without knowing it), with the thread that ran it. On
PostgreSQL the driver's implicit ``BEGIN``/``COMMIT`` and the pool's pre-ping
are no cursor statements, so the server's own log of the database
(``log_statement = all``) is counted too: every round trip the database sees.

The figure is the count in the window ``[boot + --warmup, + --seconds]``, per
minute. The dispatcher's idle backoff grows to ``OUTBOX_POLL_MAX_INTERVAL`` (or
the LISTEN backstop) and the periodic job runs every 60 s, so a steady figure
needs a warm-up of about a minute and a window of a few minutes. Idle, the
count is a step every ``OUTBOX_POLL_MAX_INTERVAL`` (30 s: one claim, three
statements on SQLite), so a window that is no multiple of it holds one claim
more or less by its phase: 90 s give 6.0 or 8.0 per minute for the same
process. Keep the window a multiple of the poll cap (the default 300 s is).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from ._harness import Context, Report, Table, bench_env, tail
from .bench_app import build

NAME = "idle"
HELP = "SQL statements per minute of an idle process (durable and inline modes)"
SMOKE = ["--warmup", "1", "--seconds", "2"]

#: name -> (database, config, goal in statements per minute)
CONFIGS: dict[str, tuple[str, dict[str, Any], float]] = {
    "sqlite-durable": ("sqlite", {"OUTBOX_DURABLE": True}, 6.0),
    "pg-durable-listen": ("pg", {"OUTBOX_DURABLE": True, "OUTBOX_LISTEN": True}, 1.0),
    "sqlite-inline": ("sqlite", {"OUTBOX_DURABLE": False}, 2.0),
    "pg-inline": ("pg", {"OUTBOX_DURABLE": False}, 2.0),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=300.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=70.0,
                        help="seconds from boot to the window (the backoff reaching its cap)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink()  # nothing should arrive; MAIL_PORT must point somewhere
    children = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        backend, config, goal = CONFIGS[name]
        for _, url in ctx.databases(backend, f"idle_{backend}", fallback=False):
            build(url, sink.smtp_port).stop()  # the tables
            if backend == "pg":
                ctx.postgres().log_statements(url)
            out = ctx.workdir / f"idle-{name}.json"
            spec = {"warmup": args.warmup, "window": args.seconds, "out": str(out)}
            proc = ctx.spawn([sys.executable, "-m", "benchmarks.idle", "--child",
                              json.dumps(spec)], env=bench_env(url, sink.smtp_port, config),
                             name=f"idle-{name}")
            children.append((name, url, goal, proc, out))
    table = Table(f"Idle cost: SQL statements per minute, {args.seconds:g} s window after "
                  f"{args.warmup:g} s", ["config", "goal/min", "measured/min",
                                         "server log/min", "by thread"])
    report = Report(NAME, tables=[table])
    per_min = 60.0 / args.seconds
    for name, url, goal, proc, out in children:
        if proc.wait(timeout=args.warmup + args.seconds + 120) != 0 or not out.exists():
            raise RuntimeError(f"idle child {name} failed (exit {proc.returncode}):\n"
                               f"{tail(proc)}")
        raw = json.loads(out.read_text())
        start = raw["boot"] + args.warmup
        end = start + args.seconds
        inside = [thread for at, thread in raw["statements"] if start <= at < end]
        threads: dict[str, int] = {}
        for thread in inside:
            threads[thread] = threads.get(thread, 0) + 1
        server = None
        if url.startswith("postgresql"):
            server = ctx.postgres().count_logged(url, start, end) * per_min
        measured = len(inside) * per_min
        table.add(name, goal, measured, server,
                  ", ".join(f"{t} {c}" for t, c in sorted(threads.items())) or "-")
        report.figures[f"{name} statements/min"] = measured
    report.notes.append("measured: cursor statements of every engine in the process; server "
                        "log: what PostgreSQL logged for the database, BEGIN/COMMIT included")
    return report


def child_main(spec: dict[str, Any]) -> None:
    """Boot an app, count its statements, sit idle, write the JSON."""
    import sqlalchemy as sa

    from .bench_app import from_env

    boot = time.time()
    statements: list[tuple[float, str]] = []

    def on_statement(*_: Any) -> None:
        statements.append((time.time(), threading.current_thread().name))

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", on_statement)
    bench = from_env()
    bench.app.test_client().get("/")  # starts the background jobs, as a first request does
    time.sleep(max(0.0, boot + spec["warmup"] + spec["window"] + 0.2 - time.time()))
    with open(spec["out"], "w") as f:
        json.dump({"boot": boot, "statements": list(statements)}, f)
    bench.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks idle`")
