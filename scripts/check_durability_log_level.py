#!/usr/bin/env python3
"""Keep every ``except`` around a durability-critical call loud.

For each ``try`` in ``flask_mail_outbox/`` (Alembic revisions excluded) whose
body calls one of ``CRITICAL_CALLEES`` (matched by the final name: both
``self.delivery.deliver_soon(...)`` and ``deliver_soon(...)`` match), every
``except`` handler must re-raise, report through ``_degrade`` (``report(...)``
or ``<tracker>.failing(...)``) or log at ERROR or above. Only the ``try`` body
counts: calls in ``else:`` and ``finally:`` are not protected by the handlers,
and calls inside a nested ``def``/``lambda`` do not run there. A handler that is
genuinely harmless says so on its ``except`` line::

    except OSError:  # durability: ok <why swallowing it loses nothing>

A call to a reporter is loud only because the helper logs at ERROR, so the
helper is checked too: ``_degrade.py`` directly under ``--root``. Its reporters
are ``REPORTERS``: ``report``, a module-level function, and ``failing``, a
method of a class there (``FaultTracker``). Every definition of a reporter
must, in its own body (not in a nested ``def``/``lambda``), log at ERROR or
above (``.error``/``.exception``/``.critical``, or ``.log(<ERROR or above>,
...)``) or call another reporter that passes this check (``failing`` reports
through ``report``), and none of its log calls may be below ERROR: whatever a
reporter logs is the report of a degradation, and a WARNING there hides it
from whoever alerts on ERROR. A path that logs nothing is allowed (``failing``
only counts the repeats of an ongoing fault), as long as the reporter logs at
ERROR somewhere. ``recovered`` and the helper's other functions are not
reporters and are not checked: a fault ending is not a degradation, so
``recovered`` logs at INFO on purpose, and a handler calling it is not loud.
Reporters are not accepted by name alone: when ``_degrade.py`` is missing, does
not parse, does not define a reporter or the reporter fails the check, a
handler calling that reporter does not report at ERROR.

Usage: ``check_durability_log_level.py [--root DIR] [--list-callees] [--self-test]``.
Exit 1 on any violation (or a file that does not parse), 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# Name -> why an exception around it may mean an email does not go out as promised.
# `send` is deliberately absent: it names Transport.send (whose errors the base
# Transport.open() stream turns into Failed results, by contract), OutboxMail.send
# (validation before anything is stored; the caller's exception) and blinker's
# Signal.send (receivers run after the outcome is recorded). The route's transport
# seam is `send_many`, listed below.
CRITICAL_CALLEES: dict[str, str] = {
    "deliver_soon": "the one mode decision: hands committed rows to delivery",
    "finish": "records the outcomes of sent rows; a failure leaves them sending",
    "claim_ids": "the compare-and-set queued -> sending gate for handed-over ids",
    "claim_due": "the dispatcher's and the sweep's claim of due rows",
    "send_many": "the transport call; a raise leaves the batch's outcome unknown",
    "record": "writes outcomes; a failure leaves rows sending until the lease expires",
    "_record": "record()'s one transaction, retried by record() on a deadlock",
    "mark_sent": "records a delivery (STYLE's name for it)",
    "renew_leases": "the heartbeat; a failure lets another claim send a duplicate",
    "reap_expired": "returns expired leases to queued; a failure strands rows in sending",
    "after_commit": "the producer's step after the outermost commit: starts delivery, "
                    "hands cancelled keys on",
    "enqueue": "the producer's insert of the rows in the caller's transaction",
    "insert_emails": "writes many email rows; swallowing it means they were never stored",
    "advance_keys": "hands the keys of cancelled rows on; a swallowed failure stalls them",
    "hand": "the hand-over of ids to the worker (commits, keys handed on, retries)",
    "advance": "hands a key to its next email; a swallowed failure can stall the key",
    "step": "one worker round: record what came back, claim, put on the stream",
    "sweep": "takes rows left behind by a crash or a failed drain",
    "run_sweep": "the scheduled sweep job",
    "insert_email": "writes the email row; swallowing it means the email was never stored",
    "set_durable": "the delivery-mode toggle; decides what takes due rows in every process",
    "requeue": "puts rows back to queued (dead-letter retry, durable sweep)",
    "retry": "mail.retry(): puts a dead letter back; swallowing it leaves it failed",
    "mark_released": "frees rows released at stop from the age gate; a failure makes "
                     "them wait OUTBOX_SWEEP_MIN_AGE_SECONDS",
}

# `_degrade`'s reporters -> how they are defined there and called: a "function" at module
# level (`_degrade.report(...)`, or imported by name), or a "method" of a class there
# (`<tracker>.failing(...)`, whatever the receiver).
REPORTERS: dict[str, str] = {"report": "function", "failing": "method"}
HELPER = "_degrade.py"  # directly under --root

EXCLUDED_DIRS = ("migrations/versions",)
# Logger method or level constant -> level (`exception` logs at ERROR).
LEVELS = {"CRITICAL": 50, "FATAL": 50, "ERROR": 40, "EXCEPTION": 40, "WARNING": 30, "WARN": 30,
          "INFO": 20, "DEBUG": 10}
LEVEL_TEXT = {30: "WARNING", 20: "INFO", 10: "DEBUG", 1: "a level the checker cannot read"}
LOGGER_NAME = re.compile(r"_*(?:\w+_)?(?:log|logger|logging)|getlogger", re.IGNORECASE)
OPT_OUT = re.compile(r"\bdurability:\s*ok\b(?P<reason>.*)$")
_DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Report:
    """What one run found."""

    files: int = 0
    seams: int = 0
    violations: list[str] = field(default_factory=list)
    opt_outs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Helper:
    """What the helper check found: the reporters that are loud, and why each other one is not."""

    loud: frozenset[str] = frozenset()
    why_not: dict[str, str] = field(default_factory=dict)

    @classmethod
    def missing(cls, why: str) -> Helper:
        """No helper to trust: no reporter is loud, for the reason ``why``."""
        return cls(frozenset(), {name: why for name in REPORTERS})


def _display(name: str) -> str:
    """How a handler calls reporter ``name``: ``_degrade.report()``, ``failing()``."""
    return f"_degrade.{name}()" if REPORTERS[name] == "function" else f"{name}()"


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


def _reporter_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to the ``_degrade`` module, and to its reporter functions (name -> reporter)."""
    modules: set[str] = {"_degrade"}
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names
                           if a.asname and a.name.rsplit(".", 1)[-1] == "_degrade")
        elif isinstance(node, ast.ImportFrom):
            from_degrade = (node.module or "").rsplit(".", 1)[-1] == "_degrade"
            for alias in node.names:
                if alias.name == "_degrade":
                    modules.add(alias.asname or alias.name)
                elif from_degrade and REPORTERS.get(alias.name) == "function":
                    functions[alias.asname or alias.name] = alias.name
    return modules, functions


def _reporter(call: ast.Call, modules: set[str], functions: dict[str, str]) -> str | None:
    """The ``_degrade`` reporter ``call`` calls, if any (loud or not: the helper decides)."""
    func = call.func
    if isinstance(func, ast.Name):
        return functions.get(func.id)
    if not isinstance(func, ast.Attribute):
        return None
    kind = REPORTERS.get(func.attr)
    if kind == "method" or (kind == "function" and _final_name(func.value) in modules):
        return func.attr
    return None


def _level(call: ast.Call) -> int:
    """The level a logger call logs at, 0 if ``call`` does not log."""
    func = call.func
    if not isinstance(func, ast.Attribute) or not LOGGER_NAME.fullmatch(_final_name(func.value)):
        return 0
    if func.attr.upper() in LEVELS:
        return LEVELS[func.attr.upper()]
    if func.attr == "log" and call.args:
        level = call.args[0]
        if isinstance(level, ast.Constant) and isinstance(level.value, int):
            return level.value
        return LEVELS.get(_final_name(level), 1)
    return 0


def _level_text(level: int) -> str:
    """``WARNING`` for 30, ``level 25`` for a level without a name."""
    return LEVEL_TEXT.get(level, f"level {level}")


def _instead(handler: ast.ExceptHandler, modules: set[str], functions: dict[str, str],
             helper: Helper) -> str | None:
    """None when ``handler`` re-raises or reports at ERROR; else what it does instead."""
    body = list(_shallow_walk(handler.body))
    levels = [0]
    quiet: dict[str, None] = {}  # reporters called that the helper check did not pass, in order
    for node in body:
        if isinstance(node, ast.Raise):
            return None
        if isinstance(node, ast.Call):
            name = _reporter(node, modules, functions)
            if name is None:
                levels.append(_level(node))
            elif name in helper.loud:
                levels.append(40)
            else:
                quiet[name] = None
    if max(levels) >= 40:
        return None
    parts = [f"logs at {_level_text(max(levels))}"] if max(levels) > 0 else []
    parts += [f"{_display(name)} is not loud: "
              f"{helper.why_not.get(name, 'the helper was not checked')}" for name in quiet]
    if parts:
        text = "; ".join(parts)
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


@dataclass
class _Definition:
    """One definition of a reporter in the helper, and what its own body does."""

    qualname: str
    lineno: int
    logs_at_error: bool
    below_error: list[tuple[int, int]]  # (line, level) of its log calls below ERROR
    calls: set[str]  # the reporters it calls


def _inspect(node: ast.FunctionDef | ast.AsyncFunctionDef, qualname: str) -> _Definition:
    """What reporter ``node``'s own body (not nested defs) logs, and the reporters it calls."""
    definition = _Definition(qualname, node.lineno, False, [], set())
    for call in _shallow_walk(node.body):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        if isinstance(func, ast.Name) and REPORTERS.get(func.id) == "function":
            definition.calls.add(func.id)
        elif isinstance(func, ast.Attribute) and REPORTERS.get(func.attr) == "method":
            definition.calls.add(func.attr)
        elif (level := _level(call)) >= 40:
            definition.logs_at_error = True
        elif level > 0:
            definition.below_error.append((call.lineno, level))
    return definition


def _definitions(tree: ast.Module) -> dict[str, list[_Definition]]:
    """Reporter -> its definitions: module-level functions, or methods of module-level classes."""
    found: dict[str, list[_Definition]] = {name: [] for name in REPORTERS}
    for node in tree.body:
        if isinstance(node, _FUNCTIONS) and REPORTERS.get(node.name) == "function":
            found[node.name].append(_inspect(node, node.name))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, _FUNCTIONS) and REPORTERS.get(item.name) == "method":
                    found[item.name].append(_inspect(item, f"{node.name}.{item.name}"))
    return found


def check_helper(source: str, label: str, report: Report) -> Helper:
    """Check the helper's reporters, adding violations to ``report``; which ones are loud."""
    definitions = _definitions(ast.parse(source, filename=label))
    # Loud: defined, and every definition logs at ERROR (or calls a loud reporter) and never
    # below. Grown to a fixed point, so reporters that only call each other are not loud.
    loud: set[str] = set()
    while True:
        grown = {name for name, defs in definitions.items() if defs and all(
            not d.below_error and (d.logs_at_error or d.calls & loud) for d in defs)}
        if grown == loud:
            break
        loud = grown
    found: list[tuple[int, str]] = []
    why_not: dict[str, str] = {}
    for name, defs in definitions.items():
        if not defs:
            where = "" if REPORTERS[name] == "function" else " method in a class"
            why_not[name] = f"{label} defines no {name}(){where}"
            continue
        for d in defs:
            for line, level in d.below_error:
                text = (f"{label}:{line}: reporter {d.qualname}() logs at {_level_text(level)}; "
                        "every call to it is taken as a report at ERROR, so it must log at "
                        "ERROR or above")
                found.append((line, text))
            if d.below_error:
                first = min(line for line, _ in d.below_error)
            elif not (d.logs_at_error or d.calls & loud):
                through = "".join(f"; it calls {other}(), which is not loud either"
                                  for other in sorted(d.calls))
                text = (f"{label}:{d.lineno}: reporter {d.qualname}() never logs at ERROR or "
                        f"above{through}; handlers calling it are not loud")
                found.append((d.lineno, text))
                first = d.lineno
            else:
                continue
            why_not.setdefault(name, f"see {label}:{first}")
    report.violations.extend(text for _, text in sorted(found))
    return Helper(frozenset(loud), why_not)


def check_source(source: str, label: str, report: Report, helper: Helper) -> None:
    """Check one module's ``source``, trusting ``helper``'s loud reporters; adds to ``report``."""
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
            elif (instead := _instead(handler, modules, functions, helper)) is None:
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
    """Check the helper under ``root``, then every module there except the excluded directories."""
    report = Report()
    path = root / HELPER
    if not path.is_file():
        helper = Helper.missing(f"there is no {HELPER} in {_label(root)}")
    else:
        try:
            helper = check_helper(path.read_text(encoding="utf-8"), _label(path), report)
        except (SyntaxError, UnicodeDecodeError):  # reported below, as for any module
            helper = Helper.missing(f"{_label(path)} cannot be checked")
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(relative.startswith(d + "/") for d in EXCLUDED_DIRS):
            continue
        try:
            check_source(path.read_text(encoding="utf-8"), _label(path), report, helper)
        except (SyntaxError, tokenize.TokenError, UnicodeDecodeError) as exc:
            report.files += 1
            report.violations.append(f"{_label(path)}: cannot be checked: {exc}")
    return report


class HelperSample(NamedTuple):
    """A built-in ``_degrade.py`` for ``--self-test`` and what the helper check must say."""

    name: str
    report: str = "logger.error('%s. Consequence: %s. Fix: %s.', what, consequence, fix)"
    failing: str = ("if fault in self.ongoing:\n    return False\n"
                    "report(what, consequence=consequence, fix=fix, exc=exc)\nreturn True")
    violations: int = 0
    says: str = ""  # must appear in the violation text
    loud: frozenset[str] = frozenset(REPORTERS)  # the reporters it must find loud
    report_def: str = "report"  # the name report()'s definition is given
    warn_all: bool = False  # every `.error(`/`.exception(`/`.critical(` turned into `.warning(`


_HELPER = ("import logging\nlogger = logging.getLogger(__name__)\n\n"
           "def {report_def}(what, *, consequence, fix, exc=None):\n{report}\n\n"
           "class FaultTracker:\n"
           "    def failing(self, fault, what, *, consequence, fix, exc=None):\n{failing}\n\n"
           "    def recovered(self, fault):  # not a reporter: a fault ending is no degradation\n"
           "        logger.info('Recovered: %s', fault)\n")
_ERROR_CALL = re.compile(r"\.(?:error|exception|critical)\(")
NOT_LOUD: frozenset[str] = frozenset()
REPORT_ONLY = frozenset({"report"})
HELPER_SAMPLES = [
    HelperSample("helper"),
    HelperSample("report-logs-at-ERROR", report="logger.log(logging.ERROR, '%s', what)"),
    HelperSample("report-logs-at-40", report="logger.log(40, '%s', what)"),
    HelperSample("report-logs-exception", report="logger.exception('%s', what)"),
    HelperSample("report-logs-critical", report="logger.critical('%s', what)"),
    HelperSample("failing-logs-itself", failing="logger.error('%s', what)\nreturn True"),
    HelperSample("error-to-warning", warn_all=True, violations=2, loud=NOT_LOUD,
                 says="reporter report() logs at WARNING"),
    HelperSample("critical-to-warning", report="logger.critical('%s', what)", warn_all=True,
                 violations=2, loud=NOT_LOUD, says="reporter report() logs at WARNING"),
    HelperSample("report-logs-at-WARNING", report="logger.log(logging.WARNING, '%s', what)",
                 violations=2, loud=NOT_LOUD, says="report() logs at WARNING"),
    HelperSample("report-logs-at-unreadable-level", report="logger.log(level, '%s', what)",
                 violations=2, loud=NOT_LOUD, says="logs at a level the checker cannot read"),
    HelperSample("report-warns-then-errs", report="logger.warning('%s', what)\n"
                 "logger.error('%s', what)", violations=2, loud=NOT_LOUD,
                 says="report() logs at WARNING"),
    HelperSample("report-logs-nothing", report="return None", violations=2, loud=NOT_LOUD,
                 says="reporter report() never logs at ERROR or above"),
    HelperSample("report-logs-in-nested-def", report="def later():\n"
                 "    logger.error('%s', what)\nreturn later", violations=2, loud=NOT_LOUD,
                 says="reporter report() never logs at ERROR or above"),
    HelperSample("no-report", report_def="notify", violations=1, loud=NOT_LOUD,
                 says="FaultTracker.failing() never logs at ERROR or above; it calls report(), "
                      "which is not loud either"),
    HelperSample("failing-logs-nothing", failing="return True", violations=1, loud=REPORT_ONLY,
                 says="reporter FaultTracker.failing() never logs at ERROR or above"),
    HelperSample("failing-warns-only", failing="logger.warning('%s', what)\nreturn True",
                 violations=1, loud=REPORT_ONLY, says="FaultTracker.failing() logs at WARNING"),
    HelperSample("failing-warns-then-reports", failing="logger.warning('%s', what)\n"
                 "report(what, consequence=consequence, fix=fix)", violations=1,
                 loud=REPORT_ONLY, says="FaultTracker.failing() logs at WARNING"),
    HelperSample("reporters-only-call-each-other",
                 report="FaultTracker().failing('f', what, consequence=consequence, fix=fix)",
                 violations=2, loud=NOT_LOUD,
                 says="report() never logs at ERROR or above; it calls failing()"),
]


def _helper_source(sample: HelperSample) -> str:
    """The built-in ``_degrade.py`` ``sample`` describes."""
    source = _HELPER.format(report_def=sample.report_def,
                            report=textwrap.indent(sample.report, " " * 4),
                            failing=textwrap.indent(sample.failing, " " * 8))
    return _ERROR_CALL.sub(".warning(", source) if sample.warn_all else source


class Sample(NamedTuple):
    """A built-in module for ``--self-test`` and what the checker must say about it."""

    name: str
    handler: str  # the body of `except Exception as exc:`
    seams: int = 1
    violations: int = 0
    says: str = ""  # must appear in the violation text
    opt_outs: int = 0
    marker: str = ""  # a comment on the except line
    body: str = "delivery.deliver_soon(ids)"  # the try body
    after: str = ""  # else:/finally: clauses
    helper: str = "helper"  # the HelperSample it is checked with; "" for no _degrade.py


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
           after="    else:\n        delivery.deliver_soon(ids)\n"),
    Sample("finally-only", "pass", seams=0, body="int(ids)",
           after="    finally:\n        worker.hand(ids)\n"),
    Sample("call-in-nested-def", "pass", seams=0,
           body="def later():\n            delivery.deliver_soon(ids)"),
    Sample("report-without-helper", "_degrade.report('x', consequence='c', fix='f')",
           violations=1, helper="",
           says="(_degrade.report() is not loud: there is no _degrade.py"),
    Sample("failing-without-helper", "faults.failing('db', 'x', consequence='c', fix='f')",
           violations=1, helper="", says="(failing() is not loud: there is no _degrade.py"),
    Sample("report-of-warned-helper", "_degrade.report('x', consequence='c', fix='f', exc=exc)",
           violations=1, helper="error-to-warning",
           says="(_degrade.report() is not loud: see <helper:error-to-warning>:"),
    Sample("failing-of-warned-helper", "faults.failing('db', 'x', consequence='c', fix='f')",
           violations=1, helper="error-to-warning", says="(failing() is not loud: see "),
    Sample("imported-report-of-quiet-helper", "loud('x', consequence='c', fix='f')",
           violations=1, helper="report-logs-nothing", says="_degrade.report() is not loud"),
    Sample("report-of-helper-without-it", "_degrade.report('x', consequence='c', fix='f')",
           violations=1, helper="no-report", says="<helper:no-report> defines no report()"),
    Sample("report-beside-quiet-failing", "_degrade.report('x', consequence='c', fix='f')",
           helper="failing-logs-nothing"),
    Sample("failing-beside-loud-report", "faults.failing('db', 'x', consequence='c', fix='f')",
           violations=1, helper="failing-logs-nothing", says="(failing() is not loud: "),
    Sample("recovered-is-not-a-report", "faults.recovered('db')", violations=1,
           says="(carries on without reporting)"),
]


def self_test() -> int:
    """Judge every built-in sample; 0 when all were judged as expected."""
    failed = 0
    helpers: dict[str, Helper] = {"": Helper.missing(f"there is no {HELPER}")}
    for helper_sample in HELPER_SAMPLES:
        report = Report()
        helper = check_helper(_helper_source(helper_sample), f"<helper:{helper_sample.name}>",
                              report)
        helpers[helper_sample.name] = helper
        said = "\n".join(report.violations)
        if ((len(report.violations), helper.loud) != (helper_sample.violations, helper_sample.loud)
                or helper_sample.says not in said):
            failed += 1
            print(f"self-test: helper sample {helper_sample.name!r} misjudged: "
                  f"{len(report.violations)} violations, loud {sorted(helper.loud)}, expected "
                  f"{helper_sample.violations}, loud {sorted(helper_sample.loud)}; "
                  f"output: {said or '(none)'}", file=sys.stderr)
    for sample in SAMPLES:
        marker = f"  # {sample.marker}" if sample.marker else ""
        source = (f"{_HEADER}{sample.body}\n    except Exception as exc:{marker}\n"
                  f"        {sample.handler}\n{sample.after}")
        report = Report()
        check_source(source, f"<{sample.name}>", report, helpers[sample.helper])
        got = (report.seams, len(report.violations), len(report.opt_outs))
        want = (sample.seams, sample.violations, sample.opt_outs)
        said = "\n".join(report.violations)
        if got != want or sample.says not in said:
            failed += 1
            print(f"self-test: sample {sample.name!r} misjudged: (seams, violations, opt-outs) "
                  f"= {got}, expected {want}; output: {said or '(none)'}", file=sys.stderr)
    total = len(HELPER_SAMPLES) + len(SAMPLES)
    print(f"self-test: {total - failed} of {total} samples judged as expected")
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
