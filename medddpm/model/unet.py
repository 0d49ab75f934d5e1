"""The Med-DDPM 3D U-Net (Dorjsembe et al., IEEE JBHI 2024), written from its published description.

Shapes: the network takes ``x`` of shape (B, image_channels + mask_channels, D, H, W) (the noisy
image with the one-hot label map concatenated on the channel axis) and a timestep ``t`` of shape
(B,), and returns the predicted noise, (B, image_channels, D, H, W). Guided-diffusion layout: base
channels 64, multipliers (1, 1, 2, 3, 4) at 128^3, one residual block per level, self-attention at
downsample factor 8, GroupNorm(32) computed in float32, SiLU, zero-initialised output convolutions.
The input need not be cubic (the BraTS setting is 192 x 192 x 144).

Its building blocks are in `medddpm.model.blocks` and `medddpm.model.group_norm`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from medddpm.model.blocks import (Attention, Downsample, PaddedConv3d, ResBlock, TapConv3d, Upsample,
                                  timestep_embedding, zero_init)
from medddpm.model.group_norm import norm_silu


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_size(text: str | int | tuple) -> int | tuple[int, int, int]:
    """'128' -> 128; '192x192x144' -> (192, 192, 144); a cube in either form -> its side (one
    canonical form, so that equal shapes give equal specs). Raises ValueError in one line."""
    if isinstance(text, (int, tuple, list)) and not isinstance(text, bool):
        parts = [text] if isinstance(text, int) else list(text)
    else:
        parts = str(text).lower().replace("×", "x").split("x")
    try:
        sides = [p if isinstance(p, int) and not isinstance(p, bool) else int(str(p).strip()) for p in parts]
    except ValueError:
        raise ValueError(f"size must be N or DxHxW in voxels, got {text!r}") from None
    if len(sides) not in (1, 3) or not all(_positive_int(s) for s in sides):
        raise ValueError(f"size must be N or DxHxW with positive sides, got {text!r}")
    return sides[0] if len(set(sides)) == 1 else tuple(sides)


def format_size(size: int | tuple[int, int, int]) -> str:
    """128 -> '128'; (192, 192, 144) -> '192x192x144' (what `parse_size` reads back)."""
    return str(size) if isinstance(size, int) else "x".join(map(str, size))


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters; everything needed to rebuild the network."""

    size: int | tuple[int, int, int] = 128  # voxels per side of a cube, or (D, H, W); a cube is kept as an int
    mask_channels: int = 2
    image_channels: int = 1
    base_channels: int = 64
    channel_mult: tuple[int, ...] | None = None  # None: the reference's choice for the largest side
    num_res_blocks: int = 1
    attention_ds: tuple[int, ...] = (8,)  # downsample factors with encoder/decoder attention
    time_dim: int = 64  # sinusoidal embedding width; the MLP widens it to 4 * base_channels
    max_period: float = 1000.0

    def __post_init__(self):
        if not isinstance(self.size, (int, tuple, list)) or isinstance(self.size, bool):
            raise ValueError(f"ModelSpec.size must be an int or a (D, H, W) tuple, got {self.size!r}")
        object.__setattr__(self, "size", parse_size(self.size))
        for name in ("channel_mult", "attention_ds"):  # lists (from JSON or a checkpoint) -> tuples: hashable, comparable
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("mask_channels", "image_channels", "base_channels", "num_res_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "mask_channels" else 1):
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        mult = self.mult
        step = 2 ** (len(mult) - 1)  # every level but the last halves each axis
        bad = [n for n in self.shape if n % step]
        if bad:
            raise ValueError(f"input {format_size(self.size)}: every side must be divisible by {step} for "
                             f"channel_mult {mult} ({len(mult)} levels); {bad[0]} is not")
        if self.base_channels % 32:
            raise ValueError(f"base_channels must be a multiple of 32 (GroupNorm groups), got {self.base_channels}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(D, H, W) of one input volume."""
        return (self.size,) * 3 if isinstance(self.size, int) else tuple(self.size)

    @property
    def voxels(self) -> int:
        return math.prod(self.shape)

    @property
    def mult(self) -> tuple[int, ...]:
        if self.channel_mult is not None:
            return tuple(self.channel_mult)
        return default_channel_mult(max(self.shape))

    @property
    def in_channels(self) -> int:
        return self.image_channels + self.mask_channels

    def attention_tokens(self) -> list[int]:
        """Tokens of each attention block's sequence: encoder/decoder levels in `attention_ds`, then the middle."""
        deepest = 2 ** (len(self.mult) - 1)
        return [math.prod(n // ds for n in self.shape) for ds in (*self.attention_ds, deepest)]


def default_channel_mult(size: int) -> tuple[int, ...]:
    """Channel multipliers the reference uses for each input size."""
    table = {256: (1, 1, 2, 2, 4, 4), 128: (1, 1, 2, 3, 4), 64: (1, 2, 3, 4)}
    if size in table:
        return table[size]
    # Small sizes (tests, smoke runs): keep the reference's shape with fewer levels.
    return (1, 2, 3, 4)[: max(2, min(4, int(math.log2(size)) - 2))]


def _realized(x: torch.Tensor) -> torch.Tensor:
    """x through Inductor's realize barrier where a compiled graph computes it (`torch._inductor.test_operators`,
    whose lowering stores its input and copies nothing): a node no other equals, which AOTAutograd's
    common-subexpression pass cannot merge with another (`UNet3D._decode`). Eager: x itself."""
    if not torch.compiler.is_compiling():
        return x
    from torch._inductor.test_operators import realize  # registers the op; its backward passes the gradient on

    return realize(x)


@torch.library.custom_op("medddpm::stored_copy", mutates_args=())
def stored_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of x, through an operator Inductor cannot fuse into: what computes x is written out, in x's dtype."""
    return x.clone()


@stored_copy.register_fake
def _(x):
    return torch.empty_like(x)


class _StoreGradient(torch.autograd.Function):
    """The identity, whose backward writes the incoming gradient out as it arrives (`store_skip_grad`).

    A compiled backward computes a decoder block's input gradient in float32 (the GroupNorm's) and casts and
    slices it where each slice is read; the skip connection's slice is read by the encoder block that made
    the skip, at the end of the backward, so the whole float32 gradient is held until then: at the top level
    of the 128^3 model, 128 channels x 128^3 voxels x 4 bytes, 1 GiB, at a checkpointed step's peak. Stored
    here, the slice is written in bf16 right away and the float32 gradient is freed (the memory page's
    `best-ckpt+store_skip_grad=false` row measures the peak it lowers)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return stored_copy(dy)


class Level(nn.Module):
    """A residual block, optionally followed by attention, then optionally a resampler."""

    def __init__(self, res: ResBlock, attn: Attention | None = None, resample: nn.Module | None = None):
        super().__init__()
        self.res, self.attn, self.resample = res, attn, resample

    def forward(self, x, emb, *, resample: bool = True):
        """`resample=False`: the resampler is left to the caller (`UNet3D._narrowed`)."""
        x = self.res(x, emb)
        if self.attn is not None:
            x = self.attn(x)
        if self.resample is not None and resample:
            x = self.resample(x)
        return x


# ------------------------------------------------------------------------------------------- U-Net


class UNet3D(nn.Module):
    """The U-Net (`forward`): a stem convolution; an encoder, each of whose outputs is also kept as a skip
    connection; a middle of a residual block, attention and a residual block; a decoder, each block of which
    takes its level's skip concatenated on the channel axis; an output GroupNorm, SiLU and convolution.

    Memory levers, each a part of its own beside the forward:
    `checkpointing=True`: activation checkpointing per U-Net block (`_checkpoint`); it subsumes
    `recompute_attention`, whose inner checkpoint would only recompute attention a second time.
    `store_skip_grad=True`: each skip connection's gradient is written out as soon as a decoder block has
    computed it (`_decode`, _StoreGradient).
    `narrow_checkpoints=True` (with `checkpointing`): the stem and each decoder level's upsampling run inside the
    checkpoints of the blocks that read their outputs, so that the checkpoints keep the narrow tensors before
    them (`_narrowed`).
    `tap_gemm=True`: the output convolution as a GEMM and a sum of its 27 shifted taps (TapConv3d); with
    `tap_major=True` the shares tap-major over a zero-haloed input."""

    def __init__(self, spec: ModelSpec = ModelSpec(), *, attention: str = "math", recompute_attention: bool = True,
                 upsample: str = "interpolate", checkpointing: bool = False, group_norm: str = "aten",
                 pad_channels: bool = False, tap_gemm: bool = False, tap_major: bool = False,
                 store_skip_grad: bool = False, narrow_checkpoints: bool = False):
        super().__init__()
        assert spec.num_res_blocks >= 1, "each level needs a residual block (the stem's output is its input)"
        self.spec = spec
        self.checkpointing, self.store_skip_grad = checkpointing, store_skip_grad
        self.narrow_checkpoints = narrow_checkpoints
        ch = spec.base_channels
        emb_dim = 4 * ch
        attn = lambda c: Attention(c, kind=attention, recompute=recompute_attention and not checkpointing,  # noqa: E731
                                   norm_kind=group_norm)
        res = lambda c_in, c_out: ResBlock(c_in, c_out, emb_dim=emb_dim, norm_kind=group_norm)  # noqa: E731

        self.time_embed = nn.Sequential(nn.Linear(spec.time_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        narrow = PaddedConv3d if pad_channels else nn.Conv3d  # the U-Net's two narrow convolutions
        self.stem = narrow(spec.in_channels, ch, 3, padding=1)

        self.down = nn.ModuleList()
        skips, ds = [ch], 1
        for level, mult in enumerate(spec.mult):
            for _ in range(spec.num_res_blocks):
                out = mult * spec.base_channels
                self.down.append(Level(res(ch, out), attn(out) if ds in spec.attention_ds else None))
                ch = out
                skips.append(ch)
            if level != len(spec.mult) - 1:
                self.down.append(_DownOnly(ch))
                skips.append(ch)
                ds *= 2

        self.middle = nn.ModuleList([res(ch, ch), attn(ch), res(ch, ch)])

        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(spec.mult))):
            for i in range(spec.num_res_blocks + 1):
                out = mult * spec.base_channels
                block = res(ch + skips.pop(), out)
                ch = out
                up = Upsample(ch, kind=upsample) if level and i == spec.num_res_blocks else None
                self.up.append(Level(block, attn(ch) if ds in spec.attention_ds else None, up))
            ds //= 2 if level else 1
        assert not skips, "every encoder activation must feed a decoder block"

        out = (functools.partial(TapConv3d, tap_major=tap_major) if tap_gemm else narrow)
        self.out = nn.Sequential(*norm_silu(ch, kind=group_norm), zero_init(out(ch, spec.image_channels, 3, padding=1)))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        assert x.ndim == 5 and x.shape[1] == spec.in_channels, (
            f"expected (B, {spec.in_channels}, D, H, W) input, got {tuple(x.shape)}"
        )
        assert t.shape == x.shape[:1], f"expected one timestep per sample, got t of shape {tuple(t.shape)}"
        emb = self._embed_time(t)
        stem, encoder, decoder = self._layers()
        h = stem(x)
        hs = [h]
        for block in encoder:
            h = block(h, emb)
            hs.append(h)
        h = self._checkpoint(self.middle[0], h, emb)
        h = self._checkpoint(self.middle[1], h)
        h = self._checkpoint(self.middle[2], h, emb)
        for block in decoder:
            h = block(h, hs.pop(), emb)
        return self._checkpoint(self.out, h)

    def _embed_time(self, t: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(t, self.spec.time_dim, max_period=self.spec.max_period)
        # in the weights' dtype: a float64 model (tests) takes it too; autocast casts as it does anyway
        return self.time_embed(emb.to(self.time_embed[0].weight.dtype))

    def _layers(self) -> tuple:
        """The forward's stem, encoder blocks and decoder blocks (`_decode`), as it calls them: every block
        under `_checkpoint` but the downsample-only ones, which save just their input, kept anyway as a skip.
        Rearranged by `_narrowed` where `narrow_checkpoints` applies."""
        encoder = [block if isinstance(block, _DownOnly) else self._checkpointed(block) for block in self.down]
        if self.narrow_checkpoints and self._checkpointing():
            return self._narrowed(encoder)
        return self.stem, encoder, [self._checkpointed(functools.partial(self._decode, block)) for block in self.up]

    def _narrowed(self, encoder: list) -> tuple:
        """`narrow_checkpoints`: the layers that widen a tensor run inside the checkpoints of the blocks that
        read their outputs, so that those checkpoints keep the narrow input. The stem's output (base channels at
        full size, a skip kept from the first encoder block to the last decoder block) is made from x inside
        the first encoder block's checkpoint and the last decoder block's; a decoder level's upsampling runs in
        the next block's checkpoint, which keeps its input (8x fewer voxels). The cost: the stem runs 4 times
        instead of once, and each upsampling's convolution once more (plain, a recomputation stops before it,
        the last layer of its block: checkpoint's early stop)."""
        encoder[0] = self._checkpointed(functools.partial(_after, self.down[0], before=self.stem))
        decoder, upsample = [], None
        for i, block in enumerate(self.up):
            skip_stem = self.stem if i == len(self.up) - 1 else None  # the last decoder block's skip is x
            decoder.append(self._checkpointed(functools.partial(self._decode, block, upsample=upsample,
                                                                skip_stem=skip_stem, resample=False)))
            upsample = block.resample  # left to the next block's checkpoint
        assert upsample is None, "the top decoder level has no upsampling"
        return _identity, encoder, decoder

    def _decode(self, block: Level, h, skip, emb, *, upsample: nn.Module | None = None,
                skip_stem: nn.Module | None = None, resample: bool = True):
        """A decoder block: the skip connection concatenated to h on the channel axis, then the block. Inside
        its checkpoint the concatenation, at the top level the largest tensor, is recomputed rather than kept.
        `store_skip_grad`: the skip's gradient is written out as soon as it is computed (_StoreGradient).
        `upsample`, `skip_stem`, `resample=False`: the layers `_narrowed` moves into this block."""
        h = upsample(h) if upsample is not None else h
        if skip_stem is not None:
            # Through Inductor's realize (stores its input, copies nothing): AOTAutograd's CSE, blind to checkpoint
            # regions, would merge this stem with the first encoder checkpoint's (the same ops on the same x; a
            # clone is removed before CSE runs), and a node two regions share is saved for the backward: the stem's
            # output, 0.25 GiB at 128^3, live through the whole backward. A skip made here sends its gradient
            # straight into the stem: nothing to store.
            skip = skip_stem(_realized(skip))
        elif self.store_skip_grad and torch.is_grad_enabled():
            skip = _StoreGradient.apply(skip)
        return block(torch.cat([h, skip], dim=1), emb, resample=resample)

    def _checkpointing(self) -> bool:
        """Whether blocks run under activation checkpointing: it is on and a backward will follow."""
        return self.checkpointing and torch.is_grad_enabled()

    def _checkpointed(self, fn):
        """fn, called through `_checkpoint`."""
        return functools.partial(self._checkpoint, fn)

    def _checkpoint(self, fn, *args):
        """fn(*args), under activation checkpointing where `_checkpointing`.

        Only the block's inputs are kept for backward; its inside is recomputed then. No block draws
        random numbers (dropout is 0), so the RNG state need not be saved and restored: skipping it
        keeps the step capturable in a CUDA graph and saves a device-state copy per block."""
        if self._checkpointing():
            # Plain checkpointing, also under torch.compile. A recompute-everything selective policy (which makes torch
            # 2.11 recompute the fused GroupNorm's autograd.Function too, pytorch/pytorch#177396) is both slower and
            # higher in memory: it recomputes what plain checkpointing keeps
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)


def _identity(x):
    return x


def _after(block: nn.Module, x, *args, before: nn.Module):
    """block(before(x), *args): two layers as one checkpointed function."""
    return block(before(x), *args)


class _DownOnly(nn.Module):
    """An encoder entry that only downsamples (its output is also a skip connection)."""

    def __init__(self, ch: int):
        super().__init__()
        self.resample = Downsample(ch)

    def forward(self, x, emb):
        return self.resample(x)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
