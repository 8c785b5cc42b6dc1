"""``transport``: the outbox's SMTP transport against aiosmtplib, the same messages, one sink.

In one child process (``python -m benchmarks.transport --child SPEC``), the N
messages are built before any clock starts (as the throughput ceiling builds
them), then, round after round and in rotating order:

* ``outbox-transport``: ``SMTPTransport.send_many`` of the N envelopes with
  ``concurrency=4`` (the library's default), its connections opened by a
  warm-up batch before the first round and reused, as a worker's are;
* ``aiosmtplib-K`` (K = 4, 8): ``aiosmtplib.SMTP.sendmail`` over K
  connections opened before the clock, each sending its share back to back:
  the throughput scenario's ceiling.

Each is timed in the client, from the first message to the last server reply
(a message is done when its 250 after DATA came back, on both sides). The
figure is how much of an end-to-end delivery the transport itself costs: the
throughput scenario's ceiling is aiosmtplib's, the outbox's drain is bounded
by its own transport plus the claim and the record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._harness import Context, Report, Table, log, log_path, median, tail
from ._registry import scenario

VARIANTS = ("outbox-transport", "aiosmtplib-4", "aiosmtplib-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="messages per round (default 2000; --quick 500)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5; --quick 2")


@scenario("transport", "the outbox's pipelining SMTP transport vs aiosmtplib, prebuilt "
          "messages, one sink", add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    n = args.n or (500 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 5)
    sink = ctx.throughput_sink()
    out = ctx.workdir / "transport.json"
    spec = {"n": n, "rounds": rounds, "port": sink.smtp_port, "out": str(out)}
    log(f"transport: sink {sink.kind}, N={n}, {rounds} rounds x {len(VARIANTS)} variants")
    child = ctx.spawn([sys.executable, "-m", "benchmarks.transport", "--child",
                       json.dumps(spec)], env={}, name="transport")
    code = child.wait(timeout=600)
    if code != 0 or not out.exists():
        raise RuntimeError(f"transport child failed (exit {code}):\n{tail(log_path(child))}")
    samples: dict[str, list[float]] = json.loads(out.read_text())
    medians = {v: median(samples[v]) for v in VARIANTS}
    ours = medians["outbox-transport"]
    table = Table(f"Sending N={n} prebuilt messages to one sink ({sink.kind}), median of "
                  f"{rounds} rounds (ms)", ["variant", "ms", "min..max", "msg/s",
                                            "/ outbox-transport"])
    for v in VARIANTS:
        ms = [s * 1000 for s in samples[v]]
        m = medians[v]
        table.add(v, m * 1000 if m else None, f"{min(ms):.0f}..{max(ms):.0f}",
                  n / m if m else None, m / ours if m and ours else None)
    report = Report("transport", tables=[table])
    report.data = {"n": n, "rounds": rounds, "sink": sink.kind, "samples": samples,
                   "medians": medians}
    report.notes += [
        "clock: in the client, from the first message to the last 250 after DATA",
        ("outbox-transport pipelines (RFC 2920): a message's MAIL, RCPT and DATA go in one "
         "write, with the previous message's content; aiosmtplib's sendmail() waits for "
         "each reply"),
    ]
    return report


def child_main(spec: dict[str, Any]) -> None:
    from flask_mail_outbox._config import load_config
    from flask_mail_outbox.transports import Envelope, SMTPTransport

    from .throughput import _prebuilt, send_over_aiosmtplib

    n, port = spec["n"], spec["port"]
    messages = _prebuilt(n)
    config = load_config({"MAIL_SERVER": "127.0.0.1", "MAIL_PORT": port},
                         instance_path="/tmp", testing=False)
    transport = SMTPTransport(config, concurrency=4)
    envelopes = [Envelope(email_id=i, sender=sender, recipients=tuple(rcpts), mime=mime,
                          message_id=f"<{i}@bench>")
                 for i, (sender, rcpts, mime) in enumerate(messages)]
    transport.send_many(envelopes[:8])  # opens its connections, as a running worker has

    def outbox() -> float:
        started = time.perf_counter()
        results = transport.send_many(envelopes)
        elapsed = time.perf_counter() - started
        if len(results) != n:
            raise RuntimeError(f"send_many returned {len(results)} results for {n}")
        return elapsed

    runs: dict[str, Callable[[], float]] = {
        "outbox-transport": outbox,
        "aiosmtplib-4": lambda: send_over_aiosmtplib(port, messages, 4),
        "aiosmtplib-8": lambda: send_over_aiosmtplib(port, messages, 8)}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(spec["rounds"]):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for variant in order:
            samples[variant].append(runs[variant]())
    Path(spec["out"]).write_text(json.dumps(samples))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks transport`")
