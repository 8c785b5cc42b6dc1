"""``flask outbox bounce``: what each kind of input exits with (MTAs act on it).

0 when processed, and 0 too for what is not a bounce, names no email of ours,
is not mail at all or cannot be read (logged); 75 (EX_TEMPFAIL) only when the
database cannot be reached, so the MTA keeps the message; never 1. Of a
message over 1 MiB the first 1 MiB is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, rows

from flask_mail_outbox import InvalidMessage, Message
from flask_mail_outbox.core import event_table, suppression_table

SAMPLES = Path(__file__).parent / "bounces"
POSTFIX_DSN = (SAMPLES / "postfix-hard-5.1.1.eml").read_bytes()


def feed(app: Any, raw: bytes) -> Any:
    return app.test_cli_runner().invoke(args=["outbox", "bounce"], input=raw)


def counts(app: Any) -> tuple[int, int]:
    with app.app_context(), db.engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(event_table)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(
                    suppression_table)).scalar_one())


@pytest.mark.parametrize(("name", "raw", "stored"), [
    ("a DSN for no email of ours", POSTFIX_DSN, (1, 0)),
    ("not a bounce", (SAMPLES / "not-bounce-plain.eml").read_bytes(), (0, 0)),
    ("an auto-reply", (SAMPLES / "vacation-auto-reply.eml").read_bytes(), (0, 0)),
    ("binary junk", bytes(range(256)) * 64, (0, 0)),
    ("empty", b"", (0, 0)),
    ("over 10 MiB, not a bounce", b"Subject: big\r\n\r\n" + b"x" * (10 * 1024 * 1024), (0, 0)),
    # Poison (defect 6): these exited 75, and the MTA delivered them again for days.
    ("a Date past what UTC holds",
     POSTFIX_DSN.replace(b"Date: Sun,  6 Dec 2026 00:27:28 +0000 (UTC)\nFrom",
                         b"Date: Fri, 31 Dec 9999 23:59:59 -2359\nFrom"), (1, 0)),
    ("a Last-Attempt-Date past what UTC holds",
     POSTFIX_DSN.replace(b"Action: failed\n",
                         b"Action: failed\nLast-Attempt-Date: Fri, 31 Dec 9999 23:59:59 -2359\n"),
     (1, 0)),
    # Defect 2's shapes: each took a core for seconds to minutes.
    ("a DSN field of 40,000 folded lines",
     POSTFIX_DSN.replace(b'Diagnostic-Code: X-Postfix; unknown user: "nobody-here"',
                         b"Diagnostic-Code: smtp; 550" + b"\n x" * 40_000), (1, 0)),
    ("40,000 Delivered-To", b"".join(b"Delivered-To: a%d@example.com\n" % i
                                     for i in range(40_000)) + POSTFIX_DSN, (0, 0)),
    ("140,000 To addresses", b"To: " + b", ".join(b"a%d@x.example" % i for i in range(140_000))
     + b"\n" + POSTFIX_DSN, (0, 0)),
    # Its text part still names the recipient: read from there, kept unmatched.
    ("a DSN without a recipient block",
     POSTFIX_DSN.replace(b"Final-Recipient:", b"X-Gone:")
     .replace(b"Original-Recipient:", b"X-Gone-Too:").replace(b"Action:", b"X-Action:"),
     (1, 0)),
])
def test_every_kind_of_input_exits_0(make_apps: MakeApps, name: str, raw: bytes,
                                     stored: tuple[int, int]) -> None:
    app, _ = make_apps(TESTING=True)
    result = feed(app, raw)
    assert result.exit_code == 0, (name, result.output)
    # An unknown row's bounce is kept, unmatched, and suppresses nothing.
    assert counts(app) == stored


def test_200000_open_parentheses_exit_0_and_the_verp_address_below_is_read(
        make_apps: MakeApps) -> None:
    """Defect 6: with VERP on, ``To:`` and 200,000 ``(`` was a RecursionError: exit 75 for ever."""
    app, mail = make_apps(TESTING=True, OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    verp = app.extensions["mail_outbox"].config.verp
    with app.app_context():
        email_id = mail.send(Message("Hi", ["nobody-here@example.com"], "x"))
        db.session.commit()
    parens = b"(" * 200_000
    assert feed(app, b"From: a@example.com\nTo: " + parens + b"\n\nhi\n").exit_code == 0
    assert counts(app) == (0, 0)
    dsn = (b"To: " + parens + b"\n" + f"X-Original-To: {verp.sender_for(email_id)}\n".encode()
           + POSTFIX_DSN)
    assert feed(app, dsn).exit_code == 0
    with app.app_context():
        assert [(e.event_type, e.email_id) for e in mail.events(email_id)] == [
            ("bounced", email_id)]
    assert counts(app) == (1, 1)


def test_a_bounce_returning_a_big_attachment_is_read_from_its_start(
        make_apps: MakeApps) -> None:
    """A DSN that returns a 12 MB original was dropped whole; its report is in its first KB."""
    app, _ = make_apps(TESTING=True)
    big = POSTFIX_DSN.replace(b"Follow this link", b"x" * (12 * 1024 * 1024) + b"\nFollow")
    result = feed(app, big)
    assert result.exit_code == 0, result.output
    assert counts(app) == (1, 0)


def test_a_message_the_reader_fails_on_is_dropped_not_retried(
        make_apps: MakeApps, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A reader bug on some shape not yet known: exit 0 and an ERROR, never 75 for ever.

    (The failure is injected: every known poison shape is read now, see above.)
    """
    import flask_mail_outbox._bounces as bounces

    def fails(text: str) -> list[object]:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(bounces, "_blocks_of", fails)
    app, mail = make_apps(TESTING=True)
    with caplog.at_level(logging.INFO):
        result = feed(app, POSTFIX_DSN)
    assert result.exit_code == 0, result.output
    assert counts(app) == (0, 0)
    (error,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "RecursionError" in error.getMessage() and "dropped" in error.getMessage()
    with app.app_context(), pytest.raises(InvalidMessage, match="could not be read"):
        mail.process_bounce(POSTFIX_DSN)


def test_the_database_unreachable_is_75_and_a_later_run_processes_it(
        make_apps: MakeApps, caplog: pytest.LogCaptureFixture) -> None:
    app, _ = make_apps(TESTING=True)
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_event RENAME TO outbox_event_away"))
    try:
        with caplog.at_level(logging.ERROR):
            result = feed(app, POSTFIX_DSN)
        assert result.exit_code == 75
        assert any("exit 75" in r.getMessage() for r in caplog.records)
    finally:
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox_event_away RENAME TO outbox_event"))
    result = feed(app, POSTFIX_DSN)  # the MTA delivers it again
    assert result.exit_code == 0
    assert counts(app)[0] == 1


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_server_that_does_not_answer_is_75(make_apps: MakeApps, db_url: str) -> None:
    app, _ = make_apps(TESTING=True)
    down = sa.make_url(db_url).set(host="127.0.0.1", port=1)
    app.extensions["mail_outbox"].outbox().engine.dispose()
    outbox = app.extensions["mail_outbox"].outbox()
    outbox.engine = sa.create_engine(down, connect_args={"connect_timeout": 2})
    outbox.store.engine = outbox.engine
    result = feed(app, POSTFIX_DSN)
    assert result.exit_code == 75


def test_process_bounce_from_python(make_apps: MakeApps) -> None:
    app, mail = make_apps(TESTING=True)
    with app.app_context():
        events = mail.process_bounce(POSTFIX_DSN)
        assert [(e.event_type, e.bounce_kind) for e in events] == [("bounced", "permanent")]
        assert events[0].email_id is None
        assert mail.process_bounce(POSTFIX_DSN) == []  # a duplicate
        assert mail.process_bounce((SAMPLES / "not-bounce-plain.eml").read_bytes()) == []
        with pytest.raises(InvalidMessage):
            mail.process_bounce(b"\x00\x01\x02")
        with pytest.raises(TypeError):
            mail.process_bounce("text")  # type: ignore[arg-type]


def test_a_recipient_cannot_bounce_someone_else_with_their_own_token(
        make_apps: MakeApps) -> None:
    """A VERP token is no secret to its recipients: it names the email, not whom to suppress.

    A bounce suppresses only the one recipient of a one-recipient email; every
    other report is kept as an event and suppresses nothing.
    """
    app, mail = make_apps(TESTING=True, OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    verp = app.extensions["mail_outbox"].config.verp
    with app.app_context():
        alone = mail.send(Message("Hi", ["mallory@example.com"], "x"))
        shared = mail.send(Message("Hi all", ["ann@example.com"], "x",
                                   cc=["bob@example.com"]))
        db.session.commit()

    def dsn(email_id: int, recipient: bytes, tag: bytes) -> bytes:
        return (f"X-Original-To: {verp.sender_for(email_id)}\r\n".encode()
                + POSTFIX_DSN.replace(b"nobody-here@example.com", recipient)
                .replace(b"Message-Id: <", b"Message-Id: <" + tag))

    # Mallory names the victim in a bounce of her own email: kept, suppresses nobody.
    assert feed(app, dsn(alone, b"victim@example.com", b"a")).exit_code == 0
    # Ann names Bob in a bounce of the email both got: kept, suppresses nobody.
    assert feed(app, dsn(shared, b"bob@example.com", b"b")).exit_code == 0
    assert counts(app) == (2, 0)
    with app.app_context():
        assert mail.suppression("victim@example.com") is None
        assert mail.suppression("bob@example.com") is None
    # A bounce of a one-recipient email for that recipient is taken.
    assert feed(app, dsn(alone, b"mallory@example.com", b"c")).exit_code == 0
    with app.app_context():
        assert mail.suppression("mallory@example.com") is not None
        assert [e.recipient for e in mail.events(alone)] == ["victim@example.com",
                                                             "mallory@example.com"]


def test_a_complaint_that_names_nobody_is_the_sole_recipients(make_apps: MakeApps) -> None:
    """Feedback loops often redact the recipient: a one-recipient email says who it was."""
    app, mail = make_apps(TESTING=True)
    with app.app_context():
        email_id = mail.send(Message("News", ["reader@example.com"], "x"))
        db.session.commit()
    stored = rows(app)[0]["message_id"]
    arf = (b"From: feedback@isp.example\r\nTo: abuse@example.com\r\nSubject: complaint\r\n"
           b"Message-ID: <arf-1@isp.example>\r\nMIME-Version: 1.0\r\n"
           b'Content-Type: multipart/report; report-type=feedback-report; boundary="b"\r\n'
           b"\r\n--b\r\nContent-Type: text/plain\r\n\r\nA complaint.\r\n"
           b"--b\r\nContent-Type: message/feedback-report\r\n\r\n"
           b"Feedback-Type: abuse\r\nUser-Agent: ISP-FBL/1.0\r\nVersion: 1\r\n"
           b"\r\n--b\r\nContent-Type: text/rfc822-headers\r\n\r\n"
           b"From: shop@example.com\r\nTo: undisclosed-recipients:;\r\n"
           + f"Message-ID: {stored}\r\n".encode() + b"Subject: News\r\n\r\n--b--\r\n")
    assert feed(app, arf).exit_code == 0
    with app.app_context():
        (event,) = mail.events(email_id)
        assert (event.event_type, event.recipient) == ("complained", "reader@example.com")
        assert mail.suppression("reader@example.com") is not None
