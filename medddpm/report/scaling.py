"""The scaling page: data-parallel step times and efficiency per world size."""

from __future__ import annotations

import math

import pandas as pd

from medddpm.report.loading import _sort
from medddpm.report.safe import code, md
from medddpm.report.tables import cpu_rows


def scaling_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, configuration and world size: the median step (`step_median_ms`: each step as long as its
    slowest rank, then the median over timed steps), global throughput, and efficiency against world size 1
    (throughput / (world size x throughput on one rank); NaN without a one-rank run)."""
    cols = ["gpu_slug", "config", "backend", "world_size", "step_median_ms", "rank_min_ms", "rank_max_ms",
            "samples_per_s", "ideal_samples_per_s", "efficiency"]
    t = df[df["timed"]]
    if t.empty:
        return pd.DataFrame(columns=cols)
    keys = ["gpu_slug", "config", "backend", "world_size"]
    step = t.groupby([*keys, "micro_step"])["step_ms"].max().groupby(keys).median().rename("step_median_ms")
    per_rank = t.groupby([*keys, "rank"])["step_ms"].median().groupby(keys).agg(rank_min_ms="min", rank_max_ms="max")
    batch = t.groupby(keys)["batch"].first()
    out = pd.concat([step, per_rank, batch], axis=1).reset_index()
    out["samples_per_s"] = out["world_size"] * out["batch"] / (out["step_median_ms"] / 1e3)
    one = out[out["world_size"] == 1].set_index(["gpu_slug", "config"])["samples_per_s"]
    base = pd.Series([one.get((g, c), math.nan) for g, c in zip(out["gpu_slug"], out["config"])], index=out.index)
    out["ideal_samples_per_s"] = base * out["world_size"]
    out["efficiency"] = out["samples_per_s"] / out["ideal_samples_per_s"]
    return _sort(out[cols], "world_size")


# ------------------------------------------------------------------------------------------ the page

SCALING_COLUMNS = {"gpu_slug": "device", "config": "configuration", "world_size": "ranks",
                   "step_median_ms": "median step (ms, slowest rank)", "samples_per_s": "samples/s"}
SCALING_FORMATS = {"median step (ms, slowest rank)": "{:.4g}", "samples/s": "{:.3g}", "efficiency": "{:.0%}"}


def check_scaling(summary: pd.DataFrame) -> None:
    """Throughputs are positive, each world size's fastest rank is no slower than its slowest, and one rank is
    100% efficient against itself."""
    if summary.empty:
        return
    assert (summary["samples_per_s"] > 0).all() and (summary["rank_min_ms"] <= summary["rank_max_ms"]).all(), summary
    assert (summary.loc[summary["world_size"] == 1, "efficiency"].dropna().round(9) == 1).all(), summary


def scaling_on_cpu(summary: pd.DataFrame, cpus: set[str]) -> pd.Series:
    """Which rows of `scaling_summary` ran on a CPU: a device the runs name a CPU, or a label that looks like one."""
    return cpu_rows(summary, cpus) if len(summary) else pd.Series(dtype=bool)


def cpu_only_text(summary: pd.DataFrame) -> str:
    """That the page holds CPU runs only, which ones, and the command that measures GPUs."""
    runs = summary.groupby(["gpu_slug", "config", "backend"], sort=False)["world_size"].max()
    return ("**This page holds no GPU measurement yet**: only "
            + "; ".join(f"a CPU run ({code(slug)}, {code(config)}, {md(backend)}, up to {n} ranks)"
                        for (slug, config, backend), n in runs.items())
            + ", which checks that the data-parallel code runs and shows how a host shares its cores among processes. "
            "How GPUs scale is still to be measured (`python -m medddpm scale --config sdpa --world-sizes 1,2,4 "
            "--preset paper` on a machine with several GPUs); this page fills in with no edit.")


def ranks_text(rows: pd.DataFrame) -> str:
    """Per device and configuration: the throughput and efficiency at its largest world size, and the spread of its
    ranks' median step times there."""
    lines = []
    for (slug, config), g in rows.groupby(["gpu_slug", "config"], sort=False):
        best = g.loc[g["world_size"].idxmax()]
        eff = f", {best['efficiency']:.0%} efficiency" if pd.notna(best["efficiency"]) else ""
        lines.append(f"- {code(slug)} / {code(config)} ({md(best['backend'])}): {best['samples_per_s']:.3g} "
                     f"samples/s on {int(best['world_size'])} ranks{eff}; its ranks' median step times "
                     f"{best['rank_min_ms']:.4g}-{best['rank_max_ms']:.4g} ms.")
    return "\n".join(lines)


def scaling_table(rows: pd.DataFrame) -> pd.DataFrame:
    """`scaling_summary` rows as the page shows them (`SCALING_COLUMNS`; format them with `SCALING_FORMATS`)."""
    return rows.drop(columns=["ideal_samples_per_s", "rank_min_ms", "rank_max_ms"]).rename(columns=SCALING_COLUMNS)


NO_RUNS = ("**No scaling runs in the data yet.** Run `python -m medddpm scale --config sdpa --world-sizes 1,2,4 "
           "--preset paper` on a machine with that many GPUs (or `--device cpu` for gloo processes), and this page "
           "fills in with no edit.")
