"""A plain-text rendering of an HTML body (placeholder).

This minimal stdlib version only keeps the signature the message builder
uses; the full module (inscriptis when installed, a careful stdlib fallback)
replaces it. It keeps the text of the document, drops scripts and styles,
and starts a new line at block elements.
"""

from __future__ import annotations

from html.parser import HTMLParser

__all__ = ["html_to_text"]

_BLOCKS = frozenset(
    {"address", "article", "blockquote", "br", "div", "footer", "h1", "h2", "h3", "h4",
     "h5", "h6", "header", "hr", "li", "ol", "p", "pre", "section", "table", "tr", "ul"}
)
_HIDDEN = frozenset({"head", "script", "style", "template", "title"})


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.chunks: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _HIDDEN:
            self._hidden += 1
        elif tag in _BLOCKS:
            self.chunks.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _HIDDEN:
            self._hidden = max(0, self._hidden - 1)
        elif tag in _BLOCKS:
            self.chunks.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.chunks.append(data)


def html_to_text(html: str) -> str:
    """The readable text of ``html``: one line per block, runs of spaces collapsed."""
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.chunks).splitlines())
    return "\n".join(line for line in lines if line)
