"""A transport paused by a fault of its own: its emails wait, one probe says when it is back.

Refused credentials, a spent quota, an unverified sender, a server that
cannot be reached at all: no email of the transport can get past such a
fault, so none should spend an attempt on it (the transports say so with
``TransientError.account_fault``). The first such failure pauses the
transport for every process on the database, in its ``outbox_rate`` row
(the row that already holds its shared rate: one row per transport for what
every process must agree on; ``paused_kind`` NULL means not paused):

* the emails that met the fault get their attempt back and are due again
  after ``OUTBOX_PAUSE_PROBE_SECONDS``; while it is paused, no process claims
  the transport's emails (a dispatcher skips its lane, a handed email is
  released unsent, its attempt returned), so none spends an attempt;
* one probe at a time, by one process (an ``UPDATE ... WHERE probe_at <= now``
  that one claim wins, holding the probe for two leases in case its process
  dies), sends one real email at ``probe_at``: ``OUTBOX_PAUSE_PROBE_SECONDS``
  after the fault, then doubling up to ``OUTBOX_PAUSE_PROBE_MAX_SECONDS``.
  Any other answer than the fault (sent, or refused for the message's own
  sake) resumes the transport at once for everyone (PostgreSQL's NOTIFY wakes
  the dispatchers); the fault again doubles the delay;
* the process holding the probe (or the one that paused it) also ends the
  emails that waited longer than ``OUTBOX_MAX_QUEUE_LIFETIME_SECONDS``
  (Postfix's ``maximal_queue_lifetime``, 5 days) ``failed``, with the fault
  as their last error, and those past their own ``expires_at`` ``expired``.

Each process reports a pause once at ERROR (when it meets the fault) and its
end at INFO. A process reads the pauses once when it starts, then only while it
knows of one (every :data:`VIEW_SECONDS`) or meets a fault: an idle claim of a
working transport costs no statement more. :class:`PauseStore` is the SQL,
:class:`Pauses` one process's view of it and its decisions.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .. import _degrade
from .._errors import ACCOUNT_FAULTS, FAULT_REASONS, TransientError
from .._outside import clean_text
from ..transports import Delivered, Failed, NotAttempted
from ._models import email_table, rate_table
from ._retry import human_seconds

if TYPE_CHECKING:
    from ._settings import OutboxConfig
    from ._store import Store

logger = logging.getLogger(__name__)

#: Seconds a process trusts what it read of the pauses before it reads them again.
VIEW_SECONDS = 1.0
#: How the last error of an email ended by OUTBOX_MAX_QUEUE_LIFETIME_SECONDS starts.
OVERDUE = "waited longer than OUTBOX_MAX_QUEUE_LIFETIME_SECONDS"


@dataclasses.dataclass(frozen=True)
class Pause:
    """One paused transport: why (``kind``, one of ``ACCOUNT_FAULTS``, and ``error``, the
    text of the error that paused it), since when, and when the next probe may go (UTC,
    naive). ``reason`` is the fault in the failure reasons' vocabulary (``_reasons``)."""

    transport: str
    kind: str
    error: str
    since: datetime
    probe_at: datetime
    probe_delay: float

    @property
    def reason(self) -> str:
        """``network_error`` for an unreachable transport, else ``account``."""
        return FAULT_REASONS.get(self.kind, "account")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``flask outbox status --json``, health, the dashboard)."""
        return {"transport": self.transport, "kind": self.kind, "reason": self.reason,
                "error": self.error,
                "since": self.since.isoformat(), "probe_at": self.probe_at.isoformat(),
                "probe_delay_seconds": self.probe_delay}


class PauseStore:
    """The pause's SQL on ``outbox_rate`` (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def all(self) -> dict[str, Pause]:
        """Every paused transport, by name."""
        t = rate_table
        with self.store.read() as conn:
            rows = conn.execute(sa.select(
                t.c.name, t.c.paused_kind, t.c.paused_error, t.c.paused_since, t.c.probe_at,
                t.c.probe_delay).where(t.c.paused_kind.is_not(None))).all()
        return {row.name: Pause(row.name, row.paused_kind, row.paused_error or "",
                                row.paused_since, row.probe_at, float(row.probe_delay or 0.0))
                for row in rows}

    def pause(self, name: str, kind: str, error: str, delay: float) -> None:
        """Pause ``name`` (unless it is already: the first fault stays its reason)."""
        t = rate_table
        values = {"paused_kind": kind, "paused_error": error,
                  "paused_since": self.store.now_expr(),
                  "probe_at": self.store.later_expr(delay), "probe_delay": delay}
        statement = (self.store.dialect.insert(t)
                     .values(name=name, tat=0.0, cut_at=0.0, **values)
                     .on_conflict_do_update(index_elements=["name"], set_=values,
                                            where=t.c.paused_kind.is_(None)))
        with self.store.write() as conn:
            conn.execute(statement)

    def take_probe(self, name: str, hold: float) -> bool:
        """Take ``name``'s probe if it is due (one caller wins); hold it ``hold`` seconds."""
        t = rate_table
        statement = (t.update()
                     .where(t.c.name == name, t.c.paused_kind.is_not(None),
                            t.c.probe_at <= self.store.now_expr())
                     .values(probe_at=self.store.later_expr(hold))
                     .returning(t.c.name))
        with self.store.write() as conn:
            return conn.execute(statement).first() is not None

    def probe_failed(self, name: str, kind: str, error: str, delay: float) -> None:
        """The probe met the fault again: the next one in ``delay`` seconds."""
        t = rate_table
        with self.store.write() as conn:
            conn.execute(t.update().where(t.c.name == name, t.c.paused_kind.is_not(None))
                         .values(paused_kind=kind, paused_error=error, probe_delay=delay,
                                 probe_at=self.store.later_expr(delay)))

    def probe_again(self, name: str, delay: float) -> None:
        """The probe tested nothing (no email went): the next one in ``delay`` seconds."""
        t = rate_table
        with self.store.write() as conn:
            conn.execute(t.update().where(t.c.name == name, t.c.paused_kind.is_not(None))
                         .values(probe_at=self.store.later_expr(delay)))

    def resume(self, name: str) -> bool:
        """``name`` is back; whether it was paused."""
        t = rate_table
        statement = (t.update().where(t.c.name == name, t.c.paused_kind.is_not(None))
                     .values(paused_kind=None, paused_error=None, paused_since=None,
                             probe_at=None, probe_delay=None)
                     .returning(t.c.name))
        with self.store.write() as conn:
            return conn.execute(statement).first() is not None

    def overdue(self, name: str, lifetime: float, limit: int) -> list[int]:
        """Queued emails of ``name`` first due ``lifetime`` seconds ago or more, or past their
        ``expires_at``, that could be claimed now (due, first of their key).

        First due: ``scheduled_for`` (``send_after``, or an operator's retry of a dead
        letter), else ``created_at``: a scheduled email's lifetime starts when it may go.
        """
        e = email_table
        first_due = sa.func.coalesce(e.c.scheduled_for, e.c.created_at)
        statement = (sa.select(e.c.id)
                     .where(self.store.dialect.claimable(self.store.now_expr),
                            e.c.transport == name,
                            sa.or_(first_due <= self.store.dialect.ago(self.store.clock,
                                                                       lifetime),
                                   e.c.expires_at <= self.store.now_expr()))
                     .order_by(e.c.id).limit(limit))
        with self.store.read() as conn:
            return [row.id for row in conn.execute(statement)]


class Gate(enum.Enum):
    """What a claim of a transport's emails may take now."""

    OPEN = "open"  # not paused: as much as there is room for
    CLOSED = "closed"  # paused: nothing
    PROBE = "probe"  # paused, and this process holds the probe: one email


class Pauses:
    """One process's view of the paused transports, and what it decides for them.

    ``clock`` is the worker's (monotonic) clock: the view is read again when
    it is :data:`VIEW_SECONDS` old. Guarded by the worker's loop: one thread.
    """

    def __init__(self, store: Store, config: OutboxConfig, faults: _degrade.FaultTracker,
                 clock: Callable[[], float]) -> None:
        self.sql = PauseStore(store)
        self.store = store
        self.config = config
        self.faults = faults
        self.clock = clock
        self._view: dict[str, Pause] = {}
        self._read_at: float | None = None
        #: The email this process sends as each transport's probe (None: none claimed
        #: yet), and when it took the probe (``clock``): held two leases at most.
        self.probing: dict[str, tuple[int | None, float]] = {}

    # -- the view --------------------------------------------------------------------

    def current(self, name: str) -> Pause | None:
        """``name``'s pause as last read (read again when old), None when not paused."""
        self._refresh()
        return self._view.get(name)

    @property
    def paused(self) -> Mapping[str, Pause]:
        """Every transport this process knows to be paused."""
        return self._view

    def look(self) -> None:
        """Read the pauses now if this process never did (a dispatcher starting: its first
        claim then costs no statement more)."""
        if self._read_at is None:
            self._refresh(force=True)

    def invalidate(self) -> None:
        """Read the pauses again at the next look (a NOTIFY: one may have ended)."""
        if self._view:
            self._read_at = None

    def _refresh(self, *, force: bool = False) -> None:
        """Read the pauses: once at the first look (a process started while a transport
        is paused probes it too: with no other process left, nobody else would), when
        forced (this process met a fault), and again when one is known and the view is
        :data:`VIEW_SECONDS` old (has it ended, or been probed?).

        A process that knows of no pause reads nothing more: idle claims cost what they
        did. One that missed a pause begun since learns it from the first email that
        meets the fault (its attempt given back).
        """
        now = self.clock()
        if not force and self._read_at is not None and (
                not self._view or now - self._read_at < VIEW_SECONDS):
            return
        self._read_at = now
        try:
            view = self.sql.all()
        except Exception as exc:  # noqa: BLE001 - reported; the last view holds meanwhile
            self.faults.failing(
                "pause-read", "Could not read which transports are paused (outbox_rate)",
                consequence="this process goes by what it read last: it may send to a paused "
                            "transport (its emails get their attempt back) or wait for one "
                            "that is back",
                fix="check the database connection and that the outbox tables are migrated "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
            return
        self.faults.recovered("pause-read")
        for name, pause in view.items():
            self._report(pause)
        for name in set(self._view) - set(view):
            self._back(name)
        self._view = view

    def _report(self, pause: Pause) -> None:
        """The pause's one ERROR in this process (again only after it ended)."""
        lifetime = self.config.max_queue_lifetime_seconds
        bound = ("they never fail for it (OUTBOX_MAX_QUEUE_LIFETIME_SECONDS is None)"
                 if lifetime is None else
                 f"they fail after OUTBOX_MAX_QUEUE_LIFETIME_SECONDS ({_lifetime(lifetime)}) "
                 "in the queue if it stays down")
        self.faults.failing(
            f"paused-{pause.transport}",
            f"Transport {pause.transport!r} is paused since {pause.since:%Y-%m-%d %H:%M:%S} UTC: "
            f"{ACCOUNT_FAULTS.get(pause.kind, pause.kind)} ({pause.error})",
            consequence="its emails wait without spending attempts (those that met it got "
                        "theirs back); one email probes it "
                        f"{human_seconds(self.config.pause_probe_seconds)} after the fault, then "
                        f"every doubling delay up to "
                        f"{human_seconds(self.config.pause_probe_max_seconds)} "
                        "(OUTBOX_PAUSE_PROBE_SECONDS, OUTBOX_PAUSE_PROBE_MAX_SECONDS), and the "
                        f"first that gets through resumes all of them; {bound}; a failover "
                        "transport, where configured, takes its mail meanwhile",
            fix=_FIXES.get(pause.kind, "check the transport's settings and account")
                + f" of OUTBOX_TRANSPORTS[{pause.transport!r}]; `flask outbox status` shows "
                  "the pause")

    def _back(self, name: str) -> None:
        self.faults.recovered(f"paused-{name}")
        logger.info("Transport %r is back: its waiting emails go out now", name)

    # -- claims ----------------------------------------------------------------------

    def gate(self, name: str) -> Gate:
        """May a claim take ``name``'s emails now: all, none, or one as the probe (taken)."""
        pause = self.current(name)
        if pause is None:
            return Gate.OPEN
        if self._probing(name) or self.store.clock() < pause.probe_at - _SKEW:
            return Gate.CLOSED
        try:
            won = self.sql.take_probe(name, 2 * self.config.lease_seconds)
        except Exception as exc:  # noqa: BLE001 - reported; the transport stays paused
            self.faults.failing(
                "pause-probe", f"Could not take the probe of paused transport {name!r}",
                consequence="its emails keep waiting until a process can",
                fix="check the database connection", exc=exc)
            return Gate.CLOSED
        self.faults.recovered("pause-probe")
        if not won:
            self._refresh(force=True)  # another process probes, or it is back
            return Gate.CLOSED
        self.probing[name] = (None, self.clock())
        return Gate.PROBE

    def _probing(self, name: str) -> bool:
        """Whether this process's probe of ``name`` is out (one lost, released unsent by a
        stop or a database error, is forgotten after the two leases it was held for)."""
        held = self.probing.get(name)
        if held is not None and self.clock() - held[1] > 2 * self.config.lease_seconds:
            del self.probing[name]
            return False
        return held is not None

    def is_probe(self, name: str, email_id: int) -> bool:
        """Whether ``email_id`` is the probe of ``name`` this process sends."""
        held = self.probing.get(name)
        return held is not None and held[0] == email_id

    def probe_with(self, name: str, email_id: int | None) -> None:
        """The email sent as ``name``'s probe; None when there was none to send."""
        if email_id is not None:
            self.probing[name] = (email_id, self.clock())
            return
        self.probing.pop(name, None)
        # None due to probe with: look again after the first probe's delay, not at once
        # (the dispatcher would spin on an empty queue while the transport stays paused).
        self._write(self.sql.probe_again, name, self.config.pause_probe_seconds)
        self._refresh(force=True)

    def next_probe_in(self) -> float | None:
        """Seconds until this process may take a probe (None: no transport is paused)."""
        waits = [(pause.probe_at - self.store.clock()).total_seconds()
                 for name, pause in self._view.items() if name not in self.probing]
        # At least a moment: the database's clock may be a little behind this one's.
        return max(_SKEW.total_seconds() / 5, min(waits)) if waits else None

    # -- after a record ----------------------------------------------------------------

    def after_record(self, results: Sequence[tuple[str, int, Any]]) -> tuple[list[str], list[str]]:
        """Pause, back off or resume after recorded results ``(transport, email id, result)``.

        Returns the transports resumed, and those this process paused.
        """
        resumed: list[str] = []
        paused: list[str] = []
        by_transport: dict[str, list[tuple[int, Any]]] = {}
        for transport, email_id, result in results:
            by_transport.setdefault(transport, []).append((email_id, result))
        for name, got in by_transport.items():
            fault = next((f for _, r in got if (f := _fault_of(r)) is not None), None)
            probe = self.probing.get(name, (None, 0.0))[0]
            probe_result = next((r for i, r in got if probe is not None and i == probe), _NONE)
            if probe_result is not _NONE:
                del self.probing[name]
                if self._probed(name, probe_result):
                    resumed.append(name)
            elif fault is not None and name not in self._view:
                if self._write(self.sql.pause, name, fault.account_fault or "",
                               _error_text(fault), self.config.pause_probe_seconds):
                    paused.append(name)
                self._refresh(force=True)
        return resumed, paused

    def _probed(self, name: str, result: Any) -> bool:
        """The probe's result: the fault again (back off), or anything else (resume)."""
        fault = _fault_of(result)
        pause = self._view.get(name)
        if fault is not None:
            delay = min(self.config.pause_probe_max_seconds,
                        2 * (pause.probe_delay if pause else self.config.pause_probe_seconds))
            self._write(self.sql.probe_failed, name, fault.account_fault or "", _error_text(fault),
                        delay)
            self._refresh(force=True)
            return False
        went = isinstance(result, Delivered) or (
            isinstance(result, Failed) and not isinstance(result.error, NotAttempted))
        if not went:
            self._write(self.sql.probe_again, name, 0.0)  # nothing went: it says nothing
            return False
        back = self._write(self.sql.resume, name)
        self._refresh(force=True)
        return bool(back)

    def _write(self, write: Callable[..., Any], *args: Any) -> Any:
        try:
            done = write(*args)
        except Exception as exc:  # noqa: BLE001 - reported; the emails still wait, attempts kept
            self.faults.failing(
                "pause-write", f"Could not store the pause state of transport {args[0]!r}",
                consequence="its emails that meet the fault keep their attempt and wait "
                            "OUTBOX_PAUSE_PROBE_SECONDS each time; other processes may not "
                            "know it is paused, or back",
                fix="check the database connection and that the outbox tables are migrated "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
            return False
        self.faults.recovered("pause-write")
        return True if done is None else done

    def held(self, name: str) -> tuple[str, float]:
        """Why an email of paused ``name`` is not sent now, and in how many seconds it is
        due again (at the next probe, at least a second from now)."""
        pause = self._view.get(name)
        if pause is None:
            return f"not sent: transport {name!r} is paused", self.config.pause_probe_seconds
        due_in = max(1.0, (pause.probe_at - self.store.clock()).total_seconds())
        why = (f"not sent: transport {name!r} is paused since "
               f"{pause.since:%Y-%m-%d %H:%M:%S} UTC ({pause.kind}: {pause.error})")
        return why, due_in

    def overdue_reason(self, name: str) -> str:
        """The last error of an email ended by OUTBOX_MAX_QUEUE_LIFETIME_SECONDS."""
        pause = self._view.get(name)
        lifetime = self.config.max_queue_lifetime_seconds or 0.0
        why = (f"{ACCOUNT_FAULTS.get(pause.kind, pause.kind)} since "
               f"{pause.since:%Y-%m-%d %H:%M:%S} UTC: {pause.error}" if pause else "paused")
        return (f"{OVERDUE} ({_lifetime(lifetime)}) while transport {name!r} was paused "
                f"({why})")


#: What to do about each kind of fault.
_FIXES = {
    "credentials": "check the credentials (API key, AWS keys, MAIL_USERNAME / MAIL_PASSWORD: "
                   "rotated or revoked?)",
    "quota": "see the account's sending quota and status at the provider (spent, paused or "
             "suspended?)",
    "sender": "verify the sending domain or address with the provider, or send from a "
              "verified one",
    "settings": "correct the setting the provider does not know (domain, base_url, "
                "configuration_set)",
    "unreachable": "check that the server is up and reachable (MAIL_SERVER and MAIL_PORT, "
                   "base_url, firewalls, DNS)",
}

#: PostgreSQL's clock and this process's may differ a little: the database decides.
_SKEW = timedelta(seconds=0.5)
_NONE = object()


def _lifetime(seconds: float) -> str:
    """OUTBOX_MAX_QUEUE_LIFETIME_SECONDS as a person reads it: ``"5 days"``."""
    return f"{round(seconds / 86400, 1):g} days" if seconds >= 2 * 86400 else human_seconds(seconds)


def _fault_of(result: Any) -> TransientError | None:
    """The account fault ``result`` failed with, if any."""
    error = getattr(result, "error", None) if isinstance(result, Failed) else None
    if isinstance(error, TransientError) and error.account_fault is not None:
        return error
    return None


def _error_text(error: TransientError) -> str:
    return clean_text(str(error), 1000)
