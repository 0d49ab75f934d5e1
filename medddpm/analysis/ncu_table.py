"""Nsight Compute's counters as one long table, and what is derived from it.

ncu's report, exported with ``ncu -i REPORT --csv --page details --print-units base --print-rule-details``,
is read into one long table of `COLUMNS` (`parse_details_csv`): a row per metric and per rule of each
profiled launch (`kernel_id`), and a text row for the layer range a launch ran in (`LAYER_SECTION`, written by
`medddpm.measure.profile.ncu_layers`). It holds ncu's `SECTIONS` and the raw `EXTRA_METRICS` the summary reads
beyond them. From it come `kernel_summary` (one row per launch: the headline numbers), `priorities` (rules
weighted by the kernel's share of the step) and the share of the step the counters cover (`profiled_coverage`;
`select_kernels` picks the kernels to profile from the torch.profiler table, longest launches first).
"""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path
from typing import IO

import pandas as pd

from medddpm.analysis.ncu_names import conv_direction, match_kernel

# Sections, not `--set full`: full also collects SourceCounters and PM sampling (55 MB for 12 kernels).
SECTIONS = (
    "SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
    "WarpStateStats", "SchedulerStats", "InstructionStats", "Occupancy", "LaunchStats",
    "SpeedOfLight_RooflineChart",
)

# Section identifier -> display name (`ncu --list-sections`, 2025.3). In the details CSV a metric row
# names its section by display name, but a rule row by the identifier of the section file that holds
# the rule, so both spellings of one section appear ("Compute Workload Analysis" and
# "ComputeWorkloadAnalysis"); parse_details_csv writes display names only.
SECTION_NAMES = {
    "C2CLink": "C2CLink",
    "ComputeWorkloadAnalysis": "Compute Workload Analysis",
    "InstructionStats": "Instruction Statistics",
    "LaunchStats": "Launch Statistics",
    "MemoryWorkloadAnalysis": "Memory Workload Analysis",
    "MemoryWorkloadAnalysis_Chart": "Memory Workload Analysis Chart",
    "MemoryWorkloadAnalysis_Tables": "Memory Workload Analysis Tables",
    "NumaAffinity": "NUMA Affinity",
    "Nvlink": "NVLink",
    "Nvlink_Tables": "NVLink Tables",
    "Nvlink_Topology": "NVLink Topology",
    "Occupancy": "Occupancy",
    "PmSampling": "PM Sampling",
    "PmSampling_WarpStates": "PM Sampling: Warp States",
    "SchedulerStats": "Scheduler Statistics",
    "SourceCounters": "Source Counters",
    "SpeedOfLight": "GPU Speed Of Light Throughput",
    "SpeedOfLight_HierarchicalDoubleRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Double Precision)",
    "SpeedOfLight_HierarchicalHalfRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Half Precision)",
    "SpeedOfLight_HierarchicalSingleRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Single Precision)",
    "SpeedOfLight_HierarchicalTensorRooflineChart": "GPU Speed Of Light Hierarchical Roofline Chart (Tensor Core)",
    "SpeedOfLight_RooflineChart": "GPU Speed Of Light Roofline Chart",
    "WarpStateStats": "Warp State Statistics",
    "WorkloadDistribution": "GPU and Memory Workload Distribution",
}

# Names as in Nsight Compute's own section files (ComputeWorkloadAnalysis, WarpStateStatistics,
# SpeedOfLight_RooflineChart) and its nvprof transition table; `measure.profile.ncu.run_ncu` drops any the device
# lacks.
TENSOR_PIPE_METRICS = (
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",  # warp MMA (Volta..Hopper)
    # Hopper: HMMA plus warpgroup HGMMA/QGMMA (an H200 lists no sm__pipe_tensor_op_gmma_cycles_active)
    "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",  # "Tensor (All)", any architecture
)
INST_CLASSES = ("fp16", "fp32", "fp64", "integer", "memory", "control", "conversion", "bit", "misc", "uniform",
                "inter_thread_communication")
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "lg_throttle",
                 "math_pipe_throttle", "tex_throttle", "not_selected", "selected", "wait", "dispatch_stall",
                 "no_instruction", "drain", "sleeping", "imc_miss", "branch_resolving", "misc", "gmma")
# Thread instructions per op; FLOPs = add + mul + 2 * fma (what the roofline section computes).
FLOP_OPS = {"fp32": ("fadd", "fmul", "ffma"), "fp64": ("dadd", "dmul", "dfma"), "fp16": ("hadd", "hmul", "hfma")}


def _inst_metric(cls: str) -> str:
    return f"smsp__sass_thread_inst_executed_op_{cls}_pred_on.sum"


def _stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


EXTRA_METRICS: list[str] = [
    *TENSOR_PIPE_METRICS,
    *(_inst_metric(c) for c in INST_CLASSES),
    *(_stall_metric(r) for r in STALL_REASONS),
    *(_inst_metric(op) for ops in FLOP_OPS.values() for op in ops),
    "l1tex__t_sector_hit_rate.pct",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes.sum.per_second",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "gpu__time_duration.sum",
]

COLUMNS = {"kernel": "str", "kernel_id": "int64", "kind": "str", "section": "str", "metric": "str",
           "value": "float64", "unit": "str", "text": "str", "speedup_type": "str"}


# The layer range each launch ran in, one text row per launch (`medddpm.measure.profile.ncu_layers`).
LAYER_SECTION, LAYER_METRIC = "NVTX", "layer"


def empty_table() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in COLUMNS.items()})


def join_launches(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """Long tables of several ncu passes as one, each pass's kernel ids shifted past those before it."""
    shifted, start = [], 0
    for t in (t[list(COLUMNS)] for t in tables if not t.empty):
        shifted.append(t.assign(kernel_id=t["kernel_id"] - t["kernel_id"].min() + start))
        start = int(shifted[-1]["kernel_id"].max()) + 1
    return pd.concat(shifted, ignore_index=True).astype(COLUMNS) if shifted else empty_table()


# ------------------------------------------------------------------------------------------ parsing

def _read_text(path_or_buffer: str | os.PathLike | IO) -> str:
    if hasattr(path_or_buffer, "read"):
        data = path_or_buffer.read()
    else:
        data = Path(path_or_buffer).read_bytes()
    if isinstance(data, bytes):
        data = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8")
    return data


def parse_details_csv(path_or_buffer: str | os.PathLike | IO) -> pd.DataFrame:
    """ncu's `--page details --csv` export (optionally gzipped) as the long table `COLUMNS`."""
    text = _read_text(path_or_buffer)
    start = text.find('"ID",')  # ncu may print ==PROF==/==WARNING== lines before the header
    if start < 0:
        return empty_table()
    raw = pd.read_csv(io.StringIO(text[start:]), dtype=str, keep_default_na=False)
    if raw.empty:
        return empty_table()
    rule = raw["Rule Name"].ne("") & raw["Metric Name"].eq("")

    def number(s: pd.Series) -> pd.Series:  # "3,153,508,771.93" -> 3153508771.93; "n/a", text -> NaN
        return pd.to_numeric(s.str.replace(",", "", regex=False), errors="coerce")

    df = pd.DataFrame({
        "kernel": raw["Kernel Name"],
        "kernel_id": raw["ID"].astype("int64"),
        "kind": rule.map({True: "rule", False: "metric"}),
        "section": raw["Section Name"].replace(SECTION_NAMES),
        "metric": raw["Metric Name"].where(~rule, raw["Rule Name"]),
        "value": number(raw["Metric Value"]).where(~rule, number(raw["Estimated Speedup"])),
        "unit": raw["Metric Unit"].where(~rule, "%"),
        "text": raw["Metric Value"].where(~rule, raw["Rule Description"]),
        "speedup_type": raw["Estimated Speedup Type"].where(rule, ""),
    })
    return df.astype(COLUMNS)



def launch_layers(ncu: pd.DataFrame) -> pd.Series:
    """kernel_id -> the layer range it ran in ('' where none was recorded)."""
    rows = ncu[(ncu["section"] == LAYER_SECTION) & (ncu["metric"] == LAYER_METRIC)]
    ids = ncu["kernel_id"].drop_duplicates().sort_values()
    return rows.groupby("kernel_id")["text"].first().reindex(ids, fill_value="")


# ------------------------------------------------------------------------------------------ summary

_SOL, _CWA, _MWA = "GPU Speed Of Light Throughput", "Compute Workload Analysis", "Memory Workload Analysis"
# column -> candidates, best first: (section display name, metric display name) or a raw metric name
HEADLINE: dict[str, tuple[tuple[str, str] | str, ...]] = {
    "duration_ns": ((_SOL, "Duration"), "gpu__time_duration.sum"),
    "sm_throughput_pct": ((_SOL, "Compute (SM) Throughput"), "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    "memory_throughput_pct": ((_SOL, "Memory Throughput"),
                              "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_throughput_pct": ((_SOL, "DRAM Throughput"), "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "dram_bytes_per_s": ("dram__bytes.sum.per_second",),
    "l1_hit_pct": ((_MWA, "L1/TEX Hit Rate"), "l1tex__t_sector_hit_rate.pct"),
    "l2_hit_pct": ((_MWA, "L2 Hit Rate"), "lts__t_sector_hit_rate.pct"),
    "achieved_occupancy_pct": (("Occupancy", "Achieved Occupancy"),
                               "sm__warps_active.avg.pct_of_peak_sustained_active"),
    "theoretical_occupancy_pct": (("Occupancy", "Theoretical Occupancy"),),
    "sm_active_cycles": ((_SOL, "SM Active Cycles"), "sm__cycles_active.avg"),
    "elapsed_cycles": ((_SOL, "Elapsed Cycles"), "gpc__cycles_elapsed.max"),
    "inst_executed": (("Instruction Statistics", "Executed Instructions"), "sm__inst_executed.sum"),
    "ipc": ((_CWA, "Executed Ipc Active"), "sm__inst_executed.avg.per_cycle_active"),
    "warp_cycles_per_inst": (("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
                             "smsp__average_warp_latency_per_inst_issued.ratio"),
    "registers_per_thread": (("Launch Statistics", "Registers Per Thread"), "launch__registers_per_thread"),
    # what turns the tensor pipe's active share into tensor-core FLOPs (`report.counters.kernel_flops`)
    "sm_count": (("Launch Statistics", "# SMs"), "device__attribute_multiprocessor_count"),
    "sm_frequency_hz": ((_SOL, "SM Frequency"), "smsp__cycles_elapsed.avg.per_second"),
    **{f"inst_{c}": (_inst_metric(c),) for c in INST_CLASSES},
    **{f"stall_{r}": (_stall_metric(r),) for r in STALL_REASONS},
}


def _wide(metrics: pd.DataFrame) -> pd.DataFrame:
    """kernel_id x (section, metric) of numeric values (first non-NaN of duplicates)."""
    return metrics.groupby(["kernel_id", "section", "metric"])["value"].first().unstack(["section", "metric"])


def _pick(wide: pd.DataFrame, candidates: tuple[tuple[str, str] | str, ...]) -> pd.Series:
    """First non-NaN among the candidates; a raw metric name is looked up in any section."""
    out = pd.Series(float("nan"), index=wide.index)
    for c in candidates:
        for col in [c] if isinstance(c, tuple) else [k for k in wide.columns if k[1] == c]:
            if col in wide.columns:
                out = out.fillna(wide[col])
    return out


def kernel_summary(ncu: pd.DataFrame) -> pd.DataFrame:
    """One row per profiled launch (kernel_id): the headline numbers, NaN where not collected."""
    names = ncu.groupby("kernel_id")["kernel"].first()
    wide = _wide(ncu[ncu["kind"] == "metric"]).reindex(names.index)
    cols = {col: _pick(wide, cands) for col, cands in HEADLINE.items()}
    cols["tensor_pipe_pct"] = pd.concat([_pick(wide, (m,)) for m in TENSOR_PIPE_METRICS], axis=1).max(axis=1)
    for kind, ops in FLOP_OPS.items():  # thread instructions -> FLOPs (an FMA is two)
        add, mul, fma = (_pick(wide, (_inst_metric(op),)) for op in ops)
        cols[f"flop_{kind}"] = add + mul + 2 * fma
    out = pd.DataFrame(cols, index=names.index).astype("float64")
    out.insert(0, "kernel", names.astype("str"))
    out.insert(1, "layer", launch_layers(ncu).reindex(names.index, fill_value="").astype("str"))
    out.insert(2, "direction", names.map(conv_direction).fillna("").astype("str"))
    return out.reset_index().astype({"kernel_id": "int64"})


# --------------------------------------------------------------------------------------- priorities

def _shares(names: pd.Series, share: pd.Series, duration: pd.Series, ncu: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(profiler name, step share) for each ncu kernel name. ncu kernels matching the same profiler
    names (a cuDNN family) split that share by their profiled durations, so it is counted once."""
    per_name = ncu.groupby("kernel_id")["kernel"].first().to_frame().assign(ns=duration).groupby("kernel")["ns"].sum()
    matches = {k: tuple(match_kernel(k, share.index.tolist())) for k in names.unique()}
    group_ns = pd.Series({k: per_name.get(k, 0.0) for k in matches}).groupby(pd.Series(matches)).transform("sum")
    frac = {k: per_name.get(k, 0.0) / group_ns[k] if group_ns[k] > 0 else 1.0 for k in matches}
    first = names.map(lambda k: matches[k][0] if matches[k] else None)  # the largest share
    return first, names.map(lambda k: share[list(matches[k])].sum() * frac[k] if matches[k] else float("nan"))


def priorities(kernels: pd.DataFrame, ncu: pd.DataFrame, *, include_local: bool = False) -> pd.DataFrame:
    """Per (kernel, rule): share of step time x the rule's estimated speedup; largest gain first.

    `share` is the torch.profiler share summed over all rows (passes) of the matched name. A
    "global" speedup is a fraction of the kernel's duration, so share x speedup estimates the saving
    in step time; a "local" one is relative to a single unit or metric and overstates it, so local
    rules are left out unless asked for. A kernel launched several times is averaged over its
    launches weighted by duration; a rule reported more than once per launch (WorkloadImbalance per
    unit, CPIStall) counts with its largest estimate. Unmatched kernels keep NaN share and priority.
    """
    cols = ["kernel", "profiler_kernel", "rule", "section", "speedup_type", "share", "speedup_pct", "priority"]
    rules = ncu[(ncu["kind"] == "rule") & ncu["value"].notna()]
    if not include_local:
        rules = rules[rules["speedup_type"] == "global"]
    if rules.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64" if c in cols[5:] else "str") for c in cols})
    share = kernels.groupby("kernel")["share"].sum().sort_values(ascending=False)
    duration = kernel_summary(ncu).set_index("kernel_id")["duration_ns"]
    launch = (rules.groupby(["kernel_id", "kernel", "metric", "section", "speedup_type"], as_index=False)["value"]
              .max().rename(columns={"metric": "rule", "value": "speedup_pct"}))
    launch["weight"] = launch["kernel_id"].map(duration).fillna(1.0)
    launch["weighted"] = launch["speedup_pct"] * launch["weight"]
    g = launch.groupby(["kernel", "rule", "section", "speedup_type"], as_index=False)[["weighted", "weight"]].sum()
    g["speedup_pct"] = g["weighted"] / g["weight"]
    g["profiler_kernel"], g["share"] = _shares(g["kernel"], share, duration, ncu)
    g["priority"] = g["share"] * g["speedup_pct"] / 100
    g = g.sort_values(["priority", "speedup_pct"], ascending=False, na_position="last")
    return g[cols].reset_index(drop=True)


# ---------------------------------------------------------------------------------------- coverage

NON_KERNEL_CATEGORIES = ("memcpy",)  # copies and fills (`analysis.kernels` files memsets here too): not kernels
# Step time the selection aims at: 80% is what the counters must cover, and matching ncu's names back to
# the profiler's loses a few points (cuDNN's dgrad launches, a few percent of sdpa's and graphs' steps)
COVERAGE = 0.85


def _kernel_times(kernels: pd.DataFrame) -> pd.Series:
    """Summed device time per distinct kernel name, largest first (name breaks ties: deterministic)."""
    k = kernels[~kernels["category"].isin(NON_KERNEL_CATEGORIES)]
    t = k.groupby("kernel")["total_us"].sum()
    return t.sort_index().sort_values(ascending=False, kind="stable")


def select_kernels(kernels: pd.DataFrame, *, coverage: float = 0.8) -> list[str]:
    """Distinct kernels whose summed time reaches `coverage` of all kernel time, taken by time per launch,
    longest first (by total time where `calls` is absent).

    Nsight Compute's cost grows with the launches it replays (seconds each at 128^3), so a
    kernel of many short launches comes last: in data/nvidia-h200/opt1, layout conversions are 398
    launches a step for 10% of its time; 80% by total time takes 698 launches a step, by time per launch 369.
    """
    t = _kernel_times(kernels)
    total = t.sum()
    if total <= 0:
        return []
    if "calls" in kernels:
        calls = kernels[kernels["kernel"].isin(t.index)].groupby("kernel")["calls"].sum().reindex(t.index)
        t = t.loc[(t / calls.clip(lower=1)).sort_values(ascending=False, kind="stable").index]
    reached = t.cumsum() >= coverage * total * (1 - 1e-12)  # float sums must not miss an exact boundary
    return t.index[: int(reached.to_numpy().argmax()) + 1].tolist()


def covered(kernels: pd.DataFrame, names: list[str]) -> float:
    """Fraction of all kernel time spent in `names`."""
    t = _kernel_times(kernels)
    return float(t[t.index.isin(names)].sum() / t.sum()) if t.sum() > 0 else 0.0


def profiled_names(kernels: pd.DataFrame, ncu: pd.DataFrame) -> set[str]:
    """The profiler's kernel names that ncu's table covers (names matched as in `match_kernel`)."""
    names = _kernel_times(kernels).index.tolist()
    return {n for k in ncu["kernel"].unique() for n in match_kernel(k, names)}


def profiled_coverage(kernels: pd.DataFrame, ncu: pd.DataFrame) -> float:
    """Fraction of the step's kernel time in kernels that ncu actually profiled: the selection aims at
    `COVERAGE`, this says what the counters cover."""
    return covered(kernels, sorted(profiled_names(kernels, ncu)))
