"""An app for crash subprocesses in tests/test_crash_sweep.py.

Run as ``python tests/crash_app.py COMMAND`` with ``PYTHONPATH=<repo>/tests:<repo>``
and the configuration in environment variables (the tables must exist: the test
process creates them):

=========================  ====================================  ===========
variable                   setting                               default
=========================  ====================================  ===========
``CRASH_DB_URL``           ``SQLALCHEMY_DATABASE_URI``           required
``CRASH_SMTP_PORT``        ``MAIL_PORT`` (``MAIL_SERVER`` is     required
                           127.0.0.1)
``CRASH_LEASE_SECONDS``    ``OUTBOX_LEASE_SECONDS``              library's
``CRASH_MIN_AGE``          ``OUTBOX_SWEEP_MIN_AGE_SECONDS``      library's
``CRASH_RUN_SCHEDULER``    ``OUTBOX_RUN_SCHEDULER`` (0/1)        0; 1 for ``serve``
``CRASH_DURABLE``          ``OUTBOX_DURABLE`` (0/1)              library's
``CRASH_RUN_WORKER``       ``OUTBOX_RUN_WORKER`` (0/1)           library's
``CRASH_TRANSPORT``        ``OUTBOX_TRANSPORT``                  library's
``CRASH_INLINE_RETRIES``   ``OUTBOX_INLINE_RETRIES``             library's
``CRASH_BATCH_SIZE``       ``OUTBOX_BATCH_SIZE``                 library's
``CRASH_MAX_ATTEMPTS``     ``OUTBOX_MAX_ATTEMPTS``               library's
``CRASH_SWEEP_BATCH``      ``OUTBOX_SWEEP_BATCH``                library's
``CRASH_MAIL_TIMEOUT``     ``MAIL_TIMEOUT``                      30
``CRASH_SUBJECT``          subject prefix of the emails sent     ``crash``
=========================  ====================================  ===========

Commands (each prints its events on stdout, one line each, flushed):

* ``send N``: queue N emails in one transaction and commit; prints
  ``COMMITTED ids=<id,...>``, then sleeps until killed (delivery, if any, runs in
  this process's background threads meanwhile).
* ``open N``: queue N emails and flush them (the INSERTs ran), but never commit;
  prints ``OPEN ids=<id,...>``, then sleeps until killed with the transaction open.
* ``serve``: build the app as a serving process (outside any click command, so
  the startup sweep is scheduled), wait up to 60 s for the startup sweep, print
  ``REPORT <json>`` (``null`` when it did not run or failed), stop, exit 0.

Transports for ``CRASH_TRANSPORT`` (crash points inside delivery):

* ``crash_app:SleepingTransport``: prints ``CLAIMED ids=<id,...>`` when the
  claimed rows are handed to it, then never returns (killed "after claim,
  before SMTP").
* ``crash_app:KillAfterAcceptTransport``: the real SMTP transport; once
  ``send_many`` returns with the server's acceptance, prints ``ACCEPTED
  ids=<id,...>`` and SIGKILLs its own process before the outcome is recorded.

The library logs to stderr at INFO.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.transports import (
    Delivered,
    Envelope,
    Report,
    Result,
    Sending,
    SMTPTransport,
    Transport,
)

_ENV_KEYS: dict[str, tuple[str, type]] = {
    "CRASH_LEASE_SECONDS": ("OUTBOX_LEASE_SECONDS", float),
    "CRASH_MIN_AGE": ("OUTBOX_SWEEP_MIN_AGE_SECONDS", float),
    "CRASH_INLINE_RETRIES": ("OUTBOX_INLINE_RETRIES", int),
    "CRASH_BATCH_SIZE": ("OUTBOX_BATCH_SIZE", int),
    "CRASH_MAX_ATTEMPTS": ("OUTBOX_MAX_ATTEMPTS", int),
    "CRASH_SWEEP_BATCH": ("OUTBOX_SWEEP_BATCH", int),
    "CRASH_MAIL_TIMEOUT": ("MAIL_TIMEOUT", float),
    "CRASH_TRANSPORT": ("OUTBOX_TRANSPORT", str),
}
_ENV_FLAGS: dict[str, str] = {
    "CRASH_RUN_SCHEDULER": "OUTBOX_RUN_SCHEDULER",
    "CRASH_DURABLE": "OUTBOX_DURABLE",
    "CRASH_RUN_WORKER": "OUTBOX_RUN_WORKER",
}


def emit(line: str) -> None:
    """One event line on stdout, flushed at once (the test reads it while we run)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _ids(envelopes: Sequence[Envelope]) -> str:
    return ",".join(str(e.email_id) for e in envelopes)


class SleepingTransport(Transport):
    """Takes the claimed rows and never sends them: a process stuck after its claim."""

    def send(self, envelope: Envelope) -> dict[str, tuple[int, str]]:
        emit(f"CLAIMED ids={_ids([envelope])}")
        while True:
            threading.Event().wait()  # until the test kills this process


class KillAfterAcceptTransport(SMTPTransport):
    """SMTP, then death between the server's 250 and the status write."""

    def open(self, report: Report) -> Sending:
        def report_then_die(envelope: Envelope, result: Result) -> None:
            if isinstance(result, Delivered):
                emit(f"ACCEPTED ids={_ids([envelope])}")
                os.kill(os.getpid(), signal.SIGKILL)
            report(envelope, result)

        return super().open(report_then_die)


def _configure_logging() -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(created).3f %(process)d %(threadName)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("flask_mail_outbox").setLevel(logging.INFO)


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def create_app() -> Flask:
    """The app, configured from ``CRASH_*`` environment variables."""
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["CRASH_DB_URL"],
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=int(os.environ["CRASH_SMTP_PORT"]),
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        MAIL_TIMEOUT=30.0,
        OUTBOX_RUN_SCHEDULER=_flag(os.environ.get("CRASH_RUN_SCHEDULER", "0")),
        # The tests' fast retry schedule (2 s doubling, 5 attempts), kept
        # explicitly: the library's defaults wait a minute and try for a day.
        OUTBOX_RETRY_BASE_SECONDS=2.0,
        OUTBOX_MAX_ATTEMPTS=5,
    )
    for env, (key, kind) in _ENV_KEYS.items():
        if os.environ.get(env):
            app.config[key] = kind(os.environ[env])
    for env, key in _ENV_FLAGS.items():
        if os.environ.get(env):
            app.config[key] = _flag(os.environ[env])
    db = SQLAlchemy(app)
    OutboxMail(app, db=db)
    app.extensions["crash_db"] = db
    return app


def _queue(app: Flask, count: int) -> list[int]:
    mail: OutboxMail = app.extensions["mail_outbox"].ext
    prefix = os.environ.get("CRASH_SUBJECT", "crash")
    return [mail.send(Message(f"{prefix}-{i}", recipients=["rcpt@example.com"],
                              body=f"{prefix} body {i}"))
            for i in range(count)]


def _sleep_forever() -> None:
    while True:
        threading.Event().wait()  # until the test kills this process


def main(argv: Sequence[str]) -> int:
    """Run one command (see the module docstring)."""
    _configure_logging()
    command, *rest = argv
    if command == "serve":
        os.environ.setdefault("CRASH_RUN_SCHEDULER", "1")
        app = create_app()
        mail: OutboxMail = app.extensions["mail_outbox"].ext
        with app.app_context():
            report = mail.wait_sweep(60)
        emit("REPORT " + json.dumps(report.as_dict() if report is not None else None))
        mail.stop()
        return 0
    if command in ("send", "open"):
        count = int(rest[0]) if rest else 1
        app = create_app()
        db: SQLAlchemy = app.extensions["crash_db"]
        with app.app_context():
            ids = _queue(app, count)
            db.session.flush()
            if command == "open":
                emit(f"OPEN ids={','.join(map(str, ids))}")
                _sleep_forever()
            db.session.commit()
            emit(f"COMMITTED ids={','.join(map(str, ids))}")
        _sleep_forever()
    raise SystemExit(f"unknown command {command!r} (send N | open N | serve)")


if __name__ == "__main__":
    # Run through the importable module, so that OUTBOX_TRANSPORT="crash_app:..."
    # names the same classes this process uses.
    import crash_app

    sys.exit(crash_app.main(sys.argv[1:]))
