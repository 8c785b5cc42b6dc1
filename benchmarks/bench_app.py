"""The app factory of the processes under test, configured from the environment.

Workers run it as::

    python -m flask --app benchmarks.bench_app:create_app outbox worker --concurrency 4

(from the repository root, or with it on ``PYTHONPATH``); scenario child
processes import it. Variables:

=======================  ==========================================================
``BENCH_DB_URL``         ``SQLALCHEMY_DATABASE_URI`` (required)
``BENCH_SMTP_PORT``      ``MAIL_PORT`` (required); ``MAIL_SERVER`` is
                         ``BENCH_SMTP_HOST`` (default 127.0.0.1)
``BENCH_CONFIG``         a JSON object of further config keys, e.g.
                         ``{"OUTBOX_DURABLE": true, "OUTBOX_LISTEN": false}``
``BENCH_LOG_LEVEL``      level of the library's log lines on stderr (WARNING)
=======================  ==========================================================

The app has no models of its own; the benchmark creates the outbox tables
(:func:`create_tables`) before any process under test starts.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import OutboxMail

SENDER = "Bench <bench@example.com>"
RECIPIENT = "rcpt@example.com"


def config_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The Flask config the environment describes."""
    env = os.environ if environ is None else environ
    config: dict[str, Any] = {
        "SQLALCHEMY_DATABASE_URI": env["BENCH_DB_URL"],
        "MAIL_SERVER": env.get("BENCH_SMTP_HOST", "127.0.0.1"),
        "MAIL_PORT": int(env["BENCH_SMTP_PORT"]),
        "MAIL_DEFAULT_SENDER": SENDER,
        "MAIL_SUPPRESS_SEND": False,
        "MAIL_TIMEOUT": 30.0,
    }
    config.update(json.loads(env.get("BENCH_CONFIG") or "{}"))
    return config


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("flask_mail_outbox")
    if not any(getattr(h, "_bench", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(created).3f %(process)d %(levelname)s %(name)s: %(message)s"))
        handler._bench = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper(), logging.WARNING))


def create_app() -> Flask:
    """A Flask app with Flask-SQLAlchemy and the outbox, from ``BENCH_*`` variables."""
    _configure_logging(os.environ.get("BENCH_LOG_LEVEL", "WARNING"))
    return build_app(config_from_env())


def build_app(config: dict[str, Any]) -> Flask:
    """The same app from an explicit config (for the benchmark process itself)."""
    app = Flask("bench_app")
    app.config.update(MAIL_DEFAULT_SENDER=SENDER, MAIL_SUPPRESS_SEND=False, MAIL_TIMEOUT=30.0)
    app.config.update(config)
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)
    return app


def local_config(db_url: str, smtp_port: int, **outbox: Any) -> dict[str, Any]:
    """``build_app`` config for ``db_url`` and a sink on 127.0.0.1:``smtp_port``."""
    return {"SQLALCHEMY_DATABASE_URI": db_url, "MAIL_SERVER": "127.0.0.1",
            "MAIL_PORT": smtp_port, **outbox}


def create_tables(db_url: str) -> None:
    """Create the outbox tables in ``db_url`` (run once, before the processes under test)."""
    import sqlalchemy as sa

    from flask_mail_outbox._models import metadata

    engine = sa.create_engine(db_url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
