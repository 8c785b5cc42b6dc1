"""The ``flask outbox`` command group (registered through ``flask.commands``)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click
from flask import current_app
from flask.cli import AppGroup
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .._bounces import MAX_BYTES
from .._compose.message import Message
from .._errors import InvalidMessage, TemplateError
from .._events import DeliveryEvent
from .._flask.state import AppState, app_state
from ..core._internal import (
    DURABLE_SETTING,
    EXACT,
    MAX_CONCURRENCY,
    PauseStore,
    recount_tally,
    utcnow,
)
from . import template_check

if TYPE_CHECKING:
    from .._flask.extension import OutboxExtension

outbox_cli = AppGroup("outbox", help="Inspect and operate the email outbox.")

_LOG_LEVELS = ("debug", "info", "warning", "error")
_F = TypeVar("_F", bound=Callable[..., Any])


def _log_level_option(default: str | Callable[[dict[str, Any]], str] = "warning"
                      ) -> Callable[[_F], _F]:
    """``--log-level``: a CLI command is an entry point, so it may set up logging.

    When the root logger has no handler (the app configures no logging), the
    library's records at that level go to stderr; otherwise the app's
    handlers stay in charge and only the library's level is set when the
    option is given. ``default`` (a level, or one chosen from the command's
    parameters): ``warning`` keeps a command's output to what it says, with
    every degradation still shown; ``info`` for the commands whose engine
    lines are their record of what they did (``worker``, a real ``sweep``).
    """
    def decorate(command: _F) -> _F:
        # In the command's body, so after the app (and whatever logging it sets up) loaded.
        @functools.wraps(command)
        def configured(*args: Any, log_level: str | None = None, **kwargs: Any) -> Any:
            _configure_logging(log_level, default if isinstance(default, str)
                               else default(kwargs))
            return command(*args, **kwargs)

        shown = default if isinstance(default, str) else "info, warning with --dry-run"
        return cast(_F, click.option(
            "--log-level", type=click.Choice(_LOG_LEVELS, case_sensitive=False), default=None,
            help=f"Level of the outbox's log lines (default {shown}, to stderr when the app "
                 "configures no logging; debug shows what the engine did).")(configured))

    return decorate


def _configure_logging(level: str | None, default: str) -> None:
    library = logging.getLogger("flask_mail_outbox")
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"))
        root.addHandler(handler)
        library.setLevel((level or default).upper())
    elif level is not None:
        library.setLevel(level.upper())


def _log_start(command: str, *, mode: str, concurrency: int | None = None) -> None:
    """One INFO line: which database, transport, mode and concurrency (no password)."""
    state = _state()
    with current_app.app_context():
        url = state.db.engine.url.render_as_string(hide_password=True)
    config = state.config
    if config.suppress_send:
        transport = "memory (MAIL_SUPPRESS_SEND)"
    else:
        specs = config.transport_specs
        transport = "; ".join(
            ("" if len(specs) == 1 else f"{spec.name}: ")
            + (f"smtp {spec.smtp.host}:{spec.smtp.port}" if spec.kind == "smtp" else spec.kind)
            + (f" at {spec.rate}" if spec.rate else "")
            + (f", failing over to {', '.join(spec.failover)}" if spec.failover else "")
            for spec in specs)
    logging.getLogger("flask_mail_outbox._operator.cli").info(
        "flask outbox %s (pid %d): database %s, transport %s, mode %s%s", command,
        os.getpid(), url, transport, mode,
        "" if concurrency is None else f", concurrency {concurrency}")


def _state() -> AppState:
    try:
        return app_state()
    except RuntimeError:
        raise click.ClickException(
            "flask-mail-outbox is not registered on this app (call OutboxMail(app) or "
            "mail.init_app(app) in your app factory)") from None


def _verdict_said(event: DeliveryEvent) -> str:
    """What the suppression policy concluded for an event's recipient, for a log line."""
    if event.verdict is None:
        return ""
    said = {"permanent": "suppressed for good", "none": "not suppressed"}.get(
        event.verdict, f"suppressed until {event.suppressed_until:%Y-%m-%d %H:%M} UTC"
        if event.suppressed_until else "suppressed until a time")
    if event.applied:
        return f": {said}"
    if event.verdict == "none":
        return ": would not have been suppressed (not applied)"
    return f": would have been {said} (not applied)"


def _extension() -> OutboxExtension:
    mail: OutboxExtension = _state().ext
    return mail


@outbox_cli.command("send-test")
@_log_level_option()
@click.option("--to", "to", required=True, metavar="ADDRESS", help="Recipient address.")
@click.option("--subject", default="flask-mail-outbox test email", show_default=True)
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=60.0,
              show_default=True, help="Seconds to wait for the delivery.")
@click.option("--transport", "transport", default=None, metavar="NAME",
              help="One of OUTBOX_TRANSPORTS (default: the default transport).")
def send_test(to: str, subject: str, timeout: float, transport: str | None) -> None:
    """Send one real email through the configured transport and report the outcome.

    A test email is one-shot: it is tried at once (in inline mode with
    OUTBOX_INLINE_RETRIES quick retries) and never retried later. If no attempt
    delivers it, it ends failed (a permanent refusal), expired (its next
    retry would come after --timeout) or cancelled (taken back: its next
    retry was due sooner), and the command exits 1. It expires at --timeout
    even if this command is killed.
    """
    state = _state()
    mail, db = state.ext, state.db
    message = Message(subject, recipients=[to],
                      body="This is a test email from flask-mail-outbox (flask outbox send-test).")
    try:
        email_id = mail.send(message, transport=transport,
                             expires_after=timedelta(seconds=timeout))
    except InvalidMessage as exc:
        hint = {"subject": "--subject", "transport": "--transport"}.get(exc.field, "--to")
        raise click.BadParameter(str(exc), param_hint=hint) from exc
    db.session.commit()
    idle = mail.wait_idle(timeout)
    reader = state.outbox().reader
    row = reader.email_outcome(email_id)
    status = row["status"]
    # Only what this process tried: with no dispatcher here (OUTBOX_RUN_WORKER = False,
    # durable), a `flask outbox worker` delivers it, and its expiry bounds the wait.
    # (Or held unsent with why, its attempt kept, while its transport is paused.)
    if idle and status == "queued" and (row["attempts"] > 0 or row["last_error"]) \
            and mail.cancel(email_id):
        # Waiting for a retry due before its expiry: a test is not retried later.
        db.session.commit()
        status = "cancelled"
    click.echo(f"email {email_id} {row['message_id']}: {status} "
               f"after {row['attempts']} attempt(s)")
    mail.stop()
    if status != "sent":
        detail = row["last_error"] or ("still in progress" if not idle else "not delivered")
        click.echo(f"error: {detail}", err=True)
        sys.exit(1)


@outbox_cli.command("worker")
@_log_level_option("info")
@click.option("--concurrency", type=click.IntRange(1, MAX_CONCURRENCY), default=None,
              help="Concurrent SMTP connections (sends in flight) in this process "
                   "[default: OUTBOX_CONCURRENCY, 4 unless set].")
@click.option("--once", is_flag=True, help="Deliver what is due now, then exit 0.")
@click.option("--shutdown-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds sends in flight get to finish on SIGTERM/SIGINT.")
def worker(concurrency: int | None, once: bool, shutdown_timeout: float) -> None:
    """Run a durable dispatcher in the foreground (whatever the mode setting says).

    Any number of workers, on any number of machines sharing one PostgreSQL,
    cooperate: each claims its rows with FOR UPDATE SKIP LOCKED under a lease.
    SIGTERM or SIGINT stops claiming, lets sends in flight finish (or releases
    them after --shutdown-timeout) and exits 0. At start, with or without --once,
    it exits 75 (EX_TEMPFAIL) when the database cannot be reached and 78
    (EX_CONFIG) when the outbox tables do not exist, in one line.
    """
    state = _state()
    if concurrency is not None and state.current_outbox() is None:
        state.concurrency = concurrency
    _check_database("worker" + (" --once" if once else ""), state)
    worker = state.outbox().dispatch(hand_ticked=True)  # its loop runs here, in the foreground
    log = logging.getLogger("flask_mail_outbox.worker")
    _log_start("worker" + (" --once" if once else ""), mode="durable (a worker always is)",
               concurrency=state.concurrency)
    if not once and state.config.run_scheduler:
        # The startup sweep, as in any serving process; the dispatcher is this loop.
        state.start_scheduler(start_dispatcher=False)
    if once:
        delivered = worker.drain()
        click.echo(f"worker --once: {delivered} email(s) handled")
        state.stop(shutdown_timeout)
        return

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("Received %s: finishing sends in flight, then exiting",
                 signal.Signals(signum).name)
        worker.request_stop()
        # Past the timeout, messages not yet handed to the server are released.
        timer = threading.Timer(shutdown_timeout, worker.cancel_unstarted)
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("outbox worker started (pid %d, concurrency %d)", os.getpid(),
             state.concurrency)
    try:
        worker.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state.stop(shutdown_timeout)
    log.info("outbox worker stopped")


#: sysexits.h EX_CONFIG: the outbox tables do not exist (a deploy that skipped the
#: migrations); restarting changes nothing until someone runs them.
EX_CONFIG = 78


def _check_database(command: str, state: AppState) -> None:
    """Exit at once, in one line, when the worker cannot work: 75 (EX_TEMPFAIL) when the
    database cannot be reached, 78 (EX_CONFIG) when the outbox tables do not exist.

    One indexed read (the health check's). A worker that started against no database
    would otherwise log a traceback per part and exit 0 (``--once``) or wait in silence
    for a database that a deploy forgot: a supervisor (cron, systemd, Kubernetes) sees
    the code and restarts it later (75) or stops restarting it (78). A database that
    goes away after the start is ridden out by the running loop, as ever.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from .. import _degrade

    try:
        state.outbox().reader.health_figures()
    except SQLAlchemyError as exc:
        with current_app.app_context():
            url = state.db.engine.url.render_as_string(hide_password=True)
        missing = _degrade.tables_missing(exc)
        if missing is not None:
            click.echo(f"flask outbox {command}: the outbox tables do not exist in {url} "
                       f"({missing}): create them with `flask db upgrade heads` (see "
                       "docs/migrations.md), or mail.create_all() in development; "
                       f"exit {EX_CONFIG}", err=True)
            code = EX_CONFIG
        else:
            verb = "reach" if _degrade.database_unreachable(exc) else "use"
            click.echo(f"flask outbox {command}: cannot {verb} the database {url} "
                       f"({type(exc).__name__}): check that it runs and accepts this "
                       f"user, and SQLALCHEMY_DATABASE_URI; exit {EX_TEMPFAIL}", err=True)
            code = EX_TEMPFAIL
        state.stop(0)
        sys.exit(code)


if TYPE_CHECKING:  # generic from click 8.2 on; Flask 3.0 allows older ones at run time
    _IntParamType = click.ParamType[int]
else:
    _IntParamType = click.ParamType


class _EmailIds(_IntParamType):
    """An email's id, as `status`, `dlq list` and the dashboard show it: a whole number."""

    name = "ID"

    def __init__(self, command: str, other: str) -> None:
        self.command, self.other = command, other

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if text.isascii() and text.isdigit() and 1 <= int(text) <= 2**63 - 1:
            return int(text)
        self.fail(f"{value!r} is not an email id: give the ids as whole numbers from 1 "
                  f"(`flask outbox {self.command} 12 13`), or {self.other}", param, ctx)


@outbox_cli.command("durable")
@_log_level_option()
@click.argument("action", type=click.Choice(["on", "off", "status"]))
def durable(action: str) -> None:
    """Switch every process sharing the database to durable (on) or inline (off) delivery."""
    state = _state()
    if action == "status":
        click.echo("durable" if state.durable() else "inline")
    else:
        # Only the setting: mail.set_durable() would also start this process's
        # dispatcher, and a command that writes a setting delivers nothing.
        state.outbox().store.admin.set_setting(DURABLE_SETTING, action == "on")
        click.echo(f"delivery mode is now {'durable' if action == 'on' else 'inline'} "
                   "for every process (each sees it within OUTBOX_SETTINGS_TTL_SECONDS)")
    state.stop(5)


def _print_report(report: Any) -> None:
    fields = report.as_dict()
    width = max(len(k) for k in fields)
    for name, value in fields.items():
        click.echo(f"{name:<{width}}  {value}")


@outbox_cli.command("sweep")
@_log_level_option(lambda params: "warning" if params["dry_run"] else "info")
@click.option("--min-age", type=click.FloatRange(0), default=None,
              help="Seconds a queued row must have waited (default OUTBOX_SWEEP_MIN_AGE_SECONDS).")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="Rows at most (default OUTBOX_SWEEP_BATCH).")
@click.option("--dry-run", is_flag=True, help="Count what would be taken; change nothing.")
def sweep(min_age: float | None, limit: int | None, dry_run: bool) -> None:
    """Take rows left behind by a crash or a failed hand-over; exit 1 if any failed."""
    mail = _extension()
    _log_start("sweep" + (" --dry-run" if dry_run else ""),
               mode="durable" if mail.durable else "inline",
               concurrency=_state().concurrency)
    try:
        report = mail.sweep(min_age=min_age, limit=limit, dry_run=dry_run)
    finally:
        mail.wait_idle(5)
    _print_report(report)
    mail.stop()
    if report.failed:
        sys.exit(1)


@outbox_cli.command("status")
@_log_level_option()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--recount", is_flag=True,
              help="First rebuild the running totals of sent, suppressed, expired and "
                   "cancelled from the rows (one scan of the table).")
def status(as_json: bool, recount: bool) -> None:
    """Rows per status, the oldest queued row's age, the mode, the last sweep and the
    transports paused by a fault of their own (since when, why, the next probe).

    queued, sending and failed are counted row by row; sent, suppressed, expired
    and cancelled are running totals that triggers keep in ``outbox_tally``
    (exact, and as cheap at a million rows as at none). ``--recount`` rebuilds
    those from the rows and says which were off.
    """
    import json

    from sqlalchemy.exc import SQLAlchemyError


    mail = _extension()
    corrected: dict[str, int] | None = None
    try:
        if recount:
            with _state().outbox().store.write() as conn:
                corrected = recount_tally(conn)
        stats = mail.stats()
        pauses = PauseStore(_state().outbox().store).all()
    except SQLAlchemyError as exc:
        # The type only: a driver's message may name hosts and users.
        raise click.ClickException(
            f"cannot read the outbox tables ({type(exc).__name__}): check the database "
            "connection and that the tables exist (`flask db upgrade outbox@head`)") from exc
    finally:
        mail.stop()
    stats.pop("dispatcher", None)  # this CLI process runs none
    if corrected is not None:
        stats["recounted"] = corrected
    stats["paused_transports"] = [pauses[name].as_dict() for name in sorted(pauses)]
    if as_json:
        click.echo(json.dumps(stats, indent=2, sort_keys=True))
        return
    if corrected is not None:
        click.echo("recount: " + (", ".join(f"{name} {change:+d}" for name, change
                                            in sorted(corrected.items()))
                                  or "every running total was right"))
    click.echo(f"mode: {stats['mode']}" + (f" (delivered by {stats['executor']} workers)"
                                           if stats["executor"] != "dispatcher" else ""))
    for name, count in stats["counts"].items():
        click.echo(f"  {name:<10} {count:>10}")
    tallied = [name for name in stats["counts"]
               if name not in {exact.value for exact in EXACT}]
    click.echo(f"  ({', '.join(tallied)}: running totals kept by the database; "
               "--recount rebuilds them)")
    age = stats["oldest_queued_age_seconds"]
    click.echo("oldest queued: " + ("none" if age is None else f"{age:.0f} s"))
    click.echo("paused transports:" + ("" if pauses else " none"))
    for name in sorted(pauses):
        pause = pauses[name]
        click.echo(f"  {name}: {pause.kind} since {pause.since:%Y-%m-%d %H:%M:%S} UTC, next "
                   f"probe at {pause.probe_at:%Y-%m-%d %H:%M:%S} UTC: {pause.error}")
    last = stats["last_sweep"]
    if last is None:
        click.echo("last sweep: never")
    else:
        kind = f", {last['kind']}" if last.get("kind") else ""
        # What that sweep saw, dated: those emails may have gone out since.
        gated = (f"; as of the sweep at {last['started_at']}, {last['age_gated']} younger "
                 f"under the age gate until {last['age_gated_until']}"
                 if last.get("age_gated") else "")
        click.echo(f"last sweep: {last['started_at']} ({last['mode']}{kind}): scanned "
                   f"{last['scanned']}, requeued {last['requeued']}, sent {last['sent']}, "
                   f"failed {last['failed']}, skipped {last['skipped']}, truncated "
                   f"{last['truncated']}{gated}")


@outbox_cli.group("dlq")
def dlq() -> None:
    """The dead-letter list (emails whose delivery failed for good)."""


@dlq.command("list")
@_log_level_option()
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
def dlq_list(limit: int) -> None:
    """The newest dead letters with their last error."""
    mail = _extension()
    rows = mail.dead_letters(limit)
    mail.stop()
    if not rows:
        click.echo("no dead letters")
        return
    click.echo(f"{'id':>8}  {'attempts':>8}  {'created':<19}  recipients / subject / last error")
    for row in rows:
        created = row["created_at"].isoformat(sep=" ", timespec="seconds")
        click.echo(f"{row['id']:>8}  {row['attempts']:>8}  {created:<19}  "
                   f"{', '.join(row['recipients'])}")
        click.echo(f"{'':>41}{row['subject']!r}")
        click.echo(f"{'':>41}{row['last_error']}")


@dlq.command("retry")
@_log_level_option()
@click.argument("ids", nargs=-1, type=_EmailIds("dlq retry", "--all"))
@click.option("--all", "retry_all", is_flag=True, help="Every dead letter.")
def dlq_retry(ids: tuple[int, ...], retry_all: bool) -> None:
    """Put dead letters back in the queue (attempts reset, due now)."""
    if bool(ids) == retry_all:
        raise click.UsageError("give dead-letter ids, or --all (not both)")
    mail = _extension()
    missing = []
    if retry_all:
        done = mail.retry_all()
    else:
        for email_id in ids:
            try:
                mail.retry(email_id)
            except LookupError:  # durability: ok unknown ids go to stderr with exit 1 below
                missing.append(email_id)
        done = len(ids) - len(missing)
    mail.wait_idle(30)
    mail.stop()
    click.echo(f"{done} email(s) queued again")
    if missing:
        click.echo(f"not dead letters: {', '.join(map(str, missing))}", err=True)
        sys.exit(1)


@dlq.command("purge")
@_log_level_option()
@click.option("--older-than", "days", type=click.FloatRange(0), default=None,
              help="Only emails dead-lettered more than DAYS ago.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(days: float | None, yes: bool) -> None:
    """Delete dead letters for good."""
    state = _state()
    if not yes:
        click.confirm("Delete dead letters" + (f" older than {days:g} days" if days else "")
                      + " for good?", abort=True)
    cutoff = None if days is None else utcnow() - timedelta(days=days)
    deleted = state.outbox().store.admin.delete_failed(older_than=cutoff)
    state.stop(5)
    click.echo(f"deleted {deleted} dead letter(s)")


@outbox_cli.command("purge")
@_log_level_option()
@click.option("--older-than", "days", type=click.FloatRange(0, min_open=True), required=True,
              help="Delete emails sent, or ended unsent, more than DAYS ago.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Only count them.")
@click.option("--batch", type=click.IntRange(1), default=1000, show_default=True)
def purge(days: float, yes: bool, dry_run: bool, batch: int) -> None:
    """Delete old sent, suppressed, expired and cancelled emails in batches.

    Queued, sending and failed rows are kept (`dlq purge` deletes dead letters).
    """
    state = _state()
    outbox = state.outbox()
    store = outbox.store
    cutoff = utcnow() - timedelta(days=days)
    sent = outbox.reader.count_sent_before(cutoff)
    ended = outbox.reader.count_ended_before(cutoff)
    total = sent + ended
    what = f"{sent} sent and {ended} suppressed, expired or cancelled email(s)"
    if dry_run:
        click.echo(f"{what} older than {days:g} day(s) would be deleted")
        state.stop(5)
        return
    if total and not yes:
        click.confirm(f"Delete {what} older than {days:g} day(s)?", abort=True)
    deleted = [0, 0]
    with click.progressbar(length=total, label="deleting", file=sys.stderr) as bar:
        for which, delete in enumerate((store.admin.delete_sent, store.admin.delete_ended)):
            while True:
                count = delete(older_than=cutoff, batch=batch)
                deleted[which] += count
                bar.update(count)
                if count < batch:
                    break
    events = 0
    window = timedelta(seconds=outbox.config.soft_bounces.window_seconds)
    while True:  # events matched to no email: none has an email to go with
        count = store.admin.delete_unmatched_events(
            older_than=min(cutoff, utcnow() - window), batch=batch)
        events += count
        if count < batch:
            break
    state.stop(5)
    click.echo(f"deleted {deleted[0]} sent and {deleted[1]} suppressed, expired or "
               f"cancelled email(s), and {events} delivery event(s) matched to no email")


@outbox_cli.group("suppression")
def suppression() -> None:
    """The suppression list: addresses the outbox does not send to."""


@suppression.command("list")
@_log_level_option()
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True)
@click.option("--prefix", default=None, help="Only addresses that start with PREFIX.")
def suppression_list(limit: int, prefix: str | None) -> None:
    """The entries in force, by address."""
    state = _state()
    outbox = state.outbox()
    entries = outbox.suppressions.entries(limit=limit, prefix=prefix)
    more = 0
    if len(entries) == limit:
        # Further matches of the prefix, not every entry on the list; counted, not read.
        more = max(0, outbox.suppressions.count(prefix=prefix) - limit)
    state.stop(5)
    if not entries:
        click.echo("the suppression list is empty" if not prefix else "no entry matches")
        return
    click.echo(f"{'address':<40}  {'reason':<12}  {'since':<19}  source")
    for entry in entries:
        since = entry.created_at.isoformat(sep=" ", timespec="seconds")
        until = (f" (until {entry.expires_at.isoformat(sep=' ', timespec='seconds')})"
                 if entry.expires_at else "")
        click.echo(f"{entry.address:<40}  {entry.reason:<12}  {since:<19}  "
                   f"{entry.source}{until}")
    if more > 0:
        click.echo(f"... {more} more" + (f" starting with {prefix!r}" if prefix else "")
                   + " (--limit, --prefix, or export)")


@suppression.command("add")
@_log_level_option()
@click.argument("address")
@click.option("--reason", type=click.Choice(["manual", "bounced", "complained",
                                             "unsubscribed"]),
              default="manual", show_default=True,
              help="unsubscribed applies to bulk mail (with List-Unsubscribe) only.")
def suppression_add(address: str, reason: str) -> None:
    """Suppress ADDRESS: delivery leaves it out of every email (bulk only: unsubscribed)."""
    mail = _extension()
    try:
        new = mail.suppress(address, reason, source="cli")
    except InvalidMessage as exc:
        raise click.BadParameter(exc.problem, param_hint="ADDRESS") from None
    finally:
        mail.stop()
    click.echo(f"{'suppressed' if new else 'already suppressed, now'} ({reason}): {address}")


@suppression.command("remove")
@_log_level_option()
@click.argument("address")
def suppression_remove(address: str) -> None:
    """Take ADDRESS off the list (exit status 1 if it was not on it)."""
    mail = _extension()
    try:
        removed = mail.unsuppress(address)
    except InvalidMessage as exc:
        raise click.BadParameter(exc.problem, param_hint="ADDRESS") from None
    finally:
        mail.stop()
    if not removed:
        click.echo(f"not on the suppression list: {address}", err=True)
        sys.exit(1)
    click.echo(f"removed: {address}")


@suppression.command("export")
@_log_level_option()
@click.option("--output", "-o", type=click.File("w", encoding="utf-8"), default="-",
              help="Write to FILE instead of standard output.")
def suppression_export(output: Any) -> None:
    """Every entry in force as CSV: address, reason, source, created_at, expires_at (UTC)."""
    import csv

    state = _state()
    writer = csv.writer(output, lineterminator="\n")
    writer.writerow(["address", "reason", "source", "created_at", "expires_at"])
    count = 0
    for entry in state.outbox().suppressions.iterate():
        writer.writerow([entry.address, entry.reason, entry.source,
                         entry.created_at.isoformat(timespec="seconds"),
                         entry.expires_at.isoformat(timespec="seconds")
                         if entry.expires_at else ""])
        count += 1
    state.stop(5)
    click.echo(f"exported {count} address(es)", err=True)


@outbox_cli.group("templates")
def templates() -> None:
    """The app's email templates (mail.send_template())."""


@templates.command("check")
@_log_level_option()
@click.option("--template", "names", multiple=True, metavar="NAME",
              help="Only this email (repeatable; default: every one).")
@click.option("--locale", "locales", multiple=True, metavar="LOCALE",
              help="Only this locale (repeatable; default: every one).")
def templates_check(names: tuple[str, ...], locales: tuple[str, ...]) -> None:
    """Render every email × locale × preview as CI should; exit 1 on any problem.

    Undefined variables are errors. One line per problem (a rendering error, a
    missing translation, a relative URL, an <img> without alt, an HTML part over
    Gmail's 102 KB, a subject over OUTBOX_TEMPLATE_MAX_SUBJECT), then a summary.
    Exit status 0 when there is none, 1 when there is one, 2 on a usage error.
    """
    state = _state()
    try:
        chosen, chosen_locales = template_check.select(state.templates, names, locales)
    except template_check.SelectionError as exc:
        raise click.BadParameter(exc.problem, param_hint=exc.option) from None
    except TemplateError as exc:  # the app's locales cannot be found
        raise click.ClickException(exc.problem) from None
    if not chosen:
        raise click.ClickException(
            f"no email templates in the folder {state.templates.folder!r} of the app's "
            "templates (OUTBOX_TEMPLATE_FOLDER): nothing to check")
    report = template_check.check_templates(
        state.app, state.templates, names=chosen, locales=chosen_locales,
        max_subject=state.config.template_max_subject)
    for problem in report.problems:
        click.echo(str(problem))
    click.echo(report.summary())
    if report.problems:
        sys.exit(1)


@outbox_cli.command("cancel")
@_log_level_option()
@click.argument("ids", nargs=-1, type=_EmailIds("cancel", "--key KEY for every queued "
                                                 "email of a key"))
@click.option("--key", default=None, help="Every queued email of this key.")
def cancel(ids: tuple[int, ...], key: str | None) -> None:
    """Cancel queued emails by id, or every queued email of a --key (commits).

    An email already being sent is not cancelled (exit status 1 when none was).
    """
    if bool(ids) == (key is not None):
        raise click.UsageError("give email ids, or --key (not both)")
    state = _state()
    mail = _extension()
    try:
        count = mail.cancel(list(ids)) if ids else mail.cancel(key=key)
        state.db.session.commit()
    except InvalidMessage as exc:
        state.db.session.rollback()
        raise click.BadParameter(exc.problem, param_hint="--key") from None
    finally:
        state.db.session.remove()
        mail.stop()
    click.echo(f"{count} email(s) cancelled")
    if not count:
        click.echo("nothing cancelled: no queued email matched (sent, sending, or unknown)",
                   err=True)
        sys.exit(1)


#: What ``flask outbox bounce`` reads of a message (bytes): its start, where a bounce says
#: what it reports. The rest of a longer one (a returned attachment) is read and discarded.
MAX_BOUNCE_BYTES = MAX_BYTES
#: sysexits.h EX_TEMPFAIL: the MTA keeps the message and delivers it again later.
EX_TEMPFAIL = 75


@outbox_cli.command("bounce")
@_log_level_option("info")
def bounce() -> None:
    """Read one bounce message on standard input (an MTA's pipe or alias delivery).

    Exit status 0 when it was processed, and also when it is not a bounce,
    names no email of ours, is not mail at all or cannot be read (logged; any
    other status would bounce the bounce back into the mail loop, or have the
    MTA deliver a poison message again for days); 75 (EX_TEMPFAIL) only when
    the database cannot be reached (or the app does not load), so the MTA keeps
    the message and tries again. Never 1. Of a message over 1 MiB, the first
    1 MiB is read.
    """
    log = logging.getLogger(__name__)
    if logging.getLogger("flask_mail_outbox").getEffectiveLevel() > logging.DEBUG:
        # flufl.bounce says "Running detector" at INFO, 17 times a message.
        logging.getLogger("flufl.bounce").setLevel(logging.WARNING)
    raw = sys.stdin.buffer.read(MAX_BOUNCE_BYTES)
    rest = 0
    while chunk := sys.stdin.buffer.read(1024 * 1024):  # the MTA sees its whole message taken
        rest += len(chunk)
    if rest:
        log.info("flask outbox bounce: a message of %d bytes: its first %d read",
                 len(raw) + rest, MAX_BOUNCE_BYTES)
    try:
        mail = _extension()
    except Exception:  # exit 75: the MTA retries once the app loads again
        log.exception("flask outbox bounce: the app's outbox is not available; the MTA "
                      "keeps the message (exit 75)")
        sys.exit(EX_TEMPFAIL)
    try:
        events = mail.process_bounce(raw)
    except InvalidMessage as exc:
        # Not mail, or a message the reader failed on (logged at ERROR where it failed).
        log.info("flask outbox bounce: dropped: %s", exc.problem)
        return
    except (DataError, IntegrityError) as exc:
        # The message's content, not the database's state: a retry fails the same way.
        log.error("flask outbox bounce: the database refused what the message says (%s); "
                  "dropped (exit 0), since the MTA's retries would fail the same way",
                  type(exc).__name__)
        return
    except (DBAPIError, PoolTimeoutError) as exc:
        log.error("flask outbox bounce: the database cannot be reached (%s); exit 75, so the "
                  "MTA keeps the message and delivers it again later", type(exc).__name__)
        sys.exit(EX_TEMPFAIL)
    except Exception:  # a poison message (or a bug): never exit 75
        log.exception("flask outbox bounce: could not process the message, and not for the "
                      "database's state; dropped (exit 0), since the MTA's retries would "
                      "fail the same way for days; report it to flask-mail-outbox with the "
                      "message")
        return
    finally:
        mail.stop()
    for event in events:
        log.info("flask outbox bounce: %s %s%s for email %s%s", event.event_type,
                 f"({event.bounce_kind}) " if event.bounce_kind else "", event.recipient,
                 event.email_id, _verdict_said(event))
