"""The counters page: Nsight Compute's hardware counters, weighted by each kernel's share of the step."""

from __future__ import annotations

import json
import math

import pandas as pd

from medddpm.report.loading import Data, _sort

_WEIGHTED = ("tensor_pipe_pct", "sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct", "l1_hit_pct",
             "l2_hit_pct", "achieved_occupancy_pct")


def ncu_kernels(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """`medddpm.measure.ncu_table.kernel_summary` for every run, with gpu_slug and config."""
    from medddpm.measure import ncu_table

    if ncu_df.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "kernel_id", "kernel", "duration_ns", *_WEIGHTED])
    parts = []
    for (run_id, slug, config), g in ncu_df.groupby(["run_id", "gpu_slug", "config"]):
        parts.append(ncu_table.kernel_summary(g.drop(columns=["gpu_slug", "config"])).assign(
            run_id=run_id, gpu_slug=slug, config=config))
    return _sort(pd.concat(parts, ignore_index=True), "kernel_id")


def ncu_by_run(ncu_df: pd.DataFrame, kernels: pd.DataFrame) -> pd.DataFrame:
    """Per run, its step as the counters see it (`medddpm.layers.step_weighted`): utilizations, hit rates and
    stalls of each kernel weighted by the kernel's share of the step (torch.profiler), not by the launches
    that happened to be profiled; executed thread instructions by class per step (each kernel's count per
    launch times its launches a step); `covered`, the share of the step whose kernels have counters."""
    from medddpm.measure import layers
    from medddpm.measure import ncu_table

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
    chosen share is the one the run recorded: a run aims at `ncu.COVERAGE` unless told another share (some
    aimed at 80%)."""
    from medddpm.measure import ncu

    aimed = {r["run_id"]: json.loads(r["profilers"] or "{}").get("ncu", {}).get("coverage", math.nan)
             for r in data.run[["run_id", "profilers"]].to_dict("records")}
    rows = []
    for run_id, g in data.ncu.groupby("run_id"):
        k = data.kernels[data.kernels["run_id"] == run_id]
        if k.empty:
            continue
        rows.append({"gpu_slug": g["gpu_slug"].iloc[0], "config": g["config"].iloc[0],
                     "selected": aimed.get(run_id, math.nan), "profiled": ncu.profiled_coverage(k, g),
                     "launches": g["kernel_id"].nunique()})
    return _sort(pd.DataFrame(rows, columns=["gpu_slug", "config", "selected", "profiled", "launches"]))


def uncounted_runs(data: Data) -> pd.DataFrame:
    """GPU runs measured (status ok) that have no counters at all: `ncu_coverage` cannot list them."""
    r = data.run
    r = r[(r["gpu_name"] != "cpu") & (r["status"] == "ok") & ~r["run_id"].isin(data.ncu["run_id"])]
    return _sort(r[["gpu_slug", "config"]].reset_index(drop=True))


def roofline_points(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """Per profiled kernel of each run: arithmetic intensity (FLOP per DRAM byte) and achieved FLOP/s of
    all its profiled launches together (their FLOPs over their bytes and over their time; `launches`),
    so that a run profiled launch by launch (the library pass) draws as many points as kernels.

    FLOPs come from ncu's FP32/FP16/FP64 thread-instruction counts (an FMA is two), which do not see
    tensor-core (HMMA/GMMA) math: tensor-core kernels are drawn with what the SASS counters see."""
    cols = ["gpu_slug", "config", "kernel", "launches", "duration_ns", "flops", "bytes", "intensity", "flops_per_s",
            "tensor_pipe_pct"]
    k = ncu_kernels(ncu_df)
    if k.empty or "flop_fp32" not in k:
        return pd.DataFrame(columns=cols)
    k = k.copy()
    k["flops"] = k[["flop_fp32", "flop_fp16", "flop_fp64"]].sum(axis=1, min_count=1)
    k["bytes"] = k["dram_bytes_per_s"] * k["duration_ns"] / 1e9
    k = k[(k["flops"] > 0) & (k["bytes"] > 0) & (k["duration_ns"] > 0)]
    k["pipe_ns"] = k["tensor_pipe_pct"] * k["duration_ns"]
    k["piped_ns"] = k["duration_ns"].where(k["tensor_pipe_pct"].notna())
    g = k.groupby(["gpu_slug", "config", "kernel"], as_index=False, sort=False).agg(
        launches=("kernel_id", "size"), duration_ns=("duration_ns", "sum"), flops=("flops", "sum"),
        bytes=("bytes", "sum"), pipe_ns=("pipe_ns", "sum"), piped_ns=("piped_ns", "sum"))
    g["intensity"] = g["flops"] / g["bytes"]
    g["flops_per_s"] = g["flops"] / (g["duration_ns"] / 1e9)
    # duration-weighted over the launches ncu gave it for; NaN where it gave none
    g["tensor_pipe_pct"] = g["pipe_ns"] / g["piped_ns"].where(g["piped_ns"] > 0)
    g["kernel"] = g["kernel"].str.slice(0, 160)  # a label: kernels are told apart by their whole names above
    return g[cols]


def ncu_priorities(data: Data, n: int = 10) -> pd.DataFrame:
    """`medddpm.measure.ncu_table.priorities` per run (share of step x a rule's estimated global speedup), top n
    each."""
    from medddpm.measure import ncu_table

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
