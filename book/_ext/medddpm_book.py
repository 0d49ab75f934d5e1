"""Sphinx extension for the Med-DDPM book (Jupyter Book 1): offline charts, clean pages, the appendix.

1. Offline vega. Altair 6's HTML output loads vega, vega-lite and vega-embed from a CDN unless
   ``VEGA_DEBUG.<lib>_version`` already equals the version it asks for. At build time this writes
   ``_static/medddpm-vega.js``: ``vl_convert.javascript_bundle()`` wrapped in a function scope (its
   top-level constants would clash on a Sphinx page), then ``VEGA_DEBUG`` set to Altair's versions,
   plus AMD ``define``s for pages that load require.js (Altair then asks require.js instead).
2. Sphinx-thebe registers its ``const THEBE_JS_URL`` script once per ``env-before-read-docs``; a
   second registration makes every page throw "Identifier 'THEBE_JS_URL' has already been declared".
   Duplicate inline scripts are dropped from each page.
3. Math without MathJax: Sphinx's MathJax comes from a CDN. ``$...$`` and ``$$...$$`` are converted
   to MathML at build time (``latex2mathml``), which Chromium draws natively; no script at all.
4. ``producer-notebooks`` directive: renders the stored, executed producer notebooks
   ``<data>/<gpu>/<config>/produce.ipynb`` (outputs as stored, never executed) as sections of a page; what they
   hold is data, shown as text (their HTML as its source, their Markdown without raw HTML).
   ``<data>`` is ``$MEDDDPM_DATA`` or ``<repository>/data``. Progress bars are left out (`strip_progress`):
   a bar that redraws itself is one stream message per update in a stored notebook, thousands of grey boxes
   on a page, and says nothing the run's tables do not.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from medddpm.store.layout import NOTEBOOK_FILE, data_root, hidden

logger = logging.getLogger(__name__)

VEGA_JS = "medddpm-vega.js"
CSS = "medddpm-book.css"
CSS_TEXT = """/* book/_ext/medddpm_book.py */
div.math > math { flex-grow: 1; overflow-x: auto; padding-bottom: .2rem; font-size: 1.15em; }
span.math > math { font-size: 1.05em; }
.medddpm-nb-image { max-width: 100%; }
p.medddpm-same-code { font-style: italic; margin: .2rem 0; }
details.medddpm-notebook > summary, details.medddpm-fold > summary {
  cursor: pointer; font-weight: 600; margin: .5rem 0; }
"""
REPO = Path(__file__).resolve().parents[2]


# --- 1. offline vega -------------------------------------------------------------------------------

def _altair_versions() -> dict[str, str]:
    import altair as alt

    return {"vega": alt.VEGA_VERSION, "vega-lite": alt.VEGALITE_VERSION, "vega-embed": alt.VEGAEMBED_VERSION}


def vega_script() -> str:
    """The JavaScript file: the vl-convert bundle in a function scope, then what Altair's loader checks."""
    import vl_convert as vlc

    versions = _altair_versions()
    vl_minor = ".".join(versions["vega-lite"].split(".")[:2])
    if vl_minor not in vlc.get_vegalite_versions():
        raise RuntimeError(
            f"vl-convert-python {getattr(vlc, '__version__', '?')} bundles Vega-Lite {vlc.get_vegalite_versions()}, "
            f"not the {versions['vega-lite']} that altair asks for: pin matching versions in requirements.txt"
        )
    bundle = vlc.javascript_bundle(vl_version=vl_minor)
    # Altair's template: VEGA_DEBUG[`${lib.replace("-", "")}_version`] == version skips the CDN script.
    debug = {f"{lib.replace('-', '')}_version": v for lib, v in versions.items()}
    return (
        f"/* vega {vlc.get_vega_version()}, vega-lite {vl_minor}, vega-embed {vlc.get_vega_embed_version()}: "
        "vl_convert.javascript_bundle(), written by book/_ext/medddpm_book.py */\n"
        "(function () {\n" + bundle + "\n}).call(window);\n"
        "(function () {\n"
        "  var d = window.VEGA_DEBUG = window.VEGA_DEBUG || {};\n"
        + "".join(f"  d[{json.dumps(k)}] = {json.dumps(v)};\n" for k, v in debug.items())
        + "  if (typeof define === 'function' && define.amd) {\n"
        "    define('vega', [], function () { return window.vega; });\n"
        "    define('vega-lite', [], function () { return window.vegaLite; });\n"
        "    define('vega-embed', [], function () { return window.vegaEmbed; });\n"
        "  }\n"
        "})();\n"
    )


def _add_vega_js(app: Sphinx) -> None:
    if app.builder.format == "html":
        # Synchronous, in <head>, after any require.js: Altair's inline scripts in <body> need it loaded.
        app.add_js_file(VEGA_JS, priority=900)
        app.add_css_file(CSS)


def _write_vega_js(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    import altair as alt
    import vl_convert as vlc

    key = json.dumps([getattr(vlc, "__version__", ""), vlc.get_vegalite_versions(), _altair_versions(), alt.__version__])
    cache = Path(app.doctreedir) / "medddpm-vega.cache.js"
    cache_key = cache.with_suffix(".key")
    if not (cache.exists() and cache_key.exists() and cache_key.read_text() == key):
        cache.write_text(vega_script(), encoding="utf-8")
        cache_key.write_text(key)
    dest = Path(app.outdir) / "_static" / VEGA_JS
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(cache.read_bytes())
    (dest.parent / CSS).write_text(CSS_TEXT, encoding="utf-8")


# --- 2. duplicate inline scripts -------------------------------------------------------------------

def _dedupe_scripts(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    files = context.get("script_files")
    if not files:
        return
    seen, kept = set(), []
    for js in files:
        body = (getattr(js, "attributes", None) or {}).get("body")
        key = ("body", body) if body else ("src", str(js))
        if key in seen:
            continue
        seen.add(key)
        kept.append(js)
    context["script_files"] = kept


# --- 3. math as MathML ----------------------------------------------------------------------------

def _mathml(self, node, display: str) -> str:
    from latex2mathml.converter import convert

    latex = node.astext()
    try:
        return convert(latex, display=display)
    except Exception as e:  # latex2mathml raises its own errors for unsupported commands
        logger.warning(f"math: cannot convert {latex!r} to MathML ({type(e).__name__}: {e}); simplify it",
                       location=node, type="medddpm", subtype="math")
        return f"<code>{self.encode(latex)}</code>"


def _visit_math(self, node: nodes.math) -> None:
    self.body.append(self.starttag(node, "span", "", CLASS="math notranslate nohighlight"))
    self.body.append(_mathml(self, node, "inline") + "</span>")
    raise nodes.SkipNode


def _visit_displaymath(self, node: nodes.math_block) -> None:
    from sphinx.util.math import get_node_equation_number

    self.body.append(self.starttag(node, "div", CLASS="math notranslate nohighlight"))
    if node.get("number"):
        self.body.append(f'<span class="eqno">({get_node_equation_number(self, node)})')
        self.add_permalink_ref(node, "Link to this equation")
        self.body.append("</span>")
    self.body.append(_mathml(self, node, "block") + "</div>\n")
    raise nodes.SkipNode


# --- 4. the stored producer notebooks --------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def producer_notebooks(root: Path) -> list[Path]:
    """``<root>/<gpu>/<config>/produce.ipynb``, hidden (in-progress) folders left out; GPUs before CPUs (a CPU's
    folder is ``cpu`` or ``cpu-<host>``), as every page lists devices."""
    found = [p for p in root.glob(f"*/*/{NOTEBOOK_FILE}") if not any(hidden(part) for part in p.relative_to(root).parts)]
    return sorted(found, key=lambda p: (bool(CPU_LABEL.match(p.relative_to(root).parts[0])), p.relative_to(root).parts))


def _text(x) -> str:
    return "".join(x) if isinstance(x, list) else (x or "")


def _markdown_html(src: str, shift: int) -> str:
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    out = md.render(src)

    def _h(m):
        level = min(6, int(m.group(2)) + shift)
        return f"<{m.group(1)}h{level}"

    return re.sub(r"<(/?)h([1-6])", _h, out)


def _literal(text: str, language: str = "none", classes: tuple[str, ...] = ()) -> nodes.literal_block:
    node = nodes.literal_block(text, text, language=language)
    node["classes"].extend(classes)
    return node


def _container(*classes: str) -> nodes.container:
    node = nodes.container()
    node["classes"].extend(classes)
    return node


# tqdm's text bar, "desc: 40%|████      | 2/5 [00:42<00:52, 17.45s/it]", and its form without a total,
# "desc: 12it [00:03, 3.9it/s]"; a redraw starts with a carriage return.
BAR_END = re.compile(r"\[[\d:]+(?:<[\d:?]+)?,\s*[^\]\r\n]*?(?:/s|s/)[^\]\r\n]*\]")  # a bar's [elapsed<left, rate]
PROGRESS = re.compile(r"[^\r\n]*?(?:\d+%\|[^|\r\n]*\||\d+(?:\.\d+)?[kMG]?[a-zA-Z]*)\s*[\d.?]*[kMG]?/?[\d.?]*[kMG]?\s*"
                      + BAR_END.pattern)
# tqdm.auto's warning that it falls back to text bars (no ipywidgets in the kernel), and the line it quotes
TQDM_WARNING = re.compile(r"[^\n]*TqdmWarning: IProgress not found[^\n]*\n?"
                          r"(?:[ \t]+from \.autonotebook import[^\n]*\n?)?")


# torch's profiler (kineto) notes "USDT: ... profiler_start" at every start and stop: native noise, not the run's
USDT = re.compile(r"^USDT:")
WIDE = 160  # a printed table this wide is padded out to its longest value: its runs of spaces are narrowed
CPU_LABEL = re.compile(r"cpu(?:$|[-_@.])")


def _strip_stream(text: str) -> str:
    # Every bar ends as BAR_END does: a text without one holds none, and PROGRESS, which tries every position of
    # every line, takes seconds to say so of a stored notebook's printed tables.
    text = TQDM_WARNING.sub("", PROGRESS.sub("", text) if BAR_END.search(text) else text)
    lines = [seg for line in text.split("\n") for seg in line.split("\r")]
    lines = [re.sub(r" {3,}", "  ", line.rstrip()) if len(line) > WIDE else line.rstrip()
             for line in lines if line.strip() and not USDT.match(line)]
    return "\n".join(lines) + ("\n" if lines else "")


def strip_progress(outputs: list[dict]) -> list[dict]:
    """A cell's outputs without progress bars: consecutive stream messages of one stream joined, tqdm's bars
    and its fallback warning taken out, streams left empty dropped. Other outputs are kept as they are."""
    kept: list[dict] = []
    for out in outputs:
        if out.get("output_type") == "stream" and kept and kept[-1].get("output_type") == "stream" \
                and kept[-1].get("name") == out.get("name"):
            kept[-1] = {**kept[-1], "text": _text(kept[-1].get("text")) + _text(out.get("text"))}
        else:
            kept.append(dict(out))
    result = []
    for out in kept:
        if out.get("output_type") == "stream":
            text = _strip_stream(_text(out.get("text")))
            if not text:
                continue
            out["text"] = text
        result.append(out)
    return result


def _output_nodes(out: dict) -> list[nodes.Node]:
    kind = out.get("output_type")
    if kind == "stream":
        cls = "stderr" if out.get("name") == "stderr" else "stream"
        return [_literal(ANSI.sub("", _text(out.get("text"))).rstrip("\n"), classes=("output", cls))]
    if kind == "error":
        tb = "\n".join(ANSI.sub("", line) for line in out.get("traceback", [])) or f"{out.get('ename')}: {out.get('evalue')}"
        return [_literal(tb, language="ipythontb", classes=("output", "traceback"))]
    data = out.get("data", {})
    # A stored notebook is data: its HTML is shown as the text it is (after its plain form, where it has one), never
    # as markup of the page; an image is an <img> (an SVG's scripts do not run there) whose bytes are base64, which
    # cannot leave the attribute; Markdown is rendered without raw HTML.
    for mime in ("image/svg+xml", "image/png", "image/jpeg", "text/markdown", "text/plain", "text/html"):
        if mime not in data:
            continue
        value = _text(data[mime])
        if mime == "image/svg+xml":
            uri = "data:image/svg+xml;base64," + base64.b64encode(value.encode()).decode()
            return [nodes.raw("", f'<img class="medddpm-nb-image" src="{uri}" alt="output"/>', format="html")]
        if mime.startswith("image/"):
            b64 = "".join(value.split())
            try:
                base64.b64decode(b64, validate=True)
            except ValueError:
                return [_literal(f"({mime} output whose bytes are not base64: left out)", classes=("output",))]
            return [nodes.raw("", f'<img class="medddpm-nb-image" src="data:{mime};base64,{b64}" alt="output"/>',
                              format="html")]
        if mime == "text/markdown":
            return [nodes.raw("", _markdown_html(value, 3), format="html")]
        return [_literal(value, classes=("output", mime.replace("/", "_")))]
    return []


def render_notebook(path: Path, root: Path, shown: dict[str, str] | None = None, title: str = "") -> list[nodes.Node]:
    """The notebook's cells as nodes. `shown` (source -> title of the notebook that showed it first), shared by the
    notebooks of one page: a cell whose source an earlier notebook showed is one line naming that notebook, so
    that the code every run shares is set once (its parameters and outputs are each run's own)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    lang = nb.get("metadata", {}).get("kernelspec", {}).get("language", "python")
    lexer = "ipython3" if lang == "python" else lang
    shown = {} if shown is None else shown
    out: list[nodes.Node] = []
    for cell in nb.get("cells", []):
        src = _text(cell.get("source"))
        first = shown.setdefault(src, title) if src.strip() else title
        if cell.get("cell_type") == "markdown":
            if first == title:
                out.append(nodes.raw("", _markdown_html(src, 2), format="html"))
        elif cell.get("cell_type") == "code":
            box = _container("cell", "docutils")
            tags = cell.get("metadata", {}).get("tags", [])
            box["classes"].extend(f"tag_{t}" for t in tags)
            inp = _container("cell_input", "docutils")
            if first == title:
                inp += _literal(src, language=lexer)
            else:
                inp += nodes.raw("", f'<p class="medddpm-same-code">same code as the notebook of {html.escape(first)}</p>',
                                 format="html")
            box += inp
            outputs = [n for o in strip_progress(cell.get("outputs", [])) for n in _output_nodes(o)]
            if outputs:
                res = _container("cell_output", "docutils")
                res.extend(outputs)
                box += res
            out.append(box)
    return out


class ProducerNotebooks(SphinxDirective):
    """One section per stored producer notebook under the data root (``$MEDDDPM_DATA`` or ``data``)."""

    has_content = False
    option_spec = {"data": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        root = Path(self.options.get("data") or data_root())
        if not root.is_absolute():
            root = REPO / root
        found = producer_notebooks(root)
        if not found:
            logger.warning(f"producer-notebooks: no <gpu>/<config>/produce.ipynb under {root}",
                           location=self.get_location(), type="medddpm", subtype="data")
            return []
        result: list[nodes.Node] = []
        shown: dict[str, str] = {}  # a cell's source -> the first notebook on the page that shows it
        for path in found:
            self.env.note_dependency(str(path))
            rel = path.relative_to(root)
            gpu, config = rel.parts[0], rel.parts[1]
            title = f"{gpu} / {config}"
            section = nodes.section(ids=[nodes.make_id(f"producer-{gpu}-{config}")], names=[nodes.fully_normalize_name(title)])
            section += nodes.title(title, title)
            para = nodes.paragraph()
            para += nodes.Text("Stored, executed notebook ")
            para += nodes.literal(f"data/{rel}", f"data/{rel}")
            para += nodes.Text(" (rendered as stored, not re-executed; progress bars left out).")
            section += para
            try:
                cells = render_notebook(path, root, shown, title)
            except (ValueError, KeyError, OSError) as e:
                logger.warning(f"producer-notebooks: cannot read {path}: {e}", location=self.get_location(),
                               type="medddpm", subtype="data")
                continue
            # Folded: the page lists every run; a reader opens the notebook of the one they look into.
            section += nodes.raw("", f'<details class="medddpm-notebook"><summary>the notebook of '
                                     f'{html.escape(title)}</summary>', format="html")
            section.extend(cells)
            section += nodes.raw("", "</details>", format="html")
            result.append(section)
        return result


def _use_mathml(app: Sphinx, config) -> None:
    config.html_math_renderer = "mathml"


def setup(app: Sphinx) -> dict:
    # sphinx-external-toc always loads sphinx-multitoc-numbering, which does not declare itself
    # parallel-read safe; it only renumbers sections after reading (and is off: _config.yml), so the
    # parallel read of scripts/book.sh (BOOK_JOBS) is safe. Without this Sphinx warns and reads serially.
    multitoc = app.extensions.get("sphinx_multitoc_numbering")
    if multitoc is not None and multitoc.parallel_read_safe is None:
        multitoc.parallel_read_safe = True
    app.add_html_math_renderer("mathml", (_visit_math, None), (_visit_displaymath, None))
    app.connect("config-inited", _use_mathml)
    app.connect("builder-inited", _add_vega_js)
    app.connect("build-finished", _write_vega_js)
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    app.add_directive("producer-notebooks", ProducerNotebooks)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
