"""The book's figures: one Altair chart builder per figure, fed with small aggregated frames.

Interactivity is Vega-Lite's own, so it works in a static HTML page with no Python behind it:
dropdowns and radio buttons bound to parameters (which GPU, which configuration, which metric),
legend-bound selections that highlight, and tooltips. Every GPU choice is built from the data's
``gpu_slug`` values, never from a list written here, so a GPU added under ``data/`` appears in
every chart. Each configuration keeps one colour across the whole book (`config_color`), each
kernel category another (`category_color`).

Pages call `setup()` first: it is the one place where the renderer is chosen.
"""

from __future__ import annotations

import math
import os
import sys

# jsonschema (under Altair) imports rfc3987_syntax whenever it is installed (jupyter-events pulls it in), and
# that builds some 35 Earley parsers: about 3 s of each page's start (python-jsonschema/jsonschema#1428).
# Altair's schema has no "iri" format, the only checks it serves; marked absent, jsonschema leaves them out.
if "jsonschema" not in sys.modules:
    sys.modules.setdefault("rfc3987_syntax", None)

import altair as alt
import numpy as np
import pandas as pd

from medddpm.report.loading import FAILS, HOLDS, NA, config_order
from medddpm.report.memory import FIT_VERDICTS, GPU_MEMORY_GB
from medddpm.report.step_time import PEAKS

# Tableau 10, then 10 more for configurations named in the data but not in CONFIGS.
PALETTE = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d",
           "#bab0ac", "#1f77b4", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
           "#9edae5", "#393b79"]
CATEGORIES = ("convolution", "gemm", "attention", "elementwise", "normalization", "reduction", "layout", "fused",
              "memcpy", "optimizer", "other")  # medddpm.kernels.CATEGORIES (not imported: it loads the profiler)
CATEGORY_COLORS = ["#4c78a8", "#9ecae9", "#b279a2", "#f58518", "#54a24b", "#88d27a", "#e45756", "#eeca3b",
                   "#bab0ac", "#9d755d", "#d6d6d6"]
PASS_ORDER = ["forward", "backward", "optimizer", "graph", "other"]
VERDICT_COLORS = {HOLDS: "#54a24b", FAILS: "#e45756", NA: "#d6d6d6"}
# DRAM bandwidth for the roofline, with its source (like step_time.PEAKS): inputs, not results.
BANDWIDTH = {"nvidia-h200": (4.3e12, "measured on this machine type (one run of a device-to-device copy)")}
MAX_ROWS = 5000  # pages pass aggregated frames; more than this is a mistake


def live_notebook() -> bool:
    """Whether this kernel belongs to a live notebook: one that a Jupyter server started (it sets
    JPY_SESSION_NAME) or scripts/lab.sh (MEDDDPM_LAB=1). A book build runs without either."""
    return os.environ.get("MEDDDPM_LAB") == "1" or bool(os.environ.get("JPY_SESSION_NAME"))


def setup() -> None:
    """Choose the renderer (the one place to change it) and guard against heavy pages.

    The book's static HTML gets Altair's default renderer (its vega scripts are served by the book,
    book/_ext/medddpm_book.py). A page opened as a notebook in JupyterLab gets the `jupyter` renderer
    with ``offline=True``: each chart is an `altair.JupyterChart` whose vega comes from vl-convert, so
    it draws with no network."""
    if live_notebook():
        alt.renderers.enable("jupyter", offline=True)
    else:
        alt.renderers.enable("default")
    alt.data_transformers.enable("default", max_rows=MAX_ROWS)


# ------------------------------------------------------------------------------------------- helpers


def config_color(configs=()) -> alt.Scale:
    """One colour per configuration, in CONFIGS order, the same in every chart of the book."""
    domain = config_order(configs)
    return alt.Scale(domain=domain, range=(PALETTE * 2)[:len(domain)])


def _config_legend(df: pd.DataFrame, title: str = "configuration (click)") -> alt.Legend:
    """A legend that lists the configurations present (the scale keeps every colour fixed)."""
    return alt.Legend(values=_configs_in(df), title=title)


def _height(df: pd.DataFrame, legend_entries: int, row: int = 22, by: str = "config") -> int:
    """Pixels for a chart with one band per `by` value of the largest GPU, tall enough for its legend
    (a legend taller than its chart is cut off in the page)."""
    rows = df.groupby("gpu_slug")[by].nunique().max() if len(df) else 1
    return int(max(row * rows, 14 * legend_entries + 40))


def _step_axis(df: pd.DataFrame) -> alt.Axis:
    """Integer ticks only (a few steps would otherwise get ticks at 1.5, 2.5)."""
    steps = sorted(df["step"].unique())
    return alt.Axis(values=[int(v) for v in steps], format="d") if len(steps) <= 25 else alt.Axis(tickMinStep=1, format="d")


def table(df: pd.DataFrame, digits: int = 4):
    """A compact table for a page: no index, floats to `digits` significant digits, NaN as '-'."""
    fmt = {c: (lambda v, d=digits: "-" if pd.isna(v) else f"{v:.{d}g}") for c in df.columns
           if pd.api.types.is_float_dtype(df[c])}
    return df.style.hide(axis="index").format(fmt)


def category_color() -> alt.Scale:
    return alt.Scale(domain=list(CATEGORIES), range=CATEGORY_COLORS)


def _light(df: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """Floats to `digits` significant digits (small pages); NaN stays NaN."""
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = [float(f"{v:.{digits}g}") if pd.notna(v) and math.isfinite(v) else np.nan for v in out[c]]
    return out


def _default_gpu(slugs) -> str:
    """The first GPU that is not the CPU, else the CPU: a reader sees a GPU first when there is one."""
    slugs = sorted(set(slugs))
    return next((s for s in slugs if s != "cpu"), slugs[0] if slugs else "")


def _gpu_param(df: pd.DataFrame, name: str = "gpu") -> alt.Parameter:
    options = sorted(df["gpu_slug"].unique())
    return alt.param(name=name, value=_default_gpu(options),
                     bind=alt.binding_select(options=options, name="GPU "))


def _config_param(df: pd.DataFrame, name: str = "cfg", skip_baseline: bool = False) -> alt.Parameter:
    options = [c for c in config_order(df["config"].unique()) if c in set(df["config"])]
    # Start on a configuration the default GPU has, or the first drawing is empty (a GPU measured in part).
    there = (set(df.loc[df["gpu_slug"] == _default_gpu(sorted(df["gpu_slug"].unique())), "config"])
             if "gpu_slug" in df else set(options))
    first = [c for c in options if c in there and not (skip_baseline and c == "baseline")]
    return alt.param(name=name, value=(first or options or [""])[0],
                     bind=alt.binding_select(options=options, name="configuration "))


def _metric_param(metrics: dict[str, str], name: str = "metric") -> alt.Parameter:
    keys = list(metrics)
    return alt.param(name=name, value=keys[0],
                     bind=alt.binding_radio(options=keys, labels=list(metrics.values()), name="show "))


def _fold(df: pd.DataFrame, metrics: dict[str, str], id_cols: list[str]) -> pd.DataFrame:
    """Long form: one row per (id, metric) with its label; NaN values dropped."""
    cols = [m for m in metrics if m in df]
    long = df.melt(id_vars=id_cols, value_vars=cols, var_name="metric", value_name="value").dropna(subset=["value"])
    return long.assign(label=long["metric"].map(metrics))


def _configs_in(df: pd.DataFrame) -> list[str]:
    return [c for c in config_order(df["config"].unique()) if c in set(df["config"])]


def _empty(message: str) -> alt.Chart:
    """A chart that says why there is nothing to draw (the page still builds)."""
    return alt.Chart(pd.DataFrame({"text": [message]})).mark_text(fontSize=14, color="#666").encode(
        text="text:N").properties(width="container", height=60)


# -------------------------------------------------------------------------------------- step time


def step_time(summary: pd.DataFrame, floors: pd.DataFrame | None = None) -> alt.LayerChart:
    """Median micro-step time per configuration with its p10-p90 spread; GPU dropdown, legend
    highlight, tooltips; optional floors (flops_per_step / peak) as dashed rules."""
    cols = ["gpu_slug", "device", "config", "precision_used", "train_median_ms", "train_p10_ms", "train_p90_ms",
            "speedup", "achieved_tflops"]
    df = _light(summary[cols])
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    order = _configs_in(df)
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    y = alt.Y("config:N", sort=order, title=None)
    tip = [alt.Tooltip("device:N", title="device"), alt.Tooltip("config:N"),
           alt.Tooltip("precision_used:N", title="precision that ran"),
           alt.Tooltip("train_median_ms:Q", title="median ms", format=".4g"),
           alt.Tooltip("train_p10_ms:Q", title="p10 ms", format=".4g"),
           alt.Tooltip("train_p90_ms:Q", title="p90 ms", format=".4g"),
           alt.Tooltip("speedup:Q", title="speedup vs baseline", format=".2f"),
           alt.Tooltip("achieved_tflops:Q", title="achieved TFLOP/s", format=".3g")]
    bars = base.mark_bar().encode(
        y=y, x=alt.X("train_median_ms:Q", title="median micro-step time (ms); whisker: p10-p90"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.25)), tooltip=tip).add_params(pick)
    spread = base.mark_rule(color="black").encode(y=y, x="train_p10_ms:Q", x2="train_p90_ms:Q", tooltip=tip)
    layers = [bars, spread]
    if floors is not None and not floors.empty:
        fl = _light(floors[["gpu_slug", "precision", "floor_ms", "peak_tflops", "source"]])
        rule = alt.Chart(fl).transform_filter(alt.datum.gpu_slug == gpu).mark_rule(strokeDash=[4, 3], color="#333")
        layers.append(rule.encode(x="floor_ms:Q", tooltip=[
            "precision:N", alt.Tooltip("floor_ms:Q", title="floor ms", format=".3g"),
            alt.Tooltip("peak_tflops:Q", title="peak TFLOP/s"), "source:N"]))
        layers.append(rule.mark_text(align="left", dx=3, dy=-4, baseline="bottom", fontSize=10).encode(
            x="floor_ms:Q", y=alt.value(0), text=alt.Text("precision:N")))
    return alt.layer(*layers).add_params(gpu).properties(
        width="container", height=_height(df, len(order)), title="Training micro-step time (forward + backward + Adam)")


def speedup(summary: pd.DataFrame) -> alt.LayerChart:
    """Speedup over the baseline of the same GPU, every GPU on one chart; click a GPU in the legend."""
    df = _light(summary[summary["speedup"].notna()][["gpu_slug", "device", "config", "train_median_ms", "speedup"]])
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    order = _configs_in(df)
    points = alt.Chart(df).mark_point(filled=True, size=110).encode(
        y=alt.Y("config:N", sort=order, title=None),
        x=alt.X("speedup:Q", scale=alt.Scale(type="log"), title="speedup over the baseline on the same GPU (log)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        shape=alt.Shape("gpu_slug:N", title="GPU (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=["device:N", "config:N", alt.Tooltip("speedup:Q", format=".2f"),
                 alt.Tooltip("train_median_ms:Q", title="median ms", format=".4g")]).add_params(pick)
    one = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(strokeDash=[4, 3], color="#666").encode(x="x:Q")
    return alt.layer(one, points).properties(width="container", height=alt.Step(22),
                                             title="Speedup over strict FP32 (1 = baseline)")


COST_METRICS = {
    "epoch_s": "one epoch (s)",
    "gpu_hours_100k": "100k steps (device-hours)",
    "energy_100k_kwh": "100k steps (kWh)",
    "sample_s": "one full sample, 250 steps (s)",
    "sample_total_s": "first sample in a process, with compilation (s)",
    "peak_mem_gib": "peak memory (GiB)",
    "achieved_tflops": "achieved TFLOP/s",
}


def cost(summary: pd.DataFrame) -> alt.Chart:
    """Cost per configuration; radio buttons choose the metric, a dropdown the GPU."""
    df = _light(_fold(summary, COST_METRICS, ["gpu_slug", "device", "config"]))
    if df.empty:
        return _empty("no cost figures in the data")
    gpu, metric = _gpu_param(df), _metric_param({k: v for k, v in COST_METRICS.items() if k in set(df["metric"])})
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", title="value of the chosen metric"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        tooltip=["device:N", "config:N", alt.Tooltip("label:N", title="metric"), alt.Tooltip("value:Q", format=".4g")],
    ).add_params(gpu, metric).properties(width="container", height=alt.Step(22),
                                         title="What one configuration costs (missing bars: not measured on this device)")


def bench(bench_df: pd.DataFrame) -> alt.Chart:
    """Bench timings kept beside the data (ours and the reference implementation, table ``bench``), a bar per
    configuration and bench run (`source`): a name's switches are those of its run's commit, so runs are not
    pooled. Training micro-steps only (`loading.bench_runs`' default); GPU dropdown."""
    if bench_df.empty:
        return _empty("no bench timings in the data")
    assert set(bench_df["phase"]) == {"train"}, "a denoising step is not a micro-step: pass training rows"
    g = (bench_df.groupby(["gpu_slug", "source", "git_commit", "config", "implementation"], as_index=False)
         .agg(train_median_ms=("train_median_ms", "median"), lo=("train_p10_ms", "min"), hi=("train_p90_ms", "max"),
              steps=("steps", "max"), peak_mem_bytes=("peak_mem_bytes", "max")))
    g["peak_mem_gib"] = g.pop("peak_mem_bytes").where(lambda b: b >= 0) / 2**30  # -1: a CPU, no device memory
    g["run"] = g["config"] + " · " + g["source"]
    order = {c: i for i, c in enumerate(_configs_in(g))}
    runs = g.sort_values(["config", "source"], key=lambda s: s.map(order) if s.name == "config" else s)["run"]
    df = _light(g)
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["implementation"], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("run:N", sort=list(dict.fromkeys(runs)), title=None),
        yOffset=alt.YOffset("implementation:N"),
        x=alt.X("train_median_ms:Q", title="median micro-step time (ms)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        opacity=alt.condition(pick, alt.Opacity("implementation:N", scale=alt.Scale(range=[1.0, 0.45]),
                                                legend=alt.Legend(symbolType="square", symbolFillColor="#4c78a8"),
                                                title="implementation (click)"), alt.value(0.08)),
        tooltip=["gpu_slug:N", "config:N", "implementation:N",
                 alt.Tooltip("train_median_ms:Q", title="median ms", format=".4g"),
                 alt.Tooltip("lo:Q", title="p10 ms", format=".4g"), alt.Tooltip("hi:Q", title="p90 ms", format=".4g"),
                 "steps:Q", alt.Tooltip("peak_mem_gib:Q", title="peak allocated GiB", format=".3g"),
                 alt.Tooltip("source:N", title="bench run"), alt.Tooltip("git_commit:N", title="commit")],
    ).add_params(gpu, pick).properties(
        width="container", height=alt.Step(14), title="Bench timings (python -m medddpm bench)")


# ---------------------------------------------------------------------------------------- kernels


ABLATION_COLORS = {"buys": "#4c78a8", "not told apart": "#bab0ac", "costs": "#e45756"}


def ablation(summary: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    """What each lever buys (`beyond.ablation_summary`): the step time each lever saves, largest first, with the
    variant's p10-p90 spread as a whisker, coloured by verdict; GPU dropdown. Failed variants are left out (the
    page lists them)."""
    df = _light(summary[summary["verdict"] != "failed"].assign(
        lo=lambda d: d["train_p10_ms"] - d["base_ms"], hi=lambda d: d["train_p90_ms"] - d["base_ms"])
        [["gpu_slug", "preset", "lever", "base_ms", "train_median_ms", "saved_ms", "lo", "hi", "ratio", "noise",
          "verdict"]])
    if df.empty:
        return _empty("No ablation measured yet (python -m medddpm ablation).")
    gpu = _gpu_param(df)
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    y = alt.Y("lever:N", sort=alt.EncodingSortField("saved_ms", order="descending"),
              title="best without", axis=alt.Axis(labelLimit=260))
    tip = [alt.Tooltip("lever:N", title="best without"),
           alt.Tooltip("train_median_ms:Q", title="its step (ms)", format=".1f"),
           alt.Tooltip("base_ms:Q", title="best's step (ms)", format=".1f"),
           alt.Tooltip("saved_ms:Q", title="the lever saves (ms)", format=".1f"),
           alt.Tooltip("ratio:Q", title="slower without it (x)", format=".2f"),
           alt.Tooltip("noise:Q", title="noise to beat", format=".1%"), alt.Tooltip("verdict:N")]
    bars = base.mark_bar().encode(
        y=y, x=alt.X("saved_ms:Q", title="milliseconds a micro-step saves with the lever; whisker: p10-p90"),
        color=alt.Color("verdict:N", scale=alt.Scale(domain=list(ABLATION_COLORS), range=list(ABLATION_COLORS.values())),
                        legend=alt.Legend(title="verdict")), tooltip=tip)
    spread = base.mark_rule(color="black").encode(y=y, x="lo:Q", x2="hi:Q", tooltip=tip)
    return alt.layer(bars, spread).add_params(gpu).properties(
        width="container", height=_height(df, 4, by="lever"),
        title="What each lever of best buys: best without it, minus best")


def category_shares(shares: pd.DataFrame) -> alt.Chart:
    """Stacked share of kernel time per category; GPU dropdown; click a category to highlight it."""
    if shares.empty:
        return _empty("no kernel profiles in the data")
    df = _light(shares.assign(order=shares["category"].map({c: i for i, c in enumerate(CATEGORIES)}).fillna(99)))
    present = [c for c in CATEGORIES if c in set(df["category"])]
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["category"], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("share:Q", stack="normalize", axis=alt.Axis(format="%"), title="share of profiled kernel time"),
        color=alt.Color("category:N", scale=category_color(),
                        legend=alt.Legend(values=present, title="category (click)")),
        order=alt.Order("order:Q"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=["config:N", "category:N", alt.Tooltip("share:Q", format=".1%"),
                 alt.Tooltip("us_per_step:Q", title="µs per step", format=",.0f")],
    ).add_params(gpu, pick).properties(width="container", height=_height(df, len(present)),
                                       title="Where the kernel time goes, by category")


def top_kernels(top: pd.DataFrame) -> alt.Chart:
    """The largest kernels of one run; dropdowns pick the GPU and the configuration."""
    if top.empty:
        return _empty("no kernel profiles in the data")
    df = top.copy()
    df["label"] = df["rank"].astype(str).str.rjust(2) + ". " + df["short_name"].str.slice(0, 48)
    df = _light(df)
    gpu, cfg = _gpu_param(df), _config_param(df)
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_bar().encode(
        y=alt.Y("label:N", sort=alt.EncodingSortField("rank", order="ascending"), title=None),
        x=alt.X("us_per_step:Q", title="device time per step (µs)"),
        color=alt.Color("category:N", scale=category_color(),
                        legend=alt.Legend(values=[c for c in CATEGORIES if c in set(df["category"])], title="category")),
        tooltip=[alt.Tooltip("kernel:N", title="kernel"), "category:N", alt.Tooltip("passes:N", title="pass"),
                 alt.Tooltip("calls_per_step:Q", title="calls per step", format=".3g"),
                 alt.Tooltip("us_per_step:Q", title="µs per step", format=",.0f"),
                 alt.Tooltip("share:Q", title="share of step", format=".1%"),
                 alt.Tooltip("tensor_cores:N", title="tensor cores (by name)")],
    ).add_params(gpu, cfg).properties(width="container", height=_height(df, df["category"].nunique(), 18, "rank"),
                                      title="Top kernels of one run")


def pass_split(passes: pd.DataFrame) -> alt.Chart:
    """Forward / backward / optimizer time per configuration; radio: absolute time or share."""
    if passes.empty:
        return _empty("no kernel profiles in the data")
    metrics = {"ms_per_step": "time per step (ms)", "share": "share of the step"}
    df = passes.assign(ms_per_step=passes["us_per_step"] / 1e3,
                       order=passes["pass"].map({p: i for i, p in enumerate(PASS_ORDER)}).fillna(9))
    df = _light(_fold(df, metrics, ["gpu_slug", "config", "pass", "order"]))
    gpu, metric = _gpu_param(df), _metric_param(metrics)
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", stack="zero", title="time per step (ms) or share, as chosen"),
        color=alt.Color("pass:N", scale=alt.Scale(domain=PASS_ORDER, range=["#4c78a8", "#f58518", "#54a24b",
                                                                            "#b279a2", "#bab0ac"]), title="pass"),
        order=alt.Order("order:Q"),
        tooltip=["config:N", "pass:N", alt.Tooltip("label:N", title="metric"), alt.Tooltip("value:Q", format=".3g")],
    ).add_params(gpu, metric).properties(width="container", height=_height(df, df["pass"].nunique()),
                                         title="Forward, backward and optimizer")


# --------------------------------------------------------------------------------------- counters


def tensor_pipe(counters: pd.DataFrame) -> alt.Chart:
    """Tensor-pipe utilization per configuration weighted over the step (`counters.ncu_by_run`), every GPU;
    legend picks the GPU."""
    if counters.empty or "tensor_pipe_pct" not in counters:
        return _empty("no Nsight Compute counters in the data")
    df = _light(counters[["gpu_slug", "config", "tensor_pipe_pct", "sm_throughput_pct"]])
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    return alt.Chart(df).mark_point(filled=True, size=110).encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("tensor_pipe_pct:Q", title="tensor-pipe utilization (% of peak, weighted by step time)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        shape=alt.Shape("gpu_slug:N", title="GPU (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=["gpu_slug:N", "config:N", alt.Tooltip("tensor_pipe_pct:Q", title="tensor pipe %", format=".3g"),
                 alt.Tooltip("sm_throughput_pct:Q", title="SM throughput %", format=".3g")],
    ).add_params(pick).properties(width="container", height=alt.Step(22), title="Tensor-core utilization")


def _stacked_counters(counters: pd.DataFrame, *, prefix: str, field: str, value: str, what: str, x_title: str,
                      title: str) -> alt.Chart:
    """Counter columns `<prefix><name>` stacked per configuration; GPU dropdown, legend highlight."""
    cols = [c for c in counters.columns if c.startswith(prefix) and c != f"{prefix}total"]
    if counters.empty or not cols:
        return _empty("no Nsight Compute counters in the data")
    df = counters.melt(id_vars=["gpu_slug", "config"], value_vars=cols, var_name=field, value_name=value)
    df = _light(df.dropna().assign(**{field: lambda d: d[field].str.removeprefix(prefix)}))
    if df.empty:
        return _empty(f"no {what} in the data")
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=[field], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X(f"{value}:Q", title=x_title),
        color=alt.Color(f"{field}:N", scale=alt.Scale(scheme="tableau20"), title=f"{field} (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=["config:N", f"{field}:N", alt.Tooltip(f"{value}:Q", format=".3s" if prefix == "inst_" else ".3g")],
    ).add_params(gpu, pick).properties(width="container", height=_height(df, df[field].nunique()), title=title)


def instruction_mix(counters: pd.DataFrame) -> alt.Chart:
    """Executed thread instructions by class per configuration (stacked); GPU dropdown, legend highlight."""
    return _stacked_counters(counters, prefix="inst_", field="class", value="instructions", what="instruction counts",
                             x_title="thread instructions executed in one step (kernels with counters)", title="Instruction mix")


MEMORY_METRICS = {"l1_hit_pct": "L1 hit %", "l2_hit_pct": "L2 hit %", "dram_throughput_pct": "DRAM throughput %",
                  "memory_throughput_pct": "memory throughput %", "sm_throughput_pct": "SM throughput %",
                  "achieved_occupancy_pct": "achieved occupancy %"}


def memory(counters: pd.DataFrame) -> alt.Chart:
    """Memory hierarchy per configuration; radio picks the metric, dropdown the GPU."""
    if counters.empty:
        return _empty("no Nsight Compute counters in the data")
    df = _light(_fold(counters, MEMORY_METRICS, ["gpu_slug", "config"]))
    if df.empty:
        return _empty("no memory counters in the data")
    gpu, metric = _gpu_param(df), _metric_param({k: v for k, v in MEMORY_METRICS.items() if k in set(df["metric"])})
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", scale=alt.Scale(domain=[0, 100]), title="percent (weighted by step time)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        tooltip=["config:N", alt.Tooltip("label:N", title="metric"), alt.Tooltip("value:Q", format=".3g")],
    ).add_params(gpu, metric).properties(width="container", height=alt.Step(22), title="Memory hierarchy")


def stalls(counters: pd.DataFrame) -> alt.Chart:
    """Warp stall reasons (cycles per issued instruction), stacked; GPU dropdown, legend highlight."""
    return _stacked_counters(counters, prefix="stall_", field="reason", value="cycles", what="stall counters",
                             x_title="stall cycles per issued instruction (weighted by step time)", title="Why warps wait")


def priorities(prio: pd.DataFrame) -> alt.Chart:
    """Nsight Compute rules ranked by share of step x estimated speedup; GPU and configuration dropdowns."""
    if prio.empty:
        return _empty("no Nsight Compute rules in the data")
    df = prio.copy()
    df["rank"] = df.groupby(["gpu_slug", "config"]).cumcount() + 1
    df["label"] = df["rank"].astype(str).str.rjust(2) + ". " + df["rule"] + " @ " + df["kernel"].str.slice(0, 32)
    df = _light(df.assign(priority_pct=df["priority"] * 100))
    gpu, cfg = _gpu_param(df), _config_param(df)
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_bar().encode(
        y=alt.Y("label:N", sort=alt.EncodingSortField("rank", order="ascending"), title=None),
        x=alt.X("priority_pct:Q", title="estimated saving (% of step) = share x rule's speedup"),
        color=alt.Color("section:N", scale=alt.Scale(scheme="tableau10"), title="section"),
        tooltip=["kernel:N", "rule:N", "section:N", alt.Tooltip("share:Q", title="share of step", format=".1%"),
                 alt.Tooltip("speedup_pct:Q", title="rule's estimated speedup %", format=".3g"),
                 alt.Tooltip("priority_pct:Q", title="estimated saving % of step", format=".3g")],
    ).add_params(gpu, cfg).properties(width="container", height=alt.Step(18), title="Where to optimize first")


def roofline(points: pd.DataFrame) -> alt.LayerChart:
    """Achieved FLOP/s against arithmetic intensity (log-log), one dot per kernel of a run (its profiled
    launches together), roofs where the GPU's peaks are known; GPU dropdown, legend picks configurations,
    size = the launches' duration."""
    if points.empty:
        return _empty("no Nsight Compute FLOP and byte counts in the data")
    # only the columns drawn or in the tooltip: the page embeds every GPU's points
    df = _light(points.assign(tflops=points["flops_per_s"] / 1e12, duration_us=points["duration_ns"] / 1e3)[
        ["gpu_slug", "config", "kernel", "launches", "intensity", "tflops", "duration_us", "tensor_pipe_pct"]])
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    dots = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_circle().encode(
        x=alt.X("intensity:Q", scale=alt.Scale(type="log"), title="arithmetic intensity (FLOP per DRAM byte)"),
        y=alt.Y("tflops:Q", scale=alt.Scale(type="log"), title="achieved TFLOP/s (SASS FP counts)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        size=alt.Size("duration_us:Q", legend=None),  # said in the title: a second legend would not react to clicks
        opacity=alt.condition(pick, alt.value(0.9), alt.value(0.1)),
        tooltip=["kernel:N", "config:N", alt.Tooltip("intensity:Q", format=".3g"),
                 alt.Tooltip("tflops:Q", title="TFLOP/s", format=".3g"),
                 alt.Tooltip("duration_us:Q", title="µs (profiled launches)", format=".3g"), "launches:Q",
                 alt.Tooltip("tensor_pipe_pct:Q", title="tensor pipe %", format=".3g")]).add_params(pick)
    roofs = []
    for slug in sorted(df["gpu_slug"].unique()):
        if slug in BANDWIDTH and slug in PEAKS:
            bw = BANDWIDTH[slug][0]
            for precision, (peak, _) in PEAKS[slug].items():
                for ai in np.logspace(-2, 4, 25):
                    roofs.append({"gpu_slug": slug, "roof": precision, "intensity": ai,
                                  "tflops": float(f"{min(peak, ai * bw) / 1e12:.4g}")})
    layers = [dots]
    if roofs:
        layers.insert(0, alt.Chart(pd.DataFrame(roofs)).transform_filter(alt.datum.gpu_slug == gpu).mark_line(
            color="#333", strokeDash=[4, 3]).encode(x="intensity:Q", y="tflops:Q", detail="roof:N",
                                                    tooltip=["roof:N"]))
    return alt.layer(*layers).add_params(gpu).properties(width="container", height=360,
                                                 title="Roofline (dot area: kernel duration)")


# ----------------------------------------------------------------------------------------- beyond


def gpu_busy(busy: pd.DataFrame) -> alt.Chart:
    """A step's time beside the time its kernels keep the device busy (`beyond.gpu_busy`); GPU dropdown.
    Where the two are equal the device never waits for the host."""
    if busy.empty:
        return _empty("no run with a kernel table in the data")
    metrics = {"train_median_ms": "step time", "kernel_ms": "kernel time in the step"}
    df = _light(_fold(busy, metrics, ["gpu_slug", "device", "config", "busy", "dispatch_median_ms"]))
    gpu = _gpu_param(df)
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        yOffset=alt.YOffset("label:N", sort=list(metrics.values())),
        x=alt.X("value:Q", title="median ms"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        opacity=alt.Opacity("label:N", sort=list(metrics.values()), scale=alt.Scale(range=[1.0, 0.4]), title=None),
        tooltip=["device:N", "config:N", alt.Tooltip("label:N", title="what"), alt.Tooltip("value:Q", format=".4g"),
                 alt.Tooltip("busy:Q", title="busy share", format=".1%"),
                 alt.Tooltip("dispatch_median_ms:Q", title="host issue time, back to back (ms)", format=".4g")],
    ).add_params(gpu).properties(width="container", height=alt.Step(12), title="Step time and kernel time")


# ---------------------------------------------------------------------------------------- quality


def loss_curves(quality: pd.DataFrame) -> alt.Chart:
    """Loss of one configuration and of strict FP32 from the same weights; GPU and config dropdowns."""
    if quality.empty:
        return _empty("no quality tables in the data")
    df = quality.melt(id_vars=["gpu_slug", "config", "step"], value_vars=["loss", "baseline_loss"],
                      var_name="series", value_name="value")
    df = _light(df.assign(series=df["series"].map({"loss": "this configuration", "baseline_loss": "strict FP32"})), 6)
    gpu, cfg = _gpu_param(df), _config_param(df, skip_baseline=True)
    series = ["this configuration", "strict FP32"]
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_line(
        point=True).encode(
        x=alt.X("step:Q", title="optimizer step", axis=_step_axis(df)),
        y=alt.Y("value:Q", scale=alt.Scale(zero=False), title="L1 loss"),
        strokeDash=alt.StrokeDash("series:N", scale=alt.Scale(domain=series, range=[[1, 0], [5, 4]]), title=None),
        color=alt.Color("series:N", scale=alt.Scale(domain=series, range=["#f58518", "#333333"]), title=None),
        tooltip=["config:N", "series:N", "step:Q", alt.Tooltip("value:Q", format=".6g")],
    ).add_params(gpu, cfg).properties(width="container", height=260, title="Loss against strict FP32")


def loss_difference(quality: pd.DataFrame) -> alt.Chart:
    """Relative loss difference from strict FP32 per step, every configuration; GPU dropdown, legend."""
    if quality.empty:
        return _empty("no quality tables in the data")
    df = quality.assign(rel_diff=(quality["loss"] - quality["baseline_loss"]) / quality["baseline_loss"].abs())
    df = _light(df[["gpu_slug", "config", "step", "rel_diff"]])
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_line(point=True).encode(
        x=alt.X("step:Q", title="optimizer step", axis=_step_axis(df)),
        y=alt.Y("rel_diff:Q", axis=alt.Axis(format="%"), title="(loss - strict FP32 loss) / strict FP32 loss"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.1)),
        tooltip=["config:N", "step:Q", alt.Tooltip("rel_diff:Q", title="relative difference", format=".2%")],
    ).add_params(gpu, pick).properties(width="container", height=260, title="Loss difference from strict FP32")


def rel_err(qsum: pd.DataFrame, tolerance: float) -> alt.LayerChart:
    """Forward-pass relative error against strict FP32 per configuration, every GPU (log axis; an
    exact match is drawn at the axis floor and named so in its tooltip)."""
    if qsum.empty:
        return _empty("no quality tables in the data")
    floor = 1e-10
    df = _light(qsum.assign(shown=qsum["rel_err"].clip(lower=floor),
                            exact=np.where(qsum["rel_err"] == 0, "bitwise equal", "")))
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    pts = alt.Chart(df).mark_point(filled=True, size=110).encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("shown:Q", scale=alt.Scale(type="log", domain=[floor, 1]),
                title="relative L2 error of one forward pass vs strict FP32 (log)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        shape=alt.Shape("gpu_slug:N", title="GPU (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=["gpu_slug:N", "config:N", "precision_used:N", alt.Tooltip("rel_err:Q", format=".2e"),
                 alt.Tooltip("exact:N", title="note"),
                 alt.Tooltip("loss_diff:Q", title="mean loss difference", format=".2%")]).add_params(pick)
    tol = alt.Chart(pd.DataFrame({"x": [tolerance]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(
        x="x:Q", tooltip=[alt.Tooltip("x:Q", title="tolerance")])
    return alt.layer(tol, pts).properties(width="container", height=alt.Step(22),
                                          title="Forward-pass error against strict FP32")


# ----------------------------------------------------------------------------------------- claims


def claims_grid(table: pd.DataFrame) -> alt.Chart:
    """Each claim x each GPU (`claims.verdicts`), coloured by verdict; hover for the evidence; click a
    verdict to highlight."""
    df = table.drop(columns=["figures"], errors="ignore")
    pick = alt.selection_point(fields=["verdict"], bind="legend")
    return alt.Chart(df).mark_rect(stroke="white", strokeWidth=2).encode(
        y=alt.Y("short:N", sort=list(dict.fromkeys(df["short"])), title=None, axis=alt.Axis(labelLimit=420)),
        x=alt.X("gpu_slug:N", title=None, axis=alt.Axis(orient="top", labelAngle=0)),
        color=alt.Color("verdict:N", scale=alt.Scale(domain=list(VERDICT_COLORS), range=list(VERDICT_COLORS.values())),
                        title="verdict (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=["claim:N", "gpu_slug:N", "verdict:N", "evidence:N", "rule:N"],
    ).add_params(pick).properties(width="container", height=alt.Step(24), title="The paper's claims, measured")


# ---------------------------------------------------------------------------------------- scaling


def scaling(summary: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    """Global throughput against world size, with the ideal (linear from one rank) dashed; GPU
    dropdown, legend picks configurations; tooltips give efficiency and the ranks' spread."""
    if summary.empty:
        return _empty("no data-parallel scaling runs in the data (python -m medddpm scale)")
    df = _light(summary)
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    x = alt.X("world_size:O", title="ranks (world size)")
    color = alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df))
    tip = ["config:N", "backend:N", alt.Tooltip("world_size:O", title="ranks"),
           alt.Tooltip("samples_per_s:Q", title="samples/s", format=".3g"),
           alt.Tooltip("efficiency:Q", title="scaling efficiency", format=".0%"),
           alt.Tooltip("step_median_ms:Q", title="median step ms (slowest rank)", format=".4g"),
           alt.Tooltip("rank_min_ms:Q", title="fastest rank's median ms", format=".4g"),
           alt.Tooltip("rank_max_ms:Q", title="slowest rank's median ms", format=".4g")]
    opacity = alt.condition(pick, alt.value(1.0), alt.value(0.15))
    measured = base.mark_line(point=True).encode(x=x, y=alt.Y("samples_per_s:Q", title="training samples per second"),
                                                 color=color, opacity=opacity, tooltip=tip).add_params(pick)
    ideal = base.mark_line(strokeDash=[4, 3]).encode(x=x, y="ideal_samples_per_s:Q", color=color, opacity=opacity,
                                                     tooltip=tip)
    return alt.layer(ideal, measured).add_params(gpu).properties(
        width="container", height=max(260, 14 * df["config"].nunique() + 40),
        title="Data-parallel throughput (dashed: linear from one rank)")


# ----------------------------------------------------------------------------------------- memory

FIT_COLORS = ["#54a24b", "#eeca3b", "#e45756"]  # fits, tight, does not fit (memory.FIT_VERDICTS)


def _model_param(df: pd.DataFrame, name: str = "model") -> alt.Parameter:
    options = sorted(df["model"].unique())
    return alt.param(name=name, value=options[0], bind=alt.binding_select(options=options, name="model "))


def memory_peaks(mem: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    """Peak allocated memory per configuration (bar) and the allocator's reserved peak (tick), log
    scale, against the card sizes (dashed); dropdowns for the GPU measured on and the model, legend
    highlights a configuration."""
    if mem.empty:
        return _empty("no GPU peak memory in the data (a CPU run has none): run the sweep on a GPU")
    cols = ["gpu_slug", "model", "config", "label", "batch", "peak_gib", "reserved_gib", "other_gib",
            "sample_peak_gib", "train_median_ms", "precision_used", "checkpointing"]
    df = _light(mem[cols])
    gpu, model = _gpu_param(df), _model_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    rank = {c: i for i, c in enumerate(config_order(df["config"]))}
    order = df.assign(_r=df["config"].map(rank)).sort_values(["_r", "batch"])["label"].drop_duplicates().tolist()
    x_scale = alt.Scale(type="log", domain=[0.25, 160], clamp=True)
    tip = ["gpu_slug:N", "model:N", "config:N", "batch:Q", "precision_used:N", "checkpointing:N",
           alt.Tooltip("peak_gib:Q", title="peak allocated GiB", format=".3g"),
           alt.Tooltip("reserved_gib:Q", title="peak reserved GiB", format=".3g"),
           alt.Tooltip("other_gib:Q", title="outside the allocator GiB", format=".3g"),
           alt.Tooltip("sample_peak_gib:Q", title="sampling peak GiB", format=".3g"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step ms", format=".4g")]
    base = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.model == model))
    y = alt.Y("label:N", sort=order, title=None)
    bars = base.mark_bar().encode(
        y=y, x=alt.X("peak_gib:Q", scale=x_scale, title="peak memory of a training micro-step, GiB (log); tick: reserved"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    ticks = base.mark_tick(color="black", thickness=2).encode(y=y, x=alt.X("reserved_gib:Q", scale=x_scale),
                                                              tooltip=tip)
    cards = pd.DataFrame({"card_gb": list(GPU_MEMORY_GB), "card": [f"{c} GB" for c in GPU_MEMORY_GB]})
    rules = alt.Chart(cards).mark_rule(strokeDash=[4, 3], color="#888").encode(
        x=alt.X("card_gb:Q", scale=x_scale), tooltip=[alt.Tooltip("card:N", title="card")])
    # neighbouring sizes (40 and 48 GB) are close on a log axis: every other label one line higher
    labels = [alt.Chart(cards.iloc[k::2]).mark_text(align="left", dx=2, dy=-4 - 11 * k, baseline="bottom", fontSize=10,
                                                    color="#555").encode(x=alt.X("card_gb:Q", scale=x_scale),
                                                                         y=alt.value(0), text="card:N")
              for k in (0, 1)]
    return alt.layer(rules, *labels, bars, ticks).add_params(gpu, model).properties(
        width="container", height=_height(df, len(set(df["config"])), by="label"),
        title="Peak memory of one training micro-step (dashed: card sizes)")


def memory_fits(fits_df: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    """Configuration x card size: does batch 1 train (colour) and the largest batch (text); dropdowns
    for the GPU the peaks were measured on and the model; legend picks a verdict."""
    if fits_df.empty:
        return _empty("no GPU peak memory in the data (a CPU run has none): nothing to fit yet")
    df = _light(fits_df)
    df["batch_text"] = [("up to " + str(int(b))) if pd.notna(b) and b >= 1 else "-" for b in df["largest_batch"]]
    gpu, model = _gpu_param(df), _model_param(df)
    pick = alt.selection_point(fields=["verdict"], bind="legend")
    base = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.model == model))
    x = alt.X("card:N", sort=[f"{c} GB" for c in GPU_MEMORY_GB], title="GPU memory", axis=alt.Axis(labelAngle=0))
    y = alt.Y("config:N", sort=_configs_in(df), title=None)
    tip = ["gpu_slug:N", "model:N", "config:N", "card:N", alt.Tooltip("verdict:N", title="batch 1"),
           alt.Tooltip("need1_gib:Q", title="need at batch 1, GiB", format=".3g"),
           alt.Tooltip("largest_batch:Q", title="largest batch"),
           alt.Tooltip("per_sample_gib:Q", title="GiB per extra volume", format=".3g"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step ms (batch 1)", format=".4g"),
           alt.Tooltip("method:N", title="how")]
    cells = base.mark_rect(stroke="white", strokeWidth=2).encode(
        x=x, y=y, color=alt.Color("verdict:N", scale=alt.Scale(domain=list(FIT_VERDICTS), range=FIT_COLORS),
                                  legend=alt.Legend(title="batch 1 (click)")),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    text = base.mark_text(fontSize=11).encode(x=x, y=y, text="batch_text:N", tooltip=tip)
    return alt.layer(cells, text).add_params(gpu, model).properties(
        width="container", height=_height(df, 3, row=30), title="What fits where: batch 1, and the largest batch")


def switch_costs(costs: pd.DataFrame) -> alt.LayerChart | alt.Chart:
    """Step time with a memory-saving switch on over off (1 = free), one bar per measured pair; GPU
    dropdown, legend picks the switch; the memory it saved in the tooltip."""
    if costs.empty:
        return _empty("no pair of runs that differ in one memory-saving switch only")
    df = _light(costs)
    df["pair"] = df["config_off"] + " -> " + df["config_on"] + " (" + df["model"] + np.where(
        df["batch"] == 1, "", ", batch " + df["batch"].astype(str)) + ")"
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["switch"], bind="legend")
    tip = ["gpu_slug:N", "model:N", "change:N", "config_off:N", "config_on:N",
           alt.Tooltip("time_off_ms:Q", title="ms without", format=".4g"),
           alt.Tooltip("time_on_ms:Q", title="ms with", format=".4g"),
           alt.Tooltip("time_ratio:Q", title="time with / without", format=".3f"),
           alt.Tooltip("peak_off_gib:Q", title="peak GiB without", format=".3g"),
           alt.Tooltip("peak_on_gib:Q", title="peak GiB with", format=".3g"),
           alt.Tooltip("saved_frac:Q", title="memory saved", format=".0%")]
    bars = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("pair:N", title=None, sort=alt.EncodingSortField("switch")),
        x=alt.X("time_ratio:Q", title="micro-step time with the switch / without (1 = free)"),
        color=alt.Color("switch:N", legend=alt.Legend(title="switch (click)")),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    one = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(strokeDash=[4, 3], color="#333").encode(x="x:Q")
    return alt.layer(bars, one).add_params(gpu).properties(
        width="container", height=_height(df, df["switch"].nunique() + 1, by="pair"),
        title="What a memory-saving switch costs in step time")
