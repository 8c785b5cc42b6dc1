"""``{outbox-config}``: the configuration reference, rendered from the code.

The keys and their defaults come from ``flask_mail_outbox.core._config._DEFAULTS``, the one
table of defaults the library reads; the type and meaning of each come from
:data:`config_descriptions.DESCRIPTIONS` beside this file. A key in one and not the
other is a build warning (so ``sphinx-build -W`` fails), and tests/test_docs.py checks
the same both ways.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from config_descriptions import DESCRIPTIONS

logger = logging.getLogger(__name__)


def defaults() -> dict[str, Any]:
    """The library's table of defaults (imported late: conf.py puts the package on the path)."""
    from flask_mail_outbox.core._config import _DEFAULTS

    return dict(_DEFAULTS)


def mismatch(code: dict[str, Any], described: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Keys the code has and the docs do not, and keys the docs have and the code does not."""
    return sorted(set(code) - set(described)), sorted(set(described) - set(code))


def render_default(value: Any) -> str:
    """A default as it would be written in a config file; sizes in MiB are said so."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024 * 1024:
        return f"`{value}` ({value / (1024 * 1024):g} MiB)"
    return f"`{value!r}`"


class OutboxConfigDirective(SphinxDirective):
    """Renders every key of ``_DEFAULTS``: key, type, default (from the code), meaning."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        code = defaults()
        undocumented, unknown = mismatch(code, DESCRIPTIONS)
        location = self.get_location()
        for key in undocumented:
            logger.warning("outbox-config: %s is in _flask.config._DEFAULTS but has no "
                           "description in docs/_ext/config_descriptions.py", key,
                           location=location)
        for key in unknown:
            logger.warning("outbox-config: %s is described in docs/_ext/config_descriptions.py "
                           "but is not in _flask.config._DEFAULTS", key, location=location)
        # MyST parses what a directive nests in a Markdown page, so this is MyST Markdown.
        lines = [
            "```{list-table}",
            ":header-rows: 1",
            ":widths: 30 12 18 40",
            "",
            "* - key",
            "  - type",
            "  - default",
            "  - meaning",
        ]
        for key, value in code.items():
            if key not in DESCRIPTIONS:
                continue
            type_, meaning = DESCRIPTIONS[key]
            lines += [
                f"* - `{key}`",
                f"  - {type_}",
                f"  - {render_default(value)}",
                f"  - {meaning}",
            ]
        lines.append("```")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="outbox-config"), self.content_offset,
                                container)
        return container.children


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("outbox-config", OutboxConfigDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
