#!/usr/bin/env python3
"""Keep every ``except`` around a durability-critical call loud.

For each ``try`` in ``flask_mail_outbox/`` (Alembic revisions excluded) whose
body calls one of ``CRITICAL_CALLEES`` (matched by the final name: both
``self.route.deliver_ids(...)`` and ``deliver_ids(...)`` match), every
``except`` handler must re-raise, report through ``_degrade`` (``report(...)``
or ``<tracker>.failing(...)``) or log at ERROR or above. Only the ``try`` body
counts: calls in ``else:`` and ``finally:`` are not protected by the handlers,
and calls inside a nested ``def``/``lambda`` do not run there. A handler that is
genuinely harmless says so on its ``except`` line::

    except OSError:  # durability: ok <why swallowing it loses nothing>

Usage: ``check_durability_log_level.py [--root DIR] [--list-callees] [--self-test]``.
Exit 1 on any violation (or a file that does not parse), 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# Name -> why an exception around it may mean an email does not go out as promised.
# `send` is deliberately absent: it names Transport.send (whose errors the base
# send_many turns into Failed results the route records, by contract), OutboxMail.send
# (validation before anything is stored; the caller's exception) and blinker's
# Signal.send (receivers run after the outcome is recorded). The route's transport
# seam is `send_many`, listed below.
CRITICAL_CALLEES: dict[str, str] = {
    "deliver_ids": "claim -> send -> record for ids handed over; every route enters here",
    "deliver_claimed": "sends rows already claimed and records their outcomes",
    "claim_ids": "the compare-and-set queued -> sending gate for handed-over ids",
    "claim_due": "the dispatcher's and the sweep's claim of due rows",
    "send_many": "the transport call; a raise leaves the batch's outcome unknown",
    "record": "writes outcomes; a failure leaves rows sending until the lease expires",
    "_record": "record()'s one transaction, retried by record() on a deadlock",
    "mark_sent": "records a delivery (STYLE's name for it)",
    "renew_leases": "the heartbeat; a failure lets another claim send a duplicate",
    "reap_expired": "returns expired leases to queued; a failure strands rows in sending",
    "publish": "hands committed rows to delivery after the outermost commit",
    "_publish": "staging's fan-out of committed rows to each app's publish()",
    "submit": "the after-commit hand-over to the inline worker",
    "take_promoted": "hands a key's next email to inline delivery",
    "tick": "one dispatcher round: reap, claim, hand to the sending pool",
    "sweep": "takes rows left behind by a crash or a failed drain",
    "run_sweep": "the scheduled sweep job",
    "insert_email": "writes the email row; swallowing it means the email was never stored",
    "set_durable": "the delivery-mode toggle; decides what takes due rows in every process",
    "requeue": "puts rows back to queued (dead-letter retry, durable sweep)",
    "retry": "mail.retry(): puts a dead letter back; swallowing it leaves it failed",
    "mark_given_back": "frees rows given back at stop from the age gate; a failure makes "
                       "them wait OUTBOX_SWEEP_MIN_AGE_SECONDS",
}

EXCLUDED_DIRS = ("migrations/versions",)
# Logger method or level constant -> level (`exception` logs at ERROR).
LEVELS = {"CRITICAL": 50, "FATAL": 50, "ERROR": 40, "EXCEPTION": 40, "WARNING": 30, "WARN": 30,
          "INFO": 20, "DEBUG": 10}
LEVEL_TEXT = {30: "WARNING", 20: "INFO", 10: "DEBUG", 1: "a level the checker cannot read"}
LOGGER_NAME = re.compile(r"_*(?:\w+_)?(?:log|logger|logging)|getlogger", re.IGNORECASE)
OPT_OUT = re.compile(r"\bdurability:\s*ok\b(?P<reason>.*)$")
_DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass
class Report:
    """What one run found."""

    files: int = 0
    seams: int = 0
    violations: list[str] = field(default_factory=list)
    opt_outs: list[str] = field(default_factory=list)


def _shallow_walk(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node under ``nodes``, not entering nested defs or lambdas (they run later)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _DEFERRED):
            stack.extend(ast.iter_child_nodes(node))


def _final_name(node: ast.AST) -> str:
    """``b`` for ``a.b``, ``a`` for ``a``, the callee's name for ``f(...)``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _reporter_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to the ``_degrade`` module, and to its ``report`` function."""
    modules, functions = {"_degrade"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names
                           if a.asname and a.name.rsplit(".", 1)[-1] == "_degrade")
        elif isinstance(node, ast.ImportFrom):
            from_degrade = (node.module or "").rsplit(".", 1)[-1] == "_degrade"
            for alias in node.names:
                if alias.name == "_degrade":
                    modules.add(alias.asname or alias.name)
                elif from_degrade and alias.name == "report":
                    functions.add(alias.asname or alias.name)
    return modules, functions


def _level(call: ast.Call, modules: set[str], functions: set[str]) -> int:
    """The level a call reports at (40 for the ``_degrade`` helper), 0 if it does not log."""
    func = call.func
    if isinstance(func, ast.Name):
        return 40 if func.id in functions else 0
    if not isinstance(func, ast.Attribute):
        return 0
    receiver = _final_name(func.value)
    if func.attr == "failing" or (func.attr == "report" and receiver in modules):
        return 40
    if not LOGGER_NAME.fullmatch(receiver):
        return 0
    if func.attr.upper() in LEVELS:
        return LEVELS[func.attr.upper()]
    if func.attr == "log" and call.args:
        level = call.args[0]
        if isinstance(level, ast.Constant) and isinstance(level.value, int):
            return level.value
        return LEVELS.get(_final_name(level), 1)
    return 0


def _instead(handler: ast.ExceptHandler, modules: set[str], functions: set[str]) -> str | None:
    """None when ``handler`` re-raises or reports at ERROR; else what it does instead."""
    body = list(_shallow_walk(handler.body))
    levels = [0]
    for node in body:
        if isinstance(node, ast.Raise):
            return None
        if isinstance(node, ast.Call):
            levels.append(_level(node, modules, functions))
    if max(levels) >= 40:
        return None
    if max(levels) > 0:
        text = f"logs at {LEVEL_TEXT.get(max(levels), 'level ' + str(max(levels)))}"
    elif any(isinstance(node, ast.Return) for node in body):
        text = "returns without reporting"
    elif all(isinstance(s, (ast.Pass, ast.Continue, ast.Break))
             or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
             for s in handler.body):
        text = "swallows silently"
    else:
        text = "carries on without reporting"
    if any(isinstance(node, ast.Raise) for node in ast.walk(handler)):
        text += "; its only raise is inside a nested function"
    return text


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on it."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}


def _opt_out(handler: ast.ExceptHandler, comments: dict[int, str]) -> str | None:
    """The reason of a ``# durability: ok`` marker on the ``except`` line(s); "" if bare."""
    last = max(handler.lineno, handler.body[0].lineno - 1)
    for line in range(handler.lineno, last + 1):
        match = OPT_OUT.search(comments.get(line, ""))
        if match:
            reason = match.group("reason").strip()
            return reason if re.search(r"\w", reason) else ""
    return None


def check_source(source: str, label: str, report: Report) -> None:
    """Check one module's ``source``, adding what it finds to ``report``."""
    tree = ast.parse(source, filename=label)
    modules, functions = _reporter_names(tree)
    comments = _comments(source)
    report.files += 1
    found: list[tuple[int, bool, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Try, ast.TryStar)):
            continue
        called = [_final_name(n) for n in _shallow_walk(node.body) if isinstance(n, ast.Call)]
        critical = sorted({name for name in called if name in CRITICAL_CALLEES})
        if not critical:
            continue
        around = ", ".join(f"{name}()" for name in critical)
        for handler in node.handlers:
            report.seams += 1
            where = f"{label}:{handler.lineno}"
            reason = _opt_out(handler, comments)
            if reason:
                opted = f"{where}: opted out around {around}: {reason}"
                found.append((handler.lineno, False, opted))
                continue
            if reason == "":
                problem = (f"`# durability: ok` around {around} needs a reason saying why "
                           "swallowing it loses nothing")
            elif (instead := _instead(handler, modules, functions)) is None:
                continue
            else:
                problem = (f"except around {around} neither re-raises nor reports at ERROR "
                           f"({instead})")
            found.append((handler.lineno, True, f"{where}: {problem}"))
    for _, violation, text in sorted(found):
        (report.violations if violation else report.opt_outs).append(text)


def _label(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (clickable in CI)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def check_tree(root: Path) -> Report:
    """Check every module under ``root`` except the excluded directories."""
    report = Report()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(d + "/") for d in EXCLUDED_DIRS):
            continue
        try:
            check_source(path.read_text(encoding="utf-8"), _label(path), report)
        except (SyntaxError, tokenize.TokenError, UnicodeDecodeError) as exc:
            report.files += 1
            report.violations.append(f"{_label(path)}: cannot be checked: {exc}")
    return report


class Sample(NamedTuple):
    """A built-in module for ``--self-test`` and what the checker must say about it."""

    name: str
    handler: str  # the body of `except Exception as exc:`
    seams: int = 1
    violations: int = 0
    says: str = ""  # must appear in the violation text
    opt_outs: int = 0
    marker: str = ""  # a comment on the except line
    body: str = "route.deliver_ids(ids)"  # the try body
    after: str = ""  # else:/finally: clauses


_HEADER = ("import logging\nfrom flask_mail_outbox import _degrade\n"
           "from flask_mail_outbox._degrade import report as loud\n"
           "from flask_mail_outbox.stats import report\nlogger = logging.getLogger(__name__)\n\n"
           "def f(self, route, ids, faults):\n    try:\n        ")
SAMPLES = [
    Sample("re-raise", "raise"),
    Sample("raise-from", "raise RuntimeError('mapped') from exc"),
    Sample("degrade-report", "_degrade.report('x', consequence='c', fix='f', exc=exc)"),
    Sample("imported-report", "loud('x', consequence='c', fix='f')"),
    Sample("faults-failing", "faults.failing('db', 'x', consequence='c', fix='f')"),
    Sample("logger-exception", "logger.exception('drain failed')"),
    Sample("logging-error", "logging.error('drain failed')"),
    Sample("log-at-ERROR", "logger.log(logging.ERROR, 'drain failed')"),
    Sample("attribute-callee", "raise", body="self.store.claim_ids(ids, owner='o')"),
    Sample("opt-out", "pass", opt_outs=1, marker="durability: ok the row stays queued"),
    Sample("pass", "pass", violations=1, says="(swallows silently)"),
    Sample("warning", "logger.warning('x')", violations=1, says="(logs at WARNING)"),
    Sample("info", "logger.info('x')", violations=1, says="(logs at INFO)"),
    Sample("log-at-WARNING", "logger.log(logging.WARNING, 'x')", violations=1,
           says="(logs at WARNING)"),
    Sample("return-none", "return None", violations=1, says="returns without reporting"),
    Sample("bare-opt-out", "pass", violations=1, says="needs a reason",
           marker="noqa: BLE001 - durability: ok"),
    Sample("raise-in-nested-def", "def later():\n            raise\n        return later",
           violations=1, says="only raise is inside a nested function"),
    Sample("report-not-from-degrade", "report('x')", violations=1, says="without reporting"),
    Sample("future-exception-is-not-logging", "return fut.exception()", violations=1),
    Sample("else-only", "pass", seams=0, body="int(ids)",
           after="    else:\n        route.deliver_ids(ids)\n"),
    Sample("finally-only", "pass", seams=0, body="int(ids)",
           after="    finally:\n        route.submit(ids)\n"),
    Sample("call-in-nested-def", "pass", seams=0,
           body="def later():\n            route.deliver_ids(ids)"),
]


def self_test() -> int:
    """Judge every built-in sample; 0 when all were judged as expected."""
    failed = 0
    for sample in SAMPLES:
        marker = f"  # {sample.marker}" if sample.marker else ""
        source = (f"{_HEADER}{sample.body}\n    except Exception as exc:{marker}\n"
                  f"        {sample.handler}\n{sample.after}")
        report = Report()
        check_source(source, f"<{sample.name}>", report)
        got = (report.seams, len(report.violations), len(report.opt_outs))
        want = (sample.seams, sample.violations, sample.opt_outs)
        said = "\n".join(report.violations)
        if got != want or sample.says not in said:
            failed += 1
            print(f"self-test: sample {sample.name!r} misjudged: (seams, violations, opt-outs) "
                  f"= {got}, expected {want}; output: {said or '(none)'}", file=sys.stderr)
    print(f"self-test: {len(SAMPLES) - failed} of {len(SAMPLES)} samples judged as expected")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path,
                        default=Path(__file__).resolve().parent.parent / "flask_mail_outbox",
                        help="package directory to check (default: %(default)s)")
    parser.add_argument("--list-callees", action="store_true",
                        help="print the durability-critical callees and why, then exit")
    parser.add_argument("--self-test", action="store_true",
                        help="check the checker on built-in samples, then exit")
    args = parser.parse_args(argv)
    if args.list_callees:
        for name, why in CRITICAL_CALLEES.items():
            print(f"{name}: {why}")
        return 0
    if args.self_test:
        return self_test()
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a directory")
    report = check_tree(args.root)
    for line in report.violations + report.opt_outs:
        print(line)
    print(f"checked {report.seams} seams in {report.files} files: "
          f"{len(report.violations)} violations, {len(report.opt_outs)} opted out")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
