"""The worker claims ahead of its connections, inline and durable.

It keeps a message waiting for each connection (``Worker.capacity``, twice the
connections), so a connection that finishes starts the next one at once.
Proved by the order of events: the server holds the replies of the messages
on both connections, and the next two are already ``sending`` meanwhile.
Their leases stay alive while they wait (three leases pass), and a stop gives
them back unsent.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from conftest import close_app, db, make_app, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import Message

MODES = ["inline", "durable"]


def _held_app(mode: str, db_url: str, smtp_server: FaultSMTPServer) -> Flask:
    """Four emails committed, two connections; the first two held at the server."""
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=mode == "durable", OUTBOX_BATCH_SIZE=4,
                   OUTBOX_LEASE_SECONDS=1, OUTBOX_POLL_INTERVAL=0.05,
                   OUTBOX_POLL_MAX_INTERVAL=0.2)
    app.extensions["mail_outbox"].concurrency = 2  # as `flask outbox worker --concurrency 2`
    smtp_server.hold()
    with app.app_context():
        for i in range(4):
            app.extensions["test_mail"].send(
                Message(f"n{i}", recipients=["a@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_held(2)
    # The connections wait for the held replies; the next two are claimed meanwhile.
    wait_rows(app, lambda r: [x["status"] for x in r] == ["sending"] * 4, timeout=5.0)
    return app


@pytest.mark.parametrize("mode", MODES)
def test_the_next_messages_are_claimed_while_the_connections_are_busy(
        mode: str, db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = _held_app(mode, db_url, smtp_server)
    try:
        # Three leases later the rows claimed ahead still hold live leases:
        # the heartbeat renews them while they wait their turn.
        time.sleep(3)
        waiting = rows(app)[2:]
        now = datetime.now(UTC).replace(tzinfo=None)  # the rows' naive UTC
        assert [r["status"] for r in waiting] == ["sending", "sending"]
        assert all(r["lease_expires_at"] > now for r in waiting), (waiting, now)
        assert smtp_server.held == 2 and smtp_server.data_attempts == 2
        smtp_server.release()
        assert smtp_server.wait_for(4)
        done = wait_rows(app, lambda r: all(x["status"] == "sent" for x in r), timeout=20.0)
        assert [r["attempts"] for r in done] == [1, 1, 1, 1]
        assert sorted(smtp_server.message_ids()) == sorted(r["message_id"] for r in done)
    finally:
        close_app(app)


@pytest.mark.parametrize("mode", MODES)
def test_rows_claimed_ahead_are_given_back_at_stop(
        mode: str, db_url: str, smtp_server: FaultSMTPServer) -> None:
    app = _held_app(mode, db_url, smtp_server)
    try:
        stopper = threading.Thread(target=app.extensions["test_mail"].stop,
                                   kwargs={"timeout": 20})
        stopper.start()
        # Given back at once, while the two on the connections are still held
        # (which two depends on how the connections took them).
        def statuses(r: list[dict[str, object]]) -> list[tuple[object, object]]:
            return sorted((x["status"], x["attempts"]) for x in r)

        given = wait_rows(app, lambda r: statuses(r) == [
            ("queued", 0), ("queued", 0), ("sending", 1), ("sending", 1)], timeout=10.0)
        assert statuses(given) == [("queued", 0), ("queued", 0), ("sending", 1),
                                   ("sending", 1)], given
        held = {r["message_id"] for r in given if r["status"] == "sending"}
        smtp_server.release()
        stopper.join(30)
        assert not stopper.is_alive()
        done = rows(app)
        assert statuses(done) == [("queued", 0), ("queued", 0), ("sent", 1), ("sent", 1)]
        assert {r["message_id"] for r in done if r["status"] == "sent"} == held
        # Only the two in flight reached the server (a pipelining connection may have
        # sent the next envelope ahead; it got no content, the connection closed).
        assert sorted(smtp_server.message_ids()) == sorted(held)
    finally:
        close_app(app)
