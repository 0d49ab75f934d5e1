"""Training quality against strict FP32 (loss, loss difference, forward-pass error) and the claims grid."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from medddpm.report.charts.theme import (VERDICT_COLORS, _config_param, _configs_in, _empty, _gpu_param, _light,
                                         _no_gpu, _step_axis, card_color, card_offset, card_order, config_color, figure,
                                         gpu_rows, is_cpu, log_axis, title)
from medddpm.report.loading import IN_PART

PANEL_COLUMNS, PANEL_WIDTH, PANEL_HEIGHT = 4, 122, 90  # four panels and their axes fit a 700 px column
IN_PART_FRAME = 4  # px: a verdict judged in part is a frame of its verdict's colour


@figure
def loss_curves(quality: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """Loss of one configuration and of strict FP32 from the same weights; GPU and config dropdowns."""
    q = gpu_rows(quality, cpu)
    if q.empty:
        return _no_gpu(quality, "quality tables")
    df = q.melt(id_vars=["gpu_slug", "config", "step"], value_vars=["loss", "baseline_loss"],
                var_name="series", value_name="value")
    df = _light(df.assign(series=df["series"].map({"loss": "this configuration", "baseline_loss": "strict FP32"})), 6)
    gpu, cfg = _gpu_param(df), _config_param(df, skip_baseline=True)
    series = ["this configuration", "strict FP32"]
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_line(
        point=True).encode(
        x=alt.X("step:Q", title="optimizer step", axis=_step_axis(df)),
        y=alt.Y("value:Q", scale=alt.Scale(zero=False), title="L1 loss (mean absolute error of the noise)"),
        strokeDash=alt.StrokeDash("series:N", scale=alt.Scale(domain=series, range=[[1, 0], [5, 4]]), title=None),
        color=alt.Color("series:N", scale=alt.Scale(domain=series, range=["#f58518", "#333333"]), title=None),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip("series:N"),
                 alt.Tooltip("step:Q", title="optimizer step", format="d"),
                 alt.Tooltip("value:Q", title="L1 loss", format=".6~r")],
    ).add_params(gpu, cfg).properties(width="container", height=260,
                                      title=title("Loss against strict FP32", "the same weights, data and noise"))


@figure
def loss_difference(quality: pd.DataFrame, *, cpu: bool = False) -> alt.FacetChart | alt.Chart:
    """Relative loss difference from strict FP32 per step: a small panel per configuration on one shared
    scale (a dozen lines on one plot hide one another), a dotted zero line in each; GPU dropdown."""
    q = gpu_rows(quality, cpu)
    if q.empty:
        return _no_gpu(quality, "quality tables")
    df = q.assign(rel_diff=(q["loss"] - q["baseline_loss"]) / q["baseline_loss"].abs())
    df = _light(df[["gpu_slug", "config", "step", "rel_diff"]])
    first = df.groupby(["gpu_slug", "config"])["step"].transform("min")
    df["first"] = df["step"] == first
    gpu = _gpu_param(df)
    x = alt.X("step:Q", title="optimizer step", axis=alt.Axis(format="d", tickMinStep=1, tickCount=4))
    line = alt.Chart().mark_line(point=alt.OverlayMarkDef(size=14), strokeWidth=1.5).encode(
        x=x, y=alt.Y("rel_diff:Q", axis=alt.Axis(format=".2~%", tickCount=4), title="loss difference (%)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        tooltip=[alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("step:Q", title="optimizer step", format="d"),
                 alt.Tooltip("rel_diff:Q", title="relative difference (%)", format=".3~%")])
    zero = alt.Chart().transform_filter(alt.datum["first"]).mark_rule(color="#888", strokeDash=[2, 2]).encode(
        y=alt.datum(0))
    return alt.layer(zero, line, data=df).transform_filter(alt.datum.gpu_slug == gpu).properties(
        width=PANEL_WIDTH, height=PANEL_HEIGHT).facet(
        facet=alt.Facet("config:N", sort=_configs_in(df), title=None,
                        header=alt.Header(labelFontWeight="bold", labelAnchor="start", labelFontSize=11)),
        columns=PANEL_COLUMNS, spacing={"row": 16, "column": 8},
        title=title("Loss difference from strict FP32",
                    "(loss - strict FP32 loss) / strict FP32 loss per step; one panel per configuration, one scale"),
    ).add_params(gpu)


@figure
def rel_err(qsum: pd.DataFrame, tolerance: float, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Forward-pass relative error against strict FP32 per configuration, every GPU (log axis; an
    exact match is drawn at the axis floor and named so in its tooltip)."""
    q = gpu_rows(qsum, cpu)
    if q.empty:
        return _no_gpu(qsum, "quality tables")
    lo = -10
    floor = 10.0**lo
    df = _light(q.assign(shown=q["rel_err"].clip(lower=floor), exact=np.where(q["rel_err"] == 0, "bitwise equal", "")))
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    scale, axis = log_axis(lo, 0, "relative L2 error of one forward pass vs strict FP32 (log scale)")
    gpus = card_order(df["gpu_slug"])
    pts = alt.Chart(df).mark_point(filled=True, size=90, opacity=1).encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        yOffset=card_offset(gpus),  # the cards side by side: the same error on two cards stays two points
        x=alt.X("shown:Q", scale=scale, axis=axis),
        color=alt.Color("gpu_slug:N", scale=card_color(gpus), sort=gpus,
                        legend=alt.Legend(title="GPU (click)", orient="bottom", direction="vertical", labelLimit=400)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=[alt.Tooltip("gpu_slug:N", title="GPU"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("precision_used:N", title="precision that ran"),
                 alt.Tooltip("rel_err:Q", title="relative L2 error", format=".2e"),
                 alt.Tooltip("exact:N", title="note"),
                 alt.Tooltip("loss_diff:Q", title="mean loss difference (%)", format=".2%")]).add_params(pick)
    tol = alt.Chart(pd.DataFrame({"x": [tolerance]})).mark_rule(strokeDash=[4, 3], color="#e45756").encode(
        x="x:Q", tooltip=[alt.Tooltip("x:Q", title="tolerance (relative L2 error)", format=".0e")])
    return alt.layer(tol, pts).properties(
        width="container", height=alt.Step(11),  # a step per card in each configuration's band
        title=title("Forward-pass error against strict FP32", "a colour per GPU, side by side; red dashed: the "
                    "tolerance; an exact match sits at the left edge"))


@figure
def claims_grid(table: pd.DataFrame, *, cpu: bool = False,
                names: dict[str, str] | None = None) -> alt.LayerChart | alt.Chart:
    """Each claim x each GPU (`claims.verdicts`), the cards side by side under their short names (`names`,
    `tables.card_names`), coloured by verdict (five states); a verdict judged in part (`judged`: some of its halves
    not judged yet) is a frame of its verdict's colour round a white cell that names it, never filled like one
    judged in full; hover for the evidence, the claim's scope and the paper's magnitude; click a verdict to
    highlight. A CPU judges no claim: its column only with `cpu`."""
    df = table.drop(columns=["figures"], errors="ignore")
    if not cpu:
        df = df[~df["gpu_slug"].map(is_cpu)]
    if df.empty:
        return _empty("no GPU measured yet: the claims are judged on a GPU")
    names = names or {}
    judged = df["judged"] if "judged" in df else pd.Series("", index=df.index)
    df = df.assign(card=df["gpu_slug"].map(lambda s: names.get(s, s)), part=np.where(judged == IN_PART, IN_PART, ""),
                   judged=judged.replace("", "not judged"))
    df["label"] = df["verdict"] + ", " + IN_PART
    cards = [names.get(s, s) for s in card_order(df["gpu_slug"])]
    pick = alt.selection_point(fields=["verdict"], bind="legend")
    base = alt.Chart(df).encode(
        y=alt.Y("short:N", sort=list(dict.fromkeys(df["short"])), title=None, axis=alt.Axis(labelLimit=420)),
        x=alt.X("card:N", sort=cards, title=None,
                axis=alt.Axis(orient="top", labelAngle=0, labelLimit=160, labelFontWeight="bold")),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=[alt.Tooltip("claim:N"), alt.Tooltip("gpu_slug:N", title="GPU"), alt.Tooltip("verdict:N"),
                 alt.Tooltip("judged:N"),
                 *([alt.Tooltip("scope:N"), alt.Tooltip("paper:N", title="the paper's magnitude"),
                    alt.Tooltip("paper_card:N", title="the paper's card")] if "scope" in df else []),
                 alt.Tooltip("evidence:N"), alt.Tooltip("rule:N")])
    verdicts = alt.Scale(domain=list(VERDICT_COLORS), range=list(VERDICT_COLORS.values()))
    full = base.transform_filter(alt.datum.part != IN_PART).mark_rect(stroke="white", strokeWidth=2).encode(
        color=alt.Color("verdict:N", scale=verdicts, title="verdict (click)",
                        legend=alt.Legend(orient="bottom", columns=3, labelLimit=300)))
    # in part: the verdict's colour as a frame round a white cell, which no verdict judged in full looks like
    part = base.transform_filter(alt.datum.part == IN_PART).mark_rect(
        fill="white", strokeWidth=IN_PART_FRAME, width=alt.RelativeBandSize(0.94), height=alt.RelativeBandSize(0.72),
    ).encode(stroke=alt.Stroke("verdict:N", scale=verdicts, legend=None))
    said = base.transform_filter(alt.datum.part == IN_PART).mark_text(fontSize=11, color="#222").encode(
        text=alt.Text("label:N"))
    return alt.layer(full, part, said).add_params(pick).properties(
        width="container", height=alt.Step(24),
        title=title("The paper's claims, measured", "a column per card; framed: judged in part, on the halves its data "
                    "judge"))
