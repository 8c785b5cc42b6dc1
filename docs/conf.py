"""Sphinx configuration of the flask-mail-outbox docs (MyST Markdown, furo).

Built by tests/test_docs.py with ``sphinx-build -W --keep-going -b html docs <out>``:
every warning fails the test. Nothing here fetches from the network (no intersphinx).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sphinx.application import Sphinx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the package, for autodoc, from a plain clone

project = "flask-mail-outbox"
author = "the flask-mail-outbox authors"
copyright = "the flask-mail-outbox authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "outbox_config",  # docs/_ext/outbox_config.py: the configuration reference
    "outbox_policy",  # docs/_ext/outbox_policy.py: the suppression policy's reason table
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
# Anchors for ## and ### headings, so pages can link to [text](page.md#a-heading).
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}


def _no_type_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any,
                       lines: list[str]) -> None:
    """Drop the docstring a data object only inherits from its type.

    A constant re-exported from a private module (``transports.BUILTIN``, a dict)
    has no ``#:`` comment where it is documented, so autodoc would render
    ``dict.__doc__``; its page entry says what it is instead.
    """
    if what == "data" and lines and type(obj).__doc__ is not None \
            and lines[0].strip() == type(obj).__doc__.strip().splitlines()[0].strip():
        lines.clear()


def setup(app: Sphinx) -> None:
    """Sphinx's hook for a project's own conf.py extensions."""
    app.connect("autodoc-process-docstring", _no_type_docstring)


html_theme = "furo"
html_title = "flask-mail-outbox"
html_static_path: list[str] = []
