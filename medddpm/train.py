"""The training loop: progress bar, loss log, atomic checkpoints, and resume after a kill."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .configs import Config
from .engine import Engine
from .model import ModelSpec
from .storage import atomic_write

CHECKPOINT = "checkpoint.pt"
LOSS_LOG = "loss.jsonl"


def batch_indices(n_items: int, step: int, micro: int, *, seed: int) -> int:
    """Which item feeds micro-batch `micro` of optimizer step `step`: a pure function of its
    arguments, so a resumed run reads exactly the data an uninterrupted one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 97 + micro)
    return int(torch.randint(n_items, (1,), generator=g))


def save_checkpoint(engine: Engine, path: Path, *, extra: dict) -> None:
    state = engine.state_dict() | {"spec": engine.spec.__dict__, "config": engine.config.flags, **extra}
    atomic_write(path, lambda f: torch.save(state, f))


def train(spec: ModelSpec, config: Config | str, dataset, *, out_dir: str | os.PathLike, steps: int,
          device: torch.device | str = "cpu", grad_accum: int = 2, lr: float = 1e-5, seed: int = 0,
          save_every: int = 500, log_every: int = 10, progress: bool = True) -> Engine:
    """Train for `steps` optimizer steps (each of `grad_accum` micro-batches of one volume).

    If `out_dir` holds a checkpoint, training resumes from it. The loss of every step goes to
    `loss.jsonl`; losses are fetched from the device every `log_every` steps, not every step.
    """
    for name, value in (("steps", steps), ("grad_accum", grad_accum), ("save_every", save_every), ("log_every", log_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if getattr(dataset, "mask_channels", spec.mask_channels) != spec.mask_channels:
        raise ValueError(f"data has {dataset.mask_channels} label channels but the model expects {spec.mask_channels}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = Engine(spec, config, device=device, lr=lr, seed=seed)
    ckpt = out / CHECKPOINT
    if ckpt.exists():
        state = torch.load(ckpt, map_location=engine.device, weights_only=False)
        if state["config"] != engine.config.flags or state["spec"] != spec.__dict__:
            raise ValueError(f"{ckpt} was written by another model or configuration; use a new --out")
        engine.load_state_dict(state)
    start = engine.step_count
    log_path = out / LOSS_LOG
    _truncate_log(log_path, start)

    pending: list[tuple[int, torch.Tensor]] = []

    def flush():
        if pending:
            values = torch.stack([loss for _, loss in pending]).tolist()  # one host sync per flush
            with open(log_path, "a") as f:
                for (s, _), v in zip(pending, values):
                    f.write(json.dumps({"step": s, "loss": v}) + "\n")
            bar.set_postfix(loss=f"{values[-1]:.4f}")
            pending.clear()

    bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"train {engine.config.name}", disable=not progress)
    for step in bar:
        batches = []
        for micro in range(grad_accum):
            image, cond = dataset[batch_indices(len(dataset), step, micro, seed=seed)]
            batches.append((engine.prepare(image[None]), engine.prepare(cond[None])))
        pending.append((step + 1, engine.step(batches)))
        if (step + 1) % log_every == 0:
            flush()
        if (step + 1) % save_every == 0 or step + 1 == steps:
            flush()
            save_checkpoint(engine, ckpt, extra={"seed": seed, "grad_accum": grad_accum, "lr": lr})
    flush()
    return engine


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint, so a resumed run neither repeats nor loses steps."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_write(path, lambda f: f.write("".join(line + "\n" for line in keep).encode()))


def read_loss_log(out_dir: str | os.PathLike) -> list[dict]:
    path = Path(out_dir) / LOSS_LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
