"""Data-parallel training over several GPUs (or CPU processes): torchrun's entry point, one process per rank.

    torchrun --nproc-per-node 4 -m medddpm.cli.distributed --steps 10 --out runs/ddp --size 64

Every rank reads its own shard of the micro-batches, DistributedDataParallel averages the gradients, and rank 0
alone writes the checkpoint and logs (`medddpm.train.distributed` joins and leaves the process group). The global
batch is world size x --grad-accum micro-batches of one volume. Besides `loss.jsonl` (averaged over ranks),
OUT/ranks.jsonl holds every rank's step times: {"step", "rank", "world_size", "step_ms"}. The model and
configuration options are `python -m medddpm train`'s (`medddpm.cli.args`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from medddpm.cli.args import add_config_args, add_model_args, config_from, open_data, positive, seed_arg, spec_from


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from medddpm.train.distributed import cleanup, init_from_env
    from medddpm.train.loop import train

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m medddpm.cli.distributed",
                                description="data-parallel Med-DDPM training (resumes from OUT/checkpoint.pt)")
    add_model_args(p, mask_default=None)
    add_config_args(p)
    p.add_argument("--data", help="'mni' (embedded templates; the default), 'mni-brats', or a folder with mask/ and "
                                  "image/ (or seg/, t1/, t1ce/, t2/, flair/)")
    p.add_argument("--pairs", type=positive, default=8, help="number of embedded training pairs (with --data mni)")
    p.add_argument("--steps", type=positive, default=100, help="optimizer steps")
    p.add_argument("--grad-accum", type=positive, default=1, help="micro-batches per rank and step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=seed_arg, default=0)
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
