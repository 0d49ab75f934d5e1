"""A string from a table as the literal text a reader sees: the one way a page's text takes in what the data says.

The book is read by people who never see its data. A run's message, a GPU's name, a kernel's signature or a label
folder's name is whatever the machine (or whoever wrote the table) put there, and a page shows it inside Markdown
(IPython's `Markdown`, which the book renders as CommonMark with raw HTML allowed, and JupyterLab as GitHub's
Markdown with ``$`` math), inside HTML (tables, folds, captions) or inside the JSON of a chart's ``<script>``. In
each, a value that holds markup would be read as markup: ``<script>`` runs, ``[x](javascript:...)`` links,
``*a*`` slants, a backtick closes the code span around it, a ``</script>`` in a chart's data ends the script early.

- `md`: a value inside Markdown text (a sentence, a list item, a heading). Every character that can
  start markup, and the first one where it could open a block, becomes a numeric character reference (``&#60;``),
  which CommonMark reads as that literal character, never as syntax, and which HTML reads the same: the value
  shows as itself whether the text around it is parsed as Markdown or as an HTML block. Runs of white space,
  line breaks included, become one space, as a browser shows them, so a value never starts a line of its own.
- `code`: a value as a Markdown code span, set in a backtick fence longer than any run of backticks it holds
  (Markdown only: inside HTML a code span is not read, and its text is raw).
- `html`: a value inside HTML text or an attribute.
- `inline_html`: a line of such Markdown as HTML, for a place that takes HTML only (a fold).
- `ScriptJSON`: the JSON encoder of a chart's spec, which a page embeds in a ``<script>`` element: ``<``, ``>``
  and ``&`` written as ``\\u003c``, ``\\u003e``, ``\\u0026``, the same JSON values.
- `styled`: a pandas Styler whose cells, column names and index show their text as text (a Styler escapes none
  of them by default).

A page module wraps each value from the data in one of these where it builds its text (``f"... {md(r.message)}"``);
text the package writes itself (configuration names it defines, numbers it formats) needs none.
"""

from __future__ import annotations

import html as _html
import json
import re

import pandas as pd

# Characters that can start inline markup anywhere in a line: CommonMark's escapes, code spans, emphasis, links and
# images, autolinks and raw HTML, entity references; GitHub's tables and strikethrough; MyST's roles; the ``$`` of
# math (JupyterLab, MyST's dollarmath); quotes, which end an HTML attribute.
INLINE = frozenset("\\`*_[]<>&|~${}\"'")
# Characters that open a block where they start a line: headings, lists, block quotes, setext underlines, MyST's
# comments, targets and colon fences, a directive's options.
BLOCK = frozenset("#-+=>%:!(")
_ORDERED = re.compile(r"\d{1,9}(?=[.)](?: |$))")  # "1. " or "1)" at the start of a line opens an ordered list


def _ref(ch: str) -> str:
    return f"&#{ord(ch)};"


def md(value) -> str:
    """`value` (any table cell; `str()` of it) as Markdown that reads as its literal text."""
    text = " ".join(str(value).split())
    out = "".join(_ref(ch) if ch in INLINE else ch for ch in text)
    if out[:1] in BLOCK:
        out = _ref(out[0]) + out[1:]
    elif m := _ORDERED.match(out):
        out = out[:m.end()] + _ref(out[m.end()]) + out[m.end() + 1:]
    return out


def code(value) -> str:
    """`value` as a Markdown code span: its text exactly, whatever backticks it holds ('' for an empty value)."""
    text = " ".join(str(value).splitlines())
    if not text:
        return ""
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    # CommonMark takes one space off each end of a span that starts and ends with one: padding keeps a leading or
    # trailing backtick or space as it is
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def html(value) -> str:
    """`value` as HTML text or an attribute's value (quotes included)."""
    return _html.escape(str(value), quote=True)


def inline_html(markdown: str) -> str:
    """One line of a page module's Markdown (its values set with `md` and `code`) as HTML: CommonMark, as the book
    renders the pages' Markdown, so that the line reads the same in a fold as in the page's text."""
    from markdown_it import MarkdownIt  # the book's Markdown parser

    return MarkdownIt("commonmark").renderInline(markdown)


_SCRIPT = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


class ScriptJSON(json.JSONEncoder):
    """JSON that can sit inside a ``<script>`` element: no ``</script>`` or ``<!--`` in a string ends or hides it."""

    def encode(self, o) -> str:
        return super().encode(o).translate(_SCRIPT)

    def iterencode(self, o, _one_shot: bool = False):
        for chunk in super().iterencode(o, _one_shot):
            yield chunk.translate(_SCRIPT)


def styled(df: pd.DataFrame, formats: dict | None = None, **kw) -> pd.io.formats.style.Styler:
    """`df`'s Styler with its cells' text, column names and index labels HTML-escaped; `formats` (column ->
    function, as `Styler.format` takes them) apply to the escaped text, so what they add stays markup; `kw` as
    `Styler.format` takes them (``na_rep``)."""
    return (df.style.format(formats, escape="html", **kw)
            .format_index(escape="html", axis=0).format_index(escape="html", axis=1))
