"""An app factory for ``flask outbox worker`` subprocesses in tests/test_workers.py.

Run as::

    flask --app worker_app:create_app outbox worker --concurrency 4

with ``PYTHONPATH=<repo>/tests:<repo>`` and the configuration in environment
variables:

=========================  ==================================  =========
variable                   setting                             default
=========================  ==================================  =========
``WORKER_DB_URL``          ``SQLALCHEMY_DATABASE_URI``         required
``WORKER_SMTP_PORT``       ``MAIL_PORT`` (``MAIL_SERVER`` is   required
                           127.0.0.1)
``WORKER_LEASE_SECONDS``   ``OUTBOX_LEASE_SECONDS``            library's
``WORKER_POLL``            ``OUTBOX_POLL_INTERVAL``            library's
``WORKER_POLL_MAX``        ``OUTBOX_POLL_MAX_INTERVAL``        library's
``WORKER_LISTEN``          ``OUTBOX_LISTEN`` (``0``/``1``)     library's
``WORKER_LISTEN_BACKSTOP`` ``OUTBOX_LISTEN_BACKSTOP_SECONDS``  library's
``WORKER_BATCH_SIZE``      ``OUTBOX_BATCH_SIZE``               library's
``WORKER_MAX_ATTEMPTS``    ``OUTBOX_MAX_ATTEMPTS``             library's
``WORKER_MAIL_TIMEOUT``    ``MAIL_TIMEOUT``                    30
``WORKER_RATE_LIMIT``      ``OUTBOX_RATE_LIMIT`` (shared)      none
=========================  ==================================  =========

The tables must exist already (the test process creates them).

For the tests to observe the worker from outside, it logs to stderr (INFO for
the library and for these lines):

* ``outbox-test sent id=<row id> mid=<Message-ID>`` for every email it delivered
  (the ``email_sent`` signal);
* ``outbox-test tick n=<n> start=<wall time> gap=<s> claimed=<n>
  listening=<bool> failed=<bool>`` after every claim of due rows, with the gap
  it chose to the next one (measured from ``start``). A claim that starts
  earlier than ``start + gap`` of the previous one was woken.

The tick line is instrumentation added here by wrapping ``Worker._schedule``
(the library is not changed), which every claim calls once with its outcome.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import OutboxMail
from flask_mail_outbox import email_sent
from flask_mail_outbox.core import Worker

log = logging.getLogger("outbox_test_worker")

_ENV_KEYS: dict[str, tuple[str, type]] = {
    "WORKER_LEASE_SECONDS": ("OUTBOX_LEASE_SECONDS", float),
    "WORKER_POLL": ("OUTBOX_POLL_INTERVAL", float),
    "WORKER_POLL_MAX": ("OUTBOX_POLL_MAX_INTERVAL", float),
    "WORKER_LISTEN_BACKSTOP": ("OUTBOX_LISTEN_BACKSTOP_SECONDS", float),
    "WORKER_BATCH_SIZE": ("OUTBOX_BATCH_SIZE", int),
    "WORKER_MAX_ATTEMPTS": ("OUTBOX_MAX_ATTEMPTS", int),
    "WORKER_MAIL_TIMEOUT": ("MAIL_TIMEOUT", float),
    "WORKER_RATE_LIMIT": ("OUTBOX_RATE_LIMIT", float),
}


def _configure_logging() -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_outbox_test", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(created).3f %(process)d [%(threadName)s] %(levelname)s %(name)s: %(message)s"))
        handler._outbox_test = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in ("flask_mail_outbox", "outbox_test_worker"):
        logging.getLogger(name).setLevel(logging.INFO)


def _trace_ticks() -> None:
    """Log every claim's start and chosen gap (see the module docstring)."""
    if getattr(Worker._schedule, "_outbox_test_traced", False):
        return
    original = Worker._schedule

    def schedule(self: Worker, started: float, *, claimed: int, full: bool,
                 failed: bool, wake_in: float | None = None) -> None:
        original(self, started, claimed=claimed, full=full, failed=failed, wake_in=wake_in)
        wall_start = time.time() - (self.clock() - started)
        log.info("outbox-test tick n=%d start=%.3f gap=%.3f claimed=%d listening=%s "
                 "failed=%s", self.claims, wall_start, self._next_claim - started,
                 claimed, self.listening, failed)

    schedule._outbox_test_traced = True  # type: ignore[attr-defined]
    Worker._schedule = schedule  # type: ignore[method-assign]


def create_app() -> Flask:
    """The worker's app, configured from ``WORKER_*`` environment variables."""
    _configure_logging()
    _trace_ticks()
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["WORKER_DB_URL"],
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=int(os.environ["WORKER_SMTP_PORT"]),
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        MAIL_TIMEOUT=30.0,
        OUTBOX_DURABLE=True,
        # The tests' fast retry schedule (2 s doubling, 5 attempts), kept
        # explicitly: the library's defaults wait a minute and try for a day.
        OUTBOX_RETRY_BASE_SECONDS=2.0,
        OUTBOX_MAX_ATTEMPTS=5,
    )
    for env, (key, kind) in _ENV_KEYS.items():
        if os.environ.get(env):
            app.config[key] = kind(os.environ[env])
    if os.environ.get("WORKER_LISTEN"):
        app.config["OUTBOX_LISTEN"] = os.environ["WORKER_LISTEN"].lower() in ("1", "true", "yes")
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)

    def sent(_sender: Flask, *, email_id: int, message_id: str, **_: Any) -> None:
        log.info("outbox-test sent id=%d mid=%s", email_id, message_id)

    email_sent.connect(sent, app, weak=False)
    return app
