"""The step-time page: each configuration's micro-step against the baseline, and against the floor a peak
throughput sets."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from medddpm.configs import CONFIGS
from medddpm.report.loading import Data, _sort
from medddpm.model.diffusion import TIMESTEPS

REFERENCE_STEPS, REFERENCE_ACCUM = 100_000, 2  # the reference's optimizer steps, micro-steps per step

# Peak throughputs (FLOP/s) that set a floor for one micro-step: 16.6 TFLOP / peak. Inputs, not results:
# each with its source. A GPU missing here simply has no floor drawn.
PEAKS: dict[str, dict[str, tuple[float, str]]] = {
    "nvidia-h200": {
        "bf16": (790e12, "measured on this machine type (one run of a dense bf16 matmul)"),
        "fp32": (67e12, "FP32 without tensor cores, NVIDIA H200 SXM datasheet"),
    },
}

# FP32 (non-tensor-core) peaks from NVIDIA's datasheets, for counting what training costs elsewhere.
DATASHEET_FP32 = {"V100 SXM2": 15.7e12, "A100 SXM": 19.5e12, "H100 SXM": 67e12}




def device_label(run: pd.DataFrame) -> pd.Series:
    """'nvidia-h200 (paper, 128³)': the GPU with the preset and size its numbers belong to."""
    return run["gpu_slug"] + " (" + run["preset"] + ", " + run["size"].astype(str) + "³)"


def step_summary(run: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run: step time with spread, speedup vs baseline on the same GPU, cost."""
    ok = run[run["status"] == "ok"].copy()
    base = ok[ok["config"] == "baseline"].set_index("gpu_slug")["train_median_ms"]
    ok["speedup"] = ok["gpu_slug"].map(base) / ok["train_median_ms"]
    ok["device"] = device_label(ok)
    ok["peak_mem_gib"] = ok["peak_mem_bytes"].where(ok["peak_mem_bytes"] >= 0) / 2**30
    ok["peak_reserved_gib"] = ok["peak_reserved_bytes"].where(ok["peak_reserved_bytes"] >= 0) / 2**30
    # A full sample once compiled and captured; sample_total_s is the first one in a process, which
    # compiles (and on the smoke preset runs fewer steps).
    ok["sample_s"] = ok["sample_step_median_ms"] * TIMESTEPS / 1e3
    cols = ["gpu_slug", "device", "config", "preset", "size", "precision_used", "compile", "train_median_ms",
            "train_p10_ms", "train_p90_ms", "speedup", "achieved_tflops", "dispatch_median_ms", "epoch_s",
            "gpu_hours_100k", "energy_per_step_j", "energy_100k_kwh", "mean_power_w", "sample_step_median_ms", "sample_s",
            "sample_total_s", "peak_mem_gib", "peak_reserved_gib", "warmup_s", "first_step_s", "flops_per_step"]
    return _sort(ok[cols])


def speedups(run: pd.DataFrame) -> pd.DataFrame:
    """Speedup of each configuration over the baseline of the same GPU (GPUs with a baseline only)."""
    s = step_summary(run)
    return s[s["speedup"].notna()][["gpu_slug", "device", "config", "train_median_ms", "speedup"]].reset_index(drop=True)




def check_speedups(df: pd.DataFrame) -> None:
    s = df["speedup"]
    bad = df[~(np.isfinite(s) & (s > 0))]
    assert bad.empty, f"speedups must be positive and finite: {bad[['gpu_slug', 'config', 'speedup']].to_dict('records')}"


def check_medians(data: Data) -> None:
    """run.parquet's median equals the median of the timed training steps in steps.parquet."""
    s = data.steps[(data.steps["phase"] == "train") & data.steps["timed"]]
    med = s.groupby("run_id")["step_ms"].median()
    r = data.ok.set_index("run_id")["train_median_ms"]
    both = r.index.intersection(med.index)
    assert np.allclose(r[both], med[both], rtol=1e-6), "run medians differ from the step table"


def check_strict_baseline(data: Data) -> None:
    """The FP32 baseline ran no TF32 tensor-core kernel and read back strict FP32 math modes."""
    k = data.kernels
    tc = k[(k["config"] == "baseline") & (k["device_type"] == "cuda") & k["tensor_cores"]]
    assert tc.empty, f"baseline ran tensor-core kernels: {tc['short_name'].unique()[:5].tolist()}"
    for _, r in data.run[(data.run["config"] == "baseline") & (data.run["status"] == "ok")].iterrows():
        flags = json.loads(r["backend_flags"] or "{}")
        assert all(v == "ieee" for v in flags.values()), f"{r['run_id']}: baseline math modes {flags}"




def floors(run: pd.DataFrame, bench: pd.DataFrame | None = None, bench_flops: float | None = None) -> pd.DataFrame:
    """Per GPU and precision with a known peak: the shortest possible micro-step (FLOPs per step / peak)
    beside the fastest configuration that ran in that precision. GPUs with no sweep use their bench
    timings when `bench_flops` (the FLOPs of the bench's micro-step) is given."""
    s = step_summary(run)[["gpu_slug", "config", "precision_used", "train_median_ms", "flops_per_step"]]
    s = s.assign(timing_source="sweep")
    if bench is not None and not bench.empty and bench_flops:
        ours = bench[(bench["implementation"] == "ours") & ~bench["gpu_slug"].isin(s["gpu_slug"])
                     & bench["config"].isin(list(CONFIGS))]
        b = ours.groupby(["gpu_slug", "config"], as_index=False)["train_median_ms"].median()
        b = b.assign(precision_used=b["config"].map(lambda c: CONFIGS[c].precision), flops_per_step=bench_flops,
                     timing_source="bench timings")
        s = pd.concat([s, b], ignore_index=True)
    rows = []
    for slug, g in s.groupby("gpu_slug"):
        for precision, (peak, peak_source) in PEAKS.get(slug, {}).items():
            same = g[g["precision_used"] == precision]
            if same.empty:
                continue
            best = same.loc[same["train_median_ms"].idxmin()]
            floor_ms = best["flops_per_step"] / peak * 1e3
            rows.append({"gpu_slug": slug, "precision": precision, "peak_tflops": peak / 1e12, "source": peak_source,
                         "floor_ms": floor_ms, "best_config": best["config"], "best_ms": best["train_median_ms"],
                         "fraction_of_peak": floor_ms / best["train_median_ms"], "timing_source": best["timing_source"]})
    return pd.DataFrame(rows, columns=["gpu_slug", "precision", "peak_tflops", "source", "floor_ms", "best_config",
                                       "best_ms", "fraction_of_peak", "timing_source"])


def best_by_gpu(summary: pd.DataFrame) -> pd.DataFrame:
    """The fastest configuration of each GPU, with its speedup over that GPU's baseline."""
    if summary.empty:
        return summary
    idx = summary.groupby("gpu_slug")["train_median_ms"].idxmin()
    return summary.loc[idx].reset_index(drop=True)
