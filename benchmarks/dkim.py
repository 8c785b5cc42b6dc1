"""``dkim``: what DKIM signing costs a worker, end to end, and the signer alone.

End to end, per round and per key set (the order rotating between rounds):
the ``drain`` scenario's drain with one ``flask outbox worker`` process, the
same N emails, a local sink that answers at once (so the worker's CPU is the
bound), unsigned and signed with an RSA 2,048-bit key, an Ed25519 key, and
both (``OUTBOX_DKIM_KEYS``: two signatures per message). The worker's CPU
time (``/proc``, Linux) is read when the emails are released and when the
sink has them all; signatures/s = signed emails / (CPU with - CPU without,
the unsigned drain of the same round), and the drain rates' ratio
signed/unsigned.

The signer alone: signatures per second of CPU time, on one core, of the app's signer (what
``load_config`` built) over a stored message of the drain, and dkimpy's
``dkim.sign`` over the same message with the same RSA key, relaxed/relaxed and
the same headers: what signing cost before it went through OpenSSL.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    execute,
    log,
    median,
    ratio,
    stop_process,
    wait_listening,
)
from .bench_app import Bench, build
from .drain import HOLD, release

NAME = "dkim"
HELP = "DKIM signing's cost: one worker's drain unsigned vs signed (RSA, Ed25519, both)"
SMOKE = ["--n", "100", "--rounds", "1", "--micro-seconds", "0.2"]

DOMAIN = "example.com"
KEY_SETS = ("unsigned", "rsa2048", "ed25519", "dual")
#: What dkimpy signed by default before (DEFAULT_SIGNED_HEADERS, those present).
HEADERS = ("From", "To", "Cc", "Subject", "Date", "Message-ID", "Reply-To", "MIME-Version",
           "Content-Type", "List-Unsubscribe", "List-Unsubscribe-Post")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=3000, help="emails per drain")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4,
                        help="flask outbox worker --concurrency")
    parser.add_argument("--keys", default=",".join(KEY_SETS),
                        help="key sets to drain with, 'unsigned' first: unsigned, rsa2048, "
                             "ed25519, dual")
    parser.add_argument("--micro-seconds", type=float, default=2.0,
                        help="seconds each signer alone signs for")
    parser.add_argument("--backends", default="pg", help="pg or sqlite")


def _pem(key: Any) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode("ascii")


def key_configs(names: list[str]) -> dict[str, dict[str, Any]]:
    """The ``OUTBOX_DKIM_*`` config of each key set (JSON-able: workers get it as BENCH_CONFIG)."""
    rsa_pem = _pem(rsa.generate_private_key(65537, 2048))
    ed_pem = _pem(ed25519.Ed25519PrivateKey.generate())
    every = {
        "unsigned": {},
        "rsa2048": {"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_SELECTOR": "rsa",
                    "OUTBOX_DKIM_PRIVATE_KEY": rsa_pem},
        "ed25519": {"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_SELECTOR": "ed",
                    "OUTBOX_DKIM_PRIVATE_KEY": ed_pem},
        "dual": {"OUTBOX_DKIM_DOMAIN": DOMAIN,
                 "OUTBOX_DKIM_KEYS": [{"selector": "rsa", "private_key": rsa_pem},
                                      {"selector": "ed", "private_key": ed_pem}]},
    }
    unknown = set(names) - set(every)
    if unknown or names[:1] != ["unsigned"]:
        raise SystemExit(f"--keys: 'unsigned' first, then of {', '.join(KEY_SETS[1:])}")
    return {name: every[name] for name in names}


def run(ctx: Context, args: argparse.Namespace) -> Report:
    names = [k.strip() for k in args.keys.split(",") if k.strip()]
    configs = key_configs(names)
    sink = ctx.sink(0.0)
    drains = Table(f"One worker (--concurrency {args.concurrency}) drains {args.n} emails to a "
                   f"sink answering at once (median of {args.rounds} rounds)",
                   ["database", "keys", "msg/s", "x unsigned", "worker CPU ms/msg",
                    "extra CPU ms/msg", "signed msg/s of CPU", "signatures/s of CPU"])
    alone = Table("The signer alone, per second of one core's CPU time, on a stored message of "
                  "the drain",
                  ["signer", "signatures/s", "messages/s", "x dkimpy"])
    report = Report(NAME, tables=[drains, alone])
    [(backend, url)] = ctx.databases(args.backends, NAME)[:1]
    bench = build(url, sink.smtp_port, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                  OUTBOX_RUN_SCHEDULER=False)
    try:
        bench.enqueue(1, "dkim micro")
        [[(mime,)]] = execute(url, "SELECT mime FROM outbox_email")
        _micro(configs, bytes(mime), url, sink, args.micro_seconds, alone, report)
        rates: dict[str, list[float]] = {name: [] for name in configs}
        cpu: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                rate, seconds = drain_cpu(ctx, bench, url, sink, n=args.n,
                                          concurrency=args.concurrency, config=configs[name])
                rates[name].append(rate)
                cpu[name].append(seconds)
                log(f"dkim {backend} round {r + 1} {name}: {rate:.0f} msg/s, "
                    f"{seconds * 1000 / args.n:.2f} ms CPU/msg")
    finally:
        bench.stop()
    for name in names:
        per_message = [c / args.n for c in cpu[name]]
        extra = [(c - u) / args.n for c, u in zip(cpu[name], cpu["unsigned"], strict=True)]
        signed = median(1 / e if e > 0 else None for e in extra) if name != "unsigned" else None
        signatures = signed * (2 if name == "dual" else 1) if signed else None
        vs = median(ratio(a, b) for a, b in zip(rates[name], rates["unsigned"], strict=True))
        drains.add(backend, name, median(rates[name]), vs,
                   _ms(median(per_message)), None if name == "unsigned" else _ms(median(extra)),
                   signed, signatures)
        report.figures[f"drain {name} msg/s"] = median(rates[name])
        if name != "unsigned":
            report.figures[f"drain {name} x unsigned"] = vs
            report.figures[f"drain {name} signatures/s of CPU"] = signatures
    report.notes += [
        ("CPU: the worker process's user + system time from the release to the last receipt "
         "(/proc/<pid>/stat, 10 ms ticks); extra = signed - the unsigned drain of the same round"),
        "dual: two signatures (RSA + Ed25519) per message; signatures/s counts both",
        ("the signer alone: the app's signer (config.dkim, as load_config built it) on one "
         "thread; dkimpy: dkim.sign with the same key, relaxed/relaxed, the same headers"),
    ]
    return report


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _micro(configs: dict[str, dict[str, Any]], mime: bytes, url: str, sink: Sink,
           seconds: float, table: Table, report: Report) -> None:
    """Signatures/s of each signer alone, and of dkimpy with the RSA key."""
    rates: dict[str, float] = {}
    dkimpy = _dkimpy_signer(configs, mime)
    if dkimpy is not None:
        rates["dkimpy rsa2048"] = _per_second(dkimpy, seconds)
    for name, config in configs.items():
        if name == "unsigned":
            continue
        signing = build(url, sink.smtp_port, create=False, **config)
        signer = signing.app.extensions["mail_outbox"].config.dkim
        rates[name] = _per_second(lambda signer=signer: signer.sign(mime), seconds)
        signing.stop()
    before = rates.get("dkimpy rsa2048")
    for name, rate in rates.items():
        signatures = rate * (2 if name == "dual" else 1)
        table.add(name, signatures, rate, ratio(rate, before) if name == "rsa2048" else None)
        report.figures[f"alone {name} signatures/s"] = signatures


def _dkimpy_signer(configs: dict[str, dict[str, Any]], mime: bytes
                   ) -> Callable[[], Any] | None:
    try:
        import dkim  # the tests' verifier (the test extra): the signer before OpenSSL
    except ImportError:
        log("dkim: dkimpy is not installed (pip install -e '.[test]'): no dkimpy figure")
        return None
    pem = configs.get("rsa2048", {}).get("OUTBOX_DKIM_PRIVATE_KEY")
    if pem is None:
        return None
    present = {line.split(b":", 1)[0].lower() for line in mime.split(b"\r\n\r\n", 1)[0]
               .split(b"\r\n") if b":" in line and line[:1] not in (b" ", b"\t")}
    include = [h.lower().encode() for h in HEADERS if h.lower().encode() in present]
    return lambda: dkim.sign(mime, b"rsa", DOMAIN.encode(), pem.encode(),
                             canonicalize=(b"relaxed", b"relaxed"), include_headers=include,
                             linesep=b"\r\n")


def _per_second(sign: Callable[[], Any], seconds: float) -> float:
    """Calls of ``sign`` per second of this thread's CPU time (wall time would count what
    the other processes of a shared machine take)."""
    sign()  # warm
    count, started = 0, time.thread_time()
    while (elapsed := time.thread_time() - started) < seconds:
        sign()
        count += 1
    return count / elapsed


def drain_cpu(ctx: Context, bench: Bench, url: str, sink: Sink, *, n: int, concurrency: int,
              config: dict[str, Any]) -> tuple[float, float]:
    """One worker drains ``n`` held emails: (msg/s, its CPU seconds from release to the last)."""
    execute(url, "DELETE FROM outbox_attachment", "DELETE FROM outbox_email")
    bench.enqueue(n, "dkim", send_after=HOLD)
    sink.reset()
    postgres = url.startswith("postgresql")
    polling = {} if postgres else {"OUTBOX_POLL_MAX_INTERVAL": 0.5}
    proc = ctx.spawn_worker(url, sink, concurrency=concurrency,
                            config={**polling, **config}, name="dkim-worker")
    try:
        if postgres:
            wait_listening(url, 1, [proc])
        else:
            time.sleep(2)  # the worker's start: no LISTEN to wait for
        cpu_before = _cpu_seconds(proc)
        released = release(bench)
        stats = sink.wait_for(n + 1, timeout=60 + n / 10, procs=[proc])
        cpu_after = _cpu_seconds(proc)
    finally:
        stop_process(proc)
    if stats["count"] < n + 1:
        raise RuntimeError(f"only {stats['count']} of {n + 1} emails arrived")
    log_path = proc.log_path  # type: ignore[attr-defined]
    unsigned = Path(log_path).read_text().count("could not be DKIM-signed")
    if unsigned:
        raise RuntimeError(f"{unsigned} emails went out unsigned: see {log_path}")
    start = released if postgres else stats["first"]
    count = stats["count"] if postgres else stats["count"] - 1
    return count / max(stats["last"] - start, 1e-9), cpu_after - cpu_before


def _cpu_seconds(proc: subprocess.Popen[Any]) -> float:
    """User + system CPU time of ``proc`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After "pid (comm)": state is field 3, utime 14 and stime 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
