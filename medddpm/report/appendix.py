"""The appendix: every run's producer notebook, listed with a link to where the page renders it (the
``producer-notebooks`` directive of `book/_ext` renders the notebooks themselves, as stored)."""

from __future__ import annotations

import html
import re

import pandas as pd

from medddpm.report.loading import cpu_slugs, data_root
from medddpm.report.tables import cpu_rows, fold


def anchor(slug: str, folder: str) -> str:
    """The id the directive gives a run's section: docutils' make_id of ``producer-<gpu>-<folder>``."""
    return re.sub(r"[^a-z0-9]+", "-", f"producer-{slug}-{folder.split('/')[-1]}".lower()).strip("-")


def listing(rows: pd.DataFrame) -> str:
    """An HTML table of runs: device, configuration, status, folder, a link to its notebook where one is stored,
    and when it started (UTC, to the minute)."""
    root = data_root()
    out = []
    for r in rows.itertuples():
        stored = (root / r.folder / "produce.ipynb").is_file()
        link = f'<a href="#{anchor(r.gpu_slug, r.folder)}">produce.ipynb</a>' if stored else "none stored"
        out.append(
            f"<tr><td>{html.escape(r.gpu_slug)}</td><td>{html.escape(r.config)}</td><td>{html.escape(r.status)}</td>"
            f"<td><code>data/{html.escape(r.folder)}/</code></td><td>{link}</td>"
            f"<td>{html.escape(r.start_time[:16].replace('T', ' '))}</td></tr>")
    return ("<table><thead><tr><th>device</th><th>configuration</th><th>status</th><th>folder</th>"
            "<th>notebook</th><th>started (UTC)</th></tr></thead><tbody>" + "".join(out) + "</tbody></table>")


def runs_html(run: pd.DataFrame) -> str:
    """The GPUs' runs listed, then the CPU's folded apart (a data tree of CPU runs only lists those unfolded)."""
    on_cpu = cpu_rows(run, cpu_slugs(run))
    gpu_runs, cpu_runs = (run[~on_cpu], run[on_cpu]) if (~on_cpu).any() else (run, run.iloc[0:0])
    page = listing(gpu_runs)
    if len(cpu_runs):
        page += fold(f"CPU smoke runs ({len(cpu_runs)} runs)", listing(cpu_runs))
    return page


def summary_text(run: pd.DataFrame) -> str:
    return (f"{len(run)} runs on {run['gpu_slug'].nunique()} device(s). Each notebook below is folded: open the one of "
            "the run you look into.")
