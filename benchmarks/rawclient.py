"""The fastest SMTP client this suite can write in Python: the sink's limit for a client.

    python -m benchmarks.rawclient --port P --n N [--connections 4] [--depth 1]
                                   [--distinct 5000]

In its own process: ``--distinct`` messages are built first (the outbox's own
MIME, dot-stuffed, each with its MAIL FROM, RCPT TO and DATA lines joined into
the bytes that go on the wire) and sent in turn until N went (a long run
without holding N messages in memory), then ``--connections`` connections are opened and
greeted (EHLO once per connection; the server must offer PIPELINING), and only
then does the clock start. Each connection sends its share on a bare
:class:`asyncio.Protocol`, counting replies in bulk as they arrive:

* ``--depth 1`` (RFC 2920 to the letter): a message's MAIL, RCPT and DATA go
  in one write; the content waits for the 354, then goes in one write with the
  next message's MAIL, RCPT and DATA (the content may open a group);
* ``--depth K`` (K > 1): up to K whole transactions, content included, are in
  flight per connection without waiting for the 354: a server that reads its
  input in order (Postfix's ``smtp-sink`` does) accepts this, and it is what
  a client can do at most on one connection.

Any reply that is not 2xx/3xx fails the run. It prints one JSON line:
``{"n", "seconds", "rate", "connections", "depth"}``, the clock running from
the first write to the last reply; the caller checks the count at the sink.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from .bench_app import RECIPIENT, SENDER

REPLIES_PER_MESSAGE = 4  # MAIL 250, RCPT 250, DATA 354, content 250


def prebuilt(n: int, body: str) -> list[tuple[bytes, bytes]]:
    """``(envelope, content)`` wire bytes of ``n`` messages, built by the library."""
    from flask_mail_outbox import Message
    from flask_mail_outbox._message import prepare_message
    from flask_mail_outbox.transports._pipeline import dot_stuffed, envelope_commands

    out = []
    for i in range(n):
        prepared = prepare_message(
            Message(f"raw client #{i}", recipients=[RECIPIENT], body=body, sender=SENDER),
            default_sender=None, allow_local_addresses=False, max_message_bytes=10_000_000,
            message_id_domain=None, ascii_attachments=False)
        envelope = b"".join(envelope_commands(prepared.sender, list(prepared.recipients),
                                              [], [])) + b"DATA\r\n"
        out.append((envelope, dot_stuffed(prepared.mime)))
    return out


class _Sender(asyncio.Protocol):
    """One greeted connection sending its share of the messages, then QUIT."""

    def __init__(self, messages: list[tuple[bytes, bytes]], depth: int) -> None:
        self.messages = messages
        self.depth = depth
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.replies = 0
        self.sent = 0  # messages whose whole transaction (or envelope, depth 1) is written
        self.greeted = asyncio.get_running_loop().create_future()
        self.done = asyncio.get_running_loop().create_future()
        self._lines: list[bytes] = []
        self._started = False

    # -- greeting (line by line; not timed) -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def _greeting(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\r\n", 1)
            self._lines.append(line)
            if len(line) >= 4 and line[3:4] == b" ":
                code = line[:3]
                if code == b"220":
                    assert self.transport is not None
                    self.transport.write(b"EHLO rawclient\r\n")
                elif code == b"250":
                    offered = b" ".join(x[4:].upper() for x in self._lines)
                    if b"PIPELINING" not in offered:
                        self.greeted.set_exception(RuntimeError("no PIPELINING offered"))
                    else:
                        self.greeted.set_result(None)
                else:
                    self.greeted.set_exception(RuntimeError(f"greeting: {line!r}"))
                self._lines = []

    # -- the timed part ---------------------------------------------------------------------

    def start(self) -> None:
        self._started = True
        assert self.transport is not None
        if not self.messages:
            self._finish()
        elif self.depth == 1:
            self.transport.write(self.messages[0][0])
            self.sent = 1
        else:
            self._fill()

    def _fill(self) -> None:
        """Whole transactions until ``depth`` are in flight (depth > 1)."""
        done = self.replies // REPLIES_PER_MESSAGE
        end = min(len(self.messages), done + self.depth)
        if end > self.sent:
            assert self.transport is not None
            self.transport.write(b"".join(e + c for e, c in self.messages[self.sent:end]))
            self.sent = end

    def data_received(self, data: bytes) -> None:
        if not self._started:
            self._greeting(data)
            return
        data = self.buffer + data
        cut = data.rfind(b"\n") + 1
        self.buffer = data[cut:]
        lines = data[:cut].split(b"\r\n")[:-1]
        for line in lines:
            if line[:1] not in (b"2", b"3"):
                self._fail(line)
                return
        before = self.replies
        self.replies += len(lines)
        if self.depth == 1:
            self._step(before)
        else:
            self._fill()
        if self.replies >= REPLIES_PER_MESSAGE * len(self.messages):
            self._finish()

    def _step(self, before: int) -> None:
        """RFC 2920: on each 354, the content and the next envelope in one write."""
        assert self.transport is not None
        # Reply 4i+3 (1-based) is message i's 354.
        for reply in range(before + 1, self.replies + 1):
            if reply % REPLIES_PER_MESSAGE == 3:
                i = reply // REPLIES_PER_MESSAGE
                nxt = self.messages[i + 1][0] if i + 1 < len(self.messages) else b""
                self.transport.write(self.messages[i][1] + nxt)

    def _fail(self, line: bytes) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(f"server replied {line!r}"))

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(time.perf_counter())
            assert self.transport is not None
            self.transport.write(b"QUIT\r\n")

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.greeted, self.done):
            if not future.done():
                future.set_exception(ConnectionError(f"connection lost: {exc}"))


async def send_all(port: int, messages: list[tuple[bytes, bytes]], connections: int,
                   depth: int) -> float:
    """Seconds from the first write to the last reply, over ``connections`` connections."""
    loop = asyncio.get_running_loop()
    senders = [_Sender(messages[i::connections], depth) for i in range(connections)]
    for sender in senders:
        await loop.create_connection(lambda s=sender: s, "127.0.0.1", port)  # type: ignore[misc]
        await sender.greeted
    started = time.perf_counter()
    for sender in senders:
        sender.start()
    ends = await asyncio.gather(*(s.done for s in senders))
    for sender in senders:
        if sender.transport is not None:
            sender.transport.close()
    return float(max(ends)) - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rawclient", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--distinct", type=int, default=5000,
                        help="messages built (and then sent in turn); default 5000")
    args = parser.parse_args(argv)
    from .drain import BODY

    built = prebuilt(min(args.n, args.distinct), BODY)
    messages = [built[i % len(built)] for i in range(args.n)]
    seconds = asyncio.run(send_all(args.port, messages, args.connections, args.depth))
    print(json.dumps({"n": args.n, "seconds": seconds, "rate": args.n / seconds,
                      "connections": args.connections, "depth": args.depth}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
