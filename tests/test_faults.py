"""Transport faults through the real SMTP transport and the outbox, inline and durable.

One matrix: each case scripts one fault on a real :class:`FaultSMTPServer`,
sends one email through ``mail.send()`` + commit, and checks where the row
ends (status, attempts, the recorded error), the log level the library used,
whether it was retried, and the copies the server holds, counted by
Message-ID: nothing lost, nothing sent twice. Faults a server gets over
(``times=1``) end ``sent`` in both modes; faults that last end differently:
inline mode leaves the row ``queued`` for the sweep, durable mode dead-letters
it after ``OUTBOX_MAX_ATTEMPTS``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import MakeApps, db, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail

GOOD, BAD = "good@example.com", "bad@example.com"
#: Seconds the server stalls when it "never answers": far past MAIL_TIMEOUT.
NEVER = 60.0


@dataclass(frozen=True)
class Fault:
    """One scripted fault and what the outbox must make of it."""

    name: str
    script: Callable[[FaultSMTPServer], None]
    status: str  # the row's final status
    attempts: int  # attempts charged to the row at the end
    codes: list[int]  # error_history codes, oldest first (0: no SMTP code)
    error: bool  # an ERROR from flask_mail_outbox about this email
    copies: int  # copies of the Message-ID the server holds at the end
    recipients: list[str] = field(default_factory=lambda: [GOOD])
    last_error: str | None = None  # a substring of last_error, when one must stay


def _script_reply(phase: str, code: int, times: int | None = 1) -> Callable[[FaultSMTPServer], None]:
    return lambda server: server.reply(phase, code, times=times)  # type: ignore[arg-type]


def _refuse_bad(server: FaultSMTPServer) -> None:
    server.refuse_recipient(BAD, 550, "5.1.1 No such user")


# Faults the server gets over: every mode ends with one copy delivered.
RECOVERED = [
    Fault("421 at connect", _script_reply("connect", 421), "sent", 2, [421], False, 1),
    Fault("451 at DATA", _script_reply("data", 451), "sent", 2, [451], False, 1),
    Fault("drop mid-DATA", lambda s: s.drop_mid_data(after_bytes=32, times=1),
          "sent", 2, [0], False, 1),
    Fault("never answers the greeting", lambda s: s.delay("connect", NEVER, times=1),
          "sent", 2, [0], False, 1),
    Fault("never answers MAIL FROM", lambda s: s.delay("mail", NEVER, times=1),
          "sent", 2, [0], False, 1),
]

# Faults with one outcome in both modes: never retried.
FINAL = [
    Fault("552 too large", _script_reply("data", 552, None), "failed", 1, [552], True, 0,
          last_error="552"),
    Fault("550 for one recipient of two", _refuse_bad, "sent", 1, [550], True, 1,
          recipients=[GOOD, BAD], last_error=f"{BAD}: 550"),
]

# Faults that last: inline gives up in process (row stays queued), durable dead-letters.
LASTING_INLINE = [
    Fault("451 at DATA, lasting", _script_reply("data", 451, None), "queued", 2, [451, 451],
          True, 0, last_error="451"),
    Fault("421 at connect, lasting", _script_reply("connect", 421, None), "queued", 2,
          [421, 421], True, 0, last_error="421"),
]
LASTING_DURABLE = [
    Fault(f.name, f.script, "failed", 2, f.codes, True, 0, last_error=f.last_error)
    for f in LASTING_INLINE
]

MODES: dict[str, dict[str, Any]] = {
    "inline": {"OUTBOX_INLINE_RETRIES": 1},
    "durable": {"OUTBOX_DURABLE": True, "OUTBOX_MAX_ATTEMPTS": 2,
                "OUTBOX_RETRY_BASE_SECONDS": 0.05, "OUTBOX_RETRY_MAX_SECONDS": 0.2,
                "OUTBOX_POLL_INTERVAL": 0.05, "OUTBOX_POLL_MAX_INTERVAL": 0.2},
}

CASES = [
    *[pytest.param(mode, f, id=f"{mode}: {f.name}") for f in RECOVERED + FINAL
      for mode in MODES],
    *[pytest.param("inline", f, id=f"inline: {f.name}") for f in LASTING_INLINE],
    *[pytest.param("durable", f, id=f"durable: {f.name}") for f in LASTING_DURABLE],
]


def _outbox_errors(caplog: pytest.LogCaptureFixture, email_id: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("flask_mail_outbox") and r.levelno >= logging.ERROR
            and f"Email {email_id} " in r.getMessage()]


@pytest.mark.parametrize(("mode", "fault"), CASES)
def test_transport_fault_ends_in_the_right_state(
        mode: str, fault: Fault, make_apps: MakeApps, smtp_server: FaultSMTPServer,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    # MAIL_TIMEOUT=1 bounds a server that never answers; NEVER is 60 times that.
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          MAIL_TIMEOUT=1, **MODES[mode])
    fault.script(smtp_server)
    email_id = _send(app, mail, fault.recipients)

    [row] = wait_rows(app, lambda r: r[0]["status"] == fault.status
                      and r[0]["attempts"] == fault.attempts, timeout=30.0)
    with app.app_context():
        assert mail.wait_idle(30)
    [row] = rows(app)
    assert (row["status"], row["attempts"]) == (fault.status, fault.attempts)
    history = json.loads(row["error_history"] or "[]")
    assert [h["code"] for h in history] == fault.codes
    assert [h["attempt"] for h in history] == list(range(1, len(fault.codes) + 1))
    if fault.last_error is not None:
        assert fault.last_error in row["last_error"]

    # Copies by Message-ID: sent once, or never; a partial refusal reached only the good one.
    copies = [m for m in smtp_server.messages if m.message_id == row["message_id"]]
    assert len(copies) == fault.copies
    if copies:
        assert copies[0].rcpt_tos == [GOOD]
    # Deliberate window: no further attempt may follow the final state.
    tried = smtp_server.connections
    assert not smtp_server.wait_until(lambda: smtp_server.connections > tried, timeout=0.5)

    errors = _outbox_errors(caplog, email_id)
    assert bool(errors) == fault.error, errors


def test_a_server_that_never_answers_is_given_up_on_after_mail_timeout(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """MAIL_TIMEOUT bounds the wait: a generous bound, not a timed assertion.

    The server stalls the first greeting for a minute; the copy of the second
    attempt arrives within a third of that, so the client gave up on the
    first session by itself (closing it ends the server's stall too).
    """
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          MAIL_TIMEOUT=1, OUTBOX_INLINE_RETRIES=1)
    smtp_server.delay("connect", NEVER, times=1)
    _send(app, mail, [GOOD])
    assert smtp_server.wait_until(lambda: smtp_server.delaying == 1)
    assert smtp_server.wait_for(1, timeout=NEVER / 3)
    assert smtp_server.connections == 2
    [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=10.0)
    assert row["attempts"] == 2 and "timed out" in row["error_history"]


def test_a_server_slower_than_the_lease_gets_one_copy(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """The heartbeat renews the lease, so a rival dispatcher never reaps a slow send."""
    common: dict[str, Any] = {
        "MAIL_SERVER": smtp_server.host, "MAIL_PORT": smtp_server.port, "MAIL_TIMEOUT": 30,
        "OUTBOX_DURABLE": True, "OUTBOX_LEASE_SECONDS": 1, "OUTBOX_POLL_INTERVAL": 0.1,
        "OUTBOX_POLL_MAX_INTERVAL": 0.2}
    app, mail = make_apps(**common)
    rival, _ = make_apps(**common)  # reaps expired leases every 0.2 s
    rival.extensions["mail_outbox"].outbox().dispatch()
    smtp_server.delay("data", 3.5, times=1)  # 3.5 leases between content and reply
    _send(app, mail, [GOOD])
    [row] = wait_rows(app, lambda r: r[0]["status"] == "sent", timeout=30.0)
    assert row["attempts"] == 1
    assert [m.message_id for m in smtp_server.messages] == [row["message_id"]]
    assert smtp_server.data_attempts == 1


def _send(app: Flask, mail: OutboxMail, recipients: list[str]) -> int:
    with app.app_context():
        email_id = mail.send(Message("fault", recipients=list(recipients), body="x"))
        db.session.commit()
    return email_id


@pytest.mark.parametrize("mode", ["inline", "durable"])
def test_mail_and_rcpt_options_reach_the_server(
        mode: str, make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    """Flask-Mail's ``mail_options`` / ``rcpt_options`` go on MAIL FROM and RCPT TO.

    aiosmtpd implements BODY on MAIL FROM and no RCPT parameter at all: the
    555 it answers to ``NOTIFY=...`` proves the parameter was sent (it is the
    answer of any server without DSN), and it is permanent.
    """
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_DURABLE=mode == "durable", OUTBOX_POLL_INTERVAL=0.1)
    with app.app_context():
        with_body = mail.send(Message("body", recipients=[GOOD], body="x",
                                      mail_options=["BODY=8BITMIME"]))
        with_notify = mail.send(Message("dsn", recipients=[GOOD], body="x",
                                        rcpt_options=["NOTIFY=FAILURE"]))
        db.session.commit()
    done = wait_rows(app, lambda r: {x["status"] for x in r} <= {"sent", "failed"}
                     and len(r) == 2, timeout=20.0)
    by_id = {r["id"]: r for r in done}
    assert by_id[with_body]["status"] == "sent"
    [received] = smtp_server.messages
    assert "BODY=8BITMIME" in received.mail_options
    assert by_id[with_notify]["status"] == "failed"
    assert "555" in by_id[with_notify]["last_error"]
