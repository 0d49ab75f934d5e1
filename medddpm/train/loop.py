"""The training loop: progress bar, loss log, atomic checkpoints, and resume after a kill."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch

from medddpm.progress import progress_bar
from medddpm.errors import UserError
from medddpm.configs import Config, ConfigError, get_config
from medddpm.train import checkpoint
from medddpm.train.checkpoint import CHECKPOINT, CheckpointError, load_error, writing
from medddpm.train.engine import Engine
from medddpm.train.loader import DeviceLoader, closing_with
from medddpm.model.unet import ModelSpec
from medddpm.store.lock import output_lock
from medddpm.store.storage import Interrupted, atomic_write, read_regular
from medddpm.train.timing import StepTimer

LOSS_LOG = "loss.jsonl"
RANK_LOG = "ranks.jsonl"  # under DDP: one line per rank and step, {"step", "rank", "world_size", "step_ms"}


class Diverged(UserError):
    """Training reached a non-finite loss on a step that fp16's loss scaler did not skip: the run stops there, its
    log holds the steps up to that one, and its last checkpoint (written before the loss went bad) is kept."""

    def __init__(self, step: int, loss: float, kept: int):
        self.step, self.loss, self.kept = step, loss, kept
        where = f"the checkpoint of step {kept} is kept" if kept else "no checkpoint had been written"
        super().__init__(f"training diverged: loss {loss} at step {step} ({where})")


def batch_indices(n_items: int, step: int, micro: int, *, seed: int) -> int:
    """Which item feeds micro-batch `micro` of optimizer step `step`: a pure function of its
    arguments, so a resumed run reads exactly the data an uninterrupted one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 97 + micro)
    return int(torch.randint(n_items, (1,), generator=g))


def step_noise(shape: tuple[int, ...], timesteps: int, step: int, micro: int, *, seed: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The diffusion timesteps and noise of micro-batch `micro` of optimizer step `step`, drawn on `device` from a
    generator seeded by its arguments alone (as `batch_indices` picks the data): every configuration trained with
    `fixed_noise` sees the same ones, whether its step draws them eagerly, compiled or in a CUDA graph."""
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + step * 97 + micro + 500_009)
    t = torch.randint(timesteps, shape[:1], generator=g, device=device)
    return t, torch.randn(shape, generator=g, device=device)


def save_checkpoint(engine: Engine, path: Path, *, extra: dict) -> None:
    state = engine.state_dict() | {"spec": engine.spec.__dict__, "config": engine.config.flags, **extra}
    checkpoint.save(state, path)


def resume_differences(state: dict, spec: ModelSpec, config: Config, hyper: dict) -> list[str]:
    """What differs between a checkpoint's run and the one asked for, as 'name saved -> asked' (the model's
    spec, the configuration's switches, and the `hyper` values the checkpoint records)."""
    try:  # switches added since the checkpoint was written take their defaults (Config fills them in)
        saved_flags = Config("saved", **state["config"]).flags
    except (ConfigError, TypeError) as e:
        raise ValueError(f"the checkpoint's configuration is not one of this version ({e})".splitlines()[0]) from None
    saved_spec = {k: tuple(v) if isinstance(v, list) else v for k, v in state["spec"].items()}
    pairs = [(k, saved_spec.get(k), v) for k, v in spec.__dict__.items()]
    pairs += [(k, saved_flags.get(k), v) for k, v in config.flags.items()]
    pairs += [(k, state[k], v) for k, v in hyper.items() if k in state]
    return [f"{k} {saved!r} -> {asked!r}" for k, saved, asked in pairs if saved != asked]


def check_lr(lr) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")


def train(spec: ModelSpec, config: Config | str, dataset, *, out_dir: str | os.PathLike, steps: int,
          device: torch.device | str = "cpu", grad_accum: int = 2, lr: float = 1e-5, seed: int = 0,
          save_every: int = 500, log_every: int = 10, progress: bool = True, ddp: bool = False,
          fixed_noise: bool = False, allow_changed: bool = False) -> Engine:
    """Train for `steps` optimizer steps (each of `grad_accum` micro-batches of one volume).

    If `out_dir` holds a checkpoint, training resumes from it; a checkpoint of another model, configuration,
    seed, lr or grad_accum is refused (naming the differences) unless `allow_changed`, in which case the run
    goes on with the values asked for (the optimizer takes the new lr). The loss of every step goes to
    `loss.jsonl`; losses are fetched from the device every `log_every` steps, not every step. One training
    at a time writes into `out_dir` (`medddpm.store.lock`): a second fails at once, naming the first.

    `ddp=True` (inside an initialised process group, see `medddpm.train.distributed`): data parallelism.
    Each rank takes its own `grad_accum` micro-batches (global batch = world size x grad_accum,
    the same items a single process with world size x grad_accum micro-batches reads), gradients
    are averaged over the ranks, and only rank 0 writes the checkpoint, `loss.jsonl` (loss averaged
    over ranks) and `ranks.jsonl` (every rank's step times).

    `fixed_noise`: each micro-batch's timesteps and noise come from `step_noise`, a function of the seed and
    the step alone, so that runs of different configurations from one seed differ by their numerics only.
    """
    for name, value in (("steps", steps), ("grad_accum", grad_accum), ("save_every", save_every), ("log_every", log_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    check_lr(lr)
    if getattr(dataset, "mask_channels", spec.mask_channels) != spec.mask_channels:
        raise ValueError(f"data has {dataset.mask_channels} label channels but the model expects {spec.mask_channels}")
    if getattr(dataset, "image_channels", spec.image_channels) != spec.image_channels:
        raise ValueError(f"data has {dataset.image_channels} image channels but the model predicts {spec.image_channels}")
    rank, world = 0, 1
    if ddp:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    out = Path(out_dir)
    with contextlib.ExitStack() as held:
        error = None
        if main:  # rank 0 alone writes, so it alone holds the folder
            try:
                held.enter_context(output_lock(out, what="training"))
                with writing(out, "making the training folder"):
                    out.mkdir(parents=True, exist_ok=True)
            except ValueError as e:
                error = e
        if ddp:  # every rank learns whether rank 0 holds the folder: none waits at a collective for a rank that left
            said = [str(error) if error else ""]
            dist.broadcast_object_list(said, src=0)
            error = error or (ValueError(said[0]) if said[0] else None)
        if error:
            raise error
        return _train(spec, get_config(config), dataset, out=out, steps=steps, device=device, grad_accum=grad_accum,
                      lr=lr, seed=seed, save_every=save_every, log_every=log_every, progress=progress, ddp=ddp,
                      fixed_noise=fixed_noise, allow_changed=allow_changed, rank=rank, world=world)


def _train(spec, config, dataset, *, out, steps, device, grad_accum, lr, seed, save_every, log_every, progress, ddp,
           fixed_noise, allow_changed, rank, world) -> Engine:
    main = rank == 0
    if ddp:
        import torch.distributed as dist
    ckpt = out / CHECKPOINT
    hyper = {"seed": seed, "grad_accum": grad_accum, "lr": lr}
    state = None
    if os.path.lexists(ckpt):  # a symlink that leads nowhere is refused by `read`, not taken for no checkpoint
        # read on the CPU: the RNG states stay CPU tensors, and loading moves the rest to the device
        state = checkpoint.read(ckpt, map_location="cpu")
        if state.get("world_size", 1) != world:
            raise ValueError(f"{ckpt} was written by {state.get('world_size', 1)} ranks, not {world}; use a new --out")
        changed = resume_differences(state, spec, config, hyper)
        if changed and not allow_changed:
            raise ValueError(f"{ckpt} was written by another run ({'; '.join(changed)}): resume with its values, "
                             "use a new --out, or pass --allow-changed to go on with the new ones")
    engine = Engine(spec, config, device=device, lr=lr, seed=seed, ddp=ddp)
    if state is not None:
        try:
            engine.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{ckpt} does not fit this model ({load_error(e)})") from None
        for group in engine.opt.param_groups:  # the checkpoint's optimizer state carries the lr it ran with
            group["lr"] = lr
    start = engine.step_count
    log_path, rank_path = out / LOSS_LOG, out / RANK_LOG
    if main:
        _truncate_log(log_path, start)
        if ddp:
            _truncate_log(rank_path, start)
    extra = hyper | ({"world_size": world} if ddp else {})

    # (step, loss, the scaler's skipped-step count after it), all on the device until a flush reads them
    pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
    timer = StepTimer(engine.device) if ddp else None
    counted = {"skipped": engine.skipped_steps if engine.scaler is not None else 0, "saved": start}

    def flush():
        if not pending:
            return
        if ddp:  # one collective per flush: every rank's losses and step times, gathered everywhere
            local = torch.cat([torch.stack([loss for _, loss, _ in pending]).float(),
                               torch.tensor(timer.read()[0], device=engine.device, dtype=torch.float32)])
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            table = torch.stack(gathered).cpu()  # (world, 2 * pending)
            values = table[:, :len(pending)].double().mean(0).tolist()
            times = table[:, len(pending):].tolist()
        else:
            values = torch.stack([loss for _, loss, _ in pending]).tolist()  # one host sync per flush
        skipped = (torch.stack([n for *_, n in pending]).tolist() if engine.scaler is not None
                   else [counted["skipped"]] * len(pending))
        bad = None  # the first non-finite loss of a step the scaler did not skip (a skipped one changed nothing)
        for (s, *_), v, n in zip(pending, values, skipped):
            if bad is None and not math.isfinite(v) and n == counted["skipped"]:
                bad = (s, v)
            counted["skipped"] = n
        if bad:  # the log ends at the step that went bad
            keep = [i for i, (s, *_) in enumerate(pending) if s <= bad[0]]
            pending[:], values = [pending[i] for i in keep], [values[i] for i in keep]
        if main:
            _append(log_path, [{"step": s, "loss": v} for (s, *_), v in zip(pending, values)])
            if ddp:
                _append(rank_path, [{"step": s, "rank": r, "world_size": world, "step_ms": times[r][i]}
                                    for i, (s, *_) in enumerate(pending) for r in range(world)])
            bar.set_postfix(loss=f"{values[-1]:.4f}")
        pending.clear()
        if bad:
            raise Diverged(bad[0], bad[1], counted["saved"])

    bar = progress_bar(range(start, steps), initial=start, total=steps, desc=f"train {engine.config.name}",
                       progress=progress and main)
    # items read ahead by worker processes, in the order batch_indices gives (the loader shuts them down when the
    # loop ends, by an error or Ctrl-C too)
    order = (batch_indices(len(dataset), s, rank * grad_accum + m, seed=seed) for s in range(start, steps)
             for m in range(grad_accum))
    items = iter(DeviceLoader(dataset, order, device=engine.device))
    try:  # Ctrl-C: one line saying which checkpoint a resumed run starts from
        for step in closing_with(bar, items):
            batches = []
            for micro in range(grad_accum):
                image, cond = next(items)
                batch = (engine.prepare(image), engine.prepare(cond))
                if fixed_noise:
                    batch += step_noise(batch[0].shape, engine.diffusion.timesteps, step, rank * grad_accum + micro,
                                        seed=seed, device=engine.device)
                batches.append(batch)
            if ddp:
                # Each rank draws its own timesteps and noise; reseeding per step keeps resume exact.
                torch.manual_seed(seed * 1_000_003 + step * 1009 + rank * 7919 + 1)
                timer.start()
            loss = engine.step(batches)
            pending.append((step + 1, loss, engine.skipped_counter() if engine.scaler is not None else None))
            if ddp:
                timer.stop()
            if (step + 1) % log_every == 0:
                flush()
            if (step + 1) % save_every == 0 or step + 1 == steps:
                flush()
                if main:
                    save_checkpoint(engine, ckpt, extra=extra)
                counted["saved"] = step + 1
    except KeyboardInterrupt:
        raise Interrupted(f"the checkpoint of step {counted['saved']} in {out} is kept; the same command resumes "
                          "from it" if counted["saved"] else
                          f"no checkpoint had been written to {out} yet; the same command starts again") from None
    flush()
    return engine


def _append(path: Path, records: list[dict]) -> None:
    """Append log lines in one write; a failed write (a full disk) is cut back off, so the log holds whole
    lines only and a resumed run finds it as the last checkpoint left it."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    with writing(path, "writing the log"), open(path, "ab") as f:
        size = f.tell()
        try:
            f.write(data)
            f.flush()
        except OSError:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past the checkpoint, so a resumed run neither repeats nor loses steps (a line a killed
    run left half-written is past it too)."""
    if not os.path.lexists(path):
        return
    keep = []
    for line in read_regular(path, "the loss log").decode(errors="replace").splitlines():
        try:
            if line and json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    with writing(path, "rewriting the log"):
        atomic_write(path, lambda f: f.write("".join(line + "\n" for line in keep).encode()))


def read_loss_log(out_dir: str | os.PathLike) -> list[dict]:
    path = Path(out_dir) / LOSS_LOG
    if not os.path.lexists(path):
        return []
    return [json.loads(line) for line in read_regular(path, "the loss log").decode().splitlines() if line]
