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

import pytest
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
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
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
    for span in spans:
        for name, value in (span.attributes or {}).items():
            assert "@" not in str(value), (span.name, name, value)


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
    # The consumers: one per attempt, each in a trace of its own, linked to its producer.
    assert len(consumers) == 3
    for consumer, producer, email_id in zip(consumers, producers, ids, strict=True):
        assert consumer.name == "process default"
        assert consumer.parent is None
        assert consumer.context.trace_id not in (request.context.trace_id,)
        assert [(link.context.trace_id, link.context.span_id) for link in consumer.links] == [
            (producer.context.trace_id, producer.context.span_id)]
        expected: dict[str, Any] = {
            "messaging.system": "flask-mail-outbox", "messaging.operation.name": "process",
            "messaging.operation.type": "process", "messaging.destination.name": "default",
            "messaging.message.id": str(email_id), "flask_mail_outbox.attempt": 1,
            "flask_mail_outbox.outcome": "sent", "server.address": smtp_server.host,
            "server.port": smtp_server.port}
        if email_id == ids[0]:
            expected["messaging.message.conversation_id"] = "account-7"
        assert dict(consumer.attributes or {}) == expected
        assert consumer.status.is_ok
    assert len({c.context.trace_id for c in consumers}) == 3
    # Each attempt's record (its batch's transaction) is a child span, inside the attempt.
    records = [s for s in exporter.get_finished_spans() if s.name == "record"]
    assert sorted((r.parent.span_id if r.parent else None, r.kind) for r in records) == sorted(
        (c.context.span_id, SpanKind.INTERNAL) for c in consumers)
    for consumer in consumers:
        [record] = [r for r in records if r.parent and r.parent.span_id == consumer.context.span_id]
        assert consumer.context.trace_id == record.context.trace_id
        assert (consumer.start_time or 0) <= (record.start_time or 0) \
            <= (record.end_time or 0) <= (consumer.end_time or 0)
        # The attempt starts at its claim, before the transport had the message.
        assert (consumer.start_time or 0) < (record.start_time or 0)
    _no_address(list(exporter.get_finished_spans()))


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
    assert list(consumer.links) == []
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


@pytest.mark.parametrize(("value", "message"), [
    ("on", "expected a dict"),
    ({"enabled": "yes"}, "'enabled' must be True, False or 'auto', got 'yes'"),
    ({"enabled": 1}, "'enabled' must be True, False or 'auto', got 1"),
    ({"link": "parent"}, "'link' must be 'link' or 'child', got 'parent'"),
    ({"recipient_domain": "yes"}, "'recipient_domain' must be True or False"),
    ({"tracer_provider": object()}, "'tracer_provider' must be an OpenTelemetry"),
    ({"sampler": 1}, "unknown key 'sampler'"),
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

        def consumers() -> list[dict[str, Any]]:
            if not spans_file.exists():
                return []
            lines = [json.loads(line) for line in spans_file.read_text().splitlines()]
            return sorted((s for s in lines if s["kind"] == "CONSUMER"),
                          key=lambda s: int(s["attributes"]["messaging.message.id"]))

        found = poll(consumers, lambda spans: len(spans) == 3, timeout=30)
        stored = rows(app)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        close_app(app)
    assert len(found) == 3, (tmp_path / "worker.log").read_text()
    producers = _spans(exporter, SpanKind.PRODUCER)
    assert [row["status"] for row in stored] == ["sent"] * 3
    assert [s["links"] for s in found] == [
        [[f"{p.context.trace_id:032x}", f"{p.context.span_id:016x}"]] for p in producers]
    assert [s["parent"] for s in found] == [None] * 3
    assert [(s["name"], s["attributes"]["messaging.message.id"],
             s["attributes"]["flask_mail_outbox.outcome"], s["attributes"]["server.port"])
            for s in found] == [("process default", str(row["id"]), "sent", smtp_server.port)
                                for row in stored]
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
    assert consumer.parent is None
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
