"""An app with real email templates, two locales and previews, for the dashboard's previews tests.

The templates are files in a tmp dir (the app's template folder); the German
catalog is written as a .po file and compiled to .mo with Babel, and Flask-Babel
finds it in the app's translation directory. ``orders/shipped`` has a layout
with a ``<style>`` block (inlined at render), a text template and three previews;
``welcome`` has neither a preview nor a text template; ``broken`` fails at line 3
of its html on any context; ``receipt`` needs no translations; ``ghost`` has a
preview but no files. The third
preview of ``orders/shipped`` raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from babel.messages.mofile import write_mo
from babel.messages.pofile import read_po
from conftest import make_app
from flask import Flask
from flask_babel import Babel

from flask_mail_outbox import OutboxMail

PREFIX = "/outbox"
#: The title's colour, in the layout's <style> block: inlined into a style attribute.
TITLE_RGB = "rgb(192, 57, 43)"

TEMPLATES = {
    "email/_layout.html": """<!doctype html>
<html><head><style>h1.title { color: #c0392b; } p.lead { font-size: 18px; }</style></head>
<body><h1 class="title" id="title">{% block title %}{% endblock %}</h1>
{% block body %}{% endblock %}</body></html>
""",
    "email/orders/shipped.subject.txt":
        "{% trans number=order.number %}Your order {{ number }} has shipped{% endtrans %}\n",
    "email/orders/shipped.html": """{% extends "email/_layout.html" %}
{% block title %}{% trans number=order.number %}Order {{ number }}{% endtrans %}{% endblock %}
{% block body %}<p class="lead" id="greeting">{{ _("Hello %(name)s,", name=customer) }}</p>
<ul id="items">{% for item in order["items"] %}<li>{{ item }}</li>{% endfor %}</ul>
{% endblock %}
""",
    "email/orders/shipped.txt": """{{ _("Hello %(name)s,", name=customer) }}
{% for item in order["items"] %}- {{ item }}
{% endfor %}""",
    "email/welcome.subject.txt": "{% trans %}Welcome{% endtrans %}\n",
    "email/welcome.html":
        '<p id="welcome">{{ _("Welcome, %(name)s!", name=name | default("friend")) }}</p>\n',
    "email/receipt.subject.txt": "Receipt {{ number | default(7) }}\n",
    "email/receipt.html": '<p id="receipt">Thank you.</p>\n',
    "email/broken.subject.txt": "Broken\n",
    "email/broken.html": "<p>\nfine so far\n{{ order.number }}</p>\n",
}

GERMAN_PO = r'''msgid ""
msgstr ""
"Content-Type: text/plain; charset=UTF-8\n"
"Language: de\n"

msgid "Your order %(number)s has shipped"
msgstr "Ihre Bestellung %(number)s ist unterwegs"

msgid "Order %(number)s"
msgstr "Bestellung %(number)s"

msgid "Hello %(name)s,"
msgstr "Hallo %(name)s,"

msgid "Welcome"
msgstr "Willkommen"

msgid "Welcome, %(name)s!"
msgstr "Willkommen, %(name)s!"
'''

SUBJECTS = {"en": "Your order 1042 has shipped", "de": "Ihre Bestellung 1042 ist unterwegs"}
MANY_ITEMS = [f"Item {n}" for n in range(1, 13)]


def write_templates(root: Path) -> Path:
    """The template files and the compiled German catalog under ``root``; the template folder."""
    templates = root / "templates"
    for name, source in TEMPLATES.items():
        path = templates / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    messages = root / "translations" / "de" / "LC_MESSAGES"
    messages.mkdir(parents=True)
    (messages / "messages.po").write_text(GERMAN_PO, encoding="utf-8")
    with (messages / "messages.po").open("rb") as po:
        catalog = read_po(po, locale="de")
    with (messages / "messages.mo").open("wb") as mo:
        write_mo(mo, catalog)
    return templates


def make_preview_app(db_url: str, root: Path, *, authorize: Any = None, babel: bool = True,
                     **config: Any) -> tuple[Flask, OutboxMail]:
    """``make_app``'s app (the test database, SMTP ``config``) with the templates under
    ``root``, Flask-Babel (en, de; none when not ``babel``), previews, and the dashboard
    under :data:`PREFIX`."""
    template_folder = write_templates(root)
    app = make_app(db_url, BABEL_DEFAULT_LOCALE="en",
                   BABEL_TRANSLATION_DIRECTORIES=str(root / "translations"), **config)
    # make_app's Flask(__name__) has no template folder of its own; nothing has been
    # rendered yet, so its Jinja loader is made from this one.
    app.template_folder = str(template_folder)
    if babel:
        Babel(app)
    mail: OutboxMail = app.extensions["test_mail"]

    @mail.preview("orders/shipped", name="one item")
    def shipped() -> dict[str, Any]:
        return {"customer": "Dana", "order": {"number": 1042, "items": ["Blue mug"]}}

    @mail.preview("orders/shipped", name="many items")
    def shipped_many() -> dict[str, Any]:
        return {"customer": "Dana", "order": {"number": 1042, "items": MANY_ITEMS}}

    @mail.preview("orders/shipped", name="no such order")
    def shipped_failing() -> dict[str, Any]:
        raise LookupError("order 9999 is not in the fixtures")

    @mail.preview("ghost")
    def ghost() -> dict[str, Any]:
        return {}

    gate = authorize if authorize is not None else (lambda: True)
    app.register_blueprint(mail.dashboard_blueprint(authorize=gate), url_prefix=PREFIX)
    return app, mail


def csrf_token_of(page: str) -> str:
    """The CSRF token a dashboard page renders in its forms."""
    marker = 'name="csrf_token" value="'
    start = page.index(marker) + len(marker)
    return page[start:page.index('"', start)]
