"""Cards against each other: each configuration's step on every card side by side, and each kernel category's
time on one card over another's beside what the roofs and the model predict (`medddpm.report.cards`)."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from medddpm.report.charts.theme import (CATEGORIES, MS, _configs_in, _empty, _light, card_color, card_legend,
                                         card_offset, card_order, card_palette, chosen_axis_title, config_color,
                                         decades, figure, log_axis, title, unit_of, with_unit)

WHAT = {"measured_ratio": "measured", "model_ratio": "the model (its kernels)",
        "roofs_ratio": "the roofs at the category's intensity"}
WHAT_SHAPES = ["circle", "diamond", "square"]
WHAT_COLORS = ["#222222", "#e45756", "#4c78a8"]


@figure
def card_steps(steps: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Median micro-step per configuration, a bar per card side by side (no dropdown: the cards are read against
    each other), measured ones with their p10-p90 whisker, estimates paler; click a card in the legend. Cards
    are GPUs (`cards.step_times`): `cpu` is taken for the charts' common signature and changes nothing."""
    if steps.empty:
        return _empty("no GPU run in the data yet")
    df = _light(steps[["card", "gpu_slug", "config", "kind", "train_median_ms", "train_p10_ms", "train_p90_ms",
                       "source"]])
    # measured cards first, in `card_order` (their colours are those of every other chart of cards), then estimates
    first = df.assign(_m=df["kind"] != "measured").sort_values(["_m", "gpu_slug"], kind="stable")
    cards = list(dict.fromkeys(first["card"]))
    pick = alt.selection_point(fields=["card"], bind="legend")
    # estimates are off at first: a slow card's estimate sets the axis and squeezes the measured bars
    shown = alt.param(name="estimates", value=False, bind=alt.binding_checkbox(name="show the estimates "))
    base = alt.Chart(df).transform_filter((alt.datum.kind == "measured") | shown)
    y = alt.Y("config:N", sort=_configs_in(df), title=None)
    offset = alt.YOffset("card:N", sort=cards)
    tip = [alt.Tooltip("card:N"), alt.Tooltip("config:N", title="configuration"), alt.Tooltip("kind:N"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step, or the prediction (ms)", format=MS),
           alt.Tooltip("train_p10_ms:Q", title="p10, or the lower reading (ms)", format=MS),
           alt.Tooltip("train_p90_ms:Q", title="p90, or the higher reading (ms)", format=MS), alt.Tooltip("source:N")]
    bars = base.mark_bar().encode(
        y=y, yOffset=offset, x=alt.X("train_median_ms:Q", title="median micro-step time (ms)"),
        color=alt.Color("card:N", sort=cards, scale=alt.Scale(domain=cards, range=card_palette(len(cards))),
                        legend=alt.Legend(title="card (click)", orient="bottom", direction="vertical", labelLimit=420,
                                          symbolOpacity=1)),
        opacity=alt.condition(pick, alt.Opacity("kind:N", scale=alt.Scale(domain=["measured", "estimate"],
                                                                           range=[1.0, 0.45]), legend=None),
                              alt.value(0.1)),
        tooltip=tip).add_params(pick)
    spread = base.mark_rule(color="black").encode(y=y, yOffset=offset, x="train_p10_ms:Q", x2="train_p90_ms:Q",
                                                  tooltip=tip)
    return alt.layer(bars, spread).add_params(shown).properties(
        width="container", height=alt.Step(max(8, 30 // max(len(cards), 1))),
        title=title("A training micro-step on every card",
                    ["forward + backward + Adam; whisker: p10-p90 of the measured steps",
                     "pale, with the box ticked: an estimate from another card's profile and this card's datasheet,",
                     "its whisker from the model's prediction to its whole reading"]))


@figure
def category_ratios(ratios: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Per kernel category: card B's time over card A's, measured (both cards' kernel tables), as the model
    predicts it from A's kernels, and as the two cards' roofs predict it at the category's arithmetic intensity;
    dropdowns pick the pair of cards and the configuration (options from the data). `cpu`: as `card_steps`."""
    if ratios.empty:
        return _empty("no card with counters to predict from yet")
    ratios = ratios.assign(gpu_slug=ratios["from_card"])
    long = ratios.melt(id_vars=["gpu_slug", "pair", "kind", "config", "category", "ms", "intensity", "bound_a"],
                       value_vars=list(WHAT), var_name="what", value_name="ratio").dropna(subset=["ratio"])
    long = _light(long.assign(what=long["what"].map(WHAT)))
    pairs = list(dict.fromkeys(ratios.sort_values("kind", key=lambda k: k != "measured", kind="stable")["pair"]))
    pair = alt.param(name="pair", value=pairs[0], bind=alt.binding_select(options=pairs, name="cards "))
    configs = _configs_in(long)
    first = [c for c in configs if c in set(long.loc[long["pair"] == pairs[0], "config"])]
    cfg = alt.param(name="cfg", value=(first or configs)[0],
                    bind=alt.binding_select(options=configs, name="configuration "))
    lo, hi = decades(long["ratio"])
    scale, axis = log_axis(lo, hi, "card B's time over card A's (x, log scale)")
    whats = list(WHAT.values())
    legend = alt.Legend(title=None, orient="bottom", direction="vertical", labelLimit=400)  # shape and colour agree
    order = [c for c in CATEGORIES if c in set(long["category"])] + sorted(set(long["category"]) - set(CATEGORIES))
    points = alt.Chart(long).transform_filter((alt.datum.pair == pair) & (alt.datum.config == cfg)).mark_point(
        size=120, filled=True, strokeWidth=2.5).encode(
        y=alt.Y("category:N", sort=order, title=None),
        yOffset=alt.YOffset("what:N", sort=whats),  # the three side by side: equal ratios would hide one another
        x=alt.X("ratio:Q", scale=scale, axis=axis),
        shape=alt.Shape("what:N", sort=whats, scale=alt.Scale(domain=whats, range=WHAT_SHAPES), legend=legend),
        color=alt.Color("what:N", sort=whats, scale=alt.Scale(domain=whats, range=WHAT_COLORS), legend=legend),
        tooltip=[alt.Tooltip("pair:N", title="cards (A → B)"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("category:N"), alt.Tooltip("what:N"),
                 alt.Tooltip("ratio:Q", title="B's time / A's (x)", format=".3~r"),
                 alt.Tooltip("ms:Q", title="the category's time on A (ms a step)", format=MS),
                 alt.Tooltip("intensity:Q", title="intensity on A (FLOP per DRAM byte)", format=".3~r"),
                 alt.Tooltip("bound_a:N", title="roof it is under at that intensity")])
    one = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(strokeDash=[4, 3], color="#666").encode(x="x:Q")
    return alt.layer(one, points).add_params(pair, cfg).properties(
        width="container", height=alt.Step(11),  # a step per marker: three to a category
        title=title("Card against card, kernel category by category",
                    ["dashed: the same time on both cards; a memory-bound category should move with the",
                     "bandwidth ratio, a compute-bound one with the compute ratio"]))


COMPARE_METRICS = {"train_median_ms": "median micro-step (ms)", "energy_per_step_j": "energy per micro-step (J)",
                   "mean_power_w": "mean board power while timed (W)", "sm_clock_mhz": "SM clock while timed (MHz)",
                   "sample_s": "one full sample, 250 steps (s)", "peak_gib": "peak memory of a micro-step (GiB)"}


@figure
def card_compare(comp: pd.DataFrame, *, cpu: bool = False,
                 names: dict[str, str] | None = None) -> alt.LayerChart | alt.Chart:
    """The measured cards side by side, configuration by configuration (`card_compare.comparison`): radio buttons
    pick the measure, a bar per card in each configuration's band, told apart by colour and named in the legend by
    their short names (`names`); the micro-step with its p10-p90 whisker; a run held down by a power cap marked
    "capped" at its bar's end. `cpu`: as `card_steps`."""
    if comp.empty:
        return _empty("one measured card only: nothing to set side by side yet")
    shown = {k: v for k, v in COMPARE_METRICS.items() if comp[k].notna().any()}
    long = comp.melt(id_vars=["config", "gpu_slug", "ratio", "clock_state", "throttled", "train_p10_ms",
                              "train_p90_ms"], value_vars=list(shown), var_name="metric", value_name="value")
    long = _light(long.dropna(subset=["value"]).assign(label=lambda d: d["metric"].map(shown)))
    long["p10"] = long["train_p10_ms"].where(long["metric"] == "train_median_ms")
    long["p90"] = long["train_p90_ms"].where(long["metric"] == "train_median_ms")
    long["mark"] = np.where(long["throttled"], "capped", "")
    long["value_text"] = [with_unit(v, unit_of(lab)) for v, lab in zip(long["value"], long["label"])]
    gpus = card_order(long["gpu_slug"])
    metric = alt.param(name="measure", value="train_median_ms",
                       bind=alt.binding_radio(options=list(shown), labels=list(shown.values()), name="show "))
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    base = alt.Chart(long).transform_filter(alt.datum.metric == metric)
    y, offset = alt.Y("config:N", sort=_configs_in(long), title=None), card_offset(gpus)
    tip = [alt.Tooltip("gpu_slug:N", title="card"), alt.Tooltip("config:N", title="configuration"),
           alt.Tooltip("label:N", title="measure"), alt.Tooltip("value_text:N", title="value"),
           alt.Tooltip("p10:Q", title="p10 (ms)", format=MS), alt.Tooltip("p90:Q", title="p90 (ms)", format=MS),
           alt.Tooltip("ratio:Q", title="micro-step over the reference's (x)", format=".3f"),
           alt.Tooltip("clock_state:N", title="clocks while timed")]
    bars = base.mark_bar().encode(
        y=y, yOffset=offset, x=alt.X("value:Q", title=None),
        color=alt.Color("gpu_slug:N", scale=card_color(gpus), sort=gpus,
                        legend=card_legend("card (click)", names, orient="bottom", direction="vertical",
                                           labelLimit=400)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)), tooltip=tip).add_params(pick)
    spread = base.transform_filter(alt.datum.p10 != None).mark_rule(color="black").encode(  # noqa: E711 (Vega)
        y=y, yOffset=offset, x="p10:Q", x2="p90:Q", tooltip=tip)
    capped = base.transform_filter(alt.datum.mark != "").mark_text(
        align="left", dx=4, fontSize=10, fontWeight="bold", color="#b22222").encode(
        y=y, yOffset=offset, x="value:Q", text="mark:N", tooltip=tip)
    return alt.layer(bars, spread, capped, chosen_axis_title(metric, shown)).add_params(metric).properties(
        width="container", height=alt.Step(max(10, 26 // len(gpus))),
        title=title("The measured cards, configuration by configuration",
                    ["pick the measure; whisker: p10-p90 of the timed micro-steps",
                     "capped: clocks held down by the power limit while timed"]))


@figure
def ratio_by_share(why: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Each configuration's time on a card over the reference's (`card_compare.why`) against the share of the
    reference's step in memory-bound kernels: a point per configuration with its spread as a whisker, named. The
    more of a step moves data, the more a card of lower bandwidth slows it. `cpu`: as `card_steps`."""
    if why.empty:
        return _empty("one measured card only: no ratio yet")
    df = _light(why.assign(pair=why["gpu_slug"] + " over " + why["reference"]))
    lo, hi = float(df["ratio_lo"].min()), float(df["ratio_hi"].max())
    pad = max(hi - lo, 0.02) * 0.15
    y = alt.Y("ratio:Q", scale=alt.Scale(domain=[min(1.0, lo - pad), hi + pad], zero=False),
              title="micro-step on the card over the reference's (x)")
    x = alt.X("reference_share:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"),
              title="share of the reference's kernel time in memory-bound kernels (%)")
    tip = [alt.Tooltip("pair:N", title="cards"), alt.Tooltip("config:N", title="configuration"),
           alt.Tooltip("ratio:Q", title="ratio (x)", format=".3f"),
           alt.Tooltip("ratio_lo:Q", title="spread from (x)", format=".3f"),
           alt.Tooltip("ratio_hi:Q", title="spread to (x)", format=".3f"),
           alt.Tooltip("reference_share:Q", title="memory-bound share on the reference (%)", format=".0%"),
           alt.Tooltip("memory_share:Q", title="memory-bound share on the card (%)", format=".0%")]
    base = alt.Chart(df)
    colour = alt.Color("config:N", scale=config_color(df["config"]), legend=None)
    points = base.mark_point(filled=True, size=90, opacity=1).encode(x=x, y=y, color=colour, tooltip=tip)
    whiskers = base.mark_rule().encode(x=x, y="ratio_lo:Q", y2="ratio_hi:Q", color=colour, tooltip=tip)
    names = base.mark_text(align="left", dx=7, fontSize=11, color="#333").encode(x=x, y=y, text="config:N")
    one = alt.Chart(pd.DataFrame({"y": [1.0]})).mark_rule(strokeDash=[4, 3], color="#666").encode(y="y:Q")
    return alt.layer(one, whiskers, points, names).properties(
        width="container", height=260,
        title=title("The ratio against the memory-bound share",
                    ["a point per configuration; whisker: the ratio's spread (p10/p90 of both runs)",
                     "dashed: as fast on both cards"]))


__all__ = ["COMPARE_METRICS", "WHAT", "card_compare", "card_steps", "category_ratios", "ratio_by_share"]
