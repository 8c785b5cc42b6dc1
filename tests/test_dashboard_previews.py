"""The dashboard's previews section through Flask's test client (issue 38, item 4).

Real parts: template files in a tmp dir, a German catalog written as .po and
compiled with Babel, Flask-Babel choosing it, the dashboard's own gate and CSRF
token, the test SMTP server. The pages only render (SQLite); what writes ("send
this to me", and the refusals that must write nothing) runs on SQLite and
PostgreSQL.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import close_app, hand_ticked_worker, rows, wait_rows
from dashboard_helpers import Gate
from flask import Flask
from flask.testing import FlaskClient
from previews_helpers import (
    MANY_ITEMS,
    PREFIX,
    SUBJECTS,
    csrf_token_of,
    make_preview_app,
)
from smtpserver import FaultSMTPServer

from flask_mail_outbox import OutboxMail
from flask_mail_outbox._operator.dashboard import (
    CONTENT_SECURITY_POLICY,
    PREVIEW_CONTENT_SECURITY_POLICY,
)

PAGE = f"{PREFIX}/previews"
SEND = f"{PREFIX}/previews/send"


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def page_app(tmp_path: Path, gate: Gate) -> Iterator[Flask]:
    """The previews app on a SQLite file, for the tests that only read pages."""
    app, _ = make_preview_app(f"sqlite:///{tmp_path / 'pages.db'}", tmp_path, authorize=gate)
    yield app
    close_app(app, timeout=5)


@pytest.fixture
def sending_app(db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path,
                gate: Gate) -> Iterator[tuple[Flask, OutboxMail]]:
    """The previews app on each backend, delivering to the test SMTP server."""
    app, mail = make_preview_app(db_url, tmp_path, authorize=gate,
                                 MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    yield app, mail
    close_app(app, timeout=5)


def columns(page: str) -> dict[str, str]:
    """Each locale's column of a preview page (its markup), by locale, in page order."""
    found = re.findall(r'<section class="locale" data-locale="([^"]*)">(.*?)</section>', page,
                       flags=re.DOTALL)
    return dict(found)


def subject_of(column: str) -> str:
    match = re.search(r'<p class="subject-line preview-subject">(.*?)</p>', column, flags=re.DOTALL)
    assert match, column
    return html.unescape(match.group(1))


def srcdoc_of(column: str) -> str:
    (iframe,) = re.findall(r"<iframe [^>]*>", column)
    assert re.search(r"\ssandbox\s", iframe), iframe  # sandboxed, with no allow-* at all
    match = re.search(r'srcdoc="([^"]*)"', iframe)
    assert match, iframe
    return html.unescape(match.group(1))


def pres_of(column: str) -> list[str]:
    return [html.unescape(text) for text in re.findall(r"<pre [^>]*>(.*?)</pre>", column,
                                                       flags=re.DOTALL)]


def preview_url(template: str, preview: str | None = None) -> str:
    client_args = {"template": template} if preview is None else {
        "template": template, "preview": preview}
    return PAGE + "?" + "&".join(f"{k}={v.replace(' ', '+')}" for k, v in client_args.items())


def token(client: FlaskClient) -> str:
    return csrf_token_of(client.get(preview_url("orders/shipped", "one item")).get_data(
        as_text=True))


# -- pages ------------------------------------------------------------------------------


def test_the_list_names_every_template_with_its_previews_from_the_navigation(
        page_app: Flask) -> None:
    client = page_app.test_client()
    overview = client.get(f"{PREFIX}/").get_data(as_text=True)
    assert f'<a href="{PAGE}"' in overview  # in the dashboard's navigation
    response = client.get(PAGE)
    assert response.status_code == 200
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    page = response.get_data(as_text=True)
    links = [(parse_qs(urlsplit(html.unescape(href)).query))
             for href in re.findall(r'href="([^"]*previews\?[^"]*)"', page)]
    assert [(q["template"][0], q.get("preview", [None])[0]) for q in links] == [
        ("broken", None),
        ("ghost", "default"),
        ("orders/shipped", "one item"), ("orders/shipped", "many items"),
        ("orders/shipped", "no such order"),
        ("receipt", None),
        ("welcome", None),
    ]
    assert "_layout" not in page  # a layout is not an email
    assert "(no such template)" in page  # ghost: a preview without files


def test_a_preview_shows_each_locale_side_by_side_translated_and_inlined(
        page_app: Flask) -> None:
    client = page_app.test_client()
    response = client.get(preview_url("orders/shipped", "one item"))
    assert response.status_code == 200
    # The email's inlined styles apply in the frame; still no script, image or fetch.
    assert response.headers["Content-Security-Policy"] == PREVIEW_CONTENT_SECURITY_POLICY
    page = response.get_data(as_text=True)
    shown = columns(page)
    assert list(shown) == ["en", "de"]  # the default locale first
    for locale, column in shown.items():
        assert subject_of(column) == SUBJECTS[locale]
        srcdoc = srcdoc_of(column)
        title = "Order 1042" if locale == "en" else "Bestellung 1042"
        assert re.search(r'<h1 [^>]*style="[^"]*color: ?#c0392b', srcdoc), srcdoc  # inlined
        assert title in srcdoc and "<li>Blue mug</li>" in srcdoc
        text, mime = pres_of(column)
        assert text.startswith("Hello Dana," if locale == "en" else "Hallo Dana,")
        assert "- Blue mug" in text
        assert f"Subject: {SUBJECTS[locale]}" in mime
        assert "To: recipient@example.com" in mime
        assert "multipart/alternative" in mime
    # The email's html is in the srcdoc attributes only, never the page's own markup.
    assert 'id="title"' not in page and 'id="greeting"' not in page
    assert "<li>" not in page
    # The other previews of the email are a click away, and the form to send this one.
    assert "many+items" in page or "many%20items" in page
    form = re.search(r'<form method="post" action="/outbox/previews/send".*?</form>', page,
                     flags=re.DOTALL)
    assert form and 'name="csrf_token"' in form.group(0)
    assert '<option value="de"' in form.group(0)


def test_each_preview_gives_its_own_context(page_app: Flask) -> None:
    page = page_app.test_client().get(preview_url("orders/shipped", "many items")).get_data(
        as_text=True)
    for column in columns(page).values():
        assert all(f"<li>{item}</li>" in srcdoc_of(column) for item in MANY_ITEMS)


def test_a_template_without_a_preview_renders_with_an_empty_context(page_app: Flask) -> None:
    response = page_app.test_client().get(preview_url("welcome"))
    assert response.status_code == 200
    shown = columns(response.get_data(as_text=True))
    assert {locale: subject_of(column) for locale, column in shown.items()} == {
        "en": "Welcome", "de": "Willkommen"}
    assert "Willkommen, friend!" in srcdoc_of(shown["de"])
    # No .txt: the text part is the one made from the html, and the page says so.
    assert "made from the HTML" in shown["de"]
    assert pres_of(shown["de"])[0].strip() == "Willkommen, friend!"


def test_a_render_error_is_shown_on_the_page_not_a_500(page_app: Flask) -> None:
    response = page_app.test_client().get(preview_url("broken"))
    assert response.status_code == 200
    shown = columns(response.get_data(as_text=True))
    assert list(shown) == ["en", "de"]
    for locale, column in shown.items():
        assert "<iframe" not in column
        error = html.unescape(re.sub(r"<[^>]+>", " ", column))
        assert "template 'broken'" in error and f"({locale})" in error
        assert "email/broken.html line 3" in error
        assert "undefined" in error


def test_a_preview_function_that_raises_is_shown_on_the_page(page_app: Flask) -> None:
    response = page_app.test_client().get(preview_url("orders/shipped", "no such order"))
    assert response.status_code == 200
    page = html.unescape(response.get_data(as_text=True))
    assert "raised LookupError: order 9999 is not in the fixtures" in page
    assert "<iframe" not in page


def test_locales_set_without_flask_babel_is_said_on_the_pages_not_a_500(
        tmp_path: Path) -> None:
    app, _ = make_preview_app(f"sqlite:///{tmp_path / 'locales.db'}", tmp_path, babel=False,
                              OUTBOX_TEMPLATE_LOCALES=["en", "de"])
    try:
        client = app.test_client()
        for url in (PAGE, preview_url("receipt")):
            response = client.get(url)
            assert response.status_code == 200, url
            assert "OUTBOX_TEMPLATE_LOCALES is set, but the app has no Flask-Babel" in \
                html.unescape(response.get_data(as_text=True)), url
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize(("url", "status"), [
    (preview_url("nope"), 404),
    (preview_url("orders/shipped", "nope"), 404),
    (preview_url("orders/shipped") + "%00", 400),
    (preview_url("x" * 300), 400),
    (preview_url("_layout"), 404),
])
def test_hand_edited_links_answer_400_or_404(page_app: Flask, url: str, status: int) -> None:
    response = page_app.test_client().get(url)
    assert response.status_code == status
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY


# -- behind the gate, and the send action (both backends) ---------------------------------


def test_the_section_is_behind_authorize_and_writes_nothing_without_it(
        sending_app: tuple[Flask, OutboxMail], gate: Gate,
        smtp_server: FaultSMTPServer) -> None:
    app, _ = sending_app
    client = app.test_client()
    csrf = token(client)
    gate.open = False
    for url in (PAGE, preview_url("orders/shipped", "one item"), preview_url("welcome")):
        assert client.get(url).status_code == 403, url
    response = client.post(SEND, data={
        "csrf_token": csrf, "template": "orders/shipped", "preview": "one item",
        "locale": "de", "address": "dana@example.com"})
    assert response.status_code == 403
    assert rows(app) == [] and smtp_server.messages == []


def test_send_without_the_sessions_csrf_token_is_refused_and_writes_nothing(
        sending_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer) -> None:
    app, _ = sending_app
    client = app.test_client()
    token(client)
    foreign = token(app.test_client())
    form = {"template": "orders/shipped", "preview": "one item", "locale": "de",
            "address": "dana@example.com"}
    for csrf in ({}, {"csrf_token": ""}, {"csrf_token": foreign}):
        response = client.post(SEND, data={**form, **csrf})
        assert response.status_code == 400, csrf
        assert "CSRF" in response.get_data(as_text=True)
    assert rows(app) == [] and smtp_server.messages == []


def test_send_this_to_me_queues_the_templated_email_through_the_outbox(
        db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path) -> None:
    # Durable, with the dispatcher ticked by hand: the row is seen queued, then delivered.
    app, _ = make_preview_app(db_url, tmp_path, MAIL_SERVER=smtp_server.host,
                              MAIL_PORT=smtp_server.port, OUTBOX_DURABLE=True,
                              OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False)
    try:
        check_send_this_to_me(app, smtp_server)
    finally:
        close_app(app, timeout=5)


def check_send_this_to_me(app: Flask, smtp_server: FaultSMTPServer) -> None:
    worker = hand_ticked_worker(app)
    client = app.test_client()
    response = client.post(SEND, data={
        "csrf_token": token(client), "template": "orders/shipped", "preview": "many items",
        "locale": "de", "address": "  dana@example.com "})
    assert response.status_code == 303
    (row,) = rows(app)
    assert response.headers["Location"] == f"{PREFIX}/emails/{row['id']}?notice=preview_sent"
    assert row["template_name"] == "orders/shipped"
    assert row["template_locale"] == "de"
    assert re.fullmatch(r"[0-9a-f]{64}", row["template_hash"])
    assert row["subject"] == SUBJECTS["de"]
    assert row["status"] == "queued" and smtp_server.messages == []

    # Delivered by the outbox to the SMTP server, as any email.
    worker.tick()
    assert smtp_server.wait_for(1)
    (received,) = smtp_server.messages
    assert received.parsed["Subject"] == SUBJECTS["de"]
    assert received.parsed["To"] == "dana@example.com"
    text = received.parsed.get_body(preferencelist=("plain",))
    assert text is not None and "- Item 12" in text.get_content()
    assert wait_rows(app, lambda rs: rs[0]["status"] == "sent", timeout=10)[0]["status"] == \
        "sent"

    # The email's page: the notice, and which template it came from.
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert "Preview queued through the outbox" in page
    assert "<code>orders/shipped</code></a> (de)" in page
    assert f"version {row['template_hash'][:12]}" in page


def test_without_flask_babel_one_column_without_a_locale_and_it_sends(
        db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path) -> None:
    app, _ = make_preview_app(db_url, tmp_path, babel=False, MAIL_SERVER=smtp_server.host,
                              MAIL_PORT=smtp_server.port)
    try:
        client = app.test_client()
        page = client.get(preview_url("receipt")).get_data(as_text=True)
        (column,) = columns(page).values()
        assert list(columns(page)) == [""] and "no locale" in column
        assert subject_of(column) == "Receipt 7"
        assert '<p id="receipt">Thank you.</p>' in srcdoc_of(column)
        assert '<input type="hidden" name="locale" value="">' in page
        response = client.post(SEND, data={
            "csrf_token": csrf_token_of(page), "template": "receipt", "preview": "",
            "locale": "", "address": "dana@example.com"})
        assert response.status_code == 303
        (row,) = rows(app)
        assert (row["template_name"], row["template_locale"]) == ("receipt", None)
        assert smtp_server.wait_for(1)
        assert smtp_server.messages[0].parsed["Subject"] == "Receipt 7"
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize(("address", "locale", "says"), [
    ("dana.example.com", "de", "recipients[0]: 'dana.example.com' is not a valid email address"),
    ("", "de", "recipients"),
    ("dana@example.com", "fr", "(fr)"),
])
def test_a_refused_send_shows_the_form_again_and_writes_nothing(
        sending_app: tuple[Flask, OutboxMail], smtp_server: FaultSMTPServer,
        address: str, locale: str, says: str) -> None:
    app, _ = sending_app
    client = app.test_client()
    response = client.post(SEND, data={
        "csrf_token": token(client), "template": "orders/shipped", "preview": "one item",
        "locale": locale, "address": address})
    assert response.status_code == 400
    page = html.unescape(response.get_data(as_text=True))
    error = re.search(r'<p class="problem" role="alert" id="send-error">(.*?)</p>', page,
                      flags=re.DOTALL)
    assert error and error.group(1).startswith("Not sent: ") and says in error.group(1), page
    assert f'name="address" value="{address}"' in page  # what was typed, kept
    assert len(columns(page)) == 2  # the preview is shown again
    assert rows(app) == [] and smtp_server.messages == []


def test_send_for_an_unknown_template_or_preview_answers_404_and_writes_nothing(
        sending_app: tuple[Flask, OutboxMail]) -> None:
    app, _ = sending_app
    client = app.test_client()
    csrf = token(client)
    for template, preview in (("nope", ""), ("orders/shipped", "nope"), ("_layout", "")):
        response = client.post(SEND, data={
            "csrf_token": csrf, "template": template, "preview": preview, "locale": "de",
            "address": "dana@example.com"})
        assert response.status_code == 404, (template, preview)
    assert rows(app) == []
