"""The exception tree of flask-mail-outbox.

::

    OutboxError
     +-- InvalidMessage (also ValueError)   bad input at send(); nothing was written
     |    +-- TemplateError                 a templated email that cannot be rendered
     +-- ConfigError (also ValueError)      a bad MAIL_* / OUTBOX_* value at init_app()
     +-- TransportError                     raised by transports
          +-- TransientError                try again later (4xx, connection trouble)
          +-- PermanentError                never try again (5xx, every recipient refused)

Transports map their library's errors onto ``TransientError`` and
``PermanentError`` at the boundary with ``raise ... from exc``; nothing above
the transport layer knows about aiosmtplib.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidMessage(OutboxError, ValueError):
    """A message that cannot be queued; the text names the offending field.

    Raised by ``mail.send()`` before anything is added to the session.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class ConfigError(OutboxError, ValueError):
    """A configuration value that cannot work; the text names the key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


class TransportError(OutboxError):
    """A delivery attempt failed.

    ``code`` is the SMTP reply code when there is one (0 otherwise) and
    ``message`` the server's text. Neither ever contains credentials.
    """

    def __init__(self, message: str, *, code: int = 0,
                 refused: dict[str, tuple[int, str]] | None = None) -> None:
        self.code = code
        self.message = message
        #: Each refused recipient's reply, ``{address: (code, text)}``, when the
        #: server refused every recipient (empty otherwise).
        self.refused = refused or {}
        super().__init__(f"{code} {message}" if code else message)


#: The faults of a whole transport that pause it (``TransientError.account_fault``),
#: each with what it means.
ACCOUNT_FAULTS: dict[str, str] = {
    "credentials": "the server or API refused the transport's credentials",
    "quota": "the account's sending quota is spent, or its sending is stopped",
    "sender": "the sender's domain or address is not verified for this account",
    "settings": "the transport's settings name what the provider does not have (a sending "
                "domain, a configuration set)",
    "unreachable": "the server or API cannot be reached at all (connection refused or "
                   "timing out)",
}


#: Each of :data:`ACCOUNT_FAULTS` as the failure reasons name it (``_reasons.REASONS``).
FAULT_REASONS: dict[str, str] = {
    "credentials": "account", "quota": "account", "sender": "account", "settings": "account",
    "unreachable": "network_error",
}


class TransientError(TransportError):
    """Delivery may succeed later: a 4xx reply, a timeout, a dropped connection.

    ``throttled`` is True when the server said we are sending too fast; the
    delivery layer then slows down instead of charging the row an attempt.
    ``transport_fault`` is True when the failure is the transport's, not the
    message's; the attempt then moves to the transport's ``failover`` list.
    ``retry_after`` is how many seconds the server asked to wait (an HTTP
    ``Retry-After``), None when it did not say. ``maybe_sent`` is True when
    the message may have been accepted all the same (the connection dropped
    after the whole message went, a timeout after the request was sent, a
    2xx the transport could not read): retrying it may deliver a second copy,
    so the delivery layer retries it only ``OUTBOX_AMBIGUOUS_RETRIES`` times.
    ``account_fault`` names a fault of the whole transport that no email can
    get past (one of :data:`ACCOUNT_FAULTS`: refused credentials, a spent
    quota, an unverified sender, a server that cannot be reached at all): the
    delivery layer then pauses the transport instead of charging its emails
    attempts (it implies ``transport_fault``).
    """

    def __init__(self, message: str, *, code: int = 0, throttled: bool = False,
                 transport_fault: bool = False, retry_after: float | None = None,
                 refused: dict[str, tuple[int, str]] | None = None,
                 maybe_sent: bool = False, account_fault: str | None = None) -> None:
        super().__init__(message, code=code, refused=refused)
        self.throttled = throttled
        self.retry_after = retry_after
        #: The message may have been delivered although the attempt failed.
        self.maybe_sent = maybe_sent
        #: The transport itself is broken, not this message (refused connection,
        #: TLS or login failure, timeout, 421): a transport's ``failover`` takes it.
        self.transport_fault = transport_fault or account_fault is not None
        if account_fault is not None and account_fault not in ACCOUNT_FAULTS:
            raise ValueError(f"account_fault: must be one of {sorted(ACCOUNT_FAULTS)}, "
                             f"got {account_fault!r}")
        #: The fault of the whole transport this is, or None (see :data:`ACCOUNT_FAULTS`).
        self.account_fault = account_fault


class PermanentError(TransportError):
    """Delivery will never succeed as sent: a 5xx reply, every recipient refused."""


class TemplateError(InvalidMessage):
    """A templated email that cannot be rendered; nothing was written.

    Raised by ``mail.send_template()`` and ``mail.template_message()``: a
    missing template, a syntax error, an undefined variable, an exception in
    the template, an unknown locale, MJML that does not compile, a stylesheet
    that cannot be read. ``template`` is the email's name (``"orders/shipped"``),
    ``locale`` the locale it was rendered in, ``file`` and ``lineno`` the
    template file and line the problem is in, when known.
    """

    def __init__(self, template: str, problem: str, *, locale: str | None = None,
                 file: str | None = None, lineno: int | None = None) -> None:
        self.template = template
        self.locale = locale
        self.file = file
        self.lineno = lineno
        where = f"template {template!r}"
        if locale:
            where += f" ({locale})"
        if file:
            where += f" {file}" + (f" line {lineno}" if lineno else "")
        super().__init__(where, problem)
