"""Charts drawn in JupyterLab: what `altair.JupyterChart` (offline) needs there besides its renderer.

Most of the book's charts have width "container": Vega reads the width of the element that holds the
chart when it draws it, and again on a window `resize` event only. Two cases leave such a chart zero
pixels wide in a notebook:

- vega-embed's element is an inline-block, as wide as what it holds, so a chart in an output of its own
  has no width to take: JUPYTER_CHART_CSS makes it a block, as wide as the output area;
- a chart drawn while hidden (under a collapsed heading, such as the workshop's folded solutions, or in
  a tab in the background) reads a width of zero and keeps it when shown: each chart's element is
  watched (a ResizeObserver), and a change of its width sends Vega the `resize` event it listens to.
"""

from __future__ import annotations

import re

import altair as alt

# `!important`: vega-embed injects its own stylesheet after this one. `overflow: visible` is Altair's own
# rule (the action menu stays uncut).
JUPYTER_CHART_CSS = """
.vega-embed {
    overflow: visible;
    display: block !important;
}
"""

_MARK = "/* medddpm: redraw on resize */"
# Appended to Altair's bundled module, whose default export is the anywidget {render} object.
_REDRAW_ON_RESIZE = _MARK + """
{
  const widget = %(default)s;
  const render = widget.render;
  widget.render = async (context) => {
    const cleanup = await render(context);
    let width = context.el.getBoundingClientRect().width;
    const observer = new ResizeObserver(() => {
      const now = context.el.getBoundingClientRect().width;
      if (now !== width) {
        width = now;
        window.dispatchEvent(new Event("resize"));
      }
    });
    observer.observe(context.el);
    return () => {
      observer.disconnect();
      if (typeof cleanup === "function") cleanup();
    };
  };
}
"""


def redraw_on_resize(esm: str) -> str:
    """Altair's JupyterChart module with every chart redrawn when its element's width changes; `esm`
    unchanged where its default export is not a named object (another bundler's output)."""
    if _MARK in esm:
        return esm
    m = re.search(r"export\s*\{\s*([\w$]+)\s+as\s+default\s*\}", esm)
    return esm + "\n" + _REDRAW_ON_RESIZE % {"default": m[1]} if m else esm


def jupyter_chart_for_lab() -> None:
    """Style and patch `altair.JupyterChart` (class-wide settings, read by each new chart). Its offline
    module is loaded here, not at the first chart: Altair loads it once, so the patch stays."""
    alt.JupyterChart.enable_offline(True)
    alt.JupyterChart._css = JUPYTER_CHART_CSS
    alt.JupyterChart._esm = redraw_on_resize(alt.JupyterChart._esm)
