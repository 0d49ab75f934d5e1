"""The kernels page: where a step's GPU time goes (torch.profiler's kernel table)."""

from __future__ import annotations


import numpy as np
import pandas as pd

from medddpm.report.loading import _sort

def _shares_by(kernels: pd.DataFrame, field: str) -> pd.DataFrame:
    """Share of profiled kernel time per (GPU, configuration, `field`); sums to 1 per run."""
    if kernels.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", field, "share", "us_per_step"])
    k = kernels.assign(us_per_step=kernels["total_us"] / kernels["steps"].clip(lower=1))
    g = k.groupby(["gpu_slug", "config", field], as_index=False)[["total_us", "us_per_step"]].sum()
    g["share"] = g["total_us"] / g.groupby(["gpu_slug", "config"])["total_us"].transform("sum")
    return _sort(g.drop(columns="total_us"), field)


def category_shares(kernels: pd.DataFrame) -> pd.DataFrame:
    """Share of profiled kernel time per kernel category (convolution, element-wise, layout, ...)."""
    return _shares_by(kernels, "category")


def pass_split(kernels: pd.DataFrame) -> pd.DataFrame:
    """Share of profiled kernel time per pass (forward / backward / optimizer / graph / other)."""
    return _shares_by(kernels, "pass")


def top_kernels(kernels: pd.DataFrame, n: int = 12) -> pd.DataFrame:
    """The n largest kernels of each run (passes added up), with what a tooltip needs."""
    cols = ["gpu_slug", "config", "rank", "short_name", "kernel", "category", "passes", "calls_per_step",
            "us_per_step", "share", "tensor_cores"]
    if kernels.empty:
        return pd.DataFrame(columns=cols)
    k = kernels.assign(us=kernels["total_us"] / kernels["steps"].clip(lower=1),
                       cps=kernels["calls"] / kernels["steps"].clip(lower=1))
    g = (k.groupby(["gpu_slug", "config", "kernel"], as_index=False)
         .agg(short_name=("short_name", "first"), category=("category", "first"),
              passes=("pass", lambda s: ", ".join(sorted(set(s)))), calls_per_step=("cps", "sum"),
              us_per_step=("us", "sum"), share=("share", "sum"), tensor_cores=("tensor_cores", "any")))
    g = g.sort_values(["gpu_slug", "config", "us_per_step"], ascending=[True, True, False])
    g["rank"] = g.groupby(["gpu_slug", "config"]).cumcount() + 1
    g = g[g["rank"] <= n].copy()
    g["kernel"] = g["kernel"].str.slice(0, 240)  # tooltips; the full names stay in kernels.parquet
    return _sort(g[cols], "rank")


UNRECORDED_OP = "(not recorded: a graph replay, or a run from before operators were recorded)"


def launching_ops(kernels: pd.DataFrame, *, category: str = "layout", n: int = 5) -> pd.DataFrame:
    """Per run, the operators that launched the kernels of one category, by time per step: the n
    largest, with their share of the category's time in that run (who makes the layout copies)."""
    cols = ["gpu_slug", "config", "rank", "op", "calls_per_step", "us_per_step", "share"]
    k = kernels[kernels["category"] == category] if len(kernels) else kernels
    if k.empty:
        return pd.DataFrame(columns=cols)
    k = k.assign(op=k["op"].where(k["op"] != "", UNRECORDED_OP),
                 us=k["total_us"] / k["steps"].clip(lower=1), cps=k["calls"] / k["steps"].clip(lower=1))
    g = k.groupby(["gpu_slug", "config", "op"], as_index=False).agg(calls_per_step=("cps", "sum"),
                                                                     us_per_step=("us", "sum"))
    g["share"] = g["us_per_step"] / g.groupby(["gpu_slug", "config"])["us_per_step"].transform("sum")
    g = g.sort_values(["gpu_slug", "config", "us_per_step", "op"], ascending=[True, True, False, True])
    g["rank"] = g.groupby(["gpu_slug", "config"]).cumcount() + 1
    return _sort(g[g["rank"] <= n][cols], "rank")


def step_curves(steps: pd.DataFrame, phase: str = "train") -> pd.DataFrame:
    """Per-step times of one phase (small: tens of rows a run), for spread charts."""
    s = steps[steps["phase"] == phase]
    return _sort(s[["gpu_slug", "config", "step", "timed", "step_ms"]], "step")


def check_shares(kernels: pd.DataFrame) -> None:
    if kernels.empty:
        return
    tot = kernels.groupby("run_id")["share"].sum()
    assert np.allclose(tot, 1.0, atol=1e-3), f"kernel shares do not sum to 1: {tot[~np.isclose(tot, 1, atol=1e-3)]}"
