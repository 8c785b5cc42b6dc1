"""The DKIM signer itself: every shape of message, every key, verified by dkimpy.

dkimpy is the independent verifier: our canonicalization (RFC 6376 3.4) and
signatures (rsa-sha256, ed25519-sha256 of RFC 8463) must agree with its own,
on relaxed and simple, long and folded headers, repeated headers, 8-bit
bodies, empty bodies, trailing blank lines and a body without its last CRLF.
The public keys are served by a DNS stub (``dnsfunc``), no network.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

import dkim
import dkim.canonicalization
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from hypothesis import given
from hypothesis import strategies as st

from flask_mail_outbox._compose.dkim import (
    DEFAULT_SIGNED_HEADERS,
    Canonicalization,
    DKIMKey,
    DKIMSigner,
    canonical_body,
    canonical_headers,
    header_fields,
)

DOMAIN = "example.com"
Keys = dict[str, Any]


@pytest.fixture(scope="module")
def keys() -> Keys:
    """One private key per kind, by selector name."""
    return {"rsa1024": rsa.generate_private_key(65537, 1024),
            "rsa2048": rsa.generate_private_key(65537, 2048),
            "rsa4096": rsa.generate_private_key(65537, 4096),
            "ed25519": ed25519.Ed25519PrivateKey.generate()}


def txt_record(key: Any) -> bytes:
    """The DNS TXT record publishing ``key``'s public half."""
    public = key.public_key()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return b"v=DKIM1; k=ed25519; p=" + base64.b64encode(raw)
    der = public.public_bytes(serialization.Encoding.DER,
                              serialization.PublicFormat.SubjectPublicKeyInfo)
    return b"v=DKIM1; k=rsa; p=" + base64.b64encode(der)


def dns(keys: Keys) -> Callable[..., bytes | None]:
    """A dnsfunc answering ``<selector>._domainkey.example.com`` for each key."""
    records = {f"{s}._domainkey.{DOMAIN}".encode(): txt_record(k) for s, k in keys.items()}

    def dnsfunc(name: bytes, timeout: int = 5) -> bytes | None:
        return records.get(name.rstrip(b"."))

    return dnsfunc


def signer(keys: Keys, selectors: list[str],
           canonicalization: tuple[Canonicalization, Canonicalization] = ("relaxed", "relaxed"),
           headers: tuple[str, ...] = DEFAULT_SIGNED_HEADERS) -> DKIMSigner:
    return DKIMSigner(domain=DOMAIN, keys=tuple(DKIMKey(s, keys[s], f"key {s}")
                                                for s in selectors),
                      headers=headers, canonicalization=canonicalization)


def verifies(data: bytes, keys: Keys, index: int = 0) -> bool:
    """Whether dkimpy verifies the ``index``-th DKIM-Signature of ``data``."""
    try:
        return bool(dkim.DKIM(data).verify(idx=index, dnsfunc=dns(keys)))
    except dkim.DKIMException:  # a body hash mismatch is raised, not returned
        return False


def signature_headers(data: bytes) -> list[str]:
    """The DKIM-Signature headers on top of ``data``, as written (folds and all)."""
    head = data.split(b"\r\n\r\n", 1)[0].decode("utf-8", "replace")
    fields = re.split(r"\r\n(?![ \t])", head)
    return [f for f in fields if f.lower().startswith("dkim-signature:")]


def tags(field: str) -> dict[str, str]:
    value = re.sub(r"\s+", "", field.split(":", 1)[1])
    return dict(tag.split("=", 1) for tag in value.split(";") if tag)


LONG_SUBJECT = "Your order " + " ".join(f"item-{i}" for i in range(40))

#: name -> the message as stored (CRLF lines); each must sign and verify.
MESSAGES: dict[str, bytes] = {
    "plain": (b"From: Shop <shop@example.com>\r\nTo: a@example.org\r\nSubject: Hello\r\n"
              b"Date: Thu, 03 Dec 2026 10:00:00 +0000\r\nMessage-ID: <1@example.com>\r\n"
              b"MIME-Version: 1.0\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n"
              b"Hello,\r\nyour order shipped.\r\n"),
    "long and folded headers": (
        b"From: shop@example.com\r\nTo: a@example.org,\r\n  b@example.org,\r\n\tc@example.org\r\n"
        b"Subject: " + LONG_SUBJECT.encode() + b"\r\n"
        b"Content-Type:   multipart/alternative;\r\n boundary=\"==abc==\"  \r\n"
        b"X-Spaces:  a   b\t\tc  \r\n\r\n--==abc==\r\n\r\ntext\r\n--==abc==--\r\n"),
    "repeated headers": (b"From: shop@example.com\r\nTo: a@example.org\r\nTo: b@example.org\r\n"
                         b"Subject: one\r\nsubject: two\r\n\r\nbody\r\n"),
    "8-bit body": ("From: shop@example.com\r\nSubject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\n"
                   "Content-Type: text/plain; charset=utf-8\r\n"
                   "Content-Transfer-Encoding: 8bit\r\n\r\nGrüße aus Köln, ½ € \t \r\n"
                   ).encode(),
    "empty body": b"From: shop@example.com\r\nSubject: empty\r\n\r\n",
    "trailing blank lines": b"From: shop@example.com\r\n\r\nbody\r\n\r\n \r\n\t\r\n\r\n",
    "no final CRLF": b"From: shop@example.com\r\nSubject: cut\r\n\r\nlast line",
    "white space in lines": b"From: shop@example.com\r\n\r\n  a  \t b \r\n\t\r\nc\r\n",
}

CANONICALIZATIONS: list[tuple[Canonicalization, Canonicalization]] = [
    ("relaxed", "relaxed"), ("simple", "simple"), ("relaxed", "simple"), ("simple", "relaxed")]
KINDS = {"rsa1024": ["rsa1024"], "rsa2048": ["rsa2048"], "rsa4096": ["rsa4096"],
         "ed25519": ["ed25519"], "dual rsa+ed25519": ["rsa2048", "ed25519"]}
HEADERS = ("From", "To", "Subject", "Date", "Message-ID", "MIME-Version", "Content-Type",
           "X-Spaces")


def tampered(data: bytes) -> list[bytes]:
    """``data`` changed in its signed From header, and in its body."""
    return [data.replace(b"\r\nFrom: ", b"\r\nFrom: x", 1), data + b"appended\r\n"]


def check_signed(data: bytes, keys: Keys, count: int) -> None:
    fields = signature_headers(data)
    assert len(fields) == count
    for index, field in enumerate(fields):
        assert verifies(data, keys, index)
        found = tags(field)
        assert "l" not in found  # never: it would let anyone append to the body
        assert "t" in found and found["d"] == DOMAIN
        assert all(len(line) <= 78 for line in field.split("\r\n"))
        for changed in tampered(data):
            assert not verifies(changed, keys, index)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", list(MESSAGES))
def test_every_key_signs_every_shape_of_message(keys: Keys, kind: str, shape: str) -> None:
    data = signer(keys, KINDS[kind], headers=HEADERS).sign(MESSAGES[shape])
    assert data.endswith(MESSAGES[shape])  # the message itself is left as it was
    check_signed(data, keys, len(KINDS[kind]))
    algorithms = [tags(f)["a"] for f in signature_headers(data)]
    assert algorithms == ["ed25519-sha256" if s == "ed25519" else "rsa-sha256"
                          for s in KINDS[kind]]


@pytest.mark.parametrize("canonicalization", CANONICALIZATIONS,
                         ids=["/".join(c) for c in CANONICALIZATIONS])
@pytest.mark.parametrize("shape", list(MESSAGES))
def test_relaxed_and_simple_canonicalization_verify(
        keys: Keys, canonicalization: tuple[Canonicalization, Canonicalization],
        shape: str) -> None:
    dual = signer(keys, ["rsa2048", "ed25519"], canonicalization, headers=HEADERS)
    data = dual.sign(MESSAGES[shape])
    check_signed(data, keys, 2)
    assert {tags(f)["c"] for f in signature_headers(data)} == {"/".join(canonicalization)}


def test_relaxed_survives_what_relays_do_and_simple_does_not(keys: Keys) -> None:
    """Re-folded headers and trailing white space: what relaxed/relaxed is chosen for."""
    message = MESSAGES["plain"]

    def relayed(data: bytes) -> bytes:
        return (data.replace(b"Subject: Hello", b"Subject:\r\n   Hello")
                .replace(b"shipped.\r\n", b"shipped. \r\n"))

    relaxed = signer(keys, ["rsa2048", "ed25519"]).sign(message)
    simple = signer(keys, ["rsa2048", "ed25519"], ("simple", "simple")).sign(message)
    assert verifies(relayed(relaxed), keys, 0) and verifies(relayed(relaxed), keys, 1)
    assert not verifies(relayed(simple), keys, 0) and not verifies(relayed(simple), keys, 1)


def test_a_header_is_signed_as_many_times_as_it_occurs_bottom_up(keys: Keys) -> None:
    data = signer(keys, ["ed25519"], headers=("From", "To", "Subject")).sign(
        MESSAGES["repeated headers"])
    assert tags(signature_headers(data)[0])["h"].split(":") == [
        "from", "from", "to", "to", "subject", "subject"]
    # Either occurrence changed or removed, or one more added below them (a verifier
    # takes the last first), breaks the signature.
    for changed in (data.replace(b"To: a@", b"To: z@"), data.replace(b"To: b@", b"To: z@"),
                    data.replace(b"subject: two", b"subject: six"),
                    data.replace(b"To: a@example.org\r\n", b""),
                    data.replace(b"Subject: one", b"Subject: one\r\nSubject: three")):
        assert not verifies(changed, keys)
    assert verifies(data, keys)


def test_from_is_oversigned_so_that_one_added_on_top_breaks_the_signature(
        keys: Keys) -> None:
    """RFC 6376 8.15: h= names From once more than it occurs. Receivers show the
    top From; without the extra instance a From added above would leave the
    signature valid (a verifier signs the bottom-most instances first)."""
    data = signer(keys, ["rsa2048"], headers=("From", "Subject")).sign(
        b"From: shop@example.com\r\nSubject: hi\r\n\r\nbody\r\n")
    assert tags(signature_headers(data)[0])["h"] == "from:from:subject"
    assert verifies(data, keys)
    head, _, rest = data.partition(b"From: shop@example.com")
    forged = head + b"From: evil@example.net\r\nFrom: shop@example.com" + rest
    assert not verifies(forged, keys)


def test_only_present_headers_are_signed_and_from_always(keys: Keys) -> None:
    data = signer(keys, ["rsa1024"], headers=("From", "Reply-To", "Subject")).sign(
        b"Subject: no sender\r\n\r\nbody\r\n")
    # From is absent: signed as absent (RFC 6376 5.4), so adding one breaks it.
    assert tags(signature_headers(data)[0])["h"] == "from:subject"
    assert verifies(data, keys)
    assert not verifies(b"From: evil@example.net\r\n" + data, keys)


def test_a_long_list_of_signed_headers_folds_within_78_columns(keys: Keys) -> None:
    names = tuple(f"X-Campaign-Tracking-Header-{i}" for i in range(12))
    message = b"From: a@example.com\r\n" + b"".join(
        f"{n}: {i}\r\n".encode() for i, n in enumerate(names)) + b"\r\nbody\r\n"
    data = signer(keys, ["rsa4096", "ed25519"], headers=("From", *names)).sign(message)
    check_signed(data, keys, 2)
    assert len(tags(signature_headers(data)[0])["h"].split(":")) == 14  # From oversigned


def test_a_line_that_is_not_a_header_field_is_refused(keys: Keys) -> None:
    with pytest.raises(ValueError, match="header line 2 is not a header field"):
        signer(keys, ["ed25519"]).sign(b"From: a@example.com\r\nnot a header\r\n\r\nx\r\n")


def test_the_time_stamp_is_the_signing_time(keys: Keys) -> None:
    data = signer(keys, ["ed25519"]).sign(MESSAGES["plain"], now=1_800_000_000.7)
    assert tags(signature_headers(data)[0])["t"] == "1800000000"


# --------------------------------------------------------------------------- #
# Canonicalization, against dkimpy's own, on any input
# --------------------------------------------------------------------------- #

_BODY_BYTES = st.lists(st.sampled_from([b"a", b"\xc3\xa9", b" ", b"\t", b"\r\n", b"\r", b"\n",
                                        b"  \t "]), max_size=30).map(b"".join)
_VALUE_BYTES = st.lists(st.sampled_from([b"v", b" ", b"\t", b"\r\n ", b"\r\n\t", b";", b":"]),
                        max_size=12).map(b"".join)


@given(body=_BODY_BYTES)
def test_body_canonicalization_is_dkimpys(body: bytes) -> None:
    # As SMTP delivers it: with its last CRLF (our signer adds it when missing).
    body += b"" if not body or body.endswith(b"\r\n") else b"\r\n"
    pairs: list[tuple[Canonicalization, Any]] = [("relaxed", dkim.canonicalization.Relaxed),
                                                 ("simple", dkim.canonicalization.Simple)]
    for how, theirs in pairs:
        assert canonical_body(body, how) == theirs.canonicalize_body(body)


@given(name=st.sampled_from([b"Subject", b"X-Tag ", b"to"]), value=_VALUE_BYTES)
def test_header_canonicalization_is_dkimpys(name: bytes, value: bytes) -> None:
    field = name + b":" + value
    [(lower, written)] = header_fields(field)
    [(their_name, their_value)] = dkim.canonicalization.Relaxed.canonicalize_headers(
        [(name, value)])
    assert canonical_headers([(lower, written)], "relaxed") == their_name + b":" + their_value
    assert canonical_headers([(lower, written)], "simple") == field + b"\r\n"
