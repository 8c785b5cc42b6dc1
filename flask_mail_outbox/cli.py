"""The ``flask outbox`` command group (registered through ``flask.commands``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

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


def _state() -> Any:
    _extension()
    return current_app.extensions["mail_outbox"]


@outbox_cli.command("worker")
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Concurrent SMTP connections (sends in flight) in this process.")
@click.option("--once", is_flag=True, help="Deliver what is due now, then exit 0.")
@click.option("--shutdown-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds sends in flight get to finish on SIGTERM/SIGINT.")
def worker(concurrency: int, once: bool, shutdown_timeout: float) -> None:
    """Run a durable dispatcher in the foreground (whatever the mode setting says).

    Any number of workers, on any number of machines sharing one PostgreSQL,
    cooperate: each claims its rows with FOR UPDATE SKIP LOCKED under a lease.
    SIGTERM or SIGINT stops claiming, lets sends in flight finish (or releases
    them after --shutdown-timeout) and exits 0.
    """
    state = _state()
    if state.current_runtime() is None:
        state.concurrency = concurrency
    runtime = state.runtime()
    dispatcher = runtime.ensure_dispatcher(start_thread=False)
    log = logging.getLogger("flask_mail_outbox.worker")
    if once:
        delivered = 0
        while True:
            report, full = dispatcher.tick()
            if report is None:
                break
            delivered += report.count
            if not full and report.count == 0:
                break
        click.echo(f"worker --once: {delivered} email(s) handled")
        state.stop(shutdown_timeout)
        return

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("Received %s: finishing sends in flight, then exiting",
                 signal.Signals(signum).name)
        dispatcher.request_stop()
        # Past the timeout, messages not yet handed to the server are released.
        timer = threading.Timer(shutdown_timeout, runtime.transport.cancel_pending)
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("outbox worker started (pid %d, concurrency %d)", os.getpid(), concurrency)
    try:
        dispatcher.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state.stop(shutdown_timeout)
    log.info("outbox worker stopped")


@outbox_cli.command("durable")
@click.argument("action", type=click.Choice(["on", "off", "status"]))
def durable(action: str) -> None:
    """Switch every process sharing the database to durable (on) or inline (off) delivery."""
    mail = _extension()
    if action == "status":
        click.echo("durable" if mail.durable else "inline")
        return
    mail.set_durable(action == "on")
    click.echo(f"delivery mode is now {'durable' if action == 'on' else 'inline'} "
               "for every process (each sees it within OUTBOX_SETTINGS_TTL_SECONDS)")
    mail.stop()
