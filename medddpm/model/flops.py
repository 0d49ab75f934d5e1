"""Counted work: parameters and FLOPs of one micro-step, the activations it keeps and the convolution layers it
runs, on the meta device (no memory, no time)."""

from __future__ import annotations

import functools

import torch
from torch.utils.flop_counter import FlopCounterMode

from medddpm.model.unet import ModelSpec, UNet3D, count_parameters


def count(spec: ModelSpec, *, batch: int = 1, backward: bool = True) -> dict:
    """Parameters, and forward / forward+backward FLOPs (2 per multiply-add) of one micro-step,
    split by operator (convolution, attention matmuls, linear), from torch's FlopCounterMode.
    `backward=False` leaves the (slower) forward+backward count out."""
    with torch.device("meta"):
        model = UNet3D(spec, recompute_attention=False)
        x = torch.empty(batch, spec.in_channels, *spec.shape)
        t = torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as fwd:
        y = model(x, t)
    by_op = {str(k).removeprefix("aten."): int(v) for k, v in fwd.get_flop_counts()["Global"].items()}
    out = {
        "parameters": count_parameters(model),
        "forward_flops": fwd.get_total_flops(),
        "forward_flops_by_op": by_op,
        "output_shape": list(y.shape),
    }
    if backward:
        with FlopCounterMode(display=False) as both:
            model(x, t).sum().backward()
        out["train_flops"] = both.get_total_flops()
    return out


def saved_activation_bytes(spec: ModelSpec, *, batch: int = 1, checkpointing: bool = False,
                           recompute_attention: bool = True) -> int:
    """Bytes autograd keeps for the backward pass of one forward, FP32 without fusion, counted on the
    meta device (each saved tensor once). Not a peak: training adds its state (weights, gradients,
    Adam), the gradients in flight and the recomputation of one block under checkpointing."""
    with torch.device("meta"):
        model = UNet3D(spec, recompute_attention=recompute_attention, checkpointing=checkpointing)
        x = torch.empty(batch, spec.in_channels, *spec.shape)
        t = torch.zeros(batch, dtype=torch.long)
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, t)
    return sum(saved.values())


@functools.cache
def widest_convolution_elements(spec: ModelSpec) -> int:
    """The most elements one convolution of a forward holds at once, its input and its output (batch 1), counted
    on the meta device: what any forward, training or sampling, keeps live beside the weights at that moment."""
    most = 0

    def widest(conv, args, out):
        nonlocal most
        most = max(most, args[0].numel() + out.numel())

    with torch.device("meta"):
        model = UNet3D(spec)
        for m in model.modules():
            if isinstance(m, torch.nn.Conv3d):
                m.register_forward_hook(widest)
        with torch.no_grad():
            model(torch.empty(1, spec.in_channels, *spec.shape), torch.zeros(1, dtype=torch.long))
    return most


LAYER_PREFIX = "conv3d "  # every layer name starts so: the profilers' NVTX ranges are told apart from others


def layer_name(conv: torch.nn.Conv3d, x: torch.Tensor) -> str:
    """What identifies a convolution layer across configurations: its channels, kernel, stride and input size,
    e.g. ``conv3d 64>128 k3 s2 @128x128x128`` (the NVTX range `measure.profile.capture` names it by)."""
    k, s = (v[0] if len(set(v)) == 1 else "x".join(map(str, v)) for v in (conv.kernel_size, conv.stride))
    return f"{LAYER_PREFIX}{conv.in_channels}>{conv.out_channels} k{k} s{s} @{'x'.join(map(str, x.shape[2:]))}"


@functools.cache
def conv_layers(spec: ModelSpec) -> dict[str, int]:
    """Instances of each convolution layer (`layer_name`) in one forward of the model."""
    seen: dict[str, int] = {}

    def count(conv, args):
        seen[layer_name(conv, args[0])] = seen.get(layer_name(conv, args[0]), 0) + 1

    with torch.device("meta"):  # shapes only: no memory, no arithmetic
        model = UNet3D(spec)
        for m in model.modules():
            if isinstance(m, torch.nn.Conv3d):
                m.register_forward_pre_hook(count)
        model(torch.empty(1, spec.in_channels, *spec.shape), torch.zeros(1, dtype=torch.long))
    return seen
