"""``drain``: how fast K ``flask outbox worker`` processes empty a PostgreSQL backlog.

Per round and per K (1 and 4 by default, the order alternating between
rounds): the tables are truncated; N emails are queued through ``mail.send()``
in this process (500 per transaction, ``OUTBOX_DURABLE=True`` with
``OUTBOX_RUN_WORKER=False`` and no scheduler) with ``send_after`` an hour
ahead, so nothing is due; the table is ANALYZEd (a production table has
statistics); K workers ``flask outbox worker --concurrency 4``
(:mod:`benchmarks.bench_app`, library defaults) start, and once all K hold
their LISTEN connection the N rows are made due in one ``UPDATE ... due_at =
now()`` plus the library's own ``NOTIFY`` (the state ``send()`` leaves a due
row in, for all N at one instant). The clock runs from that commit until the
sink has all N. The workers are then stopped with SIGTERM and the database is
checked (every row ``sent``; the sink also counts duplicate Message-IDs).

Figures:

* **msg/s**: ``N / (last receipt - release)``;
* **first->last**: ``(N - 1) / (last receipt - first receipt)``;
* **x 1 worker**: the median over rounds of (this K's msg/s / one worker's
  msg/s in the same round), so machine drift between rounds cancels out;
* **start-up s**: from spawning the K workers until all of them LISTEN (not
  part of msg/s).

Variants: ``plain`` (a sink that answers at once: Postfix's ``smtp-sink``
when installed, else the aiosmtpd sink process; CPU-bound on this machine,
where workers, PostgreSQL and the sink share 2 cores) and ``delayed`` (the
aiosmtpd sink sleeping ``--delay-ms`` before each 250: latency-bound, whose
bound is ``K x concurrency / delay``).
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    bench_env,
    cpu_seconds,
    log,
    log_path,
    median,
    ratio,
    stop_process,
    tail,
)
from ._registry import scenario

BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")


#: Emails are queued this far ahead, then released all at once (see _release).
HOLD = timedelta(hours=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="emails per round, plain sink (default 5000; --quick 1000)")
    parser.add_argument("--delay-n", type=int, default=None,
                        help="emails per round, delaying sink (default 1000; --quick 300)")
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="the delaying sink's wait before each 250 (default 50)")
    parser.add_argument("--workers", default="1,4",
                        help="worker process counts to compare (default 1,4)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="flask outbox worker --concurrency (default 4)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3; --quick 1")
    parser.add_argument("--variants", default="delayed",
                        help="plain and/or delayed (default delayed; the throughput "
                             "scenario measures 1 and 4 workers against the plain sink)")
    parser.add_argument("--batch", type=int, default=500,
                        help="emails per enqueue transaction (default 500)")


@scenario("drain", "N queued emails drained by 1 vs 4 worker processes (PostgreSQL)",
          add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import build_app, create_tables, local_config

    n_plain = args.n or (1000 if args.quick else 5000)
    n_delayed = args.delay_n or (300 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 3)
    worker_counts = [int(k) for k in args.workers.split(",") if k.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    delay = args.delay_ms / 1000.0

    pg = ctx.postgres()
    dbname, url = pg.create_database("bench_drain")
    create_tables(url)
    sinks: dict[str, Sink] = {}
    if "plain" in variants:
        sinks["plain"] = ctx.throughput_sink()
    if "delayed" in variants:
        sinks["delayed"] = ctx.aiosmtpd_sink(delay)
    # The producer: this process, durable mode, no dispatcher, no scheduler.
    producer = build_app(local_config(url, next(iter(sinks.values())).smtp_port,
                                      OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                                      OUTBOX_RUN_SCHEDULER=False))
    samples: list[dict[str, Any]] = []
    try:
        for variant in variants:
            n = n_plain if variant == "plain" else n_delayed
            sink = sinks[variant]
            for r in range(rounds):
                order = worker_counts if r % 2 == 0 else list(reversed(worker_counts))
                for k in order:
                    sample = _one(ctx, producer, url, sink, variant=variant, n=n, workers=k,
                                  concurrency=args.concurrency, batch=args.batch,
                                  round_no=r)
                    samples.append(sample)
                    log(f"drain {variant} round {r + 1}/{rounds} K={k}: "
                        f"{sample['rate']:.0f} msg/s ({sample['seconds']:.1f} s), "
                        f"start-up {sample['startup_seconds']:.1f} s, "
                        f"enqueue {sample['enqueue_rate']:.0f} msg/s")
    finally:
        producer.extensions["mail_outbox"].ext.stop(timeout=5)

    table = Table(f"Drain rate from PostgreSQL, worker --concurrency {args.concurrency} "
                  f"(median of {rounds} round(s))",
                  ["variant", "sink", "N", "workers", "msg/s", "min..max", "first->last",
                   "x 1 worker", "bound msg/s", "of bound", "start-up s", "dup", "not sent"])
    summary: dict[str, Any] = {}
    for variant in variants:
        base_k = min(worker_counts)
        for k in worker_counts:
            mine = [s for s in samples if s["variant"] == variant and s["workers"] == k]
            rates = [s["rate"] for s in mine]
            per_round = [ratio(s["rate"], next((b["rate"] for b in samples
                                                if b["variant"] == variant
                                                and b["workers"] == base_k
                                                and b["round"] == s["round"]), None))
                         for s in mine]
            bound = (k * args.concurrency / delay) if variant == "delayed" and delay else None
            med = median(rates)
            row = {"msg_per_s": med, "min": min(rates), "max": max(rates),
                   "first_to_last_msg_per_s": median(s["first_to_last_rate"] for s in mine),
                   "startup_seconds": median(s["startup_seconds"] for s in mine),
                   "ratio_vs_min_workers": median(per_round), "per_round_ratios": per_round,
                   "bound": bound, "duplicates": sum(s["duplicates"] or 0 for s in mine),
                   "not_sent": sum(s["not_sent"] for s in mine)}
            summary[f"{variant}/{k}"] = row
            table.add(variant, sinks[variant].kind, mine[0]["n"], k, med,
                      f"{min(rates):.0f}..{max(rates):.0f}", row["first_to_last_msg_per_s"],
                      None if k == base_k else row["ratio_vs_min_workers"], bound,
                      None if bound is None or med is None else f"{100 * med / bound:.0f}%",
                      row["startup_seconds"],
                      row["duplicates"] if sinks[variant].has_receipts else None,
                      row["not_sent"])
    cpu_table = Table("CPU per delivered message during the drain (ms; /proc utime+stime, "
                      "median of rounds): where the 2 cores go",
                      ["variant", "workers", "workers ms/msg", "sink ms/msg",
                       "postgres ms/msg", "total ms/msg", "cores busy"])
    for variant in variants:
        for k in worker_counts:
            mine = [s for s in samples if s["variant"] == variant and s["workers"] == k]
            per = {part: median(s["cpu_ms_per_msg"][part] for s in mine)
                   for part in ("workers", "sink", "postgres")}
            busy = median(sum(s["cpu_seconds"].values()) / max(s["seconds"], 1e-9)
                          for s in mine)
            summary[f"{variant}/{k}"]["cpu_ms_per_msg"] = per
            cpu_table.add(variant, k, per["workers"], per["sink"], per["postgres"],
                          sum(v or 0 for v in per.values()), busy)
    enqueue = Table("Enqueue through mail.send() in the benchmark process "
                    f"({args.batch} per commit, PostgreSQL, durable: one NOTIFY per commit)",
                    ["N", "median msg/s", "min..max"])
    for n in sorted({s["n"] for s in samples}):
        rates = [s["enqueue_rate"] for s in samples if s["n"] == n]
        enqueue.add(n, median(rates), f"{min(rates):.0f}..{max(rates):.0f}")
    report = Report("drain", tables=[table, cpu_table, enqueue],
                    data={"summary": summary, "samples": samples, "database": dbname})
    report.notes += [
        ("msg/s = N / (last receipt at the sink - release): the K workers are started and "
        "LISTENing first, the N rows (queued with send_after +1 h) are then made due in one "
        "UPDATE + NOTIFY; first->last = (N-1) / (last - first receipt); start-up s = spawn "
        "to all K LISTENing (not in msg/s)"),
        "x 1 worker = median over rounds of the ratio within each round",
        ("2 shared cores run the workers, PostgreSQL, the sink and this process: the plain "
        "variant measures the machine as much as the library"),
    ]
    if "delayed" in variants:
        report.notes.append(
            f"delayed: the sink waits {args.delay_ms:g} ms before each 250; bound = workers x "
            "concurrency / delay (the sink's own MAIL/RCPT/DATA round trips come on top); a "
            "worker sends one claimed batch at a time, sized to keep its connections busy "
            "for about 0.5 s at the last batch's pace (at most OUTBOX_BATCH_SIZE)")
    return report


def _one(ctx: Context, producer: Any, url: str, sink: Sink, *, variant: str, n: int,
         workers: int, concurrency: int, batch: int, round_no: int) -> dict[str, Any]:
    _reset(url)
    sink.reset()
    enqueue_seconds = _enqueue(producer, n, batch, tag=f"{variant}-{round_no}-{workers}")
    _analyze(url)
    env = bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": True})
    spawned = time.time()
    procs = [ctx.spawn_worker(env, concurrency=concurrency, name=f"worker-{variant}-{i}")
             for i in range(workers)]

    def check_alive(*_: Any) -> None:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {proc.returncode}:\n"
                                   f"{tail(log_path(proc))}")

    _wait_listening(url, workers, timeout=120, check=check_alive)
    ready = time.time()
    pg = ctx.postgres()
    worker_pids = [p.pid for p in procs]
    cpu_before = {"workers": cpu_seconds(worker_pids), "sink": cpu_seconds([sink.pid]),
                  "postgres": cpu_seconds(pg.pids())}
    released = _release(url)
    timeout = 120 + n / 10
    stats = sink.wait_for(n, timeout=timeout, progress=check_alive)
    if not sink.has_receipts:
        # smtp-sink's counter is parsed from its display: confirm with the database.
        deadline = time.monotonic() + 60
        while _counts(url).get("sent", 0) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        stats["last"] = max(stats.get("last") or 0.0, time.time())
    done = time.time()
    cpu = {"workers": cpu_seconds(worker_pids) - cpu_before["workers"],
           "sink": cpu_seconds([sink.pid]) - cpu_before["sink"],
           "postgres": cpu_seconds(pg.pids()) - cpu_before["postgres"]}
    codes = [stop_process(proc) for proc in procs]
    counts = _counts(url)
    if stats["count"] < n:
        log(f"drain: only {stats['count']} of {n} arrived within {timeout:.0f} s")
    got = min(n, stats["count"])
    first = stats.get("first") or released
    last = stats.get("last") or done
    duplicates = (stats["count"] - stats["unique"]) if stats.get("unique") is not None else None
    return {"variant": variant, "round": round_no, "workers": workers, "n": n,
            "received": stats["count"], "duplicates": duplicates,
            "spawned": spawned, "ready": ready, "released": released,
            "first": first, "last": last,
            "rate": got / max(last - released, 1e-9),
            "first_to_last_rate": (got - 1) / max(last - first, 1e-9),
            "seconds": last - released, "first_receipt_after_release": first - released,
            "startup_seconds": ready - spawned,
            "enqueue_seconds": enqueue_seconds, "enqueue_rate": n / enqueue_seconds,
            "cpu_seconds": cpu,
            "cpu_ms_per_msg": {k: 1000 * v / max(got, 1) for k, v in cpu.items()},
            "worker_exit_codes": codes, "db_counts": counts,
            "not_sent": n - counts.get("sent", 0)}


def _wait_listening(url: str, count: int, *, timeout: float, check: Any) -> None:
    """Until ``count`` sessions on the database are LISTENing (every worker is up)."""
    database = url.rsplit("/", 1)[1].split("?")[0]
    deadline = time.monotonic() + timeout
    while True:
        check()
        rows = _admin(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                           f"'{database}' AND query LIKE 'LISTEN %%'")[0]
        if rows[0][0] >= count:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"only {rows[0][0]} of {count} workers listen after "
                               f"{timeout:g} s")
        time.sleep(0.1)


def _release(url: str) -> float:
    """Make every held row due now and NOTIFY, in one transaction; returns when it committed.

    The rows were queued with ``send_after`` an hour ahead, so the workers
    could start and settle first; this is the state ``send()`` leaves a due
    row in, reached for all N at one instant.
    """
    import sqlalchemy as sa

    from flask_mail_outbox._listen import notify_statement
    from flask_mail_outbox._models import Status, email_table
    from flask_mail_outbox._store import now_expr

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(email_table.update()
                         .where(email_table.c.status == Status.QUEUED.value)
                         .values(due_at=now_expr("postgresql")))
            conn.execute(notify_statement())
        return time.time()
    finally:
        engine.dispose()


def _enqueue(app: Any, n: int, batch: int, tag: str) -> float:
    from flask_mail_outbox import Message

    from .bench_app import RECIPIENT

    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    with app.app_context():
        started = time.perf_counter()
        for start in range(0, n, batch):
            for i in range(start, min(n, start + batch)):
                mail.send(Message(f"drain {tag} #{i}", recipients=[RECIPIENT], body=BODY),
                          send_after=HOLD)
            db.session.commit()
        elapsed = time.perf_counter() - started
        db.session.remove()
    return elapsed


def _admin(url: str, *statements: str) -> list[Any]:
    import sqlalchemy as sa

    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        results = []
        with engine.connect() as conn:
            for statement in statements:
                result = conn.exec_driver_sql(statement)
                results.append(result.all() if result.returns_rows else None)
        return results
    finally:
        engine.dispose()


def _reset(url: str) -> None:
    _admin(url, "TRUNCATE outbox_attachment, outbox_email RESTART IDENTITY")


def _analyze(url: str) -> None:
    _admin(url, "ANALYZE outbox_email")


def _counts(url: str) -> dict[str, int]:
    rows = _admin(url, "SELECT status, count(*) FROM outbox_email GROUP BY status")[0]
    return {str(status): int(count) for status, count in rows}
