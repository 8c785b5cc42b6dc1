"""An email's page with a huge header, and the subject ``send()`` takes (issue 36, defect 8).

The page decoded every header with the stdlib's header parser, which slices
the rest of a header for each encoded word it reads: a 1 MB subject took
36.8 s a view, 400,000 ``é`` 31.5 s. The page now decodes the first
8,000 characters of a header (the row keeps it whole), and ``send()``
refuses a subject over 10,000 characters, naming ``subject``. A row stored
before that (or by another writer) still has its page: the test puts such a
message into a row, and checks the page's CPU time at N and 4N.
"""

from __future__ import annotations

import base64
import time

import pytest
import sqlalchemy as sa
from conftest import db as test_db
from conftest import rows
from flask import Flask

from flask_mail_outbox import InvalidMessage, Message, OutboxMail
from flask_mail_outbox._compose.message import MAX_SUBJECT_CHARS
from flask_mail_outbox.core import email_table

PREFIX = "/outbox"


@pytest.fixture
def dashboard(app: Flask, mail: OutboxMail) -> Flask:
    app.register_blueprint(mail.dashboard_blueprint(authorize=lambda: True), url_prefix=PREFIX)
    return app


def stored_with_subject(app: Flask, mail: OutboxMail, subject: str) -> int:
    """A queued row whose subject and stored message are ``subject`` (as an older writer's)."""
    from datetime import timedelta

    with app.app_context():
        email_id = mail.send(Message("placeholder", ["a@example.com"], "hi"),
                             send_after=timedelta(days=1))
        test_db.session.commit()
    # Encoded words of 15 characters, folded, as a mail library writes them (made here:
    # the stdlib's own folding of such a subject is quadratic too).
    words = [subject[i:i + 15] for i in range(0, len(subject), 15)]
    encoded = "\r\n ".join(f"=?utf-8?b?{base64.b64encode(w.encode()).decode()}?="
                            for w in words)
    mime = (f"From: shop@example.com\r\nTo: a@example.com\r\nSubject: {encoded}\r\n"
            "MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nhi\r\n")
    with app.app_context(), test_db.engine.begin() as conn:
        conn.execute(sa.update(email_table).where(email_table.c.id == email_id)
                     .values(subject=subject, mime=mime.encode()))
    return email_id


def page_cpu_seconds(app: Flask, email_id: int) -> float:
    client = app.test_client()
    client.get(f"{PREFIX}/emails/{email_id}")  # warm
    best = float("inf")
    for _ in range(2):
        started = time.thread_time()
        answer = client.get(f"{PREFIX}/emails/{email_id}")
        best = min(best, time.thread_time() - started)
        assert answer.status_code == 200
    return best


@pytest.mark.parametrize("unit", ["é", "x"])
def test_the_page_of_a_huge_subject_is_linear(dashboard: Flask, mail: OutboxMail,
                                              unit: str) -> None:
    n = 50_000 if unit == "é" else 200_000
    small = stored_with_subject(dashboard, mail, unit * n)
    large = stored_with_subject(dashboard, mail, unit * 4 * n)
    t_small, t_large = page_cpu_seconds(dashboard, small), page_cpu_seconds(dashboard, large)
    # Quadratic, 50,000 é took 1 s and 200,000 took 16 s; linear, both take a few ms.
    assert t_large < 1.0 or t_large < 8 * t_small, (t_small, t_large)
    page = dashboard.test_client().get(f"{PREFIX}/emails/{large}").get_data(as_text=True)
    assert "more characters stored" in page  # the header table says it was cut
    assert unit * 1000 in page


def test_send_refuses_a_subject_over_the_cap_naming_it(app: Flask, mail: OutboxMail) -> None:
    with app.app_context():
        with pytest.raises(InvalidMessage) as caught:
            mail.send(Message("é" * (MAX_SUBJECT_CHARS + 1), ["a@example.com"], "hi"))
        assert caught.value.field == "subject"
        assert "10,001 characters" in str(caught.value)
        test_db.session.rollback()
    assert rows(app) == []
    with app.app_context():
        mail.send(Message("😀" * MAX_SUBJECT_CHARS, ["a@example.com"], "hi"))
        test_db.session.commit()
    (row,) = rows(app)
    assert row["subject"] == "😀" * MAX_SUBJECT_CHARS
