"""``init_app`` touches no database: an app is created with its database down.

Flask-SQLAlchemy creates its engines without connecting; the outbox does the
same. What it needs on each connection (SQLite's WAL mode) is set by the
engine's ``connect`` event, on the first connection, before the first write.
So an app whose database is down starts, and ``flask outbox bounce`` exits 75
(EX_TEMPFAIL: the MTA keeps the bounce and delivers it again later) instead
of failing at ``create_app()`` with a traceback and exit 1, which makes the
MTA return the bounce to its sender.

The databases down here are real: an SQLite file under a path whose parent is
a regular file (no one, root included, can create it), and a PostgreSQL URL on
a port where nothing listens.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import free_port
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import Message, OutboxMail

ROOT = Path(__file__).resolve().parent.parent
DSN = (Path(__file__).parent / "bounces" / "postfix-hard-5.1.1.eml").read_bytes()

APP = textwrap.dedent('''
    import os

    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_mail_outbox import OutboxMail

    db = SQLAlchemy()
    mail = OutboxMail()


    def create_app():
        app = Flask(__name__)
        app.config.update(SQLALCHEMY_DATABASE_URI=os.environ["OUTBOX_DOWN_URL"],
                          MAIL_DEFAULT_SENDER="shop@example.com")
        db.init_app(app)
        mail.init_app(app)
        return app
''')


def unopenable_sqlite(tmp_path: Path) -> str:
    """An SQLite URL whose file cannot be created: its parent directory is a regular file."""
    parent = tmp_path / "not-a-directory"
    parent.write_text("a file, so nothing can be created under it\n")
    return f"sqlite:///{parent / 'app.db'}"


def stopped_postgres() -> str:
    """A PostgreSQL URL on a port of this machine where nothing listens."""
    return f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/outbox"


def down_url(kind: str, tmp_path: Path) -> str:
    return unopenable_sqlite(tmp_path) if kind == "sqlite" else stopped_postgres()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_an_app_is_created_with_its_database_down(kind: str, tmp_path: Path) -> None:
    url = down_url(kind, tmp_path)
    with pytest.raises(sa.exc.OperationalError):  # the database is really down
        sa.create_engine(url).connect().close()
    db = SQLAlchemy()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, MAIL_DEFAULT_SENDER="shop@example.com")
    db.init_app(app)
    mail = OutboxMail(app)
    assert app.extensions["mail_outbox"].ext is mail
    with app.app_context():
        # The first statement is what meets the database, and says it is down.
        with pytest.raises(sa.exc.OperationalError):
            mail.send(Message("Hi", ["ann@example.com"], "x"))
        db.session.rollback()
    mail.stop()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_flask_outbox_bounce_exits_75_while_the_database_is_down(
        kind: str, tmp_path: Path) -> None:
    (tmp_path / "downapp.py").write_text(APP, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASK_")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               OUTBOX_DOWN_URL=down_url(kind, tmp_path), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "downapp:create_app", "outbox", "bounce"],
        input=DSN, cwd=tmp_path, env=env, capture_output=True, timeout=60, check=False)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 75, stderr
    assert "exit 75" in stderr


def test_sqlite_is_in_wal_mode_before_the_first_write(tmp_path: Path) -> None:
    """WAL is set on the app's engine's first connection: the first writer finds it so."""
    path = tmp_path / "app.db"
    db = SQLAlchemy()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{path}",
                      MAIL_DEFAULT_SENDER="shop@example.com")
    db.init_app(app)
    mail = OutboxMail(app)
    assert not path.exists()  # init_app opened nothing
    with app.app_context():
        # The first connection is the app's own session (the outbox's engine is not made yet).
        db.session.execute(sa.text("CREATE TABLE account (id INTEGER PRIMARY KEY)"))
        journal = db.session.execute(sa.text("PRAGMA journal_mode")).scalar_one()
        db.session.commit()
        assert app.extensions["mail_outbox"].current_outbox() is None
    assert journal == "wal"
    with sqlite3.connect(path) as conn:  # WAL is the file's, persistent
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    mail.stop()


def test_a_request_that_sends_and_rolls_back_builds_no_delivery_core(tmp_path: Path) -> None:
    """On SQLite, ``send()`` and a rollback ask the producer for nothing of delivery: no
    engine of the outbox's own, no worker; the core is made by the first commit that needs it."""
    db = SQLAlchemy()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'app.db'}",
                      MAIL_DEFAULT_SENDER="shop@example.com", MAIL_SUPPRESS_SEND=True)
    db.init_app(app)
    mail = OutboxMail(app)
    state = app.extensions["mail_outbox"]
    with app.app_context():
        mail.create_all()
        assert state.current_outbox() is None
        mail.send(Message("hi", recipients=["ann@example.com"], body="x"))
        db.session.rollback()
        assert state.current_outbox() is None
        mail.send(Message("hi", recipients=["ann@example.com"], body="x"))
        db.session.commit()
        assert state.current_outbox() is not None  # the commit delivers
    mail.stop()
