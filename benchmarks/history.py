"""``history``: due work and the dashboard cost the same with 0 or 1,000,000 retained rows.

Per database, in this process, on an app with the dashboard at ``/outbox``:

1. the figures on an empty table: ``--due`` emails queued through ``mail.send()``
   and delivered by ``flask outbox worker --once`` (in-process through
   ``app.test_cli_runner()``), a ``mail.sweep(dry_run=True)``, and the
   dashboard's pages through the test client (routing, the query, rendering);
2. retained rows added with set-based ``INSERT ... SELECT`` into ``outbox_email``
   (0.1 % failed, 0.2 % queued far in the future, the rest sent, 20 a second
   back from now), then ``ANALYZE``, in steps up to each of ``--sizes`` and then
   ``--rows``; at each step the overview (``/outbox/``) and ``flask outbox status
   --json`` (in-process, on a second app: the command stops its extension when
   it ends) are timed, median and p95 of ``--repeat`` runs: flat means the same
   at 10,000 rows as at 1,000,000;
3. at ``--rows``, every figure again. Ratio = with the history / empty: finding
   due work reads partial indexes, the list pages paginate on keys, and the
   overview reads running totals (``outbox_tally``), so none of them should grow
   with the table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from ._harness import Context, Report, Table, execute, median, percentile, ratio
from .bench_app import Bench, build

NAME = "history"
HELP = "worker --once, sweep and dashboard pages with 0 vs 1M retained rows"
SMOKE = ["--rows", "2000", "--sizes", "500", "--due", "10", "--repeat", "2",
         "--backends", "sqlite,pg"]

_MIME = (b"From: Shop <shop@example.com>\r\nTo: customer@example.com\r\n"
         b"Subject: Order confirmation\r\nMIME-Version: 1.0\r\n"
         b"Content-Type: text/plain; charset=\"utf-8\"\r\n\r\n"
         + b"Thank you for your order. " * 8 + b"\r\n")
#: The retained rows, set-based from a series g = :first..:last; {series}, {at},
#: {future}, {false} are the dialect's series source and expressions.
_FILL = """
INSERT INTO outbox_email (status, created_at, due_at, sent_at, failed_at, message_id,
    attempts, key_head, last_error, sender, recipients, subject, size, mime,
    search_recipient, search_subject)
SELECT CASE WHEN g % 1000 = 0 THEN 'failed' WHEN g % 500 = 1 THEN 'queued' ELSE 'sent' END,
       {at}, CASE WHEN g % 500 = 1 THEN {future} ELSE {at} END,
       CASE WHEN g % 1000 <> 0 AND g % 500 <> 1 THEN {at} END,
       CASE WHEN g % 1000 = 0 THEN {at} END,
       '<h' || g || '@bench>', 1, {false}, NULL, 'shop@example.com',
       '["user' || g || '@example.com"]', 'Order ' || g || ' confirmation', :size, :mime,
       'user' || g || '@example.com', 'order ' || g || ' confirmation'
FROM {series}
"""
_DIALECTS = {
    "pg": {"series": "generate_series(CAST(:first AS integer), CAST(:last AS integer)) AS g",
           "at": "timezone('UTC', now()) - g * interval '50 milliseconds'",
           "future": "timezone('UTC', now()) + interval '30 days'", "false": "false"},
    "sqlite": {"series": "(WITH RECURSIVE s(g) AS (SELECT :first UNION ALL SELECT g + 1 FROM s "
                         "WHERE g < :last) SELECT g FROM s)",
               "at": "datetime('now', '-' || (g / 20) || ' seconds')",
               "future": "datetime('now', '+30 days')", "false": "0"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="retained rows")
    parser.add_argument("--sizes", default="10000,100000",
                        help="smaller sizes at which the overview and status are timed too")
    parser.add_argument("--due", type=int, default=50, help="emails due per measurement")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per figure")
    parser.add_argument("--backends", default="pg", help="pg and/or sqlite")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink()
    sizes = sorted({int(size) for size in args.sizes.split(",") if size.strip()
                    if 0 < int(size) < args.rows} | {args.rows})
    table = Table(f"With 0 vs {args.rows:,} retained rows (median of {args.repeat} runs, ms)",
                  ["database", "figure", "empty ms", "history ms", "history/empty"])
    flat = Table(f"Overview and `flask outbox status` by retained rows ({args.repeat} runs, ms)",
                 ["database", "rows", "overview median", "overview p95", "status median",
                  "status p95"])
    report = Report(NAME, tables=[table, flat])
    for backend, url in ctx.databases(args.backends, NAME):
        config = {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False,
                  "OUTBOX_RUN_SCHEDULER": False, "SECRET_KEY": "bench"}
        bench = build(url, sink.smtp_port, **config)
        bench.app.register_blueprint(bench.mail.dashboard_blueprint(authorize=lambda: True),
                                     url_prefix="/outbox")
        operator = build(url, sink.smtp_port, create=False, **config)
        try:
            empty = _figures(bench, args)
            filled, added = 0.0, 0
            for size in sizes:
                started = time.perf_counter()
                sql = _FILL.format(**_DIALECTS[backend])
                execute(url, sql, "ANALYZE", params={"first": added + 1, "last": size,
                                                     "mime": _MIME, "size": len(_MIME)})
                filled += time.perf_counter() - started
                added = size
                overview, status = _overview_and_status(bench, operator, args.repeat)
                flat.add(backend, f"{size:,}", median(overview), percentile(overview, 95),
                         median(status), percentile(status, 95))
                report.figures[f"{backend} overview p95 ms at {size}"] = percentile(overview, 95)
                report.figures[f"{backend} status p95 ms at {size}"] = percentile(status, 95)
            history = _figures(bench, args)
        finally:
            bench.stop()
            operator.stop()
        for figure, before in empty.items():
            r = ratio(history[figure], before)
            table.add(backend, figure, before, history[figure], r)
            report.figures[f"{backend} {figure} history/empty"] = r
        report.notes.append(f"{backend}: {args.rows:,} rows added in {filled:.1f} s")
    return report


def _overview_and_status(bench: Bench, operator: Bench, repeat: int
                         ) -> tuple[list[float], list[float]]:
    """Milliseconds of each of ``repeat`` overviews and ``flask outbox status --json`` runs."""
    client = bench.app.test_client()
    runner = operator.app.test_cli_runner()

    def overview() -> None:
        response = client.get("/outbox/")
        if response.status_code != 200:
            raise RuntimeError(f"/outbox/ answered {response.status_code}")

    def status() -> None:
        result = runner.invoke(args=["outbox", "status", "--json"])
        if result.exit_code != 0:
            raise RuntimeError(f"outbox status: {result.output}{result.exception!r}")

    timed: dict[str, list[float]] = {}
    for name, fn in (("overview", overview), ("status", status)):
        fn()  # warm the pool and the caches
        times = timed[name] = []
        for _ in range(repeat):
            started = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - started))
    return timed["overview"], timed["status"]


def _figures(bench: Bench, args: argparse.Namespace) -> dict[str, float | None]:
    """Median ms of each figure on the table as it is now."""
    client = bench.app.test_client()
    runner = bench.app.test_cli_runner()
    with bench.app.app_context():
        middle = execute(str(bench.db.engine.url.render_as_string(hide_password=False)),
                         "SELECT (min(id) + max(id)) / 2 FROM outbox_email")[0][0][0] or 1

    def drain() -> None:
        bench.enqueue(args.due, "due")
        result = runner.invoke(args=["outbox", "worker", "--once"])
        if result.exit_code != 0 or f"{args.due} email(s)" not in result.output:
            raise RuntimeError(f"worker --once: {result.output}{result.exception!r}")

    def sweep() -> None:
        with bench.app.app_context():
            bench.mail.sweep(dry_run=True)

    def page(path: str) -> Callable[[], None]:
        def get() -> None:
            response = client.get(path)
            if response.status_code != 200:
                raise RuntimeError(f"{path} answered {response.status_code}")
        return get

    figures: dict[str, Callable[[], None]] = {
        f"worker --once, {args.due} due": drain,
        "sweep --dry-run": sweep,
        "list, first page": page("/outbox/emails"),
        "list, deep page": page(f"/outbox/emails?before={middle}"),
        "list, status=failed": page("/outbox/emails?status=failed"),
        "search recipient prefix": page("/outbox/emails?q=user4242"),
        "one email": page(f"/outbox/emails/{middle}"),
        "dead letters": page("/outbox/dead-letters"),
        "overview": page("/outbox/"),
    }
    out: dict[str, float | None] = {}
    for name, fn in figures.items():
        fn()  # warm the pool and the caches
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - started))
        out[name] = median(times)
    return out
