"""Where the kernel time goes: by category, the largest kernels, and forward / backward / optimizer."""

from __future__ import annotations

import altair as alt
import pandas as pd

from medddpm.report.charts.theme import (CATEGORIES, PASS_COLORS, PASS_ORDER, _config_param, _configs_in, _fold,
                                         _gpu_param, _height, _light, _metric_param, _no_gpu, category_color,
                                         chosen_axis_title, duration_text, figure, gpu_rows, title)

CATEGORY_METRICS = {"share": "share of the step's kernel time (%)", "ms_per_step": "kernel time per step (ms)"}


@figure
def category_shares(shares: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Kernel time per category and configuration, stacked; radio: share of the step's kernel time or ms per step
    (in ms a configuration's whole bar is its kernel time, so a category that keeps its time while others grow is
    seen to); GPU dropdown; click a category to highlight it."""
    df = gpu_rows(shares, cpu)
    if df.empty:
        return _no_gpu(shares, "kernel profiles")
    df = df.assign(ms_per_step=df["us_per_step"] / 1e3, time_text=df["us_per_step"].map(duration_text),
                   order=df["category"].map({c: i for i, c in enumerate(CATEGORIES)}).fillna(99))
    df = _light(_fold(df.assign(share_text=df["share"].map("{:.1%}".format)), CATEGORY_METRICS,
                      ["gpu_slug", "config", "category", "order", "time_text", "share_text"]))
    present = [c for c in CATEGORIES if c in set(df["category"])]
    gpu, metric = _gpu_param(df), _metric_param(CATEGORY_METRICS)
    pick = alt.selection_point(fields=["category"], bind="legend")
    bars = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", stack="zero", title=None,
                axis=alt.Axis(labelExpr=f"{metric.name} == 'share' ? format(datum.value, '.0%') : datum.label")),
        color=alt.Color("category:N", scale=category_color(),
                        legend=alt.Legend(values=present, title="category (click)")),
        order=alt.Order("order:Q"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip("category:N"),
                 alt.Tooltip("share_text:N", title="share of kernel time"),
                 alt.Tooltip("time_text:N", title="time per step")])
    return alt.layer(bars, chosen_axis_title(metric, CATEGORY_METRICS)).add_params(gpu, metric, pick).properties(
        width="container", height=_height(df, len(present)), title=title("Where the kernel time goes, by category"))


@figure
def top_kernels(top: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """The largest kernels of one run; dropdowns pick the GPU and the configuration."""
    df = gpu_rows(top, cpu)
    if df.empty:
        return _no_gpu(top, "kernel profiles")
    df = df.assign(label=df["rank"].astype(str).str.rjust(2) + ". " + df["short_name"].str.slice(0, 48),
                   ms_per_step=df["us_per_step"] / 1e3, time_text=df["us_per_step"].map(duration_text))
    df = _light(df)
    gpu, cfg = _gpu_param(df), _config_param(df)
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_bar().encode(
        y=alt.Y("label:N", sort=alt.EncodingSortField("rank", order="ascending"), title=None),
        x=alt.X("ms_per_step:Q", title="device time per step (ms)"),
        color=alt.Color("category:N", scale=category_color(),
                        legend=alt.Legend(values=[c for c in CATEGORIES if c in set(df["category"])],
                                          title="category")),
        tooltip=[alt.Tooltip("kernel:N", title="kernel"), alt.Tooltip("category:N"),
                 alt.Tooltip("passes:N", title="pass"),
                 alt.Tooltip("calls_per_step:Q", title="calls per step", format=",.3~r"),
                 alt.Tooltip("time_text:N", title="time per step"),
                 alt.Tooltip("share:Q", title="share of the step (%)", format=".1%"),
                 alt.Tooltip("tensor_cores:N", title="tensor cores (by name)")],
    ).add_params(gpu, cfg).properties(width="container", height=_height(df, df["category"].nunique(), 18, "rank"),
                                      title=title("Top kernels of one run", "largest first; choose the GPU and "
                                                  "configuration below"))


PASS_METRICS = {"ms_per_step": "time per step (ms)", "share": "share of the step (%)"}


@figure
def pass_split(passes: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Forward / backward / optimizer time per configuration; radio: absolute time or share (the axis title
    and tick labels follow)."""
    df = gpu_rows(passes, cpu)
    if df.empty:
        return _no_gpu(passes, "kernel profiles")
    df = df.assign(ms_per_step=df["us_per_step"] / 1e3,
                   order=df["pass"].map({p: i for i, p in enumerate(PASS_ORDER)}).fillna(9))
    df = _light(_fold(df, PASS_METRICS, ["gpu_slug", "config", "pass", "order"]))
    df["value_text"] = [f"{v:.1%}" if m == "share" else f"{v:.4g} ms" for v, m in zip(df["value"], df["metric"])]
    gpu, metric = _gpu_param(df), _metric_param(PASS_METRICS)
    bars = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", stack="zero", title=None,
                axis=alt.Axis(labelExpr=f"{metric.name} == 'share' ? format(datum.value, '.0%') : datum.label")),
        color=alt.Color("pass:N", scale=alt.Scale(domain=PASS_ORDER, range=PASS_COLORS), title="pass"),
        order=alt.Order("order:Q"),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip("pass:N"),
                 alt.Tooltip("label:N", title="metric"), alt.Tooltip("value_text:N", title="value")])
    return alt.layer(bars, chosen_axis_title(metric, PASS_METRICS)).add_params(gpu, metric).properties(
        width="container", height=_height(df, df["pass"].nunique()), title=title("Forward, backward and optimizer"))
