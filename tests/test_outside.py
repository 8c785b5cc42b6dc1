"""``_outside``: text from outside made safe to store, once, at the boundary.

Property tests with hypothesis: the functions never raise on anything, what
they return is storable by PostgreSQL and SQLite (no NUL, no lone surrogate,
valid UTF-8) and within its length, their time is linear in their input, and
``clean_address`` gives an address or None, never HTML, a NUL or a space.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_mail_outbox._outside import (
    REPLACEMENT,
    TEXT_LIMIT,
    clean_address,
    clean_line,
    clean_text,
    redact,
)

FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# Every code point, lone surrogates and controls included (hypothesis leaves
# surrogates out by default: they are what broke Postmark's route).
ANY_CHAR = st.characters(codec=None, categories=None)
ANY_TEXT = st.text(ANY_CHAR, max_size=3000)
HOSTILE = st.sampled_from(["\x00", "\ud800", "\udfff", "\x1b[31m", "\r\n", "\x85", "\u2028",
                           "<script>", "\x7f", "\ufeff", "\u202e", "é", "\U0001f600"])
HOSTILE_TEXT = st.lists(st.one_of(HOSTILE, st.text(ANY_CHAR, max_size=20)),
                        max_size=200).map("".join)
ANY_VALUE = st.one_of(ANY_TEXT, HOSTILE_TEXT, st.binary(max_size=2000), st.none(),
                      st.integers(), st.floats(), st.booleans(),
                      st.lists(st.integers(), max_size=5), st.just(10 ** 5000))

UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> bool:
    """What PostgreSQL (no NUL, valid UTF-8) and SQLite take as text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


@FAST
@given(ANY_VALUE, st.integers(min_value=0, max_value=5000))
def test_clean_text_never_raises_and_is_storable_and_bounded(value: Any, limit: int) -> None:
    text = clean_text(value, limit)
    assert isinstance(text, str) and storable(text)
    assert len(text) <= limit
    assert not re.search("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", text)


@FAST
@given(ANY_VALUE, st.integers(min_value=0, max_value=1000))
def test_clean_line_is_one_storable_line(value: Any, limit: int) -> None:
    line = clean_line(value, limit)
    assert storable(line) and len(line) <= limit
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", line)
    assert line == line.strip()


@FAST
@given(HOSTILE_TEXT)
def test_clean_text_keeps_what_is_safe(text: str) -> None:
    cleaned = clean_text(text, 10 ** 6)
    assert len(cleaned) == len(text)
    for before, after in zip(text, cleaned, strict=True):
        assert after == before or after == REPLACEMENT


def test_the_defaults_and_the_cut() -> None:
    assert clean_text("x" * 5000) == "x" * (TEXT_LIMIT - 1) + "…"
    assert clean_text("550 no such\x00user") == f"550 no such{REPLACEMENT}user"
    assert clean_text(b"\xff\xfeok") == f"{REPLACEMENT}{REPLACEMENT}ok"
    assert clean_text(None) == "" and clean_text(10 ** 5000).startswith("<int")
    assert clean_text("abc", 0) == "" and clean_text("abcdef", 1) == "a"
    assert clean_line(" a\r\nb\tc\u2028d ") == "a b c d"


@FAST
@given(st.one_of(ANY_TEXT, HOSTILE_TEXT, st.none(), st.integers(), st.binary(max_size=50)))
def test_clean_address_is_an_address_or_none(value: Any) -> None:
    address = clean_address(value)
    if address is None:
        return
    assert storable(address) and len(address) <= 320
    assert address.count("@") == 1
    assert not re.search(r"[\s<>\"\x00-\x1f\x7f-\x9f]", address)
    local, _, domain = address.partition("@")
    assert local and domain == domain.lower() and "." in domain or domain == "localhost"


@pytest.mark.parametrize("value", [
    "<script>alert(1)</script>@example.com", "a@example.com<script>", "<b>x</b>@example.com",
    "a\x00@example.com", "a@exa\x00mple.com", "a b@example.com", "a@example .com",
    "a\tb@example.com", "\ud800@example.com", "a@\udfffexample.com", "a\u200b@example.com",
    "a\u202e@example.com", "a\x85@example.com", '"a"@example.com', "a@b@example.com",
    "example.com", "@example.com", "a@", "a@nodot", "a@example..com", "a@.example.com",
    "x" * 65 + "@example.com", "a@" + "b" * 300 + ".com", "", "<>", 42, None,
    b"a@example.com", "a@example.com\r\nBcc: x@y.com",
])
def test_clean_address_refuses(value: Any) -> None:
    assert clean_address(value) is None


@pytest.mark.parametrize(("value", "address"), [
    ("User@Example.COM", "User@example.com"),
    (" <a.b+tag@example.org> ", "a.b+tag@example.org"),
    ("o'brien@example.ie", "o'brien@example.ie"),
    ("é@bücher.de", "é@bücher.de"),
    ("root@localhost", "root@localhost"),
    ("a@example.com.", "a@example.com"),
    ("a@example.com\n", "a@example.com"),  # white space around it is not part of it
])
def test_clean_address_accepts(value: str, address: str) -> None:
    assert clean_address(value) == address


def test_redact_removes_each_credential() -> None:
    assert redact("key=SG.abcdef reply", ["SG.abcdef", None, "", "ab"]) == \
        "key=[redacted] reply"


def _seconds(function: Any, value: Any) -> float:
    start = time.perf_counter()
    function(value)
    return time.perf_counter() - start


@pytest.mark.parametrize("function", [clean_text, clean_line, clean_address],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [
    "\x00", "\ud800", "a", "\r\n", "@", "<", "a@", " ", "\u2028",
], ids=repr)
def test_linear_time_on_adversarial_shapes(function: Any, shape: str) -> None:
    """A megabyte of the worst characters: four times the input costs well under the
    sixteen times a quadratic function would, and under half a second."""
    small = shape * (250_000 // len(shape))
    large = small * 4
    _seconds(function, small)  # warm up
    small_time = min(_seconds(function, small) for _ in range(3))
    large_time = min(_seconds(function, large) for _ in range(3))
    assert large_time < max(10 * small_time, 0.05), (small_time, large_time)
    assert large_time < 0.5


def test_a_degradation_quoting_outside_text_is_logged_safe(
        caplog: pytest.LogCaptureFixture) -> None:
    """A custom transport's own error text reaches the ERROR line uncleaned by any boundary:
    ``_degrade.report`` makes it safe to write (a lone surrogate breaks a UTF-8 handler)."""
    from flask_mail_outbox import _degrade

    with caplog.at_level(logging.ERROR, logger="flask_mail_outbox"):
        _degrade.report("Email 7 dead-lettered: 554 rejected\x00 for policy \udcff",
                        consequence="it is not sent", fix="look")
    [line] = [r.getMessage() for r in caplog.records]
    assert "554 rejected\ufffd for policy \ufffd" in line
    line.encode("utf-8")  # no lone surrogate left
