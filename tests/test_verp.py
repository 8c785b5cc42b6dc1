"""VERP envelope senders (``OUTBOX_BOUNCE_ADDRESS``): a signed token naming the row.

Each SMTP delivery's MAIL FROM is ``local+<id>-<signature>@domain``; the header
From does not change, and API transports are unaffected. Only the app's
``SECRET_KEY`` (or a fallback) makes a token that reads back.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import MakeApps, db, wait_rows
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message
from flask_mail_outbox._compose.verp import VerpAddresses

VERP = VerpAddresses("bounces@example.com", ("old-key", "new-key"))


def test_an_address_reads_back_its_row() -> None:
    address = VERP.sender_for(1234)
    local, _, domain = address.partition("@")
    assert domain == "example.com" and local.startswith("bounces+1234-")
    assert len(local) <= 64
    assert VERP.email_id_of(address) == 1234
    assert VERP.email_id_of(f"<{address}>") == 1234
    # Mail software that folds the local part's case does not break it.
    assert VERP.email_id_of(address.upper()) == 1234


def test_a_token_signed_with_a_fallback_key_still_reads() -> None:
    old = VerpAddresses("bounces@example.com", ("old-key",)).sender_for(7)
    assert VERP.email_id_of(old) == 7


@pytest.mark.parametrize("address", [
    "bounces+1234-aaaaaaaaaaaaaaaa@example.com",     # forged signature
    "bounces+1235-{sig}@example.com",                 # another row's signature
    "bounces+1234-{sig}@example.org",                 # another domain
    "other+1234-{sig}@example.com",                   # another local part
    "bounces@example.com",                            # no token
    "bounces+1234@example.com",                       # no signature
    "bounces+x-{sig}@example.com",                    # not an id
    "not an address",
    "",
])
def test_anything_else_reads_as_no_row(address: str) -> None:
    signature = VERP.sender_for(1234).split("-", 1)[1].split("@")[0]
    assert VERP.email_id_of(address.format(sig=signature)) is None
    other_key = VerpAddresses("bounces@example.com", ("someone-elses-key",))
    assert other_key.email_id_of(VERP.sender_for(1234)) is None


def test_smtp_mail_from_is_the_verp_address_and_from_is_unchanged(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    with app.app_context():
        email_id = mail.send(Message("Hi", ["ann@example.com"], "x",
                                     sender="Shop <shop@example.com>"))
        db.session.commit()
    wait_rows(app, lambda rows: rows and rows[0]["status"] == "sent", timeout=10)
    (received,) = smtp_server.messages
    verp = app.extensions["mail_outbox"].config.verp
    assert received.mail_from == verp.sender_for(email_id)
    assert verp.email_id_of(received.mail_from) == email_id
    assert received.parsed["From"] == "Shop <shop@example.com>"


@pytest.mark.parametrize(("config", "problem"), [
    ({"OUTBOX_BOUNCE_ADDRESS": "not-an-address"}, "not an email address"),
    ({"OUTBOX_BOUNCE_ADDRESS": "b+x@example.com"}, "without '+'"),
    ({"OUTBOX_BOUNCE_ADDRESS": "b" * 30 + "@example.com"}, "at most 27"),
    ({"OUTBOX_BOUNCE_ADDRESS": 5}, "expected an address"),
    ({"OUTBOX_BOUNCE_ADDRESS": "bounces@example.com", "SECRET_KEY": None}, "SECRET_KEY"),
])
def test_bad_bounce_address_settings_name_the_key(make_apps: MakeApps,
                                                  config: dict[str, Any],
                                                  problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make_apps(**config)
    assert caught.value.key == "OUTBOX_BOUNCE_ADDRESS" and problem in caught.value.problem
