"""Profiles behind the README's explanations: ``python -m benchmarks.profiles [--n N]``.

Writes pyinstrument text profiles to ``benchmarks/profiles/`` (kept in git, so
the README can cite them), each run in this process against a throwaway
SQLite file or PostgreSQL database and the throughput sink:

* ``enqueue-<db>.txt``: N ``mail.send()`` in one transaction + ``commit()``;
* ``drain-<db>.txt``: the same N drained by the dispatcher ticking in the
  foreground (the SMTP loop runs in its own thread, so the profile shows the
  claim and the record, and the wait for the batch's sends), with the time per
  phase (claim, send, record) at its head;
* ``smtp-send.txt``: the outbox's SMTP transport sending N prebuilt messages,
  its asyncio loop run in the profiled thread: the CPU one message costs once
  aiosmtplib has opened the session and the transport pipelines (RFC 2920).

pyinstrument samples one thread, so each part is profiled where it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import Context, log

OUT = Path(__file__).resolve().parent / "profiles"


def _profile(name: str, fn: Any, header: str = "") -> Any:
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005, async_mode="enabled")
    profiler.start()
    try:
        result = fn()
    finally:
        profiler.stop()
    text = profiler.output_text(unicode=False, color=False, show_all=False)
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.txt").write_text(header + text)
    log(f"wrote {OUT / f'{name}.txt'}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles")
    parser.add_argument("--n", type=int, default=2000, help="emails per profile (2000)")
    args = parser.parse_args(argv)
    from .bench_app import build_app, create_tables, local_config

    ctx = Context()
    try:
        sink = ctx.throughput_sink()
        _, pg_url = ctx.postgres().create_database("bench_profile")
        for db, url in (("sqlite", f"sqlite:///{ctx.workdir / 'profile.db'}"), ("pg", pg_url)):
            create_tables(url)
            app = build_app(local_config(url, sink.smtp_port, OUTBOX_DURABLE=True,
                                         OUTBOX_RUN_WORKER=False, OUTBOX_RUN_SCHEDULER=False))
            _enqueue_and_drain(app, db, args.n, sink)
        _smtp_send(sink.smtp_port, args.n)
    finally:
        ctx.close()


def _enqueue_and_drain(app: Any, db_name: str, n: int, sink: Any) -> None:
    from flask_mail_outbox import Message

    from .bench_app import RECIPIENT
    from .throughput import BODY

    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    runtime = state.runtime()

    def enqueue() -> None:
        with app.app_context():
            for i in range(n):
                mail.send(Message(f"profile #{i}", recipients=[RECIPIENT], body=BODY))
            db.session.commit()

    started = time.perf_counter()
    _profile(f"enqueue-{db_name}", enqueue,
             f"# {n} mail.send() in one transaction + commit ({db_name})\n")
    enqueue_s = time.perf_counter() - started

    sink.reset()
    dispatcher = runtime.dispatch(hand_ticked=True)
    phases = {"claim": 0.0, "record": 0.0}

    def timed(obj: Any, name: str, phase: str) -> None:
        original = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                phases[phase] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    timed(runtime.store, "claim_due", "claim")
    timed(runtime.store, "record", "record")

    def drain() -> int:
        ticks = 0
        while sink.stats()["count"] < n:
            dispatcher.tick()
            ticks += 1
        return ticks

    started = time.perf_counter()
    ticks = _profile(f"drain-{db_name}", drain, "")
    drain_s = time.perf_counter() - started
    path = OUT / f"drain-{db_name}.txt"
    head = (f"# {n} emails drained by the dispatcher ticking in the foreground ({db_name}), "
            f"{ticks} ticks, {n / drain_s:.0f} msg/s under the profiler\n"
            f"# enqueue took {enqueue_s:.2f} s, the drain {drain_s:.2f} s; per phase: "
            + ", ".join(f"{k} {v:.2f} s ({100 * v / drain_s:.0f}%)"
                        for k, v in phases.items())
            + " (sending runs beside them, in the transport's threads)\n")
    path.write_text(head + path.read_text())
    mail.stop(timeout=5)


def _smtp_send(port: int, n: int) -> None:
    from flask_mail_outbox._config import load_config
    from flask_mail_outbox.transports import Envelope, SMTPTransport

    from .throughput import _prebuilt

    config = load_config({"MAIL_SERVER": "127.0.0.1", "MAIL_PORT": port},
                         instance_path="/tmp", testing=False)
    transport = SMTPTransport(config, concurrency=4)
    envelopes = [Envelope(email_id=i, sender=s, recipients=tuple(r), mime=m,
                          message_id=f"<{i}@bench>")
                 for i, (s, r, m) in enumerate(_prebuilt(n))]

    def send() -> None:
        asyncio.run(transport._send_batch(envelopes))

    started = time.perf_counter()
    _profile("smtp-send", send, f"# the outbox's SMTP transport sending {n} prebuilt "
                                "messages over 4 connections, its loop in this thread\n")
    log(f"smtp-send: {n / (time.perf_counter() - started):.0f} msg/s under the profiler")


if __name__ == "__main__":
    main(sys.argv[1:])
