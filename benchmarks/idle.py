"""``idle``: SQL statements per minute of a process that has nothing to send.

Each configuration runs in its own child process (``python -m benchmarks.idle
--child SPEC``), all of them at once (they mostly sleep). The child is a
serving process of :mod:`benchmarks.bench_app` (so the APScheduler sweep jobs
run, as under a WSGI server) that never sends anything. It counts, from boot:

* every statement SQLAlchemy hands to a cursor (``before_cursor_execute``) on
  the outbox's own engine (``app.extensions["mail_outbox"].runtime().engine``)
  and on the app's ``db.engine``, with the thread that ran it: the dispatcher's
  tick, the startup sweep, the periodic job, or any other thread. On SQLite
  that includes ``BEGIN IMMEDIATE``; on PostgreSQL the driver's implicit
  ``BEGIN``/``COMMIT`` and the pool's pre-ping are not cursor statements, so
  for PostgreSQL the server's own log (``log_statement = all`` on that
  database only) is counted as well: every round trip the database sees;
* pool checkouts (each one a ``SELECT 1`` pre-ping on PostgreSQL);
* every dispatcher tick (start, chosen gap, claimed), by wrapping
  ``Worker.step`` and ``Worker._schedule`` in the child only (the library is not changed).

Figures per configuration:

* **measured**: statements in the window ``[boot + warm-up, + --seconds]``, per
  minute. The warm-up defaults to the time the backoff schedule needs to reach
  its cap (+1 s start-up delay of the dispatcher, +5 s), at least 70 s; the
  verdict against the goal is taken on this figure when the window is in that
  steady state and spans two periods of the slowest cycle (the cap, the 60 s
  periodic job), else on the schedule;
* **by schedule**: what the backoff schedule alone would cost, from what one
  idle tick and one periodic job cost as measured: ``stmts/tick * 60 / cap +
  stmts/job * 60 / job interval``. The cap is ``OUTBOX_POLL_MAX_INTERVAL`` (30
  s), or ``OUTBOX_LISTEN_BACKSTOP_SECONDS`` (120 s) while LISTEN is up; the
  periodic job runs every ``OUTBOX_SWEEP_INTERVAL_SECONDS`` or 60 s in every
  mode. Measured above it means ticks came early: the table counts ticks that
  were woken before their scheduled time, and by what.

With a 120 s cap a 120 s window holds one tick more or less depending on
phase, so the default window is 300 s. Under ``all`` the idle processes run
in the background of the other scenarios (see :func:`start`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._harness import Context, Report, Table, bench_env, log, log_path, median, tail
from ._registry import scenario

#: name -> (database, extra config, goal in statements per minute or None)
CONFIGS: dict[str, tuple[str, dict[str, Any], float | None]] = {
    "sqlite-durable": ("sqlite", {"OUTBOX_DURABLE": True}, 6.0),
    "pg-durable-listen": ("pg", {"OUTBOX_DURABLE": True, "OUTBOX_LISTEN": True}, 1.0),
    "pg-durable-nolisten": ("pg", {"OUTBOX_DURABLE": True, "OUTBOX_LISTEN": False}, None),
    "sqlite-inline": ("sqlite", {"OUTBOX_DURABLE": False}, 2.0),
    "pg-inline": ("pg", {"OUTBOX_DURABLE": False}, 2.0),
}
DEFAULT_CONFIGS = list(CONFIGS)

#: The dispatcher's first tick comes from the startup sweep, one second after boot.
STARTUP_DELAY = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None,
                        help="measured window in seconds (default 300, two periods of the "
                             "120 s LISTEN backstop; --quick 30)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds from boot to the window (default: until the backoff "
                             "reaches its cap, at least 70; --quick 35)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")


def schedule(initial: float, cap: float) -> tuple[list[float], float]:
    """The idle gaps before the cap, and the time from the first tick to the first capped one."""
    gaps = []
    gap = initial
    while gap < cap:
        gaps.append(gap)
        gap = min(gap * 2, cap)
    return gaps, sum(gaps)


def _cap(effective: dict[str, Any], backend: str) -> float | None:
    if not effective["durable"]:
        return None
    if effective["listen"] and backend == "pg":
        return float(max(effective["listen_backstop_seconds"], effective["poll_max_interval"]))
    return float(effective["poll_max_interval"])


def start(ctx: Context, args: argparse.Namespace) -> Callable[[], Report]:
    """Start the idle processes; the returned function waits for them and reports.

    ``all`` starts them first and collects them last: they sit idle while the
    other scenarios run (their statement counts follow their schedule, not the
    machine's load), which saves the idle windows from the run's length.
    """
    from flask_mail_outbox._config import load_config

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown idle config(s): {', '.join(unknown)}")
    window = args.seconds if args.seconds is not None else (30.0 if args.quick else 300.0)
    sink = ctx.aiosmtpd_sink()  # nothing should arrive; MAIL_PORT must point somewhere
    children = []
    for name in names:
        backend, extra, goal = CONFIGS[name]
        config = {"OUTBOX_RUN_SCHEDULER": True, **extra}
        effective = load_config(config, instance_path=str(ctx.workdir), testing=False)
        eff = {"durable": effective.durable, "listen": effective.listen,
               "poll_interval": effective.poll_interval,
               "poll_max_interval": effective.poll_max_interval,
               "listen_backstop_seconds": effective.listen_backstop_seconds,
               "sweep_interval": effective.sweep_interval_seconds or 60.0,
               "settings_ttl": effective.settings_ttl_seconds}
        cap = _cap(eff, backend)
        to_cap = schedule(eff["poll_interval"], cap)[1] if cap else 0.0
        if args.warmup is not None:
            warmup = args.warmup
        elif args.quick:
            warmup = 35.0
        else:
            warmup = max(70.0, STARTUP_DELAY + to_cap + 5.0)
        if backend == "pg":
            pg = ctx.postgres()
            dbname, url = pg.create_database(f"bench_idle_{name.replace('-', '_')}")
            pg.enable_statement_log(dbname)
        else:
            dbname, url = name, f"sqlite:///{ctx.workdir / f'idle-{name}.db'}"
        from .bench_app import create_tables

        create_tables(url)
        out = ctx.workdir / f"idle-{name}.json"
        spec = {"name": name, "warmup": warmup, "window": window, "out": str(out)}
        proc = ctx.spawn([sys.executable, "-m", "benchmarks.idle", "--child", json.dumps(spec)],
                         env=bench_env(url, sink.smtp_port, config, log_level="INFO"),
                         name=f"idle-{name}")
        children.append({"name": name, "backend": backend, "goal": goal, "dbname": dbname,
                         "proc": proc, "out": out, "warmup": warmup, "cap": cap,
                         "to_cap": to_cap, "effective": eff})
    longest = max(c["warmup"] for c in children) + window
    warmups = ", ".join(f"{c['name']} {c['warmup']:g} s" for c in children)
    log(f"idle: {len(children)} processes, window {window:g} s after warm-ups of "
        f"{warmups}; about "
        f"{longest:.0f} s")
    return lambda: _finish(ctx, children, window, longest)


@scenario("idle", "SQL statements per minute of an idle process (durable and inline modes)",
          add_arguments=add_arguments, start=start)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    return start(ctx, args)()


def _finish(ctx: Context, children: list[dict[str, Any]], window: float,
            longest: float) -> Report:
    for child in children:
        code = child["proc"].wait(timeout=longest + 120)
        if code != 0 or not child["out"].exists():
            raise RuntimeError(f"idle child {child['name']} failed (exit {code}):\n"
                               f"{tail(log_path(child['proc']))}")

    summary = Table("Idle cost: SQL statements per minute (goal = the issue's target)",
                    ["config", "goal/min", "measured/min", "verdict", "by schedule/min",
                     "window s", "steady window", "ticks (woken)", "idle gap s",
                     "stmts/tick", "job stmts/min", "server stmts/min", "checkouts/min"])
    breakdown = Table("Where the window's statements come from",
                      ["config", "source", "statements", "kinds"])
    report = Report("idle", tables=[summary, breakdown])
    data: dict[str, Any] = {}
    for child in children:
        raw = json.loads(child["out"].read_text())
        result = _analyse(child, raw, window)
        if child["backend"] == "pg":
            server = ctx.postgres().count_logged_statements(
                child["dbname"], result["window_start"], result["window_end"])
            result["server_statements"] = server
            result["server_per_min"] = sum(server.values()) / (window / 60)
        data[child["name"]] = result
        goal = child["goal"]
        verdict = "-"
        if goal is not None:
            # On the measurement when the window is in the steady state and spans two
            # periods of the slowest cycle (the cap, the 60 s job), else on the schedule.
            periods = max(child["cap"] or 0.0, child["effective"]["sweep_interval"])
            if result["window_is_steady"] and window >= 2 * periods - 1e-9:
                figure, basis = result["measured_per_min"], ""
            else:
                figure, basis = result["steady_per_min"], " (sched.)"
            result["verdict_figure"] = figure
            result["verdict_basis"] = "by schedule" if basis else "measured"
            if figure is not None:
                verdict = ("ok" if figure <= goal + 1e-9 else "OVER") + basis
        ticks_cell = None
        if child["cap"]:
            ticks_cell = f"{result['ticks_in_window']} ({result['woken_in_window']})"
        summary.add(child["name"], goal, result["measured_per_min"], verdict,
                    result["steady_per_min"], window, result["window_is_steady"],
                    ticks_cell, result["observed_max_gap"], result["stmts_per_tick"],
                    result["job_per_min"], result.get("server_per_min"),
                    result["checkouts_per_min"])
        for source, info in sorted(result["window_by_source"].items()):
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(info["kinds"].items()))
            breakdown.add(child["name"], source, info["count"], kinds)
        if child["backend"] == "pg":
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(
                result["server_statements"].items()))
            breakdown.add(child["name"], "(server log, all)",
                          sum(result["server_statements"].values()), kinds)
    report.data = {"window_seconds": window, "configs": data}
    report.notes += [
        ("statements = SQLAlchemy before_cursor_execute on the outbox engine and db.engine "
        "(SQLite: incl. BEGIN IMMEDIATE; PostgreSQL: without the driver's implicit "
        "BEGIN/COMMIT and the pre-ping SELECT 1, which 'server stmts/min' includes)"),
        ("measured/min: the window's statements; 'steady window' = the backoff had reached "
        "its cap before the window began; with a 120 s cap use --seconds 300 or more, a "
        "shorter window holds one tick more or less depending on phase"),
        ("by schedule/min = stmts/tick x 60 / cap + the periodic job's statements per minute: "
        "what the backoff schedule alone would cost; measured above it means ticks came "
        "early ('woken' = started before the previous tick's start + gap)"),
        ("verdict: on measured/min when the window is steady and spans two periods of "
         "the slowest cycle (the cap, the 60 s job), else on the schedule ('sched.')"),
        ("the periodic APScheduler job runs every 60 s in every mode; in durable mode it "
         "reads the mode (a SELECT on outbox_setting: the OUTBOX_SETTINGS_TTL_SECONDS cache "
         "has always expired by then)"),
    ]
    for child in children:
        if not data[child["name"]]["periodic_runs"]:
            report.notes.append(
                f"{child['name']}: no periodic job ran in the "
                f"{child['warmup'] + window:.0f} s the process lived, so the steady state "
                "is unknown: run longer")
        result = data[child["name"]]
        if result["woken_in_window"]:
            report.notes.append(
                f"{child['name']}: {result['woken_in_window']} of the window's "
                f"{result['ticks_in_window']} ticks came before their scheduled time, "
                f"{result['woken_in_window_by_periodic_job']} of them right after the periodic "
                "job, which wakes the dispatcher: "
                + (f"the idle gap is at most 60 s whatever the {child['cap']:g} s cap"
                   if (child["cap"] or 0) > 60 else "extra ticks beyond the schedule"))
        if child["cap"] and not data[child["name"]]["window_is_steady"]:
            report.notes.append(
                f"{child['name']}: the window starts before the backoff reached its "
                f"{child['cap']:g} s cap (about {STARTUP_DELAY + child['to_cap']:.0f} s "
                "after boot): its measured rate overstates the steady state")
    return report


def _analyse(child: dict[str, Any], raw: dict[str, Any], window: float) -> dict[str, Any]:
    start = raw["boot"] + child["warmup"]
    end = start + window
    stmts = raw["statements"]
    ticks = raw["ticks"]
    runs = raw["runs"]

    in_window = [s for s in stmts if start <= s["at"] < end]
    by_source: dict[str, dict[str, Any]] = {}
    for s in in_window:
        info = by_source.setdefault(s["source"], {"count": 0, "kinds": {}})
        info["count"] += 1
        info["kinds"][s["kind"]] = info["kinds"].get(s["kind"], 0) + 1

    # Statements of each tick: dispatcher statements from its start to the next tick's.
    starts = [t["at"] for t in ticks]
    per_tick = []
    disp = sorted(s["at"] for s in stmts if s["source"] == "dispatcher")
    for i, at in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else float("inf")
        per_tick.append(sum(1 for a in disp if at - 0.001 <= a < nxt))
    idle_ticks = [n for n, t in zip(per_tick, ticks) if t["claimed"] == 0]
    stmts_per_tick = median(idle_ticks[1:] or idle_ticks)  # the first tick may differ

    periodic = sorted(r["at"] for r in runs if r["kind"] == "periodic")
    job_stmts = [s["at"] for s in stmts if s["source"] == "periodic"]
    per_job = []
    for i, at in enumerate(periodic):
        nxt = periodic[i + 1] if i + 1 < len(periodic) else float("inf")
        per_job.append(sum(1 for a in job_stmts if at - 0.001 <= a < nxt))
    job_interval = child["effective"]["sweep_interval"]
    job_per_min = (median(per_job) or 0.0) * 60 / job_interval if per_job else None

    cap = child["cap"]
    tick_per_min = None
    if cap:
        tick_per_min = (stmts_per_tick or 0.0) * 60 / cap
    other = [s for s in in_window if s["source"] not in ("dispatcher", "periodic")]
    # By the schedule: what the backoff alone would cost once at its cap, plus the
    # periodic job. Without one periodic run observed it is unknown (run longer).
    steady = None
    if job_per_min is not None:
        steady = (tick_per_min or 0.0) + job_per_min + len(other) / (window / 60)

    # A tick that starts before the previous one's start + gap was woken; by the
    # periodic job when one started just before it.
    woken = []
    for prev, tick in itertools.pairwise(ticks):
        if tick["at"] < prev["at"] + prev["gap"] - 0.05:
            by_job = any(tick["at"] - 1.0 <= at <= tick["at"] + 0.1 for at in periodic)
            woken.append({"at": tick["at"], "by_periodic_job": by_job})
    woken_in_window = [w for w in woken if start <= w["at"] < end]
    ticks_in_window = sum(1 for t in ticks if start <= t["at"] < end)

    capped = [t for t in ticks if cap and t["gap"] >= cap - 1e-6]
    window_is_steady = (not cap) or bool(capped and capped[0]["at"] <= start)
    checkouts = [c for c in raw["checkouts"] if start <= c < end]
    return {
        "boot": raw["boot"], "warmup": child["warmup"], "window_start": start,
        "window_end": end, "effective": child["effective"], "cap": cap,
        "time_to_cap_from_first_tick": child["to_cap"],
        "measured": len(in_window), "measured_per_min": len(in_window) / (window / 60),
        "window_by_source": by_source, "window_is_steady": window_is_steady,
        "ticks_total": len(ticks),
        "ticks_in_window": ticks_in_window, "woken": woken,
        "woken_in_window": len(woken_in_window),
        "woken_in_window_by_periodic_job": sum(1 for w in woken_in_window
                                               if w["by_periodic_job"]),
        "observed_max_gap": max((t["gap"] for t in ticks), default=None),
        "stmts_per_tick": stmts_per_tick, "stmts_per_tick_all": per_tick,
        "tick_per_min": tick_per_min, "periodic_runs": len(periodic),
        "stmts_per_job": per_job, "job_per_min": job_per_min,
        "other_in_window": len(other), "steady_per_min": steady,
        "checkouts_per_min": len(checkouts) / (window / 60),
        "ticks": ticks, "runs": runs,
    }


# -- the child process -------------------------------------------------------------------------

def child_main(spec: dict[str, Any]) -> None:
    """Boot an app, count its statements and ticks, sit idle, write the JSON."""
    from sqlalchemy import event

    from flask_mail_outbox._scheduler import SweepScheduler
    from flask_mail_outbox._worker import Worker

    boot = time.time()
    local = threading.local()
    statements: list[dict[str, Any]] = []
    checkouts: list[float] = []
    ticks: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    lock = threading.Lock()

    original_step = Worker.step
    original_schedule = Worker._schedule

    def schedule(self: Worker, started: float, *, claimed: int, full: bool,
                 failed: bool) -> None:
        original_schedule(self, started, claimed=claimed, full=full, failed=failed)
        with lock:
            ticks.append({"at": time.time() - (self.clock() - started),
                          "gap": self._next_claim - started, "claimed": claimed,
                          "listening": self.listening, "failed": failed})

    def step(self: Worker) -> None:
        local.source = "dispatcher"
        try:
            original_step(self)
        finally:
            local.source = None

    Worker.step = step  # type: ignore[method-assign]
    Worker._schedule = schedule  # type: ignore[method-assign]

    def traced_job(name: str, kind: str) -> None:
        original = getattr(SweepScheduler, name)

        def job(self: SweepScheduler) -> Any:
            with lock:
                runs.append({"kind": kind, "at": time.time()})
            local.source = kind
            try:
                return original(self)
            finally:
                local.source = None

        setattr(SweepScheduler, name, job)

    traced_job("_startup_sweep", "startup")
    traced_job("_periodic", "periodic")

    from .bench_app import create_app

    app = create_app()
    state = app.extensions["mail_outbox"]
    # A script starts the background jobs on first use; serve as the first
    # request of a WSGI process would.
    state.ensure_started()
    engines = {"outbox": state.runtime().engine}
    with app.app_context():
        engines["app"] = state.db.engine

    def listen(label: str, engine: Any) -> None:
        def on_statement(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            source = getattr(local, "source", None) or threading.current_thread().name
            words = statement.split(None, 2)
            kind = " ".join(words[:2]).upper() if words[:1] == ["BEGIN"] else (
                words[0].upper() if words else "?")
            with lock:
                statements.append({"at": time.time(), "engine": label, "source": source,
                                   "kind": kind, "sql": statement[:120]})

        def on_checkout(*_: Any) -> None:
            with lock:
                checkouts.append(time.time())

        event.listen(engine, "before_cursor_execute", on_statement)
        event.listen(engine, "checkout", on_checkout)

    for label, engine in engines.items():
        listen(label, engine)

    time.sleep(max(0.0, boot + spec["warmup"] + spec["window"] + 0.5 - time.time()))
    with lock:
        payload = {"name": spec["name"], "boot": boot, "statements": list(statements),
                   "checkouts": list(checkouts), "ticks": list(ticks), "runs": list(runs)}
    Path(spec["out"]).write_text(json.dumps(payload))
    state.ext.stop(timeout=5)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks idle`")
