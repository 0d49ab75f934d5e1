"""The training micro-step timed end to end: items read from the data set by the loader's workers, copied to the
device and one-hot encoded there, then the step (`medddpm.train.loader.DeviceLoader`, as `train` feeds it).

`time_end_to_end` times it exactly as the GPU-only micro-step is timed (`medddpm.train.timing.time_steps`: warm-up,
then back-to-back steps between CUDA events), so that its median compares with `train_median_ms`; a step that
waits for its data shows the wait. `loader_rate` is what the loader delivers alone (items a second, copies to the
device included), and `drift` compares the last timed steps with the first (a step that slows over time).
"""

from __future__ import annotations

import statistics
import time

import torch

from medddpm.train.loader import DeviceLoader
from medddpm.train.loop import batch_indices
from medddpm.train.timing import time_steps


def _order(n_items: int, count: int, seed: int):
    return (batch_indices(n_items, i, 0, seed=seed) for i in range(count))


def time_end_to_end(engine, dataset, *, warmup: int, steps: int, seed: int = 0, workers: int | None = None,
                    desc: str = "end to end", progress: bool = True, on_timed_start=None) -> dict:
    """`time_steps`' result for micro-steps that each take the next item from the loader (one volume a step)."""
    items = iter(DeviceLoader(dataset, _order(len(dataset), warmup + steps, seed), device=engine.device,
                              workers=workers))

    def step():
        image, cond = next(items)
        return engine.step((engine.prepare(image), engine.prepare(cond)))

    try:
        return time_steps(step, device=engine.device, warmup=warmup, steps=steps, desc=desc, progress=progress,
                          on_timed_start=on_timed_start)
    finally:
        items.close()  # the workers stop here, not when the generator is collected


def loader_rate(dataset, *, device: torch.device | str, items: int, seed: int = 0, workers: int | None = None) -> float:
    """Items a second that the loader delivers on the device with no step to feed, worker start-up included."""
    device = torch.device(device)
    t0 = time.perf_counter()
    n = 0
    for image, cond in DeviceLoader(dataset, _order(len(dataset), items, seed), device=device, workers=workers):
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def drift(step_ms: list[float], window: int = 50) -> float:
    """Median of the last `window` steps over the median of the first `window` (a quarter of the steps each when
    there are fewer than 4 x window), minus 1: 0.05 is a step 5% slower at the end; NaN under 8 steps."""
    if len(step_ms) < 8:
        return float("nan")
    w = min(window, len(step_ms) // 4)
    return statistics.median(step_ms[-w:]) / statistics.median(step_ms[:w]) - 1
