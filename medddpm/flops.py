"""Counted work: parameters and FLOPs of one micro-step, on the meta device (no memory, no time)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from .model import ModelSpec, UNet3D, count_parameters


def count(spec: ModelSpec, *, batch: int = 1) -> dict:
    """Parameters, and forward / forward+backward FLOPs (2 per multiply-add) of one micro-step,
    split by operator (convolution, attention matmuls, linear), from torch's FlopCounterMode."""
    with torch.device("meta"):
        model = UNet3D(spec, recompute_attention=False)
        x = torch.empty(batch, spec.in_channels, spec.size, spec.size, spec.size)
        t = torch.zeros(batch, dtype=torch.long)
    with FlopCounterMode(display=False) as fwd:
        y = model(x, t)
    with FlopCounterMode(display=False) as both:
        model(x, t).sum().backward()
    by_op = {str(k).removeprefix("aten."): int(v) for k, v in fwd.get_flop_counts()["Global"].items()}
    return {
        "parameters": count_parameters(model),
        "forward_flops": fwd.get_total_flops(),
        "forward_flops_by_op": by_op,
        "train_flops": both.get_total_flops(),
        "output_shape": list(y.shape),
    }
