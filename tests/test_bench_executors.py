"""``python -m benchmarks executors`` finds the claims it reports in the PostgreSQL log.

The scenario's "claims", "rows/claim" and "commit→claim" come from the claim
statements of the workers' sessions in the server's log: a dispatcher's
claim (one statement with the reap) and the claim of given ids a task runs
(an ``UPDATE`` built by SQLAlchemy) are written differently, and both must
be found, or the table says nothing about claim batching. The engines' rows
need their plug-ins (``benchmarks/executor_<engine>.py``) and run in CI's
``python -m benchmarks smoke``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import executors
from benchmarks.__main__ import main
from benchmarks._harness import Context, postgres_available
from benchmarks.bench_app import build, message


@pytest.fixture
def context() -> Iterator[Context]:
    if not postgres_available():
        message_ = "no PostgreSQL server binaries (scripts/pg-cluster bindir found none)"
        if os.environ.get("CI"):
            pytest.fail(message_)
        pytest.skip(message_)
    ctx = Context()
    try:
        yield ctx
    finally:
        ctx.close()


def test_every_row_counts_its_claims_and_an_engine_its_tasks(context: Context,
                                                            tmp_path: Path) -> None:
    # The engines whose plug-in is in the tree (all three once merged; in CI each
    # must also be available, or the scenario fails).
    present = [e for e in executors.ENGINES
               if importlib.util.find_spec(f"benchmarks.executor_{e}") is not None]
    out = tmp_path / "executors.json"
    assert main(["executors", "--n", "40", "--rounds", "1", "--concurrency", "4",
                 "--delay-ms", "20", "--engines", ",".join(present), "--json", str(out)]) == 0
    table = json.loads(out.read_text())["scenarios"]["executors"]["tables"][0]
    rows = {row[0]: dict(zip(table["columns"], row, strict=True)) for row in table["rows"]}
    assert set(rows) <= {"dispatcher", *present} and "dispatcher" in rows
    for name, row in rows.items():
        assert row["not sent"] == 0 and row["msg/s"] > 0, name
        # The backlog of 41 took at least one claim, and none was missed: a claim
        # holds at most a batch (100).
        assert 1 <= row["claims"] <= 41, name
        assert row["commit→claim ms"] is not None, name
        if name != "dispatcher":
            # The commit's task (the one email it sent), then the sweep's one chunk.
            assert row["tasks"] == 2, name


def test_a_claim_of_given_ids_is_found_as_a_task_runs_it(context: Context) -> None:
    # Inline mode hands a commit's ids to this process's worker, which claims
    # them by id: the same statement a task's claim of its ids is.
    pg = context.postgres()
    url = pg.create_database("claims")
    pg.log_statements(url)
    sink = context.sink()
    bench = build(url, sink.smtp_port, OUTBOX_DURABLE=False, OUTBOX_RUN_SCHEDULER=False)
    try:
        start = time.time()
        with bench.app.app_context():
            for i in range(5):
                bench.mail.send(message(f"claim #{i}"))
            bench.db.session.commit()
            bench.db.session.remove()
        assert sink.wait_for(5, timeout=30)["count"] == 5
        end = time.time()
    finally:
        executors.close(bench)
    claims = executors.claim_times(pg.directory / "postgres.log", url, start, end)
    assert 1 <= len(claims) <= 5
    assert all(start <= at <= end for at in claims)
