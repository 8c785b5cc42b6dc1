"""A throwaway SMTP sink in its own process: accepts everything, counts, timestamps.

    python -m benchmarks.sink [--port 0] [--control-port 0] [--delay SECONDS]
                              [--quota RATE [--quota-burst N] [--quota-at data|mail]
                               [--quota-reply TEXT] [--quota-keep-open]]

It prints one JSON line when it listens, ``{"smtp_port": P, "control_port": C,
"pid": N}``, then serves until SIGTERM/SIGINT. Every message is accepted with
250 after ``--delay`` seconds (an ``asyncio.sleep``, so sessions overlap: a
latency-bound server, not a slow CPU). Its receipt is recorded just before the
250: ``(time.time(), Message-ID, X-Bench-Id)``, the wall clock of this
machine, which the benchmark process compares with its own ``time.time()``.

With ``--quota RATE`` it is a provider's rate limit: one token bucket across
all its sessions, refilled at RATE messages per second and holding at most
``--quota-burst`` tokens (default: RATE, one second's worth). Each message
takes a token when it is about to be accepted (at the end of DATA, or at
MAIL FROM with ``--quota-at mail``); without one the server answers
``421 4.7.28 Rate limit exceeded, slow down`` (Gmail's words, or
``--quota-reply``) and closes the connection, as RFC 5321 says a 421 does
(``--quota-keep-open``: it does not). Refusals are counted, with their times.

The control port speaks one line per connection and answers with one JSON line:

* ``stats``: ``{"count", "unique", "first", "last", "refused"}`` (unique
  Message-IDs; ``first``/``last`` are the first and last receipt times, or
  null; ``refused``: quota refusals);
* ``refusals [START]``: ``[t, ...]``, the times of the quota refusals from index START;
* ``receipts [START]``: ``[[t, message_id, bench_id], ...]`` from index START;
* ``reset``: forget everything received so far.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

#: What the quota mode answers above its rate (Gmail's reply to a too-fast client).
QUOTA_REPLY = "421 4.7.28 Rate limit exceeded, slow down"


def _headers(data: bytes) -> tuple[str | None, str | None]:
    """Message-ID and X-Bench-Id from the header block (no full MIME parse)."""
    end = data.find(b"\r\n\r\n")
    head = data if end < 0 else data[:end]
    message_id = bench_id = None
    for line in head.split(b"\r\n"):
        lower = line[:14].lower()
        if lower.startswith(b"message-id:"):
            message_id = line[11:].strip().decode("ascii", "replace")
        elif lower.startswith(b"x-bench-id:"):
            bench_id = line[11:].strip().decode("ascii", "replace")
    return message_id, bench_id


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` held; starts full."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = time.monotonic()

    def take(self) -> bool:
        """One token if there is one (True), else False (nothing taken)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class SinkHandler:
    """aiosmtpd handler: every recipient is accepted, and every message within the quota."""

    def __init__(self, delay: float, quota: TokenBucket | None = None,
                 quota_at: str = "data", quota_reply: str = QUOTA_REPLY,
                 quota_close: bool = True) -> None:
        self.delay = delay
        self.quota = quota
        self.quota_at = quota_at
        self.quota_reply = quota_reply
        self.quota_close = quota_close
        self.receipts: list[tuple[float, str | None, str | None]] = []
        self.message_ids: set[str | None] = set()
        self.refusals: list[float] = []

    def _refuse(self, server: SMTP) -> str | None:
        """The 421 when the quota is spent (the connection then closes, unless kept open),
        else None."""
        if self.quota is None or self.quota.take():
            return None
        self.refusals.append(time.time())
        transport = server.transport
        if transport is not None and self.quota_close:
            # After the reply is written (aiosmtpd writes it before it yields again).
            asyncio.get_running_loop().call_soon(transport.close)
        return self.quota_reply

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, mail_options: list[str]) -> str:
        if self.quota_at == "mail":
            refused = self._refuse(server)
            if refused is not None:
                return refused
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.quota_at == "data":
            refused = self._refuse(server)
            if refused is not None:
                return refused
        content = envelope.original_content or envelope.content or b""
        if isinstance(content, str):
            content = content.encode("utf-8", "replace")
        message_id, bench_id = _headers(content)
        self.receipts.append((time.time(), message_id, bench_id))
        self.message_ids.add(message_id)
        return "250 2.0.0 OK"

    def reset(self) -> None:
        self.receipts = []
        self.message_ids = set()
        self.refusals = []

    def stats(self) -> dict[str, Any]:
        receipts = self.receipts
        return {"count": len(receipts), "unique": len(self.message_ids),
                "first": receipts[0][0] if receipts else None,
                "last": receipts[-1][0] if receipts else None,
                "refused": len(self.refusals)}


async def _serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    quota = None
    if args.quota:
        quota = TokenBucket(args.quota, args.quota_burst or args.quota)
    handler = SinkHandler(args.delay, quota, args.quota_at, args.quota_reply,
                          not args.quota_keep_open)

    def make_smtp() -> SMTP:
        # An explicit hostname: without one aiosmtpd calls socket.getfqdn() per connection.
        return SMTP(handler, hostname="bench-sink", ident="bench-sink", decode_data=False,
                    data_size_limit=64 * 1024 * 1024, enable_SMTPUTF8=True, timeout=900)

    smtp_server = await loop.create_server(make_smtp, args.host, args.port, backlog=1024)

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            words = (await reader.readline()).decode().split()
            command = words[0] if words else ""
            if command == "stats":
                answer: Any = handler.stats()
            elif command == "receipts":
                start = int(words[1]) if len(words) > 1 else 0
                answer = handler.receipts[start:]
            elif command == "refusals":
                start = int(words[1]) if len(words) > 1 else 0
                answer = handler.refusals[start:]
            elif command == "reset":
                handler.reset()
                answer = {"ok": True}
            else:
                answer = {"error": f"unknown command {command!r}"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    control_server = await asyncio.start_server(control, args.host, args.control_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"smtp_port": smtp_server.sockets[0].getsockname()[1],
                      "control_port": control_server.sockets[0].getsockname()[1],
                      "pid": os.getpid()}), flush=True)
    await stop.wait()
    smtp_server.close()
    control_server.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sink", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="SMTP port (0: any free one)")
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0,
                        help="seconds to wait before the 250 reply to each DATA")
    parser.add_argument("--quota", type=float, default=None, metavar="RATE",
                        help="accept at most RATE messages per second over all sessions "
                             "(a token bucket); refuse the rest with a 421")
    parser.add_argument("--quota-burst", type=float, default=None, metavar="N",
                        help="tokens the bucket holds (default: RATE)")
    parser.add_argument("--quota-at", choices=("data", "mail"), default="data",
                        help="where a message over the quota is refused (default: at the "
                             "end of DATA)")
    parser.add_argument("--quota-reply", default=QUOTA_REPLY, metavar="TEXT",
                        help=f"the reply above the quota (default: {QUOTA_REPLY!r})")
    parser.add_argument("--quota-keep-open", action="store_true",
                        help="keep the connection open after the reply above the quota "
                             "(RFC 5321 says a 421 closes it; some servers do not)")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
