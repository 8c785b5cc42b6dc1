"""Templated emails: freshness, locale scoping and the static stylesheet path (review of issue 38).

Real files, a real Flask-Babel catalog, the fixtures of tests/test_templates.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from conftest import db, rows
from flask import Flask
from flask_babel import get_locale, gettext
from test_templates import ORDER, MakeApp, make_app, project, write  # noqa: F401 - fixtures

from flask_mail_outbox import InvalidMessage, TemplateError


def test_a_text_template_added_while_auto_reload_is_on_is_used(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    app, mail = make_app(TEMPLATES_AUTO_RELOAD=True)
    with app.test_request_context("/"):
        first = mail.templates().render("welcome", {"name": "Ann"})
        assert first.text is None
        write(project / "templates", {"email/welcome.txt": "Hello {{ name }} (text)"})
        second = mail.templates().render("welcome", {"name": "Ann"})
    assert second.text == "Hello Ann (text)"
    assert second.source_hash != first.source_hash


def test_a_missing_include_added_while_auto_reload_is_on_is_hashed(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    write(project / "templates", {
        "email/inc.subject.txt": "x",
        "email/inc.html": "<p>{% include 'email/_part.html' ignore missing %}</p>"})
    app, mail = make_app(TEMPLATES_AUTO_RELOAD=True)
    with app.test_request_context("/"):
        first = mail.templates().render("inc", {})
        write(project / "templates", {"email/_part.html": "part"})
        second = mail.templates().render("inc", {})
    assert "part" in second.html
    assert "email/_part.html" in dict(second.sources)
    assert second.source_hash != first.source_hash


def test_context_processors_run_in_the_render_locale(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    write(project / "templates", {"email/site.subject.txt": "{{ track }}",
                                  "email/site.html": "<p>{{ track }}</p>"})
    app, mail = make_app()
    app.context_processor(lambda: {"track": gettext("Track it")})
    with app.test_request_context("/", headers={"Accept-Language": "en"}):
        rendered = mail.templates().render("site", {}, locale="de")
    assert rendered.subject == "Sendung verfolgen"


def test_a_static_stylesheet_with_an_escaped_name_is_inlined(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    write(project / "static", {"mail sheet.css": ".hi { color: #00ff00; }"})
    write(project / "templates", {
        "email/esc.subject.txt": "x",
        "email/esc.html": '<link rel="stylesheet" href="/static/mail%20sheet.css">'
                          '<p class="hi">Hi</p>'})
    app, mail = make_app()
    with app.test_request_context("/"):
        rendered = mail.templates().render("esc", {})
    assert 'style="color: #00ff00;"' in rendered.html


@pytest.mark.parametrize("href", [
    "/static/../templates/email/welcome.html",
    "/static/%2e%2e/templates/email/welcome.html",
    "/static/..%2Ftemplates/email/welcome.html",
    "/static//etc/passwd",
    "/static/%2Fetc/passwd",
    "/static/mail.css%00.txt",
    "http://evil.example/static/../../etc/passwd",
])
def test_a_static_stylesheet_outside_the_static_folder_is_refused(
        make_app: MakeApp, project: Path, href: str) -> None:  # noqa: F811 - fixtures
    write(project / "templates", {
        "email/out.subject.txt": "x",
        "email/out.html": f'<link rel="stylesheet" href="{href}"><p>x</p>'})
    app, mail = make_app()
    with app.test_request_context("/"), pytest.raises(TemplateError) as caught:
        mail.templates().render("out", {})
    assert "not a file in the app's static folder" in str(caught.value)


def test_the_locale_cache_does_not_grow_with_spellings(
        make_app: MakeApp) -> None:  # noqa: F811 - fixtures
    app, _ = make_app()
    templates = app.extensions["mail_outbox"].templates
    with app.test_request_context("/"):
        for spaces in range(1, 2000):
            assert templates.check_locale("welcome", " " * spaces + "de") == "de"
    assert len(templates._checked) <= 256


def test_an_undefined_attribute_in_the_layout_names_the_layout_and_its_line(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    write(project / "templates", {
        "email/_base.html": "<html>\n<body>\n{{ shop.name }}\n{% block body %}{% endblock %}"
                            "</body></html>",
        "email/lay.subject.txt": "x",
        "email/lay.html": "{% extends 'email/_base.html' %}\n{% block body %}hi{% endblock %}"})
    app, mail = make_app()
    with app.test_request_context("/"), pytest.raises(TemplateError) as caught:
        mail.templates().render("lay", {})
    assert (caught.value.file, caught.value.lineno) == ("email/_base.html", 3)


def test_concurrent_renders_in_two_locales_keep_their_own_language(
        make_app: MakeApp) -> None:  # noqa: F811 - fixtures
    """Threads share the caches and Jinja's environments; each render keeps its locale."""
    app, mail = make_app(TEMPLATES_AUTO_RELOAD=True)
    expected = {"en": "Order 1042 has shipped", "de": "Bestellung 1042 ist unterwegs"}
    start = threading.Barrier(8)
    wrong: list[tuple[str, str]] = []

    def work(locale: str, accept: str) -> None:
        start.wait()
        for _ in range(40):
            with app.test_request_context("/", headers={"Accept-Language": accept}):
                subject = mail.templates().render("orders/shipped", {"order": ORDER},
                                                  locale=locale).subject
                if subject != expected[locale] or str(get_locale()) != accept:
                    wrong.append((locale, subject))

    threads = [threading.Thread(target=work, args=(("en", "de") if i % 2 else ("de", "en")))
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []


def test_the_resolver_is_not_asked_without_a_to_address(make_app: MakeApp) -> None:  # noqa: F811
    """The guide's resolver reads recipients[0]: an email with bcc only, or none, must not
    turn into its IndexError."""
    app, mail = make_app()
    asked: list[list[str]] = []

    @mail.locale_resolver
    def resolve(recipients: list[str]) -> str | None:
        asked.append(recipients)
        return "de" if recipients[0].endswith(".de") else None

    with app.test_request_context("/"):
        with pytest.raises(InvalidMessage, match="no recipients"):
            mail.send_template("welcome", recipients=[], context={"name": "A"})
        mail.send_template("welcome", recipients=[], bcc=["jan@example.de"],
                           context={"name": "A"})
        db.session.commit()
    assert asked == []
    assert [(r["template_name"], r["template_locale"]) for r in rows(app)] == [("welcome", "en")]


def test_the_renderer_translates_outside_an_app_context(make_app: MakeApp) -> None:  # noqa: F811
    """mail.templates() kept and used later (a thread, a task) rendered in the msgids'
    language while saying 'de': Flask-Babel finds no catalog without the app's context."""
    app, mail = make_app()
    with app.app_context():
        templates = mail.templates()
    rendered = templates.render("orders/shipped", {"order": ORDER}, locale="de")
    assert (rendered.locale, rendered.subject) == ("de", "Bestellung 1042 ist unterwegs")
    other = Flask("other")
    with other.app_context():  # another app's context: still this app's catalogs
        rendered = templates.render("orders/shipped", {"order": ORDER}, locale="de")
    assert rendered.subject == "Bestellung 1042 ist unterwegs"


def test_a_request_in_a_regional_locale_gets_its_languages_emails(
        make_app: MakeApp) -> None:  # noqa: F811 - fixtures
    """Flask-Babel shows a de_AT request the de catalog; its email was English (the default)."""
    app, mail = make_app()
    app.extensions["babel"].locale_selector = lambda: "de_AT"
    with app.test_request_context("/"):
        rendered = mail.templates().render("orders/shipped", {"order": ORDER})
        assert str(get_locale()) == "de_AT" and gettext("Track it") == "Sendung verfolgen"
    assert (rendered.locale, rendered.subject) == ("de", "Bestellung 1042 ist unterwegs")


def test_auto_reload_turned_on_later_reaches_mjml_and_strict_renders(
        make_app: MakeApp, project: Path) -> None:  # noqa: F811 - fixtures
    """app.debug = True after a first render (what Flask's debug setter does to Jinja):
    the environments of MJML and of the check follow the app's, so the HTML and the hash
    agree."""
    write(project / "templates", {
        "email/promo.subject.txt": "Promo",
        "email/promo.mjml": "<mjml><mj-body><mj-section><mj-column><mj-text>old</mj-text>"
                            "</mj-column></mj-section></mj-body></mjml>"})
    app, mail = make_app()
    with app.test_request_context("/"):
        first = mail.templates().render("promo")
        strict_first = mail.templates().render("promo", strict=True)
        app.debug = True
        assert app.jinja_env.auto_reload
        source = project / "templates" / "email" / "promo.mjml"
        source.write_text(source.read_text(encoding="utf-8").replace("old", "new"),
                          encoding="utf-8")
        stat = source.stat()
        os.utime(source, (stat.st_atime, stat.st_mtime + 5))
        second = mail.templates().render("promo")
        strict_second = mail.templates().render("promo", strict=True)
    assert "old" in first.html and "old" in strict_first.html
    assert second.source_hash != first.source_hash
    assert "new" in second.html and "new" in strict_second.html
