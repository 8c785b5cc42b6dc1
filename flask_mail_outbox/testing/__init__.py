"""The test kit: commit-aware assertions, control of delivery, time and failures.

``OutboxTest(app)`` is what the pytest plugin's ``outbox`` fixture gives
(see :mod:`flask_mail_outbox.testing.pytest_plugin` and docs/guide/testing.md)::

    kit = OutboxTest(app)                     # inline: due mail goes out inside commit()
    ...                                       # the code under test sends and commits
    kit.assert_sent(to="ann@example.com", subject="Welcome")
    kit.close()                               # the real clock back

Only committed mail counts: :meth:`OutboxTest.emails` reads the app's
``outbox_email`` table on a connection of its own. Delivery, the clock,
failure injection and simulated events are :class:`OutboxControl`'s.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._control import OutboxControl, TestKitError
    from ._emails import TestEmail
    from ._kit import OutboxTest

__all__ = ["OutboxControl", "OutboxTest", "TestEmail", "TestKitError"]

# Imported on first use (PEP 562): pytest loads the plugin, a module of this
# package, in every run of a project that has the package installed.
_LAZY = {"OutboxControl": "._control", "TestKitError": "._control",
         "TestEmail": "._emails", "OutboxTest": "._kit"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value
