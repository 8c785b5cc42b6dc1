"""Templated emails: ``mail.send_template()`` end to end, on real files, catalogs and servers.

Every app here has its own template and static folders in a temporary directory,
Flask-Babel with German catalogs compiled from a .po written by the test, and
delivers to a real SMTP server; what arrives is parsed back.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from babel.messages.catalog import Catalog
from babel.messages.mofile import write_mo
from conftest import close_app, db, rows
from flask import Flask, request
from flask_babel import Babel, get_locale
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail, TemplateError

LAYOUT = """\
<!doctype html>
<html><head><style>
  p.lead { color: #123456; font-size: 18px; }
  @media (max-width: 600px) { p.lead { font-size: 14px; } }
</style></head>
<body>{% block body %}{% endblock %}</body></html>
"""

SHIPPED_SUBJECT = "{{ _('Order %(n)s has shipped', n=order.id) }}\n"
SHIPPED_HTML = """\
{% extends "email/_layout.html" %}
{% block body %}
<p class="lead">{% trans name=order.customer %}Hello {{ name }},{% endtrans %}</p>
<ul>{% for item in order['items'] %}<li>{{ item }}</li>{% endfor %}</ul>
<p><a href="https://shop.example/orders/{{ order.id }}">{{ _('Track it') }}</a></p>
{% endblock %}
"""
SHIPPED_TEXT = """\
{% trans name=order.customer %}Hello {{ name }},{% endtrans %}
{% for item in order['items'] %}- {{ item }}
{% endfor %}"""

GERMAN = {
    "Order %(n)s has shipped": "Bestellung %(n)s ist unterwegs",
    "Hello %(name)s,": "Hallo %(name)s,",
    "Track it": "Sendung verfolgen",
}

ORDER = {"id": 1042, "customer": "Ann <&>", "items": ["Tea", "Cups"]}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def compile_catalog(root: Path, locale: str, messages: dict[str, str]) -> None:
    catalog = Catalog(locale=locale)
    for msgid, msgstr in messages.items():
        catalog.add(msgid, msgstr)
    folder = root / "translations" / locale / "LC_MESSAGES"
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    write_mo(buffer, catalog)
    (folder / "messages.mo").write_bytes(buffer.getvalue())


MakeApp = Callable[..., tuple[Flask, OutboxMail]]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder: templates/email/..., static/, translations/de."""
    write(tmp_path / "templates", {
        "email/_layout.html": LAYOUT,
        "email/orders/shipped.subject.txt": SHIPPED_SUBJECT,
        "email/orders/shipped.html": SHIPPED_HTML,
        "email/orders/shipped.txt": SHIPPED_TEXT,
        "email/welcome.subject.txt": "Welcome, {{ name }}!",
        "email/welcome.html": '<link rel="stylesheet" href="/static/mail.css">'
                              '<p class="hi">Hi {{ name }}</p>',
        "signup.html": "<p>not an email</p>",
    })
    write(tmp_path / "static", {"mail.css": ".hi { color: #ff0000; }"})
    compile_catalog(tmp_path, "de", GERMAN)
    return tmp_path


@pytest.fixture
def make_app(db_url: str, project: Path, smtp_server: FaultSMTPServer
             ) -> Iterator[MakeApp]:
    made: list[Flask] = []

    def factory(babel: bool = True, **config: Any) -> tuple[Flask, OutboxMail]:
        app = Flask(__name__, root_path=str(project),
                    template_folder=str(project / "templates"),
                    static_folder=str(project / "static"))
        app.config.update(
            SQLALCHEMY_DATABASE_URI=db_url, SECRET_KEY="test", MAIL_SUPPRESS_SEND=False,
            MAIL_DEFAULT_SENDER="Shop <shop@example.com>", MAIL_SERVER=smtp_server.host,
            MAIL_PORT=smtp_server.port, OUTBOX_RUN_SCHEDULER=False,
            BABEL_TRANSLATION_DIRECTORIES=str(project / "translations"))
        app.config.update(config)
        if babel:
            Babel(app, locale_selector=lambda: request.accept_languages.best_match(["en", "de"]))
        db.init_app(app)
        mail = OutboxMail(app)
        with app.app_context():
            db.create_all()
            mail.create_all()
        app.extensions["test_mail"] = mail
        made.append(app)
        return app, mail

    yield factory
    for app in made:
        close_app(app, timeout=5)


def test_send_template_renders_translates_inlines_and_records(
        make_app: MakeApp, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_app()
    with app.test_request_context("/"):
        email_id = mail.send_template("orders/shipped", recipients=["ann@example.com"],
                                      context={"order": ORDER}, locale="de", key="order-1042")
        db.session.commit()
    assert smtp_server.wait_for(1)
    received = smtp_server.messages[0].parsed
    assert received["Subject"] == "Bestellung 1042 ist unterwegs"
    html = received.get_body(("html",)).get_content()
    text = received.get_body(("plain",)).get_content()
    # Translated, escaped (the customer's name is HTML), looped, and the CSS inlined
    # onto the element, the media query kept in a <style> for the clients that read it.
    assert "Hallo Ann &lt;&amp;&gt;," in html
    assert "<li>Tea</li><li>Cups</li>" in html
    assert 'style="color: #123456;font-size: 18px;"' in html
    assert "@media (max-width: 600px)" in html
    assert "Sendung verfolgen" in html
    # The text template, not the HTML: unescaped, its own layout.
    assert text.replace("\r\n", "\n").startswith("Hallo Ann <&>,\n- Tea\n- Cups")
    [row] = rows(app)
    assert row["id"] == email_id and row["key"] == "order-1042"
    assert row["template_name"] == "orders/shipped"
    assert row["template_locale"] == "de"
    sources = b"".join(
        name.encode() + b"\0" + (project_file(app, name)).encode() + b"\0"
        for name in sorted(["email/_layout.html", "email/orders/shipped.subject.txt",
                            "email/orders/shipped.html", "email/orders/shipped.txt"]))
    assert row["template_hash"] == hashlib.sha256(sources).hexdigest()
    with app.app_context():
        detail = app.extensions["mail_outbox"].outbox().reader.get_email(email_id)
    assert detail is not None and (detail.template_name, detail.template_locale) == (
        "orders/shipped", "de")


def project_file(app: Flask, name: str) -> str:
    return (Path(app.template_folder or "") / name).read_text(encoding="utf-8")


def test_the_hash_changes_with_the_layout_and_the_default_locale_is_english(
        make_app: MakeApp, project: Path) -> None:
    app, mail = make_app(TEMPLATES_AUTO_RELOAD=True)
    with app.test_request_context("/"):
        first = mail.templates().render("orders/shipped", {"order": ORDER})
        assert first.locale == "en"
        assert first.subject == "Order 1042 has shipped"
        layout = project / "templates" / "email" / "_layout.html"
        layout.write_text(LAYOUT.replace("#123456", "#654321"), encoding="utf-8")
        # A different mtime: Jinja's and the renderer's freshness checks both see it.
        stat = layout.stat()
        import os

        os.utime(layout, (stat.st_atime, stat.st_mtime + 5))
        second = mail.templates().render("orders/shipped", {"order": ORDER})
    assert second.source_hash != first.source_hash
    assert "#654321" in second.html


def test_the_locale_comes_from_the_resolver_then_the_request(
        make_app: MakeApp, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_app()
    asked: list[list[str]] = []

    @mail.locale_resolver
    def resolve(recipients: list[str]) -> str | None:
        asked.append(recipients)
        return "de" if recipients[0].endswith(".de") else None

    with app.test_request_context("/", headers={"Accept-Language": "en"}):
        mail.send_template("orders/shipped", recipients=["Jan <jan@example.de>"],
                           context={"order": ORDER})
        mail.send_template("orders/shipped", recipients=[("Ann", "ann@example.com")],
                           context={"order": ORDER})
        db.session.commit()
        # The render's locale never leaks into the request.
        assert str(get_locale()) == "en"
    with app.test_request_context("/", headers={"Accept-Language": "de"}):
        mail.send_template("orders/shipped", recipients=["bob@example.com"],
                           context={"order": ORDER})
        # A request already in German sends in English and stays German.
        assert str(get_locale()) == "de"
        mail.send_template("orders/shipped", recipients=["eve@example.com"],
                           context={"order": ORDER}, locale="en")
        assert str(get_locale()) == "de"
        db.session.commit()
    assert asked[:2] == [["jan@example.de"], ["ann@example.com"]]
    assert smtp_server.wait_for(4)
    assert [row["template_locale"] for row in rows(app)] == ["de", "en", "de", "en"]
    subjects = sorted(m.parsed["Subject"] for m in smtp_server.messages)
    assert subjects == ["Bestellung 1042 ist unterwegs", "Bestellung 1042 ist unterwegs",
                        "Order 1042 has shipped", "Order 1042 has shipped"]


def test_a_linked_static_stylesheet_is_inlined_and_the_text_made_from_the_html(
        make_app: MakeApp, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_app()
    with app.test_request_context("/"):
        mail.send_template("welcome", recipients=["ann@example.com"], context={"name": "Ann"},
                           cc=["cc@example.com"], priority="high")
        db.session.commit()
    assert smtp_server.wait_for(1)
    received = smtp_server.messages[0].parsed
    html = received.get_body(("html",)).get_content()
    assert '<p class="hi" style="color: #ff0000;">Hi Ann</p>' in html
    assert "<link" not in html
    assert received.get_body(("plain",)).get_content().strip() == "Hi Ann"
    assert received["Cc"] == "cc@example.com"
    assert rows(app)[0]["priority"] == 0


def test_template_message_is_a_message_send_records(make_app: MakeApp) -> None:
    app, mail = make_app()
    with app.test_request_context("/"):
        msg = mail.template_message("welcome", recipients=["ann@example.com"],
                                    context={"name": "Ann"}, locale="de")
        assert isinstance(msg, Message) and msg.subject == "Welcome, Ann!"
        assert msg.template is not None and msg.template.locale == "de"
        mail.send_many([msg])
        db.session.rollback()  # a rollback sends nothing, as for any message
    assert rows(app) == []


def test_mjml_is_compiled_with_the_context_escaped(make_app: MakeApp, project: Path) -> None:
    write(project / "templates", {
        "email/promo.subject.txt": "Promo",
        "email/promo.mjml": "<mjml><mj-body><mj-section><mj-column>"
                            "<mj-text>Hi {{ name }}</mj-text>"
                            "</mj-column></mj-section></mj-body></mjml>",
    })
    app, mail = make_app()
    with app.test_request_context("/"):
        rendered = mail.templates().render("promo", {"name": "<b>Ann</b></mj-text>"})
    assert "Hi &lt;b&gt;Ann&lt;/b&gt;&lt;/mj-text&gt;" in rendered.html
    assert "<b>Ann</b>" not in rendered.html
    assert rendered.html.lstrip().lower().startswith("<!doctype html>")


@pytest.mark.parametrize(("files", "name", "kwargs", "expected"), [
    pytest.param({}, "nothing/here", {}, "no such email: email/nothing/here.subject.txt",
                 id="missing"),
    pytest.param({"email/bad.subject.txt": "x", "email/bad.html": "<p>\n{% if %}</p>"},
                 "bad", {}, "email/bad.html line 2: syntax error", id="syntax"),
    pytest.param({"email/undef.subject.txt": "x",
                  "email/undef.html": "<p>\n\n{{ customer.total + 1 }}</p>"},
                 "undef", {}, "email/undef.html line 3: 'customer' is undefined", id="undefined"),
    pytest.param({"email/boom.subject.txt": "x", "email/boom.html": "{{ 1 // 0 }}"},
                 "boom", {}, "email/boom.html line 1: ZeroDivisionError", id="exception"),
    pytest.param({}, "orders/shipped", {"locale": "xx_YY"}, "unknown locale 'xx_YY'",
                 id="unknown-locale"),
    pytest.param({}, "orders/shipped", {"locale": "fr"},
                 "locale 'fr' is not one of the app's locales (en, de)", id="other-locale"),
    pytest.param({}, "orders/shipped", {"context": ["not", "a", "dict"]},
                 "context must be a mapping", id="context"),
    pytest.param({"email/both.subject.txt": "x", "email/both.html": "a",
                  "email/both.mjml": "<mjml/>"}, "both", {}, "has both", id="html-and-mjml"),
    pytest.param({"email/rel.subject.txt": "x",
                  "email/rel.html": '<link rel="stylesheet" href="css/a.css"><p>x</p>'},
                 "rel", {}, "neither in the app's static folder nor an absolute URL",
                 id="relative-css"),
    pytest.param({"email/gone.subject.txt": "x",
                  "email/gone.html": '<link rel="stylesheet" href="/static/gone.css"><p>x</p>'},
                 "gone", {}, "not a file in the app's static folder", id="missing-css"),
    pytest.param({"email/inc.subject.txt": "x",
                  "email/inc.html": "<p>\n{% include 'email/_gone.html' %}</p>"},
                 "inc", {}, "email/inc.html line 2: includes 'email/_gone.html'", id="include"),
    pytest.param({}, "../signup", {}, "a relative path", id="bad-name"),
])
def test_bad_input_is_a_template_error_and_nothing_is_written(
        make_app: MakeApp, project: Path, files: dict[str, str], name: str,
        kwargs: dict[str, Any], expected: str) -> None:
    write(project / "templates", files)
    app, mail = make_app()
    options = {"context": {"order": ORDER}, **kwargs}
    with app.test_request_context("/"):
        with pytest.raises(TemplateError) as caught:
            mail.send_template(name, recipients=["ann@example.com"], **options)
        db.session.commit()
    assert expected in str(caught.value)
    assert isinstance(caught.value, InvalidMessage)
    assert rows(app) == []


def test_a_locale_without_flask_babel_is_refused(make_app: MakeApp) -> None:
    app, mail = make_app(babel=False)
    with app.test_request_context("/"):
        with pytest.raises(TemplateError, match="no Flask-Babel"):
            mail.send_template("welcome", recipients=["a@example.com"],
                               context={"name": "A"}, locale="de")
        # Without a locale it renders: the row records none.
        mail.send_template("welcome", recipients=["a@example.com"], context={"name": "A"})
        db.session.commit()
    assert [(r["template_name"], r["template_locale"]) for r in rows(app)] == [("welcome", None)]


def test_the_rendered_fields_are_not_keywords(make_app: MakeApp) -> None:
    app, mail = make_app()
    with app.test_request_context("/"), pytest.raises(TypeError, match="subject"):
        mail.send_template("welcome", recipients=["a@example.com"], subject="x")


def test_names_locales_and_previews(make_app: MakeApp) -> None:
    app, mail = make_app(OUTBOX_TEMPLATE_LOCALES=["de", "en"])

    @mail.preview("orders/shipped")
    def shipped() -> dict[str, Any]:
        return {"order": ORDER}

    @mail.preview("orders/shipped", name="empty")
    def empty() -> dict[str, Any]:
        return {"order": {**ORDER, "items": []}}

    with pytest.raises(ValueError, match="already has a preview named 'empty'"):
        mail.preview("orders/shipped", name="empty")(empty)
    with app.app_context():
        templates = mail.templates()
        assert templates.names() == ["orders/shipped", "welcome"]
        # Babel's default locale first, whatever order the setting lists them in.
        assert templates.locales() == ["en", "de"]
        assert [p.name for p in templates.previews()["orders/shipped"]] == ["default", "empty"]
        rendered = templates.render("orders/shipped", shipped(), locale="de")
    assert rendered.subject == "Bestellung 1042 ist unterwegs"


def test_strict_rendering_names_the_undefined_variable(make_app: MakeApp, project: Path) -> None:
    write(project / "templates", {"email/soft.subject.txt": "Hi {{ nobody }}",
                                  "email/soft.html": "<p>x</p>"})
    app, mail = make_app()
    with app.app_context():
        assert mail.templates().render("soft").subject == "Hi"
        with pytest.raises(TemplateError,
                           match=r"email/soft.subject.txt line 1: 'nobody' is undefined"):
            mail.templates().render("soft", strict=True)


def test_inlining_without_css_inline_names_the_extra(
        make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain install: no css-inline. CSS to inline is an error naming the fix."""
    import sys

    monkeypatch.setitem(sys.modules, "css_inline", None)  # what an absent module imports as
    app, mail = make_app(babel=False)
    with app.test_request_context("/"), \
            pytest.raises(TemplateError, match=r"flask-mail-outbox\[templates\]"):
            mail.send_template("welcome", recipients=["a@example.com"], context={"name": "A"})
    app2, mail2 = make_app(babel=False, OUTBOX_TEMPLATE_INLINE_CSS=False)
    with app2.test_request_context("/"):
        html = mail2.templates().render("welcome", {"name": "A"}).html
    assert '<link rel="stylesheet" href="/static/mail.css">' in html


def test_folder_setting_is_checked(make_app: MakeApp) -> None:
    from flask_mail_outbox import ConfigError

    with pytest.raises(ConfigError, match="OUTBOX_TEMPLATE_FOLDER"):
        make_app(OUTBOX_TEMPLATE_FOLDER="../x")
    with pytest.raises(ConfigError, match="OUTBOX_TEMPLATE_LOCALES"):
        make_app(OUTBOX_TEMPLATE_LOCALES="de")


def test_the_outbox_table_has_the_template_columns(make_app: MakeApp) -> None:
    app, _ = make_app()
    with app.app_context():
        columns = {c["name"] for c in sa.inspect(db.engine).get_columns("outbox_email")}
    assert {"template_name", "template_locale", "template_hash"} <= columns


def test_a_remote_stylesheet_stays_linked_and_the_rest_is_inlined(
        make_app: MakeApp, project: Path) -> None:
    write(project / "templates", {
        "email/font.subject.txt": "x",
        "email/font.html": '<html><head><link rel="stylesheet" href="https://fonts.example/f.css">'
                           '<link rel="stylesheet" href="http://localhost/static/mail.css">'
                           "</head><body><p class=hi>x</p></body></html>"})
    app, mail = make_app()
    with app.test_request_context("/"):
        html = mail.templates().render("font").html
    assert '<link rel="stylesheet" href="https://fonts.example/f.css">' in html
    assert "localhost/static" not in html
    assert '<p class="hi" style="color: #ff0000;">' in html


def test_the_bound_catalog_renders_what_flask_babels_own_callables_render(
        make_app: MakeApp, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gettext, ngettext, pgettext and npgettext bound once per render: the same bytes."""
    from flask_mail_outbox._flask import templating

    catalog = Catalog(locale="de")
    for msgid, msgstr in GERMAN.items():
        catalog.add(msgid, msgstr)
    catalog.add(("%(count)s item", "%(count)s items"), ("%(count)s Artikel", "%(count)s Artikel"))
    catalog.add("Open", "Öffnen", context="button")
    catalog.add(("%(num)s box", "%(num)s boxes"), ("%(num)s Kiste", "%(num)s Kisten"),
                context="parcel")
    catalog.add(("%(num)s box", "%(num)s boxes"), ("%(num)s Schachtel", "%(num)s Schachteln"))
    buffer = io.BytesIO()
    write_mo(buffer, catalog)
    (project / "translations" / "de" / "LC_MESSAGES" / "messages.mo").write_bytes(
        buffer.getvalue())
    write(project / "templates", {
        "email/plural.subject.txt": "{{ ngettext('%(num)s box', '%(num)s boxes', 3) }}",
        "email/plural.html": "<p>{% trans count=n %}{{ count }} item{% pluralize %}"
                             "{{ count }} items{% endtrans %} {{ pgettext('button', 'Open') }} "
                             "{{ npgettext('parcel', '%(num)s box', '%(num)s boxes', n) }} "
                             "{{ _('Hello %(name)s,', name=who) }}</p>",
        "email/plural.txt": "{{ gettext('Track it') }} {{ _('Hello %(name)s,', name=who) }}"})
    app, mail = make_app()
    context = {"n": 2, "who": "<Ann>"}
    with app.test_request_context("/"):
        bound = [mail.templates().render("plural", context, locale=locale)
                 for locale in ("en", "de")]
        monkeypatch.setattr(templating.EmailTemplates, "_bound_gettext", lambda self, loc: {})
        unbound = [mail.templates().render("plural", context, locale=locale)
                   for locale in ("en", "de")]
    assert bound == unbound
    assert bound[1].subject == "3 Schachteln"
    assert bound[1].html == ("<p>2 Artikel Öffnen 2 Kisten Hallo &lt;Ann&gt;,</p>")
    assert bound[1].text == "Sendung verfolgen Hallo <Ann>,"
