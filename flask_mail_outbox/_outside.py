"""Text from outside made safe to store, once, at the boundary.

Everything the library did not write itself (an SMTP server's reply, a
provider's response body, a webhook's fields, a bounce's fields) passes
through these functions before it reaches a row, a log line or a page:

* :func:`clean_text`: any value to a ``str`` that every database stores and
  every terminal shows as it is: control characters (NUL first: PostgreSQL
  refuses it in text) and lone surrogates become U+FFFD, the length is capped.
* :func:`clean_line`: the same for one-line values (ids, names): line breaks
  and tabs become spaces too.
* :func:`clean_address`: an address from outside, or None when it is not one.
* :func:`redact`: the library's own credentials removed from reply text.

Each runs in time linear in its input and never raises on what it is given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["REPLACEMENT", "TEXT_LIMIT", "clean_address", "clean_line", "clean_text", "redact"]

#: What a character that cannot be stored or shown becomes.
REPLACEMENT = "\ufffd"

#: Longest text kept from outside (characters), unless a caller says otherwise.
TEXT_LIMIT = 2000

#: The mark at the end of text that was cut.
_CUT = "…"

# C0 controls but TAB, LF and CR; DEL; C1 controls; lone surrogates.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
# The same, with TAB, LF and CR as well (one-line values).
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# What an address never holds: white space, the specials (angle brackets,
# quotes, ...), control characters (C0, DEL, C1), lone surrogates (unstorable),
# and the invisible format characters that make one address look like another.
_NOT_IN_ADDRESS = ("\\s<>()\\[\\]\\\\,;:\"@\x00-\x1f\x7f-\x9f\ud800-\udfff"
                   "\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff")
# One addr-spec as mail systems write it, bounded: local@domain. Neither class
# holds "@", so matching is linear.
_ADDRESS = re.compile(f"[^{_NOT_IN_ADDRESS}]{{1,64}}@[^{_NOT_IN_ADDRESS}]{{1,255}}")


def _as_str(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if value is None:
        return ""
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - an int over Python's 4,300 digits, a broken __str__
        return f"<{type(value).__name__} that cannot be shown>"


def _capped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    if limit <= len(_CUT):
        return text[:max(limit, 0)]
    return text[:limit - len(_CUT)] + _CUT


def clean_text(value: object, limit: int = TEXT_LIMIT) -> str:
    """``value`` as storable, printable text of at most ``limit`` characters.

    Bytes are decoded as UTF-8 (undecodable bytes become U+FFFD), None is
    ``""``, anything else is ``str(value)``. Control characters other than
    TAB, LF and CR, and lone surrogates, become U+FFFD; text over ``limit``
    is cut and ends with ``…``.
    """
    text = _as_str(value)
    # Cut first (with room for the replacement), so a huge value costs its cut.
    text = _capped(text, limit)
    return _UNSAFE.sub(REPLACEMENT, text)


def clean_line(value: object, limit: int = 255) -> str:
    """:func:`clean_text` for a one-line value: TAB, CR and LF become spaces too,
    and white space at either end is removed."""
    text = _as_str(value)
    if len(text) > max(limit, 0) * 2:
        text = text[:max(limit, 0) * 2]
    text = text.replace("\r\n", " ").translate(_LINE_BREAKS).strip()
    return _UNSAFE_LINE.sub(REPLACEMENT, _capped(text, limit))


_LINE_BREAKS = str.maketrans({"\t": " ", "\r": " ", "\n": " ", "\u2028": " ", "\u2029": " "})


def clean_address(value: object) -> str | None:
    """The address ``value`` holds (``user@example.com``, at most 320 characters),
    lower-cased in its domain, or None when it is not one.

    For addresses named by outside parties (a webhook's recipient, a bounce's
    ``Final-Recipient``): HTML, spaces, control characters, angle brackets or
    a missing ``@`` make it None, so such text never becomes a suppression key.
    Surrounding ``<>`` and white space are accepted and removed.
    """
    if not isinstance(value, str) or len(value) > 330:
        return None
    text = value.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    if len(text) > 320 or _ADDRESS.fullmatch(text) is None:
        return None
    local, _, domain = text.rpartition("@")
    domain = domain.rstrip(".").lower()
    if not domain or ("." not in domain and domain != "localhost") or ".." in domain \
            or domain.startswith((".", "-")):
        return None
    return f"{local}@{domain}"


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with each of ``secrets`` (a password, an API key: at least 4
    characters; shorter or empty ones are skipped) replaced by ``[redacted]``."""
    for secret in secrets:
        if secret and len(secret) >= 4 and secret in text:
            text = text.replace(secret, "[redacted]")
    return text
