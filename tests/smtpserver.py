"""A real, scriptable SMTP server for tests.

:class:`FaultSMTPServer` wraps an :mod:`aiosmtpd` server that runs its own
asyncio loop in a background thread and listens on ``127.0.0.1`` on an
ephemeral port.  By default it behaves like a plain, RFC-compliant server that
accepts every message with ``250`` and records it.  Tests can script faults
while it runs: custom replies at any phase, refused recipients, delays,
withheld ("held") DATA replies, dropped connections (also in the middle of
the DATA content), mandatory AUTH and
(optionally) STARTTLS with a throw-away self-signed certificate.

Every public method is thread-safe and meant to be called from the test's
thread while the server runs in its own thread.

Example::

    with FaultSMTPServer() as server:
        server.reply("data", 451, times=1)
        ...  # first delivery attempt fails with 451, the next one succeeds
        assert server.wait_for(1)
        assert server.messages[0].message_id == "<id@example.com>"
"""

from __future__ import annotations

import asyncio
import contextlib
import email.policy
import hmac
import itertools
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from types import TracebackType
from typing import Any, AnyStr, Literal, NoReturn, Self, get_args

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import (
    MISSING,
    SMTP,
    AuthResult,
    Envelope,
    LoginPassword,
    Session,
)

__all__ = [
    "PHASES",
    "FaultSMTPServer",
    "Phase",
    "ReceivedMessage",
    "smtp_server",
]

Phase = Literal["connect", "ehlo", "mail", "rcpt", "data"]
"""The points of an SMTP session at which a fault can be scripted."""

PHASES: tuple[Phase, ...] = get_args(Phase)

#: Generous so tests can send large messages (aiosmtpd's default is 32 MiB).
DATA_SIZE_LIMIT = 64 * 1024 * 1024

#: How often a held DATA checks (from the server loop) whether it was released.
_HOLD_POLL_SECONDS = 0.01

#: How long stop() waits for open sessions to wind down before giving up.
_SHUTDOWN_TIMEOUT = 10.0

_DEFAULT_TEXTS: dict[int, str] = {
    220: "localhost ESMTP FaultSMTPServer ready",
    221: "2.0.0 Bye",
    250: "2.0.0 OK",
    421: "4.3.2 Service not available, closing transmission channel",
    450: "4.2.1 Mailbox unavailable, try again later",
    451: "4.3.0 Requested action aborted: local error in processing",
    452: "4.3.1 Insufficient system storage",
    454: "4.7.0 Temporary authentication failure",
    500: "5.5.2 Syntax error, command unrecognized",
    501: "5.5.4 Syntax error in parameters or arguments",
    502: "5.5.1 Command not implemented",
    503: "5.5.1 Bad sequence of commands",
    530: "5.7.0 Authentication required",
    535: "5.7.8 Authentication credentials invalid",
    550: "5.1.1 Mailbox unavailable",
    551: "5.1.6 User not local",
    552: "5.3.4 Message size exceeds fixed maximum message size",
    553: "5.1.3 Mailbox name not allowed",
    554: "5.0.0 Transaction failed",
}


def _default_text(code: int) -> str:
    """Return a plausible human-readable text for an SMTP reply ``code``."""
    if code in _DEFAULT_TEXTS:
        return _DEFAULT_TEXTS[code]
    if code < 400:
        return "OK"
    if code < 500:
        return "Temporary failure (scripted)"
    return "Permanent failure (scripted)"


def _format_reply(code: int, text: str) -> str:
    """Format ``code text`` as an SMTP reply (multi-line if ``text`` has newlines)."""
    lines = [line.rstrip("\r") for line in text.split("\n")] or [""]
    head = [f"{code}-{line}" for line in lines[:-1]]
    return "\r\n".join([*head, f"{code} {lines[-1]}"])


def _extract_message_id(data: bytes) -> str | None:
    """Return the stripped ``Message-ID`` header value of ``data``, if any."""
    try:
        headers = BytesParser(policy=email.policy.default).parsebytes(
            data, headersonly=True
        )
        value = headers.get("Message-ID")
        if value is None:
            return None
        text = str(value).strip()
    except Exception:  # noqa: BLE001 - a test server must not crash on odd input
        return None
    return text or None


def _check_phase(phase: str) -> Phase:
    """Validate ``phase`` and return it typed as :data:`Phase`."""
    for known in PHASES:
        if phase == known:
            return known
    raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")


def _check_times(times: int | None) -> None:
    """Validate a ``times`` argument (``None`` or a positive int)."""
    if times is not None and (isinstance(times, bool) or times < 1):
        raise ValueError(f"times must be None or a positive integer, got {times!r}")


#: Queue ids of accepted messages, unique in the test process (Postfix's are hex too).
_queue_ids = itertools.count(1)


@dataclass(frozen=True)
class ReceivedMessage:
    """One message the server accepted (answered 2xx at the end of DATA).

    ``data`` holds the exact message bytes received (after SMTP dot-unstuffing),
    with the line endings the client sent (normally CRLF).
    """

    mail_from: str
    rcpt_tos: list[str]
    data: bytes
    message_id: str | None
    #: ESMTP parameters given with MAIL FROM (upper-cased), e.g. ``["SMTPUTF8"]``.
    mail_options: list[str] = field(default_factory=list)
    #: The user name the session authenticated as, if it used AUTH.
    auth_username: str | None = None
    #: Whether the session was encrypted (STARTTLS) when the message arrived.
    tls: bool = False
    #: When the server accepted it (``time.monotonic()``): rates measured at the server.
    received_at: float = field(default_factory=time.monotonic)
    #: The id its ``250 ... queued as <id>`` gave it (None when a rule answered instead).
    queue_id: str | None = None

    @property
    def parsed(self) -> EmailMessage:
        """A freshly parsed :class:`~email.message.EmailMessage` of :attr:`data`."""
        message = BytesParser(policy=email.policy.default).parsebytes(self.data)
        assert isinstance(message, EmailMessage)
        return message


@dataclass
class _Rule:
    """A scripted reply or drop for one phase."""

    action: Literal["reply", "drop"]
    code: int = 0
    text: str = ""
    remaining: int | None = None  # None = forever

    @property
    def status(self) -> str:
        """The SMTP reply line(s) of this rule."""
        return _format_reply(self.code, self.text)


class _Quota:
    """A provider's rate limit: ``rate`` tokens a second over every session, ``burst`` held."""

    def __init__(self, rate: float, burst: float, status: str) -> None:
        self.rate = rate
        self.burst = burst
        self.status = status
        self.tokens = burst
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class _Delay:
    """A scripted delay for one phase."""

    seconds: float
    remaining: int | None = None  # None = forever


@dataclass
class _MidDataDrop:
    """A scripted drop in the middle of the DATA content."""

    after_bytes: int
    remaining: int | None = None  # None = forever


class _QuietSession(Session):
    """aiosmtpd ``Session`` whose legacy ``login_data`` does not log a warning.

    aiosmtpd's own ``smtp_AUTH`` sets the deprecated ``login_data`` on every
    successful login, which would log "Session.login_data is deprecated" at
    WARNING level into every test that authenticates.
    """

    @property
    def login_data(self) -> Any:
        """Legacy login data (the user name here)."""
        return self._login_data

    @login_data.setter
    def login_data(self, value: Any) -> None:
        self._login_data = value


class _FaultSMTP(SMTP):
    """aiosmtpd ``SMTP`` protocol with hooks for greeting faults, drops and counting.

    One instance is created per client connection (in the server's loop thread).
    Beware: aiosmtpd treats members named ``auth_*`` as AUTH mechanisms and
    ``smtp_*`` as commands, so helper names avoid those prefixes.
    """

    def __init__(
        self, handler: _Handler, *, owner: FaultSMTPServer, **kwargs: Any
    ) -> None:
        self._owner = owner
        self._greeting_override: str | None = None
        self._registered = False
        super().__init__(handler, **kwargs)

    def _create_session(self) -> Session:
        """Use :class:`_QuietSession` for every session."""
        return _QuietSession(self.loop)

    # -- connection bookkeeping -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Count the session (once; STARTTLS calls this again) and start it."""
        if not self._registered:
            self._registered = True
            self._owner._session_opened(self, transport.get_extra_info("peername"))
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        """Forget the session, then let aiosmtpd clean up."""
        if self._registered:
            self._registered = False
            self._owner._session_closed(self)
        super().connection_lost(error)

    # -- greeting ("connect" phase) -----------------------------------------------

    async def _handle_client(self) -> None:
        """Apply "connect" delays/faults, then run aiosmtpd's session loop."""
        owner = self._owner
        await owner._sleep_if_delayed("connect")
        rule = owner._take_rule("connect")
        if rule is not None:
            if rule.action == "drop":
                self._close_transport()
                return
            if rule.code >= 400:
                with contextlib.suppress(ConnectionError):
                    await self.push(rule.status)
                self._close_transport()
                return
            # A 2xx/3xx greeting: replace aiosmtpd's "220 ..." banner.
            self._greeting_override = rule.status
        await super()._handle_client()

    async def push(self, status: AnyStr) -> None:
        """Send a reply; the first one may be a scripted greeting."""
        if self._greeting_override is not None:
            override, self._greeting_override = self._greeting_override, None
            await super().push(override)
            return
        await super().push(status)

    # -- counting / auth ------------------------------------------------------------

    async def smtp_DATA(self, arg: str) -> None:
        """Count every DATA command (accepted or not), then handle it normally.

        A scripted :meth:`FaultSMTPServer.drop_mid_data` answers 354, reads the
        first bytes of the content and closes the connection while the client
        is still sending it.
        """
        self._owner._count_data_attempt()
        if self.envelope is not None and self.envelope.rcpt_tos and not arg:
            cut = self._owner._take_mid_data_drop()
            if cut is not None:
                await self.push("354 End data with <CR><LF>.<CR><LF>")
                await self._reader.read(cut)
                self._owner._count_mid_data_drop()
                self.drop_connection()
        await super().smtp_DATA(arg)

    async def check_auth_needed(self, caller_method: str) -> bool:
        """Require AUTH before MAIL/RCPT/DATA while ``require_auth()`` is active."""
        assert self.session is not None
        if self._owner._auth_is_required() and not self.session.authenticated:
            await self.push("530 5.7.0 Authentication required")
            return True
        return False

    # -- helpers used by the handler hooks -------------------------------------------

    def _close_transport(self) -> None:
        """Close the connection (flushing what was already written)."""
        if self.transport is not None:
            self.transport.close()

    def abort_connection(self) -> None:
        """Close the connection immediately (used on server shutdown)."""
        transport = self.transport
        if isinstance(transport, asyncio.Transport):
            transport.abort()
        elif transport is not None:
            transport.close()

    def drop_connection(self) -> NoReturn:
        """Close the connection without replying and end this session's task."""
        self._close_transport()
        raise asyncio.CancelledError("connection dropped by FaultSMTPServer")

    async def reply_and_close(self, status: str) -> NoReturn:
        """Send ``status`` (e.g. a 421), then close the connection."""
        try:
            await self.push(status)
        finally:
            self.drop_connection()


class _Handler:
    """aiosmtpd handler implementing the scripted behaviour.

    Kept separate from :class:`FaultSMTPServer` because aiosmtpd scans the
    handler for ``handle_*`` hooks and ``auth_*`` mechanisms.
    """

    def __init__(self, owner: FaultSMTPServer) -> None:
        self._owner = owner

    async def _apply_rule(self, server: _FaultSMTP, rule: _Rule) -> str | None:
        """Drop / reply-and-close / return the error status for a failing ``rule``.

        Returns ``None`` for a 2xx/3xx reply rule (the caller carries on).
        """
        if rule.action == "drop":
            server.drop_connection()
        if rule.code == 421:
            await server.reply_and_close(rule.status)
        if rule.code >= 400:
            return rule.status
        return None

    async def handle_EHLO(
        self,
        server: _FaultSMTP,
        session: Session,
        envelope: Envelope,
        hostname: str,
        responses: list[str],
    ) -> list[str]:
        """EHLO: scripted reply/delay; hide AUTH unless ``require_auth()`` is active."""
        owner = self._owner
        await owner._sleep_if_delayed("ehlo")
        rule = owner._take_rule("ehlo")
        if rule is not None:
            failure = await self._apply_rule(server, rule)
            if failure is not None:
                return [failure]
            session.host_name = hostname
            return [rule.status]
        session.host_name = hostname
        if not owner._auth_is_required():
            responses = [r for r in responses if not r[4:].upper().startswith("AUTH")]
        if owner.pipelining:
            responses = [responses[0], "250-PIPELINING", *responses[1:]]
        return responses

    async def handle_HELO(
        self, server: _FaultSMTP, session: Session, envelope: Envelope, hostname: str
    ) -> object:
        """HELO shares the "ehlo" phase's scripting."""
        owner = self._owner
        await owner._sleep_if_delayed("ehlo")
        rule = owner._take_rule("ehlo")
        if rule is not None:
            failure = await self._apply_rule(server, rule)
            if failure is not None:
                return failure
            session.host_name = hostname
            return rule.status
        return MISSING

    async def handle_MAIL(
        self,
        server: _FaultSMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        mail_options: list[str],
    ) -> object:
        """MAIL FROM: scripted reply/delay/drop, otherwise aiosmtpd's default 250."""
        owner = self._owner
        await owner._sleep_if_delayed("mail")
        rule = owner._take_rule("mail")
        if rule is not None:
            failure = await self._apply_rule(server, rule)
            if failure is not None:
                return failure
            envelope.mail_from = address
            envelope.mail_options.extend(mail_options)
            return rule.status
        return MISSING

    async def handle_RCPT(
        self,
        server: _FaultSMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> object:
        """RCPT TO: scripted reply/delay/drop, refused recipients, otherwise 250."""
        owner = self._owner
        await owner._sleep_if_delayed("rcpt")
        rule = owner._take_rule("rcpt")
        if rule is not None:
            failure = await self._apply_rule(server, rule)
            if failure is not None:
                return failure
            envelope.rcpt_tos.append(address)
            envelope.rcpt_options.extend(rcpt_options)
            return rule.status
        refusal = owner._refusal_for(address)
        if refusal is not None:
            return refusal
        return MISSING

    async def handle_DATA(
        self, server: _FaultSMTP, session: Session, envelope: Envelope
    ) -> str:
        """End of DATA: delay, decide the scripted outcome, hold, then apply it."""
        owner = self._owner
        await owner._sleep_if_delayed("data")
        # The outcome is decided on arrival so ``times=n`` counts in arrival order.
        rule = owner._take_rule("data")
        gate = owner._enter_hold()
        if gate is not None:
            try:
                while not gate.is_set():
                    await asyncio.sleep(_HOLD_POLL_SECONDS)
            finally:
                owner._leave_hold()
            if owner._is_stopping():
                # Shutting down: abandon the message, the client sees a disconnect.
                server.drop_connection()
        queue_id = f"{next(_queue_ids):08X}"
        status = f"250 2.0.0 OK: queued as {queue_id}"
        refusal = owner._over_quota()
        if refusal is not None:
            await server.reply_and_close(refusal)
        if rule is not None:
            failure = await self._apply_rule(server, rule)
            if failure is not None:
                return failure
            status, queue_id = rule.status, None
        assert envelope.mail_from is not None
        data = envelope.original_content or b""
        auth_username = session.auth_data if session.authenticated else None
        owner._record(
            ReceivedMessage(
                mail_from=envelope.mail_from,
                rcpt_tos=list(envelope.rcpt_tos),
                data=bytes(data),
                message_id=_extract_message_id(data),
                mail_options=list(envelope.mail_options),
                auth_username=auth_username if isinstance(auth_username, str) else None,
                tls=session.ssl is not None,
                queue_id=queue_id,
            )
        )
        if owner._take_accept_drop():
            server.drop_connection()
        return status

    async def handle_AUTH(
        self, server: _FaultSMTP, session: Session, envelope: Envelope, args: list[str]
    ) -> object:
        """Count AUTH commands; refuse AUTH unless :meth:`require_auth` is active."""
        owner = self._owner
        owner._count_auth_attempt()
        if not owner._auth_is_required():
            return "502 5.5.1 AUTH not enabled on this server"
        if owner._take_auth_drop():
            server.drop_connection()
        return MISSING

    def authenticate(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        mechanism: str,
        auth_data: Any,
    ) -> AuthResult:
        """aiosmtpd ``authenticator`` (PLAIN, LOGIN): check the scripted credentials."""
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        username = self._owner._check_credentials(auth_data.login, auth_data.password)
        if username is None:
            return AuthResult(success=False, handled=False)
        # Only the user name is kept in the session, never the password.
        return AuthResult(success=True, auth_data=username)


class _Controller(Controller):
    """aiosmtpd ``Controller`` that builds :class:`_FaultSMTP`; supports ``port=0``."""

    def __init__(
        self,
        owner: FaultSMTPServer,
        handler: _Handler,
        *,
        host: str,
        port: int,
        ready_timeout: float,
    ) -> None:
        super().__init__(handler, hostname=host, port=port, ready_timeout=ready_timeout)
        self._owner = owner

    def factory(self) -> SMTP:
        """Create the protocol instance for one connection."""
        return self._owner._build_protocol(self.handler, self.loop)

    def _trigger_server(self) -> None:
        """Learn the real port and invoke ``factory()`` once without a connection.

        aiosmtpd normally opens a throw-away client connection to ``self.port``
        here, which cannot work with port 0 and would pollute the connection
        counters and consume scripted faults.
        """
        server = self.server
        assert isinstance(server, asyncio.Server)
        self.port = server.sockets[0].getsockname()[1]
        self.loop.call_soon_threadsafe(self._factory_invoker)


def _generate_certificate(directory: Path) -> tuple[Path, Path]:
    """Create a self-signed certificate for localhost/127.0.0.1 with ``openssl``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "FaultSMTPServer(starttls=True) needs the 'openssl' command line tool "
            "on PATH to generate a self-signed certificate, but it was not found."
        )
    cert_file = directory / "cert.pem"
    key_file = directory / "key.pem"
    command = [
        openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=localhost",
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        "-keyout", str(key_file), "-out", str(cert_file),
    ]  # fmt: skip
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(
            f"could not run openssl to create a certificate: {exc}"
        ) from exc
    if result.returncode != 0 or not cert_file.exists() or not key_file.exists():
        raise RuntimeError(
            f"openssl failed to create a self-signed certificate "
            f"(exit code {result.returncode}): {result.stderr.strip()}"
        )
    return cert_file, key_file


class FaultSMTPServer:
    """A real SMTP server on 127.0.0.1 whose behaviour tests can script.

    Normal behaviour: accept every message with 250 and record it in
    :attr:`messages`.  Scripting methods (:meth:`reply`, :meth:`drop`,
    :meth:`delay`, :meth:`refuse_recipient`, :meth:`hold`,
    :meth:`require_auth`) take effect immediately, also while sessions are
    open, and :meth:`reset_faults` undoes them all.

    Use as a context manager or with :meth:`start`/:meth:`stop`.  The server
    can be restarted after :meth:`stop`; with ``port=0`` it then gets a new port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        starttls: bool = False,
        server_hostname: str = "localhost",
        data_size_limit: int = DATA_SIZE_LIMIT,
        ready_timeout: float = 10.0,
        pipelining: bool = True,
        smtputf8: bool = True,
    ) -> None:
        """Configure (but do not start) the server.

        :param host: address to listen on.
        :param port: port to listen on; 0 picks a free ephemeral port.
        :param starttls: offer STARTTLS with a self-signed certificate created
            at :meth:`start` with the ``openssl`` command line tool (see
            :attr:`cert_file`).
        :param server_hostname: the name the server uses in its replies.
        :param data_size_limit: largest message accepted (SIZE), in bytes.
        :param ready_timeout: how long :meth:`start` waits for the server thread.
        :param pipelining: advertise ``PIPELINING`` (RFC 2920) in the EHLO reply,
            as real servers do; aiosmtpd reads commands in order either way.
        :param smtputf8: offer ``SMTPUTF8`` (RFC 6531); without it the server
            refuses UTF-8 in commands and the ``SMTPUTF8`` MAIL parameter.
        """
        self._host = host
        self._requested_port = port
        self._port = port
        self._starttls = starttls
        self._server_hostname = server_hostname
        self._data_size_limit = data_size_limit
        self._ready_timeout = ready_timeout
        self.pipelining = pipelining
        self.smtputf8 = smtputf8

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._controller: _Controller | None = None
        self._stopping = False
        self._tls_dir: Path | None = None
        self._cert_file: Path | None = None
        self._tls_context: ssl.SSLContext | None = None

        # recording
        self._messages: list[ReceivedMessage] = []
        self._connections = 0
        self._active = 0
        self._max_concurrent = 0
        self._data_attempts = 0
        self._auth_attempts = 0
        self._sessions: set[_FaultSMTP] = set()
        self._peers: list[tuple[str, int]] = []
        self._on_connect: Callable[[tuple[str, int]], None] | None = None

        # scripting
        self._rules: dict[Phase, list[_Rule]] = {}
        self._delays: dict[Phase, _Delay] = {}
        self._refused: dict[str, str] = {}
        self._credentials: tuple[str, str] | None = None
        self._hold_gate: threading.Event | None = None
        self._held = 0
        self._delaying = 0
        self._mid_data_drop: _MidDataDrop | None = None
        # drop_after_accept(): messages still to record and then drop (-1: all).
        self._accept_drops = 0
        self._mid_data_drops = 0
        self._auth_drops = 0  # AUTH commands still to drop; -1 = every one
        self._quota: _Quota | None = None
        self._quota_refusals = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (the real one once started)."""
        return self._port

    @property
    def running(self) -> bool:
        """Whether the server is started."""
        with self._lock:
            return self._controller is not None

    @property
    def cert_file(self) -> str:
        """Path of the PEM certificate offered with STARTTLS (trust it in clients).

        Only available with ``starttls=True`` while the server runs.
        """
        with self._lock:
            if self._cert_file is None:
                raise RuntimeError(
                    "cert_file is only available while a "
                    "FaultSMTPServer(starttls=True) is running"
                )
            return str(self._cert_file)

    def start(self) -> Self:
        """Start listening and return ``self``; ``RuntimeError`` if already running."""
        with self._lock:
            if self._controller is not None:
                raise RuntimeError("FaultSMTPServer is already running")
            self._stopping = False
        if self._starttls:
            self._setup_tls()
        controller = _Controller(
            self,
            _Handler(self),
            host=self._host,
            port=self._requested_port,
            ready_timeout=self._ready_timeout,
        )
        try:
            controller.start()
        except BaseException:
            self._stop_controller(controller)
            self._cleanup_tls()
            raise
        with self._lock:
            self._port = controller.port
            self._controller = controller
        return self

    def stop(self) -> None:
        """Stop the server; never hangs.  Safe to call twice.

        Held messages are released from their hold but abandoned: their
        connections are closed without a reply (the client sees a disconnect)
        and they are not recorded.  All open sessions are closed.
        Must not be called from the server's own thread.
        """
        with self._cond:
            controller = self._controller
            if controller is None:
                return
            self._stopping = True
            self._release_locked()
        try:
            future = asyncio.run_coroutine_threadsafe(
                self._close_sessions(controller), controller.loop
            )
            try:
                future.result(timeout=_SHUTDOWN_TIMEOUT)
            except TimeoutError:
                future.cancel()
        finally:
            self._stop_controller(controller)
            with self._cond:
                self._controller = None
                self._sessions.clear()
                self._active = 0
                self._cond.notify_all()
            self._cleanup_tls()

    def __enter__(self) -> Self:
        """Start the server."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server."""
        self.stop()

    def __repr__(self) -> str:
        with self._lock:
            state = "running" if self._controller is not None else "stopped"
            return (
                f"<FaultSMTPServer {self._host}:{self._port} {state} "
                f"messages={len(self._messages)} connections={self._connections}>"
            )

    # ------------------------------------------------------------------ recording

    @property
    def messages(self) -> list[ReceivedMessage]:
        """Snapshot (a new list) of the accepted messages, oldest first."""
        with self._lock:
            return list(self._messages)

    def message_ids(self) -> list[str]:
        """Message-ID header values of the accepted messages that have one."""
        with self._lock:
            return [m.message_id for m in self._messages if m.message_id is not None]

    def clear(self) -> None:
        """Forget the received messages (counters and scripting are kept)."""
        with self._cond:
            self._messages.clear()
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> bool:
        """Block until at least ``count`` messages were accepted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._messages) >= count, timeout)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Block until ``predicate()`` is true; False on timeout.

        The predicate is re-evaluated (holding the server's lock, so it may read
        any of the server's properties) whenever the server's state changes:
        messages, counters, held/delaying sessions.
        """
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    @property
    def connections(self) -> int:
        """Number of sessions (client connections) opened so far."""
        with self._lock:
            return self._connections

    @property
    def active_connections(self) -> int:
        """Number of sessions currently open."""
        with self._lock:
            return self._active

    @property
    def max_concurrent_connections(self) -> int:
        """Peak number of simultaneously open sessions."""
        with self._lock:
            return self._max_concurrent

    @property
    def data_attempts(self) -> int:
        """Number of DATA commands received, accepted or not."""
        with self._lock:
            return self._data_attempts

    @property
    def auth_attempts(self) -> int:
        """Number of AUTH commands received, successful or not."""
        with self._lock:
            return self._auth_attempts

    @property
    def delaying(self) -> int:
        """Number of sessions currently sleeping in a scripted :meth:`delay`."""
        with self._lock:
            return self._delaying

    def reset_counters(self) -> None:
        """Zero connections, max_concurrent_connections, data_ and auth_attempts."""
        with self._cond:
            self._connections = 0
            self._max_concurrent = self._active
            self._data_attempts = 0
            self._auth_attempts = 0
            self._cond.notify_all()

    # ------------------------------------------------------------------ scripting

    def reply(
        self,
        phase: Phase,
        code: int,
        text: str | None = None,
        *,
        times: int | None = None,
    ) -> None:
        """Answer ``code text`` at ``phase`` instead of the normal reply.

        ``phase`` is one of ``"connect"`` (the greeting; with a 4xx/5xx code
        the connection is closed right after it), ``"ehlo"`` (EHLO and HELO),
        ``"mail"``, ``"rcpt"`` or ``"data"`` (the reply to the end of DATA,
        sent after the whole content was received; the message is not
        recorded unless ``code`` is 2xx).  A 421 at any phase also closes the
        connection.  ``times=None`` applies to every occurrence, ``times=n``
        to the next ``n`` only.  Rules for the same phase (from :meth:`reply`
        and :meth:`drop`) are used in the order they were added; a rule with
        ``times=None`` never runs out, so rules added after it for that phase
        never fire.  Multi-line ``text`` gives a multi-line reply.
        """
        phase = _check_phase(phase)
        _check_times(times)
        if isinstance(code, bool) or not 200 <= code <= 599:
            raise ValueError(f"code must be an SMTP reply code 200..599, got {code!r}")
        rule = _Rule(
            "reply", code, _default_text(code) if text is None else text, times
        )
        with self._cond:
            self._rules.setdefault(phase, []).append(rule)

    def quota(self, rate: float, burst: float,
              status: str = "421 4.7.0 Too many messages, slow down") -> None:
        """Refuse messages over ``rate`` a second (a token bucket of ``burst`` shared by
        every session) at the end of DATA with ``status``, closing the connection.

        A refused message is not recorded; :attr:`quota_refusals` counts them.
        """
        with self._cond:
            self._quota = _Quota(rate, burst, status)

    @property
    def quota_refusals(self) -> int:
        """Messages refused by :meth:`quota`."""
        with self._lock:
            return self._quota_refusals

    def _over_quota(self) -> str | None:
        with self._cond:
            if self._quota is None or self._quota.take():
                return None
            self._quota_refusals += 1
            return self._quota.status

    def drop(self, phase: Phase = "data", *, times: int | None = None) -> None:
        """Close the connection abruptly, without replying, at ``phase``.

        For ``"data"`` this happens after the whole content was received: the
        client sees a disconnect while waiting for the final reply, and the
        message is not recorded.  ``times`` and ordering work as for :meth:`reply`.
        """
        phase = _check_phase(phase)
        _check_times(times)
        with self._cond:
            self._rules.setdefault(phase, []).append(_Rule("drop", remaining=times))

    def drop_mid_data(self, *, after_bytes: int = 64, times: int | None = None) -> None:
        """Close the connection in the middle of the DATA content.

        The server answers ``354``, reads at most ``after_bytes`` of the
        message, then closes the connection without a reply while the client
        is still sending (unlike ``drop("data")``, which waits for the whole
        content).  Nothing is recorded.  ``times`` works as for :meth:`reply`;
        a later call replaces the previous one.
        """
        _check_times(times)
        if isinstance(after_bytes, bool) or after_bytes < 1:
            raise ValueError(f"after_bytes must be a positive integer, got {after_bytes!r}")
        with self._cond:
            self._mid_data_drop = _MidDataDrop(after_bytes, times)

    @property
    def mid_data_drops(self) -> int:
        """Number of connections closed by :meth:`drop_mid_data` so far."""
        with self._lock:
            return self._mid_data_drops

    def refuse_recipient(
        self, address: str, code: int = 550, text: str = "5.7.1 Recipient address rejected"
    ) -> None:
        """Refuse ``RCPT TO`` for ``address`` (compared case-insensitively).

        The default is a policy refusal: a test that means an unknown user says
        ``5.1.1``, which the outbox also answers by suppressing the address.
        """
        if isinstance(code, bool) or not 400 <= code <= 599:
            raise ValueError(f"code must be a 4xx or 5xx reply code, got {code!r}")
        with self._cond:
            self._refused[address.casefold()] = _format_reply(code, text)

    def delay(self, phase: Phase, seconds: float, *, times: int | None = None) -> None:
        """Sleep ``seconds`` before answering ``phase``, not blocking other sessions.

        For ``"data"`` the delay starts after the content was received.
        ``times=n`` delays only the next ``n`` occurrences; ``seconds=0``
        removes the delay.  A new call replaces the phase's previous delay.
        """
        phase = _check_phase(phase)
        _check_times(times)
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        with self._cond:
            if seconds == 0:
                self._delays.pop(phase, None)
            else:
                self._delays[phase] = _Delay(float(seconds), times)

    def hold(self) -> None:
        """From now on withhold the final DATA reply until :meth:`release`.

        Held messages are fully received but not recorded (not in
        :attr:`messages`) until released.
        """
        with self._cond:
            if self._hold_gate is None:
                self._hold_gate = threading.Event()

    def release(self) -> None:
        """Stop holding: held messages are accepted (recorded, answered 250)."""
        with self._cond:
            self._release_locked()

    @property
    def held(self) -> int:
        """Number of messages currently held."""
        with self._lock:
            return self._held

    def wait_held(self, n: int, timeout: float = 10.0) -> bool:
        """Block until at least ``n`` messages are being held; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._held >= n, timeout)

    def require_auth(self, username: str, password: str) -> None:
        """Advertise AUTH PLAIN/LOGIN and require a successful login before MAIL.

        Without login MAIL gets 530; wrong credentials get 535.  Works over
        plain TCP.  Each AUTH command counts in :attr:`auth_attempts`.
        """
        with self._cond:
            self._credentials = (username, password)

    def drop_after_accept(self, *, times: int | None = None) -> None:
        """Record the message at the end of DATA, then close the connection without its
        ``250``: the server took it, and the client cannot know (a crash after the queue
        write). ``times`` works as for :meth:`reply`."""
        _check_times(times)
        with self._cond:
            self._accept_drops = -1 if times is None else times

    def _take_accept_drop(self) -> bool:
        with self._cond:
            if self._accept_drops == 0:
                return False
            if self._accept_drops > 0:
                self._accept_drops -= 1
            return True

    def drop_during_auth(self, *, times: int | None = None) -> None:
        """Close the connection, without replying, when the client sends AUTH.

        Only while :meth:`require_auth` is active (AUTH is advertised).  The
        client has sent its command (with PLAIN, its credentials too) and sees
        a disconnect.  ``times`` works as for :meth:`reply`.
        """
        _check_times(times)
        with self._cond:
            self._auth_drops = -1 if times is None else times

    def reset_faults(self) -> None:
        """Drop all scripting (replies, drops, delays, refusals, auth), free holds."""
        with self._cond:
            self._rules.clear()
            self._delays.clear()
            self._refused.clear()
            self._credentials = None
            self._mid_data_drop = None
            self._accept_drops = 0
            self._auth_drops = 0
            self._quota = None
            self._release_locked()

    # ------------------------------------------------------------------ internals
    # Called from the server's loop thread (or under the lock by public methods).

    def _release_locked(self) -> None:
        """Open the current hold gate (caller holds the lock)."""
        if self._hold_gate is not None:
            self._hold_gate.set()
            self._hold_gate = None
        self._cond.notify_all()

    def _build_protocol(
        self, handler: Any, loop: asyncio.AbstractEventLoop
    ) -> _FaultSMTP:
        """Create the aiosmtpd protocol for one connection."""
        return _FaultSMTP(
            handler,
            owner=self,
            loop=loop,
            hostname=self._server_hostname,
            data_size_limit=self._data_size_limit,
            enable_SMTPUTF8=self.smtputf8,
            tls_context=self._tls_context,
            # AUTH is enforced dynamically by _FaultSMTP.check_auth_needed, so
            # aiosmtpd's static auth_required stays False (which also avoids its
            # "Requiring AUTH while not requiring TLS" warning).
            auth_required=False,
            auth_require_tls=False,
            authenticator=handler.authenticate,
        )

    def on_connect(self, callback: Callable[[tuple[str, int]], None] | None) -> None:
        """Call ``callback(peer)`` at each new connection, in the server's thread, while
        the client's socket is certainly open (e.g. to find which process opened it)."""
        with self._cond:
            self._on_connect = callback

    @property
    def peers(self) -> list[tuple[str, int]]:
        """The client address and port of every connection, in order."""
        with self._cond:
            return list(self._peers)

    def _session_opened(self, session: _FaultSMTP, peer: Any = None) -> None:
        with self._cond:
            callback = self._on_connect
            if peer is not None:
                self._peers.append((str(peer[0]), int(peer[1])))
        if callback is not None and peer is not None:
            callback((str(peer[0]), int(peer[1])))
        with self._cond:
            self._sessions.add(session)
            self._connections += 1
            self._active += 1
            self._max_concurrent = max(self._max_concurrent, self._active)
            self._cond.notify_all()

    def _session_closed(self, session: _FaultSMTP) -> None:
        with self._cond:
            if session in self._sessions:
                self._sessions.discard(session)
                self._active -= 1
            self._cond.notify_all()

    def _count_data_attempt(self) -> None:
        with self._cond:
            self._data_attempts += 1
            self._cond.notify_all()

    def _count_auth_attempt(self) -> None:
        with self._cond:
            self._auth_attempts += 1
            self._cond.notify_all()

    def _record(self, message: ReceivedMessage) -> None:
        with self._cond:
            self._messages.append(message)
            self._cond.notify_all()

    def _is_stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def _take_rule(self, phase: Phase) -> _Rule | None:
        """Return (a copy of) the next rule for ``phase``, consuming one use of it."""
        with self._lock:
            rules = self._rules.get(phase)
            if not rules:
                return None
            rule = rules[0]
            if rule.remaining is not None:
                rule.remaining -= 1
                if rule.remaining <= 0:
                    rules.pop(0)
            return _Rule(rule.action, rule.code, rule.text)

    async def _sleep_if_delayed(self, phase: Phase) -> None:
        """Sleep (asynchronously) if a delay is scripted for ``phase``."""
        with self._cond:
            delay = self._delays.get(phase)
            if delay is None:
                return
            seconds = delay.seconds
            if delay.remaining is not None:
                delay.remaining -= 1
                if delay.remaining <= 0:
                    del self._delays[phase]
            self._delaying += 1
            self._cond.notify_all()
        try:
            await asyncio.sleep(seconds)
        finally:
            with self._cond:
                self._delaying -= 1
                self._cond.notify_all()

    def _take_mid_data_drop(self) -> int | None:
        """Bytes to read before a scripted mid-DATA drop, consuming one use; or None."""
        with self._lock:
            drop = self._mid_data_drop
            if drop is None:
                return None
            if drop.remaining is not None:
                drop.remaining -= 1
                if drop.remaining <= 0:
                    self._mid_data_drop = None
            return drop.after_bytes

    def _take_auth_drop(self) -> bool:
        """Whether to drop at this AUTH command, consuming one use."""
        with self._lock:
            if self._auth_drops == 0:
                return False
            if self._auth_drops > 0:
                self._auth_drops -= 1
            return True

    def _count_mid_data_drop(self) -> None:
        with self._cond:
            self._mid_data_drops += 1
            self._cond.notify_all()

    def _refusal_for(self, address: str) -> str | None:
        with self._lock:
            return self._refused.get(address.casefold())

    def _enter_hold(self) -> threading.Event | None:
        """If holding, count one more held message and return the gate to wait on."""
        with self._cond:
            gate = self._hold_gate
            if gate is not None:
                self._held += 1
                self._cond.notify_all()
            return gate

    def _leave_hold(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    def _auth_is_required(self) -> bool:
        with self._lock:
            return self._credentials is not None

    def _check_credentials(self, login: bytes, password: bytes) -> str | None:
        """Return the user name if ``login``/``password`` match :meth:`require_auth`."""
        with self._lock:
            credentials = self._credentials
        if credentials is None:
            return None
        username, expected = credentials
        user_ok = hmac.compare_digest(login, username.encode("utf-8"))
        password_ok = hmac.compare_digest(password, expected.encode("utf-8"))
        return username if user_ok and password_ok else None

    async def _close_sessions(self, controller: _Controller) -> None:
        """Stop accepting, close every open session and wait for their tasks to end."""
        if controller.server is not None:
            controller.server.close()
        # Let connections accepted just before close() finish connection_made().
        await asyncio.sleep(0.05)
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.abort_connection()
        tasks = [
            s._handler_coroutine
            for s in sessions
            if s._handler_coroutine is not None and not s._handler_coroutine.done()
        ]
        if tasks:
            await asyncio.wait(tasks, timeout=_SHUTDOWN_TIMEOUT / 2)
        await asyncio.sleep(0)  # let connection_lost() callbacks run

    def _stop_controller(self, controller: _Controller) -> None:
        """Stop aiosmtpd's thread and make sure its loop is closed."""
        thread = controller._thread
        if thread is not None:
            controller.stop(no_assert=True)
            thread.join(timeout=_SHUTDOWN_TIMEOUT)
        if not controller.loop.is_running() and not controller.loop.is_closed():
            controller.loop.close()

    def _setup_tls(self) -> None:
        """Generate the self-signed certificate and the server SSL context."""
        tls_dir = Path(tempfile.mkdtemp(prefix="fault-smtp-tls-"))
        try:
            cert_file, key_file = _generate_certificate(tls_dir)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(cert_file), str(key_file))
        except BaseException:
            shutil.rmtree(tls_dir, ignore_errors=True)
            raise
        with self._lock:
            self._tls_dir = tls_dir
            self._cert_file = cert_file
            self._tls_context = context

    def _cleanup_tls(self) -> None:
        """Delete the temporary certificate directory."""
        with self._lock:
            tls_dir = self._tls_dir
            self._tls_dir = None
            self._cert_file = None
            self._tls_context = None
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


@pytest.fixture
def smtp_server() -> Iterator[FaultSMTPServer]:
    """A started :class:`FaultSMTPServer`, stopped after the test."""
    with FaultSMTPServer() as server:
        yield server
