"""What the workshop's exercises compute (medddpm/workshop.py), at small sizes on the CPU."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from medddpm import report
from medddpm.report import workshop as ws


def test_conv_precision_errors_follow_the_formats():
    out = ws.conv_precision(channels=8, size=8, device="cpu", repeats=2).set_index("mode")
    assert list(out.index) == ["fp32", "bf16"]  # no TF32 without an NVIDIA GPU
    assert out.loc["fp32", "rel_err"] < 1e-5 < 1e-4 < out.loc["bf16", "rel_err"] < 3e-2
    assert out.loc["bf16", "output dtype"] == "bfloat16"
    assert (out["conv_median_ms"] > 0).all() and math.isclose(out.attrs["flops"], 2 * 27 * 8 * 8 * 8 ** 3)
    with pytest.raises(ValueError, match="need channels >= 1, size >= 3"):
        ws.conv_precision(channels=8, size=2, device="cpu")


def _run(config, channels_last, precision="fp32", status="ok", slug="gpu"):
    return {"run_id": f"{slug}/{config}", "gpu_slug": slug, "config": config, "status": status,
            "channels_last": channels_last, "precision": precision, "compile": False, "cuda_graphs": False,
            "fused_adam": False, "attention": "math", "recompute_attention": True}


def test_channels_last_pairs_match_every_other_switch():
    run = pd.DataFrame([_run("baseline", False), _run("opt1", False, "tf32"), _run("opt2", True),
                        _run("opt12", True, "tf32"), _run("bf16-cl", True, "bf16"),  # no bf16 run: no partner
                        _run("opt2", True, slug="other"), _run("baseline", False, status="oom", slug="other")])
    pairs = ws.channels_last_pairs(run)  # this run table predates the upsample switch: it still pairs
    assert sorted(zip(pairs["gpu_slug"], pairs["channels_last"], pairs["partner"])) == [
        ("gpu", "opt12", "opt1"), ("gpu", "opt2", "baseline")]


def test_layout_share_and_stall_reading():
    k = pd.DataFrame({"run_id": ["r"] * 3, "gpu_slug": ["g"] * 3, "config": ["c"] * 3,
                      "category": ["layout", "layout", "convolution"], "calls": [4, 2, 6], "micro_steps": [2, 2, 2],
                      "share": [0.1, 0.2, 0.7], "device_type": ["cuda"] * 3})
    row = ws.layout_share(k).iloc[0]
    assert math.isclose(row["layout_share"], 0.3) and row["layout_calls_per_step"] == 3
    assert ws.reading("long_scoreboard", 85, 80).startswith("bandwidth-bound")
    assert ws.reading("long_scoreboard", 3, 25).startswith("latency-bound")
    assert ws.reading("long_scoreboard", 30, 80).startswith("waits on memory")
    assert ws.reading("math_pipe_throttle", 10, 80) == "compute-bound on one pipe"
    assert ws.reading("barrier", 10, 80).startswith("synchronization-bound")


def test_stall_table_adds_up_on_committed_counters():
    from test_explore import committed_stall_counters

    counters = committed_stall_counters().assign(gpu_slug="g", config="c")
    st = ws.stall_table(counters, top=4)
    assert len(st) == 4 and st["profiled_ms"].is_monotonic_decreasing
    # Nsight Compute's stall reasons add up to its cycles per issued instruction
    assert np.allclose(st["sum_of_stalls"], st["warp_cycles_per_inst"], rtol=0.15)
    for r in st.itertuples():
        assert r.dominant_cycles == max(getattr(r, f"stall_{x}") for x in ws.STALL_MEANING
                                        if not math.isnan(getattr(r, f"stall_{x}")))


def test_cost_model(committed_data):
    flops = 16.6e12
    h = ws.gpu_hours(flops_per_step=flops, peak_flops=100e12, efficiency=0.25)
    assert math.isclose(h, 200_000 * flops / 25e12 / 3600)
    with pytest.raises(ValueError, match="0 < efficiency <= 1"):
        ws.gpu_hours(flops_per_step=flops, peak_flops=100e12, efficiency=1.5)
    assert 0 < ws.matmul_tflops(device="cpu", n=128, repeats=2) < 100
    data = committed_data
    eff = ws.efficiencies(data)
    assert ((eff["efficiency"] > 0) & (eff["efficiency"] <= 1)).all()
    assert set(eff["gpu_slug"]) <= {s for s in data.run["gpu_slug"] if report.peaks_of(s, data.run, data.roofs)}
    assert set(eff["gpu_slug"]) <= set(ws.gpus_in(data)), "the workshop's cards are GPUs"
    assert eff["peak_source"].str.startswith(("datasheet", "measured")).all()
    # a step carried to another device at the same fraction of each one's peak, and back
    assert ws.carried_ms(100.0, 60e12, 30e12) == pytest.approx(200.0)
    assert ws.carried_ms(ws.carried_ms(100.0, 60e12, 30e12), 30e12, 60e12) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="two peaks"):
        ws.carried_ms(100.0, 0.0, 30e12)
    assert ws.step_hours(1000.0) == pytest.approx(200_000 / 3600)


def test_profile_conv_layouts_on_the_cpu():
    prof = ws.profile_conv_layouts(channels=8, size=8, device="cpu", steps=1)
    assert set(prof["memory_format"]) == {"NCDHW", "NDHWC (channels-last)"}
    assert np.allclose(prof.groupby("memory_format")["share"].sum(), 1.0)
    assert (prof.loc[prof["category"] == "convolution", "calls"] > 0).any()
