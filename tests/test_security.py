"""Security: header injection, secrets, TLS, bcc, and SQL built only from parameters.

- Header injection: a property over every header field (CR, LF or NUL anywhere
  is refused naming the field) and a property that a valid message's headers
  are exactly the expected ones, with bcc only in the envelope.
- ``MAIL_PASSWORD`` and the AUTH exchange never reach a log record (every
  logger, DEBUG), ``last_error``, the error history, CLI output or an
  exception's text: on success, on a refused login and on a drop during AUTH.
- TLS: certificates verified by default; ``MAIL_USE_TLS=False`` never
  upgrades; ``MAIL_USE_TLS=True`` never falls back to plain text.
- SQL: quotes and SQL fragments round-trip intact on both backends, and no
  module of the package builds SQL text out of values.
"""

from __future__ import annotations

import ast
import base64
import email.policy
import logging
import traceback
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import pytest
from conftest import MakeApps, db, rows, wait_rows
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smtpserver import FaultSMTPServer

import flask_mail_outbox
from flask_mail_outbox import (
    Attachment,
    ConfigError,
    InvalidMessage,
    Message,
    OutboxMail,
)
from flask_mail_outbox._compose.message import PreparedEmail, prepare_message

SENDER = "sender@example.com"
OPTIONS: dict[str, Any] = {
    "default_sender": None, "allow_local_addresses": False,
    "max_message_bytes": 25 * 1024 * 1024, "message_id_domain": None,
    "ascii_attachments": False,
}
PROPERTY = settings(max_examples=80, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def prepare(msg: Message) -> PreparedEmail:
    return prepare_message(msg, **OPTIONS)


def parse(mime: bytes) -> EmailMessage:
    parsed = BytesParser(policy=email.policy.default).parsebytes(mime)
    assert isinstance(parsed, EmailMessage)
    return parsed


# --------------------------------------------------------------------------- #
# Header injection
# --------------------------------------------------------------------------- #


def _msg(**fields: Any) -> Message:
    msg = Message("Subject", recipients=["to@example.com"], body="body", sender=SENDER)
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


def _att(**fields: Any) -> Message:
    msg = _msg()
    msg.attachments.append(Attachment(**{"filename": "a.txt", "content_type": "text/plain",
                                         "data": b"x", **fields}))
    return msg


# Every header field a caller controls: (field the error names, message with value v).
HEADER_FIELDS: dict[str, tuple[str, Callable[[str], Message]]] = {
    "subject": ("subject", lambda v: _msg(subject=v)),
    "sender": ("sender", lambda v: _msg(sender=f"{v} <s@example.com>")),
    "sender name": ("sender", lambda v: _msg(sender=(v, "s@example.com"))),
    "recipient": ("recipients[0]", lambda v: _msg(recipients=[f"to@example.com{v}"])),
    "recipient name": ("recipients[0]", lambda v: _msg(recipients=[(v, "to@example.com")])),
    "cc": ("cc[0]", lambda v: _msg(cc=[(v, "cc@example.com")])),
    "bcc": ("bcc[0]", lambda v: _msg(bcc=[f"{v}bcc@example.com"])),
    "reply_to": ("reply_to", lambda v: _msg(reply_to=(v, "r@example.com"))),
    "extra header name": ("extra_headers", lambda v: _msg(extra_headers={f"X-{v}": "v"})),
    "extra header value": ("extra_headers", lambda v: _msg(extra_headers={"X-Tag": v})),
    "attachment filename": ("attachments[0].filename", lambda v: _att(filename=f"f{v}.txt")),
    "attachment content type": ("attachments[0].content_type",
                                lambda v: _att(content_type=f"text/plain; name={v}")),
    "attachment header": ("attachments[0].headers",
                          lambda v: _att(headers={"Content-ID": f"<{v}>"})),
    "msgId": ("msgId", lambda v: _msg(msgId=f"<{v}@example.com>")),
}
_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=20)


@PROPERTY
@given(field=st.sampled_from(sorted(HEADER_FIELDS)), before=_text,
       bad=st.sampled_from(["\r", "\n", "\0", "\r\n", "\n\t"]), after=_text)
def test_header_injection_is_refused_through_every_field(
        field: str, before: str, bad: str, after: str) -> None:
    name, build = HEADER_FIELDS[field]
    with pytest.raises(InvalidMessage) as excinfo:
        prepare(build(before + bad + after))
    assert excinfo.value.field == name


_local_parts = st.from_regex(r"[a-z0-9](?:[a-z0-9_+-]{0,8}[a-z0-9])?", fullmatch=True)
_domains = st.sampled_from(["example.com", "example.org", "bücher.example", "mail.example.net"])
_addresses = st.builds(lambda local, domain: f"{local}@{domain}", _local_parts, _domains)
# Any printable text, header-looking lines included ("Bcc: x" is just text here).
_phrase = st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp")),
                  max_size=40)
_named = st.one_of(_addresses, st.tuples(_phrase, _addresses))
_body = st.one_of(st.none(), st.text(alphabet=st.characters(exclude_categories=["Cs"]),
                                     max_size=600))
_attachment = st.tuples(
    st.one_of(st.none(), st.text(alphabet=st.characters(
        exclude_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=40)
        .filter(lambda f: f.strip() == f)),
    st.sampled_from(["application/octet-stream", "image/png", "text/csv"]),
    st.one_of(st.binary(max_size=600), st.text(
        alphabet=st.characters(exclude_categories=["Cs"]), max_size=200)),
)


def _bare(address: str | tuple[str, str]) -> str:
    text = address if isinstance(address, str) else address[1]
    local, _, domain = text.partition("@")
    return f"{local}@{domain.encode('idna').decode('ascii')}".lower()


def _canonical(text: str) -> str:
    # Line breaks normalised; nothing is added to a body (as Flask-Mail).
    return text.replace("\r\n", "\n").replace("\r", "\n")


@PROPERTY
@given(subject=_phrase, to=st.lists(_named, min_size=0, max_size=3),
       cc=st.lists(_named, max_size=3), bcc=st.lists(_addresses, max_size=3),
       reply_to=st.one_of(st.none(), _named), tag=_phrase, body=_body, html=_body,
       attachments=st.lists(_attachment, max_size=3))
def test_any_valid_message_survives_build_and_parse_with_bcc_only_in_the_envelope(
        subject: str, to: list[Any], cc: list[Any], bcc: list[str], reply_to: Any,
        tag: str, body: str | None, html: str | None,
        attachments: list[tuple[str | None, str, bytes | str]]) -> None:
    if not (to or cc or bcc):
        bcc = ["only-bcc@example.com"]
    msg = Message(subject, recipients=list(to), body=body, html=html, sender=SENDER,
                  cc=list(cc), bcc=list(bcc), reply_to=reply_to,
                  extra_headers={"X-Tag": tag})
    for filename, content_type, data in attachments:
        msg.attach(filename, content_type, data)
    prepared = prepare(msg)
    parsed = parse(prepared.mime)
    head = prepared.mime.split(b"\r\n\r\n", 1)[0]

    # Exactly the expected headers: nothing smuggled in, no Bcc.
    expected = {"from", "date", "message-id", "mime-version", "content-type", "x-tag"}
    expected |= {"subject"} if subject else set()  # none for an empty subject, as Flask-Mail
    expected |= {"to"} if to or not cc else set()  # cc-only mail has no To
    expected |= {"cc"} if cc else set()
    expected |= {"reply-to"} if reply_to is not None else set()
    expected |= {"content-transfer-encoding"} if not parsed.is_multipart() else set()
    assert {k.lower() for k in parsed} == expected
    assert parsed["Subject"] == (subject or None) and parsed["X-Tag"] == tag
    for header, given_list in (("To", to), ("Cc", cc)):
        if given_list:
            assert [a.addr_spec.lower() for a in parsed[header].addresses] == \
                [_bare(a) for a in given_list]
    if reply_to is not None:
        assert [a.addr_spec.lower() for a in parsed["Reply-To"].addresses] == [_bare(reply_to)]
    # Bcc: in the envelope, nowhere in the message's headers.
    envelope = {r.lower() for r in prepared.recipients}
    assert envelope == {_bare(a) for a in [*to, *cc, *bcc]}
    shown = {a.addr_spec.lower() for name in ("From", "To", "Cc", "Reply-To") if parsed[name]
             for a in parsed[name].addresses}
    hidden = {_bare(b) for b in bcc} - {_bare(a) for a in [*to, *cc, *([reply_to] if reply_to else [])]}
    assert not hidden & shown
    assert b"\r\nbcc:" not in head.lower()

    texts = {p.get_content_type(): str(p.get_content()).replace("\r\n", "\n")
             for p in parsed.walk()
             if p.get_content_maintype() == "text" and not p.is_attachment()}
    if body is not None:
        assert texts["text/plain"] == _canonical(body)
    if html is not None:
        assert texts["text/html"] == _canonical(html)
    got = list(parsed.iter_attachments())
    assert len(got) == len(attachments)
    for (filename, content_type, data), part in zip(attachments, got, strict=True):
        assert part.get_content_type() == content_type
        assert (part.get_filename() or None) == filename
        raw = part.get_payload(decode=True)
        assert raw == (data.encode("utf-8") if isinstance(data, str) else data)


def test_bcc_never_reaches_the_delivered_headers(
        make_apps: MakeApps, smtp_server: FaultSMTPServer) -> None:
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port)
    with app.app_context():
        mail.send(Message("to and bcc", recipients=["to@example.com"],
                          bcc=["hidden@example.com"], body="x"))
        mail.send(Message("bcc only", bcc=["secret@example.com"], body="x"))
        db.session.commit()
    assert smtp_server.wait_for(2)
    by_subject = {m.parsed["Subject"]: m for m in smtp_server.messages}
    both, only = by_subject["to and bcc"], by_subject["bcc only"]
    assert sorted(both.rcpt_tos) == ["hidden@example.com", "to@example.com"]
    assert b"hidden@example.com" not in both.data and both.parsed["Bcc"] is None
    assert only.rcpt_tos == ["secret@example.com"]
    assert b"secret@example.com" not in only.data
    assert only.parsed["To"] == "undisclosed-recipients:;"


# --------------------------------------------------------------------------- #
# Secrets
# --------------------------------------------------------------------------- #

USER, SECRET = "mailer", "pa55-W0rd-never-shown"


def _secret_forms() -> list[str]:
    """The password as it could leak: plain, and inside AUTH PLAIN / LOGIN exchanges."""
    return [SECRET,
            base64.b64encode(f"\0{USER}\0{SECRET}".encode()).decode(),
            base64.b64encode(SECRET.encode()).decode()]


def _leaks(texts: list[str]) -> list[str]:
    return [t[:200] for t in texts for form in _secret_forms() if form in t]


@pytest.fixture
def every_log_record() -> Iterator[list[logging.LogRecord]]:
    """Every record of every logger at DEBUG, but the test SMTP server's own.

    The server (aiosmtpd's ``mail.log``) is the far end of the wire: it logs
    the AUTH lines it receives, as any server might. What must stay quiet is
    this process's client side: the library, aiosmtplib, asyncio, SQLAlchemy.
    """
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith("mail.log"):
                records.append(record)

    root = logging.getLogger()
    handler, level = Keep(logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _record_texts(records: list[logging.LogRecord]) -> list[str]:
    texts = []
    for record in records:
        texts.append(record.getMessage())
        texts.append(repr(record.args))
        if record.exc_info and record.exc_info[1] is not None:
            texts.append("".join(traceback.format_exception(record.exc_info[1])))
    return texts


@pytest.mark.parametrize("server_does", ["accepts the login", "refuses the password",
                                         "drops during AUTH"])
def test_the_password_never_leaves_the_config(
        server_does: str, make_apps: MakeApps, smtp_server: FaultSMTPServer,
        every_log_record: list[logging.LogRecord]) -> None:
    smtp_server.require_auth(USER, SECRET if server_does != "refuses the password" else "other")
    if server_does == "drops during AUTH":
        smtp_server.drop_during_auth()
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          MAIL_USERNAME=USER, MAIL_PASSWORD=SECRET, OUTBOX_INLINE_RETRIES=0)
    with app.app_context():
        mail.send(Message("x", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    result = app.test_cli_runner().invoke(args=["outbox", "send-test", "--to", "b@example.com",
                                                "--timeout", "20"])
    [first, second] = rows(app)
    if server_does == "accepts the login":
        assert smtp_server.auth_attempts >= 1  # one pooled, authenticated connection
        assert (first["status"], second["status"]) == ("sent", "sent")
        assert result.exit_code == 0
    else:
        # The refused login pauses the transport (test_pause.py): the test email waits
        # for its probe without a login of its own, and send-test takes it back.
        assert smtp_server.auth_attempts >= 1
        # send-test is one-shot: a failed test email is taken back (cancelled).
        assert (first["status"], second["status"]) == ("queued", "cancelled")
        assert result.exit_code == 1 and "error:" in result.output
        assert any(r.levelno == logging.ERROR for r in every_log_record)
    stored = [str(v) for row in (first, second) for v in row.values()]
    texts = _record_texts(every_log_record) + stored + [result.output]
    assert not _leaks(texts)


def test_the_transport_error_text_and_cause_hold_no_password(
        smtp_server: FaultSMTPServer, make_apps: MakeApps) -> None:
    from flask_mail_outbox.transports import Envelope, SMTPTransport

    smtp_server.require_auth(USER, "other")
    app, _ = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                       MAIL_USERNAME=USER, MAIL_PASSWORD=SECRET)
    transport = SMTPTransport(app.extensions["mail_outbox"].config.smtp)
    try:
        with pytest.raises(flask_mail_outbox.TransientError) as excinfo:
            transport.send(Envelope(1, SENDER, ("a@example.com",), b"Subject: x\r\n\r\nx\r\n",
                                    "<x@example.com>"))
    finally:
        transport.close()
    assert "authentication failed" in str(excinfo.value)
    formatted = "".join(traceback.format_exception(excinfo.value))
    assert not _leaks([str(excinfo.value), repr(excinfo.value), formatted])


@pytest.mark.parametrize("value", [b"pa55-W0rd-never-shown", ["pa55-W0rd-never-shown"], 1234])
def test_a_mistyped_password_is_not_echoed_by_the_config_error(
        tmp_path: Path, value: Any) -> None:
    from flask_sqlalchemy import SQLAlchemy

    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'x.db'}",
                      MAIL_PASSWORD=value)
    SQLAlchemy(app)
    with pytest.raises(ConfigError) as excinfo:
        OutboxMail(app)
    assert excinfo.value.key == "MAIL_PASSWORD"
    assert "pa55" not in str(excinfo.value) and "1234" not in str(excinfo.value)
    assert "pa55" not in repr(excinfo.value)


# --------------------------------------------------------------------------- #
# TLS
# --------------------------------------------------------------------------- #


@pytest.fixture
def tls_server() -> Iterator[FaultSMTPServer]:
    with FaultSMTPServer(starttls=True) as server:
        yield server


def _send_one(app: Flask, mail: OutboxMail) -> dict[str, Any]:
    with app.app_context():
        mail.send(Message("tls", recipients=["a@example.com"], body="x"))
        db.session.commit()
        assert mail.wait_idle(20)
    [row] = rows(app)
    return row


def _outbox_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("flask_mail_outbox") and r.levelno >= logging.ERROR]


MODES: dict[str, dict[str, Any]] = {
    "inline": {"OUTBOX_INLINE_RETRIES": 0},
    "durable": {"OUTBOX_DURABLE": True, "OUTBOX_MAX_ATTEMPTS": 2,
                "OUTBOX_RETRY_BASE_SECONDS": 0.05, "OUTBOX_RETRY_MAX_SECONDS": 0.1,
                "OUTBOX_POLL_INTERVAL": 0.05, "OUTBOX_POLL_MAX_INTERVAL": 0.1},
}
#: Where a transient TLS failure ends: inline leaves it for the sweep, durable dead-letters.
FINAL = {"inline": "queued", "durable": "failed"}


def _send_until(app: Flask, mail: OutboxMail, mode: str) -> dict[str, Any]:
    with app.app_context():
        mail.send(Message("tls", recipients=["a@example.com"], body="x"))
        db.session.commit()
    wait_rows(app, lambda r: r[0]["status"] == FINAL[mode] and r[0]["attempts"] >= 1,
              timeout=20.0)
    with app.app_context():
        assert mail.wait_idle(20)
    [row] = rows(app)
    assert row["status"] == FINAL[mode]
    return row


@pytest.mark.parametrize("mode", MODES)
def test_a_self_signed_server_is_refused_by_default(
        mode: str, tls_server: FaultSMTPServer, make_apps: MakeApps,
        caplog: pytest.LogCaptureFixture) -> None:
    app, mail = make_apps(MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=True, **MODES[mode])
    row = _send_until(app, mail, mode)
    assert "CERTIFICATE_VERIFY_FAILED" in row["last_error"]
    assert tls_server.data_attempts == 0 and tls_server.messages == []
    assert any("CERTIFICATE_VERIFY_FAILED" in e for e in _outbox_errors(caplog))


@pytest.mark.parametrize("trust", ["OUTBOX_TLS_CA_FILE", "OUTBOX_TLS_VERIFY=False"])
def test_a_self_signed_server_is_accepted_when_trusted(
        trust: str, tls_server: FaultSMTPServer, make_apps: MakeApps) -> None:
    config: dict[str, Any] = {"OUTBOX_TLS_CA_FILE": tls_server.cert_file} \
        if trust == "OUTBOX_TLS_CA_FILE" else {"OUTBOX_TLS_VERIFY": False}
    app, mail = make_apps(MAIL_SERVER="localhost", MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=True, **config)
    assert _send_one(app, mail)["status"] == "sent"
    assert [m.tls for m in tls_server.messages] == [True]


def test_use_tls_false_never_upgrades_when_starttls_is_offered(
        tls_server: FaultSMTPServer, make_apps: MakeApps) -> None:
    app, mail = make_apps(MAIL_SERVER=tls_server.host, MAIL_PORT=tls_server.port,
                          MAIL_USE_TLS=False)
    assert _send_one(app, mail)["status"] == "sent"
    assert [m.tls for m in tls_server.messages] == [False]


@pytest.mark.parametrize("mode", MODES)
def test_use_tls_true_never_falls_back_to_plain_text(
        mode: str, smtp_server: FaultSMTPServer, make_apps: MakeApps,
        caplog: pytest.LogCaptureFixture) -> None:
    """A server that does not offer STARTTLS gets no MAIL FROM, and an ERROR says why.

    Transient (a configuration fix resolves it): inline leaves the row queued,
    durable dead-letters it once its attempts are spent.
    """
    smtp_server.reply("mail", 530, "5.7.0 plain text MAIL FROM must never come")
    app, mail = make_apps(MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                          MAIL_USE_TLS=True, **MODES[mode])
    row = _send_until(app, mail, mode)
    assert "STARTTLS" in row["last_error"] and "530" not in row["last_error"]
    assert smtp_server.connections >= 1
    assert smtp_server.data_attempts == 0 and smtp_server.messages == []
    assert any("STARTTLS" in e for e in _outbox_errors(caplog))


# --------------------------------------------------------------------------- #
# SQL: parameters only
# --------------------------------------------------------------------------- #

NASTY = [
    "Robert'); DROP TABLE outbox_email;--",
    "' OR '1'='1",
    '"; DELETE FROM outbox_setting; --',
    "back\\slash %s %(x)s :param $1 ? {0}",
]


def test_quotes_and_sql_fragments_round_trip_intact(make_apps: MakeApps) -> None:
    app, mail = make_apps(OUTBOX_TRANSPORT="null")
    with app.app_context():
        for index, text in enumerate(NASTY):
            mail.send(Message(text, recipients=[("O'Brien; --", f"o'brien+{index}@example.com")],
                              body=text, extra_headers={"X-Note": text}),
                      key=f"{text} key", idempotency_key=f"{text} {index}")
        db.session.commit()
        assert mail.wait_idle(20)
        # The idempotency lookup is a query built from the key: it must find the row.
        again = mail.send(Message("again", recipients=["a@example.com"]),
                          idempotency_key=f"{NASTY[0]} 0")
        db.session.rollback()
    stored = wait_rows(app, lambda r: all(x["status"] == "sent" for x in r), timeout=20.0)
    assert [r["subject"] for r in stored] == NASTY
    assert [r["key"] for r in stored] == [f"{t} key" for t in NASTY]
    assert [r["idempotency_key"] for r in stored] == [f"{t} {i}" for i, t in enumerate(NASTY)]
    assert [r["recipients"] for r in stored] == [
        f'["o\'brien+{i}@example.com"]' for i in range(len(NASTY))]
    assert again == stored[0]["id"]
    for row, text in zip(stored, NASTY, strict=True):
        assert parse(row["mime"])["X-Note"] == text


_SQL_SINKS = {"text", "literal_column", "exec_driver_sql", "execute", "executescript"}


def _is_literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float))


def _literal_names(body: list[ast.stmt]) -> set[str]:
    """Names whose every assignment in ``body`` (one scope) is a literal, or a choice of two."""
    values: dict[str, list[ast.expr]] = {}
    for node in body:
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign):
                for target in inner.targets:
                    if isinstance(target, ast.Name):
                        values.setdefault(target.id, []).append(inner.value)
    return {name for name, assigned in values.items()
            if all(_is_literal(v) or (isinstance(v, ast.IfExp) and _is_literal(v.body)
                                      and _is_literal(v.orelse)) for v in assigned)}


def _is_enum_member(node: ast.expr) -> bool:
    """``Status.QUEUED`` or ``Status.QUEUED.value``: a member of a class's constants."""
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr.isupper() and \
        isinstance(node.value, ast.Name) and node.value.id[:1].isupper()


def _callers_pass_literals(tree: ast.Module, function: str, position: int) -> bool:
    """Every call of ``function`` in the module passes a string literal at ``position``."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == function]
    passed = [c.args[position] if len(c.args) > position else None for c in calls]
    return bool(calls) and all(
        isinstance(arg, ast.Constant) and isinstance(arg.value, str) for arg in passed)


def sql_built_from_values(source: str) -> list[str]:
    """Where ``source`` hands SQL text built from non-constant values to a SQL sink.

    A sink is ``text()``, ``literal_column()``, ``exec_driver_sql()``,
    ``execute()`` or ``executescript()``. Its first argument may be a string
    literal; an f-string or ``+`` whose pieces are literals, enum members
    (``Status.QUEUED.value``) or names only ever bound to literals (module
    constants, or locals chosen between two literals); a non-string expression (a SQLAlchemy construct); or a
    parameter of a function whose every call passes a literal. Anything
    formatted from other values (f-string, ``%``, ``.format()``, ``+``) is
    reported.
    """
    tree = ast.parse(source)
    constants = {n for n in _literal_names(tree.body)
                 if not any(isinstance(f, ast.FunctionDef) and n in _literal_names(f.body)
                            for f in tree.body)}
    problems: list[str] = []

    def safe_piece(node: ast.expr, names: set[str]) -> bool:
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return node.id in names
        if _is_enum_member(node):
            return True
        if isinstance(node, ast.JoinedStr):
            return all(safe_piece(v.value, names) if isinstance(v, ast.FormattedValue) else True
                       for v in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return safe_piece(node.left, names) and safe_piece(node.right, names)
        return False

    def check(node: ast.expr, function: ast.FunctionDef | None, line: int) -> None:
        names = constants | (_literal_names(function.body) if function else set())
        stringy = isinstance(node, (ast.JoinedStr, ast.BinOp)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("format", "join", "replace"))
        if stringy and not safe_piece(node, names):
            problems.append(f"line {line}: {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.Name) and node.id not in names and function is not None:
            params = [a.arg for a in function.args.args]
            if node.id in params and not _callers_pass_literals(
                    tree, function.name, params.index(node.id)):
                problems.append(f"line {line}: {function.name}({node.id}) gets non-literal SQL")

    def visit(node: ast.AST, function: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef) else function
            if isinstance(child, ast.Call) and child.args:
                name = child.func.attr if isinstance(child.func, ast.Attribute) else \
                    child.func.id if isinstance(child.func, ast.Name) else ""
                if name in _SQL_SINKS:
                    check(child.args[0], function, child.lineno)
            visit(child, inner)

    visit(tree, None)
    return problems


def test_the_sql_check_catches_sql_built_from_values() -> None:
    bad = [
        "conn.execute(sa.text(f\"SELECT * FROM t WHERE id = {email_id}\"))",
        "conn.exec_driver_sql(\"DELETE FROM t WHERE k = '%s'\" % key)",
        "conn.execute(text(\"UPDATE t SET s = '{}'\".format(subject)))",
        "cur.execute(\"SELECT \" + column)",
        "sa.literal_column(f\"'{row.status.value}'\")",
        "def where(clause):\n    return sa.text(clause)\nwhere(user_input)",
        "def f(x):\n    n = x if x else 'y'\n    op.execute(f'SELECT {n}')",
    ]
    good = [
        "CHANNEL = 'outbox'\nconn.execute(f'LISTEN {CHANNEL}')",
        "conn.execute(sa.text('SELECT 1 WHERE id = :id'), {'id': email_id})",
        "conn.execute(t.update().where(t.c.id == email_id))",
        "def where(clause):\n    return sa.text(clause)\nwhere('status = 1')",
        "conn.exec_driver_sql('BEGIN IMMEDIATE')",
        "t.c.status == sa.literal_column(f\"'{Status.QUEUED.value}'\")",
        "N = 5\ndef f(pg):\n    c = 'a' if pg else 'b'\n    op.execute(f'SELECT {c} LIMIT {N}')",
    ]
    assert all(sql_built_from_values(snippet) for snippet in bad), bad
    assert not [s for s in good if sql_built_from_values(s)]


# Reviewed exceptions: SQL text built from identifiers, never from values.
IDENTIFIERS_ONLY = {
    # send_many's PostgreSQL insert: the names of outbox_email's columns (the keys of
    # the row send() builds) and their compiled types; every value is an array parameter.
    ("core/_dialect.py", "INSERT INTO {email_table.name} ({quoted}, created_at) SELECT {selected}"),
    # The same insert with created_at among the columns (a test clock stamps the rows).
    ("core/_dialect.py", "INSERT INTO {email_table.name} ({quoted}) SELECT {selected}"),
    # The record of sent rows, on each database: constant fragments joined by a flag
    # (scrub the MIME, provider ids given); the rows are bound parameters.
    ("core/_dialect.py", "UPDATE outbox_email AS e SET status = 'sent'"),
    ("core/_dialect.py", "UPDATE outbox_email SET status = 'sent', sent_at = :now"),
    # The PostgreSQL claim: the module's constant SQL fragments, joined with and without
    # the reap; its values are the declared bind parameters.
    ("core/_claim.py", "_pg_statement(sql) gets non-literal SQL"),
    # Retention's selects: the module's constant predicates, columns and index names, and
    # the dialect's index hint (an index name); older_than and batch are bound.
    ("core/_models.py", "SELECT {what} FROM outbox_email{hint} WHERE {status} AND {column}"),
    ("core/_admin.py", "ORDER BY {('ended_at' if ended else 'sent_at')} LIMIT :batch"),
    ("core/_admin.py", "_delete(old) gets non-literal SQL"),
    # The ended rows' partial index: its predicate is the module constant ENDED_SQL, the
    # very text retention's select writes out (so the planner matches the two).
    ("core/_models.py", "_where(clause) gets non-literal SQL"),
}


def test_the_package_builds_no_sql_from_values() -> None:
    package = Path(flask_mail_outbox.__file__).parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        name = str(path.relative_to(package))
        problems = [p for p in sql_built_from_values(path.read_text(encoding="utf-8"))
                    if not any(name == file and snippet in p
                               for file, snippet in IDENTIFIERS_ONLY)]
        if problems:
            found[name] = problems
    assert found == {}


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # configuration only
@pytest.mark.parametrize(("server", "tls", "warned"), [
    ("smtp.example.com", {}, True),
    ("smtp.example.com", {"MAIL_USE_TLS": True}, False),
    ("smtp.example.com", {"MAIL_USE_SSL": True, "MAIL_PORT": 465}, False),
    ("127.0.0.1", {}, False),
    ("localhost", {}, False),
])
def test_a_login_that_would_cross_the_network_in_clear_is_warned_about(
        server: str, tls: dict[str, Any], warned: bool, make_apps: MakeApps,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    make_apps(MAIL_SERVER=server, MAIL_USERNAME=USER, MAIL_PASSWORD=SECRET, **tls)
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith("flask_mail_outbox") and r.levelno == logging.WARNING
                and "unencrypted" in r.getMessage()]
    assert len(warnings) == int(warned), warnings
    assert all(server in w and SECRET not in w for w in warnings)
