"""Delivering claimed rows: what each result means, and recording it.

Every way of delivering goes through :class:`Delivery`: the store's
compare-and-set claim is the only gate, the transport sends, and
:meth:`Delivery.finish` turns each result into an outcome
(:func:`outcome_for`, a pure function of the result and the retry policy),
records it (retried while the database is briefly away), reports what needs
reporting and tells the owner's :class:`Callbacks`. A :class:`Heartbeat` renews the leases of
rows still being sent, so a slow server never causes a second copy.

The loop that feeds it, in both modes, is :class:`~._worker.Worker`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime, timedelta
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy
from functools import cached_property
from typing import TYPE_CHECKING, Any

from sqlalchemy import exc as sa_exc

from .. import _degrade, _tracing
from .._errors import PermanentError, TransientError, TransportError
from .._events import DeliveryEvent
from .._outside import TEXT_LIMIT, clean_line, clean_text
from .._policy import for_good
from .._reasons import smtp_reason
from ..transports import Delivered, Envelope, Failed, NotAttempted, Result, Transport
from ._clock import utcnow
from ._database import KeptConnection
from ._events import EventLog
from ._intercept import BeforeSend, Intercepted, Interceptor, write_notes
from ._leases import ClaimedEmail, Outcome, Reaped, Recorded
from ._mailbox import Keeper
from ._models import Status
from ._pause import OVERDUE
from ._releases import Releases
from ._retry import Decision, RetryPolicy
from ._store import Store

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from .._compose.dkim import DKIMSigner
    from .._compose.verp import VerpAddresses
    from ._settings import OutboxConfig

logger = logging.getLogger(__name__)

_owner_counter = itertools.count(1)
_HOST = socket.gethostname()

#: Why a row claimed past its last attempt is dead-lettered unsent.
SPENT_LEASE = "lease expired: the process sending it stopped, and its attempts are spent"


def about_the_data(exc: BaseException) -> bool:
    """Whether the database refused ``exc``'s write for what it said, not for being away.

    A text it cannot store (a NUL on PostgreSQL, a lone surrogate), a value
    too long for its column, an encoding error: retrying the same write
    fails the same way. An outage (``OperationalError``, ``InterfaceError``)
    is never one of these.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (sa_exc.OperationalError, sa_exc.InterfaceError)):
            return False
        if isinstance(current, (sa_exc.DataError, UnicodeError)):
            return True
        sqlstate = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate.startswith("22"):  # data exception
            return True
        if type(current).__name__ == "DataError":  # a driver's own (psycopg, sqlite3)
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


def _safe_text(text: str | None, limit: int = TEXT_LIMIT) -> str | None:
    return None if text is None else clean_text(text, limit)


def made_safe(outcome: Outcome) -> Outcome:
    """``outcome`` with every text from outside made safe to store (see :mod:`.._outside`)."""
    provider_id = outcome.provider_message_id
    return dataclasses.replace(
        outcome, error_message=_safe_text(outcome.error_message),
        provider_message_id=(clean_line(provider_id) or None) if provider_id else None,
        unknown_recipients=tuple((clean_line(address, 320), clean_text(reply, 1000))
                                 for address, reply in outcome.unknown_recipients),
        failovers=tuple(dataclasses.replace(step, error=TransientError(
            clean_text(step.error.message), code=step.error.code))
            for step in outcome.failovers))


def bare(outcome: Outcome, why: str) -> Outcome:
    """``outcome`` with nothing from outside: its status, and why its reply is missing."""
    said = ("the server's reply could not be stored (the database refused it: "
            f"{why})")
    message = None
    if outcome.error_message is not None:
        message = (f"some recipients refused; {said}" if outcome.status is Status.SENT
                   else said)
    return dataclasses.replace(outcome, error_message=message, provider_message_id=None,
                               unknown_recipients=(), failovers=())


def new_owner() -> str:
    """A lease owner token, unique per claim (host, pid, sequence, random)."""
    return f"{_HOST[:40]}:{os.getpid()}:{next(_owner_counter)}:{uuid.uuid4().hex[:8]}"


def envelope_of(email: ClaimedEmail, dkim: DKIMSigner | None = None,
                verp: VerpAddresses | None = None) -> Envelope:
    """What the transport needs of a claimed row, DKIM-signed afresh when ``dkim`` is given.

    Suppressed recipients are left out of the envelope (see :mod:`._suppression`);
    with ``verp`` the envelope sender is the row's VERP address (the header From
    does not change). An intercepted email (:mod:`._intercept`) goes to its
    interception's recipients with its interception's bytes, signed as sent.
    """
    intercepted = email.interception
    mime = email.mime if intercepted is None else intercepted.mime
    recipients = email.deliverable if intercepted is None else intercepted.recipients
    mime = mime if dkim is None else _tracing.signed(dkim, email.id, email.message_id, mime)
    sender = email.sender if verp is None else verp.sender_for(email.id)
    left_out = tuple(address for address, _ in email.suppressed)
    if intercepted is not None:
        left_out += intercepted.left_out
    return Envelope(email_id=email.id, sender=sender, recipients=recipients,
                    mime=mime, message_id=email.message_id,
                    mail_options=email.mail_options, rcpt_options=email.rcpt_options,
                    left_out=left_out)


@dataclasses.dataclass(frozen=True)
class Suppressed:
    """The result of an email every recipient of which is suppressed: nothing was sent."""

    failovers: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Expired:
    """The result of an email claimed after its ``expires_at``: nothing was sent."""

    failovers: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Overdue:
    """The result of an email that waited longer than OUTBOX_MAX_QUEUE_LIFETIME_SECONDS for
    its paused transport (see :mod:`._pause`): nothing was sent; ``why`` is its last error."""

    why: str
    failovers: tuple[Any, ...] = ()


#: What a delivery attempt comes to: a transport's result, or no send at all.
Attempt = Result | Suppressed | Expired | Intercepted | Overdue


def expired(email: ClaimedEmail, now: datetime | None = None) -> bool:
    """Whether ``email`` is past its ``expires_at`` (never, without one)."""
    return email.expires_at is not None and email.expires_at <= (now or utcnow())


def unknown_recipients(result: Attempt) -> tuple[tuple[str, str], ...]:
    """Recipients a server refused for good, the policy says (a 5xx whose reason is a
    dead address: 5.1.1, 5.1.2, 5.1.10, "no such user"...): (address, reply)."""
    refused: Mapping[str, tuple[int, str]] = (
        result.refused if isinstance(result, Delivered) else
        result.error.refused if isinstance(result, Failed) else {})
    return tuple((address, f"{code} {text}") for address, (code, text) in refused.items()
                 if code >= 500
                 and for_good("bounced", "permanent", smtp_reason(f"{code} {text}")))


@dataclasses.dataclass(frozen=True)
class DeliveredMessage:
    """A delivered email as ``record_messages()`` yields it (Flask-Mail-like)."""

    email_id: int
    message_id: str
    sender: str
    send_to: tuple[str, ...]
    mime: bytes
    #: The provider's id of the message (an API's reply, an SMTP ``queued as``), if any.
    provider_message_id: str | None = None

    @cached_property
    def parsed(self) -> EmailMessage:
        """The message parsed back with the stdlib parser."""
        parsed = BytesParser(policy=default_policy).parsebytes(self.mime)
        return parsed

    @property
    def msgId(self) -> str:
        """Flask-Mail's name of :attr:`message_id` (for receivers written for it)."""
        return self.message_id

    @property
    def subject(self) -> str:
        """The decoded Subject header."""
        return str(self.parsed.get("Subject", ""))

    @property
    def recipients(self) -> list[str]:
        """The To addresses, as written in the header."""
        return [str(a.addr_spec) for h in self.parsed.get_all("To", []) for a in h.addresses]

    def _part(self, subtype: str) -> str | None:
        part = self.parsed.get_body(preferencelist=(subtype,))
        if part is None or part.get_content_subtype() != subtype:
            return None
        # Text travels in canonical CRLF form; hand it back with Python newlines.
        return str(part.get_content()).replace("\r\n", "\n")

    @property
    def body(self) -> str | None:
        """The text/plain body, if any."""
        return self._part("plain")

    @property
    def html(self) -> str | None:
        """The text/html body, if any."""
        return self._part("html")


@dataclasses.dataclass
class BatchReport:
    """What happened to the rows of one :meth:`Delivery.finish` (or to ids handed over)."""

    sent: list[int] = dataclasses.field(default_factory=list)
    failed: list[int] = dataclasses.field(default_factory=list)
    # Every recipient suppressed, or past its expiry: ended without a send.
    suppressed: list[int] = dataclasses.field(default_factory=list)
    expired: list[int] = dataclasses.field(default_factory=list)
    # Ended unsent by staging (a before_send veto, no allowed recipient): cancelled.
    cancelled: list[int] = dataclasses.field(default_factory=list)
    # Transient failures, back to queued: (id, attempt, error).
    transient: list[tuple[int, int, TransientError]] = dataclasses.field(default_factory=list)
    not_claimed: list[int] = dataclasses.field(default_factory=list)
    lost: list[int] = dataclasses.field(default_factory=list)
    # Claimed but never handed to the server (shutdown): back to queued, attempt returned.
    released: list[int] = dataclasses.field(default_factory=list)
    # Met a fault of their whole transport (``account_fault``): queued, attempt returned.
    paused: list[int] = dataclasses.field(default_factory=list)
    # Emails that now hold their key (a finished one handed it on): next to claim.
    holders: list[int] = dataclasses.field(default_factory=list)
    # Handed ids claimed and on their way, for a caller that waited for the claim
    # only (``Worker.deliver(..., until_claimed=True)``): their outcomes come later.
    claimed: list[int] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        """Rows finished one way or another."""
        return (len(self.sent) + len(self.failed) + len(self.suppressed) + len(self.expired)
                + len(self.cancelled) + len(self.transient) + len(self.released)
                + len(self.paused))


@dataclasses.dataclass
class Waiter:
    """Someone waiting for the outcomes of ids handed over (:meth:`._worker.Worker.deliver`)."""

    ids: set[int]
    report: BatchReport = dataclasses.field(default_factory=BatchReport)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: Done once each id is claimed (or has an outcome): the loop delivers the rest.
    until_claimed: bool = False

    def take_claimed(self, ids: Sequence[int]) -> bool:
        """Note ``ids`` claimed (when it waits for claims only); True once it has them all."""
        if self.until_claimed:
            mine = [i for i in ids if i in self.ids]
            self.report.claimed.extend(mine)
            self.ids.difference_update(mine)
            if not self.ids:
                self.done.set()
        return not self.ids

    def take(self, report: BatchReport) -> bool:
        """Note the outcomes of its ids in ``report``; True once it has them all."""
        for name in ("sent", "failed", "suppressed", "expired", "cancelled", "not_claimed",
                     "lost", "released", "paused"):
            mine = [i for i in getattr(report, name) if i in self.ids]
            getattr(self.report, name).extend(mine)
            self.ids.difference_update(mine)
        transient = [t for t in report.transient if t[0] in self.ids]
        self.report.transient.extend(transient)
        self.ids.difference_update(t[0] for t in transient)
        if not self.ids:
            self.done.set()
        return not self.ids


class Waiters:
    """Everyone waiting for the outcomes of ids handed over; guarded by its worker's lock."""

    def __init__(self) -> None:
        self._waiters: list[Waiter] = []

    def add(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def discard(self, waiter: Waiter) -> None:
        """Stop telling ``waiter`` (it gave up, or has every outcome already)."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def tell(self, report: BatchReport) -> None:
        """Give each waiter its ids' outcomes in ``report``; those who have them all are done."""
        for waiter in list(self._waiters):
            if waiter.take(report):
                self._waiters.remove(waiter)

    def claimed(self, ids: Sequence[int]) -> None:
        """``ids`` were claimed: those waiting for the claim only may be done."""
        for waiter in list(self._waiters):
            if waiter.take_claimed(ids):
                self._waiters.remove(waiter)


@dataclasses.dataclass(frozen=True)
class Callbacks:
    """What the core's owner hears of outcomes, each called once the outcome is recorded.

    ``sent(email, provider_message_id)`` for a delivered one (the id the
    provider gave it, or None); ``failed(email, error)`` for a
    dead-lettered one; ``events(events)`` for the delivery events stored
    with a batch of outcomes. They run in a delivery thread; an exception they
    raise is logged and delivery goes on.

    ``before_send(email)`` hears no outcome: it is called before each attempt,
    in the delivery thread, with an :class:`~._intercept.OutgoingEmail` it may
    change or veto (see :mod:`._intercept`); an exception it raises fails the
    attempt as a transient failure.
    """

    sent: Callable[[ClaimedEmail, str | None], None] | None = None
    failed: Callable[[ClaimedEmail, TransportError | None], None] | None = None
    #: Delivery events stored with the outcomes (recipients left out as suppressed).
    events: Callable[[Sequence[DeliveryEvent]], None] | None = None
    #: Called at delivery with each email about to go (``@mail.before_send``).
    before_send: BeforeSend | None = None


#: OUTBOX_AMBIGUOUS_RETRIES's default.
AMBIGUOUS_RETRIES = 1
#: OUTBOX_PAUSE_PROBE_SECONDS's default.
PAUSE_SECONDS = 30.0


def outcome_for(email: ClaimedEmail, result: Attempt | None, policy: RetryPolicy, *,
                retry_now: bool = False, paced: bool = False,
                ambiguous_retries: int = AMBIGUOUS_RETRIES,
                now: Callable[[], datetime] = utcnow,
                pause_seconds: float = PAUSE_SECONDS) -> Outcome:
    """What to record for ``email`` after ``result`` (None: claimed past its last attempt).

    The retry policy decides every failure in both modes: a transient one sets
    the row's next due time, or dead-letters it on its last allowed attempt; a
    throttled one gives the attempt back a bounded number of times.
    ``retry_now``: the caller retries it in process, so it is due again at once
    (a throttle deferral still waits its few seconds). ``paced``: its transport
    paces by a shared rate, which the refusal cut: a throttle deferral is due
    again at once, to wait for its slot there. A failure after which
    the message may have been accepted (``maybe_sent``) is retried at most
    ``ambiguous_retries`` times in the row's life, then ends ``failed`` with
    a last error that says it may have been sent. ``now``: the store's clock
    (whether its next attempt would come after its expiry). A fault of the
    whole transport (``account_fault``) gives the attempt back and makes the
    row due again in ``pause_seconds`` (OUTBOX_PAUSE_PROBE_SECONDS): the
    transport is paused meanwhile (:mod:`._pause`).
    """
    if result is None:
        return Outcome(email, Status.FAILED, error_message=SPENT_LEASE, give_back_attempt=True)
    outcome = _outcome_of(email, result, policy, retry_now=retry_now, paced=paced,
                          ambiguous_retries=ambiguous_retries, now=now,
                          pause_seconds=pause_seconds)
    if result.failovers:
        outcome = dataclasses.replace(outcome, failovers=result.failovers)
    unknown = unknown_recipients(result)
    if unknown:
        outcome = dataclasses.replace(outcome, unknown_recipients=unknown)
    return outcome


def _outcome_of(email: ClaimedEmail, result: Attempt, policy: RetryPolicy, *,
                retry_now: bool, ambiguous_retries: int,
                now: Callable[[], datetime], pause_seconds: float,
                paced: bool = False) -> Outcome:
    if isinstance(result, Overdue):
        return Outcome(email, Status.FAILED, give_back_attempt=True, error_message=result.why)
    if isinstance(result, (Suppressed, Expired, Intercepted)):
        return _not_sent(email, result)
    if isinstance(result, Delivered):
        return _delivered(email, result)
    error = result.error
    if isinstance(error, TransientError) and error.account_fault is not None:
        return _paused(email, error, now=now, pause_seconds=pause_seconds)
    return _failed(email, error, policy, retry_now=retry_now, paced=paced,
                   ambiguous_retries=ambiguous_retries, now=now)


def _paused(email: ClaimedEmail, error: TransientError, *, now: Callable[[], datetime],
            pause_seconds: float) -> Outcome:
    """A fault of the whole transport: the attempt is given back, due again at the probe."""
    due_in = max(pause_seconds, error.retry_after or 0.0)
    if email.expires_at is not None and now() + timedelta(seconds=due_in) >= email.expires_at:
        return Outcome(email, Status.EXPIRED, error_code=error.code, give_back_attempt=True,
                       error_message=f"expires at {email.expires_at:%Y-%m-%d %H:%M:%S} UTC, "
                                     "before its transport's next probe; last error: "
                                     f"{error.message}")
    return Outcome(email, Status.QUEUED, error_code=error.code, error_message=error.message,
                   due_in=due_in, give_back_attempt=True)


def _not_sent(email: ClaimedEmail, result: Suppressed | Expired | Intercepted) -> Outcome:
    """An email that ends without a send: every recipient suppressed, past its expiry, or
    ended by staging (cancelled, with why)."""
    if isinstance(result, Intercepted):
        return Outcome(email, Status.CANCELLED, give_back_attempt=True,
                       error_message=result.reason)
    if isinstance(result, Suppressed):
        why = ", ".join(f"{address} ({reason})" for address, reason in email.suppressed)
        return Outcome(email, Status.SUPPRESSED, give_back_attempt=True,
                       error_message=f"every recipient is on the suppression list: {why}")
    return Outcome(email, Status.EXPIRED, give_back_attempt=True,
                   error_message=f"expired at {email.expires_at:%Y-%m-%d %H:%M:%S} UTC "
                                 "before it was sent")


def _delivered(email: ClaimedEmail, result: Delivered) -> Outcome:
    """A delivered email, with the recipients the server refused, if any."""
    if not result.refused:
        # Nearly every result: nothing to write down but the provider's id.
        return Outcome(email, Status.SENT, provider_message_id=result.provider_message_id)
    refused = "; ".join(f"{addr}: {code} {text}"
                        for addr, (code, text) in result.refused.items())
    return Outcome(email, Status.SENT, provider_message_id=result.provider_message_id,
                   error_code=max((c for c, _ in result.refused.values()), default=0),
                   error_message=f"some recipients refused: {refused}" if refused else None)


def _failed(email: ClaimedEmail, error: TransportError, policy: RetryPolicy, *,
            retry_now: bool, ambiguous_retries: int, now: Callable[[], datetime],
            paced: bool = False) -> Outcome:
    """A failed attempt: dead-lettered, released (not attempted), or due again later."""
    if isinstance(error, PermanentError):
        return Outcome(email, Status.FAILED, error_code=error.code, error_message=error.message)
    if isinstance(error, NotAttempted):
        return Outcome(email, Status.QUEUED, give_back_attempt=True)
    maybe_sent = isinstance(error, TransientError) and error.maybe_sent
    if maybe_sent and email.ambiguous_attempts >= ambiguous_retries:
        return Outcome(email, Status.FAILED, error_code=error.code, maybe_sent=True,
                       error_message=may_have_been_sent(email.ambiguous_attempts + 1,
                                                        ambiguous_retries, error.message))
    decision = policy.decide(email.attempt, error, deferrals=email.throttle_deferrals)
    if decision.dead:
        return Outcome(email, Status.FAILED, error_code=error.code, error_message=error.message,
                       maybe_sent=maybe_sent)
    due_in = _due_in(error, decision, retry_now=retry_now, paced=paced)
    if email.expires_at is not None and \
            now() + timedelta(seconds=due_in or 0.0) >= email.expires_at:
        # Its next attempt would come too late: it ends now, with why.
        return Outcome(email, Status.EXPIRED, error_code=error.code,
                       error_message=f"expires at {email.expires_at:%Y-%m-%d %H:%M:%S} UTC, "
                                     f"before its next attempt; last error: {error.message}")
    return Outcome(email, Status.QUEUED, error_code=error.code, error_message=error.message,
                   due_in=due_in, give_back_attempt=not decision.charge,
                   deferred=decision.deferral, maybe_sent=maybe_sent)


def _due_in(error: TransportError, decision: Decision, *, retry_now: bool,
            paced: bool = False) -> float | None:
    """Seconds until a row queued again is due (None: at once)."""
    due_in = (None if (retry_now and decision.charge) or (paced and decision.deferral)
              else decision.delay)
    asked = getattr(error, "retry_after", None)
    if asked is not None:
        # The server said when to come back (an HTTP Retry-After): not sooner.
        due_in = max(due_in or 0.0, asked)
    return due_in


#: How the last error of a row ended by OUTBOX_AMBIGUOUS_RETRIES starts.
MAY_HAVE_BEEN_SENT = "may have been sent"


def may_have_been_sent(unclear: int, retries: int, message: str) -> str:
    """The last error of a row whose ``unclear`` attempts may each have delivered it."""
    return (f"{MAY_HAVE_BEEN_SENT}: {unclear} attempt(s) ended without knowing whether the "
            f"server accepted it, and it is not retried again (OUTBOX_AMBIGUOUS_RETRIES="
            f"{retries}) so as not to deliver another copy; check with the recipient or the "
            f"provider before retrying it. Last: {message}")


class Heartbeat:
    """Renews the leases of rows in flight every third of a lease."""

    def __init__(self, store: Store, lease_seconds: float,
                 faults: _degrade.FaultTracker) -> None:
        self.store = store
        self.lease_seconds = lease_seconds
        self.faults = faults
        self._tracked: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def track(self, claimed: Sequence[ClaimedEmail]) -> None:
        """Keep the leases of ``claimed`` alive until :meth:`done`."""
        with self._lock:
            for email in claimed:
                self._tracked.setdefault(email.owner, set()).add(email.id)
            if self._tracked and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="outbox-heartbeat",
                                                daemon=True)
                self._thread.start()

    def done(self, claimed: Sequence[ClaimedEmail]) -> None:
        """Stop renewing the leases of ``claimed`` (recorded, or released)."""
        with self._lock:
            for email in claimed:
                ids = self._tracked.get(email.owner)
                if ids is not None:
                    ids.discard(email.id)
                    if not ids:
                        del self._tracked[email.owner]

    def renew_now(self) -> int:
        """Renew every tracked lease at once (the clock may have jumped: a test's
        :class:`~._clock.TestClock`); how many rows were renewed."""
        with self._lock:
            tracked = [(owner, sorted(ids)) for owner, ids in self._tracked.items()]
        return sum(self.store.leases.renew_leases(owner, ids, self.lease_seconds)
                   for owner, ids in tracked)

    def _run(self) -> None:
        interval = self.lease_seconds / 3
        while True:
            time.sleep(interval)
            with self._lock:
                tracked = [(owner, sorted(ids)) for owner, ids in self._tracked.items()]
            for owner, ids in tracked:
                try:
                    self.store.leases.renew_leases(owner, ids, self.lease_seconds)
                    self.faults.recovered("heartbeat")
                except Exception as exc:  # noqa: BLE001 - reported; the next beat retries
                    self.faults.failing(
                        "heartbeat", "Could not renew the leases of emails being sent",
                        consequence=(f"{len(ids)} email(s) in flight may be claimed again by "
                                     "another process once their lease expires, which can "
                                     "send a duplicate with the same Message-ID"),
                        fix="check the database connection; raise OUTBOX_LEASE_SECONDS if the "
                            "database is slow",
                        exc=exc)


class Delivery:
    """Claimed rows -> outcomes recorded, for one app in one process."""

    def __init__(self, *, config: OutboxConfig, store: Store,
                 transports: dict[str, Transport], faults: _degrade.FaultTracker,
                 callbacks: Callbacks | None = None, events: EventLog,
                 releases: Releases | None = None) -> None:
        self.callbacks = callbacks or Callbacks()
        self.config = config
        self.store = store
        #: Where skips and refusals are written, with the outcomes.
        self.events = events
        events.otel = config.otel  # its events' spans follow OUTBOX_OTEL too
        #: Every named transport, "default" first (a failover chain is one transport).
        self.transports = transports
        self.transport = next(iter(transports.values()))
        self.faults = faults
        self.heartbeat = Heartbeat(store, config.lease_seconds, faults)
        self.policy = config.retry_policy()
        #: What this process releases while it stops (the owner's, shared with its worker).
        self.releases = releases or Releases(store, config)
        #: OUTBOX_OTEL: the attempts traced live (_tracing.LIVE), their Message-IDs by id.
        self._started: dict[int, str] = {}
        #: What the ``mailbox`` transports delivered, written with the outcomes.
        self.mailbox = Keeper(transports, store)
        #: Staging: OUTBOX_REDIRECT_TO, OUTBOX_ALLOWED_RECIPIENTS, before_send.
        self.interceptor = Interceptor(
            redirect_to=config.redirect_to, allowed=config.allowed_recipients,
            before_send=self.callbacks.before_send,
            allow_local=config.allow_local_addresses, allow_smtputf8=config.allow_smtputf8,
            max_attempts=config.max_attempts)

    def release(self, claimed: Sequence[ClaimedEmail]) -> int:
        """Release claimed rows unsent (queued, attempt returned); stop renewing their leases."""
        if not claimed:
            return 0
        self._untraced(claimed)
        try:
            released = self.store.leases.release(claimed)
            self.releases.note(released)
            return len(released)
        finally:
            self.heartbeat.done(claimed)

    def hold(self, claimed: Sequence[ClaimedEmail], why: str, due_in: float) -> int:
        """Release claimed rows of a paused transport unsent: queued (attempt returned), due
        again in ``due_in`` seconds (its probe), with ``why`` as their last error."""
        if not claimed:
            return 0
        self._untraced(claimed)
        try:
            outcomes = [Outcome(email, Status.QUEUED, give_back_attempt=True,
                                due_in=due_in, error_message=why) for email in claimed]
            return len(self.store.leases.record(outcomes).recorded)
        finally:
            self.heartbeat.done(claimed)

    # -- screening --------------------------------------------------------------------

    def screen(self, claimed: Sequence[ClaimedEmail]) -> list[ClaimedEmail] | None:
        """``claimed`` with their suppressed recipients noted; None if the list could not be read.

        The caller releases the rows then: sending to an address on the
        list would cost the sender's reputation what the list exists to save.
        """
        try:
            screened = self.events.suppressions.screen(claimed)
        except Exception as exc:  # noqa: BLE001 - reported; the caller releases the rows
            self.faults.failing(
                "suppression", "Could not read the suppression list for claimed emails",
                consequence=f"{len(claimed)} email(s) are released unsent (queued, their "
                            "attempt returned) and tried again at the next claim",
                fix="check the database connection and that outbox_suppression exists "
                    "(`flask db upgrade outbox@head`)",
                exc=exc)
            return None
        self.faults.recovered("suppression")
        return screened

    def intercept(self, screened: Sequence[ClaimedEmail]
                  ) -> tuple[list[ClaimedEmail], list[tuple[ClaimedEmail, Attempt]]]:
        """Staging (:mod:`._intercept`) on screened emails that have a recipient left:
        those to send, as intercepted, and those it ends unsent, with their results."""
        if not self.interceptor.active:
            return list(screened), []
        going: list[ClaimedEmail] = []
        ended: list[tuple[ClaimedEmail, Attempt]] = []
        for email in screened:
            try:
                intercepted, result = self.interceptor.intercept(email)
            except Exception as exc:  # noqa: BLE001 - reported; the attempt fails, retried
                # The hook's own exceptions are handled inside; this is staging's fault.
                _degrade.report(
                    f"Staging could not prepare email {email.id} ({email.message_id}) for "
                    f"delivery ({type(exc).__name__}: {clean_line(exc, 300)})",
                    consequence="it is not sent on this attempt (never unintercepted): it is "
                                "retried as a transient failure, and dead-lettered after "
                                "OUTBOX_MAX_ATTEMPTS",
                    fix="report this with the traceback below and the email's id",
                    exc=exc)
                intercepted, result = email, Failed(TransientError(
                    f"staging failed: {type(exc).__name__}: {clean_line(exc, 300)}"))
            if result is None:
                going.append(intercepted)
            else:
                ended.append((intercepted, result))
        return going, ended

    # -- delivering -------------------------------------------------------------------

    def finish(self, done: Sequence[tuple[ClaimedEmail, Attempt | None]], *,
               policy: RetryPolicy | None = None, retry_now: Collection[int] = (),
               kept: KeptConnection | None = None, paced: Collection[int] = ()
               ) -> BatchReport:
        """Record the results of ``done`` in one transaction; report and signal them.

        A result of None: claimed past its last attempt (its lease had expired
        on that one), dead-lettered without a send. ``retry_now``: ids the
        caller retries in process, ``paced``: ids sent at a shared rate's slot
        (see :func:`outcome_for`). ``kept``: the caller's own connection for the record.
        """
        policy = policy or self.policy
        report = BatchReport()
        if not done:
            return report
        outcomes = [outcome_for(email, result, policy, retry_now=email.id in retry_now,
                                paced=email.id in paced,
                                ambiguous_retries=self.config.ambiguous_retries,
                                now=self.store.clock,
                                pause_seconds=self.config.pause_probe_seconds)
                    for email, result in done]
        stored: list[DeliveryEvent] = []
        record_started = time.time_ns()
        try:
            recorded, lost, report.holders = self._record(outcomes, kept, stored)
        finally:
            self.heartbeat.done([email for email, _ in done])
            self.mailbox.forget(email.id for email, _ in done)
        errors: dict[int, TransportError] = {
            email.id: (result.error if isinstance(result, Failed) else TransientError(SPENT_LEASE))
            for email, result in done
            if not isinstance(result, (Delivered, Suppressed, Expired, Intercepted, Overdue))}
        overdue: list[Outcome] = []
        for outcome in recorded:
            self._report(outcome, errors.get(outcome.email.id), report, policy, overdue)
        if overdue:
            self._report_overdue(overdue)
        if recorded and self.config.otel.enabled is not False:
            self._trace(recorded, (record_started, time.time_ns()))
        if stored:
            self._tell(self.callbacks.events, stored)
        for outcome in lost:
            report.lost.append(outcome.email.id)
            _degrade.report(
                f"Email {outcome.email.id} ({outcome.email.message_id}) lost its lease while "
                f"being sent (outcome {outcome.status.value} not recorded)",
                consequence="another delivery claimed it after the lease expired; it may have "
                            "been sent twice with the same Message-ID",
                fix="raise OUTBOX_LEASE_SECONDS above the slowest SMTP transaction, or check "
                    "that the database keeps up with lease renewals")
        return report

    def traced(self, claimed: Sequence[ClaimedEmail], started: int | None = None) -> None:
        """Open the span of the claim that took ``claimed`` (its statement began at
        ``started``, time.time_ns()) and a live CONSUMER span for each attempt of
        them not traced yet (see flask_mail_outbox/_tracing.py). Never raises."""
        if self.config.otel.enabled is False or not claimed:
            return
        tracer = _tracing.tracer(self.config.otel)
        if tracer is None:
            return
        fresh = [email for email in claimed if email.id not in self._started]
        if not fresh:
            return
        self._started.update((email.id, email.message_id) for email in fresh)
        try:
            _tracing.claim(tracer, self.config.otel, fresh, started=started,
                           server=self._server)
        except Exception as exc:  # noqa: BLE001 - reported; delivery goes on untraced
            self._untraced(fresh)
            _degrade.report(
                f"Could not trace the claim of {len(fresh)} email(s)",
                consequence="their delivery spans are missing or incomplete; they are "
                            "delivered as usual",
                fix="check the database connection and the app's OpenTelemetry span "
                    "processors (the traceback below names the failing one)",
                exc=exc)

    def _untraced(self, claimed: Sequence[ClaimedEmail]) -> None:
        """Forget the attempts given back unsent: their spans are never ended."""
        if self._started:
            for email in claimed:
                message_id = self._started.pop(email.id, None)
                if message_id is not None:
                    _tracing.forget(email.id, message_id)

    def _trace(self, recorded: Sequence[Outcome], record: tuple[int, int]) -> None:
        """End the CONSUMER span of each recorded attempt with its outcome, after one
        ``record`` span for the transaction (``record``: its times) linked to them all;
        one opened now for an attempt not seen claimed (flask_mail_outbox/_tracing.py).

        Never raises: the outcomes are recorded already, and tracing must not stop delivery.
        """
        try:
            ended: list[tuple[_tracing.Attempt, str, int, bool]] = []
            unseen: list[Outcome] = []
            for outcome in recorded:
                email = outcome.email
                message_id = self._started.pop(email.id, None)
                attempt = (_tracing.LIVE.pop((email.id, message_id), None)
                           if message_id is not None else None)
                if attempt is None:
                    unseen.append(outcome)
                    continue
                ended.append((attempt, outcome.status.value, outcome.error_code,
                              outcome.status is Status.FAILED))
            tracer = _tracing.tracer(self.config.otel) if unseen else None
            for outcome in unseen if tracer is not None else ():
                email = outcome.email
                attempt = _tracing.unseen(tracer, self.config.otel, email,
                                          start_time=record[0],
                                          server=self._server(email.transport))
                ended.append((attempt, outcome.status.value, outcome.error_code,
                              outcome.status is Status.FAILED))
            _tracing.end_attempts(ended, record)
        except Exception as exc:  # noqa: BLE001 - reported; the outcomes are recorded
            for outcome in recorded:
                message_id = self._started.pop(outcome.email.id, None)
                _tracing.LIVE.pop((outcome.email.id, message_id or ""), None)
            _degrade.report(
                f"Could not trace {len(recorded)} delivery attempt(s) (emails "
                f"{', '.join(str(outcome.email.id) for outcome in recorded[:10])})",
                consequence="their delivery spans are missing or incomplete; their outcomes "
                            "are recorded and delivery goes on",
                fix="check the database connection and the app's OpenTelemetry span "
                    "processors and exporters (the traceback below names the failing one)",
                exc=exc)

    def _server(self, transport: str) -> tuple[str, int] | None:
        """The server a transport sends to: its SMTP server, or its API's host and port."""
        try:
            spec = self.config.transport_spec(transport)
        except KeyError:
            return None
        if spec.kind == "smtp":
            return (spec.smtp.host, spec.smtp.port)
        return _tracing.server_of(self.transports.get(transport))

    def _report(self, outcome: Outcome, error: TransportError | None, report: BatchReport,
                policy: RetryPolicy, overdue: list[Outcome]) -> None:
        """Count one recorded outcome, report it when it needs it, send its signal."""
        email = outcome.email
        if outcome.status is Status.SENT:
            report.sent.append(email.id)
            if outcome.error_message:
                _degrade.report(
                    f"Email {email.id} ({email.message_id}) was accepted for some "
                    f"recipients and refused for others: {outcome.error_message}",
                    consequence="it is marked sent and will not be retried, since a retry "
                                "would send a second copy to the recipients who got it",
                    fix="check the refused addresses and send them a new email if needed")
            self._tell(self.callbacks.sent, email, outcome.provider_message_id)
        elif outcome.status is Status.FAILED:
            report.failed.append(email.id)
            if (outcome.error_message or "").startswith(OVERDUE):
                overdue.append(outcome)  # one ERROR for them all (_report_overdue)
                self._tell(self.callbacks.failed, email, error)
            else:
                self._dead_lettered(outcome, error, policy)
        elif outcome.status in (Status.SUPPRESSED, Status.EXPIRED, Status.CANCELLED):
            {Status.SUPPRESSED: report.suppressed, Status.EXPIRED: report.expired,
             Status.CANCELLED: report.cancelled}[outcome.status].append(email.id)
            logger.info("Email %s (%s) was not sent: %s", email.id, email.message_id,
                        outcome.error_message)
        elif isinstance(error, NotAttempted):
            report.released.append(email.id)
            self.releases.note([email.id])
        elif isinstance(error, TransientError) and error.account_fault is not None:
            # Reported once per fault by the pause (._pause), not once per email.
            report.paused.append(email.id)
        else:
            report.transient.append(
                (email.id, email.attempt,
                 error if isinstance(error, TransientError) else TransientError(str(error))))

    def _report_overdue(self, outcomes: list[Outcome]) -> None:
        """One ERROR for the emails a paused transport held past the queue lifetime.

        A queue of thousands reaching its lifetime would otherwise log thousands.
        """
        ids = [outcome.email.id for outcome in outcomes]
        shown = ", ".join(str(i) for i in ids[:20]) + (", ..." if len(ids) > 20 else "")
        _degrade.report(
            f"{len(ids)} email(s) [{shown}] were not sent: each "
            f"{outcomes[0].error_message or ''}",
            consequence="they are dead-lettered (status failed) and will not be sent",
            fix="correct the transport's fault, then put them back with "
                "`flask outbox dlq retry --all` (or mail.retry(id))")

    def _dead_lettered(self, outcome: Outcome, error: TransportError | None,
                       policy: RetryPolicy) -> None:
        """Report a dead-lettered email at ERROR (why, and how to put it back); signal it."""
        email = outcome.email
        maybe = (outcome.error_message or "").startswith(MAY_HAVE_BEEN_SENT)
        overdue = (outcome.error_message or "").startswith(OVERDUE)
        why = ("failed permanently" if isinstance(error, PermanentError) else
               "was not sent: it " + (outcome.error_message or "") if overdue else
               "may have been sent (it is not retried again)" if maybe else
               "had an expired lease (the process sending it stopped) and no attempt "
               f"left (OUTBOX_MAX_ATTEMPTS={policy.max_attempts}); the server may or may "
               "not have accepted its last one" if outcome.error_message == SPENT_LEASE else
               f"failed for the last allowed time (OUTBOX_MAX_ATTEMPTS="
               f"{policy.max_attempts})")
        _degrade.report(
            f"Email {email.id} ({email.message_id}) {why}" if overdue else
            f"Email {email.id} ({email.message_id}) {why} on attempt {email.attempt}: "
            f"{error}",
            consequence="it is dead-lettered (status failed) and will not be sent"
                        + (" again" if maybe else ""),
            fix=(f"check whether it arrived (the provider's log, the recipient) before "
                 f"putting it back with mail.retry({email.id})" if maybe else
                 f"correct the cause, then put it back with mail.retry({email.id}) or "
                 f"`flask outbox dlq retry {email.id}`"))
        self._tell(self.callbacks.failed, email, error)

    def report_left_queued(self, email_id: int, attempt: int, error: Exception, *,
                           due_now: bool) -> None:
        """Report a row inline delivery leaves queued after its in-process retries."""
        when = ("due again now: this process stopped before retrying it" if due_now else
                "due again after its retry backoff, OUTBOX_RETRY_BASE_SECONDS doubling per "
                "attempt up to OUTBOX_RETRY_MAX_SECONDS, or in a few seconds with its attempt "
                "given back if the server was throttling")
        _degrade.report(
            f"Email {email_id} could not be delivered after {attempt} attempt(s): {error}",
            consequence=f"it stays queued ({when}); the periodic sweep (every "
                        "OUTBOX_SWEEP_INTERVAL_SECONDS) or a durable dispatcher takes it when "
                        f"due, and it is dead-lettered if attempt {self.policy.max_attempts} "
                        "(OUTBOX_MAX_ATTEMPTS) fails too",
            fix=_left_queued_fix(email_id, error))

    def report_reaped(self, reaped: Reaped) -> None:
        """Report what a reap found: rows whose sender died mid-delivery."""
        if reaped.requeued:
            _degrade.report(
                f"{len(reaped.requeued)} email(s) {list(reaped.requeued)[:20]} had an expired "
                "lease: the process sending them stopped mid-delivery",
                consequence="they are queued again and will be delivered; one may arrive "
                            "twice, with the same Message-ID, if its server had accepted it "
                            "already",
                fix="nothing for these emails; find why the other process stopped "
                    "(killed, out of memory) and give workers time to stop on SIGTERM")

    #: Seconds between attempts to record outcomes while the database refuses.
    record_retry_delays = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)

    def _record(self, outcomes: list[Outcome], kept: KeptConnection | None = None,
                stored: list[DeliveryEvent] | None = None) -> Recorded:
        """Record outcomes, retrying while the database is briefly unavailable.

        The messages were handed to the server already: giving up here means
        they are sent again once their lease expires. The heartbeat keeps the
        leases alive meanwhile (when the database lets it). The delivery
        events they come with (see :meth:`_write_events`) are written in the
        same transaction and appended to ``stored``.
        """
        def write_events(tx: Connection, recorded: list[Outcome]) -> None:
            written = self._write_events(tx, recorded)
            if stored is not None:
                stored[:] = written

        def record(conn: Connection | None = None) -> Recorded:
            return self.store.leases.record(outcomes, scrub_sent=self.config.scrub_sent, conn=conn,
                                     then=write_events)

        for delay in (*self.record_retry_delays, None):
            try:
                result = record() if kept is None else kept.run(record)
            except Exception as exc:
                if about_the_data(exc):
                    # Not an outage: the database refuses what the outcomes say.
                    # Retrying would only sleep and, the rows left sending, send
                    # them again: record them without what it refuses.
                    return self._record_made_safe(outcomes, kept, stored, exc)
                if delay is None:
                    sent = sum(o.status is Status.SENT for o in outcomes)
                    _degrade.report(
                        f"Could not record the outcome of {len(outcomes)} email(s) "
                        f"({sent} accepted by the server)",
                        consequence="they stay sending until their lease expires, then are "
                                    "delivered again: the accepted ones arrive twice, with the "
                                    "same Message-ID",
                        fix="check the database connection; on SQLite, keep other writers' "
                            "transactions short",
                        exc=exc)
                    raise
                self.faults.failing(
                    "record", "Could not record delivery outcomes; retrying",
                    consequence="the outcomes are retried for about a minute while the "
                                "leases are kept alive",
                    fix="check the database connection", exc=exc)
                time.sleep(delay)
            else:
                self.faults.recovered("record")
                return result
        raise RuntimeError("unreachable")  # pragma: no cover - the loop returns or raises

    def _record_made_safe(self, outcomes: list[Outcome], kept: KeptConnection | None,
                          stored: list[DeliveryEvent] | None, refused: Exception) -> Recorded:
        """Record ``outcomes`` the database refused for their data, without the poisoned part.

        First with every text from outside made safe (:func:`made_safe`); if
        the database still refuses, with none of it (:func:`bare`): each
        email keeps its status (a sent one stays sent) and says why its
        server's reply is missing. Each try is one write, never a sleep: the
        rows are never left ``sending`` to be claimed and sent again.
        """
        why = f"{type(refused).__name__}: {clean_line(refused, 300)}"
        last: Exception = refused
        for step, shaped in (("made safe", [made_safe(o) for o in outcomes]),
                             ("left out", [bare(o, why) for o in outcomes])):
            def write_events(tx: Connection, recorded: list[Outcome]) -> None:
                written = self._write_events(tx, recorded)
                if stored is not None:
                    stored[:] = written

            def record(conn: Connection | None = None,
                       shaped: list[Outcome] = shaped) -> Recorded:
                return self.store.leases.record(shaped, scrub_sent=self.config.scrub_sent,
                                         conn=conn, then=write_events)

            try:
                result = record() if kept is None else kept.run(record)
            except Exception as exc:
                if not about_the_data(exc):
                    raise
                last = exc
                continue
            _degrade.report(
                f"The database refused the outcome of {len(outcomes)} email(s) "
                f"{[o.email.id for o in outcomes][:20]} as the server's reply gave it ({why})",
                consequence=f"they are recorded with the server's text {step} (their status "
                            "is as delivery found it: nothing is sent again)",
                fix="nothing for these emails; report the server's reply if it recurs")
            return result
        _degrade.report(
            f"Could not record the outcome of {len(outcomes)} email(s) even without the "
            "server's reply",
            consequence="they stay sending until their lease expires, then are delivered "
                        "again: the accepted ones arrive twice, with the same Message-ID",
            fix="report this with the traceback below", exc=last)
        raise last

    def _write_events(self, tx: Connection, recorded: list[Outcome]) -> list[DeliveryEvent]:
        """The events recorded outcomes come with, written on ``tx`` (with what staging
        did to them: :func:`._intercept.write_notes`).

        A recipient left out as suppressed is a ``rejected`` event; one the
        server refused as nonexistent (5.1.1, 5.1.2, 5.1.10) is a permanent
        ``bounced`` event, which puts the address on the suppression list.
        """
        write_notes(tx, recorded)
        self.mailbox.keep_on(tx, recorded)
        events = []
        for outcome in recorded:
            email = outcome.email
            if outcome.status in (Status.SENT, Status.SUPPRESSED):
                events += [DeliveryEvent(
                    "rejected", recipient=address, transport=email.transport,
                    email_id=email.id, reason="suppressed",
                    description=f"on the suppression list ({reason}): "
                    "left out of the envelope") for address, reason in email.suppressed]
            events += [DeliveryEvent(
                "bounced", bounce_kind="permanent", recipient=address,
                transport=email.transport, email_id=email.id, mta_response=reply,
                reason=smtp_reason(reply),
                description="refused by the server as an unknown recipient")
                for address, reply in outcome.unknown_recipients]
        if not events:
            return []
        return list(self.events.record_on(tx, events, source="smtp refusal").new)

    def _tell(self, callback: Callable[..., None] | None, *args: Any) -> None:
        """Call one of the owner's callbacks; one that raises is logged, never breaks delivery."""
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            first = args[0] if args else None
            logger.exception("An outcome callback raised (email %s); the email's outcome is "
                             "recorded and delivery goes on", getattr(first, "id", None))


#: Reasons (:mod:`.._reasons`) of a reply about the recipient's mailbox, not the transport.
_RECIPIENT_REASONS = frozenset({"user_unknown", "host_unknown", "suspended", "has_moved",
                                "not_accepting", "mailbox_full"})
#: Reasons of a reply about this email's content or its sender's standing.
_MESSAGE_REASONS = frozenset({"message_too_big", "content", "spam", "virus", "authentication",
                              "policy", "blocked", "relaying_denied"})


def _left_queued_fix(email_id: int, error: Exception) -> str:
    """The Fix of an email left queued, chosen by the reply: the transport's settings only
    when the failure can be theirs (no reply, a lost connection, a login, a 421)."""
    reply = (f"{error.code} {error.message}" if isinstance(error, TransportError)
             and error.code and not getattr(error, "transport_fault", False) else "")
    reason = smtp_reason(reply) if reply else "undefined"
    if reason in _RECIPIENT_REASONS:
        return (f"nothing in the transport's settings: the reply is about the recipient's "
                f"mailbox ({reason}), which only the recipient can change; it is retried as "
                f"it is, and `flask outbox cancel {email_id}` stops it")
    if reason in _MESSAGE_REASONS:
        return (f"the reply is about this email or its sender ({reason}), not the "
                "transport's settings: read it, correct the message or the sender's domain "
                f"(SPF, DKIM), or stop it with `flask outbox cancel {email_id}`")
    return ("check the transport's settings (MAIL_SERVER and MAIL_PORT for SMTP, the "
            "entry's API settings for a provider) and that it accepts mail; "
            "`flask outbox status` shows what waits")
