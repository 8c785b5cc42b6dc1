"""``python -m benchmarks.api_sink --port P --delay S``: every provider API's success, late.

A threading HTTP/1.1 server (keep-alive) that answers each provider's send
endpoint with its documented success body after ``--delay`` seconds, so a
benchmark measures what bounds delivery through an API: requests in flight
over the provider's latency. It checks nothing and keeps nothing but counts
(``GET /count``: requests and messages so far).
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ids = itertools.count(1)
_lock = threading.Lock()
_counts = {"requests": 0, "messages": 0}


def _reply(path: str, body: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of a success for ``path``; the messages it carried."""
    def new_id() -> str:
        return f"{next(_ids):012x}-sink"

    if path == "/email/batch":  # Postmark
        items = json.loads(body)
        return 200, {}, [{"ErrorCode": 0, "Message": "OK", "MessageID": new_id(),
                          "To": item.get("To", ""), "SubmittedAt": "2026-12-05T00:00:00Z"}
                         for item in items]
    if path == "/email":
        return 200, {}, {"ErrorCode": 0, "Message": "OK", "MessageID": new_id(),
                         "To": "", "SubmittedAt": "2026-12-05T00:00:00Z"}
    if path == "/v3/mail/send":  # SendGrid: 202, the id in a header
        return 202, {"X-Message-Id": new_id()}, None
    if path.endswith("/messages.mime"):  # Mailgun
        return 200, {}, {"id": f"<{new_id()}@sink>", "message": "Queued. Thank you."}
    if path == "/emails/batch":  # Resend
        return 200, {}, {"data": [{"id": new_id()} for _ in json.loads(body)]}
    if path == "/emails":
        return 200, {}, {"id": new_id()}
    if path == "/v2/email/outbound-emails":  # SES v2
        return 200, {}, {"MessageId": new_id()}
    return 404, {}, {"message": f"no such endpoint {path}"}


def _messages(path: str, body: bytes) -> int:
    if path in ("/email/batch", "/emails/batch"):
        return len(json.loads(body))
    return 1


def serve(port: int, delay: float) -> None:
    """Serve until killed."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go in two writes: without this, Nagle holds the body
        # back until the client acknowledges the headers (a delayed ACK, ~40 ms).
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            time.sleep(delay)
            status, headers, payload = _reply(path, body)
            if status < 300:
                with _lock:
                    _counts["requests"] += 1
                    _counts["messages"] += _messages(path, body)
            self._answer(status, headers, payload)

        def do_GET(self) -> None:
            with _lock:
                counts = dict(_counts)
            self._answer(200, {}, counts)

        def _answer(self, status: int, headers: dict[str, str], payload: Any) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if payload is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    print(f"api sink on 127.0.0.1:{port}, answering after {delay:g} s", flush=True)
    server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.api_sink")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    serve(args.port, args.delay)


if __name__ == "__main__":
    main()
