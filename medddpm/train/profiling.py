"""Step profiling, the one torch.profiler pass every kernel table comes from (beside `medddpm.train.timing`, the
one timing loop): warm-up calls first, outside the profile (compilation, cuDNN autotuning, graph capture), then
the profiled calls, the device synchronised after them so that CUPTI has recorded every kernel. The trace becomes
the kernel table of `medddpm.analysis.kernels`.

The measured run, the bench's `--kernels` and the book's exercises import it; it never runs while steps are
timed.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from medddpm.analysis.kernels import kernel_rows_from_trace, op_rows_from_trace


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_kernels(step: Callable[[], object], *, device: torch.device | str, steps: int = 2,
                    warmup: int = 1) -> pd.DataFrame:
    """Call `step` `warmup` times, then `steps` times under torch.profiler; one row per (kernel, pass)
    (`analysis.kernels`: kernels on a GPU, aten operators on a CPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    for _ in range(warmup):  # compilation, cuDNN autotuning and graph capture stay out of the profile
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)  # every kernel has finished, so CUPTI has recorded it
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return (kernel_rows_from_trace if cuda else op_rows_from_trace)(trace, steps=steps)
