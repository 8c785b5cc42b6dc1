"""The example app end to end: its signup form, its migrations, a real SMTP server.

The welcome email is a template (``example_app/templates/email/welcome.*``) in English
and German: the tests check what arrives against the outbox's renderer, the row's
template columns, both ways of picking German, the preview, and the German catalog
(complete, and its committed ``.mo`` compiled from the ``.po`` as it stands).

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
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import flask_migrate  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from babel.messages.extract import extract_from_dir
from babel.messages.frontend import parse_mapping_cfg
from babel.messages.mofile import read_mo, write_mo
from babel.messages.pofile import read_po
from conftest import drop_example_tables, poll
from flask import Flask
from flask.testing import FlaskClient
from markupsafe import escape
from smtpserver import FaultSMTPServer, ReceivedMessage
from werkzeug.test import TestResponse

import example_app.views
from example_app import create_app
from example_app.extensions import db, mail
from flask_mail_outbox import InvalidMessage, Message
from flask_mail_outbox.core import email_table

if TYPE_CHECKING:
    from flask_mail_outbox._flask.templating import RenderedEmail

REPO_ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS_DIR = REPO_ROOT / "migrations"
EXAMPLE_DIR = REPO_ROOT / "example_app"
GERMAN = EXAMPLE_DIR / "translations" / "de" / "LC_MESSAGES"
DUPLICATE = "That email address has already signed up."


@dataclasses.dataclass
class Example:
    """The example app, migrated, sending to ``smtp``."""

    app: Flask
    client: FlaskClient
    smtp: FaultSMTPServer

    def sign_up(self, name: str, email: str, *, locale: str = "", follow: bool = False,
                accept_language: str | None = None) -> TestResponse:
        """POST the signup form (``locale`` "": "Your browser's language")."""
        headers = {"Accept-Language": accept_language} if accept_language else {}
        return self.client.post("/", data={"name": name, "email": email, "locale": locale},
                                headers=headers, follow_redirects=follow)

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

    def rendered_welcome(self, name: str, email: str, locale: str = "en") -> RenderedEmail:
        """The welcome email as the outbox's renderer makes it from the example's templates."""
        user = SimpleNamespace(name=name, email=email)
        with self.app.test_request_context("/"):
            return mail.templates().render("welcome", {"user": user}, locale=locale)


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
    # from the example's templates: the template `welcome`, in English (no language
    # chosen, no Accept-Language: the default locale).
    assert parsed.get_content_type() == "multipart/alternative"
    assert [p.get_content_type() for p in parsed.iter_parts()] == ["text/plain", "text/html"]
    rendered = example.rendered_welcome("Ann Example", "ann@example.com")
    text, html = rendered.text, rendered.html
    assert text is not None
    assert _text(received, "plain").rstrip("\n") == text.rstrip("\n")
    assert _text(received, "html").rstrip("\n") == html.rstrip("\n")
    assert rendered.subject == "Welcome, Ann Example!"
    assert "Thanks for signing up with ann@example.com." in text
    assert "<strong>ann@example.com</strong>" in html
    assert "http://localhost/" in text and 'href="http://localhost/"' in html
    assert '<html lang="en">' in html
    # The layout's <style> block is inlined into style attributes, and gone.
    assert "<style" not in html
    assert re.search(r'<h1 style="[^"]*font-size: ?22px', html), html

    # The row says which template, locale and sources the email came from.
    assert (row["template_name"], row["template_locale"]) == ("welcome", "en")
    assert row["template_hash"] == rendered.source_hash
    assert re.fullmatch(r"[0-9a-f]{64}", row["template_hash"])

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


def _german_welcome_arrived(example: Example, address: str) -> None:
    """The German welcome email to ``address`` arrived, and its row says ``de``."""
    assert example.smtp.wait_for(1)
    [row] = example.wait_emails(lambda rows: bool(rows) and rows[0]["status"] == "sent")
    assert (row["template_name"], row["template_locale"]) == ("welcome", "de")
    [received] = example.smtp.messages
    assert received.rcpt_tos == [address]
    assert received.parsed["Subject"] == "Willkommen, Ann Beispiel!"
    text, html = _text(received, "plain"), _text(received, "html")
    assert f"Danke für deine Anmeldung mit {address}." in text
    assert "Zur Example App: http://localhost/" in text
    assert "Du bekommst diese E-Mail, weil du dich bei der Example App angemeldet hast." in text
    assert '<html lang="de">' in html
    assert f"Danke für deine Anmeldung mit <strong>{address}</strong>." in html
    assert "Willkommen, Ann Beispiel!</h1>" in html
    assert "Welcome" not in text + html and "Thanks" not in text + html
    german = example.rendered_welcome("Ann Beispiel", address, "de")
    assert german.text is not None
    assert text.rstrip("\n") == german.text.rstrip("\n")
    assert html.rstrip("\n") == german.html.rstrip("\n")


def test_a_signup_that_picks_german_gets_the_german_welcome_email(example: Example) -> None:
    # The browser asks for English; the form's choice wins.
    response = example.sign_up("Ann Beispiel", "ann@example.de", locale="de",
                               accept_language="en-US,en;q=0.9")
    assert response.status_code == 302
    _german_welcome_arrived(example, "ann@example.de")


def test_a_german_browser_gets_the_german_welcome_email(example: Example) -> None:
    # "Your browser's language": Flask-Babel's locale selector reads Accept-Language.
    response = example.sign_up("Ann Beispiel", "ann@example.de",
                               accept_language="de-DE,de;q=0.9,en;q=0.5")
    assert response.status_code == 302
    _german_welcome_arrived(example, "ann@example.de")


def test_a_browser_language_without_a_catalog_gets_english(example: Example) -> None:
    assert example.sign_up("Ann", "ann@example.fr", accept_language="fr-FR,fr").status_code == 302
    assert example.smtp.wait_for(1)
    [row] = example.wait_emails(lambda rows: bool(rows) and rows[0]["status"] == "sent")
    assert row["template_locale"] == "en"
    assert example.smtp.messages[0].parsed["Subject"] == "Welcome, Ann!"


def test_the_form_offers_the_catalogs_languages_and_refuses_others(example: Example) -> None:
    page = example.client.get("/").get_data(as_text=True)
    options = re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', page)
    assert options == [("", "Your browser's language"), ("en", "English"),
                       ("de", "Deutsch")]

    response = example.sign_up("Ann", "ann@example.com", locale="xx")
    assert response.status_code == 400
    page = response.get_data(as_text=True)
    assert "Please choose a language from the list." in page
    assert example.users() == [] and example.emails() == []

    # A form shown again keeps the language that was picked.
    page = example.sign_up("", "ann@example.com", locale="de").get_data(as_text=True)
    assert '<option value="de" lang="de" selected>Deutsch</option>' in page


def test_the_welcome_email_has_a_preview_that_renders_in_both_languages(
        example: Example) -> None:
    with example.app.test_request_context("/"):
        templates = mail.templates()
        # The layout (its name starts with "_") is not an email of its own.
        assert templates.names() == ["welcome"]
        assert templates.locales() == ["en", "de"]
        [preview] = templates.previews()["welcome"]
        assert preview.template == "welcome"
        subjects = []
        for locale in templates.locales():
            # strict: what `flask outbox templates check` does, undefined names are errors.
            rendered = templates.render("welcome", preview.func(), locale=locale, strict=True)
            subjects.append(rendered.subject)
            assert "ann@example.com" in rendered.html
    assert subjects == ["Welcome, Ann Example!", "Willkommen, Ann Example!"]
    # A preview writes nothing.
    assert example.users() == [] and example.emails() == []


def test_the_example_passes_the_templates_check(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # `flask --app example_app outbox templates check`: no database needed, nothing sent.
    for name in list(os.environ):
        if name.startswith(("EXAMPLE_", "FLASK_")):
            monkeypatch.delenv(name)
    app = create_app({"TESTING": True, "OUTBOX_RUN_SCHEDULER": False},
                     instance_path=str(tmp_path / "instance"))
    try:
        result = app.test_cli_runner().invoke(args=["outbox", "templates", "check"])
    finally:
        mail.stop(timeout=5)
    assert result.output.splitlines()[-1].startswith("1 email × 2 locales checked"), \
        result.output
    assert len(result.output.splitlines()) == 1, result.output
    assert result.exit_code == 0, result.output


# --- the German catalog ------------------------------------------------------------------


def test_the_german_catalog_translates_every_message_of_the_email_templates() -> None:
    # What `pybabel extract -F example_app/babel.cfg` finds, against the .po.
    with open(EXAMPLE_DIR / "babel.cfg", encoding="utf-8") as cfg:
        method_map, options_map = parse_mapping_cfg(cfg)  # type: ignore[no-untyped-call]
    extracted = {message for _, _, message, _, _ in
                 extract_from_dir(str(EXAMPLE_DIR), method_map, options_map)}
    assert "Welcome, %(name)s!" in extracted and len(extracted) >= 5
    with open(GERMAN / "messages.po", "rb") as po:
        catalog = read_po(po)
    translated = {m.id for m in catalog if m.id and m.string and not m.fuzzy}
    assert sorted(extracted - translated) == [], "messages without a German translation"
    assert sorted({m.id for m in catalog if m.id} - extracted) == [], \
        "German messages no template uses any more (pybabel update)"
    assert catalog.obsolete == {}


def test_the_committed_mo_is_the_po_compiled() -> None:
    # Flask-Babel reads the .mo (and lists a locale only when it has one): a fresh clone
    # has no compile step, so the .mo is committed, and must not fall behind the .po.
    with open(GERMAN / "messages.po", "rb") as po:
        compiled = io.BytesIO()
        write_mo(compiled, read_po(po))
    compiled.seek(0)
    with open(GERMAN / "messages.mo", "rb") as mo:
        committed = read_mo(mo)

    def pairs(catalog: Any) -> dict[Any, Any]:
        return {m.id: m.string for m in catalog if m.id}

    expected = pairs(read_mo(compiled))
    assert expected and pairs(committed) == expected, \
        "messages.mo is stale: pybabel compile -d example_app/translations"


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


# --- out of the box: the development inbox ----------------------------------------------


@pytest.fixture
def inbox_example(db_url: str, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Flask]:
    """The example app as ``scripts/run-example`` runs it: no SMTP server named, so the
    ``mailbox`` transport; migrated on ``db_url``."""
    for name in list(os.environ):
        if name.startswith(("EXAMPLE_", "FLASK_")):
            monkeypatch.delenv(name)
    drop_example_tables(db_url)
    app = create_app({"SQLALCHEMY_DATABASE_URI": db_url, "OUTBOX_RUN_SCHEDULER": False},
                     instance_path=str(tmp_path / "instance"))
    try:
        with app.app_context():
            flask_migrate.upgrade(directory=str(MIGRATIONS_DIR), revision="heads")
            db.session.remove()
        yield app
    finally:
        mail.stop(timeout=5)
        with app.app_context():
            db.session.remove()
            for engine in db.engines.values():
                engine.dispose()
        drop_example_tables(db_url)


def test_out_of_the_box_the_welcome_email_is_in_the_dashboards_mailbox(
        inbox_example: Flask) -> None:
    assert inbox_example.config["OUTBOX_TRANSPORT"] == "mailbox"
    client = inbox_example.test_client()
    thanks = client.post("/", data={"name": "Ann <b>Example</b>", "email": "ann@example.com",
                                    "locale": ""}, follow_redirects=True)
    page = thanks.get_data(as_text=True)
    # The page after the signup says where the email is.
    assert 'id="mailbox-hint"' in page and 'href="/outbox/mailbox"' in page

    def kept() -> list[dict[str, Any]]:
        with inbox_example.app_context(), db.engine.connect() as conn:
            return [dict(r) for r in conn.execute(
                sa.text("SELECT id, email_id, subject, mime FROM outbox_mailbox")).mappings()]

    [row] = poll(kept, timeout=15)
    with inbox_example.app_context(), db.engine.connect() as conn:
        stored = conn.execute(sa.select(email_table.c.status, email_table.c.mime)
                              .where(email_table.c.id == row["email_id"])).one()
    assert stored.status == "sent" and bytes(row["mime"]) == bytes(stored.mime)

    listing = client.get("/outbox/mailbox").get_data(as_text=True)
    assert "Welcome, Ann &lt;b&gt;Example&lt;/b&gt;!" in listing
    message = client.get(f"/outbox/mailbox?message={row['id']}")
    shown = message.get_data(as_text=True)
    assert message.status_code == 200
    # The welcome email's html, escaped into the sandboxed frame's srcdoc.
    assert re.search(r"<iframe [^>]*sandbox srcdoc=\"[^\"]*&lt;strong&gt;ann@example.com", shown)
    assert "Thanks for signing up with ann@example.com." in shown

    # The demo's rule still holds: not from this machine, no dashboard.
    away = client.get("/outbox/mailbox", environ_overrides={"REMOTE_ADDR": "203.0.113.9"})
    assert away.status_code == 403


def test_naming_an_smtp_server_leaves_the_mailbox_and_the_hint_out(example: Example) -> None:
    assert example.app.config["OUTBOX_TRANSPORT"] == "smtp"
    page = example.sign_up("Bo", "bo@example.com", follow=True).get_data(as_text=True)
    assert "mailbox-hint" not in page
    assert example.smtp.wait_for(1)
