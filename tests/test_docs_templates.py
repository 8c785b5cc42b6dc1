"""The worked example of docs/guide/templates.md runs as written.

Its files are the blocks marked ``<!-- templates-example: <path> -->`` (templates, a
catalog, ``babel.cfg``, ``app.py``) and its commands the block marked ``run.sh``
(pybabel's extract, update and compile, then ``python app.py``). They are written into
an empty folder and run there with this environment's tools, as tests/test_docs.py runs
the migration recipes: ``app.py`` asserts what it sends, so a guide that drifts from the
code fails here.
"""

from __future__ import annotations

from pathlib import Path

from test_docs import DOCS, marked_blocks, run

GUIDE = DOCS / "guide" / "templates.md"


def example_files() -> dict[str, str]:
    files: dict[str, str] = {}
    for line, path, body in marked_blocks(GUIDE, "templates-example"):
        assert path and not path.startswith("/") and ".." not in path, f"line {line}: {path}"
        assert path not in files, f"line {line}: {path} shown twice"
        files[path] = body
    return files


def test_the_guide_shows_a_whole_example() -> None:
    files = example_files()
    assert {"app.py", "run.sh", "babel.cfg", "translations/de/LC_MESSAGES/messages.po",
            "templates/email/orders/shipped.subject.txt",
            "templates/email/orders/shipped.html"} <= set(files)
    assert "python app.py" in files["run.sh"]


def test_the_worked_example_runs_as_written(tmp_path: Path) -> None:
    for path, body in example_files().items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body, encoding="utf-8")
    result = run(["bash", "-e", "-x", "run.sh"], cwd=tmp_path)
    assert result.returncode == 0, (
        f"the worked example of {GUIDE.relative_to(DOCS.parent)} failed as written:\n"
        f"{result.stdout}\n{result.stderr}")
    assert (tmp_path / "translations" / "de" / "LC_MESSAGES" / "messages.mo").is_file()
    # The TemplateError the example prints is the one the guide quotes.
    printed = result.stdout.splitlines()[0]
    assert printed.startswith("template 'orders/shipped' (en) "), result.stdout
    assert printed in GUIDE.read_text(encoding="utf-8"), printed
