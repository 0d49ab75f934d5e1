"""GroupNorm-SiLU-convolution as one Triton kernel: the lever `conv` (`triton`, `triton_fp8`), retired from the
product on 2026-12-07 after the H100's lever call measured best+conv=triton 20.9 ms (38%) slower a training
micro-step (lab/notebook/retired-levers.md#conv). The kernel stays here for the lab: `bench-conv.py` (beside it)
imports it, and `FusedResBlock` is the product's residual block with the kernel in place of its two
GroupNorm-SiLU-convolutions, as the switch built it. It imports the product (`medddpm.model`); the product does
not import it.

At batch 1 GroupNorm's apply step is a per-channel scale and shift: a = x * scale_c + shift_c, with
scale_c = gamma_c * rstd_g(c) and shift_c = beta_c - mean_g(c) * scale_c. So "normalize, SiLU, convolve" has the
shape of batch-norm-ReLU-convolution, and one kernel can do it: `_gn_silu_conv3d` is an implicit-GEMM 3x3x3
convolution (stride 1, padding 1) of a channels-last (NDHWC) activation whose operand load applies the scale,
the shift and the SiLU, so that the normalized activation is never written; its epilogue adds a per-(sample,
channel) bias (the convolution's bias plus the residual block's time embedding) and reduces the output, as
stored, to per-channel sums and sums of squared deviations per tile, from which the next GroupNorm's
statistics follow (`channel_moments`, then `group_norm.group_stats_from_parts`): the next norm reads nothing.

The kernel: rows of the GEMM are output voxels (BLOCK_M of them, consecutive along W, H, D), columns output
channels (BLOCK_N), and the reduction runs over the 27 taps times the input channels (BLOCK_K of them a step),
one flattened loop that Triton software-pipelines: a tap's rows are its shifted voxels, masked at the volume's
faces, where the normalized-SiLU input is zero (the convolution pads after the norm). Operands are bf16 (fp16
under fp16 autocast; float32 or TF32 without autocast), or FP8 e4m3 with per-tensor scales from amax
(`operands="fp8"`): the weights' amax directly, the activation's exactly from per-channel min and max of x
(the SiLU of a monotone per-channel map reaches its largest magnitude at an end of the range, or at SiLU's
minimum). Accumulation is float32. Pointer loads only (no tensor-memory accelerator), so the same kernel
compiles with the GPU image's Triton 3.6.

On the GPU the SiLU is h + h * tanh(h) with h = a / 2 (the same function) on one `tanh.approx.f32`, a single
special-function instruction: each input element is transformed once per tap and output-channel tile, 27 times
in all, so the prologue's instructions, not the tensor cores, can bound the kernel where the output has few
channels (a Hopper SM returns 16 special-function results a clock against 2048 bf16 tensor-core multiply-adds: at
64 output channels one tanh an element takes twice the matrix product's time). Float32 and TF32 operands take the
exact sigmoid.

Training: `gn_silu_conv3d` is a custom operator (fake implementation, autograd formula), opaque to
`torch.compile` and replayed by CUDA graphs. Its backward recomputes the normalized-SiLU input and runs cuDNN's
convolution backward on it (`aten.convolution_backward`), then the GroupNorm-SiLU backward in closed form
(`group_norm.group_norm_silu_backward`), so only x is kept for the backward, not the normalized activation.
The statistics it is given are x's: the backward differentiates the norm through them, and the statistics it
returns carry no gradient.

The kernel runs on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` set before
Triton is imported). Elsewhere `unavailable` says why.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from medddpm.model.blocks import ResBlock
from medddpm.model.group_norm import _group_stats, group_norm_silu_backward, group_stats_from_parts

try:  # pyproject declares Triton for Linux x86-64, the platform of its wheels
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
# Kernels run under Triton's interpreter where TRITON_INTERPRET=1 is set before Triton is imported (the tests'):
# `triton.jit` decides then, for these kernels and for triton.language's own (tl.zeros, tl.sum)
_jit = triton.jit if triton is not None else (lambda fn: fn)

CONV_KINDS = ("cudnn", "triton", "triton_fp8")
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
SILU_MIN_AT, SILU_MIN = -1.2784645, -0.27846454  # SiLU's minimum: silu'(a) = 0 there
SILU_EXACT, SILU_TANH, SILU_TANH_BF16X2 = 0, 1, 2  # the prologue's SiLU (`_gn_silu_conv3d`'s SILU)
OPERANDS = ("float32", "float16", "bfloat16", "fp8")
_TORCH_OPERAND = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "fp8": torch.float8_e4m3fn}
# (mantissa bits, smallest normal exponent) of each rounded type: the interpreter's rounding (below)
_FORMAT = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float8_e4m3fn: (3, -6), torch.float32: (0, 0),
           torch.float64: (0, 0)}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried on the GPU: a warpgroup or two, tiles of 64-256 output voxels by
# 64-256 output channels, 3-5 stages of bf16 tiles (at most 144 KiB of shared memory). Pruned per layer
# (`_prune`): BLOCK_K divides the input channels, BLOCK_N does not exceed the output channels' power of two.
GPU_CONFIGS = ((128, 64, 64, 4, 4), (128, 64, 32, 4, 5), (256, 64, 64, 8, 3), (64, 64, 64, 4, 4),
               (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3))
INTERPRETED_BLOCK_M = 256  # the interpreter runs programs one after another, each statement on whole tiles


class ChannelStats(NamedTuple):
    """Per (sample, channel) moments of an activation, (B, C) float32 each: what `gn_silu_conv3d`'s epilogue
    gives the next GroupNorm. min and max are (B, 0) where not reduced (they scale FP8 operands)."""

    mean: torch.Tensor
    var: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor


def _interpreting() -> bool:
    """Whether the kernel was decorated for Triton's interpreter (TRITON_INTERPRET=1 when Triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_gn_silu_conv3d, InterpretedFunction)


def unavailable(device: torch.device | str, *, fp8: bool = False) -> str | None:
    """Why the fused kernel cannot run on `device` (one line), or None where it can."""
    device = torch.device(device)
    if triton is None:
        return "the fused convolution is a Triton kernel, and Triton is not installed (Linux x86-64 only)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return f"the fused convolution needs bf16 tensor cores (compute capability 8.0+), not {major}.{minor}"
        if fp8 and (major, minor) < (8, 9):
            return f"FP8 operands need FP8 tensor cores (compute capability 8.9+), not {major}.{minor}"
        return None
    if device.type == "cpu" and _interpreting():
        return None
    return "the fused convolution is a Triton kernel: it needs a CUDA device, or TRITON_INTERPRET=1 on the CPU"


# ------------------------------------------------------------------------------------------- the kernel


@_jit
def _round_nearest_even(v, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 v rounded to MANT mantissa bits (subnormals below 2^MIN_EXP), nearest-even: adding and taking away
    2^(e - MANT + 23), e v's exponent, leaves float32's own rounding at that quantum. Only under the interpreter,
    whose float casts truncate and lose the carry into the exponent (1.96 to e4m3 gives 1.0, triton 3.9): after
    this the cast is exact."""
    e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127)
    big = ((e - MANT + 23) << 23).to(tl.float32, bitcast=True)
    big = tl.where(v < 0, -big, big)
    return (v + big) - big


@_jit
def _gn_silu_conv3d(x_ptr, w_ptr, scale_ptr, shift_ptr, bias_ptr, act_scale_ptr, out_scale_ptr,
                    y_ptr, part_ptr, D, H, W, C_IN, C_OUT, PART_ROWS,
                    SILU: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                    STATS: tl.constexpr, MINMAX: tl.constexpr, INTERPRET: tl.constexpr, A_MANT: tl.constexpr,
                    A_MIN_EXP: tl.constexpr, Y_MANT: tl.constexpr, Y_MIN_EXP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (voxel tile, output-channel tile, sample b) of y = conv3x3x3(silu(x * scale + shift)) + bias.

    x: (B, D, H, W, C_IN); w: (27, C_OUT, C_IN), taps in (kd, kh, kw) order, the reduction axis contiguous (what
    FP8 tensor cores want); scale, shift: (B, C_IN) float32; bias: (B, C_OUT) float32; y: (B, D, H, W, C_OUT).
    SILU: `SILU_EXACT`, `SILU_TANH` or `SILU_TANH_BF16X2` (bf16 operands only). FP8: the activation is
    multiplied by *act_scale before its cast, and the accumulator by *out_scale = 1 / (activation scale * weight
    scale). STATS: part[0 | 1, b, tile, c] = the sum over the tile's voxels of y as stored and of its squared
    deviation from the tile's mean (MINMAX: part[2 | 3] = min, max). INTERPRET: under the interpreter, operands
    and output are rounded to their types (A_*, Y_*) by `_round_nearest_even` and multiplied in float32 (its dot
    of bf16 multiplies their bits as integers)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2)
    V = D * H * W
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < V
    w_i = offs_m % W
    d_i = offs_m // (H * W)
    h_i = (offs_m // W) % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < C_OUT
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + b.to(tl.int64) * V * C_IN
    if FP8:
        act_scale = tl.load(act_scale_ptr)
    k_steps = C_IN // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(27 * k_steps):
        tap = it // k_steps
        k0 = (it - tap * k_steps) * BLOCK_K
        dd = d_i + (tap // 9 - 1)
        hh = h_i + (tap // 3 % 3 - 1)
        ww = w_i + (tap % 3 - 1)
        ok = row_ok & (dd >= 0) & (dd < D) & (hh >= 0) & (hh < H) & (ww >= 0) & (ww < W)
        src = ((dd * H + hh) * W + ww) * C_IN + k0
        xa = tl.load(x_base + src[:, None] + offs_k[None, :], mask=ok[:, None], other=0.0)
        wb = tl.load(w_ptr + tap * C_OUT * C_IN + k0 + offs_n[None, :] * C_IN + offs_k[:, None],
                     mask=n_ok[None, :], other=0.0)
        sc = tl.load(scale_ptr + b * C_IN + k0 + offs_k)
        sh = tl.load(shift_ptr + b * C_IN + k0 + offs_k)
        if SILU == 2:  # packed bf16 pairs: h = x * scale/2 + shift/2, silu = h + h * tanh(h), 3 instructions a pair
            hb = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r",
                                           [xa.to(tl.bfloat16), (0.5 * sc).to(tl.bfloat16)[None, :],
                                            (0.5 * sh).to(tl.bfloat16)[None, :]],
                                           dtype=tl.bfloat16, is_pure=True, pack=2)
            t = tl.inline_asm_elementwise("tanh.approx.bf16x2 $0, $1;", "=r,r", [hb],
                                          dtype=tl.bfloat16, is_pure=True, pack=2)
            a = tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [hb, t, hb],
                                          dtype=tl.bfloat16, is_pure=True, pack=2)
        elif SILU == 1:  # silu(a) = h + h * tanh(h), h = a / 2: one special-function instruction
            h = xa.to(tl.float32) * (0.5 * sc)[None, :] + (0.5 * sh)[None, :]
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h],
                                          dtype=tl.float32, is_pure=True, pack=1)
            a = h + h * t
        else:
            a = xa.to(tl.float32) * sc[None, :] + sh[None, :]
            a = a / (1.0 + tl.exp(-a))
        a = tl.where(ok[:, None], a, 0.0)  # the convolution pads the normalized activation with zeros
        if FP8:
            a = tl.minimum(tl.maximum(a.to(tl.float32) * act_scale, -448.0), 448.0)
        if INTERPRET:  # operands rounded as on the GPU, multiplied in float32
            a = a.to(tl.float32)
            if A_MANT > 0:
                a = _round_nearest_even(a, A_MANT, A_MIN_EXP)
            acc = tl.dot(a, wb.to(tl.float32), acc)
        elif IEEE:
            acc = tl.dot(a.to(wb.dtype), wb, acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(wb.dtype), wb, acc)

    if FP8:
        acc = acc * tl.load(out_scale_ptr)
    acc = acc + tl.load(bias_ptr + b * C_OUT + offs_n, mask=n_ok, other=0.0)[None, :]
    if INTERPRET and Y_MANT > 0:
        acc = _round_nearest_even(acc, Y_MANT, Y_MIN_EXP)
    y = acc.to(y_ptr.dtype.element_ty)
    out_ok = row_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + b.to(tl.int64) * V * C_OUT + offs_m[:, None] * C_OUT + offs_n[None, :], y, mask=out_ok)
    if STATS:
        v = tl.where(row_ok[:, None], y.to(tl.float32), 0.0)
        total = tl.sum(v, axis=0)
        count = tl.minimum(V - pid_m * BLOCK_M, BLOCK_M)
        dev = tl.where(row_ok[:, None], v - (total / count)[None, :], 0.0)
        part = part_ptr + (b * PART_ROWS + pid_m) * C_OUT + offs_n
        plane = tl.num_programs(2) * PART_ROWS * C_OUT
        tl.store(part, total, mask=n_ok)
        tl.store(part + plane, tl.sum(dev * dev, axis=0), mask=n_ok)
        if MINMAX:
            tl.store(part + 2 * plane, tl.min(tl.where(row_ok[:, None], v, float("inf")), axis=0), mask=n_ok)
            tl.store(part + 3 * plane, tl.max(tl.where(row_ok[:, None], v, -float("inf")), axis=0), mask=n_ok)


def _prune(configs, named_args, **kwargs):
    """The GPU configurations that fit a layer: BLOCK_K divides the input channels, BLOCK_N is at most the output
    channels' next power of two (at least 64)."""
    c_in, c_out = named_args["C_IN"], named_args["C_OUT"]
    fit = [c for c in configs if c_in % c.kwargs["BLOCK_K"] == 0
           and c.kwargs["BLOCK_N"] <= max(64, triton.next_power_of_2(c_out))]
    return fit or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16}, num_warps=4, num_stages=3)]


@functools.cache
def _tuned():
    """The kernel autotuned over `GPU_CONFIGS`, per layer shape."""
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for m, n, k, w, s in GPU_CONFIGS]
    return triton.autotune(configs, key=["D", "H", "W", "C_IN", "C_OUT", "SILU", "STATS"],
                           prune_configs_by={"early_config_prune": _prune})(_gn_silu_conv3d)


def _launch(x, w, scale, shift, bias, act_scale, out_scale, y, *, silu: int, ieee: bool, stats: bool,
            minmax: bool, config: dict | None = None) -> tuple[torch.Tensor | None, int]:
    """Run `_gn_silu_conv3d` on NDHWC x into NDHWC y; returns the (2 or 4, B, tiles, C_out) partials where
    `stats` (else None), and the tiles' BLOCK_M. `config`: fixed block sizes ({"BLOCK_M": ..., "BLOCK_N": ...,
    "BLOCK_K": ...}) instead of the autotuner's choice (the interpreter always takes fixed ones)."""
    b, d, h, w_, c_in = x.shape
    c_out = y.shape[-1]
    voxels = d * h * w_
    assert c_in % 16 == 0, f"the fused convolution takes a multiple of 16 input channels, got {c_in}"
    assert voxels * max(c_in, c_out) < 2 ** 31, "one sample's activation must be indexable in 32 bits"
    interpret = x.device.type == "cpu"
    if interpret and config is None:
        config = {"BLOCK_M": INTERPRETED_BLOCK_M, "BLOCK_N": min(64, max(16, triton.next_power_of_2(c_out))),
                  "BLOCK_K": next(k for k in (64, 32, 16) if c_in % k == 0)}
    smallest_m = config["BLOCK_M"] if config else min(m for m, *_ in GPU_CONFIGS)
    rows = triton.cdiv(voxels, smallest_m)
    parts = torch.empty((4 if minmax else 2, b, rows, c_out) if stats else (1,), device=x.device,
                        dtype=torch.float32)
    a_fmt, y_fmt = _FORMAT[w.dtype], _FORMAT[y.dtype]
    args = (x, w, scale, shift, bias, act_scale, out_scale, y, parts, d, h, w_, c_in, c_out, rows)
    meta = dict(SILU=silu, FP8=w.dtype == torch.float8_e4m3fn, IEEE=ieee, STATS=stats,
                MINMAX=minmax, INTERPRET=interpret, A_MANT=a_fmt[0], A_MIN_EXP=a_fmt[1],
                Y_MANT=y_fmt[0], Y_MIN_EXP=y_fmt[1])
    if config is not None:
        grid = (triton.cdiv(voxels, config["BLOCK_M"]), triton.cdiv(c_out, config["BLOCK_N"]), b)
        _gn_silu_conv3d[grid](*args, **meta, **config)
        block_m = config["BLOCK_M"]
    else:
        tuned = _tuned()
        tuned[lambda m: (triton.cdiv(voxels, m["BLOCK_M"]), triton.cdiv(c_out, m["BLOCK_N"]), b)](*args, **meta)
        block_m = tuned.best_config.kwargs["BLOCK_M"]
    return (parts[:, :, : triton.cdiv(voxels, block_m)] if stats else None), block_m


def channel_moments(parts: torch.Tensor, voxels: int, block_m: int) -> ChannelStats:
    """The kernel's per-tile partials (2 or 4, B, tiles, C) -> per (sample, channel) moments: mean, and variance
    by Chan et al.'s combination of the tiles' sums of squared deviations (block_m voxels a tile, the last one
    fewer)."""
    total, m2 = parts[0], parts[1]
    tiles = total.shape[1]
    count = (voxels - block_m * torch.arange(tiles, device=parts.device, dtype=torch.float32)).clamp(max=block_m)
    mean = total.sum(1) / voxels
    var = (m2.sum(1) + (count[:, None] * (total / count[:, None] - mean[:, None]).square()).sum(1)) / voxels
    if parts.shape[0] == 4:
        return ChannelStats(mean, var, parts[2].amin(1), parts[3].amax(1))
    return ChannelStats(mean, var, *(mean.new_empty((mean.shape[0], 0)) for _ in range(2)))


# ------------------------------------------------------------------------------------- the operator


def _silu_amax(x_min, x_max, scale, shift) -> torch.Tensor:
    """The largest |silu(x * scale + shift)| over a tensor, from its per-(sample, channel) min and max of x: the
    affine map is monotone per channel, and SiLU's magnitude peaks at an end of the interval or at its minimum."""
    lo, hi = x_min * scale + shift, x_max * scale + shift
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    inside = ((lo <= SILU_MIN_AT) & (hi >= SILU_MIN_AT)).float() * -SILU_MIN
    return torch.maximum(torch.maximum(F.silu(lo).abs(), F.silu(hi).abs()), inside).amax()


def _operand_weights(weight: torch.Tensor, operands: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(C_out, C_in, 3, 3, 3) -> (27, C_out, C_in) in the operand type, and the FP8 weight scale (448 / amax)."""
    c_out, c_in = weight.shape[:2]
    w = weight.permute(2, 3, 4, 0, 1).reshape(27, c_out, c_in).float()
    if operands != "fp8":
        return w.to(_TORCH_OPERAND[operands]).contiguous(), None
    w_scale = FP8_MAX / w.abs().amax().clamp_min(1e-30)
    return (w * w_scale).to(torch.float8_e4m3fn).contiguous(), w_scale


def _silu_mode(operands: str, device: torch.device) -> int:
    """The exact sigmoid for float32 operands and under the interpreter; one tanh.approx on the GPU otherwise
    (its error, at most 2^-10.7 relative, is below a bf16 operand's rounding)."""
    return SILU_EXACT if operands == "float32" or device.type != "cuda" else SILU_TANH


@torch.library.custom_op("medddpm::gn_silu_conv3d", mutates_args=())
def gn_silu_conv3d(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor,
                   beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x_min: Optional[torch.Tensor],
                   x_max: Optional[torch.Tensor], groups: int, operands: str, out_dtype: torch.dtype,
                   stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv3d(silu(x * scale + shift), weight, padding=1) + bias in one kernel, with scale = rstd * gamma and
    shift = beta - mean * scale (GroupNorm's apply step: mean, rstd (B, C_in) are x's group statistics per
    channel, `groups` their groups, for the backward). x: (B, C_in, D, H, W), channels-last; bias: (B, C_out)
    float32. operands: one of `OPERANDS` ("float32" takes TF32 where cuDNN's convolutions do); "fp8" needs x's
    per-channel x_min and x_max (B, C_in). Returns y (B, C_out, D, H, W) channels-last in out_dtype, and where
    `stats` y's per-channel mean, variance, min and max (`ChannelStats`; min and max only for fp8, else (B, 0);
    all four (B, 0) without `stats`)."""
    assert operands in OPERANDS, f"operands must be one of {OPERANDS}, got {operands!r}"
    assert weight.shape[2:] == (3, 3, 3), "the fused convolution is 3x3x3, stride 1, padding 1"
    b, c_in, d, h, w_ = x.shape
    c_out = weight.shape[0]
    xl = x.permute(0, 2, 3, 4, 1).contiguous()  # NDHWC: a view of a channels-last x
    scale = (rstd.float() * gamma.float()).contiguous()
    shift = (beta.float() - mean.float() * scale).contiguous()
    w, w_scale = _operand_weights(weight, operands)
    one = torch.ones(1, device=x.device)
    act_scale = out_scale = one
    if operands == "fp8":
        assert x_min is not None and x_max is not None, "fp8 operands scale by x's per-channel min and max"
        act_scale = (FP8_MAX / _silu_amax(x_min.float(), x_max.float(), scale, shift).clamp_min(1e-30)).view(1)
        out_scale = (1.0 / (act_scale * w_scale)).view(1)
    y = torch.empty((b, c_out, d, h, w_), device=x.device, dtype=out_dtype, memory_format=torch.channels_last_3d)
    ieee = operands == "float32" and torch.backends.cudnn.conv.fp32_precision == "ieee"
    parts, block_m = _launch(xl, w, scale, shift, bias.float().contiguous(), act_scale, out_scale,
                             y.permute(0, 2, 3, 4, 1), silu=_silu_mode(operands, x.device), ieee=ieee, stats=stats,
                             minmax=stats and operands == "fp8")
    if not stats:
        return (y, *(x.new_empty((b, 0), dtype=torch.float32) for _ in range(4)))  # four tensors: no aliases
    return (y, *channel_moments(parts, d * h * w_, block_m))


@gn_silu_conv3d.register_fake
def _(x, mean, rstd, gamma, beta, weight, bias, x_min, x_max, groups, operands, out_dtype, stats):
    b, _, d, h, w_ = x.shape
    c_out = weight.shape[0]
    y = x.new_empty((b, c_out, d, h, w_), dtype=out_dtype).contiguous(memory_format=torch.channels_last_3d)
    n_moments, n_range = (c_out if stats else 0), (c_out if stats and operands == "fp8" else 0)
    moments = [x.new_empty((b, n_moments), dtype=torch.float32) for _ in range(2)]
    extremes = [x.new_empty((b, n_range), dtype=torch.float32) for _ in range(2)]
    return (y, *moments, *extremes)


def _setup_context(ctx, inputs, output):
    x, mean, rstd, gamma, beta, weight, bias, _, _, groups, operands, _, _ = inputs
    ctx.save_for_backward(x, mean, rstd, gamma, beta, weight)
    ctx.groups, ctx.operands, ctx.bias_dtype = groups, operands, bias.dtype
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, dy, *_):
    """cuDNN's convolution backward on the recomputed normalized-SiLU input (rounded to the operand type as the
    forward's tensor cores took it; bf16 for FP8 operands), then GroupNorm-SiLU's closed-form backward."""
    x, mean, rstd, gamma, beta, weight = ctx.saved_tensors
    dtype = torch.bfloat16 if ctx.operands == "fp8" else _TORCH_OPERAND[ctx.operands]
    scale = rstd.float() * gamma.float()
    shift = beta.float() - mean.float() * scale
    per_channel = (x.shape[0], x.shape[1], 1, 1, 1)
    a = F.silu(x.float() * scale.view(per_channel) + shift.view(per_channel)).to(dtype)
    da, dweight, _ = torch.ops.aten.convolution_backward(
        dy.to(dtype), a, weight.to(dtype), None, [1, 1, 1], [1, 1, 1], [1, 1, 1], False, [0, 0, 0], 1,
        [True, True, False])
    dx, dgamma, dbeta = group_norm_silu_backward(x, gamma, beta, mean, rstd, ctx.groups, True, da)
    dbias = dy.float().sum(dim=(2, 3, 4)).to(ctx.bias_dtype)
    return (dx, None, None, dgamma.to(gamma.dtype), dbeta.to(beta.dtype), dweight.to(weight.dtype), dbias,
            None, None, None, None, None, None)


gn_silu_conv3d.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------- the model's call


def operands_for(x: torch.Tensor, kind: str) -> tuple[str, torch.dtype]:
    """(operand type, output dtype) of a fused convolution of x: FP8 for `triton_fp8`, else autocast's type where
    autocast is on (as cuDNN's convolution would take), else x's. The output is in autocast's type, or x's."""
    device = x.device.type
    out = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if kind == "triton_fp8":
        return "fp8", out
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(out, "float32"), out


def norm_silu_conv(x: torch.Tensor, norm: torch.nn.GroupNorm, conv: torch.nn.Conv3d, *, kind: str,
                   bias: torch.Tensor | None = None, stats: ChannelStats | None = None,
                   want_stats: bool = False) -> tuple[torch.Tensor, ChannelStats | None]:
    """conv(silu(norm(x))) through `gn_silu_conv3d` (`kind` "triton" or "triton_fp8"), and where `want_stats` the
    output's `ChannelStats` for the norm that reads it next. `stats`: x's, from the kernel that wrote x; else they
    are computed here (chunked statistics, as `group_norm="fused"`). `bias`: (C_out,) or (B, C_out) in place
    of the convolution's own."""
    assert kind in CONV_KINDS[1:], f"fused convolution kind must be one of {CONV_KINDS[1:]}, got {kind!r}"
    operands, out_dtype = operands_for(x, kind)
    if stats is None:  # of x detached: the operator's backward differentiates the norm through its statistics
        xd = x.detach()
        mean, rstd = _group_stats(xd.to(torch.promote_types(x.dtype, torch.float32)), norm.num_groups, norm.eps)
        x_min, x_max = (xd.amin(dim=(2, 3, 4)), xd.amax(dim=(2, 3, 4))) if operands == "fp8" else (None, None)
    else:
        mean, rstd = group_stats_from_parts(stats.mean, stats.var, norm.num_groups, norm.eps)
        x_min, x_max = (stats.min, stats.max) if operands == "fp8" else (None, None)
    bias = conv.bias if bias is None else bias
    bias = bias.float().expand(x.shape[0], conv.out_channels).contiguous()
    y, *moments = gn_silu_conv3d(x.contiguous(memory_format=torch.channels_last_3d), mean, rstd, norm.weight,
                                 norm.bias, conv.weight, bias, x_min, x_max, norm.num_groups, operands, out_dtype,
                                 want_stats)
    return y, (ChannelStats(*moments) if want_stats else None)


class FusedResBlock(ResBlock):
    """`ResBlock` with each GN-SiLU-Conv as one fused kernel (`kind` "triton" or "triton_fp8"): the time embedding
    is the first one's per-sample bias, and the first one's output statistics are the second norm's. The same
    parameters as `ResBlock`, so a state dict loads either way (what the `conv` switch ran)."""

    def __init__(self, ch_in: int, ch_out: int, *, emb_dim: int, norm_kind: str = "aten", kind: str = "triton"):
        super().__init__(ch_in, ch_out, emb_dim=emb_dim, norm_kind=norm_kind)
        assert kind in CONV_KINDS[1:], f"fused convolution kind must be one of {CONV_KINDS[1:]}, got {kind!r}"
        self.kind = kind

    def forward(self, x, emb):
        (norm1, _, conv1), (norm2, _, conv2) = self.in_layers, self.out_layers
        bias = conv1.bias + self.emb_layers(emb).float()  # (B, C_out): the time embedding, added in the epilogue
        h, stats = norm_silu_conv(x, norm1, conv1, kind=self.kind, bias=bias, want_stats=True)
        out, _ = norm_silu_conv(h, norm2, conv2, kind=self.kind, stats=stats)
        return self.skip(x) + out
