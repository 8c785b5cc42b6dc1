"""What the detail page shows of a stored MIME message: headers, text and html bodies.

The html body is returned as text only. The template puts it in the ``srcdoc``
attribute of a sandboxed iframe (escaped as any attribute value), never into the
page itself.
"""

from __future__ import annotations

import dataclasses
import email.policy
from email.message import EmailMessage
from email.parser import BytesParser

# Enough to recognise an email; the whole message is a download away (the CLI).
MAX_TEXT_CHARS = 200_000
MAX_HTML_CHARS = 500_000
#: The most characters of one header's stored (encoded, folded) text decoded for the page.
#: The stdlib's header parser slices the rest of a header for each encoded word it reads:
#: quadratic (a 1 MB subject took 37 s a view). A subject is a line; the row keeps it whole.
MAX_HEADER_CHARS = 8_000


@dataclasses.dataclass(frozen=True)
class Preview:
    """Headers in order, and the bodies (None when the message has no such part)."""

    headers: list[tuple[str, str]]
    text: str | None
    html: str | None
    truncated: bool
    problem: str | None = None


def preview(mime: bytes) -> Preview:
    """Parse ``mime`` for display; a message that does not parse says why instead."""
    try:
        message = BytesParser(policy=email.policy.default).parsebytes(mime)
        if not isinstance(message, EmailMessage):  # the default policy makes EmailMessage
            raise TypeError(type(message).__name__)
        headers = [_header(name, raw) for name, raw in message.raw_items()]
        text = _body(message, "plain")
        html = _body(message, "html")
    except Exception as exc:  # noqa: BLE001 - shown on the page; the row is untouched
        return Preview([], None, None, False, problem=f"{type(exc).__name__}: {exc}")
    truncated = (text is not None and len(text) > MAX_TEXT_CHARS) or \
        (html is not None and len(html) > MAX_HTML_CHARS)
    return Preview(headers,
                   None if text is None else text[:MAX_TEXT_CHARS],
                   None if html is None else html[:MAX_HTML_CHARS],
                   truncated)


def _header(name: str, raw: str) -> tuple[str, str]:
    """A header for display: decoded, its first :data:`MAX_HEADER_CHARS` characters only."""
    policy = email.policy.default
    if len(raw) <= MAX_HEADER_CHARS:
        return name, str(policy.header_fetch_parse(name, raw))
    cut = raw[:MAX_HEADER_CHARS]
    fold = cut.rfind("\n")  # at a fold, so that no encoded word is cut in two
    if fold > 0:
        cut = cut[:fold]
    shown = str(policy.header_fetch_parse(name, cut))
    return name, f"{shown} … (cut here: {len(raw) - len(cut):,} more characters stored)"


def _body(message: EmailMessage, subtype: str) -> str | None:
    part = message.get_body(preferencelist=(subtype,))
    if part is None or part.get_content_subtype() != subtype:
        return None
    content = part.get_content()
    return content if isinstance(content, str) else None
