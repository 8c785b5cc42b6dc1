"""``mail.send_many()``: N ``send()`` calls in one multi-row insert, all or nothing."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import db, rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import InvalidMessage, Message, OutboxMail, email_queued
from flask_mail_outbox.core import attachment_table

# Columns that differ between two sends of the same message whatever the route.
_PER_SEND = {"id", "message_id", "mime", "created_at", "due_at", "scheduled_for", "size"}


def letter(i: int, **kwargs: Any) -> Message:
    return Message(f"Letter {i}", recipients=[f"user{i}@example.com"], body=f"Hello {i}",
                   **kwargs)


def with_attachment(i: int) -> Message:
    msg = letter(i, cc=[f"cc{i}@example.com"], bcc=["audit@example.com"])
    msg.attach(f"report-{i}.txt", "text/plain", f"report {i}\n" * (i + 1))
    return msg


def attachments(app: Flask) -> list[dict[str, Any]]:
    with app.app_context(), db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(attachment_table.select().order_by(
            attachment_table.c.email_id, attachment_table.c.position)).mappings()]


def comparable(row: dict[str, Any]) -> dict[str, Any]:
    # key_head: the test asserts it apart (the second batch queues behind the first).
    return {k: v for k, v in row.items() if k not in _PER_SEND | {"key_head"}}


@pytest.mark.parametrize("key", [None, "account-7"])
def test_rows_and_attachments_are_those_of_n_sends(
        app: Flask, mail: OutboxMail, key: str | None) -> None:
    messages = [with_attachment(i) if i % 2 else letter(i) for i in range(5)]
    hold = timedelta(hours=1)  # nothing due: the rows stay as the insert wrote them
    one_by_one = [mail.send(m, key=key, send_after=hold) for m in messages]
    db.session.commit()
    many = mail.send_many([with_attachment(i) if i % 2 else letter(i) for i in range(5)],
                          key=key, send_after=hold)
    db.session.commit()
    by_id = {r["id"]: r for r in rows(app)}
    assert len(by_id) == 10
    assert many == sorted(many) and many[0] > one_by_one[-1]
    if key is not None:
        # The second batch waits behind the first, whose head holds the key.
        assert [by_id[i]["key_head"] for i in one_by_one] == [True, False, False, False, False]
        assert [by_id[i]["key_head"] for i in many] == [False] * 5
    for single, batched in zip(one_by_one, many, strict=True):
        assert comparable(by_id[batched]) == comparable(by_id[single])
        assert json.loads(by_id[batched]["recipients"]) == json.loads(
            by_id[single]["recipients"])
    atts = attachments(app)
    strip = [{k: v for k, v in a.items() if k not in ("id", "email_id")} for a in atts]
    assert [a["email_id"] for a in atts] == [one_by_one[1], one_by_one[3], many[1], many[3]]
    assert strip[:2] == strip[2:]


def test_ids_come_back_in_message_order(app: Flask, mail: OutboxMail) -> None:
    n = 1200  # more than one page of insertmanyvalues (1000 rows)
    inserts: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO OUTBOX_EMAIL"):
            inserts.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", count)
    try:
        ids = mail.send_many([letter(i) for i in range(n)], send_after=timedelta(hours=1))
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", count)
    assert len(inserts) <= 2  # multi-row statements, not one per email
    db.session.commit()
    by_id = {r["id"]: r for r in rows(app)}
    assert len(ids) == n == len(set(ids))
    assert [by_id[i]["subject"] for i in ids] == [f"Letter {i}" for i in range(n)]
    assert [json.loads(by_id[i]["recipients"]) for i in ids[:3]] == [
        ["user0@example.com"], ["user1@example.com"], ["user2@example.com"]]


def test_commit_delivers_every_one_with_its_attachment(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    ids = mail.send_many([with_attachment(i) for i in range(6)])
    assert not smtp_server.wait_for(1, timeout=0.3)  # nothing before the commit
    db.session.commit()
    assert smtp_server.wait_for(6)
    assert mail.wait_idle(10)
    assert [r["status"] for r in rows(app)] == ["sent"] * 6
    by_subject = {m.parsed["Subject"]: m for m in smtp_server.messages}
    assert sorted(by_subject) == [f"Letter {i}" for i in range(6)]
    received = by_subject["Letter 4"]
    assert sorted(received.rcpt_tos) == ["audit@example.com", "cc4@example.com",
                                         "user4@example.com"]
    [part] = list(received.parsed.iter_attachments())
    assert part.get_filename() == "report-4.txt"
    assert part.get_content() == "report 4\n" * 5
    assert {r["message_id"] for r in rows(app)} == set(smtp_server.message_ids())
    assert len(ids) == 6


def test_keyed_batch_is_delivered_in_order_after_commit(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send_many([letter(i) for i in range(8)], key="order-1")
    db.session.commit()
    assert smtp_server.wait_for(8)
    assert mail.wait_idle(10)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == [
        f"Letter {i}" for i in range(8)]
    assert [r["status"] for r in rows(app)] == ["sent"] * 8


def test_keyed_batch_behind_an_open_email_of_its_key(
        hand_ticked_app: Flask, smtp_server: FaultSMTPServer) -> None:
    # Durable, ticked by hand: the batch's first email finds an earlier one
    # open, so the key passes along only as each finishes (PostgreSQL: the
    # commit advances it).
    from conftest import hand_ticked_worker

    app = hand_ticked_app
    mail: OutboxMail = app.extensions["test_mail"]
    worker = hand_ticked_worker(app)
    with app.app_context():
        mail.send(letter(100), key="k")
        db.session.commit()
        mail.send_many([letter(i) for i in range(3)], key="k")
        db.session.commit()
        for _ in range(8):
            worker.tick()
            mail.wait_idle(5)
    assert smtp_server.wait_for(4)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == [
        "Letter 100", "Letter 0", "Letter 1", "Letter 2"]


# SQLite runs one writer at a time: the earlier email cannot be recorded while
# the batch's transaction is open, so the race is PostgreSQL's only.
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_key_passes_to_a_batch_whose_predecessor_finished_before_its_commit(
        hand_ticked_app: Flask, smtp_server: FaultSMTPServer) -> None:
    from conftest import hand_ticked_worker

    app = hand_ticked_app
    mail: OutboxMail = app.extensions["test_mail"]
    worker = hand_ticked_worker(app)
    with app.app_context():
        mail.send(letter(100), key="k")
        db.session.commit()
        mail.send_many([letter(i) for i in range(3)], key="k")
        # The earlier email is sent and recorded while the batch is uncommitted:
        # its recorder sees no successor, so the batch's commit must hand the key on.
        worker.tick()
        assert smtp_server.wait_for(1)
        assert [(r["subject"], r["status"]) for r in rows(app)] == [("Letter 100", "sent")]
        db.session.commit()
        for _ in range(6):
            worker.tick()
            mail.wait_idle(5)
    assert smtp_server.wait_for(4)
    assert [m.parsed["Subject"] for m in smtp_server.messages] == [
        "Letter 100", "Letter 0", "Letter 1", "Letter 2"]


def test_rollback_writes_and_sends_nothing(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send_many([with_attachment(i) for i in range(4)], key="k")
    db.session.rollback()
    assert mail.wait_idle(5)
    assert not smtp_server.wait_for(1, timeout=0.5)
    assert rows(app) == []
    assert attachments(app) == []


def test_rolled_back_savepoint_discards_only_its_batch(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send(letter(0))
    nested = db.session.begin_nested()
    mail.send_many([letter(1), letter(2)])
    nested.rollback()
    mail.send_many([letter(3)])
    db.session.commit()
    assert smtp_server.wait_for(2)
    assert mail.wait_idle(10)
    assert sorted(m.parsed["Subject"] for m in smtp_server.messages) == ["Letter 0",
                                                                          "Letter 3"]


def test_bad_message_mid_list_names_its_index_and_writes_nothing(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    messages = [letter(i) for i in range(600)]
    messages[537] = Message("Broken", recipients=["not an address"], body="x")
    kept = mail.send(letter(1000))  # the transaction's own earlier work stays
    with pytest.raises(InvalidMessage) as info:
        mail.send_many(messages)
    assert info.value.field == "messages[537].recipients[0]"
    assert str(info.value).startswith("messages[537].recipients[0]: ")
    db.session.commit()
    assert [r["id"] for r in rows(app)] == [kept]


def test_not_a_message_names_its_index(app: Flask, mail: OutboxMail) -> None:
    with pytest.raises(InvalidMessage, match=r"^messages\[1\]\.msg: expected a "):
        mail.send_many([letter(0), "hello"])  # type: ignore[list-item]
    with pytest.raises(InvalidMessage, match="^key: "):
        mail.send_many([letter(0)], key="")
    db.session.commit()
    assert rows(app) == []


def test_empty_list_queues_nothing(app: Flask, mail: OutboxMail) -> None:
    assert mail.send_many([]) == []
    assert mail.send_many(iter([])) == []
    db.session.commit()
    assert rows(app) == []


def test_email_queued_fires_once_per_email_after_commit(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    seen: list[int] = []

    def on_queued(sender: Flask, email_id: int, **_: Any) -> None:
        seen.append(email_id)

    with email_queued.connected_to(on_queued, app):
        ids = mail.send_many([letter(i) for i in range(3)])
        assert seen == []
        db.session.commit()
    assert seen == ids
    assert smtp_server.wait_for(3)


def test_send_after_holds_the_whole_batch(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    mail.send_many([letter(i) for i in range(3)], send_after=timedelta(hours=2))
    db.session.commit()
    assert mail.wait_idle(5)
    assert not smtp_server.wait_for(1, timeout=0.5)
    due = [(r["due_at"], r["created_at"]) for r in rows(app)]
    assert len(due) == 3
    assert all(d - c > timedelta(hours=1, minutes=59) for d, c in due)
