"""The delivery core on its own: built from plain values, it delivers and records without Flask.

The script runs in a fresh interpreter, so nothing the test process imported
counts: it imports the core, builds an :class:`~flask_mail_outbox.core.Outbox`
from a database URL and settings, writes rows with plain SQLAlchemy, delivers
them through SMTP to the real server this test runs, records the outcomes, and
reports what it saw, including whether any Flask module was imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from smtpserver import FaultSMTPServer

SCRIPT = textwrap.dedent('''
    import json, sys

    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from flask_mail_outbox import Message
    from flask_mail_outbox.core import (
        Callbacks, Outbox, Producer, email_table, load_config, metadata, prepare_row)

    url, port = sys.argv[1], int(sys.argv[2])
    config = load_config({"MAIL_SERVER": "127.0.0.1", "MAIL_PORT": port,
                          "MAIL_DEFAULT_SENDER": "shop@example.com",
                          "OUTBOX_ALLOW_LOCAL_ADDRESSES": True},
                         instance_path="/nonexistent", testing=False)
    sent, failed = [], []
    outbox = Outbox(url, config, callbacks=Callbacks(
        sent=lambda email, provider_id: sent.append(email.message_id),
        failed=lambda email, error: failed.append((email.id, str(error)))))
    metadata.create_all(outbox.engine)
    rows = [prepare_row(Message(f"n{n}", recipients=[to], body="hello"), config,
                        key=None, due_at=None)
            for n, to in enumerate(["ann@example.com", "bob@example.com", "bad@example.com"])]
    producer = Producer(outbox)
    with Session(outbox.engine) as session:
        with session.begin():
            tickets = producer.enqueue(session, rows)
            producer.before_commit(session, tickets)
        producer.after_commit(tickets)
    ids = [ticket.email_id for ticket in tickets]
    outbox.worker.wait_idle(30)
    outbox.stop(10)
    with outbox.engine.connect() as conn:
        statuses = dict(conn.execute(sa.select(email_table.c.id, email_table.c.status)).all())
    print(json.dumps({
        "flask_modules": sorted(m for m in sys.modules
                                if m.split(".")[0] in ("flask", "flask_sqlalchemy", "werkzeug")),
        "ids": ids, "sent": sent, "failed": failed, "statuses": statuses,
        "message_ids": [row.values["message_id"] for row in rows],
    }))
''')


def test_the_core_delivers_and_records_with_flask_never_imported(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("bad@example.com", 550)
    result = subprocess.run([sys.executable, "-c", SCRIPT, db_url, str(smtp_server.port)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])

    assert seen["flask_modules"] == []
    ann, bob, bad = seen["ids"]
    assert seen["statuses"] == {str(ann): "sent", str(bob): "sent", str(bad): "failed"}
    # The callbacks heard each recorded outcome; the server got exactly the two accepted.
    assert sorted(seen["sent"]) == sorted(seen["message_ids"][:2])
    assert [email_id for email_id, _ in seen["failed"]] == [bad]
    assert "550" in seen["failed"][0][1]
    assert sorted(smtp_server.message_ids()) == sorted(seen["message_ids"][:2])


KEYED_SCRIPT = textwrap.dedent('''
    import json, sys

    from sqlalchemy.orm import Session

    from flask_mail_outbox import Message
    from flask_mail_outbox.core import Outbox, Producer, load_config, metadata, prepare_row

    url, port, interleave = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "interleave"
    config = load_config({"MAIL_SERVER": "127.0.0.1", "MAIL_PORT": port,
                          "MAIL_DEFAULT_SENDER": "shop@example.com",
                          "OUTBOX_ALLOW_LOCAL_ADDRESSES": True},
                         instance_path="/nonexistent", testing=False)
    outbox = Outbox(url, config)
    metadata.create_all(outbox.engine)
    producer = Producer(outbox)
    ids = []
    for step in ("received", "paid", "shipped"):
        row = prepare_row(Message(f"order 7 {step}", recipients=["ann@example.com"],
                                  body=step), config, key="order-7", due_at=None)
        with Session(outbox.engine) as session:
            with session.begin():
                tickets = producer.enqueue(session, [row])
                if interleave:
                    # The earlier email of the key finishes while this transaction is
                    # open: its record cannot hand the key to this row (locked, not
                    # committed); before_commit() must.
                    outbox.worker.wait_idle(30)
                producer.before_commit(session, tickets)
            producer.after_commit(tickets)
        ids += [ticket.email_id for ticket in tickets]
    idle = outbox.worker.wait_idle(30)
    outbox.stop(10)
    print(json.dumps({"ids": ids, "idle": idle}))
''')


def test_keyed_emails_go_out_in_order_through_the_producer(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    # On SQLite a transaction holds the write lock: the worker cannot record under it,
    # so only PostgreSQL interleaves a record with an open producer transaction.
    interleave = "interleave" if db_url.startswith("postgresql") else "plain"
    result = subprocess.run([sys.executable, "-c", KEYED_SCRIPT, db_url,
                             str(smtp_server.port), interleave],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["idle"] is True
    subjects = [m.data.split(b"Subject: ")[1].split(b"\r\n")[0].decode() for m in smtp_server.messages]
    assert subjects == ["order 7 received", "order 7 paid", "order 7 shipped"]
