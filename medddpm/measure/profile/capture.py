"""Run training steps of one configuration for an outside profiler (Nsight Compute).

`python -m medddpm.measure.profile.capture --config opt1 --preset paper` runs warm-up steps, then one step inside the
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

from medddpm.train.data import real_batch
from medddpm.train.engine import Engine
from medddpm.presets import get_preset
from medddpm.model.flops import layer_name
from medddpm.model.unet import parse_size

NVTX_RANGE = "medddpm_step"
STOPPED = "medddpm.capture: stopped"  # medddpm.measure.profile.ncu.STOPPED


def name_layers(model: torch.nn.Module, *, on_backward=None) -> list:
    """NVTX push/pop ranges named by `layer_name` around every Conv3d's forward, and around its backward
    (hooks on the output's autograd node, which run on the thread that runs the node), so that a profiler
    can tell which layer each convolution kernel computes. Eager models only: hooks are not traced into a
    compiled graph, nor replayed by a CUDA graph. `on_backward(name)` is called before each layer's backward.
    Returns the hook handles."""
    nvtx = torch.cuda.nvtx
    handles = []

    def before(conv, args):
        nvtx.range_push(layer_name(conv, args[0]))

    def after(conv, args, out):
        nvtx.range_pop()
        if out.grad_fn is not None:
            name = f"{layer_name(conv, args[0])} backward"

            def push(grad_out):  # a pre-hook that returns nothing leaves the gradients as they are
                if on_backward is not None:
                    on_backward(name)
                nvtx.range_push(name)

            def pop(grad_in, grad_out):
                nvtx.range_pop()

            out.grad_fn.register_prehook(push)
            out.grad_fn.register_hook(pop)

    for m in model.modules():
        if isinstance(m, torch.nn.Conv3d):
            handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    return handles


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
    p.add_argument("--from-backward", nargs="?", const="", metavar="LAYER",
                   help="start the step's range at the first layer's backward, or at the backward of LAYER (a layer "
                        "range's name, e.g. 'conv3d 64>64 k3 s2 @128x128x128'; eager configurations), so that a "
                        "profiler filtering on it skips what comes before")
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
    eager = not (engine.run.compile or engine.run.cuda_graphs)
    late = args.from_backward is not None
    if late and not eager:
        p.error(f"--from-backward needs an eager configuration; {args.config} compiles or replays a CUDA graph")
    # A process-wide start/end range: autograd launches the backward kernels from its own thread,
    # which a per-thread push/pop range would miss.
    handle = []

    def start(layer: str = "") -> None:  # once, at the step or at the first backward that qualifies
        if not handle and layer.startswith(args.from_backward or ""):
            handle.append(torch.cuda.nvtx.range_start(NVTX_RANGE))

    if eager:
        name_layers(engine.model, on_backward=start if late else None)
    if not late:
        start()
    engine.step((x0, cond))
    torch.cuda.synchronize()
    if not handle:
        p.error(f"no layer's backward starts with {args.from_backward!r}: nothing was profiled")
    torch.cuda.nvtx.range_end(handle[0])
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step((x0, cond))
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
