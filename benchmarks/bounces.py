"""``bounces``: how fast the bounce reader reads, on a real DSN and on the worst shapes.

Each row feeds one message to ``mail.process_bounce`` again and again, for
``--seconds`` of this thread's CPU time (at least once), on an app whose VERP
address is set: the message names no email of ours, so nothing is written,
and what is measured is the reading (parsing, the report, the VERP check).
Rows:

- a real Postfix DSN (tests/bounces/postfix-hard-5.1.1.eml, 2.5 KB);
- the same DSN with its ``Diagnostic-Code`` folded over ``--folds`` lines
  (issue 36's 40 KB DSN, which took 17 s when the reader was quadratic);
- ``--addresses`` ``Delivered-To`` headers above the DSN, and as many
  addresses in its ``To`` (issue 36: 40,000 took 7.8 s, 140,000 93 s, when
  addresses were de-duplicated in a list);
- ``--worst-kb`` of one-field report blocks, the slowest shape per byte
  found since (the stdlib parser makes a message object of each block).

``--before REF`` measures the package as it was at git ``REF`` too, in a
child process (``git archive`` of its ``flask_mail_outbox/`` into a
temporary folder), with the same rows and budget; the table shows both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._harness import Context, Report

ROOT = Path(__file__).resolve().parent.parent
DSN_FILE = ROOT / "tests" / "bounces" / "postfix-hard-5.1.1.eml"
DIAGNOSTIC = b'Diagnostic-Code: X-Postfix; unknown user: "nobody-here"'

NAME = "bounces"
HELP = "the bounce reader's throughput: a real Postfix DSN, and the worst shapes"
SMOKE = ["--seconds", "0.2", "--folds", "500", "--addresses", "500", "--worst-kb", "16"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="CPU seconds each row reads for (at least one message)")
    parser.add_argument("--folds", type=int, default=10_000,
                        help="continuation lines of the folded Diagnostic-Code")
    parser.add_argument("--addresses", type=int, default=20_000,
                        help="Delivered-To headers, and To addresses, of the address rows")
    parser.add_argument("--worst-kb", type=int, default=1024,
                        help="size of the report-blocks message, KiB")
    parser.add_argument("--before", default=None, metavar="REF",
                        help="also measure flask_mail_outbox as of this git ref (e.g. the "
                             "merge base), in a child process")


def messages(folds: int, addresses: int, worst_kb: int) -> dict[str, bytes]:
    """The rows' messages, by label."""
    dsn = DSN_FILE.read_bytes()
    folded = dsn.replace(DIAGNOSTIC, b"Diagnostic-Code: smtp; 550" + b"\n x" * folds)
    delivered = b"".join(b"Delivered-To: a%d@example.com\n" % i for i in range(addresses)) + dsn
    to = b"To: " + b", ".join(b"a%d@example.com" % i for i in range(addresses)) + b"\n" + dsn
    block = b"Final-Recipient: rfc822; x@example.com\nAction: failed\nStatus: 5.1.1\n\n"
    blocks = dsn.replace(b"Final-Recipient: rfc822; nobody-here",
                         block * (worst_kb * 1024 // len(block))
                         + b"Final-Recipient: rfc822; nobody-here")
    return {
        f"Postfix DSN ({len(dsn) / 1000:.1f} KB)": dsn,
        f"DSN, a field folded over {folds:,} lines ({len(folded) / 1000:.0f} KB)": folded,
        f"DSN under {addresses:,} Delivered-To ({len(delivered) / 1000:.0f} KB)": delivered,
        f"DSN under a To of {addresses:,} addresses ({len(to) / 1000:.0f} KB)": to,
        f"report blocks ({len(blocks) / 1000:.0f} KB): the worst shape": blocks,
    }


def measure(seconds: float, folds: int, addresses: int, worst_kb: int
            ) -> dict[str, dict[str, float]]:
    """Per row: messages read, CPU seconds, bytes per message (this process's package)."""
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_mail_outbox import OutboxMail

    logging.getLogger("flask_mail_outbox").setLevel(logging.WARNING)
    logging.getLogger("flufl.bounce").setLevel(logging.CRITICAL)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-bounces-") as tmp:
        app = Flask("bench_bounces")
        app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp}/outbox.db",
                          SECRET_KEY="bench-bounces", MAIL_DEFAULT_SENDER="a@example.com",
                          OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
        db = SQLAlchemy(app)
        mail = OutboxMail(app, db=db)
        with app.app_context():
            mail.create_all()
            for label, raw in messages(folds, addresses, worst_kb).items():
                count, started = 0, time.thread_time()
                while True:
                    mail.process_bounce(raw)
                    count += 1
                    elapsed = time.thread_time() - started
                    if elapsed >= seconds:
                        break
                results[label] = {"count": count, "cpu": elapsed, "bytes": len(raw)}
        mail.stop(timeout=5)
    return results


def measure_before(ref: str, seconds: float, folds: int, addresses: int, worst_kb: int
                   ) -> dict[str, dict[str, float]]:
    """:func:`measure` in a child process importing ``flask_mail_outbox`` as of ``ref``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "flask_mail_outbox"],
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="bench-bounces-before-") as tmp:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(ROOT)])}
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.bounces", "--child", str(seconds), str(folds),
             str(addresses), str(worst_kb)], cwd=tmp, env=env, capture_output=True, text=True,
            check=True)
    found: dict[str, dict[str, float]] = json.loads(child.stdout)
    return found


def run(ctx: Context, args: argparse.Namespace) -> Report:
    # Imported here: the --child process measures an older package, and needs none of it.
    from ._harness import Report, Table, log

    after = measure(args.seconds, args.folds, args.addresses, args.worst_kb)
    before: dict[str, dict[str, float]] = {}
    if args.before:
        log(f"bounces: measuring {args.before} in a child process")
        before = measure_before(args.before, args.seconds, args.folds, args.addresses,
                                args.worst_kb)
    columns = ["message", "msg/s", "MB/s", "ms/msg"]
    if before:
        columns += [f"msg/s at {args.before}", f"ms/msg at {args.before}", "x faster"]
    table = Table(f"mail.process_bounce() on one core (CPU time, {args.seconds} s a row; "
                  "names no email of ours: nothing written)", columns)
    report = Report(NAME, tables=[table])
    for label, row in after.items():
        rate = row["count"] / row["cpu"]
        values: list[Any] = [label, rate, rate * row["bytes"] / 1e6, 1000 / rate]
        old = before.get(label)
        if old is not None:
            old_rate = old["count"] / old["cpu"]
            values += [old_rate, 1000 / old_rate, rate / old_rate]
            report.figures[f"{label} msg/s before"] = old_rate
        elif before:
            values += [None, None, None]
        table.add(*values)
        report.figures[f"{label} msg/s"] = rate
        report.figures[f"{label} MB/s"] = rate * row["bytes"] / 1e6
    report.notes.append("CPU time of the reading thread (time.thread_time), so other work on "
                        "a shared machine does not count; one message at least per row")
    return report


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    seconds_arg, folds_arg, addresses_arg, worst_arg = sys.argv[2:6]
    print(json.dumps(measure(float(seconds_arg), int(folds_arg), int(addresses_arg),
                             int(worst_arg))))
