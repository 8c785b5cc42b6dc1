"""``enqueue``: what ``mail.send()`` + commit costs against a bare SQLAlchemy insert.

In a child process per database (``python -m benchmarks.enqueue --child
SPEC``), the same app and ``db.session`` run, alternately, round after round:

* **bare**: ``db.session.execute(insert(plain_email), {...})`` of the fields
  the caller gives (sender, recipients, subject, body, a timestamp) into a
  plain table with no index but its primary key, then ``commit()``;
* **outbox**: ``mail.send(Message(...))`` with the same fields, then
  ``commit()``: validation, the MIME built once, the row and its indexes, the
  staging hooks, and on PostgreSQL the ``NOTIFY`` in the commit.

Each is timed with 1 email per transaction and with 100 per transaction. The
outbox runs in durable mode with ``OUTBOX_RUN_WORKER=False``: what a web
process pays when workers deliver (inline mode would add its delivery thread's
work to the same process while the clock runs). Ratio = median outbox time per
email / median bare time per email, rounds paired.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC
from pathlib import Path
from typing import Any

from ._harness import Context, Report, Table, bench_env, log, log_path, median, tail
from ._registry import scenario
from .bench_app import RECIPIENT

BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="emails per measurement (default 1000; --quick 300)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5; --quick 2")
    parser.add_argument("--backends", default="sqlite,pg", help="sqlite and/or pg")


@scenario("enqueue", "mail.send() + commit vs a bare SQLAlchemy insert (1 and 100 per "
          "transaction)", add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    n = args.n or (300 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 5)
    table = Table(f"Enqueue cost per email (µs), {n} emails per measurement, median of "
                  f"{rounds} rounds", ["database", "per txn", "bare µs", "outbox µs",
                                       "outbox/bare", "outbox msg/s", "spread outbox"])
    report = Report("enqueue", tables=[table])
    sink = ctx.aiosmtpd_sink()  # MAIL_PORT must point somewhere; nothing is delivered
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "pg":
            _, url = ctx.postgres().create_database("bench_enqueue")
        else:
            url = f"sqlite:///{ctx.workdir / 'enqueue.db'}"
        create_tables(url)
        out = ctx.workdir / f"enqueue-{backend}.json"
        spec = {"n": n, "rounds": rounds, "out": str(out)}
        log(f"enqueue {backend}: {rounds} rounds x 2 sizes x bare/outbox of {n}")
        child = ctx.spawn([sys.executable, "-m", "benchmarks.enqueue", "--child",
                           json.dumps(spec)],
                          env=bench_env(url, sink.smtp_port,
                                        {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False,
                                         "OUTBOX_RUN_SCHEDULER": False}),
                          name=f"enqueue-{backend}")
        code = child.wait(timeout=1800)
        if code != 0 or not out.exists():
            raise RuntimeError(f"enqueue child failed (exit {code}):\n{tail(log_path(child))}")
        result = json.loads(out.read_text())
        report.data[backend] = result
        for per in ("1", "100"):
            bare = [t / n * 1e6 for t in result[per]["bare"]]
            outbox = [t / n * 1e6 for t in result[per]["outbox"]]
            ratios = [o / b for o, b in zip(outbox, bare)]
            result[per]["ratio_median"] = median(ratios)
            mo = median(outbox)
            table.add(backend, int(per), median(bare), mo, median(ratios),
                      1e6 / mo if mo else None,
                      f"{min(outbox):.0f}..{max(outbox):.0f}")
    report.notes += [
        ("bare: db.session.execute(insert(plain_email), fields) + commit, a table with only "
        "a primary key; outbox: mail.send(Message(...)) + commit (durable, no in-process "
        "worker; PostgreSQL: with the NOTIFY)"),
        "outbox/bare: the median over rounds of the ratio within each round",
    ]
    return report


def child_main(spec: dict[str, Any]) -> None:
    import sqlalchemy as sa

    from flask_mail_outbox import Message

    from .bench_app import create_app

    app = create_app()
    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    plain = sa.Table("plain_email", sa.MetaData(),
                     sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                               primary_key=True, autoincrement=True),
                     sa.Column("created_at", sa.DateTime(), nullable=False),
                     sa.Column("sender", sa.String(320)),
                     sa.Column("recipients", sa.Text(), nullable=False),
                     sa.Column("subject", sa.Text(), nullable=False),
                     sa.Column("body", sa.Text()))
    from datetime import datetime

    def bare(i: int) -> None:
        db.session.execute(sa.insert(plain), {
            "created_at": datetime.now(UTC).replace(tzinfo=None),
            "sender": None, "recipients": json.dumps([RECIPIENT]),
            "subject": f"enqueue #{i}", "body": BODY})

    def outbox(i: int) -> None:
        mail.send(Message(f"enqueue #{i}", recipients=[RECIPIENT], body=BODY))

    def timed(fn: Any, n: int, per: int) -> float:
        started = time.perf_counter()
        for start in range(0, n, per):
            for i in range(start, min(n, start + per)):
                fn(i)
            db.session.commit()
        return time.perf_counter() - started

    result: dict[str, dict[str, list[float]]] = {}
    with app.app_context():
        plain.create(db.engine, checkfirst=True)
        timed(bare, 50, 10)  # warm-up: connections, compiled statements
        timed(outbox, 50, 10)
        for per in (1, 100):
            times: dict[str, list[float]] = {"bare": [], "outbox": []}
            for r in range(spec["rounds"]):
                order = [("bare", bare), ("outbox", outbox)]
                for name, fn in (order if r % 2 == 0 else order[::-1]):
                    times[name].append(timed(fn, spec["n"], per))
            result[str(per)] = times
        db.session.remove()
    Path(spec["out"]).write_text(json.dumps(result))
    mail.stop(timeout=5)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks enqueue`")
