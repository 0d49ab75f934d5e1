"""The same layer in two configurations, kernel against kernel, and counters weighted by the step.

Nsight Compute profiles launches, and two configurations' profiled launch sets differ: the FP32 baseline's
are mostly cuDNN convolutions, TF32's also GroupNorm and element-wise kernels. An average over "whatever was
profiled" then compares different work. Two comparisons do not:

- **Matched layers** (`matched_layers`): `medddpm.measure.profile.capture` names each convolution of an eager step
  with an NVTX range (`conv3d 64>64 k3 s1 @128x128x128`: channels, kernel, stride, input size,
  `medddpm.model.flops.layer_name`), which ncu keeps per launch (`medddpm.measure.profile.ncu_layers.with_layers`). A layer's forward (`fprop`), input gradient (`dgrad`) and weight
  gradient (`wgrad`) each run one main kernel; the same layer and direction in two configurations is the same
  arithmetic, so their counters compare kernel against kernel. Layers are ranked by the time they carry in
  the first configuration's step: their instances in the model (`layer_counts`) times the kernel's duration.
- **Step-weighted counters** (`step_weighted`): a rate (tensor-pipe use, hit rates, DRAM throughput) of each
  profiled kernel, weighted by that kernel's share of the step's time in the torch.profiler table
  (`kernels.parquet`), not by the duration of the launches that happened to be profiled.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from medddpm.analysis import ncu_names, ncu_table

# Per-launch counters compared across configurations: (column of `ncu_table.kernel_summary`, what it is)
LAYER_METRICS = {
    "duration_ns": "kernel duration (ns)",
    "sm_active_cycles": "SM active cycles (mean over SMs)",
    "inst_executed": "executed warp instructions",
    "tensor_pipe_pct": "tensor pipe, % of peak while active",
    "l1_hit_pct": "L1/TEX hit rate (%)",
    "l2_hit_pct": "L2 hit rate (%)",
    "dram_throughput_pct": "DRAM throughput, % of peak",
    "stall_long_scoreboard": "long-scoreboard stall cycles per issued instruction",
    "stall_math_pipe_throttle": "math-pipe-throttle stall cycles per issued instruction",
}
# Rates that average over kernels (weighted by step time); counts (cycles, instructions) do not.
STEP_RATES = ("tensor_pipe_pct", "sm_throughput_pct", "l1_hit_pct", "l2_hit_pct", "dram_throughput_pct",
              "stall_long_scoreboard")


def layer_kernels(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, direction): the main convolution kernel of the profiled launches (the longest on average, so
    that a helper never stands for the layer) with its per-launch mean counters and `launches` profiled.
    Launches outside a layer range, or of kernels that are not convolutions, are left out."""
    cols = ["layer", "direction", "kernel", "launches", *LAYER_METRICS]
    k = ncu_table.kernel_summary(ncu_df) if not ncu_df.empty else pd.DataFrame(columns=["layer", "direction"])
    k = k[(k["layer"] != "") & (k["direction"] != "")]
    if k.empty:
        return pd.DataFrame(columns=cols)
    k = k.assign(layer=k["layer"].str.removesuffix(" backward"))
    per = k.groupby(["layer", "direction", "kernel"], as_index=False).agg(
        launches=("kernel_id", "size"), **{m: (m, "mean") for m in LAYER_METRICS})
    main = per.sort_values("duration_ns", ascending=False, kind="stable").drop_duplicates(["layer", "direction"])
    return main.sort_values(["layer", "direction"]).reset_index(drop=True)[cols]


def layer_counts(run: pd.Series) -> pd.Series:
    """Instances of each convolution layer in one step of the run's model (layer range name -> count), from a
    forward pass on the meta device (`model.flops.conv_layers`: torch, imported here alone, so that the table
    analyses above load without it)."""
    from medddpm.model.flops import conv_layers
    from medddpm.model.unet import ModelSpec, parse_size
    from medddpm.presets import get_preset

    try:
        preset = get_preset(run["preset"])
    except ValueError:  # a preset this version does not know: its layers cannot be counted
        return pd.Series(dtype="int64")
    spec = ModelSpec(size=parse_size(run["shape"]), mask_channels=int(run["mask_channels"]),
                     image_channels=int(run["image_channels"]), base_channels=preset.base_channels,
                     channel_mult=preset.channel_mult, num_res_blocks=int(run["num_res_blocks"]),
                     attention_ds=preset.attention_ds)
    return pd.Series(conv_layers(spec), dtype="int64")


def matched_layers(a: pd.DataFrame, b: pd.DataFrame, counts: pd.Series) -> pd.DataFrame:
    """The layers and directions profiled in both `a` and `b` (ncu tables of two configurations), kernel against
    kernel: each metric of both (`<metric>_a`, `<metric>_b`), `sm_cycles_ratio` and `instructions_ratio`
    (a over b), and `step_ms_a`, the time the layer and direction carry in a's step (instances x duration),
    largest first."""
    la, lb = layer_kernels(a), layer_kernels(b)
    m = la.merge(lb, on=["layer", "direction"], suffixes=("_a", "_b"))
    m.insert(2, "instances", m["layer"].map(counts).fillna(1).astype("int64"))
    m["sm_cycles_ratio"] = m["sm_active_cycles_a"] / m["sm_active_cycles_b"]
    m["instructions_ratio"] = m["inst_executed_a"] / m["inst_executed_b"]
    m["step_ms_a"] = m["instances"] * m["duration_ns_a"] / 1e6
    return m.sort_values(["step_ms_a", "layer"], ascending=[False, True], kind="stable").reset_index(drop=True)


def step_weighted(kernels: pd.DataFrame, ncu_df: pd.DataFrame, rates=STEP_RATES, counts=()) -> dict[str, float]:
    """The step as the torch.profiler table has it, its kernels' counters from the ncu launches that stand for
    them (`ncu_names.match_kernel`); kernels without counters are left out, and `covered` says the share of the step
    that has counters. Each of `rates`: every kernel weighted by its share of the step's kernel time, its rate
    the duration-weighted mean over its launches. Each of `counts` (`<count>_per_step`): the kernels' mean per
    launch times their launches per step, summed."""
    nan = {"covered": 0.0, **{r: math.nan for r in rates}, **{f"{c}_per_step": math.nan for c in counts}}
    s = ncu_table.kernel_summary(ncu_df) if not ncu_df.empty else pd.DataFrame()
    if s.empty or kernels.empty:
        return nan
    w = s["duration_ns"].fillna(0)
    cols = {"kernel": s["kernel"], "n": 1.0, **{r: s[r] * w for r in rates},
            **{f"w_{r}": w.where(s[r].notna(), 0) for r in rates}, **{c: s[c] for c in counts}}
    per = pd.DataFrame(cols).groupby("kernel").sum(min_count=1)
    g = kernels.groupby("kernel")
    share, launches = g["share"].sum(), g["calls"].sum() / g["micro_steps"].max().clip(lower=1)
    stands = [(p, k) for k in per.index for p in ncu_names.match_kernel(k, share.index.tolist())]
    if not stands:
        return nan
    pairs = pd.DataFrame(stands, columns=["profiler", "kernel"]).join(per, on="kernel").groupby("profiler").sum(
        numeric_only=True, min_count=1)
    weight = share.reindex(pairs.index)
    out = {"covered": float(weight.sum())}
    for r in rates:
        value = pairs[r] / pairs[f"w_{r}"].where(pairs[f"w_{r}"] > 0)
        ok = value.notna() & (weight > 0)
        out[r] = float(np.average(value[ok], weights=weight[ok])) if ok.any() else math.nan
    for c in counts:
        out[f"{c}_per_step"] = float((pairs[c] / pairs["n"] * launches.reindex(pairs.index)).sum(min_count=1))
    return out
