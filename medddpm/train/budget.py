"""Whether a training step or a sample can fit the device, estimated before any work: a request that cannot
(`train --size 1024`, a sweep at 1024^3, a checkpoint whose model is that size) is refused in one line giving the
estimate, instead of growing until the machine swaps or is killed, or recording a failed run after the attempt.
Every command that trains or samples (`train`, `sample`, `bench`, `sweep`, `ablation`, `study`) checks it, and
`--force-memory` starts it anyway.

The estimates are lower bounds of the peak, from the project's own memory model (the memory page's).

A training micro-step: the training state, 16 bytes a parameter (FP32 weights, gradients and Adam's two
moments), plus the activations autograd keeps for the backward of each volume, counted on the meta device
(`flops.saved_activation_bytes`: FP32, each saved tensor once, attention recomputed, checkpointed per block where
the configuration is). Halved under 16-bit autocast (a convolution's output is kept in 16 bits) and halved again
for a compiled step (Inductor's fusion keeps fewer tensors). On the paper's model at 128^3 it gives 17.6 GiB for
`baseline` (measured 18.5 on an H200), 9.1 for `bf16` (13.5) and 4.9 for `best` (6.9): under every measured
peak, so a refusal never stops a run that would have fitted. What the estimate leaves out (gradients in flight,
workspaces, the data) only adds.

A denoising step: the weights (4 bytes a parameter), the sampler's own tensors of each volume (the noisy image,
the noise and the label condition, FP32) and the widest convolution's input and output, which must be live at
once (`flops.widest_convolution_elements`; in 16 bits under 16-bit autocast). On the paper's model at 128^3 it
gives 1.7 GiB for `baseline` (measured 4.8 on an H200) and 0.9 for `best` (1.9): under every sampling peak
measured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from medddpm.configs import Config
from medddpm.errors import UserError
from medddpm.model.flops import saved_activation_bytes, widest_convolution_elements
from medddpm.model.unet import ModelSpec, UNet3D, count_parameters

STATE_BYTES_PER_PARAM = 16  # FP32 weights, their gradients and Adam's two moments
WEIGHT_BYTES_PER_PARAM = 4  # FP32 weights alone: what a sample keeps
_GIB = 2**30
TRAINING, SAMPLING = "a training step", "sampling"


class TooLarge(UserError):
    """A request whose estimated memory exceeds the device's (one line, with the estimate and what to do)."""


@dataclass(frozen=True)
class Estimate:
    state_bytes: int
    activation_bytes: int
    kind: str = TRAINING

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes

    def describe(self) -> str:
        state, live = (("training state", "activations kept for the backward") if self.kind == TRAINING else
                       ("weights", "volumes and the widest convolution's tensors"))
        return (f"at least {self.total / _GIB:,.1f} GiB ({state} {self.state_bytes / _GIB:,.1f}, {live} "
                f"{self.activation_bytes / _GIB:,.1f})")


@functools.lru_cache(maxsize=32)
def _counted(spec: ModelSpec, checkpointing: bool) -> tuple[int, int]:
    with torch.device("meta"):
        parameters = count_parameters(UNet3D(spec))
    return parameters, saved_activation_bytes(spec, checkpointing=checkpointing, recompute_attention=True)


def _sixteen_bit(config: Config) -> bool:
    return config.precision in ("bf16", "fp16")


def estimate(spec: ModelSpec, config: Config, *, batch: int = 1) -> Estimate:
    """The lower bound of one training micro-step's peak memory (`batch` volumes) under `config`."""
    parameters, activations = _counted(spec, bool(config.checkpointing))
    if _sixteen_bit(config):
        activations //= 2
    if config.compile:
        activations //= 2
    return Estimate(parameters * STATE_BYTES_PER_PARAM, activations * batch)


def sampling_estimate(spec: ModelSpec, config: Config, *, batch: int = 1) -> Estimate:
    """The lower bound of one denoising step's peak memory (`batch` volumes at once) under `config`."""
    parameters, _ = _counted(spec, False)
    loop = (2 * spec.image_channels + spec.mask_channels) * spec.voxels * 4
    widest = widest_convolution_elements(spec) * (2 if _sixteen_bit(config) else 4)
    return Estimate(parameters * WEIGHT_BYTES_PER_PARAM, (loop + widest) * batch, SAMPLING)


def device_memory(device: torch.device) -> tuple[int, str]:
    """The memory a step may take on `device`, and what it is: a GPU's total memory, or the RAM available now."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the total memory of {device}"
    import psutil

    return psutil.virtual_memory().available, "the RAM available on this machine"


TRAIN_ADVICE = "choose a smaller --size, a configuration with checkpointing (opt1-ckpt, best-ckpt), or"


def check_fits(spec: ModelSpec, configs: Config | list[Config], device: torch.device, *, force: bool = False,
               kind: str = TRAINING, batch: int = 1, advice: str = TRAIN_ADVICE) -> str | None:
    """Raise a one-line `TooLarge` where the estimate of `kind` (TRAINING or SAMPLING, `batch` volumes at once)
    exceeds what `device` has under any of `configs`, naming each such configuration; with `force`, return the
    note to print instead and let the work start. None where every one fits. `advice` precedes "pass
    --force-memory to start anyway" in the refusal: what else the user may change."""
    configs = [configs] if isinstance(configs, Config) else list(configs)
    count = estimate if kind == TRAINING else sampling_estimate
    have, what = device_memory(device)
    over = [(c, need) for c in configs if (need := count(spec, c, batch=batch)).total > have]
    if not over:
        return None
    subject = f"{kind} of the {'x'.join(map(str, spec.shape))} model" + (
        f", {batch} volumes at once," if batch > 1 else "")
    if len(over) == 1:
        (config, need), = over
        line = (f"{subject} under {config.name} needs {need.describe()}, more than {what} "
                f"({have / _GIB:,.1f} GiB)")
    else:
        line = (f"{subject} needs more than {what} ({have / _GIB:,.1f} GiB) under "
                + ", ".join(f"{c.name} (at least {need.total / _GIB:,.1f} GiB)" for c, need in over))
    if force:
        return f"note: {line}; starting all the same (--force-memory)"
    raise TooLarge(f"{line}; {advice + ' ' if advice else ''}pass --force-memory to start anyway")
