"""Plain text from HTML: the text/plain alternative of an html-only message.

``html_to_text(html)`` lays an HTML body out as plain text, as a text browser
would: spam filters score html-only mail worse, and a text-only client shows
the text part. A pure function. What the text looks like, with either backend:

* Dropped: ``<script>``, ``<style>``, ``<head>`` (so ``<title>``), ``<template>``,
  comments, and elements hidden by a ``hidden`` attribute or an inline
  ``display: none`` (a preheader). No other CSS is applied.
* Paragraphs, a blank line before and after: ``<p>``, ``<h1>``-``<h6>``,
  ``<blockquote>``, ``<pre>``, ``<figure>``, ``<dl>``, ``<hr>``, a list not in a
  list. A line of their own: ``<div>`` (Gmail writes a div per line), ``<li>``,
  ``<table>``, ``<tr>``, ``<dt>``, ``<dd>``, ``<header>``, ``<section>`` and the
  like. ``<br>`` ends the line.
* ``<li>`` is ``* item`` in ``<ul>``, ``1. item`` in ``<ol>`` (``start`` is
  honoured); an item's further lines and nested lists line up under its text,
  eight levels deep at most.
* A link is ``text (url)``: just ``text`` when that is the url, or the href is a
  ``#`` anchor or ``javascript:``; a ``mailto:`` shows the address; a link
  without text is its url. An image is its ``alt`` text.
* A table row is a line of its non-empty cells joined by `` | ``; a cell holding
  paragraphs keeps them, so a layout table reads top to bottom.
* Whitespace collapses to one space except in ``<pre>``; entities are decoded;
  no line ends in whitespace; never two blank lines in a row.
* Lines are not wrapped: clients wrap to their own width (a wrap at 78 leaves
  ragged lines on a phone), URLs stay whole, the transfer encoding keeps SMTP's limit.
* ``""`` when the HTML shows no text (empty, whitespace, only markup or
  scripts): the caller then sends the HTML alone, not an empty text part that
  mismatches it. Any other result ends with exactly one ``"\\n"``.
* Never raises on a ``str``. Lone surrogates become U+FFFD, ``\\r\\n`` and
  ``\\r`` a ``\\n``, vertical tab and form feed a space; other C0 controls, DEL
  and U+FDD0 (the cell marker used inside) are removed.

Backends: inscriptis (Apache-2.0, the ``html`` extra) when importable, on a
prepared lxml tree with a layout table made from these rules (not its
``[text](url)`` links or side-by-side columns). Else ``html.parser`` feeding the
same layout model; also above ``_INSCRIPTIS_MAX_CHARS`` (inscriptis is quadratic
in a line's length), past lxml's limits (it drops what is nested deeper than
256) or when inscriptis fails. Both give the same text for ordinary mail, and
differ where broken HTML is repaired differently (the fallback mirrors libxml2
for ``<p>``, lists, tables, links and misnested end tags only).
"""

from __future__ import annotations

import functools
import re
from html.parser import HTMLParser
from typing import Any, NamedTuple
from urllib.parse import unquote

__all__ = ["html_to_text"]

#: Longest input handed to inscriptis; the fallback is as fast on ordinary mail, and linear.
_INSCRIPTIS_MAX_CHARS = 64 * 1024
#: List levels that indent; an item deeper than that adds no indentation of its own.
_MAX_LIST_LEVELS = 8
#: Marks a table cell's start until ``_finish`` joins a row (a noncharacter: internal use).
_CELL = "\ufdd0"


class _Block(NamedTuple):
    """Layout of a block element: blank lines before and after, and ``<pre>``."""

    before: int
    after: int
    pre: bool = False


def _tags(names: str) -> frozenset[str]:
    return frozenset(names.split())


_PARAGRAPH = _Block(1, 1)
_LINE_TAGS = """div li table tr tbody thead tfoot caption dt dd address article aside footer header
    main nav section figcaption center form fieldset legend details summary hgroup"""
_BLOCKS: dict[str, _Block] = {
    **dict.fromkeys(_tags("p h1 h2 h3 h4 h5 h6 blockquote figure dl hr"), _PARAGRAPH),
    "pre": _Block(1, 1, pre=True),
    **dict.fromkeys(_tags(_LINE_TAGS), _Block(0, 0)),
}
#: Lists: blocks whose margins depend on their depth (see ``_list_start``).
_LISTS = _tags("ul ol")
_HIDDEN_TAGS = _tags("script style head title template")
_HEAD_TAGS = _tags("title style script meta link base noscript template")
_VOID_TAGS = _tags("area base br col embed hr img input link meta param source track wbr frame")
_TABLE_PARTS = _tags("td th tr tbody thead tfoot")
#: What libxml2 closes implicitly when a start tag arrives while it is open.
_CLOSED_BY: dict[str, frozenset[str]] = {
    "p": _tags("""p div li dt dd td th tr table ul ol h1 h2 h3 h4 h5 h6 pre blockquote hr
        tbody thead tfoot address center form dl caption"""),
    "li": _tags("li"), "dt": _tags("dt dd dl"), "dd": _tags("dt dd"),
    **dict.fromkeys(("td", "th"), _TABLE_PARTS),
    **dict.fromkeys(("tbody", "thead", "tfoot"), _tags("tbody thead tfoot")),
    **dict.fromkeys(("tr", "caption"), _tags("tr tbody thead tfoot")),
    "a": _tags("a td th table"),
}
#: libxml2's end-tag priorities (100 for the rest): an end tag is ignored when an
#: element of higher priority is open inside the one it names.
_END_PRIORITY = {"div": 150, "td": 160, "th": 160, "tr": 170, "table": 190, "head": 200}
_END_PRIORITY.update(dict.fromkeys(("thead", "tbody", "tfoot"), 180))

_WHITESPACE = re.compile(r"\s+")
_SURROGATE = re.compile("[\ud800-\udfff]")
_DROPPED_CHARS = {**dict.fromkeys((*range(9), *range(14, 32), 127, ord(_CELL))), 11: " ", 12: " "}
_DISPLAY_NONE = re.compile(r"(?i)(?:^|;)\s*display\s*:\s*none\s*(?:!\s*important)?\s*(?:;|$)")
_LIST_START = re.compile(r"[+-]?\d{1,9}")
_URL_NOISE = re.compile(r"[\t\n\r]")
_TAG_START = re.compile(r"<[A-Za-z/!?]")
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*>")


def html_to_text(html: str) -> str:
    """``html`` as plain text, laid out as the module docstring says; ``""`` when the
    HTML shows no text, else lines ending in ``"\\n"``. Never raises on a ``str``."""
    cleaned = _clean_input(html)
    if not cleaned.strip():
        return ""
    text = _try_inscriptis(cleaned) if len(cleaned) <= _INSCRIPTIS_MAX_CHARS else None
    return text if text is not None else _render_stdlib(cleaned)


# Shared by both backends -----------------------------------------------------


def _clean_input(html: str) -> str:
    """``html`` without what neither parser should see (module docstring, last rule)."""
    html = html.replace("\r\n", "\n").replace("\r", "\n").translate(_DROPPED_CHARS)
    return _SURROGATE.sub("\ufffd", html)


def _is_hidden(style: str | None, hidden: bool) -> bool:
    """Whether an element's attributes hide it (``hidden``, ``display: none``)."""
    return hidden or (style is not None and _DISPLAY_NONE.search(style) is not None)


def _list_counter(tag: str, start: str | None) -> str | int:
    """A new list's counter: its bullet, or the number of its first item."""
    if tag != "ol":
        return "* "
    return int(start) if start is not None and _LIST_START.fullmatch(start.strip()) else 1


def _next_bullet(counters: list[str | int]) -> tuple[str, int]:
    """The next ``<li>``'s bullet and indentation; advances an ``<ol>``'s counter."""
    counter = counters[-1] if counters else "* "
    if isinstance(counter, int):
        counters[-1] = counter + 1
        counter = f"{counter}. "
    return counter, len(counter) if len(counters) <= _MAX_LIST_LEVELS else 0


def _link_suffix(text: str, href: str | None) -> str:
    """What follows a link's text: `` (url)``, `` url`` when it has none, or ``""``."""
    target = _URL_NOISE.sub("", href or "").strip()
    if not target or target.startswith("#") or target.lower().startswith("javascript:"):
        return ""
    if target.lower().startswith("mailto:"):
        target = unquote(target[len("mailto:"):].split("?", 1)[0]).strip()
        if not target:
            return ""
    label = " ".join(text.split())
    if not label:
        return " " + target
    return "" if label.rstrip("/") == target.rstrip("/") else f" ({target})"


def _finish(laid_out: str) -> str:
    """Join table cells, strip line ends, keep at most one blank line in a row."""
    lines: list[str] = []
    for line in laid_out.split("\n"):
        if _CELL in line:
            head, *cells = line.split(_CELL)
            line = head + " | ".join(cell.strip() for cell in cells if cell.strip())
            if not line.strip():
                continue  # empty cells, or a cell whose content starts with a block
        line = line.rstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


# inscriptis ------------------------------------------------------------------


@functools.cache
def _inscriptis_available() -> bool:
    """Whether the ``html`` extra (inscriptis, and lxml under it) is installed."""
    try:
        import inscriptis  # noqa: F401
        import lxml.html  # noqa: F401
    except ImportError:
        return False
    return True


def _try_inscriptis(html: str) -> str | None:
    """The inscriptis rendering, or ``None`` for the fallback to render instead."""
    try:
        return _render_inscriptis(html) if _inscriptis_available() else None
    except Exception:  # noqa: BLE001 - what fails there (RecursionError...) the fallback renders
        return None


def _render_inscriptis(html: str) -> str | None:
    """Render with inscriptis; ``None`` when lxml could not keep the whole document."""
    import lxml.etree
    import lxml.html
    from inscriptis.html_engine import Inscriptis

    # One parser per call: an lxml parser must not be shared between threads.
    parser = lxml.html.HTMLParser(remove_comments=True, remove_pis=True)
    try:
        root = lxml.html.document_fromstring(_XML_DECLARATION.sub("", html, count=1), parser=parser)
    except lxml.etree.ParserError:  # "Document is empty": markup without content
        return ""
    if any(entry.type_name == "ERR_RESOURCE_LIMIT" for entry in parser.error_log):
        return None
    _prepare_tree(root)
    return _finish(str(Inscriptis(root, _inscriptis_config()).get_text()))


def _prepare_tree(root: Any) -> None:
    """Apply the rules inscriptis is not told about to the lxml tree, in place."""
    # Hidden elements are emptied and made plain inline ones, their tails kept:
    # removing them would concatenate tails, quadratic for many in a row.
    for element in [
        node for node in root.iter()
        if node.tag in _HIDDEN_TAGS or _is_hidden(node.get("style"), "hidden" in node.attrib)
    ]:
        element.clear(keep_tail=True)
        element.tag = "span"
    for element in root.iter("img", "pre"):
        if element.tag == "img" and element.get("alt"):
            element.tail = element.get("alt") + (element.tail or "")
        elif element.tag == "pre" and element.text and element.text.startswith("\n"):
            element.text = element.text[1:]  # as HTML parsing does
    # Links after images: a link's text includes its images' alt text.
    for element in root.iter("a", "td", "th"):
        if element.tag == "a":
            suffix = _link_suffix("".join(element.itertext()), element.get("href"))
            if suffix:
                element.tail = suffix + (element.tail or "")
        else:
            element.text = _CELL + (element.text or "")
    for element in root.iter():  # inscriptis unescapes what it writes, once more
        element.text = element.text and element.text.replace("&", "&amp;")
        element.tail = element.tail and element.tail.replace("&", "&amp;")


class _InlineByDefault(dict[str, Any]):
    """A CSS profile whose unknown elements inherit ``white-space`` (a ``<b>`` in ``<pre>``)."""

    def __init__(self, inline: Any) -> None:
        super().__init__()
        self._inline = inline

    def get(self, key: str, default: Any = None, /) -> Any:
        return super().get(key, self._inline)


@functools.cache
def _inscriptis_config() -> Any:
    """The ``ParserConfig`` for the rules above (built once; read-only after)."""
    from inscriptis.html_properties import Display, WhiteSpace
    from inscriptis.model.config import ParserConfig
    from inscriptis.model.html_element import HtmlElement
    from inscriptis.model.tag import CustomHtmlTagHandlerMapping

    css = _InlineByDefault(HtmlElement(whitespace=None))
    css["body"] = HtmlElement(whitespace=WhiteSpace.normal)
    for tag, block in {**_BLOCKS, **dict.fromkeys(_LISTS, _Block(0, 0))}.items():
        whitespace = WhiteSpace.pre if block.pre else None
        css[tag] = HtmlElement(display=Display.block, margin_before=block.before, whitespace=whitespace)
    # Table handlers replaced by no-ops: rows are lines and cells are marked in
    # the tree, instead of inscriptis's side-by-side column layout.
    start: dict[str, Any] = dict.fromkeys(("table", *_TABLE_PARTS), _ignore)
    start.update(ul=_list_start, ol=_list_start, li=_li_start)
    end: dict[str, Any] = {tag: _paragraph_end for tag, block in _BLOCKS.items() if block.after}
    end.update(dict.fromkeys(("table", "td", "th"), _ignore), ul=_list_end, ol=_list_end)
    mapping = CustomHtmlTagHandlerMapping(start, end)
    config = ParserConfig(css=css, custom_html_tag_handler_mapping=mapping)
    config.attribute_handler.attribute_mapping = {}  # no inline CSS margins or paddings
    return config


def _ignore(*_: Any) -> None:
    """An inscriptis tag handler that does nothing."""


def _paragraph_end(state: Any) -> None:
    """A paragraph's end: its blank line, set only now (inscriptis gives a block's
    margin after to each block opened in it, blank lines between its lines)."""
    state.tags[-1].margin_after = 1


def _list_start(state: Any, attrs: Any) -> None:
    """``<ul>``/``<ol>`` start: a top-level list opens a paragraph."""
    element = state.tags[-1]
    if not state.li_counter:
        element.margin_before = 1
    state.li_counter.append(_list_counter(element.tag, attrs.get("start")))


def _list_end(state: Any) -> None:
    """List end: a top-level list closes a paragraph (set now: ``_paragraph_end``)."""
    state.li_counter.pop()
    if not state.li_counter:
        _paragraph_end(state)


def _li_start(state: Any, attrs: Any) -> None:
    """``<li>``: its bullet, and an indentation as wide as the bullet."""
    element = state.tags[-1]
    element.list_bullet, element.padding_inline = _next_bullet(state.li_counter)


# The standard-library fallback -----------------------------------------------


def _render_stdlib(html: str) -> str:
    """Render with ``html.parser``, in the layout inscriptis would give."""
    parser = _TextParser()
    parser.feed(_drop_unterminated(html))
    parser.close()
    return _finish(parser.canvas.text())


def _drop_unterminated(html: str) -> str:
    """``html`` without the comment or tag left open at its end, as HTML drops them
    (Python's parser before 3.13.4 rescans those from every later ``<``: quadratic)."""
    comment_end = html.rfind("-->")
    comment = html.find("<!--", comment_end + 3 if comment_end >= 0 else 0)
    if comment >= 0:
        html = html[:comment]
    tag = _TAG_START.search(html, html.rfind(">") + 1)
    return html[: tag.start()] if tag else html


class _Canvas:
    """Lines laid out as inscriptis's canvas does: margins (in blank lines),
    and per open block a padding and perhaps a bullet, written with the next text."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._parts: list[str] = []  # the current line
        self._collapsible = True  # a space written now would be dropped
        self._margin = 1000  # nothing written yet: no margin before the first block
        self._paddings: list[int] = []  # per open block
        self._bullets: list[tuple[int, str]] = []  # (block index, bullet) not yet written
        self._padding = 0
        self._consumed = False  # the current line's prefix is written

    def write(self, text: str, *, pre: bool) -> None:
        """Add text to the current line, its whitespace collapsed unless ``pre``."""
        if pre:
            if not text:
                return
            text = self._first_prefix() + text.replace("\n", "\n" + " " * self._padding)
            self._collapsible = False
        else:
            text = _WHITESPACE.sub(" ", text)
            if self._collapsible and text.startswith(" "):
                text = text[1:]
            if not text:
                return
            if not self._parts:
                text = self._first_prefix() + text
            self._collapsible = text.endswith(" ")
        self._parts.append(text)

    def open_block(self, before: int, padding: int, bullet: str) -> None:
        """A block starts: end the line, keep ``before`` blank lines, push its prefix."""
        if not self._flush() and bullet:
            self._write_unconsumed_bullet()
        if bullet:
            self._bullets.append((len(self._paddings), bullet))
        self._paddings.append(padding)
        self._padding += padding
        self._keep_margin(before)

    def close_block(self, after: int, bullet: str) -> None:
        """A block ends: end the line, pop its prefix, keep ``after`` blank lines."""
        if not self._flush() and bullet:
            self._write_unconsumed_bullet()
        if self._paddings:
            self._padding -= self._paddings.pop()
            if self._bullets and self._bullets[-1][0] == len(self._paddings):
                self._bullets.pop()
        self._keep_margin(after)

    def line_break(self) -> None:
        """``<br>``: end the line, or add an empty one."""
        if not self._flush():
            self._lines.append("")

    def text(self) -> str:
        """Everything written, one string."""
        self._flush()
        return "\n".join(self._lines)

    def _keep_margin(self, margin: int) -> None:
        if margin > self._margin:
            self._lines.extend([""] * (margin - self._margin))
            self._margin = margin

    def _flush(self) -> bool:
        if not self._parts:
            return False
        line = "".join(self._parts)
        if self._collapsible and line.endswith(" "):
            line = line[:-1]
        self._lines.append(line)
        self._parts = []
        self._collapsible = True
        self._consumed = False
        self._margin = 0
        return True

    def _pop_bullet(self) -> str:
        return self._bullets.pop()[1] if self._bullets else ""

    def _first_prefix(self) -> str:
        if self._consumed:
            return ""
        self._consumed = True
        bullet = self._pop_bullet()
        return " " * (self._padding - len(bullet)) + bullet

    def _write_unconsumed_bullet(self) -> None:
        # Only on an empty line (so nothing is consumed); placed as inscriptis does.
        bullet = self._pop_bullet()
        if bullet:
            padding = self._padding - self._paddings[-1]
            self._lines.append(" " * (padding - len(bullet)) + bullet)
            self._margin = 0


class _Open(NamedTuple):
    """An element on the parser's stack."""

    tag: str
    hides: bool  # it is hidden itself (counted in _TextParser._hidden)
    shown: bool  # it was laid out (nothing around it hidden)
    bullet: str = ""


class _Link:
    """An open ``<a>``: its href and the start of its text (enough to compare)."""

    def __init__(self, href: str | None) -> None:
        self.href = href
        self.parts: list[str] = []
        self._room = 2 * len(href or "") + 64

    def add(self, text: str) -> None:
        if self._room > 0:
            self.parts.append(text[: self._room])
            self._room -= len(text)


class _TextParser(HTMLParser):
    """Feeds a ``_Canvas`` from HTML, repairing it as libxml2 mostly would."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.canvas = _Canvas()
        self._stack: list[_Open] = []
        self._at: dict[str, list[int]] = {}  # stack positions per tag: end tags in linear time
        self._hidden = 0
        self._pre = 0
        self._pre_started = False  # the next text comes right after <pre>
        self._lists: list[str | int] = []  # each open list's counter (as inscriptis's li_counter)
        self._links: list[_Link] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._pre_started = False
        attributes = dict(attrs)
        hidden = tag in _HIDDEN_TAGS or _is_hidden(attributes.get("style"), "hidden" in attributes)
        if tag in ("html", "body"):
            if tag == "body":
                self._close_head()
            self._hidden += hidden  # stays hidden: the whole document is
            return
        if self._stack and self._stack[-1].tag == "head" and tag not in _HEAD_TAGS:
            self._close_head()
        while self._stack and self._closes(self._stack[-1].tag, tag):
            self._pop()
        shown = not (hidden or self._hidden)
        if tag in _VOID_TAGS:
            if shown and tag == "br":
                self.canvas.line_break()
            elif shown and tag == "img" and attributes.get("alt"):
                self._write(attributes["alt"] or "")
            elif shown and tag == "hr":
                self._lay_out_start(tag, attributes)
                self.canvas.close_block(_PARAGRAPH.after, "")
            return
        self._hidden += hidden
        self._at.setdefault(tag, []).append(len(self._stack))
        bullet = self._lay_out_start(tag, attributes) if shown else ""
        self._stack.append(_Open(tag, hidden, shown, bullet))

    def handle_endtag(self, tag: str) -> None:
        self._pre_started = False
        at = self._at.get(tag)
        if not at:
            return  # stray: ignored, as libxml2 does
        priority = _END_PRIORITY.get(tag, 100)
        for other, other_priority in _END_PRIORITY.items():
            if other_priority > priority and self._at.get(other) and self._at[other][-1] > at[-1]:
                return
        for _ in range(len(self._stack) - at[-1]):
            self._pop()

    def handle_data(self, data: str) -> None:
        if self._pre_started and data.startswith("\n"):
            data = data[1:]
        self._pre_started = False
        if self._stack and self._stack[-1].tag == "head" and data.strip():
            self._close_head()  # text ends an unclosed head
        if not self._hidden:
            self._write(data)

    def parse_marked_section(self, i: int, report: bool = True) -> int:
        # "<![CDATA[...]]>", "<![if mso]>": in HTML a bogus comment up to the next
        # ">". (Python's own raises AssertionError on a name it does not know.)
        end = self.rawdata.find(">", i + 3)
        return -1 if end < 0 else end + 1

    def close(self) -> None:
        super().close()
        while self._stack:
            self._pop()

    @staticmethod
    def _closes(open_tag: str, tag: str) -> bool:
        if tag in _CLOSED_BY.get(open_tag, ()):
            return True
        # A new cell or row also ends the inline elements left open in the last.
        return tag in ("td", "th") and not (
            open_tag in _BLOCKS or open_tag in _TABLE_PARTS or open_tag in _HIDDEN_TAGS
        )

    def _close_head(self) -> None:
        if self._at.get("head"):
            self.handle_endtag("head")

    def _write(self, text: str) -> None:
        self.canvas.write(text, pre=self._pre > 0)
        if self._links:
            self._links[-1].add(text)

    def _lay_out_start(self, tag: str, attributes: dict[str, str | None]) -> str:
        """Open a shown element on the canvas; returns an ``<li>``'s bullet."""
        bullet, padding = "", 0
        block = _BLOCKS.get(tag)
        if tag in _LISTS:
            block = _Block(0 if self._lists else 1, 0)
            self._lists.append(_list_counter(tag, attributes.get("start")))
        elif tag == "li":
            bullet, padding = _next_bullet(self._lists)
        if block is not None:
            self.canvas.open_block(block.before, padding, bullet)
        if tag == "pre":
            self._pre += 1
            self._pre_started = True
        elif tag in ("td", "th"):
            self.canvas.write(_CELL, pre=self._pre > 0)
        elif tag == "a":
            self._links.append(_Link(attributes.get("href")))
        return bullet

    def _pop(self) -> _Open:
        element = self._stack.pop()
        self._at[element.tag].pop()
        self._hidden -= element.hides
        if element.shown:
            self._lay_out_end(element.tag, element.bullet)
        return element

    def _lay_out_end(self, tag: str, bullet: str) -> None:
        if tag in _LISTS:
            self._lists.pop()
            self.canvas.close_block(0 if self._lists else 1, "")
        elif tag in _BLOCKS:
            self.canvas.close_block(_BLOCKS[tag].after, bullet)
        if tag == "pre":
            self._pre -= 1
        elif tag == "a":
            link = self._links.pop()
            text = "".join(link.parts)
            if self._links:
                self._links[-1].add(text)
            suffix = _link_suffix(text, link.href)
            if suffix:
                self.canvas.write(suffix, pre=self._pre > 0)
