"""The one timing loop (medddpm/train/timing.py), on the CPU: warm-up, per-step times, and their summary."""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch

from medddpm.train.timing import StepTimer, summarize, time_steps


def test_time_steps_times_each_step_after_the_warm_up():
    calls = []
    started = []
    out = time_steps(lambda: (calls.append(1), time.sleep(0.002)), device="cpu", warmup=2, steps=3, progress=False,
                     on_timed_start=lambda: started.append(len(calls)))
    assert len(calls) == 5 and started == [2]  # the timed steps start after both warm-ups
    assert len(out["warmup_ms"]) == 2 and len(out["step_ms"]) == len(out["dispatch_ms"]) == 3
    assert all(t >= 2 for t in out["warmup_ms"] + out["step_ms"]) and out["peak_mem_bytes"] is None
    assert out["wall_ms"] >= sum(out["step_ms"]) * 0.99


def test_step_timer_reads_the_steps_since_the_last_read():
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start()
        time.sleep(0.001)
        timer.stop()
    steps, dispatch = timer.read()
    assert len(steps) == len(dispatch) == 2 and all(t >= 1 for t in steps)
    assert timer.read() == ([], [])
    with pytest.raises(RuntimeError, match="no step was started"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="was not stopped"):
        timer.start()


def test_summarize_takes_inclusive_deciles():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    s = summarize(values)
    q = statistics.quantiles(values, n=10, method="inclusive")
    assert s == {"median": 3.0, "p10": q[0], "p90": q[-1], "mean": 3.0, "std": statistics.stdev(values)}
    assert (s["p10"], s["p90"]) == (pytest.approx(1.4), pytest.approx(4.6))
    assert summarize([7.0]) == {"median": 7.0, "p10": 7.0, "p90": 7.0, "mean": 7.0, "std": 0.0}
    assert all(math.isnan(v) for v in summarize([]).values())
