"""``throughput``: the transport ceiling, Flask-Mail, and the outbox end to end, one sink.

Every variant sends the same N emails to the same sink (Postfix's
``smtp-sink`` when installed, else the aiosmtpd sink process), each in its own
child process (``python -m benchmarks.throughput --child SPEC``), one after
the other, the variants' order rotating between rounds:

* ``ceiling-K`` (K = 1, 4, 8): raw aiosmtplib, the N messages built before
  the clock starts (the outbox's own MIME), K connections opened before it
  starts and reused, each sending its share back to back: the transport limit
  on this machine. The outbox is compared with the best K;
* ``flaskmail-send``: Flask-Mail 0.10, ``mail.send(Message(...))`` per
  message (a connection per message, as ``mail.send`` does);
* ``flaskmail-connect``: Flask-Mail, ``with mail.connect() as conn`` and
  ``conn.send(...)`` for each message (one reused connection);
* ``outbox-inline-{sqlite,pg}``: ``mail.send(Message(...))`` N times in one
  transaction, ``commit()``, inline mode delivers in the same process;
* ``outbox-durable-{sqlite,pg}``: the same in durable mode, the app process's
  own dispatcher delivering;
* ``outbox-worker1-pg`` / ``outbox-worker4-pg``: durable, the producer
  delivers nothing (``OUTBOX_RUN_WORKER=False``) and 1 or 4 ``flask outbox
  worker --concurrency 4`` processes (started and LISTENing before the clock)
  deliver.

The clock starts in the child just before the first message is built (or
sent, for the ceiling) and stops at the sink's receipt of the N-th message;
msg/s = N / that time. For the outbox it includes the N ``send()`` calls and
the commit (what an application pays before anything can go out). Library
defaults throughout (``OUTBOX_BATCH_SIZE`` 100, 4 SMTP connections per process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
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
from .bench_app import RECIPIENT, SENDER

BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")

CEILINGS = ("ceiling-1", "ceiling-4", "ceiling-8")
PEERS = ("flaskmail-send", "flaskmail-connect")
OUTBOX = ("outbox-inline-sqlite", "outbox-inline-pg", "outbox-durable-sqlite",
          "outbox-durable-pg", "outbox-worker1-pg", "outbox-worker4-pg")
VARIANTS = CEILINGS + PEERS + OUTBOX


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="emails per variant and round (default 2000; --quick 500)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3; --quick 1")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")


@scenario("throughput", "aiosmtplib ceiling vs Flask-Mail vs the outbox end to end, one sink",
          add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    n = args.n or (500 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown throughput variant(s): {', '.join(unknown)}")
    sink = ctx.throughput_sink()
    log(f"throughput: sink {sink.kind}, N={n}, {rounds} round(s), {len(variants)} variants")
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        shift = r % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            url = None
            if variant.endswith("-pg"):
                _, url = ctx.postgres().create_database("bench_tp")
            elif variant.endswith("-sqlite"):
                url = f"sqlite:///{ctx.workdir / f'tp-{variant}-{r}.db'}"
            if url is not None:
                create_tables(url)
            rate = _one(ctx, sink, variant, n, url)
            samples[variant].append(rate)
            log(f"throughput round {r + 1}/{rounds} {variant}: {rate:.0f} msg/s")
    return _report(sink, n, rounds, variants, samples)


def _report(sink: Sink, n: int, rounds: int, variants: list[str],
            samples: dict[str, list[float]]) -> Report:
    medians = {v: median(samples[v]) for v in variants}
    ceilings = [v for v in CEILINGS if v in variants]
    best = max(ceilings, key=lambda v: medians[v] or 0.0) if ceilings else None
    connect = medians.get("flaskmail-connect")
    table = Table(f"Throughput to one sink ({sink.kind}), N={n} per run, median of {rounds} "
                  "round(s); ratios of medians within this run",
                  ["variant", "msg/s", "min..max", "/ ceiling", "/ Flask-Mail connect()"])
    for v in variants:
        rates = samples[v]
        table.add(v, medians[v], f"{min(rates):.0f}..{max(rates):.0f}",
                  ratio(medians[v], medians[best]) if best else None,
                  ratio(medians[v], connect))
    report = Report("throughput", tables=[table])
    report.data = {"n": n, "rounds": rounds, "sink": sink.kind, "samples": samples,
                   "medians": medians, "best_ceiling": best,
                   "best_ceiling_msg_per_s": medians[best] if best else None}
    report.notes += [
        ("clock: from just before the first message is built (ceiling: sent) to the sink's "
        "receipt of the N-th; the outbox's figure includes the N send() and the commit"),
        f"ceiling = the best of {', '.join(ceilings)}: {best}" if best else "no ceiling run",
    ]
    return report


def _one(ctx: Context, sink: Sink, variant: str, n: int, url: str | None) -> float:
    import subprocess

    sink.reset()
    workers: list[subprocess.Popen[Any]] = []
    config: dict[str, Any] = {}
    if variant.startswith("outbox-"):
        mode = variant.split("-")[1]
        config = {"OUTBOX_DURABLE": mode != "inline", "OUTBOX_RUN_SCHEDULER": False}
        if mode.startswith("worker"):
            assert url is not None
            config["OUTBOX_RUN_WORKER"] = False
            env = bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": True})
            workers = [ctx.spawn_worker(env, concurrency=4, name=f"tp-{variant}-{i}")
                       for i in range(int(mode[len("worker"):]))]
            _wait_listening(url, workers)
    spec = {"variant": variant, "n": n}
    env = bench_env(url or "sqlite:////dev/null", sink.smtp_port, config)
    child = ctx.spawn([sys.executable, "-m", "benchmarks.throughput", "--child",
                       json.dumps(spec)], env=env, name=f"tp-{variant}",
                      stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            child.wait(30)
            raise RuntimeError(f"{variant} failed (exit {child.returncode}):\n"
                               f"{tail(log_path(child))}")
        started = float(json.loads(line)["start"])

        def alive(_: Any) -> None:
            if child.poll() not in (None, 0):
                raise RuntimeError(f"{variant} exited with {child.returncode}:\n"
                                   f"{tail(log_path(child))}")

        stats = sink.wait_for(n, timeout=120 + n / 20, progress=alive)
        if stats["count"] < n:
            raise RuntimeError(f"{variant}: only {stats['count']} of {n} arrived")
        if stats.get("unique") is not None and stats["unique"] < n:
            raise RuntimeError(f"{variant}: {n - stats['unique']} duplicate Message-IDs")
        return n / max(float(stats["last"]) - started, 1e-9)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        stop_process(child)
        for worker in workers:
            stop_process(worker)


def _wait_listening(url: str, workers: list[Any], timeout: float = 120) -> None:
    from .drain import _admin

    database = url.rsplit("/", 1)[1].split("?")[0]
    deadline = time.monotonic() + timeout
    while True:
        for proc in workers:
            if proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {proc.returncode}:\n"
                                   f"{tail(log_path(proc))}")
        count = _admin(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                            f"'{database}' AND query LIKE 'LISTEN %%'")[0][0][0]
        if count >= len(workers):
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"only {count} of {len(workers)} workers listen")
        time.sleep(0.1)


# -- the child process -------------------------------------------------------------------------

def _announce_start() -> None:
    print(json.dumps({"start": time.time()}), flush=True)


def _wait_forever() -> None:
    """Until the parent has counted the receipts and stops this process."""
    while True:
        time.sleep(3600)


def child_main(spec: dict[str, Any]) -> None:
    variant, n = spec["variant"], spec["n"]
    if variant.startswith("ceiling-"):
        _ceiling(n, int(variant.split("-")[1]))
    elif variant.startswith("flaskmail-"):
        _flask_mail(n, connect=variant.endswith("connect"))
    else:
        _outbox(n)
    _wait_forever()


def _prebuilt(n: int) -> list[tuple[str, list[str], bytes]]:
    from flask_mail_outbox import Message
    from flask_mail_outbox._message import prepare_message

    out = []
    for i in range(n):
        prepared = prepare_message(
            Message(f"throughput #{i}", recipients=[RECIPIENT], body=BODY, sender=SENDER),
            default_sender=None, allow_local_addresses=False, max_message_bytes=10_000_000,
            message_id_domain=None, ascii_attachments=False)
        out.append((prepared.sender, list(prepared.recipients), prepared.mime))
    return out


def _ceiling(n: int, connections: int) -> None:
    import os

    send_over_aiosmtplib(int(os.environ["BENCH_SMTP_PORT"]), _prebuilt(n), connections,
                         on_start=_announce_start)


def send_over_aiosmtplib(port: int, messages: list[tuple[str, list[str], bytes]],
                         connections: int, *,
                         on_start: Callable[[], None] | None = None) -> float:
    """Send ``messages`` with aiosmtplib's ``sendmail()`` over ``connections`` connections.

    The connections are opened (and EHLO said) before the clock starts; each
    sends its share back to back. Returns the seconds from the first message to
    the last reply; ``on_start`` runs when the clock starts.
    """
    import aiosmtplib

    async def main() -> float:
        clients = [aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False,
                                   local_hostname="bench", timeout=30)
                   for _ in range(connections)]
        for client in clients:
            await client.connect()
            await client.ehlo()
        if on_start is not None:
            on_start()
        started = time.perf_counter()

        async def share(client: aiosmtplib.SMTP, part: list[tuple[str, list[str], bytes]]
                        ) -> None:
            for sender, rcpts, mime in part:
                await client.sendmail(sender, rcpts, mime)

        await asyncio.gather(*(share(c, messages[i::connections])
                               for i, c in enumerate(clients)))
        elapsed = time.perf_counter() - started
        for client in clients:
            await client.quit()
        return elapsed

    return asyncio.run(main())


def _flask_mail(n: int, *, connect: bool) -> None:
    import os

    from flask import Flask
    from flask_mail import Mail
    from flask_mail import Message as FMMessage

    app = Flask("bench_flask_mail")
    app.config.update(MAIL_SERVER="127.0.0.1", MAIL_PORT=int(os.environ["BENCH_SMTP_PORT"]),
                      MAIL_DEFAULT_SENDER=SENDER, MAIL_SUPPRESS_SEND=False)
    mail = Mail(app)
    with app.app_context():
        _announce_start()
        if connect:
            with mail.connect() as conn:
                for i in range(n):
                    conn.send(FMMessage(f"throughput #{i}", recipients=[RECIPIENT], body=BODY))
        else:
            for i in range(n):
                mail.send(FMMessage(f"throughput #{i}", recipients=[RECIPIENT], body=BODY))


def _outbox(n: int) -> None:
    import signal

    from flask_mail_outbox import Message

    from .bench_app import create_app

    app = create_app()
    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    with app.app_context():
        # Threads, the engine and the transport exist before the clock starts.
        state.runtime()
        _announce_start()
        for i in range(n):
            mail.send(Message(f"throughput #{i}", recipients=[RECIPIENT], body=BODY))
        db.session.commit()
    signal.signal(signal.SIGTERM, lambda *_: (mail.stop(timeout=5), sys.exit(0)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks throughput`")
