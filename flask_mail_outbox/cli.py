"""The ``flask outbox`` command group (registered through ``flask.commands``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
from flask import current_app
from flask.cli import AppGroup

from ._errors import InvalidMessage
from ._message import Message

if TYPE_CHECKING:
    from ._extension import OutboxMail

outbox_cli = AppGroup("outbox", help="Inspect and operate the email outbox.")


def _extension() -> OutboxMail:
    state = current_app.extensions.get("mail_outbox")
    if state is None:
        raise click.ClickException(
            "flask-mail-outbox is not registered on this app (call OutboxMail(app) or "
            "mail.init_app(app) in your app factory)")
    mail: OutboxMail = state.ext
    return mail


@outbox_cli.command("send-test")
@click.option("--to", "to", required=True, metavar="ADDRESS", help="Recipient address.")
@click.option("--subject", default="flask-mail-outbox test email", show_default=True)
@click.option("--timeout", default=60.0, show_default=True,
              help="Seconds to wait for the delivery.")
def send_test(to: str, subject: str, timeout: float) -> None:
    """Send one real email through the configured transport and report the outcome."""
    from ._models import email_table

    mail = _extension()
    db = current_app.extensions["mail_outbox"].db
    message = Message(subject, recipients=[to],
                      body="This is a test email from flask-mail-outbox (flask outbox send-test).")
    try:
        email_id = mail.send(message)
    except InvalidMessage as exc:
        raise click.BadParameter(str(exc), param_hint="--to") from exc
    db.session.commit()
    idle = mail.wait_idle(timeout)
    row = db.session.execute(
        email_table.select().where(email_table.c.id == email_id)).mappings().one()
    db.session.rollback()
    click.echo(f"email {email_id} {row['message_id']}: {row['status']} "
               f"after {row['attempts']} attempt(s)")
    if row["status"] != "sent":
        detail = row["last_error"] or ("still in progress" if not idle else "not delivered")
        click.echo(f"error: {detail}", err=True)
        mail.stop()
        sys.exit(1)
    mail.stop()
