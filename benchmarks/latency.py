"""``latency``: from ``commit()`` to the SMTP server's receipt, one email at a time.

For each configuration a producer child process (``python -m benchmarks.latency
--child SPEC``, an app of :mod:`benchmarks.bench_app` with the library's
defaults otherwise) sends single emails spaced 0.5-1 s apart (uniform, seeded),
each in its own app context and transaction, so the delivery side is idle
when each one arrives. It records ``time.time()`` just before ``commit()``
and just after it returns; the sink process records ``time.time()`` when it
has the whole message (same machine, same clock). Each email carries an
``X-Bench-Id`` header to join the two. The first ``--warmup`` emails (threads
and SMTP connection starting) are sent the same way and left out.

Configurations (``--configs``):

* ``durable-sqlite`` / ``durable-pg``: durable mode, the app process's own
  dispatcher (the commit wakes it in process);
* ``inline-sqlite`` / ``inline-pg``: inline mode (the default);
* ``worker-pg``: durable mode, ``OUTBOX_RUN_WORKER=False`` in the producer, and a
  separate ``flask outbox worker`` process woken by LISTEN/NOTIFY;
* ``worker-pg-nolisten``: the same with ``OUTBOX_LISTEN=False`` in both: the
  worker only polls (its backoff decides the latency).

Configurations run one after the other (not at once), so they do not disturb
each other's timing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ._harness import (
    Context,
    Report,
    Table,
    bench_env,
    log,
    log_path,
    median,
    percentile,
    stop_process,
    tail,
)
from ._registry import scenario

#: name -> (database, producer config, separate worker?, worker config)
CONFIGS: dict[str, tuple[str, dict[str, Any], bool, dict[str, Any]]] = {
    "durable-sqlite": ("sqlite", {"OUTBOX_DURABLE": True}, False, {}),
    "durable-pg": ("pg", {"OUTBOX_DURABLE": True}, False, {}),
    "inline-sqlite": ("sqlite", {"OUTBOX_DURABLE": False}, False, {}),
    "inline-pg": ("pg", {"OUTBOX_DURABLE": False}, False, {}),
    "worker-pg": ("pg", {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False}, True,
                  {"OUTBOX_DURABLE": True}),
    "worker-pg-nolisten": ("pg", {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False,
                                  "OUTBOX_LISTEN": False}, True,
                           {"OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False}),
}
DEFAULT_CONFIGS = ["durable-sqlite", "durable-pg", "inline-sqlite", "worker-pg"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="measured emails per configuration (default 30; --quick 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="emails sent first and left out (default 2)")
    parser.add_argument("--spacing", default="0.5,1",
                        help="seconds between emails, uniform MIN,MAX (default 0.5,1)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--seed", type=int, default=1)


@scenario("latency", "enqueue-to-delivery latency of single emails while idle",
          add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown latency config(s): {', '.join(unknown)}")
    n = args.n or (10 if args.quick else 30)
    low, high = (float(x) for x in args.spacing.split(","))
    sink = ctx.aiosmtpd_sink()
    table = Table(f"Latency from just before commit() to the sink's receipt, {n} single "
                  f"emails {low:g}-{high:g} s apart (ms)",
                  ["config", "delivered by", "n", "p50", "p90", "p99", "max", "mean",
                   "commit() p50", "missing"])
    report = Report("latency", tables=[table])
    results: dict[str, Any] = {}
    for name in names:
        backend, producer_config, separate, worker_config = CONFIGS[name]
        if backend == "pg":
            _, url = ctx.postgres().create_database(f"bench_lat_{name.replace('-', '_')}")
        else:
            url = f"sqlite:///{ctx.workdir / f'latency-{name}.db'}"
        create_tables(url)
        sink.reset()
        worker = None
        if separate:
            worker = ctx.spawn_worker(bench_env(url, sink.smtp_port, worker_config),
                                      concurrency=4, name=f"latency-worker-{name}")
            if worker_config.get("OUTBOX_LISTEN", True):
                _wait_listening(url, worker)
            else:
                time.sleep(3)  # no LISTEN to wait for: give it time to start
        out = ctx.workdir / f"latency-{name}.json"
        spec = {"name": name, "n": n, "warmup": args.warmup, "spacing": [low, high],
                "seed": args.seed, "out": str(out)}
        log(f"latency {name}: {args.warmup}+{n} emails, about "
            f"{(args.warmup + n) * (low + high) / 2:.0f} s")
        producer = ctx.spawn([sys.executable, "-m", "benchmarks.latency", "--child",
                              json.dumps(spec)],
                             env=bench_env(url, sink.smtp_port, producer_config),
                             name=f"latency-{name}")
        code = producer.wait(timeout=(args.warmup + n) * (high + 1) + 120)
        if code != 0 or not out.exists():
            raise RuntimeError(f"latency producer {name} failed (exit {code}):\n"
                               f"{tail(log_path(producer))}")
        sent = json.loads(out.read_text())["emails"]
        sink.wait_for(len(sent), timeout=60)
        if worker is not None:
            stop_process(worker)
        received = {r[2]: r[0] for r in sink.receipts() if r[2]}
        measured = [e for e in sent if not e["warmup"]]
        lat = [1000 * (received[e["id"]] - e["before_commit"]) for e in measured
               if e["id"] in received]
        commit_ms = [1000 * (e["after_commit"] - e["before_commit"]) for e in measured]
        missing = sum(1 for e in measured if e["id"] not in received)
        row = {"n": len(lat), "missing": missing, "p50_ms": percentile(lat, 50),
               "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
               "max_ms": max(lat) if lat else None,
               "mean_ms": sum(lat) / len(lat) if lat else None,
               "commit_p50_ms": median(commit_ms), "latencies_ms": lat,
               "commit_ms": commit_ms}
        results[name] = row
        by = ("worker process" if separate else "app process") + (
            "" if not separate else (" (LISTEN)" if worker_config.get("OUTBOX_LISTEN", True)
                                     else " (polling)"))
        table.add(name, by, len(lat), row["p50_ms"], row["p90_ms"], row["p99_ms"],
                  row["max_ms"], row["mean_ms"], row["commit_p50_ms"], missing)
    report.data = {"configs": results, "n": n, "spacing": [low, high]}
    report.notes += [
        f"percentiles over {n} samples (linear interpolation): p99 is close to the maximum",
        ("commit() p50: how long the producer's commit() took (after-commit hand-over "
        "included), i.e. what the request pays"),
    ]
    return report


def _wait_listening(url: str, worker: Any, timeout: float = 60) -> None:
    import sqlalchemy as sa

    database = sa.make_url(url).database
    engine = sa.create_engine(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}:\n"
                                   f"{tail(log_path(worker))}")
            with engine.connect() as conn:
                listening = conn.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = :d "
                    "AND query LIKE 'LISTEN %'"), {"d": database}).scalar_one()
            if listening:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError("the worker did not LISTEN in time")
            time.sleep(0.1)
    finally:
        engine.dispose()


# -- the child process -------------------------------------------------------------------------

def child_main(spec: dict[str, Any]) -> None:
    from flask_mail_outbox import Message

    from .bench_app import RECIPIENT, create_app

    rng = random.Random(spec["seed"])
    app = create_app()
    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    low, high = spec["spacing"]
    emails = []
    total = spec["warmup"] + spec["n"]
    for i in range(total):
        token = f"{spec['name']}-{i}-{uuid.uuid4().hex[:8]}"
        with app.app_context():
            mail.send(Message(f"latency {spec['name']} #{i}", recipients=[RECIPIENT],
                              body="A single email, to time its way to the server.\n",
                              extra_headers={"X-Bench-Id": token}))
            before = time.time()
            db.session.commit()
            after = time.time()
        emails.append({"id": token, "warmup": i < spec["warmup"], "before_commit": before,
                       "after_commit": after})
        if i + 1 < total:
            time.sleep(rng.uniform(low, high))
    # In-process delivery (inline, or this process's dispatcher) must finish first.
    with app.app_context():
        mail.wait_idle(30)
    time.sleep(0.5)
    Path(spec["out"]).write_text(json.dumps({"emails": emails}))
    mail.stop(timeout=5)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks latency`")
