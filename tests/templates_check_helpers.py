"""An app with email templates, Flask-Babel and compiled catalogs, for the templates check.

``write_shop(root)`` writes a clean template set (a layout, ``orders/shipped`` with a
preview, ``welcome`` without one) and its German catalog under ``root``;
``make_app(root)`` is the app over it. ``create_app`` is the same app for
``flask --app templates_check_helpers:create_app``, reading ``CHECK_ROOT`` from the
environment.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from babel.messages.mofile import write_mo
from babel.messages.pofile import read_po
from flask import Flask
from flask_babel import Babel
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import OutboxMail

LAYOUT = """\
<!doctype html>
<html>
<head><style>p { color: #333333; }</style></head>
<body>
{% block body %}{% endblock %}
<p><a href="{{ url_for('home', _external=True) }}">{{ _("Visit our shop") }}</a></p>
<img src="https://shop.example.com/logo.png" alt="{{ _('Shop logo') }}">
</body>
</html>
"""

SHIPPED_HTML = """\
{% extends "email/_layout.html" %}
{% block body %}
<h1>{% trans name=customer %}Hello {{ name }},{% endtrans %}</h1>
<ul>
{% for item in order["items"] %}<li>{{ item }}</li>
{% endfor %}</ul>
<p><a href="{{ url_for('order', number=order.number, _external=True) }}">{{ _("Track your order") }}</a></p>
<img src="https://shop.example.com/divider.png" alt="">
{% endblock %}
"""

#: The clean set: template file (under templates/) -> source.
SHOP = {
    "email/_layout.html": LAYOUT,
    "email/orders/shipped.subject.txt":
        '{{ _("Order %(number)s has shipped", number=order.number) }}\n',
    "email/orders/shipped.html": SHIPPED_HTML,
    "email/orders/shipped.txt":
        '{% trans name=customer %}Hello {{ name }},{% endtrans %}\n'
        '{{ url_for("order", number=order.number, _external=True) }}\n',
    "email/welcome.subject.txt": '{{ _("Welcome") }}\n',
    "email/welcome.html":
        '{% extends "email/_layout.html" %}\n'
        '{% block body %}<p>{{ _("Thanks for signing up.") }}</p>{% endblock %}\n',
}

#: The German catalog of SHOP: msgid -> msgstr.
GERMAN = {
    "Visit our shop": "Besuchen Sie unseren Laden",
    "Shop logo": "Logo des Ladens",
    "Hello %(name)s,": "Hallo %(name)s,",
    "Track your order": "Sendung verfolgen",
    "Order %(number)s has shipped": "Bestellung %(number)s ist unterwegs",
    "Welcome": "Willkommen",
    "Thanks for signing up.": "Danke für Ihre Anmeldung.",
}

SHIPPED_CONTEXT: dict[str, Any] = {"customer": "Ada",
                                   "order": {"number": 1042, "items": ["Tea", "Cups"]}}


def write_templates(root: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` (name under templates/ -> source) below ``root / "templates"``."""
    for name, source in files.items():
        path = root / "templates" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")


def write_catalog(root: Path, locale: str, messages: Mapping[str, str], *,
                  fuzzy: frozenset[str] = frozenset(), use_fuzzy: bool = False) -> Path:
    """A .po for ``locale`` under ``root / "translations"``, compiled to its .mo next to it.

    ``fuzzy``: msgids marked ``#, fuzzy``; ``use_fuzzy``: compile those into the .mo
    anyway (``pybabel compile --use-fuzzy``). Returns the .po's path.
    """
    folder = root / "translations" / locale / "LC_MESSAGES"
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for msgid, msgstr in messages.items():
        flag = "#, fuzzy\n" if msgid in fuzzy else ""
        entries.append(f'{flag}msgid "{msgid}"\nmsgstr "{msgstr}"\n')
    po = folder / "messages.po"
    po.write_text(
        f'msgid ""\nmsgstr ""\n"Language: {locale}\\n"\n'
        '"Content-Type: text/plain; charset=utf-8\\n"\n\n' + "\n".join(entries),
        encoding="utf-8")
    with po.open("rb") as source:
        catalog = read_po(source, locale=locale)
    buffer = io.BytesIO()
    write_mo(buffer, catalog, use_fuzzy=use_fuzzy)
    (folder / "messages.mo").write_bytes(buffer.getvalue())
    return po


def write_shop(root: Path) -> None:
    """The clean template set and its complete German catalog."""
    write_templates(root, SHOP)
    write_catalog(root, "de", GERMAN)


def make_app(root: Path, **config: Any) -> Flask:
    """An app over ``root``'s templates and translations (en default, de), with OutboxMail
    (its SQLite database in ``root``) and the ``orders/shipped`` preview "default"."""
    app = Flask("templates_check_app", root_path=str(root))
    app.config.update(
        SQLALCHEMY_DATABASE_URI=f"sqlite:///{root / 'outbox.db'}",
        MAIL_DEFAULT_SENDER="Shop <shop@example.com>",
        OUTBOX_RUN_SCHEDULER=False,
        BABEL_DEFAULT_LOCALE="en",
        BABEL_TRANSLATION_DIRECTORIES=str(root / "translations"),
        SECRET_KEY="test",
    )
    app.config.update(config)
    SQLAlchemy(app)
    Babel(app)
    mail = OutboxMail(app)
    app.extensions["test_mail"] = mail

    @app.get("/")
    def home() -> str:
        return "shop"

    @app.get("/orders/<int:number>")
    def order(number: int) -> str:
        return str(number)

    @mail.preview("orders/shipped", name="default")
    def shipped() -> dict[str, Any]:
        return copy.deepcopy(SHIPPED_CONTEXT)

    return app


def create_app() -> Flask:
    """``make_app(CHECK_ROOT)``, for ``flask --app templates_check_helpers:create_app``."""
    return make_app(Path(os.environ["CHECK_ROOT"]))
