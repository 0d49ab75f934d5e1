"""The convergence study's figures: loss bands over seeds, each seed's sample scores, and the paired differences
judged against their margins."""

from __future__ import annotations

import altair as alt
import pandas as pd

from medddpm.report.charts.theme import (_config_legend, _configs_in, _empty, _gpu_param, _light, _metric_param,
                                         config_color, figure, title)

NO_STUDY = "no convergence study in the data (python -m medddpm study)"
OUTCOME_COLORS = {"equivalent": "#54a24b", "better": "#4c78a8", "worse": "#e45756", "undecided": "#f2a93b"}


@figure
def study_losses(bands: pd.DataFrame) -> alt.Chart:
    """Per configuration, the median training loss over seeds (line) and its range (band), each a window mean of
    steps (`convergence.loss_bands`); GPU dropdown, the legend picks configurations."""
    df = _light(bands, 5)
    if df.empty:
        return _empty(NO_STUDY)
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    color = alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df))
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    x = alt.X("step:Q", title="optimizer step")
    tips = ["config:N", alt.Tooltip("step:Q", title="up to step"), alt.Tooltip("seeds:Q"),
            alt.Tooltip("median:Q", title="median loss", format=".4f"), alt.Tooltip("low:Q", title="lowest seed", format=".4f"),
            alt.Tooltip("high:Q", title="highest seed", format=".4f")]
    band = base.mark_area(opacity=0.15).encode(
        x=x, y=alt.Y("low:Q", scale=alt.Scale(type="log"), title="L1 loss (window mean, log scale)"), y2="high:Q",
        color=color, opacity=alt.condition(pick, alt.value(0.18), alt.value(0.02)))
    line = base.mark_line(strokeWidth=1.6).encode(x=x, y="median:Q", color=color, tooltip=tips,
                                                 opacity=alt.condition(pick, alt.value(0.95), alt.value(0.1)))
    return alt.layer(band, line).add_params(gpu, pick).properties(
        width="container", height=300, title=title("Training loss: median over seeds, band from the lowest to the highest"))


@figure
def study_scores(per_seed: pd.DataFrame, metrics: dict[str, str], real: str = "real") -> alt.LayerChart | alt.Chart:
    """Each seed's mean score (points) and the mean over seeds (tick) per configuration; the held-out subjects' real
    images (configuration `real`) as a dashed rule; GPU dropdown, metric radio buttons."""
    if per_seed.empty:
        return _empty(NO_STUDY)
    long = _light(per_seed.melt(id_vars=["gpu_slug", "config", "seed"], value_vars=list(metrics), var_name="metric",
                                value_name="value").dropna(subset=["value"]))
    long["what"] = long["metric"].map(metrics)
    trained, reals = long[long["config"] != real], long[long["config"] == real]
    gpu, metric = _gpu_param(long), _metric_param({m: m for m in metrics})
    order = _configs_in(trained)
    base = alt.Chart(trained).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric))
    y = alt.Y("config:N", sort=order, title=None)
    points = base.mark_circle(size=70, opacity=0.8).encode(
        x=alt.X("value:Q", scale=alt.Scale(zero=False), title="score (choose the metric below)"), y=y,
        color=alt.Color("config:N", scale=config_color(trained["config"]), legend=None),
        tooltip=["config:N", "seed:N", "what:N", alt.Tooltip("value:Q", format=".3f")])
    means = base.mark_tick(thickness=3, size=22, color="#333").encode(
        x="mean(value):Q", y=y, tooltip=["config:N", "what:N", alt.Tooltip("mean(value):Q", title="mean over seeds",
                                                                           format=".3f")])
    layers = [points, means]
    if len(reals):
        layers.append(alt.Chart(reals).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric))
                      .mark_rule(color="#888", strokeDash=[4, 3]).encode(
                          x="mean(value):Q", tooltip=[alt.Tooltip("mean(value):Q", title="real images", format=".3f")]))
    return alt.layer(*layers).add_params(gpu, metric).properties(
        width="container", height=max(120, 34 * len(order)), title=title("Sample scores, one point per seed"))


@figure
def paired_differences(paired: pd.DataFrame, metrics: dict[str, str]) -> alt.LayerChart | alt.Chart:
    """Per comparison, the mean paired difference (candidate minus reference) with its interval, over the band of
    plus or minus the margin; coloured by verdict; GPU dropdown, metric radio buttons."""
    df = _light(paired.drop(columns=["differences"], errors="ignore").dropna(subset=["mean"]), 4)
    if df.empty:
        return _empty("no two configurations of the study share a seed yet")
    df["comparison"] = df["candidate"] + " − " + df["reference"]
    df["lo_margin"], df["hi_margin"] = -df["margin"], df["margin"]
    df["what"] = df["metric"].map(metrics)
    gpu, metric = _gpu_param(df), _metric_param({m: m for m in metrics})
    order = list(dict.fromkeys(df["comparison"]))
    base = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric))
    y = alt.Y("comparison:N", sort=order, title=None, axis=alt.Axis(labelLimit=200))
    x_title = "candidate minus reference, seed by seed (mean and 90% interval)"
    margin = base.mark_bar(color="#e8e8e8", height=22).encode(
        x=alt.X("lo_margin:Q", title=x_title), x2="hi_margin:Q", y=y,
        tooltip=[alt.Tooltip("margin:Q", title="margin ±", format=".3f")])
    zero = alt.Chart(pd.DataFrame({"zero": [0.0]})).mark_rule(color="#999").encode(x="zero:Q")
    color = alt.Color("verdict:N", scale=alt.Scale(domain=list(OUTCOME_COLORS), range=list(OUTCOME_COLORS.values())),
                      title="verdict")
    tips = ["comparison:N", "what:N", alt.Tooltip("seeds:Q"), alt.Tooltip("mean:Q", format="+.4f"),
            alt.Tooltip("low:Q", title="interval from", format="+.4f"),
            alt.Tooltip("high:Q", title="interval to", format="+.4f"), alt.Tooltip("margin:Q", format=".3f"),
            "verdict:N", alt.Tooltip("seeds_needed:Q", title="seeds to decide")]
    interval = base.mark_rule(strokeWidth=3).encode(x="low:Q", x2="high:Q", y=y, color=color, tooltip=tips)
    point = base.mark_point(filled=True, size=80).encode(x="mean:Q", y=y, color=color, tooltip=tips)
    return alt.layer(margin, zero, interval, point).add_params(gpu, metric).properties(
        width="container", height=max(120, 40 * len(order)),
        title=title("Paired differences against the margin", "grey band: ± the margin; inside it, equivalent"))
