"""The configuration reference of docs/configuration.md, generated from the code.

The keys and their defaults come from ``flask_mail_outbox.core._config._DEFAULTS``, the one
table of defaults the library reads; the type and meaning of each come from
:data:`config_descriptions.DESCRIPTIONS` beside this file. The table is committed in
docs/configuration.md between :data:`BEGIN` and :data:`END`, so the page reads the same on
GitHub as on the built site. ``python docs/_ext/outbox_config.py`` writes it; the build
checks it: a committed table that is not the code's, or a key in one of the two tables
and not the other, is a build warning (so ``sphinx-build -W`` fails), and
tests/test_docs.py checks the same.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: The page the table is committed in.
PAGE = os.path.join(os.path.dirname(HERE), "configuration.md")
BEGIN = ("<!-- outbox-config: generated from the code by `python docs/_ext/outbox_config.py`; "
         "edit docs/_ext/config_descriptions.py, not this table -->")
END = "<!-- end outbox-config -->"


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


def render_table(code: dict[str, Any], described: dict[str, tuple[str, str]]) -> str:
    """The Markdown table of every described key of ``code``, in the code's order."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, value in code.items():
        if key in described:
            type_, meaning = described[key]
            lines.append(f"| `{key}` | {cell(type_)} | {cell(render_default(value))} | "
                         f"{cell(meaning)} |")
    return "\n".join(lines)


def generated() -> str:
    """The block the page must hold: the markers around the table the code makes now."""
    from config_descriptions import DESCRIPTIONS

    return f"{BEGIN}\n\n{render_table(defaults(), DESCRIPTIONS)}\n\n{END}"


def committed(text: str) -> str | None:
    """The generated block as committed in ``text`` (the page), or None without markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)]


def write(path: str = PAGE) -> bool:
    """Put the code's table in the page at ``path``; True when it changed."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    block = committed(text)
    if block is None:
        raise SystemExit(f"{path}: no {BEGIN!r} ... {END!r} block to fill")
    new = text.replace(block, generated())
    if new != text:
        with open(path, "w", encoding="utf-8") as file:
            file.write(new)
    return new != text


def _check(app: Any) -> None:
    """At the start of the build: the keys of both tables agree, and the page is current."""
    from sphinx.util import logging

    from config_descriptions import DESCRIPTIONS

    logger = logging.getLogger(__name__)
    undocumented, unknown = mismatch(defaults(), DESCRIPTIONS)
    for key in undocumented:
        logger.warning("outbox-config: %s is in core._config._DEFAULTS but has no "
                       "description in docs/_ext/config_descriptions.py", key)
    for key in unknown:
        logger.warning("outbox-config: %s is described in docs/_ext/config_descriptions.py "
                       "but is not in core._config._DEFAULTS", key)
    with open(PAGE, encoding="utf-8") as file:
        block = committed(file.read())
    if block != generated():
        logger.warning("outbox-config: the table committed in docs/configuration.md is not the "
                       "code's: run `python docs/_ext/outbox_config.py` and commit the page")


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _check)
    return {"version": "2", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the package, from a clone
    print(f"{PAGE}: " + ("table written" if write() else "already current"))
