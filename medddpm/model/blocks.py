"""The U-Net's building blocks: the residual block and the timestep features it adds (`ResBlock`,
`timestep_embedding`), self-attention over all voxels (`Attention`), the resamplers (`Downsample`,
`Upsample`), and the narrow convolutions computed otherwise than by cuDNN's kernels for their shapes
(`PaddedConv3d`, `TapConv3d`).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from medddpm.model.group_norm import norm, norm_silu

ATTENTION_KINDS = ("math", "sdpa")


# ----------------------------------------------------------------------------------------- helpers


def zero_init(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


ALIGN_CHANNELS = 8  # bf16 channels per 16-byte vector: cuDNN's Hopper kernels want C and K multiples of it


class PaddedConv3d(nn.Conv3d):
    """nn.Conv3d (same parameters) computed with its in- and out-channels zero-padded to a multiple of
    `ALIGN_CHANNELS`, then the extra outputs dropped: the same numbers. For the stem (4 or 8 channels
    in) and the output (1 or 4 out) of the U-Net. Aimed at cuDNN's sm80 "indexed" kernels; on Hopper those
    stay, and what goes is the stem input's layout conversion (the ablation's `best+pad_channels=false` row
    measures it)."""

    def forward(self, x):
        pin, pout = -self.in_channels % ALIGN_CHANNELS, -self.out_channels % ALIGN_CHANNELS
        if not (pin or pout):
            return super().forward(x)
        cl = torch.channels_last_3d
        fmt = cl if x.is_contiguous(memory_format=cl) else torch.contiguous_format
        x = F.pad(x, (0, 0) * 3 + (0, pin)).contiguous(memory_format=fmt)  # (W, H, D, C) pairs from the last dim
        w = F.pad(self.weight, (0, 0) * 3 + (0, pin, 0, pout))  # (kW, kH, kD, C_in, C_out)
        b = F.pad(self.bias, (0, pout)) if self.bias is not None else None
        return F.conv3d(x, w, b, self.stride, self.padding, self.dilation, self.groups)[:, : self.out_channels]


class _TapSum(torch.autograd.Function):
    """(B, D, H, W, >= 27 * C) tap shares z -> (B, D, H, W, C) float32: y[v] = sum_t z[v + k_t - 1, t], k_t the
    tap's (i, j, k). Its backward gathers the output gradient onto each tap (an unfold, flipped), where
    autograd's own backward of the 27 slices would add 27 zero-padded copies."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, channels: int) -> torch.Tensor:
        ctx.z_dtype, ctx.width = z.dtype, z.shape[-1]
        d, h, w, c = *z.shape[1:4], channels
        zp = F.pad(z.to(torch.promote_types(z.dtype, torch.float32)), (0, 0, 1, 1, 1, 1, 1, 1))
        return sum(zp[:, i:i + d, j:j + h, k:k + w, t * c:(t + 1) * c]
                   for t, (i, j, k) in enumerate(itertools.product(range(3), repeat=3)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, d, h, w, c = grad.shape
        g = F.pad(grad, (0, 0, 1, 1, 1, 1, 1, 1)).unfold(1, 3, 1).unfold(2, 3, 1).unfold(3, 3, 1)  # (B,D,H,W,C,3,3,3)
        g = g.flip(-3, -2, -1).permute(0, 1, 2, 3, 5, 6, 7, 4).reshape(b, d, h, w, 27 * c)
        return F.pad(g, (0, ctx.width - 27 * c)).to(ctx.z_dtype), None


_TAPS = tuple(itertools.product(range(3), repeat=3))  # (i, j, k) offsets of a 3x3x3 kernel's taps, tap-major order


class _TapMajorConv(torch.autograd.Function):
    """(B, Dp, Hp, Wp, C) input with a zero halo of one voxel, (n, C) weight rows (tap-major, then output channel;
    n >= 27 * C_out), (C_out,) bias or None -> (B, C_out, D, H, W) in the GEMM's dtype: zt = w @ x^T, the n rows of
    tap shares each contiguous over the padded grid, then y[v] = bias + sum_t zt[t, v + k_t] in float32 (one
    rounding, as a convolution's accumulator): for each tap one shifted slice, read at unit stride, with no mask
    (the halo's shares are zeros: the GEMM has no bias). Backward: each tap's row of the shares' gradient is the
    output gradient shifted onto the padded grid (an unfold, flipped), then two GEMMs whose input gradient comes
    out channels-last, (B, P, C) row-major."""

    @staticmethod
    def forward(ctx, xp: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, channels: int) -> torch.Tensor:
        b, dp, hp, wp, c = xp.shape
        d, h, w_ = dp - 2, hp - 2, wp - 2
        zt = torch.matmul(w, xp.reshape(b, -1, c).transpose(1, 2)).view(b, -1, dp, hp, wp)  # (B, n, Dp, Hp, Wp)
        ctx.save_for_backward(xp, w)
        ctx.channels, ctx.bias = channels, None if bias is None else (bias.dtype, bias.shape)
        z = zt.to(torch.promote_types(zt.dtype, torch.float32))
        y = sum(z[:, t * channels:(t + 1) * channels, i:i + d, j:j + h, k:k + w_] for t, (i, j, k) in enumerate(_TAPS))
        return (y if bias is None else y + bias.to(y.dtype).view(1, channels, 1, 1, 1)).to(zt.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xp, w = ctx.saved_tensors
        b, dp, hp, wp, c = xp.shape
        n, co = w.shape[0], ctx.channels
        grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
        dbias = None if ctx.bias is None else grad.sum((0, 2, 3, 4)).to(ctx.bias[0])
        # dzt[t * C_out + o, p] = grad[o, p - k_t] on the padded grid: p + (2 - i, 2 - j, 2 - k) of grad padded by 2
        g = F.pad(grad, (2, 2) * 3).unfold(2, 3, 1).unfold(3, 3, 1).unfold(4, 3, 1)  # (B, C_out, Dp, Hp, Wp, 3, 3, 3)
        g = g.flip(-3, -2, -1).permute(0, 5, 6, 7, 1, 2, 3, 4).reshape(b, 27 * co, dp * hp * wp)
        dzt = F.pad(g, (0, 0, 0, n - 27 * co)).to(w.dtype)  # (B, n, P)
        dx = torch.matmul(dzt.transpose(1, 2), w).view(b, dp, hp, wp, c)  # (B, P, C): channels-last
        dw = torch.matmul(dzt, xp.reshape(b, -1, c)).sum(0)
        return dx, dw, dbias, None


class TapConv3d(nn.Conv3d):
    """nn.Conv3d (same parameters; 3x3x3, stride 1, padding 1, few output channels) computed as a GEMM and
    a sum of shifted taps. For the U-Net's output layer, whose three convolution kernels cuDNN takes from
    sm80 on Hopper even padded (`PaddedConv3d`): as compiled taps the layer's forward and backward take less
    than half cuDNN's time (the ablation's `best+tap_gemm=false` row).

    The input times the (C_in, 27 * C_out) weights gives each voxel's share of its 27 neighbours' outputs,
    which are summed back by shifting, in float32 (one rounding, as a convolution's accumulator). The
    GEMM's narrow side is zero-padded to a multiple of `ALIGN_CHANNELS` (cuBLAS's tensor-core kernels want
    16-byte rows). The result is channels-last. (The stem, narrow on its input side, as a GEMM over
    gathered taps was slower than cuDNN: gathering its columns cost more than the convolution.)"""

    def __init__(self, *args, tap_major: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        assert (self.kernel_size, self.stride, self.padding, self.dilation, self.groups) == (
            (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1), "TapConv3d computes 3x3x3 convolutions with padding 1 only"
        self.tap_major = tap_major

    def forward(self, x):
        xl = x.permute(0, 2, 3, 4, 1)  # (B, D, H, W, C): a contiguous view of a channels-last input
        c, n = self.out_channels, 27 * self.out_channels
        weight = self.weight.permute(2, 3, 4, 0, 1).reshape(n, self.in_channels)  # rows tap-major, then out channel
        weight = F.pad(weight, (0, 0, 0, -n % ALIGN_CHANNELS))
        if self.tap_major:
            # `tap_major`: the shares of the voxel-major GEMM (B, D, H, W, n) are read 27 times at a stride of n
            # per voxel by the sum; tap-major each tap's shares are one contiguous row. The halo, written by the
            # kernel that makes x, stands for the convolution's zero padding
            xp = F.pad(xl, (0, 0, 1, 1, 1, 1, 1, 1))
            y = _TapMajorConv.apply(xp, weight.to(xp.dtype), self.bias, c)  # (B, C_out, D, H, W)
            return y.contiguous(memory_format=torch.channels_last_3d)
        z = F.linear(xl, weight)  # (B, D, H, W, n + pad)
        y = _TapSum.apply(z, c)
        y = (y if self.bias is None else y + self.bias.to(y.dtype)).to(z.dtype)
        return y.permute(0, 4, 1, 2, 3)


def timestep_embedding(t: torch.Tensor, dim: int, *, max_period: float) -> torch.Tensor:
    """(B,) timesteps -> (B, dim) sinusoidal features [cos | sin]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


# ------------------------------------------------------------------------------------------ blocks


class ResBlock(nn.Module):
    """GN-SiLU-Conv, add projected time embedding, GN-SiLU-Conv(zero); 1x1x1 skip if widths differ."""

    def __init__(self, ch_in: int, ch_out: int, *, emb_dim: int, norm_kind: str = "aten"):
        super().__init__()
        self.in_layers = nn.Sequential(*norm_silu(ch_in, kind=norm_kind), nn.Conv3d(ch_in, ch_out, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, ch_out))
        self.out_layers = nn.Sequential(*norm_silu(ch_out, kind=norm_kind),
                                        zero_init(nn.Conv3d(ch_out, ch_out, 3, padding=1)))
        self.skip = nn.Identity() if ch_in == ch_out else nn.Conv3d(ch_in, ch_out, 1)

    def forward(self, x, emb):
        skip = self.skip(x)
        h = self.in_layers(x)
        norm, act, conv = self.out_layers  # the timestep features are added by the norm (GroupNorm32's shift)
        return skip + conv(act(norm(h, self.emb_layers(emb).to(h.dtype))))


class Attention(nn.Module):
    """Single-head self-attention over all D*H*W voxels, as 1x1 projections on (B, C, N)."""

    def __init__(self, ch: int, *, kind: str = "math", recompute: bool = True, norm_kind: str = "aten"):
        super().__init__()
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind must be one of {ATTENTION_KINDS}, got {kind!r}")
        self.kind, self.recompute = kind, recompute
        self.norm = norm(ch, kind=norm_kind)
        self.qkv = nn.Conv1d(ch, 3 * ch, 1)
        self.proj_out = zero_init(nn.Conv1d(ch, ch, 1))

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            # The reference recomputes attention in backward to save the (N x N) weights.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        b, c, *spatial = x.shape
        h = self.norm(x).reshape(b, c, -1)  # (B, C, N)
        if self.kind == "sdpa":
            # Token-major (B, N, C): the 1x1 projections become plain matmuls whose outputs have unit
            # stride in the channel dim, which the flash / memory-efficient kernels require (a
            # transposed view falls back to the math kernel); free for channels-last inputs.
            h = h.transpose(1, 2)
            q, k, v = F.linear(h, self.qkv.weight[..., 0], self.qkv.bias)[:, None].chunk(3, dim=-1)
            h = F.scaled_dot_product_attention(q, k, v)[:, 0]  # (B, N, C), one head
            h = F.linear(h, self.proj_out.weight[..., 0], self.proj_out.bias).transpose(1, 2)
            return x + h.reshape(b, c, *spatial)
        q, k, v = self.qkv(h).chunk(3, dim=1)  # (B, C, N) each
        scale = c ** -0.25  # split between q and k, as guided-diffusion does, for fp16 range
        w = torch.einsum("bci,bcj->bij", q * scale, k * scale)
        w = torch.softmax(w.float(), dim=-1).to(w.dtype)
        h = torch.einsum("bij,bcj->bci", w, v)
        return x + self.proj_out(h).reshape(b, c, *spatial)


class Downsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv3d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


UPSAMPLE_KINDS = ("interpolate", "separable", "separable_ndhwc")


def upsample2x_separable(x: torch.Tensor, *, dims: tuple[int, ...] = (2, 3, 4)) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False), one axis at a time.

    Along an axis of length n: out[2i] = 0.75 x[i] + 0.25 x[i-1], out[2i+1] = 0.75 x[i] + 0.25 x[i+1],
    with the edges clamped. The same function, but its backward is slices and sums: Inductor lowers
    interpolate's backward to an atomic index_put, a sixth of a compiled step (the ablation's
    `best+upsample=interpolate` row). Eager it is slower than interpolate; it pays under torch.compile.
    `dims`: the spatial axes (1, 2, 3 for an (N, D, H, W, C) view).
    """
    for dim in dims:
        n = x.shape[dim]
        prev = torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, n - 1)], dim)
        nxt = torch.cat([x.narrow(dim, 1, n - 1), x.narrow(dim, n - 1, 1)], dim)
        x = torch.stack([0.75 * x + 0.25 * prev, 0.75 * x + 0.25 * nxt], dim + 1).flatten(dim, dim + 1)
    return x


class Upsample(nn.Module):
    """Trilinear 2x, then a 3x3x3 convolution. `kind`: "interpolate" (F.interpolate), "separable"
    (`upsample2x_separable`), or "separable_ndhwc": the same sums on the (N, D, H, W, C) view of a
    channels-last input. In the logical (N, C, D, H, W) order Inductor lays some per-axis results out
    contiguously, W fastest, and others channels-last, so kernels convert between the two on the way;
    on the view every buffer has the channels fastest (tests/test_model.py reads the compiled code), and the
    kernels stream at DRAM speed instead of converting layouts on the way."""

    def __init__(self, ch: int, *, kind: str = "interpolate"):
        super().__init__()
        assert kind in UPSAMPLE_KINDS, f"upsample kind must be one of {UPSAMPLE_KINDS}, got {kind!r}"
        self.kind = kind
        self.conv = nn.Conv3d(ch, ch, 3, padding=1)

    def forward(self, x):
        cl = x.is_contiguous(memory_format=torch.channels_last_3d)
        if self.kind == "separable_ndhwc" and cl:
            x = upsample2x_separable(x.permute(0, 2, 3, 4, 1), dims=(1, 2, 3)).permute(0, 4, 1, 2, 3)
        elif self.kind != "interpolate":
            x = upsample2x_separable(x)
            x = x.contiguous(memory_format=torch.channels_last_3d) if cl else x
        else:
            x = F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False)
        return self.conv(x)
