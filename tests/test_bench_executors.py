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


def test_the_dispatcher_row_counts_its_claims(context: Context, tmp_path: Path) -> None:
    out = tmp_path / "executors.json"
    assert main(["executors", "--n", "40", "--rounds", "1", "--concurrency", "4",
                 "--delay-ms", "20", "--engines", "", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["scenarios"]["executors"]["tables"][0]
    row = dict(zip(table["columns"], table["rows"][0], strict=True))
    assert row["executor"] == "dispatcher" and row["not sent"] == 0
    assert row["msg/s"] > 0
    # The backlog of 41 took at least one claim, and none was missed: a claim
    # holds at most a batch (100).
    assert 1 <= row["claims"] <= 41
    assert row["commit→claim ms"] is not None


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
