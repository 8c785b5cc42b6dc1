"""The one-click unsubscribe link: ``OUTBOX_UNSUBSCRIBE_URL`` plus a signed token.

The token names the recipient and is signed with the app's ``SECRET_KEY`` by
itsdangerous (Flask's own signing library), so the route that receives it
needs no database row to know whom it names, and nobody can make one for
someone else. It names the email too, by its Message-ID (``[address,
message id]``), so the unsubscribe is recorded with the email it came from;
a token made before it did (the address alone) is still read.
"""

from __future__ import annotations

import dataclasses

from itsdangerous import BadSignature, URLSafeSerializer

__all__ = ["UnsubscribeLinks"]

#: itsdangerous's salt: a token made for anything else never verifies here.
_SALT = "flask-mail-outbox.unsubscribe"

#: The longest one-click URL made (a List-Unsubscribe URI is refused over 900).
MAX_URL_LENGTH = 900


@dataclasses.dataclass(frozen=True)
class UnsubscribeLinks:
    """One-click unsubscribe URLs for one app: ``base_url`` + ``/`` + a signed token.

    ``secret_keys``: the app's ``SECRET_KEY`` last, after any
    ``SECRET_KEY_FALLBACKS`` (links signed with an old key keep working
    after a rotation). The token holds the address (URL-safe base64, not
    encrypted) and never expires: an unsubscribe link must work as long as
    the email exists.
    """

    base_url: str
    secret_keys: tuple[str | bytes, ...] = dataclasses.field(repr=False)

    def _serializer(self) -> URLSafeSerializer:
        keys = [key.encode() if isinstance(key, str) else key for key in self.secret_keys]
        return URLSafeSerializer(keys, salt=_SALT)

    def url_for(self, address: str, message_id: str | None = None) -> str:
        """The one-click URL for ``address``, naming the email ``message_id`` when given.

        A Message-ID too long for a URL of :data:`MAX_URL_LENGTH` is left out
        (the link then names the address alone).
        """
        serializer = self._serializer()
        if message_id:
            url = (f"{self.base_url}/"
                   f"{serializer.dumps([address.lower(), message_id.strip().strip('<>')])}")
            if len(url) <= MAX_URL_LENGTH:
                return url
        return f"{self.base_url}/{serializer.dumps(address.lower())}"

    def address_of(self, token: str) -> str | None:
        """The address ``token`` names, or None when it is not one of ours (tampered, foreign)."""
        named = self.named_by(token)
        return named[0] if named is not None else None

    def named_by(self, token: str) -> tuple[str, str | None] | None:
        """(address, Message-ID in angle brackets or None) ``token`` names; None when not ours."""
        try:
            value = self._serializer().loads(token)
        except BadSignature:
            return None
        if isinstance(value, str):  # a link made before links named their email
            return (value, None) if "@" in value else None
        if isinstance(value, list) and len(value) == 2 \
                and all(isinstance(part, str) and part for part in value) and "@" in value[0]:
            return value[0], f"<{value[1]}>"
        return None
