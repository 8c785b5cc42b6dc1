"""Dashboard pages on a big table: ``python -m benchmarks.dashboard_bench --pg-url URL``.

Not a test and not timed in CI: run by hand to show that the list and detail pages
cost the same on a million rows (keyset pagination and prefix range scans on
indexes, no OFFSET, no count of the list). It

1. creates a database of its own on the PostgreSQL server at ``--pg-url`` (dropped
   afterwards unless ``--keep``), and the outbox tables in it;
2. fills ``--rows`` emails set-based (one ``INSERT ... SELECT generate_series``):
   0.1 % failed, 0.2 % queued, the rest sent over the last ~14 hours, each with a
   small MIME message, then ``VACUUM ANALYZE``;
3. requests each page ``--repeat`` times through Flask's test client (the whole
   request: routing, authorization, the query, rendering) and prints the median,
   p95 and max in milliseconds;
4. prints ``EXPLAIN (ANALYZE, BUFFERS)`` of the queries behind the list pages, to
   show which index each one reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import OutboxMail
from flask_mail_outbox._models import metadata as outbox_metadata
from flask_mail_outbox._queries import list_emails
from flask_mail_outbox._store import Store

_MIME = (
    b"From: Shop <shop@example.com>\r\nTo: customer@example.com\r\n"
    b"Subject: Order confirmation\r\nMessage-ID: <bench@example.com>\r\n"
    b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=\"utf-8\"\r\n\r\n"
    + b"Thank you for your order. " * 8 + b"\r\n"
)
# The rows, set-based: status by residue, times spread over the last ~14 hours.
_FILL = """
INSERT INTO outbox_email (status, created_at, due_at, sent_at, failed_at, message_id,
    attempts, last_error, sender, recipients, subject, size, mime,
    search_recipient, search_subject)
SELECT s.status,
       t.at, t.at,
       CASE WHEN s.status = 'sent' THEN t.at + interval '1 second' END,
       CASE WHEN s.status = 'failed' THEN t.at + interval '1 second' END,
       format('<%s.bench@example.com>', g), CASE WHEN s.status = 'queued' THEN 0 ELSE 1 END,
       CASE WHEN s.status = 'failed' THEN '550 5.1.1 mailbox unknown' END,
       'shop@example.com',
       format('["user%s@example%s.com"]', g, g % 97),
       format('Order %s confirmation', g),
       :size, :mime,
       format('user%s@example%s.com', g, g % 97),
       lower(format('Order %s confirmation', g))
FROM generate_series(1, :rows) AS g,
     LATERAL (SELECT CASE WHEN g % 1000 = 0 THEN 'failed'
                          WHEN g % 500 = 1 THEN 'queued' ELSE 'sent' END AS status) AS s,
     LATERAL (SELECT timezone('UTC', now()) - (:rows - g) * interval '50 milliseconds'
                     AS at) AS t
"""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", required=True,
                        help="a PostgreSQL server (a database is created on it)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    args = parser.parse_args()

    admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
    name = f"outbox_dashbench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(args.pg_url).set(database=name).render_as_string(hide_password=False)
    try:
        fill(url, args.rows)
        print(f"load average before measuring: {os.getloadavg()[0]:.1f} "
              f"({os.cpu_count()} cores)")
        measure(url, args.repeat)
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def fill(url: str, rows: int) -> None:
    engine = sa.create_engine(url)
    started = time.perf_counter()
    with engine.begin() as conn:
        outbox_metadata.create_all(conn)
        conn.execute(sa.text(_FILL), {"rows": rows, "mime": _MIME, "size": len(_MIME)})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE outbox_email")
        size = conn.exec_driver_sql(
            "SELECT pg_size_pretty(pg_total_relation_size('outbox_email'))").scalar()
    engine.dispose()
    print(f"filled {rows:,} rows in {time.perf_counter() - started:.1f} s "
          f"(outbox_email with indexes: {size})")


def measure(url: str, repeat: int) -> None:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, SECRET_KEY="bench",
                      OUTBOX_TRANSPORT="null", OUTBOX_RUN_SCHEDULER=False)
    db = SQLAlchemy(app)
    mail = OutboxMail(app, db)
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                           url_prefix="/outbox")
    client = app.test_client()
    with app.app_context():
        store = mail._state().runtime().store
        ids = store_ids(store)
    middle = ids["middle"]
    pages = {
        "list, first page": "/outbox/emails",
        "list, page deep in the table (keyset)": f"/outbox/emails?before={middle}",
        "list, status=failed (0.1 %)": "/outbox/emails?status=failed",
        "list, status=queued, deep page": f"/outbox/emails?status=queued&before={middle}",
        "search recipient prefix, selective (user4242)": "/outbox/emails?q=user4242",
        "search recipient prefix, broad (user)": "/outbox/emails?q=user",
        "search subject prefix (order 99)": "/outbox/emails?field=subject&q=Order+99",
        "search + status=failed (user1)": "/outbox/emails?status=failed&q=user1",
        "dead letters": "/outbox/dead-letters",
        "detail of one email": f"/outbox/emails/{middle}",
        "overview (counts and 24 h chart: scans)": "/outbox/",
    }
    print(f"\n{'page':<52} {'median':>8} {'p95':>8} {'max':>8}   (ms, {repeat} requests)")
    for label, path in pages.items():
        for _ in range(3):  # warm the pool and the caches
            check(client.get(path), path)
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - started) * 1000)
            check(response, path)
        times.sort()
        p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
        print(f"{label:<52} {statistics.median(times):8.1f} {p95:8.1f} {times[-1]:8.1f}")
    with app.app_context():
        explain_all(mail._state().runtime().store, middle)
        mail.stop()
        db.engine.dispose()


def store_ids(store: Store) -> dict[str, int]:
    with store.read() as conn:
        low, high = conn.exec_driver_sql("SELECT min(id), max(id) FROM outbox_email").one()
    return {"middle": (int(low) + int(high)) // 2}


def check(response: Any, path: str) -> None:
    if response.status_code != 200:
        raise SystemExit(f"{path} answered {response.status_code}")


def explain_all(store: Store, middle: int) -> None:
    """The plans of the list queries, with the index each reads."""
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if statement.startswith("SELECT outbox_email.id"):
            captured.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    cases: dict[str, dict[str, Any]] = {
        "first page": {},
        "deep keyset page": {"cursor": {"before": str(middle)}},
        "status=failed": {"status": "failed"},
        "status=queued, deep page": {"status": "queued", "cursor": {"before": str(middle)}},
        "search recipient 'user4242'": {"prefix": "user4242"},
        "search subject 'order 99'": {"field": "subject", "prefix": "order 99"},
        "search 'user1' + status=failed": {"status": "failed", "prefix": "user1"},
    }
    for label, kwargs in cases.items():
        captured.clear()
        with store.read() as conn:
            list_emails(conn, limit=50, **kwargs)
        (statement, parameters), = captured
        with store.engine.connect() as conn:
            plan = list(conn.exec_driver_sql(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement, parameters).scalars())
        print(f"\n-- {label}")
        print("\n".join(plan))
    sa.event.remove(store.engine, "before_cursor_execute", capture)


if __name__ == "__main__":
    main()
