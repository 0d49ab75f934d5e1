"""Nothing from the data runs in a reader's browser: every string of a table reaches a page as the literal text it
is, in the pages' Markdown, their HTML tables and folds, their charts' scripts and the stored notebooks of the
appendix. These tests render through the parsers the book and JupyterLab use; test_book.py reads every page of the
one build the suite makes, whose data has two GPUs every string of which, a device name among them, is markup
(`poison.poison_gpu`, `poison.poison_source_gpu`), and opens them in a browser.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pandas as pd
import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

from conftest import REPO
from poison import LABEL_PAYLOAD, NOT_READ, PAYLOAD, kept, problems, shows, visible_text
from medddpm.report import charts, safe, tables
from medddpm.store import schema

HOSTILE = [PAYLOAD, LABEL_PAYLOAD, "# a heading", "- a list", "1. ordered", "2) ordered", "> quote", "=== setext",
           "+ plus", "% MyST comment", "(target)=", ":::{note}", "{eval}`1+1`", "```{raw} html", "a\n\n```\nb",
           "`a``b`", "` lead", "trail `", "x  \ny", "&lt;entity&gt; &#60;", "<!-- comment", "|a|b|\n|-|-|",
           "~~gone~~", "a\\", "[x]: javascript:alert(1)", "<http://example.com>", "    indented"]

# The book renders a page's Markdown output as CommonMark with raw HTML (myst-nb's default); JupyterLab as GitHub's
# Markdown with $ math. Both parsers, as markdown-it has them.
BOOK = MarkdownIt("commonmark")
LAB = MarkdownIt("commonmark").enable(["table", "strikethrough"]).use(dollarmath_plugin)


TEMPLATE_TAGS = re.compile(r"</?(ul|li|p|strong|code|details|summary)>")  # the tags of the sources below


@pytest.mark.parametrize("parser", [BOOK, LAB], ids=["book", "jupyterlab"])
@pytest.mark.parametrize("value", HOSTILE)
def test_a_value_reads_as_its_own_text_in_markdown_and_html(value, parser):
    text = " ".join(value.split())
    for where, source, times in [("a list item", f"- **{safe.md(value)}**, {safe.md(value)}", 2),
                                 ("a paragraph", f"{safe.md(value)} and {safe.code(value)}", 2),
                                 ("an HTML block", f"<details><summary>x</summary>\n{safe.md(value)}\n</details>", 1)]:
        out = parser.render(source)
        assert "<" not in TEMPLATE_TAGS.sub("", out), f"{where}: markup from {value!r}: {out!r}"
        assert visible_text(out).count(text) == times, f"{where}: {value!r} -> {out!r}"
    assert text in visible_text(safe.html(value)) and "<" not in safe.html(value)


def test_plain_names_stay_as_they_are():
    """A label, a configuration or a version reads the same in the Markdown source (and on a terminal)."""
    for name in ("nvidia-h200", "opt1", "best+precision=tf32", "2.11.0+cu130", "paper 128x128x128", "cpu-node-1"):
        assert safe.md(name) == name and safe.code(name) == f"`{name}`"
    assert safe.md("- x").startswith("&#45;") and safe.md("1. x") == "1&#46; x"
    assert safe.code("a`b") == "``a`b``" and safe.code("") == ""


def test_a_chart_s_data_cannot_end_its_script():
    import altair as alt

    charts.setup()
    value = "</script><script>window.__pwned=1</script><!--"
    html = alt.Chart(pd.DataFrame({"a": [value]})).mark_point().encode(x="a")._repr_mimebundle_()
    html = (html[0] if isinstance(html, tuple) else html)["text/html"]
    assert "</script><script>window" not in html and "<!--" not in html
    spec = json.JSONDecoder().raw_decode(html, html.rindex("})({") + 3)[0]
    assert next(iter(spec["datasets"].values()))[0]["a"] == value, "the escaped JSON holds the same value"


def test_tables_escape_cells_column_names_and_index():
    df = pd.DataFrame({PAYLOAD: [PAYLOAD], "ms": [1.5], "device": [LABEL_PAYLOAD]}, index=[PAYLOAD])
    for out in (tables.table_html(df), charts.table(df).to_html(), safe.styled(df).to_html()):
        assert not problems(out, "table"), problems(out, "table")
        assert shows(out) and shows(out, LABEL_PAYLOAD)


def test_the_appendix_shows_a_stored_notebook_s_outputs_as_text(tmp_path):
    spec = importlib.util.spec_from_file_location("medddpm_book", REPO / "book" / "_ext" / "medddpm_book.py")
    book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book)
    outputs = [{"output_type": "display_data", "data": {"text/html": PAYLOAD}},
               {"output_type": "display_data", "data": {"text/html": PAYLOAD, "text/plain": "a table"}},
               {"output_type": "display_data", "data": {"text/markdown": "<script>window.__pwned=7</script> "
                                                                         "[pwn](javascript:window.__pwned=8)"}},
               {"output_type": "display_data", "data": {"image/png": 'x" onerror="window.__pwned=6'}}]
    html = "".join(n.astext() if n.tagname == "raw" else f"<pre>{safe.html(n.astext())}</pre>"
                   for o in outputs for n in book._output_nodes(o))
    assert not problems(html, "appendix"), problems(html, "appendix")
    assert shows(html) and "a table" in html


def test_what_is_not_poisoned_cannot_carry_markup_to_a_page():
    """An enum column refuses any other value on reading; every other string column of the tables the book reads
    is poisoned (`poison.kept` says why each left alone is)."""
    for table, enums in schema.ENUMS.items():
        valid = {c: [allowed[0]] for c, allowed in enums.items()}
        for column, allowed in enums.items():
            with pytest.raises(schema.SchemaError, match=column):
                schema.check_values(pd.DataFrame(valid | {column: [allowed[0] + PAYLOAD]}), table)
    for table in schema.TABLES:
        assert set(kept(table)) <= set(schema.TABLES[table]), table
    assert set(NOT_READ) < set(schema.TABLES)
