"""Optimization configurations: each is data (a frozen dataclass), never a copy of the training loop.

The paper's four (Ryoo et al. 2026) are `baseline` (strict FP32), `opt1` (TF32 tensor cores),
`opt2` (channels-last 3D) and `opt12` (both). The rest go past the paper. Every switch can also
be set on its own (`Config.with_flags`, or the CLI's flags), so any combination is a configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints

import torch

from medddpm.errors import UserError
from medddpm.model.group_norm import triton_unavailable

Precision = Literal["fp32", "tf32", "bf16", "fp16"]
AttentionKind = Literal["math", "sdpa"]
UpsampleKind = Literal["interpolate", "separable", "separable_ndhwc"]
GroupNormKind = Literal["aten", "chunked", "fused", "triton"]


class ConfigError(UserError):
    """An unknown configuration or a flag of the wrong type or value (one line)."""


def switch(default, help: str, column: str | None = None):
    """A switch of a configuration, declared once. Its default is also what result rows written before the switch
    existed ran with; `help` is its command-line flag's (`--name-with-hyphens`), `column` its run-table column's
    description (the help where not given). `switches` lists them; the command line (`medddpm.cli.args`) and the
    run table's schema (`medddpm.store.schema`) are derived from them."""
    return field(default=default, metadata={"help": help, "column": column or help})


@dataclass(frozen=True)
class Config:
    name: str
    # fp32 = strict IEEE (TF32 off and verified off); bf16 and fp16 = autocast, fp16 with a dynamic loss scale
    precision: Precision = switch("fp32", "arithmetic of convolutions and matmuls",
                                  "fp32 | tf32 | bf16 | fp16 as requested")
    channels_last: bool = switch(False, "channels-last 3D layout")  # NDHWC for the model and its inputs
    compile: bool = switch(False, "torch.compile the training step", "torch.compile fusion")
    cuda_graphs: bool = switch(False, "replay the step as one CUDA graph", "whole-step CUDA graph (as requested)")
    fused_adam: bool = switch(False, "Adam as one fused kernel", "fused Adam kernel")
    attention: AttentionKind = switch("math", "attention kernel", "math | sdpa")  # sdpa: flash / mem-efficient
    recompute_attention: bool = switch(True, "recompute attention in the backward, not store it",
                                       "attention recomputed in backward")  # the reference checkpoints it
    # "separable": the same trilinear 2x as per-axis sums (no atomics in backward); "separable_ndhwc": those
    # sums on the (N, D, H, W, C) view of channels-last activations, so that compiled buffers stay channels-last
    upsample: UpsampleKind = switch("interpolate", "how the decoder upsamples",
                                    "interpolate | separable (trilinear 2x as per-axis sums) | separable_ndhwc (those "
                                    "sums on the channels-last view)")
    checkpointing: bool = switch(False, "activation checkpointing per U-Net block")  # keep block inputs only
    pin_layout: bool = switch(False, "compiled: pin channels-last 3D at every convolution input",
                              "channels-last 3D pinned at every convolution input of compiled graphs (as requested)")
    # "chunked": statistics per channel over voxel chunks, then per group; "fused": those statistics, the SiLU
    # after the norm in the same function, and a hand-written backward (model._GroupNormSiLU); "triton": the norm,
    # the SiLU and the timestep features added before them as Triton kernels (model.group_norm_triton)
    group_norm: GroupNormKind = switch("aten", "GroupNorm kernel: chunked statistics, or those fused with the SiLU "
                                               "after it, or Triton kernels",
                                       "aten | chunked (GroupNorm statistics per channel over voxel chunks, then per "
                                       "group) | fused (chunked statistics, the SiLU after it and a hand-written "
                                       "backward in one function) | triton (GroupNorm-SiLU forward and backward as "
                                       "Triton kernels with split reductions)")
    pad_channels: bool = switch(False, "narrow stem and output convolutions padded to 8 channels",
                                "stem and output convolutions zero-padded to 8 channels")  # model.PaddedConv3d
    # the output convolution as a GEMM and a sum of its 27 shifted taps, not cuDNN (model.TapConv3d)
    tap_gemm: bool = switch(False, "the output convolution as a GEMM of 27 taps",
                            "the output convolution as a GEMM and a sum of its 27 shifted taps, not cuDNN")
    # each skip connection's gradient written out (bf16 under autocast) as soon as its decoder block has computed
    # it, through an operator Inductor cannot fuse into (model._StoreGradient); otherwise compiled backward graphs
    # hold the top decoder blocks' whole float32 input gradient until the encoder reads the skip's slice
    store_skip_grad: bool = switch(False, "write each skip gradient out as soon as it is computed",
                                   "each skip connection's gradient written out as soon as its decoder block "
                                   "computed it")
    # with checkpointing: the stem and each decoder level's upsampling run inside the checkpoints of the blocks that
    # read their outputs, so that the checkpoints keep the narrow tensors before them (the stem's 4-8 input channels,
    # the upsampling's 8x fewer voxels), not two full-size 64-channel tensors through the whole backward. Under torch
    # 2.11 Inductor's stride check stops its backward (pytorch/pytorch#174869) unless medddpm.model.layout's pass
    # writes the recomputed views out
    narrow_checkpoints: bool = switch(False, "with checkpointing: recompute stem and upsamplings in later checkpoints",
                                      "the stem and each decoder upsampling recomputed inside the checkpoints of the "
                                      "blocks after them, which keep the narrow tensors before them")
    # compiled graphs: a reused pointwise result (a GroupNorm-SiLU chain in backward) is recomputed in each
    # kernel that reads it instead of being written out in float32 (Inductor's realize thresholds raised)
    recompute_pointwise: bool = switch(False, "compiled: recompute reused pointwise results, not store them",
                                       "compiled training graphs recompute a reused pointwise result in each kernel "
                                       "that reads it, not store it (as requested)")
    # with tap_gemm: the GEMM writes the 27 taps' shares tap-major over the input with a zero halo, so that the sum
    # shifts each tap's shares as one contiguous slice (no mask, no pad) and its backward's rows are contiguous too
    tap_major: bool = switch(False, "tap_gemm: the taps' shares tap-major over a zero-haloed input",
                             "the output convolution's tap shares written tap-major over its input with a zero "
                             "halo, summed as contiguous shifted slices (with tap_gemm)")
    # compiled graphs: each forward convolution autotuned between cuDNN and Inductor's Triton templates, which can
    # also take the bias and the pointwise work after it as an epilogue (Inductor's max_autotune for convolutions)
    conv_autotune: bool = switch(False, "compiled: autotune forward convolutions between cuDNN and Triton templates",
                                 "compiled graphs choose each forward convolution among cuDNN and Inductor's "
                                 "Triton templates by timing them (as requested)")
    description: str = field(default="", compare=False)

    def __post_init__(self):
        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            if hint is bool and not isinstance(value, bool):
                raise ConfigError(f"config flag {f.name} must be a bool, got {value!r}")
            if hint is str and not isinstance(value, str):
                raise ConfigError(f"config field {f.name} must be a str, got {value!r}")
            if get_args(hint) and value not in get_args(hint):
                raise ConfigError(f"config flag {f.name} must be one of {get_args(hint)}, got {value!r}")

    @property
    def flags(self) -> dict:
        """The switches alone (what a result row records)."""
        return {f.name: getattr(self, f.name) for f in switches(type(self))}

    def with_flags(self, name: str | None = None, **flags) -> "Config":
        unknown = set(flags) - set(self.flags)
        if unknown:
            raise ConfigError(f"unknown config flag(s) {sorted(unknown)}; known: {sorted(self.flags)}")
        changed = {k: v for k, v in flags.items() if getattr(self, k) != v}
        if not changed:
            return self
        label = name or variant_name(self.name, **changed)
        return dataclasses.replace(self, name=label, description=f"{self.name} with {changed}", **changed)


_fast = dict(precision="bf16", channels_last=True, fused_adam=True, attention="sdpa", recompute_attention=False)
# best's levers past `compile`, each kept for its measured gain: the ablation (`python -m medddpm ablation`, the book's
# "what each lever buys") times best without each of them
_best = dict(_fast, compile=True, cuda_graphs=True, upsample="separable_ndhwc", pin_layout=True, group_norm="fused",
             pad_channels=True, recompute_pointwise=True, tap_gemm=True)

CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("baseline", description="Strict FP32: cuDNN and matmul TF32 both off (the paper's Baseline)"),
    Config("opt1", precision="tf32", description="TF32 tensor cores for convolutions and matmuls (paper OPT1)"),
    Config("opt2", channels_last=True, description="Channels-last 3D memory layout, FP32 (paper OPT2)"),
    Config("opt12", precision="tf32", channels_last=True, description="TF32 + channels-last 3D (paper OPT12)"),
    Config("bf16", precision="bf16", description="bf16 autocast; GroupNorm statistics and loss in FP32"),
    Config("bf16-cl", precision="bf16", channels_last=True, description="bf16 autocast + channels-last 3D"),
    Config("sdpa", precision="bf16", channels_last=True, fused_adam=True, attention="sdpa",
           recompute_attention=False, description="bf16 + channels-last + fused Adam + SDPA attention, no recompute"),
    Config("compile", **_fast, compile=True, description="The sdpa configuration fused by torch.compile (Inductor)"),
    Config("graphs", **_fast, cuda_graphs=True, description="The sdpa configuration with the whole step in a CUDA graph"),
    Config("best", **_best, description="Fastest combination: bf16, channels-last, SDPA, fused Adam, torch.compile "
                                        "with channels-last pinned at the convolutions, CUDA graph, separable channels-last "
                                        "upsampling, GroupNorm-SiLU with chunked statistics and a hand-written "
                                        "backward, stem and output convolutions padded to 8 channels, "
                                        "pointwise chains recomputed in each kernel that reads them, the "
                                        "output convolution as a GEMM and a sum of its shifted taps"),
    # Memory: the same step with activation checkpointing, so its cost is measured against its twin.
    Config("opt1-ckpt", precision="tf32", checkpointing=True,
           description="opt1 with activation checkpointing per U-Net block (less memory, one more forward)"),
    # Its GroupNorm stays "chunked": the fused one's saved statistics and recomputed inputs raise the checkpointed
    # peak. store_skip_grad and narrow_checkpoints lower its backward's peaks; no CUDA graph: with checkpointing the
    # step is long enough that launches are hidden, and the graph's pool holds memory the checkpoints saved (the
    # memory page's switch costs measure each)
    Config("best-ckpt", **dict(_best, group_norm="chunked", cuda_graphs=False), checkpointing=True,
           store_skip_grad=True, narrow_checkpoints=True,
           description="best with activation checkpointing per U-Net block (less memory, one more forward), no CUDA graph, "
                       "skip gradients written out as computed, the stem and upsamplings recomputed inside the "
                       "checkpoints that read them"),
    # The tensor-core path of GPUs without bf16 or TF32 (V100, Turing): fp16's 5 exponent bits overflow where
    # bf16's 8 do not, so gradients go through a dynamic loss scale (torch.amp.GradScaler) that skips a step whose
    # gradients hold an inf or NaN and halves the scale. With foreach Adam the scaler reads its overflow flag on the
    # host once a step (GradScaler's recipe); fused Adam takes the flag on the device.
    Config("fp16", precision="fp16", description="fp16 autocast with a dynamic loss scale (GradScaler); GroupNorm "
                                                 "statistics and loss in FP32"),
    Config("fp16-best", **dict(_best, precision="fp16"),
           description="best in fp16 with a dynamic loss scale instead of bf16: the fastest combination on GPUs "
                       "without bf16"),
]}

PAPER = ("baseline", "opt1", "opt2", "opt12")



def switches(cls: type = Config) -> list[dataclasses.Field]:
    """The switches of a configuration class, in declaration order: every field but its name and description."""
    return [f for f in dataclasses.fields(cls) if f.name not in ("name", "description")]


def switch_kind(f: dataclasses.Field, cls: type = Config) -> type | tuple:
    """bool for an on/off switch, else the tuple of the values a choice switch takes."""
    hint = get_type_hints(cls)[f.name]
    return bool if hint is bool else get_args(hint)

def get_config(name: str | Config) -> Config:
    if isinstance(name, Config):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"configuration name must be a str, got {type(name).__name__}")
    base, *changes = name.split("+")
    if base not in CONFIGS:
        raise ConfigError(f"unknown configuration {base!r}; known: {', '.join(CONFIGS)}")
    if not changes:
        return CONFIGS[base]
    # 'best+channels_last=false+attention=math': a named configuration with switches changed
    flags = {}
    for change in changes:
        key, eq, value = change.partition("=")
        if not eq or not key:
            raise ConfigError(f"bad switch {change!r} in {name!r}; expected FLAG=VALUE")
        if key in flags:  # the last value would win unseen, and the name would say two things
            raise ConfigError(f"switch {key} is set twice in {name!r}; set each switch once")
        flags[key] = {"true": True, "false": False}.get(value.lower(), value)
    return CONFIGS[base].with_flags(name=name, **flags)


def mismatch(row) -> dict:
    """The switches in which a recorded run (a run.parquet row, or a dict) differs from its configuration's
    definition today, as {switch: (recorded, defined)}; {} when it matches. A name never changes meaning, so a
    committed row always matches; an unknown name raises ConfigError."""
    return {k: (row[k], v) for k, v in get_config(row["config"]).flags.items() if k in row and row[k] != v}


# A lever's value without it, where that is not the switch's default: bf16 is measured against TF32 (the
# fastest FP32 path of a tensor-core GPU, the paper's OPT1), not against strict FP32; TF32 against strict FP32.
_WITHOUT = {"precision": "tf32"}


def variant_name(base: str, **flags) -> str:
    """'best+tap_gemm=false': the name `get_config` reads back as `base` with these switches."""
    return base + "".join(f"+{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(flags.items()))


def ablation(base: str = "best") -> list[Config]:
    """`base`, then `base` without each of its levers (every switch it sets away from `Config`'s default, set
    back; bf16 back to TF32), each named for its one change (`best+tap_gemm=false`): what each lever buys."""
    cfg = get_config(base)
    default = Config(cfg.name).flags
    levers = [k for k, v in cfg.flags.items() if v != default[k]]
    variants = [{k: _WITHOUT[k] if k in _WITHOUT and cfg.flags[k] != _WITHOUT[k] else default[k]} for k in levers]
    return [cfg] + [get_config(variant_name(cfg.name, **v)) for v in variants]


def parse_config_list(spec: str) -> list[Config]:
    """'paper', 'all' or a comma-separated list of names; every name is checked before any work."""
    if spec == "paper":
        return [CONFIGS[n] for n in PAPER]
    if spec == "all":
        return list(CONFIGS.values())
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ConfigError("empty configuration list")
    return [get_config(n) for n in names]


# ------------------------------------------------------------------------------ device resolution


@dataclass(frozen=True)
class Resolved:
    """A configuration as it will run on one device: the switches in force and those that cannot be."""

    config: Config
    device: torch.device
    precision: str
    channels_last: bool
    compile: bool
    cuda_graphs: bool
    fused_adam: bool
    pin_layout: bool
    recompute_pointwise: bool
    group_norm: str
    not_applicable: dict[str, str]  # flag -> why it is off on this device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def loss_scaling(self) -> bool:
        """fp16 gradients underflow without a loss scale (and overflow with too large a one)."""
        return self.precision == "fp16"

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last_3d if self.channels_last else torch.contiguous_format


def resolve(config: Config, device: torch.device | str) -> Resolved:
    """Decide what runs where; GPU-only switches on a CPU are recorded as not applicable."""
    device = torch.device(device)
    na: dict[str, str] = {}
    precision, graphs = config.precision, config.cuda_graphs
    if device.type != "cuda":
        if precision == "tf32":
            na["precision"] = "TF32 is a tensor-core mode of NVIDIA GPUs; ran as strict fp32"
            precision = "fp32"
        if graphs:
            na["cuda_graphs"] = "CUDA graphs need a CUDA device; ran eagerly"
            graphs = False
    pin = config.pin_layout and config.compile and config.channels_last
    if config.pin_layout and not pin:
        na["pin_layout"] = "pins channels-last in compiled graphs: needs compile and channels_last"
    recompute = config.recompute_pointwise and config.compile
    if config.recompute_pointwise and not recompute:
        na["recompute_pointwise"] = "an Inductor fusion choice: needs compile"
    if config.tap_major and not config.tap_gemm:
        na["tap_major"] = "lays out the output convolution's tap shares: needs tap_gemm"
    if config.conv_autotune and not config.compile:
        na["conv_autotune"] = "an Inductor autotuning choice: needs compile"
    if config.narrow_checkpoints and not config.checkpointing:
        na["narrow_checkpoints"] = "moves layers into the checkpoints of the blocks after them: needs checkpointing"
    group_norm = config.group_norm
    why = triton_unavailable(device) if group_norm == "triton" else None
    if why:
        na["group_norm"] = f"{why}; ran as fused"
        group_norm = "fused"
    return Resolved(config, device, precision, config.channels_last, config.compile, graphs, config.fused_adam, pin,
                    recompute, group_norm, not_applicable=na)


def set_precision_flags(precision: str) -> dict[str, str]:
    """Set the process-wide FP32 math mode for cuDNN convolutions and matmuls, and verify it took.

    PyTorch's default leaves cuDNN TF32 on (and matmul TF32 off), so an unmodified "FP32" run
    already uses TF32 convolutions: strict fp32 must turn both off. bf16 and fp16 keep TF32 on for
    the few fp32 operations autocast leaves in fp32. Uses the `fp32_precision` API (torch >= 2.9):
    mixing it with the legacy `allow_tf32` switches raises in current PyTorch.
    """
    want = "ieee" if precision == "fp32" else "tf32"
    torch.backends.cudnn.conv.fp32_precision = want
    torch.backends.cudnn.rnn.fp32_precision = want
    torch.backends.cuda.matmul.fp32_precision = want
    got = {"cudnn_conv_fp32_precision": torch.backends.cudnn.conv.fp32_precision,
           "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision}
    if set(got.values()) != {want}:
        raise RuntimeError(f"could not set fp32 math mode to {want!r}: {got}")
    torch.backends.cudnn.benchmark = True
    return got
