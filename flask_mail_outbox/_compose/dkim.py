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

        Called by ``init_app``.
        """
        dkim = _dkimpy()
        try:
            key = dkim.crypto.parse_pem_private_key(self.private_key)
        except dkim.crypto.UnparsableKeyError as exc:
            raise ConfigError(self.key_name,
                              f"not a PEM RSA private key that dkimpy can read ({exc})") from None
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
        except dkim.DKIMException as exc:
            raise ConfigError(self.key_name, f"cannot sign a probe message: {exc}") from None

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
        return value.encode("ascii", "replace")
    if isinstance(value, bytes) and value.strip():
        return value
    raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY",
                      f"expected the PEM text of a private key, got {type(value).__name__}"
                      f"{' (empty)' if isinstance(value, (str, bytes)) else ''}")


def _read_key_file(path: Any) -> bytes:
    if not isinstance(path, str) or not path:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY_FILE", f"expected a file path, got {path!r}")
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError("OUTBOX_DKIM_PRIVATE_KEY_FILE",
                          f"cannot read {path!r}: {exc.strerror or exc}") from None
