"""The worker as a dispatcher: its schedule on a fake clock, its SQL cost; the retry policy."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import MakeApps, close_app, db, make_app, rows

from flask_mail_outbox import (
    Message,
    OutboxMail,
    PermanentError,
    TransientError,
)
from flask_mail_outbox.core import Worker
from flask_mail_outbox.core._leases import Reaped
from flask_mail_outbox.core._pacing import IdleBackoff
from flask_mail_outbox.core._releases import Releases
from flask_mail_outbox.core._retry import (
    RetryPolicy,
    human_seconds,
    longest_unfinished,
    schedule,
)

# -- the retry policy (pure) -------------------------------------------------------------

def test_retry_delays_double_then_cap_with_jitter_bounds() -> None:
    low = RetryPolicy(2, 3600, 99, rand=lambda: 0.0)
    mid = RetryPolicy(2, 3600, 99, rand=lambda: 0.5)
    high = RetryPolicy(2, 3600, 99, rand=lambda: 1.0)
    assert [mid.delay(a) for a in range(1, 8)] == [2, 4, 8, 16, 32, 64, 128]
    assert [low.delay(a) for a in (1, 2)] == pytest.approx([1.6, 3.2])
    assert [high.delay(a) for a in (1, 2)] == pytest.approx([2.4, 4.8])
    assert mid.delay(20) == 3600 and mid.delay(10_000) == 3600


def test_retry_decisions() -> None:
    policy = RetryPolicy(2, 3600, 3, rand=lambda: 0.5)
    soft = TransientError("try later", code=451)
    assert policy.decide(1, soft).dead is False and policy.decide(1, soft).delay == 2
    assert policy.decide(2, soft).delay == 4
    assert policy.decide(3, soft).dead is True
    assert policy.decide(1, PermanentError("no", code=550)).dead is True
    throttled = policy.decide(3, TransientError("421 too many", code=421, throttled=True))
    assert throttled.dead is False and throttled.charge is False


def test_throttle_deferrals_are_bounded_then_count_as_transient_failures() -> None:
    policy = RetryPolicy(2, 3600, 3, max_throttle_deferrals=2, rand=lambda: 0.5)
    throttled = TransientError("454 Throttling failure", code=454, throttled=True)
    given_back = [policy.decide(1, throttled, deferrals=n) for n in (0, 1)]
    assert all(d.deferral and d.delay == 5.0 for d in given_back)
    charged = policy.decide(1, throttled, deferrals=2)
    assert not charged.deferral and charged.charge and charged.delay == 2
    assert policy.decide(3, throttled, deferrals=2).dead is True


def test_the_schedule_and_the_bound_are_computed_from_the_settings() -> None:
    steps = schedule(60, 3600, 9)
    assert [(s.attempt, s.delay, s.elapsed) for s in steps] == [
        (1, 60, 60), (2, 120, 180), (3, 240, 420), (4, 480, 900), (5, 960, 1860),
        (6, 1920, 3780), (7, 3600, 7380), (8, 3600, 10980)]
    # Three attempts, base 10 s, pickup 1 s, lease 20 s, 0.5 s per SMTP conversation:
    # picked up (1); attempt 1 to 2: a lost lease (20 + 2 pickups) beats a backoff of
    # 12 + 1; attempt 2 to 3: the backoff 24 + 1 beats it; two deferrals of 5 + 1; the
    # last attempt's lease lost and reaped (20 + 1); five conversations.
    bound = longest_unfinished(base_seconds=10, max_seconds=100, max_attempts=3,
                               max_throttle_deferrals=2, lease_seconds=20, pickup_seconds=1,
                               send_seconds=0.5)
    assert bound == pytest.approx(1 + 22 + 25 + 2 * (5 + 1) + (20 + 1) + 5 * 0.5)
    assert [human_seconds(x) for x in (45, 60, 420, 3780, 86580)] == [
        "45 s", "1 min", "7 min", "1.1 h", "24.1 h"]


# -- the idle backoff (pure) -------------------------------------------------------------

def test_idle_gap_sequence_doubles_to_the_cap_and_snaps_back() -> None:
    backoff = IdleBackoff(0.5, 30)
    gaps = [backoff.after_claim(claimed=0, full=False, failed=False) for _ in range(8)]
    assert gaps == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.after_claim(claimed=3, full=False, failed=False) == 0.5
    assert backoff.after_claim(claimed=0, full=False, failed=False) == 0.5
    assert backoff.after_claim(claimed=0, full=False, failed=False) == 1
    assert backoff.after_claim(claimed=100, full=True, failed=False) == 0
    # A failed tick counts as idle.
    assert [backoff.after_claim(claimed=0, full=False, failed=True) for _ in range(3)] == [
        0.5, 1, 2]
    # While LISTEN is up, the cap is the backstop.
    long = IdleBackoff(0.5, 30)
    assert [long.after_claim(claimed=0, full=False, failed=False, maximum=120)
            for _ in range(10)][-3:] == [64, 120, 120]


# -- the loop on a fake clock ---------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedWorker(Worker):
    """A dispatcher whose claims are scripted: no database, no SMTP.

    Each script entry is what one claim finds: a number of rows, ``"fail"``
    (an outage), or a callable returning the claim's result.
    """

    def __init__(self, clock: Callable[[], float], script: list[Any]) -> None:
        config = make_config()
        delivery = type("Delivery", (), {
            "store": None, "faults": _Faults(), "transports": {"default": None},
            "releases": Releases(None, config),  # type: ignore[arg-type]
            "report_reaped": lambda self, reaped: None})()
        super().__init__(delivery, config, clock=clock)  # type: ignore[arg-type]
        self.pauses = _NoPauses()  # type: ignore[assignment]  # no database: nothing paused
        self.capacity = config.batch_size
        self.dispatching = self.hand_ticked = True
        self.script = script
        self.tick_times: list[float] = []

    def _claim_on_kept_connection(self, limit: int, *, reap: bool,
                                  transport: str = "default") -> tuple[list[Any], Reaped]:
        self.tick_times.append(self.clock())
        action = self.script.pop(0) if self.script else 0
        if action == "fail":
            raise RuntimeError("database is down")
        if callable(action):
            action = action()
        return [object()] * action, Reaped()

    def _put(self, claimed: Any) -> None:
        pass  # nothing is sent: only the schedule of claims is under test


class _NoPauses:
    """The paused transports of a worker without a database: none."""

    def gate(self, name: str) -> Any:
        from flask_mail_outbox.core._pause import Gate
        return Gate.OPEN

    def next_probe_in(self) -> None:
        return None

    def invalidate(self) -> None:
        pass


class _Faults:
    def __init__(self) -> None:
        self.failures = 0
        self.recoveries = 0

    def failing(self, *args: Any, **kwargs: Any) -> bool:
        self.failures += 1
        return self.failures == 1

    def recovered(self, fault: str) -> None:
        self.recoveries += 1


def make_config() -> Any:
    from flask_mail_outbox.core._config import load_config
    return load_config({"OUTBOX_POLL_INTERVAL": 0.5, "OUTBOX_POLL_MAX_INTERVAL": 30,
                        "OUTBOX_BATCH_SIZE": 10}, instance_path="/tmp", testing=False)


def run_steps(worker: ScriptedWorker, clock: FakeClock, steps: int,
              wakes: dict[int, float] | None = None) -> list[float]:
    """Run ``steps`` rounds; each wait advances the fake clock to the next claim,
    or to an earlier wake time from ``wakes`` (round index -> seconds into the wait).
    A wake that came during a round is followed at once, as the real loop does."""
    waits: list[float] = []
    for index in range(steps):
        worker.step()
        if worker._woken:
            continue
        deadline = worker._next_claim
        waits.append(round(deadline - clock.now, 6))
        if wakes and index in wakes and clock.now + wakes[index] < deadline:
            clock.now += wakes[index]
            worker.wake()
        else:
            clock.now = max(clock.now, deadline)
    return waits


def test_fake_clock_idle_gaps_from_tick_start() -> None:
    clock = FakeClock()
    worker = ScriptedWorker(clock, [])
    run_steps(worker, clock, 9)
    starts = worker.tick_times
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    assert gaps == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_fake_clock_gap_is_measured_from_tick_start() -> None:
    clock = FakeClock()

    def slow_empty_claim() -> int:
        clock.now += 0.3  # the claim itself took 0.3 s
        return 0

    worker = ScriptedWorker(clock, [slow_empty_claim, slow_empty_claim, 0])
    waits = run_steps(worker, clock, 3)
    assert waits[:2] == [0.2, 0.7]  # 0.5 and 1.0 from the claim's start
    starts = worker.tick_times
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:])] == [0.5, 1.0]


def test_fake_clock_snap_back_full_batch_and_failed_ticks() -> None:
    clock = FakeClock()
    worker = ScriptedWorker(clock, [0, 0, 0, 3, 0, 10, 10, 2, "fail", "fail", 0])
    run_steps(worker, clock, 11)
    starts = worker.tick_times
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    # idle x3 (0.5, 1, 2), claim 3 -> snap back 0.5, idle 0.5, full -> 0, full -> 0,
    # partial -> 0.5, failed ticks count as idle (0.5, 1).
    assert gaps == [0.5, 1, 2, 0.5, 0.5, 0, 0, 0.5, 0.5, 1]
    assert worker.delivery.faults.failures == 2
    assert worker.last_claim_failed is False


def test_fake_clock_wake_ticks_at_the_same_instant() -> None:
    clock = FakeClock()
    worker = ScriptedWorker(clock, [0, 0, 0, 0, 1])
    # The 4th wait would last 4 s; a wake arrives 0.25 s into it.
    run_steps(worker, clock, 5, wakes={3: 0.25})
    starts = worker.tick_times
    assert round(starts[4] - starts[3], 6) == 0.25


def test_wakes_during_a_claim_collapse_into_one_follow_up() -> None:
    clock = FakeClock()

    def claim_with_wakes() -> int:
        for _ in range(5):
            worker.wake()
        return 0

    worker = ScriptedWorker(clock, [claim_with_wakes, 0, 0])
    waits = run_steps(worker, clock, 3)
    starts = worker.tick_times
    # Exactly one immediate follow-up claim, then the normal idle wait resumes.
    assert round(starts[1] - starts[0], 6) == 0
    assert round(starts[2] - starts[1], 6) == 1.0
    assert len(waits) == 2


def test_real_wait_returns_at_once_on_wake() -> None:
    worker = ScriptedWorker(__import__("time").monotonic, [])
    worker.step()  # the first claim: the next is half a second away
    done = threading.Event()

    def waiter() -> None:
        worker._next_claim = worker.clock() + 60
        worker._wait()
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not done.wait(0.2)
    worker.wake()
    assert done.wait(5)
    thread.join()


# -- SQL cost of idle ticks on a real engine ---------------------------------------------

def count_statements(engine: sa.Engine) -> list[str]:
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement.split()[0].upper())

    sa.event.listen(engine, "before_cursor_execute", before)
    return seen


def test_idle_ticks_cost_a_reap_and_a_claim_each(db_url: str, backend: str) -> None:
    app = make_app(db_url, OUTBOX_DURABLE=True, OUTBOX_TRANSPORT="null")
    try:
        state = app.extensions["mail_outbox"]
        runtime = state.outbox()
        dispatcher = runtime.dispatch(hand_ticked=True)
        seen: list[str] = []

        def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            seen.append(statement)

        sa.event.listen(runtime.engine, "before_cursor_execute", before)
        for _ in range(10):
            dispatcher.tick()
            assert dispatcher.last_claimed == 0
        # Once per process: whether a rate learned earlier paces the lane.
        learned = [statement for statement in seen if "outbox_rate" in statement]
        assert [statement.split()[0].upper() for statement in learned] == ["SELECT"]
        seen = [statement for statement in seen if "outbox_rate" not in statement]
        heads = [statement.split()[0].upper() for statement in seen]
        if backend == "postgresql":
            # One statement per tick, in autocommit (no BEGIN/COMMIT round trips):
            # the reap and the claim are data-modifying CTEs of one WITH. Idle on
            # LISTEN, one lookup more: when the earliest lease runs out (a dead holder
            # sends no NOTIFY), one read of the lease index.
            assert heads == ["WITH", "SELECT"] * 10
            assert all("reaped AS" in s and "FOR UPDATE SKIP LOCKED" in s for s in seen[::2])
            assert all("min(outbox_email.lease_expires_at)" in s for s in seen[1::2])
        else:
            # BEGIN IMMEDIATE, the reap, the claim: nothing else (no settings read).
            assert heads == ["BEGIN", "UPDATE", "UPDATE"] * 10
            assert all("lease_expires_at <" in s for s in seen[1::3])  # exactly 10 reaps
        # Rounds on the dispatcher's own schedule (its backstop), not woken: once a lookup
        # found no lease, an idle database costs the claim alone (a claim elsewhere follows
        # a commit, whose NOTIFY wakes this dispatcher and looks again).
        del seen[:]
        for _ in range(3):
            dispatcher._next_claim = 0.0  # due now, without a wake
            dispatcher.step()
            assert dispatcher.last_claimed == 0
        heads = [statement.split()[0].upper() for statement in seen]
        assert heads == (["WITH"] * 3 if backend == "postgresql"
                         else ["BEGIN", "UPDATE", "UPDATE"] * 3)
    finally:
        close_app(app)


class _Drain:
    """A durable app sending through the null transport in batches of 2.

    Its dispatcher is ticked by hand, on a fake clock (``now[0]``, seconds).
    """

    def __init__(self, db_url: str, **config: Any) -> None:
        self.app = make_app(db_url, **{"OUTBOX_DURABLE": True, "OUTBOX_TRANSPORT": "null",
                                       "OUTBOX_BATCH_SIZE": 2, "OUTBOX_RUN_WORKER": False,
                                       **config})
        self.mail: OutboxMail = self.app.extensions["test_mail"]
        self.runtime = self.app.extensions["mail_outbox"].outbox()
        self.dispatcher = self.runtime.dispatch(hand_ticked=True)
        self.now = [100.0]
        self.dispatcher.clock = lambda: self.now[0]
        self.claim_limits: list[int] = []  # of the claims made since fail_claims()

    def queue(self, *subjects: str, keys: int = 0) -> list[int]:
        """Queue one email per subject; with ``keys``, email i has key ``k{i % keys}``."""
        with self.app.app_context():
            ids = [self.mail.send(Message(s, recipients=["a@example.com"], body="x"),
                                  key=f"k{i % keys}" if keys else None)
                   for i, s in enumerate(subjects)]
            db.session.commit()
        return ids

    def statuses(self) -> list[str]:
        return [str(r["status"]) for r in rows(self.app)]

    def fail_claims(self, failing: Callable[[int], bool]) -> list[bool]:
        """Make claim number n (from 1) raise an outage when ``failing(n)``.

        Returns the list each claim appends to: whether it was asked to reap.
        """
        store = self.dispatcher.store
        real_claim_due = store.leases.claim_due
        reaps: list[bool] = []

        def claim_due(*args: Any, **kwargs: Any) -> Any:
            reaps.append(bool(kwargs.get("reap")))
            self.claim_limits.append(args[0])
            if failing(len(reaps)):
                raise sa.exc.OperationalError("claim", {}, Exception("the database is down"))
            return real_claim_due(*args, **kwargs)

        store.leases.claim_due = claim_due  # type: ignore[method-assign]
        return reaps


@pytest.fixture
def drain(db_url: str) -> Iterator[_Drain]:
    drain = _Drain(db_url)
    yield drain
    close_app(drain.app)


def test_a_draining_dispatcher_reaps_once_a_second_and_at_every_idle_tick(
        drain: _Drain) -> None:
    drain.queue(*(f"m{i}" for i in range(8)))
    engine = drain.runtime.engine
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", before)
    reaps, claimed = [], []
    try:
        for _ in range(7):
            seen.clear()
            drain.dispatcher.tick()
            reaps.append(any("lease_expires_at <" in s for s in seen))
            claimed.append(drain.dispatcher.last_claimed)
            drain.now[0] += 0.3
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)
    # t = 0, 0.3, ... 1.8 s: the first tick reaps; then, while ticks find
    # work, once a second has passed (t = 1.2); then at every idle tick.
    assert claimed == [2, 2, 2, 2, 0, 0, 0]
    assert reaps == [True, False, False, False, True, True, True]


def test_the_claim_after_a_failed_one_reaps(drain: _Drain) -> None:
    drain.queue(*(f"m{i}" for i in range(6)))
    reaps = drain.fail_claims(lambda n: n == 2)
    for _ in range(4):
        drain.dispatcher.tick()
        drain.now[0] += 0.3
    # The first claim reaps; the second, 0.3 s into a drain, does not (and
    # fails); the one after the failure reaps again; the next does not.
    assert reaps == [True, False, True, False]


def test_a_failing_reap_report_loses_no_claimed_row(drain: _Drain) -> None:
    """Nothing claimed is left sending for nobody (here, reporting the reap raises)."""
    ids = drain.queue("m0", "m1")
    delivery = drain.dispatcher.delivery
    real_report = delivery.report_reaped
    calls: list[int] = []

    def report_reaped(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("reporting failed")
        real_report(*args)

    delivery.report_reaped = report_reaped  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="reporting failed"):
        drain.dispatcher.tick()
    drain.dispatcher.tick()  # the rows claimed were sent all the same
    assert [(r["id"], r["status"], r["attempts"]) for r in rows(drain.app)] == [
        (ids[0], "sent", 1), (ids[1], "sent", 1)]


def test_a_foreground_loop_that_ended_no_longer_counts_as_running(drain: _Drain) -> None:
    """So stopping the app afterwards closes the transport and the engine; and, stopped,
    nothing (the scheduler asking for a dispatcher) starts it again."""
    drain.dispatcher.request_stop()
    drain.dispatcher.run()
    assert not drain.dispatcher.running
    drain.dispatcher.start()
    assert not drain.dispatcher.running


def test_an_idle_process_sends_no_sql_for_the_mode(db_url: str) -> None:
    app = make_app(db_url, OUTBOX_TRANSPORT="null")
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("x", recipients=["a@example.com"], body="x"))
            db.session.commit()
            assert mail.wait_idle(10)
        runtime = app.extensions["mail_outbox"].outbox()
        seen = count_statements(runtime.engine)
        import time
        time.sleep(1.0)
        assert seen == []
    finally:
        close_app(app)


def test_a_claim_takes_at_most_the_room_oldest_due_first(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                          OUTBOX_TRANSPORT="null", OUTBOX_BATCH_SIZE=5)
    with app.app_context():
        ids = [mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
               for i in range(12)]
        db.session.commit()
    worker = app.extensions["mail_outbox"].outbox().dispatch(hand_ticked=True)
    assert worker.capacity == 5  # a batch
    claimed: list[list[int]] = []
    for _ in range(3):
        before = {r["id"] for r in rows(app) if r["status"] == "sent"}
        worker.tick()
        claimed.append(sorted({r["id"] for r in rows(app) if r["status"] == "sent"} - before))
    assert claimed == [ids[0:5], ids[5:10], ids[10:12]]


def test_without_psycopg_3_the_listener_reports_once_and_the_dispatcher_polls(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An app on psycopg2 has no psycopg (3): no LISTEN, an ERROR saying so, no crash."""
    import sys

    from flask_mail_outbox import _degrade
    from flask_mail_outbox.core._listen import Listener

    monkeypatch.setitem(sys.modules, "psycopg", None)  # "import psycopg" raises ImportError
    states: list[bool] = []
    listener = Listener("postgresql://nobody@127.0.0.1:1/none", lambda: None, states.append,
                        _degrade.FaultTracker())
    with caplog.at_level(logging.ERROR):
        listener.start()
        assert listener._thread is not None
        listener._thread.join(10)
    assert states == [False]
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "psycopg (3) is not installed" in record.getMessage()
    assert "OUTBOX_LISTEN" in record.getMessage()
