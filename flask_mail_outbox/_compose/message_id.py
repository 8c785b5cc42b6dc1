"""Message-IDs: made with the ``Message``, as Flask-Mail makes them, but never from DNS.

Flask-Mail's ``make_msgid()`` asks the resolver for the host's name; a domain
from the settings or the sender is as unique and costs nothing. The id is
made once and kept, so ``as_string()``, the stored row and the delivered
message agree.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

from .._errors import ConfigError
from .addresses import Addr, AddressError, bare_address, parse_address
from .ambient import ComposeOptions, current_options
from .fields import ExtraHeaders, check_message_id, check_message_id_domain

__all__ = ["context_domain", "new_message_id", "resolve_message_id"]


def resolve_message_id(
    msg: Any, extra: ExtraHeaders | None, domain_setting: str | None, sender: Addr
) -> str:
    """The Message-ID the user chose, checked (an extra header wins over ``msgId``).

    A message whose ``msgId`` could not be made yet (no domain to go by), or
    was made with another domain than ``OUTBOX_MESSAGE_ID_DOMAIN`` (outside an
    app context), gets one now from the setting or the sender, and keeps it.
    """
    if extra and "message-id" in extra.replaced:
        return check_message_id(extra.replaced["message-id"])
    domain = check_message_id_domain(domain_setting) if domain_setting else sender.domain
    message_id = msg.msgId
    if message_id is None or (
        # Made before the app's setting was known (outside an app context).
        msg._msg_id_made and domain_setting and not message_id.endswith(f"@{domain}>")
    ):
        message_id = msg._msg_id = new_message_id(domain)
        msg._msg_id_made = True
    return check_message_id(message_id)


def new_message_id(domain: str) -> str:
    """A fresh ``<time.random@domain>``: unique without asking DNS for a host name."""
    return f"<{time.time_ns() // 1000:x}.{secrets.token_hex(8)}@{domain}>"


def context_domain(sender: object, options: ComposeOptions | None = None) -> str | None:
    """The Message-ID domain known now: the app's setting, else the sender's; None when neither is known.

    In an app context: ``OUTBOX_MESSAGE_ID_DOMAIN`` (as ``init_app`` parsed
    it, or the raw key of an app without the extension), else the domain of
    ``sender`` or of ``MAIL_DEFAULT_SENDER``. Outside one: ``sender``'s.
    ``options``: the :func:`~.ambient.current_options` the caller has read already.
    """
    if options is None:
        options = current_options()
    setting = options.message_id_domain
    if setting:
        try:
            return check_message_id_domain(setting)
        except (ConfigError, TypeError):
            return None  # reported, naming the key, when the message is built
    if sender is None or sender == "":
        sender = options.default_sender
    if isinstance(sender, str):
        return _domain_of_text(sender)
    return _domain_of(sender)


@functools.lru_cache(maxsize=256)
def _domain_of_text(sender: str) -> str | None:
    # Every Message() made without a sender asks for the same one, the app's
    # MAIL_DEFAULT_SENDER: parsed once, not per message.
    return _domain_of(sender)


def _domain_of(sender: object) -> str | None:
    address = bare_address(sender)
    if "@" not in address:
        return None
    try:
        return parse_address(address, True).domain
    except AddressError:
        return None
