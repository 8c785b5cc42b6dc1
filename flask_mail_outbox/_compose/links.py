"""The one-click unsubscribe link: ``OUTBOX_UNSUBSCRIBE_URL`` plus an opaque token.

The token names the recipient and the email (by its Message-ID), encrypted and
authenticated with a key derived from the app's ``SECRET_KEY`` (AES-SIV, RFC 5297, from
the ``cryptography`` package), so the route that receives it needs no database row to
know whom it names (it works after the email's row is purged), nobody can make one for
someone else, and a forwarded newsletter does not show the subscriber's address in its
URL. AES-SIV is deterministic: one message built twice carries one link.

Links made before the tokens were opaque (itsdangerous signatures over the address in
readable base64, with or without the Message-ID) are still read: they are in inboxes,
and an unsubscribe link must keep working (docs/events.md says until when).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from functools import cached_property

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from itsdangerous import BadSignature, URLSafeSerializer

__all__ = ["UnsubscribeLinks"]

#: itsdangerous's salt of the signed (readable) tokens made before they were opaque.
_SALT = "flask-mail-outbox.unsubscribe"
#: HKDF's ``info``: the encryption key of the opaque tokens is used for nothing else.
_KEY_INFO = b"flask-mail-outbox.unsubscribe.opaque"
#: The opaque token's first byte (and AES-SIV's associated data): its format.
_FORMAT = b"\x01"
#: An opaque token: URL-safe base64 without padding (a signed one has dots).
_OPAQUE = re.compile(r"[A-Za-z0-9_-]+")


def _cipher(secret: str | bytes) -> AESSIV:
    """AES-SIV with a 512-bit key derived from one of the app's secret keys."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return AESSIV(HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
                       info=_KEY_INFO).derive(raw))

#: The longest one-click URL made (a List-Unsubscribe URI is refused over 900).
MAX_URL_LENGTH = 900


@dataclasses.dataclass(frozen=True)
class UnsubscribeLinks:
    """One-click unsubscribe URLs for one app: ``base_url`` + ``/`` + an opaque token.

    ``secret_keys``: the app's ``SECRET_KEY`` last, after any
    ``SECRET_KEY_FALLBACKS`` (links made with an old key keep working
    after a rotation). The token holds the address and the Message-ID,
    encrypted, and never expires: an unsubscribe link must work as long as
    the email exists.
    """

    base_url: str
    secret_keys: tuple[str | bytes, ...] = dataclasses.field(repr=False)

    def _serializer(self) -> URLSafeSerializer:
        keys = [key.encode() if isinstance(key, str) else key for key in self.secret_keys]
        return URLSafeSerializer(keys, salt=_SALT)

    @cached_property
    def _ciphers(self) -> tuple[AESSIV, ...]:
        """One per key, the current one (the last of ``secret_keys``) first."""
        return tuple(_cipher(key) for key in reversed(self.secret_keys))

    def _seal(self, value: list[str]) -> str:
        plain = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        sealed = _FORMAT + self._ciphers[0].encrypt(plain, [_FORMAT])
        return base64.urlsafe_b64encode(sealed).decode("ascii").rstrip("=")

    def url_for(self, address: str, message_id: str | None = None) -> str:
        """The one-click URL for ``address``, naming the email ``message_id`` when given.

        A Message-ID too long for a URL of :data:`MAX_URL_LENGTH` is left out
        (the link then names the address alone).
        """
        if message_id:
            url = (f"{self.base_url}/"
                   f"{self._seal([address.lower(), message_id.strip().strip('<>')])}")
            if len(url) <= MAX_URL_LENGTH:
                return url
        return f"{self.base_url}/{self._seal([address.lower()])}"

    def address_of(self, token: str) -> str | None:
        """The address ``token`` names, or None when it is not one of ours (tampered, foreign)."""
        named = self.named_by(token)
        return named[0] if named is not None else None

    def named_by(self, token: str) -> tuple[str, str | None] | None:
        """(address, Message-ID in angle brackets or None) ``token`` names; None when not ours."""
        value = self._opened(token) if "." not in token else self._signed(token)
        if isinstance(value, str):  # a signed link made before links named their email
            value = [value]
        if not (isinstance(value, list) and 1 <= len(value) <= 2
                and all(isinstance(part, str) and part for part in value)
                and "@" in value[0]):
            return None
        return value[0], (f"<{value[1]}>" if len(value) == 2 else None)

    def _opened(self, token: str) -> object:
        """An opaque token's content, or None when it is not one of ours."""
        if not _OPAQUE.fullmatch(token):
            return None
        try:
            sealed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except ValueError:  # binascii.Error: a length no base64 has
            return None
        if sealed[:1] != _FORMAT:
            return None
        for cipher in self._ciphers:
            try:
                plain = cipher.decrypt(sealed[1:], [_FORMAT])
            except (InvalidTag, ValueError):  # another key's, or altered, or too short
                continue
            try:
                return json.loads(plain)
            except ValueError:  # cannot happen for a token we made
                return None
        return None

    def _signed(self, token: str) -> object:
        """A signed (readable) token's content, made before tokens were opaque, or None."""
        try:
            return self._serializer().loads(token)
        except BadSignature:
            return None
