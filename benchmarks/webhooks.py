"""``webhooks``: provider webhooks under gunicorn, a burst of 10,000 events, single and batched.

A gunicorn deployment (``-w 2 --threads 4`` by default, gthread workers) serves
:mod:`benchmarks.bench_app` with two ``OUTBOX_TRANSPORTS`` entries that have a
``webhook_secret``: ``sendgrid`` (the public half of an ECDSA P-256 key this
process makes) and ``resend`` (a ``whsec_`` secret). The database holds
``--emails`` emails with a ``provider_message_id`` (set by SQL on
``outbox_email``), so the events are matched to them, 2% name none
(unmatched) and 2% are permanent bounces (a suppression each). This process
signs the requests as the providers do (Svix HMAC, SendGrid ECDSA), then fires
each burst from ``--connections`` concurrent httpx connections:

* **resend single**: ``--events`` POSTs of one event each;
* **sendgrid N/POST**: the same number of events in batches of N (each of
  ``--batch-sizes``; 1,000 and 100 by default).

Per burst: events/s accepted (events over the wall time from the first request
to the last response), p50/p95/max response time, the non-2xx answers (the goal:
none), and the rows of ``outbox_event`` counted before and after (exactly
``--events`` new ones, each of the burst's ids). What bounds the work, in the
same run:

* **ok route**: the same requests, bodies and connections against a route of
  the same gunicorn app that reads the body and answers 200 (HTTP, WSGI and the
  client: the ceiling for this machine);
* **bare insert**: the same rows, as many per transaction as the burst puts in
  one request, inserted by plain SQLAlchemy from one connection into a copy of
  ``outbox_event`` (its unique key and indexes) in the same database.

Then ``--replays`` new batches of the largest size are posted one at a time,
and each of them again (signed anew, as SendGrid signs a retry): every event of
the second postings must come back as a duplicate and nothing be written; their
response time is set against the first postings'.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hashlib
import hmac
import json
import os
import resource
import ssl
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ._harness import (
    Context,
    Report,
    Table,
    bench_env,
    execute,
    free_port,
    log,
    median,
    percentile,
    stop_process,
    tail,
    wait_port,
)
from .bench_app import build

NAME = "webhooks"
HELP = "webhooks under gunicorn: 10,000 events as single Resend POSTs and SendGrid batches"
SMOKE = ["--events", "200", "--batch-sizes", "100,20", "--emails", "100", "--rounds", "1",
         "--replays", "2", "--connections", "8"]

PREFIX = "/outbox/webhooks"
OK_PATH = "/bench/ok"
READY_PATH = "/bench/ready"

#: A copy of outbox_event's columns, unique key and indexes: the bare-insert baseline.
BARE = sa.Table(
    "bench_bare_event", sa.MetaData(),
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("email_id", sa.BigInteger()),
    sa.Column("transport", sa.String(64), nullable=False),
    sa.Column("provider_event_id", sa.String(255)),
    sa.Column("event_type", sa.String(16), nullable=False),
    sa.Column("bounce_kind", sa.String(16)),
    sa.Column("recipient", sa.String(320)),
    sa.Column("occurred_at", sa.DateTime(), nullable=False),
    sa.Column("received_at", sa.DateTime(), nullable=False),
    sa.Column("description", sa.Text(), nullable=False),
    sa.Column("mta_response", sa.Text(), nullable=False),
    sa.Column("payload", sa.Text()),
    sa.UniqueConstraint("transport", "provider_event_id", name="uq_bench_bare_event"),
    sa.Index("ix_bench_bare_event_email", "email_id", "occurred_at", "id"),
    sa.Index("ix_bench_bare_event_type", "event_type", "email_id"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=10_000,
                        help="events per burst (default 10,000)")
    parser.add_argument("--batch-sizes", default="1000,100",
                        help="SendGrid events per POST, comma-separated (default 1000,100)")
    parser.add_argument("--connections", type=int, default=32,
                        help="concurrent client connections (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (default 2)")
    parser.add_argument("--threads", type=int, default=4,
                        help="gunicorn threads per worker (default 4)")
    parser.add_argument("--emails", type=int, default=2000,
                        help="emails in the database the events are matched to (default 2000)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="bursts per phase, the median reported (default 3)")
    parser.add_argument("--replays", type=int, default=5,
                        help="batches posted twice, the second time all duplicates (default 5)")
    parser.add_argument("--backends", default="sqlite,pg", help="sqlite and/or pg (default both)")


# -- the events ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """One event as the route should store it (and as the bare insert writes it)."""

    index: int
    event_id: str
    email_id: int | None
    provider_message_id: str
    recipient: str
    event_type: str
    bounce_kind: str | None
    occurred: int  # Unix seconds


def specs(tag: str, n: int, email_ids: list[int], now: float) -> list[Spec]:
    """``n`` events over the emails: each one's delivery (or bounce, or deferral), then opens
    and clicks; every 50th names an email nobody sent (unmatched)."""
    out = []
    for i in range(n):
        slot, stage = i % len(email_ids), i // len(email_ids)
        email_id: int | None = email_ids[slot]
        if i % 50 == 49:
            email_id = None
        pmid = f"pm-{email_id}" if email_id is not None else f"pm-unknown-{tag}-{i}"
        bounce = None
        if stage == 0:
            kind = ("bounced" if slot % 50 == 0 else "deferred" if slot % 50 == 1
                    else "delivered")
            bounce = "permanent" if kind == "bounced" else None
        else:
            kind = "clicked" if stage % 3 == 2 else "opened"
        out.append(Spec(i, f"{tag}-{i:06d}", email_id, pmid, f"user{slot}@example.com", kind,
                        bounce, int(now) - 60 + stage))
    return out


_RESEND_TYPES = {"delivered": "email.delivered", "deferred": "email.delivery_delayed",
                 "bounced": "email.bounced", "opened": "email.opened",
                 "clicked": "email.clicked"}
_SENDGRID_TYPES = {"delivered": "delivered", "deferred": "deferred", "bounced": "bounce",
                   "opened": "open", "clicked": "click"}
_AGENT = "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko)"


def resend_payload(spec: Spec) -> dict[str, Any]:
    """A Resend webhook body, in the shape of Resend's event pages."""
    at = datetime.fromtimestamp(spec.occurred, UTC)
    data: dict[str, Any] = {
        "created_at": (at - timedelta(seconds=5)).isoformat(),
        "email_id": spec.provider_message_id, "from": "Bench <bench@example.com>",
        "to": [spec.recipient], "subject": "Your sign-up", "tags": {"category": "bench"}}
    if spec.event_type == "bounced":
        data["bounce"] = {"type": "Permanent", "subType": "General",
                          "message": "The recipient's mail server permanently rejected it.",
                          "diagnosticCode": ["smtp; 550 5.1.1 user unknown"]}
    elif spec.event_type == "clicked":
        data["click"] = {"ipAddress": "203.0.113.7", "link": "https://example.com/welcome",
                         "timestamp": at.isoformat(), "userAgent": _AGENT}
    return {"type": _RESEND_TYPES[spec.event_type],
            "created_at": at.isoformat().replace("+00:00", "Z"), "data": data}


def sendgrid_event(spec: Spec) -> dict[str, Any]:
    """One event of a SendGrid Event Webhook batch, in the shape of its reference."""
    event: dict[str, Any] = {
        "email": spec.recipient, "timestamp": spec.occurred,
        "smtp-id": f"<{spec.provider_message_id}@ismtpd-555>",
        "event": _SENDGRID_TYPES[spec.event_type], "category": "bench",
        "sg_event_id": spec.event_id,
        "sg_message_id": f"{spec.provider_message_id}.filter0001.16648.5515E0B88.0"}
    if spec.event_type == "delivered":
        event["response"] = "250 OK"
    elif spec.event_type == "deferred":
        event.update(response="400 try again later", attempt="5")
    elif spec.event_type == "bounced":
        event.update(reason="550 5.1.1 unknown recipient", status="5.1.1", type="bounce")
    else:
        event.update(useragent=_AGENT, ip="203.0.113.7")
        if spec.event_type == "clicked":
            event["url"] = "https://example.com/welcome"
    return event


def bare_row(spec: Spec, transport: str, payload: dict[str, Any], received: datetime
             ) -> dict[str, Any]:
    return {"email_id": spec.email_id, "transport": transport,
            "provider_event_id": spec.event_id, "event_type": spec.event_type,
            "bounce_kind": spec.bounce_kind, "recipient": spec.recipient,
            "occurred_at": datetime.fromtimestamp(spec.occurred, UTC).replace(tzinfo=None),
            "received_at": received, "description": "", "mta_response": "",
            "payload": json.dumps(payload, separators=(",", ":"))}


# -- signing, as the providers do ----------------------------------------------------------

@dataclasses.dataclass
class Keys:
    sendgrid_private: Any
    sendgrid_public: str  # base64 DER, as SendGrid shows its verification key
    resend_secret: str  # whsec_...

    @classmethod
    def new(cls) -> Keys:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        private = ec.generate_private_key(ec.SECP256R1())
        der = private.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        return cls(private, base64.b64encode(der).decode("ascii"),
                   "whsec_" + base64.b64encode(os.urandom(24)).decode("ascii"))


Request = tuple[str, dict[str, str], bytes]


def resend_requests(keys: Keys, batch: list[Spec]) -> list[Request]:
    """One Svix-signed POST per event (the event id is the svix-id, as Resend's)."""
    key = base64.b64decode(keys.resend_secret.removeprefix("whsec_"))
    stamp = str(int(time.time()))
    out = []
    for spec in batch:
        body = json.dumps(resend_payload(spec)).encode()
        digest = hmac.new(key, f"{spec.event_id}.{stamp}.".encode() + body,
                          hashlib.sha256).digest()
        out.append((f"{PREFIX}/resend", {
            "content-type": "application/json", "user-agent": "Svix-Webhooks/1.0",
            "svix-id": spec.event_id, "svix-timestamp": stamp,
            "svix-signature": "v1," + base64.b64encode(digest).decode("ascii")}, body))
    return out


def sendgrid_bodies(batch: list[Spec], size: int) -> list[bytes]:
    # A trailing CRLF, as SendGrid's POSTs end: the raw bytes are signed.
    return [json.dumps([sendgrid_event(s) for s in batch[i:i + size]]).encode() + b"\r\n"
            for i in range(0, len(batch), size)]


def sendgrid_requests(keys: Keys, bodies: list[bytes]) -> list[Request]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    stamp = str(int(time.time()))
    out = []
    for body in bodies:
        signature = keys.sendgrid_private.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
        out.append((f"{PREFIX}/sendgrid", {
            "content-type": "application/json",
            "x-twilio-email-event-webhook-signature": base64.b64encode(signature).decode(),
            "x-twilio-email-event-webhook-timestamp": stamp}, body))
    return out


def to_ok_route(requests: list[Request]) -> list[Request]:
    return [(OK_PATH, headers, body) for _, headers, body in requests]


# -- the client ----------------------------------------------------------------------------

@dataclasses.dataclass
class Burst:
    """What one burst of requests got back."""

    seconds: float
    times_ms: list[float]
    statuses: dict[int, int]  # status (0: no answer) -> count
    accepted: int = 0
    duplicates: int = 0
    unmatched: int = 0
    client_cpu: float = 0.0  # this process's CPU seconds over the burst's seconds

    @property
    def non_2xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if not 200 <= status < 300)


async def _burst(port: int, requests: list[Request], connections: int, timeout: float
                 ) -> Burst:
    import httpx

    times: list[float] = []
    statuses: dict[int, int] = {}
    sums = {"accepted": 0, "duplicates": 0, "unmatched": 0}
    pending = iter(requests)

    async def one_connection(client: httpx.AsyncClient) -> None:
        for path, headers, body in pending:
            started = time.perf_counter()
            try:
                response = await client.post(path, content=body, headers=headers)
                status, content = response.status_code, response.content
            except httpx.HTTPError as exc:
                log(f"webhooks: no answer: {type(exc).__name__}: {exc}")
                status, content = 0, b""
            times.append(1000 * (time.perf_counter() - started))
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200 and path != OK_PATH:
                answer = json.loads(content)
                for key in sums:
                    sums[key] += int(answer[key])

    # A client per connection: one pool of many connections costs the client more CPU
    # per request as the connections grow (httpcore scans its pool on every request).
    tls = ssl.create_default_context()  # unused (plain HTTP), made once rather than per client
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout,
                                 verify=tls, limits=httpx.Limits(max_connections=1))
               for _ in range(min(connections, len(requests)))]
    try:
        cpu = _cpu_seconds()
        started = time.perf_counter()
        await asyncio.gather(*[one_connection(client) for client in clients])
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu
    finally:
        for client in clients:
            await client.aclose()
    return Burst(seconds, times, statuses, **sums, client_cpu=cpu / seconds)


def burst(port: int, requests: list[Request], connections: int,
          timeout: float = 300.0) -> Burst:
    return asyncio.run(_burst(port, requests, connections, timeout))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- the database --------------------------------------------------------------------------

def count_events(url: str, transport: str, tag: str) -> tuple[int, int]:
    """(rows of ``transport``, rows whose id starts with ``tag-``) in outbox_event."""
    total, tagged = execute(
        url, "SELECT count(*) FROM outbox_event WHERE transport = :t",
        "SELECT count(*) FROM outbox_event WHERE transport = :t AND provider_event_id LIKE :p",
        params={"t": transport, "p": f"{tag}-%"})
    return int(total[0][0]), int(tagged[0][0])


def bare_insert(url: str, rows: list[dict[str, Any]], per_txn: int) -> float:
    """Seconds to insert ``rows``, ``per_txn`` a transaction, one connection."""
    engine = sa.create_engine(url)
    if engine.dialect.name == "sqlite":
        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute("PRAGMA busy_timeout=30000")  # WAL: the file already is
    try:
        with engine.connect() as conn:
            started = time.perf_counter()
            for start in range(0, len(rows), per_txn):
                with conn.begin():
                    conn.execute(BARE.insert(), rows[start:start + per_txn])
            return time.perf_counter() - started
    finally:
        engine.dispose()


def seed(url: str, n: int) -> list[int]:
    """``n`` queued emails with a provider_message_id ``pm-<id>``; their ids."""
    # No email is delivered here: MAIL_PORT is a port nothing listens on.
    bench = build(url, free_port(), OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                  OUTBOX_RUN_SCHEDULER=False, OUTBOX_LISTEN=False)
    try:
        bench.enqueue(n, "webhooks", batch=500)
    finally:
        bench.stop()
    engine = sa.create_engine(url)
    try:
        BARE.create(engine, checkfirst=True)
    finally:
        engine.dispose()
    ids = execute(url, "UPDATE outbox_email SET provider_message_id = 'pm-' || id",
                  "SELECT id FROM outbox_email ORDER BY id")[1]
    return [int(row[0]) for row in ids]


# -- the server ----------------------------------------------------------------------------

def serve() -> Any:
    """What gunicorn loads: the bench app with its webhooks, and a trivial route beside them."""
    from flask import jsonify, request

    from .bench_app import from_env

    app = from_env().app

    @app.post(OK_PATH)
    def ok() -> Any:
        request.get_data()
        return jsonify(accepted=0, duplicates=0, unmatched=0)

    @app.get(READY_PATH)
    def ready() -> str:
        return str(os.getpid())

    return app


def start_server(ctx: Context, url: str, keys: Keys, args: argparse.Namespace,
                 backend: str) -> tuple[Any, int]:
    import httpx

    port = free_port()
    config = {"OUTBOX_DURABLE": True, "OUTBOX_RUN_WORKER": False,
              "OUTBOX_RUN_SCHEDULER": False, "OUTBOX_LISTEN": False,
              "OUTBOX_TRANSPORTS": {
                  "sendgrid": {"transport": "sendgrid", "api_key": "SG.bench",
                               "webhook_secret": keys.sendgrid_public},
                  "resend": {"transport": "resend", "api_key": "re_bench",
                             "webhook_secret": keys.resend_secret}}}
    server = ctx.spawn([sys.executable, "-m", "gunicorn", "-w", str(args.workers),
                        "--threads", str(args.threads), "-b", f"127.0.0.1:{port}",
                        "--no-control-socket", "--timeout", "300", "--graceful-timeout", "10",
                        "benchmarks.webhooks:serve()"],
                       env=bench_env(url, free_port(), config), name=f"webhooks-{backend}")
    wait_port(port, 60, [server])
    deadline = time.monotonic() + 60
    while httpx.get(f"http://127.0.0.1:{port}{READY_PATH}", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"gunicorn did not get ready:\n{tail(server)}")
        time.sleep(0.1)
    return server, port


# -- the scenario --------------------------------------------------------------------------

@dataclasses.dataclass
class Phase:
    """One burst kind: its rounds' bursts, the ok route's, the bare inserts' seconds."""

    name: str
    transport: str
    per_post: int
    hooks: list[Burst] = dataclasses.field(default_factory=list)
    oks: list[Burst] = dataclasses.field(default_factory=list)
    bare: list[float] = dataclasses.field(default_factory=list)
    rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (new, tagged)


def run(ctx: Context, args: argparse.Namespace) -> Report:
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    keys = Keys.new()
    table = Table(
        f"Webhook bursts of {args.events:,} events, gunicorn -w {args.workers} --threads "
        f"{args.threads}, {args.connections} client connections; median of {args.rounds} "
        "rounds (events/s; response times in ms)",
        ["database", "phase", "POSTs", "events/s", "p50", "p95", "max", "non-2xx",
         "rows new", "client CPU", "ok route ev/s", "/ ok route", "bare ev/s", "/ bare"])
    replay_table = Table(
        f"Batches of {max(sizes)} events posted one at a time: {args.replays} new ones, then "
        "each again (signed anew, as SendGrid signs a retry): every event a duplicate, "
        "nothing written (ms)",
        ["database", "first p50", "replay p50", "replay max", "replay / first",
         "duplicates acked", "rows new", "non-2xx"])
    report = Report(NAME, tables=[table, replay_table])
    failures: list[str] = []
    for backend, url in ctx.databases(args.backends, NAME):
        log(f"webhooks {backend}: seeding {args.emails} emails")
        email_ids = seed(url, args.emails)
        server, port = start_server(ctx, url, keys, args, backend)
        try:
            _warm(port, keys, email_ids, args.connections)
            phases = [Phase("resend single", "resend", 1)] + [
                Phase(f"sendgrid {size}/POST", "sendgrid", size) for size in sizes]
            for rnd in range(args.rounds):
                for number, phase in enumerate(phases):
                    tag = f"r{rnd}p{number}"
                    batch = specs(tag, args.events, email_ids, time.time())
                    if phase.transport == "resend":
                        payloads = [resend_payload(s) for s in batch]
                        ok_requests = to_ok_route(resend_requests(keys, batch))
                    else:
                        payloads = [sendgrid_event(s) for s in batch]
                        bodies = sendgrid_bodies(batch, phase.per_post)
                        ok_requests = [(OK_PATH, {"content-type": "application/json"}, b)
                                       for b in bodies]
                    phase.oks.append(burst(port, ok_requests, args.connections))
                    before, _ = count_events(url, phase.transport, tag)
                    requests = (resend_requests(keys, batch) if phase.transport == "resend"
                                else sendgrid_requests(keys, bodies))
                    hooks = burst(port, requests, args.connections)
                    phase.hooks.append(hooks)
                    after, tagged = count_events(url, phase.transport, tag)
                    phase.rows.append((after - before, tagged))
                    received = datetime.now(UTC).replace(tzinfo=None)
                    rows = [bare_row(s, f"{phase.transport}-{tag}", p, received)
                            for s, p in zip(batch, payloads, strict=True)]
                    phase.bare.append(bare_insert(url, rows, phase.per_post))
                    log(f"webhooks {backend} round {rnd + 1} {phase.name}: "
                        f"{args.events / hooks.seconds:,.0f} events/s "
                        f"(ok route {args.events / phase.oks[-1].seconds:,.0f}, bare "
                        f"{args.events / phase.bare[-1]:,.0f}), p95 "
                        f"{percentile(hooks.times_ms, 95):.0f} ms, statuses {hooks.statuses}, "
                        f"{after - before} rows new, responses: {hooks.accepted} accepted "
                        f"{hooks.duplicates} duplicates {hooks.unmatched} unmatched")
            for phase in phases:
                failures += _add_phase(report, table, backend, phase, args.events)
            failures += _replay(report, replay_table, backend, url, port, keys, email_ids,
                                max(sizes), args.replays)
        finally:
            code = stop_process(server)
            log(f"webhooks {backend}: gunicorn exited with {code}")
        errors = [line for line in _server_log(server) if "Could not store" in line
                  or "Traceback" in line]
        if errors:
            failures.append(f"{backend}: the server logged {len(errors)} error(s), first: "
                            f"{errors[0][:200]}")
    report.notes += [
        ("events/s: the burst's events over the wall time from its first request to its last "
         "response; p50/p95/max: each request's time from sending to its whole answer"),
        ("ok route: the same requests to a route of the same app that reads the body and "
         "answers 200 (gunicorn, Flask and the client: the ceiling here); bare: the same rows, "
         "as many per transaction as per POST, by plain SQLAlchemy on one connection into a "
         "copy of outbox_event with its unique key and indexes"),
        ("rows new: outbox_event rows of the transport counted before and after each burst "
         "(each round's count, all of them carrying the burst's own ids)"),
        ("client CPU: this process's CPU time over the webhook burst's wall time (1.0 = one "
         "core): the client (one asyncio loop, an httpx client per connection) runs on the "
         "same cores as gunicorn and the database, and takes that share from them"),
    ]
    report.notes += [f"FAILED: {f}" for f in failures]
    return report


def _warm(port: int, keys: Keys, email_ids: list[int], connections: int) -> None:
    """Every worker thread's first requests: imports, pools, the receivers' keys."""
    batch = specs("warm", 4 * connections, email_ids, time.time())
    burst(port, to_ok_route(resend_requests(keys, batch)), connections)
    burst(port, resend_requests(keys, batch[:2 * connections]), connections)
    burst(port, sendgrid_requests(keys, sendgrid_bodies(batch[2 * connections:], 8)),
          connections)


def _add_phase(report: Report, table: Table, backend: str, phase: Phase, events: int
               ) -> list[str]:
    rate = median(events / b.seconds for b in phase.hooks)
    ok_rate = median(events / b.seconds for b in phase.oks)
    bare_rate = median(events / s for s in phase.bare)
    versus_ok = median(o.seconds / h.seconds for h, o in zip(phase.hooks, phase.oks,
                                                             strict=True))
    versus_bare = median(s / h.seconds for h, s in zip(phase.hooks, phase.bare, strict=True))
    p50 = median(percentile(b.times_ms, 50) for b in phase.hooks)
    p95 = median(percentile(b.times_ms, 95) for b in phase.hooks)
    worst = max(max(b.times_ms) for b in phase.hooks)
    non_2xx = sum(b.non_2xx for b in phase.hooks)
    new_rows = sorted({new for new, _ in phase.rows})
    failures = []
    if non_2xx:
        statuses: dict[int, int] = {}
        for b in phase.hooks:
            for status, n in b.statuses.items():
                if not 200 <= status < 300:
                    statuses[status] = statuses.get(status, 0) + n
        failures.append(f"{backend} {phase.name}: {non_2xx} non-2xx answers {statuses}")
    bad_rows = [r for r in phase.rows if r != (events, events)]
    if bad_rows:
        failures.append(f"{backend} {phase.name}: rows (new, tagged) per round {phase.rows}, "
                        f"expected {events} each")
    bad_answers = [b.accepted for b in phase.hooks if b.accepted != events]
    if bad_answers:
        failures.append(f"{backend} {phase.name}: the responses accepted {bad_answers}, "
                        f"expected {events}")
    posts = len(phase.hooks[0].times_ms)
    client_cpu = median(b.client_cpu for b in phase.hooks)
    table.add(backend, phase.name, posts, rate, p50, p95, worst, non_2xx,
              "/".join(str(n) for n in new_rows),
              f"{client_cpu:.0%}" if client_cpu is not None else None,
              ok_rate, versus_ok, bare_rate, versus_bare)
    good = not failures
    key = f"{backend} {phase.name}"
    report.figures[f"{key} events/s"] = rate if good else None
    report.figures[f"{key} p95 ms"] = p95 if good else None
    report.figures[f"{key} / ok route"] = versus_ok if good else None
    report.figures[f"{key} / bare"] = versus_bare if good else None
    report.figures[f"{key} non-2xx"] = float(non_2xx)
    return failures


def _replay(report: Report, table: Table, backend: str, url: str, port: int, keys: Keys,
            email_ids: list[int], size: int, replays: int) -> list[str]:
    """``replays`` new batches posted one at a time, then each of them again."""
    fresh_specs = specs("fresh", size * replays, email_ids, time.time())
    bodies = sendgrid_bodies(fresh_specs, size)
    # One at a time, each signed when it is sent (the timestamp is checked).
    fresh = [burst(port, sendgrid_requests(keys, [body]), 1) for body in bodies]
    before, _ = count_events(url, "sendgrid", "fresh")
    again = [burst(port, sendgrid_requests(keys, [body]), 1) for body in bodies]
    after, _ = count_events(url, "sendgrid", "fresh")
    first_p50 = percentile([t for b in fresh for t in b.times_ms], 50)
    times = [t for b in again for t in b.times_ms]
    duplicates = sum(b.duplicates for b in again)
    non_2xx = sum(b.non_2xx for b in fresh + again)
    replay_p50 = percentile(times, 50)
    versus = replay_p50 / first_p50 if replay_p50 and first_p50 else None
    table.add(backend, first_p50, replay_p50, max(times), versus,
              f"{duplicates} of {size * replays}", after - before, non_2xx)
    failures = []
    if duplicates != size * replays or after != before or non_2xx \
            or any(b.accepted for b in again) \
            or sum(b.accepted for b in fresh) != size * replays:
        failures.append(f"{backend} replay: {duplicates} duplicates of {size * replays}, "
                        f"{after - before} rows new, {non_2xx} non-2xx")
    report.figures[f"{backend} replay {size} p50 ms"] = replay_p50 if not failures else None
    report.figures[f"{backend} replay / first"] = versus if not failures else None
    return failures


def _server_log(proc: Any) -> list[str]:
    try:
        with open(proc.log_path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []
