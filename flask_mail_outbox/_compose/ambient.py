"""The settings a message is built with when nobody passes them: the app's, or neutral ones.

``Message(...)`` built inside an app fills its sender and Message-ID domain
from that app's settings, and ``as_bytes()`` renders what ``send()`` would
store. This layer knows no Flask: the integration installs a provider
(:func:`set_provider`) that reads the current app, and without one, or
outside an app, the neutral :data:`NEUTRAL` options apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .links import UnsubscribeLinks

#: ``OUTBOX_MAX_MESSAGE_BYTES``'s default.
DEFAULT_MAX_MESSAGE_BYTES = 25 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ComposeOptions:
    """How messages are built: the message-related settings of one app."""

    default_sender: str | tuple[str, str] | None = None
    allow_local_addresses: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: As configured: checked when a message uses it (a bad one is reported then).
    message_id_domain: object = None
    ascii_attachments: bool = False
    html_to_text: bool = True
    allow_smtputf8: bool = False
    #: Makes ``list_unsubscribe=True``'s URL (None: OUTBOX_UNSUBSCRIBE_URL is not set).
    unsubscribe_links: UnsubscribeLinks | None = None


#: The options outside any app.
NEUTRAL = ComposeOptions()

_provider: Callable[[], ComposeOptions | None] | None = None


def set_provider(provider: Callable[[], ComposeOptions | None]) -> None:
    """Install the function that returns the current options (None: neutral ones)."""
    global _provider
    _provider = provider


def current_options() -> ComposeOptions:
    """The options in force here: the provider's, else :data:`NEUTRAL`."""
    provider = _provider
    options = provider() if provider is not None else None
    return NEUTRAL if options is None else options
