"""``python -m benchmarks list|smoke|all|<scenario> [options]``: run, print, write JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from ._harness import Context, Report, log, machine_info
from ._public_api import private_imports

#: The scenario modules, in the order ``all`` and ``smoke`` run them. Each has
#: NAME, HELP, SMOKE (its arguments for ``smoke``), add_arguments and run.
MODULES = ("enqueue", "transport", "drain", "limits", "providers", "request", "history", "idle",
           "peers", "webhooks", "dkim", "bounces", "templates", "costs", "otel",
           "executors")
RESULTS = Path(__file__).resolve().parent / "results"


def scenarios() -> dict[str, ModuleType]:
    loaded = [importlib.import_module(f"benchmarks.{name}") for name in MODULES]
    return {module.NAME: module for module in loaded}


def scenario_parser(module: ModuleType, parser: argparse.ArgumentParser | None = None
                    ) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog=f"python -m benchmarks {module.NAME}")
    module.add_arguments(parser)
    return parser


def _common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="where to write the results (default benchmarks/results/"
                             "<command>-<UTC time>.json)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (PostgreSQL data, process logs)")
    parser.add_argument("--no-pg", action="store_true", help="SQLite only")
    return parser


def build_parser(found: dict[str, ModuleType]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="flask-mail-outbox benchmarks "
        "(see benchmarks/__init__.py); each scenario takes --help for its sizes")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="the scenarios")
    _common(sub.add_parser("smoke", help="every scenario at a tiny size, and the public-API "
                                         "check; exits 1 when one raises or gives no figure"))
    _common(sub.add_parser("all", help="every scenario at its full size"))
    for module in found.values():
        scenario_parser(module, _common(sub.add_parser(module.NAME, help=module.HELP)))
    return parser


def run_one(ctx: Context, module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Run a scenario; its JSON entry (with ``error`` when it raised or gave no figure)."""
    log(f"scenario {module.NAME}")
    started = time.monotonic()
    try:
        report: Report = module.run(ctx, args)
    except KeyboardInterrupt:
        raise
    except Exception:  # noqa: BLE001 - report it, go on with the next scenario
        text = traceback.format_exc()
        log(f"scenario {module.NAME} failed:\n{text}")
        return {"error": text, "seconds": round(time.monotonic() - started, 1)}
    report.seconds = time.monotonic() - started
    print(f"\n== {module.NAME} ({report.seconds:.1f} s) ==\n{report.render()}\n", flush=True)
    entry = report.as_json()
    if not any(isinstance(v, int | float) for v in report.figures.values()):
        entry["error"] = "no figure"
        log(f"scenario {module.NAME} produced no figure")
    return entry


def main(argv: list[str] | None = None) -> int:
    found = scenarios()
    args = build_parser(found).parse_args(argv)
    if args.command == "list":
        for module in found.values():
            print(f"{module.NAME:<10} {module.HELP}")
        return 0
    if args.command in ("smoke", "all"):
        plan = [(m, scenario_parser(m).parse_args(m.SMOKE if args.command == "smoke" else []))
                for m in found.values()]
    else:
        plan = [(found[args.command], args)]
    started = time.monotonic()
    payload: dict[str, Any] = {"command": args.command, "argv": sys.argv[1:],
                               "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                               "machine": machine_info(), "scenarios": {}}
    failed = False
    if args.command == "smoke":
        found_private = private_imports()
        payload["private_imports"] = found_private
        for line in found_private:
            log(f"private import: {line}")
        failed = bool(found_private)
    ctx = Context(keep=args.keep, postgres=not args.no_pg)
    try:
        for module, scenario_args in plan:
            entry = run_one(ctx, module, scenario_args)
            payload["scenarios"][module.NAME] = entry
            failed = failed or "error" in entry
    finally:
        ctx.close()
        payload["seconds"] = round(time.monotonic() - started, 1)
        out = args.json
        if out is None:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            out = RESULTS / f"{args.command}-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        log(f"{args.command}: {payload['seconds']:.1f} s, "
            + ("FAILED" if failed else "ok") + f"; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
