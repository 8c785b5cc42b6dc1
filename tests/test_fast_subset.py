"""The fast subset, ``pytest -m "not slow"``, stays what docs/contributing.md promises.

tests/slow.txt lists the slow tests by node-id prefix and tests/conftest.py marks them
``slow``. One collection of the whole suite (in a subprocess, as a contributor's run
collects it) proves:

- every test module keeps at least one test in the fast subset, so the quick loop runs
  something of every module, except the files tests/slow.txt names whole (on purpose,
  with the reason beside them): none is dropped from it by accident;
- every entry of tests/slow.txt still names a test: a renamed or deleted test leaves no
  dead entry behind (one that would later mark an unrelated new test slow);
- a test is marked ``slow`` exactly when an entry names it (the conftest hook works).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SLOW_LIST, read_slow_list, slow_entry_matches

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def collect(tmp_path: Path) -> dict[str, bool]:
    """Every test of the suite by node id: whether it is marked slow."""
    report = tmp_path / "collected.txt"
    env = {**os.environ, "OUTBOX_COLLECTION_REPORT": str(report)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", str(TESTS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    collected = {}
    for line in report.read_text(encoding="utf-8").splitlines():
        kind, nodeid = line.split(" ", 1)
        collected[nodeid] = kind == "slow"
    assert len(collected) > 1000, f"only {len(collected)} tests collected"
    return collected


def test_the_slow_list_and_the_fast_subset(tmp_path: Path) -> None:
    collected = collect(tmp_path)
    entries = read_slow_list()

    modules = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py"))
    without_fast = [m for m in modules if m not in entries
                    and not any(n.startswith(m + "::") and not slow
                                for n, slow in collected.items())]
    assert not without_fast, (
        f"these test modules have no test left in the fast subset; keep one of each "
        f"out of {SLOW_LIST.name} (or name the file whole there, saying why): {without_fast}")

    dead = [e for e in entries if not any(slow_entry_matches(e, n) for n in collected)]
    assert not dead, f"{SLOW_LIST.name} entries that name no test (remove them): {dead}"

    mismatched = [n for n, slow in collected.items()
                  if slow != any(slow_entry_matches(e, n) for e in entries)]
    assert not mismatched, f"marked slow but not listed, or listed but not marked: {mismatched[:20]}"
