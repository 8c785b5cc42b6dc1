"""The app of the processes under test, configured from the environment or explicitly.

Workers run it as::

    python -m flask --app benchmarks.bench_app:create_app outbox worker --concurrency 4

(from the repository root, or with it on ``PYTHONPATH``). Variables:

=======================  ==========================================================
``BENCH_DB_URL``         ``SQLALCHEMY_DATABASE_URI`` (required)
``BENCH_SMTP_PORT``      ``MAIL_PORT`` of a sink on 127.0.0.1 (required)
``BENCH_CONFIG``         a JSON object of further config keys, e.g.
                         ``{"OUTBOX_DURABLE": true, "OUTBOX_LISTEN": false}``
``BENCH_SKIP_SCREEN``    set: the process screens no claimed batch against the
                         suppression list (the ``costs`` scenario's variant, see
                         :func:`benchmarks.costs.skip_screen`)
=======================  ==========================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import Message, OutboxMail

SENDER = "Bench <bench@example.com>"
RECIPIENT = "rcpt@example.com"
BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")


@dataclasses.dataclass
class Bench:
    """An app with the handles a scenario needs (the extension keeps none on the app)."""

    app: Flask
    db: SQLAlchemy
    mail: OutboxMail

    def enqueue(self, n: int, tag: str, *, batch: int = 500, **send: Any) -> float:
        """``n`` emails through ``mail.send()``, ``batch`` per commit; the seconds it took."""
        import time

        with self.app.app_context():
            started = time.perf_counter()
            for start in range(0, n, batch):
                for i in range(start, min(n, start + batch)):
                    self.mail.send(message(f"{tag} #{i}"), **send)
                self.db.session.commit()
            elapsed = time.perf_counter() - started
            self.db.session.remove()
        return elapsed

    def stop(self) -> None:
        self.mail.stop(timeout=5)


def message(subject: str, **headers: str) -> Message:
    """A short transactional email to the benchmark recipient."""
    return Message(subject, recipients=[RECIPIENT], body=BODY, extra_headers=headers or None)


def build(db_url: str, smtp_port: int, *, create: bool = True, **config: Any) -> Bench:
    """A Flask app with Flask-SQLAlchemy and the outbox; ``create``: the outbox tables too.

    The benchmark process creates the tables before any worker starts: workers
    creating them at once would race.
    """
    app = Flask("bench_app")
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, MAIL_SERVER="127.0.0.1",
                      MAIL_PORT=smtp_port, MAIL_DEFAULT_SENDER=SENDER,
                      MAIL_SUPPRESS_SEND=False, MAIL_TIMEOUT=30.0, **config)
    db = SQLAlchemy(app)
    mail = OutboxMail(app, db=db)
    if create:
        with app.app_context():
            mail.create_all()
    return Bench(app, db, mail)


def from_env() -> Bench:
    """:func:`build` from the ``BENCH_*`` variables."""
    if os.environ.get("BENCH_SKIP_SCREEN"):
        from .costs import skip_screen

        skip_screen()
    return build(os.environ["BENCH_DB_URL"], int(os.environ["BENCH_SMTP_PORT"]), create=False,
                 **json.loads(os.environ.get("BENCH_CONFIG") or "{}"))


def create_app() -> Flask:
    """The app factory for ``flask --app``."""
    return from_env().app
