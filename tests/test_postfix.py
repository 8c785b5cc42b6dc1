"""The private Postfix harness (tests/postfix.py), and Postfix's own DSNs as interop data.

Mail goes in over SMTP (smtplib) with a VERP envelope sender ``bounces+<token>@outbox.test``,
the way the outbox sends it; what Postfix itself mails back to ``bounces`` is checked
against RFC 3464: a ``multipart/report; report-type=delivery-status`` with ``Action: failed``
and ``Status: 5.1.1`` for an unknown user, ``Action: delayed`` for a destination that
refuses connections, and the original Message-ID in the returned headers.
"""

from __future__ import annotations

import email
import email.policy
import smtplib
import socket
import uuid
from collections.abc import Iterator
from email.message import EmailMessage, Message
from pathlib import Path

import postfix
import pytest
from postfix import PostfixError, PrivatePostfix, require_postfix


@pytest.fixture(scope="module")
def mta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePostfix]:
    """One private Postfix for this module's tests (each test uses its own VERP token)."""
    require_postfix()
    with PrivatePostfix(tmp_path_factory.mktemp("postfix"), users=["alice"]) as server:
        yield server


def send(mta: PrivatePostfix, recipients: list[str], *, token: str,
         mail_options: tuple[str, ...] = ()) -> str:
    """Send a small message from ``bounces+<token>@outbox.test``; returns its Message-ID."""
    message_id = f"<{token}@app.example>"
    msg = EmailMessage()
    msg["From"] = "App <app@example.com>"
    msg["To"] = ", ".join(recipients)
    msg["Subject"] = f"test {token}"
    msg["Message-ID"] = message_id
    msg.set_content(f"body of {token}\n")
    with smtplib.SMTP(mta.host, mta.port, timeout=10) as smtp:
        refused = smtp.send_message(msg, from_addr=mta.address(f"bounces+{token}"),
                                    to_addrs=recipients, mail_options=list(mail_options))
    assert refused == {}
    return message_id


def parse(raw: bytes) -> EmailMessage:
    msg = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(msg, EmailMessage)
    return msg


def dsn_fields(dsn: EmailMessage) -> tuple[Message, list[Message]]:
    """An RFC 3464 report's per-message fields and its per-recipient field blocks."""
    assert dsn.get_content_type() == "multipart/report"
    assert dsn.get_param("report-type") == "delivery-status"
    parts = list(dsn.iter_parts())
    assert [p.get_content_type() for p in parts[:2]] == ["text/plain", "message/delivery-status"]
    payload = parts[1].get_payload()
    assert isinstance(payload, list)
    blocks = [b for b in payload if isinstance(b, Message)]
    assert len(blocks) == len(payload) >= 2
    return blocks[0], blocks[1:]


def returned_part(dsn: EmailMessage) -> Message:
    parts = list(dsn.iter_parts())
    assert len(parts) == 3
    return parts[2]


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def test_delivers_to_a_mailbox(mta: PrivatePostfix) -> None:
    token = new_token()
    message_id = send(mta, [mta.address("alice")], token=token)
    [raw] = mta.wait_for("alice", containing=token.encode())
    msg = parse(raw)
    assert msg["Message-ID"] == message_id
    assert msg["Return-Path"] == f"<bounces+{token}@outbox.test>"
    assert msg["Delivered-To"] == "alice@outbox.test"
    assert msg.get_content().strip() == f"body of {token}"


def test_plus_address_lands_in_the_bounces_mailbox(mta: PrivatePostfix) -> None:
    token = new_token()
    send(mta, [mta.address(f"bounces+reply-{token}")], token=token)
    [raw] = mta.wait_for("bounces", containing=f"reply-{token}".encode())
    assert parse(raw)["X-Original-To"] == f"bounces+reply-{token}@outbox.test"


def test_unknown_user_comes_back_as_postfixs_dsn(mta: PrivatePostfix) -> None:
    """RET=HDRS: the DSN returns the headers only, as text/rfc822-headers."""
    token = new_token()
    message_id = send(mta, [mta.address("alice"), mta.address("nobody")], token=token,
                      mail_options=("RET=HDRS",))
    mta.wait_for("alice", containing=token.encode())
    [raw] = mta.wait_for("bounces", containing=token.encode())
    dsn = parse(raw)
    # Postfix's own: from the MAILER-DAEMON, with a null envelope sender, back to the VERP address.
    assert dsn["Return-Path"] == "<>"
    assert dsn["To"] == f"bounces+{token}@outbox.test"
    assert dsn["X-Original-To"] == f"bounces+{token}@outbox.test"
    assert "MAILER-DAEMON@" in dsn["From"]
    assert dsn["Subject"] == "Undelivered Mail Returned to Sender"
    per_message, recipients = dsn_fields(dsn)
    assert per_message["Reporting-MTA"] == "dns; mx.outbox.test"
    assert per_message["X-Postfix-Sender"] == f"rfc822; bounces+{token}@outbox.test"
    [rcpt] = recipients  # alice was delivered: only nobody is reported
    assert rcpt["Final-Recipient"] == "rfc822; nobody@outbox.test"
    assert rcpt["Action"] == "failed"
    assert rcpt["Status"] == "5.1.1"
    assert "unknown user" in rcpt["Diagnostic-Code"]
    returned = returned_part(dsn)
    assert returned.get_content_type() == "text/rfc822-headers"
    text = returned.get_payload(decode=True)
    assert isinstance(text, bytes)
    headers = email.message_from_bytes(text, policy=email.policy.default)
    assert headers["Message-ID"] == message_id
    assert headers["Return-Path"] == f"<bounces+{token}@outbox.test>"


def test_dsn_returns_the_whole_message_by_default(mta: PrivatePostfix) -> None:
    """Without RET (the outbox sends none), the DSN's third part is message/rfc822."""
    token = new_token()
    message_id = send(mta, [mta.address("nobody")], token=token)
    [raw] = mta.wait_for("bounces", containing=token.encode())
    dsn = parse(raw)
    _, [rcpt] = dsn_fields(dsn)
    assert (rcpt["Action"], rcpt["Status"]) == ("failed", "5.1.1")
    returned = returned_part(dsn)
    assert returned.get_content_type() == "message/rfc822"
    payload = returned.get_payload()
    assert isinstance(payload, list) and len(payload) == 1
    original = payload[0]
    assert isinstance(original, EmailMessage)
    assert original["Message-ID"] == message_id
    assert original.get_content().strip() == f"body of {token}"


def test_refused_destination_gives_a_delay_dsn(mta: PrivatePostfix) -> None:
    token = new_token()
    message_id = send(mta, [f"someone@{mta.defer_domain}"], token=token,
                      mail_options=("RET=HDRS",))
    [raw] = mta.wait_for("bounces", containing=token.encode())
    dsn = parse(raw)
    assert dsn["Subject"] == "Delayed Mail (still being retried)"
    assert dsn["To"] == f"bounces+{token}@outbox.test"
    _, [rcpt] = dsn_fields(dsn)
    assert rcpt["Final-Recipient"] == f"rfc822; someone@{mta.defer_domain}"
    assert rcpt["Action"] == "delayed"
    assert rcpt["Status"].startswith("4.")
    assert "Connection refused" in " ".join(rcpt["Diagnostic-Code"].split())  # folded
    assert rcpt["Will-Retry-Until"]
    headers = returned_part(dsn).get_payload(decode=True)
    assert isinstance(headers, bytes) and message_id.encode() in headers
    # Still queued, and retried on demand.
    assert f"someone@{mta.defer_domain}" in mta.queue()
    mta.flush()


def test_other_domains_never_leave_the_machine(mta: PrivatePostfix) -> None:
    token = new_token()
    send(mta, ["someone@example.com"], token=token)
    [raw] = mta.wait_for("bounces", containing=token.encode())
    _, [rcpt] = dsn_fields(parse(raw))
    assert (rcpt["Action"], rcpt["Status"]) == ("failed", "5.7.1")
    assert "delivers nothing outside" in rcpt["Diagnostic-Code"]


def test_wait_for_times_out_with_the_log(mta: PrivatePostfix) -> None:
    with pytest.raises(PostfixError, match=r"(?s)alice@outbox.test has 0 message.*maillog"):
        mta.wait_for("alice", containing=b"never sent", timeout=0.2)
    with pytest.raises(KeyError):
        mta.mailbox("mallory")


def test_start_and_stop(tmp_path: Path) -> None:
    """Its own directories and port; stop() leaves no process, no port and no directory."""
    require_postfix()
    system_config = Path("/etc/postfix")
    before = sorted(p.name for p in system_config.iterdir()) if system_config.is_dir() else []
    server = PrivatePostfix(tmp_path / "pf")
    with server:
        root = server.root
        assert root is not None and root.is_dir()
        assert (tmp_path / "pf" / "postfix").resolve() == root
        pids = server.processes()
        assert pids  # master, qmgr, pickup, ...
        main_cf = server.main_cf()
        assert main_cf["queue_directory"] == str(root / "queue")
        assert main_cf["data_directory"] == str(root / "data")
        with smtplib.SMTP(server.host, server.port, timeout=10) as smtp:
            code, _ = smtp.ehlo("client.test")
            assert code == 250
            assert smtp.has_extn("dsn")
        port = server.port
    assert server.root is None
    assert not root.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server.host, port), timeout=5).close()
    log = (tmp_path / "pf" / "postfix-maillog").read_text()
    assert "starting the Postfix mail system" in log
    assert f"{server.host}:{port} inet" in (tmp_path / "pf" / "postfix-master.cf").read_text()
    assert not (tmp_path / "pf" / "postfix").exists()
    after = sorted(p.name for p in system_config.iterdir()) if system_config.is_dir() else []
    assert after == before  # the system's /etc/postfix: no main.cf appeared
    server.stop()  # twice is fine


def test_a_daemon_that_cannot_start_fails_start_with_the_log(tmp_path: Path) -> None:
    require_postfix()
    server = PrivatePostfix(tmp_path, settings={"queue_run_delay": "banana"})
    with pytest.raises(PostfixError, match=r"(?s)qmgr.*fatal: parameter queue_run_delay.*maillog"):
        server.start()
    assert server.root is None  # stopped and cleaned up
    assert "banana" in (tmp_path / "postfix-maillog").read_text()


def test_require_postfix_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postfix, "POSTFIX", Path("/nonexistent/postfix"))
    assert not postfix.postfix_available()
    monkeypatch.setattr(postfix, "REQUIRE_POSTFIX", False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install postfix"):
        require_postfix()
    monkeypatch.setattr(postfix, "REQUIRE_POSTFIX", True)
    with pytest.raises(pytest.fail.Exception, match="required.*apt-get install postfix"):
        require_postfix()
