"""The pytest plugin (``flask_mail_outbox.testing.pytest_plugin``), run on small user projects
with pytester: the fixtures take the project's own ``app`` fixture, the marker, the errors of
bad use, isolation under pytest-xdist, and a project without the outbox left alone.

The plugin reaches a run through the installed ``pytest11`` entry point; where this
checkout's entry point is not installed in the environment yet (a branch before
``pip install -e .``), the runs name it with ``-p`` instead. That the entry point itself
is right is tested on its own, with a distribution declaring exactly pyproject's line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import require_postgres

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
MODULE = "flask_mail_outbox.testing.pytest_plugin"


def plugin_args() -> list[str]:
    """``-p`` the plugin unless the environment's entry point already loads it."""
    installed = any(ep.value == MODULE for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", MODULE]


# A user's project as the testing guide shows it: an app factory and an `app` fixture on a
# SQLite file of the test's own.
CONFTEST = '''
import pytest
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy

from flask_mail_outbox import Message, OutboxMail

db = SQLAlchemy()
mail = OutboxMail()


def create_app(config):
    app = Flask(__name__)
    app.config.update(MAIL_DEFAULT_SENDER="noreply@example.com", **config)
    db.init_app(app)
    mail.init_app(app)

    @app.post("/signup")
    def signup():
        mail.send(Message("Welcome", recipients=[request.form["email"]], body="Hi!"))
        if request.form.get("fail"):
            db.session.rollback()
            return "no", 400
        db.session.commit()
        return "ok"

    return app


@pytest.fixture
def app(tmp_path):
    app = create_app({"TESTING": True, "OUTBOX_RUN_SCHEDULER": False,
                      "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/test.db"})
    with app.app_context():
        db.create_all()
        mail.create_all()
    yield app
    mail.stop()
'''


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider",
                                         "-p", "no:randomly", *args, timeout=120)


def test_the_outbox_fixture_takes_the_projects_app(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_signup='''
        def test_signup_sends_a_welcome_email(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            [email] = outbox.assert_sent(subject="Welcome", to="ann@example.com")
            assert email.text == "Hi!"


        def test_a_failed_signup_sends_nothing(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com", "fail": "1"})
            outbox.assert_not_sent(to="ann@example.com")
            assert outbox.emails() == []


        def test_a_failed_assertion_lists_what_was_sent(app, outbox):
            app.test_client().post("/signup", data={"email": "bob@example.com"})
            outbox.assert_sent(to="ann@example.com")
    ''')
    result = run(pytester, "--strict-markers")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        ("*AssertionError: assert_sent(to='ann@example.com'): expected a sent email matching, "
         "found none."),
        "*The outbox has 1 committed email(s):",
        "*id*status*to*subject*template",
        "*1*sent*bob@example.com*Welcome*-",
    ])


def test_without_an_app_fixture_the_error_says_what_to_define(pytester: pytest.Pytester
                                                               ) -> None:
    pytester.makepyfile(test_no_app='''
        def test_uses_the_outbox(outbox):
            pass


        def test_uses_the_manual_outbox(outbox_manual):
            pass
    ''')
    result = run(pytester)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines([
        ("*the `outbox` fixture (flask-mail-outbox) needs an `app` fixture that returns your "
         "Flask app, as pytest-flask does: define one in conftest.py, for example"),
        "*the `outbox_manual` fixture (flask-mail-outbox) needs an `app` fixture*",
    ])


def test_an_app_fixture_that_is_no_flask_app_is_named(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_not_flask='''
        import pytest


        @pytest.fixture
        def app():
            return {"not": "a Flask app"}


        def test_uses_the_outbox(outbox):
            pass
    ''')
    result = run(pytester)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        ("*the `outbox` fixture (flask-mail-outbox) takes your `app` fixture's Flask app, and "
         "it returned a dict: make `app` return (or yield) the Flask app that registers "
         "OutboxMail")])


def test_bad_set_up_and_bad_use_name_the_fixture(pytester: pytest.Pytester) -> None:
    """A real transport in tests and a clock moved while a delivery thread runs: each error
    names the fixture the test used (not the kit's inner class) and what to do."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_bad_use='''
        import pytest
        from conftest import create_app


        @pytest.fixture
        def app(tmp_path):  # no TESTING: the SMTP transport, as in production
            return create_app({"OUTBOX_RUN_SCHEDULER": False,
                               "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path}/t.db"})


        def test_real_transport(outbox):
            pass
    ''', test_thread='''
        def test_advance_while_a_worker_runs(app, outbox_manual):
            worker = app.extensions["mail_outbox"].outbox().worker
            worker.hand_ticked = False
            worker.start()  # a delivery thread started outside the kit
            try:
                outbox_manual.advance(60)
            finally:
                worker.stop(5)
    ''')
    result = run(pytester)
    result.assert_outcomes(errors=1, failed=1)
    result.stdout.fnmatch_lines_random([
        ("*the `outbox` fixture (flask-mail-outbox): a real transport 'smtp' is configured*"
         "set TESTING = True*"),
        "*TestKitError: outbox_manual.advance(60): a delivery thread is running*",
    ])


def test_the_marker_is_registered_and_checked(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_marker='''
        import pytest


        @pytest.mark.outbox(mode="fast")
        def test_bad_mode(outbox):
            pass


        @pytest.mark.outbox("manual")
        def test_positional(outbox):
            pass


        @pytest.mark.outbox(mode="inline")
        def test_contradicts_manual(outbox_manual):
            pass


        @pytest.mark.outbox(mode="inline")
        def test_inline(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox.assert_sent(count=1)


        @pytest.mark.outbox(mode="manual")
        def test_manual(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox.assert_enqueued(to="ann@example.com")
            assert outbox.deliver() == 1
            outbox.assert_sent(to="ann@example.com")


        def test_manual_fixture(app, outbox_manual):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox_manual.assert_not_sent()
            outbox_manual.deliver()
            outbox_manual.assert_sent(count=1)


        def test_unmarked_is_inline(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox.assert_sent(count=1)
    ''')
    result = run(pytester, "--strict-markers")
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines_random([
        "*@pytest.mark.outbox(mode='fast'): mode must be one of 'inline', 'manual'",
        "*@pytest.mark.outbox takes only mode=... (one of inline, manual); got args ('manual',)*",
        ("*the outbox_manual fixture is manual mode; the test's "
         "@pytest.mark.outbox(mode='inline') contradicts it*"),
    ])
    markers = run(pytester, "--markers")
    markers.stdout.fnmatch_lines([("@pytest.mark.outbox(mode='inline'): how the "
                                   "flask-mail-outbox `outbox` fixture delivers*")])


def test_a_project_without_the_outbox_is_left_alone(pytester: pytest.Pytester) -> None:
    # No Flask app, and fixtures of its own named like ours: the plugin changes nothing.
    pytester.makeconftest('''
        import threading

        import pytest

        THREADS = threading.active_count()


        @pytest.fixture
        def outbox():
            return ["their own"]
    ''')
    pytester.makepyfile(test_plain='''
        import sys
        import threading

        from conftest import THREADS


        def test_their_own_outbox_fixture_wins(outbox):
            assert outbox == ["their own"]


        def test_nothing_was_started_nor_an_app_made():
            assert threading.active_count() == THREADS == 1
            assert "flask_mail_outbox.testing.pytest_plugin" in sys.modules
            from flask_mail_outbox._flask.state import all_states
            assert len(all_states) == 0
    ''')
    run(pytester, "--strict-markers").assert_outcomes(passed=2)


def test_the_fixtures_close_what_they_started(pytester: pytest.Pytester) -> None:
    # One app for the session: each test finds it as it was before the kit took it over.
    pytester.makeconftest(CONFTEST.replace("@pytest.fixture\ndef app(tmp_path):",
                                           "@pytest.fixture(scope='session')\n"
                                           "def app(tmp_path_factory):\n"
                                           "    tmp_path = tmp_path_factory.mktemp('db')"))
    pytester.makepyfile(test_clock='''
        from datetime import timedelta

        from conftest import db, mail
        from flask_mail_outbox import Message


        def test_moves_the_clock(app, outbox_manual):
            outbox_manual.advance(timedelta(hours=2))
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox_manual.assert_enqueued(count=1)


        def test_the_next_test_gets_the_app(app, outbox):
            outbox.assert_enqueued(count=1)  # the last test's, which nothing delivered
            app.test_client().post("/signup", data={"email": "bob@example.com"})
            outbox.assert_sent(to="bob@example.com")


        def test_without_the_kit_the_app_is_as_before(app):
            assert app.extensions["mail_outbox"].clock is None
            with app.app_context():
                mail.send(Message("Later", recipients=["cat@example.com"], body="x"))
                db.session.commit()  # TESTING delivers inside the commit
                statuses = db.session.execute(
                    db.text("SELECT status FROM outbox_email ORDER BY id")).scalars().all()
            assert statuses == ["queued", "sent", "sent"]
    ''')
    run(pytester).assert_outcomes(passed=3)


def test_isolated_under_xdist(pytester: pytest.Pytester) -> None:
    # Each test's app has a SQLite file of its own (tmp_path): two workers never see each
    # other's mail, whatever runs where.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_many='''
        import os
        import pytest


        @pytest.mark.parametrize("n", range(8))
        def test_each_sees_only_its_own(app, outbox, n):
            app.test_client().post("/signup", data={"email": f"user{n}@example.com"})
            [email] = outbox.assert_sent(count=1)
            assert email.recipients == (f"user{n}@example.com",)
            assert os.environ["PYTEST_XDIST_WORKER"] in ("gw0", "gw1")  # run by a worker
    ''')
    result = run(pytester, "-p", "xdist", "-n", "2")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(["*2 workers*"])


def documented_postgres_fixtures() -> str:
    """The testing guide's PostgreSQL fixtures (one database per xdist worker), as written."""
    text = (ROOT / "docs" / "guide" / "testing.md").read_text(encoding="utf-8")
    section = text[text.index("- **PostgreSQL**"):]
    return section[section.index("```python\n") + 10:section.index("\n```\n")]


def test_isolated_under_xdist_with_a_postgresql_database_per_worker(
        pytester: pytest.Pytester) -> None:
    url = require_postgres()
    fixtures = documented_postgres_fixtures()
    assert 'ADMIN_URL = "postgresql+psycopg://postgres@localhost/postgres"' in fixtures
    # The project's conftest: the guide's app factory, then its PostgreSQL fixtures on the
    # server of this test run.
    pytester.makeconftest(CONFTEST.split("@pytest.fixture")[0] + fixtures.replace(
        '"postgresql+psycopg://postgres@localhost/postgres"', repr(url)))
    pytester.makepyfile(test_many='''
        import pytest


        @pytest.mark.parametrize("n", range(6))
        def test_each_sees_only_its_own(app, outbox, n):
            app.test_client().post("/signup", data={"email": f"user{n}@example.com"})
            [email] = outbox.assert_sent(count=1)
            assert email.recipients == (f"user{n}@example.com",)
    ''')
    result = run(pytester, "-p", "xdist", "-n", "2")
    result.assert_outcomes(passed=6)


def test_the_entry_point_loads_the_plugin(pytester: pytest.Pytester, tmp_path: Path) -> None:
    # A distribution declaring exactly pyproject's pytest11 line, on the path of a run given
    # no -p: the fixtures come from the entry point.
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pytest11 = declared["project"]["entry-points"]["pytest11"]
    assert pytest11 == {"flask_mail_outbox": MODULE}
    dist = tmp_path / "site" / "flask_mail_outbox_entry-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flask-mail-outbox-entry\n"
                                   "Version: 0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{name} = {value}\n" for name, value in pytest11.items()),
        encoding="utf-8")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_entry='''
        def test_signup(app, outbox):
            app.test_client().post("/signup", data={"email": "ann@example.com"})
            outbox.assert_sent(to="ann@example.com")
    ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "site"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--strict-markers", str(pytester.path)],
        cwd=pytester.path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_importing_the_plugin_starts_nothing() -> None:
    code = textwrap.dedent(f'''
        import sys, threading
        import {MODULE}
        assert threading.active_count() == 1
        from flask_mail_outbox._flask.state import all_states
        assert len(all_states) == 0  # no app registered, no core
    ''')
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_loading_the_plugin_imports_neither_flask_nor_the_package() -> None:
    """pytest loads the plugin in every run of a project that has the package installed.

    Importing it must cost nothing but its own module: not Flask, not SQLAlchemy,
    not the package's message building or core (about 0.6 s before the package's
    names became lazy).
    """
    probe = ("import sys, flask_mail_outbox.testing.pytest_plugin; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('flask', 'sqlalchemy', 'flask_sqlalchemy', 'jinja2', 'email_validator') "
             "or m.startswith('flask_mail_outbox.') and m not in "
             "('flask_mail_outbox._errors', 'flask_mail_outbox.testing', "
             "'flask_mail_outbox.testing.pytest_plugin')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout
