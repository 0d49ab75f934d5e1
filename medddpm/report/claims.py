"""The published claims of Ryoo et al. (2026), each a small rule judged on every GPU in the data.

A rule reads the measurements of one GPU and returns a `Verdict` in one of five states: it *holds*; its
*direction holds but its magnitude differs* (the effect goes the paper's way, but its size lies outside the band
the paper's own figure sets: "up to 5x", "~1.5%"); it *does not hold*; it is *undecided* (measured, but the
spread cannot tell); or it is *not measurable* (and why, naming what is missing). A claim whose paper gives no
figure holds or does not. Every rule can come out every way it has; the thresholds and bands are the constants
below. The claims are about GPU kernels, so a CPU's rows never judge one: on a CPU every claim is "not
measurable", and the headline counts GPUs only.

Each claim is judged in one **scope** (`SCOPES`), and each figure of its evidence names the scope it is of:

- *matched layer*: the TF32 claims compare the same convolution layer and direction in baseline and opt1, kernel
  against kernel (`medddpm.analysis.layers`), and judge the matched layer that carries the most of baseline's step;
  a band "up to X" is held against the largest value over the matched layers;
- *step-weighted*: the channels-last claims, and the claims about the whole step, weight each kernel's counters by
  its share of the step (torch.profiler), not by the launches that happened to be profiled; kernel-time shares
  and step times are of this scope too;
- *model output*: the quality claims compare what the trained or stepped model computes.

A figure of another scope may stand beside the deciding one as context ("the whole step 3.9x faster"), named so;
it never decides. Claims the paper makes about one card (`Claim.paper_card`, e.g. the H100's stalls) are still
judged on every card, side by side (`side_by_side`).

    python -m medddpm claims [--data DIR] [--json]
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from medddpm.analysis import ncu_table
from medddpm.report import equivalence
# The page's matched-layer tables are evidence of one GPU: read here, the claims page has one module to call.
from medddpm.report.claim_evidence import GPU, MATCHED_FORMATS, check_matched, matched_tables  # noqa: F401
from medddpm.report.convergence import FAIL_DICE, MARGINS, Study, paired, verdicts as study_verdicts
from medddpm.report.loading import FAILS, HOLDS, MAGNITUDE, NA, UNDECIDED, Data, is_cpu
from medddpm.report.quality import QUALITY_LOSS, QUALITY_REL_ERR
from medddpm.report.safe import code, md

SPEEDUP_MIN = 1.10  # a change "cuts" a time, cycle or instruction count when the ratio reaches 1.10
CONV_DOMINANT = 0.50  # "dominated by convolution": more than half of the baseline's kernel time
SHIFT_MIN = 0.05  # a shift of kernel-time share counts from 5 percentage points
TENSOR_NEAR = 2.0  # "near baseline" tensor-pipe use: within 2 percentage points
SM_DROP = 0.90  # "SM throughput drops": channels-last's step-weighted SM throughput at most 90% of baseline's
PEAK_FAR = 0.50  # "does not reach peak": a step's achieved FLOP/s under half the card's roof in its precision
# The five sources of inefficiency the paper names, each with the figure and threshold that shows it:
SOURCE_RULES_MIN = 0.05  # memory access, warp scheduling: ncu rules estimate at least 5% of baseline's step
LAYOUT_MIN = 0.05  # layout conversion: conversion kernels take at least 5% of one paper configuration's step
L1_LOW = 50.0  # cache residency: baseline's step-weighted L1 hit rate under 50%
TENSOR_LOW = 50.0  # low tensor-core use: the TF32 step's step-weighted tensor pipe under 50% of peak
# The paper's magnitudes as bands: "up to X" spans X / MAGNITUDE_FACTOR to X x MAGNITUDE_FACTOR (the largest
# value of the claim's scope is held against it), "~X" spans X within ABOUT_REL of itself, "A-B" is [A, B].
MAGNITUDE_FACTOR = 1.5
ABOUT_REL = 0.20
MEMORY_SECTIONS = ("Memory Workload Analysis", "Memory Workload Analysis Tables", "Memory Workload Analysis Chart")
SCHEDULING_SECTIONS = ("Warp State Statistics", "Scheduler Statistics")
PAPER_CONFIGS = ("baseline", "opt1", "opt2", "opt12")
VERDICTS = (HOLDS, MAGNITUDE, FAILS, UNDECIDED, NA)

MATCHED, STEP, OUTPUT = "matched layer", "step-weighted", "model output"
SCOPES = {
    MATCHED: "the same convolution layer and direction in both configurations, kernel against kernel (the NVTX "
             "range of each layer); the matched layer that carries the most of baseline's step decides",
    STEP: "the whole step: each kernel weighted by its share of the step's kernel time (torch.profiler), its "
          "counters from the launches that stand for it; kernel-time shares and median step times",
    "duration-weighted": "the profiled launches, each weighted by its own duration (the roofline; no claim)",
    OUTPUT: "what the model computes: one forward pass and the losses from the same weights, or the samples of "
            "trained models",
}


@dataclass(frozen=True)
class Band:
    """The paper's magnitude: `said` as published, [`low`, `high`] what counts as it, `of` which of our figures
    is held against it."""

    said: str
    low: float
    high: float
    of: str
    unit: str = ""  # what our figure is written with: "x", "%"

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high


def up_to(value: float, said: str, of: str, unit: str = "", cap: float = math.inf) -> Band:
    return Band(said, value / MAGNITUDE_FACTOR, min(value * MAGNITUDE_FACTOR, cap), of, unit)


def about(value: float, said: str, of: str, unit: str = "") -> Band:
    return Band(said, value * (1 - ABOUT_REL), value * (1 + ABOUT_REL), of, unit)


BAND_CYCLES = up_to(5.0, "up to 5x", "the largest baseline/opt1 ratio over the matched layers", "x")
BAND_INSTRUCTIONS = up_to(100.0, "up to 100x", "the largest baseline/opt1 ratio over the matched layers", "x")
BAND_TENSOR = Band("1.45x-9.98x (A100)", 1.45, 9.98, "the top matched layer's opt1/baseline gain", "x")
BAND_CL_TENSOR = about(1.5, "~1.5%", "opt2's step-weighted tensor pipe", "% of peak")
BAND_CL_SM = about(0.5, "~50% drop", "opt2/baseline step-weighted SM throughput", "x")
BAND_CL_L2 = up_to(85.0, "up to 85%", "opt2's step-weighted L2 hit rate", "%", cap=100.0)


@dataclass(frozen=True)
class Verdict:
    verdict: str
    evidence: str
    figures: dict = field(default_factory=dict)


def _judge(ok: bool, evidence: str, band: Band | None = None, value: float | None = None, fmt: str = ".3g",
           **figures) -> Verdict:
    """Does not hold where the direction fails (`ok` false); else holds, or, where the paper gives a `band` and
    our `value` (its statistic) lies outside it, direction holds but magnitude differs."""
    if band is None or value is None or not math.isfinite(value):
        return Verdict(HOLDS if ok else FAILS, evidence, figures)
    inside = band.holds(value)
    evidence += (f"; magnitude: {band.of} {value:{fmt}}{band.unit} against the paper's {band.said} "
                 f"({'inside' if inside else 'outside'} {band.low:.3g}-{band.high:.3g}{band.unit})")
    figures |= {"magnitude": float(value), "band": [band.low, band.high]}
    return Verdict(FAILS if not ok else HOLDS if inside else MAGNITUDE, evidence, figures)


def _na(why: str) -> Verdict:
    return Verdict(NA, why)


# ------------------------------------------------------------------------------------------- rules

def conv_dominates(g: GPU) -> Verdict:
    s = g.category_share("baseline", ("convolution",))
    if s is None:
        return _na(g.missing("baseline"))
    return _judge(s > CONV_DOMINANT, f"convolution kernels take {s:.0%} of baseline's kernel time (step-weighted)",
                  conv_share=s)


def _rules_share(kernels: pd.DataFrame, counters: pd.DataFrame, sections: tuple[str, ...]) -> float:
    """Step time that ncu's rules of `sections` estimate recoverable: for each kernel its largest estimated
    global speedup among those rules, times its share of the step."""
    p = ncu_table.priorities(kernels, counters)
    p = p[p["section"].isin(sections) & p["priority"].notna()]
    return float(p.groupby("kernel")["priority"].max().sum()) if len(p) else 0.0


def inefficiency_sources(g: GPU) -> Verdict:
    k, c = g.kernels("baseline"), g.counters("baseline")
    if c.empty or "opt1" not in g.step_weighted:
        return _na(g.missing("baseline", "opt1"))
    layout = {cfg: s for cfg in PAPER_CONFIGS if (s := g.category_share(cfg, ("layout",))) is not None}
    worst = max(layout, key=layout.get)
    figures = {"memory_rules_share": _rules_share(k, c, MEMORY_SECTIONS),
               "layout_share": [worst, layout[worst]],
               "scheduling_rules_share": _rules_share(k, c, SCHEDULING_SECTIONS),
               "l1_hit_pct": g.rate("baseline", "l1_hit_pct"),
               "tensor_pipe_pct_tf32": g.rate("opt1", "tensor_pipe_pct")}
    if figures["l1_hit_pct"] is None or figures["tensor_pipe_pct_tf32"] is None:
        return _na("the counters lack hit rates or tensor-pipe use")
    sources = {
        "memory access": (figures["memory_rules_share"] >= SOURCE_RULES_MIN,
                          f"memory rules {figures['memory_rules_share']:.0%} of baseline's step"),
        "layout conversion": (layout[worst] >= LAYOUT_MIN, f"layout kernels {layout[worst]:.0%} of {worst}'s step"),
        "warp scheduling": (figures["scheduling_rules_share"] >= SOURCE_RULES_MIN,
                            f"warp-state and scheduler rules {figures['scheduling_rules_share']:.0%} of baseline's step"),
        "cache residency": (figures["l1_hit_pct"] < L1_LOW,
                            f"baseline's L1 hit rate {figures['l1_hit_pct']:.0f}% over its whole step"),
        "tensor-core use": (figures["tensor_pipe_pct_tf32"] < TENSOR_LOW,
                            f"opt1's tensor pipe {figures['tensor_pipe_pct_tf32']:.0f}% of peak over its whole step"),
    }
    absent = [name for name, (ok, _) in sources.items() if not ok]
    said = "; ".join(f"{name}: {text}" for name, (_, text) in sources.items()) + " (all step-weighted)"
    return _judge(not absent, said + (f" (not shown: {', '.join(absent)})" if absent else ""), **figures)


def _tf32(g: GPU) -> Verdict | None:
    """Not measurable unless opt1 really ran TF32 and a layer was profiled in both baseline and opt1."""
    if g.precision_used("opt1") != "tf32":
        return _na("opt1 did not run TF32 here" if g.precision_used("opt1") else g.missing("opt1"))
    if g.counters("baseline").empty or g.counters("opt1").empty:
        return _na(g.missing("baseline", "opt1"))
    if g.matched.empty:
        return _na("no convolution layer has counters in both baseline and opt1 (the counters need layer ranges: "
                   + code(f"python -m medddpm counters data/{g.slug}/baseline data/{g.slug}/opt1 --force") + ")")
    return None


def _top(g: GPU) -> pd.Series:
    return g.matched.iloc[0]


def _layer(m: pd.Series) -> str:
    return f"matched layer {code(m['layer'])} {m['direction']} ({m['step_ms_a']:.0f} ms of baseline's step)"


def _tf32_cut(g: GPU, column: str, what: str, band: Band, context: str = "") -> Verdict:
    """A TF32 count (`column`: a baseline/opt1 ratio of `matched_layers`) cut by at least SPEEDUP_MIN on the top
    matched layer; its magnitude, the largest ratio over the matched layers, against the paper's `band`."""
    if (na := _tf32(g)) is not None:
        return na
    m, r = _top(g), g.matched[column]
    return _judge(m[column] >= SPEEDUP_MIN, f"{_layer(m)}: baseline/opt1 {what} {m[column]:.1f}x; {r.min():.2f}x to "
                  f"{r.max():.1f}x over {len(r)} matched layers{context}", band, float(r.max()), ".1f",
                  **{column: float(m[column])}, layer=m["layer"], direction=m["direction"],
                  range=[float(r.min()), float(r.max())])


def tf32_cycles(g: GPU) -> Verdict:
    step = [g.train_median_ms(c) for c in ("baseline", "opt1")]
    steps = (f" (context, step time: the whole step {step[0][0] / step[1][0]:.2f}x faster)"
             if None not in step else "")
    return _tf32_cut(g, "sm_cycles_ratio", "SM cycles", BAND_CYCLES, steps)


def tf32_instructions(g: GPU) -> Verdict:
    per = g.per_step
    context = ""
    if {"baseline", "opt1"} <= set(per.index) and "inst_total" in per and per.loc["opt1", "inst_total"] > 0:
        ratio = per.loc["baseline", "inst_total"] / per.loc["opt1", "inst_total"]
        context = (f" (context, step-weighted: the thread instructions of a whole step, over the kernels with "
                   f"counters, {ratio:.1f}x fewer)")
    return _tf32_cut(g, "instructions_ratio", "executed instructions", BAND_INSTRUCTIONS, context)


def tf32_tensor(g: GPU) -> Verdict:
    if (na := _tf32(g)) is not None:
        return na
    m = _top(g)
    a, b = float(m["tensor_pipe_pct_a"]), float(m["tensor_pipe_pct_b"])
    gain = b / a if a > 0 else math.inf
    return _judge(gain >= SPEEDUP_MIN, f"{_layer(m)}: tensor pipe {a:.2f}% -> {b:.2f}% of peak ({gain:.1f}x)",
                  BAND_TENSOR, gain, ".1f", tensor_pipe_pct=[a, b], layer=m["layer"], direction=m["direction"])


def tf32_memory(g: GPU) -> Verdict:
    if (na := _tf32(g)) is not None:
        return na
    m = _top(g)
    l1 = [float(m["l1_hit_pct_a"]), float(m["l1_hit_pct_b"])]
    dram = [float(m["dram_throughput_pct_a"]), float(m["dram_throughput_pct_b"])]
    step = [g.rate(c, "l1_hit_pct") for c in ("baseline", "opt1")]
    context = (f" (context, step-weighted: the whole step's L1 hit rate {step[0]:.1f}% -> {step[1]:.1f}%)"
               if None not in step else "")
    return _judge(l1[1] < l1[0] and dram[1] > dram[0],
                  f"{_layer(m)}: L1 hit {l1[0]:.1f}% -> {l1[1]:.1f}%, DRAM throughput {dram[0]:.1f}% -> "
                  f"{dram[1]:.1f}% of peak{context}", l1_hit_pct=l1, dram_throughput_pct=dram, layer=m["layer"],
                  direction=m["direction"])


def tf32_stalls(g: GPU) -> Verdict:
    if (na := _tf32(g)) is not None:
        return na
    m = _top(g)
    long = [float(m["stall_long_scoreboard_a"]), float(m["stall_long_scoreboard_b"])]
    pipe = [float(m["stall_math_pipe_throttle_a"]), float(m["stall_math_pipe_throttle_b"])]
    if any(math.isnan(v) for v in long + pipe):
        return _na("the matched layer's counters lack a stall reason this claim reads")
    parts = {"math-pipe-throttle stalls fall": pipe[1] < pipe[0], "long-scoreboard stalls rise": long[1] > long[0]}
    wrong = [p for p, ok in parts.items() if not ok]
    return _judge(not wrong, f"{_layer(m)}: math-pipe-throttle stalls {pipe[0]:.2f} -> {pipe[1]:.2f}, long-scoreboard "
                  f"stalls {long[0]:.2f} -> {long[1]:.2f} cycles per issued instruction"
                  + (f" (not so: {', '.join(wrong)})" if wrong else ""),
                  stall_math_pipe_throttle=pipe, stall_long_scoreboard=long, layer=m["layer"],
                  direction=m["direction"])


def cl_shift(g: GPU) -> Verdict:
    for plain, cl in (("baseline", "opt2"), ("opt1", "opt12")):
        x, y = (g.category_share(c, ("elementwise", "layout")) for c in (plain, cl))
        if x is not None and y is not None:
            return _judge(y - x > SHIFT_MIN, f"element-wise + layout share of the step's kernel time {x:.0%} ({plain}) "
                          f"-> {y:.0%} ({cl})", elementwise_layout_share=[x, y], configs=[plain, cl])
    return _na(g.missing("baseline", "opt2"))


def _rates(g: GPU, column: str, *configs: str) -> list[float] | Verdict:
    values = [g.rate(c, column) for c in configs]
    return _na(g.missing(*configs)) if None in values else values


def cl_tensor(g: GPU) -> Verdict:
    if isinstance(t := _rates(g, "tensor_pipe_pct", "baseline", "opt2"), Verdict):
        return t
    return _judge(abs(t[1] - t[0]) <= TENSOR_NEAR, f"tensor pipe {t[0]:.2f}% (baseline) vs {t[1]:.2f}% (opt2) of "
                  "peak, step-weighted", BAND_CL_TENSOR, t[1], ".2f", tensor_pipe_pct=t)


def cl_sm(g: GPU) -> Verdict:
    if isinstance(s := _rates(g, "sm_throughput_pct", "baseline", "opt2"), Verdict):
        return s
    return _judge(s[1] / s[0] <= SM_DROP, f"SM throughput {s[0]:.1f}% -> {s[1]:.1f}% of peak ({s[1] / s[0]:.2f}x), "
                  "step-weighted", BAND_CL_SM, s[1] / s[0], ".2f", sm_throughput_pct=s)


def cl_cache(g: GPU) -> Verdict:
    l2, dram = _rates(g, "l2_hit_pct", "baseline", "opt2"), _rates(g, "dram_throughput_pct", "baseline", "opt2")
    if isinstance(l2, Verdict) or isinstance(dram, Verdict):
        return l2 if isinstance(l2, Verdict) else dram
    return _judge(l2[1] > l2[0] and dram[1] < dram[0], f"L2 hit {l2[0]:.1f}% -> {l2[1]:.1f}%, DRAM throughput "
                  f"{dram[0]:.1f}% -> {dram[1]:.1f}% of peak (baseline -> opt2, step-weighted)", BAND_CL_L2, l2[1],
                  ".1f", l2_hit_pct=l2, dram_throughput_pct=dram)


def opt12_partial(g: GPU) -> Verdict:
    times = [g.train_median_ms(c) for c in ("opt2", "opt12", "opt1")]
    if None in times:
        return _na(g.missing("opt1", "opt2", "opt12"))
    ms = [t[0] for t in times]
    if isinstance(t := _rates(g, "tensor_pipe_pct", "opt2", "opt12", "opt1"), Verdict):
        return t
    faster, piped = ms[0] > ms[1] > ms[2], t[0] < t[1] < t[2]
    return _judge(faster and piped, f"step time opt2 {ms[0]:.4g} > opt12 {ms[1]:.4g} > opt1 {ms[2]:.4g} ms"
                  f"{'' if faster else ' does not hold'}; tensor pipe opt2 {t[0]:.2f}% < opt12 {t[1]:.2f}% < opt1 "
                  f"{t[2]:.2f}% (step-weighted){'' if piped else ' does not hold'}", step_ms=ms, tensor_pipe_pct=t)


def opt12_peak(g: GPU) -> Verdict:
    """OPT12 far from the card's roof in its precision, its step held by element-wise and layout kernels more
    than by its convolutions."""
    share = g.category_share("opt12", ("elementwise", "layout"))
    conv = g.category_share("opt12", ("convolution",))
    got = g.achieved("opt12")
    if share is None or conv is None:
        return _na(g.missing("opt12"))
    if got is None:
        return _na("no roof of opt12's precision for this card (no measured roofs and no datasheet for its type)")
    flops, precision, peak, source = got
    parts = {"reaches under half its roof": flops / peak < PEAK_FAR,
             "element-wise + layout kernels outweigh the convolutions": share > conv}
    wrong = [p for p, ok in parts.items() if not ok]
    return _judge(not wrong, f"opt12 reaches {flops / 1e12:.3g} TFLOP/s, {flops / peak:.0%} of the card's "
                  f"{md(precision.upper())} roof ({peak / 1e12:.4g} TFLOP/s, {md(source.split(':')[0])}); element-wise + layout "
                  f"kernels take {share:.0%} of its step's kernel time, convolutions {conv:.0%} (step-weighted)"
                  + (f" (not so: {', '.join(wrong)})" if wrong else ""),
                  fraction_of_peak=flops / peak, elementwise_layout_share=share, conv_share=conv)


def fusion_needed(g: GPU) -> Verdict:
    a, b = g.train_median_ms("sdpa"), g.train_median_ms("compile")
    if a is None or b is None:
        return _na(g.missing("sdpa", "compile"))
    return _judge(a[0] / b[0] >= SPEEDUP_MIN, f"compile's step is {a[0] / b[0]:.2f}x faster than sdpa's ({a[0]:.4g} vs "
                  f"{b[0]:.4g} ms, {a[1]})", speedup=a[0] / b[0])


def tf32_quality(g: GPU) -> Verdict:
    if g.precision_used("opt1") != "tf32":
        return _na("opt1 did not run TF32 here" if g.precision_used("opt1") else g.missing("opt1"))
    q = g.data.quality
    q = q[(q["gpu_slug"] == g.slug) & (q["config"] == "opt1")] if not q.empty else q
    if q.empty:
        return _na("no quality table for opt1")
    rel = float(q["rel_err"].iloc[0])
    dloss = float((q["loss"] - q["baseline_loss"]).abs().mean() / q["baseline_loss"].abs().mean())
    return _judge(rel <= QUALITY_REL_ERR and dloss <= QUALITY_LOSS,
                  f"forward relative error {rel:.1e}, mean loss difference {dloss:.2%}", rel_err=rel, loss_diff=dloss)


def tf32_samples(g: GPU) -> Verdict:
    """The trained model, not one step: opt1 against strict FP32 in the convergence study, seed by seed (same
    weights, data order and noise), by the study's equivalence test (`convergence.verdicts`)."""
    if g.study is None or g.study.empty:
        return _na("no convergence study in the data (python -m medddpm study --configs baseline,opt1,...)")
    v = study_verdicts(g.study, (("opt1", "baseline"),))
    v = v[v["gpu_slug"] == g.slug]
    if v.empty:
        return _na("the convergence study here lacks opt1 or baseline runs of a shared seed")
    r = v.iloc[0]
    p = paired(g.study, (("opt1", "baseline"),))
    p = p[p["gpu_slug"] == g.slug].set_index("metric")
    parts = []
    for m, row in p.iterrows():
        interval = (f"{row['mean']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]" if pd.notna(row["low"])
                    else f"{row['mean']:+.3f} (no interval)")
        need = (f", about {int(row['seeds_needed'])} seeds would decide" if pd.notna(row["seeds_needed"]) else "")
        parts.append(f"{m} {interval} against ±{row['margin']:g}: {row['verdict']}{need}")
    evidence = (f"opt1 minus strict FP32 over {int(r['seeds'])} paired seeds ({equivalence.CONFIDENCE:.0%} "
                f"t-intervals): " + "; ".join(parts) +
                f"; failed runs {int(r['candidate_failed'])} against {int(r['reference_failed'])}")
    figures = {f"{m}_{k}": row[k] for m, row in p.iterrows() for k in ("mean", "low", "high")} | {
        "seeds": int(r["seeds"]), "failed": [int(r["candidate_failed"]), int(r["reference_failed"])],
        "verdicts": {m: row["verdict"] for m, row in p.iterrows()}}
    state = {equivalence.EQUIVALENT: HOLDS, equivalence.BETTER: HOLDS, equivalence.WORSE: FAILS,
             equivalence.UNDECIDED: UNDECIDED}[r["verdict"]]
    return Verdict(state, evidence, figures)


# ------------------------------------------------------------------------------------------- table

@dataclass(frozen=True)
class Claim:
    id: str
    short: str  # a chart label
    text: str  # as published
    rule: str  # how the verdict is computed
    judge: Callable[[GPU], Verdict]
    scope: str = STEP  # one of SCOPES: where every deciding figure comes from
    band: Band | None = None  # the paper's magnitude, where it gives one
    paper_card: str = ""  # the card the paper makes the claim about, where it names one


def _band_rule(band: Band) -> str:
    return (f" Magnitude: {band.of} within {band.low:.3g}-{band.high:.3g}{band.unit} (the paper: {band.said}), else "
            "direction holds, magnitude differs.")


CLAIMS = [
    Claim("conv-dominates", "Convolutions dominate", "Training is dominated by cuDNN convolution / implicit-GEMM kernels.",
          f"Convolution kernels take more than {CONV_DOMINANT:.0%} of baseline's kernel time (kernels.parquet).",
          conv_dominates),
    Claim("inefficiency-sources", "Five sources of inefficiency",
          "Inefficiencies come from memory access, layout conversion, warp scheduling, cache residency and low "
          "tensor-core use.",
          f"Each source shown: memory-access and warp-scheduling rules of ncu estimate at least "
          f"{SOURCE_RULES_MIN:.0%} of baseline's step recoverable; layout-conversion kernels take at least "
          f"{LAYOUT_MIN:.0%} of one paper configuration's step; baseline's L1 hit rate is under {L1_LOW:.0f}%; opt1's "
          f"tensor pipe is under {TENSOR_LOW:.0f}% of peak.", inefficiency_sources),
    Claim("tf32-cycles", "TF32 cuts SM cycles (up to 5x)", "TF32 cuts SM cycles (up to 5x).",
          f"SM active cycles of the same layer, baseline / opt1 >= {SPEEDUP_MIN}, on the matched layer carrying the "
          "most of baseline's step." + _band_rule(BAND_CYCLES), tf32_cycles, MATCHED, BAND_CYCLES),
    Claim("tf32-instructions", "TF32 cuts instructions (up to 100x)", "TF32 cuts dynamic instructions (up to 100x).",
          f"Executed instructions of the same layer, baseline / opt1 >= {SPEEDUP_MIN}, on the matched layer carrying "
          "the most of baseline's step." + _band_rule(BAND_INSTRUCTIONS), tf32_instructions, MATCHED,
          BAND_INSTRUCTIONS),
    Claim("tf32-tensor", "TF32 raises tensor-core use 1.45-9.98x", "TF32 raises tensor-core utilization 1.45x-9.98x (A100).",
          f"Tensor-pipe use of the same layer, opt1 / baseline >= {SPEEDUP_MIN}, on the matched layer carrying the "
          "most of baseline's step." + _band_rule(BAND_TENSOR), tf32_tensor, MATCHED, BAND_TENSOR, "A100"),
    Claim("tf32-memory", "TF32: L1 hit falls, DRAM use rises", "Under TF32 the L1 hit rate falls and DRAM bandwidth use rises.",
          "L1 hit rate lower and DRAM throughput higher in opt1 than in baseline, on the matched layer carrying the "
          "most of baseline's step.", tf32_memory, MATCHED),
    Claim("tf32-stalls", "TF32 on H100: pipe stalls fall, scoreboard rise",
          "With TF32 on the H100, math-pipe-throttle stalls fall but long-scoreboard stalls rise.",
          "Math-pipe-throttle stall cycles per issued instruction lower and long-scoreboard ones higher in opt1 than "
          "in baseline, on the matched layer carrying the most of baseline's step; judged on every card.",
          tf32_stalls, MATCHED, paper_card="H100"),
    Claim("cl-shift", "Channels-last: element-wise + layout kernels",
          "Channels-last shifts the workload to small element-wise and layout-conversion kernels.",
          f"Share of element-wise + layout kernel time, opt2 minus baseline (where opt2 is missing, opt12 minus opt1) "
          f"> {SHIFT_MIN:.0%} points (kernels.parquet).", cl_shift),
    Claim("cl-tensor", "Channels-last: tensor cores near baseline (~1.5%)",
          "Under channels-last tensor-core use stays near baseline (~1.5%).",
          f"Step-weighted tensor-pipe use of opt2 within {TENSOR_NEAR} points of baseline's."
          + _band_rule(BAND_CL_TENSOR), cl_tensor, STEP, BAND_CL_TENSOR),
    Claim("cl-sm", "Channels-last: SM throughput drops (~50%)", "Under channels-last SM throughput drops (~50%).",
          f"Step-weighted SM throughput, opt2 / baseline <= {SM_DROP}." + _band_rule(BAND_CL_SM), cl_sm, STEP,
          BAND_CL_SM),
    Claim("cl-cache", "Channels-last: L2 hit rises (to 85%), DRAM falls",
          "Under channels-last the L2 hit rate rises (up to 85%) and DRAM use collapses.",
          "Step-weighted L2 hit rate higher and DRAM throughput lower in opt2 than in baseline."
          + _band_rule(BAND_CL_L2), cl_cache, STEP, BAND_CL_L2),
    Claim("opt12-partial", "OPT12 only partly restores", "Combined (OPT12) only partly restores tensor-core use.",
          "Both orderings opt2 < opt12 < opt1: in step speed (median step time), and in step-weighted tensor-pipe use.",
          opt12_partial),
    Claim("opt12-peak", "OPT12 on H100: far from peak, element-wise bound",
          "OPT12 does not reach peak on the H100 and stays dominated by element-wise and layout kernels.",
          f"opt12's achieved FLOP/s (FLOPs per step / median step time) under {PEAK_FAR:.0%} of the card's roof in "
          "its precision (measured, else the datasheet's), and element-wise + layout kernels a larger share of its "
          "step's kernel time than convolutions; judged on every card.", opt12_peak, paper_card="H100"),
    Claim("fusion-needed", "Fusion is needed", "Further kernel fusion is needed.",
          f"Fusing the same model with torch.compile: sdpa / compile median step time >= {SPEEDUP_MIN}.", fusion_needed),
    Claim("tf32-quality", "TF32 keeps quality", "TF32 does not degrade synthesis quality.",
          f"opt1 against strict FP32 from the same weights: forward relative error <= {QUALITY_REL_ERR:g} and mean "
          f"relative loss difference <= {QUALITY_LOSS:.0%}, where TF32 really ran (quality.parquet).", tf32_quality,
          OUTPUT),
    Claim("tf32-samples", "TF32 trains as good a model", "TF32 does not degrade synthesis quality.",
          "Convergence study, paired seeds: opt1 minus strict FP32, seed by seed, judged by an equivalence test "
          f"({equivalence.CONFIDENCE:.0%} t-interval of the mean difference within ±{MARGINS['label_dice']:g} label_dice, "
          f"±{MARGINS['hist_w1']:g} hist_w1 and ±{MARGINS['ms_ssim']:g} MS-SSIM), and no more of opt1's runs fail "
          f"(diverged, or mean label_dice < {FAIL_DICE}). Holds when equivalent or better; does not hold when worse; "
          "undecided otherwise.",
          tf32_samples, OUTPUT),
]
COLUMNS = ["claim_id", "short", "claim", "gpu_slug", "verdict", "scope", "paper", "paper_card", "rule", "evidence",
           "figures"]
ON_CPU = "a claim about GPU kernels: not measurable on a CPU (the CPU run checks the pipeline, not the paper)"


def devices(data: Data) -> list[str]:
    """Every device in the data: swept ones, and GPUs known from bench timings only."""
    bench = set(data.bench["gpu_slug"]) if not data.bench.empty else set()
    return sorted(set(data.run["gpu_slug"]) | bench, key=lambda s: (is_cpu(s), s))  # GPUs first


def verdicts(data: Data, claims=CLAIMS, study: Study | None = None) -> pd.DataFrame:
    """Every claim against every device in the data (`COLUMNS`; `figures` a dict of the numbers judged); the
    convergence study (`convergence.load_study`), where given, judges the trained models' samples."""
    rows = []
    for slug in devices(data):
        g = GPU(data, slug, study)
        for c in claims:
            v = c.judge(g) if g.is_gpu else _na(ON_CPU)
            rows.append({"claim_id": c.id, "short": c.short, "claim": c.text, "gpu_slug": slug, "verdict": v.verdict,
                         "scope": c.scope, "paper": c.band.said if c.band else "", "paper_card": c.paper_card,
                         "rule": c.rule, "evidence": v.evidence, "figures": v.figures})
    return pd.DataFrame(rows, columns=COLUMNS)


def headline(table: pd.DataFrame) -> pd.DataFrame:
    """Verdict counts per GPU (CPU rows left out)."""
    t = table[~table["gpu_slug"].map(is_cpu).astype(bool)]
    return t.groupby("gpu_slug")["verdict"].value_counts().unstack(fill_value=0).reindex(columns=list(VERDICTS),
                                                                                          fill_value=0)


def side_by_side(table: pd.DataFrame) -> pd.DataFrame:
    """A row per claim, a verdict column per GPU (CPU rows left out), with the claim's scope, the paper's
    magnitude and the card the paper made it about."""
    t = table[~table["gpu_slug"].map(is_cpu).astype(bool)]
    if t.empty:
        return pd.DataFrame(columns=["claim_id", "short", "scope", "paper", "paper_card"])
    wide = t.pivot(index="claim_id", columns="gpu_slug", values="verdict")
    meta = t.drop_duplicates("claim_id").set_index("claim_id")[["short", "scope", "paper", "paper_card"]]
    order = list(dict.fromkeys(t["claim_id"]))
    gpus = list(dict.fromkeys(t["gpu_slug"]))
    return meta.join(wide[gpus]).loc[order].reset_index()


def _plain(v):
    if isinstance(v, float):
        return None if math.isnan(v) else v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v.item() if hasattr(v, "item") else v


def as_json(table: pd.DataFrame) -> str:
    """The verdicts as a JSON list, a claim each, every device's verdict side by side: {claim, text, scope, paper,
    paper_card, rule, verdicts: {device: {verdict, evidence, figures}}}."""
    out = []
    for claim_id, rows in table.groupby("claim_id", sort=False):
        r = rows.iloc[0]
        out.append({"claim": claim_id, "text": r["claim"], "scope": r["scope"], "paper": r["paper"] or None,
                    "paper_card": r["paper_card"] or None, "rule": r["rule"],
                    "verdicts": {d.gpu_slug: {"verdict": d.verdict, "evidence": d.evidence,
                                              "figures": {k: _plain(v) for k, v in d.figures.items()}}
                                 for d in rows.itertuples()}})
    return json.dumps(out, indent=1)


# ------------------------------------------------------------------------------------------ the page

def check_verdicts(table: pd.DataFrame, cpus: set[str]) -> None:
    """Every claim judged once on every device, with a known verdict, none on a CPU."""
    assert set(table["verdict"]) <= set(VERDICTS), set(table["verdict"])
    assert len(table) == len(CLAIMS) * table["gpu_slug"].nunique(), len(table)
    assert (table.loc[table["gpu_slug"].isin(cpus) | table["gpu_slug"].map(is_cpu), "verdict"] == NA).all()


def tally_text(t: pd.Series) -> str:
    """One device's verdict counts (a row of `headline`) in words."""
    return (f"{t[HOLDS]} hold, {t[MAGNITUDE]} hold in direction but not in magnitude, {t[FAILS]} do not hold"
            + (f", {t[UNDECIDED]} undecided" if t[UNDECIDED] else "") + f", {t[NA]} not measurable")


def headline_text(table: pd.DataFrame, on_cpu: bool) -> str:
    """The tally of every GPU, and that a CPU run judges none."""
    lines = [f"- **{md(slug)}**: **{r[HOLDS]} hold**, **{r[MAGNITUDE]} hold in direction but not in magnitude**, "
             f"**{r[FAILS]} do not hold**" + (f", {r[UNDECIDED]} undecided" if r[UNDECIDED] else "")
             + f", {r[NA]} not measurable" for slug, r in headline(table).iterrows()]
    cpu = "\n\nThe CPU run (a small model, to check the pipeline) judges none of them." if on_cpu else ""
    return (f"{len(CLAIMS)} claims on each GPU:\n\n" + ("\n".join(lines) or "- no GPU measured yet") + cpu
            + "\n\nHover over a cell for the numbers; click a verdict in the legend to pick those cells out.")


def claims_text(gpu_table: pd.DataFrame) -> str:
    """Claim by claim: its text, scope, the paper's magnitude and card, its rule, every GPU's verdict and evidence."""
    parts = []
    for c in CLAIMS:
        rows = gpu_table[gpu_table["claim_id"] == c.id]
        about = f"*Scope:* {c.scope}" + (f"; *the paper's magnitude:* {c.band.said}" if c.band else "") + (
            f"; *the paper's card:* {c.paper_card}" if c.paper_card else "")
        parts.append(f"**{c.text}**\n\n{about}\n\n*Rule:* {c.rule}\n\n"
                     + ("\n".join(f"- {md(r.gpu_slug)}: **{r.verdict}**: {r.evidence}" for r in rows.itertuples())
                        or "- no GPU measured yet"))
    return "\n\n".join(parts)


THRESHOLDS = {
    "SPEEDUP_MIN": "a ratio of times, cycles or instructions that counts as a cut",
    "CONV_DOMINANT": "convolution share of baseline's kernel time that counts as dominant",
    "SHIFT_MIN": "smallest shift of kernel-time share that counts",
    "TENSOR_NEAR": "tensor-pipe points within which use is 'near' the baseline",
    "SM_DROP": "channels-last SM throughput at most this fraction of baseline's",
    "SOURCE_RULES_MIN": "step share ncu's memory or scheduling rules must estimate recoverable",
    "LAYOUT_MIN": "layout-conversion share of a paper configuration's step that counts",
    "L1_LOW": "baseline L1 hit rate (%) under which cache residency is poor",
    "TENSOR_LOW": "opt1 tensor-pipe use (% of peak) under which it is low",
    "PEAK_FAR": "share of the card's roof under which a step 'does not reach peak'",
    "MAGNITUDE_FACTOR": "'up to X' spans X / this to X × this",
    "ABOUT_REL": "'~X' spans X within this relative difference",
    "QUALITY_REL_ERR": "forward relative error tolerated against strict FP32",
    "QUALITY_LOSS": "mean relative loss difference tolerated",
}


def thresholds() -> pd.DataFrame:
    """The constants the rules use, with their values as they are now and what each means."""
    return pd.DataFrame([{"constant": k, "value": globals()[k], "meaning": v} for k, v in THRESHOLDS.items()])


def scopes() -> pd.DataFrame:
    return pd.DataFrame([{"scope": k, "what it weighs": v} for k, v in SCOPES.items()])
