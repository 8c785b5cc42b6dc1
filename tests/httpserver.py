"""A real HTTP server on 127.0.0.1 for the provider API tests, scripted to fail.

:class:`FakeAPI` is the part every provider's fake shares: a threading HTTP/1.1
server in a thread of its own, keep-alive on, that records every request and
answers through :meth:`FakeAPI.handle`, which a provider's fake overrides with
its documented endpoints, auth and reply shapes. Tests script faults in front
of that: the next requests answer a given status and body (with headers such
as ``Retry-After``), answer late, answer a body that is not JSON, or close the
connection in the middle of the response; and a latency for every request.
:meth:`FakeAPI.answer_ambiguously` lets the provider handle a request as usual
(it accepts what it accepts) and then loses its answer: the client cannot know
whether the message went. :meth:`FakeAPI.echo_credentials` answers an error
that repeats the request's headers (its API key) back.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        """A header's value (any case), or None."""
        wanted = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == wanted), None)


@dataclasses.dataclass(frozen=True)
class Reply:
    """What to answer: a status, a body (bytes, or JSON-able), headers."""

    status: int
    body: Any = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Seconds to wait before answering.
    delay: float = 0.0
    #: Send the status line and headers, then close the connection mid-body.
    cut: bool = False

    def encoded(self) -> tuple[bytes, dict[str, str]]:
        """The body's bytes and the headers to send with it."""
        if isinstance(self.body, bytes):
            return self.body, dict(self.headers)
        return json.dumps(self.body).encode(), {"Content-Type": "application/json",
                                                **self.headers}


class FakeAPI:
    """A provider API on a loopback port (see the module docstring)."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.latency = 0.0
        self._scripted: list[Reply] = []
        self._ambiguous: list[tuple[str, float, int | None]] = []
        self._echo: int | None = None
        self._lock = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go in two writes: without this, Nagle holds the body
            # back until the client acknowledges the headers (a delayed ACK, ~40 ms).
            disable_nagle_algorithm = True

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                request = Request(self.command, self.path, dict(self.headers.items()), body,
                                  time.monotonic())
                reply = fake._reply(request)
                if reply.delay or fake.latency:
                    time.sleep(reply.delay + fake.latency)
                data, headers = reply.encoded()
                self.send_response(reply.status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if reply.cut:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="fake-api")

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeAPI:
        """Serve in a thread of its own."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the ``base_url`` to configure."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- scripting ------------------------------------------------------------------------

    def script(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order, before :meth:`handle` answers."""
        with self._lock:
            self._scripted.extend(replies)

    def answer_ambiguously(self, shape: str, *, times: int | None = None,
                           delay: float = 1.5) -> None:
        """Handle the next ``times`` requests (None: every one) as the provider does, then
        lose the answer: ``"garbled"`` a 200 whose body is not the provider's (a proxy's
        page), ``"late"`` the answer after ``delay`` s (past the client's timeout),
        ``"cut"`` the answer's connection closed mid-body. What the provider accepted
        stays accepted."""
        if shape not in ("garbled", "late", "cut"):
            raise ValueError(f"shape must be garbled, late or cut, got {shape!r}")
        with self._lock:
            self._ambiguous = [(shape, delay, times)]

    def echo_credentials(self, status: int = 401) -> None:
        """Answer every request ``status`` with a body repeating its headers (the API key)."""
        with self._lock:
            self._echo = status

    def _lose(self, reply: Reply) -> Reply:
        with self._lock:
            if not self._ambiguous:
                return reply
            shape, delay, times = self._ambiguous[0]
            if times is not None:
                self._ambiguous = [(shape, delay, times - 1)] if times > 1 else []
        if shape == "garbled":
            return Reply(200, b"<html><body>502 upstream says hi</body></html>",
                         {"Content-Type": "text/html"})
        if shape == "late":
            return dataclasses.replace(reply, delay=delay)
        return dataclasses.replace(reply, cut=True, body=reply.body or b"x" * 64)

    def _reply(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            self._lock.notify_all()
            scripted = self._scripted.pop(0) if self._scripted else None
            echo = self._echo
        if scripted is not None:
            return scripted
        if echo is not None:
            said = "; ".join(f"{k}: {v}" for k, v in request.headers.items())
            return Reply(echo, {"message": f"refused the request with {said}",
                                "Message": f"refused the request with {said}",
                                "errors": [{"message": f"refused: {said}"}]})
        return self._lose(self.handle(request))

    def handle(self, request: Request) -> Reply:
        """The provider's answer to ``request``; a subclass implements its API."""
        return Reply(404, {"message": "no such endpoint"})

    def wait_for(self, count: int, timeout: float = 10.0,
                 where: Callable[[Request], bool] = lambda r: True) -> bool:
        """Wait until ``count`` requests matching ``where`` arrived; True when they did."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while sum(1 for r in self.requests if where(r)) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
            return True
