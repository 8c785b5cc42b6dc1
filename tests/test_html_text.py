"""html_to_text: the text/plain rendering of HTML mail, on both backends.

Every layout test runs twice, on inscriptis and on the standard-library
fallback, against the same expected text: the two must agree on ordinary mail.
The ``backend`` fixture forces one: with inscriptis the fallback is made to
fail the test if it is reached; for the fallback, inscriptis counts as absent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_mail_outbox._compose import html_text as _html_text
from flask_mail_outbox._compose.html_text import (
    _clean_input,
    _render_inscriptis,
    _render_stdlib,
    html_to_text,
)

Render = Callable[[str], str]


@pytest.fixture(params=["inscriptis", "stdlib"])
def to_text(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Render]:
    if request.param == "inscriptis":
        pytest.importorskip("inscriptis")

        def no_fallback(html: str) -> str:
            raise AssertionError("inscriptis declined this input: the fallback rendered it")

        monkeypatch.setattr(_html_text, "_render_stdlib", no_fallback)
    else:
        monkeypatch.setattr(_html_text, "_inscriptis_available", lambda: False)
    yield html_to_text


def newsletter(articles: int) -> str:
    """A marketing newsletter the usual way: nested layout tables, inline CSS."""
    head = """<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Weekly</title>
<style>body{margin:0} @media (max-width:600px){.col{width:100%!important}}</style>
<!--[if mso]><xml><o:OfficeDocumentSettings></o:OfficeDocumentSettings></xml><![endif]-->
</head><body style="margin:0;padding:0">
<div style="display:none;max-height:0;overflow:hidden">This week: stories &zwnj;&nbsp;&zwnj;</div>
<table role="presentation" width="100%"><tr><td align="center">
<table role="presentation" width="600" style="background:#fff">
<tr><td style="padding:20px"><table width="100%"><tr>
<td><a href="https://shop.example.com/"><img src="logo.png" alt="Example Shop"></a></td>
<td align="right"><a href="https://shop.example.com/view/1">View in browser</a></td></tr></table></td></tr>
"""
    article = """<tr><td style="padding:10px 20px"><h2>Story {n}</h2>
<p style="margin:0 0 12px">Lorem ipsum dolor sit amet, <b>consectetur</b> adipiscing elit. Read
<a href="https://shop.example.com/story/{n}?utm_campaign=weekly&amp;utm_medium=email">the story</a>.</p>
<ul><li>First point</li><li>Second, with <i>emphasis</i></li></ul>
<table width="100%"><tr>
<td class="col" width="50%"><img src="a.jpg" alt="Blue mug"><p>Blue mug<br>&euro;12.00</p></td>
<td class="col" width="50%"><img src="b.jpg" alt=""><p>Red mug<br>&euro;14.00</p></td>
</tr></table>
<table><tr><td bgcolor="#0066cc" style="padding:12px 24px">
<a href="https://shop.example.com/buy/{n}" style="color:#fff">Shop now</a></td></tr></table>
</td></tr>
"""
    foot = """<tr><td style="font-size:12px"><hr><p>Example Shop, 1 Main Street</p>
<p><a href="https://shop.example.com/unsubscribe?u=abc">Unsubscribe</a> |
<a href="mailto:help@example.com">help@example.com</a></p></td></tr></table></td></tr></table>
<script>var x = "<p>never</p>";</script></body></html>
"""
    return head + "".join(article.format(n=n) for n in range(1, articles + 1)) + foot


def articles_for(size: int) -> int:
    """How many articles make a newsletter of at least ``size`` characters."""
    frame, article = len(newsletter(0)), len(newsletter(1)) - len(newsletter(0))
    return -(-(size - frame) // article)


def newsletter_text(articles: int) -> str:
    article = """Story {n}

Lorem ipsum dolor sit amet, consectetur adipiscing elit. Read the story (https://shop.example.com/story/{n}?utm_campaign=weekly&utm_medium=email).

* First point
* Second, with emphasis

Blue mug

Blue mug
€12.00

Red mug
€14.00

Shop now (https://shop.example.com/buy/{n})

"""
    return (
        "Example Shop (https://shop.example.com/) | View in browser (https://shop.example.com/view/1)\n\n"
        + "".join(article.format(n=n) for n in range(1, articles + 1))
        + "Example Shop, 1 Main Street\n\n"
        "Unsubscribe (https://shop.example.com/unsubscribe?u=abc) | help@example.com\n"
    )


# --------------------------------------------------------------------------- #
# Layout, on both backends
# --------------------------------------------------------------------------- #


def test_a_transactional_email(to_text: Render) -> None:
    html = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Confirm your address</title>
<style>.button { background: #06c; }</style></head>
<body>
  <h1>Confirm your address</h1>
  <p>Hi Ann,</p>
  <p>Thanks for signing up. Please confirm that
     <b>ann@example.org</b> is your address:</p>
  <p><a class="button" href="https://app.example.org/confirm?t=abc&amp;next=%2F">Confirm my address</a></p>
  <p>Or paste this link into your browser:<br>
     <a href="https://app.example.org/confirm?t=abc&amp;next=%2F">https://app.example.org/confirm?t=abc&amp;next=%2F</a></p>
  <div class="footer">
    <p>Example Ltd, 1 Main Street, Springfield</p>
    <p>Questions? <a href="mailto:help@example.org?subject=Signup">Write to us</a>.
       <a href="https://app.example.org/unsubscribe?u=42">Unsubscribe</a></p>
  </div>
</body></html>"""
    assert to_text(html) == (
        "Confirm your address\n"
        "\n"
        "Hi Ann,\n"
        "\n"
        "Thanks for signing up. Please confirm that ann@example.org is your address:\n"
        "\n"
        "Confirm my address (https://app.example.org/confirm?t=abc&next=%2F)\n"
        "\n"
        "Or paste this link into your browser:\n"
        "https://app.example.org/confirm?t=abc&next=%2F\n"
        "\n"
        "Example Ltd, 1 Main Street, Springfield\n"
        "\n"
        "Questions? Write to us (help@example.org). Unsubscribe (https://app.example.org/unsubscribe?u=42)\n"
    )


@pytest.mark.parametrize(
    ("html", "text"),
    [
        ('<a href="https://x.org/a">Read</a>', "Read (https://x.org/a)\n"),
        ('<a href="https://x.org/">https://x.org</a>', "https://x.org\n"),
        ('<a href="#top">Back to top</a>', "Back to top\n"),
        ('<a href="javascript:void(0)">Menu</a>', "Menu\n"),
        ('<a name="here">Anchor</a>', "Anchor\n"),
        ('<a href="mailto:a@x.org">a@x.org</a>', "a@x.org\n"),
        ('<a href="mailto:a@x.org?subject=Hi">Mail us</a>', "Mail us (a@x.org)\n"),
        ('Logo: <a href="https://x.org/"><img src="l.png"></a>', "Logo: https://x.org/\n"),
        ('<a href="https://x.org/"><img src="l.png" alt="Example"></a>', "Example (https://x.org/)\n"),
        ('<a href=" https://x.org/\n\tlong ">Go</a>, now', "Go (https://x.org/long), now\n"),
    ],
)
def test_links(to_text: Render, html: str, text: str) -> None:
    assert to_text(html) == text


def test_nested_lists(to_text: Render) -> None:
    html = """<p>Your order:</p>
<ul>
  <li>Tea
    <ul><li>green</li><li>black
      <ol><li>Assam</li><li>Ceylon</li></ol></li></ul>
  </li>
  <li>Cups</li>
</ul>
<ol start="9"><li>ninth</li><li>tenth<br>on two lines</li></ol>
<p>Thanks</p>"""
    assert to_text(html) == (
        "Your order:\n"
        "\n"
        "* Tea\n"
        "  * green\n"
        "  * black\n"
        "    1. Assam\n"
        "    2. Ceylon\n"
        "* Cups\n"
        "\n"
        "9. ninth\n"
        "10. tenth\n"
        "    on two lines\n"
        "\n"
        "Thanks\n"
    )


def test_a_table_layout_email(to_text: Render) -> None:
    assert to_text(newsletter(2)) == newsletter_text(2)


def test_a_data_table_is_rows_of_cells(to_text: Render) -> None:
    html = """<p>Receipt</p><table>
<tr><th>Item</th><th>Qty</th><th>Price</th></tr>
<tr><td>Blue mug</td><td>2</td><td>&euro;24</td></tr>
<tr><td>&nbsp;</td><td></td><td> </td></tr>
<tr><td>Total</td><td></td><td><b>&euro;24</b></td></tr>
</table><p>Thanks</p>"""
    assert to_text(html) == "Receipt\n\nItem | Qty | Price\nBlue mug | 2 | €24\nTotal | €24\n\nThanks\n"


def test_scripts_styles_comments_and_hidden_content_are_dropped(to_text: Render) -> None:
    html = """<html><head><title>Title</title><script>var a = "<p>no</p>";</script>
<style>p { color: red }</style></head><body>
<div style="display:none; max-height:0">Preheader &zwnj;&nbsp;</div>
<!-- a comment <p>not shown</p> -->
<!--[if mso]><p>Outlook only</p><![endif]-->
<p>Shown<span hidden> not this</span>.</p>
<template><p>template</p></template>
<script>document.write("x")</script>
<p style="color: red; DISPLAY : None !important">hidden paragraph</p>
<p>End</p></body></html>"""
    assert to_text(html) == "Shown.\n\nEnd\n"


def test_entities_and_non_ascii(to_text: Render) -> None:
    html = (
        "<p>caf&eacute; &amp; cr&egrave;me &mdash; 10&nbsp;&euro; &lt;b&gt; &amp;lt; "
        "&#128512; &#x65E5;本 &unknown; AT&T</p><p>Ünïcødé ✓</p>"
    )
    # "&amp;lt;" is the text "&lt;": decoded once, never twice.
    assert to_text(html) == "café & crème — 10 € <b> &lt; 😀 日本 &unknown; AT&T\n\nÜnïcødé ✓\n"


def test_pre_keeps_its_whitespace(to_text: Render) -> None:
    html = "<p>Code:</p><pre>\ndef f():\n    return  <b>1  +  2</b>\n</pre><p>a   b</p>"
    assert to_text(html) == "Code:\n\ndef f():\n    return  1  +  2\n\na b\n"
    # Its first newline is not content (HTML drops it); later lines keep the item's indentation.
    assert to_text("<ul><li><pre>\nx\n y</pre></li></ul>") == "* x\n   y\n"


def test_divs_and_breaks_are_lines(to_text: Render) -> None:
    # Gmail's shape: one <div> per line, <div><br></div> for an empty one.
    html = "<div>Hi Bob,</div><div><br></div><div>See you at 10.<br>Ann</div><blockquote>a<div>b</div></blockquote>"
    assert to_text(html) == "Hi Bob,\n\nSee you at 10.\nAnn\n\na\nb\n"


def test_malformed_html(to_text: Render) -> None:
    html = (
        "<p>one<p>two <b>bold<div>three</b><ul><li>a<li>b</ul>"
        "<table><tr><td>x<td>y<tr><td>z</table></div></span></p>"
        "tail <a href='https://x.org/u'>open link<!-- unterminated <p>comment"
    )
    assert to_text(html) == "one\n\ntwo bold\nthree\n\n* a\n* b\n\nx | y\nz\n\ntail open link (https://x.org/u)\n"


def test_a_list_after_text_is_a_paragraph(to_text: Render) -> None:
    assert to_text("Intro:<ul><li>a</li></ul>after") == "Intro:\n\n* a\n\nafter\n"


def test_marked_sections_are_bogus_comments(to_text: Render) -> None:
    # Outlook's downlevel-revealed conditionals, CDATA, and a name Python's parser
    # does not know (it raises AssertionError there before 3.13.4).
    assert to_text("<![if !mso]>Shown<![endif]> a<![CDATA[x]]>b<![foo[x]]>c") == "Shown abc\n"


@pytest.mark.parametrize(
    ("html", "text"),
    [
        ("<head><title>T</title><meta charset=utf-8>Loose text<p>para", "Loose text\n\npara\n"),
        ("<html><head><style>p{}</style><p>No body tag</p>", "No body tag\n"),
    ],
)
def test_an_unclosed_head_ends_at_content(to_text: Render, html: str, text: str) -> None:
    assert to_text(html) == text


@pytest.mark.parametrize(
    "html", ["", "   \n\t ", "<p></p>", "<!-- only a comment -->", "<html><head><title>T</title></head></html>",
             "<script>x()</script>", "<!DOCTYPE html>", "&nbsp;", "<div><br><br></div>"],
)
def test_html_without_text_gives_empty_text(to_text: Render, html: str) -> None:
    assert to_text(html) == ""


def test_input_cleaning(to_text: Render) -> None:
    assert to_text("a\r\nb\x00c\x07d\ud800e\ufdd0f<pre>g\rh\x0ci</pre>") == "a bcd\ufffdef\n\ng\nh i\n"


# --------------------------------------------------------------------------- #
# Which backend renders
# --------------------------------------------------------------------------- #


def test_inscriptis_renders_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("inscriptis")
    assert _html_text._inscriptis_available()
    calls: list[str] = []

    def fallback(html: str) -> str:
        calls.append(html)
        return "fallback\n"

    monkeypatch.setattr(_html_text, "_render_stdlib", fallback)
    assert html_to_text("<p>Hello</p>") == "Hello\n"
    assert calls == []


def test_inscriptis_is_absent_when_its_import_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "inscriptis", None)  # import raises ImportError
    assert _html_text._inscriptis_available.__wrapped__() is False


def test_nesting_too_deep_for_lxml_falls_back() -> None:
    pytest.importorskip("inscriptis")
    html = "<div>" * 300 + "deep text"
    assert _render_inscriptis(html) is None  # lxml would drop the text below depth 256
    assert html_to_text(html) == "deep text\n"


def test_large_input_skips_inscriptis(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("inscriptis")
    calls: list[str] = []

    def inscriptis(html: str) -> str:
        calls.append(html)
        return "inscriptis\n"

    monkeypatch.setattr(_html_text, "_render_inscriptis", inscriptis)
    articles = articles_for(_html_text._INSCRIPTIS_MAX_CHARS + 1)
    assert html_to_text(newsletter(articles)) == newsletter_text(articles)
    assert calls == []
    assert html_to_text("<p>small</p>") == "inscriptis\n"


def test_an_inscriptis_failure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("inscriptis")

    def fail(html: str) -> str:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(_html_text, "_render_inscriptis", fail)
    assert html_to_text("<p>Hello <a href='https://x.org/'>you</a></p>") == "Hello you (https://x.org/)\n"


# --------------------------------------------------------------------------- #
# Size and robustness
# --------------------------------------------------------------------------- #


def test_ten_megabytes() -> None:
    articles = articles_for(10_000_000)
    assert html_to_text(newsletter(articles)) == newsletter_text(articles)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: "<a" * (n // 2),  # start tags never closed
        lambda n: "<!--" * (n // 4),  # comments never closed
        lambda n: "<a b='" * (n // 6) + ">",
        lambda n: "<![CDATA[" * (n // 9) + ">",
        lambda n: "<div>" * (n // 5) + "deep",
        lambda n: "<ul><li>x" * (n // 9),
        lambda n: "<table><tr>" + "<td>x" * (n // 5),
        lambda n: "<p>" + "<b>w</b> " * (n // 9),
    ],
    ids=["open-tags", "open-comments", "open-quotes", "cdata", "deep-divs", "deep-lists", "wide-row", "long-line"],
)
def test_a_megabyte_of_pathological_html_finishes(make: Callable[[int], str]) -> None:
    # Quadratic handling would take minutes here (the stdlib parser's rescans
    # of unterminated constructs took 15 s for 100 KB before _drop_unterminated).
    text = html_to_text(make(1_000_000))
    assert isinstance(text, str)
    assert all(line == line.rstrip() for line in text.split("\n"))


def assert_well_formed(text: str) -> None:
    assert text == "" or (text.endswith("\n") and not text.endswith("\n\n") and not text.startswith("\n"))
    assert "\n\n\n" not in text
    assert all(line == line.rstrip() for line in text.split("\n"))
    assert "\ufdd0" not in text
    text.encode("utf-8")  # no lone surrogate


TAG_SOUP = st.lists(
    st.sampled_from([
        "<p>", "</p>", "<div>", "</div>", "<a href='https://x.org/'>", "<a href=#t>", "</a>",
        "<ul>", "<ol start=2>", "</ul>", "</ol>", "<li>", "</li>", "<table>", "</table>", "<tr>",
        "<td>", "</td>", "<th>", "<pre>", "</pre>", "<br>", "<hr>", "<img alt='pic'>", "<b>", "</b>",
        "<script>", "</script>", "<style>", "<head>", "<title>", "<template>", "<span hidden>",
        "<!--", "-->", "<![CDATA[", "]]>", "<![if mso]>", "<!x", "<?php", "<", ">", "/>", "'", '"',
        "&amp;", "&", "&#", "&#x1F600;", "&nbsp;", "text", " ", "\n", "\t", "é", "\x00", "\ud800",
        "\ufdd0", "</", "<h1>", "<blockquote>", "<dl><dt>", "<dd>",
    ]),
    max_size=40,
).map("".join)


@settings(deadline=None, max_examples=300)
@given(st.one_of(st.text(), TAG_SOUP))
def test_any_text_renders_without_error(html: str) -> None:
    assert_well_formed(html_to_text(html))
    assert_well_formed(_render_stdlib(_clean_input(html)))
    if _html_text._inscriptis_available():
        rendered = _render_inscriptis(_clean_input(html))
        assert rendered is None or isinstance(rendered, str)
        if rendered is not None:
            assert_well_formed(rendered)
