"""Named transports (``OUTBOX_TRANSPORTS``): what each one is, validated at ``init_app``.

Each entry names a transport (a built-in or ``module:Class``), its SMTP
settings spelled like Flask-Mail's keys, and its own ``concurrency``,
``rate_limit`` and ``failover`` list. The ``MAIL_*`` keys, ``OUTBOX_TRANSPORT``,
``OUTBOX_CONCURRENCY`` and ``OUTBOX_RATE_LIMIT`` make the implicit ``"default"``
entry; an entry named ``"default"`` replaces it. An entry's SMTP settings never
inherit the app's ``MAIL_*`` values (a second provider must not receive the
first one's password): what it leaves out takes Flask-Mail's defaults.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._config import OutboxConfig

logger = logging.getLogger(__name__)

#: The name of the transport of ``MAIL_*`` / ``OUTBOX_TRANSPORT``, and of every row sent without one.
DEFAULT = "default"
#: A stored transport name is at most this long (the ``transport`` column).
MAX_NAME_LENGTH = 64

#: The SMTP keys an entry may set (read like the app's keys of the same name).
SMTP_KEYS = ("MAIL_SERVER", "MAIL_PORT", "MAIL_USE_TLS", "MAIL_USE_SSL", "MAIL_USERNAME",
             "MAIL_PASSWORD", "MAIL_TIMEOUT")
ENTRY_KEYS = ("transport", *SMTP_KEYS, "rate_limit", "concurrency", "failover")

_PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "min": 60.0, "minute": 60.0,
            "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([a-z]+)\s*$")


@dataclasses.dataclass(frozen=True)
class Rate:
    """A rate limit: ``count`` messages per ``period`` seconds."""

    count: float
    period: float

    @property
    def per_second(self) -> float:
        """Messages per second."""
        return self.count / self.period

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "min", 3600.0: "h", 86400.0: "day"}.get(self.period)
        return f"{self.count:g}/{unit}" if unit else f"{self.per_second:g}/s"


def parse_rate(key: str, value: Any) -> Rate | None:
    """``"14/s"``, ``"600/min"``, ``"1000/h"``, ``"50000/day"``, or a number (per second)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(key, f"must be a positive number of messages per second, "
                                   f"got {value!r}")
        return Rate(float(value), 1.0)
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2) not in _PERIODS:
        raise ConfigError(key, f"expected a rate such as '14/s', '600/min', '1000/h' or "
                               f"'50000/day', got {value!r}")
    count = float(match.group(1))
    if count <= 0:
        raise ConfigError(key, f"must be more than 0 messages, got {value!r}")
    return Rate(count, _PERIODS[match.group(2)])


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    """One named transport, as configured.

    ``smtp`` is a :class:`~._config.SMTPSettings`; ``concurrency`` None means
    ``OUTBOX_CONCURRENCY`` (or ``flask outbox worker --concurrency``).
    """

    name: str
    kind: str
    smtp: Any
    rate: Rate | None = None
    concurrency: int | None = None
    failover: tuple[str, ...] = ()


def check_name(field: str, name: Any) -> str:
    """A transport name as stored: a non-empty string of at most 64 characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise ConfigError(field, f"a transport name is a non-empty string of at most "
                                 f"{MAX_NAME_LENGTH} characters, got {name!r}")
    return name


def named_transports(
        raw: Any, default: TransportSpec, *,
        smtp_of: Callable[[Callable[[str], Any], str], Any],
        kind_of: Callable[[Any, str], str],
        concurrency_of: Callable[[str, Any], int]) -> dict[str, TransportSpec]:
    """Every transport by name, ``"default"`` first (see the module docstring).

    ``smtp_of(get, prefix)`` reads an entry's SMTP settings (``get(key)``
    returns the entry's value or Flask-Mail's default; errors name
    ``prefix + key``); ``kind_of(value, key)`` and ``concurrency_of(key, value)`` check one.
    """
    specs = {DEFAULT: default}
    if raw is None:
        return specs
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("OUTBOX_TRANSPORTS",
                          f"expected a dict of transport name -> settings, got {raw!r}")
    for name, entry in raw.items():
        check_name("OUTBOX_TRANSPORTS", name)
        specs[name] = _entry(name, entry, smtp_of=smtp_of, kind_of=kind_of,
                             concurrency_of=concurrency_of)
    for spec in specs.values():
        for other in spec.failover:
            if other not in specs:
                raise ConfigError(f'OUTBOX_TRANSPORTS["{spec.name}"]["failover"]',
                                  f"names {other!r}, which is not a transport here "
                                  f"(known: {', '.join(sorted(specs))})")
            if other == spec.name:
                raise ConfigError(f'OUTBOX_TRANSPORTS["{spec.name}"]["failover"]',
                                  "a transport cannot fail over to itself")
    return specs


def _entry(name: str, entry: Any, *, smtp_of: Callable[[Callable[[str], Any], str], Any],
           kind_of: Callable[[Any, str], str],
           concurrency_of: Callable[[str, Any], int]) -> TransportSpec:
    prefix = f'OUTBOX_TRANSPORTS["{name}"]'
    if not isinstance(entry, Mapping):
        raise ConfigError(prefix, f"expected a dict of settings, got {entry!r}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS), key=str)
    if unknown:
        raise ConfigError(f'{prefix}["{unknown[0]}"]',
                          f"unknown setting; an entry takes {', '.join(ENTRY_KEYS)}")
    failover = entry.get("failover", ())
    if isinstance(failover, str) or not isinstance(failover, (list, tuple)):
        raise ConfigError(f'{prefix}["failover"]',
                          f"expected a list of transport names, got {failover!r}")
    from ._config import _DEFAULTS

    def get(key: str) -> Any:
        return entry.get(key, _DEFAULTS[key])

    concurrency = entry.get("concurrency")
    return TransportSpec(
        name=name,
        kind=kind_of(entry.get("transport", "smtp"), f'{prefix}["transport"]'),
        smtp=smtp_of(get, prefix),
        rate=parse_rate(f'{prefix}["rate_limit"]', entry.get("rate_limit")),
        concurrency=(None if concurrency is None
                     else concurrency_of(f'{prefix}["concurrency"]', concurrency)),
        failover=tuple(check_name(f'{prefix}["failover"]', n) for n in failover),
    )


def warn_plaintext_logins(config: OutboxConfig) -> None:
    """Warn for each SMTP transport whose login would cross the network unencrypted.

    Flask-Mail logs in whatever the connection, and so does the outbox (a
    relay on the same host is a fair setup); to another host the password
    travels in clear unless ``MAIL_USE_TLS`` or ``MAIL_USE_SSL`` is on.
    """
    if config.suppress_send:
        return
    for spec in config.transport_specs:
        s = spec.smtp
        if spec.kind != "smtp" or not s.username or s.use_tls or s.use_ssl \
                or _is_loopback(s.host):
            continue
        where = "" if spec.name == DEFAULT else f' (OUTBOX_TRANSPORTS["{spec.name}"])'
        logger.warning(
            "MAIL_USERNAME is set but neither MAIL_USE_TLS nor MAIL_USE_SSL is%s: the SMTP "
            "login to %s:%s will send the password unencrypted. Set MAIL_USE_TLS=True "
            "(STARTTLS) or MAIL_USE_SSL=True.", where, s.host, s.port)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
