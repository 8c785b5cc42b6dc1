"""The development inbox: the ``mailbox`` transport and the dashboard's Mailbox pages.

On SQLite and PostgreSQL, through the real delivery path (claim, transport, record):
a message delivered by the ``mailbox`` transport lands in ``outbox_mailbox`` with the
exact bytes, in the transaction that records it sent; one delivered by another
transport does not. Then the pages through Flask's test client: the list (newest
first), a message (the html only in a sandboxed frame, with the preview's CSP), the
attachments and the ``.eml`` byte-exact as downloads with a safe file name, "Clear
mailbox" behind the CSRF token, and every route behind ``authorize``.
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, make_app, poll, rows
from conftest import db as test_db
from dashboard_helpers import Gate
from flask import Flask
from flask.testing import FlaskClient
from markupsafe import escape
from test_dkim import dkim_config, key_pair, verifies  # noqa: F401 - key_pair: a fixture

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._flask.state import app_state
from flask_mail_outbox._operator.dashboard import (
    CONTENT_SECURITY_POLICY,
    PREVIEW_CONTENT_SECURITY_POLICY,
)
from flask_mail_outbox._operator.dashboard._mailbox import safe_filename
from flask_mail_outbox.core import email_table
from flask_mail_outbox.core._models import mailbox_table
from flask_mail_outbox.transports import MailboxTransport

PREFIX = "/outbox"
# Every byte value, and a CRLF a text conversion would change: byte-exact or not.
BINARY = bytes(range(256)) * 3 + b"\r\n\n\r end"
HTML = ('<html><body><h1 style="color: #c00">Welcome</h1><p>Hi <b>Ann</b></p>'
        "<script>parent.document.title='owned'</script></body></html>")


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def app(db_url: str, gate: Gate) -> Iterator[Flask]:
    """An app whose default transport is the mailbox, with the dashboard at /outbox."""
    app = make_app(db_url, OUTBOX_TRANSPORT="mailbox")
    mail: OutboxMail = app.extensions["test_mail"]
    app.register_blueprint(mail.dashboard_blueprint(authorize=gate, page_size=2),
                           url_prefix=PREFIX)
    yield app
    close_app(app)


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def send(app: Flask, **fields: Any) -> int:
    """Queue one email, commit, wait until it is recorded sent; its id."""
    mail: OutboxMail = app.extensions["test_mail"]
    values: dict[str, Any] = {"subject": "Welcome, Ann", "recipients": ["Ann <ann@example.com>"],
                              "body": "Hello Ann,\nwelcome.", "html": HTML}
    values.update(fields)
    message = Message(**values)
    if "attach" not in fields:
        message.attach("report.bin", "application/octet-stream", BINARY)
    with app.app_context():
        email_id = mail.send(message)
        test_db.session.commit()
    poll(lambda: rows(app), lambda rs: any(r["id"] == email_id and r["status"] == "sent"
                                           for r in rs), timeout=10)
    return email_id


def mailbox_rows(app: Flask) -> list[dict[str, Any]]:
    with app.app_context(), test_db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            mailbox_table.select().order_by(mailbox_table.c.id)).mappings()]


def email_row(app: Flask, email_id: int) -> dict[str, Any]:
    with app.app_context(), test_db.engine.connect() as conn:
        return dict(conn.execute(email_table.select().where(email_table.c.id == email_id))
                    .mappings().one())


def csrf_token(client: FlaskClient) -> str:
    page = client.get(f"{PREFIX}/mailbox").get_data(as_text=True)
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


# --- the transport and the table ---------------------------------------------------------


def test_a_delivered_message_lands_in_the_mailbox_with_its_exact_bytes(app: Flask) -> None:
    email_id = send(app)
    row = email_row(app, email_id)
    [kept] = poll(lambda: mailbox_rows(app), timeout=5)
    assert row["status"] == "sent" and row["attempts"] == 1
    assert kept["email_id"] == email_id
    # The bytes handed to the transport, as the outbox built them.
    assert bytes(kept["mime"]) == bytes(row["mime"]) and kept["size"] == len(row["mime"])
    assert BINARY not in bytes(kept["mime"])  # base64 in the MIME: decoded only on download
    assert kept["message_id"] == row["message_id"]
    assert kept["sender"] == "sender@example.com"
    assert json.loads(kept["recipients"]) == ["ann@example.com"]
    assert (kept["header_from"], kept["header_to"], kept["subject"]) == (
        "Sender <sender@example.com>", "Ann <ann@example.com>", "Welcome, Ann")
    assert kept["received_at"] is not None
    # Written with the outcome, then let go: the transport holds nothing afterwards.
    with app.app_context():
        [transport] = list(app_state().outbox().transports.values())
    assert isinstance(transport, MailboxTransport)
    assert transport.held(email_id) is None


def test_mail_through_another_transport_is_not_kept(db_url: str) -> None:
    app = make_app(db_url, OUTBOX_TRANSPORT="null",
                   OUTBOX_TRANSPORTS={"dev": {"transport": "mailbox"}})
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            dropped = mail.send(Message("to null", recipients=["a@example.com"], body="x"))
            kept = mail.send(Message("to the mailbox", recipients=["b@example.com"], body="y"),
                             transport="dev")
            test_db.session.commit()
        poll(lambda: rows(app), lambda rs: len(rs) == 2 and all(r["status"] == "sent"
                                                                for r in rs), timeout=10)
        found = poll(lambda: mailbox_rows(app), timeout=5)
        assert [(r["email_id"], r["subject"]) for r in found] == [(kept, "to the mailbox")]
        assert dropped not in [r["email_id"] for r in found]
    finally:
        close_app(app)


@pytest.mark.parametrize("place", ["primary", "backup"])
def test_a_mailbox_in_a_failover_chain_keeps_what_it_delivered(db_url: str, place: str) -> None:
    # A port nothing listens on: the SMTP server is down, a transport fault.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    down = {"transport": "smtp", "MAIL_SERVER": "127.0.0.1", "MAIL_PORT": closed_port,
            "MAIL_TIMEOUT": 2}
    # The primary of a chain is wrapped (it has no name of its own); a backup is a named entry.
    chain = ({"default": {"transport": "mailbox", "failover": ["spare"]}, "spare": down}
             if place == "primary" else
             {"default": {**down, "failover": ["dev"]}, "dev": {"transport": "mailbox"}})
    app = make_app(db_url, OUTBOX_TRANSPORTS=chain)
    try:
        email_id = send(app)
        [kept] = poll(lambda: mailbox_rows(app), timeout=5)
        assert kept["email_id"] == email_id
        assert bytes(kept["mime"]) == bytes(email_row(app, email_id)["mime"])
    finally:
        close_app(app)


# --- the pages -------------------------------------------------------------------------


def test_the_list_shows_newest_first_and_pages_back(app: Flask, client: FlaskClient) -> None:
    for n in range(3):
        send(app, subject=f"Message {n}", recipients=[f"user{n}@example.com"])
    response = client.get(f"{PREFIX}/mailbox")
    page = response.get_data(as_text=True)
    assert response.status_code == 200
    assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert 'aria-current="page">Mailbox</a>' in page
    # page_size=2: the two newest, newest first, then a link to the older one.
    assert page.index("Message 2") < page.index("Message 1")
    assert "Message 0" not in page
    assert "user2@example.com" in page and "Sender &lt;sender@example.com&gt;" in page
    older = re.search(r'<a rel="next" href="([^"]+)"', page)
    assert older, page
    rest = client.get(older.group(1).replace("&amp;", "&")).get_data(as_text=True)
    assert "Message 0" in rest and "Message 1" not in rest and 'rel="next"' not in rest


def test_a_message_page_shows_html_sandboxed_text_headers_and_attachments(
        app: Flask, client: FlaskClient) -> None:
    send(app, subject="<i>Hi</i> & welcome")
    [kept] = mailbox_rows(app)
    response = client.get(f"{PREFIX}/mailbox?message={kept['id']}")
    page = response.get_data(as_text=True)
    assert response.status_code == 200
    # The html exists only as the srcdoc of a sandboxed frame (no allow-scripts), escaped.
    assert "<script>" not in page and "<h1 style" not in page, page[page.find("<script>") - 300:]
    frame = re.search(r"<iframe [^>]*>", page)
    assert frame and " sandbox " in frame.group(0) and "allow-" not in frame.group(0)
    assert f'srcdoc="{escape(HTML)}' in page
    # Its inlined styles apply: the preview's policy (inline styles, still no script).
    assert response.headers["Content-Security-Policy"] == PREVIEW_CONTENT_SECURITY_POLICY
    assert '<pre class="text-body">Hello Ann,\nwelcome.' in page.replace("\r\n", "\n")
    assert "&lt;i&gt;Hi&lt;/i&gt; &amp; welcome" in page and "<i>Hi</i>" not in page
    assert "<th>Message-ID</th>" in page and "<th>Content-Type</th>" in page
    assert f"/outbox/mailbox?message={kept['id']}&amp;download=0" in page
    assert "report.bin" in page
    assert f"/outbox/mailbox?message={kept['id']}&amp;download=eml" in page
    assert f"/outbox/emails/{kept['email_id']}" in page


def test_attachments_and_the_eml_download_byte_exact_and_never_render(
        app: Flask, client: FlaskClient) -> None:
    message_fields: dict[str, Any] = {"attach": True}
    mail_message = Message("files", recipients=["ann@example.com"], body="see attached")
    mail_message.attach("report.bin", "application/octet-stream", BINARY)
    mail_message.attach('../../etc/"pass\\wd".html', "text/html", "<script>alert(1)</script>")
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        email_id = mail.send(mail_message)
        test_db.session.commit()
    del message_fields
    poll(lambda: rows(app), lambda rs: rs and rs[0]["status"] == "sent", timeout=10)
    [kept] = poll(lambda: mailbox_rows(app), timeout=5)
    assert kept["email_id"] == email_id
    base = f"{PREFIX}/mailbox?message={kept['id']}"

    first = client.get(f"{base}&download=0")
    assert first.status_code == 200 and first.get_data() == BINARY
    assert first.headers["Content-Disposition"] == "attachment; filename=report.bin"
    assert first.headers["Content-Type"] == "application/octet-stream"

    second = client.get(f"{base}&download=1")
    assert second.get_data() == b"<script>alert(1)</script>"
    # An html attachment is a download, never a page of the dashboard's origin.
    assert second.headers["Content-Type"] == "application/octet-stream"
    disposition = second.headers["Content-Disposition"]
    assert disposition.startswith("attachment;") and "/" not in disposition
    assert "\\" not in disposition and disposition.count('"') in (0, 2)
    assert client.get(f"{base}&download=2").status_code == 404

    raw = client.get(f"{base}&download=eml")
    assert raw.status_code == 200 and raw.get_data() == bytes(kept["mime"])
    assert raw.headers["Content-Disposition"] == f"attachment; filename=mailbox-{kept['id']}.eml"
    assert raw.headers["Content-Type"] == "message/rfc822"
    assert raw.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(("name", "safe"), [
    ("report.pdf", "report.pdf"),
    ("../../etc/passwd", "etc_passwd"),
    ('a"b\\c:d*e?f<g>h|i', "a_b_c_d_e_f_g_h_i"),
    ("line\r\nbreak\x00.txt", "line break�.txt"),
    (".hidden", "hidden"),
    ("", "attachment-3"),
    (None, "attachment-3"),
    ("ünïcødé.txt", "ünïcødé.txt"),
])
def test_download_names_are_made_safe(name: str | None, safe: str) -> None:
    assert safe_filename(name, 2) == safe


def test_download_names_cannot_disguise_their_type() -> None:
    # A right-to-left override shows "invoice\u202egpj.exe" as "invoiceexe.jpg": the format
    # characters go, so the name reads as the type it is.
    assert safe_filename("invoice\u202egpj.exe", 0) == "invoicegpj.exe"
    assert safe_filename("a\u200bb\u2066c\ufeff.txt", 0) == "abc.txt"
    # A long name is cut in its stem: the extension the browser and the OS go by stays.
    long = safe_filename("x" * 400 + ".pdf", 0)
    assert long.endswith("….pdf") and len(long) <= 150
    assert safe_filename("y" * 400, 0) == "y" * 149 + "…"


def test_clear_needs_the_csrf_token_and_empties_the_mailbox(
        app: Flask, client: FlaskClient) -> None:
    send(app)
    send(app, subject="second")
    assert len(mailbox_rows(app)) == 2
    refused = client.post(f"{PREFIX}/mailbox/clear", data={})
    assert refused.status_code == 400 and len(mailbox_rows(app)) == 2
    forged = client.post(f"{PREFIX}/mailbox/clear", data={"csrf_token": "forged"})
    assert forged.status_code == 400 and len(mailbox_rows(app)) == 2
    done = client.post(f"{PREFIX}/mailbox/clear", data={"csrf_token": csrf_token(client)})
    assert done.status_code == 303 and done.headers["Location"].endswith(
        "/outbox/mailbox?notice=cleared&n=2")
    assert mailbox_rows(app) == []
    # The outbox's own rows are not the mailbox: they stay.
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]
    page = client.get(done.headers["Location"]).get_data(as_text=True)
    assert "Mailbox cleared: 2 message(s) deleted." in page and "The mailbox is empty." in page


def test_every_mailbox_route_is_behind_authorize(app: Flask, client: FlaskClient,
                                                 gate: Gate) -> None:
    send(app)
    [kept] = mailbox_rows(app)
    token = csrf_token(client)
    gate.open = False
    base = f"{PREFIX}/mailbox"
    for url in (base, f"{base}?message={kept['id']}", f"{base}?message={kept['id']}&download=eml",
                f"{base}?message={kept['id']}&download=0"):
        assert client.get(url).status_code == 403, url
    assert client.post(f"{base}/clear", data={"csrf_token": token}).status_code == 403
    assert len(mailbox_rows(app)) == 1


def test_hand_edited_links_are_400_or_404(app: Flask, client: FlaskClient) -> None:
    send(app)
    [kept] = mailbox_rows(app)
    assert client.get(f"{PREFIX}/mailbox?message=999").status_code == 404
    assert client.get(f"{PREFIX}/mailbox?message=999&download=eml").status_code == 404
    for bad in ("x", "0", "-1", str(2**63), "", "1e3"):
        assert client.get(f"{PREFIX}/mailbox?message={bad}").status_code == 400, bad
    for bad in ("x", "-1", "eml2", "9999999999"):
        url = f"{PREFIX}/mailbox?message={kept['id']}&download={bad}"
        assert client.get(url).status_code == 400, bad
    assert client.get(f"{PREFIX}/mailbox?before=x").status_code == 400
    assert client.get(f"{PREFIX}/mailbox?before=0").status_code == 400
    assert client.get(f"{PREFIX}/mailbox?before={2**63}").status_code == 400


def test_an_app_without_a_mailbox_transport_says_how_to_get_one(db_url: str) -> None:
    app = make_app(db_url, OUTBOX_TRANSPORT="null")
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True),
                               url_prefix=PREFIX)
        page = app.test_client().get(f"{PREFIX}/mailbox").get_data(as_text=True)
        assert "The mailbox is empty." in page
        assert 'OUTBOX_TRANSPORT = "mailbox"' in page.replace("&#34;", '"')
    finally:
        close_app(app)


def test_the_mailbox_table_is_in_the_catalog_with_its_index(app: Flask) -> None:
    with app.app_context():
        inspector = sa.inspect(test_db.engine)
        assert "outbox_mailbox" in inspector.get_table_names()
        indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes("outbox_mailbox")}
    assert indexes["ix_outbox_mailbox_email_id"] == ["email_id", "id"]


# --- local_debug_only: open as Flask's debugger is, shut otherwise ---------------------


@pytest.mark.parametrize(("debug", "remote", "host", "headers", "allowed"), [
    (True, "127.0.0.1", "localhost:5000", {}, True),
    (True, "127.0.0.1", "127.0.0.1:5000", {}, True),
    (True, "::1", "[::1]:5000", {}, True),
    (True, "127.0.0.1", "app.localhost", {}, True),
    (False, "127.0.0.1", "localhost:5000", {}, False),   # not in debug mode
    (True, "192.168.1.20", "localhost:5000", {}, False),  # another machine
    (True, "127.0.0.1", "evil.example:5000", {}, False),  # DNS rebinding
    (True, "127.0.0.1", "localhost", {"X-Forwarded-For": "203.0.113.9"}, False),  # a proxy
    (True, "127.0.0.1", "localhost", {"Forwarded": "for=203.0.113.9"}, False),
    # A proxy that adds only these (Traefik, Caddy, an nginx with proxy_set_header
    # X-Forwarded-Proto, a chain noting itself in Via) is a proxy all the same.
    (True, "127.0.0.1", "localhost", {"X-Forwarded-Proto": "https"}, False),
    (True, "127.0.0.1", "localhost", {"X-Forwarded-Host": "shop.example"}, False),
    (True, "127.0.0.1", "localhost", {"X-Forwarded-Server": "edge"}, False),
    (True, "127.0.0.1", "localhost", {"Via": "1.1 edge"}, False),
    (True, "::ffff:127.0.0.1", "localhost", {}, True),  # an IPv4 peer on a dual-stack socket
])
def test_local_debug_only_opens_the_dashboard_as_flasks_debugger_would(
        db_url: str, debug: bool, remote: str, host: str, headers: dict[str, str],
        allowed: bool) -> None:
    from flask_mail_outbox import local_debug_only

    app = make_app(db_url, OUTBOX_TRANSPORT="mailbox")
    try:
        mail: OutboxMail = app.extensions["test_mail"]
        app.register_blueprint(mail.dashboard_blueprint(authorize=local_debug_only),
                               url_prefix=PREFIX)
        app.debug = debug
        response = app.test_client().get(
            f"{PREFIX}/mailbox", headers={"Host": host, **headers},
            environ_overrides={"REMOTE_ADDR": remote})
        assert response.status_code == (200 if allowed else 403)
    finally:
        close_app(app)


def test_with_dkim_the_mailbox_keeps_the_signed_bytes_that_were_delivered(
        db_url: str, key_pair: tuple[str, bytes]) -> None:  # noqa: F811 - the fixture
    app = make_app(db_url, OUTBOX_TRANSPORT="mailbox", **dkim_config(key_pair[0]))
    try:
        email_id = send(app)
        [kept] = poll(lambda: mailbox_rows(app), timeout=5)
        mime = bytes(kept["mime"])
        # Signed afresh at delivery: the row keeps the unsigned bytes, the mailbox what went.
        assert mime.startswith(b"DKIM-Signature: ") and verifies(mime, key_pair[1])
        assert mime.endswith(bytes(email_row(app, email_id)["mime"]))
    finally:
        close_app(app)


def test_a_mailbox_the_database_refuses_leaves_the_email_recorded_sent(
        app: Flask, caplog: pytest.LogCaptureFixture) -> None:
    with app.app_context(), test_db.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE outbox_mailbox"))
    with caplog.at_level(logging.ERROR):
        email_id = send(app)  # waits for "sent": not left sending to be delivered again
    row = email_row(app, email_id)
    assert (row["status"], row["attempts"]) == ("sent", 1)
    [record] = [r for r in caplog.records if "in the mailbox (outbox_mailbox)" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert f"[{email_id}]" in record.getMessage() and "recorded sent" in record.getMessage()
    assert "flask db upgrade outbox@head" in record.getMessage()
