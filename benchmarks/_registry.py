"""The scenario registry: ``@scenario`` adds a run function under a name.

A scenario module defines::

    def add_arguments(parser): ...          # its own options (optional)

    @scenario("name", "one line of help", add_arguments=add_arguments)
    def run(ctx: Context, args: argparse.Namespace) -> Report: ...

and is listed in :data:`SCENARIO_MODULES` (import order = ``all`` order).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._harness import Context, Report

#: Modules that register scenarios, in the order ``all`` runs them.
SCENARIO_MODULES = ("benchmarks.idle", "benchmarks.throughput", "benchmarks.transport",
                    "benchmarks.enqueue", "benchmarks.enqueue_many", "benchmarks.history",
                    "benchmarks.backlog", "benchmarks.request", "benchmarks.drain",
                    "benchmarks.latency", "benchmarks.limits")


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    help: str
    run: Callable[[Context, argparse.Namespace], Report]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    #: For scenarios that mostly wait: starts them and returns the function that
    #: collects the report; ``all`` starts these first and collects them last.
    start: Callable[[Context, argparse.Namespace], Callable[[], Report]] | None = None


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, help: str, *,
             add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
             start: Callable[..., Any] | None = None,
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``run`` under ``name``."""
    def register(run: Callable[..., Any]) -> Callable[..., Any]:
        if name in SCENARIOS:
            raise RuntimeError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = Scenario(name, help, run, add_arguments, start)
        return run
    return register


def load_all() -> dict[str, Scenario]:
    """Import every scenario module; returns the registry."""
    for module in SCENARIO_MODULES:
        importlib.import_module(module)
    return SCENARIOS
