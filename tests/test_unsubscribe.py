"""One-click unsubscribe (RFC 8058): ``Message(..., list_unsubscribe=...)``.

An https URL and/or a mailto: URI become ``List-Unsubscribe: <https://...>,
<mailto:...>``; an https URL adds ``List-Unsubscribe-Post:
List-Unsubscribe=One-Click``. Anything else (http, other schemes, a mailto:
without a valid address, CR/LF, spaces, non-ASCII) is refused with
``InvalidMessage`` naming the field, and nothing is written.
"""

from __future__ import annotations

import email.policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import pytest
from conftest import PREPARE_OPTIONS, db, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox._compose.message import prepare_message

SENDER = "news@example.com"
OPTIONS = PREPARE_OPTIONS
HTTPS = "https://example.com/unsubscribe?u=42&t=Zm9vYmFy"
MAILTO = "mailto:unsubscribe@example.com?subject=unsubscribe%2042"


def newsletter(list_unsubscribe: Any, **kwargs: Any) -> Message:
    return Message("News", ["reader@example.com"], "Read me", sender=SENDER,
                   list_unsubscribe=list_unsubscribe, **kwargs)


def build(msg: Message) -> tuple[bytes, EmailMessage]:
    mime = prepare_message(msg, **OPTIONS).mime
    parsed = BytesParser(policy=email.policy.default).parsebytes(mime)
    assert isinstance(parsed, EmailMessage)
    return mime, parsed


def unfolded(parsed: EmailMessage, name: str) -> str | None:
    value = parsed.get(name)
    return None if value is None else " ".join(str(value).split())


def test_https_and_mailto_with_one_click_post() -> None:
    mime, parsed = build(newsletter([HTTPS, MAILTO]))
    assert unfolded(parsed, "List-Unsubscribe") == f"<{HTTPS}>, <{MAILTO}>"
    assert parsed["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert len(parsed.get_all("List-Unsubscribe", [])) == 1
    head = mime.split(b"\r\n\r\n", 1)[0]
    assert all(len(line) <= 78 for line in head.split(b"\r\n"))


def test_a_single_https_string() -> None:
    _, parsed = build(newsletter(HTTPS))
    assert unfolded(parsed, "List-Unsubscribe") == f"<{HTTPS}>"
    assert parsed["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"


def test_mailto_only_has_no_one_click_post() -> None:
    _, parsed = build(newsletter((MAILTO,)))
    assert unfolded(parsed, "List-Unsubscribe") == f"<{MAILTO}>"
    assert "List-Unsubscribe-Post" not in parsed


@pytest.mark.parametrize("empty", [None, [], ()])
def test_no_unsubscribe_writes_no_header(empty: Any) -> None:
    _, parsed = build(newsletter(empty))
    assert "List-Unsubscribe" not in parsed and "List-Unsubscribe-Post" not in parsed


def test_a_long_url_stays_within_the_line_limit() -> None:
    url = "https://example.com/u/" + "a" * 800
    mime, parsed = build(newsletter([url, MAILTO]))
    assert unfolded(parsed, "List-Unsubscribe") == f"<{url}>, <{MAILTO}>"
    assert max(len(line) for line in mime.split(b"\r\n")) <= 998


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ("http://example.com/u", "list_unsubscribe", "needs https"),
        (["https://example.com/u", "http://example.com/u"], "list_unsubscribe[1]", "needs https"),
        ("ftp://example.com/u", "list_unsubscribe", "neither an https URL nor a mailto"),
        ("example.com/unsubscribe", "list_unsubscribe", "neither an https URL nor a mailto"),
        ("https:///path-only", "list_unsubscribe", "has no host"),
        ("mailto:", "list_unsubscribe", "not an email address"),
        ("mailto:not-an-address", "list_unsubscribe", "not an email address"),
        ("mailto:a@localhost", "list_unsubscribe", "not an email address"),
        ("https://example.com/u\r\nBcc: x@example.com", "list_unsubscribe", "CR, LF or NUL"),
        ("https://example.com/u\n", "list_unsubscribe", "CR, LF or NUL"),
        ("https://example.com/a b", "list_unsubscribe", "without spaces"),
        ("https://example.com/<u>", "list_unsubscribe", "angle brackets"),
        ("https://exämple.com/u", "list_unsubscribe", "printable ASCII"),
        ("https://example.com/" + "a" * 900, "list_unsubscribe", "up to 900"),
        ([HTTPS, 7], "list_unsubscribe[1]", "expected str"),
        (7, "list_unsubscribe", "expected an https or mailto URI"),
        ({"url": HTTPS}, "list_unsubscribe", "expected an https or mailto URI"),
    ],
    ids=["http", "http-in-list", "ftp", "no-scheme", "no-host", "empty-mailto", "bad-mailto",
         "local-mailto", "crlf", "lf", "space", "brackets", "non-ascii", "too-long",
         "not-str-in-list", "int", "dict"],
)
def test_bad_unsubscribe_values_are_refused_naming_the_field(
        value: Any, field: str, words: str) -> None:
    with pytest.raises(InvalidMessage) as info:
        build(newsletter(value))
    assert info.value.field == field
    assert words in info.value.problem


def test_also_in_extra_headers_is_refused() -> None:
    msg = newsletter(HTTPS, extra_headers={"List-Unsubscribe": "<mailto:x@example.com>"})
    with pytest.raises(InvalidMessage) as info:
        build(msg)
    assert info.value.field == "list_unsubscribe"
    # Without list_unsubscribe, an extra header is written as before.
    _, parsed = build(newsletter(None, extra_headers={"List-Unsubscribe": "<mailto:x@example.com>"}))
    assert parsed["List-Unsubscribe"] == "<mailto:x@example.com>"


def test_has_bad_headers_sees_a_newline_in_list_unsubscribe() -> None:
    assert newsletter(["https://example.com/u\r\nX: y"]).has_bad_headers()
    assert not newsletter([HTTPS, MAILTO]).has_bad_headers()


def test_refused_at_send_and_nothing_is_written(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context(), pytest.raises(InvalidMessage) as info:
        mail.send(Message("News", ["reader@example.com"], "x",
                          list_unsubscribe="http://example.com/u"))
    assert info.value.field == "list_unsubscribe"
    with app.app_context():
        db.session.commit()
    assert rows(app) == []


def test_delivered_over_smtp_and_parsed_back(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        mail.send(Message("News", ["reader@example.com"], "Read me",
                          list_unsubscribe=[HTTPS, MAILTO]))
        mail.send(Message("Digest", ["reader@example.com"], "Read me too",
                          list_unsubscribe=MAILTO))
        db.session.commit()
    assert smtp_server.wait_for(2)
    assert mail.wait_idle(10)
    by_subject = {m.parsed["Subject"]: m.parsed for m in smtp_server.messages}
    news, digest = by_subject["News"], by_subject["Digest"]
    assert unfolded(news, "List-Unsubscribe") == f"<{HTTPS}>, <{MAILTO}>"
    assert news["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    assert unfolded(digest, "List-Unsubscribe") == f"<{MAILTO}>"
    assert "List-Unsubscribe-Post" not in digest
