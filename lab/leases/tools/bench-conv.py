"""best's GroupNorm-SiLU-convolutions at 128^3, cuDNN's way against the fused Triton kernel (`fused_conv.py` beside
this script: the retired lever `conv`), on a GPU.

Two tables, each row timed with CUDA events around CUDA-graph replays (so that launch gaps, which best's whole-step
graph removes, stay out), after warm-up (compilation, cuDNN's and Triton's autotuning), median and 10th-90th
percentiles of `--repeats`, rotating among input sets that together exceed the L2 cache (at most 8 sets):

- kernels (forward), for every distinct 3x3x3 convolution of best's residual blocks (`medddpm.model.unet`, traced
  on the meta device): `cudnn` the cuDNN convolution of the normalized bf16 activation; `apply` the compiled
  GroupNorm-SiLU apply step that best runs before it (x * scale + shift, SiLU, bf16 out); `stats` the compiled
  statistics pass the next norm runs on the output; `triton` the fused kernel (tanh.approx.f32 SiLU), `triton_bf16x2`
  the same with the packed-bf16 SiLU (tanh.approx.bf16x2, 0.5 special-function instructions an element), and
  `triton_fp8` the FP8 kernel: each with the statistics epilogue. What fusion replaces is cudnn + apply (+ stats for
  a block's first convolution) against triton.
- blocks (forward, and forward + backward, `train`): a whole residual block (`ResBlock`, best's GroupNorm kind),
  compiled with best's options under bf16 autocast: cuDNN's (`ResBlock`), and the fused kernel's with bf16 and FP8
  operands (`fused_conv.FusedResBlock`, triton and triton_fp8).

Numerics on the card: each kernel's relative error against a float32 reference (strict FP32 convolution of the
float32 normalized activation), next to cuDNN's own; a fused block's output and gradients against cuDNN's block.
The fused kernel's code (from Triton's cache): whether its matrix instructions are wgmma (HGMMA / QGMMA in SASS),
its special-function instructions, registers and spills.

TFLOP/s count the convolution alone (2 * 27 * voxels * C_in * C_out a forward, three times that with backward),
over each row's time; the roof is this card's bf16 matmul rate, measured in the same call
(`medddpm.measure.timing.roofs`). A table prints last; `--json` gets every number.
Usage: python lab/leases/tools/bench-conv.py [--kernels all|none|CIN:COUT@S,...] [--blocks top|all|none|CIN:COUT@S,...]
       [--kinds cudnn,triton,triton_bf16x2,triton_fp8] [--repeats 30] [--json $OUT/bench-conv.json]
"""

import argparse
import collections
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import fused_conv  # noqa: E402  (beside this script: the kernel left the product with its lever)
from medddpm.measure.env import environment  # noqa: E402
from medddpm.measure.timing import roofs  # noqa: E402
from medddpm.model.blocks import ResBlock  # noqa: E402
from medddpm.model.group_norm import _group_stats  # noqa: E402
from medddpm.model.layout import compile_options  # noqa: E402
from medddpm.model.unet import ModelSpec, UNet3D  # noqa: E402

CL = torch.channels_last_3d
DEVICE = "cuda"  # `--device cpu`: a dry run of the script itself at tiny sizes, under Triton's interpreter
L2_BYTES = 50 * 2**20  # H100 and H200: 50 MiB
KERNEL_KINDS = ("cudnn", "apply", "stats", "triton", "triton_bf16x2", "triton_fp8")
BLOCK_KINDS = ("cudnn", "triton", "triton_fp8")


def best_blocks(size: int = 128, mask_channels: int = 3) -> collections.Counter:
    """(C_in, C_out, side) -> instances of best's residual blocks, from a forward on the meta device."""
    with torch.device("meta"):
        model = UNet3D(ModelSpec(size=size, mask_channels=mask_channels), attention="sdpa",
                       recompute_attention=False, upsample="separable_ndhwc")
    seen = collections.Counter()
    for mod in model.modules():
        if isinstance(mod, ResBlock):
            mod.register_forward_pre_hook(lambda m, args: seen.update(
                [(args[0].shape[1], m.in_layers[2].out_channels, args[0].shape[-1])]))
    with torch.no_grad():
        model(torch.empty(1, model.spec.in_channels, size, size, size, device="meta"),
              torch.zeros(1, dtype=torch.long, device="meta"))
    return seen


def parse_shapes(spec: str, default: list) -> list:
    if spec in ("all", "top"):
        return default
    if spec == "none":
        return []
    out = []
    for item in spec.split(","):
        chans, _, side = item.partition("@")
        c_in, _, c_out = chans.partition(":")
        out.append((int(c_in), int(c_out), int(side)))
    return out


def graph_times(fns: list, repeats: int, warmup: int = 3) -> list[float]:
    """Each fn warmed up, captured into a CUDA graph, then the graphs replayed in turn, each between two events.
    On the CPU (a dry run of this script under TRITON_INTERPRET=1) the host clock around plain calls."""
    if DEVICE == "cpu":
        for fn in fns:
            fn()
        times = []
        for i in range(repeats):
            t = time.perf_counter()
            fns[i % len(fns)]()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    graphs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            for _ in range(warmup):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for i, (start, end) in enumerate(events):
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1]}


def rel(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def sets_for(nbytes: int) -> int:
    return max(2, min(8, math.ceil(2 * L2_BYTES / nbytes)))


@contextlib.contextmanager
def silu_mode(mode: int | None):
    """The fused operator with another prologue SiLU (the bench's triton_bf16x2 rows)."""
    saved = fused_conv._silu_mode
    if mode is not None:
        fused_conv._silu_mode = lambda operands, device: mode
    try:
        yield
    finally:
        fused_conv._silu_mode = saved


def kernel_rows(c_in: int, c_out: int, side: int, kinds, repeats: int, gen) -> list[dict]:
    """The forward kernels of one convolution shape, as a block's first convolution (statistics out)."""
    dev = DEVICE
    vox = side ** 3
    n = sets_for(vox * c_in * 2)
    xs = [(torch.randn(1, c_in, side, side, side, device=dev, generator=gen) * 1.5 + 0.3).to(torch.bfloat16)
          .contiguous(memory_format=CL) for _ in range(n)]
    groups, eps = 32, 1e-5
    norm = torch.nn.GroupNorm(groups, c_in).to(dev).requires_grad_(False)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3), torch.nn.init.normal_(norm.bias, 0.0, 0.3)
    weight = torch.randn(c_out, c_in, 3, 3, 3, device=dev, generator=gen) / math.sqrt(27 * c_in)
    bias = torch.randn(1, c_out, device=dev, generator=gen) * 0.1
    stats = [_group_stats(x.float(), groups, eps) for x in xs]
    scale = [(r * norm.weight).detach() for _, r in stats]
    shift = [(norm.bias - m * s).detach() for (m, _), s in zip(stats, scale)]
    view = (1, c_in, 1, 1, 1)
    acts = [F.silu(x.float() * s.view(view) + t.view(view)) for x, s, t in zip(xs, scale, shift)]
    abf = [a.to(torch.bfloat16).contiguous(memory_format=CL) for a in acts]
    wb = weight.to(torch.bfloat16).contiguous(memory_format=CL)
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    ref = F.conv3d(acts[0], weight, bias[0], padding=1)  # strict FP32
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    flop = 2 * 27 * vox * c_in * c_out
    apply_fn = torch.compile(lambda x, s, t: F.silu(x.float() * s.view(view) + t.view(view)).to(torch.bfloat16)
                             .contiguous(memory_format=CL), dynamic=True)
    stats_fn = torch.compile(lambda y: _group_stats(y.float(), groups, eps), dynamic=True)
    rows = []
    for kind in kinds:
        out = {}
        if kind == "cudnn":
            fns = [lambda i=i: out.__setitem__(i, F.conv3d(abf[i], wb, bias[0].to(torch.bfloat16), padding=1))
                   for i in range(n)]
        elif kind == "apply":
            fns = [lambda i=i: out.__setitem__(i, apply_fn(xs[i], scale[i], shift[i])) for i in range(n)]
        elif kind == "stats":
            ys = [torch.randn(1, c_out, side, side, side, device=dev, generator=gen).to(torch.bfloat16)
                  .contiguous(memory_format=CL) for _ in range(n)]
            fns = [lambda i=i: out.__setitem__(i, stats_fn(ys[i])) for i in range(n)]
        else:
            kw = dict(kind="triton_fp8" if kind == "triton_fp8" else "triton", bias=bias, want_stats=True)
            mode = fused_conv.SILU_TANH_BF16X2 if kind == "triton_bf16x2" else None

            def fused(i, kw=kw, mode=mode):
                with silu_mode(mode), torch.autocast(DEVICE, dtype=torch.bfloat16), torch.no_grad():
                    out[i] = fused_conv.norm_silu_conv(xs[i], norm, _Conv(weight, bias), **kw)[0]
            fns = [lambda i=i: fused(i) for i in range(n)]
        try:
            ms = graph_times(fns, repeats)
        except Exception as e:  # one failing variant (an unsupported instruction) must not lose the others
            rows.append({"shape": [c_in, c_out, side], "kind": kind, "error": repr(e)[:300]})
            print(f"  {c_in}->{c_out}@{side} {kind}: FAILED {repr(e)[:200]}", flush=True)
            continue
        row = {"shape": [c_in, c_out, side], "kind": kind, **summary(ms), "sets": n}
        if kind not in ("apply", "stats"):
            row["tflops"] = flop / (row["median_ms"] / 1e3) / 1e12
            row["rel_err_fp32"] = rel(out[0], ref)
        rows.append(row)
    return rows


class _Conv(torch.nn.Module):
    """A 3x3x3 convolution's parameters as `norm_silu_conv` reads them."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias, self.out_channels = weight, bias[0], weight.shape[0]


def block_rows(c_in: int, c_out: int, side: int, kinds, repeats: int, gen) -> list[dict]:
    """A residual block, compiled as best compiles it, forward and forward + backward, per conv kind."""
    dev = DEVICE
    vox = side ** 3
    n = sets_for(vox * c_in * 2)
    torch.manual_seed(0)
    plain = ResBlock(c_in, c_out, emb_dim=256, norm_kind="fused").to(dev, memory_format=CL)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    xs = [torch.randn(1, c_in, side, side, side, device=dev, generator=gen).to(torch.bfloat16)
          .contiguous(memory_format=CL) for _ in range(n)]
    embs = [torch.randn(1, 256, device=dev, generator=gen) for _ in range(n)]
    ups = [torch.randn(1, c_out, side, side, side, device=dev, generator=gen).to(torch.bfloat16)
           .contiguous(memory_format=CL) for _ in range(n)]
    flop = 2 * 27 * vox * (c_in * c_out + c_out * c_out)
    rows, results = [], {}
    for kind in kinds:
        block = (ResBlock(c_in, c_out, emb_dim=256, norm_kind="fused") if kind == "cudnn" else
                 fused_conv.FusedResBlock(c_in, c_out, emb_dim=256, norm_kind="fused", kind=kind))
        block = block.to(dev, memory_format=CL)
        block.load_state_dict(plain.state_dict())
        for mode in ("forward", "train"):
            torch._dynamo.reset()
            f = torch.compile(block, dynamic=False, options=compile_options(pin_layout=True))
            out = {}
            params = list(block.parameters())

            def step(i, mode=mode, f=f, out=out, params=params):
                x = xs[i].detach().requires_grad_(mode == "train")
                with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.set_grad_enabled(mode == "train"):
                    y = f(x, embs[i])
                out[i] = (y,) if mode == "forward" else (y, *torch.autograd.grad((y * ups[i]).sum(), [x, *params]))
            try:
                ms = graph_times([lambda i=i: step(i) for i in range(n)], repeats)
            except Exception as e:
                rows.append({"shape": [c_in, c_out, side], "kind": kind, "mode": mode, "error": repr(e)[:300]})
                print(f"  block {c_in}->{c_out}@{side} {kind} {mode}: FAILED {repr(e)[:200]}", flush=True)
                continue
            results[kind, mode] = out[0]
            row = {"shape": [c_in, c_out, side], "kind": kind, "mode": mode, **summary(ms), "sets": n,
                   "tflops": (flop if mode == "forward" else 3 * flop) / (statistics.median(ms) / 1e3) / 1e12}
            if kind != "cudnn" and ("cudnn", mode) in results:
                row["rel_err_vs_cudnn"] = [rel(a, b) for a, b in zip(out[0], results["cudnn", mode])]
            rows.append(row)
    return rows


def kernel_code() -> list[dict]:
    """The fused kernel's compiled variants in Triton's cache: matrix and special-function instructions, registers."""
    found = []
    kernel = fused_conv._gn_silu_conv3d
    caches = getattr(kernel, "device_caches", None) or {}
    compiled = []
    for value in caches.values():
        table = value[0] if isinstance(value, tuple) else value
        compiled += list(table.values()) if isinstance(table, dict) else []
    try:
        from triton.tools.disasm import get_sass
    except ImportError:
        get_sass = None
    for k in compiled:
        ptx = k.asm.get("ptx", "")
        entry = {"name": getattr(k, "name", "?"), "num_warps": k.metadata.num_warps,
                 "num_stages": getattr(k.metadata, "num_stages", None), "shared": k.metadata.shared,
                 "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                 "ptx_wgmma": ptx.count("wgmma.mma_async"), "ptx_mma_sync": ptx.count("mma.sync"),
                 "ptx_tanh": ptx.count("tanh.approx")}
        if get_sass is not None and "cubin" in k.asm:
            try:
                sass = get_sass(k.asm["cubin"])
                for op in ("HGMMA", "QGMMA", "HMMA", "MUFU.TANH", "MUFU.EX2", "MUFU.RCP", "LDL", "STL"):
                    entry[f"sass_{op}"] = sass.count(op)
            except Exception as e:
                entry["sass_error"] = repr(e)[:200]
        found.append(entry)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="all", help="all | none | CIN:COUT@SIDE,...")
    ap.add_argument("--blocks", default="top", help="top (the 128^3 blocks) | all | none | CIN:COUT@SIDE,...")
    ap.add_argument("--kinds", default="cudnn,apply,stats,triton,triton_bf16x2,triton_fp8")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (TRITON_INTERPRET=1, tiny shapes)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    assert DEVICE == "cpu" or torch.cuda.is_available(), "this times cuDNN and Triton kernels: it needs a GPU"
    kinds = args.kinds.split(",")
    bad = set(kinds) - set(KERNEL_KINDS)
    assert not bad, f"unknown kinds {sorted(bad)}; known: {KERNEL_KINDS}"
    torch.backends.cudnn.benchmark = True
    t0 = time.time()
    device = torch.device(DEVICE)
    blocks = best_blocks()
    convs = collections.Counter()
    for (c_in, c_out, side), count in blocks.items():
        convs[c_in, c_out, side] += count
        convs[c_out, c_out, side] += count
    kernel_shapes = parse_shapes(args.kernels, sorted(convs, key=lambda s: (-s[2], s[0], s[1])))
    top = [b for b in blocks if b[2] == max(s for *_, s in blocks)]
    block_shapes = parse_shapes(args.blocks, top if args.blocks == "top" else sorted(blocks, key=lambda s: -s[2]))
    sizes = roofs.GPU_SIZES if DEVICE == "cuda" else roofs.CPU_SIZES
    roof = roofs.matmul(device, "bf16", sizes)["value"] / 1e12
    dram = roofs.bandwidth(device, sizes)["value"] / 1e12
    print(f"{environment(device)['gpu_name']}: bf16 matmul {roof:.0f} TFLOP/s, DRAM {dram:.2f} TB/s "
          f"({time.time() - t0:.0f} s)", flush=True)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    doc = {"environment": environment(device), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "bf16_roof_tflops": roof, "dram_tbs": dram,
           "instances": {f"{a}:{b}@{s}": c for (a, b, s), c in convs.items()}, "kernels": [], "blocks": []}

    def save():  # after every shape, so that a call that runs out of time keeps what it measured
        for r in doc["kernels"] + doc["blocks"]:
            if "tflops" in r:
                r["roof_fraction"] = r["tflops"] / roof
        doc["seconds"] = time.time() - t0
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1))

    for c_in, c_out, side in kernel_shapes:
        try:
            doc["kernels"] += kernel_rows(c_in, c_out, side, kinds, args.repeats, gen)
        except Exception as e:  # noqa: BLE001 - one shape's failure must not lose the others
            doc["kernels"].append({"shape": [c_in, c_out, side], "kind": "all", "error": repr(e)[:300]})
        print(f"kernels {c_in}->{c_out}@{side}^3 done ({time.time() - t0:.0f} s)", flush=True)
        save()
    for c_in, c_out, side in block_shapes:
        try:
            doc["blocks"] += block_rows(c_in, c_out, side, [k for k in BLOCK_KINDS if k in kinds], args.repeats, gen)
        except Exception as e:  # noqa: BLE001
            doc["blocks"].append({"shape": [c_in, c_out, side], "kind": "all", "mode": "all", "error": repr(e)[:300]})
        print(f"block {c_in}->{c_out}@{side}^3 done ({time.time() - t0:.0f} s)", flush=True)
        save()
    try:
        doc["kernel_code"] = kernel_code()
    except Exception as e:  # noqa: BLE001 - Triton's cache layout differs between versions
        doc["kernel_code"] = [{"error": repr(e)[:300]}]
    save()
    print_tables(doc, convs)


def print_tables(doc: dict, convs: collections.Counter) -> None:
    """One line a shape (ms of each kind, the fused kernel's TFLOP/s and share of the roof, errors), then the blocks."""
    code = [c for c in doc["kernel_code"] if "error" not in c]
    print(f"\nfused kernel builds: {len(code)}; with wgmma: {sum(c.get('ptx_wgmma', 0) > 0 for c in code)}; "
          f"HGMMA/QGMMA in SASS: {sum(c.get('sass_HGMMA', 0) + c.get('sass_QGMMA', 0) > 0 for c in code)}; "
          f"spills: {sorted({str(c.get('n_spills')) for c in code})}")
    by_shape = collections.defaultdict(dict)
    for r in doc["kernels"]:
        by_shape[tuple(r["shape"])][r["kind"]] = r
    kinds = [k for k in KERNEL_KINDS if any(k in v for v in by_shape.values())]
    print(f"{'conv':>12} {'x':>2} " + " ".join(f"{k[:13]:>13}" for k in kinds)
          + "  ms; triton TF/s roof; err fp32: cudnn triton fp8")
    for shape, rows in by_shape.items():
        cells = []
        for k in kinds:
            r = rows.get(k, {})
            cells.append(f"{'FAILED' if 'error' in r else '-' if not r else format(r['median_ms'], '.4f'):>13}")
        t = rows.get("triton", {})
        errs = " ".join(format(rows.get(k, {}).get("rel_err_fp32", float("nan")), ".1e")
                        for k in ("cudnn", "triton", "triton_fp8"))
        print("{:>12} {:>2} ".format("{}->{}@{}".format(*shape), convs.get(shape, 0)) + " ".join(cells) +
              f"  {t.get('tflops', float('nan')):4.0f} {t.get('roof_fraction', float('nan')):4.0%}; {errs}")
    for r in doc["blocks"]:
        layer = "block {}->{}@{}".format(*r["shape"])
        if "error" in r:
            print(f"{layer:>20} {r['kind']:>10} {r['mode']:>7}  FAILED {r['error'][:80]}")
            continue
        err = r.get("rel_err_vs_cudnn")
        print(f"{layer:>20} {r['kind']:>10} {r['mode']:>7} {r['median_ms']:8.3f} ms ({r['p10_ms']:.3f}-"
              f"{r['p90_ms']:.3f}) {r['tflops']:5.0f} TF/s {r['roof_fraction']:4.0%} "
              f"{'' if err is None else 'err vs cudnn ' + ' '.join(f'{e:.1e}' for e in err[:3])}")
    print(f"({doc['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
