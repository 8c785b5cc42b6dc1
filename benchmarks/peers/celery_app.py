"""The Celery peer: how Flask apps send email in the background today, Celery + Flask-Mail.

One task, ``send(i)``, builds a Flask-Mail ``Message`` and calls ``mail.send()``
inside the Flask app's context, as the Flask-Mail and Celery documentation show
it (a connection per message). The ``peers`` scenario starts the worker::

    python -m celery -A benchmarks.peers.celery_app worker --pool prefork -c 4

with ``BENCH_REDIS_URL`` (the broker) and ``BENCH_SMTP_PORT`` (the sink on
127.0.0.1) in its environment, and queues tasks by name with :func:`enqueue`.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from ..bench_app import BODY, RECIPIENT, SENDER

TASK = "benchmarks.peers.celery_app.send"


def make_celery(broker: str) -> Celery:
    """A Celery app on ``broker``, results ignored (a sent email returns nothing)."""
    app = Celery("bench_peer", broker=broker)
    app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, worker_prefetch_multiplier=4)
    return app


celery = make_celery(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
_flask: dict[str, Any] = {}


@celery.task(name=TASK)  # type: ignore[untyped-decorator]
def send(i: int) -> None:
    """Send email number ``i`` with Flask-Mail (one SMTP connection, as ``mail.send`` does)."""
    from flask import Flask
    from flask_mail import Mail, Message

    if not _flask:
        app = Flask("bench_celery_peer")
        app.config.update(MAIL_SERVER="127.0.0.1", MAIL_PORT=int(os.environ["BENCH_SMTP_PORT"]),
                          MAIL_DEFAULT_SENDER=SENDER, MAIL_SUPPRESS_SEND=False)
        _flask.update(app=app, mail=Mail(app))
    with _flask["app"].app_context():
        _flask["mail"].send(Message(f"celery #{i}", recipients=[RECIPIENT], body=BODY))


def enqueue(broker: str, n: int) -> None:
    """Queue tasks ``send(0)`` .. ``send(n - 1)`` on ``broker``."""
    client = make_celery(broker)
    with client.producer_or_acquire() as producer:
        for i in range(n):
            client.send_task(TASK, args=[i], producer=producer)
