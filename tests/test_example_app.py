"""The example app end to end: its signup form, its migrations, a real SMTP server.

Each test builds the app with ``example_app.create_app(config)`` on a SQLite file and on
PostgreSQL, creates the schema the way ``scripts/run-example`` does (Flask-Migrate's
``upgrade heads`` over the repository's ``migrations/``, the library's ``outbox`` branch
included; not ``create_all``), and delivers over SMTP to the aiosmtpd server of
``tests/smtpserver.py``.

The fixture is not called ``app``: pytest-flask would push a request context around every
test that uses a fixture of that name, and these tests go through the test client.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flask_migrate  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from conftest import drop_example_tables, poll
from flask import Flask, render_template, url_for
from flask.testing import FlaskClient
from markupsafe import escape
from smtpserver import FaultSMTPServer, ReceivedMessage
from werkzeug.test import TestResponse

import example_app.views
from example_app import create_app
from example_app.extensions import db, mail
from flask_mail_outbox import InvalidMessage, Message
from flask_mail_outbox.core import email_table

REPO_ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS_DIR = REPO_ROOT / "migrations"
DUPLICATE = "That email address has already signed up."


@dataclasses.dataclass
class Example:
    """The example app, migrated, sending to ``smtp``."""

    app: Flask
    client: FlaskClient
    smtp: FaultSMTPServer

    def sign_up(self, name: str, email: str, *, follow: bool = False) -> TestResponse:
        """POST the signup form."""
        return self.client.post("/", data={"name": name, "email": email},
                                follow_redirects=follow)

    def users(self) -> list[dict[str, Any]]:
        """The ``users`` table, in id order."""
        with self.app.app_context(), db.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.text("SELECT id, email, name FROM users ORDER BY id")).mappings()]

    def emails(self) -> list[dict[str, Any]]:
        """The ``outbox_email`` table, in id order."""
        with self.app.app_context(), db.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                email_table.select().order_by(email_table.c.id)).mappings()]

    def wait_emails(self, predicate: Callable[[list[dict[str, Any]]], bool],
                    timeout: float = 15.0) -> list[dict[str, Any]]:
        """The email rows once ``predicate`` holds for them (or at ``timeout``)."""
        return poll(self.emails, predicate, timeout=timeout)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """``mail.wait_idle`` (it needs the app's context)."""
        with self.app.app_context():
            return mail.wait_idle(timeout)

    def rendered_welcome(self, name: str, email: str) -> tuple[str, str]:
        """The welcome email's text and HTML as the example's templates render them."""
        user = SimpleNamespace(name=name, email=email)
        with self.app.test_request_context("/"):
            context = {"user": user, "site_url": url_for("example.signup_form", _external=True)}
            return (render_template("email/welcome.txt", **context),
                    render_template("email/welcome.html", **context))


@pytest.fixture
def example(db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Example]:
    """The example app on ``db_url``, migrated, delivering to ``smtp_server``."""
    # create_app reads EXAMPLE_* and FLASK_* variables; the test's config alone counts.
    for name in list(os.environ):
        if name.startswith(("EXAMPLE_", "FLASK_")):
            monkeypatch.delenv(name)
    drop_example_tables(db_url)
    app = create_app(
        {
            "SQLALCHEMY_DATABASE_URI": db_url,
            "TESTING": True,
            # TESTING alone would pick the memory transport; this is about real SMTP.
            "MAIL_SUPPRESS_SEND": False,
            "MAIL_SERVER": smtp_server.host,
            "MAIL_PORT": smtp_server.port,
            "MAIL_TIMEOUT": 5,
            # No sweep jobs: each test builds and drops its schema around the app.
            "OUTBOX_RUN_SCHEDULER": False,
        },
        instance_path=str(tmp_path / "instance"),
    )
    try:
        with app.app_context():
            # What `flask --app example_app db upgrade heads` (scripts/run-example) runs.
            flask_migrate.upgrade(directory=str(MIGRATIONS_DIR), revision="heads")
            db.session.remove()
        yield Example(app=app, client=app.test_client(), smtp=smtp_server)
    finally:
        mail.stop(timeout=5)
        with app.app_context():
            db.session.remove()
            for engine in db.engines.values():
                engine.dispose()
        drop_example_tables(db_url)


def _text(message: ReceivedMessage, subtype: str) -> str:
    parsed: EmailMessage = message.parsed
    part = parsed.get_body(preferencelist=(subtype,))
    assert part is not None and part.get_content_subtype() == subtype, \
        f"no text/{subtype} part in {parsed.get_content_type()}"
    return str(part.get_content()).replace("\r\n", "\n")


def test_schema_comes_from_the_migrations(example: Example) -> None:
    with example.app.app_context():
        tables = set(sa.inspect(db.engine).get_table_names())
        with db.engine.connect() as conn:
            versions = set(conn.execute(
                sa.text("SELECT version_num FROM alembic_version")).scalars())
    assert {"users", "outbox_email", "outbox_attachment", "outbox_setting",
            "alembic_version"} <= tables
    # The example's head, and no merge revision. outbox_0001 is implied (example_0001
    # depends on it); a later outbox revision would be recorded beside the example's head.
    assert versions == {"example_0001"}


def test_signup_form_renders(example: Example) -> None:
    response = example.client.get("/")
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert "<h1>Sign up</h1>" in page
    assert '<form method="post" action="/"' in page
    assert 'name="name"' in page and 'name="email"' in page
    assert example.users() == [] and example.emails() == []


def test_signup_commits_the_user_and_sends_one_welcome_email(example: Example) -> None:
    response = example.sign_up("  Ann Example ", " Ann@Example.COM ")
    assert response.status_code == 302
    assert response.headers["Location"].endswith("/thanks")

    # The address is stored as the example normalises it: stripped and lower-cased.
    [user] = example.users()
    assert (user["name"], user["email"]) == ("Ann Example", "ann@example.com")

    assert example.smtp.wait_for(1)
    [row] = example.wait_emails(lambda rows: bool(rows) and rows[0]["status"] == "sent")
    assert example.wait_idle(10)
    assert row["status"] == "sent" and row["attempts"] == 1
    assert row["idempotency_key"] == f"welcome-{user['id']}"
    assert json.loads(row["recipients"]) == ["ann@example.com"]

    [received] = example.smtp.messages
    assert received.rcpt_tos == ["ann@example.com"]
    assert received.mail_from == "noreply@example.com"
    assert received.message_id == row["message_id"]
    parsed = received.parsed
    assert parsed["Message-ID"] == row["message_id"]
    assert parsed["Subject"] == "Welcome, Ann Example!"
    [to] = parsed["To"].addresses
    assert (to.display_name, to.addr_spec) == ("Ann Example", "ann@example.com")
    [sender] = parsed["From"].addresses
    assert (sender.display_name, sender.addr_spec) == ("Example App", "noreply@example.com")

    # multipart/alternative: the text part first, then the HTML part, both rendered
    # from the example's templates.
    assert parsed.get_content_type() == "multipart/alternative"
    assert [p.get_content_type() for p in parsed.iter_parts()] == ["text/plain", "text/html"]
    text, html = example.rendered_welcome("Ann Example", "ann@example.com")
    assert _text(received, "plain").rstrip("\n") == text.rstrip("\n")
    assert _text(received, "html").rstrip("\n") == html.rstrip("\n")
    assert "Thanks for signing up with ann@example.com." in text
    assert "<strong>ann@example.com</strong>" in html
    assert "http://localhost/" in text and 'href="http://localhost/"' in html

    # The thanks page, after the redirect.
    page = example.client.get("/thanks").get_data(as_text=True)
    assert "Thanks, Ann Example! A welcome email is on its way to ann@example.com." in page
    assert '<span class="name">Ann Example</span>' in page


@pytest.mark.parametrize("address", ["not-an-email", "ann@localhost", "ann@@example.com"])
def test_invalid_address_shows_the_invalid_message_text_and_writes_nothing(
        example: Example, address: str) -> None:
    with example.app.app_context(), pytest.raises(InvalidMessage) as expected:
        # The message the view builds, checked the way mail.send() checks it.
        Message("x", recipients=[("Ann", address)]).as_bytes()
    assert expected.value.field == "recipients[0]"

    response = example.sign_up("Ann", address)
    assert response.status_code == 400
    page = response.get_data(as_text=True)
    assert str(escape(str(expected.value))) in page
    assert "is not a valid email address" in page
    # The form comes back filled in.
    assert f'value="{escape(address)}"' in page

    assert example.wait_idle(5)
    assert example.users() == []
    assert example.emails() == []
    assert not example.smtp.wait_for(1, timeout=0.5)


def test_duplicate_signup_shows_the_duplicate_message_and_sends_nothing_new(
        example: Example) -> None:
    assert example.sign_up("Ann", "ann@example.com").status_code == 302
    assert example.smtp.wait_for(1)
    example.wait_emails(lambda rows: bool(rows) and rows[0]["status"] == "sent")

    # The same address in another case, under another name.
    response = example.sign_up("Ann Again", "ANN@example.com")
    assert response.status_code == 400
    assert escape(DUPLICATE) in response.get_data(as_text=True)

    assert example.wait_idle(5)
    assert not example.smtp.wait_for(2, timeout=0.5)
    assert len(example.smtp.messages) == 1
    assert [u["name"] for u in example.users()] == ["Ann"]
    assert [e["status"] for e in example.emails()] == ["sent"]


def test_duplicate_that_slips_past_the_check_is_caught_by_the_unique_constraint(
        example: Example, monkeypatch: pytest.MonkeyPatch) -> None:
    assert example.sign_up("Ann", "ann@example.com").status_code == 302
    assert example.smtp.wait_for(1)
    example.wait_emails(lambda rows: bool(rows) and rows[0]["status"] == "sent")

    # Two signups of one address racing: both pass the lookup, the second one's flush
    # hits the unique constraint, and its transaction (with no email in it yet) rolls back.
    monkeypatch.setattr(example_app.views, "_already_signed_up", lambda email: False)
    response = example.sign_up("Ann Again", "ann@example.com")
    assert response.status_code == 400
    assert escape(DUPLICATE) in response.get_data(as_text=True)

    assert example.wait_idle(5)
    assert not example.smtp.wait_for(2, timeout=0.5)
    assert [u["name"] for u in example.users()] == ["Ann"]
    assert len(example.emails()) == 1


def test_names_are_escaped_on_the_pages_and_in_the_html_email(example: Example) -> None:
    name = "<script>x</script>"
    escaped = "&lt;script&gt;x&lt;/script&gt;"

    response = example.sign_up(name, "xss@example.com", follow=True)
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert "<h1>Thanks for signing up</h1>" in page
    assert name not in page
    assert f"Thanks, {escaped}! A welcome email" in page  # the flashed message
    assert f'<span class="name">{escaped}</span>' in page  # the recent signups

    assert example.smtp.wait_for(1)
    assert example.wait_idle(10)
    [received] = example.smtp.messages
    html = _text(received, "html")
    assert "<script" not in html
    assert f"<title>Welcome, {escaped}!</title>" in html
    assert f"Welcome, {escaped}!</h1>" in html
    # Plain text and headers are not HTML: the name is there as typed.
    assert "Welcome, <script>x</script>!" in _text(received, "plain")
    assert received.parsed["Subject"] == "Welcome, <script>x</script>!"
    [to] = received.parsed["To"].addresses
    assert (to.display_name, to.addr_spec) == (name, "xss@example.com")

    # A form shown again escapes what was typed into its value attributes.
    response = example.sign_up('"><script>y</script>', "")
    assert response.status_code == 400
    page = response.get_data(as_text=True)
    assert "<script>y" not in page
    assert 'value="&#34;&gt;&lt;script&gt;y&lt;/script&gt;"' in page
    assert "Please enter your email address." in page
