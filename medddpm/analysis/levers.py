"""Where a step's remaining milliseconds are: its kernels against the roof that binds each, grouped into levers, and
the rule that decides whether a lever measured against `best` wins.

**The roof of a kernel.** A kernel moves DRAM bytes and keeps the tensor pipe busy; its time at the roof is the
larger of its bytes over the card's DRAM bandwidth and its tensor-core FLOPs over the card's dense matmul rate in
the step's precision (the roofline: a pointwise or norm kernel is bound by DRAM, a convolution by the tensor pipe).
Its distance from that roof is its time minus its time at the roof: what the lever that takes it to the roof saves
at most (`max_saving_ms`). Ranking kernels by time multiplied by their relative distance from the roof is ranking
them by that saving.

**Where the work comes from.** Nsight Compute counts the work: DRAM bytes (`dram__bytes`) and the tensor pipe's
active share, which times the SMs' active cycles and the card's dense FLOPs per SM and cycle is the tensor work
(`roofs.Card.tensor_flop_per_sm_cycle`). Each profiled kernel's rates (bytes and FLOPs per second of its profiled
launches) times its time in the torch.profiler table give its work per micro-step (`work_per_step`). Work is a
property of the program, not of the card: another card's kernel table is set against the same work and its own
roofs (`roof_rows`), so a card without counters is ranked from another card's counters. A kernel with no counters
has no known roof: its time is kept (`uncounted_ms`) and no saving is claimed for it.

cuDNN picks its convolution kernels per card and again under the profiler, so a convolution is not matched by name
but by its direction and kernel family (`work_key`: "cuDNN sm90 fprop"). Compiled, CUDA-graphed steps run no layer
ranges, so convolutions are grouped by direction and family, not by layer shape.

**The lever decision** (`paired_verdict`): blocks of timed steps of `best` and its variants, interleaved in one
process (A, B, C, A, B, C, ...). Each variant block is set against the mean of the `best` blocks beside it (the one
before and the one after), which cancels drift in the card's clocks and temperature; the yardstick is how far two
neighbouring `best` blocks lie apart, the spread of the same step measured twice. A lever counts only when its
paired difference is beyond that spread and its numerics hold against strict FP32 as `best`'s do (`parity_held`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from medddpm.analysis import ncu_table
from medddpm.analysis.ncu_names import conv_direction, match_kernel
from medddpm.analysis.roofs import DATASHEET

# ------------------------------------------------------------------------------------------------ the levers

_CUDNN_FAMILY = re.compile(r"^(sm\d+)_xmma_(fprop|dgrad|wgrad)_")
DIRECTION_WORDS = {"fprop": "forward", "dgrad": "input gradient", "wgrad": "weight gradient"}

# (lever, rule on the kernel's name), first match wins; Inductor names a Triton kernel after the operators it fuses
_TRITON_LEVERS = (
    # the output convolution's tap sum and its gradient (TapConv3d: F.pad, then 27 slices or an unfold), and the
    # narrow layers' channel pads (PaddedConv3d)
    ("padding (constant_pad_nd)", re.compile(r"constant_pad_nd")),
    ("separable upsampling", re.compile(r"stack|slice_backward")),
    ("GroupNorm-SiLU backward", re.compile(r"sigmoid")),  # SiLU's derivative
    ("GroupNorm statistics", re.compile(r"var_mean")),
    ("GroupNorm-SiLU forward", re.compile(r"silu|_neg_")),
    ("bias gradients", re.compile(r"convolution_backward")),
    # Inductor peels each convolution's bias off (cuDNN runs without it) and adds it in the next pointwise kernel:
    # alone where the output is kept for the backward, fused with a residual add or a skip's concatenation otherwise
    ("bias adds and skip concatenations", re.compile(r"convolution|cat")),
)
# GroupNorm's own kernels (group_norm="triton"'s, or ATen's in eager steps): the same three levers as Inductor's
_NORM_LEVERS = (
    ("GroupNorm-SiLU backward", re.compile(r"backward|gradients|gammabeta", re.IGNORECASE)),
    ("GroupNorm statistics", re.compile(r"stats|moments", re.IGNORECASE)),
    ("GroupNorm-SiLU forward", re.compile(r"")),  # the rest applies the norm (and the SiLU after it)
)
NARROW_CONVOLUTIONS = "convolutions on sm80 kernels (narrow layers)"


def lever(name: str, category: str) -> str:
    """The lever a kernel belongs to: a group of kernels one change of the program would speed up together."""
    if category == "fused":
        return next((group for group, rule in _TRITON_LEVERS if rule.search(name)), "other fused kernels")
    if category == "normalization":
        return next(group for group, rule in _NORM_LEVERS if rule.search(name))
    if category == "convolution":
        family = _CUDNN_FAMILY.match(name)
        if family and family.group(1) != "sm90":
            return NARROW_CONVOLUTIONS
        direction = conv_direction(name)
        return f"convolution {DIRECTION_WORDS[direction]}" if direction else "cuDNN helpers"
    return {"gemm": "GEMMs (attention projections, output taps)", "attention": "attention (cuDNN SDPA)",
            "optimizer": "Adam"}.get(category, "other")


def work_key(name: str) -> str:
    """The name a kernel's work is known by across cards and profilers: a cuDNN convolution by its family and
    direction ("cuDNN sm90 fprop"), any other kernel by its own name."""
    family = _CUDNN_FAMILY.match(name)
    return f"cuDNN {family.group(1)} {family.group(2)}" if family else name


# ----------------------------------------------------------------------------------------------- the work

def per_step(kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per kernel of a torch.profiler table (passes summed): `ms` and `calls` per micro-step, its
    `category`, `lever` and `key` (`work_key`)."""
    steps = kernels["micro_steps"].max() if len(kernels) else 1
    k = (kernels.groupby(["kernel", "category"], as_index=False)[["total_us", "calls"]].sum()
         .assign(ms=lambda d: d["total_us"] / steps / 1e3, calls=lambda d: d["calls"] / steps))
    k["lever"] = [lever(n, c) for n, c in zip(k["kernel"], k["category"])]
    k["key"] = k["kernel"].map(work_key)
    return k[["kernel", "key", "category", "lever", "calls", "ms"]]


def counter_rates(kernels: pd.DataFrame, ncu: pd.DataFrame, gpu_type: str, precision: str = "bf16") -> pd.DataFrame:
    """Per work key of the profiler's table: the DRAM bytes and tensor-core FLOPs per second of the ncu launches
    that stand for it (their sums over their summed duration), and `launches`. A convolution launch stands for its
    family and direction; any other launch for the profiler's kernel its name matches (`match_kernel`).
    `gpu_type`: the card the counters were taken on (its datasheet's FLOPs per SM and cycle)."""
    cols = ["key", "bytes_per_s", "flops_per_s", "launches"]
    s = ncu_table.kernel_summary(ncu) if not ncu.empty else pd.DataFrame()
    if s.empty or kernels.empty:
        return pd.DataFrame(columns=cols)
    card = DATASHEET.get(gpu_type)
    per_cycle = card.tensor_flop_per_sm_cycle(precision) if card else None
    names = sorted(kernels["kernel"].unique())

    def key(ncu_name: str) -> str | None:
        family = _CUDNN_FAMILY.match(ncu_name)
        if family:
            return work_key(ncu_name)
        hits = match_kernel(ncu_name, names)
        return work_key(hits[0]) if hits else None

    s = s.assign(key=s["kernel"].map(key)).dropna(subset=["key"])
    seconds = s["duration_ns"] / 1e9
    tensor = (s["tensor_pipe_pct"].fillna(0) / 100 * s["sm_active_cycles"] * s["sm_count"] * per_cycle
              if per_cycle else pd.Series(math.nan, index=s.index))
    g = pd.DataFrame({"key": s["key"], "seconds": seconds, "bytes": s["dram_bytes_per_s"] * seconds,
                      "flops": tensor}).groupby("key").agg(seconds=("seconds", "sum"), bytes=("bytes", "sum"),
                                                           flops=("flops", "sum"), launches=("seconds", "size"))
    g = g[g["seconds"] > 0]
    return pd.DataFrame({"key": g.index, "bytes_per_s": (g["bytes"] / g["seconds"]).to_numpy(),
                         "flops_per_s": (g["flops"] / g["seconds"]).to_numpy(),
                         "launches": g["launches"].to_numpy()})[cols]


def work_per_step(steps: pd.DataFrame, rates: pd.DataFrame) -> pd.DataFrame:
    """Per work key: DRAM bytes and tensor FLOPs of one micro-step, its time on the counters' card (`per_step`)
    times its rates there."""
    k = steps.groupby("key", as_index=False)["ms"].sum().merge(rates, on="key", how="inner")
    return pd.DataFrame({"key": k["key"], "bytes": k["ms"] / 1e3 * k["bytes_per_s"],
                         "flops": k["ms"] / 1e3 * k["flops_per_s"]})


@dataclass(frozen=True)
class Roofs:
    """A card's two roofs for the ranking, and where they come from."""

    dram: float  # byte/s
    tensor: float  # FLOP/s, the step's precision
    source: str


def roof_rows(steps: pd.DataFrame, work: pd.DataFrame, roofs: Roofs) -> pd.DataFrame:
    """Per work key of a card's step (`per_step` of its own table): its `ms`, the work (`work_per_step`, from the
    counters of this card or another), the time that work takes at each roof (`dram_ms`, `tensor_ms`), the roof
    that binds (`binds`: the larger), `at_roof_ms` (at most `ms`: a kernel already at its roof saves nothing) and
    `max_saving_ms`. Keys without counters have NaN there."""
    g = steps.groupby(["key", "lever", "category"], as_index=False).agg(ms=("ms", "sum"), calls=("calls", "sum"),
                                                                       kernels=("kernel", "size"))
    g = g.merge(work, on="key", how="left")
    g["dram_ms"] = g["bytes"] / roofs.dram * 1e3
    g["tensor_ms"] = g["flops"].fillna(0) / roofs.tensor * 1e3
    g.loc[g["bytes"].isna(), "tensor_ms"] = math.nan
    g["binds"] = np.where(g["bytes"].isna(), "", np.where(g["tensor_ms"] > g["dram_ms"], "tensor", "DRAM"))
    g["at_roof_ms"] = np.minimum(g[["dram_ms", "tensor_ms"]].max(axis=1, skipna=False), g["ms"])
    g["max_saving_ms"] = g["ms"] - g["at_roof_ms"]
    return g.sort_values("max_saving_ms", ascending=False, na_position="last", ignore_index=True)


LEVER_COLUMNS = ["lever", "ms", "counted_ms", "at_roof_ms", "max_saving_ms", "of_roof", "binds", "uncounted_ms",
                 "kernels"]


def lever_ranking(rows: pd.DataFrame) -> pd.DataFrame:
    """`roof_rows` summed per lever, largest `max_saving_ms` first: `ms` (every kernel), `counted_ms` (those with
    counters), `at_roof_ms` and `max_saving_ms` (over those), `of_roof` (at_roof over counted: how near the roof
    the lever's kernels run), `binds` (DRAM, tensor or both), `uncounted_ms` and `kernels`."""
    counted = rows["at_roof_ms"].notna()
    r = rows.assign(counted_ms=rows["ms"].where(counted, 0.0), uncounted_ms=rows["ms"].where(~counted, 0.0),
                    at_roof_ms=rows["at_roof_ms"].fillna(0.0), max_saving_ms=rows["max_saving_ms"].fillna(0.0))
    r["dram_ms_bound"] = r["counted_ms"].where(rows["binds"] == "DRAM", 0.0)
    r["tensor_ms_bound"] = r["counted_ms"].where(rows["binds"] == "tensor", 0.0)
    g = r.groupby("lever", as_index=False).agg(
        ms=("ms", "sum"), counted_ms=("counted_ms", "sum"), at_roof_ms=("at_roof_ms", "sum"),
        max_saving_ms=("max_saving_ms", "sum"), uncounted_ms=("uncounted_ms", "sum"), kernels=("kernels", "sum"),
        dram=("dram_ms_bound", "sum"), tensor=("tensor_ms_bound", "sum"))
    g["of_roof"] = g["at_roof_ms"] / g["counted_ms"].where(g["counted_ms"] > 0)
    share = g["dram"] / (g["dram"] + g["tensor"]).where(g["dram"] + g["tensor"] > 0)
    g["binds"] = np.select([share.isna(), share >= 0.9, share <= 0.1], ["", "DRAM", "tensor"], "DRAM and tensor")
    g = g.sort_values(["max_saving_ms", "ms"], ascending=False, ignore_index=True)
    return g[LEVER_COLUMNS]


def rank_step(kernels: pd.DataFrame, counted_on: pd.DataFrame, ncu: pd.DataFrame, counters_gpu_type: str,
              roofs: Roofs, precision: str = "bf16") -> tuple[pd.DataFrame, pd.DataFrame]:
    """A card's step ranked: (`roof_rows`, `lever_ranking`). `kernels` is the card's torch.profiler table;
    `counted_on` the table of the run whose Nsight Compute table `ncu` is (the same table where the card has
    counters of its own), taken on a card of type `counters_gpu_type`."""
    counters_steps = per_step(counted_on)
    work = work_per_step(counters_steps, counter_rates(counted_on, ncu, counters_gpu_type, precision))
    rows = roof_rows(per_step(kernels), work, roofs)
    return rows, lever_ranking(rows)


def by_lever(kernels: pd.DataFrame, key: str = "run_id") -> pd.DataFrame:
    """Milliseconds per micro-step of each lever (rows) in each of several runs' kernel tables (columns: `key`)."""
    parts = {run: per_step(k).groupby("lever")["ms"].sum() for run, k in kernels.groupby(key, sort=False)}
    return pd.DataFrame(parts).fillna(0.0)


# ------------------------------------------------------------------------------------------- the decision

VERDICTS = ("faster", "slower", "not told apart")


def paired_differences(blocks: pd.DataFrame, base: str, variant: str) -> pd.Series:
    """Per block of `variant`: its time minus the mean of the `base` blocks beside it in the call's order (the
    nearest before and the nearest after; one at either end). `blocks`: `config`, `position` (order in the call)
    and `block_ms` (a block's median step)."""
    b = blocks[blocks["config"] == base].sort_values("position")
    v = blocks[blocks["config"] == variant].sort_values("position")
    out = {}
    for r in v.itertuples():
        before, after = b[b["position"] < r.position].tail(1), b[b["position"] > r.position].head(1)
        near = pd.concat([before, after])["block_ms"]
        if len(near):
            out[r.position] = r.block_ms - near.mean()
    return pd.Series(out, dtype="float64")


def repeat_spread(blocks: pd.DataFrame, base: str) -> float:
    """The yardstick: the largest difference between two neighbouring blocks of `base` (the same step, measured
    twice one round apart); NaN with fewer than two blocks."""
    ms = blocks[blocks["config"] == base].sort_values("position")["block_ms"].to_numpy()
    return float(np.abs(np.diff(ms)).max()) if len(ms) > 1 else math.nan


def paired_verdict(blocks: pd.DataFrame, base: str, variant: str) -> dict:
    """`diff_ms` (median paired difference, variant minus base: below 0 is faster), `spread_ms` (`repeat_spread`),
    `pairs`, and `verdict`: "faster" or "slower" when the median paired difference is beyond the spread, else
    "not told apart" (also with no spread to judge by)."""
    d = paired_differences(blocks, base, variant)
    spread = repeat_spread(blocks, base)
    diff = float(d.median()) if len(d) else math.nan
    if math.isnan(diff) or math.isnan(spread):
        verdict = "not told apart"
    else:
        verdict = "faster" if diff < -spread else "slower" if diff > spread else "not told apart"
    return {"diff_ms": diff, "spread_ms": spread, "pairs": len(d), "verdict": verdict}


PARITY_FACTOR = 2.0  # a lever may move the numerics against strict FP32 at most this much past best's own
# ... or up to this relative difference, whatever the base's: float32's rounding of another order of summation
# (1e-7 to 1e-6) passes, bf16's (about 4e-3) does not
PARITY_FLOOR = 1e-5


def parity(quality: pd.DataFrame) -> pd.Series:
    """One quality table's forward error (`rel_err`) and mean relative loss difference (`loss_diff`) against
    strict FP32."""
    loss = (quality["loss"] - quality["baseline_loss"]).abs().mean() / quality["baseline_loss"].abs().mean()
    return pd.Series({"rel_err": float(quality["rel_err"].iloc[0]), "loss_diff": float(loss)})


def parity_held(variant: pd.DataFrame, base: pd.DataFrame, factor: float = PARITY_FACTOR,
                floor: float = PARITY_FLOOR) -> bool:
    """Whether a variant's numerics against strict FP32 stay within `factor` of the base's, both measured from the
    same weights, data and noise: its forward error and its mean relative loss difference each, at most `factor`
    times the base's or `floor`, whichever is larger."""
    v, b = parity(variant), parity(base)
    ok = [v[m] <= max(factor * b[m], floor) for m in ("rel_err", "loss_diff")]
    return bool(all(ok) and np.isfinite(v.to_numpy()).all())


def lever_counts(verdict: dict, held: bool | None) -> bool:
    """A lever counts when it is faster beyond the spread of the repeats and its parity held (None: not measured,
    which does not count)."""
    return verdict["verdict"] == "faster" and held is True
