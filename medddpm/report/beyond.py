"""The beyond-the-paper page: what each lever of `best` buys (the ablation) and how busy the GPU is kept."""

from __future__ import annotations

import math

import pandas as pd

from medddpm.report.loading import Data, _sort
from medddpm.report.step_time import device_label

ABLATION_VERDICTS = ("buys", "not told apart", "costs", "failed")


def ablation_summary(ablation: pd.DataFrame, run: pd.DataFrame | None = None, base: str = "best") -> pd.DataFrame:
    """Per GPU and model, what each lever of `base` buys: the ablation's `base` and each `base+<switch>=<value>`
    (`configs.ablation`), with `saved_ms` = that variant's median step minus `base`'s. The noise a lever must beat
    is `noise`: the larger of the two runs' p10-p90 spreads relative to their medians and, where the main runs
    hold `base` on the same GPU and model (`run`), how far that run and the ablation's lie apart. `verdict`: "buys"
    when the variant is slower by more than the noise, "costs" when faster by more, "not told apart" otherwise,
    "failed" when the variant did not finish its timed steps."""
    cols = ["gpu_slug", "preset", "shape", "lever", "config", "status", "message", "base_ms", "train_median_ms",
            "train_p10_ms", "train_p90_ms", "saved_ms", "ratio", "noise", "rerun", "verdict"]
    rows = []
    for (slug, preset, shape), g in ablation[ablation["batch"] == 1].groupby(["gpu_slug", "preset", "shape"]):
        b = g[(g["config"] == base) & (g["status"] == "ok")]
        if b.empty:
            continue
        b = b.iloc[0]
        rerun = math.nan
        if run is not None:
            main = run[(run["gpu_slug"] == slug) & (run["config"] == base) & (run["preset"] == preset)
                       & (run["shape"] == shape) & (run["batch"] == 1) & (run["status"] == "ok")]
            if len(main):
                ms = sorted([main["train_median_ms"].iloc[0], b["train_median_ms"]])
                rerun = ms[1] / ms[0] - 1
        for v in g[g["config"].str.startswith(base + "+")].itertuples():
            ok = v.train_median_ms > 0
            ratio = v.train_median_ms / b["train_median_ms"] if ok else math.nan
            spread = max((r.train_p90_ms - r.train_p10_ms) / r.train_median_ms for r in (b, v)) if ok else math.nan
            noise = max(spread, rerun) if not math.isnan(rerun) else spread
            verdict = ("failed" if not ok else "buys" if ratio - 1 > noise else "costs" if 1 / ratio - 1 > noise
                       else "not told apart")
            rows.append({"gpu_slug": slug, "preset": preset, "shape": shape, "lever": v.config[len(base) + 1:],
                         "config": v.config, "status": v.status, "message": v.message, "base_ms": b["train_median_ms"],
                         "train_median_ms": v.train_median_ms if ok else math.nan,
                         "train_p10_ms": v.train_p10_ms if ok else math.nan,
                         "train_p90_ms": v.train_p90_ms if ok else math.nan,
                         "saved_ms": v.train_median_ms - b["train_median_ms"] if ok else math.nan, "ratio": ratio,
                         "noise": noise, "rerun": rerun, "verdict": verdict})
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["gpu_slug", "preset", "saved_ms"], ascending=[True, True, False], ignore_index=True)


def gpu_busy(data: Data) -> pd.DataFrame:
    """Per finished run with a kernel table: the device time of its kernels and copies in one step
    (torch.profiler, profiled steps) beside the step's median time; `busy` is their ratio. Near 1 the
    device never waits for the host, so a CUDA graph has no launch gap to close. The host's time to
    issue a step (`dispatch_median_ms`) cannot tell that when steps run back to back: once the launch
    queue is full the host waits for the device, and issues a step in the device's time. The kernels' summed
    time can pass the step's a little (kernels that overlap count twice, and the profiled steps are not the timed
    ones); the device cannot be busy more than the whole step, so `busy` stops at 1 (`kernel_ms` keeps the sum)."""
    cols = ["gpu_slug", "device", "config", "train_median_ms", "dispatch_median_ms", "kernel_ms", "busy"]
    k = data.kernels
    ok = data.run[(data.run["status"] == "ok") & data.run["run_id"].isin(k["run_id"])].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    per_step = k.groupby("run_id")["total_us"].sum() / k.groupby("run_id")["steps"].max() / 1e3
    ok["device"], ok["kernel_ms"] = device_label(ok), ok["run_id"].map(per_step)
    return _sort(ok.assign(busy=(ok["kernel_ms"] / ok["train_median_ms"]).clip(upper=1.0))[cols])
