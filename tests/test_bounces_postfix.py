"""Bounces from a real MTA: the suite's private Postfix, and ``flask outbox bounce``.

The app sends through Postfix with VERP envelope senders
(``OUTBOX_BOUNCE_ADDRESS``). Mail to a user that does not exist comes back as
Postfix's own DSN to ``bounces+<token>@outbox.test``; fed to ``flask outbox
bounce`` it records the event and suppresses the address, and the next
``send()`` to it ends ``suppressed``. A delayed delivery's DSN is ``deferred``.
A forged token changes nothing. Every exit status of the command is asserted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from bounces_helpers import feed, mail_of, send, sent
from conftest import close_app, db, make_app, rows
from flask import Flask
from postfix import PrivatePostfix, require_postfix

from flask_mail_outbox.core import event_table, suppression_table

BOUNCES = "bounces@outbox.test"


@pytest.fixture(scope="module")
def mta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePostfix]:
    require_postfix()
    with PrivatePostfix(tmp_path_factory.mktemp("postfix"), users=["alice"]) as server:
        yield server


@pytest.fixture
def app(db_url: str, mta: PrivatePostfix) -> Iterator[Flask]:
    app = make_app(db_url, MAIL_SERVER=mta.host, MAIL_PORT=mta.port,
                   OUTBOX_ALLOW_LOCAL_ADDRESSES=True, OUTBOX_BOUNCE_ADDRESS=BOUNCES,
                   MAIL_DEFAULT_SENDER="App <app@outbox.test>")
    yield app
    close_app(app, timeout=5)


def bounce_of(app: Flask, mta: PrivatePostfix, email_id: int) -> bytes:
    """Postfix's DSN for ``email_id``, from the ``bounces`` mailbox (by its Message-ID,
    unique across the tests sharing the instance; its VERP token is checked too)."""
    row = next(r for r in rows(app) if r["id"] == email_id)
    (raw,) = mta.wait_for("bounces", containing=row["message_id"].strip("<>").encode())
    verp = app.extensions["mail_outbox"].config.verp
    assert verp.sender_for(email_id).encode() in raw
    return raw


def counts(app: Flask) -> tuple[int, int]:
    with app.app_context(), db.engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(event_table)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(
                    suppression_table)).scalar_one())


def test_postfix_dsn_for_an_unknown_user_bounces_and_suppresses(
        app: Flask, mta: PrivatePostfix) -> None:
    email_id = send(app, "nobody@outbox.test")
    row = sent(app, email_id)
    assert row["status"] == "sent"  # Postfix took it, then found no such user
    raw = bounce_of(app, mta, email_id)
    assert b"report-type=delivery-status" in raw
    result = feed(app, raw)
    assert result.exit_code == 0, result.output
    with app.app_context():
        (event,) = mail_of(app).events(email_id)
        entry = mail_of(app).suppression("nobody@outbox.test")
    assert (event.event_type, event.bounce_kind, event.recipient) == (
        "bounced", "permanent", "nobody@outbox.test")
    assert "5.1.1" in event.description + event.mta_response
    assert entry is not None and entry.reason == "bounced"
    # The same bounce fed twice is stored once.
    assert feed(app, raw).exit_code == 0
    assert counts(app) == (1, 1)
    # The next email to that address ends suppressed: Postfix never sees it.
    again = send(app, "nobody@outbox.test", "Again")
    assert sent(app, again)["status"] == "suppressed"


def test_a_delayed_delivery_is_deferred(app: Flask, mta: PrivatePostfix) -> None:
    email_id = send(app, "someone@defer.test")
    assert sent(app, email_id)["status"] == "sent"
    raw = bounce_of(app, mta, email_id)
    assert re.search(rb"Action: delayed", raw)
    assert feed(app, raw).exit_code == 0
    with app.app_context():
        (event,) = mail_of(app).events(email_id)
        assert mail_of(app).suppression("someone@defer.test") is None
    assert (event.event_type, event.recipient) == ("deferred", "someone@defer.test")


def test_a_forged_token_changes_nothing(app: Flask, mta: PrivatePostfix) -> None:
    victim = send(app, "alice@outbox.test", "For alice")
    assert sent(app, victim)["status"] == "sent"
    email_id = send(app, "nobody@outbox.test")
    raw = bounce_of(app, mta, email_id)
    verp = app.extensions["mail_outbox"].config.verp
    real = verp.sender_for(email_id).split("@")[0].encode()
    # Aim the bounce at alice's email with a made-up signature, and at alice.
    forged_token = f"bounces+{victim}-{'a' * 16}".encode()
    forged = raw.replace(real, forged_token).replace(b"nobody@outbox.test",
                                                     b"alice@outbox.test")
    result = feed(app, forged)
    assert result.exit_code == 0, result.output
    with app.app_context():
        assert mail_of(app).events(victim) == []
        assert mail_of(app).suppression("alice@outbox.test") is None
    assert counts(app) == (0, 0)
