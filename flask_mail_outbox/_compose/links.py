"""The one-click unsubscribe link: ``OUTBOX_UNSUBSCRIBE_URL`` plus a signed token.

The token names the recipient and is signed with the app's ``SECRET_KEY`` by
itsdangerous (Flask's own signing library), so the route that receives it
needs no database row to know whom it names, and nobody can make one for
someone else.
"""

from __future__ import annotations

import dataclasses

from itsdangerous import BadSignature, URLSafeSerializer

__all__ = ["UnsubscribeLinks"]

#: itsdangerous's salt: a token made for anything else never verifies here.
_SALT = "flask-mail-outbox.unsubscribe"


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

    def url_for(self, address: str) -> str:
        """The one-click URL for ``address``."""
        return f"{self.base_url}/{self._serializer().dumps(address.lower())}"

    def address_of(self, token: str) -> str | None:
        """The address ``token`` names, or None when it is not one of ours (tampered, foreign)."""
        try:
            address = self._serializer().loads(token)
        except BadSignature:
            return None
        return address if isinstance(address, str) and "@" in address else None
