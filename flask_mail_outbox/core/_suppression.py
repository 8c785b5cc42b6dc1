"""The suppression list: addresses the outbox does not send to.

One row per address, keyed by :func:`suppression_key` (the address as
``send()`` stores it, normalized by email-validator, then without case,
as providers compare their own lists). Delivery asks :meth:`Suppressions.screen`
which recipients of a claimed batch to leave out: every reason applies to
every email but ``unsubscribed``, which applies only to bulk mail (a message
with a ``List-Unsubscribe`` header), so a password reset still reaches
someone who left the newsletter.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .._compose.addresses import AddressError, parse_address
from .._errors import InvalidMessage
from ._models import suppression_table

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ._leases import ClaimedEmail
    from ._store import Store

#: Why an address is suppressed.
REASONS = ("bounced", "complained", "unsubscribed", "manual")

#: Addresses per ``IN`` list (SQLite's default limit on bound parameters is 32,766).
_CHUNK = 500
#: The form of "now" of a store on the caller's clock (a value bound at each read).
_CALLERS_CLOCK = object()
_LIST_UNSUBSCRIBE = re.compile(rb"(?:^|\n)list-unsubscribe:", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Suppression:
    """One entry of the suppression list."""

    address: str
    reason: str
    source: str
    created_at: datetime
    expires_at: datetime | None = None


def suppression_key(address: str) -> str:
    """``address`` as the list keys it; ``InvalidMessage`` naming ``address`` if it is not one.

    The form ``send()`` stores (email-validator's normalization, the domain
    in ASCII), in lower case.
    """
    if not isinstance(address, str):
        raise InvalidMessage("address", f"expected str, got {type(address).__name__}")
    try:
        addr = parse_address(address.strip(), True, True)
    except AddressError as exc:
        raise InvalidMessage("address", f"{address!r} is not an email address ({exc})") from None
    return addr.ascii.lower()


def loose_key(address: str) -> str:
    """The key of an address a provider reported: normalized when valid, else just lower-cased."""
    try:
        return suppression_key(address)
    except InvalidMessage:
        return address.strip().lower()


def is_bulk(mime: bytes) -> bool:
    """Whether a stored message is bulk mail: it has a ``List-Unsubscribe`` header."""
    end = mime.find(b"\r\n\r\n")
    return _LIST_UNSUBSCRIBE.search(mime if end < 0 else mime[:end]) is not None


class Suppressions:
    """The suppression list in one database."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # The screen's read, built once (see _lookup): (the "now" it compares with, it).
        self._screen_statement: tuple[object, sa.Select[Any]] | None = None

    # -- delivery ---------------------------------------------------------------------

    def screen(self, claimed: Sequence[ClaimedEmail]) -> list[ClaimedEmail]:
        """``claimed`` with each email's suppressed recipients in ``ClaimedEmail.suppressed``.

        One query for the whole batch; an email nobody on the list receives
        is returned as it was.
        """
        wanted = {r.lower() for email in claimed for r in email.recipients}
        if not wanted:
            return list(claimed)
        with self.store.read() as conn:
            found = self._lookup(conn, wanted)
        if not found:
            return list(claimed)
        screened = []
        for email in claimed:
            skipped = []
            bulk: bool | None = None
            for recipient in email.recipients:
                reason = found.get(recipient.lower())
                if reason == "unsubscribed":
                    if bulk is None:
                        bulk = is_bulk(email.mime)
                    if not bulk:
                        continue
                if reason is not None:
                    skipped.append((recipient, reason))
            screened.append(dataclasses.replace(email, suppressed=tuple(skipped))
                            if skipped else email)
        return screened

    def _lookup(self, conn: Connection, keys: Iterable[str]) -> dict[str, str]:
        """The reason of each of ``keys`` whose entry is in force (absent: not suppressed)."""
        stmt, params = self._in_force_statement()
        ordered = sorted(keys)
        found: dict[str, str] = {}
        for start in range(0, len(ordered), _CHUNK):
            rows = conn.execute(stmt, {**params, "keys": ordered[start:start + _CHUNK]}).all()
            found.update((row.address, row.reason) for row in rows)
        return found

    def _in_force_statement(self) -> tuple[sa.Select[Any], dict[str, Any]]:
        """The lookup's SELECT and its parameters but the keys.

        Built once per form of "now": building the SELECT took more client
        CPU than running it (230 of 370 us on PostgreSQL), and the screen
        runs at every claim. The caller's clock (a bound value) becomes the
        ``now`` parameter; the database's clock stays SQL.
        """
        now = self.store.now_expr()
        params: dict[str, Any] = {}
        form: object = self.store.dialect
        if isinstance(now, sa.BindParameter):
            params["now"] = now.value
            form = _CALLERS_CLOCK
        if self._screen_statement is None or self._screen_statement[0] is not form:
            t = suppression_table
            compared = (sa.bindparam("now", type_=sa.DateTime()) if form is _CALLERS_CLOCK
                        else now)
            stmt: sa.Select[Any] = sa.select(t.c.address, t.c.reason).where(
                t.c.address.in_(sa.bindparam("keys", expanding=True)),
                sa.or_(t.c.expires_at.is_(None), t.c.expires_at > compared))
            self._screen_statement = (form, stmt)
        return self._screen_statement[1], params

    # -- changes ------------------------------------------------------------------------

    def add(self, address: str, reason: str = "manual", *, source: str = "",
            expires_at: datetime | None = None, conn: Connection | None = None) -> bool:
        """Suppress ``address`` (insert, or replace its entry); True if it was not suppressed."""
        key = suppression_key(address)
        if reason not in REASONS:
            raise InvalidMessage("reason", f"{reason!r} is not one of {', '.join(REASONS)}")
        with self.store.write(conn) as tx:
            before = self._lookup(tx, [key])
            self.put(tx, [(key, reason, source)], expires_at=expires_at, replace=True)
        return key not in before

    def put(self, conn: Connection, entries: Sequence[tuple[str, str, str]], *,
            expires_at: datetime | None = None, replace: bool = False) -> None:
        """Upsert ``(key, reason, source)`` entries on ``conn`` (keys already normalized).

        Without ``replace`` (what events do), a permanent entry that applies
        to every email is not narrowed to ``unsubscribed``, which applies to
        bulk mail only: a complaint followed by an unsubscribe stays a
        complaint; a temporary one (``expires_at``) is replaced.
        """
        if not entries:
            return
        t = suppression_table
        now = self.store.clock()
        # One entry per address, in address order (concurrent upserts never deadlock).
        rows = [{"address": key, "reason": reason, "source": source[:255],
                 "created_at": now, "expires_at": expires_at}
                for key, reason, source in sorted({e[0]: e for e in entries}.values())]
        insert = self.store.dialect.insert(t)
        where = None
        if not replace:
            # An entry that lapses (expires_at) is replaced: a permanent one wins.
            where = sa.or_(insert.excluded.reason != "unsubscribed",
                           t.c.reason == "unsubscribed",
                           t.c.expires_at.is_not(None))
        conn.execute(insert.on_conflict_do_update(
            index_elements=[t.c.address],
            set_={"reason": insert.excluded.reason, "source": insert.excluded.source,
                  "created_at": insert.excluded.created_at,
                  "expires_at": insert.excluded.expires_at},
            where=where), rows)

    def put_until(self, conn: Connection,
                  entries: Sequence[tuple[str, str, str, datetime]]) -> None:
        """Upsert bounded ``(key, reason, source, expires_at)`` entries on ``conn``.

        A bounded entry never replaces a permanent one, nor shortens a bounded
        one: it takes an address that is not on the list, or one whose entry
        lapses sooner (a lapsed one among them).
        """
        if not entries:
            return
        t = suppression_table
        now = self.store.clock()
        latest: dict[str, tuple[str, str, str, datetime]] = {}
        for entry in entries:
            if entry[0] not in latest or entry[3] > latest[entry[0]][3]:
                latest[entry[0]] = entry
        rows = [{"address": key, "reason": reason, "source": source[:255],
                 "created_at": now, "expires_at": until}
                for key, reason, source, until in sorted(latest.values())]
        insert = self.store.dialect.insert(t)
        conn.execute(insert.on_conflict_do_update(
            index_elements=[t.c.address],
            set_={"reason": insert.excluded.reason, "source": insert.excluded.source,
                  "created_at": insert.excluded.created_at,
                  "expires_at": insert.excluded.expires_at},
            where=sa.and_(t.c.expires_at.is_not(None),
                          t.c.expires_at < insert.excluded.expires_at)), rows)

    def remove(self, address: str) -> bool:
        """Take ``address`` off the list; True if it was on it.

        An entry a provider reported in a form that is not a valid address is
        found by its lower-cased text.
        """
        if not isinstance(address, str):
            raise InvalidMessage("address", f"expected str, got {type(address).__name__}")
        key = loose_key(address)
        t = suppression_table
        with self.store.write() as conn:
            return bool(conn.execute(t.delete().where(t.c.address == key)).rowcount)

    def prune(self) -> int:
        """Delete entries whose ``expires_at`` has passed; returns how many."""
        t = suppression_table
        with self.store.write() as conn:
            return int(conn.execute(t.delete().where(
                t.c.expires_at.is_not(None), t.c.expires_at <= self.store.now_expr())).rowcount)

    # -- reading ------------------------------------------------------------------------

    def get(self, address: str) -> Suppression | None:
        """The entry in force for ``address``, or None."""
        key = suppression_key(address)
        t = suppression_table
        with self.store.read() as conn:
            row = conn.execute(sa.select(t).where(
                t.c.address == key,
                sa.or_(t.c.expires_at.is_(None), t.c.expires_at > self.store.now_expr()))
            ).first()
        return None if row is None else _entry(row._mapping)

    def entries(self, *, limit: int | None = None, after: str | None = None,
                prefix: str | None = None) -> list[Suppression]:
        """Entries in force, by address (keyset: ``after`` the last one seen)."""
        t = suppression_table
        query = sa.select(t).where(*self._in_force(prefix))
        if after is not None:
            query = query.where(t.c.address > after)
        query = query.order_by(t.c.address)
        if limit is not None:
            query = query.limit(limit)
        with self.store.read() as conn:
            return [_entry(row._mapping) for row in conn.execute(query)]

    def iterate(self, batch: int = 1000) -> Iterator[Suppression]:
        """Every entry in force, by address, read ``batch`` at a time (for an export)."""
        after: str | None = None
        while True:
            page = self.entries(limit=batch, after=after)
            yield from page
            if len(page) < batch:
                return
            after = page[-1].address

    def count(self, *, prefix: str | None = None) -> int:
        """How many entries are in force (of addresses that start with ``prefix``)."""
        t = suppression_table
        with self.store.read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                *self._in_force(prefix))).scalar_one())

    def _in_force(self, prefix: str | None) -> list[Any]:
        """The WHERE of the entries in force, of addresses starting with ``prefix`` if given."""
        t = suppression_table
        where: list[Any] = [sa.or_(t.c.expires_at.is_(None),
                                   t.c.expires_at > self.store.now_expr())]
        if prefix:
            low = prefix.strip().lower()
            where += [t.c.address >= low, t.c.address < low + "\U0010ffff"]
        return where


def _entry(row: Any) -> Suppression:
    return Suppression(address=row["address"], reason=row["reason"], source=row["source"],
                       created_at=row["created_at"], expires_at=row["expires_at"])
