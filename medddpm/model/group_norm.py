"""GroupNorm as the U-Net computes it: statistics in float32 (or wider) whatever the activation dtype
(`GroupNorm32`), in one of `GROUP_NORM_KINDS`: PyTorch's own ("aten"); from per-channel statistics over voxel
chunks, for channels-last activations ("chunked", `group_norm_chunked`); chunked statistics with a
hand-written backward that takes in the SiLU after it ("fused", `_GroupNormSiLU`); or the norm, the SiLU and
the residual block's timestep features added before them as Triton kernels with split reductions ("triton",
`medddpm.model.group_norm_triton`).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

GROUP_NORM_KINDS = ("aten", "chunked", "fused", "triton")
SILU_KINDS = ("fused", "triton")  # the kinds that compute the SiLU after the norm themselves
STAT_CHUNKS = 256  # voxel chunks of the first statistics pass: rows enough to fill the GPU at every level


def _group_stats(x: torch.Tensor, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, channel) mean and 1/std of x's GroupNorm groups, (B, C) each, from per-channel
    statistics over voxel chunks (see `group_norm_chunked`). In x's dtype: call it on float32."""
    var, mean = torch.var_mean(_chunk_rows(x), dim=2, correction=0)  # (B, K, C)
    return group_stats_from_parts(mean, var, groups, eps)


def group_stats_from_parts(mean: torch.Tensor, var: torch.Tensor, groups: int,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sample, channel) mean and 1/std of the GroupNorm groups, (B, C) each, from the mean and variance of
    equal-count parts of each channel, (B, K, C) or (B, C): by the law of total variance (the mean of the parts'
    variances plus the variance of their means; Chan et al. 1979)."""
    b, c = mean.shape[0], mean.shape[-1]
    assert c % groups == 0, f"{c} channels do not split into {groups} groups"
    var, mean = var.reshape(b, -1, groups, c // groups), mean.reshape(b, -1, groups, c // groups)
    g_mean = mean.mean(dim=(1, 3), keepdim=True)  # (B, 1, G, 1)
    g_var = var.mean(dim=(1, 3), keepdim=True) + (mean - g_mean).square().mean(dim=(1, 3), keepdim=True)
    per_channel = lambda t: t.expand(b, 1, groups, c // groups).reshape(b, c)  # noqa: E731
    return per_channel(g_mean), per_channel(torch.rsqrt(g_var + eps))


def _chunk_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) -> (B, K, voxels / K, C): a view when x is channels-last, so that a reduction over
    dim 2 reads thousands of rows along the contiguous channel axis."""
    b, c, *spatial = x.shape
    voxels = math.prod(spatial)
    k = math.gcd(voxels, STAT_CHUNKS)
    return x.permute(0, *range(2, x.ndim), 1).reshape(b, k, voxels // k, c)


def group_norm_chunked(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float) -> torch.Tensor:
    """F.group_norm(x, ...) computed from per-channel statistics, for channels-last activations.

    Inductor lowers F.group_norm to one reduction per (sample, group) over C/G x D*H*W elements: 32
    rows for a whole 128^3 volume, read with a stride of C in NDHWC memory. Here the first pass is
    a var_mean per channel over chunks of voxels, (B, K, n, C) -> (B, K, C): thousands of rows, each
    read along the contiguous channel axis. Chunks and channels of a group then combine by the law
    of total variance (equal counts: var = mean of variances + variance of means; Chan et al. 1979),
    as exact as a one-pass Welford. The output is x * scale + shift with per-channel scale and shift,
    as PyTorch's own GroupNorm kernel computes it. Statistics in x's dtype: call it on float32.
    """
    mean, rstd = _group_stats(x, groups, eps)
    scale, shift = _affine(mean, rstd, weight, bias)
    per_channel = scale.shape + (1,) * (x.ndim - 2)
    return x * scale.view(per_channel) + shift.view(per_channel)


def _affine(mean, rstd, weight, bias):
    """GroupNorm's output as x * scale + shift, with per (sample, channel) scale and shift."""
    scale = rstd * weight if weight is not None else rstd
    shift = -mean * scale
    return scale, (shift + bias if bias is not None else shift)



class _GroupNormSiLU(torch.autograd.Function):
    """silu(group_norm(x)) (or group_norm(x) with `silu=False`) computed in float32 whatever x's dtype,
    output in x's dtype, with a hand-written backward (`group_norm="fused"`).

    Autograd's backward of `group_norm_chunked` differentiates its chunk statistics: each voxel's
    gradient reads its chunk's mean and variance gradients through the chunked view, whose index
    arithmetic Inductor does not simplify (the kernel is limited by its integer instructions), and it is
    written in float32. The closed form needs two passes over x and the output gradient: per-channel
    sums of da and da * xhat (on the chunked view), then dx = scale * da - rstd * (m1 + xhat * m2) with
    per-channel coefficients, written in x's dtype. Only x and the (B, C) statistics are kept; the
    SiLU's input is recomputed. The ablation's `best+group_norm=chunked` row measures what it buys."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, silu: bool):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        mean, rstd = _group_stats(xf, groups, eps)
        scale, shift = _affine(mean, rstd, weight, bias)
        a = xf * _bcast(scale, x) + _bcast(shift, x)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups, ctx.silu = groups, silu
        # A new tensor even where x is float32 (a bf16 x makes it a cast anyway): torch 2.11's Dynamo gave every
        # input a zero gradient when the output was the intermediate itself (pytorch/pytorch#180642, fixed in 2.12)
        return (F.silu(a) if silu else a).to(x.dtype, copy=True)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = group_norm_silu_backward(x, weight, bias, mean, rstd, ctx.groups, ctx.silu, dy)
        return dx, dweight, dbias, None, None, None


def group_norm_silu_backward(x, weight, bias, mean, rstd, groups: int, silu: bool, dy):
    """The gradients of silu(group_norm(x)) (of group_norm(x) with `silu=False`) for x, weight and bias, given
    the output's gradient dy and the (B, C) statistics of x (see `_GroupNormSiLU`): dx in x's dtype, dweight and
    dbias (None where the norm has no affine parameters) in float32 or wider."""
    b, c, *spatial = x.shape
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    dyf = dy.to(xf.dtype)
    scale, shift = _affine(mean, rstd, weight, bias)
    xhat = (xf - _bcast(mean, x)) * _bcast(rstd, x)
    if silu:
        a = xf * _bcast(scale, x) + _bcast(shift, x)
        s = torch.sigmoid(a)
        da = dyf * s * (1 + a * (1 - s))
    else:
        da = dyf
    # per (sample, channel) sums over voxels: dbeta = sum da, dgamma = sum da * xhat
    sum_da = _chunk_rows(da).sum(dim=2).sum(dim=1)
    sum_da_xhat = _chunk_rows(da * xhat).sum(dim=2).sum(dim=1)
    gamma = weight if weight is not None else torch.ones_like(sum_da[0])
    n = (c // groups) * math.prod(spatial)  # elements of a group
    group_mean = lambda t: t.view(b, groups, -1).sum(-1, keepdim=True).expand(  # noqa: E731
        b, groups, c // groups).reshape(b, c) / n
    m1, m2 = group_mean(gamma * sum_da), group_mean(gamma * sum_da_xhat)  # means of dxhat, dxhat * xhat
    dx = da * _bcast(scale, x) - _bcast(rstd * m1, x) - xhat * _bcast(rstd * m2, x)
    dweight = sum_da_xhat.sum(0) if weight is not None else None
    dbias = sum_da.sum(0) if bias is not None else None
    return dx.to(x.dtype), dweight, dbias


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B, C, 1, ...) against a (B, C, *spatial) tensor."""
    return t.view(t.shape + (1,) * (like.ndim - 2))


class GroupNorm32(nn.GroupNorm):
    """GroupNorm whose statistics are computed in float32 (or wider) whatever the activation dtype.

    `kind="chunked"`: the same function through `group_norm_chunked` (for compiled channels-last runs).
    `kind="fused"`: chunked statistics and a hand-written backward (`_GroupNormSiLU`); `kind="triton"`: Triton
    kernels (`medddpm.model.group_norm_triton`). With `silu=True` (those two kinds) the SiLU that follows is part
    of it (the module then computes silu(group_norm(x))). `forward(x, shift)` normalizes x + shift, a per
    (sample, channel) term broadcast over the voxels, which the Triton kernels add as they read x."""

    def __init__(self, num_groups: int, num_channels: int, *, kind: str = "aten", silu: bool = False):
        assert kind in GROUP_NORM_KINDS, f"group norm kind must be one of {GROUP_NORM_KINDS}, got {kind!r}"
        assert not silu or kind in SILU_KINDS, f"only the {' and '.join(SILU_KINDS)} group norms take their SiLU " \
                                               f"in, not {kind!r}"
        if kind == "triton" and importlib.util.find_spec("triton") is None:
            raise ModuleNotFoundError("group_norm='triton' needs the triton package (pip install triton)")
        super().__init__(num_groups, num_channels)
        self.kind, self.silu = kind, silu

    def forward(self, x, shift: torch.Tensor | None = None):
        if self.kind == "triton":
            from medddpm.model.group_norm_triton import group_norm_silu

            return group_norm_silu(x, self.weight, self.bias, self.num_groups, self.eps, silu=self.silu, shift=shift)
        if shift is not None:
            x = x + shift[:, :, None, None, None]
        if self.kind == "fused":
            return _GroupNormSiLU.apply(x, self.weight, self.bias, self.num_groups, self.eps, self.silu)
        dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 -> fp32; a float64 model (tests) stays float64
        fn = group_norm_chunked if self.kind == "chunked" else F.group_norm
        return fn(x.to(dtype), self.num_groups, self.weight, self.bias, self.eps).to(x.dtype)


def triton_unavailable(device: torch.device | str) -> str | None:
    """Why `group_norm="triton"` cannot run on `device`, or None where it can: its kernels need the triton
    package, and a CUDA device or Triton's CPU interpreter (TRITON_INTERPRET=1 when triton is first imported)."""
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package"
    if torch.device(device).type == "cuda":
        return None
    from medddpm.model.group_norm_triton import interpreted

    return None if interpreted() else "Triton kernels: need a CUDA device (or TRITON_INTERPRET=1 on the CPU)"


def norm(channels: int, *, kind: str = "aten") -> nn.GroupNorm:
    return GroupNorm32(32, channels, kind=kind)


def norm_silu(channels: int, *, kind: str = "aten") -> list[nn.Module]:
    """GroupNorm then SiLU, as two entries of an nn.Sequential; the fused and triton kinds compute both in their
    first (the second is then an identity), so parameter names are the same for every kind."""
    if kind in SILU_KINDS:
        return [GroupNorm32(32, channels, kind=kind, silu=True), nn.Identity()]
    return [norm(channels, kind=kind), nn.SiLU()]
