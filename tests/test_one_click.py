"""``list_unsubscribe=True``: the outbox makes the one-click link and answers it.

The URL is ``OUTBOX_UNSUBSCRIBE_URL`` plus an opaque token naming the one recipient,
encrypted with a key from ``SECRET_KEY``. Its route takes RFC 8058's POST
(``List-Unsubscribe=One-Click``) and suppresses the address for bulk mail;
a GET only shows a confirmation page; a bad token gets 400 and writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, make_app
from flask import Flask

from flask_mail_outbox import (
    ConfigError,
    InvalidMessage,
    Message,
    OutboxMail,
    email_unsubscribed,
)
from flask_mail_outbox.core import event_table, suppression_table

BASE = "https://app.example.com/outbox/unsubscribe"
ONE_CLICK = {"List-Unsubscribe": "One-Click"}


@pytest.fixture
def app(db_url: str) -> Iterator[Flask]:
    app = make_app(db_url, TESTING=True, OUTBOX_UNSUBSCRIBE_URL=BASE)
    yield app
    close_app(app)


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def newsletter(to: list[Any] | None = None) -> Message:
    return Message("News", to or ["Reader@example.com"], "Read me", list_unsubscribe=True)


def link_of(app: Flask, msg: Message) -> str:
    """The one-click URL ``msg`` carries once built by ``app``."""
    with app.app_context():
        head = msg.as_bytes().split(b"\r\n\r\n", 1)[0].decode()
    unfolded = re.sub(r"\r\n\s+", " ", head).replace("\r\n", "\n")
    (url,) = re.findall(r"^List-Unsubscribe: <([^>]+)>$", unfolded, re.MULTILINE)
    assert "List-Unsubscribe-Post: List-Unsubscribe=One-Click" in unfolded
    return str(url)


def path_of(url: str) -> str:
    assert url.startswith(BASE + "/")
    return url[len("https://app.example.com"):]


def suppressions(app: Flask) -> list[tuple[str, str, str]]:
    with app.app_context(), db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(
            suppression_table.c.address, suppression_table.c.reason,
            suppression_table.c.source))]


def event_count(app: Flask) -> int:
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(event_table)).scalar_one())


def test_the_link_names_the_recipient_and_its_email_and_is_signed(app: Flask) -> None:
    msg = newsletter()
    url = link_of(app, msg)
    token = url.rsplit("/", 1)[1]
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", token)
    with app.app_context():
        links = app.extensions["mail_outbox"].config.unsubscribe_links
    assert links.named_by(token) == ("reader@example.com", msg.msgId)
    # The message sent carries that link; another message, another link.
    with mail_of(app).record_messages() as outbox, app.app_context():
        mail_of(app).send(msg)
        mail_of(app).send(newsletter())
        db.session.commit()
    assert url in outbox[0].mime.decode() and url not in outbox[1].mime.decode()


def test_post_one_click_suppresses_for_bulk_mail_and_signals(app: Flask) -> None:
    path = path_of(link_of(app, newsletter()))
    heard: list[str] = []

    def on_unsubscribed(sender: Flask, address: str, **_: Any) -> None:
        heard.append(address)

    with email_unsubscribed.connected_to(on_unsubscribed, app):
        response = app.test_client().post(path, data=ONE_CLICK)
        response.close()
    assert response.status_code == 200
    assert suppressions(app) == [("reader@example.com", "unsubscribed", "list-unsubscribe")]
    assert heard == ["reader@example.com"]
    # Bulk mail is no longer sent to that address; a password reset still is.
    with app.app_context(), mail_of(app).record_messages() as outbox:
        mail_of(app).send(newsletter())
        mail_of(app).send(Message("Reset", ["reader@example.com"], "Your code"))
        db.session.commit()
    assert [m.subject for m in outbox] == ["Reset"]


def test_get_shows_a_button_and_changes_nothing(app: Flask) -> None:
    path = path_of(link_of(app, newsletter()))
    response = app.test_client().get(path)
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert '<form method="post">' in page
    assert 'name="List-Unsubscribe" value="One-Click"' in page
    # Masked: whoever opens a forwarded link does not learn the reader's address.
    assert "r•••@example.com" in page and "reader@" not in page
    assert response.headers["Cache-Control"] == "no-store"
    assert suppressions(app) == []


@pytest.mark.parametrize("mangle", [
    # The signature's first character changed: its last one may carry only padding bits,
    # and then a "changed" token decodes to the same signature (1 run in 64 passed it).
    lambda token: (token.rpartition(".")[0] + "."
                   + ("A" if token.rpartition(".")[2][0] != "A" else "B")
                   + token.rpartition(".")[2][1:]),
    lambda token: token.split(".")[0] + ".x",                       # signature cut
    lambda token: "",
    lambda token: "not-a-token",
])
def test_a_bad_token_gets_400_and_writes_nothing(app: Flask, mangle: Any) -> None:
    token = link_of(app, newsletter()).rsplit("/", 1)[1]
    client = app.test_client()
    for method in (client.post, client.get):
        response = method(f"/outbox/unsubscribe/{mangle(token)}", data=ONE_CLICK)
        assert response.status_code in (400, 404, 405)
    assert suppressions(app) == []
    assert event_count(app) == 0


def test_a_token_from_another_secret_key_is_refused(app: Flask, db_url: str) -> None:
    other = make_app(db_url, TESTING=True, OUTBOX_UNSUBSCRIBE_URL=BASE, SECRET_KEY="other")
    try:
        path = path_of(link_of(other, newsletter()))
    finally:
        close_app(other)
    assert app.test_client().post(path, data=ONE_CLICK).status_code == 400
    assert suppressions(app) == []


def test_a_post_without_the_one_click_body_is_refused(app: Flask) -> None:
    path = path_of(link_of(app, newsletter()))
    assert app.test_client().post(path).status_code == 400
    assert app.test_client().post(path, data={"List-Unsubscribe": "yes"}).status_code == 400
    assert suppressions(app) == []


def test_links_signed_before_a_key_rotation_keep_working(db_url: str) -> None:
    old = make_app(db_url, TESTING=True, OUTBOX_UNSUBSCRIBE_URL=BASE, SECRET_KEY="old")
    try:
        path = path_of(link_of(old, newsletter()))
    finally:
        close_app(old)
    new = make_app(db_url, TESTING=True, OUTBOX_UNSUBSCRIBE_URL=BASE, SECRET_KEY="new",
                   SECRET_KEY_FALLBACKS=["old"])
    try:
        assert new.test_client().post(path, data=ONE_CLICK).status_code == 200
        assert suppressions(new)[0][:2] == ("reader@example.com", "unsubscribed")
    finally:
        close_app(new)


def test_one_recipient_exactly(app: Flask) -> None:
    with app.app_context():
        with pytest.raises(InvalidMessage, match="exactly one recipient"):
            mail_of(app).send(newsletter(["a@example.com", "b@example.com"]))
        with pytest.raises(InvalidMessage, match="exactly one recipient"):
            mail_of(app).send(Message("News", ["a@example.com"], "x", bcc=["b@example.com"],
                                      list_unsubscribe=True))
        db.session.commit()
    with app.app_context(), db.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_email")).scalar() == 0


def test_true_without_the_url_setting_is_refused(db_url: str) -> None:
    app = make_app(db_url, TESTING=True)
    try:
        with app.app_context(), pytest.raises(InvalidMessage, match="OUTBOX_UNSUBSCRIBE_URL"):
            app.extensions["test_mail"].send(newsletter())
        # And no route exists.
        assert app.test_client().post("/outbox/unsubscribe/x").status_code == 404
    finally:
        close_app(app)


@pytest.mark.parametrize(("config", "message"), [
    ({"OUTBOX_UNSUBSCRIBE_URL": "http://app.example.com/u"}, "https"),
    ({"OUTBOX_UNSUBSCRIBE_URL": "/u"}, "https"),
    ({"OUTBOX_UNSUBSCRIBE_URL": "https://app.example.com/u?x=1"}, "query"),
    ({"OUTBOX_UNSUBSCRIBE_URL": 42}, "https"),
    ({"OUTBOX_UNSUBSCRIBE_URL": "https://app.example.com"}, "with a path"),
    ({"OUTBOX_UNSUBSCRIBE_URL": "https://app.example.com/"}, "with a path"),
    ({"OUTBOX_UNSUBSCRIBE_URL": BASE, "SECRET_KEY": None}, "SECRET_KEY"),
    ({"OUTBOX_WEBHOOK_PREFIX": "outbox/hooks"}, "URL path"),
    ({"OUTBOX_WEBHOOK_PREFIX": "/a?b"}, "URL path"),
])
def test_bad_settings_name_their_key(db_url: str, config: dict[str, Any],
                                     message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        make_app(db_url, TESTING=True, **config)
    assert caught.value.key in config


@pytest.mark.parametrize("csrf_first", [True, False], ids=["csrf-first", "csrf-after"])
def test_flask_wtf_csrf_protection_leaves_the_one_click_post_alone(
        db_url: str, csrf_first: bool) -> None:
    """A provider's or mailbox's POST carries no CSRF token: whichever extension is set up
    first, CSRFProtect must not refuse the one-click route (nor the webhooks)."""
    from flask_wtf.csrf import CSRFProtect

    csrf = CSRFProtect()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=db_url, SECRET_KEY="test", TESTING=True,
                      WTF_CSRF_ENABLED=True, OUTBOX_RUN_SCHEDULER=False,
                      OUTBOX_UNSUBSCRIBE_URL=BASE, MAIL_DEFAULT_SENDER="shop@example.com")
    if csrf_first:
        csrf.init_app(app)
    db.init_app(app)
    mail = OutboxMail(app)
    if not csrf_first:
        csrf.init_app(app)

    @app.post("/form")
    def form() -> str:
        return "ok"

    try:
        with app.app_context():
            db.create_all()
            mail.create_all()
        path = path_of(link_of(app, newsletter()))
        client = app.test_client()
        assert client.post("/form").status_code == 400  # CSRF is on for the app's own form
        assert client.post(path, data=ONE_CLICK).status_code == 200
        assert suppressions(app)[0][:2] == ("reader@example.com", "unsubscribed")
    finally:
        mail.stop()
        with app.app_context():
            db.session.remove()
            for engine in db.engines.values():
                engine.dispose()


# -- issue 36: HEAD, repeated POSTs, the email the link came from ---------------------


def sent_newsletter(app: Flask) -> tuple[int, str]:
    """(email id, one-click path) of a newsletter sent by ``app``."""
    mail = mail_of(app)
    with mail.record_messages() as outbox, app.app_context():
        email_id = int(mail.send(newsletter()))
        db.session.commit()
    (sent,) = outbox
    unfolded = re.sub(r"\r\n\s+", " ", sent.mime.decode().split("\r\n\r\n", 1)[0])
    (url,) = re.findall(r"List-Unsubscribe: <([^>]+)>", unfolded)
    return email_id, path_of(url)


def test_a_head_with_the_one_click_body_changes_nothing(app: Flask) -> None:
    path = path_of(link_of(app, newsletter()))
    response = app.test_client().open(path, method="HEAD", data=ONE_CLICK)
    assert response.status_code == 200
    assert suppressions(app) == [] and event_count(app) == 0
    # Nor does any other method than POST.
    for method in ("PUT", "DELETE", "PATCH"):
        assert app.test_client().open(path, method=method, data=ONE_CLICK).status_code == 405
    assert suppressions(app) == [] and event_count(app) == 0


def test_repeated_posts_of_one_link_store_one_event_and_signal_once(app: Flask) -> None:
    _, path = sent_newsletter(app)
    heard: list[str] = []

    def on_unsubscribed(sender: Flask, address: str, **_: Any) -> None:
        heard.append(address)

    with email_unsubscribed.connected_to(on_unsubscribed, app):
        for _ in range(5):
            response = app.test_client().post(path, data=ONE_CLICK)
            response.close()
            assert response.status_code == 200
            assert "will get no more" in response.get_data(as_text=True)
    assert event_count(app) == 1
    assert heard == ["reader@example.com"]
    assert suppressions(app) == [("reader@example.com", "unsubscribed", "list-unsubscribe")]


def test_the_unsubscribe_is_recorded_with_its_email(app: Flask) -> None:
    app.register_blueprint(mail_of(app).dashboard_blueprint(authorize=lambda: True),
                           url_prefix="/dash")
    email_id, path = sent_newsletter(app)
    assert app.test_client().post(path, data=ONE_CLICK).status_code == 200
    with app.app_context():
        (event,) = mail_of(app).events(email_id)
    # Under the transport that sent the email, not a made-up one.
    assert (event.event_type, event.recipient, event.email_id, event.transport) == (
        "unsubscribed", "reader@example.com", email_id, "default")
    page = app.test_client().get(f"/dash/emails/{email_id}").get_data(as_text=True)
    assert "<h2>Delivery events</h2>" in page and "the one-click unsubscribe link" in page


def test_a_link_made_before_links_named_their_email_still_works(app: Flask) -> None:
    """Tokens already sent hold the address alone: read as before, no email named."""
    from itsdangerous import URLSafeSerializer

    # As links.py made them before (the app's SECRET_KEY, the same salt).
    token = URLSafeSerializer(b"test", salt="flask-mail-outbox.unsubscribe").dumps(
        "reader@example.com")
    client = app.test_client()
    for _ in range(3):
        assert client.post(f"/outbox/unsubscribe/{token}", data=ONE_CLICK).status_code == 200
    assert suppressions(app) == [("reader@example.com", "unsubscribed", "list-unsubscribe")]
    assert event_count(app) == 1


def test_the_token_is_opaque_a_forwarded_link_does_not_show_the_address(app: Flask) -> None:
    """Issue 41: the token used to be the address in URL-safe base64 (signed, readable)."""
    import base64

    msg = newsletter(["Reader.Name+news@example.com"])
    url = link_of(app, msg)
    token = url.rsplit("/", 1)[1]
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)  # one path segment, no dots
    decoded = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    assert "reader" not in token.lower() and b"reader" not in decoded.lower()
    assert b"example.com" not in decoded.lower()
    assert msg.msgId.strip("<>").split("@")[0].encode() not in decoded
    # Still resolved by the server alone: no row, no database.
    with app.app_context():
        links = app.extensions["mail_outbox"].config.unsubscribe_links
    assert links.named_by(token) == ("reader.name+news@example.com", msg.msgId)
    assert app.test_client().post(path_of(url), data=ONE_CLICK).status_code == 200
    assert suppressions(app)[0][:2] == ("reader.name+news@example.com", "unsubscribed")


def test_a_signed_readable_link_of_before_keeps_working_with_its_email(app: Flask) -> None:
    """Links already in inboxes, made as [address, message id] signed and readable."""
    from itsdangerous import URLSafeSerializer

    email_id, path = sent_newsletter(app)
    from flask_mail_outbox.core import email_table as t

    with app.app_context(), db.engine.connect() as conn:
        stored = conn.execute(sa.select(t.c.message_id).where(t.c.id == email_id)).scalar_one()
    token = URLSafeSerializer(b"test", salt="flask-mail-outbox.unsubscribe").dumps(
        ["reader@example.com", stored.strip("<>")])
    assert app.test_client().post(f"/outbox/unsubscribe/{token}",
                                  data=ONE_CLICK).status_code == 200
    with app.app_context():
        (event,) = mail_of(app).events(email_id)
    assert (event.event_type, event.recipient) == ("unsubscribed", "reader@example.com")
    assert path != f"/outbox/unsubscribe/{token}"  # the new link of that email is opaque


@pytest.mark.parametrize("mangle", [
    lambda token: token[:-1] + ("A" if token[-1] != "A" else "B"),  # the last character
    lambda token: "B" + token[1:] if token[0] != "B" else "C" + token[1:],  # the format byte
    lambda token: token[:10],                                          # cut short
    lambda token: token + "!",                                         # not base64
])
def test_an_altered_opaque_token_gets_400_and_writes_nothing(app: Flask, mangle: Any) -> None:
    token = link_of(app, newsletter()).rsplit("/", 1)[1]
    response = app.test_client().post(f"/outbox/unsubscribe/{mangle(token)}", data=ONE_CLICK)
    assert response.status_code in (400, 404)
    assert suppressions(app) == [] and event_count(app) == 0
