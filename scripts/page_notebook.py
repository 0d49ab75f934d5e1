"""A book page (a MyST text notebook, book/*.md) as a notebook for JupyterLab, its solutions folded.

    python scripts/page_notebook.py book/workshop.md runs/jupyterlab/workshop.ipynb

jupytext turns the page into cells; in JupyterLab the `jupyterlab-myst` extension renders each
Markdown cell with mystmd, so an ``{exercise}`` directive renders as a numbered box. A gated solution
of sphinx-exercise (``{solution-start}`` ... ``{solution-end}``, spanning code cells) does not: its two
ends sit in different cells, and the whole answer would show. Each gate is therefore rewritten:

- its start becomes a Markdown cell of its own, a heading "Solution to Exercise N" one level below the
  section's, stored collapsed (cell metadata ``jp-MarkdownHeadingCollapsed``): JupyterLab hides every
  cell under a collapsed heading, up to the next heading of the same or a higher level, and shows
  "N cells hidden" beside it;
- the gate's Markdown stays as it is, its code cells too, under that heading;
- a page that ends on a solution gets a last heading, "End of the page", outside the fold.

A collapsed heading holds where per-cell folding does not: JupyterLab clears a code cell's
``outputs_hidden`` whenever the cell runs, so "Run All" would print every answer, while cells under a
collapsed heading run and stay hidden. A student sees each exercise and opens its answer on purpose:
the caret beside the heading, the "cells hidden" button, or Shift+Enter on the heading itself
(JupyterLab unfolds a heading when the active cell moves under it). The book itself is untouched.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import jupytext
import nbformat

# A directive's opening fence: ```{name} argument (backticks or colons, three or more).
_FENCE = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[\w-]+)\}\s*(?P<arg>.*?)\s*$")
_CODE_FENCE = re.compile(r"^\s{0,3}(?P<fence>`{3,}|~{3,}|:{3,})")
_OPTION = re.compile(r"^:(?P<key>[\w-]+):\s*(?P<value>.*?)\s*$")
_HEADING = re.compile(r"^\s{0,3}(?P<hashes>#{1,6})(\s|$)")
GATE_NAMES = ("solution-start", "solution-end")
EXERCISE_NAMES = ("exercise", "exercise-start")
COLLAPSED = "jp-MarkdownHeadingCollapsed"  # JupyterLab's cell metadata for a collapsed heading
END_TITLE = "End of the page"


class GateError(ValueError):
    """A solution that cannot be folded: a gate sphinx-exercise rejects too (unclosed, nested,
    unopened), or one whose end is not followed by a heading that closes its fold."""


def _directive_end(lines: list[str], start: int, fence: str) -> int:
    """Index of the line that closes the directive opened at `start` (its fence, at least as long)."""
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            return j
    raise GateError(f"unclosed directive: {lines[start].strip()}")


def _split(source: str) -> list[tuple[str, object]]:
    """The cell's text as ("text", str) runs and ("start", (label, options)) / ("end", None) gate marks."""
    lines = source.split("\n")
    parts: list[tuple[str, object]] = []
    text: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m and m["name"] in GATE_NAMES:
            end = _directive_end(lines, i, m["fence"])
            options = {o["key"]: o["value"] for o in map(_OPTION.match, lines[i + 1:end]) if o}
            parts.append(("text", "\n".join(text)))
            text = []
            parts.append(("start", (m["arg"], options)) if m["name"] == "solution-start" else ("end", None))
            i = end + 1
        else:
            text.append(lines[i])
            i += 1
    parts.append(("text", "\n".join(text)))
    return parts


def headings(text: str) -> list[int]:
    """Levels of the Markdown headings in `text`, in order, leaving out lines in fenced blocks (a
    shell comment in a code block is no heading)."""
    levels, fence = [], None
    for line in text.split("\n"):
        m = _CODE_FENCE.match(line)
        if fence is None and m:
            fence = m["fence"]
        elif fence is not None and line.strip() and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
            fence = None
        elif fence is None and (h := _HEADING.match(line)):
            levels.append(len(h["hashes"]))
    return levels


def exercise_numbers(nb: nbformat.NotebookNode) -> dict[str, int]:
    """Exercise label -> its number, counted in page order as sphinx-exercise and mystmd count them
    (an exercise with ``:nonumber:`` takes none)."""
    numbers: dict[str, int] = {}
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.split("\n")
        for i, line in enumerate(lines):
            m = _FENCE.match(line)
            if not (m and m["name"] in EXERCISE_NAMES):
                continue
            body = lines[i + 1:]
            options = {}
            for opt in body:
                if not (o := _OPTION.match(opt)):
                    break
                options[o["key"]] = o["value"]
            if "nonumber" in options:
                continue
            n += 1
            if "label" in options:
                numbers[options["label"]] = n
    return numbers


def _first_heading(text: str) -> int | None:
    """Level of the heading `text` opens with (after blank lines and MyST targets such as ``(name)=``),
    or None when it opens with anything else."""
    for line in text.split("\n"):
        if not line.strip() or re.fullmatch(r"\s*\(.+\)=\s*", line):
            continue
        m = _HEADING.match(line)
        return len(m["hashes"]) if m else None
    return None


def fold_solutions(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of `nb` with every solution gate under a collapsed heading (module docstring)."""
    out = copy.deepcopy(nb)
    numbers = exercise_numbers(out)
    cells: list[nbformat.NotebookNode] = []
    section = 1  # level of the last heading outside the solutions
    gate: tuple[str, int] | None = None  # (exercise label, heading level) inside a solution
    ended: tuple[str, int] | None = None  # a solution that ended, until a heading closes its fold

    def add(source: str, metadata: dict, cell_id: str) -> None:
        cell = nbformat.v4.new_markdown_cell(source, metadata=metadata)
        if any("id" in c for c in out.cells):
            cell.id = cell_id[-64:]  # named after the cell it comes from: unique, and no random part
        else:
            cell.pop("id", None)  # nbformat 4.4 and older have no cell ids
        cells.append(cell)

    for cell in out.cells:
        if cell.cell_type != "markdown":
            if ended is not None and cell.cell_type == "code":
                raise GateError(f"the solution of {ended[0]} ends on a code cell, with no heading to end its fold")
            cells.append(cell)
            continue
        pieces: list[str] = []
        for k, (kind, value) in enumerate(_split(cell.source)):
            if kind == "start":
                label = value[0]
                if gate is not None:
                    raise GateError(f"solution-start {label} inside the solution of {gate[0]}")
                if not label:
                    raise GateError("solution-start names no exercise")
                if pieces:
                    add("\n\n".join(pieces), dict(cell.metadata), f"{cell.get('id', '')}-{k}")
                    pieces = []
                gate = (label, min(section + 1, 6))
                title = f"Solution to Exercise {numbers[label]}" if label in numbers else f"Solution to {label}"
                add(f"{'#' * gate[1]} {title}", {COLLAPSED: True}, f"{cell.get('id', '')}-solution-{k}")
            elif kind == "end":
                if gate is None:
                    raise GateError("solution-end with no solution-start before it")
                if pieces:
                    add("\n\n".join(pieces), dict(cell.metadata), f"{cell.get('id', '')}-{k}")
                    pieces = []
                gate, ended = None, gate
            elif value.strip():
                levels = headings(value)
                if ended is not None:
                    first = _first_heading(value)
                    if first is None or first > ended[1]:
                        raise GateError(f"the solution of {ended[0]} is followed by text that does not open with a "
                                        f"heading of level {ended[1]} or higher, which its fold would hide: add one")
                    ended = None
                if gate is not None and any(level <= gate[1] for level in levels):
                    raise GateError(f"the solution of {gate[0]} holds a heading of level {min(levels)}, which would "
                                    f"end its fold early: use level {gate[1] + 1} or deeper")
                if gate is None and levels:
                    section = levels[-1]
                pieces.append(value.strip())
        if pieces:
            cell.source = "\n\n".join(pieces)
            cells.append(cell)
    if gate is not None:
        raise GateError(f"solution-start {gate[0]} has no solution-end")
    if ended is not None:
        # JupyterLab unfolds a collapsed heading when the active cell moves under it, and "Run All"
        # leaves the last cell active: a page that ends on a solution gets a last cell outside it.
        add(f"{'#' * max(ended[1] - 1, 1)} {END_TITLE}", {}, "end-of-page")
    out.cells = cells
    return out


def page_to_notebook(page: str | Path) -> nbformat.NotebookNode:
    """The page read by jupytext (its MyST format), solutions folded."""
    return fold_solutions(jupytext.read(str(page)))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/page_notebook.py book/PAGE.md OUT.ipynb", file=sys.stderr)
        return 2
    page, out = argv
    try:
        nb = page_to_notebook(page)
    except GateError as e:
        print(f"page_notebook: {page}: {e}", file=sys.stderr)
        return 1
    nbformat.validate(nb)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    jupytext.write(nb, out, fmt="ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
