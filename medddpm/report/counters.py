"""The counters page: Nsight Compute's hardware counters, weighted by each kernel's share of the step, and the
roofline, with tensor-core FLOPs counted from the tensor pipe's active cycles."""

from __future__ import annotations

import json
import math
import re

import pandas as pd

from medddpm.analysis import layers, ncu_table
from medddpm.analysis import roofs as ar
from medddpm.report.loading import Data, _sort, gpu_types
from medddpm.report.roofs import card_roofs
from medddpm.report.safe import code, md

_WEIGHTED = ("tensor_pipe_pct", "sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct", "l1_hit_pct",
             "l2_hit_pct", "achieved_occupancy_pct")


def ncu_kernels(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """`medddpm.analysis.ncu_table.kernel_summary` for every run, with gpu_slug and config."""

    if ncu_df.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "kernel_id", "kernel", "duration_ns", *_WEIGHTED])
    parts = []
    for (run_id, slug, config), g in ncu_df.groupby(["run_id", "gpu_slug", "config"]):
        parts.append(ncu_table.kernel_summary(g.drop(columns=["gpu_slug", "config"])).assign(
            run_id=run_id, gpu_slug=slug, config=config))
    return _sort(pd.concat(parts, ignore_index=True), "kernel_id")


def ncu_by_run(ncu_df: pd.DataFrame, kernels: pd.DataFrame) -> pd.DataFrame:
    """Per run, its step as the counters see it (`medddpm.analysis.layers.step_weighted`): utilizations, hit rates and
    stalls of each kernel weighted by the kernel's share of the step (torch.profiler), not by the launches
    that happened to be profiled; executed thread instructions by class per step (each kernel's count per
    launch times its launches a step); `covered`, the share of the step whose kernels have counters."""

    stalls = [f"stall_{r}" for r in ncu_table.STALL_REASONS]
    insts = [f"inst_{c}" for c in ncu_table.INST_CLASSES]
    rows = []
    for (run_id, slug, config), g in ncu_df.groupby(["run_id", "gpu_slug", "config"]) if not ncu_df.empty else ():
        k = kernels[kernels["run_id"] == run_id]
        s = layers.step_weighted(k, g.drop(columns=["gpu_slug", "config"]), rates=(*_WEIGHTED, *stalls), counts=insts)
        row = {"gpu_slug": slug, "config": config, "kernels": int(g["kernel_id"].nunique()), **s}
        row |= {c: row.pop(f"{c}_per_step") for c in insts}
        row["inst_total"] = pd.Series([row[c] for c in insts]).sum(min_count=1)
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=["gpu_slug", "config"])
    return _sort(pd.DataFrame(rows))


def ncu_coverage(data: Data) -> pd.DataFrame:
    """Per run with counters: the share of step time (torch.profiler) of the kernels chosen for ncu,
    and of those it actually profiled. They differ when a chosen kernel never ran under ncu (cuDNN's
    autotuner can pick other algorithms there): the counters stand for the second share only. The
    chosen share is the one the run recorded: a run aims at `ncu_table.COVERAGE` unless told another share (some
    aimed at 80%)."""

    aimed = {r["run_id"]: json.loads(r["profilers"] or "{}").get("ncu", {}).get("coverage", math.nan)
             for r in data.run[["run_id", "profilers"]].to_dict("records")}
    rows = []
    for run_id, g in data.ncu.groupby("run_id"):
        k = data.kernels[data.kernels["run_id"] == run_id]
        if k.empty:
            continue
        rows.append({"gpu_slug": g["gpu_slug"].iloc[0], "config": g["config"].iloc[0],
                     "selected": aimed.get(run_id, math.nan), "profiled": ncu_table.profiled_coverage(k, g),
                     "launches": g["kernel_id"].nunique()})
    return _sort(pd.DataFrame(rows, columns=["gpu_slug", "config", "selected", "profiled", "launches"]))


def ncu_sections() -> tuple[str, ...]:
    """The Nsight Compute sections every counters pass collects (`medddpm.analysis.ncu_table.SECTIONS`), for
    the methodology page to list."""
    return tuple(ncu_table.SECTIONS)


def uncounted_runs(data: Data) -> pd.DataFrame:
    """GPU runs measured (status ok) that have no counters at all: `ncu_coverage` cannot list them."""
    r = data.run
    r = r[(r["gpu_name"] != "cpu") & (r["status"] == "ok") & ~r["run_id"].isin(data.ncu["run_id"])]
    return _sort(r[["gpu_slug", "config"]].reset_index(drop=True))


# A kernel's tensor-core precision, from the words of its name (cuDNN's and CUTLASS's `..._bf16bf16_bf16f32_...`,
# `..._f32f32_tf32f32_...`, `..._s16816gemm_fp16_...`), checked in this order: "bf16" holds "f16".
_TENSOR_WORDS = (("bf16", re.compile(r"bf16|bfloat16")), ("tf32", re.compile(r"tf32")),
                 ("fp16", re.compile(r"fp16|f16|half|h884|h1688|h16816")))
TENSOR_MIN_PCT = 5.0  # a kernel whose name says no precision counts as a tensor-core kernel from this pipe use


def tensor_precision(kernel: str, run_precision: str, tensor_pipe_pct: float) -> str | None:
    """The precision a kernel's tensor-core math runs in: its name's, else the run's where the run's is a tensor
    precision and the kernel keeps the tensor pipe busy (cuBLAS's and Triton's names say none); None for a kernel
    of the CUDA cores (a strict-FP32 convolution shows a percent or two of tensor pipe that is no tensor math)."""
    for precision, words in _TENSOR_WORDS:
        if words.search(kernel):
            # cuDNN's fused attention says "f16" for either 16-bit type: the run's says which
            return run_precision if precision == "fp16" and run_precision in ("bf16", "fp16") else precision
    if run_precision in ar.TENSOR and tensor_pipe_pct >= TENSOR_MIN_PCT:
        return run_precision
    return None


def math_of(precision) -> str:
    """Where a kernel's math runs, in words: "tensor cores (bf16)", or "CUDA cores"."""
    return f"tensor cores ({precision})" if isinstance(precision, str) else "CUDA cores"


def _per_sm_cycle(kind: str, roofs: dict, precision: str, sm_count: float, sm_hz: float) -> float:
    """Dense tensor FLOPs of one SM in one cycle: from the datasheet of the card's type (its peak over its SMs
    and the clock the peak assumes), else the card's measured roof over its SMs at the kernel's own clock."""
    card = ar.DATASHEET.get(kind)
    rate = card.tensor_flop_per_sm_cycle(precision) if card else None
    if rate is None and precision in roofs and sm_count > 0 and sm_hz > 0:
        rate = roofs[precision].value / (sm_count * sm_hz)
    return rate if rate is not None else math.nan


def kernel_flops(k: pd.DataFrame, run: pd.DataFrame | None = None, roofs: pd.DataFrame | None = None) -> pd.DataFrame:
    """`ncu_kernels` rows with their FLOPs counted: `flops_sass` from the FP32/FP16/FP64 thread instructions (an
    FMA is two), `flops_tensor` from the tensor pipe's active cycles (Nsight Compute counts no tensor-core FLOPs:
    the pipe's active share x the SMs' active cycles x the SMs x the card's dense FLOPs per SM and cycle in the
    kernel's precision, `tensor_precision`), `flops` their sum and `dram_bytes` the DRAM traffic."""
    run = run if run is not None else pd.DataFrame(columns=["run_id", "gpu_slug", "gpu_type", "precision_used"])
    out = k.copy()
    for col in ("run_id", "sm_count", "sm_frequency_hz", "sm_active_cycles", "tensor_pipe_pct", "flop_fp16",
                "flop_fp64"):
        if col not in out:  # tables of older ncu runs, or made by hand, lack some
            out[col] = "" if col == "run_id" else math.nan
    out["flops_sass"] = out[["flop_fp32", "flop_fp16", "flop_fp64"]].sum(axis=1, min_count=1)
    precision = dict(zip(run["run_id"], run["precision_used"]))
    kinds = gpu_types(run, roofs)
    out["tensor_precision"] = [tensor_precision(name, precision.get(rid, ""), pipe if pipe == pipe else 0.0)
                               for name, rid, pipe in zip(out["kernel"], out["run_id"], out["tensor_pipe_pct"])]
    cards = {slug: card_roofs(slug, run, roofs) for slug in out["gpu_slug"].unique()}
    rates = [_per_sm_cycle(kinds.get(slug, slug), cards[slug], p, n, hz) if isinstance(p, str) else 0.0
             for slug, p, n, hz in zip(out["gpu_slug"], out["tensor_precision"], out["sm_count"],
                                       out["sm_frequency_hz"])]
    out["flops_tensor"] = out["tensor_pipe_pct"].fillna(0) / 100 * out["sm_active_cycles"] * out["sm_count"] * rates
    out["flops"] = out["flops_sass"].fillna(0) + out["flops_tensor"].fillna(0)
    out["dram_bytes"] = out["dram_bytes_per_s"] * out["duration_ns"] / 1e9
    return out


def roofline_points(ncu_df: pd.DataFrame, run: pd.DataFrame | None = None,
                    roofs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per profiled kernel of each run: arithmetic intensity (FLOP per DRAM byte) and achieved FLOP/s of
    all its profiled launches together (their FLOPs over their bytes and over their time; `launches`),
    so that a run profiled launch by launch (the library pass) draws as many points as kernels. A scope of its
    own: the profiled launches, weighted by their own durations (not the step's).

    FLOPs are CUDA-core and tensor-core FLOPs (`kernel_flops`), so a TF32 or bf16 convolution sits where it runs;
    `math` says which: "tensor cores (<precision>)" or "CUDA cores"."""
    cols = ["gpu_slug", "config", "kernel", "launches", "duration_ns", "flops", "flops_tensor", "bytes", "intensity",
            "flops_per_s", "tensor_pipe_pct", "math"]
    k = ncu_kernels(ncu_df)
    if k.empty or "flop_fp32" not in k:
        return pd.DataFrame(columns=cols)
    k = kernel_flops(k, run, roofs).rename(columns={"dram_bytes": "bytes"})
    k = k[(k["flops"] > 0) & (k["bytes"] > 0) & (k["duration_ns"] > 0)].copy()
    k["pipe_ns"] = k["tensor_pipe_pct"] * k["duration_ns"]
    k["piped_ns"] = k["duration_ns"].where(k["tensor_pipe_pct"].notna())
    k["math"] = k["tensor_precision"].map(math_of)
    g = k.groupby(["gpu_slug", "config", "kernel"], as_index=False, sort=False).agg(
        launches=("kernel_id", "size"), duration_ns=("duration_ns", "sum"), flops=("flops", "sum"),
        flops_tensor=("flops_tensor", "sum"), bytes=("bytes", "sum"), pipe_ns=("pipe_ns", "sum"),
        piped_ns=("piped_ns", "sum"), math=("math", "first"))
    g["intensity"] = g["flops"] / g["bytes"]
    g["flops_per_s"] = g["flops"] / (g["duration_ns"] / 1e9)
    # duration-weighted over the launches ncu gave it for; NaN where it gave none
    g["tensor_pipe_pct"] = g["pipe_ns"] / g["piped_ns"].where(g["piped_ns"] > 0)
    g["kernel"] = g["kernel"].str.slice(0, 160)  # a label: kernels are told apart by their whole names above
    return g[cols]


_LAYER = re.compile(r"conv3d (\d+)>(\d+) k(\d+) s(\d+) @(\d+)x(\d+)x(\d+)")


def layer_flops(layer: str) -> float:
    """A convolution layer's FLOPs in one direction, from its range's name (`conv3d 64>64 k3 s1 @128x128x128`:
    2 x in x out channels x k^3 x output voxels; forward, input gradient and weight gradient alike)."""
    m = _LAYER.match(layer)
    if not m:
        return math.nan
    cin, cout, k, stride, d, h, w = map(int, m.groups())
    return 2.0 * cin * cout * k**3 * (d // stride) * (h // stride) * (w // stride)


def flop_count_check(data: Data) -> pd.DataFrame:
    """The FLOP count held against arithmetic: per run, each convolution layer and direction profiled in its
    range, its counted FLOPs (`kernel_flops`, its main kernel) over the layer's own (`layer_flops`). Near 1 the
    count is right; well above 1 the kernel computes padding (a layer of 1 or 4 channels on a tile of 64)."""
    cols = ["gpu_slug", "config", "layer", "direction", "kernel", "math", "duration_ns", "counted", "layer_flops",
            "ratio"]
    k = ncu_kernels(data.ncu)
    if k.empty or "flop_fp32" not in k:
        return pd.DataFrame(columns=cols)
    k = kernel_flops(k, data.run, data.roofs)
    k = k[(k["layer"] != "") & (k["direction"] != "")].copy()
    if k.empty:
        return pd.DataFrame(columns=cols)
    k["layer"] = k["layer"].str.removesuffix(" backward")
    k["math"] = k["tensor_precision"].map(math_of)
    main = k.sort_values("duration_ns", ascending=False).drop_duplicates(["gpu_slug", "config", "layer", "direction"])
    main = main.assign(counted=main["flops"], layer_flops=main["layer"].map(layer_flops))
    main["ratio"] = main["counted"] / main["layer_flops"]
    return _sort(main[cols].dropna(subset=["ratio"]), "layer")


def ncu_priorities(data: Data, n: int = 10) -> pd.DataFrame:
    """`medddpm.analysis.ncu_table.priorities` per run (share of step x a rule's estimated global speedup), top n
    each."""

    if data.ncu.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "kernel", "rule", "section", "share", "speedup_pct",
                                     "priority"])
    parts = []
    for (run_id, slug, config), g in data.ncu.groupby(["run_id", "gpu_slug", "config"]):
        k = data.kernels[data.kernels["run_id"] == run_id]
        p = ncu_table.priorities(k, g.drop(columns=["gpu_slug", "config"])).head(n)
        parts.append(p.assign(gpu_slug=slug, config=config))
    out = pd.concat(parts, ignore_index=True)
    out["kernel"] = out["kernel"].str.slice(0, 160)
    return _sort(out, "priority")


# ------------------------------------------------------------------------------------------ the page

PERCENT_COLUMNS = ("tensor_pipe_pct", "l1_hit_pct", "l2_hit_pct", "dram_throughput_pct", "sm_throughput_pct")
COVERAGE_FLOOR = 0.8  # a run's counters that stand for less of its step than this are named on the page


def check_counters(counters: pd.DataFrame) -> None:
    """Step-weighted percentages lie within 0-100 (half a point of slack for rounding in Nsight Compute)."""
    for col in PERCENT_COLUMNS:
        if col in counters:
            v = counters[col].dropna()
            assert ((v >= 0) & (v <= 100.5)).all(), (col, v.tolist())


def counters_text(data: Data, counters: pd.DataFrame) -> str:
    """What the counters stand for and how they are weighted; where the data holds none, why and how to get them."""
    if data.ncu.empty:
        gpus = sorted(set(data.run.loc[data.run["gpu_name"] != "cpu", "gpu_slug"]))
        return ("**These figures need a GPU run.** The data holds no `ncu.parquet`: "
                + ("no GPU has been measured with the pipeline yet" if not gpus else
                   f"the GPU runs ({md(', '.join(gpus))}) have no Nsight Compute table")
                + ". Hardware counters exist only on an NVIDIA GPU with Nsight Compute (`ncu`) on the path; run "
                "`python -m medddpm sweep --preset paper` there, and every chart on this page fills in with no edit. "
                "Until then each chart below says that it has nothing to draw.")
    return (f"Counters for {counters['gpu_slug'].nunique()} GPU(s) and {len(counters)} runs, over "
            f"{int(counters['kernels'].sum())} profiled kernel launches. Nsight Compute profiles a sample of each "
            "step's launches, and two runs' samples differ, so no figure here averages the profiled launches. "
            "A rate (tensor-pipe use, hit rates, throughputs, stalls) weights each kernel of the step by its share "
            "of the step's kernel time in the torch.profiler table, with the kernel's own rate from the launches "
            "that stand for it; a count (instructions) is each kernel's count per launch times its launches a "
            "step. Kernels without counters are left out of both, and the share of the step that has counters "
            "is in the table below.")


def coverage_text(data: Data, cov: pd.DataFrame) -> str:
    """What share of each run's step the counters stand for: the runs short of `COVERAGE_FLOOR` and why that
    happens, and the GPU runs with no counters at all."""
    short = cov[cov["profiled"] < COVERAGE_FLOOR - 1e-9]
    text = ("What the counters stand for, as a share of each run's kernel time: the kernels chosen for Nsight "
            "Compute (from the profiler's table, longest launches first, to the share the run asked for), and "
            "those it actually profiled. "
            + (f"Every run's counters cover at least {COVERAGE_FLOOR:.0%}." if short.empty else
               f"Short of {COVERAGE_FLOOR:.0%}: "
               + ", ".join(f"{code(f'{r.gpu_slug}/{r.config}')} {r.profiled:.2%}" for r in short.itertuples())
               + ". A chosen kernel that ncu never saw is usually a cuDNN convolution of the backward pass: "
               "ncu names cuDNN's launches after the launch before them, so its name filters lose them, and "
               "they are profiled in a pass of their own, every launch in order, as far as the time allows. "
               "Read these runs' figures as those of the kernels profiled, not of the whole step; "
               "`python -m medddpm counters RUN_DIR` takes a run's counters again without timing it again "
               "(with `--merge` it adds to the counters a run has, going on where their library pass stopped)."))
    none = uncounted_runs(data)
    if not none.empty:
        text += ("\n\nNo counters yet: " + ", ".join(code(f"{r.gpu_slug}/{r.config}") for r in none.itertuples())
                 + " (`python -m medddpm counters RUN_DIR` on that GPU).")
    return text


COVERAGE_COLUMNS = {"gpu_slug": "GPU", "config": "configuration", "selected": "chosen for ncu", "profiled": "profiled",
                    "launches": "profiled launches"}


def top_savings(prio: pd.DataFrame) -> pd.DataFrame:
    """The largest estimated saving of each run (`ncu_priorities`): the rule and its kernel, the kernel's share of
    the step times the rule's estimated speedup, in the page's column names."""
    top = _sort(prio.sort_values("priority", ascending=False).groupby(["gpu_slug", "config"]).head(1))
    top = top.assign(what=top["rule"] + " on " + top["kernel"].str.slice(0, 40) + "…",
                     how=[f"{a:.0%}\u00a0×\u00a0{b:.0f}%" for a, b in zip(top["share"], top["speedup_pct"])])
    return top[["gpu_slug", "config", "priority", "how", "what"]].rename(
        columns={"gpu_slug": "GPU", "config": "configuration", "priority": "saving, of step",
                 "how": "share × speedup", "what": "rule, on kernel"})


def roofs_in_use(roofs: pd.DataFrame) -> pd.DataFrame:
    """`roofs.roofs_view` as the page shows it: each roof's value in use with its unit and source, the card's own
    measurement and the datasheet's value beside it, and the measured share of the datasheet."""
    t = roofs.assign(shown=[f"{v / 1e12:.3g} {'TB/s' if u == 'byte/s' else 'TFLOP/s'}"
                            for v, u in zip(roofs["value"], roofs["unit"])],
                     own=[f"{v / 1e12:.3g}" if pd.notna(v) else "-" for v in roofs["measured"]],
                     sheet=[f"{v / 1e12:.3g}" if pd.notna(v) else "-" for v in roofs["datasheet"]],
                     share=[f"{v:.0%}" if pd.notna(v) else "-" for v in roofs["of_datasheet"]])
    return t[["gpu_slug", "what", "shown", "source", "own", "sheet", "share"]].rename(columns={
        "gpu_slug": "GPU", "what": "roof", "shown": "value", "own": "measured (same unit)",
        "sheet": "datasheet (same unit)", "share": "measured / datasheet"})


def roof_sources_text(roofs: pd.DataFrame) -> str:
    said = roofs.drop_duplicates(["gpu_slug", "detail"])
    return "Sources: " + "; ".join(f"**{md(r.gpu_slug)}**, {md(r.source)}: {md(r.detail)}"
                                   for r in said.itertuples()) + "."


FLOP_CLOSE = 0.05  # a counted layer within 5% of its arithmetic counts right


def flop_check_text(check: pd.DataFrame) -> str:
    """How many layer directions count within `FLOP_CLOSE` of their arithmetic, how many count less (which the
    count cannot explain), and why a kernel may count more."""
    close = check[(check["ratio"] - 1).abs() <= FLOP_CLOSE]
    low = check[check["ratio"] < 1 - FLOP_CLOSE]
    return (f"{len(close)} of {len(check)} layer directions count within {FLOP_CLOSE:.0%} of the layer's FLOPs"
            + (f"; {len(low)} count less, which the count cannot explain and which makes its FLOP figures suspect"
               if len(low) else "") + ". A kernel counted higher executes more arithmetic than its layer needs (a "
            "tensor-core tile of 64 channels over a layer of 1 or 4 computes the padding too; some CUDA-core "
            "weight-gradient engines execute more FMAs than the gradient has): the count is of what ran, not of "
            "what the layer asked for. The longest three of each run and unit:")


def flop_check_table(check: pd.DataFrame, n: int = 3) -> pd.DataFrame:
    """The `n` longest layer directions of each run and unit, their counted FLOPs over the layer's."""
    big = check.sort_values("duration_ns", ascending=False).groupby(["gpu_slug", "config", "math"]).head(n)
    return big[["gpu_slug", "config", "layer", "direction", "math", "ratio"]].rename(columns={
        "gpu_slug": "GPU", "config": "configuration", "math": "math ran on", "ratio": "counted / layer FLOPs"})
