"""A private Redis server for the executor tests (Debian's ``redis-server``), as PostgreSQL is.

:class:`RedisServer` runs ``redis-server`` on a free loopback port with its own
directory and no persistence; :meth:`RedisServer.restart` stops it and starts it
again on the same port (a broker restart, with its queued tasks lost: the
outbox's sweep publishes them again). CI installs the package (``.ci/run``);
elsewhere ``apt-get install redis-server``. Without it, the tests that need it
fail in CI and skip elsewhere, saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_redis() -> str:
    """The path of ``redis-server``; fails in CI, skips elsewhere when it is missing."""
    path = shutil.which("redis-server") or ("/usr/bin/redis-server"
                                            if os.path.exists("/usr/bin/redis-server") else None)
    if path is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class RedisServer:
    """One private ``redis-server`` (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.binary = require_redis()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        with open(self.directory / "redis.log", "ab") as log:  # the child has its own copy
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory), "--protected-mode", "no"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see "
                                   f"{self.directory / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout} s")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def kill(self) -> None:
        """SIGKILL: the broker dies with what it held."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def restart(self, down_for: float = 0.0) -> None:
        """Stop (SIGKILL), stay down ``down_for`` seconds, start again on the same port."""
        self.kill()
        time.sleep(down_for)
        self.start()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A private Redis for one test (started, stopped after it)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()
