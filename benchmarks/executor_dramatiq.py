"""The Dramatiq plug-in of the ``executors`` scenario.

:mod:`benchmarks.executors` imports it: one ``dramatiq`` command with ONE worker
process (``--processes 1``) of twice as many threads as connections (at least
:data:`THREADS`), the app loaded once per worker process by
``flask_mail_outbox.contrib.dramatiq:setup`` from ``FLASK_APP``; its SMTP
connections are the app's ``OUTBOX_CONCURRENCY`` (the scenario sets it). The
threads of one process share its delivery loop: they bound how many one-email
tasks are on the wire at once (``python -m benchmarks executors --ids-per-task 1``).

Needs PostgreSQL (``scripts/pg-cluster``), ``redis-server`` and dramatiq.
"""

from __future__ import annotations

import os
import shutil
import sys

ENGINE = "dramatiq"
APP = "benchmarks.bench_app:create_app"
#: Threads of the worker process at least (Dramatiq's default); worker_command gives
#: twice the connections (docs/executors/dramatiq.md has the measured difference).
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
