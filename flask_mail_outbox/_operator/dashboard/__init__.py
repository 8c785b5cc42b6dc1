"""The operator dashboard: an opt-in blueprint (``mail.dashboard_blueprint(authorize=...)``).

Server-rendered pages (Jinja, one CSS file, no JavaScript) that answer "is mail
flowing, what is stuck, and why", and what happened after the hand-off (each
email's delivery events; the list filtered by the latest one), and fix it: retry
or purge dead letters, switch the delivery mode, add an address to the
suppression list or take one off.

Security is not left to the host app:

* ``authorize()`` runs before every page, action and static file; only ``True``
  lets the request in, anything else is a 403 (a truthy user object, a redirect
  response or a string is a mistake, not a yes; it is logged at ERROR once).
  There is no default: without a callable the blueprint is refused. For a
  development machine, :func:`local_debug_only` lets in what Flask's debugger
  would: requests from this machine while the app runs in debug mode.
* Every action is a POST carrying a per-session CSRF token (kept in Flask's signed
  session, so registering on an app without ``SECRET_KEY`` fails at once). The
  blueprint is exempted from Flask-WTF's ``CSRFProtect`` when the app has it: that
  one looks for a token of its own, which the dashboard's forms do not carry.
* Jinja autoescapes every page; an email's html is shown only inside an
  ``<iframe sandbox srcdoc=...>`` (no scripts, an opaque origin).
* Every response carries a Content-Security-Policy that loads nothing but the
  dashboard's stylesheet, lets the preview neither load from the app nor
  navigate, and forbids framing the dashboard. A template preview's page and a
  Mailbox message's page allow inline styles besides (an email's inlined CSS), and
  nothing else.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, current_app, g, request, session
from flask.blueprints import BlueprintSetupState
from werkzeug.wrappers import Response

from ..._errors import ConfigError
from ._mailbox import MailboxPages
from ._previews import INLINE_STYLES_FLAG, PREVIEW_CONTENT_SECURITY_POLICY, Previews
from ._views import Dashboard

if TYPE_CHECKING:
    from flask.sansio.app import App

    from ..._flask.extension import OutboxExtension

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "PREVIEW_CONTENT_SECURITY_POLICY",
    "local_debug_only",
    "make_blueprint",
]

logger = logging.getLogger(__name__)

# The preview's srcdoc frame inherits this policy: an email's html may load no
# image but an inline data: one (not even from the app: that would be a false
# "opened" hit or a GET of an app page with the operator's cookies), and may not
# navigate its frame anywhere (frame-src does not apply to srcdoc itself).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self'; img-src data:; frame-src 'none'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_CSRF_SESSION_KEY = "outbox_dashboard_csrf"
_CSRF_FIELD = "csrf_token"


def make_blueprint(mail: OutboxExtension, authorize: Callable[[], Any], *,
                   name: str = "outbox_dashboard", page_size: int = 50) -> Blueprint:
    """The dashboard for ``mail``, as a blueprint to register under a prefix.

    ``authorize`` is called with no arguments (inside the request: read
    ``flask.request``, ``flask_login.current_user``, ...) on every request to
    the blueprint; only a result that ``is True`` lets the request in, any
    other answers 403. A gate that fails open on a mistake such as
    ``lambda: current_user`` (always truthy) is worse than none, so a result
    that is not a bool is also logged at ERROR, once per blueprint.
    ``page_size`` is the number of emails per list page.
    """
    if authorize is None or not callable(authorize):
        raise TypeError(
            "dashboard_blueprint() needs authorize=<callable returning True for operators>, "
            f"got {authorize!r}: an operator page open to everyone is not a default this "
            "library offers (e.g. authorize=lambda: current_user.is_admin)")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 500:
        raise ValueError(f"page_size must be an integer from 1 to 500, got {page_size!r}")
    bp = Blueprint(name, __name__, template_folder="templates", static_folder="static",
                   static_url_path="/static")
    bp.record_once(_require_secret_key)
    bp.record(_require_safe_mount)
    bp.record(_exempt_from_flask_wtf)

    misused = False

    @bp.before_request
    def authorize_and_check_csrf() -> None:
        nonlocal misused
        allowed = authorize()
        if allowed is not True:
            if not isinstance(allowed, bool) and not misused:
                misused = True
                logger.error(
                    "The outbox dashboard's authorize() returned a %s, not True or False; "
                    "consequence: every request to the dashboard %r is refused with 403; "
                    "fix: return a bool, e.g. authorize=lambda: current_user.is_authenticated "
                    "and current_user.is_admin (not lambda: current_user)",
                    type(allowed).__name__, name)
            abort(403)
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            _check_csrf_token()

    bp.after_request(_security_headers)
    bp.context_processor(lambda: {"csrf_token": csrf_token})
    Dashboard(mail, page_size=page_size).register(bp)
    Previews(mail).register(bp)
    MailboxPages(page_size=page_size).register(bp)
    return bp


#: Headers a reverse proxy adds: a request that carries one did not come from this machine
#: directly, whatever its peer address says.
_PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto",
                  "X-Forwarded-Server", "X-Forwarded-Port", "X-Forwarded-Prefix", "X-Real-IP",
                  "Via")
_refused_outside_debug = False


def local_debug_only() -> bool:
    """An ``authorize`` for development: True only as Flask's debugger would be open.

    ``mail.dashboard_blueprint(authorize=local_debug_only)`` lets a request in
    when all of these hold, and refuses it (403) otherwise:

    * the app runs in debug mode (``flask run --debug``, ``app.debug``);
    * the request comes from a loopback address (127.0.0.0/8, ::1);
    * its ``Host`` names this machine (``localhost``, ``*.localhost`` or a
      loopback address): a page elsewhere cannot reach it by DNS rebinding;
    * it carries no proxy header (``Forwarded``, ``X-Forwarded-*``, ``Via``, ...):
      behind a reverse proxy on the same machine every request comes from
      127.0.0.1, so one that went through a proxy is refused.

    Outside debug mode it refuses everything (said once at WARNING), so a
    deployment that forgets to replace it is shut, not open.
    """
    global _refused_outside_debug
    if not current_app.debug:
        if not _refused_outside_debug:
            _refused_outside_debug = True
            logger.warning(
                "The outbox dashboard's authorize=local_debug_only refuses every request: "
                "the app is not in debug mode; run `flask run --debug` on your machine, or "
                "give the dashboard the app's own login check")
        return False
    if any(header in request.headers for header in _PROXY_HEADERS):
        return False
    return _loopback(request.remote_addr or "") and _loopback(_hostname(request.host),
                                                              names=True)


def _hostname(host: str) -> str:
    """The name or address of a ``Host`` header, without its port or IPv6 brackets."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else ""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _loopback(value: str, *, names: bool = False) -> bool:
    """Whether ``value`` is a loopback address (or, with ``names``, localhost)."""
    if names and (value.lower() == "localhost" or value.lower().endswith(".localhost")):
        return True
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return False
    # An IPv4 peer on a dual-stack socket (``flask run --host ::``) is ::ffff:127.0.0.1.
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def csrf_token() -> str:
    """This session's CSRF token (created on first use)."""
    token = session.get(_CSRF_SESSION_KEY)
    if not isinstance(token, str):
        token = session[_CSRF_SESSION_KEY] = secrets.token_urlsafe(32)
    return token


def _check_csrf_token() -> None:
    expected = session.get(_CSRF_SESSION_KEY)
    sent = request.form.get(_CSRF_FIELD, "")
    if not isinstance(expected, str) or not hmac.compare_digest(sent.encode(), expected.encode()):
        abort(400, description="The form's CSRF token is missing or does not match this "
                               "session; reload the page and try again.")


def _security_headers(response: Response) -> Response:
    # A preview page (and only it) lets the email's inlined styles apply in its frame.
    inline_styles = g.get(INLINE_STYLES_FLAG) is True
    response.headers["Content-Security-Policy"] = \
        PREVIEW_CONTENT_SECURITY_POLICY if inline_styles else CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Cache-Control"] = "no-store"
    return response


def _require_safe_mount(state: BlueprintSetupState) -> None:
    """At ``register_blueprint``: a prefix of its own, and templates that autoescape.

    Without a prefix the dashboard's ``/`` and ``/static`` would be the app's.
    Escaping is Jinja's, switched on by the app for ``.html`` templates (Flask's
    default): an app that turned it off would render emails' subjects as markup.
    """
    if not (state.url_prefix or "").strip("/"):
        raise ValueError(
            "the outbox dashboard needs a url_prefix of its own, e.g. "
            "app.register_blueprint(bp, url_prefix='/outbox'): without one its / and "
            "/static would take the app's")
    if not state.app.select_jinja_autoescape("outbox_dashboard/base.html"):
        raise RuntimeError(
            "the outbox dashboard needs Jinja autoescaping for .html templates (Flask's "
            "default), which this app's select_jinja_autoescape() turns off: subjects and "
            "error texts from emails would be rendered as markup")


def _exempt_from_flask_wtf(state: BlueprintSetupState) -> None:
    """At ``register_blueprint``: keep Flask-WTF's ``CSRFProtect`` off the dashboard.

    The dashboard checks a token of its own on every POST; ``CSRFProtect``
    would refuse each one (400 "The CSRF session token is missing"), since
    its token is not in the form. It may be set up before the blueprint is
    registered or after (an app factory's order): exempt the blueprint now,
    or on the first request, before ``CSRFProtect``'s own check runs.
    """
    app, blueprint = state.app, state.blueprint
    if _exempt(app, blueprint):
        return
    done: list[bool] = []

    def exempt_once() -> None:
        # (Not removed from the hook list: Flask is iterating over it.)
        if not done and _exempt(app, blueprint):
            done.append(True)

    app.before_request(exempt_once)


def _exempt(app: App, blueprint: object) -> bool:
    """Exempt ``blueprint`` from the app's Flask-WTF ``CSRFProtect``, if any; whether it did."""
    csrf = app.extensions.get("csrf")
    if csrf is None or not hasattr(csrf, "exempt"):
        return False
    csrf.exempt(blueprint)
    return True


def _require_secret_key(state: BlueprintSetupState) -> None:
    """At ``register_blueprint``: the CSRF token needs a signed session."""
    if not state.app.config.get("SECRET_KEY"):
        raise ConfigError(
            "SECRET_KEY",
            "the outbox dashboard keeps its CSRF token in Flask's session, which needs a "
            "secret key; set app.config['SECRET_KEY'] (a long random value kept out of the "
            "code) before registering the blueprint")
