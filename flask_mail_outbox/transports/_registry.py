"""From a transport's name to its class, and from its settings to an instance: one table.

``OUTBOX_TRANSPORT`` and each ``OUTBOX_TRANSPORTS`` entry name a built-in
(:data:`BUILTIN`) or a ``"package.module:Class"``; :func:`transport_class`
resolves the name once, at ``init_app``, and :func:`build` makes the
instance from its :class:`TransportSettings`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .._errors import ConfigError
from .._providers import PROVIDERS
from ._base import Transport
from ._mailbox import MailboxTransport
from ._settings import TransportSettings
from ._simple import ConsoleTransport, FileTransport, MemoryTransport, NullTransport
from ._smtp import SMTPTransport

#: The built-in transports by name.
BUILTIN: dict[str, type[Transport]] = {
    "smtp": SMTPTransport,
    "console": ConsoleTransport,
    "file": FileTransport,
    "memory": MemoryTransport,
    "null": NullTransport,
    "mailbox": MailboxTransport,
}


#: The provider API transports by name, imported on first use (``ses`` needs an extra):
#: ``_providers.PROVIDERS``, the one table of providers.
API_KINDS: dict[str, str] = {kind: p.transport for kind, p in PROVIDERS.items()}
#: What a kind needs installed beyond the package's own dependencies.
_EXTRAS = {kind: p.extra for kind, p in PROVIDERS.items() if p.extra is not None}


def is_builtin(name: object) -> bool:
    """Whether ``name`` is one of the transports that come with the package."""
    return name in BUILTIN or name in API_KINDS


def transport_class(name: Any, key: str) -> type[Transport]:
    """The class ``name`` stands for; :class:`ConfigError` naming ``key`` when there is none."""
    if not isinstance(name, str) or not name:
        raise ConfigError(key, f"expected a transport name, got {name!r}")
    builtin = BUILTIN.get(name)
    if builtin is not None:
        return builtin
    if name in API_KINDS:
        module, _, attr = API_KINDS[name].partition(":")
        try:
            found: type[Transport] = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            extra = _EXTRAS.get(name)
            hint = f" (pip install 'flask-mail-outbox[{extra}]')" if extra else ""
            raise ConfigError(key, f"the {name} transport cannot be imported: {exc}{hint}") \
                from exc
        return found
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(key, f"{name!r} is neither one of {', '.join(BUILTIN)} nor "
                               "'package.module:Class'")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(key, f"cannot import {name!r}: {exc}") from exc
    if not isinstance(found, type) or not issubclass(found, Transport):
        raise ConfigError(key, f"{name!r} must be a subclass of "
                               "flask_mail_outbox.transports.Transport")
    if _needs_arguments(found):
        raise ConfigError(key, f"{name!r} cannot be built: its __init__ takes arguments and it "
                               "has no classmethod from_settings(cls, settings) to pass them "
                               "(flask_mail_outbox.transports.TransportSettings: .options, "
                               ".smtp, .file_path, .concurrency)")
    return found


def build(cls: type[Transport], settings: TransportSettings) -> Transport:
    """An instance of ``cls`` for ``settings`` (:meth:`Transport.from_settings`)."""
    return cls.from_settings(settings)


def _needs_arguments(cls: type[Transport]) -> bool:
    """Whether ``cls()`` cannot work: ``__init__`` requires arguments, no ``from_settings``."""
    if _builds_itself(cls) or cls.__init__ is Transport.__init__:
        return False
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return any(p.default is p.empty and p.kind is not p.VAR_POSITIONAL
               and p.kind is not p.VAR_KEYWORD for p in parameters)


def _builds_itself(cls: type[Transport]) -> bool:
    """Whether ``cls`` or a base below :class:`Transport` defines ``from_settings``."""
    return cls.from_settings.__func__ is not Transport.from_settings.__func__  # type: ignore[attr-defined]
