"""``peers``: the outbox against how Flask (and Django) apps send email in the background today.

The same N emails, the same sink answering each after ``--delay-ms`` (a provider's
latency), one row per sender, msg/s from the first to the last receipt:

* ``outbox``: 4 ``flask outbox worker --concurrency 8`` processes draining a
  released backlog (:func:`benchmarks.drain.start_drain`); always runs;
* ``flask-mail``: Flask-Mail's ``mail.send()`` from 4 threads of this process,
  a connection per message (what a request or a thread pool does);
* ``celery``: Celery (Redis broker, ``--pool prefork -c 4``) running a task
  that calls Flask-Mail's ``mail.send()`` (:mod:`.celery_app`); needs the
  ``celery`` and ``redis`` packages (the ``bench`` extra) and ``redis-server``;
* ``post-office``: django-post-office's ``send_queued_mail --processes 4``
  (:mod:`.post_office`); needs PostgreSQL and ``BENCH_POST_OFFICE_PYTHON``.

A peer whose software is missing is skipped with a line naming what is missing;
``benchmarks/peers/README.md`` says how to install each. Nothing here imports
anything private of flask_mail_outbox.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .._harness import (
    Context,
    Report,
    Sink,
    Table,
    free_port,
    log,
    ratio,
    stop_process,
    wait_port,
)
from ..bench_app import BODY, RECIPIENT, SENDER, build
from ..drain import drain_once

NAME = "peers"
HELP = "the outbox vs Flask-Mail, Celery + Flask-Mail and django-post-office, same slow sink"
SMOKE = ["--n", "40", "--delay-ms", "20"]
PEERS = ("outbox", "flask-mail", "celery", "post-office")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1000, help="emails per peer")
    parser.add_argument("--delay-ms", type=float, default=100.0,
                        help="the sink's wait before each 250")
    parser.add_argument("--peers", default=",".join(PEERS), help=", ".join(PEERS))


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink(args.delay_ms / 1000)
    runners = {"outbox": _outbox, "flask-mail": _flask_mail, "celery": _celery,
               "post-office": _post_office}
    table = Table(f"{args.n} emails, sink answering after {args.delay_ms:g} ms",
                  ["peer", "how", "msg/s", "outbox / peer"])
    report = Report(NAME, tables=[table])
    rates: dict[str, float | None] = {}
    for peer in [p.strip() for p in args.peers.split(",") if p.strip()]:
        missing = _missing(ctx, peer)
        if missing:
            log(f"peers: skipping {peer}: {missing}")
            report.notes.append(f"{peer}: skipped, {missing}")
            continue
        sink.reset()
        how, rates[peer] = runners[peer](ctx, sink, args.n)
        log(f"peers {peer}: {rates[peer]:.0f} msg/s")
        report.figures[f"{peer} msg/s"] = rates[peer]
        table.add(peer, how, rates[peer], ratio(rates.get("outbox"), rates[peer]))
    return report


def _missing(ctx: Context, peer: str) -> str | None:
    """What the peer needs and this machine lacks, or None."""
    needs = {"flask-mail": ["flask_mail"], "celery": ["celery", "redis", "flask_mail"]}
    for module in needs.get(peer, []):
        if importlib.util.find_spec(module) is None:
            return f"the {module} package is not installed (pip install -e '.[bench]')"
    if peer == "celery" and shutil.which("redis-server") is None:
        return "no redis-server on PATH (apt-get install redis-server)"
    if peer == "post-office":
        if not ctx.has_postgres:
            return "no PostgreSQL server binaries"
        if not os.environ.get("BENCH_POST_OFFICE_PYTHON"):
            return "BENCH_POST_OFFICE_PYTHON is not set (see benchmarks/peers/README.md)"
    return None


def _first_to_last(stats: dict[str, Any]) -> float:
    return (stats["count"] - 1) / max(stats["last"] - stats["first"], 1e-9)


def _outbox(ctx: Context, sink: Sink, n: int) -> tuple[str, float]:
    backend, url = ctx.databases("pg", "peers")[0]
    workers = 4 if backend == "pg" else 1
    bench = build(url, sink.smtp_port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                  OUTBOX_RUN_SCHEDULER=False)
    try:
        rate = drain_once(ctx, bench, url, sink, n=n, workers=workers, concurrency=8)
    finally:
        bench.stop()
    return f"{workers} worker(s) x --concurrency 8, {backend}", rate


def _flask_mail(ctx: Context, sink: Sink, n: int) -> tuple[str, float]:
    from flask import Flask
    from flask_mail import Mail, Message

    app = Flask("bench_flask_mail")
    app.config.update(MAIL_SERVER="127.0.0.1", MAIL_PORT=sink.smtp_port,
                      MAIL_DEFAULT_SENDER=SENDER, MAIL_SUPPRESS_SEND=False)
    mail = Mail(app)

    def share(part: range) -> None:
        with app.app_context():
            for i in part:
                mail.send(Message(f"flask-mail #{i}", recipients=[RECIPIENT], body=BODY))

    threads = [threading.Thread(target=share, args=(range(t, n, 4),)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return "mail.send() from 4 threads", _first_to_last(sink.wait_for(n, timeout=10))


def _celery(ctx: Context, sink: Sink, n: int) -> tuple[str, float]:
    from .celery_app import enqueue

    port = free_port()
    redis = ctx.spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save",
                       "", "--appendonly", "no"], env={}, name="redis",
                      stdout=subprocess.DEVNULL)
    wait_port(port, 10, [redis])
    broker = f"redis://127.0.0.1:{port}/0"
    worker = ctx.spawn([sys.executable, "-m", "celery", "-A", "benchmarks.peers.celery_app",
                        "worker", "--pool", "prefork", "-c", "4", "--loglevel", "WARNING"],
                       env={"BENCH_REDIS_URL": broker, "BENCH_SMTP_PORT": str(sink.smtp_port)},
                       name="celery", stdout=subprocess.DEVNULL)
    try:
        enqueue(broker, n)
        stats = sink.wait_for(n, timeout=60 + n * 0.5, procs=[worker])
    finally:
        stop_process(worker)
        stop_process(redis)
    if stats["count"] < n:
        raise RuntimeError(f"celery delivered {stats['count']} of {n}")
    return "prefork -c 4, Flask-Mail mail.send()", _first_to_last(stats)


def _post_office(ctx: Context, sink: Sink, n: int) -> tuple[str, float]:
    from .post_office import write_project

    python = os.environ["BENCH_POST_OFFICE_PYTHON"]
    project = ctx.workdir / "post-office"
    env = write_project(project, database_url=ctx.postgres().create_database("post_office"),
                        smtp_port=sink.smtp_port,
                        message={"sender": SENDER, "recipient": RECIPIENT, "body": BODY})

    def manage(*command: str) -> None:
        proc = ctx.spawn([python, *command], env=env, name="post-office",
                         stdout=subprocess.DEVNULL)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}")

    manage(str(project / "manage.py"), "migrate", "-v", "0")
    manage(str(project / "enqueue.py"), str(n))
    started = time.time()
    manage(str(project / "manage.py"), "send_queued_mail", "--processes", "4",
           "--lockfile", str(Path(project) / "send_queued_mail"))
    stats = sink.wait_for(n, timeout=10)
    log(f"peers post-office: {time.time() - started:.1f} s including its start-up")
    return "send_queued_mail --processes 4 (5 threads each)", _first_to_last(stats)
