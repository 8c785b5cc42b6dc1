"""``backlog`` and ``memory``: a worker draining a deep backlog, on PostgreSQL.

The rows are written set-based (one ``INSERT ... SELECT generate_series``,
the same MIME in every row, ``due_at`` an hour ahead), the table ANALYZEd, a
``flask outbox worker --concurrency 4`` started and LISTENing, then every row
is made due at once with the library's ``NOTIFY`` (as in ``drain``). The sink
is the throughput sink (Postfix's ``smtp-sink``, else aiosmtpd).

* ``backlog``: ``--keys`` keys x ``--per-key`` emails each (only one email
  of a key may be in flight: the claim sees one head per key) against the same
  number of keyless emails; figure: keyed msg/s / keyless msg/s (goal >= 0.5).
* ``memory``: the worker's peak RSS (``VmHWM`` from ``/proc``, read before it
  is stopped) draining ``--large`` vs ``--small`` keyless emails (goal: ratio
  <= 1.3, memory does not grow with the backlog).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ._harness import (
    Context,
    Report,
    Sink,
    Table,
    bench_env,
    log,
    log_path,
    median,
    ratio,
    stop_process,
    tail,
)
from ._registry import scenario
from .drain import _analyze, _counts, _release, _reset, _wait_listening


def _template() -> tuple[str, str, bytes]:
    from flask_mail_outbox import Message
    from flask_mail_outbox._message import prepare_message

    from .bench_app import RECIPIENT, SENDER
    from .throughput import BODY

    prepared = prepare_message(
        Message("backlog", recipients=[RECIPIENT], body=BODY, sender=SENDER),
        default_sender=None, allow_local_addresses=False, max_message_bytes=10_000_000,
        message_id_domain=None, ascii_attachments=False)
    return prepared.sender, prepared.recipients[0], prepared.mime


def fill(url: str, n: int, *, keys: int = 0) -> None:
    """``n`` queued rows, due in an hour; with ``keys``, row g has key ``k{g % keys}``."""
    import sqlalchemy as sa

    sender, recipient, mime = _template()
    key = "NULL" if not keys else f"'k' || (g %% {int(keys)})"
    head = "false" if not keys else f"g <= {int(keys)}"
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO outbox_email (status, created_at, due_at, message_id, key, "
                "key_head, sender, recipients, subject, size, mime, attempts) "
                "SELECT 'queued', timezone('UTC', now()), timezone('UTC', now()) + "
                "interval '1 hour', '<b' || g || '.' || md5(random()::text) || '@bench>', "
                f"{key}, {head}, %(sender)s, %(recipients)s, 'backlog', %(size)s, %(mime)s, 0 "
                f"FROM generate_series(1, {int(n)}) AS g ORDER BY g",
                {"sender": sender, "recipients": f'["{recipient}"]', "size": len(mime),
                 "mime": mime})
    finally:
        engine.dispose()
    _analyze(url)


def drain_once(ctx: Context, url: str, sink: Sink, n: int, name: str) -> dict[str, Any]:
    """Start one worker, release the ``n`` rows, time the drain; peak RSS included."""
    sink.reset()
    worker = ctx.spawn_worker(bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": True}),
                              concurrency=4, name=name)

    def alive(*_: Any) -> None:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}:\n"
                               f"{tail(log_path(worker))}")

    try:
        _wait_listening(url, 1, timeout=120, check=alive)
        rss_idle = _status_kb(worker.pid, "VmRSS")
        released = _release(url)
        stats = sink.wait_for(n, timeout=120 + n / 20, progress=alive)
        if not sink.has_receipts:
            deadline = time.monotonic() + 60
            while _counts(url).get("sent", 0) < n and time.monotonic() < deadline:
                time.sleep(0.1)
        peak = _status_kb(worker.pid, "VmHWM")
    finally:
        code = stop_process(worker)
    counts = _counts(url)
    if counts.get("sent", 0) != n:
        raise RuntimeError(f"{name}: {counts} after the drain, expected {n} sent")
    last = float(stats.get("last") or time.time())
    return {"n": n, "rate": n / max(last - released, 1e-9), "seconds": last - released,
            "peak_rss_kb": peak, "idle_rss_kb": rss_idle, "exit": code}


def _status_kb(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _backlog_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=20, help="ordering keys (default 20)")
    parser.add_argument("--per-key", type=int, default=None,
                        help="emails per key (default 1000; --quick 100); the keyless run "
                             "has keys x per-key emails")
    parser.add_argument("--rounds", type=int, default=None, help="default 1; --quick 1")


@scenario("backlog", "deep per-key backlog (20 keys x 1000) vs as many keyless: drain ratio",
          add_arguments=_backlog_arguments)
def run_backlog(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    per_key = args.per_key or (100 if args.quick else 1000)
    n = args.keys * per_key
    rounds = args.rounds or 1
    sink = ctx.throughput_sink()
    _, url = ctx.postgres().create_database("bench_backlog")
    create_tables(url)
    samples: dict[str, list[dict[str, Any]]] = {"keyed": [], "keyless": []}
    for r in range(rounds):
        for variant in (("keyed", "keyless") if r % 2 == 0 else ("keyless", "keyed")):
            _reset(url)
            fill(url, n, keys=args.keys if variant == "keyed" else 0)
            sample = drain_once(ctx, url, sink, n, f"backlog-{variant}")
            samples[variant].append(sample)
            log(f"backlog round {r + 1}/{rounds} {variant}: {sample['rate']:.0f} msg/s")
    keyed = median(s["rate"] for s in samples["keyed"])
    keyless = median(s["rate"] for s in samples["keyless"])
    table = Table(f"Deep per-key backlog, 1 worker --concurrency 4, PostgreSQL, sink "
                  f"{sink.kind} (median of {rounds} round(s))",
                  ["backlog", "N", "msg/s", "keyed/keyless"])
    table.add(f"{args.keys} keys x {per_key}", n, keyed, ratio(keyed, keyless))
    table.add("keyless", n, keyless, None)
    report = Report("backlog", tables=[table],
                    data={"samples": samples, "keyed": keyed, "keyless": keyless,
                          "ratio": ratio(keyed, keyless), "sink": sink.kind})
    report.notes.append("only the head of each key is claimable, so a keyed claim takes at "
                        f"most {args.keys} rows; the next head is promoted when its "
                        "predecessor's outcome is recorded")
    return report


def _memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--large", type=int, default=None,
                        help="the large backlog (default 50000; --quick 10000)")
    parser.add_argument("--small", type=int, default=1000, help="the small one (default 1000)")


@scenario("memory", "peak RSS of a worker draining 50,000 vs 1,000 emails",
          add_arguments=_memory_arguments)
def run_memory(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    large = args.large or (10_000 if args.quick else 50_000)
    sink = ctx.throughput_sink()
    _, url = ctx.postgres().create_database("bench_memory")
    create_tables(url)
    results = {}
    for n in (args.small, large):
        _reset(url)
        fill(url, n)
        results[n] = drain_once(ctx, url, sink, n, f"memory-{n}")
        log(f"memory {n}: peak RSS {results[n]['peak_rss_kb'] / 1024:.1f} MiB, "
            f"{results[n]['rate']:.0f} msg/s")
    table = Table("Worker peak RSS (VmHWM), 1 worker --concurrency 4, PostgreSQL",
                  ["backlog", "peak RSS MiB", "RSS when idle MiB", "msg/s", "x small"])
    for n, result in results.items():
        table.add(n, result["peak_rss_kb"] / 1024, (result["idle_rss_kb"] or 0) / 1024,
                  result["rate"], ratio(result["peak_rss_kb"], results[args.small]["peak_rss_kb"]))
    return Report("memory", tables=[table],
                  data={"results": {str(k): v for k, v in results.items()},
                        "ratio": ratio(results[large]["peak_rss_kb"],
                                       results[args.small]["peak_rss_kb"])})
