"""The scaling page: data-parallel step times and efficiency per world size."""

from __future__ import annotations

import math

import pandas as pd

from medddpm.report.loading import _sort

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
    step = t.groupby([*keys, "step"])["step_ms"].max().groupby(keys).median().rename("step_median_ms")
    per_rank = t.groupby([*keys, "rank"])["step_ms"].median().groupby(keys).agg(rank_min_ms="min", rank_max_ms="max")
    batch = t.groupby(keys)["batch"].first()
    out = pd.concat([step, per_rank, batch], axis=1).reset_index()
    out["samples_per_s"] = out["world_size"] * out["batch"] / (out["step_median_ms"] / 1e3)
    one = out[out["world_size"] == 1].set_index(["gpu_slug", "config"])["samples_per_s"]
    base = pd.Series([one.get((g, c), math.nan) for g, c in zip(out["gpu_slug"], out["config"])], index=out.index)
    out["ideal_samples_per_s"] = base * out["world_size"]
    out["efficiency"] = out["samples_per_s"] / out["ideal_samples_per_s"]
    return _sort(out[cols], "world_size")
