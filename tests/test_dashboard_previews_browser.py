"""The dashboard's previews in a real browser: headless Chromium, driven by Playwright.

An app with real template files (English and German, the German catalog compiled
from a .po file) is served on 127.0.0.1 by a werkzeug server thread, delivering
to the test SMTP server. The operator opens the previews from the dashboard's
navigation, opens an email's preview and sees both locales side by side: the
html in sandboxed frames, rendered with its inlined styles; the narrow/wide
switch (radio buttons and CSS, no script) changes the frames' width. Then
"Send this to me": the email is delivered and its page says which template it
came from. Nothing runs a script, nothing loads from elsewhere.

The screenshot goes to the test's tmp_path, and to ``$OUTBOX_DASHBOARD_SCREENSHOTS``
when set (how docs/dashboard-previews.png is made, as test_dashboard_browser.py
makes the other docs/dashboard-*.png).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import close_app, poll, rows
from flask import Flask
from playwright.sync_api import Dialog, Page, sync_playwright
from previews_helpers import PREFIX, SUBJECTS, TITLE_RGB, make_preview_app
from smtpserver import FaultSMTPServer
from test_dashboard_browser import chromium
from werkzeug.serving import make_server

SCREENSHOT = "dashboard-previews.png"


@pytest.fixture
def served(db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path) -> Iterator[
        tuple[Flask, str]]:
    """The previews app behind a real HTTP server; (app, base URL)."""
    app, _ = make_preview_app(db_url, tmp_path / "app", MAIL_SERVER=smtp_server.host,
                              MAIL_PORT=smtp_server.port)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="previews-http", daemon=True)
    thread.start()
    try:
        yield app, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()
        close_app(app, timeout=5)


def frame_widths(page: Page) -> list[int]:
    """The width each preview frame gives its email (the viewport its CSS sees)."""
    return [int(frame.content_frame.locator("body").evaluate("b => window.innerWidth"))
            for frame in page.locator("iframe.preview-html").all()]


def test_operator_previews_an_email_in_both_locales_narrow_and_wide_and_sends_it(
        served: tuple[Flask, str], smtp_server: FaultSMTPServer, tmp_path: Path) -> None:
    executable = chromium()
    app, base = served
    finished: list[str] = []
    errors: list[str] = []
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(15_000)
            page.on("requestfinished", lambda request: finished.append(request.url))
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("dialog", on_dialog)

            # From the dashboard's navigation to the list, and into one preview.
            page.goto(f"{base}{PREFIX}/")
            page.click("header.top nav a:has-text('Previews')")
            page.wait_for_url(f"{base}{PREFIX}/previews")
            page.click("td.preview-links a:has-text('one item')")
            page.wait_for_url(lambda url: "preview=one" in url)

            # Both locales side by side, each html in its sandboxed frame, styles inlined.
            locales = page.locator("section.locale")
            assert locales.count() == 2
            for locale, title in (("en", "Order 1042"), ("de", "Bestellung 1042")):
                column = page.locator(f"section.locale[data-locale={locale}]")
                assert column.locator(".preview-subject").inner_text() == SUBJECTS[locale]
                frame = page.frame_locator(f"section.locale[data-locale={locale}] iframe")
                assert frame.locator("#title").inner_text() == title
                # The layout's <style> was inlined, and the preview page lets it apply.
                assert frame.locator("#title").evaluate(
                    "h1 => getComputedStyle(h1).color") == TITLE_RGB
            # Side by side: one row, English left of German.
            boxes = [box for box in (column.bounding_box() for column in locales.all()) if box]
            assert len(boxes) == 2 and boxes[0]["y"] == boxes[1]["y"]
            assert boxes[0]["x"] < boxes[1]["x"]

            # Wide by default; narrow and back, by the radio buttons (CSS only): the
            # width the email's own CSS sees (its media queries apply).
            assert frame_widths(page) == [800, 800]
            page.click("label[for=width-narrow]")
            assert frame_widths(page) == [375, 375]
            for element in page.locator("iframe").all():
                element.scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / SCREENSHOT), full_page=True)
            page.click("label[for=width-wide]")
            assert frame_widths(page) == [800, 800]
            assert page.locator("script").count() == 0

            # Send this to me: delivered through the outbox, in German.
            page.fill("form.send-preview input[name=address]", "dana@example.com")
            page.select_option("form.send-preview select[name=locale]", "de")
            page.click("form.send-preview button[type=submit]")
            page.wait_for_url(lambda url: "notice=preview_sent" in url)
            assert "Preview queued" in page.inner_text("p.notice")
            assert page.inner_text("#template").startswith("orders/shipped (de)")
            assert smtp_server.wait_for(1)
            assert smtp_server.messages[0].parsed["Subject"] == SUBJECTS["de"]
            assert poll(lambda: [r["status"] for r in rows(app)],
                        lambda s: s == ["sent"], timeout=10) == ["sent"]
        finally:
            browser.close()

    assert errors == [] and dialogs == []
    assert finished and {urlsplit(url).hostname for url in finished} == {"127.0.0.1"}
    assert (tmp_path / SCREENSHOT).stat().st_size > 10_000
    copy_to = os.environ.get("OUTBOX_DASHBOARD_SCREENSHOTS")
    if copy_to:
        shutil.copy(tmp_path / SCREENSHOT, Path(copy_to) / SCREENSHOT)
