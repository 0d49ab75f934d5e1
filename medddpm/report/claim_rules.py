"""The rules that judge the paper's claims, one small function per claim, each reading one GPU's measurements
(`medddpm.report.claim_evidence.GPU`) and returning a `Verdict`: *holds*, *direction holds but magnitude differs*,
*does not hold*, *undecided*, or *not measurable* (naming what is missing and what would settle it). The table of
claims, and what the pages and the command print of them, are in `medddpm.report.claims`.

A claim of several parts (the step-time ordering and the tensor-pipe ordering of OPT12; the five sources of
inefficiency) judges each part its data can judge: a part whose data are missing is *not judged yet* and names
what would settle it, and the claim's verdict is that of its judged parts, marked "in part" (`Verdict.judged`).
A part never counts as holding because it was not measured: a claim judged in part holds only where every part
judged holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from medddpm.analysis import ncu_table
from medddpm.report import equivalence
from medddpm.report.claim_evidence import GPU
from medddpm.report.convergence import FAIL_DICE, MARGINS, paired, verdicts as study_verdicts  # noqa: F401
from medddpm.report.loading import FAILS, HOLDS, IN_FULL, IN_PART, MAGNITUDE, NA, UNDECIDED
from medddpm.report.quality import QUALITY_LOSS, QUALITY_REL_ERR  # noqa: F401 - the claims' thresholds

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


# What a verdict that is not measurable, or a part not judged yet, waits for: (kind, configuration) pairs.
NEEDS = {"counters": "Nsight Compute counters", "layers": "counters with layer ranges", "run": "a run",
         "kernels": "a kernel table (torch.profiler)", "quality": "a quality table", "study": "the convergence study"}


@dataclass(frozen=True)
class Verdict:
    verdict: str
    evidence: str
    figures: dict = field(default_factory=dict)
    unjudged: tuple[str, ...] = ()  # the parts its data cannot judge yet, each "part: why"
    needs: frozenset = frozenset()  # what would judge it (not measurable) or its unjudged parts: (kind, config)

    @property
    def judged(self) -> str:
        """IN_FULL, IN_PART (some parts not judged yet), or "" (not measurable)."""
        return "" if self.verdict == NA else IN_PART if self.unjudged else IN_FULL


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


def _na(why: str, needs=()) -> Verdict:
    return Verdict(NA, why, needs=frozenset(needs))


def _missing(g: GPU, *configs: str) -> Verdict:
    """Not measurable: which of `configs` lack a run or counters on this GPU, with the commands that give them."""
    return _na(g.missing(*configs), g.lacking(*configs))


def combine(parts: dict[str, Verdict], note: str = "") -> Verdict:
    """One verdict of a claim's parts, each judged where its data are: not measurable where no part is; else does
    not hold where a judged part does not, undecided where one cannot tell, direction-only where one's magnitude
    differs, holds where every judged part holds. `note` follows the judged parts' evidence; the parts not judged
    yet close it, with why, and what would judge them is kept in `needs`."""
    judged = {n: v for n, v in parts.items() if v.verdict != NA}
    waiting = {n: v for n, v in parts.items() if v.verdict == NA}
    needs = frozenset().union(*(v.needs for v in waiting.values()))
    if not judged:
        return _na("; ".join(dict.fromkeys(v.evidence for v in parts.values())), needs)
    states = {v.verdict for v in judged.values()}
    state = next(s for s in (FAILS, UNDECIDED, MAGNITUDE, HOLDS) if s in states)
    unjudged = tuple(f"{n}: {v.evidence}" for n, v in waiting.items())
    why: dict[str, list[str]] = {}  # parts waiting for the same data are named together
    for n, v in waiting.items():
        why.setdefault(v.evidence, []).append(n)
    evidence = "; ".join(v.evidence for v in judged.values()) + note
    if why:
        evidence += " (not judged yet: " + "; ".join(f"{', '.join(n)}: {w}" for w, n in why.items()) + ")"
    figures = {k: x for v in judged.values() for k, x in v.figures.items()}
    return Verdict(state, evidence, figures, unjudged, needs)


# ------------------------------------------------------------------------------------------- rules

def conv_dominates(g: GPU) -> Verdict:
    s = g.category_share("baseline", ("convolution",))
    if s is None:
        return _missing(g, "baseline")
    return _judge(s > CONV_DOMINANT, f"convolution kernels take {s:.0%} of baseline's kernel time (step-weighted)",
                  conv_share=s)


def _rules_share(kernels: pd.DataFrame, counters: pd.DataFrame, sections: tuple[str, ...]) -> float:
    """Step time that ncu's rules of `sections` estimate recoverable: for each kernel its largest estimated
    global speedup among those rules, times its share of the step."""
    p = ncu_table.priorities(kernels, counters)
    p = p[p["section"].isin(sections) & p["priority"].notna()]
    return float(p.groupby("kernel")["priority"].max().sum()) if len(p) else 0.0


def _source(shown: bool, evidence: str, **figures) -> Verdict:
    return Verdict(HOLDS if shown else FAILS, evidence, figures)


def inefficiency_sources(g: GPU) -> Verdict:
    """The five sources, each a part: shown (holds), not shown (does not hold), or not judged yet where its data
    are missing (the layout source reads kernel tables; the other four read Nsight Compute counters)."""
    k, c = g.kernels("baseline"), g.counters("baseline")
    parts = {}
    if c.empty:
        parts["memory access"] = parts["warp scheduling"] = _missing(g, "baseline")
    else:
        memory, scheduling = _rules_share(k, c, MEMORY_SECTIONS), _rules_share(k, c, SCHEDULING_SECTIONS)
        parts["memory access"] = _source(memory >= SOURCE_RULES_MIN, f"memory access: memory rules {memory:.0%} "
                                         "of baseline's step", memory_rules_share=memory)
        parts["warp scheduling"] = _source(scheduling >= SOURCE_RULES_MIN, f"warp scheduling: warp-state and "
                                           f"scheduler rules {scheduling:.0%} of baseline's step",
                                           scheduling_rules_share=scheduling)
    layout = {cfg: s for cfg in PAPER_CONFIGS if (s := g.category_share(cfg, ("layout",))) is not None}
    if layout:
        worst = max(layout, key=layout.get)
        parts["layout conversion"] = _source(layout[worst] >= LAYOUT_MIN, f"layout conversion: layout kernels "
                                             f"{layout[worst]:.0%} of {worst}'s step", layout_share=[worst, layout[worst]])
    else:
        parts["layout conversion"] = _na("no kernel table of the paper's configurations (the sweep's torch phase)",
                                         {("kernels", cfg) for cfg in PAPER_CONFIGS})
    l1, pipe = g.rate("baseline", "l1_hit_pct"), g.rate("opt1", "tensor_pipe_pct")
    parts["cache residency"] = (_source(l1 < L1_LOW, f"cache residency: baseline's L1 hit rate {l1:.0f}% over its "
                                        "whole step", l1_hit_pct=l1) if l1 is not None else
                                _missing(g, "baseline") if c.empty else _na("the counters lack hit rates"))
    parts["tensor-core use"] = (_source(pipe < TENSOR_LOW, f"tensor-core use: opt1's tensor pipe {pipe:.0f}% of peak "
                                        "over its whole step", tensor_pipe_pct_tf32=pipe) if pipe is not None else
                                _missing(g, "opt1") if g.counters("opt1").empty else
                                _na("the counters lack tensor-pipe use"))
    order = ("memory access", "layout conversion", "warp scheduling", "cache residency", "tensor-core use")
    parts = {n: parts[n] for n in order}
    absent = [n for n, v in parts.items() if v.verdict == FAILS]
    scope = " (all step-weighted)" if len([v for v in parts.values() if v.verdict != NA]) > 1 else " (step-weighted)"
    return combine(parts, scope + (f" (not shown: {', '.join(absent)})" if absent else ""))


def _tf32(g: GPU) -> Verdict | None:
    """Not measurable unless opt1 really ran TF32 and a layer was profiled in both baseline and opt1."""
    if g.precision_used("opt1") != "tf32":
        return _na("opt1 did not run TF32 here") if g.precision_used("opt1") else _missing(g, "opt1")
    if g.counters("baseline").empty or g.counters("opt1").empty:
        return _missing(g, "baseline", "opt1")
    if g.matched.empty:
        return _na("no convolution layer has counters in both baseline and opt1 (the counters need layer ranges: "
                   f"`python -m medddpm counters data/{g.slug}/baseline data/{g.slug}/opt1 --force`)",
                   {("layers", "baseline"), ("layers", "opt1")})
    return None


def _top(g: GPU) -> pd.Series:
    return g.matched.iloc[0]


def _layer(m: pd.Series) -> str:
    return f"matched layer `{m['layer']}` {m['direction']} ({m['step_ms_a']:.0f} ms of baseline's step)"


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
    return _missing(g, "baseline", "opt2")


def _rates(g: GPU, column: str, *configs: str) -> list[float] | Verdict:
    values = [g.rate(c, column) for c in configs]
    return _missing(g, *configs) if None in values else values


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
    """Two orderings, opt2 < opt12 < opt1, each a part judged where its data are: in step speed (the runs' median
    step times) and in tensor-pipe use (step-weighted counters)."""
    times = [g.train_median_ms(c) for c in ("opt2", "opt12", "opt1")]
    if None in times:
        speed = _missing(g, "opt1", "opt2", "opt12")
    else:
        ms = [t[0] for t in times]
        faster = ms[0] > ms[1] > ms[2]
        speed = _judge(faster, f"step time opt2 {ms[0]:.4g} > opt12 {ms[1]:.4g} > opt1 {ms[2]:.4g} ms"
                       f"{'' if faster else ' does not hold'}", step_ms=ms)
    if isinstance(t := _rates(g, "tensor_pipe_pct", "opt2", "opt12", "opt1"), Verdict):
        pipe = t
    else:
        piped = t[0] < t[1] < t[2]
        pipe = _judge(piped, f"tensor pipe opt2 {t[0]:.2f}% < opt12 {t[1]:.2f}% < opt1 {t[2]:.2f}% (step-weighted)"
                      f"{'' if piped else ' does not hold'}", tensor_pipe_pct=t)
    return combine({"step time": speed, "tensor-pipe use": pipe})


def opt12_peak(g: GPU) -> Verdict:
    """OPT12 far from the card's roof in its precision, its step held by element-wise and layout kernels more
    than by its convolutions."""
    share = g.category_share("opt12", ("elementwise", "layout"))
    conv = g.category_share("opt12", ("convolution",))
    e = g.efficiency("opt12")
    if share is None or conv is None:
        return _missing(g, "opt12")
    if e is None:
        return _na("no roof of opt12's precision for this card (no measured roofs and no datasheet for its type)")
    parts = {"reaches under half its roof": e["efficiency"] < PEAK_FAR,
             "element-wise + layout kernels outweigh the convolutions": share > conv}
    wrong = [p for p, ok in parts.items() if not ok]
    return _judge(not wrong, f"opt12 reaches {e['achieved_tflops']:.3g} TFLOP/s, {e['efficiency']:.0%} of the card's "
                  f"{e['roof'].upper()} roof ({e['peak_tflops']:.4g} TFLOP/s, {e['peak_source'].split(':')[0]}); "
                  f"element-wise + layout kernels take {share:.0%} of its step's kernel time, convolutions {conv:.0%} "
                  "(step-weighted)" + (f" (not so: {', '.join(wrong)})" if wrong else ""),
                  fraction_of_peak=float(e["efficiency"]), elementwise_layout_share=share, conv_share=conv)


def fusion_needed(g: GPU) -> Verdict:
    a, b = g.train_median_ms("sdpa"), g.train_median_ms("compile")
    if a is None or b is None:
        return _missing(g, "sdpa", "compile")
    return _judge(a[0] / b[0] >= SPEEDUP_MIN, f"compile's step is {a[0] / b[0]:.2f}x faster than sdpa's ({a[0]:.4g} vs "
                  f"{b[0]:.4g} ms, {a[1]})", speedup=a[0] / b[0])


def tf32_quality(g: GPU) -> Verdict:
    if g.precision_used("opt1") != "tf32":
        return _na("opt1 did not run TF32 here") if g.precision_used("opt1") else _missing(g, "opt1")
    q = g.data.quality
    q = q[(q["gpu_slug"] == g.slug) & (q["config"] == "opt1")] if not q.empty else q
    if q.empty:
        return _na("no quality table for opt1", {("quality", "opt1")})
    rel = float(q["rel_err"].iloc[0])
    dloss = float((q["loss"] - q["baseline_loss"]).abs().mean() / q["baseline_loss"].abs().mean())
    return _judge(rel <= QUALITY_REL_ERR and dloss <= QUALITY_LOSS,
                  f"forward relative error {rel:.1e}, mean loss difference {dloss:.2%}", rel_err=rel, loss_diff=dloss)


def tf32_samples(g: GPU) -> Verdict:
    """The trained model, not one step: opt1 against strict FP32 in the convergence study, seed by seed (same
    weights, data order and noise), by the study's equivalence test (`convergence.verdicts`)."""
    if g.study is None or g.study.empty:
        return _na("no convergence study in the data (`python -m medddpm study --configs baseline,opt1`)",
                   {("study", "")})
    v = study_verdicts(g.study, (("opt1", "baseline"),))
    v = v[v["gpu_slug"] == g.slug]
    if v.empty:
        return _na("the convergence study here lacks opt1 or baseline runs of a shared seed", {("study", "")})
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


