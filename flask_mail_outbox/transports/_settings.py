"""What a transport is built from: its own settings, never the whole app config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class SMTPSettings:
    """Connection settings of an SMTP transport (Flask-Mail's ``MAIL_*`` keys and the TLS ones)."""

    host: str = "127.0.0.1"
    port: int = 25
    use_tls: bool = False
    use_ssl: bool = False
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    timeout: float = 10.0
    tls_verify: bool = True
    tls_ca_file: str | None = None


@dataclasses.dataclass(frozen=True)
class TransportSettings:
    """One configured transport's settings, as :meth:`Transport.from_settings` receives them.

    ``name`` is its name in ``OUTBOX_TRANSPORTS`` (``"default"`` for the
    ``MAIL_*`` keys); ``smtp`` its SMTP settings; ``file_path`` the folder of
    the ``file`` transport; ``concurrency`` the sends in flight it may keep per
    process; ``options`` the entry's other keys, for custom transports.
    """

    name: str = "default"
    smtp: SMTPSettings = SMTPSettings()
    file_path: str = "outbox-mail"
    concurrency: int = 4
    #: Not in the repr: an API key is one of them.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
