"""Step timing, the one loop every timed measurement uses (nanoGPT's bench.py habit).

Warm-up steps come first, each between host syncs and read off the host clock (compilation and cuDNN
autotuning show there). The timed steps then run back to back: on a GPU each between its own pair of CUDA
events, the host waiting for the device once, after the last; on a CPU each read off the host clock. Beside
each step's time (`step_ms`) the host's time to issue it (`dispatch_ms`): on a GPU the host runs ahead of the
device, so this is the launch cost, not the step. Milliseconds throughout. `summarize` gives the median,
p10, p90, mean and standard deviation of a list of them.

Only torch and the standard library: the training loop, the measurements and the book's exercises import it.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from medddpm.progress import progress_bar


class StepTimer:
    """Times steps run one after another: `start()` before a step, `stop()` after it, `read()` for the steps
    stopped since the last read. On a GPU a step is a pair of CUDA events and nothing waits for the device
    until `read`; on a CPU it is the host clock. A caller that records nothing but the boundaries of
    consecutive steps (a callback after each) calls `stop()` then `start()` at each of them."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._steps: list[tuple] = []  # (start, stop): CUDA events, or host clock readings on a CPU
        self._dispatch: list[float] = []
        self._open: tuple | None = None  # (start mark, stop event, host clock at start) of the step in progress

    def start(self) -> None:
        if self._open is not None:
            raise RuntimeError("StepTimer.start: the step before was not stopped")
        if self.cuda:
            mark, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            mark.record()
        else:
            mark = t0 = time.perf_counter()
            end = None
        self._open = (mark, end, t0)

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("StepTimer.stop: no step was started")
        mark, end, t0 = self._open
        if self.cuda:
            end.record()
            t1 = time.perf_counter()
        else:
            end = t1 = time.perf_counter()
        self._steps.append((mark, end))
        self._dispatch.append((t1 - t0) * 1e3)
        self._open = None

    def read(self) -> tuple[list[float], list[float]]:
        """(step_ms, dispatch_ms) of the steps stopped since the last read, oldest first. On a GPU this waits
        for the last of them to finish on the device."""
        if self.cuda:
            if self._steps:
                self._steps[-1][1].synchronize()
            step_ms = [a.elapsed_time(b) for a, b in self._steps]
        else:
            step_ms = [(b - a) * 1e3 for a, b in self._steps]
        dispatch_ms = self._dispatch
        self._steps, self._dispatch = [], []
        return step_ms, dispatch_ms


def time_steps(fn: Callable[[], object], *, device: torch.device | str, warmup: int, steps: int,
               desc: str = "steps", progress: bool = True, on_timed_start: Callable[[], object] | None = None) -> dict:
    """Run `fn` `warmup` times, each between host syncs on the host clock, then `steps` times back to back under
    a `StepTimer`. Returns `warmup_ms`, `step_ms` and `dispatch_ms` (one value a step), `wall_ms` (the
    timed steps from first start to last finish) and `peak_mem_bytes` (peak allocated device memory over the
    timed steps; None on a CPU). `on_timed_start` runs once just before the first timed step."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    warmup_ms = []
    for _ in progress_bar(range(warmup), desc=f"{desc} warm-up", progress=progress):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        warmup_ms.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    timer = StepTimer(device)
    sync()
    if on_timed_start is not None:
        on_timed_start()
    wall0 = time.perf_counter()
    for _ in progress_bar(range(steps), desc=f"{desc} timed", progress=progress):
        timer.start()
        fn()
        timer.stop()
    step_ms, dispatch_ms = timer.read()
    sync()
    wall_ms = (time.perf_counter() - wall0) * 1e3
    return {"warmup_ms": warmup_ms, "step_ms": step_ms, "dispatch_ms": dispatch_ms, "wall_ms": wall_ms,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def summarize(values: list[float]) -> dict[str, float]:
    """`median`, `p10`, `p90` (inclusive deciles: the 10th and 90th percentile interpolated between the values),
    `mean` and `std` (sample standard deviation, 0 for one value) of a list; all NaN for an empty one."""
    if not values:
        return dict.fromkeys(("median", "p10", "p90", "mean", "std"), math.nan)
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1], "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}
