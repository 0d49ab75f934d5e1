"""The U-Net's two narrow convolutions alone on the GPU: cuDNN, cuDNN zero-padded, and (the output) tap GEMMs.

Times forward + backward of the stem (C_in 4 -> 64) and the output layer (64 -> 1) at 128^3 in bf16
autocast, channels-last, each way, eager and compiled (`timing.time_steps`: warm-up, then CUDA events with
no host sync between steps), and names the kernels each spends its time in (torch.profiler). What `tap_gemm` is for: data/nvidia-h200/NOTES.md, session 12. The backward starts from
the mean square of the output, whose own kernels are part of each time (the same for every way).
`--pad-widths 8,16` also pads to 16 channels ("padded16"): whether cuDNN then leaves its sm80 kernels.
Usage: python scripts/narrow-convs.py [--size 128] [--steps 20] [--pad-widths 8] [--json F]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from medddpm import model  # noqa: E402
from medddpm.train.timing import summarize, time_steps  # noqa: E402
from medddpm.measure.env import environment  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pad-widths", default="8", help="comma-separated channel multiples to pad to (PaddedConv3d)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    widths = [int(w) for w in args.pad_widths.split(",")]
    assert all(w >= 1 for w in widths), f"pad widths must be positive, got {args.pad_widths!r}"
    # kind -> (module class, the alignment PaddedConv3d pads to); "padded" is the model's own (8)
    kinds = {"cudnn": (nn.Conv3d, model.ALIGN_CHANNELS)}
    kinds |= {"padded" + ("" if w == model.ALIGN_CHANNELS else str(w)): (model.PaddedConv3d, w) for w in widths}
    kinds["taps"] = (model.TapConv3d, model.ALIGN_CHANNELS)
    assert torch.cuda.is_available(), "this measures cuDNN and cuBLAS kernels: it needs a GPU"
    torch.backends.cudnn.benchmark = True
    rows = []
    for layer, (c_in, c_out) in {"stem": (4, 64), "output": (64, 1)}.items():
        shape = (1, c_in, args.size, args.size, args.size)
        x = torch.randn(shape, device="cuda").to(memory_format=torch.channels_last_3d)
        x.requires_grad_(layer == "output")  # the stem's input (noisy image and labels) needs no gradient
        for kind, (cls, align) in kinds.items():
            if kind == "taps" and c_out > c_in:
                continue  # TapConv3d is for a narrow output
            model.ALIGN_CHANNELS = align  # read by PaddedConv3d at each call
            for compiled in (False, True):
                torch._dynamo.reset()
                torch.manual_seed(0)
                conv = cls(c_in, c_out, 3, padding=1).cuda().to(memory_format=torch.channels_last_3d)
                f = torch.compile(conv) if compiled else conv

                def step():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = f(x)
                    y.float().square().mean().backward()

                timing = time_steps(step, device=torch.device("cuda"), warmup=3, steps=args.steps, progress=False)
                s = summarize(timing["step_ms"])
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                kernels = sorted(((e.key, e.device_time_total / 1e3) for e in prof.key_averages()
                                  if e.device_time_total > 0), key=lambda kv: -kv[1])
                row = {"layer": layer, "kind": kind, "compiled": compiled,
                       "step_median_ms": s["median"], "step_p10_ms": s["p10"], "step_p90_ms": s["p90"],
                       "kernels": [[name[:110], round(ms, 4)] for name, ms in kernels[:6]]}
                rows.append(row)
                print(f"{layer:6s} {kind:6s} compiled={compiled!s:5s} {s['median']:.3f} ms "
                      f"({s['p10']:.3f}-{s['p90']:.3f})", flush=True)
                for name, ms in row["kernels"]:
                    print(f"    {ms:8.4f} ms  {name}")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(torch.device("cuda")), "size": args.size,
                                         "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
