"""What the pages show, without building the book: progress bars left out of the stored producer notebooks,
tables that put GPUs first and fold a CPU's smoke rows, the headline of the first page and the bench table."""

from __future__ import annotations

import importlib.util
import json
import re

import pandas as pd
import pytest

from conftest import REPO
from medddpm import report
from medddpm.report import tables

_spec = importlib.util.spec_from_file_location("medddpm_book", REPO / "book" / "_ext" / "medddpm_book.py")
book = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(book)


def _stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def test_strip_progress_keeps_what_a_cell_printed_and_drops_the_bars():
    outputs = [
        _stream("stdout", "ok\n"),
        _stream("stderr", "\rtrain baseline warm-up:   0%|          | 0/5 [00:00<?, ?it/s]"),
        _stream("stderr", "\rtrain baseline warm-up:  40%|████      | 2/5 [00:42<00:52, 17.45s/it]"),
        _stream("stderr", "\rtrain baseline warm-up: 100%|██████████| 5/5 [00:44<00:00,  8.92s/it]\n"),
        _stream("stderr", "/x/profiler.py:224: UserWarning: Profiler clears events\n  _warn_once(\n"),
        _stream("stderr", "\rMNI pairs 16: 12it [00:03, 3.9it/s]\n"),
        {"output_type": "execute_result", "data": {"text/plain": "3"}, "metadata": {}, "execution_count": 1},
        _stream("stderr", "/x/tqdm/auto.py:21: TqdmWarning: IProgress not found. Please update jupyter\n"
                          "  from .autonotebook import tqdm as notebook_tqdm\n"),
        _stream("stderr", "\rsampling:  50%|█████     | 1/2 [00:10<00:10, 10.00s/it]"),
    ]
    kept = book.strip_progress(outputs)
    assert [o["output_type"] for o in kept] == ["stream", "stream", "execute_result"]
    assert kept[0] == _stream("stdout", "ok\n")
    assert kept[1]["name"] == "stderr"
    assert kept[1]["text"] == "/x/profiler.py:224: UserWarning: Profiler clears events\n  _warn_once(\n"
    assert book.strip_progress(kept) == kept, "stripping twice changes nothing"
    assert outputs[1]["text"].startswith("\r"), "the stored outputs are not changed in place"


def test_the_appendix_leaves_out_profiler_notes_narrows_padded_rows_and_lists_gpus_first(tmp_path):
    wide = "profilers" + " " * 300 + '{"torch": "ok"}'
    kept = book.strip_progress([_stream("stderr", "USDT:2026-11-29 23:43:26 1:1 Sync.cpp:52] profiler_start\n"
                                                  "a warning\n"),
                                _stream("stdout", f"run_id     x\n{wide}\n")])
    assert kept[0]["text"] == "a warning\n"
    assert kept[1]["text"] == 'run_id     x\nprofilers  {"torch": "ok"}\n'  # a narrow table keeps its columns
    for label in ("cpu", "nvidia-h200", "cpu-node-1", "nvidia-a100"):
        (tmp_path / label / "opt1").mkdir(parents=True)
        (tmp_path / label / "opt1" / "produce.ipynb").write_text("{}")
    assert [p.parent.parent.name for p in book.producer_notebooks(tmp_path)] == \
        ["nvidia-a100", "nvidia-h200", "cpu", "cpu-node-1"]


def test_the_appendix_sets_the_code_every_run_shares_once(tmp_path):
    """Two runs' notebooks with one shared cell and one of their own: the second names the first for the shared
    cell's code and shows its own cell's code and both outputs."""
    import json

    def notebook(folder, own):
        cells = [{"cell_type": "code", "source": "import medddpm\n", "metadata": {},
                  "outputs": [_stream("stdout", f"{folder} ran\n")]},
                 {"cell_type": "code", "source": own, "metadata": {}, "outputs": []}]
        path = tmp_path / folder / "produce.ipynb"
        path.parent.mkdir()
        path.write_text(json.dumps({"cells": cells, "metadata": {}}))
        return path

    def text(nodes):
        return "".join(n.astext() for n in nodes)  # a raw node's text is its HTML

    shown = {}
    first = text(book.render_notebook(notebook("a", "config = 'opt1'\n"), tmp_path, shown, "gpu / a"))
    second = text(book.render_notebook(notebook("b", "config = 'best'\n"), tmp_path, shown, "gpu / b"))
    assert "import medddpm" in first and "a ran" in first and "config = 'opt1'" in first
    assert "import medddpm" not in second and "same code as the notebook of gpu / a" in second
    assert "b ran" in second and "config = 'best'" in second


def test_committed_producer_notebooks_hold_no_progress_bars():
    paths = sorted((REPO / "data").glob("**/produce.ipynb"))
    assert paths, "no stored producer notebook under data/"
    for path in paths:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            outputs = cell.get("outputs", [])
            stripped = book.strip_progress(outputs)
            texts = ["".join(o["text"]) if isinstance(o.get("text"), list) else o.get("text") for o in outputs]
            assert [("".join(o["text"]) if isinstance(o.get("text"), list) else o.get("text")) for o in stripped] \
                == texts, f"{path.relative_to(REPO)} stores progress bars or profiler notes (the appendix's filter)"


def _frame(slugs_configs) -> pd.DataFrame:
    return pd.DataFrame([{"gpu_slug": s, "config": c, "ms": 1.5} for s, c in slugs_configs])


def test_sort_puts_gpus_before_cpus():
    df = _frame([("cpu", "opt1"), ("cpu", "baseline"), ("nvidia-h200", "opt1"), ("cpu-node-7", "baseline"),
                 ("nvidia-a100", "baseline")])
    out = report._sort(df)
    assert list(out["gpu_slug"]) == ["nvidia-a100", "nvidia-h200", "cpu", "cpu", "cpu-node-7"]
    assert list(out.loc[out["gpu_slug"] == "cpu", "config"]) == ["baseline", "opt1"]
    assert tables.gpus_first(["cpu", "nvidia-h200", "cpu-x"]) == ["nvidia-h200", "cpu", "cpu-x"]


def test_by_device_folds_the_cpu_rows_and_keeps_placeholders_as_text():
    df = _frame([("nvidia-h200", "baseline"), ("my-laptop", "opt1"), ("cpu", "opt1")])
    out = tables.by_device(df.assign(path="data/<gpu-slug>/<config>/"), {"my-laptop"}, what="runs",
                           rename={"gpu_slug": "device"}).data
    gpu_part, _, cpu_part = out.partition("<details")
    assert "nvidia-h200" in gpu_part and "my-laptop" not in gpu_part and "cpu" not in gpu_part.split("</table>")[0]
    assert "CPU smoke runs (2 runs" in cpu_part and "my-laptop" in cpu_part
    assert "data/&lt;gpu-slug&gt;/&lt;config&gt;/" in out, "a path's placeholders are escaped, not read as tags"
    assert "white-space: nowrap" in gpu_part, "a device label is kept on one line"
    only_cpu = tables.by_device(_frame([("cpu", "opt1")])).data
    assert "<details" not in only_cpu, "with no GPU the CPU's rows are all there is: not folded"


def test_long_names_may_break_inside_a_word_and_short_ones_stay_whole():
    kernel = "void wgrad_alg1_nd_float_engine<float, 512, 6, 5, 3, 3, 3, false>"
    out = tables.table_html(pd.DataFrame({"rule, on kernel": ["CPIStall on " + kernel, "short"], "ms": [1.5, 2.0]}))
    assert out.count("overflow-wrap: anywhere") == 1, "only the long cell may break anywhere"
    assert "wgrad_alg1_nd_float_engine&lt;float" in out, "its text is escaped"
    layer = tables.table_html(pd.DataFrame({"layer": ["conv3d 64>64 k3 s1 @128x128x128"]}))
    assert "overflow-wrap" not in layer, "long text of short words breaks between its words, never inside one"


def _runs(rows) -> pd.DataFrame:
    return pd.DataFrame([{"gpu_slug": s, "config": c, "status": "ok", "batch": 1, "preset": p, "size": n,
                          "train_median_ms": ms, "train_p10_ms": ms * 0.99, "train_p90_ms": ms * 1.02}
                         for s, c, p, n, ms in rows])


def test_headline_takes_the_paper_s_four_and_the_fastest_overall():
    run = _runs([("nvidia-h200", "baseline", "paper", 128, 800.0), ("nvidia-h200", "opt1", "paper", 128, 200.0),
                 ("nvidia-h200", "opt2", "paper", 128, 1000.0), ("nvidia-h200", "best", "paper", 128, 50.0),
                 ("cpu", "baseline", "smoke", 16, 200.0), ("cpu", "sdpa", "smoke", 16, 40.0),
                 ("nvidia-a100", "opt1", "paper", 128, 300.0)])  # no baseline: no speedup to state
    h = report.headline(run)
    assert list(h["gpu_slug"]) == ["nvidia-h200"] * 4 + ["cpu"] * 2
    g = h[h["gpu_slug"] == "nvidia-h200"].set_index("config")
    assert g["role"].tolist() == ["the paper's"] * 3 + ["fastest measured"]
    assert g.loc["baseline", "speedup"] == 1.0 and g.loc["opt1", "speedup"] == 4.0
    assert g.loc["opt2", "speedup"] == 0.8 and g.loc["opt2", "hi"] < 1  # slower than strict FP32: shown, not hidden
    assert g.loc["best", "speedup"] == 16.0
    assert (h["lo"] < h["speedup"]).all() and (h["speedup"] < h["hi"]).all()
    assert h.loc[h["gpu_slug"] == "cpu", "config"].tolist() == ["baseline", "sdpa"]
    # the fastest being one of the paper's is not shown twice
    only = report.headline(run[run["config"] != "best"])
    assert only.loc[only["gpu_slug"] == "nvidia-h200", "role"].eq("the paper's").all()


def test_bench_table_sets_the_implementations_side_by_side():
    b = pd.DataFrame([
        {"gpu_slug": "nvidia-h200", "source": "run 1", "config": "baseline", "implementation": "ours",
         "train_median_ms": 100.0, "timed_steps": 30},
        {"gpu_slug": "nvidia-h200", "source": "run 2", "config": "baseline", "implementation": "ours",
         "train_median_ms": 102.0, "timed_steps": 30},
        {"gpu_slug": "nvidia-h200", "source": "run 1", "config": "baseline",
         "implementation": "reference (mobaidoctor/med-ddpm)", "train_median_ms": 110.0, "timed_steps": 30},
        {"gpu_slug": "nvidia-h200", "source": "run 3", "config": "bf16", "implementation": "ours",
         "train_median_ms": 40.0, "timed_steps": 20},
    ])
    t = report.bench_table(b).set_index("config")
    assert t.loc["baseline", "ours_ms"] == 101.0 and t.loc["baseline", "reference_ms"] == 110.0
    assert t.loc["baseline", "runs"] == 2 and t.loc["baseline", "ours_faster"] == pytest.approx(110 / 101 - 1)
    assert pd.isna(t.loc["bf16", "reference_ms"]) and t.loc["bf16", "runs"] == 1
    assert report.bench_table(b.iloc[0:0]).empty


def test_every_page_module_is_reached_by_its_name():
    """`report.<page>` is the page's module: a name the facade's star imports bring in never shadows one."""
    import types

    for name in report.SUBMODULES:
        assert isinstance(getattr(report, name), types.ModuleType), f"report.{name} is {getattr(report, name)!r}"


_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(?P<body>.*?)^```\s*$", re.M | re.S)


def _cells(page) -> list[tuple[set[str], str]]:
    out = []
    for m in _CELL.finditer(page.read_text()):
        lines = m["body"].split("\n")
        tags = next((set(t.strip() for t in ln.split("[", 1)[1].rstrip("]").split(","))
                     for ln in lines if ln.startswith(":tags:")), set())
        out.append((tags, "\n".join(ln for ln in lines if not ln.startswith(":"))))
    return out


def test_pages_read_as_lessons():
    """Every page: its code calls into `medddpm.report` and imports nothing of the package past it, defines no
    function, imports the package under its own name; a cell it hides is its setup (imports, the renderer, sanity
    asserts), and the rest is visible or folded."""
    import ast

    for page in sorted((REPO / "book").glob("*.md")):
        for tags, code in _cells(page):
            tree = ast.parse(code)
            where = f"{page.name}: {code.strip().splitlines()[0] if code.strip() else ''}"
            assert not any(isinstance(n, (ast.FunctionDef, ast.Lambda, ast.ClassDef)) for n in ast.walk(tree)), where
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("medddpm"):
                    assert n.module.startswith("medddpm.report") or {a.name for a in n.names} == {"report"}, where
                    assert all(a.asname is None for a in n.names), where
                elif isinstance(n, ast.Import):
                    assert not any(a.name.startswith("medddpm") for a in n.names), where
            assert "remove-input" not in tags, f"{where}: fold it (hide-input) instead"
            if "remove-cell" in tags:
                for stmt in tree.body:
                    setup = isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Assert)) or (
                        isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "charts.setup()")
                    assert setup, f"{where}: a hidden cell holds {ast.unparse(stmt)[:60]!r}, not setup"
