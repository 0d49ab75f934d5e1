"""Pages opened in JupyterLab (scripts/jupyterlab.sh, scripts/page_notebook.py): the command it starts, as root
and not; the workshop's solutions folded in the notebook it writes; and, slow, a JupyterLab started by
jupyterlab.sh as a reader would start it, driven in headless Chromium with no network: exercises render as
boxes, solutions stay folded after "Run All" and open on a click, the explorers' charts draw.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import jupytext
import nbformat
import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("page_notebook", REPO / "scripts" / "page_notebook.py")
page_notebook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(page_notebook)

WORKSHOP = REPO / "book" / "workshop.md"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def hidden_by_lab(nb) -> list[bool]:
    """Which cells JupyterLab hides on opening `nb`: those under a heading stored collapsed, up to the
    next heading of the same or a higher level."""
    hidden, fold = [], None  # fold: level of the collapsed heading whose section this is
    for cell in nb.cells:
        levels = page_notebook.headings(cell.source) if cell.cell_type == "markdown" else []
        if fold is not None and levels and min(levels) <= fold:
            fold = None
        hidden.append(fold is not None)
        if cell.cell_type == "markdown" and cell.metadata.get(page_notebook.COLLAPSED) and fold is None:
            fold = levels[0]
    return hidden


def solution_code(page: Path) -> tuple[list[str], list[str]]:
    """The page's code cells in solutions and outside them, read from jupytext's notebook as it is."""
    inside, outside, gate = [], [], False
    for cell in jupytext.read(str(page)).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.split("\n"):
                if re.match(r"^`{3,}\{solution-start\}", line):
                    gate = True
                elif re.match(r"^`{3,}\{solution-end\}", line):
                    gate = False
        elif cell.cell_type == "code":
            (inside if gate else outside).append(cell.source)
    return inside, outside


def test_workshop_folds_every_solution_and_shows_every_exercise():
    nb = page_notebook.page_to_notebook(WORKSHOP)
    nbformat.validate(nb)
    hidden = hidden_by_lab(nb)
    inside, outside = solution_code(WORKSHOP)
    assert len(inside) >= 8 and len(outside) >= 5  # the page's exercises have code on both sides
    for cell, is_hidden in zip(nb.cells, hidden):
        if cell.cell_type == "code":
            code = cell.source
            assert code in inside or code in outside, code[:80]  # code cells pass through as they are
            assert is_hidden == (code in inside), f"{'visible' if not is_hidden else 'hidden'}: {code[:80]}"
        elif "{exercise}" in cell.source:
            assert not is_hidden, cell.source[:80]
        assert not re.search(r"\{solution-(start|end)\}", cell.source), cell.source[:80]
    page = WORKSHOP.read_text()
    n = len(re.findall(r"^`{3,}\{exercise\}", page, flags=re.M))
    assert n == 4 and sum("{exercise}" in c.source for c in nb.cells if c.cell_type == "markdown") == n
    titles = [c.source for c in nb.cells if c.metadata.get(page_notebook.COLLAPSED)]
    assert titles == [f"### Solution to Exercise {i}" for i in range(1, n + 1)]
    assert sum(h for c, h in zip(nb.cells, hidden) if c.cell_type == "code") == len(inside)
    # The page ends on a solution: "Run All" leaves the last cell active, and it is not in a fold.
    assert nb.cells[-1].source == f"## {page_notebook.END_TITLE}" and not hidden[-1]


def _nb(*cells):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c[5:]) if c.startswith("code:")
                                           else nbformat.v4.new_markdown_cell(c) for c in cells])


START = "```{solution-start} ex-a\n:class: dropdown\n```"
END = "```{solution-end}\n```"
EXERCISE = "```{exercise} Title\n:label: ex-a\n\nDo it.\n```"


def test_fold_solutions_cases():
    # Text before the gate in the same cell stays out of it; a heading inside a solution's code block
    # is no heading; a solution of code cells only still gets its title.
    nb = page_notebook.fold_solutions(_nb(
        "## Part", EXERCISE + "\n\nBefore.\n\n" + START + "\n\nAnswer:\n\n```bash\n# a shell comment\n```",
        "code:x = 1", END + "\n\n## Next\n\n```{exercise} Two\n:nonumber:\n```\n\n" + START.replace("ex-a", "ex-b"),
        "code:y = 2", END + "\n\n(target)=\n## Last"))
    sources = [c.source for c in nb.cells]
    assert sources[1].endswith("Before.") and "{exercise}" in sources[1]
    assert sources[2] == "### Solution to Exercise 1" and sources[3].startswith("Answer:")
    assert "### Solution to ex-b" in sources  # an exercise that is not numbered: named by its label
    assert hidden_by_lab(nb) == [False, False, False, True, True, False, False, True, False]
    assert sources[-1] == "(target)=\n## Last" and len({c.id for c in nb.cells}) == len(nb.cells)
    nbformat.validate(nb)

    for cells, message in [
        (("## A", START, "code:x", END + "\n\nText, no heading."), "does not open with a heading"),
        (("## A", START, "code:x", END, "code:y"), "ends on a code cell"),
        (("## A", START, "### Inside", END), "would end its fold early"),
        (("## A", START, "code:x"), "has no solution-end"),
        (("## A", END), "no solution-start"),
        (("## A", START, START.replace("ex-a", "ex-b")), "inside the solution"),
        (("## A", "```{solution-start}\n```"), "names no exercise"),
    ]:
        with pytest.raises(page_notebook.GateError, match=message):
            page_notebook.fold_solutions(_nb(*cells))
    # A page without solutions converts as jupytext has it.
    plain = _nb("# A", "code:x = 1")
    assert page_notebook.fold_solutions(plain) == plain


def _lab_command(tmp_path, uid: int, *args) -> subprocess.CompletedProcess:
    """scripts/jupyterlab.sh with JUPYTERLAB_CONVERT_ONLY=1, with `id -u` answering `uid`."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "id").write_text(f"#!/bin/sh\n[ \"$1\" = -u ] && echo {uid} || exec /usr/bin/id \"$@\"\n")
    (shim / "id").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", JUPYTERLAB_SKIP_SETUP="1", JUPYTERLAB_CONVERT_ONLY="1",
               JUPYTERLAB_OUT=str(tmp_path / "lab"))
    return subprocess.run(["bash", "scripts/jupyterlab.sh", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_jupyterlab_sh_command_as_root_and_not(tmp_path):
    root = _lab_command(tmp_path, 0, "book/workshop.md", "--", "--no-browser", "--ip", "0.0.0.0")
    assert root.returncode == 0, root.stderr
    command = root.stdout.strip().splitlines()[-1]
    assert command.endswith(f"jupyter lab {tmp_path}/lab/workshop.ipynb --no-browser --ip 0.0.0.0 --allow-root")
    assert "MEDDDPM_LAB=1" in command
    # The notebook it opens is the folded one.
    nb = nbformat.read(tmp_path / "lab" / "workshop.ipynb", as_version=4)
    assert sum(bool(c.metadata.get(page_notebook.COLLAPSED)) for c in nb.cells) == 4

    user = _lab_command(tmp_path, 1000, "book/workshop.md")
    assert user.returncode == 0, user.stderr
    assert user.stdout.strip().splitlines()[-1].endswith(f"jupyter lab {tmp_path}/lab/workshop.ipynb")
    assert "--allow-root" not in user.stdout


def test_jupyterlab_myst_is_installed():
    """The extension that renders the pages' MyST in JupyterLab ships in the venv (requirements.txt)."""
    pinned = re.search(r"^jupyterlab-myst==(\S+)", (REPO / "requirements.txt").read_text(), flags=re.M)[1]
    package = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "jupyterlab-myst" / "package.json"
    assert package.is_file() and f'"version": "{pinned}"' in package.read_text()


def test_charts_fill_the_output_in_lab(monkeypatch):
    """In JupyterLab a chart of width "container" is as wide as the output, not zero pixels: a block
    element, redrawn when its width changes (test_jupyterlab_in_browser sees them drawn)."""
    import altair as alt

    from medddpm.report import charts
    from medddpm.report.charts import jupyterlab

    monkeypatch.setenv("MEDDDPM_LAB", "1")
    try:
        charts.setup()
        charts.setup()  # each page calls it: the module is patched once
        assert re.search(r"\.vega-embed\s*\{[^}]*display:\s*block", alt.JupyterChart._css)
        esm = alt.JupyterChart._esm
        assert alt.JupyterChart._is_offline and esm.count("ResizeObserver(") == 1
        assert re.search(r"export\s*\{\s*[\w$]+\s+as\s+default", esm)  # the bundle's export, as patched
    finally:
        monkeypatch.delenv("MEDDDPM_LAB")
        charts.setup()
    module = "const __default={render};export{__default as default};"
    patched = jupyterlab.redraw_on_resize(module)
    assert patched.startswith(module) and "const widget = __default;" in patched
    assert jupyterlab.redraw_on_resize(patched) == patched
    assert jupyterlab.redraw_on_resize("export default { render }") == "export default { render }"


# ------------------------------------------------------------------------------- JupyterLab, slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab started by scripts/jupyterlab.sh (as root where the tests run as root) on the workshop and
    the explorers, stopped afterwards."""
    out = tmp_path_factory.mktemp("lab")
    port = _free_port()
    env = dict(os.environ, JUPYTERLAB_SKIP_SETUP="1", JUPYTERLAB_OUT=str(out))
    log = open(out / "lab.log", "w")
    proc = subprocess.Popen(
        ["bash", "scripts/jupyterlab.sh", "book/workshop.md", "book/explorers.md", "--", "--no-browser", f"--port={port}",
         "--IdentityProvider.token="],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if proc.poll() is not None:
                pytest.fail(f"scripts/jupyterlab.sh exited ({proc.returncode}): {(out / 'lab.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"JupyterLab did not answer: {(out / 'lab.log').read_text()[-2000:]}")
        yield url, out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _run_all(page) -> None:
    """Run > Run All Cells, then wait until every code cell, folded or not, has run."""
    started = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].some(e => /[*\\d]/.test(e.textContent))"
    for _ in range(5):  # a click before the notebook has the focus finds the command disabled
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            pytest.fail(f"JupyterLab shows a dialog: {dialog.first.inner_text()}")
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-content > .lm-Menu-item", has_text=re.compile(r"^Run All Cells$")).first.click()
        try:
            page.wait_for_function(started, timeout=5_000)
            break
        except Exception:
            page.keyboard.press("Escape")
    try:
        page.wait_for_function("""() => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);
            return document.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                && prompts.length && prompts.every(t => /\\[\\d+\\]/.test(t)); }""", timeout=120_000)
    except Exception:
        state = page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell')].map(c =>
            (c.querySelector('.jp-InputPrompt') || {}).textContent + ' '
            + [...c.querySelectorAll('.jp-OutputArea-output[data-mime-type*="error"], .jp-RenderedText[data-mime-type*="stderr"]')]
                .map(e => e.textContent.slice(-300)).join(' | '))""")
        pytest.fail("not every cell ran:\n" + "\n".join(state))


# Per cell, in notebook order: shown or hidden, its kind, its prompt, the start of its rendered Markdown.
CELLS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(c => ({
    shown: c.offsetParent !== null, code: c.classList.contains('jp-CodeCell'),
    prompt: (c.querySelector('.jp-InputPrompt') || {}).textContent || '',
    text: (c.querySelector('.myst') || {}).textContent || ''}))"""
# Each chart in an output: its drawn width and marks.
CHARTS = """() => [...document.querySelectorAll('.jp-OutputArea-output svg.marks')].map(s => ({
    width: s.getBoundingClientRect().width, marks: s.querySelectorAll('path, rect, line, text').length}))"""


@pytest.mark.slow
@pytest.mark.budget(160)  # 52 CPU seconds measured: the server, a kernel and Chromium
@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"needs {CHROMIUM} (scripts/test.sh installs it)")
def test_jupyterlab_in_browser(lab_server):
    from playwright.sync_api import sync_playwright

    url, out = lab_server

    screens = os.environ.get("JUPYTERLAB_SCREENS")  # a folder: the screenshots of what the test sees go there
    outside, errors = [], []

    def route(r):
        u = urlsplit(r.request.url)
        if u.hostname == "127.0.0.1" or u.scheme in ("data", "blob"):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.route("**/*", route)

            def open_notebook(name):
                page = context.new_page()
                page.on("pageerror", lambda e: errors.append(f"{name}: {e} {e.stack}"))
                page.goto(f"{url}/lab/tree/{name}?reset")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                # JupyterLab asks for a kernel when its list of kernels comes after the notebook: the
                # notebook's own (Python 3) is the one selected.
                page.wait_for_function("""() => document.querySelector('.jp-Dialog')
                    || /\\| Idle/.test(document.querySelector('#jp-main-statusbar')?.textContent)""",
                                       timeout=60_000)
                if page.locator(".jp-Dialog", has_text="Select Kernel").count():
                    page.locator(".jp-Dialog button", has_text="Select").click()
                # The kernel up before any cell runs (jupyterlab-myst runs Markdown cells through it).
                page.wait_for_function("""() => /\\| Idle/.test(
                    document.querySelector('#jp-main-statusbar')?.textContent)""", timeout=60_000)
                return page

            page = open_notebook("workshop.ipynb")
            _run_all(page)
            news = page.get_by_role("button", name="No", exact=True)  # JupyterLab's news prompt
            if news.count():
                news.first.click()
            cells = page.evaluate(CELLS)
            # After "Run All" JupyterLab hides exactly the cells of the solutions, and has run them.
            nb = nbformat.read(out / "workshop.ipynb", as_version=4)
            assert [not c["shown"] for c in cells] == hidden_by_lab(nb)
            hidden_code = [c for c in cells if c["code"] and not c["shown"]]
            assert len(hidden_code) >= 8 and all(re.search(r"\[\d+\]", c["prompt"]) for c in hidden_code)
            titles = [c["text"] for c in cells if c["text"].startswith("Solution to Exercise")]
            assert len(titles) == 4
            boxes = page.locator(".jp-MarkdownCell aside.myst-exercise")  # jupyterlab-myst's exercise box
            assert boxes.count() == 4 and all(boxes.nth(i).is_visible() for i in range(4))
            assert "Exercise 1" in boxes.first.text_content()
            assert not any("{exercise}" in c["text"] for c in cells)  # none renders as raw text
            if screens:
                page.locator(".jp-MarkdownCell", has_text="1. Precision on one convolution").first.evaluate(
                    "e => e.scrollIntoView()")
                page.wait_for_timeout(1000)
                page.screenshot(path=f"{screens}/lab-workshop.png")
            # A click on "cells hidden" opens one solution, ran and with its outputs.
            head = page.locator(".jp-MarkdownCell", has_text="Solution to Exercise 3").first
            head.evaluate("e => e.scrollIntoView()")
            head.locator(".jp-showHiddenCellsButton").first.click()
            page.wait_for_timeout(1500)
            after = page.evaluate(CELLS)
            start = next(i for i, c in enumerate(after) if c["text"].startswith("Solution to Exercise 3"))
            opened = after[start + 1:next(i for i, c in enumerate(after) if "4. What training costs" in c["text"])]
            assert opened and all(c["shown"] for c in opened)
            assert sum(c["shown"] for c in after) == sum(c["shown"] for c in cells) + len(opened)
            head.evaluate("e => e.scrollIntoView()")
            page.wait_for_timeout(1000)
            if screens:
                page.screenshot(path=f"{screens}/lab-workshop-open.png")
            drawn = [c for c in page.evaluate(CHARTS) if c["width"] > 100 and c["marks"] > 5]
            assert drawn, "the stall chart of solution 3 does not draw"

            page = open_notebook("explorers.ipynb")
            _run_all(page)
            cell = page.locator(".jp-CodeCell", has_text="explorer.chart()").first
            cell.evaluate("e => e.scrollIntoView()")
            page.wait_for_timeout(2000)
            charts = page.evaluate(CHARTS)
            # The explorer's own chart (in its widget) and the two stills after it, each of them drawn.
            assert len(charts) >= 3 and all(c["width"] > 100 and c["marks"] > 5 for c in charts), charts
            widgets = page.locator(".jp-OutputArea-output .widget-dropdown")
            assert widgets.count() >= 3  # the explorer's dropdowns are live
            if screens:
                page.screenshot(path=f"{screens}/lab-explorers.png")
        finally:
            browser.close()
    assert not outside, f"JupyterLab fetched from outside: {outside[:5]}"
    # JupyterLab's cell toolbar measures a rendered Markdown cell through `inputArea.renderedInput`, which
    # jupyterlab-myst's cells lack at times: a TypeError in an idle callback, with nothing on the page.
    errors = [e for e in errors if "_markdownOverlapsToolbar" not in e]
    assert not errors, "\n".join(errors[:5])
