"""DKIM signing (RFC 6376) of each message as it goes out: RSA and Ed25519 through OpenSSL.

A message is signed when its envelope is made from the stored row
(:func:`~._delivery.envelope_of`), on every attempt: the stored bytes stay
what ``send()`` validated (and what the dashboard shows), a retry carries a
signature of its own time, and a key rotated in the configuration signs what
is still queued. Every transport gets the signed bytes (SMTP, and the
memory, console and file transports, so a test or a developer sees what a
receiver would).

The keys sign through ``cryptography`` (OpenSSL): ``rsa-sha256`` (PKCS#1
v1.5) and ``ed25519-sha256`` (RFC 8463). The canonicalization (RFC 6376 3.4)
and the header selection are done here, once per message, and each key then
adds its own DKIM-Signature header: two keys for the one domain (RSA and
Ed25519, ``OUTBOX_DKIM_KEYS``) give the dual signatures large senders use,
which a receiver that knows only RSA still verifies.

:class:`DKIMSigner` is built by ``load_config`` from the ``OUTBOX_DKIM_*``
keys, which reads every key there (a key that cannot be used fails naming
its config key); ``init_app`` calls :meth:`DKIMSigner.check`, which signs a
probe message with each. A message that still cannot be signed at delivery
goes out unsigned, and that is reported at ERROR (it may be refused or filed
as spam by a receiver whose domain policy asks for DKIM).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

from .. import _degrade
from .._errors import ConfigError

__all__ = ["DEFAULT_SIGNED_HEADERS", "DKIMKey", "DKIMSigner"]

logger = logging.getLogger(__name__)

#: The headers signed when present (From always): what a receiver shows or acts on.
DEFAULT_SIGNED_HEADERS: tuple[str, ...] = (
    "From", "To", "Cc", "Subject", "Date", "Message-ID", "Reply-To", "MIME-Version",
    "Content-Type", "List-Unsubscribe", "List-Unsubscribe-Post",
)

#: Headers RFC 6376 (5.4) says not to sign: relays add or remove them.
_NEVER_SIGNED = frozenset({"return-path", "received", "comments", "keywords", "bcc",
                           "resent-bcc", "dkim-signature"})

# Receivers ignore shorter RSA keys (RFC 8301: 1024 at least, 2048 recommended).
_MIN_KEY_BITS = 1024

_HEADER_NAME = re.compile(r"[!-9;-~]+")  # RFC 5322 ftext: printable ASCII but ":"
_PEM_BEGIN = re.compile(rb"-----BEGIN (?P<label>[A-Z0-9 ]+)-----")
_PEM_ON_ONE_LINE = re.compile(rb"(-----BEGIN [A-Z0-9 ]+-----)(.*?)(-----END [A-Z0-9 ]+-----)",
                              re.DOTALL)
_MAKE_KEY = ("DKIM signing needs an RSA or Ed25519 private key (openssl genrsa -out dkim.pem "
             "2048, or openssl genpkey -algorithm ed25519 -out dkim.pem)")

#: The fields of an ``OUTBOX_DKIM_KEYS`` entry.
_ENTRY_FIELDS = ("selector", "private_key", "private_key_file")

Canonicalization = Literal["relaxed", "simple"]
PrivateKey = rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey

# The header block's fields: a line break not followed by white space ends one.
_FIELD_BREAK = re.compile(rb"\r\n(?![ \t])")
_FOLD = re.compile(rb"\r\n(?=[ \t])")
_WSP_RUN = re.compile(rb"(?: [ \t]|\t)[ \t]*")  # white space but a single space
#: DKIM-Signature lines are folded to this length (RFC 5322 2.1.1's "SHOULD").
_LINE = 78
_PKCS1 = padding.PKCS1v15()
_SHA256 = hashes.SHA256()

def signed_header_names(value: Any) -> tuple[str, ...]:
    """``OUTBOX_DKIM_HEADERS``: None for the default, else a list of header names."""
    if value is None:
        return DEFAULT_SIGNED_HEADERS
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError("OUTBOX_DKIM_HEADERS",
                          f"expected a non-empty list of header names, got {value!r}")
    names: list[str] = []
    for name in value:
        if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
            raise ConfigError("OUTBOX_DKIM_HEADERS", f"not a header name: {name!r}")
        if name.lower() in _NEVER_SIGNED:
            raise ConfigError("OUTBOX_DKIM_HEADERS",
                              f"{name!r} must not be signed (RFC 6376 5.4: relays change it)")
        if name.lower() not in (n.lower() for n in names):
            names.append(name)
    if "from" not in (n.lower() for n in names):
        names.insert(0, "From")  # RFC 6376 5.4: From is always signed
    return tuple(names)


# --------------------------------------------------------------------------- #
# Canonicalization (RFC 6376 3.4)
# --------------------------------------------------------------------------- #


def header_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """The fields of a header block: (lower-cased name, the field as written, folds and all).

    Raises ValueError for a line that is neither a field nor the fold of one.
    """
    fields = []
    for number, field in enumerate(_FIELD_BREAK.split(head), 1):
        name, colon, _ = field.partition(b":")
        name = name.rstrip(b" \t")
        if not colon or not name or name[:1] in (b" ", b"\t"):
            raise ValueError(f"header line {number} is not a header field (no name and ':')")
        fields.append((name.lower(), field))
    return fields


def canonical_headers(fields: Sequence[tuple[bytes, bytes]], how: Canonicalization) -> bytes:
    """Header fields (as :func:`header_fields` gives them) canonicalized, each with its CRLF.

    RFC 6376 3.4.1 and 3.4.2. Relaxed works on the whole block at once: each
    value stripped, then unfolded, then its white space runs made one space.
    """
    if how == "simple":
        return b"".join(field + b"\r\n" for _, field in fields)
    block = b"".join(name + b":" + field.partition(b":")[2].strip(b" \t\r\n") + b"\r\n"
                     for name, field in fields)
    if b"\r\n " in block or b"\r\n\t" in block:
        block = _FOLD.sub(b"", block)
    if b"  " in block or b"\t" in block:
        block = _WSP_RUN.sub(b" ", block)
    return block


def canonical_body(body: bytes, how: Canonicalization) -> bytes:
    """The body canonicalized (RFC 6376 3.4.3, 3.4.4).

    A body whose last line has no CRLF is taken with one, as SMTP delivers it
    (RFC 5321's DATA ends with CRLF.CRLF): what the receiver verifies.
    """
    if body and not body.endswith(b"\r\n"):
        body += b"\r\n"
    if how == "relaxed":
        # The searches skip a pass over a body that has nothing to change, the usual case.
        if b" \r\n" in body or b"\t\r\n" in body:
            body = b"\r\n".join([line.rstrip(b" \t") for line in body.split(b"\r\n")])
        if b"  " in body or b"\t" in body:
            body = _WSP_RUN.sub(b" ", body)
    end = len(body)
    while end >= 2 and body.startswith(b"\r\n", end - 2):  # the empty lines at the end
        end -= 2
    if end == 0:
        return b"" if how == "relaxed" else b"\r\n"
    return body[:end + 2]


# --------------------------------------------------------------------------- #
# Keys
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class DKIMKey:
    """One signing key of the domain: its selector and the private key, read once."""

    selector: str
    private_key: PrivateKey = dataclasses.field(repr=False)
    #: The config key it came from, for error texts.
    key_name: str

    @property
    def algorithm(self) -> str:
        """The ``a=`` tag: ``rsa-sha256`` or ``ed25519-sha256``."""
        return ("ed25519-sha256" if isinstance(self.private_key, ed25519.Ed25519PrivateKey)
                else "rsa-sha256")

    def signature(self, data: bytes) -> bytes:
        """The signature of the canonicalized header data (RFC 6376 3.7, RFC 8463 3)."""
        if isinstance(self.private_key, ed25519.Ed25519PrivateKey):
            # RFC 8463: Ed25519 signs the SHA-256 hash of the data, not the data.
            return self.private_key.sign(hashlib.sha256(data).digest())
        return self.private_key.sign(data, _PKCS1, _SHA256)


def _private_key(pem: bytes, key_name: str) -> PrivateKey:
    """The RSA or Ed25519 private key in ``pem``, or ConfigError saying what is wrong.

    OpenSSL's own errors about a bad key name ASN.1 offsets; the PEM armour
    says what the text is, so the error can say what to do. Neither quotes the key.
    """
    problem = _pem_problem(pem, key_name)
    if problem is not None:
        raise ConfigError(key_name, problem)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ConfigError(key_name, "the private key is damaged (cut or changed when it was "
                                    f"copied?); {_MAKE_KEY}") from None
    if isinstance(key, rsa.RSAPrivateKey):
        if key.key_size < _MIN_KEY_BITS:
            raise ConfigError(key_name,
                              f"the RSA key has {key.key_size} bits; receivers ignore DKIM keys "
                              f"under {_MIN_KEY_BITS} bits (use 2048, or an Ed25519 key)")
        return key
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key
    # OpenSSL's classes are named for the kind: ECPrivateKey, DSAPrivateKey, Ed448PrivateKey...
    kind = type(key).__name__.removesuffix("PrivateKey") or "unsupported"
    raise ConfigError(key_name, f"this is {_article(kind)} {kind} key, not an RSA or Ed25519 "
                                f"key; {_MAKE_KEY}")


def _article(word: str) -> str:
    return "an" if word[:1] in "AEIOUXu" else "a"


def _pem_problem(pem: bytes, key_name: str) -> str | None:
    """What ``pem`` is instead of an unencrypted private key; None when it may be one."""
    begin = _PEM_BEGIN.search(pem)
    if begin is None:
        one_line = b"\n" not in pem.strip()
        path = one_line and (pem.lstrip().startswith((b"/", b"~", b"."))
                             or pem.strip().endswith((b".pem", b".key")))
        hint = (" It looks like a file path: set OUTBOX_DKIM_PRIVATE_KEY_FILE to it instead."
                if path and key_name == "OUTBOX_DKIM_PRIVATE_KEY" else
                " It looks like a file path: set private_key_file to it instead."
                if path and key_name.endswith('["private_key"]') else "")
        return ("holds no PEM block: the text of a private key starts with a line "
                f"'-----BEGIN RSA PRIVATE KEY' or '-----BEGIN PRIVATE KEY'.{hint}")
    label = begin["label"].decode("ascii")
    end = pem.find(b"-----END " + begin["label"] + b"-----", begin.end())
    body = pem[begin.end():end] if end >= 0 else b""
    # An encrypted PKCS#1 key says so in RFC 1421 header lines ("Proc-Type: 4,ENCRYPTED").
    headers = [line for line in body.split(b"\n") if b":" in line]
    if label == "ENCRYPTED PRIVATE KEY" or any(b"ENCRYPTED" in line for line in headers):
        return ("the key is encrypted with a passphrase, which DKIM signing cannot ask for: "
                "store it unencrypted where only the app can read it (openssl pkey -in "
                "encrypted.pem -out dkim.pem)")
    if "PUBLIC KEY" in label:
        return "this is the public key, which goes in the DNS TXT record; signing needs its private key"
    if label == "CERTIFICATE":
        return f"this is a certificate, not a private key; {_MAKE_KEY}"
    if label not in ("RSA PRIVATE KEY", "PRIVATE KEY"):
        kind = label.removesuffix(" PRIVATE KEY")
        return f"this is {_article(kind)} {kind} key, not an RSA or Ed25519 key; {_MAKE_KEY}"
    if end < 0:
        return f"the {label} block has no END line (cut when it was copied?)"
    try:
        base64.b64decode(b"".join(body.split()), validate=True)
    except binascii.Error:
        return ("the text between the BEGIN and END lines is not valid base64 (cut or changed "
                "when it was copied?)")
    return None


# --------------------------------------------------------------------------- #
# Signing
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class DKIMSigner:
    """Signs messages for ``domain`` with each of its ``keys`` (``OUTBOX_DKIM_*``)."""

    domain: str
    keys: tuple[DKIMKey, ...]
    headers: tuple[str, ...] = DEFAULT_SIGNED_HEADERS
    #: Header and body canonicalization. relaxed/relaxed survives the re-folding and
    #: white space changes relays make; simple/simple is there for the tests.
    canonicalization: tuple[Canonicalization, Canonicalization] = ("relaxed", "relaxed")

    def check(self) -> None:
        """Sign a probe message carrying every header to sign; ConfigError naming the key if not.

        Called by ``init_app``: the keys were read by ``load_config``, this
        proves each signs. What fails is said in words, never by quoting the key.
        """
        lines = [f"{name}: probe" for name in self.headers if name.lower() != "from"]
        probe = ("\r\n".join([f"From: probe@{self.domain}", *lines]) + "\r\n\r\nprobe\r\n"
                 ).encode("ascii")
        for key in self.keys:
            try:
                dataclasses.replace(self, keys=(key,)).sign(probe)
            except Exception as exc:  # noqa: BLE001 - any failure here is the key's: say so
                raise ConfigError(key.key_name, "the key was read but cannot sign a probe "
                                                f"message ({type(exc).__name__}); {_MAKE_KEY}"
                                  ) from None

    def sign(self, mime: bytes, *, now: float | None = None) -> bytes:
        """``mime`` with a DKIM-Signature header per key on top (the first key's first).

        Raises ValueError for a header block that is not one (a line that is
        not a header field).
        """
        end = mime.find(b"\r\n\r\n")
        head, body = (mime, b"") if end < 0 else (mime[:end], mime[end + 4:])
        header_how, body_how = self.canonicalization
        body_hash = base64.b64encode(hashlib.sha256(canonical_body(body, body_how)).digest())
        names, data = self._signed_headers(header_fields(head.removesuffix(b"\r\n")),
                                           header_how)
        common = [("c", f"{header_how}/{body_how}"), ("d", self.domain)]
        stamp = [("t", str(int(time.time() if now is None else now)))]
        signatures = []
        for key in self.keys:
            tags = [("v", "1"), ("a", key.algorithm), *common, ("s", key.selector), *stamp]
            header, column = _folded(tags, names, body_hash.decode("ascii"))
            raw = header.encode("ascii")
            signed = data + canonical_headers([(b"dkim-signature", raw)], header_how)[:-2]
            signature = base64.b64encode(key.signature(signed)).decode("ascii")
            signatures.append(raw + _fold_base64(signature, column).encode("ascii") + b"\r\n")
        return b"".join(signatures) + mime

    def _signed_headers(self, fields: list[tuple[bytes, bytes]], how: Canonicalization
                        ) -> tuple[list[str], bytes]:
        """The ``h=`` names and the canonicalized fields they sign, in that order.

        Each configured name present is signed as many times as it occurs,
        the last occurrence first (RFC 6376 5.4.2); From once more than that,
        so that a From added on top fails verification.
        """
        wanted = self._names
        found: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for item in fields:
            if item[0] in wanted:
                found.setdefault(item[0], []).append(item)
        names: list[str] = []
        signed: list[tuple[bytes, bytes]] = []
        for name, text in wanted.items():
            items = found.get(name)
            if items:
                names += [text] * len(items)
                signed += reversed(items)
            if name == b"from":
                # Once more than it occurs, so signed absent above the signed ones: a
                # From added on top breaks the signature (RFC 6376 8.15, oversigning).
                names.append(text)
        return names, canonical_headers(signed, how)

    @functools.cached_property
    def _names(self) -> dict[bytes, str]:
        """``headers`` as :func:`header_fields` names them, and as ``h=`` does."""
        return {name.lower().encode("ascii"): name.lower() for name in self.headers}

    def signed(self, email_id: int, mime: bytes) -> bytes:
        """``mime`` signed, or unsigned with an ERROR when it cannot be (never raises).

        Reported once per email: the probe at start-up signed, so what fails
        here is this message, not the key (a fault of the key would have
        stopped ``init_app``).
        """
        try:
            return self.sign(mime)
        except Exception as exc:  # noqa: BLE001 - the email goes out unsigned, reported
            _degrade.report(
                f"Email {email_id} could not be DKIM-signed for {self.domain} "
                f"({type(exc).__name__}: {exc})",
                consequence="this attempt sends it without a DKIM signature: receivers whose "
                            "domain policy (DMARC) asks for one may refuse it (it is then "
                            "dead-lettered) or file it as spam",
                fix="check OUTBOX_DKIM_*; the keys signed a probe message at start-up, so "
                    "this message holds something that cannot be signed (such as a header "
                    "line that is not a header field): report it with the email's id",
                exc=exc)
            return mime


def _folded(tags: list[tuple[str, str]], names: list[str], body_hash: str) -> tuple[str, int]:
    """The DKIM-Signature header up to an empty ``b=``, folded; and the last line's length.

    Lines stay within 78 characters: a tag goes on the line while it fits,
    ``h=`` may break after any colon (RFC 6376 allows FWS there). ``l=`` is
    never written: it would let anyone append to a signed body.
    """
    # (glue, text): a piece that does not fit starts a line of its own instead of the glue.
    pieces = [(" ", f"{tag}={value};") for tag, value in tags]
    signed = [f"{name}:" for name in names]
    signed[-1] = signed[-1][:-1] + ";"
    pieces += [(" ", "h=" + signed[0]), *(("", name) for name in signed[1:])]
    pieces += [(" ", f"bh={body_hash};"), (" ", "b=")]
    lines: list[str] = []
    line = "DKIM-Signature:"
    for glue, text in pieces:
        room = _LINE - 4 if text == "b=" else _LINE  # b= keeps a few of its characters by it
        if len(line) + len(glue) + len(text) > room:
            lines.append(line)
            line = " " + text
        else:
            line += glue + text
    lines.append(line)
    return "\r\n".join(lines), len(line)


def _fold_base64(value: str, column: int) -> str:
    """``value`` (the ``b=`` signature) after ``column`` characters, folded within 78."""
    first = _LINE - column
    rest = [value[i:i + _LINE - 1] for i in range(first, len(value), _LINE - 1)]
    return "\r\n ".join([value[:first], *rest])


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def signer_from(get: Any, key_text: Any, key_file: Any, headers: Sequence[str],
                entries: Any = None) -> DKIMSigner | None:
    """The signer the ``OUTBOX_DKIM_*`` keys describe, None when DKIM is off.

    ``get(key)`` reads an optional non-empty string key; ``key_text``,
    ``key_file`` and ``entries`` are the raw values of ``OUTBOX_DKIM_PRIVATE_KEY``,
    ``OUTBOX_DKIM_PRIVATE_KEY_FILE`` and ``OUTBOX_DKIM_KEYS``. Every key is
    read here, once.
    """
    domain = get("OUTBOX_DKIM_DOMAIN")
    selector = get("OUTBOX_DKIM_SELECTOR")
    if entries is not None:
        if key_text is not None or key_file is not None:
            raise ConfigError("OUTBOX_DKIM_KEYS",
                              "set OUTBOX_DKIM_KEYS or OUTBOX_DKIM_PRIVATE_KEY(_FILE), not both")
        if selector is not None:
            raise ConfigError("OUTBOX_DKIM_SELECTOR", "OUTBOX_DKIM_KEYS gives each key its "
                                                      "selector: leave this unset")
        keys = _entry_keys(entries)
        if domain is None:
            raise ConfigError("OUTBOX_DKIM_DOMAIN",
                              "OUTBOX_DKIM_KEYS is set: DKIM signing needs OUTBOX_DKIM_DOMAIN too")
        _check_name("OUTBOX_DKIM_DOMAIN", domain)
        return DKIMSigner(domain=domain, keys=keys, headers=tuple(headers))
    if key_text is not None and key_file is not None:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                          "set OUTBOX_DKIM_PRIVATE_KEY or OUTBOX_DKIM_PRIVATE_KEY_FILE, not both")
    if key_file is not None:
        name, pem = "OUTBOX_DKIM_PRIVATE_KEY_FILE", _read_key_file(key_file,
                                                                   "OUTBOX_DKIM_PRIVATE_KEY_FILE")
    elif key_text is not None:
        name, pem = "OUTBOX_DKIM_PRIVATE_KEY", _key_bytes(key_text, "OUTBOX_DKIM_PRIVATE_KEY")
    elif domain is None and selector is None:
        return None
    else:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                          "DKIM signing needs a private key: set OUTBOX_DKIM_PRIVATE_KEY (PEM "
                          "text) or OUTBOX_DKIM_PRIVATE_KEY_FILE, or OUTBOX_DKIM_KEYS")
    for key, value in (("OUTBOX_DKIM_DOMAIN", domain), ("OUTBOX_DKIM_SELECTOR", selector)):
        if value is None:
            raise ConfigError(key, f"{name} is set: DKIM signing needs OUTBOX_DKIM_DOMAIN and "
                                   "OUTBOX_DKIM_SELECTOR too")
        _check_name(key, value)
    only = DKIMKey(selector=selector, private_key=_private_key(pem, name), key_name=name)
    return DKIMSigner(domain=domain, keys=(only,), headers=tuple(headers))


def _check_name(key: str, value: str) -> None:
    if not value.isascii() or not _HEADER_NAME.fullmatch(value) or ";" in value:
        raise ConfigError(key, f"not an ASCII domain name or selector: {value!r}")


def _entry_keys(entries: Any) -> tuple[DKIMKey, ...]:
    """``OUTBOX_DKIM_KEYS``: a list of ``{"selector", "private_key" or "private_key_file"}``."""
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, (list, tuple)) \
            or not entries:
        raise ConfigError("OUTBOX_DKIM_KEYS",
                          "expected a non-empty list of {'selector': ..., 'private_key': ... or "
                          f"'private_key_file': ...}}, got {type(entries).__name__}")
    keys: list[DKIMKey] = []
    selectors: dict[str, int] = {}
    for index, entry in enumerate(entries):
        at = f"OUTBOX_DKIM_KEYS[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(at, "expected a dict {'selector': ..., 'private_key': ... or "
                                  f"'private_key_file': ...}}, got {type(entry).__name__}")
        unknown = sorted(str(field) for field in entry if field not in _ENTRY_FIELDS)
        if unknown:
            raise ConfigError(f'{at}["{unknown[0]}"]',
                              f"not a field of a DKIM key; the fields are "
                              f"{', '.join(_ENTRY_FIELDS)}")
        selector = entry.get("selector")
        field = f'{at}["selector"]'
        if not isinstance(selector, str) or not selector:
            raise ConfigError(field, f"expected the selector's name, got {selector!r}")
        _check_name(field, selector)
        if selector in selectors:
            raise ConfigError(field, f"{selector!r} is the selector of OUTBOX_DKIM_KEYS"
                                     f"[{selectors[selector]}] too: each key needs its own "
                                     "(its DNS record holds one key)")
        selectors[selector] = index
        text, path = entry.get("private_key"), entry.get("private_key_file")
        if (text is None) == (path is None):
            raise ConfigError(f'{at}["private_key"]',
                              "set private_key (PEM text) or private_key_file, one of them")
        if path is not None:
            name = f'{at}["private_key_file"]'
            pem = _read_key_file(path, name)
        else:
            name = f'{at}["private_key"]'
            pem = _key_bytes(text, name)
        keys.append(DKIMKey(selector=selector, private_key=_private_key(pem, name),
                            key_name=name))
    return tuple(keys)


def _key_bytes(value: Any, key_name: str) -> bytes:
    # Never echo the value: it is a private key.
    if isinstance(value, str) and value.strip():
        return _line_breaks(value.encode("ascii", "replace"))
    if isinstance(value, bytes) and value.strip():
        return _line_breaks(value)
    raise ConfigError(key_name,
                      f"expected the PEM text of a private key, got {type(value).__name__}"
                      f"{' (empty)' if isinstance(value, (str, bytes)) else ''}")


def _read_key_file(path: Any, key_name: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConfigError(key_name, f"expected a file path, got {path!r}")
    try:
        with open(path, "rb") as handle:
            return _line_breaks(handle.read())
    except OSError as exc:
        raise ConfigError(key_name, f"cannot read {path!r}: {exc.strerror or exc}") from None


def _line_breaks(pem: bytes) -> bytes:
    """``pem`` with the LF line breaks of a PEM file.

    A key file saved on Windows has CRLF; a key put on one line of an .env
    file or a secret store has the two characters ``\\n`` instead, or spaces.
    """
    pem = pem.replace(b"\r\n", b"\n").strip()
    if b"\n" not in pem:
        pem = pem.replace(b"\\n", b"\n")
    one_line = _PEM_ON_ONE_LINE.fullmatch(pem) if b"\n" not in pem else None
    if one_line is not None:
        pem = b"\n".join([one_line[1], *one_line[2].split(), one_line[3]])
    return pem + b"\n"
