"""The peer: how Flask users send email in the background today, Celery + Flask-Mail.

A Celery app (Redis broker, no result backend) with one task, ``send(i)``,
that builds a Flask-Mail ``Message`` and calls ``mail.send()`` inside the
Flask app's context, as the Flask-Mail and Celery documentation show it (a
connection per message). The worker is started by the ``limits`` scenario::

    python -m celery -A benchmarks.celery_peer worker --pool prefork -c 4

with ``BENCH_REDIS_URL`` (the broker) and ``BENCH_SMTP_PORT`` (the sink on
127.0.0.1) in its environment. :func:`enqueue` queues tasks from another
process with ``send_task`` (by name: the caller needs neither Flask nor
Flask-Mail).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from .bench_app import RECIPIENT, SENDER

TASK = "benchmarks.celery_peer.send"

BODY = ("Hello,\n\nthis is a benchmark email of flask-mail-outbox, about the size of a "
        "short transactional message (a sign-up confirmation or a password reset).\n\n"
        + "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 12 + "\n\n-- \nBench\n")


def make_celery(broker: str) -> Celery:
    """A Celery app on ``broker``, results ignored (a sent email returns nothing)."""
    app = Celery("bench_peer", broker=broker)
    app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, worker_prefetch_multiplier=4)
    return app


celery = make_celery(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
_flask: dict[str, Any] = {}


def _flask_app() -> tuple[Any, Any]:
    """The Flask app and its ``Mail``, built once per worker process."""
    if not _flask:
        from flask import Flask
        from flask_mail import Mail

        app = Flask("bench_celery_peer")
        app.config.update(MAIL_SERVER="127.0.0.1", MAIL_PORT=int(os.environ["BENCH_SMTP_PORT"]),
                          MAIL_DEFAULT_SENDER=SENDER, MAIL_SUPPRESS_SEND=False)
        _flask.update(app=app, mail=Mail(app))
    return _flask["app"], _flask["mail"]


@celery.task(name=TASK)  # type: ignore[untyped-decorator]
def send(i: int) -> None:
    """Send email number ``i`` with Flask-Mail (one SMTP connection, as ``mail.send`` does)."""
    from flask_mail import Message

    app, mail = _flask_app()
    with app.app_context():
        mail.send(Message(f"celery #{i}", recipients=[RECIPIENT], body=BODY))


def enqueue(broker: str, n: int, start: int = 0) -> None:
    """Queue tasks ``send(start)`` .. ``send(start + n - 1)`` on ``broker``."""
    client = make_celery(broker)
    with client.producer_or_acquire() as producer:
        for i in range(start, start + n):
            client.send_task(TASK, args=[i], producer=producer)
