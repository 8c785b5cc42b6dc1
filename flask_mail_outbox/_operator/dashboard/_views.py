"""The dashboard's pages and actions.

Pages only read, through the core's read API (:class:`~flask_mail_outbox.core.Reader`,
and the suppression list's reads). Actions go through the library's own API
(``mail.retry``, ``mail.set_durable``, ``mail.suppress``, ``mail.unsuppress``, the
store's dead-letter functions), each of which commits its own short transaction;
then they redirect (303) to a page with a notice, so a reload never repeats an
action. An action refused for its input (an address that is not one) writes
nothing and shows the page again with the reason, answering 400.
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from ..._errors import InvalidMessage
from ..._events import EVENT_TYPES
from ..._flask.state import app_state
from ...core._internal import (
    EVENT_SCAN_BUDGET,
    EXACT,
    REASONS,
    SEARCH_FIELDS,
    HourCount,
    PauseStore,
    Reader,
    Status,
    suppression_key,
    utcnow,
)
from ._preview import preview

if TYPE_CHECKING:
    from ..._flask.extension import OutboxExtension

_STATUSES = tuple(status.value for status in Status)
#: The statuses whose counts are running totals (the others are counted row by row).
_TALLIED = tuple(status.value for status in Status if status not in EXACT)
# What an action tells the page it redirects to: fixed texts, so a link cannot
# make the dashboard say anything else.
NOTICES = {
    "retried": "Email queued again; delivery starts now.",
    "not_failed": "That email is not a dead letter (any more); nothing was changed.",
    "cancelled": "Email cancelled: it will not be sent.",
    "not_cancelled": "That email is not queued (any more: it is being sent, or has ended); "
                     "nothing was changed.",
    "retried_all": "{n} dead letter(s) queued again.",
    "purged": "{n} dead letter(s) deleted.",
    "durable": "Delivery mode is now durable for every process sharing the database.",
    "inline": "Delivery mode is now inline for every process sharing the database.",
    "suppressed": "Address added to the suppression list: nothing more is sent to it.",
    "resuppressed": "That address was on the suppression list already; its entry was replaced.",
    "unsuppressed": "Address taken off the suppression list: mail to it is delivered again.",
    "not_suppressed": "That address is not on the suppression list (any more); nothing was "
                      "changed.",
    "preview_sent": "Preview queued through the outbox, as send_template() queues it; "
                    "its delivery shows here.",
}
# Ids are BIGINT: a larger number can name no email, and overflows the drivers.
_MAX_ID = 2**63 - 1
# The suppression list's key column: no longer address (or prefix of one) exists.
_MAX_ADDRESS = 320
_CHART_HEIGHT = 120
_CHART_BAR = 10
_CHART_GAP = 6


@dataclasses.dataclass(frozen=True)
class ChartBar:
    """One bar of the per-hour chart, in SVG user units."""

    x: int
    y: float
    height: float
    kind: str
    title: str


@dataclasses.dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[ChartBar]
    labels: list[tuple[int, str]]
    peak: int
    sent: int
    failed: int


class Dashboard:
    """The views, bound to one ``OutboxMail``."""

    def __init__(self, mail: OutboxExtension, *, page_size: int) -> None:
        self.mail = mail
        self.page_size = page_size

    def register(self, bp: Blueprint) -> None:
        bp.add_url_rule("/", "overview", self.overview)
        bp.add_url_rule("/emails", "emails", self.emails)
        bp.add_url_rule("/emails/<int:email_id>", "email", self.email)
        bp.add_url_rule("/emails/<int:email_id>/retry", "retry", self.retry, methods=["POST"])
        bp.add_url_rule("/emails/<int:email_id>/cancel", "cancel", self.cancel,
                        methods=["POST"])
        bp.add_url_rule("/dead-letters", "dead_letters", self.dead_letters)
        bp.add_url_rule("/dead-letters/retry-all", "retry_all", self.retry_all,
                        methods=["POST"])
        bp.add_url_rule("/dead-letters/purge", "purge", self.purge, methods=["POST"])
        bp.add_url_rule("/mode", "mode", self.set_mode, methods=["POST"])
        bp.add_url_rule("/suppressions", "suppressions", self.suppressions)
        bp.add_url_rule("/suppressions/add", "suppress", self.suppress, methods=["POST"])
        bp.add_url_rule("/suppressions/remove", "unsuppress", self.unsuppress,
                        methods=["POST"])
        bp.context_processor(_formatting)

    def _reader(self) -> Reader:
        return app_state().outbox().reader

    # -- pages ----------------------------------------------------------------------

    def overview(self) -> ResponseReturnValue:
        # One connection; no figure on it grows with the rows retained (see _queries).
        figures = self._reader().overview()
        pauses = PauseStore(app_state().outbox().store).all()  # the transports' rows only
        return render_template(
            "outbox_dashboard/overview.html", counts=figures.counts, statuses=_STATUSES,
            tallied=_TALLIED, oldest_queued_age=figures.oldest_queued_age,
            paused=[pauses[name] for name in sorted(pauses)],
            durable=self.mail.durable, chart=build_chart(figures.hours), notice=_notice())

    def emails(self) -> ResponseReturnValue:
        status = request.args.get("status") or None
        if status is not None and status not in _STATUSES:
            abort(400, description=f"status must be one of {', '.join(_STATUSES)}")
        field = request.args.get("field") or "recipient"
        if field not in SEARCH_FIELDS:
            abort(400, description=f"field must be one of {', '.join(SEARCH_FIELDS)}")
        event = request.args.get("event") or None
        if event is not None and event not in EVENT_TYPES:
            abort(400, description=f"event must be one of {', '.join(EVENT_TYPES)}")
        prefix = request.args.get("q", "").strip()
        if "\x00" in prefix:  # PostgreSQL text cannot hold NUL: it would be a 500
            abort(400, description="q must not contain a NUL character")
        cursor = _cursor(searching=bool(prefix))
        page = self._reader().list_emails(status=status, field=field, prefix=prefix,
                                          event=event, cursor=cursor, limit=self.page_size)
        return render_template("outbox_dashboard/emails.html", page=page, status=status,
                               field=field, q=prefix, event=event, statuses=_STATUSES,
                               event_types=EVENT_TYPES, first_page=_is_first_page(),
                               scan_budget=EVENT_SCAN_BUDGET)

    def email(self, email_id: int) -> ResponseReturnValue:
        if not 1 <= email_id <= _MAX_ID:
            abort(404, description=f"There is no email {email_id}.")
        detail = self._reader().get_email(email_id)
        if detail is None:
            abort(404, description=f"There is no email {email_id}.")
        shown = None if detail.mime is None else preview(detail.mime)
        kinds = {spec.name: spec.kind for spec in app_state().config.transport_specs}
        return render_template("outbox_dashboard/email.html", email=detail, preview=shown,
                               kind=kinds.get(detail.transport), notice=_notice())

    def dead_letters(self) -> ResponseReturnValue:
        cursor = _cursor(searching=False)
        page = self._reader().list_emails(status=Status.FAILED.value, cursor=cursor,
                                          limit=self.page_size)
        return render_template("outbox_dashboard/dead_letters.html", page=page,
                               first_page=_is_first_page(), notice=_notice())

    def suppressions(self) -> ResponseReturnValue:
        return self._suppressions_page()

    def _suppressions_page(self, *, error: str | None = None, address: str = "",
                           reason: str = "manual", code: int = 200) -> ResponseReturnValue:
        """The list by address (keyset: ``after`` the last one shown), a prefix search, the form.

        ``error``, ``address`` and ``reason``: an add that was refused, shown
        with what was typed (``code`` 400).
        """
        prefix = _text_arg("q")
        after = _text_arg("after") or None
        suppressions = app_state().outbox().suppressions
        entries = suppressions.entries(limit=self.page_size + 1, after=after,
                                       prefix=prefix or None)
        next_after = entries[self.page_size - 1].address \
            if len(entries) > self.page_size else None
        return render_template(
            "outbox_dashboard/suppressions.html", entries=entries[:self.page_size],
            next_after=next_after, total=suppressions.count(), q=prefix,
            first_page=after is None, reasons=REASONS, error=error, address=address,
            reason=reason, notice=None if error else _notice()), code

    # -- actions --------------------------------------------------------------------

    def retry(self, email_id: int) -> ResponseReturnValue:
        try:
            self.mail.retry(email_id)
        except LookupError:  # durability: ok not a dead letter; nothing changed, the page says so
            return _back(".email", "not_failed", email_id=email_id)
        return _back(".email", "retried", email_id=email_id)

    def retry_all(self) -> ResponseReturnValue:
        return _back(".dead_letters", "retried_all", n=self.mail.retry_all())

    def cancel(self, email_id: int) -> ResponseReturnValue:
        state = app_state()
        if email_id > _MAX_ID:
            return _back(".email", "not_cancelled", email_id=email_id)
        try:
            cancelled = self.mail.cancel(email_id)
            state.db.session.commit()
        except Exception:
            state.db.session.rollback()
            raise
        return _back(".email", "cancelled" if cancelled else "not_cancelled", email_id=email_id)

    def purge(self) -> ResponseReturnValue:
        if request.form.get("confirm") != "yes":
            abort(400, description="Tick the box to confirm that the dead letters are to "
                                   "be deleted.")
        older_than: datetime | None = None
        days = request.form.get("older_than_days", "").strip()
        if days:
            try:
                number = float(days)
            except ValueError:
                number = math.nan
            if not 0 <= number <= 36_500:
                abort(400, description="older_than_days must be a number of days "
                                       "from 0 to 36500, or empty for all.")
            older_than = utcnow() - timedelta(days=number)
        purged = app_state().outbox().store.admin.delete_failed(older_than=older_than)
        return _back(".dead_letters", "purged", n=purged)

    def set_mode(self) -> ResponseReturnValue:
        mode = request.form.get("mode")
        if mode not in ("durable", "inline"):
            abort(400, description="mode must be durable or inline")
        self.mail.set_durable(mode == "durable")
        return _back(".overview", mode)

    def suppress(self) -> ResponseReturnValue:
        address = _form_address()
        reason = request.form.get("reason") or "manual"
        if reason not in REASONS:
            abort(400, description=f"reason must be one of {', '.join(REASONS)}")
        try:
            added = self.mail.suppress(address, reason, source="dashboard")
        except InvalidMessage as exc:  # checked before anything is written
            return self._suppressions_page(
                error=f"Not added: {exc.problem}", address=address, reason=reason, code=400)
        # The list, searched for the entry just written (the address as it is kept).
        return _back(".suppressions", "suppressed" if added else "resuppressed",
                     q=suppression_key(address))

    def unsuppress(self) -> ResponseReturnValue:
        address = _form_address()
        try:
            removed = self.mail.unsuppress(address)
        except InvalidMessage as exc:
            return self._suppressions_page(error=f"Not removed: {exc.problem}", code=400)
        search = request.form.get("q", "").strip()
        return _back(".suppressions", "unsuppressed" if removed else "not_suppressed",
                     q=search if search and _plain_text(search) else None)


def build_chart(hours: list[HourCount]) -> Chart:
    """Bars for sent and failed per hour, scaled to the busiest hour."""
    peak = max([1, *(max(h.sent, h.failed) for h in hours)])
    step = 2 * _CHART_BAR + _CHART_GAP
    bars: list[ChartBar] = []
    labels: list[tuple[int, str]] = []
    for n, hour in enumerate(hours):
        x = n * step
        label = f"{hour.start:%H}:00"
        for offset, kind, count in ((0, "sent", hour.sent), (_CHART_BAR, "failed", hour.failed)):
            height = _CHART_HEIGHT * count / peak
            bars.append(ChartBar(x + offset, _CHART_HEIGHT - height, height, kind,
                                 f"{label} UTC: {count} {kind}"))
        if n % 6 == 0 or n == len(hours) - 1:
            labels.append((x, label))
    return Chart(width=len(hours) * step, height=_CHART_HEIGHT, bars=bars, labels=labels,
                 peak=peak, sent=sum(h.sent for h in hours),
                 failed=sum(h.failed for h in hours))


def _cursor(*, searching: bool) -> dict[str, str] | None:
    """The keyset cursor in the query string, checked; None on the first page.

    Hand-edited or truncated links answer 400, never 500: ids are ASCII
    decimals in the BIGINT range (``"²".isdigit()`` is true, and larger ids
    overflow the drivers), and the key holds no NUL (PostgreSQL text cannot).
    """
    args = request.args
    if searching:
        if "after_id" not in args:
            return None
        after_key = args.get("after_key", "")
        if "\x00" in after_key:
            abort(400, description="after_key must not contain a NUL character")
        return {"after_key": after_key, "after_id": _id_arg("after_id")}
    if "before" not in args:
        return None
    return {"before": _id_arg("before")}


def _id_arg(name: str) -> str:
    """Query argument ``name`` if it is an email id (an ASCII decimal from 1 to 2**63 - 1)."""
    value = request.args[name]
    if not (value.isascii() and value.isdigit() and len(value) <= 19
            and 1 <= int(value) <= _MAX_ID):
        abort(400, description=f"{name} must be an email id (a whole number from 1 to "
                               f"{_MAX_ID})")
    return value


def _text_arg(name: str) -> str:
    """Query argument ``name`` stripped ('' when absent); 400 when no address could hold it."""
    value = request.args.get(name, "").strip()
    if not _plain_text(value):
        abort(400, description=f"{name} must be at most {_MAX_ADDRESS} characters, "
                               "without a NUL character")
    return value


def _form_address() -> str:
    """The form's ``address``, stripped; 400 for one no text column could hold."""
    address = request.form.get("address", "").strip()
    if not _plain_text(address):
        abort(400, description=f"address must be at most {_MAX_ADDRESS} characters, "
                               "without a NUL character")
    return address


def _plain_text(value: str) -> bool:
    # PostgreSQL text cannot hold NUL (it would be a 500); no key is longer.
    return "\x00" not in value and len(value) <= _MAX_ADDRESS


def _is_first_page() -> bool:
    return "before" not in request.args and "after_id" not in request.args


def _notice() -> str | None:
    text = NOTICES.get(request.args.get("notice", ""))
    if text is None:
        return None
    count = request.args.get("n", "")
    return text.format(n=count if count.isascii() and count.isdigit() else "?")


def _back(endpoint: str, notice: str, **values: Any) -> ResponseReturnValue:
    """Post/redirect/get: 303 to ``endpoint`` with a notice (``n``: its count)."""
    return redirect(url_for(endpoint, notice=notice, **values), code=303)


def _formatting() -> dict[str, Any]:
    return {"format_time": format_time, "format_age": format_age,
            "format_size": format_size}


def format_time(value: datetime | None) -> str:
    """A stored (naive UTC) time for display."""
    return "—" if value is None else f"{value:%Y-%m-%d %H:%M:%S}"


def format_age(seconds: float | None) -> str:
    """``3 h 12 min``, ``4 min 05 s``, ``12 s``; a dash for None."""
    if seconds is None:
        return "—"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def format_size(size: int) -> str:
    """Bytes for people: ``812 B``, ``14.2 KiB``, ``3.1 MiB``."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1024 * 1024):.1f} MiB"
