"""What a user installs: the wheel's metadata, and the install lines that lead to it.

- The wheel is built as a user's ``pip`` builds it (``pip wheel --no-deps``, build
  isolation, the newest setuptools that ``[build-system]`` allows) from a copy of the
  sources, so the checkout gets no ``build/`` or ``*.egg-info``. Its metadata carries the
  SPDX ``License-Expression``, the build prints no setuptools deprecation (the
  ``project.license`` table becomes an error in February 2027), and the ``postgres``
  extra brings psycopg 3, the driver the outbox runs on.
- The package is not on PyPI yet: the Install sections of the README and Getting Started
  lead with the from-a-clone line, and say so wherever they show the index line.
- Every extra an install line in the docs names is one the wheel provides, and each page
  that recommends PostgreSQL shows the ``postgres`` extra and a psycopg 3 URL.

- A clean clone (``git clone`` of this checkout's commit) builds with ``python -m build``
  (the sdist, then the wheel from it): the sdist holds every committed file but CI's own,
  tests and docs included; the wheel holds the package and nothing else, no tests; the
  sdist installs into a fresh virtualenv, and what it installs has its migrations,
  templates, static files and ``py.typed``, and imports.
  (scripts/check-install, run by scripts/run-tests, installs the wheel with each extra.)

The build fetches setuptools from the package index: offline, the wheel's tests are
skipped locally and fail in CI.
"""

from __future__ import annotations

import email
import email.message
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# What pip says when it cannot fetch the build requirements (no index reachable).
_OFFLINE = ("No matching distribution found for setuptools",
            "Could not find a version that satisfies the requirement setuptools")


@dataclass(frozen=True)
class BuiltWheel:
    """The wheel's core metadata, and what the build printed."""

    metadata: email.message.Message
    build_output: str


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> BuiltWheel:
    """Builds the wheel once for this module, from a copy of what the build reads."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "flask-mail-outbox"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "flask_mail_outbox", source / "flask_mail_outbox",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = work / "dist"
    # An absolute path: a bare name would be looked up on the index as a project.
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps", "--no-input",
         "--disable-pip-version-check", "--wheel-dir", str(out), str(source.resolve())],
        capture_output=True, text=True, timeout=600, check=False)
    output = build.stdout + build.stderr
    if build.returncode != 0:
        reason = f"pip wheel failed:\n{output[-6000:]}"
        if not IN_CI and any(line in output for line in _OFFLINE):
            pytest.skip(reason)
        pytest.fail(reason)
    [built] = out.glob("flask_mail_outbox-*.whl")
    with zipfile.ZipFile(built) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    return BuiltWheel(metadata=metadata, build_output=output)


def test_the_wheel_declares_its_license_as_an_spdx_expression(wheel: BuiltWheel) -> None:
    assert wheel.metadata["License-Expression"] == "BSD-3-Clause", wheel.metadata.items()
    # The legacy free-text field goes with the table form; the text itself ships.
    assert wheel.metadata["License"] is None
    assert wheel.metadata.get_all("License-File") == ["LICENSE"]
    assert "SetuptoolsDeprecationWarning" not in wheel.build_output, wheel.build_output[-6000:]


def test_the_postgres_extra_brings_psycopg_3(wheel: BuiltWheel) -> None:
    assert "postgres" in wheel.metadata.get_all("Provides-Extra", [])
    requirements = [Requirement(r) for r in wheel.metadata.get_all("Requires-Dist", [])]
    [psycopg] = [r for r in requirements
                 if r.marker is not None and r.marker.evaluate({"extra": "postgres"})
                 and not r.marker.evaluate({"extra": ""})]
    assert psycopg.name == "psycopg"
    assert psycopg.extras == {"binary"}
    # psycopg 3: the LISTEN connection (core/_listen.py) and the outage check
    # (_degrade.database_unreachable) use its API, which psycopg2 does not have.
    assert psycopg.specifier.contains("3.1") and not psycopg.specifier.contains("3.0")


# `pip install` and what it installs: the project by name (the index) or a path (a clone).
_PIP_INSTALL = re.compile(r"pip install (?:-[-\w]+ )*(?P<target>['\"]?[^\s`'\"]+)")
_BY_NAME = re.compile(r"['\"]?flask-mail-outbox\b")
_PENDING = "not on PyPI yet"


def install_section(page: Path) -> str:
    """The text of the page's ``## Install`` section, up to the next heading of that level."""
    text = page.read_text(encoding="utf-8")
    match = re.search(r"^## Install\n(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        pytest.fail(f"{page.relative_to(ROOT)} has no '## Install' section")
    return match.group("body")


def commands(section: str) -> list[str]:
    """The command lines of the section's shell blocks, without their comments."""
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    lines = (line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_install_section_leads_with_a_line_that_works_today(page: str) -> None:
    section = install_section(ROOT / page)
    targets = [m.group("target") for line in commands(section)
               for m in _PIP_INSTALL.finditer(line)]
    assert targets, f"{page}: no pip install command in its Install section"
    # The first command a reader copies installs a clone, not the unpublished name.
    assert not _BY_NAME.match(targets[0]), (page, targets)
    # Wherever the section names the index line (prose, comment or command), it says why
    # that fails for now.
    if any(_BY_NAME.match(m.group("target")) for m in _PIP_INSTALL.finditer(section)):
        assert _PENDING in " ".join(section.split()), \
            f"{page} shows the index line without saying {_PENDING!r}"


def doc_pages() -> list[Path]:
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts]
    return sorted([ROOT / "README.md", *pages])


# An install line's extras: `flask-mail-outbox[a,b]`, `.[a,b]` or `/path/to/clone[a,b]`.
_EXTRAS = re.compile(r"pip install [^\n`]*?(?:flask-mail-outbox|\.|/[\w./-]*)\[(?P<extras>[\w,]+)\]")


def test_every_extra_an_install_line_names_is_one_the_wheel_provides(wheel: BuiltWheel) -> None:
    provided = set(wheel.metadata.get_all("Provides-Extra", []))
    named = {(str(page.relative_to(ROOT)), extra)
             for page in doc_pages()
             for m in _EXTRAS.finditer(page.read_text(encoding="utf-8"))
             for extra in m.group("extras").split(",")}
    assert named, "no install line with extras found: the pattern is stale"
    assert {(page, extra) for page, extra in named if extra not in provided} == set()


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/deploying.md"])
def test_the_pages_that_recommend_postgresql_show_its_driver(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    extras = {extra for m in _EXTRAS.finditer(text) for extra in m.group("extras").split(",")}
    assert "postgres" in extras, f"{page}: no install line with the postgres extra"
    # SQLAlchemy's plain postgresql:// means psycopg2, which the extra does not bring.
    assert "postgresql+psycopg://" in text, f"{page}: no psycopg 3 database URL"


def _check_install_module() -> types.ModuleType:
    """scripts/check-install as a module: its sdist and wheel checks, shared."""
    loader = importlib.machinery.SourceFileLoader("check_install", str(ROOT / "scripts/check-install"))
    spec = importlib.util.spec_from_loader("check_install", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_install"] = module  # its dataclasses look their module up
    loader.exec_module(module)
    return module


_SDIST_PROBE = """
import importlib.resources, sys
from pathlib import Path
import flask_mail_outbox
from flask_mail_outbox import OutboxMail
from flask_mail_outbox.migrations import include_object
package = importlib.resources.files("flask_mail_outbox")
assert Path(flask_mail_outbox.__file__).resolve().is_relative_to(Path(sys.prefix).resolve())
assert package.joinpath("py.typed").is_file()
assert any(p.name.endswith(".py") for p in package.joinpath("migrations", "versions").iterdir())
templates = package.joinpath("_operator", "dashboard", "templates", "outbox_dashboard")
assert templates.joinpath("base.html").is_file()
assert any(package.joinpath("_operator", "dashboard", "static").iterdir())
print("installed", flask_mail_outbox.__file__)
"""


def test_a_clean_clone_builds_an_sdist_with_tests_and_a_wheel_without(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        if IN_CI:
            pytest.fail(f"{ROOT} is not a git checkout: CI runs on a clone")
        pytest.skip(f"{ROOT} is not a git checkout (an unpacked sdist?): nothing to clone")
    check_install = _check_install_module()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                   check=True, capture_output=True, timeout=120)
    committed = subprocess.run(["git", "-C", str(clone), "ls-files", "-z"], check=True,
                               capture_output=True, text=True).stdout.split("\0")
    files = sorted(n for n in committed if n)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"),
                            str(clone)], capture_output=True, text=True, timeout=600,
                           check=False, env=env)
    output = build.stdout + build.stderr
    if build.returncode != 0:
        if not IN_CI and any(line in output for line in _OFFLINE):
            pytest.skip(f"python -m build could not fetch setuptools:\n{output[-3000:]}")
        pytest.fail(f"python -m build failed in a clean clone:\n{output[-6000:]}")
    [sdist] = (tmp_path / "dist").glob("*.tar.gz")
    [wheel] = (tmp_path / "dist").glob("*.whl")
    version = check_install.tomllib.loads((clone / "pyproject.toml").read_text())["project"]["version"]
    built = check_install.Built(sdist=sdist, wheel=wheel, version=version)
    # Every committed file but CI's, no more; tests and docs among them.
    check_install.check_sdist(built, files)
    assert any(n.startswith("tests/test_") for n in files)
    assert "docs/index.md" in files
    # The package's files and nothing else: no tests.
    extras = check_install.check_wheel(built, clone)
    assert "postgres" in extras

    # The sdist installs (pip builds it again, as a user's pip does without a wheel).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--quiet", "--disable-pip-version-check", "--no-input", str(sdist)],
        capture_output=True, text=True, timeout=900, check=False, env=env)
    assert install.returncode == 0, (install.stdout + install.stderr)[-6000:]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", _SDIST_PROBE], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, check=False, env=env)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert str(venv) in probe.stdout


def test_the_changelog_opens_with_the_version_to_release() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    changelog = (ROOT / "docs/changelog.md").read_text("utf-8")
    first = re.search(r"^## (?P<title>.+)$", changelog, re.MULTILINE)
    assert first is not None, "docs/changelog.md has no release section"
    # "## 0.1.0", dated ("## 0.1.0 (2027-01-15)") when it is tagged.
    assert first.group("title").split()[0] == project["version"], first.group(0)
    # The Python versions the classifiers claim start at requires-python's floor.
    floor = project["requires-python"].removeprefix(">=")
    claimed = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert claimed and claimed[0] == floor, (floor, claimed)
    assert "Typing :: Typed" in project["classifiers"]


def test_getting_started_lists_exactly_the_extras_for_users(wheel: BuiltWheel) -> None:
    # The contributors' extras (scripts/check-install installs every other one).
    provided = set(wheel.metadata.get_all("Provides-Extra", [])) - {"test", "dev", "bench"}
    section = install_section(ROOT / "docs/getting-started.md")
    listed = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    assert listed == provided
