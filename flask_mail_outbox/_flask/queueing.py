"""Queuing rows in the caller's transaction: what ``send()`` does with a prepared row.

:func:`queue_rows` inserts rows :func:`~flask_mail_outbox.core.prepare_row`
built, in the current ``db.session`` transaction, and stages them for
publication at the outermost commit. ``mail.send()``, ``mail.send_many()``
and Flask-Mail's ``mail.connect()`` all go through it.
"""

from __future__ import annotations

from ..core._internal import QueuedRow, email_dialect, insert_emails
from . import staging
from .state import AppState


def queue_rows(state: AppState, rows: list[QueuedRow], *, key: str | None) -> list[int]:
    """Insert prepared rows in the current transaction and stage them; their ids."""
    if not rows:
        return []
    session = state.db.session()
    dialect = email_dialect(session)
    notify = notifies(state, dialect)
    inserted = insert_emails(session, [(row.values, row.attachments) for row in rows],
                             key=key, notify=notify, dialect=dialect)
    staging.stage_many(session, [
        staging.StagedEmail(email_id=email_id, due_now=row.due_now, publisher=state,
                             notified=notify, waits_on_key=key if waits else None,
                             urgent=row.urgent)
        for (email_id, waits), row in zip(inserted, rows, strict=True)])
    return [email_id for email_id, _ in inserted]


def notifies(state: AppState, dialect: str) -> bool:
    """Whether the insert itself runs the NOTIFY that prepare_commit() would send at commit."""
    return state.config.listen and dialect == "postgresql" and state.durable()
