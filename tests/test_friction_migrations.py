"""From ``mail.create_all()`` to migrations, and no revision of a user's in the package.

A real Flask-Migrate project (docs/migrations.md's ``app.py``) run with this
environment's ``flask``, on SQLite and PostgreSQL. The package is imported from
this checkout (as an editable install is), so a revision Alembic put into the
package's ``versions`` folder would land in the checkout: the tests compare that
folder before and after.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_mail_outbox.migrations import VERSIONS_DIR

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PAGE = REPO / "docs" / "migrations.md"
_BLOCK = re.compile(r"<!-- (?P<kind>recipe|recipe-file): (?P<name>[\w.-]+) -->\n"
                    r"```\w+\n(?P<body>.*?)```", re.DOTALL)


def docs_block(kind: str, name: str) -> str:
    [body] = [m.group("body") for m in _BLOCK.finditer(PAGE.read_text(encoding="utf-8"))
              if (m.group("kind"), m.group("name")) == (kind, name)]
    return body


def package_folder() -> dict[str, bytes]:
    """The package's versions folder: every file (``__pycache__`` aside) and its bytes."""
    return {p.name: p.read_bytes() for p in Path(VERSIONS_DIR).iterdir() if p.is_file()}


def clear_project_tables(url: str) -> None:
    """PostgreSQL: the session's shared database keeps no table of the docs' project."""
    if sa.make_url(url).get_backend_name() != "postgresql":
        return
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql('DROP TABLE IF EXISTS "user"')
            conn.exec_driver_sql("DROP TABLE IF EXISTS alembic_version")
    finally:
        engine.dispose()


class Project:
    """docs/migrations.md's ``app.py`` in a folder, on ``url``; ``run`` runs shell lines."""

    def __init__(self, folder: Path, url: str) -> None:
        self.folder = folder
        app = docs_block("recipe-file", "app.py")
        uri = 'app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///app.db"'
        assert uri in app, "docs/migrations.md's app.py changed"
        (folder / "app.py").write_text(
            app.replace(uri, f"app.config['SQLALCHEMY_DATABASE_URI'] = {url!r}"),
            encoding="utf-8")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FLASK_")}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.env["PYTHONPATH"] = f"{REPO}{os.pathsep}{folder}"
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-e", "-x", "-c", script], cwd=self.folder,
                              env=self.env, capture_output=True, text=True, timeout=300,
                              check=False)

    def ok(self, script: str) -> str:
        result = self.run(script)
        assert result.returncode == 0, f"{script}\nfailed:\n{result.stdout}\n{result.stderr}"
        return result.stdout + result.stderr

    def own_revisions(self) -> set[str]:
        return {p.name for p in (self.folder / "migrations" / "versions").glob("*.py")}


@pytest.fixture
def project(db_url: str, tmp_path: Path) -> Iterator[Project]:
    clear_project_tables(db_url)
    before = package_folder()
    yield Project(tmp_path, db_url)
    # Whatever a failing test left in the checkout's package goes, after it was seen.
    for name in set(package_folder()) - set(before):
        (Path(VERSIONS_DIR) / name).unlink()
    clear_project_tables(db_url)


def test_a_database_made_by_create_all_moves_to_migrations(project: Project,
                                                          db_url: str) -> None:
    project.ok('python -c "from app import app, db, mail\n'
               'with app.app_context():\n    db.create_all()\n    mail.create_all()"')
    # What the issue met: upgrading a database create_all() made fails.
    failed = project.run("flask db init && flask db upgrade outbox@head")
    assert failed.returncode != 0 and "already exists" in failed.stdout + failed.stderr
    project.ok("rm -rf migrations")

    output = project.ok(docs_block("recipe", "from-create-all"))
    assert "No new upgrade operations detected" in output
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            applied = set(conn.exec_driver_sql("SELECT version_num FROM alembic_version")
                          .scalars())
        assert "outbox_0001" in applied and len(applied) == 2
        # Day to day afterwards, as the page says.
        (project.folder / "app.py").write_text(
            (project.folder / "app.py").read_text(encoding="utf-8")
            + "    name: Mapped[str | None]\n", encoding="utf-8")
        project.ok(docs_block("recipe", "daily"))
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("user")}
        assert "name" in columns
    finally:
        engine.dispose()
    assert len(project.own_revisions()) == 2


def test_a_merge_or_a_revision_on_the_outbox_branch_never_lands_in_the_package(
        project: Project) -> None:
    before = package_folder()
    project.ok(docs_block("recipe", "new-project"))
    mine = project.own_revisions()
    for command in ('flask db merge outbox@head app@head -m "merge"',
                    'flask db revision --head outbox@head -m "mine"'):
        result = project.run(command)
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert "flask-mail-outbox's own folder" in output and "it was deleted" in output
        assert "--head app@head" in output
        assert package_folder() == before, f"{command} wrote into the package"
        assert project.own_revisions() == mine
    # A revision of the user's own branch is written as ever, where it belongs.
    project.ok('flask db revision --head app@head -m "ours"')
    assert len(project.own_revisions()) == len(mine) + 1
    assert package_folder() == before


def test_the_guard_is_registered_on_a_migrate_set_up_before_the_outbox(tmp_path: Path) -> None:
    from flask import Flask
    from flask_migrate import Migrate
    from flask_sqlalchemy import SQLAlchemy

    from flask_mail_outbox import OutboxMail
    from flask_mail_outbox.migrations import guard_package_versions

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'a.db'}"
    db = SQLAlchemy(app)
    migrate = Migrate(app, db)
    OutboxMail(app)
    assert migrate.configure_callbacks == [guard_package_versions]
    # A second app on the same Migrate object does not add it twice.
    other = Flask("other")
    other.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'b.db'}"
    migrate.init_app(other, SQLAlchemy(other))
    OutboxMail(other)
    assert migrate.configure_callbacks == [guard_package_versions]
