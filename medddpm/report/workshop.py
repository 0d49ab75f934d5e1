"""What the workshop's exercises compute (book/workshop.md): each function measures or reads something
real, small enough for a CPU, and measures the GPU instead where one is present.

- `conv_precision`: one Conv3d forward under each FP32 math mode the device has (strict FP32, TF32 on
  an NVIDIA GPU, bf16 autocast), its error against a float64 reference and its time.
- `channels_last_pairs`, `profile_conv_layouts`: where layout-conversion kernels appear, in the
  committed profiles and in a profile of one convolution made now.
- `stall_table`: Nsight Compute's warp-stall breakdown per kernel, with its dominant reason and a
  reading of it.
- `efficiencies`, `matmul_tflops`, `gpu_hours`, `cost_estimates`, `here_estimates`: fraction of peak reached by
  the measured GPUs (the book's one figure per card, `roofs.step_efficiency`), a device's dense matmul throughput
  measured now, and the training cost that follows, a measured step carried to another device by the ratio of
  two peaks of one source.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from medddpm import report
from medddpm.analysis import roofs as ar
from medddpm.configs import Config, set_precision_flags
from medddpm.report.safe import code, md
from medddpm.train.timing import summarize, time_steps

# Unit roundoff 2^-p of each format (p = stored mantissa bits + 1): inputs rounded to the format are
# off by at most this, relatively. TF32 keeps FP32's exponent and 10 mantissa bits; bf16 keeps 7.
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "tf32": 2.0 ** -11, "bf16": 2.0 ** -8}
# Switches that make two runs comparable apart from their memory layout (Config's, less the layout).
_SWITCHES = tuple(k for k in Config("x").flags if k != "channels_last")


def _device(device) -> torch.device:
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


# ----------------------------------------------------------------------------------- precision


def precision_modes(device: torch.device | str) -> list[str]:
    """The FP32 math modes this device has: TF32 only on an NVIDIA GPU."""
    return ["fp32", "tf32", "bf16"] if torch.device(device).type == "cuda" else ["fp32", "bf16"]


def conv_precision(*, channels: int | None = None, size: int | None = None, device=None, repeats: int = 5,
                   seed: int = 0) -> pd.DataFrame:
    """One Conv3d(channels, channels, 3) forward on a (1, channels, size^3) input under each math mode
    of the device: relative L2 error against the same convolution in float64, and the median time of one
    forward (`conv_median_ms`, from `medddpm.train.timing`: a warm-up call, then `repeats` timed ones).
    Small by default on a CPU (32 channels, 24^3), larger on a GPU (64 channels, 48^3)."""
    device = _device(device)
    cuda = device.type == "cuda"
    channels = channels or (64 if cuda else 32)
    size = size or (48 if cuda else 24)
    if channels < 1 or size < 3 or repeats < 1:
        raise ValueError(f"need channels >= 1, size >= 3, repeats >= 1; got {channels}, {size}, {repeats}")
    g = torch.Generator().manual_seed(seed)
    conv = torch.nn.Conv3d(channels, channels, 3, padding=1)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(27 * channels))
    x = torch.randn(1, channels, size, size, size, generator=g)
    conv, x = conv.to(device), x.to(device)
    with torch.no_grad():
        ref = torch.nn.functional.conv3d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    flops = 2 * 27 * channels * channels * size ** 3
    saved = None
    if cuda:
        saved = (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
                 torch.backends.cudnn.rnn.fp32_precision, torch.backends.cudnn.benchmark)
    rows = []
    try:
        for mode in precision_modes(device):
            if cuda:
                set_precision_flags("fp32" if mode == "fp32" else "tf32")

            def run(mode=mode):
                with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16"):
                    return conv(x)

            y = run()
            err = float((y.double() - ref).norm() / ref.norm())
            timing = time_steps(run, device=device, warmup=1, steps=repeats, progress=False)
            med = summarize(timing["step_ms"])["median"]
            rows.append({"mode": mode, "output dtype": str(y.dtype).removeprefix("torch."), "rel_err": err,
                         "unit_roundoff": UNIT_ROUNDOFF[mode], "conv_median_ms": med, "gflop_per_s": flops / med / 1e6})
    finally:
        if saved is not None:
            (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
             torch.backends.cudnn.rnn.fp32_precision, torch.backends.cudnn.benchmark) = saved
    out = pd.DataFrame(rows)
    out.attrs.update(device=str(device), channels=channels, size=size, flops=flops, repeats=repeats)
    return out


PRECISION_CONFIGS = {"baseline": "fp32", "opt1": "tf32", "bf16": "bf16"}  # one configuration per math mode


def precision_step_times(data: report.Data) -> pd.DataFrame:
    """Median training micro-step time of strict FP32, TF32 and bf16 (the configurations baseline,
    opt1 and bf16) on every device in the data: the sweep's where it ran, else the bench timings'."""
    ok = data.ok
    bench = data.bench[data.bench["implementation"] == "ours"] if not data.bench.empty else data.bench
    slugs = sorted(set(ok["gpu_slug"]) | set(bench["gpu_slug"] if len(bench) else []))
    rows = []
    for slug in slugs:
        for config, mode in PRECISION_CONFIGS.items():
            r = ok[(ok["gpu_slug"] == slug) & (ok["config"] == config)]
            if len(r):
                r = r.iloc[0]
                rows.append({"gpu_slug": slug, "config": config, "mode": mode, "ran_as": r["precision_used"],
                             "size": int(r["size"]), "train_median_ms": float(r["train_median_ms"]),
                             "source": "sweep"})
                continue
            b = bench[(bench["gpu_slug"] == slug) & (bench["config"] == config)] if len(bench) else bench
            if len(b):
                ran = {"ieee": "fp32", "tf32": "tf32"}.get(b["fp32_math"].iloc[0], mode)
                rows.append({"gpu_slug": slug, "config": config, "mode": mode, "ran_as": ran,
                             "size": int(b["size"].iloc[0]), "train_median_ms": float(b["train_median_ms"].median()),
                             "source": f"bench ({', '.join(sorted(b['source'].unique()))})"})
    out = pd.DataFrame(rows, columns=["gpu_slug", "config", "mode", "ran_as", "size", "train_median_ms", "source"])
    base = out[out["config"] == "baseline"].set_index("gpu_slug")["train_median_ms"]
    out["speedup_vs_fp32"] = out["gpu_slug"].map(base) / out["train_median_ms"]
    return out


# -------------------------------------------------------------------------------------- layout


def channels_last_pairs(run: pd.DataFrame) -> pd.DataFrame:
    """Each finished channels-last run beside the run of the same GPU whose other switches are equal
    (opt2 with baseline, opt12 with opt1, bf16-cl with bf16, ...), whichever of them the data holds."""
    ok = run[run["status"] == "ok"]
    switches = [s for s in _SWITCHES if s in ok.columns]  # older run tables lack newer switches
    rows = []
    for _, cl in ok[ok["channels_last"]].iterrows():
        same = ok[(ok["gpu_slug"] == cl["gpu_slug"]) & ~ok["channels_last"]]
        for s in switches:
            same = same[same[s] == cl[s]]
        for _, other in same.iterrows():
            rows.append({"gpu_slug": cl["gpu_slug"], "channels_last": cl["config"], "partner": other["config"],
                         "cl_run_id": cl["run_id"], "partner_run_id": other["run_id"]})
    return pd.DataFrame(rows, columns=["gpu_slug", "channels_last", "partner", "cl_run_id", "partner_run_id"])


def layout_share(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per run: share of profiled kernel time in the `layout` category and its launches per step."""
    k = kernels.assign(layout=kernels["category"] == "layout",
                       cps=kernels["calls"] / kernels["micro_steps"].clip(lower=1))
    g = k.groupby(["run_id", "gpu_slug", "config"], as_index=False).apply(
        lambda d: pd.Series({"layout_share": d.loc[d["layout"], "share"].sum(),
                             "layout_calls_per_step": d.loc[d["layout"], "cps"].sum(),
                             "device_type": d["device_type"].iloc[0]}), include_groups=False)
    return report._sort(g)


def profile_conv_layouts(*, channels: int | None = None, size: int | None = None, device=None,
                         steps: int = 2) -> pd.DataFrame:
    """torch.profiler rows of one Conv3d forward + backward, once with NCDHW tensors and once with
    channels-last (NDHWC) ones; `memory_format` says which. Kernels on a GPU, aten operators on a CPU."""
    from medddpm.train.profiling import profile_kernels

    device = _device(device)
    cuda = device.type == "cuda"
    channels = channels or (64 if cuda else 32)
    size = size or (48 if cuda else 24)
    parts = []
    for name, fmt in (("NCDHW", torch.contiguous_format), ("NDHWC (channels-last)", torch.channels_last_3d)):
        torch.manual_seed(0)
        conv = torch.nn.Conv3d(channels, channels, 3, padding=1).to(device, memory_format=fmt)
        x = torch.randn(1, channels, size, size, size, device=device).to(memory_format=fmt).requires_grad_()

        def step(conv=conv, x=x):
            conv(x).square().mean().backward()

        parts.append(profile_kernels(step, device=device, steps=steps).assign(memory_format=name))
    out = pd.concat(parts, ignore_index=True)
    out.attrs.update(device=str(device), channels=channels, size=size)
    return out


# -------------------------------------------------------------------------------------- stalls

# What a warp waiting for each reason is waiting on (Nsight Compute's warp-state documentation).
STALL_MEANING = {
    "long_scoreboard": "a global or local memory result (L1TEX: L2 or DRAM)",
    "short_scoreboard": "a shared-memory or special-function (MIO) result",
    "barrier": "the other warps of its block at a barrier (__syncthreads)",
    "membar": "a memory barrier",
    "mio_throttle": "a full shared-memory / special-function instruction queue",
    "lg_throttle": "a full local/global memory instruction queue",
    "math_pipe_throttle": "a busy math pipe",
    "tex_throttle": "a full texture unit",
    "not_selected": "nothing: it was eligible, another warp was picked",
    "selected": "nothing: it issued",
    "wait": "a fixed-latency dependency",
    "dispatch_stall": "the dispatcher",
    "no_instruction": "instruction fetch (an instruction-cache miss or a branch)",
    "drain": "its memory stores to drain at exit",
    "sleeping": "a sleep or a yield",
    "imc_miss": "the immediate-constant cache",
    "branch_resolving": "a branch target",
    "misc": "something else",
    "gmma": "a warpgroup MMA (Hopper tensor cores)",
}
BANDWIDTH_BOUND_DRAM = 60.0  # DRAM throughput (% of peak) above which a memory-stalled kernel is bandwidth-bound
LOW_OCCUPANCY = 40.0  # achieved occupancy (% of the SM's warp slots) below which latency cannot be hidden


def reading(dominant: str, dram_pct: float, occupancy_pct: float) -> str:
    """A first reading of a stall breakdown (a rule of thumb, thresholds above)."""
    if dominant == "long_scoreboard":
        if dram_pct >= BANDWIDTH_BOUND_DRAM:
            return "bandwidth-bound: memory is busy, the kernel waits for it"
        if occupancy_pct < LOW_OCCUPANCY:
            return "latency-bound: waits on memory with too few warps in flight to hide it, DRAM mostly idle"
        return "waits on memory (cache misses) without saturating DRAM"
    if dominant in ("math_pipe_throttle", "gmma"):
        return "compute-bound on one pipe"
    if dominant in ("not_selected", "selected"):
        return "issue-bound: warps are ready, the scheduler is the limit"
    if dominant == "barrier":
        return "synchronization-bound: warps idle at block barriers"
    return f"waits on {STALL_MEANING.get(dominant, dominant)}"


def stall_table(ncu_df: pd.DataFrame, *, top: int = 8) -> pd.DataFrame:
    """Per run and kernel (by short name, launches weighted by duration), the `top` kernels by profiled
    time: stall cycles per issued instruction by reason, their sum, the dominant reason and a reading."""
    from medddpm.analysis.kernels import categorize, short_name

    k = report.ncu_kernels(ncu_df)
    stalls = [c for c in k.columns if c.startswith("stall_")]
    cols = ["gpu_slug", "config", "kernel", "category", "launches", "profiled_ms", "warp_cycles_per_inst",
            "sum_of_stalls", "dominant", "dominant_cycles", "dram_throughput_pct", "achieved_occupancy_pct",
            "sm_throughput_pct", "reading", *stalls]
    if k.empty or not stalls:
        return pd.DataFrame(columns=cols)
    k = k.assign(kernel=k["kernel"].map(short_name), category=k["kernel"].map(categorize))
    keys = ["gpu_slug", "config", "kernel"]
    w = k["duration_ns"].fillna(0)
    # each figure averaged over a kernel's launches that have it, weighted by their durations (np.average's)
    averaged = ["warp_cycles_per_inst", "dram_throughput_pct", "achieved_occupancy_pct", "sm_throughput_pct", *stalls]
    has = {c: k[c].notna() & (w > 0) for c in averaged}
    weighted = pd.DataFrame({c: (k[c] * w).where(has[c], 0.0) for c in averaged}).groupby([k[c] for c in keys]).sum()
    weights = pd.DataFrame({c: w.where(has[c], 0.0) for c in averaged}).groupby([k[c] for c in keys]).sum()
    groups = k.groupby(keys).agg(category=("category", "first"), launches=("kernel", "size"))
    groups["profiled_ms"] = w.groupby([k[c] for c in keys]).sum() / 1e6
    groups = groups.join((weighted / weights).where(weights > 0))
    rows = []
    for (slug, config, name), g in groups[groups["profiled_ms"] > 0].to_dict("index").items():
        row = {"gpu_slug": slug, "config": config, "kernel": name, **g, "launches": int(g["launches"]),
               **{c: float(g[c]) for c in averaged}}
        breakdown = {c.removeprefix("stall_"): row[c] for c in stalls if not math.isnan(row[c])}
        if not breakdown:
            continue
        row["sum_of_stalls"] = sum(breakdown.values())
        row["dominant"] = max(breakdown, key=breakdown.get)
        row["dominant_cycles"] = breakdown[row["dominant"]]
        row["reading"] = reading(row["dominant"], row["dram_throughput_pct"], row["achieved_occupancy_pct"])
        rows.append(row)
    out = pd.DataFrame(rows, columns=cols)
    out = out.sort_values(["gpu_slug", "config", "profiled_ms"], ascending=[True, True, False])
    return out.groupby(["gpu_slug", "config"]).head(top).reset_index(drop=True)


# ---------------------------------------------------------------------------------------- cost


EFFICIENCY_CONFIGS = {"fp32": "baseline", "tf32": "opt1", "bf16": "bf16", "fp16": "fp16"}
MICRO_STEPS = report.REFERENCE_STEPS * report.REFERENCE_ACCUM  # the reference's training: 100,000 optimizer steps


def efficiencies(data: report.Data) -> pd.DataFrame:
    """Per GPU and precision it ran: the efficiency of a training micro-step in that precision (strict FP32 = the
    baseline; TF32 = opt1; bf16 = the bf16 configuration; fp16 = the fp16 one), the figure the whole book prints
    for it (`roofs.step_efficiency`: the step's FLOPs over its median time, over the card's roof on the book's
    basis), from the sweep, else from the bench timings."""
    e = report.step_efficiency(data)
    e = e[e["gpu_slug"].isin(gpus_in(data))]
    e = e[[EFFICIENCY_CONFIGS.get(p) == c for p, c in zip(e["precision"], e["config"])]]
    return e[["gpu_slug", "precision", "config", "timing", "train_median_ms", "flops_per_step", "achieved_tflops",
              "peak_tflops", "efficiency", "basis", "peak_source"]].reset_index(drop=True)


EFFICIENCY_SHOWN = {"gpu_slug": "card", "precision": "precision", "config": "configuration", "train_median_ms": "ms",
                    "achieved_tflops": "achieved TFLOP/s", "peak_tflops": "peak TFLOP/s", "efficiency": "efficiency"}


def efficiency_table(eff: pd.DataFrame) -> pd.DataFrame:
    """`efficiencies` as the page shows it (`EFFICIENCY_SHOWN`): the roofs' source is said once above it."""
    return eff[list(EFFICIENCY_SHOWN)].rename(columns=EFFICIENCY_SHOWN)


def carried_ms(step_ms: float, peak_from: float, peak_to: float) -> float:
    """A step carried from one device to another at the same fraction of each one's peak: its time x the peak of
    the device it ran on / the other's. Both peaks come from one source (both datasheets, or both measured), the
    only way the fraction carries: a measured roof lies below its datasheet, so a step read against one and
    carried to the other would come back shorter than it ran."""
    if not (step_ms > 0 and peak_from > 0 and peak_to > 0):
        raise ValueError(f"need a step and two peaks > 0; got {step_ms}, {peak_from}, {peak_to}")
    return step_ms * peak_from / peak_to


def step_hours(step_ms: float, micro_steps: int = MICRO_STEPS) -> float:
    """Device hours for `micro_steps` training micro-steps of `step_ms` each."""
    return micro_steps * step_ms / 1e3 / 3600


def cost_estimates(eff: pd.DataFrame, data: report.Data, cards=ar.PAPER_CARDS, precision: str = "fp32") -> pd.DataFrame:
    """Exercise 4's estimates: the reference's training (100,000 optimizer steps of two micro-steps) on each of
    `cards` (device types), from each measured GPU's step in `precision` (`efficiencies`) carried by the ratio of
    the two cards' datasheet peaks (`carried_ms`): the paper's cards are known by their datasheets, so the measured
    card's peak is its datasheet's too, whichever roofs the book reads it against. Where the data holds a run of
    the estimated card, its measured hours stand beside the estimate; `own` marks the estimate made from that
    card's own step, which gives them back."""
    mine = eff[eff["precision"] == precision]
    types = report.gpu_types(data.run, data.roofs)
    measured = {types.get(r.gpu_slug, r.gpu_slug): r.train_median_ms for r in mine.itertuples()}
    cols = ["GPU", "gpu_type", "from", "its step (ms)", "peak ratio", "estimated hours", "measured hours", "own"]
    rows = []
    for r in mine.itertuples():
        kind = types.get(r.gpu_slug, r.gpu_slug)
        peak_from = ar.DATASHEET[kind].roofs.get(precision) if kind in ar.DATASHEET else None
        if peak_from is None:  # no datasheet peak to carry the step from
            continue
        for card in cards:
            peak = ar.DATASHEET[card].roofs.get(precision)
            if peak is None:
                continue
            rows.append(dict(zip(cols, [
                ar.DATASHEET[card].name.removeprefix("NVIDIA "), card, r.gpu_slug, r.train_median_ms, peak_from / peak,
                step_hours(carried_ms(r.train_median_ms, peak_from, peak)),
                step_hours(measured[card]) if card in measured else math.nan, kind == card])))
    return pd.DataFrame(rows, columns=cols)


def check_estimates(estimates: pd.DataFrame) -> None:
    """Every estimate is positive, and a card estimated from its own step gets back its measured hours."""
    assert (estimates["estimated hours"] > 0).all(), estimates
    own = estimates[estimates["own"]]
    assert np.allclose(own["estimated hours"], own["measured hours"], rtol=1e-9), own


def here_estimates(eff: pd.DataFrame, data: report.Data, rates: dict[str, float]) -> pd.DataFrame:
    """The reference's training on the device that runs the page, from the dense matmul rate measured on it now
    (`rates`: precision -> TFLOP/s, `matmul_tflops`): each measured GPU's step in that precision carried by the
    ratio of that GPU's own measured roof (a large matmul too, `python -m medddpm roofs`) to the rate here
    (`carried_ms`), measured against measured. A GPU without its own measured roof in that precision carries
    nothing here."""
    cols = ["precision", "matmul TFLOP/s here", "from", "its step (ms)", "its measured roof TFLOP/s",
            "estimated hours here"]
    rows = []
    for r in eff[eff["precision"].isin(list(rates))].itertuples():
        roof = ar.own_roofs(data.roofs, r.gpu_slug).get(r.precision)
        if roof is None:
            continue
        here = rates[r.precision]
        rows.append(dict(zip(cols, [r.precision, here, r.gpu_slug, r.train_median_ms, roof.value / 1e12,
                                    step_hours(carried_ms(r.train_median_ms, roof.value, here * 1e12))])))
    return pd.DataFrame(rows, columns=cols)


def profiled_counts(data: report.Data, table: str = "kernels") -> pd.DataFrame:
    """How many rows each run has in a profile `table` ("kernels": kernels and operators; "ncu": launches with
    counters), a row per configuration and a column per device: the count, "none" where the run has no such
    rows, and "not run" where the device never ran the configuration. A zero would read as a measurement."""
    ok = data.ok[data.ok["batch"] == 1]
    frame = getattr(data, table)
    frame = frame[frame["run_id"].isin(set(ok["run_id"]))]
    n = frame.groupby("run_id")["kernel_id"].nunique() if table == "ncu" else frame.groupby("run_id").size()
    devices = report.tables.gpus_first(ok["gpu_slug"])
    configs = [c for c in report.config_order(ok["config"]) if c in set(ok["config"])]
    out = pd.DataFrame("not run", index=pd.Index(configs, name="configuration"), columns=devices, dtype=object)
    for r in ok.itertuples():
        out.loc[r.config, r.gpu_slug] = str(int(n[r.run_id])) if r.run_id in n.index else "none"
    return out.reset_index()


def gpu_hours(*, flops_per_step: float, peak_flops: float, efficiency: float,
              micro_steps: int = MICRO_STEPS) -> float:
    """Device hours for `micro_steps` training micro-steps at `efficiency` x `peak_flops`."""
    if not (peak_flops > 0 and 0 < efficiency <= 1 and flops_per_step > 0):
        raise ValueError(f"need peak > 0, 0 < efficiency <= 1, flops > 0; got {peak_flops}, {efficiency}, "
                         f"{flops_per_step}")
    return micro_steps * flops_per_step / (efficiency * peak_flops) / 3600


def matmul_tflops(*, device=None, dtype: torch.dtype = torch.float32, n: int | None = None,
                  repeats: int = 5) -> float:
    """Dense (n x n) @ (n x n) throughput measured now, TFLOP/s (median of `repeats`). Strict FP32 on a
    GPU: TF32 is turned off for the measurement and restored after it."""
    device = _device(device)
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    saved = torch.backends.cuda.matmul.fp32_precision if cuda else None
    try:
        if cuda:
            torch.backends.cuda.matmul.fp32_precision = "ieee"
        timing = time_steps(lambda: a @ b, device=device, warmup=2, steps=repeats, progress=False)
    finally:
        if saved is not None:
            torch.backends.cuda.matmul.fp32_precision = saved
    return 2 * n ** 3 / (summarize(timing["step_ms"])["median"] / 1e3) / 1e12


# ------------------------------------------------------------------------------------ the page's answers

def gpus_in(data: report.Data) -> list[str]:
    """The GPUs the data holds: swept ones (their runs are not a CPU's) and those with bench timings only."""
    return sorted(set(data.run.loc[data.run["gpu_name"] != "cpu", "gpu_slug"]) | set(data.bench["gpu_slug"]))


def precision_text(prec: pd.DataFrame, device: torch.device) -> str:
    """Exercise 1's answer on this device: each mode's error in units of its own roundoff, and its time against
    strict FP32's."""
    p = prec.set_index("mode")
    ratio = p["rel_err"] / p["unit_roundoff"]
    a = prec.attrs
    reduced = [m for m in p.index if m != "fp32"]
    lines = [f"- **Error.** Strict FP32 is off by {ratio['fp32']:.2g} u: its inputs are exact, and the error is the "
             f"rounding of {27 * a['channels']:,} products and their sum in FP32, which partly cancels. "
             + "; ".join(f"{m} is off by {ratio[m]:.2g} u of its own format" for m in reduced)
             + ": rounding the inputs to the narrower format sets the error, and the FP32 accumulation adds little "
               "to it."]
    for mode in reduced:
        speed = p.loc["fp32", "conv_median_ms"] / p.loc[mode, "conv_median_ms"]
        lines.append(f"- **Time, {mode}.** {p.loc[mode, 'conv_median_ms']:.3g} ms against "
                     f"{p.loc['fp32', 'conv_median_ms']:.3g} ms for strict FP32 on {a['device']} ({a['channels']} "
                     f"channels, {a['size']}³): "
                     + (f"{speed:.2f}x faster." if speed >= 1 else f"{1 / speed:.2f}x slower."))
    if torch.device(device).type == "cpu":
        lines.append("- On a CPU, bf16 is fast only where the processor has bf16 instructions (oneDNN uses them), "
                     "and a shared CPU times noisily: run the cell again and compare.")
    return "\n".join(lines)


def step_speedup_text(gpu_steps: pd.DataFrame) -> str:
    """Per GPU: how much faster TF32 and bf16 make the whole step than strict FP32, and why less than the
    convolutions alone."""
    lines = []
    for slug, g in gpu_steps.groupby("gpu_slug"):
        g = g.set_index("config")
        for config, label in (("opt1", "TF32"), ("bf16", "bf16")):
            if config in g.index and "baseline" in g.index and g.loc[config, "ran_as"] == PRECISION_CONFIGS[config]:
                lines.append(f"- **{md(slug)}**: {label} makes the step {g.loc[config, 'speedup_vs_fp32']:.2f}x faster "
                             f"than strict FP32 ({g.loc[config, 'train_median_ms']:.4g} vs "
                             f"{g.loc['baseline', 'train_median_ms']:.4g} ms).")
    if not lines:
        return "The data holds no GPU step with both strict FP32 and a faster mode yet."
    return ("\n".join(lines) + "\n\nOn the GPU, strict FP32 convolutions run on the FMA pipes and TF32 or bf16 ones "
            "on tensor cores, a different unit with several times the throughput. The step gains less than its "
            "convolutions do, because its normalization, element-wise and layout kernels (exercise 2) run on neither.")


def layout_text(kernels: pd.DataFrame, gpu_layout: pd.DataFrame) -> str:
    """Exercise 2's answer in the committed profiles: each GPU run's layout share, launches and largest layout
    kernels, and whether cuDNN converts layouts around its tensor-core convolutions."""
    if gpu_layout.empty:
        return ("The data holds no GPU kernel profile yet: only aten operators on a CPU, where `copy_` and friends "
                "are the layout work.")
    lines = []
    for r in gpu_layout.sort_values("layout_share", ascending=False).itertuples():
        k = kernels[(kernels["run_id"] == r.run_id) & (kernels["category"] == "layout")]
        top = (k.assign(us=k["total_us"] / k["micro_steps"].clip(lower=1)).groupby("short_name")["us"].sum()
               .sort_values(ascending=False))
        assert len(top), r
        lines.append(f"- **{md(r.gpu_slug)}** {code(r.config)}: {r.layout_share:.0%} of the kernel time, "
                     f"{r.layout_calls_per_step:.0f} launches per step; largest: "
                     + ", ".join(f"{code(n)} ({us / 1e3:.2f} ms per step)" for n, us in top.head(3).items()) + ".")
    names = " ".join(kernels.loc[kernels["device_type"] == "cuda", "kernel"])
    cudnn = "nchwToNhwc" in names or "nhwcToNchw" in names
    return "\n".join(lines) + (
        "\n\nThese runs keep the model in NCDHW, yet their profiles hold cuDNN's `nchwToNhwcKernel` and "
        "`nhwcToNchwKernel`: cuDNN converts the tensors to channels-last around its tensor-core convolutions "
        "and back after them, on every call." if cudnn else "")


def pairs_text(pairs: pd.DataFrame, gpus: list[str]) -> str:
    """Each channels-last run's layout share against its partner's, and the GPUs with no such pair yet."""
    lines = [f"- **{md(r.gpu_slug)}**: {code(r.channels_last)} {r.cl_share:.1%} against {code(r.partner)} "
             f"{r.partner_share:.1%} ({(r.cl_share - r.partner_share) * 100:+.1f} points)" for r in pairs.dropna().itertuples()]
    missing = [g for g in gpus if g not in set(pairs["gpu_slug"])]
    if missing:
        lines.append(f"- {md(', '.join(missing))}: no channels-last profile with a partner in the data yet "
                     "(`python -m medddpm sweep --preset paper --configs paper` measures opt2 and opt12).")
    return ("\n".join(lines) + "\n\nThe paper saw channels-last *move* time into small element-wise and layout "
            "kernels rather than remove it: compare the layout share of each pair above, and the kernel names in its "
            "channels-last profile.")


def check_stalls(st: pd.DataFrame) -> None:
    """Stall cycles are never negative, and the reasons add up to the cycles per issued instruction (Nsight
    Compute's own identity), within 15%."""
    stall_cols = [c for c in st.columns if c.startswith("stall_")]
    assert (st[stall_cols].fillna(0) >= 0).all().all(), st
    both = st.dropna(subset=["warp_cycles_per_inst"])
    assert np.allclose(both["sum_of_stalls"], both["warp_cycles_per_inst"], rtol=0.15), both[
        ["kernel", "sum_of_stalls"]]


def stalls_text(st: pd.DataFrame) -> str:
    """Exercise 3's answer: each kernel's dominant stall and reading, which columns tell latency from bandwidth,
    and which kernels more thread blocks would help."""
    lines = [f"- {code(r.kernel)} ({md(r.gpu_slug)} {code(r.config)}, {r.profiled_ms:.2f} ms profiled): "
             f"{md(r.dominant.replace('_', ' '))} {r.dominant_cycles:.1f} of {r.warp_cycles_per_inst:.1f} cycles; "
             f"DRAM {r.dram_throughput_pct:.0f}%, occupancy {r.achieved_occupancy_pct:.0f}%: *{md(r.reading)}*."
             for r in st.itertuples()]
    latency = st[st["reading"].str.startswith("latency-bound")]
    bandwidth = st[st["reading"].str.startswith("bandwidth-bound")]
    text = "\n".join(lines) + (
        f"\n\nDRAM throughput and achieved occupancy tell the two apart (rule of thumb: DRAM at least "
        f"{BANDWIDTH_BOUND_DRAM:.0f}% is bandwidth-bound; occupancy under {LOW_OCCUPANCY:.0f}% with DRAM idle is "
        "latency-bound). ")
    if len(latency):
        text += ("More thread blocks would help the latency-bound ones: "
                 + ", ".join(code(k) for k in latency["kernel"].unique())
                 + ". Their warps wait on memory that is mostly idle, because there are too few of them to cover its "
                   "latency. ")
        if (latency["category"] == "normalization").any():
            text += ("PyTorch's GroupNorm statistics kernels launch one block per (sample, group): 32 blocks at "
                     "batch 1 with 32 groups, fewer than the GPU has SMs (132 on an H200). ")
    if len(bandwidth):
        text += ("The bandwidth-bound ones (" + ", ".join(code(k) for k in bandwidth["kernel"].unique())
                 + ") would not get faster with more blocks, only with fewer bytes: fusion, or a smaller dtype.")
    return text


def estimates_text(estimates: pd.DataFrame, names: dict[str, str] | None = None) -> str:
    """Exercise 4's estimates in hours and days, per card whose step they carry, each against the measured hours
    where the estimated card is the measured one; and the weakest assumption behind them."""
    names = names or {}
    lines = []
    for src, g in estimates.groupby("from", sort=False):
        parts = []
        for _, r in g.iterrows():
            h, m = r["estimated hours"], r["measured hours"]
            part = f"{r['GPU']}: {h:,.1f} h ({h / 24:.1f} days)"
            if r["own"]:
                part += f", the {m:,.1f} h its own measured step gives"
            elif pd.notna(m):
                part += f", against {m:,.1f} h from its measured step ({h / m - 1:+.1%})"
            parts.append(part)
        lines.append(f"- From the **{md(names.get(src, src))}**'s step: " + "; ".join(parts) + ".")
    return ("\n".join(lines) + "\n"
            "- The weakest assumption is that the fraction of the peak carries over. It is a property of the GPU as "
            "much as of the model: the memory-bound kernels of a step (exercise 3) follow memory bandwidth, not the "
            "FLOP peak, and the ratio of the two, the cache sizes and the convolution kernels cuDNN has differ from "
            "one GPU to the next. The estimate is a first guess, to check against one measured step on the new GPU.")


def here_text(here: pd.DataFrame, device: torch.device, names: dict[str, str] | None = None) -> str:
    """What the reference's training would take on the device that runs the page, at the measured matmul rate:
    from the first GPU's step that `here_estimates` carries here."""
    r = here.iloc[0]
    hours, src = r["estimated hours here"], md((names or {}).get(r["from"], r["from"]))
    ms = carried_ms(r["its step (ms)"], r["its measured roof TFLOP/s"], r["matmul TFLOP/s here"])
    return (f"At {r['matmul TFLOP/s here']:.3g} TFLOP/s ({md(r['precision'])}) measured here, against the "
            f"{r['its measured roof TFLOP/s']:.3g} TFLOP/s the {src} measured for the same matmul, its "
            f"{r['its step (ms)']:.4g} ms step becomes {ms:,.0f} ms, and 100,000 optimizer steps would take about "
            f"{hours:,.0f} hours here ({hours / 24 / 365:.2g} years)"
            + (": the reason this model trains on GPUs." if torch.device(device).type == "cpu" else "."))
