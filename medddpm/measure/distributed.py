"""Data-parallel training over several GPUs (or CPU processes) with torch.distributed.

Launch one process per GPU with torchrun; every rank reads its own shard of the micro-batches,
DistributedDataParallel averages the gradients, and rank 0 alone writes the checkpoint and logs:

    torchrun --nproc-per-node 4 -m medddpm.measure.distributed --steps 10 --out runs/ddp --size 64

Backend: NCCL when CUDA is available (one GPU per local rank), else gloo on the CPU. The global
batch is world size x --grad-accum micro-batches of one volume. Besides `loss.jsonl` (averaged over
ranks), OUT/ranks.jsonl holds every rank's step times: {"step", "rank", "world_size", "step_ms"}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def init_from_env(backend: str | None = None, *, timeout_s: float = 600) -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Returns (rank, world_size, local_rank, device). Without torchrun's variables this is a
    world of one (rank 0), which still needs MASTER_ADDR/MASTER_PORT for the rendezvous."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local} but only {torch.cuda.device_count()} CUDA devices visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = backend or "nccl"
    else:
        device = torch.device("cpu")
        backend = backend or "gloo"
    if not dist.is_initialized():
        kw = {"device_id": device} if device.type == "cuda" and backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=dt.timedelta(seconds=timeout_s), **kw)
    return rank, world, local, device


def is_main() -> bool:
    """True on rank 0, and in a process that is not part of a process group."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def cleanup() -> None:
    """Destroy the process group; call it after letting go of the DDP model.

    If a DDP Reducer holds the last reference to a gloo group, the group dies in the Reducer's
    destructor, which joins the group's worker threads with the GIL held, while a worker finishing its
    last work waits for the GIL: the rank hangs at exit (pytorch/pytorch#56297; seen in CI, one rank
    of two stuck in `~ProcessGroupGloo` under `~Reducer`). Destroyed from here instead, the group goes
    through its Python binding, which releases the GIL first (pytorch/pytorch#154976)."""
    gc.collect()  # DDP's hooks make reference cycles: the Reducer goes only with a collection
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from medddpm.cli.args import add_config_args, add_model_args, config_from, open_data, positive, spec_from
    from medddpm.train.loop import train

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m medddpm.measure.distributed",
                                description="data-parallel Med-DDPM training (resumes from OUT/checkpoint.pt)")
    add_model_args(p, mask_default=None)
    add_config_args(p)
    p.add_argument("--data", help="'mni' (embedded templates; the default), 'mni-brats', or a folder with mask/ and "
                                  "image/ (or seg/, t1/, t1ce/, t2/, flair/)")
    p.add_argument("--pairs", type=positive, default=8, help="number of embedded training pairs (with --data mni)")
    p.add_argument("--steps", type=positive, default=100, help="optimizer steps")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per rank and step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=positive, default=500)
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with CUDA, else gloo")
    p.add_argument("--out", required=True, help="folder for checkpoint.pt, loss.jsonl and ranks.jsonl")
    args = p.parse_args(argv)

    config = config_from(args)  # bad arguments fail here, before the rendezvous
    data = open_data(args)
    spec = spec_from(args, data.mask_channels, getattr(data, "image_channels", 1))
    rank, world, _, device = init_from_env(args.backend)
    engine = None
    try:
        engine = train(spec, config, data, out_dir=args.out, steps=args.steps, device=device,
                       grad_accum=args.grad_accum, lr=args.lr, seed=args.seed, save_every=args.save_every,
                       log_every=args.log_every, ddp=True)
        if rank == 0:
            print(f"trained {engine.step_count} steps on {world} ranks ({dist.get_backend()}); "
                  f"checkpoint in {Path(args.out) / 'checkpoint.pt'}", file=sys.stderr)
    finally:
        engine = None  # the DDP model first, then the group (cleanup)
        cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
