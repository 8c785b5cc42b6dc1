"""DEBUG lines never carry an address, even when the server's reply echoes one (review2).

Servers commonly write the refused recipient into their reply (Postfix: ``550 5.1.1
<bob@example.com>: Recipient address rejected``); the reply and the record lines at
DEBUG quote that text, so the address is masked there.
"""

from __future__ import annotations

from conftest import MakeApps, db
from smtpserver import FaultSMTPServer
from test_cli import _flask

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox._errors import PermanentError, TransientError
from flask_mail_outbox.transports import Delivered, Failed, FailedOver
from flask_mail_outbox.transports._base import said


def test_debug_lines_mask_an_address_the_server_echoes(
        make_apps: MakeApps, db_url: str, smtp_server: FaultSMTPServer) -> None:
    make_apps()  # the tables
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False)
    assert isinstance(mail, OutboxMail)
    with app.app_context():
        refused = mail.send(Message("gone", recipients=["gone.person@example.com"], body="x"))
        later = mail.send(Message("later", recipients=["later.person@example.com"], body="x"))
        db.session.commit()
    smtp_server.reply("rcpt", 550, "5.1.1 <gone.person@example.com>: Recipient address "
                                   "rejected: User unknown", times=1)
    smtp_server.reply("data", 451, "4.3.0 Try again later, later.person@example.com", times=1)
    done = _flask(db_url, smtp_server.port, "worker", "--once", "--log-level", "debug")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines()
             if " DEBUG " in line and (f"Email {refused}" in line or f"Email {later}" in line)]
    # The lines are there (the reply's text included), the addresses are not.
    assert any("550" in line and "Recipient address rejected" in line for line in lines), lines
    assert any("451" in line and "Try again later" in line for line in lines), lines
    assert not [line for line in lines if "gone.person@" in line or "later.person@" in line], \
        lines


def test_the_reply_line_keeps_the_provider_id_and_masks_a_failover_s_address() -> None:
    """A Mailgun-style provider id has an "@": it is the operator's handle, kept whole; an
    address in a failed-over transport's reply is masked."""
    result = Delivered(provider_message_id="<20261207.1@mg.example.com>", failovers=(
        FailedOver("primary", PermanentError("550 5.1.1 <gone.person@example.com>: no"),
                   "backup"),))
    line = said(result)
    assert "provider id <20261207.1@mg.example.com>" in line
    assert "gone.person" not in line and "***@example.com" in line
    assert said(Failed(TransientError("451 4.3.0 later.person@example.com"))) == \
        "transient failure: 451 4.3.0 ***@example.com"
