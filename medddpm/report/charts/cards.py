"""Cards against each other: each configuration's step on every card side by side, and each kernel category's
time on one card over another's beside what the roofs and the model predict (`medddpm.report.cards`)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from medddpm.report.charts.theme import (CATEGORIES, MS, _configs_in, _empty, _light, decades, distinct_colors, figure,
                                         log_axis, title)

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
    cards = list(dict.fromkeys(df.sort_values("kind", key=lambda k: k != "measured", kind="stable")["card"]))
    pick = alt.selection_point(fields=["card"], bind="legend")
    # estimates are off at first: a slow card's estimate sets the axis and squeezes the measured bars
    shown = alt.param(name="estimates", value=False, bind=alt.binding_checkbox(name="show the estimates "))
    base = alt.Chart(df).transform_filter((alt.datum.kind == "measured") | shown)
    y = alt.Y("config:N", sort=_configs_in(df), title=None)
    offset = alt.YOffset("card:N", sort=cards)
    tip = [alt.Tooltip("card:N"), alt.Tooltip("config:N", title="configuration"), alt.Tooltip("kind:N"),
           alt.Tooltip("train_median_ms:Q", title="median micro-step (ms)", format=MS),
           alt.Tooltip("train_p10_ms:Q", title="p10 (ms)", format=MS),
           alt.Tooltip("train_p90_ms:Q", title="p90 (ms)", format=MS), alt.Tooltip("source:N")]
    bars = base.mark_bar().encode(
        y=y, yOffset=offset, x=alt.X("train_median_ms:Q", title="median micro-step time (ms)"),
        color=alt.Color("card:N", sort=cards, scale=alt.Scale(domain=cards, range=distinct_colors(len(cards))),
                        legend=alt.Legend(title="card (click)", orient="bottom", direction="vertical", labelLimit=420,
                                          symbolOpacity=1)),
        opacity=alt.condition(pick, alt.Opacity("kind:N", scale=alt.Scale(domain=["measured", "estimate"],
                                                                           range=[1.0, 0.45]), legend=None),
                              alt.value(0.1)),
        tooltip=tip).add_params(pick)
    spread = base.transform_filter(alt.datum.kind == "measured").mark_rule(color="black").encode(
        y=y, yOffset=offset, x="train_p10_ms:Q", x2="train_p90_ms:Q", tooltip=tip)
    return alt.layer(bars, spread).add_params(shown).properties(
        width="container", height=alt.Step(max(8, 30 // max(len(cards), 1))),
        title=title("A training micro-step on every card",
                    ["forward + backward + Adam; whisker: p10-p90 of the measured steps",
                     "pale, with the box ticked: an estimate from another card's profile and this card's datasheet"]))


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
    legend = alt.Legend(title=None, orient="bottom", direction="vertical")  # one legend: shape and colour agree
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


__all__ = ["WHAT", "card_steps", "category_ratios"]
