"""The test kit's assertions: filters over committed emails, and failures that say what there is.

A failed assertion raises :class:`AssertionError` whose text says what was
asked, then lists the app's emails in one compact table (id, status, to,
subject, template), at most :data:`TABLE_ROWS` of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from flask import Flask

from .._flask.state import EXTENSION_KEY, AppState
from .._outside import clean_line
from ..core import Status
from ._control import TestKitError
from ._emails import STATUSES, TestEmail, read_emails

#: How many emails a failed assertion lists before "... and N more".
TABLE_ROWS = 20

#: What ``assert_enqueued`` counts as queued and not delivered yet.
ENQUEUED = (Status.QUEUED.value,)


@dataclass(frozen=True)
class Filters:
    """What an assertion looks for; None: any. Every given filter must hold.

    ``subject``: equal. ``to``: one of the envelope recipients (to, cc or bcc), the
    address compared without regard to case. ``html_contains`` /
    ``text_contains``: a substring of the HTML / text body. ``template`` /
    ``locale``: what ``mail.send_template()`` rendered.
    """

    subject: str | None = None
    to: str | None = None
    html_contains: str | None = None
    text_contains: str | None = None
    template: str | None = None
    locale: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{f.name} must be a str or None, got {type(value).__name__}")

    def match(self, email: TestEmail) -> bool:
        """Whether ``email`` passes every filter."""
        if self.subject is not None and email.subject != self.subject:
            return False
        if self.to is not None:
            wanted = self.to.strip().lower()
            if all(address.lower() != wanted for address in email.recipients):
                return False
        if self.html_contains is not None and self.html_contains not in (email.html or ""):
            return False
        if self.text_contains is not None and self.text_contains not in (email.text or ""):
            return False
        if self.template is not None and email.template != self.template:
            return False
        return self.locale is None or email.locale == self.locale

    def describe(self) -> str:
        """The filters as they were passed: ``subject='Welcome', to='ann@example.com'``."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if getattr(self, f.name) is not None)


def check_count(count: object) -> int | None:
    """``count`` if it is None or an int >= 0; otherwise a TypeError/ValueError naming it."""
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int or None, got {type(count).__name__}")
    if count < 0:
        raise ValueError(f"count must be 0 or more, got {count}")
    return count


def check_status(status: object) -> str | None:
    """``status`` if it is None or one of the outbox's statuses; a ValueError naming it otherwise."""
    if status is None:
        return None
    text = str(status) if isinstance(status, Status) else status
    if not isinstance(text, str) or text not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)} or None, got {status!r}")
    return text


def state_of(app: Flask) -> AppState:
    """The outbox state of ``app``; a TestKitError saying what to do when it has none."""
    state = app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, AppState):
        raise TestKitError(f"flask-mail-outbox is not registered on the app {app.name!r}: "
                           "call OutboxMail(app) or mail.init_app(app) in the app your `app` "
                           "fixture returns")
    return state


class EmailAssertions:
    """Reads and assertions over the committed emails of one app (its own database only)."""

    def __init__(self, app: Flask) -> None:
        if not isinstance(app, Flask):
            raise TypeError(f"the test kit needs a Flask app, got {type(app).__name__}")
        self._state = state_of(app)

    def emails(self, status: str | None = None) -> list[TestEmail]:
        """Every committed email of the app, oldest first; ``status``: only those.

        Read on a connection of its own: mail whose transaction or savepoint
        rolled back is not there, nor mail not committed yet.
        """
        return read_emails(self._state.outbox().engine, check_status(status))

    def assert_sent(self, *, subject: str | None = None, to: str | None = None,
                    html_contains: str | None = None, text_contains: str | None = None,
                    template: str | None = None, locale: str | None = None,
                    count: int | None = None) -> list[TestEmail]:
        """The ``sent`` emails matching every filter given; AssertionError when there are none
        (or not exactly ``count``)."""
        filters = Filters(subject, to, html_contains, text_contains, template, locale)
        return self._expect("assert_sent", filters, (Status.SENT.value,), check_count(count))

    def assert_not_sent(self, *, subject: str | None = None, to: str | None = None,
                        html_contains: str | None = None, text_contains: str | None = None,
                        template: str | None = None, locale: str | None = None) -> None:
        """AssertionError when a ``sent`` email matches every filter given."""
        filters = Filters(subject, to, html_contains, text_contains, template, locale)
        self._expect("assert_not_sent", filters, (Status.SENT.value,), 0)

    def assert_enqueued(self, *, subject: str | None = None, to: str | None = None,
                        html_contains: str | None = None, text_contains: str | None = None,
                        template: str | None = None, locale: str | None = None,
                        count: int | None = None) -> list[TestEmail]:
        """The ``queued`` emails (committed, not delivered yet: manual mode, ``send_after``,
        a retry waiting) matching every filter given; AssertionError when there are none
        (or not exactly ``count``)."""
        filters = Filters(subject, to, html_contains, text_contains, template, locale)
        return self._expect("assert_enqueued", filters, ENQUEUED, check_count(count))

    def _expect(self, name: str, filters: Filters, statuses: Sequence[str],
                count: int | None) -> list[TestEmail]:
        emails = self.emails()
        matches = [e for e in emails if e.status in statuses and filters.match(e)]
        if count is None and matches or count is not None and len(matches) == count:
            return matches
        asked = [filters.describe()] if filters.describe() else []
        if count is not None and name != "assert_not_sent":
            asked.append(f"count={count}")
        call = f"{name}({', '.join(asked)})"
        wanted = " or ".join(statuses)
        if name == "assert_not_sent":
            said = f"expected no {wanted} email matching, found {len(matches)}"
        elif count is None:
            said = f"expected a {wanted} email matching, found none"
        else:
            said = f"expected exactly {count} {wanted} email(s) matching, found {len(matches)}"
        if matches:
            said += f" (ids {', '.join(str(e.id) for e in matches)})"
        raise AssertionError(f"{call}: {said}.\n{table(emails)}")


def table(emails: Sequence[TestEmail], limit: int = TABLE_ROWS) -> str:
    """The emails as one compact table (id, status, to, subject, template), ``limit`` rows at most."""
    if not emails:
        return "The outbox has no committed email."
    head = ("id", "status", "to", "subject", "template")
    rows = [(str(e.id), e.status, _cut(", ".join(e.recipients), 40), _cut(e.subject, 50),
             "-" if e.template is None else _cut(f"{e.template} ({e.locale or '-'})", 30))
            for e in emails[:limit]]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"The outbox has {len(emails)} committed email(s):"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
              for r in [head, *rows]]
    if len(emails) > limit:
        lines.append(f"  ... and {len(emails) - limit} more")
    return "\n".join(lines)


def _cut(text: str, limit: int) -> str:
    line = clean_line(text, limit=10 * limit)
    return line if len(line) <= limit else line[:limit - 1] + "…"
