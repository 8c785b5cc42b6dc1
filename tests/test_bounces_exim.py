"""Bounces from a real Exim: the app sends through a private Exim, which relays to a
loopback server that refuses; Exim's bounce to the VERP address is fed to ``flask outbox
bounce``.

An unknown user (550 5.1.1) suppresses the address for good; a full mailbox (552 5.2.2)
is recorded with its reason, and the policy (``for_good``) concludes nothing lasting. See tests/bounces_helpers.py for
how Exim runs (unpacked from Debian's packages, in a private mount namespace).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from bounces_helpers import (
    PrivateExim,
    RefusingServer,
    feed,
    mail_of,
    require_exim,
    send,
    sent,
)
from conftest import close_app, db, make_app, rows
from flask import Flask

from flask_mail_outbox._policy import for_good
from flask_mail_outbox.core import event_table, suppression_table


@pytest.fixture(scope="module")
def mta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateExim]:
    require_exim()
    with RefusingServer() as remote, PrivateExim(Path(tmp_path_factory.mktemp("exim")),
                                                 remote.port) as exim:
        yield exim


@pytest.fixture
def app(db_url: str, mta: PrivateExim) -> Iterator[Flask]:
    app = make_app(db_url, MAIL_SERVER=mta.host, MAIL_PORT=mta.port,
                   OUTBOX_ALLOW_LOCAL_ADDRESSES=True, OUTBOX_BOUNCE_ADDRESS="bounces@outbox.test",
                   MAIL_DEFAULT_SENDER="App <app@outbox.test>")
    yield app
    close_app(app, timeout=5)


def bounce_of(app: Flask, mta: PrivateExim, email_id: int) -> bytes:
    """Exim's bounce of ``email_id``: by the Message-ID it returns (unique across the tests
    sharing the instance), mailed to its VERP address."""
    row = next(r for r in rows(app) if r["id"] == email_id)
    raw = mta.wait_for(row["message_id"].strip("<>").encode())
    verp = app.extensions["mail_outbox"].config.verp
    assert b"Envelope-to: " + verp.sender_for(email_id).encode() in raw
    return raw


def suppressions(app: Flask) -> int:
    with app.app_context(), db.engine.connect() as conn:
        count: int = conn.execute(sa.select(sa.func.count()).select_from(
            suppression_table)).scalar_one()
        return count


@pytest.mark.parametrize(("to", "reason", "suppressed"), [
    ("nobody@remote.test", "user_unknown", True),
    ("full@remote.test", "mailbox_full", False),
])
def test_exim_bounce_is_read_and_suppresses_only_a_dead_address(
        app: Flask, mta: PrivateExim, to: str, reason: str, suppressed: bool) -> None:
    email_id = send(app, to)
    assert sent(app, email_id)["status"] == "sent"  # Exim took it, then the relay refused
    raw = bounce_of(app, mta, email_id)
    assert b"X-Failed-Recipients: " + to.encode() in raw
    result = feed(app, raw)
    assert result.exit_code == 0, result.output
    with app.app_context():
        (event,) = mail_of(app).events(email_id)
        entry = mail_of(app).suppression(to)
    assert (event.event_type, event.bounce_kind, event.recipient, event.reason) == (
        "bounced", "permanent", to, reason)
    # What the policy concludes for the address (_policy.for_good), stored on the event
    # and applied by the event log (issue 40 item 2): the dead address is suppressed for
    # good; one soft bounce of a full mailbox suppresses nothing.
    assert (for_good(event.event_type, event.bounce_kind, event.reason) == "bounced") \
        is suppressed
    assert event.verdict == ("permanent" if suppressed else "none")
    if suppressed:
        assert entry is not None and entry.reason == "bounced" and entry.expires_at is None
        assert suppressions(app) == 1
    else:
        assert entry is None and suppressions(app) == 0
    assert [r["id"] for r in rows(app)] == [email_id]
    with app.app_context(), db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(event_table)).scalar_one() == 1
