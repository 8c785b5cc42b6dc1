"""Health: is mail flowing? ``mail.health()`` and its route (``mail.health_view``).

A check is one SQL statement (:meth:`~flask_mail_outbox.core.Reader.health_figures`) whose
subqueries each read index entries of queued or failed rows only (which index
is the planner's choice: the partial ones, or ``ix_outbox_email_status_id``),
so it costs the same with a million retained ``sent`` rows as with none, and a
load balancer may call it every second; and one read of ``outbox_rate`` (a row
per transport) for the paused transports.

The status is ``degraded`` when, with one reason each:

* ``database_unreachable``: the check's statement failed (nothing else is known);
* ``queue_too_old``: the longest-waiting due email has been due for more than
  ``OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS``. Waiting is counted from the row's
  due time, so an email scheduled with ``send_after`` or waiting for its next
  retry is not late before its time comes;
* ``dead_letters_growing``: the dead-letter count is higher than the lowest
  count this process saw in the last ``DEAD_LETTER_WINDOW_SECONDS``;
* ``dispatcher_tick_failed``: this process's dispatcher's last tick failed;
* ``transport_paused``: a transport is paused by a fault of its own (refused
  credentials, a spent quota, an unverified sender, a server that cannot be
  reached: see docs/guide/modes.md, "A paused transport"), one reason per transport, naming it,
  since when and why; its emails wait (``paused_transports`` lists them).

The route answers 503 only for :data:`INSTANCE_REASONS` unless it is strict.
``queue_too_old`` and ``dead_letters_growing`` describe the shared database:
every instance would report them at once (one 550 for a mistyped address is
enough), and a load balancer that drains every instance takes the site down
while fixing nothing; ``transport_paused`` too (the pause is shared by every
process, and no instance's requests fail for it). ``dispatcher_tick_failed`` is left out as well: the
dispatcher runs beside the requests, not in them, so taking this instance out
of rotation does not restart it or help its requests, and a single failed tick
(a deadlock, a restart of the database) would flap the instance in and out. A
database this process cannot reach is different: its requests fail too.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from flask import Response, jsonify

from .._flask.state import AppState
from ..core._internal import PauseStore, utcnow

#: How far back ``dead_letters_growing`` looks for a lower dead-letter count.
DEAD_LETTER_WINDOW_SECONDS = 900.0
#: The reasons that make the (default, non-strict) route answer 503: states of
#: this instance that a load balancer can act on by routing around it.
INSTANCE_REASONS = frozenset({"database_unreachable"})


class DeadLetterTrend:
    """Whether the dead-letter count rose within a window, from the counts seen.

    Only changes are kept (a repeated count refreshes its time), so memory is
    bounded by how often the count changed within the window, not by how
    often health is checked.
    """

    def __init__(self, window: float = DEAD_LETTER_WINDOW_SECONDS, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._seen: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def observe(self, count: int) -> int:
        """Record ``count``; how many it is above the lowest count within the window."""
        now = self.clock()
        with self._lock:
            seen = self._seen
            while seen and seen[0][0] < now - self.window:
                seen.popleft()
            lowest = min((c for _, c in seen), default=count)
            if seen and seen[-1][1] == count:
                seen.pop()
            seen.append((now, count))
        return max(0, count - lowest)


_trends: weakref.WeakKeyDictionary[AppState, DeadLetterTrend] = weakref.WeakKeyDictionary()
_trends_lock = threading.Lock()


def _trend(state: AppState) -> DeadLetterTrend:
    with _trends_lock:
        trend = _trends.get(state)
        if trend is None:
            trend = _trends[state] = DeadLetterTrend()
        return trend


def check(state: AppState) -> dict[str, Any]:
    """The health of ``state``'s app as seen from this process (never raises for the database)."""
    config = state.config
    outbox = state.outbox()
    reasons: list[dict[str, str]] = []
    due_age: float | None = None
    dead_letters: int | None = None
    added: int | None = None
    paused: list[dict[str, Any]] = []
    try:
        row = outbox.reader.health_figures()
        pauses = PauseStore(outbox.store).all()
    except Exception as exc:  # noqa: BLE001 - reported; the answer says so
        state.faults.failing(
            "health-database", "The health check could not query the outbox tables",
            consequence="health() and the health route answer degraded "
                        "(database_unreachable) until the database answers",
            fix="check the database connection and that the outbox tables exist "
                "(`flask db upgrade outbox@head`)",
            exc=exc)
        reasons.append({"code": "database_unreachable",
                        "message": f"the outbox tables could not be read "
                                   f"({type(exc).__name__}; details in the log)"})
    else:
        state.faults.recovered("health-database")
        if row.earliest_due is not None:
            due_age = max(0.0, float((row.now - row.earliest_due).total_seconds()))
        dead_letters = row.dead_letters
        limit = config.health_max_queued_age_seconds
        if due_age is not None and due_age > limit:
            reasons.append({"code": "queue_too_old",
                            "message": f"an email has been due for {due_age:.0f} s, more than "
                                       f"OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS ({limit:g} s)"})
        for pause in sorted(pauses.values(), key=lambda p: p.transport):
            paused.append(pause.as_dict())
            reasons.append({"code": "transport_paused",
                            "message": f"transport {pause.transport!r} is paused since "
                                       f"{pause.since:%Y-%m-%d %H:%M:%S} UTC ({pause.kind}: "
                                       f"{pause.error}); its emails wait, probed next at "
                                       f"{pause.probe_at:%H:%M:%S} UTC"})
        added = _trend(state).observe(dead_letters)
        if added:
            reasons.append({"code": "dead_letters_growing",
                            "message": f"{added} more dead letter(s) than this process "
                                       f"saw in the last {DEAD_LETTER_WINDOW_SECONDS:g} s"})
    dispatcher = outbox.dispatcher
    if dispatcher is not None and dispatcher.last_claim_failed:
        reasons.append({"code": "dispatcher_tick_failed",
                        "message": "this process's dispatcher's last tick failed "
                                   "(details in the log)"})
    return {
        "status": "degraded" if reasons else "ok",
        "reasons": reasons,
        "oldest_due_age_seconds": due_age,
        "dead_letters": dead_letters,
        "dead_letters_added": added,
        "paused_transports": paused,
        "dispatcher": None if dispatcher is None else {
            "running": dispatcher.running, "last_tick_failed": dispatcher.last_claim_failed,
        },
        "checked_at": utcnow().isoformat(timespec="seconds") + "Z",
    }


def response(result: dict[str, Any], *, strict: bool = False) -> Response:
    """The route's answer: the check as JSON (every reason), never cached.

    503 when a reason in :data:`INSTANCE_REASONS` is present, or with
    ``strict`` when there is any reason at all; 200 otherwise.
    """
    codes = {reason["code"] for reason in result["reasons"]}
    failing = bool(codes) if strict else bool(codes & INSTANCE_REASONS)
    resp = jsonify(result)
    resp.status_code = 503 if failing else 200
    resp.headers["Cache-Control"] = "no-store"
    return resp
