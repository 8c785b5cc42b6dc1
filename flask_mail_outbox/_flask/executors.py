"""The Flask side of ``OUTBOX_EXECUTOR``: which app a task delivers for, and its two tasks' bodies.

An app whose ``OUTBOX_EXECUTOR`` names a task queue publishes after each
commit (see ``core/_executor.py``); the task queue's workers import the same
app (its factory) and run :func:`deliver_task` and :func:`sweep_task`, which
the engines' modules (``flask_mail_outbox.contrib.celery``, ``.rq``,
``.dramatiq``) wrap as their tasks. Those modules are imported by name here
(:func:`load`): this layer knows no engine.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app, has_app_context

from .._errors import ConfigError
from ..core._internal import BatchReport, Executor, deliver_ids, run_sweep
from .state import EXTENSION_KEY

if TYPE_CHECKING:
    from .state import AppState

logger = logging.getLogger(__name__)

#: Each engine's module, and the extra that installs the engine.
MODULES = {
    "celery": "flask_mail_outbox.contrib.celery",
    "rq": "flask_mail_outbox.contrib.rq",
    "dramatiq": "flask_mail_outbox.contrib.dramatiq",
}

#: The apps of this process whose OUTBOX_EXECUTOR is a task queue: a task finds its app here.
_apps: weakref.WeakSet[Flask] = weakref.WeakSet()
_lock = threading.Lock()
#: Held while FLASK_APP is loaded: the first tasks of a worker's threads load it once.
_load_lock = threading.Lock()
#: The apps this module loaded itself (FLASK_APP), kept for the process's lifetime.
_loaded: list[Flask] = []


def load(app: Flask, name: str) -> Executor | None:
    """The publisher of executor ``name`` for ``app`` (None: the dispatcher); registers ``app``.

    Raises :class:`ConfigError` naming ``OUTBOX_EXECUTOR`` when the engine's
    extra is not installed, or the engine's module refuses the configuration.
    """
    if name == "dispatcher":
        return None
    module = engine_module(name)
    with _lock:
        _apps.add(app)
    publisher: Executor = module.publisher(app)
    return publisher


def engine_module(name: str) -> Any:
    """The module of engine ``name``; :class:`ConfigError` when its extra is missing."""
    try:
        return importlib.import_module(MODULES[name])
    except KeyError:
        raise ConfigError("OUTBOX_EXECUTOR", f"unknown executor {name!r}") from None
    except ImportError as exc:
        raise ConfigError(
            "OUTBOX_EXECUTOR",
            f"{name!r} needs {name} installed: pip install 'flask-mail-outbox[{name}]' "
            f"({exc})") from None


def task_app(app: Flask | None = None) -> Flask:
    """The app a task delivers for: ``app``, the current one, or this process's only one.

    :class:`ConfigError` naming ``OUTBOX_EXECUTOR`` when the worker process
    created no app with a task-queue executor (its module must import the
    app, or call the factory), or several and no app context says which.
    """
    if app is not None:
        return app
    if has_app_context() and EXTENSION_KEY in current_app.extensions:
        return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]
    with _lock:
        apps = list(_apps)
    if not apps:
        # One thread loads it (as `flask` finds it: FLASK_APP, or app.py / wsgi.py here);
        # the others of a worker's first tasks wait for that app rather than make more.
        with _load_lock:
            with _lock:
                apps = list(_apps)
            if not apps:
                _load_flask_app()
                with _lock:
                    apps = list(_apps)
    if len(apps) == 1:
        return apps[0]
    if not apps:
        raise ConfigError(
            "OUTBOX_EXECUTOR",
            "this worker process has no Flask app whose OUTBOX_EXECUTOR names a task queue: "
            "set FLASK_APP for the worker (as for `flask`), or make the worker's module "
            "create the app (call its factory) before tasks run; see docs/executors/index.md")
    raise ConfigError(
        "OUTBOX_EXECUTOR",
        f"this worker process has {len(apps)} Flask apps with a task-queue executor "
        f"({', '.join(sorted(a.import_name for a in apps))}): run the tasks inside the app's "
        "context (app.app_context()), or pass app= to the task functions")


def _load_flask_app() -> None:
    """Load the app the way the ``flask`` command does (``FLASK_APP``, else app.py/wsgi.py).

    Its ``init_app`` registers it here. Nothing found is not an error here:
    the caller says what to do.
    """
    from flask.cli import NoAppException, ScriptInfo

    try:
        # ScriptInfo reads no environment: FLASK_APP is the `flask` command's option's.
        app = ScriptInfo(app_import_path=os.environ.get("FLASK_APP"),
                         set_debug_flag=False).load_app()
    except NoAppException as exc:
        logger.debug("No Flask app found the way `flask` finds one: %s", exc)
        return
    # The registry holds apps weakly (an app a program drops is not kept alive by
    # it); nothing else holds this one, made here for the worker's lifetime.
    with _lock:
        _loaded.append(app)


def _state(app: Flask) -> AppState:
    state: AppState = app.extensions[EXTENSION_KEY]
    return state


def summary(report: BatchReport) -> dict[str, int]:
    """A task's result: counts only (a result backend stores no id lists or errors)."""
    return {"sent": len(report.sent), "failed": len(report.failed),
            "retry": len(report.transient), "suppressed": len(report.suppressed),
            "expired": len(report.expired), "cancelled": len(report.cancelled),
            "paused": len(report.paused), "not_claimed": len(report.not_claimed)}


def deliver_task(ids: Sequence[int], *, app: Flask | None = None,
                 until_claimed: bool = False) -> dict[str, int]:
    """The deliver task's body: claim ``ids``, deliver, record (see ``core/_executor.py``).

    Never raises for a delivery error (the backoff sets the next due time and
    the sweep task publishes the email again); raises :class:`ConfigError`
    for a worker set up wrong, and ``TypeError`` for ids that are not integers.
    ``until_claimed``: return once the ids are claimed (an engine that runs one
    task at a time per process); the counts then have ``claimed`` too.
    """
    if isinstance(ids, (str, bytes)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"flask_mail_outbox.deliver: ids must be a list of integers, "
                        f"got {ids!r:.200}")
    target = task_app(app)
    with target.app_context():
        report = deliver_ids(_state(target).outbox().worker, ids, until_claimed=until_claimed)
    counts = summary(report)
    if until_claimed:
        counts["claimed"] = len(report.claimed)
    return counts


def sweep_task(*, app: Flask | None = None) -> dict[str, int]:
    """The periodic sweep task's body: publish what is due (retries, ``send_after``,
    expired leases, lost doorbells) to the task queue; counts of what it did.

    Raises when the database cannot be read (the scheduler runs it again).
    """
    target = task_app(app)
    with target.app_context():
        report = run_sweep(_state(target).outbox(), kind="periodic")
    return {"published": report.requeued, "scanned": report.scanned,
            "not_published": report.skipped}


__all__ = ["MODULES", "deliver_task", "engine_module", "load", "summary", "sweep_task",
           "task_app"]
