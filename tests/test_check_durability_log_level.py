"""``scripts/check_durability_log_level.py``: the real tree passes, and weakening a seam fails it.

The script runs as CI runs it: a subprocess from the repository root.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_durability_log_level.py"
PACKAGE = ROOT / "flask_mail_outbox"
# A call that reports at ERROR, as written in the library's handlers.
LOUD_CALL = re.compile(
    r"_degrade\.report\(|[\w.]+\.failing\(|logger\.(?:exception|error|critical)\(")


def run_checker(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the checker with ``args`` from the repository root."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A tiny package under ``root`` made of ``files`` (relative path -> source)."""
    package = root / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return package


def claim_with_handler(handler: str, marker: str = "") -> str:
    """A module whose ``except`` around ``claim_ids()`` (on line 6) runs ``handler``."""
    return (
        "import logging\n"
        "logger = logging.getLogger(__name__)\n\n"
        "def drain(store, ids):\n"
        "    try:\n"
        "        store.claim_ids(ids, owner='o', lease_seconds=30)\n"
        f"    except Exception:{marker}\n"
        f"        {handler}\n"
    )


def test_real_tree_passes() -> None:
    result = run_checker()
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"checked (\d+) seams in (\d+) files: 0 violations", result.stdout)
    assert match, result.stdout
    assert int(match.group(1)) > 0 and int(match.group(2)) > 0


def test_self_test_passes() -> None:
    result = run_checker("--self-test")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"self-test: (\d+) of \1 samples judged as expected", result.stdout)


def test_list_callees_names_each_seam_with_a_reason() -> None:
    result = run_checker("--list-callees")
    assert result.returncode == 0
    names = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert {"deliver_soon", "claim_ids", "send_many", "record", "renew_leases"} <= set(names)
    assert "send" not in names  # ambiguous: transport, mail.send and blinker signals
    assert all(reason.strip() for reason in names.values())


def _loud_handler_around_deliver_soon(package: Path) -> tuple[Path, ast.ExceptHandler]:
    """The first ``except`` in ``package`` around a ``deliver_soon()`` call that reports loudly."""
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Try):
                continue
            calls = [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
            if not any(isinstance(c.func, ast.Attribute) and c.func.attr == "deliver_soon"
                       for c in calls):
                continue
            for handler in node.handlers:
                text = ast.get_source_segment(source, handler) or ""
                if LOUD_CALL.search(text) and "raise" not in text:
                    return path, handler
    raise AssertionError("no loud except around deliver_soon() in the package")


def test_weakening_a_seam_to_warning_fails_with_its_location(tmp_path: Path) -> None:
    copy = tmp_path / "flask_mail_outbox"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path, handler = _loud_handler_around_deliver_soon(copy)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    first, last = handler.lineno - 1, handler.end_lineno or handler.lineno
    lines[first:last] = [LOUD_CALL.sub("logger.warning(", line) for line in lines[first:last]]
    path.write_text("".join(lines), encoding="utf-8")

    result = run_checker("--root", str(copy))

    assert result.returncode == 1, result.stdout + result.stderr
    violation = next((line for line in result.stdout.splitlines()
                      if line.startswith(f"{path}:{handler.lineno}: ")), None)
    assert violation is not None, result.stdout
    assert "deliver_soon()" in violation and "(logs at WARNING)" in violation
    assert re.search(r"checked \d+ seams in \d+ files: 1 violations", result.stdout)


def test_pass_around_claim_ids_fails(tmp_path: Path) -> None:
    package = write_package(tmp_path, {"worker.py": claim_with_handler("pass")})
    result = run_checker("--root", str(package))
    assert result.returncode == 1
    assert (f"{package / 'worker.py'}:7: except around claim_ids() neither re-raises nor "
            "reports at ERROR (swallows silently)") in result.stdout
    assert "checked 1 seams in 2 files: 1 violations, 0 opted out" in result.stdout


@pytest.mark.parametrize(("handler", "verdict"), [
    ("logger.info('claim failed')", "(logs at INFO)"),
    ("return None", "(returns without reporting)"),
])
def test_quiet_handlers_around_claim_ids_fail(tmp_path: Path, handler: str, verdict: str) -> None:
    package = write_package(tmp_path, {"worker.py": claim_with_handler(handler)})
    result = run_checker("--root", str(package))
    assert result.returncode == 1
    assert verdict in result.stdout


@pytest.mark.parametrize("marker", ["  # durability: ok", "  # noqa: BLE001 - durability: ok  "])
def test_opt_out_without_a_reason_fails(tmp_path: Path, marker: str) -> None:
    package = write_package(tmp_path, {"worker.py": claim_with_handler("pass", marker)})
    result = run_checker("--root", str(package))
    assert result.returncode == 1
    assert f"{package / 'worker.py'}:7: `# durability: ok` around claim_ids() needs a reason" \
        in result.stdout


def test_opt_out_with_a_reason_passes_and_is_counted(tmp_path: Path) -> None:
    marker = "  # durability: ok the row stays queued and the sweep takes it"
    package = write_package(tmp_path, {"worker.py": claim_with_handler("pass", marker)})
    result = run_checker("--root", str(package))
    assert result.returncode == 0, result.stdout
    assert "opted out around claim_ids(): the row stays queued and the sweep takes it" \
        in result.stdout
    assert "checked 1 seams in 2 files: 0 violations, 1 opted out" in result.stdout


def test_alembic_revisions_are_not_checked(tmp_path: Path) -> None:
    package = write_package(tmp_path, {
        "migrations/__init__.py": "",
        "migrations/versions/0001_initial.py": claim_with_handler("pass"),
    })
    result = run_checker("--root", str(package))
    assert result.returncode == 0, result.stdout
    assert "checked 0 seams in 2 files: 0 violations" in result.stdout


# --- the helper itself: `_degrade`'s reporters must log at ERROR ----------------------------

# Every call that logs at ERROR or above, as the mutation rewrites it.
ERROR_CALL = re.compile(r"\.(?:error|exception|critical)\(")


def copy_package(tmp_path: Path) -> Path:
    """A copy of the real package under ``tmp_path``, checked with ``--root``."""
    copy = tmp_path / "flask_mail_outbox"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _reporter_def(source: str, name: str) -> ast.FunctionDef:
    """The definition of ``name`` in ``_degrade``'s source (module level or in a class)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"_degrade.py defines no {name}()")


def _error_call_lines(source: str, name: str) -> list[int]:
    """The lines of ``name``'s calls that log at ERROR or above (``.error(`` and kin)."""
    return [n.lineno for n in ast.walk(_reporter_def(source, name)) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in {"error", "exception", "critical"}]


def test_every_error_turned_into_warning_fails_on_the_helper(tmp_path: Path) -> None:
    copy = copy_package(tmp_path)
    helper = copy / "_degrade.py"
    report_lines = _error_call_lines(helper.read_text(encoding="utf-8"), "report")
    assert report_lines, "_degrade.report() logs nothing at ERROR in the real package"
    for path in copy.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        path.write_text(ERROR_CALL.sub(".warning(", source), encoding="utf-8")

    result = run_checker("--root", str(copy))

    assert result.returncode == 1, result.stdout + result.stderr
    for line in report_lines:
        assert re.search(rf"^{re.escape(str(helper))}:{line}: .*report\(\).*logs at WARNING",
                         result.stdout, re.MULTILINE), result.stdout
    assert not re.search(r"checked \d+ seams in \d+ files: 0 violations", result.stdout)


def _rewrite_reporter(helper: Path, name: str, body: str | None = None) -> int:
    """Turn ``name``'s ERROR calls into WARNING, or replace its body by ``body``; its line."""
    source = helper.read_text(encoding="utf-8")
    node = _reporter_def(source, name)
    lines = source.splitlines(keepends=True)
    first, last = node.body[0].lineno - 1, node.end_lineno or node.lineno
    if body is None:
        lines[first:last] = [ERROR_CALL.sub(".warning(", line) for line in lines[first:last]]
    else:
        indent = " " * node.body[0].col_offset
        lines[first:last] = [f"{indent}{body}\n"]
    helper.write_text("".join(lines), encoding="utf-8")
    return node.lineno


def test_helper_report_at_warning_fails_and_its_callers_are_not_loud(tmp_path: Path) -> None:
    copy = copy_package(tmp_path)
    helper = copy / "_degrade.py"
    lines = _error_call_lines(helper.read_text(encoding="utf-8"), "report")
    _rewrite_reporter(helper, "report")

    result = run_checker("--root", str(copy))

    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(rf"^{re.escape(str(helper))}:{lines[0]}: .*report\(\).*logs at WARNING",
                     result.stdout, re.MULTILINE), result.stdout
    # failing() reports through report(): it is not loud either, nor is any handler using them.
    assert re.search(rf"^{re.escape(str(helper))}:\d+: .*failing\(\)", result.stdout,
                     re.MULTILINE), result.stdout
    assert re.search(r"^\S+:\d+: except around .*_degrade\.report\(\) is not loud",
                     result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize(("reporter", "body"), [
    ("report", "return None"),
    ("failing", "return True"),
])
def test_helper_reporter_that_logs_nothing_fails(tmp_path: Path, reporter: str,
                                                 body: str) -> None:
    copy = copy_package(tmp_path)
    helper = copy / "_degrade.py"
    line = _rewrite_reporter(helper, reporter, body)

    result = run_checker("--root", str(copy))

    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(rf"^{re.escape(str(helper))}:{line}: .*{reporter}\(\) never logs at ERROR",
                     result.stdout, re.MULTILINE), result.stdout


def test_unmutated_copy_of_the_package_passes(tmp_path: Path) -> None:
    result = run_checker("--root", str(copy_package(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"checked [1-9]\d* seams in \d+ files: 0 violations", result.stdout)
    assert "_degrade.py" not in result.stdout


GOOD_HELPER = """\
    import logging
    logger = logging.getLogger(__name__)

    def report(what, *, consequence, fix, exc=None):
        logger.log(logging.ERROR, "%s. %s. %s.", what, consequence, fix)

    class FaultTracker:
        def failing(self, fault, what, *, consequence, fix, exc=None):
            report(what, consequence=consequence, fix=fix, exc=exc)
            return True

        def recovered(self, fault):
            logger.info("Recovered: %s", fault)  # not a report: INFO is fine
    """
REPORTING_WORKER = """\
    from . import _degrade

    def drain(store, faults, ids):
        try:
            store.claim_ids(ids, owner='o', lease_seconds=30)
        except Exception as exc:
            _degrade.report('claim failed', consequence='c', fix='f', exc=exc)
        try:
            store.claim_ids(ids, owner='o', lease_seconds=30)
        except Exception as exc:
            faults.failing('claim', 'claim failed', consequence='c', fix='f', exc=exc)
    """


def test_reporters_of_a_helper_that_logs_at_error_are_loud(tmp_path: Path) -> None:
    package = write_package(tmp_path, {"_degrade.py": GOOD_HELPER, "worker.py": REPORTING_WORKER})
    result = run_checker("--root", str(package))
    assert result.returncode == 0, result.stdout
    assert "checked 2 seams in 3 files: 0 violations, 0 opted out" in result.stdout


@pytest.mark.parametrize(("helper", "says"), [
    (None, "there is no _degrade.py"),
    ("import logging\n", "defines no report()"),
    (GOOD_HELPER.replace("def report(", "def notify("), "defines no report()"),
], ids=["no-helper", "empty-helper", "report-renamed"])
def test_reporters_are_not_accepted_by_name_alone(tmp_path: Path, helper: str | None,
                                                  says: str) -> None:
    files = {"worker.py": REPORTING_WORKER} if helper is None else {
        "_degrade.py": helper, "worker.py": REPORTING_WORKER}
    package = write_package(tmp_path, files)
    result = run_checker("--root", str(package))
    assert result.returncode == 1, result.stdout
    worker = package / "worker.py"
    assert f"{worker}:6: except around claim_ids() neither re-raises nor reports at ERROR " \
        "(_degrade.report() is not loud: " in result.stdout
    assert f"{worker}:10: except around claim_ids() neither re-raises nor reports at ERROR " \
        "(failing() is not loud: " in result.stdout
    assert says in result.stdout
