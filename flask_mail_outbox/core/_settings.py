"""The outbox's settings as plain values: what the core is built from.

:func:`~._config.load_config` reads a mapping of keys (``app.config``, in
``init_app``) into an :class:`OutboxConfig` once, validating every key.
Nothing here reads configuration or knows Flask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from .._compose.ambient import ComposeOptions
from .._policy import SoftBounceRule
from .._tracing import TracingSettings
from ..transports import SMTPSettings, Transport, TransportSettings
from ._retry import RetryPolicy

if TYPE_CHECKING:
    from .._compose.dkim import DKIMSigner
    from .._compose.links import UnsubscribeLinks
    from .._compose.verp import VerpAddresses

#: The name of the transport of ``MAIL_*`` / ``OUTBOX_TRANSPORT``, and of every row sent without one.
DEFAULT_TRANSPORT = "default"


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


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    """One named transport, as configured: what it is, how it is built, its limits.

    ``concurrency`` None means the process's ``OUTBOX_CONCURRENCY`` (or
    ``flask outbox worker --concurrency``).
    """

    name: str
    kind: str
    cls: type[Transport]
    settings: TransportSettings
    rate: Rate | None = None
    concurrency: int | None = None
    failover: tuple[str, ...] = ()
    #: The entry's ``webhook_secret``: its webhook route exists only with one.
    webhook_secret: Any = dataclasses.field(default=None, repr=False)

    @property
    def smtp(self) -> SMTPSettings:
        """Its SMTP settings (those of an ``smtp`` transport; defaults for other kinds)."""
        return self.settings.smtp


@dataclasses.dataclass(frozen=True)
class OutboxConfig:
    """Every setting the outbox uses, validated: what :func:`load_config` returns."""

    default_sender: str | tuple[str, str] | None
    ascii_attachments: bool
    suppress_send: bool
    durable: bool
    max_attempts: int
    inline_retries: int
    retry_base_seconds: float
    retry_max_seconds: float
    max_throttle_deferrals: int
    lease_seconds: float
    batch_size: int
    concurrency: int
    poll_interval: float
    poll_max_interval: float
    listen: bool
    listen_url: str | None
    listen_backstop_seconds: float
    run_worker: bool
    sweep_on_startup: bool
    sweep_min_age_seconds: float
    sweep_batch: int
    sweep_interval_seconds: float | None
    settings_ttl_seconds: float
    max_message_bytes: int
    allow_local_addresses: bool
    message_id_domain: str | None
    retention_days: float | None
    scrub_sent: bool
    health_max_queued_age_seconds: float
    run_scheduler: bool = True
    #: OUTBOX_AMBIGUOUS_RETRIES: retries of an attempt that may have been delivered.
    ambiguous_retries: int = 1
    html_to_text: bool = True
    allow_smtputf8: bool = False
    #: None when DKIM signing is off.
    dkim: DKIMSigner | None = None
    #: Every transport by name, "default" first.
    transport_specs: tuple[TransportSpec, ...] = ()
    #: OUTBOX_WEBHOOK_PREFIX, without a trailing "/".
    webhook_prefix: str = "/outbox/webhooks"
    #: OUTBOX_UNSUBSCRIBE_URL, without a trailing "/" (None: no one-click route).
    unsubscribe_url: str | None = None
    #: OUTBOX_BOUNCE_ADDRESS's VERP envelope senders (None: the message's sender).
    verp: VerpAddresses | None = dataclasses.field(default=None, repr=False)
    #: Makes and reads the one-click URLs (None without OUTBOX_UNSUBSCRIBE_URL).
    unsubscribe_links: UnsubscribeLinks | None = dataclasses.field(default=None, repr=False)
    #: OUTBOX_TEMPLATE_*: send_template()'s folder, CSS inlining, locales, subject limit.
    template_folder: str = "email"
    template_inline_css: bool = True
    template_locales: tuple[str, ...] | None = None
    template_max_subject: int = 78
    #: OUTBOX_REDIRECT_TO: every email goes to these addresses instead (None: off).
    redirect_to: tuple[str, ...] | None = None
    #: OUTBOX_ALLOWED_RECIPIENTS, normalised: ``user@domain`` and ``*@domain`` (None: off).
    allowed_recipients: tuple[str, ...] | None = None
    #: OUTBOX_SOFT_BOUNCE_*: repeated soft bounces suppress an address for a bounded time.
    soft_bounces: SoftBounceRule = dataclasses.field(default_factory=SoftBounceRule)
    #: OUTBOX_PAUSE_PROBE_SECONDS / _MAX_SECONDS: a paused transport's probe backoff.
    pause_probe_seconds: float = 30.0
    pause_probe_max_seconds: float = 600.0
    #: OUTBOX_MAX_QUEUE_LIFETIME_SECONDS: how long an email waits for a paused
    #: transport before it ends failed (None: for ever; 0: not at all).
    max_queue_lifetime_seconds: float | None = 5 * 86400.0
    #: OUTBOX_OTEL: OpenTelemetry tracing (see flask_mail_outbox/_tracing.py).
    otel: TracingSettings = dataclasses.field(default_factory=TracingSettings)
    #: OUTBOX_EXECUTOR: what delivers committed emails: "dispatcher" (this library's
    #: own worker) or a task queue ("celery", "rq", "dramatiq"; see core/_executor.py).
    executor: str = "dispatcher"
    #: OUTBOX_EXECUTOR_QUEUE: the task queue's queue the tasks go to.
    executor_queue: str = "outbox"
    #: OUTBOX_EXECUTOR_URL: the broker of the task queue, where the engine has no
    #: app of its own to say it (RQ's Redis, Dramatiq's Redis); None: the engine's own.
    executor_url: str | None = dataclasses.field(default=None, repr=False)

    def transport_spec(self, name: str) -> TransportSpec:
        """The transport called ``name`` (KeyError when there is none)."""
        for spec in self.transport_specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def transport_names(self) -> tuple[str, ...]:
        """The names ``mail.send(transport=...)`` accepts, "default" first."""
        return tuple(spec.name for spec in self.transport_specs)

    @property
    def smtp(self) -> SMTPSettings:
        """The default transport's SMTP settings (Flask-Mail's ``MAIL_*`` keys)."""
        return self.transport_spec(DEFAULT_TRANSPORT).smtp

    @functools.cached_property
    def compose(self) -> ComposeOptions:
        """How this app's messages are built."""
        return ComposeOptions(
            default_sender=self.default_sender,
            allow_local_addresses=self.allow_local_addresses,
            max_message_bytes=self.max_message_bytes,
            message_id_domain=self.message_id_domain,
            ascii_attachments=self.ascii_attachments,
            html_to_text=self.html_to_text,
            allow_smtputf8=self.allow_smtputf8,
            unsubscribe_links=self.unsubscribe_links)

    def retry_policy(self) -> RetryPolicy:
        """The retry policy these settings describe (both modes use it)."""
        return RetryPolicy(self.retry_base_seconds, self.retry_max_seconds, self.max_attempts,
                           max_throttle_deferrals=self.max_throttle_deferrals)

    def sweep_interval_for(self, durable: bool) -> float | None:
        """The periodic sweep interval in force for a delivery mode."""
        if self.sweep_interval_seconds is not None:
            return self.sweep_interval_seconds
        return None if durable else 60.0
