"""``OutboxTest``: the kit a test uses (the package re-exports it)."""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Self

from flask import Flask

from .._events import DeliveryEvent
from ._assertions import EmailAssertions
from ._control import OutboxControl

if TYPE_CHECKING:
    from ..core import TestClock

class OutboxTest(EmailAssertions):
    """The outbox of one app under test: what was committed, and control over delivery.

    ``mode="inline"`` delivers due mail inside ``commit()``, as ``TESTING``
    does; ``mode="manual"`` delivers nothing until :meth:`deliver`. Reads
    and assertions (:meth:`emails`, :meth:`assert_sent`,
    :meth:`assert_not_sent`, :meth:`assert_enqueued`) see committed rows only.
    Call :meth:`close` at the end (the plugin's fixtures do), or use it as a
    context manager.
    """

    __test__ = False  # a name pytest would otherwise collect

    def __init__(self, app: Flask, mode: str = "inline", *, label: str = "OutboxTest") -> None:
        super().__init__(app)
        # ``label``: what its errors call it (the pytest plugin gives the fixture's name).
        self.control = OutboxControl(app, mode=mode, label=label)

    @property
    def clock(self) -> TestClock:
        """The outbox's clock for this app (see :meth:`advance`)."""
        return self.control.clock

    def deliver(self) -> int:
        """Deliver every email due now, in this thread, as a worker would; how many were tried."""
        return self.control.deliver()

    def advance(self, seconds: float | timedelta) -> None:
        """Move the outbox's clock forward (``send_after``, expiry, retry backoff, leases)."""
        self.control.advance(seconds)

    def fail_next(self, count: int = 1, *, to: str | None = None, kind: str = "transient",
                  message: str | None = None) -> None:
        """Make the next ``count`` sends (to ``to``, or any) fail on the memory transport.

        ``kind``: ``"transient"`` (retried), ``"permanent"`` (dead-lettered) or
        ``"throttle"`` (the server asks to slow down).
        """
        self.control.fail_next(count, to=to, kind=kind, message=message)

    def simulate_event(self, email_id: int, kind: str, *, recipient: str | None = None,
                       description: str | None = None,
                       reason: str | None = None) -> DeliveryEvent:
        """Record a delivery event for a sent email as a verified webhook would.

        ``kind``: ``"delivered"``, ``"bounced"`` (permanent), ``"soft_bounced"``,
        ``"complained"`` or ``"unsubscribed"``; ``reason``: why it failed (a
        bounce is ``user_unknown`` by default, a soft bounce ``mailbox_full``);
        the suppression policy, the list and the ``email_event`` signal behave
        as in production, and the returned event carries the policy's
        ``verdict`` and ``suppressed_until``.
        """
        return self.control.simulate_event(email_id, kind, recipient=recipient,
                                           description=description, reason=reason)

    def close(self) -> None:
        """Put the real clock back and stop what the kit started (idempotent)."""
        self.control.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
