"""The Med-DDPM 3D U-Net (Dorjsembe et al., IEEE JBHI 2024), written from its published description.

Shapes: the network takes ``x`` of shape (B, 1 + mask_channels, D, H, W) (the noisy image with the
one-hot label map concatenated on the channel axis) and a timestep ``t`` of shape (B,), and returns
the predicted noise, (B, out_channels, D, H, W). Guided-diffusion layout: base channels 64,
multipliers (1, 1, 2, 3, 4) at 128^3, one residual block per level, self-attention at downsample
factor 8, GroupNorm(32) computed in float32, SiLU, zero-initialised output convolutions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ATTENTION_KINDS = ("math", "sdpa")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters; everything needed to rebuild the network."""

    size: int = 128
    mask_channels: int = 2
    image_channels: int = 1
    base_channels: int = 64
    channel_mult: tuple[int, ...] | None = None  # None: the reference's choice for `size`
    num_res_blocks: int = 1
    attention_ds: tuple[int, ...] = (8,)  # downsample factors with encoder/decoder attention
    time_dim: int = 64  # sinusoidal embedding width; the MLP widens it to 4 * base_channels
    max_period: float = 1000.0

    def __post_init__(self):
        for name in ("size", "mask_channels", "image_channels", "base_channels", "num_res_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "mask_channels" else 1):
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        mult = self.mult
        if self.size % 2 ** (len(mult) - 1):
            raise ValueError(f"size {self.size} must be divisible by {2 ** (len(mult) - 1)} for channel_mult {mult}")
        if self.base_channels % 32:
            raise ValueError(f"base_channels must be a multiple of 32 (GroupNorm groups), got {self.base_channels}")

    @property
    def mult(self) -> tuple[int, ...]:
        if self.channel_mult is not None:
            return tuple(self.channel_mult)
        return default_channel_mult(self.size)

    @property
    def in_channels(self) -> int:
        return self.image_channels + self.mask_channels


def default_channel_mult(size: int) -> tuple[int, ...]:
    """Channel multipliers the reference uses for each input size."""
    table = {256: (1, 1, 2, 2, 4, 4), 128: (1, 1, 2, 3, 4), 64: (1, 2, 3, 4)}
    if size in table:
        return table[size]
    # Small sizes (tests, smoke runs): keep the reference's shape with fewer levels.
    return (1, 2, 3, 4)[: max(2, min(4, int(math.log2(size)) - 2))]


# ----------------------------------------------------------------------------------------- helpers


def zero_init(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


class GroupNorm32(nn.GroupNorm):
    """GroupNorm whose statistics are computed in float32 whatever the activation dtype."""

    def forward(self, x):
        return F.group_norm(x.float(), self.num_groups, self.weight, self.bias, self.eps).to(x.dtype)


def norm(channels: int) -> nn.GroupNorm:
    return GroupNorm32(32, channels)


def timestep_embedding(t: torch.Tensor, dim: int, *, max_period: float) -> torch.Tensor:
    """(B,) timesteps -> (B, dim) sinusoidal features [cos | sin]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


# ------------------------------------------------------------------------------------------ blocks


class ResBlock(nn.Module):
    """GN-SiLU-Conv, add projected time embedding, GN-SiLU-Conv(zero); 1x1x1 skip if widths differ."""

    def __init__(self, ch_in: int, ch_out: int, *, emb_dim: int):
        super().__init__()
        self.in_layers = nn.Sequential(norm(ch_in), nn.SiLU(), nn.Conv3d(ch_in, ch_out, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, ch_out))
        self.out_layers = nn.Sequential(norm(ch_out), nn.SiLU(), zero_init(nn.Conv3d(ch_out, ch_out, 3, padding=1)))
        self.skip = nn.Identity() if ch_in == ch_out else nn.Conv3d(ch_in, ch_out, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        h = h + self.emb_layers(emb).to(h.dtype)[:, :, None, None, None]
        return self.skip(x) + self.out_layers(h)


class Attention(nn.Module):
    """Single-head self-attention over all D*H*W voxels, as 1x1 projections on (B, C, N)."""

    def __init__(self, ch: int, *, kind: str = "math", recompute: bool = True):
        super().__init__()
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind must be one of {ATTENTION_KINDS}, got {kind!r}")
        self.kind, self.recompute = kind, recompute
        self.norm = norm(ch)
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


UPSAMPLE_KINDS = ("interpolate", "separable")


def upsample2x_separable(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False), one axis at a time.

    Along an axis of length n: out[2i] = 0.75 x[i] + 0.25 x[i-1], out[2i+1] = 0.75 x[i] + 0.25 x[i+1],
    with the edges clamped. The same function, but its backward is slices and sums: Inductor lowers
    interpolate's backward to an atomic index_put, which took 16.6 ms of best's 93 ms step on the H200
    (data/nvidia-h200/NOTES.md). Eager it is slower than interpolate; it pays under torch.compile.
    """
    for dim in (2, 3, 4):
        n = x.shape[dim]
        prev = torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, n - 1)], dim)
        nxt = torch.cat([x.narrow(dim, 1, n - 1), x.narrow(dim, n - 1, 1)], dim)
        x = torch.stack([0.75 * x + 0.25 * prev, 0.75 * x + 0.25 * nxt], dim + 1).flatten(dim, dim + 1)
    return x


class Upsample(nn.Module):
    def __init__(self, ch: int, *, kind: str = "interpolate"):
        super().__init__()
        assert kind in UPSAMPLE_KINDS, f"upsample kind must be one of {UPSAMPLE_KINDS}, got {kind!r}"
        self.kind = kind
        self.conv = nn.Conv3d(ch, ch, 3, padding=1)

    def forward(self, x):
        if self.kind == "separable":
            fmt = torch.channels_last_3d if x.is_contiguous(memory_format=torch.channels_last_3d) else None
            x = upsample2x_separable(x)
            x = x.contiguous(memory_format=fmt) if fmt is not None else x
        else:
            x = F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False)
        return self.conv(x)


class Level(nn.Module):
    """A residual block, optionally followed by attention, then optionally a resampler."""

    def __init__(self, res: ResBlock, attn: Attention | None = None, resample: nn.Module | None = None):
        super().__init__()
        self.res, self.attn, self.resample = res, attn, resample

    def forward(self, x, emb):
        x = self.res(x, emb)
        if self.attn is not None:
            x = self.attn(x)
        if self.resample is not None:
            x = self.resample(x)
        return x


# ------------------------------------------------------------------------------------------- U-Net


class UNet3D(nn.Module):
    def __init__(self, spec: ModelSpec = ModelSpec(), *, attention: str = "math", recompute_attention: bool = True,
                 upsample: str = "interpolate"):
        super().__init__()
        self.spec = spec
        ch = spec.base_channels
        emb_dim = 4 * ch
        attn = lambda c: Attention(c, kind=attention, recompute=recompute_attention)  # noqa: E731

        self.time_embed = nn.Sequential(nn.Linear(spec.time_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.stem = nn.Conv3d(spec.in_channels, ch, 3, padding=1)

        self.down = nn.ModuleList()
        skips, ds = [ch], 1
        for level, mult in enumerate(spec.mult):
            for _ in range(spec.num_res_blocks):
                out = mult * spec.base_channels
                self.down.append(Level(ResBlock(ch, out, emb_dim=emb_dim), attn(out) if ds in spec.attention_ds else None))
                ch = out
                skips.append(ch)
            if level != len(spec.mult) - 1:
                self.down.append(_DownOnly(ch))
                skips.append(ch)
                ds *= 2

        self.middle = nn.ModuleList([ResBlock(ch, ch, emb_dim=emb_dim), attn(ch), ResBlock(ch, ch, emb_dim=emb_dim)])

        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(spec.mult))):
            for i in range(spec.num_res_blocks + 1):
                out = mult * spec.base_channels
                res = ResBlock(ch + skips.pop(), out, emb_dim=emb_dim)
                ch = out
                up = Upsample(ch, kind=upsample) if level and i == spec.num_res_blocks else None
                self.up.append(Level(res, attn(ch) if ds in spec.attention_ds else None, up))
            ds //= 2 if level else 1
        assert not skips, "every encoder activation must feed a decoder block"

        self.out = nn.Sequential(norm(ch), nn.SiLU(), zero_init(nn.Conv3d(ch, spec.image_channels, 3, padding=1)))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        assert x.ndim == 5 and x.shape[1] == spec.in_channels, (
            f"expected (B, {spec.in_channels}, D, H, W) input, got {tuple(x.shape)}"
        )
        assert t.shape == x.shape[:1], f"expected one timestep per sample, got t of shape {tuple(t.shape)}"
        emb = self.time_embed(timestep_embedding(t, spec.time_dim, max_period=spec.max_period))
        h = self.stem(x)
        hs = [h]
        for block in self.down:
            h = block(h, emb)
            hs.append(h)
        h = self.middle[0](h, emb)
        h = self.middle[1](h)
        h = self.middle[2](h, emb)
        for block in self.up:
            h = block(torch.cat([h, hs.pop()], dim=1), emb)
        return self.out(h)


class _DownOnly(nn.Module):
    """An encoder entry that only downsamples (its output is also a skip connection)."""

    def __init__(self, ch: int):
        super().__init__()
        self.resample = Downsample(ch)

    def forward(self, x, emb):
        return self.resample(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
