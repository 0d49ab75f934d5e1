"""Nsight Compute counters: tensor-core use, instruction mix, memory hierarchy, stalls, rules, the roofline."""

from __future__ import annotations

import altair as alt
import pandas as pd

from medddpm.report.charts.theme import (_config_legend, _config_param, _configs_in, _empty, _fold, _gpu_param,
                                         _height, _light, _metric_param, _no_gpu, chosen_axis_title, config_color,
                                         decades, duration_text, figure, gpu_rows, log_axis, parts_color, title,
                                         top_parts)
NO_COUNTERS = "no Nsight Compute counters in the data"


@figure
def tensor_pipe(counters: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """Tensor-pipe utilization per configuration weighted over the step (`counters.ncu_by_run`), every GPU;
    legend picks the GPU."""
    if counters.empty or "tensor_pipe_pct" not in counters:
        return _empty(NO_COUNTERS)
    df = _light(gpu_rows(counters, cpu)[["gpu_slug", "config", "tensor_pipe_pct", "sm_throughput_pct"]])
    if df.empty:
        return _no_gpu(counters, "Nsight Compute counters")
    pick = alt.selection_point(fields=["gpu_slug"], bind="legend")
    return alt.Chart(df).mark_point(filled=True, size=110).encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("tensor_pipe_pct:Q", scale=alt.Scale(domain=[0, 100]),
                title="tensor-pipe utilization (% of peak, weighted by step time)"),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        shape=alt.Shape("gpu_slug:N", title="GPU (click)"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.15)),
        tooltip=[alt.Tooltip("gpu_slug:N", title="GPU"), alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("tensor_pipe_pct:Q", title="tensor pipe (% of peak)", format=".3~r"),
                 alt.Tooltip("sm_throughput_pct:Q", title="SM throughput (% of peak)", format=".3~r")],
    ).add_params(pick).properties(width="container", height=alt.Step(22), title=title("Tensor-core utilization"))


def _stacked_counters(counters: pd.DataFrame, *, prefix: str, field: str, value: str, what: str, x_title: str,
                      tip_title: str, fmt: str, chart_title: str, subtitle: str | None = None,
                      cpu: bool = False) -> alt.Chart:
    """Counter columns `<prefix><name>` stacked per configuration, the smallest grouped as "other" so that no
    two parts share a colour; GPU dropdown, legend highlight."""
    cols = [c for c in counters.columns if c.startswith(prefix) and c != f"{prefix}total"]
    if counters.empty or not cols:
        return _empty(NO_COUNTERS)
    df = gpu_rows(counters, cpu).melt(id_vars=["gpu_slug", "config"], value_vars=cols, var_name=field, value_name=value)
    df = df.dropna().assign(**{field: lambda d: d[field].str.removeprefix(prefix)})
    if df.empty:
        return _no_gpu(counters, what)
    df, parts = top_parts(df, field, value, ["gpu_slug", "config"])
    df = _light(df.assign(order=df[field].map({p: i for i, p in enumerate(parts)})))
    axis_fmt = fmt.replace(".3", "")  # ticks are round numbers: no fixed count of digits
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=[field], bind="legend")
    return alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X(f"{value}:Q", title=x_title,
                axis=alt.Axis(tickCount=8, labelExpr=f"datum.value == 0 ? '0' : format(datum.value, '{axis_fmt}')")),
        color=alt.Color(f"{field}:N", scale=parts_color(parts), legend=alt.Legend(values=parts),
                        title=f"{field} (click)"),
        order=alt.Order("order:Q"),
        opacity=alt.condition(pick, alt.value(1.0), alt.value(0.2)),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip(f"{field}:N"),
                 alt.Tooltip(f"{value}:Q", title=tip_title, format=fmt)],
    ).add_params(gpu, pick).properties(width="container", height=_height(df, len(parts)),
                                       title=title(chart_title, subtitle))


@figure
def instruction_mix(counters: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Executed thread instructions per step by class (points) and in all (black tick) per configuration, on a log
    axis: strict FP32 executes orders of magnitude more than a tensor-core configuration, which a linear axis would
    leave as a sliver. GPU dropdown, legend highlight; the tooltip gives each class's share and the total's ratio
    to strict FP32's on the same GPU."""
    cols = [c for c in counters.columns if c.startswith("inst_") and c != "inst_total"]
    if counters.empty or not cols:
        return _empty(NO_COUNTERS)
    rows = gpu_rows(counters, cpu)
    df = rows.melt(id_vars=["gpu_slug", "config"], value_vars=cols, var_name="class", value_name="instructions")
    df = df.dropna().assign(**{"class": lambda d: d["class"].str.removeprefix("inst_")})
    df = df[df["instructions"] > 0]
    if df.empty:
        return _no_gpu(counters, "instruction counts")
    df, parts = top_parts(df, "class", "instructions", ["gpu_slug", "config"])
    total = df.groupby(["gpu_slug", "config"], as_index=False)["instructions"].sum()
    base = total[total["config"] == "baseline"].set_index("gpu_slug")["instructions"]
    total["vs_baseline"] = total["gpu_slug"].map(base) / total["instructions"]
    df = df.merge(total.rename(columns={"instructions": "total"}), on=["gpu_slug", "config"])
    df = _light(df.assign(share=df["instructions"] / df["total"]))
    total = _light(total)
    lo, hi = decades(df["instructions"])
    scale = alt.Scale(type="log", domain=[10.0**lo, 10.0**hi])
    axis = alt.Axis(values=[10.0**k for k in range(lo, hi + 1)], labelExpr="format(datum.value, '~s')",
                    title="thread instructions executed per step (count, log scale; k, M, G, T: SI prefixes)")
    gpu, pick = _gpu_param(df), alt.selection_point(fields=["class"], bind="legend")
    y = alt.Y("config:N", sort=_configs_in(df), title=None)
    points = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_point(filled=True, size=70).encode(
        x=alt.X("instructions:Q", scale=scale, axis=axis), y=y,
        color=alt.Color("class:N", scale=parts_color(parts), legend=alt.Legend(values=parts), title="class (click)"),
        opacity=alt.condition(pick, alt.value(0.95), alt.value(0.15)),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip("class:N"),
                 alt.Tooltip("instructions:Q", title="instructions per step", format=".3~s"),
                 alt.Tooltip("share:Q", title="share of the configuration's (%)", format=".1%")])
    totals = alt.Chart(total).transform_filter(alt.datum.gpu_slug == gpu).mark_tick(
        color="#222", thickness=3, size=22).encode(
        x=alt.X("instructions:Q", scale=scale, axis=axis), y=y,
        tooltip=[alt.Tooltip("config:N", title="configuration"),
                 alt.Tooltip("instructions:Q", title="instructions per step", format=".3~s"),
                 alt.Tooltip("vs_baseline:Q", title="strict FP32 executes (x as many)", format=".3~r")])
    return alt.layer(points, totals).add_params(gpu, pick).properties(
        width="container", height=_height(df, len(parts)),
        title=title("Instruction mix", "per class (points) and in all (tick), kernels with counters; "
                                       "the smallest classes as other"))


MEMORY_METRICS = {"l1_hit_pct": "L1 hit rate (%)", "l2_hit_pct": "L2 hit rate (%)",
                  "dram_throughput_pct": "DRAM throughput (% of peak)",
                  "memory_throughput_pct": "memory throughput (% of peak)",
                  "sm_throughput_pct": "SM throughput (% of peak)",
                  "achieved_occupancy_pct": "achieved occupancy (% of the warps an SM can hold)"}


@figure
def memory(counters: pd.DataFrame, *, cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Memory hierarchy per configuration; radio picks the metric (the axis title follows), dropdown the GPU."""
    if counters.empty:
        return _empty(NO_COUNTERS)
    df = _light(_fold(gpu_rows(counters, cpu), MEMORY_METRICS, ["gpu_slug", "config"]))
    if df.empty:
        return _no_gpu(counters, "memory counters")
    shown = {k: v for k, v in MEMORY_METRICS.items() if k in set(df["metric"])}
    gpu, metric = _gpu_param(df), _metric_param(shown)
    bars = alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.metric == metric)).mark_bar().encode(
        y=alt.Y("config:N", sort=_configs_in(df), title=None),
        x=alt.X("value:Q", scale=alt.Scale(domain=[0, 100]), title=None, axis=alt.Axis(labelExpr="datum.label + '%'")),
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=None),
        tooltip=[alt.Tooltip("config:N", title="configuration"), alt.Tooltip("label:N", title="metric"),
                 alt.Tooltip("value:Q", title="value (%)", format=".3~r")])
    axis = {k: v + ", weighted by step time" for k, v in shown.items()}
    return alt.layer(bars, chosen_axis_title(metric, axis)).add_params(gpu, metric).properties(
        width="container", height=alt.Step(22), title=title("Memory hierarchy", "choose the counter below"))


@figure
def stalls(counters: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """Warp stall reasons (cycles per issued instruction), stacked; GPU dropdown, legend highlight."""
    return _stacked_counters(counters, prefix="stall_", field="reason", value="cycles", what="stall counters",
                             x_title="stall cycles per issued instruction (weighted by step time)",
                             tip_title="cycles per issued instruction", fmt=".3~r", chart_title="Why warps wait",
                             subtitle="the smallest reasons together as other", cpu=cpu)


@figure
def kernel_stalls(st: pd.DataFrame, min_cycles: float = 0.05) -> alt.Chart:
    """The workshop's stall breakdown (`workshop.stall_table`): a bar per kernel of a run, its stall cycles per issued
    instruction stacked by reason (those above `min_cycles`), the largest profiled kernels first; GPU dropdown."""
    long = st.melt(id_vars=["gpu_slug", "config", "kernel", "profiled_ms"],
                   value_vars=[c for c in st.columns if c.startswith("stall_")], var_name="reason", value_name="cycles")
    long = _light(long.dropna().assign(reason=lambda d: d["reason"].str.removeprefix("stall_"),
                                       row=lambda d: d["config"] + " · " + d["kernel"].str.slice(0, 44)))
    long = long[long["cycles"] > min_cycles]
    gpu = _gpu_param(long)
    return alt.Chart(long).transform_filter(alt.datum.gpu_slug == gpu).mark_bar().encode(
        y=alt.Y("row:N", title=None, sort=alt.EncodingSortField("profiled_ms", order="descending")),
        x=alt.X("cycles:Q", title="stall cycles per issued instruction"),
        color=alt.Color("reason:N", scale=alt.Scale(scheme="tableau20"),
                        legend=alt.Legend(orient="bottom", columns=5, title="reason")),
        tooltip=["config:N", "kernel:N", "reason:N", alt.Tooltip("cycles:Q", format=".3g")],
    ).add_params(gpu).properties(width="container", height=alt.Step(20), title="Why warps wait, per kernel")


@figure
def priorities(prio: pd.DataFrame, *, cpu: bool = False) -> alt.Chart:
    """Nsight Compute rules ranked by share of step x estimated speedup, the largest saving first (rank 1);
    GPU and configuration dropdowns."""
    df = gpu_rows(prio, cpu)
    if df.empty:
        return _no_gpu(prio, "Nsight Compute rules")
    df = df.sort_values(["gpu_slug", "config", "priority"], ascending=[True, True, False], kind="stable")
    df["rank"] = df.groupby(["gpu_slug", "config"]).cumcount() + 1
    df["label"] = df["rank"].astype(str).str.rjust(2) + ". " + df["rule"] + " @ " + df["kernel"].str.slice(0, 32)
    df = _light(df.assign(priority_pct=df["priority"] * 100)[
        ["gpu_slug", "config", "rank", "label", "kernel", "rule", "section", "share", "speedup_pct", "priority_pct"]])
    sections = sorted(df["section"].unique())
    gpu, cfg = _gpu_param(df), _config_param(df)
    return alt.Chart(df).transform_filter((alt.datum.gpu_slug == gpu) & (alt.datum.config == cfg)).mark_bar().encode(
        y=alt.Y("label:N", sort=alt.EncodingSortField("rank", order="ascending"), title=None,
                axis=alt.Axis(labelLimit=230)),
        x=alt.X("priority_pct:Q", title="estimated saving (% of the step)"),
        color=alt.Color("section:N", scale=parts_color(sections),
                        legend=alt.Legend(title="section", orient="bottom", direction="vertical", labelLimit=320)),
        tooltip=[alt.Tooltip("rank:Q", title="rank", format="d"), alt.Tooltip("kernel:N"), alt.Tooltip("rule:N"),
                 alt.Tooltip("section:N"), alt.Tooltip("share:Q", title="kernel's share of the step (%)", format=".1%"),
                 alt.Tooltip("speedup_pct:Q", title="rule's estimated speedup (%)", format=".3~r"),
                 alt.Tooltip("priority_pct:Q", title="estimated saving (% of the step)", format=".3~r")],
    ).add_params(gpu, cfg).properties(
        width="container", height=alt.Step(18),
        title=title("Where to optimize first", "largest estimated saving first: the kernel's share of the step "
                    "× the rule's estimated speedup"))


def _roofs(df: pd.DataFrame, roofs: pd.DataFrame, lo: int, hi: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The roofs of each GPU of `df` (`report.roofs_view`: measured, else its datasheet's), over 10^lo..10^hi
    FLOP per byte, and their labels: the memory roof above its diagonal, each compute roof over its right end
    (precisions of one rate share a roof and a label), each saying whether it was measured."""
    lines, labels = [], []
    for slug in sorted(df["gpu_slug"].unique()):
        mine = roofs[roofs["gpu_slug"] == slug].set_index("roof") if len(roofs) else roofs
        if "dram" not in mine.index or len(mine) < 2:
            continue
        bw, left = float(mine.loc["dram", "value"]), 10.0**lo
        lines.append({"gpu_slug": slug, "roof": "memory", "intensity": left, "tflops": left * bw / 1e12})
        at = 10.0 ** (lo + 2)  # above the diagonal, where no kernel can be, two decades in
        labels.append({"gpu_slug": slug, "roof": "memory", "intensity": at, "tflops": at * bw / 1e12,
                       "text": f"memory roof ({mine.loc['dram', 'source']})\nDRAM {bw / 1e12:.2g} TB/s",
                       "align": "left"})
        compute = mine.drop(index="dram")
        for (peak, source), same in compute.groupby(["value", "source"], sort=False):
            name = ", ".join(p.upper() for p in same.index)
            ridge = peak / bw
            for ai in (left, ridge, 10.0**hi):
                if left <= ai <= 10.0**hi:
                    lines.append({"gpu_slug": slug, "roof": name, "intensity": ai, "tflops": min(peak, ai * bw) / 1e12})
            # one line each: roofs a factor of two apart (TF32 and bf16) are a line's height apart on the plot
            labels.append({"gpu_slug": slug, "roof": name, "intensity": 10.0**hi, "tflops": peak / 1e12,
                           "text": f"compute roof {name} ({source}): {peak / 1e12:.3g} TFLOP/s", "align": "right"})
    return pd.DataFrame(lines), pd.DataFrame(labels)


@figure
def roofline(points: pd.DataFrame, roofs: pd.DataFrame | None = None, *,
             cpu: bool = False) -> alt.LayerChart | alt.Chart:
    """Achieved FLOP/s against arithmetic intensity (log-log), one dot per kernel of a run (its profiled
    launches together; CUDA-core and tensor-core FLOPs, `counters.roofline_points`), its shape where the math
    ran, with the GPU's roofs (`report.roofs_view`: measured, else its datasheet's, labelled so); GPU dropdown,
    legend picks configurations, size = the launches' duration."""
    pts = gpu_rows(points, cpu)
    if pts.empty:
        return _no_gpu(points, "Nsight Compute FLOP and byte counts")
    roofs = roofs if roofs is not None else pd.DataFrame(columns=["gpu_slug", "roof", "value", "source"])
    # only the columns drawn or in the tooltip: the page embeds every GPU's points
    df = _light(pts.assign(tflops=pts["flops_per_s"] / 1e12, duration_us=pts["duration_ns"] / 1e3,
                           duration_text=pts["duration_ns"].div(1e3).map(duration_text),
                           tensor_share=(pts["flops_tensor"] / pts["flops"]).fillna(0))[
        ["gpu_slug", "config", "kernel", "math", "launches", "intensity", "tflops", "tensor_share", "duration_us",
         "duration_text", "tensor_pipe_pct"]])
    shown = roofs[roofs["gpu_slug"].isin(df["gpu_slug"].unique())] if len(roofs) else roofs
    peaks = [v / 1e12 for v in shown.loc[shown["roof"] != "dram", "value"]] if len(shown) else []
    xlo, xhi = decades(df["intensity"])
    xhi += 1 if peaks else 0  # room right of the data for the compute roofs' labels
    ylo, yhi = decades(df["tflops"], peaks)
    x_scale, x_axis = log_axis(xlo, xhi, "arithmetic intensity (FLOP per DRAM byte)")
    y_scale, y_axis = log_axis(ylo, yhi + (1 if peaks else 0),
                               "achieved throughput (TFLOP/s, CUDA-core + tensor-core FLOPs)")
    x = alt.X("intensity:Q", scale=x_scale, axis=x_axis)
    y = alt.Y("tflops:Q", scale=y_scale, axis=y_axis)
    gpu = _gpu_param(df)
    pick = alt.selection_point(fields=["config"], bind="legend")
    maths = sorted(df["math"].unique(), key=lambda m: (m == "CUDA cores", m))
    dots = alt.Chart(df).transform_filter(alt.datum.gpu_slug == gpu).mark_point(filled=True).encode(
        x=x, y=y,
        color=alt.Color("config:N", scale=config_color(df["config"]), legend=_config_legend(df)),
        shape=alt.Shape("math:N", sort=maths, legend=alt.Legend(title="math ran on", orient="bottom")),
        size=alt.Size("duration_us:Q", legend=None),  # said in the title: a second legend would not react to clicks
        opacity=alt.condition(pick, alt.value(0.9), alt.value(0.1)),
        tooltip=[alt.Tooltip("kernel:N"), alt.Tooltip("config:N", title="configuration"), alt.Tooltip("math:N"),
                 alt.Tooltip("intensity:Q", title="intensity (FLOP/byte)", format=".3~r"),
                 alt.Tooltip("tflops:Q", title="achieved (TFLOP/s)", format=".3~r"),
                 alt.Tooltip("tensor_share:Q", title="tensor-core share of the FLOPs (%)", format=".0%"),
                 alt.Tooltip("duration_text:N", title="duration (profiled launches)"),
                 alt.Tooltip("launches:Q", title="profiled launches", format="d"),
                 alt.Tooltip("tensor_pipe_pct:Q", title="tensor pipe (% of peak)", format=".3~r")]).add_params(pick)
    lines, labels = _roofs(df, shown, xlo, xhi)
    layers = [dots]
    if len(lines):
        roof = alt.Chart(lines).transform_filter(alt.datum.gpu_slug == gpu).mark_line(color="#333", strokeDash=[4, 3])
        text = alt.Chart(_light(labels)).transform_filter(alt.datum.gpu_slug == gpu)
        style = {"align": "right", "baseline": "bottom", "fontSize": 11, "color": "#333", "lineBreak": "\n"}
        layers = [roof.encode(x=x, y=y, detail="roof:N", tooltip=[alt.Tooltip("roof:N")]),
                  text.transform_filter(alt.datum.align == "right").mark_text(
                      dx=-4, dy=-3, **style).encode(
                      x=x, y=y, text="text:N"),
                  text.transform_filter(alt.datum.align == "left").mark_text(
                      dx=-6, dy=-18, **style).encode(
                      x=x, y=y, text="text:N"),
                  dots]
    return alt.layer(*layers).add_params(gpu).properties(
        width="container", height=380,
        title=title("Roofline", "a dot per kernel: its profiled launches, duration-weighted, their total time its "
                    "area; dashed: roofs"))


__all__ = ["MEMORY_METRICS", "instruction_mix", "memory", "priorities", "roofline", "stalls",
           "tensor_pipe"]
