"""The RQ plug-in of the ``executors`` scenario, and RQ's per-job cost by worker class.

As a plug-in (:mod:`benchmarks.executors` imports it): one ``rq worker`` process
of :class:`flask_mail_outbox.contrib.rq.OutboxWorker` (the app loaded at start,
every job in that process), finding the app through ``FLASK_APP``.

Run alone, ``python -m benchmarks.executor_rq [--jobs 200] [--rounds 3]`` measures
what one job costs on each way to run RQ's worker, with a sink that answers at
once: N emails, each published as a job of its own (one id), delivered by ONE
worker process, from the first publish to the sink's last receipt, per job:

* ``OutboxWorker``: :class:`rq.SimpleWorker`, the app loaded at start (the recommended one);
* ``ForkingWorker``: RQ's default :class:`rq.Worker`, a work-horse forked per job,
  the app loaded in the parent (the outbox's core is rebuilt in each work-horse:
  a new database pool and SMTP connection per job);
* ``rq.Worker`` with ``FLASK_APP`` only: the app is created in each work-horse.

Needs PostgreSQL (``scripts/pg-cluster``), ``redis-server`` and rq.
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
from typing import Any

import sqlalchemy as sa

try:
    from rq import Worker
except ImportError:  # available() says why
    Worker = object  # type: ignore[assignment,misc]

ENGINE = "rq"
APP = "benchmarks.bench_app:create_app"
OUTBOX_WORKER = "flask_mail_outbox.contrib.rq.OutboxWorker"


def available() -> str | None:
    """None, or why RQ cannot run here."""
    try:
        import redis  # noqa: F401
        import rq  # noqa: F401
    except ImportError as exc:
        return f"rq is not installed (pip install 'flask-mail-outbox[rq]'): {exc}"
    if not (shutil.which("redis-server") or os.path.exists("/usr/bin/redis-server")):
        return "redis-server is not installed"
    return None


def config(broker_url: str) -> dict[str, object]:
    """The app's keys: RQ on ``broker_url`` (the web side then runs no dispatcher)."""
    return {"OUTBOX_EXECUTOR": "rq", "OUTBOX_EXECUTOR_URL": broker_url}


def worker_command(*, broker_url: str, queue: str, concurrency: int,
                   worker_class: str = OUTBOX_WORKER) -> list[str]:
    """ONE ``rq worker`` process; its ``concurrency`` SMTP connections are the app's
    ``OUTBOX_CONCURRENCY`` (the scenario sets it): RQ runs one job at a time, and a
    job delivers its ids over the outbox's connections."""
    del concurrency  # the app's OUTBOX_CONCURRENCY
    processes = int(os.environ.get("BENCH_RQ_PROCESSES", "1"))
    if processes > 1:  # RQ runs one job at a time per process: a pool runs several
        return [sys.executable, "-m", "rq.cli", "worker-pool", "-n", str(processes),
                "--worker-class", worker_class, "-u", broker_url, "--quiet", queue]
    return [sys.executable, "-m", "rq.cli", "worker", "--worker-class", worker_class,
            "-u", broker_url, "--quiet", queue]


def extra_env(broker_url: str) -> dict[str, str]:
    """How the worker finds the app: as ``flask`` does."""
    return {"FLASK_APP": APP}


class ForkingWorker(Worker):
    """RQ's default forking worker with the app created in the parent (for the comparison)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from flask_mail_outbox.contrib.rq import load_app

        load_app()


WORKERS = {
    "OutboxWorker (no fork, app at start)": OUTBOX_WORKER,
    "ForkingWorker (fork per job, app in parent)": "benchmarks.executor_rq.ForkingWorker",
    "rq.Worker + FLASK_APP (fork, app per job)": "rq.Worker",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def per_job_cost(jobs: int, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per one-email job of each worker class (see the module docstring)."""
    from benchmarks._harness import Context, bench_env, log
    from benchmarks.bench_app import build
    from flask_mail_outbox.contrib.rq import RQExecutor

    ctx = Context()
    results: dict[str, list[float]] = {name: [] for name in WORKERS}
    try:
        port = _free_port()
        ctx.spawn(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                  env={}, name="redis", stdout=subprocess.DEVNULL)
        broker = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.5)
        sink = ctx.sink(0.0)
        [(_, url)] = ctx.databases("pg", "rq_cost", fallback=False)
        cfg = {"OUTBOX_DURABLE": True, **config(broker)}
        bench = build(url, sink.smtp_port, **cfg)
        executor = RQExecutor(broker, "outbox")
        for round_ in range(rounds):
            for name, worker_class in WORKERS.items():
                with bench.app.app_context():
                    bench.db.session.execute(sa.text("DELETE FROM outbox_email"))
                    bench.db.session.commit()
                # Not due: nothing published at these commits.
                bench.enqueue(jobs, "cost", send_after=timedelta(hours=1))
                env = {**bench_env(url, sink.smtp_port, cfg), **extra_env(broker)}
                proc = ctx.spawn(worker_command(broker_url=broker, queue="outbox",
                                                concurrency=4, worker_class=worker_class),
                                 env=env, name="rq-worker")
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
                    executor.publish([email_id])
                stats = sink.wait_for(len(ids), timeout=600, procs=[proc])
                elapsed = float(stats["last"]) - started
                results[name].append(1000.0 * elapsed / len(ids))
                log(f"round {round_ + 1} {name}: {len(ids)} jobs in {elapsed:.2f} s, "
                    f"{results[name][-1]:.1f} ms/job")
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    log(f"{name}: the worker did not stop on SIGTERM in 30 s; killed")
                    proc.kill()
                    proc.wait(10)
        bench.stop()
    finally:
        ctx.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = per_job_cost(args.jobs, args.rounds)
    print(json.dumps({name: {"ms_per_job_median": round(statistics.median(v), 2),
                             "rounds": [round(x, 2) for x in v]}
                      for name, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
