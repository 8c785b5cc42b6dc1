"""Message-level Flask-Mail compatibility: what a Flask-Mail user reads off a ``Message``.

Flask-Mail 0.10 makes ``msgId`` in the constructor, formats a tuple sender as
``"name <address>"``, writes no Subject for an empty one, Q-encodes mostly
ASCII subjects (``email.header.Header`` with utf-8 as SHORTEST), adds nothing
to a body and puts html mail in a multipart/alternative that starts with
text/plain. Each of those is checked here against the stdlib parser, and the
Message-ID also through ``mail.send()``, the stored row and a real SMTP server.
"""

from __future__ import annotations

import email.charset
import email.header
import email.policy
import re
import secrets
from datetime import UTC, datetime
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import pytest
from conftest import PREPARE_OPTIONS, close_app, db, make_app, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox._compose.message import PreparedEmail, prepare_message
from flask_mail_outbox._errors import ConfigError
from flask_mail_outbox.core._config import load_config

SENDER = "sender@example.com"
OPTIONS = PREPARE_OPTIONS
_ENCODED_WORD = re.compile(r"=\?utf-8\?([qb])\?[^?]*\?=")


def prepare(msg: Message, **overrides: Any) -> PreparedEmail:
    return prepare_message(msg, **{**OPTIONS, **overrides})


def parse(mime: bytes) -> EmailMessage:
    parsed = BytesParser(policy=email.policy.default).parsebytes(mime)
    assert isinstance(parsed, EmailMessage)
    return parsed


def header_lines(mime: bytes) -> list[str]:
    return mime.split(b"\r\n\r\n", 1)[0].decode("ascii").split("\r\n")


def shape(part: EmailMessage) -> Any:
    """The MIME tree as nested (content type, [children]) / content type."""
    if part.is_multipart():
        return (part.get_content_type(), [shape(p) for p in part.iter_parts()])  # type: ignore[arg-type]
    return part.get_content_type()


# --------------------------------------------------------------------------- #
# msgId
# --------------------------------------------------------------------------- #


def test_msgid_is_made_with_the_message_from_the_senders_domain() -> None:
    msg = Message("Hi", ["to@example.com"], "body", sender="App <app@mail.example.org>")
    assert msg.msgId is not None
    assert re.fullmatch(r"<[0-9a-f]+\.[0-9a-f]{16}@mail\.example\.org>", msg.msgId)
    assert msg.msgId == msg.msgId  # read twice, the same
    assert Message("Hi", sender=SENDER).msgId != Message("Hi", sender=SENDER).msgId


def test_msgid_domain_in_an_app_context() -> None:
    app = Flask(__name__)
    app.config["MAIL_DEFAULT_SENDER"] = ("The App", "app@default.example.com")
    with app.app_context():
        # No sender: the app's default sender's domain.
        assert str(Message("Hi", ["to@example.com"]).msgId).endswith("@default.example.com>")
        app.config["OUTBOX_MESSAGE_ID_DOMAIN"] = "ids.example.net"
        # The setting wins over any sender.
        msg = Message("Hi", ["to@example.com"], sender="x@other.example.org")
        assert str(msg.msgId).endswith("@ids.example.net>")
        unread = Message("Hi", ["to@example.com"], sender="x@other.example.org")
    # Made in the constructor: read after the app context ended, it is the app's still.
    assert str(unread.msgId).endswith("@ids.example.net>")


def test_messages_of_one_default_sender_parse_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every Message() without a sender takes its Message-ID domain from the
    # same MAIL_DEFAULT_SENDER: read once, not parsed again per message.
    import flask_mail_outbox._compose.addresses as addresses

    parsed: list[str] = []
    parseaddr = addresses.parseaddr
    monkeypatch.setattr(addresses, "parseaddr", lambda text: parsed.append(text) or parseaddr(text))
    sender = f"Once {secrets.token_hex(4)} <app@once.example.com>"
    app = Flask(__name__)
    app.config["MAIL_DEFAULT_SENDER"] = sender
    with app.app_context():
        ids = [Message("Hi", ["to@example.com"]).msgId for _ in range(3)]
    assert all(str(i).endswith("@once.example.com>") for i in ids) and len(set(ids)) == 3
    assert parsed == [sender]
    # Another app's default sender is its own.
    other = Flask(__name__)
    other.config["MAIL_DEFAULT_SENDER"] = f"Other {secrets.token_hex(4)} <app@other.example.org>"
    with other.app_context():
        assert str(Message("Hi", ["to@example.com"]).msgId).endswith("@other.example.org>")


def test_msgid_without_an_app_context_or_a_sender_waits_for_a_domain_then_keeps_it() -> None:
    msg = Message("Hi", ["to@example.com"], "body")
    assert msg.msgId is None  # nothing to take a domain from, and no DNS lookup
    msg.sender = "late@example.org"
    made = msg.msgId
    assert made is not None and made.endswith("@example.org>")
    msg.sender = "changed@example.net"
    assert msg.msgId == made
    # Built with a default sender, a message with no id yet gets one and keeps it.
    orphan = Message("Hi", ["to@example.com"], "body")
    prepared = prepare(orphan, default_sender="d@default.example.com")
    assert orphan.msgId == prepared.message_id
    assert prepared.message_id.endswith("@default.example.com>")


def test_msgid_made_outside_an_app_is_made_again_for_the_apps_domain_setting() -> None:
    msg = Message("Hi", ["to@example.com"], "body", sender=SENDER)
    outside = msg.msgId
    prepared = prepare(msg, message_id_domain="ids.example.net")
    assert prepared.message_id != outside and prepared.message_id.endswith("@ids.example.net>")
    assert msg.msgId == prepared.message_id
    # A msgId the user chose is never replaced.
    msg.msgId = "<mine@example.com>"
    assert prepare(msg, message_id_domain="ids.example.net").message_id == "<mine@example.com>"


def test_msgid_set_to_none_makes_a_new_one() -> None:
    msg = Message("Hi", ["to@example.com"], "body", sender=SENDER)
    first = msg.msgId
    msg.msgId = None
    assert msg.msgId is not None and msg.msgId != first


def test_str_and_as_string_are_the_same_message_every_time() -> None:
    msg = Message("Hi", ["to@example.com"], "body", "<p>body</p>", sender=SENDER)
    msg.attach("a.txt", "text/plain", "attached")
    first = msg.as_string()
    # Message-ID, Date (of the first build) and boundaries are kept.
    assert str(msg) == first == msg.as_string()
    assert bytes(msg) == msg.as_bytes() == first.encode("ascii")
    assert parse(msg.as_bytes())["Message-ID"] == msg.msgId


def test_the_date_of_the_first_build_is_kept() -> None:
    msg = Message("Hi", ["to@example.com"], "body", sender=SENDER)
    first = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse(prepare(msg, now=first).mime)["Date"].datetime == first
    later = datetime(2026, 1, 2, 9, 0, 0, tzinfo=UTC)
    assert parse(prepare(msg, now=later).mime)["Date"].datetime == first
    # A date the user gives is used as it is.
    msg.date = later
    assert parse(prepare(msg).mime)["Date"].datetime == later


def test_the_stored_row_and_the_delivered_message_carry_msgid(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        msg = Message("Hi", ["user@example.com"], "body")
        made = msg.msgId
        assert made is not None and made.endswith("@example.com>")  # MAIL_DEFAULT_SENDER's
        preview = msg.as_bytes()
        mail.send(msg)
        db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    [row] = rows(app)
    assert row["message_id"] == made
    assert smtp_server.message_ids() == [made]
    assert parse(preview)["Message-ID"] == made
    # What was previewed is what was stored and sent.
    assert row["mime"] == preview


# --------------------------------------------------------------------------- #
# Sender, subject, body
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("given", "text", "display_name"),
    [
        (("Name", "a@example.org"), "Name <a@example.org>", "Name"),
        (("Doe, John", "a@example.org"), '"Doe, John" <a@example.org>', "Doe, John"),
        (('Say "hi"', "a@example.org"), '"Say \\"hi\\"" <a@example.org>', 'Say "hi"'),
        (("Zoë Café", "a@example.org"), "Zoë Café <a@example.org>", "Zoë Café"),
        (("", "a@example.org"), "a@example.org", ""),
    ],
    ids=["plain", "comma", "quote", "unicode", "no-name"],
)
def test_tuple_sender_reads_as_flask_mail_writes_it(
        given: tuple[str, str], text: str, display_name: str) -> None:
    msg = Message("Hi", ["to@example.com"], "body", sender=given)
    assert msg.sender == text
    [author] = parse(prepare(msg).mime)["From"].addresses
    assert (author.display_name, author.addr_spec) == (display_name, "a@example.org")


def test_a_malformed_sender_tuple_is_kept_for_validation_to_report() -> None:
    odd: Any = ("only one",)
    kept: object = Message("Hi", sender=odd).sender
    assert kept == ("only one",)


def test_a_message_made_in_an_app_context_takes_the_apps_default_sender() -> None:
    """Flask-Mail's ``sender or default_sender``, at construction (#29)."""
    app = Flask(__name__)
    app.config["MAIL_DEFAULT_SENDER"] = ("The App", "app@example.com")
    with app.app_context():
        inside = Message("Hi", ["to@example.com"], "body")
        emptied = Message("Hi", ["to@example.com"], "body", sender="")
        own = Message("Hi", ["to@example.com"], "body", sender="own@example.com")
    outside = Message("Hi", ["to@example.com"], "body")
    assert inside.sender == emptied.sender == "The App <app@example.com>"
    assert own.sender == "own@example.com"
    assert outside.sender is None
    [author] = parse(prepare(inside).mime)["From"].addresses
    assert (author.display_name, author.addr_spec) == ("The App", "app@example.com")


def test_a_bad_default_sender_taken_at_construction_is_reported_as_the_setting() -> None:
    app = Flask(__name__)
    app.config["MAIL_DEFAULT_SENDER"] = "nope"
    with app.app_context():
        msg = Message("Hi", ["to@example.com"], "body")
    with pytest.raises(InvalidMessage) as info:
        prepare(msg)
    assert info.value.field == "sender"
    assert info.value.problem.startswith("MAIL_DEFAULT_SENDER: ")


def test_an_attachment_only_message_starts_with_an_empty_text_part_in_its_charset() -> None:
    """As Flask-Mail writes it: the body comes first, empty, in the message's charset."""
    msg = Message("Hi", ["to@example.com"], sender=SENDER, charset="us-ascii")
    msg.attach("data.csv", "text/csv", b"a,b")
    parsed = parse(prepare(msg).mime)
    assert shape(parsed) == ("multipart/mixed", ["text/plain", "text/csv"])
    body, attachment = parsed.iter_parts()
    assert body["Content-Type"] == 'text/plain; charset="us-ascii"'
    assert body.get_content() == ""
    assert attachment.get_filename() == "data.csv"


def test_an_empty_subject_writes_no_subject_header() -> None:
    mime = prepare(Message("", ["to@example.com"], "body", sender=SENDER)).mime
    assert not any(line.lower().startswith("subject:") for line in header_lines(mime))
    assert "Subject" not in parse(mime)


@pytest.mark.parametrize(
    "subject",
    [
        "Hello é",
        "Grüße aus München, wie geht es dir heute an diesem schönen Tag?",
        "Café déjà vu",
        "日本語のテスト件名です",
        "Ünïcödé " * 20,
    ],
)
def test_non_ascii_subjects_use_the_encoding_flask_mail_picks(subject: str) -> None:
    mime = prepare(Message(subject, ["to@example.com"], "body", sender=SENDER)).mime
    lines = header_lines(mime)
    start = next(i for i, line in enumerate(lines) if line.startswith("Subject: "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    folded = lines[start:end]
    # Flask-Mail: email.header.Header(subject, "utf-8").encode() with utf-8 as SHORTEST.
    charset = email.charset.Charset("utf-8")
    charset.header_encoding = email.charset.SHORTEST
    expected_kinds = set(_ENCODED_WORD.findall(email.header.Header(subject, charset).encode()))
    assert set(_ENCODED_WORD.findall(" ".join(folded))) == expected_kinds
    # RFC 2047: an encoded-word is at most 75 characters; lines stay within 78.
    assert all(len(word) <= 75 for line in folded for word in line.split())
    assert all(len(line) <= 78 for line in folded)
    assert parse(mime)["Subject"] == subject


def test_a_mostly_ascii_subject_is_q_encoded() -> None:
    mime = prepare(Message("Hello é", ["to@example.com"], "body", sender=SENDER)).mime
    assert "Subject: =?utf-8?q?Hello_=C3=A9?=" in header_lines(mime)


def test_no_newline_is_added_to_the_body() -> None:
    mime = prepare(Message("Hi", ["to@example.com"], "no newline", sender=SENDER)).mime
    assert mime.endswith(b"\r\n\r\nno newline")
    mime = prepare(Message("Hi", ["to@example.com"], "one\n", sender=SENDER)).mime
    assert mime.endswith(b"\r\n\r\none\r\n")


# --------------------------------------------------------------------------- #
# html mail: a text part first
# --------------------------------------------------------------------------- #

HTML = "<html><head><style>p {color: red}</style></head><body><h1>Order shipped</h1><p>Track it <a href='https://example.com/t'>here</a>.</p></body></html>"


def test_html_only_gets_a_text_part_rendered_from_the_html() -> None:
    parsed = parse(prepare(Message("Hi", ["to@example.com"], html=HTML, sender=SENDER)).mime)
    assert shape(parsed) == ("multipart/alternative", ["text/plain", "text/html"])
    plain, html = parsed.iter_parts()
    text = str(plain.get_content())
    assert {"Order", "shipped", "Track", "here"} <= set(re.findall(r"\w+", text))
    assert "<" not in text and "color" not in text
    assert str(html.get_content()) == HTML


def test_with_html_to_text_off_html_only_is_flask_mails_alternative_with_an_empty_text_part() -> None:
    parsed = parse(prepare(Message("Hi", ["to@example.com"], html=HTML, sender=SENDER),
                           html_to_text=False).mime)
    assert shape(parsed) == ("multipart/alternative", ["text/plain", "text/html"])
    plain, _ = parsed.iter_parts()
    assert plain.get_content() == ""


def test_a_body_is_never_replaced_by_the_rendering() -> None:
    parsed = parse(prepare(Message("Hi", ["to@example.com"], "my text", HTML, sender=SENDER)).mime)
    plain = parsed.get_body(("plain",))
    assert plain is not None and plain.get_content() == "my text"


def test_alts_only_start_with_a_text_part_too() -> None:
    as_html = Message("Hi", ["to@example.com"], alts={"html": "<p>x y</p>"}, sender=SENDER)
    parsed = parse(prepare(as_html).mime)
    assert shape(parsed) == ("multipart/alternative", ["text/plain", "text/html"])
    other = Message("Hi", ["to@example.com"], alts={"x-markdown": "*x*"}, sender=SENDER)
    parsed = parse(prepare(other).mime)
    assert shape(parsed) == ("multipart/alternative", ["text/plain", "text/x-markdown"])
    assert next(parsed.iter_parts()).get_content() == ""  # no html to render


def test_html_to_text_setting_applies_in_an_app_context() -> None:
    app = Flask(__name__)
    app.config["OUTBOX_HTML_TO_TEXT"] = False
    msg = Message("Hi", ["to@example.com"], html="<p>words here</p>", sender=SENDER)
    with app.app_context():
        plain = next(parse(msg.as_bytes()).iter_parts())
    assert plain.get_content() == ""
    assert "words" in str(next(parse(msg.as_bytes()).iter_parts()).get_content())


@pytest.mark.parametrize("value", ["maybe", 2, None])
def test_html_to_text_must_be_a_flag(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"OUTBOX_HTML_TO_TEXT": value}, instance_path="/tmp", testing=True)
    assert info.value.key == "OUTBOX_HTML_TO_TEXT"
    assert load_config({}, instance_path="/tmp", testing=True).html_to_text is True


@pytest.mark.parametrize("html_to_text", [True, False])
def test_html_mail_over_smtp_follows_the_setting(
        db_url: str, smtp_server: FaultSMTPServer, html_to_text: bool) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_HTML_TO_TEXT=html_to_text)
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Hi", ["user@example.com"], html="<p>Hello <b>reader</b></p>"))
            db.session.commit()
        assert smtp_server.wait_for(1)
        [received] = smtp_server.messages
        parsed = received.parsed
        assert shape(parsed) == ("multipart/alternative", ["text/plain", "text/html"])
        text = str(next(parsed.iter_parts()).get_content())
        assert text.split() == (["Hello", "reader"] if html_to_text else [])
    finally:
        close_app(app, timeout=5)
