"""A private Exim on loopback, and a loopback SMTP server that refuses by local part.

``PrivateExim(workdir, remote_port)`` runs Exim 4 (``exim4 -bdf``, a daemon in the
foreground) with its own configuration, spool and log under ``workdir``, listening on
127.0.0.1 on a free port (``host``, ``port``). It relays from 127.0.0.1:

- ``remote.test`` to the loopback port ``remote_port`` (a :class:`RefusingServer`);
- ``outbox.test`` (with ``+`` suffixes: VERP senders) to the Maildir ``bounces`` under
  ``workdir``: where Exim's bounces arrive;
- anything else fails at once ("Unrouteable address"): nothing leaves the machine.

Debian's ``exim4-daemon-light`` conflicts with the ``postfix`` package the other bounce
tests need, so Exim is not installed: its Debian packages are unpacked with ``dpkg -x``
into ``OUTBOX_EXIM_ROOT`` (default ``/opt/outbox-exim``; .ci/run does it). Exim runs there
as root in a private mount namespace (``unshare --mount``) whose ``/etc/passwd`` names the
``Debian-exim`` user it was built for and whose ``/usr/sbin`` is the package's (Exim runs
``/usr/sbin/exim4`` again for each delivery). The system's files are never changed.

``require_exim()`` skips a test when Exim cannot run here, and fails it under CI
(``CI=true`` or ``OUTBOX_REQUIRE_EXIM=1``), as ``require_postfix()`` does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest
from aiosmtpd.controller import Controller
from conftest import db, wait_rows
from flask import Flask
from postfix import free_port

from flask_mail_outbox import Message, OutboxMail

EXIM_ROOT = Path(os.environ.get("OUTBOX_EXIM_ROOT", "/opt/outbox-exim"))
EXIM_BINARY = EXIM_ROOT / "usr" / "sbin" / "exim4"
REQUIRE_EXIM = (os.environ.get("CI", "").lower() == "true"
                or os.environ.get("OUTBOX_REQUIRE_EXIM") == "1")
INSTALL_HINT = ("unpack Debian's exim4-daemon-light, exim4-base and libidn12 with "
                f"'apt-get download' and 'dpkg -x' into {EXIM_ROOT} (see .ci/run)")
#: The uid and gid the private /etc/passwd gives Debian-exim (not the system's: no user
#: is added to this machine).
EXIM_UID = 2100


def exim_unavailable() -> str | None:
    """Why a private Exim cannot run on this machine, or None when it can."""
    if not EXIM_BINARY.is_file():
        return f"Exim is not unpacked (no {EXIM_BINARY}); {INSTALL_HINT}"
    if EXIM_BINARY.stat().st_mode & stat.S_ISUID:
        # Set-uid, Exim's deliveries (as Debian-exim) would not find libidn in EXIM_ROOT.
        return f"{EXIM_BINARY} is still set-uid; chmod u-s it (see .ci/run)"
    if os.geteuid() != 0:
        return f"a private Exim runs as root in a mount namespace; this is uid {os.geteuid()}"
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine (util-linux)"
    return None


def require_exim() -> None:
    """Skip (locally) or fail (CI / OUTBOX_REQUIRE_EXIM) when Exim cannot run here."""
    reason = exim_unavailable()
    if reason is None:
        return
    if REQUIRE_EXIM:
        pytest.fail(f"Exim tests are required (CI / OUTBOX_REQUIRE_EXIM) but {reason}")
    pytest.skip(reason)


#: The loopback server's refusal of each local part.
REPLIES = {
    "nobody": "550 5.1.1 <{}>: Recipient address rejected: User unknown in virtual "
              "mailbox table",
    "full": "552 5.2.2 <{}>: Recipient address rejected: Mailbox full, quota exceeded",
    "relay": "554 5.7.1 <{}>: Relay access denied",
    "slow": "451 4.3.0 <{}>: Temporary lookup failure",
}


class _Refusing:
    """aiosmtpd handler: refuses recipients by local part (:data:`REPLIES`), takes the rest."""

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str,
                          options: Any) -> str:
        reply = REPLIES.get(address.split("@")[0])
        if reply is not None:
            return reply.format(address)
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        return "250 2.0.0 Ok: queued"


class RefusingServer:
    """A loopback SMTP server (aiosmtpd) refusing ``nobody``, ``full``, ``relay``, ``slow``."""

    def __init__(self) -> None:
        self.port = free_port()
        self._controller = Controller(_Refusing(), hostname="127.0.0.1", port=self.port)

    def __enter__(self) -> Self:
        self._controller.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._controller.stop()


_CONFIG = """\
primary_hostname = mx.exim.test
qualify_domain = outbox.test
domainlist local_domains = outbox.test
spool_directory = {root}/spool
log_file_path = {root}/log/%slog
exim_user = Debian-exim
exim_group = Debian-exim
never_users =
keep_environment = LD_LIBRARY_PATH
daemon_smtp_ports = {port}
local_interfaces = <; 127.0.0.1
host_lookup =
tls_advertise_hosts =
rfc1413_hosts =
acl_smtp_rcpt = acl_rcpt

begin acl

acl_rcpt:
  accept hosts = 127.0.0.1
  deny

begin routers

bounces:
  driver = accept
  domains = +local_domains
  local_parts = bounces
  local_part_suffix = +*
  local_part_suffix_optional
  transport = maildir

remote:
  driver = manualroute
  domains = remote.test
  route_list = * 127.0.0.1 byname
  self = send
  transport = remote_smtp

begin transports

maildir:
  driver = appendfile
  directory = {root}/bounces
  maildir_format
  create_directory
  envelope_to_add
  return_path_add
  user = Debian-exim

remote_smtp:
  driver = smtp
  port = {remote_port}
  hosts_avoid_tls = *
  allow_localhost

begin retry
*   *   F,1m,10s
"""


class PrivateExim:
    """A private Exim daemon on 127.0.0.1; a context manager (start/stop)."""

    host = "127.0.0.1"

    def __init__(self, workdir: Path, remote_port: int) -> None:
        # Exim runs deliveries as Debian-exim, which cannot enter pytest's 0700 directory:
        # its files live in a directory of its own under /tmp, linked from ``workdir``.
        self.root = Path(tempfile.mkdtemp(prefix="outbox-exim-"))
        self.root.chmod(0o755)
        (Path(workdir) / "exim").symlink_to(self.root)
        self.remote_port = remote_port
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        for name in ("spool", "log", "bounces", "etc"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        for name in ("spool", "log", "bounces"):
            os.chown(self.root / name, EXIM_UID, EXIM_UID)
        (self.root / "exim.conf").write_text(_CONFIG.format(
            root=self.root, port=self.port, remote_port=self.remote_port))
        passwd = Path("/etc/passwd").read_text() + (
            f"Debian-exim:x:{EXIM_UID}:{EXIM_UID}:Exim:/nonexistent:/usr/sbin/nologin\n")
        group = Path("/etc/group").read_text() + f"Debian-exim:x:{EXIM_UID}:\n"
        (self.root / "etc" / "passwd").write_text(passwd)
        (self.root / "etc" / "group").write_text(group)
        script = (
            f"mount --bind {self.root}/etc/passwd /etc/passwd && "
            f"mount --bind {self.root}/etc/group /etc/group && "
            f"mount --bind {EXIM_ROOT}/usr/sbin /usr/sbin && "
            f"exec /usr/sbin/exim4 -C {self.root}/exim.conf -bdf -q2s")
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
               "LD_LIBRARY_PATH": f"{EXIM_ROOT}/usr/lib/x86_64-linux-gnu"}
        self._process = subprocess.Popen(["unshare", "--mount", "sh", "-c", script], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"exim exited ({self._process.returncode}): "
                                   f"{self._diagnostics()}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"exim did not listen on {self.port}: {self._diagnostics()}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the session it was started in: its own
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        if process is not None and process.stderr is not None:
            process.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _diagnostics(self) -> str:
        stderr = b""
        if self._process is not None and self._process.poll() is not None \
                and self._process.stderr is not None:
            stderr = self._process.stderr.read()
        log = self.root / "log" / "mainlog"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        panic = self.root / "log" / "paniclog"
        tail += panic.read_text(errors="replace")[-1000:] if panic.exists() else ""
        return f"{stderr.decode(errors='replace')[-1000:]}\n{tail}"

    def bounces(self) -> list[bytes]:
        """The messages in the ``bounces`` Maildir, oldest first."""
        files = [f for sub in ("new", "cur") if (self.root / "bounces" / sub).is_dir()
                 for f in (self.root / "bounces" / sub).iterdir() if f.is_file()]
        files.sort(key=lambda f: (f.stat().st_mtime, f.name))
        return [f.read_bytes() for f in files]

    def wait_for(self, containing: bytes, timeout: float = 15.0) -> bytes:
        """The one bounce containing ``containing``; RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in self.bounces() if containing in m]
            if len(found) == 1:
                return found[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(found)} bounces containing {containing!r} after "
                                   f"{timeout:g}s\n{self._diagnostics()}")
            time.sleep(0.05)


# -- the app's side, shared by the live-MTA tests ----------------------------------------


def mail_of(app: Flask) -> OutboxMail:
    mail: OutboxMail = app.extensions["test_mail"]
    return mail


def send(app: Flask, to: str, subject: str = "Hello") -> int:
    with app.app_context():
        email_id = mail_of(app).send(Message(subject, [to], "Hi"))
        db.session.commit()
    return email_id


def sent(app: Flask, email_id: int) -> dict[str, Any]:
    """Row ``email_id`` once the worker has finished with it."""
    found = wait_rows(app, lambda rs: any(r["id"] == email_id and r["status"] not in
                                          ("queued", "sending") for r in rs), timeout=15)
    return next(r for r in found if r["id"] == email_id)


def feed(app: Flask, raw: bytes) -> Any:
    """``flask outbox bounce`` with ``raw`` on standard input."""
    return app.test_cli_runner().invoke(args=["outbox", "bounce"], input=raw)
