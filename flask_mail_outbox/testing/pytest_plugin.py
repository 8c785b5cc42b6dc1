"""The outbox's pytest plugin: the ``outbox`` and ``outbox_manual`` fixtures.

Registered through the ``pytest11`` entry point, so it loads in every pytest
run where the package is installed; it stays inert until a test asks for
one of its fixtures. Importing it imports neither Flask nor the package (the
fixtures import the kit when they run), and starts nothing.

- ``outbox``: an :class:`~flask_mail_outbox.testing.OutboxTest` of the app
  your own ``app`` fixture returns (as pytest-flask takes it), in ``inline``
  mode (due mail is delivered inside ``commit()``), or in the mode of the
  test's ``@pytest.mark.outbox(mode="manual")``.
- ``outbox_manual``: the same in ``manual`` mode (nothing goes out until
  ``outbox_manual.deliver()``).

Each is closed at the end of its test (the real clock is back). See
docs/guide/testing.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from flask_mail_outbox.testing import OutboxTest

#: The modes a test may ask for.
MODES = ("inline", "manual")

_MARKER = ("outbox(mode='inline'): how the flask-mail-outbox `outbox` fixture delivers: "
           "'inline' (inside commit(), the default) or 'manual' (only on outbox.deliver())")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``outbox`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line("markers", _MARKER)


def _mode_of(request: pytest.FixtureRequest, default: str) -> str:
    marker = request.node.get_closest_marker("outbox")
    if marker is None:
        return default
    if marker.args or set(marker.kwargs) - {"mode"}:
        pytest.fail(f"@pytest.mark.outbox takes only mode=... (one of {', '.join(MODES)}); "
                    f"got args {marker.args!r} and kwargs {marker.kwargs!r}", pytrace=False)
    mode = marker.kwargs.get("mode", default)
    if mode not in MODES:
        pytest.fail(f"@pytest.mark.outbox(mode={mode!r}): mode must be one of "
                    f"{', '.join(repr(m) for m in MODES)}", pytrace=False)
    return str(mode)


def _kit(request: pytest.FixtureRequest, fixture: str, mode: str) -> Iterator[OutboxTest]:
    try:
        app = request.getfixturevalue("app")
    except pytest.FixtureLookupError:
        pytest.fail(
            f"the `{fixture}` fixture (flask-mail-outbox) needs an `app` fixture that returns "
            "your Flask app, as pytest-flask does: define one in conftest.py, for example\n\n"
            "    @pytest.fixture\n"
            "    def app(tmp_path):\n"
            "        app = create_app({\"TESTING\": True, \"SQLALCHEMY_DATABASE_URI\": "
            "f\"sqlite:///{tmp_path}/test.db\"})\n"
            "        with app.app_context():\n"
            "            db.create_all()\n"
            "            mail.create_all()\n"
            "        yield app\n", pytrace=False)
    from flask import Flask

    from flask_mail_outbox.testing import OutboxTest

    if not isinstance(app, Flask):
        pytest.fail(f"the `{fixture}` fixture (flask-mail-outbox) takes your `app` fixture's "
                    f"Flask app, and it returned a {type(app).__name__}: make `app` return "
                    "(or yield) the Flask app that registers OutboxMail", pytrace=False)
    from flask_mail_outbox.testing import TestKitError

    try:
        kit = OutboxTest(app, mode=mode, label=fixture)
    except TestKitError as exc:
        # A set-up the kit cannot work with (a real transport, a second kit): said as the
        # fixture's error, so the user sees which fixture and what to change.
        pytest.fail(f"the `{fixture}` fixture (flask-mail-outbox): "
                    f"{str(exc).removeprefix(f'{fixture}(app): ')}", pytrace=False)
    try:
        yield kit
    finally:
        kit.close()


@pytest.fixture
def outbox(request: pytest.FixtureRequest) -> Iterator[OutboxTest]:
    """The outbox of your ``app`` fixture's app, in inline mode (or the marker's)."""
    yield from _kit(request, "outbox", _mode_of(request, "inline"))


@pytest.fixture
def outbox_manual(request: pytest.FixtureRequest) -> Iterator[OutboxTest]:
    """The outbox of your ``app`` fixture's app in manual mode: nothing goes out until
    ``outbox_manual.deliver()``."""
    marker = request.node.get_closest_marker("outbox")
    if marker is not None and marker.kwargs.get("mode", "manual") != "manual":
        pytest.fail(f"the outbox_manual fixture is manual mode; the test's "
                    f"@pytest.mark.outbox(mode={marker.kwargs['mode']!r}) contradicts it: use the "
                    "`outbox` fixture with that marker instead", pytrace=False)
    yield from _kit(request, "outbox_manual", "manual")
