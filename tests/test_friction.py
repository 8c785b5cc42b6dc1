"""Issue 41's first-day frictions: what a new user meets before any email goes out.

The worker's exit status with no database, the texts of four log lines, the
suppression list's count under ``--prefix``, and ``cancel abc``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MakeApps, free_port
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._webhooks._base import WebhookRefused, check_timestamp

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PACKAGE = REPO / "flask_mail_outbox"


def outbox_command(db_url: str, *args: str,
                   timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``flask outbox ARGS`` in its own process, for an app that configures no logging."""
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}",
           "DEPLOY_DB_URL": db_url, "DEPLOY_SMTP_PORT": str(free_port())}
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "gunicorn_app:create_app", "outbox", *args],
        env=env, cwd=str(TESTS), capture_output=True, text=True, timeout=timeout, check=False)


# --- item 3: the worker with no database ---------------------------------------------------

@pytest.mark.parametrize("once", [True, False], ids=["once", "long-running"])
def test_a_worker_without_the_outbox_tables_exits_78_in_one_line(db_url: str,
                                                                 once: bool) -> None:
    """``db_url`` is an empty database (the fixture drops the outbox tables on PostgreSQL;
    the SQLite file does not exist yet): no traceback, the migration command, exit 78."""
    started = time.monotonic()
    result = outbox_command(db_url, "worker", *(["--once"] if once else []))
    assert result.returncode == 78, result.stdout + result.stderr
    assert time.monotonic() - started < 30, "the long-running worker must not wait"
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert "the outbox tables do not exist" in line and "flask db upgrade heads" in line
    assert "email(s) handled" not in result.stdout


def test_a_worker_that_cannot_reach_the_database_exits_75_without_the_password() -> None:
    url = f"postgresql+psycopg://outbox:s3cret-pw@127.0.0.1:{free_port()}/outbox"
    result = outbox_command(url, "worker", "--once")
    assert result.returncode == 75, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert "cannot reach the database postgresql+psycopg://outbox:***@127.0.0.1" in line
    assert "s3cret-pw" not in result.stderr + result.stdout


def test_a_worker_once_with_its_tables_still_exits_0(make_apps: MakeApps,
                                                    db_url: str) -> None:
    make_apps()  # creates the tables
    result = outbox_command(db_url, "worker", "--once")
    assert result.returncode == 0, result.stderr
    assert "worker --once: 0 email(s) handled" in result.stdout


# --- item 7: log texts ---------------------------------------------------------------------

def left_queued_fix(app: Flask, mail: OutboxMail, caplog: pytest.LogCaptureFixture,
                    to: str) -> str:
    """The Fix of the ERROR that reports one email, to ``to``, left queued by inline delivery."""
    from conftest import db

    with app.app_context():
        email_id = mail.send(Message("x", recipients=[to], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR
               and f"Email {email_id} could not be delivered" in r.getMessage()]
    return error.getMessage().split("Fix: ", 1)[1].replace(str(email_id), "<id>")


def test_a_full_mailbox_is_not_blamed_on_the_server_settings(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    smtp_server.refuse_recipient("full@example.com", 452, "4.2.2 Mailbox full")
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_INLINE_RETRIES=0)
    fix = left_queued_fix(app, mail, caplog, "full@example.com")
    assert "MAIL_SERVER" not in fix and "MAIL_PORT" not in fix
    assert "recipient's mailbox (mailbox_full)" in fix
    assert "flask outbox cancel <id>" in fix


def test_a_server_closing_at_its_greeting_still_points_at_the_server_settings(
        make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    # (A refused connection pauses the transport: its ERROR is the pause's, see test_pause.)
    smtp_server.reply("connect", 421, "4.3.2 Service not available, closing channel")
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_INLINE_RETRIES=0, MAIL_TIMEOUT=2)
    fix = left_queued_fix(app, mail, caplog, "a@example.com")
    assert fix.startswith("check the transport's settings (MAIL_SERVER and MAIL_PORT")


@pytest.mark.parametrize(("offset", "said"), [(-601, "601 s ago"),
                                              (+420, "420 s in the future")])
def test_a_webhook_timestamp_outside_the_window_says_ago_or_ahead(offset: int,
                                                                 said: str) -> None:
    now = 1_800_000_000.0
    with pytest.raises(WebhookRefused) as refused:
        check_timestamp(now + offset, now)
    assert f"the signed timestamp is {said}," in str(refused.value)
    assert "from now" not in str(refused.value)


def test_no_log_text_doubles_a_quote_after_a_repr() -> None:
    """``transport 'default''s learned rate``: a possessive after ``%r``/``!r}`` reads as
    a doubled quote."""
    found = [f"{path.relative_to(REPO)}:{number}"
             for path in PACKAGE.rglob("*.py")
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"(%r|!r\})'s\b", line)]
    assert found == []


def test_cancel_abc_names_the_argument_and_the_accepted_forms(make_apps: MakeApps) -> None:
    app, _ = make_apps()
    result = app.test_cli_runner().invoke(args=["outbox", "cancel", "abc"])
    assert result.exit_code == 2
    assert "'abc' is not an email id" in result.output
    assert "IDS" in result.output and "--key" in result.output
    assert "integer range" not in result.output
    dlq = app.test_cli_runner().invoke(args=["outbox", "dlq", "retry", "0"])
    assert dlq.exit_code == 2 and "'0' is not an email id" in dlq.output
    assert "--all" in dlq.output


# --- item 9: suppression list --prefix -----------------------------------------------------

def test_suppression_list_counts_further_matches_of_the_prefix(make_apps: MakeApps) -> None:
    app, mail = make_apps()
    with app.app_context():
        for address in ("alice@example.com", "bob@example.com", "gina@example.com",
                        "gisela@example.com", "gita@example.com"):
            mail.suppress(address)
    runner = app.test_cli_runner()
    one = runner.invoke(args=["outbox", "suppression", "list", "--prefix", "gin"])
    assert one.exit_code == 0 and "gina@example.com" in one.output
    assert "more" not in one.output, one.output
    first = runner.invoke(args=["outbox", "suppression", "list", "--prefix", "gi",
                                "--limit", "1"])
    assert "gina@example.com" in first.output
    assert "... 2 more starting with 'gi'" in first.output, first.output
    every = runner.invoke(args=["outbox", "suppression", "list", "--limit", "2"])
    assert "... 3 more (" in every.output, every.output


# --- item 6: missing tables at send() ------------------------------------------------------

def test_send_without_the_outbox_tables_says_how_to_create_them(make_apps: MakeApps) -> None:
    from conftest import db

    from flask_mail_outbox import ConfigError
    from flask_mail_outbox.core import metadata

    app, mail = make_apps()
    with app.app_context():
        metadata.drop_all(db.engine)
        for send in (lambda: mail.send(Message("x", recipients=["a@example.com"], body="x")),
                     lambda: mail.send_many([Message("x", recipients=["a@example.com"],
                                                     body="x")] * 2)):
            with pytest.raises(ConfigError) as raised:
                send()
            db.session.rollback()
            text = str(raised.value)
            assert text.startswith("SQLALCHEMY_DATABASE_URI: the outbox tables do not exist")
            assert "flask db upgrade heads" in text and "mail.create_all()" in text
            assert "INSERT" not in text and raised.value.__suppress_context__
        # The app's own tables are untouched and usable: only the outbox's were missing.
        mail.create_all()
        email_id = mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert email_id >= 1


# --- item 8: a database the outbox does not run on -----------------------------------------

@pytest.mark.parametrize(("uri", "mysql"), [("mysql+pymysql://app:pw@db.example.com/app", True),
                                           ("mariadb://app:pw@db.example.com/app", True),
                                           ("mssql+pyodbc://app:pw@dsn", False)])
def test_init_app_refuses_an_unsupported_database_naming_the_key(uri: str,
                                                                 mysql: bool) -> None:
    """Refused from the URL alone, before any engine: none of these drivers is installed,
    and the message, not a ModuleNotFoundError, is what the user sees from init_app."""
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_mail_outbox import ConfigError, OutboxMail

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = uri
    with pytest.raises(ConfigError) as refused:
        OutboxMail(app, db=SQLAlchemy())  # a db not yet bound to the app: no engine made
    text = str(refused.value)
    assert refused.value.key == "SQLALCHEMY_DATABASE_URI"
    assert "postgresql+psycopg://" in text and "sqlite:///" in text
    assert ("MySQL and MariaDB are not supported" in text) is mysql
    assert "pw" not in text
    assert "mail_outbox" not in app.extensions


def test_a_plain_postgresql_url_means_what_the_docs_say(pg_database: str | None,
                                                      smtp_server: FaultSMTPServer) -> None:
    """SQLAlchemy 2.0 reads ``postgresql://`` as psycopg2, 2.1 as psycopg 3 (docs/deploying.md);
    on 2.1 such a URL delivers end to end."""
    import sqlalchemy as sa
    from conftest import close_app, db, empty_postgres, make_app, require_postgres

    require_postgres()
    assert pg_database is not None
    version = tuple(int(part) for part in sa.__version__.split(".")[:2])
    driver = sa.make_url("postgresql://").get_dialect().driver
    assert driver == ("psycopg" if version >= (2, 1) else "psycopg2")
    if driver != "psycopg":
        return  # psycopg2 is not installed here: the docs tell 2.0 users to name psycopg
    url = empty_postgres(pg_database).replace("postgresql+psycopg://", "postgresql://", 1)
    assert url.startswith("postgresql://")
    app = make_app(url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    try:
        with app.app_context():
            app.extensions["test_mail"].send(Message("plain", recipients=["a@example.com"],
                                                     body="x"))
            db.session.commit()
        assert smtp_server.wait_for(1, timeout=20)
    finally:
        close_app(app)


def test_the_dashboard_table_of_docs_operations_lists_every_page(tmp_path: Path) -> None:
    """Every page (GET route) of the dashboard's blueprint is a row of docs/operations.md's
    table, and every row is a page."""
    from conftest import close_app, make_app
    from dashboard_helpers import Gate

    app = make_app(f"sqlite:///{tmp_path / 'dashboard.db'}")
    try:
        app.register_blueprint(app.extensions["test_mail"].dashboard_blueprint(
            authorize=Gate()), url_prefix="/outbox")
        pages = {re.sub(r"<int:\w+>", "<id>", rule.rule.removeprefix("/outbox"))
                 for rule in app.url_map.iter_rules()
                 if rule.endpoint.startswith("outbox_dashboard.") and "GET" in (rule.methods or ())
                 and not rule.endpoint.endswith(".static")}
    finally:
        close_app(app)
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    table = text.split("| page | shows | actions (POST) |", 1)[1].split("\n\n", 1)[0]
    rows = set(re.findall(r"^\| `([^`]+)`", table, re.MULTILINE))
    assert pages == rows


# --- item 8: every documented signature is the code's --------------------------------------

def documented_signatures() -> list[tuple[str, str, str]]:
    """``(where, method, parameters)`` of every ``mail.NAME(...)`` written as a signature
    (with a bare ``*,``: a call never has one) in a backtick span of README.md or docs/."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"`mail\.(\w+)\(([^`]*)\)`", text):
            params = " ".join(match.group(2).split())
            if re.search(r"(^|, )\*, ", params):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(REPO)}:{line}", match.group(1), params))
    return found


def test_every_documented_signature_matches_the_code() -> None:
    import ast
    import inspect

    from flask_mail_outbox import OutboxMail

    checked = 0
    problems = []
    for where, method, params in documented_signatures():
        try:
            tree = ast.parse(f"def f({params}): pass")
        except SyntaxError:  # "messages, ...": an abbreviation, not a signature
            continue
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        args = function.args
        documented: dict[str, object] = {}
        positional = [*args.posonlyargs, *args.args]
        for arg, default in zip(positional[::-1], args.defaults[::-1]):
            documented[arg.arg] = ast.literal_eval(default)
        documented.update({arg.arg: inspect.Parameter.empty for arg in positional
                           if arg.arg not in documented})
        for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
            documented[arg.arg] = (inspect.Parameter.empty if kw_default is None
                                   else ast.literal_eval(kw_default))
        if args.vararg is not None:
            documented["*"] = inspect.Parameter.empty
        if args.kwarg is not None:  # its name is the docs' choice (**message_fields)
            documented["**"] = inspect.Parameter.empty
        stars: dict[inspect._ParameterKind, str] = {inspect.Parameter.VAR_POSITIONAL: "*",
                                                     inspect.Parameter.VAR_KEYWORD: "**"}
        code = {stars.get(p.kind, name): p.default
                for name, p in inspect.signature(getattr(OutboxMail, method)).parameters.items()
                if name != "self"}
        if documented != code:
            problems.append(f"{where}: mail.{method}({params}) but the code has {code}")
        checked += 1
    assert checked >= 6
    assert problems == []
