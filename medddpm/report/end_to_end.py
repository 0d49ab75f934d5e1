"""The step time end to end: the GPU-only micro-step beside the micro-step of a training loop fed from a NIfTI
folder by the data loader, per device and configuration (as nnU-Net reports its benchmark with and without data
loading), and the runs whose clocks the driver held down while they were timed.

`end_to_end_table` picks the runs that were timed both ways (`e2e_median_ms` measured); `end_to_end_view` shows
them, or says plainly that there are none yet; `throttled_runs` lists the runs with a clock slowdown reason.
"""

from __future__ import annotations

import html

import pandas as pd
from IPython.display import HTML

from medddpm.report import tables

TARGET = 1.10  # the loader keeps up when the end-to-end micro-step is within 10% of the GPU-only one
COLUMNS = {"gpu_slug": "device", "config": "configuration", "shape": "shape", "data_source": "data",
           "train_median_ms": "GPU only, ms", "e2e_median_ms": "with loading, ms", "ratio": "ratio",
           "loader_items_per_s": "loader, items/s", "cache_build_s": "cache build, s", "e2e_drift": "drift",
           "throttle_reasons": "clock slowdown"}


def end_to_end_table(run: pd.DataFrame) -> pd.DataFrame:
    """One row per run timed end to end: both medians, their ratio, the loader's rate, the first pass's cache
    build, the step's drift over the run and any clock slowdown; GPUs first, then by configuration."""
    if "e2e_median_ms" not in run:
        return pd.DataFrame(columns=list(COLUMNS))
    df = run[(run["status"] == "ok") & run["e2e_median_ms"].notna()].copy()
    df["ratio"] = df["e2e_median_ms"] / df["train_median_ms"]
    df["throttle_reasons"] = df["throttle_reasons"].replace("", "none")
    df = df[list(COLUMNS)]
    order = tables.gpus_first(df["gpu_slug"].unique())
    df["_device"] = df["gpu_slug"].map({s: i for i, s in enumerate(order)})
    return df.sort_values(["_device", "config", "data_source"]).drop(columns="_device").reset_index(drop=True)


def throttled_runs(run: pd.DataFrame) -> pd.DataFrame:
    """The finished runs whose clocks NVML said were held down (power cap, thermal, hardware slowdown) while
    their steps were timed, with the share of samples that said so."""
    if "throttle_reasons" not in run:
        return pd.DataFrame(columns=["gpu_slug", "config", "throttle_reasons", "throttled_share"])
    df = run[(run["status"] == "ok") & (run["throttle_reasons"] != "")]
    return df[["gpu_slug", "config", "throttle_reasons", "throttled_share"]].reset_index(drop=True)


def end_to_end_view(run: pd.DataFrame, cpus: set[str] | None = None) -> HTML:
    """The table of `end_to_end_table` with a line on each run against the 10% target, and the throttled runs;
    a sentence saying so where no run was timed end to end."""
    df = end_to_end_table(run)
    parts = []
    if df.empty:
        parts.append("<p>No run in the data was trained from a NIfTI folder yet, so there is no end-to-end time "
                     "to show: <code>python -m medddpm sweep --data DIR</code> times one (<code>python -m medddpm "
                     "export-data</code> writes such a folder).</p>")
    else:
        parts.append(tables.by_device(df, cpus, what="runs", rename=COLUMNS, code=("config",), formats={
            "ratio": lambda v: "-" if pd.isna(v) else f"{v:.2f}x",
            "e2e_drift": lambda v: "-" if pd.isna(v) else f"{v:+.1%}"}).data)
        items = []
        for r in df.itertuples():
            verdict = "within" if r.ratio <= TARGET else "outside"
            items.append(f"<li><b>{html.escape(r.gpu_slug)}</b>, <code>{html.escape(r.config)}</code> on "
                         f"{html.escape(r.data_source)}: {r.e2e_median_ms:.4g} ms with loading against "
                         f"{r.train_median_ms:.4g} ms on the GPU alone ({r.ratio:.2f}x), {verdict} the 10% "
                         f"target.</li>")
        parts.append("<ul>" + "".join(items) + "</ul>")
    slowed = throttled_runs(run)
    if len(slowed):
        parts.append("<p>Clocks held down while timed (these runs' times are slower than the card's best): " + ", ".join(
            f"<code>{html.escape(r.config)}</code> on {html.escape(r.gpu_slug)} ({html.escape(r.throttle_reasons)}, "
            f"{r.throttled_share:.0%} of the samples)" for r in slowed.itertuples()) + ".</p>")
    return HTML("\n".join(parts))
