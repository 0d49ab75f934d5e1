"""The command line's shared arguments and their parsers: used by `medddpm.cli.parser` and by the
data-parallel training entry point (`medddpm.cli.distributed`), which takes the same model and configuration switches."""

from __future__ import annotations

import argparse
import dataclasses

from medddpm.configs import Config, get_config, switch_kind, switches
from medddpm.presets import PRESETS, get_preset
from medddpm.model.unet import ModelSpec, parse_size
from medddpm.store.schema import PHASES

PRESET_NAMES = tuple(PRESETS)


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


MAX_SEED = 2**32 - 1  # NumPy's seeds end there; the seeds derived from it (`loop.batch_indices`) stay in 63 bits


def seed_arg(text: str) -> int:
    """A seed: an integer from 0 to MAX_SEED (a negative or larger one overflows the generators it seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed from 0 to {MAX_SEED}, got {text!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer seed from 0 to {MAX_SEED}, got {value}")
    return value


def add_force_memory(p, what: str = "the step's") -> None:
    p.add_argument("--force-memory", action="store_true",
                   help=f"start even where {what} estimated memory exceeds the device's (refused without it)")


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


def add_config_args(p: argparse.ArgumentParser, config_class: type = Config) -> None:
    """--config, and one expert flag per switch of `config_class` (`configs.switches`: name, help and values)."""
    p.add_argument("--config", default="baseline", metavar="NAME",
                   help="a named configuration (python -m medddpm configs lists them), or NAME+switch=value")
    # One switch each, apart from the common options: the named configurations already set them together.
    g = p.add_argument_group("expert: one switch of --config at a time",
                             "each sets one switch of the configuration (configs --wide shows them all)")
    for f in switches(config_class):
        kind, flag = switch_kind(f, config_class), "--" + f.name.replace("_", "-")
        if kind is bool:
            g.add_argument(flag, type=bool_arg, metavar="BOOL", help=f.metadata["help"])
        else:
            g.add_argument(flag, choices=kind, help=f.metadata["help"])
    p.set_defaults(config_class=config_class)


def config_from(args):
    """--config with the switches given alone applied over it."""
    cls = getattr(args, "config_class", Config)
    base = get_config(args.config)
    if not isinstance(base, cls):  # a configuration class with more switches: the named one, those at their defaults
        base = cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    return base.with_flags(**{f.name: getattr(args, f.name) for f in switches(cls)
                              if getattr(args, f.name, None) is not None})


def preset_from(args):
    """The preset named by --preset, with --size / --base-channels applied; None without --preset."""
    if not args.preset:
        return None
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
        if values[0] > 1000:  # a count: a list of that many seeds is made
            raise argparse.ArgumentTypeError(f"a count of at most 1000 seeds, got {values[0]}")
        values = list(range(values[0]))
    if not values or min(values) < 0 or max(values) > MAX_SEED or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected a positive count or distinct non-negative seeds, got {text!r}")
    return values
