"""The ``outbox`` Alembic branch builds exactly the schema of ``flask_mail_outbox.core._models``.

Each database test runs on a SQLite file and on PostgreSQL (a fresh database per test,
created through ``OUTBOX_TEST_POSTGRES_URL``). Equality is checked twice: Alembic's own
``compare_metadata`` (types and server defaults included), and the database catalog of
the migrated schema against the catalog that ``metadata.create_all`` writes, which also
covers what ``compare_metadata`` skips: partial-index predicates, check constraints,
foreign-key actions, sequences.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from flask_mail_outbox.core import _models
from flask_mail_outbox.migrations import (
    BRANCH_LABEL,
    VERSIONS_DIR,
    combine_include_object,
    include_object,
)

PG_URL_VAR = "OUTBOX_TEST_POSTGRES_URL"
REPO_ROOT = Path(__file__).resolve().parent.parent
OUTBOX_TABLES = sorted(_models.TABLE_NAMES)

# The smallest env.py that runs the branch on a connection handed over by the test,
# with the test's target_metadata (whose naming convention Alembic's op.* would use).
MINIMAL_ENV_PY = """\
from alembic import context

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=context.config.attributes.get("target_metadata"),
)
with context.begin_transaction():
    context.run_migrations()
"""

# The convention Flask projects commonly put on db.metadata (example_app's included).
HOST_NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NewDatabase = Callable[[], sa.Engine]


@pytest.fixture(params=["sqlite", "postgresql"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NewDatabase]:
    """Makes empty databases of one kind: SQLite files, or fresh PostgreSQL databases.

    Every engine is disposed and every PostgreSQL database dropped afterwards.
    """
    engines: list[sa.Engine] = []
    pg_names: list[str] = []
    admin: sa.Engine | None = None
    if request.param == "postgresql":
        pg_url = os.environ.get(PG_URL_VAR)
        if not pg_url:
            pytest.skip(f"{PG_URL_VAR} not set")
        admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")

    def new() -> sa.Engine:
        if admin is None:
            url = f"sqlite:///{tmp_path / f'db{len(engines)}.sqlite'}"
        else:
            name = f"outbox_mig_{uuid.uuid4().hex[:12]}"
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
            pg_names.append(name)
            url = admin.url.set(database=name).render_as_string(hide_password=False)
        engine = sa.create_engine(url)
        engines.append(engine)
        return engine

    yield new

    for engine in engines:
        engine.dispose()
    if admin is not None:
        with admin.connect() as conn:
            for name in pg_names:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def branch_config(tmp_path: Path) -> Config:
    """An Alembic config that sees nothing but the package's ``VERSIONS_DIR``."""
    script_location = tmp_path / "alembic_env"
    script_location.mkdir()
    (script_location / "env.py").write_text(MINIMAL_ENV_PY)
    config = Config()
    config.set_main_option("script_location", str(script_location).replace("%", "%%"))
    config.set_main_option("path_separator", "newline")
    config.set_main_option("version_locations", VERSIONS_DIR.replace("%", "%%"))
    return config


def run(config: Config, engine: sa.Engine, action: Callable[[Config], None]) -> None:
    """Runs an Alembic command on one connection of ``engine``, and commits."""
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        try:
            action(config)
        finally:
            del config.attributes["connection"]


def upgrade_branch(config: Config, engine: sa.Engine) -> None:
    run(config, engine, lambda cfg: command.upgrade(cfg, f"{BRANCH_LABEL}@head"))


def compare_server_default(
    context: MigrationContext,
    inspected_column: sa.Column[Any],
    metadata_column: sa.Column[Any],
    inspected_default: str | None,
    metadata_default: Any,
    rendered_metadata_default: str | None,
) -> bool | None:
    """Alembic's server-default comparison, less one false alarm.

    On SQLite, Alembic unquotes a reflected ``'x'`` (or ``('x')``) to ``x`` but leaves
    an empty ``''`` quoted, so ``server_default=""`` (``outbox_email.subject``) always
    looks changed, even on a table that ``create_all`` made. ``catalog()`` compares the
    real DDL instead. None: Alembic decides, as without this hook.
    """
    if (
        context.dialect.name == "sqlite"
        and rendered_metadata_default == ""
        and inspected_default in ("''", "('')")
    ):
        return False
    return None


def diff_against(
    engine: sa.Engine, metadata: sa.MetaData | list[sa.MetaData], **opts: Any
) -> list[Any]:
    """What autogenerate would change to make the database match ``metadata``."""
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={"compare_type": True, "compare_server_default": compare_server_default, **opts},
        )
        # A list of MetaData works as it does for target_metadata; the stub says one.
        diff: list[Any] = compare_metadata(context, cast(Any, metadata))
    return diff


def catalog(engine: sa.Engine) -> dict[str, Any]:
    """The outbox tables as the database itself describes them."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.execute(
                sa.text(
                    "SELECT type, name, tbl_name, sql FROM sqlite_master"
                    " WHERE tbl_name IN :tables ORDER BY type, name"
                ).bindparams(sa.bindparam("tables", expanding=True)),
                {"tables": OUTBOX_TABLES},
            ).all()
            return {"sqlite_master": [tuple(row) for row in rows]}
        tables = {"tables": OUTBOX_TABLES}
        columns = conn.execute(
            sa.text(
                "SELECT table_name, ordinal_position, column_name, data_type,"
                " character_maximum_length, is_nullable, column_default"
                " FROM information_schema.columns"
                " WHERE table_schema = 'public' AND table_name = ANY(:tables)"
                " ORDER BY table_name, ordinal_position"
            ),
            tables,
        ).all()
        constraints = conn.execute(
            sa.text(
                "SELECT conrelid::regclass::text, conname, contype,"
                " pg_get_constraintdef(oid)"
                " FROM pg_constraint WHERE conrelid::regclass::text = ANY(:tables)"
                " ORDER BY 1, 2"
            ),
            tables,
        ).all()
        indexes = conn.execute(
            sa.text(
                "SELECT tablename, indexname, indexdef FROM pg_indexes"
                " WHERE schemaname = 'public' AND tablename = ANY(:tables)"
                " ORDER BY 1, 2"
            ),
            tables,
        ).all()
        sequences = conn.execute(
            sa.text(
                "SELECT sequence_name, data_type FROM information_schema.sequences"
                " WHERE sequence_schema = 'public' ORDER BY 1"
            )
        ).all()
        triggers = conn.execute(
            sa.text(
                "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
                " WHERE NOT tgisinternal AND tgrelid::regclass::text = ANY(:tables)"
                " ORDER BY 1"
            ),
            tables,
        ).all()
        functions = conn.execute(
            sa.text(
                "SELECT proname, pg_get_functiondef(p.oid) FROM pg_proc p"
                " JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'public' ORDER BY 1"
            )
        ).all()
    return {
        "columns": [tuple(row) for row in columns],
        "constraints": [tuple(row) for row in constraints],
        "indexes": [tuple(row) for row in indexes],
        "sequences": [tuple(row) for row in sequences],
        "triggers": [tuple(row) for row in triggers],
        "functions": [tuple(row) for row in functions],
    }


def index_definitions(engine: sa.Engine) -> dict[str, str]:
    """Index name -> the SQL the database keeps for it (SQLite's text, PostgreSQL's)."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).all()
        else:
            rows = conn.exec_driver_sql(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
            ).all()
    return {name: sql for name, sql in rows}


def partial_indexes() -> dict[str, str]:
    """Index name -> WHERE clause, for every partial index of the models."""
    where: dict[str, str] = {}
    for table in _models.metadata.tables.values():
        for index in table.indexes:
            sqlite_where = index.dialect_options["sqlite"]["where"]
            postgresql_where = index.dialect_options["postgresql"]["where"]
            if sqlite_where is None and postgresql_where is None:
                continue
            # The models give both dialects the same predicate; the checks below rely on it.
            assert str(sqlite_where) == str(postgresql_where), index.name
            assert index.name is not None
            where[index.name] = str(sqlite_where)
    return where


def table_names(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_table_names())


# --- the branch alone -------------------------------------------------------------------


@pytest.mark.parametrize(
    "host_convention", [None, HOST_NAMING_CONVENTION], ids=["no-convention", "host-convention"]
)
def test_upgrade_builds_the_models_schema(
    new_database: NewDatabase, branch_config: Config, host_convention: dict[str, str] | None
) -> None:
    """Whatever naming convention the host app's target_metadata has: same names."""
    if host_convention is not None:
        branch_config.attributes["target_metadata"] = sa.MetaData(naming_convention=host_convention)
    migrated = new_database()
    upgrade_branch(branch_config, migrated)

    assert table_names(migrated) >= _models.TABLE_NAMES
    assert diff_against(migrated, _models.metadata) == []

    reference = new_database()
    _models.metadata.create_all(reference)
    assert catalog(migrated) == catalog(reference)


def test_every_partial_index_has_its_predicate(
    new_database: NewDatabase, branch_config: Config
) -> None:
    migrated = new_database()
    upgrade_branch(branch_config, migrated)
    reference = new_database()
    _models.metadata.create_all(reference)

    expected = partial_indexes()
    assert len(expected) == 10  # a new partial index belongs in the list of this test
    migrated_defs = index_definitions(migrated)
    reference_defs = index_definitions(reference)
    for name, clause in expected.items():
        assert name in migrated_defs, f"partial index {name} is missing"
        definition = migrated_defs[name]
        assert " WHERE " in definition.upper(), f"{name} is not partial: {definition}"
        # SQLite keeps the statement as written; PostgreSQL re-renders the predicate
        # (casts, parentheses), so there it must equal what create_all produced.
        if migrated.dialect.name == "sqlite":
            assert definition.endswith(f"WHERE {clause}"), definition
        assert definition == reference_defs[name]


def test_foreign_key_cascades_and_status_is_checked(
    new_database: NewDatabase, branch_config: Config
) -> None:
    migrated = new_database()
    upgrade_branch(branch_config, migrated)
    with migrated.connect() as conn:
        inspector = sa.inspect(conn)
        (foreign_key,) = inspector.get_foreign_keys("outbox_attachment")
        checks = inspector.get_check_constraints("outbox_email")
    assert foreign_key["referred_table"] == "outbox_email"
    assert foreign_key["constrained_columns"] == ["email_id"]
    assert (foreign_key.get("options") or {}).get("ondelete", "").upper() == "CASCADE"
    assert [check["name"] for check in checks] == ["ck_outbox_email_status"]


def test_downgrade_to_base_removes_every_outbox_table(
    new_database: NewDatabase, branch_config: Config
) -> None:
    engine = new_database()
    upgrade_branch(branch_config, engine)
    run(branch_config, engine, lambda cfg: command.downgrade(cfg, "base"))

    assert table_names(engine) & _models.TABLE_NAMES == set()
    assert not any(name.startswith("ix_outbox_") for name in index_definitions(engine))
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            sequences = (
                conn.exec_driver_sql("SELECT sequence_name FROM information_schema.sequences")
                .scalars()
                .all()
            )
        assert sequences == []
    assert triggers_and_functions(engine) == []  # PostgreSQL keeps a function unless dropped
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM alembic_version").scalar() == 0

    # And back up again: downgrade() left nothing that gets in the way.
    upgrade_branch(branch_config, engine)
    assert diff_against(engine, _models.metadata) == []


def triggers_and_functions(engine: sa.Engine) -> list[str]:
    """The names of the triggers on the outbox tables, and of the database's own functions."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return list(conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' ORDER BY name").scalars())
        return list(conn.exec_driver_sql(
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal UNION ALL"
            " SELECT proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'public' ORDER BY 1").scalars())


def tally_matches_the_rows(engine: sa.Engine) -> dict[str, int]:
    """Asserts that the tally's totals (per status, and sent per hour) equal a GROUP BY."""
    from flask_mail_outbox.core._queries import counts

    hour = ("CAST(strftime('%s', sent_at) AS INTEGER) / 3600" if engine.dialect.name == "sqlite"
            else "CAST(floor(extract(epoch FROM sent_at) / 3600) AS bigint)")
    with engine.connect() as conn:
        real: dict[str, int] = dict(conn.exec_driver_sql(
            "SELECT status, count(*) FROM outbox_email GROUP BY status").all())
        real_hours: dict[int, int] = dict(conn.exec_driver_sql(
            f"SELECT {hour}, count(*) FROM outbox_email WHERE status = 'sent' GROUP BY 1").all())
        tally_hours = {hour_: int(n) for hour_, n in conn.exec_driver_sql(
            "SELECT sent_hour, sum(n) FROM outbox_tally WHERE status = 'sent'"
            " GROUP BY sent_hour HAVING sum(n) <> 0").all()}
        shown = counts(conn)
    assert shown == {status: real.get(status, 0) for status in shown}
    assert tally_hours == real_hours
    return shown


def test_the_tally_triggers_keep_the_totals_from_the_first_row(
    new_database: NewDatabase, branch_config: Config
) -> None:
    engine = new_database()
    upgrade_branch(branch_config, engine)
    assert len(triggers_and_functions(engine)) == (
        3 if engine.dialect.name == "sqlite" else 5)  # PostgreSQL: four and their function
    statuses = ["queued", "sending", "sent", "failed", "suppressed", "expired", "cancelled"]
    rows = []
    for i in range(70):
        at = datetime(2026, 12, 1, 0, 30) + timedelta(hours=i % 5)
        status = statuses[i % 7]
        rows.append({"status": status, "at": at, "sent_at": at if status == "sent" else None})
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_email (status, created_at, due_at, sent_at, message_id,"
                " sender, recipients, size) VALUES (:status, :at, :at, :sent_at, 'm', 's',"
                " '[]', 1)"
            ),
            rows,
        )
    shown = tally_matches_the_rows(engine)
    assert shown["sent"] == shown["cancelled"] == 10
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_email SET status = 'expired' WHERE status = 'queued'")
        conn.execute(sa.text("DELETE FROM outbox_email WHERE id % 4 = 0"))
    assert tally_matches_the_rows(engine)["expired"] > 10


def test_branch_is_one_labelled_root_that_imports_nothing_from_the_package(
    branch_config: Config,
) -> None:
    script = ScriptDirectory.from_config(branch_config)
    (base,) = script.get_bases()
    assert base == "outbox_0001"
    revision = script.get_revision(base)
    assert revision is not None and revision.branch_labels == {BRANCH_LABEL}
    assert len(script.get_heads()) == 1

    # Revisions are frozen history: a later change to the models must not change them.
    for path in Path(VERSIONS_DIR).glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported = [node.module or ""]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for module in imported:
                assert not module.startswith("flask_mail_outbox"), f"{path.name} imports {module}"


# --- include_object ------------------------------------------------------------------


def user_metadata() -> sa.MetaData:
    """A user's models: one table of their own, no outbox tables."""
    metadata = sa.MetaData()
    sa.Table(
        "account",
        metadata,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("email", sa.String(255), nullable=False, index=True),
    )
    return metadata


def test_include_object_keeps_autogenerate_off_the_outbox_tables(
    new_database: NewDatabase, branch_config: Config
) -> None:
    engine = new_database()
    upgrade_branch(branch_config, engine)
    user = user_metadata()
    user.create_all(engine)

    # Without the hook, autogenerate wants the outbox tables gone: the test can fail.
    unfiltered = diff_against(engine, user)
    assert {op[1].name for op in unfiltered if op[0] == "remove_table"} == _models.TABLE_NAMES

    assert diff_against(engine, user, include_object=include_object) == []


def test_combine_include_object_asks_the_user_hook_about_everything_else(
    new_database: NewDatabase, branch_config: Config
) -> None:
    engine = new_database()
    upgrade_branch(branch_config, engine)
    user = user_metadata()
    user.create_all(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE legacy (id INTEGER PRIMARY KEY)")

    asked: list[str | None] = []

    def skip_legacy(
        object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        asked.append(name)
        return not (type_ == "table" and name == "legacy")

    # Each hook alone leaves something to drop; combined, nothing.
    assert {
        op[1].name
        for op in diff_against(engine, user, include_object=skip_legacy)
        if op[0] == "remove_table"
    } == _models.TABLE_NAMES
    assert [
        op[1].name
        for op in diff_against(engine, user, include_object=include_object)
        if op[0] == "remove_table"
    ] == ["legacy"]
    asked.clear()
    combined = combine_include_object(skip_legacy)
    assert diff_against(engine, user, include_object=combined) == []
    assert "legacy" in asked and "account" in asked
    assert not _models.TABLE_NAMES & set(asked)  # never even asked about them

    assert combine_include_object(None) is include_object


def test_include_object_excludes_what_is_on_the_outbox_tables() -> None:
    for table in _models.metadata.tables.values():
        assert not include_object(table, table.name, "table", True, None)
        for column in table.columns:
            assert not include_object(column, column.name, "column", True, None)
        for index in table.indexes:
            assert not include_object(index, index.name, "index", True, None)
        for constraint in table.constraints:
            kind = {
                sa.ForeignKeyConstraint: "foreign_key_constraint",
                sa.UniqueConstraint: "unique_constraint",
            }.get(type(constraint), "constraint")
            assert not include_object(constraint, str(constraint.name), kind, True, None)
    for table in user_metadata().tables.values():
        assert include_object(table, table.name, "table", False, None)
        for index in table.indexes:
            assert include_object(index, str(index.name), "index", False, None)
    # A foreign key of the user's own table that points at the outbox stays the user's.
    mine = sa.MetaData()
    sa.Table("outbox_email", mine, sa.Column("id", sa.Integer(), primary_key=True))
    link = sa.Table(
        "receipt",
        mine,
        sa.Column("email_id", sa.ForeignKey("outbox_email.id")),
    )
    (foreign_key,) = link.foreign_key_constraints
    assert include_object(foreign_key, None, "foreign_key_constraint", False, None)


# --- the top-level migrations/ environment (example_app) -------------------------------


def example_app_config() -> Config:
    """The top-level migrations/alembic.ini, as Flask-Migrate loads it."""
    config = Config(str(REPO_ROOT / "migrations" / "alembic.ini"))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    return config


def test_example_env_is_two_branches_that_no_revision_merges() -> None:
    script = ScriptDirectory.from_config(example_app_config())
    outbox_base = script.get_revision("outbox_0001")
    assert outbox_base is not None
    assert Path(outbox_base.path).parent == Path(VERSIONS_DIR)
    # One head per branch: the example's and the outbox's.
    heads = script.get_heads()
    assert len(heads) == 2, heads
    assert len(script.revision_map.filter_for_lineage(heads, BRANCH_LABEL)) == 1, heads
    assert len(script.revision_map.filter_for_lineage(heads, "example")) == 1, heads
    revisions = list(script.walk_revisions())
    outbox_revisions = {rev.revision for rev in revisions
                        if Path(rev.path).parent == Path(VERSIONS_DIR)}
    example_revisions = [rev for rev in revisions
                         if Path(rev.path).parent == REPO_ROOT / "migrations" / "versions"]
    assert outbox_revisions and example_revisions
    assert [rev.revision for rev in example_revisions if rev.is_base] == ["example_0001"]
    for rev in example_revisions:
        # No merge, and no outbox revision as a parent: a release adds nothing here.
        parents = rev.down_revision if isinstance(rev.down_revision, tuple) else (
            rev.down_revision,)
        assert len(parents) == 1 and not set(parents) & outbox_revisions, rev.revision
    root = script.get_revision("example_0001")
    assert root is not None and root.dependencies == "outbox_0001"


def test_example_app_upgrade_creates_everything_and_autogenerate_proposes_nothing(
    new_database: NewDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flask import current_app

    # `python -m pytest` (scripts/run-tests) has the repository root on sys.path; a bare
    # `pytest` does not.
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from example_app import create_app
    from example_app.extensions import db, mail

    engine = new_database()
    app = create_app(
        {
            "SQLALCHEMY_DATABASE_URI": engine.url.render_as_string(hide_password=False),
            "TESTING": True,
            "OUTBOX_SWEEP_ON_STARTUP": False,
        },
        instance_path=str(tmp_path / "instance"),
    )
    try:
        with app.app_context():
            config = current_app.extensions["migrate"].migrate.get_config()
            # What `flask --app example_app db upgrade heads` (scripts/run-example) runs.
            command.upgrade(config, "heads")
            assert table_names(engine) >= _models.TABLE_NAMES | {"users", "alembic_version"}
            # Everything, the app's table included, is as the two sets of models say.
            assert diff_against(engine, [db.metadata, _models.metadata]) == []
            # What `flask --app example_app db check` runs: `db migrate` would find nothing.
            command.check(config)
            assert applied(engine) == {"example_0001"}  # outbox_0001 implied: a dependency

            # A release adds outbox_0002 (a copy of the package's folder stands in for it):
            # the same command applies it; example_0001's depends_on is no merge.
            installed = tmp_path / "installed_versions"
            installed.mkdir()
            for path in Path(VERSIONS_DIR).glob("*.py"):
                (installed / path.name).write_text(path.read_text(encoding="utf-8"))
            (installed / "outbox_0002_simulated.py").write_text(SIMULATED_OUTBOX_0002)
            config = current_app.extensions["migrate"].migrate.get_config()
            config.set_main_option("version_locations", ";".join(
                [str(REPO_ROOT / "migrations" / "versions"), str(installed).replace("%", "%%")]))
            command.upgrade(config, "heads")
            assert applied(engine) == {"example_0001", "outbox_0002"}
            assert "simulated" in columns_of(engine, "outbox_email")
            db.session.remove()
    finally:
        mail.stop(timeout=5)
        with app.app_context():
            for app_engine in db.engines.values():
                app_engine.dispose()


# --- the upgrade story of docs/migrations.md, across a second outbox revision ------------

DOCS_PAGE = REPO_ROOT / "docs" / "migrations.md"
_DOCS_BLOCK = re.compile(
    r"^<!-- recipe(?P<file>-file)?: (?P<name>[^ ]+) -->\n```[a-z]*\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)

# What a later release of the package would add to its versions folder: a column and an
# index on outbox_email, on top of outbox_0001.
SIMULATED_OUTBOX_0002 = '''\
"""outbox: a second revision, simulated by tests/test_migrations.py"""
import sqlalchemy as sa
from alembic import op

revision = "outbox_0002"
down_revision = "outbox_0001"
branch_labels = None
depends_on = None


def upgrade():
    op.add_column("outbox_email", sa.Column("simulated", sa.Integer(), nullable=True))
    op.create_index("ix_outbox_email_simulated", "outbox_email", ["simulated"])


def downgrade():
    op.drop_index("ix_outbox_email_simulated", table_name="outbox_email")
    op.drop_column("outbox_email", "simulated")
'''


def docs_recipes() -> dict[str, str]:
    """The page's recipes by name (``new-project``, ``daily``, ...), and its ``app.py``."""
    return {m.group("name"): m.group("body")
            for m in _DOCS_BLOCK.finditer(DOCS_PAGE.read_text(encoding="utf-8"))}


class UserProject:
    """A user's Flask-Migrate project in a folder, run with this environment's ``flask``.

    Its app is the page's ``app.py`` with two changes: the database URL, and the outbox's
    versions folder, which is a copy of the installed package's (``installed``), so that a
    test can add what a later release would bring.
    """

    def __init__(self, folder: Path, database_url: str) -> None:
        self.folder = folder
        self.installed = folder / "site-packages-flask_mail_outbox-migrations-versions"
        self.installed.mkdir()
        for path in Path(VERSIONS_DIR).glob("*.py"):
            (self.installed / path.name).write_text(path.read_text(encoding="utf-8"))
        app = docs_recipes()["app.py"]
        uri = 'app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///app.db"'
        package = "flask_mail_outbox.migrations:versions"
        assert uri in app and package in app, "docs/migrations.md's app.py changed"
        self.app = (app.replace(uri, f"app.config['SQLALCHEMY_DATABASE_URI'] = {database_url!r}")
                    .replace(package, str(self.installed).replace("%", "%%")))
        self.write_app()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FLASK_")}
        bin_dir = str(Path(sys.executable).parent)
        self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"

    def write_app(self, extra_columns: str = "") -> None:
        (self.folder / "app.py").write_text(self.app + extra_columns, encoding="utf-8")

    def run(self, script: str) -> str:
        """Runs ``script`` (shell commands) in the project; its output."""
        result = subprocess.run(["bash", "-e", "-x", "-c", script], cwd=self.folder,
                                env=self.env, capture_output=True, text=True, timeout=300,
                                check=False)
        assert result.returncode == 0, f"{script}\nfailed:\n{result.stdout}\n{result.stderr}"
        return result.stdout + result.stderr

    def own_revisions(self) -> dict[str, str]:
        """The project's own revision files: name -> text."""
        return {p.name: p.read_text(encoding="utf-8")
                for p in (self.folder / "migrations" / "versions").glob("*.py")}


def applied(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars())


def columns_of(engine: sa.Engine, table: str) -> set[str]:
    with engine.connect() as conn:
        return {column["name"] for column in sa.inspect(conn).get_columns(table)}


def test_a_release_with_a_new_outbox_revision_needs_no_migration_from_the_user(
    new_database: NewDatabase, tmp_path: Path
) -> None:
    engine = new_database()
    recipes = docs_recipes()
    project = UserProject(tmp_path, engine.url.render_as_string(hide_password=False))

    # A new project, as the page says; then a change of the user's models, day to day.
    project.run(recipes["new-project"])
    assert len(project.own_revisions()) == 1, "the recipe writes the initial revision only"
    (initial,) = project.own_revisions()
    project.write_app("    name: Mapped[str | None]\n")
    project.run(recipes["daily"])
    assert "name" in columns_of(engine, "user")
    mine = project.own_revisions()
    assert len(mine) == 2, "a change of the models makes one revision, no merge"
    user_head = applied(engine) - {"outbox_0001"}
    assert len(user_head) == 1 and "outbox_0001" in applied(engine)

    # The package's next release brings outbox_0002.
    (project.installed / "outbox_0002_simulated.py").write_text(SIMULATED_OUTBOX_0002)
    output = project.run(recipes["upgrade"])
    assert "Running upgrade outbox_0001 -> outbox_0002" in output
    assert applied(engine) == user_head | {"outbox_0002"}
    assert "simulated" in columns_of(engine, "outbox_email")
    assert "ix_outbox_email_simulated" in index_definitions(engine)
    # ... and the user wrote nothing for it: no merge, no revision, nothing changed.
    assert project.own_revisions() == mine
    assert "No new upgrade operations detected" in project.run("flask db check")

    # Day to day afterwards: the next revision builds on the user's head, not the outbox's.
    project.write_app("    name: Mapped[str | None]\n    nickname: Mapped[str | None]\n")
    project.run(recipes["daily"])
    (latest,) = set(project.own_revisions()) - set(mine)
    script = ScriptDirectory(str(tmp_path / "migrations"),
                             version_locations=[str(tmp_path / "migrations" / "versions"),
                                                str(project.installed)])
    newest = next(rev for rev in script.walk_revisions() if Path(rev.path).name == latest)
    assert newest.down_revision in user_head
    assert applied(engine) == {newest.revision, "outbox_0002"}
    assert {"name", "nickname"} <= columns_of(engine, "user")
    assert initial in project.own_revisions()
