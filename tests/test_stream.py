"""The streaming interface: ``Transport.open(report)`` and its :class:`Sending`.

Messages go in with ``put()``; each result comes back through ``report`` as
soon as it is known. The base class's stream is tested over custom
transports that only implement ``send()``; the SMTP transport's over the
real aiosmtpd server of :mod:`smtpserver`, proved by the order of events
(what the server had received when each report arrived), not by timing.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from unittest.mock import ANY

import pytest
from conftest import free_port, poll
from smtpserver import FaultSMTPServer

from flask_mail_outbox import PermanentError, TransientError
from flask_mail_outbox.transports import (
    Delivered,
    Envelope,
    Failed,
    NotAttempted,
    Result,
    Sending,
    SMTPSettings,
    SMTPTransport,
    Transport,
)
from flask_mail_outbox.transports._smtp import _SMTPSending

SENDER = "sender@example.com"
#: A message the server took (its queue id, whatever it is, is the provider's id).
ACCEPTED = Delivered(refused={}, provider_message_id=ANY)


def _settings(port: int = 25, *, timeout: float = 5.0) -> SMTPSettings:
    return SMTPSettings(port=port, timeout=timeout)


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


def _ended(before: set[threading.Thread], *names: str) -> bool:
    """Whether the threads named ``names`` started since ``before`` all end (soon)."""
    for thread in set(threading.enumerate()) - before:
        if thread.name in names:
            thread.join(5)
            if thread.is_alive():
                return False
    return True


# -- the base class's stream, over a transport that only implements send() ----------------


class Gate(Transport):
    """Records each send() in order; waits for ``opened`` before each while it is clear."""

    def __init__(self) -> None:
        super().__init__()
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
    before = set(threading.enumerate())
    reports = Reports()
    sending = gate.open(reports)
    for n in range(1, 21):
        sending.put(_envelope(n))
    assert sending.close(10)
    assert gate.sent == list(range(1, 21))
    assert reports.ids == list(range(1, 21))
    assert reports.results == [(n, ACCEPTED) for n in range(1, 21)]
    assert gate.threads == reports.threads == {"outbox-send"}
    # Closed and drained: its thread ends.
    assert _ended(before, "outbox-send")


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
    assert results[4] == Delivered(refused={"refused@example.com": (550, "no")},
                                   provider_message_id=ANY)
    assert results[5] == ACCEPTED


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
    assert reports.of(1) == [ACCEPTED]
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


def test_send_many_over_the_stream_keeps_its_order(gate: Gate) -> None:
    assert gate.send_many([]) == []
    twice = _envelope(7)
    results = gate.send_many([_envelope(1, "never@example.com"), twice, _envelope(2), twice])
    assert [type(r) for r in results] == [Failed, Delivered, Delivered, Delivered]


# -- the SMTP transport's stream, against the real server ----------------------------------


def _smtp(server: FaultSMTPServer, *, concurrency: int = 2,
          timeout: float = 5.0) -> SMTPTransport:
    return SMTPTransport(_settings(server.port, timeout=timeout), concurrency=concurrency)


@pytest.fixture(params=[True, False], ids=["pipelined", "lock-step"])
def server(request: pytest.FixtureRequest) -> Iterator[FaultSMTPServer]:
    with FaultSMTPServer(pipelining=request.param) as started:
        yield started


@pytest.fixture
def transports() -> Iterator[list[SMTPTransport]]:
    """SMTP transports made by a test, closed at its end whatever happened."""
    made: list[SMTPTransport] = []
    yield made
    for transport in made:
        transport.close()


def _copies(server: FaultSMTPServer) -> collections.Counter[str]:
    return collections.Counter(server.message_ids())


def test_each_result_is_reported_when_its_reply_arrives(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport]) -> None:
    # 0.3 s per message on two connections: six messages take three rounds.
    smtp_server.delay("data", 0.3)
    transports.append(transport := _smtp(smtp_server, concurrency=2))
    accepted_at_report: list[int] = []
    pending_at_report: list[int] = []
    sending: Sending

    def report(envelope: Envelope, result: Result) -> None:
        assert result == ACCEPTED
        accepted_at_report.append(len(smtp_server.messages))
        pending_at_report.append(sending.pending())

    sending = transport.open(report)
    for n in range(1, 7):
        sending.put(_envelope(n))
    assert sending.close(30)
    # The first result was reported while the server had not accepted the
    # others yet: one by one, not all at the end.
    assert accepted_at_report[0] < 6 and pending_at_report[0] == 6
    assert accepted_at_report == sorted(accepted_at_report)
    assert pending_at_report == [6, 5, 4, 3, 2, 1]
    assert sorted(_copies(smtp_server).values()) == [1] * 6


def test_a_stream_fed_from_its_reports_keeps_its_connections(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport],
        monkeypatch: pytest.MonkeyPatch) -> None:
    workers: list[object] = []
    work = _SMTPSending._work

    async def counted(self: _SMTPSending) -> None:
        workers.append(self)
        await work(self)

    monkeypatch.setattr(_SMTPSending, "_work", counted)
    smtp_server.delay("data", 0.02)
    transports.append(transport := _smtp(smtp_server, concurrency=2))
    total = 20
    put = [2]
    done = threading.Event()
    reports = Reports()
    sending: Sending

    def report(envelope: Envelope, result: Result) -> None:
        reports(envelope, result)
        if put[0] < total:
            put[0] += 1
            sending.put(_envelope(put[0]))
        elif len(reports.results) == total:
            done.set()

    sending = transport.open(report)
    sending.put(_envelope(1))
    sending.put(_envelope(2))
    assert done.wait(30)
    assert sending.close(10)
    assert sorted(reports.ids) == list(range(1, total + 1))
    # Fed one message per result, each connection's worker waited for the
    # next one instead of ending: two workers and two connections, for twenty.
    assert len(workers) == 2
    assert smtp_server.connections == 2
    assert smtp_server.max_concurrent_connections == 2
    assert sorted(_copies(smtp_server).values()) == [1] * total
    # Reports come from the stream's own thread, never from the putting one.
    assert reports.threads == {"outbox-report"}


def test_pending_close_and_its_timeout_while_the_server_holds_replies(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport]) -> None:
    transports.append(transport := _smtp(smtp_server, concurrency=2))
    before = set(threading.enumerate())
    reports = Reports()
    smtp_server.hold()
    sending = transport.open(reports)
    for n in (1, 2, 3):
        sending.put(_envelope(n))
    assert sending.pending() == 3
    assert smtp_server.wait_held(2)
    assert sending.close(timeout=0.3) is False
    assert sending.pending() == 3 and reports.results == []
    with pytest.raises(RuntimeError, match="closed"):
        sending.put(_envelope(4))
    smtp_server.release()
    assert sending.close(20) is True
    assert sending.pending() == 0
    assert sorted(reports.ids) == [1, 2, 3]
    assert all(r == ACCEPTED for _, r in reports.results)
    # Closed and drained: the reporter thread ends, the connections stay pooled.
    assert _ended(before, "outbox-report")
    assert smtp_server.active_connections == 2


def test_cancel_pending_answers_exactly_what_never_started(
        server: FaultSMTPServer, transports: list[SMTPTransport]) -> None:
    transports.append(transport := _smtp(server, concurrency=2))
    reports = Reports()
    server.hold()
    sending = transport.open(reports)
    for n in range(1, 7):
        sending.put(_envelope(n))
    # One message on each connection waits for its reply. Which two depends on
    # which connection opened first; on a pipelining server the next envelope
    # went ahead with a content, and is not started either.
    assert server.wait_held(2)
    never = sending.cancel_pending()
    assert len(never) == 4 and never < set(range(1, 7))
    assert reports.wait(4)
    for n in never:
        [result] = reports.of(n)
        assert isinstance(result, Failed) and isinstance(result.error, NotAttempted)
    with pytest.raises(RuntimeError):
        sending.put(_envelope(7))
    server.release()
    assert sending.close(20)
    assert sorted(reports.ids) == [1, 2, 3, 4, 5, 6]  # each exactly once
    started = set(range(1, 7)) - never
    assert all(reports.of(n) == [ACCEPTED] for n in started)
    # Exactly what was not cancelled reaches the server, once; nothing else.
    assert not server.wait_for(3, timeout=0.5)
    assert _copies(server) == {f"<m{n}@example.com>": 1 for n in started}


def test_a_raising_report_does_not_stop_smtp_sends(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport],
        caplog: pytest.LogCaptureFixture) -> None:
    transports.append(transport := _smtp(smtp_server, concurrency=1))
    seen: list[int] = []

    def report(envelope: Envelope, result: Result) -> None:
        seen.append(envelope.email_id)
        raise RuntimeError("a bug in the caller")

    sending = transport.open(report)
    for n in (1, 2, 3):
        sending.put(_envelope(n))
    assert sending.close(20)
    assert seen == [1, 2, 3]
    assert len(_copies(smtp_server)) == 3
    assert len([r for r in caplog.records if "report callback" in r.getMessage()
                and r.levelno == logging.ERROR and r.exc_info is not None]) == 3


def _fails(kind: type[Exception], code: int | None = None) -> Callable[[Result], bool]:
    return lambda r: (isinstance(r, Failed) and type(r.error) is kind
                      and (code is None or r.error.code == code))


@pytest.mark.parametrize(("script", "recipients", "expected"), [
    pytest.param(lambda s: s.reply("data", 451, times=1), (), _fails(TransientError, 451),
                 id="451 at DATA"),
    pytest.param(lambda s: s.reply("mail", 553, times=1), (), _fails(PermanentError, 553),
                 id="553 at MAIL"),
    pytest.param(lambda s: s.reply("data", 554, times=1), (), _fails(PermanentError, 554),
                 id="554 at DATA"),
    pytest.param(lambda s: s.reply("rcpt", 452, times=1), (), _fails(TransientError, 452),
                 id="452 at RCPT"),
    pytest.param(lambda s: s.drop_mid_data(after_bytes=16, times=1), (),
                 _fails(TransientError), id="dropped mid-DATA"),
    pytest.param(lambda s: s.refuse_recipient("bad@example.com", 550),
                 ("bad@example.com", "good@example.com"),
                 lambda r: isinstance(r, Delivered) and list(r.refused) == ["bad@example.com"]
                 and r.refused["bad@example.com"][0] == 550, id="one recipient refused"),
    pytest.param(lambda s: s.refuse_recipient("bad@example.com", 550), ("bad@example.com",),
                 _fails(PermanentError, 550), id="every recipient refused"),
])
def test_each_server_fault_maps_to_its_result_through_the_stream(
        server: FaultSMTPServer, transports: list[SMTPTransport],
        script: Callable[[FaultSMTPServer], None], recipients: tuple[str, ...],
        expected: Callable[[Result], bool]) -> None:
    transports.append(transport := _smtp(server, concurrency=1))
    script(server)
    reports = Reports()
    sending = transport.open(reports)
    sending.put(_envelope(1, *recipients))
    sending.put(_envelope(2))
    assert sending.close(20)
    [first] = reports.of(1)
    assert expected(first), first
    # The next message is not hurt by the fault of the one before.
    assert reports.of(2) == [ACCEPTED]
    assert _copies(server)["<m2@example.com>"] == 1
    assert _copies(server)["<m1@example.com>"] == (1 if isinstance(first, Delivered) else 0)


def test_nobody_can_reach_the_server_fails_what_is_queued_then_tries_again(
        transports: list[SMTPTransport]) -> None:
    port = free_port()
    transports.append(transport := SMTPTransport(_settings(port), concurrency=2))
    reports = Reports()
    sending = transport.open(reports)
    for n in (1, 2, 3):
        sending.put(_envelope(n))
    assert reports.wait(3)
    assert sorted(reports.ids) == [1, 2, 3]
    assert all(isinstance(r, Failed) and isinstance(r.error, TransientError)
               for _, r in reports.results)
    # The stream is still open: once the server is up, the next put connects.
    with FaultSMTPServer(port=port) as late:
        sending.put(_envelope(4))
        assert reports.wait(4)
        assert reports.of(4) == [ACCEPTED]
        assert late.message_ids() == ["<m4@example.com>"]
        assert sending.close(10)


def test_a_refused_extra_connection_leaves_the_work_to_the_open_one(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport]) -> None:
    transports.append(transport := _smtp(smtp_server, concurrency=2))
    reports = Reports()
    smtp_server.hold()
    sending = transport.open(reports)
    sending.put(_envelope(1))
    assert smtp_server.wait_held(1)
    # From now on the server refuses more connections (as one limiting
    # connections per client does).
    smtp_server.reply("connect", 421)
    sending.put(_envelope(2))
    assert smtp_server.wait_until(lambda: smtp_server.connections == 2)
    sending.put(_envelope(3))
    # Deliberate window: no connect per message while the refusal is fresh.
    assert not smtp_server.wait_until(lambda: smtp_server.connections > 2, timeout=0.3)
    smtp_server.release()
    assert sending.close(20)
    # Queued behind the open connection, not failed: it sends all three.
    assert sorted(reports.ids) == [1, 2, 3]
    assert all(r == ACCEPTED for _, r in reports.results)
    assert sorted(_copies(smtp_server).values()) == [1, 1, 1]


def test_an_idle_worker_parks_its_connection_and_a_later_put_reuses_it(
        smtp_server: FaultSMTPServer, transports: list[SMTPTransport]) -> None:
    transports.append(transport := _smtp(smtp_server, concurrency=2))
    transport.idle_seconds = 0.2
    reports = Reports()
    sending = transport.open(reports)
    sending.put(_envelope(1))
    assert reports.wait(1)
    # Idle, the stream keeps the one connection it used open, and parks it.
    assert poll(lambda: len(transport._idle), lambda idle: idle == 1, timeout=5) == 1
    assert smtp_server.active_connections == 1
    sending.put(_envelope(2))
    assert reports.wait(2)
    assert sending.close(10)
    assert reports.of(2) == [ACCEPTED]
    assert smtp_server.connections == 1


def test_closing_the_transport_stops_its_open_streams(
        smtp_server: FaultSMTPServer) -> None:
    before = set(threading.enumerate())
    transport = _smtp(smtp_server, concurrency=1, timeout=1)
    reports = Reports()
    smtp_server.hold()
    sending = transport.open(reports)
    for n in (1, 2, 3):
        sending.put(_envelope(n))
    assert smtp_server.wait_held(1)
    transport.close()
    # What had not started is given up; the one in flight ended (its reply
    # timed out after MAIL_TIMEOUT) before close() returned.
    assert sending.close(5)
    assert isinstance(reports.of(1)[0], Failed)
    for n in (2, 3):
        [result] = reports.of(n)
        assert isinstance(result, Failed) and isinstance(result.error, NotAttempted)
    with pytest.raises(RuntimeError):
        sending.put(_envelope(4))
    smtp_server.release()
    assert _ended(before, "outbox-smtp", "outbox-report")
