"""What every webhook receiver shares: the request, the refusal, the replay window.

The rules every kind keeps (the issue's contract, and the docs' promise):

- a missing or wrong signature or credential is refused with 401 (missing)
  or 403 (wrong), before the body is parsed for events;
- a signed timestamp more than :data:`TOLERANCE_SECONDS` away from now is
  refused with 403 (a replay);
- a body that is not the JSON the provider sends is refused with 400;
- a refusal never names the secret or echoes a signature.

The body cap (:data:`MAX_BODY_BYTES`, 413) is the route's: it stops reading
before a receiver sees anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

from .._errors import ConfigError
from .._events import DeliveryEvent, naive_utc
from .._providers import PROVIDERS

#: A signed timestamp further than this from now is a replay (seconds).
TOLERANCE_SECONDS = 300.0

#: The largest body a webhook route reads (bytes); more is refused with 413.
MAX_BODY_BYTES = 1024 * 1024

#: The deepest JSON nesting a receiver parses; deeper is refused with 400. Providers
#: nest a few levels (SES's events about six); Python's parser would recurse to its
#: limit and raise RecursionError.
MAX_JSON_DEPTH = 64

#: kind -> "module:Class" of its receiver, imported when first used (``_providers.PROVIDERS``).
RECEIVERS = {kind: p.receiver for kind, p in PROVIDERS.items()}


@dataclasses.dataclass(frozen=True)
class WebhookRequest:
    """One POST as a receiver sees it.

    ``headers`` has lower-case names. ``now`` is the time it arrived
    (seconds since the epoch), given so tests can set the clock.
    """

    headers: Mapping[str, str]
    body: bytes
    now: float

    def header(self, name: str) -> str | None:
        """The header ``name`` (any case), or None."""
        return self.headers.get(name.lower())


class WebhookRefused(Exception):
    """The request is refused: answer ``status``; ``reason`` is safe to log and to show."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"{status}: {reason}")


@dataclasses.dataclass(frozen=True)
class Received:
    """What a verified request carried.

    ``nonces``: values that must never be accepted twice for this transport
    (Mailgun's signature tokens); the route stores them with the events, in
    one transaction, and refuses the request (403) if one was seen before.
    ``confirm_url``: an SNS subscription to confirm by fetching this URL once
    the request is answered.
    """

    events: tuple[DeliveryEvent, ...] = ()
    nonces: tuple[str, ...] = ()
    confirm_url: str | None = None


class Receiver:
    """One configured transport's webhook: verify a request, normalize its events.

    Subclasses set :attr:`kind`, may check the secret's form in
    :meth:`check_secret` (at ``init_app``, raising ``ConfigError``), and
    implement :meth:`receive`. ``name`` is the ``OUTBOX_TRANSPORTS`` entry's
    name, which every event carries as its ``transport``.
    """

    kind: ClassVar[str] = ""

    def __init__(self, name: str, secret: Any, options: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.secret = secret
        self.options = dict(options or {})

    def __repr__(self) -> str:  # never the secret
        return f"<{type(self).__name__} {self.name!r}>"

    @classmethod
    def check_secret(cls, secret: Any, key: str) -> None:
        """Refuse a ``webhook_secret`` that cannot work; ``key`` names it in the error."""
        if not isinstance(secret, str) or not secret.strip():
            raise ConfigError(key, "expected a non-empty string")

    def receive(self, request: WebhookRequest) -> Received:
        """Verify ``request`` and return its events; raise :class:`WebhookRefused` otherwise."""
        raise NotImplementedError


def receiver_class(kind: str) -> type[Receiver] | None:
    """The receiver of a built-in transport kind, or None when the kind has no webhooks."""
    target = RECEIVERS.get(kind)
    if target is None:
        return None
    module, _, name = target.partition(":")
    cls: type[Receiver] = getattr(importlib.import_module(module), name)
    return cls


def bounded_id(event_id: str) -> str:
    """``event_id``, or its SHA-256 when longer than the column (255): still stable."""
    if len(event_id) <= 255:
        return event_id
    return hashlib.sha256(event_id.encode("utf-8", "surrogatepass")).hexdigest()


def iso_time(value: Any) -> datetime | None:
    """An ISO 8601 time (naive ones taken as UTC) as naive UTC, or None.

    None too for a time that has no UTC equivalent (``9999-12-31T23:59:59-23:59``
    is past the year 9999 in UTC).
    """
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        moment = datetime.fromisoformat(value)
        return naive_utc(moment if moment.tzinfo else moment.replace(tzinfo=UTC))
    except (ValueError, OverflowError):
        return None


def outside_recipient(value: str | None) -> str | None:
    """A recipient a provider named, bounded for :class:`DeliveryEvent`.

    The event makes it safe (:func:`~flask_mail_outbox._outside.clean_address`:
    what is not an address is dropped, and shown in the description); text over
    an address's 320 characters is cut here (and marked, with a space no address
    holds), so it is dropped the same way rather than refused with the rest of
    the request.
    """
    if value is None or len(value) <= 320:
        return value
    return value[:300] + " …"


def json_object(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def joined(separator: str, *parts: Any) -> str:
    """The non-empty strings of ``parts``, joined."""
    return separator.join(part for part in parts if isinstance(part, str) and part)


def json_body(request: WebhookRequest) -> Any:
    """The body parsed as JSON, or a 400 refusal."""
    return bounded_json(request.body, "the body")


# A JSON string (its escapes included), or an unterminated one up to the end: no
# backtracking (possessive), so a body of many quotes or backslashes stays linear.
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# What is neither a bracket nor a quote.
_NOT_BRACKET = re.compile(r'[^\[\]{}"]+')
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1, '"': 0}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def bounded_json(data: bytes | str, what: str) -> Any:
    """``data`` parsed as JSON, in time linear in its size, or a 400 refusal naming ``what``.

    Refused: text that is not JSON (or not UTF-8), nesting deeper than
    :data:`MAX_JSON_DEPTH` (measured before parsing, without recursion),
    ``NaN`` and ``Infinity`` (not JSON), an integer over Python's 4,300 digits.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise WebhookRefused(400, f"{what} is not JSON (not UTF-8)") from None
    if json_depth(text) > MAX_JSON_DEPTH:
        raise WebhookRefused(400, f"{what} nests deeper than {MAX_JSON_DEPTH} levels: not "
                             "a provider's event")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise WebhookRefused(400, f"{what} is not JSON") from None


def json_depth(text: str) -> int:
    """How deep the brackets of JSON ``text`` nest (its strings skipped), in linear time."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(_DEPTH_STEP[char] for char in brackets), default=0)


def check_timestamp(timestamp: Any, now: float) -> float:
    """A signed timestamp (seconds since the epoch) inside the window, or a 403 refusal.

    ``nan`` and ``inf`` are refused: every comparison with ``nan`` is false, so
    it would pass any window.
    """
    try:
        value = float(timestamp)
    except (TypeError, ValueError, OverflowError):
        raise WebhookRefused(403, "the signed timestamp is not a number") from None
    if not math.isfinite(value):
        raise WebhookRefused(403, "the signed timestamp is not a finite number")
    if abs(now - value) > TOLERANCE_SECONDS:
        when = (f"{now - value:.0f} s ago" if value < now
                else f"{value - now:.0f} s in the future")
        raise WebhookRefused(403, f"the signed timestamp is {when}, outside the "
                             f"{TOLERANCE_SECONDS:g} s window (a replay, or a clock that "
                             "is wrong)")
    return value
