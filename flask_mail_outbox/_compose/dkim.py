"""DKIM signing (RFC 6376) of each message as it goes out, on dkimpy (extra ``dkim``).

A message is signed when its envelope is made from the stored row
(:func:`~._delivery.envelope_of`), on every attempt: the stored bytes stay
what ``send()`` validated (and what the dashboard shows), a retry carries a
signature of its own time, and a key rotated in the configuration signs what
is still queued. Every transport gets the signed bytes (SMTP, and the
memory, console and file transports, so a test or a developer sees what a
receiver would).

:class:`DKIMSigner` is built by ``load_config`` from the ``OUTBOX_DKIM_*``
keys; ``init_app`` calls :meth:`DKIMSigner.check`, which signs a probe
message, so a key that cannot sign fails at start-up naming its key, not at
the first email. A message that still cannot be signed at delivery goes out
unsigned, and that is reported at ERROR (it may be refused or filed as spam
by a receiver whose domain policy asks for DKIM).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Any

from .. import _degrade
from .._errors import ConfigError

__all__ = ["DEFAULT_SIGNED_HEADERS", "DKIMSigner"]

logger = logging.getLogger(__name__)

#: The headers signed when present (From always): what a receiver shows or acts on.
DEFAULT_SIGNED_HEADERS: tuple[str, ...] = (
    "From", "To", "Cc", "Subject", "Date", "Message-ID", "Reply-To", "MIME-Version",
    "Content-Type", "List-Unsubscribe", "List-Unsubscribe-Post",
)

#: Headers RFC 6376 (5.4) says not to sign: relays add or remove them (dkimpy refuses them).
_NEVER_SIGNED = frozenset({"return-path", "received", "comments", "keywords", "bcc",
                           "resent-bcc", "dkim-signature"})

# Receivers ignore shorter RSA keys (RFC 8301: 1024 at least, 2048 recommended).
_MIN_KEY_BITS = 1024

_HEADER_NAME = re.compile(r"[!-9;-~]+")  # RFC 5322 ftext: printable ASCII but ":"
_INSTALL = "pip install flask-mail-outbox[dkim]"
_PEM_BEGIN = re.compile(rb"-----BEGIN (?P<label>[A-Z0-9 ]+)-----")
_PEM_ON_ONE_LINE = re.compile(rb"(-----BEGIN [A-Z0-9 ]+-----)(.*?)(-----END [A-Z0-9 ]+-----)",
                              re.DOTALL)
_MAKE_KEY = "DKIM signing needs an RSA private key (openssl genrsa -out dkim.pem 2048)"


def _dkimpy() -> Any:
    """dkimpy, imported on first use (an optional dependency, untyped)."""
    try:
        import dkim
    except ImportError:
        raise ConfigError("OUTBOX_DKIM_DOMAIN",
                          f"DKIM signing needs dkimpy, which is not installed: {_INSTALL}"
                          ) from None
    return dkim


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


def _present_headers(mime: bytes) -> set[bytes]:
    """The lower-cased names of the headers of ``mime``'s top part."""
    end = mime.find(b"\r\n\r\n")
    head = mime if end < 0 else mime[:end]
    names = set()
    for line in head.split(b"\r\n"):
        if line[:1] not in (b" ", b"\t") and b":" in line:
            names.add(line.split(b":", 1)[0].strip().lower())
    return names


def _rsa_key(dkim: Any, pem: bytes, key_name: str) -> Any:
    """The RSA private key in ``pem`` as dkimpy parses it, or ConfigError saying what is wrong.

    dkimpy reads only unencrypted RSA keys (PKCS#1 ``RSA PRIVATE KEY`` or
    PKCS#8 ``PRIVATE KEY``), and what it raises for anything else ranges from
    binascii's "Incorrect padding" to ASN.1 byte offsets; the PEM armour says
    what the text is, so the error can say what to do.
    """
    problem = _pem_problem(pem, key_name)
    if problem is not None:
        raise ConfigError(key_name, problem)
    try:
        return dkim.crypto.parse_pem_private_key(pem)
    except Exception:  # noqa: BLE001 - dkimpy's ASN.1 errors, whatever their type
        what = ("a PKCS#8 key of another kind (Ed25519 or EC?)" if b"BEGIN PRIVATE KEY" in pem
                else "damaged (cut or changed when it was copied?)")
        raise ConfigError(key_name, f"not an RSA private key that dkimpy can read: {what}; "
                                    f"{_MAKE_KEY}") from None


def _pem_problem(pem: bytes, key_name: str) -> str | None:
    """What ``pem`` is instead of an unencrypted RSA private key; None when it may be one."""
    begin = _PEM_BEGIN.search(pem)
    if begin is None:
        one_line = b"\n" not in pem.strip()
        path = one_line and (pem.lstrip().startswith((b"/", b"~", b"."))
                             or pem.strip().endswith((b".pem", b".key")))
        hint = (" It looks like a file path: set OUTBOX_DKIM_PRIVATE_KEY_FILE to it instead."
                if path and key_name == "OUTBOX_DKIM_PRIVATE_KEY" else "")
        return ("holds no PEM block: the text of an RSA private key starts with a line "
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
        return f"this is {'an' if kind[:1] in 'AEIOU' else 'a'} {kind} key, not an RSA key; {_MAKE_KEY}"
    if end < 0:
        return f"the {label} block has no END line (cut when it was copied?)"
    try:
        base64.b64decode(b"".join(body.split()), validate=True)
    except binascii.Error:
        return ("the text between the BEGIN and END lines is not valid base64 (cut or changed "
                "when it was copied?)")
    return None


@dataclasses.dataclass(frozen=True)
class DKIMSigner:
    """Signs messages for ``domain`` with ``selector``'s key (``OUTBOX_DKIM_*``)."""

    domain: str
    selector: str
    private_key: bytes = dataclasses.field(repr=False)
    #: Which key the private key came from, for error texts.
    key_name: str
    headers: tuple[str, ...] = DEFAULT_SIGNED_HEADERS

    def check(self) -> None:
        """Sign a probe message carrying every header to sign; ConfigError naming the key if not.

        Called by ``init_app``. What is wrong with the key is said in words,
        never by quoting it, and neither are dkimpy's own texts about it.
        """
        dkim = _dkimpy()
        key = _rsa_key(dkim, self.private_key, self.key_name)
        bits = int(key["modulus"]).bit_length()
        if bits < _MIN_KEY_BITS:
            raise ConfigError(self.key_name,
                              f"the RSA key has {bits} bits; receivers ignore DKIM keys under "
                              f"{_MIN_KEY_BITS} bits (use 2048)")
        lines = [f"{name}: probe" for name in self.headers if name.lower() != "from"]
        probe = ("\r\n".join([f"From: probe@{self.domain}", *lines]) + "\r\n\r\nprobe\r\n"
                 ).encode("ascii")
        try:
            self.sign(probe)
        except Exception as exc:  # noqa: BLE001 - any failure here is the key's: say so, by name
            raise ConfigError(self.key_name, "the key was read but cannot sign a probe message "
                                             f"({type(exc).__name__}); {_MAKE_KEY}") from None

    def sign(self, mime: bytes) -> bytes:
        """``mime`` with a DKIM-Signature header on top; raises dkimpy's DKIMException."""
        dkim = _dkimpy()
        present = _present_headers(mime)
        include = [n.lower().encode("ascii") for n in self.headers
                   if n.lower().encode("ascii") in present]
        signature: bytes = dkim.sign(
            mime, self.selector.encode("ascii"), self.domain.encode("ascii"), self.private_key,
            # relaxed/relaxed: survives the re-folding and whitespace changes relays make.
            canonicalize=(b"relaxed", b"relaxed"), include_headers=include or [b"from"],
            linesep=b"\r\n")
        return signature + mime

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
                fix="check OUTBOX_DKIM_*; the key signed a probe message at start-up, so "
                    "this message holds something dkimpy cannot sign: report it with the "
                    "email's id",
                exc=exc)
            return mime


def signer_from(get: Any, key_text: Any, key_file: Any, headers: Sequence[str]
                ) -> DKIMSigner | None:
    """The signer the ``OUTBOX_DKIM_*`` keys describe, None when DKIM is off.

    ``get(key)`` reads an optional non-empty string key; ``key_text`` and
    ``key_file`` are the raw values of the two private key keys.
    """
    domain = get("OUTBOX_DKIM_DOMAIN")
    selector = get("OUTBOX_DKIM_SELECTOR")
    if key_text is not None and key_file is not None:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                          "set OUTBOX_DKIM_PRIVATE_KEY or OUTBOX_DKIM_PRIVATE_KEY_FILE, not both")
    if key_file is not None:
        name, private_key = "OUTBOX_DKIM_PRIVATE_KEY_FILE", _read_key_file(key_file)
    elif key_text is not None:
        name, private_key = "OUTBOX_DKIM_PRIVATE_KEY", _key_bytes(key_text)
    elif domain is None and selector is None:
        return None
    else:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                          "DKIM signing needs a private key: set OUTBOX_DKIM_PRIVATE_KEY (PEM "
                          "text) or OUTBOX_DKIM_PRIVATE_KEY_FILE")
    for key, value in (("OUTBOX_DKIM_DOMAIN", domain), ("OUTBOX_DKIM_SELECTOR", selector)):
        if value is None:
            raise ConfigError(key, f"{name} is set: DKIM signing needs OUTBOX_DKIM_DOMAIN and "
                                   "OUTBOX_DKIM_SELECTOR too")
        if not value.isascii() or not _HEADER_NAME.fullmatch(value) or ";" in value:
            raise ConfigError(key, f"not an ASCII domain name or selector: {value!r}")
    return DKIMSigner(domain=domain, selector=selector, private_key=private_key,
                      key_name=name, headers=tuple(headers))


def _key_bytes(value: Any) -> bytes:
    # Never echo the value: it is a private key.
    if isinstance(value, str) and value.strip():
        return _line_breaks(value.encode("ascii", "replace"))
    if isinstance(value, bytes) and value.strip():
        return _line_breaks(value)
    raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                      f"expected the PEM text of a private key, got {type(value).__name__}"
                      f"{' (empty)' if isinstance(value, (str, bytes)) else ''}")


def _read_key_file(path: Any) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY_FILE", f"expected a file path, got {path!r}")
    try:
        with open(path, "rb") as handle:
            return _line_breaks(handle.read())
    except OSError as exc:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY_FILE",
                          f"cannot read {path!r}: {exc.strerror or exc}") from None


def _line_breaks(pem: bytes) -> bytes:
    """``pem`` with the LF line breaks dkimpy's reader needs.

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
