"""``OutboxMail``: the extension as users import it, with its operator surfaces.

The sending and administration API is the integration's
(:class:`~._flask.extension.OutboxExtension`); this top layer adds what is
built on it: the ``flask outbox`` commands on ``app.cli``, the dashboard,
health and metrics. They use the extension's public API and the core's read
API, so nothing below this module knows them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flask import Flask, Response

from ._flask.compat import FlaskMailState
from ._flask.extension import OutboxExtension
from ._flask.state import EXTENSION_KEY, AppState
from ._operator import health as health_check
from ._operator import otel_metrics
from ._operator.cli import outbox_cli
from ._operator.dashboard import make_blueprint
from .migrations import guard_package_versions

if TYPE_CHECKING:
    from flask_sqlalchemy import SQLAlchemy


class OutboxMail(OutboxExtension):
    """Transactional email for Flask.

    ``mail.send(msg)`` adds the email to ``db.session`` as a ``queued`` row in
    the caller's transaction; it is delivered in the background after the
    outermost commit, and a rollback sends nothing.
    """

    def init_app(self, app: Flask, db: SQLAlchemy | None = None) -> FlaskMailState:
        """Register with ``app``: read and check the configuration, hook the session.

        Also puts a Flask-Mail-compatible object at ``app.extensions["mail"]``
        unless another extension (Flask-Mail itself) holds that key, and
        returns it, as Flask-Mail's ``init_app`` returns its state; and adds
        the ``flask outbox`` commands to ``app.cli`` (the ``flask`` entry
        point has them too), so ``app.test_cli_runner()`` and custom CLIs see them.
        """
        state = super().init_app(app, db)
        otel_metrics.install(app.extensions[EXTENSION_KEY])  # OUTBOX_OTEL's "metrics"
        app.cli.add_command(outbox_cli)
        _guard_migrations(app)
        return state

    def dashboard_blueprint(self, authorize: Any, **options: Any) -> Any:
        """An operator dashboard as a Flask blueprint (opt-in; see docs/operations.md).

        ``authorize`` is a callable with no arguments, called on every page and
        action; when it returns a false value the answer is 403. Register the
        result with ``app.register_blueprint(bp, url_prefix="/outbox")``.
        """
        return make_blueprint(self, authorize, **options)

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "reasons": [...], ...}`` for this app.

        Degraded when an email has been due for longer than
        ``OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS``, when dead letters grew in
        the last 15 minutes, when this process's last dispatcher tick failed,
        or when the database cannot be read (a reason, never an exception).
        One indexed SQL statement; see docs/operations.md for every field.
        """
        return health_check.check(self._state())

    def health_view(self, strict: bool = False) -> Response:
        """A view for monitoring and load balancers: ``health()`` as JSON.

        Opt in with ``app.add_url_rule("/healthz", view_func=mail.health_view)``.
        The body lists every reason; the status is 503 only when this instance
        cannot read the database (``database_unreachable``), 200 otherwise: the
        other reasons are shared by every instance, and a load balancer that
        drained them all would take the site down. ``strict=True`` answers 503
        for any reason, for a monitor rather than a load balancer:
        ``app.add_url_rule("/healthz/strict", "healthz_strict",
        view_func=mail.health_view, defaults={"strict": True})``. The answer
        holds counts, ages and reason codes, no addresses or settings.
        """
        return health_check.response(self.health(), strict=strict)

    def init_metrics(self, registry: Any = None, *, app: Flask | None = None) -> None:
        """Register Prometheus metrics for ``app`` (default: the current app).

        On ``registry`` (a ``prometheus_client.CollectorRegistry``; the default
        ``REGISTRY`` otherwise), once per app: calling again is harmless. No
        server is started; the app's own ``/metrics`` exposes them. Needs the
        ``metrics`` extra (``prometheus_client``).
        """
        registered: AppState | None = (self._state() if app is None
                                        else app.extensions.get(EXTENSION_KEY))
        if registered is None or registered.ext is not self:
            raise RuntimeError("init_metrics(app=...): this OutboxMail is not registered on "
                               "that app; call mail.init_app(app) first")
        # prometheus_client is the `metrics` extra: imported here, where it is used,
        # so an install without it can import and run everything else.
        from ._operator import metrics

        metrics.install(registered, registry)


def _guard_migrations(app: Flask) -> None:
    """Keep a user's Alembic revisions out of the package (see ``guard_package_versions``).

    Registered on the app's Flask-Migrate object when it was set up before this
    extension; with Migrate set up after, the app registers it itself (the
    migrations page says how). Idempotent: the guard is added once.
    """
    found = app.extensions.get("migrate")
    callbacks = getattr(getattr(found, "migrate", None), "configure_callbacks", None)
    if isinstance(callbacks, list) and guard_package_versions not in callbacks:
        callbacks.append(guard_package_versions)
