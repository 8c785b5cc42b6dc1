"""A dispatcher holds a fraction of a second of its streams' work, not a whole batch.

The rule on a fake clock, then a real dispatcher against a slow SMTP server:
the rows it holds ``sending`` stay near what its connections deliver in
:data:`HOLD_SECONDS`, where a batch of 100 would be two and a half seconds.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import close_app, db, make_app, rows
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message, OutboxMail
from flask_mail_outbox.core._pacing import HOLD_SECONDS, HOLD_WINDOW_SECONDS, HeldWork


def test_the_rows_held_follow_the_rate_measured_over_each_window() -> None:
    held = HeldWork(batch=100, floor=8)
    assert held.capacity() == 100  # nothing measured yet: a batch
    t = 1000.0
    # 40 results a second, recorded every 0.1 s: the first window ends at 0.5 s.
    for i in range(5):
        held.finished(4, t + 0.1 * i)
    assert held.rate is None and held.capacity() == 100
    held.finished(4, t + 0.5)
    # 24 results over 0.5 s (the first record opens the window and counts).
    assert held.rate == 48.0
    assert held.capacity() == 12  # ceil(48 * 0.25)
    # Faster streams: the next window gives a larger hold, never above a batch...
    for i in range(1, 6):
        held.finished(200, t + 0.5 + 0.1 * i)
    assert held.rate == 2000.0 and held.capacity() == 100
    # ...and slower ones a smaller one, never below the floor.
    now = t + 1.0
    for _ in range(6):
        now += 0.1
        held.finished(1, now)
    assert held.rate == pytest.approx(10.0) and held.capacity() == 8
    # A pause is no measure: the window restarts after it, the last rate stands.
    now += 30.0
    held.finished(3, now)
    assert held.rate == pytest.approx(10.0)
    now += HOLD_WINDOW_SECONDS
    held.finished(27, now)
    assert held.rate == pytest.approx(60.0) and held.capacity() == 15
    assert HOLD_SECONDS == 0.25


def test_a_dispatcher_against_a_slow_server_holds_a_fraction_of_a_batch(
        db_url: str, smtp_server: FaultSMTPServer) -> None:
    smtp_server.delay("data", 0.1)  # four connections: 40 messages a second
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_LISTEN=False, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_CONCURRENCY=4, OUTBOX_BATCH_SIZE=100)
    total = 240  # 6 s at 40 a second
    most_later: list[int] = []
    done = threading.Event()

    def watch() -> None:
        start = time.monotonic()
        while not done.is_set():
            sending = sum(r["status"] == "sending" for r in rows(app))
            # The first claim takes a batch (nothing is measured yet): 2.5 s of work.
            if time.monotonic() - start > 3.5:
                most_later.append(sending)
            time.sleep(0.05)

    try:
        mail: OutboxMail = app.extensions["test_mail"]
        with app.app_context():
            mail.send_many([Message(f"m{i}", recipients=["a@example.com"], body="x")
                            for i in range(total)])
            db.session.commit()
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert smtp_server.wait_for(total, timeout=60)
        finally:
            done.set()
            watcher.join()
        # A batch would be 100 rows (2.5 s of these connections' work); a quarter of a
        # second is 10, and the floor 8 (a message on each connection and one waiting).
        assert most_later and max(most_later) <= 30, most_later
    finally:
        close_app(app, timeout=5)
