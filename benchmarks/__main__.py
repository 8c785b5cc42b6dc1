"""``python -m benchmarks <scenario>|all|list [options]``: run, print, write JSON."""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import RESULT_SCHEMA
from ._harness import Context, Report, log, machine_info, write_results
from ._registry import load_all
from .goals import goals_table


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of about a minute per scenario (fewer samples, "
                             "shorter windows); its figures are indicative only")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON file to write (default benchmarks/results/"
                             "<name>-<UTC time>.json)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (PostgreSQL data, process logs)")
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    scenarios = load_all()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="flask-mail-outbox benchmarks (run by hand; see benchmarks/__init__.py).")
    sub = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    sub.add_parser("list", help="list the scenarios")
    everything = sub.add_parser("all", help="every scenario with its default options")
    _common(everything)
    for scenario in scenarios.values():
        p = sub.add_parser(scenario.name, help=scenario.help, description=scenario.help)
        _common(p)
        if scenario.add_arguments is not None:
            scenario.add_arguments(p)
    return parser


def _defaults_for(name: str, quick: bool) -> argparse.Namespace:
    """A scenario's options at their defaults (for ``all``)."""
    scenario = load_all()[name]
    p = argparse.ArgumentParser()
    _common(p)
    if scenario.add_arguments is not None:
        scenario.add_arguments(p)
    args = p.parse_args(["--quick"] if quick else [])
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    scenarios = load_all()
    if args.scenario == "list":
        for scenario in scenarios.values():
            print(f"{scenario.name:<10} {scenario.help}")
        return 0
    if args.scenario == "all":
        plan = [(name, _defaults_for(name, args.quick)) for name in scenarios]
    else:
        plan = [(args.scenario, args)]
    started = datetime.now(UTC)
    payload: dict[str, Any] = {
        "schema": RESULT_SCHEMA, "name": args.scenario,
        "started_at": started.isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine_info(), "scenarios": {},
    }
    ctx = Context(keep=args.keep, workdir=args.workdir)
    failed = False
    try:
        # Scenarios that mostly wait (idle) start first and are collected last.
        background: dict[str, Callable[[], Report]] = {}
        for name, scenario_args in plan:
            start = scenarios[name].start
            if len(plan) > 1 and start is not None:
                log(f"scenario {name} (in the background): {vars(scenario_args)}")
                try:
                    background[name] = start(ctx, scenario_args)
                except Exception:  # noqa: BLE001 - report, go on with the next scenario
                    failed = True
                    payload["scenarios"][name] = {"error": traceback.format_exc()}
        t_start = time.monotonic()
        in_order = ([(n, a) for n, a in plan if n not in background]
                    + [(n, a) for n, a in plan if n in background])
        for name, scenario_args in in_order:
            if name in payload["scenarios"]:
                continue
            if name in background:
                collect: Callable[[], Report] = background[name]
            else:
                log(f"scenario {name}: {vars(scenario_args)}")
                collect = functools.partial(scenarios[name].run, ctx, scenario_args)
            t0 = t_start if name in background else time.monotonic()
            try:
                report: Report = collect()
            except KeyboardInterrupt:
                raise
            except Exception:  # noqa: BLE001 - report, go on with the next scenario
                failed = True
                text = traceback.format_exc()
                log(f"scenario {name} failed:\n{text}")
                payload["scenarios"][name] = {"error": text}
                continue
            report.seconds = time.monotonic() - t0
            payload["scenarios"][name] = {"args": {k: v for k, v in vars(scenario_args).items()
                                                   if k not in ("out", "workdir")},
                                          **report.as_json()}
            print(f"\n== {name} ({report.seconds:.0f} s) ==\n{report.render()}\n", flush=True)
        table, rows = goals_table(payload["scenarios"])
        if args.scenario != "all":
            keep = [i for i, row in enumerate(rows) if row["scenario"] == args.scenario]
            table.rows = [table.rows[i] for i in keep]
            rows = [rows[i] for i in keep]
        payload["goals"] = rows
        if rows:
            print(f"\n== goals ==\n{table.render()}\n", flush=True)
        if ctx._pg is not None:
            payload["machine"]["postgresql"] = ctx._pg.server_version()
    finally:
        payload["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
        payload["machine"]["loadavg_end"] = __import__("os").getloadavg()
        path = write_results(args.scenario, payload, args.out)
        ctx.close()
        print(f"results: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
