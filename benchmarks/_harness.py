"""What the scenarios share: PostgreSQL, SMTP sinks, subprocesses, statistics, output.

Everything a scenario starts goes through a :class:`Context`, which stops it
again at the end of the run (also on Ctrl-C or an error): PostgreSQL clusters,
sinks and worker processes are all separate processes, so the process that
measures never shares a GIL with the one measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PG_CLUSTER = REPO / "scripts" / "pg-cluster"
POSTFIX_SINK = Path("/usr/sbin/smtp-sink")


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- statistics ------------------------------------------------------------------------

def median(values: Iterable[float | None]) -> float | None:
    present = [float(v) for v in values if v is not None and not math.isnan(v)]
    return float(statistics.median(present)) if present else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear interpolation between closest ranks."""
    data = sorted(values)
    if not data:
        return None
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- output ------------------------------------------------------------------------------

@dataclasses.dataclass
class Table:
    """One printed table: column titles and rows of already-formatted or raw values."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = dataclasses.field(default_factory=list)

    def add(self, *values: Any) -> None:
        self.rows.append(list(values))

    def render(self) -> str:
        cells = [[fmt(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells if i < len(r)])
                  for i, c in enumerate(self.columns)]

        def line(values: list[str], numeric: list[bool]) -> str:
            out = []
            for i, value in enumerate(values):
                out.append(value.rjust(widths[i]) if numeric[i] else value.ljust(widths[i]))
            return "  ".join(out).rstrip()

        numeric_cols = [all(_looks_numeric(r[i]) for r in cells if i < len(r) and r[i] != "-")
                        and i > 0 for i in range(len(self.columns))]
        parts = [self.title, line(self.columns, numeric_cols),
                 line(["-" * w for w in widths], [False] * len(widths))]
        parts += [line(row, numeric_cols) for row in cells]
        return "\n".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns,
                "rows": [[_jsonable(v) for v in row] for row in self.rows]}


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d.,]+(e[-+]?\d+)?[x%s]?( ?ms)?", text))


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


@dataclasses.dataclass
class Report:
    """What a scenario returns: tables to print, notes, and the raw data for the JSON."""

    scenario: str
    tables: list[Table] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def render(self) -> str:
        parts = [t.render() for t in self.tables]
        if self.notes:
            parts.append("\n".join(f"  * {n}" for n in self.notes))
        return "\n\n".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "seconds": round(self.seconds, 1),
                "tables": [t.as_json() for t in self.tables], "notes": self.notes,
                "data": self.data}


def machine_info() -> dict[str, Any]:
    """What the figures depend on, recorded next to them."""
    import sqlalchemy

    info: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "sqlalchemy": sqlalchemy.__version__,
    }
    for module in ("psycopg", "aiosmtplib", "aiosmtpd"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - informational only
            info[module] = None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "flask_mail_outbox"], capture_output=True, text=True,
                               check=False).stdout
        info["git"] = {"head": head, "library_dirty": bool(dirty.strip())}
    except Exception:  # noqa: BLE001 - not a git checkout
        info["git"] = None
    return info


def write_results(name: str, payload: dict[str, Any], out: Path | None = None) -> Path:
    """Write the run's JSON (default ``benchmarks/results/<name>-<UTC>.json``)."""
    if out is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = RESULTS_DIR / f"{name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return out


# -- PostgreSQL ------------------------------------------------------------------------------

class PgCluster:
    """A throwaway cluster from ``scripts/pg-cluster start DIR`` (stopped by :meth:`stop`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.url: str | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    def start(self) -> str:
        log(f"starting PostgreSQL in {self.directory}")
        done = subprocess.run([str(PG_CLUSTER), "start", str(self.directory)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"scripts/pg-cluster start failed:\n{done.stderr}")
        self.url = done.stdout.strip().splitlines()[-1]
        # Log lines carry the database and a UTC time, so per-database statement
        # logging (see enable_statement_log) can be counted over a time window.
        self.admin_execute(
            "ALTER SYSTEM SET log_line_prefix = '%%m [%%p] db=%%d '",
            "ALTER SYSTEM SET log_timezone = 'UTC'",
            "SELECT pg_reload_conf()")
        return self.url

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, background workers)."""
        try:
            postmaster = int((self.directory / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        return [postmaster] + children_of(postmaster)

    def stop(self) -> None:
        if self.url is None:
            return
        subprocess.run([str(PG_CLUSTER), "stop", str(self.directory)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        self.url = None

    def admin_execute(self, *statements: str) -> None:
        import sqlalchemy as sa

        assert self.url is not None
        engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                for statement in statements:
                    conn.exec_driver_sql(statement)
        finally:
            engine.dispose()

    def create_database(self, prefix: str) -> tuple[str, str]:
        """A new empty database; returns ``(name, url)``."""
        import sqlalchemy as sa

        assert self.url is not None
        name = f"{prefix}_{uuid.uuid4().hex[:8]}".replace("-", "_")
        self.admin_execute(f'CREATE DATABASE "{name}"')
        url = sa.make_url(self.url).set(database=name).render_as_string(hide_password=False)
        return name, url

    def enable_statement_log(self, database: str) -> None:
        """Log every statement of new sessions on ``database`` (for server-side counts)."""
        self.admin_execute(f'ALTER DATABASE "{database}" SET log_statement = \'all\'')

    def server_version(self) -> str | None:
        import sqlalchemy as sa

        if self.url is None:
            return None
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                return str(conn.exec_driver_sql("SHOW server_version").scalar())
        finally:
            engine.dispose()

    _LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) UTC \[\d+\] db=(\S*) "
                       r"LOG:  (statement|execute [^:]*): (.*)$")

    def count_logged_statements(self, database: str, start: float, end: float
                                ) -> dict[str, int]:
        """Statements the server logged for ``database`` between two ``time.time()``s.

        Returns counts by the statement's first word (``BEGIN``, ``SELECT``, ...).
        """
        counts: dict[str, int] = {}
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                match = self._LINE.match(line)
                if not match or match.group(2) != database:
                    continue
                at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f").replace(
                    tzinfo=UTC).timestamp()
                if start <= at < end:
                    word = (match.group(4).split() or ["?"])[0].upper()
                    counts[word] = counts.get(word, 0) + 1
        return counts


# -- SMTP sinks --------------------------------------------------------------------------------

class Sink:
    """An SMTP sink process; :meth:`stats` reads its counters."""

    kind = "?"
    smtp_port: int
    pid: int
    has_receipts = False

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def receipts(self, start: int = 0) -> list[list[Any]]:
        raise NotImplementedError(f"the {self.kind} sink keeps no per-message receipts")

    def reset(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def wait_for(self, count: int, timeout: float, poll: float = 0.05,
                 progress: Callable[[dict[str, Any]], None] | None = None
                 ) -> dict[str, Any]:
        """Poll until the sink has ``count`` messages (or ``timeout``); returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if progress is not None:
                progress(stats)
            if stats["count"] >= count or time.monotonic() >= deadline:
                return stats
            time.sleep(poll)


class AiosmtpdSink(Sink):
    """``python -m benchmarks.sink`` in a subprocess."""

    kind = "aiosmtpd"
    has_receipts = True

    def __init__(self, delay: float = 0.0, stderr: IO[Any] | None = None) -> None:
        self.delay = delay
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.sink", "--delay", str(delay)],
            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError("the aiosmtpd sink did not start")
        ready = json.loads(line)
        self.smtp_port = int(ready["smtp_port"])
        self.control_port = int(ready["control_port"])
        self.pid = self.proc.pid

    def _ask(self, command: str) -> Any:
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=30) as s:
            s.sendall(command.encode() + b"\n")
            chunks = []
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        return json.loads(b"".join(chunks))

    def stats(self) -> dict[str, Any]:
        return dict(self._ask("stats"))

    def receipts(self, start: int = 0) -> list[list[Any]]:
        return list(self._ask(f"receipts {start}"))

    def reset(self) -> None:
        self._ask("reset")

    def stop(self) -> None:
        stop_process(self.proc)


class PostfixSink(Sink):
    """Postfix's ``smtp-sink -c`` (only when /usr/sbin/smtp-sink exists).

    Its running counter on stdout is the only count it gives: no per-message
    receipts, no Message-IDs (so no duplicate check), and first/last times are
    when this process saw the counter move (polled). Untested on the machine
    this suite was written on (no Postfix there).
    """

    kind = "postfix smtp-sink"

    def __init__(self) -> None:
        self.smtp_port = free_port()
        cmd = [str(POSTFIX_SINK), "-c"]
        if os.geteuid() == 0:
            cmd += ["-u", "nobody"]
        cmd += [f"127.0.0.1:{self.smtp_port}", "1024"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid
        self._count = 0
        self._base = 0
        self._first: float | None = None
        self._last: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        wait_port(self.smtp_port, 10)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        while True:
            chunk = self.proc.stdout.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                return
            buf = (buf + chunk)[-256:]
            numbers = re.findall(rb"\d+", re.split(rb"[\r\n]+", buf.strip())[-1])
            if numbers:
                now = time.time()
                with self._lock:
                    self._count = int(numbers[-1])
                    if self._count > self._base:
                        self._first = self._first or now
                        self._last = now

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"count": self._count - self._base, "unique": None,
                    "first": self._first, "last": self._last}

    def reset(self) -> None:
        with self._lock:
            self._base, self._first, self._last = self._count, None, None

    def stop(self) -> None:
        stop_process(self.proc)


def postfix_sink_available() -> bool:
    return POSTFIX_SINK.exists() and os.access(POSTFIX_SINK, os.X_OK)


# -- processes -----------------------------------------------------------------------------------

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: the repository importable, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("FLASK_APP", None)
    if extra:
        env.update(extra)
    return env


def bench_env(db_url: str, smtp_port: int, config: dict[str, Any] | None = None,
              log_level: str = "WARNING") -> dict[str, str]:
    """``BENCH_*`` variables for :mod:`benchmarks.bench_app`."""
    return {"BENCH_DB_URL": db_url, "BENCH_SMTP_PORT": str(smtp_port),
            "BENCH_CONFIG": json.dumps(config or {}), "BENCH_LOG_LEVEL": log_level}


def stop_process(proc: subprocess.Popen[Any], timeout: float = 15.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (Linux /proc; gone pids count 0)."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


# -- the run context -------------------------------------------------------------------------

class Context:
    """One benchmark run: a work directory, and everything started in it.

    PostgreSQL is started on first use and shared by the scenarios of the
    run; :meth:`close` stops every process that was started.
    """

    def __init__(self, *, keep: bool = False, workdir: Path | None = None) -> None:
        self.keep = keep
        if workdir is None:
            # Under /tmp and world-traversable: the postgres user must reach the cluster.
            workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-", dir="/tmp"))
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o755)
        self.workdir = workdir
        self._pg: PgCluster | None = None
        self._cleanups: list[Callable[[], Any]] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._log_files: list[IO[Any]] = []

    # PostgreSQL

    def postgres(self) -> PgCluster:
        if self._pg is None:
            pg = PgCluster(self.workdir / "pg")
            self._pg = pg
            pg.start()
        return self._pg

    # sinks and processes

    def aiosmtpd_sink(self, delay: float = 0.0) -> AiosmtpdSink:
        sink = AiosmtpdSink(delay, stderr=self.log_file(f"sink-{delay:g}"))
        self._cleanups.append(sink.stop)
        return sink

    def throughput_sink(self, prefer_postfix: bool = True) -> Sink:
        """Postfix's smtp-sink when it exists (C, cheap on CPU), else the aiosmtpd sink."""
        if prefer_postfix and postfix_sink_available():
            sink: Sink = PostfixSink()
            self._cleanups.append(sink.stop)
            return sink
        return self.aiosmtpd_sink()

    def log_file(self, name: str) -> IO[Any]:
        path = self.workdir / "logs" / f"{name}-{uuid.uuid4().hex[:6]}.log"
        path.parent.mkdir(exist_ok=True)
        f = open(path, "w")  # noqa: SIM115 - closed by close()
        self._log_files.append(f)
        return f

    def spawn(self, args: list[str], *, env: dict[str, str], name: str,
              stdout: Any = None) -> subprocess.Popen[Any]:
        """A child process from the repository root, its stderr in a log file."""
        err = self.log_file(name)
        proc = subprocess.Popen(args, cwd=REPO, env=child_env(env), stdout=stdout,
                                stderr=err, text=True)
        proc.log_path = Path(err.name)  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc


    def spawn_worker(self, env: dict[str, str], *, concurrency: int, name: str
                     ) -> subprocess.Popen[Any]:
        """``flask outbox worker --concurrency N`` against ``benchmarks.bench_app``."""
        return self.spawn([sys.executable, "-m", "flask", "--app",
                           "benchmarks.bench_app:create_app", "outbox", "worker",
                           "--concurrency", str(concurrency)], env=env, name=name)

    def close(self) -> None:
        for child in self._procs:
            try:
                stop_process(child)
            except Exception as exc:  # noqa: BLE001 - best effort at the end
                log(f"could not stop pid {child.pid}: {exc}")
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except Exception as exc:  # noqa: BLE001
                log(f"cleanup failed: {exc}")
        if self._pg is not None:
            self._pg.stop()
        for f in self._log_files:
            f.close()
        if self.keep:
            log(f"kept the work directory {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def log_path(proc: subprocess.Popen[Any]) -> Path:
    """The stderr log file of a process started by :meth:`Context.spawn`."""
    return Path(getattr(proc, "log_path"))  # noqa: B009 - set by Context.spawn


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
