"""The app of the Celery worker processes of tests/test_executor_celery.py (and its producer).

A worker runs ``python -m celery -A executor_celery_app worker -Q outbox ...`` with
``PYTHONPATH=<repo>/tests:<repo>``, cwd ``tests/``, and

=====================  ==================================================
variable               meaning
=====================  ==================================================
``EXEC_DB_URL``        ``SQLALCHEMY_DATABASE_URI`` (tables must exist)
``EXEC_SMTP_PORT``     ``MAIL_PORT`` (``MAIL_SERVER`` is 127.0.0.1)
``EXEC_BROKER_URL``    the Celery broker (a private Redis)
``EXEC_CONFIG``        a JSON object of further app config keys
``EXEC_BEAT_SECONDS``  set: the Celery config has the sweep's beat entry
                       (``beat_schedule(seconds)``), for ``celery beat``
=====================  ==================================================

The Celery app is made as the Flask docs' pattern makes it (``celery_init_app``:
stored at ``app.extensions["celery"]``, tasks run in an app context), before
``OutboxMail(app)``; the outbox's tasks come from ``flask_mail_outbox.contrib.celery``,
which ``init_app`` imports. Library logs go to the worker's log at INFO.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from celery import Celery, Task
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.contrib.celery import beat_schedule


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Signup(db.Model):  # type: ignore[name-defined,misc]
    """The app's own row, committed (or rolled back) with the email."""

    __tablename__ = "celery_signup"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]


#: The worker settings the docs recommend (docs/executors/celery.md).
CELERY_DEFAULTS: dict[str, Any] = {
    "worker_prefetch_multiplier": 1,
    "task_acks_late": False,
    "broker_connection_retry_on_startup": True,
}


def celery_init_app(app: Flask) -> Celery:
    """A Celery app configured from ``app.config["CELERY"]``, at ``app.extensions["celery"]``."""

    class FlaskTask(Task):  # type: ignore[misc]
        def __call__(self, *args: object, **kwargs: object) -> object:
            with app.app_context():
                return self.run(*args, **kwargs)

    celery = Celery(app.name, task_cls=FlaskTask)
    celery.config_from_object(app.config["CELERY"])
    celery.set_default()
    app.extensions["celery"] = celery
    return celery


def create_app(db_url: str, smtp_port: int, broker_url: str,
               **config: Any) -> Flask:
    """The app: durable, never its own dispatcher, delivering on Celery."""
    app = Flask("executor_celery_app")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=db_url,
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=smtp_port,
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        MAIL_TIMEOUT=10,
        PROPAGATE_EXCEPTIONS=True,
        OUTBOX_DURABLE=True,
        OUTBOX_RUN_SCHEDULER=False,
        OUTBOX_SWEEP_ON_STARTUP=False,
        OUTBOX_EXECUTOR="celery",
        OUTBOX_RETRY_BASE_SECONDS=1.0,
        OUTBOX_MAX_ATTEMPTS=5,
        CELERY=dict(CELERY_DEFAULTS, broker_url=broker_url),
    )
    app.config.update(config)
    db.init_app(app)
    celery_init_app(app)
    mail = OutboxMail(app, db=db)

    @app.post("/signup/<int:n>")
    def signup(n: int) -> str:
        address = f"user-{n}@example.com"
        db.session.add(Signup(email=address))
        mail.send(Message(f"signup {n}", recipients=[address], body="welcome"))
        db.session.commit()
        return "ok"

    @app.post("/signup-fails/<int:n>")
    def signup_fails(n: int) -> str:
        db.session.add(Signup(email=f"user-{n}@example.com"))
        mail.send(Message(f"rolled back {n}", recipients=["nobody@example.com"], body="x"))
        db.session.rollback()
        return "rolled back"

    return app


def from_env() -> Flask:
    """:func:`create_app` from the ``EXEC_*`` variables."""
    broker = os.environ["EXEC_BROKER_URL"]
    config = json.loads(os.environ.get("EXEC_CONFIG") or "{}")
    if os.environ.get("EXEC_BEAT_SECONDS"):
        config["CELERY"] = dict(CELERY_DEFAULTS, broker_url=broker, beat_schedule=beat_schedule(
            float(os.environ["EXEC_BEAT_SECONDS"]), queue=config.get("OUTBOX_EXECUTOR_QUEUE",
                                                                     "outbox")))
    return create_app(os.environ["EXEC_DB_URL"], int(os.environ["EXEC_SMTP_PORT"]), broker,
                      **config)


if os.environ.get("EXEC_DB_URL"):  # a worker process: `celery -A executor_celery_app`
    logging.getLogger("flask_mail_outbox").setLevel(logging.INFO)
    flask_app = from_env()
    celery_app: Celery = flask_app.extensions["celery"]
