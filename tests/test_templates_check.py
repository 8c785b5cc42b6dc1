"""``flask outbox templates check``: real templates, Flask-Babel with compiled catalogs.

Each test writes the clean set of templates_check_helpers (a layout, ``orders/shipped``
with a preview, ``welcome`` without one, a complete German catalog), breaks one thing,
and asserts the exact lines the command prints and its exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import Result
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from templates_check_helpers import (
    GERMAN,
    SHIPPED_CONTEXT,
    make_app,
    write_catalog,
    write_shop,
    write_templates,
)

from flask_mail_outbox import OutboxMail
from flask_mail_outbox._operator.template_check import (
    GMAIL_CLIP_BYTES,
    catalog_of,
    check_html,
)

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SHIPPED = 'orders/shipped [{}] (preview "default")'
CLEAN_SUMMARY = "2 emails × 2 locales checked (4 renderings): 0 problems\n"

MakeApp = Callable[..., Flask]


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    """The clean template set and catalog, in ``tmp_path``."""
    write_shop(tmp_path)
    return tmp_path


@pytest.fixture
def shop_app(shop: Path) -> Iterator[MakeApp]:
    """``shop_app(**config)``: the app over ``shop``; each is stopped at teardown."""
    made: list[Flask] = []

    def factory(**config: Any) -> Flask:
        app = make_app(shop, **config)
        made.append(app)
        return app

    yield factory
    for app in made:
        app.extensions["test_mail"].stop()


def check(app: Flask, *args: str) -> Result:
    return app.test_cli_runner().invoke(args=["outbox", "templates", "check", *args])


def replace_line(root: Path, name: str, number: int, text: str) -> None:
    """Line ``number`` (1-based) of template ``name`` becomes ``text``."""
    path = root / "templates" / name
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_clean_set_passes(shop_app: MakeApp) -> None:
    """Every email × locale × preview, alt="" and a default-length subject included."""
    result = check(shop_app())
    assert result.output == CLEAN_SUMMARY
    assert result.exit_code == 0


@pytest.mark.parametrize(("line", "text", "problem"), [
    (4, "<p>{{ order.tracking }}</p>",
     "'dict object' has no attribute 'tracking' (pass it in context=...)"),
    (8, '<p><a href="/returns">{{ _("Track your order") }}</a></p>',
     'relative URL in <a href>: "/returns"'),
], ids=["undefined-variable", "relative-link"])
def test_a_problem_written_in_the_html_is_printed_at_its_line_in_each_locale(
        shop: Path, shop_app: MakeApp, line: int, text: str, problem: str) -> None:
    replace_line(shop, "email/orders/shipped.html", line, text)
    result = check(shop_app(), "--template", "orders/shipped")
    assert result.output == (
        f"email/orders/shipped.html:{line}: {SHIPPED.format('en')}: {problem}\n"
        f"email/orders/shipped.html:{line}: {SHIPPED.format('de')}: {problem}\n"
        "1 email × 2 locales checked (2 renderings): 2 problems\n")
    assert result.exit_code == 1


def test_a_syntax_error_in_the_layout_is_a_problem_of_every_email(
        shop: Path, shop_app: MakeApp) -> None:
    replace_line(shop, "email/_layout.html", 5, "{% block body %}{% endblock %}{% if %}")
    result = check(shop_app(), "--locale", "en")
    lines = result.output.splitlines()
    problem = "syntax error: Expected an expression, got 'end of statement block'"
    assert lines[:-1] == [
        f"email/_layout.html:5: {SHIPPED.format('en')}: {problem}",
        f"email/_layout.html:5: welcome [en] (no preview, context {{}}): {problem}"]
    assert result.exit_code == 1


def test_a_missing_translation_is_reported_where_the_string_is_used(
        shop: Path, shop_app: MakeApp) -> None:
    """In the non-default locale only; a layout's string once for each email using it."""
    replace_line(shop, "email/orders/shipped.html", 8, '<p>{{ _("Free returns") }}</p>')
    write_catalog(shop, "de", {k: v for k, v in GERMAN.items() if k != "Visit our shop"})
    result = check(shop_app())
    assert result.output == (
        f'email/_layout.html:6: {SHIPPED.format("de")}: no de translation of '
        '"Visit our shop"\n'
        f'email/orders/shipped.html:8: {SHIPPED.format("de")}: no de translation of '
        '"Free returns"\n'
        'email/_layout.html:6: welcome [de] (no preview, context {}): no de translation of '
        '"Visit our shop"\n'
        "2 emails × 2 locales checked (4 renderings): 3 problems\n")
    assert result.exit_code == 1


def test_translations_are_checked_in_every_locale_but_babels_default(
        shop: Path, shop_app: MakeApp) -> None:
    """OUTBOX_TEMPLATE_LOCALES without the default (en): its first locale is checked too."""
    write_catalog(shop, "de", {k: v for k, v in GERMAN.items() if k != "Welcome"})
    write_catalog(shop, "fr", GERMAN)
    result = check(shop_app(OUTBOX_TEMPLATE_LOCALES=["de", "fr"]), "--template", "welcome")
    assert result.output == (
        'email/welcome.subject.txt:1: welcome [de] (no preview, context {}): no de '
        'translation of "Welcome"\n'
        "1 email × 2 locales checked (2 renderings): 1 problem\n")
    assert result.exit_code == 1


@pytest.mark.parametrize("use_fuzzy", [True, False], ids=["compiled-in", "left-out"])
def test_a_fuzzy_translation_is_a_missing_one(shop: Path, shop_app: MakeApp,
                                              use_fuzzy: bool) -> None:
    """Left out of the .mo (pybabel's default) or compiled in (``--use-fuzzy``): the .po
    next to the .mo says why it does not count."""
    write_catalog(shop, "de", GERMAN, fuzzy=frozenset({"Welcome"}), use_fuzzy=use_fuzzy)
    result = check(shop_app(), "--template", "welcome")
    assert result.output == (
        "email/welcome.subject.txt:1: welcome [de] (no preview, context {}): fuzzy "
        'translation of "Welcome" in the de catalog\n'
        "1 email × 2 locales checked (2 renderings): 1 problem\n")
    assert result.exit_code == 1


def test_a_relative_url_for_is_reported_at_its_line_in_the_rendered_html(
        shop: Path, shop_app: MakeApp) -> None:
    """url_for without _external: not in the sources literally, so the rendered line."""
    replace_line(shop, "email/orders/shipped.html", 7,
                 "<p><a href=\"{{ url_for('order', number=order.number) }}\">"
                 "{{ _('Track your order') }}</a></p>")
    app = shop_app()
    with app.test_request_context():
        html = app.extensions["test_mail"].templates().render(
            "orders/shipped", SHIPPED_CONTEXT, locale="en", strict=True).html
    [line] = [number for number, text in enumerate(html.splitlines(), 1)
              if 'href="/orders/1042"' in text]
    result = check(app, "--template", "orders/shipped", "--locale", "en")
    assert result.output == (
        f'<rendered email/orders/shipped.html>:{line}: {SHIPPED.format("en")}: relative URL '
        'in <a href>: "/orders/1042"\n'
        "1 email × 1 locale checked (1 rendering): 1 problem\n")
    assert result.exit_code == 1


def test_an_img_without_alt_is_reported_where_written(shop: Path, shop_app: MakeApp) -> None:
    """The layout's: once per email and locale, with the first preview that showed it.
    alt="" (decorative) passes."""
    replace_line(shop, "email/_layout.html", 7,
                 '<img src="https://shop.example.com/logo.png">')
    app = shop_app()
    many = {**SHIPPED_CONTEXT, "order": {"number": 7, "items": ["Tea"] * 10}}
    app.extensions["test_mail"].preview("orders/shipped", name="many items")(lambda: many)
    result = check(app, "--locale", "de")
    assert result.output == (
        f"email/_layout.html:7: {SHIPPED.format('de')}: <img> without alt\n"
        "email/_layout.html:7: welcome [de] (no preview, context {}): <img> without alt\n"
        "2 emails × 1 locale checked (3 renderings): 2 problems\n")
    assert result.exit_code == 1


def test_an_img_whose_src_is_computed_is_found_by_its_tag(shop: Path,
                                                         shop_app: MakeApp) -> None:
    """Its src is not in the sources: the closure's only <img> without alt is the one."""
    replace_line(shop, "email/orders/shipped.html", 8,
                 "<img src=\"{{ url_for('home', _external=True) }}divider.png\">")
    result = check(shop_app(), "--template", "orders/shipped", "--locale", "en")
    assert result.output == (
        f"email/orders/shipped.html:8: {SHIPPED.format('en')}: <img> without alt\n"
        "1 email × 1 locale checked (1 rendering): 1 problem\n")
    assert result.exit_code == 1


def test_an_mjml_template_is_checked_after_compilation(shop: Path,
                                                       shop_app: MakeApp) -> None:
    """MRML writes the <img> of an <mj-image>: both problems are placed in the .mjml."""
    write_templates(shop, {
        "email/promo.subject.txt": "Spring sale\n",
        "email/promo.mjml": "<mjml><mj-body><mj-section><mj-column>\n"
                            '<mj-image src="https://shop.example.com/sale.png"></mj-image>\n'
                            '<mj-button href="/sale">Shop now</mj-button>\n'
                            "</mj-column></mj-section></mj-body></mjml>\n"})
    result = check(shop_app(), "--template", "promo", "--locale", "en")
    assert result.output == (
        "email/promo.mjml:2: promo [en] (no preview, context {}): <img> without alt\n"
        'email/promo.mjml:3: promo [en] (no preview, context {}): relative URL in <a href>: '
        '"/sale"\n'
        "1 email × 1 locale checked (1 rendering): 2 problems\n")
    assert result.exit_code == 1


def test_an_html_part_over_gmails_clip_size_counts_bytes(shop: Path,
                                                           shop_app: MakeApp) -> None:
    """60,000 "é" are fewer characters than 102 KB but 120,000 UTF-8 bytes; 45,000 fit."""
    write_templates(shop, {"email/big.subject.txt": "Big\n",
                           "email/big.html": "<p>{{ filler }}</p>\n"})
    app = shop_app()
    mail: OutboxMail = app.extensions["test_mail"]
    mail.preview("big", name="fits")(lambda: {"filler": "é" * 45_000})
    mail.preview("big", name="clipped")(lambda: {"filler": "é" * 60_000})
    with app.test_request_context():
        html = mail.templates().render("big", {"filler": "é" * 60_000}, strict=True).html
    size = len(html.encode("utf-8"))
    assert len(html) < GMAIL_CLIP_BYTES < size
    result = check(app, "--template", "big", "--locale", "en")
    assert result.output == (
        f'email/big.html: big [en] (preview "clipped"): HTML part is {size:,} bytes, over '
        "Gmail's clipping size of 104,448 bytes (102 KB): Gmail hides the rest behind "
        '"[Message clipped]"\n'
        "1 email × 1 locale checked (2 renderings): 1 problem\n")
    assert result.exit_code == 1


def test_a_subject_over_the_configured_length(shop_app: MakeApp) -> None:
    result = check(shop_app(OUTBOX_TEMPLATE_MAX_SUBJECT=22), "--template", "orders/shipped")
    assert result.output == (
        f"email/orders/shipped.subject.txt:1: {SHIPPED.format('de')}: subject is 29 "
        'characters, over OUTBOX_TEMPLATE_MAX_SUBJECT (22): "Bestellung 1042 ist unterwegs"\n'
        "1 email × 2 locales checked (2 renderings): 1 problem\n")
    assert result.exit_code == 1


def test_a_preview_that_raises_or_returns_no_mapping_is_reported_at_its_function(
        shop_app: MakeApp) -> None:
    app = shop_app()
    mail: OutboxMail = app.extensions["test_mail"]

    @mail.preview("welcome", name="broken")
    def broken() -> dict[str, Any]:
        raise KeyError("customer")

    @mail.preview("welcome", name="listed")
    def listed() -> Any:
        return [("name", "Ada")]

    here = os.path.relpath(__file__)
    prefix = "test_a_preview_that_raises_or_returns_no_mapping_is_reported_at_its_function"
    result = check(app, "--template", "welcome", "--locale", "en")
    assert result.output == (
        f'{here}:{broken.__code__.co_firstlineno}: welcome [en] (preview "broken"): preview '
        f"function {prefix}.<locals>.broken raised KeyError: 'customer'\n"
        f'{here}:{listed.__code__.co_firstlineno}: welcome [en] (preview "listed"): preview '
        f"function {prefix}.<locals>.listed returned list, not a mapping (the context)\n"
        "1 email × 1 locale checked (2 renderings): 2 problems\n")
    assert result.exit_code == 1


def test_a_preview_of_no_template_is_a_problem(shop_app: MakeApp) -> None:
    app = shop_app()
    mail: OutboxMail = app.extensions["test_mail"]

    def shipped() -> dict[str, Any]:
        return {}

    mail.preview("orders/shiped")(shipped)
    result = check(app)
    assert result.output.splitlines()[0] == (
        f"{os.path.relpath(__file__)}:{shipped.__code__.co_firstlineno}: orders/shiped "
        '(preview "default"): preview registered for a template that does not exist')
    assert result.exit_code == 1


def test_template_and_locale_options_narrow_the_check(shop_app: MakeApp) -> None:
    result = check(shop_app(), "--template", "welcome", "--locale", "DE",
                   "--template", "welcome")
    assert result.output == "1 email × 1 locale checked (1 rendering): 0 problems\n"
    assert result.exit_code == 0


@pytest.mark.parametrize(("args", "says"), [
    (["--template", "orders/shiped"],
     ("Invalid value for --template: no email template 'orders/shiped' in folder 'email'; "
      "the app has: orders/shipped, welcome")),
    (["--locale", "fr"],
     "Invalid value for --locale: 'fr' is not one of the app's locales (en, de)"),
    (["--bogus"], "No such option '--bogus'"),
], ids=["template", "locale", "option"])
def test_a_usage_error_exits_2(shop_app: MakeApp, args: list[str], says: str) -> None:
    result = check(shop_app(), *args)
    assert says in " ".join(result.output.split())
    assert result.exit_code == 2


def test_an_app_without_templates_fails(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    try:
        result = check(app)
    finally:
        app.extensions["test_mail"].stop()
    assert "no email templates in the folder 'email'" in result.output
    assert result.exit_code == 1


def test_locales_that_cannot_be_found_are_an_error(tmp_path: Path) -> None:
    """OUTBOX_TEMPLATE_LOCALES without Flask-Babel: said, not a traceback."""
    write_templates(tmp_path, {"email/a.subject.txt": "A\n", "email/a.html": "<p>A</p>\n"})
    app = Flask("no_babel", root_path=str(tmp_path))
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'outbox.db'}",
                      OUTBOX_RUN_SCHEDULER=False, OUTBOX_TEMPLATE_LOCALES=["de"])
    SQLAlchemy(app)
    mail = OutboxMail(app)
    try:
        result = check(app)
    finally:
        mail.stop()
    assert result.output == (
        "Error: OUTBOX_TEMPLATE_LOCALES is set, but the app has no Flask-Babel to translate "
        "with: set it up (flask_babel.Babel(app), the `i18n` extra)\n")
    assert result.exit_code == 1


def _flask_check(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{REPO}", "CHECK_ROOT": str(root)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "flask"),
         "--app", "templates_check_helpers:create_app",
         "outbox", "templates", "check", *args],
        env=env, cwd=str(root), capture_output=True, text=True, timeout=120, check=False)


def test_the_real_command_exits_0_1_and_2(shop: Path) -> None:
    """What CI sees: the exit status of ``flask --app ... outbox templates check``."""
    clean = _flask_check(shop)
    assert (clean.returncode, clean.stdout, clean.stderr) == (0, CLEAN_SUMMARY, "")
    assert _flask_check(shop, "--locale", "xx").returncode == 2
    replace_line(shop, "email/_layout.html", 7, '<img src="https://shop.example.com/logo.png">')
    broken = _flask_check(shop, "--template", "welcome", "--locale", "en")
    assert broken.stdout == (
        "email/_layout.html:7: welcome [en] (no preview, context {}): <img> without alt\n"
        "1 email × 1 locale checked (1 rendering): 1 problem\n")
    assert broken.returncode == 1


# -- the rules as functions ------------------------------------------------------------------


@pytest.mark.parametrize(("url", "relative"), [
    ("https://shop.example.com/a", False), ("http://x", False), ("mailto:a@example.com", False),
    ("tel:+4930123", False), ("cid:logo", False), ("data:image/png;base64,AAAA", False),
    ("#top", False), (" https://padded.example.com ", False),
    ("/orders/7", True), ("orders/7", True), ("//cdn.example.com/a.png", True), ("", True),
    ("?page=2", True),
])
def test_which_urls_are_relative(url: str, relative: bool) -> None:
    findings = check_html(f'<a href="{url}">x</a><img alt="" src="{url}">')
    assert [(f.line, f.attribute) for f in findings] == (
        [(1, "href"), (1, "src")] if relative else [])


def test_an_img_without_alt_but_not_one_with_empty_alt() -> None:
    findings = check_html('<p>\n<img src="https://x/a.png" alt="">\n<img src="https://x/b.png">'
                          '\n<IMG SRC="https://x/c.png" ALT="c"></p>')
    assert [(f.line, f.kind, f.value) for f in findings] == [
        (3, "<img> without alt", "https://x/b.png")]


def test_catalog_of_needs_every_plural_form_and_splits_contexts() -> None:
    class Compiled:
        files: ClassVar[list[str]] = []
        _catalog: ClassVar[dict[Any, str]] = {"": "Project-Id-Version: x", "Hello": "Hallo", "Empty": "",
                    ("%(n)s item", 0): "%(n)s Artikel", ("%(n)s item", 1): "%(n)s Artikel",
                    ("%(n)s box", 0): "%(n)s Kiste", ("%(n)s box", 1): "",
                    "menu\x04Open": "Öffnen"}

    catalog = catalog_of(Compiled())
    assert catalog.translated == {(None, "Hello"), (None, "%(n)s item"), ("menu", "Open")}
    assert catalog.fuzzy == frozenset()
