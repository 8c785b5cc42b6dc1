"""One-click unsubscribe: a ``Message``'s ``list_unsubscribe``, checked and written.

RFC 2369's ``List-Unsubscribe`` lists where a reader can unsubscribe; RFC
8058's ``List-Unsubscribe-Post: List-Unsubscribe=One-Click`` says the https
one takes a single POST, which large mailbox providers ask of bulk senders.
Only https (never plain http, which would carry the unsubscribe token in
clear) and ``mailto:`` URIs with a valid address are accepted.

``list_unsubscribe=True`` has the outbox make the URL: :class:`UnsubscribeLinks`
joins ``OUTBOX_UNSUBSCRIBE_URL`` and an opaque token naming the one recipient,
encrypted and authenticated with a key derived from the app's ``SECRET_KEY``, so
the route that receives it needs no database row to know whom it names, and the
URL does not show the address.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence

from .._errors import InvalidMessage
from .addresses import AddressError, check_header_text, parse_address
from .fields import ExtraHeaders
from .links import UnsubscribeLinks
from .mime import uri_list_header

__all__ = ["unsubscribe_lines"]

# A URI in a header: printable ASCII but space and the brackets around it.
_URI_CHARS = re.compile(r"[!-;=?-~]+")
_MAX_URI_LENGTH = 900
_UNSUBSCRIBE_HEADERS = frozenset({"list-unsubscribe", "list-unsubscribe-post"})


def unsubscribe_lines(
    value: object, extra: ExtraHeaders | None, allow_local: bool, *,
    recipients: Sequence[str] = (), links: UnsubscribeLinks | None = None,
    message_id: str | None = None,
) -> list[tuple[str, str]]:
    """``list_unsubscribe`` checked, as (lower-case name, header line) pairs for ``top_headers``.

    ``value`` is a str or a list or tuple of them; None or an empty list
    writes nothing. True makes the one-click URL with ``links`` for the one
    address in ``recipients``, naming the email by ``message_id`` (so the
    unsubscribe is recorded with it). Giving these headers in ``extra_headers``
    as well is refused rather than guessed at.
    """
    if value is None or value is False:
        return []
    if value is True:
        if links is None:
            raise InvalidMessage(
                "list_unsubscribe", "True needs OUTBOX_UNSUBSCRIBE_URL (and the app's "
                "SECRET_KEY) set, in the app that builds or sends the message")
        if len(recipients) != 1:
            raise InvalidMessage(
                "list_unsubscribe", f"True needs exactly one recipient (To, Cc and Bcc "
                f"together), this message has {len(recipients)}: the link names whom it "
                "unsubscribes; send one message per recipient (send_many)")
        value = links.url_for(recipients[0], message_id)
    if isinstance(value, str):
        uris = [("list_unsubscribe", value)]
    elif isinstance(value, (list, tuple)):
        uris = [(f"list_unsubscribe[{i}]", uri) for i, uri in enumerate(value)]
    else:
        raise InvalidMessage(
            "list_unsubscribe",
            f"expected an https or mailto URI, or a list of them, got {type(value).__name__}",
        )
    if not uris:
        return []
    checked = [_unsubscribe_uri(field, uri, allow_local) for field, uri in uris]
    if extra and any(name in _UNSUBSCRIBE_HEADERS for name, _ in extra.lines):
        raise InvalidMessage(
            "list_unsubscribe", "List-Unsubscribe is also given in extra_headers; give it once"
        )
    lines = [("list-unsubscribe", uri_list_header("List-Unsubscribe", checked))]
    if any(uri.lower().startswith("https:") for uri in checked):
        # RFC 8058: the receiver may unsubscribe with one POST to the https URI.
        lines.append(("list-unsubscribe-post", "List-Unsubscribe-Post: List-Unsubscribe=One-Click"))
    return lines


def _unsubscribe_uri(field: str, uri: object, allow_local: bool) -> str:
    """One List-Unsubscribe URI: an https URL with a host, or a mailto: with a valid address."""
    if not isinstance(uri, str):
        raise InvalidMessage(field, f"expected str, got {type(uri).__name__}")
    check_header_text(field, uri)
    if not uri.isascii() or not _URI_CHARS.fullmatch(uri) or len(uri) > _MAX_URI_LENGTH:
        raise InvalidMessage(
            field,
            f"{uri[:80]!r} is not a URI of printable ASCII without spaces or angle brackets "
            f"(percent-encode the rest), up to {_MAX_URI_LENGTH} characters",
        )
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "https":
        if not parts.hostname:
            raise InvalidMessage(field, f"{uri!r} has no host")
        return uri
    if scheme == "mailto":
        address = urllib.parse.unquote(parts.path)
        try:
            parse_address(address, allow_local)
        except AddressError as exc:
            raise InvalidMessage(field, f"{uri!r}: {address!r} is not an email address ({exc})") from None
        return uri
    if scheme == "http":
        raise InvalidMessage(field, f"{uri!r}: one-click unsubscribe (RFC 8058) needs https, not http")
    raise InvalidMessage(field, f"{uri!r} is neither an https URL nor a mailto: URI")
