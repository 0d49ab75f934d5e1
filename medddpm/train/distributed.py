"""The process group of data-parallel training over several GPUs (or CPU processes): joined from what torchrun
describes (`init_from_env`) and left so that no rank hangs at exit (`cleanup`). Each rank then feeds its own
micro-batches, and DistributedDataParallel averages the gradients (`Engine(..., ddp=True)`, `train(..., ddp=True)`).

Backend: NCCL when CUDA is available (one GPU per local rank), else gloo on the CPU. Training's torchrun entry
point is `medddpm.cli.distributed`; the scaling measurement's is `medddpm.measure.scaling`.
"""

from __future__ import annotations

import datetime as dt
import gc
import os

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
