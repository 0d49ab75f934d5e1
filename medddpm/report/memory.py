"""The memory page: measured peaks, what fits on which card, what saving memory costs, and the targets."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from torch.torch_version import TorchVersion

from medddpm.store import schema
from medddpm.store.layout import PARTITION_FILE
from medddpm.configs import CONFIGS, get_config
from medddpm.report import tables
from medddpm.report.loading import FAILS, HOLDS, NOT_MEASURED, NOT_YET, DataError, _GIB, _read, _sort, data_root
from medddpm.report.safe import code, inline_html, md
# What does not grow with the batch, for a run measured at one batch only: FP32 weights, their gradients and
# Adam's two moments, 4 bytes each per parameter, as training's own estimate counts them. (Static inputs, cuDNN
# workspaces and the like are then counted as per-sample: the largest batch is underestimated, never overestimated.)
from medddpm.train.budget import STATE_BYTES_PER_PARAM


@dataclass(frozen=True)
class Card:
    """A card the memory page answers for. It is sold with a size in decimal GB (`sold_gb`: what its vendor
    prints), and its driver reports a memory that is smaller still than that size read as GiB (ECC, firmware,
    reserved regions): `reported_bytes`, CUDA's total memory of the device (`cudaDeviceProp.totalGlobalMem`, what
    deviceQuery prints and what the sweep records as ``gpu_total_bytes``), from `source`. The two are never
    mixed: fits are computed on the reported memory alone, in GiB."""

    name: str  # as its driver names it
    gpu_type: str  # the device type a sweep on it records (`gpu_type`), to find a run that measured it
    sold_gb: int
    reported_bytes: int
    source: str


# One card per size the reference's users train on, each with a published deviceQuery of its memory (a card a run
# measured takes its measurement instead: `card_memory`). The V100, A100 and H200 are the paper's and this book's cards.
CARDS = (
    Card("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb", 16, 16_911_433_728,
         "deviceQuery on CINECA's Marconi-100 (CUDA 11.0), github.com/kosl/ihipp-examples, docs/week5.md"),
    Card("NVIDIA GeForce RTX 3090", "nvidia-geforce-rtx-3090", 24, 25_286_672_384,
         "device query, github.com/Jumperkables/cuda-benchmarking, 00_deviceQuery/README.md"),
    Card("NVIDIA A100-SXM4-40GB", "nvidia-a100-sxm4-40gb", 40, 42_405_855_232,
         "deviceQuery on Paderborn's PC2 cluster, upb-pc2.atlassian.net/wiki/spaces/PC2DOK/pages/1900609"),
    Card("NVIDIA L40S", "nvidia-l40s", 48, 47_803_596_800,
         "deviceQuery (CUDA 12.4), github.com/thamada/nvidia-smi, nvsim/L40S_deviceQuery.py"),
    Card("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb", 80, 85_198_045_184,
         "deviceQuery (CUDA 11.4), gist.github.com/gengwg/3520df2ebf8872e5ee4818367e3a4122"),
    Card("NVIDIA H200", "nvidia-h200", 141, 150_109_880_320,
         "this book's H200 runs (`gpu_total_bytes`, CUDA 13.0), as committed under data/nvidia-h200/"),
)
MEASURED_CARD, CITED_CARD = "measured", "cited"
CARD_COLUMNS = ["card", "gpu_type", "sold_gb", "card_gib", "kind", "source"]
# Kept free on every card, of the memory its driver reports: the caching allocator needs slack for fragmentation.
# An input, not a result.
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


_SOLD = re.compile(r"(?<![\w.])(\d+)\s?GB\b", re.IGNORECASE)


def sold_size(name: str) -> float:
    """The size a card is sold with (GB), where its driver's name states it ("NVIDIA H100 80GB HBM3": 80); NaN
    where it does not ("NVIDIA H200")."""
    m = _SOLD.search(str(name))
    return float(m.group(1)) if m else math.nan


def card_memory(run: pd.DataFrame | None = None, catalogue=CARDS) -> pd.DataFrame:
    """The cards the page answers for, smallest first, a row each: its name, the size it is sold with (GB, the
    vendor's figure; for a card known only from a run, as its name states it, else NaN) and the memory its driver
    reports in GiB (`card_gib`), with where that figure comes from (`kind`: measured by a run here, else cited).
    A run that measured its device (``gpu_total_bytes``) replaces the catalogue's figure of that device type, and
    adds its card where the catalogue has none of that type."""
    rows = {c.gpu_type: {"card": c.name, "gpu_type": c.gpu_type, "sold_gb": float(c.sold_gb),
                         "card_gib": c.reported_bytes / _GIB, "kind": CITED_CARD, "source": c.source}
            for c in catalogue}
    if run is not None and len(run):
        seen = run[(run["gpu_total_bytes"] > 0) & (run["gpu_name"] != "cpu")]
        for kind, g in seen.groupby("gpu_type"):
            known = rows.get(kind, {"card": g["gpu_name"].iloc[0], "gpu_type": kind,
                                    "sold_gb": sold_size(g["gpu_name"].iloc[0])})
            rows[kind] = known | {"card_gib": g["gpu_total_bytes"].max() / _GIB, "kind": MEASURED_CARD,
                                  "source": "measured here: the driver's total memory recorded by the runs on "
                                            + ", ".join(sorted(set(g["gpu_slug"])))}
    out = pd.DataFrame(list(rows.values()), columns=CARD_COLUMNS)
    return out.sort_values(["card_gib", "card"], ignore_index=True)


def check_cards(table: pd.DataFrame) -> None:
    """Each card's reported memory lies under its sold size read as GiB (the driver keeps some of it) and within a
    tenth of its sold size in GB: a figure outside those bounds has its GB and GiB mixed up."""
    sold = table.dropna(subset=["sold_gb"])
    assert (sold["card_gib"] < sold["sold_gb"]).all(), sold
    assert (sold["card_gib"] * _GIB / 1e9 > 0.9 * sold["sold_gb"]).all(), sold


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


def fits(model: pd.DataFrame, card_table: pd.DataFrame | None = None, *, headroom: float = HEADROOM) -> pd.DataFrame:
    """Per (GPU measured on, model, configuration, card): whether batch 1 trains on the card, and the largest batch.

    A card holds the memory its driver reports (`card_memory`: `card_gib`, measured where a run measured it). Need at
    batch b = fixed + b x per_sample + memory outside the allocator (0 where never measured). Batch 1 *fits* when
    its need leaves `headroom` of the card free and the allocator's measured reserved peak fits too; it is *tight*
    when only the bare need fits (it may run, with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or fail on
    fragmentation); else it *does not fit*. The largest batch keeps the headroom."""
    card_table = card_memory() if card_table is None else card_table
    cols = ["gpu_slug", "model", "config", "card", "sold_gb", "card_gib", "card_kind", "verdict", "need1_gib",
            "largest_batch", "per_sample_gib", "method", "checkpointing", "train_median_ms"]
    rows = []
    for r in model.itertuples():
        other = 0.0 if pd.isna(r.other_gib) else r.other_gib
        need1 = r.peak1_gib + other
        for c in card_table.itertuples():
            usable = c.card_gib * (1 - headroom)
            reserved_ok = pd.isna(r.reserved1_gib) or r.reserved1_gib + other <= c.card_gib
            verdict = (FIT_VERDICTS[0] if need1 <= usable and reserved_ok else
                       FIT_VERDICTS[1] if need1 <= c.card_gib else FIT_VERDICTS[2])
            largest = (math.floor((usable - other - r.fixed_gib) / r.per_sample_gib)
                       if r.per_sample_gib > 0 else math.nan)
            rows.append({"gpu_slug": r.gpu_slug, "model": r.model, "config": r.config, "card": c.card,
                         "sold_gb": c.sold_gb, "card_gib": c.card_gib, "card_kind": c.kind, "verdict": verdict,
                         "need1_gib": need1, "largest_batch": max(largest, 0) if pd.notna(largest) else largest,
                         "per_sample_gib": r.per_sample_gib, "method": r.method, "checkpointing": r.checkpointing,
                         "train_median_ms": r.train_median_ms})
    return _sort(pd.DataFrame(rows, columns=cols), "model", "card_gib")


def _flag_columns() -> list[str]:
    from medddpm.configs import Config

    return [f for f in Config.__dataclass_fields__ if f not in ("name", "description")]


# Autocast keeps the activations it saves for the backward in 2 bytes (bf16, fp16) instead of 4 (strict FP32 and
# TF32, which round only inside the tensor cores): a precision switch saves memory only across that line.
HALF_PRECISIONS = ("bf16", "fp16")


def _saves_memory(switch: str, off, on) -> bool:
    """Is going from `off` to `on` the memory-saving direction of `switch`? For precision: from a 4-byte
    precision to a 2-byte one (`HALF_PRECISIONS`); bf16 against fp16 saves nothing."""
    if switch == "precision":
        return on in HALF_PRECISIONS and off not in HALF_PRECISIONS
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
    MemoryTarget("brats-40", "BraTS-size training at batch 1 in 40 GiB or less",
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


# ------------------------------------------------------------------------------------------ the page

BRATS_PARAMETERS = 57_562_564  # the reference's train_brats.py model, counted on the meta device


def check_page(run: pd.DataFrame, mem: pd.DataFrame, counted: pd.DataFrame, card_table: pd.DataFrame) -> None:
    """The memory page's inputs are sane: some run finished, its peaks are (`check_memory`), the BraTS-size model
    has the reference's parameters, and every card's figure is in its own unit (`check_cards`)."""
    assert len(run), "no finished run under data/"
    check_memory(mem)
    assert counted.loc[counted["preset"] == "brats", "parameters"].iloc[0] == BRATS_PARAMETERS, counted
    check_cards(card_table)


COUNTED_COLUMNS = {"model": "model", "channels": "channels in -> out", "parameters": "parameters",
                   "forward_tflop": "forward TFLOP", "state_gib": "state GiB", "activations_gib": "activations GiB",
                   "activations_ckpt_gib": "checkpointed GiB"}
COUNTED_NOTE = ("*State*: FP32 weights, gradients and Adam's two moments. *Activations*: what autograd keeps for the "
                "backward pass of one volume in FP32 without fusion; *checkpointed*: the same with the `checkpointing` "
                "switch.")


def counted_table(counted: pd.DataFrame) -> pd.DataFrame:
    shown = counted.assign(channels=counted["channels_in"].astype(str) + " -> " + counted["channels_out"].astype(str),
                           parameters=counted["parameters"].map("{:,}".format))
    return shown[list(COUNTED_COLUMNS)].rename(columns=COUNTED_COLUMNS)


def activations_text(counted: pd.DataFrame) -> str:
    """What the BraTS-size model keeps for its backward pass against the whole-head one, and with checkpointing."""
    b = counted.set_index("preset")
    return (f"In FP32 without fusion the BraTS model keeps **{b.loc['brats', 'activations_gib']:.1f} GiB** of "
            f"activations for the backward pass of one volume "
            f"({b.loc['brats', 'activations_gib'] / b.loc['paper', 'activations_gib']:.1f}x the whole-head model's "
            f"{b.loc['paper', 'activations_gib']:.1f} GiB), beside {b.loc['brats', 'state_gib']:.2f} GiB of weights, "
            "gradients and Adam state: the peak adds the gradients in flight and the libraries' workspaces on top. "
            "Activation checkpointing (the `checkpointing` switch: each U-Net block keeps its inputs and recomputes "
            f"its inside during the backward pass) keeps {b.loc['brats', 'activations_ckpt_gib']:.1f} GiB of them, at "
            "the price of one more forward pass.")


def traced_version(kept: pd.DataFrame, run: pd.DataFrame) -> str:
    """The torch version whose trace the page reads: the GPU runs' (their most common) where it traced the step,
    else the newest that did."""
    versions = sorted(kept["torch"].unique(), key=TorchVersion)
    gpu_torch = run.loc[run["gpu_slug"] != "cpu", "torch"].mode()
    return gpu_torch.iloc[0] if len(gpu_torch) and gpu_torch.iloc[0] in versions else versions[-1]


FUSED_CKPT = "best-ckpt+group_norm=fused"


def check_compiled(kept: pd.DataFrame, torch_version: str) -> None:
    """Every trace keeps something, none was traced under an older definition, and checkpointing keeps less."""
    assert (kept["activations_gib"] > 0).all(), kept
    stale = sorted(set(kept.loc[~kept["current"], "config"]))
    assert not stale, f"data/partition.parquet traced {stale} under older definitions: record them again (--write)"
    k = kept[kept["torch"] == torch_version].set_index("config")
    assert k.loc["best-ckpt", "activations_gib"] < k.loc["best", "activations_gib"], "checkpointing keeps more"


def compiled_text(kept: pd.DataFrame, torch_version: str) -> str:
    """What best and best-ckpt keep under the version read, the fused GroupNorm's cost under checkpointing, and
    where the versions traced disagree."""
    versions = sorted(kept["torch"].unique(), key=TorchVersion)
    k = kept[kept["torch"] == torch_version].set_index("config")
    by_version = kept.pivot_table(index="config", columns="torch", values="activations_gib", aggfunc="first")
    differ = (by_version[(by_version.max(axis=1) - by_version.min(axis=1)) > 1e-3] if len(versions) > 1
              else by_version.iloc[:0])
    others = ", ".join(v for v in versions if v != torch_version)
    return (f"Traced with torch {md(torch_version)}"
            + (f" (the GPU runs' version; also with {md(others)})" if len(versions) > 1 else "")
            + f": `best` keeps {k.loc['best', 'activations_gib']:.2f} GiB for the backward of one whole-head volume, "
            f"`best-ckpt` {k.loc['best-ckpt', 'activations_gib']:.2f} GiB. `best-ckpt` keeps the chunked GroupNorm; "
            f"with `best`'s fused one (`{FUSED_CKPT}`) it keeps {k.loc[FUSED_CKPT, 'activations_gib']:.2f} GiB. That "
            "GroupNorm is a custom autograd function, whose tensors checkpointing under `torch.compile` may save "
            "instead of recomputing (pytorch/pytorch#177396)."
            + ("" if differ.empty else " The torch versions traced differ for "
               + ", ".join(f"{code(c)} ({' / '.join(f'{v:.2f}' for v in r.dropna())} GiB)"
                           for c, r in differ.iterrows())
               + ": the same code, partitioned by another AOTAutograd."))


def compiled_table(kept: pd.DataFrame) -> pd.DataFrame:
    """What each traced configuration keeps: tensors, GiB, and of it float32 in MiB (a few tensors at most)."""
    return kept.assign(float32_mib=kept["float32_gib"] * 1024)[
        ["config", "torch", "tensors", "activations_gib", "float32_mib"]].rename(
        columns={"config": "configuration", "activations_gib": "kept GiB", "float32_mib": "of it float32, MiB"})


def lowest_peaks(mem: pd.DataFrame) -> dict[tuple[str, str], pd.Series]:
    """(GPU, model) -> the run with the lowest allocated peak at batch 1: the targets read the same rows."""
    one = mem[mem["batch"] == 1]
    return {key: g.loc[g["peak_gib"].idxmin()] for key, g in one.groupby(["gpu_slug", "model"], sort=False)}


def peaks_text(mem: pd.DataFrame, run: pd.DataFrame) -> str:
    """Per GPU and model at batch 1: the lowest and highest allocated peak, and what the lowest reserves; the
    devices without peaks; or that no GPU peak is in the data."""
    lines = []
    for (slug, m), g in mem[mem["batch"] == 1].groupby(["gpu_slug", "model"], sort=False):
        lo, hi = g.loc[g["peak_gib"].idxmin()], g.loc[g["peak_gib"].idxmax()]
        lines.append(f"- **{md(slug)}**, {md(m)}, batch 1: from {lo['peak_gib']:.2f} GiB ({code(lo['config'])}) to "
                     f"{hi['peak_gib']:.2f} GiB ({code(hi['config'])}) allocated, {len(g)} configuration(s) measured; "
                     f"{code(lo['config'])} reserves {lo['reserved_gib']:.2f} GiB with the allocator's cache.")
    no_peaks = sorted(set(run["gpu_slug"]) - set(mem["gpu_slug"]))
    if no_peaks:
        lines.append(f"- No GPU peak memory for {', '.join(f'**{md(s)}**' for s in no_peaks)}: a CPU run records none.")
    if mem.empty:
        lines.insert(0, "No run in the data has a GPU peak yet: every figure below waits for a sweep on a GPU "
                        "(`python -m medddpm sweep --preset paper` or `--preset brats`).")
    return "\n".join(lines)


CARD_TABLE_COLUMNS = {"card": "card (as its driver names it)", "sold_gb": "sold as (GB)",
                      "card_gib": "its driver reports (GiB)", "kind": "figure", "source": "from"}


def card_list(card_table: pd.DataFrame) -> pd.DataFrame:
    """The cards as the page lists them: the size each is sold with in GB, the memory its driver reports in GiB."""
    shown = card_table.assign(sold_gb=[f"{v:g}" if pd.notna(v) else "-" for v in card_table["sold_gb"]])
    return shown[list(CARD_TABLE_COLUMNS)].rename(columns=CARD_TABLE_COLUMNS)


def fits_text(fit: pd.DataFrame) -> str:
    """Per GPU measured on and model, per card: how many measured configurations fit at batch 1, the fastest."""
    lines = []
    for (slug, m), g in fit.groupby(["gpu_slug", "model"], sort=False):
        per_card = []
        for _, gc in g.groupby(["card_gib", "card"], sort=True):
            ok = gc[gc["verdict"] == FIT_VERDICTS[0]]
            fastest = ok.loc[ok["train_median_ms"].idxmin()] if ok["train_median_ms"].notna().any() else None
            name = f"{md(gc['card'].iloc[0].removeprefix('NVIDIA '))} ({gc['card_gib'].iloc[0]:.1f} GiB)"
            per_card.append(f"{name}: " + (f"{len(ok)} of {len(gc)} fit, fastest {code(fastest['config'])}"
                                           if fastest is not None else f"none of {len(gc)} fits"))
        estimated = g["method"].str.startswith("estimate").any()
        lines.append(f"- **{md(slug)}**, {md(m)}: " + "; ".join(per_card)
                     + (" (largest batches estimated from batch 1)" if estimated else "") + ".")
    return "At batch 1, per card (measured configurations only):\n\n" + "\n".join(lines)


def fits_intro_text() -> str:
    """How a batch is judged to fit a card, and where the largest batch comes from."""
    return (f"Of each card's memory, {HEADROOM:.0%} is kept free: the allocator needs slack. The need of a batch is its "
            "allocated peak plus the memory outside the allocator (where measured). Batch 1 **fits** when that need "
            "leaves the headroom free and the measured reserved peak fits as well; it is **tight** when only the "
            "bare need fits (it may run with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or fail on "
            "fragmentation); otherwise it **does not fit**.\n\n"
            "The largest batch comes from a line, peak(b) = fixed + b × per sample. Where runs at two or more batches "
            "exist (`--batch 2`), the line goes through their measured peaks. Where batch 1 alone was measured it is "
            f"an **estimate**: the fixed part is the training state ({STATE_BYTES_PER_PARAM} bytes per parameter: "
            "FP32 weights, gradients and Adam's two moments) and everything else is taken to grow with the batch, "
            "which errs on the small side. The tooltip says which, for each cell; a GPU measured here answers for "
            "another card only as far as the same software needs the same memory there.")


LINE_COLUMNS = {"gpu_slug": "measured on", "model": "model", "config": "configuration", "batches": "batches",
                "peak1_gib": "batch 1 GiB", "fixed_gib": "fixed GiB", "per_sample_gib": "per sample GiB",
                "other_gib": "outside GiB"}


def methods_text(model: pd.DataFrame) -> str:
    methods = model.groupby("method")["config"].apply(lambda c: ", ".join(code(x) for x in dict.fromkeys(c)))
    return "How each line was found:\n\n" + "\n".join(f"- {md(m)}: {c}." for m, c in methods.items())


def cost_line(r) -> str:
    """One pair of runs that differ in one memory-saving switch: its time cost and the memory it saves."""
    saved = (f", {r.saved_gib:.2f} GiB ({r.saved_frac:.0%}) less memory" if pd.notna(r.saved_gib)
             else " (a CPU records no peak)")
    return (f"**{md(r.gpu_slug)}**, {md(r.model)}{'' if r.batch == 1 else f', batch {r.batch}'}: "
            f"{code(r.config_off)} → {code(r.config_on)} ({md(r.change)}): {r.time_ratio:.2f}x the step time{saved}.")


def costs_text(costs: pd.DataFrame, cpus: set[str]) -> tuple[str, str]:
    """The pairs of `switch_costs` in words: the GPUs' as Markdown (the CPU's where there is no GPU pair), and the
    CPU's folded apart as HTML where GPU pairs exist ("" otherwise)."""
    on_cpu = tables.cpu_rows(costs, cpus)
    shown = costs[~on_cpu] if (~on_cpu).any() else costs
    text = "\n".join("- " + cost_line(r) for r in shown.itertuples())
    folded = ""
    if (~on_cpu).any() and on_cpu.any():
        items = "".join(f"<li>{inline_html(cost_line(r))}</li>" for r in costs[on_cpu].itertuples())
        folded = tables.fold(f"CPU smoke runs ({on_cpu.sum()} pairs)", f"<ul>{items}</ul>")
    return text, folded


def check_costs(costs: pd.DataFrame) -> None:
    assert (costs["time_ratio"] > 0).all(), costs


def check_targets(targets: pd.DataFrame, mem: pd.DataFrame, lowest: dict) -> None:
    """A target that holds names a measured run whose peak is the one the measured peaks show, under the target;
    the checkpointing target's run is no lower than the lowest peak listed for its GPU and model."""
    for t in targets[targets["verdict"] == HOLDS].itertuples():
        target = next(x for x in MEMORY_TARGETS if x.id == t.target_id)
        row = mem[(mem["gpu_slug"] == t.gpu_slug) & (mem["config"] == t.config) & (mem["preset"] == target.preset)
                  & (mem["batch"] == 1)]
        assert len(row) == 1 and abs(row["peak_gib"].iloc[0] - t.peak_gib) < 1e-9, (t, row)
        assert t.peak_gib <= target.max_gib, t
        if target.checkpointing_only:
            lo = lowest.get((t.gpu_slug, row["model"].iloc[0]))
            assert lo is not None and lo["peak_gib"] <= t.peak_gib + 1e-9, (t, lo)


def checkpoint_target_text(targets: pd.DataFrame, mem: pd.DataFrame) -> str:
    """Where the checkpointing target holds: the peak against it, and what the card must hold beside the allocated
    memory (the allocator's reserved peak, the CUDA context and libraries), all in GiB."""
    target = next(x for x in MEMORY_TARGETS if x.checkpointing_only)
    lines = []
    for t in targets[(targets["target_id"] == target.id) & (targets["verdict"] == HOLDS)].itertuples():
        r = mem[(mem["gpu_slug"] == t.gpu_slug) & (mem["config"] == t.config) & (mem["preset"] == target.preset)
                & (mem["batch"] == 1)].iloc[0]
        other = (f", and the CUDA context and libraries {r['other_gib']:.2f} GiB beside it"
                 if pd.notna(r["other_gib"]) else "")
        lines.append(f"On **{md(t.gpu_slug)}**, {code(t.config)} allocates at most {t.peak_gib:.2f} GiB in a "
                     f"whole-head step, {target.max_gib - t.peak_gib:.2f} GiB under the {target.max_gib:g} GiB target. The targets count "
                     "allocated memory; what a card must hold is more: the allocator reserves "
                     f"{r['reserved_gib']:.2f} GiB with its cache{other} ([what fits where](#what-fits-where)).")
    return "\n\n".join(lines)
