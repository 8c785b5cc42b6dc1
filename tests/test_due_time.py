"""``send_after``: delivered at its due time, and dated when it becomes due.

A row that was not due when its commit handed it over cannot be in flight
anywhere, so the sweep's age gate does not apply to it: the committing
process's worker sends it when it is due, and if that process is gone, the
next sweep of any process takes it whatever its age. Its Date header is its
due time (an explicit ``Message(date=...)`` is kept as given), not the time
it was queued.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from conftest import MakeApps, db, poll, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core import email_table


def _hello(subject: str, **kwargs: Any) -> Message:
    return Message(subject, recipients=["a@example.com"], body="x", **kwargs)


def _date_of(mime: bytes) -> datetime:
    header = mime.split(b"\r\nDate: ", 1)[1].split(b"\r\n", 1)[0].decode()
    return parsedate_to_datetime(header).astimezone(UTC).replace(tzinfo=None)


def _to_the_second(when: datetime) -> datetime:
    """A Date header's precision."""
    return when.replace(microsecond=0)


def test_inline_send_after_goes_out_when_due_not_after_the_age_gate(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    """The committing process's worker sends a scheduled email when it is due; the
    sweep's age gate (300 s by default) does not hold it back. (These test apps run no
    sweep at all: only the worker can have sent it.)"""
    assert app.extensions["mail_outbox"].config.sweep_min_age_seconds == 300
    with app.app_context():
        later = mail.send(_hello("later"), send_after=timedelta(seconds=2))
        db.session.commit()
        mail.send(_hello("now"))
        db.session.commit()
    assert smtp_server.wait_for(2, timeout=30), [r["status"] for r in rows(app)]
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["now", "later"]
    [row] = [r for r in wait_rows(app, lambda rs: all(r["status"] == "sent" for r in rs),
                                  timeout=30) if r["id"] == later]
    assert row["status"] == "sent"
    assert row["sent_at"] >= row["due_at"]


def test_a_scheduled_email_of_a_stopped_process_is_swept_when_due_whatever_its_age(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """The committing process stops before the due time: another one's sweep takes
    the email once it is due, without waiting for the age gate, and does not count it
    as younger under the age gate."""
    smtp = {"MAIL_SERVER": smtp_server.host, "MAIL_PORT": smtp_server.port}
    first, first_mail = make_apps(**smtp)
    second, second_mail = make_apps(**smtp)
    with first.app_context():
        email_id = first_mail.send(_hello("later"), send_after=timedelta(seconds=1))
        db.session.commit()
    first_mail.stop(timeout=5)
    with second.app_context():
        # Before it is due nothing takes it; once due, a dry run would take it.
        report = poll(lambda: second_mail.sweep(dry_run=True),
                      lambda r: r.scanned or r.age_gated, timeout=15)
        assert (report.scanned, report.age_gated) == (1, 0), report
        report = second_mail.sweep()
    assert (report.scanned, report.sent, report.age_gated) == (1, 1, 0), report
    assert smtp_server.wait_for(1)
    assert [r["status"] for r in rows(second) if r["id"] == email_id] == ["sent"]


def test_durable_send_after_goes_out_when_due_not_at_the_next_poll(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """Durable mode: the committing process's dispatcher claims a scheduled row when
    it is due, whatever its idle backoff says (here its next poll is ten minutes off)."""
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=True, OUTBOX_LISTEN=False,
                          OUTBOX_POLL_INTERVAL=600, OUTBOX_POLL_MAX_INTERVAL=600)
    with app.app_context():
        mail.send(_hello("later"), send_after=timedelta(seconds=2))
        mail.send(_hello("now"))
        db.session.commit()
    assert smtp_server.wait_for(2, timeout=30)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == ["now", "later"]


def test_a_delayed_email_is_dated_when_it_becomes_due(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    with app.app_context():
        email_id = mail.send(_hello("later"), send_after=timedelta(seconds=2))
        db.session.commit()
    assert smtp_server.wait_for(1, timeout=30)
    [row] = [r for r in rows(app) if r["id"] == email_id]
    received = _date_of(smtp_server.messages[0].data)
    assert received == _to_the_second(row["due_at"]) == _date_of(row["mime"])


def test_a_reminder_three_days_ahead_is_dated_three_days_ahead(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    with app.app_context():
        soon = mail.send(_hello("soon"))
        reminder = mail.send(_hello("reminder"), send_after=timedelta(days=3))
        due = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
        fixed = mail.send(_hello("fixed"), send_after=due)
        db.session.commit()
    by_id = {r["id"]: r for r in rows(app)}
    queued_at = by_id[soon]["created_at"]
    assert _date_of(by_id[reminder]["mime"]) == _to_the_second(by_id[reminder]["due_at"])
    assert _date_of(by_id[reminder]["mime"]) - queued_at > timedelta(days=2, hours=23)
    assert _date_of(by_id[fixed]["mime"]) == due.replace(tzinfo=None)
    # An immediate one is dated when send() built it: before its commit.
    assert abs(_date_of(by_id[soon]["mime"]) - _to_the_second(queued_at)) <= timedelta(seconds=1)


def test_an_explicit_date_is_kept_as_given_even_when_delayed(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    given = datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC)
    with app.app_context():
        email_id = mail.send(_hello("dated", date=given), send_after=timedelta(days=3))
        db.session.commit()
    [row] = [r for r in rows(app) if r["id"] == email_id]
    assert _date_of(row["mime"]) == given.replace(tzinfo=None)


def test_a_retried_delayed_email_keeps_its_date(
        hand_ticked_app: Flask, smtp_server: FaultSMTPServer) -> None:
    """The first attempt is refused at the end of DATA (451), the second accepted: the
    message keeps the Date it got when it was queued, its due time."""
    app = hand_ticked_app
    mail: OutboxMail = app.extensions["test_mail"]
    smtp_server.reply("data", 451, times=1)
    with app.app_context():
        email_id = mail.send(_hello("later"), send_after=timedelta(seconds=1))
        db.session.commit()
    [queued] = rows(app)
    dated = _date_of(queued["mime"])
    assert dated == _to_the_second(queued["due_at"])
    outbox = app.extensions["mail_outbox"].outbox()

    def attempts() -> int:
        outbox.worker.tick(timeout=30)
        return int(rows(app)[0]["attempts"])

    assert poll(attempts, lambda n: n >= 1, timeout=15) == 1
    # Due again after its backoff: make it due now rather than wait for it.
    with outbox.store.write() as conn:
        conn.execute(email_table.update().where(email_table.c.id == email_id)
                     .values(due_at=datetime(2000, 1, 1)))
    outbox.worker.tick(timeout=30)
    assert smtp_server.wait_for(1)
    assert rows(app)[0]["status"] == "sent"
    assert _date_of(smtp_server.messages[0].data) == dated
