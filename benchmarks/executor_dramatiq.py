"""The Dramatiq plug-in of the ``executors`` scenario, and Dramatiq's per-task cost by threads.

As a plug-in (:mod:`benchmarks.executors` imports it): one ``dramatiq`` command
with ONE worker process (``--processes 1``) of :data:`THREADS` threads, the app
loaded once per worker process by ``flask_mail_outbox.contrib.dramatiq:setup``
from ``FLASK_APP``; its SMTP connections are the app's ``OUTBOX_CONCURRENCY``
(the scenario sets it).

Run alone, ``python -m benchmarks.executor_dramatiq [--tasks 200] [--rounds 3]``
measures what one task costs with 1, 2 and 8 threads, with a sink that answers
at once: N emails, each published as a task of its own (one id), delivered by
ONE worker process, from the first publish to the sink's last receipt, per task.
Threads of one process share one drain (``Worker._drain_lock``): a thread
whose task arrives while another drains hands its ids to that drain and waits,
so threads beyond a few add waiting, not connections.

Needs PostgreSQL (``scripts/pg-cluster``), ``redis-server`` and dramatiq.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

ENGINE = "dramatiq"
APP = "benchmarks.bench_app:create_app"
#: Threads of the worker process (Dramatiq's default): one drains, the tasks of the
#: others join its drain (measured: 1-2 threads ~62 ms per one-email task against a
#: 50 ms server with 4 connections, 8 threads ~30 ms, 16 ~28 ms).
THREADS = 8


def available() -> str | None:
    """None, or why Dramatiq cannot run here."""
    try:
        import dramatiq  # noqa: F401
        import redis  # noqa: F401
    except ImportError as exc:
        return f"dramatiq is not installed (pip install 'flask-mail-outbox[dramatiq]'): {exc}"
    if not (shutil.which("redis-server") or os.path.exists("/usr/bin/redis-server")):
        return "redis-server is not installed"
    return None


def config(broker_url: str) -> dict[str, object]:
    """The app's keys: Dramatiq on ``broker_url`` (the web side then runs no dispatcher)."""
    return {"OUTBOX_EXECUTOR": "dramatiq", "OUTBOX_EXECUTOR_URL": broker_url}


def worker_command(*, broker_url: str, queue: str, concurrency: int,
                   threads: int | None = None) -> list[str]:
    """ONE worker process of ``threads`` threads (default: twice the connections, at
    least :data:`THREADS`) on ``queue`` and its urgent queue; its ``concurrency`` SMTP
    connections are the app's ``OUTBOX_CONCURRENCY``."""
    del broker_url  # the app's OUTBOX_EXECUTOR_URL
    threads = threads or max(THREADS, 2 * concurrency)
    return [sys.executable, "-m", "dramatiq", "flask_mail_outbox.contrib.dramatiq:setup",
            "--processes", "1", "--threads", str(threads),
            "--queues", queue, f"{queue}.urgent"]


def extra_env(broker_url: str) -> dict[str, str]:
    """How the worker finds the app: as ``flask`` does (``FLASK_APP``)."""
    return {"FLASK_APP": APP}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def per_task_cost(tasks: int, rounds: int, threads: tuple[int, ...] = (1, 2, 8),
                  delay: float = 0.0) -> dict[int, list[float]]:
    """Milliseconds per one-email task for each thread count (see the module docstring)."""
    from benchmarks._harness import Context, bench_env, log
    from benchmarks.bench_app import build
    from flask_mail_outbox.contrib.dramatiq import executor

    ctx = Context()
    results: dict[int, list[float]] = {n: [] for n in threads}
    try:
        port = _free_port()
        ctx.spawn(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                  env={}, name="redis", stdout=subprocess.DEVNULL)
        broker = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
        sink = ctx.sink(delay)
        [(_, url)] = ctx.databases("pg", "dramatiq_cost", fallback=False)
        cfg = {"OUTBOX_DURABLE": True, "OUTBOX_CONCURRENCY": 4, **config(broker)}
        bench = build(url, sink.smtp_port, **cfg)
        publisher = executor(bench.app)
        for round_ in range(rounds):
            for n in threads:
                with bench.app.app_context():
                    bench.db.session.execute(sa.text("DELETE FROM outbox_email"))
                    bench.db.session.commit()
                # Not due: nothing published at these commits.
                bench.enqueue(tasks, "cost", send_after=timedelta(hours=1))
                env = {**bench_env(url, sink.smtp_port, cfg), **extra_env(broker)}
                proc = ctx.spawn(worker_command(broker_url=broker, queue="outbox",
                                                concurrency=4, threads=n),
                                 env=env, name="dramatiq-worker", stdout=subprocess.DEVNULL)
                sink.reset()
                bench.enqueue(1, "warm-up")  # due now: published, delivered
                sink.wait_for(1, timeout=60, procs=[proc])
                with bench.app.app_context():
                    ids = [int(i) for i in bench.db.session.execute(sa.text(
                        "UPDATE outbox_email SET due_at = :now WHERE status = 'queued' "
                        "RETURNING id"), {"now": datetime.now(UTC).replace(tzinfo=None)}
                    ).scalars()]
                    bench.db.session.commit()
                    bench.db.session.remove()
                sink.reset()
                started = time.time()
                for email_id in sorted(ids):
                    publisher.publish([email_id])
                stats = sink.wait_for(len(ids), timeout=600, procs=[proc])
                elapsed = float(stats["last"]) - started
                results[n].append(1000.0 * elapsed / len(ids))
                log(f"round {round_ + 1} threads={n}: {len(ids)} tasks in {elapsed:.2f} s, "
                    f"{results[n][-1]:.1f} ms/task")
                proc.terminate()
                proc.wait(30)
        bench.stop()
    finally:
        ctx.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="the sink's answer delay (0: at once)")
    args = parser.parse_args()
    results = per_task_cost(args.tasks, args.rounds, delay=args.delay_ms / 1000)
    print(json.dumps({f"threads={n}": {"ms_per_task_median": round(statistics.median(v), 2),
                                       "rounds": [round(x, 2) for x in v]}
                      for n, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
