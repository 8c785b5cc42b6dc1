"""The app of a ``flask outbox worker`` subprocess in tests/test_otel.py.

Run as ``flask --app otel_worker_app:create_app outbox worker`` with
``PYTHONPATH=<repo>/tests:<repo>``, ``OTEL_TEST_DB_URL``, ``OTEL_TEST_SMTP_PORT`` and
``OTEL_TEST_SPANS`` (a file) in the environment. It sets the process-wide tracer
provider of the OpenTelemetry SDK, as an app would, and leaves ``OUTBOX_OTEL`` at
its default ("auto"), so tracing is on because a provider is set. Every finished
span is appended to ``OTEL_TEST_SPANS`` as one JSON line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from flask_mail_outbox import OutboxMail


class FileExporter(SpanExporter):
    """Each span as a JSON line: kind, name, ids, parent, links, attributes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.lock, open(self.path, "a", encoding="utf-8") as out:
            out.writelines(json.dumps(span_json(span)) + "\n" for span in spans)
        return SpanExportResult.SUCCESS


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """A span as plain JSON: kind, name, ids, parent, links, attributes, times, status."""
    context = span.get_span_context()
    return {
        "kind": span.kind.name, "name": span.name,
        "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
        "parent": f"{span.parent.span_id:016x}" if span.parent else None,
        "links": [[f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}"]
                  for link in span.links],
        "attributes": {name: list(value) if isinstance(value, tuple) else value
                       for name, value in (span.attributes or {}).items()},
        "start": span.start_time, "end": span.end_time, "status": span.status.status_code.name,
    }


def create_app() -> Flask:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["OTEL_TEST_SPANS"])))
    trace.set_tracer_provider(provider)
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["OTEL_TEST_DB_URL"],
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=int(os.environ["OTEL_TEST_SMTP_PORT"]),
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        OUTBOX_DURABLE=True,
        OUTBOX_POLL_INTERVAL=0.05,
        OUTBOX_POLL_MAX_INTERVAL=0.2,
    )
    SQLAlchemy(app)
    OutboxMail(app)
    return app
