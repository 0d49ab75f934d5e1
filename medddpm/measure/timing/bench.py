"""Timing of training micro-steps and denoising steps per configuration (`python -m medddpm bench`), through
the one timing loop (`medddpm.train.timing`: warm-up first, then each timed step between device events, no
profiler attached), and the `bench` table those timings make, one row a timed configuration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from medddpm.configs import Config, get_config
from medddpm.train.data import real_batch
from medddpm.model.diffusion import TIMESTEPS
from medddpm.train.engine import Engine
from medddpm.model.unet import ModelSpec
from medddpm.measure.env import gpu_slug
from medddpm.measure.memory.snapshot import memory_snapshot
from medddpm.store import schema
from medddpm.store.layout import BENCH_FILE
from medddpm.train.timing import summarize, time_steps

REFERENCE = "reference (mobaidoctor/med-ddpm)"  # the bench table's implementation of the reference's runs
# the reference's runs match our configurations' math: strict FP32 is baseline's, TF32 opt1's
REFERENCE_CONFIGS = {"reference-fp32": "baseline", "reference-tf32": "opt1"}


def train_summary(step_ms: list[float]) -> dict[str, float]:
    """The training micro-step's summary under the run table's names (train_median_ms, ...)."""
    s = summarize(step_ms)
    return {"train_median_ms": s["median"], "train_p10_ms": s["p10"], "train_p90_ms": s["p90"],
            "train_mean_ms": s["mean"], "train_std_ms": s["std"]}


def sample_step_summary(step_ms: list[float]) -> dict[str, float]:
    """A denoising step's summary (sample_step_median_ms, as the run table names its median, ...)."""
    s = summarize(step_ms)
    return {"sample_step_median_ms": s["median"], "sample_step_p10_ms": s["p10"], "sample_step_p90_ms": s["p90"]}


def kernel_summary(step: Callable[[], object], *, device: torch.device, top: int, steps: int = 2) -> dict:
    """Device time per step by kernel category and the `top` kernels, from `steps` more steps under
    torch.profiler (after the timing: profiling is kept apart from it). Microseconds per step."""
    from medddpm.train.profiling import profile_kernels

    k = profile_kernels(step, device=device, steps=steps, warmup=0)
    per_kernel = (k.groupby(["short_name", "category"], as_index=False)[["calls", "total_us"]].sum()
                  .sort_values("total_us", ascending=False, ignore_index=True))
    per_kernel[["calls", "total_us"]] = per_kernel[["calls", "total_us"]] / steps
    by_category = (k.groupby("category")["total_us"].sum() / steps).sort_values(ascending=False)
    return {"kernel_us": float(k["total_us"].sum() / steps), "category_us": by_category.to_dict(),
            "top_kernels": per_kernel.head(top).to_dict("records")}


def _result(engine: Engine, result: dict) -> dict:
    if engine.capture_peak_bytes is not None:  # a CUDA graph's memory was allocated at its capture
        result["peak_mem_bytes"] = max(result["peak_mem_bytes"], engine.capture_peak_bytes)
    return result | {"config": engine.config.name, "not_applicable": engine.run.not_applicable,
                     "backend_flags": engine.backend_flags}


def bench_train(spec: ModelSpec, config: Config | str, *, device: torch.device, warmup: int = 5,
                micro_steps: int = 30, batch: int = 1, seed: int = 0, kernels: int = 0,
                snapshot: str | Path | None = None, progress: bool = True) -> dict:
    """Median time of one micro-step (forward + backward + Adam step) for one configuration; `snapshot`:
    then the allocator's history over one more step, to that file (`memory_snapshot`)."""
    config = get_config(config)
    engine = Engine(spec, config, device=device, seed=seed, ema=False)
    image, cond = real_batch(spec, seed=seed, batch=batch)
    x0, c = engine.prepare(image), engine.prepare(cond)
    losses = []
    result = time_steps(lambda: losses.append(engine.step((x0, c))), device=device, warmup=warmup,
                        steps=micro_steps, desc=config.name, progress=progress)
    result |= train_summary(result["step_ms"])
    result["loss"] = torch.stack(losses).float().cpu().tolist()
    if kernels:
        result |= kernel_summary(lambda: engine.step((x0, c)), device=engine.device, top=kernels)
    if snapshot:
        memory_snapshot(lambda: engine.step((x0, c)), device=engine.device, path=snapshot)
        result["memory_snapshot"] = Path(snapshot).name
    return _result(engine, result)


def bench_sample(spec: ModelSpec, config: Config | str, *, device: torch.device, warmup: int = 5,
                 steps: int = 30, batch: int = 1, seed: int = 0, timesteps: int = TIMESTEPS, kernels: int = 0,
                 progress: bool = True) -> dict:
    """Median time of one denoising step (`Engine.denoise_step`: the model's forward without gradients
    and the ancestral update), at the middle of the schedule; a full sample is `timesteps` of them."""
    config = get_config(config)
    engine = Engine(spec, config, device=device, seed=seed, ema=False, timesteps=timesteps)
    engine.model.eval()
    _, cond = real_batch(spec, seed=seed, batch=batch)
    c = engine.prepare(cond)
    g = torch.Generator(engine.device).manual_seed(seed)
    x, noise = (torch.randn((batch, spec.image_channels, *spec.shape), device=engine.device, generator=g)
                for _ in range(2))
    t = torch.full((batch,), timesteps // 2, device=engine.device, dtype=torch.long)
    step = lambda: engine.denoise_step(x, c, t, noise)  # noqa: E731
    result = time_steps(step, device=engine.device, warmup=warmup, steps=steps, desc=f"{config.name} sample",
                        progress=progress)
    result |= sample_step_summary(result["step_ms"])
    if kernels:
        result |= kernel_summary(step, device=engine.device, top=kernels)
    return _result(engine, result | {"sample_s": result["sample_step_median_ms"] * timesteps / 1e3})


def bench_rows(doc: dict, *, source: str) -> pd.DataFrame:
    """The `bench` table of one bench invocation's results (`{"environment", "spec", "phase", "runs"}`, what
    `python -m medddpm bench --json` writes): a row per timed run, its summary under the phase's names (the
    other phase's columns NaN), its reference runs under the configuration whose math they match."""
    env, spec = doc.get("environment", {}), doc.get("spec", {})
    phase = doc.get("phase", "train")
    if phase not in ("train", "sample"):
        raise ValueError(f"a bench's phase is train or sample, not {phase!r}")
    size = spec.get("size", -1)
    rows = []
    for r in doc["runs"]:
        name = r["config"]
        summary = train_summary(r["step_ms"]) if phase == "train" else sample_step_summary(r["step_ms"])
        peak = r.get("peak_mem_bytes")
        rows.append({
            "gpu_slug": gpu_slug(env.get("gpu_name", "")), "source": source, "phase": phase,
            "config": REFERENCE_CONFIGS.get(name, name),
            "implementation": REFERENCE if name.startswith("reference-") else "ours",
            **{k: summary.get(k, math.nan) for k in ("train_median_ms", "train_p10_ms", "train_p90_ms",
                                                     "sample_step_median_ms", "sample_step_p10_ms",
                                                     "sample_step_p90_ms")},
            "timed_steps": len(r["step_ms"]), "peak_mem_bytes": -1 if peak is None else int(peak),
            "fp32_math": (r.get("backend_flags") or {}).get("cudnn_conv_fp32_precision", ""),
            "git_commit": env.get("git_commit", ""), "torch": env.get("torch", ""), "cudnn": str(env.get("cudnn", "")),
            "time_utc": env.get("time_utc", ""), "size": max(size) if isinstance(size, (list, tuple)) else int(size),
            "mask_channels": int(spec.get("mask_channels", -1)), "base_channels": int(spec.get("base_channels", -1)),
        })
    return pd.DataFrame(rows, columns=list(schema.TABLES["bench"]))


def write_bench(out_dir: str | Path, doc: dict, *, source: str) -> Path:
    """Write `doc`'s rows (`bench_rows`) to OUT_DIR/bench.parquet, atomically and checked against the schema,
    in place of the rows of the same source; the file's other sources are kept."""
    path = Path(out_dir) / BENCH_FILE
    rows = bench_rows(doc, source=source)
    if path.is_file():
        kept = schema.read_table(path, "bench")
        kept = kept[kept["source"] != source]
        rows = pd.concat([kept, rows], ignore_index=True) if len(kept) else rows
    return schema.write_table(rows, path, "bench")
