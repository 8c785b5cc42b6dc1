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
