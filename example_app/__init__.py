"""A small Flask app that sends a welcome email through flask-mail-outbox.

Run it from the repository root::

    flask --app example_app db upgrade heads   # creates the app's table and the outbox's
    flask --app example_app run

(``scripts/run-example`` does both.) The outbox dashboard is at ``/outbox/``, open to
requests from this machine only (a demo rule, see ``_demo_authorize``); its previews
section shows the welcome email in English and German, and its Mailbox page the welcome
emails sent (``FLASK_OUTBOX_TRANSPORT=console`` prints them on the terminal instead).

The welcome email is the template ``welcome`` (``templates/email/welcome.*``, on the
layout ``templates/email/_layout.html``), sent with ``mail.send_template`` in the
language the form names, else the browser's (Flask-Babel's locale selector). The German
catalog is ``translations/de/LC_MESSAGES/messages.po``; after editing a template or the
catalog, from the repository root::

    pybabel extract -F example_app/babel.cfg -o messages.pot example_app
    pybabel update -i messages.pot -d example_app/translations   # then translate
    pybabel compile -d example_app/translations                  # the .mo is committed

(``tests/test_example_app.py`` fails while the catalog lacks a message or the ``.mo`` is
stale.) Out of the box it keeps its data in SQLite at
``<instance folder>/example.db`` and keeps every email in its development inbox (the
``mailbox`` transport: nothing leaves the machine), which the dashboard shows at
``/outbox/mailbox``; the page after a signup links to it. Environment variables change
that:

============================  ===============================================
``EXAMPLE_DATABASE_URL``      any SQLAlchemy URL, e.g.
                              ``postgresql+psycopg://user@localhost/example``
``EXAMPLE_MAIL_SERVER``       an SMTP server: switches to the ``smtp`` transport
``EXAMPLE_MAIL_PORT``         its port (default 25)
``EXAMPLE_MAIL_USE_TLS``      ``1`` for STARTTLS
``EXAMPLE_MAIL_USERNAME``     login, if the server wants one
``EXAMPLE_MAIL_PASSWORD``
``EXAMPLE_SECRET_KEY``        the session signing key (set it outside development)
``FLASK_INSTANCE_PATH``       the instance folder (default: ``instance/`` beside
                              this package)
``FLASK_*``                   any Flask config key, e.g. ``FLASK_OUTBOX_DURABLE=true``
============================  ===============================================

``create_app(config)`` applies ``config`` last, over all of the above. Whenever the final
config names a ``MAIL_SERVER`` and no ``OUTBOX_TRANSPORT``, email goes out by SMTP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flask import Flask, has_request_context, request

from example_app.extensions import babel, db, mail, migrate

__all__ = ["create_app"]

# Flask-Migrate resolves its directory against the working directory; an absolute path
# lets `flask --app example_app db upgrade` run from anywhere.
MIGRATIONS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "migrations"
)

# Development only: anyone who knows this key can forge session cookies (and so the
# flashed messages). Set EXAMPLE_SECRET_KEY (or FLASK_SECRET_KEY) anywhere else.
_DEV_SECRET_KEY = "dev-only-not-secret"

_TRUE = frozenset({"1", "true", "yes", "on"})


def create_app(
    config: Mapping[str, Any] | None = None, *, instance_path: str | None = None
) -> Flask:
    """Build the example app.

    Configuration, later layers winning: embedded defaults, the ``EXAMPLE_*`` variables,
    the ``FLASK_*`` variables, then ``config``.
    """
    instance_path = instance_path or os.environ.get("FLASK_INSTANCE_PATH") or None
    app = Flask(__name__, instance_path=os.path.abspath(instance_path) if instance_path else None)
    os.makedirs(app.instance_path, exist_ok=True)

    app.config.update(
        SECRET_KEY=os.environ.get("EXAMPLE_SECRET_KEY", _DEV_SECRET_KEY),
        SQLALCHEMY_DATABASE_URI="sqlite:///" + os.path.join(app.instance_path, "example.db"),
        MAIL_DEFAULT_SENDER="Example App <noreply@example.com>",
    )
    app.config.update(_config_from_example_env(os.environ))
    app.config.from_prefixed_env()
    if config is not None:
        app.config.update(config)
    # The development inbox (the dashboard's Mailbox page) unless an SMTP server was named
    # somewhere (and no transport chosen).
    app.config.setdefault(
        "OUTBOX_TRANSPORT", "smtp" if app.config.get("MAIL_SERVER") else "mailbox"
    )

    db.init_app(app)
    migrate.init_app(app, db, directory=MIGRATIONS_DIR)
    # English is the templates' own language; translations/ holds the others.
    babel.init_app(app, locale_selector=_browser_locale)
    mail.init_app(app)

    # The preview functions (@mail.preview) register on import.
    from example_app import previews  # noqa: F401
    from example_app.views import bp

    app.register_blueprint(bp)
    # The operator dashboard at /outbox, for requests from this machine only.
    app.register_blueprint(
        mail.dashboard_blueprint(authorize=_demo_authorize), url_prefix="/outbox"
    )
    return app


def _demo_authorize() -> bool:
    """Demo only: let in requests from this machine (``flask run`` on localhost).

    Not authentication: behind a reverse proxy every request comes from the proxy's
    address, often 127.0.0.1. A real app checks its own login, e.g.
    ``authorize=lambda: current_user.is_authenticated and current_user.is_admin``.
    """
    return request.remote_addr in ("127.0.0.1", "::1")


def _browser_locale() -> str | None:
    """Flask-Babel's locale selector: the best of the browser's languages we have.

    None (no request, or no match) falls back to the default locale, English.
    """
    if not has_request_context():
        return None
    return request.accept_languages.best_match(
        [str(locale) for locale in babel.list_translations()])


def _config_from_example_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config keys from the ``EXAMPLE_*`` variables that are set."""
    config: dict[str, Any] = {}
    if environ.get("EXAMPLE_DATABASE_URL"):
        config["SQLALCHEMY_DATABASE_URI"] = environ["EXAMPLE_DATABASE_URL"]
    if environ.get("EXAMPLE_MAIL_SERVER"):
        config["MAIL_SERVER"] = environ["EXAMPLE_MAIL_SERVER"]
        config["OUTBOX_TRANSPORT"] = "smtp"
    if environ.get("EXAMPLE_MAIL_PORT"):
        try:
            config["MAIL_PORT"] = int(environ["EXAMPLE_MAIL_PORT"])
        except ValueError:
            raise ValueError(
                f"EXAMPLE_MAIL_PORT must be a port number, not {environ['EXAMPLE_MAIL_PORT']!r}"
            ) from None
    if "EXAMPLE_MAIL_USE_TLS" in environ:
        config["MAIL_USE_TLS"] = environ["EXAMPLE_MAIL_USE_TLS"].strip().lower() in _TRUE
    if "EXAMPLE_MAIL_USERNAME" in environ:
        config["MAIL_USERNAME"] = environ["EXAMPLE_MAIL_USERNAME"]
    if "EXAMPLE_MAIL_PASSWORD" in environ:
        config["MAIL_PASSWORD"] = environ["EXAMPLE_MAIL_PASSWORD"]
    return config
