"""The dispatcher's schedule on a fake clock, its SQL cost, and the retry policy."""

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
from flask_mail_outbox._delivery import BatchReport
from flask_mail_outbox._dispatcher import Dispatcher, IdleBackoff, RateLimiter
from flask_mail_outbox._retry import (
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
    gaps = [backoff.after_tick(claimed=0, full=False, failed=False) for _ in range(8)]
    assert gaps == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.after_tick(claimed=3, full=False, failed=False) == 0.5
    assert backoff.after_tick(claimed=0, full=False, failed=False) == 0.5
    assert backoff.after_tick(claimed=0, full=False, failed=False) == 1
    assert backoff.after_tick(claimed=100, full=True, failed=False) == 0
    # A failed tick counts as idle.
    assert [backoff.after_tick(claimed=0, full=False, failed=True) for _ in range(3)] == [
        0.5, 1, 2]
    # While LISTEN is up, the cap is the backstop.
    long = IdleBackoff(0.5, 30)
    assert [long.after_tick(claimed=0, full=False, failed=False, maximum=120)
            for _ in range(10)][-3:] == [64, 120, 120]


# -- the loop on a fake clock ---------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedDispatcher(Dispatcher):
    """A dispatcher whose tick is scripted: no database, no SMTP."""

    def __init__(self, clock: FakeClock, script: list[Any]) -> None:
        config = make_config()
        route = type("Route", (), {"store": None, "faults": _Faults(), "transport": None})()
        super().__init__(route, config, clock=clock)  # type: ignore[arg-type]
        self.script = script
        self.tick_times: list[float] = []

    def tick(self) -> tuple[BatchReport | None, bool]:
        self.tick_times.append(self.clock())
        action = self.script.pop(0) if self.script else 0
        if action == "fail":
            raise RuntimeError("database is down")
        if callable(action):
            return action()
        if action == 0:
            return None, False
        report = BatchReport(sent=list(range(action)))
        return report, action >= self.config.batch_size


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
    from flask_mail_outbox._config import load_config
    return load_config({"OUTBOX_POLL_INTERVAL": 0.5, "OUTBOX_POLL_MAX_INTERVAL": 30,
                        "OUTBOX_BATCH_SIZE": 10}, instance_path="/tmp", testing=False)


def run_steps(dispatcher: ScriptedDispatcher, clock: FakeClock, steps: int,
              wakes: dict[int, float] | None = None) -> list[float]:
    """Run ``steps`` iterations; a wait advances the fake clock to its deadline,
    or to an earlier wake time from ``wakes`` (step index -> seconds into the wait)."""
    waits: list[float] = []
    for index in range(steps):
        def wait(deadline: float, index: int = index) -> None:
            waits.append(round(deadline - clock.now, 6))
            if wakes and index in wakes and clock.now + wakes[index] < deadline:
                clock.now += wakes[index]
                dispatcher.wake()
            else:
                clock.now = deadline
        dispatcher.step(wait=lambda deadline: _wait_or_follow_up(dispatcher, wait, deadline))
    return waits


def _wait_or_follow_up(dispatcher: Dispatcher, wait: Any, deadline: float) -> None:
    # The real _wait_until returns at once when a wake arrived during the tick.
    if dispatcher._wake_pending:
        return
    wait(deadline)


def test_fake_clock_idle_gaps_from_tick_start() -> None:
    clock = FakeClock()
    dispatcher = ScriptedDispatcher(clock, [])
    run_steps(dispatcher, clock, 9)
    starts = dispatcher.tick_times
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    assert gaps == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_fake_clock_gap_is_measured_from_tick_start() -> None:
    clock = FakeClock()

    def slow_empty_tick() -> tuple[None, bool]:
        clock.now += 0.3  # the tick itself took 0.3 s
        return None, False

    dispatcher = ScriptedDispatcher(clock, [slow_empty_tick, slow_empty_tick, 0])
    waits = run_steps(dispatcher, clock, 3)
    assert waits[:2] == [0.2, 0.7]  # 0.5 and 1.0 from tick start
    starts = dispatcher.tick_times
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:])] == [0.5, 1.0]


def test_fake_clock_snap_back_full_batch_and_failed_ticks() -> None:
    clock = FakeClock()
    dispatcher = ScriptedDispatcher(clock, [0, 0, 0, 3, 0, 10, 10, 2, "fail", "fail", 0])
    run_steps(dispatcher, clock, 11)
    starts = dispatcher.tick_times
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    # idle x3 (0.5, 1, 2), claim 3 -> snap back 0.5, idle 0.5, full -> 0, full -> 0,
    # partial -> 0.5, failed ticks count as idle (0.5, 1).
    assert gaps == [0.5, 1, 2, 0.5, 0.5, 0, 0, 0.5, 0.5, 1]
    assert dispatcher.route.faults.failures == 2
    assert dispatcher.last_tick_failed is False


def test_fake_clock_wake_ticks_at_the_same_instant() -> None:
    clock = FakeClock()
    dispatcher = ScriptedDispatcher(clock, [0, 0, 0, 0, 1])
    # The 4th wait would last 4 s; a wake arrives 0.25 s into it.
    run_steps(dispatcher, clock, 5, wakes={3: 0.25})
    starts = dispatcher.tick_times
    assert round(starts[4] - starts[3], 6) == 0.25


def test_wakes_during_a_tick_collapse_into_one_follow_up() -> None:
    clock = FakeClock()

    def tick_with_wakes() -> tuple[None, bool]:
        for _ in range(5):
            dispatcher.wake()
        return None, False

    dispatcher = ScriptedDispatcher(clock, [tick_with_wakes, 0, 0])
    waits: list[float] = []

    def wait(deadline: float) -> None:
        waits.append(deadline - clock.now)
        clock.now = deadline

    for _ in range(3):
        dispatcher.step(wait=lambda d: _wait_or_follow_up(dispatcher, wait, d))
    starts = dispatcher.tick_times
    # Exactly one immediate follow-up tick, then the normal idle wait resumes.
    assert round(starts[1] - starts[0], 6) == 0
    assert round(starts[2] - starts[1], 6) == 1.0
    assert len(waits) == 2


def test_real_wait_returns_at_once_on_wake() -> None:
    dispatcher = ScriptedDispatcher(FakeClock(), [])
    dispatcher.clock = __import__("time").monotonic
    done = threading.Event()

    def waiter() -> None:
        dispatcher._wait_until(dispatcher.clock() + 60)
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not done.wait(0.2)
    dispatcher.wake()
    assert done.wait(5)
    thread.join()


def test_rate_limiter_paces_and_backs_off() -> None:
    clock = FakeClock()
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    limiter = RateLimiter(10, clock=clock, sleep=sleep)
    assert limiter.acquire(100) == 10
    assert limiter.acquire(100) == 10
    assert slept == [1.0]
    limiter.feedback(throttled=True)
    assert limiter.current == 5
    assert limiter.acquire(100) == 5


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
        runtime = state.runtime()
        dispatcher = runtime.ensure_dispatcher(start_thread=False)
        seen: list[str] = []

        def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            seen.append(statement)

        sa.event.listen(runtime.engine, "before_cursor_execute", before)
        for _ in range(10):
            report, _full = dispatcher.tick()
            assert report is None
        heads = [statement.split()[0].upper() for statement in seen]
        if backend == "postgresql":
            # One statement per tick, in autocommit (no BEGIN/COMMIT round trips):
            # the reap and the claim are data-modifying CTEs of one WITH.
            assert heads == ["WITH"] * 10
            assert all("reaped AS" in s and "FOR UPDATE SKIP LOCKED" in s for s in seen)
        else:
            # BEGIN IMMEDIATE, the reap, the claim: nothing else (no settings read).
            assert heads == ["BEGIN", "UPDATE", "UPDATE"] * 10
            assert all("lease_expires_at <" in s for s in seen[1::3])  # exactly 10 reaps
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
        self.runtime = self.app.extensions["mail_outbox"].runtime()
        self.dispatcher = self.runtime.ensure_dispatcher(start_thread=False)
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
        real_claim_due = store.claim_due
        reaps: list[bool] = []

        def claim_due(*args: Any, **kwargs: Any) -> Any:
            reaps.append(bool(kwargs.get("reap")))
            self.claim_limits.append(args[0])
            if failing(len(reaps)):
                raise sa.exc.OperationalError("claim", {}, Exception("the database is down"))
            return real_claim_due(*args, **kwargs)

        store.claim_due = claim_due  # type: ignore[method-assign]
        return reaps


@pytest.fixture
def drain(db_url: str) -> Iterator[_Drain]:
    drain = _Drain(db_url)
    yield drain
    close_app(drain.app)


def test_a_draining_dispatcher_reaps_once_a_second_and_at_every_idle_tick(
        drain: _Drain) -> None:
    drain.queue(*(f"m{i}" for i in range(8)))
    drain.dispatcher.prefetch = False  # one claim per tick, at the tick's time
    engine = drain.runtime.engine
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", before)
    reaps, claimed = [], []
    try:
        for _ in range(7):
            seen.clear()
            drain.dispatcher.step(wait=lambda deadline: None)
            reaps.append(any("lease_expires_at <" in s for s in seen))
            claimed.append(drain.dispatcher.last_claimed)
            drain.now[0] += 0.3
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)
    # t = 0, 0.3, ... 1.8 s: the first tick reaps; then, while ticks find
    # work, once a second has passed (t = 1.2); then at every idle tick.
    assert claimed == [2, 2, 2, 2, 0, 0, 0]
    assert reaps == [True, False, False, False, True, True, True]


def test_a_claim_ahead_that_failed_meanwhile_is_made_again_not_raised(
        drain: _Drain, caplog: pytest.LogCaptureFixture) -> None:
    """A claim ahead fails while its batch's predecessor is sent (the database went away).

    By the next tick the database may be back: that tick claims afresh
    instead of failing on the old error, and nothing is reported at ERROR
    (an outage report would open after the outage had ended).
    """
    drain.queue("m0", "m1", "m2", "m3")
    # Claim 2 is the claim ahead, made while m0 and m1 are sent.
    claims = drain.fail_claims(lambda n: n == 2)
    with caplog.at_level(logging.INFO, logger="flask_mail_outbox"):
        first, _ = drain.dispatcher.tick()
        second, _ = drain.dispatcher.tick()
    assert first is not None and second is not None
    assert len(first.sent) == 2 and len(second.sent) == 2
    assert len(claims) == 4  # tick 2 claimed afresh, and (a full batch) ahead again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("claim made ahead failed" in r.getMessage() for r in caplog.records)


def test_the_claim_after_a_failed_one_reaps(drain: _Drain) -> None:
    drain.queue(*(f"m{i}" for i in range(6)))
    drain.dispatcher.prefetch = False
    reaps = drain.fail_claims(lambda n: n == 2)
    for _ in range(4):
        drain.dispatcher.step(wait=lambda deadline: None)
        drain.now[0] += 0.3
    # The first claim reaps; the second, 0.3 s into a drain, does not (and
    # fails); the one after the failure reaps again; the next does not.
    assert reaps == [True, False, True, False]


def test_a_batch_claimed_ahead_and_given_back_to_a_rate_limit_keeps_the_reap_of_its_reclaim(
        drain: _Drain, caplog: pytest.LogCaptureFixture) -> None:
    drain.queue("m0", "m1", "m2", "m3")
    dispatcher = drain.dispatcher
    dispatcher.tick()  # sends m0, m1 and claims m2, m3 ahead
    assert dispatcher._prefetched is not None
    assert len(dispatcher._prefetched.result()[0]) == 2
    # A row whose sender died: its lease is already over.
    [orphan] = drain.queue("orphan")
    [dead] = drain.runtime.store.claim_due(1, owner="dead", lease_seconds=0)[0]
    assert dead.id == orphan
    # The server throttled meanwhile: the batch claimed ahead is given back
    # and claimed again under the limiter; that claim's reap finds the orphan.
    dispatcher.rate_limiter = RateLimiter(1000.0, clock=lambda: drain.now[0],
                                          sleep=lambda s: None)
    drain.now[0] += 2  # a second after the last reap
    with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
        dispatcher.tick()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"[{orphan}] had an expired lease" in m for m in errors), errors


@pytest.mark.parametrize("rows_of", ["its own claim", "a claim ahead"])
def test_a_tick_that_fails_before_sending_gives_its_claimed_rows_back(
        drain: _Drain, rows_of: str) -> None:
    """Nothing claimed is left sending for nobody (here, reporting the reap raises)."""
    ids = drain.queue(*(f"m{i}" for i in range(2 if rows_of == "its own claim" else 4)))
    if rows_of == "a claim ahead":
        drain.dispatcher.tick()  # sends m0, m1; claims m2, m3 ahead
    route = drain.dispatcher.route
    real_report = route.report_reaped
    calls: list[int] = []

    def report_reaped(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("reporting failed")
        real_report(*args)

    route.report_reaped = report_reaped  # type: ignore[method-assign]
    drain.dispatcher.step(wait=lambda deadline: None)
    assert drain.dispatcher.last_tick_failed
    assert [(r["status"], r["attempts"]) for r in rows(drain.app)][-2:] == [
        ("queued", 0), ("queued", 0)]
    drain.dispatcher.release_held()  # the next claim ahead, if one runs
    report, _ = drain.dispatcher.tick()
    assert report is not None and report.sent == ids[-2:]


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
        runtime = app.extensions["mail_outbox"].runtime()
        seen = count_statements(runtime.engine)
        import time
        time.sleep(1.0)
        assert seen == []
    finally:
        close_app(app)


def test_a_tick_claims_at_most_a_batch_oldest_due_first(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False,
                          OUTBOX_TRANSPORT="null", OUTBOX_BATCH_SIZE=5)
    with app.app_context():
        ids = [mail.send(Message(f"m{i}", recipients=["a@example.com"], body="x"))
               for i in range(12)]
        db.session.commit()
    dispatcher = app.extensions["mail_outbox"].runtime().ensure_dispatcher(start_thread=False)
    first, full = dispatcher.tick()
    assert first is not None and full is True and first.sent == ids[:5]
    second, _ = dispatcher.tick()
    third, full = dispatcher.tick()
    assert second is not None and third is not None
    assert second.sent == ids[5:10] and third.sent == ids[10:] and full is False
