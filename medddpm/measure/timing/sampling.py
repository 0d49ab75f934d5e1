"""Seconds per generated volume over batch sizes (table `sample_batches`): one configuration's denoising step timed
at each batch, through the one timing loop (`medddpm.train.timing`), from the smallest batch up until one does not
fit. A full sample is `timesteps` denoising steps of the whole batch, so a volume costs timesteps x step / batch; the
best batch is the one that makes that smallest."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import pandas as pd
import torch

from medddpm.configs import Config, get_config
from medddpm.measure.env import environment, gpu_slug
from medddpm.model.diffusion import TIMESTEPS
from medddpm.model.unet import ModelSpec
from medddpm.store import schema
from medddpm.train.data import real_batch
from medddpm.train.engine import Engine
from medddpm.train.timing import summarize, time_steps


def parse_batches(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: positive, increasing (a batch that does not fit ends the measurement)."""
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"batches must be comma-separated positive integers, got {text!r}") from None
    if not batches or min(batches) < 1 or batches != sorted(set(batches)):
        raise ValueError(f"batches must be increasing positive integers, got {text!r}")
    return batches


def _row(engine: Engine, spec: ModelSpec, batch: int, *, warmup: int, steps: int, seed: int, timesteps: int) -> dict:
    """One batch's denoising step, timed at the middle of the schedule (as `bench --phase sample` times it)."""
    device = engine.device
    _, cond = real_batch(spec, seed=seed, batch=batch)
    c = engine.prepare(cond)
    g = torch.Generator(device).manual_seed(seed)
    x, noise = (torch.randn((batch, spec.image_channels, *spec.shape), device=device, generator=g) for _ in range(2))
    t = torch.full((batch,), timesteps // 2, device=device, dtype=torch.long)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        engine.capture_peak_bytes = None
    result = time_steps(lambda: engine.denoise_step(x, c, t, noise), device=device, warmup=warmup, steps=steps,
                        desc=f"{engine.config.name} sample b{batch}", progress=False)
    s = summarize(result["step_ms"])
    peak = max(result["peak_mem_bytes"] or -1, engine.capture_peak_bytes or -1)
    return {"status": "ok", "message": "", "step_median_ms": s["median"], "step_p10_ms": s["p10"],
            "step_p90_ms": s["p90"], "volume_s": timesteps * s["median"] / 1e3 / batch, "peak_mem_bytes": int(peak)}


def sample_batches(spec: ModelSpec, config: Config | str, batches: list[int], *, device: torch.device | str,
                   warmup: int = 3, steps: int = 20, seed: int = 0, timesteps: int = TIMESTEPS,
                   label: str | None = None, call_id: str | None = None, engine: Engine | None = None) -> pd.DataFrame:
    """The `sample_batches` table of one configuration: a row per batch in `batches` (increasing), until one runs
    out of memory (its row says oom; larger ones are not tried). One engine serves every batch: a compiled
    configuration compiles its denoising step once per batch shape (`dynamic=False`), a CUDA graph is captured
    for each. `engine`: one already built for this configuration (its weights are used as they are)."""
    config = get_config(config)
    engine = engine or Engine(spec, config, device=device, seed=seed, ema=False, timesteps=timesteps)
    engine.model.eval()
    env = environment(engine.device)
    start = dt.datetime.now(dt.timezone.utc)
    slug = gpu_slug(label or env["gpu_name"])
    call_id = call_id or f"{slug}/sample-batches/{start.strftime('%Y%m%dT%H%M%SZ')}"
    rows = []
    for batch in batches:
        try:
            row = _row(engine, spec, batch, warmup=warmup, steps=steps, seed=seed, timesteps=timesteps)
        except torch.OutOfMemoryError as e:
            row = {"status": "oom", "message": str(e).strip().splitlines()[0][:200]}
        except Exception as e:  # noqa: BLE001 - recorded; a larger batch may still be tried
            row = {"status": "error", "message": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
        finally:
            engine._denoise_graph = None  # the next batch captures its own; this one's pool goes
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append({"call_id": call_id, "gpu_slug": slug, "gpu_name": env["gpu_name"], "config": config.name,
                     "size": max(spec.shape), "batch": batch, "timesteps": timesteps,
                     "steps": steps if row["status"] == "ok" else 0,
                     **{k: math.nan for k in ("step_median_ms", "step_p10_ms", "step_p90_ms", "volume_s")},
                     "peak_mem_bytes": -1, "git_commit": env["git_commit"], "torch": env["torch"],
                     "start_time": start.isoformat(timespec="seconds")} | row)
        if row["status"] == "oom":
            break
    return pd.DataFrame(rows, columns=list(schema.TABLES["sample_batches"]))


def best_batch(table: pd.DataFrame) -> pd.DataFrame:
    """Per (call, configuration): the batch that fits with the fewest seconds per volume, its row."""
    ok = table[table["status"] == "ok"].sort_values(["call_id", "config", "volume_s", "batch"])
    return ok.drop_duplicates(["call_id", "config"]).reset_index(drop=True)


def write_sample_batches(path: str | Path, rows: pd.DataFrame) -> Path:
    """Add `rows` to the table at `path` (schema-checked, atomic), in place of rows of the same call, configuration
    and batch."""
    path = Path(path)
    if path.is_file():
        kept = schema.read_table(path, "sample_batches")
        keys = ["call_id", "config", "batch"]
        kept = kept[~kept.set_index(keys).index.isin(rows.set_index(keys).index)]
        rows = pd.concat([kept, rows], ignore_index=True) if len(kept) else rows
    return schema.write_table(rows, path, "sample_batches")
