"""The dashboard blueprint through Flask's test client, on SQLite and PostgreSQL.

Security first: every route of the blueprint (read from the url_map, so a new one
cannot be forgotten) answers 403 without authorization; every POST without the
session's CSRF token answers 400 and changes nothing; HTML in a subject, a display
name or a server's error text comes out escaped; an email's html exists on
the page only inside a sandboxed iframe's srcdoc; every response carries the CSP;
only ``authorize() is True`` lets a request in; a hand-edited link is a 400 or 404,
never a 500. Then the pages: keyset pagination and prefix search (wildcards literal,
runs of equal values paged once), the actions (retry; retry all as one UPDATE that
keeps each key's order; purge, which spares a row retried while it runs; mode), the
per-hour chart, and OUTBOX_SCRUB_SENT.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import (
    close_app,
    empty_postgres,
    make_app,
    query_plan,
    require_postgres,
    rows,
    wait_rows,
)
from conftest import db as test_db
from dashboard_helpers import Gate
from flask import Flask
from flask.testing import FlaskClient
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox._operator.dashboard import (
    CONTENT_SECURITY_POLICY,
    make_blueprint,
)
from flask_mail_outbox.core import Status, attachment_table, email_table
from flask_mail_outbox.core._dialect import Postgres
from flask_mail_outbox.core._insert import search_values
from flask_mail_outbox.core._leases import Outcome
from flask_mail_outbox.core._queries import get_setting, list_emails, prefix_bounds
from flask_mail_outbox.core._store import Store

PREFIX = "/outbox"
XSS = "<script>alert(1)</script>"
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def dashboard(app: Flask, mail: OutboxMail, gate: Gate) -> Flask:
    """The conftest app (SMTP to the test server) with the dashboard under /outbox."""
    app.register_blueprint(mail.dashboard_blueprint(authorize=gate, page_size=20),
                           url_prefix=PREFIX)
    return app


@pytest.fixture
def client(dashboard: Flask) -> FlaskClient:
    return dashboard.test_client()


def send(app: Flask, mail: OutboxMail, *, count: int = 1, later: bool = False,
         **fields: Any) -> list[int]:
    """Queue ``count`` emails in one transaction; ``later``: due tomorrow (stay queued)."""
    ids = []
    with app.app_context():
        for n in range(count):
            values: dict[str, Any] = {"subject": f"Hello {n}",
                                      "recipients": [f"user{n}@example.com"], "body": "hi"}
            values.update(fields)
            ids.append(mail.send(Message(**values),
                                 send_after=timedelta(days=1) if later else None))
        test_db.session.commit()
    return ids


def dead_letter(app: Flask, mail: OutboxMail, server: FaultSMTPServer,
                text: str = "5.1.1 mailbox unknown", **fields: Any) -> int:
    """One email the server refuses with 550: a dead letter."""
    server.reply("data", 550, text, times=1)
    (email_id,) = send(app, mail, **fields)
    wait_rows(app, lambda rs: any(r["id"] == email_id and r["status"] == "failed"
                                  for r in rs), timeout=10)
    assert status_of(app, email_id) == "failed"
    return email_id


def status_of(app: Flask, email_id: int) -> str:
    return str(next(r["status"] for r in rows(app) if r["id"] == email_id))


def csrf_token(client: FlaskClient) -> str:
    """The session's token, as a page renders it."""
    page = client.get(f"{PREFIX}/dead-letters").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match is not None, "the page has no CSRF field"
    return match.group(1)


def dashboard_routes(app: Flask) -> list[tuple[str, str]]:
    """(method, url) for every route of the blueprint, placeholders filled in."""
    routes = []
    for rule in app.url_map.iter_rules():
        if not rule.endpoint.startswith("outbox_dashboard."):
            continue
        values = {"email_id": 1, "filename": "outbox-dashboard.css"}
        url = rule.build({name: values[name] for name in rule.arguments})
        assert url is not None
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            routes.append((method, url[1]))
    return routes


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


def elements(html: str, tag: str) -> list[dict[str, str | None]]:
    parser = _Elements()
    parser.feed(html)
    return [attrs for name, attrs in parser.found if name == tag]


def next_link(html: str) -> str | None:
    links = [a["href"] for a in elements(html, "a") if a.get("rel") == "next"]
    return None if not links else str(links[0]).replace("&amp;", "&")


def walk(client: FlaskClient, url: str) -> list[int]:
    """Follow "Next page" from ``url`` to the end; every email id listed, in order."""
    seen: list[int] = []
    pages = 0
    next_url: str | None = url
    while next_url is not None:
        response = client.get(next_url)
        assert response.status_code == 200, response.get_data(as_text=True)
        page = response.get_data(as_text=True)
        seen += [int(m) for m in re.findall(r'<td class="num"><a href="[^"]*/emails/(\d+)"', page)]
        next_url = next_link(page)
        pages += 1
        assert pages < 100, "pagination does not end"
    return seen


# --- registration ----------------------------------------------------------------------


@pytest.mark.parametrize("authorize", [None, "yes", True, 1])
def test_blueprint_refuses_to_exist_without_an_authorize_callable(
        mail: OutboxMail, authorize: Any) -> None:
    with pytest.raises(TypeError, match="authorize"):
        mail.dashboard_blueprint(authorize=authorize)
    with pytest.raises(TypeError, match="authorize"):
        make_blueprint(mail, authorize)


def test_registering_on_an_app_without_secret_key_fails_naming_it(
        make_apps: Callable[..., tuple[Flask, OutboxMail]]) -> None:
    app, mail = make_apps(SECRET_KEY=None)
    with pytest.raises(ConfigError, match="SECRET_KEY") as caught:
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix=PREFIX)
    assert caught.value.key == "SECRET_KEY"


@pytest.mark.parametrize("prefix", [None, "", "/"])
def test_mounting_without_a_prefix_is_refused(app: Flask, mail: OutboxMail,
                                              prefix: str | None) -> None:
    with pytest.raises(ValueError, match="url_prefix"):
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix=prefix)


def test_an_app_without_html_autoescaping_is_refused(
        make_apps: Callable[..., tuple[Flask, OutboxMail]]) -> None:
    app, mail = make_apps()
    app.select_jinja_autoescape = lambda filename: False  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="autoescap"):
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix=PREFIX)


def test_page_size_is_checked(mail: OutboxMail) -> None:
    with pytest.raises(ValueError, match="page_size"):
        mail.dashboard_blueprint(authorize=lambda: True, page_size=0)


class _AnonymousUser:
    """Truthy, as Flask-Login's AnonymousUserMixin is: ``lambda: current_user`` lets it in."""


@pytest.mark.parametrize("answer", [_AnonymousUser(), "yes", 1, ["admin"], None, 0])
def test_only_true_from_authorize_lets_a_request_in(
        app: Flask, mail: OutboxMail, answer: Any, caplog: pytest.LogCaptureFixture) -> None:
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: answer),
                           url_prefix=PREFIX)
    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
        for url in (f"{PREFIX}/", f"{PREFIX}/dead-letters", f"{PREFIX}/emails"):
            assert client.get(url).status_code == 403, url
    # Not a bool (even a falsy one): a mistake in the gate, said once per blueprint,
    # not once per request.
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "authorize() returned a" in errors[0] and "True or False" in errors[0]
    assert "lambda: current_user" in errors[0]


def test_authorize_false_is_a_quiet_403_and_true_lets_in(
        app: Flask, mail: OutboxMail, caplog: pytest.LogCaptureFixture) -> None:
    answer = [False]
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: answer[0]),
                           url_prefix=PREFIX)
    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
        assert client.get(f"{PREFIX}/").status_code == 403
        answer[0] = True
        assert client.get(f"{PREFIX}/").status_code == 200
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- authorization, CSRF, headers ------------------------------------------------------


def test_every_route_answers_403_without_authorization_and_changes_nothing(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail, gate: Gate,
        smtp_server: FaultSMTPServer) -> None:
    failed = dead_letter(dashboard, mail, smtp_server)
    token = csrf_token(client)
    routes = dashboard_routes(dashboard)
    # The blueprint's pages, actions and stylesheet: if one is added, it is in here.
    assert {url for _, url in routes} >= {
        f"{PREFIX}/", f"{PREFIX}/emails", f"{PREFIX}/emails/1", f"{PREFIX}/emails/1/retry",
        f"{PREFIX}/dead-letters", f"{PREFIX}/dead-letters/retry-all",
        f"{PREFIX}/dead-letters/purge", f"{PREFIX}/mode",
        f"{PREFIX}/static/outbox-dashboard.css"}
    before = rows(dashboard)
    gate.open = False
    gate.calls = 0
    for method, url in routes:
        url = url.replace("/emails/1", f"/emails/{failed}")
        response = client.open(url, method=method, data={
            "csrf_token": token, "confirm": "yes", "mode": "durable"})
        assert response.status_code == 403, (method, url)
        assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert gate.calls == len(routes)
    assert rows(dashboard) == before
    assert mail.durable is False

    # The same requests go through once authorized (the 403 was the gate, nothing else).
    gate.open = True
    for method, url in routes:
        if method == "GET":
            url = url.replace("/emails/1", f"/emails/{failed}")
            with client.get(url) as page:  # closes the stylesheet's file
                assert page.status_code == 200, url


def test_posts_without_the_sessions_csrf_token_are_refused_and_change_nothing(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    failed = dead_letter(dashboard, mail, smtp_server)
    token = csrf_token(client)
    other_session = dashboard.test_client()
    foreign_token = csrf_token(other_session)
    assert foreign_token != token
    posts = [url.replace("/emails/1", f"/emails/{failed}")
             for method, url in dashboard_routes(dashboard) if method == "POST"]
    # retry, cancel, retry-all, purge, mode, suppress, unsuppress, send a preview,
    # clear the mailbox
    assert len(posts) == 9
    before = rows(dashboard)
    for url in posts:
        for form in ({}, {"csrf_token": ""}, {"csrf_token": "x" * 43},
                     {"csrf_token": foreign_token}):
            response = client.post(url, data={**form, "confirm": "yes", "mode": "durable"})
            assert response.status_code == 400, (url, form)
            assert "CSRF" in response.get_data(as_text=True)
    assert rows(dashboard) == before
    assert mail.durable is False

    # With the token, the same action works.
    response = client.post(f"{PREFIX}/emails/{failed}/retry", data={"csrf_token": token})
    assert response.status_code == 303
    assert smtp_server.wait_for(1)
    assert wait_rows(dashboard, lambda rs: rs[0]["status"] == "sent", timeout=10)[0][
        "status"] == "sent"


def test_every_response_carries_the_security_headers(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    (email_id,) = send(dashboard, mail, later=True)
    urls = [url.replace("/emails/1", f"/emails/{email_id}")
            for method, url in dashboard_routes(dashboard) if method == "GET"]
    urls += [f"{PREFIX}/emails/999999", f"{PREFIX}/emails?status=nope",
             f"{PREFIX}/emails?before=x", *MALFORMED]
    statuses = set()
    for url in urls:
        response = client.get(url)
        response.close()  # the stylesheet is served from an open file
        statuses.add(response.status_code)
        assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY, url
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["Referrer-Policy"] == "no-referrer"
        assert response.headers["X-Frame-Options"] == "DENY"
    assert statuses == {200, 400, 404}
    # Nothing may come from elsewhere, nothing may frame the dashboard.
    policy = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["frame-ancestors"] == "'none'"
    # The preview inherits the policy: no image from the app, no navigation of the
    # frame (tests/test_dashboard_browser.py watches Chromium obey both).
    assert policy["img-src"] == "data:" and policy["frame-src"] == "'none'"
    assert "http" not in CONTENT_SECURITY_POLICY and "*" not in CONTENT_SECURITY_POLICY


# Hand-edited links: (url, status). Never a 500, on either backend.
MALFORMED_STATUS = {
    f"{PREFIX}/emails?before=%C2%B2": 400,  # "²".isdigit() is true, int("²") raises
    f"{PREFIX}/emails?q=a&after_id=%C2%B2": 400,
    f"{PREFIX}/emails?before=99999999999999999999999": 400,  # past BIGINT
    f"{PREFIX}/emails?before=9223372036854775808": 400,  # 2**63
    f"{PREFIX}/emails?before=0": 400,
    f"{PREFIX}/emails?before=" + "1" * 5000: 400,  # past int()'s digit limit
    f"{PREFIX}/emails?q=a&after_id=x": 400,
    f"{PREFIX}/emails?q=a&after_id=99999999999999999999999": 400,
    f"{PREFIX}/emails?q=a%00b": 400,  # PostgreSQL text holds no NUL
    f"{PREFIX}/emails?q=a&after_key=%00&after_id=1": 400,
    f"{PREFIX}/emails/99999999999999999999999": 404,  # an id no row can have
    f"{PREFIX}/emails/9223372036854775808": 404,
    f"{PREFIX}/emails/0": 404,
    f"{PREFIX}/emails?before=9223372036854775807": 200,  # the largest id is fine
    f"{PREFIX}/emails?q=a&after_key=a&after_id=9223372036854775807": 200,
    f"{PREFIX}/dead-letters?notice=retried_all&n=%C2%B2": 200,
}
MALFORMED = list(MALFORMED_STATUS)


def test_malformed_query_strings_and_ids_answer_400_or_404_never_500(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    send(dashboard, mail, later=True)
    for url, expected in MALFORMED_STATUS.items():
        response = client.get(url)
        assert response.status_code == expected, (url, response.get_data(as_text=True))
    page = client.get(f"{PREFIX}/dead-letters?notice=retried_all&n=%C2%B2")
    assert "? dead letter(s) queued again." in page.get_data(as_text=True)
    # An action on an id no row can have changes nothing and says so.
    response = client.post(f"{PREFIX}/emails/99999999999999999999999/retry",
                           data={"csrf_token": csrf_token(client)})
    assert response.status_code == 303 and response.headers["Location"].endswith(
        "notice=not_failed")


# --- escaping and the html preview -----------------------------------------------------


def test_html_in_subject_name_and_server_text_is_shown_escaped(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    email_id = dead_letter(dashboard, mail, smtp_server, text=f"5.7.1 {XSS}", subject=XSS,
                           recipients=[(XSS, "victim@example.com")], html="<p>x</p>")
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    pages = {
        "list": client.get(f"{PREFIX}/emails").get_data(as_text=True),
        "search": client.get(f"{PREFIX}/emails?field=subject&q=%3Cscr").get_data(as_text=True),
        "dead letters": client.get(f"{PREFIX}/dead-letters").get_data(as_text=True),
        "detail": client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True),
    }
    for name, page in pages.items():
        assert "<script" not in page.lower(), name
        assert escaped in page, name  # the subject, and the server's text
    detail = pages["detail"]
    assert detail.count(escaped) >= 3  # subject line, Subject header, last error
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &lt;victim@example.com&gt;" in detail \
        or "&#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34; &lt;victim@example.com&gt;" in detail


def test_html_body_is_only_inside_a_sandboxed_iframes_srcdoc(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    html = ('<h1 id="inside">Hi</h1><script>parent.document.title = "owned"</script>'
            '<img src="https://tracker.example/p.gif" onerror="alert(1)">')
    (email_id,) = send(dashboard, mail, later=True, html=html, body="text part")
    page = client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True)

    (frame,) = elements(page, "iframe")
    assert "sandbox" in frame and frame["sandbox"] in ("", None)  # every restriction on
    assert frame["srcdoc"] is not None and frame["srcdoc"].strip() == html
    # Outside the attribute the markup never appears as markup.
    assert "<script" not in page and "<h1 id=\"inside\"" not in page
    assert "onerror=\"alert" not in page
    assert 'srcdoc="&lt;h1 id=&#34;inside&#34;&gt;Hi&lt;/h1&gt;&lt;script&gt;' in page
    assert "<pre class=\"text-body\">text part" in page


# --- listing, search, pagination --------------------------------------------------------


def test_keyset_pagination_walks_every_row_exactly_once_without_offset(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    ids = send(dashboard, mail, count=65, later=True)
    offsets: list[Any] = []

    def note_offsets(conn: Any, cursor: Any, statement: str, parameters: Any,
                     *args: Any) -> None:
        if statement.startswith("SELECT") and "outbox_email" in statement:
            # SQLAlchemy's SQLite dialect always appends "OFFSET ?" and passes 0.
            offsets.append(parameters[-1] if " OFFSET " in statement.upper() else None)

    with dashboard.app_context():
        engine = mail._state().outbox().engine
    sa.event.listen(engine, "before_cursor_execute", note_offsets)

    seen = walk(client, f"{PREFIX}/emails")
    assert seen == sorted(ids, reverse=True)  # newest first, each once
    assert walk(client, f"{PREFIX}/emails?status=queued") == sorted(ids, reverse=True)
    assert walk(client, f"{PREFIX}/emails?status=sent") == []
    # Search pages in (recipient, id) order: user0, user1, user10, ...
    searched = walk(client, f"{PREFIX}/emails?field=recipient&q=USER")
    assert sorted(searched) == sorted(ids) and len(searched) == len(set(searched))
    by_address = sorted(ids, key=lambda i: (f"user{ids.index(i)}@example.com", i))
    assert searched == by_address
    assert len(offsets) >= 12 and set(offsets) <= {None, 0}


def test_prefix_search_on_recipient_and_subject_is_case_insensitive(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    def one(subject: str, to: str) -> int:
        (email_id,) = send(dashboard, mail, later=True, subject=subject, recipients=[to])
        return email_id

    alice = one("Welcome aboard", "Alice@Example.com")
    alfred = one("Invoice 42", "alfred@example.com")
    bob = one("Welcome back", "bob@example.com")
    elodie = one("Élan vital", "elodie@example.com")

    def found(query: str) -> list[int]:
        return walk(client, f"{PREFIX}/emails?{query}")

    assert found("field=recipient&q=al") == [alfred, alice]
    assert found("field=recipient&q=ALI") == [alice]
    assert found("field=recipient&q=alice%40example.com") == [alice]
    assert found("field=recipient&q=carol") == []
    assert found("field=subject&q=welcome") == [alice, bob]
    assert found("field=subject&q=WELCOME+BA") == [bob]
    assert found("field=subject&q=%C3%A9LAN") == [elodie]  # "éLAN"
    assert found("status=queued&field=subject&q=inv") == [alfred]
    assert found("status=failed&field=subject&q=inv") == []
    assert client.get(f"{PREFIX}/emails?field=body&q=x").status_code == 400


def test_search_wildcards_are_literal_characters(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    def one(subject: str) -> int:
        (email_id,) = send(dashboard, mail, later=True, subject=subject)
        return email_id

    percent = one("100% off")
    underscore = one("a_b")
    backslash = one("back\\slash")
    one("100 percent off")
    one("axb")
    one("back slash")

    def found(q: str) -> list[int]:
        return walk(client, f"{PREFIX}/emails?field=subject&q={q}")

    assert found("100%25") == [percent]  # "100%": no LIKE wildcard
    assert found("a_") == [underscore]
    assert found("back%5C") == [backslash]
    assert found("%25") == [] and found("_") == []


def test_search_pages_through_many_equal_values_once_each(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    # 45 emails to one address: the (value, id) cursor, not the value alone, pages on
    # (page_size is 20, so two page boundaries fall inside the run of equal values).
    ids = send(dashboard, mail, count=45, later=True, recipients=["same@example.com"])
    others = send(dashboard, mail, count=3, later=True, recipients=["samf@example.com"])
    assert walk(client, f"{PREFIX}/emails?field=recipient&q=same%40") == ids
    assert walk(client, f"{PREFIX}/emails?field=recipient&q=sam") == ids + others


def test_prefix_bounds_cover_exactly_the_strings_that_start_with_the_prefix() -> None:
    assert prefix_bounds("ab") == ("ab", "ac")
    assert prefix_bounds("a\U0010ffff") == ("a\U0010ffff", "b")
    assert prefix_bounds("\U0010ffff") == ("\U0010ffff", None)
    assert prefix_bounds("a\ud7ff") == ("a\ud7ff", "a\ue000")
    words = ["ab", "abc", "ab\U0010ffff", "aa\U0010ffff", "ac", "a", "b", "ab\x00"]
    lo, hi = prefix_bounds("ab")
    assert hi is not None
    assert sorted(w for w in words if lo <= w < hi) == sorted(w for w in words
                                                              if w.startswith("ab"))


def test_search_columns_are_filled_at_send(dashboard: Flask, mail: OutboxMail) -> None:
    (email_id,) = send(dashboard, mail, later=True, subject="Ünïcode " + "x" * 300,
                       recipients=[("Big Name", "BIG@Example.COM")], cc=["cc@example.com"])
    (row,) = [r for r in rows(dashboard) if r["id"] == email_id]
    assert row["search_recipient"] == "big@example.com"
    assert row["search_subject"] == ("ünïcode " + "x" * 300)[:200]
    assert search_values(row["recipients"], row["subject"]) == {
        "search_recipient": row["search_recipient"], "search_subject": row["search_subject"]}


# --- pages and actions ---------------------------------------------------------------


def test_overview_shows_counts_mode_and_the_per_hour_chart(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    send(dashboard, mail, count=2, later=True)
    send(dashboard, mail, count=3)
    assert smtp_server.wait_for(3)
    wait_rows(dashboard, lambda rs: sum(r["status"] == "sent" for r in rs) == 3, timeout=10)
    dead_letter(dashboard, mail, smtp_server)
    page = client.get(f"{PREFIX}/").get_data(as_text=True)
    assert '<span class="count" id="count-queued">2</span>' in page
    assert '<span class="count" id="count-sent">3</span>' in page
    assert '<span class="count" id="count-failed">1</span>' in page
    assert '<span id="mode">inline</span>' in page
    # Which counts are running totals (outbox_tally) and which are counted row by row.
    assert re.search(r'id="counts-note">sent, suppressed, expired, cancelled: running totals',
                     page)
    assert "Last 24 hours: 3 sent, 1 dead-lettered" in page
    assert page.count('class="bar-sent"') == 24 and page.count('class="bar-failed"') == 24
    # The bars hold all of them (in one hour's bar or two, if the hour turned meanwhile).
    for kind, total in (("sent", 3), ("failed", 1)):
        counts = [int(n) for n in re.findall(rf'<title>\d\d:00 UTC: (\d+) {kind}</title>',
                                              page)]
        assert len(counts) == 24 and sum(counts) == total, (kind, counts)
    (row,) = [r for r in rows(dashboard) if r["status"] == "failed"]
    assert row["failed_at"] is not None


def test_the_overview_reads_indexes_and_the_tally_never_the_whole_table(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail, backend: str) -> None:
    """Every statement of the overview, as it ran: outbox_email only through an index
    of one status's rows; the terminal statuses' counts and the sent chart from
    outbox_tally (a few rows whatever the table holds)."""
    with dashboard.app_context():
        store: Store = mail._state().outbox().store
    executed: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")) and "FROM" in statement:
            executed.append((statement, parameters))

    client.get(f"{PREFIX}/")  # connects first
    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        assert client.get(f"{PREFIX}/").status_code == 200
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    assert sum("outbox_tally" in statement for statement, _ in executed) == 2, executed
    for statement, parameters in executed:
        if "outbox_email" not in statement:
            continue
        plan = query_plan(store.engine, statement, parameters)
        # An index of one status's rows (which one is the planner's choice: SQLite's,
        # on a table never analysed, takes ix_outbox_email_status_id), never the table,
        # nor the whole of the index of every status.
        assert re.search(r"(?:INDEX|using) ix_outbox_email_", plan), plan
        assert not re.search(r"SCAN outbox_email(?! USING)", plan), plan
        assert not re.search(r"SCAN outbox_email USING (?:COVERING )?INDEX "
                             r"ix_outbox_email_status_id", plan), plan
        assert "Seq Scan on outbox_email" not in plan, plan


def test_mode_toggle_switches_delivery_for_every_process(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    token = csrf_token(client)
    response = client.post(f"{PREFIX}/mode", data={"csrf_token": token, "mode": "durable"})
    assert response.status_code == 303
    with dashboard.app_context():
        assert mail.durable is True
        with mail._state().outbox().store.read() as conn:
            assert get_setting(conn, "durable") is True
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert '<span id="mode">durable</span>' in page and "now durable" in page
    client.post(f"{PREFIX}/mode", data={"csrf_token": token, "mode": "inline"})
    with dashboard.app_context():
        assert mail.durable is False
    assert client.post(f"{PREFIX}/mode", data={"csrf_token": token,
                                               "mode": "on"}).status_code == 400


def test_detail_shows_failure_history_attachments_and_retry_delivers(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    email_id = dead_letter(dashboard, mail, smtp_server, text="5.1.1 no such user",
                           attachments=None)
    with dashboard.app_context():
        message = Message(subject="With file", recipients=["a@example.com"], body="b")
        message.attach("report.csv", "text/csv", b"a,b\n1,2\n")
        smtp_server.reply("data", 550, "5.1.1 no such user", times=1)
        with_file = mail.send(message)
        test_db.session.commit()
    wait_rows(dashboard, lambda rs: all(r["status"] == "failed" for r in rs), timeout=10)
    page = client.get(f"{PREFIX}/emails/{with_file}").get_data(as_text=True)
    assert "report.csv" in page and "text/csv" in page
    assert "550" in page and "no such user" in page  # the failure history
    assert "Retry this email" in page

    response = client.post(f"{PREFIX}/emails/{email_id}/retry",
                           data={"csrf_token": csrf_token(client)})
    assert response.status_code == 303
    assert response.headers["Location"].endswith(f"/emails/{email_id}?notice=retried")
    assert smtp_server.wait_for(1)
    wait_rows(dashboard, lambda rs: status_of(dashboard, email_id) == "sent", timeout=10)
    assert status_of(dashboard, email_id) == "sent"
    page = client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True)
    assert '<span class="status status-sent">sent</span>' in page
    # Retrying what is no longer a dead letter changes nothing and says so.
    response = client.post(f"{PREFIX}/emails/{email_id}/retry",
                           data={"csrf_token": csrf_token(client)})
    assert response.headers["Location"].endswith("notice=not_failed")


def test_retry_all_and_purge_dead_letters(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    first = dead_letter(dashboard, mail, smtp_server)
    second = dead_letter(dashboard, mail, smtp_server)
    token = csrf_token(client)
    page = client.get(f"{PREFIX}/dead-letters").get_data(as_text=True)
    assert f"/emails/{first}/retry" in page and f"/emails/{second}/retry" in page

    response = client.post(f"{PREFIX}/dead-letters/retry-all", data={"csrf_token": token})
    assert response.headers["Location"].endswith("notice=retried_all&n=2")
    assert smtp_server.wait_for(2)
    wait_rows(dashboard, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)
    assert "2 dead letter(s) queued again." in client.get(
        response.headers["Location"]).get_data(as_text=True)

    third = dead_letter(dashboard, mail, smtp_server)
    # Purging needs the confirmation box; "older than 1 day" spares a fresh one.
    assert client.post(f"{PREFIX}/dead-letters/purge",
                       data={"csrf_token": token}).status_code == 400
    assert client.post(f"{PREFIX}/dead-letters/purge", data={
        "csrf_token": token, "confirm": "yes", "older_than_days": "-1"}).status_code == 400
    response = client.post(f"{PREFIX}/dead-letters/purge", data={
        "csrf_token": token, "confirm": "yes", "older_than_days": "1"})
    assert response.headers["Location"].endswith("notice=purged&n=0")
    assert status_of(dashboard, third) == "failed"
    response = client.post(f"{PREFIX}/dead-letters/purge",
                           data={"csrf_token": token, "confirm": "yes"})
    assert response.headers["Location"].endswith("notice=purged&n=1")
    assert [r["id"] for r in rows(dashboard)] == [first, second]


def dead_letter_with_attachment(app: Flask, mail: OutboxMail,
                                server: FaultSMTPServer) -> int:
    with app.app_context():
        message = Message(subject="With file", recipients=["a@example.com"], body="b")
        message.attach("report.csv", "text/csv", b"a,b\n1,2\n")
        server.reply("data", 550, "5.1.1 no such user", times=1)
        email_id = mail.send(message)
        test_db.session.commit()
    wait_rows(app, lambda rs: status_of(app, email_id) == "failed", timeout=10)
    return email_id


def attachment_owners(app: Flask) -> list[int]:
    with app.app_context(), test_db.engine.connect() as conn:
        return list(conn.execute(sa.select(attachment_table.c.email_id)).scalars())


@pytest.mark.parametrize("via", ["dashboard", "cli"])
def test_purge_spares_a_dead_letter_retried_while_it_runs(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer, backend: str, via: str) -> None:
    retried = dead_letter_with_attachment(dashboard, mail, smtp_server)
    purged = dead_letter_with_attachment(dashboard, mail, smtp_server)
    token = csrf_token(client)
    with dashboard.app_context():
        store: Store = mail._state().outbox().store
    # A retry commits at the last moment it can: on PostgreSQL just before the purge
    # deletes (after any read of ids it made); on SQLite just before the purge's
    # BEGIN IMMEDIATE, which shuts every other writer out until it commits.
    trigger = "BEGIN IMMEDIATE" if backend == "sqlite" else "DELETE FROM outbox_email"
    interleaved: list[bool] = []
    fired: list[str] = []

    def retry_now(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith(trigger) and not fired:
            fired.append(statement)  # before: the retry's own statements pass through here
            interleaved.append(store.admin.retry_failed(retried))  # its own connection, commits

    sa.event.listen(store.engine, "before_cursor_execute", retry_now)
    try:
        if via == "dashboard":
            response = client.post(f"{PREFIX}/dead-letters/purge",
                                   data={"csrf_token": token, "confirm": "yes"})
            assert response.headers["Location"].endswith("notice=purged&n=1")
        else:
            result = dashboard.test_cli_runner().invoke(args=["outbox", "dlq", "purge",
                                                              "--yes"])
            assert result.exit_code == 0, result.output
            assert "deleted 1 dead letter(s)" in result.output
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", retry_now)
    assert interleaved == [True]
    by_id = {r["id"]: r for r in rows(dashboard)}
    assert purged not in by_id
    assert by_id[retried]["status"] == "queued"  # put back, so not deleted
    assert attachment_owners(dashboard) == [retried]  # and its attachment with it


def test_purge_older_than_counts_from_when_it_was_dead_lettered(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    old_but_fresh = dead_letter(dashboard, mail, smtp_server)
    legacy = dead_letter(dashboard, mail, smtp_server)
    t = email_table
    with dashboard.app_context(), test_db.engine.begin() as conn:
        long_ago = sa.literal(datetime(2000, 1, 1), sa.DateTime())
        # Created long ago, dead-lettered just now (a retry schedule of days).
        conn.execute(t.update().where(t.c.id == old_but_fresh).values(created_at=long_ago))
        # A row from before outbox_0002: no failed_at, counted from created_at.
        conn.execute(t.update().where(t.c.id == legacy).values(created_at=long_ago,
                                                               failed_at=None))
    response = client.post(f"{PREFIX}/dead-letters/purge", data={
        "csrf_token": csrf_token(client), "confirm": "yes", "older_than_days": "1"})
    assert response.headers["Location"].endswith("notice=purged&n=1")
    assert [r["id"] for r in rows(dashboard)] == [old_but_fresh]


def test_retry_all_is_one_update_and_keeps_each_keys_order(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("bad@example.com", 550, "5.7.1 Relay access denied")
    with dashboard.app_context():
        keyed = [mail.send(Message(f"keyed {n}", recipients=["bad@example.com"], body="x"),
                           key="customer-7") for n in range(3)]
        loose = [mail.send(Message(f"loose {n}", recipients=["bad@example.com"], body="x"))
                 for n in range(3)]
        test_db.session.commit()
    wait_rows(dashboard, lambda rs: len(rs) == 6 and all(r["status"] == "failed" for r in rs),
              timeout=20)
    smtp_server.reset_faults()
    smtp_server.hold()  # nothing is delivered until the statements are counted
    with dashboard.app_context():
        store: Store = mail._state().outbox().store
    statements: list[str] = []
    request_thread = threading.get_ident()  # the test client runs the request here

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if (threading.get_ident() == request_thread
                and statement.lstrip().upper().startswith(("UPDATE OUTBOX_EMAIL", "WITH C AS"))):
            statements.append(statement)

    token = csrf_token(client)
    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        response = client.post(f"{PREFIX}/dead-letters/retry-all", data={"csrf_token": token})
        requeued = [r for r in rows(dashboard) if r["status"] in ("queued", "sending")]
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    assert response.headers["Location"].endswith("notice=retried_all&n=6")
    # In the request: one UPDATE puts all six back, one more hands the key to its
    # oldest (delivery runs on its own thread), not one UPDATE per dead letter.
    assert len(statements) == 2, statements
    assert len(requeued) == 6
    heads = [r["id"] for r in requeued if r["key"] == "customer-7" and r["key_head"]]
    assert heads == [keyed[0]]  # one head per key: the oldest
    smtp_server.release()
    assert smtp_server.wait_for(6)
    wait_rows(dashboard, lambda rs: all(r["status"] == "sent" for r in rs), timeout=20)
    subjects = [m.data.split(b"Subject: ")[1].split(b"\r\n")[0].decode()
                for m in smtp_server.messages]
    assert [x for x in subjects if x.startswith("keyed")] == ["keyed 0", "keyed 1", "keyed 2"]
    assert sorted(subjects) == sorted([f"keyed {n}" for n in range(3)]
                                      + [f"loose {n}" for n in range(3)])
    assert loose  # sent too (above)


def test_retry_all_waits_for_a_key_whose_lock_a_producer_holds(
        pg_database: str | None, smtp_server: FaultSMTPServer) -> None:
    """PostgreSQL: "Retry all" only tries the keys' locks; a key a request is sending to
    right now (send() holds its lock until the request commits) is retried after it."""
    require_postgres()
    assert pg_database is not None
    app = make_app(empty_postgres(pg_database), MAIL_SERVER=smtp_server.host,
                   MAIL_PORT=smtp_server.port)
    engine = sa.create_engine(pg_database)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        smtp_server.refuse_recipient("bad@example.com", 550, "5.7.1 Relay access denied")
        with app.app_context():
            keyed = [mail.send(Message(f"keyed {n}", recipients=["bad@example.com"],
                                       body="x"), key="busy-key") for n in range(2)]
            loose = mail.send(Message("loose", recipients=["bad@example.com"], body="x"))
            test_db.session.commit()
        wait_rows(app, lambda rs: len(rs) == 3 and all(r["status"] == "failed" for r in rs),
                  timeout=20)
        smtp_server.reset_faults()
        retried: list[int] = []

        def retry_all() -> None:
            with app.app_context():
                retried.append(mail.retry_all())

        with engine.connect() as producer:
            producer.execute(sa.select(Postgres.producer_lock("busy-key")))  # a request mid-send()
            worker = threading.Thread(target=retry_all)
            worker.start()
            wait_rows(app, lambda rs: status_of(app, loose) != "failed", timeout=20)
            # The free rows went back at once; the held key's wait for its lock.
            assert [status_of(app, i) for i in keyed] == ["failed", "failed"]
            assert worker.is_alive()
            producer.rollback()  # the request ends
        worker.join(timeout=30)
        assert retried == [3]
        assert smtp_server.wait_for(3)
        wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=20)
        subjects = [m.parsed["Subject"] for m in smtp_server.messages]
        assert [x for x in subjects if x.startswith("keyed")] == ["keyed 0", "keyed 1"]
    finally:
        close_app(app, timeout=5)
        engine.dispose()


def test_cli_dlq_retry_all_puts_every_dead_letter_back(
        dashboard: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    first = dead_letter(dashboard, mail, smtp_server)
    second = dead_letter(dashboard, mail, smtp_server)
    result = dashboard.test_cli_runner().invoke(args=["outbox", "dlq", "retry", "--all"])
    assert result.exit_code == 0, result.output
    assert "2 email(s) queued again" in result.output
    assert {r["id"]: r["status"] for r in rows(dashboard)}[first] != "failed"
    assert status_of(dashboard, second) != "failed"


# --- OUTBOX_SCRUB_SENT -----------------------------------------------------------------


@pytest.mark.parametrize("scrub", [True, False])
def test_scrub_sent_drops_the_body_of_sent_rows_only(
        db_url: str, smtp_server: FaultSMTPServer, scrub: bool) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_SCRUB_SENT=scrub)
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix=PREFIX)
        (sent,) = send(app, mail, html="<p>secret</p>")
        assert smtp_server.wait_for(1)
        failed = dead_letter(app, mail, smtp_server)
        wait_rows(app, lambda rs: status_of(app, sent) == "sent", timeout=10)
        by_id = {r["id"]: r for r in rows(app)}
        assert by_id[sent]["status"] == "sent"
        assert (by_id[sent]["mime"] is None) is scrub
        assert by_id[failed]["mime"]  # a dead letter keeps its body: it can be retried
        assert b"secret" in smtp_server.messages[0].data  # delivered before it was dropped
        page = app.test_client().get(f"{PREFIX}/emails/{sent}").get_data(as_text=True)
        assert ('id="scrubbed"' in page) is scrub
        assert ("secret" in page) is not scrub
    finally:
        close_app(app, timeout=5)


def test_recording_sent_with_scrub_drops_the_mime_and_the_page_says_scrubbed(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    ids = send(dashboard, mail, count=3, later=True, html="<p>secret</p>")
    with dashboard.app_context():
        store = mail._state().outbox().store
        with store.write() as conn:
            conn.execute(email_table.update().values(due_at=store.now_expr()))
        claimed = store.leases.claim_ids(ids, owner="t", lease_seconds=30)
        recorded, lost, _ = store.leases.record(
            [Outcome(claimed[0], Status.SENT),
             Outcome(claimed[1], Status.SENT, error_code=550, error_message="one refused"),
             Outcome(claimed[2], Status.FAILED, error_code=550, error_message="refused")],
            scrub_sent=True)
    assert len(recorded) == 3 and not lost
    by_id = {r["id"]: r for r in rows(dashboard)}
    assert [by_id[i]["mime"] for i in ids[:2]] == [None, None]
    assert by_id[ids[2]]["mime"]  # a dead letter keeps its body: it can be retried
    page = client.get(f"{PREFIX}/emails/{ids[0]}").get_data(as_text=True)
    assert 'id="scrubbed"' in page and "secret" not in page
    page = client.get(f"{PREFIX}/emails/{ids[2]}").get_data(as_text=True)
    assert 'id="scrubbed"' not in page and "secret" in page


def test_a_reaped_row_whose_attempts_are_spent_gets_its_failed_at(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    (email_id,) = send(dashboard, mail, later=True)
    max_attempts = dashboard.config["OUTBOX_MAX_ATTEMPTS"]
    with dashboard.app_context():
        runtime = mail._state().outbox()
        store = runtime.store
        with store.write() as conn:
            conn.execute(email_table.update().values(due_at=store.now_expr()))
        assert store.leases.claim_ids([email_id], owner="gone", lease_seconds=30)
        with store.write() as conn:  # its last attempt; the process holding it died long ago
            conn.execute(email_table.update().values(
                attempts=max_attempts,
                lease_expires_at=sa.literal(datetime(2000, 1, 1), sa.DateTime())))
        assert store.leases.reap_expired().requeued == (email_id,)
        # The next claim finds no attempt left: dead-lettered, not sent.
        report = runtime.worker.deliver([email_id], timeout=30)
    assert report.failed == [email_id]
    (row,) = rows(dashboard)
    assert row["status"] == "failed" and row["failed_at"] is not None
    assert row["attempts"] == max_attempts and "attempts are spent" in row["last_error"]
    assert "1 dead-lettered" in client.get(f"{PREFIX}/").get_data(as_text=True)


def test_list_query_reads_one_row_more_to_know_about_the_next_page(
        app: Flask, mail: OutboxMail) -> None:
    ids = send(app, mail, count=3, later=True)
    with app.app_context():
        store: Store = mail._state().outbox().store
    with store.read() as conn:
        full = list_emails(conn, limit=3)
        short = list_emails(conn, limit=2)
        rest = list_emails(conn, limit=2, cursor=short.next_cursor)
    assert [r.id for r in full.rows] == ids[::-1] and full.next_cursor is None
    assert [r.id for r in short.rows] == ids[:0:-1]
    assert short.next_cursor == {"before": str(ids[1])}
    assert [r.id for r in rest.rows] == [ids[0]] and rest.next_cursor is None
