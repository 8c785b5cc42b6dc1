"""An app factory for ``flask outbox worker`` subprocesses of tests/test_pause_workers.py.

Run as ``flask --app pause_helpers:create_app outbox worker`` with
``PYTHONPATH=<repo>/tests:<repo>`` and ``WORKER_DB_URL`` (the database),
``WORKER_SES_URL`` (tests/provider_ses.py's fake) and AWS's credentials in the
environment. Durable, ``OUTBOX_MAX_ATTEMPTS=2`` (the issue's measurement), a
paused transport probed 0.5 s after its fault doubling to 1 s, fast polling.
It logs to stderr, INFO for the library, and ``outbox-test sent id=<row id>
mid=<Message-ID>`` for every email it delivered.
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


def create_app() -> Flask:
    """The worker's app (see the module docstring)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(created).3f %(process)d [%(threadName)s] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in ("flask_mail_outbox", "outbox_test_worker"):
        logging.getLogger(name).setLevel(logging.INFO)
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["WORKER_DB_URL"],
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        OUTBOX_DURABLE=True,
        OUTBOX_MAX_ATTEMPTS=2,
        OUTBOX_RETRY_BASE_SECONDS=0.2,
        OUTBOX_PAUSE_PROBE_SECONDS=0.5,
        OUTBOX_PAUSE_PROBE_MAX_SECONDS=1.0,
        OUTBOX_POLL_INTERVAL=0.1,
        OUTBOX_POLL_MAX_INTERVAL=0.5,
        OUTBOX_LISTEN_BACKSTOP_SECONDS=0.5,
        OUTBOX_LEASE_SECONDS=5.0,
        OUTBOX_BATCH_SIZE=10,
        OUTBOX_TRANSPORTS={"default": {
            "transport": "ses", "region": "eu-west-1",
            "base_url": os.environ["WORKER_SES_URL"], "concurrency": 4}},
    )
    OutboxMail(app, db=SQLAlchemy(app))

    def sent(_sender: Flask, *, email_id: int, message_id: str, **_: Any) -> None:
        log.info("outbox-test sent id=%d mid=%s", email_id, message_id)

    email_sent.connect(sent, app, weak=False)
    return app
