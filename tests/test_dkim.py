"""DKIM signing at delivery: verified with dkimpy against the public key, no network.

The public key is served by a DNS stub (dkimpy's ``verify(..., dnsfunc=...)``);
the keys are made with the ``openssl`` command line tool, which the SMTP test
server needs too. The signer's own matrix (every shape of message, every
kind of key, relaxed and simple) is tests/test_dkim_sign.py; here is the app:
the configuration, the keys it refuses, and what each transport delivers.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from email.parser import BytesParser
from email.policy import default as default_policy
from pathlib import Path
from typing import Any

import dkim
import pytest
import sqlalchemy as sa
from conftest import close_app, db, hand_ticked_worker, make_app, rows, wait_rows
from flask import Flask
from smtpserver import FaultSMTPServer

from flask_mail_outbox import ConfigError, Message, OutboxMail
from flask_mail_outbox.core import email_table
from flask_mail_outbox.transports import MemoryTransport

DOMAIN = "example.com"
SELECTOR = "outbox2026"


def _openssl(*args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["openssl", *args], input=data, check=True,
                          capture_output=True).stdout


@pytest.fixture(scope="module")
def key_pair() -> tuple[str, bytes]:
    """A 2048-bit RSA key: (private PEM text, the DNS record's p= value)."""
    private = _openssl("genrsa", "2048")
    public_der = _openssl("pkey", "-pubout", "-outform", "DER", data=private)
    return private.decode("ascii"), base64.b64encode(public_der)


@pytest.fixture(scope="module")
def ed25519_pair() -> tuple[str, bytes]:
    """An Ed25519 key (RFC 8463): (private PEM text, the DNS record's p= value)."""
    private = _openssl("genpkey", "-algorithm", "ed25519")
    # The DER SubjectPublicKeyInfo ends with the 32 bytes of the key, which p= holds.
    raw = _openssl("pkey", "-pubout", "-outform", "DER", data=private)[-32:]
    return private.decode("ascii"), base64.b64encode(raw)


def dns_stub(public: bytes) -> Any:
    """A dnsfunc that answers only our selector's TXT record, an RSA key."""
    return dns_records({SELECTOR: b"v=DKIM1; k=rsa; p=" + public})


def dns_records(records: Mapping[str, bytes]) -> Any:
    """A dnsfunc that answers ``<selector>._domainkey.example.com`` with ``records[selector]``."""
    asked: list[bytes] = []

    def dnsfunc(name: bytes, timeout: int = 5) -> bytes | None:
        asked.append(name)
        for selector, record in records.items():
            if name.rstrip(b".") == f"{selector}._domainkey.{DOMAIN}".encode():
                return record
        return None

    dnsfunc.asked = asked  # type: ignore[attr-defined]
    return dnsfunc


def verifies(data: bytes, public: bytes) -> bool:
    """Whether dkimpy verifies ``data``'s signature against ``public`` (no network)."""
    return bool(dkim.verify(data, dnsfunc=dns_stub(public)))


def verifies_at(data: bytes, records: Mapping[str, bytes], index: int) -> bool:
    """Whether dkimpy verifies the ``index``-th DKIM-Signature of ``data``."""
    try:
        return bool(dkim.DKIM(data).verify(idx=index, dnsfunc=dns_records(records)))
    except dkim.DKIMException:  # a body hash mismatch is raised, not returned
        return False


def signature_tags(data: bytes) -> dict[str, str]:
    """The tags of the message's DKIM-Signature header."""
    parsed = BytesParser(policy=default_policy).parsebytes(data, headersonly=True)
    [header] = parsed.get_all("DKIM-Signature")
    value = re.sub(r"\s+", "", str(header))
    return dict(tag.split("=", 1) for tag in value.split(";") if tag)


def dkim_config(private: str, **extra: Any) -> dict[str, Any]:
    return {"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_SELECTOR": SELECTOR,
            "OUTBOX_DKIM_PRIVATE_KEY": private, **extra}


@pytest.fixture
def dkim_app(db_url: str, smtp_server: FaultSMTPServer,
             key_pair: tuple[str, bytes]) -> Iterator[Flask]:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   **dkim_config(key_pair[0]))
    yield app
    close_app(app, timeout=5)


def _send(app: Flask, **fields: Any) -> int:
    mail: OutboxMail = app.extensions["test_mail"]
    with app.app_context():
        fields.setdefault("recipients", ["to@example.org"])
        fields.setdefault("body", "Hello, signed world.\n")
        email_id = mail.send(Message(fields.pop("subject", "Signed"), **fields))
        db.session.commit()
    return email_id


# --------------------------------------------------------------------------- #
# Over SMTP
# --------------------------------------------------------------------------- #


def test_smtp_delivery_is_signed_and_verifies(dkim_app: Flask, smtp_server: FaultSMTPServer,
                                              key_pair: tuple[str, bytes]) -> None:
    _send(dkim_app, cc=["cc@example.org"], html="<p>Hello</p>")
    assert smtp_server.wait_for(1)
    data = smtp_server.messages[0].data
    stub = dns_stub(key_pair[1])
    assert dkim.verify(data, dnsfunc=stub)
    assert stub.asked == [f"{SELECTOR}._domainkey.{DOMAIN}.".encode()]
    tags = signature_tags(data)
    assert (tags["d"], tags["s"], tags["a"], tags["c"]) == (DOMAIN, SELECTOR, "rsa-sha256",
                                                            "relaxed/relaxed")
    # The default list, only the headers present: no Reply-To, no List-Unsubscribe.
    assert tags["h"].split(":") == ["from", "from", "to", "cc", "subject", "date", "message-id",
                                    "mime-version", "content-type"]
    # The stored bytes stay what send() validated: signing happens on the way out.
    [row] = wait_rows(dkim_app, lambda r: r[0]["status"] == "sent", timeout=10)
    assert b"DKIM-Signature" not in row["mime"]
    assert data.endswith(row["mime"])


def test_a_retried_email_is_signed_on_the_attempt_that_delivers(
        dkim_app: Flask, smtp_server: FaultSMTPServer, key_pair: tuple[str, bytes]) -> None:
    smtp_server.reply("data", 451, "4.3.0 Try again", times=1)
    _send(dkim_app)
    assert smtp_server.wait_for(1, timeout=20)
    [row] = wait_rows(dkim_app, lambda r: r[0]["status"] == "sent", timeout=15)
    assert row["attempts"] == 2
    assert [h["code"] for h in json.loads(row["error_history"])] == [451]
    data = smtp_server.messages[0].data
    assert verifies(data, key_pair[1])
    # Signed afresh from the stored row, not a signature on top of the last one.
    assert data.count(b"DKIM-Signature:") == 1
    assert b"DKIM-Signature" not in row["mime"]


def test_a_tampered_message_fails_verification(dkim_app: Flask, smtp_server: FaultSMTPServer,
                                               key_pair: tuple[str, bytes]) -> None:
    _send(dkim_app, subject="Invoice 42", body="Pay 10 EUR to the usual account.\n")
    assert smtp_server.wait_for(1)
    data = smtp_server.messages[0].data
    assert verifies(data, key_pair[1])
    assert b"Pay 10 EUR" in data and b"Subject: Invoice 42" in data
    assert not verifies(data.replace(b"Pay 10 EUR", b"Pay 99 EUR"), key_pair[1])
    assert not verifies(data.replace(b"Subject: Invoice 42", b"Subject: Invoice 43"),
                        key_pair[1])
    # Another key's public half does not verify it either.
    other = base64.b64encode(_openssl("pkey", "-pubout", "-outform", "DER",
                                      data=_openssl("genrsa", "2048")))
    assert not verifies(data, other)


def _key_set(kind: str, rsa_pair: tuple[str, bytes], ed_pair: tuple[str, bytes],
             tmp_path: Path) -> tuple[dict[str, Any], dict[str, bytes], list[str]]:
    """The config of ``kind``, its DNS records by selector, and the a= of each signature."""
    rsa_record = b"v=DKIM1; k=rsa; p=" + rsa_pair[1]
    ed_record = b"v=DKIM1; k=ed25519; p=" + ed_pair[1]
    if kind == "ed25519":
        return dkim_config(ed_pair[0]), {SELECTOR: ed_record}, ["ed25519-sha256"]
    # Dual: RSA first (every receiver knows it), Ed25519 from a file.
    key_file = tmp_path / "ed25519.pem"
    key_file.write_text(ed_pair[0])
    config = {"OUTBOX_DKIM_DOMAIN": DOMAIN,
              "OUTBOX_DKIM_KEYS": [{"selector": "rsa2026", "private_key": rsa_pair[0]},
                                   {"selector": "ed2026", "private_key_file": str(key_file)}]}
    return config, {"rsa2026": rsa_record, "ed2026": ed_record}, ["rsa-sha256", "ed25519-sha256"]


@pytest.mark.parametrize("kind", ["ed25519", "dual"])
def test_smtp_delivery_signed_with_ed25519_or_both_verifies(
        db_url: str, smtp_server: FaultSMTPServer, key_pair: tuple[str, bytes],
        ed25519_pair: tuple[str, bytes], tmp_path: Path, kind: str) -> None:
    config, records, algorithms = _key_set(kind, key_pair, ed25519_pair, tmp_path)
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port, **config)
    try:
        _send(app, subject="Invoice 42", body="Pay 10 EUR to the usual account.\n",
              html="<p>Hello</p>")
        assert smtp_server.wait_for(1)
        data = smtp_server.messages[0].data
        assert b"Pay 10 EUR" in data and b"Subject: Invoice 42" in data
        parsed = BytesParser(policy=default_policy).parsebytes(data, headersonly=True)
        found = [dict(tag.split("=", 1) for tag in re.sub(r"\s+", "", str(h)).split(";") if tag)
                 for h in parsed.get_all("DKIM-Signature")]
        assert [t["a"] for t in found] == algorithms
        assert [t["s"] for t in found] == list(records)
        for index in range(len(algorithms)):
            assert verifies_at(data, records, index)
            assert not verifies_at(data.replace(b"Subject: Invoice 42", b"Subject: Invoice 43"),
                                   records, index)
            assert not verifies_at(data.replace(b"Pay 10 EUR", b"Pay 99 EUR"), records, index)
        assert all("l" not in t for t in found)
    finally:
        close_app(app, timeout=5)


def test_configured_headers_are_signed_when_present(
        db_url: str, smtp_server: FaultSMTPServer, key_pair: tuple[str, bytes]) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   **dkim_config(key_pair[0], OUTBOX_DKIM_HEADERS=["Subject", "X-Campaign",
                                                                  "Reply-To"]))
    try:
        _send(app, extra_headers={"X-Campaign": "spring"})
        assert smtp_server.wait_for(1)
        data = smtp_server.messages[0].data
        assert verifies(data, key_pair[1])
        # From first (always signed), the rest in the configured order, Reply-To absent.
        assert signature_tags(data)["h"].split(":") == ["from", "from", "subject", "x-campaign"]
        assert not verifies(data.replace(b"X-Campaign: spring", b"X-Campaign: autumn"),
                            key_pair[1])
    finally:
        close_app(app, timeout=5)


def test_no_signature_without_dkim_settings(app: Flask, smtp_server: FaultSMTPServer) -> None:
    _send(app)
    assert smtp_server.wait_for(1)
    assert b"DKIM-Signature" not in smtp_server.messages[0].data


# --------------------------------------------------------------------------- #
# Transports without a server get the signed bytes too
# --------------------------------------------------------------------------- #


def test_memory_transport_gets_the_signed_bytes(
        db_url: str, key_pair: tuple[str, bytes]) -> None:
    app = make_app(db_url, TESTING=True, **dkim_config(key_pair[0]))
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context(), mail.record_messages() as recorded:
            mail.send(Message("Test", recipients=["to@example.org"], body="x"))
            db.session.commit()
        transport = app.extensions["mail_outbox"].outbox().delivery.transport
        assert isinstance(transport, MemoryTransport)
        [envelope] = transport.outbox
        assert verifies(envelope.mime, key_pair[1])
        # record_messages() yields the message as send() stored it, unsigned.
        assert recorded[0].subject == "Test" and b"DKIM-Signature" not in recorded[0].mime
        assert envelope.mime.endswith(recorded[0].mime)
    finally:
        close_app(app, timeout=5)


def test_console_transport_prints_the_signed_message(
        db_url: str, key_pair: tuple[str, bytes], capsys: pytest.CaptureFixture[str]) -> None:
    app = make_app(db_url, OUTBOX_TRANSPORT="console", **dkim_config(key_pair[0]))
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        _send(app)
        with app.app_context():
            assert mail.wait_idle(10)
        printed = capsys.readouterr().out
        start = printed.index("DKIM-Signature: ")
        end = printed.index("---------- end of email")
        data = printed[start:end].rstrip("\n").replace("\n", "\r\n").encode() + b"\r\n"
        assert verifies(data, key_pair[1])
    finally:
        close_app(app, timeout=5)


def test_file_transport_writes_the_signed_bytes(
        db_url: str, tmp_path: Path, key_pair: tuple[str, bytes]) -> None:
    folder = tmp_path / "mail"
    app = make_app(db_url, OUTBOX_TRANSPORT="file", OUTBOX_FILE_PATH=str(folder),
                   **dkim_config(key_pair[0]))
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        _send(app)
        with app.app_context():
            assert mail.wait_idle(10)
        [written] = list(folder.glob("*.eml"))
        assert verifies(written.read_bytes(), key_pair[1])
    finally:
        close_app(app, timeout=5)


# --------------------------------------------------------------------------- #
# A message that cannot be signed at delivery
# --------------------------------------------------------------------------- #


def test_a_message_that_cannot_be_signed_goes_out_unsigned_and_is_reported(
        db_url: str, smtp_server: FaultSMTPServer, key_pair: tuple[str, bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(db_url, MAIL_SERVER=smtp_server.host, MAIL_PORT=smtp_server.port,
                   OUTBOX_DURABLE=True, OUTBOX_RUN_WORKER=False, OUTBOX_LISTEN=False,
                   **dkim_config(key_pair[0]))
    try:
        worker = hand_ticked_worker(app)
        first = _send(app, subject="unsignable")
        second = _send(app, subject="fine")
        # A stored row dkimpy cannot parse (the probe at init_app passed: the
        # key is fine, this message is not).
        [row] = [r for r in rows(app) if r["id"] == first]
        broken = row["mime"].replace(b"\r\nMIME-Version:", b"\r\nnot a header line\r\nMIME-Version:",
                                    1)
        with app.app_context(), db.engine.begin() as conn:
            conn.execute(sa.update(email_table).where(email_table.c.id == first)
                         .values(mime=broken))
        caplog.set_level(logging.INFO, logger="flask_mail_outbox")
        worker.tick()
        assert smtp_server.wait_for(2)
        ids = {r["id"]: r["message_id"] for r in rows(app)}
        by_id = {m.message_id: m.data for m in smtp_server.messages}
        assert b"DKIM-Signature" not in by_id[ids[first]]
        assert b"not a header line" in by_id[ids[first]]
        assert verifies(by_id[ids[second]], key_pair[1])
        assert {r["status"] for r in wait_rows(
            app, lambda rs: all(r["status"] == "sent" for r in rs), timeout=10)} == {"sent"}
        [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        text = error.getMessage()
        assert f"Email {first} could not be DKIM-signed for {DOMAIN}" in text
        assert "sends it without a DKIM signature" in text and "Fix: check OUTBOX_DKIM_" in text
    finally:
        close_app(app, timeout=5)


# --------------------------------------------------------------------------- #
# A key that cannot sign fails at init_app, naming its key
# --------------------------------------------------------------------------- #


def _init(tmp_path: Path, **config: Any) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'app.db'}"
    app.config.update(config)
    from flask_sqlalchemy import SQLAlchemy

    SQLAlchemy(app)
    OutboxMail(app)


#: The issue's key (#29): PEM armour around text that is not base64.
BAD_BASE64 = "-----BEGIN RSA PRIVATE KEY-----\nnot a key\n-----END RSA PRIVATE KEY-----"


def _bad_key_cases(tmp_path: Path, private: str) -> dict[str, tuple[dict[str, Any], str, str]]:
    public_pem = _openssl("pkey", "-pubout", data=private.encode()).decode()
    short = _openssl("genrsa", "512").decode()
    pkcs8_encrypted = _openssl("pkey", "-aes256", "-passout", "pass:secret",
                               data=private.encode()).decode()
    pem_encrypted = _openssl("rsa", "-aes256", "-traditional", "-passout", "pass:secret",
                             data=private.encode()).decode()
    ec_key = _openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout").decode()
    ed448_key = _openssl("genpkey", "-algorithm", "ed448").decode()
    pkcs8_ec_key = _openssl("genpkey", "-algorithm", "EC", "-pkeyopt",
                            "ec_paramgen_curve:P-256").decode()
    # PEM armour and valid base64 around bytes that are no key (DER cut short).
    cut_der = _openssl("pkey", "-outform", "DER", data=private.encode())[:300]
    damaged = ("-----BEGIN PRIVATE KEY-----\n" + base64.encodebytes(cut_der).decode()
               + "-----END PRIVATE KEY-----\n")
    certificate = _openssl("req", "-x509", "-key", "/dev/stdin", "-subj", "/CN=dkim",
                           "-days", "1", data=private.encode()).decode()
    not_a_key = tmp_path / "not-a-key.pem"
    not_a_key.write_text("hello\n")
    bad_base64_file = tmp_path / "bad-base64.pem"
    bad_base64_file.write_text(BAD_BASE64 + "\n")
    encrypted_file = tmp_path / "encrypted.pem"
    encrypted_file.write_text(pkcs8_encrypted)
    base = {"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_SELECTOR": SELECTOR}

    def keys(*entries: Any) -> dict[str, Any]:
        value = entries[0] if entries and isinstance(entries[0], str) else list(entries)
        return {"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_KEYS": value}

    text, file = "OUTBOX_DKIM_PRIVATE_KEY", "OUTBOX_DKIM_PRIVATE_KEY_FILE"
    return {
        "unreadable file": ({**base, file: str(tmp_path / "none.pem")}, file, "cannot read"),
        "file is a folder": ({**base, file: str(tmp_path)}, file, "cannot read"),
        "file holds no key": ({**base, file: str(not_a_key)}, file, "no PEM block"),
        "file with bad base64": ({**base, file: str(bad_base64_file)}, file,
                                 "not valid base64"),
        "encrypted file": ({**base, file: str(encrypted_file)}, file, "encrypted"),
        "bad base64": ({**base, text: BAD_BASE64}, text, "not valid base64"),
        "not PEM text": ({**base, text: "hello"}, text, "no PEM block"),
        "a path as the key": ({**base, text: "/run/secrets/dkim.pem"}, text,
                              "set OUTBOX_DKIM_PRIVATE_KEY_FILE"),
        "encrypted PKCS#8": ({**base, text: pkcs8_encrypted}, text, "encrypted"),
        "encrypted PKCS#1": ({**base, text: pem_encrypted}, text, "encrypted"),
        "an EC key": ({**base, text: ec_key}, text, "an EC key, not an RSA or Ed25519 key"),
        "a PKCS#8 EC key": ({**base, text: pkcs8_ec_key}, text,
                            "an EC key, not an RSA or Ed25519 key"),
        "an Ed448 key": ({**base, text: ed448_key}, text, "an Ed448 key, not an RSA or Ed25519"),
        "a damaged key": ({**base, text: damaged}, text, "damaged (cut or changed"),
        "a certificate": ({**base, text: certificate}, text, "a certificate"),
        "a public key": ({**base, text: public_pem}, text, "the public key"),
        "a short key": ({**base, text: short}, text, "512 bits"),
        "empty key": ({**base, text: ""}, text, "expected the PEM text"),
        "domain, no key": (base, text, "needs a private key"),
        "key, no domain": ({"OUTBOX_DKIM_SELECTOR": SELECTOR, text: private},
                           "OUTBOX_DKIM_DOMAIN", "needs OUTBOX_DKIM_DOMAIN"),
        "key, no selector": ({"OUTBOX_DKIM_DOMAIN": DOMAIN, text: private},
                             "OUTBOX_DKIM_SELECTOR", "OUTBOX_DKIM_SELECTOR too"),
        "key and file": ({**base, text: private, file: str(not_a_key)}, text, "not both"),
        "bcc signed": ({**base, text: private, "OUTBOX_DKIM_HEADERS": ["From", "Bcc"]},
                       "OUTBOX_DKIM_HEADERS", "must not be signed"),
        "headers as a string": ({**base, text: private, "OUTBOX_DKIM_HEADERS": "From"},
                                "OUTBOX_DKIM_HEADERS", "list of header names"),
        "a header with a colon": ({**base, text: private, "OUTBOX_DKIM_HEADERS": ["Subject:"]},
                                  "OUTBOX_DKIM_HEADERS", "not a header name"),
        "unicode domain": ({**base, "OUTBOX_DKIM_DOMAIN": "bücher.example", text: private},
                           "OUTBOX_DKIM_DOMAIN", "not an ASCII domain"),
        # OUTBOX_DKIM_KEYS: each entry's field is named.
        "keys as a string": (keys("rsa"), "OUTBOX_DKIM_KEYS", "non-empty list"),
        "no keys": (keys(), "OUTBOX_DKIM_KEYS", "non-empty list"),
        "a key entry not a dict": ({"OUTBOX_DKIM_DOMAIN": DOMAIN, "OUTBOX_DKIM_KEYS": ["rsa"]},
                                   "OUTBOX_DKIM_KEYS[0]", "expected a dict"),
        "an unknown entry field": (keys({"selector": "a", "private_key": private, "pem": 1}),
                                   'OUTBOX_DKIM_KEYS[0]["pem"]', "not a field of a DKIM key"),
        "an entry without selector": (keys({"private_key": private}),
                                      'OUTBOX_DKIM_KEYS[0]["selector"]', "expected the selector"),
        "an entry's bad selector": (keys({"selector": "a;b", "private_key": private}),
                                    'OUTBOX_DKIM_KEYS[0]["selector"]', "not an ASCII"),
        "two entries, one selector": (keys({"selector": "a", "private_key": private},
                                           {"selector": "a", "private_key": ed448_key}),
                                      'OUTBOX_DKIM_KEYS[1]["selector"]',
                                      "selector of OUTBOX_DKIM_KEYS[0] too"),
        "an entry without key": (keys({"selector": "a"}), 'OUTBOX_DKIM_KEYS[0]["private_key"]',
                                 "one of them"),
        "an entry with key and file": (keys({"selector": "a", "private_key": private,
                                             "private_key_file": str(not_a_key)}),
                                       'OUTBOX_DKIM_KEYS[0]["private_key"]', "one of them"),
        "an entry's bad base64": (keys({"selector": "a", "private_key": BAD_BASE64}),
                                  'OUTBOX_DKIM_KEYS[0]["private_key"]', "not valid base64"),
        "an entry's short key": (keys({"selector": "a", "private_key": private},
                                      {"selector": "b", "private_key": short}),
                                 'OUTBOX_DKIM_KEYS[1]["private_key"]', "512 bits"),
        "an entry's Ed448 key": (keys({"selector": "a", "private_key": ed448_key}),
                                 'OUTBOX_DKIM_KEYS[0]["private_key"]', "an Ed448 key"),
        "an entry's path as key": (keys({"selector": "a", "private_key": "/run/dkim.pem"}),
                                   'OUTBOX_DKIM_KEYS[0]["private_key"]',
                                   "set private_key_file to it"),
        "an entry's unreadable file": (keys({"selector": "a",
                                             "private_key_file": str(tmp_path / "none.pem")}),
                                       'OUTBOX_DKIM_KEYS[0]["private_key_file"]', "cannot read"),
        "an entry's encrypted file": (keys({"selector": "a",
                                            "private_key_file": str(encrypted_file)}),
                                      'OUTBOX_DKIM_KEYS[0]["private_key_file"]', "encrypted"),
        "keys and a key": ({**keys({"selector": "a", "private_key": private}), text: private},
                           "OUTBOX_DKIM_KEYS", "not both"),
        "keys and a selector": ({**keys({"selector": "a", "private_key": private}),
                                 "OUTBOX_DKIM_SELECTOR": SELECTOR},
                                "OUTBOX_DKIM_SELECTOR", "gives each key its selector"),
        "keys, no domain": ({"OUTBOX_DKIM_KEYS": [{"selector": "a", "private_key": private}]},
                            "OUTBOX_DKIM_DOMAIN", "OUTBOX_DKIM_DOMAIN too"),
    }


_CASE_NAMES = ["unreadable file", "file is a folder", "file holds no key",
               "file with bad base64", "encrypted file", "bad base64", "not PEM text",
               "a path as the key", "encrypted PKCS#8", "encrypted PKCS#1", "an EC key",
               "a PKCS#8 EC key", "an Ed448 key", "a damaged key", "a certificate",
               "a public key", "a short key", "empty key", "domain, no key", "key, no domain",
               "key, no selector", "key and file", "bcc signed", "headers as a string",
               "a header with a colon", "unicode domain", "keys as a string", "no keys",
               "a key entry not a dict", "an unknown entry field", "an entry without selector",
               "an entry's bad selector", "two entries, one selector", "an entry without key",
               "an entry with key and file", "an entry's bad base64", "an entry's short key",
               "an entry's Ed448 key", "an entry's path as key", "an entry's unreadable file",
               "an entry's encrypted file", "keys and a key", "keys and a selector",
               "keys, no domain"]


def _key_material(config: dict[str, Any]) -> list[str]:
    """The base64 lines of the PEM text or file a case configures: never to be echoed."""
    entries = config.get("OUTBOX_DKIM_KEYS")
    sources = [config] + [e for e in entries if isinstance(e, dict)] \
        if isinstance(entries, list) else [config]
    lines = []
    for source in sources:
        pem = source.get("OUTBOX_DKIM_PRIVATE_KEY") or source.get("private_key") or ""
        path = source.get("OUTBOX_DKIM_PRIVATE_KEY_FILE") or source.get("private_key_file")
        if path and Path(path).is_file():
            pem = Path(path).read_text()
        lines += [line for line in pem.splitlines()
                  if line and not line.startswith("-----") and ":" not in line]
    return lines


@pytest.mark.parametrize("case", _CASE_NAMES)
def test_a_key_that_cannot_sign_fails_at_init_app_naming_the_key(
        tmp_path: Path, key_pair: tuple[str, bytes], case: str) -> None:
    config, key, text = _bad_key_cases(tmp_path, key_pair[0])[case]
    with pytest.raises(ConfigError) as excinfo:
        _init(tmp_path, **config)
    assert excinfo.value.key == key
    assert text in str(excinfo.value)
    message = str(excinfo.value)
    assert "PRIVATE KEY-----" not in message  # a key is never echoed
    assert not [line for line in _key_material(config) if line[:16] in message]


def test_signing_needs_no_dkimpy(db_url: str, key_pair: tuple[str, bytes],
                                 ed25519_pair: tuple[str, bytes], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenSSL signs (``cryptography``, a main dependency): dkimpy is only the tests' verifier."""
    config, records, _ = _key_set("dual", key_pair, ed25519_pair, tmp_path)
    monkeypatch.setitem(sys.modules, "dkim", None)  # import dkim raises ImportError
    app = make_app(db_url, TESTING=True, **config)
    try:
        with app.app_context():
            app.extensions["test_mail"].send(Message("Test", recipients=["to@example.org"],
                                                     body="x"))
            db.session.commit()
        mime = app.extensions["mail_outbox"].outbox().delivery.transport.outbox[0].mime
    finally:
        close_app(app, timeout=5)
    monkeypatch.undo()
    assert verifies_at(mime, records, 0) and verifies_at(mime, records, 1)


def test_a_key_file_signs(db_url: str, tmp_path: Path, key_pair: tuple[str, bytes]) -> None:
    key_file = tmp_path / "dkim.pem"
    key_file.write_text(key_pair[0])
    app = make_app(db_url, TESTING=True, OUTBOX_DKIM_DOMAIN=DOMAIN,
                   OUTBOX_DKIM_SELECTOR=SELECTOR, OUTBOX_DKIM_PRIVATE_KEY_FILE=str(key_file))
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Test", recipients=["to@example.org"], body="x"))
            db.session.commit()
        transport = app.extensions["mail_outbox"].outbox().delivery.transport
        assert verifies(transport.outbox[0].mime, key_pair[1])
    finally:
        close_app(app, timeout=5)


@pytest.mark.parametrize("line_break", ["\r\n", "\\n", " "],
                         ids=["CRLF line endings", "escaped newlines", "spaces"])
def test_a_key_copied_with_other_line_breaks_signs(
        db_url: str, key_pair: tuple[str, bytes], line_break: str) -> None:
    """A key file saved on Windows, or a key put on one line of an .env file."""
    text = key_pair[0].strip().replace("\n", line_break)
    app = make_app(db_url, TESTING=True, **dkim_config(text))
    mail: OutboxMail = app.extensions["test_mail"]
    try:
        with app.app_context():
            mail.send(Message("Test", recipients=["to@example.org"], body="x"))
            db.session.commit()
        transport = app.extensions["mail_outbox"].outbox().delivery.transport
        assert verifies(transport.outbox[0].mime, key_pair[1])
    finally:
        close_app(app, timeout=5)
