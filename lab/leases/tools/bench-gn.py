#!/usr/bin/env python3
"""GroupNorm-SiLU alone on the GPU, at best's shapes: aten (eager), fused (compiled, best's kind) and triton.

For each GroupNorm of best's U-Net at 128^3 (found by running the model on the meta device: channels, volume,
whether the SiLU and the timestep shift are part of it, calls a step), bf16 channels-last activations: the forward
(training mode) and the backward of each kind, as GroupNorm32 computes them in the model. Each pass is captured
in a CUDA graph of one call per rotating input set (enough sets to overflow L2), after three warm-up calls on a
side stream (compilation, Triton's JIT), and its replays are timed with CUDA events: median and p10-p90 of
`--repeats`, per call. Where capture fails the pass is timed as back-to-back calls on the stream instead (the row
says which). Before timing, each kind's output and input gradient are checked against the fused kind's.

The floor of each pass in bytes, the activation x of B*C*D*H*W bf16 elements: forward 3x (x read for the
statistics, read again to normalize, y written), backward 5x (x and dy read for the two sums, read again for dx,
dx written). GB/s is that floor over the time; "of roof" is against the DRAM roof measured here (a 1 GiB
device-to-device copy, medddpm.measure.timing.roofs). The totals weight each shape by its calls a step.

Usage (repository root, a GPU): python3 lab/leases/tools/bench-gn.py [--kinds aten,fused,triton] [--min-mb 8]
    [--repeats 30] [--triton-tiles 4096] [--json $OUT/bench-gn.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from medddpm.measure.env import environment  # noqa: E402
from medddpm.measure.timing.roofs import GPU_SIZES, bandwidth  # noqa: E402
from medddpm.model import group_norm_triton  # noqa: E402
from medddpm.model.group_norm import GroupNorm32  # noqa: E402
from medddpm.model.unet import ModelSpec, UNet3D  # noqa: E402

CL = torch.channels_last_3d


def best_norms(size: int, mask_channels: int) -> list[dict]:
    """Every distinct GroupNorm call of the U-Net's forward (best's model), with its calls a step."""
    spec = ModelSpec(size=size, mask_channels=mask_channels)
    with torch.device("meta"):
        model = UNet3D(spec, group_norm="fused")
    calls = collections.Counter()

    def hook(module, args, _out):
        x = args[0]
        calls[(x.shape[0], x.shape[1], tuple(x.shape[2:]), module.silu, len(args) > 1 and args[1] is not None)] += 1

    for m in model.modules():
        if isinstance(m, GroupNorm32):
            m.register_forward_hook(hook)
    model(torch.empty(1, spec.in_channels, *spec.shape, device="meta"), torch.zeros(1, dtype=torch.long, device="meta"))
    rows = [dict(batch=b, channels=c, spatial=list(s), silu=silu, shift=shift, calls=n,
                 mb=b * c * math.prod(s) * 2 / 1e6) for (b, c, s, silu, shift), n in calls.items()]
    return sorted(rows, key=lambda r: -r["mb"])


class NormSiLU(nn.Module):
    """The norm as the model calls it: GroupNorm32 of `kind`, the SiLU after it, the shift added before it."""

    def __init__(self, channels: int, kind: str, silu: bool):
        super().__init__()
        takes_silu = silu and kind in ("fused", "triton")
        self.norm = GroupNorm32(32, channels, kind=kind, silu=takes_silu)
        self.act = nn.SiLU() if silu and not takes_silu else nn.Identity()

    def forward(self, x, shift=None):
        return self.act(self.norm(x, shift))


def _inputs(shape: dict, sets: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    b, c, s = shape["batch"], shape["channels"], shape["spatial"]

    def rand(*dims):
        return torch.randn(*dims, generator=g, device=device, dtype=torch.bfloat16)

    xs = [(rand(b, c, *s) * 2 + 0.5).to(memory_format=CL).requires_grad_() for _ in range(sets)]
    shifts = [rand(b, c).requires_grad_() if shape["shift"] else None for _ in range(sets)]
    dys = [rand(b, c, *s).to(memory_format=CL) for _ in range(sets)]
    return xs, shifts, dys


def _module(shape: dict, kind: str, device) -> nn.Module:
    module = NormSiLU(shape["channels"], kind, shape["silu"]).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
    return torch.compile(module, dynamic=False) if kind == "fused" else module  # static shapes, as best compiles


def _stats(ms: list[float], per: int) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"ms": statistics.median(ms) / per, "p10": q[0] / per, "p90": q[-1] / per}


def _time(fn, repeats: int, per: int, *, pool=None) -> tuple[dict, torch.cuda.CUDAGraph | None]:
    """fn (per calls) warmed up on a side stream, captured in a CUDA graph and its replays timed; per call. Where
    capture fails, back-to-back calls on the stream instead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph, how = torch.cuda.CUDAGraph(), "graph"
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 -- the stream's timing is the fallback, and the row says so
        print(f"  capture failed ({type(e).__name__}: {e}); timing on the stream", flush=True)
        torch.cuda.synchronize()
        graph, how, run = None, "stream", fn
    run()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return _stats([s.elapsed_time(e) for s, e in pairs], per) | {"timing": how}, graph


def measure(shape: dict, kind: str, args, device, l2_bytes: int) -> dict:
    x_bytes = shape["mb"] * 1e6
    sets = max(2, min(16, math.ceil(3 * l2_bytes / x_bytes)))
    module = _module(shape, kind, device)
    xs, shifts, dys = _inputs(shape, sets, device)
    params = list(module.parameters())
    outs: list = [None] * sets

    def forward():
        for i in range(sets):
            outs[i] = module(xs[i], shifts[i])

    def backward():
        for i in range(sets):
            leaves = [xs[i], *params] + ([shifts[i]] if shifts[i] is not None else [])
            torch.autograd.grad(outs[i], leaves, dys[i], retain_graph=True)

    row = dict(shape, kind=kind, sets=sets)
    fwd, graph = _time(forward, args.repeats, sets)
    bwd, _ = _time(backward, args.repeats, sets, pool=graph.pool() if graph is not None else None)
    for name, t, floor in (("fwd", fwd, 3), ("bwd", bwd, 5)):
        row |= {f"{name}_{k}": v for k, v in t.items()}
        row[f"{name}_floor_bytes"] = floor * x_bytes
        row[f"{name}_gbps"] = floor * x_bytes / (t["ms"] / 1e3) / 1e9
    return row


def check(shape: dict, kinds: list[str], device) -> dict:
    """Each kind's output and input gradient against the fused kind's, on one random input: relative L2 error."""
    xs, shifts, dys = _inputs(shape, 1, device, seed=7)
    got = {}
    for kind in kinds:
        module = _module(shape, kind, device)
        y = module(xs[0], shifts[0])
        (dx,) = torch.autograd.grad(y, xs[0], dys[0])
        got[kind] = y.float(), dx.float()
        del module
    ref = got.get("fused") or next(iter(got.values()))
    return {kind: [((a - r).norm() / r.norm()).item() for a, r in zip(v, ref)] for kind, v in got.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--mask-channels", type=int, default=3)
    ap.add_argument("--kinds", default="aten,fused,triton")
    ap.add_argument("--min-mb", type=float, default=8.0, help="only shapes whose activation has this many MB or more")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--triton-tiles", default=str(group_norm_triton.TILE),
                    help="comma-separated tile sizes (elements) for the triton kind: one row each")
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench-gn.json")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench-gn times CUDA kernels: run it on a GPU"
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    # one compiled graph per shape (and per module of the check), all of the same code: past Dynamo's limit of
    # recompilations it would run the rest eagerly
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    props = torch.cuda.get_device_properties(device)
    roof = bandwidth(device, GPU_SIZES)
    print(f"{props.name}: DRAM roof {roof['value'] / 1e9:.0f} GB/s (p10-p90 {roof['p10'] / 1e9:.0f}-"
          f"{roof['p90'] / 1e9:.0f}), L2 {props.L2_cache_size / 2**20:.0f} MiB", flush=True)

    shapes = best_norms(args.size, args.mask_channels)
    kept = [s for s in shapes if s["mb"] >= args.min_mb]
    share = sum(s["mb"] * s["calls"] for s in kept) / sum(s["mb"] * s["calls"] for s in shapes)
    kinds = args.kinds.split(",")
    tiles = [int(t) for t in args.triton_tiles.split(",")]
    result = {"device": props.name, "environment": environment(device), "triton": group_norm_triton.triton.__version__,
              "roof": roof, "shapes": shapes, "measured_share_of_bytes": share, "rows": [], "checks": [],
              "errors": []}
    for shape in kept:
        label = f"{shape['channels']}x{'x'.join(map(str, shape['spatial']))}"
        try:
            result["checks"].append(dict(shape, errors=check(shape, kinds, device)))
        except Exception:  # noqa: BLE001 -- one failing shape must not cost the others
            result["errors"].append({"shape": label, "what": "check", "error": traceback.format_exc()})
        for kind in kinds:
            for tile in tiles if kind == "triton" else [None]:
                if tile is not None:
                    group_norm_triton.TILE = tile
                name = kind if tile is None or len(tiles) == 1 else f"triton@{tile}"
                t0 = time.time()
                try:
                    row = measure(shape, kind, args, device, props.L2_cache_size) | {"kind": name, "tile": tile}
                except Exception:  # noqa: BLE001
                    result["errors"].append({"shape": label, "what": name, "error": traceback.format_exc()})
                    print(f"{label} {name}: failed\n{traceback.format_exc()}", flush=True)
                    continue
                finally:
                    torch.cuda.empty_cache()
                result["rows"].append(row)
                print(f"{label:>14} x{shape['calls']} {name:>12}: fwd {row['fwd_ms']:.3f} ms "
                      f"({row['fwd_gbps'] / roof['value'] * 1e9:.0%} of roof), bwd {row['bwd_ms']:.3f} ms "
                      f"({row['bwd_gbps'] / roof['value'] * 1e9:.0%}) [{row['fwd_timing']}, {time.time() - t0:.0f} s]",
                      flush=True)
        group_norm_triton.TILE = tiles[0]
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for r in result["rows"]:
        totals[r["kind"]][0] += r["calls"] * r["fwd_ms"]
        totals[r["kind"]][1] += r["calls"] * r["bwd_ms"]
    floor = [sum(s["calls"] * f * s["mb"] * 1e6 for s in kept) / roof["value"] * 1e3 for f in (3, 5)]
    result["totals_ms_per_step"] = {k: {"fwd": f, "bwd": b} for k, (f, b) in totals.items()} | {
        "floor": {"fwd": floor[0], "bwd": floor[1]}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str))

    print(f"\nshape             calls kind          fwd ms  %roof   bwd ms  %roof   check (y, dx vs fused)")
    checks = {(c["channels"], tuple(c["spatial"])): c["errors"] for c in result["checks"]}
    for r in result["rows"]:
        err = checks.get((r["channels"], tuple(r["spatial"])), {}).get(r["kind"].split("@")[0], ["", ""])
        err = " ".join(f"{e:.1e}" if e != "" else "-" for e in err)
        print(f"{r['channels']:>4}x{'x'.join(map(str, r['spatial'])):<12} {r['calls']:>5} {r['kind']:<12} "
              f"{r['fwd_ms']:>7.3f} {r['fwd_gbps'] * 1e9 / roof['value']:>6.0%} {r['bwd_ms']:>8.3f} "
              f"{r['bwd_gbps'] * 1e9 / roof['value']:>6.0%}   {err}")
    print(f"\nper step, the {len(kept)} shapes of >= {args.min_mb:g} MB ({share:.1%} of the GroupNorm bytes):")
    for k, v in result["totals_ms_per_step"].items():
        print(f"  {k:<12} fwd {v['fwd']:.2f} ms  bwd {v['bwd']:.2f} ms  total {v['fwd'] + v['bwd']:.2f} ms")
    print(f"errors: {len(result['errors'])}; JSON: {args.json}")


if __name__ == "__main__":
    main()
