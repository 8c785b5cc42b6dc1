"""``enqueue-many``: ``mail.send_many()`` of N emails + commit against N ``send()`` + commit.

In a child process per database (``python -m benchmarks.enqueue_many --child
SPEC``), the same app and ``db.session`` run, alternately, round after round:

* **loop**: ``for m in messages: mail.send(m)`` then one ``commit()``;
* **many**: ``mail.send_many(messages)`` then one ``commit()``.

The messages are built before the clock starts (both pay the same validation
and MIME building inside the call). The app runs in durable mode with
``OUTBOX_RUN_WORKER=False`` (what a web process pays when workers deliver),
as :mod:`benchmarks.enqueue` does. Ratio = loop time / many time, rounds
paired. With ``--key``, every email carries one key (the keyed path).

End to end (``--e2e``, on by default): a child in the default inline mode
runs ``send_many`` of N + commit, or the loop of N ``send()`` + commit, and
the clock runs from just before the call to the sink's receipt of the N-th
message (its in-process delivery worker sends them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._harness import (
    Context,
    Report,
    Table,
    bench_env,
    log,
    log_path,
    median,
    stop_process,
    tail,
)
from ._registry import scenario
from .bench_app import RECIPIENT

BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=None,
                        help="emails per measurement (default 2000; --quick 500)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5; --quick 2")
    parser.add_argument("--backends", default="pg,sqlite", help="pg and/or sqlite")
    parser.add_argument("--key", default=None, help="one key for every email (keyed path)")
    parser.add_argument("--no-e2e", dest="e2e", action="store_false",
                        help="skip the end-to-end runs")


@scenario("enqueue-many", "mail.send_many() of N + commit vs N send() + commit; and end to "
          "end to the sink", add_arguments=add_arguments)
def run(ctx: Context, args: argparse.Namespace) -> Report:
    from .bench_app import create_tables

    n = args.n or (500 if args.quick else 2000)
    rounds = args.rounds or (2 if args.quick else 5)
    keyed = f", key={args.key!r}" if args.key else ""
    table = Table(f"Enqueue of {n} emails in one transaction (ms), median of {rounds} "
                  f"rounds{keyed}", ["database", "loop ms", "send_many ms", "loop/many",
                                     "send_many msg/s", "spread send_many"])
    e2e_table = Table(f"End to end: {n} emails queued then delivered to the sink (inline "
                      "mode)", ["database", "route", "seconds", "msg/s"])
    report = Report("enqueue-many", tables=[table] + ([e2e_table] if args.e2e else []))
    sink = ctx.aiosmtpd_sink()
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend == "pg":
            _, url = ctx.postgres().create_database("bench_enqueue_many")
        else:
            url = f"sqlite:///{ctx.workdir / 'enqueue-many.db'}"
        create_tables(url)
        out = ctx.workdir / f"enqueue-many-{backend}.json"
        spec = {"mode": "enqueue", "n": n, "rounds": rounds, "out": str(out), "key": args.key}
        log(f"enqueue-many {backend}: {rounds} rounds x loop/many of {n}")
        child = ctx.spawn([sys.executable, "-m", "benchmarks.enqueue_many", "--child",
                           json.dumps(spec)],
                          env=bench_env(url, sink.smtp_port,
                                        {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False,
                                         "OUTBOX_RUN_SCHEDULER": False}),
                          name=f"enqueue-many-{backend}")
        code = child.wait(timeout=1800)
        if code != 0 or not out.exists():
            raise RuntimeError(f"enqueue-many child failed (exit {code}):\n"
                               f"{tail(log_path(child))}")
        result = json.loads(out.read_text())
        ratios = [lo / ma for lo, ma in zip(result["loop"], result["many"], strict=True)]
        result["ratio_median"] = median(ratios)
        many_ms = [t * 1e3 for t in result["many"]]
        many_s = median(result["many"])
        table.add(backend, median([t * 1e3 for t in result["loop"]]), median(many_ms), median(ratios),
                  n / many_s if many_s else None, f"{min(many_ms):.0f}..{max(many_ms):.0f}")
        if args.e2e:
            result["e2e"] = {}
            for route in ("many", "loop"):
                seconds = _end_to_end(ctx, url, sink, n=n, route=route, key=args.key,
                                      name=f"enqueue-many-e2e-{backend}-{route}")
                result["e2e"][route] = seconds
                e2e_table.add(backend, "send_many" if route == "many" else "send() loop",
                              seconds, n / seconds)
        report.data[backend] = result
    report.notes += [
        ("loop: N mail.send() then one commit; send_many: mail.send_many(N messages) then "
         "one commit; messages built before the clock; durable mode, no in-process worker"),
        "loop/many: the median over rounds of the ratio within each round",
        ("end to end: from just before the call to the sink's receipt of the N-th message, "
         "delivered by the child's inline worker"),
    ]
    return report


def _end_to_end(ctx: Context, url: str, sink: Any, *, n: int, route: str,
                key: str | None, name: str) -> float:
    """One child: queue ``n`` by ``route`` and commit; seconds until the sink has all."""
    sink.reset()
    spec = {"mode": "e2e", "n": n, "route": route, "key": key}
    child = ctx.spawn([sys.executable, "-m", "benchmarks.enqueue_many", "--child",
                       json.dumps(spec)],
                      env=bench_env(url, sink.smtp_port, {"OUTBOX_RUN_SCHEDULER": False}),
                      name=name, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            child.wait(30)
            raise RuntimeError(f"{name} failed (exit {child.returncode}):\n"
                               f"{tail(log_path(child))}")
        started = float(json.loads(line)["start"])

        def alive(_: Any) -> None:
            if child.poll() not in (None, 0):
                raise RuntimeError(f"{name} exited with {child.returncode}:\n"
                                   f"{tail(log_path(child))}")

        stats = sink.wait_for(n, timeout=120 + n / 20, progress=alive)
        if stats["count"] < n:
            raise RuntimeError(f"{name}: only {stats['count']} of {n} arrived")
        return max(float(stats["last"]) - started, 1e-9)
    finally:
        stop_process(child)


def _messages(n: int, tag: str) -> list[Any]:
    from flask_mail_outbox import Message

    return [Message(f"{tag} #{i}", recipients=[RECIPIENT], body=BODY) for i in range(n)]


def child_main(spec: dict[str, Any]) -> None:
    from .bench_app import create_app

    app = create_app()
    state = app.extensions["mail_outbox"]
    mail, db = state.ext, state.db
    key = spec.get("key")

    def loop(messages: list[Any]) -> None:
        for m in messages:
            mail.send(m, key=key)
        db.session.commit()

    def many(messages: list[Any]) -> None:
        mail.send_many(messages, key=key)
        db.session.commit()

    with app.app_context():
        if spec["mode"] == "e2e":
            messages = _messages(spec["n"], f"e2e-{spec['route']}")
            print(json.dumps({"start": time.time()}), flush=True)
            (many if spec["route"] == "many" else loop)(messages)
            mail.wait_idle(120 + spec["n"] / 20)  # the parent watches the sink meanwhile
            mail.stop(timeout=5)
            return
        loop(_messages(50, "warm-up"))  # connections, compiled statements
        many(_messages(50, "warm-up"))
        times: dict[str, list[float]] = {"loop": [], "many": []}
        for r in range(spec["rounds"]):
            order = [("loop", loop), ("many", many)]
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                messages = _messages(spec["n"], name)
                started = time.perf_counter()
                fn(messages)
                times[name].append(time.perf_counter() - started)
        db.session.remove()
    Path(spec["out"]).write_text(json.dumps(times))
    mail.stop(timeout=5)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        raise SystemExit("run through `python -m benchmarks enqueue-many`")
