"""The Celery engine of the ``executors`` scenario (``benchmarks/executors.py``).

One worker process is ``python -m benchmarks.executor_celery --broker URL --queue Q
--concurrency C``: a Celery app on ``URL`` made this process's current app, the
benchmark app (:func:`benchmarks.bench_app.from_env`, ``OUTBOX_CONCURRENCY=C``), then
``celery worker`` in this process with the settings docs/executors/celery.md
recommends: the threads pool (:data:`THREADS` task threads sharing the process's one
outbox core and its C SMTP connections), prefetch multiplier 1, early acks.

The benchmark process publishes through the current Celery app too: :func:`config`
makes one on the broker (the app finds it there when it has no
``app.extensions["celery"]``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys

ENGINE = "celery"
#: Task threads per worker process at least; worker_command gives twice the connections
#: (one-email tasks: threads bound how many are on the wire; docs/executors/celery.md).
THREADS = 1

#: The worker's app, kept alive for as long as the worker runs.
_apps: list[object] = []


def available() -> str | None:
    """None, or why the Celery executor cannot run here."""
    if importlib.util.find_spec("celery") is None or importlib.util.find_spec("redis") is None:
        return "celery or redis (the Python client) is not installed: pip install " \
               "'flask-mail-outbox[celery]' redis"
    if shutil.which("redis-server") is None and not os.path.exists("/usr/bin/redis-server"):
        return "redis-server is not installed (apt-get install redis-server)"
    return None


def use_broker(broker_url: str) -> None:
    """Make a Celery app on ``broker_url`` this process's current (default) app."""
    from celery import Celery

    Celery("outbox_bench", broker=broker_url,
           broker_connection_retry_on_startup=True).set_default()


def config(broker_url: str) -> dict[str, object]:
    """The app config keys of the Celery executor; also makes this process publish to
    ``broker_url`` (see the module docstring)."""
    use_broker(broker_url)
    return {"OUTBOX_EXECUTOR": "celery"}


def worker_command(*, broker_url: str, queue: str, concurrency: int) -> list[str]:
    """One Celery worker process delivering with ``concurrency`` SMTP connections."""
    return [sys.executable, "-m", "benchmarks.executor_celery", "--broker", broker_url,
            "--queue", queue, "--concurrency", str(concurrency),
            "--threads", str(max(THREADS, 2 * concurrency))]


def extra_env(broker_url: str) -> dict[str, str]:
    """Nothing: the worker's module makes its app (from the ``BENCH_*`` variables)."""
    return {}


def main(argv: list[str] | None = None) -> None:
    """Run one worker (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.executor_celery")
    parser.add_argument("--broker", required=True)
    parser.add_argument("--queue", default="outbox")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="SMTP connections (OUTBOX_CONCURRENCY)")
    parser.add_argument("--threads", type=int, default=THREADS, help="Celery task threads")
    args = parser.parse_args(argv)
    extra = json.loads(os.environ.get("BENCH_CONFIG") or "{}")
    extra.update(OUTBOX_EXECUTOR="celery", OUTBOX_EXECUTOR_QUEUE=args.queue,
                 OUTBOX_CONCURRENCY=args.concurrency)
    os.environ["BENCH_CONFIG"] = json.dumps(extra)
    use_broker(args.broker)
    from celery import current_app

    from .bench_app import from_env

    # The tasks find the app in a weak registry: this process keeps it (a module's
    # variable in a real worker), and its init_app imports the tasks.
    _apps.append(from_env().app)
    current_app.worker_main(["worker", "-Q", args.queue, "--pool", "threads",
                             "--concurrency", str(args.threads), "--prefetch-multiplier", "1",
                             "--without-gossip", "--without-mingle", "--without-heartbeat",
                             "--loglevel", os.environ.get("BENCH_CELERY_LOGLEVEL", "WARNING")])


if __name__ == "__main__":
    main()
