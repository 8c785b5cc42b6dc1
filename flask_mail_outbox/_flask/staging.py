"""Publishing staged emails when, and only when, the outermost transaction commits.

``send()`` stages each new row on the session transaction it was inserted in
(the innermost one: a savepoint when ``begin_nested()`` is active). SQLAlchemy
2 fires ``after_commit`` and ``after_rollback`` for savepoints too, so:

* a released savepoint hands its rows to its parent (not a publication);
* a rolled-back savepoint discards its rows; the outer transaction goes on;
* the outermost commit publishes what it holds;
* an outermost rollback discards (INFO);
* a session that ends with neither (``close()`` with staged rows: only
  ``after_transaction_end`` fires) is a forgotten ``commit()``: ERROR, naming
  the emails and the fix, unless the request was failing anyway.

(flask-sqlalchemy's ``track_modifications`` publishes on any ``after_commit``,
which would publish a savepoint's rows before the outer commit.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

from flask import g, has_app_context
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .. import _degrade

logger = logging.getLogger(__name__)

_KEY = "mail_outbox_staged"
_REQUEST_FAILED = "_mail_outbox_request_failed"


class Publisher(Protocol):
    """What receives committed rows (the per-app state)."""

    def prepare_commit(self, session: Session, entries: list[StagedEmail]) -> None:
        """Last statements inside the outermost transaction that holds ``entries``."""

    def publish(self, entries: list[StagedEmail]) -> None:
        """The outermost transaction committed these rows."""

    def cancel_ended(self, entries: list[StagedEmail]) -> None:
        """A transaction that cancelled ``entries`` ended without committing."""


@dataclasses.dataclass(frozen=True)
class StagedEmail:
    """A row inserted by ``send()`` whose transaction has not ended yet."""

    email_id: int
    due_now: bool
    publisher: Publisher
    # Its insert ran pg_notify already: the commit needs no NOTIFY for it.
    notified: bool = False
    # PostgreSQL: the key of an email that found an earlier one of its key open;
    # the commit hands the key on if that one finished meanwhile (see _ordering).
    waits_on_key: str | None = None
    # priority="high": handed to an inline worker before what already waits.
    urgent: bool = False
    # Not a new row but a cancel (mail.cancel()): nothing to deliver; after the
    # commit, the key of a cancelled row is handed on (``cancelled_key``).
    cancelled: bool = False
    cancelled_key: str | None = None


def stage(session: Session, entry: StagedEmail) -> None:
    """Remember ``entry`` on the session's innermost active transaction."""
    stage_many(session, [entry])


def stage_many(session: Session, entries: list[StagedEmail]) -> None:
    """Remember ``entries`` (``send_many()``'s, in order) as :func:`stage` each would."""
    trans = session.get_nested_transaction() or session.get_transaction()
    if trans is None:  # send() flushed, so there is always one; be explicit anyway
        raise RuntimeError("mail.send() needs an active session transaction")
    staged: dict[SessionTransaction, list[StagedEmail]] = session.info.setdefault(_KEY, {})
    staged.setdefault(trans, []).extend(entries)


def mark_request_failed() -> None:
    """Called when a request ends with an exception: its staged rows are not forgotten."""
    if has_app_context():
        setattr(g, _REQUEST_FAILED, True)


def _ending(session: Session) -> SessionTransaction | None:
    # Inside after_commit / after_rollback the transaction being ended is
    # still the session's innermost one.
    return session.get_nested_transaction() or session.get_transaction()


def _publish(entries: list[StagedEmail]) -> None:
    by_publisher: dict[int, tuple[Publisher, list[StagedEmail]]] = {}
    for entry in entries:
        by_publisher.setdefault(id(entry.publisher), (entry.publisher, []))[1].append(entry)
    for publisher, group in by_publisher.values():
        publisher.publish(group)


def _before_commit(session: Session) -> None:
    staged: dict[SessionTransaction, list[StagedEmail]] | None = session.info.get(_KEY)
    if not staged or session.get_nested_transaction() is not None:
        return  # a savepoint is being released: not the commit that publishes
    publishers: dict[int, tuple[Publisher, list[StagedEmail]]] = {}
    for entries in staged.values():
        for entry in entries:
            if not entry.notified or entry.waits_on_key is not None:
                publishers.setdefault(id(entry.publisher), (entry.publisher, []))[1].append(entry)
    for publisher, group in publishers.values():
        publisher.prepare_commit(session, group)


def _take_ending(session: Session) -> tuple[
        dict[SessionTransaction, list[StagedEmail]], SessionTransaction,
        list[StagedEmail]] | None:
    """The staged rows of the transaction that is ending now (removed from the map)."""
    staged: dict[SessionTransaction, list[StagedEmail]] | None = session.info.get(_KEY)
    if not staged:
        return None
    trans = _ending(session)
    if trans is None:
        return None
    return staged, trans, staged.pop(trans, None) or []


def _after_commit(session: Session) -> None:
    ending = _take_ending(session)
    if ending is None or not ending[2]:
        return
    staged, trans, entries = ending
    if trans.parent is not None:
        staged.setdefault(trans.parent, []).extend(entries)
        return
    _publish(entries)


def _after_rollback(session: Session) -> None:
    ending = _take_ending(session)
    if ending is None:
        return
    staged, trans, entries = ending
    if entries:
        _log_discarded(entries)
    if trans.parent is None:
        # A rollback of the outermost transaction undoes every savepoint too.
        for leftover in staged.values():
            if leftover:
                _log_discarded(leftover)
        staged.clear()


def _log_discarded(entries: list[StagedEmail]) -> None:
    sends = [e.email_id for e in entries if not e.cancelled]
    cancels = [e.email_id for e in entries if e.cancelled]
    _cancel_ended([e for e in entries if e.cancelled])
    if sends:
        logger.info("Rollback discarded %d staged email(s) %s; nothing was sent.",
                    len(sends), sends)
    if cancels:
        logger.info("Rollback undid the cancel of %d email(s) %s; they stay queued.",
                    len(cancels), cancels)


def _after_transaction_end(session: Session, trans: SessionTransaction) -> None:
    staged: dict[SessionTransaction, list[StagedEmail]] | None = session.info.get(_KEY)
    if not staged:
        return
    entries = staged.pop(trans, None)
    if not entries:
        return
    if trans.parent is not None:
        # Closed without commit or rollback of its own: the parent decides.
        staged.setdefault(trans.parent, []).extend(entries)
        return
    cancels = [e.email_id for e in entries if e.cancelled]
    ids = [e.email_id for e in entries if not e.cancelled]
    if has_app_context() and g.get(_REQUEST_FAILED):
        logger.info("The request failed before committing; %d staged email(s) %s and %d "
                    "cancel(s) %s were discarded with its transaction.", len(ids), ids,
                    len(cancels), cancels)
        return
    _cancel_ended([e for e in entries if e.cancelled])
    if cancels:
        _degrade.report(
            f"The session ended without commit() or rollback() while the cancel of "
            f"{len(cancels)} email(s) {cancels} was pending in it (a forgotten "
            "db.session.commit()?)",
            consequence="they were not cancelled: they stay queued and will be sent",
            fix="call db.session.commit() after mail.cancel()")
    if not ids:
        return
    _degrade.report(
        f"The session ended without commit() or rollback() while {len(ids)} email(s) "
        f"{ids} were staged in it (a forgotten db.session.commit()?)",
        consequence="those emails were never stored and will not be sent",
        fix="call db.session.commit() after mail.send() (or db.session.rollback() when the "
            "emails must not go out)")


def _cancel_ended(entries: list[StagedEmail]) -> None:
    """Tell each publisher of the cancels a transaction dropped (their keys go on)."""
    by_publisher: dict[int, tuple[Publisher, list[StagedEmail]]] = {}
    for entry in entries:
        by_publisher.setdefault(id(entry.publisher), (entry.publisher, []))[1].append(entry)
    for publisher, group in by_publisher.values():
        publisher.cancel_ended(group)


_installed: set[int] = set()


def install(session_target: Any) -> None:
    """Listen on ``session_target`` (a scoped_session, sessionmaker or Session class) once."""
    if id(session_target) in _installed:
        return
    _installed.add(id(session_target))
    listeners: list[tuple[str, Callable[..., None]]] = [
        ("before_commit", _before_commit),
        ("after_commit", _after_commit),
        ("after_rollback", _after_rollback),
        ("after_transaction_end", _after_transaction_end),
    ]
    for name, fn in listeners:
        event.listen(session_target, name, fn)
