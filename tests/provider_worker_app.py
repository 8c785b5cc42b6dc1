"""An app factory for ``flask outbox worker`` subprocesses delivering through a provider API.

Run as::

    flask --app provider_worker_app:create_app outbox worker

with ``PYTHONPATH=<repo>/tests:<repo>``, the AWS credentials in the environment
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``: the ses transport finds them
through AWS's usual chain) and the rest in environment variables:

=============================  ====================================  =========
variable                       setting                               default
=============================  ====================================  =========
``WORKER_DB_URL``              ``SQLALCHEMY_DATABASE_URI``           required
``WORKER_SES_URL``             the ses entry's ``base_url``          required
``WORKER_SES_REGION``          the ses entry's ``region``            eu-west-1
``WORKER_HTTP_CONCURRENCY``    the ses entry's ``concurrency``       4
``WORKER_LEASE_SECONDS``       ``OUTBOX_LEASE_SECONDS``              library's
``WORKER_POLL``                ``OUTBOX_POLL_INTERVAL``              library's
``WORKER_POLL_MAX``            ``OUTBOX_POLL_MAX_INTERVAL``          library's
``WORKER_LISTEN_BACKSTOP``     ``OUTBOX_LISTEN_BACKSTOP_SECONDS``    library's
``WORKER_BATCH_SIZE``          ``OUTBOX_BATCH_SIZE``                 library's
=============================  ====================================  =========

The ``default`` transport is that ses entry, so rows queued for ``default``
by another app (with whatever transport it has) go out through the provider.
The tables must exist already (the test process creates them). The worker logs
to stderr, INFO for the library, and ``outbox-test sent id=<row id> mid=<Message-ID>``
for every email it delivered (the ``email_sent`` signal), as ``worker_app`` does.
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
    "WORKER_LEASE_SECONDS": ("OUTBOX_LEASE_SECONDS", float),
    "WORKER_POLL": ("OUTBOX_POLL_INTERVAL", float),
    "WORKER_POLL_MAX": ("OUTBOX_POLL_MAX_INTERVAL", float),
    "WORKER_LISTEN_BACKSTOP": ("OUTBOX_LISTEN_BACKSTOP_SECONDS", float),
    "WORKER_BATCH_SIZE": ("OUTBOX_BATCH_SIZE", int),
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


def create_app() -> Flask:
    """The worker's app, configured from ``WORKER_*`` environment variables."""
    _configure_logging()
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["WORKER_DB_URL"],
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        OUTBOX_DURABLE=True,
        # The tests' fast retry schedule (2 s doubling, 5 attempts).
        OUTBOX_RETRY_BASE_SECONDS=2.0,
        OUTBOX_MAX_ATTEMPTS=5,
        OUTBOX_TRANSPORTS={"default": {
            "transport": "ses",
            "region": os.environ.get("WORKER_SES_REGION", "eu-west-1"),
            "base_url": os.environ["WORKER_SES_URL"],
            "concurrency": int(os.environ.get("WORKER_HTTP_CONCURRENCY", "4")),
        }},
    )
    for env, (key, kind) in _ENV_KEYS.items():
        if os.environ.get(env):
            app.config[key] = kind(os.environ[env])
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)

    def sent(_sender: Flask, *, email_id: int, message_id: str, **_: Any) -> None:
        log.info("outbox-test sent id=%d mid=%s", email_id, message_id)

    email_sent.connect(sent, app, weak=False)
    return app
