"""OpenTelemetry tracing (OUTBOX_OTEL): the trace context travels with the row.

Real parts: the SDK's TracerProvider with its InMemorySpanExporter, the real
SMTP test server, SQLite (inline delivery) and PostgreSQL (a durable dispatcher).
The provider is handed to the app (``"tracer_provider"``), so nothing here sets
the process-wide one that other tests would see.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import otel_worker_app
import pytest
import sqlalchemy as sa
from conftest import (
    close_app,
    db,
    empty_postgres,
    hand_ticked_worker,
    make_app,
    poll,
    require_postgres,
    rows,
    wait_rows,
)
from flask import Flask
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from provider_postmark import TOKEN as POSTMARK_TOKEN
from provider_postmark import (
    WEBHOOK_SECRET,
    FakePostmark,
    delivery_record,
    webhook_request,
)
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox._tracing import settings_from

Traced = tuple[TracerProvider, InMemorySpanExporter]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def traced() -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _app(db_url: str, smtp_server: FaultSMTPServer, otel: dict[str, Any] | None,
         **config: Any) -> Flask:
    config.setdefault("OUTBOX_DURABLE", db_url.startswith("postgresql"))
    if otel is not None:
        config["OUTBOX_OTEL"] = otel
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_RETRY_BASE_SECONDS=0.05,
                   OUTBOX_RETRY_MAX_SECONDS=0.2, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_POLL_MAX_INTERVAL=0.2, **config)
    mail: OutboxMail = app.extensions["test_mail"]
    request_tracer = trace.get_tracer("test") if otel is None or "tracer_provider" not in otel \
        else otel["tracer_provider"].get_tracer("test")

    @app.post("/signup")
    def signup() -> str:
        # What the Flask instrumentation would open: the request's SERVER span.
        with request_tracer.start_as_current_span("POST /signup", kind=SpanKind.SERVER):
            mail.send(Message("Welcome", recipients=["ann@example.com"], body="hi"),
                      key="account-7")
            mail.send_many([Message(f"Tip {i}", recipients=[f"bob{i}@example.org"],
                                    body="tip") for i in (1, 2)])
            db.session.commit()
        return "ok"

    return app


def _spans(exporter: InMemorySpanExporter, kind: SpanKind) -> list[ReadableSpan]:
    return sorted((s for s in exporter.get_finished_spans() if s.kind is kind),
                  key=lambda s: (int((s.attributes or {})["messaging.message.id"]),
                                 s.start_time or 0))


def _consumers(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The CONSUMER spans once there are ``count`` (each is ended just after its record)."""
    return poll(lambda: _spans(exporter, SpanKind.CONSUMER), lambda s: len(s) >= count,
                timeout=10)


def _traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _no_address(spans: list[ReadableSpan]) -> None:
    """No attribute of the spans or of their events (a recorded exception's message
    and stack trace) holds an address."""
    for span in spans:
        for name, value in (span.attributes or {}).items():
            assert "@" not in str(value), (span.name, name, value)
        for event in span.events:
            for name, value in (event.attributes or {}).items():
                assert "@" not in str(value), (span.name, event.name, name, value)


def test_a_request_that_sends_three_emails_is_one_trace_and_each_delivery_links_to_it(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    app = _app(db_url, smtp_server, {"tracer_provider": provider})
    try:
        assert app.test_client().post("/signup").status_code == 200
        assert smtp_server.wait_for(3, timeout=20)
        stored = wait_rows(app, lambda r: all(row["status"] == "sent" for row in r), 20.0)
        consumers = _consumers(exporter, 3)
    finally:
        close_app(app)
    [request] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    producers = _spans(exporter, SpanKind.PRODUCER)
    ids = [row["id"] for row in stored]
    assert [row["status"] for row in stored] == ["sent"] * 3
    # The producers: children of the request, one per email, its context on the row.
    assert [(p.name, p.parent and p.parent.span_id) for p in producers] == [
        ("send default", request.context.span_id),
        ("create default", request.context.span_id),
        ("create default", request.context.span_id)]
    assert {p.context.trace_id for p in producers} == {request.context.trace_id}
    assert [dict(p.attributes or {}) for p in producers] == [
        {"messaging.system": "flask-mail-outbox", "messaging.operation.name": "send",
         "messaging.operation.type": "send", "messaging.destination.name": "default",
         "messaging.message.conversation_id": "account-7",
         "messaging.message.id": str(ids[0])},
        *({"messaging.system": "flask-mail-outbox", "messaging.operation.name": "create",
           "messaging.operation.type": "create", "messaging.destination.name": "default",
           "messaging.message.id": str(email_id)} for email_id in ids[1:])]
    assert [row["traceparent"] for row in stored] == [_traceparent(p) for p in producers]
    assert [row["tracestate"] for row in stored] == [None] * 3
    # The worker's side: claim -> process (one per attempt) -> smtp transaction, record.
    spans = [as_dict(s) for s in exporter.get_finished_spans()]
    check_delivery(spans, {email_id: as_dict(p) for email_id, p in zip(ids, producers,
                                                                        strict=True)},
                   keys={ids[0]: "account-7"}, server=(smtp_server.host, smtp_server.port))
    assert len(consumers) == 3
    for consumer in consumers:
        assert consumer.context.trace_id != request.context.trace_id
        assert consumer.status.is_ok
    _no_address(list(exporter.get_finished_spans()))


def as_dict(span: ReadableSpan) -> dict[str, Any]:
    """A span as tests/otel_worker_app.py writes it (one format for both processes)."""
    return otel_worker_app.span_json(span)


def check_delivery(spans: list[dict[str, Any]], producers: dict[int, dict[str, Any]], *,
                   keys: dict[int, str], server: tuple[str, int],
                   sending: str = "smtp transaction") -> None:
    """The delivery spans of emails each sent at its first attempt, exactly: every claim
    a root CLIENT span linked to the producers of the emails it took; one CONSUMER span
    per email, the child of its claim, linked to its producer, with a ``sending`` child
    (the SMTP transaction); one ``record`` span per record transaction, a child of a
    claim, linked to the CONSUMER spans of the attempts it recorded, between their
    sending and their end."""
    by_id = {s["span_id"]: s for s in spans}
    claims = [s for s in spans if s["name"] == "claim"]
    records = [s for s in spans if s["name"] == "record"]
    consumers = {int(s["attributes"]["messaging.message.id"]): s for s in spans
                 if s["kind"] == "CONSUMER"}
    assert sorted(consumers) == sorted(producers)
    link_of = {email_id: [p["trace_id"], p["span_id"]] for email_id, p in producers.items()}
    assert sorted(link for claim in claims for link in claim["links"]) == sorted(
        link_of.values())
    for claim in claims:
        assert (claim["kind"], claim["parent"]) == ("CLIENT", None)
        assert claim["attributes"] == {
            "messaging.system": "flask-mail-outbox", "messaging.operation.name": "claim",
            "messaging.operation.type": "receive", "messaging.destination.name": "default",
            "messaging.batch.message_count": len(claim["links"])}
        assert claim["start"] < claim["end"]  # the claim statement itself, timed
    for email_id, consumer in consumers.items():
        claim = by_id[consumer["parent"]]
        assert claim["name"] == "claim" and link_of[email_id] in claim["links"]
        assert consumer["trace_id"] == claim["trace_id"] != producers[email_id]["trace_id"]
        assert consumer["name"] == "process default"
        assert consumer["links"] == [link_of[email_id]]
        expected: dict[str, Any] = {
            "messaging.system": "flask-mail-outbox", "messaging.operation.name": "process",
            "messaging.operation.type": "process", "messaging.destination.name": "default",
            "messaging.message.id": str(email_id), "flask_mail_outbox.attempt": 1,
            "flask_mail_outbox.outcome": "sent", "server.address": server[0],
            "server.port": server[1]}
        if email_id in keys:
            expected["messaging.message.conversation_id"] = keys[email_id]
        assert consumer["attributes"] == expected
        children = [s for s in spans if s["parent"] == consumer["span_id"]]
        assert [(s["name"], s["kind"]) for s in children] == [(sending, "CLIENT")]
        [sent] = children
        # Delivered: what its CONSUMER parent says (outcome "sent") is not said again.
        assert sent["attributes"] == {"server.address": server[0], "server.port": server[1]}
        [record] = [s for s in records if [consumer["trace_id"], consumer["span_id"]]
                    in s["links"]]
        assert claim["end"] <= consumer["start"] <= sent["start"] <= sent["end"] \
            <= record["start"] <= record["end"] <= consumer["end"]
    assert sorted(link for record in records for link in record["links"]) == sorted(
        [c["trace_id"], c["span_id"]] for c in consumers.values())
    for record in records:
        assert (record["kind"], by_id[record["parent"]]["name"]) == ("INTERNAL", "claim")
        assert record["attributes"] == {
            "messaging.system": "flask-mail-outbox", "messaging.operation.name": "record",
            "messaging.operation.type": "settle", "messaging.destination.name": "default",
            "messaging.batch.message_count": len(record["links"])}
    requests = {p["trace_id"] for p in producers.values()}
    assert len([s for s in spans if s["trace_id"] not in requests]) == \
        len(claims) + 2 * len(consumers) + len(records)


def test_a_retry_is_two_consumer_spans_linked_to_one_producer(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    smtp_server.reply("data", 451, "4.7.1 Greylisted, try again", times=1)
    app = _app(db_url, smtp_server, {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Reset", recipients=["ann@example.com"], body="link"))
            db.session.commit()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        consumers = _consumers(exporter, 2)
    finally:
        close_app(app)
    [producer] = _spans(exporter, SpanKind.PRODUCER)
    assert row["attempts"] == 2
    assert [((c.attributes or {})["flask_mail_outbox.attempt"],
             (c.attributes or {})["flask_mail_outbox.outcome"],
             (c.attributes or {}).get("flask_mail_outbox.reply_code"),
             [link.context.span_id for link in c.links]) for c in consumers] == [
        (1, "queued", 451, [producer.context.span_id]),
        (2, "sent", None, [producer.context.span_id])]
    _no_address([producer, *consumers])


def test_child_of_makes_the_delivery_part_of_the_request_trace_and_domains_are_opt_in(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    app = _app(db_url, smtp_server, {"tracer_provider": provider, "link": "child",
                                     "recipient_domain": True})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Reset", recipients=["ann@Example.com", "bob@example.org"],
                              body="link"))
            db.session.commit()
        wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        consumers = _consumers(exporter, 1)
    finally:
        close_app(app)
    [producer] = _spans(exporter, SpanKind.PRODUCER)
    [consumer] = consumers
    assert consumer.parent is not None
    assert (consumer.parent.span_id, consumer.context.trace_id) == (
        producer.context.span_id, producer.context.trace_id)
    # Its claim is in the worker's own trace, a link away.
    [claim] = [s for s in exporter.get_finished_spans() if s.name == "claim"]
    assert claim.parent is None and claim.context.trace_id != producer.context.trace_id
    assert [link.context.span_id for link in consumer.links] == [claim.context.span_id]
    assert [link.context.span_id for link in claim.links] == [producer.context.span_id]
    assert (consumer.attributes or {})["flask_mail_outbox.recipient_domains"] == (
        "example.com", "example.org")
    _no_address([producer, consumer])


def test_tracing_off_writes_null_and_makes_no_span(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    # "auto" with no tracer provider set (the API's default): off. Then off by hand
    # even with a provider.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    for rounds, otel in enumerate((None, {"enabled": False, "tracer_provider": provider}), 1):
        app = _app(db_url, smtp_server, otel)
        try:
            assert app.test_client().post("/signup").status_code == 200
            stored = wait_rows(app, lambda r: all(row["status"] == "sent" for row in r), 20.0)
        finally:
            close_app(app)
        # The same database each round: three more rows.
        assert [(row["status"], row["traceparent"], row["tracestate"]) for row in stored] == [
            ("sent", None, None)] * 3 * rounds
        assert [s for s in exporter.get_finished_spans() if s.kind is not SpanKind.SERVER] == []
        smtp_server.clear()


def test_tracing_adds_no_statement_to_the_delivery(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    """One dispatcher tick delivering three emails runs the same SQL statements with
    tracing off, on "auto" with no provider, and on with the SDK: the claim reads the
    trace contexts, so tracing has no query of its own."""
    provider, exporter = traced
    executed: dict[str, list[str]] = {}
    for name, otel in (("off", {"enabled": False}), ("none", None),
                       ("sdk", {"tracer_provider": provider})):
        app = _app(db_url, smtp_server, otel, OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                   OUTBOX_LISTEN=False, OUTBOX_INLINE_RETRIES=0)
        mail: OutboxMail = app.extensions["test_mail"]
        statements = executed[name] = []

        def note(_conn: Any, _cursor: Any, statement: str, *_: Any,
                 statements: list[str] = statements) -> None:
            statements.append(" ".join(statement.split()))

        try:
            with app.app_context():
                mail.send_many([Message(f"Tip {i}", recipients=[f"bob{i}@example.org"],
                                        body="tip") for i in range(3)])
                db.session.commit()
                engine = mail._state().outbox().store.engine
            worker = hand_ticked_worker(app)
            sa.event.listen(engine, "before_cursor_execute", note)
            try:
                worker.tick()
                wait_rows(app, lambda r: all(row["status"] == "sent" for row in r), 20.0)
            finally:
                sa.event.remove(engine, "before_cursor_execute", note)
        finally:
            close_app(app)
        assert smtp_server.wait_for(3, timeout=10)
        smtp_server.clear()
    assert executed["off"], "no statement seen"
    assert executed["none"] == executed["off"]
    assert executed["sdk"] == executed["off"]
    assert len(_spans(exporter, SpanKind.CONSUMER)) == 3  # the sdk round was traced


_NOTHING_IMPORTED = """
import json, sys
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_mail_outbox import Message, OutboxMail

app = Flask("plain")
app.config.update(SQLALCHEMY_DATABASE_URI=sys.argv[1], MAIL_SERVER="127.0.0.1",
                  MAIL_PORT=int(sys.argv[2]), MAIL_SUPPRESS_SEND=False,
                  MAIL_DEFAULT_SENDER="Sender <sender@example.com>")
db = SQLAlchemy(app)
mail = OutboxMail(app)
with app.app_context():
    mail.create_all()
    mail.send(Message("Welcome", recipients=["ann@example.com"], body="hi"))
    mail.send_many([Message("Tip", recipients=["bob@example.org"], body="tip")])
    db.session.commit()
    mail.wait_idle(timeout=20)
    status = [row[0] for row in db.session.execute(
        db.text("SELECT status FROM outbox_email ORDER BY id"))]
print(json.dumps({"status": status, "loaded": sorted(
    m for m in sys.modules if m.partition(".")[0] == "opentelemetry")}))
"""


def test_with_no_provider_set_sending_and_delivering_import_nothing_of_opentelemetry(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    """OpenTelemetry installed (here it is) but not used by the app: "auto" leaves it
    unimported through send(), the claim, the SMTP transaction and the record."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLASK_APP",)}
    env["PYTHONPATH"] = str(TESTS.parent)
    child = subprocess.run(
        [sys.executable, "-c", _NOTHING_IMPORTED, f"sqlite:///{tmp_path / 'plain.db'}",
         str(smtp_server.port)], capture_output=True, text=True, timeout=120, check=False,
        cwd=tmp_path, env=env)
    assert child.returncode == 0, child.stderr[-6000:]
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["status"] == ["sent", "sent"]
    assert report["loaded"] == []
    assert smtp_server.wait_for(2, timeout=10)


@pytest.mark.parametrize(("value", "message"), [
    ("on", "expected a dict"),
    ({"enabled": "yes"}, "'enabled' must be True, False or 'auto', got 'yes'"),
    ({"enabled": 1}, "'enabled' must be True, False or 'auto', got 1"),
    ({"link": "parent"}, "'link' must be 'link' or 'child', got 'parent'"),
    ({"recipient_domain": "yes"}, "'recipient_domain' must be True or False"),
    ({"tracer_provider": object()}, "'tracer_provider' must be an OpenTelemetry"),
    ({"sampler": 1}, "unknown key 'sampler'"),
    ({"metrics": "yes"}, "'metrics' must be True, False or 'auto', got 'yes'"),
    ({"meter_provider": object()}, "'meter_provider' must be an OpenTelemetry"),
])
def test_bad_values_name_the_key(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="OUTBOX_OTEL") as caught:
        settings_from(value)
    assert message in str(caught.value)


def test_a_worker_process_reads_the_context_back_from_the_row(
        tmp_path: Path, pg_database: str | None, smtp_server: FaultSMTPServer,
        traced: Traced) -> None:
    """The request in this process, the delivery in a ``flask outbox worker`` process
    whose app set the SDK's global provider (OUTBOX_OTEL left at "auto")."""
    db_url = empty_postgres(pg_database or require_postgres())
    provider, exporter = traced
    app = _app(db_url, smtp_server, {"tracer_provider": provider}, OUTBOX_RUN_WORKER=False)
    spans_file = tmp_path / "worker-spans.jsonl"
    worker = None
    try:
        assert app.test_client().post("/signup").status_code == 200
        assert [row["status"] for row in rows(app)] == ["queued"] * 3
        env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{TESTS.parent}",
                   OTEL_TEST_DB_URL=db_url, OTEL_TEST_SMTP_PORT=str(smtp_server.port),
                   OTEL_TEST_SPANS=str(spans_file))
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "flask", "--app", "otel_worker_app:create_app",
                 "outbox", "worker"], env=env, cwd=str(TESTS), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT)

        def spans() -> list[dict[str, Any]]:
            if not spans_file.exists():
                return []
            return [json.loads(line) for line in spans_file.read_text().splitlines()]

        # Each CONSUMER span ends after its record: all three ended, the rest has too.
        found = poll(spans, lambda found: sum(s["kind"] == "CONSUMER" for s in found) == 3,
                     timeout=30)
        stored = rows(app)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        close_app(app)
    assert sum(s["kind"] == "CONSUMER" for s in found) == 3, \
        (tmp_path / "worker.log").read_text()
    producers = _spans(exporter, SpanKind.PRODUCER)
    assert [row["status"] for row in stored] == ["sent"] * 3
    ids = [row["id"] for row in stored]
    # The context read back from each row: the worker's spans link to this process's.
    check_delivery(found, {email_id: as_dict(p) for email_id, p in zip(ids, producers,
                                                                        strict=True)},
                   keys={ids[0]: "account-7"}, server=("127.0.0.1", smtp_server.port))
    assert not [s for s in found if "@" in json.dumps(s["attributes"])]


def test_a_delivery_run_inside_another_span_still_opens_a_trace_of_its_own(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    app = _app(db_url, smtp_server, {"tracer_provider": provider}, OUTBOX_DURABLE=True,
               OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Reset", recipients=["ann@example.com"], body="link"))
            db.session.commit()
        worker = hand_ticked_worker(app)
        # A job runner's span, current in the thread that ticks the dispatcher.
        with provider.get_tracer("test").start_as_current_span("job") as job:
            worker.tick()
            wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
    finally:
        close_app(app)
    [producer] = _spans(exporter, SpanKind.PRODUCER)
    [consumer] = _spans(exporter, SpanKind.CONSUMER)
    [claim] = [s for s in exporter.get_finished_spans() if s.name == "claim"]
    assert claim.parent is None
    assert consumer.parent is not None and consumer.parent.span_id == claim.context.span_id
    assert consumer.context.trace_id != job.get_span_context().trace_id
    assert [link.context.span_id for link in consumer.links] == [producer.context.span_id]


def test_a_send_whose_insert_fails_ends_its_producer_span_in_error(
        tmp_path: Path, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    app = _app(f"sqlite:///{tmp_path / 'gone.db'}", smtp_server, {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            with db.engine.begin() as conn:
                conn.exec_driver_sql("DROP TABLE outbox_email")
            with pytest.raises(Exception, match="outbox_email"):
                mail.send(Message("Reset", recipients=["ann@example.com"], body="link"))
            db.session.rollback()
    finally:
        close_app(app)
    [producer] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    assert producer.status.status_code is trace.StatusCode.ERROR
    assert "messaging.message.id" not in (producer.attributes or {})
    assert [event.name for event in producer.events] == ["exception"]
    _no_address([producer])


def test_a_failed_insert_puts_neither_its_parameters_nor_its_message_on_the_span(
        tmp_path: Path, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    """SQLAlchemy's error of a failed INSERT lists its parameters (the recipients, the
    subject, the message): the span names the error's type only."""
    provider, exporter = traced
    app = _app(f"sqlite:///{tmp_path / 'refusing.db'}", smtp_server,
               {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            with db.engine.begin() as conn:
                conn.exec_driver_sql("CREATE TRIGGER refuse BEFORE INSERT ON outbox_email "
                                     "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END")
            with pytest.raises(sa.exc.IntegrityError, match="ann@example.com"):
                mail.send(Message("Reset", recipients=["ann@example.com"], body="link"))
            db.session.rollback()
    finally:
        close_app(app)
    [producer] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    assert producer.status.status_code is trace.StatusCode.ERROR
    assert [(event.name, dict(event.attributes or {})) for event in producer.events] == [
        ("exception", {"exception.type": "sqlalchemy.exc.IntegrityError"})]
    _no_address([producer])


class _FailingProcessor(SpanProcessor):
    """An app's span processor whose exporter is down: it raises on every ended span."""

    def on_end(self, span: ReadableSpan) -> None:
        if span.kind is SpanKind.CONSUMER:
            raise RuntimeError("the collector is down")


def test_a_failing_span_processor_never_stops_delivery(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced,
        caplog: pytest.LogCaptureFixture) -> None:
    provider, _ = traced
    provider.add_span_processor(_FailingProcessor())
    app = _app(db_url, smtp_server, {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            first = mail.send(Message("One", recipients=["ann@example.com"], body="1"))
            db.session.commit()
            wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
            second = mail.send(Message("Two", recipients=["ann@example.com"], body="2"))
            db.session.commit()
        stored = wait_rows(app, lambda r: [row["status"] for row in r] == ["sent"] * 2, 20.0)
        errors = poll(lambda: [r.getMessage() for r in caplog.records
                               if r.levelno >= logging.ERROR], lambda e: len(e) >= 2, timeout=10)
    finally:
        close_app(app)
    assert [row["id"] for row in stored] == [first, second]
    assert errors == [
        f"Could not trace 1 delivery attempt(s) (emails {email_id}). Consequence: their "
        "delivery spans are missing or incomplete; their outcomes are recorded and delivery "
        "goes on. Fix: check the database connection and the app's OpenTelemetry span "
        "processors and exporters (the traceback below names the failing one)."
        for email_id in (first, second)]


class _FailingProducerProcessor(SpanProcessor):
    """An app's span processor that raises on the PRODUCER spans, at their start or end."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.phase == "start" and span.kind is SpanKind.PRODUCER:
            raise RuntimeError("the processor is broken")

    def on_end(self, span: ReadableSpan) -> None:
        if self.phase == "end" and span.kind is SpanKind.PRODUCER:
            raise RuntimeError("the processor is broken")


@pytest.mark.parametrize("phase", ["start", "end"])
def test_a_failing_span_processor_never_stops_send(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced,
        caplog: pytest.LogCaptureFixture, phase: str) -> None:
    provider, _ = traced
    provider.add_span_processor(_FailingProducerProcessor(phase))
    app = _app(db_url, smtp_server, {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            ids = mail.send_many([Message(f"Tip {i}", recipients=["ann@example.com"],
                                          body="tip") for i in (1, 2)])
            db.session.commit()
        stored = wait_rows(app, lambda r: [row["status"] for row in r] == ["sent"] * 2, 20.0)
    finally:
        close_app(app)
    assert [row["id"] for row in stored] == ids
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    if phase == "start":
        assert [row["traceparent"] for row in stored] == [None, None]
        assert errors == [
            ("Could not open the PRODUCER span of 2 email(s) being queued. Consequence: they "
            "are queued untraced: no span, and their delivery spans link to nothing. Fix: "
            "check the app's OpenTelemetry span processors (the traceback below names the "
            "failing one).")]
    else:
        assert all(row["traceparent"] for row in stored)
        assert errors == [
            ("Could not end the PRODUCER spans of 2 email(s) queued. Consequence: those spans "
            "are missing from the trace; the emails are queued with their trace context and "
            "delivered as usual. Fix: check the app's OpenTelemetry span processors (the "
            "traceback below names the failing one).")]


def test_dkim_signing_is_a_child_span_of_the_attempt_only_when_configured(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    private = subprocess.run(["openssl", "genrsa", "2048"], check=True,
                             capture_output=True).stdout.decode("ascii")
    app = _app(db_url, smtp_server, {"tracer_provider": provider},
               OUTBOX_DKIM_DOMAIN="example.com", OUTBOX_DKIM_SELECTOR="s1",
               OUTBOX_DKIM_PRIVATE_KEY=private)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            email_id = mail.send(Message("Signed", recipients=["ann@example.com"], body="x"))
            db.session.commit()
        wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        [consumer] = _consumers(exporter, 1)
    finally:
        close_app(app)
    assert b"DKIM-Signature:" in smtp_server.messages[0].data
    children = sorted((s for s in exporter.get_finished_spans()
                       if s.parent and s.parent.span_id == consumer.context.span_id),
                      key=lambda s: s.start_time or 0)
    assert [(s.name, dict(s.attributes or {})) for s in children] == [
        ("dkim.sign", {"messaging.message.id": str(email_id)}),
        ("smtp transaction", {
            "server.address": smtp_server.host, "server.port": smtp_server.port})]
    # Without DKIM settings (every other test here): no such span.
    assert not [s for s in exporter.get_finished_spans() if s.name == "dkim.sign"
                and s.parent and s.parent.span_id != consumer.context.span_id]


def test_a_batch_api_request_links_all_its_emails_and_a_webhook_event_links_back(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    fake = FakePostmark()
    fake.start()
    fake.inactive.add("bounced@example.com")
    app = _app(db_url, smtp_server, {"tracer_provider": provider}, OUTBOX_DURABLE=True,
               OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False, OUTBOX_INLINE_RETRIES=0,
               OUTBOX_TRANSPORTS={"default": {"transport": "postmark", "base_url": fake.url,
                                              "token": POSTMARK_TOKEN,
                                              "webhook_secret": WEBHOOK_SECRET}})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            ids = mail.send_many([Message(f"Tip {i}", recipients=[to], body="tip")
                                  for i, to in enumerate(["ann@example.com", "bob@example.org",
                                                          "bounced@example.com"])])
            db.session.commit()
        hand_ticked_worker(app).tick()
        stored = wait_rows(app, lambda r: all(row["status"] != "queued" for row in r), 20.0)
        _consumers(exporter, 3)
        # Postmark's Delivery webhook for the second email, in the webhook request's trace.
        headers, body = webhook_request(delivery_record(stored[1]["provider_message_id"],
                                                        "bob@example.org"))
        with provider.get_tracer("test").start_as_current_span(
                "POST /outbox/webhooks/default", kind=SpanKind.SERVER) as webhook:
            response = app.test_client().post("/outbox/webhooks/default", headers=headers,
                                              data=body)
        assert response.status_code == 200
    finally:
        close_app(app)
        fake.stop()
    # What came back: a span in the webhook's trace, linked to the email's producer.
    [event] = [s for s in exporter.get_finished_spans() if s.name == "event delivered"]
    assert (event.parent and event.parent.span_id) == webhook.get_span_context().span_id
    assert [link.context.span_id for link in event.links] == [
        _spans(exporter, SpanKind.PRODUCER)[1].context.span_id]
    assert dict(event.attributes or {}) == {
        "messaging.system": "flask-mail-outbox", "messaging.operation.name": "event",
        "messaging.operation.type": "process", "messaging.destination.name": "default",
        "messaging.message.id": str(ids[1]), "flask_mail_outbox.event_type": "delivered"}
    [request] = fake.sending()
    assert request.path == "/email/batch"
    assert [row["status"] for row in stored] == ["sent", "sent", "failed"]
    producers = _spans(exporter, SpanKind.PRODUCER)
    [claim] = [s for s in exporter.get_finished_spans() if s.name == "claim"]
    [batch] = [s for s in exporter.get_finished_spans() if s.name == "postmark api"]
    assert (batch.kind, batch.parent and batch.parent.span_id) == (
        SpanKind.CLIENT, claim.context.span_id)
    assert [link.context.span_id for link in batch.links] == [
        p.context.span_id for p in producers]
    host, port = fake.url.split("//")[1].split(":")
    assert dict(batch.attributes or {}) == {
        "messaging.system": "flask-mail-outbox", "messaging.operation.name": "send",
        "messaging.operation.type": "send", "messaging.destination.name": "default",
        "messaging.batch.message_count": 3, "server.address": host,
        "server.port": int(port.rstrip("/")), "flask_mail_outbox.outcome": "partial",
        "flask_mail_outbox.reply_code": 422}
    assert batch.status.status_code is trace.StatusCode.ERROR
    consumers = _spans(exporter, SpanKind.CONSUMER)
    assert [((c.attributes or {})["messaging.message.id"],
             (c.attributes or {})["flask_mail_outbox.outcome"],
             (c.attributes or {})["server.address"]) for c in consumers] == [
        (str(ids[0]), "sent", host), (str(ids[1]), "sent", host), (str(ids[2]), "failed", host)]
    _no_address(list(exporter.get_finished_spans()))


def _metrics(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Every metric's points: name -> [(attributes, value or histogram count)]."""
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "flask_mail_outbox"
            for metric in scope.metrics:
                found[metric.name] = sorted(
                    ((dict(point.attributes or {}),
                      getattr(point, "value", None) if hasattr(point, "value")
                      else point.count) for point in metric.data.data_points),
                    key=repr)
    return found


def test_otel_metrics_count_what_the_prometheus_ones_count(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    smtp_server.reply("data", 550, "5.7.1 Refused", times=1)
    app = _app(db_url, smtp_server, {"enabled": False, "meter_provider": meters},
               OUTBOX_MAX_ATTEMPTS=1)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("One", recipients=["ann@example.com"], body="1"))
            db.session.commit()
            wait_rows(app, lambda r: r[0]["status"] == "failed", 20.0)
            mail.send(Message("Two", recipients=["ann@example.com"], body="2"))
            db.session.commit()
        wait_rows(app, lambda r: [row["status"] for row in r] == ["failed", "sent"], 20.0)
        found = poll(lambda: _metrics(reader), lambda m: m.get("outbox.emails.sent"),
                     timeout=10)
    finally:
        close_app(app)
        meters.shutdown()
    assert found == {
        "outbox.emails.queued": [({}, 2)],
        "outbox.emails.sent": [({}, 1)],
        "outbox.emails.failed": [({}, 1)],
        "outbox.email.delivery.duration": [({}, 1)],
        "outbox.queue.depth": [({"outbox.status": "queued"}, 0),
                               ({"outbox.status": "sending"}, 0)],
        "outbox.queue.oldest_due_age": [({}, 0.0)],
        "outbox.transport.paused": [({"outbox.pause.kind": "", "outbox.transport": "default"},
                                     0)],
    }


def test_otel_metrics_are_off_without_a_meter_provider(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    app = _app(db_url, smtp_server, {"metrics": False, "meter_provider": meters})
    try:
        assert app.test_client().post("/signup").status_code == 200
        wait_rows(app, lambda r: all(row["status"] == "sent" for row in r), 20.0)
    finally:
        close_app(app)
    assert _metrics(reader) == {}
    meters.shutdown()


_AUTO_METRICS = """
import json, sys
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))  # before init_app

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_mail_outbox import Message, OutboxMail

app = Flask("metered")
app.config.update(SQLALCHEMY_DATABASE_URI=sys.argv[1], MAIL_SERVER="127.0.0.1",
                  MAIL_PORT=int(sys.argv[2]), MAIL_SUPPRESS_SEND=False,
                  MAIL_DEFAULT_SENDER="Sender <sender@example.com>")
db = SQLAlchemy(app)
mail = OutboxMail(app)
with app.app_context():
    mail.create_all()
    mail.send(Message("Welcome", recipients=["ann@example.com"], body="hi"))
    db.session.commit()
    mail.wait_idle(timeout=20)
found = {}
for resource in reader.get_metrics_data().resource_metrics:
    for scope in resource.scope_metrics:
        for metric in scope.metrics:
            found[metric.name] = sum(getattr(p, "value", 0) or getattr(p, "count", 0)
                                     for p in metric.data.data_points)
print(json.dumps(found))
"""


def test_otel_metrics_auto_are_on_when_the_app_set_a_meter_provider_before_init_app(
        tmp_path: Path, smtp_server: FaultSMTPServer) -> None:
    """OUTBOX_OTEL left at its default: the global meter provider an app sets (as
    ``opentelemetry-instrument`` does) turns the metrics on; the other half of "auto"
    (no provider: nothing imported) is
    test_with_no_provider_set_sending_and_delivering_import_nothing_of_opentelemetry."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLASK_APP",)}
    env["PYTHONPATH"] = str(TESTS.parent)
    child = subprocess.run(
        [sys.executable, "-c", _AUTO_METRICS, f"sqlite:///{tmp_path / 'metered.db'}",
         str(smtp_server.port)], capture_output=True, text=True, timeout=120, check=False,
        cwd=tmp_path, env=env)
    assert child.returncode == 0, child.stderr[-6000:]
    found = json.loads(child.stdout.splitlines()[-1])
    assert (found.get("outbox.emails.queued"), found.get("outbox.emails.sent"),
            found.get("outbox.email.delivery.duration")) == (1, 1, 1), found
    assert {"outbox.queue.depth", "outbox.queue.oldest_due_age"} <= set(found), found


class _FailingOn(SpanProcessor):
    """An app's span processor that raises when a span of one of ``names`` ends."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def on_end(self, span: ReadableSpan) -> None:
        if span.name in self.names:
            raise RuntimeError("the collector is down")


def test_a_failing_span_processor_on_the_transaction_or_dkim_span_never_stops_sending(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced,
        caplog: pytest.LogCaptureFixture) -> None:
    provider, exporter = traced
    provider.add_span_processor(_FailingOn("smtp transaction", "dkim.sign"))
    private = subprocess.run(["openssl", "genrsa", "2048"], check=True,
                             capture_output=True).stdout.decode("ascii")
    app = _app(db_url, smtp_server, {"tracer_provider": provider},
               OUTBOX_DKIM_DOMAIN="example.com", OUTBOX_DKIM_SELECTOR="s1",
               OUTBOX_DKIM_PRIVATE_KEY=private)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("One", recipients=["ann@example.com"], body="1"))
            db.session.commit()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        [consumer] = _consumers(exporter, 1)
    finally:
        close_app(app)
    assert row["attempts"] == 1 and len(smtp_server.messages) == 1
    assert (consumer.attributes or {})["flask_mail_outbox.outcome"] == "sent"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"Could not end the span {name!r} of a delivery attempt. Consequence: that span is "
        "missing from its trace or incomplete; the email is sent and its outcome recorded "
        "as usual. Fix: check the app's OpenTelemetry span processors (the traceback below "
        "names the failing one)." for name in ("dkim.sign", "smtp transaction")]


def test_the_api_request_span_is_current_while_httpx_sends_so_its_instrumentation_nests(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What opentelemetry-instrumentation-httpx does, done here on httpx's own transport:
    a CLIENT span ``POST`` opened in the current context when the request goes out."""
    provider, exporter = traced
    http_tracer = provider.get_tracer("httpx")
    sending = httpx.AsyncHTTPTransport.handle_async_request

    async def instrumented(self: httpx.AsyncHTTPTransport,
                           request: httpx.Request) -> httpx.Response:
        with http_tracer.start_as_current_span(request.method, kind=SpanKind.CLIENT):
            return await sending(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", instrumented)
    fake = FakePostmark()
    fake.start()
    app = _app(db_url, smtp_server, {"tracer_provider": provider},
               OUTBOX_TRANSPORTS={"default": {"transport": "postmark", "base_url": fake.url,
                                              "token": POSTMARK_TOKEN}})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("One", recipients=["ann@example.com"], body="1"))
            db.session.commit()
        wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        [consumer] = _consumers(exporter, 1)
    finally:
        close_app(app)
        fake.stop()
    spans = exporter.get_finished_spans()
    [api] = [s for s in spans if s.name == "postmark api"]
    [post] = [s for s in spans if s.name == "POST"]
    assert (api.parent and api.parent.span_id) == consumer.context.span_id
    assert (post.parent and post.parent.span_id) == api.context.span_id
    assert post.context.trace_id == consumer.context.trace_id
    host, port = fake.url.split("//")[1].rstrip("/").split(":")
    assert dict(api.attributes or {}) == {"server.address": host, "server.port": int(port)}


def test_a_bounce_matched_to_an_email_links_back_to_its_producer(
        db_url: str, smtp_server: FaultSMTPServer, traced: Traced) -> None:
    provider, exporter = traced
    app = _app(db_url, smtp_server, {"tracer_provider": provider})
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            email_id = mail.send(Message("Hi", recipients=["nobody-here@example.com"],
                                         body="hi"))
            db.session.commit()
        [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", 20.0)
        # A real Postfix DSN, about this email (its Message-ID quoted in the returned part).
        dsn = (TESTS / "bounces" / "postfix-hard-5.1.1.eml").read_bytes().replace(
            b"<176498070012.4242.17023845513306081729@example.com>",
            row["message_id"].encode())
        with app.app_context(), provider.get_tracer("test").start_as_current_span(
                "bounce job") as job:
            [event] = mail.process_bounce(dsn)
    finally:
        close_app(app)
    assert event.email_id == email_id
    [producer] = _spans(exporter, SpanKind.PRODUCER)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "event bounced"]
    assert (span.parent and span.parent.span_id) == job.get_span_context().span_id
    assert [link.context.span_id for link in span.links] == [producer.context.span_id]
    assert dict(span.attributes or {}) == {
        "messaging.system": "flask-mail-outbox", "messaging.operation.name": "event",
        "messaging.operation.type": "process", "messaging.destination.name": "bounce",
        "messaging.message.id": str(email_id), "flask_mail_outbox.event_type": "bounced",
        "flask_mail_outbox.bounce_kind": "permanent",
        "flask_mail_outbox.reason": event.reason}
    _no_address(list(exporter.get_finished_spans()))
