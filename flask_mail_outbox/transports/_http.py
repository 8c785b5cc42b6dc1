"""Provider HTTP APIs: one pooled async client per transport, the stream, the error classes.

:class:`HTTPTransport` is what the provider transports (Postmark, SendGrid,
Mailgun, Resend, SES) share. Each keeps one ``httpx.AsyncClient`` open in a
loop thread of its own, as the SMTP transport keeps its connections, with at
most ``concurrency`` requests in flight per stream: a provider answering in
100 ms is latency-bound exactly as an SMTP server is. A provider with a batch
endpoint (:attr:`HTTPTransport.max_batch`) gets several queued messages per
request, and still reports one result per message.

A subclass says how a message becomes a request (:meth:`HTTPTransport.request_for`)
and what a successful answer means for each message (:meth:`HTTPTransport.results_for`).
Everything else is classified here, the same way for every provider:

* a refused connection, a timeout while connecting, a 5xx: transient, and the
  transport's fault (the attempt moves to its ``failover`` list); a timeout or
  a dropped connection after the request went out: transient, and ambiguous
  (below);
* 429: throttled (``Retry-After`` honoured; the shared rate is halved and no
  attempt is charged, as for a throttling SMTP reply);
* 401 and 403: transient, with one ERROR naming the transport, so a rotated
  key never dead-letters the queue;
* any other 4xx: permanent for that message, with the provider's code and text;
* a 2xx body that is not what the provider documents: transient, with what came back.

Whether the provider may have accepted a message that failed so: a 2xx it
could not read, a timeout or a dropped connection after the request went
out. Such an error is ``maybe_sent`` (retried only ``OUTBOX_AMBIGUOUS_RETRIES``
times), unless the provider honours an idempotency key
(:attr:`HTTPTransport.idempotent`), which makes a retry safe; either way it
is no transport fault, so it never fails over to another transport (which
would send a copy of its own). A timeout or a refusal before the request
went out (connecting) is a transport fault as before.

Every text of an answer (its body, its message, a provider's id) is made
safe to store where it enters (:meth:`HTTPTransport.outside`): control
characters replaced, the length capped, the entry's own secrets (its API
key) replaced by ``[redacted]``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import email.utils
import json
import logging
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import httpx

from .. import _degrade, _tracing
from .._errors import ConfigError, PermanentError, TransientError, TransportError
from .._outside import clean_line, clean_text, redact
from ._base import Envelope, Failed, NotAttempted, Report, Result, Sending, Transport
from ._settings import TransportSettings

logger = logging.getLogger(__name__)

#: The keys every HTTP kind takes in its ``OUTBOX_TRANSPORTS`` entry, besides its own.
COMMON_KEYS = ("base_url", "timeout")
#: Seconds a request may take when the entry sets no ``timeout``.
DEFAULT_TIMEOUT = 10.0
#: The longest ``Retry-After`` honoured; a longer one is the retry policy's to wait out.
MAX_RETRY_AFTER = 3600.0
#: At most this much of an error body goes into the row's error history.
MAX_DETAIL = 500


class BadResponse(Exception):
    """A 2xx answer that is not what the provider documents (raised by ``results_for``)."""


class HTTPTransport(Transport):
    """Base of the provider API transports (see the module docstring).

    ``options`` is the transport's ``OUTBOX_TRANSPORTS`` entry without the
    keys every transport takes; :meth:`check_settings` has checked it.
    """

    #: The kind's name in ``OUTBOX_TRANSPORTS`` ("postmark", ...), for messages.
    kind: ClassVar[str] = "http"
    #: The provider's documented API root (an entry's ``base_url`` replaces it).
    default_base_url: ClassVar[str] = ""
    #: The entry keys this kind takes besides ``transport``, ``rate_limit``,
    #: ``concurrency``, ``failover`` and :data:`COMMON_KEYS`.
    settings_keys: ClassVar[tuple[str, ...]] = ()
    #: Those of :attr:`settings_keys` an entry must set (non-empty strings).
    required_keys: ClassVar[tuple[str, ...]] = ()
    #: Those never shown in a message (API keys, tokens).
    secret_keys: ClassVar[tuple[str, ...]] = ()
    #: The most messages one request carries (1: the provider has no batch endpoint).
    max_batch: ClassVar[int] = 1
    takes_esmtp_options: ClassVar[bool] = False
    #: The provider honours an idempotency key the transport sends with each
    #: request (the same on every attempt of an email): an ambiguous failure is
    #: then retried like any other, since a retry cannot send a second copy.
    #: It still never fails over: another transport knows nothing of the key.
    idempotent: ClassVar[bool] = False

    #: httpx errors raised before the request reached the provider: never ambiguous.
    _NOT_SENT: ClassVar[tuple[type[Exception], ...]] = (
        httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol,
        httpx.InvalidURL, httpx.LocalProtocolError, httpx.ProxyError)

    def __init__(self, options: Mapping[str, Any], *, name: str = "default",
                 concurrency: int = 4) -> None:
        super().__init__()
        self.options = dict(options)
        self.name = name
        self.base_url = str(options.get("base_url") or self.default_base_url).rstrip("/")
        self.timeout = float(options.get("timeout") or DEFAULT_TIMEOUT)
        self.concurrency = max(1, concurrency)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """The transport of one ``OUTBOX_TRANSPORTS`` entry."""
        return cls(settings.options, name=settings.name, concurrency=settings.concurrency)

    @classmethod
    def entry_keys(cls) -> tuple[str, ...] | None:
        """:data:`COMMON_KEYS` and the provider's own :attr:`settings_keys`."""
        return (*COMMON_KEYS, *cls.settings_keys)

    @classmethod
    def check_settings(cls, options: Mapping[str, Any], prefix: str) -> None:
        """Check an entry's own keys at ``init_app``; :class:`ConfigError` naming the key.

        A secret's value is never shown in the message.
        """
        for key in cls.required_keys:
            value = options.get(key)
            if not isinstance(value, str) or not value.strip():
                shown = ("" if key in cls.secret_keys or value is None
                         else f", got {value!r}")
                raise ConfigError(f'{prefix}["{key}"]',
                                  f"a {cls.kind} transport needs it (a non-empty string){shown}")
        base_url = options.get("base_url")
        if base_url is not None and (not isinstance(base_url, str) or
                                     not base_url.startswith(("https://", "http://"))):
            raise ConfigError(f'{prefix}["base_url"]',
                              f"expected an http(s) URL such as {cls.default_base_url!r}, "
                              f"got {base_url!r}")
        timeout = options.get("timeout")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f'{prefix}["timeout"]',
                              f"expected a positive number of seconds, got {timeout!r}")

    # -- what a provider says -------------------------------------------------------------

    def batchable(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` may share a request with others (when :attr:`max_batch` > 1)."""
        return True

    def request_for(self, client: httpx.AsyncClient,
                    envelopes: Sequence[Envelope]) -> httpx.Request:
        """The request that sends ``envelopes`` (one, or a batch of at most :attr:`max_batch`)."""
        raise NotImplementedError

    def results_for(self, envelopes: Sequence[Envelope],
                    response: httpx.Response) -> list[Result]:
        """One result per envelope from a 2xx answer; :class:`BadResponse` when it is not one."""
        raise NotImplementedError

    def classify_error(self, envelopes: Sequence[Envelope],
                       response: httpx.Response) -> TransportError | None:
        """The provider's own reading of an error answer, for every envelope of the request.

        None (the base class) lets the status decide as the module docstring
        says; a provider returns an error where its codes say more than the
        status (an account-level refusal, a throttle without ``Retry-After``).
        """
        return None

    def outside(self, text: object, limit: int = MAX_DETAIL) -> str:
        """``text`` from the provider made safe to store and log, at most ``limit`` characters.

        Control characters and lone surrogates become U+FFFD (see
        :func:`~flask_mail_outbox._outside.clean_text`), and this entry's
        secrets (:attr:`secret_keys`: an API key a reply echoes) ``[redacted]``.
        """
        secrets = [str(self.options.get(key) or "") for key in self.secret_keys]
        return redact(clean_text(text, limit), secrets)

    def error_detail(self, response: httpx.Response) -> str:
        """The provider's error code and text from an error answer (its JSON, or its text).

        Made safe with :meth:`outside`.
        """
        try:
            body = response.json()
        except ValueError:
            return self.outside(_clip(response.text))
        if isinstance(body, Mapping):
            parts = [f"{key} {body[key]}" for key in ("ErrorCode", "code", "name", "statusCode")
                     if key in body]
            for key in ("Message", "message", "error", "errors"):
                if key in body:
                    parts.append(str(body[key]))
                    break
            if parts:
                return self.outside(_clip("; ".join(parts)))
        return self.outside(_clip(json.dumps(body)))

    # -- the transport --------------------------------------------------------------------

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        result = self.send_many([envelope])[0]
        if isinstance(result, Failed):
            raise result.error
        return dict(result.refused)

    def open(self, report: Report) -> Sending:
        """A stream with up to ``concurrency`` requests in flight (see :class:`Sending`)."""
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                # First use, or a forked child, where the parent's thread is gone.
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=f"outbox-{self.kind}",
                                          daemon=True)
                thread.start()
                self._loop, self._thread, self._client = loop, thread, None
            return _HTTPSending(self, self._loop, report)

    def close(self) -> None:
        """Close the pooled connections and the loop thread; open() starts them again."""
        with self._lock:
            loop, thread, client = self._loop, self._thread, self._client
            self._loop = self._thread = self._client = None
        if loop is None or thread is None:
            return
        if client is not None and loop.is_running():
            future = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
            try:
                future.result(timeout=self.timeout + 1)
            except Exception:
                logger.debug("Closing the %s client failed", self.kind, exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=2)
        if not thread.is_alive():
            loop.close()

    def _http_client(self) -> httpx.AsyncClient:
        """The pooled client, made in the loop thread on first use."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout),
                limits=httpx.Limits(max_connections=self.concurrency,
                                    max_keepalive_connections=self.concurrency),
                headers={"User-Agent": "flask-mail-outbox"})
        return self._client

    async def _send_batch(self, envelopes: Sequence[Envelope]) -> list[Result]:
        """One request for ``envelopes``; their results, every failure classified.

        Every text the provider chose is made safe (:meth:`outside`) here.
        """
        with _tracing.sending(envelopes, f"{self.kind} api",
                              _tracing.server_of(self)) as traced:
            results = [self._made_safe(result) for result in await self._attempt(envelopes)]
            traced.done(results)
        return results

    async def _attempt(self, envelopes: Sequence[Envelope]) -> list[Result]:
        client = self._http_client()
        try:
            request = self.request_for(client, envelopes)
            response = await client.send(request)
        except httpx.TimeoutException as exc:
            # A timeout after the request went out: the provider may have taken it.
            # Then it is no transport fault: a failover would send another copy.
            sent = not isinstance(exc, self._NOT_SENT)
            return self._all(envelopes, TransientError(
                f"{self.kind} API did not answer within {self.timeout:g} s "
                f"({type(exc).__name__})" + (_MAYBE if sent else ""), transport_fault=not sent,
                maybe_sent=sent and not self.idempotent, account_fault=_unreachable(exc)))
        except httpx.TransportError as exc:
            sent = not isinstance(exc, self._NOT_SENT)
            return self._all(envelopes, TransientError(
                f"{self.kind} API connection failed: {type(exc).__name__}: {exc}"
                + (_MAYBE if sent else ""), transport_fault=not sent,
                maybe_sent=sent and not self.idempotent, account_fault=_unreachable(exc)))
        except TransportError as exc:  # the provider's own refusal to build the request
            return self._all(envelopes, exc)
        return self._classify(envelopes, response)

    def _made_safe(self, result: Result) -> Result:
        """``result`` with every text of the provider's made safe (see :meth:`outside`)."""
        if isinstance(result, Failed):
            error = result.error
            error.message = self.outside(error.message, 2 * MAX_DETAIL)
            error.args = (f"{error.code} {error.message}" if error.code else error.message,)
            error.refused = {address: (code, self.outside(text))
                             for address, (code, text) in error.refused.items()}
            return result
        if not result.refused and result.provider_message_id is None:
            return result
        provider_id = result.provider_message_id
        return dataclasses.replace(
            result, refused={address: (code, self.outside(text))
                             for address, (code, text) in result.refused.items()},
            provider_message_id=(clean_line(redact(provider_id, [
                str(self.options.get(key) or "") for key in self.secret_keys])) or None)
            if provider_id is not None else None)

    def _classify(self, envelopes: Sequence[Envelope], response: httpx.Response) -> list[Result]:
        status = response.status_code
        if 200 <= status < 300:
            try:
                results = self.results_for(envelopes, response)
            except (BadResponse, ValueError, KeyError, TypeError) as exc:
                # The provider answered success: it most likely took the message.
                sent = not self.idempotent
                return self._all(envelopes, TransientError(
                    f"{self.kind} API answered {status} with a body that is not what it "
                    f"documents ({type(exc).__name__}: {self.outside(exc)}): "
                    f"{self.outside(_clip(response.text))}" + (_MAYBE if sent else ""),
                    code=status, maybe_sent=sent))
            return results
        own = self.classify_error(envelopes, response)
        if own is not None:
            return self._all(envelopes, own)
        detail = self.error_detail(response)
        if status == 429:
            return self._all(envelopes, TransientError(
                f"{self.kind} API throttled the request (HTTP 429): {detail}", code=429,
                throttled=True, retry_after=retry_after(response)))
        if status in (401, 403):
            # The account's fault, not the message's: the core pauses the transport
            # (one ERROR per process) and no email spends an attempt on it.
            return self._all(envelopes, TransientError(
                f"{self.kind} API refused the credentials (HTTP {status}): {detail}; check "
                f"the API key of OUTBOX_TRANSPORTS[{self.name!r}]", code=status,
                account_fault="credentials"))
        if status >= 500:
            return self._all(envelopes, TransientError(
                f"{self.kind} API failed (HTTP {status}): {detail}", code=status,
                transport_fault=True))
        return self._all(envelopes, PermanentError(
            f"{self.kind} API refused the message (HTTP {status}): {detail}", code=status))

    @staticmethod
    def _all(envelopes: Sequence[Envelope], error: TransportError) -> list[Result]:
        return [Failed(error) for _ in envelopes]


def _unreachable(exc: Exception) -> str | None:
    """``"unreachable"`` when ``exc`` says no connection to the API could be made at all
    (refused, timing out, no such host), not a TLS handshake that failed."""
    if not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return None
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return None
        seen = seen.__cause__ or seen.__context__
    return "unreachable"


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (a number or an HTTP date), capped; None when absent or bad."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value else None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    return min(MAX_RETRY_AFTER, max(0.0, seconds))


#: Said of an error after which the provider may have sent the message.
_MAYBE = "; the provider may have accepted it"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL] + "..."


class _HTTPSending(Sending):
    """The stream of :meth:`HTTPTransport.open`: queued messages, up to ``concurrency`` requests.

    Everything of the stream but the caller's bookkeeping lives in the loop
    thread, so taking a message and starting its request is one step and
    :meth:`cancel_pending` is exact. Results are reported from a reporter
    thread, never from the loop.
    """

    def __init__(self, transport: HTTPTransport, loop: asyncio.AbstractEventLoop,
                 report: Report) -> None:
        super().__init__(report)
        self._transport, self._loop = transport, loop
        self._results: collections.deque[tuple[Envelope, Result] | None] = collections.deque()
        self._results_ready = threading.Condition()
        self._reporter: threading.Thread | None = None
        # -- the loop thread's ---------------------------------------------------------
        self._queue: collections.deque[Envelope] = collections.deque()
        self._in_flight = 0
        self._cancelled = False

    def _hand_over(self, envelopes: Sequence[Envelope]) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_results,
                                              name="outbox-report", daemon=True)
            self._reporter.start()
        self._loop.call_soon_threadsafe(self._arrive, list(envelopes))

    def _cancel(self) -> set[int]:
        self._push(None)
        if not self._loop.is_running():
            return set()
        future = asyncio.run_coroutine_threadsafe(self._cancel_in_loop(), self._loop)
        return future.result(timeout=5)

    def _no_more_puts(self) -> None:
        self._push(None)

    def _push(self, item: tuple[Envelope, Result] | None) -> None:
        with self._results_ready:
            self._results.append(item)
            self._results_ready.notify()

    def _report_results(self) -> None:
        while True:
            with self._results_ready:
                self._results_ready.wait_for(lambda: bool(self._results))
                item = self._results.popleft()
            if item is not None:
                self._reported(*item)
            with self._lock:
                if self._closed and self._unreported == 0:
                    return

    # -- the loop thread ------------------------------------------------------------------

    def _arrive(self, envelopes: list[Envelope]) -> None:
        if self._cancelled:
            for envelope in envelopes:
                self._push((envelope, Failed(NotAttempted())))
            return
        self._queue.extend(envelopes)
        self._start_requests()

    def _start_requests(self) -> None:
        transport = self._transport
        while self._queue and self._in_flight < transport.concurrency:
            batch = [self._queue.popleft()]
            if transport.max_batch > 1 and transport.batchable(batch[0]):
                while (self._queue and len(batch) < transport.max_batch
                       and transport.batchable(self._queue[0])):
                    batch.append(self._queue.popleft())
            self._in_flight += 1
            self._loop.create_task(self._request(batch))

    async def _request(self, batch: list[Envelope]) -> None:
        try:
            results = await self._transport._send_batch(batch)
        except Exception as exc:  # noqa: BLE001 - a broken provider class must not lose mail
            _degrade.report(
                f"The {self._transport.kind} transport raised {type(exc).__name__} instead of "
                f"returning results ({len(batch)} email(s))",
                consequence="the emails are put back to queued and retried (a transient "
                            "failure)",
                fix="report it with the traceback below", exc=exc)
            results = [Failed(TransientError(f"{type(exc).__name__}: {exc}"))] * len(batch)
        finally:
            self._in_flight -= 1
        for envelope, result in zip(batch, results, strict=True):
            self._push((envelope, result))
        self._start_requests()

    async def _cancel_in_loop(self) -> set[int]:
        self._cancelled = True
        never = list(self._queue)
        self._queue.clear()
        for envelope in never:
            self._push((envelope, Failed(NotAttempted())))
        return {envelope.email_id for envelope in never}
