"""Nsight Compute counters for a run already measured: `python -m medddpm counters data/<gpu>/<run>`.

A sweep profiles with ncu last, in what is left of its time, so a slow configuration can end with
counters for only part of its step (or none). Counting again needs no new timing: ncu runs its own
process (`medddpm.measure.profile.capture`) anyway, and the kernels to profile come from the run's `kernels.parquet`.
The new `ncu.parquet` replaces the old one only when it covers at least as much of the step (or
with `force`), and the run row's `profilers` entry for ncu records the commit and time of the pass.
With `merge`, the new launches are added to the run's counters instead (e.g. a library pass over a
run whose counters came from one pass that missed cuDNN's launches: see `medddpm.measure.profile.ncu.PASSES`); the
entry then keeps the one before it under "merged". A merge profiles only what the run's counters lack:
the kernels they do not cover, and the library launches after those their library passes reached, so
that counters too slow for one lease add up over several.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import torch

from medddpm.errors import UserError
from medddpm.store import schema
from medddpm.store.layout import NCU_REPORTS, RUN_FILE, is_run, run_table
from medddpm.configs import mismatch
from medddpm.measure.env import device_name, git_commit, gpu_slug
from medddpm.model.unet import format_size, parse_size
from medddpm.analysis.ncu_table import COVERAGE, join_launches, profiled_coverage
from medddpm.measure.profile.ncu import PASSES, library_launches_done, run_ncu


class CountersError(UserError):
    """A run folder that cannot be given counters here (one line, before any GPU work)."""


def check_run(run_dir: str | Path, *, device: torch.device | str = "cuda"):
    """The run's row, if `run_dir` is a finished run of this device's GPU under its configuration's
    current switches; else CountersError."""
    run_dir = Path(run_dir)
    if not is_run(run_dir):
        raise CountersError(f"{run_dir}: no {RUN_FILE} here (expected a run folder such as data/nvidia-h200/opt1)")
    run = schema.read_table(run_table(run_dir, "run"), "run").iloc[0]
    if run["status"] != "ok":
        raise CountersError(f"{run_dir}: the run's status is {run['status']!r}; counters need a measured step")
    if not run_table(run_dir, "kernels").is_file():
        raise CountersError(f"{run_dir}: no kernels.parquet (the torch.profiler ranking picks the kernels to count)")
    if changed := mismatch(run):
        raise CountersError(f"{run_dir}: the run does not match {run['config']}'s switches "
                            f"({', '.join(f'{k}={a}' for k, (a, _) in changed.items())}); measure it again with "
                            "`python -m medddpm sweep --force`")
    device = torch.device(device)
    here = gpu_slug(device_name(device)) if device.type != "cuda" or torch.cuda.is_available() else "no CUDA device"
    if here != run["gpu_slug"]:
        raise CountersError(f"{run_dir}: measured on {run['gpu_slug']}, this machine has {here}")
    return run


def add_counters(run_dir: str | Path, *, timeout_s: int = 420, coverage: float = COVERAGE, force: bool = False,
                 passes: tuple[str, ...] = PASSES, merge: bool = False, from_backward: str | None = None,
                 device: torch.device | str = "cuda") -> dict:
    """Profile the run's step with ncu and keep the result if it covers at least as much as the counters
    the run has (any result with `force`); with `merge`, add it to them (with `from_backward`, a pass from a
    layer's backward on: for an eager run whose counters stopped before it; see `medddpm.ncu.ncu_command`). Returns ncu's status, with
    `kept` saying which table stayed."""
    run_dir = Path(run_dir)
    run = check_run(run_dir, device=device)
    kernels = schema.read_table(run_table(run_dir, "kernels"), "kernels")
    old = run_table(run_dir, "ncu")
    old_df = schema.read_table(old, "ncu") if old.is_file() else None
    had = profiled_coverage(kernels, old_df) if old_df is not None else 0.0
    recorded = json.loads(run["profilers"] or "{}")
    merging = merge and old_df is not None
    df, status = run_ncu(kernels_df=kernels, config=run["config"], preset=run["preset"],
                         size=format_size(parse_size(run["shape"])), batch=int(run["batch"]),
                         out_dir=NCU_REPORTS / run["gpu_slug"] / run_dir.name, timeout_s=timeout_s, coverage=coverage,
                         passes=passes, profiled=old_df if merging else None,
                         library_skip=library_launches_done(recorded.get("ncu", {})) if merging and from_backward is None else 0,
                         from_backward=from_backward)
    status |= {"git_commit": git_commit(), "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if merging and status["status"] == "ok":
        df = join_launches([old_df, df])
        status |= {"profiled_coverage": profiled_coverage(kernels, df), "merged": recorded.get("ncu", {})}
        status["message"] += f"; added to the run's {old_df['kernel_id'].nunique()} launches"
    got = status.get("profiled_coverage", 0.0)
    if status["status"] != "ok" or (got < had and not force):
        why = status["message"] if status["status"] != "ok" else f"covers {got:.2%}, the run's counters {had:.2%}"
        return status | {"kept": f"the run's counters ({why})"}
    # ncu.parquet first: a run row that names counters it does not have would be the worse half-state
    schema.write_table(df.assign(run_id=run["run_id"]), old, "ncu")
    row = schema.read_table(run_table(run_dir, "run"), "run")
    row.loc[0, "profilers"] = json.dumps(recorded | {"ncu": status})
    schema.write_table(row, run_table(run_dir, "run"), "run")
    return status | {"kept": f"the new counters ({got:.2%} of the step; the run's covered {had:.2%})"}
