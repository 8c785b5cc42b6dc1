"""The streaming interface: ``Transport.open(report)`` and its :class:`Sending`.

Messages go in with ``put()``; each result comes back through ``report`` as
soon as it is known. The base class's stream is tested over custom
transports that only implement ``send()``; the SMTP transport's over the
real aiosmtpd server of :mod:`smtpserver`, proved by the order of events
(what the server had received when each report arrived), not by timing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import pytest

from flask_mail_outbox import PermanentError, TransientError
from flask_mail_outbox._config import OutboxConfig, load_config
from flask_mail_outbox.transports import (
    Delivered,
    Envelope,
    Failed,
    NotAttempted,
    Result,
    Sending,
    Transport,
)

SENDER = "sender@example.com"


def _config(port: int = 25, *, timeout: float = 5.0) -> OutboxConfig:
    return load_config({"MAIL_SERVER": "127.0.0.1", "MAIL_PORT": port, "MAIL_TIMEOUT": timeout,
                        "MAIL_SUPPRESS_SEND": False}, instance_path="/nonexistent",
                       testing=False)


def _envelope(n: int, *recipients: str) -> Envelope:
    mime = f"Message-ID: <m{n}@example.com>\r\nSubject: n{n}\r\n\r\nbody {n}\r\n".encode()
    return Envelope(email_id=n, sender=SENDER, recipients=recipients or ("to@example.com",),
                    mime=mime, message_id=f"<m{n}@example.com>")


class Reports:
    """A report callback that keeps every (email id, result), the thread, and waits."""

    def __init__(self) -> None:
        self.results: list[tuple[int, Result]] = []
        self.threads: set[str] = set()
        self._cond = threading.Condition()

    def __call__(self, envelope: Envelope, result: Result) -> None:
        with self._cond:
            self.results.append((envelope.email_id, result))
            self.threads.add(threading.current_thread().name)
            self._cond.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.results) >= count, timeout)

    @property
    def ids(self) -> list[int]:
        with self._cond:
            return [email_id for email_id, _ in self.results]

    def of(self, email_id: int) -> list[Result]:
        with self._cond:
            return [r for i, r in self.results if i == email_id]


# -- the base class's stream, over a transport that only implements send() ----------------


class Gate(Transport):
    """Records each send() in order; waits for ``opened`` before each while it is clear."""

    def __init__(self) -> None:
        super().__init__(_config())
        self.sent: list[int] = []
        self.threads: set[str] = set()
        self.opened = threading.Event()
        self.opened.set()
        self.entered = threading.Semaphore(0)

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        self.entered.release()
        assert self.opened.wait(10)
        self.sent.append(envelope.email_id)
        self.threads.add(threading.current_thread().name)
        if envelope.recipients == ("later@example.com",):
            raise TransientError("try later", code=451)
        if envelope.recipients == ("never@example.com",):
            raise PermanentError("no such user", code=550)
        if envelope.recipients == ("bug@example.com",):
            raise ValueError("a bug in the transport")
        if "refused@example.com" in envelope.recipients:
            return {"refused@example.com": (550, "no")}
        return {}


@pytest.fixture
def gate() -> Gate:
    return Gate()


def test_the_base_stream_sends_in_put_order_from_its_own_thread(gate: Gate) -> None:
    reports = Reports()
    sending = gate.open(reports)
    for n in range(1, 21):
        sending.put(_envelope(n))
    assert sending.close(10)
    assert gate.sent == list(range(1, 21))
    assert reports.ids == list(range(1, 21))
    assert reports.results == [(n, Delivered(refused={})) for n in range(1, 21)]
    assert gate.threads == reports.threads == {"outbox-send"}
    # Closed and drained: its thread is gone.
    assert not [t for t in threading.enumerate() if t.name == "outbox-send" and t.is_alive()]


def test_the_base_stream_maps_each_outcome(gate: Gate, caplog: pytest.LogCaptureFixture) -> None:
    reports = Reports()
    sending = gate.open(reports)
    sending.put(_envelope(1, "later@example.com"))
    sending.put(_envelope(2, "never@example.com"))
    sending.put(_envelope(3, "bug@example.com"))
    sending.put(_envelope(4, "a@example.com", "refused@example.com"))
    sending.put(_envelope(5))
    assert sending.close(10)
    results = dict(reports.results)
    assert isinstance(results[1], Failed) and type(results[1].error) is TransientError
    assert results[1].error.code == 451
    assert isinstance(results[2], Failed) and type(results[2].error) is PermanentError
    # A bug is a transient failure of that email, logged at ERROR with its fix.
    assert isinstance(results[3], Failed) and type(results[3].error) is TransientError
    assert str(results[3].error) == "transport raised ValueError: a bug in the transport"
    [line] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "Gate.send raised ValueError instead of returning results (email 3)" in (
        line.getMessage())
    assert "Consequence:" in line.getMessage() and "Fix:" in line.getMessage()
    assert results[4] == Delivered(refused={"refused@example.com": (550, "no")})
    assert results[5] == Delivered(refused={})


def test_pending_counts_and_close_waits_for_every_report(gate: Gate) -> None:
    reports = Reports()
    sending = gate.open(reports)
    gate.opened.clear()
    for n in range(1, 4):
        sending.put(_envelope(n))
    assert sending.pending() == 3
    assert gate.entered.acquire(timeout=10)  # the first is inside send()
    assert sending.close(timeout=0.2) is False
    assert sending.pending() == 3 and reports.results == []
    with pytest.raises(RuntimeError, match="closed"):
        sending.put(_envelope(4))
    gate.opened.set()
    assert sending.close() is True
    assert sending.pending() == 0
    assert reports.ids == [1, 2, 3]


def test_cancel_pending_on_the_base_stream(gate: Gate) -> None:
    reports = Reports()
    sending = gate.open(reports)
    gate.opened.clear()
    for n in range(1, 6):
        sending.put(_envelope(n))
    assert gate.entered.acquire(timeout=10)  # 1 is being sent
    assert sending.cancel_pending() == {2, 3, 4, 5}
    with pytest.raises(RuntimeError):
        sending.put(_envelope(6))
    gate.opened.set()
    assert sending.close(10)
    assert gate.sent == [1]
    assert sorted(reports.ids) == [1, 2, 3, 4, 5]
    assert reports.of(1) == [Delivered(refused={})]
    for n in (2, 3, 4, 5):
        [result] = reports.of(n)
        assert isinstance(result, Failed) and isinstance(result.error, NotAttempted)
    assert sending.cancel_pending() == set()


def test_a_raising_report_is_logged_and_sending_goes_on(
        gate: Gate, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def report(envelope: Envelope, result: Result) -> None:
        seen.append(envelope.email_id)
        if envelope.email_id == 1:
            raise KeyError("a bug in the caller")

    sending = gate.open(report)
    for n in (1, 2, 3):
        sending.put(_envelope(n))
    assert sending.close(10)
    assert seen == [1, 2, 3] and gate.sent == [1, 2, 3]
    [line] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "report callback" in line.getMessage() and line.exc_info is not None


def test_report_may_put_more_but_not_close(gate: Gate,
                                           caplog: pytest.LogCaptureFixture) -> None:
    done = threading.Event()
    sending: Sending

    def report(envelope: Envelope, result: Result) -> None:
        if envelope.email_id < 5:
            sending.put(_envelope(envelope.email_id + 1))
        else:
            try:
                sending.close()  # would wait for itself: refused, logged
            finally:
                done.set()

    sending = gate.open(report)
    sending.put(_envelope(1))
    assert done.wait(10)
    assert sending.close(10)
    assert gate.sent == [1, 2, 3, 4, 5]
    assert any("report callback" in r.getMessage() and r.exc_info is not None
               and "would wait for itself" in str(r.exc_info[1]) for r in caplog.records)


def test_send_many_over_the_stream_keeps_its_order_and_cancel(gate: Gate) -> None:
    assert gate.send_many([]) == []
    twice = _envelope(7)
    results = gate.send_many([_envelope(1, "never@example.com"), twice, _envelope(2), twice])
    assert [type(r) for r in results] == [Failed, Delivered, Delivered, Delivered]
    # The old per-batch cancel reaches the stream send_many has open.
    gate.opened.clear()
    gate.entered = threading.Semaphore(0)
    out: list[list[Result]] = []
    batch = threading.Thread(target=lambda: out.append(
        gate.send_many([_envelope(n) for n in range(10, 14)])))
    batch.start()
    assert gate.entered.acquire(timeout=10)
    assert gate.cancel_pending() == {11, 12, 13}
    gate.opened.set()
    batch.join(10)
    [first, *rest] = out[0]
    assert first == Delivered(refused={})
    assert all(isinstance(r, Failed) and isinstance(r.error, NotAttempted) for r in rest)
    assert gate.cancel_pending() == set()  # no batch open




