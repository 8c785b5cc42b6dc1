"""``python -m benchmarks <scenario>|all|list [options]``: run, print, write JSON."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import RESULT_SCHEMA
from ._harness import Context, Report, log, machine_info, write_results
from ._registry import load_all


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
        for name, scenario_args in plan:
            log(f"scenario {name}: {vars(scenario_args)}")
            t0 = time.monotonic()
            try:
                report: Report = scenarios[name].run(ctx, scenario_args)
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
