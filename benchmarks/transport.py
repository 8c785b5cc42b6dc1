"""``transport``: the outbox's SMTP transport against aiosmtplib, the same messages, one sink.

In this process, N messages are built first with ``Message(...).as_bytes()``,
then, round after round in rotating order:

* ``outbox-transport``: ``SMTPTransport.send_many`` of the N envelopes over 4
  connections (the library's default), opened by a warm-up batch first, as a
  running worker's are;
* ``aiosmtplib-K`` (K = 4, 8): ``aiosmtplib.SMTP.sendmail`` over K connections
  opened before the clock, each sending its share back to back.

Each is timed in the client, from the first message to the last reply. With a
sink that answers after ``--delay-ms`` the bound is connections / delay; at 0
it is the CPU one message costs on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from ._harness import Context, Report, Table, median, smtp_transport
from .bench_app import BODY, RECIPIENT, SENDER

NAME = "transport"
HELP = "the outbox's SMTP transport vs aiosmtplib sendmail(), prebuilt messages, one sink"
SMOKE = ["--n", "100", "--rounds", "1"]
VARIANTS = ("outbox-transport", "aiosmtplib-4", "aiosmtplib-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=2000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="the sink's wait before each 250 (default 0)")


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sink = ctx.sink(args.delay_ms / 1000)
    samples = _measure(args.n, args.rounds, sink.smtp_port)
    ours = median(samples["outbox-transport"])
    table = Table(f"Sending {args.n} prebuilt messages, sink answering after "
                  f"{args.delay_ms:g} ms, median of {args.rounds} rounds",
                  ["variant", "msg/s", "time / outbox-transport"])
    report = Report(NAME, tables=[table])
    for variant in VARIANTS:
        seconds = median(samples[variant])
        rate = args.n / seconds if seconds else None
        table.add(variant, rate, seconds / ours if seconds and ours else None)
        report.figures[f"{variant} msg/s"] = rate
    return report


def _measure(n: int, rounds: int, port: int) -> dict[str, list[float]]:
    from flask_mail_outbox import Message
    from flask_mail_outbox.transports import Delivered, Envelope

    messages = [Message(f"transport #{i}", sender=SENDER, recipients=[RECIPIENT],
                        body=BODY).as_bytes() for i in range(n)]
    envelopes = [Envelope(email_id=i, sender="bench@example.com", recipients=(RECIPIENT,),
                          mime=mime, message_id=f"<{i}@bench>")
                 for i, mime in enumerate(messages)]
    transport = smtp_transport("127.0.0.1", port, concurrency=4)
    transport.send_many(envelopes[:8])

    def outbox() -> float:
        started = time.perf_counter()
        results = transport.send_many(envelopes)
        elapsed = time.perf_counter() - started
        if len(results) != n or not all(isinstance(r, Delivered) for r in results):
            raise RuntimeError("the transport did not deliver every message")
        return elapsed

    runs: dict[str, Callable[[], float]] = {
        "outbox-transport": outbox,
        "aiosmtplib-4": lambda: asyncio.run(_aiosmtplib(port, messages, 4)),
        "aiosmtplib-8": lambda: asyncio.run(_aiosmtplib(port, messages, 8))}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(rounds):
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                samples[variant].append(runs[variant]())
    finally:
        transport.close()
    return samples


async def _aiosmtplib(port: int, messages: list[bytes], connections: int) -> float:
    """Seconds to send ``messages`` over ``connections`` greeted connections."""
    import aiosmtplib

    clients = [aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False,
                               local_hostname="bench", timeout=30) for _ in range(connections)]
    for client in clients:
        await client.connect()
        await client.ehlo()
    started = time.perf_counter()

    async def share(client: aiosmtplib.SMTP, part: list[bytes]) -> None:
        for mime in part:
            await client.sendmail("bench@example.com", [RECIPIENT], mime)

    await asyncio.gather(*(share(c, messages[i::connections]) for i, c in enumerate(clients)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.quit()
    return elapsed

