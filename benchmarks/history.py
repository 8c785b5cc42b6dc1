"""``history``: finding due work costs the same with 0 or 1,000,000 retained ``sent`` rows.

Per database (SQLite file, PostgreSQL), in this process, on the store the
library uses:

1. the outbox tables with ``--due`` due ``queued`` rows (and nothing else);
2. the timings: the dispatcher's claim (:meth:`Store.claim_due`, limit =
   ``--due``: the reap and the claim, one round trip on PostgreSQL; the
   claimed rows are put back to ``queued`` between samples, untimed) and the
   sweep's lookup (:meth:`Store.sweep_candidates`, age gate 0), each the
   median of ``--samples`` runs;
3. ``--rows`` ``sent`` rows added with one set-based ``INSERT ... SELECT``
   (``generate_series`` / a recursive CTE), then ``ANALYZE``;
4. the same timings again, and ``EXPLAIN`` of the claim's row pick and of
   the sweep's query: they read the partial indexes (``ix_outbox_email_due``,
   ``ix_outbox_email_queued_created``, ``ix_outbox_email_lease``), whose size
   does not depend on the ``sent`` rows.

Ratio = time with the history / time without (goal <= 2).
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from ._harness import Context, Report, Table, log, median, ratio
from ._registry import scenario


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=None,
                        help="retained sent rows (default 1000000; --quick 100000)")
    parser.add_argument("--due", type=int, default=50, help="due queued rows (default 50)")
    parser.add_argument("--samples", type=int, default=None,
                        help="timed runs per figure (default 200; --quick 50)")
    parser.add_argument("--backends", default="sqlite,pg", help="sqlite and/or pg")


@scenario("history", "due-work lookup (claim, sweep) with 0 vs 1M retained sent rows",
          add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    samples = args.samples or (50 if args.quick else 200)
    table = Table(f"Due-work lookup with 0 vs {rows:,} retained sent rows ({args.due} due "
                  f"rows; median of {samples} runs, ms)",
                  ["database", "lookup", "empty ms", "history ms", "history/empty",
                   "indexes read (plan)", "partial"])
    report = Report("history", tables=[table])
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "pg":
            _, url = ctx.postgres().create_database("bench_history")
        else:
            url = f"sqlite:///{ctx.workdir / 'history.db'}"
        result = _measure(url, rows=rows, due=args.due, samples=samples)
        report.data[backend] = result
        for lookup in ("claim", "sweep"):
            plan = result["plans"][lookup]
            table.add(backend, lookup, result["empty"][lookup], result["history"][lookup],
                      ratio(result["history"][lookup], result["empty"][lookup]),
                      ", ".join(plan["indexes"]), plan["partial_index"])
        log(f"history {backend}: {result['insert_seconds']:.1f} s to add {rows:,} rows")
    for backend, result in report.data.items():
        for lookup in ("claim", "sweep"):
            report.notes.append(f"{backend} {lookup} plan with the history: "
                                + " | ".join(result["plans"][lookup]["lines"][:6]))
    report.notes.append("claim = Store.claim_due (reap + claim; the claimed rows are put back "
                        "between runs, untimed); sweep = Store.sweep_candidates (age gate 0)")
    return report


def _measure(url: str, *, rows: int, due: int, samples: int) -> dict[str, Any]:
    import sqlalchemy as sa

    from flask_mail_outbox._models import Status, email_table, metadata
    from flask_mail_outbox._store import Store

    engine = sa.create_engine(url)
    try:
        metadata.create_all(engine)
        store = Store(engine)
        _add_due(engine, due)
        result: dict[str, Any] = {"rows": rows, "due": due}
        result["empty"] = _timings(store, due, samples)
        started = time.perf_counter()
        _add_history(engine, rows)
        result["insert_seconds"] = time.perf_counter() - started
        result["history"] = _timings(store, due, samples)
        result["plans"] = _plans(engine, store)
        with engine.connect() as conn:
            counts = dict(conn.execute(sa.select(email_table.c.status, sa.func.count())
                                       .group_by(email_table.c.status)).all())
        result["counts"] = counts
        if counts.get(Status.SENT.value) != rows:
            raise RuntimeError(f"expected {rows} sent rows, found {counts}")
        return result
    finally:
        engine.dispose()


def _add_due(engine: Any, due: int) -> None:
    from flask_mail_outbox._models import email_table
    from flask_mail_outbox._store import utcnow

    now = utcnow()
    with engine.begin() as conn:
        conn.execute(email_table.insert(), [
            {"status": "queued", "created_at": now, "due_at": now, "message_id": f"<due{i}@b>",
             "sender": "bench@example.com", "recipients": '["rcpt@example.com"]',
             "subject": "due", "size": 10, "mime": b"x" * 10, "attempts": 0}
            for i in range(due)])


def _add_history(engine: Any, rows: int) -> None:
    """``rows`` sent rows in one set-based statement, then fresh statistics."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(
                "INSERT INTO outbox_email (status, created_at, due_at, sent_at, message_id, "
                "sender, recipients, subject, size, mime, attempts, key_head) "
                "SELECT 'sent', now() - make_interval(secs => g), now() - make_interval(secs "
                "=> g), now() - make_interval(secs => g), '<h' || g || '@bench>', "
                "'bench@example.com', '[\"rcpt@example.com\"]', 'old', 200, "
                "decode(repeat('78', 200), 'hex'), 1, false "
                f"FROM generate_series(1, {int(rows)}) AS g")
        else:
            conn.exec_driver_sql(
                "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g "
                f"WHERE i < {int(rows)}) "
                "INSERT INTO outbox_email (status, created_at, due_at, sent_at, message_id, "
                "sender, recipients, subject, size, mime, attempts, key_head) "
                "SELECT 'sent', datetime('now', '-' || i || ' seconds'), "
                "datetime('now', '-' || i || ' seconds'), datetime('now', '-' || i || "
                "' seconds'), '<h' || i || '@bench>', 'bench@example.com', "
                "'[\"rcpt@example.com\"]', 'old', 200, randomblob(200), 1, 0 FROM g")
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                "VACUUM ANALYZE outbox_email")
        else:
            conn.exec_driver_sql("ANALYZE")
            conn.commit()


def _put_back(store: Any) -> None:
    """Claimed rows back to due ``queued`` (between samples, untimed)."""
    from flask_mail_outbox._models import email_table as t

    with store.engine.begin() as conn:
        conn.execute(t.update().where(t.c.status == "sending").values(
            status="queued", attempts=0, lease_owner=None, lease_expires_at=None,
            due_at=t.c.created_at))


def _timings(store: Any, due: int, samples: int) -> dict[str, float | None]:
    claim_ms: list[float] = []
    sweep_ms: list[float] = []
    conn = store.dispatch_connection()
    try:
        for i in range(samples + 5):
            started = time.perf_counter()
            claimed, _ = store.claim_due(due, owner="bench", lease_seconds=30,
                                         reap=True, conn=conn)
            took = time.perf_counter() - started
            if len(claimed) != due:
                raise RuntimeError(f"claimed {len(claimed)} of {due} due rows")
            _put_back(store)
            started2 = time.perf_counter()
            found = store.sweep_candidates(min_age_seconds=0, limit=500)
            took2 = time.perf_counter() - started2
            if len(found) != due:
                raise RuntimeError(f"the sweep found {len(found)} of {due} due rows")
            if i >= 5:  # the first runs warm caches and compile statements
                claim_ms.append(1000 * took)
                sweep_ms.append(1000 * took2)
    finally:
        conn.close()
    return {"claim": median(claim_ms), "sweep": median(sweep_ms)}


_INDEX = re.compile(r"\b(ix_outbox_email_\w+|outbox_email_pkey|pk_outbox_email)\b")
_PARTIAL = ("ix_outbox_email_due", "ix_outbox_email_queued_created", "ix_outbox_email_lease",
            "ix_outbox_email_key_open")


def _plans(engine: Any, store: Any) -> dict[str, dict[str, Any]]:
    """EXPLAIN of the statements the claim and the sweep really send (captured)."""
    from sqlalchemy import event

    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH")):
            captured.append((statement, parameters))

    plans: dict[str, dict[str, Any]] = {}
    prefix = "EXPLAIN QUERY PLAN " if engine.dialect.name == "sqlite" else "EXPLAIN "
    for name in ("claim", "sweep"):
        captured.clear()
        event.listen(engine, "before_cursor_execute", capture)
        try:
            conn = store.dispatch_connection()
            try:
                if name == "claim":
                    store.claim_due(50, owner="explain", lease_seconds=30,
                                    reap=True, conn=conn)
                    _put_back(store)
                else:
                    store.sweep_candidates(min_age_seconds=0, limit=500)
            finally:
                conn.close()
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        lines: list[str] = []
        with engine.connect() as conn:
            for statement, parameters in captured:
                rows = conn.exec_driver_sql(prefix + statement, parameters).all()
                lines += [" ".join(str(c) for c in row if c is not None).strip()
                          for row in rows]
            conn.rollback()
        used = sorted(set(_INDEX.findall("\n".join(lines))))
        plans[name] = {"lines": lines, "indexes": used,
                       "partial_index": any(i in _PARTIAL for i in used)}
    return plans
