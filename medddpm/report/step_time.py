"""The step-time page: each configuration's micro-step against the baseline, and against the floor a peak
throughput sets."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from medddpm.configs import PAPER
from medddpm.report.loading import Data, _sort
from medddpm.report.roofs import DATASHEET_FP32, peaks_of  # noqa: F401 - the pages read them here too
from medddpm.report.safe import code, md
from medddpm.model.diffusion import TIMESTEPS
from medddpm.presets import REFERENCE_ACCUM, REFERENCE_STEPS  # noqa: F401 - the pages' 100k-step costs


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




def best_by_gpu(summary: pd.DataFrame) -> pd.DataFrame:
    """The fastest configuration of each GPU, with its speedup over that GPU's baseline."""
    if summary.empty:
        return summary
    idx = summary.groupby("gpu_slug")["train_median_ms"].idxmin()
    return summary.loc[idx].reset_index(drop=True)


def bench_table(bench: pd.DataFrame) -> pd.DataFrame:
    """The bench timings (table ``bench``, training micro-steps) as one row per GPU and configuration: each
    implementation's median micro-step, the median over its bench runs; how many runs timed it; and, where the
    reference implementation was timed too, ours against it (`ours_faster`: reference / ours - 1)."""
    cols = ["gpu_slug", "config", "ours_ms", "reference_ms", "ours_faster", "runs", "timed_steps"]
    if bench.empty:
        return pd.DataFrame(columns=cols)
    b = bench.assign(impl=bench["implementation"].map(lambda i: "ours" if i == "ours" else "reference"))
    ms = b.pivot_table(index=["gpu_slug", "config"], columns="impl", values="train_median_ms", aggfunc="median")
    ms = ms.reindex(columns=["ours", "reference"]).rename(columns={"ours": "ours_ms", "reference": "reference_ms"})
    extra = b.groupby(["gpu_slug", "config"]).agg(runs=("source", "nunique"), timed_steps=("timed_steps", "max"))
    out = ms.join(extra).reset_index()
    out["ours_faster"] = out["reference_ms"] / out["ours_ms"] - 1
    return _sort(out[cols])


HEADLINE_ROLES = ("the paper's", "fastest measured")


def headline(run: pd.DataFrame) -> pd.DataFrame:
    """Per device with a strict-FP32 baseline: each of the paper's four configurations measured there (role "the
    paper's"; the baseline at 1x, and one slower than it below 1x) and the fastest configuration measured (role
    "fastest measured", unless it is one of the paper's), each with its median micro-step and its speedup over the
    baseline. `lo`-`hi` is the speedup's spread from the two runs' 10th-90th percentiles (baseline p10 / config
    p90 to baseline p90 / config p10). Devices in `_sort` order (GPUs first), the paper's in their order."""
    cols = ["gpu_slug", "preset", "size", "role", "config", "base_ms", "train_median_ms", "train_p10_ms",
            "train_p90_ms", "speedup", "lo", "hi"]
    ok = run[(run["status"] == "ok") & (run["batch"] == 1)]
    rows = []
    for slug, g in ok.groupby("gpu_slug"):
        g = g.set_index("config")
        if "baseline" not in g.index:
            continue
        b = g.loc["baseline"]
        fastest = g["train_median_ms"].idxmin()
        picks = [(HEADLINE_ROLES[0], c) for c in PAPER if c in g.index]
        picks += [(HEADLINE_ROLES[1], fastest)] if fastest not in PAPER else []
        for role, config in picks:
            r = g.loc[config]
            rows.append({"gpu_slug": slug, "preset": b["preset"], "size": int(b["size"]), "role": role,
                         "config": config, "base_ms": b["train_median_ms"], "train_median_ms": r["train_median_ms"],
                         "train_p10_ms": r["train_p10_ms"], "train_p90_ms": r["train_p90_ms"],
                         "speedup": b["train_median_ms"] / r["train_median_ms"],
                         "lo": b["train_p10_ms"] / r["train_p90_ms"], "hi": b["train_p90_ms"] / r["train_p10_ms"]})
    out = pd.DataFrame(rows, columns=cols)
    return _sort(out) if len(out) else out


# ------------------------------------------------------------------------------------------ the page

SUMMARY_COLUMNS = {"gpu_slug": "device", "config": "configuration", "precision_used": "precision ran",
                   "train_median_ms": "median ms", "train_p10_ms": "p10 ms", "train_p90_ms": "p90 ms",
                   "speedup": "speedup (x)", "achieved_tflops": "TFLOP/s"}
BENCH_COLUMNS = {"gpu_slug": "device", "config": "configuration", "ours_ms": "ours, ms",
                 "reference_ms": "reference, ms", "ours_faster": "ours against the reference", "runs": "bench runs",
                 "timed_steps": "timed steps"}
BENCH_APART = 0.10  # a bench timing this far from the sweep's times the configuration as it was defined then


def check(data: Data, summary: pd.DataFrame) -> None:
    """The step-time page's numbers are sane: some run finished, every speedup is positive and finite, each
    median lies in its p10-p90 spread and is the median of the run's timed steps in steps.parquet, and every
    projected cost is positive."""
    assert len(summary), "no finished run under data/"
    check_speedups(speedups(data.run))
    check_medians(data)
    assert (summary["train_p10_ms"] <= summary["train_median_ms"]).all(), summary
    assert (summary["train_median_ms"] <= summary["train_p90_ms"]).all(), summary
    assert (summary["gpu_hours_100k"] > 0).all(), summary
    assert (summary["sample_s"].dropna() > 0).all(), summary


def _cpu(slug: str, cpus: set[str], what: str = "CPU smoke runs") -> str:
    return f" ({what})" if slug in cpus else ""


def fastest_text(summary: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: its fastest configuration, against the baseline where there is one, and the widest spread."""
    lines = []
    for slug, g in summary.groupby("gpu_slug", sort=False):  # GPUs first
        g = g.set_index("config")
        best = g["train_median_ms"].idxmin()
        line = (f"- **{md(slug)}**{_cpu(slug, cpus)} ({md(g['preset'].iloc[0])}, {g['size'].iloc[0]}³): fastest is "
                f"{code(best)} at {g.loc[best, 'train_median_ms']:.4g} ms")
        if "baseline" in g.index:
            line += (f", {g.loc[best, 'speedup']:.2f}x the strict-FP32 baseline "
                     f"({g.loc['baseline', 'train_median_ms']:.4g} ms)")
        spread = ((g["train_p90_ms"] - g["train_p10_ms"]) / g["train_median_ms"]).max()
        lines.append(line + f"; the widest p10-p90 spread is {spread:.0%} of its median.")
    return "\n".join(lines)


def cost_text(summary: pd.DataFrame, cpus: set[str]) -> str:
    """Per device: the device-hours and energy of 100k steps, cheapest and dearest, and one full sample's time."""
    lines = []
    for slug, g in summary.groupby("gpu_slug", sort=False):  # GPUs first
        g = g.set_index("config")
        fast, slow = g["gpu_hours_100k"].idxmin(), g["gpu_hours_100k"].idxmax()
        line = (f"- **{md(slug)}**{_cpu(slug, cpus)}: 100k steps take {g.loc[fast, 'gpu_hours_100k']:.3g} device-hours "
                f"with {code(fast)} and {g.loc[slow, 'gpu_hours_100k']:.3g} with {code(slow)}")
        if g["energy_100k_kwh"].notna().any():
            e = g["energy_100k_kwh"].dropna()
            line += f"; energy {e.min():.3g} to {e.max():.3g} kWh"
        s = g["sample_s"].dropna()
        if len(s):
            fast = s.idxmin()
            line += (f"; one full sample takes {s.min():.3g} s ({code(fast)}) to {s.max():.3g} s "
                     f"({code(s.idxmax())}) once compiled, {g.loc[fast, 'sample_step_median_ms']:.3g} ms or more per denoising step")
            if g.loc[fast, "compile"] and pd.notna(g.loc[fast, "sample_total_s"]):
                line += f" (the first sample of a process, which compiles, took {g.loc[fast, 'sample_total_s']:.3g} s)"
        lines.append(line + ".")
    return "\n".join(lines)


def faster_text(v: float) -> str:
    """`bench_table`'s `ours_faster` in words: '3.1% faster', '2.0% slower', '-' where the reference was not timed."""
    return "-" if pd.isna(v) else f"{abs(v):.1%} {'faster' if v >= 0 else 'slower'}"


def check_bench(bt: pd.DataFrame) -> None:
    """Ours and the reference implement the same model: where both were timed, within a factor of 1.5."""
    both = bt.dropna(subset=["reference_ms"])
    assert both["ours_faster"].abs().lt(0.5).all(), both


def bench_text(bt: pd.DataFrame, summary: pd.DataFrame) -> str:
    """Ours against the reference for each configuration timed in both, and the bench timings that lie more than
    `BENCH_APART` from the sweep's (a bench run times a configuration as defined when it ran; the sweep's rows are
    what the other pages use)."""
    both = bt.dropna(subset=["reference_ms"])
    lines = [f"- **{md(r.gpu_slug)}, {code(r.config)}**: ours {r.ours_ms:.4g} ms, the reference "
             f"{r.reference_ms:.4g} ms: ours is {faster_text(r.ours_faster)}." for r in both.itertuples()]
    sweep = summary.set_index(["gpu_slug", "config"])["train_median_ms"]
    apart = [(r, sweep[(r.gpu_slug, r.config)]) for r in bt.itertuples() if (r.gpu_slug, r.config) in sweep.index
             and abs(r.ours_ms / sweep[(r.gpu_slug, r.config)] - 1) > BENCH_APART]
    text = "\n".join(lines) if lines else "No configuration was timed in both implementations."
    if apart:
        text += ("\n\nA bench run times a configuration as it was defined when the run was made; these differ from the "
                 f"sweep by more than {BENCH_APART:.0%}: " + ", ".join(
                     f"{code(r.config)} on {md(r.gpu_slug)} ({r.ours_ms:.4g} ms in the bench, {ms:.4g} ms in the sweep)"
                     for r, ms in apart) + ". The sweep's times are the ones every other page uses.")
    return text
