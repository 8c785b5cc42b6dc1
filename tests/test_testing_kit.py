"""The test kit's user side (``flask_mail_outbox.testing.OutboxTest``): committed mail only,
the filters of its assertions, and failures that list what there is.

A real app with ``TESTING`` (the memory transport, delivery inside ``commit()``) on real
SQLite and PostgreSQL (the ``backend`` fixture).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import close_app, db, make_app
from flask import Flask
from flask_babel import Babel

from flask_mail_outbox import Message, OutboxMail, testing
from flask_mail_outbox.testing import OutboxTest, TestEmail


@pytest.fixture
def app(db_url: str, tmp_path: Path) -> Iterator[Flask]:
    templates = tmp_path / "templates" / "email"
    templates.mkdir(parents=True)
    (templates / "welcome.subject.txt").write_text("Welcome, {{ name }}!", encoding="utf-8")
    (templates / "welcome.html").write_text("<p>Hi {{ name }}</p>", encoding="utf-8")
    app = make_app(db_url, TESTING=True, OUTBOX_TEMPLATE_LOCALES=["en", "de"])
    app.template_folder = str(tmp_path / "templates")
    Babel(app)
    yield app
    close_app(app, timeout=5)


@pytest.fixture
def mail(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


@pytest.fixture
def outbox(app: Flask) -> Iterator[OutboxTest]:
    with OutboxTest(app) as kit:
        yield kit


def send(app: Flask, mail: OutboxMail, *messages: Message, commit: bool = True,
         **options: object) -> list[int]:
    with app.app_context():
        ids = [mail.send(m, **options) for m in messages]  # type: ignore[arg-type]
        if commit:
            db.session.commit()
        else:
            db.session.rollback()
    return ids


def welcome(to: str = "ann@example.com", subject: str = "Welcome") -> Message:
    return Message(subject, recipients=[to], body="Hi there", html="<p>Hi <b>there</b></p>")


def test_a_committed_email_is_there_parsed_once(app: Flask, mail: OutboxMail,
                                                outbox: OutboxTest) -> None:
    message = Message("Welcome", recipients=["Ann <ann@example.com>"],
                      cc=["cat@example.com"], bcc=["Boss@Example.com"],
                      body="Hi there", html="<p>Hi <b>there</b></p>",
                      extra_headers={"X-Campaign": "spring"})
    message.attach("a.txt", "text/plain", b"attached")
    with app.app_context(), mail.record_messages() as delivered:
        email_id = mail.send(message, key="user-7")
        db.session.commit()
    [email] = outbox.emails()
    assert isinstance(email, TestEmail)
    assert (email.id, email.status, email.subject, email.key) == (email_id, "sent", "Welcome",
                                                                   "user-7")
    assert email.sender == "sender@example.com"
    assert email.to == ("ann@example.com",)
    assert email.cc == ("cat@example.com",)
    assert email.bcc == ("Boss@example.com",)  # the domain as the library stores it
    assert email.recipients == ("ann@example.com", "cat@example.com", "Boss@example.com")
    assert email.text == "Hi there"
    assert email.html == "<p>Hi <b>there</b></p>"
    assert email.mime == delivered[0].mime  # the exact bytes the transport had
    assert email.parsed is not None and email.parsed["Subject"] == "Welcome"
    assert email.headers("x-campaign") == ["spring"]
    assert email.header("X-Missing") is None
    assert email.attachments() == [("a.txt", "text/plain", b"attached")]
    assert email.attempts == 1 and email.last_error is None and email.sent_at is not None
    assert (email.template, email.locale) == (None, None)
    assert [e.id for e in outbox.emails(status="sent")] == [email_id]
    assert outbox.emails(status="queued") == []


def test_mail_of_a_rolled_back_transaction_is_not_there(app: Flask, mail: OutboxMail,
                                                         outbox: OutboxTest) -> None:
    send(app, mail, welcome(), commit=False)
    assert outbox.emails() == []
    outbox.assert_not_sent(to="ann@example.com")
    with pytest.raises(AssertionError, match="found none"):
        outbox.assert_sent(to="ann@example.com")


def test_mail_of_a_rolled_back_savepoint_is_not_there(app: Flask, mail: OutboxMail,
                                                       outbox: OutboxTest) -> None:
    with app.app_context():
        mail.send(welcome("kept@example.com"))
        with db.session.begin_nested() as savepoint:
            mail.send(welcome("dropped@example.com"))
            savepoint.rollback()
        db.session.commit()
    [kept] = outbox.assert_sent()
    assert kept.recipients == ("kept@example.com",)
    outbox.assert_not_sent(to="dropped@example.com")
    assert len(outbox.emails()) == 1


def test_mail_not_committed_yet_is_not_there(app: Flask, mail: OutboxMail,
                                             outbox: OutboxTest) -> None:
    with app.app_context():
        mail.send(welcome())
        db.session.flush()  # the row is in the database, in a transaction still open
        assert outbox.emails() == []
        db.session.commit()
    outbox.assert_sent(to="ann@example.com")


def test_the_filters(app: Flask, mail: OutboxMail, outbox: OutboxTest) -> None:
    send(app, mail, welcome("ann@example.com"), welcome("bob@example.com", "Receipt"))
    with app.app_context():
        mail.send_template("welcome", recipients=["cat@example.com"], context={"name": "Cat"},
                           locale="de")
        db.session.commit()
    [ann, bob, cat] = outbox.emails()
    assert outbox.assert_sent(to="ANN@Example.COM") == [ann]  # any case
    assert outbox.assert_sent(to="  ann@example.com ") == [ann]
    send(app, mail, Message("Note", recipients=["x@example.com"], bcc=["Dan.Smith@Example.com"],
                            body="n"))
    [note] = outbox.assert_sent(to="dan.smith@EXAMPLE.com")
    assert note.bcc == ("Dan.Smith@example.com",)
    assert outbox.assert_sent(subject="Welcome") == [ann]  # equal, not a prefix
    assert outbox.assert_sent(subject="Receipt", to="bob@example.com") == [bob]
    assert outbox.assert_sent(html_contains="<b>there</b>", count=2) == [ann, bob]
    assert outbox.assert_sent(text_contains="Hi there", count=2) == [ann, bob]
    assert outbox.assert_sent(template="welcome") == [cat]
    assert outbox.assert_sent(template="welcome", locale="de", html_contains="Hi Cat") == [cat]
    assert (cat.template, cat.locale, cat.subject) == ("welcome", "de", "Welcome, Cat!")
    assert outbox.assert_sent(count=4) == [ann, bob, cat, note]
    outbox.assert_not_sent(template="welcome", locale="en")
    outbox.assert_not_sent(subject="Welcome", to="bob@example.com")
    outbox.assert_not_sent(html_contains="nowhere")
    with pytest.raises(AssertionError, match=r"assert_not_sent\(to='bob@example.com'\): "
                                             r"expected no sent email matching, found 1 \(ids 2\)"):
        outbox.assert_not_sent(to="bob@example.com")
    with pytest.raises(AssertionError, match=r"expected exactly 1 sent email\(s\) matching, "
                                             r"found 2 \(ids 1, 2\)"):
        outbox.assert_sent(text_contains="Hi there", count=1)
    with pytest.raises(AssertionError, match="expected exactly 0"):
        outbox.assert_sent(subject="Welcome", count=0)
    assert outbox.assert_sent(subject="Nothing", count=0) == []


def test_enqueued_is_committed_and_not_delivered_yet(app: Flask, mail: OutboxMail,
                                                     outbox: OutboxTest) -> None:
    send(app, mail, welcome("later@example.com", "Reminder"), send_after=timedelta(hours=1))
    send(app, mail, welcome("now@example.com"))
    [later] = outbox.assert_enqueued()
    assert later.status == "queued" and later.recipients == ("later@example.com",)
    assert outbox.assert_enqueued(subject="Reminder", count=1) == [later]
    outbox.assert_not_sent(to="later@example.com")
    with pytest.raises(AssertionError, match=r"assert_enqueued\(to='now@example.com'\): "
                                             r"expected a queued email matching, found none"):
        outbox.assert_enqueued(to="now@example.com")
    send(app, mail, welcome("never@example.com"), commit=False, send_after=timedelta(hours=1))
    outbox.assert_enqueued(count=1)


def test_manual_mode_delivers_on_deliver_only(app: Flask, mail: OutboxMail) -> None:
    with OutboxTest(app, mode="manual") as manual:
        send(app, mail, welcome())
        [queued] = manual.assert_enqueued(to="ann@example.com")
        manual.assert_not_sent()
        assert manual.deliver() == 1
        [sent] = manual.assert_sent(to="ann@example.com")
        assert sent.id == queued.id and sent.status == "sent"
        manual.assert_enqueued(count=0)


def test_a_failed_assertion_lists_what_there_is(app: Flask, mail: OutboxMail,
                                                outbox: OutboxTest) -> None:
    with pytest.raises(AssertionError) as empty:
        outbox.assert_sent(subject="Welcome")
    assert str(empty.value) == ("assert_sent(subject='Welcome'): expected a sent email "
                                "matching, found none.\nThe outbox has no committed email.")
    send(app, mail, welcome("queued@example.com", "Later " + "x" * 80),
         send_after=timedelta(hours=1))
    with pytest.raises(AssertionError) as queued:
        outbox.assert_sent(to="queued@example.com")
    # A long subject is cut, so the row stays one line of the table.
    assert str(queued.value).splitlines()[1:] == [
        "The outbox has 1 committed email(s):",
        "  id  status  to                  subject" + " " * 45 + "template",
        "  1   queued  queued@example.com  Later " + "x" * 43 + "…  -"]
    send(app, mail, *(welcome(f"user{n}@example.com", f"Hello {n}") for n in range(24)))
    with pytest.raises(AssertionError) as failed:
        outbox.assert_sent(subject="Welcome", to="ann@example.com", count=2)
    lines = str(failed.value).splitlines()
    assert lines[0] == ("assert_sent(subject='Welcome', to='ann@example.com', count=2): "
                        "expected exactly 2 sent email(s) matching, found 0.")
    assert lines[1] == "The outbox has 25 committed email(s):"
    assert re.fullmatch(r"  id +status +to +subject +template", lines[2])
    assert re.fullmatch(r"  1 +queued +queued@example\.com +Later x+… +-", lines[3])
    assert re.fullmatch(r"  2 +sent +user0@example\.com +Hello 0 +-", lines[4])
    assert len(lines) == 3 + 20 + 1
    assert lines[-1] == "  ... and 5 more"


def test_bad_use_is_a_clear_error(app: Flask, outbox: OutboxTest, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="status must be one of queued, sending, sent"):
        outbox.emails(status="delivered")
    with pytest.raises(TypeError, match="count must be an int or None, got bool"):
        outbox.assert_sent(count=True)
    with pytest.raises(ValueError, match="count must be 0 or more, got -1"):
        outbox.assert_enqueued(count=-1)
    with pytest.raises(TypeError, match="to must be a str or None, got list"):
        outbox.assert_sent(to=["ann@example.com"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="assert_not_sent"):
        outbox.assert_not_sent(count=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="needs a Flask app, got str"):
        OutboxTest("app")  # type: ignore[arg-type]
    bare = Flask("bare")
    with pytest.raises(testing.TestKitError, match=r"not registered on the app 'bare': call "
                                           r"OutboxMail\(app\) or mail.init_app\(app\)"):
        OutboxTest(bare)
