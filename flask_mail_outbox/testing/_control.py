"""The test kit's control half: delivery, the clock, failures and events, on demand.

:class:`OutboxControl` takes one app under test and puts its outbox on a
:class:`~flask_mail_outbox.core.TestClock`. Nothing runs behind the test's
back: the worker is ticked by hand (no thread), no sweep job runs, and the
clock moves only when :meth:`OutboxControl.advance` says so. Everything goes
through the code production runs:

* :meth:`OutboxControl.deliver` is the worker's own drain: the reap of expired
  leases, the dispatcher's claim of due rows, the transport, the record, the
  signals (:meth:`~flask_mail_outbox.core.Worker.drain`);
* :meth:`OutboxControl.fail_next` scripts the memory transport to answer as a
  real server would (a 451, a 550, a 421 rate reply), so the retry policy,
  dead letters and ``email_failed`` are production's;
* :meth:`OutboxControl.simulate_event` records an event through the core's
  event log and sends ``email_event``, as a verified webhook does.

Every bad use raises :class:`TestKitError`, naming the method and what to do.
The user side (assertions, the pytest plugin) is :mod:`flask_mail_outbox.testing`'s.
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from flask import Flask

from .._events import DeliveryEvent
from .._flask.state import EXTENSION_KEY, AppState
from .._reasons import REASONS
from ..core._internal import Outbox, OutboxConfig, Status, TestClock, email_table
from ..transports import MemoryTransport
from ..transports._simple import FAILURE_REPLIES, Failures

#: The modes: "inline" delivers due mail inside ``commit()`` (as ``TESTING`` does),
#: "manual" delivers nothing until :meth:`OutboxControl.deliver`.
MODES = ("inline", "manual")

#: What :meth:`OutboxControl.simulate_event` takes: kind -> (event type, bounce kind).
EVENT_KINDS: dict[str, tuple[str, str | None]] = {
    "delivered": ("delivered", None),
    "bounced": ("bounced", "permanent"),
    "soft_bounced": ("bounced", "transient"),
    "complained": ("complained", None),
    "unsubscribed": ("unsubscribed", None),
}

#: The reason a simulated event of each kind has when ``reason=`` is not given: a hard
#: bounce is a mailbox that does not exist, a soft one a full mailbox.
DEFAULT_REASONS: dict[str, str | None] = {
    "delivered": None, "bounced": "user_unknown", "soft_bounced": "mailbox_full",
    "complained": "complaint", "unsubscribed": None,
}

#: Real seconds :meth:`OutboxControl.deliver` waits at most for the transport's results.
DELIVER_TIMEOUT = 60.0


class TestKitError(RuntimeError):
    """The test kit used in a way it cannot work; the message names the fixture or
    method and what to do instead."""

    __test__ = False  # not a pytest test class, whatever its name


def _choices(values: Any) -> str:
    return ", ".join(repr(value) for value in values)


class OutboxControl:
    """Delivery, time, failures and events of one app's outbox, under a test's control.

    ``mode="manual"``: a commit delivers nothing, :meth:`deliver` does;
    ``mode="inline"``: due mail goes out inside ``commit()`` as with
    ``TESTING``, and :meth:`deliver` delivers what came due since (after
    :meth:`advance`, a retry's backoff). Either way the app's worker runs in
    the caller's thread only, and the app's outbox is on :attr:`clock` until
    :meth:`close`.

    Raises :class:`TestKitError` when the app has no outbox, another control
    holds it, or a transport other than ``memory`` is configured.
    """

    __test__ = False

    def __init__(self, app: Flask, *, mode: str = "manual", label: str = "OutboxControl") -> None:
        #: What error messages call this control: the fixture's name under the pytest plugin
        #: (``outbox.advance(60): ...``), so an error names what the test used.
        self.label = label
        if mode not in MODES:
            raise TestKitError(f"{label}(app, mode={mode!r}): the mode is one of "
                               f"{_choices(MODES)}")
        state = app.extensions.get(EXTENSION_KEY) if isinstance(app, Flask) else None
        if not isinstance(state, AppState):
            raise TestKitError(
                f"{label}(app): {app!r} has no flask-mail-outbox; pass the Flask app "
                "under test, made with OutboxMail(app) or mail.init_app(app)")
        if state.clock is not None:
            raise TestKitError(
                f"{label}(app): this app's outbox is under another test kit's control "
                "already (a second outbox fixture or OutboxControl on the same app); use that "
                "one, or close() it first")
        _check_transports(state.config, label)
        self.app = app
        self.mode = mode
        #: The outbox's clock while this control holds the app (see :meth:`advance`).
        self.clock = TestClock()
        #: The scripted failures of every memory transport of the app (see :meth:`fail_next`).
        self.failures = Failures()
        self._state = state
        self._closed = False
        # No sweep job in this process while the test runs: it would deliver in a
        # thread of its own, at times the test does not choose.
        self._serving = state.serving
        state.serving = False
        scheduler = state.scheduler
        if scheduler is not None and scheduler.pid == os.getpid():
            state.scheduler = None
            scheduler.stop()
        state.use_clock(self.clock, prepare=self._prepare)
        try:
            state.outbox()  # made now: a set-up that cannot work fails here
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------

    def _prepare(self, outbox: Outbox) -> None:
        """Each core made on :attr:`clock`: worker ticked by hand, memory transports scripted."""
        transports = outbox.transports
        wrapped = sorted(name for name, transport in transports.items()
                         if not isinstance(transport, MemoryTransport))
        if wrapped:
            raise TestKitError(
                f"{self.label}(app): transport(s) {_choices(wrapped)} are not plain memory "
                "transports (a failover list wraps them); remove the failover entries in tests")
        for transport in transports.values():
            if isinstance(transport, MemoryTransport):
                transport.failures = self.failures
        outbox.manual = self.mode == "manual"
        worker = outbox.worker
        worker.hand_ticked = True  # never a thread: drained in the caller's thread
        worker.dispatch()  # each drain claims every due row, as a dispatcher does

    def _outbox(self, method: str) -> Outbox:
        """The app's core, checked to be still this control's."""
        if self._closed:
            raise TestKitError(f"{self.label}.{method}: this control is closed; make a new "
                               "one (or use the outbox fixture) for another test")
        state = self._state
        if state.clock is not self.clock:
            raise TestKitError(
                f"{self.label}.{method}: the app's outbox is no longer on this control's "
                "clock (AppState.use_clock() was called since); make a new control")
        return state.outbox()

    def _no_thread(self, method: str, outbox: Outbox) -> None:
        """Refuse ``method`` while something delivers in a thread of its own."""
        scheduler = self._state.scheduler
        if outbox.has_worker and outbox.worker.running:
            raise TestKitError(
                f"{self.label}.{method}: a delivery thread is running for this app (its "
                "worker was started outside the test kit); let the kit drive delivery: "
                "deliver() instead of starting a worker, or stop it (mail.stop()) first")
        if scheduler is not None and scheduler.pid == os.getpid():
            raise TestKitError(
                f"{self.label}.{method}: the app's sweep jobs run in a thread (started "
                "after the kit took the app over); set OUTBOX_RUN_SCHEDULER = False in the "
                "test configuration")

    # -- delivery and time -------------------------------------------------------------

    def deliver(self) -> int:
        """Deliver every email due now, in this thread; how many were attempted.

        The worker's own path: expired leases reaped, due rows claimed (by
        priority, per key, per transport), sent through the memory transport,
        outcomes recorded, signals sent; repeated until nothing more is due now
        (the next email of a key included). A transient failure is queued
        again for its backoff: :meth:`advance` past it, then deliver again.
        Rows of a rate-limited transport whose slot has not come stay claimed
        (``sending``) until a later call finds their slot passed.
        """
        outbox = self._outbox("deliver()")
        self._no_thread("deliver()", outbox)
        worker = outbox.worker
        if not (worker.hand_ticked and worker.dispatching):
            raise TestKitError(f"{self.label}.deliver(): the app's worker is not the kit's "
                               "(it was replaced behind the control); make a new control")
        # The leases of rows this worker still holds (waiting for a rate slot) are
        # renewed first: the clock may have jumped past them, the heartbeat's beat not.
        outbox.delivery.heartbeat.renew_now()
        reaped = outbox.store.leases.reap_expired()  # what a sweep reaps, at this clock
        if reaped:
            outbox.delivery.report_reaped(reaped)
        return worker.drain(DELIVER_TIMEOUT, wait_for_slots=False)

    def advance(self, seconds: float | timedelta) -> None:
        """Move the outbox's clock ``seconds`` forward (a number or a timedelta).

        ``send_after``, ``expires_after``, retry backoff, leases, sweep ages and
        rate limits all follow it; nothing is delivered until :meth:`deliver`
        (or, inline, the next commit).
        """
        outbox = self._outbox(f"advance({seconds!r})")
        self._no_thread(f"advance({seconds!r})", outbox)
        try:
            self.clock.advance(seconds)
        except (ValueError, TypeError):
            raise TestKitError(
                f"{self.label}.advance({seconds!r}): the outbox's clock only moves forward; "
                "pass a number of seconds >= 0 or a timedelta >= 0") from None

    # -- failures and events -----------------------------------------------------------

    def fail_next(self, count: int = 1, *, to: str | None = None, kind: str = "transient",
                  message: str | None = None) -> None:
        """Make the next ``count`` sends (of emails to ``to``, or any) fail, as a server would.

        ``kind``: ``"transient"`` (451: retried after the backoff, then
        dead-lettered once ``OUTBOX_MAX_ATTEMPTS`` are spent), ``"permanent"``
        (550: ``failed`` at once) or ``"throttle"`` (421 rate reply: deferred,
        the attempt given back). ``message``: the server's text.
        """
        self._outbox("fail_next()")
        try:
            self.failures.add(count, to=to, kind=kind, message=message)
        except ValueError as exc:
            raise TestKitError(f"{self.label}.fail_next(): {exc} (kinds: "
                               f"{_choices(FAILURE_REPLIES)})") from None

    def simulate_event(self, email_id: int, kind: str, *, recipient: str | None = None,
                       description: str | None = None,
                       reason: str | None = None) -> DeliveryEvent:
        """Record a provider's event for sent email ``email_id``, as a verified webhook does.

        ``kind``: ``"delivered"``, ``"bounced"`` (permanent), ``"soft_bounced"``
        (transient), ``"complained"`` or ``"unsubscribed"``; ``recipient``: one
        of its recipients (the first by default); ``reason``: why it failed, one
        of the reasons (:data:`DEFAULT_REASONS` by default: a bounce is
        ``user_unknown``, a soft bounce ``mailbox_full``), for the failure kinds
        only. The suppression policy decides as for a real event: a bounce for
        a dead address, a complaint and an unsubscribe suppress the recipient
        for good, repeated soft bounces for a while (``bounced`` with
        ``reason="spam"`` is a soft one). ``email_event`` is sent. Returns the
        stored event, with the policy's ``verdict`` and ``suppressed_until``.
        """
        method = f"simulate_event({email_id!r}, {kind!r})"
        outbox = self._outbox(method)
        if kind not in EVENT_KINDS:
            raise TestKitError(f"{self.label}.{method}: the kind is one of "
                               f"{_choices(EVENT_KINDS)}")
        if isinstance(email_id, bool) or not isinstance(email_id, int):
            raise TestKitError(f"{self.label}.{method}: email_id is the int id "
                               "mail.send() returned")
        if reason is None:
            reason = DEFAULT_REASONS[kind]
        elif kind in ("delivered", "unsubscribed"):
            raise TestKitError(f"{self.label}.{method}: reason= is for a failure (bounced, "
                               f"soft_bounced, complained), not {kind}")
        elif not isinstance(reason, str) or reason not in REASONS:
            raise TestKitError(f"{self.label}.{method}: reason {reason!r:.80} is not one of "
                               f"{_choices(REASONS)}")
        t = email_table
        with outbox.store.read() as conn:
            row = conn.execute(sa.select(t.c.status, t.c.recipients, t.c.transport)
                               .where(t.c.id == email_id)).first()
        if row is None:
            raise TestKitError(f"{self.label}.{method}: there is no email {email_id} in the "
                               "outbox; pass an id mail.send() returned, once its transaction "
                               "committed")
        if row.status != Status.SENT.value:
            raise TestKitError(f"{self.label}.{method}: email {email_id} is {row.status!r}, "
                               "not sent, and a provider reports only on sent mail; deliver() "
                               "it first")
        recipients = json.loads(row.recipients)
        if recipient is None:
            recipient = recipients[0]
        elif not isinstance(recipient, str) or recipient.lower() not in {
                address.lower() for address in recipients}:
            raise TestKitError(f"{self.label}.{method}: {recipient!r} is not a recipient of "
                               f"email {email_id} ({', '.join(recipients)})")
        event_type, bounce_kind = EVENT_KINDS[kind]
        event = DeliveryEvent(
            event_type, recipient=recipient, occurred_at=self.clock.now(),
            transport=row.transport, provider_event_id=f"simulated-{uuid.uuid4().hex}",
            email_id=email_id, bounce_kind=bounce_kind, reason=reason,
            description=description if description is not None
            else f"simulated by the test kit ({kind})")
        # A verified webhook's path: stored with its suppression in one transaction,
        # then email_event.
        recorded = outbox.events.record([event])
        self._state.tell_events(recorded.new)
        return recorded.new[0]

    # -- the end -----------------------------------------------------------------------

    def close(self) -> None:
        """Put the real clock back and stop what the kit started (idempotent).

        The app's core made on :attr:`clock` is stopped; the next use makes a
        new one on the real clocks, as before the control.
        """
        if self._closed:
            return
        self._closed = True
        state = self._state
        if state.clock is self.clock:
            state.use_clock(None)
        state.serving = self._serving
        self.failures.clear()


def _check_transports(config: OutboxConfig, label: str) -> None:
    """Every transport of the app keeps mail in memory; else :class:`TestKitError`."""
    if config.suppress_send:
        return  # MAIL_SUPPRESS_SEND (TESTING): every name is one memory transport
    real = [(spec.name, spec.kind) for spec in config.transport_specs
            if not issubclass(spec.cls, MemoryTransport)]
    if real:
        name, kind = real[0]
        why = ("the kit reads and scripts the memory transport only" if kind == "mailbox"
               else "tests must not send real email")
        raise TestKitError(
            f"{label}(app): a{' real' if kind != 'mailbox' else ''} transport {kind!r} is "
            f"configured (transport {name!r}), and {why}; set TESTING = True (which sets "
            "MAIL_SUPPRESS_SEND) or OUTBOX_TRANSPORT = 'memory' in the test configuration")
