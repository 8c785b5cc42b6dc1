"""Bugs found reviewing what landed for issues 40 and 41 (each test fails without its fix)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from flask_mail_outbox import ConfigError
from flask_mail_outbox._compose.links import UnsubscribeLinks
from flask_mail_outbox.core._config import load_config

BASE = "https://app.example.com/outbox/unsubscribe"


def _config(**keys: Any) -> Any:
    return load_config({"SECRET_KEY": "the current key", **keys},
                       instance_path=tempfile.gettempdir(), testing=True)


@pytest.mark.parametrize("setting", ["OUTBOX_UNSUBSCRIBE_URL", "OUTBOX_BOUNCE_ADDRESS"])
@pytest.mark.parametrize(("fallbacks", "said"), [
    ("old key", "got a str"),           # read letter by letter: each letter a key
    (b"old key", "got a bytes"),
    (["old key", ""], "item 1 must be a non-empty string"),  # an empty key is a known one
    ([None], "item 0 must be a non-empty string"),
])
def test_secret_key_fallbacks_that_would_make_tokens_forgeable_are_refused(
        setting: str, fallbacks: Any, said: str) -> None:
    value = BASE if setting == "OUTBOX_UNSUBSCRIBE_URL" else "bounces@example.com"
    with pytest.raises(ConfigError, match="SECRET_KEY_FALLBACKS") as raised:
        _config(**{setting: value, "SECRET_KEY_FALLBACKS": fallbacks})
    assert said in str(raised.value)


def test_a_string_of_fallbacks_let_a_one_letter_key_forge_an_unsubscribe_link() -> None:
    """What the refusal prevents: with SECRET_KEY_FALLBACKS="old key" every letter was a key,
    so a link sealed with the key "o" (found in at most 256 tries) named any address."""
    forged = UnsubscribeLinks(BASE, ("o",)).url_for("victim@example.com").rsplit("/", 1)[1]
    assert UnsubscribeLinks(BASE, (*"old key", "current")).named_by(forged) is not None
    with pytest.raises(ConfigError):
        _config(OUTBOX_UNSUBSCRIBE_URL=BASE, SECRET_KEY_FALLBACKS="old key")


def test_a_list_of_fallbacks_still_opens_links_of_the_old_key() -> None:
    config = _config(OUTBOX_UNSUBSCRIBE_URL=BASE, SECRET_KEY_FALLBACKS=["old key"],
                     OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    old = UnsubscribeLinks(BASE, ("old key",)).url_for("a@example.com").rsplit("/", 1)[1]
    assert config.unsubscribe_links.named_by(old) == ("a@example.com", None)
    assert config.unsubscribe_links.secret_keys == ("old key", "the current key")


def test_a_rate_paced_dispatcher_does_not_spin_on_a_lease_it_cannot_reap(
        pg_database: str | None) -> None:
    """Issue 41 item 2's lease wake, when no lane has room (a slow rate holds a paced row):
    a dead worker's lease that already ran out woke the dispatcher every 0.05 s for the
    lookup, while no claim (so no reap) could run before the lane opened (up to an hour
    here). The row is reaped by the claim that the lane's opening schedules, as before."""
    import time

    import sqlalchemy as sa
    from conftest import close_app, db, empty_postgres, make_app, require_postgres, rows

    from flask_mail_outbox import Message

    require_postgres()
    assert pg_database is not None
    app = make_app(empty_postgres(pg_database), OUTBOX_DURABLE=True, OUTBOX_TRANSPORT="null",
                   OUTBOX_RATE_LIMIT=1 / 3600, OUTBOX_RUN_WORKER=False)
    try:
        runtime = app.extensions["mail_outbox"].outbox()
        dispatcher = runtime.dispatch(hand_ticked=True)
        with app.app_context():
            for subject in ("sent at once", "paced an hour", "held by a dead worker"):
                app.extensions["test_mail"].send(
                    Message(subject, recipients=["a@example.com"], body="x"))
            db.session.commit()
        for _ in range(3):  # one row a claim (the rate's block): sent, then paced
            dispatcher._woken = True
            dispatcher.step()
            time.sleep(0.2)
        assert dispatcher.listening
        assert sorted(str(r["status"]) for r in rows(app)) == ["queued", "sending", "sent"]
        with app.app_context(), db.engine.begin() as conn:  # a worker died holding it
            conn.execute(sa.text(
                "UPDATE outbox_email SET status = 'sending', lease_owner = 'dead', "
                "lease_expires_at = now() AT TIME ZONE 'utc' - interval '5 seconds' "
                "WHERE status = 'queued'"))
        seen: list[str] = []
        sa.event.listen(runtime.engine, "before_cursor_execute",
                        lambda conn, cursor, statement, *args: seen.append(statement))
        dispatcher._woken = True  # a NOTIFY: the lookup runs once
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            dispatcher.step()
            time.sleep(0.01)
        lookups = [s for s in seen if "min(outbox_email.lease_expires_at)" in s]
        assert len(lookups) <= 1, len(lookups)  # 15 or more without the fix
    finally:
        close_app(app)


def test_suppression_list_counts_further_prefix_matches_without_reading_them(
        make_apps: Any) -> None:
    """Issue 41 item 9's count read every further match of the prefix (each a row, into
    memory) to count them: all but a few of a large list for ``--prefix a``."""
    import sqlalchemy as sa

    app, mail = make_apps()
    with app.app_context():
        for number in range(12):
            mail.suppress(f"a{number:02}@example.com")
        mail.suppress("b@example.com")
    engine = app.extensions["mail_outbox"].outbox().engine
    seen: list[str] = []
    sa.event.listen(engine, "before_cursor_execute",
                    lambda conn, cursor, statement, *args: seen.append(statement))
    listed = app.test_cli_runner().invoke(
        args=["outbox", "suppression", "list", "--prefix", "a", "--limit", "2"])
    assert listed.exit_code == 0, listed.output
    assert "... 10 more starting with 'a'" in listed.output, listed.output
    reads = [s for s in seen if "outbox_suppression" in s and s.lstrip().upper().startswith(
        "SELECT")]
    # The page (LIMIT 2) and one count: no unbounded read of the rows.
    assert all("LIMIT" in s.upper() or "count(" in s.lower() for s in reads), reads
