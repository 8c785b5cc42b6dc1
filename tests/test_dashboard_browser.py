"""The dashboard in a real browser: headless Chromium, driven by Playwright.

The example app (its dashboard mounted at /outbox) is served on 127.0.0.1 by a
werkzeug server thread, delivering to the test SMTP server. An operator signs up
in the browser, the server refuses the welcome email (550), and the operator finds
the dead letter from the overview, opens it, presses Retry, and sees it delivered
and the page say so. A hostile email (script in the subject, the html trying to
reach the dashboard's document and a remote tracker) is opened too: nothing runs,
nothing loads from elsewhere. Nor from the app itself: a same-origin image (a false
"opened" hit on the app's own tracking) and a same-origin link clicked in the
preview (an app page loaded with the operator's cookies) never reach the server.
Every request the browser makes stays on 127.0.0.1.

Chromium is Debian's (``/usr/bin/chromium``; ``.ci/run`` installs it): Playwright
never downloads a browser. Locally a missing Chromium skips; in CI it fails.
Screenshots of each page go to the test's tmp_path, and also to
``$OUTBOX_DASHBOARD_SCREENSHOTS`` when set (how docs/dashboard-*.png are made).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import flask_migrate  # type: ignore[import-untyped]
import pytest
import sqlalchemy as sa
from conftest import drop_example_tables, poll
from flask import Flask
from playwright.sync_api import Dialog, sync_playwright
from smtpserver import FaultSMTPServer
from werkzeug.serving import BaseWSGIServer, make_server

from example_app import create_app
from example_app.extensions import db, mail
from flask_mail_outbox import Message
from flask_mail_outbox.core import email_table

CHROMIUM = "/usr/bin/chromium"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO_ROOT = Path(__file__).resolve().parent.parent
XSS = "<script>alert(1)</script>"
HOSTILE_HTML = (
    '<h1 id="inside">Quarterly report</h1>'
    '<script>parent.document.title = "owned"; document.body.dataset.ran = "yes";'
    ' console.log("owned")</script>'
    '<img src="https://tracker.example/pixel.gif" onerror="parent.document.title = \'owned\'">'
    '<link rel="stylesheet" href="https://cdn.example/evil.css">'
    # Same origin as the dashboard (a srcdoc resolves against its parent's URL).
    '<img id="pixel" src="/probe/pixel.gif">'
    '<a id="away" href="/probe/page">Open the report</a>'
)
PROBE = "/probe/"


def chromium() -> str:
    """Debian's Chromium, or skip (locally) / fail (CI) when it is not installed."""
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if IN_CI:
        pytest.fail(f"{CHROMIUM} is missing but CI runs the browser tests: install "
                    "Debian's chromium package (.ci/run does: apt-get install chromium)")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")


class PathLog:
    """WSGI middleware: the path of every request that reached the server."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.paths: list[str] = []

    def __call__(self, environ: dict[str, Any],
                 start_response: Callable[..., Any]) -> Iterable[bytes]:
        self.paths.append(str(environ.get("PATH_INFO", "")))
        return self.app(environ, start_response)


class Served:
    """The example app behind a real HTTP server on 127.0.0.1."""

    def __init__(self, app: Flask, server: BaseWSGIServer, log: PathLog) -> None:
        self.app = app
        self.server = server
        self.log = log
        self.base = f"http://127.0.0.1:{server.server_port}"

    def statuses(self) -> dict[int, str]:
        with self.app.app_context(), db.engine.connect() as conn:
            return {row.id: row.status for row in conn.execute(
                sa.select(email_table.c.id, email_table.c.status))}

    def wait_status(self, email_id: int, status: str, timeout: float = 15) -> bool:
        return poll(lambda: self.statuses().get(email_id), lambda s: s == status,
                    timeout=timeout) == status


@pytest.fixture
def served(db_url: str, smtp_server: FaultSMTPServer, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    for name in list(os.environ):
        if name.startswith(("EXAMPLE_", "FLASK_")):
            monkeypatch.delenv(name)
    drop_example_tables(db_url)
    app = create_app({
        "SQLALCHEMY_DATABASE_URI": db_url,
        "SECRET_KEY": "browser-test",
        "MAIL_SERVER": smtp_server.host,
        "MAIL_PORT": smtp_server.port,
        "MAIL_TIMEOUT": 5,
        "OUTBOX_RUN_SCHEDULER": False,
    }, instance_path=str(tmp_path / "instance"))
    log = PathLog(app)
    server = make_server("127.0.0.1", 0, log, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="dashboard-http",
                              daemon=True)
    try:
        with app.app_context():
            flask_migrate.upgrade(directory=str(REPO_ROOT / "migrations"), revision="heads")
            db.session.remove()
        thread.start()
        yield Served(app, server, log)
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


def test_operator_finds_a_dead_letter_retries_it_and_nothing_hostile_runs(
        served: Served, smtp_server: FaultSMTPServer, tmp_path: Path) -> None:
    executable = chromium()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    requests: list[str] = []
    finished: list[str] = []
    refused: list[tuple[str, str | None]] = []
    console: list[str] = []
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
            page.on("request", lambda request: requests.append(request.url))
            page.on("requestfinished", lambda request: finished.append(request.url))
            page.on("requestfailed",
                    lambda request: refused.append((request.url, request.failure)))
            page.on("console", lambda message: console.append(message.text))
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("dialog", on_dialog)

            def shot(name: str) -> None:
                # An iframe below the fold is painted only once scrolled to.
                for frame in page.locator("iframe").all():
                    frame.scroll_into_view_if_needed()
                page.screenshot(path=str(shots / f"dashboard-{name}.png"), full_page=True)

            # A visitor signs up; the mail server refuses the welcome email for good.
            smtp_server.reply("data", 550, "5.1.1 <b>mailbox</b> unknown", times=1)
            page.goto(f"{served.base}/")
            page.fill("input[name=name]", "Dana Operator")
            page.fill("input[name=email]", "dana@example.com")
            page.click("button[type=submit]")
            page.wait_for_url(f"{served.base}/thanks")
            (welcome_id,) = served.statuses()
            assert served.wait_status(welcome_id, "failed")
            hostile_id = _queue_hostile_email(served.app)

            # Overview: one dead letter, the chart drawn by the server.
            page.goto(f"{served.base}/outbox/")
            assert page.inner_text("#count-failed") == "1"
            assert page.inner_text("#count-queued") == "1"
            assert page.inner_text("#mode") == "inline"
            assert page.locator("svg.chart rect.bar-failed").count() == 24
            shot("overview")

            # To the dead letters, and into the one there.
            page.click("a.card-failed")
            page.wait_for_url(f"{served.base}/outbox/dead-letters")
            assert page.locator("table.emails tbody tr").count() == 1
            shot("dead-letters")
            page.click("td.subject a")
            page.wait_for_url(f"{served.base}/outbox/emails/{welcome_id}")
            assert page.inner_text("h1 .status") == "failed"
            assert "<b>mailbox</b> unknown" in page.inner_text("table.history")
            shot("email-failed")

            # Retry: the server takes it now, and the page shows it sent.
            page.click("button.retry")
            page.wait_for_url(f"{served.base}/outbox/emails/{welcome_id}?notice=retried")
            assert "queued again" in page.inner_text("p.notice")
            assert smtp_server.wait_for(1)
            assert smtp_server.messages[0].parsed["To"] == "Dana Operator <dana@example.com>"
            assert served.wait_status(welcome_id, "sent")
            page.reload()
            assert page.inner_text("h1 .status") == "sent"
            shot("email-sent")

            # The list, searched by recipient prefix.
            page.goto(f"{served.base}/outbox/emails")
            page.select_option("select[name=field]", "recipient")
            page.fill("input[name=q]", "DANA")
            page.click("form.filters button")
            assert page.locator("table.emails tbody tr").count() == 1
            page.goto(f"{served.base}/outbox/emails")
            assert page.locator("table.emails tbody tr").count() == 2
            assert XSS in page.inner_text("table.emails")  # shown as text
            shot("emails")

            # The hostile email: its html is shown, and none of it runs or loads.
            page.goto(f"{served.base}/outbox/emails/{hostile_id}")
            title = page.title()
            preview = page.frame_locator("iframe.html-body")
            assert preview.locator("#inside").inner_text() == "Quarterly report"
            assert preview.locator("body").get_attribute("data-ran") is None
            assert page.inner_text("p.subject-line") == XSS
            # The same-origin image is not loaded (the page's load event has fired:
            # every image it was going to fetch was fetched or refused by then).
            assert preview.locator("#pixel").evaluate("img => img.naturalWidth") == 0
            shot("email-html")
            # A click on the same-origin link in the preview: Chromium refuses the
            # navigation (frame-src 'none'). It then usually commits an error page
            # in the frame, but not always: wait for any sign that the click was
            # handled (the frame navigated, or the request was refused, or the
            # console says so) before reading what reached the app.
            handled: list[str] = []
            page.on("framenavigated", lambda frame: handled.append("navigated")
                    if frame != page.main_frame else None)
            page.on("requestfailed", lambda request: handled.append("refused")
                    if "/probe/page" in request.url else None)
            page.on("console", lambda message: handled.append("console")
                    if "/probe/page" in message.text else None)
            # The refusal is also a CSP violation reported to the page that holds
            # the frame (the only sign in some runs).
            page.evaluate("document.addEventListener('securitypolicyviolation',"
                          " e => { window.__refused = e.violatedDirective; })")
            preview.locator("#away").click()
            deadline = time.monotonic() + 15
            while not handled and time.monotonic() < deadline:
                page.wait_for_timeout(50)
                if page.evaluate("window.__refused || null"):
                    handled.append("csp")
            # Under load (CI's `-n 2` beside a browser per worker) Chromium has dropped
            # the refused navigation without any of those signs: after 15 s the click
            # was handled one way or another, and what matters is checked below: that
            # nothing under /probe/ reached the app.
            served_paths = list(served.log.paths)
            page.reload()
            assert page.title() == title == f"Email {hostile_id} · Outbox dashboard"
            assert page.locator("script").count() == 0
        finally:
            browser.close()

    assert dialogs == [] and errors == []
    # Neither the image nor the link reached the app (nor anything under /probe/).
    assert [path for path in served_paths if path.startswith(PROBE)] == []
    assert [url for url in finished if PROBE in url] == []
    assert not any("owned" in text for text in console)
    # Every request that reached the network went to the app. Chromium checks some
    # subresources against the CSP in the browser process and reports them as
    # requests that failed with "csp": those never left. Anything else that was
    # not for 127.0.0.1 would fail differently (there is no other network here).
    assert finished and {urlsplit(url).hostname for url in finished} == {"127.0.0.1"}
    elsewhere = [url for url in requests if urlsplit(url).hostname != "127.0.0.1"]
    assert all((url, "csp") in refused for url in elsewhere), (elsewhere, refused)
    # The tracker and the stylesheet were asked for, and refused by the CSP.
    blocked = " ".join(console) + " ".join(url for url, _ in refused)
    assert "tracker.example" in blocked and "cdn.example" in blocked
    pages = sorted(path.name for path in shots.iterdir())
    assert pages == [f"dashboard-{name}.png" for name in (
        "dead-letters", "email-failed", "email-html", "email-sent", "emails", "overview")]
    assert all((shots / name).stat().st_size > 10_000 for name in pages)
    copy_to = os.environ.get("OUTBOX_DASHBOARD_SCREENSHOTS")
    if copy_to:
        for name in pages:
            shutil.copy(shots / name, Path(copy_to) / name)


def _queue_hostile_email(app: Flask) -> int:
    """An email built to attack the operator's browser; due tomorrow, so it stays queued."""
    with app.app_context():
        email_id = mail.send(
            Message(subject=XSS, recipients=[("<img src=x onerror=alert(2)>",
                                              "target@example.com")],
                    body="see the html part", html=HOSTILE_HTML),
            send_after=timedelta(days=1))
        db.session.commit()
    return email_id


def test_operator_adds_an_address_to_the_suppression_list_sees_it_and_removes_it(
        served: Served, tmp_path: Path) -> None:
    executable = chromium()
    errors: list[str] = []
    dialogs: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(15_000)
            page.on("pageerror", lambda error: errors.append(str(error)))
            def on_dialog(dialog: Dialog) -> None:
                dialogs.append(dialog.message)
                dialog.dismiss()

            page.on("dialog", on_dialog)

            # From the overview, through the navigation.
            page.goto(f"{served.base}/outbox/")
            page.click("header.top nav a:has-text('Suppressions')")
            page.wait_for_url(f"{served.base}/outbox/suppressions")
            assert page.inner_text("#suppression-total") == "0"
            assert "No addresses here." in page.inner_text("table.suppressions")

            # A typo first: refused with the reason, what was typed kept, nothing written.
            page.fill("input[name=address]", "dana.example.com")
            page.click("form.add-suppression button[type=submit]")
            assert "is not an email address" in page.inner_text("#suppression-error")
            assert page.input_value("input[name=address]") == "dana.example.com"
            assert page.inner_text("#suppression-total") == "0"

            # The address: added, and the list shows it (kept in lower case).
            page.fill("input[name=address]", "Dana@Example.com")
            page.click("form.add-suppression button[type=submit]")
            page.wait_for_url(lambda url: "notice=suppressed" in url)
            assert "added to the suppression list" in page.inner_text("p.notice")
            row = page.locator("table.suppressions tbody tr")
            assert row.count() == 1
            assert row.locator("td.addr").inner_text() == "dana@example.com"
            assert row.locator(".reason").inner_text() == "manual"
            assert row.locator("td.source").inner_text() == "dashboard"
            with served.app.app_context():
                entry = mail.suppression("dana@example.com")
            assert entry is not None and entry.reason == "manual"
            page.screenshot(path=str(tmp_path / "dashboard-suppressions.png"), full_page=True)

            # Removed from its row: the list is empty again, and so is the table.
            row.locator("button.unsuppress").click()
            page.wait_for_url(lambda url: "notice=unsuppressed" in url)
            assert "taken off the suppression list" in page.inner_text("p.notice")
            assert "No addresses here." in page.inner_text("table.suppressions")
            page.goto(f"{served.base}/outbox/suppressions")
            assert page.inner_text("#suppression-total") == "0"
            with served.app.app_context():
                assert mail.suppression("dana@example.com") is None
        finally:
            browser.close()
    assert errors == [] and dialogs == []
    assert (tmp_path / "dashboard-suppressions.png").stat().st_size > 10_000
    copy_to = os.environ.get("OUTBOX_DASHBOARD_SCREENSHOTS")
    if copy_to:
        shutil.copy(tmp_path / "dashboard-suppressions.png",
                    Path(copy_to) / "dashboard-suppressions.png")
