"""A server's reply that a database cannot store never stalls delivery nor sends mail twice.

Issue 36, defect 1: an SMTP reply text with a NUL byte went into ``last_error``
and ``mta_response``; PostgreSQL refused it (DataError), the delivery thread
took that for a database outage, slept through its record retries (about a
minute) and left the batch ``sending``, to be sent again at each lease expiry.

Two layers, each tested on its own, on both databases, in both modes:

* the boundary: every SMTP reply is made safe (:mod:`flask_mail_outbox._outside`)
  where it is read, so the row stores the reply with U+FFFD for the NUL;
* the record's fallback: an outcome whose text the database refuses anyway (a
  custom transport hands one past every boundary) is recorded again with its
  outside text made safe, never retried as an outage nor sent again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
from conftest import MakeApps, db, rows, wait_rows
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message
from flask_mail_outbox.transports import (
    Delivered,
    Envelope,
    Report,
    Result,
    Sending,
    Transport,
)
from flask_mail_outbox.transports._base import _OneAtATime

GOOD, BAD, OTHER = "good@example.com", "bad@example.com", "other@example.com"
#: What the server answers BAD: an unknown user, with a NUL in the middle.
POISON = "5.1.1 no such\x00user"

MODES: dict[str, dict[str, Any]] = {
    "inline": {},
    "durable": {"OUTBOX_DURABLE": True, "OUTBOX_POLL_INTERVAL": 0.05,
                "OUTBOX_POLL_MAX_INTERVAL": 0.2},
}
#: A lease short enough that a batch left ``sending`` would be claimed and sent
#: again within the test's window (the defect's second copy).
SHORT_LEASE = {"OUTBOX_LEASE_SECONDS": 2, "OUTBOX_MAX_ATTEMPTS": 3}
#: Far below the record retries' minute of sleeps the defect cost.
PROMPT = 10.0


def _send_pair(app: Any, mail: Any) -> tuple[int, int]:
    """One email to GOOD and BAD, one unrelated to OTHER, in one commit (one batch)."""
    with app.app_context():
        partly = mail.send(Message("partly refused", recipients=[GOOD, BAD], body="x"))
        unrelated = mail.send(Message("unrelated", recipients=[OTHER], body="y"))
        db.session.commit()
    return partly, unrelated


def _copies(server: FaultSMTPServer, message_id: str) -> int:
    return sum(1 for m in server.messages if m.message_id == message_id)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_nul_in_a_recipients_refusal_is_stored_cleaned_and_sent_once(
        mode: str, make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    smtp_server.refuse_recipient(BAD, 550, POISON)
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          **MODES[mode], **SHORT_LEASE)
    started = time.monotonic()
    partly, unrelated = _send_pair(app, mail)

    done = wait_rows(app, lambda r: len(r) == 2 and all(x["status"] == "sent" for x in r),
                     timeout=PROMPT)
    took = time.monotonic() - started
    by_id = {r["id"]: r for r in done}
    assert [by_id[partly]["status"], by_id[unrelated]["status"]] == ["sent", "sent"], done
    assert took < PROMPT

    # Stored as the server said it, the NUL made U+FFFD.
    refused = by_id[partly]["last_error"]
    assert f"{BAD}: 550 5.1.1 no such\ufffduser" in refused, refused
    assert "\x00" not in refused
    history = json.loads(by_id[partly]["error_history"])
    assert history[-1]["message"].endswith("no such\ufffduser")
    with app.app_context():
        events = mail.events(partly)
    assert [(e.event_type, e.recipient) for e in events] == [("bounced", BAD)]
    assert events[0].mta_response == "550 5.1.1 no such\ufffduser"

    # Past two leases: nothing was claimed again, each email arrived once.
    tried = smtp_server.connections
    assert not smtp_server.wait_until(lambda: smtp_server.connections > tried, timeout=4.5)
    assert _copies(smtp_server, by_id[partly]["message_id"]) == 1
    assert _copies(smtp_server, by_id[unrelated]["message_id"]) == 1
    assert [m.rcpt_tos for m in smtp_server.messages
            if m.message_id == by_id[partly]["message_id"]] == [[GOOD]]
    assert [(r["status"], r["attempts"]) for r in rows(app)] == [("sent", 1), ("sent", 1)]
    # Made safe where it was read: the record's own fallback was not needed.
    assert not [r for r in caplog.records if "database refused" in r.getMessage()]


class PoisonTransport(Transport):
    """Hands back, past every boundary, what a database cannot store.

    BAD is refused with a NUL and a lone surrogate in the reply; the provider's
    id of a delivered message has a NUL too. Counts each message it is given.
    """

    sent: ClassVar[list[str]] = []

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        PoisonTransport.sent.append(envelope.message_id)
        if BAD in envelope.recipients:
            return {BAD: (550, "5.1.1 no such\x00user \udcff")}
        return {}


class FailingPoisonTransport(Transport):
    """Fails every message permanently with a NUL in the error text."""

    sent: ClassVar[list[str]] = []

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        from flask_mail_outbox import PermanentError
        FailingPoisonTransport.sent.append(envelope.message_id)
        raise PermanentError("554 rejected\x00 for policy \udcff", code=554)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_record_holds_without_the_boundary(
        mode: str, make_apps: MakeApps) -> None:
    """A custom transport's text is not cleaned at a boundary: the record's fallback holds."""
    PoisonTransport.sent = []
    app, mail = make_apps(OUTBOX_TRANSPORT="test_poisoned_replies:PoisonTransport",
                          **MODES[mode], **SHORT_LEASE)
    started = time.monotonic()
    partly, unrelated = _send_pair(app, mail)
    done = wait_rows(app, lambda r: len(r) == 2 and all(x["status"] == "sent" for x in r),
                     timeout=PROMPT)
    assert time.monotonic() - started < PROMPT
    by_id = {r["id"]: r for r in done}
    assert [by_id[partly]["status"], by_id[unrelated]["status"]] == ["sent", "sent"], done
    stored = by_id[partly]["last_error"]
    assert "\x00" not in stored and f"{BAD}: 550" in stored, stored
    # Past two leases: neither was handed to the transport again.
    time.sleep(4.5)
    assert sorted(PoisonTransport.sent) == sorted(
        [by_id[partly]["message_id"], by_id[unrelated]["message_id"]])
    assert [r["status"] for r in rows(app)] == ["sent", "sent"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_permanent_failure_with_a_poisoned_text_ends_failed_once(
        mode: str, make_apps: MakeApps) -> None:
    FailingPoisonTransport.sent = []
    app, mail = make_apps(OUTBOX_TRANSPORT="test_poisoned_replies:FailingPoisonTransport",
                          **MODES[mode], **SHORT_LEASE)
    with app.app_context():
        email_id = mail.send(Message("refused", recipients=[GOOD], body="x"))
        db.session.commit()
    [row] = wait_rows(app, lambda r: r[0]["status"] == "failed", timeout=PROMPT)
    assert row["status"] == "failed" and row["id"] == email_id
    assert "rejected" in row["last_error"] and "\x00" not in row["last_error"]
    assert "\ufffd" in row["last_error"]
    time.sleep(4.5)
    assert FailingPoisonTransport.sent == [row["message_id"]]


class _LongIds(_OneAtATime):
    def _send(self, envelope: Envelope) -> Result:
        LongIdTransport.sent.append(envelope.message_id)
        # Longer than provider_message_id's 255 characters: PostgreSQL refuses it.
        return Delivered(provider_message_id="id-" + "x" * 300 + "\x00")


class LongIdTransport(Transport):
    """A transport whose stream hands back a provider id no column can hold."""

    sent: ClassVar[list[str]] = []

    def open(self, report: Report) -> Sending:
        return _LongIds(self, report)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_provider_id_too_long_for_its_column_is_stored_cut_and_sent_once(
        mode: str, make_apps: MakeApps, backend: str) -> None:
    """PostgreSQL refuses the 304 characters (and the NUL); SQLite stores any length."""
    LongIdTransport.sent = []
    app, mail = make_apps(OUTBOX_TRANSPORT="test_poisoned_replies:LongIdTransport",
                          **MODES[mode], **SHORT_LEASE)
    with app.app_context():
        mail.send(Message("long id", recipients=[GOOD], body="x"))
        db.session.commit()
    [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=PROMPT)
    assert row["status"] == "sent"
    stored = row["provider_message_id"]
    assert stored is not None and stored.startswith("id-x")
    if backend == "postgresql":
        assert len(stored) <= 255 and "\x00" not in stored
    time.sleep(4.5)
    assert LongIdTransport.sent == [row["message_id"]]
