"""The routes that hear back: provider webhooks and the one-click unsubscribe link.

``POST <OUTBOX_WEBHOOK_PREFIX>/<transport>`` exists for each transport whose
``OUTBOX_TRANSPORTS`` entry has a ``webhook_secret``. In the request: the body
is read (at most 1 MiB, else 413), the provider's receiver verifies it
(:mod:`flask_mail_outbox._webhooks`), and its events are written in one
transaction; the answer is 200. After the answer is sent: the
``email_event`` signal for each new event, and an SNS subscription's
confirmation. A refusal writes nothing.

``OUTBOX_UNSUBSCRIBE_URL``'s path takes the RFC 8058 one-click POST
(``List-Unsubscribe=One-Click``) to ``<path>/<token>``: the address the
opaque token names is suppressed for bulk mail, an ``unsubscribed`` event is
stored with the email the token names (under that email's transport), and
``email_unsubscribed`` is sent. A link POSTed again stores nothing and sends
nothing (the event's id is the link's). A GET or a HEAD shows a page with a
button and changes nothing, because link scanners follow them.
"""

from __future__ import annotations

import hashlib
import html
import logging
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from flask import Flask, Response, jsonify, request

from .. import _degrade
from .._errors import InvalidMessage
from .._events import DeliveryEvent
from .._providers import webhook_auth
from .._webhooks import (
    MAX_BODY_BYTES,
    Receiver,
    WebhookRefused,
    WebhookRequest,
    receiver_class,
)
from ..core._internal import Replayed
from .signals import email_unsubscribed

if TYPE_CHECKING:
    from .state import AppState

logger = logging.getLogger(__name__)

#: The source a one-click unsubscribe writes on the suppression list.
UNSUBSCRIBE_SOURCE = "list-unsubscribe"


def receivers_of(state: AppState) -> dict[str, Receiver]:
    """A receiver for each configured transport that has a ``webhook_secret``."""
    receivers: dict[str, Receiver] = {}
    for spec in state.config.transport_specs:
        cls = receiver_class(spec.kind) if spec.webhook_secret is not None else None
        if cls is not None:
            receivers[spec.name] = cls(spec.name, spec.webhook_secret)
    return receivers


def register(app: Flask, state: AppState) -> None:
    """Add the webhook route (when a transport has a secret) and the unsubscribe route."""
    receivers = receivers_of(state)
    views: list[Callable[..., Any]] = []
    if receivers:
        def webhook(name: str) -> Response:
            return _receive(state, receivers, name)

        app.add_url_rule(f"{state.config.webhook_prefix}/<name>", endpoint="outbox_webhook",
                         view_func=webhook, methods=["POST"])
        views.append(webhook)
    if state.config.unsubscribe_url is not None:
        path = urllib.parse.urlsplit(state.config.unsubscribe_url).path.rstrip("/")

        def unsubscribe(token: str) -> Response:
            return _unsubscribe(state, token)

        app.add_url_rule(f"{path}/<token>", endpoint="outbox_unsubscribe",
                         view_func=unsubscribe, methods=["GET", "POST"])
        views.append(unsubscribe)
    # Flask-WTF's CSRFProtect would refuse a provider's POST: these carry their own
    # proof. It may be set up before the outbox or after (an app factory's order):
    # exempt the views now, or on the first request, before its own check runs.
    if views and not _exempt_from_csrf(app, views):
        done: list[bool] = []

        def exempt_once() -> None:
            # (Not removed from the hook list: Flask is iterating over it.)
            if not done and _exempt_from_csrf(app, views):
                done.append(True)

        app.before_request(exempt_once)


def _exempt_from_csrf(app: Flask, views: list[Callable[..., Any]]) -> bool:
    """Exempt ``views`` from Flask-WTF's CSRFProtect if the app has it; whether it did."""
    csrf = app.extensions.get("csrf")
    if csrf is None or not hasattr(csrf, "exempt"):
        return False
    for view in views:
        csrf.exempt(view)
    return True


def _refusal(status: int, reason: str, *, basic: bool = False) -> Response:
    response = jsonify(error=reason)
    response.status_code = status
    if status == 401 and basic:
        response.headers["WWW-Authenticate"] = 'Basic realm="flask-mail-outbox webhooks"'
    return response


def _read_body() -> bytes | None:
    """The body, or None when it is over :data:`MAX_BODY_BYTES`."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        return None
    body = request.stream.read(MAX_BODY_BYTES + 1)
    return None if len(body) > MAX_BODY_BYTES else body


def _receive(state: AppState, receivers: dict[str, Receiver], name: str) -> Response:
    receiver = receivers.get(name)
    if receiver is None:
        return _refusal(404, "no webhook here: the transport is not configured, or its "
                        "OUTBOX_TRANSPORTS entry has no webhook_secret")
    body = _read_body()
    if body is None:
        return _refusal(413, f"the body is over {MAX_BODY_BYTES} bytes")
    incoming = WebhookRequest(headers={k.lower(): v for k, v in request.headers.items()},
                              body=body, now=time.time())
    try:
        received = receiver.receive(incoming)
    except WebhookRefused as refused:
        logger.warning("Refused a %s webhook request for transport %r from %s: %s",
                       receiver.kind, name, request.remote_addr, refused.reason)
        return _refusal(refused.status, refused.reason,
                        basic=webhook_auth(receiver.kind) == "basic")
    except InvalidMessage as exc:  # a verified body with a field no event can hold
        logger.warning("Refused a %s webhook request for transport %r: %s", receiver.kind,
                       name, exc)
        return _refusal(400, f"an event the outbox cannot store: {exc}")
    outbox = state.outbox()
    try:
        recorded = outbox.events.record(received.events, nonces=received.nonces,
                                        nonce_transport=name)
    except Replayed:  # durability: ok a replay is refused on purpose; no email is affected
        logger.warning("Refused a replayed %s webhook request for transport %r from %s",
                       receiver.kind, name, request.remote_addr)
        return _refusal(403, "this signature token was accepted before (a replay)")
    except Exception as exc:  # noqa: BLE001 - reported; the provider retries on a 5xx
        _degrade.report(
            f"Could not store {len(received.events)} delivery event(s) from transport {name!r}",
            consequence="they are not recorded yet: the request is answered 503, and the "
                        "provider sends them again later (each provider retries for hours); "
                        "suppressions they call for wait until then",
            fix="check the database connection and that outbox_event exists "
                "(`flask db upgrade outbox@head`)",
            exc=exc)
        return _refusal(503, "the events could not be stored; send them again later")
    if recorded.unmatched:
        logger.info("%d delivery event(s) from transport %r name no email this outbox knows "
                    "(kept with email_id NULL)", recorded.unmatched, name)
    response = jsonify(accepted=len(recorded.new), duplicates=recorded.duplicates,
                       unmatched=recorded.unmatched)
    if recorded.new or received.confirm_url:
        new, confirm = recorded.new, received.confirm_url
        response.call_on_close(lambda: _after(state, new, confirm, name))
    return response


def _after(state: AppState, events: tuple[DeliveryEvent, ...], confirm_url: str | None,
           name: str) -> None:
    """Once the provider has its answer: the signals, and an SNS subscription's confirmation."""
    if events:
        state.tell_events(events)
    if confirm_url is not None:
        try:
            response = httpx.get(confirm_url, timeout=10.0, follow_redirects=False)
            response.raise_for_status()
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            _degrade.report(
                f"Could not confirm the SNS subscription of transport {name!r}",
                consequence="SNS does not send this endpoint SES events until the "
                            "subscription is confirmed: bounces and complaints go unrecorded",
                fix="confirm it in the SNS console, or ask SNS to send the confirmation "
                    "again (it is valid for three days)",
                exc=exc)
        else:
            logger.info("Confirmed the SNS subscription of transport %r", name)


# -- one-click unsubscribe -------------------------------------------------------------

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="robots" content="noindex">
<title>{title}</title></head>
<body style="font-family: system-ui, sans-serif; max-width: 32rem; margin: 4rem auto;">
<h1 style="font-size: 1.4rem">{title}</h1>
{body}
</body></html>
"""


def _page(title: str, body: str, status: int = 200) -> Response:
    response = Response(_PAGE.format(title=html.escape(title), body=body), status=status,
                        mimetype="text/html")
    response.headers["Cache-Control"] = "no-store"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def _unsubscribe(state: AppState, token: str) -> Response:
    links = state.config.unsubscribe_links
    named = links.named_by(token) if links is not None else None
    if named is None:
        return _page("This unsubscribe link is not valid",
                     "<p>It may have been cut or changed. Use the link from the email "
                     "itself.</p>", status=400)
    address, message_id = named
    # Masked: a forwarded newsletter's link must not show its reader's address to
    # whoever opens it (the token is opaque for the same reason).
    shown = html.escape(masked(address))
    # Only a POST unsubscribes (RFC 8058). A GET, and a HEAD (a link checker's, even
    # with the one-click body), shows the page and changes nothing.
    if request.method != "POST":
        return _page("Unsubscribe", (
            f"<p>Stop sending mailing-list email to <strong>{shown}</strong>?</p>"
            '<form method="post"><input type="hidden" name="List-Unsubscribe" '
            'value="One-Click"><button type="submit">Unsubscribe</button></form>'))
    if request.form.get("List-Unsubscribe") != "One-Click":
        return _page("Not unsubscribed", "<p>The request did not say "
                     "<code>List-Unsubscribe=One-Click</code> (RFC 8058).</p>", status=400)
    try:
        outbox = state.outbox()
        email = (outbox.events.email_sent_to(address, message_id)
                 if message_id is not None else None)
        # With the email it came from, under the transport that sent it; one event per
        # link: its id is the link's, so a repeated POST stores nothing and tells no one.
        event = DeliveryEvent(
            "unsubscribed", recipient=address,
            transport=email[1] if email is not None else UNSUBSCRIBE_SOURCE,
            email_id=email[0] if email is not None else None,
            provider_event_id=_link_event_id(address, message_id),
            description="the one-click unsubscribe link (RFC 8058)")
        recorded = outbox.events.record([event], source=UNSUBSCRIBE_SOURCE)
    except Exception as exc:  # noqa: BLE001 - reported; answered 503 so the sender retries
        _degrade.report(
            f"Could not suppress {address} after a one-click unsubscribe",
            consequence="the address stays subscribed; the request is answered 503, so a "
                        "mailbox provider retries it (a person sees an error page)",
            fix="check the database connection and that outbox_suppression exists "
                "(`flask db upgrade outbox@head`)",
            exc=exc)
        return _page("Please try again later", "<p>The request could not be saved.</p>",
                     status=503)
    response = _page("Unsubscribed", f"<p><strong>{shown}</strong> will get no more "
                     "mailing-list email from us.</p>")
    if not recorded.new:  # this link was used before: recorded and told then
        return response
    app = state.app

    def tell() -> None:
        state.tell_events(recorded.new)
        with app.app_context():
            try:
                email_unsubscribed.send(app, address=address)
            except Exception:
                logger.exception("A receiver of the email_unsubscribed signal raised "
                                 "(%s); the address is suppressed all the same", address)

    response.call_on_close(tell)
    return response


def masked(address: str) -> str:
    """``address`` as the unsubscribe page shows it: ``r•••@example.com``."""
    local, at, domain = address.rpartition("@")
    if not at:
        return "•••"
    return f"{local[:1]}•••@{domain}"


def _link_event_id(address: str, message_id: str | None) -> str:
    """The event id of one link's unsubscribe: the same for every POST of that link."""
    named = f"{address}\x1f{message_id or ''}".encode("utf-8", "surrogatepass")
    return f"{UNSUBSCRIBE_SOURCE}:{hashlib.sha256(named).hexdigest()}"
