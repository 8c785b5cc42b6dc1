"""One mail transaction on an open SMTP session, and what its errors mean.

:func:`send_message` sends one message on a :class:`~._pipeline.Session`:
MAIL, RCPTs and DATA as one group when the server offers PIPELINING (one
command at a time when it does not), then the content, with the next
message's group in the same write when the caller offers one (RFC 2920 lets
the content open a group). Which message goes on which connection, and
when, is the caller's business (:mod:`._smtp`); a transaction only asks it,
through ``begin``, whether it may still start.

aiosmtplib's errors are mapped here, and only here (:func:`map_smtp_error`),
onto :class:`TransientError` (4xx, timeouts, dropped connections, login
failures, which are configuration problems that a fix resolves) and
:class:`PermanentError` (5xx). No credential ever reaches an error text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import aiosmtplib

from .._compose.addresses import needs_smtputf8
from .._errors import PermanentError, TransientError, TransportError
from .._outside import clean_text, redact
from ._base import Delivered, Envelope, Failed, Result
from ._pipeline import Session, dot_stuffed, envelope_commands
from ._replies import ReplyClass, classify_reply, queue_id

#: What :func:`send_message` returns: (result, keep the connection, the follow written).
Outcome = tuple[Result | None, bool, bool]


def _is_throttle(code: int, text: str) -> bool:
    return classify_reply(code, text) is ReplyClass.THROTTLED


def map_smtp_error(exc: BaseException, secrets: Sequence[str | None] = ()) -> TransportError:
    """Translate an aiosmtplib (or socket) error into the outbox's error tree.

    Every text a server chose (its replies, as aiosmtplib read them while
    opening a session) is made safe to store here, where it enters, and
    ``secrets`` (the password) are replaced by ``[redacted]``.
    """
    def safe(text: object) -> str:
        cleaned = clean_text(text)
        return redact(cleaned, secrets) if secrets else cleaned

    if isinstance(exc, aiosmtplib.SMTPAuthenticationError) or (
            isinstance(exc, aiosmtplib.SMTPResponseException) and exc.code in (530, 535)):
        # A bad password (535), or a server that wants one (530): fixed by
        # configuration, not by giving up on the email; the transport pauses.
        return TransientError(f"authentication failed: {safe(exc.message)}", code=exc.code,
                              account_fault="credentials")
    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        codes = [err.code for err in exc.recipients]
        replies = [(err.recipient, err.code, safe(err.message)) for err in exc.recipients]
        text = "; ".join(f"{address}: {code} {message}" for address, code, message in replies)
        refused = {address: (code, message) for address, code, message in replies}
        if all(code >= 500 for code in codes):
            return PermanentError(f"every recipient refused: {text}", code=max(codes),
                                  refused=refused)
        # Throttled only when every temporary refusal says so (Gmail's 450 4.2.1
        # "receiving mail at a rate" comes at RCPT): one greylisting recipient
        # means the attempt counts.
        temporary = [(code, message) for _, code, message in replies if code < 500]
        return TransientError(f"every recipient refused: {text}", code=min(codes),
                              throttled=all(_is_throttle(code, message)
                                            for code, message in temporary), refused=refused)
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        message = safe(exc.message)
        if isinstance(exc, aiosmtplib.SMTPConnectResponseError) or exc.code < 500:
            throttled = _is_throttle(exc.code, message)
            # 421: the service is closing the channel; a throttle paces instead.
            fault = not throttled and (exc.code == 421 or isinstance(
                exc, aiosmtplib.SMTPConnectResponseError))
            return TransientError(message, code=exc.code, throttled=throttled,
                                  transport_fault=fault)
        return PermanentError(message, code=exc.code)
    if isinstance(exc, (aiosmtplib.SMTPTimeoutError, TimeoutError)):
        return TransientError(f"timed out: {safe(exc)}", transport_fault=True)
    if isinstance(exc, (aiosmtplib.SMTPException, OSError)):
        # Refused or dropped connections, TLS handshakes: the server, not the message.
        return TransientError(f"{type(exc).__name__}: {safe(exc)}", transport_fault=True)
    return TransientError(f"unexpected {type(exc).__name__}: {safe(exc)}")


def utf8_addresses(envelope: Envelope) -> list[str]:
    """The addresses of ``envelope`` that need SMTPUTF8 (RFC 6531), sender first."""
    return [a for a in (envelope.sender, *envelope.recipients) if needs_smtputf8(a)]


def smtputf8_refusal(session: Session, envelope: Envelope) -> PermanentError | None:
    """Why ``envelope`` can never go through this server: it needs SMTPUTF8, not offered."""
    utf8 = utf8_addresses(envelope)
    if not utf8 or session.smtputf8:
        return None
    shown = ", ".join(repr(a) for a in utf8[:3]) + (f" and {len(utf8) - 3} more"
                                                   if len(utf8) > 3 else "")
    return PermanentError(
        f"the server does not offer the SMTPUTF8 extension (RFC 6531), which the non-ASCII "
        f"address {shown} needs (OUTBOX_ALLOW_SMTPUTF8 accepted it): send it through a "
        "server that offers SMTPUTF8, or to an ASCII address")


def envelope_group(session: Session, envelope: Envelope) -> list[bytes]:
    """MAIL FROM (with SIZE when offered, SMTPUTF8 when needed) and the RCPT TO lines.

    Raises ``ValueError`` for an envelope this session cannot carry
    (:func:`smtputf8_refusal` says why).
    """
    options = list(envelope.mail_options)
    if session.size and not any(o.upper().startswith("SIZE=") for o in options):
        options.append(f"SIZE={len(envelope.mime)}")
    utf8 = bool(utf8_addresses(envelope))
    if utf8:
        if not session.smtputf8:
            raise ValueError("the envelope needs SMTPUTF8, which the server does not offer")
        # Only when an address needs it: RFC 6531 asks the server to deliver
        # such mail only to SMTPUTF8-capable hops, so ASCII mail never asks.
        upper = [o.upper() for o in options]
        if "SMTPUTF8" not in upper:
            options.append("SMTPUTF8")
        if session.eightbitmime and not any(o.startswith("BODY=") for o in upper):
            options.append("BODY=8BITMIME")  # RFC 6532 headers are 8-bit content
    return envelope_commands(envelope.sender, envelope.recipients, options,
                             envelope.rcpt_options, utf8=utf8)


@dataclasses.dataclass
class _Progress:
    """How far one transaction got, for the reply to a failure."""

    opened: bool = False  # the server answered MAIL FROM: a transaction may be open
    content_sent: bool = False  # the whole content and its final dot went out
    finished: bool = False  # the content's reply came: none is open any more
    follow_written: bool = False


async def send_message(session: Session, envelope: Envelope, *, timeout: float | None,
                       begin: Callable[[], bool], written: bool = False,
                       take_follow: Callable[[], Envelope | None] | None = None) -> Outcome:
    """Send ``envelope`` on ``session``; returns (result, keep connection, ``follow`` written).

    A result of None means the connection was dead before the server saw
    anything of this message (safe to resend at once), or ``begin`` said no.
    ``begin()`` is asked right before the message counts as started, in the
    same step, so a caller's cancel is exact: False means stop (the message
    was given up), True marks it started. ``written``: this message's MAIL,
    RCPTs and DATA went out already, after the previous message's content;
    it counts as started only when its content goes, and a stop before that
    closes the connection instead (nothing was accepted). ``take_follow``
    (pipelining servers only) gives the next message, whose MAIL, RCPTs and
    DATA go out with this one's content: one write and one round trip per
    message; when it was written, the caller sends it next on this
    connection, or again on another one if this one is dropped.
    """
    if not written and not begin():
        # Stopped while this connection opened: it must not start now.
        return None, True, False
    refusal = None if written else smtputf8_refusal(session, envelope)
    if refusal is not None:
        # Nothing was written: the connection goes on with the next message.
        return Failed(refusal), True, False
    pipe, progress = session.pipe, _Progress()
    try:
        # An envelope that went ahead was built and written with the last content.
        lines = [] if written else envelope_group(session, envelope)
        content = dot_stuffed(envelope.mime)
        if not written and pipe.discard_unsolicited():
            return None, False, False
        try:
            if not written:
                # MAIL, every RCPT and DATA in one write (RFC 2920), or MAIL alone.
                pipe.write(b"".join(lines) + b"DATA\r\n" if session.pipelining else lines[0])
            reply = await pipe.read(timeout)
        except aiosmtplib.SMTPServerDisconnected:
            return None, False, False
        progress.opened = True
        answers = await _envelope_replies(session, envelope, reply, lines, written, timeout)
        if answers is None:
            # Its envelope went ahead and its content never did: resend it on a
            # fresh connection, uncharged.
            return None, False, False
        replies, data_reply = answers
        refused = await _accepted(session, envelope, reply, replies, data_reply, timeout)
        return await _send_content(session, envelope, content, refused, data_reply,
                                   begin=begin, written=written, take_follow=take_follow,
                                   progress=progress, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - every error becomes a result
        return await _failed(session, exc, progress, timeout)


async def _envelope_replies(session: Session, envelope: Envelope,
                            reply: aiosmtplib.SMTPResponse, lines: list[bytes], written: bool,
                            timeout: float | None
                            ) -> tuple[list[aiosmtplib.SMTPResponse],
                                       aiosmtplib.SMTPResponse | None] | None:
    """The RCPT replies and (pipelined) the DATA reply; None when a written-ahead line died."""
    pipe = session.pipe
    if not session.pipelining:
        replies = []
        if reply.code == 250:
            for line in lines[1:]:
                replies.append(await pipe.command(line, timeout))
        return replies, None
    try:
        replies = [await pipe.read(timeout) for _ in envelope.recipients]
        data_reply = await pipe.read(timeout)
    except (aiosmtplib.SMTPServerDisconnected, aiosmtplib.SMTPTimeoutError):
        if written:
            return None
        raise
    if reply.code != 250 and data_reply.code == 354:
        # A server that took DATA after refusing MAIL: end it, so that the RSET
        # after the failure is read as a command, not as content.
        await pipe.command(b".\r\n", timeout)
    return replies, data_reply


async def _accepted(session: Session, envelope: Envelope, reply: aiosmtplib.SMTPResponse,
                    replies: list[aiosmtplib.SMTPResponse],
                    data_reply: aiosmtplib.SMTPResponse | None,
                    timeout: float | None) -> dict[str, tuple[int, str]]:
    """The recipients refused; raises when the sender or every recipient was."""
    if reply.code != 250:
        raise aiosmtplib.SMTPSenderRefused(reply.code, reply.message, envelope.sender)
    refused: dict[str, tuple[int, str]] = {}
    refusals: list[aiosmtplib.SMTPRecipientRefused] = []
    for recipient, answer in zip(envelope.recipients, replies):
        if answer.code not in (250, 251):
            refusals.append(aiosmtplib.SMTPRecipientRefused(
                answer.code, answer.message, recipient))
            refused[recipient] = (answer.code, answer.message)
    if len(refusals) == len(envelope.recipients):
        if data_reply is not None and data_reply.code == 354:
            # The server took DATA with nobody to deliver to: end it empty.
            await session.pipe.command(b".\r\n", timeout)
        raise aiosmtplib.SMTPRecipientsRefused(refusals)
    return refused


async def _send_content(session: Session, envelope: Envelope, content: bytes,
                        refused: dict[str, tuple[int, str]],
                        data_reply: aiosmtplib.SMTPResponse | None, *,
                        begin: Callable[[], bool], written: bool,
                        take_follow: Callable[[], Envelope | None] | None,
                        progress: _Progress, timeout: float | None) -> Outcome:
    """DATA (unless it went with the envelope), then the content and the next group."""
    pipe = session.pipe
    if data_reply is None:
        data_reply = await pipe.command(b"DATA\r\n", timeout)
    if data_reply.code != 354:
        raise aiosmtplib.SMTPDataError(data_reply.code, data_reply.message)
    if written and not begin():
        # Its envelope went ahead, but delivery stops: after 354 only closing
        # the connection ends the transaction without a message.
        pipe.close()
        return None, False, False
    follow = take_follow() if take_follow is not None else None
    group = b""
    if follow is not None:
        try:
            group = b"".join(envelope_group(session, follow)) + b"DATA\r\n"
        except ValueError:
            group = b""  # it fails on its own turn, not inside this one
    pipe.write(content + group)
    progress.content_sent = True
    progress.follow_written = bool(group)
    done = await pipe.read(timeout)
    progress.finished = True
    if done.code != 250:
        raise aiosmtplib.SMTPDataError(done.code, done.message)
    return (Delivered(refused=refused, provider_message_id=queue_id(done.message)), True,
            progress.follow_written)


async def _failed(session: Session, exc: Exception, progress: _Progress,
                  timeout: float | None) -> Outcome:
    """The failure's result, and whether the connection can go on (after an RSET)."""
    pipe = session.pipe
    keep = pipe.is_connected and isinstance(
        exc, (aiosmtplib.SMTPResponseException, aiosmtplib.SMTPRecipientsRefused))
    if keep and progress.opened and not progress.finished:
        # A transaction left open; none is open after the content's reply (and
        # an RSET then would cancel the envelope sent ahead).
        try:
            reset = await pipe.command(b"RSET\r\n", timeout)
            keep = reset.code == 250
        except Exception:  # noqa: BLE001 - a failed RSET means a new connection
            keep = False
    error = map_smtp_error(exc)
    if progress.content_sent and not progress.finished and isinstance(error, TransientError) \
            and not isinstance(exc, aiosmtplib.SMTPResponseException):
        # Dropped (or silent) after the final dot: the server may have queued it.
        error = TransientError(f"{error.message}, after the whole message was sent: the "
                               "server may have accepted it", code=error.code,
                               transport_fault=error.transport_fault, maybe_sent=True)
    return Failed(error), keep, progress.follow_written
