"""The memory page: measured peaks, what fits on which card, what saving memory costs, and the targets."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from medddpm.store import schema
from medddpm.store.layout import PARTITION_FILE
from medddpm.configs import CONFIGS, get_config
from medddpm.report.loading import FAILS, HOLDS, NOT_MEASURED, NOT_YET, DataError, _GIB, _read, _sort, data_root
# What does not grow with the batch, for a run measured at one batch only: FP32 weights, their gradients and
# Adam's two moments, 4 bytes each per parameter, as training's own estimate counts them. (Static inputs, cuDNN
# workspaces and the like are then counted as per-sample: the largest batch is underestimated, never overestimated.)
from medddpm.train.budget import STATE_BYTES_PER_PARAM

GPU_MEMORY_GB = (16, 24, 40, 48, 80, 141)  # the card sizes the memory page answers for
# Kept free on every card: what a driver reports is a few percent under the size a card is sold with
# (ECC, firmware), and the caching allocator needs slack for fragmentation. An input, not a result.
HEADROOM = 0.05
MEMORY_SWITCHES = ("checkpointing", "precision", "recompute_attention")  # switches that trade time for memory
FIT_VERDICTS = ("fits", "tight", "does not fit")


def model_label(run: pd.DataFrame) -> pd.Series:
    """'paper 128x128x128' / 'brats 192x192x144': the model and input a memory figure belongs to."""
    return run["preset"] + " " + run["shape"]


def memory_runs(run: pd.DataFrame) -> pd.DataFrame:
    """Finished runs with a measured device peak (not a CPU's), one row each, sizes in GiB."""
    cols = ["gpu_slug", "model", "preset", "shape", "batch", "config", "label", "checkpointing", "precision_used",
            "compile", "cuda_graphs", "parameters", "peak_gib", "reserved_gib", "other_gib", "total_gib",
            "sample_peak_gib", "train_median_ms", "folder"]
    ok = run[(run["status"] == "ok") & (run["peak_mem_bytes"] >= 0)].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok["model"] = model_label(ok)
    ok["label"] = ok["config"] + np.where(ok["batch"] == 1, "", " (batch " + ok["batch"].astype(str) + ")")

    def gib(col):
        return ok[col].where(ok[col] >= 0) / _GIB

    ok = ok.assign(peak_gib=gib("peak_mem_bytes"), reserved_gib=gib("peak_reserved_bytes"), other_gib=gib("gpu_other_bytes"),
                   total_gib=gib("gpu_total_bytes"), sample_peak_gib=gib("sample_peak_mem_bytes"))
    return _sort(ok[cols], "model", "batch")


def memory_model(mem: pd.DataFrame) -> pd.DataFrame:
    """Per (GPU, model, configuration): peak allocated memory as fixed + batch x per_sample (GiB).

    With runs at two or more batches, a least-squares line through the measured peaks. With one batch
    only, an estimate: the fixed part is the training state (`STATE_BYTES_PER_PARAM` per parameter)
    and the rest is taken to grow with the batch. `other_gib` is the device memory outside PyTorch's
    allocator (CUDA context, libraries) as measured on these runs, else on that GPU; NaN where never
    measured. The `method` column says which."""
    cols = ["gpu_slug", "model", "config", "batches", "fixed_gib", "per_sample_gib", "other_gib", "peak1_gib",
            "reserved1_gib", "train_median_ms", "method", "checkpointing"]
    rows = []
    gpu_other = mem.groupby("gpu_slug")["other_gib"].max() if len(mem) else pd.Series(dtype=float)
    for (slug, model, config), g in mem.groupby(["gpu_slug", "model", "config"], sort=False):
        pts = g.groupby("batch")["peak_gib"].max()
        batches = [int(b) for b in pts.index]
        if len(pts) >= 2:
            per_sample, fixed = np.polyfit(pts.index.to_numpy(float), pts.to_numpy(float), 1)
            method = f"line through the peaks measured at batch {', '.join(map(str, batches))}"
        else:
            b = batches[0]
            fixed = g["parameters"].iloc[0] * STATE_BYTES_PER_PARAM / _GIB
            per_sample = (pts.iloc[0] - fixed) / b
            method = (f"estimate from batch {b} alone: {STATE_BYTES_PER_PARAM} bytes per parameter fixed "
                      "(weights, gradients, Adam), the rest per sample")
        other = g["other_gib"].max()
        if pd.isna(other):
            other = gpu_other.get(slug, math.nan)
            method += "; memory outside the allocator " + ("as measured on other runs of this GPU"
                                                            if pd.notna(other) else "not measured")
        one = g[g["batch"] == 1]
        rows.append({"gpu_slug": slug, "model": model, "config": config, "batches": ", ".join(map(str, batches)),
                     "fixed_gib": float(fixed), "per_sample_gib": float(per_sample), "other_gib": other,
                     "peak1_gib": one["peak_gib"].iloc[0] if len(one) else fixed + per_sample,
                     "reserved1_gib": one["reserved_gib"].iloc[0] if len(one) else math.nan,
                     "train_median_ms": one["train_median_ms"].iloc[0] if len(one) else math.nan,
                     "method": method, "checkpointing": bool(g["checkpointing"].iloc[0])})
    return _sort(pd.DataFrame(rows, columns=cols), "model")


def fits(model: pd.DataFrame, sizes_gb=GPU_MEMORY_GB, *, headroom: float = HEADROOM) -> pd.DataFrame:
    """Per (GPU measured on, model, configuration, card size): whether batch 1 trains, and the largest batch.

    A card of C GB is taken to hold C GiB. Need at batch b = fixed + b x per_sample + memory outside the
    allocator (0 where never measured). Batch 1 *fits* when its need leaves `headroom` of the card free
    and the allocator's measured reserved peak fits too; it is *tight* when only the bare need fits (it
    may run, with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or fail on fragmentation); else it
    *does not fit*. The largest batch keeps the headroom."""
    cols = ["gpu_slug", "model", "config", "card_gb", "card", "verdict", "need1_gib", "largest_batch", "per_sample_gib",
            "method", "checkpointing", "train_median_ms"]
    rows = []
    for r in model.itertuples():
        other = 0.0 if pd.isna(r.other_gib) else r.other_gib
        need1 = r.peak1_gib + other
        for c in sizes_gb:
            usable = c * (1 - headroom)
            reserved_ok = pd.isna(r.reserved1_gib) or r.reserved1_gib + other <= c
            verdict = FIT_VERDICTS[0] if need1 <= usable and reserved_ok else FIT_VERDICTS[1] if need1 <= c else FIT_VERDICTS[2]
            largest = (math.floor((usable - other - r.fixed_gib) / r.per_sample_gib)
                       if r.per_sample_gib > 0 else math.nan)
            rows.append({"gpu_slug": r.gpu_slug, "model": r.model, "config": r.config, "card_gb": c, "card": f"{c} GB",
                         "verdict": verdict, "need1_gib": need1, "largest_batch": max(largest, 0) if pd.notna(largest) else largest,
                         "per_sample_gib": r.per_sample_gib, "method": r.method, "checkpointing": r.checkpointing,
                         "train_median_ms": r.train_median_ms})
    return _sort(pd.DataFrame(rows, columns=cols), "model", "card_gb")


def _flag_columns() -> list[str]:
    from medddpm.configs import Config

    return [f for f in Config.__dataclass_fields__ if f not in ("name", "description")]


def _saves_memory(switch: str, off, on) -> bool:
    """Is going from `off` to `on` the memory-saving direction of `switch`?"""
    if switch == "precision":
        return on == "bf16" and off != "bf16"
    return bool(on) and not bool(off)


def switch_costs(run: pd.DataFrame, switches=MEMORY_SWITCHES) -> pd.DataFrame:
    """Each pair of finished runs on the same GPU, model and batch whose switches differ in exactly one
    memory-saving switch: its time cost (on / off step time) and the peak memory it saves (NaN on a CPU)."""
    cols = ["gpu_slug", "model", "batch", "switch", "change", "config_off", "config_on", "time_off_ms", "time_on_ms",
            "time_ratio", "peak_off_gib", "peak_on_gib", "saved_gib", "saved_frac"]
    ok = run[run["status"] == "ok"].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok["model"] = model_label(ok)
    flags = _flag_columns()
    rows = []
    for (slug, model, batch), g in ok.groupby(["gpu_slug", "model", "batch"], sort=False):
        recs = g.to_dict("records")
        for a in recs:
            for b in recs:
                diff = [f for f in flags if a[f] != b[f]]
                if len(diff) != 1 or diff[0] not in switches or not _saves_memory(diff[0], a[diff[0]], b[diff[0]]):
                    continue
                sw = diff[0]
                peak = [x["peak_mem_bytes"] / _GIB if x["peak_mem_bytes"] >= 0 else math.nan for x in (a, b)]
                rows.append({"gpu_slug": slug, "model": model, "batch": int(batch), "switch": sw,
                             "change": f"{sw}: {a[sw]} -> {b[sw]}", "config_off": a["config"], "config_on": b["config"],
                             "time_off_ms": a["train_median_ms"], "time_on_ms": b["train_median_ms"],
                             "time_ratio": b["train_median_ms"] / a["train_median_ms"], "peak_off_gib": peak[0],
                             "peak_on_gib": peak[1], "saved_gib": peak[0] - peak[1],
                             "saved_frac": (peak[0] - peak[1]) / peak[0] if peak[0] > 0 else math.nan})
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["gpu_slug", "model", "switch", "config_off"], ignore_index=True) if len(out) else out


@dataclass(frozen=True)
class MemoryTarget:
    id: str
    text: str
    shape: str  # input the target is about
    preset: str
    max_gib: float  # peak allocated at batch 1
    checkpointing_only: bool = False


MEMORY_TARGETS = [
    MemoryTarget("head-8", "Whole-head 128³ training in 8 GiB or less, with the fastest configuration that fits",
                 "128x128x128", "paper", 8.0),
    MemoryTarget("head-4-ckpt", "Whole-head 128³ training in 4 GiB or less with activation checkpointing",
                 "128x128x128", "paper", 4.0, checkpointing_only=True),
    MemoryTarget("brats-40", "BraTS-size training at batch 1 in 40 GiB or less (an A100 40 GB, every 80 GB card)",
                 "192x192x144", "brats", 40.0),
]


def memory_targets(mem: pd.DataFrame, targets=MEMORY_TARGETS, *, configs=tuple(CONFIGS.values())) -> pd.DataFrame:
    """Each target on each GPU with peaks: holds / does not hold / not met by the runs so far / not
    measured yet, with the numbers. The configuration reported is the fastest whose measured peak
    allocated (batch 1) meets the target. A target none meets *does not hold* only once every one of
    `configs` (those with checkpointing, for a checkpointing target) has been measured."""
    cols = ["target_id", "target", "gpu_slug", "verdict", "config", "peak_gib", "train_median_ms", "evidence"]
    rows = []
    for slug in list(dict.fromkeys(mem["gpu_slug"])) if len(mem) else []:  # mem's order: GPUs first
        for t in targets:
            g = mem[(mem["gpu_slug"] == slug) & (mem["preset"] == t.preset) & (mem["shape"] == t.shape)
                    & (mem["batch"] == 1)]
            if t.checkpointing_only:
                g = g[g["checkpointing"]]
            row = {"target_id": t.id, "target": t.text, "gpu_slug": slug, "config": "", "peak_gib": math.nan,
                   "train_median_ms": math.nan}
            if g.empty:
                what = "no checkpointed run" if t.checkpointing_only else "no run"
                rows.append(row | {"verdict": NOT_MEASURED, "evidence": f"{what} of the {t.preset} preset at batch 1 "
                                                                        "with a measured peak on this GPU"})
                continue
            measured = f" (of {len(g)} measured: {', '.join(g['config'])})"
            under = g[g["peak_gib"] <= t.max_gib]
            if under.empty:
                low = g.loc[g["peak_gib"].idxmin()]
                missing = [c.name for c in configs if c.name not in set(g["config"])
                           and (c.checkpointing or not t.checkpointing_only)]
                rows.append(row | {"verdict": NOT_YET if missing else FAILS, "config": low["config"],
                                   "peak_gib": low["peak_gib"], "train_median_ms": low["train_median_ms"],
                                   "evidence": f"the lowest peak, {low['label']}'s, is {low['peak_gib']:.2f} GiB "
                                               "allocated"
                                               + measured + (f"; not measured: {', '.join(missing)}" if missing else "")})
                continue
            best = under.loc[under["train_median_ms"].idxmin()]
            fastest = g.loc[g["train_median_ms"].idxmin()]
            note = ("" if fastest["config"] == best["config"] else
                    f"; the fastest overall, {fastest['label']}, needs {fastest['peak_gib']:.2f} GiB")
            reserved = (f"; {best['reserved_gib']:.2f} GiB reserved with the allocator's cache"
                        if pd.notna(best["reserved_gib"]) else "")
            rows.append(row | {"verdict": HOLDS, "config": best["config"], "peak_gib": best["peak_gib"],
                               "train_median_ms": best["train_median_ms"],
                               "evidence": f"{best['label']}: {best['peak_gib']:.2f} GiB allocated at "
                                           f"{best['train_median_ms']:.4g} ms a micro-step{reserved}{note}" + measured})
    return pd.DataFrame(rows, columns=cols)


def check_memory(mem: pd.DataFrame) -> None:
    """Measured peaks are sane: positive, reserved at least allocated, under the card's own size."""
    if mem.empty:
        return
    assert (mem["peak_gib"] > 0).all(), "a non-positive peak"
    r = mem.dropna(subset=["reserved_gib"])
    assert (r["reserved_gib"] >= r["peak_gib"] * 0.999).all(), "reserved below allocated"
    t = mem.dropna(subset=["total_gib"])
    assert (t["peak_gib"] <= t["total_gib"]).all(), "a peak larger than the device"


def counted_models(presets=("paper", "brats")) -> pd.DataFrame:
    """The models of the measurement presets, counted on the meta device (no GPU, nothing measured):
    parameters, forward FLOPs, training state, and FP32 activations kept for backward without and with
    activation checkpointing."""
    from medddpm.model.flops import count, saved_activation_bytes
    from medddpm.presets import get_preset
    from medddpm.model.unet import format_size

    rows = []
    for name in presets:
        preset = get_preset(name)
        spec = preset.spec()
        info = count(spec, backward=False)
        rows.append({"preset": name, "model": f"{name} {'x'.join(map(str, spec.shape))}", "input": format_size(spec.size),
                     "channels_in": spec.in_channels, "channels_out": spec.image_channels,
                     "res_blocks": spec.num_res_blocks, "parameters": info["parameters"],
                     "forward_tflop": info["forward_flops"] / 1e12,
                     "state_gib": info["parameters"] * STATE_BYTES_PER_PARAM / _GIB,
                     "activations_gib": saved_activation_bytes(spec) / _GIB,
                     "activations_ckpt_gib": saved_activation_bytes(spec, checkpointing=True) / _GIB,
                     "description": preset.description})
    return pd.DataFrame(rows)


COMPILED_SAVED = ("best", "best-ckpt", "best-ckpt+group_norm=fused")


def compiled_saved(preset: str = "paper", configs=COMPILED_SAVED, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """What each compiled configuration's training step keeps for its backward, from AOTAutograd's
    partition traced at full size on the CPU and stored in ``data/partition.parquet`` (`partition.record`;
    counted, not measured), one row per configuration and tracing torch version: the activations in GiB,
    how much of it is float32, the largest shapes, and `current` (traced under today's definition)."""
    path = (Path(root) if root is not None else data_root()) / PARTITION_FILE
    if not path.is_file():
        raise DataError(f"missing data file {path}: record it with `python -m medddpm saved --preset {preset} "
                        f"--configs {','.join(configs)} --write`")
    table = _read(path, "partition")
    table = table[(table["preset"] == preset) & table["config"].isin(configs)].copy()
    missing = [c for c in configs if c not in set(table["config"])]
    if missing:
        raise DataError(f"{path}: no {preset} trace of {', '.join(missing)} (`python -m medddpm saved --preset "
                        f"{preset} --configs {','.join(missing)} --write`)")
    # a switch that came after the trace had the value it was added with (schema.ADDED), as for a run's row
    before = {k: v for k, v in schema.ADDED["run"].items() if k in get_config("baseline").flags}
    table["current"] = [all((before | json.loads(s)).get(k) == v for k, v in get_config(c).flags.items())
                        for s, c in zip(table["switches"], table["config"])]
    table["activations_gib"] = table["activation_bytes"] / _GIB
    table["float32_gib"] = table["float32_bytes"] / _GIB
    order = {c: i for i, c in enumerate(configs)}  # the configurations as asked, each one's torch versions together
    return (table.assign(_order=table["config"].map(order)).sort_values(["_order", "torch"], ignore_index=True)
            .drop(columns="_order"))
