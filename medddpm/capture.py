"""Run training steps of one configuration for an outside profiler (Nsight Compute).

`python -m medddpm.capture --config opt1 --preset paper` runs warm-up steps, then one step inside the
NVTX range `medddpm_step`, so that `ncu --nvtx --nvtx-include "medddpm_step/"` profiles exactly
one training step and none of the warm-up (compilation, cuDNN autotuning).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time

import torch

from .bench import real_batch
from .engine import Engine
from .measure import get_preset
from .model import parse_size

NVTX_RANGE = "medddpm_step"
STOPPED = "medddpm.capture: stopped"  # medddpm.ncu.STOPPED


def _stop(seconds: float) -> None:
    time.sleep(seconds)
    print(f"{STOPPED} after {seconds:g} s", file=sys.stderr, flush=True)
    os._exit(0)  # from the timer thread: the main thread is inside a (replayed) kernel launch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="baseline")
    p.add_argument("--preset", default="paper", help="model shape and size of a measurement preset")
    p.add_argument("--size", type=parse_size, help="override the preset's input size: N or DxHxW")
    p.add_argument("--batch", type=int, default=1, help="volumes per micro-step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trace", help="also write a torch.profiler (Kineto) trace of one more step here")
    p.add_argument("--stop-after", type=float, metavar="S",
                   help="exit after S seconds, wherever the step is: under ncu, what was profiled is kept")
    args = p.parse_args(argv)
    if args.stop_after:  # a daemon: a step done in time exits as usual
        threading.Thread(target=_stop, args=(args.stop_after,), daemon=True).start()
    preset = get_preset(args.preset)
    spec = dataclasses.replace(preset, size=args.size or preset.size).spec()
    engine = Engine(spec, args.config, device="cuda", ema=False)
    x0, cond = (engine.prepare(t) for t in real_batch(spec, batch=args.batch))
    for _ in range(args.warmup):
        engine.step((x0, cond))
    torch.cuda.synchronize()
    # A process-wide start/end range: autograd launches the backward kernels from its own thread,
    # which a per-thread push/pop range would miss.
    handle = torch.cuda.nvtx.range_start(NVTX_RANGE)
    engine.step((x0, cond))
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_end(handle)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step((x0, cond))
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
