"""Timing of training micro-steps: warm-up first (compilation, cuDNN autotuning), then each timed
step between device events, no profiler attached (nanoGPT's bench.py habit)."""

from __future__ import annotations

import pickle
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm  # text bars: tqdm.auto draws ipywidgets bars, a message per update under papermill

from medddpm.configs import Config, get_config
from medddpm.train.data import make_brats_case, make_mni_pair, one_hot_condition
from medddpm.model.diffusion import TIMESTEPS
from medddpm.train.engine import Engine
from medddpm.model.unet import ModelSpec
from medddpm.measure.snapshot import SOURCES, package_source, sources
from medddpm.store.storage import atomic_write


def time_steps(fn: Callable[[], object], *, device: torch.device, warmup: int, steps: int,
               desc: str = "steps", progress: bool = True, on_timed_start: Callable[[], object] | None = None) -> dict:
    """Run `fn` `warmup` times (each timed with a host sync: compilation shows there), then `steps`
    times back to back, each between CUDA events (host clock on a CPU). Milliseconds."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    warm_ms = []
    for _ in tqdm(range(warmup), desc=f"{desc} warm-up", disable=not progress):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        warm_ms.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    times, dispatch = [], []
    sync()
    if on_timed_start is not None:
        on_timed_start()
    wall0 = time.perf_counter()
    for i in tqdm(range(steps), desc=f"{desc} timed", disable=not progress):
        t0 = time.perf_counter()
        if cuda:
            events[i][0].record()
        fn()
        if cuda:
            events[i][1].record()
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        dispatch.append((time.perf_counter() - t0) * 1e3)  # host time to issue the step
    sync()
    wall_ms = (time.perf_counter() - wall0) * 1e3
    if cuda:
        times = [a.elapsed_time(b) for a, b in events]
    return {"warmup_ms": warm_ms, "step_ms": times, "dispatch_ms": dispatch, "wall_ms": wall_ms,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            **summarize(times)}


def summarize(times: list[float]) -> dict:
    if not times:
        return {"median_ms": float("nan"), "p10_ms": float("nan"), "p90_ms": float("nan")}
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return {"median_ms": statistics.median(times), "p10_ms": q[0], "p90_ms": q[-1]}


def real_batch(spec: ModelSpec, *, seed: int = 0, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of embedded pairs (never zeros: they time faster than real data): whole-head MNI
    pairs for a 1-image, 3-label model, synthetic BraTS-like cases for a 4-image, 4-label one."""
    kinds = {(1, 3): make_mni_pair, (4, 4): make_brats_case}
    make = kinds.get((spec.image_channels, spec.mask_channels))
    if make is None:
        raise ValueError(f"no embedded data for {spec.image_channels} image and {spec.mask_channels} label channels; "
                         f"embedded: {', '.join(f'{i} image + {m} label' for i, m in kinds)}")
    pairs = [make(seed + i, size=spec.size) for i in range(batch)]
    image = torch.stack([torch.from_numpy(img).reshape(spec.image_channels, *spec.shape) for img, _ in pairs])
    cond = torch.stack([one_hot_condition(lab, num_classes=spec.mask_channels) for _, lab in pairs])
    return image, cond


def kernel_summary(step: Callable[[], object], *, device: torch.device, top: int, steps: int = 2) -> dict:
    """Device time per step by kernel category and the `top` kernels, from `steps` more steps under
    torch.profiler (after the timing: profiling is kept apart from it). Microseconds per step."""
    from medddpm.measure.kernels import profile_kernels

    k = profile_kernels(step, device=device, steps=steps, warmup=0)
    per_kernel = (k.groupby(["short_name", "category"], as_index=False)[["calls", "total_us"]].sum()
                  .sort_values("total_us", ascending=False, ignore_index=True))
    per_kernel[["calls", "total_us"]] = per_kernel[["calls", "total_us"]] / steps
    by_category = (k.groupby("category")["total_us"].sum() / steps).sort_values(ascending=False)
    return {"kernel_us": float(k["total_us"].sum() / steps), "category_us": by_category.to_dict(),
            "top_kernels": per_kernel.head(top).to_dict("records")}


def memory_snapshot(step: Callable[[], object], *, device: torch.device, path: str | Path) -> None:
    """One more step with the CUDA caching allocator's history on, saved as a pickle that
    https://pytorch.org/memory_viz reads (`torch.cuda.memory._dump_snapshot`): which tensors are live at
    the peak, with the Python frames that allocated them. After the timing. A step replayed from a CUDA
    graph allocates nothing: take it from a configuration with `cuda_graphs=false`."""
    if device.type != "cuda":
        raise ValueError(f"a memory snapshot needs a CUDA device, not {device}")
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()  # what _dump_snapshot pickles
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # the frames name functions and lines only: keep what they were at this commit (medddpm.measure.snapshot reads it)
    snap[SOURCES] = sources(snap, package_source)
    atomic_write(path, lambda f: pickle.dump(snap, f))


def _result(engine: Engine, result: dict) -> dict:
    if engine.capture_peak_bytes is not None:  # a CUDA graph's memory was allocated at its capture
        result["peak_mem_bytes"] = max(result["peak_mem_bytes"], engine.capture_peak_bytes)
    return result | {"config": engine.config.name, "not_applicable": engine.run.not_applicable,
                     "backend_flags": engine.backend_flags}


def bench_train(spec: ModelSpec, config: Config | str, *, device: torch.device, warmup: int = 5,
                steps: int = 30, batch: int = 1, seed: int = 0, kernels: int = 0, snapshot: str | Path | None = None,
                progress: bool = True) -> dict:
    """Median time of one micro-step (forward + backward + Adam step) for one configuration; `snapshot`:
    then the allocator's history over one more step, to that file (`memory_snapshot`)."""
    config = get_config(config)
    engine = Engine(spec, config, device=device, seed=seed, ema=False)
    image, cond = real_batch(spec, seed=seed, batch=batch)
    x0, c = engine.prepare(image), engine.prepare(cond)
    losses = []
    result = time_steps(lambda: losses.append(engine.step((x0, c))), device=device, warmup=warmup, steps=steps,
                        desc=config.name, progress=progress)
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
    if kernels:
        result |= kernel_summary(step, device=engine.device, top=kernels)
    return _result(engine, result | {"sample_s": result["median_ms"] * timesteps / 1e3})
