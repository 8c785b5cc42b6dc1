"""What the scenarios share: PostgreSQL, SMTP sinks, subprocesses, statistics, output.

Everything a scenario starts goes through a :class:`Context`, which stops it
again at the end of the run (also on Ctrl-C or an error). Sinks and workers are
separate processes, so the process that measures never shares a GIL with the
one measured.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa

REPO = Path(__file__).resolve().parent.parent
PG_CLUSTER = REPO / "scripts" / "pg-cluster"
APP = "benchmarks.bench_app:create_app"


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
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- output ------------------------------------------------------------------------------

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
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


@dataclasses.dataclass
class Table:
    """One printed table: column titles and rows of raw values."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = dataclasses.field(default_factory=list)

    def add(self, *values: Any) -> None:
        self.rows.append(list(values))

    def render(self) -> str:
        cells = [[fmt(v) for v in row] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells if i < len(r)])
                  for i, c in enumerate(self.columns)]
        lines = [self.title, "  ".join(c.ljust(w) for c, w in zip(self.columns, widths)),
                 "  ".join("-" * w for w in widths)]
        # Numbers right-aligned, the first column (the row's name) left-aligned.
        lines += ["  ".join(v.rjust(w) if i else v.ljust(w)
                            for i, (v, w) in enumerate(zip(row, widths))) for row in cells]
        return "\n".join(line.rstrip() for line in lines)


@dataclasses.dataclass
class Report:
    """What a scenario returns: tables to print, notes, and its figures for the JSON.

    ``figures`` are the numbers a run is about (``None`` when not measured);
    ``smoke`` fails a scenario that produced none.
    """

    scenario: str
    tables: list[Table] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    figures: dict[str, float | None] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def render(self) -> str:
        parts = [t.render() for t in self.tables]
        if self.notes:
            parts.append("\n".join(f"  * {n}" for n in self.notes))
        return "\n\n".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "figures": self.figures,
                "notes": self.notes,
                "tables": [dataclasses.asdict(t) for t in self.tables]}


def machine_info() -> dict[str, Any]:
    """What the figures depend on, recorded next to them."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "sqlalchemy": sa.__version__, "git_head": head or None}


# -- the transports' constructors ------------------------------------------------------------

def smtp_transport(host: str, port: int, concurrency: int) -> Any:
    """The library's SMTP transport for ``host:port``, plain SMTP, ``concurrency`` connections.

    The one place that builds a transport by hand; everything else goes
    through an app.
    """
    from flask_mail_outbox.transports import SMTPSettings, SMTPTransport

    return SMTPTransport(SMTPSettings(host=host, port=port), concurrency=concurrency)


# -- SQL against the documented tables --------------------------------------------------------

def execute(url: str, *statements: str, params: dict[str, Any] | None = None) -> list[Any]:
    """Run ``statements`` in autocommit; the rows of each (None when it returns none)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        results = []
        with engine.connect() as conn:
            for statement in statements:
                result = conn.execute(sa.text(statement), params or {})
                results.append(result.all() if result.returns_rows else None)
        return results
    finally:
        engine.dispose()


def status_counts(url: str) -> dict[str, int]:
    rows = execute(url, "SELECT status, count(*) FROM outbox_email GROUP BY status")[0]
    return {str(status): int(count) for status, count in rows}


def wait_listening(url: str, count: int, procs: Sequence[subprocess.Popen[Any]],
                   timeout: float = 60) -> None:
    """Until ``count`` sessions on the PostgreSQL database LISTEN (the workers are up)."""
    database = sa.make_url(url).database
    deadline = time.monotonic() + timeout
    while True:
        check_alive(procs)
        listening = execute(url, "SELECT count(*) FROM pg_stat_activity WHERE datname = :d "
                                 "AND query LIKE 'LISTEN %'", params={"d": database})[0][0][0]
        if listening >= count:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"only {listening} of {count} workers listen after {timeout:g} s")
        time.sleep(0.05)


# -- PostgreSQL ------------------------------------------------------------------------------

def postgres_available() -> bool:
    done = subprocess.run([str(PG_CLUSTER), "bindir"], capture_output=True, check=False)
    return done.returncode == 0


class PgCluster:
    """A throwaway cluster from ``scripts/pg-cluster start DIR`` (stopped by :meth:`stop`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        log(f"starting PostgreSQL in {directory}")
        done = subprocess.run([str(PG_CLUSTER), "start", str(directory)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"scripts/pg-cluster start failed:\n{done.stderr}")
        self.url = done.stdout.strip().splitlines()[-1]
        # Log lines carry the database, so a database's statements can be counted.
        execute(self.url, "ALTER SYSTEM SET log_line_prefix = '%m [%p] db=%d '",
                "ALTER SYSTEM SET log_timezone = 'UTC'", "SELECT pg_reload_conf()")

    def stop(self) -> None:
        subprocess.run([str(PG_CLUSTER), "stop", str(self.directory)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

    def create_database(self, prefix: str) -> str:
        """A new empty database; its URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:8]}".replace("-", "_")
        execute(self.url, f'CREATE DATABASE "{name}"')
        return sa.make_url(self.url).set(database=name).render_as_string(hide_password=False)

    def log_statements(self, url: str) -> None:
        """Log every statement of new sessions on ``url``'s database."""
        execute(self.url, f'ALTER DATABASE "{sa.make_url(url).database}" '
                          "SET log_statement = 'all'")

    def count_logged(self, url: str, start: float, end: float) -> int:
        """Statements the server logged for ``url``'s database between two ``time.time()``."""
        import re
        from datetime import UTC, datetime

        line_re = re.compile(r"^(\S+ \S+) UTC \[\d+\] db=(\S*) LOG:  (statement|execute)")
        database = sa.make_url(url).database
        count = 0
        with open(self.directory / "postgres.log", encoding="utf-8", errors="replace") as f:
            for line in f:
                match = line_re.match(line)
                if match and match.group(2) == database:
                    at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f").replace(
                        tzinfo=UTC).timestamp()
                    count += start <= at < end
        return count


# -- SMTP sinks --------------------------------------------------------------------------------

class Sink:
    """``python -m benchmarks.sink`` in a subprocess; its control port answers in JSON."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the sink did not start")
        ready = json.loads(line)
        self.smtp_port = int(ready["smtp_port"])
        self.control_port = int(ready["control_port"])

    def _ask(self, command: str) -> Any:
        with socket.create_connection(("127.0.0.1", self.control_port), timeout=30) as s:
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(1 << 20):
                chunks.append(chunk)
        return json.loads(b"".join(chunks))

    def stats(self) -> dict[str, Any]:
        """``count``, ``unique`` Message-IDs, ``first``/``last`` receipt times, ``refused``."""
        return dict(self._ask("stats"))

    def receipts(self) -> list[list[Any]]:
        """``[time, Message-ID, X-Bench-Id]`` of every message since the last reset."""
        return list(self._ask("receipts"))

    def refusals(self) -> list[float]:
        """The times of the quota's refusals since the last reset."""
        return [float(t) for t in self._ask("refusals")]

    def reset(self) -> None:
        self._ask("reset")

    def wait_for(self, count: int, timeout: float,
                 procs: Sequence[subprocess.Popen[Any]] = ()) -> dict[str, Any]:
        """Poll until the sink has ``count`` messages (or ``timeout``); returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            check_alive(procs)
            stats = self.stats()
            if stats["count"] >= count or time.monotonic() >= deadline:
                return stats
            time.sleep(0.02)


# -- processes -----------------------------------------------------------------------------------

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: the repository importable, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("FLASK_APP", None)
    env.update(extra or {})
    return env


def bench_env(db_url: str, smtp_port: int, config: dict[str, Any] | None = None
              ) -> dict[str, str]:
    """``BENCH_*`` variables for :mod:`benchmarks.bench_app`."""
    return {"BENCH_DB_URL": db_url, "BENCH_SMTP_PORT": str(smtp_port),
            "BENCH_CONFIG": json.dumps(config or {})}


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


def check_alive(procs: Iterable[subprocess.Popen[Any]]) -> None:
    """Raise, with the tail of its log, when a process that should run has exited."""
    for proc in procs:
        if proc.poll() not in (None, 0):
            raise RuntimeError(f"{' '.join(proc.args[-3:])} exited with {proc.returncode}:\n"
                               f"{tail(proc)}")


def tail(proc: subprocess.Popen[Any], lines: int = 30) -> str:
    """The end of the stderr log of a process started by :meth:`Context.spawn`."""
    try:
        text = Path(getattr(proc, "log_path", "")).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, procs: Sequence[subprocess.Popen[Any]] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        check_alive(procs)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


# -- the run context -------------------------------------------------------------------------

class Context:
    """One benchmark run: a work directory, and everything started in it.

    PostgreSQL is started on first use and shared by the scenarios of the run;
    :meth:`close` stops every process that was started.
    """

    def __init__(self, *, keep: bool = False, postgres: bool = True) -> None:
        self.keep = keep
        # Under /tmp and world-traversable: the postgres user must reach the cluster.
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-", dir="/tmp"))
        os.chmod(self.workdir, 0o755)
        self.has_postgres = postgres and postgres_available()
        self._pg: PgCluster | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._log_files: list[IO[Any]] = []

    def postgres(self) -> PgCluster:
        if not self.has_postgres:
            raise RuntimeError("no PostgreSQL server (scripts/pg-cluster bindir found none)")
        if self._pg is None:
            self._pg = PgCluster(self.workdir / "pg")
        return self._pg

    def databases(self, backends: str, name: str, *, fallback: bool = True
                  ) -> list[tuple[str, str]]:
        """``(backend, url)`` of a new database per backend of ``"sqlite,pg"``.

        PostgreSQL is skipped, with a line saying so, when this machine has none;
        with ``fallback`` a scenario that asked for PostgreSQL alone runs on SQLite.
        """
        wanted = [b.strip() for b in backends.split(",") if b.strip()]
        if not self.has_postgres and "pg" in wanted:
            log(f"{name}: skipping PostgreSQL (no server binaries, or --no-pg)")
            wanted = [b for b in wanted if b != "pg"] or (["sqlite"] if fallback else [])
        out = []
        for backend in wanted:
            if backend == "pg":
                out.append((backend, self.postgres().create_database(f"bench_{name}")))
            elif backend == "sqlite":
                path = self.workdir / f"{name}-{uuid.uuid4().hex[:6]}.db"
                out.append((backend, f"sqlite:///{path}"))
            else:
                raise SystemExit(f"unknown backend {backend!r} (sqlite, pg)")
        return out

    def sink(self, delay: float = 0.0, quota: float | None = None,
             burst: float | None = None, quota_at: str | None = None,
             quota_reply: str | None = None, quota_close: bool = True) -> Sink:
        """An SMTP sink process answering each message after ``delay`` s, above ``quota`` 421.

        ``burst``: the tokens the quota's bucket holds (default: one second's worth);
        ``quota_at``: where it refuses ("data", the default, or "mail"); ``quota_reply``:
        its reply; ``quota_close``: whether it closes the connection after it (see
        benchmarks/sink.py).
        """
        args = [sys.executable, "-m", "benchmarks.sink", "--delay", str(delay)]
        if quota:
            args += ["--quota", f"{quota:g}"]
            if burst:
                args += ["--quota-burst", f"{burst:g}"]
            if quota_at:
                args += ["--quota-at", quota_at]
            if quota_reply:
                args += ["--quota-reply", quota_reply]
            if not quota_close:
                args += ["--quota-keep-open"]
        return Sink(self.spawn(args, env={}, name="sink", stdout=subprocess.PIPE))

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
        proc.log_path = err.name  # type: ignore[attr-defined]
        self._procs.append(proc)
        return proc

    def spawn_worker(self, url: str, sink: Sink, *, concurrency: int = 4,
                     config: dict[str, Any] | None = None, name: str = "worker"
                     ) -> subprocess.Popen[Any]:
        """``flask outbox worker --concurrency N``, durable, on ``url`` and ``sink``."""
        env = bench_env(url, sink.smtp_port, {"OUTBOX_DURABLE": True, **(config or {})})
        return self.spawn([sys.executable, "-m", "flask", "--app", APP, "outbox", "worker",
                           "--concurrency", str(concurrency)], env=env, name=name)

    def close(self) -> None:
        for proc in reversed(self._procs):
            try:
                stop_process(proc)
            except Exception as exc:  # noqa: BLE001 - best effort at the end
                log(f"could not stop pid {proc.pid}: {exc}")
            if proc.stdout is not None:  # a sink's pipe (its one ready line was read)
                proc.stdout.close()
        if self._pg is not None:
            self._pg.stop()
        for f in self._log_files:
            f.close()
        if self.keep:
            log(f"kept the work directory {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def measure(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
