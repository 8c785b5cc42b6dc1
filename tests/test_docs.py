"""The docs site is tested: it builds clean, its examples run, its recipes work.

- The site builds with ``sphinx-build -W --keep-going -b html docs <tmp>``: any warning
  (a broken link or anchor, a bad directive, an autodoc import error) fails.
- The configuration reference (docs/configuration.md, rendered by docs/_ext/) describes
  exactly the keys of ``flask_mail_outbox.core._config._DEFAULTS``, both ways.
- Every public name (``flask_mail_outbox.__all__``) is documented on docs/api.md.
- Every Python block marked ``<!-- runnable -->`` on a page runs, in a fresh interpreter
  in an empty temporary folder; ``<!-- runnable: pytest -->`` blocks run as a test module.
- The migration recipes of docs/migrations.md run exactly as written (the commands parsed
  from the page, with the app file the page shows), in a temporary folder, on SQLite, with
  this environment's ``flask`` (tests/test_migrations.py runs them on both databases,
  across a simulated second outbox revision).

Sphinx and myst-parser come with the ``test`` extra; when they are missing these tests
fail (they never skip).
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent

# A marker comment, then a fenced block: the block's info string and its text.
_MARKED_BLOCK = re.compile(
    r"^<!-- (?P<marker>[a-z-]+)(?:: (?P<arg>[^ ]+))? -->\n"
    r"```(?P<info>[a-z]*)\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


def marked_blocks(page: Path, marker: str) -> list[tuple[int, str | None, str]]:
    """``(line, argument, text)`` of every block after ``<!-- marker[: argument] -->``."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group("arg"), m.group("body"))
            for m in _MARKED_BLOCK.finditer(text) if m.group("marker") == marker]


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def clean_env() -> dict[str, str]:
    """This environment's tools first on PATH; no FLASK_* from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASK_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


# --- the build -------------------------------------------------------------------------


def test_the_docs_build_without_warnings(tmp_path: Path) -> None:
    import myst_parser  # noqa: F401  (the test extra brings them: missing is a failure)
    import sphinx  # noqa: F401

    result = run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                  str(DOCS), str(tmp_path / "html")], cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "html" / "configuration.html").is_file()
    built = (tmp_path / "html" / "configuration.html").read_text(encoding="utf-8")
    assert "OUTBOX_SCRUB_SENT" in built and "OUTBOX_TRANSPORTS" in built


# --- the configuration reference --------------------------------------------------------


def _descriptions() -> dict[str, tuple[str, str]]:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import config_descriptions
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return config_descriptions.DESCRIPTIONS


def test_the_configuration_reference_describes_exactly_the_keys_in_the_code() -> None:
    from flask_mail_outbox.core._config import _DEFAULTS

    described = _descriptions()
    assert sorted(set(_DEFAULTS) - set(described)) == [], \
        "keys in _config._DEFAULTS without a description in docs/_ext/config_descriptions.py"
    assert sorted(set(described) - set(_DEFAULTS)) == [], \
        "keys described in docs/_ext/config_descriptions.py that _config._DEFAULTS lacks"
    for key, (type_, meaning) in described.items():
        assert type_.strip() and meaning.strip(), key


def test_the_configuration_page_commits_the_table_the_code_makes() -> None:
    """docs/configuration.md reads the same on GitHub as on the site: its table is committed,
    and is exactly what ``python docs/_ext/outbox_config.py`` makes from the code now."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import outbox_config
        block = outbox_config.committed((DOCS / "configuration.md").read_text(encoding="utf-8"))
        expected = outbox_config.generated()
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    assert block is not None, "docs/configuration.md lost its outbox-config markers"
    assert block == expected, (
        "docs/configuration.md's table is not the code's: run "
        "`python docs/_ext/outbox_config.py` and commit the page")
    from flask_mail_outbox.core._config import _DEFAULTS

    assert all(f"| `{key}` |" in block for key in _DEFAULTS)


# --- the API page -----------------------------------------------------------------------


def test_every_public_name_is_on_the_api_page() -> None:
    import flask_mail_outbox

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. auto\w+:: flask_mail_outbox\.(\w+)$", api, re.MULTILINE))
    assert sorted(set(flask_mail_outbox.__all__) - documented) == []


# --- runnable examples ------------------------------------------------------------------

RUNNABLE = [(page, line, arg, body) for page in pages()
            for line, arg, body in marked_blocks(page, "runnable")]


def test_the_guide_has_runnable_examples() -> None:
    # A marker lost in an edit must not turn this file's examples test into nothing.
    runnable_pages = {page.relative_to(DOCS).as_posix() for page, *_ in RUNNABLE}
    assert {"getting-started.md", "guide/sending.md", "guide/transactions.md",
            "guide/testing.md", "guide/transports.md"} <= runnable_pages


@pytest.mark.parametrize(("page", "line", "arg", "body"), RUNNABLE,
                         ids=[f"{p.relative_to(DOCS).as_posix()}:{line}"
                              for p, line, _, _ in RUNNABLE])
def test_a_runnable_example_runs(page: Path, line: int, arg: str | None, body: str,
                                 tmp_path: Path) -> None:
    if arg == "pytest":
        (tmp_path / "test_example.py").write_text(body, encoding="utf-8")
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-W", "error", "--rootdir", str(tmp_path), "test_example.py"]
    else:
        assert arg is None, f"{page}:{line}: unknown runnable kind {arg!r}"
        (tmp_path / "example.py").write_text(body, encoding="utf-8")
        args = [sys.executable, "example.py"]
    result = run(args, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (
        f"the example at {page.relative_to(ROOT)}:{line} failed (exit {result.returncode}):\n"
        f"{result.stdout}\n{result.stderr}")


# --- migration recipes ------------------------------------------------------------------

MIGRATIONS = DOCS / "migrations.md"

# The project of "An existing Flask-Migrate project" before the outbox joins it.
_EXISTING_APP = '''\
from flask import Flask
from flask_migrate import Migrate
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import Mapped, mapped_column

app = Flask(__name__)
app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///app.db"
db = SQLAlchemy(app)
migrate = Migrate(app, db)


class User(db.Model):
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]
'''


def recipe(name: str) -> str:
    [(_, _, body)] = [b for b in marked_blocks(MIGRATIONS, "recipe") if b[1] == name]
    return body


def recipe_file(name: str) -> str:
    [(_, _, body)] = [b for b in marked_blocks(MIGRATIONS, "recipe-file") if b[1] == name]
    return body


def run_recipe(name: str, cwd: Path) -> None:
    assert (BIN / "flask").exists(), f"no flask next to {sys.executable}"
    script = cwd / f"{name}.sh"
    script.write_text(recipe(name), encoding="utf-8")
    result = run(["bash", "-e", "-x", str(script)], cwd=cwd)
    assert result.returncode == 0, (
        f"the {name} recipe of docs/migrations.md failed as written:\n"
        f"{result.stdout}\n{result.stderr}")


def versions_in_the_package() -> set[str]:
    from flask_mail_outbox.migrations import VERSIONS_DIR

    return {p.name for p in Path(VERSIONS_DIR).glob("*.py")}


def tables(cwd: Path) -> set[str]:
    with sqlite3.connect(cwd / "instance" / "app.db") as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def heads(cwd: Path) -> list[str]:
    result = run([str(BIN / "flask"), "db", "heads"], cwd=cwd)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.strip()]


def assert_migrated(cwd: Path, package_before: set[str]) -> None:
    assert {"user", "outbox_email", "outbox_attachment", "outbox_setting"} <= tables(cwd)
    # Two branches, never merged: the project's head and the outbox's.
    found = heads(cwd)
    assert len(found) == 2 and len([h for h in found if "(outbox)" in h]) == 1, found
    merges = [p.name for p in (cwd / "migrations" / "versions").glob("*.py")
              if "down_revision = (" in p.read_text(encoding="utf-8")]
    assert merges == [], "the recipe should write no merge revision"
    # Nothing was written into the installed package's folder (a revision there would be
    # lost with the next install, and Alembic puts one there when the order is wrong).
    assert versions_in_the_package() == package_before


def test_the_recipes_say_the_commands_in_order() -> None:
    new = [line for line in recipe("new-project").splitlines() if line.strip()]
    assert new[0] == "flask db init"
    assert new.index("flask db upgrade heads") < next(
        i for i, line in enumerate(new) if line.startswith("flask db migrate"))
    text = MIGRATIONS.read_text(encoding="utf-8")
    assert "outbox_0" not in text.split("## A new project")[1].split("## Your tables refer")[0], \
        "the recipes must not name an outbox revision id"
    recipes = [body for _, _, body in marked_blocks(MIGRATIONS, "recipe")]
    assert recipes and not [body for body in recipes if "flask db merge" in body]
    assert recipe("upgrade").strip() == "flask db upgrade heads"


def test_the_new_project_recipe_runs_as_written(tmp_path: Path) -> None:
    before = versions_in_the_package()
    (tmp_path / "app.py").write_text(recipe_file("app.py"), encoding="utf-8")
    run_recipe("new-project", tmp_path)
    assert_migrated(tmp_path, before)
    assert len(list((tmp_path / "migrations" / "versions").glob("*.py"))) == 1  # initial


def test_the_existing_project_recipe_runs_as_written(tmp_path: Path) -> None:
    before = versions_in_the_package()
    (tmp_path / "app.py").write_text(_EXISTING_APP, encoding="utf-8")
    for command in (["db", "init"], ["db", "migrate", "-m", "users"], ["db", "upgrade"]):
        result = run([str(BIN / "flask"), *command], cwd=tmp_path)
        assert result.returncode == 0, f"setting up the existing project: {result.stderr}"
    (tmp_path / "app.py").write_text(recipe_file("app.py"), encoding="utf-8")
    run_recipe("existing-project", tmp_path)
    assert_migrated(tmp_path, before)


# --- the retry schedule, stated twice -----------------------------------------------------


def test_the_retry_schedule_on_the_modes_page_is_the_readmes() -> None:
    # tests/test_retries.py checks the README's table and bounds against the code; this
    # keeps docs/guide/modes.md saying the same.
    def schedule_of(text: str) -> tuple[list[str], list[str]]:
        section = text[text.index("The retry schedule"):]
        rows = re.findall(r"^\| \d+ \| .+ \|$", section, re.MULTILINE)
        bounds = re.findall(r"(?:durable|inline) mode: at most [\d.]+ h", section)
        return rows, bounds

    readme = schedule_of((ROOT / "README.md").read_text(encoding="utf-8"))
    modes = schedule_of((DOCS / "guide" / "modes.md").read_text(encoding="utf-8"))
    assert len(readme[0]) == 29 and len(readme[1]) == 2
    assert modes == readme


# --- the architecture page and the package's faces ---------------------------------------
# docs/architecture.md is held to the code as the configuration reference is: its layer
# rows are the import-linter "layers" contract, every module it names exists, and every
# module of the package is named.

PACKAGE = ROOT / "flask_mail_outbox"
ARCHITECTURE = DOCS / "architecture.md"


def _layers_contract() -> list[set[str]]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [{name.strip().removeprefix("flask_mail_outbox.") for name in row.split("|")}
            for row in contract["layers"]]


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def test_the_architecture_page_shows_the_layers_contract_row_by_row() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    contract = _layers_contract()
    block = re.search(r"^<!-- layers: [^\n]* -->\n```text\n(?P<body>.*?)^```$", text,
                      re.MULTILINE | re.DOTALL)
    assert block is not None, "the layer block (after <!-- layers: ... -->) is gone"
    shown = [{name.strip() for name in re.split(r"\s{2,}", line)[0].split("|")}
             for line in block.group("body").splitlines()]
    assert shown == contract
    table = [line for line in _section(text, "The layers").splitlines()
             if line.startswith("| `")]
    rows = [set(re.findall(r"`([\w.]+)`", line.split("|")[1])) for line in table]
    assert rows == contract
    count = "one two three four five six seven eight nine ten".split()[len(contract) - 1]
    assert f"The package is {count} layers" in text


def test_every_module_of_the_package_is_in_a_layer() -> None:
    layered = set().union(*_layers_contract())
    children = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(children - layered) == [], "modules in no layer of the contract"
    assert sorted(layered - children) == [], "layers naming no module"


def test_the_architecture_page_names_every_module_and_only_modules_that_exist() -> None:
    modules = _section(ARCHITECTURE.read_text(encoding="utf-8"), "The modules, one job each")
    named: set[Path] = set()
    base = PACKAGE
    for line in modules.splitlines():
        if line.startswith("### "):
            folder = [t for t in re.findall(r"`([^`]+)`", line) if t.endswith("/")]
            base = PACKAGE / folder[0] if folder else PACKAGE
            assert base.is_dir(), line
        elif line.startswith("| `"):
            for token in re.findall(r"`([\w./]+)`", line.split("|")[1]):
                named.add(base / token)
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert missing == [], "docs/architecture.md names modules that do not exist"
    folders = [p for p in named if p.is_dir()]
    unnamed = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and p not in named
        and not any(folder in p.parents for folder in folders))
    assert unnamed == [], "modules docs/architecture.md does not name"


def test_no_page_or_module_refers_to_a_file_outside_the_repository() -> None:
    # The product contract was once a DESIGN.md kept outside the repository.
    texts = [*pages(), *PACKAGE.rglob("*.py")]
    assert [str(p.relative_to(ROOT)) for p in texts
            if "DESIGN.md" in p.read_text(encoding="utf-8")] == []
    architecture = ARCHITECTURE.read_text(encoding="utf-8")
    for path in re.findall(r"`((?:tests|scripts|docs|\.ci)/[\w./-]+)`", architecture):
        assert (ROOT / path).exists(), path


def test_the_core_public_face_is_on_the_api_page() -> None:
    import flask_mail_outbox.core as core

    section = (DOCS / "api.md").read_text(encoding="utf-8")
    section = section[section.index("## The delivery core"):]
    section = section[:section.index("\n## ", 1)]
    shown = set(re.findall(r"flask_mail_outbox\.core\.(\w+)$", section, re.MULTILINE)) | set(
        re.findall(r"`(\w+)`", section))
    assert sorted(set(core.__all__) - shown) == []
