"""``executors``: the drain on a task queue's worker (Celery, RQ, Dramatiq) against the dispatcher.

Issue 43's question: does delivering on the task queue a shop already runs
cost rate? Per round, for the built-in dispatcher and for each engine that
can run here (the order alternating between rounds), with the same sink
answering each message after ``--delay-ms`` and the same C connections:

* the tables are emptied and N emails are queued through ``mail.send()`` in
  this process with ``send_after`` an hour ahead, so nothing is due (as the
  ``drain`` scenario does, :mod:`benchmarks.drain`);
* ONE worker process starts: for the dispatcher ``flask outbox worker
  --concurrency C``; for an engine its plug-in's worker command (below), with
  ``OUTBOX_CONCURRENCY`` = C, on a private ``redis-server`` this scenario
  starts on a free port (a database of it per engine). One warm-up email,
  due now, goes through it first, so the clock never counts a worker's
  start-up (nor tasks an earlier round left in the queue: their rows are
  gone, and a task whose ids it cannot claim returns at once);
* one transaction makes every queued row due and sends one more email; the
  clock runs from its commit until the sink has all N + 1.

The commit wakes a dispatcher (its NOTIFY), which then claims whatever is due:
the whole backlog. An executor's commit publishes a task naming only the ids
that transaction sent, the one email: the rows made due by the UPDATE are
due rows like a retry's or a ``send_after``'s, which on an executor only the
periodic sweep task publishes. So for an engine this process then runs that
sweep once, at once: ``mail.sweep(min_age=0)`` (``OUTBOX_SWEEP_MIN_AGE_SECONDS``
= 0, with a limit above N), which reads the due ids and publishes them in
tasks of ``OUTBOX_BATCH_SIZE`` ids (100 by default), oldest first. In
production that sweep runs on the engine's scheduler every few seconds; here
it runs right after the commit, so the figure is the engine's delivery, not
the sweep's interval.

On SQLite (no PostgreSQL here, or ``--no-pg``) the dispatcher polls instead
of being woken, so every row's clock runs from the first receipt instead,
and no claims are counted (they come from PostgreSQL's log).

The goal (issue 43) is an engine's rate >= 0.9 of the dispatcher's in the
same round ("x dispatcher", the median of the per-round ratios). The bound
is C / delay for every row: one process of C connections.

Where an engine's time goes, against the dispatcher's:

* "commit→claim ms": from the release commit to the first claim statement
  in the PostgreSQL log (this scenario logs every statement of the workers'
  sessions; 0 when the claim came before ``commit()`` returned here). For
  the dispatcher that is its NOTIFY and one claim; for an engine it is one
  task's whole hop: the publish after the commit, the broker, the worker
  taking the task, the task finding its app, the claim of its id.
* "publish ms": how long the sweep took in this process to read the due ids
  and publish every task (engines only).
* "tasks" and "ids/task": the tasks published in the run (the commit's one,
  then the sweep's ``ceil(published / OUTBOX_BATCH_SIZE)``) and the ids per task.
* Claim batching: "claims" and "rows/claim" are the claim statements of the
  run in the PostgreSQL log and the rows each took on average. A dispatcher
  claims up to a batch, then claims again whenever what it holds falls to
  its refill point (about half a batch): its connections never wait for a
  claim. A task claims its ids in one statement and returns when the last
  is recorded, so a task that runs alone ends with connections idle while
  its last emails are in flight: ``ceil(B / C)`` rounds of the delay for B
  ids, 13 for 100 on 8 where 12.5 would do. "1-at-a-time bound" is the rate
  at best when the engine runs its tasks one after another (the run's task
  sizes, ``ceil`` rounds each); an engine running several tasks at once in
  one process escapes it (the outbox's drain there takes the next task's ids
  as the refill point comes).
* "steady": the share of the bound between the 10th and the 90th percentile
  receipt, as in ``drain``: a loss spread over the whole run (each task's
  tail) shows here, one at the ends (the start, the last round) does not.
* "ms lost/task": the engine's drain time less the dispatcher's in the same
  round, over its tasks: the per-task overhead all told (the hop, the task's
  idle tail, the claim and record of each task).

Engines come from plug-ins, ``benchmarks/executor_<engine>.py`` (celery, rq,
dramatiq): ``ENGINE``, ``available()`` (None, or why it cannot run here),
``config(broker_url)`` (the app's keys: ``OUTBOX_EXECUTOR`` and so on),
``worker_command(broker_url=, queue=, concurrency=)`` (one worker process
with that many SMTP connections, run from the repository root with the
``BENCH_*`` variables of :mod:`benchmarks.bench_app`) and
``extra_env(broker_url)``. An engine whose plug-in is missing, or whose
``available()`` gives a reason, or with no ``redis-server`` here, is skipped
with a line saying why; under CI (``CI`` set), where every engine and
``redis-server`` are installed, a reason from ``available()``, a missing
``redis-server`` or an app refusing the plug-in's configuration (its
``flask_mail_outbox.contrib`` module missing, say) fails the scenario after
the rest has run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import re
import shutil
import socket
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from flask_mail_outbox import ConfigError

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    bench_env,
    execute,
    free_port,
    log,
    median,
    ratio,
    status_counts,
    stop_process,
    tail,
    wait_listening,
    wait_port,
)
from .bench_app import Bench, build, message
from .drain import HOLD, release

NAME = "executors"
HELP = "the drain on Celery, RQ and Dramatiq workers vs the dispatcher, same connections"
SMOKE = ["--n", "40", "--rounds", "1", "--concurrency", "4", "--delay-ms", "20"]
ENGINES = ("celery", "rq", "dramatiq")
DISPATCHER = "dispatcher"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=2000, help="emails per round")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="SMTP connections of the one worker process (C)")
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="the sink's wait before each 250")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="the task queues to compare with the dispatcher")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="OUTBOX_BATCH_SIZE: ids per task, rows per dispatcher claim at "
                             "most (default: the default, 100)")
    parser.add_argument("--ids-per-task", type=int, default=None,
                        help="the publishing side's OUTBOX_BATCH_SIZE only: the ids of one "
                             "task (1: each email its own task, as when every commit sends "
                             "one); the workers keep --batch-size")


# -- the engines' plug-ins -------------------------------------------------------------------

@dataclasses.dataclass
class Engine:
    """One plug-in that can run here, with its broker and its app in this process."""

    name: str
    plugin: ModuleType
    broker_url: str = ""
    bench: Bench | None = None
    _config: dict[str, Any] | None = None

    def config(self) -> dict[str, Any]:
        """The plug-in's app keys for this broker (asked once: before this process's app
        is built, as a plug-in may set up the engine's publishing side then)."""
        if self._config is None:
            self._config = dict(self.plugin.config(self.broker_url))
        return dict(self._config)


def _plugin(name: str) -> tuple[ModuleType | None, str | None]:
    """The plug-in of engine ``name``, or why there is none."""
    module_name = f"benchmarks.executor_{name}"
    try:
        return importlib.import_module(module_name), None
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None, f"no plug-in (benchmarks/executor_{name}.py)"


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found is None and os.path.exists("/usr/bin/redis-server"):
        found = "/usr/bin/redis-server"
    return found


def redis_command(port: int, *words: str) -> bytes:
    """One command to the Redis on ``port`` (RESP by hand: no client needed); its reply."""
    payload = f"*{len(words)}\r\n".encode() + b"".join(
        f"${len(w.encode())}\r\n{w}\r\n".encode() for w in words)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        return sock.recv(1 << 16)


def start_redis(ctx: Context, binary: str) -> int:
    """A private ``redis-server`` (no persistence) on a free port; the port."""
    port = free_port()
    proc = ctx.spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(ctx.workdir), "--protected-mode", "no"],
                     env={}, name="redis", stdout=subprocess.DEVNULL)
    wait_port(port, 15, [proc])
    deadline = time.monotonic() + 15
    while not redis_command(port, "PING").startswith(b"+PONG"):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"redis-server on port {port} does not answer PING")
        time.sleep(0.05)
    return port


def engines(ctx: Context, wanted: list[str], report: Report) -> tuple[list[Engine], list[str]]:
    """The engines that can run here, and the reasons that must fail a CI run.

    Every skipped engine gets a note saying why.
    """
    found: list[Engine] = []
    must_fail: list[str] = []
    ci = bool(os.environ.get("CI"))
    binary = redis_binary()
    for name in wanted:
        if name not in ENGINES:
            raise SystemExit(f"unknown engine {name!r} ({', '.join(ENGINES)})")
        plugin, why = _plugin(name)
        if plugin is not None:
            why = plugin.available()
            if why is None and binary is None:
                why = "no redis-server (apt-get install redis-server)"
            if why is not None and ci:
                must_fail.append(f"{name}: {why}")
        if plugin is None or why is not None:
            log(f"{NAME}: skipping {name}: {why}")
            report.notes.append(f"{name}: skipped, {why}")
            continue
        found.append(Engine(name, plugin))
    if found and binary is not None:
        port = start_redis(ctx, binary)
        for db, engine in enumerate(found):
            engine.broker_url = f"redis://127.0.0.1:{port}/{db}"
    return found, must_fail


# -- one run ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
    """One drain: its rate and where its time went (None where not measured)."""

    rate: float
    seconds: float  # the release commit to the last receipt
    first: float | None  # the release commit to the first receipt, less the delay
    steady: float | None  # msg/s between the 10th and the 90th percentile receipt
    to_claim: float | None  # the release commit to the first claim statement
    claims: int | None  # claim statements from the release to the last receipt
    publish: float | None = None  # the sweep's reading and publishing (engines)
    tasks: int | None = None  # tasks published (engines)
    sizes: list[int] = dataclasses.field(default_factory=list)  # ids of each task (engines)

    def serial_bound(self, concurrency: int, delay: float) -> float | None:
        """msg/s at best when the tasks run one after another: each ends with its last
        round of the delay, ``ceil(ids / C)`` rounds for its ids."""
        rounds = sum(math.ceil(k / concurrency) for k in self.sizes)
        return sum(self.sizes) / (rounds * delay) if rounds and delay else None


def run(ctx: Context, args: argparse.Namespace) -> Report:
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    delay = args.delay_ms / 1000
    c = args.concurrency
    bound = c / delay if delay else None
    table = Table(f"Drain of {args.n} emails by one worker process of {c} connections, "
                  f"sink answering after {args.delay_ms:g} ms (median of {args.rounds} rounds)",
                  ["executor", "msg/s", "bound msg/s", "of bound", "x dispatcher",
                   "not sent", "first ms", "steady", "commit→claim ms", "publish ms", "tasks",
                   "ids/task", "1-at-a-time bound", "claims", "rows/claim", "ms lost/task"])
    report = Report(NAME, tables=[table])
    found, must_fail = engines(ctx, wanted, report)
    sink = ctx.sink(delay)
    backend, url = ctx.databases("pg", NAME)[0]
    pg = ctx.postgres() if backend == "pg" else None
    if pg is not None:
        pg.log_statements(url)  # the workers' sessions: their claims, timed
    base = {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False, "OUTBOX_RUN_SCHEDULER": False,
            "OUTBOX_CONCURRENCY": c}
    if args.batch_size is not None:
        base["OUTBOX_BATCH_SIZE"] = args.batch_size
    if backend != "pg":
        base["OUTBOX_POLL_MAX_INTERVAL"] = 0.5  # SQLite wakes no other process
    batch = args.batch_size or 100
    dispatcher = build(url, sink.smtp_port, **base)
    names = [DISPATCHER]
    try:
        for engine in found:
            try:
                publishing = dict(base)
                if args.ids_per_task is not None:
                    publishing["OUTBOX_BATCH_SIZE"] = args.ids_per_task
                engine.bench = build(url, sink.smtp_port, create=False,
                                     **{**publishing, **engine.config()})
            except ConfigError as exc:  # its contrib module or its extra is missing
                why = f"the app refuses its configuration: {exc}"
                log(f"{NAME}: skipping {engine.name}: {why}")
                report.notes.append(f"{engine.name}: skipped, {why}")
                if os.environ.get("CI"):
                    must_fail.append(f"{engine.name}: {why}")
                continue
            names.append(engine.name)
        runs: dict[str, list[Run]] = {name: [] for name in names}
        not_sent = dict.fromkeys(names, 0)
        by_name = {e.name: e for e in found if e.bench is not None}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                current = by_name.get(name)
                bench = dispatcher if current is None or current.bench is None else current.bench
                one = drain(ctx, bench, url, sink, current, n=args.n, concurrency=c,
                            delay=delay, config=base, pg=pg)
                runs[name].append(one)
                not_sent[name] += args.n + 2 - status_counts(url).get("sent", 0)
                log(f"{NAME} round {r + 1} {name}: {one.rate:.0f} msg/s"
                    + (f", {one.tasks} tasks" if one.tasks is not None else ""))
    finally:
        for bench in [e.bench for e in found if e.bench is not None] + [dispatcher]:
            close(bench)
    base_runs = runs[DISPATCHER]
    for name in names:
        mine = runs[name]
        rate = median(x.rate for x in mine)
        vs = median(ratio(a.rate, b.rate) for a, b in zip(mine, base_runs, strict=True))
        tasks = median(x.tasks for x in mine)
        claims = median(x.claims for x in mine)
        lost = None if name == DISPATCHER else median(
            (a.seconds - b.seconds) / a.tasks * 1000
            for a, b in zip(mine, base_runs, strict=True) if a.tasks)
        table.add(name, rate, bound, ratio(rate, bound), vs, not_sent[name],
                  _ms(median(x.first for x in mine)), ratio(median(x.steady for x in mine), bound),
                  _ms(median(x.to_claim for x in mine)),
                  _ms(median(x.publish for x in mine)), tasks, ratio(args.n + 1, tasks),
                  median(x.serial_bound(c, delay) for x in mine), claims,
                  ratio(args.n + 1, claims), lost)
        report.figures[f"{name} msg/s"] = rate
        report.figures[f"{name} of bound"] = ratio(rate, bound)
        if name != DISPATCHER:
            report.figures[f"{name} x dispatcher"] = vs
            report.figures[f"{name} ms lost per task"] = lost
    report.notes.append(f"one worker process of {c} connections each; bound = C / delay; "
                        f"database {backend}" + ("" if pg is not None else
                        " (the clock from the first receipt; no claims counted)"))
    per_task = args.ids_per_task or batch
    report.notes.append(f"engines: the backlog published by one sweep (min_age=0) in tasks of "
                        f"up to {per_task} ids; goal (issue 43): x dispatcher >= 0.9")
    if must_fail:
        raise RuntimeError("under CI every engine must run: " + "; ".join(must_fail)
                           + "\n" + report.render())
    return report


def _steady(times: list[float]) -> float | None:
    """msg/s between the 10th and the 90th percentile of sorted receipt ``times``."""
    if len(times) < 10:
        return None
    low, high = len(times) // 10, len(times) * 9 // 10
    return (high - low) / max(times[high] - times[low], 1e-9)


def close(bench: Bench) -> None:
    """Stop ``bench``'s outbox and close its database connections."""
    bench.stop()
    with bench.app.app_context():
        bench.db.engine.dispose()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def drain(ctx: Context, bench: Bench, url: str, sink: Sink, engine: Engine | None, *, n: int,
          concurrency: int, delay: float, config: dict[str, Any], pg: Any) -> Run:
    """One round of one executor (see the module docstring); the worker stopped after."""
    execute(url, "DELETE FROM outbox_attachment", "DELETE FROM outbox_email")
    bench.enqueue(n, NAME, send_after=HOLD)
    if engine is None:
        proc = ctx.spawn_worker(url, sink, concurrency=concurrency, config=config,
                                name="exec-dispatcher")
    else:
        cfg = {**config, **engine.config()}
        queue = str(cfg.get("OUTBOX_EXECUTOR_QUEUE", "outbox"))
        command = engine.plugin.worker_command(broker_url=engine.broker_url, queue=queue,
                                               concurrency=concurrency)
        env = {**bench_env(url, sink.smtp_port, cfg), **engine.plugin.extra_env(engine.broker_url)}
        # Its stdout (a banner, say) in a log file: this process's stdout has the tables.
        proc = ctx.spawn(list(command), env=env, name=f"exec-{engine.name}",
                         stdout=ctx.log_file(f"exec-{engine.name}-stdout"))
    try:
        sink.reset()
        warm_up(bench, sink, proc)
        if engine is None and url.startswith("postgresql"):
            wait_listening(url, 1, [proc])
        sink.reset()
        committing = time.time()  # a worker may claim before commit() returns here
        released = release(bench)
        publish = tasks = None
        sizes: list[int] = []
        if engine is not None:
            started = time.perf_counter()
            with bench.app.app_context():
                swept = bench.mail.sweep(min_age=0, limit=n + 10)
            publish = time.perf_counter() - started
            size = int(bench.app.config.get("OUTBOX_BATCH_SIZE") or 100)
            # As the outbox publishes: the commit's task, then the sweep's chunks.
            sizes = [1] + [min(size, swept.requeued - i) for i in range(0, swept.requeued, size)]
            tasks = len(sizes)
        stats = sink.wait_for(n + 1, timeout=60 + n / 10, procs=[proc])
    finally:
        stop_process(proc)
    if stats["count"] < n + 1:
        raise RuntimeError(f"{engine.name if engine else DISPATCHER}: only {stats['count']} "
                           f"of {n + 1} emails arrived")
    times = sorted(float(r[0]) for r in sink.receipts())
    claims = None if pg is None else claim_times(pg.directory / "postgres.log", url,
                                                 committing, stats["last"])
    if pg is None:
        # SQLite wakes no dispatcher in another process (it polls every 0.5 s):
        # every row's clock runs from its first receipt instead, as in drain.
        seconds = max(stats["last"] - stats["first"], 1e-9)
        rate = (stats["count"] - 1) / seconds
    else:
        seconds = max(stats["last"] - released, 1e-9)
        rate = stats["count"] / seconds
    return Run(rate=rate, seconds=seconds,
               first=times[0] - released - delay if times else None, steady=_steady(times),
               to_claim=max(0.0, claims[0] - released) if claims else None,
               claims=len(claims) if claims is not None else None,
               publish=publish, tasks=tasks, sizes=sizes)


def warm_up(bench: Bench, sink: Sink, proc: subprocess.Popen[Any]) -> None:
    """One email due now, through the worker just started: it is up when the sink has it."""
    with bench.app.app_context():
        bench.mail.send(message("warm-up"))
        bench.db.session.commit()
        bench.db.session.remove()
    stats = sink.wait_for(1, timeout=120, procs=[proc])
    if stats["count"] < 1:
        raise RuntimeError(f"the worker delivered no warm-up email in 120 s; its log "
                           f"ends:\n{tail(proc)}")


# -- claims in the PostgreSQL log ------------------------------------------------------------

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) UTC \[\d+\] db=(\S*) (\w+):  (.*)$")
# A claim sets attempts = attempts + 1: the dispatcher's CTE and a task's UPDATE alike.
_CLAIM = re.compile(r"attempts\s*=\s*\(?\s*(outbox_email\.)?attempts\s*\+")


def claim_times(path: Path, url: str, start: float, end: float) -> list[float]:
    """The times (``time.time()``) of the claim statements on ``url``'s database in
    [``start``, ``end``], oldest first, from a log written with ``log_statement = all``."""
    import sqlalchemy as sa

    database = sa.make_url(url).database
    found: list[float] = []
    at: float | None = None
    text: list[str] = []

    def flush() -> None:
        if at is not None and start <= at <= end and _CLAIM.search(" ".join(text)):
            found.append(at)

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = _LINE.match(line)
            if match is None:
                if line.startswith("\t"):
                    text.append(line.strip())
                continue
            flush()
            at, text = None, []
            if match.group(2) == database and match.group(3) == "LOG" and (
                    match.group(4).startswith(("statement:", "execute "))):
                at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f").replace(
                    tzinfo=UTC).timestamp()
                text = [match.group(4)]
    flush()
    return sorted(found)
