"""VERP envelope senders: ``bounces+<token>@example.com``, the token naming the row.

With ``OUTBOX_BOUNCE_ADDRESS = "bounces@example.com"`` each SMTP delivery's
MAIL FROM (and so the Return-Path, where bounces go) is
``bounces+<id>-<signature>@example.com``. The signature is an HMAC-SHA256 of
the row id under the app's ``SECRET_KEY``, so a forged bounce cannot fail
someone else's mail: without the key nobody can name a row.

Why not itsdangerous here, as for the unsubscribe links: its signatures are
base64, which is case-sensitive, and the local part of an address is the one
place mail software is known to change case on the way back (RFC 5321 says
not to; some relays fold it all the same). The token is lower-case base32 of
the HMAC, 80 bits, which survives that.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import re

__all__ = ["VerpAddresses"]

#: Bits of HMAC kept in a token: 80 (16 base32 characters).
_SIGNATURE_CHARS = 16
_TOKEN = re.compile(r"(\d{1,19})-([a-z2-7]{16})")


@dataclasses.dataclass(frozen=True)
class VerpAddresses:
    """Makes and reads one app's VERP addresses (see the module docstring).

    ``secret_keys``: the app's ``SECRET_KEY`` last, after any
    ``SECRET_KEY_FALLBACKS`` (a bounce of mail sent before a key rotation is
    still read; new addresses use the newest key).
    """

    bounce_address: str
    secret_keys: tuple[str | bytes, ...] = dataclasses.field(repr=False)

    @property
    def _parts(self) -> tuple[str, str]:
        local, _, domain = self.bounce_address.rpartition("@")
        return local, domain

    def sender_for(self, email_id: int) -> str:
        """The envelope sender of row ``email_id``."""
        local, domain = self._parts
        return f"{local}+{email_id}-{self._signature(email_id, self.secret_keys[-1])}@{domain}"

    def email_id_of(self, address: str) -> int | None:
        """The row an address of ours names, or None (another address, a forged token)."""
        local, domain = self._parts
        address = address.strip().strip("<>").strip()
        given_local, at, given_domain = address.rpartition("@")
        if not at or given_domain.lower() != domain.lower():
            return None
        head, plus, token = given_local.partition("+")
        if not plus or head.lower() != local.lower():
            return None
        match = _TOKEN.fullmatch(token.lower())
        if match is None:
            return None
        email_id = int(match.group(1))
        if any(hmac.compare_digest(match.group(2), self._signature(email_id, key))
               for key in self.secret_keys):
            return email_id
        return None

    @staticmethod
    def _signature(email_id: int, key: str | bytes) -> str:
        secret = key.encode() if isinstance(key, str) else key
        digest = hmac.new(secret, f"flask-mail-outbox.verp:{email_id}".encode(),
                          hashlib.sha256).digest()
        return base64.b32encode(digest).decode("ascii").lower()[:_SIGNATURE_CHARS]
