"""The ``limits`` rows that bring in something other than the outbox's workers.

* ``celery-peer``: Celery (Redis broker, prefork, 4 processes) running
  :mod:`benchmarks.celery_peer`'s Flask-Mail task on the 100 ms sink, compared
  with the outbox's ``latency-4x8`` row of the same run;
* ``post-office-peer``: django-post-office (:mod:`benchmarks.post_office_peer`,
  its own virtualenv), ``send_queued_mail --processes 4`` on the same sink,
  compared with the same row;
* ``sink-limit``: :mod:`benchmarks.rawclient` against Postfix's ``smtp-sink``
  (the fastest a client goes there), then one worker draining a committed
  backlog to the same sink;
* ``priority``: a high-priority email sent while a deep low-priority backlog
  drains (only when ``OutboxMail.send`` takes ``priority``).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._harness import (
    Sink,
    children_of,
    cpu_seconds,
    free_port,
    log,
    log_path,
    median,
    ratio,
    stop_process,
    tail,
    wait_port,
)
from .limits import (
    HOLD,
    Row,
    _Bench,
    _enqueue,
    _latency,
    _producer,
    _spawn_workers,
    _wait_until,
    steady_rate,
)

#: Raw-client variants: messages in flight per connection (1: RFC 2920 to the letter).
RAW_DEPTHS = (1, 8)


# -- celery-peer ----------------------------------------------------------------------------

def _redis(bench: _Bench) -> str:
    """A private redis-server on a loopback port (no persistence); returns its URL."""
    port = free_port()
    directory = bench.ctx.workdir / f"redis-{port}"
    directory.mkdir()
    bench.ctx.spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                     "--dir", str(directory), "--save", "", "--appendonly", "no",
                     "--logfile", str(directory / "redis.log")], env={}, name="redis")
    wait_port(port, 15)
    return f"redis://127.0.0.1:{port}/0"


def celery_row(bench: _Bench) -> Row:
    """Celery + Flask-Mail, 4 prefork processes, on the latency-bound sink."""
    if importlib.util.find_spec("celery") is None or shutil.which("redis-server") is None:
        return Row("celery-peer", None, "msg/s", None, None, "outbox >= 5 x Celery", None,
                   note="not available: needs celery[redis] and redis-server "
                        "(benchmarks/setup installs both)")
    from .celery_peer import enqueue

    plan = bench.plan
    sink = bench.sink("delayed")
    broker = _redis(bench)
    env = {"BENCH_REDIS_URL": broker, "BENCH_SMTP_PORT": str(sink.smtp_port)}
    worker = bench.ctx.spawn([sys.executable, "-m", "celery", "-A", "benchmarks.celery_peer",
                              "worker", "--pool", "prefork", "-c", "4", "--loglevel",
                              "WARNING", "--without-gossip", "--without-mingle",
                              "--without-heartbeat"], env=env, name="celery-worker",
                             stdout=bench.ctx.log_file("celery-worker-stdout"))
    try:
        sink.reset()
        enqueue(broker, 8)  # the pool is up once these arrived
        _wait_until(time.time() + 60, lambda: sink.stats()["count"] >= 8, [worker])
        if sink.stats()["count"] < 8:
            raise RuntimeError(f"the Celery worker sent nothing:\n{tail(log_path(worker))}")
        sink.reset()
        n = plan.backlog(4 / plan.delay)
        started = time.time()
        enqueue(broker, n, start=8)
        t0 = started + plan.warmup
        _wait_until(t0 + plan.window + 0.5, lambda: sink.stats()["count"] >= n, [worker])
        times = [float(r[0]) for r in sink.receipts()]
    finally:
        code = stop_process(worker)
    rate, note = steady_rate(times, t0, plan.window, n)
    outbox = bench.done.get("latency-4x8")
    if outbox is None or outbox.measured is None:
        log("limits celery-peer: measuring the outbox's 4 workers x 8 for the comparison")
        outbox = _latency(4, 8)(bench)
    r = ratio(outbox.measured, rate)
    return Row("celery-peer", rate, "msg/s", None, r, "outbox 4 workers >= 5 x Celery",
               None if r is None else r >= 5.0,
               note=(f"ratio = outbox latency-4x8 ({outbox.measured or 0:.0f} msg/s, 4 workers "
                     f"x 8 connections) / Celery prefork -c 4, Flask-Mail mail.send (a "
                     f"connection per message), same {plan.delay * 1000:g} ms sink"
                     + (f"; {note}" if note else "")),
               data={"n": n, "rate": rate, "outbox_rate": outbox.measured,
                     "exit_code": code})


# -- post-office-peer ------------------------------------------------------------------------

#: django-post-office's ``send_queued_mail --processes``, as the brief of issue 18 runs it.
PO_PROCESSES = 4
#: Its ``THREADS_PER_PROCESS`` default: each thread keeps one SMTP connection for a batch.
PO_THREADS = 5
#: Its ``STATUS`` integers (``post_office.models.STATUS``).
PO_STATUS = {0: "sent", 1: "failed", 2: "queued", 3: "requeued"}


def _django(bench: _Bench, python: Path, project: Path, args: list[str], name: str,
            timeout: float = 600) -> str:
    """Run one of the project's commands to the end; returns its stdout."""
    from .post_office_peer import project_env

    child = bench.ctx.spawn([str(python), *args], env=project_env(project), name=name,
                            stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=timeout)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} exited {child.returncode}:\n"
                           f"{tail(log_path(child))}")
    return str(out)


def _post_office_project(bench: _Bench, sink: Sink) -> tuple[Path, Path, str]:
    """The virtualenv's python, the migrated project and its database URL."""
    from .bench_app import RECIPIENT, SENDER
    from .drain import BODY
    from .post_office_peer import ensure_venv, write_project

    python = ensure_venv()
    _, url = bench.ctx.postgres().create_database("limits_post_office")
    project = write_project(bench.ctx.workdir / "post-office", database_url=url,
                            smtp_port=sink.smtp_port,
                            message={"sender": SENDER, "recipient": RECIPIENT, "body": BODY})
    _django(bench, python, project, [str(project / "manage.py"), "migrate", "-v", "0"],
            "post-office-migrate")
    return python, project, url


def _stop_tree(proc: subprocess.Popen[Any]) -> int | None:
    """SIGTERM the command and then the pool processes it forked (orphans otherwise)."""
    children = children_of(proc.pid)
    code = stop_process(proc)
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return code


def _post_office_drain(bench: _Bench, python: Path, project: Path, sink: Sink, n: int
                       ) -> dict[str, Any]:
    """``send_queued_mail --processes 4`` on the queued backlog, for the steady window."""
    from .post_office_peer import project_env

    plan = bench.plan
    sink.reset()
    started = time.time()
    proc = bench.ctx.spawn([str(python), str(project / "manage.py"), "send_queued_mail",
                            "--processes", str(PO_PROCESSES),
                            "--lockfile", str(project / "send_queued_mail")],
                           env=project_env(project), name="post-office-send")
    t0 = started + plan.warmup
    try:
        # The command exits once nothing is queued: that ends the wait too.
        while (time.time() < t0 + plan.window + 0.5 and proc.poll() is None
               and sink.stats()["count"] < n):
            time.sleep(0.1)
        exited = proc.poll()
        stats = sink.stats()
        times = [float(r[0]) for r in sink.receipts()]
    finally:
        code = _stop_tree(proc)
    if exited not in (None, 0):
        raise RuntimeError(f"send_queued_mail exited {exited}:\n{tail(log_path(proc))}")
    return {"times": times, "t0": t0, "stats": stats, "exit_code": code,
            "stopped_mid_run": exited is None}


def _post_office_statuses(url: str) -> dict[str, int]:
    from .drain import _admin

    rows = _admin(url, "SELECT status, count(*) FROM post_office_email GROUP BY status")[0]
    return {PO_STATUS.get(status, str(status)): int(count) for status, count in rows}


def post_office_row(bench: _Bench) -> Row:
    """django-post-office, ``send_queued_mail --processes 4``, on the latency-bound sink."""
    from .post_office_peer import VenvUnavailable

    plan = bench.plan
    goal = "reported"
    sink = bench.sink("delayed")
    try:
        python, project, url = _post_office_project(bench, sink)
    except VenvUnavailable as exc:
        return Row("post-office-peer", None, "msg/s", None, None, goal, None,
                   note=f"skipped: {exc} (benchmarks/setup makes the virtualenv)")
    limit = PO_PROCESSES * PO_THREADS / plan.delay
    n = plan.backlog(limit)
    queued = json.loads(_django(bench, python, project, [str(project / "enqueue.py"), str(n)],
                                "post-office-enqueue").strip().splitlines()[-1])
    got = _post_office_drain(bench, python, project, sink, n)
    rate, note = steady_rate(got["times"], got["t0"], plan.window, n)
    statuses = _post_office_statuses(url)
    outbox = bench.done.get("latency-4x8")
    if outbox is None or outbox.measured is None:
        log("limits post-office-peer: measuring the outbox's 4 workers x 8 for the comparison")
        outbox = _latency(4, 8)(bench)
    r = ratio(outbox.measured, rate)
    own = ratio(rate, limit)
    enqueue_rate = n / max(float(queued["seconds"]), 1e-9)
    # Delivered, yet still "queued": a batch's statuses are written after the whole batch.
    unrecorded = int(got["stats"]["count"]) - statuses.get("sent", 0)
    outbox_enqueue = outbox.data.get("enqueue_rate")
    return Row(
        "post-office-peer", rate, "msg/s", None, r, goal, None,
        note=(f"ratio = outbox latency-4x8 ({outbox.measured or 0:.0f} msg/s, 32 connections) "
              f"/ django-post-office send_queued_mail --processes {PO_PROCESSES} (library "
              f"defaults: {PO_THREADS} threads, one SMTP connection each, batches of 100), "
              f"same {plan.delay * 1000:g} ms sink; its own limit {PO_PROCESSES} x "
              f"{PO_THREADS} / {plan.delay * 1000:g} ms = {limit:.0f} msg/s, reached "
              f"{own or 0:.2f}; no goal: the two limits differ by configuration (320 vs "
              f"{limit:.0f}), not design; enqueue (500 per transaction) "
              f"{enqueue_rate:.0f} msg/s" + (f" vs outbox {outbox_enqueue:.0f}"
                                             if outbox_enqueue else "")
              + f"; stopped by SIGTERM with {unrecorded} delivered emails still unmarked"
              + (f"; {note}" if note else "")),
        data={"n": n, "rate": rate, "limit": limit, "of_limit": own,
              "outbox_rate": outbox.measured, "enqueue_rate": enqueue_rate,
              "outbox_enqueue_rate": outbox_enqueue, "statuses": statuses,
              "delivered_unrecorded": unrecorded, "processes": PO_PROCESSES,
              "threads": PO_THREADS, "exit_code": got["exit_code"],
              "stopped_mid_run": got["stopped_mid_run"]})


# -- sink-limit ----------------------------------------------------------------------------

def _raw(bench: _Bench, sink: Sink, depth: int) -> float:
    """One raw-client run of ``plan.raw_n`` messages; the sink must count every one."""
    n = bench.plan.raw_n
    sink.reset()
    child = bench.ctx.spawn([sys.executable, "-m", "benchmarks.rawclient", "--port",
                             str(sink.smtp_port), "--n", str(n), "--connections", "4",
                             "--depth", str(depth)], env={}, name=f"rawclient-{depth}",
                            stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=300)
    if child.returncode != 0 or not out.strip():
        raise RuntimeError(f"the raw client failed (exit {child.returncode}):\n"
                           f"{tail(log_path(child))}")
    result = json.loads(out.strip().splitlines()[-1])
    got = sink.wait_for(n, timeout=10)["count"]
    if got != n:
        raise RuntimeError(f"raw client depth {depth}: the sink counted {got} of {n}")
    return float(result["rate"])


def _drain(bench: _Bench, sink: Sink, url: str, producer: Any, round_no: int
           ) -> tuple[float, dict[str, float]]:
    """One worker (library defaults, 4 connections) drains ``plan.drain_n`` committed emails.

    Returns msg/s and the CPU ms per message of the worker, PostgreSQL and the sink.
    """
    from .drain import _counts, _release, _reset

    n = bench.plan.drain_n
    _reset(url)
    _enqueue(producer, n, f"sink-limit r{round_no}", send_after=HOLD)
    procs = _spawn_workers(bench, url, sink.smtp_port, workers=1, concurrency=4, config={},
                           name=f"limits-sink-{round_no}")
    parts: dict[str, Callable[[], list[int]]] = {
        "worker": lambda: [p.pid for p in procs], "postgres": bench.ctx.postgres().pids,
        "sink": lambda: [sink.pid]}
    try:
        sink.reset()
        before = {k: cpu_seconds(pids()) for k, pids in parts.items()}
        released = _release(url)
        _wait_until(time.time() + 120 + n / 50, lambda: sink.stats()["count"] >= n, procs)
        stats = sink.stats()
        cpu = {k: 1000 * (cpu_seconds(pids()) - before[k]) / n for k, pids in parts.items()}
    finally:
        for proc in procs:
            stop_process(proc)
    if stats["count"] < n:
        raise RuntimeError(f"the drain delivered {stats['count']} of {n}")
    counts = _counts(url)
    if counts.get("sent", 0) != n:
        raise RuntimeError(f"after the drain the rows are {counts}")
    return n / max(float(stats["last"]) - released, 1e-9), cpu


def sink_limit_row(bench: _Bench) -> Row:
    """The raw client's rate is the limit; one worker's drain is compared with it."""
    from ._harness import postfix_sink_available

    goal = "drain >= 0.5 x limit"
    if not postfix_sink_available():
        return Row("sink-limit", None, "msg/s", None, None, goal, None,
                   note="not available: no /usr/sbin/smtp-sink (benchmarks/setup installs it)")
    sink = bench.ctx.throughput_sink()
    url = bench.database("limits_sink")
    producer = _producer(url, sink.smtp_port)
    raw: dict[int, list[float]] = {d: [] for d in RAW_DEPTHS}
    drains: list[float] = []
    cpus: list[dict[str, float]] = []
    try:
        for round_no in range(bench.plan.rounds):
            for depth in RAW_DEPTHS:
                raw[depth].append(_raw(bench, sink, depth))
            rate, cpu = _drain(bench, sink, url, producer, round_no)
            drains.append(rate)
            cpus.append(cpu)
            log(f"limits sink-limit round {round_no + 1}: raw "
                + ", ".join(f"depth {d} {raw[d][-1]:.0f}" for d in RAW_DEPTHS)
                + f" msg/s; drain {drains[-1]:.0f} msg/s")
    finally:
        producer.extensions["mail_outbox"].ext.stop(timeout=5)
    raw_medians = {d: median(v) for d, v in raw.items()}
    best = max(RAW_DEPTHS, key=lambda d: raw_medians[d] or 0.0)
    limit = raw_medians[best]
    drain = median(drains)
    cpu_ms = {k: median(c[k] for c in cpus) for k in cpus[0]} if cpus else {}
    r = ratio(drain, limit)
    return Row("sink-limit", drain, "msg/s", limit, r, goal, None if r is None else r >= 0.5,
               note=(f"limit = the raw client's median over {bench.plan.rounds} round(s), "
                     f"4 connections, {best} message(s) in flight each ("
                     + ", ".join(f"depth {d}: {raw_medians[d] or 0:.0f}" for d in RAW_DEPTHS)
                     + f" msg/s); drain = N={bench.plan.drain_n} / (last receipt - release), "
                       "one worker, library defaults (4 connections); CPU ms per message "
                       "in the drain: "
                     + ", ".join(f"{k} {v or 0:.3f}" for k, v in cpu_ms.items())),
               data={"raw": raw, "raw_medians": raw_medians, "drains": drains,
                     "drain_cpu_ms_per_msg": cpu_ms})


# -- priority ------------------------------------------------------------------------------

def priority_available() -> bool:
    """Whether ``OutboxMail.send`` takes ``priority`` (issue 18's priorities)."""
    from flask_mail_outbox import OutboxMail

    return "priority" in inspect.signature(OutboxMail.send).parameters


def priority_row(bench: _Bench) -> Row:
    """Emails the sink receives between a high one's commit and the high one."""
    if not priority_available():
        return Row("priority", None, "emails", None, None, "<= 2 batches", None,
                   note="not available yet: OutboxMail.send() takes no priority")
    from flask_mail_outbox import Message

    from .bench_app import RECIPIENT
    from .drain import _release

    plan = bench.plan
    sink = bench.sink("plain")
    url = bench.database("limits_priority")
    producer = _producer(url, sink.smtp_port)
    batch = 100  # OUTBOX_BATCH_SIZE's default, what the workers run with
    try:
        _enqueue(producer, plan.priority_n, "low", send_after=HOLD, priority="low")
        procs = _spawn_workers(bench, url, sink.smtp_port, workers=1, concurrency=4,
                               config={}, name="limits-priority")
        try:
            sink.reset()
            _release(url)
            _wait_until(time.time() + 60, lambda: sink.stats()["count"] >= 2 * batch, procs)
            state = producer.extensions["mail_outbox"]
            with producer.app_context():
                state.ext.send(Message("high", recipients=[RECIPIENT], body="high",
                                       extra_headers={"X-Bench-Id": "high"}), priority="high")
                committed = time.time()
                state.db.session.commit()
                state.db.session.remove()

            def arrived() -> bool:
                return any(r[2] == "high" for r in sink.receipts())

            _wait_until(time.time() + 120, arrived, procs, poll=0.2)
            receipts = sink.receipts()
        finally:
            for proc in procs:
                stop_process(proc)
    finally:
        producer.extensions["mail_outbox"].ext.stop(timeout=5)
    at = next((i for i, r in enumerate(receipts) if r[2] == "high"), None)
    if at is None:
        return Row("priority", None, "emails", 2 * batch, None, "<= 2 batches", False,
                   note="the high-priority email did not arrive within 120 s")
    before = sum(1 for r in receipts[:at] if float(r[0]) >= committed)
    r = ratio(before, 2 * batch)
    return Row("priority", float(before), "emails", float(2 * batch), r, "<= 2 batches",
               before <= 2 * batch,
               note=(f"emails the sink received between the high one's commit and its "
                     f"arrival, {plan.priority_n} low queued (it was number {at + 1} overall)"),
               data={"before": before, "position": at + 1})
