"""``providers``: each provider API transport, end to end, against an API answering late.

For each kind, an app in this process queues N emails (durable mode, no worker
of its own), then ``flask outbox worker --once`` drains them through that kind
to ``benchmarks.api_sink``, which answers every request after ``--latency-ms``.
With C requests in flight and a latency L, the bound is C / L messages a second
for a single-message endpoint; a batch endpoint carries many messages per
request. Rows: every kind on its single endpoint (an attachment keeps a message
off Resend's batch endpoint, a 90 KB one off Postmark's), and the batch
endpoints (Postmark, Resend) on the same sink.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._harness import Context, Report, Table, free_port, median, wait_port
from .bench_app import BODY, RECIPIENT, SENDER

NAME = "providers"
HELP = "each provider API transport through a worker, against an API answering after 100 ms"
SMOKE = ["--n", "40", "--rounds", "1", "--latency-ms", "20", "--batch-n", "200"]

# (row, kind, entry settings, attachment bytes (0: none), batch endpoint). An
# attachment keeps a message off Resend's batch endpoint, and one over 80 KB off
# Postmark's, so those rows measure the single-message endpoints.
ROWS: tuple[tuple[str, str, dict[str, Any], int, bool], ...] = (
    ("postmark", "postmark", {"token": "bench"}, 90_000, False),
    ("sendgrid", "sendgrid", {"api_key": "bench"}, 0, False),
    ("mailgun", "mailgun", {"api_key": "bench", "domain": "bench.example.com"}, 0, False),
    ("resend", "resend", {"api_key": "re_bench"}, 20, False),
    ("ses", "ses", {"region": "eu-west-1", "access_key_id": "AKIDBENCH",
                    "secret_access_key": "bench"}, 0, False),
    ("postmark batch", "postmark", {"token": "bench"}, 0, True),
    ("resend batch", "resend", {"api_key": "re_bench"}, 0, True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=1000, help="emails per single-endpoint row")
    parser.add_argument("--batch-n", type=int, default=4000, help="emails per batch row")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (C)")
    parser.add_argument("--latency-ms", type=float, default=100.0,
                        help="the API's wait before each answer (L)")
    parser.add_argument("--rounds", type=int, default=3)


def run(ctx: Context, args: argparse.Namespace) -> Report:
    port = free_port()
    sink = ctx.spawn([sys.executable, "-m", "benchmarks.api_sink", "--port", str(port),
                      "--delay", str(args.latency_ms / 1000)], env={}, name="api-sink")
    wait_port(port, 15, [sink])
    base_url = f"http://127.0.0.1:{port}"
    bound = args.concurrency / (args.latency_ms / 1000)
    table = Table(f"Draining emails through each API, {args.concurrency} requests in flight, "
                  f"the API answering after {args.latency_ms:g} ms (bound C/L = {bound:g} "
                  f"msg/s for one message per request); median of {args.rounds} rounds",
                  ["row", "emails", "msg/s", "/ (C/L)", "/ single"])
    report = Report(NAME, tables=[table])
    single: dict[str, float] = {}
    for row, kind, entry, attach, batch in ROWS:
        n = args.batch_n if batch else args.n
        rates = [_drain(ctx, kind, {**entry, "base_url": base_url}, n=n, attach=attach,
                        concurrency=args.concurrency) for _ in range(args.rounds)]
        rate = median(rates)
        if not batch:
            single[kind] = rate or 0.0
        versus = (rate / single[kind]) if batch and rate and single.get(kind) else None
        table.add(row, n, rate, rate / bound if rate else None, versus)
        report.figures[f"{row} msg/s"] = rate
        report.figures[f"{row} / bound"] = rate / bound if rate else None
    return report


def _drain(ctx: Context, kind: str, entry: dict[str, Any], *, n: int, attach: int,
           concurrency: int) -> float:
    """Queue ``n`` emails for ``kind``, drain them with ``worker --once``; messages a second."""
    entry_base_url = entry["base_url"]
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_mail_outbox import Message, OutboxMail

    ((_, url),) = ctx.databases("sqlite", f"providers-{kind}")
    app = Flask(__name__)
    if kind == "ses":  # SES names its endpoint endpoint_url
        entry = {key: value for key, value in entry.items() if key != "base_url"}
        entry["endpoint_url"] = entry_base_url
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url, MAIL_DEFAULT_SENDER=SENDER, OUTBOX_DURABLE=True,
        OUTBOX_RUN_WORKER=False, OUTBOX_RUN_SCHEDULER=False, OUTBOX_LISTEN=False,
        OUTBOX_BATCH_SIZE=max(100, 2 * concurrency * 100),
        OUTBOX_TRANSPORTS={"default": {"transport": kind, "concurrency": concurrency,
                                       **entry}})
    db = SQLAlchemy(app)
    mail = OutboxMail(app)
    with app.app_context():
        mail.create_all()
        messages = []
        for i in range(n):
            message = Message(f"providers #{i}", sender=SENDER, recipients=[RECIPIENT],
                              body=BODY)
            if attach:
                message.attach("report.bin", "application/octet-stream",
                               bytes(i % 251 for i in range(attach)))
            messages.append(message)
        mail.send_many(messages)
        db.session.commit()
        started = time.perf_counter()
        result = app.test_cli_runner().invoke(args=["outbox", "worker", "--once"])
        elapsed = time.perf_counter() - started
        counts = mail.stats()["counts"]
    mail.stop()
    if result.exit_code != 0 or counts.get("sent") != n:
        raise RuntimeError(f"{kind}: worker --once exited {result.exit_code}, counts {counts}: "
                           f"{result.output[-2000:]}")
    return n / elapsed
