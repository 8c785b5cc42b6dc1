"""``enqueue``: what ``mail.send()`` + commit costs against a bare SQLAlchemy insert.

In this process, per database, the same app and ``db.session`` run,
alternately, round after round, N emails at 1 and at 100 per transaction:

* **bare**: ``db.session.execute(insert(plain_email), {...})`` of the fields the
  caller gives into a table with no index but its primary key, then ``commit()``;
* **send**: ``mail.send(Message(...))``, then ``commit()``: validation, the MIME
  built once, the row and its indexes, the after-commit hand-over (and on
  PostgreSQL the ``NOTIFY``);
* **send_many**: ``mail.send_many([...])`` of the transaction's messages, then
  ``commit()`` (one multi-row INSERT);
* **row**: the bound of what ``send()`` stores: a bare SQLAlchemy insert into
  ``outbox_email`` itself (every index, the same column values as a row
  ``send()`` wrote, with its own subject, Message-ID and times), then
  ``commit()``. ``send/row`` is what ``send()`` adds to the write it must
  make: validation, building the MIME, its bookkeeping.

Durable mode with ``OUTBOX_RUN_WORKER=False``: what a web process pays when
workers deliver (inline mode would add its delivery thread's work to the
process while the clock runs). Ratio = median time / median bare time, the
rounds paired.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from ._harness import Context, Report, Table, median
from .bench_app import BODY, RECIPIENT, Bench, build, message

NAME = "enqueue"
HELP = "mail.send() + commit vs send_many vs a bare SQLAlchemy insert (1 and 100 per txn)"
SMOKE = ["--n", "100", "--rounds", "1"]

PLAIN = sa.Table("plain_email", sa.MetaData(),
                 sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                           primary_key=True, autoincrement=True),
                 sa.Column("created_at", sa.DateTime(), nullable=False),
                 sa.Column("recipients", sa.Text(), nullable=False),
                 sa.Column("subject", sa.Text(), nullable=False),
                 sa.Column("body", sa.Text()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1000, help="emails per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,pg", help="sqlite and/or pg")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    table = Table(f"Enqueue cost per email (µs), {args.n} emails per measurement, median of "
                  f"{args.rounds} rounds", ["database", "per txn", "bare µs", "send µs",
                                            "send/bare", "send_many µs", "send_many/bare",
                                            "row µs", "send/row"])
    report = Report(NAME, tables=[table])
    for backend, url in ctx.databases(args.backends, NAME):
        for per, times in _measure(url, args.n, args.rounds).items():
            us = {k: (median(v) or 0.0) * 1e6 / args.n for k, v in times.items()}
            ratios = {k: median(t / b for t, b in zip(times[k], times["bare"], strict=True))
                      for k in ("send", "send_many")}
            send_row = median(t / b for t, b in zip(times["send"], times["row"], strict=True))
            table.add(backend, per, us["bare"], us["send"], ratios["send"], us["send_many"],
                      ratios["send_many"], us["row"], send_row)
            report.figures[f"{backend}/{per} send/bare"] = ratios["send"]
            report.figures[f"{backend}/{per} send_many/bare"] = ratios["send_many"]
            report.figures[f"{backend}/{per} send/row"] = send_row
    report.notes.append("bare: an insert of the caller's fields into a table with only a "
                        "primary key; row: an insert of send()'s own row into outbox_email; "
                        "x/bare, x/row: the median of the per-round ratios")
    return report


def _measure(url: str, n: int, rounds: int) -> dict[int, dict[str, list[float]]]:
    bench = build(url, 1, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                  OUTBOX_RUN_SCHEDULER=False)
    session = bench.db.session

    def bare(i: int, per: int) -> None:
        for j in range(i, i + per):
            session.execute(sa.insert(PLAIN), {
                "created_at": datetime.now(UTC).replace(tzinfo=None),
                "recipients": json.dumps([RECIPIENT]), "subject": f"enqueue #{j}",
                "body": BODY})

    email, template = _stored_row(bench)

    def row(i: int, per: int) -> None:
        for j in range(i, i + per):
            now = datetime.now(UTC).replace(tzinfo=None)
            session.execute(sa.insert(email), dict(
                template, subject=f"enqueue #{j}", search_subject=f"enqueue #{j}",
                message_id=f"<{j}.row@example.com>", created_at=now, due_at=now))

    def send(i: int, per: int) -> None:
        for j in range(i, i + per):
            bench.mail.send(message(f"enqueue #{j}"))

    def send_many(i: int, per: int) -> None:
        bench.mail.send_many([message(f"enqueue #{j}") for j in range(i, i + per)])

    variants: dict[str, Callable[[int, int], None]] = {
        "bare": bare, "send": send, "send_many": send_many, "row": row}

    def timed(fn: Callable[[int, int], None], count: int, per: int) -> float:
        started = time.perf_counter()
        for i in range(0, count, per):
            fn(i, per)
            session.commit()
        return time.perf_counter() - started

    result: dict[int, dict[str, list[float]]] = {}
    try:
        with bench.app.app_context():
            PLAIN.create(bench.db.engine, checkfirst=True)
            for fn in variants.values():  # warm-up: connections, compiled statements
                timed(fn, 20, 10)
            for per in (1, 100):
                times: dict[str, list[float]] = {k: [] for k in variants}
                for r in range(rounds):
                    names = list(variants)
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        times[name].append(timed(variants[name], n, per))
                result[per] = times
            session.remove()
    finally:
        bench.stop()
    return result


def _stored_row(bench: Bench) -> tuple[sa.Table, dict[str, Any]]:
    """``outbox_email`` as the database has it, and the columns of a row ``send()`` wrote."""
    with bench.app.app_context():
        email_id = bench.mail.send(message("enqueue template"))
        bench.db.session.commit()
        email = sa.Table("outbox_email", sa.MetaData(), autoload_with=bench.db.engine)
        stored = bench.db.session.execute(sa.select(email).where(email.c.id == email_id)).one()
        bench.db.session.remove()
    return email, {k: v for k, v in stored._mapping.items() if k != "id"}
