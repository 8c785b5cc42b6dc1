"""A real HTTP server on 127.0.0.1 for the provider API tests, scripted to fail.

:class:`FakeAPI` is the part every provider's fake shares: a threading HTTP/1.1
server in a thread of its own, keep-alive on, that records every request and
answers through :meth:`FakeAPI.handle`, which a provider's fake overrides with
its documented endpoints, auth and reply shapes. Tests script faults in front
of that: the next requests answer a given status and body (with headers such
as ``Retry-After``), answer late, answer a body that is not JSON, or close the
connection in the middle of the response; and a latency for every request.
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

    def _reply(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            self._lock.notify_all()
            scripted = self._scripted.pop(0) if self._scripted else None
        return scripted if scripted is not None else self.handle(request)

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
