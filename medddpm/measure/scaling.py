"""Data-parallel scaling: one configuration's training micro-step on 1, 2, ... ranks, every rank's
step times recorded, so that the book can show throughput and efficiency against world size.

    python -m medddpm scale --config sdpa --world-sizes 1,2 --preset smoke --device cpu

One torchrun launch per world size (NCCL with one GPU per rank; gloo on CPUs). Each rank feeds its
own micro-batches through DistributedDataParallel and times its own steps (warm-up first, CUDA
events on a GPU, no profiler). Rank 0 gathers every rank's times and writes
``<out>/<gpu-slug>/scaling/<config>.parquet`` (table ``scaling``), replacing that world size's rows
atomically: a re-run redoes one world size and keeps the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

from medddpm import REPO
from medddpm.store import schema
from medddpm.store.layout import scaling_table
from medddpm.configs import Config, get_config


def parse_world_sizes(spec: str | list[int]) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; every size a positive int, each once."""
    sizes = spec if isinstance(spec, list) else [s.strip() for s in str(spec).split(",") if s.strip()]
    out = []
    for s in sizes:
        try:
            n = int(s)
        except (TypeError, ValueError):
            raise ValueError(f"world sizes must be positive integers, got {s!r}") from None
        if isinstance(s, bool) or n < 1:
            raise ValueError(f"world sizes must be positive integers, got {s!r}")
        out.append(n)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"world sizes must be a non-empty list without repeats, got {spec!r}")
    return out


def check(config: Config, world_sizes: list[int], *, device: str) -> None:
    """Everything that can fail before a process is launched fails here, in one line."""
    if config.cuda_graphs:
        raise ValueError(f"configuration {config.name!r} captures CUDA graphs, which DDP does not support; "
                         f"use {config.name}+cuda_graphs=false")
    if device == "cuda":
        have = torch.cuda.device_count()
        if max(world_sizes) > have:
            raise ValueError(f"world size {max(world_sizes)} needs that many GPUs; {have} visible")
    elif device != "cpu":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")


def merge_rows(path: Path, rows: pd.DataFrame) -> pd.DataFrame:
    """The file's rows of other world sizes, plus `rows` (which replace their world size's)."""
    if path.is_file():
        old = schema.read_table(path, "scaling")
        rows = pd.concat([old[~old["world_size"].isin(rows["world_size"])], rows], ignore_index=True)
    return rows.sort_values(["world_size", "rank", "micro_step"], ignore_index=True)


def scale(config: str | Config, world_sizes: str | list[int], *, preset: str = "smoke", out: str = "data",
          device: str | None = None, micro_steps: int | None = None, warmup: int | None = None,
          timeout_s: int = 3600) -> Path:
    """Launch one torchrun per world size; returns the table's path."""
    from medddpm.measure.env import device_name, gpu_slug
    from medddpm.presets import get_preset

    config = get_config(config)
    sizes = parse_world_sizes(world_sizes)
    get_preset(preset)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check(config, sizes, device=device)
    for name, value in (("micro_steps", micro_steps), ("warmup", warmup)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < (1 if name == "micro_steps" else 0)):
            positive = "positive" if name == "micro_steps" else "non-negative"
            raise ValueError(f"{name} must be a {positive} int, got {value!r}")
    slug = gpu_slug(device_name(torch.device(device)))
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the ranks must not find a GPU (init_from_env picks CUDA if it can)
    root = str(REPO)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    for n in sizes:
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # the machine's cores split among the ranks (torchrun would give every rank one thread, and
            # a single rank all of them): each world size then uses the whole machine
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "medddpm.measure.scaling", "--config", config.name, "--preset", preset, "--out", str(out)]
        cmd += [a for k, v in (("--micro-steps", micro_steps), ("--warmup", warmup)) if v is not None for a in (k, str(v))]
        print(f"scale: {config.name} on {n} rank(s) ({device})", file=sys.stderr)
        done = subprocess.run(cmd, env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"torchrun with {n} rank(s) exited {done.returncode}; rows of other world sizes are kept")
    return scaling_table(out, slug, config.name)


def _worker(argv: list[str] | None = None) -> int:
    """One rank (started by torchrun): time this rank's DDP micro-steps; rank 0 writes the table."""
    import torch.distributed as dist

    from medddpm.train.timing import time_steps
    from medddpm.train.data import open_dataset
    from medddpm.train.distributed import cleanup, init_from_env
    from medddpm.train.engine import Engine
    from medddpm.measure.env import environment, gpu_slug
    from medddpm.presets import get_preset

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m medddpm.measure.scaling")
    p.add_argument("--config", required=True)
    p.add_argument("--preset", default="smoke")
    p.add_argument("--out", default="data")
    p.add_argument("--micro-steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config, preset = get_config(args.config), get_preset(args.preset)
    micro_steps = args.micro_steps or preset.micro_steps
    warmup = preset.warmup if args.warmup is None else args.warmup
    rank, world, _, device = init_from_env()
    engine = None
    try:
        start = dt.datetime.now(dt.timezone.utc)
        data = open_dataset("mni", size=preset.size, seed=args.seed)
        engine = Engine(preset.spec(mask_channels=data.mask_channels), config, device=device, seed=args.seed, ddp=True)
        x0, cond = (engine.prepare(t.unsqueeze(0)) for t in data[rank % len(data)])  # each rank its own pair
        timing = time_steps(lambda: engine.step((x0, cond)), device=device, warmup=warmup, steps=micro_steps,
                            desc=f"rank {rank}/{world}", progress=rank == 0)
        mine = [(i, i >= len(timing["warmup_ms"]), t) for i, t in enumerate(timing["warmup_ms"] + timing["step_ms"])]
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            env = environment(device)
            slug = gpu_slug(env["gpu_name"])
            run_id = f"{slug}/{config.name}/scaling-{world}/{start.strftime('%Y%m%dT%H%M%SZ')}"
            rows = pd.DataFrame([
                {"run_id": run_id, "gpu_name": env["gpu_name"], "gpu_slug": slug, "config": config.name,
                 "preset": preset.name, "backend": dist.get_backend(), "world_size": world, "rank": r, "micro_step": i,
                 "timed": timed, "step_ms": t, "batch": 1, "size": preset.size,
                 "threads_per_rank": torch.get_num_threads(), "torch": env["torch"], "git_commit": env["git_commit"],
                 "start_time": start.isoformat(timespec="seconds")}
                for r, part in enumerate(gathered) for i, timed, t in part])
            path = scaling_table(args.out, slug, config.name)
            schema.write_table(merge_rows(path, rows), path, "scaling")
            print(f"scale: {world} rank(s) -> {path}", file=sys.stderr)
        dist.barrier()
    finally:
        engine = None  # the DDP model first, then the group (distributed.cleanup)
        cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker())
