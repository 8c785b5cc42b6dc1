"""Keeping the tickets of ``send()`` on the session until its outermost transaction ends.

The commit protocol is the core's (:class:`~flask_mail_outbox.core._producer.Producer`);
this module only carries its tickets on the session and calls the protocol's
steps at the right SQLAlchemy events. ``send()`` keeps each new row's ticket
on the session transaction it was inserted in (the innermost one: a savepoint
when ``begin_nested()`` is active). SQLAlchemy 2 fires ``after_commit`` and
``after_rollback`` for savepoints too, so:

* a released savepoint hands its tickets to its parent (not a publication);
* a rolled-back savepoint forgets its tickets; the outer transaction goes on;
* the outermost commit runs ``before_commit`` inside it and ``after_commit`` after it;
* an outermost rollback forgets every ticket (``after_rollback``: INFO);
* a session that ends with neither (``close()`` with tickets kept: only
  ``after_transaction_end`` fires) is a forgotten ``commit()``: ERROR, naming
  the emails and the fix, unless the request was failing anyway.

(flask-sqlalchemy's ``track_modifications`` publishes on any ``after_commit``,
which would publish a savepoint's rows before the outer commit.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flask import g, has_app_context
from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .. import _degrade
from ..core._internal import Ticket

logger = logging.getLogger(__name__)

_KEY = "mail_outbox_staged"
_REQUEST_FAILED = "_mail_outbox_request_failed"


class Publisher(Protocol):
    """What the tickets are handed to at the transaction's end (the per-app state)."""

    def before_commit(self, session: Session, tickets: list[Ticket]) -> None:
        """Last statements inside the outermost transaction that holds ``tickets``."""

    def after_commit(self, tickets: list[Ticket]) -> None:
        """The outermost transaction committed these tickets."""

    def after_rollback(self, tickets: list[Ticket]) -> None:
        """A transaction (or savepoint) holding ``tickets`` rolled back."""

    def forget(self, tickets: list[Ticket]) -> tuple[list[int], list[int]]:
        """A transaction holding ``tickets`` ended without either; the ids of its
        sends and of its cancels."""


#: The tickets of one transaction, with whom they go to.
Kept = list[tuple[Publisher, Ticket]]


def keep(session: Session, publisher: Publisher, tickets: Sequence[Ticket]) -> None:
    """Keep ``tickets`` (in order) on the session's innermost active transaction."""
    if not tickets:
        return
    trans = session.get_nested_transaction() or session.get_transaction()
    if trans is None:  # send() flushed, so there is always one; be explicit anyway
        raise RuntimeError("mail.send() needs an active session transaction")
    staged: dict[SessionTransaction, Kept] = session.info.setdefault(_KEY, {})
    staged.setdefault(trans, []).extend((publisher, t) for t in tickets)


def mark_request_failed() -> None:
    """Called when a request ends with an exception: its staged rows are not forgotten."""
    if has_app_context():
        setattr(g, _REQUEST_FAILED, True)


def _ending(session: Session) -> SessionTransaction | None:
    # Inside after_commit / after_rollback the transaction being ended is
    # still the session's innermost one.
    return session.get_nested_transaction() or session.get_transaction()


def _by_publisher(kept: Kept) -> list[tuple[Publisher, list[Ticket]]]:
    groups: dict[int, tuple[Publisher, list[Ticket]]] = {}
    for publisher, ticket in kept:
        groups.setdefault(id(publisher), (publisher, []))[1].append(ticket)
    return list(groups.values())


def _before_commit(session: Session) -> None:
    staged: dict[SessionTransaction, Kept] | None = session.info.get(_KEY)
    if not staged or session.get_nested_transaction() is not None:
        return  # a savepoint is being released: not the commit that publishes
    for publisher, tickets in _by_publisher([k for kept in staged.values() for k in kept]):
        publisher.before_commit(session, tickets)


def _take_ending(session: Session) -> tuple[
        dict[SessionTransaction, Kept], SessionTransaction, Kept] | None:
    """The tickets of the transaction that is ending now (removed from the map)."""
    staged: dict[SessionTransaction, Kept] | None = session.info.get(_KEY)
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
    staged, trans, kept = ending
    if trans.parent is not None:
        staged.setdefault(trans.parent, []).extend(kept)
        return
    for publisher, tickets in _by_publisher(kept):
        publisher.after_commit(tickets)


def _after_rollback(session: Session) -> None:
    ending = _take_ending(session)
    if ending is None:
        return
    staged, trans, kept = ending
    if trans.parent is None:
        # A rollback of the outermost transaction undoes every savepoint too.
        kept = [*kept, *(k for leftover in staged.values() for k in leftover)]
        staged.clear()
    for publisher, tickets in _by_publisher(kept):
        publisher.after_rollback(tickets)


def _after_transaction_end(session: Session, trans: SessionTransaction) -> None:
    staged: dict[SessionTransaction, Kept] | None = session.info.get(_KEY)
    if not staged:
        return
    kept = staged.pop(trans, None)
    if not kept:
        return
    if trans.parent is not None:
        # Closed without commit or rollback of its own: the parent decides.
        staged.setdefault(trans.parent, []).extend(kept)
        return
    ids: list[int] = []
    cancels: list[int] = []
    for publisher, tickets in _by_publisher(kept):
        sends, undone = publisher.forget(tickets)
        ids += sends
        cancels += undone
    if has_app_context() and g.get(_REQUEST_FAILED):
        logger.info("The request failed before committing; %d staged email(s) %s and %d "
                    "cancel(s) %s were discarded with its transaction.", len(ids), ids,
                    len(cancels), cancels)
        return
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
