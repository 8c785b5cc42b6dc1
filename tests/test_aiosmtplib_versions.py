"""The SMTP transport's tests on the lowest aiosmtplib that pyproject.toml allows.

The transport takes aiosmtplib's open session over (``Pipe.take_over``: its
``transport`` and ``set_protocol``), so every release in the allowed range must
be one the tests ran on. The whole suite runs on what pip resolves, the newest
release below the upper bound; this module runs the transport's test modules
once more, in a subprocess, with the lower bound's release installed by
``pip install --target`` into a throwaway directory that comes first on
``PYTHONPATH`` (every other package is the suite's own). SQLite only: the
aiosmtplib version does not meet the database, and the PostgreSQL half would
double the time. The release comes from PyPI: offline, the test is skipped
locally and fails in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import aiosmtplib
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Every module that drives aiosmtplib or the SMTP transport itself (the rest of
# the suite uses the transport only as the way emails leave).
TRANSPORT_MODULES = [
    "tests/test_transports.py",
    "tests/test_pipelining.py",
    "tests/test_faults.py",
    "tests/test_smtpserver.py",
    "tests/test_delivery.py",
    "tests/test_security.py",
    "tests/test_replies.py",
    "tests/test_retries.py",
]


def aiosmtplib_requirement() -> Requirement:
    """The ``aiosmtplib`` entry of ``[project] dependencies``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    [requirement] = [r for r in map(Requirement, project["dependencies"])
                     if r.name == "aiosmtplib"]
    return requirement


def lowest_allowed() -> Version:
    """The version of the requirement's ``>=`` bound."""
    [bound] = [s.version for s in aiosmtplib_requirement().specifier if s.operator == ">="]
    return Version(bound)


def test_the_requirement_is_a_tested_range() -> None:
    specifier = aiosmtplib_requirement().specifier
    assert {s.operator for s in specifier} == {">=", "<"}, specifier
    # The whole suite runs on this one; pip keeps it inside the range.
    assert specifier.contains(aiosmtplib.__version__), (aiosmtplib.__version__, specifier)


def test_transport_tests_pass_on_the_lowest_allowed_aiosmtplib(tmp_path: Path) -> None:
    lowest = lowest_allowed()
    target = tmp_path / f"aiosmtplib-{lowest}"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-input", "--no-deps", "--only-binary=:all:", "--target", str(target),
         f"aiosmtplib=={lowest}"],
        capture_output=True, text=True, timeout=300, check=False)
    if install.returncode != 0:
        reason = f"pip could not install aiosmtplib=={lowest}:\n{install.stderr[-3000:]}"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)

    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(target),
                                                        os.environ.get("PYTHONPATH")]))}
    found = subprocess.run(
        [sys.executable, "-c", "import aiosmtplib; print(aiosmtplib.__version__)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert Version(found.stdout.strip()) == lowest, found.stdout

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "basetemp"), "-k", "not postgresql",
         *TRANSPORT_MODULES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    output = run.stdout + run.stderr
    # Exit code 0: tests were collected (5 if not) and none failed.
    assert run.returncode == 0, f"on aiosmtplib {lowest}:\n{output[-12000:]}"
