"""Step time and what it buys: micro-step time, speedup, cost, bench runs, the ablation, GPU busy time, scaling."""

from __future__ import annotations

import altair as alt
import pandas as pd

from medddpm.report.charts.theme import (MS, _config_legend, _configs_in, _empty, _fold, _gpu_param, _height, _light,
                                         _metric_param, _no_gpu, card_color, card_offset, card_order,
                                         chosen_axis_title, config_color, figure, gpu_rows, title, unit_of, with_unit)


FLOOR_LINE = 12  # px between two floor labels stacked over the step-time chart
FLOOR_LABEL = 0.12  # share of the axis a floor's label takes (about 80 px of a 700 px column)


def floor_labels(fl: pd.DataFrame, spans: dict[str, float]) -> pd.DataFrame:
    """The floors' labels of each GPU, whose axis ends at `spans[gpu]` (ms): floors closer than a hundredth of
    the axis share one label ("bf16 / fp16 floor", at the first), and a label that would run into the one before
    (closer than `FLOOR_LABEL` of the axis) goes a line higher (`line`: 0, 1, ...). Labels of nearby floors
    would otherwise print over each other."""
    rows = []
    for slug, g in fl.groupby("gpu_slug", sort=False):
        span = max(spans.get(slug, float(g["floor_ms"].max())), 1e-12)
        g = g.sort_values("floor_ms")
        groups: list[list] = []
        for r in g.itertuples():
            if groups and (r.floor_ms - groups[-1][0]) / span < 0.01:
                groups[-1][1].append(r.precision)
            else:
                groups.append([r.floor_ms, [r.precision]])
        line, last = 0, None
        for floor, names in groups:
            line = line + 1 if last is not None and (floor - last) / span < FLOOR_LABEL else 0
            rows.append({"gpu_slug": slug, "floor_ms": floor, "line": line,
                         "floor_label": f"{' / '.join(names)} floor{'s' if len(names) > 1 else ''}"})
            last = floor
    return pd.DataFrame(rows, columns=["gpu_slug", "floor_ms", "floor_label", "line"])


@figure
def step_time(summary: pd.DataFrame, floors: pd.DataFrame | None = None, *,
              cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Median micro-step time per configuration with its p10-p90 spread; GPU dropdown, legend
    highlight, tooltips; optional floors (flops_per_step / peak) as dashed rules. CPU rows only with `cpu`."""
    cols = ["gpu_slug", "device", "config", "precision_used", "train_median_ms", "train_p10_ms", "train_p90_ms",
            "speedup", "achieved_tflops"]
    df = _light(gpu_rows(summary[cols], cpu))
    if df.empty:
        return _no_gpu(summary, "finished run")
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    order = _configs_in(df)
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    y = alt.Y("config:N", sort=order, title=None)
    tip = [alt.Tooltip("device:N", title="device"), alt.Tooltip("config:N", title="configuration"),
           alt.Tooltip("precision_used:N", title="precision that ran"),
           alt.Tooltip("train_median_ms:Q", title="median (ms)", format=MS),
           alt.Tooltip("train_p10_ms:Q", title="p10 (ms)", format=MS),
           alt.Tooltip("train_p90_ms:Q", title="p90 (ms)", format=MS),
           alt.Tooltip("speedup:Q", title="speedup vs baseline (×)", format=".2f"),
           alt.Tooltip("achieved_tflops:Q", title="achieved (TFLOP/s)", format=".3~r")]
    bars = base.mark_bar().encode(
        y=y, x=alt.X("train_median_ms:Q", title="median micro-step time (ms)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.25)), tooltip=tip).add_params(pick)
    spread = base.mark_rule(color="black").encode(y=y, x="train_p10_ms:Q", x2="train_p90_ms:Q", tooltip=tip)
    layers, lines = [bars, spread], 1
    sub = "forward + backward + Adam; whisker: p10-p90"
    fl = gpu_rows(floors, cpu) if floors is not None else None
    if fl is not None and not fl.empty:
        fl = _light(fl[["gpu_slug", "precision", "floor_ms", "peak_tflops", "source"]])
        rule = alt.Chart(fl).transform_filter(alt.datum.gpu_slug == gpu).mark_rule(strokeDash=[4, 3], color="#333")
        layers.append(rule.encode(x="floor_ms:Q", tooltip=[
            alt.Tooltip("precision:N"), alt.Tooltip("floor_ms:Q", title="floor (ms)", format=".3~r"),
            alt.Tooltip("peak_tflops:Q", title="peak (TFLOP/s)", format=".4~r"), alt.Tooltip("source:N")]))
        spans = df.groupby("gpu_slug")["train_p90_ms"].max().to_dict()
        placed = floor_labels(fl, spans)
        lines = int(placed["line"].max()) + 1 if len(placed) else 1
        labels = alt.Chart(placed).transform_filter(alt.datum.gpu_slug == gpu)
        layers += [labels.transform_filter(alt.datum.line == k).mark_text(
            align="left", dx=3, dy=-4 - FLOOR_LINE * k, baseline="bottom", fontSize=10).encode(
            x="floor_ms:Q", y=alt.value(0), text=alt.Text("floor_label:N")) for k in range(lines)]
        sub += "; dashed: the time at the GPU's peak FLOP/s"
    heading = title("Training micro-step time", sub)
    heading.offset = 6 + FLOOR_LINE * (lines - 1)  # room for the floors' stacked labels over the plot
    return alt.layer(*layers).add_params(gpu).properties(
        width="container", height=_height(df, len(order)), title=heading)


@figure
def headline(head: pd.DataFrame, names: dict[str, str] | None = None) -> alt.LayerChart:
    """The first page's figure: per device (by its short name, `names`), each configuration of
    `step_time.headline` (the paper's four and the fastest measured) as its speedup over strict FP32, a bar with
    the runs' p10-p90 spread as a whisker and its value beside it; a dashed rule at 1x, so that a configuration
    slower than the baseline shows as a bar short of it. Every device of `head` is drawn: the page chooses whether
    CPU rows are among them."""
    names = names or {}
    df = head.assign(row=head["gpu_slug"].map(lambda s: names.get(s, s)) + " · " + head["config"],
                     value=head["speedup"].map(lambda v: f"{v:.3g}x"))
    bars = alt.Chart(df).encode(y=alt.Y("row:N", sort=list(df["row"]), title=None, axis=alt.Axis(labelLimit=320)))
    x = alt.X("speedup:Q", title="speedup over strict FP32 on the same device (x)",
              scale=alt.Scale(domain=[0, float(df["hi"].max()) * 1.15]))
    tooltip = [alt.Tooltip("gpu_slug:N", title="device"), alt.Tooltip("config:N", title="configuration"),
               alt.Tooltip("base_ms:Q", title="strict FP32 (ms)", format=".4g"),
               alt.Tooltip("train_median_ms:Q", title="this configuration (ms)", format=".4g"),
               alt.Tooltip("speedup:Q", title="speedup (x)", format=".3g"),
               alt.Tooltip("lo:Q", title="p10-p90 spread from (x)", format=".3g"),
               alt.Tooltip("hi:Q", title="p10-p90 spread to (x)", format=".3g")]
    one = alt.Chart(pd.DataFrame({"one": [1.0]})).mark_rule(strokeDash=[4, 3], color="#555").encode(
        x="one:Q", tooltip=[alt.Tooltip("one:Q", title="strict FP32 (x)", format=".0f")])
    return alt.layer(
        bars.mark_bar(height=20).encode(x=x, color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
                                        tooltip=tooltip),
        bars.mark_rule(color="black").encode(x="lo:Q", x2="hi:Q"),
        bars.mark_text(align="left", dx=6, fontSize=12, fontWeight="bold").encode(x="hi:Q", text="value:N"),
        one).properties(
        width="container", height={"step": 34},
        title=title("A training micro-step against strict FP32",
                    ["the paper's four and the fastest measured", "whisker: the runs' 10th-90th percentiles; "
                     "dashed: 1x"]))


@figure
def speedup(summary: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Speedup over the baseline of the same GPU, every GPU on one chart: a point per card and configuration,
    the cards side by side in each configuration's band and told apart by colour (equal speedups on two cards
    stay two points); click a GPU in the legend."""
    df = _light(gpu_rows(summary[summary["speedup"].notna()], cpu)[
        ["gpu_slug", "device", "config", "train_median_ms", "speedup"]])
    if df.empty:
        return _no_gpu(summary[summary["speedup"].notna()], "speedup over a baseline")
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    order = _configs_in(df)
    gpus = card_order(df["gpu_slug"])
    points = alt.Chart(df).mark_point(filled=True, size=90, opacity=1).encode(
        y=alt.Y("config:N", sort=order, title=None),
        yOffset=card_offset(gpus),
        x=alt.X("speedup:Q", scale=alt.Scale(type="log"), axis=alt.Axis(format="~g"),
                title="speedup over the baseline on the same GPU (×, log scale)"),
        color=alt.Color("gpu_slug:N", scale=card_color(gpus), sort=gpus,
                        legend=alt.Legend(title="GPU (click)", orient="bottom", direction="vertical", labelLimit=400)),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=[alt.Tooltip("device:N"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("speedup:Q", title="speedup (×)", format=".2f"),
                 alt.Tooltip("train_median_ms:Q", title="median micro-step (ms)", format=MS)]).add_params(pick)
    one = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(strokeDash=[4, 3], color="#666").encode(x="x:Q")
    return alt.layer(one, points).properties(
        width="container", height=alt.Step(11),  # a step per card in each configuration's band
        title=title("Speedup over strict FP32", "a colour per GPU, side by side; dashed: 1 = the baseline"))


COST_METRICS = {
    "epoch_s": "one epoch (s)",
    "gpu_hours_100k": "100k steps (device-hours)",
    "energy_100k_kwh": "100k steps (kWh)",
    "sample_s": "one full sample, 250 steps (s)",
    "sample_total_s": "first sample in a process, with compilation (s)",
    "peak_mem_gib": "peak memory (GiB)",
    "achieved_tflops": "achieved throughput (TFLOP/s)",
}


def _value_text(long: pd.DataFrame) -> pd.Series:
    """Each folded value with the unit its metric's label names."""
    return pd.Series([with_unit(v, unit_of(lab)) for v, lab in zip(long["value"], long["label"])], index=long.index,
                     dtype=object)


@figure
def cost(summary: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Cost per configuration; radio buttons choose the metric (the axis title follows), a dropdown the GPU."""
    df = _light(_fold(gpu_rows(summary, cpu), COST_METRICS, ["gpu_slug", "device", "config"]))
    if df.empty:
        return _no_gpu(summary, "cost figures")
    df["value_text"] = _value_text(df)
    shown = {k: v for k, v in COST_METRICS.items() if k in set(df["metric"])}
    gpu, metric = _gpu_param(df), _metric_param(shown)
    bars = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", title=None),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        tooltip=[alt.Tooltip("device:N"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("label:N", title="metric"), alt.Tooltip("value_text:N", title="value")])
    return alt.layer(bars, chosen_axis_title(metric, shown)).add_params(gpu, metric).properties(
        width="container", height=alt.Step(22),
        title=title("What one configuration costs", "choose the measure below; no bar: not measured on this GPU"))


@figure
def bench(bench_df: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """Bench timings kept beside the data (ours and the reference implementation, table ``bench``), a bar per
    configuration and bench run (`source`): a name's switches are those of its run's commit, so runs are not
    pooled. Training micro-steps only (`loading.bench_runs`' default); GPU dropdown."""
    if bench_df.empty:
        return _empty("no bench timings in the data")
    assert set(bench_df["phase"]) == {"train"}, "a denoising step is not a micro-step: pass training rows"
    if gpu_rows(bench_df, cpu).empty:
        return _no_gpu(bench_df, "bench timings")
    bench_df = gpu_rows(bench_df, cpu)
    g = (bench_df.groupby(["gpu_slug", "source", "git_commit", "config", "implementation"], as_index=False)
         .agg(train_median_ms=("train_median_ms", "median"), lo=("train_p10_ms", "min"), hi=("train_p90_ms", "max"),
              timed_steps=("timed_steps", "max"), peak_mem_bytes=("peak_mem_bytes", "max")))
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
                                                legend=alt.Legend(symbolType="square", symbolFillColor="#4c78a8",
                                                                  labelLimit=280, orient="bottom",
                                                                  direction="vertical"),
                                                title="implementation (click)"), alt.value(0.08)),
        tooltip=[alt.Tooltip("gpu_slug:N", title="GPU"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("implementation:N"),
                 alt.Tooltip("train_median_ms:Q", title="median (ms)", format=MS),
                 alt.Tooltip("lo:Q", title="p10 (ms)", format=MS), alt.Tooltip("hi:Q", title="p90 (ms)", format=MS),
                 alt.Tooltip("timed_steps:Q", title="timed steps", format="d"),
                 alt.Tooltip("peak_mem_gib:Q", title="peak allocated (GiB)", format=".3~r"),
                 alt.Tooltip("source:N", title="bench run"), alt.Tooltip("git_commit:N", title="commit")],
    ).add_params(gpu, pick).properties(
        width="container", height=alt.Step(14),
        title=title("Bench timings", "python -m medddpm bench: a bar per configuration, bench run and implementation"))


ABLATION_COLORS = {"buys": "#4c78a8", "not told apart": "#bab0ac", "costs": "#e45756"}


@figure
def ablation(summary: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """What each lever buys (`beyond.ablation_summary`): the step time each lever saves, largest first, with the
    variant's p10-p90 spread as a whisker, coloured by verdict; GPU dropdown. Failed variants are left out (the
    page lists them)."""
    df = _light(gpu_rows(summary, cpu)[lambda d: d["verdict"] != "failed"].assign(
        lo=lambda d: d["train_p10_ms"] - d["base_ms"], hi=lambda d: d["train_p90_ms"] - d["base_ms"])
        [["gpu_slug", "preset", "lever", "base_ms", "train_median_ms", "saved_ms", "lo", "hi", "ratio", "noise",
          "verdict"]])
    if df.empty:
        return _empty("No ablation measured yet (python -m medddpm ablation).")
    gpu = _gpu_param(df)
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    largest_first = alt.EncodingSortField("saved_ms", order="descending")
    y = alt.Y("lever:N", sort=largest_first, title="best without", axis=alt.Axis(labelLimit=260))
    tip = [alt.Tooltip("lever:N", title="best without"),
           alt.Tooltip("train_median_ms:Q", title="its micro-step (ms)", format=".1f"),
           alt.Tooltip("base_ms:Q", title="best's micro-step (ms)", format=".1f"),
           alt.Tooltip("saved_ms:Q", title="the lever saves (ms)", format=".1f"),
           alt.Tooltip("ratio:Q", title="slower without it (×)", format=".2f"),
           alt.Tooltip("noise:Q", title="noise to beat (% of the step)", format=".1%"), alt.Tooltip("verdict:N")]
    bars = base.mark_bar().encode(
        y=y, x=alt.X("saved_ms:Q", title="time a micro-step saves with the lever (ms)"),
        color=alt.Color("verdict:N", legend=alt.Legend(title="verdict"),
                        scale=alt.Scale(domain=list(ABLATION_COLORS), range=list(ABLATION_COLORS.values()))),
        tooltip=tip)
    # Layers that share a y scale drop a sort by field: each layer sorts its own scale, the whisker's unseen.
    spread = base.mark_rule(color="black").encode(y=alt.Y("lever:N", sort=largest_first, axis=None),
                                                  x="lo:Q", x2="hi:Q", tooltip=tip)
    return alt.layer(bars, spread).resolve_scale(y="independent").add_params(gpu).properties(
        width="container", height=_height(df, 4, by="lever"),
        title=title("What each lever of best buys", "best without the lever, minus best, largest first; "
                    "whisker: p10-p90 of the variant"))


@figure
def gpu_busy(busy: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """A step's time beside the time its kernels keep the device busy (`beyond.gpu_busy`); GPU dropdown.
    Where the two are equal the device never waits for the host."""
    metrics = {"train_median_ms": "step time (ms)", "kernel_ms": "kernel time in the step (ms)"}
    df = _light(_fold(gpu_rows(busy, cpu), metrics, ["gpu_slug", "device", "config", "busy", "dispatch_median_ms"]))
    if df.empty:
        return _no_gpu(busy, "run with a kernel table")
    df["value_text"] = _value_text(df)
    gpu = _gpu_param(df)
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        yOffset=alt.YOffset("label:N", sort=list(metrics.values())),
        x=alt.X("value:Q", title="median time per micro-step (ms)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        opacity=alt.Opacity("label:N", sort=list(metrics.values()), scale=alt.Scale(range=[1.0, 0.4]), title=None),
        tooltip=[alt.Tooltip("device:N"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("label:N", title="what"), alt.Tooltip("value_text:N", title="median"),
                 alt.Tooltip("busy:Q", title="busy share (%)", format=".1%"),
                 alt.Tooltip("dispatch_median_ms:Q", title="host issue time, back to back (ms)", format=MS)],
    ).add_params(gpu).properties(width="container", height=alt.Step(12),
                                 title=title("Step time and kernel time",
                                             "equal bars: the GPU never waits for the host"))


@figure
def scaling(summary: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Global throughput against world size, with the ideal (linear from one rank) dashed; GPU
    dropdown, legend picks configurations; tooltips give efficiency and the ranks' spread."""
    if summary.empty:
        return _empty("no data-parallel scaling runs in the data (python -m medddpm scale)")
    df = _light(gpu_rows(summary, cpu))
    if df.empty:
        return _no_gpu(summary, "data-parallel scaling run")
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    base = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu)
    x = alt.X("world_size:O", title="ranks (world size)", axis=alt.Axis(labelAngle=0))
    color = alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df))
    tip = [alt.Tooltip("config:N", title="configuration"), alt.Tooltip("backend:N"),
           alt.Tooltip("world_size:O", title="ranks"),
           alt.Tooltip("samples_per_s:Q", title="throughput (samples/s)", format=".3~r"),
           alt.Tooltip("efficiency:Q", title="scaling efficiency (%)", format=".0%"),
           alt.Tooltip("step_median_ms:Q", title="median step, slowest rank (ms)", format=MS),
           alt.Tooltip("rank_min_ms:Q", title="fastest rank's median (ms)", format=MS),
           alt.Tooltip("rank_max_ms:Q", title="slowest rank's median (ms)", format=MS)]
    opacity = alt.condition(pick, alt.value(1.0), alt.value(0.15))
    measured = base.mark_line(point=True).encode(
        x=x, y=alt.Y("samples_per_s:Q", title="training throughput (samples/s)"), color=color, opacity=opacity,
        tooltip=tip).add_params(pick)
    ideal = base.mark_line(strokeDash=[4, 3]).encode(x=x, y="ideal_samples_per_s:Q", color=color, opacity=opacity,
                                                     tooltip=tip)
    return alt.layer(ideal, measured).add_params(gpu).properties(
        width="container", height=max(260, 14 * df["config"].nunique() + 40),
        title=title("Data-parallel throughput", "solid: measured; dashed: linear from one rank"))


__all__ = ["ABLATION_COLORS", "COST_METRICS", "ablation", "bench", "cost", "floor_labels", "gpu_busy", "scaling",
           "speedup", "step_time"]
