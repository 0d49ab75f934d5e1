"""GroupNorm then SiLU as Triton kernels (`group_norm="triton"`): three launches forward, three backward.

PyTorch's GroupNorm reduces each (sample, group) in one thread block: at batch 1 with 32 groups, 32 blocks for
132 SMs. Inductor's kernels for the fused kind (`_GroupNormSiLU`) run below the DRAM roof: on best's H200 counters
(data/nvidia-h200/best/ncu.parquet) its largest forward kernels at 41-54% of peak DRAM throughput, its backward at
46-73%, and in best's kernel tables about as long on the H100 as on the H200, whose bandwidth is 1.4x. Here every
pass streams tiles of (voxels, all channels) of a channels-last (or contiguous) activation, and each reduction is
split over many programs per sample whose per-channel partial sums a small second kernel combines per group:

- forward: `_group_norm_stats` (partial sums of x - x[first voxel] and its square, per channel), then
  `_group_norm_finalize` (per group: mean, 1/std, and the per-channel scale and shift), then
  `_group_norm_silu_apply` (y = silu(x * scale + shift), in x's dtype);
- backward: `_group_norm_silu_backward_sums` (per-channel partial sums of da and da * xhat, with
  da = dy * silu'(a) for the recomputed a), then `_group_norm_backward_finalize` (dgamma, dbeta and the two
  per-group coefficients), then `_group_norm_silu_backward_dx` (dx = scale * da - k1 - xhat * k2).

The statistics, and every sum, are float32 whatever x's dtype (bfloat16, float16 or float32). A per-(sample,
channel) `shift` added to x before the norm (the residual block's timestep features) is folded into the per-channel
coefficients, so that x + shift is never written; its gradient, the sum of dx over each channel, comes from the
backward's sums in closed form. The kernels are wrapped as custom operators (`medddpm::group_norm_silu` and its
backward) with fake implementations and an autograd formula, so `torch.compile` graphs call them as opaque
operators and a CUDA graph replays their launches.

The kernels run on a CUDA device, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` in the
environment before triton is first imported: `triton.jit` decides when it decorates, triton's own library too).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import custom_op

TILE = 4096  # elements of one (voxels, channels) tile: 32 a thread with 4 warps, four 16-byte loads in bf16
PROGRAMS_PER_SM = 8  # split reductions: programs per SM, all samples together (several waves of resident programs)
SPLIT_BLOCK = 256  # partial sums of a channel that a finalize program adds per iteration
# Triton's CPU interpreter runs the programs one after another, at milliseconds each whatever their size: there the
# tiles are larger, the reductions split in fewer programs, and one finalize program takes all of a sample's groups
INTERPRETER_TILE = 16384
INTERPRETER_PROGRAMS = 4


@triton.jit
def _group_norm_stats(x_ptr, part_ptr, S, rows_per_split, splits, stride_b, stride_s, stride_c,
                      C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (sample b, split k): per channel, the sums of d = x - x[b, voxel 0] and d * d over the split's
    voxels, into part[b, 0 | 1, c, k]. Shifting by one voxel of the channel keeps the float32 sums exact enough
    for a variance however far the mean is from zero (the shifted-data algorithm)."""
    pid = tl.program_id(0)
    b = pid // splits
    k = pid % splits
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    base = x_ptr + b.to(tl.int64) * stride_b
    ref = tl.load(base + c * stride_c, mask=cm, other=0.0).to(tl.float32)
    acc1 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    start = k * rows_per_split
    for i in range(0, rows_per_split, BLOCK_S):
        s = start + i + tl.arange(0, BLOCK_S)
        m = (s < S)[:, None] & cm[None, :]
        x = tl.load(base + s[:, None] * stride_s + c[None, :] * stride_c, mask=m, other=0.0).to(tl.float32)
        d = tl.where(m, x - ref[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    out = part_ptr + (b * 2 * C + c) * splits + k
    tl.store(out, tl.sum(acc1, axis=0), mask=cm)
    tl.store(out + C * splits, tl.sum(acc2, axis=0), mask=cm)


@triton.jit
def _per_group(v, GPP: tl.constexpr, BLOCK_CPG: tl.constexpr):
    """The sum of a (GPP * BLOCK_CPG,) per-channel vector over each group's BLOCK_CPG entries, per channel."""
    sums = tl.sum(tl.reshape(v, (GPP, BLOCK_CPG)), axis=1)
    return tl.reshape(tl.broadcast_to(sums[:, None], (GPP, BLOCK_CPG)), (GPP * BLOCK_CPG,))


@triton.jit
def _partial_sums(rows, splits, cm, BLOCK_CH: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sums over k of rows[c, k] (a channel's partial sums, `splits` apart), per channel."""
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_CH, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, splits, BLOCK_K):
        k = k0 + kk
        acc += tl.load(rows[:, None] + k[None, :], mask=cm[:, None] & (k < splits)[None, :], other=0.0)
    return tl.sum(acc, axis=1)


@triton.jit
def _group_norm_finalize(part_ptr, x_ptr, w_ptr, bias_ptr, shift_ptr, center_ptr, rstd_ptr, scale_ptr, offset_ptr,
                         S, splits, stride_b, stride_c, eps,
                         C: tl.constexpr, CPG: tl.constexpr, BLOCK_CPG: tl.constexpr, GPP: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Program (sample b, GPP groups from the program's first): each group's mean and 1/std from its channels'
    partial sums (the law of total variance over channels: mean of the variances plus variance of the means),
    and per channel scale = rstd * w and offset = bias - (mean - shift) * scale, so that the norm of x + shift
    is x * scale + offset. center = mean - shift is the value xhat is measured from, per channel."""
    pid = tl.program_id(0)
    programs = C // CPG // GPP
    b = pid // programs
    i = tl.arange(0, GPP * BLOCK_CPG)
    j = i % BLOCK_CPG
    cm = j < CPG
    c = ((pid % programs) * GPP + i // BLOCK_CPG) * CPG + j
    rows = part_ptr + (b * 2 * C + c) * splits
    mu = _partial_sums(rows, splits, cm, GPP * BLOCK_CPG, BLOCK_K) / S  # mean of d, per channel
    var = tl.maximum(_partial_sums(rows + C * splits, splits, cm, GPP * BLOCK_CPG, BLOCK_K) / S - mu * mu, 0.0)
    ref = tl.load(x_ptr + b.to(tl.int64) * stride_b + c * stride_c, mask=cm, other=0.0).to(tl.float32)
    shift = tl.zeros((GPP * BLOCK_CPG,), dtype=tl.float32)
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + b * C + c, mask=cm, other=0.0).to(tl.float32)
    mean = tl.where(cm, ref + mu + shift, 0.0)
    g_mean = _per_group(mean, GPP, BLOCK_CPG) / CPG
    dev = tl.where(cm, mean - g_mean, 0.0)
    g_var = _per_group(tl.where(cm, var, 0.0) + dev * dev, GPP, BLOCK_CPG) / CPG
    rstd = tl.rsqrt(g_var + eps)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    center = g_mean - shift
    scale = rstd * w
    out = b * C + c
    tl.store(center_ptr + out, center, mask=cm)
    tl.store(rstd_ptr + out, rstd, mask=cm)
    tl.store(scale_ptr + out, scale, mask=cm)
    tl.store(offset_ptr + out, bias - center * scale, mask=cm)


@triton.jit
def _group_norm_silu_apply(x_ptr, y_ptr, scale_ptr, offset_ptr, S, tiles, stride_b, stride_s, stride_c,
                           C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr):
    """Program (sample b, tile t): y = silu(x * scale + offset) over BLOCK_S voxels and all channels, float32
    inside, stored in y's dtype. y has x's strides."""
    pid = tl.program_id(0)
    b = pid // tiles
    t = pid % tiles
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    scale = tl.load(scale_ptr + b * C + c, mask=cm, other=0.0)
    offset = tl.load(offset_ptr + b * C + c, mask=cm, other=0.0)
    s = t * BLOCK_S + tl.arange(0, BLOCK_S)
    m = (s < S)[:, None] & cm[None, :]
    at = b.to(tl.int64) * stride_b + s[:, None] * stride_s + c[None, :] * stride_c
    a = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32) * scale[None, :] + offset[None, :]
    if SILU:
        a = a * tl.sigmoid(a)
    tl.store(y_ptr + at, a.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _coefficients(center_ptr, rstd_ptr, w_ptr, bias_ptr, at, c, cm):
    """Per channel of sample b (at = b * C + c): center, rstd, and the forward's scale and offset."""
    center = tl.load(center_ptr + at, mask=cm, other=0.0)
    rstd = tl.load(rstd_ptr + at, mask=cm, other=0.0)
    scale = rstd * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    return center, rstd, scale, tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32) - center * scale


@triton.jit
def _da_xhat(x, dy, scale, offset, center, rstd, SILU: tl.constexpr):
    """The gradient at the norm's output (through the SiLU) and xhat, for float32 tiles."""
    a = x * scale[None, :] + offset[None, :]
    if SILU:
        sg = tl.sigmoid(a)
        dy = dy * sg * (1.0 + a * (1.0 - sg))
    return dy, (x - center[None, :]) * rstd[None, :]


@triton.jit
def _group_norm_silu_backward_sums(x_ptr, dy_ptr, center_ptr, rstd_ptr, w_ptr, bias_ptr, part_ptr,
                                   S, rows_per_split, splits, stride_b, stride_s, stride_c, dy_stride_b,
                                   dy_stride_s, dy_stride_c, C: tl.constexpr, BLOCK_S: tl.constexpr,
                                   BLOCK_C: tl.constexpr, SILU: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Program (sample b, split k): per channel, the sums of da, da * xhat and (with a shift) xhat over the
    split's voxels, into part[b, 0 | 1 | 2, c, k]."""
    pid = tl.program_id(0)
    b = pid // splits
    k = pid % splits
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    center, rstd, scale, offset = _coefficients(center_ptr, rstd_ptr, w_ptr, bias_ptr, b * C + c, c, cm)
    acc1 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
    x_base = x_ptr + b.to(tl.int64) * stride_b
    dy_base = dy_ptr + b.to(tl.int64) * dy_stride_b
    start = k * rows_per_split
    for i in range(0, rows_per_split, BLOCK_S):
        s = start + i + tl.arange(0, BLOCK_S)
        m = (s < S)[:, None] & cm[None, :]
        x = tl.load(x_base + s[:, None] * stride_s + c[None, :] * stride_c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_base + s[:, None] * dy_stride_s + c[None, :] * dy_stride_c, mask=m, other=0.0)
        da, xhat = _da_xhat(x, dy.to(tl.float32), scale, offset, center, rstd, SILU)
        acc1 += tl.where(m, da, 0.0)
        acc2 += tl.where(m, da * xhat, 0.0)
        if HAS_SHIFT:
            acc3 += tl.where(m, xhat, 0.0)
    out = part_ptr + (b * 3 * C + c) * splits + k
    tl.store(out, tl.sum(acc1, axis=0), mask=cm)
    tl.store(out + C * splits, tl.sum(acc2, axis=0), mask=cm)
    if HAS_SHIFT:
        tl.store(out + 2 * C * splits, tl.sum(acc3, axis=0), mask=cm)


@triton.jit
def _group_norm_backward_finalize(part_ptr, w_ptr, rstd_ptr, k1_ptr, k2_ptr, dw_ptr, db_ptr, dshift_ptr,
                                  B, S, splits, C: tl.constexpr, CPG: tl.constexpr, BLOCK_CPG: tl.constexpr,
                                  GPP: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """Program (GPP groups from the program's first), over the samples: with each group's means m1 of w * da and
    m2 of w * da * xhat, dx = scale * da - k1 - xhat * k2 where k1 = rstd * m1 and k2 = rstd * m2; dgamma and
    dbeta are the sums of da * xhat and da over samples and voxels; the shift's gradient, the sum of dx over a
    channel's voxels, is scale * sum(da) - S * k1 - k2 * sum(xhat)."""
    i = tl.arange(0, GPP * BLOCK_CPG)
    j = i % BLOCK_CPG
    cm = j < CPG
    c = (tl.program_id(0) * GPP + i // BLOCK_CPG) * CPG + j
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    dw = tl.zeros((GPP * BLOCK_CPG,), dtype=tl.float32)
    db = tl.zeros((GPP * BLOCK_CPG,), dtype=tl.float32)
    n = S * CPG
    for b in range(0, B):
        rows = part_ptr + (b * 3 * C + c) * splits
        sum_da = _partial_sums(rows, splits, cm, GPP * BLOCK_CPG, BLOCK_K)
        sum_da_xhat = _partial_sums(rows + C * splits, splits, cm, GPP * BLOCK_CPG, BLOCK_K)
        rstd = tl.load(rstd_ptr + b * C + c, mask=cm, other=0.0)
        k1 = rstd * _per_group(w * sum_da, GPP, BLOCK_CPG) / n
        k2 = rstd * _per_group(w * sum_da_xhat, GPP, BLOCK_CPG) / n
        tl.store(k1_ptr + b * C + c, k1, mask=cm)
        tl.store(k2_ptr + b * C + c, k2, mask=cm)
        if HAS_SHIFT:
            sum_xhat = _partial_sums(rows + 2 * C * splits, splits, cm, GPP * BLOCK_CPG, BLOCK_K)
            dshift = rstd * w * sum_da - S * k1 - k2 * sum_xhat
            tl.store(dshift_ptr + b * C + c, dshift.to(dshift_ptr.dtype.element_ty), mask=cm)
        dw += sum_da_xhat
        db += sum_da
    tl.store(dw_ptr + c, dw.to(dw_ptr.dtype.element_ty), mask=cm)
    tl.store(db_ptr + c, db.to(db_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _group_norm_silu_backward_dx(x_ptr, dy_ptr, dx_ptr, center_ptr, rstd_ptr, w_ptr, bias_ptr, k1_ptr, k2_ptr,
                                 S, tiles, stride_b, stride_s, stride_c, dy_stride_b, dy_stride_s, dy_stride_c,
                                 C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr):
    """Program (sample b, tile t): dx = scale * da - k1 - xhat * k2, in dx's dtype; dx has x's strides."""
    pid = tl.program_id(0)
    b = pid // tiles
    t = pid % tiles
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    center, rstd, scale, offset = _coefficients(center_ptr, rstd_ptr, w_ptr, bias_ptr, b * C + c, c, cm)
    k1 = tl.load(k1_ptr + b * C + c, mask=cm, other=0.0)
    k2 = tl.load(k2_ptr + b * C + c, mask=cm, other=0.0)
    s = t * BLOCK_S + tl.arange(0, BLOCK_S)
    m = (s < S)[:, None] & cm[None, :]
    at = b.to(tl.int64) * stride_b + s[:, None] * stride_s + c[None, :] * stride_c
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + b.to(tl.int64) * dy_stride_b + s[:, None] * dy_stride_s + c[None, :] * dy_stride_c,
                 mask=m, other=0.0)
    da, xhat = _da_xhat(x, dy.to(tl.float32), scale, offset, center, rstd, SILU)
    dx = da * scale[None, :] - k1[None, :] - xhat * k2[None, :]
    tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------ launches

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter: they and triton's own library functions were decorated
    for it (TRITON_INTERPRET=1 when triton was first imported), and it is still told to (the interpreter reads the
    variable again as it runs them)."""
    decorated = not any(isinstance(f, triton.runtime.JITFunction) for f in (_group_norm_stats, tl.zeros))
    return decorated and os.environ.get("TRITON_INTERPRET") == "1"


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x itself where it is channels-last or contiguous (the kernels index voxels with one stride), else a
    channels-last copy (a contiguous one for other than 5 dimensions)."""
    cl = x.ndim == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
    if cl or x.is_contiguous():
        return x
    return x.contiguous(memory_format=torch.channels_last_3d) if x.ndim == 5 else x.contiguous()


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(sample, voxel, channel) strides of a dense (B, C, *spatial) tensor, either layout."""
    c, s = x.shape[1], math.prod(x.shape[2:])
    cl = x.ndim == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
    return (c * s, c, 1) if cl else (c * s, 1, s)


def _blocks(x: torch.Tensor) -> tuple[int, int]:
    """(voxels, channels) of a tile: all the channels, padded to a power of two."""
    block_c = triton.next_power_of_2(x.shape[1])
    return max(1, (TILE if x.device.type == "cuda" else INTERPRETER_TILE) // block_c), block_c


def _splits(x: torch.Tensor, block_s: int) -> tuple[int, int]:
    """(splits per sample, voxels per split: a multiple of block_s) for a split reduction over x's voxels."""
    b, s = x.shape[0], math.prod(x.shape[2:])
    programs = PROGRAMS_PER_SM * _multiprocessors(x.device) if x.device.type == "cuda" else INTERPRETER_PROGRAMS
    blocks = triton.cdiv(s, block_s)
    per_split = triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(programs, b))))
    return triton.cdiv(blocks, per_split), per_split * block_s


def _groups_per_program(x: torch.Tensor, groups: int) -> int:
    """Groups a finalize program takes: one on a GPU, as many as a power of two dividing them in the interpreter."""
    return 1 if x.device.type == "cuda" else groups & -groups


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(x: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    c = x.shape[1]
    if x.dtype not in DTYPES:
        raise TypeError(f"group_norm='triton' takes {', '.join(str(d) for d in DTYPES)} activations, not {x.dtype}")
    if x.device.type != "cuda" and not interpreted():
        raise RuntimeError("group_norm='triton' runs on a CUDA device, or on the CPU with TRITON_INTERPRET=1 set "
                           "before triton is first imported")
    assert c % groups == 0, f"{c} channels do not split into {groups} groups"
    assert weight.shape == (c,), f"weight of shape {tuple(weight.shape)} for {c} channels"
    assert x.numel() // x.shape[0] < 2 ** 31, "a sample of more than 2^31 elements (the kernels index it in int32)"


def _empty_stats(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape[:2], device=x.device, dtype=torch.float32)


@custom_op("medddpm::group_norm_silu", mutates_args=())
def group_norm_silu_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shift: Optional[torch.Tensor],
                            groups: int, eps: float, silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(group_norm(x + shift)), center, rstd): the output in x's dtype and layout, and per (sample, channel)
    the value xhat is measured from (the group's mean less the shift) and the group's 1/std, float32."""
    _check(x, weight, groups)
    x = _dense(x)
    b, c = x.shape[:2]
    s = math.prod(x.shape[2:])
    block_s, block_c = _blocks(x)
    splits, rows = _splits(x, block_s)
    sb, ss, sc = _strides(x)
    part = torch.empty((b, 2, c, splits), device=x.device, dtype=torch.float32)
    _group_norm_stats[(b * splits,)](x, part, s, rows, splits, sb, ss, sc, C=c, BLOCK_S=block_s, BLOCK_C=block_c)
    center, rstd, scale, offset = (_empty_stats(x) for _ in range(4))
    cpg = c // groups
    has_shift = shift is not None
    shift = shift.contiguous() if has_shift else rstd  # a pointer the kernel never reads
    gpp = _groups_per_program(x, groups)
    _group_norm_finalize[(b * groups // gpp,)](part, x, weight, bias, shift, center, rstd, scale, offset, s, splits,
                                               sb, sc, eps, C=c, CPG=cpg, BLOCK_CPG=triton.next_power_of_2(cpg),
                                               GPP=gpp, BLOCK_K=SPLIT_BLOCK, HAS_SHIFT=has_shift)
    y = torch.empty_like(x)
    tiles = triton.cdiv(s, block_s)
    _group_norm_silu_apply[(b * tiles,)](x, y, scale, offset, s, tiles, sb, ss, sc, C=c, BLOCK_S=block_s,
                                         BLOCK_C=block_c, SILU=silu)
    return y, center, rstd


@group_norm_silu_forward.register_fake
def _(x, weight, bias, shift, groups, eps, silu):
    return torch.empty_like(_dense(x)), _empty_stats(x), _empty_stats(x)


@custom_op("medddpm::group_norm_silu_backward", mutates_args=())
def group_norm_silu_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                             center: torch.Tensor, rstd: torch.Tensor, shift: Optional[torch.Tensor], groups: int,
                             silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dshift) of `group_norm_silu_forward`; dshift is empty without a shift."""
    x, dy = _dense(x), _dense(dy)
    b, c = x.shape[:2]
    s = math.prod(x.shape[2:])
    block_s, block_c = _blocks(x)
    splits, rows = _splits(x, block_s)
    sb, ss, sc = _strides(x)
    dsb, dss, dsc = _strides(dy)
    has_shift = shift is not None
    part = torch.empty((b, 3, c, splits), device=x.device, dtype=torch.float32)  # the third with a shift only
    _group_norm_silu_backward_sums[(b * splits,)](x, dy, center, rstd, weight, bias, part, s, rows, splits, sb, ss,
                                                  sc, dsb, dss, dsc, C=c, BLOCK_S=block_s, BLOCK_C=block_c,
                                                  SILU=silu, HAS_SHIFT=has_shift)
    k1, k2 = _empty_stats(x), _empty_stats(x)
    dweight, dbias = torch.empty_like(weight), torch.empty_like(bias)
    dshift = torch.empty_like(shift) if has_shift else x.new_empty(0)
    cpg = c // groups
    gpp = _groups_per_program(x, groups)
    _group_norm_backward_finalize[(groups // gpp,)](part, weight, rstd, k1, k2, dweight, dbias,
                                                    dshift if has_shift else k1, b, s, splits, C=c, CPG=cpg,
                                                    BLOCK_CPG=triton.next_power_of_2(cpg), GPP=gpp,
                                                    BLOCK_K=SPLIT_BLOCK, HAS_SHIFT=has_shift)
    dx = torch.empty_like(x)
    tiles = triton.cdiv(s, block_s)
    _group_norm_silu_backward_dx[(b * tiles,)](x, dy, dx, center, rstd, weight, bias, k1, k2, s, tiles, sb, ss, sc,
                                               dsb, dss, dsc, C=c, BLOCK_S=block_s, BLOCK_C=block_c, SILU=silu)
    return dx, dweight, dbias, dshift


@group_norm_silu_backward.register_fake
def _(dy, x, weight, bias, center, rstd, shift, groups, silu):
    dshift = torch.empty_like(shift) if shift is not None else x.new_empty(0)
    return torch.empty_like(_dense(x)), torch.empty_like(weight), torch.empty_like(bias), dshift


def _setup_context(ctx, inputs, output):
    x, weight, bias, shift, groups, eps, silu = inputs
    _, center, rstd = output
    ctx.save_for_backward(x, weight, bias, center, rstd, shift)
    ctx.groups, ctx.silu = groups, silu
    ctx.mark_non_differentiable(center, rstd)


def _backward(ctx, dy, _dcenter, _drstd):
    x, weight, bias, center, rstd, shift = ctx.saved_tensors
    dx, dweight, dbias, dshift = group_norm_silu_backward(dy, x, weight, bias, center, rstd, shift, ctx.groups,
                                                          ctx.silu)
    return dx, dweight, dbias, dshift if shift is not None else None, None, None, None


group_norm_silu_forward.register_autograd(_backward, setup_context=_setup_context)


def group_norm_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float, *,
                    silu: bool = True, shift: torch.Tensor | None = None) -> torch.Tensor:
    """silu(group_norm(x + shift[:, :, None, None, None])) (without the SiLU where `silu=False`; no shift where
    None) through the Triton kernels, in x's dtype and layout."""
    return group_norm_silu_forward(x, weight, bias, shift, groups, eps, silu)[0]
