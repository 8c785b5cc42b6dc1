"""``flask outbox templates check``: every templated email rendered as CI should see it.

:func:`check_templates` renders each email template in each locale with each of
its preview contexts (``{}`` without one), undefined variables being errors,
inside a test request context of the app, and hands every rendering to the
rules below. The rules are plain functions from what was rendered to a list
of :class:`Problem`, so each can be tested without the command:

- :func:`check_html`: relative ``href`` / ``src`` URLs and ``<img>`` without ``alt``
  (positions in the rendered HTML, from :mod:`html.parser`);
- :func:`check_size`: an HTML part larger than Gmail's clipping size;
- :func:`check_subject`: a subject longer than ``OUTBOX_TEMPLATE_MAX_SUBJECT``;
- :func:`untranslated`: a message id the templates use without a translation
  in the locale's catalog (Flask-Babel's).

A problem found in the rendered HTML is reported at the source file and line
that wrote it when its text is there literally, else at its line in the
rendered HTML, and the line says which.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import TemplateError
from .._outside import clean_line

if TYPE_CHECKING:
    from flask import Flask
    from jinja2 import Environment

    from .._flask.templating import EmailTemplates, Preview

#: Gmail shows "[Message clipped]" and hides the rest of an HTML part over this size
#: (102 KB of the HTML as sent, counted here in UTF-8 bytes).
GMAIL_CLIP_BYTES = 102 * 1024

#: A URL with a scheme (https:, mailto:, cid:, ...) or a fragment works in a mail client;
#: anything else (a path, "//host/...", empty) has nothing to be resolved against.
_ABSOLUTE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:|#")
_URL_ATTRIBUTES = ("href", "src")
# An <img> (or MJML's <mj-image>) start tag in a template source, and an alt attribute.
_SOURCE_IMG = re.compile(r"<(?:img|mj-image)\b[^>]*>", re.IGNORECASE)
_ALT = re.compile(r"\salt\s*=", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    """One problem of one rendering, printed as one line.

    ``file`` and ``line`` say where: a template file of the closure (as Jinja
    names it, ``email/orders/shipped.html``), or, when ``in_rendered`` is
    true, ``line`` is a line of the rendered HTML of ``file``. ``preview`` is
    the preview's name, None for a template rendered with ``{}`` (no preview).
    """

    template: str
    locale: str | None
    preview: str | None
    message: str
    file: str | None = None
    line: int | None = None
    in_rendered: bool = False

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"<rendered {self.file}>" if self.in_rendered else self.file
            where += f":{self.line}: " if self.line is not None else ": "
        locale = f" [{self.locale}]" if self.locale else ""
        preview = ("(no preview, context {})" if self.preview is None
                   else f'(preview "{clean_line(self.preview, 100)}")')
        return f"{where}{self.template}{locale} {preview}: {clean_line(self.message, 500)}"


@dataclass
class CheckReport:
    """What :func:`check_templates` did: the problems, in the order found, and the counts."""

    problems: list[Problem] = field(default_factory=list)
    emails: int = 0
    locales: int = 0
    renders: int = 0

    def summary(self) -> str:
        """The command's last line: ``3 emails × 2 locales checked (8 renderings): 1 problem``."""
        checked = (f"{_count(self.emails, 'email')} × {_count(self.locales, 'locale')} checked"
                   if self.locales else f"{_count(self.emails, 'email')} checked without locales")
        return (f"{checked} ({_count(self.renders, 'rendering')}): "
                f"{_count(len(self.problems), 'problem')}")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


class SelectionError(ValueError):
    """A ``--template`` or ``--locale`` the app does not have; ``option`` names which."""

    def __init__(self, option: str, problem: str) -> None:
        self.option = option
        self.problem = problem
        super().__init__(f"{option}: {problem}")


# -- the HTML rules ------------------------------------------------------------------------


RELATIVE_URL = "relative URL"
IMG_WITHOUT_ALT = "<img> without alt"


class HtmlFinding(NamedTuple):
    """A problem :func:`check_html` saw at ``line`` of the rendered HTML."""

    line: int
    kind: str  # RELATIVE_URL or IMG_WITHOUT_ALT
    message: str
    #: For a relative URL, the attribute and its value; for an <img>, its src ("" if none).
    attribute: str
    value: str


class _HtmlScanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.findings: list[HtmlFinding] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        line = self.getpos()[0]
        values = {name: value or "" for name, value in attrs}
        for name in _URL_ATTRIBUTES:
            if name in values and not _ABSOLUTE.match(values[name].strip()):
                url = values[name].strip()
                self.findings.append(HtmlFinding(
                    line, RELATIVE_URL, f'relative URL in <{tag} {name}>: "{clean_line(url, 200)}"',
                    name, url))
        if tag == "img" and "alt" not in values:
            self.findings.append(HtmlFinding(
                line, IMG_WITHOUT_ALT, IMG_WITHOUT_ALT, "src",
                values.get("src", "").strip()))


def check_html(html: str) -> list[HtmlFinding]:
    """Relative ``href``/``src`` URLs and ``<img>`` without ``alt`` in ``html``, in order."""
    scanner = _HtmlScanner()
    scanner.feed(html)
    scanner.close()
    return scanner.findings


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def locate_attribute(sources: Sequence[tuple[str, str]], attribute: str,
                     value: str) -> tuple[str, int] | None:
    """The first source file and line where ``attribute="value"`` is written literally."""
    if not value:
        return None
    escaped = value.replace("&", "&amp;")
    for candidate in dict.fromkeys((value, escaped)):
        pattern = re.compile(rf"""\b{re.escape(attribute)}\s*=\s*(["']?){re.escape(candidate)}"""
                             r"""(?:\1)(?=[\s/>]|$)""", re.IGNORECASE)
        for name, source in sources:
            match = pattern.search(source)
            if match is not None:
                return name, _line_of(source, match.start())
    return None


def locate_img_without_alt(sources: Sequence[tuple[str, str]],
                           src: str) -> tuple[str, int] | None:
    """The source ``<img>``/``<mj-image>`` without alt that wrote a rendered one of ``src``.

    The one whose src is written literally; else the closure's only such tag.
    """
    tags = [(name, source, match) for name, source in sources
            for match in _SOURCE_IMG.finditer(source) if not _ALT.search(match.group())]
    if src:
        for name, source, match in tags:
            if locate_attribute([(name, match.group())], "src", src) is not None:
                return name, _line_of(source, match.start())
    if len(tags) == 1:
        name, source, match = tags[0]
        return name, _line_of(source, match.start())
    return None


# -- the rules over one rendering ------------------------------------------------------------


@dataclass(frozen=True)
class Rendering:
    """Which rendering a problem belongs to."""

    template: str
    locale: str | None
    preview: str | None
    #: The email's own files, as Jinja names them: its HTML (or MJML) and its subject.
    html_file: str
    subject_file: str

    def problem(self, message: str, file: str | None = None, line: int | None = None, *,
                in_rendered: bool = False) -> Problem:
        return Problem(self.template, self.locale, self.preview, message, file, line,
                       in_rendered)


def html_problems(rendering: Rendering, html: str,
                  sources: Sequence[tuple[str, str]]) -> list[Problem]:
    """:func:`check_html` of ``html``, each finding placed in the sources when possible."""
    problems = []
    for finding in check_html(html):
        if finding.kind == IMG_WITHOUT_ALT:
            place = locate_img_without_alt(sources, finding.value)
        else:
            place = locate_attribute(sources, finding.attribute, finding.value)
        if place is not None:
            problems.append(rendering.problem(finding.message, *place))
        else:
            problems.append(rendering.problem(finding.message, rendering.html_file,
                                              finding.line, in_rendered=True))
    return problems


def check_size(rendering: Rendering, html: str, limit: int = GMAIL_CLIP_BYTES) -> list[Problem]:
    """The HTML part over ``limit`` bytes (UTF-8), where Gmail clips it."""
    size = len(html.encode("utf-8"))
    if size <= limit:
        return []
    return [rendering.problem(
        f"HTML part is {size:,} bytes, over Gmail's clipping size of {limit:,} bytes "
        f"({limit // 1024} KB): Gmail hides the rest behind \"[Message clipped]\"",
        rendering.html_file)]


def check_subject(rendering: Rendering, subject: str, limit: int) -> list[Problem]:
    """A subject over ``limit`` characters (OUTBOX_TEMPLATE_MAX_SUBJECT)."""
    if len(subject) <= limit:
        return []
    return [rendering.problem(
        f'subject is {len(subject)} characters, over OUTBOX_TEMPLATE_MAX_SUBJECT ({limit}): '
        f'"{clean_line(subject, 200)}"', rendering.subject_file, 1)]


# -- translations ---------------------------------------------------------------------------

#: A message id as a catalog keys it: (msgctxt or None, msgid; the singular for a plural).
MessageKey = tuple[str | None, str]


class UsedMessage(NamedTuple):
    """A translatable string a template uses, and where."""

    key: MessageKey
    file: str
    line: int


def used_messages(env: Environment, sources: Iterable[tuple[str, str]]) -> list[UsedMessage]:
    """Every constant message id of ``_()``, ``gettext()``, ``ngettext()``, ``pgettext()``,
    ``npgettext()`` and ``{% trans %}`` in ``sources``, parsed by ``env`` (the app's, so its
    delimiters, extensions and ``trimmed`` policy apply)."""
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.ext import extract_from_ast

    used = []
    for name, source in sources:
        try:
            tree = env.parse(source, name=name)
        except TemplateSyntaxError:  # reported by the rendering itself
            continue
        for lineno, function, message in extract_from_ast(tree, babel_style=True):
            key = _message_key(function, message)
            if key is not None:
                used.append(UsedMessage(key, name, lineno))
    return used


def _message_key(function: str, message: Any) -> MessageKey | None:
    strings = message if isinstance(message, tuple) else (message,)
    if function in ("pgettext", "npgettext"):
        context, msgid = (strings + (None, None))[:2]
    else:
        context, msgid = None, strings[0] if strings else None
    if not isinstance(msgid, str) or not msgid:  # gettext(variable): nothing to look up
        return None
    return (context if isinstance(context, str) else None), msgid


class Catalog(NamedTuple):
    """The message keys a locale translates, and those its .po files mark fuzzy."""

    translated: frozenset[MessageKey]
    fuzzy: frozenset[MessageKey]


def catalog_of(translations: object) -> Catalog:
    """What a Flask-Babel ``Translations`` object translates (non-empty, every plural form).

    The compiled catalog (.mo) keeps no fuzzy flag: the fuzzy set comes from the
    ``.po`` next to each ``.mo`` the translations were loaded from, when there is one.
    """
    entries: Mapping[Any, str] = getattr(translations, "_catalog", None) or {}
    translated: set[MessageKey] = set()
    plurals: dict[MessageKey, bool] = {}
    for raw, text in entries.items():
        if isinstance(raw, tuple):
            key = _split_context(raw[0])
            plurals[key] = plurals.get(key, True) and bool(text)
        elif raw and text:
            translated.add(_split_context(raw))
    translated.update(key for key, complete in plurals.items() if complete)
    fuzzy: set[MessageKey] = set()
    for compiled in getattr(translations, "files", ()):
        po = Path(compiled).with_suffix(".po")
        if po.is_file():
            fuzzy.update(_fuzzy_in(po))
    return Catalog(frozenset(translated), frozenset(fuzzy))


def _split_context(raw: str) -> MessageKey:
    context, separator, msgid = raw.partition("\x04")
    return (context, msgid) if separator else (None, raw)


def _fuzzy_in(po: Path) -> set[MessageKey]:
    from babel.messages.pofile import read_po

    with po.open("rb") as file:
        catalog = read_po(file)
    return {(message.context, message.id if isinstance(message.id, str) else message.id[0])
            for message in catalog if message.id and message.fuzzy}


def untranslated(rendering: Rendering, used: Iterable[UsedMessage],
                 catalog: Catalog) -> list[Problem]:
    """A problem for each used message the catalog lacks, or has only fuzzy."""
    problems = []
    for message in used:
        context, msgid = message.key
        what = f'"{clean_line(msgid, 200)}"' + (f' (context "{context}")' if context else "")
        if message.key in catalog.fuzzy:
            problem = f"fuzzy translation of {what} in the {rendering.locale} catalog"
        elif message.key not in catalog.translated:
            problem = f"no {rendering.locale} translation of {what}"
        else:
            continue
        problems.append(rendering.problem(problem, message.file, message.line))
    return problems


# -- the whole check -------------------------------------------------------------------------


def select(templates: EmailTemplates, names: Sequence[str],
           locales: Sequence[str]) -> tuple[list[str], list[str | None]]:
    """The templates and locales to check: those given (checked), else every one.

    Raises :class:`SelectionError` for a name or locale the app does not have.
    """
    known = templates.names()
    for name in names:
        if name not in known:
            raise SelectionError("--template", f"no email template {name!r} in folder "
                                 f"{templates.folder!r}; the app has: {', '.join(known) or 'none'}")
    app_locales = templates.locales()
    chosen: list[str | None] = []
    for wanted in locales:
        match = next((locale for locale in app_locales
                      if _same_locale(locale, wanted)), None)
        if match is None:
            raise SelectionError("--locale", f"{wanted!r} is not one of the app's locales "
                                 f"({', '.join(app_locales) or 'none: Flask-Babel is not set up'})")
        chosen.append(match)
    return (list(dict.fromkeys(names)) or known,
            list(dict.fromkeys(chosen)) or list(app_locales) or [None])


def _same_locale(a: str, b: str) -> bool:
    return a.replace("-", "_").lower() == b.replace("-", "_").lower()


def check_templates(app: Flask, templates: EmailTemplates, *, names: Sequence[str],
                    locales: Sequence[str | None], max_subject: int) -> CheckReport:
    """Render ``names`` × ``locales`` × each template's previews and run every rule.

    Each rendering runs in its own ``app.test_request_context()`` (so ``url_for``
    works, and a relative URL it makes is then found by the link rule), with
    ``strict=True``. The same problem at the same place of the same email and
    locale is reported once, with the first preview that showed it.
    """
    report = CheckReport(emails=len(names), locales=len([lc for lc in locales if lc]))
    previews = templates.previews()
    report.problems.extend(_orphan_previews(previews, names, templates.names()))
    default = _source_locale(app, templates)
    catalogs: dict[str, Catalog] = {}
    messages: dict[tuple[str, str], list[UsedMessage]] = {}
    for name in names:
        # A template without a preview is rendered once, with {}.
        contexts: list[Preview | None] = [*previews.get(name, [])] or [None]
        for locale in locales:
            for preview in contexts:
                report.renders += 1
                rendering = _rendering(templates.folder, name, locale, preview)
                with app.test_request_context():
                    report.problems.extend(_check_one(
                        app, templates, rendering, preview, max_subject,
                        check_translations=locale is not None and locale != default,
                        catalogs=catalogs, messages=messages))
    report.problems = _first_preview_only(report.problems)
    return report


def _rendering(folder: str, name: str, locale: str | None, preview: Preview | None) -> Rendering:
    return Rendering(name, locale, None if preview is None else preview.name,
                     html_file=f"{folder}/{name}.html", subject_file=f"{folder}/{name}.subject.txt")


def _check_one(app: Flask, templates: EmailTemplates, rendering: Rendering,
               preview: Preview | None, max_subject: int, *, check_translations: bool,
               catalogs: dict[str, Catalog],
               messages: dict[tuple[str, str], list[UsedMessage]]) -> list[Problem]:
    context: Mapping[str, Any] = {}
    if preview is not None:
        try:
            context = preview.func()
        except Exception as exc:  # noqa: BLE001 - the app's code: reported, the check goes on
            return [rendering.problem(
                f"preview function {preview.func.__qualname__} raised {type(exc).__name__}: "
                f"{exc}", *_where_defined(preview.func))]
        if not isinstance(context, Mapping):
            return [rendering.problem(f"preview function {preview.func.__qualname__} returned "
                                      f"{type(context).__name__}, not a mapping (the context)",
                                      *_where_defined(preview.func))]
    try:
        rendered = templates.render(rendering.template, context, locale=rendering.locale,
                                    strict=True)
    except TemplateError as exc:
        return [rendering.problem(exc.problem, exc.file, exc.lineno)]
    mjml_file = rendering.html_file.removesuffix(".html") + ".mjml"
    if any(name == mjml_file for name, _source in rendered.sources):
        rendering = replace(rendering, html_file=mjml_file)
    problems = [*html_problems(rendering, rendered.html, rendered.sources),
                *check_size(rendering, rendered.html),
                *check_subject(rendering, rendered.subject, max_subject)]
    if check_translations and rendering.locale is not None:
        used = []
        for source in rendered.sources:
            if source not in messages:
                messages[source] = used_messages(app.jinja_env, [source])
            used.extend(messages[source])
        if rendering.locale not in catalogs:
            catalogs[rendering.locale] = _catalog_for(rendering.locale)
        problems.extend(untranslated(rendering, used, catalogs[rendering.locale]))
    return problems


def _source_locale(app: Flask, templates: EmailTemplates) -> str | None:
    """The locale the msgids are written in: Flask-Babel's default locale.

    Not ``templates.default_locale()``, the first of ``OUTBOX_TEMPLATE_LOCALES`` when
    that list leaves the default out: such a first locale still needs its translations.
    """
    babel = app.extensions.get("babel")
    if babel is None:
        return templates.default_locale()
    from babel import Locale

    return str(Locale.parse(babel.default_locale))


def _catalog_for(locale: str) -> Catalog:
    from flask_babel import force_locale, get_translations

    with force_locale(locale):
        return catalog_of(get_translations())


def _where_defined(func: Callable[..., Any]) -> tuple[str | None, int | None]:
    code = getattr(inspect.unwrap(func), "__code__", None)
    if code is None:
        return None, None
    path = code.co_filename
    try:
        path = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        pass
    return path, code.co_firstlineno


def _orphan_previews(previews: Mapping[str, Sequence[Preview]], names: Sequence[str],
                     known: Sequence[str]) -> list[Problem]:
    """Previews registered for a template that does not exist (a typo), when all are checked."""
    if list(names) != list(known):
        return []
    return [Problem(template, None, preview.name,
                    "preview registered for a template that does not exist",
                    *_where_defined(preview.func))
            for template, registered in previews.items() if template not in known
            for preview in registered]


def _first_preview_only(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[Any, ...]] = set()
    kept = []
    for problem in problems:
        key = (problem.template, problem.locale, problem.file, problem.line,
               problem.in_rendered, problem.message)
        if key not in seen:
            seen.add(key)
            kept.append(problem)
    return kept
