"""``{outbox-policy}``: the suppression policy's table, rendered from the code.

One row per reason of ``flask_mail_outbox._reasons.REASONS``: what a permanent and a
transient bounce for it do to the address, as ``flask_mail_outbox._policy.for_good``
decides. tests/test_policy.py checks that docs/events.md uses the directive and that
the rows say what the code does.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

FOR_GOOD = "**suppressed for good**"
SOFT = "soft: counts toward the limit"


def rows() -> list[tuple[str, str, str, str]]:
    """``(reason, meaning, permanent bounce, transient bounce)`` for every reason."""
    from flask_mail_outbox._policy import for_good
    from flask_mail_outbox._reasons import REASONS

    def said(kind: str, reason: str) -> str:
        return FOR_GOOD if for_good("bounced", kind, reason) else SOFT

    return [(reason, meaning, said("permanent", reason), said("transient", reason))
            for reason, meaning in REASONS.items()]


def lines() -> list[str]:
    """The table as MyST Markdown (a list-table)."""
    out = ["```{list-table}", ":header-rows: 1", ":widths: 18 46 18 18", "",
           "* - `reason`", "  - what it means", "  - a permanent bounce", "  - a transient bounce"]
    for reason, meaning, permanent, transient in rows():
        out += [f"* - `{reason}`", f"  - {meaning}", f"  - {permanent}", f"  - {transient}"]
    out.append("```")
    return out


class OutboxPolicyDirective(SphinxDirective):
    """Renders the reason -> verdict table."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(lines(), source="outbox-policy"), self.content_offset,
                                container)
        return container.children


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("outbox-policy", OutboxPolicyDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
