"""The rule that keeps the benchmarks running through refactors: public API only.

The benchmarks import ``flask_mail_outbox`` and ``flask_mail_outbox.transports``
(their ``__all__``), and nothing whose name starts with ``_`` under them: a
private module or name can move in any commit, and a benchmark that used one
would break without anyone running it. ``python -m benchmarks smoke`` fails
when :func:`private_imports` finds any.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "flask_mail_outbox"
HERE = Path(__file__).resolve().parent

#: Private uses allowed, by file and name, each with its reason. The smoke run
#: executes each of these files, so a move of the name fails it, not silently.
ALLOWED = {
    ("benchmarks/costs.py", PACKAGE + ".core._suppression"):
        "the no-screen variant measures what the suppression screen costs a drain",
}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_imports(root: Path = HERE) -> list[str]:
    """``path:line: what`` for every private use of the package under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(root.parent)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module.split(".")[0] == PACKAGE):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                # flask_mail_outbox.x._y and importlib-style strings are caught below.
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and base.id == PACKAGE:
                    names = [ast.unparse(node)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value.startswith(PACKAGE + ".")):
                names = [node.value]
            found += [f"{where}:{node.lineno}: {name}" for name in names
                      if _private(name) and (str(where), name) not in ALLOWED]
    return found


if __name__ == "__main__":
    problems = private_imports()
    print("\n".join(problems) or "benchmarks use the public API only")
    raise SystemExit(1 if problems else 0)
