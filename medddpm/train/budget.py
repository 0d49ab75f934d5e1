"""Whether a training step can fit the device, estimated before any work: a request that cannot (`train --size
1024`) is refused in one line giving the estimate, instead of growing until the machine swaps or is killed.

The estimate is a lower bound of the step's peak, from the project's own memory model (the memory page's): the
training state, 16 bytes a parameter (FP32 weights, gradients and Adam's two moments), plus the activations
autograd keeps for the backward of one volume, counted on the meta device (`flops.saved_activation_bytes`: FP32,
each saved tensor once, attention recomputed, checkpointed per block where the configuration is). Halved under
16-bit autocast (a convolution's output is kept in 16 bits) and halved again for a compiled step (Inductor's
fusion keeps fewer tensors). On the paper's model at 128^3 it gives 17.6 GiB for `baseline` (measured 18.5 on an
H200), 9.1 for `bf16` (13.5) and 4.9 for `best` (6.9): under every measured peak, so a refusal never stops a run
that would have fitted. What the estimate leaves out (gradients in flight, workspaces, the data) only adds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from medddpm.configs import Config
from medddpm.model.flops import saved_activation_bytes
from medddpm.model.unet import ModelSpec, UNet3D, count_parameters

STATE_BYTES_PER_PARAM = 16  # FP32 weights, their gradients and Adam's two moments
_GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    state_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes

    def describe(self) -> str:
        return (f"at least {self.total / _GIB:,.1f} GiB (training state {self.state_bytes / _GIB:,.1f}, activations "
                f"kept for the backward {self.activation_bytes / _GIB:,.1f})")


@functools.lru_cache(maxsize=32)
def _counted(spec: ModelSpec, checkpointing: bool) -> tuple[int, int]:
    with torch.device("meta"):
        parameters = count_parameters(UNet3D(spec))
    return parameters, saved_activation_bytes(spec, checkpointing=checkpointing, recompute_attention=True)


def estimate(spec: ModelSpec, config: Config) -> Estimate:
    """The lower bound of one training micro-step's peak memory (one volume) under `config`."""
    parameters, activations = _counted(spec, bool(config.checkpointing))
    if config.precision in ("bf16", "fp16"):
        activations //= 2
    if config.compile:
        activations //= 2
    return Estimate(parameters * STATE_BYTES_PER_PARAM, activations)


def device_memory(device: torch.device) -> tuple[int, str]:
    """The memory a step may take on `device`, and what it is: a GPU's total memory, or the RAM available now."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the total memory of {device}"
    import psutil

    return psutil.virtual_memory().available, "the RAM available on this machine"


def check_fits(spec: ModelSpec, config: Config, device: torch.device, *, force: bool = False) -> str | None:
    """Raise a one-line ValueError where the step's estimate exceeds what `device` has; with `force`, return the
    note to print instead and let the training start. None where it fits."""
    need = estimate(spec, config)
    have, what = device_memory(device)
    if need.total <= have:
        return None
    size = "x".join(map(str, spec.shape))
    line = (f"a training step of the {size} model under {config.name} needs {need.describe()}, more than "
            f"{what} ({have / _GIB:,.1f} GiB)")
    if force:
        return f"note: {line}; starting all the same (--force-memory)"
    raise ValueError(f"{line}; choose a smaller --size, a configuration with checkpointing (opt1-ckpt, best-ckpt), "
                     "or pass --force-memory to start anyway")
