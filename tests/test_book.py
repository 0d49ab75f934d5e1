"""The book: a strict offline build, every page opened in headless Chromium with no network, and a
second GPU's data folder showing up in the comparison charts with no page edited, and every string of that
folder and of the first GPU with counters, which is markup (`poison.poison_gpu`, `poison.poison_source_gpu`), shown
as text and never run. One build serves them all (conftest.py's `built_book`, on a copy of data/ with a second GPU
folder added); a build that must fail is the only other run of scripts/book.sh.

Needs Debian `chromium` (/usr/bin/chromium; scripts/test.sh installs it) and the `playwright` Python
package (never `playwright install`). Skipped only when both are missing. The browser test leaves a
full-page screenshot of every page, as a reader first sees it, in runs/screens/page-<name>.png.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import threading
import time
from urllib.parse import urlsplit

import pytest

from conftest import FAKE_NAME, FAKE_SLUG, REPO, run_book_sh, toc_pages
import poison
from medddpm.store import schema
from medddpm.store.layout import PARTITION_FILE, table_of

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

try:
    import playwright.sync_api  # noqa: F401
    HAVE_PLAYWRIGHT = True
except ImportError:
    HAVE_PLAYWRIGHT = False
HAVE_CHROMIUM = os.access(CHROMIUM, os.X_OK)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not HAVE_PLAYWRIGHT and not HAVE_CHROMIUM,
    reason="book test needs Debian chromium (/usr/bin/chromium) and the playwright package: neither is installed "
           "(scripts/test.sh installs both)",
)]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def book_url(built_book):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built_book.html)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# In the page: is every Altair chart embedded and drawn? (an <svg> with mark items, or a non-blank <canvas>)
CHARTS_STATE = """() => {
  const out = [];
  for (const div of document.querySelectorAll('div[id^="altair-viz-"]')) {
    const err = div.querySelector('.error');
    const svg = div.querySelector('svg.marks');
    const canvas = div.querySelector('canvas.marks');
    let drawn = false;
    if (svg) drawn = svg.querySelectorAll('.role-mark path, .role-mark rect, .role-mark line, .role-mark text, .role-mark circle').length > 0;
    if (canvas && canvas.width > 0 && canvas.height > 0) {
      const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
      for (let i = 3; i < px.length; i += 4 * 7) { if (px[i] !== 0) { drawn = true; break; } }
    }
    out.push({id: div.id, embedded: div.classList.contains('vega-embed'), drawn,
              kind: svg ? 'svg' : (canvas ? 'canvas' : 'none'), error: err ? err.textContent : null});
  }
  return out;
}"""

SNAPSHOT = """(id) => {
  const div = document.getElementById(id);
  const svg = div.querySelector('svg.marks');
  if (svg) return svg.outerHTML;
  const canvas = div.querySelector('canvas.marks');
  return canvas ? canvas.toDataURL() : '';
}"""


def _wait_changed(page, chart_id: str, before: str, what: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        page.wait_for_timeout(100)
        if page.evaluate(SNAPSHOT, chart_id) != before:
            return
    raise AssertionError(f"{page.url}: {what} on chart #{chart_id} did not change what is drawn")


def _exercise_chart(page, chart_id: str, kinds: dict[str, int], twins: dict[str, str]) -> None:
    """Change every bound dropdown/radio, and click one legend entry; each must change the drawing. `twins`:
    a GPU folder and its copy under another name (FAKE_SLUG) hold the same numbers, so a GPU dropdown is
    switched to a GPU other than the current one's twin (with no other, it is left alone, as with one GPU)."""
    root = page.locator(f"#{chart_id}")
    for i, select in enumerate(root.locator(".vega-bind select").all()):
        options = select.locator("option").evaluate_all("os => os.map(o => o.value)")
        current = select.input_value()
        others = [o for o in options if o != current and o != twins.get(current)]
        if not others:
            continue
        before = page.evaluate(SNAPSHOT, chart_id)
        select.select_option(others[-1])
        _wait_changed(page, chart_id, before, f"dropdown {i} -> {others[-1]!r}")
        kinds["dropdown"] += 1
    radios = root.locator('.vega-bind input[type="radio"]')
    if radios.count() > 1:
        target = next((r for r in radios.all() if not r.is_checked()), None)
        if target is not None:
            before = page.evaluate(SNAPSHOT, chart_id)
            target.check()
            _wait_changed(page, chart_id, before, "radio button")
            kinds["radio"] += 1
    legends = root.locator("svg.marks g.role-legend")
    if legends.count() == 0 and root.locator("canvas.marks").count():
        return  # a canvas legend cannot be located; the pages use vega-embed's SVG renderer (its default)
    # Only charts whose legend is bound to a selection react to a click; Vega-Lite names those params.
    spec_has_legend_binding = page.evaluate(
        """(id) => { const s = document.getElementById(id).nextElementSibling;
                     return !!s && /"bind":\\s*"legend"/.test(s.textContent); }""", chart_id)
    # A one-entry legend (one GPU so far) selects everything or nothing: no visible change to expect. A
    # chart may also have legends no selection is bound to (point size): one of its legends must react.
    items = [lg.locator(".role-legend-symbol path") for lg in legends.all()]
    items = [it for it in items if it.count() > 1]
    if items and spec_has_legend_binding:
        for it in items:
            before = page.evaluate(SNAPSHOT, chart_id)
            it.nth(1).click(force=True)
            try:
                _wait_changed(page, chart_id, before, "legend click")
            except AssertionError:
                continue
            kinds["legend"] += 1
            return
        raise AssertionError(f"{page.url}: legend click on chart #{chart_id} did not change what is drawn")


def _check_solutions(page) -> int:
    """Folded exercise solutions (sphinx-exercise + sphinx-togglebutton): each one's body is hidden when
    the page loads and shown after a click on its toggle; returns how many were checked."""
    solutions = page.locator("div.solution")
    for i in range(solutions.count()):
        sol = solutions.nth(i)
        body = sol.locator("section, .cell, p:not(.admonition-title)").first
        # the solution's own title comes first: its folded code cells carry titles of their own inside it
        title = sol.locator(".admonition-title").first.inner_text().strip()
        assert body.count() == 1, f"solution {i} ({title}) has no body"
        assert not body.is_visible(), f"solution {i} ({title}) is visible before any click"
        sol.locator("button.toggle-button").click()
        body.wait_for(state="visible", timeout=5000)
        assert sol.locator(".cell").count() > 0, f"solution {i} ({title}) holds no executed code cell"
    return solutions.count()


PAGE_LIMIT = 2_000_000  # bytes of one page's HTML
SCREENS = REPO / "runs" / "screens"  # full-page screenshots of the last browser test, one per page


def _visible_text(page_html: str) -> str:
    """What a reader sees of a page: its text without scripts, styles and tags (the charts' specs left out)."""
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", page_html, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


def test_pages_read_as_a_published_report(built_book):
    """Every page: at most 2 MB; no Markdown table left as text; no development history (sessions, diary
    files, commit hashes as labels); a headline chart on the first page."""
    problems = []
    for name in toc_pages():
        path = built_book.html / f"{name}.html"
        page_html = path.read_text(encoding="utf-8")
        size = path.stat().st_size
        if size > PAGE_LIMIT:
            problems.append(f"{name}: {size:,} bytes (over {PAGE_LIMIT:,})")
        text = _visible_text(page_html)
        # a pipe table that no parser turned into a table: its rule row, dashes or the em dashes of smart quotes
        if m := re.search(r"\|\s*(-{3,}|—+)\s*\|", text):
            problems.append(f"{name}: a Markdown table shown as text: ...{text[max(0, m.start() - 80):m.end() + 40]!r}")
        for pattern, what in ((r"(?i)\bsessions?\b", "a session"), (r"NOTES\.md", "the lab's diary"),
                              (r"\blab/(notebook|tuning|logs|leases)", "the lab's folders")):
            if m := re.search(pattern, text):
                problems.append(f"{name}: {what}: ...{text[max(0, m.start() - 60):m.end() + 60]!r}")
        if m := re.search(r"@ [0-9a-f]{7,40}\b", page_html):  # a configuration labelled by a commit
            problems.append(f"{name}: a commit as a label: ...{page_html[max(0, m.start() - 60):m.end() + 20]!r}")
    intro = (built_book.html / f"{toc_pages()[0]}.html").read_text(encoding="utf-8")
    assert _chart_specs(intro), "the first page has no chart"
    assert "speedup" in _visible_text(intro).lower(), "the first page states no speedup"
    assert not problems, "\n".join(problems)


def test_book_in_browser(book_url, built_book):
    assert HAVE_PLAYWRIGHT, "the playwright Python package is missing (pip install -r requirements.txt)"
    assert HAVE_CHROMIUM, f"{CHROMIUM} is missing (apt-get install chromium; scripts/test.sh does it)"
    from playwright.sync_api import sync_playwright

    host = urlsplit(book_url).netloc
    outside: list[str] = []
    problems: list[str] = []
    kinds = {"dropdown": 0, "radio": 0, "legend": 0}
    charts_total = 0
    solutions = 0
    twins = {FAKE_SLUG: built_book.src, built_book.src: FAKE_SLUG}
    shown: list[str] = []  # pages whose text shows the poisoned GPU's strings as written

    def route(r):
        u = urlsplit(r.request.url)
        if u.scheme in ("http", "https", "ws", "wss") and u.netloc == host:
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    SCREENS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
            context.route("**/*", route)
            for name in toc_pages():
                page = context.new_page()
                page.on("pageerror", lambda e, n=name: problems.append(f"{n}: page error: {e}"))
                page.on("console", lambda m, n=name: problems.append(f"{n}: console {m.type}: {m.text}")
                        if m.type == "error" else None)
                page.on("websocket", lambda ws, n=name: outside.append(f"{n}: websocket {ws.url}"))
                page.goto(f"{book_url}/{name}.html", wait_until="load")
                if " ".join(poison.PAYLOAD.split()) in " ".join(page.inner_text("body").split()):
                    shown.append(name)
                n_charts = page.locator('div[id^="altair-viz-"]').count()
                if n_charts:
                    try:
                        page.wait_for_function(f"() => ({CHARTS_STATE})().every(c => c.drawn || c.error)", timeout=20000)
                    except Exception:
                        pass
                    for c in page.evaluate(CHARTS_STATE):
                        if c["error"] or not c["drawn"]:
                            problems.append(f"{name}: chart #{c['id']} not drawn ({c['kind']}): {c['error']}")
                # As a reader first sees it: charts drawn, folds closed, nothing clicked yet.
                page.screenshot(path=str(SCREENS / f"page-{name.split('/')[-1]}.png"), full_page=True)
                # The folded solutions first: opened, the charts inside them are exercised like the others
                # (their controls cannot be used while folded).
                try:
                    solutions += _check_solutions(page)
                except AssertionError as e:
                    problems.append(f"{name}: {e}")
                if n_charts:
                    for c in page.evaluate(CHARTS_STATE):
                        if c["drawn"]:
                            try:
                                _exercise_chart(page, c["id"], kinds, twins)
                            except AssertionError as e:
                                problems.append(f"{name}: {e}")
                charts_total += n_charts
                page.wait_for_timeout(200)
                if page.evaluate(f"() => window.{poison.FLAG} !== undefined"):
                    problems.append(f"{name}: a script from the data ran (window.{poison.FLAG} is set)")
                page.close()
        finally:
            browser.close()
    print(f"{len(toc_pages())} pages, {charts_total} charts, interactions exercised: {kinds}, "
          f"folded solutions opened: {solutions}")
    assert not outside, "requests outside the book (aborted):\n" + "\n".join(outside)
    assert not problems, "\n".join(problems)
    assert charts_total > 0, "no Altair chart in the book"
    assert kinds["dropdown"] + kinds["radio"] > 0, "no chart with a bound dropdown/radio was exercised"
    assert kinds["legend"] > 0, "no chart with a legend bound to a selection was exercised"
    assert solutions >= 3, f"only {solutions} folded exercise solutions in the book (the workshop has more)"
    assert "book/methodology" in shown, f"the failed run's message (markup) is not shown as text: {shown}"


# The pages that name a card by its device name (`tables.card_names`): its name, which is markup, shows as text.
NAMING_PAGES = ("intro", "methodology", "step-time", "cards", "beyond", "memory", "quality", "claims", "workshop")


def test_no_string_of_the_data_is_markup_on_any_page(built_book):
    """Every string of two GPUs of the book's data is markup: the added GPU's, its failed run's message and its
    stored notebooks' outputs (`poison.poison_gpu`), and the first GPU's with counters, its device name among them,
    given every kind of table the book reads (`poison.poison_source_gpu`). No page holds any of it as HTML; the pages
    that list a failed run (methodology, and its stored notebooks the appendix), an ablation lever that failed and a
    lever call (beyond), a study run that diverged (convergence) and two cards side by side (cards) show its text,
    and the pages that name a card show its name as text."""
    poisoned = [*(built_book.data / poison.SOURCE).rglob("*.parquet"), *(built_book.data / FAKE_SLUG).rglob("*.parquet"),
                built_book.data / PARTITION_FILE]
    assert {table_of(p) for p in poisoned} == set(schema.TABLES) - set(poison.NOT_READ)
    found, shown, named = [], [], []
    for name in toc_pages():
        page_html = (built_book.html / f"{name}.html").read_text(encoding="utf-8")
        found += poison.problems(page_html, name)
        shown += [name] if poison.shows(page_html) else []
        named += [name] if poison.shows(page_html, poison.LABEL_PAYLOAD) else []
    assert not found, "\n".join(found)
    pages = {"methodology", "appendix", "beyond", "convergence", "cards"}
    assert {f"book/{p}" for p in pages} <= set(shown), f"the data's markup is shown as text only on {shown}"
    assert {f"book/{p}" for p in NAMING_PAGES} <= set(named), f"pages that never name the GPU: {named}"


# --- a second GPU appears with no page edited ------------------------------------------------------

def _chart_specs(html: str) -> list[dict]:
    """The Vega-Lite specs embedded by Altair's HTML output on a page: `})({spec}, {embed options});`."""
    decoder, specs = json.JSONDecoder(), []
    for m in re.finditer(r'<div id="altair-viz-[^"]+"></div>\s*<script[^>]*>(.*?)</script>', html, flags=re.S):
        script = m.group(1)
        start = script.rfind("})({")
        assert start > 0, "an Altair chart script without its spec"
        spec, _ = decoder.raw_decode(script, start + 3)
        specs.append(spec)
    return specs


def test_second_gpu_appears_without_edits(built_book):
    html, src = built_book.html, built_book.src
    with_src, with_both = [], []
    for name in toc_pages():
        text = "\n".join(json.dumps(spec) for spec in _chart_specs((html / f"{name}.html").read_text(encoding="utf-8")))
        if re.search(rf'"(gpu_slug|gpu|gpu_name|run_id)":\s*"{re.escape(src)}\b', text) or f'"{src}/' in text:
            with_src.append(name)
            if FAKE_SLUG in text or FAKE_NAME in text:
                with_both.append(name)
    print(f"pages charting {src!r}: {with_src}; with {FAKE_SLUG!r} too: {with_both}")
    assert with_src, f"no chart shows data of {src!r}"
    missing = sorted(set(with_src) - set(with_both))
    assert not missing, f"pages whose charts show {src!r} but not the added {FAKE_SLUG!r}: {missing}"
    appendix = (html / "book" / "appendix.html")
    if appendix.is_file():
        assert f"{FAKE_SLUG} / " in appendix.read_text(encoding="utf-8"), "appendix lacks the added GPU's producer notebooks"


def test_missing_data_fails_the_build_naming_the_page(tmp_path):
    """A run folder whose run.parquet is gone (a missing data file) fails the build, naming the page."""
    data = tmp_path / "data"
    shutil.copytree(REPO / "data", data, ignore=shutil.ignore_patterns(".*"))
    victim = sorted(data.glob("*/*/run.parquet"))[0]
    victim.unlink()
    proc, log, took, _ = run_book_sh(tmp_path / "book", data)
    assert proc.returncode != 0, f"the build passed without {victim}"
    assert re.search(r"book: FAILED: .*book/[\w-]+\.md", log), f"the failure does not name a page:\n{log[-3000:]}"
    assert str(victim.parent) in log, f"the failure does not name the folder {victim.parent}:\n{log[-3000:]}"
    print(f"failed as expected in {took:.1f} s")
