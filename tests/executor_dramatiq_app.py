"""The app of the Dramatiq worker processes in tests/test_executor_dramatiq.py.

The workers run the documented command::

    FLASK_APP=executor_dramatiq_app:create_app \\
        python -m dramatiq flask_mail_outbox.contrib.dramatiq:setup --processes 1 --threads 2

with ``PYTHONPATH=<repo>/tests:<repo>`` and the configuration in environment
variables:

=========================  ==================================  =========
variable                   setting                             default
=========================  ==================================  =========
``EXEC_DB_URL``            ``SQLALCHEMY_DATABASE_URI``         required
``EXEC_SMTP_PORT``         ``MAIL_PORT`` (127.0.0.1)           required
``EXEC_BROKER_URL``        ``OUTBOX_EXECUTOR_URL``             required
``EXEC_LEASE_SECONDS``     ``OUTBOX_LEASE_SECONDS``            library's
``EXEC_BATCH_SIZE``        ``OUTBOX_BATCH_SIZE``               library's
``EXEC_CONCURRENCY``       ``OUTBOX_CONCURRENCY``              library's
``EXEC_SWEEP_MIN_AGE``     ``OUTBOX_SWEEP_MIN_AGE_SECONDS``    library's
``EXEC_SWEEP_INTERVAL``    ``OUTBOX_SWEEP_INTERVAL_SECONDS``   library's
=========================  ==================================  =========

The tables must exist (the test process creates them). Every delivered email
is logged as ``outbox-test sent id=<row id> mid=<Message-ID>`` (stderr, INFO).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import OutboxMail, email_sent

log = logging.getLogger("outbox_test_worker")

_ENV_KEYS: dict[str, tuple[str, type]] = {
    "EXEC_LEASE_SECONDS": ("OUTBOX_LEASE_SECONDS", float),
    "EXEC_BATCH_SIZE": ("OUTBOX_BATCH_SIZE", int),
    "EXEC_CONCURRENCY": ("OUTBOX_CONCURRENCY", int),
    "EXEC_SWEEP_MIN_AGE": ("OUTBOX_SWEEP_MIN_AGE_SECONDS", float),
    "EXEC_SWEEP_INTERVAL": ("OUTBOX_SWEEP_INTERVAL_SECONDS", float),
}


def config(db_url: str, smtp_port: int, broker_url: str) -> dict[str, Any]:
    """The settings the test's producer app and the workers share."""
    return {
        "SQLALCHEMY_DATABASE_URI": db_url,
        "MAIL_SERVER": "127.0.0.1",
        "MAIL_PORT": smtp_port,
        "MAIL_DEFAULT_SENDER": "Sender <sender@example.com>",
        "MAIL_SUPPRESS_SEND": False,
        "MAIL_TIMEOUT": 30.0,
        "OUTBOX_DURABLE": True,
        "OUTBOX_EXECUTOR": "dramatiq",
        "OUTBOX_EXECUTOR_URL": broker_url,
        "OUTBOX_RUN_SCHEDULER": False,
        # The tests' fast retry schedule (2 s doubling, 5 attempts).
        "OUTBOX_RETRY_BASE_SECONDS": 2.0,
        "OUTBOX_MAX_ATTEMPTS": 5,
    }


def create_app() -> Flask:
    """The worker's app, configured from ``EXEC_*`` environment variables."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(created).3f %(process)d [%(threadName)s] %(levelname)s %(name)s: %(message)s"))
    for name in ("flask_mail_outbox", "outbox_test_worker"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False
    app = Flask(__name__)
    app.config.update(config(os.environ["EXEC_DB_URL"], int(os.environ["EXEC_SMTP_PORT"]),
                             os.environ["EXEC_BROKER_URL"]))
    for env, (key, kind) in _ENV_KEYS.items():
        if os.environ.get(env):
            app.config[key] = kind(os.environ[env])
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)

    def sent(_sender: Flask, *, email_id: int, message_id: str, **_: Any) -> None:
        log.info("outbox-test sent id=%d mid=%s", email_id, message_id)

    email_sent.connect(sent, app, weak=False)
    return app
