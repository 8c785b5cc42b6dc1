"""The plain install: importing the package and sending imports no optional extra.

An extra's module (prometheus_client for ``metrics``, botocore for ``ses``,
inscriptis and lxml for ``html``, Flask-Migrate for ``migrate``, psycopg for
``postgres``) may be imported only where its feature is used. The test suite's
environment has every extra installed, so an import at module level would go
unnoticed here and break every install without that extra (as ``_mail.py``'s
import of the metrics module once did). A child interpreter refuses those imports
with an import hook (a ``sys.meta_path`` finder), as if those were not installed,
then imports the package (and its public modules), makes an app with the
dashboard, asks for its health, sends an html-only email (whose text part
the standard-library renderer makes without the ``html`` extra) through to
``sent``, and runs ``flask outbox status``'s command. An optional import on that
path that does not fall back fails it with the hook's ImportError.

scripts/check-install proves the same with real installs of the wheel, in CI;
this keeps it so between CI runs, in a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The top-level modules of the optional extras (and what they bring).
OPTIONAL = ("prometheus_client", "botocore", "boto3", "inscriptis", "lxml", "flask_migrate",
            "alembic", "psycopg", "psycopg_binary", "psycopg2", "sphinx", "myst_parser",
            "opentelemetry")

_CHILD = textwrap.dedent('''
    import json, os, sqlite3, sys, traceback

    BLOCKED = frozenset(json.loads(sys.argv[1]))
    refused = []

    class RefuseOptional:
        """Refuses every import of an optional extra's module, noting who asked."""

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                refused.append(name + "\\n" + "".join(traceback.format_stack(limit=12)))
                raise ImportError(f"{name} is an optional extra's module (blocked by the test)")
            return None

    sys.meta_path.insert(0, RefuseOptional())

    import flask_mail_outbox
    import flask_mail_outbox.core
    import flask_mail_outbox.migrations
    import flask_mail_outbox.transports
    from flask_mail_outbox import Message, OutboxMail
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    db_path = sys.argv[2]
    app = Flask("plain")
    app.config.update(TESTING=True, SQLALCHEMY_DATABASE_URI="sqlite:///" + db_path,
                      SECRET_KEY="a test's secret key, long enough for the dashboard",
                      MAIL_DEFAULT_SENDER="Example <noreply@example.com>")
    db = SQLAlchemy(app)
    mail = OutboxMail(app)
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True), url_prefix="/outbox")
    with app.app_context():
        mail.create_all()
        health = mail.health()
        with mail.record_messages() as delivered:
            email_id = mail.send(Message("Welcome", recipients=["ann@example.com"],
                                         html="<p>Hi <b>Ann</b></p>"))
            db.session.commit()
    with sqlite3.connect(db_path) as con:
        [(status,)] = con.execute("SELECT status FROM outbox_email WHERE id = ?", (email_id,))
    page = app.test_client().get("/outbox/")
    result = app.test_cli_runner().invoke(args=["outbox", "status", "--json"])
    print(json.dumps({
        "status": status,
        "health": sorted(health),
        "dashboard": page.status_code,
        "delivered": [m.subject for m in delivered],
        "cli_exit": result.exit_code,
        "cli_output": result.output,
        "refused": refused,
        "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
        "package": flask_mail_outbox.__file__,
    }))
''')


def test_the_plain_path_imports_no_optional_extra(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASK_APP")}
    env["PYTHONPATH"] = str(ROOT)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(OPTIONAL), str(tmp_path / "app.db")],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=env)
    # An import at module level fails the child with the hook's ImportError.
    assert child.returncode == 0, child.stderr[-6000:]
    report = json.loads(child.stdout.splitlines()[-1])
    # The package under test is this checkout's.
    assert Path(report["package"]).resolve().is_relative_to(ROOT), report["package"]
    # Where a feature only prefers an extra (the html renderer tries inscriptis), the
    # refusal is an absent extra and its fallback runs: nothing optional got loaded.
    assert report["loaded"] == [], report["refused"]
    assert report["status"] == "sent"
    assert report["health"], "mail.health() said nothing"
    assert report["dashboard"] == 200
    assert report["delivered"] == ["Welcome"]
    assert report["cli_exit"] == 0, report["cli_output"]
    assert json.loads(report["cli_output"])["counts"]["sent"] == 1, report["cli_output"]
