"""What the book's pages read: every run under ``data/``, validated, and the summaries each page draws.

A *run* is a folder ``data/<gpu-slug>/<run>/`` holding ``run.parquet`` (written last by the
producer, so its presence marks a finished measurement). ``<run>`` is the configuration's name for
the device's main preset at batch 1 (what every page compares), and ``<config>@<preset>[-b<batch>]``
for a *variant* (another model, such as the BraTS one, or another batch; `schema.run_folder`): only
the memory page reads those (``variants=True``). Folders that hold no parquet at all (such
as ``data/nvidia-h200/reference/`` with raw ``bench`` timings, or a sweep's hidden staging folders)
are not runs and are listed by `scan` as such. A folder with some parquet but no ``run.parquet`` is
an incomplete run: reading it raises a one-line `DataError` naming the folder, which fails the book
build on purpose (a page must never silently drop a measurement).

Nothing here names a GPU: every summary is grouped by the ``gpu_slug`` found in the data, so a
GPU added under ``data/`` appears on every page without an edit. Pages call the ``check_*``
functions to assert that their numbers are sane; `medddpm.claims` turns each published claim of
Ryoo et al. (2026) into a verdict computed from these tables.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from . import schema
from .configs import CONFIGS, PAPER, get_config  # noqa: F401 - PAPER for the pages
from .diffusion import TIMESTEPS
from .scaling import SCALING_DIR

REPO = Path(__file__).resolve().parent.parent
ABLATION_DIR = "ablation"  # data/<gpu>/ablation/<run>/: `python -m medddpm ablation`
TABLES = ("run", "steps", "kernels", "ncu", "quality")  # one file each in every run folder
REFERENCE_STEPS, REFERENCE_ACCUM = 100_000, 2  # the reference's optimizer steps, micro-steps per step

# Peak throughputs (FLOP/s) that set a floor for one micro-step: 16.6 TFLOP / peak. Inputs, not results:
# each with its source. A GPU missing here simply has no floor drawn.
PEAKS: dict[str, dict[str, tuple[float, str]]] = {
    "nvidia-h200": {
        "bf16": (790e12, "dense bf16 matmul measured on this machine type (data/nvidia-h200/NOTES.md)"),
        "fp32": (67e12, "FP32 without tensor cores, NVIDIA H200 SXM datasheet"),
    },
}

# FP32 (non-tensor-core) peaks from NVIDIA's datasheets, for counting what training costs elsewhere.
DATASHEET_FP32 = {"V100 SXM2": 15.7e12, "A100 SXM": 19.5e12, "H100 SXM": 67e12}

# Quality against strict FP32, for the quality page and the claims' "TF32 keeps quality" (`medddpm.claims`).
QUALITY_REL_ERR = 1e-2  # forward-pass relative L2 error tolerated against strict FP32
QUALITY_LOSS = 0.02  # mean relative loss difference tolerated against strict FP32

HOLDS, FAILS, NA = "holds", "does not hold", "not measurable"
NOT_MEASURED = "not measured yet"
NOT_YET = "not met by the runs so far"  # a memory target none of the measured runs meets, while others are unmeasured


class DataError(RuntimeError):
    """The data tree is missing or malformed (one line naming the folder or file)."""


def data_root() -> Path:
    return Path(os.environ.get("MEDDDPM_DATA", REPO / "data"))


def config_order(names=()) -> list[str]:
    """CONFIGS order first, then any other configuration names found in the data, sorted."""
    extra = sorted({str(n) for n in names} - set(CONFIGS))
    return list(CONFIGS) + extra


def _sort(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """Rows by GPU, then configuration in CONFIGS order."""
    if df.empty or "config" not in df:
        return df.reset_index(drop=True)
    rank = {c: i for i, c in enumerate(config_order(df["config"].unique()))}
    keys = [c for c in ("gpu_slug", *cols) if c in df]
    return (df.assign(_rank=df["config"].map(rank)).sort_values([keys[0], "_rank", *keys[1:]] if keys else ["_rank"])
            .drop(columns="_rank").reset_index(drop=True))


# ------------------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class Scan:
    runs: list[Path]  # data/<slug>/<config>/ folders with run.parquet
    not_runs: list[Path]  # folders without any parquet (raw notes, bench JSON), not read as runs


def scan(root: str | os.PathLike | None = None) -> Scan:
    """Find the runs under the data tree; raise on a missing tree or an incomplete run."""
    root = Path(root) if root is not None else data_root()
    if not root.is_dir():
        raise DataError(f"no data tree at {root} (set MEDDDPM_DATA or run `python -m medddpm sweep`)")
    runs, not_runs = [], []
    for gpu in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for folder in sorted(p for p in gpu.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if folder.name in (SCALING_DIR, ABLATION_DIR):
                continue  # data-parallel scaling tables (`scaling`) and the ablation's runs (`ablation_runs`)
            if (folder / "run.parquet").is_file():
                runs.append(folder)
            elif any(folder.glob("*.parquet")):
                raise DataError(f"incomplete run {folder}: parquet files but no run.parquet "
                                "(re-run the sweep for it, or remove the folder)")
            else:
                not_runs.append(folder)
    return Scan(runs, not_runs)


def _read(path: Path, table: str) -> pd.DataFrame:
    try:
        return schema.read_table(path, table)
    except (schema.SchemaError, OSError, ValueError) as e:
        raise DataError(f"{path}: {str(e).splitlines()[0]}") from None


def _read_run(path: Path) -> pd.DataFrame:
    """A run.parquet, validated, with its one row and what differs from its configuration's definition."""
    df = _read(path, "run")
    if len(df) != 1:
        raise DataError(f"{path}: {len(df)} rows, expected 1")
    return df


def runs(root: str | os.PathLike | None = None, *, variants: bool = False) -> pd.DataFrame:
    """The run table of every run (one row each), with its folder relative to the data root.

    `variants`: also the runs of other presets or batches (``<config>@<preset>[-b<batch>]``); every
    page but the memory one compares the main runs only, one per (GPU, configuration)."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for folder in scan(root).runs:
        df = _read_run(folder / "run.parquet")
        slug, config = df.loc[0, "gpu_slug"], df.loc[0, "config"]
        batch = int(df.loc[0, "batch"])  # -1: a run that failed before recording it (older rows), batch 1 then
        name = schema.run_folder(config, df.loc[0, "preset"], batch if batch > 0 else 1)
        if (slug, name) != (folder.parent.name, folder.name):
            raise DataError(f"{folder}: run.parquet says {slug}/{name}, the folder says "
                            f"{folder.parent.name}/{folder.name}")
        if variants or name == config:
            frames.append(df.assign(folder=str(folder.relative_to(root))))
    if not frames:
        return schema.empty("run").assign(folder=pd.Series(dtype="str"))
    out = pd.concat(frames, ignore_index=True)
    dup = out["run_id"][out["run_id"].duplicated()]
    if len(dup):
        raise DataError(f"run_id {dup.iloc[0]} appears in more than one folder")
    return _sort(out)


def ablation_runs(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """The ablation's runs (``data/<gpu>/ablation/<config>/``, written by `python -m medddpm ablation`): ordinary
    runs, validated as the main ones, each in the folder its row names."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for path in sorted(root.glob(f"*/{ABLATION_DIR}/*/run.parquet")):
        df = _read_run(path)
        r, folder = df.iloc[0], path.parent
        name = schema.run_folder(r["config"], r["preset"], max(int(r["batch"]), 1))
        if (r["gpu_slug"], name) != (folder.parent.parent.name, folder.name):
            raise DataError(f"{folder}: run.parquet says {r['gpu_slug']}/{ABLATION_DIR}/{name}")
        frames.append(df.assign(folder=str(folder.relative_to(root))))
    if not frames:
        return schema.empty("run").assign(folder=pd.Series(dtype="str"))
    return _sort(pd.concat(frames, ignore_index=True))


ABLATION_VERDICTS = ("buys", "not told apart", "costs", "failed")


def ablation_summary(ablation: pd.DataFrame, run: pd.DataFrame | None = None, base: str = "best") -> pd.DataFrame:
    """Per GPU and model, what each lever of `base` buys: the ablation's `base` and each `base+<switch>=<value>`
    (`configs.ablation`), with `saved_ms` = that variant's median step minus `base`'s. The noise a lever must beat
    is `noise`: the larger of the two runs' p10-p90 spreads relative to their medians and, where the main runs
    hold `base` on the same GPU and model (`run`), how far that run and the ablation's lie apart. `verdict`: "buys"
    when the variant is slower by more than the noise, "costs" when faster by more, "not told apart" otherwise,
    "failed" when the variant did not finish its timed steps."""
    cols = ["gpu_slug", "preset", "shape", "lever", "config", "status", "message", "base_ms", "median_ms", "p10_ms",
            "p90_ms", "saved_ms", "ratio", "noise", "rerun", "verdict"]
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
                         "median_ms": v.train_median_ms if ok else math.nan,
                         "p10_ms": v.train_p10_ms if ok else math.nan, "p90_ms": v.train_p90_ms if ok else math.nan,
                         "saved_ms": v.train_median_ms - b["train_median_ms"] if ok else math.nan, "ratio": ratio,
                         "noise": noise, "rerun": rerun, "verdict": verdict})
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["gpu_slug", "preset", "saved_ms"], ascending=[True, True, False], ignore_index=True)


def load(table: str, root: str | os.PathLike | None = None, *, variants: bool = False) -> pd.DataFrame:
    """Every ``data/*/*/<table>.parquet`` of the runs, validated, with ``gpu_slug`` and ``config``."""
    if table not in schema.TABLES:
        raise DataError(f"unknown table {table!r}; known: {', '.join(schema.TABLES)}")
    root = Path(root) if root is not None else data_root()
    run = runs(root, variants=variants)
    if table == "run":
        return run
    frames = []
    for folder in run["folder"]:
        path = root / folder / f"{table}.parquet"
        if not path.is_file():
            continue  # a phase that did not run (a CPU has no ncu table; a failed run has few tables)
        df = _read(path, table)
        if not df.empty and not df["run_id"].isin(run["run_id"]).all():
            raise DataError(f"{path}: run_id {df['run_id'].iloc[0]} is not the run of its folder")
        frames.append(df)
    df = pd.concat(frames, ignore_index=True) if frames else schema.empty(table)
    keys = run[["run_id", "gpu_slug", "config"]]
    return df.merge(keys, on="run_id", how="left", validate="many_to_one")


@dataclass
class Data:
    """All tables of all runs (what `claims` and the page summaries take)."""

    run: pd.DataFrame
    steps: pd.DataFrame
    kernels: pd.DataFrame
    ncu: pd.DataFrame
    quality: pd.DataFrame
    bench: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=BENCH_COLUMNS))
    scaling: pd.DataFrame = field(default_factory=lambda: schema.empty("scaling"))

    @property
    def ok(self) -> pd.DataFrame:
        return self.run[self.run["status"] == "ok"]


def load_all(root: str | os.PathLike | None = None) -> Data:
    return Data(**{t: load(t, root) for t in TABLES}, bench=bench_runs(root), scaling=scaling(root))


def scaling(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every ``data/<gpu-slug>/scaling/<config>.parquet`` (`python -m medddpm scale`), validated."""
    root = Path(root) if root is not None else data_root()
    frames = []
    for path in sorted(root.glob(f"*/{SCALING_DIR}/*.parquet")):
        df = _read(path, "scaling")
        if not df.empty and not ((df["gpu_slug"] == path.parent.parent.name) & (df["config"] == path.stem)).all():
            raise DataError(f"{path}: rows of another GPU or configuration than its path says")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else schema.empty("scaling")


def scaling_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, configuration and world size: the step time (each step as long as its slowest rank,
    then the median over timed steps), global throughput, and efficiency against world size 1
    (throughput / (world size x throughput on one rank); NaN without a one-rank run)."""
    cols = ["gpu_slug", "config", "backend", "world_size", "step_ms", "rank_min_ms", "rank_max_ms",
            "samples_per_s", "ideal_samples_per_s", "efficiency"]
    t = df[df["timed"]]
    if t.empty:
        return pd.DataFrame(columns=cols)
    keys = ["gpu_slug", "config", "backend", "world_size"]
    step = t.groupby([*keys, "step"])["time_ms"].max().groupby(keys).median().rename("step_ms")
    per_rank = t.groupby([*keys, "rank"])["time_ms"].median().groupby(keys).agg(rank_min_ms="min", rank_max_ms="max")
    batch = t.groupby(keys)["batch"].first()
    out = pd.concat([step, per_rank, batch], axis=1).reset_index()
    out["samples_per_s"] = out["world_size"] * out["batch"] / (out["step_ms"] / 1e3)
    one = out[out["world_size"] == 1].set_index(["gpu_slug", "config"])["samples_per_s"]
    base = pd.Series([one.get((g, c), math.nan) for g, c in zip(out["gpu_slug"], out["config"])], index=out.index)
    out["ideal_samples_per_s"] = base * out["world_size"]
    out["efficiency"] = out["samples_per_s"] / out["ideal_samples_per_s"]
    return _sort(out[cols], "world_size")


BENCH_COLUMNS = ["gpu_slug", "source", "phase", "config", "implementation", "median_ms", "p10_ms", "p90_ms", "steps",
                 "peak_mem_gib", "fp32_math", "git_commit", "torch", "cudnn", "time_utc", "size", "mask_channels",
                 "base_channels"]
BENCH_PHASES = ("train", "sample")


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from None


def bench_runs(root: str | os.PathLike | None = None, *, phase: str | None = "train") -> pd.DataFrame:
    """Raw `python -m medddpm bench` timings (JSON) kept in folders that are not runs.

    These come before the measurement pipeline (no kernels, counters or quality): the book shows them
    apart and uses them for timing claims only where a GPU has no sweep yet. `phase`: "train" (a
    micro-step, the default), "sample" (a denoising step) or None for both; a file written before the
    bench recorded its phase is a sampling one if its runs carry `sample_s` (`sample_total_s` before)."""
    if phase is not None and phase not in BENCH_PHASES:
        raise ValueError(f"phase must be one of {BENCH_PHASES} or None, got {phase!r}")
    cols = BENCH_COLUMNS
    root = Path(root) if root is not None else data_root()
    rows = []
    for folder in scan(root).not_runs:
        for path in sorted(folder.glob("*.json")):
            doc = _json(path)
            if not isinstance(doc, dict) or "runs" not in doc:
                continue
            env, spec = doc.get("environment", {}), doc.get("spec", {})
            bad = [k for r in doc["runs"] for k in ("config", "median_ms", "p10_ms", "p90_ms", "step_ms",
                                                      "peak_mem_bytes") if k not in r]
            if bad:
                raise DataError(f"{path}: a bench run lacks {sorted(set(bad))}")
            for r in doc["runs"]:
                name = r["config"]
                ref = name.startswith("reference-")
                kind = doc.get("phase", "sample" if {"sample_s", "sample_total_s"} & set(r) else "train")
                if phase is not None and kind != phase:
                    continue
                rows.append({
                    "gpu_slug": folder.parent.name, "source": str(path.relative_to(root)), "phase": kind,
                    "config": {"reference-fp32": "baseline", "reference-tf32": "opt1"}.get(name, name),
                    "implementation": "reference (mobaidoctor/med-ddpm)" if ref else "ours",
                    "median_ms": r["median_ms"], "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"],
                    "steps": len(r["step_ms"]), "peak_mem_gib": r["peak_mem_bytes"] / 2**30,
                    "fp32_math": r.get("backend_flags", {}).get("cudnn_conv_fp32_precision", ""),
                    "git_commit": env.get("git_commit", ""), "torch": env.get("torch", ""),
                    "cudnn": str(env.get("cudnn", "")),
                    "time_utc": env.get("time_utc", ""), "size": spec.get("size"),
                    "mask_channels": spec.get("mask_channels"), "base_channels": spec.get("base_channels"),
                })
    return _sort(pd.DataFrame(rows, columns=cols), "implementation", "source")


# ------------------------------------------------------------------------------------- summaries


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


def gpu_busy(data: Data) -> pd.DataFrame:
    """Per finished run with a kernel table: the device time of its kernels and copies in one step
    (torch.profiler, profiled steps) beside the step's median time; `busy` is their ratio. Near 1 the
    device never waits for the host, so a CUDA graph has no launch gap to close. The host's time to
    issue a step (`dispatch_median_ms`) cannot tell that when steps run back to back: once the launch
    queue is full the host waits for the device, and issues a step in the device's time. `busy` can
    pass 1 a little where kernels overlap, or where the profiled steps ran slower than the timed ones."""
    cols = ["gpu_slug", "device", "config", "train_median_ms", "dispatch_median_ms", "kernel_ms", "busy"]
    k = data.kernels
    ok = data.run[(data.run["status"] == "ok") & data.run["run_id"].isin(k["run_id"])].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    per_step = k.groupby("run_id")["total_us"].sum() / k.groupby("run_id")["steps"].max() / 1e3
    ok["device"], ok["kernel_ms"] = device_label(ok), ok["run_id"].map(per_step)
    return _sort(ok.assign(busy=ok["kernel_ms"] / ok["train_median_ms"])[cols])


def speedups(run: pd.DataFrame) -> pd.DataFrame:
    """Speedup of each configuration over the baseline of the same GPU (GPUs with a baseline only)."""
    s = step_summary(run)
    return s[s["speedup"].notna()][["gpu_slug", "device", "config", "train_median_ms", "speedup"]].reset_index(drop=True)


def _shares_by(kernels: pd.DataFrame, field: str) -> pd.DataFrame:
    """Share of profiled kernel time per (GPU, configuration, `field`); sums to 1 per run."""
    if kernels.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", field, "share", "us_per_step"])
    k = kernels.assign(us_per_step=kernels["total_us"] / kernels["steps"].clip(lower=1))
    g = k.groupby(["gpu_slug", "config", field], as_index=False)[["total_us", "us_per_step"]].sum()
    g["share"] = g["total_us"] / g.groupby(["gpu_slug", "config"])["total_us"].transform("sum")
    return _sort(g.drop(columns="total_us"), field)


def category_shares(kernels: pd.DataFrame) -> pd.DataFrame:
    """Share of profiled kernel time per kernel category (convolution, element-wise, layout, ...)."""
    return _shares_by(kernels, "category")


def pass_split(kernels: pd.DataFrame) -> pd.DataFrame:
    """Share of profiled kernel time per pass (forward / backward / optimizer / graph / other)."""
    return _shares_by(kernels, "pass")


def top_kernels(kernels: pd.DataFrame, n: int = 12) -> pd.DataFrame:
    """The n largest kernels of each run (passes added up), with what a tooltip needs."""
    cols = ["gpu_slug", "config", "rank", "short_name", "kernel", "category", "passes", "calls_per_step",
            "us_per_step", "share", "tensor_cores"]
    if kernels.empty:
        return pd.DataFrame(columns=cols)
    k = kernels.assign(us=kernels["total_us"] / kernels["steps"].clip(lower=1),
                       cps=kernels["calls"] / kernels["steps"].clip(lower=1))
    g = (k.groupby(["gpu_slug", "config", "kernel"], as_index=False)
         .agg(short_name=("short_name", "first"), category=("category", "first"),
              passes=("pass", lambda s: ", ".join(sorted(set(s)))), calls_per_step=("cps", "sum"),
              us_per_step=("us", "sum"), share=("share", "sum"), tensor_cores=("tensor_cores", "any")))
    g = g.sort_values(["gpu_slug", "config", "us_per_step"], ascending=[True, True, False])
    g["rank"] = g.groupby(["gpu_slug", "config"]).cumcount() + 1
    g = g[g["rank"] <= n].copy()
    g["kernel"] = g["kernel"].str.slice(0, 240)  # tooltips; the full names stay in kernels.parquet
    return _sort(g[cols], "rank")


UNRECORDED_OP = "(not recorded: a graph replay, or a run from before operators were recorded)"


def launching_ops(kernels: pd.DataFrame, *, category: str = "layout", n: int = 5) -> pd.DataFrame:
    """Per run, the operators that launched the kernels of one category, by time per step: the n
    largest, with their share of the category's time in that run (who makes the layout copies)."""
    cols = ["gpu_slug", "config", "rank", "op", "calls_per_step", "us_per_step", "share"]
    k = kernels[kernels["category"] == category] if len(kernels) else kernels
    if k.empty:
        return pd.DataFrame(columns=cols)
    k = k.assign(op=k["op"].where(k["op"] != "", UNRECORDED_OP),
                 us=k["total_us"] / k["steps"].clip(lower=1), cps=k["calls"] / k["steps"].clip(lower=1))
    g = k.groupby(["gpu_slug", "config", "op"], as_index=False).agg(calls_per_step=("cps", "sum"),
                                                                     us_per_step=("us", "sum"))
    g["share"] = g["us_per_step"] / g.groupby(["gpu_slug", "config"])["us_per_step"].transform("sum")
    g = g.sort_values(["gpu_slug", "config", "us_per_step", "op"], ascending=[True, True, False, True])
    g["rank"] = g.groupby(["gpu_slug", "config"]).cumcount() + 1
    return _sort(g[g["rank"] <= n][cols], "rank")


def step_curves(steps: pd.DataFrame, phase: str = "train") -> pd.DataFrame:
    """Per-step times of one phase (small: tens of rows a run), for spread charts."""
    s = steps[steps["phase"] == phase]
    return _sort(s[["gpu_slug", "config", "step", "timed", "time_ms"]], "step")


# ----------------------------------------------------------------------------------- ncu summaries

_WEIGHTED = ("tensor_pipe_pct", "sm_throughput_pct", "memory_throughput_pct", "dram_throughput_pct", "l1_hit_pct",
             "l2_hit_pct", "achieved_occupancy_pct")


def ncu_kernels(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """`medddpm.ncu.kernel_summary` for every run, with gpu_slug and config."""
    from . import ncu

    if ncu_df.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "kernel_id", "kernel", "duration_ns", *_WEIGHTED])
    parts = []
    for (run_id, slug, config), g in ncu_df.groupby(["run_id", "gpu_slug", "config"]):
        parts.append(ncu.kernel_summary(g.drop(columns=["gpu_slug", "config"])).assign(
            run_id=run_id, gpu_slug=slug, config=config))
    return _sort(pd.concat(parts, ignore_index=True), "kernel_id")


def ncu_by_run(ncu_df: pd.DataFrame, kernels: pd.DataFrame) -> pd.DataFrame:
    """Per run, its step as the counters see it (`medddpm.layers.step_weighted`): utilizations, hit rates and
    stalls of each kernel weighted by the kernel's share of the step (torch.profiler), not by the launches
    that happened to be profiled; executed thread instructions by class per step (each kernel's count per
    launch times its launches a step); `covered`, the share of the step whose kernels have counters."""
    from . import layers, ncu

    stalls = [f"stall_{r}" for r in ncu.STALL_REASONS]
    insts = [f"inst_{c}" for c in ncu.INST_CLASSES]
    rows = []
    for (run_id, slug, config), g in ncu_df.groupby(["run_id", "gpu_slug", "config"]) if not ncu_df.empty else ():
        k = kernels[kernels["run_id"] == run_id]
        s = layers.step_weighted(k, g.drop(columns=["gpu_slug", "config"]), rates=(*_WEIGHTED, *stalls), counts=insts)
        row = {"gpu_slug": slug, "config": config, "kernels": int(g["kernel_id"].nunique()), **s}
        row |= {c: row.pop(f"{c}_per_step") for c in insts}
        row["inst_total"] = pd.Series([row[c] for c in insts]).sum(min_count=1)
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=["gpu_slug", "config"])
    return _sort(pd.DataFrame(rows))


def ncu_coverage(data: Data) -> pd.DataFrame:
    """Per run with counters: the share of step time (torch.profiler) of the kernels chosen for ncu,
    and of those it actually profiled. They differ when a chosen kernel never ran under ncu (cuDNN's
    autotuner can pick other algorithms there): the counters stand for the second share only. The
    chosen share is the one the run recorded (runs before session 8 aimed at 80%)."""
    from . import ncu

    aimed = {r["run_id"]: json.loads(r["profilers"] or "{}").get("ncu", {}).get("coverage", math.nan)
             for r in data.run[["run_id", "profilers"]].to_dict("records")}
    rows = []
    for run_id, g in data.ncu.groupby("run_id"):
        k = data.kernels[data.kernels["run_id"] == run_id]
        if k.empty:
            continue
        rows.append({"gpu_slug": g["gpu_slug"].iloc[0], "config": g["config"].iloc[0],
                     "selected": aimed.get(run_id, math.nan), "profiled": ncu.profiled_coverage(k, g),
                     "launches": g["kernel_id"].nunique()})
    return _sort(pd.DataFrame(rows, columns=["gpu_slug", "config", "selected", "profiled", "launches"]))


def uncounted_runs(data: Data) -> pd.DataFrame:
    """GPU runs measured (status ok) that have no counters at all: `ncu_coverage` cannot list them."""
    r = data.run
    r = r[(r["gpu_name"] != "cpu") & (r["status"] == "ok") & ~r["run_id"].isin(data.ncu["run_id"])]
    return _sort(r[["gpu_slug", "config"]].reset_index(drop=True))


def roofline_points(ncu_df: pd.DataFrame) -> pd.DataFrame:
    """Per profiled kernel of each run: arithmetic intensity (FLOP per DRAM byte) and achieved FLOP/s of
    all its profiled launches together (their FLOPs over their bytes and over their time; `launches`),
    so that a run profiled launch by launch (the library pass) draws as many points as kernels.

    FLOPs come from ncu's FP32/FP16/FP64 thread-instruction counts (an FMA is two), which do not see
    tensor-core (HMMA/GMMA) math: tensor-core kernels are drawn with what the SASS counters see."""
    cols = ["gpu_slug", "config", "kernel", "launches", "duration_ns", "flops", "bytes", "intensity", "flops_per_s",
            "tensor_pipe_pct"]
    k = ncu_kernels(ncu_df)
    if k.empty or "flop_fp32" not in k:
        return pd.DataFrame(columns=cols)
    k = k.copy()
    k["flops"] = k[["flop_fp32", "flop_fp16", "flop_fp64"]].sum(axis=1, min_count=1)
    k["bytes"] = k["dram_bytes_per_s"] * k["duration_ns"] / 1e9
    k = k[(k["flops"] > 0) & (k["bytes"] > 0) & (k["duration_ns"] > 0)]
    k["pipe_ns"] = k["tensor_pipe_pct"] * k["duration_ns"]
    k["piped_ns"] = k["duration_ns"].where(k["tensor_pipe_pct"].notna())
    g = k.groupby(["gpu_slug", "config", "kernel"], as_index=False, sort=False).agg(
        launches=("kernel_id", "size"), duration_ns=("duration_ns", "sum"), flops=("flops", "sum"),
        bytes=("bytes", "sum"), pipe_ns=("pipe_ns", "sum"), piped_ns=("piped_ns", "sum"))
    g["intensity"] = g["flops"] / g["bytes"]
    g["flops_per_s"] = g["flops"] / (g["duration_ns"] / 1e9)
    # duration-weighted over the launches ncu gave it for; NaN where it gave none
    g["tensor_pipe_pct"] = g["pipe_ns"] / g["piped_ns"].where(g["piped_ns"] > 0)
    g["kernel"] = g["kernel"].str.slice(0, 160)  # a label: kernels are told apart by their whole names above
    return g[cols]


def ncu_priorities(data: Data, n: int = 10) -> pd.DataFrame:
    """`medddpm.ncu.priorities` per run (share of step x a rule's estimated global speedup), top n each."""
    from . import ncu

    if data.ncu.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "kernel", "rule", "section", "share", "speedup_pct",
                                     "priority"])
    parts = []
    for (run_id, slug, config), g in data.ncu.groupby(["run_id", "gpu_slug", "config"]):
        k = data.kernels[data.kernels["run_id"] == run_id]
        p = ncu.priorities(k, g.drop(columns=["gpu_slug", "config"])).head(n)
        parts.append(p.assign(gpu_slug=slug, config=config))
    out = pd.concat(parts, ignore_index=True)
    out["kernel"] = out["kernel"].str.slice(0, 160)
    return _sort(out, "priority")


# -------------------------------------------------------------------------------------- checks


def check_speedups(df: pd.DataFrame) -> None:
    s = df["speedup"]
    bad = df[~(np.isfinite(s) & (s > 0))]
    assert bad.empty, f"speedups must be positive and finite: {bad[['gpu_slug', 'config', 'speedup']].to_dict('records')}"


def check_strict_baseline(data: Data) -> None:
    """The FP32 baseline ran no TF32 tensor-core kernel and read back strict FP32 math modes."""
    k = data.kernels
    tc = k[(k["config"] == "baseline") & (k["device_type"] == "cuda") & k["tensor_cores"]]
    assert tc.empty, f"baseline ran tensor-core kernels: {tc['short_name'].unique()[:5].tolist()}"
    for _, r in data.run[(data.run["config"] == "baseline") & (data.run["status"] == "ok")].iterrows():
        flags = json.loads(r["backend_flags"] or "{}")
        assert all(v == "ieee" for v in flags.values()), f"{r['run_id']}: baseline math modes {flags}"


def check_shares(kernels: pd.DataFrame) -> None:
    if kernels.empty:
        return
    tot = kernels.groupby("run_id")["share"].sum()
    assert np.allclose(tot, 1.0, atol=1e-3), f"kernel shares do not sum to 1: {tot[~np.isclose(tot, 1, atol=1e-3)]}"


def check_medians(data: Data) -> None:
    """run.parquet's median equals the median of the timed training steps in steps.parquet."""
    s = data.steps[(data.steps["phase"] == "train") & data.steps["timed"]]
    med = s.groupby("run_id")["time_ms"].median()
    r = data.ok.set_index("run_id")["train_median_ms"]
    both = r.index.intersection(med.index)
    assert np.allclose(r[both], med[both], rtol=1e-6), "run medians differ from the step table"


# ------------------------------------------------------------------------------------ quality


def quality_summary(data: Data) -> pd.DataFrame:
    """Per run: forward relative error and mean relative loss difference against strict FP32."""
    q = data.quality
    if q.empty:
        return pd.DataFrame(columns=["gpu_slug", "config", "rel_err", "loss_diff", "precision_used"])
    g = q.groupby(["gpu_slug", "config"], as_index=False).apply(
        lambda d: pd.Series({"rel_err": d["rel_err"].iloc[0],
                             "loss_diff": (d["loss"] - d["baseline_loss"]).abs().mean() / d["baseline_loss"].abs().mean()}),
        include_groups=False)
    pu = data.run.set_index(["gpu_slug", "config"])["precision_used"]
    g["precision_used"] = [pu.get((s, c), "") for s, c in zip(g["gpu_slug"], g["config"])]
    return _sort(g)


# ------------------------------------------------------------------------------------ floors


def floors(run: pd.DataFrame, bench: pd.DataFrame | None = None, bench_flops: float | None = None) -> pd.DataFrame:
    """Per GPU and precision with a known peak: the shortest possible micro-step (FLOPs per step / peak)
    beside the fastest configuration that ran in that precision. GPUs with no sweep use their bench
    timings when `bench_flops` (the FLOPs of the bench's micro-step) is given."""
    s = step_summary(run)[["gpu_slug", "config", "precision_used", "train_median_ms", "flops_per_step"]]
    s = s.assign(timing_source="sweep")
    if bench is not None and not bench.empty and bench_flops:
        ours = bench[(bench["implementation"] == "ours") & ~bench["gpu_slug"].isin(s["gpu_slug"])
                     & bench["config"].isin(list(CONFIGS))]
        b = ours.groupby(["gpu_slug", "config"], as_index=False)["median_ms"].median()
        b = b.assign(precision_used=b["config"].map(lambda c: CONFIGS[c].precision), flops_per_step=bench_flops,
                     timing_source="bench JSON").rename(columns={"median_ms": "train_median_ms"})
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


# ------------------------------------------------------------------------------------- memory

GPU_MEMORY_GB = (16, 24, 40, 48, 80, 141)  # the card sizes the memory page answers for
# Kept free on every card: what a driver reports is a few percent under the size a card is sold with
# (ECC, firmware), and the caching allocator needs slack for fragmentation. An input, not a result.
HEADROOM = 0.05
# What does not grow with the batch, for a run measured at one batch only: FP32 weights, their
# gradients and Adam's two moments, 4 bytes each per parameter. (Static inputs, cuDNN workspaces and
# the like are then counted as per-sample: the largest batch is underestimated, never overestimated.)
STATE_BYTES_PER_PARAM = 16
MEMORY_SWITCHES = ("checkpointing", "precision", "recompute_attention")  # switches that trade time for memory
FIT_VERDICTS = ("fits", "tight", "does not fit")
_GIB = 2**30


def model_label(run: pd.DataFrame) -> pd.Series:
    """'paper 128x128x128' / 'brats 192x192x144': the model and input a memory figure belongs to."""
    return run["preset"] + " " + run["shape"]


def memory_runs(run: pd.DataFrame) -> pd.DataFrame:
    """Finished runs with a measured device peak (not a CPU's), one row each, sizes in GiB."""
    cols = ["gpu_slug", "model", "preset", "shape", "batch", "config", "label", "checkpointing", "precision_used",
            "compile", "cuda_graphs", "parameters", "peak_gib", "reserved_gib", "other_gib", "total_gib",
            "sample_peak_gib", "train_median_ms", "folder"]
    ok = run[(run["status"] == "ok") & (run["peak_mem_bytes"] >= 0)].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok["model"] = model_label(ok)
    ok["label"] = ok["config"] + np.where(ok["batch"] == 1, "", " (batch " + ok["batch"].astype(str) + ")")

    def gib(col):
        return ok[col].where(ok[col] >= 0) / _GIB

    ok = ok.assign(peak_gib=gib("peak_mem_bytes"), reserved_gib=gib("peak_reserved_bytes"), other_gib=gib("gpu_other_bytes"),
                   total_gib=gib("gpu_total_bytes"), sample_peak_gib=gib("sample_peak_mem_bytes"))
    return _sort(ok[cols], "model", "batch")


def memory_model(mem: pd.DataFrame) -> pd.DataFrame:
    """Per (GPU, model, configuration): peak allocated memory as fixed + batch x per_sample (GiB).

    With runs at two or more batches, a least-squares line through the measured peaks. With one batch
    only, an estimate: the fixed part is the training state (`STATE_BYTES_PER_PARAM` per parameter)
    and the rest is taken to grow with the batch. `other_gib` is the device memory outside PyTorch's
    allocator (CUDA context, libraries) as measured on these runs, else on that GPU; NaN where never
    measured. The `method` column says which."""
    cols = ["gpu_slug", "model", "config", "batches", "fixed_gib", "per_sample_gib", "other_gib", "peak1_gib",
            "reserved1_gib", "train_median_ms", "method", "checkpointing"]
    rows = []
    gpu_other = mem.groupby("gpu_slug")["other_gib"].max() if len(mem) else pd.Series(dtype=float)
    for (slug, model, config), g in mem.groupby(["gpu_slug", "model", "config"], sort=False):
        pts = g.groupby("batch")["peak_gib"].max()
        batches = [int(b) for b in pts.index]
        if len(pts) >= 2:
            per_sample, fixed = np.polyfit(pts.index.to_numpy(float), pts.to_numpy(float), 1)
            method = f"line through the peaks measured at batch {', '.join(map(str, batches))}"
        else:
            b = batches[0]
            fixed = g["parameters"].iloc[0] * STATE_BYTES_PER_PARAM / _GIB
            per_sample = (pts.iloc[0] - fixed) / b
            method = (f"estimate from batch {b} alone: {STATE_BYTES_PER_PARAM} bytes per parameter fixed "
                      "(weights, gradients, Adam), the rest per sample")
        other = g["other_gib"].max()
        if pd.isna(other):
            other = gpu_other.get(slug, math.nan)
            method += "; memory outside the allocator " + ("as measured on other runs of this GPU"
                                                            if pd.notna(other) else "not measured")
        one = g[g["batch"] == 1]
        rows.append({"gpu_slug": slug, "model": model, "config": config, "batches": ", ".join(map(str, batches)),
                     "fixed_gib": float(fixed), "per_sample_gib": float(per_sample), "other_gib": other,
                     "peak1_gib": one["peak_gib"].iloc[0] if len(one) else fixed + per_sample,
                     "reserved1_gib": one["reserved_gib"].iloc[0] if len(one) else math.nan,
                     "train_median_ms": one["train_median_ms"].iloc[0] if len(one) else math.nan,
                     "method": method, "checkpointing": bool(g["checkpointing"].iloc[0])})
    return _sort(pd.DataFrame(rows, columns=cols), "model")


def fits(model: pd.DataFrame, sizes_gb=GPU_MEMORY_GB, *, headroom: float = HEADROOM) -> pd.DataFrame:
    """Per (GPU measured on, model, configuration, card size): whether batch 1 trains, and the largest batch.

    A card of C GB is taken to hold C GiB. Need at batch b = fixed + b x per_sample + memory outside the
    allocator (0 where never measured). Batch 1 *fits* when its need leaves `headroom` of the card free
    and the allocator's measured reserved peak fits too; it is *tight* when only the bare need fits (it
    may run, with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, or fail on fragmentation); else it
    *does not fit*. The largest batch keeps the headroom."""
    cols = ["gpu_slug", "model", "config", "card_gb", "card", "verdict", "need1_gib", "largest_batch", "per_sample_gib",
            "method", "checkpointing", "train_median_ms"]
    rows = []
    for r in model.itertuples():
        other = 0.0 if pd.isna(r.other_gib) else r.other_gib
        need1 = r.peak1_gib + other
        for c in sizes_gb:
            usable = c * (1 - headroom)
            reserved_ok = pd.isna(r.reserved1_gib) or r.reserved1_gib + other <= c
            verdict = FIT_VERDICTS[0] if need1 <= usable and reserved_ok else FIT_VERDICTS[1] if need1 <= c else FIT_VERDICTS[2]
            largest = (math.floor((usable - other - r.fixed_gib) / r.per_sample_gib)
                       if r.per_sample_gib > 0 else math.nan)
            rows.append({"gpu_slug": r.gpu_slug, "model": r.model, "config": r.config, "card_gb": c, "card": f"{c} GB",
                         "verdict": verdict, "need1_gib": need1, "largest_batch": max(largest, 0) if pd.notna(largest) else largest,
                         "per_sample_gib": r.per_sample_gib, "method": r.method, "checkpointing": r.checkpointing,
                         "train_median_ms": r.train_median_ms})
    return _sort(pd.DataFrame(rows, columns=cols), "model", "card_gb")


def _flag_columns() -> list[str]:
    from .configs import Config

    return [f for f in Config.__dataclass_fields__ if f not in ("name", "description")]


def _saves_memory(switch: str, off, on) -> bool:
    """Is going from `off` to `on` the memory-saving direction of `switch`?"""
    if switch == "precision":
        return on == "bf16" and off != "bf16"
    return bool(on) and not bool(off)


def switch_costs(run: pd.DataFrame, switches=MEMORY_SWITCHES) -> pd.DataFrame:
    """Each pair of finished runs on the same GPU, model and batch whose switches differ in exactly one
    memory-saving switch: its time cost (on / off step time) and the peak memory it saves (NaN on a CPU)."""
    cols = ["gpu_slug", "model", "batch", "switch", "change", "config_off", "config_on", "time_off_ms", "time_on_ms",
            "time_ratio", "peak_off_gib", "peak_on_gib", "saved_gib", "saved_frac"]
    ok = run[run["status"] == "ok"].copy()
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok["model"] = model_label(ok)
    flags = _flag_columns()
    rows = []
    for (slug, model, batch), g in ok.groupby(["gpu_slug", "model", "batch"], sort=False):
        recs = g.to_dict("records")
        for a in recs:
            for b in recs:
                diff = [f for f in flags if a[f] != b[f]]
                if len(diff) != 1 or diff[0] not in switches or not _saves_memory(diff[0], a[diff[0]], b[diff[0]]):
                    continue
                sw = diff[0]
                peak = [x["peak_mem_bytes"] / _GIB if x["peak_mem_bytes"] >= 0 else math.nan for x in (a, b)]
                rows.append({"gpu_slug": slug, "model": model, "batch": int(batch), "switch": sw,
                             "change": f"{sw}: {a[sw]} -> {b[sw]}", "config_off": a["config"], "config_on": b["config"],
                             "time_off_ms": a["train_median_ms"], "time_on_ms": b["train_median_ms"],
                             "time_ratio": b["train_median_ms"] / a["train_median_ms"], "peak_off_gib": peak[0],
                             "peak_on_gib": peak[1], "saved_gib": peak[0] - peak[1],
                             "saved_frac": (peak[0] - peak[1]) / peak[0] if peak[0] > 0 else math.nan})
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["gpu_slug", "model", "switch", "config_off"], ignore_index=True) if len(out) else out


@dataclass(frozen=True)
class MemoryTarget:
    id: str
    text: str
    shape: str  # input the target is about
    preset: str
    max_gib: float  # peak allocated at batch 1
    checkpointing_only: bool = False


MEMORY_TARGETS = [
    MemoryTarget("head-8", "Whole-head 128³ training in 8 GiB or less, with the fastest configuration that fits",
                 "128x128x128", "paper", 8.0),
    MemoryTarget("head-4-ckpt", "Whole-head 128³ training in 4 GiB or less with activation checkpointing",
                 "128x128x128", "paper", 4.0, checkpointing_only=True),
    MemoryTarget("brats-40", "BraTS-size training at batch 1 in 40 GiB or less (an A100 40 GB, every 80 GB card)",
                 "192x192x144", "brats", 40.0),
]


def memory_targets(mem: pd.DataFrame, targets=MEMORY_TARGETS, *, configs=tuple(CONFIGS.values())) -> pd.DataFrame:
    """Each target on each GPU with peaks: holds / does not hold / not met by the runs so far / not
    measured yet, with the numbers. The configuration reported is the fastest whose measured peak
    allocated (batch 1) meets the target. A target none meets *does not hold* only once every one of
    `configs` (those with checkpointing, for a checkpointing target) has been measured."""
    cols = ["target_id", "target", "gpu_slug", "verdict", "config", "peak_gib", "train_median_ms", "evidence"]
    rows = []
    for slug in sorted(mem["gpu_slug"].unique()) if len(mem) else []:
        for t in targets:
            g = mem[(mem["gpu_slug"] == slug) & (mem["preset"] == t.preset) & (mem["shape"] == t.shape)
                    & (mem["batch"] == 1)]
            if t.checkpointing_only:
                g = g[g["checkpointing"]]
            row = {"target_id": t.id, "target": t.text, "gpu_slug": slug, "config": "", "peak_gib": math.nan,
                   "train_median_ms": math.nan}
            if g.empty:
                what = "no checkpointed run" if t.checkpointing_only else "no run"
                rows.append(row | {"verdict": NOT_MEASURED, "evidence": f"{what} of the {t.preset} preset at batch 1 "
                                                                        "with a measured peak on this GPU"})
                continue
            measured = f" (of {len(g)} measured: {', '.join(g['config'])})"
            under = g[g["peak_gib"] <= t.max_gib]
            if under.empty:
                low = g.loc[g["peak_gib"].idxmin()]
                missing = [c.name for c in configs if c.name not in set(g["config"])
                           and (c.checkpointing or not t.checkpointing_only)]
                rows.append(row | {"verdict": NOT_YET if missing else FAILS, "config": low["config"],
                                   "peak_gib": low["peak_gib"], "train_median_ms": low["train_median_ms"],
                                   "evidence": f"the lowest peak, {low['label']}'s, is {low['peak_gib']:.2f} GiB"
                                               + measured + (f"; not measured: {', '.join(missing)}" if missing else "")})
                continue
            best = under.loc[under["train_median_ms"].idxmin()]
            fastest = g.loc[g["train_median_ms"].idxmin()]
            note = ("" if fastest["config"] == best["config"] else
                    f"; the fastest overall, {fastest['label']}, needs {fastest['peak_gib']:.2f} GiB")
            rows.append(row | {"verdict": HOLDS, "config": best["config"], "peak_gib": best["peak_gib"],
                               "train_median_ms": best["train_median_ms"],
                               "evidence": f"{best['label']}: {best['peak_gib']:.2f} GiB at {best['train_median_ms']:.4g} "
                                           f"ms a micro-step{note}" + measured})
    return pd.DataFrame(rows, columns=cols)


def check_memory(mem: pd.DataFrame) -> None:
    """Measured peaks are sane: positive, reserved at least allocated, under the card's own size."""
    if mem.empty:
        return
    assert (mem["peak_gib"] > 0).all(), "a non-positive peak"
    r = mem.dropna(subset=["reserved_gib"])
    assert (r["reserved_gib"] >= r["peak_gib"] * 0.999).all(), "reserved below allocated"
    t = mem.dropna(subset=["total_gib"])
    assert (t["peak_gib"] <= t["total_gib"]).all(), "a peak larger than the device"


def counted_models(presets=("paper", "brats")) -> pd.DataFrame:
    """The models of the measurement presets, counted on the meta device (no GPU, nothing measured):
    parameters, forward FLOPs, training state, and FP32 activations kept for backward without and with
    activation checkpointing."""
    from .flops import count, saved_activation_bytes
    from .measure import get_preset
    from .model import format_size

    rows = []
    for name in presets:
        preset = get_preset(name)
        spec = preset.spec()
        info = count(spec, backward=False)
        rows.append({"preset": name, "model": f"{name} {'x'.join(map(str, spec.shape))}", "input": format_size(spec.size),
                     "channels_in": spec.in_channels, "channels_out": spec.image_channels,
                     "res_blocks": spec.num_res_blocks, "parameters": info["parameters"],
                     "forward_tflop": info["forward_flops"] / 1e12,
                     "state_gib": info["parameters"] * STATE_BYTES_PER_PARAM / _GIB,
                     "activations_gib": saved_activation_bytes(spec) / _GIB,
                     "activations_ckpt_gib": saved_activation_bytes(spec, checkpointing=True) / _GIB,
                     "description": preset.description})
    return pd.DataFrame(rows)


COMPILED_SAVED = ("best", "best-ckpt", "best-ckpt+group_norm=fused")


def compiled_saved(preset: str = "paper", configs=COMPILED_SAVED, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """What each compiled configuration's training step keeps for its backward, from AOTAutograd's
    partition traced at full size on the CPU and stored in ``data/partition.parquet`` (`partition.record`;
    counted, not measured), one row per configuration and tracing torch version: the activations in GiB,
    how much of it is float32, the largest shapes, and `current` (traced under today's definition)."""
    from .partition import TABLE_FILE

    path = (Path(root) if root is not None else data_root()) / TABLE_FILE
    if not path.is_file():
        raise DataError(f"missing data file {path}: record it with `python -m medddpm saved --preset {preset} "
                        f"--configs {','.join(configs)} --write`")
    table = _read(path, "partition")
    table = table[(table["preset"] == preset) & table["config"].isin(configs)].copy()
    missing = [c for c in configs if c not in set(table["config"])]
    if missing:
        raise DataError(f"{path}: no {preset} trace of {', '.join(missing)} (`python -m medddpm saved --preset "
                        f"{preset} --configs {','.join(missing)} --write`)")
    # a switch that came after the trace had the value it was added with (schema.ADDED), as for a run's row
    before = {k: v for k, v in schema.ADDED["run"].items() if k in get_config("baseline").flags}
    table["current"] = [all((before | json.loads(s)).get(k) == v for k, v in get_config(c).flags.items())
                        for s, c in zip(table["switches"], table["config"])]
    table["activations_gib"] = table["activation_bytes"] / _GIB
    table["float32_gib"] = table["float32_bytes"] / _GIB
    order = {c: i for i, c in enumerate(configs)}  # the configurations as asked, each one's torch versions together
    return (table.assign(_order=table["config"].map(order)).sort_values(["_order", "torch"], ignore_index=True)
            .drop(columns="_order"))
