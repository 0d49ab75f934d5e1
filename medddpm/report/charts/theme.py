"""What every chart shares: the renderer, the colours, which rows are a GPU's, titles, units and formats."""

from __future__ import annotations

import colorsys
import functools
import json
import math
import os
import re
import textwrap

import altair as alt
import numpy as np
import pandas as pd

from medddpm.report.loading import FAILS, HOLDS, MAGNITUDE, NA, UNDECIDED, config_order

# One colour per configuration, in CONFIGS order: Tableau 10, then ten more chosen so that no two of the twenty
# are closer than about 25 CIELAB units (the light and dark twins of Tableau 20 are closer than 10, and a
# reader cannot tell opt1-ckpt from baseline by them). Configurations past twenty get generated hues.
PALETTE = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d",
           "#bab0ac", "#393b79", "#843c39", "#637939", "#222222", "#e377c2", "#cedb9c", "#6b6ecf", "#dc0000",
           "#800080", "#ff1493"]
CATEGORIES = ("convolution", "gemm", "attention", "elementwise", "normalization", "reduction", "layout", "fused",
              "memcpy", "optimizer", "other")  # medddpm.kernels.CATEGORIES (not imported: it loads the profiler)
# Related categories share a hue (convolution and GEMM blue, normalization and reduction green); "other" is grey.
CATEGORY_COLORS = ["#4c78a8", "#9ecae9", "#b279a2", "#f58518", "#54a24b", "#88d27a", "#e45756", "#eeca3b",
                   "#72b7b2", "#9d755d", "#d6d6d6"]
OTHER = "other"
OTHER_COLOR = "#d6d6d6"
# Parts of a whole (stall reasons, instruction classes, rule sections): Tableau 10 without its grey, which
# stands for what is grouped as "other".
PARTS = ["#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d"]
PASS_ORDER = ["forward", "backward", "optimizer", "graph", "other"]
PASS_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#bab0ac"]
VERDICT_COLORS = {HOLDS: "#54a24b", MAGNITUDE: "#b5d99c", FAILS: "#e45756", UNDECIDED: "#f2a93b", NA: "#d6d6d6"}
MAX_ROWS = 5000  # pages pass aggregated frames; more than this is a mistake
GIB = 2**30
MS = ".4~r"  # milliseconds and most measured values in tooltips: four significant digits, no trailing zeros


def live_notebook() -> bool:
    """Whether this kernel belongs to a live notebook: one that a Jupyter server started (it sets
    JPY_SESSION_NAME) or scripts/jupyterlab.sh (MEDDDPM_LAB=1). A book build runs without either."""
    return os.environ.get("MEDDDPM_LAB") == "1" or bool(os.environ.get("JPY_SESSION_NAME"))


def setup() -> None:
    """Choose the renderer (the one place to change it) and guard against heavy pages.

    The book's static HTML gets Altair's default renderer (its vega scripts are served by the book,
    book/_ext/medddpm_book.py). A page opened as a notebook in JupyterLab gets the `jupyter` renderer
    with ``offline=True``: each chart is an `altair.JupyterChart` whose vega comes from vl-convert, so
    it draws with no network, and which takes the output's width (`lab.jupyter_chart_for_lab`)."""
    if live_notebook():
        from medddpm.report.charts.jupyterlab import jupyter_chart_for_lab

        alt.renderers.enable("jupyter", offline=True)
        jupyter_chart_for_lab()
    else:
        alt.renderers.enable("default")
    alt.data_transformers.enable("default", max_rows=MAX_ROWS)


def figure(build):
    """Marks a chart builder of the book: its chart drops a quantitative axis label that would overlap its
    neighbour (the last label sits flush with the axis end, on top of the one before in a narrow column)."""
    @functools.wraps(build)
    def built(*args, **kwargs):
        return build(*args, **kwargs).configure_axisQuantitative(labelOverlap=True, labelSeparation=6)
    return built


# ------------------------------------------------------------------------------------ GPUs and CPUs

_CPU = re.compile(r"cpu(?:$|[-_@.])")


def is_cpu(slug: str) -> bool:
    """A CPU's device name: `cpu`, or a CPU run kept under a label of its own (`cpu-<host>`)."""
    return bool(_CPU.match(str(slug)))


def gpu_rows(df: pd.DataFrame, cpu: bool = False) -> pd.DataFrame:
    """The rows measured on a GPU; CPU rows too only when `cpu` is true. A CPU run checks the pipeline on a
    small model: beside a GPU's numbers it only crowds the legend and the dropdown."""
    if cpu or df.empty or "gpu_slug" not in df:
        return df
    return df[~df["gpu_slug"].map(is_cpu)]


def _no_gpu(df: pd.DataFrame, what: str, hint: str = "") -> alt.Chart:
    """The chart of a frame that is empty once the CPU rows are left out, or empty to begin with."""
    if len(df) and "gpu_slug" in df and df["gpu_slug"].map(is_cpu).all():
        return _empty(f"no {what} measured on a GPU yet: the data holds CPU runs only, which this chart leaves out")
    return _empty(f"no {what} in the data{hint}")


# ------------------------------------------------------------------------------------------- colours


def distinct_colors(n: int) -> list[str]:
    """`n` colours, no two alike: PALETTE, then hues a golden angle apart at two lightnesses."""
    out = list(PALETTE[:n])
    k = 0
    while len(out) < n:
        r, g, b = colorsys.hls_to_rgb((0.11 + k * 0.381966) % 1.0, 0.35 if k % 2 else 0.6, 0.55)
        colour = "#{:02x}{:02x}{:02x}".format(*(round(255 * v) for v in (r, g, b)))
        if colour not in out:
            out.append(colour)
        k += 1
    return out


# One colour per card where cards stand side by side in one chart (each card's marks beside the other's, never on
# top: `card_offset`). Dark and far apart, so that a card reads at a glance in a point or a thin bar.
CARD_PALETTE = ["#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518", "#9d755d", "#72b7b2", "#222222"]


def card_order(slugs) -> list[str]:
    """Device labels in the order every chart of cards uses: GPUs first, each group sorted."""
    return sorted(set(slugs), key=lambda s: (is_cpu(s), s))


def card_palette(n: int) -> list[str]:
    """`n` colours for cards: `CARD_PALETTE`, then `distinct_colors` for more."""
    return CARD_PALETTE[:n] if n <= len(CARD_PALETTE) else distinct_colors(n)


def card_color(slugs) -> alt.Scale:
    """One colour per device label, in `card_order`: the same card has the same colour wherever the same cards
    are drawn."""
    domain = card_order(slugs)
    return alt.Scale(domain=domain, range=card_palette(len(domain)))


def card_legend(title: str, names: dict[str, str] | None = None, **kw) -> alt.Legend:
    """A legend of cards that shows each device label by its short name (`tables.card_names`), the label itself
    where it has none; the field it encodes stays the label, which selections and tooltips use."""
    shown = {k: v for k, v in (names or {}).items() if k != v}
    expr = f"({json.dumps(shown)})[datum.label] || datum.label" if shown else alt.Undefined
    return alt.Legend(title=title, labelExpr=expr, **kw)


def card_offset(slugs, field: str = "gpu_slug") -> alt.YOffset:
    """Each card's mark in its own lane of a band: two cards' points at the same value never cover each other."""
    return alt.YOffset(f"{field}:N", sort=card_order(slugs), scale=alt.Scale(paddingInner=0.1))


def config_color(configs=()) -> alt.Scale:
    """One colour per configuration, in CONFIGS order, the same in every chart of the book."""
    domain = config_order(configs)
    return alt.Scale(domain=domain, range=distinct_colors(len(domain)))


def category_color() -> alt.Scale:
    return alt.Scale(domain=list(CATEGORIES), range=CATEGORY_COLORS)


def parts_color(domain: list[str]) -> alt.Scale:
    """Parts of a whole in `domain` order: PARTS for up to nine, "other" grey; more parts get PALETTE's."""
    named = [d for d in domain if d != OTHER]
    colours = PARTS[:len(named)] if len(named) <= len(PARTS) else distinct_colors(len(named))
    return alt.Scale(domain=named + ([OTHER] if OTHER in domain else []),
                     range=colours + ([OTHER_COLOR] if OTHER in domain else []))


def top_parts(df: pd.DataFrame, field: str, value: str, keys: list[str],
              keep: int = len(PARTS)) -> tuple[pd.DataFrame, list[str]]:
    """At most `keep` parts by their total over the frame, the rest summed as "other" per `keys`; with the
    parts in legend order (largest first, "other" last). Nine colours are told apart at a glance; twenty are not."""
    totals = df.groupby(field)[value].sum().sort_values(ascending=False)
    if len(totals) <= keep + 1:
        return df, list(totals.index)
    kept = list(totals.index[:keep])
    rest = df[~df[field].isin(kept)].groupby(keys, as_index=False)[value].sum().assign(**{field: OTHER})
    return pd.concat([df[df[field].isin(kept)], rest], ignore_index=True), kept + [OTHER]


# ------------------------------------------------------------------------------------ titles and units


def title(text: str, subtitle: str | list[str] | None = None) -> alt.TitleParams:
    """A short title, the detail as a subtitle, both flush left over the chart's whole width (a centred title
    longer than the plot runs past its left edge)."""
    return alt.TitleParams(text=text, subtitle=subtitle if subtitle else alt.Undefined, anchor="start",
                           frame="bounds", subtitleColor="#555", subtitleFontSize=11, offset=6)


def unit_of(label: str) -> str:
    """'one epoch (s)' -> 's': the unit a metric's label names in its last parentheses."""
    m = re.search(r"\(([^()]*)\)\s*$", label)
    return m.group(1) if m else ""


def with_unit(value: float, unit: str, digits: int = 4) -> str:
    """A tooltip's value with its unit; '-' where there is none."""
    if pd.isna(value):
        return "-"
    if unit.startswith("%"):
        return f"{value:.{min(digits, 3)}g}{unit}"
    return f"{value:.{digits}g} {unit}".strip()


def duration_text(us: float) -> str:
    """A duration in the unit a reader takes in: µs below a millisecond, ms below a second, else s."""
    if pd.isna(us):
        return "-"
    if abs(us) < 1e3:
        return f"{us:.3g} µs"
    if abs(us) < 1e6:
        return f"{us / 1e3:.3g} ms"
    return f"{us / 1e6:.3g} s"


def chosen_axis_title(metric: alt.Parameter, labels: dict[str, str], offset: int = 30) -> alt.Chart:
    """The x-axis title of a chart whose metric a radio button picks, as text where the axis title goes
    (a Vega-Lite axis title is fixed): the chosen metric's name and unit."""
    df = pd.DataFrame({"metric": list(labels), "axis_title": list(labels.values())})
    return alt.Chart(df).transform_filter(alt.datum.metric == metric).mark_text(
        fontWeight="bold", fontSize=11, baseline="top", align="center").encode(
        x=alt.value({"expr": "width / 2"}), y=alt.value({"expr": f"height + {offset}"}), text="axis_title:N")


def log_axis(lo: int, hi: int, title_text: str) -> tuple[alt.Scale, alt.Axis]:
    """A log scale from 10^lo to 10^hi with a tick per decade, labelled as plain numbers from 0.001 to
    10,000 and as 1e-5 beyond; every other decade only when there are more than seven (labels would collide)."""
    step = 1 if hi - lo <= 7 else 2
    exp = "round(log(datum.value) / LN10)"
    label = (f"({exp} - ({lo})) % {step} != 0 ? '' : (datum.value >= 0.001 && datum.value <= 10000 ? "
             f"format(datum.value, ',~g') : '1e' + {exp})")
    return (alt.Scale(type="log", domain=[10.0**lo, 10.0**hi]),
            alt.Axis(values=[10.0**k for k in range(lo, hi + 1)], labelExpr=label, title=title_text))


def decades(*values) -> tuple[int, int]:
    """The powers of ten that enclose every positive value given (arrays or numbers)."""
    v = np.concatenate([np.atleast_1d(np.asarray(x, dtype=float)) for x in values])
    v = v[np.isfinite(v) & (v > 0)]
    if not len(v):
        return 0, 1
    lo, hi = math.floor(math.log10(v.min())), math.ceil(math.log10(v.max()))
    return lo, max(hi, lo + 1)


# ------------------------------------------------------------------------------------------- helpers


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
    if len(steps) <= 25:
        return alt.Axis(values=[int(v) for v in steps], format="d")
    return alt.Axis(tickMinStep=1, format="d")


def table(df: pd.DataFrame, digits: int = 4):
    """A compact table for a page: no index, floats to `digits` significant digits, NaN as '-'."""
    fmt = {c: (lambda v, d=digits: "-" if pd.isna(v) else f"{v:.{d}g}") for c in df.columns
           if pd.api.types.is_float_dtype(df[c])}
    return df.style.hide(axis="index").format(fmt)


def _light(df: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """Floats to `digits` significant digits (small pages); NaN stays NaN."""
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = [float(f"{v:.{digits}g}") if pd.notna(v) and math.isfinite(v) else np.nan for v in out[c]]
    return out


def _default_gpu(slugs) -> str:
    """The first GPU that is not a CPU, else a CPU: a reader sees a GPU first when there is one."""
    slugs = sorted(set(slugs))
    return next((s for s in slugs if not is_cpu(s)), slugs[0] if slugs else "")


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
    """A chart that says why there is nothing to draw (the page still builds), in lines that fit a narrow page."""
    lines = textwrap.wrap(message, 70) or [""]
    return alt.Chart(pd.DataFrame({"text": ["\n".join(lines)]})).mark_text(
        fontSize=14, color="#666", align="left", baseline="top", lineBreak="\n").encode(
        text="text:N", x=alt.value(0), y=alt.value(8)).properties(width="container", height=20 + 18 * len(lines),
                                                                  view=alt.ViewBackground(stroke=None))
