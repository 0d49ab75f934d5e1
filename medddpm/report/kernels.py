"""The kernels page: where a step's GPU time goes (torch.profiler's kernel table)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from medddpm.report.loading import _sort, config_order
from medddpm.report.step_time import check_strict_baseline
from medddpm.report.safe import md
from medddpm.report.tables import gpus_first


def _shares_by(kernels: pd.DataFrame, field: str) -> pd.DataFrame:
    """Share of profiled kernel time per (GPU, configuration, `field`); sums to 1 per run."""
    if kernels.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", field, "share", "us_per_step"])
    k = kernels.assign(us_per_step=kernels["total_us"] / kernels["micro_steps"].clip(lower=1))
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
    k = kernels.assign(us=kernels["total_us"] / kernels["micro_steps"].clip(lower=1),
                       cps=kernels["calls"] / kernels["micro_steps"].clip(lower=1))
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
                 us=k["total_us"] / k["micro_steps"].clip(lower=1), cps=k["calls"] / k["micro_steps"].clip(lower=1))
    g = k.groupby(["gpu_slug", "config", "op"], as_index=False).agg(calls_per_step=("cps", "sum"),
                                                                     us_per_step=("us", "sum"))
    g["share"] = g["us_per_step"] / g.groupby(["gpu_slug", "config"])["us_per_step"].transform("sum")
    g = g.sort_values(["gpu_slug", "config", "us_per_step", "op"], ascending=[True, True, False, True])
    g["rank"] = g.groupby(["gpu_slug", "config"]).cumcount() + 1
    return _sort(g[g["rank"] <= n][cols], "rank")


def step_curves(steps: pd.DataFrame, phase: str = "train") -> pd.DataFrame:
    """Per-step times of one phase (small: tens of rows a run), for spread charts."""
    s = steps[steps["phase"] == phase]
    return _sort(s[["gpu_slug", "config", "micro_step", "timed", "step_ms"]], "micro_step")


def check_shares(kernels: pd.DataFrame) -> None:
    if kernels.empty:
        return
    tot = kernels.groupby("run_id")["share"].sum()
    assert np.allclose(tot, 1.0, atol=1e-3), f"kernel shares do not sum to 1: {tot[~np.isclose(tot, 1, atol=1e-3)]}"


# ------------------------------------------------------------------------------------------ the page

def check_kernels(data, shares: pd.DataFrame) -> None:
    """The kernels page's numbers are sane: some run has a kernel table, every run's shares add up to 1 (by kernel
    and by category), and the strict-FP32 baseline ran no tensor-core kernel and read back strict math modes."""
    assert len(data.kernels), "no kernels.parquet under data/"
    check_shares(data.kernels)
    check_strict_baseline(data)
    assert np.allclose(shares.groupby(["gpu_slug", "config"])["share"].sum(), 1.0), shares


def _share(shares: pd.DataFrame, slug: str, config: str, categories) -> float | None:
    s = shares[(shares["gpu_slug"] == slug) & (shares["config"] == config)]
    return s[s["category"].isin(categories)]["share"].sum() if len(s) else None


def convolution_text(shares: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: the convolutions' share of the baseline's kernel time, and the element-wise and layout share
    in the baseline against channels-last (opt2)."""
    lines = []
    for slug in gpus_first(shares["gpu_slug"]):
        conv = _share(shares, slug, "baseline", ["convolution"])
        if conv is None:
            continue
        line = (f"- **{md(slug)}**{' (CPU smoke runs: aten operators)' if slug in cpus else ''}: convolutions take "
                f"{conv:.0%} of the baseline's kernel time")
        base = _share(shares, slug, "baseline", ["elementwise", "layout"])
        cl = _share(shares, slug, "opt2", ["elementwise", "layout"])
        if cl is not None:
            line += (f"; element-wise and layout kernels take {base:.0%} in the baseline and {cl:.0%} under "
                     f"channels-last ({(cl - base) * 100:+.0f} points)")
        lines.append(line + ".")
    return "\n".join(lines) if lines else "No baseline kernel profile in the data yet."


def tensor_core_share(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, a column per GPU: the share of its kernel time in kernels whose name says tensor cores
    (empty without a GPU kernel profile)."""
    k = kernels[kernels["device_type"] == "cuda"]
    tc = k.assign(t=k["total_us"] * k["tensor_cores"]).groupby(["gpu_slug", "config"])[["t", "total_us"]].sum()
    if tc.empty:
        return pd.DataFrame()
    tc = _sort((tc["t"] / tc["total_us"]).rename("share").reset_index())
    wide = tc.pivot(index="config", columns="gpu_slug", values="share")
    wide = wide.loc[[c for c in config_order(wide.index) if c in wide.index]].reset_index()
    return wide.rename(columns={"config": "configuration"})


def backward_text(passes: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: the baseline's backward over forward time, and the optimizer's share of the step."""
    p = passes.pivot_table(index=["gpu_slug", "config"], columns="pass", values="us_per_step", aggfunc="sum")
    lines = []
    for slug in gpus_first(p.index.get_level_values("gpu_slug")):
        r = p.loc[(slug, "baseline")] if (slug, "baseline") in p.index else None
        if r is not None and r.get("forward", 0) > 0:
            lines.append(f"- **{md(slug)}**{' (CPU smoke run)' if slug in cpus else ''}, baseline: backward / "
                         f"forward = {r.get('backward', np.nan) / r['forward']:.2f}, "
                         f"optimizer {r.get('optimizer', 0) / r.sum():.1%} of the step.")
    return "\n".join(lines) if lines else "No forward/backward split in the data."


def check_launching_ops(every_op: pd.DataFrame, shares: pd.DataFrame, category: str = "layout") -> None:
    """Split by launching operator, each run's time in `category` is still the category's time of `shares`."""
    by_run = every_op.groupby(["gpu_slug", "config"])["us_per_step"].sum()
    total = shares[shares["category"] == category].set_index(["gpu_slug", "config"])["us_per_step"]
    assert np.allclose(by_run.sort_index(), total.loc[by_run.index].sort_index()), "operator split loses its time"


def launchers_by_run(every_op: pd.DataFrame, shares: pd.DataFrame, top: int = 4) -> tuple[pd.DataFrame, pd.DataFrame]:
    """From `launching_ops` (every operator): a row per run with its layout time a step and the operators that
    launch it, largest first (those of at least 1%); and the `top` operators of each run with their launches and
    time, for a fold. Both empty when no run recorded its launching operators."""
    sources = every_op[every_op["rank"] <= top]
    known = sources[sources["op"] != UNRECORDED_OP]
    if known.empty:
        return known, known
    layout = shares[shares["category"] == "layout"].set_index(["gpu_slug", "config"])["us_per_step"]
    brief = (known.groupby(["gpu_slug", "config"], sort=False)
             .apply(lambda g: ", ".join(f"{op.removeprefix('aten::')} {sh:.0%}" for op, sh in zip(g["op"], g["share"])
                                        if sh >= 0.01), include_groups=False)
             .rename("launched by (share of the run's layout time)").reset_index())
    brief.insert(2, "layout µs / step", [layout.get((s, c)) for s, c in zip(brief["gpu_slug"], brief["config"])])
    detail = known.drop(columns="rank").rename(columns={
        "gpu_slug": "device", "config": "configuration", "op": "launched by", "calls_per_step": "launches / step",
        "us_per_step": "µs / step", "share": "of its layout time"})
    return brief, detail
