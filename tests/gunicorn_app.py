"""The README's signup app as gunicorn serves it, for tests/test_deploy.py.

Run as ``gunicorn -w 2 [--preload] -b 127.0.0.1:PORT 'gunicorn_app:serve()'`` from
``tests/`` with ``PYTHONPATH=<repo>/tests:<repo>``, or as ``flask --app
gunicorn_app:create_app outbox ...`` (an app that configures no logging), and

======================  ==============================================  ========
variable                meaning                                         default
======================  ==============================================  ========
``DEPLOY_DB_URL``       ``SQLALCHEMY_DATABASE_URI`` (tables must exist)  required
``DEPLOY_SMTP_PORT``    ``MAIL_PORT`` (``MAIL_SERVER`` is 127.0.0.1)    required
``DEPLOY_DURABLE``      ``OUTBOX_DURABLE`` (``0``/``1``)                 ``0``
======================  ==============================================  ========

Everything else is the library's default, the age gate
(``OUTBOX_SWEEP_MIN_AGE_SECONDS``, 300 s) included. ``POST /signup/<n>`` adds a
user row (the tests' ``test_user`` table, so ``conftest.make_app`` creates it)
and one email (subject ``signup <n>``) in one commit, as the README's view
does; ``GET /ready`` answers this worker's pid. ``serve()`` also configures
logging as an app would: every record at INFO and above of the library goes to
stderr as ``<time> pid=<pid> <LEVEL> <logger>: <message>``, so a test can tell
which process logged what.
"""

from __future__ import annotations

import logging
import os
import sys

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_mail_outbox import Message, OutboxMail


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
mail = OutboxMail()


class DeployUser(db.Model):  # type: ignore[name-defined,misc]
    """The app's own row, committed with the email."""

    __tablename__ = "test_user"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(created).3f pid=%(process)d %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("flask_mail_outbox").setLevel(logging.INFO)


def create_app() -> Flask:
    """The signup app, configured from the environment (see the module docstring)."""
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["DEPLOY_DB_URL"],
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=int(os.environ["DEPLOY_SMTP_PORT"]),
        MAIL_DEFAULT_SENDER="Example <noreply@example.com>",
        MAIL_TIMEOUT=30,
        OUTBOX_DURABLE=os.environ.get("DEPLOY_DURABLE", "0") == "1",
        OUTBOX_CONCURRENCY=int(os.environ.get("DEPLOY_CONCURRENCY", "4")),
    )
    db.init_app(app)
    mail.init_app(app)

    @app.post("/signup/<int:n>")
    def signup(n: int) -> str:
        address = f"user{n}@example.com"
        db.session.add(DeployUser(email=address))
        mail.send(Message(f"signup {n}", recipients=[address], body="Hi!"))
        db.session.commit()
        return "ok"

    @app.get("/ready")
    def ready() -> str:
        return str(os.getpid())

    return app


def serve() -> Flask:
    """What gunicorn loads: the app, with logging configured."""
    _configure_logging()
    return create_app()
