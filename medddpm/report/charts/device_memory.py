"""Device memory: measured peaks against the cards' memory, what fits where, and what a memory-saving switch costs.

Every size is in GiB, a card's too: the memory its driver reports (`memory.card_memory`), measured where a run measured
it, else cited. A card is named as its driver names it; the size it is sold with (GB) stays out of the charts, in
the page's table of cards."""

from __future__ import annotations

import textwrap

import altair as alt
import numpy as np
import pandas as pd

from medddpm.report.charts.theme import (MS, _config_legend, _configs_in, _default_gpu, _gpu_param, _height, _light,
                                         _no_gpu, config_color, figure, gpu_rows, parts_color, title)
from medddpm.report.loading import config_order
from medddpm.report.memory import FIT_VERDICTS, card_memory

FIT_COLORS = ["#54a24b", "#eeca3b", "#e45756"]  # fits, tight, does not fit (memory.FIT_VERDICTS)


def _model_param(df: pd.DataFrame, name: str = "model") -> alt.Parameter:
    """The model dropdown, starting on a model the default GPU (`_gpu_param`'s) ran, the one it ran most
    configurations of: a GPU that never ran the first model in the list would open on an empty chart."""
    options = sorted(df["model"].unique())
    mine = df[df["gpu_slug"] == _default_gpu(df["gpu_slug"])] if "gpu_slug" in df else df
    counts = mine.groupby("model")["config"].nunique() if len(mine) else pd.Series(dtype=int)
    first = max(options, key=lambda m: (counts.get(m, 0), -options.index(m)))
    return alt.param(name=name, value=first, bind=alt.binding_select(options=options, name="model "))


def card_label(name: str, gib: float) -> str:
    """A card on a chart: its name as its driver gives it, without the vendor's prefix, and its memory in GiB."""
    return f"{name.removeprefix('NVIDIA ')}: {gib:.1f} GiB"


AXIS_LINE = 10  # characters of a card's name on one line of an axis label: 60 px, a seventh of the column


def axis_label(name: str, gib: float) -> str:
    """A card under a column of a chart: its name (`card_label`'s, without "Tesla") in lines of at most
    `AXIS_LINE` characters, broken at spaces and hyphens, over its memory; lines joined by "|" for the axis's
    `labelExpr` to split. Full names side by side would run into each other."""
    short = name.removeprefix("NVIDIA ").removeprefix("Tesla ")
    return "|".join(textwrap.wrap(short, AXIS_LINE, break_on_hyphens=True) + [f"{gib:.1f} GiB"])


def _cards(df: pd.DataFrame, cards: pd.DataFrame) -> pd.DataFrame:
    """Per (GPU, model): the cards up to the smallest that holds every peak drawn, so that the linear axis ends
    there and the bars keep the width (a 140 GiB card beside 4 GiB peaks leaves them slivers)."""
    rows = []
    for (slug, model), g in df.groupby(["gpu_slug", "model"]):
        top = np.nanmax(g[["peak_gib", "reserved_gib"]].to_numpy(dtype=float))
        sizes = cards[cards["card_gib"] < top].to_dict("records") + cards[cards["card_gib"] >= top].head(1).to_dict(
            "records")
        rows += [{"gpu_slug": slug, "model": model, "card_gib": c["card_gib"], "source": c["source"], "k": i % 2,
                  "card": card_label(c["card"], c["card_gib"])} for i, c in enumerate(sizes)]
    return pd.DataFrame(rows, columns=["gpu_slug", "model", "card_gib", "card", "source", "k"])


@figure
def memory_peaks(mem: pd.DataFrame, cards: pd.DataFrame | None = None, *,
                 cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Peak allocated memory per configuration (bar, linear from 0) and the allocator's reserved peak (tick),
    against the cards' memory (dashed: `memory.card_memory`, the catalogue's when not given); dropdowns for the GPU
    measured on and the model, legend highlights a configuration."""
    cols = ["gpu_slug", "model", "config", "label", "batch", "peak_gib", "reserved_gib", "other_gib",
            "sample_peak_gib", "train_median_ms", "precision_used", "checkpointing"]
    df = _light(gpu_rows(mem, cpu)[cols]) if len(mem) else mem
    if df.empty:
        return _no_gpu(mem, "GPU peak memory", " (a CPU run has none): run the sweep on a GPU")
    gpu, model = _gpu_param(df), _model_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    rank = {c: i for i, c in enumerate(config_order(df["config"]))}
    order = df.assign(_r=df["config"].map(rank)).sort_values(["_r", "batch"])["label"].drop_duplicates().tolist()
    tip = [alt.Tooltip("gpu_slug:N", title="measured on"), alt.Tooltip("model:N"),
           alt.Tooltip("config:N", title="configuration"), alt.Tooltip("batch:Q", format="d"),
           alt.Tooltip("precision_used:N", title="precision that ran"), alt.Tooltip("checkpointing:N"),
           alt.Tooltip("peak_gib:Q", title="peak allocated (GiB)", format=".3~r"),
           alt.Tooltip("reserved_gib:Q", title="peak reserved (GiB)", format=".3~r"),
           alt.Tooltip("other_gib:Q", title="outside the allocator (GiB)", format=".3~r"),
           alt.Tooltip("sample_peak_gib:Q", title="sampling peak (GiB)", format=".3~r"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step (ms)", format=MS)]
    keep = (alt.datum.gpu_slug == gpu) & (alt.datum.model == model)
    base = alt.Chart(df).transform_filter(keep)
    y = alt.Y("label:N", sort=order, title=None)
    x = alt.X("peak_gib:Q", scale=alt.Scale(zero=True), title="peak memory of a training micro-step (GiB)")
    bars = base.mark_bar().encode(
        y=y, x=x, color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    ticks = base.mark_tick(color="black", thickness=2).encode(y=y, x="reserved_gib:Q", tooltip=tip)
    cards = alt.Chart(_cards(df, card_memory() if cards is None else cards)).transform_filter(keep)
    rules = cards.mark_rule(strokeDash=[4, 3], color="#888").encode(
        x="card_gib:Q", tooltip=[alt.Tooltip("card:N", title="card: memory its driver reports"),
                                 alt.Tooltip("source:N", title="figure from")])
    # neighbouring sizes can lie close: every other label one line higher
    labels = [cards.transform_filter(alt.datum.k == k).mark_text(
        align="center", dy=-4 - 11 * k, baseline="bottom", fontSize=10, color="#555").encode(
        x="card_gib:Q", y=alt.value(0), text="card:N") for k in (0, 1)]
    return alt.layer(rules, *labels, bars, ticks).add_params(gpu, model).properties(
        width="container", height=_height(df, len(set(df["config"])), by="label"),
        title=title("Peak memory of one training micro-step",
                    ["bar: peak allocated; tick: peak reserved by the allocator",
                     "dashed: the memory a card's driver reports, up to the smallest card that holds every bar"]))


@figure
def memory_fits(fits_df: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Configuration x card: does batch 1 train (colour) and the largest batch (text); dropdowns
    for the GPU the peaks were measured on and the model; legend picks a verdict."""
    df = gpu_rows(fits_df, cpu)
    if df.empty:
        return _no_gpu(fits_df, "GPU peak memory", " (a CPU run has none): nothing to fit yet")
    df = _light(df.assign(card_axis=[axis_label(c, g) for c, g in zip(df["card"], df["card_gib"])]))
    df["batch_text"] = [("up to " + str(int(b))) if pd.notna(b) and b >= 1 else "-" for b in df["largest_batch"]]
    gpu, model = _gpu_param(df), _model_param(df)
    pick = alt.selection_point(fields=["verdict"], bind="legend")
    base = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.model == model))
    order = df.sort_values(["card_gib", "card"])["card_axis"].drop_duplicates().tolist()
    # a card's name over its memory, the name on short lines: seven cards side by side fit the page's column
    x = alt.X("card_axis:N", sort=order, title="card: the memory its driver reports (GiB)",
              axis=alt.Axis(labelAngle=0, labelExpr="split(datum.label, '|')", labelLimit=160))
    y = alt.Y("config:N", sort=_configs_in(df), title=None)
    tip = [alt.Tooltip("gpu_slug:N", title="measured on"), alt.Tooltip("model:N"),
           alt.Tooltip("config:N", title="configuration"), alt.Tooltip("card:N"),
           alt.Tooltip("card_gib:Q", title="card memory, as its driver reports (GiB)", format=".3~r"),
           alt.Tooltip("card_kind:N", title="card memory figure"), alt.Tooltip("verdict:N", title="batch 1"),
           alt.Tooltip("need1_gib:Q", title="need at batch 1 (GiB)", format=".3~r"),
           alt.Tooltip("largest_batch:Q", title="largest batch", format="d"),
           alt.Tooltip("per_sample_gib:Q", title="per extra volume (GiB)", format=".3~r"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step, batch 1 (ms)", format=MS),
           alt.Tooltip("method:N", title="how")]
    cells = base.mark_rect(stroke="white", strokeWidth=2).encode(
        x=x, y=y, color=alt.Color("verdict:N", scale=alt.Scale(domain=list(FIT_VERDICTS), range=FIT_COLORS),
                                  legend=alt.Legend(title="batch 1 (click)")),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    text = base.mark_text(fontSize=11).encode(x=x, y=y, text="batch_text:N", tooltip=tip)
    return alt.layer(cells, text).add_params(gpu, model).properties(
        width="container", height=_height(df, 3, row=30),
        title=title("What fits where", "colour: does batch 1 train; text: the largest batch"))


@figure
def switch_costs(costs: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Step time with a memory-saving switch on over off (1 = free), one bar per measured pair; GPU
    dropdown, legend picks the switch; the memory it saved in the tooltip."""
    df = gpu_rows(costs, cpu)
    if df.empty:
        return _no_gpu(costs, "pair of runs that differ in one memory-saving switch only")
    df = _light(df)
    df["pair"] = df["config_off"] + " -> " + df["config_on"] + " (" + df["model"] + np.where(
        df["batch"] == 1, "", ", batch " + df["batch"].astype(str)) + ")"
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["switch"], bind="legend")
    tip = [alt.Tooltip("gpu_slug:N", title="GPU"), alt.Tooltip("model:N"), alt.Tooltip("change:N"),
           alt.Tooltip("config_off:N", title="without"), alt.Tooltip("config_on:N", title="with"),
           alt.Tooltip("time_off_ms:Q", title="micro-step without (ms)", format=MS),
           alt.Tooltip("time_on_ms:Q", title="micro-step with (ms)", format=MS),
           alt.Tooltip("time_ratio:Q", title="time with / without (×)", format=".3f"),
           alt.Tooltip("peak_off_gib:Q", title="peak without (GiB)", format=".3~r"),
           alt.Tooltip("peak_on_gib:Q", title="peak with (GiB)", format=".3~r"),
           alt.Tooltip("saved_frac:Q", title="memory saved (%)", format=".0%")]
    bars = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("pair:N", title=None, sort=alt.EncodingSortField("switch"), axis=alt.Axis(labelLimit=240)),
        x=alt.X("time_ratio:Q", title="micro-step time with the switch ÷ without (×; 1 = free)"),
        color=alt.Color("switch:N", scale=parts_color(sorted(df["switch"].unique())),
                        legend=alt.Legend(title="switch (click)")),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    one = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(strokeDash=[4, 3], color="#333").encode(x="x:Q")
    return alt.layer(bars, one).add_params(gpu).properties(
        width="container", height=_height(df, df["switch"].nunique() + 1, by="pair"),
        title=title("What a memory-saving switch costs in step time", "dashed: 1 = as fast as without"))
