"""``python -m benchmarks templates`` runs, and compares like with like.

The benchmark's claim is "the extra cost of a templated send": it holds only if
``send()`` gets the very email ``send_template()`` stores, translated and
inlined as described. These tests run it at its smoke size and check the
comparison on the stored rows themselves.
"""

from __future__ import annotations

import email
import json
from collections.abc import Iterator
from email.message import Message as EmailMessage
from pathlib import Path

import pytest
import sqlalchemy as sa

from benchmarks import templates
from benchmarks.__main__ import main
from benchmarks.bench_app import RECIPIENT


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[templates.App]:
    translations = templates.compile_catalogs(tmp_path / "translations")
    app = templates.build(f"sqlite:///{tmp_path / 'bench.db'}", translations, create=True)
    yield app
    app.stop()


def _parts(mime: bytes) -> dict[str, str]:
    parsed: EmailMessage = email.message_from_bytes(mime)
    out = {"subject": str(parsed["Subject"])}
    for part in parsed.walk():
        if part.get_content_maintype() == "text":
            payload = part.get_payload(decode=True)
            assert isinstance(payload, bytes)
            out[part.get_content_type()] = payload.decode(part.get_content_charset() or "utf-8")
    return out


def test_the_scenario_runs_at_its_smoke_size_and_gives_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "templates.json"
    assert main(["templates", *templates.SMOKE, "--no-pg", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["scenarios"]["templates"]["figures"]
    for name in ("send_template µs", "send µs", "extra of a templated send (send_template - send) µs",
                 "extra, no text template µs", "Jinja render: HTML (layout, loop) µs",
                 "css-inline of the HTML µs", "locale switch (force_locale + catalog) µs",
                 "render(), cached: with text template µs", "render(), first in the app µs",
                 "render(), second µs", "goal met"):
        assert isinstance(figures[name], int | float), name
    assert figures["send_template µs"] > 0 and figures["render(), first in the app µs"] > 0


@pytest.mark.parametrize("name", [templates.WITH_TEXT, templates.HTML_ONLY])
@pytest.mark.parametrize("locale", templates.LOCALES)
def test_send_gets_the_email_send_template_stores(bench: templates.App, name: str,
                                                  locale: str) -> None:
    from flask_mail_outbox import Message

    with templates.in_request(bench):
        pre = templates.prerender(bench, name)
        ids = [bench.mail.send_template(name, recipients=[RECIPIENT],
                                        context=templates.CONTEXT, locale=locale),
               bench.mail.send(Message(pre.subject[locale], recipients=[RECIPIENT],
                                       html=pre.html[locale], body=pre.text[locale]))]
        bench.db.session.commit()
        mimes = [bench.db.session.execute(sa.text("SELECT mime FROM outbox_email WHERE id = :i"),
                                          {"i": i}).scalar_one() for i in ids]
        bench.db.session.remove()
    templated, sent = (_parts(bytes(m)) for m in mimes)
    assert templated == sent
    assert ("Lieferadresse" in templated["text/html"]) == (locale == "de")
    assert "<style" not in templated["text/html"]
    # Without a text template both carry the text send() makes from the HTML.
    assert "Notebook, dotted, A5, rust" in templated["text/plain"]


def test_the_benchmark_refuses_an_email_that_was_not_translated(tmp_path: Path) -> None:
    from babel.messages.catalog import Catalog
    from babel.messages.mofile import write_mo

    # A German catalog that translates nothing: the locale exists, the email stays English.
    mo = tmp_path / "empty" / "de" / "LC_MESSAGES" / "messages.mo"
    mo.parent.mkdir(parents=True)
    with mo.open("wb") as f:
        write_mo(f, Catalog(locale="de"))
    bench = templates.build(f"sqlite:///{tmp_path / 'bench.db'}", tmp_path / "empty", create=True)
    try:
        with templates.in_request(bench), pytest.raises(RuntimeError,
                                                        match="German catalog was not applied"):
            templates.prerender(bench, templates.WITH_TEXT)
    finally:
        bench.stop()
