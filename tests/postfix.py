"""A private Postfix on loopback, for tests that need a real MTA's own bounces.

``PrivatePostfix(workdir, users=["alice"])`` runs its own Postfix instance
(``postfix -c <its config dir>``) with its own main.cf, master.cf, queue and data
directories; it never uses or changes the system's /etc/postfix/main.cf or master.cf
(only the package's own metadata there, postfix-files) and never talks to a system
instance:

- smtpd listens on 127.0.0.1 on a free port (``host``, ``port``) and accepts
  mail from 127.0.0.0/8 without authentication or TLS;
- ``outbox.test`` (``domain``) is a virtual(8) domain with Maildir mailboxes
  for ``bounces``, ``postmaster`` and the given users, delivered as ``nobody``.
  ``recipient_delimiter = +``, so ``bounces+<token>@outbox.test`` (a VERP
  envelope sender) lands in ``bounces``. Unknown users are accepted at RCPT
  time, so Postfix itself bounces them afterwards with an RFC 3464 DSN
  (``Status: 5.1.1``) to the envelope sender;
- ``defer.test`` (``defer_domain``) is routed to a loopback port where nothing
  listens (connection refused: deferred), and ``delay_warning_time = 1s``
  makes Postfix mail its delay DSN (``Action: delayed``) right after the
  first failed attempt;
- any other domain fails at once through the error(8) transport: nothing ever
  leaves the machine, and there are no DNS lookups.

Postfix logs to ``maillog`` in the instance's directory (``log_tail()``);
errors raised here include the log's tail and the queue. Expected noise there:
bounce(8) warns that the stock delay template's "hours" round 1s down to zero
(the DSN says "more than 0 hour(s)"); the DSNs are Postfix's stock ones.

The instance runs in a short directory under /tmp, not in ``workdir`` itself:
the daemons run as the ``postfix`` and ``nobody`` users, which cannot enter
pytest's ``/tmp/pytest-of-root`` (mode 0700), and Postfix's UNIX sockets need a
short path (108 bytes). ``workdir/postfix`` is a symbolic link to it while it
runs; ``stop()`` copies the log and the configuration into ``workdir`` and
removes the directory.

Postfix's master must start as root. ``require_postfix()`` skips a test when
Postfix cannot run here, and fails it under CI (``CI=true`` or
``OUTBOX_REQUIRE_POSTFIX=1``), like ``require_postgres()`` in conftest.py.
"""

from __future__ import annotations

import atexit
import contextlib
import grp
import os
import pwd
import re
import shutil
import signal
import smtplib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import pytest

SBIN = Path("/usr/sbin")
POSTFIX = SBIN / "postfix"
POSTCONF = SBIN / "postconf"
POSTQUEUE = SBIN / "postqueue"
DAEMON_DIRECTORY = Path("/usr/lib/postfix/sbin")
#: The daemons the instance's master.cf runs (all must be installed).
DAEMONS = ("master", "smtpd", "pickup", "cleanup", "qmgr", "trivial-rewrite", "bounce",
           "verify", "flush", "proxymap", "smtp", "showq", "error", "discard", "local",
           "virtual", "lmtp", "anvil", "scache", "postlogd")
#: The user virtual(8) delivers as; the Maildirs belong to it.
MAILBOX_USER = "nobody"
#: Where the instance's directory is made: every daemon user must be able to enter it.
RUNTIME_PARENT = Path("/tmp")
INSTALL_HINT = ("install Debian's postfix without a system configuration: "
                "echo 'postfix postfix/main_mailer_type select No configuration' "
                "| debconf-set-selections && apt-get install postfix (bash .ci/run does)")

REQUIRE_POSTFIX = bool(os.environ.get("OUTBOX_REQUIRE_POSTFIX")) or \
    os.environ.get("CI", "").lower() in ("1", "true", "yes")


class PostfixError(RuntimeError):
    """The private Postfix did not start, stop, or deliver in time (message has its log)."""


def postfix_unavailable() -> str | None:
    """Why a private Postfix cannot run on this machine, or None when it can."""
    missing = [str(p) for p in (POSTFIX, POSTCONF, POSTQUEUE) if not os.access(p, os.X_OK)]
    missing += [str(DAEMON_DIRECTORY / d) for d in DAEMONS
                if not os.access(DAEMON_DIRECTORY / d, os.X_OK)]
    if missing:
        return f"Postfix is not installed (missing {', '.join(missing[:3])}); {INSTALL_HINT}"
    if os.geteuid() != 0:
        return f"Postfix's master must start as root; these tests run as uid {os.geteuid()}"
    for user in ("postfix", MAILBOX_USER):
        try:
            pwd.getpwnam(user)
        except KeyError:
            return f"no {user!r} user on this machine (the postfix package creates 'postfix')"
    try:
        grp.getgrnam("postdrop")
    except KeyError:
        return "no 'postdrop' group on this machine (the postfix package creates it)"
    return None


def postfix_available() -> bool:
    """Whether a private Postfix can run here (installed, and running as root)."""
    return postfix_unavailable() is None


def require_postfix() -> None:
    """Skip (locally) or fail (CI / OUTBOX_REQUIRE_POSTFIX) when Postfix cannot run here."""
    reason = postfix_unavailable()
    if reason is None:
        return
    if REQUIRE_POSTFIX:
        pytest.fail(f"Postfix tests are required (CI / OUTBOX_REQUIRE_POSTFIX) but {reason}")
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _postfix_version() -> tuple[int, int]:
    """Postfix's major.minor, from ``postconf -d`` (which needs no main.cf of its own)."""
    with tempfile.TemporaryDirectory(prefix="outbox-postconf-") as conf:
        Path(conf, "main.cf").touch()
        Path(conf, "master.cf").touch()
        out = subprocess.run([str(POSTCONF), "-c", conf, "-d", "-h", "mail_version"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
    match = re.match(r"(\d+)\.(\d+)", out.strip())
    if not match:
        raise PostfixError(f"cannot read Postfix's version from {out!r}")
    return int(match[1]), int(match[2])


class PrivatePostfix:
    """A private Postfix instance on 127.0.0.1; a context manager (start/stop)."""

    host = "127.0.0.1"

    def __init__(self, workdir: Path, users: Iterable[str] = (), *,
                 domain: str = "outbox.test", defer_domain: str = "defer.test",
                 settings: Mapping[str, str] | None = None,
                 start_timeout: float = 30.0) -> None:
        """``users``: mailboxes besides ``bounces`` and ``postmaster``; ``settings``: main.cf
        parameters that override (or add to) the harness's own."""
        self.workdir = Path(workdir)
        self.domain = domain
        self.defer_domain = defer_domain
        self.users = list(dict.fromkeys(["bounces", "postmaster", *users]))
        for user in self.users:
            if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", user):
                raise ValueError(f"mailbox name {user!r}: lower-case letters, digits, '.', '_', '-'")
        self.settings = dict(settings or {})
        self.start_timeout = start_timeout
        self.port = 0
        self.root: Path | None = None
        self._refused: socket.socket | None = None
        self._master_pid: int | None = None

    # --- paths ---------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        if self.root is None:
            raise PostfixError("the private Postfix is not running (start() it first)")
        return self.root / name

    @property
    def config_dir(self) -> Path:
        """The instance's config_directory (main.cf, master.cf, lookup tables)."""
        return self._dir("config")

    @property
    def queue_dir(self) -> Path:
        """The instance's queue_directory."""
        return self._dir("queue")

    @property
    def maillog(self) -> Path:
        """Postfix's log file (``maillog_file``)."""
        return self._dir("maillog")

    @property
    def refused_port(self) -> int:
        """The loopback port ``defer_domain`` is routed to: bound, never listening."""
        if self._refused is None:
            raise PostfixError("the private Postfix is not running (start() it first)")
        return int(self._refused.getsockname()[1])

    def address(self, user: str) -> str:
        """``user@domain``."""
        return f"{user}@{self.domain}"

    # --- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Write the configuration, start the instance, and wait until smtpd answers
        and qmgr runs (PostfixError, with the log, when a daemon fails instead)."""
        if self.root is not None:
            raise PostfixError("the private Postfix is already running")
        reason = postfix_unavailable()
        if reason:
            raise PostfixError(reason)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="outbox-postfix-", dir=RUNTIME_PARENT))
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        root = self._dir("")
        root.chmod(0o755)  # the daemons run as postfix and nobody
        link = self.workdir / "postfix"
        if link.is_symlink():
            link.unlink()
        if not link.exists():
            link.symlink_to(root, target_is_directory=True)
        # Connecting here is refused (nothing listens) but nobody else can take the port.
        self._refused = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._refused.bind(("127.0.0.1", 0))
        for sub in ("config", "queue"):
            (root / sub).mkdir(mode=0o755)
        postfix_user = pwd.getpwnam("postfix")
        data = root / "data"
        data.mkdir(mode=0o700)
        os.chown(data, postfix_user.pw_uid, postfix_user.pw_gid)
        mailbox_user = pwd.getpwnam(MAILBOX_USER)
        mail = root / "mail"
        mail.mkdir(mode=0o700)
        os.chown(mail, mailbox_user.pw_uid, mailbox_user.pw_gid)
        self._write_tables()
        last = ""
        deadline = time.monotonic() + self.start_timeout
        for _attempt in range(3):
            # free_port() races other processes: a port taken meanwhile fails master's
            # bind, and the next attempt takes another port.
            self.port = free_port()
            self._write_main_cf()
            self._write_master_cf()
            log_offset = self._log_size()
            proc = self._postfix("start", timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode == 0:
                self._master_pid = self._read_master_pid()
                self._wait_until_ready(deadline, log_offset)
                return
            last = proc.stdout + proc.stderr
            if "Address already in use" not in last + self._log_since(log_offset):
                break
        raise PostfixError(f"postfix start failed:\n{last}\n{self._diagnostics()}")

    def stop(self) -> None:
        """Stop the instance, wait until none of its processes is left, and clean up.

        Keeps ``postfix-maillog``, ``postfix-main.cf`` and ``postfix-master.cf`` in
        ``workdir``. Safe to call twice, and when start() failed half-way.
        """
        atexit.unregister(self.stop)
        root = self.root
        if root is None:
            return
        try:
            if (root / "config" / "main.cf").exists():
                if self._master_running():
                    self._postfix("stop", timeout=30)
                self._wait_for_exit(timeout=15)
        finally:
            for name, target in (("maillog", "postfix-maillog"),
                                 ("config/main.cf", "postfix-main.cf"),
                                 ("config/master.cf", "postfix-master.cf")):
                with contextlib.suppress(OSError):
                    shutil.copyfile(root / name, self.workdir / target)
            link = self.workdir / "postfix"
            if link.is_symlink():
                link.unlink()
            if self._refused is not None:
                self._refused.close()
                self._refused = None
            shutil.rmtree(root, ignore_errors=True)
            self.root = None
            self._master_pid = None

    # --- configuration -------------------------------------------------------------------

    def _write_tables(self) -> None:
        conf = self.config_dir
        # texthash: read by the daemons at start, no postmap needed. "user/" is a Maildir.
        (conf / "vmailbox").write_text(
            "".join(f"{self.address(u)} {u}/\n" for u in self.users))
        (conf / "transport").write_text(
            f"{self.defer_domain} smtp:[127.0.0.1]:{self.refused_port}\n")

    def main_cf(self) -> dict[str, str]:
        """The instance's main.cf parameters (the harness's own, then ``settings``)."""
        root = self._dir("")
        uid = pwd.getpwnam(MAILBOX_USER).pw_uid
        gid = pwd.getpwnam(MAILBOX_USER).pw_gid
        major, minor = _postfix_version()
        params = {
            "compatibility_level": f"{major}.{minor}",
            # Its own directories: nothing under /var/spool/postfix or /var/lib/postfix.
            "queue_directory": str(root / "queue"),
            "data_directory": str(root / "data"),
            "maillog_file": str(root / "maillog"),
            "maillog_file_prefixes": str(root),
            "syslog_name": "postfix-outbox-test",
            # Loopback only, no DNS, no TLS, no aliases, no local(8) domain.
            "inet_interfaces": "127.0.0.1",
            "inet_protocols": "ipv4",
            "mynetworks": "127.0.0.0/8",
            "myhostname": f"mx.{self.domain}",
            "mydomain": self.domain,
            "myorigin": self.domain,
            "mydestination": "",
            "relayhost": "",
            "alias_maps": "",
            "alias_database": "",
            "local_recipient_maps": "",
            "disable_dns_lookups": "yes",
            "smtp_dns_support_level": "disabled",
            "lmtp_dns_support_level": "disabled",
            "smtp_host_lookup": "native",
            "smtpd_peername_lookup": "no",
            "smtpd_tls_security_level": "none",
            "smtp_tls_security_level": "none",
            "smtpd_relay_restrictions": "permit_mynetworks, reject_unauth_destination",
            # The virtual domain: Maildirs as nobody; unknown users accepted, then bounced
            # by Postfix itself (virtual(8): "unknown user", 5.1.1) with a DSN.
            "virtual_mailbox_domains": self.domain,
            "virtual_mailbox_base": str(root / "mail"),
            "virtual_mailbox_maps": f"texthash:{root / 'config' / 'vmailbox'}",
            "virtual_alias_maps": "",
            "virtual_uid_maps": f"static:{uid}",
            "virtual_gid_maps": f"static:{gid}",
            "recipient_delimiter": "+",
            "smtpd_reject_unlisted_recipient": "no",
            # defer.test: connection refused (deferred); everything else: error(8).
            "transport_maps": f"texthash:{root / 'config' / 'transport'}",
            "default_transport": "error:5.7.1 the tests' Postfix delivers nothing outside "
                                 f"{self.domain} and {self.defer_domain}",
            "smtp_connect_timeout": "2s",
            # Fast: queue runs every second, a delay DSN after the first failed attempt.
            "queue_run_delay": "1s",
            "minimal_backoff_time": "1s",
            "maximal_backoff_time": "2s",
            "delay_warning_time": "1s",
            "in_flow_delay": "0",
            "smtpd_error_sleep_time": "0",
            "biff": "no",
        }
        params.update(self.settings)
        return params

    def _write_main_cf(self) -> None:
        lines = ["# Written by tests/postfix.py: a private instance for the test suite.\n"]
        lines += [f"{key} = {value}\n" for key, value in self.main_cf().items()]
        (self.config_dir / "main.cf").write_text("".join(lines))

    def _write_master_cf(self) -> None:
        # Nothing chrooted (the instance's directories are not set up for it); no tlsmgr.
        services = [
            f"{self.host}:{self.port} inet n - n - - smtpd",
            "pickup unix n - n 60 1 pickup",
            "cleanup unix n - n - 0 cleanup",
            "qmgr unix n - n 300 1 qmgr",
            "rewrite unix - - n - - trivial-rewrite",
            "bounce unix - - n - 0 bounce",
            "defer unix - - n - 0 bounce",
            "trace unix - - n - 0 bounce",
            "verify unix - - n - 1 verify",
            "flush unix n - n 1000? 0 flush",
            "proxymap unix - - n - - proxymap",
            "proxywrite unix - - n - 1 proxymap",
            "smtp unix - - n - - smtp",
            "relay unix - - n - - smtp",
            "showq unix n - n - - showq",
            "error unix - - n - - error",
            "retry unix - - n - - error",
            "discard unix - - n - - discard",
            "local unix - n n - - local",
            "virtual unix - n n - - virtual",
            "lmtp unix - - n - - lmtp",
            "anvil unix - - n - 1 anvil",
            "scache unix - - n - 1 scache",
            "postlog unix-dgram n - n - 1 postlogd",
        ]
        (self.config_dir / "master.cf").write_text(
            "# Written by tests/postfix.py: a private instance for the test suite.\n"
            + "".join(line + "\n" for line in services))

    # --- running Postfix's commands ------------------------------------------------------

    def _postfix(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return self._run([str(POSTFIX), "-c", str(self.config_dir), command], timeout)

    def _run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAIL_")}
        env["MAIL_CONFIG"] = str(self.config_dir)
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            # Not _diagnostics(): it runs postqueue, which may be what hangs.
            raise PostfixError(f"{' '.join(argv)} took over {timeout:.0f}s\n"
                               f"--- maillog (tail) ---\n{self.log_tail()}") from exc

    def flush(self) -> None:
        """Try every queued message now (``postqueue -c <dir> -f``)."""
        proc = self._run([str(POSTQUEUE), "-c", str(self.config_dir), "-f"], timeout=30)
        if proc.returncode != 0:
            raise PostfixError(f"postqueue -f failed: {proc.stdout}{proc.stderr}\n"
                               f"{self._diagnostics()}")

    def queue(self) -> str:
        """The queue as ``postqueue -p`` lists it."""
        proc = self._run([str(POSTQUEUE), "-c", str(self.config_dir), "-p"], timeout=30)
        return (proc.stdout + proc.stderr).strip()

    # --- processes -----------------------------------------------------------------------

    def _read_master_pid(self) -> int | None:
        try:
            return int((self.queue_dir / "pid" / "master.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _master_running(self) -> bool:
        pid = self._master_pid or self._read_master_pid()
        return pid is not None and self._is_ours(pid)

    def _is_ours(self, pid: int) -> bool:
        """Whether ``pid`` is a process of this instance (every daemon works in its queue)."""
        try:
            return os.readlink(f"/proc/{pid}/cwd") == str(self.queue_dir)
        except OSError:
            return False

    def processes(self) -> list[int]:
        """The pids of this instance's processes still running (master and daemons)."""
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and self._is_ours(int(p))]

    def _wait_for_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.processes():
            if time.monotonic() > deadline:
                for pid in self.processes():  # only this instance's own processes
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
                left = self.processes()
                if left:
                    raise PostfixError(f"Postfix processes {left} did not exit")
                return
            time.sleep(0.05)

    def _daemon_names(self) -> set[str]:
        names = set()
        for pid in self.processes():
            with contextlib.suppress(OSError):
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        return names

    def _wait_until_ready(self, deadline: float, log_offset: int) -> None:
        """Until smtpd answers and qmgr has run for a moment (it reads main.cf first).

        A daemon's fatal error in the log (after ``log_offset``) fails at once.
        """
        last: Exception | None = None
        smtpd_ok = False
        qmgr_seen: float | None = None
        while time.monotonic() < deadline:
            fatal = [line for line in self._log_since(log_offset).splitlines()
                     if " fatal: " in line]
            if fatal:
                raise PostfixError(f"the private Postfix failed: {fatal[0]}\n{self._diagnostics()}")
            if not smtpd_ok:
                try:
                    with smtplib.SMTP(self.host, self.port, timeout=5) as smtp:
                        smtpd_ok = smtp.noop()[0] == 250
                except (OSError, smtplib.SMTPException) as exc:
                    last = exc
            if "qmgr" not in self._daemon_names():
                qmgr_seen = None
            elif qmgr_seen is None:
                qmgr_seen = time.monotonic()
            elif smtpd_ok and time.monotonic() - qmgr_seen >= 0.2:
                return
            time.sleep(0.05)
        what = "qmgr did not start" if smtpd_ok else \
            f"smtpd on {self.host}:{self.port} did not answer ({last!r})"
        raise PostfixError(f"{what} in {self.start_timeout:g}s\n{self._diagnostics()}")

    # --- mailboxes -----------------------------------------------------------------------

    def mailbox(self, user: str) -> list[bytes]:
        """The raw messages in ``user``'s Maildir (new and cur), oldest first."""
        if user not in self.users:
            raise KeyError(f"{user!r} has no mailbox here (mailboxes: {', '.join(self.users)})")
        base = self._dir("mail") / user
        files = [f for sub in ("new", "cur") if (base / sub).is_dir()
                 for f in (base / sub).iterdir() if f.is_file()]
        # Maildir names start with the delivery time: seconds, then a unique part.
        files.sort(key=lambda f: (f.stat().st_mtime, f.name))
        return [f.read_bytes() for f in files]

    def wait_for(self, user: str, count: int = 1, timeout: float = 30.0, *,
                 containing: bytes | None = None) -> list[bytes]:
        """``user``'s messages once there are at least ``count``; PostfixError after ``timeout``.

        ``containing``: count (and return) only the messages with these bytes in them,
        e.g. a VERP token or a Message-ID, when an instance serves several tests.
        """
        deadline = time.monotonic() + timeout
        while True:
            messages = [m for m in self.mailbox(user) if containing is None or containing in m]
            if len(messages) >= count:
                return messages
            if time.monotonic() > deadline:
                what = "" if containing is None else f" containing {containing!r}"
                raise PostfixError(f"{self.address(user)} has {len(messages)} message(s){what}, "
                                   f"not {count}, after {timeout:g}s\n{self._diagnostics()}")
            time.sleep(0.05)

    # --- diagnostics ---------------------------------------------------------------------

    def _log_size(self) -> int:
        try:
            return self.maillog.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> str:
        try:
            with self.maillog.open("rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of Postfix's log."""
        try:
            text = self.maillog.read_text(errors="replace")
        except (OSError, PostfixError):
            return ""
        return "".join(text.splitlines(keepends=True)[-lines:])

    def _diagnostics(self) -> str:
        queue = ""
        if self.root is not None and self._master_running():
            with contextlib.suppress(PostfixError):
                queue = self.queue()
        return (f"--- queue (postqueue -p) ---\n{queue or '(not available)'}\n"
                f"--- {self.root}/maillog (tail) ---\n{self.log_tail() or '(empty)'}")
