"""The Flask app of the RQ worker processes in tests/test_executor_rq.py.

A worker runs as (from ``tests/``, with ``PYTHONPATH=<repo>/tests:<repo>``)::

    FLASK_APP=executor_rq_app:create_app python -m rq.cli worker \
        --worker-class flask_mail_outbox.contrib.rq.OutboxWorker -u $RQ_TEST_REDIS_URL outbox

configured from the environment:

======================  ==========================================  ==========
variable                setting                                     default
======================  ==========================================  ==========
``RQ_TEST_DB_URL``      ``SQLALCHEMY_DATABASE_URI``                 required
``RQ_TEST_SMTP_PORT``   ``MAIL_PORT`` (``MAIL_SERVER`` 127.0.0.1)   required
``RQ_TEST_REDIS_URL``   ``OUTBOX_EXECUTOR_URL``                     required
``RQ_TEST_LEASE``       ``OUTBOX_LEASE_SECONDS``                    library's
``RQ_TEST_CONCURRENCY`` ``OUTBOX_CONCURRENCY``                      library's
``RQ_TEST_BATCH``       ``OUTBOX_BATCH_SIZE``                       library's
======================  ==========================================  ==========

The tables must exist (the test process creates them). The app logs to stderr:
the library at INFO, and ``rq-test sent id=<id> pid=<pid>`` for every email this
process delivered (the ``email_sent`` signal; ``pid`` is the work-horse's when RQ
forks one).

:class:`ForkingWorker` is RQ's default worker (a work-horse forked per job) with
the app loaded once in the parent, for the tests of a killed work-horse and the
per-job cost measurement.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from rq import Worker

from flask_mail_outbox import OutboxMail, email_sent
from flask_mail_outbox.contrib.rq import load_app

log = logging.getLogger("rq_test_worker")

_ENV_KEYS: dict[str, tuple[str, type]] = {
    "RQ_TEST_LEASE": ("OUTBOX_LEASE_SECONDS", float),
    "RQ_TEST_CONCURRENCY": ("OUTBOX_CONCURRENCY", int),
    "RQ_TEST_BATCH": ("OUTBOX_BATCH_SIZE", int),
}

#: The producer's and the workers' shared settings: durable, the tests' fast retries,
#: a sweep that takes a due row after a second (the test runs the sweep job itself).
COMMON: dict[str, Any] = {
    "MAIL_SERVER": "127.0.0.1",
    "MAIL_DEFAULT_SENDER": "Sender <sender@example.com>",
    "MAIL_SUPPRESS_SEND": False,
    "MAIL_TIMEOUT": 10.0,
    "OUTBOX_DURABLE": True,
    "OUTBOX_EXECUTOR": "rq",
    "OUTBOX_RUN_WORKER": False,
    "OUTBOX_RUN_SCHEDULER": False,
    "OUTBOX_SWEEP_ON_STARTUP": False,
    "OUTBOX_SWEEP_MIN_AGE_SECONDS": 1.0,
    "OUTBOX_RETRY_BASE_SECONDS": 2.0,
    "OUTBOX_MAX_ATTEMPTS": 5,
}


def _configure_logging() -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_outbox_test", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(created).3f %(process)d [%(threadName)s] %(levelname)s %(name)s: %(message)s"))
        handler._outbox_test = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for name in ("flask_mail_outbox", "rq_test_worker"):
        logging.getLogger(name).setLevel(logging.INFO)


def create_app() -> Flask:
    """The workers' app (see the module docstring)."""
    _configure_logging()
    app = Flask(__name__)
    app.config.update(COMMON)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["RQ_TEST_DB_URL"],
        MAIL_PORT=int(os.environ["RQ_TEST_SMTP_PORT"]),
        OUTBOX_EXECUTOR_URL=os.environ["RQ_TEST_REDIS_URL"],
    )
    for variable, (key, kind) in _ENV_KEYS.items():
        if os.environ.get(variable):
            app.config[key] = kind(os.environ[variable])
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)

    def sent(sender: Any, email_id: int, **extra: Any) -> None:
        log.info("rq-test sent id=%s pid=%d", email_id, os.getpid())

    email_sent.connect(sent, app, weak=False)
    return app


class ForkingWorker(Worker):
    """RQ's forking worker, the app created in the parent before the first fork."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        load_app()
