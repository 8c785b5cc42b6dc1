"""The development inbox in a real browser: headless Chromium, driven by Playwright.

The example app as ``scripts/run-example`` runs it (no SMTP server named: the
``mailbox`` transport) is served on 127.0.0.1 by a werkzeug server thread. A
visitor signs up; the thanks page points to the dashboard's Mailbox; there the
welcome email is listed like a mail client's (from, to, subject, date), and opens
with its html in the sandboxed frame, its inlined styles applied, its text and
headers below. The ``.eml`` download is the delivered bytes. Nothing runs a script,
nothing loads from elsewhere.

The screenshot goes to the test's tmp_path, and to ``$OUTBOX_DASHBOARD_SCREENSHOTS``
when set (how docs/dashboard-mailbox.png is made, as test_dashboard_browser.py makes
the other docs/dashboard-*.png).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import flask_migrate  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from conftest import drop_example_tables, poll
from flask import Flask
from playwright.sync_api import Dialog, sync_playwright
from test_dashboard_browser import chromium
from werkzeug.serving import make_server

from example_app import create_app
from example_app.extensions import db, mail

REPO_ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = "dashboard-mailbox.png"


@pytest.fixture
def served(db_url: str, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Flask, str]]:
    """The example app out of the box (the mailbox transport) behind a real HTTP server."""
    for name in list(os.environ):
        if name.startswith(("EXAMPLE_", "FLASK_")):
            monkeypatch.delenv(name)
    drop_example_tables(db_url)
    app = create_app({"SQLALCHEMY_DATABASE_URI": db_url, "SECRET_KEY": "browser-test",
                      "OUTBOX_RUN_SCHEDULER": False},
                     instance_path=str(tmp_path / "instance"))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="mailbox-http", daemon=True)
    try:
        with app.app_context():
            flask_migrate.upgrade(directory=str(REPO_ROOT / "migrations"), revision="heads")
            db.session.remove()
        thread.start()
        yield app, f"http://127.0.0.1:{server.server_port}"
    finally:
        if thread.is_alive():
            server.shutdown()
            thread.join(timeout=10)
        server.server_close()
        mail.stop(timeout=5)
        with app.app_context():
            db.session.remove()
            for engine in db.engines.values():
                engine.dispose()
        drop_example_tables(db_url)


def kept_mime(app: Flask) -> list[bytes]:
    with app.app_context(), db.engine.connect() as conn:
        return [bytes(m) for m in conn.execute(sa.text("SELECT mime FROM outbox_mailbox"))
                .scalars()]


def test_a_signup_shows_its_welcome_email_in_the_dashboards_mailbox(
        served: tuple[Flask, str], tmp_path: Path) -> None:
    executable = chromium()
    app, base = served
    finished: list[str] = []
    requests: list[str] = []
    errors: list[str] = []
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900},
                                          accept_downloads=True)
            page = context.new_page()
            page.set_default_timeout(15_000)
            page.on("request", lambda request: requests.append(request.url))
            page.on("requestfinished", lambda request: finished.append(request.url))
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("dialog", on_dialog)

            # Sign up; the thanks page says where the welcome email is.
            page.goto(f"{base}/")
            page.fill("input[name=name]", "Dana Developer")
            page.fill("input[name=email]", "dana@example.com")
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/thanks")
            [mime] = poll(lambda: kept_mime(app), timeout=15)
            page.click("#mailbox-hint a")
            page.wait_for_url(f"{base}/outbox/mailbox")

            # Listed like a mail client's inbox.
            assert page.locator("header.top nav a[aria-current=page]").inner_text() == "Mailbox"
            listed = page.locator("table.mailbox tbody tr")
            assert listed.count() == 1
            cells = [c.inner_text() for c in listed.first.locator("td").all()]
            assert cells[0] == "Example App <noreply@example.com>"
            assert cells[1] == "Dana Developer <dana@example.com>"
            assert cells[2] == "Welcome, Dana Developer!"

            # The message: its html in the sandboxed frame, with its inlined styles.
            page.click("td.subject a")
            page.wait_for_url(lambda url: "/outbox/mailbox?message=" in url)
            frame = page.frame_locator("iframe.html-body")
            heading = frame.locator("h1")
            assert "Dana Developer" in heading.inner_text()
            assert heading.evaluate("h1 => getComputedStyle(h1).fontSize") == "22px"
            assert page.frame_locator("iframe.html-body").locator("strong").first \
                .inner_text() == "dana@example.com"
            assert "Thanks for signing up with dana@example.com." in \
                page.inner_text("pre.text-body")
            assert "Welcome, Dana Developer!" in page.inner_text("table.headers")
            assert page.locator("script").count() == 0
            sandbox = page.locator("iframe.html-body").get_attribute("sandbox")
            assert sandbox == ""
            for element in page.locator("iframe").all():
                element.scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / SCREENSHOT), full_page=True)

            # The raw message downloads as the bytes that were delivered.
            with page.expect_download() as info:
                page.click("#download-eml")
            download = info.value
            assert download.suggested_filename.startswith("mailbox-")
            assert download.suggested_filename.endswith(".eml")
            assert Path(download.path()).read_bytes() == mime
        finally:
            browser.close()

    assert errors == [] and dialogs == []
    assert finished and {urlsplit(url).hostname for url in finished} == {"127.0.0.1"}
    assert {urlsplit(url).hostname for url in requests} == {"127.0.0.1"}
    assert (tmp_path / SCREENSHOT).stat().st_size > 10_000
    copy_to = os.environ.get("OUTBOX_DASHBOARD_SCREENSHOTS")
    if copy_to:
        shutil.copy(tmp_path / SCREENSHOT, Path(copy_to) / SCREENSHOT)
