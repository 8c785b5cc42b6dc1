"""Reading and validating configuration, once, in ``init_app``.

Every ``MAIL_*`` / ``OUTBOX_*`` key is read here into a frozen
:class:`OutboxConfig`. A value that cannot work raises :class:`ConfigError`
naming the key, so a typo fails at start-up instead of at the first email.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .._compose.addresses import AddressError, parse_address
from .._compose.dkim import DKIMSigner, signed_header_names, signer_from
from .._compose.links import UnsubscribeLinks
from .._compose.verp import VerpAddresses
from .._errors import ConfigError
from .._policy import SoftBounceRule
from .._providers import PROVIDERS
from .._tracing import settings_from
from .._webhooks import receiver_class
from ..transports import (
    SMTPSettings,
    TransportSettings,
    is_builtin,
    transport_class,
)
from ._intercept import AllowList, allow_pattern
from ._settings import DEFAULT_TRANSPORT, OutboxConfig, Rate, TransportSpec

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024

#: A stored transport name is at most this long (the ``transport`` column).
MAX_NAME_LENGTH = 64

#: The SMTP keys an entry may set (read like the app's keys of the same name).
SMTP_KEYS = ("MAIL_SERVER", "MAIL_PORT", "MAIL_USE_TLS", "MAIL_USE_SSL", "MAIL_USERNAME",
             "MAIL_PASSWORD", "MAIL_TIMEOUT")
#: The keys every entry takes, whatever its kind.
GENERAL_KEYS = ("transport", "rate_limit", "concurrency", "failover", "webhook_secret")
ENTRY_KEYS = (*GENERAL_KEYS, *SMTP_KEYS)

_PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "min": 60.0, "minute": 60.0,
            "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([a-z]+)\s*$")

# Flask-Mail's keys keep Flask-Mail's defaults; the outbox's own keys are described in
# docs/_ext/config_descriptions.py, rendered on docs/configuration.md (tests/test_docs.py
# checks both ways). ``None`` for OUTBOX_SWEEP_INTERVAL_SECONDS means "by mode".
_DEFAULTS: dict[str, Any] = {
    "MAIL_SERVER": "127.0.0.1",
    "MAIL_PORT": 25,
    "MAIL_USE_TLS": False,
    "MAIL_USE_SSL": False,
    "MAIL_USERNAME": None,
    "MAIL_PASSWORD": None,
    "MAIL_DEFAULT_SENDER": None,
    "MAIL_ASCII_ATTACHMENTS": False,
    "MAIL_TIMEOUT": 10.0,
    "OUTBOX_TRANSPORT": "smtp",
    "OUTBOX_FILE_PATH": None,
    "OUTBOX_DURABLE": False,
    # 1 min, 2, 4, ... capped at an hour: a greylisting server (5-15 min) is
    # passed by the 4th or 5th attempt, and 30 attempts keep trying for about a
    # day, so a provider outage of hours dead-letters nothing (the table in docs/guide/modes.md).
    "OUTBOX_MAX_ATTEMPTS": 30,
    "OUTBOX_INLINE_RETRIES": 3,
    "OUTBOX_RETRY_BASE_SECONDS": 60.0,
    "OUTBOX_RETRY_MAX_SECONDS": 3600.0,
    "OUTBOX_MAX_THROTTLE_DEFERRALS": 10,
    # Retries of an attempt that may have been delivered (a drop after the final
    # dot, a provider's timeout after the request went): each may be a copy.
    "OUTBOX_AMBIGUOUS_RETRIES": 1,
    # A paused transport (refused credentials, a spent quota, an unverified sender,
    # unreachable) is probed after 30 s, doubling to 10 min; its emails wait, and
    # end failed after Postfix's maximal_queue_lifetime, 5 days (None: never).
    "OUTBOX_PAUSE_PROBE_SECONDS": 30.0,
    "OUTBOX_PAUSE_PROBE_MAX_SECONDS": 600.0,
    "OUTBOX_MAX_QUEUE_LIFETIME_SECONDS": 5 * 86400.0,
    "OUTBOX_LEASE_SECONDS": 30.0,
    "OUTBOX_BATCH_SIZE": 100,
    "OUTBOX_CONCURRENCY": 4,
    "OUTBOX_POLL_INTERVAL": 0.5,
    "OUTBOX_POLL_MAX_INTERVAL": 30.0,
    "OUTBOX_LISTEN": True,
    "OUTBOX_LISTEN_URL": None,
    "OUTBOX_LISTEN_BACKSTOP_SECONDS": 120.0,
    "OUTBOX_RUN_WORKER": True,
    "OUTBOX_RATE_LIMIT": None,
    # Named transports: {name: {"transport": ..., MAIL_* keys, "rate_limit": "14/s",
    # "concurrency": n, "failover": [names]}}; MAIL_*/OUTBOX_TRANSPORT are "default".
    "OUTBOX_TRANSPORTS": None,
    "OUTBOX_SWEEP_ON_STARTUP": True,
    "OUTBOX_SWEEP_MIN_AGE_SECONDS": 300.0,
    "OUTBOX_SWEEP_BATCH": 500,
    "OUTBOX_SWEEP_INTERVAL_SECONDS": None,
    "OUTBOX_SETTINGS_TTL_SECONDS": 5.0,
    "OUTBOX_MAX_MESSAGE_BYTES": 25 * _MIB,
    "OUTBOX_ALLOW_LOCAL_ADDRESSES": False,
    "OUTBOX_MESSAGE_ID_DOMAIN": None,
    # An html message without ``body`` gets a text/plain rendering of the html.
    "OUTBOX_HTML_TO_TEXT": True,
    # RFC 6531 addresses (non-ASCII local parts), sent with SMTPUTF8.
    "OUTBOX_ALLOW_SMTPUTF8": False,
    # DKIM signing at delivery: on when a key is set.
    "OUTBOX_DKIM_DOMAIN": None,
    "OUTBOX_DKIM_SELECTOR": None,
    "OUTBOX_DKIM_PRIVATE_KEY": None,
    "OUTBOX_DKIM_PRIVATE_KEY_FILE": None,
    "OUTBOX_DKIM_HEADERS": None,  # None: _dkim.DEFAULT_SIGNED_HEADERS
    "OUTBOX_DKIM_KEYS": None,  # [{"selector", "private_key" or "private_key_file"}]: dual signing
    "OUTBOX_TLS_VERIFY": True,
    "OUTBOX_TLS_CA_FILE": None,
    "OUTBOX_RETENTION_DAYS": None,
    "OUTBOX_SCRUB_SENT": False,
    "OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS": 600.0,
    # Soft bounces (docs/events.md#soft-bounces): this many of one address within the
    # window suppress it for this long; 0 in any of them: soft bounces never suppress.
    "OUTBOX_SOFT_BOUNCE_LIMIT": 3,
    "OUTBOX_SOFT_BOUNCE_WINDOW_DAYS": 7.0,
    "OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS": 14.0,
    # Provider webhooks: POST <prefix>/<transport name>, for each transport with a
    # webhook_secret in its OUTBOX_TRANSPORTS entry.
    "OUTBOX_WEBHOOK_PREFIX": "/outbox/webhooks",
    # One-click unsubscribe (list_unsubscribe=True): an absolute https URL, whose
    # path is the route; None: list_unsubscribe=True is refused.
    "OUTBOX_UNSUBSCRIBE_URL": None,
    # VERP: SMTP envelope senders bounces+<signed token>@domain (None: the sender).
    "OUTBOX_BOUNCE_ADDRESS": None,
    # mail.send_template(): the folder of email templates in the app's Jinja loader,
    # CSS inlining of templated HTML (the `templates` extra), the locales emails are
    # written in (None: Flask-Babel's translations), and the longest subject
    # `flask outbox templates check` lets through.
    "OUTBOX_TEMPLATE_FOLDER": "email",
    "OUTBOX_TEMPLATE_INLINE_CSS": True,
    "OUTBOX_TEMPLATE_LOCALES": None,
    "OUTBOX_TEMPLATE_MAX_SUBJECT": 78,
    # Staging (docs/guide/staging.md): every email to these addresses instead, and
    # the only recipients mail may go to ("user@domain", "*@domain"); None: off.
    "OUTBOX_REDIRECT_TO": None,
    "OUTBOX_ALLOWED_RECIPIENTS": None,
    # OpenTelemetry tracing and metrics (flask_mail_outbox/_tracing.py): None means
    # {"enabled": "auto", "metrics": "auto"}.
    "OUTBOX_OTEL": None,
    # What delivers committed emails: this library's dispatcher, or the workers of a
    # task queue the app already runs ("celery", "rq", "dramatiq"; docs/executors/index.md).
    "OUTBOX_EXECUTOR": "dispatcher",
    "OUTBOX_EXECUTOR_QUEUE": "outbox",
    # The broker's URL where the engine has no app of its own (RQ, Dramatiq): redis://...
    "OUTBOX_EXECUTOR_URL": None,
    # Not a Flask-Mail key: lets a process that imports the
    # app without serving it (a script, a test) skip the sweep jobs.
    "OUTBOX_RUN_SCHEDULER": True,
}


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"0", "false", "no", "off", ""}:
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(key, f"expected True or False, got {value!r}")


def _number(key: str, value: Any, *, minimum: float, integer: bool = False,
            allow_none: bool = False, strict_minimum: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"expected a finite number, got {value!r}")
    if integer and value != int(value):
        raise ConfigError(key, f"expected a whole number, got {value!r}")
    if value < minimum or (strict_minimum and value == minimum):
        relation = "greater than" if strict_minimum else "at least"
        raise ConfigError(key, f"must be {relation} {minimum:g}, got {value!r}")
    return int(value) if integer else float(value)


def _optional_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"expected a non-empty string or None, got {value!r}")
    return value


def _password(value: Any) -> str | None:
    # Never echo the value: a wrong type is still somebody's password.
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigError("MAIL_PASSWORD", f"expected a non-empty string or None, got "
                                       f"{'an empty string' if value == '' else type(value).__name__}")


def _sender(value: Any) -> str | tuple[str, str] | None:
    if value is None or isinstance(value, str):
        return value or None
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(part, str) for part in value)):
        return (value[0], value[1])
    raise ConfigError("MAIL_DEFAULT_SENDER",
                      f"expected 'addr@example.com' or ('Name', 'addr@example.com'), got {value!r}")


class _Keys:
    """``app.config`` read one key at a time, a key not set at its default (``_DEFAULTS``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config

    def get(self, key: str) -> Any:
        return self._config.get(key, _DEFAULTS[key])

    def flag(self, key: str) -> bool:
        return _bool(key, self.get(key))

    def number(self, key: str, *, minimum: float, integer: bool = False,
               allow_none: bool = False, strict_minimum: bool = False) -> Any:
        return _number(key, self.get(key), minimum=minimum, integer=integer,
                       allow_none=allow_none, strict_minimum=strict_minimum)

    def text(self, key: str) -> str | None:
        return _optional_str(key, self.get(key))


def load_config(config: Mapping[str, Any], *, instance_path: str,
                testing: bool) -> OutboxConfig:
    """Validate ``app.config`` and return the frozen settings.

    Raises :class:`ConfigError` naming the first bad key.
    """
    keys = _Keys(config)
    suppress = config.get("MAIL_SUPPRESS_SEND", testing)
    smtp = _smtp_settings(keys.get)
    file_path = _file_path(keys, instance_path)
    poll, poll_max = _poll_intervals(keys)
    base, retry_max = _retry_delays(keys)
    domain = _message_id_domain(keys)
    unsubscribe_url = _unsubscribe_url(keys.get("OUTBOX_UNSUBSCRIBE_URL"))
    return OutboxConfig(
        default_sender=_sender(keys.get("MAIL_DEFAULT_SENDER")),
        ascii_attachments=keys.flag("MAIL_ASCII_ATTACHMENTS"),
        suppress_send=_bool("MAIL_SUPPRESS_SEND", suppress),
        durable=keys.flag("OUTBOX_DURABLE"),
        max_attempts=keys.number("OUTBOX_MAX_ATTEMPTS", minimum=1, integer=True),
        inline_retries=keys.number("OUTBOX_INLINE_RETRIES", minimum=0, integer=True),
        retry_base_seconds=base,
        retry_max_seconds=retry_max,
        max_throttle_deferrals=keys.number("OUTBOX_MAX_THROTTLE_DEFERRALS", minimum=0,
                                           integer=True),
        ambiguous_retries=keys.number("OUTBOX_AMBIGUOUS_RETRIES", minimum=0, integer=True),
        lease_seconds=keys.number("OUTBOX_LEASE_SECONDS", minimum=1),
        batch_size=keys.number("OUTBOX_BATCH_SIZE", minimum=1, integer=True),
        concurrency=_concurrency(keys),
        poll_interval=poll,
        poll_max_interval=poll_max,
        listen=keys.flag("OUTBOX_LISTEN"),
        listen_url=keys.text("OUTBOX_LISTEN_URL"),
        listen_backstop_seconds=keys.number("OUTBOX_LISTEN_BACKSTOP_SECONDS", minimum=0,
                                            strict_minimum=True),
        run_worker=keys.flag("OUTBOX_RUN_WORKER"),
        transport_specs=_transport_specs(keys, smtp, file_path),
        sweep_on_startup=keys.flag("OUTBOX_SWEEP_ON_STARTUP"),
        sweep_min_age_seconds=keys.number("OUTBOX_SWEEP_MIN_AGE_SECONDS", minimum=0),
        sweep_batch=keys.number("OUTBOX_SWEEP_BATCH", minimum=1, integer=True),
        sweep_interval_seconds=keys.number("OUTBOX_SWEEP_INTERVAL_SECONDS", minimum=0,
                                           strict_minimum=True, allow_none=True),
        settings_ttl_seconds=keys.number("OUTBOX_SETTINGS_TTL_SECONDS", minimum=0),
        max_message_bytes=keys.number("OUTBOX_MAX_MESSAGE_BYTES", minimum=1, integer=True),
        allow_local_addresses=keys.flag("OUTBOX_ALLOW_LOCAL_ADDRESSES"),
        message_id_domain=domain,
        retention_days=keys.number("OUTBOX_RETENTION_DAYS", minimum=0, strict_minimum=True,
                                   allow_none=True),
        scrub_sent=keys.flag("OUTBOX_SCRUB_SENT"),
        health_max_queued_age_seconds=keys.number("OUTBOX_HEALTH_MAX_QUEUED_AGE_SECONDS",
                                                  minimum=0, strict_minimum=True),
        run_scheduler=keys.flag("OUTBOX_RUN_SCHEDULER"),
        soft_bounces=_soft_bounces(keys),
        html_to_text=keys.flag("OUTBOX_HTML_TO_TEXT"),
        allow_smtputf8=keys.flag("OUTBOX_ALLOW_SMTPUTF8"),
        dkim=_dkim_signer(keys),
        webhook_prefix=_url_path("OUTBOX_WEBHOOK_PREFIX", keys.get("OUTBOX_WEBHOOK_PREFIX")),
        unsubscribe_url=unsubscribe_url,
        unsubscribe_links=_unsubscribe_links(config, unsubscribe_url),
        verp=_verp(config, keys.get("OUTBOX_BOUNCE_ADDRESS")),
        template_folder=_template_folder(keys.get("OUTBOX_TEMPLATE_FOLDER")),
        template_inline_css=keys.flag("OUTBOX_TEMPLATE_INLINE_CSS"),
        template_locales=_template_locales(keys.get("OUTBOX_TEMPLATE_LOCALES")),
        template_max_subject=keys.number("OUTBOX_TEMPLATE_MAX_SUBJECT", minimum=1,
                                         integer=True),
        otel=settings_from(keys.get("OUTBOX_OTEL")),
        **_executor(keys),
        **_staging(keys),
        **_pause_settings(keys),
    )


#: OUTBOX_EXECUTOR's values: the library's own dispatcher, or a task queue's workers.
EXECUTORS = ("dispatcher", "celery", "rq", "dramatiq")


def _executor(keys: _Keys) -> dict[str, Any]:
    """OUTBOX_EXECUTOR, _QUEUE and _URL: what delivers committed emails (core/_executor.py)."""
    name = keys.get("OUTBOX_EXECUTOR")
    if name not in EXECUTORS:
        raise ConfigError("OUTBOX_EXECUTOR", f"expected one of {', '.join(map(repr, EXECUTORS))}, "
                                             f"got {name!r}")
    queue = keys.text("OUTBOX_EXECUTOR_QUEUE")
    if not queue or not queue.strip() or queue != queue.strip():
        raise ConfigError("OUTBOX_EXECUTOR_QUEUE", f"expected a queue name such as 'outbox', "
                                                   f"got {queue!r}")
    return {"executor": name, "executor_queue": queue,
            "executor_url": keys.text("OUTBOX_EXECUTOR_URL")}


def _soft_bounces(keys: _Keys) -> SoftBounceRule:
    """OUTBOX_SOFT_BOUNCE_*: the bounded suppression of repeated soft bounces."""
    days = {}
    for key in ("OUTBOX_SOFT_BOUNCE_WINDOW_DAYS", "OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS"):
        days[key] = keys.number(key, minimum=0)
        if days[key] > _MAX_SOFT_BOUNCE_DAYS:  # bounded: a time the databases can store
            raise ConfigError(key, f"must be at most {_MAX_SOFT_BOUNCE_DAYS} days, got "
                                   f"{days[key]:g}")
    return SoftBounceRule(
        limit=keys.number("OUTBOX_SOFT_BOUNCE_LIMIT", minimum=0, integer=True),
        window_seconds=days["OUTBOX_SOFT_BOUNCE_WINDOW_DAYS"] * 86400.0,
        suppress_seconds=days["OUTBOX_SOFT_BOUNCE_SUPPRESS_DAYS"] * 86400.0)


#: The longest soft-bounce window or suppression (days): ten years.
_MAX_SOFT_BOUNCE_DAYS = 3650


def _pause_settings(keys: _Keys) -> dict[str, Any]:
    """The paused transport's probe backoff and the queue lifetime (see core/_pause.py)."""
    probe = keys.number("OUTBOX_PAUSE_PROBE_SECONDS", minimum=0, strict_minimum=True)
    probe_max = keys.number("OUTBOX_PAUSE_PROBE_MAX_SECONDS", minimum=0, strict_minimum=True)
    if probe_max < probe:
        raise ConfigError("OUTBOX_PAUSE_PROBE_MAX_SECONDS",
                          f"must be at least OUTBOX_PAUSE_PROBE_SECONDS ({probe:g}), got "
                          f"{probe_max:g}")
    return {"pause_probe_seconds": float(probe), "pause_probe_max_seconds": float(probe_max),
            "max_queue_lifetime_seconds": keys.number(
                "OUTBOX_MAX_QUEUE_LIFETIME_SECONDS", minimum=0, allow_none=True)}


def _staging(keys: _Keys) -> dict[str, Any]:
    """OUTBOX_REDIRECT_TO and OUTBOX_ALLOWED_RECIPIENTS, checked against each other."""
    allow_local = keys.flag("OUTBOX_ALLOW_LOCAL_ADDRESSES")
    allowed = _allowed_recipients(keys.get("OUTBOX_ALLOWED_RECIPIENTS"), allow_local)
    redirect = _redirect_to(keys.get("OUTBOX_REDIRECT_TO"), allow_local)
    if redirect and allowed is not None:
        allow_list = AllowList(allowed)
        outside = [address for address in redirect if not allow_list.allows(address)]
        if outside:
            raise ConfigError("OUTBOX_REDIRECT_TO", f"{', '.join(outside)} is outside "
                              "OUTBOX_ALLOWED_RECIPIENTS, so every redirected email would be "
                              "blocked: add it there, or redirect elsewhere")
    return {"redirect_to": redirect, "allowed_recipients": allowed}


def _address_items(key: str, value: Any, example: str) -> list[Any]:
    """A non-empty list (or tuple) of a staging key; ConfigError naming ``key`` otherwise."""
    if isinstance(value, str):
        raise ConfigError(key, f"expected a list, got the string {value!r}; write [{value!r}]")
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(key, f"expected a non-empty list such as {example}, or None for "
                               f"none, got {value!r}")
    return list(value)


def _redirect_to(value: Any, allow_local: bool) -> tuple[str, ...] | None:
    """OUTBOX_REDIRECT_TO: None, or bare addresses (ASCII, as a header must carry them)."""
    key = "OUTBOX_REDIRECT_TO"
    if value is None:
        return None
    addresses: list[str] = []
    for item in _address_items(key, value, "['qa@example.com']"):
        if not isinstance(item, str) or "<" in item:
            raise ConfigError(key, f"expected bare addresses such as 'qa@example.com', "
                                   f"got {item!r}")
        try:
            address = parse_address(item.strip(), allow_local).ascii
        except AddressError as exc:
            hint = ("; set OUTBOX_ALLOW_LOCAL_ADDRESSES = True for a local or test domain"
                    if not allow_local else "")
            raise ConfigError(key, f"{item!r} is not a valid email address ({exc}){hint}") \
                from None
        if address not in addresses:
            addresses.append(address)
    return tuple(addresses)


def _allowed_recipients(value: Any, allow_local: bool) -> tuple[str, ...] | None:
    """OUTBOX_ALLOWED_RECIPIENTS: None, or 'user@domain' and '*@domain' patterns."""
    key = "OUTBOX_ALLOWED_RECIPIENTS"
    if value is None:
        return None
    patterns: list[str] = []
    for item in _address_items(key, value, "['*@example.com', 'qa@example.org']"):
        try:
            pattern = allow_pattern(item, allow_local=allow_local)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
        if pattern not in patterns:
            patterns.append(pattern)
    return tuple(patterns)


def _template_folder(value: Any) -> str:
    """OUTBOX_TEMPLATE_FOLDER: a relative folder of the Jinja loader, "/"-separated."""
    key = "OUTBOX_TEMPLATE_FOLDER"
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a folder name such as 'email', got {value!r}")
    folder = value.strip("/")
    if not folder or any(part in ("", ".", "..") for part in folder.split("/")) or "\\" in folder:
        raise ConfigError(key, f"expected a relative folder such as 'email', got {value!r}")
    return folder


def _template_locales(value: Any) -> tuple[str, ...] | None:
    """OUTBOX_TEMPLATE_LOCALES: None, or a non-empty list of locale names ("en", "pt_BR")."""
    key = "OUTBOX_TEMPLATE_LOCALES"
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(key, f"expected a list of locales such as ['en', 'de'], got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(key, f"expected locale names (str), got {item!r}")
    return tuple(item.strip() for item in value)


#: The most SMTP connections one process opens per transport (``--concurrency`` too).
MAX_CONCURRENCY = 256


def _concurrency(keys: _Keys) -> int:
    """OUTBOX_CONCURRENCY: connections per process (a stream's sends in flight)."""
    return _concurrency_value("OUTBOX_CONCURRENCY", keys.get("OUTBOX_CONCURRENCY"))


def _concurrency_value(key: str, value: Any) -> int:
    checked: int = _number(key, value, minimum=1, integer=True)
    if checked > MAX_CONCURRENCY:
        raise ConfigError(key, f"must be at most {MAX_CONCURRENCY}, got {value!r}")
    return checked


def _transport_specs(keys: _Keys, smtp: SMTPSettings,
                     file_path: str) -> tuple[TransportSpec, ...]:
    """OUTBOX_TRANSPORTS, with the ``MAIL_*`` / ``OUTBOX_*`` keys as the implicit default.

    Each entry names a transport (a built-in or ``module:Class``), its SMTP
    settings spelled like Flask-Mail's keys, and its own ``concurrency``,
    ``rate_limit`` and ``failover`` list; an entry named ``"default"`` replaces
    the implicit one. An entry's SMTP settings never inherit the app's
    ``MAIL_*`` values (a second provider must not receive the first one's
    password): what it leaves out takes Flask-Mail's defaults.
    """
    kind = keys.get("OUTBOX_TRANSPORT")
    cls = transport_class(kind, "OUTBOX_TRANSPORT")
    if cls.entry_keys() is not None:
        raise ConfigError("OUTBOX_TRANSPORT", f"a {kind} transport needs settings of its own: "
                          f"configure it as OUTBOX_TRANSPORTS = {{'default': {{'transport': "
                          f"{kind!r}, ...}}}} instead")
    specs = {DEFAULT_TRANSPORT: TransportSpec(
        name=DEFAULT_TRANSPORT, kind=kind, cls=cls,
        settings=TransportSettings(name=DEFAULT_TRANSPORT, smtp=smtp, file_path=file_path),
        rate=parse_rate("OUTBOX_RATE_LIMIT", keys.number(
            "OUTBOX_RATE_LIMIT", minimum=0, strict_minimum=True, allow_none=True)))}
    raw = keys.get("OUTBOX_TRANSPORTS")
    if raw is None:
        return tuple(specs.values())
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("OUTBOX_TRANSPORTS",
                          f"expected a dict of transport name -> settings, got {raw!r}")
    for name, entry in raw.items():
        check_name("OUTBOX_TRANSPORTS", name)
        specs[name] = _entry(name, entry, keys, file_path)
    for spec in specs.values():
        for other in spec.failover:
            if other not in specs:
                raise ConfigError(f'OUTBOX_TRANSPORTS["{spec.name}"]["failover"]',
                                  f"names {other!r}, which is not a transport here "
                                  f"(known: {', '.join(sorted(specs))})")
            if other == spec.name:
                raise ConfigError(f'OUTBOX_TRANSPORTS["{spec.name}"]["failover"]',
                                  "a transport cannot fail over to itself")
    return tuple(specs.values())


def _entry(name: str, entry: Any, keys: _Keys, file_path: str) -> TransportSpec:
    prefix = f'OUTBOX_TRANSPORTS["{name}"]'
    if not isinstance(entry, Mapping):
        raise ConfigError(prefix, f"expected a dict of settings, got {entry!r}")
    kind = entry.get("transport", "smtp")
    cls = transport_class(kind, f'{prefix}["transport"]')
    own = cls.entry_keys()
    allowed = ENTRY_KEYS if own is None else (*GENERAL_KEYS, *own)
    unknown = sorted(set(entry) - set(allowed), key=str)
    if unknown and is_builtin(kind):
        raise ConfigError(f'{prefix}["{unknown[0]}"]',
                          f"unknown setting; a {kind} entry takes {', '.join(allowed)}")
    # A kind's own keys, and a custom transport's, reach it as ``settings.options``.
    options = {key: entry[key] for key in entry if key not in ENTRY_KEYS}
    cls.check_settings(options, prefix)
    failover = entry.get("failover", ())
    if isinstance(failover, str) or not isinstance(failover, (list, tuple)):
        raise ConfigError(f'{prefix}["failover"]',
                          f"expected a list of transport names, got {failover!r}")

    def get(key: str) -> Any:
        # TLS verification stays the app's: one trust policy per app.
        return keys.get(key) if key.startswith("OUTBOX_TLS_") else entry.get(key, _DEFAULTS[key])

    concurrency = entry.get("concurrency")
    secret = entry.get("webhook_secret")
    if secret is not None:
        receiver = receiver_class(kind)
        if receiver is None:
            raise ConfigError(f'{prefix}["webhook_secret"]',
                              f"a {kind} transport has no provider webhooks ("
                              f"{', '.join(PROVIDERS)} have); feed its events to "
                              "mail.record_event() from a route of your own")
        receiver.check_secret(secret, f'{prefix}["webhook_secret"]')
    return TransportSpec(
        name=name,
        kind=kind,
        cls=cls,
        settings=TransportSettings(
            name=name, smtp=_smtp_settings(get, prefix) if own is None else SMTPSettings(),
            file_path=file_path, options=options),
        rate=parse_rate(f'{prefix}["rate_limit"]', entry.get("rate_limit")),
        concurrency=(None if concurrency is None
                     else _concurrency_value(f'{prefix}["concurrency"]', concurrency)),
        failover=tuple(check_name(f'{prefix}["failover"]', n) for n in failover),
        webhook_secret=secret,
    )


def _smtp_settings(get: Any, prefix: str = "") -> SMTPSettings:
    """The ``smtp`` transport's settings, from Flask-Mail's keys and the TLS ones.

    ``get(key)`` reads a key; errors name ``prefix + key`` (a named transport's entry).
    """
    def field(key: str) -> str:
        return f'{prefix}["{key}"]' if prefix else key

    def number(key: str, **kw: Any) -> Any:
        return _number(field(key), get(key), **kw)

    port = number("MAIL_PORT", minimum=1, integer=True)
    if port > 65535:
        raise ConfigError(field("MAIL_PORT"), f"must be at most 65535, got {port!r}")
    use_tls = _bool(field("MAIL_USE_TLS"), get("MAIL_USE_TLS"))
    use_ssl = _bool(field("MAIL_USE_SSL"), get("MAIL_USE_SSL"))
    if use_tls and use_ssl:
        raise ConfigError(field("MAIL_USE_TLS"),
                          "MAIL_USE_TLS (STARTTLS) and MAIL_USE_SSL (implicit TLS) are exclusive; "
                          "use MAIL_USE_SSL with port 465 or MAIL_USE_TLS with port 587")
    host = get("MAIL_SERVER")
    if not isinstance(host, str) or not host:
        raise ConfigError(field("MAIL_SERVER"), f"expected a host name, got {host!r}")
    password = get("MAIL_PASSWORD")
    if prefix and password is not None and not (isinstance(password, str) and password):
        raise ConfigError(field("MAIL_PASSWORD"), "expected a non-empty string or None")
    return SMTPSettings(
        host=host,
        port=port,
        use_tls=use_tls,
        use_ssl=use_ssl,
        username=_optional_str(field("MAIL_USERNAME"), get("MAIL_USERNAME")),
        password=password if prefix else _password(password),
        timeout=number("MAIL_TIMEOUT", minimum=0, strict_minimum=True),
        tls_verify=_bool("OUTBOX_TLS_VERIFY", get("OUTBOX_TLS_VERIFY")),
        tls_ca_file=_optional_str("OUTBOX_TLS_CA_FILE", get("OUTBOX_TLS_CA_FILE")),
    )


def _file_path(keys: _Keys, instance_path: str) -> str:
    """The ``file`` transport's folder: ``OUTBOX_FILE_PATH``, or one in the instance folder."""
    file_path = keys.get("OUTBOX_FILE_PATH")
    if file_path is None:
        return f"{instance_path}/outbox-mail"
    if not isinstance(file_path, str) or not file_path:
        raise ConfigError("OUTBOX_FILE_PATH", f"expected a folder path, got {file_path!r}")
    return file_path


def _poll_intervals(keys: _Keys) -> tuple[float, float]:
    """The idle poll's first and longest interval, the longest no shorter than the first."""
    poll = keys.number("OUTBOX_POLL_INTERVAL", minimum=0, strict_minimum=True)
    poll_max = keys.number("OUTBOX_POLL_MAX_INTERVAL", minimum=0, strict_minimum=True)
    if poll_max < poll:
        raise ConfigError("OUTBOX_POLL_MAX_INTERVAL",
                          f"must be at least OUTBOX_POLL_INTERVAL ({poll:g}), got {poll_max:g}")
    return poll, poll_max


def _retry_delays(keys: _Keys) -> tuple[float, float]:
    """The retry backoff's first and longest delay, the longest no shorter than the first."""
    base = keys.number("OUTBOX_RETRY_BASE_SECONDS", minimum=0)
    retry_max = keys.number("OUTBOX_RETRY_MAX_SECONDS", minimum=0)
    if retry_max < base:
        raise ConfigError("OUTBOX_RETRY_MAX_SECONDS",
                          f"must be at least OUTBOX_RETRY_BASE_SECONDS ({base:g}), got {retry_max:g}")
    return base, retry_max


def _dkim_signer(keys: _Keys) -> DKIMSigner | None:
    """The ``OUTBOX_DKIM_*`` keys, each private key read: None when DKIM is off.

    ``init_app`` then signs a probe with each key.
    """
    headers = signed_header_names(keys.get("OUTBOX_DKIM_HEADERS"))
    return signer_from(keys.text, keys.get("OUTBOX_DKIM_PRIVATE_KEY"),
                       keys.get("OUTBOX_DKIM_PRIVATE_KEY_FILE"), headers,
                       keys.get("OUTBOX_DKIM_KEYS"))


def _message_id_domain(keys: _Keys) -> str | None:
    """``OUTBOX_MESSAGE_ID_DOMAIN``: None, or a name that fits in a Message-ID."""
    domain = keys.text("OUTBOX_MESSAGE_ID_DOMAIN")
    if domain is not None and any(c in domain for c in "\r\n\0<>@ "):
        raise ConfigError("OUTBOX_MESSAGE_ID_DOMAIN", f"not a domain name: {domain!r}")
    return domain


def _url_path(key: str, value: Any) -> str:
    """A URL path prefix: starts with "/", no trailing "/", no query."""
    if not isinstance(value, str) or not value.startswith("/") or len(value) < 2 \
            or any(c in value for c in "?#<> \t\n") or "//" in value:
        raise ConfigError(key, f"expected a URL path such as '/outbox/webhooks', got {value!r}")
    return value.rstrip("/")


def _unsubscribe_url(value: Any) -> str | None:
    """OUTBOX_UNSUBSCRIBE_URL: None, or an absolute https URL without query or fragment."""
    key = "OUTBOX_UNSUBSCRIBE_URL"
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(key, f"expected an https URL, got {value!r}")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme != "https" or not parts.hostname:
        raise ConfigError(key, f"expected an absolute https URL (RFC 8058 one-click "
                          f"unsubscribe needs https), got {value!r}")
    if parts.query or parts.fragment or not value.isascii() or " " in value:
        raise ConfigError(key, f"expected a URL without query, fragment or spaces, got {value!r}")
    if not parts.path.strip("/"):
        raise ConfigError(key, f"expected a URL with a path (its path is the unsubscribe "
                          f"route, e.g. https://app.example.com/outbox/unsubscribe), got "
                          f"{value!r}")
    _url_path(key, parts.path)
    return value.rstrip("/")


#: The longest local part of OUTBOX_BOUNCE_ADDRESS: "+", a BIGINT id, "-" and the
#: 16-character signature must fit RFC 5321's 64 octets.
MAX_BOUNCE_LOCAL_PART = 64 - (1 + 19 + 1 + 16)


def _verp(config: Mapping[str, Any], value: Any) -> VerpAddresses | None:
    """OUTBOX_BOUNCE_ADDRESS: a plain ASCII address whose local part leaves room for a token."""
    key = "OUTBOX_BOUNCE_ADDRESS"
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(key, f"expected an address such as 'bounces@example.com', got "
                          f"{value!r}")
    try:
        addr = parse_address(value.strip(), True)
    except AddressError as exc:
        raise ConfigError(key, f"{value!r} is not an email address ({exc})") from None
    local = addr.ascii.rpartition("@")[0]
    if "+" in local or len(local) > MAX_BOUNCE_LOCAL_PART:
        raise ConfigError(key, f"the local part must be at most {MAX_BOUNCE_LOCAL_PART} "
                          "characters without '+': the outbox appends '+<token>' to it "
                          "(RFC 5321 allows 64 in all)")
    return VerpAddresses(addr.ascii, _secret_keys(config, key, "the VERP tokens are signed"))


def _unsubscribe_links(config: Mapping[str, Any], url: str | None) -> UnsubscribeLinks | None:
    """The one-click URL maker: OUTBOX_UNSUBSCRIBE_URL signed with SECRET_KEY (and fallbacks)."""
    if url is None:
        return None
    return UnsubscribeLinks(url, _secret_keys(config, "OUTBOX_UNSUBSCRIBE_URL",
                                              "the one-click links are sealed"))


def _secret_keys(config: Mapping[str, Any], key: str, what: str) -> tuple[str | bytes, ...]:
    """SECRET_KEY_FALLBACKS then SECRET_KEY, each a non-empty str or bytes.

    A str given as the fallbacks would be read character by character, each a one-letter
    key (and an empty key is a known one): anyone could then make a VERP address (a
    forged bounce suppresses) or an unsubscribe link for any address. Refused instead.
    """
    secret = config.get("SECRET_KEY")
    if not secret or not isinstance(secret, (str, bytes)):
        raise ConfigError(key, f"{what} with the app's SECRET_KEY, which is not set: set "
                          "SECRET_KEY before init_app")
    fallbacks = config.get("SECRET_KEY_FALLBACKS") or []
    if not isinstance(fallbacks, (list, tuple)):
        raise ConfigError("SECRET_KEY_FALLBACKS", f"expected a list of the old keys, such as "
                          f"['old key'], got a {type(fallbacks).__name__} (a string would "
                          "make each of its characters a key)")
    for index, fallback in enumerate(fallbacks):
        if not fallback or not isinstance(fallback, (str, bytes)):
            raise ConfigError("SECRET_KEY_FALLBACKS", f"item {index} must be a non-empty "
                              f"string (an old SECRET_KEY), got a {type(fallback).__name__}"
                              + (" that is empty" if isinstance(fallback, (str, bytes))
                                 else ""))
    return (*fallbacks, secret)


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


def check_name(field: str, name: Any) -> str:
    """A transport name as stored: a non-empty string of at most 64 characters."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise ConfigError(field, f"a transport name is a non-empty string of at most "
                                 f"{MAX_NAME_LENGTH} characters, got {name!r}")
    return name


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
        where = "" if spec.name == DEFAULT_TRANSPORT else f' (OUTBOX_TRANSPORTS["{spec.name}"])'
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
