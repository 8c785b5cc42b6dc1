"""The goals table of issue 5, computed from one run's scenario results.

:func:`goals_table` reads the ``data`` each scenario put in the run's JSON and
returns one row per figure: the figure, the measured value, the goal, and
whether it is met. A figure whose scenario did not run (or failed) says so.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from ._harness import Table, ratio

_AT_LEAST = (operator.ge, ">=")
_AT_MOST = (operator.le, "<=")


def _throughput(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    medians = data["medians"]
    best = data["best_ceiling_msg_per_s"]
    rows = []
    for variant in ("outbox-inline-sqlite", "outbox-inline-pg", "outbox-durable-sqlite",
                    "outbox-durable-pg"):
        if variant in medians:
            rows.append((f"{variant} / raw aiosmtplib ceiling ({data['best_ceiling']})",
                         ratio(medians[variant], best)))
    return rows


def _peer(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    medians = data["medians"]
    connect = medians.get("flaskmail-connect")
    return [(f"{variant} / Flask-Mail connect()", ratio(medians[variant], connect))
            for variant in ("outbox-durable-sqlite", "outbox-durable-pg", "outbox-worker1-pg",
                            "outbox-worker4-pg") if variant in medians]


def _enqueue(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    return [(f"enqueue, 1 per transaction, {backend}: send()+commit / bare insert",
             result["1"].get("ratio_median")) for backend, result in data.items()]


def _idle(goal_configs: tuple[str, ...]) -> Callable[[dict[str, Any]], list[Any]]:
    def rows(data: dict[str, Any]) -> list[tuple[str, float | None]]:
        out = []
        for name in goal_configs:
            result = data.get("configs", {}).get(name)
            if result is None:
                continue
            # The idle scenario's own verdict basis: the measurement when its window
            # is steady and long enough, else what the schedule settles to.
            out.append((f"idle {name}, SQL statements/min ({result['verdict_basis']})",
                        result["verdict_figure"]))
        return out
    return rows


def _request(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    return [(f"request p50 with a 1 s SMTP server, {name} (ms)", row["p50_ms"])
            for name, row in data.items()]


def _history(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    rows = []
    for backend, result in data.items():
        for lookup in ("claim", "sweep"):
            rows.append((f"{lookup} lookup, {result['rows']:,} retained / empty, {backend}",
                         ratio(result["history"][lookup], result["empty"][lookup])))
    return rows


def _drain(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    summary = data.get("summary", {})
    ks = sorted(int(key.split("/")[1]) for key in summary if key.startswith("delayed/"))
    if len(ks) < 2:
        return []
    return [(f"{ks[-1]} workers / {ks[0]} worker, 50 ms sink, PostgreSQL",
             summary[f"delayed/{ks[-1]}"]["ratio_vs_min_workers"])]


def _backlog(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    return [("deep per-key backlog / keyless drain rate", data.get("ratio"))]


def _memory(data: dict[str, Any]) -> list[tuple[str, float | None]]:
    sizes = sorted(int(k) for k in data["results"])
    return [(f"worker peak RSS, {sizes[-1]:,} backlog / {sizes[0]:,}", data.get("ratio"))]


#: (scenario, rows from its data, comparison, goal)
GOALS: list[tuple[str, Callable[[dict[str, Any]], list[Any]], tuple[Any, str], float]] = [
    ("throughput", _throughput, _AT_LEAST, 0.8),
    ("throughput", _peer, _AT_LEAST, 2.0),
    ("enqueue", _enqueue, _AT_MOST, 1.5),
    ("idle", _idle(("sqlite-durable",)), _AT_MOST, 6.0),
    ("idle", _idle(("pg-durable-listen",)), _AT_MOST, 1.0),
    ("idle", _idle(("sqlite-inline", "pg-inline")), _AT_MOST, 2.0),
    ("request", _request, _AT_MOST, 20.0),
    ("history", _history, _AT_MOST, 2.0),
    ("drain", _drain, _AT_LEAST, 3.0),
    ("backlog", _backlog, _AT_LEAST, 0.5),
    ("memory", _memory, _AT_MOST, 1.3),
]


def goals_table(scenarios: dict[str, Any]) -> tuple[Table, list[dict[str, Any]]]:
    """The goals table from a run's ``scenarios`` (as written to the JSON)."""
    table = Table("Goals of issue 5 (ratios within this run)",
                  ["figure", "measured", "goal", "met"])
    rows: list[dict[str, Any]] = []
    for name, figures, (compare, sign), goal in GOALS:
        result = scenarios.get(name)
        if result is None or "data" not in result:
            why = "not run" if result is None else "scenario failed"
            table.add(f"({name}: {why})", None, f"{sign} {goal:g}", None)
            rows.append({"scenario": name, "figure": None, "value": None, "goal": goal,
                         "sign": sign, "met": None})
            continue
        for label, value in figures(result["data"]):
            met = None if value is None else bool(compare(value, goal))
            table.add(label, value, f"{sign} {goal:g}", met)
            rows.append({"scenario": name, "figure": label, "value": value, "goal": goal,
                         "sign": sign, "met": met})
    return table, rows
