"""Inline images that render: ``embed()`` and inline ``attach()`` go in multipart/related.

Flask-Mail puts an inline part in the multipart/mixed with the attachments,
where Thunderbird and others list it as an attachment and the html's
``cid:`` reference shows a broken image (Flask-Mail issue #91). Here the
html part and its inline parts share a multipart/related that takes the html
part's place in the multipart/alternative; multipart/mixed appears only for
regular attachments. Every tree is read back with the stdlib parser, and
every ``cid:`` in the html must name a part's Content-ID, including after a
real SMTP delivery.
"""

from __future__ import annotations

import email.policy
import re
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import pytest
from conftest import PREPARE_OPTIONS, db, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._compose.message import prepare_message

SENDER = "sender@example.com"
OPTIONS = PREPARE_OPTIONS
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
GIF = b"GIF89a" + bytes(64)


def build(msg: Message, **overrides: Any) -> EmailMessage:
    mime = prepare_message(msg, **{**OPTIONS, **overrides}).mime
    parsed = BytesParser(policy=email.policy.default).parsebytes(mime)
    assert isinstance(parsed, EmailMessage)
    return parsed


def shape(part: EmailMessage) -> Any:
    """The MIME tree as nested (content type, [children]) / content type."""
    if part.is_multipart():
        return (part.get_content_type(), [shape(p) for p in part.iter_parts()])  # type: ignore[arg-type]
    return part.get_content_type()


def assert_cids_resolve(parsed: EmailMessage) -> set[str]:
    """Every cid: the html references is the Content-ID of a part in its multipart/related."""
    html = parsed.get_body(("html",))
    assert html is not None
    referenced = set(re.findall(r'src="cid:([^"]+)"', str(html.get_content())))
    assert referenced
    [related] = [p for p in parsed.walk() if p.get_content_type() == "multipart/related"]
    assert related.get_param("type") == "text/html"
    parts = list(related.iter_parts())
    assert parts[0].get_content_type() == "text/html"  # the root comes first (RFC 2387)
    ids = {str(p["Content-ID"]).strip("<>") for p in parts[1:]}
    assert referenced <= ids
    for part in parts[1:]:
        assert part.get_content_disposition() == "inline"
    return referenced


def with_logo(**kwargs: Any) -> tuple[Message, str]:
    msg = Message("Logo", ["to@example.com"], sender=SENDER, **kwargs)
    cid = msg.embed("logo.png", "image/png", PNG)
    msg.html = f'<p>Hello <img src="cid:{cid}"></p>'
    return msg, cid


def test_embed_returns_a_cid_without_brackets_and_guesses_the_type() -> None:
    msg = Message("Logo", ["to@example.com"], sender=SENDER)
    cid = msg.embed("pixel.gif", None, GIF)
    assert "<" not in cid and ">" not in cid and "@" in cid
    [att] = msg.attachments
    assert (att.content_type, att.disposition) == ("image/gif", "inline")
    assert dict(att.headers) == {"Content-ID": f"<{cid}>"}
    assert msg.embed("pixel.gif", None, GIF) != cid


def test_html_and_an_embedded_image_make_related_inside_alternative() -> None:
    msg, cid = with_logo()
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/alternative",
        ["text/plain", ("multipart/related", ["text/html", "image/png"])],
    )
    assert assert_cids_resolve(parsed) == {cid}
    [image] = [p for p in parsed.walk() if p.get_content_type() == "image/png"]
    assert image.get_content() == PNG
    assert not list(parsed.iter_attachments())  # nothing a client lists as an attachment


def test_body_html_and_an_embedded_image() -> None:
    msg, _ = with_logo(body="Hello, in text")
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/alternative",
        ["text/plain", ("multipart/related", ["text/html", "image/png"])],
    )
    plain = parsed.get_body(("plain",))
    assert plain is not None and plain.get_content() == "Hello, in text"
    assert_cids_resolve(parsed)


def test_an_attachment_as_well_puts_mixed_on_top() -> None:
    msg, _ = with_logo(body="text")
    msg.attach("invoice.pdf", "application/pdf", b"%PDF-1.4")
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/mixed",
        [
            ("multipart/alternative",
             ["text/plain", ("multipart/related", ["text/html", "image/png"])]),
            "application/pdf",
        ],
    )
    assert [a.get_filename() for a in parsed.iter_attachments()] == ["invoice.pdf"]
    assert_cids_resolve(parsed)


def test_several_images_and_the_order_of_parts() -> None:
    msg = Message("Two", ["to@example.com"], sender=SENDER)
    first = msg.embed("a.png", "image/png", PNG)
    msg.attach("report.csv", "text/csv", "a,b\n")
    second = msg.embed("b.gif", "image/gif", GIF)
    msg.html = f'<img src="cid:{first}"><img src="cid:{second}">'
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/mixed",
        [
            ("multipart/alternative",
             ["text/plain", ("multipart/related", ["text/html", "image/png", "image/gif"])]),
            "text/csv",
        ],
    )
    assert assert_cids_resolve(parsed) == {first, second}


def test_flask_mail_style_inline_attach_is_related_too() -> None:
    msg = Message("Logo", ["to@example.com"], html='<img src="cid:logo@example.com">',
                  sender=SENDER)
    msg.attach("logo.png", "image/png", PNG, "inline", headers={"Content-ID": "<logo@example.com>"})
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/alternative",
        ["text/plain", ("multipart/related", ["text/html", "image/png"])],
    )
    assert assert_cids_resolve(parsed) == {"logo@example.com"}


def test_inline_without_content_id_or_with_attachment_disposition_stays_an_attachment() -> None:
    msg = Message("x", ["to@example.com"], html="<p>x</p>", sender=SENDER)
    msg.attach("shown.png", "image/png", PNG, "inline")  # no Content-ID: nothing can refer to it
    msg.attach("listed.png", "image/png", PNG, headers={"Content-ID": "<l@example.com>"})
    parsed = build(msg)
    assert shape(parsed) == (
        "multipart/mixed",
        [("multipart/alternative", ["text/plain", "text/html"]), "image/png", "image/png"],
    )


def test_embed_without_html_stays_an_inline_part_after_the_text() -> None:
    msg = Message("Logo", ["to@example.com"], "text only", sender=SENDER)
    msg.embed("logo.png", "image/png", PNG)
    parsed = build(msg)
    assert shape(parsed) == ("multipart/mixed", ["text/plain", "image/png"])
    image = list(parsed.iter_parts())[1]
    assert image.get_content_disposition() == "inline" and image.get_content() == PNG


def test_embed_with_html_to_text_off_keeps_flask_mails_empty_text_part() -> None:
    msg, _ = with_logo()
    parsed = build(msg, html_to_text=False)
    assert shape(parsed) == (
        "multipart/alternative",
        ["text/plain", ("multipart/related", ["text/html", "image/png"])],
    )
    assert_cids_resolve(parsed)


def test_the_inline_parts_are_listed_with_the_attachments() -> None:
    msg, _ = with_logo()
    [info] = prepare_message(msg, **OPTIONS).attachments
    assert (info.filename, info.content_type, info.size) == ("logo.png", "image/png", len(PNG))


@pytest.mark.parametrize("with_attachment", [False, True], ids=["related", "mixed"])
def test_inline_images_survive_storage_and_smtp_delivery(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer, with_attachment: bool) -> None:
    # The outbox stores the whole MIME in the row (outbox_attachment only
    # lists names, types and sizes), so Content-ID and disposition travel as built.
    with app.app_context():
        msg = Message("Logo", ["user@example.com"], "text")
        cid = msg.embed("logo.png", "image/png", PNG)
        msg.html = f'<p><img src="cid:{cid}"></p>'
        if with_attachment:
            msg.attach("invoice.pdf", "application/pdf", b"%PDF-1.4")
        mail.send(msg)
        db.session.commit()
    assert smtp_server.wait_for(1)
    assert mail.wait_idle(10)
    [received] = smtp_server.messages
    parsed = received.parsed
    alternative = ("multipart/alternative",
                   ["text/plain", ("multipart/related", ["text/html", "image/png"])])
    expected = ("multipart/mixed", [alternative, "application/pdf"]) if with_attachment \
        else alternative
    assert shape(parsed) == expected
    assert assert_cids_resolve(parsed) == {cid}
    [image] = [p for p in parsed.walk() if p.get_content_type() == "image/png"]
    assert image.get_content() == PNG
    [row] = rows(app)
    assert row["status"] == "sent"
