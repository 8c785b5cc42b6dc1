"""Bad input: every case raises a typed error naming the field or key, and writes nothing.

Three matrices, counted in the README:

- ``mail.send()``: malformed, local, IDN and overlong addresses; CR, LF and NUL
  in every header field; oversized messages and attachments; attachment data
  that is neither bytes nor str; a wrong type for every ``Message`` argument
  and every ``send()`` option. Each raises ``InvalidMessage`` whose ``field``
  names the culprit; the session is then committed and the outbox tables
  must be exactly as before.
- configuration: a bad value for every ``OUTBOX_*`` key and every ``MAIL_*``
  key the library reads raises ``ConfigError`` naming it at ``init_app``;
  nothing is registered and no table is created.
- the CLI: unknown ids and bad options exit non-zero with a message that
  says what was wrong, and change no row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import close_app, db, empty_postgres, make_app, require_postgres
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import ConfigError, InvalidMessage, Message, OutboxMail
from flask_mail_outbox.core import metadata as outbox_metadata

MAX_BYTES = 20_000
LONG_LOCAL = "l" * 65 + "@example.com"  # local part over 64 octets
LONG_LABEL = "a@" + "b" * 64 + ".com"  # a DNS label over 63 octets
LONG_ADDRESS = "a@" + ".".join(["c" * 60] * 5) + ".com"  # over 254 octets


# --------------------------------------------------------------------------- #
# One app per backend for the whole module: validation must not touch it.
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def bad_app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            pg_database: str | None) -> Iterator[Flask]:
    """An app on the ``null`` transport with one committed email already stored."""
    if request.param == "postgresql":
        require_postgres()
        assert pg_database is not None
        url = empty_postgres(pg_database)
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('bad') / 'bad.db'}"
    app = make_app(url, OUTBOX_TRANSPORT="null", OUTBOX_MAX_MESSAGE_BYTES=MAX_BYTES)
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        mail.send(Message("existing", recipients=["a@example.com"], body="x"),
                  idempotency_key="existing")
        db.session.commit()
        assert mail.wait_idle(10)
    yield app
    close_app(app)


def snapshot(app: Flask) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the three outbox tables, read on a fresh connection."""
    with app.app_context(), db.engine.connect() as conn:
        return {name: [tuple(r) for r in conn.execute(
            table.select().order_by(*table.primary_key.columns))]
            for name, table in outbox_metadata.tables.items()}


# --------------------------------------------------------------------------- #
# mail.send()
# --------------------------------------------------------------------------- #


def message(**overrides: Any) -> Message:
    """A valid message with ``overrides`` applied as attributes."""
    msg = Message("Subject", recipients=["to@example.com"], body="body")
    for name, value in overrides.items():
        setattr(msg, name, value)
    return msg


def with_attachment(**fields: Any) -> Message:
    """A valid message whose one attachment has ``fields`` replaced."""
    msg = message()
    msg.attach(**{"filename": "a.txt", "content_type": "text/plain", "data": b"x", **fields})
    return msg


def oversized_attachment() -> Message:
    msg = message()
    msg.attach("big.bin", "application/octet-stream", b"\0" * (MAX_BYTES + 1))
    return msg


# (field the error must name, message factory, send() keyword arguments)
SendCase = tuple[str, Callable[[], Any], dict[str, Any]]

ADDRESS_CASES: dict[str, SendCase] = {
    "empty address": ("recipients[0]", lambda: message(recipients=[""]), {}),
    "no @": ("recipients[0]", lambda: message(recipients=["not-an-address"]), {}),
    "two @": ("recipients[0]", lambda: message(recipients=["a@@example.com"]), {}),
    "space inside": ("recipients[0]", lambda: message(recipients=["a b@example.com"]), {}),
    "single-label domain": ("recipients[0]", lambda: message(recipients=["a@example"]), {}),
    "localhost": ("recipients[0]", lambda: message(recipients=["a@localhost"]), {}),
    "special-use .test": ("recipients[0]", lambda: message(recipients=["a@x.test"]), {}),
    "local part > 64": ("recipients[0]", lambda: message(recipients=[LONG_LOCAL]), {}),
    "label > 63": ("recipients[0]", lambda: message(recipients=[LONG_LABEL]), {}),
    "address > 254": ("recipients[0]", lambda: message(recipients=[LONG_ADDRESS]), {}),
    "IDN, invalid punycode": ("recipients[0]", lambda: message(recipients=["a@xn--zz.com"]), {}),
    "IDN, disallowed code point": ("recipients[0]",
                                   lambda: message(recipients=["a@exa\u2028mple.com"]), {}),
    "non-ASCII local part (SMTPUTF8)": ("recipients[0]",
                                        lambda: message(recipients=["jörg@example.com"]), {}),
    "display form without address": ("recipients[0]",
                                     lambda: message(recipients=["Name <>"]), {}),
    "tuple with bad address": ("recipients[0]",
                               lambda: message(recipients=[("Name", "nope")]), {}),
    "tuple of three": ("recipients[0]", lambda: message(recipients=[("a", "b", "c")]), {}),
    "a bare string for the list": ("recipients",
                                   lambda: message(recipients="to@example.com"), {}),
    "no recipient at all": ("recipients", lambda: message(recipients=[], cc=[], bcc=[]), {}),
    "bad cc": ("cc[1]", lambda: message(cc=["cc@example.com", "bad"]), {}),
    "bad bcc": ("bcc[0]", lambda: message(bcc=["bad@"]), {}),
    "bad sender": ("sender", lambda: message(sender="sender@"), {}),
    "bad reply_to": ("reply_to", lambda: message(reply_to="@example.com"), {}),
    "bad reply_to in a list": ("reply_to[0]", lambda: message(reply_to=["x"]), {}),
}

# Every header field, with CR, LF and NUL.
_INJECTABLE: dict[str, tuple[str, Callable[[str], Any]]] = {
    "subject": ("subject", lambda v: message(subject=f"Hi{v}Bcc: victim@example.com")),
    "sender name": ("sender", lambda v: message(sender=(f"Eve{v}X: y", "eve@example.com"))),
    "sender string": ("sender", lambda v: message(sender=f"Eve{v} <eve@example.com>")),
    "recipient name": ("recipients[0]",
                       lambda v: message(recipients=[(f"To{v}X: y", "to@example.com")])),
    "recipient address": ("recipients[0]",
                          lambda v: message(recipients=[f"to@example.com{v}"])),
    "cc": ("cc[0]", lambda v: message(cc=[f"cc@example.com{v}Bcc: x@example.com"])),
    "bcc": ("bcc[0]", lambda v: message(bcc=[(f"B{v}", "bcc@example.com")])),
    "reply_to": ("reply_to", lambda v: message(reply_to=f"r@example.com{v}X: y")),
    "extra header name": ("extra_headers", lambda v: message(extra_headers={f"X-A{v}B": "v"})),
    "extra header value": ("extra_headers",
                           lambda v: message(extra_headers={"X-A": f"v{v}Bcc: x@example.com"})),
    "attachment filename": ("attachments[0].filename",
                            lambda v: with_attachment(filename=f"a{v}.txt")),
    "attachment content type": ("attachments[0].content_type",
                                lambda v: with_attachment(content_type=f"text/plain{v}")),
    "attachment disposition": ("attachments[0].disposition",
                               lambda v: with_attachment(disposition=f"inline{v}")),
    "attachment header value": ("attachments[0].headers",
                                lambda v: with_attachment(headers={"Content-ID": f"<c{v}>"})),
    "msgId": ("msgId", lambda v: message(msgId=f"<a{v}@example.com>")),
}


def _injected(factory: Callable[[str], Any], char: str) -> Callable[[], Any]:
    return lambda: factory(char)


INJECTION_CASES: dict[str, SendCase] = {
    f"{name} with {label}": (field, _injected(factory, char), {})
    for name, (field, factory) in _INJECTABLE.items()
    for label, char in (("CR", "\r"), ("LF", "\n"), ("NUL", "\0"))
}

SIZE_AND_DATA_CASES: dict[str, SendCase] = {
    "message over OUTBOX_MAX_MESSAGE_BYTES": (
        "message size", lambda: message(body="b" * (MAX_BYTES + 1)), {}),
    "attachment over OUTBOX_MAX_MESSAGE_BYTES": ("message size", oversized_attachment, {}),
    "attachment data int": ("attachments[0].data", lambda: with_attachment(data=42), {}),
    "attachment data None": ("attachments[0].data", lambda: with_attachment(data=None), {}),
    "attachment data list": ("attachments[0].data", lambda: with_attachment(data=[b"x"]), {}),
    "attachment data lone surrogate": ("attachments[0].data",
                                       lambda: with_attachment(data="\udc80"), {}),
    "attachment not an Attachment": ("attachments[0]", lambda: message(attachments=["a.txt"]),
                                     {}),
}

TYPE_CASES: dict[str, SendCase] = {
    "subject int": ("subject", lambda: message(subject=1), {}),
    "recipients int": ("recipients", lambda: message(recipients=42), {}),
    "recipient int": ("recipients[0]", lambda: message(recipients=[42]), {}),
    "body bytes": ("body", lambda: message(body=b"x"), {}),
    "html int": ("html", lambda: message(html=1), {}),
    "alts int": ("alts", lambda: message(alts=1), {}),
    "alts value int": ("alts['html']", lambda: message(alts={"html": 1}), {}),
    "sender int": ("sender", lambda: message(sender=1), {}),
    "cc dict": ("cc", lambda: message(cc={"cc@example.com": 1}), {}),
    "bcc int": ("bcc", lambda: message(bcc=1), {}),
    "attachments str": ("attachments", lambda: message(attachments="file.txt"), {}),
    "reply_to int": ("reply_to", lambda: message(reply_to=1), {}),
    "date str": ("date", lambda: message(date="yesterday"), {}),
    "date NaN": ("date", lambda: message(date=float("nan")), {}),
    "charset int": ("charset", lambda: message(charset=1), {}),
    "charset unknown": ("charset", lambda: message(charset="no-such-charset"), {}),
    "extra_headers list": ("extra_headers", lambda: message(extra_headers=[("X-A", "b")]), {}),
    "extra header value int": ("extra_headers", lambda: message(extra_headers={"X-A": 1}), {}),
    "mail_options str": ("mail_options", lambda: message(mail_options="SMTPUTF8"), {}),
    "mail_options with CRLF": ("mail_options",
                               lambda: message(mail_options=["BODY=8BITMIME\r\nRCPT TO:<x>"]),
                               {}),
    "rcpt_options int": ("rcpt_options", lambda: message(rcpt_options=[1]), {}),
    "msgId int": ("msgId", lambda: message(msgId=1), {}),
    "msgId malformed": ("msgId", lambda: message(msgId="no-angle-brackets"), {}),
    "send(msg=str)": ("msg", lambda: "not a Message", {}),
    "send(key=int)": ("key", message, {"key": 1}),
    "send(key='')": ("key", message, {"key": ""}),
    "send(idempotency_key too long)": ("idempotency_key", message,
                                       {"idempotency_key": "k" * 300}),
    "send(idempotency_key with NUL)": ("idempotency_key", message,
                                       {"idempotency_key": "k\0"}),
    "send(send_after=str)": ("send_after", message, {"send_after": "tomorrow"}),
}

SEND_CASES = {**ADDRESS_CASES, **INJECTION_CASES, **SIZE_AND_DATA_CASES, **TYPE_CASES}


@pytest.mark.parametrize(("field", "make", "options"), list(SEND_CASES.values()),
                         ids=list(SEND_CASES))
def test_send_refuses_bad_input_naming_the_field_and_writes_nothing(
        bad_app: Flask, field: str, make: Callable[[], Any], options: dict[str, Any]) -> None:
    mail: OutboxMail = bad_app.extensions["test_mail"]
    before = snapshot(bad_app)
    with bad_app.app_context():
        with pytest.raises(InvalidMessage) as excinfo:
            mail.send(make(), **options)
        db.session.commit()  # whatever the session holds now is written
    assert excinfo.value.field == field, str(excinfo.value)
    assert str(excinfo.value).startswith(f"{field}: ")
    assert snapshot(bad_app) == before


def test_the_bad_input_check_can_see_a_write(bad_app: Flask) -> None:
    """The control: the same check sees a valid message written, and only once committed."""
    mail: OutboxMail = bad_app.extensions["test_mail"]
    before = snapshot(bad_app)
    with bad_app.app_context():
        mail.send(message(recipients=["a@bücher.example"]))  # a valid IDN
        db.session.flush()
        assert snapshot(bad_app) == before  # flushed, not committed
        db.session.commit()
        assert mail.wait_idle(10)
    after = snapshot(bad_app)
    assert len(after["outbox_email"]) == len(before["outbox_email"]) + 1


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #

# A bad value for every key the library reads (at least one each).
CONFIG_CASES: list[tuple[str, Any]] = [
    ("MAIL_SERVER", ""),
    ("MAIL_SERVER", 25),
    ("MAIL_PORT", 0),
    ("MAIL_PORT", 70000),
    ("MAIL_PORT", "smtp"),
    ("MAIL_USE_TLS", "maybe"),
    ("MAIL_USE_SSL", 2),
    ("MAIL_USERNAME", ""),
    ("MAIL_USERNAME", 42),
    ("MAIL_PASSWORD", ""),
    ("MAIL_PASSWORD", 1234),
    ("MAIL_DEFAULT_SENDER", 42),
    ("MAIL_DEFAULT_SENDER", ("only-one",)),
    ("MAIL_SUPPRESS_SEND", "sometimes"),
    ("MAIL_ASCII_ATTACHMENTS", "ascii"),
    ("MAIL_TIMEOUT", 0),
    ("MAIL_TIMEOUT", "soon"),
    ("OUTBOX_TRANSPORT", ""),
    ("OUTBOX_TRANSPORT", "carrier-pigeon"),
    ("OUTBOX_TRANSPORT", "no_such_module_x:Thing"),
    ("OUTBOX_TRANSPORT", "pathlib:PurePath"),
    ("OUTBOX_FILE_PATH", ""),
    ("OUTBOX_FILE_PATH", 3),
    ("OUTBOX_DURABLE", "maybe"),
    ("OUTBOX_MAX_ATTEMPTS", 0),
    ("OUTBOX_MAX_ATTEMPTS", 2.5),
    ("OUTBOX_INLINE_RETRIES", -1),
    ("OUTBOX_RETRY_BASE_SECONDS", -1),
    ("OUTBOX_RETRY_MAX_SECONDS", 1),  # below the default base (60)
    ("OUTBOX_MAX_THROTTLE_DEFERRALS", -1),
    ("OUTBOX_MAX_THROTTLE_DEFERRALS", 1.5),
    ("OUTBOX_AMBIGUOUS_RETRIES", -1),
    ("OUTBOX_AMBIGUOUS_RETRIES", "once"),
    ("OUTBOX_LEASE_SECONDS", 0.5),
    ("OUTBOX_BATCH_SIZE", 0),
    ("OUTBOX_POLL_INTERVAL", 0),
    ("OUTBOX_POLL_MAX_INTERVAL", 0.1),  # below the interval (0.5)
    ("OUTBOX_LISTEN", 2),
    ("OUTBOX_LISTEN_URL", ""),
    ("OUTBOX_LISTEN_BACKSTOP_SECONDS", 0),
    ("OUTBOX_PAUSE_PROBE_SECONDS", 0),
    ("OUTBOX_PAUSE_PROBE_MAX_SECONDS", 1),  # below the probe's first delay (30)
    ("OUTBOX_MAX_QUEUE_LIFETIME_SECONDS", -1),
    ("OUTBOX_MAX_QUEUE_LIFETIME_SECONDS", "5 days"),
    ("OUTBOX_SOFT_BOUNCE_LIMIT", -1),
    ("OUTBOX_SOFT_BOUNCE_LIMIT", 1.5),
    ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", "a week"),
    ("OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS", 4000),  # past the most a database time holds here
    ("OUTBOX_RUN_WORKER", "both"),
    ("OUTBOX_RATE_LIMIT", 0),
    ("OUTBOX_RATE_LIMIT", float("inf")),
    ("OUTBOX_TRANSPORTS", "bulk"),  # a dict of name -> settings is expected
    ("OUTBOX_TRANSPORTS", 7),
    ("OUTBOX_SWEEP_ON_STARTUP", "later"),
    ("OUTBOX_SWEEP_MIN_AGE_SECONDS", -5),
    ("OUTBOX_SWEEP_BATCH", 0),
    ("OUTBOX_CONCURRENCY", 0),
    ("OUTBOX_CONCURRENCY", 257),
    ("OUTBOX_SWEEP_INTERVAL_SECONDS", 0),
    ("OUTBOX_SETTINGS_TTL_SECONDS", -1),
    ("OUTBOX_MAX_MESSAGE_BYTES", 0),
    ("OUTBOX_MAX_MESSAGE_BYTES", True),
    ("OUTBOX_ALLOW_LOCAL_ADDRESSES", "yes please"),
    ("OUTBOX_MESSAGE_ID_DOMAIN", "a b"),
    ("OUTBOX_MESSAGE_ID_DOMAIN", "x@y"),
    ("OUTBOX_TLS_VERIFY", "strict"),
    ("OUTBOX_TLS_CA_FILE", ""),
    ("OUTBOX_RETENTION_DAYS", 0),
    ("OUTBOX_SCRUB_SENT", "all"),
    ("OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS", float("nan")),
    ("OUTBOX_RUN_SCHEDULER", "no thanks"),
    ("OUTBOX_HTML_TO_TEXT", "sometimes"),
    ("OUTBOX_TEMPLATE_FOLDER", ""),
    ("OUTBOX_TEMPLATE_FOLDER", "email/../secrets"),
    ("OUTBOX_TEMPLATE_FOLDER", 3),
    ("OUTBOX_TEMPLATE_INLINE_CSS", "sometimes"),
    ("OUTBOX_TEMPLATE_LOCALES", "de"),
    ("OUTBOX_TEMPLATE_LOCALES", ()),
    ("OUTBOX_TEMPLATE_LOCALES", ("de", 5)),
    ("OUTBOX_TEMPLATE_MAX_SUBJECT", 0),
    ("OUTBOX_ALLOW_SMTPUTF8", "utf-8"),
    ("OUTBOX_DKIM_DOMAIN", ""),
    ("OUTBOX_DKIM_SELECTOR", 7),
    ("OUTBOX_DKIM_PRIVATE_KEY", ""),
    ("OUTBOX_DKIM_PRIVATE_KEY_FILE", "/nonexistent/dkim.pem"),
    ("OUTBOX_DKIM_HEADERS", "From"),  # a list is expected
    ("OUTBOX_DKIM_KEYS", "rsa2026"),  # a list of {"selector", "private_key"} is expected
    ("OUTBOX_WEBHOOK_PREFIX", "outbox/webhooks"),
    ("OUTBOX_WEBHOOK_PREFIX", "/a?b"),
    ("OUTBOX_UNSUBSCRIBE_URL", "http://app.example.com/u"),
    ("OUTBOX_UNSUBSCRIBE_URL", 5),
    ("OUTBOX_BOUNCE_ADDRESS", "not an address"),
    ("OUTBOX_BOUNCE_ADDRESS", "b+x@example.com"),
    ("OUTBOX_REDIRECT_TO", "qa@example.com"),  # a list is expected
    ("OUTBOX_REDIRECT_TO", []),
    ("OUTBOX_REDIRECT_TO", ["not an address"]),
    ("OUTBOX_REDIRECT_TO", ["QA <qa@example.com>"]),  # bare addresses only
    ("OUTBOX_REDIRECT_TO", ("qa@other.org",)),  # outside the allow-list below
    ("OUTBOX_ALLOWED_RECIPIENTS", "*@example.com"),  # a list is expected
    ("OUTBOX_ALLOWED_RECIPIENTS", []),
    ("OUTBOX_ALLOWED_RECIPIENTS", ["*.example.com"]),
    ("OUTBOX_ALLOWED_RECIPIENTS", ["qa*@example.com"]),
    ("OUTBOX_ALLOWED_RECIPIENTS", ["*@not a domain"]),
    ("OUTBOX_ALLOWED_RECIPIENTS", [42]),
    ("OUTBOX_OTEL", True),  # a dict is expected
    ("OUTBOX_EXECUTOR", "huey"),
    ("OUTBOX_EXECUTOR", None),
    ("OUTBOX_EXECUTOR_QUEUE", ""),
    ("OUTBOX_EXECUTOR_QUEUE", " outbox"),
    ("OUTBOX_EXECUTOR_QUEUE", 5),
    ("OUTBOX_EXECUTOR_URL", 5),
    ("OUTBOX_OTEL", {"enabled": "yes"}),
    ("OUTBOX_OTEL", {"link": "parent"}),
    ("OUTBOX_OTEL", {"recipient_domain": 1}),
    ("OUTBOX_OTEL", {"tracer_provider": "jaeger"}),
    ("OUTBOX_OTEL", {"sample": 0.1}),  # unknown key
    ("OUTBOX_OTEL", {"metrics": "on"}),
    ("OUTBOX_OTEL", {"meter_provider": "prometheus"}),
    ("OUTBOX_INLINE_RETRY", 3),  # unknown key, with a suggestion
    ("MAIL_USE_TLS", True),  # with MAIL_USE_SSL below: exclusive
    ("SQLALCHEMY_DATABASE_URI", "sqlite://"),
]
_TOGETHER: dict[tuple[str, Any], dict[str, Any]] = {
    ("MAIL_USE_TLS", True): {"MAIL_USE_SSL": True},
    ("OUTBOX_REDIRECT_TO", ("qa@other.org",)): {"OUTBOX_ALLOWED_RECIPIENTS": ["*@example.com"]},
}


def test_every_key_the_library_reads_has_a_bad_value_case() -> None:
    from flask_mail_outbox.core._config import _DEFAULTS

    covered = {key for key, _ in CONFIG_CASES}
    assert set(_DEFAULTS) <= covered | {"MAIL_SUPPRESS_SEND"}, set(_DEFAULTS) - covered


@pytest.mark.parametrize(("key", "value"), CONFIG_CASES,
                         ids=[f"{k}={v!r}" for k, v in CONFIG_CASES])
def test_bad_config_fails_at_init_naming_the_key_and_creates_nothing(
        tmp_path: Path, key: str, value: Any) -> None:
    database = tmp_path / "app.db"
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{database}"
    app.config[key] = value
    app.config.update(next((extra for (k, v), extra in _TOGETHER.items()
                            if (k, v) == (key, value)), {}))
    sqlalchemy = SQLAlchemy(app)
    with pytest.raises(ConfigError) as excinfo:
        OutboxMail(app)
    assert excinfo.value.key == key
    assert str(excinfo.value).startswith(f"{key}: ")
    assert "mail_outbox" not in app.extensions
    assert "outbox" not in app.cli.commands
    with app.app_context():
        tables = sa.inspect(sqlalchemy.engine).get_table_names()
        sqlalchemy.engine.dispose()
    assert tables == []


# --------------------------------------------------------------------------- #
# The CLI
# --------------------------------------------------------------------------- #

# (arguments, exit code, text the output must contain)
CLI_CASES: list[tuple[list[str], int, str]] = [
    (["dlq", "retry", "999999"], 1, "not dead letters: 999999"),
    (["dlq", "retry", "0"], 2, "'0' is not an email id: give the ids as whole numbers from 1"),
    (["dlq", "retry", "99999999999999999999999"], 2,
     "'99999999999999999999999' is not an email id"),
    (["dlq", "retry", "-3"], 2, "No such option '-3'"),
    (["dlq", "retry", "abc"], 2, "'abc' is not an email id: give the ids as whole numbers"),
    (["dlq", "retry"], 2, "give dead-letter ids, or --all"),
    (["dlq", "retry", "1", "--all"], 2, "give dead-letter ids, or --all"),
    (["dlq", "list", "--limit", "0"], 2, "--limit"),
    (["dlq", "purge", "--older-than", "-1", "--yes"], 2, "--older-than"),
    (["dlq", "frobnicate"], 2, "No such command 'frobnicate'"),
    (["send-test"], 2, "Missing option '--to'"),
    (["send-test", "--to", "not-an-address"], 2, "recipients[0]"),
    (["send-test", "--to", "a@example.com\r\nBcc: x@example.com"], 2, "CR, LF or NUL"),
    (["send-test", "--to", "a@example.com", "--subject", "x\nBcc: y@example.com"], 2,
     "Invalid value for --subject: subject: contains a CR, LF or NUL"),
    (["send-test", "--to", "a@example.com", "--timeout", "-1"], 2, "--timeout"),
    (["sweep", "--limit", "0"], 2, "--limit"),
    (["sweep", "--min-age", "-1"], 2, "--min-age"),
    (["purge"], 2, "Missing option '--older-than'"),
    (["purge", "--older-than", "0", "--yes"], 2, "--older-than"),
    (["purge", "--older-than", "soon", "--yes"], 2, "'soon' is not a valid float"),
    (["purge", "--older-than", "1", "--batch", "0", "--yes"], 2, "--batch"),
    (["worker", "--concurrency", "0"], 2, "--concurrency"),
    (["worker", "--shutdown-timeout", "-1"], 2, "--shutdown-timeout"),
    (["durable", "maybe"], 2, "'maybe' is not one of 'on', 'off', 'status'"),
    (["status", "--yaml"], 2, "No such option '--yaml'"),
]


@pytest.mark.parametrize(("args", "code", "text"), CLI_CASES,
                         ids=[" ".join(a) for a, _, _ in CLI_CASES])
def test_cli_refuses_bad_input_with_a_clear_message_and_changes_nothing(
        bad_app: Flask, args: list[str], code: int, text: str) -> None:
    before = snapshot(bad_app)
    result = bad_app.test_cli_runner().invoke(args=["outbox", *args])
    assert result.exit_code == code, result.output
    assert text in result.output
    assert "Traceback" not in result.output
    assert snapshot(bad_app) == before


def test_cli_retry_of_a_row_that_is_not_a_dead_letter(bad_app: Flask) -> None:
    """The stored (sent) email is not a dead letter: refused, and left as it is."""
    before = snapshot(bad_app)
    existing = before["outbox_email"][0]
    result = bad_app.test_cli_runner().invoke(args=["outbox", "dlq", "retry",
                                                    str(existing[0])])
    assert result.exit_code == 1
    assert f"not dead letters: {existing[0]}" in result.output
    assert snapshot(bad_app) == before

