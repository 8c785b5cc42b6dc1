"""The previews section: every templated email, each locale side by side, and "send this to me".

``GET /previews`` lists the app's email templates (``EmailTemplates.names()``)
with the previews registered for each (``@mail.preview``); a template without
one is listed too, rendered with an empty context. ``GET /previews?template=
<name>&preview=<preview name>`` renders it in every locale, side by side: the
subject, the html (the ``srcdoc`` of a sandboxed iframe, never the page
itself), the text part and the raw MIME, as ``mail.send_template()`` would
build them. A render that fails shows the :class:`TemplateError`'s text
(template, locale, file, line) in its column; the page still answers 200.

``POST /previews/send`` ("send this to me") queues the same email to an address
through ``mail.send_template()``, the normal outbox path, commits, and redirects
to the new email's page. An address or locale that is refused shows the page
again with the reason (400); nothing is written.

The template and preview are query arguments, not path segments: a template
name holds slashes, and every route of the blueprint stays buildable with no
placeholder but an email id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, g, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from ..._errors import InvalidMessage, TemplateError
from ..._flask.state import app_state
from ._preview import preview as parse_mime

if TYPE_CHECKING:
    from ..._flask.extension import OutboxExtension
    from ..._flask.templating import EmailTemplates, Preview

#: The Content-Security-Policy of a preview page: the dashboard's, with inline
#: styles allowed. A templated email's CSS is inlined into ``style`` attributes,
#: which the dashboard's ``style-src 'self'`` would drop in the (inheriting)
#: srcdoc frame, and a preview is for seeing the look. Still no script (none is
#: allowed anywhere), no image but ``data:``, no font, no navigation of the frame:
#: a style cannot fetch anything, so it cannot report what it matched. The
#: dashboard's own markup is autoescaped and carries no style attribute.
PREVIEW_CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self' 'unsafe-inline'; img-src data:; frame-src 'none'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
#: The flag on ``flask.g`` that gives a response the preview's policy.
INLINE_STYLES_FLAG = "outbox_dashboard_inline_styles"
#: The recipient of the raw MIME shown (the envelope is not part of a preview).
PREVIEW_RECIPIENT = "recipient@example.com"
#: Form fields no template or preview name can exceed (PostgreSQL text has no NUL).
_MAX_NAME = 255
_MAX_ADDRESS = 320


@dataclasses.dataclass(frozen=True)
class Rendered:
    """One locale's column: what ``send_template()`` would send, or why it cannot."""

    locale: str | None
    subject: str | None = None
    html: str | None = None
    text: str | None = None
    #: The text part was made from the html (the template has no ``.txt``).
    text_from_html: bool = False
    mime: str | None = None
    #: Why the message could not be built (after the render worked): e.g. no sender.
    mime_problem: str | None = None
    error: str | None = None
    error_fields: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Listed:
    """A template in the list: its name and its previews' names (registration order)."""

    name: str
    previews: list[str]


class Previews:
    """The previews pages and the send action, bound to one ``OutboxMail``."""

    def __init__(self, mail: OutboxExtension) -> None:
        self.mail = mail

    def register(self, bp: Blueprint) -> None:
        bp.add_url_rule("/previews", "previews", self.previews)
        bp.add_url_rule("/previews/send", "send_preview", self.send, methods=["POST"])

    # -- pages ----------------------------------------------------------------------

    def previews(self) -> ResponseReturnValue:
        if "template" not in request.args:
            return self._list()
        name = _name_arg(request.args, "template")
        return self._page(name, _name_arg(request.args, "preview") or None)

    def _list(self) -> ResponseReturnValue:
        templates = _templates()
        registered = templates.previews()
        found = set(templates.names())
        listed = [Listed(name, [p.name for p in registered.get(name, [])])
                  for name in sorted(found | set(registered))]
        locales, problem = _locales(templates)
        return render_template("outbox_dashboard/previews.html", listed=listed, found=found,
                               folder=templates.folder, locales=locales, problem=problem)

    def _page(self, name: str, preview_name: str | None, *, error: str | None = None,
              address: str = "", locale: str | None = None,
              code: int = 200) -> ResponseReturnValue:
        templates = _templates()
        found = name in templates.names()
        chosen = _find_preview(templates, name, preview_name, found=found)
        locales, problem = _locales(templates)
        context, context_error = _context(chosen)
        if problem is not None or context is None:
            columns = [Rendered(loc, error=problem or context_error) for loc in locales]
        else:
            columns = [_render(templates, name, context, loc) for loc in locales]
        g.setdefault(INLINE_STYLES_FLAG, True)
        others = [p.name for p in templates.previews().get(name, [])]
        return render_template(
            "outbox_dashboard/preview.html", name=name, preview_name=preview_name,
            others=others, columns=columns, error=error, address=address,
            locale=locale, found=found), code

    # -- the action -----------------------------------------------------------------

    def send(self) -> ResponseReturnValue:
        name = _name_arg(request.form, "template")
        preview_name = _name_arg(request.form, "preview") or None
        locale = _name_arg(request.form, "locale") or None
        address = request.form.get("address", "").strip()
        if "\x00" in address or len(address) > _MAX_ADDRESS:
            abort(400, description=f"address must be at most {_MAX_ADDRESS} characters, "
                                   "without a NUL character")
        templates = _templates()
        chosen = _find_preview(templates, name, preview_name, found=name in templates.names())
        context, context_error = _context(chosen)
        if context is None:
            return self._page(name, preview_name, error=f"Not sent: {context_error}",
                              address=address, locale=locale, code=400)
        session = app_state().db.session
        try:
            email_id = self.mail.send_template(name, recipients=[address], context=context,
                                               locale=locale)
            session.commit()
        except InvalidMessage as exc:  # checked before anything is added to the session
            return self._page(name, preview_name, error=f"Not sent: {exc}",
                              address=address, locale=locale, code=400)
        except Exception:
            session.rollback()
            raise
        return redirect(url_for(".email", email_id=email_id, notice="preview_sent"), code=303)


def _templates() -> EmailTemplates:
    return app_state().templates


def _locales(templates: EmailTemplates) -> tuple[list[str | None], str | None]:
    """The columns' locales (one None column without any), and why there are none, if
    the setting is wrong (``OUTBOX_TEMPLATE_LOCALES`` without Flask-Babel)."""
    try:
        return list(templates.locales()) or [None], None
    except TemplateError as exc:
        return [None], str(exc)


def _find_preview(templates: EmailTemplates, name: str, preview_name: str | None, *,
                  found: bool) -> Preview | None:
    """The registered preview, or None (an empty context); 404 for a name no one knows.

    ``found``: whether ``name`` is among the templates' names.
    """
    registered = templates.previews().get(name, [])
    if not found and not registered:
        abort(404, description=f"There is no email template {name!r} under "
                               f"{templates.folder!r}.")
    if preview_name is None:
        return None
    for candidate in registered:
        if candidate.name == preview_name:
            return candidate
    abort(404, description=f"The email template {name!r} has no preview {preview_name!r}.")


def _context(chosen: Preview | None) -> tuple[Mapping[str, Any] | None, str | None]:
    """The preview function's context (``{}`` without one), or None and why not."""
    if chosen is None:
        return {}, None
    label = f"the preview {chosen.name!r} of {chosen.template!r}"
    try:
        context = chosen.func()
    except Exception as exc:  # noqa: BLE001 - shown on the page, in place of the email
        return None, f"{label} raised {type(exc).__name__}: {exc}"
    if not isinstance(context, Mapping):
        return None, (f"{label} returned a {type(context).__name__}, not a mapping "
                      "(a dict of the template's variables)")
    return context, None


def _render(templates: EmailTemplates, name: str, context: Mapping[str, Any],
            locale: str | None) -> Rendered:
    """One locale's column: the render, and the message ``send_template()`` would build."""
    try:
        rendered = templates.render(name, context, locale=locale)
    except TemplateError as exc:
        fields = [("template", exc.template), ("locale", exc.locale or "—")]
        if exc.file:
            fields.append(("file", exc.file))
        if exc.lineno:
            fields.append(("line", str(exc.lineno)))
        return Rendered(locale, error=str(exc), error_fields=tuple(fields))
    try:
        mime = rendered.message(recipients=[PREVIEW_RECIPIENT]).as_bytes()
    except InvalidMessage as exc:  # e.g. no MAIL_DEFAULT_SENDER: the render is still shown
        return Rendered(locale, subject=rendered.subject, html=rendered.html,
                        text=rendered.text, mime_problem=str(exc))
    parsed = parse_mime(mime)
    # The text part as it would be sent: the template's, or the one made from the html.
    text = rendered.text if rendered.text is not None else parsed.text
    return Rendered(locale, subject=rendered.subject, html=rendered.html, text=text,
                    text_from_html=rendered.text is None and text is not None,
                    mime=mime.decode("utf-8", "replace"))


def _name_arg(values: Mapping[str, str], field: str) -> str:
    """A template, preview or locale name from the query or form ('' when absent); 400 if no
    name could be it."""
    value = values.get(field, "")
    if "\x00" in value or len(value) > _MAX_NAME:
        abort(400, description=f"{field} must be at most {_MAX_NAME} characters, "
                               "without a NUL character")
    return value
