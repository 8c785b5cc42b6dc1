"""A writer process for tests/test_sqlite_locking.py: requests that send and commit.

Run as ``python tests/chaos_app.py THREADS REQUESTS`` with
``PYTHONPATH=<repo>/tests:<repo>`` and

=====================  ==============================================
variable               meaning
=====================  ==============================================
``CHAOS_DB_URL``       ``SQLALCHEMY_DATABASE_URI`` (tables must exist)
``CHAOS_SMTP_PORT``    ``MAIL_PORT`` (``MAIL_SERVER`` is 127.0.0.1)
``CHAOS_NAME``         prefix of the subjects (unique per process)
=====================  ==============================================

The app is durable with its own dispatcher (``OUTBOX_RUN_WORKER``), polling
fast in small batches, so this process claims and records while its
``THREADS`` threads each make ``REQUESTS`` requests to ``POST /signup`` (a user
row and an email, one commit). Every exception a request raises is printed on
stdout as ``EXC <thread> <type>: <text>``; ``DONE sent=<n> errors=<n>`` ends
the run, after ``mail.stop()`` (sends in flight finish, unstarted claims are
released for the other processes). Library logs go to stderr at INFO. Exit
status 1 when any request raised.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_mail_outbox import Message, OutboxMail


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Signup(db.Model):  # type: ignore[name-defined,misc]
    """The app's own row, committed with the email."""

    __tablename__ = "chaos_signup"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]


def create_app(db_url: str, smtp_port: int, name: str) -> Flask:
    """The writer app (see the module docstring); subjects are ``"<name> <n>"``."""
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=db_url,
        MAIL_SERVER="127.0.0.1",
        MAIL_PORT=smtp_port,
        MAIL_DEFAULT_SENDER="Sender <sender@example.com>",
        MAIL_SUPPRESS_SEND=False,
        PROPAGATE_EXCEPTIONS=True,  # a failing request raises in the calling thread
        OUTBOX_DURABLE=True,
        OUTBOX_RUN_SCHEDULER=False,
        OUTBOX_BATCH_SIZE=5,
        OUTBOX_POLL_INTERVAL=0.05,
        OUTBOX_POLL_MAX_INTERVAL=0.2,
        # The tests' fast retry schedule (2 s doubling, 5 attempts), kept
        # explicitly: the library's defaults wait a minute and try for a day.
        OUTBOX_RETRY_BASE_SECONDS=2.0,
        OUTBOX_MAX_ATTEMPTS=5,
    )
    db.init_app(app)
    mail = OutboxMail(app, db=db)

    @app.post("/signup/<int:n>")
    def signup(n: int) -> str:
        address = f"{name}-{n}@example.com"
        db.session.add(Signup(email=address))
        mail.send(Message(f"{name} {n}", recipients=[address], body="welcome"))
        db.session.commit()
        return "ok"

    return app


def run_writers(app: Flask, threads: int, requests: int) -> tuple[int, list[str]]:
    """``threads`` threads each make ``requests`` signups; (requests done, exceptions)."""
    lock = threading.Lock()
    errors: list[str] = []
    done = [0]

    def write(index: int) -> None:
        client = app.test_client()
        for i in range(requests):
            try:
                client.post(f"/signup/{index * requests + i}")
            except Exception as exc:  # noqa: BLE001 - returned: the test fails on it
                with lock:
                    errors.append(f"EXC {index} {type(exc).__name__}: {exc}")
            else:
                with lock:
                    done[0] += 1

    workers = [threading.Thread(target=write, args=(i,), name=f"writer-{i}")
               for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return done[0], errors


def main(threads: int, requests: int) -> int:
    """Run the writers; print every exception; 1 if any."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(created).3f %(process)d [%(threadName)s] %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("flask_mail_outbox").setLevel(logging.INFO)
    app = create_app(os.environ["CHAOS_DB_URL"], int(os.environ["CHAOS_SMTP_PORT"]),
                     os.environ.get("CHAOS_NAME", "writer"))
    done, errors = run_writers(app, threads, requests)
    mail: OutboxMail = app.extensions["mail_outbox"].ext
    mail.stop(timeout=30)
    for line in errors:
        print(line, flush=True)
    print(f"DONE sent={done} errors={len(errors)}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
