"""The app of a ``flask outbox worker`` subprocess with a ``@mail.before_send`` hook.

Run as ``flask --app staging_helpers:create_app outbox worker`` with the
environment of tests/worker_app.py (``WORKER_DB_URL``, ``WORKER_SMTP_PORT``). The
hook marks each email with the process that ran it and the app whose context it
ran in, and redirects it to ``hook@team.org``: tests/test_staging.py reads both at
the SMTP server.
"""

from __future__ import annotations

import os

from flask import Flask, current_app
from worker_app import create_app as create_worker_app

from flask_mail_outbox import OutboxMail
from flask_mail_outbox.core import OutgoingEmail


def create_app() -> Flask:
    """tests/worker_app.py's app, with the hook registered."""
    app = create_worker_app()
    mail: OutboxMail = app.extensions["mail_outbox"].ext

    @mail.before_send
    def mark(email: OutgoingEmail) -> None:
        email.set_header("X-Hook-Pid", str(os.getpid()))
        email.set_header("X-Hook-App", current_app.import_name)
        email.recipients = ["hook@team.org"]

    return app
