"""The dashboard's delivery events and suppression list, through Flask's test client.

On SQLite and PostgreSQL: the email page's events table (newest last, escaped,
one query however many); the list filtered by each email's LATEST event
(greatest ``(occurred_at, id)``: a ``deferred`` followed by ``delivered`` shows
under delivered only), alone and with the status filter and the search, paged
by keyset, through the ``ix_outbox_event_*`` indexes; the ``suppressed`` status
in the overview's counts and the status filter; the suppression page (keyset
pages by address, a prefix search, add and remove), whose actions refuse a
missing or foreign CSRF token and a bad address, writing nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import db as test_db
from conftest import query_plan, rows, wait_rows
from dashboard_helpers import Gate
from flask import Flask
from flask.testing import FlaskClient
from smtpserver import FaultSMTPServer

from flask_mail_outbox import DeliveryEvent, Message, OutboxMail
from flask_mail_outbox.core import event_table, suppression_table
from flask_mail_outbox.core._store import Store

PREFIX = "/outbox"
PAGE_SIZE = 20
XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
T0 = datetime(2030, 1, 1, 12, 0, 0)


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def dashboard(app: Flask, mail: OutboxMail, gate: Gate) -> Flask:
    """The conftest app (SMTP to the test server) with the dashboard under /outbox."""
    app.register_blueprint(mail.dashboard_blueprint(authorize=gate, page_size=PAGE_SIZE),
                           url_prefix=PREFIX)
    return app


@pytest.fixture
def client(dashboard: Flask) -> FlaskClient:
    return dashboard.test_client()


def send(app: Flask, mail: OutboxMail, count: int = 1, **fields: Any) -> list[int]:
    """Queue ``count`` emails due tomorrow (they stay queued: events are all that happens)."""
    ids = []
    with app.app_context():
        for n in range(count):
            values: dict[str, Any] = {"subject": f"Hello {n}",
                                      "recipients": [f"user{n}@example.com"], "body": "hi"}
            values.update(fields)
            ids.append(mail.send(Message(**values), send_after=timedelta(days=1)))
        test_db.session.commit()
    return ids


def record(app: Flask, mail: OutboxMail, email_id: int | None, event_type: str,
           minutes: float, **fields: Any) -> DeliveryEvent:
    """An event of ``email_id``, ``minutes`` after T0, recorded through the public API."""
    with app.app_context():
        event = mail.record_event(event_type, email_id=email_id,
                                  occurred_at=T0 + timedelta(minutes=minutes), **fields)
    assert event is not None
    return event


def csrf_token(client: FlaskClient) -> str:
    page = client.get(f"{PREFIX}/suppressions").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert match is not None, "the page has no CSRF field"
    return match.group(1)


class _Cells(HTMLParser):
    """The text of every cell of every ``<table class=...>`` row, per table class."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def table(html: str, css_class: str) -> list[list[str]]:
    parser = _Cells()
    parser.feed(html)
    return parser.tables.get(css_class, [])


def next_link(html: str) -> str | None:
    match = re.search(r'<a rel="next" href="([^"]+)"', html)
    return None if match is None else match.group(1).replace("&amp;", "&")


def walk_emails(client: FlaskClient, url: str) -> list[int]:
    """Follow "Next page" from ``url``; every email id listed, in order."""
    seen: list[int] = []
    next_url: str | None = url
    for _ in range(100):
        if next_url is None:
            return seen
        response = client.get(next_url)
        assert response.status_code == 200, response.get_data(as_text=True)
        page = response.get_data(as_text=True)
        seen += [int(m) for m in re.findall(r'<td class="num"><a href="[^"]*/emails/(\d+)"',
                                            page)]
        next_url = next_link(page)
    raise AssertionError("pagination does not end")


def walk_suppressions(client: FlaskClient, url: str) -> list[str]:
    seen: list[str] = []
    next_url: str | None = url
    for _ in range(100):
        if next_url is None:
            return seen
        response = client.get(next_url)
        assert response.status_code == 200, response.get_data(as_text=True)
        page = response.get_data(as_text=True)
        seen += [r[0] for r in table(page, "suppressions") if len(r) > 1]
        next_url = next_link(page)
    raise AssertionError("pagination does not end")


def suppression_rows(app: Flask) -> list[dict[str, Any]]:
    with app.app_context(), test_db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            suppression_table.select().order_by(suppression_table.c.address)).mappings()]


def store_of(app: Flask, mail: OutboxMail) -> Store:
    with app.app_context():
        store: Store = mail._state().outbox().store
    return store


# --- the email page's events -------------------------------------------------------------


def test_the_email_page_shows_its_events_newest_last_and_escaped(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    email_id, quiet = send(dashboard, mail, count=2)
    # Recorded out of order: the table follows occurred_at, not arrival.
    record(dashboard, mail, email_id, "bounced", 10, bounce_kind="permanent",
           recipient="user0@example.com", transport="postmark", provider_event_id="b-1",
           description=f"Hard bounce {XSS}", mta_response="550 5.1.1 <user0@example.com>: "
                                                        "Recipient address rejected")
    record(dashboard, mail, email_id, "deferred", 1, recipient="user0@example.com",
           transport="postmark", description="Greylisted",
           mta_response="451 4.7.1 Try again later")
    record(dashboard, mail, email_id, "delivered", 5, recipient="user0@example.com")

    page = client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True)
    assert "<h2>Delivery events</h2>" in page
    assert table(page, "events") == [
        ["2030-01-01 12:01:00", "deferred", "user0@example.com", "postmark",
         "Greylisted451 4.7.1 Try again later"],
        ["2030-01-01 12:05:00", "delivered", "user0@example.com", "app", ""],
        # The reason read from the reply, and the suppression policy's verdict.
        ["2030-01-01 12:10:00", "bounced (permanent) user_unknown",
         "user0@example.comsuppressed for good", "postmark",
         f"Hard bounce {XSS}550 5.1.1 <user0@example.com>: Recipient address rejected"],
    ]
    assert "<script" not in page and f"Hard bounce {ESCAPED}" in page
    assert "550 5.1.1 &lt;user0@example.com&gt;: Recipient" in page
    # An email nothing happened to after the hand-off has no such section at all.
    page = client.get(f"{PREFIX}/emails/{quiet}").get_data(as_text=True)
    assert "Delivery events" not in page and 'class="events"' not in page


def test_the_email_page_reads_its_events_in_one_query_without_payloads(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    (email_id,) = send(dashboard, mail)
    for n in range(30):
        record(dashboard, mail, email_id, "opened", n, payload={"big": "x" * 1000})
    store = store_of(dashboard, mail)
    statements: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "outbox_event" in statement:
            statements.append(statement)

    client.get(f"{PREFIX}/emails/{email_id}")  # connects first
    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        page = client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True)
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    assert len(table(page, "events")) == 30
    assert len(statements) == 1, statements  # not one per event
    assert "payload" not in statements[0]  # 64 KiB each at most, and no page shows it


def test_the_email_page_shows_the_newest_events_of_a_very_busy_email(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flask_mail_outbox.core import _queries

    monkeypatch.setattr(_queries, "EVENTS_SHOWN", 5)
    (email_id,) = send(dashboard, mail)
    for n in range(8):
        record(dashboard, mail, email_id, "clicked", n, description=f"click {n}")
    page = client.get(f"{PREFIX}/emails/{email_id}").get_data(as_text=True)
    assert [r[4] for r in table(page, "events")] == [f"click {n}" for n in range(3, 8)]
    assert "Only the latest 5 are shown" in page


# --- the list by latest event ---------------------------------------------------------------


def test_the_list_filters_by_each_emails_latest_event(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    (recovered, opened, waiting, silent, tie, late_news, bounced) = send(
        dashboard, mail, count=7)
    record(dashboard, mail, recovered, "deferred", 1)
    record(dashboard, mail, recovered, "delivered", 2)
    record(dashboard, mail, opened, "delivered", 1)
    record(dashboard, mail, opened, "opened", 3)
    record(dashboard, mail, opened, "opened", 4)  # twice: listed once
    record(dashboard, mail, waiting, "deferred", 1)
    record(dashboard, mail, waiting, "deferred", 2)
    # The same moment: the later id is the latest.
    record(dashboard, mail, tie, "deferred", 5)
    record(dashboard, mail, tie, "delivered", 5)
    # Arrived last, happened first: occurred_at decides, not arrival.
    record(dashboard, mail, late_news, "delivered", 9)
    record(dashboard, mail, late_news, "deferred", 8)
    record(dashboard, mail, bounced, "bounced", 1, bounce_kind="transient")
    # Events naming no email, or one that no longer exists, list nothing.
    record(dashboard, mail, None, "delivered", 1, message_id="<nobody@example.com>")
    record(dashboard, mail, 10**12, "delivered", 1)

    def listed(query: str) -> list[int]:
        return walk_emails(client, f"{PREFIX}/emails?{query}")

    assert listed("event=delivered") == [late_news, tie, recovered]
    assert listed("event=deferred") == [waiting]
    assert listed("event=opened") == [opened]
    assert listed("event=bounced") == [bounced]
    assert listed("event=complained") == []
    assert sorted(listed("")) == sorted([recovered, opened, waiting, silent, tie, late_news,
                                         bounced])
    # With the status filter and the search.
    assert listed("status=queued&event=delivered") == [late_news, tie, recovered]
    assert listed("status=sent&event=delivered") == []
    assert listed("event=delivered&field=recipient&q=USER0") == [recovered]
    assert listed("event=delivered&field=subject&q=hello") == [recovered, tie, late_news]
    assert listed("event=deferred&field=subject&q=hello+2") == [waiting]
    assert listed("event=deferred&field=subject&q=hello+3") == []  # silent: no events
    page = client.get(f"{PREFIX}/emails?event=delivered").get_data(as_text=True)
    assert '<option value="delivered" selected>delivered</option>' in page
    assert "latest delivery event is <strong>delivered</strong>" in page
    for bad in ("nope", "DELIVERED", "delivered%00"):
        assert client.get(f"{PREFIX}/emails?event={bad}").status_code == 400


def test_the_latest_event_filter_pages_by_keyset(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    ids = send(dashboard, mail, count=50)
    delivered = []
    for n, email_id in enumerate(ids):
        record(dashboard, mail, email_id, "deferred", 1)
        if n % 5:  # one in five stays deferred
            record(dashboard, mail, email_id, "delivered", 2)
            delivered.append(email_id)
    walked = walk_emails(client, f"{PREFIX}/emails?event=delivered")
    assert walked == sorted(delivered, reverse=True)  # each once, newest first
    assert len(walked) == 40 and len(walked) > 2 * PAGE_SIZE - 1  # three pages
    assert walk_emails(client, f"{PREFIX}/emails?event=deferred") == sorted(
        set(ids) - set(delivered), reverse=True)
    # The next page's link keeps the filter.
    page = client.get(f"{PREFIX}/emails?event=delivered").get_data(as_text=True)
    link = next_link(page)
    assert link is not None and "event=delivered" in link and "before=" in link
    assert 'id="partial-page"' not in page  # full: no word about the walk's budget


def test_a_rare_match_gives_short_pages_never_a_long_walk(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail, backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flask_mail_outbox._operator.dashboard import _views
    from flask_mail_outbox.core import _queries

    # Emails walked a page, at most: the reader's own bound and what the page asks for.
    monkeypatch.setattr(_queries, "EVENT_SCAN_BUDGET", 4)
    monkeypatch.setattr(_views, "EVENT_SCAN_BUDGET", 4)
    ids = send(dashboard, mail, count=12)
    still_deferred = []
    for n, email_id in enumerate(ids):
        record(dashboard, mail, email_id, "deferred", 1)
        if n % 4:
            record(dashboard, mail, email_id, "delivered", 2)
        else:
            still_deferred.append(email_id)
    pages = []
    next_url: str | None = f"{PREFIX}/emails?event=deferred"
    while next_url is not None:
        page = client.get(next_url).get_data(as_text=True)
        pages.append(page)
        next_url = next_link(page)
        assert len(pages) < 10
    # One match in each stretch of four: a short page each, and every match once.
    shown = [[int(m) for m in re.findall(r'<td class="num"><a href="[^"]*/emails/(\d+)"', p)]
             for p in pages]
    assert [x for page in shown for x in page] == sorted(still_deferred, reverse=True)
    assert shown[:3] == [[i] for i in sorted(still_deferred, reverse=True)]
    assert all('id="partial-page"' in p and "looked at 4 emails with a <strong>deferred"
               in p for p in pages[:3])
    assert all(x == [] and 'id="partial-page"' not in p for x, p in zip(shown[3:], pages[3:],
                                                                        strict=True))


def test_the_latest_event_filter_reads_the_event_indexes(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail, backend: str) -> None:
    ids = send(dashboard, mail, count=3)
    for email_id in ids:
        record(dashboard, mail, email_id, "deferred", 1)
        record(dashboard, mail, email_id, "delivered", 2)
    store = store_of(dashboard, mail)
    executed: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "outbox_event" in statement and "outbox_email" in statement:
            executed.append((statement, parameters))

    client.get(f"{PREFIX}/emails")  # connects first
    sa.event.listen(store.engine, "before_cursor_execute", note)
    try:
        for query in ("event=delivered", "event=delivered&status=queued",
                      f"event=delivered&before={ids[-1]}"):
            assert client.get(f"{PREFIX}/emails?{query}").status_code == 200
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", note)
    assert len(executed) == 3, executed  # one statement per page
    for statement, parameters in executed:
        assert "OFFSET" not in statement.upper() or backend == "sqlite"
        plan = query_plan(store.engine, statement, parameters)
        # The candidates from (event_type, email_id), the latest from (email_id,
        # occurred_at, id), the rows by primary key: never a whole table, never a sort.
        assert "ix_outbox_event_type" in plan, plan
        assert "ix_outbox_event_email" in plan, plan
        # Each email read by its primary key (not, for each candidate, every row of
        # the status through its index).
        assert ("pk_outbox_email" if backend == "postgresql"
                else "outbox_email USING INTEGER PRIMARY KEY") in plan, plan
        assert "ix_outbox_email_status_id" not in plan, plan
        assert "Seq Scan" not in plan and "Sort" not in plan, plan
        assert not re.search(r"SCAN (outbox_event|outbox_email|ev|e)\b(?! USING)", plan), plan
        assert "TEMP B-TREE" not in plan, plan


# --- the suppressed status ----------------------------------------------------------------


def test_the_overview_and_the_status_filter_know_suppressed(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail,
        smtp_server: FaultSMTPServer) -> None:
    with dashboard.app_context():
        mail.suppress("gone@example.com")
        suppressed = mail.send(Message("Bye", recipients=["gone@example.com"], body="x"))
        test_db.session.commit()
    wait_rows(dashboard, lambda rs: rs[0]["status"] == "suppressed", timeout=10)
    send(dashboard, mail)  # one queued
    assert smtp_server.messages == []  # the server was never asked
    page = client.get(f"{PREFIX}/").get_data(as_text=True)
    assert '<span class="count" id="count-suppressed">1</span>' in page
    assert '<span class="count" id="count-queued">1</span>' in page
    assert f'href="{PREFIX}/emails?status=suppressed"' in page
    page = client.get(f"{PREFIX}/emails").get_data(as_text=True)
    assert '<option value="suppressed">suppressed</option>' in page
    assert walk_emails(client, f"{PREFIX}/emails?status=suppressed") == [suppressed]
    page = client.get(f"{PREFIX}/emails/{suppressed}").get_data(as_text=True)
    assert '<span class="status status-suppressed">suppressed</span>' in page


# --- the suppression page ---------------------------------------------------------------------


def test_the_suppression_page_is_in_the_navigation_and_behind_the_gate(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail, gate: Gate) -> None:
    page = client.get(f"{PREFIX}/").get_data(as_text=True)
    assert f'<a href="{PREFIX}/suppressions">Suppressions</a>' in page
    token = csrf_token(client)
    gate.open = False
    assert client.get(f"{PREFIX}/suppressions").status_code == 403
    for action in ("add", "remove"):
        response = client.post(f"{PREFIX}/suppressions/{action}",
                               data={"csrf_token": token, "address": "a@example.com"})
        assert response.status_code == 403
    assert suppression_rows(dashboard) == []


def test_add_shows_and_remove_takes_off_an_address(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    token = csrf_token(client)
    response = client.post(f"{PREFIX}/suppressions/add",
                           data={"csrf_token": token, "address": "  Alice@Example.COM "})
    assert response.status_code == 303
    location = response.headers["Location"]
    # The list, searched for the entry just written (as it is kept: lower case).
    assert location.endswith("/suppressions?notice=suppressed&q=alice@example.com")
    page = client.get(location).get_data(as_text=True)
    assert "Address added to the suppression list" in page
    ((address, reason, source, since, expires, _),) = table(page, "suppressions")
    assert (address, reason, source, expires) == ("alice@example.com", "manual", "dashboard",
                                                   "—")
    with dashboard.app_context():
        entry = mail.suppression("alice@example.com")
    assert entry is not None and entry.reason == "manual" and entry.source == "dashboard"
    assert since == f"{entry.created_at:%Y-%m-%d %H:%M:%S}"

    # Again, with another reason: the entry is replaced, and the page says so.
    response = client.post(f"{PREFIX}/suppressions/add", data={
        "csrf_token": token, "address": "alice@example.com", "reason": "complained"})
    assert "notice=resuppressed" in response.headers["Location"]
    assert [(r["address"], r["reason"]) for r in suppression_rows(dashboard)] == [
        ("alice@example.com", "complained")]
    assert client.post(f"{PREFIX}/suppressions/add", data={
        "csrf_token": token, "address": "b@example.com",
        "reason": "forever"}).status_code == 400
    assert len(suppression_rows(dashboard)) == 1

    # Remove: the row's own form, which keeps the operator's search.
    page = client.get(f"{PREFIX}/suppressions?q=ali").get_data(as_text=True)
    form = re.search(r'<form method="post" action="([^"]+)" class="inline danger">(.*?)</form>',
                     page, re.DOTALL)
    assert form is not None and form.group(1) == f"{PREFIX}/suppressions/remove"
    fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(2)))
    assert fields == {"csrf_token": token, "address": "alice@example.com", "q": "ali"}
    response = client.post(form.group(1), data=fields)
    assert response.status_code == 303
    assert response.headers["Location"].endswith("/suppressions?notice=unsuppressed&q=ali")
    assert suppression_rows(dashboard) == []
    page = client.get(response.headers["Location"]).get_data(as_text=True)
    assert "taken off the suppression list" in page and "No addresses here." in page
    # Removing it again changes nothing and says so.
    response = client.post(form.group(1), data=fields)
    assert "notice=not_suppressed" in response.headers["Location"]


def test_the_suppression_list_pages_by_address_and_searches_by_prefix(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    addresses = [f"user{n}@example.com" for n in range(45)] + ["other@example.org"]
    with dashboard.app_context():
        for address in addresses:
            mail.suppress(address)
        # An entry that has expired is no longer on the list, nor on the page.
        mail.suppress("old@example.com", expires_at=datetime(2000, 1, 1))
    walked = walk_suppressions(client, f"{PREFIX}/suppressions")
    assert walked == sorted(addresses)  # each once, by address, 20 a page
    page = client.get(f"{PREFIX}/suppressions").get_data(as_text=True)
    assert '<span id="suppression-total">46</span>' in page
    assert walk_suppressions(client, f"{PREFIX}/suppressions?q=USER1") == sorted(
        a for a in addresses if a.startswith("user1"))
    assert walk_suppressions(client, f"{PREFIX}/suppressions?q=nobody") == []
    link = next_link(client.get(f"{PREFIX}/suppressions?q=user").get_data(as_text=True))
    assert link is not None and "q=user" in link and "after=" in link
    for bad in ("q=%00", "after=a%00", "q=" + "x" * 321):
        assert client.get(f"{PREFIX}/suppressions?{bad}").status_code == 400


def test_a_bad_address_is_refused_with_the_reason_and_nothing_is_written(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    token = csrf_token(client)
    for address in ("not an address", "", f"{XSS}@example.com", "a@b@example.com",
                    "x" * 70 + "@example.com"):
        response = client.post(f"{PREFIX}/suppressions/add",
                               data={"csrf_token": token, "address": address,
                                     "reason": "bounced"})
        assert response.status_code == 400, address
        page = response.get_data(as_text=True)
        error = re.search(r'<p class="problem" role="alert" id="suppression-error">(.*?)</p>',
                          page, re.DOTALL)
        assert error is not None, page
        assert error.group(1).startswith("Not added: ")
        assert "is not an email address" in error.group(1)
        assert "<script" not in page
        # What was typed stays in the form, escaped, with the reason chosen.
        assert 'name="address" value="' + address.replace("<", "&lt;").replace(
            ">", "&gt;") + '"' in page
        assert '<option value="bounced" selected>bounced</option>' in page
    assert client.post(f"{PREFIX}/suppressions/add", data={
        "csrf_token": token, "address": "a\x00@example.com"}).status_code == 400
    # Removing takes any text (a provider may have reported a malformed address).
    response = client.post(f"{PREFIX}/suppressions/remove",
                           data={"csrf_token": token, "address": "not an address"},
                           follow_redirects=True)
    assert response.status_code == 200
    assert "is not on the suppression list" in response.get_data(as_text=True)
    assert suppression_rows(dashboard) == []


def test_suppression_actions_refuse_a_missing_or_foreign_csrf_token(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    with dashboard.app_context():
        mail.suppress("kept@example.com")
    token = csrf_token(client)
    foreign = csrf_token(dashboard.test_client())
    assert foreign != token
    before = suppression_rows(dashboard)
    for action, address in (("add", "new@example.com"), ("remove", "kept@example.com")):
        for form in ({}, {"csrf_token": ""}, {"csrf_token": "x" * 43},
                     {"csrf_token": foreign}):
            response = client.post(f"{PREFIX}/suppressions/{action}",
                                   data={**form, "address": address})
            assert response.status_code == 400, (action, form)
            assert "CSRF" in response.get_data(as_text=True)
    assert suppression_rows(dashboard) == before
    # GET is no way around it.
    assert client.get(f"{PREFIX}/suppressions/add?address=new@example.com").status_code == 405
    assert suppression_rows(dashboard) == before


def test_the_suppression_page_escapes_what_providers_and_apps_wrote(
        dashboard: Flask, client: FlaskClient, mail: OutboxMail) -> None:
    with dashboard.app_context():
        mail.suppress("o'brien&co@example.com", "bounced", source=f"webhook {XSS}")
    page = client.get(f"{PREFIX}/suppressions").get_data(as_text=True)
    assert "<script" not in page
    assert f"webhook {ESCAPED}" in page
    assert "o&#39;brien&amp;co@example.com" in page


@pytest.fixture
def events_rows(dashboard: Flask) -> Iterator[Any]:
    def read() -> list[dict[str, Any]]:
        with dashboard.app_context(), test_db.engine.connect() as conn:
            return [dict(r) for r in conn.execute(event_table.select()).mappings()]
    yield read


def test_pages_change_nothing(dashboard: Flask, client: FlaskClient, mail: OutboxMail,
                              events_rows: Any) -> None:
    (email_id,) = send(dashboard, mail)
    record(dashboard, mail, email_id, "bounced", 1, bounce_kind="permanent",
           recipient="user0@example.com", reason="user_unknown")
    before = (rows(dashboard), events_rows(), suppression_rows(dashboard))
    assert [r["address"] for r in before[2]] == ["user0@example.com"]  # the bounce's doing
    for url in (f"/emails/{email_id}", "/emails?event=bounced", "/suppressions",
                "/suppressions?q=user", "/"):
        assert client.get(PREFIX + url).status_code == 200
    assert (rows(dashboard), events_rows(), suppression_rows(dashboard)) == before


def test_a_queued_email_can_be_cancelled_from_its_page(make_apps: Any) -> None:
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                          TESTING=True)
    app.register_blueprint(mail.dashboard_blueprint(lambda: True), url_prefix="/outbox")
    with app.app_context():
        email_id = mail.send(Message("Later", ["a@example.com"], "x"),
                             send_after=timedelta(days=1))
        test_db.session.commit()
    client = app.test_client()
    page = client.get(f"/outbox/emails/{email_id}").get_data(as_text=True)
    assert "Cancel this email" in page
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token is not None
    response = client.post(f"/outbox/emails/{email_id}/cancel",
                           data={"csrf_token": token.group(1)}, follow_redirects=True)
    assert response.status_code == 200
    text = response.get_data(as_text=True)
    assert "Email cancelled" in text and "Cancel this email" not in text
    assert rows(app)[0]["status"] == "cancelled"
    # Again: nothing to cancel, and the page says so.
    response = client.post(f"/outbox/emails/{email_id}/cancel",
                           data={"csrf_token": token.group(1)}, follow_redirects=True)
    assert "is not queued" in response.get_data(as_text=True)
