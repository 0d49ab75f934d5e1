"""The command line's shared arguments and their parsers: used by `medddpm.cli.parser` and by the
data-parallel worker (`medddpm.measure.distributed`), which takes the same model and configuration switches."""

from __future__ import annotations

import argparse
import dataclasses
from typing import get_args

from medddpm.configs import (AttentionKind, GroupNormKind, Precision, UpsampleKind, get_config)
from medddpm.model.unet import ModelSpec, parse_size
from medddpm.store.schema import PHASES

PRESET_NAMES = ("smoke", "paper", "brats")  # measure.PRESETS, without importing the measurement stack


def phases_arg(text: str) -> str:
    unknown = {p.strip() for p in text.split(",") if p.strip()} - set(PHASES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(PHASES)}")
    return ",".join(p.strip() for p in text.split(",") if p.strip())


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def size_arg(text: str) -> int | tuple[int, int, int]:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or DxHxW in voxels (e.g. 128 or 192x192x144), got {text!r}") from None


def bool_arg(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {value:g}")
    return value


WIDTH = 100  # terminal columns that help and the plain listings fit
MASK_CHANNELS = 3  # the whole-head model's label channels: the embedded data's CSF, grey and white matter
DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda if present, else cpu)"


def add_device_arg(p) -> None:
    p.add_argument("--device", metavar="DEV", help=DEVICE_HELP)


def add_model_args(p: argparse.ArgumentParser, *, mask_default: int | None = MASK_CHANNELS) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=PRESET_NAMES, help="the model of a measurement preset (brats: the BraTS "
                                                          "setting); --size and --base-channels override it")
    g.add_argument("--size", type=size_arg, metavar="N|DxHxW", help="input size in voxels: N for a cube or DxHxW (default 128)")
    g.add_argument("--mask-channels", type=positive, default=None, metavar="N",
                   help="label channels, background not counted " + (
                       f"(default {mask_default}: CSF, grey and white matter; 2 is the reference's whole-head width)"
                       if mask_default else "(default: the data's label classes)"))
    g.add_argument("--base-channels", type=positive, metavar="N", help="channels of the U-Net's first level (default 64)")
    p.set_defaults(mask_default=mask_default)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="baseline", metavar="NAME",
                   help="a named configuration (python -m medddpm configs lists them), or NAME+switch=value")
    # One switch each, apart from the common options: the named configurations already set them together.
    g = p.add_argument_group("expert: one switch of --config at a time",
                             "each sets one switch of the configuration (configs --wide shows them all)")
    g.add_argument("--precision", choices=get_args(Precision), help="arithmetic of convolutions and matmuls")
    g.add_argument("--channels-last", type=bool_arg, metavar="BOOL", help="channels-last 3D layout")
    g.add_argument("--compile", type=bool_arg, metavar="BOOL", help="torch.compile the training step")
    g.add_argument("--cuda-graphs", type=bool_arg, metavar="BOOL", help="replay the step as one CUDA graph")
    g.add_argument("--fused-adam", type=bool_arg, metavar="BOOL", help="Adam as one fused kernel")
    g.add_argument("--recompute-attention", type=bool_arg, metavar="BOOL",
                   help="recompute attention in the backward, not store it")
    g.add_argument("--attention", choices=get_args(AttentionKind), help="attention kernel")
    g.add_argument("--upsample", choices=get_args(UpsampleKind), help="how the decoder upsamples")
    g.add_argument("--group-norm", choices=get_args(GroupNormKind),
                   help="GroupNorm kernel: chunked statistics, or those fused with the SiLU after it")
    g.add_argument("--pad-channels", type=bool_arg, metavar="BOOL",
                   help="narrow stem and output convolutions padded to 8 channels")
    g.add_argument("--tap-gemm", type=bool_arg, metavar="BOOL", help="the output convolution as a GEMM of 27 taps")
    g.add_argument("--recompute-pointwise", type=bool_arg, metavar="BOOL",
                   help="compiled: recompute reused pointwise results, not store them")
    g.add_argument("--checkpointing", type=bool_arg, metavar="BOOL", help="activation checkpointing per U-Net block")
    g.add_argument("--store-skip-grad", type=bool_arg, metavar="BOOL",
                   help="write each skip gradient out as soon as it is computed")
    g.add_argument("--narrow-checkpoints", type=bool_arg, metavar="BOOL",
                   help="with checkpointing: recompute stem and upsamplings in later checkpoints")
    g.add_argument("--pin-layout", type=bool_arg, metavar="BOOL",
                   help="compiled: pin channels-last 3D at every convolution input")


OVERRIDES = ("precision", "channels_last", "compile", "cuda_graphs", "fused_adam", "recompute_attention", "attention",
              "upsample", "checkpointing", "pin_layout", "group_norm", "pad_channels", "recompute_pointwise",
              "tap_gemm", "store_skip_grad", "narrow_checkpoints")


def config_from(args):
    base = get_config(args.config)
    return base.with_flags(**{k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None})


def preset_from(args):
    """The preset named by --preset, with --size / --base-channels applied; None without --preset."""
    if not args.preset:
        return None
    from medddpm.measure.run import get_preset

    preset = get_preset(args.preset)
    changes = {k: getattr(args, k) for k in ("size", "base_channels") if getattr(args, k) is not None}
    return dataclasses.replace(preset, **changes)


def spec_from(args, mask_channels: int | None = None, image_channels: int | None = None) -> ModelSpec:
    """The model from --preset or the model flags; `mask_channels` / `image_channels` from the data."""
    mask = args.mask_channels or mask_channels
    preset = preset_from(args)
    if preset is not None:
        return preset.spec(mask_channels=mask, image_channels=image_channels)
    return ModelSpec(size=args.size or 128, mask_channels=mask or args.mask_default, image_channels=image_channels or 1,
                     base_channels=args.base_channels or 64)


def open_data(args):
    """--data, else the preset's embedded data, at the preset's (or --size's) input size."""
    from medddpm.train.data import open_dataset

    preset = preset_from(args)
    # an empty --data is a mistake (an unset shell variable), never the embedded data: open_dataset refuses it
    source = args.data if args.data is not None else (preset.data if preset else "mni")
    return open_dataset(source, size=preset.size if preset else args.size or 128, n=args.pairs, seed=args.seed,
                        mask_channels=args.mask_channels, resample_mask=getattr(args, "resample_mask", False))


def seeds_arg(text: str) -> list[int]:
    """'3': seeds 0, 1, 2; '0,4,7': those seeds."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count (3) or a list of seeds (0,4,7), got {text!r}") from None
    if len(values) == 1 and "," not in text:
        values = list(range(values[0]))
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected a positive count or distinct non-negative seeds, got {text!r}")
    return values
