"""The suppression policy (issue 40 item 2): what each event concludes for its recipient.

Permanent suppression only for a bounce whose reason says the address is dead
(user or host unknown, suspended, moved, no mail accepted), a complaint or an
unsubscribe; every other bounce is soft, and repeated soft bounces suppress the
address until a time (``OUTBOX_SOFT_BOUNCE_*``). Each stored event keeps the
verdict, applied or (for a report not trusted to act) only what it would have
been. Driven through the real parts: each provider's signed webhook on its
route, ``mail.process_bounce()`` with DSN bytes, an SMTP server refusing at
``RCPT TO``, the test kit on a fake clock; on SQLite and PostgreSQL.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import provider_mailgun
import provider_postmark
import provider_resend
import provider_sendgrid
import provider_ses
import pytest
import sqlalchemy as sa
from conftest import MakeApps, db, rows, wait_rows
from dashboard_helpers import Gate
from flask import Flask
from smtpserver import FaultSMTPServer
from webhooks_helpers import TRANSPORTS, post, sign

from flask_mail_outbox import (
    ConfigError,
    DeliveryEvent,
    InvalidMessage,
    Message,
    OutboxMail,
)
from flask_mail_outbox._policy import (
    DEAD_REASONS,
    SoftBounceRule,
    Verdict,
    conclude,
    for_good,
    is_soft_bounce,
)
from flask_mail_outbox._reasons import REASONS
from flask_mail_outbox.core import event_table, suppression_table
from flask_mail_outbox.core._config import load_config
from flask_mail_outbox.testing._control import OutboxControl, TestKitError

DAY = 86400.0
POSTFIX_DSN = (Path(__file__).parent / "bounces" / "postfix-hard-5.1.1.eml").read_bytes()


def stored_events(app: Flask, recipient: str) -> list[dict[str, Any]]:
    with app.app_context(), db.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            event_table.select().where(event_table.c.recipient == recipient)
            .order_by(event_table.c.id)).mappings()]


def entry_row(app: Flask, address: str) -> dict[str, Any] | None:
    """The suppression row as stored (lapsed or not)."""
    with app.app_context(), db.engine.connect() as conn:
        row = conn.execute(suppression_table.select().where(
            suppression_table.c.address == address)).mappings().first()
    return None if row is None else dict(row)


# -- the rule, as data ----------------------------------------------------------------------


def test_only_dead_reasons_of_a_permanent_bounce_suppress_for_good() -> None:
    for reason in REASONS:
        expected = "bounced" if reason in DEAD_REASONS else None
        assert for_good("bounced", "permanent", reason) == expected, reason
        assert for_good("bounced", "transient", reason) is None, reason
        assert is_soft_bounce("bounced", "permanent", reason) is (expected is None)
    assert for_good("bounced", "permanent", None) is None  # a reason not said is not death
    assert (for_good("complained", None, None), for_good("unsubscribed", None, None)) \
        == ("complained", "unsubscribed")
    for other in ("delivered", "deferred", "rejected", "opened", "clicked", "unknown"):
        assert for_good(other, None, "user_unknown") is None
        assert conclude(other, None, "user_unknown", soft_bounces=9, rule=SoftBounceRule(),
                        now=datetime(2026, 1, 1)) is None


def _verdict(bounce_kind: str, reason: str, soft_bounces: int, rule: SoftBounceRule) -> Verdict:
    found = conclude("bounced", bounce_kind, reason, soft_bounces=soft_bounces, rule=rule,
                     now=datetime(2026, 1, 1))
    assert found is not None
    return found


def test_the_verdict_of_soft_bounces_is_bounded_and_off_at_zero() -> None:
    rule = SoftBounceRule(limit=3, window_seconds=7 * DAY, suppress_seconds=14 * DAY)
    assert _verdict("permanent", "spam", 2, rule).verdict == "none"
    until = _verdict("transient", "mailbox_full", 3, rule)
    assert (until.verdict, until.suppression, until.until) == (
        "until", "bounced", datetime(2026, 1, 15))
    assert _verdict("permanent", "user_unknown", 0, rule).verdict == "permanent"
    for off in (SoftBounceRule(0, 7 * DAY, DAY), SoftBounceRule(3, 0, DAY),
                SoftBounceRule(3, DAY, 0)):
        assert _verdict("transient", "undefined", 99, off).verdict == "none"


# -- configuration ----------------------------------------------------------------------------


def test_the_soft_bounce_keys_are_read_with_their_defaults(tmp_path: Path) -> None:
    assert load_config({}, instance_path=str(tmp_path), testing=True).soft_bounces == \
        SoftBounceRule(limit=3, window_seconds=7 * DAY, suppress_seconds=14 * DAY)
    rule = load_config({"OUTBOX_SOFT_BOUNCE_LIMIT": "5", "OUTBOX_SOFT_BOUNCE_WINDOW_DAYS": 0.5,
                        "OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS": 0},
                       instance_path=str(tmp_path), testing=True).soft_bounces
    assert (rule.limit, rule.window_seconds, rule.enabled) == (5, DAY / 2, False)


@pytest.mark.parametrize(("key", "value"), [
    ("OUTBOX_SOFT_BOUNCE_LIMIT", -1), ("OUTBOX_SOFT_BOUNCE_LIMIT", 1.5),
    ("OUTBOX_SOFT_BOUNCE_LIMIT", "three"), ("OUTBOX_SOFT_BOUNCE_LIMIT", True),
    ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", -1), ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", "week"),
    ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", float("inf")), ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", 3651),
    ("OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS", float("nan")), ("OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS", 1e9),
    ("OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS", None),
])
def test_a_bad_soft_bounce_value_is_a_config_error_naming_the_key(
        tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({key: value}, instance_path=str(tmp_path), testing=True)
    assert caught.value.key == key


# -- each provider's hard bounce, through its webhook route ------------------------------------


@pytest.fixture
def hooks(make_apps: MakeApps) -> Flask:
    app, _ = make_apps(TESTING=True, OUTBOX_TRANSPORTS=TRANSPORTS)
    return app


def _postmark(address: str, hard: bool) -> str:
    return json.dumps(provider_postmark.bounce_record(
        "pm-1", address, bounce_type="HardBounce" if hard else "SoftBounce",
        type_code=1 if hard else 4096, bounce_id=7 if hard else 8))


def _ses(address: str, hard: bool) -> str:
    status, diagnostic, sub_type = (
        ("5.1.1", "smtp; 550 5.1.1 user unknown", "NoEmail") if hard
        else ("5.7.1", "smtp; 550 5.7.1 message content rejected", "ContentRejected"))
    return json.dumps(provider_ses.ses_event("Bounce", [address], provider_ses.bounce_detail(
        [(address, status, diagnostic)], "Permanent", sub_type)))


def _sendgrid(address: str, hard: bool) -> str:
    fields = ({"bounce_classification": "Invalid Address",
               "reason": "550 5.1.1 The email account does not exist"} if hard
              else {"bounce_classification": "Content",
                    "reason": "550 5.7.1 Message rejected: content"})
    return json.dumps([provider_sendgrid.webhook_event(
        "bounce", "sg-1", address, int(time.time()), event_id=f"sg-{hard}", **fields)])


def _mailgun(address: str, hard: bool) -> str:
    extra: dict[str, Any] = {} if hard else {"delivery-status": {
        "attempt-no": 1, "code": 550, "description": "",
        "message": "5.7.1 Our system has detected that this message is likely spam.",
        "session-seconds": 1.0, "mx-host": "aspmx.l.example.org"}}
    return json.dumps(provider_mailgun.webhook_event("failed", "<mg-1@mg.example.com>", address,
                                                     time.time(), event_id=f"mg-{hard}",
                                                     **extra))


def _resend(address: str, hard: bool) -> str:
    bounce = ({**provider_resend.bounce("Permanent", "General"),
               "diagnosticCode": ["smtp; 550 5.1.1 The email account does not exist"]} if hard
              else provider_resend.bounce("Permanent", "ContentRejected"))
    return json.dumps(provider_resend.resend_event("email.bounced", to=[address],
                                                   bounce=bounce))


PAYLOADS = {"postmark": _postmark, "ses": _ses, "sendgrid": _sendgrid, "mailgun": _mailgun,
            "resend": _resend}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_each_providers_hard_bounce_suppresses_for_good(hooks: Flask, kind: str) -> None:
    """Postmark HardBounce, SES Permanent/NoEmail, SendGrid's Invalid Address, Mailgun's
    permanent failure with 5.1.1, Resend's Permanent with 5.1.1: the address is dead."""
    address = f"gone-{kind}@example.com"
    response = post(hooks, kind, *sign(kind, PAYLOADS[kind](address, True)))
    assert response.status_code == 200, response.get_data(as_text=True)
    [event] = stored_events(hooks, address)
    assert (event["event_type"], event["bounce_kind"], event["reason"]) == (
        "bounced", "permanent", "user_unknown")
    assert (event["verdict"], event["suppressed_until"], event["applied_to"]) == (
        "permanent", None, address)
    entry = entry_row(hooks, address)
    assert entry is not None and (entry["reason"], entry["expires_at"]) == ("bounced", None)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_each_providers_soft_bounce_suppresses_nothing_once(hooks: Flask, kind: str) -> None:
    """A full mailbox, a spam or content block: the provider's permanent class stays, the
    address is not suppressed."""
    address = f"soft-{kind}@example.com"
    response = post(hooks, kind, *sign(kind, PAYLOADS[kind](address, False)))
    assert response.status_code == 200, response.get_data(as_text=True)
    [event] = stored_events(hooks, address)
    assert event["event_type"] == "bounced"
    assert event["reason"] not in DEAD_REASONS
    assert (event["verdict"], event["suppressed_until"], event["applied_to"]) == (
        "none", None, address)
    assert entry_row(hooks, address) is None


# -- bounded soft suppression, on the test kit's clock -----------------------------------------


@pytest.fixture
def kit(make_apps: MakeApps) -> Iterator[tuple[Flask, OutboxMail, OutboxControl]]:
    app, mail = make_apps(TESTING=True)
    control = OutboxControl(app)
    with app.app_context():
        yield app, mail, control
    control.close()


def _sent(mail: OutboxMail, control: OutboxControl, to: str = "ann@example.com") -> int:
    email_id = mail.send(Message("hello", recipients=[to], body="hi"))
    db.session.commit()
    control.deliver()
    return int(email_id)


def _status(app: Flask, email_id: int) -> str:
    return str(next(row["status"] for row in rows(app) if row["id"] == email_id))


def test_repeated_soft_bounces_suppress_until_a_time_then_mail_flows_again(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    first = _sent(mail, control)
    verdicts = [control.simulate_event(first, "soft_bounced").verdict]
    control.advance(DAY)
    verdicts.append(control.simulate_event(first, "bounced", reason="spam").verdict)
    # Day 7.5: the first falls out of the 7-day window: two in it, not three.
    control.advance(6.5 * DAY)
    verdicts.append(control.simulate_event(first, "soft_bounced").verdict)
    assert verdicts == ["none", "none", "none"]
    assert mail.suppression("ann@example.com") is None
    control.advance(DAY / 4)  # day 7.75: days 1, 7.5 and this one
    third = control.simulate_event(first, "soft_bounced", reason="mailbox_full")
    until = control.clock.now() + timedelta(days=14)
    assert third.verdict == "until" and third.applied
    assert abs((third.suppressed_until - until).total_seconds()) < 60  # type: ignore[operator]
    entry = mail.suppression("ann@example.com")
    assert entry is not None and entry.reason == "bounced"
    assert entry.expires_at == third.suppressed_until
    # mail.events() says the same as the returned event.
    stored = mail.events(first)[-1]
    assert (stored.verdict, stored.suppressed_until, stored.applied) == (
        "until", third.suppressed_until, True)
    assert [e.verdict for e in mail.events(first)] == ["none", "none", "none", "until"]
    # Meanwhile mail to the address ends suppressed, unsent.
    meanwhile = _sent(mail, control)
    assert _status(app, meanwhile) == "suppressed"
    # After the time, it is sent again.
    control.advance(14 * DAY + 60)
    assert mail.suppression("ann@example.com") is None
    after = _sent(mail, control)
    assert _status(app, after) == "sent"


def test_a_hard_verdict_makes_a_bounded_entry_permanent_and_soft_ones_never_shorten(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    _, mail, control = kit
    email_id = _sent(mail, control)
    for _ in range(3):
        control.simulate_event(email_id, "soft_bounced")
    bounded = mail.suppression("ann@example.com")
    assert bounded is not None and bounded.expires_at is not None
    hard = control.simulate_event(email_id, "bounced")  # user_unknown
    assert (hard.verdict, hard.suppressed_until) == ("permanent", None)
    entry = mail.suppression("ann@example.com")
    assert entry is not None and entry.expires_at is None
    # Soft bounces after it conclude "until", but a permanent entry stays permanent.
    later = control.simulate_event(email_id, "soft_bounced")
    assert later.verdict == "until"
    entry = mail.suppression("ann@example.com")
    assert entry is not None and entry.expires_at is None
    control.advance(30 * DAY)
    assert mail.suppression("ann@example.com") is not None


def test_a_bounded_entry_is_never_shortened_and_existing_entries_keep_their_meaning(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    app, mail, control = kit
    far = control.clock.now() + timedelta(days=90)
    mail.suppress("ann@example.com", reason="bounced", expires_at=far)
    mail.suppress("bob@example.com", reason="manual")
    ann, bob = _sent_all(mail, control)
    verdicts = [control.simulate_event(email_id, "soft_bounced").verdict
                for email_id in (ann, bob) for _ in range(3)]
    assert verdicts == ["none", "none", "until"] * 2
    ann_entry, bob_entry = entry_row(app, "ann@example.com"), entry_row(app, "bob@example.com")
    assert ann_entry is not None and ann_entry["expires_at"] == far
    assert bob_entry is not None and (bob_entry["reason"], bob_entry["expires_at"]) == (
        "manual", None)


def _sent_all(mail: OutboxMail, control: OutboxControl) -> tuple[int, int]:
    """Two emails marked sent before the entries apply (as if sent earlier)."""
    ids = [int(mail.send(Message("hello", recipients=[to], body="hi")))
           for to in ("ann@example.com", "bob@example.com")]
    db.session.commit()
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_email SET status = 'sent' WHERE id IN (:a, :b)"),
                     {"a": ids[0], "b": ids[1]})
    return ids[0], ids[1]


def test_soft_bounces_never_suppress_with_the_limit_at_zero(make_apps: MakeApps) -> None:
    app, mail = make_apps(TESTING=True, OUTBOX_SOFT_BOUNCE_LIMIT=0)
    control = OutboxControl(app)
    try:
        with app.app_context():
            email_id = _sent(mail, control)
            verdicts = {control.simulate_event(email_id, "soft_bounced").verdict
                        for _ in range(6)}
            assert verdicts == {"none"}
            assert mail.suppression("ann@example.com") is None
    finally:
        control.close()


# -- the test kit's reason= ---------------------------------------------------------------------


def test_simulate_event_takes_a_reason_and_returns_the_verdict(
        kit: tuple[Flask, OutboxMail, OutboxControl]) -> None:
    _, mail, control = kit
    email_id = _sent(mail, control)
    blocked = control.simulate_event(email_id, "bounced", reason="spam")
    assert (blocked.bounce_kind, blocked.reason, blocked.verdict) == ("permanent", "spam", "none")
    assert mail.suppression("ann@example.com") is None
    opened = control.simulate_event(email_id, "delivered")
    assert (opened.reason, opened.verdict, opened.applied) == (None, None, False)
    moved = control.simulate_event(email_id, "bounced", reason="host_unknown")
    assert (moved.reason, moved.verdict) == ("host_unknown", "permanent")
    with pytest.raises(TestKitError, match="'nope' is not one of"):
        control.simulate_event(email_id, "bounced", reason="nope")
    with pytest.raises(TestKitError, match="reason= is for a failure"):
        control.simulate_event(email_id, "delivered", reason="spam")


# -- reports not trusted to act: the verdict, not applied -----------------------------------


def test_a_forged_bounce_stores_its_verdict_suppresses_nothing_and_is_not_counted(
        make_apps: MakeApps) -> None:
    """A bounce of an email with several recipients may be any of them naming another:
    it acts on nobody. Its soft bounces do not count either: counted, three forgeries
    would suppress the address as surely as three real bounces."""
    app, mail = make_apps(TESTING=True, OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    verp = app.extensions["mail_outbox"].config.verp
    with app.app_context():
        alone = mail.send(Message("Hi", ["bob@example.com"], "x"))
        shared = mail.send(Message("Hi all", ["ann@example.com"], "x", cc=["bob@example.com"]))
        db.session.commit()

    def dsn(email_id: int, tag: str, *, soft: bool) -> bytes:
        raw = (f"X-Original-To: {verp.sender_for(email_id)}\r\n".encode()
               + POSTFIX_DSN.replace(b"nobody-here@example.com", b"bob@example.com")
               .replace(b"Message-Id: <", f"Message-Id: <{tag}".encode()))
        if soft:
            raw = raw.replace(b"Status: 5.1.1", b"Status: 5.2.2").replace(
                b'X-Postfix; unknown user: "nobody-here"', b"smtp; 552 5.2.2 mailbox full")
        return raw

    with app.app_context():
        hard = mail.process_bounce(dsn(shared, "hard", soft=False))
        soft = [mail.process_bounce(dsn(shared, f"soft{n}", soft=True)) for n in range(3)]
        assert mail.suppression("bob@example.com") is None
        assert [(e.verdict, e.applied) for e in hard] == [("permanent", False)]
        # Each would have been "none": the forged ones are not counted, only itself.
        assert [(e.verdict, e.applied) for [e] in soft] == [("none", False)] * 3
        # The real ones (bob alone got that email) count, and only they.
        real = [mail.process_bounce(dsn(alone, f"real{n}", soft=True)) for n in range(3)]
        assert [e.verdict for [e] in real] == ["none", "none", "until"]
        assert all(e.applied for [e] in real)
        entry = mail.suppression("bob@example.com")
        assert entry is not None and entry.expires_at is not None
    rows = stored_events(app, "bob@example.com")
    assert [(r["verdict"], r["applied_to"]) for r in rows] == (
        [("permanent", None)] + [("none", None)] * 3
        + [("none", "bob@example.com")] * 2 + [("until", "bob@example.com")])


# -- the SMTP refusal at RCPT TO, the same policy ----------------------------------------------


def test_an_smtp_refusal_suppresses_for_good_only_for_a_dead_address(
        app: Flask, mail: OutboxMail, smtp_server: FaultSMTPServer) -> None:
    smtp_server.refuse_recipient("gone@example.com", 550, "5.1.1 No such user")
    smtp_server.refuse_recipient("off@example.com", 550, "5.2.1 Mailbox disabled")
    smtp_server.refuse_recipient("spam@example.com", 550, "5.7.1 Message rejected as spam")
    with app.app_context():
        email_id = mail.send(Message("Hi", ["gone@example.com", "off@example.com",
                                            "spam@example.com", "ok@example.com"], "x"))
        db.session.commit()
    wait_rows(app, lambda rs: any(r["id"] == email_id and r["status"] == "sent" for r in rs),
              timeout=15)
    with app.app_context():
        events = {e.recipient: e for e in mail.events(email_id)}
        assert set(events) == {"gone@example.com", "off@example.com"}
        assert {(e.reason, e.verdict, e.applied) for e in events.values()} == {
            ("user_unknown", "permanent", True), ("suspended", "permanent", True)}
        assert mail.suppression("gone@example.com") is not None
        assert mail.suppression("off@example.com") is not None
        assert mail.suppression("spam@example.com") is None


# -- where the verdict is shown: the dashboard's email page, `flask outbox bounce` -------------


def test_the_dashboard_shows_each_events_verdict(app: Flask, mail: OutboxMail) -> None:
    app.register_blueprint(mail.dashboard_blueprint(authorize=Gate()), url_prefix="/outbox")
    with app.app_context():
        # Due in a day: it stays queued, the events are all that happens.
        email_id = int(mail.send(Message("Hi", ["ann@example.com", "bob@example.com"], "x"),
                                 send_after=timedelta(days=1)))
        db.session.commit()
        mail.record_event("bounced", email_id=email_id, recipient="ann@example.com",
                          bounce_kind="permanent", reason="user_unknown",
                          provider_event_id="1")
        mail.record_event("bounced", email_id=email_id, recipient="bob@example.com",
                          bounce_kind="permanent", mta_response="550 5.7.1 spam",
                          provider_event_id="2")
        for n in range(3, 5):
            mail.record_event("bounced", email_id=email_id, recipient="bob@example.com",
                              bounce_kind="transient", reason="mailbox_full",
                              provider_event_id=str(n))
        until = mail.events(email_id)[-1].suppressed_until
        mail.record_event("delivered", email_id=email_id, recipient="carl@example.com",
                          provider_event_id="5")
    assert until is not None
    page = app.test_client().get(f"/outbox/emails/{email_id}").get_data(as_text=True)
    assert page.count("suppressed for good") == 1
    assert page.count("not suppressed") == 2
    assert page.count(f"suppressed until {until:%Y-%m-%d %H:%M}") == 1
    assert page.count('class="verdict') == 4  # the delivery has none
    assert "would have been" not in page


def test_flask_outbox_bounce_logs_the_verdict(make_apps: MakeApps,
                                              caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(TESTING=True, OUTBOX_BOUNCE_ADDRESS="bounces@example.com")
    verp = app.extensions["mail_outbox"].config.verp
    with app.app_context():
        shared = mail.send(Message("Hi all", ["ann@example.com"], "x", cc=["bob@example.com"]))
        alone = mail.send(Message("Hi", ["bob@example.com"], "x"))
        db.session.commit()
    with caplog.at_level(logging.INFO):
        for email_id in (shared, alone):
            raw = (f"X-Original-To: {verp.sender_for(email_id)}\r\n".encode()
                   + POSTFIX_DSN.replace(b"nobody-here@example.com", b"bob@example.com")
                   .replace(b"Message-Id: <", f"Message-Id: <{email_id}".encode()))
            result = app.test_cli_runner().invoke(args=["outbox", "bounce"], input=raw)
            assert result.exit_code == 0, result.output
    said = [r.getMessage() for r in caplog.records if "flask outbox bounce: bounced" in
            r.getMessage()]
    assert len(said) == 2
    assert said[0].endswith(": would have been suppressed for good (not applied)")
    assert said[1].endswith(f"for email {alone}: suppressed for good")


# -- the documented table is the code's ---------------------------------------------------------


def test_the_policy_table_on_the_events_page_is_made_from_the_code() -> None:
    docs = Path(__file__).parent.parent / "docs"
    page = (docs / "events.md").read_text(encoding="utf-8")
    assert "```{outbox-policy}\n```" in page
    assert "outbox_policy" in (docs / "conf.py").read_text(encoding="utf-8")
    sys.path.insert(0, str(docs / "_ext"))
    try:
        outbox_policy = importlib.import_module("outbox_policy")
    finally:
        sys.path.remove(str(docs / "_ext"))
    table = outbox_policy.rows()
    assert [row[0] for row in table] == list(REASONS)
    for reason, meaning, permanent, transient in table:
        assert meaning == REASONS[reason]
        assert (permanent == outbox_policy.FOR_GOOD) is (reason in DEAD_REASONS)
        assert transient == outbox_policy.SOFT
    rendered = "\n".join(outbox_policy.lines())
    assert rendered.count(outbox_policy.FOR_GOOD) == len(DEAD_REASONS)
    # The soft-bounce keys and their defaults are on the same page.
    for key in ("OUTBOX_SOFT_BOUNCE_LIMIT` soft bounces of one address (3)",
                "OUTBOX_SOFT_BOUNCE_WINDOW_DAYS` (7)", "OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS` (14)"):
        assert key in page
    rule = SoftBounceRule()
    assert (rule.limit, rule.window_seconds / DAY, rule.suppress_seconds / DAY) == (3, 7, 14)


def test_the_policy_decides_whatever_an_apps_event_says_and_a_bad_reason_is_refused(
        app: Flask, mail: OutboxMail) -> None:
    with app.app_context():
        claimed = mail.record_event(DeliveryEvent(
            "bounced", bounce_kind="permanent", reason="spam", recipient="ann@example.com",
            verdict="permanent", applied=True))
        shown = mail.record_event(DeliveryEvent(
            "delivered", recipient="ann@example.com", verdict="until",
            suppressed_until=datetime(2099, 1, 1)))
        assert claimed is not None and shown is not None
        assert (claimed.verdict, claimed.applied) == ("none", True)
        assert (shown.verdict, shown.suppressed_until, shown.applied) == (None, None, False)
        assert [(e.verdict, e.suppressed_until) for e in
                (claimed, shown)] == [(r["verdict"], r["suppressed_until"])
                                      for r in stored_events(app, "ann@example.com")]
        assert mail.suppression("ann@example.com") is None
        with pytest.raises(InvalidMessage) as caught:
            mail.record_event("bounced", bounce_kind="permanent", reason="dead",
                              recipient="bob@example.com")
        assert caught.value.field == "reason"
        with pytest.raises(InvalidMessage) as caught:
            DeliveryEvent("bounced", bounce_kind="permanent", verdict="forever")
        assert caught.value.field == "verdict"
    assert stored_events(app, "bob@example.com") == []
