"""``costs``: what the tally's triggers and the suppression screen cost a drain into a fast sink.

Issue 41 measured end-to-end bulk delivery 10-20 % slower than before the tally
(``outbox_tally``, kept by triggers on ``outbox_email``) and the suppression
screen (one read of ``outbox_suppression`` per claimed batch). This scenario
drains the same backlog three ways, interleaved within each round (the order
rotating from round to round), each on a database of its own:

* ``as-is``: the product;
* ``no-tally``: that database's tally triggers dropped in the set-up (``DROP
  TRIGGER``: the counts go stale, nothing else changes);
* ``no-screen``: the worker processes skip the screen (``BENCH_SKIP_SCREEN``:
  :func:`skip_screen` replaces the screen by "nobody is suppressed" in the
  process under test; the one private use of the package in the benchmarks,
  allowed by name in :mod:`benchmarks._public_api`).

Configurations: ``sqlite-inline`` (one app process in inline mode: ``send()``
N emails, 500 per commit, its in-process delivery sends them; the clock runs
from the first ``send()`` to the last row ``sent``), ``pg-K`` (durable, K
``flask outbox worker`` processes: N held emails released at once, as in
``drain``; the clock runs from the release's commit to the last row ``sent``).
The sink is Postfix's ``smtp-sink`` (C, answers at once) when installed, else
``benchmarks/sink.py`` with no delay; completion is read from the database
(``status = 'sent'``, polled every 20 ms), so the figure includes the record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ._harness import (
    Context,
    Report,
    Table,
    bench_env,
    execute,
    free_port,
    log,
    median,
    stop_process,
    tail,
    wait_listening,
    wait_port,
)
from .bench_app import RECIPIENT, build
from .drain import HOLD, release

NAME = "costs"
HELP = "drain into a fast sink as is, without the tally triggers, without the suppression screen"
SMOKE = ["--n", "20", "--rounds", "1", "--configs", "sqlite-inline,pg-1"]
VARIANTS = ("as-is", "no-tally", "no-screen")
CONFIGS = ("sqlite-inline", "pg-1", "pg-4")

#: The tally's triggers on ``outbox_email`` (migration outbox_0001), per backend.
TALLY_TRIGGERS = ("outbox_tally_insert", "outbox_tally_update", "outbox_tally_delete",
                  "outbox_tally_truncate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=2000, help="emails per drain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4,
                        help="connections per process (OUTBOX_CONCURRENCY, worker --concurrency)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--sink", choices=("auto", "smtp-sink", "aiosmtpd"), default="auto")


def skip_screen() -> None:
    """Make this process's outbox screen no claimed batch (every recipient deliverable)."""
    import importlib

    module = importlib.import_module("flask_mail_outbox.core._suppression")
    cls = module.Suppressions
    if not hasattr(cls, "screen"):  # moved: say so rather than measure nothing
        raise RuntimeError("Suppressions.screen is gone: update benchmarks/costs.py")
    cls.screen = lambda self, claimed: list(claimed)


class FastSink:
    """Postfix's ``smtp-sink`` on a free port (``smtp_port``, as :class:`._harness.Sink`)."""

    def __init__(self, ctx: Context) -> None:
        self.smtp_port = free_port()
        # As root it must be told whose privileges to drop to.
        user = ["-u", "nobody"] if os.geteuid() == 0 else []
        self.proc = ctx.spawn([str(shutil.which("smtp-sink")), *user, "-c",
                               f"127.0.0.1:{self.smtp_port}", "1024"], env={}, name="smtp-sink",
                              stdout=subprocess.DEVNULL)
        wait_port(self.smtp_port, 10, [self.proc])


def _sink(ctx: Context, choice: str) -> Any:
    if choice == "smtp-sink" or (choice == "auto" and shutil.which("smtp-sink")):
        return FastSink(ctx)
    return ctx.sink(0.0)


def _drop_tally(url: str) -> None:
    on = " ON outbox_email" if url.startswith("postgresql") else ""
    execute(url, *(f"DROP TRIGGER IF EXISTS {name}{on}" for name in TALLY_TRIGGERS))
    left = _triggers(url)
    if left:
        raise RuntimeError(f"tally triggers left on outbox_email: {left}")


def _triggers(url: str) -> list[str]:
    if url.startswith("postgresql"):
        sql = ("SELECT tgname FROM pg_trigger WHERE tgrelid = 'outbox_email'::regclass"
               " AND NOT tgisinternal")
    else:
        sql = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'outbox_email'"
    return sorted(str(row[0]) for row in execute(url, sql)[0])


@dataclasses.dataclass(frozen=True)
class Drain:
    """One drain: msg/s, and CPU seconds per email of the client and the server (None: SQLite)."""

    rate: float
    cpu: float
    server_cpu: float | None


class SentCounter:
    """``count(*)`` of ``sent`` rows on one kept connection (a new one per poll would cost
    the server a backend each time, and the measurement with it)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        self.conn = self.engine.connect()

    def counts(self) -> dict[str, int]:
        rows = self.conn.execute(sa.text("SELECT status, count(*) FROM outbox_email "
                                         "GROUP BY status")).all()
        return {str(status): int(n) for status, n in rows}

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()

    def wait(self, count: int, procs: list[subprocess.Popen[Any]], timeout: float) -> float:
        """Poll until ``count`` rows are ``sent``; the time it was seen."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.counts()
            if counts.get("sent", 0) >= count:
                return time.time()
            ended = {k: v for k, v in counts.items() if k not in ("queued", "sending", "sent")}
            if ended:
                raise RuntimeError(f"emails ended unsent: {ended}")
            for proc in procs:
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"worker exited with {proc.returncode}:\n{tail(proc)}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"only {counts} after {timeout:g} s")
            time.sleep(0.02)


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of ``pids`` (all their threads), from /proc; 0 for one gone."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def server_pids(ctx: Context) -> list[int]:
    """PostgreSQL's postmaster and its children (backends, background processes)."""
    pid_file = ctx.postgres().directory / "data" / "postmaster.pid"
    postmaster = int(pid_file.read_text().split()[0])
    found = [postmaster]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster:
            found.append(int(stat.parent.name))
    return found


def drain_pg(ctx: Context, url: str, sink: Any, *, n: int, workers: int, concurrency: int,
             variant: str) -> Drain:
    """Durable drain by ``workers`` processes: msg/s from the release to the last ``sent``."""
    execute(url, "DELETE FROM outbox_attachment", "DELETE FROM outbox_email")
    bench = build(url, sink.smtp_port, create=False, OUTBOX_DURABLE=True,
                  OUTBOX_RUN_WORKER=False, OUTBOX_RUN_SCHEDULER=False)
    try:
        bench.enqueue(n, "costs", send_after=HOLD)
        extra = {"BENCH_SKIP_SCREEN": "1"} if variant == "no-screen" else {}
        procs = []
        for i in range(workers):
            env = {**bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": True}), **extra}
            procs.append(ctx.spawn([sys.executable, "-m", "flask", "--app",
                                    "benchmarks.bench_app:create_app", "outbox", "worker",
                                    "--concurrency", str(concurrency)], env=env,
                                   name=f"costs-{variant}-{i}"))
        counter = SentCounter(url)
        try:
            wait_listening(url, workers, procs)
            server = server_pids(ctx)  # after every worker connected
            pids = [proc.pid for proc in procs]
            cpu_before = cpu_seconds(pids), cpu_seconds(server)
            released = release(bench)
            done = counter.wait(n + 1, procs, timeout=60 + n / 20)
            cpu_after = cpu_seconds(pids), cpu_seconds(server)
        finally:
            counter.close()
            for proc in procs:
                stop_process(proc)
    finally:
        bench.stop()
    return Drain((n + 1) / max(done - released, 1e-9),
                 (cpu_after[0] - cpu_before[0]) / (n + 1), (cpu_after[1] - cpu_before[1]) / (n + 1))


def drain_inline(ctx: Context, url: str, sink: Any, *, n: int, concurrency: int,
                 variant: str) -> Drain:
    """Inline mode in a child process: msg/s from the first ``send()`` to the last ``sent``."""
    execute(url, "DELETE FROM outbox_attachment", "DELETE FROM outbox_email")
    out = ctx.workdir / f"costs-inline-{variant}.json"
    out.unlink(missing_ok=True)
    env = bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": False,
                                          "OUTBOX_CONCURRENCY": concurrency})
    if variant == "no-screen":
        env["BENCH_SKIP_SCREEN"] = "1"
    proc = ctx.spawn([sys.executable, "-m", "benchmarks.costs", "--child",
                      json.dumps({"n": n, "out": str(out)})], env=env, name=f"costs-{variant}")
    if proc.wait(timeout=120 + n / 20) != 0 or not out.exists():
        raise RuntimeError(f"inline child failed (exit {proc.returncode}):\n{tail(proc)}")
    got = json.loads(out.read_text())
    return Drain(float(got["rate"]), float(got["cpu"]) / n, None)


def child_main(spec: dict[str, Any]) -> None:
    """The inline app: send ``n`` (500 per commit), wait until all are sent; rate and CPU."""
    from .bench_app import from_env

    bench = from_env()
    counter = SentCounter(os.environ["BENCH_DB_URL"])
    bench.app.test_client().get("/")  # starts the background jobs, as a first request does
    n = spec["n"]
    started, cpu = time.time(), time.process_time()
    bench.enqueue(n, "costs")
    done = counter.wait(n, [], timeout=60 + n / 20)
    cpu = time.process_time() - cpu
    counter.close()
    with open(spec["out"], "w") as f:
        json.dump({"rate": n / max(done - started, 1e-9), "cpu": cpu}, f)
    bench.stop()


def run(ctx: Context, args: argparse.Namespace) -> Report:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r} ({', '.join(CONFIGS)})")
    sink = _sink(ctx, args.sink)
    sink_name = "smtp-sink" if isinstance(sink, FastSink) else "aiosmtpd sink"
    databases: dict[tuple[str, str], str] = {}
    for backend in sorted({c.split("-")[0] for c in configs}):
        if backend == "pg" and not ctx.has_postgres:
            log("costs: skipping PostgreSQL (no server binaries, or --no-pg)")
            continue
        for variant in VARIANTS:
            [(_, url)] = ctx.databases(backend, f"costs_{variant.replace('-', '_')}",
                                       fallback=False)
            bench = build(url, sink.smtp_port)  # the tables, the triggers
            if variant == "no-screen":
                # Proof that the screen is skipped: were it read, every email would end
                # suppressed and the drain would fail.
                with bench.app.app_context():
                    bench.mail.suppress(RECIPIENT, "manual", source="benchmarks.costs")
            bench.stop()
            if variant == "no-tally":
                _drop_tally(url)
            databases[backend, variant] = url
    drains: dict[tuple[str, str], list[Drain]] = {}
    for r in range(args.rounds):
        for config in configs:
            backend = config.split("-")[0]
            if (backend, "as-is") not in databases:
                continue
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                url = databases[backend, variant]
                if backend == "pg":
                    got = drain_pg(ctx, url, sink, n=args.n, workers=int(config.split("-")[1]),
                                   concurrency=args.concurrency, variant=variant)
                else:
                    got = drain_inline(ctx, url, sink, n=args.n,
                                       concurrency=args.concurrency, variant=variant)
                drains.setdefault((config, variant), []).append(got)
                log(f"costs round {r + 1} {config} {variant}: {got.rate:.0f} msg/s, "
                    f"{got.cpu * 1e6:.0f} us client CPU/msg"
                    + ("" if got.server_cpu is None else
                       f", {got.server_cpu * 1e6:.0f} us server CPU/msg")
                    + f" (load {os.getloadavg()[0]:.1f})")
    table = Table(f"Drain of {args.n} emails into {sink_name}, {args.rounds} rounds, variants "
                  "interleaved; / as-is: over as-is in the same round, median (min-max)",
                  ["config", "variant", "msg/s", "/ as-is", "CPU us/msg", "/ as-is",
                   "server CPU us/msg", "/ as-is"])
    report = Report(NAME, tables=[table])
    for config in configs:
        base = drains.get((config, "as-is"))
        if not base:
            continue
        for variant in VARIANTS:
            got = drains[config, variant]
            cells: list[Any] = [config, variant]
            for field, scale in (("rate", 1.0), ("cpu", 1e6), ("server_cpu", 1e6)):
                values = [getattr(d, field) for d in got]
                if None in values:
                    cells += [None, None]
                    continue
                # A tiny run (smoke) can measure 0 CPU ticks: no ratio for that round.
                ratios = [v / getattr(b, field) for v, b in zip(values, base, strict=True)
                          if getattr(b, field)]
                if not ratios:
                    cells += [(median(values) or 0.0) * scale, None]
                    report.figures[f"{config} {variant} {field}"] = median(values)
                    continue
                cells += [(median(values) or 0.0) * scale,
                          f"{median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"]
                report.figures[f"{config} {variant} {field}"] = median(values)
                report.figures[f"{config} {variant} {field} / as-is"] = median(ratios)
            table.add(*cells)
    report.notes.append("CPU: the worker processes' (inline: the app process's, the enqueue "
                        "included) user + system time from the release to the last sent row, "
                        "per email; server: PostgreSQL's processes over the same span")
    report.notes.append("no-tally: DROP TRIGGER of outbox_tally_* on that database; no-screen: "
                        "the screen replaced in the processes under test (BENCH_SKIP_SCREEN)")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks costs`")
