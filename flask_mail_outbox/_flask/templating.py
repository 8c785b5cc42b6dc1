"""Templated emails: ``mail.send_template()`` renders in the caller's request.

An email named ``orders/shipped`` is up to three Jinja templates found through
the app's own loader (the app's and its blueprints' ``templates/`` folders),
under ``OUTBOX_TEMPLATE_FOLDER`` (``email``)::

    email/orders/shipped.subject.txt   the subject (required; one line once rendered)
    email/orders/shipped.html          the HTML (or .mjml, compiled by MRML; one of the two)
    email/orders/shipped.txt           the text part (optional; made from the HTML without it)

They are rendered together, in one locale set with Flask-Babel's
``force_locale`` for the render only, with the caller's context and the app's
context processors. The HTML's ``<style>`` blocks and the static stylesheets it
links are then inlined by css-inline, because mail clients drop both.

Every template file the render reads is hashed (layouts and includes too, when
named by a string; not the inlined static stylesheets): the row
records the template's name, the locale and that hash, so an email says which
version of its template it came from. Every problem is a :class:`TemplateError`
naming the template, the locale, and the file and line when they are known;
nothing is written.

Caching: the compiled templates are Jinja's (the app's environment, and one
environment of ours each for strict undefined and MJML's escaping); this module
keeps per email which files it has and the hash of their sources, and per
stylesheet set one inliner. With ``TEMPLATES_AUTO_RELOAD`` (debug), a changed
file, or one added where the render looked for it, is read on the next render.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from email.utils import parseaddr
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import jinja2
from flask import Flask, current_app, has_app_context, has_request_context
from jinja2 import meta
from werkzeug.security import safe_join

from .._compose.message import Address, Message, TemplateInfo
from .._errors import TemplateError
from ..core._internal import OutboxConfig

logger = logging.getLogger(__name__)

SUBJECT_SUFFIX = ".subject.txt"
HTML_SUFFIX = ".html"
MJML_SUFFIX = ".mjml"
TEXT_SUFFIX = ".txt"
#: Fields the template makes: ``template_message()`` refuses them as keywords.
RENDERED_FIELDS = ("subject", "html", "body")

#: Spellings of locales remembered once checked (``"pt-BR"`` -> ``"pt_BR"``).
_MAX_CHECKED_LOCALES = 256

LocaleResolver = Callable[[list[str]], "str | None"]


class Preview(NamedTuple):
    """A preview of a templated email: its context, made by ``func()``."""

    template: str
    name: str
    func: Callable[[], Mapping[str, Any]]


@dataclass(frozen=True)
class RenderedEmail:
    """A templated email, rendered: what ``Message`` is built from."""

    name: str
    locale: str | None
    subject: str
    #: After MJML's compilation and CSS inlining.
    html: str
    #: The text template's output; None without one (the text is then made from the HTML).
    text: str | None
    #: SHA-256 (hex) of every file the render read, names and sources.
    source_hash: str
    #: ``(template file name, source)`` of every file the render read, layouts included.
    sources: tuple[tuple[str, str], ...]

    def message(self, **fields: Any) -> Message:
        """A :class:`Message` of this rendering; ``fields`` are its other fields (recipients...)."""
        _refuse_rendered_fields(self.name, fields)
        msg = Message(subject=self.subject, html=self.html, body=self.text, **fields)
        msg.template = TemplateInfo(self.name, self.locale, self.source_hash)
        return msg


def _refuse_rendered_fields(name: str, fields: Mapping[str, Any]) -> None:
    given = [field for field in RENDERED_FIELDS if field in fields]
    if given:
        raise TypeError(f"template {name!r}: {', '.join(given)} come from the template's files; "
                        "pass the values they need in context=...")


@dataclass(frozen=True)
class _Files:
    """Which files an email has, and the hash of everything they read."""

    subject: str
    body: str
    text: str | None
    source_hash: str
    sources: tuple[tuple[str, str], ...]
    #: Template file path -> name, to name the file in an error's traceback.
    names_by_path: dict[str, str]
    uptodate: tuple[Callable[[], bool], ...]
    #: Files looked for and not found (an optional part, a missing include): one that
    #: appears later changes the email as much as an edit does.
    absent: tuple[str, ...] = ()

    @property
    def mjml(self) -> bool:
        return self.body.endswith(MJML_SUFFIX)

    def fresh(self, env: jinja2.Environment) -> bool:
        return (all(check() for check in self.uptodate)
                and all(_source(env, file) is None for file in self.absent))


class EmailTemplates:
    """The templated emails of one app: names, locales, previews, and the renderer."""

    def __init__(self, app: Flask, config: OutboxConfig,
                 previews: dict[str, list[Preview]]) -> None:
        self.app = app
        self.folder = config.template_folder
        self.inline_css = config.template_inline_css
        self.max_subject = config.template_max_subject
        self._configured_locales = config.template_locales
        self._previews = previews
        self._files: dict[str, _Files] = {}
        self._envs: dict[tuple[bool, bool], jinja2.Environment] = {}
        self._locales: list[str] | None = None
        self._checked: dict[str, str] = {}
        self._inliners: dict[str, Any] = {}
        self._sheets: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    # -- what there is ----------------------------------------------------------------

    def names(self) -> list[str]:
        """Every templated email under the folder, sorted: ``["orders/shipped", ...]``.

        An email is a ``<name>.subject.txt`` file; a path segment starting with ``_``
        (``email/_layout.html``, ``email/_parts/...``) is never one.
        """
        prefix = self.folder + "/"
        found = set()
        for path in self.app.jinja_env.list_templates():
            if path.startswith(prefix) and path.endswith(SUBJECT_SUFFIX):
                name = path[len(prefix):-len(SUBJECT_SUFFIX)]
                if name and not any(part.startswith("_") for part in name.split("/")):
                    found.add(name)
        return sorted(found)

    def previews(self) -> dict[str, list[Preview]]:
        """Each template's registered previews (``@mail.preview``), in registration order."""
        return {name: list(items) for name, items in self._previews.items()}

    def default_locale(self) -> str | None:
        """Flask-Babel's default locale (``BABEL_DEFAULT_LOCALE``); None without Flask-Babel.

        The language the templates are written in: the one no catalog translates.
        """
        babel = self.app.extensions.get("babel")
        if babel is None:
            return None
        from babel import Locale  # Flask-Babel's own dependency

        return str(Locale.parse(babel.default_locale))

    def locales(self) -> list[str]:
        """The locales emails are written in, the default first.

        ``OUTBOX_TEMPLATE_LOCALES`` when set, else every locale Flask-Babel has a
        catalog for; empty when the app has no Flask-Babel.
        """
        if self._locales is None:
            self._locales = self._find_locales()
        return list(self._locales)

    def _find_locales(self) -> list[str]:
        babel = self.app.extensions.get("babel")
        if babel is None:
            if self._configured_locales:
                raise TemplateError("*", "OUTBOX_TEMPLATE_LOCALES is set, but the app has no "
                                    "Flask-Babel to translate with: set it up "
                                    "(flask_babel.Babel(app), the `i18n` extra)")
            return []
        default = self.default_locale()
        if self._configured_locales:
            found = [self._normal(name, "*") for name in self._configured_locales]
        else:
            with self.app.app_context():
                found = [str(locale) for locale in babel.instance.list_translations()]
        ordered = ([default] if default is not None and (
            default in found or not self._configured_locales) else [])
        ordered += sorted(set(found) - {default})
        return ordered

    # -- the locale ---------------------------------------------------------------------

    def choose_locale(self, name: str, given: str | None = None,
                      recipients: Iterable[Address] = (),
                      resolver: LocaleResolver | None = None) -> str | None:
        """The locale to render ``name`` in: given, else the resolver's, else the request's.

        Then Flask-Babel's default; None without Flask-Babel. A given or resolved
        locale that is not one of :meth:`locales` is a :class:`TemplateError`.
        """
        if given is not None:
            return self.check_locale(name, given)
        bare = _bare(recipients) if resolver is not None else []
        if resolver is not None and bare:  # no To address (bcc only): nobody to ask about
            resolved = resolver(bare)
            if resolved is not None:
                return self.check_locale(name, resolved)
        babel = self.app.extensions.get("babel")
        if babel is None:
            return None
        locales = self.locales()
        if has_request_context():
            import flask_babel

            current = flask_babel.get_locale()
            if current is not None:
                # A regional locale (de_AT) reads its language's catalog (de), as the
                # request's own pages do.
                for candidate in (str(current), current.language):
                    if candidate in locales:
                        return candidate
        return locales[0] if locales else None

    def check_locale(self, name: str, locale: object) -> str:
        """``locale`` normalised (``"pt-BR"`` -> ``"pt_BR"``), or a :class:`TemplateError`."""
        if isinstance(locale, str) and locale in self._checked:
            return self._checked[locale]
        if self.app.extensions.get("babel") is None:
            raise TemplateError(name, f"locale {locale!r} given, but the app has no Flask-Babel "
                                "to translate with: set it up (flask_babel.Babel(app), the "
                                "`i18n` extra), or send without a locale")
        normal = self._normal(locale, name)
        locales = self.locales()
        if locales and normal not in locales:
            raise TemplateError(name, f"locale {normal!r} is not one of the app's locales "
                                f"({', '.join(locales)}): add its catalog, or list it in "
                                "OUTBOX_TEMPLATE_LOCALES", locale=normal)
        if isinstance(locale, str):
            # Bounded: a locale can come from outside (a form, a user's setting), and
            # every spelling (" de", "de\t"...) would otherwise be kept for good.
            if len(self._checked) >= _MAX_CHECKED_LOCALES:
                self._checked.clear()
            self._checked[locale] = normal
        return normal

    @staticmethod
    def _normal(locale: object, name: str) -> str:
        from babel import Locale, UnknownLocaleError

        if not isinstance(locale, str) or not locale.strip():
            raise TemplateError(name, f"a locale is a name such as 'de' or 'pt_BR', got {locale!r}")
        try:
            return str(Locale.parse(locale.strip().replace("-", "_")))
        except (ValueError, TypeError, UnknownLocaleError) as exc:
            raise TemplateError(name, f"unknown locale {locale!r} ({exc})") from None

    def _forced(self, locale: str | None) -> AbstractContextManager[Any]:
        if locale is None or self.app.extensions.get("babel") is None:
            return nullcontext()
        import flask_babel

        forced: AbstractContextManager[Any] = flask_babel.force_locale(locale)
        return forced

    def _bound_gettext(self, locale: str | None) -> dict[str, Any]:
        """Flask-Babel's template gettext family, bound to this render's catalog.

        Flask-Babel's callables find the app, the locale and the catalog again
        on every call (7-12 µs each); a render has one locale, so they are found
        once. Jinja resolves these names in the render's context before the
        environment's globals, and its own newstyle wrappers (the ones
        Flask-Babel installs) do the rest, so the output is the same bytes
        (benchmarks/templates.py: about 0.5 ms an email of 41 strings).
        """
        if locale is None or not getattr(self.app.jinja_env, "newstyle_gettext", False):
            return {}
        import flask_babel
        from jinja2 import ext

        makers = [getattr(ext, f"_make_new_{kind}", None)
                  for kind in ("gettext", "ngettext", "pgettext", "npgettext")]
        if any(maker is None for maker in makers):
            return {}  # a Jinja without them: Flask-Babel's own callables do the work
        catalog = flask_babel.get_translations()
        functions = (catalog.ugettext, catalog.ungettext, catalog.upgettext, catalog.unpgettext)
        bound = {name: maker(function)  # type: ignore[misc]
                 for name, maker, function in zip(
                     ("gettext", "ngettext", "pgettext", "npgettext"), makers, functions,
                     strict=True)}
        # Jinja's ``_`` looks ``gettext`` up and calls it: one call instead of two.
        bound["_"] = bound["gettext"]
        return bound

    # -- rendering ------------------------------------------------------------------------

    def render(self, name: str, context: Mapping[str, Any] | None = None, *,
               locale: str | None = None, strict: bool = False) -> RenderedEmail:
        """Render ``name`` in ``locale`` (None: as :meth:`choose_locale` picks).

        In the app's context: the current one, else one pushed for the render.

        ``strict``: an undefined variable is an error even where Jinja would print
        nothing (the check's mode). Raises :class:`TemplateError`.
        """
        # In this app's context: Flask-Babel finds the catalog through it, and without
        # it (or in another app's) translated nothing, while the email said its locale.
        if _current_app() is self.app:
            return self._render_email(name, context, locale, strict)
        with self.app.app_context():
            return self._render_email(name, context, locale, strict)

    def _render_email(self, name: str, context: Mapping[str, Any] | None, locale: str | None,
                      strict: bool) -> RenderedEmail:
        _check_name(name)
        if context is not None and not isinstance(context, Mapping):
            raise TemplateError(name, f"context must be a mapping (a dict), got "
                                f"{type(context).__name__}")
        locale = self.choose_locale(name, locale)
        files = self._files_of(name, locale)
        values = dict(context or {})
        values.setdefault("locale", locale)
        with self._forced(locale):
            # The app's context processors too: a value they translate is in this locale.
            self.app.update_template_context(values)
            for alias, bound in self._bound_gettext(locale).items():
                values.setdefault(alias, bound)
            subject = self._render(name, files, files.subject, values, locale, strict)
            body = self._render(name, files, files.body, values, locale, strict,
                                escape_all=files.mjml)
            text = (self._render(name, files, files.text, values, locale, strict)
                    if files.text is not None else None)
        subject = " ".join(subject.split())
        if files.mjml:
            body = self._compile_mjml(name, files.body, body, locale)
        html = self._inline(name, body, locale) if self.inline_css else body
        logger.debug("Rendered the email template %s in locale %s (sources %s)", name, locale,
                     files.source_hash[:12])
        return RenderedEmail(name=name, locale=locale, subject=subject, html=html, text=text,
                             source_hash=files.source_hash, sources=files.sources)

    def _env(self, strict: bool, escape_all: bool) -> jinja2.Environment:
        base = self.app.jinja_env
        if not strict and not escape_all:
            return base
        env = self._envs.get((strict, escape_all))
        if env is None or env.linked_to is not base:
            # Its own cache: a compiled template is bound to the environment it was
            # compiled in, whose undefined and autoescape it keeps.
            options: dict[str, Any] = {"cache_size": 400}
            if strict:
                options["undefined"] = jinja2.StrictUndefined
            if escape_all:
                options["autoescape"] = True
            env = self._envs[strict, escape_all] = base.overlay(**options)
        # An overlay copies auto_reload once; Flask's debug setter changes the app's
        # later, and a stale overlay rendered an old file under the new file's hash.
        env.auto_reload = base.auto_reload
        return env

    def _render(self, name: str, files: _Files, file: str, values: dict[str, Any],
                locale: str | None, strict: bool, *, escape_all: bool = False) -> str:
        try:
            return self._env(strict, escape_all).get_template(file).render(values)
        except TemplateError:
            raise
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(name, f"syntax error: {exc.message}", locale=locale,
                                file=exc.name or file, lineno=exc.lineno) from None
        except jinja2.TemplateNotFound as exc:
            where, line = _template_position(exc, files)
            raise TemplateError(name, f"includes {exc.name!r}, which is not in the app's "
                                "template folders", locale=locale, file=where or file,
                                lineno=line) from None
        except jinja2.UndefinedError as exc:
            where, line = _template_position(exc, files)
            raise TemplateError(name, f"{exc.message} (pass it in context=...)",
                                locale=locale, file=where or file, lineno=line) from None
        except Exception as exc:
            where, line = _template_position(exc, files)
            raise TemplateError(name, f"{type(exc).__name__} while rendering: {exc}",
                                locale=locale, file=where or file, lineno=line) from exc

    # -- the files and their hash ----------------------------------------------------------

    def _files_of(self, name: str, locale: str | None) -> _Files:
        files = self._files.get(name)
        env = self.app.jinja_env
        if files is not None and (not env.auto_reload or files.fresh(env)):
            return files
        files = self._files[name] = self._find_files(name, locale)
        return files

    def _find_files(self, name: str, locale: str | None) -> _Files:
        env = self.app.jinja_env
        base = f"{self.folder}/{name}"
        subject = base + SUBJECT_SUFFIX
        found = {suffix: _source(env, base + suffix)
                 for suffix in (SUBJECT_SUFFIX, HTML_SUFFIX, MJML_SUFFIX, TEXT_SUFFIX)}
        if found[SUBJECT_SUFFIX] is None:
            known = self.names()
            hint = (f"; the app has {', '.join(known[:10])}" if known
                    else f"; the app has no templated email under {self.folder}/")
            raise TemplateError(name, f"no such email: {subject} is not in the app's template "
                                f"folders{hint}", locale=locale)
        if (found[HTML_SUFFIX] is None) == (found[MJML_SUFFIX] is None):
            both = "has both" if found[HTML_SUFFIX] is not None else "needs one of"
            raise TemplateError(name, f"{both} {base}{HTML_SUFFIX} and {base}{MJML_SUFFIX}",
                                locale=locale)
        body = base + (HTML_SUFFIX if found[HTML_SUFFIX] is not None else MJML_SUFFIX)
        text = base + TEXT_SUFFIX if found[TEXT_SUFFIX] is not None else None
        sources: dict[str, tuple[str, str | None, Callable[[], bool] | None]] = {}
        absent = {base + suffix for suffix, got in found.items() if got is None}
        pending = [file for file in (subject, body, text) if file is not None]
        while pending:
            file = pending.pop()
            if file in sources:
                continue
            got = _source(env, file)
            if got is None:
                absent.add(file)  # an include that is missing: the render names it
                continue
            sources[file] = got
            try:
                parsed = env.parse(got[0], file)
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateError(name, f"syntax error: {exc.message}", locale=locale,
                                    file=file, lineno=exc.lineno) from None
            pending.extend(ref for ref in meta.find_referenced_templates(parsed)
                           if ref is not None)
        digest = hashlib.sha256()
        for file in sorted(sources):
            digest.update(file.encode() + b"\0" + sources[file][0].encode() + b"\0")
        return _Files(
            subject=subject, body=body, text=text, source_hash=digest.hexdigest(),
            sources=tuple((file, sources[file][0]) for file in sorted(sources)),
            names_by_path={path: file for file, (_, path, _) in sources.items() if path},
            uptodate=tuple(check for _, _, check in sources.values() if check is not None),
            absent=tuple(sorted(absent)))

    # -- MJML and CSS ---------------------------------------------------------------------

    def _compile_mjml(self, name: str, file: str, source: str, locale: str | None) -> str:
        try:
            import mrml
        except ImportError:
            raise TemplateError(name, "an .mjml template needs MRML: pip install "
                                "'flask-mail-outbox[mjml]'", locale=locale, file=file) from None
        try:
            compiled: str = mrml.to_html(source).content
        except Exception as exc:  # noqa: BLE001 - MRML's parser raises its own types
            raise TemplateError(name, f"MJML does not compile: {exc}", locale=locale,
                                file=file) from None
        return compiled

    def _inline(self, name: str, html: str, locale: str | None) -> str:
        lowered = html.lower()
        if "<style" not in lowered and "<link" not in lowered:
            return html
        html, sheets = self._take_static_sheets(name, html, locale)
        if "<style" not in lowered and not sheets:
            return html
        inliner = self._inliners.get(sheets)
        if inliner is None:
            try:
                import css_inline
            except ImportError:
                raise TemplateError(
                    name, "its HTML has CSS to inline, which needs css-inline: pip install "
                    "'flask-mail-outbox[templates]' (or set OUTBOX_TEMPLATE_INLINE_CSS = False "
                    "to send the CSS as written, which most mail clients drop)",
                    locale=locale) from None
            # Remote sheets (a web font's) stay linked for the clients that load them;
            # the app's own were taken out above and come in as extra_css.
            inliner = css_inline.CSSInliner(
                keep_at_rules=True, keep_link_tags=True, load_remote_stylesheets=False,
                extra_css=sheets or None)
            with self._lock:
                if len(self._inliners) > 64:
                    self._inliners.clear()
                self._inliners[sheets] = inliner
        try:
            inlined: str = inliner.inline(html)
        except ValueError as exc:  # css_inline.InlineError
            raise TemplateError(name, f"its CSS cannot be inlined: {exc}", locale=locale) from None
        return inlined

    def _take_static_sheets(self, name: str, html: str, locale: str | None) -> tuple[str, str]:
        """``html`` without its links to the app's static stylesheets, and their text.

        A link to ``/static/...`` (``url_for("static", ...)``, external or not) is read
        from the app's static folder, never fetched. A link to another site stays
        (a web font's); a relative link to anything else cannot work in an email.
        """
        static_path = (self.app.static_url_path or "").rstrip("/") + "/"
        kept: list[str] = []
        sheets: list[str] = []
        last = 0
        for match in _LINK_TAG.finditer(html):
            href = _stylesheet_href(match.group(0))
            if href is None:
                continue
            parts = urlsplit(href)
            folder = self.app.static_folder
            if static_path != "/" and parts.path.startswith(static_path) and folder:
                # url_for() quotes the name ("a%20b.css"); safe_join() then refuses
                # what leaves the folder, however it was spelled ("%2e%2e/").
                file = safe_join(folder, unquote(parts.path[len(static_path):]))
                if file is None or not os.path.isfile(file):
                    raise TemplateError(name, f"links the stylesheet {href!r}, which is not a "
                                        "file in the app's static folder", locale=locale)
                sheets.append(self._sheet(file))
                kept.append(html[last:match.start()])
                last = match.end()
            elif not (parts.scheme and parts.netloc):
                raise TemplateError(
                    name, f"links the stylesheet {href!r}, which is neither in the app's static "
                    "folder nor an absolute URL: an email has no page to be relative to; put "
                    "it under static/ (it is then inlined) or in a <style> block", locale=locale)
        kept.append(html[last:])
        return "".join(kept), "".join(sheets)

    def _sheet(self, file: str) -> str:
        mtime = os.stat(file).st_mtime
        kept = self._sheets.get(file)
        if kept is None or kept[0] != mtime:
            with open(file, encoding="utf-8") as handle:
                kept = self._sheets[file] = (mtime, handle.read())
        return kept[1] + "\n"


def _current_app() -> Flask | None:
    """The app whose context is active, or None."""
    if not has_app_context():
        return None
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    return app


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise TemplateError(repr(name), "a template name is a str such as 'orders/shipped'")
    parts = name.split("/")
    if any(part in ("", ".", "..") or part.startswith("_") for part in parts) or "\\" in name:
        raise TemplateError(name, "a template name is a relative path such as 'orders/shipped', "
                            "without empty, '.', '..' or '_'-prefixed parts")


def _source(env: jinja2.Environment,
            file: str) -> tuple[str, str | None, Callable[[], bool] | None] | None:
    if env.loader is None:
        return None
    try:
        return env.loader.get_source(env, file)
    except jinja2.TemplateNotFound:
        return None


def _template_position(exc: BaseException, files: _Files) -> tuple[str | None, int | None]:
    """The template file and line an exception was raised in (the innermost template frame).

    Jinja rewrites a render's traceback so that each template frame has the
    template's file name and line; they are matched back to template names.
    """
    where: tuple[str | None, int | None] = (None, None)
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if path in files.names_by_path:
            where = (files.names_by_path[path], tb.tb_lineno)
        tb = tb.tb_next
    if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno:
        return (exc.name or where[0], exc.lineno)
    return where


_LINK_TAG = re.compile(r"<link\b[^>]*>", re.IGNORECASE)
# Starts only where a name starts: each run of letters is tried once (linear).
_ATTRIBUTE = re.compile(r"""(?<![a-zA-Z-])([a-zA-Z-]+)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")


def _stylesheet_href(tag: str) -> str | None:
    """The ``href`` of a ``<link rel="stylesheet">`` tag; None for any other link."""
    attributes = {m.group(1).lower(): m.group(2) or m.group(3) or m.group(4) or ""
                  for m in _ATTRIBUTE.finditer(tag)}
    if "stylesheet" in attributes.get("rel", "").lower().split() and attributes.get("href"):
        return attributes["href"]
    return None


def _bare(recipients: Iterable[Address]) -> list[str]:
    bare = []
    for recipient in recipients:
        if isinstance(recipient, tuple):
            bare.append(recipient[1])
        elif isinstance(recipient, str):
            bare.append(parseaddr(recipient)[1] or recipient)
    return bare

